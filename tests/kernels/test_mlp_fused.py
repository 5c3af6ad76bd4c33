"""The two-layer MLP in one launch (kernels.mlp_fused): its kernel on the interpreter against float64, its use by
kernels.mlp and the fused update block where switched on, and on a Hopper GPU the bits of the two GEMM launches."""

import importlib

import pytest
import torch
from mlff_distiller.kernels import gemm_fusable, mlp, mlp_reference, painn_update, painn_update_reference, use_backend
from torch.nn import functional as nnf

lin = importlib.import_module("mlff_distiller.kernels.linear")
fused = importlib.import_module("mlff_distiller.kernels.mlp_fused")


def _rand(*shape, gen, device="cpu", scale=1.0):
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(device=device, dtype=torch.float32)


def _close(actual, expected, tol, what):
    assert actual.shape == expected.shape, what
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    err = (actual.double() - expected.double()).norm().item()
    assert err <= tol * max(expected.double().norm().item(), 1e-30), f"{what}: normwise error {err:.3e}"


def _weights(k, h, n, gen, device="cpu"):
    return (
        _rand(h, k, gen=gen, device=device, scale=k**-0.5),
        _rand(h, gen=gen, device=device),
        _rand(n, h, gen=gen, device=device, scale=h**-0.5),
        _rand(n, gen=gen, device=device),
    )


def _silu_grad(p):
    sg = torch.sigmoid(p)
    return sg * (1 + p * (1 - sg))


def _interpreter_only(triton_device):
    if triton_device.type != "cpu":
        pytest.skip("the interpreter's case; on CUDA test_mlp2_equals_two_gemms_on_cuda runs the kernel")
    if lin._TensorDescriptor is None:
        pytest.skip("this Triton has no host-side tensor descriptors")


@pytest.mark.parametrize("m, k, h, n", [(150, 80, 64, 96), (70, 128, 128, 384), (1, 256, 128, 64)])
def test_mlp2_kernel_forward_on_the_interpreter(triton_device, m, k, h, n):
    """The forward launch: out = W2 SiLU(W1 x + b1) + b2 and its pre-activation against float64, with rows, K and
    output columns that leave the last tiles partial (the descriptors' zero fill and clipped stores)."""
    _interpreter_only(triton_device)
    gen = torch.Generator().manual_seed(m + k + h + n)
    x = _rand(m, k, gen=gen)
    w1, b1, w2, b2 = _weights(k, h, n, gen)
    out, pre = torch.full((m, n), float("nan")), torch.full((m, h), float("nan"))
    fused._launch_mlp2(x, w1, b1, pre, w2, b2, None, out, m, k, n, h, False, "ieee")
    pre_ref = x.double() @ w1.double().T + b1.double()
    _close(pre, pre_ref, 1e-6, "pre")
    _close(out, nnf.silu(pre_ref) @ w2.double().T + b2.double(), 1e-6, "out")


@pytest.mark.parametrize("addend", [False, True])
@pytest.mark.parametrize("m, k, h, n", [(150, 80, 64, 96), (70, 128, 128, 384)])
def test_mlp2_kernel_backward_on_the_interpreter(triton_device, m, k, h, n, addend):
    """The backward launch: g_x = (SiLU'(pre) ⊙ (g W2)) W1 (+ an addend: the residual alias's gradient) against
    float64, from the weights' kept transposes."""
    _interpreter_only(triton_device)
    gen = torch.Generator().manual_seed(3 * m + n)
    g, pre = _rand(m, n, gen=gen), _rand(m, h, gen=gen, scale=2.0)
    w1, _, w2, _ = _weights(k, h, n, gen)
    d = _rand(m, k, gen=gen) if addend else None
    out = torch.full((m, k), float("nan"))
    fused._launch_mlp2(g, w2.t().contiguous(), None, pre, w1.t().contiguous(), None, d, out, m, n, k, h, True, "ieee")
    expect = ((g.double() @ w2.double()) * _silu_grad(pre.double())) @ w1.double()
    if addend:
        expect = expect + d.double()
    _close(out, expect, 1e-6, "g_x")


def _count_launches(monkeypatch):
    calls = []
    real = fused._launch_mlp2
    monkeypatch.setattr(fused, "_launch_mlp2", lambda *a, **kw: calls.append(a[12]) or real(*a, **kw))
    return calls


def test_mlp_takes_the_fused_launch_when_switched_on(triton_device, monkeypatch):
    """kernels.mlp with ``fused_mlp_min_rows`` reached: one fused launch forward and one backward (a spy counts
    them, BWD False then True), output and gradient wrt x (with the residual alias's gradient added) as the
    float64 reference; below the threshold, none. Off (None, shipped): never."""
    _interpreter_only(triton_device)
    gen = torch.Generator().manual_seed(11)
    m, k, h, n = 90, 128, 128, 384
    ws = _weights(k, h, n, gen)
    calls = _count_launches(monkeypatch)
    assert lin._CONFIG["fused_mlp_min_rows"] is None
    monkeypatch.setitem(lin._CONFIG, "fused_mlp_min_rows", 64)
    for rows, launches in ((m, [False, True]), (40, [])):
        calls.clear()
        x = _rand(rows, k, gen=gen).requires_grad_(True)
        up, up_alias = _rand(rows, n, gen=gen), _rand(rows, k, gen=gen)
        with use_backend("triton"):
            assert gemm_fusable(x, *ws)
            y, alias = mlp(x, *ws, residual=True)
            (g,) = torch.autograd.grad((y, alias), x, (up, up_alias))
        assert calls == launches
        x64 = x.detach().double().requires_grad_(True)
        y_ref = mlp_reference(x64, *(w.double() for w in ws))
        (g_ref,) = torch.autograd.grad(y_ref, x64, up.double())
        _close(y, y_ref.detach(), 1e-6, "MLP output")
        _close(g, g_ref + up_alias.double(), 1e-6, "MLP gradient wrt x")


@pytest.mark.parametrize("need_v", [True, False])
def test_update_block_takes_the_fused_launch_when_switched_on(triton_device, monkeypatch, need_v):
    """The fused update block's mixing MLP with the fused launch (forward and backward; the last layer's 2F-wide
    tail too) against the torch reference, gradients wrt s and v included."""
    _interpreter_only(triton_device)
    gen = torch.Generator().manual_seed(21 + need_v)
    n_atoms, f = 70, 64
    s = _rand(n_atoms, f, gen=gen).requires_grad_(True)
    v = _rand(n_atoms, 3, f, gen=gen).requires_grad_(True)
    weights = (
        _rand(f, f, gen=gen, scale=f**-0.5),
        _rand(f, f, gen=gen, scale=f**-0.5),
        _rand(f, 2 * f, gen=gen, scale=(2 * f) ** -0.5),
        _rand(f, gen=gen),
        _rand(3 * f, f, gen=gen, scale=f**-0.5),
        _rand(3 * f, gen=gen),
    )
    calls = _count_launches(monkeypatch)
    monkeypatch.setitem(lin._CONFIG, "fused_mlp_min_rows", 1)
    with use_backend("triton"):
        s_out, v_out = painn_update(s, v, *weights, need_v=need_v)
        outs = (s_out,) if v_out is None else (s_out, v_out)
        ups = tuple(torch.randn(o.shape, generator=gen, dtype=torch.float64).float() for o in outs)
        g_s, g_v = torch.autograd.grad(outs, (s, v), ups)
    assert calls == [False, True]
    s64, v64 = (t.detach().double().requires_grad_(True) for t in (s, v))
    ref = painn_update_reference(s64, v64, *(w.double() for w in weights), need_v=need_v)
    ref = ref[:1] if not need_v else ref
    for a, b, what in zip(outs, ref, ("s_out", "v_out"), strict=False):
        _close(a, b.detach(), 1e-5, what)
    r_s, r_v = torch.autograd.grad(ref, (s64, v64), tuple(u.double() for u in ups))
    _close(g_s, r_s, 1e-5, "grad s")
    _close(g_v, r_v, 1e-5, "grad v")


def test_plan_refuses_what_the_kernel_does_not_take(monkeypatch):
    """The fused launch applies only where switched on and reached, to float32 operands with 16-byte aligned
    rows, a hidden width that is a power of two from 64, and one kernel dot for both weights (not tf32x3 with W's
    parts made once)."""
    gen = torch.Generator().manual_seed(5)
    x = _rand(100, 128, gen=gen)
    w1, b1, w2, b2 = _weights(128, 128, 384, gen)
    monkeypatch.setitem(lin._CONFIG, "fused_mlp_min_rows", None)
    assert fused.mlp2_forward(x, w1, b1, w2, b2, "ieee") is None
    monkeypatch.setitem(lin._CONFIG, "fused_mlp_min_rows", 101)
    assert fused.mlp2_forward(x, w1, b1, w2, b2, "ieee") is None
    monkeypatch.setitem(lin._CONFIG, "fused_mlp_min_rows", 1)
    assert fused._plan(x, 100, 96, w1, w2, "ieee", (x,)) is None  # H not a power of two
    assert fused._plan(x, 100, 32, w1, w2, "ieee", (x,)) is None  # H / 4 below the dot's 16
    assert fused._plan(x, 100, 128, w1, w2, "ieee", (x.double(),)) is None
    assert fused._plan(x, 100, 128, w1, w2, "ieee", (x[:, 1:],)) is None  # unaligned rows
    assert fused._plan(x, 100, 128, w1, w2, "ieee", (x,)) == "ieee"
    assert fused._plan(x, 100, 128, w1, w2, "tf32x3", (x,)) == "tf32x3"
    assert fused._plan(x, 3000, 128, w1, w2, "tf32x3", (x,)) is None  # W's parts made once: two tiles a product
    from mlff_distiller.kernels._frozen import round_tf32_

    w1r, w2r = w1.clone(), w2.clone()
    round_tf32_(w1r)
    round_tf32_(w2r)
    assert fused._plan(x, 3000, 128, w1r, w2r, "tf32x3", (x,)) == "tf32x2f"
    assert fused._plan(x, 3000, 128, w1r, w2, "tf32x3", (x,)) is None  # one weight on the grid, one not


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("m", [3001, 22000])
@pytest.mark.parametrize("k, n", [(128, 384), (256, 384), (256, 256)])
def test_mlp2_equals_two_gemms_on_cuda(monkeypatch, m, k, n):
    """On a Hopper GPU the fused launch gives the bits of the two GEMM launches (H = 128: its hidden tiles are the
    GEMM's K steps), forward (out and pre) and backward (with an addend), weights on the TF32 grid (two MMAs, the
    shipped students) and in one TF32 pass; within float32 accuracy of float64."""
    from mlff_distiller.kernels._frozen import round_tf32_

    dev = torch.device("cuda")
    if torch.cuda.get_device_capability(dev)[0] < 9 or lin._TensorDescriptor is None:
        pytest.skip("the descriptor path needs sm90+ and Triton's host-side descriptors")
    monkeypatch.setitem(lin._CONFIG, "tma_eager_min_rows", 0)
    gen = torch.Generator().manual_seed(m + k + n)
    h = 128
    x, g = _rand(m, k, gen=gen, device=dev), _rand(m, n, gen=gen, device=dev)
    d = _rand(m, k, gen=gen, device=dev)
    w1, b1, w2, b2 = _weights(k, h, n, gen, device=dev)
    round_tf32_(w1)
    round_tf32_(w2)
    for dot in ("tf32x3", "tf32"):
        monkeypatch.setitem(lin._CONFIG, "fused_mlp_min_rows", 1)
        got = fused.mlp2_forward(x, w1, b1, w2, b2, dot)
        assert got is not None
        out, pre = got
        g_x = fused.mlp2_backward(g, w1, w2, pre, dot, addend=d)
        assert g_x is not None
        h_ref, pre_ref = lin.gemm(x, w1, b1, act="silu", dot=dot)
        out_ref = lin.gemm(h_ref, w2, b2, dot=dot)[0]
        g_h = lin.gemm(g, w2, transpose_w=False, dot=dot)[0]
        g_x_ref = lin.gemm(g_h, w1, transpose_w=False, prologue_silu_of=pre_ref, addend=d, dot=dot)[0]
        assert torch.equal(pre, pre_ref), dot
        assert torch.equal(out, out_ref), dot
        assert torch.equal(g_x, g_x_ref), dot
        if dot == "tf32x3":
            p64 = x.double() @ w1.double().T + b1.double()
            _close(out, nnf.silu(p64) @ w2.double().T + b2.double(), 1e-6, "out")
            gx64 = ((g.double() @ w2.double()) * _silu_grad(p64)) @ w1.double() + d.double()
            _close(g_x, gx64, 1e-6, "g_x")
