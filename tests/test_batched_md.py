"""BatchedMD: many trajectories in one engine call per step, against ASE's integrators one structure at a time."""

import json

import numpy as np
import pytest
import torch
from ase import units
from ase.build import molecule
from ase.md.verlet import VelocityVerlet
from helpers import make_model, silicon_cell

from mlff_distiller import StudentCalculator, load_model
from mlff_distiller.ase_compat import maxwell_boltzmann
from mlff_distiller.batched_md import BatchedMD
from mlff_distiller.batching import NonFiniteOutputError

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _ase_nve(model, atoms, momenta, steps, dt_fs, device="cpu"):
    atoms = atoms.copy()
    atoms.set_momenta(momenta)
    atoms.calc = StudentCalculator(model, precision="fp64", device=device)
    VelocityVerlet(atoms, timestep=dt_fs * units.fs).run(steps)
    return atoms


@pytest.mark.parametrize("device", DEVICES)
def test_nve_equals_ase_velocity_verlet_structure_by_structure(device):
    """Different molecules and a periodic crystal in one batch: each replica follows ASE's VelocityVerlet with the
    calculator on that structure alone (float64), and the start is the calculator's Maxwell-Boltzmann draw."""
    model = make_model(seed=3)
    structures = [molecule("CH4"), silicon_cell(rattle=0.05), molecule("C6H6"), molecule("H2O")]
    md = BatchedMD(model, structures, ensemble="nve", precision="fp64", seed=7, fix_com=False, device=device)
    md.run(25)
    assert md.nsteps == 25 and md.time_fs == pytest.approx(12.5)
    rng = np.random.default_rng(7)
    final = md.get_atoms()
    for k, atoms in enumerate(structures):
        start = atoms.copy()
        maxwell_boltzmann(start, 300.0, rng=rng)
        ref = _ase_nve(model, start, start.get_momenta(), 25, 0.5)
        got = final[k]
        assert got.info["replica"] == k
        np.testing.assert_allclose(got.positions, ref.positions, rtol=0, atol=1e-9)
        np.testing.assert_allclose(got.get_momenta(), ref.get_momenta(), rtol=0, atol=1e-9)
        assert got.get_potential_energy() == pytest.approx(ref.get_potential_energy(), abs=1e-9)
        np.testing.assert_allclose(got.get_forces(), ref.get_forces(), rtol=0, atol=1e-9)
    # The list was kept across steps (the skin) and the run was exact anyway (above).
    assert md.engine.verlet.n_builds < 25


def test_skin_list_gives_the_trajectory_of_a_fresh_list_every_step():
    model = make_model(seed=4)
    structures = [molecule("C6H6"), molecule("CH3CH2OH")]
    runs = []
    for skin in (1.0, 0.0):
        md = BatchedMD(model, structures, ensemble="nve", precision="fp64", temperature_K=600, seed=2, skin=skin)
        md.run(40)
        runs.append((md.positions.cpu().numpy(), md.engine.verlet.n_builds))
    np.testing.assert_allclose(runs[0][0], runs[1][0], rtol=0, atol=1e-9)
    assert runs[0][1] < 10 and runs[1][1] == 41


@pytest.mark.parametrize("device", DEVICES)
def test_fix_com_removes_the_centre_of_mass_momentum_and_counts_3n_minus_3(device):
    model = make_model(seed=5)
    structures = [molecule("C6H6"), molecule("H2O"), silicon_cell()]
    md = BatchedMD(model, structures, temperature_K=400, friction_per_fs=0.05, seed=1, device=device)
    assert md.fix_com.tolist() == [True, True, False]  # the molecules, not the crystal
    np.testing.assert_array_equal(md.dof, [3 * 12 - 3, 3 * 3 - 3, 3 * 2])
    md.run(5)
    ptr = md.ptr
    p = md.momenta.cpu().numpy()
    for k in (0, 1):
        assert np.abs(p[ptr[k] : ptr[k + 1]].sum(axis=0)).max() < 1e-10
    assert np.abs(p[ptr[2] : ptr[3]].sum(axis=0)).max() > 1e-3  # the crystal's is not removed
    ke = md.kinetic_energies()
    np.testing.assert_allclose(md.temperatures(), 2 * ke / (md.dof * units.kB))
    # ASE's temperature of the same state with FixCom (3N - 3 degrees of freedom)
    from ase.constraints import FixCom

    a = md.get_atoms([0])[0]
    a.set_constraint(FixCom())
    assert a.get_temperature() == pytest.approx(md.temperatures()[0], rel=1e-12)


@pytest.mark.parametrize("device", DEVICES)
def test_langevin_holds_the_bath_temperature(device):
    """64 water molecules at 500 K with the shipped student: the mean kinetic temperature after equilibration is the
    bath's (a noise of the wrong size, or a friction applied twice, misses by far more than the tolerance)."""
    model = load_model("builtin:chno-gfn2")
    md = BatchedMD(model, [molecule("H2O")] * 64, temperature_K=500.0, friction_per_fs=0.2, seed=11, device=device)
    temps = []
    md.run(240, observer=lambda m: temps.append(m.temperatures().mean()), interval=4)
    mean = float(np.mean(temps[20:]))
    assert 460.0 < mean < 540.0, mean
    # replicas started alike but sampled apart
    pos = md.positions.cpu().numpy().reshape(64, 3, 3)
    assert np.abs(pos[0] - pos[1]).max() > 1e-3


@pytest.mark.parametrize("device", DEVICES)
def test_each_replica_holds_its_own_bath_temperature(device):
    """Per-replica baths (tempering, annealing): 32 waters at 300 K beside 32 at 900 K each hold their own, and
    ``set_temperature`` moves them between runs (on a GPU, through the captured integrator's buffer)."""
    model = load_model("builtin:chno-gfn2")
    temps = [300.0] * 32 + [900.0] * 32
    md = BatchedMD(model, [molecule("H2O")] * 64, temperature_K=temps, friction_per_fs=0.2, seed=5, device=device)
    np.testing.assert_array_equal(md.bath_temperatures, temps)
    cold, hot = [], []

    def watch(m):
        t = m.temperatures()
        cold.append(t[:32].mean())
        hot.append(t[32:].mean())

    # 160 steps a run (τ = 5 fs: thermalised within the first ~12 observations; seeds 5-8 all inside the bounds)
    md.run(160, observer=watch, interval=4)
    assert hot[0] > 2 * cold[0]  # each replica's velocities drawn at its own temperature
    assert 260 < np.mean(cold[12:]) < 340 and 780 < np.mean(hot[12:]) < 1020, (np.mean(cold[12:]), np.mean(hot[12:]))
    md.set_temperature(600.0)
    cold.clear(), hot.clear()
    md.run(160, observer=watch, interval=4)
    both = np.mean(cold[20:] + hot[20:])
    assert 530 < both < 670, both


@pytest.mark.gpu
@pytest.mark.parametrize("ensemble", ["langevin", "nve"])
def test_cuda_graph_integrator_equals_the_eager_one(ensemble):
    """The integrator's two halves replayed as CUDA graphs give the eager kernels' trajectory (the same draws), and
    the warm-up before their capture leaves the state as it was."""
    model = make_model(seed=8)
    structures = [molecule("C6H6"), molecule("CH3CH2OH"), silicon_cell()]
    runs = []
    for graphs in (True, False):
        kw = {"seed": 3, "device": "cuda", "precision": "fp64", "cuda_graphs": graphs}
        md = BatchedMD(model, structures, ensemble=ensemble, **kw)
        md.run(30)
        assert isinstance(getattr(md._captured[0], "__self__", None), torch.cuda.CUDAGraph) == graphs
        runs.append((md.positions.cpu().numpy(), md.momenta.cpu().numpy()))
    np.testing.assert_allclose(runs[0][0], runs[1][0], rtol=0, atol=1e-12)
    np.testing.assert_allclose(runs[0][1], runs[1][1], rtol=0, atol=1e-12)


def test_observer_runs_at_the_start_and_every_interval():
    md = BatchedMD(make_model(), [molecule("H2O")], seed=0)
    seen = []
    md.run(10, observer=lambda m: seen.append(m.nsteps), interval=4)
    md.run(4, observer=lambda m: seen.append(m.nsteps), interval=2)
    assert seen == [0, 4, 8, 12, 14]


def test_get_atoms_results_are_the_calculators_on_those_positions():
    model = make_model(seed=6)
    md = BatchedMD(model, [molecule("CH3CH2OH"), molecule("CH4")], seed=4, precision="fp64")
    md.run(6)
    for atoms in md.get_atoms():
        energy, forces = atoms.get_potential_energy(), atoms.get_forces()
        energies = atoms.calc.results["energies"]
        atoms.calc = StudentCalculator(model, precision="fp64", device="cpu")
        assert energy == pytest.approx(atoms.get_potential_energy(), abs=1e-10)
        np.testing.assert_allclose(forces, atoms.get_forces(), atol=1e-10)
        np.testing.assert_allclose(energies, atoms.get_potential_energies(), atol=1e-10)


def test_input_velocities_are_kept_and_inputs_are_not_modified():
    atoms = molecule("CH4")
    rng = np.random.default_rng(0)
    maxwell_boltzmann(atoms, 300, rng=rng)
    before = atoms.get_momenta().copy(), atoms.positions.copy()
    md = BatchedMD(make_model(), [atoms], velocities="input", fix_com=False, ensemble="nve")
    np.testing.assert_array_equal(md.momenta.cpu().numpy(), before[0])
    md.run(3)
    np.testing.assert_array_equal(atoms.get_momenta(), before[0])
    np.testing.assert_array_equal(atoms.positions, before[1])


def test_a_replica_that_blows_up_is_named_and_the_others_kept():
    md = BatchedMD(make_model(), [molecule("H2O"), molecule("CH4"), molecule("H2O")], seed=0)
    md.run(2)
    ptr = md.ptr
    md.momenta[ptr[1]] = float("nan")
    with pytest.raises(NonFiniteOutputError, match=r"replica\(s\) \[1\]") as err:
        md.run(1)
    assert err.value.indices == [1]
    assert err.value.results[1] is None
    assert np.isfinite(err.value.results[0]["forces"]).all() and len(err.value.results[2]["forces"]) == 3
    # NaN positions meeting a list rebuild: the replica is named, not the neighbour list's ValueError
    md = BatchedMD(make_model(), [molecule("H2O"), molecule("CH4")], seed=0)
    md.run(1)
    md.positions[md.ptr[1] + 2] = float("nan")
    md.engine.verlet.reset()
    with pytest.raises(NonFiniteOutputError, match=r"replica\(s\) \[1\] have a non-finite"):
        md.run(1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"ensemble": "npt"}, "ensemble must be one of"),
        ({"velocities": "zero"}, "velocities must be"),
        ({"timestep_fs": 0.0}, "timestep_fs must be"),
        ({"temperature_K": float("nan")}, "temperature_K must be"),
        ({"temperature_K": [300.0, -1.0]}, "temperature_K must be"),
        ({"temperature_K": [300.0, 400.0, 500.0]}, r"one per replica \(2\)"),
        ({"friction_per_fs": -1.0}, "friction_per_fs must be"),
        ({"skin": -0.5}, "skin must be"),
        ({"fix_com": [True, False, True]}, "one flag per structure"),
        ({"velocities": "input"}, "have no momenta"),
        ({"freeze_force": 0.0}, "freeze_force must be"),
        ({"freeze_force": float("inf")}, "freeze_force must be"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BatchedMD(make_model(), [molecule("H2O"), molecule("CH4")], **kwargs)


def test_bad_structures_are_named():
    model = make_model()
    with pytest.raises(ValueError, match="at least one structure"):
        BatchedMD(model, [])
    with pytest.raises(ValueError, match="element"):
        BatchedMD(model, [molecule("H2O"), molecule("NaCl")])
    bad = molecule("H2O")
    bad.positions[1, 0] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        BatchedMD(model, [molecule("CH4"), bad])


def _cli(tmp_path):
    import torch

    from mlff_distiller import StudentModel
    from mlff_distiller.cli import main

    torch.manual_seed(0)
    model = tmp_path / "m.pt"
    StudentModel(species=[1, 6, 7, 8], hidden=16, layers=1).save(model)
    return main, ["md", "--model", str(model), "--device", "cpu", "--precision", "fp64"]


def test_md_command_runs_several_frames_and_replicas_in_one_batch(tmp_path, capsys):
    """``--input file@: --replicas 2``: every replica of every frame, one batch; each written frame names its
    trajectory, and is what ASE writes for it; the last frames are BatchedMD's state (the same draw)."""
    import ase.io

    from mlff_distiller import load_model
    from mlff_distiller.cli_jobs import MDJob

    main, base = _cli(tmp_path)
    src = tmp_path / "three.xyz"
    starts = [molecule("CH4"), molecule("CH3CH2OH"), molecule("NH3")]
    ase.io.write(src, starts)
    out = tmp_path / "md.extxyz"
    args = [*base, "--input", f"{src}@:", "--replicas", "2", "--output", str(out), "--ensemble", "nve"]
    assert main([*args, "--steps", "8", "--interval", "4", "--seed", "5"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["replicas"] == 6 and report["replica_steps_per_s"] > 0 and report["startup_s"] > 0
    frames = ase.io.read(out, index=":")
    assert len(frames) == 3 * 6
    assert [f.info["replica"] for f in frames] == list(range(6)) * 3
    assert [f.info["time_fs"] for f in frames] == [0.0] * 6 + [2.0] * 6 + [4.0] * 6
    assert [len(f) for f in frames[:6]] == [5, 5, 9, 9, 4, 4]
    # the two replicas of a frame start alike and move apart (their own velocities)
    np.testing.assert_array_equal(frames[0].positions, frames[1].positions)
    assert np.abs(frames[-6].positions - frames[-5].positions).max() > 1e-4
    # NVE in fp64: each replica's total energy is kept
    for k in range(6):
        e = [f.info["total_energy"] for f in frames if f.info["replica"] == k]
        assert max(e) - min(e) < 1e-3
    md = BatchedMD(load_model(base[2]), [a for a in starts for _ in range(2)], ensemble="nve", precision="fp64", seed=5)
    md.run(8)
    for got, ref in zip(frames[-6:], md.get_atoms(), strict=True):
        np.testing.assert_allclose(got.positions, ref.positions, atol=5e-9)
        np.testing.assert_allclose(got.get_momenta(), ref.get_momenta(), atol=5e-9)
        np.testing.assert_allclose(got.get_forces(), ref.get_forces(), atol=5e-9)
    from test_md_frames import _ase_text

    text = out.read_text().splitlines(keepends=True)
    first = "".join(text[: len(starts[0]) + 2])
    frame = frames[0]
    calc, frame.calc = frame.calc, None
    info = {k: v for k, v in frame.info.items() if k not in calc.results}
    assert _ase_text(frame, calc.results, info) == first
    assert MDJob().replicas == 1


def test_md_command_batched_traj_and_continuation(tmp_path, capsys):
    """A batched run into ``.traj``; continuing three trajectories from their last frames (``@-3:``, ``--velocities
    input``) is the longer run, at the same times."""
    import ase.io

    main, base = _cli(tmp_path)
    src = tmp_path / "start.xyz"
    ase.io.write(src, molecule("CH3CH2OH"))
    common = [*base, "--replicas", "3", "--ensemble", "nve", "--interval", "5"]

    def run(inp, out, steps, *extra):
        code = main([*common, "--input", str(inp), "--output", str(tmp_path / out), "--steps", str(steps), *extra])
        capsys.readouterr()
        assert code == 0
        return ase.io.read(tmp_path / out, index=":")

    first = run(src, "first.extxyz", 10)
    whole = run(src, "whole.traj", 15)
    assert len(first) == 9 and len(whole) == 12
    after = run(f"{tmp_path / 'first.extxyz'}@-3:", "next.extxyz", 5, "--velocities", "input", "--replicas", "1")
    assert [f.info["time_fs"] for f in after] == [5.0] * 3 + [7.5] * 3
    for got, ref in zip(after[-3:], whole[-3:], strict=True):
        np.testing.assert_allclose(got.positions, ref.positions, atol=1e-6)
        np.testing.assert_allclose(got.get_momenta(), ref.get_momenta(), atol=1e-6)
        assert got.info["replica"] == ref.info["replica"]


def test_md_command_batched_refusals(tmp_path, capsys):
    import ase.io

    main, base = _cli(tmp_path)
    src = tmp_path / "two.xyz"
    ase.io.write(src, [molecule("CH4"), molecule("NH3")])
    out = str(tmp_path / "o.extxyz")
    for extra, says in (
        (["--input", f"{src}@:", "--ensemble", "npt"], "npt' runs one structure"),
        (["--input", str(src), "--replicas", "0"], "replicas must be >= 1"),
        (["--input", f"{src}@:", "--velocities", "input"], "has no momenta"),
        (["--input", str(src), "--freeze-force", "10"], "give --replicas or several input frames"),
    ):
        assert main([*base, *extra, "--output", out, "--steps", "2"]) == 2
        assert says in capsys.readouterr().err
    # a file without an index: its first frame alone, as before (no replica named)
    assert main([*base, "--input", str(src), "--output", out, "--steps", "2", "--interval", "1"]) == 0
    capsys.readouterr()
    frames = ase.io.read(out, index=":")
    assert len(frames) == 3 and all(len(f) == 5 and "replica" not in f.info for f in frames)


def test_md_command_freezes_replicas_above_the_force(tmp_path, capsys):
    """``--freeze-force``: a limit below every force the student gives freezes each replica at its start; the run
    goes on, the summary names them and every frame says so, at the starting positions."""
    import ase.io

    main, base = _cli(tmp_path)
    src = tmp_path / "start.xyz"
    ase.io.write(src, molecule("CH3CH2OH"))
    out = tmp_path / "md.extxyz"
    args = [*base, "--input", str(src), "--replicas", "2", "--output", str(out), "--steps", "4", "--interval", "2"]
    assert main([*args, "--freeze-force", "1e-9"]) == 0
    assert json.loads(capsys.readouterr().out)["frozen"] == [0, 1]
    frames = ase.io.read(out, index=":")
    assert len(frames) == 6 and all(f.info["frozen"] for f in frames)
    for f in frames:
        np.testing.assert_allclose(f.positions, molecule("CH3CH2OH").positions, atol=1e-12)
    assert main(args) == 0  # without it: nothing frozen
    assert json.loads(capsys.readouterr().out)["frozen"] == []


@pytest.mark.gpu
def test_positions_on_the_device_are_not_speculated_on():
    """The engine launches a step before its displacement test only for positions given on the host (the calculator):
    a test on device positions would wait for that step (BatchedMD keeps its state on the device)."""
    model = make_model()
    md = BatchedMD(model, [molecule("CH4")] * 4, device="cuda", seed=0)
    md.run(10)
    assert md.engine.n_speculated == 0
    atoms = molecule("CH4")
    atoms.calc = StudentCalculator(model, device="cuda")
    for _ in range(6):
        atoms.positions += 1e-3
        atoms.get_forces()
    assert atoms.calc.engine.n_speculated > 0


def test_a_batched_md_engine_captures_beyond_the_one_off_limit():
    """BatchedMD repeats one shape every step, so its engine in mode "auto" captures buckets up to MD_MAX_EDGES
    edges, where a one-off graph (the engine's default, a shrinking relaxation) stops at auto_max_edges (for a
    512-wide student AUTO_MAX_EDGES): 4,096 benzenes (~540,000 edges with the skin) get a bucket."""
    from mlff_distiller.batched_md import MD_MAX_EDGES, batch_engine
    from mlff_distiller.engine import AUTO_MAX_EDGES, ForceEngine, auto_max_edges

    model = make_model(hidden=512)
    assert auto_max_edges(512) == AUTO_MAX_EDGES
    md = BatchedMD(model, [molecule("CH4")] * 2, device="cpu", seed=0)
    assert md.engine.buckets.max_edges >= MD_MAX_EDGES > AUTO_MAX_EDGES
    assert md.engine.buckets.select(49_152, 540_000) is not None
    assert ForceEngine(model, mode="auto").buckets.select(49_152, 540_000) is None
    relax = batch_engine(model, True, device="cpu", precision="fp32", mode="auto", skin=1.0)  # relax_batch's
    assert relax.buckets.max_edges < MD_MAX_EDGES
    eager = batch_engine(model, True, device="cpu", precision="fp32", mode="eager", skin=1.0, fixed_shape=True)
    assert eager.buckets.max_edges == ForceEngine(model, mode="eager").buckets.max_edges  # a mode given: as asked
    md.run(3)
    assert np.isfinite(md.potential_energies()).all()


def test_replicas_outside_the_training_data_are_named():
    """The shipped student stores its training envelope: a squeezed water among ordinary molecules is named at the
    start, by replica, as the calculator would warn for it alone; checks repeat every ``check_domain`` steps."""
    from mlff_distiller.domain import OutOfDomainWarning

    squeezed = molecule("H2O")
    squeezed.positions[1] = squeezed.positions[0] + 0.45 * (squeezed.positions[1] - squeezed.positions[0])
    structures = [molecule("CH3CH2OH"), squeezed, molecule("CH4")]
    with pytest.warns(OutOfDomainWarning, match=r"replica\(s\) \[1\] lie outside .*H-O pair at 0.44"):
        md = BatchedMD("builtin:chno-gfn2", structures, ensemble="nve", temperature_K=10.0, check_domain=4)
        md.potential_energies()
    assert list(md.domain_findings) == [1]
    calls = []
    real = md._check_domain
    md._check_domain = lambda: (calls.append(md.nsteps), real())
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", OutOfDomainWarning)  # the same replica found again does not warn again
        md.run(9)
    assert calls == [4, 8]
    quiet = BatchedMD("builtin:chno-gfn2", structures, ensemble="nve", check_domain=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", OutOfDomainWarning)
        quiet.run(2)
    assert quiet.domain is None and quiet.domain_findings == {}
    with pytest.raises(ValueError, match="check_domain must be"):
        BatchedMD(make_model(), structures, check_domain=0)


def test_replicas_with_runaway_forces_are_named(monkeypatch):
    """A replica in which an atom felt a force component above FORCE_LIMIT at any step is named by the next check (every
    ``check_domain`` steps, also for a student without an envelope) and stays named; the others are not."""
    import warnings

    import mlff_distiller.domain as domain
    from mlff_distiller.domain import OutOfDomainWarning

    structures = [molecule("CH4"), molecule("H2O"), molecule("NH3")]
    model = make_model()  # random weights: no envelope, no wall
    monkeypatch.setattr(domain, "FORCE_LIMIT", 50.0)
    md = BatchedMD(model, structures, ensemble="nve", temperature_K=0.0, check_domain=2, cuda_graphs=False)
    real, calls = md.engine.compute, []

    def kicked(batch, **kw):  # from the 4th force call (step 3) on, replica 1 feels 1e3 eV/Å
        out = dict(real(batch, **kw))
        calls.append(1)
        if len(calls) >= 4:
            lo, hi = md.ptr[1], md.ptr[2]
            forces = out["forces"].clone()
            forces[lo:hi] = 1e3
            out["forces"] = forces
        return out

    md.engine.compute = kicked
    with warnings.catch_warnings():
        warnings.simplefilter("error", OutOfDomainWarning)
        md.run(2)  # checks at the start and at step 2: nothing
    assert md.domain_findings == {}
    with pytest.warns(OutOfDomainWarning, match=r"replica\(s\) \[1\] .*an atom felt a force of 1e\+03 eV/Å by step 4"):
        md.run(2)
    assert list(md.domain_findings) == [1]
    md.engine.compute = real  # the forces come back down: named once, it stays named
    with warnings.catch_warnings():
        warnings.simplefilter("error", OutOfDomainWarning)
        md.run(4)
    assert list(md.domain_findings) == [1] and "eV/Å" in md.domain_findings[1][0]


def _inject(md, replica: int, value: float, from_call: int) -> None:
    """From the ``from_call``-th force call on, every force of ``replica`` is ``value`` (and its energy, if that is
    not finite)."""
    real, calls = md.engine.compute, []

    def injected(batch, **kw):
        out = dict(real(batch, **kw))
        calls.append(1)
        if len(calls) >= from_call:
            forces = out["forces"].clone()
            forces[md.ptr[replica] : md.ptr[replica + 1]] = value
            out["forces"] = forces
            if not np.isfinite(value):  # what a blown-up student gives: the energy too
                energy = out["energy"].clone()
                energy[replica] = value
                out["energy"] = energy
        return out

    md.engine.compute = injected


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ensemble", ["nve", "langevin"])
@pytest.mark.parametrize("value", [float("nan"), 5e3])
def test_a_blown_up_replica_is_frozen_and_the_others_go_on(device, ensemble, value):
    """``freeze_force``: a replica whose forces turn non-finite or exceed the limit (injected from the 4th force
    call, i.e. at step 3) stops where it was with zero momenta, is named, and the run goes on; the other replicas'
    trajectories are those of a run without the limit in which nothing happened (NVE: exactly; Langevin: the same
    draws)."""
    import warnings

    from mlff_distiller.domain import OutOfDomainWarning

    structures = [molecule("H2O"), molecule("CH4"), molecule("NH3")]
    kw = dict(ensemble=ensemble, seed=4, device=device, precision="fp64", check_domain=2, freeze_force=1e3)
    kw["fix_com"] = ensemble == "langevin"  # both ways of making the kick: with and without FixCom
    model = make_model(seed=3)
    quiet = BatchedMD(model, structures, **{**kw, "freeze_force": None})  # the same run without freezing
    with warnings.catch_warnings():
        warnings.simplefilter("error", OutOfDomainWarning)
        quiet.run(8)
    assert quiet.frozen == []
    md = BatchedMD(model, structures, **kw)
    _inject(md, 1, value, from_call=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", OutOfDomainWarning)
        md.run(2)
    assert md.frozen == []
    with pytest.warns(OutOfDomainWarning, match=r"replica\(s\) \[1\] .*frozen by step 4"):
        md.run(2)
    assert md.frozen == [1]
    held = md.positions[md.ptr[1] : md.ptr[2]].clone()
    md.run(4)  # no NonFiniteOutputError: the frozen replica does not stop the run
    lo, hi = md.ptr[1], md.ptr[2]
    assert torch.equal(md.positions[lo:hi], held) and not md.momenta[lo:hi].any()
    assert torch.isfinite(md.positions).all()
    keep = np.r_[0 : md.ptr[1], md.ptr[2] : md.ptr[3]]
    np.testing.assert_allclose(md.positions.cpu().numpy()[keep], quiet.positions.cpu().numpy()[keep], atol=1e-12)
    np.testing.assert_allclose(md.momenta.cpu().numpy()[keep], quiet.momenta.cpu().numpy()[keep], atol=1e-12)
    atoms = md.get_atoms()
    assert atoms[1].info.get("frozen") and not atoms[0].info.get("frozen") and not atoms[2].info.get("frozen")
    assert md.temperatures()[1] == 0.0
    # No NaN leaves in a frame: frozen by a NaN, the replica's frame holds its geometry and no student numbers;
    # frozen by a large force, it keeps them.
    results = {k: r for k, _, r in md.states()}
    if np.isfinite(value):
        assert results[1]["forces"].max() == value and np.isfinite(results[1]["energy"])
    else:
        assert results[1] == {} and atoms[1].calc.results == {}
    assert np.isfinite(results[0]["energy"]) and np.isfinite(results[2]["forces"]).all()


def test_without_freeze_force_a_blow_up_stops_the_run():
    md = BatchedMD(make_model(seed=3), [molecule("H2O"), molecule("CH4")], ensemble="nve", check_domain=None)
    _inject(md, 1, float("nan"), from_call=3)
    with pytest.raises(NonFiniteOutputError, match=r"replica\(s\) \[1\]"):
        md.run(5)
    assert md.frozen == []


def test_ase_constraints_other_than_fixcom_are_refused():
    from ase.constraints import FixAtoms, FixCom

    fixed = molecule("H2O")
    fixed.set_constraint(FixAtoms(indices=[0]))
    with pytest.raises(ValueError, match=r"structure 1 carries an ASE constraint \(FixAtoms\)"):
        BatchedMD(make_model(), [molecule("CH4"), fixed])
    crystal = silicon_cell()
    crystal.set_constraint(FixCom())  # honoured: a periodic structure with FixCom gets its centre of mass fixed
    md = BatchedMD(make_model(), [molecule("CH4"), crystal])
    assert md.fix_com.tolist() == [True, True]
