# ruff: noqa: B023  (closures are called inside the loop iteration that made them)
"""Where does one small-molecule step spend its time? (GPU diagnostic for the engine issue.)

Prints, for benzene and a batch of g2 molecules: the CUDA-graph replay time, the kernels of one padded step
(names, counts, device time) from ``torch.profiler``, and cProfile tables of the host side of
``ForceEngine.compute`` and of an ASE MD step through ``StudentCalculator``; and for a 192-atom periodic water box
with the water student's architecture (hidden 128, 3 layers, 20 RBF, 5 Å: ``configs/water_sevennet_train.yaml``),
the distribution of ``StudentCalculator`` step times in a thermal random walk (median, mean, max, neighbour-list
rebuilds, graph captures) and a host profile of those steps.

    python benchmarks/profile_step.py --out DIR [--sections small,water,variants,large]

``variants``: the CUDA-graph replay of benzene, the 192-atom water box, 1,024 g2 molecules and a 3,000-atom water
box with the message-passing forward and sender backward forced to the "block" or the "atom" variant (the
``block_min_atoms`` rule of ``kernels/message_passing.py``).

``host`` (any device; runs on a CPU): the host cost of one ASE MD step through ``StudentCalculator`` without the
model work. The 192-atom water box runs velocity Verlet (0.5 fs, 300 K) through the calculator's MD path (mode
"cudagraph": on a CPU the padded eager path, the same host code; Verlet skin 1 Å) with the engine's padded step
replaced by a stub that returns a zero output buffer, so what is timed is ASE, the calculator, the Verlet
displacement test, the copies into the bucket and the unpacking: median / p20 / p80 µs per step over 2,000 steps
(list rebuilds included in the mean only), then a cProfile table (internal time) of the steps among 500 more that
built no list (a build's table would hide the per-step host work under the build's).

    python benchmarks/profile_step.py --sections host

``large``: where the energy + forces step of a large periodic water box goes (issue 7; ~32 ms at 24,000 atoms on
an H100). For the 3,000- and 24,000-atom boxes of ``bench_large.py`` (``systems.water_box``, ~1 g/cm³; the default
student of ``peers.make_student``: hidden 128, 3 layers, float32, seeded random weights) and for its two step rows,
"ours eager" and "ours best (ForceEngine mode auto)" (``peers.StepImpl``: neighbour list built once, then model +
one ``autograd.grad``, or the captured replay of the padded step): the wall median of the step
(``triton.testing.do_bench``), the peak memory of the row, the kernel table of one step (names, counts, device
time) and a summary by kernel group (lines starting ``group``): each ``_mp_*`` message-passing kernel on its own,
GEMMs (cuBLAS / CUTLASS), torch elementwise / reduce / index kernels, other torch kernels, memcpy / memset, other
Triton kernels; device µs per step, per launch and % of the summed device time. Without CUDA it prints one line
and returns.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from systems import g2_chno

from mlff_distiller import ForceEngine, StudentCalculator, load_model
from mlff_distiller.batch import AtomsBatch


def _kernel_table(fn, reps: int = 5, rows: int = 40, groups: bool = False) -> str:
    """Kernels of ``fn`` (``reps`` calls after one untimed call); ``groups``: also ``_kernel_groups`` of them."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    total_us = sum(e.device_time for e in events) / reps
    head = f"device kernels per call: {len(events) / reps:.0f}, summed device time per call: {total_us:.1f} µs\n"
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=70)
    if groups:
        table += "\n" + _kernel_groups([(e.name, e.device_time) for e in events], reps)
    return head + table


def _kernel_group(name: str) -> str:
    """The group of one device kernel name (``_kernel_groups``); torch kernels by their function's name, not by
    the template arguments (a functor's name may say "index" or "reduce")."""
    if name.startswith("_mp_"):
        return name
    low = name.lower()
    if "memcpy" in low or "memset" in low:
        return "memcpy / memset"
    head = low.removeprefix("void ").replace("(anonymous namespace)", "anon").split("<")[0].split("(")[0]
    if any(k in head for k in ("gemm", "xmma", "cutlass", "gemv", "splitkreduce")):
        return "GEMM (cuBLAS / CUTLASS)"
    if head.startswith(("at::", "at_cuda_detail::", "cub::")):
        if any(k in head for k in ("index", "scatter", "gather")):
            return "torch index / scatter / gather"
        if "reduce" in head:
            return "torch reduce"
        if "elementwise" in head:
            return "torch elementwise"
        return "torch other (sort, cat, search, ...)"
    if re.fullmatch(r"[A-Za-z_]\w*", name):
        return "Triton (other)"
    return "other"


def _kernel_groups(kernels: list[tuple[str, float]], reps: int, top: int = 3) -> str:
    """Summary of device kernels by ``_kernel_group``: ``kernels`` = (name, device µs) of every launch in ``reps``
    calls. One line per group (``group ...``): launches and device µs per call, µs per launch, % of the summed
    device time; under a group of several names, its ``top`` names by time."""
    per: dict[str, dict[str, list[float]]] = {}
    for name, us in kernels:
        per.setdefault(_kernel_group(name), {}).setdefault(name, []).append(us)
    total = sum(us for _, us in kernels) or 1.0
    width = max((len(g) for g in per), default=10)
    lines = [
        f"--- kernel groups: device time per call ({total / reps:.1f} µs summed), launches per call, "
        "µs per launch, % of the summed device time"
    ]
    by_time = sorted(per.items(), key=lambda kv: -sum(sum(v) for v in kv[1].values()))
    for group, names in by_time:
        us = sum(sum(v) for v in names.values())
        n = sum(len(v) for v in names.values())
        lines.append(
            f"group {group:<{width}} {us / reps:10.1f} µs/call {n / reps:7.1f} launches {us / n:9.2f} µs/launch "
            f"{100 * us / total:5.1f} %" + (f"  ({len(names)} names)" if len(names) > 1 else "")
        )
        if len(names) > 1:
            for name, v in sorted(names.items(), key=lambda kv: -sum(kv[1]))[:top]:
                short = name.removeprefix("void ")
                short = short if len(short) <= 90 else short[:87] + "..."
                lines.append(f"      {sum(v) / reps:10.1f} µs/call {len(v) / reps:7.1f} launches  {short}")
    return "\n".join(lines)


def _host_profile(fn, reps: int, rows: int = 35) -> str:
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(rows)
    return s.getvalue()


def _compiled_variants() -> dict[str, int]:
    """Compiled variants per Triton kernel of this package (a step that grows one paid a JIT compile)."""
    from triton.runtime.jit import JITFunction

    out = {}
    for name, mod in list(sys.modules.items()):
        if not (name.startswith("mlff_distiller") or name.startswith("kernels")):
            continue
        for attr, fn in vars(mod).items():
            if isinstance(fn, JITFunction):
                out[f"{name.rsplit('.', 1)[-1]}.{attr}"] = sum(len(v[0]) for v in fn.device_caches.values())
    return out


def _water_steps(n_steps: int = 400) -> list[str]:
    """StudentCalculator step times on a 192-atom water box (the SevenNet-0 example's system and student
    architecture, random weights) while the atoms random-walk by ~0.01 Å per step (about an MD step's motion
    at 300 K and 0.5 fs for H), in each calculator mode."""
    import time

    import numpy as np
    from systems import water_box

    from mlff_distiller import StudentModel

    out = []
    torch.manual_seed(0)
    model = StudentModel(species=[1, 8], hidden=128, layers=3, n_rbf=20, cutoff=5.0)
    for mode in ("auto", "eager"):
        atoms = water_box(192, seed=0)
        calc = StudentCalculator(model, device="cuda", mode=mode)
        atoms.calc = calc
        rng = np.random.default_rng(0)
        times, events = [], []
        for k in range(n_steps + 20):
            atoms.positions = atoms.positions + rng.normal(0, 0.01, atoms.positions.shape)
            before = (_compiled_variants(), getattr(calc.engine.verlet, "n_builds", 0), _graphs(calc.engine))
            t0 = time.perf_counter()
            f = atoms.get_forces()
            times.append(time.perf_counter() - t0)
            if k >= 20 and times[-1] > 0.02:  # what happened in a slow step: list builds, graphs, JIT compiles
                after = _compiled_variants()
                grown = {n: c for n, c in after.items() if c > before[0].get(n, 0)}
                events.append(
                    f"step {k - 20}: {times[-1] * 1e3:.1f} ms, list builds {before[1]}->"
                    f"{getattr(calc.engine.verlet, 'n_builds', 0)}, graphs {before[2]}->{_graphs(calc.engine)}, "
                    f"new JIT variants {grown}"
                )
        assert np.isfinite(f).all()
        t = np.array(times[20:]) * 1e3
        eng = calc.engine
        builds = getattr(getattr(eng, "verlet", None), "n_builds", None)
        out.append(
            f"\n===== water 192 atoms, StudentCalculator(mode={mode!r}), {n_steps} steps: "
            f"median {np.median(t):.3f} ms, "
            f"mean {t.mean():.3f} ms, p90 {np.percentile(t, 90):.3f} ms, max {t.max():.3f} ms; "
            f"list builds {builds}, graphs {_graphs(eng)}"
        )
        out.append("slowest steps (ms, index): " + ", ".join(f"{t[i]:.2f}@{i}" for i in np.argsort(t)[-8:][::-1]))
        out.extend(events[:12])
        runners = {**eng._runners, **{key: md.runner for key, md in eng._md_runners.items()}}
        if mode == "auto" and runners:
            key, runner = next(iter(runners.items()))
            out.append(f"--- kernels of one graph replay (bucket {key})")
            out.append(_kernel_table(runner.replay, rows=30))
        out.append(f"--- host profile of 200 more steps (mode={mode!r})")

        def one():
            atoms.positions = atoms.positions + rng.normal(0, 0.01, atoms.positions.shape)
            atoms.get_forces()

        out.append(_host_profile(one, 200))
    return out


def _graphs(eng) -> int:
    """The engine's captured steps: the plain ones and the MD path's zero-copy ones (stop 66)."""
    return len(getattr(eng, "_runners", {})) + len(getattr(eng, "_md_runners", {}))


def _host_md_steps(n_atoms: int = 192, steps: int = 2000) -> list[str]:
    """Host µs per ASE MD step without the model work (see the module docstring, ``host``)."""
    import time
    import warnings

    import numpy as np
    from ase import units
    from ase.md.verlet import VelocityVerlet
    from systems import water_box

    from mlff_distiller import StudentModel
    from mlff_distiller.ase_compat import maxwell_boltzmann

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = StudentModel(species=[1, 8], hidden=128, layers=3, n_rbf=20, cutoff=5.0)
    atoms = water_box(n_atoms, seed=0)
    maxwell_boltzmann(atoms, 300, rng=np.random.default_rng(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # mode "cudagraph" on a CPU: the padded eager path, with a warning
        calc = StudentCalculator(model, device=device, mode="cudagraph")
    eng = calc.engine
    outputs: dict = {}

    def no_model(bucket, graph, stress=False):  # the padded step's packed output buffer, never computed
        out = outputs.get(bucket)
        if out is None:
            # (the float64 energies' bytes, then atomic energies and forces: engine_padded.unpack)
            size = (8 // eng.dtype.itemsize + 4) * bucket.atoms
            out = outputs[bucket] = torch.zeros(size, dtype=eng.dtype, device=eng.device)
        return out

    eng._run = no_model
    atoms.calc = calc
    dyn = VelocityVerlet(atoms, timestep=0.5 * units.fs)
    dyn.run(50)
    stamps: list[float] = []
    dyn.attach(lambda: stamps.append(time.perf_counter()), interval=1)
    builds0 = eng.verlet.n_builds
    dyn.run(steps)
    t = np.diff(stamps) * 1e6
    out = [
        f"\n===== host cost of an MD step without the model, {n_atoms}-atom water: median {np.median(t):.1f} µs, "
        f"p20 {np.percentile(t, 20):.1f}, p80 {np.percentile(t, 80):.1f} (mean {t.mean():.1f} µs; list builds "
        f"{eng.verlet.n_builds - builds0}); StudentCalculator engine mode {eng.mode!r} on {device}, velocity "
        f"Verlet 0.5 fs, {steps} steps",
    ]
    stats, buf, with_build = None, io.StringIO(), 0
    for _ in range(500):  # one profile per step: those of steps that built a list are left out
        builds = eng.verlet.n_builds
        pr = cProfile.Profile()
        pr.enable()
        dyn.run(1)
        pr.disable()
        if eng.verlet.n_builds != builds:
            with_build += 1
        elif stats is None:
            stats = pstats.Stats(pr, stream=buf)
        else:
            stats.add(pr)
    out.append(f"--- host profile of the {500 - with_build} of 500 more steps without a list build (internal time)")
    stats.sort_stats("tottime").print_stats(30)
    out.append(buf.getvalue())
    return out


def _variant_replays() -> list[str]:
    import importlib

    import triton
    from systems import water_box

    from mlff_distiller import StudentModel

    mp = importlib.import_module("mlff_distiller.kernels.message_passing")  # the module (the package exports the op)
    torch.manual_seed(0)
    water_model = StudentModel(species=[1, 8], hidden=128, layers=3, n_rbf=20, cutoff=5.0)
    builtin = load_model("builtin:chno-gfn2")
    from ase.build import molecule

    cases = [
        ("benzene (builtin)", builtin, [molecule("C6H6")]),
        ("water 192 (water student)", water_model, [water_box(192, seed=0)]),
        ("g2 x1024 (builtin)", builtin, g2_chno(1024)),
        ("water 3000 (water student)", water_model, [water_box(3000, seed=0)]),
    ]
    out = ["\n===== message-passing variant per graph size: CUDA-graph replay, median µs (triton.testing.do_bench)"]
    out.append("| case | atoms | edges (bucket) | all block | all atom | shipped rule | block / atom |")
    out.append("|---|---:|---:|---:|---:|---:|---:|")
    for name, model, structs in cases:
        batch = AtomsBatch.from_atoms(structs)
        row = {}
        for label, min_atoms in (("block", 0), ("atom", 1 << 40), ("rule", mp._CONFIG["block_min_atoms"])):
            with mp._configured(block_min_atoms=min_atoms, fwd_variant="block"):
                eng = ForceEngine(model, device="cuda", mode="cudagraph")
                eng.compute(batch, to_host=True)
                eng.compute(batch, to_host=True)
                bucket, runner = next(iter(eng._runners.items()))
                row[label] = triton.testing.do_bench(runner.replay, warmup=25, rep=200, return_mode="median") * 1e3
        out.append(
            f"| {name} | {batch.num_atoms} | {bucket.edges} | {row['block']:.1f} | {row['atom']:.1f} | "
            f"{row['rule']:.1f} | {row['block'] / row['atom']:.2f} |"
        )
    return out


def _large_steps(sizes: tuple[int, ...] = (3000, 24000), hidden: int = 128) -> list[str]:
    """The energy + forces step of ``bench_large.py`` (its "ours eager" and "ours best" rows) on large water boxes:
    wall median, peak memory, kernel table and kernel groups of one step."""
    if not torch.cuda.is_available():
        return ["large: skipped (no CUDA device; the section profiles the GPU energy + forces step)"]
    import gc
    import warnings

    import triton
    from peers import StepImpl, make_student
    from systems import water_box

    from mlff_distiller.neighbors import neighbor_list

    model = make_student(hidden=hidden)  # bench_large.py's student (hidden 128): the default StudentModel, seed 0
    out = []
    rows = (("ours eager", "eager"), ("ours best (ForceEngine mode auto)", "auto"))
    for n in sizes:
        atoms = water_box(n, seed=0)
        d = AtomsBatch.from_atoms([atoms], dtype=torch.float32).to("cuda")
        with torch.no_grad():
            n_edges = neighbor_list(d.positions, d.cell, d.pbc, d.batch, d.ptr, model.cutoff).num_edges
        del d
        for label, mode in rows:
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                impl = StepImpl(label, "ours", model, "cuda", backend="auto", mode=mode)
            head = f"\n===== water {len(atoms)} atoms, {n_edges} edges, hidden {hidden}, {label}"
            if not impl.available:
                out.append(f"{head}: unavailable ({impl.why_unavailable})")
                continue
            eng = impl.engine
            bucket = eng.buckets.select(len(atoms), n_edges) if eng.pad else None
            if mode != "eager" and bucket is None:
                why = f"runs {eng.mode}" if not eng.pad else "no padded bucket holds the box"
                out.append(f"{head}: skipped ({why}: it would run eager, = ours eager)")
                impl = eng = None
                continue
            run = impl.prepare([atoms], True)  # the neighbour list, built once (and the padded graph filled)
            run()  # cold: Triton compiles, autotuning, the graph capture
            run()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() / 1e9  # before do_bench adds its 256 MB cache-flush buffer
            t_ms = triton.testing.do_bench(run, warmup=100, rep=500, return_mode="median")
            runs = f"runs {eng.mode}" + (f", {bucket}" if bucket is not None else "")
            out.append(
                f"{head} ({runs}): wall median {t_ms:.3f} ms (do_bench), peak allocated {peak:.2f} GB "
                "(inputs, neighbour list, first two calls)"
            )
            out.append("--- kernels of one step (3 calls profiled)")
            out.append(_kernel_table(run, reps=3, rows=45, groups=True))
            run = impl = eng = None  # the 24,000-atom step's engine, graph and buffers go before the next row
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default=None)
    p.add_argument("--sections", default="small,water")
    p.add_argument("--hidden", type=int, default=128, help="the large section's student width (the small one: 64)")
    p.add_argument("--large-sizes", default="3000,24000", help="the large section's water boxes, atoms")
    args = p.parse_args()
    sections = set(args.sections.split(","))
    import triton
    from ase import units
    from ase.build import molecule
    from ase.md.verlet import VelocityVerlet

    model = load_model("builtin:chno-gfn2") if "small" in sections else None
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    report = [f"{device} torch {torch.__version__} triton {triton.__version__}"]
    if "host" in sections:
        report.extend(_host_md_steps())
    systems = [("benzene", [molecule("C6H6")]), ("g2x1024", g2_chno(1024))] if "small" in sections else []
    for name, structs in systems:
        eng = ForceEngine(model, device="cuda", mode="cudagraph")
        batch = AtomsBatch.from_atoms(structs)
        eng.compute(batch, to_host=True)
        eng.compute(batch, to_host=True)
        bucket, runner = next(iter(eng._runners.items()))
        t_replay = triton.testing.do_bench(runner.replay, warmup=50, rep=300, return_mode="median")
        t_e2e = triton.testing.do_bench(
            lambda: eng.compute(batch, to_host=True), warmup=20, rep=300, return_mode="median"
        )
        report.append(f"\n===== {name}: bucket {bucket}, replay {t_replay * 1e3:.1f} µs, e2e {t_e2e * 1e3:.1f} µs")
        graph = eng._graph(bucket)
        report.append("--- kernels of one graph replay")
        report.append(_kernel_table(runner.replay))
        report.append("--- kernels of the same padded step run eagerly")
        report.append(_kernel_table(lambda: eng._step(*graph.inputs())))
        report.append("--- host profile of engine.compute (to_host), 200 calls")
        report.append(_host_profile(lambda: eng.compute(batch, to_host=True), 200))
    if "small" in sections:
        atoms = molecule("C6H6")
        atoms.calc = StudentCalculator(model, device="cuda")
        dyn = VelocityVerlet(atoms, 0.5 * units.fs)
        dyn.run(20)
        report.append("\n===== ASE MD step (benzene, StudentCalculator defaults), host profile of 200 steps")
        report.append(_host_profile(lambda: dyn.run(1), 200))
    if "water" in sections:
        report.extend(_water_steps())
    if "variants" in sections:
        report.extend(_variant_replays())
    if "large" in sections:
        report.extend(_large_steps(tuple(int(x) for x in args.large_sizes.split(",")), hidden=args.hidden))
    text = "\n".join(report)
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "profile_step.txt").write_text(text)


if __name__ == "__main__":
    main()
