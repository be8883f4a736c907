"""Explicit weight containers for the checkpoint's storage formats (SPEC 3.2, 3.3, 3.5).

Owns the four formats of a linear weight: plain (`dense`), FP8 e4m3 with 128x128 block scales
(`fp8`), MXFP4 e2m1 with 1x32 E8M0 scales (`mxfp4`) and ModelOpt NVFP4 with 1x16 e4m3 scales
plus fp32 globals (`nvfp4`). Each container holds the stored tensors under their official
suffixes, validates them against `layout()`, and gives the reference `dequantize`/`matmul_ref`
read from the real packed bytes. It does not own name mapping or file IO (the loader does).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, fields
from typing import ClassVar

import torch
import torch.nn.functional as F

from dsv4.ops.act_quant import (
    FP8_AMAX_FLOOR,
    FP8_MAX,
    FP8_MAX_INV,
    act_quant_sim_ref,
    ue8m0_ceil_ref,
)
from dsv4.ops.fp4_quant import (
    FP4_AMAX_FLOOR,
    FP4_MAX,
    FP4_MAX_INV,
    e2m1_encode_ref,
    e2m1_lut,
)

Layout = dict[str, tuple[tuple[int, ...], torch.dtype]]  # suffix -> (shape, dtype)

ACT_BLOCK = 128  # the reference's FP8 activation block (1 x 128 along K) before FP8/FP4 GEMMs


# ----------------------------------------------------------------------------------------------
# E8M0 <-> fp32, bit exact. E8M0 byte b encodes 2^(b-127); b = 255 is NaN. Work on the bytes:
# numeric float <-> e8m0 casts round (and some stacks zero them), bytes never do.


def e8m0_to_float(t: torch.Tensor) -> torch.Tensor:
    """float8_e8m0fnu (or its uint8 byte view), any shape -> fp32 2^(byte-127), same shape."""
    if t.dtype not in (torch.float8_e8m0fnu, torch.uint8):
        raise ValueError(f"e8m0_to_float: expected float8_e8m0fnu or uint8, got {t.dtype}")
    b = t.contiguous().view(torch.uint8).to(torch.int32)
    bits = torch.where(b == 0, 0x00400000, b << 23)  # byte 0 = 2^-127, an fp32 subnormal
    bits = torch.where(b == 255, 0x7FC00000, bits)  # NaN
    return bits.view(torch.float32)


def float_to_e8m0(t: torch.Tensor) -> torch.Tensor:
    """fp32 exact powers of two in [2^-127, 2^127], any shape -> float8_e8m0fnu, same shape.

    Raises ValueError for anything else (no rounding: a scale that is not a power of two is a bug
    upstream)."""
    if t.dtype != torch.float32:
        raise ValueError(f"float_to_e8m0: expected float32, got {t.dtype}")
    bits = t.contiguous().view(torch.int32)
    exp = (bits >> 23) & 0xFF
    sub = bits == 0x00400000  # 2^-127
    ok = ((bits >= 0) & ((bits & 0x7FFFFF) == 0) & (exp != 0) & (exp != 0xFF)) | sub
    if not bool(ok.all()):
        bad = t[~ok].flatten()[:4].tolist()
        raise ValueError(
            f"float_to_e8m0: values must be powers of two in [2^-127, 2^127], got {bad}"
        )
    return torch.where(sub, 0, exp).to(torch.uint8).view(torch.float8_e8m0fnu)


# ----------------------------------------------------------------------------------------------
# Helpers.


def _expand(s: torch.Tensor, rows: int, cols: int, n: int, k: int) -> torch.Tensor:
    """Block scales s [ceil(n/rows), ceil(k/cols)] -> per element [n, k]."""
    return s.repeat_interleave(rows, 0).repeat_interleave(cols, 1)[:n, :k]


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """codes [n, k] uint8 in 0..15 -> [n, k/2] uint8, low nibble = even element."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[n, k/2] bytes (any 1-byte dtype) -> codes [n, k] uint8, even element from low nibble."""
    b = packed.view(torch.uint8)
    return torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)


def _e2m1_decode(packed: torch.Tensor) -> torch.Tensor:
    """[n, k/2] packed e2m1 -> fp32 [n, k] grid values (LUT lookup, so -0 stays -0)."""
    return e2m1_lut(packed.device)[_unpack_nibbles(packed).long()]


def _check(cls_name: str, tensors: dict[str, torch.Tensor], layout: Layout) -> None:
    for name, (shape, dtype) in layout.items():
        t = tensors[name]
        if t.dtype != dtype:
            raise ValueError(f"{cls_name}.{name}: dtype {t.dtype}, expected {dtype}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{cls_name}.{name}: shape {tuple(t.shape)}, expected {shape}")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# ----------------------------------------------------------------------------------------------
# Containers. Fields are the stored tensors, named by their checkpoint suffix.


@dataclass(frozen=True, eq=False, repr=False)
class LinearWeight(ABC):
    """A linear layer's weight in one storage format. Subclasses declare the stored tensors as
    dataclass fields named by checkpoint suffix and provide layout/quantize/_infer/_dequantize."""

    FORMAT: ClassVar[str]

    def __post_init__(self) -> None:
        for name, t in self.tensors().items():
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{type(self).__name__}.{name}: expected a tensor, got {type(t)}")
        if self.weight.dim() != 2:  # every format has a 2-D `weight`; the rest follows layout()
            got = tuple(self.weight.shape)
            raise ValueError(f"{type(self).__name__}.weight: expected a 2-D tensor, got {got}")
        n, k, opts = self._infer()
        _check(type(self).__name__, self.tensors(), self.layout(n, k, **opts))

    @abstractmethod
    def _infer(self) -> tuple[int, int, dict]:
        """(N, K, layout options) implied by the stored tensors."""

    @property
    def shape(self) -> tuple[int, int]:
        """Logical [N, K] (out_features, in_features)."""
        n, k, _ = self._infer()
        return n, k

    def tensors(self) -> dict[str, torch.Tensor]:
        """Suffix -> stored tensor, e.g. {"weight": ..., "scale": ...}."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_tensors(cls, d: dict[str, torch.Tensor]) -> LinearWeight:
        """Build from suffix -> tensor; exact key set required, dtypes/shapes validated."""
        names = {f.name for f in fields(cls)}
        missing, extra = sorted(names - d.keys()), sorted(d.keys() - names)
        if missing or extra:
            raise ValueError(f"{cls.__name__}.from_tensors: missing {missing}, unexpected {extra}")
        return cls(**{name: d[name] for name in names})

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Reference dequantization from the stored bytes -> [N, K] in dtype."""
        return self._dequantize_f32().to(dtype)

    @abstractmethod
    def _dequantize_f32(self) -> torch.Tensor:
        """[N, K] fp32 from the stored tensors."""

    def matmul_ref(self, x: torch.Tensor, act_quant: bool) -> torch.Tensor:
        """x [..., K] -> x @ W^T [..., N] in x.dtype; fp32 GEMM on the dequantized weight.

        act_quant=True first FP8-simulates x in 1 x 128 blocks (the reference W8A8 / W4A8
        numerics of FP8, MXFP4 and, for parity, NVFP4 weights); use False for BF16 linears."""
        n, k = self.shape
        if x.shape[-1] != k:
            raise ValueError(f"{type(self).__name__}.matmul_ref: x {tuple(x.shape)} vs K={k}")
        xf = act_quant_sim_ref(x, ACT_BLOCK, out_dtype=torch.float32) if act_quant else x.float()
        return (xf @ self._dequantize_f32().T).to(x.dtype)

    def __repr__(self) -> str:
        ts = ", ".join(f"{k}={str(v.dtype)[6:]}{list(v.shape)}" for k, v in self.tensors().items())
        return f"{type(self).__name__}(shape={list(self.shape)}, {ts})"


@dataclass(frozen=True, eq=False, repr=False)
class DenseWeight(LinearWeight):
    """Plain BF16/F16/F32 weight [N, K]."""

    weight: torch.Tensor
    FORMAT: ClassVar[str] = "dense"
    DTYPES: ClassVar[tuple[torch.dtype, ...]] = (torch.bfloat16, torch.float16, torch.float32)

    def _infer(self):
        return *self.weight.shape, {"dtype": self.weight.dtype}

    @staticmethod
    def layout(n: int, k: int, dtype: torch.dtype = torch.bfloat16) -> Layout:
        if dtype not in DenseWeight.DTYPES:
            raise ValueError(
                f"DenseWeight.weight: dtype {dtype}, expected one of {DenseWeight.DTYPES}"
            )
        return {"weight": ((n, k), dtype)}

    def _dequantize_f32(self) -> torch.Tensor:
        return self.weight.float()

    @classmethod
    def quantize(cls, w: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> DenseWeight:
        """Float weight [N, K] -> stored in dtype (RNE cast)."""
        return cls(w.to(dtype).contiguous())


@dataclass(frozen=True, eq=False, repr=False)
class Fp8BlockWeight(LinearWeight):
    """FP8 e4m3 weight [N, K] with one scale per 128 x 128 block, E8M0 (official) or fp32.

    W[n, k] = float(weight[n, k]) * scale[n // 128, k // 128]."""

    weight: torch.Tensor  # [N, K] float8_e4m3fn
    scale: torch.Tensor  # [ceil(N/128), ceil(K/128)] float8_e8m0fnu | float32
    FORMAT: ClassVar[str] = "fp8"
    BLOCK: ClassVar[int] = 128
    SCALE_DTYPES: ClassVar[dict[str, torch.dtype]] = {
        "e8m0": torch.float8_e8m0fnu,
        "f32": torch.float32,
    }

    def _infer(self):
        by_dtype = {v: k for k, v in self.SCALE_DTYPES.items()}
        if self.scale.dtype not in by_dtype:
            raise ValueError(
                f"Fp8BlockWeight.scale: dtype {self.scale.dtype}, expected {tuple(by_dtype)}"
            )
        return *self.weight.shape, {"scale_dtype": by_dtype[self.scale.dtype]}

    @staticmethod
    def layout(n: int, k: int, scale_dtype: str = "e8m0") -> Layout:
        if scale_dtype not in Fp8BlockWeight.SCALE_DTYPES:
            raise ValueError(
                f"Fp8BlockWeight: scale_dtype {scale_dtype!r}, expected 'e8m0' or 'f32'"
            )
        b = Fp8BlockWeight.BLOCK
        return {
            "weight": ((n, k), torch.float8_e4m3fn),
            "scale": ((_ceil_div(n, b), _ceil_div(k, b)), Fp8BlockWeight.SCALE_DTYPES[scale_dtype]),
        }

    def _scale_f32(self) -> torch.Tensor:
        s = self.scale
        return e8m0_to_float(s) if s.dtype == torch.float8_e8m0fnu else s

    def _dequantize_f32(self) -> torch.Tensor:
        n, k = self.shape
        return self.weight.float() * _expand(self._scale_f32(), self.BLOCK, self.BLOCK, n, k)

    @classmethod
    def quantize(cls, w: torch.Tensor, scale_dtype: str = "e8m0") -> Fp8BlockWeight:
        """Float [N, K] -> per 128x128 block s = 2^ceil(log2(max(amax, 1e-4) * fp32(1/448))),
        weight = e4m3_RNE(clamp(w / s, +-448)). The f32 option stores the same power of two."""
        cls.layout(*w.shape, scale_dtype=scale_dtype)  # validates the option
        n, k = w.shape
        b = cls.BLOCK
        wf = w.float()
        blocks = F.pad(wf, (0, -k % b, 0, -n % b)).unflatten(1, (-1, b)).unflatten(0, (-1, b))
        amax = blocks.abs().amax((1, 3)).clamp_min(FP8_AMAX_FLOOR)  # [ceil(N/b), ceil(K/b)]
        s = ue8m0_ceil_ref(amax * FP8_MAX_INV)
        q = (wf / _expand(s, b, b, n, k)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return cls(q, float_to_e8m0(s) if scale_dtype == "e8m0" else s)


@dataclass(frozen=True, eq=False, repr=False)
class Mxfp4Weight(LinearWeight):
    """Official FP4 expert weight: packed e2m1, one E8M0 scale per 1 x 32 block along K.

    W[n, k] = E2M1_LUT[nibble(n, k)] * 2^(scale_byte[n, k // 32] - 127); byte weight[n, j] holds
    element 2j in its LOW nibble and 2j+1 in its high nibble."""

    weight: torch.Tensor  # [N, K/2] int8 (bytes; read as uint8)
    scale: torch.Tensor  # [N, K/32] float8_e8m0fnu
    FORMAT: ClassVar[str] = "mxfp4"
    BLOCK: ClassVar[int] = 32

    def _infer(self):
        return self.weight.shape[0], 2 * self.weight.shape[1], {}

    @staticmethod
    def layout(n: int, k: int) -> Layout:
        if k % Mxfp4Weight.BLOCK:
            raise ValueError(f"Mxfp4Weight: K={k} must be a multiple of {Mxfp4Weight.BLOCK}")
        return {
            "weight": ((n, k // 2), torch.int8),
            "scale": ((n, k // Mxfp4Weight.BLOCK), torch.float8_e8m0fnu),
        }

    def _dequantize_f32(self) -> torch.Tensor:
        s = e8m0_to_float(self.scale).repeat_interleave(self.BLOCK, 1)  # [N, K]
        return _e2m1_decode(self.weight) * s

    @classmethod
    def quantize(cls, w: torch.Tensor) -> Mxfp4Weight:
        """Float [N, K] -> per 1x32 block s = 2^ceil(log2(max(amax, 6*2^-126) * fp32(1/6))),
        nibble = e2m1_RNE(clamp(w / s, +-6)), packed low nibble = even element."""
        n, k = w.shape
        cls.layout(n, k)
        wb = w.float().unflatten(1, (k // cls.BLOCK, cls.BLOCK))  # [N, K/32, 32]
        amax = wb.abs().amax(-1).clamp_min(FP4_AMAX_FLOOR)  # [N, K/32]
        s = ue8m0_ceil_ref(amax * FP4_MAX_INV)
        codes = e2m1_encode_ref((wb / s.unsqueeze(-1)).clamp(-FP4_MAX, FP4_MAX)).flatten(1)
        return cls(_pack_nibbles(codes).view(torch.int8), float_to_e8m0(s))


@dataclass(frozen=True, eq=False, repr=False)
class Nvfp4Weight(LinearWeight):
    """ModelOpt NVFP4 routed-expert weight: packed e2m1, e4m3 scale per 1 x 16 block, fp32 globals.

    W[n, k] = E2M1_LUT[nibble(n, k)] * float(weight_scale[n, k // 16]) * weight_scale_2 (low nibble
    = even element). input_scale belongs to the W4A4 kernels only; the reference numerics
    (matmul_ref) keep the FP8 1x128 activation simulation and ignore it (SPEC 3.5)."""

    weight: torch.Tensor  # [N, K/2] uint8
    weight_scale: torch.Tensor  # [N, K/16] float8_e4m3fn
    weight_scale_2: torch.Tensor  # [] fp32 = weight_amax / (6 * 448)
    input_scale: torch.Tensor  # [] fp32 = input_amax / (6 * 448)
    FORMAT: ClassVar[str] = "nvfp4"
    BLOCK: ClassVar[int] = 16

    def _infer(self):
        return self.weight.shape[0], 2 * self.weight.shape[1], {}

    @staticmethod
    def layout(n: int, k: int) -> Layout:
        if k % Nvfp4Weight.BLOCK:
            raise ValueError(f"Nvfp4Weight: K={k} must be a multiple of {Nvfp4Weight.BLOCK}")
        return {
            "weight": ((n, k // 2), torch.uint8),
            "weight_scale": ((n, k // Nvfp4Weight.BLOCK), torch.float8_e4m3fn),
            "weight_scale_2": ((), torch.float32),
            "input_scale": ((), torch.float32),
        }

    def _dequantize_f32(self) -> torch.Tensor:
        s = self.weight_scale.float().repeat_interleave(self.BLOCK, 1)  # [N, K]
        return _e2m1_decode(self.weight) * s * self.weight_scale_2

    @classmethod
    def quantize(
        cls, w: torch.Tensor, *, input_amax: float = 1.0, weight_amax: float | None = None
    ) -> Nvfp4Weight:
        """Float [N, K] -> ModelOpt NVFP4 (dynamic path).

        weight_scale_2 = weight_amax / (6*448) (weight_amax defaults to max|w|; pass a larger,
        shared one to pair w1/w3), weight_scale = e4m3(amax_blk / (6 * weight_scale_2)) with
        all-zero blocks -> 1.0, nibble = e2m1_RNE(w / (weight_scale * weight_scale_2)),
        input_scale = input_amax / (6*448). An all-zero weight gets weight_scale_2 = 1."""
        n, k = w.shape
        cls.layout(n, k)
        wf = w.float()
        amax = wf.abs().amax()
        if weight_amax is not None:
            if weight_amax < amax.item():
                raise ValueError(f"Nvfp4Weight.quantize: weight_amax={weight_amax} < max|w|={amax}")
            amax = torch.tensor(weight_amax, dtype=torch.float32)
        ws2 = amax / (FP4_MAX * FP8_MAX) if amax > 0 else torch.tensor(1.0)
        wb = wf.unflatten(1, (k // cls.BLOCK, cls.BLOCK))  # [N, K/16, 16]
        blk = wb.abs().amax(-1) / (FP4_MAX * ws2)  # [N, K/16]
        blk = torch.where(blk == 0, 1.0, blk).clamp_max(FP8_MAX).to(torch.float8_e4m3fn)
        codes = e2m1_encode_ref(wb / (blk.float() * ws2).unsqueeze(-1)).flatten(1)
        input_scale = torch.tensor(input_amax / (FP4_MAX * FP8_MAX), dtype=torch.float32)
        return cls(_pack_nibbles(codes), blk, ws2.reshape(()).float(), input_scale)


def nvfp4_quantize_pair(
    w1: torch.Tensor, w3: torch.Tensor, *, input_amax: float = 1.0
) -> tuple[Nvfp4Weight, Nvfp4Weight]:
    """Quantize an expert's w1/w3 with one shared amax, so both get the same weight_scale_2 and
    input_scale (the fused gate/up GEMM has one global scale, SPEC 3.5)."""
    amax = max(w1.float().abs().max().item(), w3.float().abs().max().item())
    return (
        Nvfp4Weight.quantize(w1, input_amax=input_amax, weight_amax=amax),
        Nvfp4Weight.quantize(w3, input_amax=input_amax, weight_amax=amax),
    )


def check_shared_global_scale(w1: Nvfp4Weight, w3: Nvfp4Weight) -> None:
    """Raise ValueError unless w1/w3 share weight_scale_2 and input_scale bit for bit."""
    for name in ("weight_scale_2", "input_scale"):
        a, b = getattr(w1, name), getattr(w3, name)
        if not torch.equal(a.view(torch.int32), b.view(torch.int32)):
            raise ValueError(f"NVFP4 w1/w3 {name} differ: {a.item()} vs {b.item()}")


FORMATS: dict[str, type[LinearWeight]] = {
    c.FORMAT: c for c in (DenseWeight, Fp8BlockWeight, Mxfp4Weight, Nvfp4Weight)
}


def weight_from_tensors(fmt: str, tensors: dict[str, torch.Tensor]) -> LinearWeight:
    """Format name ("dense" | "fp8" | "mxfp4" | "nvfp4") + suffix -> tensor dict -> container."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}, expected one of {sorted(FORMATS)}")
    return FORMATS[fmt].from_tensors(tensors)
