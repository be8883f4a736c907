"""The embedded demo model: a small random-weight DeepSeek-V4 with the real vocabulary.

Owns `DEMO_CONFIG` (every layer kind of Flash at toy width, real 129280-token vocabulary so the real
tokenizer works) and `demo_checkpoint()`, which writes it once, in the official FP8 + MXFP4 format,
into a cache directory (`$DSV4_CACHE`, default ~/.cache/dsv4) and reuses it afterwards. The marker
file records every file's size and SHA-256; a cached checkpoint that no longer verifies (truncated,
overwritten, stale) is rebuilt. Creation is atomic (temp dir, then rename), so racing processes are
safe. A cache that cannot hold it (read-only, full, not a directory) is a `DemoCacheError` that
says where the cache is, how much space it needs and how to choose another. The weights are random:
the demo exercises the engine, not the language.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

DEMO_VERSION = 1
DEMO_FORMAT = "fp8"  # official FP8 projections + MXFP4 routed experts
DEMO_SEED = 0
MARKER = ".dsv4-demo.json"
CACHE_ENV = "DSV4_CACHE"

# SWA, CSA (ratio 4, indexer), HCA (ratio 16: emits every 16 tokens), 2 hash layers then score
# routing, one MTP block; YaRN as Flash. Every linear's K is a multiple of 128 (FP8 1x128
# activation blocks of the reference numerics; MXFP4 needs 32).
# fmt: off
DEMO_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
    "vocab_size": 129280, "bos_token_id": 0, "eos_token_id": 1,
    "hidden_size": 256, "num_hidden_layers": 5, "num_attention_heads": 4, "num_key_value_heads": 1,
    "head_dim": 128, "qk_rope_head_dim": 64, "q_lora_rank": 128, "o_groups": 2, "o_lora_rank": 128,
    "sliding_window": 64, "compress_ratios": [0, 4, 16, 4, 16, 0],
    "compress_rope_theta": 160000, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 4096,
                     "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 65536,
    "index_n_heads": 8, "index_head_dim": 64, "index_topk": 64,
    "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
    "moe_intermediate_size": 256, "num_hash_layers": 2, "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True, "routed_scaling_factor": 1.5, "swiglu_limit": 10.0,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6,
    "num_nextn_predict_layers": 1, "hidden_act": "silu", "topk_method": "noaux_tc",
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
# fmt: on


class DemoCacheError(OSError):
    """The demo cache cannot hold the demo checkpoint; the message is one line for the user."""


def _fingerprint() -> str:
    blob = json.dumps(
        {"v": DEMO_VERSION, "fmt": DEMO_FORMAT, "seed": DEMO_SEED, "cfg": DEMO_CONFIG},
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def _sha256(file: Path) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _manifest(d: Path) -> dict[str, dict[str, Any]]:
    """Size and SHA-256 of every file of a checkpoint directory (the marker excluded)."""
    return {
        f.name: {"size": f.stat().st_size, "sha256": _sha256(f)}
        for f in sorted(d.iterdir())
        if f.is_file() and f.name != MARKER
    }


def verify_demo(d: str | Path) -> str | None:
    """None if `d` holds the current demo checkpoint intact, else why not (one phrase)."""
    d = Path(d)
    if not d.is_dir():
        return "it does not exist"
    try:
        marker = json.loads((d / MARKER).read_text())
        files = marker["files"]
        if marker.get("fingerprint") != _fingerprint() or not isinstance(files, dict) or not files:
            raise ValueError
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return "it was written by another dsv4 version or not completed"
    for name, rec in files.items():
        f = d / name
        try:
            size = f.stat().st_size
        except OSError:
            return f"{name} is missing"
        if size != rec.get("size"):
            return f"{name} has {size} bytes, {rec.get('size')} were written"
    for name, rec in files.items():  # sizes first: they are free, the hashes read ~150 MB
        try:
            if _sha256(d / name) != rec.get("sha256"):
                return f"{name} does not match the SHA-256 recorded when it was written"
        except OSError as e:
            return f"{name} is unreadable ({e.strerror or e})"
    return None


def _valid(d: Path) -> bool:
    return verify_demo(d) is None


def default_cache_dir() -> Path:
    """$DSV4_CACHE, else ~/.cache/dsv4."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dsv4"


def demo_bytes() -> int:
    """Bytes the demo checkpoint takes on disk (tensor data + tokenizer, headers rounded up)."""
    from dsv4.checkpoint import expected_tensors
    from dsv4.config import ModelConfig
    from dsv4.writer import TOKENIZER_FILES, _tokenizer_dir, checkpoint_config

    cfg = ModelConfig.from_dict(checkpoint_config(DEMO_CONFIG, DEMO_FORMAT))
    data = sum(math.prod(s.shape) * s.dtypes[0].itemsize for s in expected_tensors(cfg).values())
    try:
        tok = sum((_tokenizer_dir(None) / f).stat().st_size for f in TOKENIZER_FILES)
    except (OSError, ValueError):
        tok = 8 * 2**20
    return data + tok + 2**20  # + headers, index and configs


def _cache_error(base: Path, problem: str, full: bool = False) -> DemoCacheError:
    src = f" (${CACHE_ENV})" if os.environ.get(CACHE_ENV) and base == default_cache_dir() else ""
    fix = "free some space there or set" if full else "set"
    return DemoCacheError(
        f"demo cache {base}{src}: {problem}. The built-in demo model (random weights) is written there "
        f"once and needs {demo_bytes() / 1e6:.0f} MB: {fix} {CACHE_ENV} to another directory"
    )


def _os_error(base: Path, e: OSError) -> DemoCacheError:
    if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return _cache_error(base, f"not writable ({e.strerror.lower()})")
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        free = shutil.disk_usage(base).free if base.is_dir() else 0
        return _cache_error(base, f"no space left on the device ({free / 1e6:.0f} MB free)", full=True)
    if e.errno in (errno.ENOTDIR, errno.EEXIST):
        return _cache_error(base, "not a directory (a file is in the way)")
    return _cache_error(base, f"cannot write there ({e.strerror or e})")


def demo_checkpoint(
    cache_dir: str | Path | None = None, on_build: Callable[[Path, str | None], None] | None = None
) -> Path:
    """Path of the demo checkpoint `<cache_dir>/demo-<version>` (cache_dir defaults to
    `default_cache_dir()`), written on first use (~150 MB, seconds on CPU) and reused while it
    verifies (`verify_demo`: marker, sizes, SHA-256). `on_build(path, reason)` is called before it
    is (re)written: reason None the first time, else why the cached one was rejected. Raises
    DemoCacheError when the cache cannot hold it."""
    base = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = base / f"demo-{DEMO_VERSION}"
    reason = verify_demo(final)
    if reason is None:
        return final
    if base.exists() and not base.is_dir():
        raise _cache_error(base, "a file, not a directory")
    if on_build is not None:
        on_build(final, None if not final.exists() else reason)
    try:
        base.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(base).free
        need = demo_bytes()
        if free < need:
            raise _cache_error(base, f"only {free / 1e6:.0f} MB free", full=True)
        _build(base, final)
    except DemoCacheError:
        raise
    except OSError as e:
        raise _os_error(base, e) from e
    return final


def _build(base: Path, final: Path) -> None:
    from dsv4.writer import write_checkpoint

    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=base))
    stale = None
    try:
        ckpt = tmp / "ckpt"
        write_checkpoint(DEMO_CONFIG, ckpt, DEMO_FORMAT, seed=DEMO_SEED)
        marker = {"version": DEMO_VERSION, "fingerprint": _fingerprint(), "files": _manifest(ckpt)}
        (ckpt / MARKER).write_text(json.dumps(marker, indent=1) + "\n")
        if final.exists() and not _valid(final):  # stale or broken: move it aside, then replace it
            stale = Path(tempfile.mkdtemp(prefix=f".{final.name}.stale-", dir=base))
            try:
                os.rename(final, stale / "old")
            except FileNotFoundError:
                pass  # another process moved it first
        try:
            os.rename(ckpt, final)
        except OSError:
            if not _valid(final):  # lost a race to a process that did not finish a valid one
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if stale is not None:
            shutil.rmtree(stale, ignore_errors=True)


__all__ = [
    "DEMO_CONFIG",
    "DEMO_VERSION",
    "DemoCacheError",
    "default_cache_dir",
    "demo_bytes",
    "demo_checkpoint",
    "verify_demo",
]
