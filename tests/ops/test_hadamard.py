"""hadamard_ref: hand 4-point transform, explicit Sylvester matrix, orthonormality/involution; rotate_fp4 (fast == ref)."""

import pytest
import torch

from dsv4.ops.hadamard import hadamard_ref, rotate_fp4_ref


# interpreted on CPU (CI); on a GPU machine compiled, and selected by `-m gpu`
both_tiers = pytest.mark.gpu if torch.cuda.is_available() else (lambda f: f)


def sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def test_four_point_by_hand():
    # H4 = [[1,1,1,1],[1,-1,1,-1],[1,1,-1,-1],[1,-1,-1,1]] / 2; applied to [1,2,3,4]
    y = hadamard_ref(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert y.tolist() == [5.0, -1.0, -2.0, 0.0]


@pytest.mark.parametrize("n", [1, 2, 8, 64, 128])
def test_matches_sylvester_matrix(n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(3, 5, n, generator=g)
    want = (x.double() @ sylvester(n)) * n**-0.5
    torch.testing.assert_close(hadamard_ref(x).double(), want, rtol=0, atol=1e-5)


def test_orthonormal_and_involution_128():
    m = hadamard_ref(torch.eye(128))  # rows of the orthonormal matrix
    torch.testing.assert_close(m @ m.T, torch.eye(128), rtol=0, atol=1e-6)
    torch.testing.assert_close(m, m.T, rtol=0, atol=0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 128, generator=g)
    torch.testing.assert_close(hadamard_ref(hadamard_ref(x)), x, rtol=0, atol=1e-5)
    q, k = x[:8], x[8:]
    torch.testing.assert_close(hadamard_ref(q) @ hadamard_ref(k).T, q @ k.T, rtol=0, atol=1e-4)


def test_dtype_and_views():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 256, generator=g)[:, ::2].to(torch.bfloat16)  # non-contiguous [4,128]
    y = hadamard_ref(x)
    assert y.dtype == torch.bfloat16 and y.shape == (4, 128)
    assert torch.equal(y, hadamard_ref(x.float()).to(torch.bfloat16))


@pytest.mark.parametrize("shape", [(4, 96), (0,), ()])
def test_bad_dim_raises(shape):
    with pytest.raises(ValueError, match="power of two"):
        hadamard_ref(torch.zeros(shape))


# ---- rotate_fp4: the fused fast path (dsv4/ops/hadamard_triton.py) equals the reference bit for bit ----------

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _fast_rotate():
    pytest.importorskip("triton")
    from dsv4.ops import hadamard_triton
    return hadamard_triton.rotate_fp4


def _rotate_inputs(shape, dtype, seed):
    """Indexer-like rows with FP4 edge cases: per-row magnitudes 2^-20..2^12, exact zeros, -0.0, a row of
    zeros (the amax floor), values that land on e2m1 midpoints after the rotation (powers of two spread by H)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-20, 13, (*shape[:-1], 1), generator=g).float())
    flat = x.view(-1, shape[-1])
    flat[0] = 0.0
    flat[1, ::3] = -0.0
    if flat.shape[0] > 2:
        flat[2] = 0.0
        flat[2, 0] = 4.0  # H spreads one spike evenly: every element is +-4 / sqrt(n), one block scale
    if flat.shape[0] > 3:
        flat[3] = torch.where(torch.rand(shape[-1], generator=g) < 0.5, 1.0, -1.0) * 3.0
    return x.to(dtype).to(DEV)


@both_tiers
@pytest.mark.parametrize("shape", [(1, 1, 64, 128), (3, 5, 128), (7, 32), (2, 1024), (17, 256)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_rotate_fp4_fast_equals_reference(shape, dtype):
    fast = _fast_rotate()
    x = _rotate_inputs(shape, dtype, seed=len(shape) * 100 + shape[-1])
    got = fast(x)
    want = rotate_fp4_ref(x)
    assert got.dtype == x.dtype and got.shape == x.shape
    bad = (got.view(torch.int16 if dtype != torch.float32 else torch.int32)
           != want.view(torch.int16 if dtype != torch.float32 else torch.int32)).nonzero()
    assert not bad.numel(), f"{len(bad)} values differ, first at {tuple(bad[0].tolist())}"


@both_tiers
def test_rotate_fp4_strided_input_and_errors():
    fast = _fast_rotate()
    x = _rotate_inputs((6, 256), torch.bfloat16, seed=9)[:, 64:192]  # rows with stride 256
    assert torch.equal(fast(x), rotate_fp4_ref(x))
    for bad in (torch.zeros(4, 48, device=DEV), torch.zeros(4, 16, device=DEV), torch.zeros(2, 2048, device=DEV)):
        with pytest.raises(ValueError, match="power of two in \\[32, 1024\\]"):
            fast(bad)
    with pytest.raises(ValueError, match="dtype"):
        fast(torch.zeros(2, 64, dtype=torch.int32, device=DEV))
    assert fast(torch.zeros(0, 64, device=DEV)).shape == (0, 64)


@both_tiers
@pytest.mark.parametrize("shape,rd", [((1, 1, 64, 128), 64), ((2, 3, 4, 128), 64), ((1, 5, 64), 16),
                                      ((1, 2, 3, 32), 32)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rotate_fp4_with_rope_first_equals_reference(shape, rd, dtype):
    # the indexer's queries: RoPE (angles per token), rounded to x's dtype, then the rotation + FP4 in one launch;
    # bit for bit rotate_fp4_ref(x, cos, sin) = fp4 sim of hadamard of rope_ref(x, cos, sin)
    fast = _fast_rotate()
    x = _rotate_inputs(shape, dtype, seed=shape[1] * 10 + rd)
    ang = torch.rand(shape[1], rd // 2, generator=torch.Generator().manual_seed(rd)) * 6.3
    cos, sin = ang.cos().to(DEV), ang.sin().to(DEV)
    got, want = fast(x, cos, sin), rotate_fp4_ref(x, cos, sin)
    bad = (got.view(torch.int16 if dtype != torch.float32 else torch.int32)
           != want.view(torch.int16 if dtype != torch.float32 else torch.int32)).nonzero()
    assert not bad.numel(), f"{len(bad)} values differ, first at {tuple(bad[0].tolist())}"
    assert not torch.equal(got, fast(x)), "the RoPE was applied"
    with pytest.raises(ValueError, match="cos and sin come together"):
        fast(x, cos, None)
    with pytest.raises(ValueError, match="cos / sin must be"):
        fast(x, cos[:1].expand(shape[1] + 1, -1), sin[:1].expand(shape[1] + 1, -1))
