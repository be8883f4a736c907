"""Linear layers on prepared weights (SPEC §2.0): `linear`, the grouped `wo_a`, and `prepare_linear`.

Owns `PreparedLinear`, the layout every linear kernel reads, made once after loading by
`prepare_linear` from a stored `dsv4.formats` container (no copy of the weight bytes):
- dense: `weight` [N, K] bf16/f16/f32;
- fp8: `weight` [N, K] float8_e4m3fn, `scale` [ceil(N/128), ceil(K/128)] fp32 (powers of two);
- mxfp4: `weight` [N, K/2] uint8 (low nibble = even k), `scale` [N, K/32] uint8: the E8M0 bytes b,
  scale = 2^(b - 127) (kept as bytes: as fp32 they would be 4x larger, ~0.8 GB per Flash layer);
- nvfp4: `weight` [N, K/2] uint8, `scale` [N, K/16] float8_e4m3fn, `global_scale` [] fp32;
  W = (e2m1 * float(scale)) * global_scale.
A leading expert dim [E, ...] on every tensor stacks the routed experts of a layer.

`linear_ref(x, w, act_quant, out_dtype)`: with act_quant the activation is FP8-simulated in 1x128
blocks (the reference's W8A8 / W4A8), then an fp32 GEMM on the dequantized weight, rounded once
to out_dtype. x may come as a `QuantAct` (an activation with its quantization, made by the op that
wrote it): a linear that quantizes reads its codes (the same values as quantizing x), any other reads
x. `norm_linear_ref`: a weighted RMSNorm and the linear on its output, one op. `wo_a_ref`: the grouped
low-rank output projection in the activation dtype (DeepSeek runs wo_a dequantized to bf16, without
activation quantization).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4 import formats
from dsv4.ops.act_quant import QuantAct, act_quant_sim_ref
from dsv4.ops.fp4_quant import e2m1_lut

ACT_BLOCK = 128


@dataclass(eq=False)
class PreparedLinear:
    fmt: str  # "dense" | "fp8" | "mxfp4" | "nvfp4"
    n: int  # out_features
    k: int  # in_features
    weight: torch.Tensor
    scale: torch.Tensor | None = None
    global_scale: torch.Tensor | None = None

    @property
    def quantized(self) -> bool:
        return self.fmt != "dense"

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.weight, self.scale, self.global_scale) if t is not None]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def select(self, e: int) -> "PreparedLinear":
        """Expert e of a stacked [E, ...] weight."""
        pick = (lambda t: None if t is None else t[e])
        return PreparedLinear(self.fmt, self.n, self.k, self.weight[e], pick(self.scale), pick(self.global_scale))

    def gather(self, idx: torch.Tensor) -> "PreparedLinear":
        """Expert idx ([1] device index) of a stacked weight, gathered without a host sync."""
        pick = (lambda t: None if t is None else t.index_select(0, idx)[0])
        return PreparedLinear(self.fmt, self.n, self.k, pick(self.weight), pick(self.scale), pick(self.global_scale))

    def dequantize(self) -> torch.Tensor:
        """[N, K] fp32 (reference only: the fast path never materializes this)."""
        w, n, k = self.weight, self.n, self.k
        if self.fmt == "dense":
            return w.float()
        if self.fmt == "fp8":
            s = self.scale.repeat_interleave(128, -2).repeat_interleave(128, -1)[..., :n, :k]
            return w.float() * s
        codes = torch.stack((w & 0xF, w >> 4), dim=-1).flatten(-2).long()
        vals = e2m1_lut(w.device)[codes]
        blk = k // self.scale.shape[-1]
        s = formats.e8m0_to_float(self.scale) if self.fmt == "mxfp4" else self.scale.float()
        out = vals * s.repeat_interleave(blk, -1)
        if self.fmt == "nvfp4":
            out = out * self.global_scale
        return out


def prepare_linear(w: formats.LinearWeight) -> PreparedLinear:
    """A stored weight container -> the kernel layout (weight bytes and FP4 scales shared, FP8 block scales
    as fp32)."""
    n, k = w.shape
    if isinstance(w, formats.DenseWeight):
        return PreparedLinear("dense", n, k, w.weight)
    if isinstance(w, formats.Fp8BlockWeight):
        return PreparedLinear("fp8", n, k, w.weight, w._scale_f32().contiguous())
    if isinstance(w, formats.Mxfp4Weight):
        return PreparedLinear("mxfp4", n, k, w.weight.view(torch.uint8), w.scale.view(torch.uint8))
    if isinstance(w, formats.Nvfp4Weight):
        return PreparedLinear("nvfp4", n, k, w.weight.view(torch.uint8), w.weight_scale, w.weight_scale_2)
    raise ValueError(f"prepare_linear: unsupported weight {type(w).__name__}")


def stack_prepared(ws: list[PreparedLinear]) -> PreparedLinear:
    """Stack same-shaped prepared weights into one [E, ...] PreparedLinear (copies)."""
    w0 = ws[0]
    st = (lambda name: None if getattr(w0, name) is None else torch.stack([getattr(w, name) for w in ws]))
    return PreparedLinear(w0.fmt, w0.n, w0.k, st("weight"), st("scale"), st("global_scale"))


def pow2_scales(w: PreparedLinear) -> bool:
    """True when every FP8 block scale of w is a power of two (E8M0, as the official checkpoint stores them): then
    e4m3 x scale is exact in bf16, and the FP8 weight holds exactly the values of its bf16 dequantization. Syncs the
    host once (call it when preparing weights, not per step)."""
    if w.fmt != "fp8" or w.scale is None:
        return False
    s = w.scale
    return bool(((s > 0) & (torch.frexp(s).mantissa == 0.5)).all())


def linear_ref(x: torch.Tensor | QuantAct, w: PreparedLinear, act_quant: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """x [..., K] -> x @ W^T [..., N] in out_dtype (fp32 GEMM; FP8 1x128 activation simulation first
    when act_quant and the weight is quantized: from x's own codes when it is a QuantAct)."""
    if x.shape[-1] != w.k:
        raise ValueError(f"linear: x {tuple(x.shape)} does not match K={w.k}")
    if act_quant and w.quantized:
        xf = x.dequantize() if isinstance(x, QuantAct) else act_quant_sim_ref(x, ACT_BLOCK, out_dtype=torch.float32)
    else:
        xf = (x.x if isinstance(x, QuantAct) else x).float()
    return (xf @ w.dequantize().T).to(out_dtype)


def norm_linear_ref(x: torch.Tensor, norm_w: torch.Tensor, eps: float, w: PreparedLinear, act_quant: bool,
                    out_dtype: torch.dtype) -> torch.Tensor:
    """linear_ref(rmsnorm_ref(x, norm_w, eps), w, act_quant, out_dtype): a weighted RMSNorm (result in x.dtype) and
    the linear that reads it (the query's low-rank norm and wq_b)."""
    from dsv4.ops.norm import rmsnorm_ref

    return linear_ref(rmsnorm_ref(x, norm_w, eps), w, act_quant, out_dtype)


def wo_a_ref(o: torch.Tensor, w: torch.Tensor, w8: PreparedLinear | None = None) -> torch.Tensor:
    """o [..., G, Dg] (activation dtype), w [G, R, Dg] (activation dtype) -> z [..., G, R] in o.dtype:
    z[g, r] = sum_d o[g, d] w[g, r, d], in the activation dtype as DeepSeek's bf16 einsum. `w8`, when given, is the
    same weight as FP8 [G * R, Dg] with power-of-two block scales (exactly w's values); the reference reads w."""
    return torch.einsum("...gd,grd->...gr", o, w.to(o.dtype))


def check_codes(x2: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> None:
    """Given codes for x2 [M, K] must be e4m3 [M, K] and fp32 scales [M, K / 128], both contiguous (ValueError)."""
    M, K = x2.shape
    if not (q.dtype == torch.float8_e4m3fn and tuple(q.shape) == (M, K) and q.is_contiguous()
            and s.dtype == torch.float32 and tuple(s.shape) == (M, K // ACT_BLOCK) and s.is_contiguous()
            and q.device == x2.device and s.device == x2.device):
        raise ValueError(f"linear: codes {tuple(q.shape)} {q.dtype} / scales {tuple(s.shape)} {s.dtype} do not match "
                         f"x [{M}, {K}] (contiguous e4m3 [M, K] and fp32 [M, K / {ACT_BLOCK}] on x's device)")


def make_fast_linear(linear_triton):
    """The fast `linear`: the CUDA GEMV (dsv4/ops/linear_cuda.py) for the decode shapes it takes, the CUDA GEMM for
    prefill chunks on FP8 weights, the Triton kernels for everything else (FP4 and dense prefill, fp32 out, CPU under
    TRITON_INTERPRET=1, no CUDA build here). Given a QuantAct, the prefill kernels of a quantizing linear read its
    codes instead of launching a quantization."""
    if linear_triton is None:
        return None
    from dsv4.ops import linear_cuda

    def linear_fast(x: torch.Tensor | QuantAct, w: PreparedLinear, act_quant: bool, out_dtype: torch.dtype
                    ) -> torch.Tensor:
        pre = None
        if isinstance(x, QuantAct):  # the prefill kernels start from its codes; the decode ones quantize x in-kernel
            pre, x = ((x.q, x.s) if act_quant else None), x.x
            if pre is not None:
                check_codes(x.reshape(-1, x.shape[-1]), *pre)
        if (x.is_cuda and isinstance(w, PreparedLinear) and x.dim() >= 1 and x.shape[-1] == w.k
                and x.dtype in (torch.bfloat16, torch.float32) and out_dtype in (torch.bfloat16, torch.float32)):
            x2 = linear_triton._rows(x, w.k, "linear")
            gemv = linear_cuda.applies(x2, w, bool(act_quant), out_dtype)
            plan = None if gemv else linear_cuda.gemm_choice(x2, w, bool(act_quant), out_dtype)
            if gemv or plan:
                linear_triton._check_weight(w, x.device)
                out = torch.empty((*x.shape[:-1], w.n), dtype=out_dtype, device=x.device)
                if w.n:
                    if gemv:
                        linear_cuda.gemv(x2, w, out.view(-1, w.n))
                    else:
                        linear_cuda.gemm(x2, w, out.view(-1, w.n), plan.splits, pre, plan.bn)
                return out
        return linear_triton.linear(x, w, act_quant, out_dtype, pre)

    linear_fast.__doc__ = linear_triton.linear.__doc__
    linear_fast.check_weight = linear_triton._check_weight
    return linear_fast


def make_fast_norm_linear(linear_fast, norm_fast):
    """The fast `norm_linear`, one A/B unit (`--kernels ...,norm_linear=ref` swaps it whole; the `linear` and `rmsnorm`
    settings do not reach inside it, as for the other fused ops): decode rows (the CUDA GEMV's shapes, FP8 weights,
    bf16 x) norm x in the GEMV's own x prologue, one launch; otherwise the fast norm, which also quantizes its output
    where the linear quantizes (rmsnorm_quant: the prefill GEMM reads its codes), then the fast linear. The norm's
    statistic is an fp32 sum in the order of whichever kernel takes it (the GEMV prologue by block or by thread
    stride, Triton), so a normed value may land one bf16 rounding apart between decode and prefill, as between any
    fast norm and rmsnorm_ref."""
    if linear_fast is None or norm_fast is None:
        return None
    from dsv4.ops import linear_cuda

    def norm_linear_fast(x: torch.Tensor, norm_w: torch.Tensor, eps: float, w: PreparedLinear, act_quant: bool,
                         out_dtype: torch.dtype) -> torch.Tensor:
        if not isinstance(w, PreparedLinear):
            raise TypeError(f"norm_linear: w must be a PreparedLinear, got {type(w).__name__}")
        aq = bool(act_quant and w.quantized)
        if (x.is_cuda and w.fmt == "fp8" and aq
                and x.dtype == torch.bfloat16 and x.dim() >= 1 and x.shape[-1] == w.k and norm_w.shape == (w.k,)
                and norm_w.dtype == torch.bfloat16 and norm_w.device == x.device
                and out_dtype in (torch.bfloat16, torch.float32)):
            x2 = x.reshape(-1, w.k)
            if x2.stride(-1) == 1 and linear_cuda.applies(x2, w, True, out_dtype):
                linear_fast.check_weight(w, x.device)
                out = torch.empty((*x.shape[:-1], w.n), dtype=out_dtype, device=x.device)
                linear_cuda.gemv(x2, w, out.view(-1, w.n), norm=(norm_w.contiguous(), eps))
                return out
        quant = aq and w.k % ACT_BLOCK == 0  # the norm hands the linear its codes
        y = (norm_fast.rmsnorm_quant if quant else norm_fast.rmsnorm)(x, norm_w, eps)
        return linear_fast(y, w, act_quant, out_dtype)

    return norm_linear_fast


def make_fast_wo_a():
    """The fast `wo_a`: the CUDA grouped GEMV on the FP8 weight `w8` (half the bytes of the bf16 copy) for decode
    shapes (1-8 tokens, bf16 o), else the cuBLAS bf16 batched GEMM of the reference on `w`, which streams the bf16
    weight faster than linear_triton.wo_a (H200: 19.8 vs 23.1 us at M = 1, 24.3 vs 31.7 us at M = 128; the Triton
    kernel stays tested in tests/ops/test_linear.py)."""
    from dsv4.ops import linear_cuda

    def wo_a_fast(o: torch.Tensor, w: torch.Tensor, w8: PreparedLinear | None = None) -> torch.Tensor:
        if w8 is not None and o.dim() >= 2 and o.is_cuda:
            G, D = o.shape[-2], o.shape[-1]
            o2 = o.reshape(-1, G * D)
            if linear_cuda.wo_a_applies(o2, w8, G):
                out = torch.empty((*o.shape[:-1], w8.n // G), dtype=o.dtype, device=o.device)
                linear_cuda.wo_a(o2, w8, G, out.view(o2.shape[0], w8.n))
                return out
        return wo_a_ref(o, w, w8)

    return wo_a_fast


def load_triton_module():
    """dsv4.ops.linear_triton, or None where it cannot be imported (no Triton on this machine): then
    the references run and `ops.configure` lists the ops as such."""
    try:
        from dsv4.ops import linear_triton
    except ImportError:
        return None
    return linear_triton


def register_ops(register) -> None:
    linear_triton = load_triton_module()
    fast_linear = make_fast_linear(linear_triton)
    fast_wo_a = make_fast_wo_a()
    register("linear", linear_ref, fast_linear, interpretable=True,
             doc="x @ W^T for dense / FP8 block / MXFP4 / NVFP4 weights, FP8 1x128 activation quantization",
             cuda="decode GEMV, 1-8 tokens on FP8 / bf16 weights; prefill GEMM (TMA + wgmma) on FP8 weights")
    try:
        from dsv4.ops import norm_rope_triton as norm_fast
    except ImportError:  # no Triton here: the reference runs
        norm_fast = None
    register("norm_linear", norm_linear_ref, make_fast_norm_linear(fast_linear, norm_fast), interpretable=True,
             doc="weighted RMSNorm, then the linear on its output (the query's norm and wq_b)",
             cuda="decode: the norm in the GEMV's x prologue, one launch")
    register("wo_a", wo_a_ref, fast_wo_a,
             doc="grouped low-rank output projection, bf16 products, no activation quantization",
             cuda="decode grouped GEMV on the FP8 weight (bf16 x)")
