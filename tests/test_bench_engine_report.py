"""bench_engine's report (benchmarks/engine_report.py, re-exported by bench_engine.py): its tables and issue 5's
targets read off a run's rows, on the CPU (the benchmark itself needs a GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_engine
import engine_report
import harness

pytestmark = pytest.mark.timeout(120)

REF = engine_report.REFERENCE_LABEL
assert bench_engine.REFERENCE[0] == REF and bench_engine.write_report is engine_report.write_report


def test_bench_engine_reports_the_host_speed_beside_the_md_step(tmp_path):
    """bench_engine's MD table carries each variant's fixed host work before and after its run (the step is
    host-bound, and the GPU guests' host runs at two speeds); a skipped variant leaves the column empty."""
    rows = [
        dict(section="md", variant="auto = cudagraph", molecule="C6H6", step_us=160.0, mean_us=170.0, graphs=1,
             builds=1, ahead="300 taken, 0 missed", dense=True, host_us=(47.5, 91.0)),
        dict(section="md", variant="cudagraph+compile", skipped="time budget"),
    ]  # fmt: skip
    engine_report.write_report({"rows": rows}, tmp_path / "engine.md")
    text = (tmp_path / "engine.md").read_text()
    assert "| auto = cudagraph | 160.0 | 170.0 | 1 | 300 taken, 0 missed | 1 | yes | 47.5 / 91.0 |" in text
    assert "| cudagraph+compile | — | — |  |  | time budget |  |  |" in text
    assert 0.0 < harness.host_work_us(20) < 1e5


def _rows():
    return [
        dict(section="latency", variant=REF, molecule="C6H6", atoms=12, e2e_us=9000.0, step_us=1.0, first_call_s=0.1),
        dict(section="latency", variant="cudagraph", molecule="C6H6", atoms=12, e2e_us=120.0, step_us=48.8,
             first_call_s=0.1),
        dict(section="latency", variant="cudagraph", molecule="H2", atoms=2, e2e_us=100.0, step_us=10.0,
             first_call_s=0.1),
        dict(section="latency", variant="compile default", molecule="C6H6", skipped="time budget"),
        dict(section="md", variant=REF, step_us=9000.0),
        dict(section="md", variant="auto = cudagraph", step_us=230.0),
        dict(section="sweep", variant=REF, batch=4096, atoms=21749, step_us_per_structure=0.01,
             e2e_us_per_structure=1.0, structures_per_s=1.0, first_call_s=0.1),
        dict(section="sweep", variant="cudagraph fp32", batch=4096, atoms=21749, step_us_per_structure=0.342,
             e2e_us_per_structure=1.0, structures_per_s=1.0, first_call_s=0.1),
        dict(section="sweep", variant="cudagraph tf32", batch=4096, atoms=21749, step_us_per_structure=0.311,
             e2e_us_per_structure=1.0, structures_per_s=1.0, first_call_s=0.1),
        dict(section="sweep", variant="cudagraph bf16", batch=4096, atoms=21749, step_us_per_structure=0.298,
             e2e_us_per_structure=1.0, structures_per_s=1.0, first_call_s=0.1),
        dict(section="sweep", variant="cudagraph fp16", batch=4096, atoms=21749, step_us_per_structure=0.1,
             e2e_us_per_structure=1.0, structures_per_s=1.0, first_call_s=0.1),
        dict(section="sweep", variant="cudagraph fp32", batch=1024, skipped="time budget"),
        dict(section="startup", variant="cudagraph", phase="cold", first_result_s=5.3),
        dict(section="startup", variant="cudagraph", phase="warm", first_result_s=1.13),
        dict(section="startup", variant="cudagraph+compile", phase="warm", first_result_s=13.9),
    ]  # fmt: skip


def test_bench_engine_reads_issue_5s_targets_off_its_own_rows(tmp_path):
    """Each target takes the fastest of ours for its row: never the torch reference (here faster than anything),
    never another molecule, batch or precision (fp16 is neither tf32 nor bf16), never a skipped row; a missed goal
    reads FAIL, a row without a measurement of ours `not measured`."""
    got = {t[0]: t[1:] for t in engine_report.target_rows(_rows())}
    assert len(got) == len(engine_report.TARGETS) == 6
    t = iter(got.values())
    assert next(t) == ("48.8 µs (cudagraph)", "≤ 50 µs", "pass")  # benzene, not H2's 10 µs or the reference's 1
    assert next(t) == ("230.0 µs (auto = cudagraph)", "≤ 200 µs", "FAIL")
    assert next(t) == ("0.342 µs (cudagraph fp32)", "≤ 0.6 µs", "pass")
    assert next(t) == ("0.298 µs (cudagraph bf16)", "≤ 0.3 µs", "pass")  # not fp16's 0.1
    assert next(t) == ("—", "≤ 0.8 µs", "not measured")  # batch 1,024 was skipped
    assert next(t) == ("1.13 s (cudagraph)", "≤ 2 s", "pass")
    engine_report.write_report({"rows": _rows()}, tmp_path / "engine.md")
    text = (tmp_path / "engine.md").read_text()
    assert "## Targets (issue 5" in text
    row = "| g2 x 4,096, step per structure, tf32 or bf16 matmuls | 0.298 µs (cudagraph bf16) | ≤ 0.3 µs | pass |"
    assert row in text
    assert text.index("## Targets") < text.index("## Single-molecule latency")
