"""Fast CPU checks of the probes in benchmarks/ (probe_*.py and the harness they share): each runs on a small case,
reports what it measured and restores what it patched; the GPU-only ones say so on a machine without CUDA. Split
from test_benchmarks_smoke.py at stop 79 (size); the kernel-side probes went to test_probes_kernels_smoke.py at
stop 85."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))


pytestmark = pytest.mark.timeout(120)


def test_probe_stress_step_on_cpu_restores_what_it_times(tmp_path):
    """probe_stress_step.py end to end on a CPU (the padded steps run eagerly there): both calls checked against
    each other, the phase tables written, and every method and module function it timed put back afterwards."""
    import probe_stress_step

    from mlff_distiller import ForceEngine, engine_padded

    before = (engine_padded.fill_padded, engine_padded._with_stress)
    argv = ["--sizes", "48", "--hidden", "8", "--layers", "1", "--reps", "2", "--prof", "1", "--npt-steps", "2"]
    probe_stress_step.main([*argv, "--out", str(tmp_path), "--name", "probe"])
    text = (tmp_path / "probe.md").read_text()
    assert "| energy + forces |" in text and "| stress |" in text and "`whole call`" in text
    assert "One NPTBerendsen step" in text and "`needs_rebuild`" in text
    assert (engine_padded.fill_padded, engine_padded._with_stress) == before
    engine = ForceEngine(probe_stress_step.make_student(hidden=8, layers=1), device="cpu")
    with probe_stress_step._PhaseTimer([(engine, "_run"), (engine_padded, "_with_stress")]) as timer:
        assert "_run" in vars(engine)
    assert "_run" not in vars(engine) and engine_padded._with_stress is before[1] and not timer.saved


def test_probe_cpu_md_students_only(tmp_path):
    """probe_cpu_md.py without the teacher: both shipped students step ethanol and a water cluster on the CPU, and
    the table is written."""
    import probe_cpu_md

    cluster = probe_cpu_md.water_cluster(4)
    assert len(cluster) == 12 and cluster.get_all_distances()[np.triu_indices(12, 1)].min() > 0.7
    argv = ["--sizes", "2", "--steps", "1", "--warmup", "1", "--no-teacher", "--threads", "1", "--autograd"]
    lines = probe_cpu_md.main([*argv, "--out", str(tmp_path), "--name", "cpu"])
    text = (tmp_path / "cpu.md").read_text()
    assert "| ethanol | 9 |" in text and "| (H2O)2 | 6 |" in text and lines[-1].startswith("| (H2O)2")
    assert "builtin:chno-gfn2 (autograd) ms" in text and lines[-1].count("|") == 9  # 4 students' paths, 2 ratios


def test_probe_cpu_analytic_compares_both_paths(tmp_path, monkeypatch):
    import probe_cpu_analytic

    monkeypatch.setattr(probe_cpu_analytic, "water_cluster", lambda n: probe_cpu_analytic.molecule("H2O"))
    lines = probe_cpu_analytic.main(["--threads", "1", "--out", str(tmp_path), "--name", "ab"])
    rows = [line for line in lines if line.startswith("| builtin")]
    assert len(rows) == 6 and all(float(r.split("|")[-2]) < 1e-4 for r in rows)  # the two paths' forces agree


def test_probe_domain_quick(tmp_path):
    """probe_domain.py --quick: one molecule inside the shipped students' training set, one outside, GFN2-xTB."""
    pytest.importorskip("tblite")
    import probe_domain

    assert probe_domain.main(["--quick", "--out", str(tmp_path), "--name", "dom"]) == 0
    rows = [
        line for line in (tmp_path / "dom.md").read_text().splitlines() if line.startswith("| H2O") or "BDA" in line
    ]
    assert len(rows) == 2 and rows[0].endswith("| 0 / 6 |") and rows[1].endswith("| 6 / 6 |")


@pytest.mark.gpu
def test_probe_md_step_runs_on_cuda(tmp_path):
    """probe_md_step.py end to end with a few repetitions (it reaches into the engine's Verlet-path buffers, so it
    breaks when they change: stop 27 found it crashing on the GPU). Its in-graph copies must give the engine's
    forces."""
    import probe_md_step

    probe_md_step.main(["--steps", "5", "--out", str(tmp_path), "--name", "probe"])
    text = (tmp_path / "probe.md").read_text()
    assert "| replay + sync |" in text and "| 192-atom water random walk" in text
    diff = float(text.rsplit("max |ΔF| = ", 1)[1].split()[0])
    assert diff < 1e-4


def test_probe_label_progress_quick(tmp_path, monkeypatch):
    """probe_label_progress.py on two tiny sizes: both variants label every frame, and the emulated former behaviour
    rewrites progress.json once per task (the write it is meant to time) while the journal does not."""
    import probe_label_progress

    from mlff_distiller.distill import frame_store as labelling  # the record and its file names live there

    writes = []
    real = labelling._atomic_write_text
    monkeypatch.setattr(labelling, "_atomic_write_text", lambda p, t: (writes.append(p.name), real(p, t))[1])
    assert probe_label_progress.main(["--sizes", "5", "--out", str(tmp_path)]) == 0
    rows = [line for line in (tmp_path / "probe_label_progress.md").read_text().splitlines() if line.startswith("| 5 ")]
    assert len(rows) == 1
    assert writes.count(labelling.PROGRESS_NAME) == 2 + (2 + 5)  # the journal's run, then the emulated one


def test_probe_relax_file_quick(tmp_path):
    """probe_relax_file.py on a few structures (CPU): every variant writes every structure at the same positions."""
    import probe_relax_file

    argv = ["--structures", "6", "--chunks", "4", "--reps", "1", "--ase-path", "--out", str(tmp_path)]
    lines = probe_relax_file.main(argv)
    rows = [line for line in lines if line.startswith("| one call") or line.startswith("| relax_file")]
    assert len(rows) == 3 and all(r.endswith("| 6 |") for r in rows) and "through ASE's reader" in rows[2]
    assert all(float(r.split("|")[-3]) < 1e-4 for r in rows[1:])  # max |Δpos| against the one call


def test_probe_first_call_compiles_quick(tmp_path, monkeypatch):
    """probe_first_call_compiles.py on the CPU (no Triton compiles there): two relaxations, the table written, and
    the process's cache settings as they were."""
    import os

    import probe_first_call_compiles

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    argv = ["--structures", "4", "--model", "builtin:chno-gfn2-small", "--out", str(tmp_path), "--name", "p"]
    lines = probe_first_call_compiles.main(argv)
    assert any("relax_batch twice" in line for line in lines) and "| where | seconds |" in lines
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "mine")


def test_probe_relax_first_call_quick(tmp_path):
    """probe_relax_first_call.py on a few structures (CPU, eager): two calls per setting, every engine call counted,
    and the engine it made for a setting is not kept for the next (a fresh engine each)."""
    import probe_relax_first_call

    from mlff_distiller import predict

    argv = ["--structures", "4", "--settings", "capture_after=1,eager", "--model", "builtin:chno-gfn2-small"]
    lines = probe_relax_first_call.main([*argv, "--out", str(tmp_path), "--name", "p"])
    rows = [line for line in lines if line.startswith("| capture_after=1") or line.startswith("| eager")]
    assert len(rows) == 4 and all(int(r.split("|")[4]) > 0 for r in rows)
    assert not predict._engines  # cleared after the last setting


def test_probe_large_capture_quick(tmp_path):
    """probe_large_capture.py on the CPU (no capture there: the harness itself): its three systems, both ladders,
    finite results, the table written."""
    import probe_large_capture

    argv = ["--device", "cpu", "--replicas", "2", "--water", "192", "--rounds", "1", "--blocks", "1"]
    lines = probe_large_capture.main(
        [*argv, "--out", str(tmp_path), "--name", "p", "--model", "builtin:chno-gfn2-small"]
    )
    rows = [line for line in lines if line.startswith("| BatchedMD") or line.startswith("| ForceEngine")]
    assert len(rows) == 3 and all(float(r.split("|")[-2]) > 0 for r in rows)
    assert (tmp_path / "p.md").exists()


def test_profile_step_host_section_on_cpu():
    """``profile_step.py --sections host`` runs the calculator's MD path with the engine's step stubbed out (the
    stub must keep the engine's ``_run`` signature, stress included): a median and a host profile come back."""
    import profile_step

    lines = profile_step._host_md_steps(n_atoms=24, steps=30)
    assert "host cost of an MD step without the model, 24-atom water: median" in lines[0]
    assert "StudentCalculator.check_state" in lines[-1] or "calculator.py" in lines[-1]


def test_probe_large_replica_on_cpu(tmp_path, monkeypatch):
    """probe_large_replica.py on the CPU (its --device cpu check of the probe itself): a 192-atom water box and its
    two-fold replica pass (E_B = 2 E_A, each copy's forces A's), with either kind of pair vectors; one force of the
    second copy off by 0.01 eV/Å fails."""
    import probe_large_replica

    from mlff_distiller import batch as batch_module

    argv = ["--device", "cpu", "--atoms", "192", "--out", str(tmp_path), "--name", "r"]
    assert probe_large_replica.main([*argv, "--pairs", "both"]) == 0
    rows = (tmp_path / "r.md").read_text().splitlines()[-2:]
    for row, kind in zip(rows, ("float64", "float32"), strict=True):
        assert row.startswith(f"| 192 | 384 | {kind} |") and row.endswith("| yes |"), row
    assert batch_module.PRECISE_PAIRS_FROM == 100.0  # restored after the float32 rows
    real = probe_large_replica.compute

    def wrong_second_copy(engine, atoms):
        energy, forces, seconds = real(engine, atoms)
        if len(atoms) == 384:
            forces = forces.copy()
            forces[200, 1] += 0.01
        return energy, forces, seconds

    monkeypatch.setattr(probe_large_replica, "compute", wrong_second_copy)
    assert probe_large_replica.main(argv) == 1
    assert (tmp_path / "r.md").read_text().splitlines()[-1].endswith("| NO |")


def test_probe_stress_sum_on_cpu(tmp_path):
    """probe_stress_sum.py end to end on a CPU (a 96-atom water box): both sums' rows against the float64 engine,
    finite, within float32's reach of it, and the sums' switch left on."""
    import probe_stress_sum
    from mlff_distiller.kernels import linear

    assert probe_stress_sum.main(["--atoms", "96", "--repeats", "1", "--device", "cpu", "--out", str(tmp_path)]) == 0
    rows = [line for line in (tmp_path / "probe_stress_sum.md").read_text().splitlines() if line.startswith("| 96 ")]
    assert [r.split("|")[2].strip() for r in rows] == ["float32", "float64"]
    for r in rows:
        scale, diff = float(r.split("|")[3]), float(r.split("|")[5])
        assert scale > 0 and diff < 1e-5 * scale + 1e-9, r
    assert linear._CONFIG["energy_sum_f64"] is True


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU message of the GPU probes")
def test_stop51_gpu_probes_say_they_need_cuda(capsys):
    """probe_eager_host.py, probe_auto_capture.py and probe_md_large.py need a CUDA device: on a CPU each says so
    and returns 0 (the GPU runs are in results/stop51_gpu/)."""
    import probe_auto_capture
    import probe_eager_host
    import probe_md_large

    for probe in (probe_eager_host, probe_auto_capture, probe_md_large):
        assert probe.main([]) == 0
        assert "needs a CUDA device" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU message of the GPU probes")
def test_stop52_gpu_probes_say_they_need_cuda(capsys):
    """probe_launch_cost.py, probe_capture_limit.py, probe_e2e_profile.py, probe_capture_pressure.py,
    probe_relax_limit.py and probe_single_point.py need a CUDA device: on a CPU each says so and returns 0 (the GPU
    runs: results/stop52_gpu/)."""
    import probe_capture_limit
    import probe_capture_pressure
    import probe_e2e_profile
    import probe_launch_cost
    import probe_relax_limit
    import probe_single_point

    probes = (
        probe_launch_cost,
        probe_capture_limit,
        probe_e2e_profile,
        probe_capture_pressure,
        probe_relax_limit,
        probe_single_point,
    )
    for probe in probes:
        assert probe.main([]) == 0
        assert "needs a CUDA device" in capsys.readouterr().out


def test_host_us_times_calls_back_to_back(monkeypatch):
    """harness.host_us: the mean wall µs per call between two synchronisations (stubbed on a CPU)."""
    import harness

    syncs = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: syncs.append(1))
    calls = []
    us = harness.host_us(lambda: calls.append(time.sleep(0.002)), 5)
    assert len(calls) == 5 and len(syncs) == 2 and 1_900 <= us <= 50_000


def test_back_to_back_us_takes_the_median_round(monkeypatch):
    """harness.back_to_back_us: warm-up calls, then rounds of calls each ended by a synchronisation (stubbed on a
    CPU), the median round's µs per call; calls that take 2 ms and one round of 20 ms calls read about 2,000."""
    import harness

    syncs = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: syncs.append(1))
    calls = []
    slow = iter([0.0] * 2 + [0.02] * 3 + [0.002] * 12)  # warm-up, one slow round, four quick rounds of 3 calls

    us = harness.back_to_back_us(lambda: calls.append(time.sleep(next(slow))), 3, warmup=2)
    assert len(calls) == 17 and len(syncs) == 6 and 1_900 <= us <= 15_000


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU message of the GPU probes")
def test_stop56_gpu_probe_says_it_needs_cuda(capsys):
    """probe_kernel_table.py needs a CUDA device: on a CPU it says so and returns 0 (its GPU runs are in
    results/stop56_gpu/ and later; stop62_gpu/e/ is its ``--ops`` table, then probe_torch_ops.py). ``--ops`` asks
    for an eager step: with the captured one it stops with a usage error before anything runs."""
    import probe_kernel_table

    for argv in ([], ["--ops", "--step-mode", "eager"]):
        assert probe_kernel_table.main(argv) == 0
        assert "needs a CUDA device" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        probe_kernel_table.main(["--ops"])
    assert exc.value.code == 2
    assert "--ops needs --step-mode eager" in capsys.readouterr().err


def test_probe_last_update_cpu_runs(tmp_path):
    """probe_last_update_cpu.py on ethanol: a row per shipped student, the two settings' forces within rounding."""
    import probe_last_update_cpu

    lines = probe_last_update_cpu.main(["--systems", "ethanol", "--reps", "0.05", "--out", str(tmp_path)])
    rows = [line for line in lines if line.startswith("| builtin:")]
    assert len(rows) == 2
    for row in rows:
        assert float(row.split("|")[7]) < 1e-4, row
    assert (tmp_path / "probe_last_update_cpu.md").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU message of the GPU probes")
def test_stop59_60_gpu_probes_say_they_need_cuda(capsys):
    """probe_tf32_grid.py (stop 59) needs a CUDA device: on a CPU it says so and returns 0 (its GPU run is in
    results/stop59_gpu/d/)."""
    import probe_tf32_grid

    assert probe_tf32_grid.main([]) == 0
    assert "needs a CUDA device" in capsys.readouterr().out


def test_stop77_probes_report_what_they_measured(tmp_path, capsys):
    """probe_md_affinity's table shows each process's rows as written (its JSON lines), harness.profile_tables
    sorts a profile by each key, and the CUDA probes say so on a CPU-only machine instead of failing."""
    import cProfile

    import harness
    import probe_md_affinity
    import probe_md_profile
    import probe_predict_one

    row = {
        "label": "core 3", "allowed": [3], "cpus_seen": [3], "host_work_us": 47.6, "host_work_us_after": 94.5,
        "ase_floor_us": 602.0, "launch_sync_us": 24.7, "md_us_rounds": [231.3, 294.9, 303.4], "md_us": 294.9,
    }  # fmt: skip
    rows = tmp_path / "rows.jsonl"
    rows.write_text("noise from a child process\n" + json.dumps(row) + "\n")
    text = probe_md_affinity.table(rows)
    assert text.count("\n") == 3 and "| core 3 | 3 | 3 | 47.6 / 94.5 | 602.0 | 24.7 |" in text
    assert "231.3 / 294.9 / 303.4 | **294.9** |" in text
    prof = cProfile.Profile()
    prof.enable()
    sorted(range(100), key=lambda x: -x)
    prof.disable()
    out = harness.profile_tables(prof, 5, title="calls")
    assert "## calls by tottime" in out and "## calls by cumtime" in out and "sorted" in out
    if not torch.cuda.is_available():
        for probe in (probe_md_profile, probe_predict_one, probe_md_affinity):
            probe.main([])
        assert capsys.readouterr().out.count("needs CUDA") == 3
