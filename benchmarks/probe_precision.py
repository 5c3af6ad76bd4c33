"""The engine's reduced precisions, step time against accuracy (a probe for issue 5's tf32 / bf16 row).

Under ``precision="tf32"``, ``"bf16"`` and ``"fp16"`` the Triton GEMMs multiply in TF32 or 16 bits and the
message-passing dots take one TF32 pass instead of tf32x3 (``kernels.message_passing._CONFIG["reduced_dots"]``).
This probe times each precision with the message passing reduced and kept at tf32x3, in one run:

* the captured energy + forces step of 1,024 and 4,096 g2 molecules (random 128 x 3 student, µs per structure) and
  of a 3,000-atom water box (ms);
* the error against fp64 of the shipped ``builtin:chno-gfn2`` on the H/C/N/O g2 molecules (force RMSE and max,
  meV/Å; the student's own force MAE against GFN2-xTB is 18.75 meV/Å).

    python benchmarks/probe_precision.py --out benchmarks/results --name probe_precision_h100
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import g2_batch, make_student
from harness import time_fn, write_lines
from mlff_distiller.kernels.message_passing import _configured
from peers import StepImpl
from systems import water_box

from mlff_distiller import AtomsBatch, ForceEngine, load_model

VARIANTS = (  # (precision, message passing reduced)
    ("fp32", False),
    ("tf32", False),
    ("tf32", True),
    ("bf16", False),
    ("bf16", True),
    ("fp16", True),
)


def _step_us(model, structures, **engine_kwargs) -> float:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        impl = StepImpl("probe", "ours", model, "cuda", **engine_kwargs)
        run = impl.prepare(structures, forces=True)
    t = time_fn(run, torch.device("cuda"), warmup_ms=25, rep_ms=300).median_us
    del impl, run
    torch.cuda.empty_cache()
    return t


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
    batch = AtomsBatch.from_atoms(chno)
    ref = ForceEngine(builtin, device="cuda", precision="fp64").compute(batch, to_host=True)
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
                    out = ForceEngine(builtin, device="cuda", precision=precision).compute(batch, to_host=True)
                    df = (out["forces"].double() - ref["forces"].double()) * 1e3
                    de = (out["energy"].double() - ref["energy"].double()).abs() / batch.counts.double()
                    errors[key] = (float(df.pow(2).mean().sqrt()), float(df.abs().max()), float(de.max()) * 1e3)
            print(key, {k: v[-1] for k, v in row.items()}, errors[key], flush=True)
    lines = [
        "# Reduced precisions: step time against accuracy (probe_precision.py)",
        "",
        f"{torch.cuda.get_device_name()} · torch {torch.__version__} · triton {triton.__version__} · "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        "Step = the captured energy + forces step alone (random 128 x 3 student, the 14 g2 species), the median of "
        f"{args.rounds} passes over the variants in alternating order (each pass a CUDA-event median). Errors: the "
        f"shipped `builtin:chno-gfn2` on {len(chno)} H/C/N/O g2 molecules against its fp64 result; its own force "
        "MAE against GFN2-xTB is 18.75 meV/Å. MP = the message-passing dots: tf32x3 (float32 accuracy) or one TF32 "
        "pass.",
        "",
        "| precision | MP dots | g2 ×1,024 µs/structure | g2 ×4,096 µs/structure | water 3,000 ms | force RMSE meV/Å "
        "| force max meV/Å | energy max meV/atom |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for key in VARIANTS:
        row, (rmse, fmax, emax) = times[key], errors[key]
        med = {k: sorted(v)[len(v) // 2] for k, v in row.items()}
        lines.append(
            f"| {key[0]} | {'TF32' if key[1] and key[0] != 'fp32' else 'tf32x3'} | {med['g2x1024']:.3f} | "
            f"{med['g2x4096']:.3f} | {med['water3000']:.3f} | {rmse:.2f} | {fmax:.1f} | {emax:.3f} |"
        )
    print(f"wrote {write_lines(lines, args.out, args.name)}")


if __name__ == "__main__":
    main()
