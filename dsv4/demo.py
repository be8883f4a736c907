"""The embedded demo model: a small random-weight DeepSeek-V4 with the real vocabulary.

Owns `DEMO_CONFIG` (every layer kind of Flash at toy width, real 129280-token vocabulary so the real
tokenizer works) and `demo_checkpoint()`, which writes it once, in the official FP8 + MXFP4 format,
into a cache directory and reuses it afterwards. Creation is atomic (temp dir, then rename), so
racing processes are safe. The weights are random: the demo exercises the engine, not the language.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

DEMO_VERSION = 1
DEMO_FORMAT = "fp8"  # official FP8 projections + MXFP4 routed experts
DEMO_SEED = 0
MARKER = ".dsv4-demo.json"

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


def _fingerprint() -> str:
    blob = json.dumps(
        {"v": DEMO_VERSION, "fmt": DEMO_FORMAT, "seed": DEMO_SEED, "cfg": DEMO_CONFIG},
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def _valid(d: Path) -> bool:
    try:
        return json.loads((d / MARKER).read_text()).get("fingerprint") == _fingerprint()
    except (OSError, ValueError, AttributeError):
        return False


def default_cache_dir() -> Path:
    """$DSV4_CACHE, else ~/.cache/dsv4."""
    env = os.environ.get("DSV4_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "dsv4"


def demo_checkpoint(cache_dir: str | Path | None = None) -> Path:
    """Path of the demo checkpoint `<cache_dir>/demo-<version>` (cache_dir defaults to
    `default_cache_dir()`), written on first use (~150 MB, seconds on CPU) and reused while its
    marker file matches the current demo config."""
    from dsv4.writer import write_checkpoint

    base = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = base / f"demo-{DEMO_VERSION}"
    if _valid(final):
        return final
    base.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=base))
    stale = None
    try:
        write_checkpoint(DEMO_CONFIG, tmp / "ckpt", DEMO_FORMAT, seed=DEMO_SEED)
        (tmp / "ckpt" / MARKER).write_text(
            json.dumps({"version": DEMO_VERSION, "fingerprint": _fingerprint()}) + "\n"
        )
        if final.exists() and not _valid(final):  # stale or broken: move it aside, then replace it
            stale = Path(tempfile.mkdtemp(prefix=f".{final.name}.stale-", dir=base))
            try:
                os.rename(final, stale / "old")
            except FileNotFoundError:
                pass  # another process moved it first
        try:
            os.rename(tmp / "ckpt", final)
        except OSError:
            if not _valid(final):  # lost a race to a process that did not finish a valid one
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if stale is not None:
            shutil.rmtree(stale, ignore_errors=True)
    return final


__all__ = ["DEMO_CONFIG", "DEMO_VERSION", "default_cache_dir", "demo_checkpoint"]
