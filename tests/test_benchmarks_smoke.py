"""Fast CPU checks of the benchmark suite's pieces (benchmarks/run_all.py, peers.py, bench_breakdown.py)."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from ase import Atoms
from ase.build import molecule

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_breakdown  # noqa: E402
import peers  # noqa: E402
import run_all  # noqa: E402

from mlff_distiller import AtomsBatch, ForceEngine, kernels  # noqa: E402
from mlff_distiller.engine_padded import unpack  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def _schnet_energy_with_cdist_edges(model, atoms: Atoms) -> torch.Tensor:
    """SchNet energy with edges from an all-pairs distance matrix (no periodic images): an independent graph."""
    pos = torch.tensor(atoms.positions, dtype=torch.float32)
    d = torch.cdist(pos.double(), pos.double())
    i, j = torch.nonzero((d < model.cutoff) & (d > 0), as_tuple=True)
    model.interaction_graph.edges = (torch.stack([i, j]), torch.zeros(len(i), 3))
    z = torch.tensor(atoms.numbers)
    return model(z, pos, torch.zeros(len(atoms), dtype=torch.long)).reshape(-1)


def test_schnet_peer_matches_size_and_independent_edges():
    pytest.importorskip("torch_geometric.nn.models", reason="PyG SchNet peer needs torch_geometric")
    target = peers.count_params(peers.make_student())
    impl = peers.SchNetImpl("schnet", target, 5.0, "cpu")
    assert impl.available, impl.why_unavailable
    assert abs(impl.params - target) / target < 0.02
    atoms = molecule("C6H6")
    ours = impl.energy_forces(AtomsBatch.from_atoms(atoms), forces=True)
    ref = _schnet_energy_with_cdist_edges(impl.model, atoms)
    torch.testing.assert_close(ours["energy"], ref, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(ours["forces"]).all() and ours["forces"].abs().max() > 0
    # Forces are -dE/dr: a finite difference along one coordinate agrees.
    h = 1e-2
    plus, minus = atoms.copy(), atoms.copy()
    plus.positions[0, 0] += h
    minus.positions[0, 0] -= h
    e_p = impl.energy_forces(AtomsBatch.from_atoms(plus), forces=False)["energy"]
    e_m = impl.energy_forces(AtomsBatch.from_atoms(minus), forces=False)["energy"]
    fd = -(e_p - e_m) / (2 * h)
    assert abs(float(fd) - float(ours["forces"][0, 0])) < 2e-2 * max(1.0, abs(float(fd)))


def test_schnet_peer_uses_periodic_images():
    """A periodic box and its 2x1x1 supercell: the supercell's energy is twice the box's (extensive), which only
    holds when edges across the boundary (our shift vectors) reach SchNet."""
    pytest.importorskip("torch_geometric.nn.models", reason="PyG SchNet peer needs torch_geometric")
    from systems import water_box

    box = water_box(24, seed=3)
    impl = peers.SchNetImpl("schnet", 50_000, 5.0, "cpu")
    e1 = impl.energy_forces(AtomsBatch.from_atoms(box), forces=False)["energy"]
    e2 = impl.energy_forces(AtomsBatch.from_atoms(box.repeat((2, 1, 1))), forces=False)["energy"]
    torch.testing.assert_close(e2, 2 * e1, rtol=1e-4, atol=1e-4)
    # Without periodicity the same atoms give a different (surface) energy, so the check above has teeth.
    open_box = box.copy()
    open_box.pbc = False
    e_open = impl.energy_forces(AtomsBatch.from_atoms(open_box), forces=False)["energy"]
    assert abs(float(e_open - e1)) > 1e-3


def test_breakdown_instrumentation_keeps_the_math_and_is_undone():
    model = peers.make_student().float()
    atoms = molecule("H2O")
    batch = AtomsBatch.from_atoms(atoms, dtype=torch.float32)
    before = (kernels.edge_basis, kernels.message_passing)
    clock = bench_breakdown._StageClock(torch.device("cpu"), timed=True)
    with kernels.use_backend("torch"):
        energy, forces = bench_breakdown.instrumented_step(model, batch, clock)
        ref = ForceEngine(model, device="cpu", precision="fp32").compute(batch)
    assert (kernels.edge_basis, kernels.message_passing) == before
    torch.testing.assert_close(energy, ref["energy"], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(forces, ref["forces"], rtol=1e-5, atol=1e-6)
    expected = {
        "neighbour list",
        "edge features",
        "basis",
        "embedding",
        "message φ MLP",
        "message aggregation",
        "update",
        "readout",
        "backward",
    }
    assert expected <= set(clock.times)
    assert all(t >= 0 for t in clock.times.values())


def test_breakdown_labels_the_fused_readout():
    """Frozen weights on the Triton backend (the interpreter here): the model's readout runs as
    kernels.linear.readout, which the breakdown times as the "readout" stage and restores afterwards."""
    if not kernels.triton_available("cpu"):
        pytest.skip("needs the Triton interpreter (TRITON_INTERPRET=1)")
    model = peers.make_student().float()
    for p in model.parameters():
        p.requires_grad_(False)
    batch = AtomsBatch.from_atoms(molecule("H2O"), dtype=torch.float32)
    before = kernels.linear.readout
    calls = []

    def spy(*args, **kwargs):
        calls.append(1)
        return before(*args, **kwargs)

    kernels.linear.readout = spy
    try:
        clock = bench_breakdown._StageClock(torch.device("cpu"), timed=True)
        with kernels.use_backend("triton"):
            bench_breakdown.instrumented_step(model, batch, clock)
        assert kernels.linear.readout is spy  # restored
    finally:
        kernels.linear.readout = before
    assert calls and "readout" in clock.times


def test_breakdown_and_launch_count_on_cpu(tmp_path):
    r = bench_breakdown.breakdown(peers.make_student(), [molecule("CH4")], torch.device("cpu"), "torch", reps=1)
    assert r["step_us_instrumented"] > 0
    # The stages plus "other" make up the step (stages never nest, so they cannot exceed it).
    assert sum(r["stages_frac"].values()) == pytest.approx(1.0, abs=0.02)
    trace = tmp_path / "t.json.gz"
    counts = bench_breakdown.profile_step(peers.make_student(), [molecule("CH4")], torch.device("cpu"), "torch", trace)
    assert counts["torch_ops_per_step"] > 10
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    assert any(e.get("name") == "message aggregation" for e in events)


def test_annotate_ratios():
    rows = [
        {"section": "latency", "system": "X", "task": "t", "batch": 1, "kind": "ours", "us": 10.0},
        {"section": "latency", "system": "X", "task": "t", "batch": 1, "kind": "ours", "us": 20.0},
        {"section": "latency", "system": "X", "task": "t", "batch": 1, "kind": "reference", "us": 40.0},
        {"section": "latency", "system": "X", "task": "t", "batch": 1, "kind": "peer", "us": 5.0},
        {"section": "latency", "system": "Y", "task": "t", "batch": 1, "kind": "peer", "us": 5.0},
    ]
    run_all.annotate(rows)
    assert [r.get("x_ours") for r in rows] == [1.0, 2.0, 4.0, 0.5, None]
    assert rows[0]["vs_reference"] == 4.0 and rows[3]["vs_reference"] == 8.0


def test_run_all_quick_end_to_end(tmp_path):
    """A reduced CPU run: latency and sweep with ours, the reference and SchNet; files and ratios present."""
    rc = run_all.main([
        "--device", "cpu", "--quick", "--out", str(tmp_path), "--name", "smoke", "--budget-s", "600",
        "--sections", "latency,sweep", "--impls", "ours,ref,schnet", "--molecules", "H2O",
        "--sweep-sizes", "1,3",
    ])  # fmt: skip
    assert rc == 0
    data = json.loads((tmp_path / "smoke.json").read_text())
    timed = [r for r in data["rows"] if "us" in r]
    assert {r["section"] for r in timed} == {"latency", "sweep"}
    assert all(np.isfinite(r["us"]) and r["us"] > 0 for r in timed)
    assert all("x_ours" in r for r in timed)
    md = (tmp_path / "smoke.md").read_text()
    assert "PyG SchNet" in md and "ours ×" in md and "Seeds' numbers" in md
    assert (tmp_path / "smoke-sweep.png").stat().st_size > 1000


@pytest.mark.parametrize(
    "argv",
    [["--sections", "nope"], ["--impls", "ours,bogus"], ["--sweep-sizes", "1,x", "--sections", "sweep"]],
)
def test_run_all_rejects_bad_arguments(argv, tmp_path):
    with pytest.raises(ValueError):
        run_all.main(["--device", "cpu", "--out", str(tmp_path), "--budget-s", "5", *argv])


def test_startup_children_time_each_phase():
    import bench_startup

    rows = bench_startup.run_startup(
        peers.make_student(), "cpu", lambda: 100.0, variants=[("eager", ["--mode", "eager"])]
    )
    assert [(r["impl"], r["phase"]) for r in rows] == [("eager", "cold"), ("eager", "warm")]
    for r in rows:
        assert "error" not in r, r
        assert r["import_torch_s"] > 0 and r["import_package_s"] > 0 and r["first_result_s"] > 0
        assert r["import_ase_build_s"] > 0 and r["steady_call_ms"] > 0
    skipped = bench_startup.run_startup(peers.make_student(), "cpu", lambda: 0.0)
    assert skipped and all("skipped" in r for r in skipped)


def test_step_only_rows_on_the_padded_path():
    """StepImpl drives the engine's bucket internals (the GPU replay path); on a CPU the padded modes run the
    padded eager step, so the same code is exercised here: its energy equals the eager engine's."""
    import warnings

    model = peers.make_student()
    atoms = [molecule("C6H6"), molecule("H2O")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "CUDA graphs need a CUDA device": expected on CPU
        step = peers.StepImpl("step", "ours", model, "cpu", mode="cudagraph")
    assert step.available and step.engine.pad
    packed = step.prepare(atoms, True)()
    ref = ForceEngine(model, device="cpu").compute(AtomsBatch.from_atoms(atoms, dtype=torch.float32))
    (bucket,) = step.engine._graphs  # the one bucket the step filled
    got = unpack(packed, bucket.atoms, sum(map(len, atoms)), 2)  # (the float64 energies' bytes come first)
    torch.testing.assert_close(got["energy"], ref["energy"], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="energy \\+ forces"):
        step.prepare(atoms, False)


def test_bench_host_checks_and_writes(tmp_path):
    """bench_host.py runs its host phases on the CPU (each shipped path checked equal to its reference first)."""
    import bench_host

    assert bench_host.main(["--sizes", "3", "40", "--reps", "1", "--out", str(tmp_path), "--name", "h"]) == 0
    text = (tmp_path / "h.md").read_text()
    for phase in ("from_atoms", "molecular list", "result rows"):
        assert text.count(f"| {phase}") == 2
    mols = bench_host.g2_batch(40)
    got, want = bench_host.result_rows, bench_host.rows_reference
    batch = AtomsBatch.from_atoms(mols)
    out = {
        "energy": torch.randn(40),
        "forces": torch.randn(batch.num_atoms, 3),
        "atomic_energies": torch.randn(len(batch.numbers)),
    }
    for a, b in zip(got(batch, out), want(batch, out), strict=True):
        assert a["energy"] == b["energy"] and np.array_equal(a["forces"], b["forces"])
        assert np.array_equal(a["energies"], b["energies"])


def test_bench_stress_quick_writes_checked_rows(tmp_path):
    """bench_stress.py --quick (CPU): every variant checked against the reference before timing, the padded
    variants ran padded, the report and JSON written, the NPT rows finite."""
    import bench_stress

    data = bench_stress.main(
        [
            "--quick",
            "--out",
            str(tmp_path),
            "--reps",
            "2",
            "--npt-steps",
            "4",
            "--teacher",
            "emt",
            "--teacher-steps",
            "2",
        ]
    )
    rows = data["compute"]
    assert [r["variant"] for r in rows] == [v[0] for v in bench_stress.VARIANTS]
    assert all(r["max_rel_dev"] <= 1e-4 and r["median_us"] > 0 for r in rows)
    assert [r["padded"] for r in rows] == [False, False, True, True]
    assert len(data["npt"]) == 5 and all(r["finite"] for r in data["npt"])
    auto, fresh = data["npt"][0], data["npt"][2]
    assert auto["cell_updates"] > 0 and auto["list_builds"] == 1  # the list kept across the barostat's cells
    assert fresh["list_builds"] is None and abs(auto["volume_change"]) > 0
    assert data["npt"][4]["variant"] == "teacher emt"
    assert "NPT speed-up, teacher / student" in (tmp_path / "bench_stress.md").read_text()
    md = (tmp_path / "bench_stress.md").read_text()
    assert "| 24 | ours cudagraph, stress step | yes |" in md
    assert json.loads((tmp_path / "bench_stress.json").read_text())["model"] == "128 x 3"
