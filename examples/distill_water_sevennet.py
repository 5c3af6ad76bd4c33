"""Distil SevenNet-0 into a PaiNN student on a 192-atom periodic water box (the issue-6 water target).

    python examples/distill_water_sevennet.py --deadline 420          # one H100, ~7 minutes in all

Target: force MAE ≤ 20 meV/Å on held-out frames, and ≥ 100× faster than the teacher per ASE MD step on the
same box and GPU. The whole run is time-boxed by ``--deadline`` (seconds):

1. builds the box (``benchmarks/systems.py`` ``water_box``, 1 g/cm³), loads the teacher (on the GPU when
   there is one) and measures its Langevin MD step on the box;
2. sizes the sampling from that measurement so labelling takes its share of the deadline (default 40 %),
   then labels Langevin trajectories (one per box and temperature, ``configs/water_sevennet_label.yaml``)
   and a separate held-out trajectory, to disk and resumably (the plan is kept in ``<work>/plan.json``);
   the teacher runs in this one process (one GPU: no parallel workers);
3. trains a student (``configs/water_sevennet_train.yaml``) until the training share of the deadline ends;
4. evaluates on the held-out trajectory (energy/force MAE and RMSE, parity plot, learning curve), times one
   ASE velocity-Verlet step of the student (``StudentCalculator``, default mode) against the teacher on the
   same box and device in this run, and runs a short NVE check;
5. writes ``<results>/water-sevennet.pt``, ``metrics.json`` and ``summary.md``.

``--quick`` is a CPU smoke test (a 24-atom box, a few frames, seconds of training); ``--teacher emt`` swaps
in ASE's EMT so it runs without ``sevenn`` (the numbers are then meaningless, the pipeline is the same).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from systems import water_box  # noqa: E402  (benchmarks/systems.py: the same boxes the benchmarks time)

FORCE_MAE_TARGET = 20.0  # meV/Å
SPEEDUP_TARGET = 100.0  # teacher / student seconds per ASE MD step


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        return out.stdout.strip() or None
    except OSError:
        return None


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def teacher_md_step_seconds(box, teacher, *, warmup: int, steps: int, temperature: float = 350.0) -> float:
    """Wall-clock seconds per Langevin step of the teacher on a copy of ``box`` (what labelling pays)."""
    from ase import units
    from ase.md.langevin import Langevin
    from ase.md.velocitydistribution import MaxwellBoltzmannDistribution

    work = box.copy()
    work.calc = teacher
    rng = np.random.default_rng(0)
    MaxwellBoltzmannDistribution(work, temperature_K=temperature, rng=rng)
    dyn = Langevin(work, timestep=0.5 * units.fs, temperature_K=temperature, friction=0.01 / units.fs, rng=rng)
    dyn.run(warmup)
    _sync()
    t0 = time.perf_counter()
    dyn.run(steps)
    _sync()
    return (time.perf_counter() - t0) / steps


def make_plan(step_s: float, seconds_left: float, n_train: int, n_test: int, sample_every: int, budget: dict) -> dict:
    """Teacher MD steps per training and held-out trajectory that fit ``seconds_left`` at ``step_s`` per step.

    A trajectory gets at least two frames and at most ``budget['max_md_steps']`` steps; its length is a
    multiple of ``sample_every``.
    """
    calls = max(0.0, float(budget["safety"]) * seconds_left / step_s)
    share = float(budget["test_share"])
    cap = int(budget["max_md_steps"])

    def per_traj(total: float, n: int) -> int:
        steps = int(total / max(n, 1)) // sample_every * sample_every
        return int(min(max(steps, 2 * sample_every), cap // sample_every * sample_every))

    train_steps = per_traj(calls * (1 - share), n_train)
    test_steps = per_traj(calls * share, n_test)
    return {
        "teacher_step_s": step_s,
        "label_seconds_planned": seconds_left,
        "teacher_steps_planned": (train_steps * n_train + test_steps * n_test),
        "md_steps_train": train_steps,
        "md_steps_test": test_steps,
        "sample_every": sample_every,
        "train_trajectories": n_train,
        "test_trajectories": n_test,
        "expected_frames_train": n_train * (train_steps // sample_every),
        "expected_frames_test": n_test * (test_steps // sample_every),
    }


def write_summary_md(summary: dict, path: Path) -> None:
    """A short human-readable report of ``metrics.json``."""

    def get(*keys, fmt="{:.3g}"):
        d = summary
        for k in keys:
            if not isinstance(d, dict) or k not in d:
                return "—"
            d = d[k]
        if isinstance(d, dict) and "error" in d:
            return f"error: {d['error']}"
        return fmt.format(d) if isinstance(d, int | float) and not isinstance(d, bool) else str(d)

    t = summary.get("targets", {})
    lines = [
        f"# {summary['system']['atoms']}-atom water box distilled from {summary['teacher']}",
        "",
        f"{summary['device']} · torch {summary['torch']} · triton {summary.get('triton')} · "
        f"commit {summary.get('commit')} · {summary.get('date')}",
        "",
        f"Command: `{summary['command']}`",
        "",
        "| quantity | value | target |",
        "|---|---:|---:|",
        f"| held-out force MAE (meV/Å) | {get('test_fp32', 'force_mae_mev_a')} | ≤ {FORCE_MAE_TARGET:g}"
        f" ({'met' if t.get('force_mae', {}).get('met') else 'not met'}) |",
        f"| held-out force RMSE (meV/Å) | {get('test_fp32', 'force_rmse_mev_a')} | |",
        f"| held-out energy MAE (meV/atom) | {get('test_fp32', 'energy_mae_mev_atom')} | |",
        f"| teacher s / ASE MD step | {get('md_step_timing', 'teacher_s_per_step')} | |",
        f"| student s / ASE MD step | {get('md_step_timing', 'student_s_per_step')} | |",
        f"| speed-up (teacher / student) | {get('md_step_timing', 'speedup')} | ≥ {SPEEDUP_TARGET:g}"
        f" ({'met' if t.get('speedup', {}).get('met') else 'not met'}) |",
        f"| NVE drift (meV/atom/ps, fp64) | {get('nve', 'drift_mev_atom_per_ps')} | |",
        "",
        f"Data: {get('frames', 'train')} training + {get('frames', 'val')} validation frames from "
        f"{summary['plan']['train_trajectories']} Langevin trajectories of {summary['plan']['md_steps_train']} steps "
        f"(0.5 fs, T = {summary['sampling']['train_temperatures']} K), {get('frames', 'test')} held-out frames "
        f"from {summary['plan']['test_trajectories']} separate trajectory of {summary['plan']['md_steps_test']} steps "
        f"(T = {summary['sampling']['test_temperatures']} K, another box). Teacher MD step measured before "
        f"sampling: {get('plan', 'teacher_step_s')} s. Labelling took {get('label_seconds', fmt='{:.0f}')} s.",
        "",
        f"Training: {get('training', 'steps')} steps in {get('training', 'seconds', fmt='{:.0f}')} s "
        f"(stopped: {get('training', 'stopped')}); student {summary['student_config']}.",
        "",
        f"Whole run: {get('seconds_total', fmt='{:.0f}')} s of a {summary['deadline_s']:.0f} s deadline.",
        "",
    ]
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", default="runs/water_sevennet", help="labels and training run directory")
    ap.add_argument("--results", default=None, help="checkpoint, metrics, plots (default: <work>/results)")
    ap.add_argument("--teacher", default=None, help="teacher preset (default: the label config's, sevennet-0)")
    ap.add_argument("--device", default="auto", help="teacher and student device: auto, cuda or cpu")
    ap.add_argument("--deadline", type=float, default=None, help="whole-run wall clock, s (default 420; quick 60)")
    ap.add_argument("--time-limit", type=float, default=None, help="cap on the training wall clock, s")
    ap.add_argument("--label-config", default=str(ROOT / "configs/water_sevennet_label.yaml"))
    ap.add_argument("--train-config", default=str(ROOT / "configs/water_sevennet_train.yaml"))
    ap.add_argument("--quick", action="store_true", help="tiny CPU end-to-end check (24 atoms, seconds)")
    args = ap.parse_args(argv)

    from ase import io as ase_io

    from mlff_distiller.calculator import StudentCalculator
    from mlff_distiller.cli import TrainJob
    from mlff_distiller.distill import (
        SamplingConfig,
        error_metrics,
        get_teacher,
        label,
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

    t_start = time.perf_counter()
    deadline = args.deadline if args.deadline is not None else (60.0 if args.quick else 420.0)
    work = Path(args.work)
    results = Path(args.results) if args.results else work / "results"
    results.mkdir(parents=True, exist_ok=True)
    lcfg = load_yaml(args.label_config)
    train_job = from_dict(TrainJob, load_yaml(args.train_config))
    tcfg = train_job.train
    budget = dict(lcfg["budget"])
    teacher_preset = (args.teacher or lcfg.get("teacher", "sevennet-0")).strip().lower()
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    n_atoms = int(lcfg["system"]["atoms"])
    density = float(lcfg["system"].get("density", 1.0))
    train_spec, test_spec = dict(lcfg["train"]), dict(lcfg["test"])
    sampling_base = dict(lcfg.get("sampling", {}))
    timing_steps, nve_steps = 200, 2000
    if args.quick:
        n_atoms = 24
        train_spec["boxes"] = train_spec["boxes"][:1]
        test_spec["temperatures"] = test_spec["temperatures"][:1]
        sampling_base["sample_every"] = 4
        budget["max_md_steps"] = 16
        tcfg.model.hidden, tcfg.model.layers, tcfg.model.n_rbf = 32, 2, 8
        tcfg.batch_size, tcfg.val_batch_size, tcfg.eval_every, tcfg.warmup_steps = 2, 8, 10, 5
        timing_steps, nve_steps = 5, 50
    tcfg.device = device
    sample_every = int(sampling_base.get("sample_every", 10))

    summary: dict = {
        "teacher": teacher_preset,
        "teacher_device": "cpu" if teacher_preset == "emt" else device,
        "student_device": device,
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "quick": args.quick,
        "deadline_s": deadline,
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "commit": _git_commit(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "student_config": {k: getattr(tcfg.model, k) for k in ("species", "hidden", "layers", "n_rbf", "cutoff")},
        "targets": {},
    }
    try:
        import triton

        summary["triton"] = triton.__version__
    except ImportError:
        summary["triton"] = None
    try:
        import sevenn

        summary["sevenn"] = getattr(sevenn, "__version__", "installed")
    except ImportError:
        summary["sevenn"] = None

    def save_summary() -> None:
        summary["seconds_total"] = time.perf_counter() - t_start
        (results / "metrics.json").write_text(json.dumps(summary, indent=1, default=str))

    def elapsed() -> float:
        return time.perf_counter() - t_start

    # 1. The box and the teacher, and the teacher's MD step time on it.
    box = water_box(n_atoms, seed=0, density=density)
    summary["system"] = {
        "atoms": len(box),
        "molecules": len(box) // 3,
        "cell_A": float(box.cell.lengths()[0]),
        "density_g_cm3": density,
    }
    options = dict(lcfg.get("teacher_options") or {})
    if teacher_preset == "sevennet-0":
        options.setdefault("device", device)
    t = time.perf_counter()
    teacher = get_teacher(teacher_preset, **options)
    summary["teacher_load_s"] = time.perf_counter() - t
    step_s = teacher_md_step_seconds(box, teacher, warmup=2 if args.quick else 3, steps=3 if args.quick else 10)
    print(f"teacher {teacher_preset} on {summary['teacher_device']}: {1000 * step_s:.1f} ms per MD step", flush=True)

    # 2. Sampling sized to the labelling budget (a resumed run keeps its first plan, so its configs match).
    train_boxes = [water_box(n_atoms, seed=int(s), density=density) for s in train_spec["boxes"]]
    test_boxes = [water_box(n_atoms, seed=int(s), density=density) for s in test_spec["boxes"]]
    n_train = len(train_boxes) * len(train_spec["temperatures"])
    n_test = len(test_boxes) * len(test_spec["temperatures"])
    plan_path = work / "plan.json"
    identity = {"teacher": teacher_preset, "atoms": n_atoms, "quick": args.quick}
    if plan_path.exists() and all(json.loads(plan_path.read_text()).get(k) == v for k, v in identity.items()):
        plan = json.loads(plan_path.read_text())
        print(f"resuming with the plan in {plan_path}", flush=True)
    else:
        left = float(budget["label"]) * deadline - elapsed()
        plan = {**identity, **make_plan(step_s, left, n_train, n_test, sample_every, budget)}
        work.mkdir(parents=True, exist_ok=True)
        plan_path.write_text(json.dumps(plan, indent=1))
    summary["plan"] = {**plan, "teacher_step_s_measured_now": step_s}
    summary["sampling"] = {
        **sampling_base,
        "train_boxes": train_spec["boxes"],
        "train_temperatures": train_spec["temperatures"],
        "test_boxes": test_spec["boxes"],
        "test_temperatures": test_spec["temperatures"],
    }
    print(f"plan: {json.dumps(plan)}", flush=True)
    save_summary()

    t = time.perf_counter()
    for name, boxes, spec, steps in (
        ("train", train_boxes, train_spec, plan["md_steps_train"]),
        ("test", test_boxes, test_spec, plan["md_steps_test"]),
    ):
        cfg = from_dict(
            SamplingConfig,
            {
                **sampling_base,
                "temperatures": spec["temperatures"],
                "md_steps": steps,
                "replicas": 1,
                "rattle_per_seed": 0,
                "seed": int(spec.get("seed", 0)),
            },
        )
        report = label(boxes, teacher, work / f"{name}_labels", cfg, progress=False)
        summary[f"label_{name}"] = {
            "frames": report.total,
            "written": report.written,
            "tasks_run": report.tasks_run,
            "seconds": report.seconds,
        }
        print(f"labelled {name}: {report}", flush=True)
    summary["label_seconds"] = time.perf_counter() - t
    save_summary()

    frames = read_frames(work / "train_labels")
    test = read_frames(work / "test_labels")
    if not frames or not test:
        raise SystemExit(f"no frames labelled (train {len(frames)}, test {len(test)}): see the teacher's output")
    # The held-out trajectory also as one extxyz (for `mlff-distill evaluate --data`).
    ase_io.write(results / "test_frames.extxyz", test, format="extxyz")
    # Frame-level split: with a handful of trajectories a whole-trajectory split would take a quarter of the
    # data; validation only selects the checkpoint, the score is on the held-out trajectory.
    train_frames, val_frames = split_frames(frames, train_job.val_fraction, seed=train_job.split_seed, group_key="_")
    summary["frames"] = {"train": len(train_frames), "val": len(val_frames), "test": len(test)}

    # 3. Training gets what is left of its share.
    train_end = (float(budget["label"]) + float(budget["train"])) * deadline
    limit = train_end - elapsed()
    if args.time_limit is not None:
        limit = min(limit, args.time_limit)
    if args.quick:
        limit = min(limit, 8.0)
    tcfg.time_limit_s = max(limit, 5.0 if args.quick else 20.0)
    summary["train_time_limit_s"] = tcfg.time_limit_s
    save_summary()
    result = train(
        train_frames,
        val_frames,
        tcfg,
        work / "train",
        metadata={"teacher": teacher_preset, "data": f"{n_atoms}-atom water box, Langevin MD"},
    )
    summary["training"] = {
        "steps": result.steps,
        "seconds": result.seconds,
        "stopped": result.stopped,
        "best_val": result.best_val,
    }
    if result.history:  # empty when the time ran out before the first validation
        learning_curve_plot(result.history, results / "learning_curve.png")
    model = result.model.to(device="cpu", dtype=torch.float32).eval()
    meta = {
        "teacher": teacher_preset,
        "description": f"PaiNN student of {teacher_preset} on a {n_atoms}-atom water box at {density:g} g/cm³",
        "recipe": "python examples/distill_water_sevennet.py --deadline 420",
        "val": result.best_val,
        "train_frames": len(train_frames),
        "train_seconds": result.seconds,
        "train_device": summary["device"],
    }
    ckpt = results / "water-sevennet.pt"
    model.save(ckpt, metadata=meta)  # before evaluation, so a failure there cannot lose the student
    summary["checkpoint_bytes"] = ckpt.stat().st_size
    save_summary()

    # 4. Evaluation: each phase records its own failure and the run goes on.
    def phase(name, fn) -> None:
        t = time.perf_counter()
        try:
            summary[name] = fn()
        except Exception as exc:
            summary[name] = {"error": f"{type(exc).__name__}: {exc}"}
        if isinstance(summary[name], dict):
            summary[name]["phase_seconds"] = time.perf_counter() - t
        print(f"{name}: {summary[name]}", flush=True)
        save_summary()

    def test_errors() -> dict:
        m = error_metrics(test, predict_frames(model, test, device=device, precision="fp32"))
        parity_plot(m, results / "parity.png", title=f"student vs {teacher_preset}, held-out water trajectory")
        return {k: v for k, v in m.items() if not k.startswith("_")}

    # A liquid configuration (the last held-out frame) rather than the starting lattice.
    liquid = test[-1].copy()
    liquid.calc = None

    def timing() -> dict:
        left = deadline - elapsed()
        # The teacher's steps dominate: give them at most a third of what is left.
        steps = int(min(timing_steps, max(5, left / 3 / max(step_s, 1e-6))))
        student = StudentCalculator(model, device=device)
        out = md_step_timing(liquid, student, teacher, steps=steps, warmup=5)
        return {**out, "student_device": device, "teacher_device": summary["teacher_device"], "mode": "default"}

    def nve() -> dict:
        left = deadline - elapsed()
        if left < 15 and not args.quick:
            return {"skipped": f"{left:.0f} s left of the deadline"}
        return nve_drift(liquid, model, steps=nve_steps, device=device)

    phase("test_fp32", test_errors)
    phase("md_step_timing", timing)
    phase("nve", nve)

    mae = summary["test_fp32"].get("force_mae_mev_a")
    speedup = summary["md_step_timing"].get("speedup")
    summary["targets"] = {
        "force_mae": {
            "target_mev_a": FORCE_MAE_TARGET,
            "measured": mae,
            "met": mae is not None and mae <= FORCE_MAE_TARGET,
        },
        "speedup": {
            "target": SPEEDUP_TARGET,
            "measured": speedup,
            "met": speedup is not None and speedup >= SPEEDUP_TARGET,
        },
    }
    if mae is not None:
        meta.update(
            test_force_mae_mev_a=mae,
            test_force_rmse_mev_a=summary["test_fp32"]["force_rmse_mev_a"],
            test_energy_mae_mev_atom=summary["test_fp32"]["energy_mae_mev_atom"],
            test_frames=summary["test_fp32"]["frames"],
        )
        model.save(ckpt, metadata=meta)
    save_summary()
    write_summary_md(summary, results / "summary.md")
    print((results / "summary.md").read_text(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
