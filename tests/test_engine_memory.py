"""ForceEngine's memory: batches sized by an atom budget, out-of-memory errors split and retried (nothing lost, input
order kept, pipelined or not, CUDA graphs or not), the budget's cap after an OOM and its lifting, and the memory
probe. Split from ``test_engine_modes.py``."""

import warnings

import numpy as np
import pytest
import torch
from helpers import random_molecules as _mols

from mlff_distiller import AtomsBatch, ForceEngine, batching, predict_forces

gpu = pytest.mark.gpu


def test_oom_splits_and_keeps_order(model, monkeypatch):
    """An injected out-of-memory error for any batch above 20 atoms: batches are halved until they fit,
    nothing is lost and the order is the input order."""
    mols = _mols(17, seed=7)
    ref = predict_forces(model, mols, precision="fp64", batch_size=1)
    engine = ForceEngine(model, device="cpu", precision="fp64", pad=True)
    real = ForceEngine.compute
    sizes = []

    def flaky(self, batch, **kw):
        sizes.append(batch.num_atoms)
        if batch.num_atoms > 20:
            raise torch.OutOfMemoryError("CUDA out of memory (injected by the test)")
        return real(self, batch, **kw)

    monkeypatch.setattr(ForceEngine, "compute", flaky)
    out = engine.predict(mols, atom_budget=10_000)
    assert len(out) == len(mols) and engine.oom_splits >= 2
    assert max(sizes) > 20 and engine.atom_budget() <= max(sizes) // 2
    for a, b, atoms in zip(ref, out, mols, strict=True):
        assert b["forces"].shape == (len(atoms), 3)
        assert a["energy"] == pytest.approx(b["energy"], abs=1e-10)
        np.testing.assert_allclose(a["forces"], b["forces"], atol=1e-10)
    # one structure that does not fit cannot be split: on the torch backend (this CPU's) the recompute cannot help,
    # so the error comes at once, without a retry or a warning
    monkeypatch.setitem(_update_module()._CONFIG, "recompute_uv_min_atoms", None)
    sizes.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", category=DeprecationWarning)  # NumPy 2.5 in ASE 3.29's Atoms
        with pytest.raises(torch.OutOfMemoryError):
            engine.predict([mols[0] + mols[1] + mols[2] + mols[3]], atom_budget=10_000)
    assert len(sizes) == 1 and _update_module()._CONFIG["recompute_uv_min_atoms"] is None


def _update_module():
    import importlib

    return importlib.import_module("mlff_distiller.kernels.painn_update")


@pytest.mark.parametrize("pipeline", [False, True])
def test_a_structure_out_of_memory_is_tried_again_with_the_recompute(model, monkeypatch, pipeline):
    """One structure out of memory (in a batch of several: split down to it first) is tried once more with the
    update blocks' uvvv made again in the backward from its atom count on (``recompute_uv_min_atoms``), with a
    warning; the results equal those of a run that fits, in input order, and the switch stays for later
    structures of as many atoms. Where it already applied, the error is raised as before."""
    pu = _update_module()
    monkeypatch.setitem(pu._CONFIG, "recompute_uv_min_atoms", None)
    # (the fused update blocks, which the recompute is for, are this CPU's only under the Triton interpreter)
    monkeypatch.setattr(batching, "_recompute_helps", lambda engine: True)
    mols = _mols(5, seed=3)
    big = mols[0] + mols[1] + mols[2]
    structures = [mols[3], big, mols[4]]
    want = predict_forces(model, structures, precision="fp64", batch_size=1)
    engine = ForceEngine(model, device="cpu", precision="fp64")
    real = ForceEngine.compute
    n_big = len(big)

    def fits_with_recompute(self, batch, **kw):
        limit = pu._CONFIG["recompute_uv_min_atoms"]
        if batch.num_atoms >= n_big and (limit is None or limit > batch.num_atoms):
            raise torch.OutOfMemoryError("CUDA out of memory (injected by the test)")
        return real(self, batch, **kw)

    monkeypatch.setattr(ForceEngine, "compute", fits_with_recompute)
    with pytest.warns(RuntimeWarning, match=f"structure of {n_big} atoms ran out of GPU memory"):
        got = engine.predict(structures, batch_size=3, pipeline=pipeline)
    assert pu._CONFIG["recompute_uv_min_atoms"] == n_big
    for a, b in zip(want, got, strict=True):
        assert a["energy"] == pytest.approx(b["energy"], abs=1e-10)
        np.testing.assert_allclose(a["forces"], b["forces"], atol=1e-10)

    def never_fits(self, batch, **kw):
        raise torch.OutOfMemoryError("CUDA out of memory (injected by the test)")

    monkeypatch.setattr(ForceEngine, "compute", never_fits)
    with pytest.raises(torch.OutOfMemoryError):  # already on from n_big atoms: no second retry, no new warning
        engine.predict([big], batch_size=1, pipeline=pipeline)


def _fits_with_recompute(monkeypatch, n_atoms):
    """ForceEngine.compute raising an out-of-memory error for batches of ``n_atoms`` atoms or more unless the
    update blocks' recompute applies to them (``recompute_uv_min_atoms`` at most their atom count); the fused update
    blocks, which the recompute is for, are this CPU's only under the Triton interpreter, so it is said to help."""
    pu = _update_module()
    monkeypatch.setitem(pu._CONFIG, "recompute_uv_min_atoms", None)
    monkeypatch.setattr(batching, "_recompute_helps", lambda engine: True)
    real, calls = ForceEngine.compute, []

    def compute(self, batch, **kw):
        calls.append(batch.num_atoms)
        limit = pu._CONFIG["recompute_uv_min_atoms"]
        if batch.num_atoms >= n_atoms and (limit is None or limit > batch.num_atoms):
            raise torch.OutOfMemoryError("CUDA out of memory (injected by the test)")
        return real(self, batch, **kw)

    monkeypatch.setattr(ForceEngine, "compute", compute)
    return calls


def _never_fits(monkeypatch):
    def compute(self, batch, **kw):
        raise torch.OutOfMemoryError("CUDA out of memory (injected by the test)")

    monkeypatch.setattr(ForceEngine, "compute", compute)


@pytest.mark.parametrize("backend_helps", [True, False])
def test_the_calculator_tries_a_structure_again_with_the_recompute(model, monkeypatch, backend_helps):
    """StudentCalculator: a structure out of memory is computed once more with the recompute on from its atom
    count (with a warning) and gives the result of a run that fits; where the recompute already applies, or on the
    torch backend (``backend_helps`` False: no retry, no warning), the error reaches the caller."""
    from ase.build import molecule

    from mlff_distiller import StudentCalculator

    atoms = molecule("CH3CH2OH")
    atoms.rattle(0.05, seed=1)
    atoms.calc = StudentCalculator(model, device="cpu", precision="fp64")
    want_e, want_f = atoms.get_potential_energy(), atoms.get_forces()
    atoms.calc = StudentCalculator(model, device="cpu", precision="fp64")
    calls = _fits_with_recompute(monkeypatch, len(atoms))
    if not backend_helps:
        monkeypatch.setattr(batching, "_recompute_helps", lambda engine: False)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            warnings.filterwarnings("ignore", category=DeprecationWarning)  # NumPy 2.5 in ASE 3.29's Atoms
            with pytest.raises(torch.OutOfMemoryError):
                atoms.get_forces()
        assert calls == [len(atoms)] and _update_module()._CONFIG["recompute_uv_min_atoms"] is None
        return
    with pytest.warns(RuntimeWarning, match=f"StudentCalculator: a structure of {len(atoms)} atoms ran out of GPU"):
        forces = atoms.get_forces()
    assert calls == [len(atoms), len(atoms)]
    assert atoms.get_potential_energy() == pytest.approx(want_e, abs=1e-10)
    np.testing.assert_allclose(forces, want_f, rtol=0, atol=1e-10)
    atoms.positions[0, 0] += 0.01
    _never_fits(monkeypatch)
    with pytest.raises(torch.OutOfMemoryError):  # already on from this atom count: no second retry
        atoms.get_forces()


def test_batched_md_tries_its_replicas_again_with_the_recompute(monkeypatch):
    """BatchedMD, whose replicas cannot be split: a step out of memory is computed once more with the recompute
    on from the batch's atom count (with a warning), and the trajectory is the one of a run that fits."""
    from ase.build import molecule
    from helpers import make_model

    from mlff_distiller.batched_md import BatchedMD

    model = make_model(seed=4)
    structures = [molecule("C6H6"), molecule("CH3CH2OH")]
    kw = dict(ensemble="nve", precision="fp64", temperature_K=600, seed=2, device="cpu")
    want = BatchedMD(model, structures, **kw)
    want.run(6)
    md = BatchedMD(model, structures, **kw)
    n = md.positions.shape[0]
    _fits_with_recompute(monkeypatch, n)
    with pytest.warns(RuntimeWarning, match=f"BatchedMD: the replicas of {n} atoms ran out of GPU memory"):
        md.run(6)
    assert _update_module()._CONFIG["recompute_uv_min_atoms"] == n
    np.testing.assert_allclose(md.positions.cpu().numpy(), want.positions.cpu().numpy(), rtol=0, atol=1e-10)
    _never_fits(monkeypatch)
    with pytest.raises(torch.OutOfMemoryError):
        md.run(1)


def test_pipelined_oom_keeps_the_batch_in_flight(model, monkeypatch):
    """An out-of-memory error while another batch is in flight: that batch's rows are kept, the failing one is
    split, nothing is lost or duplicated and the order is the input order."""
    mols = _mols(17, seed=7)
    engine = ForceEngine(model, device="cpu", precision="fp64")
    want = engine.predict(mols, batch_size=1, pipeline=False)
    real = ForceEngine.compute
    calls = []

    def flaky(self, batch, **kw):
        calls.append(batch.num_structures)
        if len(calls) == 2:  # the second batch, launched while the first is in flight
            raise torch.OutOfMemoryError("CUDA out of memory (injected by the test)")
        return real(self, batch, **kw)

    monkeypatch.setattr(ForceEngine, "compute", flaky)
    got = engine.predict(mols, batch_size=6, pipeline=True)
    assert engine.oom_splits == 1 and calls[:3] == [6, 6, 3]
    for a, b in zip(want, got, strict=True):
        assert a["energy"] == pytest.approx(b["energy"], abs=1e-10)
        np.testing.assert_allclose(a["forces"], b["forces"], atol=1e-10)
    assert len(got) == len(mols)


def test_memory_budget_batches_small(model):
    mols = _mols(8, seed=9)
    engine = ForceEngine(model, device="cpu", precision="fp64", memory_budget=1)
    assert engine.atom_budget() == 1
    seen = []
    real = engine.compute
    engine.compute = lambda batch, **kw: seen.append(batch.num_structures) or real(batch, **kw)
    out = engine.predict(mols)
    assert seen == [1] * 8
    ref = predict_forces(model, mols, precision="fp64")
    for a, b in zip(ref, out, strict=True):
        np.testing.assert_allclose(a["forces"], b["forces"], atol=1e-10)
    big = ForceEngine(model, device="cpu", memory_budget=10**12)
    assert big.atom_budget() > 10**5 and big.estimate_bytes(10, 100) > big.estimate_bytes(10, 10) > 0


@gpu
def test_oom_split_with_cuda_graphs(model, monkeypatch):
    mols = _mols(20, seed=3)
    ref = predict_forces(model, mols, device="cuda", batch_size=1)
    engine = ForceEngine(model, device="cuda", mode="cudagraph")
    real = ForceEngine._compute_padded

    def flaky(self, batch, to_host):
        if batch.num_atoms > 30:
            raise torch.OutOfMemoryError("CUDA out of memory (injected by the test)")
        return real(self, batch, to_host)

    monkeypatch.setattr(ForceEngine, "_compute_padded", flaky)
    out = engine.predict(mols)
    assert engine.oom_splits >= 1 and len(out) == len(mols)
    for a, b in zip(ref, out, strict=True):
        np.testing.assert_allclose(a["forces"], b["forces"], atol=1e-5)


@gpu
def test_probe_memory_gpu(model):
    engine = ForceEngine(model, device="cuda")
    ratio = engine.probe_memory(_mols(50, seed=1))
    assert 0.05 <= ratio < 50
    assert engine.atom_budget() >= 1


def test_oom_cap_lasts_until_memory_frees_up(model, monkeypatch):
    """After an OOM the batches stay small while the memory found is what it was at the error, and grow back
    when at least OOM_CAP_LIFT times as much is found later (a kept engine after a transient OOM)."""
    from mlff_distiller import engine as engine_module

    mols = _mols(12, seed=5)
    engine = ForceEngine(model, device="cpu", precision="fp64", memory_budget=10**9)
    uncapped = engine.atom_budget()
    real = ForceEngine.compute
    fail_above = [20]
    sizes = []

    def flaky(self, batch, **kw):
        sizes.append(batch.num_atoms)
        if batch.num_atoms > fail_above[0]:
            raise torch.OutOfMemoryError("CUDA out of memory (injected by the test)")
        return real(self, batch, **kw)

    monkeypatch.setattr(ForceEngine, "compute", flaky)
    engine.predict(mols)
    capped = engine.atom_budget()
    assert engine.oom_splits >= 1 and capped < uncapped and capped <= 20
    # The same memory found: the cap stays, and the next call starts small (no new OOM).
    fail_above[0] = 10**9
    sizes.clear()
    engine.predict(mols)
    largest = max(len(m) for m in mols)  # a structure above the budget is a batch of its own
    assert engine.atom_budget() == capped and max(sizes) <= max(capped, largest)
    # A little more memory is not enough to lift it ...
    engine.memory_budget = int(10**9 * (engine_module.OOM_CAP_LIFT - 0.5))
    assert engine.atom_budget() == capped
    # ... twice as much is: full-size batches again.
    engine.memory_budget = 10**9 * engine_module.OOM_CAP_LIFT
    assert engine.atom_budget() == engine._uncapped_atom_budget() > capped
    sizes.clear()
    engine.predict(mols)
    assert max(sizes) == sum(len(m) for m in mols)


def test_a_structure_out_of_memory_first_releases_the_captured_graphs(model, monkeypatch):
    """``recompute_before_retry`` (predict's, the calculator's, BatchedMD's and relax_batch's last retry of a batch
    that cannot be split) releases the engine's captured CUDA graphs, whose private pools an eager step or another
    capture may need, and asks for the retry even where the recompute cannot help (this CPU's torch backend); with
    nothing captured and no recompute, it does not (the caller raises)."""
    from mlff_distiller.engine_padded import _EagerRunner

    monkeypatch.setattr(batching, "_recompute_helps", lambda engine: False)
    engine = ForceEngine(model, device="cpu", precision="fp64", pad=True)
    engine.compute(AtomsBatch.from_atoms(_mols(2, seed=1)))
    bucket = engine.last_bucket
    engine._runners[bucket] = object()  # a stand-in captured graph (CUDA graphs need a GPU)
    other = engine.buckets.select(bucket.atoms + 1, bucket.edges + 1)
    engine._runners[other] = _EagerRunner(None, None)  # a bucket left eager: not a capture to release
    err = torch.OutOfMemoryError("CUDA out of memory (injected by the test)")
    with pytest.warns(RuntimeWarning, match=r"captured CUDA graphs of 1 bucket\(s\) released"):
        assert batching.recompute_before_retry(engine, 5000, err)
    assert list(engine._runners) == [other] and engine.captures_released == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", category=DeprecationWarning)  # NumPy 2.5 in ASE 3.29's Atoms
        assert not batching.recompute_before_retry(engine, 5000, err)


def test_a_small_call_on_cuda_makes_no_free_memory_query(model, monkeypatch):
    """A call of at most SMALL_CALL_ATOMS atoms on a CUDA engine sized by free memory is one batch without asking
    the device (``atom_budget_for``); larger calls, a cap from an out-of-memory error, or a memory budget the caller
    set take the budget as before. predict() asks it with the call's atoms in all."""
    from mlff_distiller import engine_budget

    queries = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: queries.append(1) or (8 * 10**9, 80 * 10**9))

    class Stand(engine_budget.BudgetMixin):  # the state BudgetMixin reads, on a "CUDA" device (no GPU needed)
        def __init__(self, memory_budget=None):
            self.model, self.dtype, self.device = model, torch.float32, torch.device("cuda")
            self.memory_budget, self._bytes_scale = memory_budget, 1.0
            self._atom_budget_cap = self._atom_budget_at_oom = None

    small = engine_budget.SMALL_CALL_ATOMS
    eng = Stand()
    assert eng.atom_budget_for(small) == small and eng.atom_budget_for(0) == 1 and not queries
    full = eng.atom_budget()
    assert len(queries) == 1 and full > small  # 4 GB of half the free memory: many more atoms
    assert eng.atom_budget_for(small + 1) == full and len(queries) == 2
    eng._atom_budget_cap, eng._atom_budget_at_oom = 40, full
    assert eng.atom_budget_for(10) == 40 and len(queries) == 3  # capped: asked, and the cap holds
    assert Stand(memory_budget=10**9).atom_budget_for(10) == Stand(memory_budget=10**9).atom_budget() > 10
    assert len(queries) == 3  # the caller's budget: no device query either way
    asked = []
    cpu = ForceEngine(model, device="cpu", precision="fp64")
    monkeypatch.setattr(cpu, "atom_budget_for", lambda n: asked.append(n) or 10**6)
    mols = _mols(3, seed=8)
    cpu.predict(mols)
    cpu.predict(mols, batch_size=2)  # sized by structures: no budget
    assert asked == [sum(len(m) for m in mols)]
    many = [mols[0]] * (engine_budget.SMALL_CALL_ATOMS + 1)  # more structures than a small call's atoms
    cpu.predict(many)
    assert asked[-1] == len(many)  # no small call: their count stands in for the atoms (not counted twice)
