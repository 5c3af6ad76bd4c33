"""The half gathers (``message_passing._CONFIG["half_gathers"]``, ``["half_grads"]``): under the engine's bf16 /
fp16 the message kernels gather 16-bit copies of the senders' x and v (or the folded p = x_b ⊙ v) and, in the
backward, 16-bit copies of the receivers' gradient rows, widening them to float32 in registers.

The forward is exact on the rounded rows: it equals the float64 reference evaluated on x and v rounded to the
16-bit type (or on p rounded once, where the kernels fold), within float32's bound, and it does not equal the
reference on the unrounded rows within that bound (so the rounded rows were gathered). Every first gradient stays
within a bound of a few 16-bit roundings of the float64 one. The forward's rows are kept for the backward's edge
kernel. Off (the switches, or outside a 16-bit mode) nothing changes. The dots are kept at float32 accuracy here
(on the CPU the interpreter's "ieee", on CUDA tf32x3), so these bounds are the gathers' alone.
"""

import importlib

import pytest
import torch
from mlff_distiller.kernels import message_passing, use_backend
from mlff_distiller.kernels._precision import matmul_dtype
from mp_helpers import abs_scales, check, graph, message_passing_backward_reference, symmetric_graph

mp = importlib.import_module("mlff_distiller.kernels.message_passing")

LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Unit roundoff of each 16-bit type: 2^-8 (bfloat16, 8 significant bits), 2^-11 (float16, 11).
U = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


@pytest.fixture
def made(monkeypatch):
    """What each call of ``_gathered_rows`` returned (a spy over it), in call order."""
    calls = []
    real = mp._gathered_rows

    def spy(*args):
        rows = real(*args)
        calls.append(rows)
        return rows

    monkeypatch.setattr(mp, "_gathered_rows", spy)
    return calls


def _forward_on(x, p, rbf, w, unit, ei):
    """The forward in float64 with the b-term's x_b ⊙ v given as ``p`` [N, 3, F] (the kernels' folded form)."""
    x, p, rbf, w, unit = (t.double() for t in (x, p, rbf, w, unit))
    n, f = p.shape[0], p.shape[2]
    i, j = ei[0], ei[1]
    filt = rbf @ w.T  # [E, 3F]
    a = x[j, :f] * filt[:, :f]
    c = x[j, 2 * f :] * filt[:, 2 * f :]
    msg_v = filt[:, None, f : 2 * f] * p[j] + c[:, None, :] * unit[:, :, None]
    ds = torch.zeros(n, f, dtype=torch.float64, device=x.device).index_add_(0, i, a)
    dv = torch.zeros(n, 3, f, dtype=torch.float64, device=x.device).index_add_(0, i, msg_v)
    return ds, dv


def _run(inputs, ei, low, row_ptr=None, symmetric=False, grads=True, **cfg):
    """Triton forward (and the five first gradients for fixed upstream gradients) under ``matmul_dtype(low)``,
    the dots kept at float32 accuracy (``reduced_dots`` off: on CUDA the mode otherwise gives them one TF32 pass,
    whose rounding would hide the gathers'; test_precision_dots.py covers those)."""
    ins = [t.detach().clone().requires_grad_(grads) for t in inputs]
    cfg = {"block_min_atoms": 0, "reduced_dots": False, **cfg}
    with use_backend("triton"), matmul_dtype(low), mp._configured(**cfg):
        out = message_passing(*ins, ei, row_ptr=row_ptr, symmetric=symmetric)
        if not grads:
            return [o.detach() for o in out], None
        gen = torch.Generator().manual_seed(5)
        go = [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o) for o in out]
        g = torch.autograd.grad(out, ins, go)
    return [o.detach() for o in out], (go, g)


@pytest.mark.parametrize("low", ["bf16", "fp16"])
@pytest.mark.parametrize("fold", [False, True])
def test_forward_is_the_reference_on_rounded_rows(triton_device, low, fold):
    dt = LOW[low]
    x, v, rbf, w, unit, ei = graph(40, 500, 24, 8, torch.float32, triton_device, seed=11)
    # fold_xb_min_edges None: never fold; 0 with min degree 1: always.
    cfg = dict(fold_xb_min_edges=0, fold_xb_min_degree=1) if fold else dict(fold_xb_min_edges=None)
    (ds, dv), _ = _run((x, v, rbf, w, unit), ei, dt, grads=False, fwd_variant="block", **cfg)
    f = v.shape[2]
    xr = x.to(dt).double()
    if fold:
        p = (x[:, f : 2 * f].unsqueeze(1).double() * v.double()).to(torch.float32).to(dt).double()
    else:
        p = xr[:, f : 2 * f].unsqueeze(1) * v.to(dt).double()
    r_s, r_v = _forward_on(xr, p, rbf, w, unit, ei)
    s_s, s_v = abs_scales(x, v, rbf, w, unit, ei)
    check(ds, r_s, s_s, 2e-6, "ds")
    check(dv, r_v, s_v, 2e-6, "dv")
    # The unrounded rows do not give it: the 16-bit rows were gathered.
    exact = _forward_on(x, x[:, f : 2 * f].unsqueeze(1).double() * v.double(), rbf, w, unit, ei)
    with pytest.raises(AssertionError, match="exceeds the bound"):
        check(dv, exact[1], s_v, 2e-6, "dv")


@pytest.mark.parametrize("low", ["bf16", "fp16"])
@pytest.mark.parametrize("half_grads", [False, True])
@pytest.mark.parametrize("symmetric", [False, True])
def test_gradients_within_the_16bit_bound(triton_device, low, half_grads, symmetric):
    """All five first gradients (the edge kernel's ∂rbf, ∂u on the forward's kept rows; the sender kernel's ∂x,
    ∂v, on the gathered gradient rows with half_grads) within 4 roundings of the 16-bit types involved, relative
    to the sums of absolute values; and apart from the float32 result where a rounding was made. The graphs have
    ~20 edges per atom, above ``half_grads_min_degree``."""
    dt = LOW[low]
    if symmetric:
        *inputs, ei, row_ptr = symmetric_graph(30, 300, 24, 8, torch.float32, triton_device, seed=3)
    else:
        *inputs, ei = graph(30, 600, 24, 8, torch.float32, triton_device, seed=3)
        row_ptr = None
    cfg = dict(half_grads=half_grads, fwd_variant="block", bwd_sender_variant="block")
    _, (go, grads) = _run(inputs, ei, dt, row_ptr=row_ptr, symmetric=symmetric, **cfg)
    ref64 = [t.double() for t in inputs]
    ref = message_passing_backward_reference(go[0].double(), go[1].double(), *ref64, ei)
    _, scales = abs_scales(*inputs, ei, go[0], go[1])
    u = U[dt]  # half_grads_type "mode": the gradient rows in the same type
    for name, g, r, s in zip(("x", "v", "rbf", "filter_weight", "unit"), grads, ref, scales, strict=True):
        check(g, r, s, 4 * u, f"grad {name}")
    # The gradient of rbf reads the rounded x, v (and g): not the float32 result.
    with mp._configured(half_gathers=False, half_grads=False):
        _, (_, g32) = _run(inputs, ei, dt, row_ptr=row_ptr, symmetric=symmetric, **cfg)
    assert not torch.allclose(grads[2], g32[2], rtol=1e-5, atol=1e-6)
    if half_grads:  # the sender kernel's ∂x reads the rounded gradient rows
        assert not torch.allclose(grads[0], g32[0], rtol=1e-5, atol=1e-6)


def test_fp16_gradient_rows_past_its_range_give_inf_not_a_finite_result(triton_device):
    """Under fp16 the gradient rows are float16: one past 65,504 becomes inf, so the gradients are not finite (the
    engine then raises NonFiniteOutputError rather than return them), never a finite wrong value. bfloat16 rows
    (``half_grads_type="bf16"``) keep float32's range."""
    *inputs, ei = graph(30, 600, 24, 8, torch.float32, triton_device, seed=8)
    cfg = {"block_min_atoms": 0, "reduced_dots": False, "fwd_variant": "block", "bwd_sender_variant": "block"}

    def grads(**extra):
        ins = [t.detach().clone().requires_grad_(True) for t in inputs]
        with use_backend("triton"), matmul_dtype(torch.float16), mp._configured(**cfg, **extra):
            out = message_passing(*ins, ei)
            go = [torch.full_like(o, 1e5) for o in out]
            return torch.autograd.grad(out, ins, go)

    assert not torch.isfinite(grads()[0]).all()
    assert all(torch.isfinite(g).all() for g in grads(half_grads_type="bf16"))


def test_switches_off_and_float32_unchanged(triton_device):
    """Outside a 16-bit mode, and inside one with both switches off, the results are the float32 kernels' own:
    bit for bit on the CPU (whose dots are "ieee" in every mode)."""
    *inputs, ei = graph(30, 400, 24, 8, torch.float32, triton_device, seed=4)
    base, (_, g_base) = _run(inputs, ei, None)
    assert mp._gathered_rows(*inputs[:3], inputs[3], True) is None  # no 16-bit mode: no copies
    with mp._configured(half_gathers=False, half_grads=False):
        off, (_, g_off) = _run(inputs, ei, torch.bfloat16)
    if triton_device.type == "cpu":
        for a, b in zip([*base, *g_base], [*off, *g_off], strict=True):
            assert torch.equal(a, b)
    # Float64 inputs never take the 16-bit rows, whatever the mode.
    with matmul_dtype(torch.bfloat16), mp._configured(block_min_atoms=0):
        x64 = [t.double() for t in inputs]
        assert mp._gathered_rows(x64[0], x64[1], x64[2], x64[3], True) is None


def test_rows_are_made_once_and_kept_for_the_backward(triton_device, made, monkeypatch):
    """One set of 16-bit rows per forward (x and p, or v), and the backward's edge kernel gathers those same
    tensors; v = 0 (``v_zero``, the first layer) is never copied."""
    edge_args = []
    real_edge = mp._edge_grads

    def edge_spy(*args, **kw):
        edge_args.append(kw.get("rows"))
        return real_edge(*args, **kw)

    monkeypatch.setattr(mp, "_edge_grads", edge_spy)
    *inputs, ei = graph(30, 600, 24, 8, torch.float32, triton_device, seed=6)
    _run(inputs, ei, torch.float16, fwd_variant="block", fold_xb_min_edges=None)
    assert len(made) == 1 and made[0] is not None
    xg, vg, fold = made[0]
    assert xg.dtype == vg.dtype == torch.float16 and not fold
    assert len(edge_args) == 1 and edge_args[0][2] is xg and edge_args[0][3] is vg
    assert edge_args[0][0].dtype == edge_args[0][1].dtype == torch.float16  # half_grads: the mode's type
    made.clear()
    edge_args.clear()
    _run(inputs, ei, torch.float16, fwd_variant="block", fold_xb_min_edges=None, half_grads_type="bf16")
    assert edge_args[0][0].dtype == edge_args[0][1].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="half_grads_type"):
        _run(inputs, ei, torch.float16, fwd_variant="block", half_grads_type="fp8")
    # Below half_grads_min_degree edges per atom the gradient rows stay float32 (x and v still 16-bit).
    made.clear()
    edge_args.clear()
    _run(inputs, ei, torch.float16, fwd_variant="block", half_grads_min_degree=21)
    assert made[0][0].dtype == torch.float16 and edge_args[0][0].dtype == edge_args[0][1].dtype == torch.float32
    made.clear()
    ins = [t.detach().clone() for t in inputs]
    with use_backend("triton"), matmul_dtype(torch.float16), mp._configured(block_min_atoms=0):
        mp._MessagePassing.apply(*ins, ei, mp._offsets(ei[0].contiguous(), 30), None, None, True)
    assert made[0][1] is ins[1]  # v_zero: v is not loaded, so not copied


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_small_graphs_keep_float32_rows_gpu():
    """On the GPU a graph below ``block_min_atoms`` runs the atom-variant forward, which takes no 16-bit rows: no
    copies are made there (they would cost launches on launch-bound steps)."""
    *inputs, _ = graph(300, 3000, 32, 8, torch.float32, torch.device("cuda"), seed=2)
    with matmul_dtype(torch.bfloat16):
        assert mp._gathered_rows(inputs[0], inputs[1], inputs[2], inputs[3], True) is None
        with mp._configured(block_min_atoms=0):
            assert mp._gathered_rows(inputs[0], inputs[1], inputs[2], inputs[3], True) is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("mode", ["eager", "cudagraph"])
def test_engine_16bit_with_half_gathers_within_tolerance_gpu(precision, mode, made):
    """The engine's bf16 / fp16 on a periodic water box of 1,536 atoms (more than ``block_min_atoms``, ~55 edges
    per atom: both halves on; captured, the edge kernel on the sink's second stream): within the documented
    tolerance of fp64, the 16-bit rows made in every layer."""
    import numpy as np
    from ase import Atoms
    from ase.build import molecule
    from helpers import assert_close_to, make_model

    from mlff_distiller import AtomsBatch, ForceEngine

    rng = np.random.default_rng(0)
    water, side, n = molecule("H2O"), 3.1, 8
    box = Atoms(cell=[side * n] * 3, pbc=True)
    for corner in np.ndindex(n, n, n):
        w = water.copy()
        w.rotate(rng.uniform(0, 360), rng.normal(size=3))
        w.translate(np.array(corner) * side + rng.uniform(0, 0.2, 3))
        box += w
    structures = [box]
    batch = AtomsBatch.from_atoms(structures)
    model = make_model(seed=5, cutoff=5.0)
    ref = ForceEngine(model, device="cuda", precision="fp64").compute(batch)
    with use_backend("triton"):
        out = ForceEngine(model, device="cuda", precision=precision, mode=mode).compute(batch)
    assert_close_to(out, ref, precision, len(structures))
    assert made and all(rows is not None for rows in made[-model.config.layers :])
