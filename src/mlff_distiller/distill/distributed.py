"""Data-parallel training over several processes (``torchrun``): one process per GPU, each with a shard of every
global batch; :class:`torch.nn.parallel.DistributedDataParallel` averages the gradients.

Launch::

    torchrun --nproc_per_node 2 -m mlff_distiller.cli train --config train.yaml

``torchrun`` sets ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``; without them everything here is a no-op and
training runs in one process as usual. Rules the trainer follows (see ``training.train``):

* every rank draws the same epoch order (same seed) and takes ``global_batch[rank::world_size]``, so the global
  batch size stays ``batch_size`` and the averaged gradient is that of the whole batch (exactly so when the
  shards have equal sizes); a final global batch with fewer frames than ranks is skipped;
* force training differentiates the energy with respect to the positions (``create_graph=True``) inside the
  step: that ``autograd.grad`` runs no parameter ``AccumulateGrad`` node, so DDP's hooks fire once, in
  ``loss.backward()``;
* decisions that end or shape the run (time limit, early stopping, learning-rate plateau) are taken on rank 0
  and broadcast; only rank 0 writes checkpoints, history and logs.

Backends: NCCL on CUDA (``LOCAL_RANK`` picks the GPU), gloo on the CPU (what the tests use).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mlff_distiller.devices import resolve_device

__all__ = ["DistInfo", "dist_info", "setup", "shard", "teardown"]


@dataclass(frozen=True)
class DistInfo:
    """This process's place in the job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def broadcast_flag(self, flag: bool, device: torch.device) -> bool:
        """Rank 0's ``flag`` on every rank."""
        if not self.enabled:
            return bool(flag)
        t = torch.tensor([1 if flag else 0], dtype=torch.int64, device=device)
        dist.broadcast(t, src=0)
        return bool(t.item())

    def broadcast_object(self, obj):
        """Rank 0's (picklable) ``obj`` on every rank."""
        if not self.enabled:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def mean(self, value: float, device: torch.device) -> float:
        """The mean of ``value`` over ranks."""
        if not self.enabled:
            return float(value)
        t = torch.tensor([float(value)], dtype=torch.float64, device=device)
        dist.all_reduce(t)
        return float(t.item()) / self.world_size

    def wrap(self, model: torch.nn.Module, device: torch.device, *, find_unused: bool = False) -> torch.nn.Module:
        """The module to call for the training forward (once per step): ``model`` itself, or a DDP wrapper.

        ``find_unused``: some parameters get no gradient from the loss, e.g. the readout bias in force-only
        training (forces do not see a constant energy shift); DDP must then look for them every step.
        """
        if not self.enabled:
            return model
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(
            model, device_ids=ids, output_device=device.index if ids else None, find_unused_parameters=find_unused
        )


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {value!r}") from None


def dist_info() -> DistInfo:
    """Rank, world size and local rank from ``torchrun``'s environment (one process when unset)."""
    world = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    local = _env_int("LOCAL_RANK", rank)
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"inconsistent torchrun environment: RANK={rank}, WORLD_SIZE={world}")
    return DistInfo(rank=rank, world_size=world, local_rank=local)


def setup(device: str | torch.device = "auto") -> tuple[DistInfo, torch.device]:
    """Join the process group when launched by ``torchrun`` and choose this rank's device.

    ``device``: ``"auto"`` (CUDA when available), ``"cuda"`` or ``"cpu"``. In a multi-process CUDA job each rank
    takes GPU ``LOCAL_RANK``; asking for more ranks than GPUs is an error.
    """
    info = dist_info()
    dev = resolve_device(device)  # a ValueError for an unknown or unavailable device
    if dev.type == "cuda":
        if info.enabled:
            if info.local_rank >= torch.cuda.device_count():
                raise ValueError(
                    f"LOCAL_RANK {info.local_rank} but only {torch.cuda.device_count()} GPU(s): "
                    "start at most one process per GPU"
                )
            dev = torch.device("cuda", info.local_rank)
        if dev.index is not None:
            torch.cuda.set_device(dev)
    if info.enabled and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo")
    return info, dev


def shard(indices: list[int], info: DistInfo) -> list[int]:
    """This rank's part of a global batch (``indices[rank::world_size]``)."""
    return indices[info.rank :: info.world_size] if info.enabled else indices


def teardown(info: DistInfo) -> None:
    """Leave the process group (after the last collective)."""
    if info.enabled and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
