"""Fine-tune a shipped student on a molecule it was not trained on, against training a new one for the same time.

    python examples/finetune_builtin.py --molecule BDA --time-limit 60 --results benchmarks/results/finetune_bda_cpu

The built-in students learned GFN2-xTB on the 61 small H/C/N/O molecules of ASE's g2 set. ``--molecule`` names one
outside that set (ASE's ``molecule()`` extras: ``BDA`` 1,4-benzenediamine, ``C7NH5`` benzonitrile, ``biphenyl``).
Steps, all with the same labels and the same wall-clock budget:

1. label GFN2-xTB (tblite) Langevin MD of the molecule at 300, 500 and 700 K: training trajectories and held-out
   ones from another random seed, all at the same temperatures (``mlff_distiller.distill.label``);
2. errors of the shipped student on the held-out frames, as it ships;
3. ``train(..., model=shipped)``: fine-tuning for ``--time-limit`` seconds (``--finetune-lr``; with a teacher
   other than the student's, ``refit_energy_reference`` first moves it to the new teacher's energy zero);
4. a new student of the same architecture trained from scratch on the same frames for the same time;
5. errors of all three on the held-out frames;
6. Langevin MD at 300 K of the shipped and the fine-tuned student, ``--md-ps`` each (or ``--md-seconds`` of wall
   clock), checked for a collapsed pair and a broken or new bond (``mlff_distiller.distill.stability_run``);
7. writes ``metrics.json`` and ``summary.md`` under ``--results``.

``--quick`` is a CPU smoke test (ASE's EMT as the teacher, a few dozen frames, seconds of training).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
from ase.build import molecule

from mlff_distiller import load_model
from mlff_distiller.distill import (
    FrameDataset,
    SamplingConfig,
    TrainConfig,
    label,
    read_frames,
    split_frames,
    stability_run,
    train,
)
from mlff_distiller.distill.objective import evaluate_dataset

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from harness import git_commit  # noqa: E402  (benchmarks/harness.py: commit, -dirty when changed)


def errors(model, frames) -> dict:
    """Energy and force errors of ``model`` on ``frames`` (evaluated in float64 on the CPU)."""
    m = type(model)(model.config).double()
    m.load_state_dict(model.state_dict())
    return evaluate_dataset(m, FrameDataset(frames, cutoff=m.cutoff, dtype=torch.float64))


def train_config(args, **kw) -> TrainConfig:
    """The built-in recipe's loss weights and schedule, scaled to a short run on few frames."""
    opts = dict(
        batch_size=16,
        energy_weight=16.0,
        force_weight=4.0,
        warmup_steps=50,
        ema_decay=0.99,
        eval_every=50,
        patience=0,
        epochs=100000,
        time_limit_s=args.time_limit,
        device=args.device,
        seed=args.seed,
    )
    opts.update(kw)
    return TrainConfig(**opts)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--molecule", default="BDA", help="a name ase.build.molecule knows (default: BDA)")
    p.add_argument("--student", default="builtin:chno-gfn2", help="the student to fine-tune")
    p.add_argument("--teacher", default="gfn2-xtb")
    p.add_argument("--time-limit", type=float, default=60.0, help="training seconds, for each of the two runs")
    p.add_argument("--finetune-lr", type=float, default=5e-4, help="peak learning rate of the fine-tuning")
    p.add_argument("--scratch-lr", type=float, default=2e-3, help="peak learning rate of the new student")
    p.add_argument("--md-steps", type=int, default=400)
    p.add_argument("--replicas", type=int, default=4, help="training trajectories per temperature")
    p.add_argument("--md-ps", type=float, default=5.0, help="simulated ps of each stability run")
    p.add_argument("--md-seconds", type=float, default=120.0, help="wall-clock cap of each stability run")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default="runs/finetune", help="labels and checkpoints")
    p.add_argument("--results", default="runs/finetune/results")
    p.add_argument("--quick", action="store_true", help="CPU smoke test: EMT teacher, few frames, short runs")
    args = p.parse_args(argv)
    if args.quick:
        args.teacher, args.md_steps, args.replicas, args.time_limit = "emt", 40, 1, min(args.time_limit, 3.0)
        args.md_ps, args.md_seconds = 0.02, 10.0
    work, results = Path(args.work), Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    seed = molecule(args.molecule)
    temperatures = [300.0, 500.0, 700.0]

    t0 = time.perf_counter()
    every = 4 if args.quick else 8
    train_cfg = SamplingConfig(
        temperatures=temperatures, md_steps=args.md_steps, sample_every=every, replicas=args.replicas
    )
    test_cfg = SamplingConfig(
        temperatures=temperatures,
        md_steps=args.md_steps,
        sample_every=every,
        replicas=max(1, args.replicas // 2),
        seed=99,
    )
    label([seed], args.teacher, work / "train_labels", train_cfg, progress=False)
    label([seed], args.teacher, work / "test_labels", test_cfg, progress=False)
    label_seconds = time.perf_counter() - t0
    frames, test = read_frames(work / "train_labels"), read_frames(work / "test_labels")
    train_f, val_f = split_frames(frames, 0.15, seed=args.seed)

    shipped = load_model(args.student)
    quiet = lambda msg: None  # noqa: E731
    runs = {"shipped, as it is": {"model": shipped, "seconds": 0.0, "steps": 0}}
    # Labels from another teacher than the student's have another energy zero: refit its energy reference first.
    refit = args.teacher != shipped.metadata.get("teacher")
    cfg = train_config(args, lr=args.finetune_lr, refit_energy_reference=refit)
    tuned = train(train_f, val_f, cfg, work / "finetuned", model=shipped, log=quiet)
    runs["fine-tuned"] = {"model": tuned.model, "seconds": tuned.seconds, "steps": tuned.steps}
    arch = {k: v for k, v in shipped.config.__dict__.items()}
    fresh = train(train_f, val_f, train_config(args, lr=args.scratch_lr, model=arch), work / "scratch", log=quiet)
    runs["new student, same architecture"] = {"model": fresh.model, "seconds": fresh.seconds, "steps": fresh.steps}

    device = tuned.model.atomic_scale.device
    rows = {}
    for name, run in runs.items():
        rows[name] = {"train_seconds": run["seconds"], "steps": run["steps"], **errors(run["model"].cpu(), test)}
    metrics = {
        "molecule": args.molecule,
        "formula": seed.get_chemical_formula(),
        "atoms": len(seed),
        "teacher": args.teacher,
        "student": args.student,
        "train_frames": len(train_f),
        "val_frames": len(val_f),
        "test_frames": len(test),
        "label_seconds": label_seconds,
        "time_limit_s": args.time_limit,
        "finetune_lr": args.finetune_lr,
        "scratch_lr": args.scratch_lr,
        "refit_energy_reference": refit,
        "device": str(device) + ("" if device.type != "cuda" else f" ({torch.cuda.get_device_name(device)})"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, {torch.get_num_threads()} torch threads",
        "torch": torch.__version__,
        "commit": git_commit(),
        "runs": rows,
    }
    md_device = "cpu" if device.type == "cpu" else str(device)
    for name in ("shipped, as it is", "fine-tuned"):
        md, _ = stability_run(
            runs[name]["model"], seed, md_device, seconds=args.md_seconds, max_ps=args.md_ps, temperature=300.0,
            timestep_fs=0.5, check=20, seed=args.seed,
        )  # fmt: skip
        rows[name]["md"] = md
    (results / "metrics.json").write_text(json.dumps(metrics, indent=1))
    lines = [
        f"# Fine-tuning `{args.student}` on {args.molecule} ({metrics['formula']}, {len(seed)} atoms), "
        f"teacher {args.teacher}",
        "",
        "`python examples/finetune_builtin.py " + " ".join(sys.argv[1:] if argv is None else argv) + "`",
        f"commit {metrics['commit']} · torch {torch.__version__} · training on {metrics['device']} · "
        f"{metrics['machine']}",
        "",
        f"Labels: Langevin MD at {', '.join(f'{t:.0f}' for t in temperatures)} K, {len(train_f)} training and "
        f"{len(val_f)} validation frames, {len(test)} held-out frames from separate trajectories (another seed); "
        f"labelling took {label_seconds:.0f} s. Each training run had {args.time_limit:.0f} s of wall clock "
        f"(fine-tuning lr {args.finetune_lr:g}{', energy reference refitted' if refit else ''}; the new student lr "
        f"{args.scratch_lr:g}; loss weights and schedule of the built-in recipe).",
        "",
        "| student | training s | steps | held-out force MAE meV/Å | force RMSE meV/Å | energy MAE meV/atom |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, r in rows.items():
        lines.append(
            f"| {name} | {r['train_seconds']:.0f} | {r['steps']} | {r['force_mae_mev_a']:.1f} | "
            f"{r['force_rmse_mev_a']:.1f} | {r['energy_mae_mev_atom']:.2f} |"
        )
    lines += ["", "Langevin MD at 300 K (0.5 fs, fp32), checked every 20 steps:", ""]
    for name in ("shipped, as it is", "fine-tuned"):
        md = rows[name]["md"]
        verdict = "stable" if md["stable"] else f"unstable: {md['failure']}"
        lines.append(
            f"- {name}: {md.get('simulated_ps', 0.0):.2f} ps in {md['wall_seconds']:.0f} s, {verdict}, closest pair "
            f"{md.get('min_pair_distance_a', float('nan')):.2f} Å"
        )
    (results / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return metrics


if __name__ == "__main__":
    main()
