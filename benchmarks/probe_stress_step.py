"""Why a padded stress call costs more than an energy + forces call of the same periodic box (GPU).

    python benchmarks/probe_stress_step.py --out results/ [--sizes 192 3000] [--hidden 128 --layers 3]

``bench_stress.py`` measured, wall clock per ``engine.compute(batch, stress=..., to_host=True)`` with a fresh list
per call, 1.46 vs 1.05 ms at 192 water atoms (stop 23; 1.69 vs 1.42 in stop 25) for the shipped student's size.
The stress step adds little device work on paper (the shift-vector gradient is written by the edge backward
anyway; ``edge_virial`` is a handful of small kernels). This probe splits the two calls, in one process, for
each box:

* wall clock of the whole call (median of ``--reps``), as bench_stress reports it;
* the replay of the captured step alone (the bucket's runner, CUDA events around ``replay()``);
* torch.profiler over ``--prof`` calls: device time per call, kernel launches per call, and the ten kernels and
  host-side operations that differ most between the two calls.

Both calls are first checked against each other (energy and forces agree to fp32 rounding). Seeded random
weights (the cost does not depend on them). Writes ``<out>/<name>.md``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import environment, write_lines
from peers import make_student
from systems import water_box

from mlff_distiller import AtomsBatch, ForceEngine


def _wall_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def _replay_ms(runner, reps: int) -> float:
    if not torch.cuda.is_available():
        return float("nan")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        runner.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _profile(fn, calls: int) -> tuple[Counter, Counter, Counter]:
    """(device µs per kernel name, launches per kernel name, host µs per CPU op name), summed over ``calls``."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(calls):
            fn()
        if cuda:
            torch.cuda.synchronize()
    dev_us, launches, host_us = Counter(), Counter(), Counter()
    for ev in prof.key_averages():
        dev = getattr(ev, "device_time_total", None)
        if dev is None:
            dev = getattr(ev, "cuda_time_total", 0.0)
        if ev.device_type is not None and "CUDA" in str(ev.device_type):
            dev_us[ev.key] += dev
            launches[ev.key] += ev.count
        else:
            host_us[ev.key] += ev.self_cpu_time_total
    return dev_us, launches, host_us


class _PhaseTimer:
    """Host µs spent inside chosen methods and module functions (perf_counter around each call, no
    synchronisation added): a phase that grows absorbs a wait for the device. Nested phases overlap."""

    def __init__(self, targets: list[tuple[object, str]]) -> None:
        self.spent: Counter = Counter()
        self.targets = targets
        self.saved: list[tuple[object, str, object, bool]] = []

    def __enter__(self) -> _PhaseTimer:
        for obj, name in self.targets:
            f = getattr(obj, name)
            own = name in getattr(obj, "__dict__", {})

            def wrapper(*a, _f=f, _name=name, **k):
                t0 = time.perf_counter()
                try:
                    return _f(*a, **k)
                finally:
                    self.spent[_name] += time.perf_counter() - t0

            self.saved.append((obj, name, f, own))
            setattr(obj, name, wrapper)
        return self

    def __exit__(self, *exc) -> None:
        for obj, name, f, own in reversed(self.saved):
            if own or isinstance(obj, type(sys)):
                setattr(obj, name, f)
            else:
                delattr(obj, name)  # back to the class's method
        self.saved.clear()

    def per(self, calls: int) -> dict[str, float]:
        return {k: 1e6 * v / calls for k, v in self.spent.items()}


def _phases(engine, fn, calls: int) -> dict[str, float]:
    """Host µs per call inside each phase of the padded call."""
    from mlff_distiller import engine_padded

    targets = [(engine, m) for m in ("_device_topology", "_neighbors", "_run", "_run_padded")]
    targets += [(engine_padded, "fill_padded"), (engine_padded, "_with_stress")]
    with _PhaseTimer(targets) as timer:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        timer.spent["whole call"] = time.perf_counter() - t0
    return timer.per(calls)


def npt_phases(model, n: int, steps: int, device: torch.device) -> list[str]:
    """Where one ASE NPTBerendsen step goes on the host (the default calculator: padded stress step, Verlet list
    kept across cell changes), µs per step; "ASE and the rest" is the step minus the calculator's calculate."""
    from mlff_distiller import StudentCalculator, engine_padded
    from mlff_distiller.distill import npt_berendsen

    atoms = water_box(n, seed=2)
    atoms.calc = calc = StudentCalculator(model, device=device)
    dyn = npt_berendsen(atoms, taup_fs=200.0)
    dyn.run(20)
    engine = calc.engine
    targets = [(calc, "calculate"), (calc, "_batch"), (engine, "compute"), (engine, "_run_padded")]
    targets += [(engine, "_run"), (engine, "_write_positions"), (engine, "_verlet_list")]
    targets += [(engine.verlet, "needs_rebuild"), (engine.verlet, "_apply_cell"), (engine_padded, "_with_stress")]
    targets += [(engine, "_write_shift_vectors"), (engine.verlet, "_make_shift_vectors")]
    targets = [(obj, name) for obj, name in targets if hasattr(obj, name)]  # (older code: some are missing)
    with _PhaseTimer(targets) as timer:
        t0 = time.perf_counter()
        dyn.run(steps)
        whole = time.perf_counter() - t0
    per = timer.per(steps)
    per["whole step"] = 1e6 * whole / steps
    per["ASE and the rest (step minus calculate)"] = per["whole step"] - per.get("calculate", 0.0)
    lines = [
        f"## One NPTBerendsen step, {n} water atoms ({steps} steps; µs per step, 2 calculations per step)",
        "",
        "| phase | µs per step |",
        "|---|---:|",
    ]
    lines += [f"| `{k}` | {v:.1f} |" for k, v in sorted(per.items(), key=lambda kv: -kv[1])]
    return [*lines, ""]


def probe(n: int, model, reps: int, prof_calls: int, device: torch.device) -> list[str]:
    batch = AtomsBatch.from_atoms([water_box(n, seed=2)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # on a CPU: "cudagraph" runs the padded steps eagerly
        engine = ForceEngine(model, device=device, precision="fp32", mode="cudagraph")
    out = {}
    for stress in (False, True):
        for _ in range(5):
            out[stress] = engine.compute(batch, stress=stress, to_host=True)
    dev_e = float((out[True]["energy"] - out[False]["energy"]).abs().max())
    dev_f = float((out[True]["forces"] - out[False]["forces"]).abs().max())
    scale = float(out[False]["forces"].abs().max())
    if dev_f > 1e-4 * scale:
        raise AssertionError(f"{n} atoms: the stress call's forces differ from the plain call's by {dev_f:.3e}")
    bucket = engine.last_bucket
    lines = [
        f"## {n} water atoms, bucket {bucket}",
        "",
        f"Stress call vs plain call: max |ΔE| {dev_e:.2e} eV, max |ΔF| {dev_f:.2e} eV/Å (largest |F| {scale:.2f}).",
        "",
        "| call | wall ms (median) | replay alone ms | device µs / call (profiler) | kernels / call |",
        "|---|---:|---:|---:|---:|",
    ]
    profiles, phases = {}, {}
    for stress in (False, True):

        def call(stress=stress):
            engine.compute(batch, stress=stress, to_host=True)

        wall = _wall_ms(call, reps)
        runners = engine._stress_runners if stress else engine._runners
        replay = _replay_ms(runners[bucket], reps) if bucket in runners else float("nan")
        phases[stress] = _phases(engine, call, reps)
        dev_us, launches, host_us = _profile(call, prof_calls)
        profiles[stress] = (dev_us, launches, host_us)
        lines.append(
            f"| {'stress' if stress else 'energy + forces'} | {wall:.3f} | {replay:.3f} | "
            f"{sum(dev_us.values()) / prof_calls:.1f} | {sum(launches.values()) / prof_calls:.1f} |"
        )
    lines += [
        "",
        "Host µs per call inside each phase (nested: `_run_padded` holds `_run` and the copy to the host):",
        "",
        "| phase | plain µs | stress µs | difference |",
        "|---|---:|---:|---:|",
    ]
    for k in sorted(set(phases[False]) | set(phases[True])):
        pa, pb = phases[False].get(k, 0.0), phases[True].get(k, 0.0)
        lines.append(f"| `{k}` | {pa:.1f} | {pb:.1f} | {pb - pa:+.1f} |")
    for title, idx, unit in (("device kernels", 0, "µs"), ("host-side operations (self CPU)", 2, "µs")):
        a, b = profiles[False][idx], profiles[True][idx]
        keys = sorted(set(a) | set(b), key=lambda k: -abs(b.get(k, 0.0) - a.get(k, 0.0)))[:12]
        lines += [
            "",
            f"Largest differences, {title}, {unit} per call (stress minus plain):",
            "",
            f"| name | plain {unit} | stress {unit} | difference |",
            "|---|---:|---:|---:|",
        ]
        for k in keys:
            pa, pb = a.get(k, 0.0) / prof_calls, b.get(k, 0.0) / prof_calls
            lines.append(f"| `{k[:90]}` | {pa:.1f} | {pb:.1f} | {pb - pa:+.1f} |")
    return [*lines, ""]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="*", default=[192, 3000], help="water boxes (none: the NPT table only)")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--prof", type=int, default=20)
    ap.add_argument("--npt-steps", type=int, default=300, help="NPTBerendsen steps of the phase table (0: none)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    ap.add_argument("--name", default="probe_stress_step_h100")
    args = ap.parse_args(argv)
    # On a CPU (a smoke run of the same code; mode "cudagraph" runs the padded steps eagerly there) the numbers
    # say nothing about the GPU.
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    env = environment(device, copy_gbps=0.0)
    model = make_student(hidden=args.hidden, layers=args.layers)
    lines = [
        "# probe_stress_step.py: a padded stress call against an energy + forces call",
        "",
        f"{env.device} · torch {env.torch} · triton {env.triton} · commit {env.commit} · "
        f"student {args.hidden} x {args.layers}, seeded random weights, fp32, mode cudagraph, a fresh list per call",
        "",
    ]
    for n in args.sizes:
        lines += probe(n, model, args.reps, args.prof, device)
    if args.npt_steps:
        lines += npt_phases(model, 192, args.npt_steps, device)
    write_lines(lines, args.out, args.name)


if __name__ == "__main__":
    main()
