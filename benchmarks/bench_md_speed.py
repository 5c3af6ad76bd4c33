"""Student vs teacher time per ASE MD step on the same structure and GPU (issue 6's speed target).

    python benchmarks/bench_md_speed.py --out DIR [--teacher sevennet-0] [--atoms 192] [--steps 300]

The system is the SevenNet-0 water example's: a periodic box of 192 atoms at 1 g/cm³ (``systems.water_box``);
the student has that example's architecture (``configs/water_sevennet_train.yaml``: 128 features, 3 layers,
20 radial functions, 5 Å). The step time of a student does not depend on its weights, only on its architecture
and on how often its Verlet list is rebuilt, so the student here is freshly initialised with its energy scaled
down (``--student-scale``) so that its random forces do not heat the box faster than a trained student would.
Both run velocity-Verlet MD at 0.5 fs from the same 300 K velocities through
:func:`mlff_distiller.distill.md_step_timing`: each step timed on its own, median reported (mean and max beside
it show one-off costs), the student through ``StudentCalculator`` defaults (CUDA graphs on the GPU, Verlet skin
1 Å). Writes ``md_speed.json`` and ``md_speed.md``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from systems import water_box

from mlff_distiller import StudentCalculator, StudentModel
from mlff_distiller.distill import get_teacher, md_step_timing


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/md_speed")
    ap.add_argument("--teacher", default="sevennet-0")
    ap.add_argument("--atoms", type=int, default=192)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--student-scale", type=float, default=0.01, help="factor on the random student's energy")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        raise ValueError("--steps must be >= 1 and --warmup >= 0")
    torch.manual_seed(0)
    model = StudentModel(species=[1, 8], hidden=128, layers=3, n_rbf=20, cutoff=5.0)
    with torch.no_grad():  # smaller random forces: a thermal trajectory, not an explosion
        model.atomic_scale.mul_(args.student_scale)
    box = water_box(args.atoms, seed=0)
    options = {"device": args.device} if args.teacher == "sevennet-0" else {}
    teacher = get_teacher(args.teacher, **options)
    student = StudentCalculator(model, device=args.device)
    t0 = time.perf_counter()
    timing = md_step_timing(box, student, teacher, steps=args.steps, warmup=args.warmup)
    result = {
        "teacher": args.teacher,
        "system": f"water box, {len(box)} atoms, periodic, 1 g/cm3",
        "student": "hidden 128, 3 layers, 20 RBF, 5 A (water example architecture), StudentCalculator defaults",
        "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "seconds": time.perf_counter() - t0,
        "timing": timing,
        "verlet_builds": getattr(student.engine.verlet, "n_builds", None),
    }
    try:
        import triton

        result["triton"] = triton.__version__
    except ImportError:
        result["triton"] = None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "md_speed.json").write_text(json.dumps(result, indent=1))
    t = timing
    lines = [
        f"# Student vs {args.teacher} per ASE MD step ({result['device']}, torch {result['torch']}, "
        f"triton {result['triton']})",
        "",
        f"{result['system']}; {args.steps} timed velocity-Verlet steps after {args.warmup} warm-up steps; student: "
        f"{result['student']}; Verlet list builds {result['verlet_builds']}.",
        "",
        "| | median ms / step | mean ms | max ms |",
        "|---|---:|---:|---:|",
        f"| student | {t['student_s_per_step'] * 1e3:.3f} | {t['student_mean_s_per_step'] * 1e3:.3f} | "
        f"{t['student_max_s_per_step'] * 1e3:.2f} |",
        f"| {args.teacher} | {t['teacher_s_per_step'] * 1e3:.3f} | {t['teacher_mean_s_per_step'] * 1e3:.3f} | "
        f"{t['teacher_max_s_per_step'] * 1e3:.2f} |",
        "",
        f"**Speed-up (teacher / student, medians): {t['speedup']:.1f}x** (target >= 100x).",
    ]
    (out / "md_speed.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


if __name__ == "__main__":
    main()
