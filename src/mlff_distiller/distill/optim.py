"""The optimiser side of training: AdamW (plain, or capturable for CUDA graphs) and its saved state, the
learning-rate schedule (linear warm-up then cosine decay, or reduce-on-plateau), and the exponential moving
average (EMA) of the weights that is validated, checkpointed and returned.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from mlff_distiller.model import StudentModel

if TYPE_CHECKING:
    from mlff_distiller.distill.training import TrainConfig


def _optimizer(model: StudentModel, cfg: TrainConfig, mode: str, device: torch.device, dtype) -> torch.optim.AdamW:
    """AdamW over ``model``'s parameters for step mode ``mode`` (``cudagraph``: capturable, lr a device tensor)."""
    if mode == "cudagraph":
        # A device learning rate the captured step reads; capturable keeps the step counts on the device.
        lr = torch.tensor(cfg.lr, dtype=dtype, device=device)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=cfg.weight_decay, capturable=True)
        _init_state(opt)
        return opt
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)


def _step_dtype(p: torch.Tensor) -> torch.dtype:
    """The dtype of a capturable AdamW step count for parameter ``p``: float64 for float64 parameters.

    torch makes capturable step counts float32 (unless the default dtype is float64) and computes the bias
    corrections from them on the device: ``1 - 0.999**1`` in float32 is off by 3e-5 relative, so a float64 run
    would part from the same run with the plain AdamW (whose corrections are Python floats) at the 1e-9 level
    after one step. Float64 counts give the plain optimiser's numbers."""
    return torch.float64 if p.dtype == torch.float64 else torch.float32


@torch.no_grad()
def _init_state(opt: torch.optim.AdamW) -> None:
    """Create the capturable optimiser's state now (torch would create it at the first step), with step
    counts in :func:`_step_dtype`."""
    for group in opt.param_groups:
        for p in group["params"]:
            if opt.state.get(p):
                continue
            st = opt.state[p]
            st["step"] = torch.zeros((), dtype=_step_dtype(p), device=p.device)
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group.get("amsgrad"):
                st["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _load_optimizer(opt: torch.optim.AdamW, state: dict, mode: str) -> None:
    """Load a saved optimiser state into ``opt`` whatever step mode saved it (lr kept as ``opt`` holds it)."""
    lrs = [g["lr"] for g in opt.param_groups]
    flags = [g.get("capturable", False) for g in opt.param_groups]
    opt.load_state_dict(state)
    for g, lr, cap in zip(opt.param_groups, lrs, flags, strict=True):
        value = float(g["lr"])
        if isinstance(lr, torch.Tensor):
            lr.fill_(value)
            g["lr"] = lr
        else:
            g["lr"] = value
        g["capturable"] = cap
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state.get(p)
            if st and "step" in st and torch.is_tensor(st["step"]):
                if group["capturable"]:
                    st["step"] = st["step"].to(device=p.device, dtype=_step_dtype(p))
                else:
                    st["step"] = st["step"].to(device="cpu", dtype=torch.float32)
    if any(g["capturable"] for g in opt.param_groups):
        _init_state(opt)  # a state saved before the first step holds none


def _optimizer_state(opt: torch.optim.AdamW) -> dict:
    """``opt.state_dict()`` with plain-float learning rates (loadable whatever the step mode)."""
    sd = opt.state_dict()
    sd["param_groups"] = [
        {**g, "lr": float(g["lr"])} if isinstance(g["lr"], torch.Tensor) else g for g in sd["param_groups"]
    ]
    return sd


def _plateau(opt: torch.optim.AdamW, cfg: TrainConfig) -> torch.optim.lr_scheduler.ReduceLROnPlateau | None:
    """The reduce-on-plateau scheduler of ``cfg.scheduler == "plateau"`` (stepped on the validation force MAE),
    else None (the learning rate then comes from :func:`_lr_factor`)."""
    return (
        torch.optim.lr_scheduler.ReduceLROnPlateau(
            opt, factor=cfg.plateau_factor, patience=cfg.plateau_patience, min_lr=cfg.lr * cfg.min_lr_ratio
        )
        if cfg.scheduler == "plateau"
        else None
    )


def _lr_factor(cfg: TrainConfig, step: int, total: int, elapsed: float) -> float:
    """The multiple of ``cfg.lr`` at optimiser ``step`` of ``total``, ``elapsed`` seconds into the run."""
    if cfg.scheduler != "cosine":
        return 1.0
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
    if cfg.time_limit_s > 0:
        # With a wall-clock budget the cosine also follows elapsed time, so it has decayed when time runs out.
        progress = max(progress, min(1.0, elapsed / cfg.time_limit_s))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class _EMA:
    """Exponential moving average of the trainable parameters (buffers are copied as they are)."""

    def __init__(self, model: StudentModel, decay: float) -> None:
        self.decay = decay
        self.shadow = [p.detach().clone() for p in model.parameters()]

    def decay_at(self, step: int) -> float:
        """The decay of update ``step`` (1 = the first step's update)."""
        # Warm-up of the decay (as TensorFlow's EMA does): early weights must not linger for many steps.
        return min(self.decay, (1 + step) / (10 + step))

    @torch.no_grad()
    def update(self, model: StudentModel, step: int) -> None:
        d = self.decay_at(step)
        for s, p in zip(self.shadow, model.parameters(), strict=True):
            s.lerp_(p.detach(), 1 - d)

    @torch.no_grad()
    def swap(self, model: StudentModel) -> None:
        """Exchange the live and the averaged weights (call twice to restore)."""
        for s, p in zip(self.shadow, model.parameters(), strict=True):
            tmp = p.detach().clone()
            p.copy_(s)
            s.copy_(tmp)
