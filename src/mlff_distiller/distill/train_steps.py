"""The optimiser step of training, in three implementations with the same math (``TrainConfig.train_step``).

Every implementation takes the frame indices of one batch and the learning rate of the step, and updates the
model, the optimiser and the EMA in place; ``last()`` reads the loss of the latest step back (a sync).

* ``plain`` (``_PlainStep``): the batch as it comes (variable shapes), loss parts read back to the host every
  step.
* ``static`` (``_StaticStep``): every batch is padded to the next capacity of a geometric ladder
  (:mod:`mlff_distiller.buckets`): one trailing inert row is appended to the dataset's atoms, frames and edges,
  padding atoms point at it and belong to a dummy structure whose energy is masked out of the loss, and padding
  edges are self-loops of padding atoms with a shift longer than the cutoff, so every padding message, force
  and gradient is exactly 0. The host only writes integer gather indices (``_StaticBatcher`` in
  :mod:`mlff_distiller.distill.static_batch`); the gathers, the model, the forces (``create_graph=True``), the
  masked loss, the backward, gradient clipping, the AdamW step and the EMA update all run on the device without
  a host sync. Loss values are read back only at validations.
* ``cudagraph`` (``_StaticStep`` too): the static step of each capacity captured once as a CUDA graph (after
  two eager warm-up steps) and replayed: one launch per step instead of hundreds, with AdamW
  ``capturable=True`` (learning rate a device tensor) and the EMA inside the graph. A capture that fails falls
  back to the eager static step for that capacity.

A non-finite loss raises ``FloatingPointError``: at once in ``plain``, at the next validation otherwise.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from mlff_distiller import kernels
from mlff_distiller.buckets import Bucket
from mlff_distiller.cudagraph import capturing
from mlff_distiller.distill.dataset import FrameDataset
from mlff_distiller.distill.objective import (
    _NO_HVP_LABELS,
    _NO_STRESS_LABELS,
    _central_hvp,
    _loss,
    _weighted_mean,
    residual_loss,
)
from mlff_distiller.distill.optim import _EMA
from mlff_distiller.distill.static_batch import _StaticBatcher, _StaticData
from mlff_distiller.engine_padded import _VOIGT, edge_virial
from mlff_distiller.model import StudentModel
from mlff_distiller.model.painn import CSRInteraction

if TYPE_CHECKING:
    from mlff_distiller.distill.training import TrainConfig


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
            raise ValueError(_NO_HVP_LABELS)
        if cfg.stress_weight > 0 and not data.has_stress:
            raise ValueError(_NO_STRESS_LABELS)
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
            # The decay _EMA.update would use after this step, as a device scalar the (captured) step reads.
            d = self.ema.decay_at(step + 1)
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
        if cap.steps == 0 and self.device.type == "cuda":
            # A capacity's first step: its Triton kernels compile in parallel first, in a dry run of the loss and
            # its backward (kernels/_compile_ahead.py; ~27 s of one-by-one compiles in a cold process otherwise).
            t0 = time.perf_counter()
            if kernels.precompile(self._dry_backward, cap, device=self.device, for_capture=self.mode == "cudagraph"):
                self.opt.zero_grad(set_to_none=True)
            self.capture_seconds += time.perf_counter() - t0
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
                with capturing(graph, mode="global"):
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
        with torch.enable_grad():
            loss, parts = self._batch_loss(cap)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
        if self.cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        self.opt.step()
        with torch.no_grad():
            if self.ema is not None:
                diff = torch._foreach_sub([p.detach() for p in self.params], self.ema.shadow)
                torch._foreach_mul_(diff, self.ema_weight)
                torch._foreach_add_(self.ema.shadow, diff)
            self.bad |= ~torch.isfinite(loss.detach())
            return torch.stack([loss.detach(), *(p.detach() for p in parts)])

    def _dry_backward(self, cap: _Capacity) -> None:
        """The loss and its backward, for :func:`kernels.precompile`: what of the step launches Triton kernels (the
        optimiser and the EMA are torch ops). Leaves garbage gradients; the caller drops them."""
        with torch.enable_grad():
            loss, _ = self._batch_loss(cap)
            loss.backward()

    def _batch_loss(self, cap: _Capacity) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The batch's loss and its parts, with the graph for the backward (called under ``enable_grad``)."""
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
        smask = (frame_src < d.n_frames).to(self.dtype)
        # The frames' loss weights (0 on padding), read from the dataset's buffer by index like the labels: a
        # captured step sees each batch's weights.
        weight = d.weight[frame_src]
        atom_weight = weight[batch]
        count = cfg.weight_norm == "count"  # the real frames and atoms count, the padding does not
        frames, atoms = (smask, smask[batch]) if count else (None, None)

        stress = cfg.stress_weight > 0
        virial = None

        def energy_forces(pos: torch.Tensor, with_virial: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
            nonlocal virial
            pos = pos.detach().requires_grad_(True)
            shifts = shift_vectors.detach().requires_grad_(with_virial)
            energy = self.view(numbers, pos, edge_index, shifts, batch, s)["energy"]
            inputs = (pos, shifts) if with_virial else (pos,)
            grads = torch.autograd.grad((energy * smask).sum(), inputs, create_graph=True)
            if with_virial:  # dE/dε per structure slot from the pairs' gradient (as the plain step)
                virial = edge_virial(pos, shifts, grads[1], edge_index, batch, s)
            return energy, -grads[0]

        with torch.enable_grad():
            positions = d.positions[atom_src]
            energy, forces = energy_forces(positions, with_virial=stress)
            e_err = (energy - d.energy[frame_src]) / d.counts[frame_src]
            e_loss = _weighted_mean(residual_loss(e_err, cfg), weight, frames)
            f_loss = _weighted_mean(residual_loss(forces - d.forces[atom_src], cfg), atom_weight, atoms)
            loss = cfg.energy_weight * e_loss + cfg.force_weight * f_loss
            parts = [e_loss, f_loss]
            if stress:
                # ((σ - σ_t) V / n)² over the 6 components, mean over the labelled frames (objective._stress_loss):
                # σ V = dE/dε, so the student side is the strain derivative per atom.
                pred = torch.stack([virial[:, i, j] for i, j in _VOIGT], dim=1) / d.counts[frame_src][:, None]
                sq = (pred - d.virial[frame_src]).square().mean(dim=1)
                labelled = d.stress_mask[frame_src]  # (0 on padding)
                s_loss = _weighted_mean(sq, labelled * weight, labelled if count else None)
                loss = loss + cfg.stress_weight * s_loss
                parts.append(s_loss)
            if cfg.hvp_weight > 0:
                hv = _central_hvp(lambda x: energy_forces(x)[1], positions, d.hvp_dir[atom_src], cfg.hvp_eps)
                h_loss = _weighted_mean((hv - d.hvp[atom_src]).square(), atom_weight, atoms)
                loss = loss + cfg.hvp_weight * h_loss
                parts.append(h_loss)
        return loss, parts

    def last(self) -> tuple[float, dict]:
        if self._last_out is None:
            return math.nan, {}
        values = self._last_out.tolist()
        names = ["energy", "forces"] + (["stress"] if self.cfg.stress_weight > 0 else [])
        names += ["hvp"] if self.cfg.hvp_weight > 0 else []
        parts = dict(zip(names, values[1:], strict=True))
        if bool(self.bad) or not math.isfinite(values[0]):
            raise FloatingPointError(f"non-finite training loss ({parts}); lower lr or check the labels")
        return values[0], parts

    def finish(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
