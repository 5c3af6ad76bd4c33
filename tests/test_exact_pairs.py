"""Pair vectors made in float64 (``AtomsBatch.positions64``): a float32 batch whose coordinates reach
``PRECISE_PAIRS_FROM`` Å keeps its float64 positions and cell, and the engine (eager and padded paths) makes the
pair vectors from them, rounded once. A periodic box whose atoms sit in far images of the cell is the same
physical system as the wrapped box, so both must give the same energies, forces and stress; from float32
coordinates of ~400 Å they did not (1.6e-3 eV/Å against 2e-5)."""

import dataclasses
import os

import numpy as np
import pytest
import torch
from ase import Atoms, units
from ase.build import molecule
from ase.md.verlet import VelocityVerlet
from helpers import triclinic_cu

from mlff_distiller import ForceEngine, StudentCalculator, load_model, predict_forces
from mlff_distiller import batch as batch_module
from mlff_distiller.batch import PRECISE_PAIRS_FROM, AtomsBatch
from mlff_distiller.neighbors import neighbor_list

# Relative to the largest force (~9 eV/Å in these boxes). Measured on the development CPU with the shipped
# student (81 water atoms, images up to ~420 Å away): float64 pairs 6e-6 eV/Å from the float64 result, float32
# positions 1.6e-3; the wrapped box in float32 2.1e-5. The engine's float32 tolerance is 1e-4 of the largest force.
FORCE_BOUND = 1e-5
FLOAT32_TOLERANCE = 1e-4


def force_error(forces, ref) -> float:
    """The largest force error relative to the largest reference force."""
    forces, ref = np.asarray(forces, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    return float(np.abs(forces - ref).max() / np.abs(ref).max())


@pytest.fixture(scope="module")
def student():
    return load_model("builtin:chno-gfn2")


def water_box(side: float = 14.0, seed: int = 0) -> Atoms:
    """27 water molecules in a cubic periodic box, rattled."""
    rng = np.random.default_rng(seed)
    numbers, positions = [], []
    for k in range(27):
        w = molecule("H2O")
        w.rotate(rng.uniform(0, 360), rng.normal(size=3))
        centre = (np.array([k % 3, (k // 3) % 3, k // 9]) + 0.5) * side / 3
        positions.append(w.positions + centre)
        numbers += list(w.numbers)
    box = Atoms(numbers=numbers, positions=np.concatenate(positions), cell=[side] * 3, pbc=True)
    box.rattle(0.05, seed=seed + 1)
    return box


def far_images(atoms: Atoms, seed: int = 0, lo: int = 8, hi: int = 30) -> Atoms:
    """``atoms`` with every atom but the first moved by a whole number of cell vectors (``lo`` to ``hi`` cells
    along each): the same periodic system, with coordinates up to ``hi`` box lengths."""
    rng = np.random.default_rng(seed)
    out = atoms.copy()
    out.positions[1:] += rng.integers(lo, hi, size=(len(out) - 1, 3)) @ np.asarray(atoms.cell)
    return out


def test_from_atoms_keeps_float64_positions_where_coordinates_reach_the_threshold():
    box = water_box()
    far = far_images(box)
    assert AtomsBatch.from_atoms(box, dtype=torch.float32).positions64 is None
    assert AtomsBatch.from_atoms(far, dtype=torch.float64).positions64 is None  # float64 positions need none
    b = AtomsBatch.from_atoms([box, far], dtype=torch.float32)
    assert b.positions64.dtype == b.cell64.dtype == torch.float64
    want = np.concatenate([box.positions - box.positions[0], far.positions - far.positions[0]])
    assert np.array_equal(b.positions64.numpy(), want)  # the same float64 subtraction, not rounded
    assert np.array_equal(b.cell64.numpy(), np.stack([box.cell.array, far.cell.array]))
    assert torch.equal(b.positions, b.positions64.to(torch.float32))
    # A molecule of 100 Å or more gets them too (the origin is its first atom).
    chain = Atoms("H2", positions=[[0, 0, 0], [PRECISE_PAIRS_FROM, 0, 0]])
    assert AtomsBatch.from_atoms(chain, dtype=torch.float32).positions64 is not None
    chain.positions[1, 0] = PRECISE_PAIRS_FROM - 1
    assert AtomsBatch.from_atoms(chain, dtype=torch.float32).positions64 is None
    # Moved, they stay float64; cast to float64, the batch takes them as its positions and cell.
    moved = b.to("cpu", torch.float32)
    assert moved.positions64.dtype == torch.float64 and moved.positions.dtype == torch.float32
    wide = b.to(dtype=torch.float64)
    assert wide.positions64 is None and wide.cell64 is None
    assert torch.equal(wide.positions, b.positions64) and torch.equal(wide.cell, b.cell64)
    # Back to Atoms from the float64 positions: the caller's coordinates, to float64 rounding.
    np.testing.assert_allclose(b.to_atoms()[1].positions, far.positions, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="positions64 and cell64 come together"):
        dataclasses.replace(b, cell64=None)
    with pytest.raises(ValueError, match="positions64 must be"):
        dataclasses.replace(b, positions64=b.positions64[1:])


def test_pair_vectors64_of_several_structures_are_the_float64_vectors():
    """Two structures with different (one triclinic) cells: the float64 pair vectors from a float32 batch equal
    the vectors of a float64 batch of the same structures, and a batch without float64 positions has none."""
    structures = [far_images(water_box(side=13.0, seed=3), seed=1), far_images(triclinic_cu(), seed=2)]
    b32 = AtomsBatch.from_atoms(structures, dtype=torch.float32)
    b64 = AtomsBatch.from_atoms(structures, dtype=torch.float64)
    nl = neighbor_list(b64.positions, b64.cell, b64.pbc, b64.batch, b64.ptr, 5.0)
    assert nl.num_edges > 0 and bool((nl.shifts != 0).any())
    vec = b32.pair_vectors64(nl.edge_index, nl.shifts)
    assert vec.dtype == torch.float64
    np.testing.assert_allclose(vec.numpy(), nl.vectors(b64.positions).numpy(), rtol=0, atol=1e-11)
    with pytest.raises(ValueError, match="needs a batch with positions64"):
        b64.pair_vectors64(nl.edge_index, nl.shifts)


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_far_images_give_the_wrapped_box_results(student, monkeypatch, kernels):
    """Energy, forces and stress of the far-image box in float32 against the wrapped box in float64: within
    the float32 bound with float64 pairs, well outside it without them (the threshold raised past the box). On
    the torch kernels (the written-out CPU backward) and on the Triton kernels (the interpreter)."""
    if kernels == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernels on CPU tensors need the interpreter (TRITON_INTERPRET=1)")
    monkeypatch.setenv("MLFF_DISTILLER_KERNELS", kernels)
    box = water_box()
    far = far_images(box)
    ref = predict_forces(student, [box], device="cpu", precision="fp64", stress=True)[0]
    out = predict_forces(student, [far], device="cpu", precision="fp32", stress=True)[0]
    assert force_error(out["forces"], ref["forces"]) < FORCE_BOUND
    assert abs(out["energy"] - ref["energy"]) < 2e-5
    np.testing.assert_allclose(out["stress"], ref["stress"], rtol=0, atol=2e-7)
    monkeypatch.setattr(batch_module, "PRECISE_PAIRS_FROM", float("inf"))
    plain = ForceEngine(student, device="cpu", precision="fp32").compute(
        AtomsBatch.from_atoms(far, dtype=torch.float32), stress=True
    )
    assert force_error(plain["forces"], ref["forces"]) > FLOAT32_TOLERANCE


def test_verlet_list_and_spatial_order_carry_the_float64_positions(student):
    """The eager Verlet path in Morton order (MD of a large system): the float64 positions are sorted with the
    atoms, step after step, and the forces stay those of the wrapped box; so on the sorted path without a Verlet
    list."""
    box = water_box(seed=4)
    far = far_images(box, seed=4)
    engine = ForceEngine(student, device="cpu", precision="fp32", neighbor_skin=0.5, spatial_sort_min_atoms=8)
    ref_engine = ForceEngine(student, device="cpu", precision="fp64")
    rng = np.random.default_rng(5)
    for _ in range(3):
        step = rng.normal(0, 0.02, box.positions.shape)  # within the skin: one build
        box.positions += step
        far.positions += step
        out = engine.compute(AtomsBatch.from_atoms(far, dtype=torch.float32))
        ref = ref_engine.compute(AtomsBatch.from_atoms(box))
        assert force_error(out["forces"], ref["forces"]) < FORCE_BOUND
    assert engine.verlet.n_builds == 1 and engine._verlet_sorted
    # A fresh list per call, in Morton order (the eager path of large batches).
    sorted_engine = ForceEngine(student, device="cpu", precision="fp32", spatial_sort_min_atoms=8)
    out = sorted_engine.compute(AtomsBatch.from_atoms(far, dtype=torch.float32))
    assert force_error(out["forces"], ref["forces"]) < FORCE_BOUND


def test_md_through_the_calculator_keeps_float64_positions(student):
    """StudentCalculator's MD steps (the previous batch with new positions): a box with far images keeps its
    float64 positions from step to step, and a box whose atoms move out past the threshold gets them on that
    step; its forces stay those of the wrapped box."""
    box = water_box(seed=6)
    far = far_images(box, seed=6)
    far.calc = StudentCalculator(student, device="cpu", precision="fp32")
    ref_calc = StudentCalculator(student, device="cpu", precision="fp64")
    rng = np.random.default_rng(7)
    far.set_velocities(rng.normal(0, 0.05, far.positions.shape))  # ~5e-3 Å/fs, thermal speeds near 300 K
    dyn = VelocityVerlet(far, timestep=0.5 * units.fs)
    for _ in range(3):
        dyn.run(1)
        batch = far.calc._last_batch
        assert batch.positions64 is not None
        assert np.array_equal(batch.positions64.numpy(), far.positions - batch.origin.numpy()[0])
        wrapped = far.copy()
        wrapped.wrap()
        wrapped.calc = ref_calc
        assert force_error(far.get_forces(), wrapped.get_forces()) < FORCE_BOUND
    # A wrapped box (no float64 positions) whose atoms are moved out by whole cells in a positions-only step.
    box.calc = StudentCalculator(student, device="cpu", precision="fp32")
    ref = box.get_forces()
    assert box.calc._last_batch.positions64 is None
    moved = far_images(box, seed=8)
    box.positions = moved.positions
    forces = box.get_forces()
    assert box.calc._last_batch.positions64 is not None
    assert force_error(forces, ref) < 2 * FORCE_BOUND  # both in float32


@pytest.mark.parametrize("kw", [{}, {"pad": True}, {"pad": True, "neighbor_skin": 0.5}])
def test_a_float64_engine_takes_the_float64_positions(student, kw):
    """An fp64 engine given a float32 batch with float64 positions computes from them (the cast folds them
    in), not from the rounded ones: eager, padded, and the padded Verlet path over two steps."""
    far = far_images(water_box(seed=9), seed=9)
    engine = ForceEngine(student, device="cpu", precision="fp64", **kw)
    ref_engine = ForceEngine(student, device="cpu", precision="fp64")
    for _ in range(2):
        far.positions += 0.01
        out = engine.compute(AtomsBatch.from_atoms(far, dtype=torch.float32))
        ref = ref_engine.compute(AtomsBatch.from_atoms(far))
        np.testing.assert_allclose(out["forces"].numpy(), ref["forces"].numpy(), rtol=0, atol=1e-9)


@pytest.mark.parametrize("skin", [None, 0.5])
def test_padded_paths_write_the_float64_pair_vectors(student, skin):
    """The padded paths (static buckets; captured on CUDA): a fresh list per call, and the Verlet path, whose
    static shift vectors get the step's float64 pair vectors every step (energy + forces and the stress step). A
    trajectory that moves out past the threshold refills its bucket with them; one that comes back refills it
    with plain positions."""
    box = water_box(seed=12)
    far = far_images(box, seed=12)
    engine = ForceEngine(student, device="cpu", precision="fp32", pad=True, neighbor_skin=skin)
    ref_engine = ForceEngine(student, device="cpu", precision="fp64")
    rng = np.random.default_rng(13)
    for _ in range(3):
        step = rng.normal(0, 0.02, box.positions.shape)
        box.positions += step
        far.positions += step
        for stress in (False, True):
            engine.last_bucket = None
            out = engine.compute(AtomsBatch.from_atoms(far, dtype=torch.float32), stress=stress)
            assert engine.last_bucket is not None  # the padded path ran
            ref = ref_engine.compute(AtomsBatch.from_atoms(box), stress=stress)
            assert force_error(out["forces"], ref["forces"]) < FORCE_BOUND
            if stress:
                np.testing.assert_allclose(out["stress"].numpy(), ref["stress"].numpy(), rtol=0, atol=2e-7)
    if skin is None:
        return
    assert engine.verlet.n_builds == 1 and engine._verlet_fill.exact

    # The same positions (no rebuild) on the other side of the threshold: the bucket is filled again with plain
    # positions, then again with float64 pair vectors.
    ref = ref_engine.compute(AtomsBatch.from_atoms(box))
    for threshold, exact in ((float("inf"), False), (PRECISE_PAIRS_FROM, True)):
        batch_module.PRECISE_PAIRS_FROM = threshold
        try:
            batch = AtomsBatch.from_atoms(far, dtype=torch.float32)
        finally:
            batch_module.PRECISE_PAIRS_FROM = PRECISE_PAIRS_FROM
        out = engine.compute(batch)
        assert engine._verlet_fill.exact == exact and engine.verlet.n_builds == 1
        assert force_error(out["forces"], ref["forces"]) < (FORCE_BOUND if exact else 10 * FLOAT32_TOLERANCE)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["eager", "auto"])
def test_far_images_on_cuda(student, mode):
    """On CUDA (the Triton kernels), eager and mode "auto" (its padded paths, captured after their first calls):
    the far-image box in float32 against the wrapped box in float64."""
    box = water_box(seed=10)
    far = far_images(box, seed=10)
    ref = predict_forces(student, [box], device="cpu", precision="fp64", stress=True)[0]
    engine = ForceEngine(student, device="cuda", precision="fp32", mode=mode)
    for _ in range(3):
        out = engine.compute(AtomsBatch.from_atoms(far, dtype=torch.float32), stress=True, to_host=True)
        assert force_error(out["forces"], ref["forces"]) < FORCE_BOUND
        np.testing.assert_allclose(out["stress"].numpy()[0], ref["stress"], rtol=0, atol=2e-7)
    if mode == "auto":  # the padded stress step ran, and was captured
        assert engine.last_bucket is not None and engine._stress_runners


@pytest.mark.gpu
@pytest.mark.parametrize("kw", [{"mode": "eager"}, {"mode": "auto"}, {"mode": "auto", "neighbor_skin": 0.5}])
def test_a_float64_engine_on_cuda_takes_the_float64_positions(student, kw):
    """A float64 engine on CUDA given a float32 host batch with float64 positions: eager, padded (moved to the
    device with its cached topology) and padded Verlet results equal those of the float64 batch."""
    far = far_images(water_box(seed=14), seed=14)
    engine = ForceEngine(student, device="cuda", precision="fp64", **kw)
    ref_engine = ForceEngine(student, device="cpu", precision="fp64")
    for _ in range(3):
        far.positions += 0.01
        out = engine.compute(AtomsBatch.from_atoms(far, dtype=torch.float32), to_host=True)
        ref = ref_engine.compute(AtomsBatch.from_atoms(far))
        np.testing.assert_allclose(out["forces"].numpy(), ref["forces"].numpy(), rtol=0, atol=1e-9)


@pytest.mark.gpu
def test_md_through_the_calculator_on_cuda(student):
    """StudentCalculator on CUDA (its MD steps take the padded Verlet path, captured): a few steps of the
    far-image box, each against the wrapped box in float64 on the CPU."""
    far = far_images(water_box(seed=11), seed=11)
    far.calc = StudentCalculator(student, device="cuda", precision="fp32")
    far.set_velocities(np.random.default_rng(12).normal(0, 0.05, far.positions.shape))
    ref_calc = StudentCalculator(student, device="cpu", precision="fp64")
    dyn = VelocityVerlet(far, timestep=0.5 * units.fs)
    for _ in range(3):
        dyn.run(2)
        assert far.calc._last_batch.positions64 is not None
        wrapped = far.copy()
        wrapped.wrap()
        wrapped.calc = ref_calc
        assert force_error(far.get_forces(), wrapped.get_forces()) < FORCE_BOUND
    engine = far.calc.engine
    assert engine._verlet_fill is not None and engine._verlet_fill.exact and engine.captured_buckets


@pytest.mark.gpu
def test_molecules_far_apart_through_the_calculator_on_cuda(student):
    """Two molecules 250 Å apart in one non-periodic structure through StudentCalculator on CUDA: coordinates past
    PRECISE_PAIRS_FROM in the calculator's frame, so float64 pair vectors, made on the device from a list built on
    the host (the fill moves the host pairs there first; stop 67 found a molecule that had flown past 100 Å stop
    the MD with a device mismatch). Forces against the float64 CPU calculator, over MD steps."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    far = molecule("CH3CH2OH")
    other = molecule("H2O")
    other.translate([250.0, 10.0, -5.0])
    far += other
    far.calc = StudentCalculator(student, device="cuda", precision="fp32")
    far.set_velocities(np.random.default_rng(13).normal(0, 0.02, far.positions.shape))
    ref_calc = StudentCalculator(student, device="cpu", precision="fp64")
    dyn = VelocityVerlet(far, timestep=0.5 * units.fs)
    for _ in range(3):
        dyn.run(2)
        assert far.calc._last_batch.positions64 is not None
        same = far.copy()
        same.calc = ref_calc
        assert force_error(far.get_forces(), same.get_forces()) < FORCE_BOUND
    engine = far.calc.engine
    assert engine._verlet_fill is not None and engine._verlet_fill.exact


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_batched_md_in_float32_makes_float64_pair_vectors_far_from_the_origin(student, device):
    """BatchedMD keeps its state in float64 in the caller's frame: a float32 engine took its float32 rounding, so
    a molecule 10,000 Å from the origin had forces 0.016 eV/Å off (1,000 Å: 3.3e-3). With coordinates of
    PRECISE_PAIRS_FROM and more the engine makes the pair vectors from the float64 state itself, step after step;
    a molecule near the origin keeps the float32 path."""
    from mlff_distiller import BatchedMD

    ethanol = molecule("CH3CH2OH")
    ethanol.rattle(0.05, seed=15)
    far = ethanol.copy()
    far.positions += 10_000.0
    box = far_images(water_box(seed=16), seed=16)
    md = BatchedMD(student, [far, box, ethanol], device=device, precision="fp32", ensemble="nve", seed=17)
    assert md._batch.positions64 is md._batch.positions  # the live state
    near = BatchedMD(student, [ethanol], device=device, precision="fp32", ensemble="nve", seed=17)
    assert near._batch.positions64 is None
    for _ in range(2):
        md.run(2)
        frames = md.get_atoms()
        refs = predict_forces(student, frames, device="cpu", precision="fp64")
        for frame, ref in zip(frames, refs, strict=True):
            assert force_error(frame.get_forces(), ref["forces"]) < FORCE_BOUND


def drifting_molecule(threshold: float, speed: float = 0.4) -> Atoms:
    """Ethanol just below ``threshold`` Å (its largest coordinate 0.5 Å under it), moving at ``speed`` Å/fs along
    (1, 1, 1): it crosses the threshold after ~1.25 fs."""
    ethanol = molecule("CH3CH2OH")
    ethanol.rattle(0.05, seed=21)
    ethanol.positions += threshold - 0.5 - ethanol.positions.max()
    velocity = np.full((len(ethanol), 3), speed / units.fs)
    ethanol.set_momenta(ethanol.get_masses()[:, None] * velocity)
    return ethanol


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("observed", [False, True])
def test_batched_md_takes_float64_pair_vectors_once_a_replica_drifts_past_the_threshold(
    student, device, observed, monkeypatch
):
    """A replica that starts below PRECISE_PAIRS_FROM and drifts past it (molecules without fix_com, unwrapped
    periodic atoms) gets float64 pair vectors from the next check on: every PRECISE_CHECK_EVERY steps, or at an
    observation of run(). The threshold is raised to 10,000 Å here, where float32 pair vectors miss by ~1e-3 of
    the largest force, so the check can fail; a replica near the origin keeps the float32 path."""
    from mlff_distiller import BatchedMD
    from mlff_distiller import batched_md as batched_md_module

    threshold = 10_000.0
    monkeypatch.setattr(batch_module, "PRECISE_PAIRS_FROM", threshold)
    monkeypatch.setattr(batched_md_module, "PRECISE_CHECK_EVERY", 10**9 if observed else 4)
    ethanol = molecule("CH3CH2OH")
    ethanol.rattle(0.05, seed=22)
    kw = dict(device=device, precision="fp32", ensemble="nve", velocities="input", timestep_fs=0.5, fix_com=False)
    ethanol.set_momenta(np.zeros((len(ethanol), 3)))
    md = BatchedMD(student, [drifting_molecule(threshold), ethanol], **kw)
    assert md._batch.positions64 is None
    seen = []
    if observed:
        md.run(3, observer=lambda m: seen.append(m._batch.positions64 is not None), interval=1)
        assert seen == [False, False, False, True]  # (before the first step, then after each)
    else:
        md.run(3)
        assert md._batch.positions64 is None  # past the threshold since step 3, not checked yet
        md.run(1)
    assert float(md._batch.positions.abs().max()) > threshold
    assert md._batch.positions64 is md._batch.positions and md._batch.cell64 is md._batch.cell
    md.run(1)  # forces from the float64 pair vectors
    frames = md.get_atoms()
    refs = predict_forces(student, frames, device="cpu", precision="fp64")
    for frame, ref in zip(frames, refs, strict=True):
        assert force_error(frame.get_forces(), ref["forces"]) < FORCE_BOUND


@pytest.mark.gpu
def test_a_drifting_batched_md_misses_without_the_check_on_cuda(student, monkeypatch):
    """The control of the test above on CUDA: with no check after the start, the replica past 10,000 Å keeps
    float32 pair vectors, whose forces miss the float64 ones by more than FORCE_BOUND (so that test can fail there).
    On the CPU the engine itself gives a float64 host batch float64 pair vectors (ForceEngine._exact_float64_batch),
    so there the test above holds without BatchedMD's check, which its assertion on positions64 covers."""
    from mlff_distiller import BatchedMD
    from mlff_distiller import batched_md as batched_md_module

    monkeypatch.setattr(batch_module, "PRECISE_PAIRS_FROM", 10_000.0)
    monkeypatch.setattr(batched_md_module, "PRECISE_CHECK_EVERY", 10**9)
    kw = dict(device="cuda", precision="fp32", ensemble="nve", velocities="input", timestep_fs=0.5, fix_com=False)
    md = BatchedMD(student, [drifting_molecule(10_000.0)], **kw)
    md.run(5)
    assert md._batch.positions64 is None
    frame = md.get_atoms()[0]
    ref = predict_forces(student, [frame], device="cpu", precision="fp64")[0]
    assert force_error(frame.get_forces(), ref["forces"]) > 10 * FORCE_BOUND


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_relax_batch_in_float32_makes_float64_pair_vectors_far_from_the_origin(student, device, monkeypatch):
    """relax_batch's positions are float64 in the caller's frame, on the device: a float32 engine took their
    float32 rounding there (ForceEngine makes float64 pair vectors for host batches only). A batch with coordinates
    of PRECISE_PAIRS_FROM and more now gets them from FIRE's float64 positions; a molecule near the origin keeps
    the float32 path. The forces reported at the end are checked against float64 at the same positions."""
    from mlff_distiller import batched_relax, relax_batch

    seen = []
    real = batched_relax._exact_pairs_if_far

    def spy(batch, engine):
        real(batch, engine)
        seen.append(batch.positions64 is batch.positions and batch.cell64 is batch.cell)

    monkeypatch.setattr(batched_relax, "_exact_pairs_if_far", spy)
    ethanol = molecule("CH3CH2OH")
    ethanol.rattle(0.1, seed=23)
    far = ethanol.copy()
    far.positions += 10_000.0
    kw = dict(fmax=1e-3, steps=6, precision="fp32", device=device)
    relaxed = relax_batch(student, [far, ethanol], **kw)
    assert seen == [True]
    refs = predict_forces(student, relaxed, device="cpu", precision="fp64")
    for atoms, ref in zip(relaxed, refs, strict=True):
        assert force_error(atoms.get_forces(), ref["forces"]) < FORCE_BOUND
    seen.clear()
    relax_batch(student, [ethanol], **kw)
    assert seen == [False]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("kw", [{}, {"pad": True}, {"pad": True, "neighbor_skin": 0.5}])
def test_a_float64_batch_for_a_float32_engine(student, kw, device):
    """``ForceEngine.compute(AtomsBatch.from_atoms(atoms, device=...))`` (float64 by default, positions in the
    caller's frame) on a float32 engine: a molecule 10,000 Å from the origin and a far-image box get float64 pair
    vectors from the batch's own positions (0.016 eV/Å off before, for the molecule); a molecule near the origin
    keeps its path. On the host always; on a GPU where the engine builds a fresh list every call (the list build
    waits for the device anyway), not with a Verlet list, whose callers decide (no sync added to their steps)."""
    ethanol = molecule("CH3CH2OH")
    ethanol.rattle(0.05, seed=18)
    far = ethanol.copy()
    far.positions += 10_000.0
    box = far_images(water_box(seed=19), seed=19)
    engine = ForceEngine(student, device=device, precision="fp32", **kw)
    kept_by_engine = device == "cpu" or "neighbor_skin" not in kw
    for atoms in (far, box, ethanol):
        batch = AtomsBatch.from_atoms(atoms, device=device)  # float64
        kept = engine._exact_float64_batch(batch).positions64
        if atoms is ethanol or not kept_by_engine:
            assert kept is None
            if atoms is not ethanol:
                continue  # (the Verlet engine's device batch: float32 pairs, its callers' decision)
        else:
            assert torch.equal(kept, batch.positions)
        out = engine.compute(batch)
        ref = predict_forces(student, [atoms], device="cpu", precision="fp64")[0]
        assert force_error(out["forces"].cpu(), ref["forces"]) < FORCE_BOUND


def test_the_calculator_follows_a_changed_threshold(student, monkeypatch):
    """PRECISE_PAIRS_FROM set by the caller holds for the calculator's MD steps as for ``from_atoms``: coordinates
    between 100 Å and a raised threshold take the fast step (no float64 positions), not the full way every step."""
    monkeypatch.setattr(batch_module, "PRECISE_PAIRS_FROM", 1e6)
    box = far_images(water_box(seed=20), seed=20)
    box.calc = StudentCalculator(student, device="cpu", precision="fp32")
    box.get_forces()
    first = box.calc._last_batch
    box.positions = box.positions + 0.01
    box.get_forces()
    moved = box.calc._last_batch
    assert moved.positions64 is None and moved.numbers is first.numbers  # the previous batch, new positions
