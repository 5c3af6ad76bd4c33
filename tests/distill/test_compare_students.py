"""benchmarks/compare_students.py: several students on the same labelled frames, in one process."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from mlff_distiller import StudentModel, load_model
from mlff_distiller.distill import error_metrics, predict_frames, read_frames

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import compare_students

pytestmark = pytest.mark.timeout(300)


def _student(path: Path, hidden: int, seed: int) -> Path:
    torch.manual_seed(seed)
    StudentModel(species=[1, 6, 7, 8], hidden=hidden, layers=2, n_rbf=6, cutoff=4.0).save(path)
    return path


def test_compare_students_tables_every_student_on_the_same_frames(emt_test_labels, tmp_path):
    wide = _student(tmp_path / "wide.pt", 16, 0)
    narrow = _student(tmp_path / "narrow.pt", 8, 1)
    out = tmp_path / "cmp" / "table"
    assert compare_students.main(
        ["--test", str(emt_test_labels), "--model", f"wide={wide}", "--model", f"narrow={narrow}",
         "--device", "cpu", "--by", "temperature", "--by", "formula", "--out", str(out)]
    ) == 0  # fmt: skip
    result = json.loads(out.with_suffix(".json").read_text())
    frames = read_frames(emt_test_labels)
    assert result["frames"] == len(frames)
    assert list(result["students"]) == ["wide", "narrow"]
    for name, path, hidden in (("wide", wide, 16), ("narrow", narrow, 8)):
        s = result["students"][name]
        assert (s["hidden"], s["layers"]) == (hidden, 2)
        model = load_model(path)
        assert s["parameters"] == sum(p.numel() for p in model.parameters())
        direct = error_metrics(frames, predict_frames(model, frames, device="cpu", precision="fp32"))
        assert s["all"]["force_mae_mev_a"] == pytest.approx(direct["force_mae_mev_a"], rel=1e-9)
        assert s["all"]["energy_mae_mev_atom"] == pytest.approx(direct["energy_mae_mev_atom"], rel=1e-9)
        for key in ("temperature", "formula"):
            groups = s["by"][key]
            assert len(groups) >= 2
            assert sum(g["frames"] for g in groups.values()) == len(frames)
    # Two different random students: different errors (the table is not one student's numbers twice).
    assert (
        result["students"]["wide"]["all"]["force_mae_mev_a"] != result["students"]["narrow"]["all"]["force_mae_mev_a"]
    )
    text = out.with_suffix(".md").read_text()
    assert "| wide |" in text and "| narrow |" in text and "by `temperature`" in text and "by `formula`" in text


def test_compare_students_refuses_a_model_without_a_name(emt_test_labels):
    with pytest.raises(SystemExit, match="NAME=MODEL"):
        compare_students.main(["--test", str(emt_test_labels), "--model", "builtin:chno-gfn2", "--device", "cpu"])


def test_compare_students_refuses_an_empty_folder(tmp_path):
    with pytest.raises(ValueError, match=r"without frames|no labelled frames"):
        compare_students.compare(str(tmp_path), [("x", "builtin:chno-gfn2")], device="cpu", precision="fp32", by=[])
