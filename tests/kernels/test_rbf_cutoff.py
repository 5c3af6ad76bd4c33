"""Triton rbf_cutoff (forward, backward, double backward) against the torch reference.

Tolerances. The oracle is the torch reference evaluated in float64 on the same inputs (for float32 inputs
too: the float32 reference is itself off by up to 1e-2 relative in the Bessel gradient at small d).
  * outputs, elementwise: float32 atol = rtol = 1e-5; float64 atol = rtol = 1e-12.
  * first gradients: |g - g_ref| <= tol·(|g_ref| + S), same tol, with
    S = Σ_k |go_k| (|R_k'| + d |R_k''| + |B_k'| + |B_k|/rc). g = Σ_k go_k R_k'(d) is a sum of terms that
    can cancel; near a zero of sin(kπd/rc), R_k' is sensitive to the last bit of d; next to the cutoff the
    reference's own envelope (an expanded polynomial) is only absolutely accurate. S is the bound of a
    backward-stable evaluation: the term magnitudes, their change under a relative tol perturbation of d,
    and an absolute tol error in the envelope f (tol/rc in f').
  * double backward: normwise, |g - g_ref| <= tol·|g_ref| + 10·tol·max|g_ref|.
The full size grid (up to 100003 edges, a prime larger than any block) also runs on the CPU interpreter.
"""

import os
import subprocess
import sys

import pytest
import torch
from mlff_distiller.kernels import BASES, ENVELOPES, rbf_cutoff, rbf_cutoff_reference, use_backend
from mlff_distiller.kernels.rbf_cutoff import basis_reference

CUTOFF = 5.0
N_RBF = 20
TOL = {torch.float32: 1e-5, torch.float64: 1e-12}
SIZES = [0, 1, 7, 1000, 100003]
PATHS = ["dispatch", "op"]
OPS = torch.ops.mlff_distiller


def _special(dtype, device):
    # d = 0, inside the reference's Taylor branch (d < 1e-4), near / at / beyond the cutoff. Between 1e-4 and
    # ~1e-3 the float64 reference's own gradient is only good to ~1e-11 absolute (its formula cancels), so the
    # random draws start at 1e-3; gradcheck covers that range against finite differences.
    return torch.tensor([0.0, 3e-5, 0.5, CUTOFF - 1e-3, CUTOFF, CUTOFF + 0.3, 1.0], dtype=dtype, device=device)


def _distances(n, dtype, device, low=1e-3, special=True):
    d = torch.empty(n, dtype=dtype, device=device).uniform_(low, 1.2 * CUTOFF)
    if special and n >= 7:
        d[:7] = _special(dtype, device)
    return d


def _assert_close(actual, expected, tol, normwise=False):
    actual = actual.double()
    assert torch.isfinite(actual).all(), "non-finite values in the Triton result"
    atol = tol * (expected.abs().max().item() if normwise and expected.numel() else 1.0)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=tol)


def _assert_grad_close(actual, expected, scale, tol):
    """|actual - expected| <= tol·(|expected| + scale), elementwise."""
    actual = actual.double()
    assert torch.isfinite(actual).all(), "non-finite values in the Triton gradient"
    err = (actual - expected).abs()
    bound = tol * (expected.abs() + scale)
    over = err > bound
    assert not over.any(), f"{int(over.sum())} gradient entries beyond the bound; worst error {(err - bound).max():.3g}"


def _grad_scale(d, grad_out, basis, envelope, n_rbf=N_RBF):
    """S of the module docstring per edge, from float64 derivative tiles (jvps along ones)."""

    def deriv(fn):
        return lambda x: torch.func.jvp(fn, (x,), (torch.ones_like(x),))[1]

    def rbf(x):
        return rbf_cutoff_reference(x, n_rbf, CUTOFF, basis, envelope)

    def bas(x):
        return basis_reference(x, n_rbf, CUTOFF, basis)

    r1, r2, b1 = deriv(rbf)(d), deriv(deriv(rbf))(d), deriv(bas)(d)
    terms = r1.abs() + d[:, None].abs() * r2.abs() + b1.abs() + bas(d).abs() / CUTOFF
    return (grad_out.abs() * terms).sum(-1)


def _rbf_triton(d, n_rbf=N_RBF, basis="bessel", envelope="cosine", path="dispatch"):
    """The Triton path: through the public dispatcher (eager autograd.Functions) or the torch.library op
    itself (what torch.compile uses); both run the same kernels and must agree with the reference."""
    if path == "op":
        return OPS.rbf_cutoff(d, n_rbf, CUTOFF, basis, envelope)
    with use_backend("triton"):
        return rbf_cutoff(d, n_rbf, CUTOFF, basis, envelope)


@pytest.mark.parametrize("envelope", ENVELOPES)
@pytest.mark.parametrize("basis", BASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n_edges", SIZES)
@pytest.mark.parametrize("path", PATHS)
def test_matches_reference(triton_device, path, n_edges, dtype, basis, envelope, poison):
    if path == "op" and n_edges > 1000:
        pytest.skip("the op path shares every kernel and host function with the dispatcher path; sizes <= 1000")
    d = _distances(n_edges, dtype, triton_device).requires_grad_(True)
    poison(n_edges * N_RBF, dtype, triton_device)
    out = _rbf_triton(d, N_RBF, basis, envelope, path)
    assert out.shape == (n_edges, N_RBF) and out.dtype == dtype and out.device == d.device

    d64 = d.detach().double().requires_grad_(True)
    ref = rbf_cutoff_reference(d64, N_RBF, CUTOFF, basis, envelope)
    _assert_close(out, ref, TOL[dtype])

    grad_out = torch.randn_like(out)
    (g,) = torch.autograd.grad(out, d, grad_out)
    (g_ref,) = torch.autograd.grad(ref, d64, grad_out.double())
    _assert_grad_close(g, g_ref, _grad_scale(d64.detach(), grad_out.double(), basis, envelope), TOL[dtype])


@pytest.mark.parametrize("envelope", ENVELOPES)
@pytest.mark.parametrize("basis", BASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("path", PATHS)
def test_double_backward_matches_reference(triton_device, path, dtype, basis, envelope):
    # Away from d -> 0, where the reference's own second derivative cancels catastrophically (gradgradcheck
    # below covers small d against finite differences of the kernels).
    d = _distances(257, dtype, triton_device, low=0.05, special=False).requires_grad_(True)
    go = torch.randn(257, N_RBF, dtype=dtype, device=triton_device, requires_grad=True)
    (g,) = torch.autograd.grad(_rbf_triton(d, N_RBF, basis, envelope, path), d, go, create_graph=True)
    gg = torch.randn_like(g)
    dd, dgo = torch.autograd.grad(g, (d, go), gg)

    d64 = d.detach().double().requires_grad_(True)
    go64 = go.detach().double().requires_grad_(True)
    (g_ref,) = torch.autograd.grad(
        rbf_cutoff_reference(d64, N_RBF, CUTOFF, basis, envelope), d64, go64, create_graph=True
    )
    dd_ref, dgo_ref = torch.autograd.grad(g_ref, (d64, go64), gg.double())
    _assert_close(dd, dd_ref, 10 * TOL[dtype], normwise=True)
    _assert_close(dgo, dgo_ref, TOL[dtype], normwise=True)


@pytest.mark.parametrize("n_rbf", [1, 2, 3, 7, 16, 33, 150])
@pytest.mark.parametrize("basis", BASES)
def test_column_chunking(triton_device, n_rbf, basis):
    """n_rbf is split into power-of-two column chunks (and 128-wide blocks); each must write its columns."""
    d = _distances(101, torch.float64, triton_device, low=0.05, special=False).requires_grad_(True)
    out = _rbf_triton(d, n_rbf, basis, "polynomial")
    ref = rbf_cutoff_reference(d, n_rbf, CUTOFF, basis, "polynomial")
    _assert_close(out, ref, TOL[torch.float64])
    go = torch.randn_like(out, requires_grad=True)
    (g,) = torch.autograd.grad(out, d, go, create_graph=True)
    (g_ref,) = torch.autograd.grad(ref, d, go, create_graph=True)
    _assert_close(g, g_ref, 1e-12, normwise=True)
    gg = torch.randn_like(g)
    _assert_close(torch.autograd.grad(g, go, gg)[0], torch.autograd.grad(g_ref, go, gg)[0], 1e-12, normwise=True)


@pytest.mark.parametrize("envelope", ENVELOPES)
@pytest.mark.parametrize("basis", BASES)
@pytest.mark.parametrize("path", PATHS)
def test_gradcheck_and_gradgradcheck(triton_device, path, basis, envelope):
    # Small d (0, inside and just above the Taylor branch), mid-range, near and beyond the cutoff; exactly d =
    # rc is left out because f'' jumps there, so finite differences of the first derivative straddle a kink.
    d = torch.tensor([0.0, 3e-5, 2e-3, 0.3, 1.7, 4.98, 4.9999, 5.3], dtype=torch.float64, device=triton_device)
    d.requires_grad_(True)

    def fn(x):
        return _rbf_triton(x, 6, basis, envelope, path)

    # fast mode (a random projection of the Jacobian, as the other kernels' gradchecks): the full one took one
    # backward per output element, 48 here, up to 18 s a case under the interpreter
    assert torch.autograd.gradcheck(fn, (d,), fast_mode=True)
    assert torch.autograd.gradgradcheck(fn, (d,), fast_mode=True)


@pytest.mark.parametrize("path", PATHS)
def test_empty_and_noncontiguous(triton_device, path):
    d = torch.empty(0, dtype=torch.float32, device=triton_device, requires_grad=True)
    out = _rbf_triton(d, path=path)
    assert out.shape == (0, N_RBF)
    (g,) = torch.autograd.grad(out, d, torch.ones_like(out), create_graph=True)
    assert g.shape == (0,)
    (gg,) = torch.autograd.grad(g.sum(), d, allow_unused=True, materialize_grads=True)
    assert gg.shape == (0,)

    base = _distances(300, torch.float64, triton_device, special=False)
    d = base[::3]
    assert not d.is_contiguous()
    _assert_close(_rbf_triton(d, path=path), rbf_cutoff_reference(d, N_RBF, CUTOFF), 1e-12)


def test_op_registration(triton_device):
    """Schemas and autograd registrations pass torch.library.opcheck (fake tensors: on CUDA, below)."""
    d = _distances(33, torch.float64, triton_device).requires_grad_(True)
    go = torch.randn(33, 8, dtype=torch.float64, device=triton_device, requires_grad=True)
    for op, args in [
        (OPS.rbf_cutoff.default, (d, 8, CUTOFF, "bessel", "cosine")),
        (OPS.rbf_cutoff_bwd.default, (go, d, 8, CUTOFF, "gaussian", "polynomial")),
    ]:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_autograd_registration"))


@pytest.mark.parametrize("path", PATHS)
def test_bad_dtype_is_a_clear_error(triton_device, path):
    with pytest.raises(TypeError, match="float32 and float64"):
        _rbf_triton(torch.rand(5, device=triton_device).half(), path=path)


def test_module_imports_without_triton():
    """The torch path must not need triton: without it the package imports and runs the reference."""
    code = (
        "import sys; sys.modules['triton'] = None; sys.modules['triton.language'] = None\n"
        "import torch\n"
        "from mlff_distiller import kernels\n"
        "from mlff_distiller.kernels._triton_utils import HAS_TRITON\n"
        "assert not HAS_TRITON and not kernels.triton_available('cpu')\n"
        "d = torch.linspace(0, 6, 11)\n"
        "assert torch.equal(kernels.rbf_cutoff(d, 8, 5.0), kernels.rbf_cutoff_reference(d, 8, 5.0))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MLFF_DISTILLER_KERNELS")}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


# ------------------------------------------------------------------------------------------------------------
# torch.compile (GPU only: compiling a triton_op needs real kernels, not the interpreter)


@pytest.mark.gpu
@pytest.mark.parametrize("basis", BASES)
def test_compile_fullgraph(basis):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch._dynamo.reset()
    d = _distances(1000, torch.float32, torch.device("cuda")).requires_grad_(True)
    go = torch.randn(1000, N_RBF, device="cuda")

    def fwd(x):
        return torch.ops.mlff_distiller.rbf_cutoff(x, N_RBF, CUTOFF, basis, "cosine")

    def bwd(grad_rbf, x):
        return torch.ops.mlff_distiller.rbf_cutoff_bwd(grad_rbf, x, N_RBF, CUTOFF, basis, "cosine")

    # forward + backward through the compiled graph
    out = torch.compile(fwd, fullgraph=True)(d)
    (g,) = torch.autograd.grad(out, d, go)
    out_e = fwd(d)
    (g_e,) = torch.autograd.grad(out_e, d, go)
    torch.testing.assert_close(out, out_e)
    torch.testing.assert_close(g, g_e)

    # the backward op compiled, and its own backward (the double-backward kernel) through the compiled graph
    go_r = go.clone().requires_grad_(True)
    gc = torch.compile(bwd, fullgraph=True)(go_r, d)
    gg = torch.randn_like(gc)
    dd, dgo = torch.autograd.grad(gc, (d, go_r), gg)
    ge = bwd(go_r, d)
    dd_e, dgo_e = torch.autograd.grad(ge, (d, go_r), gg)
    torch.testing.assert_close(gc, ge)
    torch.testing.assert_close(dd, dd_e)
    torch.testing.assert_close(dgo, dgo_e)

    for op, args in [
        (OPS.rbf_cutoff.default, (d, N_RBF, CUTOFF, basis, "cosine")),
        (OPS.rbf_cutoff_bwd.default, (go_r, d, N_RBF, CUTOFF, basis, "cosine")),
        (
            OPS.rbf_cutoff_bwd_bwd.default,
            (torch.randn_like(d), go, d.detach(), N_RBF, CUTOFF, basis, "cosine"),
        ),
    ]:
        torch.library.opcheck(op, args)


@pytest.mark.gpu
def test_compile_force_style_double_backward():
    """Force training inside one compiled graph: energy -> autograd.grad(create_graph) -> loss.backward."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if not hasattr(torch._dynamo.config, "trace_autograd_ops"):
        pytest.skip("this torch cannot trace torch.autograd.grad inside a compiled graph")
    torch._dynamo.reset()
    w = torch.randn(N_RBF, device="cuda", dtype=torch.float64)

    def forces(x):
        energy = (OPS.rbf_cutoff(x, N_RBF, CUTOFF, "bessel", "cosine") @ w).square().sum()
        (g,) = torch.autograd.grad(energy, x, create_graph=True)
        return g

    d = _distances(500, torch.float64, torch.device("cuda"), special=False).requires_grad_(True)
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        fc = torch.compile(forces, fullgraph=True)(d)
    (dc,) = torch.autograd.grad(fc.square().sum(), d)
    fe = forces(d)
    (de,) = torch.autograd.grad(fe.square().sum(), d)
    torch.testing.assert_close(fc, fe)
    torch.testing.assert_close(dc, de)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n_edges", [0, 7, 1000])
@pytest.mark.parametrize("how", ["no_grad", "input_without_grad"])
def test_forward_without_autograd(triton_device, n_edges, dtype, how, poison):
    """Inference takes the host function without an autograd.Function: the reference's values, no graph."""
    d = _distances(n_edges, dtype, triton_device)
    if how == "no_grad":
        d.requires_grad_(True)
    poison(n_edges * N_RBF, dtype, triton_device)
    with torch.no_grad() if how == "no_grad" else torch.enable_grad():
        out = _rbf_triton(d, N_RBF, "bessel", "cosine", "dispatch")
    assert out.shape == (n_edges, N_RBF) and out.dtype == dtype
    assert not out.requires_grad and out.grad_fn is None
    _assert_close(out, rbf_cutoff_reference(d.detach().double(), N_RBF, CUTOFF, "bessel", "cosine"), TOL[dtype])
