"""hadamard_ref: hand 4-point transform, explicit Sylvester matrix, orthonormality/involution."""

import pytest
import torch

from dsv4.ops.hadamard import hadamard_ref


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
