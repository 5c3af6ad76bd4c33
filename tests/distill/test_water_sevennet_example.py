"""examples/distill_water_sevennet.py (the issue-6 water target): the sampling plan and a quick end-to-end run."""

import importlib.util
import json
import math
from pathlib import Path

import pytest

from mlff_distiller import load_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("distill_water_sevennet", ROOT / "examples/distill_water_sevennet.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BUDGET = {"safety": 0.85, "test_share": 0.2, "max_md_steps": 4000}


def test_plan_fits_the_labelling_budget(example):
    # 0.1 s per step on both boxes, 168 s: 0.85 × 168 / 0.1 = 1428 teacher steps, 80 % over 4 training
    # trajectories (285 -> 280, a multiple of sample_every) and 20 % to the held-out one.
    plan = example.make_plan(0.1, 0.1, 168.0, 4, 1, 10, BUDGET)
    assert plan["md_steps_train"] == 280 and plan["md_steps_test"] == 280
    assert plan["label_seconds_expected"] == pytest.approx(5 * 280 * 0.1)
    assert plan["label_seconds_expected"] <= 0.85 * 168.0
    assert plan["expected_frames_train"] == 4 * 28 and plan["expected_frames_test"] == 28
    # A slower training box gets proportionally fewer steps; the held-out share is unchanged.
    slower = example.make_plan(0.2, 0.1, 168.0, 4, 1, 10, BUDGET)
    assert slower["md_steps_train"] == 140 and slower["md_steps_test"] == 280


def test_plan_clamps_to_two_frames_and_to_the_cap(example):
    slow = example.make_plan(10.0, 10.0, 30.0, 4, 1, 10, BUDGET)  # 2.5 steps affordable: still two frames each
    assert slow["md_steps_train"] == 20 and slow["md_steps_test"] == 20
    fast = example.make_plan(1e-4, 1e-4, 168.0, 4, 1, 10, BUDGET)
    assert fast["md_steps_train"] == 4000 and fast["md_steps_test"] == 4000


def _check_run(work: Path, teacher: str) -> dict:
    results = work / "results"
    metrics = json.loads((results / "metrics.json").read_text())
    assert metrics["teacher"] == teacher and metrics["quick"] is True
    assert metrics["system"]["atoms"] == 24 and metrics["system"]["molecules"] == 8
    assert 0.9 < metrics["system"]["density_g_cm3"] < 1.1
    plan = metrics["plan"]
    assert plan["teacher_step_s_train_box"] > 0 and plan["teacher_step_s_test_box"] > 0
    assert plan["md_steps_train"] % plan["sample_every"] == 0 and plan["md_steps_test"] % plan["sample_every"] == 0
    frames = metrics["frames"]
    assert frames["train"] >= 1 and frames["val"] >= 1 and frames["test"] >= 2
    strained = metrics.get("label_strain", {}).get("frames", 0)  # --stress: strained frames join the MD ones
    assert frames["train"] + frames["val"] == metrics["label_train"]["frames"] + strained
    assert metrics["sampling"]["train_atoms"] == 48 and metrics["sampling"]["test_atoms"] == 24
    test = metrics["test_fp32"]
    assert "error" not in test, test
    assert test["frames"] == frames["test"] and test["atoms"] == 24 * frames["test"]
    assert math.isfinite(test["force_mae_mev_a"]) and test["force_mae_mev_a"] > 0
    timing = metrics["md_step_timing"]
    assert "error" not in timing, timing
    assert timing["atoms"] == 24 and timing["student_s_per_step"] > 0 and timing["teacher_s_per_step"] > 0
    assert timing["speedup"] == pytest.approx(timing["teacher_s_per_step"] / timing["student_s_per_step"])
    assert "error" not in metrics["nve"], metrics["nve"]
    targets = metrics["targets"]
    assert targets["force_mae"]["measured"] == test["force_mae_mev_a"]
    assert targets["force_mae"]["met"] == (test["force_mae_mev_a"] <= 20.0)
    assert targets["speedup"]["met"] == (timing["speedup"] >= 100.0)
    for name in ("summary.md", "parity.png", "test_frames.extxyz"):
        assert (results / name).stat().st_size > 0, name
    # Quick mode validates every 2 steps; a loaded machine may get fewer steps than that in the time limit.
    if metrics["training"]["steps"] >= 2:
        assert (results / "learning_curve.png").stat().st_size > 0
    assert "held-out force MAE" in (results / "summary.md").read_text()
    model = load_model(results / "water-sevennet.pt")
    assert model.species_list == [1, 8]
    assert model.metadata["teacher"] == teacher
    assert model.metadata["test_force_mae_mev_a"] == pytest.approx(test["force_mae_mev_a"])
    return metrics


def test_quick_run_with_emt_then_resume(example, tmp_path):
    work = tmp_path / "water"
    assert example.main(["--quick", "--teacher", "emt", "--work", str(work)]) == 0
    first = _check_run(work, "emt")
    assert first["label_train"]["tasks_run"] == 2 and first["label_test"]["tasks_run"] == 1
    # A second run resumes: same plan, every labelling task already done, the same frames.
    assert example.main(["--quick", "--teacher", "emt", "--work", str(work), "--time-limit", "2"]) == 0
    second = _check_run(work, "emt")
    assert second["label_train"]["tasks_run"] == 0 and second["label_test"]["tasks_run"] == 0
    assert second["frames"] == first["frames"]
    assert second["plan"]["md_steps_train"] == first["plan"]["md_steps_train"]


def test_quick_stress_run_with_emt(example, tmp_path):
    """--stress: strained frames labelled with the teacher's stress join the MD frames, training fits the stress
    (plain step), and the evaluation adds stress and pressure errors, both equations of state and NPT runs."""
    work = tmp_path / "water"
    assert example.main(["--quick", "--teacher", "emt", "--stress", "--work", str(work)]) == 0
    metrics = _check_run(work, "emt")
    labels = metrics["stress_labels"]
    assert labels["strained_frames"] == metrics["label_strain"]["frames"] >= 2
    assert labels["frames_with_stress"] == labels["frames"]
    assert metrics["train_config"]["stress_weight"] == 20.0 and metrics["training"]["train_step"] == "plain"
    assert (
        metrics["test_fp32"]["stress_frames"] == metrics["frames"]["test"]
        and metrics["test_fp32"]["pressure_mae_gpa"] > 0
    )
    eos = metrics["eos"]
    assert len(eos["density_g_cm3"]) == 5
    for who in ("teacher", "student"):
        assert len(eos[who]["pressure_gpa"]) == 5
    npt = metrics["npt"]
    assert npt["student"]["steps"] == 20 and len(npt["teacher"]["density_g_cm3"]) == 3
    assert npt["npt_speedup"] > 0
    rigid = metrics["eos_rigid"]
    assert rigid["molecules"] is True and len(rigid["student"]["pressure_gpa"]) == 5
    text = (work / "results" / "summary.md").read_text()
    assert "held-out pressure MAE" in text and "zero-pressure density" in text and "rigid molecules" in text


@pytest.mark.slow
def test_quick_run_with_sevennet(example, tmp_path):
    pytest.importorskip("sevenn.calculator")
    work = tmp_path / "water"
    assert example.main(["--quick", "--work", str(work), "--device", "cpu"]) == 0
    metrics = _check_run(work, "sevennet-0")
    assert metrics["sevenn"] is not None and metrics["teacher_device"] == "cpu"
