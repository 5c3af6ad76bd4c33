"""The fine-tuning loop from a student's own MD: ``harvest`` picks where each trajectory first went wrong, ``label
--as-given`` labels those frames as they are, ``train --data OLD --data NEW --init-model`` fine-tunes on both."""

import json
import os

import ase.io
import numpy as np
import pytest
from ase import Atoms
from ase.build import molecule
from ase.calculators.emt import EMT
from distill_helpers import emt_seeds

from mlff_distiller import load_model
from mlff_distiller.cli import main
from mlff_distiller.distill import SamplingConfig, label, read_frames
from mlff_distiller.distill.sampling import make_tasks
from mlff_distiller.domain import DomainEnvelope
from mlff_distiller.harvest import harvest


def _trajectories(n_frames=6):
    """Frames as ``mlff-distill md`` writes them for 4 replicas (time-major): replica 1 frozen from its frame 4 on,
    replica 2 with a pair squeezed to 0.5 Å in its frame 2, replica 3 with non-finite positions from its frame 3
    (a run without freeze_force), replica 0 fine throughout."""
    rng = np.random.default_rng(0)
    base = molecule("H2O")
    frames = []
    for t in range(n_frames):
        for r in range(4):
            a = base.copy()
            a.positions += rng.normal(0.0, 0.02, a.positions.shape)
            a.info.update(time_fs=2.0 * t, replica=r)
            if r == 1 and t >= 4:
                a.info["frozen"] = True
            if r == 2 and t == 2:
                a.positions[1] = a.positions[0] + [0.5, 0.0, 0.0]
            if r == 3 and t >= 3:
                a.positions[:] = np.nan
            frames.append(a)
    return frames


def _envelope():
    rng = np.random.default_rng(1)
    data = []
    for _ in range(8):
        a = molecule("H2O")
        a.positions += rng.normal(0.0, 0.02, a.positions.shape)
        data.append(a)
    return DomainEnvelope.from_frames(data, cutoff=4.0)


def test_harvest_picks_each_trajectory_first_bad_frame_and_those_before_it():
    frames = _trajectories()
    at = {(f.info["replica"], int(f.info["time_fs"] // 2)): f for f in frames}
    report = harvest(frames, before=2, envelope=_envelope())
    picked = [(f.info["replica"], int(f.info["time_fs"] // 2), f.info["harvest"]) for f in report.frames]
    assert picked == [
        (1, 2, "before"),
        (1, 3, "before"),
        (1, 4, "frozen"),
        (2, 0, "before"),
        (2, 1, "before"),
        (2, 2, "outside"),
        (3, 1, "before"),
        (3, 2, "before"),  # the non-finite frame itself is not picked
    ]
    assert (report.trajectories, report.frozen, report.outside, report.nonfinite) == (4, 1, 1, 1)
    assert report.reasons[1] == "frozen" and "H-O pair at 0.50" in report.reasons[2]
    assert report.reasons[3] == "non-finite positions" and 0 not in report.reasons
    for f in report.frames:  # the geometry and where it came from, no student results
        src = at[(f.info["replica"], int(f.info["time_fs"] // 2))]
        np.testing.assert_array_equal(f.positions, src.positions)
        np.testing.assert_array_equal(f.numbers, src.numbers)
        assert f.calc is None and "frozen" not in f.info


def test_harvest_options():
    frames = _trajectories()
    # Without an envelope only the frozen and the non-finite trajectories count.
    report = harvest(frames, before=1)
    assert [(f.info["replica"], f.info["harvest"]) for f in report.frames] == [
        (1, "before"),
        (1, "frozen"),
        (3, "before"),
    ]
    assert report.outside == 0
    report = harvest(frames, before=0, envelope=_envelope())
    assert [f.info["harvest"] for f in report.frames] == ["frozen", "outside"]
    with pytest.raises(ValueError, match="before must be >= 0"):
        harvest(frames, before=-1)
    # A file without replica numbers is one trajectory: its first bad frame ends it.
    single = [f for f in frames if f.info["replica"] == 2]
    for f in single:
        del f.info["replica"]
    report = harvest(single, before=5, envelope=_envelope())
    assert [f.info["harvest"] for f in report.frames] == ["before", "before", "outside"] and report.trajectories == 1
    # A frozen replica's frame written before the freeze was noticed has the frozen geometry: not picked twice.
    twin = [f.copy() for f in _trajectories() if f.info["replica"] == 1]
    twin[3].positions = twin[4].positions
    assert [f.info["harvest"] for f in harvest(twin, before=2).frames] == ["before", "frozen"]


def test_harvest_takes_the_first_frame_the_students_disagree_on():
    """``disagreement`` (one dict per frame, None where not checked) picks the first flagged frame of a trajectory
    that nothing before it picked; frozen and outside come first; a list of the wrong length is refused."""
    frames = _trajectories()
    rows = [
        None if not np.isfinite(f.positions).all() else {"flagged": False, "force_disagreement_mev_a": 10.0}
        for f in frames
    ]
    at = {(f.info["replica"], int(f.info["time_fs"] // 2)): k for k, f in enumerate(frames)}
    rows[at[(0, 3)]] = {"flagged": True, "force_disagreement_mev_a": 432.0}
    rows[at[(1, 1)]] = {"flagged": True, "force_disagreement_mev_a": 80.0}  # before replica 1's freeze: first
    rows[at[(2, 4)]] = {"flagged": True, "force_disagreement_mev_a": 80.0}  # after replica 2's outside frame
    report = harvest(frames, before=1, envelope=_envelope(), disagreement=rows)
    picked = [(f.info["replica"], int(f.info["time_fs"] // 2), f.info["harvest"]) for f in report.frames]
    assert picked == [
        (0, 2, "before"),
        (0, 3, "disagree"),
        (1, 0, "before"),
        (1, 1, "disagree"),
        (2, 1, "before"),
        (2, 2, "outside"),
        (3, 2, "before"),
    ]
    assert (report.frozen, report.outside, report.disagree, report.nonfinite) == (0, 1, 2, 1)
    assert report.reasons[0] == "the students' forces differ by 432 meV/Å"
    with pytest.raises(ValueError, match="disagreement has 3 entries for 24 frames"):
        harvest(frames, disagreement=rows[:3])


def test_harvest_command_with_a_committee(tmp_path, capsys):
    """``--committee``: the two shipped students differ by hundreds of meV/Å on 1,4-benzenediamine (not in their
    data) and little on ethanol (in it): the first benzenediamine frame is picked, nothing of ethanol."""
    rng = np.random.default_rng(3)
    frames = []
    for t in range(3):
        for r, name in enumerate(("CH3CH2OH", "BDA")):
            a = molecule(name)
            a.positions += rng.normal(0.0, 0.01, a.positions.shape)
            a.info.update(time_fs=1.0 * t, replica=r)
            frames.append(a)
    src, out = tmp_path / "md.extxyz", tmp_path / "picked.extxyz"
    ase.io.write(src, frames)
    args = ["harvest", "--input", str(src), "--output", str(out), "--device", "cpu"]
    assert main([*args, "--committee", "builtin:chno-gfn2,builtin:chno-gfn2-small"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["disagree"], summary["frames_written"]) == (1, 1) and "differ by" in summary["examples"]["1"]
    picked = ase.io.read(out, index=":")
    assert [(f.info["replica"], f.info["time_fs"], f.info["harvest"]) for f in picked] == [(1, 0.0, "disagree")]
    assert main([*args, "--committee", "builtin:chno-gfn2"]) == 2
    assert "at least two students" in capsys.readouterr().err


def test_label_as_given_labels_exactly_the_structures_given(tmp_path):
    """``label_seeds`` with no MD and no rattles: one frame per seed, the seed's own geometry with the teacher's
    numbers; a frame the teacher finds unphysical is dropped; a second run resumes and adds nothing."""
    seeds = emt_seeds()
    squeezed = molecule("H2O")
    squeezed.positions[1] = squeezed.positions[0] + [0.3, 0.0, 0.0]  # closer than MIN_PAIR_DISTANCE
    config = SamplingConfig(label_seeds=True, md_steps=0, rattle_per_seed=0)
    assert [t.key for t in make_tasks([*seeds, squeezed], config)] == [f"given/s{s:04d}" for s in range(4)]
    with_md = SamplingConfig(label_seeds=True, md_steps=8, sample_every=4, temperatures=[300.0], rattle_per_seed=1)
    assert [t.kind for t in make_tasks(seeds[:1], with_md)] == ["given", "md", "rattle"]
    assert [t.kind for t in make_tasks(seeds[:1], with_md, on_policy_round=1)] == ["onpolicy"]
    report = label([*seeds, squeezed], "emt", tmp_path, config, progress=False)
    frames = read_frames(tmp_path)
    assert report.written == 3 and len(frames) == 3
    for seed, frame in zip(seeds, frames, strict=True):
        np.testing.assert_array_equal(frame.positions, seed.positions)
        ref = seed.copy()
        ref.calc = EMT()
        assert frame.get_potential_energy() == pytest.approx(ref.get_potential_energy(), abs=1e-10)
        np.testing.assert_allclose(frame.get_forces(), ref.get_forces(), atol=1e-10)
        assert frame.info["kind"] == "given"
    assert label([*seeds, squeezed], "emt", tmp_path, config, progress=False).written == 0


def test_a_directory_labelled_before_label_seeds_existed_still_resumes(tmp_path):
    """The run's recorded settings leave label_seeds out at its default: an older directory, whose record has no
    such key, resumes; asking it for the seeds as given is a different run, refused by name."""
    import json

    config = SamplingConfig(md_steps=8, sample_every=4, temperatures=[300.0])
    label(emt_seeds()[:1], "emt", tmp_path, config, progress=False)
    record = json.loads((tmp_path / "label_config.json").read_text())
    assert "label_seeds" not in record["sampling"]
    assert label(emt_seeds()[:1], "emt", tmp_path, config, progress=False).written == 0
    with pytest.raises(ValueError, match=r"different \['sampling'\]"):
        label(emt_seeds()[:1], "emt", tmp_path, SamplingConfig(**{**vars(config), "label_seeds": True}), progress=False)


def test_a_given_structure_the_teacher_cannot_do_is_skipped_and_counted():
    """tblite raises ASE's CalculationFailed when its SCF does not converge (hot, broken geometries): that structure
    is skipped and counted; a labelling run of many picked frames goes on."""
    from ase.calculators.calculator import CalculationFailed

    from mlff_distiller.distill.sampling import run_task

    class Picky(EMT):
        def calculate(self, atoms=None, *args, **kwargs):
            if len(atoms) == 3:
                raise CalculationFailed("SCF did not converge")
            super().calculate(atoms, *args, **kwargs)

    config = SamplingConfig(label_seeds=True, md_steps=0, rattle_per_seed=0)
    seeds = emt_seeds()  # H2O (3 atoms), CH4, NH3
    stats = {}
    done = [list(run_task(t, seeds[t.seed_index], Picky(), config, stats=stats)) for t in make_tasks(seeds, config)]
    assert [len(d) for d in done] == [0, 1, 1] and stats == {"failed": 1}
    with pytest.raises(CalculationFailed):  # elsewhere (teacher MD) a failure still stops the run
        md = SamplingConfig(md_steps=4, sample_every=2, temperatures=[300.0])
        list(run_task(make_tasks(seeds[:1], md)[0], seeds[0], Picky(), md))


def test_the_loop_from_the_command_line(tmp_path, capsys, emt_labels, monkeypatch):
    """md with --freeze-force -> harvest -> label --as-given -> train on both label sets from the student. The md
    frames, frozen ones included, all take the fast writer."""
    import mlff_distiller._extxyz_fast as fast

    declined, real = [], fast.format_md_frame
    monkeypatch.setattr(fast, "format_md_frame", lambda *a: declined.append(1) if (t := real(*a)) is None else t)
    start = tmp_path / "start.xyz"
    squeezed = molecule("H2O")
    squeezed.positions[1] = squeezed.positions[0] + [0.0, 0.0, 0.6]  # an O-H pair deep in the student's wall
    ase.io.write(start, [molecule("CH4"), squeezed])
    hot = tmp_path / "hot.extxyz"
    model = "builtin:chno-gfn2"
    md = ["md", "--model", model, "--input", f"{start}@:", "--replicas", "2", "--steps", "6", "--interval", "2"]
    md += ["--freeze-force", "50", "--device", "cpu", "--output", str(hot)]
    assert main(md) == 0
    assert json.loads(capsys.readouterr().out)["frozen"] == [2, 3]  # the squeezed water's two replicas
    assert not declined
    picked = tmp_path / "picked.extxyz"
    assert main(["harvest", "--input", str(hot), "--output", str(picked), "--model", model]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["trajectories"], summary["frozen"], summary["outside"]) == (4, 2, 0)
    frames = ase.io.read(picked, index=":")
    assert [(f.info["replica"], f.info["harvest"]) for f in frames] == [(2, "frozen"), (3, "frozen")]
    np.testing.assert_allclose(frames[0].positions, squeezed.positions, atol=1e-6)
    new = tmp_path / "round1"
    args = ["label", "--teacher", "emt", "--seeds", str(picked), "--as-given", "--out", str(new), "--no-progress"]
    assert main([*args, "--set", "sampling.max_force=1e4"]) == 0
    assert json.loads(capsys.readouterr().out)["written"] == 2
    assert main([*args, "--on-policy-round", "1", "--student", model]) == 2
    assert "--as-given labels the seed structures as they are" in capsys.readouterr().err
    run = tmp_path / "run"
    train = ["train", "--data", str(emt_labels), "--data", str(new), "--init-model", model, "--out", str(run)]
    for s in ("train.max_steps=2", "train.device=cpu", "train.refit_energy_reference=true", "val_fraction=0.3"):
        train += ["--set", s]
    assert main(train) == 0
    capsys.readouterr()
    meta = load_model(run / "best.pt").metadata
    assert meta["data"] == f"{emt_labels}, {new}"
    assert meta["train_frames"] + _val_frames(emt_labels, new) == len(read_frames(emt_labels)) + 2


def _val_frames(*sources) -> int:
    from mlff_distiller.cli_distill import _read_labelled
    from mlff_distiller.distill import split_frames

    return len(split_frames(_read_labelled([str(s) for s in sources]), 0.3, seed=0)[1])


def test_several_label_sources_keep_their_tasks_apart(emt_labels, tmp_path):
    """Two sources with the same task names (two label runs of the same seeds) stay separate groups in the split."""
    from mlff_distiller.cli_distill import _read_labelled

    one = read_frames(emt_labels)
    both = _read_labelled([str(emt_labels), str(emt_labels)])
    assert len(both) == 2 * len(one)
    tasks = {f.info["task"] for f in one}
    assert {f.info["task"] for f in both} == {f"{k}:{t}" for k in (0, 1) for t in tasks}
    assert (
        len(_read_labelled(str(emt_labels))) == len(one) and _read_labelled([str(emt_labels)])[0].info["task"] in tasks
    )
    with pytest.raises(ValueError, match="no labelled data"):
        _read_labelled([])


def test_harvest_command_errors(tmp_path, capsys):
    src = tmp_path / "t.extxyz"
    ase.io.write(src, [Atoms("H2", positions=[(0, 0, 0), (0, 0, 0.74)])])
    assert main(["harvest", "--input", str(src), "--output", str(src)]) == 2
    assert "is the input file" in capsys.readouterr().err
    assert main(["harvest", "--input", str(tmp_path / "none.extxyz")]) == 2
    assert "input file not found" in capsys.readouterr().err
    assert main(["harvest", "--input", str(src), "--output", str(tmp_path / "o.extxyz"), "--before", "-2"]) == 2
    assert "before must be >= 0" in capsys.readouterr().err


_CRASHY = '''
import os
from ase.calculators.emt import EMT
from mlff_distiller.distill import teachers


class Crashy(EMT):
    """EMT that takes its process down (no Python exception) on a 3-atom structure, as tblite's Fortran runtime
    does on rare geometries."""

    def calculate(self, atoms=None, *args, **kwargs):
        if len(atoms) == 3:
            os._exit(3)
        super().calculate(atoms, *args, **kwargs)


teachers.TEACHERS["crashy-emt"] = lambda **kw: Crashy(**kw)
teachers.TEACHERS["dead-emt"] = lambda **kw: os._exit(4)  # dies as it is built, before any task runs
'''


def test_a_structure_that_kills_the_teacher_process_is_given_up_and_the_rest_labelled(tmp_path, monkeypatch, capfd):
    """label_parallel: a worker that dies inside a task is started again on its shard (the other shards undisturbed);
    after MAX_ATTEMPTS deaths the task is given up and counted as failed, and every other structure is labelled.
    The teacher's process death is simulated by os._exit in a preset registered at interpreter start-up
    (sitecustomize, so that the spawned workers have it)."""
    from mlff_distiller.distill import label_parallel
    from mlff_distiller.distill.labelling import MAX_ATTEMPTS

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_CRASHY)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])]))
    seeds = [*emt_seeds(), molecule("CH3OH"), molecule("H2O2")]  # H2O (3 atoms) is seed 0: shard 0 of 2
    config = SamplingConfig(label_seeds=True, md_steps=0, rattle_per_seed=0)
    report = label_parallel(seeds, "crashy-emt", tmp_path / "out", config, workers=2)
    frames = read_frames(tmp_path / "out")
    assert sorted(len(f) for f in frames) == sorted(len(s) for s in seeds[1:])  # all but the water
    assert report.written == 4 and report.failed == 1 and report.tasks_run == 4  # (the dead processes report none)
    assert report.total == 4
    assert capfd.readouterr().err.count("shard 0 died inside a task (exit code 3); resuming") == MAX_ATTEMPTS
    progress = json.loads((tmp_path / "out" / "shard-00-of-02" / "progress.json").read_text())
    assert progress["given_up"] == ["given/s0000"]
    # Resumed: nothing to do, nothing tried again.
    again = label_parallel(seeds, "crashy-emt", tmp_path / "out", config, workers=2)
    assert (again.written, again.tasks_run, again.failed) == (0, 0, 0) and again.tasks_skipped == 5


def test_the_label_command_in_one_process_gets_past_a_teacher_abort(tmp_path, monkeypatch, capfd):
    """``mlff-distill label`` without ``--workers`` runs in a watched process of its own (label_watched): the same
    directory layout as before, and an aborting teacher is given up after MAX_ATTEMPTS deaths, the rest labelled."""
    from mlff_distiller.distill.labelling import MAX_ATTEMPTS

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_CRASHY)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])]))
    seeds = tmp_path / "seeds.extxyz"
    ase.io.write(seeds, [*emt_seeds(), molecule("CH3OH")])
    out = tmp_path / "labels"
    args = ["label", "--teacher", "crashy-emt", "--seeds", str(seeds), "--as-given", "--out", str(out), "--no-progress"]
    assert main(args) == 0
    captured = capfd.readouterr()
    report = json.loads(captured.out)
    assert (report["written"], report["failed"], report["total"]) == (3, 1, 3)
    assert captured.err.count("the labelling process died inside a task") == MAX_ATTEMPTS
    assert (out / "frames.db").exists() and not list(out.glob("shard-*"))
    assert main([*args, "--set", "sampling.max_force=9"]) == 2  # an error in the process comes back as itself
    assert "the labelling process: " in capfd.readouterr().err


def test_a_process_that_dies_outside_any_task_is_not_started_again(tmp_path, monkeypatch):
    """A process that dies without starting a task (here: while its teacher is built, after an earlier death inside
    a task left attempts.json non-empty) would die the same way again: an error naming it, not an endless restart."""
    from mlff_distiller.distill import label_watched
    from mlff_distiller.distill.labelling import ATTEMPTS_NAME

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_CRASHY)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])]))
    out = tmp_path / "out"
    out.mkdir()
    (out / ATTEMPTS_NAME).write_text(json.dumps({"given/s0000": 1}))
    config = SamplingConfig(label_seeds=True, md_steps=0, rattle_per_seed=0)
    with pytest.raises(RuntimeError, match=r"died outside any task: the labelling process \(exit code 4\)"):
        label_watched(emt_seeds(), "dead-emt", out, config, progress=False)


def test_a_shard_error_is_raised_again_in_the_caller(tmp_path):
    """An exception inside a shard's process (here: resuming a directory whose shard 1 was labelled with other
    settings) comes back as itself, naming the shard, after the other shards are done; not as a dead process."""
    from mlff_distiller.distill import label_parallel

    config = SamplingConfig(label_seeds=True, md_steps=0, rattle_per_seed=0)
    label_parallel(emt_seeds(), "emt", tmp_path, config, workers=2)
    record = tmp_path / "shard-01-of-02" / "label_config.json"
    record.write_text(record.read_text().replace('"max_force": 50.0', '"max_force": 9.0'))
    with pytest.raises(ValueError, match=r"shard 1: .*shard-01-of-02 holds a labelling run with a different"):
        label_parallel(emt_seeds(), "emt", tmp_path, config, workers=2)


def test_attempts_are_counted_only_for_deaths(tmp_path):
    """A task started MAX_ATTEMPTS times without finishing (attempts.json) is given up without calling the teacher;
    an interrupt or a Python exception inside a task leaves no attempt behind."""
    from mlff_distiller.distill.labelling import ATTEMPTS_NAME, MAX_ATTEMPTS

    config = SamplingConfig(label_seeds=True, md_steps=0, rattle_per_seed=0)
    seeds = emt_seeds()

    class Raising(EMT):
        def __init__(self, exc):
            super().__init__()
            self.exc = exc

        def calculate(self, atoms=None, *args, **kwargs):
            if len(atoms) == 5:
                raise self.exc
            super().calculate(atoms, *args, **kwargs)

    for exc in (KeyboardInterrupt(), RuntimeError("boom")):
        out = tmp_path / type(exc).__name__
        with pytest.raises(type(exc)):
            label(seeds, Raising(exc), out, config, progress=False)
        assert json.loads((out / ATTEMPTS_NAME).read_text()) == {}
        assert len(read_frames(out)) == 1  # the water, before the methane
    out = tmp_path / "given_up"
    label(seeds[:1], "emt", out, SamplingConfig(md_steps=8, sample_every=4, temperatures=[300.0]), progress=False)
    (out / ATTEMPTS_NAME).write_text(json.dumps({"md/s0000/T300/r0": MAX_ATTEMPTS - 1}))
    (out / "progress.json").write_text(json.dumps({"done": []}))  # an earlier version's record, a task unfinished
    again = label(
        seeds[:1], "emt", out, SamplingConfig(md_steps=8, sample_every=4, temperatures=[300.0]), progress=False
    )
    assert (again.tasks_run, again.failed, again.written) == (1, 0, 0)  # one more try: it finishes (frames kept)
    (out / ATTEMPTS_NAME).write_text(json.dumps({"md/s0000/T300/r0": MAX_ATTEMPTS}))
    (out / "progress.json").write_text(json.dumps({"done": []}))
    again = label(
        seeds[:1], "emt", out, SamplingConfig(md_steps=8, sample_every=4, temperatures=[300.0]), progress=False
    )
    assert (again.tasks_run, again.failed) == (0, 1)
    assert json.loads((out / ATTEMPTS_NAME).read_text()) == {}
    assert json.loads((out / "progress.json").read_text())["given_up"] == ["md/s0000/T300/r0"]
