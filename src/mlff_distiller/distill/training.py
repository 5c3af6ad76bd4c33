"""Force-matching training of a student on teacher labels.

Loss per batch (units eV², so the weights are dimensionless)::

    L = w_E · mean_b ((E_b − E_b^T) / n_b)² + w_F · mean_{i,α} (F_iα − F_iα^T)² + w_H · mean (Hv − Hv^T)² · Å²

Forces are ``−∂E/∂x`` from ``torch.autograd.grad(..., create_graph=True)``, so the loss differentiates through
them (double backward of the model's ops; on the GPU that is the Triton kernels' backward-of-backward). The
optional Hessian term matches the student's H·v, taken by the same central finite difference the teacher
labels used, H·v ≈ −(F(x + εv) − F(x − εv)) / 2ε: two extra force evaluations and only second derivatives,
rather than a third-order autograd through the kernels.

The forward here mirrors :meth:`mlff_distiller.ForceEngine.compute` (same graph, same model call) but keeps
the parameters' graph; the engine freezes them for inference.

Before training, per-species reference energies are fitted by least squares (``model.set_energy_reference``:
shift μ_z, scale = RMS teacher force component), then AdamW with linear warm-up and cosine decay (or
reduce-on-plateau), gradient clipping, and an exponential moving average (EMA) of the weights, which is what
is validated, checkpointed and returned. Training stops early after ``patience`` validations without a better
validation force MAE. ``out_dir/train_state.pt`` (written atomically) lets a killed run resume.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from mlff_distiller.distill.dataset import FrameDataset, LabelledBatch, fit_energy_reference
from mlff_distiller.model import ModelConfig, StudentModel

__all__ = ["TrainConfig", "TrainResult", "evaluate_dataset", "student_forward", "train"]

_DTYPES = {"float32": torch.float32, "float64": torch.float64}


@dataclass(kw_only=True)
class TrainConfig:
    """Training settings (all optional).

    Attributes:
        model: :class:`ModelConfig` of a new student (species default to those of the data).
        batch_size: frames per batch.
        lr: peak AdamW learning rate. weight_decay: AdamW weight decay.
        epochs: passes over the training set (upper bound; ``max_steps``/``time_limit_s`` may stop earlier).
        max_steps: optimiser steps (0 = no limit). time_limit_s: wall-clock limit, s (0 = none).
        energy_weight, force_weight, hvp_weight: loss weights (see module docstring).
        hvp_eps: finite-difference step of the student's H·v, Å (use the labels' step).
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
    hvp_eps: float = 0.005
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
            "grad_clip",
            "time_limit_s",
        ):
            if float(getattr(self, name)) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.energy_weight == 0 and self.force_weight == 0 and self.hvp_weight == 0:
            raise ValueError("at least one of energy_weight, force_weight, hvp_weight must be > 0")
        if not 0 <= self.ema_decay < 1:
            raise ValueError(f"ema_decay must be in [0, 1), got {self.ema_decay}")
        if self.scheduler not in ("cosine", "plateau", "none"):
            raise ValueError(f"scheduler must be 'cosine', 'plateau' or 'none', got {self.scheduler!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if not self.hvp_eps > 0:
            raise ValueError(f"hvp_eps must be > 0 Å, got {self.hvp_eps}")
        if not 0 < self.min_lr_ratio <= 1 or not 0 < self.plateau_factor < 1:
            raise ValueError("min_lr_ratio must be in (0, 1] and plateau_factor in (0, 1)")

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


@dataclass
class TrainResult:
    """The trained student (EMA weights of the best validation step) and its history."""

    model: StudentModel
    best_val: dict
    history: list[dict]
    steps: int
    seconds: float
    stopped: str  # "epochs" | "max_steps" | "time_limit" | "early_stopping"


def student_forward(
    model: StudentModel, batch: LabelledBatch, *, create_graph: bool, positions: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Energies ``[B]`` (eV) and forces ``[N, 3]`` (eV/Å) with the parameters' graph kept.

    ``create_graph=True`` keeps the graph of the forces themselves, so a loss on them can be back-propagated.
    ``positions`` replaces the batch's positions (for finite differences).
    """
    a = batch.atoms
    pos = (a.positions if positions is None else positions).detach().requires_grad_(True)
    out = model(a.numbers, pos, batch.edge_index, batch.shift_vectors(), a.batch, a.num_structures)
    (grad,) = torch.autograd.grad(out["energy"].sum(), pos, create_graph=create_graph)
    return out["energy"], -grad


def _student_hvp(model: StudentModel, batch: LabelledBatch, eps: float) -> torch.Tensor:
    pos, v = batch.atoms.positions, batch.hvp_dir
    f_plus = student_forward(model, batch, create_graph=True, positions=pos + eps * v)[1]
    f_minus = student_forward(model, batch, create_graph=True, positions=pos - eps * v)[1]
    return -(f_plus - f_minus) / (2 * eps)


def _loss(model: StudentModel, batch: LabelledBatch, cfg: TrainConfig) -> tuple[torch.Tensor, dict]:
    energy, forces = student_forward(model, batch, create_graph=True)
    n = batch.atoms.counts.to(energy.dtype)
    e_loss = (((energy - batch.energy) / n) ** 2).mean()
    f_loss = ((forces - batch.forces) ** 2).mean()
    loss = cfg.energy_weight * e_loss + cfg.force_weight * f_loss
    parts = {"energy": float(e_loss.detach()), "forces": float(f_loss.detach())}
    if cfg.hvp_weight > 0:
        if batch.hvp is None:
            raise ValueError("hvp_weight > 0 needs frames labelled with Hessian-vector products (sampling hvp: true)")
        h_loss = ((_student_hvp(model, batch, cfg.hvp_eps) - batch.hvp) ** 2).mean()
        loss = loss + cfg.hvp_weight * h_loss
        parts["hvp"] = float(h_loss.detach())
    return loss, parts


def evaluate_dataset(model: StudentModel, dataset: FrameDataset, batch_size: int = 64) -> dict:
    """Errors of ``model`` on ``dataset``: energy MAE/RMSE (meV/atom), force MAE/RMSE (meV/Å)."""
    was_training = model.training
    model.eval()
    e_err, f_err, counts = [], [], []
    for batch in dataset.batches(batch_size):
        energy, forces = student_forward(model, batch, create_graph=False)
        n = batch.atoms.counts
        e_err.append(((energy.detach() - batch.energy) / n).double().cpu())
        f_err.append((forces.detach() - batch.forces).double().cpu().reshape(-1))
        counts.append(n.cpu())
    model.train(was_training)
    e = torch.cat(e_err)
    f = torch.cat(f_err)
    return {
        "energy_mae_mev_atom": 1000 * float(e.abs().mean()),
        "energy_rmse_mev_atom": 1000 * float(e.pow(2).mean().sqrt()),
        "force_mae_mev_a": 1000 * float(f.abs().mean()),
        "force_rmse_mev_a": 1000 * float(f.pow(2).mean().sqrt()),
        "frames": len(dataset),
        "atoms": int(torch.cat(counts).sum()),
    }


class _EMA:
    """Exponential moving average of the trainable parameters (buffers are copied as they are)."""

    def __init__(self, model: StudentModel, decay: float) -> None:
        self.decay = decay
        self.shadow = [p.detach().clone() for p in model.parameters()]

    @torch.no_grad()
    def update(self, model: StudentModel, step: int) -> None:
        # Warm-up of the decay (as TensorFlow's EMA does): early weights must not linger for many steps.
        d = min(self.decay, (1 + step) / (10 + step))
        for s, p in zip(self.shadow, model.parameters(), strict=True):
            s.lerp_(p.detach(), 1 - d)

    @torch.no_grad()
    def swap(self, model: StudentModel) -> None:
        """Exchange the live and the averaged weights (call twice to restore)."""
        for s, p in zip(self.shadow, model.parameters(), strict=True):
            tmp = p.detach().clone()
            p.copy_(s)
            s.copy_(tmp)


def _lr_factor(cfg: TrainConfig, step: int, total: int, elapsed: float) -> float:
    if cfg.scheduler != "cosine":
        return 1.0
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
    if cfg.time_limit_s > 0:
        # With a wall-clock budget the cosine also follows elapsed time, so it has decayed when time runs out.
        progress = max(progress, min(1.0, elapsed / cfg.time_limit_s))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def _atomic_torch_save(obj, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _initial_model(cfg: TrainConfig, train_set: FrameDataset) -> StudentModel:
    mcfg = cfg.model
    species = train_set.species()
    missing = sorted(set(species) - set(mcfg.species))
    if missing:
        # The config's default species (CHNO) do not cover the data: train on the data's species instead.
        mcfg = ModelConfig(**{**mcfg.__dict__, "species": sorted(set(species) | set(mcfg.species))})
    torch.manual_seed(cfg.seed)
    model = StudentModel(mcfg)
    mu = fit_energy_reference(train_set, model.species_list)
    force_rms = float(train_set.forces.double().pow(2).mean().sqrt())
    scale = max(force_rms, 1e-3)
    model.set_energy_reference(torch.tensor(mu), torch.full((len(model.species_list),), scale))
    return model


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
            student's cutoff on the training device).
        config: :class:`TrainConfig`.
        out_dir: where ``best.pt`` (the best EMA student, via ``model.save``), ``last.pt``, ``train_state.pt``
            and ``history.json`` go; None keeps everything in memory.
        model: start from this student instead of a new one (fine-tuning; its energy reference is kept).
        resume: continue from ``out_dir/train_state.pt``.
        metadata: extra checkpoint metadata (teacher name, data description...).
        log: a function receiving progress lines (default: stderr).
    """
    cfg = config or TrainConfig()
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    device, dtype = cfg.resolved_device(), _DTYPES[cfg.dtype]
    out = Path(out_dir) if out_dir is not None else None
    state_path = out / "train_state.pt" if out is not None else None
    if resume and (state_path is None or not state_path.exists()):
        raise ValueError(f"resume=True but there is no training state at {state_path}")
    cutoff = model.cutoff if model is not None else cfg.model.cutoff
    train_set = _as_dataset(train_frames, cutoff, device, dtype, "training")
    val_set = _as_dataset(val_frames, cutoff, device, dtype, "validation") if val_frames is not None else None
    if val_set is None or len(val_set) == 0:
        raise ValueError("training needs validation frames (early stopping and checkpoints select on them)")

    state = torch.load(state_path, map_location="cpu", weights_only=False) if resume else None
    if state is not None:
        model = StudentModel(ModelConfig(**state["model_config"]))
        model.load_state_dict(state["model"])
    elif model is None:
        model = _initial_model(cfg, train_set)
    else:
        import copy

        model = copy.deepcopy(model)
    model = model.to(device=device, dtype=dtype).train()
    model.check_species(train_set.numbers)
    model.check_species(val_set.numbers)

    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    plateau = (
        torch.optim.lr_scheduler.ReduceLROnPlateau(
            opt, factor=cfg.plateau_factor, patience=cfg.plateau_patience, min_lr=cfg.lr * cfg.min_lr_ratio
        )
        if cfg.scheduler == "plateau"
        else None
    )
    ema = _EMA(model, cfg.ema_decay) if cfg.ema_decay > 0 else None
    gen = torch.Generator().manual_seed(cfg.seed)
    steps_per_epoch = math.ceil(len(train_set) / cfg.batch_size)
    total = steps_per_epoch * cfg.epochs if cfg.max_steps == 0 else min(cfg.max_steps, steps_per_epoch * cfg.epochs)
    eval_every = cfg.eval_every or steps_per_epoch
    step, epoch, bad, elapsed_before = 0, 0, 0, 0.0
    best: dict = {"force_mae_mev_a": math.inf}
    history: list[dict] = []
    if state is not None:
        opt.load_state_dict(state["optimizer"])
        if plateau is not None and state.get("plateau") is not None:
            plateau.load_state_dict(state["plateau"])
        if ema is not None and state.get("ema") is not None:
            ema.shadow = [t.to(device=device, dtype=dtype) for t in state["ema"]]
        gen.set_state(state["generator"])
        step, epoch, bad = state["step"], state["epoch"], state["bad"]
        best, history, elapsed_before = state["best"], state["history"], state["elapsed"]
        log(f"resumed at step {step} (epoch {epoch}, best val force MAE {best['force_mae_mev_a']:.2f} meV/Å)")

    def checkpoint_meta(metrics: dict) -> dict:
        return {**(metadata or {}), "val": metrics, "step": step, "train_config": _plain(cfg)}

    best_state: dict | None = None
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
            for g in opt.param_groups:
                elapsed = elapsed_before + time.perf_counter() - t0
                g["lr"] = cfg.lr * _lr_factor(cfg, step, total, elapsed) if plateau is None else g["lr"]
            loss, parts = _loss(model, train_set.batch(idx), cfg)
            if not torch.isfinite(loss):
                raise FloatingPointError(
                    f"non-finite training loss at step {step} ({parts}); lower lr or check the labels"
                )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            step += 1
            if ema is not None:
                ema.update(model, step)
            last_epoch_step = position >= len(epoch_order)
            if step % eval_every == 0 or (last_epoch_step and cfg.eval_every == 0):
                if ema is not None:
                    ema.swap(model)
                metrics = evaluate_dataset(model, val_set, cfg.val_batch_size)
                elapsed = elapsed_before + time.perf_counter() - t0
                row = {
                    "step": step,
                    "epoch": epoch + (position / len(epoch_order)),
                    "seconds": elapsed,
                    "lr": opt.param_groups[0]["lr"],
                    "train_loss": float(loss.detach()),
                    **{f"train_{k}_mse": v for k, v in parts.items()},
                    **{f"val_{k}": v for k, v in metrics.items()},
                }
                history.append(row)
                improved = metrics["force_mae_mev_a"] < best["force_mae_mev_a"] - cfg.min_delta
                if improved:
                    best, bad = {**metrics, "step": step, "seconds": elapsed}, 0
                    best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
                    if out is not None:
                        model.save(out / "best.pt", metadata=checkpoint_meta(metrics))
                else:
                    bad += 1
                if out is not None:
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
                if out is not None:
                    (out / "history.json").write_text(json.dumps(history, indent=1))
                    _atomic_torch_save(
                        {
                            "model_config": model.config_dict(),
                            "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
                            "optimizer": opt.state_dict(),
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
                        },
                        state_path,
                    )
                if cfg.patience and bad >= cfg.patience:
                    stopped = "early_stopping"
                    break
            if cfg.max_steps and step >= cfg.max_steps:
                stopped = "max_steps"
                break
            if cfg.time_limit_s and elapsed_before + time.perf_counter() - t0 >= cfg.time_limit_s:
                stopped = "time_limit"
                break
        if position >= len(epoch_order):
            epoch += 1
            epoch_order = None
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
    log(f"stopped ({stopped}) after {step} steps, {seconds:.1f} s; best val {best}")
    return TrainResult(model=final, best_val=best, history=history, steps=step, seconds=seconds, stopped=stopped)


def _as_dataset(frames, cutoff: float, device, dtype, what: str) -> FrameDataset | None:
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
    from dataclasses import asdict

    d = asdict(cfg)
    return json.loads(json.dumps(d, default=lambda x: x.item() if isinstance(x, np.generic) else str(x)))
