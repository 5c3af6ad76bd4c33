"""examples/finetune_builtin.py: the --quick end-to-end run (EMT labels, seconds of training)."""

import importlib.util
import json
import math
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_finetune_example_quick(tmp_path):
    spec = importlib.util.spec_from_file_location("finetune_builtin", ROOT / "examples/finetune_builtin.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    out = tmp_path / "results"
    metrics = example.main(["--quick", "--molecule", "C7NH5", "--work", str(tmp_path / "work"), "--results", str(out)])
    assert json.loads((out / "metrics.json").read_text()) == json.loads(json.dumps(metrics))
    runs = metrics["runs"]
    assert list(runs) == ["shipped, as it is", "fine-tuned", "new student, same architecture"]
    assert runs["shipped, as it is"]["steps"] == 0 and runs["fine-tuned"]["steps"] > 0
    assert all(math.isfinite(r["force_mae_mev_a"]) and r["frames"] == metrics["test_frames"] for r in runs.values())
    # EMT is not the shipped student's teacher: its energy reference was refitted before fine-tuning, which takes
    # the energy error from tens of eV per atom (another energy zero) to well under one.
    assert metrics["refit_energy_reference"] is True
    assert runs["shipped, as it is"]["energy_mae_mev_atom"] > 1e4 > 1e3 > runs["fine-tuned"]["energy_mae_mev_atom"]
    for name in ("shipped, as it is", "fine-tuned"):  # the stability MD of both (0.02 ps in --quick)
        assert runs[name]["md"]["steps"] == 40 and runs[name]["md"]["checks"] == 3  # steps 0, 20, 40
    summary = (out / "summary.md").read_text()
    assert "| fine-tuned |" in summary and "- fine-tuned: 0.02 ps" in summary
