"""examples/make_builtin_student.py end to end (``--quick``: 4 molecules, GFN2-xTB labels, 20 s of training)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(600)


def test_make_builtin_student_keeps_what_the_trainer_recorded(tmp_path):
    pytest.importorskip("tblite.ase")
    from mlff_distiller import load_model
    from mlff_distiller.domain import DomainEnvelope

    work, results = tmp_path / "work", tmp_path / "res"
    cmd = [
        sys.executable, str(ROOT / "examples/make_builtin_student.py"), "--quick", "--workers", "2",
        "--work", str(work), "--results", str(results), "--name", "q", "--batch-size", "4", "--lr", "1e-3",
        "--seed", "3",
    ]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=560)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads((results / "metrics.json").read_text())
    # The command line's training options reach the trainer (and the record).
    assert summary["train_config"] == {"batch_size": 4, "lr": 1e-3, "seed": 3, "time_limit_s": 20, "ema_decay": 0.999}
    model = load_model(results / "q.pt")
    meta = model.metadata
    # The trainer's envelope of its data travels with the checkpoint: the domain check reads it from there, and the
    # repulsion wall under the student lies at 0.9 of the envelope's shortest pairs.
    env = DomainEnvelope.of_model(model)
    assert env is not None and env.frames == summary["frames"]["train"]
    wall = {(a, b): r for a, b, r in model.config.repulsion}
    assert wall == pytest.approx(env.repulsion_radii(model.species_list))
    # The weights the trainer rounded onto the TF32 grid, and its record of it.
    assert meta["tf32_grid"] is True and model.on_tf32_grid()
    assert "force_mae_mev_a" in meta["val_tf32_grid"]
    assert meta["test_frames"] == summary["frames"]["test"]
    assert "--batch-size 4" in meta["recipe"]
