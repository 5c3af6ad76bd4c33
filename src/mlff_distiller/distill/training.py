"""Force-matching training of a student on teacher labels: the settings (:class:`TrainConfig`), the run
(:func:`train`) and its result (:class:`TrainResult`).

Before training, per-species reference energies are fitted by least squares (``model.set_energy_reference``:
shift μ_z, scale = RMS teacher force component), then AdamW with linear warm-up and cosine decay (or
reduce-on-plateau), gradient clipping, and an exponential moving average (EMA) of the weights, which is what
is validated, checkpointed and returned. Training stops early after ``patience`` validations without a better
validation force MAE; the last step of a run (its ``max_steps``, its last epoch or its wall-clock limit) is
validated too, whatever ``eval_every`` says.
``out_dir/train_state.pt`` (written atomically) lets a killed run resume.

The pieces, one job a module:

* :mod:`mlff_distiller.distill.objective`: the student's forward with the parameters' graph kept, the loss
  (energies, forces and the optional Hessian-vector term, weighted per frame by ``info["config_weight"]``; its
  formula is there) and :func:`evaluate_dataset` (unweighted: validation and early stopping ignore the weights).
* :mod:`mlff_distiller.distill.optim`: AdamW and its saved state, the learning-rate schedule, the EMA.
* :mod:`mlff_distiller.distill.train_steps`: the implementations of one optimiser step
  (``TrainConfig.train_step``), with the same math: ``plain`` (the batch as it comes), ``static`` (every batch
  padded to a capacity of a geometric ladder, no host sync) and ``cudagraph`` (the static step captured per
  capacity as a CUDA graph). ``auto`` (the default) is ``cudagraph`` on CUDA and ``plain`` elsewhere.
* :mod:`mlff_distiller.distill.static_batch`: the host side of the padded static step (the gather indices).

A non-finite loss raises ``FloatingPointError``: at once in ``plain``, at the next validation otherwise.
``TrainConfig.kernels`` picks the kernel backend (``triton`` or the ``torch`` reference) for the whole run.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from mlff_distiller import kernels
from mlff_distiller.distill.dataset import FrameDataset, fit_energy_reference
from mlff_distiller.distill.objective import (
    _weighted_mean,
    energy_reference_correction,
    evaluate_dataset,
    student_forward,
)
from mlff_distiller.distill.optim import _EMA, _load_optimizer, _lr_factor, _optimizer, _optimizer_state, _plateau
from mlff_distiller.distill.train_steps import _PlainStep, _StaticStep
from mlff_distiller.domain import DomainEnvelope
from mlff_distiller.model import ModelConfig, StudentModel

__all__ = ["TrainConfig", "TrainResult", "evaluate_dataset", "student_forward", "train"]

_DTYPES = {"float32": torch.float32, "float64": torch.float64}
TRAIN_STEPS = ("auto", "plain", "static", "cudagraph")


@dataclass(kw_only=True)
class TrainConfig:
    """Training settings (all optional).

    Attributes:
        model: :class:`ModelConfig` of a new student (species default to those of the data).
        batch_size: frames per batch.
        lr: peak AdamW learning rate. weight_decay: AdamW weight decay.
        epochs: passes over the training set (upper bound; ``max_steps``/``time_limit_s`` may stop earlier).
        max_steps: optimiser steps (0 = no limit). time_limit_s: wall-clock limit, s (0 = none).
        energy_weight, force_weight, hvp_weight, stress_weight: loss weights (see
            :mod:`mlff_distiller.distill.objective`). ``stress_weight > 0`` needs periodic frames with a teacher
            stress; every step implementation fits it.
        hvp_eps: finite-difference step of the student's H·v, Å (use the labels' step).
        loss: ``"mse"`` (squares of the energy-per-atom and force residuals) or ``"huber"`` (squares up to
            ``huber_delta``, eV/atom and eV/Å, linear beyond: :func:`~mlff_distiller.distill.objective.residual_loss`),
            for fine-tuning rounds whose new frames lie far from the student (``mlff-distill harvest``).
        weight_norm: how the frames' loss weights (``config_weight``, ``--data-weight``) normalise each mean of a
            batch: ``"sum"`` divides by the weights' sum (a weight acts relative to its batch), ``"count"`` by the
            number of frames or atoms, as MACE does (a weight scales its frames' share absolutely; weights below 1
            then also shrink the step). Both are the plain means when every weight is 1.
        scheduler: ``"cosine"`` (linear warm-up, cosine to ``min_lr_ratio``·lr over the steps, or over
            ``time_limit_s`` when that ends first), ``"plateau"`` or ``"none"``.
        warmup_steps: warm-up length. plateau_factor, plateau_patience: reduce-on-plateau settings.
        ema_decay: EMA decay per step (0 disables EMA).
        grad_clip: max global gradient norm (0 disables).
        eval_every: steps between validations (0 = once per epoch).
        patience: validations without improvement before stopping (0 disables early stopping).
        min_delta: a validation force MAE must beat the best by more than this (meV/Å) to count as better.
        val_batch_size: frames per validation batch.
        device: ``"cuda"``, ``"cpu"`` or ``"auto"``. dtype: ``"float32"`` or ``"float64"``.
        seed: random seed (weights init and shuffling).
        train_step: ``"auto"``, ``"plain"``, ``"static"`` or ``"cudagraph"`` (see
            :mod:`mlff_distiller.distill.train_steps`; ``auto`` is ``cudagraph`` on CUDA, ``plain`` elsewhere).
        kernels: kernel backend for the run (``"auto"``, ``"triton"``, ``"torch"``; None keeps the process
            setting, i.e. ``MLFF_DISTILLER_KERNELS``).
        bucket_growth: ratio between neighbouring padded capacities of the static steps (> 1).
        refit_energy_reference: when training starts from an existing student (fine-tuning: ``train(model=...)``,
            the CLI's ``init_model``), first add to its per-species energy shift the least-squares correction to
            the training energies (:func:`~mlff_distiller.distill.objective.energy_reference_correction`): for
            labels from a teacher with another energy zero. False keeps the student's reference as it is.
        repulsion: put a ZBL pair repulsion under the student below the training data's shortest pairs
            (:meth:`~mlff_distiller.domain.DomainEnvelope.repulsion_radii`: 0.9 times the shortest pair of each two
            elements, where the envelope check calls a structure outside; :mod:`mlff_distiller.kernels.repulsion`).
            It is exactly zero on every training frame and keeps a relaxation or a hot trajectory from pulling
            atoms into one another where the student has seen no data. False: no repulsion (also removes one a
            fine-tuned student had).
        tf32_grid: round the trained student's ``nn.Linear`` weights to the nearest TF32 values
            (:meth:`~mlff_distiller.model.StudentModel.round_weights_tf32`; float32 training only), validate it
            again and write it as ``best.pt``: in fp32 on a GPU each product with such a weight then takes two TF32
            MMAs instead of three, at the same float32 accuracy (1.07-1.12x a whole step). The rounding moves the
            predictions by ~0.1-0.3 meV/Å (the shipped students), far below a student's error; the validation of
            the rounded student is logged and stored (``val_tf32_grid`` in the checkpoint's metadata, and
            ``TrainResult.val_tf32_grid``). False: the weights as trained.
    """

    model: ModelConfig = field(default_factory=lambda: ModelConfig(hidden=64, layers=3, n_rbf=16, cutoff=5.0))
    batch_size: int = 16
    lr: float = 1e-3
    weight_decay: float = 0.0
    epochs: int = 100
    max_steps: int = 0
    time_limit_s: float = 0.0
    energy_weight: float = 1.0
    force_weight: float = 10.0
    hvp_weight: float = 0.0
    stress_weight: float = 0.0
    hvp_eps: float = 0.005
    loss: str = "mse"
    huber_delta: float = 0.5
    weight_norm: str = "sum"
    scheduler: str = "cosine"
    warmup_steps: int = 100
    min_lr_ratio: float = 0.01
    plateau_factor: float = 0.5
    plateau_patience: int = 5
    ema_decay: float = 0.99
    grad_clip: float = 10.0
    eval_every: int = 0
    patience: int = 20
    min_delta: float = 0.0
    val_batch_size: int = 64
    device: str = "auto"
    dtype: str = "float32"
    seed: int = 0
    train_step: str = "auto"
    kernels: str | None = None
    bucket_growth: float = 1.25
    refit_energy_reference: bool = False
    repulsion: bool = True
    tf32_grid: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.model, dict):
            self.model = ModelConfig(**self.model)
        for name in ("batch_size", "epochs", "val_batch_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_steps", "warmup_steps", "eval_every", "patience", "plateau_patience"):
            if int(getattr(self, name)) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        for name in (
            "min_delta",
            "weight_decay",
            "energy_weight",
            "force_weight",
            "hvp_weight",
            "stress_weight",
            "grad_clip",
            "time_limit_s",
        ):
            if float(getattr(self, name)) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.energy_weight == 0 and self.force_weight == 0 and self.hvp_weight == 0 and self.stress_weight == 0:
            raise ValueError("at least one of energy_weight, force_weight, hvp_weight, stress_weight must be > 0")
        if not 0 <= self.ema_decay < 1:
            raise ValueError(f"ema_decay must be in [0, 1), got {self.ema_decay}")
        if self.scheduler not in ("cosine", "plateau", "none"):
            raise ValueError(f"scheduler must be 'cosine', 'plateau' or 'none', got {self.scheduler!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if not self.hvp_eps > 0:
            raise ValueError(f"hvp_eps must be > 0 Å, got {self.hvp_eps}")
        if self.loss not in ("mse", "huber"):
            raise ValueError(f"loss must be 'mse' or 'huber', got {self.loss!r}")
        if self.weight_norm not in ("sum", "count"):
            raise ValueError(f"weight_norm must be 'sum' or 'count', got {self.weight_norm!r}")
        if not float(self.huber_delta) > 0:
            raise ValueError(f"huber_delta must be > 0, got {self.huber_delta}")
        if not 0 < self.min_lr_ratio <= 1 or not 0 < self.plateau_factor < 1:
            raise ValueError("min_lr_ratio must be in (0, 1] and plateau_factor in (0, 1)")
        if self.train_step not in TRAIN_STEPS:
            raise ValueError(f"train_step must be one of {TRAIN_STEPS}, got {self.train_step!r}")
        if self.kernels is not None and self.kernels not in kernels.BACKENDS:
            raise ValueError(f"kernels must be one of {kernels.BACKENDS} or None, got {self.kernels!r}")
        if not float(self.bucket_growth) > 1:
            raise ValueError(f"bucket_growth must be > 1, got {self.bucket_growth}")
        if not isinstance(self.refit_energy_reference, bool):
            raise ValueError(f"refit_energy_reference must be true or false, got {self.refit_energy_reference!r}")
        if not isinstance(self.repulsion, bool):
            raise ValueError(f"repulsion must be true or false, got {self.repulsion!r}")

    def resolved_device(self) -> torch.device:
        from mlff_distiller.devices import resolve_device

        return resolve_device(self.device)

    def resolved_train_step(self, device: torch.device | None = None) -> str:
        """The step implementation that runs on ``device`` (default: :meth:`resolved_device`)."""
        device = torch.device(device) if device is not None else self.resolved_device()
        if self.train_step == "auto":
            return "cudagraph" if device.type == "cuda" and torch.cuda.is_available() else "plain"
        if self.train_step == "cudagraph" and device.type != "cuda":
            raise ValueError(f"train_step 'cudagraph' needs a CUDA device, got {device}")
        return self.train_step


@dataclass
class TrainResult:
    """The trained student (EMA weights of the best validation step) and its history."""

    model: StudentModel
    best_val: dict
    history: list[dict]
    steps: int
    seconds: float
    stopped: str  # "epochs" | "max_steps" | "time_limit" | "early_stopping"
    train_step: str = "plain"  # the step implementation that ran
    captures: int = 0  # CUDA graphs captured (one per padded capacity)
    capture_seconds: float = 0.0  # wall clock of the eager warm-up steps and captures (part of ``seconds``)
    steady_step_seconds: float = math.nan  # mean wall clock per step after the last warm-up/capture, validations
    # excluded (nan when no step ran after it)
    val_tf32_grid: dict | None = None  # the validation of the student rounded onto the TF32 grid (tf32_grid)


def train(
    train_frames,
    val_frames,
    config: TrainConfig | None = None,
    out_dir: str | Path | None = None,
    *,
    model: StudentModel | None = None,
    resume: bool = False,
    metadata: dict | None = None,
    log: Callable[[str], None] | None = None,
) -> TrainResult:
    """Train a student on teacher-labelled frames.

    Args:
        train_frames, val_frames: labelled ``ase.Atoms`` lists (or :class:`FrameDataset` s built with the
            student's cutoff on the training device). A training frame's ``info["config_weight"]`` (default 1.0)
            weights its terms in the loss (:mod:`mlff_distiller.distill.objective`); validation is unweighted.
        config: :class:`TrainConfig`.
        out_dir: where ``best.pt`` (the best EMA student, via ``model.save``), ``last.pt``, ``train_state.pt``
            and ``history.json`` go; None keeps everything in memory.
        model: start from this student instead of a new one (fine-tuning): its architecture replaces
            ``config.model``, its weights are the starting point and its energy reference is kept, or corrected
            to the training energies with ``config.refit_energy_reference``. The data may hold only elements the
            student knows. The caller's model is not modified.
        resume: continue from ``out_dir/train_state.pt``.
        metadata: extra checkpoint metadata (teacher name, data description...).
        log: a function receiving progress lines (default: stderr).
    """
    cfg = config or TrainConfig()
    backend = kernels.use_backend(cfg.kernels) if cfg.kernels is not None else contextlib.nullcontext()
    with backend:
        return _train(train_frames, val_frames, cfg, out_dir, model, resume, metadata, log)


def _train(train_frames, val_frames, cfg: TrainConfig, out_dir, model, resume, metadata, log) -> TrainResult:
    from mlff_distiller.distill import distributed

    owns_group = not torch.distributed.is_available() or not torch.distributed.is_initialized()
    info = distributed.dist_info()
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    device, dtype = cfg.resolved_device(), _DTYPES[cfg.dtype]
    if info.enabled:  # launched by torchrun: one process per GPU (or gloo processes on a CPU)
        info, device = distributed.setup(cfg.device)
        if not info.is_main:
            log = _silent
    mode = cfg.resolved_train_step(device)
    if info.enabled and mode != "plain":
        log(f"{info.world_size} processes (DistributedDataParallel): train_step {mode!r} -> 'plain'")
        mode = "plain"
    out = Path(out_dir) if out_dir is not None else None
    state_path = out / "train_state.pt" if out is not None else None
    write = out is not None and info.is_main  # only rank 0 writes checkpoints, history and state
    if resume and (state_path is None or not state_path.exists()):
        raise ValueError(f"resume=True but there is no training state at {state_path}")
    cutoff = model.cutoff if model is not None else cfg.model.cutoff
    train_set = _as_dataset(train_frames, cutoff, device, dtype, "training")
    val_set = _as_dataset(val_frames, cutoff, device, dtype, "validation") if val_frames is not None else None
    if val_set is None or len(val_set) == 0:
        raise ValueError("training needs validation frames (early stopping and checkpoints select on them)")
    if not bool((train_set.weight > 0).any()):
        raise ValueError("every training frame has loss weight 0 (config_weight, --data-weight): nothing to fit")

    state = torch.load(state_path, map_location="cpu", weights_only=False) if resume else None
    finetune = state is None and model is not None  # training starts from the caller's student
    if state is not None:
        model = StudentModel(ModelConfig(**state["model_config"]))
        model.load_state_dict(state["model"])
    elif model is None:
        model = _initial_model(cfg, train_set)
    else:
        model = copy.deepcopy(model)
    model = model.to(device=device, dtype=dtype).train()
    for data in (train_set, val_set):
        try:
            model.check_species(data.numbers)
        except ValueError as exc:
            if not finetune:
                raise
            raise ValueError(f"the starting student cannot be fine-tuned on these frames: {exc}") from None
    # Where the training data lies (stored with the checkpoints: mlff_distiller.domain). Fine-tuning adds the new
    # frames to the starting student's envelope; a starting student without one has an unknown domain, so none. A
    # resumed run takes the envelope its state recorded (a state written before envelopes: its frames').
    domain = DomainEnvelope.from_dataset(train_set)
    if finetune:
        base = DomainEnvelope.of_model(model)
        domain = base.merged(domain) if base is not None else None  # same cutoff: fine-tuning keeps the model
    elif state is not None and "domain" in state:
        domain = DomainEnvelope.from_dict(state["domain"]) if state["domain"] is not None else None
    if not cfg.repulsion:
        model.set_repulsion(None)
    elif domain is not None:  # zero on every training frame: the wall lies below the data's shortest pairs
        model.set_repulsion(domain.repulsion_radii(model.species_list))
    if finetune:
        c = model.config
        log(f"fine-tuning a student of {c.hidden} features x {c.layers} layers (config.model is not used)")
        if cfg.refit_energy_reference:
            delta = energy_reference_correction(model, train_set, cfg.val_batch_size)
            shift = model.atomic_shift.detach().double().cpu() + delta
            model.set_energy_reference(shift, model.atomic_scale.detach().clone())
            log(f"energy reference refitted: shift changed by {np.round(delta.numpy(), 4).tolist()} eV per species")

    opt = _optimizer(model, cfg, mode, device, dtype)
    plateau = _plateau(opt, cfg)
    ema = _EMA(model, cfg.ema_decay) if cfg.ema_decay > 0 else None
    gen = torch.Generator().manual_seed(cfg.seed)
    steps_per_epoch = math.ceil(len(train_set) / cfg.batch_size)
    total = steps_per_epoch * cfg.epochs if cfg.max_steps == 0 else min(cfg.max_steps, steps_per_epoch * cfg.epochs)
    eval_every = cfg.eval_every or steps_per_epoch
    step, epoch, bad, elapsed_before = 0, 0, 0, 0.0
    best: dict = {"force_mae_mev_a": math.inf}
    history: list[dict] = []
    if state is not None:
        _load_optimizer(opt, state["optimizer"], mode)
        if plateau is not None and state.get("plateau") is not None:
            plateau.load_state_dict(state["plateau"])
        if ema is not None and state.get("ema") is not None:
            ema.shadow = [t.to(device=device, dtype=dtype) for t in state["ema"]]
        gen.set_state(state["generator"])
        step, epoch, bad = state["step"], state["epoch"], state["bad"]
        best, history, elapsed_before = state["best"], state["history"], state["elapsed"]
        log(f"resumed at step {step} (epoch {epoch}, best val force MAE {best['force_mae_mev_a']:.2f} meV/Å)")

    def checkpoint_meta(metrics: dict) -> dict:
        extra = {"domain": domain.to_dict()} if domain is not None else {}
        return {**(metadata or {}), **extra, "val": metrics, "step": step, "train_config": _plain(cfg)}

    stepper = (
        _PlainStep(model, train_set, cfg, opt, ema, info.wrap(model, device, find_unused=cfg.energy_weight == 0))
        if mode == "plain"
        else _StaticStep(model, train_set, cfg, opt, ema, mode, log)
    )
    best_state: dict | None = None
    eval_spans: list[tuple[float, float]] = []
    t0 = time.perf_counter()
    stopped = "epochs"
    epoch_order: list[int] | None = state.get("epoch_order") if state else None
    position = state.get("position", 0) if state else 0
    while epoch < cfg.epochs and stopped == "epochs":
        if epoch_order is None:
            epoch_order = torch.randperm(len(train_set), generator=gen).tolist()
            position = 0
        while position < len(epoch_order):
            idx = epoch_order[position : position + cfg.batch_size]
            position += len(idx)
            last_epoch_step = position >= len(epoch_order)
            if len(idx) < info.world_size:  # too few frames to give every rank one: skipped by all ranks
                continue
            elapsed = elapsed_before + time.perf_counter() - t0
            lr = cfg.lr * _lr_factor(cfg, step, total, elapsed) if plateau is None else None
            # every rank draws the same epoch order and trains on its share of the global batch
            stepper.step(distributed.shard(idx, info), step, lr)
            step += 1
            # The wall clock has run out: validate this last step too, so its weights can be the result.
            time_up = bool(cfg.time_limit_s) and elapsed_before + time.perf_counter() - t0 >= cfg.time_limit_s
            time_up = info.broadcast_flag(time_up, device)  # rank 0's clock decides for all
            # The run's last step (max_steps, or the last epoch's end) is validated too, whatever eval_every says:
            # else a run shorter than eval_every would end with no best.pt, last.pt or validated result.
            ending = bool(cfg.max_steps and step >= cfg.max_steps) or (last_epoch_step and epoch + 1 >= cfg.epochs)
            if step % eval_every == 0 or (last_epoch_step and cfg.eval_every == 0) or time_up or ending:
                t_eval = time.perf_counter()
                train_loss, parts = stepper.last()  # syncs; raises on a non-finite loss
                train_loss = info.mean(train_loss, device)
                if ema is not None:
                    ema.swap(model)
                metrics = evaluate_dataset(model, val_set, cfg.val_batch_size)
                metrics = info.broadcast_object(metrics)  # rank 0's numbers drive every decision below
                elapsed = elapsed_before + time.perf_counter() - t0
                row = {
                    "step": step,
                    "epoch": epoch + (position / len(epoch_order)),
                    "seconds": elapsed,
                    "lr": float(opt.param_groups[0]["lr"]),
                    "train_loss": train_loss,
                    **{f"train_{k}_mse": v for k, v in parts.items()},
                    **{f"val_{k}": v for k, v in metrics.items()},
                }
                history.append(row)
                improved = metrics["force_mae_mev_a"] < best["force_mae_mev_a"] - cfg.min_delta
                if improved:
                    best, bad = {**metrics, "step": step, "seconds": elapsed}, 0
                    best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
                    if write:
                        model.save(out / "best.pt", metadata=checkpoint_meta(metrics))
                else:
                    bad += 1
                if write:
                    model.save(out / "last.pt", metadata=checkpoint_meta(metrics))
                if ema is not None:
                    ema.swap(model)
                if plateau is not None:
                    plateau.step(metrics["force_mae_mev_a"])
                log(
                    f"step {step:6d} epoch {row['epoch']:7.2f} lr {row['lr']:.2e} "
                    f"loss {row['train_loss']:.4g} val E {metrics['energy_mae_mev_atom']:.2f} meV/atom "
                    f"F {metrics['force_mae_mev_a']:.2f} meV/Å" + (" *" if improved else "")
                )
                if write:
                    (out / "history.json").write_text(json.dumps(history, indent=1))
                    _atomic_torch_save(
                        {
                            "model_config": model.config_dict(),
                            "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
                            "optimizer": _optimizer_state(opt),
                            "plateau": plateau.state_dict() if plateau is not None else None,
                            "ema": [t.cpu() for t in ema.shadow] if ema is not None else None,
                            "generator": gen.get_state(),
                            "step": step,
                            "epoch": epoch,
                            "epoch_order": epoch_order if not last_epoch_step else None,
                            "position": position if not last_epoch_step else 0,
                            "bad": bad,
                            "best": best,
                            "history": history,
                            "elapsed": elapsed,
                            "config": _plain(cfg),
                            "domain": domain.to_dict() if domain is not None else None,
                        },
                        state_path,
                    )
                eval_spans.append((t_eval, time.perf_counter()))
                if cfg.patience and bad >= cfg.patience and not ending:
                    stopped = "early_stopping"
                    break
            if cfg.max_steps and step >= cfg.max_steps:
                stopped = "max_steps"
                break
            if time_up:
                stopped = "time_limit"
                break
        if position >= len(epoch_order):
            epoch += 1
            epoch_order = None
    stepper.finish()
    t_end = time.perf_counter()
    steady = math.nan
    if stepper.ready is not None and step > stepper.ready[1]:
        t_ready, step_ready = stepper.ready
        in_evals = sum(b - max(a, t_ready) for a, b in eval_spans if b > t_ready)
        steady = (t_end - t_ready - in_evals) / (step - step_ready)
    if step > 0 and not history:
        stepper.last()  # a non-finite loss must not pass silently when no validation ran
    seconds = elapsed_before + time.perf_counter() - t0

    # Return the best validated (EMA) weights.
    if best_state is not None:
        model.load_state_dict(best_state)
        final = model
    elif out is not None and (out / "best.pt").exists():  # resumed, and nothing better since
        from mlff_distiller.checkpoint import load_model

        final = load_model(out / "best.pt")
    else:
        if ema is not None:
            ema.swap(model)
        final = model
    final = final.to(device=device, dtype=dtype).eval()
    final.metadata = {k: v for k, v in dict(getattr(final, "metadata", None) or {}).items() if k != "domain"}
    if domain is not None:
        final.metadata["domain"] = domain.to_dict()
    grid_metrics = None
    if cfg.tf32_grid and dtype == torch.float32:
        # Onto the TF32 grid (two TF32 MMAs per weight product in fp32 on a GPU), validated again and written as
        # best.pt (each rank rounds the same weights; rank 0's validation is everyone's, as in the loop).
        changed = final.round_weights_tf32()
        grid_metrics = info.broadcast_object(evaluate_dataset(final, val_set, cfg.val_batch_size))
        final.metadata["tf32_grid"] = True
        final.metadata["val_tf32_grid"] = grid_metrics
        log(
            f"weights on the TF32 grid ({changed} rounded): val force MAE "
            f"{grid_metrics['force_mae_mev_a']:.3f} meV/Å (as trained {best.get('force_mae_mev_a', math.nan):.3f})"
        )
        if write and (out / "best.pt").exists():
            from mlff_distiller.checkpoint import load_model

            # (this run's metadata: the returned model may still carry a fine-tuned student's own)
            saved = load_model(out / "best.pt").metadata
            final.save(out / "best.pt", metadata={**saved, "tf32_grid": True, "val_tf32_grid": grid_metrics})
    log(
        f"stopped ({stopped}) after {step} steps ({mode} step, {1000 * steady:.2f} ms/step steady), "
        f"{seconds:.1f} s; best val {best}"
    )
    if info.enabled and owns_group:
        distributed.teardown(info)
    return TrainResult(
        model=final,
        best_val=best,
        history=history,
        steps=step,
        seconds=seconds,
        stopped=stopped,
        train_step=mode,
        captures=stepper.captures,
        capture_seconds=stepper.capture_seconds,
        steady_step_seconds=steady,
        val_tf32_grid=grid_metrics,
    )


def _initial_model(cfg: TrainConfig, train_set: FrameDataset) -> StudentModel:
    """A new student seeded with ``cfg.seed``, its energy reference fitted to ``train_set`` (see the module
    docstring; both fits weigh the frames by their loss weights)."""
    mcfg = cfg.model
    species = train_set.species()
    missing = sorted(set(species) - set(mcfg.species))
    if missing:
        # The config's default species (CHNO) do not cover the data: train on the data's species instead.
        mcfg = ModelConfig(**{**mcfg.__dict__, "species": sorted(set(species) | set(mcfg.species))})
    torch.manual_seed(cfg.seed)
    model = StudentModel(mcfg)
    mu = fit_energy_reference(train_set, model.species_list)
    atom_weight = torch.repeat_interleave(train_set.weight, train_set.num_atoms).double()
    force_rms = float(_weighted_mean(train_set.forces.double().pow(2), atom_weight).sqrt())
    scale = max(force_rms, 1e-3)
    model.set_energy_reference(torch.tensor(mu), torch.full((len(model.species_list),), scale))
    return model


def _silent(msg: str) -> None:
    """The log of ranks other than 0 in a torchrun job."""


def _as_dataset(frames, cutoff: float, device, dtype, what: str) -> FrameDataset | None:
    """``frames`` as a :class:`FrameDataset` on ``device`` (a given dataset must use the student's cutoff, Å)."""
    if frames is None:
        return None
    if isinstance(frames, FrameDataset):
        if abs(frames.cutoff - cutoff) > 1e-9:
            raise ValueError(f"{what} dataset was built with cutoff {frames.cutoff} Å, the student uses {cutoff} Å")
        return frames
    frames = list(frames)
    if not frames:
        raise ValueError(f"no {what} frames")
    return FrameDataset(frames, cutoff, device=device, dtype=dtype)


def _plain(cfg: TrainConfig) -> dict:
    """``cfg`` as JSON-safe plain data (numpy scalars as numbers, anything else unknown as its string)."""
    d = asdict(cfg)
    return json.loads(json.dumps(d, default=lambda x: x.item() if isinstance(x, np.generic) else str(x)))


def _atomic_torch_save(obj, path: Path) -> None:
    """``torch.save`` through a temporary file and a rename: a crash mid-write leaves the older file intact."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)
