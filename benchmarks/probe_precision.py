"""The engine's reduced precisions, step time against accuracy (a probe for issue 5's tf32 / bf16 row).

Under ``precision="tf32"``, ``"bf16"`` and ``"fp16"`` the Triton GEMMs multiply in TF32 or 16 bits and the
message-passing dots take one TF32 pass instead of tf32x3 (``kernels.message_passing._CONFIG["reduced_dots"]``).
Under bf16 / fp16 the message kernels also gather 16-bit copies of the senders' rows (``half_gathers``) and of the
backward's gradient rows (``half_grads``, in the mode's type; under fp16 also timed as bfloat16). This probe times
each precision, the 16-bit modes with those switches off, with the rows of x and v only, and with both (shipped), in
one run:

* the captured energy + forces step of 1,024 and 4,096 g2 molecules (random student, 128 x 3 unless
  ``--hidden`` / ``--layers``, µs per structure), of a 3,000-atom water box (ms, mode auto: captured) and, with
  ``--large``, of a 24,000-atom one (ms, mode auto: eager);
* the error against fp64 of a shipped student (``--student``, default ``mlff_distiller.DEFAULT_MODEL``; with
  ``--errors-only`` no step is timed) on the H/C/N/O g2 molecules as built and rattled
  by 0.05 Å (force RMSE, median and max of the per-atom error norm, meV/Å; the student's own force MAE against
  GFN2-xTB is in its metadata). The g2 geometries are exactly symmetric: at a symmetric site an atom's vector
  features cancel, and the update block's ``sqrt(|Vv|² + 1e-8)`` turns rounding noise there into an O(1) change of
  its gradient, so a few such atoms set the max and the RMSE on the built set. The rattled sets, like MD frames,
  show the typical error. Each rattled set holds four rattled copies of every molecule (~2,200 atoms: a GPU graph
  of at least ``block_min_atoms`` = 1,024 atoms, where the block kernels and the half gathers run; the built set's
  558 atoms take the atom variant). A 3,000-atom water box (as built, jittered) is the third set.

    python benchmarks/probe_precision.py --out benchmarks/results --name probe_precision_h100
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import g2_batch, make_student
from harness import write_lines
from mlff_distiller.kernels.message_passing import _configured
from probe_student_size import _step_us  # the step alone on a prepared graph (peers.StepImpl)
from systems import water_box

from mlff_distiller import AtomsBatch, ForceEngine, load_model

F32_ROWS = {"half_gathers": False, "half_grads": False}
VARIANTS = (  # (precision, what the message passing gathers, its switches)
    ("fp32", "f32 rows", {}),
    ("tf32", "f32 rows", {}),
    ("bf16", "f32 rows", F32_ROWS),
    ("bf16", "16-bit x, v", {"half_grads": False}),
    ("bf16", "16-bit x, v, g", {}),
    ("fp16", "f32 rows", F32_ROWS),
    ("fp16", "16-bit x, v", {"half_grads": False}),
    ("fp16", "16-bit x, v, g bf16", {"half_grads_type": "bf16"}),
    ("fp16", "16-bit x, v, g", {}),
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--name", default="probe_precision_h100")
    p.add_argument("--rounds", type=int, default=2, help="timing passes over the variants (order alternates)")
    p.add_argument("--hidden", type=int, default=128, help="the timed student's width")
    p.add_argument("--layers", type=int, default=3, help="the timed student's depth")
    p.add_argument("--large", action="store_true", help="also time a 24,000-atom water box")
    p.add_argument("--student", default=None, help="whose errors (default: mlff_distiller.DEFAULT_MODEL)")
    p.add_argument("--errors-only", action="store_true", help="no step timing: the error columns alone")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("probe_precision: needs CUDA")
        return
    import triton

    student = make_student(hidden=args.hidden, layers=args.layers)
    g2 = {n: g2_batch(n) for n in (1024, 4096)}
    water = {3000: [water_box(3000, seed=0)]}
    if args.large:
        water[24000] = [water_box(24000, seed=0)]
    from mlff_distiller import DEFAULT_MODEL

    student_name = args.student or DEFAULT_MODEL
    builtin = load_model(student_name)
    chno = [m for m in g2_batch(162) if set(m.get_chemical_symbols()) <= {"H", "C", "N", "O"}]
    sets = {"g2": chno}
    for seed in (1, 2):
        rattled = [m.copy() for _ in range(4) for m in chno]
        for k, m in enumerate(rattled):
            m.rattle(0.05, seed=10_000 * seed + k)
        sets[f"rattled {seed}"] = rattled
    sets["water 3,000"] = [water_box(3000, seed=1)]
    batches = {k: AtomsBatch.from_atoms(v) for k, v in sets.items()}
    refs = {
        k: ForceEngine(builtin, device="cuda", precision="fp64").compute(b, to_host=True) for k, b in batches.items()
    }
    times: dict = {}
    errors: dict = {}
    timed = not args.errors_only
    rounds = args.rounds if timed else 1
    for r in range(rounds):
        for precision, rows, cfg in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
            key = (precision, rows)
            with _configured(**cfg):
                row = times.setdefault(key, {"g2x1024": [], "g2x4096": [], **{f"water{n}": [] for n in water}})
                for n, mols in g2.items():
                    us = _step_us(student, mols, mode="cudagraph", precision=precision) / n if timed else float("nan")
                    row[f"g2x{n}"].append(us)
                for n, box in water.items():
                    ms = _step_us(student, box, mode="auto", precision=precision) / 1e3 if timed else float("nan")
                    row[f"water{n}"].append(ms)
                if key not in errors:
                    engine = ForceEngine(builtin, device="cuda", precision=precision)
                    errors[key] = {}
                    for name, b in batches.items():
                        out, ref = engine.compute(b, to_host=True), refs[name]
                        df = (out["forces"].double() - ref["forces"].double()) * 1e3
                        norm = df.norm(dim=1)
                        de = (out["energy"].double() - ref["energy"].double()).abs() / b.counts.double()
                        errors[key][name] = (
                            float(df.pow(2).mean().sqrt()),
                            float(norm.median()),
                            float(norm.max()),
                            float(de.max()) * 1e3,
                        )
                    del engine
            print(key, {k: v[-1] for k, v in row.items()}, errors[key], flush=True)
    lines = [
        "# Reduced precisions: step time against accuracy (probe_precision.py)",
        "",
        f"{torch.cuda.get_device_name()} · torch {torch.__version__} · triton {triton.__version__} · "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        f"Step = the energy + forces step alone (random {args.hidden} x {args.layers} student, the 14 g2 species; "
        "captured, the 24,000-atom box eager), the median of "
        f"{args.rounds} passes over the variants in alternating order (each pass a CUDA-event median). Errors: the "
        f"shipped `{student_name}` on {len(chno)} H/C/N/O g2 molecules as built, on four copies of each "
        "rattled by 0.05 Å (two seeds) and on a 3,000-atom water box, against its fp64 result; its own force MAE "
        f"against GFN2-xTB is {builtin.metadata.get('test_force_mae_mev_a', float('nan')):.2f} meV/Å. The built g2 "
        "geometries are exactly symmetric, and a few atoms at symmetric sites set their max and RMSE (see the "
        "probe's docstring). Message-passing dots: tf32x3 in fp32, one TF32 pass otherwise; rows: what its "
        "kernels gather (float32, or 16-bit copies of the senders' x and v, and bfloat16 ones of the gradients).",
        "",
        "| precision | rows | g2 ×1,024 µs/structure | g2 ×4,096 µs/structure | "
        + " | ".join(f"water {n:,} ms" for n in water)
        + " | "
        + " | ".join(f"{name}: force RMSE / median / max meV/Å, energy max meV/atom" for name in sets)
        + " |",
        "|---|---|---:|---:|" + "---:|" * len(water) + "---|" * len(sets),
    ]
    for precision, rows, _ in VARIANTS:
        key = (precision, rows)
        med = {k: sorted(v)[len(v) // 2] for k, v in times[key].items()}
        errs = " | ".join(
            f"{rmse:.2f} / {mid:.2f} / {fmax:.1f}, {emax:.3f}" for rmse, mid, fmax, emax in errors[key].values()
        )
        walls = " | ".join(f"{med[f'water{n}']:.3f}" for n in water)
        lines.append(f"| {precision} | {rows} | {med['g2x1024']:.3f} | {med['g2x4096']:.3f} | {walls} | {errs} |")
    print(f"wrote {write_lines(lines, args.out, args.name)}")


if __name__ == "__main__":
    main()
