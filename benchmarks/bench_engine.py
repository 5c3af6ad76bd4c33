"""ForceEngine on the GPU: every mode against the eager torch-reference student, in one run.

Sections (``--sections``, each merged into ``<out>/<name>.json``, the markdown is rebuilt from all of them):

* ``latency``: single-molecule energy + forces for H2, H2O, CH4 and benzene in every mode; ``e2e`` is
  ``engine.compute`` from a host ``AtomsBatch`` to host results (neighbour list, padding, step, one copy back),
  ``step`` the energy + forces step alone on a prebuilt graph (a graph replay in the padded modes);
* ``md``: ``StudentCalculator`` wall time per ASE velocity-Verlet step on benzene (0.5 fs, 300 K; median and mean);
* ``sweep``: batches of 1 … 4096 of ASE's g2 molecules, µs per structure and structures/s;
* ``errors``: energy and force error of each precision against fp64;
* ``startup``: a fresh process from loading the model to its first result, cold (empty cache directory) and
  warm (the same directory again), not counting ``import torch``.

Run: ``python benchmarks/bench_engine.py [--sections latency,md,sweep,errors,startup] [--budget-s 420]``.
The reference is the same model with ``MLFF_DISTILLER_KERNELS=torch`` kernels in eager mode.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_report import REFERENCE_LABEL, TARGETS, target_rows, write_report  # noqa: F401  (the report's API here too)
from harness import environment, host_work_us, student_weights, time_fn

from mlff_distiller import AtomsBatch, ForceEngine, StudentCalculator, StudentModel, kernels
from mlff_distiller.neighbors import neighbor_list

LATENCY_MOLECULES = ("H2", "H2O", "CH4", "C6H6")
SWEEP_SIZES = (1, 4, 8, 16, 32, 64, 256, 1024, 4096)
# (label, ForceEngine kwargs, kernel backend)
REFERENCE = (REFERENCE_LABEL, dict(mode="eager"), "torch")
LATENCY_VARIANTS = [
    REFERENCE,
    ("eager (triton)", dict(mode="eager"), "auto"),
    ("cudagraph", dict(mode="cudagraph"), "auto"),
    ("cudagraph+compile", dict(mode="cudagraph", compile_mode="default"), "auto"),
    ("compile default", dict(mode="compile", compile_mode="default"), "auto"),
    ("compile reduce-overhead", dict(mode="compile", compile_mode="reduce-overhead"), "auto"),
    ("compile max-autotune", dict(mode="compile", compile_mode="max-autotune"), "auto"),
    ("cudagraph+max-autotune", dict(mode="cudagraph", compile_mode="max-autotune"), "auto"),
]
SWEEP_VARIANTS = [
    (REFERENCE[0], dict(mode="eager", precision="fp32"), "torch"),
    ("eager fp32", dict(mode="eager", precision="fp32"), "auto"),
    ("cudagraph fp32", dict(mode="cudagraph", precision="fp32"), "auto"),
    ("cudagraph tf32", dict(mode="cudagraph", precision="tf32"), "auto"),
    ("cudagraph bf16", dict(mode="cudagraph", precision="bf16"), "auto"),
    ("cudagraph fp16", dict(mode="cudagraph", precision="fp16"), "auto"),
    ("cudagraph+compile fp32", dict(mode="cudagraph", compile_mode="default", precision="fp32"), "auto"),
    ("cudagraph+compile tf32", dict(mode="cudagraph", compile_mode="default", precision="tf32"), "auto"),
    ("compile max-autotune fp32", dict(mode="compile", compile_mode="max-autotune", precision="fp32"), "auto"),
    ("cudagraph+max-autotune fp32", dict(mode="cudagraph", compile_mode="max-autotune", precision="fp32"), "auto"),
]


def _picks(key: str, label: str) -> bool:
    """--variants: ``=label`` picks that variant only, any other key every variant whose label contains it."""
    return label == key[1:] if key.startswith("=") else key in label


class _SavingRows(list):
    """A section's rows that call ``save(rows)`` after every append."""

    def __init__(self, save):
        super().__init__()
        self._save = save

    def append(self, row) -> None:
        super().append(row)
        self._save(self)


def make_student(seed: int = 0, hidden: int = 128, layers: int = 3) -> StudentModel:
    """The default student (hidden 128, 3 layers, 20 Bessel functions, 5 Å) over every element of g2, with
    random weights (``harness.STUDENT_WEIGHTS``: on the TF32 grid, as the trainer leaves a student): timing and
    precision errors do not depend on training."""
    from ase.collections import g2

    torch.manual_seed(seed)
    species = sorted({int(z) for a in g2 for z in a.numbers})
    model = StudentModel(species=species, hidden=hidden, layers=layers)
    n = len(species)
    model.set_energy_reference(shift=-torch.linspace(1.0, 5.0, n), scale=torch.full((n,), 0.5))
    return student_weights(model)  # on the TF32 grid unless MLFF_BENCH_WEIGHTS=as-trained


def g2_batch(count: int) -> list:
    from ase.collections import g2

    mols = list(g2)
    return [mols[k % len(mols)] for k in range(count)]


class Clock:
    """The run's time budget: sections and variants check it and are skipped (and reported) when spent."""

    def __init__(self, budget_s: float) -> None:
        self.t0, self.budget = time.perf_counter(), budget_s

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.t0)


def _engine(model, backend: str, **kw) -> tuple[ForceEngine, str]:
    with kernels.use_backend(backend):
        return ForceEngine(model, device="cuda", **kw), backend


def _step_taken(engine: ForceEngine) -> str:
    """Which step the engine's last call ran: ``dense`` (the dense step for one small molecule, stop 69), ``model``
    (the model's forward and autograd in a bucket, captured or not) or ``eager`` (unpadded)."""
    if not engine.pad or engine.last_bucket is None:
        return "eager"
    graph = engine._graph(engine.last_bucket)
    return "dense" if engine._dense_slots(graph) is not None else "model"


def _step_fn(engine: ForceEngine, batch: AtomsBatch, backend: str):
    """The energy + forces step alone: a replay (padded modes) or model + grad on a prebuilt graph. The padded
    graph is marked a molecule where the batch has no periodic images, as ``engine.compute`` marks it, so that the
    step timed is the one the engine takes (until stop 73 it was not: the 64-wide student's rows timed the model's
    step where ``compute`` ran the dense step)."""
    dev = batch.to("cuda", engine.dtype)
    with torch.no_grad():
        nl = neighbor_list(dev.positions, dev.cell, dev.pbc, dev.batch, dev.ptr, engine.cutoff)
    if engine.pad:
        bucket = engine.buckets.select(dev.num_atoms, nl.num_edges)
        graph = engine._graph(bucket)
        from mlff_distiller.buckets import fill_padded

        fill_padded(
            graph,
            dev.numbers,
            dev.positions,
            dev.batch,
            dev.num_structures,
            nl.edge_index,
            nl.shift_vectors.to(engine.dtype),
            molecule=not bool(batch.pbc.any()),
        )

        def run():
            with kernels.use_backend(backend):
                return engine._run(bucket, graph)

        return run
    model = engine.model
    for p in model.parameters():
        p.requires_grad_(False)

    def run():
        with kernels.use_backend(backend), torch.enable_grad():
            pos = dev.positions.detach().requires_grad_(True)
            out = model(dev.numbers, pos, nl.edge_index, nl.shift_vectors, dev.batch, dev.num_structures)
            return torch.autograd.grad(out["energy"].sum(), pos)

    return run


def _e2e_fn(engine: ForceEngine, batch: AtomsBatch, backend: str):
    def run():
        with kernels.use_backend(backend):
            return engine.compute(batch, to_host=True)

    return run


def _timed_first_call(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


# ------------------------------------------------------------------------------------------------ sections
def bench_latency(model, clock: Clock, rows: list) -> None:
    from ase.build import molecule

    for label, kw, backend in LATENCY_VARIANTS:
        if "compile" in label:
            torch._dynamo.reset()
        need = 90 if "compile" in label else 10
        # max-autotune benchmarks every GEMM's choices (330 s on the H100 for benzene's bucket, stop 40): benzene
        # first, then the others, which share its bucket and so its autotuning cache (41 s each for cudagraph +
        # max-autotune). A run cut off by its time limit keeps the rows measured so far (saved as they come).
        molecules = (
            ("C6H6", *(m for m in LATENCY_MOLECULES if m != "C6H6")) if "max-autotune" in label else LATENCY_MOLECULES
        )
        for name in molecules:
            if clock.left() < need:
                rows.append(dict(section="latency", variant=label, molecule=name, skipped="time budget"))
                continue
            engine, _ = _engine(model, backend, precision="fp32", **kw)
            batch = AtomsBatch.from_atoms(molecule(name), dtype=engine.dtype)
            first = _timed_first_call(_e2e_fn(engine, batch, backend))
            e2e = time_fn(_e2e_fn(engine, batch, backend), engine.device)
            taken = _step_taken(engine)
            step = time_fn(_step_fn(engine, batch, backend), engine.device)
            rows.append(
                dict(
                    section="latency",
                    variant=label,
                    molecule=name,
                    atoms=batch.num_atoms,
                    e2e_us=e2e.median_us,
                    e2e_p20_us=e2e.p20_us,
                    e2e_p80_us=e2e.p80_us,
                    step_us=step.median_us,
                    step_p20_us=step.p20_us,
                    step_p80_us=step.p80_us,
                    first_call_s=first,
                    step_taken=taken,
                )
            )
            print(rows[-1], flush=True)


def bench_md(model, clock: Clock, rows: list, steps: int = 300) -> None:
    """Velocity Verlet on benzene through ``StudentCalculator`` (0.5 fs; until stop 66 ``timestep=0.5`` in ASE units,
    ~4.9 fs, whose hot steps rebuilt the list every few steps), wall clock between steps: the median (the step as
    MD repeats it) and the mean (list rebuilds included), with the launches ahead the calculator's predictions
    made and the next steps took (stop 66)."""
    from ase import units
    from ase.build import molecule
    from ase.md.verlet import VelocityVerlet

    from mlff_distiller.ase_compat import maxwell_boltzmann

    variants = [
        (REFERENCE[0], dict(mode="eager"), "torch"),
        ("eager (triton)", dict(mode="eager"), "auto"),
        ("auto = cudagraph", dict(mode="auto"), "auto"),
        ("cudagraph+compile", dict(mode="cudagraph", compile_mode="default"), "auto"),
    ]
    for label, kw, backend in variants:
        if clock.left() < 30:
            rows.append(dict(section="md", variant=label, skipped="time budget"))
            continue
        host_before = host_work_us()
        with kernels.use_backend(backend):
            atoms = molecule("C6H6")
            maxwell_boltzmann(atoms, 300, rng=np.random.default_rng(0))
            atoms.calc = StudentCalculator(model, device="cuda", precision="fp32", **kw)
            dyn = VelocityVerlet(atoms, timestep=0.5 * units.fs)
            dyn.run(20)  # capture / compile / warm-up
            torch.cuda.synchronize()
            stamps: list[float] = []
            dyn.attach(lambda stamps=stamps: stamps.append(time.perf_counter()), interval=1)
            dyn.run(steps)
            t = np.diff(stamps) * 1e6
        eng = atoms.calc.engine
        rows.append(
            dict(
                section="md",
                variant=label,
                molecule="C6H6",
                step_us=float(np.median(t)),
                mean_us=float(t.mean()),
                graphs=len(eng.captured_buckets),
                builds=eng.verlet.n_builds,
                ahead=f"{eng.n_ahead_taken} taken, {eng.n_ahead_missed} missed"
                + (f", {eng.n_chain_adopted} chained" if getattr(eng, "n_chained", 0) else "")
                + (f" ({eng.n_chain_kept} kept unpredicted)" if getattr(eng, "n_chain_kept", 0) else ""),
                dense=any(md.dense for md in getattr(eng, "_md_runners", {}).values()),
                host_us=(host_before, host_work_us()),
            )
        )
        print(rows[-1], flush=True)


def bench_sweep(model, clock: Clock, rows: list, sizes=SWEEP_SIZES) -> None:
    batches = {b: AtomsBatch.from_atoms(g2_batch(b)) for b in sizes}
    for label, kw, backend in SWEEP_VARIANTS:
        if "compile" in label:
            torch._dynamo.reset()
        engine, _ = _engine(model, backend, **kw)
        for b in sizes:
            if "compile" in label and b not in (1024, 4096):
                continue  # a compilation per bucket: only the batches the targets name
            if "max-autotune" in label and b != 1024:
                continue  # autotuning costs minutes per bucket: batch 1,024 only
            need = 60 if "compile" in label else 8
            if clock.left() < need:
                rows.append(dict(section="sweep", variant=label, batch=b, skipped="time budget"))
                continue
            batch = batches[b].to(dtype=engine.dtype)
            try:
                first = _timed_first_call(_e2e_fn(engine, batch, backend))
                step = time_fn(_step_fn(engine, batch, backend), engine.device)
                e2e = time_fn(_e2e_fn(engine, batch, backend), engine.device)
            except torch.OutOfMemoryError as exc:
                rows.append(dict(section="sweep", variant=label, batch=b, skipped=f"OOM: {exc}"[:200]))
                torch.cuda.empty_cache()
                continue
            rows.append(
                dict(
                    section="sweep",
                    variant=label,
                    batch=b,
                    atoms=batch.num_atoms,
                    step_us_per_structure=step.median_us / b,
                    e2e_us_per_structure=e2e.median_us / b,
                    structures_per_s=b / (e2e.median_us * 1e-6),
                    step_us=step.median_us,
                    e2e_us=e2e.median_us,
                    first_call_s=first,
                )
            )
            print(rows[-1], flush=True)
        del engine
        torch.cuda.empty_cache()


def bench_errors(model, clock: Clock, rows: list, builtin: bool = False) -> None:
    """Each precision against fp64: the benchmark's random student on 324 g2 molecules, or (``builtin``) the
    default student (``mlff_distiller.DEFAULT_MODEL``) on the g2 molecules made of H, C, N and O only (its elements),
    so that the errors stand beside the student's own error against its teacher (18.29 meV/Å force MAE)."""
    if builtin:
        from mlff_distiller import DEFAULT_MODEL, load_model

        model = load_model(DEFAULT_MODEL)
        mols = [m for m in g2_batch(162) if set(m.get_chemical_symbols()) <= {"H", "C", "N", "O"}]
        batch = AtomsBatch.from_atoms(mols)
    else:
        batch = AtomsBatch.from_atoms(g2_batch(324))
    ref = ForceEngine(model, device="cuda", precision="fp64").compute(batch)
    e_ref, f_ref = ref["energy"].cpu(), ref["forces"].cpu()
    counts = batch.counts.double()
    for precision in ("fp32", "tf32", "bf16", "fp16"):
        for mode in ("eager", "cudagraph"):
            out = ForceEngine(model, device="cuda", precision=precision, mode=mode).compute(batch, to_host=True)
            de = (out["energy"].double() - e_ref).abs()
            df = out["forces"].double() - f_ref
            rows.append(
                dict(
                    section="errors_builtin" if builtin else "errors",
                    structures=batch.num_structures,
                    precision=precision,
                    mode=mode,
                    energy_max_abs_eV=float(de.max()),
                    energy_mae_per_atom_eV=float((de / counts).mean()),
                    energy_max_rel=float((de / e_ref.abs().clamp_min(1.0)).max()),
                    force_max_abs_eVA=float(df.abs().max()),
                    force_rmse_eVA=float(df.pow(2).mean().sqrt()),
                    force_scale_eVA=float(f_ref.abs().max()),
                )
            )
            print(rows[-1], flush=True)


def bench_startup(model, clock: Clock, rows: list) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "student.pt"
        model.save(ckpt)
        for label, args in (
            ("cudagraph", ["--mode", "cudagraph"]),
            ("cudagraph+compile", ["--mode", "cudagraph", "--compile-mode", "default"]),
        ):
            cache = Path(tmp) / label.replace(" ", "_").replace("+", "_")
            for phase in ("cold", "warm"):
                if clock.left() < 60:
                    rows.append(dict(section="startup", variant=label, phase=phase, skipped="time budget"))
                    continue
                cmd = [
                    sys.executable,
                    __file__,
                    "--child-startup",
                    str(ckpt),
                    "--cache-dir",
                    str(cache),
                    *args,
                ]
                # Without the cache variables this process has: Inductor writes them into os.environ on its first
                # compile (the latency section's), and a child inheriting them read that warm cache "cold" (stop 80).
                env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
                res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=max(30, clock.left() - 20))
                line = [x for x in res.stdout.splitlines() if x.startswith("{")]
                row = dict(section="startup", variant=label, phase=phase)
                row.update(json.loads(line[-1]) if line else dict(skipped=res.stderr[-300:]))
                rows.append(row)
                print(row, flush=True)


def child_startup(args) -> None:
    """Child process: seconds from loading the checkpoint to the first benzene result on the fast path."""
    from ase.build import molecule

    from mlff_distiller import load_model

    torch.cuda.init()
    t0 = time.perf_counter()
    model = load_model(args.child_startup)
    engine = ForceEngine(model, device="cuda", mode=args.mode, compile_mode=args.compile_mode, cache_dir=args.cache_dir)
    engine.compute(AtomsBatch.from_atoms(molecule("C6H6")), to_host=True)
    t1 = time.perf_counter()
    engine.compute(AtomsBatch.from_atoms(molecule("C6H6")), to_host=True)
    t2 = time.perf_counter()
    print(json.dumps(dict(first_result_s=t1 - t0, second_call_ms=1e3 * (t2 - t1), step_taken=_step_taken(engine))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sections", default="latency,md,sweep,errors,startup")
    ap.add_argument("--budget-s", type=float, default=420.0)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--name", default="engine_h100")
    ap.add_argument("--sizes", default=",".join(map(str, SWEEP_SIZES)))
    ap.add_argument(
        "--variants", default="", help="comma list: only variants whose label contains one (=label: that one only)"
    )
    ap.add_argument("--child-startup", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--mode", default="cudagraph")
    # 64: the default student's width (mlff_distiller.DEFAULT_MODEL, builtin:chno-gfn2-small, since stop 85);
    # builtin:chno-gfn2 is 128 wide.
    ap.add_argument("--hidden", type=int, default=64, help="student width (the default student is 64; 128 x 3 too)")
    ap.add_argument("--layers", type=int, default=3, help="student interaction layers")
    ap.add_argument("--compile-mode", default=None)
    args = ap.parse_args()
    if args.child_startup:
        child_startup(args)
        return
    if not torch.cuda.is_available():
        raise SystemExit("bench_engine.py needs a CUDA device")
    if args.variants:
        keep = [v.strip() for v in args.variants.split(",")]
        for table in (LATENCY_VARIANTS, SWEEP_VARIANTS):
            table[:] = [
                v for v in table if v is REFERENCE or v[0] == REFERENCE[0] or any(_picks(k, v[0]) for k in keep)
            ]
    clock = Clock(args.budget_s)
    model = make_student(hidden=args.hidden, layers=args.layers)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / f"{args.name}.json", out / f"{args.name}.md"
    data = json.loads(json_path.read_text()) if json_path.exists() else {"rows": []}
    env = environment(torch.device("cuda"), copy_gbps=0.0)
    data["env"] = dict(
        device=env.device,
        torch=env.torch,
        triton=env.triton,
        commit=env.commit,
        python=sys.version.split()[0],
        weights=env.weights,
    )
    data["timestamp"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    data["model"] = f"{args.hidden} x {args.layers}"
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    runners = dict(
        latency=bench_latency,
        md=bench_md,
        errors=bench_errors,
        errors_builtin=lambda m, c, r: bench_errors(m, c, r, builtin=True),
        startup=bench_startup,
        sweep=lambda m, c, r: bench_sweep(m, c, r, tuple(int(x) for x in args.sizes.split(","))),
    )
    for section in sections:
        kept = [r for r in data["rows"] if r["section"] != section]

        def save(rows, kept=kept):
            data["rows"] = kept + list(rows)
            json_path.write_text(json.dumps(data, indent=1))
            write_report(data, md_path)

        rows = _SavingRows(save)  # each row is on disk as it comes: a run killed at its time limit keeps them
        try:
            runners[section](model, clock, rows)
        finally:
            save(rows)
    print(md_path.read_text())


if __name__ == "__main__":
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(min(16, os.cpu_count() or 1)))
    main()
