"""Per-stage breakdown of one energy + forces step, a chrome trace, and kernel launches per step.

The model is not edited: the stages are marked from the benchmark side. ``kernels.edge_basis`` and
``kernels.message_passing`` (looked up by the model at call time) are wrapped for the duration of a run, and
forward hooks on the model's sub-modules open and close the other ranges. Each stage runs inside
``torch.profiler.record_function(<stage>)`` (visible in the trace) and, for the timing table, between two
device synchronisations: a stage's time is what it costs when nothing overlaps it, launch overhead included
(the regime small molecules live in). With the Triton backend edge geometry and basis are one fused kernel,
timed as one stage; the torch reference runs them as two.

Stages: neighbour list, edge features, basis (or the fused pair), embedding, message φ MLP, message
aggregation, update, readout (+ energy sum), backward (one ``autograd.grad``).

    python benchmarks/bench_breakdown.py [--device cuda] [--quick] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import shutil
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import environment, sync

from mlff_distiller import AtomsBatch, kernels
from mlff_distiller.neighbors import neighbor_list

__all__ = ["STAGES", "breakdown", "count_launches", "instrumented_step"]

STAGES = (
    "neighbour list",
    "edge features",
    "basis",
    "edge features + basis (fused)",
    "embedding",
    "message φ MLP",
    "message aggregation",
    "update",
    "readout",
    "backward",
)
# Host calls that put work on the GPU (runtime and driver API; Triton launches through the driver).
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")


class _StageClock:
    """Accumulates synchronised wall time per stage for the current step."""

    def __init__(self, device: torch.device, timed: bool) -> None:
        self.device, self.timed = device, timed
        self.times: dict[str, float] = defaultdict(float)
        self._open: dict[str, tuple[float, object]] = {}

    def enter(self, name: str) -> None:
        rf = record_function(name)
        rf.__enter__()
        if self.timed:
            sync(self.device)
        self._open[name] = (time.perf_counter(), rf)

    def exit(self, name: str) -> None:
        if self.timed:
            sync(self.device)
        t0, rf = self._open.pop(name)
        self.times[name] += time.perf_counter() - t0
        rf.__exit__(None, None, None)

    @contextlib.contextmanager
    def stage(self, name: str):
        self.enter(name)
        try:
            yield
        finally:
            self.exit(name)


@contextlib.contextmanager
def _instrument(model: torch.nn.Module, clock: _StageClock):
    """Wrap the model's kernel calls and hook its sub-modules so every stage is marked; undone on exit."""
    orig_basis, orig_mp = kernels.edge_basis, kernels.message_passing

    def edge_basis(positions, edge_index, shift_vectors, n_rbf, cutoff, basis="bessel", envelope="cosine", wall=None):
        if kernels.resolve_backend(positions.device) == "triton":
            with clock.stage("edge features + basis (fused)"):
                return orig_basis(positions, edge_index, shift_vectors, n_rbf, cutoff, basis, envelope, wall=wall)
        # The torch reference of the fused op is these calls (kernels.edge_basis_reference; the wall's gate is
        # exactly 1 outside it, where the reference skips it on the CPU).
        with clock.stage("edge features"):
            _, dist, unit = kernels.edge_features(positions, edge_index, shift_vectors)
        with clock.stage("basis"):
            rbf = kernels.rbf_cutoff(dist, n_rbf, cutoff, basis, envelope)
            if wall is not None:
                rbf = rbf * kernels.wall_gate_reference(dist, edge_index, *wall).unsqueeze(-1)
        return dist, unit, rbf

    def message_passing(*args, **kwargs):
        with clock.stage("message aggregation"):
            return orig_mp(*args, **kwargs)

    # The model runs its MLPs through kernels.mlp with the weights (not the nn.Sequential, whose hooks below
    # then stay silent): the stage is found from the first layer's weight.
    orig_mlp = kernels.mlp
    mlp_stage = {id(getattr(inter, "inner", inter).phi[0].weight): "message φ MLP" for inter in model.interactions}
    mlp_stage[id(model.readout[0].weight)] = "readout"

    def mlp(x, w1, *rest):
        with clock.stage(mlp_stage.get(id(w1), "other MLP")):
            return orig_mlp(x, w1, *rest)

    # Where the readout's Triton GEMMs run (frozen weights, Triton backend) the model calls kernels.linear.readout
    # (scale, shift and energy sum fused) instead of kernels.mlp.
    orig_readout = kernels.linear.readout

    def readout(*args, **kwargs):
        with clock.stage("readout"):
            return orig_readout(*args, **kwargs)

    hooks = []

    def mark(module, name):
        hooks.append(module.register_forward_pre_hook(lambda *_: clock.enter(name)))
        hooks.append(module.register_forward_hook(lambda *_: clock.exit(name)))

    mark(model.embedding, "embedding")
    for inter in model.interactions:
        mark(getattr(inter, "inner", inter).phi, "message φ MLP")
    for upd in model.updates:
        mark(upd, "update")
    mark(model.readout, "readout")
    kernels.edge_basis, kernels.message_passing, kernels.mlp = edge_basis, message_passing, mlp
    kernels.linear.readout = readout
    try:
        yield
    finally:
        kernels.edge_basis, kernels.message_passing, kernels.mlp = orig_basis, orig_mp, orig_mlp
        kernels.linear.readout = orig_readout
        for h in hooks:
            h.remove()


def instrumented_step(model, batch: AtomsBatch, clock: _StageClock):
    """One eager energy + forces step of ``model`` on a device ``batch``, every stage marked.

    Returns (energy [B] eV, forces [N, 3] eV/Å)."""
    with clock.stage("neighbour list"), torch.no_grad():
        nl = neighbor_list(batch.positions, batch.cell, batch.pbc, batch.batch, batch.ptr, model.cutoff)
    with torch.enable_grad(), _instrument(model, clock):
        pos = batch.positions.detach().requires_grad_(True)
        out = model(batch.numbers, pos, nl.edge_index, nl.shift_vectors, batch.batch, batch.num_structures)
        with clock.stage("backward"):
            (g,) = torch.autograd.grad(out["energy"].sum(), pos)
    return out["energy"].detach(), -g


def count_launches(fn, device: torch.device, steps: int = 5, trace_path: Path | None = None) -> dict:
    """Profile ``steps`` calls of ``fn`` (after one warm call): device kernels and host launch calls per call
    (CUDA), or torch operators per call (CPU). Optionally writes the chrome trace (gzipped) to ``trace_path``.
    Also returns host launch calls per stage when ``fn`` marks stages with ``record_function``."""
    fn()
    sync(device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            with record_function("step"):
                fn()
        sync(device)
    events = prof.events()
    out: dict = {"steps": steps}
    ranges = defaultdict(list)
    for e in events:
        if e.name in STAGES:
            ranges[e.name].append((e.time_range.start, e.time_range.end))
    if device.type == "cuda":
        dev_events = [e for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
        kern = [e for e in dev_events if not e.name.startswith(("Memcpy", "Memset", "gpu_user_annotation"))]
        kern = [e for e in kern if e.name not in STAGES and e.name != "step"]
        launches = [e for e in events if e.name in LAUNCH_CALLS]
        out["kernels_per_step"] = len(kern) / steps
        out["host_launches_per_step"] = len(launches) / steps
        out["graph_launches_per_step"] = sum(e.name == "cudaGraphLaunch" for e in launches) / steps
        per_stage = {}
        for name, spans in ranges.items():
            n = sum(any(a <= e.time_range.start <= b for a, b in spans) for e in launches)
            per_stage[name] = n / steps
        out["host_launches_per_stage"] = per_stage
    else:
        ops = [e for e in events if e.name.startswith("aten::")]
        out["torch_ops_per_step"] = len(ops) / steps
    if trace_path is not None:
        raw = trace_path.with_suffix("")  # "x.json.gz" -> "x.json"
        prof.export_chrome_trace(str(raw))
        with raw.open("rb") as src, gzip.open(trace_path, "wb") as dst:
            shutil.copyfileobj(src, dst)
        raw.unlink()
        out["trace"] = trace_path.name
    return out


def breakdown(model, structures, device: torch.device, backend: str, reps: int = 10) -> dict:
    """Median synchronised time per stage (µs) of an eager step of ``model`` with kernel ``backend``, the
    un-instrumented step time for comparison, and the stages' share of the instrumented step."""
    model = model.to(device=device, dtype=torch.float32).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    batch = AtomsBatch.from_atoms(list(structures), dtype=torch.float32).to(device)
    per_stage: dict[str, list[float]] = defaultdict(list)
    totals = []
    with kernels.use_backend(backend):
        for k in range(reps + 2):
            clock = _StageClock(device, timed=True)
            sync(device)
            t0 = time.perf_counter()
            instrumented_step(model, batch, clock)
            sync(device)
            if k < 2:
                continue  # warm-up: kernel compilation, allocator
            totals.append(time.perf_counter() - t0)
            for name, t in clock.times.items():
                per_stage[name].append(t)
    stages = {name: 1e6 * statistics.median(v) for name, v in per_stage.items()}
    total = 1e6 * statistics.median(totals)
    stages["other (energy sum, glue)"] = max(0.0, total - sum(stages.values()))
    return {
        "backend": backend,
        "atoms": batch.num_atoms,
        "structures": batch.num_structures,
        "step_us_instrumented": total,
        "stages_us": stages,
        "stages_frac": {k: v / total for k, v in stages.items()},
    }


def profile_step(model, structures, device: torch.device, backend: str, trace_path: Path | None) -> dict:
    """Kernel and launch counts of one instrumented eager step (no synchronisation inside)."""
    model = model.to(device=device, dtype=torch.float32).eval()
    batch = AtomsBatch.from_atoms(list(structures), dtype=torch.float32).to(device)
    clock = _StageClock(device, timed=False)
    with kernels.use_backend(backend):
        return count_launches(lambda: instrumented_step(model, batch, clock), device, trace_path=trace_path)


def main(argv=None) -> int:
    from ase.build import molecule
    from peers import make_student
    from systems import water_box

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    env = environment(device, float("nan"))
    backends = ["torch"] + (["triton"] if device.type == "cuda" else [])
    rows = []
    for name, structs in (("C6H6", [molecule("C6H6")]), ("water", [water_box(96 if args.quick else 3000)])):
        for backend in backends:
            row = {"system": name, **breakdown(make_student(), structs, device, backend, reps=3 if args.quick else 10)}
            row["profile"] = profile_step(make_student(), structs, device, backend, None)
            rows.append(row)
            print(json.dumps(row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    tag = "cpu" if device.type == "cpu" else "gpu"
    (args.out / f"bench_breakdown_{tag}.json").write_text(json.dumps({"env": env.__dict__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
