"""Distil SevenNet-0 into a PaiNN student on a 192-atom periodic water box (the issue-6 water target).

    python examples/distill_water_sevennet.py --deadline 420          # one H100, ~7 minutes in all

Target: force MAE ≤ 20 meV/Å on held-out frames, and ≥ 100× faster than the teacher per ASE MD step on the
same box and GPU. The whole run is time-boxed by ``--deadline`` (seconds):

1. builds the boxes (``benchmarks/systems.py`` ``water_box``, 1 g/cm³): the 192-atom target box and larger
   training boxes of the same liquid (648 atoms by default: on an H100 the teacher's step is host-bound and
   costs about the same, so each teacher second yields 3.4x the labels); loads the teacher (on the GPU when
   there is one) and measures its Langevin MD step on both;
2. sizes the sampling from those measurements so labelling takes its share of the deadline (default 40 %),
   then labels Langevin trajectories (one per box and temperature, ``configs/water_sevennet_label.yaml``)
   and separate held-out trajectories of the 192-atom box, to disk and resumably (the plan is kept in
   ``<work>/plan.json``); the teacher runs in this one process (one GPU: no parallel workers);
3. trains a student (``configs/water_sevennet_train.yaml``) until the training share of the deadline ends;
4. evaluates on the held-out frames (energy/force MAE and RMSE, parity plot, learning curve), times one ASE
   velocity-Verlet step of the student (``StudentCalculator``, default mode) against the teacher on the same
   192-atom box and device in this run, and runs a short NVE check with the student in float64;
5. writes ``<results>/water-sevennet.pt``, ``metrics.json``, ``summary.md`` (both rewritten after every
   phase), ``parity.png``, ``learning_curve.png`` and ``test_frames.extxyz``.

``--stress`` distils an NPT student: after the MD labels, strained rattles of training frames (a random
symmetric cell strain, ``stress.strain`` of the label config) are labelled with the teacher's stress, the student
trains with ``stress_weight``, and the evaluation adds the held-out stress and pressure errors, the pressure
against density of teacher and student on the same scaled frames (``pressure_curve``: zero-pressure density and
bulk modulus) and Berendsen NPT runs of both from the same start (``npt_run``), with their step times.

``--quick`` is a CPU smoke test (24- and 48-atom boxes, a few frames, seconds of training); ``--teacher emt``
swaps in ASE's EMT so it runs without ``sevenn`` (the numbers are then meaningless, the pipeline the same).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from harness import git_commit  # noqa: E402  (benchmarks/harness.py: commit, -dirty when changed)
from systems import water_box  # noqa: E402  (benchmarks/systems.py: the same boxes the benchmarks time)

FORCE_MAE_TARGET = 20.0  # meV/Å
SPEEDUP_TARGET = 100.0  # teacher / student seconds per ASE MD step


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def teacher_md_step_seconds(box, teacher, *, warmup: int, steps: int, temperature: float = 350.0) -> float:
    """Wall-clock seconds per Langevin step of the teacher on a copy of ``box`` (what labelling pays)."""
    from ase import units
    from ase.md.langevin import Langevin

    from mlff_distiller.ase_compat import maxwell_boltzmann

    work = box.copy()
    work.calc = teacher
    rng = np.random.default_rng(0)
    maxwell_boltzmann(work, temperature, rng=rng)
    dyn = Langevin(work, timestep=0.5 * units.fs, temperature_K=temperature, friction=0.01 / units.fs, rng=rng)
    dyn.run(warmup)
    _sync()
    t0 = time.perf_counter()
    dyn.run(steps)
    _sync()
    return (time.perf_counter() - t0) / steps


def make_plan(
    train_step_s: float,
    test_step_s: float,
    seconds_left: float,
    n_train: int,
    n_test: int,
    sample_every: int,
    budget: dict,
) -> dict:
    """Teacher MD steps per training and held-out trajectory that fit ``seconds_left``.

    ``train_step_s``/``test_step_s``: measured seconds per teacher MD step on the training and the held-out
    box. ``budget['safety']`` of the time is planned, ``budget['test_share']`` of it for the held-out
    trajectories. A trajectory gets at least two frames and at most ``budget['max_md_steps']`` steps; its
    length is a multiple of ``sample_every``.
    """
    seconds = max(0.0, float(budget["safety"]) * seconds_left)
    share = float(budget["test_share"])
    cap = int(budget["max_md_steps"])

    def per_traj(secs: float, step_s: float, n: int) -> int:
        steps = int(secs / step_s / max(n, 1)) // sample_every * sample_every
        return int(min(max(steps, 2 * sample_every), cap // sample_every * sample_every))

    train_steps = per_traj(seconds * (1 - share), train_step_s, n_train)
    test_steps = per_traj(seconds * share, test_step_s, n_test)
    return {
        "teacher_step_s_train_box": train_step_s,
        "teacher_step_s_test_box": test_step_s,
        "label_seconds_planned": seconds_left,
        "label_seconds_expected": train_steps * n_train * train_step_s + test_steps * n_test * test_step_s,
        "md_steps_train": train_steps,
        "md_steps_test": test_steps,
        "sample_every": sample_every,
        "train_trajectories": n_train,
        "test_trajectories": n_test,
        "expected_frames_train": n_train * (train_steps // sample_every),
        "expected_frames_test": n_test * (test_steps // sample_every),
    }


def write_summary_md(summary: dict, path: Path) -> None:
    """A short human-readable report of ``metrics.json`` (written after every phase, so it may be partial)."""

    def get(*keys, fmt="{:.3g}"):
        d = summary
        for k in keys:
            if not isinstance(d, dict) or k not in d:
                return "—"
            d = d[k]
        if isinstance(d, dict) and "error" in d:
            return f"error: {d['error']}"
        return fmt.format(d) if isinstance(d, int | float) and not isinstance(d, bool) else str(d)

    def met(key: str) -> str:
        m = summary.get("targets", {}).get(key, {}).get("met")
        return "" if m is None else (" (met)" if m else " (not met)")

    lines = [
        f"# {get('system', 'atoms')}-atom water box distilled from {summary['teacher']}",
        "",
        f"{summary['device']} · torch {summary['torch']} · triton {summary.get('triton')} · "
        f"sevenn {summary.get('sevenn')} · commit {summary.get('commit')} · {summary.get('date')}",
        "",
        f"Command: `{summary['command']}`",
        "",
        "| quantity | value | target |",
        "|---|---:|---:|",
        f"| held-out force MAE (meV/Å) | {get('test_fp32', 'force_mae_mev_a')} | ≤ {FORCE_MAE_TARGET:g}"
        f"{met('force_mae')} |",
        f"| held-out force RMSE (meV/Å) | {get('test_fp32', 'force_rmse_mev_a')} | |",
        f"| held-out energy MAE (meV/atom) | {get('test_fp32', 'energy_mae_mev_atom')} | |",
        f"| teacher s / ASE MD step ({get('md_step_timing', 'atoms')} atoms) | "
        f"{get('md_step_timing', 'teacher_s_per_step')} | |",
        f"| student s / ASE MD step (StudentCalculator, default mode) | "
        f"{get('md_step_timing', 'student_s_per_step')} | |",
        f"| speed-up (teacher / student) | {get('md_step_timing', 'speedup')} | ≥ {SPEEDUP_TARGET:g}{met('speedup')} |",
        f"| NVE drift, student fp64 (meV/atom/ps) | {get('nve', 'drift_mev_atom_per_ps')} | |",
    ]
    if summary.get("stress_mode"):
        lines += [
            f"| held-out stress MAE (meV/Å³; GPa) | {get('test_fp32', 'stress_mae_mev_a3')}; "
            f"{get('test_fp32', 'stress_mae_gpa')} | |",
            f"| held-out pressure MAE (GPa) | {get('test_fp32', 'pressure_mae_gpa')} | |",
            f"| zero-pressure density, teacher / student (g/cm³) | "
            f"{get('eos', 'teacher', 'zero_pressure_density_g_cm3', fmt='{:.4f}')} / "
            f"{get('eos', 'student', 'zero_pressure_density_g_cm3', fmt='{:.4f}')} | |",
            f"| bulk modulus, teacher / student (GPa) | {get('eos', 'teacher', 'bulk_modulus_gpa')} / "
            f"{get('eos', 'student', 'bulk_modulus_gpa')} | |",
            f"| rigid molecules: zero-pressure density, teacher / student (g/cm³) | "
            f"{get('eos_rigid', 'teacher', 'zero_pressure_density_g_cm3', fmt='{:.4f}')} / "
            f"{get('eos_rigid', 'student', 'zero_pressure_density_g_cm3', fmt='{:.4f}')} | |",
            f"| rigid molecules: bulk modulus, teacher / student (GPa) | "
            f"{get('eos_rigid', 'teacher', 'bulk_modulus_gpa')} / "
            f"{get('eos_rigid', 'student', 'bulk_modulus_gpa')} | |",
            f"| NPT ({get('npt', 'teacher', 'steps')} steps) mean density of the second half, teacher / student "
            f"(g/cm³) | {get('npt', 'teacher', 'mean_density_second_half', fmt='{:.4f}')} / "
            f"{get('npt', 'student_same_steps', 'mean_density_second_half', fmt='{:.4f}')} | |",
            f"| NPT s / step, teacher / student; speed-up | {get('npt', 'teacher', 's_per_step')} / "
            f"{get('npt', 'student_same_steps', 's_per_step')}; {get('npt', 'npt_speedup')} | |",
            f"| student NPT, {get('npt', 'student', 'steps')} steps: final density (g/cm³) | "
            f"{get('npt', 'student', 'final_density', fmt='{:.4f}')} | |",
        ]
    lines += [
        "",
        f"Data: {get('frames', 'train')} training + {get('frames', 'val')} validation frames "
        f"({get('sampling', 'train_atoms')}-atom boxes {get('sampling', 'train_boxes')}, "
        f"T = {get('sampling', 'train_temperatures')} K, {get('plan', 'md_steps_train')} Langevin steps of "
        f"{get('sampling', 'timestep_fs')} fs each, a frame every {get('plan', 'sample_every')} steps); "
        f"{get('frames', 'test')} held-out frames from separate trajectories ({get('system', 'atoms')}-atom boxes "
        f"{get('sampling', 'test_boxes')}, T = {get('sampling', 'test_temperatures')} K, "
        f"{get('plan', 'md_steps_test')} steps, another noise seed). Teacher MD step measured before sampling: "
        f"{get('plan', 'teacher_step_s_train_box')} s (training box), {get('plan', 'teacher_step_s_test_box')} s "
        f"(held-out box). Labelling took {get('label_seconds', fmt='{:.0f}')} s.",
        "",
        f"Training: {get('training', 'steps')} steps in {get('training', 'seconds', fmt='{:.0f}')} s "
        f"(stopped: {get('training', 'stopped')}; limit {get('train_time_limit_s', fmt='{:.0f}')} s; "
        f"{get('training', 'train_step')} step, {get('training', 'steady_step_seconds')} s/step steady); "
        f"student {summary['student_config']}.",
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
    ap.add_argument("--quick", action="store_true", help="tiny CPU end-to-end check (24/48-atom boxes, seconds)")
    ap.add_argument("--stress", action="store_true", help="an NPT student: strained frames, stress_weight, NPT checks")
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
        npt_run,
        nve_drift,
        parity_plot,
        predict_frames,
        pressure_curve,
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
    stress_cfg = dict(lcfg.get("stress") or {}) if args.stress else {}
    budget.update(stress_cfg.get("budget") or {})
    if args.stress:
        tcfg.stress_weight = float(stress_cfg.get("stress_weight", 20.0))
    teacher_preset = (args.teacher or lcfg.get("teacher", "sevennet-0")).strip().lower()
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    density = float(lcfg["system"].get("density", 1.0))
    n_atoms = int(lcfg["system"]["atoms"])  # the target system: held-out frames and MD timing
    train_spec, test_spec = dict(lcfg["train"]), dict(lcfg["test"])
    n_train_atoms = int(train_spec.get("atoms", n_atoms))
    sampling_base = dict(lcfg.get("sampling", {}))
    timing_steps, nve_steps = 200, 2000
    if args.quick:
        n_atoms, n_train_atoms = 24, 48
        train_spec["boxes"] = train_spec["boxes"][:1]
        test_spec["temperatures"] = test_spec["temperatures"][:1]
        sampling_base["sample_every"] = 4
        budget["max_md_steps"] = 16
        tcfg.model.hidden, tcfg.model.layers, tcfg.model.n_rbf = 32, 2, 8
        tcfg.batch_size, tcfg.val_batch_size, tcfg.eval_every, tcfg.warmup_steps = 2, 8, 2, 5
        timing_steps, nve_steps = 5, 50
    tcfg.device = device
    sample_every = int(sampling_base.get("sample_every", 10))

    summary: dict = {
        "teacher": teacher_preset,
        "teacher_device": "cpu" if teacher_preset == "emt" else device,
        "student_device": device,
        "command": " ".join(["python examples/distill_water_sevennet.py", *(sys.argv[1:] if argv is None else argv)]),
        "quick": args.quick,
        "deadline_s": deadline,
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "commit": git_commit(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "student_config": {k: getattr(tcfg.model, k) for k in ("species", "hidden", "layers", "n_rbf", "cutoff")},
        "train_config": {
            k: getattr(tcfg, k) for k in ("batch_size", "lr", "force_weight", "stress_weight", "ema_decay")
        },
        "stress_mode": stress_cfg or None,
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

    def elapsed() -> float:
        return time.perf_counter() - t_start

    def save_summary() -> None:
        summary["seconds_total"] = elapsed()
        (results / "metrics.json").write_text(json.dumps(summary, indent=1, default=str))
        write_summary_md(summary, results / "summary.md")

    # 1. The boxes and the teacher, and the teacher's MD step time on them.
    box = water_box(n_atoms, seed=0, density=density)
    summary["system"] = {
        "atoms": len(box),
        "molecules": len(box) // 3,
        "cell_A": float(box.cell.lengths()[0]),
        "density_g_cm3": density,
    }
    train_boxes = [water_box(n_train_atoms, seed=int(s), density=density) for s in train_spec["boxes"]]
    test_boxes = [water_box(n_atoms, seed=int(s), density=density) for s in test_spec["boxes"]]
    options = dict(lcfg.get("teacher_options") or {})
    if teacher_preset == "sevennet-0":
        options.setdefault("device", device)
    t = time.perf_counter()
    teacher = get_teacher(teacher_preset, **options)
    summary["teacher_load_s"] = time.perf_counter() - t
    warm, timed = (2, 3) if args.quick else (3, 10)
    test_step_s = teacher_md_step_seconds(box, teacher, warmup=warm, steps=timed)
    train_step_s = (
        test_step_s
        if n_train_atoms == n_atoms
        else teacher_md_step_seconds(train_boxes[0], teacher, warmup=warm, steps=timed)
    )
    print(
        f"teacher {teacher_preset} on {summary['teacher_device']}: {1000 * test_step_s:.1f} ms per MD step "
        f"({n_atoms} atoms), {1000 * train_step_s:.1f} ms ({n_train_atoms} atoms)",
        flush=True,
    )

    # 2. Sampling sized to the labelling budget (a resumed run keeps its first plan, so its configs match).
    n_train = len(train_boxes) * len(train_spec["temperatures"])
    n_test = len(test_boxes) * len(test_spec["temperatures"])
    plan_path = work / "plan.json"
    identity = {"teacher": teacher_preset, "atoms": n_atoms, "train_atoms": n_train_atoms, "quick": args.quick}
    if plan_path.exists() and all(json.loads(plan_path.read_text()).get(k) == v for k, v in identity.items()):
        plan = json.loads(plan_path.read_text())
        print(f"resuming with the plan in {plan_path}", flush=True)
    else:
        left = float(budget["label"]) * deadline - elapsed()
        plan = {**identity, **make_plan(train_step_s, test_step_s, left, n_train, n_test, sample_every, budget)}
        work.mkdir(parents=True, exist_ok=True)
        plan_path.write_text(json.dumps(plan, indent=1))
    summary["plan"] = {**plan, "teacher_step_s_measured_now": [train_step_s, test_step_s]}
    summary["sampling"] = {
        **sampling_base,
        "train_atoms": n_train_atoms,
        "train_boxes": train_spec["boxes"],
        "train_temperatures": train_spec["temperatures"],
        "test_atoms": n_atoms,
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
        save_summary()
    if args.stress:
        # Strained rattles of training frames: the liquid at other densities, each with the teacher's stress.
        md_frames = read_frames(work / "train_labels")
        seconds = float(budget.get("safety", 0.85)) * float(budget.get("strain", 0.06)) * deadline
        n_seeds = int(max(2, min(len(md_frames), seconds / max(train_step_s, 1e-6))))
        picks = np.linspace(0, len(md_frames) - 1, n_seeds).round().astype(int)
        seeds = []
        for k in picks:
            seed_atoms = md_frames[int(k)].copy()
            seed_atoms.calc = None
            seeds.append(seed_atoms)
        cfg = from_dict(
            SamplingConfig,
            {
                "temperatures": [float(train_spec["temperatures"][0])],
                "md_steps": 0,
                "rattle_per_seed": 1,
                "rattle_std": float(stress_cfg.get("rattle_std", 0.02)),
                "rattle_strain": float(stress_cfg.get("strain", 0.02)),
                "max_force": float(sampling_base.get("max_force", 50.0)),
                "seed": 7,
            },
        )
        report = label(seeds, teacher, work / "strain_labels", cfg, progress=False)
        summary["label_strain"] = {"seeds": n_seeds, "frames": report.total, "seconds": report.seconds}
        print(f"labelled strained frames: {report}", flush=True)
    summary["label_seconds"] = time.perf_counter() - t

    frames = read_frames(work / "train_labels")
    if args.stress:
        strained = read_frames(work / "strain_labels")
        frames = frames + strained
        summary["stress_labels"] = {
            "frames_with_stress": sum("stress" in (a.calc.results if a.calc else {}) for a in frames),
            "frames": len(frames),
            "strained_frames": len(strained),
        }
    test = read_frames(work / "test_labels")
    if not frames or not test:
        raise SystemExit(f"no frames labelled (train {len(frames)}, test {len(test)}): see the teacher's output")
    # The held-out frames also as one extxyz (for `mlff-distill evaluate --data`).
    ase_io.write(results / "test_frames.extxyz", test, format="extxyz")
    # Frame-level split: with a handful of trajectories a whole-trajectory split would take a quarter of the
    # data; validation only selects the checkpoint, the score is on the held-out trajectories.
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
        metadata={"teacher": teacher_preset, "data": f"{n_train_atoms}-atom water boxes, Langevin MD"},
    )
    summary["training"] = {
        "steps": result.steps,
        "seconds": result.seconds,
        "stopped": result.stopped,
        "best_val": result.best_val,
        # Step implementation and steady step time (TrainResult fields of the padded/CUDA-graph training).
        **{k: getattr(result, k) for k in ("train_step", "captures", "steady_step_seconds") if hasattr(result, k)},
    }
    if result.history:  # empty when the time ran out before the first validation
        learning_curve_plot(result.history, results / "learning_curve.png")
    model = result.model.to(device="cpu", dtype=torch.float32).eval()
    meta = {
        "teacher": teacher_preset,
        "description": f"PaiNN student of {teacher_preset} for liquid water at {density:g} g/cm³ "
        f"(trained on {n_train_atoms}-atom boxes, tested on {n_atoms}-atom boxes)",
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
        summary[name]["phase_seconds"] = time.perf_counter() - t
        print(f"{name}: {summary[name]}", flush=True)
        save_summary()

    def test_errors() -> dict:
        m = error_metrics(test, predict_frames(model, test, device=device, precision="fp32"))
        parity_plot(m, results / "parity.png", title=f"student vs {teacher_preset}, held-out water trajectories")
        return {k: v for k, v in m.items() if not k.startswith("_")}

    # A liquid configuration of the target box (the last held-out frame) rather than the starting lattice.
    liquid = test[-1].copy()
    liquid.calc = None

    def timing() -> dict:
        left = deadline - elapsed()
        # The teacher's steps dominate: give them at most a third of what is left.
        steps = int(min(timing_steps, max(5, left / 3 / max(test_step_s, 1e-6))))
        student = StudentCalculator(model, device=device)
        out = md_step_timing(liquid, student, teacher, steps=steps, warmup=5)
        return {**out, "student_device": device, "teacher_device": summary["teacher_device"], "mode": "default"}

    def nve() -> dict:
        left = deadline - elapsed()
        if left < 15 and not args.quick:
            return {"skipped": f"{left:.0f} s left of the deadline"}
        steps = nve_steps
        fp32_step = summary["md_step_timing"].get("student_s_per_step")
        if fp32_step and not args.quick:
            # fp64 steps: assume 3x the measured fp32 step, and leave 10 s for start-up.
            steps = int(min(nve_steps, max(100, (left - 10) / (3 * fp32_step))))
        return nve_drift(liquid, model, steps=steps, device=device)

    phase("test_fp32", test_errors)
    mae = summary["test_fp32"].get("force_mae_mev_a")
    summary["targets"] = {
        "force_mae": {
            "target_mev_a": FORCE_MAE_TARGET,
            "measured": mae,
            "met": None if mae is None else mae <= FORCE_MAE_TARGET,
        }
    }
    if mae is not None:
        meta.update(
            test_force_mae_mev_a=mae,
            test_force_rmse_mev_a=summary["test_fp32"]["force_rmse_mev_a"],
            test_energy_mae_mev_atom=summary["test_fp32"]["energy_mae_mev_atom"],
            test_frames=summary["test_fp32"]["frames"],
        )
        model.save(ckpt, metadata=meta)
    phase("md_step_timing", timing)
    speedup = summary["md_step_timing"].get("speedup")
    summary["targets"]["speedup"] = {
        "target": SPEEDUP_TARGET,
        "measured": speedup,
        "met": None if speedup is None else speedup >= SPEEDUP_TARGET,
    }
    if speedup is not None:
        meta.update(md_step_speedup_vs_teacher=speedup, md_step_atoms=summary["md_step_timing"]["atoms"])
        model.save(ckpt, metadata=meta)
    if args.stress:
        student_calc = StudentCalculator(model, device=device)
        npt_kw = {k: float(v) for k, v in (stress_cfg.get("npt") or {}).items() if k != "student_steps"}
        ratios = stress_cfg.get("volume_ratios", [0.92, 0.96, 1.0, 1.04, 1.08])
        npt_steps = 20 if args.quick else int((stress_cfg.get("npt") or {}).get("student_steps", 2000))

        def eos() -> dict:
            picked = test[-min(len(test), 4) :]
            return pressure_curve(picked, {"teacher": teacher, "student": student_calc}, volume_ratios=ratios)

        def npt() -> dict:
            out = {"student": npt_run(liquid, student_calc, steps=npt_steps, **npt_kw)}
            left = deadline - elapsed() - 10
            per_step = 2.5 * float(summary["md_step_timing"].get("teacher_s_per_step") or 0.1)
            steps = int(min(out["student"]["steps"], left / per_step)) // 10 * 10
            if args.quick:  # the smoke run exercises every phase however slow the machine (20 cheap steps)
                steps = max(steps, 20)
            if steps >= 20:
                out["teacher"] = npt_run(liquid, teacher, steps=steps, **npt_kw)
                # The student over the teacher's steps, for the same window (same start and velocities).
                same = npt_run(liquid, student_calc, steps=steps, **npt_kw)
                out["student_same_steps"] = same
                out["density_difference_second_half"] = (
                    same["mean_density_second_half"] - out["teacher"]["mean_density_second_half"]
                )
                out["npt_speedup"] = out["teacher"]["s_per_step"] / same["s_per_step"]
            else:
                out["teacher"] = {"skipped": f"{left:.0f} s left of the deadline"}
            return out

        def eos_rigid() -> dict:
            picked = test[-min(len(test), 4) :]
            calcs = {"teacher": teacher, "student": student_calc}
            return pressure_curve(picked, calcs, volume_ratios=ratios, molecules=True)

        phase("eos", eos)
        phase("eos_rigid", eos_rigid)
        phase("npt", npt)
    phase("nve", nve)
    print((results / "summary.md").read_text(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
