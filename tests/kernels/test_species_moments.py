"""Species-resolved radial moments (``kernels.species_moments``, the first PaiNN layer without gathers): the Triton
kernels (the interpreter on the CPU, CUDA on the GPU) against the torch reference, forward and gradients; padding
edges past the receiver CSR; first order only on the Triton path."""

import importlib

import pytest
import torch
from helpers import capture_spy
from mlff_distiller.kernels import use_backend

sm = importlib.import_module("mlff_distiller.kernels.species_moments")


def _graph(n, e, n_rbf, n_species, dtype, device, seed=0, pad=0, isolated=2):
    """rbf, unit, edge_index (receiver-sorted, then ``pad`` edges past row_ptr[N]), species, row_ptr."""
    gen = torch.Generator().manual_seed(seed)
    rbf = torch.randn(e + pad, n_rbf, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)
    unit = torch.nn.functional.normalize(torch.randn(e + pad, 3, generator=gen, dtype=torch.float64), dim=-1)
    unit = unit.to(device=device, dtype=dtype)
    ei = torch.randint(0, n - isolated, (2, e), generator=gen)
    ei = ei[:, torch.argsort(ei[0], stable=True)]
    ei = torch.cat([ei, torch.zeros(2, pad, dtype=torch.long)], 1).to(device)  # padding: no receiver owns them
    species = torch.randint(0, n_species, (n,), generator=gen).to(device)
    counts = torch.bincount(ei[0, :e].cpu(), minlength=n)
    row_ptr = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).to(device)
    return rbf, unit, ei, species, row_ptr


def _reference(rbf, unit, ei, species, n_species, row_ptr):
    live = int(row_ptr[-1])
    n = row_ptr.shape[0] - 1
    return sm.species_moments_reference(rbf[:live], unit[:live], ei[:, :live], species, n_species, n)


@pytest.mark.parametrize("rows", [64, 16, 4])
@pytest.mark.parametrize("n_species", [1, 3, 4, 8, 14])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_forward_and_gradients_match_the_reference(triton_device, n_species, dtype, rows, monkeypatch):
    """``rows`` 4: one receiver per program whose tile is padded to 16 rows (the rows past its slots stay out)."""
    monkeypatch.setitem(sm._CONFIG, "rows", rows)
    tol = {torch.float64: 1e-12, torch.float32: 2e-5}[dtype]
    args = _graph(37, 400, 20, n_species, dtype, triton_device, seed=n_species, pad=9)
    rbf, unit, ei, species, row_ptr = args
    rbf, unit = rbf.clone().requires_grad_(True), unit.clone().requires_grad_(True)
    with use_backend("triton"):
        p, q = sm.species_moments(rbf, unit, ei, species, n_species, row_ptr)
    assert p.shape == (37, n_species * 20) and q.shape == (37, 3, n_species * 20)
    r64, u64 = rbf.detach().double().requires_grad_(True), unit.detach().double().requires_grad_(True)
    p_ref, q_ref = _reference(r64, u64, ei, species, n_species, row_ptr)
    scale = max(float(p_ref.detach().abs().max()), float(q_ref.detach().abs().max()))
    torch.testing.assert_close(p.double(), p_ref, rtol=0, atol=tol * scale)
    torch.testing.assert_close(q.double(), q_ref, rtol=0, atol=tol * scale)
    gen = torch.Generator().manual_seed(5)
    wp = torch.randn(p.shape, generator=gen, dtype=torch.float64).to(triton_device)
    wq = torch.randn(q.shape, generator=gen, dtype=torch.float64).to(triton_device)
    g_rbf, g_unit = torch.autograd.grad((p.double() * wp).sum() + (q.double() * wq).sum(), (rbf, unit))
    r_rbf, r_unit = torch.autograd.grad((p_ref * wp).sum() + (q_ref * wq).sum(), (r64, u64))
    gscale = max(float(r_rbf.abs().max()), float(r_unit.abs().max()))
    torch.testing.assert_close(g_rbf.double(), r_rbf, rtol=0, atol=tol * gscale)
    torch.testing.assert_close(g_unit.double(), r_unit, rtol=0, atol=tol * gscale)
    assert float(r_rbf.abs().max()) > 0.1  # a real comparison
    live = int(row_ptr[-1])
    assert not g_rbf[live:].any() and not g_unit[live:].any()  # the padding edges: zero rows


def test_isolated_atoms_have_zero_moments(triton_device):
    rbf, unit, ei, species, row_ptr = _graph(20, 150, 20, 4, torch.float64, triton_device, isolated=3)
    with use_backend("triton"):
        p, q = sm.species_moments(rbf, unit, ei, species, 4, row_ptr)
    assert not p[-3:].any() and not q[-3:].any()
    assert p[:-3].abs().sum(1).gt(0).any()


def test_gradcheck_on_the_triton_path(triton_device):
    rbf, unit, ei, species, row_ptr = _graph(9, 40, 6, 3, torch.float64, triton_device, seed=3, pad=2)
    rbf.requires_grad_(True)
    unit.requires_grad_(True)

    def f(rbf, unit):
        with use_backend("triton"):
            return sm.species_moments(rbf, unit, ei, species, 3, row_ptr)

    # fast mode (random projections of the Jacobian, as the other kernels' gradchecks): the full Jacobian of 360
    # inputs took ~75 s of interpreted launches
    assert torch.autograd.gradcheck(f, (rbf, unit), fast_mode=True)


def test_a_second_derivative_raises_on_the_triton_path(triton_device):
    rbf, unit, ei, species, row_ptr = _graph(9, 40, 6, 2, torch.float64, triton_device, seed=4)
    rbf.requires_grad_(True)
    with use_backend("triton"):
        p, q = sm.species_moments(rbf, unit, ei, species, 2, row_ptr)
    (g,) = torch.autograd.grad(p.square().sum() + q.square().sum(), rbf, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiable once only"):
        torch.autograd.grad(g.square().sum(), rbf)


def test_the_torch_backend_takes_the_reference():
    rbf, unit, ei, species, row_ptr = _graph(15, 90, 8, 3, torch.float64, torch.device("cpu"), pad=4)
    with use_backend("torch"):
        p, q = sm.species_moments(rbf, unit, ei, species, 3, row_ptr)
    p_ref, q_ref = _reference(rbf, unit, ei, species, 3, row_ptr)
    assert torch.equal(p, p_ref) and torch.equal(q, q_ref)


def test_bad_shapes_raise():
    rbf, unit, ei, species, row_ptr = _graph(10, 30, 8, 2, torch.float64, torch.device("cpu"))
    with pytest.raises(ValueError, match="unit"):
        sm.species_moments(rbf, unit[:, :2], ei, species, 2, row_ptr)
    with pytest.raises(ValueError, match="n_species"):
        sm.species_moments(rbf, unit, ei, species, sm.MAX_SPECIES + 1, row_ptr)
    with pytest.raises(ValueError, match="species"):
        sm.species_moments(rbf, unit, ei, species[:-1], 2, row_ptr)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_first_layer_messages_on_the_triton_gemms(triton_device, dtype):
    """The moments times [M_a; M_c] in one autograd node (Triton GEMMs) against the reference composite (moments,
    then torch matmuls): values and gradients wrt rbf and unit."""
    tol = {torch.float64: 1e-12, torch.float32: 2e-5}[dtype]
    rbf, unit, ei, species, row_ptr = _graph(31, 300, 20, 4, dtype, triton_device, seed=12, pad=5)
    gen = torch.Generator().manual_seed(13)
    m = torch.randn(2, 4 * 20, 32, generator=gen, dtype=torch.float64).to(device=triton_device, dtype=dtype)
    rbf.requires_grad_(True)
    unit.requires_grad_(True)
    with use_backend("triton"):
        ds, dv = sm.first_layer_messages(rbf, unit, ei, species, 4, row_ptr, m)
    r64, u64 = rbf.detach().double().requires_grad_(True), unit.detach().double().requires_grad_(True)
    p, q = _reference(r64, u64, ei, species, 4, row_ptr)
    ds_ref, dv_ref = p @ m[0].double(), (q.reshape(-1, 80) @ m[1].double()).view(31, 3, 32)
    scale = float(dv_ref.detach().abs().max())
    torch.testing.assert_close(ds.double(), ds_ref, rtol=0, atol=tol * scale)
    torch.testing.assert_close(dv.double(), dv_ref, rtol=0, atol=tol * scale)
    w_s = torch.randn(ds.shape, generator=gen, dtype=torch.float64).to(triton_device)
    w_v = torch.randn(dv.shape, generator=gen, dtype=torch.float64).to(triton_device)
    got = torch.autograd.grad((ds.double() * w_s).sum() + (dv.double() * w_v).sum(), (rbf, unit))
    want = torch.autograd.grad((ds_ref * w_s).sum() + (dv_ref * w_v).sum(), (r64, u64))
    gscale = float(want[0].abs().max())
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), w, rtol=0, atol=tol * gscale)


@pytest.mark.parametrize("stable", [True, False])
def test_first_layer_messages_hand_the_gemms_the_same_parts_every_call(triton_device, monkeypatch, stable):
    """M's two parts reach the GEMMs (forward and backward) as the very same tensors on every call, so that the
    GEMMs' frozen-weight forms of them (a transpose, W's TF32 parts; keyed by the tensors' identities) are made once:
    as views made anew each call they were made again every step (stop 51). ``stable_parts`` off (the mutation):
    new tensors each call. After an in-place edit of M the parts show the new values."""
    lin = importlib.import_module("mlff_distiller.kernels.linear")
    real = lin.gemm
    seen = []

    def spy(a, w, *args, **kw):
        seen.append(w)
        return real(a, w, *args, **kw)

    monkeypatch.setattr(lin, "gemm", spy)
    monkeypatch.setitem(sm._CONFIG, "stable_parts", stable)
    dtype = torch.float32 if triton_device.type == "cuda" else torch.float64  # CUDA: the Triton GEMMs take float32
    rbf, unit, ei, species, row_ptr = _graph(31, 300, 20, 4, dtype, triton_device, seed=12)
    m = torch.randn(2, 4 * 20, 32, generator=torch.Generator().manual_seed(13), dtype=torch.float64)
    m = m.to(device=triton_device, dtype=dtype)
    calls = []
    for _ in range(2):
        seen.clear()
        r = rbf.detach().clone().requires_grad_(True)
        with use_backend("triton"):
            ds, dv = sm.first_layer_messages(r, unit, ei, species, 4, row_ptr, m)
            (ds.sum() + dv.sum()).backward()
        calls.append(list(seen))
    assert len(calls[0]) == len(calls[1]) == 4  # two products forward, two backward
    same = [a is b for a, b in zip(calls[0], calls[1], strict=True)]
    assert all(same) if stable else not any(same), same
    with torch.no_grad():
        m.mul_(2.0)
    with use_backend("triton"):
        ds2, _ = sm.first_layer_messages(rbf, unit, ei, species, 4, row_ptr, m)
    tol = 1e-12 if dtype == torch.float64 else 1e-5 * float(ds.detach().abs().max())
    torch.testing.assert_close(ds2, 2 * ds.detach(), rtol=0, atol=tol)


def test_first_layer_messages_checks_its_inputs():
    rbf, unit, ei, species, row_ptr = _graph(10, 30, 8, 2, torch.float64, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"m must be \[2, S·R = 16, F\]"):
        sm.first_layer_messages(rbf, unit, ei, species, 2, row_ptr, torch.zeros(2, 15, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="unit"):
        sm.first_layer_messages(rbf, unit[:, :2], ei, species, 2, row_ptr, torch.zeros(2, 16, 4, dtype=torch.float64))


@pytest.mark.parametrize("filled", [True, False])
def test_first_layer_messages_add_into_the_edge_sink(triton_device, filled, monkeypatch):
    """With the step's edge-gradient sink (``edge_sink``; here one on a single stream, on any device), the moments'
    backward adds ∂rbf, ∂u into the sink's sums (writes them where no layer has yet) and hands autograd nothing, so
    that the sink's node passes the sums on without an add. The gradients reaching rbf and unit equal the plain
    path's plus what the sink held; with ``into_sink`` off, the same through autograd's adds."""
    edge_sink = importlib.import_module("mlff_distiller.kernels.edge_sink")
    # float32 on CUDA: the Triton GEMMs (and so this node) take float64 under the interpreter only
    dt = torch.float32 if triton_device.type == "cuda" else torch.float64
    tol = dict(rtol=1e-5, atol=1e-4) if dt == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    rbf, unit, ei, species, row_ptr = _graph(31, 300, 20, 4, dt, triton_device, seed=21, pad=5)
    gen = torch.Generator().manual_seed(22)
    m = torch.randn(2, 4 * 20, 32, generator=gen, dtype=dt).to(triton_device)
    held = [torch.randn(t.shape, generator=gen, dtype=dt).to(triton_device) for t in (rbf, unit)]
    w_s = torch.randn(31, 32, generator=gen, dtype=dt).to(triton_device)
    w_v = torch.randn(31, 3, 32, generator=gen, dtype=dt).to(triton_device)
    rbf.requires_grad_(True)
    unit.requires_grad_(True)
    grads, sums, ran = {}, {}, {}
    into = capture_spy(monkeypatch, "mlff_distiller.kernels.species_moments", "_moments_grads_into")
    for way in ("plain", "into", "off"):
        monkeypatch.setitem(sm._CONFIG, "into_sink", way != "off")
        into.clear()
        sink = None
        r, u = rbf, unit
        if way != "plain":
            sink = edge_sink.EdgeGradSink(None, rbf, unit)
            r, u = edge_sink._DeferredEdgeGrads.apply(rbf, unit, sink)
            sink.node = importlib.import_module("weakref").ref(r.grad_fn)
            if filled:  # as the other layers' edge kernels leave it
                sink.rbf.copy_(held[0]), sink.unit.copy_(held[1])
                sink.filled = True
        with use_backend("triton"):
            ds, dv = sm.first_layer_messages(r, u, ei, species, 4, row_ptr, m, edge_sink=sink)
        grads[way] = torch.autograd.grad((ds * w_s).sum() + (dv * w_v).sum(), (rbf, unit))
        sums[way], ran[way] = sink, bool(into)
    # the backward took the sink's path exactly where it was on and a sink was there
    assert ran == {"plain": False, "into": True, "off": False}, ran
    for got, want, h in zip(grads["into"], grads["plain"], held, strict=True):
        torch.testing.assert_close(got, want + h if filled else want, **tol)
    for got, want in zip(grads["off"], grads["into"], strict=True):
        torch.testing.assert_close(got, want, **tol)
    # the sums were written in place: the gradient autograd handed on is the sink's own tensor
    assert grads["into"][0] is sums["into"].rbf, "the sink's sums were copied on their way to autograd.grad"
    assert grads["off"][0] is not sums["off"].rbf
