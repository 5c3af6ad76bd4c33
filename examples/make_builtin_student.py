"""Make the built-in student ``builtin:chno-gfn2`` (GFN2-xTB distilled into a PaiNN student), reproducibly.

    python examples/make_builtin_student.py --workers 16 --deadline 440 --install

1. labels training frames (``configs/chno_gfn2_label.yaml``) and held-out frames from separate trajectories
   (``configs/chno_gfn2_test.yaml``) with GFN2-xTB (tblite), in parallel over molecules;
2. trains with ``configs/chno_gfn2_train.yaml`` (on CUDA when available);
3. evaluates on the held-out frames (energy/force MAE and RMSE, parity plot, learning curve), times an ASE
   MD step of the student against GFN2-xTB on ethanol, and runs an NVE drift check;
4. writes ``<results>/<name>.pt`` (``--name``, default ``chno-gfn2``) with the measured metrics in its metadata
   and ``<results>/metrics.json``; ``--install`` also copies it to ``src/mlff_distiller/data/<name>.pt``.

``--hidden``/``--layers`` change the student's size (``builtin:chno-gfn2-small`` is ``--hidden 64 --layers 3``).

The shipped checkpoint was made with this script on one H100
(see ``benchmarks/results/builtin_chno_gfn2.md``).
``--quick`` runs a tiny version (4 molecules, seconds of training) to check the pipeline end to end.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", default="runs/chno_gfn2", help="labels and training run directory")
    ap.add_argument("--results", default="runs/chno_gfn2/results", help="checkpoint, metrics, plots")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="labelling processes")
    ap.add_argument("--time-limit", type=float, default=None, help="training wall clock, s (default: config)")
    ap.add_argument(
        "--deadline",
        type=float,
        default=None,
        help="whole-run wall clock, s: training gets what labelling left, minus 100 s for evaluation",
    )
    ap.add_argument("--install", action="store_true", help="copy the checkpoint into the package data")
    ap.add_argument("--name", default="chno-gfn2", help="builtin name: writes <name>.pt (builtin:<name>)")
    ap.add_argument("--hidden", type=int, default=None, help="student width (default: the training config's)")
    ap.add_argument("--layers", type=int, default=None, help="interaction layers (default: the config's)")
    ap.add_argument("--batch-size", type=int, default=None, help="training batch (default: the config's)")
    ap.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the config's)")
    ap.add_argument("--seed", type=int, default=None, help="training seed (default: the config's)")
    ap.add_argument("--quick", action="store_true", help="tiny end-to-end check")
    args = ap.parse_args()

    from mlff_distiller.cli import LabelJob, TrainJob
    from mlff_distiller.distill import (
        error_metrics,
        g2_chno,
        label_parallel,
        learning_curve_plot,
        md_step_timing,
        nve_drift,
        parity_plot,
        predict_frames,
        read_frames,
        split_frames,
        train,
    )
    from mlff_distiller.distill.config import from_dict, load_yaml
    from mlff_distiller.distill.teachers import get_teacher

    t_start = time.perf_counter()
    work, results = Path(args.work), Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    label_train = from_dict(LabelJob, load_yaml(ROOT / "configs/chno_gfn2_label.yaml"))
    label_test = from_dict(LabelJob, load_yaml(ROOT / "configs/chno_gfn2_test.yaml"))
    train_job = from_dict(TrainJob, load_yaml(ROOT / "configs/chno_gfn2_train.yaml"))
    seeds = g2_chno()
    if args.quick:
        seeds = seeds[20:24]
        for job in (label_train, label_test):
            job.sampling.temperatures = job.sampling.temperatures[:2]
            job.sampling.md_steps = 80
        label_train.sampling.rattle_per_seed = 2
        train_job.train.model.hidden = 32
        train_job.train.model.layers = 2
        train_job.train.time_limit_s = 20
        train_job.train.eval_every = 50
        train_job.train.warmup_steps = 20
        train_job.train.batch_size = 8
    if args.time_limit is not None:
        train_job.train.time_limit_s = args.time_limit
    if args.hidden is not None:
        train_job.train.model.hidden = args.hidden
    if args.layers is not None:
        train_job.train.model.layers = args.layers
    for key in ("batch_size", "lr", "seed"):
        if getattr(args, key) is not None:
            setattr(train_job.train, key, getattr(args, key))
    ckpt_name = f"{args.name}.pt"
    model_cfg = train_job.train.model
    summary: dict = {
        "teacher": "gfn2-xtb (tblite)",
        "seeds": f"{len(seeds)} closed-shell CHNO molecules of ase.collections.g2",
        "host": platform.node(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "name": args.name,
        "model": {"hidden": model_cfg.hidden, "layers": model_cfg.layers, "n_rbf": model_cfg.n_rbf},
        "train_config": {
            k: getattr(train_job.train, k) for k in ("batch_size", "lr", "seed", "time_limit_s", "ema_decay")
        },
    }
    try:
        import triton

        summary["triton"] = triton.__version__
    except ImportError:
        summary["triton"] = None

    def save_summary() -> None:
        (results / "metrics.json").write_text(json.dumps(summary, indent=1, default=str))

    t = time.perf_counter()
    for name, job in (("train", label_train), ("test", label_test)):
        report = label_parallel(seeds, job.teacher, work / f"{name}_labels", job.sampling, workers=args.workers)
        summary[f"label_{name}"] = {"frames": report.total, "duplicates": report.duplicates}
        print(f"labelled {name}: {report}", flush=True)
    summary["label_seconds"] = time.perf_counter() - t
    save_summary()

    if args.deadline is not None:
        left = args.deadline - (time.perf_counter() - t_start) - 100.0
        if left < 30:
            raise SystemExit(f"deadline {args.deadline} s leaves {left:.0f} s for training; aborting")
        train_job.train.time_limit_s = min(train_job.train.time_limit_s or left, left)
        summary["train_time_limit_s"] = train_job.train.time_limit_s
    frames = read_frames(work / "train_labels")
    test = read_frames(work / "test_labels")
    train_frames, val_frames = split_frames(frames, train_job.val_fraction, seed=train_job.split_seed)
    summary["frames"] = {"train": len(train_frames), "val": len(val_frames), "test": len(test)}
    result = train(
        train_frames,
        val_frames,
        train_job.train,
        work / "train",
        metadata={"teacher": "gfn2-xtb", "data": "g2 CHNO, 300-800 K"},
    )
    summary["training"] = {
        "steps": result.steps,
        "seconds": result.seconds,
        "stopped": result.stopped,
        "best_val": result.best_val,
    }
    learning_curve_plot(result.history, results / "learning_curve.png")
    save_summary()

    model = result.model.to(device="cpu", dtype=torch.float32).eval()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    meta = {
        "teacher": "gfn2-xtb",
        "description": (
            f"PaiNN student ({train_job.train.model.hidden} features x {train_job.train.model.layers} layers) of "
            "GFN2-xTB on closed-shell CHNO molecules of ASE g2, 300-800 K"
        ),
        "recipe": "python " + " ".join(["examples/make_builtin_student.py", *sys.argv[1:]]),
        "val": result.best_val,
        "train_frames": len(train_frames),
        "train_seconds": result.seconds,
        "train_device": summary["device"],
    }
    # What the trainer recorded with its student: where the training data lies (``domain``, mlff_distiller.domain:
    # the domain check of StudentCalculator, predict_forces and `mlff-distill check` reads it from the checkpoint)
    # and whether its weights are on the TF32 grid (``tf32_grid``, ``val_tf32_grid``).
    trained = getattr(result.model, "metadata", None) or {}
    meta.update({k: trained[k] for k in ("domain", "tf32_grid", "val_tf32_grid") if trained.get(k) is not None})

    def save_model() -> None:
        model.save(results / ckpt_name, metadata=meta)
        summary["checkpoint_bytes"] = (results / ckpt_name).stat().st_size
        save_summary()
        if args.install:
            target = ROOT / "src/mlff_distiller/data" / ckpt_name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(results / ckpt_name, target)

    save_model()  # before evaluation, so a failure there cannot lose the trained student

    def phase(name, fn) -> None:
        # Each measurement is independent: record a failure and go on with the others.
        try:
            summary[name] = fn()
        except Exception as exc:
            summary[name] = {"error": f"{type(exc).__name__}: {exc}"}
        save_summary()

    def test_errors(precision: str) -> dict:
        m = error_metrics(test, predict_frames(model, test, device=device, precision=precision))
        if precision == "fp32":
            parity_plot(m, results / "parity.png", title=f"builtin:{args.name} vs GFN2-xTB, held-out trajectories")
        return {k: v for k, v in m.items() if not k.startswith("_")}

    from ase.build import molecule

    from mlff_distiller.calculator import StudentCalculator

    ethanol = molecule("CH3CH2OH")

    def timing() -> dict:
        student = StudentCalculator(model, device=device, precision="fp32")
        out = md_step_timing(ethanol, student, get_teacher("gfn2-xtb"), steps=20 if args.quick else 200)
        return {**out, "student_device": device, "teacher_device": "cpu (tblite has no GPU path)"}

    phase("test_fp32", lambda: test_errors("fp32"))
    phase("test_fp64", lambda: test_errors("fp64"))
    phase("md_step_timing_ethanol", timing)
    phase("nve_ethanol", lambda: nve_drift(ethanol, model, steps=200 if args.quick else 2000, device=device))
    test_m = summary["test_fp32"]
    if "error" not in test_m:
        meta.update(
            test_energy_mae_mev_atom=test_m["energy_mae_mev_atom"],
            test_force_mae_mev_a=test_m["force_mae_mev_a"],
            test_force_rmse_mev_a=test_m["force_rmse_mev_a"],
            test_frames=test_m["frames"],
        )
    save_model()
    print(json.dumps(summary, indent=1, default=str))


if __name__ == "__main__":
    sys.exit(main())
