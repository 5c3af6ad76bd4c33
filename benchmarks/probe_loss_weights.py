"""What a per-source loss weight (``mlff-distill train --data-weight``) does to a fine-tuning round, on the CPU with
the EMT teacher (no GPU, no xTB).

    python benchmarks/probe_loss_weights.py --out benchmarks/results/ [--steps 3000] [--ft-steps 1500] [--seeds 0 1 2]

Set A: EMT-labelled MD of small CHNO molecules at 300 and 500 K (``mlff-distill label``'s sampling), training and
held-out trajectories from different seeds. Set B, "hot": the same molecules with every atom displaced by a normal
of ``--hot-sigma`` Å per component (forces of several eV/Å, the stand-in for a harvested round), training and
held-out frames from different draws. A student is trained on A, then fine-tuned through the command line
(``train --data A --data B --init-model base.pt``) with B weighted 1.0 and 0.2 (and 0.0: B ignored). Each student's
force MAE on held-out A and held-out B is reported (unweighted, ``evaluate_dataset``), per seed of the fine-tuning.
Writes ``<out>/loss_weights_cpu.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import ase.io
import numpy as np
import torch
from ase.build import molecule
from ase.calculators.emt import EMT
from ase.calculators.singlepoint import SinglePointCalculator

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import git_commit, write_lines

from mlff_distiller import load_model
from mlff_distiller.cli import main as cli
from mlff_distiller.distill import FrameDataset, SamplingConfig, TrainConfig, evaluate_dataset, label, read_frames
from mlff_distiller.distill.training import train

MOLECULES = ("H2O", "CH4", "NH3", "CH3OH", "HCN", "C2H4")
STUDENT = dict(hidden=32, layers=2, n_rbf=8, cutoff=4.0)


def hot_frames(n_per_molecule: int, sigma: float, seed: int) -> list:
    """The molecules with every atom displaced by N(0, sigma²) Å per component, EMT-labelled."""
    rng = np.random.default_rng(seed)
    out = []
    for name in MOLECULES:
        for _ in range(n_per_molecule):
            a = molecule(name)
            a.positions += rng.normal(scale=sigma, size=a.positions.shape)
            a.calc = EMT()
            b = a.copy()
            b.calc = SinglePointCalculator(b, energy=a.get_potential_energy(), forces=a.get_forces())
            out.append(b)
    return out


def force_mae(model, frames) -> float:
    return evaluate_dataset(model.float(), FrameDataset(frames, model.cutoff))["force_mae_mev_a"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--steps", type=int, default=3000, help="optimiser steps of the base run")
    p.add_argument("--ft-steps", type=int, default=1500, help="optimiser steps of each fine-tuning run")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds of the fine-tuning runs")
    p.add_argument("--weights", type=float, nargs="+", default=[1.0, 0.2, 0.0], help="--data-weight of set B")
    p.add_argument("--hot-sigma", type=float, default=0.15, help="Å, the hot set's displacement per component")
    p.add_argument(
        "--weight-norms",
        nargs="+",
        default=["sum"],
        choices=["sum", "count"],
        help="train.weight_norm of the fine-tuning runs (each run with every one; count: as MACE, per frame count)",
    )
    p.add_argument("--name", default="loss_weights_cpu")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="loss_weights_"))
    seeds = [molecule(m) for m in MOLECULES]
    sampling = dict(temperatures=[300.0, 500.0], md_steps=120, sample_every=4, timestep_fs=0.5, rattle_per_seed=4)
    label(seeds, "emt", work / "a", SamplingConfig(**sampling), progress=False)
    label(
        seeds, "emt", work / "a_test", SamplingConfig(**{**sampling, "seed": 99, "rattle_per_seed": 0}), progress=False
    )
    hot_train, hot_test = hot_frames(25, args.hot_sigma, 1), hot_frames(10, args.hot_sigma, 2)
    ase.io.write(work / "b.extxyz", hot_train, format="extxyz")
    a_test = read_frames(work / "a_test")
    n_a = len(read_frames(work / "a"))
    f_a = np.abs(np.concatenate([f.get_forces() for f in a_test])).mean()
    f_b = np.abs(np.concatenate([f.get_forces() for f in hot_test])).mean()

    common = dict(batch_size=16, lr=2e-3, warmup_steps=20, eval_every=100, patience=0, device="cpu", max_steps=0)
    base_cfg = TrainConfig(model=STUDENT, **{**common, "max_steps": args.steps})
    from mlff_distiller.distill import split_frames

    tr, va = split_frames(read_frames(work / "a"), 0.1)
    base = train(tr, va, base_cfg, work / "base", log=lambda m: None).model
    rows = [("base (A only)", "-", "-", force_mae(base, a_test), force_mae(base, hot_test))]
    print(rows[-1], flush=True)
    norms = args.weight_norms
    for seed in args.seeds:
        for w in args.weights:
            for norm in norms:
                run = work / f"ft_w{w}_s{seed}_{norm}"
                argv = ["train", "--data", str(work / "a"), "--data", str(work / "b.extxyz"), "--out", str(run)]
                argv += ["--init-model", str(work / "base" / "best.pt"), "--data-weight", "1", "--data-weight", str(w)]
                sets = dict(common, lr=5e-4, max_steps=args.ft_steps, seed=seed, weight_norm=norm)
                argv += [f"--set=train.{k}={v}" for k, v in sets.items()]
                with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                    assert cli(argv) == 0, argv
                tuned = load_model(run / "best.pt")
                name = f"fine-tuned on A + B, B weight {w:g}" + (f", weight_norm {norm}" if len(norms) > 1 else "")
                rows.append((name, seed, (w, norm), force_mae(tuned, a_test), force_mae(tuned, hot_test)))
                print(rows[-1], flush=True)

    lines = [
        "# Per-source loss weight in a fine-tuning round (CPU, EMT teacher)",
        "",
        f"`python benchmarks/probe_loss_weights.py {' '.join(sys.argv[1:])}`; commit {git_commit()}, torch "
        f"{torch.__version__}, {platform.processor() or platform.machine()}, {args.threads} threads, "
        f"{time.perf_counter() - t_start:.0f} s in all.",
        "",
        f"Set A: EMT MD of {', '.join(MOLECULES)} at 300 and 500 K plus rattles ({n_a} training frames); held-out A: "
        f"{len(a_test)} frames of other trajectories (mean |F| component {1000 * f_a:.0f} meV/Å). Set B (hot): the "
        f"molecules with every atom displaced by N(0, {args.hot_sigma} Å) per component ({len(hot_train)} training "
        f"frames, {len(hot_test)} held out, mean |F| component {1000 * f_b:.0f} meV/Å). Student {json.dumps(STUDENT)}, "
        f"float32. Base: {args.steps} steps on A (lr 2e-3). Fine-tuning: `mlff-distill train --data A --data B "
        f"--data-weight 1 --data-weight W --init-model base.pt`, {args.ft_steps} steps at lr 5e-4, batch 16; best.pt "
        "chosen on the (unweighted) validation split of A + B. Force MAE (meV/Å), unweighted, on the held-out sets."
        + (f" `train.weight_norm`: {' and '.join(norms)} (docs/distillation.md)." if len(norms) > 1 else ""),
        "",
        "| student | seed | B weight | force MAE held-out A | force MAE held-out B |",
        "|---|---:|---:|---:|---:|",
    ]
    lines += [f"| {name} | {s} | {_w(w)} | {a:.1f} | {b:.1f} |" for name, s, w, a, b in rows]
    for w in args.weights:
        for norm in norms:
            sel = [r for r in rows if r[2] == (w, norm)]
            what = f"B weight {w:g}" + (f", weight_norm {norm}" if len(norms) > 1 else "")
            lines.append(
                f"| mean over seeds, {what} | | {w:g} | {np.mean([r[3] for r in sel]):.1f} | "
                f"{np.mean([r[4] for r in sel]):.1f} |"
            )
    write_lines(lines, args.out, args.name)


def _w(w) -> str:
    """The table's weight cell: "-" for the base, the weight of a fine-tuning run."""
    return w if isinstance(w, str) else f"{w[0]:g}"


if __name__ == "__main__":
    main()
