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
validation force MAE; a run stopped by its wall-clock limit validates its last step too.
``out_dir/train_state.pt`` (written atomically) lets a killed run resume.

Two implementations of one optimiser step (``TrainConfig.train_step``), with the same math:

* ``plain``: the batch as it comes (variable shapes), loss parts read back to the host every step.
* ``static``: every batch is padded to the next capacity of a geometric ladder (:mod:`mlff_distiller.buckets`):
  one trailing inert row is appended to the dataset's atoms, frames and edges, padding atoms point at it and
  belong to a dummy structure whose energy is masked out of the loss, and padding edges are self-loops of
  padding atoms with a shift longer than the cutoff, so every padding message, force and gradient is exactly
  0. The host only writes integer gather indices (``_StaticBatcher``); the gathers, the model, the forces
  (``create_graph=True``), the masked loss, the backward, gradient clipping, the AdamW step and the EMA update
  all run on the device without a host sync. Loss values are read back only at validations.
* ``cudagraph``: the static step of each capacity captured once as a CUDA graph (after two eager warm-up
  steps) and replayed: one launch per step instead of hundreds, with AdamW ``capturable=True`` (learning
  rate a device tensor) and the EMA inside the graph. A capture that fails falls back to the eager static
  step for that capacity. ``auto`` (the default) is ``cudagraph`` on CUDA and ``plain`` elsewhere.

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from mlff_distiller import kernels
from mlff_distiller.buckets import Bucket, BucketLadder
from mlff_distiller.distill.dataset import FrameDataset, LabelledBatch, fit_energy_reference
from mlff_distiller.model import ModelConfig, StudentModel
from mlff_distiller.model.painn import CSRInteraction

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
        train_step: ``"auto"``, ``"plain"``, ``"static"`` or ``"cudagraph"`` (see the module docstring).
        kernels: kernel backend for the run (``"auto"``, ``"triton"``, ``"torch"``; None keeps the process
            setting, i.e. ``MLFF_DISTILLER_KERNELS``).
        bucket_growth: ratio between neighbouring padded capacities of the static steps (> 1).
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
    train_step: str = "auto"
    kernels: str | None = None
    bucket_growth: float = 1.25

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
        if self.train_step not in TRAIN_STEPS:
            raise ValueError(f"train_step must be one of {TRAIN_STEPS}, got {self.train_step!r}")
        if self.kernels is not None and self.kernels not in kernels.BACKENDS:
            raise ValueError(f"kernels must be one of {kernels.BACKENDS} or None, got {self.kernels!r}")
        if not float(self.bucket_growth) > 1:
            raise ValueError(f"bucket_growth must be > 1, got {self.bucket_growth}")

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

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
        bare = getattr(model, "module", model)  # DDP: the wrapped forward runs once per step
        h_loss = ((_student_hvp(bare, batch, cfg.hvp_eps) - batch.hvp) ** 2).mean()
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


# ------------------------------------------------------------------------------------------------------------
# Step implementations. Both take the frame indices of one batch and the learning rate of the step, and update
# the model, the optimiser and the EMA in place; ``last()`` reads the loss of the latest step back (a sync).
# ------------------------------------------------------------------------------------------------------------


class _PlainStep:
    """The batch as it comes: variable shapes, loss parts read back every step."""

    mode = "plain"
    captures = 0
    capture_seconds = 0.0

    def __init__(
        self, model: StudentModel, data: FrameDataset, cfg: TrainConfig, opt, ema: _EMA | None, forward=None
    ) -> None:
        self.model, self.data, self.cfg, self.opt, self.ema = model, data, cfg, opt, ema
        self.forward = forward if forward is not None else model  # a DistributedDataParallel wrapper in torchrun
        self._last: tuple[float, dict] = (math.nan, {})
        self.ready: tuple[float, int] | None = None  # (time, steps done) when the steady phase began
        self._steps = 0

    def step(self, idx: Sequence[int], step: int, lr: float | None) -> None:
        if lr is not None:
            for g in self.opt.param_groups:
                g["lr"] = lr
        loss, parts = _loss(self.forward, self.data.batch(idx), self.cfg)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite training loss at step {step} ({parts}); lower lr or check the labels")
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if self.cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.opt.step()
        if self.ema is not None:
            self.ema.update(self.model, step + 1)
        self._last = (float(loss.detach()), parts)
        self._steps += 1
        if self._steps == 1:  # the first step pays one-off costs (Triton JIT, cuBLAS handles)
            self.ready = (time.perf_counter(), step + 1)

    def last(self) -> tuple[float, dict]:
        return self._last

    def finish(self) -> None:
        pass


def _csr_view(model: StudentModel, csr: dict) -> StudentModel:
    """A shallow view of ``model`` (the same parameter tensors) whose message blocks take ``csr["row_ptr"]``."""
    view = copy.copy(model)
    view._modules = dict(model._modules)
    view.interactions = nn.ModuleList(CSRInteraction(m, csr) for m in model.interactions)
    return view


def _segment_arange_np(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    offsets = np.cumsum(counts) - counts
    return np.arange(int(counts.sum()), dtype=np.int64) + np.repeat(starts - offsets, counts)


class _StaticData:
    """A dataset's tensors on its device, each with one trailing inert row that padding entries point at
    (atom: the model's first species at the origin with zero force; frame: zero energy, one atom; edge: a shift
    vector longer than the cutoff), and host copies of the offsets that the batcher needs."""

    def __init__(self, ds: FrameDataset, pad_z: int, cutoff: float) -> None:
        dev = ds.device

        def ext(t: torch.Tensor | None, fill: float) -> torch.Tensor | None:
            if t is None:
                return None
            return torch.cat([t, torch.full((1, *t.shape[1:]), fill, dtype=t.dtype, device=dev)])

        self.n_atoms, self.n_frames = int(ds.atom_ptr[-1]), len(ds)
        self.n_edges = int(ds.edges_local.shape[1])
        self.numbers = ext(ds.numbers, pad_z)
        self.positions = ext(ds.positions, 0.0)
        self.forces = ext(ds.forces, 0.0)
        self.energy = ext(ds.energy, 0.0)
        self.counts = ext(ds.num_atoms.to(ds.dtype), 1.0)
        self.hvp_dir, self.hvp = ext(ds.hvp_dir, 0.0), ext(ds.hvp, 0.0)
        edge_counts = ds.edge_ptr[1:] - ds.edge_ptr[:-1]
        edge_frame = torch.repeat_interleave(torch.arange(self.n_frames, device=dev), edge_counts)
        sv = torch.einsum("ei,eij->ej", ds.edge_shifts.to(ds.dtype), ds.cell[edge_frame])
        far = torch.zeros((1, 3), dtype=ds.dtype, device=dev)
        far[0, 0] = 2.0 * float(cutoff) + 1.0  # far outside the cutoff in any precision (as buckets.py)
        self.shift_vectors = torch.cat([sv, far])
        self.atom_ptr = ds.atom_ptr.cpu().numpy()
        self.edge_ptr = ds.edge_ptr.cpu().numpy()
        self.edges_local = ds.edges_local.cpu().numpy()


class _StaticBatcher:
    """Host side of the static step: the padded capacity of a batch and its gather indices, one int64 row
    ``[atom_src A | batch A | receiver C | sender C | edge_src C | frame_src S]`` (S = batch size + 1)."""

    def __init__(self, data: _StaticData, batch_size: int, growth: float) -> None:
        self.data = data
        self.structures = int(batch_size) + 1
        counts = np.sort(data.atom_ptr[1:] - data.atom_ptr[:-1])[::-1]
        ecounts = np.sort(data.edge_ptr[1:] - data.edge_ptr[:-1])[::-1]
        # The largest possible batch bounds the ladder, so every batch has a capacity.
        ladder = BucketLadder(
            min_atoms=64,
            max_atoms=max(64, int(counts[:batch_size].sum()) + 1),
            min_edges=64,
            max_edges=max(64, int(ecounts[:batch_size].sum())),
            growth=float(growth),
        )
        self.atom_caps = np.array(ladder.atom_capacities)
        self.edge_caps = np.array(ladder.edge_capacities)

    def bucket(self, n_atoms: int, n_edges: int) -> Bucket:
        a = self.atom_caps[np.searchsorted(self.atom_caps, n_atoms + 1)]
        e = self.edge_caps[np.searchsorted(self.edge_caps, max(n_edges, 1))]
        return Bucket(int(a), int(e))

    def plan(self, idx: Sequence[int]) -> tuple[Bucket, np.ndarray]:
        d = self.data
        idx = np.asarray(idx, dtype=np.int64)
        if idx.size == 0 or idx.size >= self.structures:
            raise ValueError(f"a static batch holds 1..{self.structures - 1} frames, got {idx.size}")
        counts = d.atom_ptr[idx + 1] - d.atom_ptr[idx]
        ecounts = d.edge_ptr[idx + 1] - d.edge_ptr[idx]
        n, e, b, s = int(counts.sum()), int(ecounts.sum()), idx.size, self.structures
        bucket = self.bucket(n, e)
        a, c = bucket.atoms, bucket.edges
        row = np.empty(2 * a + 3 * c + s, dtype=np.int64)
        atom_src, batch, recv, send, edge_src, frame_src = np.split(row, np.cumsum([a, a, c, c, c]))
        atom_src[:n] = _segment_arange_np(d.atom_ptr[idx], counts)
        atom_src[n:] = d.n_atoms
        batch[:n] = np.repeat(np.arange(b, dtype=np.int64), counts)
        batch[n:] = s - 1  # the dummy structure
        esrc = _segment_arange_np(d.edge_ptr[idx], ecounts)
        edge_src[:e] = esrc
        edge_src[e:] = d.n_edges
        offsets = np.repeat(np.cumsum(counts) - counts, ecounts)
        recv[:e] = d.edges_local[0, esrc] + offsets
        send[:e] = d.edges_local[1, esrc] + offsets
        if c > e:
            # Self-loops of padding atoms n .. a-1 in ascending order: the list stays sorted by receiver.
            recv[e:] = n + (np.arange(c - e, dtype=np.int64) * (a - n)) // (c - e)
            send[e:] = recv[e:]
        frame_src[:b] = idx
        frame_src[b:] = d.n_frames
        return bucket, row


@dataclass
class _Capacity:
    """Static inputs of one padded capacity and, in CUDA-graph mode, its captured step."""

    bucket: Bucket
    flat: torch.Tensor
    bounds: torch.Tensor
    steps: int = 0
    warm: int = 0
    graph: object = None  # torch.cuda.CUDAGraph, or False after a failed capture
    out: torch.Tensor | None = None


# Eager steps of a capacity before its capture: lazy initialisation (cuBLAS handles, Triton JIT, optimiser
# state) must not happen during capture.
_WARMUP_STEPS = 2
# Pinned staging slots for the per-step index rows; waiting on a slot's previous copy also bounds how many
# steps the host runs ahead of the GPU.
_RING = 8


class _StaticStep:
    """Padded static-shape step (eager, or captured per capacity as a CUDA graph); see the module docstring."""

    def __init__(
        self,
        model: StudentModel,
        data: FrameDataset,
        cfg: TrainConfig,
        opt,
        ema: _EMA | None,
        mode: str,
        log: Callable[[str], None],
    ) -> None:
        self.model, self.cfg, self.opt, self.ema, self.mode, self.log = model, cfg, opt, ema, mode, log
        self.device, self.dtype = data.device, data.dtype
        if cfg.hvp_weight > 0 and not data.has_hvp:
            raise ValueError("hvp_weight > 0 needs frames labelled with Hessian-vector products (sampling hvp: true)")
        self.data = _StaticData(data, model.species_list[0], model.cutoff)
        self.batcher = _StaticBatcher(self.data, cfg.batch_size, cfg.bucket_growth)
        self.csr: dict = {"row_ptr": None}
        self.view = _csr_view(model, self.csr)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.capacities: dict[Bucket, _Capacity] = {}
        self.ema_weight = torch.zeros((), dtype=self.dtype, device=self.device)
        self._ema_value: float | None = None
        self._lr_value: float | None = None
        self.lr_tensor = opt.param_groups[0]["lr"] if isinstance(opt.param_groups[0]["lr"], torch.Tensor) else None
        self.bad = torch.zeros((), dtype=torch.bool, device=self.device)
        self._last_out: torch.Tensor | None = None
        self.captures, self.capture_seconds = 0, 0.0
        self._pinned = self.device.type == "cuda"
        self._ring: list[torch.Tensor | None] = [None] * _RING
        self._events = [torch.cuda.Event() for _ in range(_RING)] if self._pinned else []
        self._used = [False] * _RING
        self._k = 0
        self.ready: tuple[float, int] | None = None

    # -------------------------------------------------------------------------------------- host side
    def _set_lr(self, lr: float | None) -> None:
        if lr is None:  # plateau scheduler: it sets the groups' lr; keep the device tensor in step
            if self.lr_tensor is not None:
                for g in self.opt.param_groups:
                    if g["lr"] is not self.lr_tensor:
                        value = float(g["lr"])
                        g["lr"] = self.lr_tensor
                        self._lr_value = None
                        lr = value
            if lr is None:
                return
        if lr == self._lr_value:
            return
        self._lr_value = lr
        if self.lr_tensor is not None:
            self.lr_tensor.fill_(lr)
        else:
            for g in self.opt.param_groups:
                g["lr"] = lr

    def _upload(self, cap: _Capacity, row: np.ndarray) -> None:
        src = torch.from_numpy(row)
        if not self._pinned:
            cap.flat.copy_(src)
            return
        k = self._k % _RING
        self._k += 1
        if self._used[k]:
            self._events[k].synchronize()  # the copy that last read this slot has finished
        buf = self._ring[k]
        if buf is None or buf.numel() < row.size:
            buf = self._ring[k] = torch.empty(row.size, dtype=torch.long, pin_memory=True)
        buf[: row.size].copy_(src)
        cap.flat.copy_(buf[: row.size], non_blocking=True)
        self._events[k].record()
        self._used[k] = True

    def _capacity(self, bucket: Bucket) -> _Capacity:
        cap = self.capacities.get(bucket)
        if cap is None:
            length = 2 * bucket.atoms + 3 * bucket.edges + self.batcher.structures
            cap = _Capacity(
                bucket=bucket,
                flat=torch.zeros(length, dtype=torch.long, device=self.device),
                bounds=torch.arange(bucket.atoms + 1, dtype=torch.long, device=self.device),
            )
            self.capacities[bucket] = cap
        return cap

    def step(self, idx: Sequence[int], step: int, lr: float | None) -> None:
        self._set_lr(lr)
        if self.ema is not None:
            # Same decay warm-up as _EMA.update, as a device scalar the (captured) step reads.
            d = min(self.ema.decay, (2 + step) / (11 + step))
            if d != self._ema_value:
                self._ema_value = d
                self.ema_weight.fill_(1 - d)
        bucket, row = self.batcher.plan(idx)
        cap = self._capacity(bucket)
        self._upload(cap, row)
        state = (cap.steps, cap.warm, cap.graph)
        self._last_out = self._run(cap)
        cap.steps += 1
        if state[0] == 0 or (cap.warm, cap.graph) != state[1:]:
            # The first step of a capacity, a warm-up or a capture (one-off costs): restart the steady clock.
            self.ready = (time.perf_counter(), step + 1)

    def _run(self, cap: _Capacity) -> torch.Tensor:
        if self.mode != "cudagraph" or cap.graph is False:
            return self._body(cap)
        if cap.graph is None and cap.warm < _WARMUP_STEPS:
            t0 = time.perf_counter()
            cap.warm += 1
            current = torch.cuda.current_stream(self.device)
            side = torch.cuda.Stream(device=self.device)
            side.wait_stream(current)
            with torch.cuda.stream(side):
                out = self._body(cap)
            current.wait_stream(side)
            torch.cuda.synchronize(self.device)
            self.capture_seconds += time.perf_counter() - t0
            return out
        if cap.graph is None:
            t0 = time.perf_counter()
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph):
                    cap.out = self._body(cap)
            except Exception as exc:  # any capture failure: run this capacity eagerly
                torch.cuda.synchronize(self.device)
                self.log(f"CUDA graph capture of {cap.bucket} failed ({type(exc).__name__}: {exc}); running it eagerly")
                cap.graph, cap.out = False, None
                self.capture_seconds += time.perf_counter() - t0
                return self._body(cap)
            cap.graph = graph
            self.captures += 1
            self.capture_seconds += time.perf_counter() - t0
            self.log(f"captured the training step of {cap.bucket} as a CUDA graph ({time.perf_counter() - t0:.2f} s)")
        cap.graph.replay()
        return cap.out

    # ------------------------------------------------------------------------------------ device side
    def _body(self, cap: _Capacity) -> torch.Tensor:
        """One optimiser step on the indices in ``cap.flat``; no host sync (capturable)."""
        cfg, d = self.cfg, self.data
        a, c, s = cap.bucket.atoms, cap.bucket.edges, self.batcher.structures
        f = cap.flat
        atom_src, batch = f[:a], f[a : 2 * a]
        # A fresh edge tensor every step: the kernels cache sender CSRs per edge tensor.
        edge_index = f[2 * a : 2 * a + 2 * c].view(2, c).clone()
        edge_src, frame_src = f[2 * a + 2 * c : 2 * a + 3 * c], f[2 * a + 3 * c :]
        self.csr["row_ptr"] = torch.searchsorted(edge_index[0], cap.bounds)
        numbers = d.numbers[atom_src]
        shift_vectors = d.shift_vectors[edge_src]
        amask = (atom_src < d.n_atoms).to(self.dtype)
        smask = (frame_src < d.n_frames).to(self.dtype)

        def energy_forces(pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            pos = pos.detach().requires_grad_(True)
            energy = self.view(numbers, pos, edge_index, shift_vectors, batch, s)["energy"]
            (grad,) = torch.autograd.grad((energy * smask).sum(), pos, create_graph=True)
            return energy, -grad

        with torch.enable_grad():
            positions = d.positions[atom_src]
            energy, forces = energy_forces(positions)
            e_err = (energy - d.energy[frame_src]) / d.counts[frame_src]
            e_loss = (e_err.square() * smask).sum() / smask.sum()
            n3 = 3 * amask.sum()
            f_loss = ((forces - d.forces[atom_src]).square().sum(1) * amask).sum() / n3
            loss = cfg.energy_weight * e_loss + cfg.force_weight * f_loss
            parts = [e_loss, f_loss]
            if cfg.hvp_weight > 0:
                v, eps = d.hvp_dir[atom_src], cfg.hvp_eps
                f_plus = energy_forces(positions + eps * v)[1]
                f_minus = energy_forces(positions - eps * v)[1]
                hv = -(f_plus - f_minus) / (2 * eps)
                h_loss = ((hv - d.hvp[atom_src]).square().sum(1) * amask).sum() / n3
                loss = loss + cfg.hvp_weight * h_loss
                parts.append(h_loss)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip)
        self.opt.step()
        with torch.no_grad():
            if self.ema is not None:
                diff = torch._foreach_sub([p.detach() for p in self.params], self.ema.shadow)
                torch._foreach_mul_(diff, self.ema_weight)
                torch._foreach_add_(self.ema.shadow, diff)
            self.bad |= ~torch.isfinite(loss.detach())
            return torch.stack([loss.detach(), *(p.detach() for p in parts)])

    def last(self) -> tuple[float, dict]:
        if self._last_out is None:
            return math.nan, {}
        values = self._last_out.tolist()
        names = ["energy", "forces"] + (["hvp"] if self.cfg.hvp_weight > 0 else [])
        parts = dict(zip(names, values[1:], strict=True))
        if bool(self.bad) or not math.isfinite(values[0]):
            raise FloatingPointError(f"non-finite training loss ({parts}); lower lr or check the labels")
        return values[0], parts

    def finish(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _optimizer(model: StudentModel, cfg: TrainConfig, mode: str, device: torch.device, dtype) -> torch.optim.AdamW:
    if mode == "cudagraph":
        # A device learning rate the captured step reads; capturable keeps the step counts on the device.
        lr = torch.tensor(cfg.lr, dtype=dtype, device=device)
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=cfg.weight_decay, capturable=True)
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)


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
                step = st["step"].to(torch.float32)
                st["step"] = step.to(p.device) if group["capturable"] else step.cpu()


def _optimizer_state(opt: torch.optim.AdamW) -> dict:
    """``opt.state_dict()`` with plain-float learning rates (loadable whatever the step mode)."""
    sd = opt.state_dict()
    sd["param_groups"] = [
        {**g, "lr": float(g["lr"])} if isinstance(g["lr"], torch.Tensor) else g for g in sd["param_groups"]
    ]
    return sd


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

    opt = _optimizer(model, cfg, mode, device, dtype)
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
        return {**(metadata or {}), "val": metrics, "step": step, "train_config": _plain(cfg)}

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
            if step % eval_every == 0 or (last_epoch_step and cfg.eval_every == 0) or time_up:
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
                        },
                        state_path,
                    )
                eval_spans.append((t_eval, time.perf_counter()))
                if cfg.patience and bad >= cfg.patience:
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
    )


def _silent(msg: str) -> None:
    """The log of ranks other than 0 in a torchrun job."""


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
