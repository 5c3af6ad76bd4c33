"""The README's main job (``make demo`` runs ``examples/demo.py``) runs end to end on the shipped student."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_demo_runs_md_and_batched_prediction():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "demo.py")],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "student: builtin:chno-gfn2" in out, out  # the embedded student, no download
    assert "MD: ethanol, 200 Langevin steps" in out, out
    assert "predict_forces: 256 structures" in out, out
    assert "check: ethanol (in the training set): students differ by" in out and "the students agree" in out, out
    assert "check: 1,4-benzenediamine (not in it)" in out and "flagged: fine-tune" in out, out
    assert "nan" not in out.lower(), out
