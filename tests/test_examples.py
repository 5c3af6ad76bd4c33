"""The README's examples run end to end on the CPU: the main job (``make demo`` runs ``examples/demo.py``) and
the small ones."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(name: str, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "nan" not in proc.stdout.lower(), proc.stdout
    return proc.stdout


def test_demo_runs_md_and_batched_prediction():
    out = _run("demo.py")
    # the embedded default student (mlff_distiller.DEFAULT_MODEL, 64 x 3 since stop 85), no download
    assert "student: builtin:chno-gfn2-small on" in out, out
    assert "MD: ethanol, 200 Langevin steps" in out, out
    assert "predict_forces: 256 structures" in out, out
    assert "check: ethanol (in the training set): students differ by" in out and "the students agree" in out, out
    assert "check: 1,4-benzenediamine (not in it)" in out and "flagged: fine-tune" in out, out


def test_ase_md_example_conserves_energy_and_thermalises():
    out = _run("ase_md.py")
    drift = float(re.search(r"total-energy drift (-?[\d.]+) meV/atom", out).group(1))
    assert abs(drift) < 1.0, out  # fp64 NVE, 200 steps of 0.5 fs
    temps = [float(t) for t in re.findall(r"T =\s+([\d.]+) K", out)]
    assert len(temps) == 5 and 350 < max(temps) < 800, out  # Langevin at 500 K heats the molecule towards it


def test_batched_predict_example():
    out = _run("batched_predict.py")
    assert re.search(r"1000 molecules in [\d.]+ s; first: E = -?[\d.]+ eV", out), out


def test_batched_md_example(tmp_path):
    import ase.io

    out_file = tmp_path / "runs.extxyz"
    out = _run("batched_md.py", "--replicas", "1", "--steps", "40", "--output", str(out_file))
    assert re.search(r"61 trajectories \(61 molecules x 1\), 40 Langevin steps on cpu: [\d.]+ s", out), out
    temps = [float(t) for t in re.findall(r"mean T =\s+([\d.]+) K", out)]
    assert len(temps) == 5 and all(100 < t < 600 for t in temps), out
    frames = ase.io.read(out_file, index=":")
    assert len(frames) == 5 * 61 and [f.info["replica"] for f in frames[:61]] == list(range(61))
