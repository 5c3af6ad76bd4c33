"""kernels/_dense_kernels.py's grouped sums and the products it reduces once.

The dense step sums several tiles along one axis in one variadic ``tl.reduce`` on the GPU (``_sum2`` ... ``_sum6``:
one round trip through shared memory where the axis spans warps) and each alone under the interpreter, whose generic
reduce is ~100x slower (``ONE_REDUCTION``). The step's own tests on the CPU therefore run the second form only; here
both forms run on the interpreter (the module's switch flipped) on small tiles, against torch, with the products built
on them (``_mvs``, ``_mv2o``, ``_mv3x2``, ``_mvs3v``) in both orientations of the weights. On CUDA the compiled (GPU)
form runs.
"""

import pytest
import torch
from mlff_distiller.kernels import _dense_kernels as dk
from mlff_distiller.kernels._triton_utils import HAS_TRITON, tl, triton

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")

if HAS_TRITON:
    from mlff_distiller.kernels._dense_kernels import _mv2o, _mv3x2, _mvs, _mvs3v, _sum2, _sum3, _sum4, _sum6

    @triton.jit
    def _sums_kernel(x_ptr, out_ptr, R: tl.constexpr, C: tl.constexpr, AXIS: tl.constexpr):
        """Fifteen sums of six ``[R, C]`` tiles along ``AXIS``: ``_sum2`` (0, 1), ``_sum3`` (2, 3, 4), ``_sum4`` (5, 0,
        1, 2), ``_sum6`` (0-5), each result in a row of ``out`` (length C for axis 0, R for axis 1)."""
        r = tl.arange(0, R)
        c = tl.arange(0, C)
        offs = r[:, None] * C + c[None, :]
        x0 = tl.load(x_ptr + offs)
        x1 = tl.load(x_ptr + R * C + offs)
        x2 = tl.load(x_ptr + 2 * R * C + offs)
        x3 = tl.load(x_ptr + 3 * R * C + offs)
        x4 = tl.load(x_ptr + 4 * R * C + offs)
        x5 = tl.load(x_ptr + 5 * R * C + offs)
        a0, a1 = _sum2(x0, x1, AXIS)
        b0, b1, b2 = _sum3(x2, x3, x4, AXIS)
        c0, c1, c2, c3 = _sum4(x5, x0, x1, x2, AXIS)
        d0, d1, d2, d3, d4, d5 = _sum6(x0, x1, x2, x3, x4, x5, AXIS)
        L: tl.constexpr = C if AXIS == 0 else R
        o = tl.arange(0, L)
        tl.store(out_ptr + o, a0)
        tl.store(out_ptr + L + o, a1)
        tl.store(out_ptr + 2 * L + o, b0)
        tl.store(out_ptr + 3 * L + o, b1)
        tl.store(out_ptr + 4 * L + o, b2)
        tl.store(out_ptr + 5 * L + o, c0)
        tl.store(out_ptr + 6 * L + o, c1)
        tl.store(out_ptr + 7 * L + o, c2)
        tl.store(out_ptr + 8 * L + o, c3)
        tl.store(out_ptr + 9 * L + o, d0)
        tl.store(out_ptr + 10 * L + o, d1)
        tl.store(out_ptr + 11 * L + o, d2)
        tl.store(out_ptr + 12 * L + o, d3)
        tl.store(out_ptr + 13 * L + o, d4)
        tl.store(out_ptr + 14 * L + o, d5)

    @triton.jit
    def _products_kernel(x_ptr, w_ptr, out_ptr, K: tl.constexpr, N: tl.constexpr, MV: tl.constexpr):
        """Six vectors ``x_i [K]`` against three matrices ``M_t [K, N]`` (row-major, ``K N`` apart at ``w_ptr``;
        their transposes after them, ``N K`` apart), by the helpers; fourteen rows of ``out`` ([N] each)."""
        k = tl.arange(0, K)
        x0 = tl.load(x_ptr + k)
        x1 = tl.load(x_ptr + K + k)
        x2 = tl.load(x_ptr + 2 * K + k)
        x3 = tl.load(x_ptr + 3 * K + k)
        x4 = tl.load(x_ptr + 4 * K + k)
        x5 = tl.load(x_ptr + 5 * K + k)
        wt = w_ptr + 3 * K * N
        s3 = _mvs(x0, x1, x2, w_ptr, K * N, N, wt, N * K, K, K, N, MV, 3)
        s2 = _mvs(x3, x4, x4, w_ptr, K * N, N, wt, N * K, K, K, N, MV, 2)
        p0, p1 = _mv2o(x5, w_ptr + K * N, K * N, N, wt + N * K, N * K, K, K, N, MV)
        q0, q1, q2, q3, q4, q5 = _mv3x2(x0, x1, x2, w_ptr, 2 * K * N, N, wt, 2 * N * K, K, K, N, MV)
        v0, v1, v2 = _mvs3v(x0, x1, x2, x3, x4, x5, w_ptr, K * N, N, wt, N * K, K, K, N, MV)
        n = tl.arange(0, N)
        tl.store(out_ptr + n, s3)
        tl.store(out_ptr + N + n, s2)
        tl.store(out_ptr + 2 * N + n, p0)
        tl.store(out_ptr + 3 * N + n, p1)
        tl.store(out_ptr + 4 * N + n, q0)
        tl.store(out_ptr + 5 * N + n, q1)
        tl.store(out_ptr + 6 * N + n, q2)
        tl.store(out_ptr + 7 * N + n, q3)
        tl.store(out_ptr + 8 * N + n, q4)
        tl.store(out_ptr + 9 * N + n, q5)
        tl.store(out_ptr + 10 * N + n, v0)
        tl.store(out_ptr + 11 * N + n, v1)
        tl.store(out_ptr + 12 * N + n, v2)


@pytest.fixture(params=["one reduction", "a sum each"])
def reduction_form(request, triton_device, monkeypatch):
    """Both forms of the grouped sums on the interpreter (the module's switch is read when a kernel runs there);
    on CUDA the compiled kernels keep the form they were compiled with (the GPU's), so the other is skipped."""
    one = request.param == "one reduction"
    if triton_device.type == "cuda":
        if not one:
            pytest.skip("compiled kernels keep the GPU's form (one reduction)")
    else:
        monkeypatch.setattr(dk, "ONE_REDUCTION", tl.constexpr(one))
    return triton_device


@pytest.mark.parametrize("axis", [0, 1])
def test_grouped_sums_equal_each_sum(reduction_form, axis):
    device = reduction_form
    r, c = 8, 16
    x = torch.randn(6, r, c, dtype=torch.float64, generator=torch.Generator().manual_seed(axis)).to(device)
    out = torch.full((15, c if axis == 0 else r), float("nan"), dtype=torch.float64, device=device)
    _sums_kernel[(1,)](x, out, R=r, C=c, AXIS=axis)
    s = x.sum(dim=1 + axis)
    want = torch.stack([s[0], s[1], s[2], s[3], s[4], s[5], s[0], s[1], s[2], *s])
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mv", [0, 1], ids=["columns", "rows"])
def test_products_reduced_once_equal_the_matrix_products(reduction_form, mv):
    """``_mvs`` (three and two terms), ``_mv2o``, ``_mv3x2`` and ``_mvs3v`` against torch's matrix products, the
    weights read as themselves (MV 0) or as their transposes (MV 1), as the dense kernels lay them out."""
    device = reduction_form
    k, n = 16, 32
    gen = torch.Generator().manual_seed(7 + mv)
    x = torch.randn(6, k, dtype=torch.float64, generator=gen)
    m = torch.randn(3, k, n, dtype=torch.float64, generator=gen)
    w = torch.cat([m.reshape(-1), m.transpose(1, 2).contiguous().reshape(-1)]).to(device)
    out = torch.full((13, n), float("nan"), dtype=torch.float64, device=device)
    _products_kernel[(1,)](x.to(device), w, out, K=k, N=n, MV=mv)
    want = torch.stack(
        [
            x[0] @ m[0] + x[1] @ m[1] + x[2] @ m[2],
            x[3] @ m[0] + x[4] @ m[1],
            x[5] @ m[1],
            x[5] @ m[2],
            *(x[i] @ m[0] for i in range(3)),
            *(x[i] @ m[2] for i in range(3)),
            *(x[i] @ m[0] + x[i + 3] @ m[1] for i in range(3)),
        ]
    )
    torch.testing.assert_close(out.cpu(), want, rtol=1e-12, atol=1e-12)
