"""Energy + forces + stress of periodic boxes: the padded stress step (stop 22) against the eager path it replaces.

For water boxes (~1 g/cm³, default 192 and 3,000 atoms) and one student size (``--hidden/--layers``; default
128 x 3, seeded random weights: the cost does not depend on them), in one run:

* ``engine.compute(batch, stress=True, to_host=True)`` wall clock (median of repeated calls, each waiting for its
  results): the torch reference (torch kernels, eager), ours eager (the path every stress call took before stop
  22), ours ``mode="cudagraph"`` (the padded stress step, replayed), and ours ``mode="cudagraph"`` without stress
  (energy + forces only), so the price of the strain derivative is visible;
* one ASE ``NPTBerendsen`` step (300 K, water's compressibility, 0.5 fs) through ``StudentCalculator``: default
  ``mode="auto"`` (the padded stress step; its Verlet list kept across the barostat's cell changes), the same
  with ``skin=None`` (a fresh list every call: the stop-22 path), ``mode="eager"``, and with ``--teacher`` the
  teacher (e.g. ``sevennet-0``) on the same box, for the NPT speed-up. ``--student PATH`` times a trained student
  (e.g. ``results/water_sevennet_npt_h100/water-sevennet-npt.pt``) instead of seeded random weights.

Correctness first: each variant's energy, forces and stress are checked against the reference in the same run
(fp32 tolerance relative to the largest value) before anything is timed. Writes ``<out>/<name>.md`` and ``.json``.
On a CPU (``--quick``) it is a smoke run of the same code: CPU numbers say nothing about the GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import environment, wall_us
from peers import make_student
from systems import water_box

from mlff_distiller import AtomsBatch, ForceEngine, StudentCalculator, kernels

# (label, ForceEngine kwargs, kernel backend, stress)
VARIANTS = [
    ("reference (torch kernels, eager)", dict(mode="eager"), "torch", True),
    ("ours eager (the stress path before stop 22)", dict(mode="eager"), "auto", True),
    ("ours cudagraph, stress step", dict(mode="cudagraph"), "auto", True),
    ("ours cudagraph, energy + forces only", dict(mode="cudagraph"), "auto", False),
]


def _check(out: dict, ref: dict, stress: bool) -> float:
    """Largest deviation from the reference, relative to the reference's largest |value|, over E, F (and σ)."""
    worst = 0.0
    for key in ("energy", "forces", "stress") if stress else ("energy", "forces"):
        a, b = out[key].double().cpu(), ref[key].double().cpu()
        worst = max(worst, float((a - b).abs().max() / b.abs().max().clamp_min(1e-6)))
    return worst


def bench_compute(model, sizes, device, reps: int) -> list[dict]:
    rows = []
    for n in sizes:
        atoms = water_box(n, seed=1)
        batch = AtomsBatch.from_atoms(atoms)
        ref = None
        for label, kw, backend, stress in VARIANTS:
            with kernels.use_backend(backend), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # cudagraph on a CPU: the padded eager path, with a warning
                engine = ForceEngine(model, device=device, precision="fp32", **kw)

                def call(engine=engine, stress=stress, batch=batch):
                    return engine.compute(batch, stress=stress, to_host=True)

                t0 = time.perf_counter()
                out = call()
                first_s = time.perf_counter() - t0
                if ref is None:
                    ref = out
                err = _check(out, ref, stress)
                if err > 1e-4:
                    raise SystemExit(f"{label} at {n} atoms differs from the reference by {err:.2e} (relative)")
                median, p20 = wall_us(call, reps=reps, warmup=3)
            rows.append(
                dict(
                    atoms=n,
                    variant=label,
                    stress=stress,
                    median_us=median,
                    p20_us=p20,
                    first_call_s=first_s,
                    max_rel_dev=err,
                    padded=engine.last_bucket is not None,
                )
            )
            print(f"{n:>6} atoms  {label:<48} {median:>10.1f} µs  (first call {first_s:.2f} s, dev {err:.1e})")
    return rows


def _no_speculation(model, device) -> StudentCalculator:
    calc = StudentCalculator(model, device=device)
    calc.engine.speculative_verlet = False
    return calc


def bench_npt(model, n: int, device, steps: int, teacher: str | None = None, teacher_steps: int = 20) -> list[dict]:
    from mlff_distiller.distill import npt_berendsen

    calcs = [
        ("StudentCalculator, mode auto", lambda: StudentCalculator(model, device=device), steps),
        ("StudentCalculator, mode auto, no speculative launch", lambda: _no_speculation(model, device), steps),
        (
            "StudentCalculator, mode auto, skin None (a fresh list per call)",
            lambda: StudentCalculator(model, device=device, skin=None),
            steps,
        ),
        ("StudentCalculator, mode eager", lambda: StudentCalculator(model, device=device, mode="eager"), steps),
    ]
    if teacher:
        from mlff_distiller.distill import get_teacher

        options = {"device": str(device)} if teacher == "sevennet-0" else {}
        calcs.append((f"teacher {teacher}", lambda: get_teacher(teacher, **options), teacher_steps))
    rows = []
    for label, make, k in calcs:
        atoms = water_box(n, seed=2)
        atoms.calc = make()
        dyn = npt_berendsen(atoms, taup_fs=200.0)
        dyn.run(3)  # capture, first lists
        v0 = atoms.get_volume()
        stamps = []
        dyn.attach(lambda st=stamps: st.append(time.perf_counter()), interval=1)
        dyn.run(k)
        if device.type == "cuda":
            torch.cuda.synchronize()
        per = np.diff(stamps) * 1e6
        ok = bool(np.isfinite(atoms.get_stress()).all() and np.isfinite(atoms.get_forces()).all())
        engine = getattr(atoms.calc, "engine", None)
        v = getattr(engine, "verlet", None)
        rows.append(
            dict(
                atoms=n,
                variant=label,
                us_per_step=float(np.median(per)),
                mean_us_per_step=float(per.mean()),
                steps=k,
                finite=ok,
                volume_change=atoms.get_volume() / v0 - 1,
                list_builds=None if v is None else v.n_builds,
                cell_updates=None if v is None else v.cell_updates,
            )
        )
        print(f"{n:>6} atoms  NPTBerendsen step, {label:<40} {rows[-1]['us_per_step']:>10.1f} µs")
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    ap.add_argument("--name", default="bench_stress")
    ap.add_argument("--sizes", type=int, nargs="+", default=None, help="water box sizes (atoms)")
    ap.add_argument("--npt-atoms", type=int, default=None, help="box of the NPT step timing (0: skip)")
    ap.add_argument("--npt-steps", type=int, default=None)
    ap.add_argument("--reps", type=int, default=None, help="timed calls per variant")
    ap.add_argument("--hidden", type=int, default=128, help="student width (builtin:chno-gfn2-small is 64)")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--student", default=None, help="a trained student checkpoint (default: seeded random weights)")
    ap.add_argument("--teacher", default=None, help="also time the teacher's NPT step (e.g. sevennet-0, emt)")
    ap.add_argument("--teacher-steps", type=int, default=20)
    ap.add_argument("--skip-compute", action="store_true", help="the NPT section only")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (CPU smoke run)")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    args = ap.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    sizes = args.sizes or ([24] if args.quick else [192, 3000])
    npt_atoms = args.npt_atoms if args.npt_atoms is not None else (24 if args.quick else 192)
    npt_steps = args.npt_steps or (3 if args.quick else 50)
    reps = args.reps or (3 if args.quick else 30)
    if args.student:
        from mlff_distiller import load_model

        model = load_model(args.student)
        args.hidden, args.layers = model.config.hidden, model.config.layers
    else:
        model = make_student(hidden=args.hidden, layers=args.layers)
    env = environment(device, copy_gbps=0.0)
    data = {
        "env": {"device": env.device, "torch": env.torch, "triton": env.triton, "commit": env.commit},
        "model": f"{args.hidden} x {args.layers}" + (f" ({args.student})" if args.student else ""),
        "compute": [] if args.skip_compute else bench_compute(model, sizes, device, reps),
        "npt": bench_npt(model, npt_atoms, device, npt_steps, args.teacher, args.teacher_steps) if npt_atoms else [],
    }
    lines = [
        "# Stress in the padded modes (bench_stress.py)",
        "",
        f"{env.device} · torch {env.torch} · triton {env.triton} · commit {env.commit}",
        "",
        f"Student {data['model']} (features x layers), fp32, "
        f"{'trained weights' if args.student else 'seeded random weights'}; water boxes at ~1 g/cm³. Every "
        "variant was checked against the reference (energy, forces and stress within 1e-4 of the largest value) "
        "before it was timed. Wall clock per `engine.compute(batch, stress=..., to_host=True)`, median.",
        "",
        "| atoms | variant | stress | median µs | p20 µs | reference / this | first call s | max rel. dev. |",
        "|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in data["compute"]:
        ref = next(x for x in data["compute"] if x["atoms"] == r["atoms"])
        lines.append(
            f"| {r['atoms']} | {r['variant']} | {'yes' if r['stress'] else 'no'} | {r['median_us']:.1f} | "
            f"{r['p20_us']:.1f} | {ref['median_us'] / r['median_us']:.2f}x | {r['first_call_s']:.2f} | "
            f"{r['max_rel_dev']:.1e} |"
        )
    if data["npt"]:
        lines += [
            "",
            "## One ASE NPTBerendsen step (300 K, 1 bar, water's compressibility, τ_P 200 fs, 0.5 fs; wall clock)",
            "",
        ]
        lines += [
            "| atoms | calculator | median µs / step | mean | steps | volume change | list builds | cell updates | "
            "finite |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---|",
        ]
        for r in data["npt"]:
            lines.append(
                f"| {r['atoms']} | {r['variant']} | {r['us_per_step']:.1f} | {r['mean_us_per_step']:.1f} | "
                f"{r['steps']} | {r['volume_change']:.2e} | {r['list_builds']} | {r['cell_updates']} | {r['finite']} |"
            )
        teacher_rows = [r for r in data["npt"] if r["variant"].startswith("teacher")]
        if teacher_rows:
            t = teacher_rows[0]["us_per_step"]
            auto = data["npt"][0]["us_per_step"]
            lines += ["", f"NPT speed-up, teacher / student (mode auto): {t / auto:.1f}x"]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    (args.out / f"{args.name}.json").write_text(json.dumps(data, indent=1, default=str))
    print("\n".join(lines))
    return data


if __name__ == "__main__":
    main()
