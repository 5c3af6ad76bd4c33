"""The engine's reduced precisions, step time against accuracy (a probe for issue 5's tf32 / bf16 row).

Under ``precision="tf32"``, ``"bf16"`` and ``"fp16"`` the Triton GEMMs multiply in TF32 or 16 bits and the
message-passing dots take one TF32 pass instead of tf32x3 (``kernels.message_passing._CONFIG["reduced_dots"]``).
This probe times each precision with the message passing reduced and kept at tf32x3, in one run:

* the captured energy + forces step of 1,024 and 4,096 g2 molecules (random 128 x 3 student, µs per structure) and
  of a 3,000-atom water box (ms);
* the error against fp64 of the shipped ``builtin:chno-gfn2`` on the H/C/N/O g2 molecules as built and rattled
  by 0.05 Å (force RMSE, median and max of the per-atom error norm, meV/Å; the student's own force MAE against
  GFN2-xTB is 18.75 meV/Å). The g2 geometries are exactly symmetric: at a symmetric site an atom's vector
  features cancel, and the update block's ``sqrt(|Vv|² + 1e-8)`` turns rounding noise there into an O(1) change of
  its gradient, so a few such atoms set the max and the RMSE on the built set. The rattled sets, like MD frames,
  show the typical error.

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

VARIANTS = (  # (precision, message passing reduced)
    ("fp32", False),
    ("tf32", False),
    ("tf32", True),
    ("bf16", False),
    ("bf16", True),
    ("fp16", False),
    ("fp16", True),
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--name", default="probe_precision_h100")
    p.add_argument("--rounds", type=int, default=2, help="timing passes over the variants (order alternates)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("probe_precision: needs CUDA")
        return
    import triton

    student = make_student()
    g2 = {n: g2_batch(n) for n in (1024, 4096)}
    water = [water_box(3000, seed=0)]
    builtin = load_model("builtin:chno-gfn2")
    chno = [m for m in g2_batch(162) if set(m.get_chemical_symbols()) <= {"H", "C", "N", "O"}]
    sets = {"g2": chno}
    for seed in (1, 2):
        rattled = [m.copy() for m in chno]
        for k, m in enumerate(rattled):
            m.rattle(0.05, seed=100 * seed + k)
        sets[f"rattled {seed}"] = rattled
    batches = {k: AtomsBatch.from_atoms(v) for k, v in sets.items()}
    refs = {
        k: ForceEngine(builtin, device="cuda", precision="fp64").compute(b, to_host=True) for k, b in batches.items()
    }
    times: dict = {}
    errors: dict = {}
    for r in range(args.rounds):
        for precision, reduced in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
            key = (precision, reduced)
            with _configured(reduced_dots=reduced):
                row = times.setdefault(key, {"g2x1024": [], "g2x4096": [], "water3000": []})
                for n, mols in g2.items():
                    row[f"g2x{n}"].append(_step_us(student, mols, mode="cudagraph", precision=precision) / n)
                row["water3000"].append(_step_us(student, water, mode="auto", precision=precision) / 1e3)
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
        "Step = the captured energy + forces step alone (random 128 x 3 student, the 14 g2 species), the median of "
        f"{args.rounds} passes over the variants in alternating order (each pass a CUDA-event median). Errors: the "
        f"shipped `builtin:chno-gfn2` on {len(chno)} H/C/N/O g2 molecules, as built and rattled by 0.05 Å (two "
        "seeds), against its fp64 result; its own force MAE against GFN2-xTB is 18.75 meV/Å. The built g2 "
        "geometries are exactly symmetric, and a few atoms at symmetric sites set their max and RMSE (see the "
        "probe's docstring). MP = the message-passing dots: tf32x3 (float32 accuracy) or one TF32 "
        "pass.",
        "",
        "| precision | MP dots | g2 ×1,024 µs/structure | g2 ×4,096 µs/structure | water 3,000 ms | "
        + " | ".join(f"{name}: force RMSE / median / max meV/Å, energy max meV/atom" for name in sets)
        + " |",
        "|---|---|---:|---:|---:|" + "---|" * len(sets),
    ]
    for key in VARIANTS:
        med = {k: sorted(v)[len(v) // 2] for k, v in times[key].items()}
        errs = " | ".join(
            f"{rmse:.2f} / {mid:.2f} / {fmax:.1f}, {emax:.3f}" for rmse, mid, fmax, emax in errors[key].values()
        )
        lines.append(
            f"| {key[0]} | {'TF32' if key[1] and key[0] != 'fp32' else 'tf32x3'} | {med['g2x1024']:.3f} | "
            f"{med['g2x4096']:.3f} | {med['water3000']:.3f} | {errs} |"
        )
    print(f"wrote {write_lines(lines, args.out, args.name)}")


if __name__ == "__main__":
    main()
