"""Triton edge_features and edge_basis: forward, backward to positions and shifts, double backward.

Tolerances. The oracle is the torch reference evaluated in float64 on the same inputs (float32 inputs too).
  * outputs, elementwise: float32 atol = rtol = 1e-5; float64 atol = rtol = 1e-12.
  * first gradients: |g - g_ref| <= tol·(|g_ref| + S), same tol, where S sums the magnitudes of the terms that
    make up the entry (a position gradient sums many edges, each edge n_rbf terms: they cancel, so the bound
    follows the condition of the sum, not |g| alone); see _grad_scales.
  * double backward: normwise, |g - g_ref| <= tol·|g_ref| + 10·tol·max|g_ref|.
The graphs are random: atoms in a box, random pairs, a third of the edges shifted by lattice vectors, and
(from 7 edges on) one zero-length edge: i = j with no shift.
"""

import importlib

import pytest
import torch
from mlff_distiller.kernels import (
    BASES,
    ENVELOPES,
    edge_basis,
    edge_basis_reference,
    edge_features,
    edge_features_reference,
    rbf_cutoff_reference,
    use_backend,
)
from mlff_distiller.kernels.rbf_cutoff import basis_reference
from torch.utils._python_dispatch import TorchDispatchMode

CUTOFF = 5.0
N_RBF = 20
BOX = 6.0
TOL = {torch.float32: 1e-5, torch.float64: 1e-12}
SIZES = [0, 1, 7, 1000, 100003]
PATHS = ["dispatch", "op"]
OPS = torch.ops.mlff_distiller
# The module itself (the package re-exports the function under the same name).
edge_features_module = importlib.import_module("mlff_distiller.kernels.edge_features")
# The edge_basis variants the finer tests run (the reference-comparison test runs all of them).
VARIANTS = [None, ("bessel", "cosine"), ("gaussian", "polynomial")]


def _graph(n_edges, dtype, device, zero_edge=True, n_atoms=None):
    """positions [N,3], edge_index [2,E], shifts [E,3]; edge 0 has zero length if ``zero_edge`` and E >= 7."""
    n_atoms = n_atoms or max(2, n_edges // 8)
    pos = torch.rand(n_atoms, 3, dtype=dtype, device=device) * BOX
    ei = torch.randint(0, n_atoms, (2, n_edges), device=device)
    shifts = torch.zeros(n_edges, 3, dtype=dtype, device=device)
    periodic = (torch.rand(n_edges, device=device) < 0.3) | (ei[0] == ei[1])
    cells = torch.randint(-1, 2, (n_edges, 3), device=device).to(dtype)
    cells[:, 0] = torch.where(cells.abs().sum(1) == 0, 1.0, cells[:, 0])  # a self-loop needs a non-zero shift
    shifts[periodic] = BOX * cells[periodic]
    if zero_edge and n_edges >= 7:
        ei[:, 0] = 0
        shifts[0] = 0.0
    return pos, ei, shifts


def _assert_close(actual, expected, tol, normwise=False):
    actual = actual.double()
    assert torch.isfinite(actual).all(), "non-finite values in the Triton result"
    atol = tol * (expected.abs().max().item() if normwise and expected.numel() else 1.0)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=tol)


def _grad_scales(variant, pos, ei, shifts, grads_out):
    """S for the position [N,1] and shift [E,1] gradients: per edge, the magnitudes of the terms of the
    gradient wrt vec, |g_vec| + |g_dist| + Σ_k |g_rbf,k| (|R_k'| + d |R_k''| + |B_k'| + |B_k|/rc) +
    2|g_unit|/d, summed over the edges of each atom. The rbf part is the bound of a backward-stable
    evaluation, as in test_rbf_cutoff.py."""
    _, dist, _ = edge_features_reference(pos, ei, shifts)
    if variant is None:
        g_vec, g_dist, g_unit = grads_out
        s = g_vec.norm(dim=-1) + g_dist.abs()
    else:
        g_dist, g_unit, g_rbf = grads_out

        def deriv(fn):
            return lambda x: torch.func.jvp(fn, (x,), (torch.ones_like(x),))[1]

        def rbf(x):
            return rbf_cutoff_reference(x, N_RBF, CUTOFF, *variant)

        def bas(x):
            return basis_reference(x, N_RBF, CUTOFF, variant[0])

        terms = deriv(rbf)(dist).abs() + dist[:, None] * deriv(deriv(rbf))(dist).abs()
        terms = terms + deriv(bas)(dist).abs() + bas(dist).abs() / CUTOFF
        s = g_dist.abs() + (g_rbf.abs() * terms).sum(-1)
    nonzero = dist > 0
    s = s + torch.where(nonzero, 2 * g_unit.norm(dim=-1) / torch.where(nonzero, dist, 1.0), g_unit.norm(dim=-1))
    per_atom = torch.zeros(pos.shape[0], dtype=s.dtype, device=s.device).index_add(0, ei[0], s).index_add(0, ei[1], s)
    return per_atom[:, None], s[:, None]


def _assert_grad_close(actual, expected, scale, tol):
    """|actual - expected| <= tol·(|expected| + scale), elementwise."""
    actual = actual.double()
    assert torch.isfinite(actual).all(), "non-finite values in the Triton gradient"
    err = (actual - expected).abs()
    bound = tol * (expected.abs() + scale)
    over = err > bound
    assert not over.any(), f"{int(over.sum())} gradient entries beyond the bound; worst error {(err - bound).max():.3g}"


def _run(variant, pos, ei, shifts, n_rbf=N_RBF, path="dispatch"):
    """The Triton path: through the public dispatcher (eager autograd.Functions) or the torch.library op
    itself (what torch.compile uses); both run the same kernels and must agree with the reference."""
    if path == "op":
        if variant is None:
            return OPS.edge_features(pos, ei, shifts)
        return OPS.edge_basis(pos, ei, shifts, n_rbf, CUTOFF, *variant)
    with use_backend("triton"):
        if variant is None:
            return edge_features(pos, ei, shifts)
        return edge_basis(pos, ei, shifts, n_rbf, CUTOFF, *variant)


def _reference(variant, pos, ei, shifts, n_rbf=N_RBF):
    if variant is None:
        return edge_features_reference(pos, ei, shifts)
    return edge_basis_reference(pos, ei, shifts, n_rbf, CUTOFF, *variant)


def _check_against_reference(variant, pos, ei, shifts, tol, poison, path):
    if path == "op" and ei.shape[1] > 1000:
        pytest.skip("the op path shares every kernel and host function with the dispatcher path; sizes <= 1000")
    pos.requires_grad_(True)
    shifts.requires_grad_(True)
    poison(ei.shape[1] * N_RBF, pos.dtype, pos.device)
    out = _run(variant, pos, ei, shifts, path=path)
    pos64 = pos.detach().double().requires_grad_(True)
    sh64 = shifts.detach().double().requires_grad_(True)
    ref = _reference(variant, pos64, ei, sh64)
    for o, r in zip(out, ref, strict=True):
        assert o.shape == r.shape and o.dtype == pos.dtype and o.device == pos.device
        _assert_close(o, r, tol)
    grads_out = [torch.randn_like(o) for o in out]
    grads_out64 = [go.double() for go in grads_out]
    g = torch.autograd.grad(out, (pos, shifts), grads_out)
    g_ref = torch.autograd.grad(ref, (pos64, sh64), grads_out64)
    scales = _grad_scales(variant, pos64.detach(), ei, sh64.detach(), grads_out64)
    for a, b, scale in zip(g, g_ref, scales, strict=True):
        _assert_grad_close(a, b, scale, tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n_edges", SIZES)
@pytest.mark.parametrize("path", PATHS)
def test_edge_features_matches_reference(triton_device, path, n_edges, dtype, poison):
    pos, ei, shifts = _graph(n_edges, dtype, triton_device)
    _check_against_reference(None, pos, ei, shifts, TOL[dtype], poison, path)


@pytest.mark.parametrize("envelope", ENVELOPES)
@pytest.mark.parametrize("basis", BASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n_edges", SIZES)
@pytest.mark.parametrize("path", PATHS)
def test_edge_basis_matches_reference(triton_device, path, n_edges, dtype, basis, envelope, poison):
    pos, ei, shifts = _graph(n_edges, dtype, triton_device)
    _check_against_reference((basis, envelope), pos, ei, shifts, TOL[dtype], poison, path)


@pytest.mark.parametrize("segmented", [True, False], ids=["segmented", "atomics"])
@pytest.mark.parametrize("variant", VARIANTS[:2], ids=["features", "basis-bessel-cos"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sorted_receivers(triton_device, dtype, variant, segmented, poison, monkeypatch):
    """Receiver-sorted edges, as the neighbour lists produce them: runs of ~700 edges of one atom i that
    cross block boundaries and end in the masked tail. The backward's segmented receiver sum (and the plain
    per-edge atomics it replaces) must give the reference's position gradients."""
    if triton_device.type == "cpu" and segmented and (dtype, variant) != (torch.float64, None):
        pytest.skip("the interpreter scans element by element (seconds per block): one CPU case suffices")
    monkeypatch.setitem(edge_features_module._OPTIONS, "segmented_receivers", segmented)
    monkeypatch.setitem(edge_features_module._OPTIONS, "segmented_receivers_cpu", segmented)
    pos, ei, shifts = _graph(5003, dtype, triton_device, zero_edge=False, n_atoms=7)
    order = ei[0].argsort(stable=True)  # permuting whole edges keeps each (i, j, shift) intact
    ei, shifts = ei[:, order].contiguous(), shifts[order].contiguous()
    assert (ei[0, 1:] >= ei[0, :-1]).all()
    _check_against_reference(variant, pos, ei, shifts, TOL[dtype], poison, "dispatch")


@pytest.mark.parametrize("variant", VARIANTS, ids=["features", "basis-bessel-cos", "basis-gauss-poly"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("path", PATHS)
def test_double_backward_matches_reference(triton_device, path, dtype, variant):
    """Force-training pattern: first gradients with create_graph, then the gradient of a loss on them wrt the
    inputs and the upstream gradients (what edge_*_bwd_bwd computes)."""

    def second_order(run, pos, ei, shifts, grads_out, w_pos, w_shift):
        out = run(variant, pos, ei, shifts) if run is _reference else run(variant, pos, ei, shifts, path=path)
        g_pos, g_shift = torch.autograd.grad(out, (pos, shifts), grads_out, create_graph=True)
        loss = (g_pos * w_pos).sum() + (g_shift * w_shift).sum()
        return torch.autograd.grad(loss, (pos, shifts, *grads_out))

    pos, ei, shifts = _graph(500, dtype, triton_device)
    pos.requires_grad_(True)
    shifts.requires_grad_(True)
    shapes = [(500, 3), (500,), (500, 3)] if variant is None else [(500,), (500, 3), (500, N_RBF)]
    grads_out = [torch.randn(s, dtype=dtype, device=triton_device, requires_grad=True) for s in shapes]
    w_pos, w_shift = torch.randn_like(pos), torch.randn_like(shifts)
    got = second_order(_run, pos, ei, shifts, grads_out, w_pos, w_shift)

    p64, s64 = pos.detach().double().requires_grad_(True), shifts.detach().double().requires_grad_(True)
    go64 = [g.detach().double().requires_grad_(True) for g in grads_out]
    want = second_order(_reference, p64, ei, s64, go64, w_pos.double(), w_shift.double())
    for a, b in zip(got, want, strict=True):
        _assert_close(a, b, 10 * TOL[dtype], normwise=True)


@pytest.mark.parametrize("variant", VARIANTS, ids=["features", "basis-bessel-cos", "basis-gauss-poly"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("path", PATHS)
def test_zero_length_edges(triton_device, path, dtype, variant):
    """Coincident atoms and an unshifted self-loop: dist 0, unit 0, finite gradients of every order, exactly
    the reference's values."""
    pos = torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.5, -0.2], [1.0, 0.5, -0.2], [2.0, 2.0, 2.0]], dtype=dtype)
    pos = pos.to(triton_device).requires_grad_(True)
    ei = torch.tensor([[0, 1, 2, 3, 1], [0, 2, 1, 0, 3]], device=triton_device)
    shifts = torch.zeros(5, 3, dtype=dtype, device=triton_device, requires_grad=True)
    out = _run(variant, pos, ei, shifts, path=path)
    ref = _reference(variant, pos, ei, shifts)
    dist, unit = (out[1], out[2]) if variant is None else (out[0], out[1])
    assert torch.equal(dist[:3], torch.zeros_like(dist[:3])) and torch.equal(unit[:3], torch.zeros_like(unit[:3]))
    for o, r in zip(out, ref, strict=True):
        _assert_close(o, r.double(), TOL[dtype])
    grads_out = [torch.randn_like(o) for o in out]
    g = torch.autograd.grad(out, (pos, shifts), grads_out, create_graph=True)
    g_ref = torch.autograd.grad(ref, (pos, shifts), grads_out, create_graph=True)
    w = [torch.randn_like(x) for x in g]
    gg = torch.autograd.grad(sum((a * b).sum() for a, b in zip(g, w, strict=True)), (pos, shifts))
    gg_ref = torch.autograd.grad(sum((a * b).sum() for a, b in zip(g_ref, w, strict=True)), (pos, shifts))
    for a, b in zip(g + gg, g_ref + gg_ref, strict=True):
        _assert_close(a, b.double(), 10 * TOL[dtype], normwise=True)


@pytest.mark.parametrize("variant", [None, *[(b, e) for b in BASES for e in ENVELOPES]])
@pytest.mark.parametrize("path", PATHS)
def test_gradcheck_and_gradgradcheck(triton_device, path, variant):
    """float64 finite differences on a small graph with a zero-length edge (edge 0), a 1e-3 Å edge (edge 1),
    edges near and beyond the cutoff. The direction of a zero-length edge is undefined (unit jumps under any
    perturbation), so that edge's dist/unit/rbf outputs are left out of the checked function; it still flows
    through every kernel."""
    dev = triton_device
    pos, ei, shifts = _graph(14, torch.float64, dev, n_atoms=6)
    pos[2] = pos[1] + torch.tensor([1e-3, 0.0, 0.0], dtype=torch.float64, device=dev)
    ei[:, 1] = torch.tensor([1, 2], device=dev)
    shifts[1] = 0.0
    # Self-loops whose shift sets the length: just inside, beyond, well inside the cutoff.
    for e, (atom, length) in enumerate([(3, CUTOFF - 1e-2), (4, CUTOFF + 0.2), (5, 0.9 * CUTOFF)], start=2):
        ei[:, e] = atom
        shifts[e] = torch.tensor([0.6, 0.0, 0.8], dtype=torch.float64, device=dev) * length
    pos.requires_grad_(True)
    shifts.requires_grad_(True)
    keep = torch.arange(14, device=triton_device) > 0

    def fn(p, s):
        out = _run(variant, p, ei, s, n_rbf=5, path=path)
        if variant is None:
            return out[0], out[1][keep], out[2][keep]
        return tuple(o[keep] for o in out)

    assert torch.autograd.gradcheck(fn, (pos, shifts), fast_mode=True)
    assert torch.autograd.gradgradcheck(fn, (pos, shifts), fast_mode=True)


@pytest.mark.parametrize("variant", VARIANTS, ids=["features", "basis-bessel-cos", "basis-gauss-poly"])
@pytest.mark.parametrize("path", PATHS)
def test_layouts_and_empty(triton_device, path, variant):
    # Non-contiguous positions / shifts, edge_index as the transpose of [E, 2] and as int32.
    pos, ei, shifts = _graph(200, torch.float64, triton_device)
    pos_nc = torch.stack([pos, torch.full_like(pos, float("nan"))], dim=-1)[..., 0]
    shifts_nc = torch.stack([torch.full_like(shifts, float("nan")), shifts], dim=-1)[..., 1]
    ei_t = ei.t().contiguous().t()
    assert not (pos_nc.is_contiguous() or shifts_nc.is_contiguous() or ei_t.is_contiguous())
    ref = _reference(variant, pos, ei, shifts)
    for args in [(pos_nc, ei_t, shifts_nc), (pos, ei.to(torch.int32), shifts)]:
        for o, r in zip(_run(variant, *args, path=path), ref, strict=True):
            _assert_close(o, r, 1e-12)

    # E = 0: right shapes, gradients of the right shape, nothing launched.
    pos = pos.requires_grad_(True)
    empty_ei = torch.empty(2, 0, dtype=torch.long, device=triton_device)
    empty_sh = torch.empty(0, 3, dtype=torch.float64, device=triton_device, requires_grad=True)
    out = _run(variant, pos, empty_ei, empty_sh, path=path)
    for o, r in zip(out, _reference(variant, pos, empty_ei, empty_sh), strict=True):
        assert o.shape == r.shape
    g_pos, g_sh = torch.autograd.grad(out, (pos, empty_sh), [torch.ones_like(o) for o in out], create_graph=True)
    assert torch.equal(g_pos, torch.zeros_like(pos)) and g_sh.shape == (0, 3)


def test_op_registration(triton_device):
    """Schemas and autograd registrations pass torch.library.opcheck (fake tensors: on CUDA, below)."""
    pos, ei, shifts = _graph(40, torch.float64, triton_device)
    pos.requires_grad_(True)
    shifts.requires_grad_(True)
    for op, args in [
        (OPS.edge_features.default, (pos, ei, shifts)),
        (OPS.edge_basis.default, (pos, ei, shifts, 6, CUTOFF, "bessel", "polynomial")),
    ]:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_autograd_registration"))


@pytest.mark.parametrize("path", PATHS)
def test_mixed_dtypes_are_a_clear_error(triton_device, path):
    pos, ei, shifts = _graph(10, torch.float64, triton_device)
    with pytest.raises(TypeError, match="share a dtype"):
        _run(None, pos, ei, shifts.float(), path=path)


# ------------------------------------------------------------------------------------------------------------
# torch.compile (GPU only: compiling a triton_op needs real kernels, not the interpreter)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS, ids=["features", "basis-bessel-cos", "basis-gauss-poly"])
def test_compile_fullgraph(variant):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch._dynamo.reset()
    dev = torch.device("cuda")
    pos, ei, shifts = _graph(2000, torch.float32, dev)
    pos.requires_grad_(True)
    shifts.requires_grad_(True)
    rbf = () if variant is None else (N_RBF, CUTOFF, *variant)
    fwd_op = OPS.edge_features if variant is None else OPS.edge_basis
    bwd_op = OPS.edge_features_bwd if variant is None else OPS.edge_basis_bwd

    def fwd(p, s):
        return fwd_op(p, ei, s, *rbf)

    out = torch.compile(fwd, fullgraph=True)(pos, shifts)
    out_e = fwd(pos, shifts)
    grads_out = [torch.randn_like(o) for o in out]
    g = torch.autograd.grad(out, (pos, shifts), grads_out)
    # Kept: dist and unit of the eager forward feed the double-backward check below.
    g_e = torch.autograd.grad(out_e, (pos, shifts), grads_out, retain_graph=True)
    for a, b in zip(out + g, out_e + g_e, strict=True):
        torch.testing.assert_close(a, b)

    # The backward op compiled, and its backward (the double-backward kernel) through the compiled graph.
    go = [x.detach().clone().requires_grad_(True) for x in grads_out]
    dist, unit = (out_e[1], out_e[2]) if variant is None else (out_e[0], out_e[1])

    def bwd(*gs):
        return bwd_op(*gs, dist, unit, ei, pos.shape[0], *rbf)

    gc = torch.compile(bwd, fullgraph=True)(*go)
    ge = bwd(*go)
    w = [torch.randn_like(x) for x in ge]
    dc = torch.autograd.grad(gc, (pos, shifts, *go), w, allow_unused=True, materialize_grads=True, retain_graph=True)
    de = torch.autograd.grad(ge, (pos, shifts, *go), w, allow_unused=True, materialize_grads=True)
    for a, b in zip(gc + dc, ge + de, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)  # atomics: summation order differs run to run

    torch.library.opcheck(fwd_op.default, (pos, ei, shifts, *rbf))
    torch.library.opcheck(bwd_op.default, (*go, dist.detach(), unit.detach(), ei, pos.shape[0], *rbf))


@pytest.mark.gpu
def test_compile_force_style_double_backward():
    """energy -> forces = -dE/dpos (create_graph) -> loss on forces -> backward, all in one compiled graph."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if not hasattr(torch._dynamo.config, "trace_autograd_ops"):
        pytest.skip("this torch cannot trace torch.autograd.grad inside a compiled graph")
    torch._dynamo.reset()
    dev = torch.device("cuda")
    pos, ei, shifts = _graph(3000, torch.float64, dev, zero_edge=False)
    w = torch.randn(N_RBF, dtype=torch.float64, device=dev)

    def forces(p):
        dist, unit, rbf = OPS.edge_basis(p, ei, shifts, N_RBF, CUTOFF, "bessel", "cosine")
        energy = ((rbf @ w) * (1.0 + unit[:, 0]) + 0.1 * dist).square().sum()
        (g,) = torch.autograd.grad(energy, p, create_graph=True)
        return -g

    pos.requires_grad_(True)
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        fc = torch.compile(forces, fullgraph=True)(pos)
    (dc,) = torch.autograd.grad(fc.square().sum(), pos)
    fe = forces(pos)
    (de,) = torch.autograd.grad(fe.square().sum(), pos)
    torch.testing.assert_close(fc, fe)
    torch.testing.assert_close(dc, de)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n_edges", [0, 7, 1000])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("how", ["no_grad", "inputs_without_grad"])
def test_forward_without_autograd(triton_device, variant, n_edges, dtype, how, poison):
    """Inference (nothing requires grad, or grad mode off) takes the host function without an autograd.Function:
    same outputs as the reference, nothing attached to a graph, and each output its own tensor."""
    pos, ei, shifts = _graph(n_edges, dtype, triton_device)
    if how == "no_grad":
        pos.requires_grad_(True)
    poison(n_edges * N_RBF, dtype, triton_device)
    with torch.no_grad() if how == "no_grad" else torch.enable_grad():
        out = _run(variant, pos, ei, shifts)
    ref = _reference(variant, pos.detach().double(), ei, shifts.double())
    assert len(out) == 3
    for o, r in zip(out, ref, strict=True):
        assert o.shape == r.shape and o.dtype == dtype and o.device == pos.device
        assert not o.requires_grad and o.grad_fn is None and o.is_contiguous()
        _assert_close(o, r, TOL[dtype])
    if n_edges:
        ptrs = {o.data_ptr() for o in out}
        assert len(ptrs) == 3, "outputs must not share storage"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("used", ["unit+rbf", "rbf", "unit"])
def test_edge_basis_unused_outputs_need_no_zero_gradient(triton_device, dtype, used, monkeypatch):
    """The model never uses edge_basis's dist: its gradient arrives as None, and the backward reads no zero-filled
    buffer for it; grad_pos, which the kernel's atomics accumulate into, was zeroed by the forward's kernel (no
    fill in the backward). Bit for bit the gradient with an explicit zero for every unused output (on the CPU; the
    GPU's atomics add in any order), which is a second backward over the same graph: it fills grad_pos itself."""
    monkeypatch.setitem(edge_features_module._OPTIONS, "zero_in_forward", True)
    torch.manual_seed(4)
    pos, ei, shifts = _graph(200, dtype, triton_device)
    pos.requires_grad_(True)
    with use_backend("triton"):
        dist, unit, rbf = edge_basis(pos, ei, shifts, N_RBF, CUTOFF, "bessel", "cosine")
    g_unit, g_rbf = torch.randn_like(unit), torch.randn_like(rbf)
    outs, grads = {"unit": (unit, g_unit), "rbf": (rbf, g_rbf)}, {}
    picked = [outs[k] for k in used.split("+")]
    fills = []

    class _Fills(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in ("zeros", "zeros_like", "new_zeros", "zero_", "fill_"):
                fills.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with _Fills():
        (grads["none"],) = torch.autograd.grad([o for o, _ in picked], pos, [g for _, g in picked], retain_graph=True)
    want_go = [torch.zeros_like(dist), g_unit if "unit" in used else torch.zeros_like(unit)]
    want_go.append(g_rbf if "rbf" in used else torch.zeros_like(rbf))
    (want,) = torch.autograd.grad((dist, unit, rbf), pos, want_go)
    if triton_device.type == "cpu":
        assert torch.equal(grads["none"], want)
    else:  # the forces' atomics add in a different order each run
        _assert_close(grads["none"], want.double(), TOL[dtype], normwise=True)
    assert fills.count("zeros") + fills.count("new_zeros") + fills.count("zeros_like") == (used != "unit+rbf")


@pytest.mark.parametrize("variant", VARIANTS[1:])
def test_the_forwards_zeros_for_the_position_gradient(triton_device, variant, monkeypatch):
    """edge_basis's forward kernel zeroes the backward's position gradient (``zero_in_forward``): the kernel fills
    every entry of a poisoned buffer, for more entries than its programs' first pass covers; the gradients equal
    those of a backward that fills its own zeros (bit for bit on the CPU), also for a second backward over the same
    graph (which must not add into the first one's buffer)."""
    pos, ei, shifts = _graph(40, torch.float64, triton_device, n_atoms=1000)  # 3,000 entries, one program
    zero = torch.full((1000, 3), float("nan"), dtype=torch.float64, device=triton_device)
    with use_backend("triton"):
        edge_features_module._edge_forward(
            pos, ei, shifts, (N_RBF, CUTOFF, *variant), edge_features_module._bare, None, zero
        )
    assert torch.equal(zero, torch.zeros_like(zero))

    pos, ei, shifts = _graph(3000, torch.float64, triton_device)
    pos.requires_grad_(True)
    g = {}
    for on in (True, False):
        monkeypatch.setitem(edge_features_module._OPTIONS, "zero_in_forward", on)
        with use_backend("triton"):
            _, unit, rbf = edge_basis(pos, ei, shifts, N_RBF, CUTOFF, *variant)
        go = (torch.cos(unit.detach()), torch.sin(rbf.detach()))
        first = torch.autograd.grad((unit, rbf), pos, go, retain_graph=True)[0]
        g[on] = (first, torch.autograd.grad((unit, rbf), pos, go)[0])
    for a, b in zip(g[True], g[False], strict=True):
        if triton_device.type == "cpu":
            assert torch.equal(a, b)
        else:
            _assert_close(a, b, TOL[torch.float64], normwise=True)
    assert g[True][0].abs().sum() > 0
