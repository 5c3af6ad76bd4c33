"""ASE's FIRE for many structures at once, on the device (:func:`~mlff_distiller.batched_relax.relax_batch`'s
optimizer): per structure its own velocity, time step, mixing factor and counters, every update in place so that a
CUDA graph can replay it, and the state gathered (:meth:`_Fire.subset`) or joined (:meth:`_Fire.merge`) when
structures leave or join the batch."""

from __future__ import annotations

import torch

from mlff_distiller.batch import AtomsBatch

__all__ = ["_Fire"]


class _Fire:
    """ASE's FIRE for many structures at once, on the device, every update in place (so that a CUDA graph can
    replay it): per structure its velocity, time step, mixing factor and steps since the power went negative.

    :meth:`step` judges the forces in :attr:`forces` (a structure whose forces are not finite fails and stops where
    it is; its NaNs are zeroed so that they cannot reach the others' arithmetic; one whose largest force is below
    ``fmax`` has converged and stays so; one that took ``steps`` steps stops) and moves the rest, each from its own
    first step (which, as ASE's, only accelerates from rest). On CUDA the step is one captured graph (~40 small
    kernels otherwise, whose launches cost more than the student's step for a few hundred structures).
    """

    def __init__(self, batch, *, steps, fmax, dt, maxstep, dtmax, n_min, finc, fdec, astart, fa) -> None:
        b, n, dev = batch.num_structures, batch.num_atoms, batch.positions.device
        f64 = {"dtype": torch.float64, "device": dev}
        self.b, self.owner, self.positions = b, batch.batch, batch.positions
        self.max_steps, self.dt0 = int(steps), float(dt)
        self.maxstep, self.dtmax, self.n_min, self.finc, self.fdec, self.astart, self.fa = (
            maxstep, dtmax, n_min, finc, fdec, astart, fa
        )  # fmt: skip
        self.fmax2 = fmax * fmax
        self.forces = torch.zeros((n, 3), **f64)
        self.vel = torch.zeros((n, 3), **f64)
        self.step_dt = torch.full((b,), float(dt), **f64)
        self.mix = torch.full((b,), float(astart), **f64)
        self.since_negative = torch.zeros(b, dtype=torch.long, device=dev)
        self.taken = torch.zeros(b, dtype=torch.long, device=dev)
        self.converged = torch.zeros(b, dtype=torch.bool, device=dev)
        self.failed = torch.zeros(b, dtype=torch.bool, device=dev)
        self.done = torch.zeros(b, dtype=torch.bool, device=dev)
        self._graph = None
        from mlff_distiller.cudagraph import cuda_graphs_available

        self._capture = cuda_graphs_available(dev)

    _PER_STRUCTURE = ("step_dt", "mix", "since_negative", "taken", "converged", "failed", "done")

    def _with(self, batch: AtomsBatch, forces, vel, **per_structure) -> _Fire:
        new = object.__new__(_Fire)
        new.__dict__.update(self.__dict__)
        new.b, new.owner, new.positions = batch.num_structures, batch.batch, batch.positions
        new.forces, new.vel = forces, vel
        for name, value in per_structure.items():
            setattr(new, name, value)
        new._graph = None  # its own captured step follows
        return new

    def subset(self, keep: torch.Tensor, batch: AtomsBatch) -> _Fire:
        """The state of the structures ``keep`` (``[B]`` bool) alone, moving ``batch``'s positions (the batch
        :func:`_subset` made of them)."""
        atoms = keep.index_select(0, self.owner)
        rows = {name: getattr(self, name)[keep] for name in self._PER_STRUCTURE}
        return self._with(batch, self.forces[atoms], self.vel[atoms], **rows)

    def merge(self, other: _Fire, batch: AtomsBatch) -> _Fire:
        """This state, then ``other``'s, moving ``batch``'s positions (the batch :func:`_concat` made of theirs)."""
        rows = {name: torch.cat([getattr(self, name), getattr(other, name)]) for name in self._PER_STRUCTURE}
        return self._with(batch, torch.cat([self.forces, other.forces]), torch.cat([self.vel, other.vel]), **rows)

    def _per_structure(self, x: torch.Tensor) -> torch.Tensor:  # Σ over each structure's atoms of a per-atom value
        return torch.zeros(self.b, dtype=torch.float64, device=x.device).index_add_(0, self.owner, x)

    def judge(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Failed and converged structures from :attr:`forces`; returns the forces (non-finite rows zeroed) and
        each atom's |F|²."""
        forces = self.forces
        bad_atoms = ~torch.isfinite(forces).all(dim=1)
        self.failed.logical_or_(self._per_structure(bad_atoms.to(torch.float64)) > 0)
        forces = torch.where(bad_atoms.unsqueeze(1), 0.0, forces)
        f2 = (forces * forces).sum(dim=1)
        worst = torch.zeros(self.b, dtype=torch.float64, device=f2.device)
        worst.scatter_reduce_(0, self.owner, f2, reduce="amax", include_self=True)
        self.converged.logical_or_((worst < self.fmax2) & ~self.failed)  # converged stays done (ASE stops there)
        torch.logical_or(self.converged, self.failed, out=self.done)
        self.done.logical_or_(self.taken >= self.max_steps)  # ASE's run(steps=...): judged, then no further step
        return forces, f2

    def _step(self) -> None:
        forces, f2 = self.judge()
        owner, vel = self.owner, self.vel
        moving = ~self.done
        started = moving & (self.taken > 0)  # ASE's first step (from rest) mixes nothing: only the others here
        vf = self._per_structure((forces * vel).sum(dim=1))
        g2 = self._per_structure(f2)
        v2 = self._per_structure((vel * vel).sum(dim=1))
        uphill = (vf <= 0.0) & started
        downhill = (vf > 0.0) & started
        mix, step_dt, since = self.mix, self.step_dt, self.since_negative
        scale = torch.where(downhill, mix * torch.sqrt(v2) / torch.sqrt(torch.where(downhill, g2, 1.0)), 0.0)
        keep = torch.where(downhill, 1.0 - mix, torch.where(uphill, 0.0, 1.0))
        vel.mul_(keep[owner].unsqueeze(1)).add_(forces * scale[owner].unsqueeze(1))
        grow = downhill & (since > self.n_min)
        step_dt.copy_(torch.where(grow, torch.clamp(step_dt * self.finc, max=self.dtmax), step_dt))
        mix.copy_(torch.where(grow, mix * self.fa, mix))
        since.copy_(torch.where(downhill, since + 1, since))
        mix.copy_(torch.where(uphill, self.astart, mix))
        step_dt.copy_(torch.where(uphill, step_dt * self.fdec, step_dt))
        since.copy_(torch.where(uphill, 0, since))
        atom_dt = self.step_dt[owner].unsqueeze(1)
        vel.copy_(torch.where(moving[owner].unsqueeze(1), vel + atom_dt * forces, vel))
        dr = atom_dt * vel
        norm = torch.sqrt(self._per_structure((dr * dr).sum(dim=1)))
        shrink = torch.where(norm > self.maxstep, self.maxstep / torch.where(norm > 0, norm, 1.0), 1.0)
        self.positions.add_(dr * torch.where(moving, shrink, 0.0)[owner].unsqueeze(1))
        self.taken.add_(moving.long())

    def step(self) -> None:
        """Judge :attr:`forces` and move the structures still going (see the class docstring)."""
        if not self._capture:
            self._step()
            return
        if self._graph is None:
            self._graph = self._captured()
        self._graph.replay()

    def _captured(self):
        """The step as a CUDA graph; the state is restored after the warm-up run that precedes it."""
        from mlff_distiller.cudagraph import capturing

        state = [self.positions, self.vel, self.step_dt, self.mix, self.since_negative, self.taken]
        state += [self.converged, self.failed, self.done]
        saved = [t.clone() for t in state]
        side = torch.cuda.Stream(device=self.positions.device)
        side.wait_stream(torch.cuda.current_stream(self.positions.device))
        with torch.cuda.stream(side):
            self._step()
        torch.cuda.current_stream(self.positions.device).wait_stream(side)
        for t, old in zip(state, saved, strict=True):
            t.copy_(old)
        graph = torch.cuda.CUDAGraph()
        with capturing(graph, mode="thread_local"):
            self._step()
        for t, old in zip(state, saved, strict=True):  # the capture ran nothing; the replay below takes the step
            t.copy_(old)
        return graph
