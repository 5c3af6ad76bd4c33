"""relax_batch: many structures relaxed together, each on the path ASE's FIRE takes on it alone."""

import json

import numpy as np
import pytest
import torch
from ase.build import molecule
from ase.optimize import FIRE
from helpers import make_model, silicon_cell

from mlff_distiller import StudentCalculator, load_model
from mlff_distiller.batched_relax import relax_batch

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _rattled(names, amount=0.1):
    out = []
    for k, name in enumerate(names):
        a = molecule(name)
        a.rattle(amount, seed=k)
        out.append(a)
    return out


def _ase_fire(model, atoms, fmax, steps):
    a = atoms.copy()
    a.calc = StudentCalculator(model, precision="fp64", device="cpu")
    opt = FIRE(a, logfile=None)
    converged = opt.run(fmax=fmax, steps=steps)
    return a, opt.nsteps, converged


@pytest.mark.parametrize("device", DEVICES)
def test_each_structure_follows_ase_fire(device):
    """Four rattled molecules of different sizes in one batch (the shipped student, float64): each ends where ASE's
    FIRE with the calculator ends on it alone, after as many steps; the inputs are left as they were."""
    model = load_model("builtin:chno-gfn2")
    structures = _rattled(["C6H6", "CH3CH2OH", "H2O", "NH3"])
    before = [a.positions.copy() for a in structures]
    out = relax_batch(model, structures, fmax=0.01, steps=300, precision="fp64", device=device)
    for a, got, start in zip(structures, out, before, strict=True):
        np.testing.assert_array_equal(a.positions, start)
        ref, nsteps, converged = _ase_fire(model, a, 0.01, 300)
        assert got.info["relax_converged"] and converged
        assert got.info["relax_steps"] == nsteps
        np.testing.assert_allclose(got.positions, ref.positions, rtol=0, atol=1e-9)
        assert got.get_potential_energy() == pytest.approx(ref.get_potential_energy(), abs=1e-9)
        assert np.abs(got.get_forces()).max() < 0.01 * 1.0001
        assert len(got.calc.results["energies"]) == len(a)


def test_a_step_limit_stops_each_structure_where_ase_would():
    """``steps=7``: nothing converges; every structure is where ASE's FIRE is after 7 steps. A crystal (fixed cell,
    a random student) relaxes beside the molecules."""
    model = make_model(seed=2)
    structures = [*_rattled(["CH4", "C6H6"], 0.2), silicon_cell(rattle=0.15)]
    out = relax_batch(model, structures, fmax=1e-4, steps=7, precision="fp64")
    for a, got in zip(structures, out, strict=True):
        ref, nsteps, converged = _ase_fire(model, a, 1e-4, 7)
        assert not converged and not got.info["relax_converged"] and got.info["relax_steps"] == nsteps == 7
        np.testing.assert_allclose(got.positions, ref.positions, rtol=0, atol=1e-9)
        np.testing.assert_array_equal(got.cell, a.cell)


def test_converged_structures_stay_put_while_others_go_on():
    """A structure already relaxed takes no step, however long the others need."""
    model = load_model("builtin:chno-gfn2")
    done = relax_batch(model, [molecule("H2O")], fmax=0.005, steps=500, precision="fp64")[0]
    done.calc = None
    out = relax_batch(model, [done, *_rattled(["CH3CH2OH"], 0.15)], fmax=0.005, steps=500, precision="fp64")
    assert out[0].info["relax_steps"] == 0 and out[0].info["relax_converged"]
    np.testing.assert_array_equal(out[0].positions, done.positions)
    assert out[1].info["relax_steps"] > 20 and out[1].info["relax_converged"]


def test_bad_input_is_named():
    from ase.constraints import FixAtoms

    model = make_model()
    fixed = molecule("H2O")
    fixed.set_constraint(FixAtoms(indices=[0]))
    with pytest.raises(ValueError, match=r"structure 1 carries ASE constraints \(FixAtoms\)"):
        relax_batch(model, [molecule("CH4"), fixed])
    for kwargs, match in (
        ({"fmax": 0.0}, "fmax must be"),
        ({"steps": -1}, "steps must be"),
        ({"maxstep": float("nan")}, "maxstep must be"),
        ({"compact": 1.0}, "compact must be"),
        ({"max_atoms": 0}, "max_atoms must be"),
        ({"max_atoms": "all"}, "max_atoms must be"),
    ):
        with pytest.raises(ValueError, match=match):
            relax_batch(model, [molecule("CH4")], **kwargs)
    with pytest.raises(ValueError, match="at least one structure"):
        relax_batch(model, [])
    with pytest.raises(ValueError, match="element"):
        relax_batch(model, [molecule("NaCl")])


def test_relax_command(tmp_path, capsys, monkeypatch):
    """``mlff-distill relax``: every frame of the input relaxed, written with its convergence and step count, the
    same positions as relax_batch gives."""
    import ase.io

    from mlff_distiller import StudentModel
    from mlff_distiller.cli import main

    torch.manual_seed(0)
    model = tmp_path / "m.pt"
    StudentModel(species=[1, 6, 7, 8], hidden=16, layers=1).save(model)
    src = tmp_path / "in.xyz"
    structures = _rattled(["CH4", "NH3", "CH3CH2OH"], 0.1)
    ase.io.write(src, structures)
    out = tmp_path / "relaxed.extxyz"
    base = ["relax", "--model", str(model), "--device", "cpu", "--precision", "fp64", "--input", str(src)]
    assert main([*base, "--output", str(out), "--fmax", "0.02", "--steps", "200"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["structures"] == 3 and report["converged"] == 3 and report["output"] == str(out)
    frames = ase.io.read(out, index=":")
    want = relax_batch(str(model), ase.io.read(src, index=":"), fmax=0.02, steps=200, precision="fp64")
    for got, ref in zip(frames, want, strict=True):
        assert got.info["relax_converged"] and got.info["relax_steps"] == ref.info["relax_steps"]
        np.testing.assert_allclose(got.positions, ref.positions, atol=5e-9)
        np.testing.assert_allclose(got.get_forces(), ref.get_forces(), atol=5e-9)
    import mlff_distiller.batched_relax as br

    budgets = []
    real = br.relax_arrays  # (under relax_batch, and called alone for the plain extxyz the command reads here)
    monkeypatch.setattr(br, "relax_arrays", lambda *a, **kw: budgets.append(kw["max_atoms"]) or real(*a, **kw))
    streamed = tmp_path / "streamed.extxyz"  # --max-atoms: a few at a time, the same results
    assert main([*base, "--output", str(streamed), "--fmax", "0.02", "--steps", "200", "--max-atoms", "6"]) == 0
    capsys.readouterr()
    for got, ref in zip(ase.io.read(streamed, index=":"), frames, strict=True):
        assert got.info["relax_steps"] == ref.info["relax_steps"]
        np.testing.assert_allclose(got.positions, ref.positions, atol=1e-10)
    assert budgets == [6]
    assert main([*base, "--output", str(src)]) == 2
    assert "is the input file" in capsys.readouterr().err


def test_relax_command_writes_the_others_when_one_fails(tmp_path, capsys, monkeypatch):
    """A structure whose forces stop being finite is left out and named (exit 2); the others are written."""
    import ase.io

    import mlff_distiller.batched_relax as br
    from mlff_distiller.batching import NonFiniteOutputError
    from mlff_distiller.cli import main

    real_batch, real_arrays = br.relax_batch, br.relax_arrays

    def one_fails(model, structures, **kw):  # relax_batch's error (other formats than plain extxyz)
        out = real_batch(model, structures, **kw)
        raise NonFiniteOutputError("relax_batch: structure(s) [1]", [1], [out[0], None, out[2]])

    def one_fails_arrays(model, structures, **kw):  # relax_arrays' record of it (plain extxyz)
        run = real_arrays(model, structures, **kw)
        run.failed = [1]
        return run

    frames_in = _rattled(["CH4", "NH3", "H2O"], 0.05)
    for name, why in (("in.xyz", "reached non-finite forces or energy"), ("in.traj", "non-finite forces or energy")):
        if name == "in.xyz":
            monkeypatch.setattr(br, "relax_arrays", one_fails_arrays)
        else:
            monkeypatch.setattr(br, "relax_arrays", real_arrays)
            monkeypatch.setattr(br, "relax_batch", one_fails)
        src = tmp_path / name
        ase.io.write(src, frames_in)
        out = tmp_path / f"relaxed_{name}.extxyz"
        args = ["relax", "--model", "builtin:chno-gfn2", "--device", "cpu", "--input", str(src), "--output", str(out)]
        assert main(args) == 2
        err = capsys.readouterr().err
        assert "1 of 3 input structures were left out" in err and f"structure 1: {why}" in err
        frames = ase.io.read(out, index=":")
        assert [f.get_chemical_formula() for f in frames] == ["CH4", "H2O"]


@pytest.mark.parametrize("device", DEVICES)
def test_finished_structures_leave_the_batch(device, monkeypatch):
    """With ``compact`` the structures that are done leave the batch (here from any size on): every structure
    ends exactly where it ends when all stay to the end (positions, energies, forces, steps), in input order."""
    import mlff_distiller.batched_relax as br

    model = load_model("builtin:chno-gfn2")
    names = ["CH4", "C6H6", "H2O", "CH3CH2OH", "NH3", "HCN", "CH3OH", "C2H2", "H2CO", "CH3NO2"]
    structures = _rattled(names)
    for k, a in enumerate(structures):  # some further from their minimum than others
        a.rattle(0.05 * (k % 3), seed=100 + k)
    kw = dict(fmax=0.02, steps=300, precision="fp64", device=device)
    whole = relax_batch(model, structures, compact=0.0, **kw)
    made = []
    real = br._subset

    def counted(batch, keep):
        made.append(int(keep.sum()))
        return real(batch, keep)

    monkeypatch.setattr(br, "_subset", counted)
    assert relax_batch(model, structures, **kw) and made == []  # 10 molecules: below COMPACT_MIN_ATOMS
    monkeypatch.setattr(br, "COMPACT_MIN_ATOMS", 0)
    compacted = relax_batch(model, structures, compact=0.75, **kw)
    assert len(made) >= 2 and made == sorted(made, reverse=True)  # the batch shrank more than once
    steps = [a.info["relax_steps"] for a in whole]
    assert len(set(steps)) > 5  # the structures finish at many different steps
    for got, want, start in zip(compacted, whole, structures, strict=True):
        assert got.get_chemical_formula() == start.get_chemical_formula()
        assert got.info["relax_steps"] == want.info["relax_steps"] and got.info["relax_converged"]
        np.testing.assert_allclose(got.positions, want.positions, rtol=0, atol=1e-10)
        assert got.get_potential_energy() == pytest.approx(want.get_potential_energy(), abs=1e-10)
        np.testing.assert_allclose(got.get_forces(), want.get_forces(), rtol=0, atol=1e-10)
        np.testing.assert_allclose(got.calc.results["energies"], want.calc.results["energies"], rtol=0, atol=1e-10)


@pytest.mark.parametrize("device", DEVICES)
def test_max_atoms_streams_the_structures_through_the_batch(device, monkeypatch):
    """``max_atoms``: at most that many atoms in the batch; structures start in input order as finished ones make
    room (one alone if it is larger than the budget) and each ends exactly where it ends with all in one batch
    (positions, energies, forces, steps), with a step limit that stops some of them and a structure that is
    already relaxed; a structure of an unknown element anywhere is refused before any step."""
    import mlff_distiller.batched_relax as br

    model = load_model("builtin:chno-gfn2")
    names = ["CH4", "C6H6", "H2O", "CH3CH2OH", "NH3", "HCN", "CH3OH", "C2H2", "H2CO", "CH3NO2", "CH3CH2OH", "H2O"]
    structures = _rattled(names)
    for k, a in enumerate(structures):
        a.rattle(0.05 * (k % 3), seed=200 + k)
    structures[4] = relax_batch(model, [structures[4]], fmax=0.005, steps=300, precision="fp64")[0]
    structures[4].calc = None  # relaxed already: it finishes at its first look
    kw = dict(fmax=0.01, steps=40, precision="fp64", device=device)
    whole = relax_batch(model, structures, **kw)
    sizes = []
    real_compute = br.batch_engine

    def watching(*args, **kwargs):
        engine = real_compute(*args, **kwargs)
        compute = engine.compute

        def watched(batch, **kw2):
            sizes.append(batch.num_atoms)
            return compute(batch, **kw2)

        engine.compute = watched
        return engine

    from mlff_distiller.predict import clear_engine_cache

    clear_engine_cache()
    monkeypatch.setattr(br, "batch_engine", watching)
    streamed = relax_batch(model, structures, max_atoms=16, **kw)
    assert max(sizes) <= 16 and len(set(sizes)) > 3  # the batch regrouped many times, never above the budget
    steps = [a.info["relax_steps"] for a in whole]
    assert steps[4] == 0 and 40 in steps and not all(a.info["relax_converged"] for a in whole)
    for got, want in zip(streamed, whole, strict=True):
        assert got.info["relax_steps"] == want.info["relax_steps"]
        assert got.info["relax_converged"] == want.info["relax_converged"]
        np.testing.assert_allclose(got.positions, want.positions, rtol=0, atol=1e-10)
        assert got.get_potential_energy() == pytest.approx(want.get_potential_energy(), abs=1e-10)
        np.testing.assert_allclose(got.get_forces(), want.get_forces(), rtol=0, atol=1e-10)
    one = relax_batch(model, structures[:3], max_atoms=1, **kw)  # each structure alone, larger than the budget
    for got, want in zip(one, whole[:3], strict=True):
        np.testing.assert_allclose(got.positions, want.positions, rtol=0, atol=1e-10)
    sizes.clear()
    with pytest.raises(ValueError, match="unknown element"):
        relax_batch(model, [*structures, molecule("NaCl")], max_atoms=16, **kw)
    assert sizes == []  # refused before the first step


def _engines_out_of_memory(monkeypatch, fails) -> list[int]:
    """relax_batch's engines raise a (simulated) CUDA out-of-memory error for a batch where
    ``fails(n_atoms, calls so far)``; returns the list of every call's atom count."""
    import mlff_distiller.batched_relax as br

    real, sizes = br.batch_engine, []

    def small_memory(*args, **kwargs):
        engine = real(*args, **kwargs)
        compute = engine.compute

        def limited(batch, **kw):
            sizes.append(batch.num_atoms)
            if fails(batch.num_atoms, len(sizes)):
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
            return compute(batch, **kw)

        engine.compute = limited
        return engine

    monkeypatch.setattr(br, "batch_engine", small_memory)
    return sizes


def test_out_of_memory_sets_structures_aside_and_loses_nothing(monkeypatch):
    """A device out-of-memory error (here: any batch above 11 atoms from the 5th step on) halves the batch: the
    structures beyond it wait with their state and come back; every structure ends exactly where it ends without
    the error, except one that does not fit alone (benzene, 12 atoms), which is named with the others' results."""
    from mlff_distiller.batching import NonFiniteOutputError
    from mlff_distiller.predict import clear_engine_cache

    model = load_model("builtin:chno-gfn2")
    names = ["CH4", "H2O", "CH3CH2OH", "NH3", "C6H6", "HCN", "CH3OH", "C2H2", "H2CO", "CH3NO2"]
    structures = _rattled(names)
    kw = dict(fmax=0.01, steps=60, precision="fp64")
    whole = relax_batch(model, structures, **kw)
    clear_engine_cache()
    # from the 5th step on (mid-relaxation), any batch above 11 atoms
    sizes = _engines_out_of_memory(monkeypatch, lambda n_atoms, calls: calls > 5 and n_atoms > 11)
    with pytest.raises(NonFiniteOutputError, match=r"structure\(s\) \[4\] do not fit in the device's memory") as err:
        relax_batch(model, structures, max_atoms=None, **kw)
    assert err.value.indices == [4] and err.value.results[4] is None
    assert sum(s > 11 for s in sizes) >= 3  # several errors, each halving the batch
    for k, (got, want) in enumerate(zip(err.value.results, whole, strict=True)):
        if k == 4:
            continue
        assert got.info["relax_steps"] == want.info["relax_steps"]
        assert got.info["relax_converged"] == want.info["relax_converged"]
        np.testing.assert_allclose(got.positions, want.positions, rtol=0, atol=1e-10)
        np.testing.assert_allclose(got.get_forces(), want.get_forces(), rtol=0, atol=1e-10)


def test_a_structure_out_of_memory_alone_is_tried_again_with_the_recompute(monkeypatch):
    """A structure that does not fit alone (benzene, 12 atoms, past the 5th step) gets one more try with the update
    blocks' recompute on from its atom count (with a warning; the fused update blocks it is for are this CPU's only
    under the Triton interpreter, so it is said to help); with it the batches fit, and every structure ends where
    it ends without the error."""
    import importlib

    from mlff_distiller import batching
    from mlff_distiller.predict import clear_engine_cache

    pu = importlib.import_module("mlff_distiller.kernels.painn_update")
    monkeypatch.setitem(pu._CONFIG, "recompute_uv_min_atoms", None)
    monkeypatch.setattr(batching, "_recompute_helps", lambda engine: True)
    model = load_model("builtin:chno-gfn2")
    structures = _rattled(["CH4", "H2O", "C6H6", "HCN", "CH3OH"])
    kw = dict(fmax=0.01, steps=40, precision="fp64")
    whole = relax_batch(model, structures, **kw)
    clear_engine_cache()

    def fails(n_atoms, calls):  # as above, unless the recompute applies to the batch
        limit = pu._CONFIG["recompute_uv_min_atoms"]
        return calls > 5 and n_atoms > 11 and (limit is None or limit > n_atoms)

    _engines_out_of_memory(monkeypatch, fails)
    with pytest.warns(RuntimeWarning, match="relax: a structure of 12 atoms ran out of GPU memory"):
        got = relax_batch(model, structures, max_atoms=None, **kw)
    assert pu._CONFIG["recompute_uv_min_atoms"] == 12
    for a, b in zip(got, whole, strict=True):
        assert a.info["relax_steps"] == b.info["relax_steps"]
        np.testing.assert_allclose(a.positions, b.positions, rtol=0, atol=1e-10)
        np.testing.assert_allclose(a.get_forces(), b.get_forces(), rtol=0, atol=1e-10)


@pytest.mark.parametrize("compacting", [False, True])
def test_a_structure_with_non_finite_forces_stops_and_is_named(monkeypatch, compacting):
    """NaN forces for one structure (injected from the third call on) stop that structure only; the others relax
    as they would alone, and the error names the bad one with the others' results; also when the failed structure
    leaves the batch (``compacting``)."""
    import mlff_distiller.batched_relax as br
    from mlff_distiller.batching import NonFiniteOutputError
    from mlff_distiller.predict import clear_engine_cache

    real, real_subset = br.batch_engine, br._subset

    def engine_with_a_nan(*args, **kwargs):
        engine = real(*args, **kwargs)
        compute, calls = engine.compute, []

        def poisoned(batch, **kw):
            out = dict(compute(batch, **kw))
            calls.append(1)
            counts = batch.counts.tolist()
            if len(calls) >= 3 and 3 in counts:  # the water, wherever it sits in the batch
                lo = batch.ptr[counts.index(3)].item()
                hi = lo + 3
                forces = out["forces"].clone()
                forces[lo:hi] = float("nan")
                out["forces"] = forces
            return out

        engine.compute = poisoned
        return engine

    model = load_model("builtin:chno-gfn2")
    structures = _rattled(["CH4", "H2O", "NH3"])
    alone = relax_batch(model, [structures[0], structures[2]], fmax=0.02, steps=300, precision="fp64")
    clear_engine_cache()  # the poisoned engine below, not the kept one
    monkeypatch.setattr(br, "batch_engine", engine_with_a_nan)
    monkeypatch.setattr(br, "COMPACT_MIN_ATOMS", 0 if compacting else br.COMPACT_MIN_ATOMS)
    left = []
    monkeypatch.setattr(br, "_subset", lambda batch, keep: left.append(keep.tolist()) or real_subset(batch, keep))
    with pytest.raises(NonFiniteOutputError, match=r"structure\(s\) \[1\]") as err:
        relax_batch(model, structures, fmax=0.02, steps=300, precision="fp64", compact=0.9)
    assert left[:1] == ([[True, False, True]] if compacting else [])  # the failed water left first
    assert err.value.indices == [1] and err.value.results[1] is None
    for got, ref in zip([err.value.results[0], err.value.results[2]], alone, strict=True):
        assert got.info["relax_converged"]
        np.testing.assert_allclose(got.positions, ref.positions, rtol=0, atol=1e-9)


def test_structures_that_end_outside_the_training_data_are_named():
    """The shipped student's envelope: a squeezed water left as it is (``steps=0``) ends outside and is named, in
    a warning and in its info; a relaxed ethanol beside it is not; ``check_domain=False`` checks nothing."""
    import warnings

    from mlff_distiller.domain import OutOfDomainWarning

    squeezed = molecule("H2O")
    squeezed.positions[1] = squeezed.positions[0] + 0.45 * (squeezed.positions[1] - squeezed.positions[0])
    structures = [molecule("CH3CH2OH"), squeezed]
    with pytest.warns(OutOfDomainWarning, match=r"structure\(s\) \[1\] ended outside .*H-O pair at 0.44") as seen:
        out = relax_batch("builtin:chno-gfn2", structures, steps=0)
    (ours,) = [w for w in seen if issubclass(w.category, OutOfDomainWarning)]  # (NumPy 2.5 adds ASE's deprecations)
    assert ours.filename == __file__  # the warning names the caller's line
    assert "domain" not in out[0].info and "H-O pair at 0.44" in out[1].info["domain"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", OutOfDomainWarning)
        quiet = relax_batch("builtin:chno-gfn2", structures, steps=0, check_domain=False)
    assert all("domain" not in a.info for a in quiet)


def test_the_engine_is_kept_for_the_next_call(monkeypatch):
    """A second call with the same student and settings reuses the first call's engine (its list, its buckets)
    and relaxes exactly as a fresh engine would; a changed student or other settings get a new one."""
    import mlff_distiller.batched_relax as br
    from mlff_distiller.predict import clear_engine_cache

    made = []
    real = br.batch_engine

    def counting(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(br, "batch_engine", counting)
    model = load_model("builtin:chno-gfn2")
    first = _rattled(["CH4", "H2O", "NH3"])
    second = _rattled(["CH3OH", "HCN"], amount=0.12)
    kw = dict(fmax=0.02, steps=300, precision="fp64")
    a = relax_batch(model, first, **kw)
    b = relax_batch(model, second, **kw)
    again = relax_batch(model, first, **kw)
    assert len(made) == 1  # one engine for the three calls
    clear_engine_cache()
    fresh = relax_batch(model, second, **kw)
    assert len(made) == 2
    for got, want in zip(b, fresh, strict=True):
        assert got.info["relax_steps"] == want.info["relax_steps"]
        np.testing.assert_allclose(got.positions, want.positions, rtol=0, atol=1e-12)
    for got, want in zip(again, a, strict=True):
        np.testing.assert_allclose(got.positions, want.positions, rtol=0, atol=1e-12)
    relax_batch(model, first, **{**kw, "skin": 0.5})  # other settings: another engine
    with torch.no_grad():
        model.readout[2].bias.add_(0.1)  # a changed student: another engine
    relax_batch(model, first, **kw)
    assert len(made) == 4


@pytest.mark.gpu
def test_the_captured_fire_step_equals_the_eager_one(monkeypatch):
    """On CUDA every FIRE step after the first replays one captured graph: the same paths as the eager update, to
    float64 rounding, and the same step counts."""
    import mlff_distiller.batched_relax as br

    model = load_model("builtin:chno-gfn2")
    structures = _rattled(["CH4", "H2O", "NH3", "CH3OH", "HCN", "C2H2"])
    kw = dict(fmax=0.02, steps=300, precision="fp64", device="cuda")
    captures = []
    real_captured = br._Fire._captured

    def counted(self):
        captures.append(1)
        return real_captured(self)

    monkeypatch.setattr(br._Fire, "_captured", counted)
    graphed = relax_batch(model, structures, **kw)
    assert captures == [1]
    real_init = br._Fire.__init__

    def eager(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        self._capture = False

    monkeypatch.setattr(br._Fire, "__init__", eager)
    plain = relax_batch(model, structures, **kw)
    assert captures == [1]
    for got, want in zip(graphed, plain, strict=True):
        assert got.info["relax_steps"] == want.info["relax_steps"] and got.info["relax_converged"]
        np.testing.assert_allclose(got.positions, want.positions, rtol=0, atol=1e-12)


def test_a_frame_table_relaxes_as_its_atoms():
    """relax_batch on a FrameTable (no Atoms in) returns what it returns for the same structures as Atoms, and
    relax_arrays gives the same as arrays, with the structures that fail named rather than raised."""
    import mlff_distiller.batched_relax as br
    from mlff_distiller.frames import FrameTable

    model = load_model("builtin:chno-gfn2")
    structures = _rattled(["CH4", "NH3", "CH3CH2OH", "H2O"], 0.08)
    structures[3].set_cell([6.0, 6.5, 7.0])
    structures[3].pbc = [True, False, True]
    table = FrameTable(
        np.concatenate([a.numbers for a in structures]),
        np.concatenate([a.positions for a in structures]),
        np.stack([a.cell.array for a in structures]),
        np.stack([a.pbc for a in structures]),
        [len(a) for a in structures],
    )
    kw = dict(fmax=0.02, steps=200, precision="fp64", device="cpu")
    want = relax_batch(model, structures, **kw)
    got = relax_batch(model, table, **kw)
    run = br.relax_arrays(model, table, **kw)
    assert not run.failed and not run.too_large and not run.reasons()
    for k, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.info == w.info and g.pbc.tolist() == w.pbc.tolist()
        np.testing.assert_array_equal(g.cell.array, w.cell.array)
        np.testing.assert_array_equal(g.positions, w.positions)
        np.testing.assert_array_equal(g.get_forces(), w.get_forces())
        lo, hi = run.ptr[k], run.ptr[k + 1]
        np.testing.assert_array_equal(run.positions[lo:hi], w.positions)
        assert run.energy[k] == w.get_potential_energy() and run.steps[k] == w.info["relax_steps"]
    with pytest.raises(ValueError, match="unknown element"):
        relax_batch(model, FrameTable([14], [[0.0, 0.0, 0.0]], np.zeros((1, 3, 3)), [[False] * 3], [1]), **kw)
    np.testing.assert_array_equal(table.positions, np.concatenate([a.positions for a in structures]))  # unmoved
