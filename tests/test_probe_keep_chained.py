"""benchmarks/probe_keep_chained.py's plumbing on the CPU (no chain there: every counter zero, the same bits)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import probe_keep_chained

from mlff_distiller import ForceEngine


def test_the_keep_probe_runs_both_ways_and_restores_the_switch():
    lines = probe_keep_chained.run(["benzene"], 2, 1, [1.0], "builtin:chno-gfn2-small", "cpu")
    rows = [line for line in lines if line.startswith("| benzene |")]
    assert [r.split("|")[4].strip() for r in rows] == ["on", "off", "off again"]
    assert all(float(r.split("|")[10]) == 0.0 for r in rows)  # the CPU path: the same bits
    assert ForceEngine.keep_chained_steps is True
