"""Teachers, sampling, labelling to disk and its SIGKILL-safe resume."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import ase.io
import numpy as np
import pytest
import torch
from ase.build import molecule
from ase.calculators.emt import EMT
from distill_helpers import emt_seeds, small_sampling

from mlff_distiller.distill import (
    Deduplicator,
    FrameStore,
    MissingExtraError,
    SamplingConfig,
    get_teacher,
    label,
    label_parallel,
    make_tasks,
    read_frames,
    run_task,
)


def test_get_teacher_presets_and_errors():
    assert isinstance(get_teacher("emt"), EMT)
    calc = EMT()
    assert get_teacher(calc) is calc
    with pytest.raises(ValueError, match="unknown teacher 'dft'"):
        get_teacher("dft")
    with pytest.raises(ValueError, match="ASE Calculator"):
        get_teacher(42)


def test_missing_extra_names_the_pip_extra():
    try:
        import sevenn  # noqa: F401
    except ImportError:
        with pytest.raises(MissingExtraError, match=r"mlff-distiller\[sevennet\]"):
            get_teacher("sevennet-0")
    else:
        pytest.skip("sevenn is installed")


def test_gfn2_teacher_labels_water():
    pytest.importorskip("tblite")
    atoms = molecule("H2O")
    atoms.calc = get_teacher("gfn2-xtb")
    f = atoms.get_forces()
    assert f.shape == (3, 3) and np.isfinite(f).all()
    assert abs(f.sum(0)).max() < 1e-6  # no net force on an isolated molecule


def test_gfn2_labelling_gives_back_the_torch_thread_count(tmp_path):
    """The GFN2-xTB preset runs tblite on one OpenMP thread, which torch's CPU ops share: a training after the
    labelling in the same process must not be left on one thread."""
    pytest.importorskip("tblite")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        label(
            [molecule("H2O")],
            "gfn2-xtb",
            tmp_path / "x",
            small_sampling(temperatures=[300.0], md_steps=8),
            progress=False,
        )
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_sampling_config_rejects_bad_values():
    with pytest.raises(ValueError, match="temperatures"):
        SamplingConfig(temperatures=[300, -5])
    with pytest.raises(ValueError, match="sample_every"):
        SamplingConfig(sample_every=0)
    with pytest.raises(ValueError, match="dedup_rms"):
        SamplingConfig(dedup_rms=-1)


def test_tasks_are_deterministic_and_labelled():
    cfg = small_sampling(md_steps=20, hvp=True)
    seeds = emt_seeds()
    tasks = make_tasks(seeds, cfg)
    assert len(tasks) == len(seeds) * (2 + 4)  # two temperatures + four rattles per seed
    assert len({t.key for t in tasks}) == len(tasks)
    task = tasks[1]
    a = list(run_task(task, seeds[task.seed_index], EMT(), cfg))
    b = list(run_task(task, seeds[task.seed_index], EMT(), cfg))
    assert [k for k, _ in a] == list(range(5))
    for (_, x), (_, y) in zip(a, b, strict=True):
        np.testing.assert_array_equal(x.positions, y.positions)
        np.testing.assert_array_equal(x.get_forces(), y.get_forces())
    # The teacher label equals a fresh teacher evaluation of the frame.
    frame = a[-1][1]
    fresh = frame.copy()
    fresh.calc = EMT()
    np.testing.assert_allclose(frame.get_forces(), fresh.get_forces(), atol=1e-12)
    np.testing.assert_allclose(frame.get_potential_energy(), fresh.get_potential_energy(), atol=1e-12)
    # H·v by central differences agrees with a smaller step (the O(ε²) error is small).
    v, hv = frame.arrays["hvp_dir"], frame.arrays["hvp"]
    assert abs(np.linalg.norm(v) - 1) < 1e-12
    eps = 1e-3
    plus, minus = frame.copy(), frame.copy()
    plus.positions += eps * v
    minus.positions -= eps * v
    plus.calc, minus.calc = EMT(), EMT()
    np.testing.assert_allclose(hv, -(plus.get_forces() - minus.get_forces()) / (2 * eps), atol=2e-3 * np.abs(hv).max())


def test_deduplicator_drops_near_copies_only():
    a = molecule("CH4")
    d = Deduplicator(0.01)
    assert not d.is_duplicate(a)
    d.add(a)
    moved = a.copy()
    moved.rotate(40, "z")
    moved.translate([1.0, 2.0, 3.0])
    assert d.is_duplicate(moved)  # same geometry, rotated and translated
    other = a.copy()
    other.rattle(0.1, seed=3)
    assert not d.is_duplicate(other)
    with pytest.raises(ValueError):
        Deduplicator(-1)


def test_label_writes_db_and_extxyz_and_resumes_as_noop(tmp_path):
    cfg = small_sampling(md_steps=20, dedup_rms=0.0)
    report = label(emt_seeds()[:2], "emt", tmp_path, cfg, progress=False)
    assert report.written == report.total == 2 * (2 * 5 + 4)
    db_frames = read_frames(tmp_path)
    xyz_frames = ase.io.read(tmp_path / "frames.extxyz", index=":")
    assert len(db_frames) == len(xyz_frames) == report.total
    for a, b in zip(db_frames, xyz_frames, strict=True):
        np.testing.assert_allclose(a.positions, b.positions, atol=1e-7)
        np.testing.assert_allclose(a.get_forces(), b.get_forces(), atol=1e-7)
        assert a.info["task"] == b.info["task"]
    again = label(emt_seeds()[:2], "emt", tmp_path, cfg, progress=False)
    assert again.written == 0 and again.tasks_run == 0 and again.total == report.total


def test_finished_run_resumes_without_building_the_teacher(tmp_path, monkeypatch):
    """Labels carried to a machine without the teacher's package (the GPU host has no tblite) still resume."""
    cfg = small_sampling(md_steps=20, dedup_rms=0.0)
    report = label(emt_seeds()[:1], "emt", tmp_path, cfg, progress=False)
    import mlff_distiller.distill.labelling as labelling

    def unavailable(*args, **kwargs):
        raise MissingExtraError("the teacher's package is not installed here")

    monkeypatch.setattr(labelling, "get_teacher", unavailable)
    again = label(emt_seeds()[:1], "emt", tmp_path, cfg, progress=False)
    assert again.tasks_run == 0 and again.total == report.total
    # A task left to run still needs the teacher, and says so.
    with pytest.raises(MissingExtraError, match="not installed"):
        label(emt_seeds()[:2], "emt", tmp_path / "more", cfg, progress=False)
    with pytest.raises(ValueError, match="different"):
        label(emt_seeds()[:2], "emt", tmp_path, small_sampling(md_steps=40), progress=False)


def test_label_rejects_bad_seeds(tmp_path):
    with pytest.raises(ValueError, match="at least one seed"):
        label([], "emt", tmp_path / "a", progress=False)
    with pytest.raises(ValueError, match="seed 0"):
        label(["H2O"], "emt", tmp_path / "b", progress=False)


def test_read_frames_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_frames(tmp_path / "missing")
    with pytest.raises(ValueError, match="label output"):
        read_frames(tmp_path)
    bare = tmp_path / "bare.xyz"
    ase.io.write(bare, molecule("H2O"))
    with pytest.raises(ValueError, match="no energy and forces"):
        read_frames(bare)


_CHILD = textwrap.dedent(
    """
    import sys, time
    from ase.build import molecule
    from ase.calculators.emt import EMT
    from mlff_distiller.distill import SamplingConfig, label

    class SlowEMT(EMT):
        # Slow enough that the parent can kill the run in the middle of a task.
        def calculate(self, *args, **kwargs):
            time.sleep(0.002)
            super().calculate(*args, **kwargs)

    seeds = [molecule("H2O"), molecule("CH4"), molecule("NH3")]
    cfg = SamplingConfig(temperatures=[300, 500], md_steps=120, sample_every=4, rattle_per_seed=3, dedup_rms=0.02)
    label(seeds, SlowEMT(), sys.argv[1], cfg, progress=False)
    """
)


# How long a child labelling run may take: it finishes in a few seconds. Earlier waits of 30, 120 and 400 s that
# "timed out on a loaded machine" were a hang: a kill inside an ASE write left its lock file behind (see
# test_resume_is_not_stopped_by_a_lock_file_left_by_a_kill). The generous wait stays for loaded CI machines.
_CHILD_WAIT = 400


def _run_child(script, out, env):
    return subprocess.Popen([sys.executable, str(script), str(out)], env=env)


def test_sigkill_resume_loses_and_duplicates_nothing(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ref, killed = tmp_path / "ref", tmp_path / "killed"
    assert _run_child(script, ref, env).wait(timeout=_CHILD_WAIT) == 0
    expected = [(a.info["task"], a.info["frame"], a.positions.copy()) for a in read_frames(ref)]
    assert len(expected) > 60

    kills = 0
    for target in (15, 70):  # kill twice: early in the run, then again after the first resume
        proc = _run_child(script, killed, env)
        deadline = time.time() + 60
        while time.time() < deadline and proc.poll() is None:
            if (killed / "frames.db").exists() and len(FrameStore(killed)) >= target:
                proc.send_signal(signal.SIGKILL)
                kills += 1
                break
            time.sleep(0.02)
        # Unkilled (a slow machine did not reach the target in time), the child runs to its end.
        proc.wait(timeout=_CHILD_WAIT)
    assert kills >= 1
    partial = len(FrameStore(killed))
    assert 0 < partial < len(expected)
    assert _run_child(script, killed, env).wait(timeout=_CHILD_WAIT) == 0

    got = read_frames(killed)
    keys = [(a.info["task"], a.info["frame"]) for a in got]
    assert len(keys) == len(set(keys)), "duplicated frames after resume"
    assert sorted(keys) == sorted((t, f) for t, f, _ in expected), "lost or extra frames after resume"
    ref_pos = {(t, f): p for t, f, p in expected}
    for a in got:
        np.testing.assert_array_equal(a.positions, ref_pos[(a.info["task"], a.info["frame"])])
    xyz = ase.io.read(killed / "frames.extxyz", index=":")
    assert sorted((a.info["task"], int(a.info["frame"])) for a in xyz) == sorted(keys)
    progress = json.loads((killed / "progress.json").read_text())
    assert len(progress["done"]) == 3 * (2 + 3)


def test_resume_is_not_stopped_by_a_lock_file_left_by_a_kill(tmp_path):
    """A SIGKILL inside an ASE database write leaves ``frames.db.lock`` (an O_EXCL file that ASE waits on forever):
    the resume hung until CI's 400 s wait ran out. The store does not use ASE's lock file, so a leftover one is
    ignored and the run finishes. Run in a child so that a regression fails in 120 s instead of hanging."""
    out = tmp_path / "labels"
    script = tmp_path / "child.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys
            from ase.build import molecule
            from mlff_distiller.distill import SamplingConfig, label
            cfg = SamplingConfig(temperatures=[300], md_steps=8, sample_every=4, rattle_per_seed=1, dedup_rms=0.0)
            label([molecule("H2O")], "emt", sys.argv[1], cfg, progress=False)
            """
        )
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    assert subprocess.run([sys.executable, str(script), str(out)], env=env, timeout=_CHILD_WAIT).returncode == 0
    n = len(FrameStore(out))
    progress = out / "progress.json"
    progress.write_text(json.dumps({"done": []}))  # as if killed before any task was marked done
    with FrameStore(out).db as db:  # drop one frame, so the resume must write
        db.delete([max(row.id for row in db.select())])
    (out / "frames.db.lock").write_text("")  # what a kill inside ``db.write`` leaves behind
    assert subprocess.run([sys.executable, str(script), str(out)], env=env, timeout=120).returncode == 0
    assert len(FrameStore(out)) == n
    assert json.loads(progress.read_text())["done"]


def test_store_survives_a_kill_during_database_initialisation(tmp_path):
    """ASE commits each CREATE TABLE on its own: a SIGKILL before the version row leaves a file ASE cannot open.
    The store initialises new databases atomically and replaces such a frame-less leftover; frames are kept."""
    import sqlite3

    from mlff_distiller.distill.labelling import DB_NAME, FrameStore

    out = tmp_path / "labels"
    out.mkdir()
    con = sqlite3.connect(out / DB_NAME)  # the state a kill mid-initialisation leaves behind
    con.execute("CREATE TABLE systems (id INTEGER PRIMARY KEY AUTOINCREMENT, unique_id TEXT UNIQUE)")
    con.execute("CREATE TABLE information (name TEXT, value TEXT)")
    con.commit()
    con.close()
    store = FrameStore(out)
    assert len(store) == 0
    atoms = molecule("H2O")
    atoms.calc = EMT()
    atoms.get_forces()
    store.write(atoms, task="t", frame=0, kind="md", temperature=300.0)
    again = FrameStore(out)  # a healthy database with a frame is opened as is
    assert len(again) == 1 and again.keys() == {("t", 0)}
    assert not (out / (DB_NAME + ".init")).exists()


def test_label_parallel_equals_one_process_and_resumes_with_the_same_worker_count(tmp_path):
    """Shards together hold exactly the frames of one unsharded run; a rerun labels nothing; resuming with
    another worker count is refused (its shards would duplicate every task)."""
    cfg = small_sampling(md_steps=12, rattle_per_seed=1)
    one = label(emt_seeds(), "emt", tmp_path / "one", cfg, progress=False)
    two = label_parallel(emt_seeds(), "emt", tmp_path / "two", cfg, workers=2)
    assert two.written == two.total == one.total > 0
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == ["shard-00-of-02", "shard-01-of-02"]

    def key(a):
        return (a.info["task"], round(float(a.get_potential_energy()), 8))

    a, b = read_frames(tmp_path / "one"), read_frames(tmp_path / "two")
    assert sorted(map(key, a)) == sorted(map(key, b))
    again = label_parallel(emt_seeds(), "emt", tmp_path / "two", cfg, workers=2)
    assert again.written == 0 and again.tasks_run == 0 and again.total == one.total
    with pytest.raises(ValueError, match="sharded over 2 workers; resume with workers=2"):
        label_parallel(emt_seeds(), "emt", tmp_path / "two", cfg, workers=3)


def test_on_policy_round_labels_only_where_the_committee_disagrees(tmp_path):
    """Query by committee: the same student-driven trajectories, but the teacher labels only the frames where the
    two shipped students' forces differ by more than select_disagreement (here: the molecule outside their
    training set, not the one inside it)."""
    from dataclasses import replace

    from mlff_distiller import StudentCalculator, load_model

    class CountingTeacher(StudentCalculator):  # a teacher whose calls are counted (any ASE calculator will do)
        calls = 0

        def calculate(self, *args, **kwargs):
            type(self).calls += 1
            super().calculate(*args, **kwargs)

    small = StudentCalculator(load_model("builtin:chno-gfn2-small"), device="cpu", precision="fp64")
    big = StudentCalculator(load_model("builtin:chno-gfn2"), device="cpu", precision="fp64")
    teacher = CountingTeacher(load_model("builtin:chno-gfn2"), device="cpu", precision="fp64")
    seeds = [molecule("CH3CH2OH"), molecule("BDA")]  # inside and outside the students' training set
    cfg = small_sampling(temperatures=[300.0], md_steps=24, sample_every=4, rattle_per_seed=0)
    kw = dict(student=small, on_policy_round=1, progress=False)
    every = label(seeds, teacher, tmp_path / "all", cfg, **kw)
    assert every.written == 12 and every.not_selected == 0 and CountingTeacher.calls == 12
    CountingTeacher.calls = 0
    chosen = label(seeds, teacher, tmp_path / "sel", replace(cfg, select_disagreement=50.0), committee=big, **kw)
    assert chosen.written + chosen.not_selected == every.written  # the same visited frames, labelled or not
    assert chosen.written == CountingTeacher.calls == 6 and chosen.not_selected == 6
    frames = read_frames(tmp_path / "sel")
    assert all(len(a) == 16 for a in frames)  # BDA's frames only
    with pytest.raises(ValueError, match="committee"):
        label(seeds, teacher, tmp_path / "x", replace(cfg, select_disagreement=50.0), **kw)
    with pytest.raises(ValueError, match="select_disagreement"):
        replace(cfg, select_disagreement=-1.0)


def test_seed_specs():
    """``molecule:`` lists (the prefix may repeat, spaces around names are dropped); unknown names and empty lists
    are errors that name them."""
    from mlff_distiller.distill.seeds import load_seeds

    for spec in ("molecule:H2O,CH4", "molecule:H2O,molecule:CH4", "molecule: H2O , CH4"):
        assert [a.info["name"] for a in load_seeds(spec)] == ["H2O", "CH4"], spec
    with pytest.raises(ValueError, match="unknown molecule 'XY'"):
        load_seeds("molecule:H2O,XY")
    with pytest.raises(ValueError, match="no molecule names"):
        load_seeds("molecule:")


def test_progress_journal_survives_a_kill_and_folds_in(tmp_path):
    """progress.log, the per-task journal: what a run marked before it died (no compaction) is done for the next
    reader, a line cut by the kill is ignored, given-up tasks stay given up, and compaction writes progress.json and
    removes the journal."""
    from mlff_distiller.distill.labelling import PROGRESS_LOG_NAME, PROGRESS_NAME, _ProgressRecord

    (tmp_path / PROGRESS_NAME).write_text(json.dumps({"done": ["a"], "given_up": []}))
    first = _ProgressRecord(tmp_path)
    first.mark("b")
    first.mark("c", given_up=True)
    with open(tmp_path / PROGRESS_LOG_NAME, "a") as log:  # the kill: no compaction, a half-written last line
        log.write('{"done": "d", "giv')
    again = _ProgressRecord(tmp_path)
    assert again.done == {"a", "b", "c"} and again.given_up == {"c"}
    again.compact()
    assert not (tmp_path / PROGRESS_LOG_NAME).exists()
    assert json.loads((tmp_path / PROGRESS_NAME).read_text()) == {"done": ["a", "b", "c"], "given_up": ["c"]}
    assert _ProgressRecord(tmp_path).done == {"a", "b", "c"}


def test_progress_record_is_written_twice_per_run_not_per_task(tmp_path, monkeypatch):
    """Rewriting the sorted record after every task cost time quadratic in the tasks; a run now writes
    progress.json at its start and end only (each task one journal line), and the record holds every task."""
    from mlff_distiller.distill import frame_store as labelling  # the record and its file names live there

    writes = []
    real = labelling._atomic_write_text
    monkeypatch.setattr(labelling, "_atomic_write_text", lambda p, t: (writes.append(p.name), real(p, t))[1])
    seeds = [molecule(name) for name in ("H2O", "NH3", "CH4", "H2", "CO", "N2")]
    cfg = SamplingConfig(label_seeds=True, md_steps=0, rattle_per_seed=0)
    report = label(seeds, "emt", tmp_path, cfg, progress=False)
    assert report.written == 6
    assert writes.count(labelling.PROGRESS_NAME) == 2
    done = json.loads((tmp_path / labelling.PROGRESS_NAME).read_text())["done"]
    assert done == sorted(f"given/s{k:04d}" for k in range(6))
    assert not (tmp_path / labelling.PROGRESS_LOG_NAME).exists()
    assert label(seeds, "emt", tmp_path, cfg, progress=False).written == 0
