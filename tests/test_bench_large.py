"""CPU smoke tests of benchmarks/bench_large.py: a --quick run writes the markdown and JSON with the expected
rows, out-of-memory errors become rows, a spent budget skips (and says so), and the large-box builder keeps
systems.water_box's recipe."""

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

import bench_large  # noqa: E402
import peers  # noqa: E402
from systems import water_box  # noqa: E402

from mlff_distiller import ForceEngine  # noqa: E402
from mlff_distiller.neighbors import neighbor_list_batch  # noqa: E402
from mlff_distiller.neighbors.vesin_backend import vesin_available  # noqa: E402

pytestmark = pytest.mark.timeout(300)

TARGET_NAMES = [
    "ours == reference (48 atoms, fp32)",
    "24000 atoms energy+forces (best of ours)",
    "24000 atoms peak memory (ours eager)",
    "3000 atoms energy+forces (best of ours)",
    "NL one 24,000-atom box (Triton cell list, incl. CSR)",
    "NL 1,024 boxes x 24 atoms, one call",
    "NL 1,024 boxes: vesin (1 call/box) / ours",
    "largest water box that fits (ours)",
]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("large")
    data = bench_large.main(["--quick", "--out", str(out), "--nl-atoms", "48", "--n-small", "3", "--budget-s", "900"])
    return out, data


def test_quick_run_writes_md_and_json(quick_run):
    out, data = quick_run
    md = (out / "bench_large.md").read_text()
    on_disk = json.loads((out / "bench_large.json").read_text())
    assert on_disk["targets"] == data["targets"]
    env = data["env"]
    assert env["quick"] and env["device"] and env["torch"] == torch.__version__ and env["commit"]
    assert not data["skipped"] and not data["notes"], (data["skipped"], data["notes"])
    for header in (
        "## Targets",
        "## Correctness before timing",
        "## Energy + forces",
        "## Neighbour lists",
        "## Largest box that fits",
    ):
        assert header in md
    assert [t["target"] for t in data["targets"]] == TARGET_NAMES
    for t in data["targets"]:
        assert f"| {t['target']} | {t['value']} | {t['goal']} | {t['result']} |" in md
    # Every markdown table row has as many cells as its table's header (no stray '|' in a value).
    width = None
    for line in md.splitlines():
        if not line.startswith("|"):
            width = None
        elif width is None:
            width = line.count("|")
        else:
            assert line.count("|") == width, line


def test_quick_run_correctness_precedes_and_passes(quick_run):
    _, data = quick_run
    c = data["correctness"]
    assert c["atoms"] == 48 and c["passed"] and c["forces_finite_nonzero"]
    assert [r["impl"] for r in c["rows"]] == ["ours eager", "ours best (mode auto)"]
    assert all(r["dF_eVA"] <= 1e-4 for r in c["rows"])
    assert data["targets"][0]["result"] == "pass"


def test_quick_run_energy_forces_rows(quick_run):
    out, data = quick_run
    md = (out / "bench_large.md").read_text()
    rows = data["energy_forces"]
    for n in (24, 48):
        by_key = {r["key"]: r for r in rows if r["atoms"] == n}
        assert set(by_key) == {"ours", "best", "graph", "ref", "ours_nl"}
        for key in ("ours", "ref"):
            r = by_key[key]
            assert r["step_us"] > 0 and r["finite_nonzero"] and r["edges"] > 20 * n
            assert r["us_per_atom"] == pytest.approx(r["step_us"] / n)
            assert r["ref_over_this"] == pytest.approx(by_key["ref"]["step_us"] / r["step_us"])
            assert r["peak_bytes"] is None  # not measured off CUDA
            assert f"| {n} | {r['edges']} | {r['impl']} | {r['step_us'] / 1e3:.3f} |" in md
        assert "mode auto runs eager on cpu" in by_key["best"]["skipped"]
        # mode cudagraph on a CPU runs the padded eager path (with a warning): measured, finite
        assert by_key["graph"]["step_us"] > 0 and by_key["graph"]["finite_nonzero"]
        assert by_key["ours_nl"]["e2e_us"] > 0 and by_key["ours"]["e2e_us"] == by_key["ours_nl"]["e2e_us"]
        assert f"| {by_key['ours']['e2e_us'] / 1e3:.3f} ({by_key['ours']['nl_method']}) |" in md


def test_quick_run_neighbour_list_rows(quick_run):
    _, data = quick_run
    rows = data["neighbour_lists"]
    cases = sorted({r["case"] for r in rows})
    assert cases == ["1 box, 48 atoms", "3 boxes x 24 atoms (6.2 Å)"]
    for case in cases:
        got = {r["impl"]: r for r in rows if r["case"] == case}
        assert list(got) == [
            "brute (1 batched call)",
            "cell_list torch (1 batched call)",
            "cell_list triton (1 batched call)",
            "vesin, our contract (1 call/box)",
            "vesin raw i,j,S (1 call/box)",
        ]
        ran = [r for r in got.values() if "median_us" in r]
        assert {"brute (1 batched call)", "cell_list torch (1 batched call)"} <= {r["impl"] for r in ran}
        assert len({r["pairs"] for r in ran}) == 1 and ran[0]["pairs"] > 0
        assert all(r["agree"].startswith("yes") for r in ran)
        for r in got.values():
            assert ("median_us" in r) != ("skipped" in r), r  # every row either ran or says why not
        if not vesin_available():
            assert "does not import" in got["vesin raw i,j,S (1 call/box)"]["skipped"]
        else:
            raw = got["vesin raw i,j,S (1 call/box)"]
            assert raw["vesin_raw_over_this"] == 1.0
            assert got["brute (1 batched call)"]["vesin_raw_over_this"] == pytest.approx(
                raw["median_us"] / got["brute (1 batched call)"]["median_us"]
            )


def test_quick_run_largest_rows(quick_run):
    _, data = quick_run
    grow = data["largest"]
    assert [g["atoms"] for g in grow] == [48, 96, 192]
    assert all(g["status"] == "ran" and g["finite_nonzero"] and g["edges"] > 0 for g in grow)
    assert all(g["nl_method"] == "cell_list" for g in grow)
    fit = data["targets"][-1]
    assert fit["value"].startswith("192 atoms") and fit["result"] == "FAIL"


def test_oom_becomes_a_row_not_a_crash(tmp_path, monkeypatch):
    """Out-of-memory errors (injected: the reference above 24 atoms, the engine at 96 atoms and more) end up as
    'OOM at N atoms' rows; everything else still runs and the files are written."""
    step_prepare = peers.StepImpl.prepare
    compute = ForceEngine.compute

    def prepare(self, structures, forces):
        if self.kind == "reference" and len(structures[0]) > 24:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 40.00 GiB")
        return step_prepare(self, structures, forces)

    def engine_compute(self, batch, **kw):
        if batch.num_atoms >= 96:
            raise RuntimeError("CUDA error: out of memory")
        return compute(self, batch, **kw)

    monkeypatch.setattr(peers.StepImpl, "prepare", prepare)
    monkeypatch.setattr(ForceEngine, "compute", engine_compute)
    data = bench_large.main(
        [
            "--quick",
            "--out",
            str(tmp_path),
            "--sections",
            "ef,grow",
            "--sizes",
            "24",
            "48",
            "--grow-sizes",
            "48",
            "96",
            "192",
        ]
    )
    md = (tmp_path / "bench_large.md").read_text()
    ref48 = next(r for r in data["energy_forces"] if r["atoms"] == 48 and r["key"] == "ref")
    assert ref48["error"] == "OOM at 48 atoms" and ref48["oom"] and "step_us" not in ref48
    ours48 = next(r for r in data["energy_forces"] if r["atoms"] == 48 and r["key"] == "ours")
    assert ours48["step_us"] > 0 and "ref_over_this" not in ours48
    assert "OOM at 48 atoms" in md
    assert [(g["atoms"], g["status"]) for g in data["largest"]] == [(48, "ran"), (96, "OOM at 96 atoms")]
    fit = data["targets"][-1]
    assert fit["value"] == "48 atoms (next, 96 atoms: OOM at 96 atoms)" and fit["result"] == "FAIL"
    assert data["correctness"] == {} and data["targets"][0]["result"] == "not measured"


def test_spent_budget_skips_everything_and_says_so(tmp_path):
    data = bench_large.main(["--quick", "--budget-s", "0", "--out", str(tmp_path)])
    md = (tmp_path / "bench_large.md").read_text()
    assert data["skipped"] == [
        f"{s}: time budget spent" for s in ("correctness", "energy + forces", "neighbour lists", "largest box")
    ]
    assert "## Skipped / notes" in md and md.count("time budget spent") == 4
    assert all(t["result"] == "not measured" for t in data["targets"])
    assert not data["energy_forces"] and not data["neighbour_lists"] and not data["largest"]


def test_is_oom():
    assert bench_large.is_oom(torch.OutOfMemoryError("CUDA out of memory"))
    assert bench_large.is_oom(RuntimeError("CUDA error: out of memory"))
    assert bench_large.is_oom(RuntimeError("CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate"))
    assert not bench_large.is_oom(RuntimeError("shape mismatch"))
    assert not bench_large.is_oom(ValueError("out of memory"))


def test_measure_paths():
    cpu = torch.device("cpu")
    fast = bench_large.measure(lambda: 1, cpu, slow_budget_s=1.0, rep_ms=5)
    assert fast.how == "do_bench" and fast.result == 1 and fast.median_us < 1e4 and fast.peak_bytes is None

    calls = []

    def nap():
        calls.append(1)
        time.sleep(0.06)
        return 2

    slow = bench_large.measure(nap, cpu, slow_budget_s=0.3, rep_ms=5)
    assert slow.how == "events" and 1 <= slow.calls <= 5 and slow.median_us >= 6e4 and slow.result == 2
    assert len(calls) == 2 + slow.calls  # cold + warm + timed
    calls.clear()
    warm = bench_large.measure(nap, cpu, slow_budget_s=0.01, rep_ms=5)
    assert warm.how == "1 warm call" and warm.calls == 1 and warm.median_us >= 6e4 and len(calls) == 2
    calls.clear()
    cold = bench_large.measure(nap, cpu, slow_budget_s=1.0, rep_ms=5, max_single_s=0.01)
    assert cold.how == "cold only" and cold.median_us == cold.cold_us >= 6e4 and len(calls) == 1

    # A first call slowed by one-off work (compilation) is not what gets reported.
    first = []

    def compiles_once():
        if not first:
            first.append(1)
            time.sleep(0.4)
        return 3

    t = bench_large.measure(compiles_once, cpu, slow_budget_s=0.2, rep_ms=5)
    assert t.how == "do_bench" and t.cold_us >= 4e5 and t.median_us < 5e4


def test_water_box_fast_keeps_the_recipe():
    """Same density, cell, molecule geometry and neighbour density as systems.water_box; no overlapping
    molecules (jittered lattice)."""
    n = 768
    fast, loop = bench_large.water_box_fast(n, seed=1), water_box(n, seed=1)
    assert len(fast) == len(loop) == n and (fast.numbers == loop.numbers).all()
    np.testing.assert_allclose(fast.cell.array, loop.cell.array)
    grams = fast.get_masses().sum() / 6.02214076e23
    assert grams / (fast.get_volume() * 1e-24) == pytest.approx(1.0, rel=0.01)
    pos = fast.positions.reshape(-1, 3, 3)
    oh = np.linalg.norm(pos[:, 1:] - pos[:, :1], axis=-1)
    np.testing.assert_allclose(oh, np.linalg.norm(loop.positions[1] - loop.positions[0]), atol=1e-9)
    hh = np.linalg.norm(pos[:, 1] - pos[:, 2], axis=-1)
    np.testing.assert_allclose(hh, np.linalg.norm(loop.positions[1] - loop.positions[2]), atol=1e-9)
    from mlff_distiller import AtomsBatch

    edges = [neighbor_list_batch(AtomsBatch.from_atoms(a), 5.0).num_edges for a in (fast, loop)]
    assert edges[0] == pytest.approx(edges[1], rel=0.05)
    o = fast.positions[::3]
    d = o[:, None] - o[None]
    d -= fast.cell[0, 0] * np.round(d / fast.cell[0, 0])
    r = np.linalg.norm(d, axis=-1) + np.eye(len(o)) * 99
    assert r.min() > 2.0


def test_student_size_options_reach_the_model_and_the_report(tmp_path):
    """--hidden/--layers benchmark another student size (builtin:chno-gfn2-small is 64 x 3); the report says which."""
    size = ["--hidden", "32", "--layers", "2"]
    data = bench_large.main(["--quick", "--out", str(tmp_path), "--sections", "check,ef", "--sizes", "24", *size])
    from mlff_distiller import StudentModel

    expected = sum(p.numel() for p in StudentModel(species=[1, 6, 7, 8], hidden=32, layers=2).parameters())
    md = (tmp_path / "bench_large.md").read_text()
    assert f"PaiNN 32 features x 2 layers ({expected:,} parameters" in md
    assert data["correctness"] and all(r.get("step_us", 1) > 0 for r in data["energy_forces"])
