"""sparse_attn fast path (dsv4/ops/sparse_attn_triton.py) against sparse_attn_ref on fresh random inputs.

CPU tier: the Triton kernels in the interpreter (a private copy of the module imported with
TRITON_INTERPRET=1), production head shapes (H=64, D=512, W=128) for decode and small shapes for
prefill chunks. GPU tier (`gpu` mark): Flash shapes at 1K, 16K and 128K context (CSA top-512 lists over
the whole entries buffer, HCA lists with -1 past the visible count), prefill chunks of 128 queries, and
CUDA-graph capture (replay == eager, bitwise). Both launches (one program walking the whole list; the
decode split-KV walk seeded with the running maximum) are held to `op_attention`, and the split walk must
reproduce the whole-list walk but for rare one-ulp output flips (fp32 rescaling order).
"""

import os
import subprocess
import sys

import pytest
import torch

from dsv4.model.layers import StepPlan
from dsv4.ops.rope import rope_ref
from dsv4.ops.sparse_attn import sparse_attn_ref
from dsv4.testing import assert_bitwise_equal, assert_close_rel

CUDA = torch.cuda.is_available()
# Triton picks the interpreter when a kernel (its own library included) is defined, so the CPU tier runs in
# a process started with TRITON_INTERPRET=1: directly under it, else through test_cpu_tier_interpreted.
INTERP = os.environ.get("TRITON_INTERPRET") == "1"
cpu_tier = pytest.mark.skipif(not INTERP, reason="Triton interpreter tier: runs in test_cpu_tier_interpreted")


def run_interpreted(test_file: str) -> None:
    """Run the CPU tier of `test_file` in a subprocess under TRITON_INTERPRET=1."""
    pytest.importorskip("triton")
    if INTERP:
        pytest.skip("this process is interpreted: the CPU tier ran directly")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file, "-m", "not gpu",
           "-k", "not test_cpu_tier_interpreted"]
    r = subprocess.run(cmd, env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]


def test_cpu_tier_interpreted():
    run_interpreted(__file__)


@pytest.fixture(scope="module")
def cpu_fast():
    pytest.importorskip("triton")
    from dsv4.ops import sparse_attn_triton
    return sparse_attn_triton


def make_case(B, S, H, D, W, Nc, Lc, *, seed, dtype=torch.bfloat16, device="cpu", win_holes=0.1, n_vis=None,
              csa=True, peak=0.0):
    """Random q (unit-RMS rows, like the model's normed q), ring + chunk kv, window lists with -1 holes and
    a -1 tail like StepPlan's, and a compressed list of Lc slots over Nc entries of which the first n_vis
    are visible: CSA (distinct visible entries in random order, -1 past the visible count) or HCA
    (entries 0.. ascending, -1 past the visible count). `peak` > 0 aligns a few keys with the queries."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, H, D, generator=g)
    kvw = torch.randn(B, W + S, D, generator=g)
    iw = torch.randint(0, W + S, (B, S, W), generator=g, dtype=torch.int32)
    iw[torch.rand(B, S, W, generator=g) < win_holes] = -1
    iw[:, :, W - W // 8:] = -1  # a young window: the last slots are empty
    kvc = ic = None
    if Lc:
        kvc = torch.randn(B, Nc, D, generator=g)
        nv = Nc if n_vis is None else n_vis
        if csa:
            ic = torch.full((B, S, Lc), -1, dtype=torch.int32)
            for b in range(B):
                for s in range(S):
                    pick = torch.randperm(nv, generator=g)[:Lc]
                    ic[b, s, :pick.numel()] = pick.to(torch.int32)
        else:
            ic = torch.where(torch.arange(Lc) < nv, torch.arange(Lc), -1).to(torch.int32).expand(B, S, Lc).clone()
    if peak:
        j = torch.randint(0, W + S, (4,), generator=g)
        kvw[:, j] = kvw[:, j] + peak * q[:, :1, :4].mean(1)  # keys close to some heads' queries
    sink = torch.randn(H, generator=g)
    t = lambda x: None if x is None else x.to(device)  # noqa: E731
    return (t(q.to(dtype)), t(kvw.to(dtype)), t(iw), t(kvc.to(dtype) if kvc is not None else None), t(ic),
            t(sink), D ** -0.5)


def whole_list(fast, args):
    """The launch with one program per (query, head group) walking the whole list (no split)."""
    q, _, iw, _, ic, _, _ = args
    L = iw.shape[-1] + (ic.shape[-1] if ic is not None else 0)
    return dict(bh=min(64, max(16, q.shape[2])), warps=8, stages=1, nsplit=1, bps=max(1, -(-L // 64)))


def check(fast, args, *, cfg=None):
    o = fast.sparse_attn(*args, cfg=cfg)  # the fast kernel runs before the reference is allocated
    ref = sparse_attn_ref(*args)
    assert_close_rel(o, ref, "op_attention")
    return o, ref


def check_split_matches_whole(fast, args):
    """The default (split) launch against the reference and against one program walking the whole list: the
    split walks start from the sequential walk's running maximum, so every p and bf16(p) is the walk's; only
    the fp32 rescaling of the partials differs (~1e-7 relative), which flips an output rounding very rarely."""
    q, _, iw, _, ic, _, _ = args
    L = iw.shape[-1] + (ic.shape[-1] if ic is not None else 0)
    assert fast.config(q.shape[0], q.shape[1], q.shape[2], L, q.device)["nsplit"] > 1
    o, _ = check(fast, args)
    whole = fast.sparse_attn(*args, cfg=whole_list(fast, args))
    assert_close_rel(o, whole, "op_attention")
    assert (o != whole).float().mean().item() < 1e-3, "split walk differs from the sequential walk"
    return o


# ---------------------------------------------------------------------------------------------------------
# CPU tier (Triton interpreter)


@cpu_tier
@pytest.mark.parametrize("kind,S", [("swa", 3), ("csa", 1), ("csa", 2), ("hca", 1)])
def test_decode_production_shapes(cpu_fast, kind, S):
    Lc, Nc, csa = {"swa": (0, 0, False), "csa": (512, 2048, True), "hca": (1024, 1024, False)}[kind]
    n_vis = {"csa": 512, "hca": 700}.get(kind)
    args = make_case(1, S, 64, 512, 128, Nc, Lc, seed=10 * S + len(kind), n_vis=n_vis, csa=csa)
    check(cpu_fast, args, cfg=whole_list(cpu_fast, args))  # one program walks the list
    check_split_matches_whole(cpu_fast, args)  # the default decode launch splits it


@cpu_tier
def test_odd_tails_and_short_lists(cpu_fast):
    # list lengths not multiples of 64, a block straddling window and compressed parts, a compressed list
    # shorter than k (3 valid of 45), a query whose whole list is -1 (all-zero output)
    args = make_case(2, 3, 64, 512, 37, 300, 45, seed=3, n_vis=3)
    args[2][1, 2] = -1
    args[4][1, 2] = -1
    o, ref = check(cpu_fast, args, cfg=whole_list(cpu_fast, args))
    assert_bitwise_equal(o[1, 2], torch.zeros_like(o[1, 2]), "all -1 -> zeros")
    o, _ = check(cpu_fast, args, cfg=dict(bh=64, warps=8, stages=1, nsplit=2, bps=1))
    assert_bitwise_equal(o[1, 2], torch.zeros_like(o[1, 2]), "all -1 -> zeros (split)")


@cpu_tier
def test_long_mostly_empty_list(cpu_fast):
    # an HCA list over an entries buffer far longer than the context (decode, 1 block per split): 67 splits,
    # more than one combine load holds, most of them without a valid slot
    args = make_case(1, 1, 16, 64, 16, 4200, 4200, seed=8, n_vis=150, csa=False)
    assert cpu_fast.config(1, 1, 16, 16 + 4200, args[0].device)["nsplit"] > 64
    check_split_matches_whole(cpu_fast, args)


@cpu_tier
def test_prefill_chunks_small_heads(cpu_fast):
    # S = 37 and 128 queries with StepPlan's causal window lists (W = 16), H < 16 (padded heads), D = 64
    for S, start, H, seed in ((37, 0, 4, 1), (128, 40, 16, 2)):
        plan = StepPlan.build(torch.tensor([start]), S, 16, start)
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(1, S, H, 64, generator=g).bfloat16()
        kvw = torch.randn(1, 16 + S, 64, generator=g).bfloat16()
        n = (start + S) // 4
        kvc = torch.randn(1, n + 1, 64, generator=g).bfloat16()[:, :n]  # entries[:, :n]: a strided slice
        nv = (plan.pos + 1) // 4
        ar = torch.arange(n)
        ic = torch.where(ar[None, :] < nv[:, None], ar, -1).to(torch.int32)[None]
        sink = torch.randn(H, generator=g)
        args = (q, kvw, plan.win_idx[None], kvc, ic, sink, 0.125)
        check(cpu_fast, args)
        assert cpu_fast.config(1, S, H, 0, q.device)["nsplit"] == 1


@cpu_tier
def test_fp32_and_noncontiguous(cpu_fast):
    # exact numerics (fp32 q/kv: P is not rounded) up to fp32 summation order; strided views everywhere
    args = make_case(2, 2, 16, 64, 16, 40, 24, seed=5, dtype=torch.float32, csa=True, peak=4.0)
    q, kvw, iw, kvc, ic, sink, scale = args
    q = torch.cat([q, q], 2)[:, :, ::2]  # stride 2 over heads
    iw = iw[:1].expand(2, -1, -1)  # batch stride 0, as the model's plan.win_idx.expand
    kvc = torch.cat([kvc, kvc], 1)[:, :40]
    args = (q, kvw, iw, kvc, ic, sink, scale)
    o = cpu_fast.sparse_attn(*args, cfg=whole_list(cpu_fast, args))
    assert_close_rel(o, sparse_attn_ref(*args), "op_fp32_out")


def rope_tables(S: int, rd: int, seed: int, device="cpu"):
    """cos, sin [S, rd/2] fp32 at random angles (the tokens' positions)."""
    ang = torch.rand(S, rd // 2, generator=torch.Generator().manual_seed(seed)) * 6.3
    return ang.cos().to(device), ang.sin().to(device)


def check_rope_inverted(fast, args, cos, sin, *, cfg=None):
    """The output with its RoPE dims rotated back in the kernel: the attention's rounded output (the same
    launch without RoPE) through rope_ref's inverse, up to one rounding of the rotation (the kernel's
    fp32 products may be fused); the other dims bit for bit; and against the reference."""
    rd = 2 * cos.shape[1]
    o = fast.sparse_attn(*args, cos, sin, cfg=cfg)
    plain = fast.sparse_attn(*args, cfg=cfg)
    assert_bitwise_equal(o[..., :-rd], plain[..., :-rd], "dims without RoPE")
    want = rope_ref(plain, cos, sin, True)
    assert_close_rel(o, want, "op_bf16_out" if o.dtype != torch.float32 else "op_fp32_out")
    assert (o != want).float().mean().item() < 1e-2, "rotation rounded differently from rope_ref too often"
    assert_close_rel(o, sparse_attn_ref(*args, cos, sin), "op_attention")
    return o


@cpu_tier
def test_output_rope_inverted(cpu_fast):
    # whole-list programs (chunks of the output: D = 96 has 4 chunks of 32 columns, rd = 48 reaches into two)
    # and the split walk's combine (tiles of BD columns); prefill-like S = 5 (angles per token)
    args = make_case(1, 5, 16, 96, 16, 40, 24, seed=21, csa=True)
    cos, sin = rope_tables(5, 48, seed=1)
    check_rope_inverted(cpu_fast, args, cos, sin, cfg=whole_list(cpu_fast, args))
    check_rope_inverted(cpu_fast, args, cos, sin, cfg=dict(bh=16, warps=4, stages=1, nsplit=2, bps=1))
    args = make_case(1, 1, 64, 512, 128, 2048, 512, seed=22, n_vis=512, csa=True)  # Flash decode, rd = 64
    cos, sin = rope_tables(1, 64, seed=2)
    assert cpu_fast.config(1, 1, 64, 640, args[0].device)["nsplit"] > 1
    check_rope_inverted(cpu_fast, args, cos, sin)
    check_rope_inverted(cpu_fast, args, cos, sin, cfg=whole_list(cpu_fast, args))
    with pytest.raises(ValueError, match="cos / sin must both be"):
        cpu_fast.sparse_attn(*args, cos, None)
    with pytest.raises(ValueError, match="cos / sin must both be"):
        cpu_fast.sparse_attn(*args, *rope_tables(2, 64, seed=3))


@cpu_tier
def test_bad_inputs_raise(cpu_fast):
    q, kvw, iw, kvc, ic, sink, scale = make_case(1, 1, 16, 64, 16, 20, 8, seed=0)
    with pytest.raises(ValueError, match="kv_win"):
        cpu_fast.sparse_attn(q, kvw.float(), iw, kvc, ic, sink, scale)
    with pytest.raises(ValueError, match="both be given"):
        cpu_fast.sparse_attn(q, kvw, iw, kvc, None, sink, scale)
    with pytest.raises(ValueError, match="sink"):
        cpu_fast.sparse_attn(q, kvw, iw, kvc, ic, sink[:4], scale)
    with pytest.raises(ValueError, match="idx_win"):
        cpu_fast.sparse_attn(q, kvw, iw.float(), kvc, ic, sink, scale)


# ---------------------------------------------------------------------------------------------------------
# GPU tier

def _gpu_fast():
    from dsv4.ops import sparse_attn_triton
    return sparse_attn_triton


def flash_case(context: int, kind: str, S: int, seed: int, *, state_len: int | None = None):
    """Flash decode/prefill shapes at a context: SWA (window only), HCA (r=128: the list covers the whole
    entries buffer, -1 past the visible count), CSA (r=4: the indexer's top-512 of the visible entries,
    any order; fewer than 512 visible -> -1 tail). The entries buffer holds `state_len` tokens (default:
    the context)."""
    W, H, D = 128, 64, 512
    r = {"csa": 4, "hca": 128}.get(kind)
    if r is None:
        return make_case(1, S, H, D, W, 0, 0, seed=seed, win_holes=0.0, device="cuda")
    Nc = (state_len or context) // r
    Lc = 512 if kind == "csa" else Nc
    return make_case(1, S, H, D, W, Nc, Lc, seed=seed, win_holes=0.0, n_vis=context // r, csa=kind == "csa",
                     device="cuda")


@pytest.mark.parametrize("S", [1, 2, 4])
@pytest.mark.parametrize("kind", ["swa", "hca", "csa"])
@pytest.mark.parametrize("context", [1024, 16384, 131072])
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or INTERP, reason="needs CUDA (not interpreted)")
def test_gpu_decode_flash(context, kind, S):
    fast = _gpu_fast()
    args = flash_case(context, kind, S, seed=context + S)
    check(fast, args, cfg=whole_list(fast, args))
    check_split_matches_whole(fast, args)  # the default decode launch


@pytest.mark.parametrize("kind", ["hca", "csa"])
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or INTERP, reason="needs CUDA (not interpreted)")
def test_gpu_prefill_chunk_128k(kind):
    fast = _gpu_fast()
    args = flash_case(131072, kind, 128, seed=7)
    assert fast.config(1, 128, 64, 640, args[0].device)["nsplit"] == 1
    check(fast, args)


@pytest.mark.parametrize("kind,S", [("csa", 1), ("hca", 4), ("swa", 2), ("csa", 128)])
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or INTERP, reason="needs CUDA (not interpreted)")
def test_gpu_output_rope_inverted(kind, S):
    fast = _gpu_fast()
    args = flash_case(16384, kind, S, seed=40 + S)
    cos, sin = rope_tables(S, 64, seed=S, device="cuda")
    check_rope_inverted(fast, args, cos, sin)
    if S <= 8:
        check_rope_inverted(fast, args, cos, sin, cfg=whole_list(fast, args))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or INTERP, reason="needs CUDA (not interpreted)")
def test_gpu_state_longer_than_context():
    # an entries buffer sized for 1M tokens at 16K context: the HCA list is mostly -1 blocks
    fast = _gpu_fast()
    check_split_matches_whole(fast, flash_case(16384, "hca", 1, seed=3, state_len=1 << 20))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or INTERP, reason="needs CUDA (not interpreted)")
def test_gpu_graph_replay_equals_eager():
    fast = _gpu_fast()
    for kind, S in (("csa", 1), ("hca", 4), ("csa", 128)):
        args = flash_case(16384, kind, S, seed=11)
        eager = fast.sparse_attn(*args)
        torch.cuda.synchronize()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fast.sparse_attn(*args)  # warm-up (compilation) outside the capture
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fast.sparse_attn(*args)
        graph.replay()
        torch.cuda.synchronize()
        assert_bitwise_equal(out, eager, f"graph replay {kind} S={S}")
        # new index lists in the same buffers: the replay follows them (indices live on the device)
        q, kvw, iw, kvc, ic, sink, scale = args
        if ic is not None:
            ic.copy_(ic.flip(-1))
            graph.replay()
            torch.cuda.synchronize()
            assert_bitwise_equal(out, fast.sparse_attn(*args), f"graph replay after new lists {kind} S={S}")
