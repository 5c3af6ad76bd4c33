"""The Verlet-skin neighbour list (``VerletNeighborList``): MD with the skin list equals a fresh list every step,
rebuilds by displacement, complete lists kept, device inputs, the fast paths against the reference formula, bad
input. Split from ``test_neighbors.py``."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from ase import Atoms
from helpers import our_pairs

from mlff_distiller.batch import AtomsBatch
from mlff_distiller.neighbors import NeighborList, VerletNeighborList, neighbor_list_batch


def _pair_forces(nl: NeighborList, positions: torch.Tensor, cutoff: float) -> torch.Tensor:
    """Forces (eV/Å) of a smooth pair potential ``sum (1 - r/rc)^3 / r`` over the list's edges."""
    pos = positions.detach().clone().requires_grad_(True)
    r = nl.distances(pos)
    energy = ((1 - r / cutoff) ** 3 / r).sum()
    return -torch.autograd.grad(energy, pos)[0]


def test_verlet_skin_md_matches_fresh_list():
    """1,000 steps of EMT copper MD (32 atoms, 7.2 Å cell: narrower than 2 x cutoff) at ~1,000 K: every step
    the skin list equals a fresh list (pairs, shifts, CSR) and gives the same pair-potential forces."""
    from ase.build import bulk
    from ase.calculators.emt import EMT
    from ase.md.verlet import VelocityVerlet
    from ase.units import fs

    from mlff_distiller.ase_compat import maxwell_boltzmann

    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat((2, 2, 2))
    atoms.rattle(0.05, seed=3)
    maxwell_boltzmann(atoms, 2000, rng=np.random.default_rng(4))
    atoms.calc = EMT()
    cutoff = 4.0
    skin_nl = VerletNeighborList(cutoff, skin=0.4)
    dyn = VelocityVerlet(atoms, timestep=5 * fs)
    checked = []

    def check():
        batch = AtomsBatch.from_atoms(atoms)
        got = skin_nl.update_batch(batch)
        fresh = neighbor_list_batch(batch, cutoff)
        assert torch.equal(got.edge_index, fresh.edge_index), f"step {len(checked)}"
        assert torch.equal(got.shifts, fresh.shifts) and torch.equal(got.row_ptr, fresh.row_ptr)
        torch.testing.assert_close(got.shift_vectors, fresh.shift_vectors, rtol=0, atol=1e-12)
        if len(checked) % 25 == 0:
            torch.testing.assert_close(
                _pair_forces(got, batch.positions, cutoff), _pair_forces(fresh, batch.positions, cutoff)
            )
        checked.append(got.num_edges)

    dyn.attach(check, interval=1)
    dyn.run(1000)
    assert len(checked) == 1001 and skin_nl.n_calls == 1001
    # Atoms drift by ~0.03 Å per step here: a 0.2 Å half-skin lasts a few steps, far fewer builds than steps.
    assert 10 <= skin_nl.n_builds <= 500, skin_nl
    assert min(checked) > 0


def test_verlet_rebuild_triggers_and_padded_mode():
    rng = np.random.default_rng(8)
    cell = np.eye(3) * 7.0
    atoms = Atoms("H20", positions=rng.uniform(0, 7, (20, 3)), cell=cell, pbc=True)
    b = AtomsBatch.from_atoms(atoms)
    vl = VerletNeighborList(3.0, skin=1.0)
    vl(b.positions, b.cell, b.pbc, b.batch, b.ptr)
    vl(b.positions.clone(), b.cell, b.pbc, b.batch, b.ptr)
    assert vl.n_builds == 1
    moved = b.positions.clone()
    moved[0, 0] += 0.45  # < skin / 2: reuse
    vl(moved, b.cell, b.pbc, b.batch, b.ptr)
    assert vl.n_builds == 1
    moved[0, 0] += 0.1  # now 0.55 > skin / 2 from the build
    vl(moved, b.cell, b.pbc, b.batch, b.ptr)
    assert vl.n_builds == 2
    vl(moved, b.cell * 1.01, b.pbc, b.batch, b.ptr)  # a cell 1 % larger: kept under the strain test
    assert vl.n_builds == 2 and vl.cell_updates == 1
    vl(moved, b.cell * 1.2, b.pbc, b.batch, b.ptr)  # 20 %: (3 + 1) x 0.2 Å > skin, rebuilt
    assert vl.n_builds == 3
    vl(moved, b.cell * 1.2, b.pbc, b.batch, b.ptr, numbers=b.numbers)  # numbers now tracked
    assert vl.n_builds == 4
    vl.skin = 0.5  # a new skin rebuilds
    vl(moved, b.cell * 1.2, b.pbc, b.batch, b.ptr, numbers=b.numbers)
    assert vl.n_builds == 5
    zero = VerletNeighborList(3.0, skin=0.0)
    for k in range(3):
        zero(b.positions + 1e-6 * k, b.cell, b.pbc, b.batch, b.ptr)
    assert zero.n_builds == 3, "skin 0 rebuilds whenever anything moved"
    padded = VerletNeighborList(3.0, skin=1.0, filter=False).update_batch(b)
    exact = neighbor_list_batch(b, 3.0)
    assert set(our_pairs(exact)) < set(our_pairs(padded)), "padded list is a strict superset here"
    assert float(padded.distances(b.positions).max()) < 4.0


def _walk(rng: np.random.Generator, positions: torch.Tensor, steps: int, size: float):
    """Positions of a random walk of every atom, ``size`` Å per step and coordinate at most."""
    pos = positions.clone()
    for _ in range(steps):
        pos = pos + torch.from_numpy(rng.uniform(-size, size, tuple(pos.shape))).to(pos.dtype)
        yield pos


@pytest.mark.parametrize("filt", [True, False])
def test_verlet_complete_list_is_kept_and_exact(filt):
    """A list that holds every pair of a non-periodic structure (benzene at 5 Å + skin) is built once, however far
    the atoms walk: the filtered list equals a fresh one at every step (and so do its pair forces), the unfiltered
    one is still every pair, those within the cutoff the fresh list's. ``keep_complete=False`` rebuilds by the
    displacement test."""
    from ase.build import molecule

    b = AtomsBatch.from_atoms(molecule("C6H6"), dtype=torch.float64)
    vl = VerletNeighborList(5.0, skin=0.3, filter=filt)
    plain = VerletNeighborList(5.0, skin=0.3, filter=filt, keep_complete=False)
    rng = np.random.default_rng(11)
    steps = 0
    for pos in _walk(rng, b.positions, 60, 0.08):  # ~0.6 Å drift per 10 steps: far past the half skin
        got, fresh = (
            vl(pos, b.cell, b.pbc, b.batch, b.ptr),
            neighbor_list_batch(dataclasses.replace(b, positions=pos), 5.0),
        )
        plain(pos, b.cell, b.pbc, b.batch, b.ptr)
        if filt:
            assert torch.equal(got.edge_index, fresh.edge_index) and torch.equal(got.row_ptr, fresh.row_ptr)
            torch.testing.assert_close(_pair_forces(got, pos, 5.0), _pair_forces(fresh, pos, 5.0), rtol=0, atol=0)
        else:  # every pair, those within the cutoff the fresh list's
            inside = got.edge_index[:, got.distances(pos) < 5.0]
            assert got.num_edges == 12 * 11 and torch.equal(inside, fresh.edge_index)
        steps += 1
    assert steps == 60 and vl.complete and vl.n_builds == 1, vl
    assert plain.n_builds > 5, "the displacement test rebuilds the same list"
    assert vl(pos, b.cell, b.pbc, b.batch, b.ptr, numbers=b.numbers) is not None and vl.n_builds == 2, "numbers given"


def test_verlet_incomplete_or_periodic_lists_rebuild_by_displacement():
    """Not complete, so rebuilt by the displacement test: a chain longer than cutoff + skin; a batch of a complete
    molecule and such a chain; a periodic box whose list has exactly n (n - 1) pairs (two atoms in a 12 Å box),
    whose atom walks to the face where the other's image comes within the cutoff: the rebuilt list holds it."""
    chain = Atoms("C12", positions=[[1.5 * k, 0.0, 0.0] for k in range(12)])
    small = Atoms("H2", positions=[[0, 0, 0], [0.74, 0, 0]])
    for case in ([chain], [small, chain]):
        b = AtomsBatch.from_atoms(case, dtype=torch.float64)
        vl = VerletNeighborList(5.0, skin=0.3)
        vl(b.positions, b.cell, b.pbc, b.batch, b.ptr)
        assert not vl.complete
        moved = b.positions.clone()
        moved[0, 1] += 0.2  # > skin / 2
        vl(moved, b.cell, b.pbc, b.batch, b.ptr)
        assert vl.n_builds == 2
    one = AtomsBatch.from_atoms(small, dtype=torch.float64)
    vl = VerletNeighborList(5.0, skin=0.3)
    vl(one.positions, one.cell, one.pbc, one.batch, one.ptr)
    assert vl.complete, "a lone H2 holds its one pair both ways"
    box = Atoms("H2", positions=[[6.0, 6.0, 6.0], [8.0, 6.0, 6.0]], cell=np.eye(3) * 12.0, pbc=True)
    b = AtomsBatch.from_atoms(box, dtype=torch.float64)
    vl = VerletNeighborList(5.0, skin=0.3)
    first = vl(b.positions, b.cell, b.pbc, b.batch, b.ptr)
    assert first.num_edges == 2 and not vl.complete, "periodic: images may enter"
    moved = b.positions.clone()
    moved[0, 0] = 0.5  # 7.5 Å from atom 1; its image at 12.5 Å is 4.5 Å from it
    got = vl(moved, b.cell, b.pbc, b.batch, b.ptr)
    fresh = neighbor_list_batch(dataclasses.replace(b, positions=moved), 5.0)
    assert vl.n_builds == 2 and torch.equal(got.edge_index, fresh.edge_index) and torch.equal(got.shifts, fresh.shifts)
    assert got.num_edges == 2 and bool((got.shifts != 0).any()), "the image pair, through the rebuild"


def test_verlet_device_inputs_are_kept_while_the_same_tensors_come():
    """A build on another device copies the caller's cell, pbc, batch and ptr once while the very same tensors come
    unmodified (MD): the same copies again; an in-place change or another tensor gets new copies. (Copies on the
    meta device: the caching alone, on a machine without a GPU.)"""
    b = AtomsBatch.from_atoms(Atoms("H2", positions=[[0, 0, 0], [0.7, 0, 0]], cell=np.eye(3) * 5, pbc=True))
    vl = VerletNeighborList(3.0)
    meta = torch.device("meta")
    inputs = (b.cell, b.pbc, b.batch, b.ptr)
    first = vl._device_inputs(inputs, meta)
    assert all(c.device == meta for c in first)
    assert all(a is c for a, c in zip(vl._device_inputs(inputs, meta), first, strict=True))
    b.cell.mul_(1.0)  # in place: a new version
    again = vl._device_inputs(inputs, meta)
    assert all(a is not c for a, c in zip(again, first, strict=True))
    other = (b.cell.clone(), b.pbc, b.batch, b.ptr)
    assert vl._device_inputs(other, meta)[0] is not again[0]


def test_verlet_bad_input():
    for kwargs, match in [
        ({"cutoff": 0.0}, "cutoff"),
        ({"cutoff": float("nan")}, "cutoff"),
        ({"cutoff": 3.0, "skin": -0.1}, "skin"),
        ({"cutoff": 3.0, "skin": "wide"}, "skin"),
    ]:
        with pytest.raises(ValueError, match=match):
            VerletNeighborList(**kwargs)
    vl = VerletNeighborList(3.0)
    with pytest.raises(ValueError, match="skin"):
        vl.skin = float("inf")


def test_verlet_seen_object_shortcut_decides_as_full_compare():
    """An MD step that passes the same cell/pbc/batch/ptr/numbers objects (the shortcut: only positions are
    compared) decides as one that passes an equal but new cell tensor (every input compared), and both follow the
    skin / 2 rule, for displacements on both sides of it, in float32 and float64."""
    rng = np.random.default_rng(11)
    atoms = Atoms("H30", positions=rng.uniform(0, 8, (30, 3)), cell=np.eye(3) * 8.0, pbc=True)
    for dtype in (torch.float32, torch.float64):
        b = AtomsBatch.from_atoms(atoms, dtype=dtype)
        vl = VerletNeighborList(3.0, skin=0.8)
        vl.update_batch(b)
        vl.update_batch(b)  # the cell, pbc, batch, ptr, numbers objects are now "seen"
        for step in range(40):
            moved = b.positions.clone()
            moved[step % 30] += torch.tensor(rng.normal(0, 0.25, 3), dtype=dtype)
            fast = vl.needs_rebuild(moved, b.cell, b.pbc, b.batch, b.ptr, b.numbers)
            slow = vl.needs_rebuild(moved, b.cell.clone(), b.pbc, b.batch, b.ptr, b.numbers)
            far = float((moved.double() - b.positions.double()).square().sum(1).max()) > 0.4**2
            assert fast == slow == far


def test_verlet_host_fast_path_decides_as_the_reference_formula(monkeypatch):
    """Host positions with the very same cell/pbc/batch/ptr/numbers objects take the NumPy fast path (the generic
    compare never runs) and decide exactly as ``(d * d).sum(axis=1).max() > (skin / 2)^2`` in float64, also for
    displacements within rounding of skin / 2; anything else (an in-place edit of the cell, another positions
    dtype, numbers dropped) goes the generic way and rebuilds."""
    rng = np.random.default_rng(12)
    atoms = Atoms("H30", positions=rng.uniform(0, 8, (30, 3)), cell=np.eye(3) * 8.0, pbc=True)
    half = 0.4
    for dtype in (torch.float32, torch.float64):
        for with_numbers in (True, False):
            b = AtomsBatch.from_atoms(atoms, dtype=dtype)
            numbers = b.numbers if with_numbers else None
            vl = VerletNeighborList(3.0, skin=2 * half, strain_reuse=False)  # a changed cell rebuilds
            vl(b.positions, b.cell, b.pbc, b.batch, b.ptr, numbers)
            built = b.positions.clone()
            generic = []
            slow = vl._needs_rebuild
            monkeypatch.setattr(vl, "_needs_rebuild", lambda *a, _slow=slow, _g=generic: _g.append(1) or _slow(*a))
            answers = set()
            for step in range(300):
                moved = built.clone()
                u = rng.normal(size=3)
                r = half * (1 + rng.choice([-1.0, 1.0]) * 10 ** rng.uniform(-17, -3))
                moved[step % 30] += torch.tensor(u / np.linalg.norm(u) * r, dtype=dtype)
                if step % 3 == 0:
                    moved.requires_grad_(True)
                d = moved.detach().numpy().astype(np.float64) - built.numpy()
                want = bool((d * d).sum(axis=1).max() > half**2)
                got = vl.needs_rebuild(moved, b.cell, b.pbc, b.batch, b.ptr, numbers)
                assert got is want, (dtype, step)
                answers.add(got)
            assert answers == {True, False}
            assert not generic, "the fast path decided every call"
            other = torch.float64 if dtype == torch.float32 else torch.float32
            assert vl.needs_rebuild(built.to(other), b.cell, b.pbc, b.batch, b.ptr, numbers)
            if with_numbers:
                assert vl.needs_rebuild(built, b.cell, b.pbc, b.batch, b.ptr)  # numbers no longer given
            assert not vl.needs_rebuild(built, b.cell, b.pbc, b.batch, b.ptr, numbers)
            n_generic = len(generic)
            b.cell.mul_(1.0)  # an in-place op bumps the version: compared again (equal: no rebuild)
            assert not vl.needs_rebuild(built, b.cell, b.pbc, b.batch, b.ptr, numbers)
            assert len(generic) == n_generic + 1
            assert not vl.needs_rebuild(built, b.cell, b.pbc, b.batch, b.ptr, numbers)  # seen again: fast
            assert len(generic) == n_generic + 1
            b.cell[0, 0, 0] += 0.01  # an in-place change of the cell rebuilds
            assert vl.needs_rebuild(built, b.cell, b.pbc, b.batch, b.ptr, numbers)


def test_near_rebuild_extrapolates_the_largest_displacement():
    """``near_rebuild``: near after a build until two displacement tests on different positions ran; then near
    where the largest displacement plus ``steps`` times its growth between those tests reaches half the skin; a
    second test of the same positions keeps the growth; never for a complete list. A hint only: the rebuild
    itself stays the displacement test's."""
    chain = Atoms("C12", positions=[[1.5 * k, 0.0, 0.0] for k in range(12)])
    b = AtomsBatch.from_atoms(chain, dtype=torch.float32)
    vl = VerletNeighborList(5.0, skin=1.0)  # rebuild distance 0.5 Å
    vl(b.positions, b.cell, b.pbc, b.batch, b.ptr)
    assert not vl.complete and vl.near_rebuild()  # no test yet

    def test_at(shift: float) -> bool:
        moved = b.positions.clone()
        moved[3, 2] += shift
        return vl.needs_rebuild(moved, b.cell, b.pbc, b.batch, b.ptr)

    assert not test_at(0.05) and vl.near_rebuild()  # one test: no growth known
    assert not test_at(0.10) and not vl.near_rebuild()  # 0.10 + 3 x 0.05 = 0.25 < 0.5
    assert not test_at(0.10) and not vl.near_rebuild()  # the same positions again: the growth kept
    assert not test_at(0.25) and vl.near_rebuild()  # 0.25 + 3 x 0.15 = 0.70
    assert not vl.near_rebuild(steps=1.0)  # 0.25 + 0.15 = 0.40
    assert not test_at(0.20) and not vl.near_rebuild()  # shrinking: 0.20 < 0.5
    assert not test_at(0.45) and vl.near_rebuild(steps=0.5)  # 0.45 + 0.125
    assert test_at(0.55) and vl.n_builds == 1  # a test decides; the hint rebuilt nothing
    assert vl.n_builds == 1

    small = AtomsBatch.from_atoms(Atoms("H2", positions=[[0, 0, 0], [0.74, 0, 0]]), dtype=torch.float32)
    vl = VerletNeighborList(5.0, skin=0.3)
    vl(small.positions, small.cell, small.pbc, small.batch, small.ptr)
    assert vl.complete and not vl.near_rebuild()
