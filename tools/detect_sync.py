#!/usr/bin/env python3
"""Graph-capture sync-violation detector: finds what would break or stall the CUDA-graph decode step (and prefill).

For the embedding, every layer and the head it (1) runs the static decode step under
torch.cuda.set_sync_debug_mode("warn") and records every host sync (.item(), a Python branch on a
tensor value, a synchronous host<->device copy, nonzero/unique, ...) with its module and source line,
(2) captures the piece as a CUDA graph and reports a capture failure with its source line, and (3)
replays the whole decode step and reports any device allocation made between graph replays. Where the engine
prefills through graphs (the fast MoE), it does the same for each layer's two captured prefill pieces and its
eager middle (host syncs only: the middle allocates by design). Exits 1 on any violation. Default model: a random
tiny model with SWA, CSA and HCA layers.
"""

from __future__ import annotations

import argparse
import sys
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dsv4.cli import Parser  # noqa: E402  (argparse errors in one line)


@dataclass
class Violation:
    piece: str  # "embed", "layers.3 (csa)", "head", "step"
    kind: str  # "host sync" | "capture failure" | "device allocation"
    where: str  # file:line function (innermost frame inside the dsv4 package)
    detail: str


def _where(frames) -> str:
    """Innermost frame of this repository's code, but not this tool (else the innermost frame), as
    'path:line in func: code'."""
    pick = None
    for f in frames:
        path = Path(f.filename).resolve()
        if path != Path(__file__).resolve() and ROOT in path.parents:
            pick = f
    pick = pick or (frames[-1] if frames else None)
    if pick is None:
        return "?"
    try:
        rel = Path(pick.filename).resolve().relative_to(ROOT)
    except ValueError:
        rel = pick.filename
    return f"{rel}:{pick.lineno} in {pick.name}: {(pick.line or '').strip()}"


def find_syncs(piece: str, fn) -> list[Violation]:
    """Run fn once with sync debugging on; one Violation per synchronizing call site."""
    import torch

    found: list[Violation] = []
    seen = set()
    old_show = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if "synchroniz" not in text.lower() or "prototype feature" in text:
            return old_show(message, category, filename, lineno, file, line)
        where = _where(traceback.extract_stack()[:-1])
        if where not in seen:
            seen.add(where)
            found.append(Violation(piece, "host sync", where, text.splitlines()[0][:120]))

    torch.cuda.synchronize()  # (the current GPU: the piece's, where a caller runs it under its device)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with torch.no_grad():
                fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = old_show
    return found


def try_capture(piece: str, fn, device) -> list[Violation]:
    import torch

    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.device(device), torch.no_grad(), torch.cuda.graph(g, stream=torch.cuda.Stream(device)):
            fn()
    except Exception as e:  # noqa: BLE001 - every capture failure is a finding
        tb = traceback.extract_tb(e.__traceback__)
        return [Violation(piece, "capture failure", _where(tb), f"{type(e).__name__}: {str(e).splitlines()[0][:120]}")]
    finally:
        torch.cuda.synchronize(device)
    return []


def check(model, max_len: int, steps: int = 8) -> list[Violation]:
    """All violations of `model`'s decode step (state sized for max_len)."""
    import torch

    from dsv4.graphs import DecodeRunner

    from dsv4 import ops

    state = model.new_state(max_len)
    eager = DecodeRunner(model, state, use_graphs=False)
    with ops.fixed_shapes():  # the decode pieces' kernels as the graphs run them (specialized on the shapes)
        eager.step(1, 0)  # warm up (lazy RoPE tables, allocator)
    names = {"embed": "embed", "head": "head"}
    pieces = [("embed", eager.embed_dev, eager._run_embed)]
    for i, (layer, dev) in enumerate(zip(model.layers, eager.devices)):
        names[i] = f"layers.{i} ({layer.spec.attn}, ratio {layer.spec.ratio})"
        pieces.append((i, dev, lambda i=i: eager._run_layer(i)))  # (a two-schedule layer: its closing step)
        if eager.defer_ratio[i]:  # its second schedule: the compressors deferred (dsv4/graphs.py)
            names[(i, "defer")] = f"layers.{i} ({layer.spec.attn}, ratio {layer.spec.ratio}, compressors deferred)"
            pieces.append(((i, "defer"), dev, lambda i=i: eager._run_layer(i, True)))
    pieces.append(("head", eager.head_dev, eager._run_head))
    out: list[Violation] = []
    for key, dev, fn in pieces:
        with ops.fixed_shapes():
            out += find_syncs(names[key], fn)
            out += try_capture(names[key], fn, dev)
    if any(v.kind == "capture failure" for v in out):
        return out
    state.reset()
    runner = DecodeRunner(model, state, use_graphs=True)
    out += find_syncs("step (graph replay loop)", lambda: [runner.step(5) for _ in range(2)])
    # every layer's other schedule too: a step at a position that closes each ratio's windows (dsv4/graphs.py)
    ends = sorted({r - 1 for r in runner.defer_ratio if r and r <= max_len})
    out += find_syncs("step (graph replay loop)", lambda: [runner.step(5, p) for p in ends])
    state.reset()
    devs = list(dict.fromkeys([runner.embed_dev, *runner.devices, runner.head_dev]))

    def allocated() -> int:  # allocations so far on every GPU of the model
        for d in devs:
            torch.cuda.synchronize(d)
        return sum(torch.cuda.memory_stats(d)["allocation.all.allocated"] for d in devs)

    before = allocated()
    for _ in range(steps):
        runner.step(7)
    n = allocated() - before
    if n:
        out.append(Violation("step (graph replay loop)", "device allocation", "dsv4/graphs.py: DecodeRunner.step",
                             f"{n} allocations in {steps} steps"))
    runner = None
    return out + check_prefill(model, state, names)


def check_prefill(model, state, names: dict) -> list[Violation]:
    """The prefill graphs (dsv4/graphs.py PrefillRunner), where the engine uses them (fast MoE, room for two chunks):
    host syncs in each layer's captured pieces (begin, finish) and in its eager middle (attend: a sync there stalls
    every chunk), capture failures, and host syncs in the replay loop."""
    import torch

    from dsv4.engine import PREFILL_CHUNK
    from dsv4.graphs import PrefillRunner, prefill_graphs_apply
    from dsv4.model.layers import StepPlan

    chunk = PREFILL_CHUNK
    room = min(state.max_len, model.max_pos)
    if not prefill_graphs_apply() or 2 * chunk > room:
        return []
    state.reset()
    dev0 = model.embed.weight.device
    ids = torch.randint(0, model.cfg.vocab_size, (1, chunk), generator=torch.Generator().manual_seed(0)).to(dev0)
    out: list[Violation] = []
    x, plans, res = model.embed_streams(ids), {}, {}
    for i, (layer, st) in enumerate(zip(model.layers, state.blocks)):
        dev = layer.attn_norm.weight.device
        if dev not in plans:
            plans[dev] = StepPlan.build(torch.full((1,), chunk, dtype=torch.int64, device=dev), chunk,
                                        model.cfg.sliding_window, None)
            plans[dev].end = 2 * chunk
        plan, x, ids_i = plans[dev], x.to(dev), ids.to(dev)
        rope = model.rope(layer.spec.rope, dev)
        with torch.cuda.device(dev):  # Triton launches on the current device: the layer's (as on_device does)
            out += find_syncs(f"{names[i]} prefill begin",
                              lambda: res.__setitem__("b", layer.begin(x, plan, st, rope, join=True)))
            carry, a = res["b"]
            out += find_syncs(f"{names[i]} prefill middle (eager)",
                              lambda: res.__setitem__("o", layer.attn.attend(a, plan, st)))
            out += find_syncs(f"{names[i]} prefill finish",
                              lambda: res.__setitem__("x", layer.finish(res["o"], carry, ids_i)))
        x = res["x"]
    state.reset()
    try:
        runner = PrefillRunner(model, state, chunk)
    except Exception as e:  # noqa: BLE001 - every capture failure is a finding
        tb = traceback.extract_tb(e.__traceback__)
        return out + [Violation("prefill graphs", "capture failure", _where(tb),
                                f"{type(e).__name__}: {str(e).splitlines()[0][:120]}")]
    finally:
        for d in plans:  # every GPU of the model's layers
            torch.cuda.synchronize(d)
    out += find_syncs("prefill (graph replays + eager middles)",
                      lambda: [runner.run(ids, p) for p in sorted({chunk, room - chunk})])
    state.reset()
    return out


def main(argv=None) -> int:
    p = Parser(description="Report host syncs, capture failures and device allocations "
                           "in the CUDA-graph decode step; exit 1 on any. Needs a CUDA GPU "
                           "(exit 2 without one).")
    p.add_argument("--model", help="checkpoint directory (default: a random tiny SWA/CSA/HCA model)")
    p.add_argument("--device", default="cuda:0",
                   help="cuda device, or a comma list to spread layers (default: cuda:0)")
    p.add_argument("--max-len", type=int, default=512, help="state size in tokens (default: 512)")
    p.add_argument("--numerics", choices=("exact", "reference"), default="reference",
                   help="exact: plain float math; reference: DeepSeek's quantization simulation (default)")
    p.add_argument("--kernels", default=None, metavar="SPEC",
                   help="op backends: ref, fast, or e.g. fast,sparse_attn=ref (default: fast on CUDA)")
    args = p.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("error: detect_sync needs a CUDA device", file=sys.stderr)
        return 2
    from dsv4 import ops

    try:
        backend, overrides = ops.parse_kernels(args.kernels)
        print(ops.banner(ops.configure(backend, "cuda", overrides)), file=sys.stderr)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    devices = [d.strip() for d in args.device.split(",") if d.strip()]
    dtype = torch.bfloat16 if args.numerics == "reference" else torch.float32
    if args.model:
        from dsv4.loader import load_model

        model = load_model(args.model, numerics=args.numerics, dtype=dtype, devices=devices, with_mtp=False)
    else:
        from dsv4.config import ModelConfig
        from dsv4.model.layers import Numerics
        from dsv4.model.transformer import Transformer
        from dsv4.testing import randomize_, tiny_config

        # FP8 projections + MXFP4 experts at a width every fast kernel tiles
        raw = tiny_config([0, 4, 128, 16], hidden=256, head_dim=128, rope_dim=64, index_dim=64, index_topk=4,
                          max_pos=max(1024, args.max_len), expert_dtype="fp4",
                          quantization_config=dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic",
                                                   scale_fmt="ue8m0", weight_block_size=[128, 128]))
        model = randomize_(Transformer(ModelConfig.from_dict(raw), Numerics(args.numerics, dtype)), 0)
        model.place(devices)
    found = check(model, args.max_len)
    for v in found:
        print(f"VIOLATION [{v.kind}] {v.piece}: {v.where} -- {v.detail}")
    from dsv4.graphs import defer_ratios

    n_defer = sum(1 for r in defer_ratios(model) if r)
    n_pieces = len(model.layers) + n_defer + 2
    from dsv4.engine import PREFILL_CHUNK
    from dsv4.graphs import prefill_graphs_apply

    prefill = prefill_graphs_apply() and 2 * PREFILL_CHUNK <= min(args.max_len, model.max_pos)
    extra = f"; prefill: {len(model.layers)} x (2 captured pieces + the eager middle)" if prefill else \
        "; prefill graphs not checked (the engine prefills eagerly with the reference MoE or a state under 2 chunks)"
    print(f"detect_sync: {len(found)} violations in {n_pieces} captured pieces "
          f"({len(model.layers)} layers{f' ({n_defer} in two schedules)' if n_defer else ''} + embed + head){extra} "
          f"on {','.join(devices)}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
