"""The Verlet list kept across cell changes (NPT): the strain-aware test of ``VerletNeighborList``.

Every kept list must hold every pair a fresh list finds, with the shift vectors of the current cell; the test
must rebuild once the strain and the displacements since the build no longer fit in the skin."""

import numpy as np
import pytest
import torch
from ase import Atoms
from helpers import triclinic_cu

from mlff_distiller import AtomsBatch
from mlff_distiller.neighbors import VerletNeighborList, neighbor_list_batch


def _pairs(nl):
    i, j = nl.edge_index.tolist()
    return sorted(zip(i, j, map(tuple, nl.shifts.tolist()), strict=True))


def _strained(atoms: Atoms, rng: np.random.Generator, strain: float, rattle: float) -> Atoms:
    """``atoms`` with its cell deformed by a random symmetric strain (atoms following it, as a barostat moves
    them) and each atom then displaced by a Gaussian of σ ``rattle`` Å."""
    e = rng.normal(0.0, strain, (3, 3))
    out = atoms.copy()
    out.set_cell(atoms.cell[:] @ (np.eye(3) + 0.5 * (e + e.T)), scale_atoms=True)
    out.positions += rng.normal(0.0, rattle, (len(out), 3))
    return out


def _systems():
    rng = np.random.default_rng(3)
    cell = np.array([[8.5, 0.0, 0.0], [1.8, 8.0, 0.0], [-1.2, 1.1, 7.6]])
    h = Atoms("H40", positions=rng.uniform(0, 1, (40, 3)) @ cell, cell=cell, pbc=True)
    return [h, triclinic_cu()]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_kept_lists_equal_fresh_ones_under_strain_and_motion(dtype):
    """60 steps of random cell strains and displacements on a batch of two triclinic cells: the filtered list
    equals a fresh one every step (pairs, shifts and shift vectors); the unfiltered kept list holds every fresh
    pair. The list is kept most steps and rebuilt when the drift exhausts the skin."""
    rng = np.random.default_rng(0)
    systems = _systems()
    cutoff, skin = 3.0, 0.8
    vl = VerletNeighborList(cutoff, skin=skin)
    kept = VerletNeighborList(cutoff, skin=skin, filter=False)
    for step in range(60):
        systems = [_strained(a, rng, 0.002, 0.02) for a in systems]
        b = AtomsBatch.from_atoms(systems, dtype=dtype)
        got = vl.update_batch(b)
        want = neighbor_list_batch(b, cutoff, "brute")
        assert _pairs(got) == _pairs(want), step
        order = {p: k for k, p in enumerate(_pairs_in_order(want))}
        perm = [order[p] for p in _pairs_in_order(got)]
        tol = 1e-12 if dtype == torch.float64 else 1e-5
        np.testing.assert_allclose(got.shift_vectors.numpy(), want.shift_vectors.numpy()[perm], atol=tol)
        padded = kept.update_batch(b)
        assert set(_pairs(want)) <= set(_pairs(padded)), step
        cell = b.cell.to(torch.float64)[b.batch[padded.edge_index[0]]]
        expect = torch.einsum("ea,eab->eb", padded.shifts.to(torch.float64), cell)
        np.testing.assert_allclose(padded.shift_vectors.to(torch.float64).numpy(), expect.numpy(), atol=tol)
    assert 1 < vl.n_builds < 20 and vl.cell_updates > 30, (vl.n_builds, vl.cell_updates)


def _pairs_in_order(nl):
    i, j = nl.edge_index.tolist()
    return list(zip(i, j, map(tuple, nl.shifts.tolist()), strict=True))


def test_the_strain_test_on_a_uniform_compression():
    """Atoms scaled with a cubic cell (no displacement beyond the affine one): the list is kept while
    (cutoff + skin) δ <= skin for a compression by δ, and rebuilt beyond; a pair just outside cutoff + skin at the
    build comes within the cutoff only beyond that bound, so no pair is ever missed."""
    cutoff, skin, a = 3.0, 0.6, 10.0
    reach = cutoff + skin
    # Two atoms at just over cutoff + skin: the pair the compression brings in.
    atoms = Atoms("H2", positions=[[1.0, 1.0, 1.0], [1.0 + reach * 1.0001, 1.0, 1.0]], cell=np.eye(3) * a, pbc=True)
    bound = skin / reach  # δ at which the test must rebuild
    for delta, rebuilds in ((0.99 * bound, False), (1.01 * bound, True)):
        vl = VerletNeighborList(cutoff, skin=skin)
        vl.update_batch(AtomsBatch.from_atoms(atoms, dtype=torch.float64))
        squeezed = atoms.copy()
        squeezed.set_cell(atoms.cell[:] * (1 - delta), scale_atoms=True)
        b = AtomsBatch.from_atoms(squeezed, dtype=torch.float64)
        got = vl.update_batch(b)
        assert (vl.n_builds == 2) is rebuilds, delta
        assert _pairs(got) == _pairs(neighbor_list_batch(b, cutoff, "brute"))
    # The pair really is inside the cutoff once compressed by more than skin / (cutoff + skin) / 1.0001 - ...:
    # at δ = bound it sits at reach (1 - bound) = cutoff, so the bound is tight for this pair.
    assert reach * 1.0001 * (1 - bound) == pytest.approx(cutoff, rel=1e-3)


def test_cell_changes_rebuild_without_full_periodicity_or_when_asked():
    rng = np.random.default_rng(5)
    slab = _systems()[0].copy()
    slab.pbc = [True, True, False]
    for atoms, kwargs in ((slab, {}), (_systems()[1], {"strain_reuse": False})):
        vl = VerletNeighborList(3.0, skin=0.8, **kwargs)
        vl.update_batch(AtomsBatch.from_atoms(atoms, dtype=torch.float64))
        b = AtomsBatch.from_atoms(_strained(atoms, rng, 0.001, 0.0), dtype=torch.float64)
        got = vl.update_batch(b)
        assert vl.n_builds == 2 and vl.cell_updates == 0
        assert _pairs(got) == _pairs(neighbor_list_batch(b, 3.0, "brute"))


def test_back_to_the_build_cell_restores_its_shift_vectors():
    atoms = _systems()[1]
    vl = VerletNeighborList(3.0, skin=0.8, filter=False)
    b0 = AtomsBatch.from_atoms(atoms, dtype=torch.float64)
    first = vl.update_batch(b0).shift_vectors.clone()
    b1 = AtomsBatch.from_atoms(_strained(atoms, np.random.default_rng(1), 0.002, 0.0), dtype=torch.float64)
    assert not torch.equal(vl.update_batch(b1).shift_vectors, first) and vl.cell_updates == 1
    back = AtomsBatch.from_atoms(atoms, dtype=torch.float64)
    torch.testing.assert_close(vl.update_batch(back).shift_vectors, first, rtol=0, atol=1e-14)
    assert vl.n_builds == 1 and vl.cell_updates == 2


def test_one_structure_strain_test_agrees_with_the_batched_form():
    """``_StrainTest`` decides one structure (MD and NPT through the calculator) with Python-float 3 x 3 algebra
    and ``u = x1 - s0 h1``; the batched form (inverse and SVD from NumPy) must take the same decision, here on
    random strains and displacements scattered around the rebuild bound, and reject singular or non-finite cells."""
    from mlff_distiller.neighbors.verlet import _StrainTest

    atoms = _systems()[0]
    b0 = AtomsBatch.from_atoms(atoms, dtype=torch.float64)
    ref = {"positions": b0.positions, "cell": b0.cell, "pbc": b0.pbc, "batch": b0.batch}
    one = _StrainTest.of(ref, 3.8)
    batched = _StrainTest.of(ref, 3.8)
    batched.single = False  # the [B]-wide form on the same data
    rng = np.random.default_rng(11)
    decisions = []
    for _ in range(400):
        strained = _strained(atoms, rng, 10 ** rng.uniform(-2.5, -0.7), 10 ** rng.uniform(-2, -0.7))
        b = AtomsBatch.from_atoms(strained, dtype=torch.float64)
        got = one.fits(b.positions, b.cell, 0.8)
        assert got == batched.fits(b.positions, b.cell, 0.8)
        decisions.append(got)
    assert 0.2 < np.mean(decisions) < 0.8  # both outcomes were tested
    flat = b0.cell.clone()
    flat[0, 2] = flat[0, 0] + flat[0, 1]  # coplanar cell vectors
    nan = b0.cell.clone()
    nan[0, 1, 1] = float("nan")
    for bad in (flat, nan):
        assert not one.fits(b0.positions, bad, 0.8) and not batched.fits(b0.positions, bad, 0.8)


def test_a_kept_list_makes_its_shift_vectors_when_read():
    """A kept list under a new cell records the cell (``pending_cell``); ``topology`` leaves it pending, ``last``
    and ``filtered`` make the shift vectors from the integer shifts and ``shift_basis``, once."""
    rng = np.random.default_rng(4)
    atoms = _systems()[0]
    vl = VerletNeighborList(3.0, skin=0.8, filter=False)
    vl.update_batch(AtomsBatch.from_atoms(atoms, dtype=torch.float64))
    b1 = AtomsBatch.from_atoms(_strained(atoms, rng, 0.002, 0.0), dtype=torch.float64)
    assert not vl.needs_rebuild(b1.positions, b1.cell, b1.pbc, b1.batch, b1.ptr, b1.numbers)
    assert vl.cell_updates == 1 and vl.pending_cell is not None
    stale = vl.topology.shift_vectors.clone()
    assert vl.pending_cell is not None  # topology did not make them
    shifts, structure = vl.shift_basis()
    want = torch.einsum("ea,eab->eb", shifts, b1.cell.to(torch.float64)[structure])
    assert not torch.allclose(stale, want)
    torch.testing.assert_close(vl.last.shift_vectors, want, rtol=0, atol=1e-14)
    assert vl.pending_cell is None and vl.last is vl.last  # made once
    got = vl.filtered(b1.positions)
    fresh = neighbor_list_batch(b1, 3.0, "brute")
    assert _pairs(got) == _pairs(fresh)


def test_closed_form_3x3_norm_and_determinant():
    """The one-structure strain test's 3 x 3 algebra against LAPACK: the spectral norm (the strain's reach in the
    skin budget: too small would miss pairs) and the determinant, on random, isotropic, diagonal, rank-one, zero,
    tiny and large matrices."""
    from mlff_distiller.neighbors.verlet import _det3, _spectral_norm3

    rng = np.random.default_rng(0)
    cases = [rng.normal(size=(3, 3)) * 10.0 ** rng.uniform(-7, 2) for _ in range(3000)]
    cases += [np.eye(3) * s for s in (1e-9, -3e-4, 0.02, 1.0)]
    cases += [np.diag(rng.normal(size=3)) for _ in range(50)]
    cases += [np.outer(rng.normal(size=3), rng.normal(size=3)) for _ in range(50)]
    cases += [np.zeros((3, 3)), np.diag([1.0, 1.0, 1.0 + 1e-12])]
    for m in cases:
        want = np.linalg.norm(m, 2)
        assert abs(_spectral_norm3(m.tolist()) - want) <= 1e-12 * want + 1e-300, m
        assert abs(_det3(m.tolist()) - np.linalg.det(m)) <= 1e-12 * max(np.abs(m).max() ** 3, 1e-300), m
