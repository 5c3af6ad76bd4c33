"""The next velocity-Verlet step launched ahead (``StudentCalculator._launch_ahead``, ``ForceEngine.launch_ahead``):
the calculator predicts ASE's next positions and launches their step before ASE asks; the next calculation takes it
only where its positions are the ones launched, byte for byte.

On the CPU the engine is put on the padded Verlet path's zero-copy step with a stand-in capture (``FakeRunner``: the
step runs at each "replay"), so that every decision is tested here: a trajectory with launches ahead is the very
trajectory without them (bit for bit), velocity Verlet takes nearly every launch, and Langevin (friction and noise)
takes none and stops the predictions after ``AHEAD_MISSES``. ``test_*_on_cuda`` runs the real thing.
"""

import numpy as np
import pytest
import torch
from ase import units
from ase.build import molecule
from ase.constraints import FixCom
from ase.md.langevin import Langevin
from ase.md.verlet import VelocityVerlet
from helpers import make_model

from mlff_distiller import ForceEngine, StudentCalculator
from mlff_distiller import calculator as calculator_module
from mlff_distiller.ase_compat import maxwell_boltzmann


def _calc(model, ahead: bool) -> StudentCalculator:
    """A CPU calculator on the padded Verlet path's zero-copy step (what a CUDA calculator runs), float32."""
    calc = StudentCalculator(model, device="cpu", precision="fp32", skin=0.3, check_domain=None)
    calc.engine = ForceEngine(model, device="cpu", precision="fp32", pad=True, neighbor_skin=0.3)
    calc.engine.mode = "cudagraph"
    calc.engine.zero_copy = True
    calc.engine.speculative_verlet = True
    calc.launch_ahead = ahead  # (an instance attribute over the class default)
    return calc


def _run(model, ahead: bool, dyn_kind: str, steps: int, name="C6H6"):
    atoms = molecule(name)
    maxwell_boltzmann(atoms, 1500, rng=np.random.default_rng(2))
    calc = _calc(model, ahead)
    atoms.calc = calc
    if dyn_kind == "verlet":
        dyn = VelocityVerlet(atoms, timestep=1.0 * units.fs)
    else:
        if dyn_kind == "langevin-followed":  # as `mlff-distill md` runs a molecule: FixCom, and followed
            atoms.set_constraint(FixCom())
        dyn = Langevin(
            atoms, timestep=1.0 * units.fs, temperature_K=1500, friction=0.05, rng=np.random.default_rng(7), fixcm=False
        )
        if dyn_kind == "langevin-followed":
            calc.follow(dyn)
    energies = []
    dyn.attach(lambda: energies.append(atoms.get_potential_energy()), interval=1)
    dyn.run(steps)
    return atoms, calc, np.array(energies)


@pytest.mark.parametrize("dyn_kind", ["verlet", "langevin", "langevin-followed"])
def test_a_trajectory_with_launches_ahead_is_the_trajectory_without(fake_graphs, dyn_kind):
    """Bit for bit the same positions, momenta, energies and forces after 60 steps, launches ahead or not: a taken
    launch computed exactly the step the calculation would have launched."""
    model = make_model()
    a_on, calc_on, e_on = _run(model, True, dyn_kind, 60)
    a_off, calc_off, e_off = _run(model, False, dyn_kind, 60)
    np.testing.assert_array_equal(a_on.positions, a_off.positions)
    np.testing.assert_array_equal(a_on.get_momenta(), a_off.get_momenta())
    np.testing.assert_array_equal(e_on, e_off)
    np.testing.assert_array_equal(a_on.get_forces(), a_off.get_forces())
    eng = calc_on.engine
    assert calc_off.engine.n_ahead_taken == calc_off.engine.n_ahead_missed == 0
    if dyn_kind == "langevin-followed":
        # the noise predicted from a copy of the integrator's generator: from the second calculation on (the first
        # comes before any step), every launch is taken; the last one, after the run, is never asked for
        assert eng.n_ahead_taken == 59 and eng.n_ahead_missed == 0, (eng.n_ahead_taken, eng.n_ahead_missed)
        assert eng.n_discarded == 0 and eng.n_rebuilt_ahead == eng.verlet.n_builds - 1
    elif dyn_kind == "verlet":
        # from the third calculation on (dt needs two positions), every launch is taken
        assert eng.n_ahead_taken >= 57 and eng.n_ahead_missed == 0, (eng.n_ahead_taken, eng.n_ahead_missed)
        # across rebuilds: each made ahead, at the predicted positions, so that no launched step was thrown away;
        # without the launches ahead each rebuild threw a speculative step away
        builds = eng.verlet.n_builds
        assert builds >= 3 and eng.n_rebuilt_ahead == builds - 1 and eng.n_discarded == 0, (builds, eng.n_discarded)
        assert calc_off.engine.verlet.n_builds == builds and calc_off.engine.n_discarded == builds - 1
    else:
        # friction and noise: never the predicted positions; the calculator stops after AHEAD_MISSES in a row
        assert eng.n_ahead_taken == 0 and eng.n_ahead_missed == calculator_module.AHEAD_MISSES


def test_rebuild_ahead_off_launches_on_the_old_list(fake_graphs):
    """``rebuild_ahead = False``: a launch ahead whose positions cross the half skin runs on the old list, which the
    next call throws away to rebuild (stop 66's behaviour); the trajectory is the same either way."""
    model = make_model()
    a_on, calc_on, e_on = _run(model, True, "verlet", 40)
    atoms = molecule("C6H6")
    maxwell_boltzmann(atoms, 1500, rng=np.random.default_rng(2))
    calc = _calc(model, True)
    calc.engine.rebuild_ahead = False
    atoms.calc = calc
    energies = []
    dyn = VelocityVerlet(atoms, timestep=1.0 * units.fs)
    dyn.attach(lambda: energies.append(atoms.get_potential_energy()), interval=1)
    dyn.run(40)
    eng = calc.engine
    np.testing.assert_array_equal(atoms.positions, a_on.positions)
    np.testing.assert_array_equal(np.array(energies), e_on)
    builds = eng.verlet.n_builds
    assert builds >= 2 and eng.n_rebuilt_ahead == 0 and eng.n_discarded == builds - 1
    assert calc_on.engine.n_rebuilt_ahead == builds - 1 and calc_on.engine.n_discarded == 0
    # the launches on the old list were taken (the same positions), then thrown away by the rebuild
    assert eng.n_ahead_missed == 0 and eng.n_ahead_taken == calc_on.engine.n_ahead_taken


def test_predictions_resume_after_the_pause(fake_graphs, monkeypatch):
    """After AHEAD_PAUSE calculations the calculator predicts again (one try; another miss pauses it again): a
    Langevin run followed by velocity Verlet with the same calculator gets its launches taken again."""
    monkeypatch.setattr(calculator_module, "AHEAD_PAUSE", 10)
    model = make_model()
    atoms = molecule("CH4")
    maxwell_boltzmann(atoms, 1000, rng=np.random.default_rng(2))
    calc = _calc(model, True)
    atoms.calc = calc
    Langevin(atoms, timestep=1.0 * units.fs, temperature_K=1000, friction=0.05, rng=np.random.default_rng(1)).run(30)
    eng = calc.engine
    missed = eng.n_ahead_missed
    assert eng.n_ahead_taken == 0 and missed >= calculator_module.AHEAD_MISSES
    VelocityVerlet(atoms, timestep=1.0 * units.fs).run(40)
    assert eng.n_ahead_taken >= 25 and eng.n_ahead_missed <= missed + 1


def test_no_launch_ahead_where_nothing_predicts(fake_graphs):
    """Constraints, a float64 engine, positions set by hand (a random walk) and stress calls launch nothing ahead
    that stays taken: constraints and float64 launch nothing, a random walk's launches are all missed."""
    from ase.constraints import FixAtoms

    model = make_model()
    atoms = molecule("C6H6")
    maxwell_boltzmann(atoms, 1000, rng=np.random.default_rng(3))
    atoms.set_constraint(FixAtoms(indices=[0]))
    calc = _calc(model, True)
    atoms.calc = calc
    VelocityVerlet(atoms, timestep=1.0 * units.fs).run(10)
    assert calc.engine.n_ahead_taken == calc.engine.n_ahead_missed == 0
    atoms.set_constraint()
    calc64 = StudentCalculator(model, device="cpu", precision="fp64", skin=0.3, check_domain=None)
    calc64.engine = ForceEngine(model, device="cpu", precision="fp64", pad=True, neighbor_skin=0.3)
    calc64.engine.mode, calc64.engine.zero_copy, calc64.engine.speculative_verlet = "cudagraph", True, True
    atoms.calc = calc64
    VelocityVerlet(atoms, timestep=1.0 * units.fs).run(10)
    assert calc64.engine.n_ahead_taken == calc64.engine.n_ahead_missed == 0
    calc = _calc(model, True)
    atoms.calc = calc
    rng = np.random.default_rng(0)
    for _ in range(8):
        atoms.positions = atoms.positions + rng.normal(0, 0.01, atoms.positions.shape)
        atoms.get_forces()
    assert calc.engine.n_ahead_taken == 0 and calc.engine.n_ahead_missed <= calculator_module.AHEAD_MISSES


def test_the_engine_takes_a_launch_only_on_the_same_bytes(fake_graphs):
    """``launch_ahead`` then ``compute``: the same positions take the launched step (its result, the one the call
    would compute); positions one float32 ulp away throw it away and compute their own; a call on another path
    (the stress step) throws it away too."""
    import dataclasses

    from mlff_distiller import AtomsBatch

    model = make_model()
    atoms = molecule("CH4")
    eng = _calc(model, True).engine
    ref = ForceEngine(model, device="cpu", precision="fp32", mode="eager")
    first = AtomsBatch.from_atoms(atoms, dtype=torch.float32)

    def batch_of(pos):  # as the calculator makes an MD step's batch: the same tensors but the positions
        shifted = (pos - first.origin.numpy()).astype(np.float32)
        return dataclasses.replace(first, positions=torch.from_numpy(shifted))

    eng.compute(first, as_numpy=True)
    eng.compute(first, as_numpy=True)  # the zero-copy step captured
    moved = atoms.positions + 0.01
    assert eng.launch_ahead(batch_of(moved))
    got = eng.compute(batch_of(moved), as_numpy=True)
    assert eng.last_ahead is True and eng.n_ahead_taken == 1
    np.testing.assert_allclose(got["forces"], ref.compute(batch_of(moved), to_host=True)["forces"].numpy(), atol=1e-5)
    assert eng.launch_ahead(batch_of(moved))
    off = batch_of(moved)
    off.positions[0, 0] = torch.nextafter(off.positions[0, 0], torch.tensor(10.0))
    got = eng.compute(off, as_numpy=True)
    assert eng.last_ahead is False and eng.n_ahead_missed == 1
    want = ref.compute(off, to_host=True)["forces"].numpy()
    np.testing.assert_allclose(got["forces"], want, atol=1e-5)
    assert eng.launch_ahead(batch_of(moved))
    eng.compute(batch_of(moved), stress=False, to_host=False)  # device results: not the zero-copy step
    assert eng.last_ahead is False and eng.n_ahead_missed == 2 and eng._ahead is None
    other = AtomsBatch.from_atoms(atoms, dtype=torch.float32)  # another cell tensor (not an MD step's batch)
    assert not eng.launch_ahead(other) and eng._ahead is None


def test_a_taken_launch_skips_the_second_displacement_test(fake_graphs, monkeypatch):
    """The launch ahead ran the displacement test on its positions; the call that takes it (the same bytes, the same
    other inputs) does not run it again. Another numbers tensor in the call (same values) runs it, and so does a
    call whose launch ahead was made with ``rebuild_ahead`` off (untested)."""
    import dataclasses

    from mlff_distiller import AtomsBatch

    model = make_model()
    atoms = molecule("CH4")
    eng = _calc(model, True).engine
    first = AtomsBatch.from_atoms(atoms, dtype=torch.float32)

    def batch_of(pos, **kw):  # as the calculator makes an MD step's batch: the same tensors but the positions
        shifted = (pos - first.origin.numpy()).astype(np.float32)
        return dataclasses.replace(first, positions=torch.from_numpy(shifted), **kw)

    eng.compute(first, as_numpy=True)
    eng.compute(first, as_numpy=True)  # the zero-copy step captured
    tests = []
    real = eng.verlet.needs_rebuild
    monkeypatch.setattr(eng.verlet, "needs_rebuild", lambda *a, **k: tests.append(1) or real(*a, **k))
    for k, (ahead_on, kw, expect) in enumerate(
        [(True, {}, 1), (True, {"numbers": first.numbers.clone()}, 2), (False, {}, 1)]
    ):
        eng.rebuild_ahead = ahead_on
        moved = atoms.positions + 0.001 * (k + 1)
        tests.clear()
        calls = eng.verlet.n_calls
        assert eng.launch_ahead(batch_of(moved))
        assert len(tests) == (1 if ahead_on else 0)
        eng.compute(batch_of(moved, **kw), as_numpy=True)
        assert eng.last_ahead is True and len(tests) == expect, (k, tests)
        assert eng.verlet.n_calls == calls + 1


def _counting_moved(calc, monkeypatch) -> list:
    """Count the calculator's casts of positions into a batch (``_moved``) and of the time step read off the
    trajectory (``np.vdot`` calls in the calculator module)."""
    counts = {"moved": 0, "vdot": 0}
    moved = calc._moved

    def counted_moved(*a, **k):
        counts["moved"] += 1
        return moved(*a, **k)

    real_vdot = np.vdot

    def counted_vdot(*a, **k):
        counts["vdot"] += 1
        return real_vdot(*a, **k)

    monkeypatch.setattr(calc, "_moved", counted_moved)
    monkeypatch.setattr(calculator_module.np, "vdot", counted_vdot)
    return counts


@pytest.mark.parametrize("step_fs", [1.0, 0.013])
def test_the_launched_batch_and_time_step_are_reused(fake_graphs, monkeypatch, step_fs):
    """``reuse_ahead``: in velocity Verlet's steady state (every launch taken) a step casts its positions once (the
    prediction's batch serves the next calculation, whose step then finds the very tensor it launched) and reads the
    time step off the trajectory only until a prediction with it was taken. The trajectory is the one without reuse
    (bit for bit) and without launches ahead at all. A new time step mid-run misses one launch, then is read again.
    At 0.013 fs the least-squares time step is ~70 ulps off ASE's: the exact one is found (``_exact_step``)."""
    model = make_model()
    runs = {}
    for reuse in (True, False):
        atoms = molecule("C6H6")
        maxwell_boltzmann(atoms, 1500, rng=np.random.default_rng(2))
        calc = _calc(model, True)
        calc.reuse_ahead = reuse
        atoms.calc = calc
        dyn = VelocityVerlet(atoms, timestep=step_fs * units.fs)
        dyn.run(5)
        with monkeypatch.context() as m:
            counts = _counting_moved(calc, m)
            dyn.run(30)
            assert calc.engine.n_ahead_missed == 0 and calc.engine.n_ahead_taken >= 32
            # ASE's VelocityVerlet.run(30) makes one calculation (its first step reuses the last forces: none), so
            # 30 calculations, each taking the launch made by the one before it
            if reuse:
                assert counts == {"moved": 30, "vdot": 0}, counts
            else:
                assert counts == {"moved": 60, "vdot": 60}, counts
        dyn.dt = 0.5 * units.fs  # the time step changed: the next launch misses, the one after is taken again
        dyn.run(10)
        eng = calc.engine
        assert eng.n_ahead_missed == 1, eng.n_ahead_missed
        assert eng.last_ahead is True
        runs[reuse] = (atoms.positions.copy(), atoms.get_momenta().copy(), atoms.get_forces().copy())
    atoms = molecule("C6H6")
    maxwell_boltzmann(atoms, 1500, rng=np.random.default_rng(2))
    atoms.calc = _calc(model, False)
    dyn = VelocityVerlet(atoms, timestep=step_fs * units.fs)
    dyn.run(35)
    dyn.dt = 0.5 * units.fs
    dyn.run(10)
    runs["off"] = (atoms.positions, atoms.get_momenta(), atoms.get_forces())
    for a, b, c in zip(runs[True], runs[False], runs["off"], strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)


def test_the_exact_time_step_of_a_velocity_verlet_move():
    """``_exact_step`` gives the time step that reproduces ASE's move bit for bit: a decimal number of femtoseconds
    from an estimate ~1e-11 off, a raw step from an estimate a few ulps off; where nothing reproduces the move (the
    estimate too far off, or not ASE's expression), the estimate itself."""
    rng = np.random.default_rng(4)
    prev = rng.normal(0.0, 3.0, (12, 3))
    p = rng.normal(0.0, 0.05, (12, 3))
    m = rng.uniform(1.0, 16.0, (12, 1))
    for dt in (0.013 * units.fs, 0.5 * units.fs, 2.0 * units.fs, 0.0123456789123):
        x = prev + dt * p / m  # ASE's expression
        for off in (1, 3, -5):
            estimate = dt + off * np.spacing(dt)
            got = calculator_module._exact_step(estimate, prev, x, p, m)
            assert (prev + got * p / m).tobytes() == x.tobytes()
            if dt < 0.01:  # a decimal number of femtoseconds: ASE's own step, not only one that reproduces it
                assert got == dt
    dt = 0.5 * units.fs
    x = prev + dt * p / m
    far = dt * (1 + 1e-11)
    assert calculator_module._exact_step(far, prev, x, p, m) == dt  # the decimal femtoseconds
    raw = 0.0123456789123
    x = prev + raw * p / m
    assert calculator_module._exact_step(raw * (1 + 1e-11), prev, x, p, m) == raw * (1 + 1e-11)
    assert calculator_module._exact_step(dt, prev, x + 1e-3, p, m) == dt
    # the step found before is tried first: one check where it still reproduces the move, the search where not
    x = prev + dt * p / m
    calls = []
    real = calculator_module.units

    class CountingUnits:  # the search reads units.fs once; the shortcut does not get that far
        @property
        def fs(self):
            calls.append(1)
            return real.fs

    calculator_module.units = CountingUnits()
    try:
        assert calculator_module._exact_step(dt * (1 + 1e-11), prev, x, p, m, last=dt) == dt and not calls
        assert calculator_module._exact_step(dt * (1 + 1e-11), prev, x, p, m, last=2 * dt) == dt and calls
    finally:
        calculator_module.units = real


def _captured(name: str):
    """``(engine, reference, first, moved)``: a CPU engine on the zero-copy step, its capture made by two calls on the
    molecule ``name`` (``first``, its batch), an eager reference engine, and the batch of the positions moved by
    0.01 Å as the calculator makes an MD step's batch (the same tensors but the positions)."""
    import dataclasses

    from mlff_distiller import AtomsBatch

    model = make_model()
    atoms = molecule(name)
    eng = _calc(model, True).engine
    ref = ForceEngine(model, device="cpu", precision="fp32", mode="eager")
    first = AtomsBatch.from_atoms(atoms, dtype=torch.float32)
    eng.compute(first, as_numpy=True)
    eng.compute(first, as_numpy=True)  # the zero-copy step captured
    shifted = (atoms.positions + 0.01 - first.origin.numpy()).astype(np.float32)
    return eng, ref, first, dataclasses.replace(first, positions=torch.from_numpy(shifted))


def test_a_launched_tensor_changed_in_place_is_compared_by_its_bytes(fake_graphs):
    """The engine takes a launch by identity only for the very tensor launched, unmodified: the same tensor written
    in place after the launch (other bytes) throws the launch away and computes its own positions; written back to
    the launched bytes in place, it is taken (compared by its bytes)."""
    eng, ref, _, batch = _captured("CH4")
    assert eng.launch_ahead(batch)
    batch.positions[1, 2] += 0.02
    got = eng.compute(batch, as_numpy=True)
    assert eng.last_ahead is False and eng.n_ahead_missed == 1
    want = ref.compute(batch, to_host=True)["forces"].numpy()
    np.testing.assert_allclose(got["forces"], want, atol=1e-5)
    assert eng.launch_ahead(batch)
    batch.positions[1, 2] += 0.0  # a write of the same bytes: the version moves, the bytes do not
    eng.compute(batch, as_numpy=True)
    assert eng.last_ahead is True and eng.n_ahead_taken == 1


_COUNTERS = ("n_ahead_taken", "n_ahead_missed", "n_speculated", "n_discarded", "n_rebuilt_ahead", "last_ahead")


@pytest.mark.parametrize("dyn_kind", ["verlet", "langevin-followed"])
def test_the_express_take_is_the_general_path(fake_graphs, monkeypatch, dyn_kind):
    """``ForceEngine.express_take``: a call on the very batch launched ahead takes the launch without the general
    path (``_compute`` not called), and the trajectory, the engine's counters and the Verlet list's are bit for bit
    those of the general path, across the list's rebuilds ahead."""
    model = make_model()
    runs = {}
    for express in (True, False):
        monkeypatch.setattr(ForceEngine, "express_take", express)
        general = []
        real = ForceEngine._compute
        with monkeypatch.context() as m:
            m.setattr(ForceEngine, "_compute", lambda self, *a, g=general, f=real, **k: g.append(1) or f(self, *a, **k))
            atoms, calc, energies = _run(model, True, dyn_kind, 50)
        eng = calc.engine
        assert eng.express_take is express
        counters = [getattr(eng, k) for k in _COUNTERS]
        counters += [eng.verlet.n_builds, eng.verlet.n_calls, eng.last_bucket]
        runs[express] = (atoms.positions, atoms.get_momenta(), atoms.get_forces(), energies, counters, len(general))
    on, off = runs[True], runs[False]
    for a, b in zip(on[:4], off[:4], strict=True):
        np.testing.assert_array_equal(a, b)
    assert on[4] == off[4]
    assert on[4][0] >= 45 and on[4][1] == 0 and on[4][6] >= 3, on[4]  # taken, none missed, rebuilt ahead
    # the general path: 51 calculations; the express take: only those before the first launch taken (and the last)
    assert off[5] == 51 and on[5] == 51 - on[4][0], (on[5], off[5], on[4][0])


def test_the_express_take_falls_back_where_the_inputs_changed(fake_graphs):
    """The launched positions tensor with other atomic numbers (a new numbers tensor), with a new cell tensor (the
    same values) or with float64 positions beside it, a launch made without its displacement test (``rebuild_ahead``
    off), a list since marked as built in the other atom order, or the speculation or the Verlet list switched off by
    hand after the launch: the call goes the general path, which computes the inputs' step (against an eager
    reference; some of these drop the launch); the launched batch itself takes the express path, with the same
    results, as NumPy arrays or CPU tensors."""
    import dataclasses

    eng, ref, first, launched = _captured("CH3OH")
    numbers = first.numbers.clone()
    numbers[1] = 7  # O -> N: other species, the same positions tensor
    general = []
    real = eng._compute
    eng._compute = lambda *a, **k: general.append(1) or real(*a, **k)  # (an instance attribute over the method)
    for case in ("numbers", "cell", "float64", "untested", "order", "speculation", "express", "tensors", "no list"):
        eng.rebuild_ahead = case != "untested"
        assert eng.launch_ahead(launched)
        batch = launched
        if case == "numbers":
            batch = dataclasses.replace(launched, numbers=numbers)
        elif case == "cell":
            batch = dataclasses.replace(launched, cell=launched.cell.clone())
        elif case == "float64":  # the same positions tensor with float64 ones beside it: pair vectors in float64
            batch = dataclasses.replace(
                launched, positions64=launched.positions.double(), cell64=launched.cell.double()
            )
        elif case == "order":
            eng._verlet_sorted = True  # (as if the eager path had since built the list in Morton order)
        elif case == "speculation":
            eng.speculative_verlet = False  # set by hand between the launch and the call: the step is launched again
        elif case == "no list":
            eng.verlet = None  # likewise: the plain padded path (its own molecular list)
        general.clear()
        if case == "tensors":  # the express take with CPU tensors out (to_host) instead of NumPy arrays
            got = eng.compute(batch, to_host=True)
            assert isinstance(got["forces"], torch.Tensor) and got["forces"].device.type == "cpu"
            got = {k: v.numpy() for k, v in got.items()}
        else:
            got = eng.compute(batch, as_numpy=True)
        assert len(general) == (0 if case in ("express", "tensors") else 1), case
        # the general path takes the launch too (by identity), except where it drops the list (the other order) or
        # the fill (float64 pair vectors are written as the shift vectors of a fill of their own)
        assert eng.last_ahead is (case not in ("float64", "order", "speculation", "no list")), case
        eng.speculative_verlet = True
        want = ref.compute(batch, to_host=True)
        np.testing.assert_allclose(got["forces"], want["forces"].numpy(), atol=1e-5, err_msg=case)
        np.testing.assert_allclose(got["energy"], want["energy"].numpy(), rtol=1e-6, err_msg=case)
        if case in ("cell", "float64"):
            eng.compute(launched, as_numpy=True)  # the launched batch's cell and float32 path the engine's again


def _cuda_runs(make_dyn) -> list:
    """Benzene at 1,500 K for 100 steps on CUDA, twice: ``make_dyn(atoms, calc, on)`` sets up each run's integrator
    (``on`` True, then False); returns ``[(atoms, engine)]`` of the two."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    model = make_model()
    runs = []
    for on in (True, False):
        atoms = molecule("C6H6")
        maxwell_boltzmann(atoms, 1500, rng=np.random.default_rng(2))
        calc = StudentCalculator(model, device="cuda", skin=0.3)
        atoms.calc = calc
        make_dyn(atoms, calc, on).run(100)
        runs.append((atoms, calc.engine))
    return runs


@pytest.mark.gpu
def test_velocity_verlet_takes_its_launches_ahead_on_cuda():
    """On CUDA (mode auto: captured steps, the zero-copy step): velocity Verlet takes its launches ahead, and its
    trajectory equals the one without them (float32 steps on the same inputs: the same results up to the
    message passing's float32 sums, so positions within 1e-5 Å after 100 steps)."""

    def verlet(atoms, calc, on):
        calc.launch_ahead = on
        return VelocityVerlet(atoms, timestep=1.0 * units.fs)

    (a_on, eng), (a_off, _) = _cuda_runs(verlet)
    assert eng.mode == "cudagraph" and eng._md_runners
    assert eng.n_ahead_taken >= 95 and eng.n_ahead_missed == 0, (eng.n_ahead_taken, eng.n_ahead_missed)
    builds = eng.verlet.n_builds  # (benzene at 4 + 0.3 Å is not complete: its list is rebuilt)
    assert builds >= 2 and eng.n_rebuilt_ahead == builds - 1 and eng.n_discarded == 0, (builds, eng.n_discarded)
    np.testing.assert_allclose(a_on.positions, a_off.positions, rtol=0, atol=1e-5)


@pytest.mark.gpu
def test_a_followed_langevin_takes_its_launches_ahead_on_cuda():
    """On CUDA: ASE's Langevin with FixCom (``mlff-distill md``'s molecule), followed by the calculator, takes its
    launches ahead, and its trajectory equals the one not followed (within the float32 steps' sums, 1e-5 Å)."""

    def langevin(atoms, calc, on):
        atoms.set_constraint(FixCom())
        rng = np.random.default_rng(7)
        dyn = Langevin(atoms, timestep=1.0 * units.fs, temperature_K=1500, friction=0.05, rng=rng, fixcm=False)
        if on:
            calc.follow(dyn)
        return dyn

    (a_on, eng), (a_off, eng_off) = _cuda_runs(langevin)
    assert eng.n_ahead_taken >= 95 and eng.n_ahead_missed == 0, (eng.n_ahead_taken, eng.n_ahead_missed)
    assert eng_off.n_ahead_taken == 0
    np.testing.assert_allclose(a_on.positions, a_off.positions, rtol=0, atol=1e-5)


def test_follow_takes_langevin_only():
    calc = StudentCalculator(make_model(), device="cpu")
    atoms = molecule("H2O")
    with pytest.raises(ValueError, match="Langevin"):
        calc.follow(VelocityVerlet(atoms, timestep=1.0 * units.fs))
    dyn = Langevin(atoms, timestep=1.0 * units.fs, temperature_K=300, friction=0.05, fixcm=False)
    assert calc.follow(dyn) is calc and calc._followed is dyn
    calc.follow(None)
    assert calc._followed is None
