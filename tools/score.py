#!/usr/bin/env python3
"""Score a token sequence: write the next-token logits at every position to a .npy file.

`full` runs one stateless forward over the whole sequence; `incremental` prefills the first N tokens
in chunks of C and then decodes the rest one token at a time. The output is float32 [T, vocab].
Example: python tools/score.py --model DIR --input ids.json --output logits.npy --numerics exact
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsv4.cli import Parser  # noqa: E402  (argparse errors in one line)


def parse_args(argv=None) -> argparse.Namespace:
    p = Parser(
        description="Write next-token logits [T, vocab] (float32 .npy) for a JSON list of token ids. Runs on CPU "
                    "or CUDA. Its defaults are for comparing against transformers and differ from the dsv4 "
                    "command's: --numerics exact (dsv4: reference), --dtype float32 (dsv4: bfloat16), "
                    "--device cpu (dsv4: cuda when present).")
    p.add_argument("--model", required=True, metavar="DIR", help="checkpoint directory (config.json + safetensors)")
    p.add_argument("--input", required=True, metavar="FILE", help="JSON file holding a list of token ids")
    p.add_argument("--output", required=True, metavar="FILE", help="output .npy path")
    p.add_argument("--numerics", choices=("exact", "reference"), default="exact",
                   help="exact: no quantization simulation, transformers' math (default); reference: DeepSeek's")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="activation dtype between ops (default: float32)")
    p.add_argument("--device", default="cpu",
                   help="cpu, cuda, cuda:N or a comma list to spread the layers (default: cpu)")
    p.add_argument("--mode", choices=("full", "incremental"), default="full",
                   help="full: one stateless forward over the whole sequence (default); incremental: chunked "
                        "prefill, then one token at a time")
    p.add_argument("--prefill", type=int, default=None, metavar="N",
                   help="incremental: tokens run as prefill (default: all but the last)")
    p.add_argument("--chunk", type=int, default=128, metavar="C",
                   help="incremental: prefill chunk size, 1..128 (default: 128)")
    return p.parse_args(argv)


def fail(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


def read_ids(path: str) -> list[int]:
    try:
        ids = json.loads(Path(path).read_text())
    except OSError as e:
        fail(f"cannot read --input {path}: {e.strerror or e}")
    except json.JSONDecodeError as e:
        fail(f"--input {path} is not valid JSON: {e}")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        fail(f"--input {path} must hold a non-empty JSON list of integer token ids")
    return ids


def main(argv=None) -> int:
    args = parse_args(argv)
    ids = read_ids(args.input)
    out_dir = Path(args.output).resolve().parent
    if not out_dir.is_dir():  # before the forward pass, not after it
        fail(f"--output {args.output}: folder {out_dir} does not exist")
    T = len(ids)
    prefill = T - 1 if args.prefill is None else args.prefill
    if args.mode == "incremental":
        if not 0 <= prefill <= T:
            fail(f"--prefill must be in [0, {T}] for {T} tokens, got {prefill}")
        if not 1 <= args.chunk <= 128:
            fail(f"--chunk must be in [1, 128], got {args.chunk}")

    import numpy as np
    import torch

    from dsv4.config import ConfigError
    from dsv4.loader import CheckpointError, load_model

    devices = [d.strip() for d in args.device.split(",") if d.strip()]
    if any(d.startswith("cuda") for d in devices) and not torch.cuda.is_available():
        fail(f"--device {args.device}: CUDA is not available on this machine")
    dtype = getattr(torch, args.dtype)
    try:
        t0 = time.perf_counter()
        model = load_model(args.model, numerics=args.numerics, dtype=dtype, devices=devices, with_mtp=False,
                           max_pos=T)
    except (ConfigError, CheckpointError, ValueError, OSError) as e:
        fail(str(e))
    vocab = model.cfg.vocab_size
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        fail(f"--input holds token ids outside [0, {vocab}): {bad[:5]}")

    dev = model.embed.weight.device
    x = torch.tensor([ids], dtype=torch.long, device=dev)
    state = model.new_state(T)
    t1 = time.perf_counter()
    with torch.no_grad():
        if args.mode == "full":
            logits = model(x, state)
        else:
            outs, p = [], 0
            while p < prefill:
                c = min(args.chunk, prefill - p)
                outs.append(model(x[:, p:p + c], state))
                p += c
            while p < T:
                outs.append(model(x[:, p:p + 1], state))
                p += 1
            logits = torch.cat(outs, 1)
    out = logits[0].float().cpu().numpy().astype(np.float32)
    try:
        np.save(args.output, out)
    except OSError as e:
        fail(f"--output {args.output}: {e.strerror or e}")
    print(f"wrote {args.output} [{T}, {vocab}] float32 ({args.mode}, {args.numerics}, {args.dtype}); "
          f"load {t1 - t0:.1f}s, forward {time.perf_counter() - t1:.1f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
