"""Model configuration: a frozen `ModelConfig` parsed from a checkpoint's official `config.json`.

Owns the parsing and validation of every field SPEC.md §1.1 lists, and the derived per-layer schedule
(`LayerSpec`: attention kind and compression ratio, RoPE table, routing kind) for the main layers and
the MTP blocks. Field names follow `config.json`. An inconsistent or unsupported config raises
`ConfigError` with one line that names the field. Nothing here touches tensors.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """An inconsistent or unsupported config.json; the message names the field."""


CSA_RATIO = 4  # the official model overlaps windows and runs the Lightning Indexer exactly when ratio == 4


@dataclass(frozen=True)
class LayerSpec:
    """Derived schedule of one block (main layer or MTP block)."""

    index: int  # 0..num_hidden_layers-1 for main layers, num_hidden_layers+i for MTP block i
    ratio: int  # compress ratio: 0 = sliding window only
    attn: str  # "swa" | "csa" (ratio 4: overlapping windows + indexer) | "hca" (any other ratio > 0)
    rope: str  # "main" (rope_theta, no YaRN) | "compress" (compress_rope_theta + YaRN)
    routing: str  # "hash" (tid2eid lookup) | "score" (top-k of scores + bias)
    is_mtp: bool = False

    @property
    def overlap(self) -> bool:
        return self.attn == "csa"

    @property
    def has_indexer(self) -> bool:
        return self.attn == "csa"


@dataclass(frozen=True)
class YarnConfig:
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class QuantConfig:
    """`quantization_config` (+ `expert_dtype`): which stored format each linear family uses."""

    dense_format: str  # "fp8" for the official FP8 projections
    expert_format: str  # "mxfp4" | "nvfp4" | "fp8"
    fp8_scale_dtype: str  # "e8m0" (ue8m0, official) | "f32" (FP8-expert "Base"-style checkpoints)


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    compress_ratios: tuple[int, ...]
    compress_rope_theta: float
    rope_theta: float
    rope_scaling: YarnConfig | None
    max_position_embeddings: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    num_hash_layers: int
    scoring_func: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    swiglu_limit: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    num_nextn_predict_layers: int
    bos_token_id: int
    eos_token_id: int
    quant: QuantConfig | None  # None: every linear is a plain BF16/F32 tensor
    layers: tuple[LayerSpec, ...] = field(repr=False, default=())
    mtp_layers: tuple[LayerSpec, ...] = field(repr=False, default=())

    # ---- derived sizes ----
    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    @property
    def hc_mix(self) -> int:
        return (2 + self.hc_mult) * self.hc_mult

    @property
    def o_group_in(self) -> int:
        return self.num_attention_heads * self.head_dim // self.o_groups

    def rope_scaling_for(self, rope: str) -> YarnConfig | None:
        return self.rope_scaling if rope == "compress" else None

    def theta_for(self, rope: str) -> float:
        return self.compress_rope_theta if rope == "compress" else self.rope_theta

    def to_dict(self) -> dict[str, Any]:
        """A config.json-style dict (official field names) that `from_dict` parses back identically."""
        d: dict[str, Any] = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4"}
        for f in fields(self):
            if f.name in ("layers", "mtp_layers", "quant", "rope_scaling", "compress_ratios"):
                continue
            d[f.name] = getattr(self, f.name)
        d["compress_ratios"] = list(self.compress_ratios)
        d["num_key_value_heads"] = 1
        d["hidden_act"] = "silu"
        d["topk_method"] = "noaux_tc"
        d["tie_word_embeddings"] = False
        d["torch_dtype"] = "bfloat16"
        if self.rope_scaling is not None:
            y = self.rope_scaling
            d["rope_scaling"] = {
                "type": "yarn",
                "factor": y.factor,
                "original_max_position_embeddings": y.original_max_position_embeddings,
                "beta_fast": y.beta_fast,
                "beta_slow": y.beta_slow,
            }
        if self.quant is not None:
            q = {
                "quant_method": "fp8",
                "fmt": "e4m3",
                "activation_scheme": "dynamic",
                "weight_block_size": [128, 128],
            }
            if self.quant.fp8_scale_dtype == "e8m0":
                q["scale_fmt"] = "ue8m0"
            if self.quant.expert_format == "nvfp4":
                q["moe_quant_algo"] = "NVFP4"
            d["quantization_config"] = q
            d["expert_dtype"] = {"mxfp4": "fp4", "nvfp4": "fp4", "fp8": "fp8"}[self.quant.expert_format]
        return d

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        return _parse(raw)

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            text = path.read_text()
        except OSError as e:
            raise ConfigError(f"cannot read {path}: {e.strerror or e}") from None
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path} must hold a JSON object")
        return _parse(raw)


# --------------------------------------------------------------------------------------------------
# parsing


def _get(raw: dict, name: str, kind: type, default: Any = ..., *, aliases: tuple[str, ...] = ()) -> Any:
    for key in (name, *aliases):
        if key in raw and raw[key] is not None:
            value = raw[key]
            break
    else:
        if default is ...:
            raise ConfigError(f"config.json: missing required field '{name}'")
        return default
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
            raise ConfigError(f"config.json: '{name}' must be an integer, got {value!r}")
        return int(value)
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"config.json: '{name}' must be a number, got {value!r}")
        return float(value)
    if kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"config.json: '{name}' must be true or false, got {value!r}")
        return value
    if kind is str:
        if not isinstance(value, str):
            raise ConfigError(f"config.json: '{name}' must be a string, got {value!r}")
        return value
    return value


def _require(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"config.json: '{name}' {msg}")


def _parse_yarn(raw: dict) -> YarnConfig | None:
    rs = raw.get("rope_scaling")
    if rs is None:
        return None
    _require(isinstance(rs, dict), "rope_scaling", f"must be an object or null, got {rs!r}")
    kind = rs.get("type", rs.get("rope_type"))
    _require(kind == "yarn", "rope_scaling", f"type {kind!r} is not supported (only 'yarn')")
    for key in ("factor", "original_max_position_embeddings"):
        _require(key in rs, "rope_scaling", f"is missing '{key}'")
    y = YarnConfig(
        factor=_get(rs, "factor", float),
        original_max_position_embeddings=_get(rs, "original_max_position_embeddings", int),
        beta_fast=_get(rs, "beta_fast", float, 32.0),
        beta_slow=_get(rs, "beta_slow", float, 1.0),
    )
    _require(y.factor >= 1.0, "rope_scaling", f"factor must be >= 1, got {y.factor}")
    _require(y.original_max_position_embeddings > 0, "rope_scaling", "original_max_position_embeddings must be > 0")
    _require(y.beta_fast > y.beta_slow > 0, "rope_scaling", "needs beta_fast > beta_slow > 0")
    for key in ("mscale", "mscale_all_dim"):
        _require(not rs.get(key), "rope_scaling", f"'{key}' is not supported: DeepSeek-V4 applies no YaRN mscale")
    return y


def _parse_quant(raw: dict) -> QuantConfig | None:
    q = raw.get("quantization_config")
    if q is None:
        return None
    _require(isinstance(q, dict), "quantization_config", "must be an object")
    method = q.get("quant_method")
    _require(method == "fp8", "quantization_config", f"quant_method {method!r} is not supported (only 'fp8')")
    fmt = q.get("fmt", "e4m3")
    _require(fmt == "e4m3", "quantization_config", f"fmt {fmt!r} is not supported (only 'e4m3')")
    block = q.get("weight_block_size", [128, 128])
    _require(list(block) == [128, 128], "quantization_config", f"weight_block_size {block} is not supported (only [128, 128])")
    scale_fmt = q.get("scale_fmt")
    _require(scale_fmt in (None, "ue8m0"), "quantization_config", f"scale_fmt {scale_fmt!r} is not supported")
    scale_dtype = "e8m0" if scale_fmt == "ue8m0" else "f32"
    algo = q.get("moe_quant_algo")
    expert_dtype = raw.get("expert_dtype", q.get("expert_dtype"))
    if algo is not None:
        _require(str(algo).upper() == "NVFP4", "quantization_config", f"moe_quant_algo {algo!r} is not supported (only 'NVFP4')")
        expert = "nvfp4"
    elif expert_dtype in ("fp4", "mxfp4"):
        expert = "mxfp4"
    elif expert_dtype in (None, "fp8"):
        expert = "fp8"
    else:
        raise ConfigError(f"config.json: 'expert_dtype' {expert_dtype!r} is not supported (fp4 or fp8)")
    return QuantConfig(dense_format="fp8", expert_format=expert, fp8_scale_dtype=scale_dtype)


def _layer_spec(index: int, ratio: int, hash_layer: bool, is_mtp: bool) -> LayerSpec:
    if ratio == 0:
        attn = "swa"
    elif ratio == CSA_RATIO:
        attn = "csa"
    else:
        attn = "hca"
    return LayerSpec(
        index=index,
        ratio=ratio,
        attn=attn,
        rope="main" if ratio == 0 else "compress",
        routing="hash" if hash_layer else "score",
        is_mtp=is_mtp,
    )


def _parse(raw: dict[str, Any]) -> ModelConfig:
    mt = raw.get("model_type", "deepseek_v4")
    _require(mt == "deepseek_v4", "model_type", f"is {mt!r}; this engine runs DeepSeek-V4 ('deepseek_v4') only")
    dspark = sorted(k for k in raw if k.startswith("dspark_"))
    if dspark:
        raise ConfigError(
            f"config.json: '{dspark[0]}' (DeepSeek-V4-Flash-0731 DSpark layers) is not supported by this engine"
        )
    n_layers = _get(raw, "num_hidden_layers", int)
    n_mtp = _get(raw, "num_nextn_predict_layers", int, 0)
    _require(n_layers >= 1, "num_hidden_layers", "must be >= 1")
    _require(n_mtp >= 0, "num_nextn_predict_layers", "must be >= 0")

    ratios_raw = raw.get("compress_ratios")
    _require(isinstance(ratios_raw, list), "compress_ratios", "must be a list of per-layer integers")
    _require(
        len(ratios_raw) == n_layers + n_mtp,
        "compress_ratios",
        f"has {len(ratios_raw)} entries; expected num_hidden_layers + num_nextn_predict_layers = {n_layers + n_mtp}",
    )
    ratios = []
    for i, r in enumerate(ratios_raw):
        _require(isinstance(r, int) and not isinstance(r, bool) and r >= 0, "compress_ratios", f"entry {i} must be an integer >= 0, got {r!r}")
        ratios.append(r)

    n_kv = _get(raw, "num_key_value_heads", int, 1)
    _require(n_kv == 1, "num_key_value_heads", f"must be 1 (one shared latent KV head), got {n_kv}")
    act = _get(raw, "hidden_act", str, "silu")
    _require(act == "silu", "hidden_act", f"{act!r} is not supported (only 'silu')")
    topk_method = _get(raw, "topk_method", str, "noaux_tc")
    _require(topk_method == "noaux_tc", "topk_method", f"{topk_method!r} is not supported (only 'noaux_tc')")
    _require(not raw.get("tie_word_embeddings", False), "tie_word_embeddings", "must be false (DeepSeek-V4 has a separate head)")
    _require(not raw.get("attention_bias", False), "attention_bias", "must be false")
    n_shared = _get(raw, "n_shared_experts", int, 1)
    _require(n_shared == 1, "n_shared_experts", f"must be 1, got {n_shared}")

    eos = raw.get("eos_token_id", 1)
    if isinstance(eos, list):
        _require(len(eos) >= 1, "eos_token_id", "must not be empty")
        eos = eos[0]

    n_hash = _get(raw, "num_hash_layers", int, 0)
    _require(0 <= n_hash <= n_layers, "num_hash_layers", f"must be in [0, num_hidden_layers], got {n_hash}")
    layers = tuple(_layer_spec(i, ratios[i], i < n_hash, False) for i in range(n_layers))
    mtp = tuple(_layer_spec(n_layers + i, ratios[n_layers + i], False, True) for i in range(n_mtp))

    cfg = ModelConfig(
        vocab_size=_get(raw, "vocab_size", int),
        hidden_size=_get(raw, "hidden_size", int),
        num_hidden_layers=n_layers,
        num_attention_heads=_get(raw, "num_attention_heads", int),
        head_dim=_get(raw, "head_dim", int),
        qk_rope_head_dim=_get(raw, "qk_rope_head_dim", int, 64),
        q_lora_rank=_get(raw, "q_lora_rank", int),
        o_groups=_get(raw, "o_groups", int),
        o_lora_rank=_get(raw, "o_lora_rank", int),
        sliding_window=_get(raw, "sliding_window", int),
        compress_ratios=tuple(ratios),
        compress_rope_theta=_get(raw, "compress_rope_theta", float, 160000.0),
        rope_theta=_get(raw, "rope_theta", float, 10000.0),
        rope_scaling=_parse_yarn(raw),
        max_position_embeddings=_get(raw, "max_position_embeddings", int),
        index_n_heads=_get(raw, "index_n_heads", int, 64),
        index_head_dim=_get(raw, "index_head_dim", int, 128),
        index_topk=_get(raw, "index_topk", int, 512),
        n_routed_experts=_get(raw, "n_routed_experts", int),
        n_shared_experts=n_shared,
        num_experts_per_tok=_get(raw, "num_experts_per_tok", int),
        moe_intermediate_size=_get(raw, "moe_intermediate_size", int),
        num_hash_layers=n_hash,
        scoring_func=_get(raw, "scoring_func", str, "sqrtsoftplus"),
        norm_topk_prob=_get(raw, "norm_topk_prob", bool, True),
        routed_scaling_factor=_get(raw, "routed_scaling_factor", float, 1.0),
        swiglu_limit=_get(raw, "swiglu_limit", float, 0.0),
        hc_mult=_get(raw, "hc_mult", int, 4),
        hc_sinkhorn_iters=_get(raw, "hc_sinkhorn_iters", int, 20),
        hc_eps=_get(raw, "hc_eps", float, 1e-6),
        rms_norm_eps=_get(raw, "rms_norm_eps", float, 1e-6),
        num_nextn_predict_layers=n_mtp,
        bos_token_id=_get(raw, "bos_token_id", int, 0),
        eos_token_id=int(eos),
        quant=_parse_quant(raw),
        layers=layers,
        mtp_layers=mtp,
    )
    _validate(cfg)
    return cfg


def _validate(c: ModelConfig) -> None:
    for name in (
        "vocab_size", "hidden_size", "num_attention_heads", "head_dim", "q_lora_rank", "o_groups",
        "o_lora_rank", "sliding_window", "max_position_embeddings", "n_routed_experts",
        "num_experts_per_tok", "moe_intermediate_size", "hc_mult", "hc_sinkhorn_iters",
    ):
        _require(getattr(c, name) >= 1, name, f"must be >= 1, got {getattr(c, name)}")
    _require(
        0 < c.qk_rope_head_dim <= c.head_dim and c.qk_rope_head_dim % 2 == 0,
        "qk_rope_head_dim",
        f"must be even and in (0, head_dim={c.head_dim}], got {c.qk_rope_head_dim}",
    )
    _require(
        (c.num_attention_heads * c.head_dim) % c.o_groups == 0,
        "o_groups",
        f"must divide num_attention_heads * head_dim = {c.num_attention_heads * c.head_dim}",
    )
    _require(
        c.num_experts_per_tok <= c.n_routed_experts,
        "num_experts_per_tok",
        f"({c.num_experts_per_tok}) must not exceed n_routed_experts ({c.n_routed_experts})",
    )
    _require(
        c.scoring_func in ("sqrtsoftplus", "sigmoid", "softmax"),
        "scoring_func",
        f"{c.scoring_func!r} is not supported (sqrtsoftplus, sigmoid or softmax)",
    )
    _require(c.routed_scaling_factor > 0, "routed_scaling_factor", "must be > 0")
    _require(c.swiglu_limit >= 0, "swiglu_limit", "must be >= 0 (0 disables the clamp)")
    _require(c.hc_eps > 0 and c.rms_norm_eps > 0, "hc_eps", "and rms_norm_eps must be > 0")
    if any(s.attn == "csa" for s in c.layers + c.mtp_layers):
        for name in ("index_n_heads", "index_head_dim", "index_topk"):
            _require(getattr(c, name) >= 1, name, f"must be >= 1, got {getattr(c, name)}")
        d = c.index_head_dim
        _require(d & (d - 1) == 0, "index_head_dim", f"must be a power of two (Hadamard rotation), got {d}")
        _require(d >= c.qk_rope_head_dim, "index_head_dim", f"must be >= qk_rope_head_dim ({c.qk_rope_head_dim})")
    if c.rope_scaling is not None:
        _require(
            c.rope_scaling.original_max_position_embeddings <= c.max_position_embeddings,
            "rope_scaling",
            "original_max_position_embeddings must not exceed max_position_embeddings",
        )
    _require(0 <= c.bos_token_id < c.vocab_size, "bos_token_id", f"must be a token id < vocab_size, got {c.bos_token_id}")
    _require(0 <= c.eos_token_id < c.vocab_size, "eos_token_id", f"must be a token id < vocab_size, got {c.eos_token_id}")
