"""kernels/small_step.py: a molecule's whole energy + forces step in one Triton program.

Oracles: the model's own forward and autograd in float64 (``small_step_reference``: the edge list built here from
all pairs within the cutoff), finite differences of the kernel's own energy; on the CPU under the interpreter, on
CUDA when present.
"""

import pytest
import torch
from mlff_distiller.kernels import small_step as ss

from mlff_distiller.model.painn import StudentModel

NP = ss.MAX_ATOMS
WALL = [[1, 6, 1.2], [6, 6, 1.5], [1, 1, 0.9], [6, 8, 1.3]]


def _model(dtype=torch.float64, seed=0, **kw):
    torch.manual_seed(seed)
    config = dict(hidden=32, layers=3, n_rbf=20, cutoff=5.0, repulsion=WALL) | kw
    model = StudentModel(**config).to(dtype)
    with torch.no_grad():
        model.atomic_scale.uniform_(0.5, 1.5)
        model.atomic_shift.uniform_(-2.0, 2.0)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def _molecules(sizes, dtype=torch.float64, seed=0, spread=1.6):
    gen = torch.Generator().manual_seed(seed)
    pos = torch.zeros((len(sizes), NP, 3), dtype=torch.float64)
    idx = torch.full((len(sizes), NP), -1, dtype=torch.int32)
    for b, n in enumerate(sizes):
        pos[b, :n] = torch.randn(n, 3, generator=gen, dtype=torch.float64) * spread
        idx[b, :n] = torch.randint(0, 4, (n,), generator=gen, dtype=torch.int32)
    return pos.to(dtype), idx


def _close(got, want, rtol, atol=0.0):
    torch.testing.assert_close(got.double().cpu(), want.double().cpu(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("wall", [WALL, None])
def test_float64_equals_the_models_autograd(triton_device, wall):
    """Molecules of 16, 12, 7, 2 and 1 atoms (the padding slots of each program, a lone atom) with pairs inside the
    ZBL wall and pairs beyond the cutoff: energies, atomic energies and forces to float64 rounding. Without a
    wall the kernel takes a table of radius 0."""
    if triton_device.type == "cuda":
        pytest.skip(
            "the CUDA kernel compiles for ~150 s (benchmarks/results/stop68_gpu/); benchmarks/probe_small_step.py "
            "checks it on the GPU against the same float64 oracle"
        )
    model = _model(repulsion=wall)
    pos, idx = _molecules([16, 12, 7, 2, 1], spread=2.2)
    pos[1, 1] = pos[1, 0] + torch.tensor([0.85, 0.1, 0.0], dtype=torch.float64)  # inside a wall
    idx[1, :2] = torch.tensor([0, 1], dtype=torch.int32)  # H and C: the (1, 6) wall at 1.2 Å
    d = torch.cdist(pos[0, :16], pos[0, :16])
    assert (d > model.cutoff).any(), "the test wants pairs beyond the cutoff"
    er, ar, fr = ss.small_step_reference(model, pos, idx)
    e, a, f = ss.small_step(model, pos, idx)
    _close(e, er, rtol=1e-12)
    _close(a, ar, rtol=1e-12, atol=1e-12)
    _close(f, fr, rtol=1e-10, atol=1e-11)
    assert a[idx < 0].eq(0).all() and f[idx < 0].eq(0).all()
    assert f[4].abs().max() == 0  # a lone atom: no force


def test_forces_are_minus_the_energys_finite_differences():
    model = _model(seed=3)
    pos, idx = _molecules([9], seed=3, spread=1.3)
    _, _, f = ss.small_step(model, pos, idx)
    h = 1e-5
    for atom, k in [(0, 0), (3, 1), (8, 2)]:
        plus, minus = pos.clone(), pos.clone()
        plus[0, atom, k] += h
        minus[0, atom, k] -= h
        fd = -(ss.small_step(model, plus, idx)[0] - ss.small_step(model, minus, idx)[0]) / (2 * h)
        assert abs(float(fd) - float(f[0, atom, k])) < 1e-6 * max(1.0, abs(float(fd)))


def test_shipped_student_on_benzene_in_float32():
    """The 64 x 3 student shipped with the package, float32 products (``ieee`` on the interpreter) against its
    float64 copy."""
    from ase.build import molecule

    from mlff_distiller import load_model

    m32, m64 = load_model("builtin:chno-gfn2-small"), load_model("builtin:chno-gfn2-small").double()
    for m in (m32, m64):
        for p in m.parameters():
            p.requires_grad_(False)
    at = molecule("C6H6")
    pos = torch.zeros((1, NP, 3), dtype=torch.float64)
    idx = torch.full((1, NP), -1, dtype=torch.int32)
    pos[0, :12] = torch.as_tensor(at.positions)
    zi = {z: k for k, z in enumerate(m32.config.species)}
    idx[0, :12] = torch.tensor([zi[int(z)] for z in at.numbers], dtype=torch.int32)
    er, _, fr = ss.small_step_reference(m64, pos, idx)
    e, _, f = ss.small_step(m32, pos.float(), idx)
    assert abs(float(e) - float(er)) < 5e-5
    assert (f.double() - fr).abs().max() < 2e-5


def test_rejects_what_it_does_not_compute():
    assert ss.supports(_model()) is None
    assert "layers" in ss.supports(_model(layers=2))
    assert "hidden 48" in ss.supports(_model(hidden=48))
    assert "basis" in ss.supports(_model(basis="gaussian"))
    model = _model()
    with pytest.raises(ValueError, match=r"positions \[B, 16, 3\]"):
        ss.small_step(model, torch.zeros(1, 8, 3, dtype=torch.float64), torch.zeros(1, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="2 layers"):
        ss.small_step(_model(layers=2), *_molecules([3]))


def test_packed_weights_hold_every_weight_once_in_each_orientation():
    model = _model(hidden=32, n_rbf=20)
    w = ss.pack_weights(model)
    f, rp = 32, 32
    layer = model.interactions[1]
    assert w.numel() == 3 * ss.layer_size(f, rp) + 4 * 4 * f + 2 * f * 16 + 2 * 16 + 1 + 2 * 4
    base = ss.layer_size(f, rp)  # layer 1: W1^T first, then W1
    torch.testing.assert_close(w[base : base + f * f].view(f, f), layer.phi[0].weight.t())
    torch.testing.assert_close(w[base + f * f : base + 2 * f * f].view(f, f), layer.phi[0].weight)
