"""kernels/repulsion.py: the ZBL wall below a student's training data.

Oracles: the ZBL formula written out here independently (Ziegler-Biersack-Littmark's four exponentials), the
smoothstep switch, autograd over the reference, finite differences; the Triton op (CPU interpreter, and CUDA when
present) against the torch reference on random edges.
"""

import math

import pytest
import torch
from mlff_distiller.kernels import (
    pair_repulsion,
    pair_repulsion_reference,
    repulsion_table,
    triton_available,
    use_backend,
)
from mlff_distiller.kernels.repulsion import ON_FRACTION, _terms

SPECIES = [1, 6, 8]
RADII = {(1, 1): 0.56, (1, 6): 0.74, (6, 8): 0.89, (8, 8): 1.02}  # (6, 6) and (1, 8): none
BACKENDS = ["torch"] + (["triton"] if triton_available("cpu") else [])


def _zbl(r: float, za: int, zb: int) -> float:
    a = 0.8854 * 0.529177 / (za**0.23 + zb**0.23)
    x = r / a
    phi = (
        0.18175 * math.exp(-3.1998 * x)
        + 0.50986 * math.exp(-0.94229 * x)
        + 0.28022 * math.exp(-0.4029 * x)
        + 0.02817 * math.exp(-0.20162 * x)
    )
    return 14.399645 * za * zb / r * phi


def _switch(r: float, r_off: float) -> float:
    r_on = r_off * 2 / 3
    t = min(max((r - r_on) / (r_off - r_on), 0.0), 1.0)
    return 1 - 10 * t**3 + 15 * t**4 - 6 * t**5


def _random_graph(n_atoms: int, n_edges: int, n_struct: int, seed: int, dtype, device, r_max: float = 1.3):
    """Random edges between random species at distances spread over [0, r_max] (some exactly 0: coincident
    atoms), with the distances as a leaf."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, len(SPECIES), (n_atoms,), generator=g)
    batch = torch.sort(torch.randint(0, n_struct, (n_atoms,), generator=g)).values
    edge_index = torch.randint(0, n_atoms, (2, n_edges), generator=g)
    dist = torch.rand(n_edges, generator=g, dtype=torch.float64) * r_max
    dist[:3] = 0.0
    dist[3:4] = 1e-5
    table = repulsion_table(SPECIES, RADII, dtype=dtype)
    to = dict(device=device)
    return (
        dist.to(dtype=dtype, **to).requires_grad_(True),
        edge_index.to(**to),
        idx.to(**to),
        table.to(**to),
        batch.to(**to),
    )


def test_reference_is_the_switched_zbl_formula():
    table = repulsion_table(SPECIES, RADII, dtype=torch.float64)
    rs = [0.05, 0.2, 0.3, 0.45, 0.5, 0.6, 0.7, 0.73, 0.74, 0.8, 2.0]
    for za, zb in [(1, 6), (6, 1), (1, 1), (8, 8), (6, 8), (6, 6), (1, 8)]:
        r_off = RADII.get((min(za, zb), max(za, zb)), 0.0)
        for r in rs:
            idx = torch.tensor([SPECIES.index(za), SPECIES.index(zb)])
            edge_index = torch.tensor([[0], [1]])
            dist = torch.tensor([r], dtype=torch.float64)
            atomic, energy, gate = pair_repulsion_reference(dist, edge_index, idx, table, torch.zeros(2, dtype=int), 1)
            want = 0.5 * _zbl(r, za, zb) * _switch(r, r_off) if r < r_off else 0.0
            assert gate.item() == pytest.approx(1.0 - _switch(r, r_off) if r < r_off else 1.0, rel=1e-12, abs=1e-15)
            assert atomic[0].item() == pytest.approx(want, rel=1e-12, abs=0.0), (za, zb, r)
            assert atomic[1].item() == 0.0  # the sender gets its half from the reverse edge
            if r >= r_off:
                assert gate.item() == 1.0  # exactly: the student's message is untouched outside the wall
            if r <= ON_FRACTION * r_off:
                assert gate.item() == 0.0
            assert energy.item() == atomic[0].item()
            if r <= ON_FRACTION * r_off:  # the full ZBL, unswitched
                assert atomic[0].item() == pytest.approx(0.5 * _zbl(r, za, zb), rel=1e-12)


def test_terms_derivative_is_the_energys():
    """The closed-form de/dr that the Triton backward and the double backward use is autograd's of e."""
    dist, edge_index, idx, table, _ = _random_graph(40, 4000, 1, 0, torch.float64, "cpu")
    from mlff_distiller.kernels.repulsion import _params

    e, de, gate, dgate = _terms(dist, _params(edge_index, idx, table))
    (auto,) = torch.autograd.grad(e.sum(), dist, retain_graph=True)
    torch.testing.assert_close(de, auto, rtol=1e-12, atol=1e-12)
    (auto,) = torch.autograd.grad(gate.sum(), dist)
    torch.testing.assert_close(dgate, auto, rtol=1e-12, atol=1e-12)
    assert ((gate > 0) & (gate < 1)).sum() > 100
    assert (e > 0).sum() > 100 and (e == 0).sum() > 100  # both sides of the switch are exercised
    assert torch.isfinite(e).all() and torch.isfinite(de).all()  # coincident atoms: large, finite


@pytest.mark.parametrize("backend", BACKENDS)
def test_finite_differences(backend):
    dist, edge_index, idx, table, batch = _random_graph(12, 60, 3, 1, torch.float64, "cpu", r_max=1.1)
    with torch.no_grad():
        dist.clamp_(min=0.01)  # away from the R_MIN clamp
    with use_backend(backend):
        atomic, energy, gate = pair_repulsion(dist, edge_index, idx, table, batch, 3)
        w = torch.linspace(0, 1, 12, dtype=dist.dtype)
        wg = torch.linspace(-2, 3, gate.shape[0], dtype=dist.dtype)
        (grad,) = torch.autograd.grad(energy.sum() + (atomic * w).sum() + (gate * wg).sum(), dist)
    h = 1e-6
    for k in range(dist.shape[0]):  # one edge at a time: the sum of all is too large for a 1e-6 step's rounding
        vals = []
        for sign in (1, -1):
            d = dist.detach()[k : k + 1] + sign * h
            a, e, g = pair_repulsion_reference(d, edge_index[:, k : k + 1], idx, table, batch, 3)
            vals.append((e.sum() + (a * w).sum() + g.sum() * wg[k]).item())
        assert grad[k].item() == pytest.approx((vals[0] - vals[1]) / (2 * h), rel=1e-6, abs=1e-6), k
    assert (grad != 0).sum() > 20


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradcheck_and_gradgradcheck(backend):
    dist, edge_index, idx, table, batch = _random_graph(10, 30, 2, 2, torch.float64, "cpu", r_max=1.0)
    with torch.no_grad():
        dist.clamp_(min=0.05)

    def f(d):
        return pair_repulsion(d, edge_index, idx, table, batch, 2)

    with use_backend(backend):
        assert torch.autograd.gradcheck(f, (dist,))
        assert torch.autograd.gradgradcheck(f, (dist,))


TRITON_DEVICES = [d for d in ("cpu", "cuda") if (d == "cpu" or torch.cuda.is_available()) and triton_available(d)]


@pytest.mark.skipif(not TRITON_DEVICES, reason="needs triton (the interpreter on the CPU, or CUDA)")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_triton_matches_reference(dtype):
    for device in TRITON_DEVICES:
        for seed, (n, e, b) in enumerate([(7, 1, 1), (50, 3000, 4), (300, 20000, 17)]):
            dist, edge_index, idx, table, batch = _random_graph(n, e, b, 10 + seed, dtype, device)
            g_a = torch.randn(n, dtype=dtype, device=device)
            g_e = torch.randn(b, dtype=dtype, device=device)
            g_g = torch.randn(e, dtype=dtype, device=device)
            outs = {}
            for backend in ("torch", "triton"):
                with use_backend(backend):
                    a, en, gate = pair_repulsion(dist, edge_index, idx, table, batch, b)
                    (gd,) = torch.autograd.grad([a, en, gate], dist, [g_a, g_e, g_g], retain_graph=True)
                    # only some outputs seeded (the engine's steps seed the energies and the gate's consumer)
                    (gd_e,) = torch.autograd.grad(en, dist, g_e, retain_graph=True)
                    (gd_a,) = torch.autograd.grad(a, dist, g_a, retain_graph=True)
                    (gd_g,) = torch.autograd.grad(gate, dist, g_g)
                outs[backend] = (a, en, gate, gd, gd_e, gd_a, gd_g)
            tol = dict(rtol=1e-11, atol=1e-9) if dtype == torch.float64 else dict(rtol=2e-5, atol=1e-2)
            for want, got in zip(outs["torch"], outs["triton"], strict=True):
                assert torch.isfinite(got).all()
                torch.testing.assert_close(got, want, **tol)


def test_table_errors():
    with pytest.raises(ValueError, match=r"\(1, 7\).*species"):
        repulsion_table(SPECIES, {(1, 7): 0.5})
    with pytest.raises(ValueError, match=">= 0"):
        repulsion_table(SPECIES, {(1, 6): -0.1})
    with pytest.raises(ValueError, match="table"):
        dist, edge_index, idx, table, batch = _random_graph(5, 6, 1, 3, torch.float64, "cpu")
        pair_repulsion(dist[:4], edge_index, idx, table, batch, 1)


def test_wall_touched_decides_on_the_cpu():
    """On CPU tensors the op is skipped when no edge lies inside its pair's wall (exactly nothing to add, a gate of
    1); one edge inside is enough to run it."""
    from mlff_distiller.kernels import wall_touched

    dist, edge_index, idx, table, batch = _random_graph(30, 200, 2, 4, torch.float64, "cpu")
    inside = pair_repulsion_reference(dist, edge_index, idx, table, batch, 2)
    assert wall_touched(dist, edge_index, idx, table)
    assert inside[2].min() < 1
    with torch.no_grad():
        far = dist.detach() + 1.1  # every pair beyond every radius (the largest is 1.02 Å)
    assert not wall_touched(far, edge_index, idx, table)
    atomic, energy, gate = pair_repulsion_reference(far, edge_index, idx, table, batch, 2)
    assert not atomic.any() and not energy.any() and bool((gate == 1).all())  # what skipping it stands for
    one = far.clone()
    one[7] = 0.3
    code = idx[edge_index[0, 7]] * 3 + idx[edge_index[1, 7]]
    assert wall_touched(one, edge_index, idx, table) == bool(table[code, 1] > 0.3)


# -- the gate inside the edge basis (kernels.edge_basis(..., wall=...)) ---------------------------------------------


def _cluster(n_atoms: int, seed: int, dtype, device, side: float = 1.6):
    """Atoms of random species in a small box, every ordered pair an edge (some periodic images too), so that
    distances fall below, across and beyond the walls' radii; atoms 0 and 1 coincide."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.rand(n_atoms, 3, generator=g, dtype=torch.float64) * side
    pos[1] = pos[0]
    idx = torch.randint(0, len(SPECIES), (n_atoms,), generator=g)
    i, j = torch.meshgrid(torch.arange(n_atoms), torch.arange(n_atoms), indexing="ij")
    keep = i != j
    ei = torch.stack([i[keep], j[keep]])
    shifts = torch.zeros(ei.shape[1], 3, dtype=torch.float64)
    shifts[::5, 0] = 1.9  # images at ~2 Å: outside every wall, inside the cutoff
    to = dict(device=device)
    return pos.to(dtype=dtype, **to), ei.to(**to), shifts.to(dtype=dtype, **to), idx.to(**to)


def _gated(path: str, p, ei, s, idx, table, variant):
    from mlff_distiller.kernels import edge_basis, edge_basis_reference, wall_gate_reference

    if path == "triton":
        with use_backend("triton"):
            return edge_basis(p, ei, s, 7, 5.0, *variant, wall=(idx, table))
    dist, unit, rbf = edge_basis_reference(p, ei, s, 7, 5.0, *variant)  # the basis, then the gate: two ops
    return dist, unit, rbf * wall_gate_reference(dist, ei, idx, table).unsqueeze(-1)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("variant", [("bessel", "cosine"), ("gaussian", "polynomial")])
def test_gated_basis_matches_the_basis_times_the_gate(triton_device, dtype, variant):
    """Triton's gated edge_basis (the gate folded into the envelope) against the reference basis times the
    reference gate as two separate ops: forward, backward to positions and shifts, and the backward's backward,
    with random weights on every output and gradient."""
    from mlff_distiller.kernels import edge_basis_reference

    pos, ei, shifts, idx = _cluster(13, 5, dtype, triton_device)
    table = repulsion_table(SPECIES, RADII, dtype=dtype).to(triton_device)
    plain = edge_basis_reference(pos, ei, shifts, 7, 5.0, *variant)[2]
    results, weights = {}, None
    for path in ("reference", "triton"):
        p = pos.clone().requires_grad_(True)
        s = shifts.clone().requires_grad_(True)
        dist, unit, rbf = _gated(path, p, ei, s, idx, table, variant)
        if weights is None:
            weights = [torch.randn_like(x) for x in (dist, unit, rbf, p, s)]
        loss = (dist * weights[0]).sum() + (unit * weights[1]).sum() + (rbf * weights[2]).sum()
        g = torch.autograd.grad(loss, (p, s), create_graph=True)
        gg = torch.autograd.grad((g[0] * weights[3]).sum() + (g[1] * weights[4]).sum(), (p, s))
        results[path] = [x.detach() for x in (dist, unit, rbf, *g, *gg)]
    gate_on = ~torch.isclose(results["reference"][2], plain).all(dim=1)
    assert 10 < int(gate_on.sum()) < ei.shape[1] - 10  # edges inside walls and outside them
    tol = dict(rtol=1e-10, atol=1e-9) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-3)
    for got, want in zip(results["triton"], results["reference"], strict=True):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, **tol)
    from mlff_distiller.kernels import edge_basis

    with use_backend("triton"):  # the gate is exactly 1 outside the walls: bit for bit the ungated kernel's basis
        ungated = edge_basis(pos, ei, shifts, 7, 5.0, *variant)[2]
    assert torch.equal(results["triton"][2][~gate_on], ungated[~gate_on])


def test_gated_basis_gradcheck_and_gradgradcheck(triton_device):
    pos, ei, shifts, idx = _cluster(6, 8, torch.float64, triton_device, side=1.1)
    pos[1] += 0.2  # no coincident pair here: finite differences across r = 0 are meaningless
    table = repulsion_table(SPECIES, RADII, dtype=torch.float64).to(triton_device)
    pos.requires_grad_(True)
    shifts.requires_grad_(True)

    def fn(p, s):
        return _gated("triton", p, ei, s, idx, table, ("bessel", "cosine"))

    assert torch.autograd.gradcheck(fn, (pos, shifts), fast_mode=True)
    assert torch.autograd.gradgradcheck(fn, (pos, shifts), fast_mode=True)


@pytest.mark.skipif(not TRITON_DEVICES, reason="needs triton (the interpreter on the CPU, or CUDA)")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_add_pair_repulsion_is_the_sum_of_the_energies(dtype):
    """``add_pair_repulsion`` (Triton: one copy of both inputs, the wall's atomics into it) against the student's
    energies plus the reference op's: values, gradients wrt all three inputs with random weights, the second
    derivative in dist; the inputs are left as they were."""
    from mlff_distiller.kernels import add_pair_repulsion

    for device in TRITON_DEVICES:
        dist, edge_index, idx, table, batch = _random_graph(50, 3000, 4, 21, dtype, device)
        atomic = torch.randn(50, dtype=dtype, device=device, requires_grad=True)
        energy = torch.randn(4, dtype=dtype, device=device, requires_grad=True)
        before = (atomic.detach().clone(), energy.detach().clone())
        w_a, w_e = torch.randn_like(atomic), torch.randn_like(energy)
        outs = {}
        for backend in ("triton", "reference"):
            if backend == "triton":
                with use_backend("triton"):
                    a, e = add_pair_repulsion(atomic, energy, dist, edge_index, idx, table, batch)
            else:
                ref_a, ref_e, _ = pair_repulsion_reference(dist, edge_index, idx, table, batch, 4)
                a, e = atomic + ref_a, energy + ref_e
            loss = (a * w_a).sum() + (e * w_e).sum()
            g = torch.autograd.grad(loss, (atomic, energy, dist), create_graph=True)
            (gg,) = torch.autograd.grad((g[2] * torch.cos(dist.detach())).sum(), dist)
            outs[backend] = [x.detach() for x in (a, e, *g, gg)]
        tol = dict(rtol=1e-11, atol=1e-9) if dtype == torch.float64 else dict(rtol=2e-5, atol=1e-2)
        for got, want in zip(outs["triton"], outs["reference"], strict=True):
            torch.testing.assert_close(got, want, **tol)
        assert torch.equal(atomic.detach(), before[0]) and torch.equal(energy.detach(), before[1])


def test_bad_wall_arguments_are_named():
    from mlff_distiller.kernels import add_pair_repulsion, edge_basis

    dist, edge_index, idx, table, batch = _random_graph(5, 6, 1, 3, torch.float64, "cpu")
    pos = torch.rand(5, 3, dtype=torch.float64)
    shifts = torch.zeros(6, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="species indices must be integers"):
        edge_basis(pos, edge_index, shifts, 4, 5.0, wall=(idx.double(), table))
    with pytest.raises(ValueError, match="species indices must be integers"):
        edge_basis(pos, edge_index, shifts, 4, 5.0, wall=(idx[:4], table))
    with pytest.raises(ValueError, match="table"):
        edge_basis(pos, edge_index, shifts, 4, 5.0, wall=(idx, table[:5]))
    with pytest.raises(ValueError, match=r"atomic \[N\] and energy \[B\]"):
        add_pair_repulsion(torch.zeros(4), torch.zeros(1), dist, edge_index, idx, table, batch)
