"""Many independent MD trajectories advanced together: one engine call per step for all of them.

One small molecule under ASE's integrator runs at the pace of one CUDA-graph replay plus ASE's host work per step
(0.3-0.5 ms on an H100), which leaves a GPU idle: the same replay holds a thousand molecules for a few times that.
:class:`BatchedMD` keeps every trajectory's state on the device (positions and momenta in float64) and advances all
of them with one :meth:`ForceEngine.compute <mlff_distiller.engine.ForceEngine.compute>` per step on a Verlet-skin
list (the engine's padded path: a CUDA graph per bucket on a GPU). The replicas may be copies of one
structure (independent samples of one molecule) or different structures of any sizes.

Integrators (``ensemble``):

* ``"nve"``: velocity Verlet, the same update as ASE's ``VelocityVerlet`` (``p += F dt/2; r += p/m dt; F(r);
  p += F dt/2``);
* ``"langevin"``: BAOAB (Leimkuhler & Matthews, Appl. Math. Res. Express 2013; OpenMM's
  ``LangevinMiddleIntegrator``): half kick, half drift, the exact Ornstein-Uhlenbeck update of the momenta
  ``p ← c p + sqrt((1 - c²) m kT) ξ`` with ``c = exp(-γ dt)``, half drift, forces, half kick. One force call per
  step, and its configurational sampling is accurate to second order in ``dt``. Not ASE's ``Langevin`` scheme: the
  two sample the same distribution, not the same paths.

``fix_com`` (default: the molecules, as ``mlff-distill md`` puts ASE's ``FixCom`` on a molecule) removes each such
structure's centre-of-mass momentum at the start and after each thermostat kick, and its temperature counts
``3N - 3`` degrees of freedom (as ASE's ``get_temperature`` with ``FixCom``).

Why not an ASE dynamics object per replica, or ASE's integrators on one ``Atoms`` holding all replicas: the first is
one engine call per replica and step; the second makes the replicas one structure to the engine, with one neighbour
list, one energy, and one temperature. TorchSim (Radical AI) takes the same batched approach for its models.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from mlff_distiller import batch as batch_module
from mlff_distiller import domain as _domain
from mlff_distiller.batch import AtomsBatch
from mlff_distiller.batching import NonFiniteOutputError, recompute_before_retry
from mlff_distiller.buckets import BucketLadder
from mlff_distiller.calculator import DOMAIN_CHECK_EVERY
from mlff_distiller.domain import DomainEnvelope, OutOfDomainWarning
from mlff_distiller.engine import ForceEngine
from mlff_distiller.frames import FrameTable
from mlff_distiller.model import StudentModel

__all__ = ["BatchedMD", "batch_engine"]


ENSEMBLES = ("langevin", "nve")


# The largest CUDA-graph bucket of a BatchedMD engine in mode "auto" (the engine's own default, auto_max_edges: 2^19
# edges until stop 51, 2^21 since stop 52 for students up to 128 wide and fewer for wider ones, is for one-off graphs
# too). A trajectory repeats its shape for thousands of steps, and an eager step of a large batch is bound by its
# host launches: 4,096 benzenes (≈ 540,000 edges with the skin) 17.6 ms a step eagerly, 12.5 ms captured (1.41x);
# 8,192 g2 molecules (captured either way) 1.005x; a 24,000-atom water box, whose step the device bounds, 1.009x
# (H200, fp32, the shipped student, both alternating in one process; benchmarks/results/stop42_gpu/
# probe_large_capture.md).
MD_MAX_EDGES = 2**21

# How often (in steps) a float32 or lower-precision BatchedMD looks again whether its coordinates reach
# batch.PRECISE_PAIRS_FROM (one device sync; also at every observation of run()). Periodic replicas are not wrapped
# and molecules without fix_com drift, so a run that started below the threshold may cross it: from then on the
# engine makes the pair vectors from the float64 state (AtomsBatch.positions64), as for a run that started there.
# float32's pair-vector error grows with the coordinates (~1e-5 of the largest force at 100-400 Å, 0.016 eV/Å at
# 10,000 Å), so a check every 100 steps is within what one step of drift adds.
PRECISE_CHECK_EVERY = 100


def batch_engine(
    model: StudentModel, molecular: bool, *, device, precision: str, mode: str, skin: float, fixed_shape: bool = False
):
    """The engine of a batch whose positions live on the device and move a little every call (BatchedMD,
    :func:`~mlff_distiller.batched_relax.relax_batch`): a Verlet-skin list; molecules (``molecular``: no structure
    is periodic) stay in their order (each is
    contiguous already, and an eager engine would sort a batch of 10,000 atoms or more spatially and run every step
    eagerly: 4,096 g2 molecules took 12.6 ms a step so, the engine call 9.9 ms, on an H100,
    benchmarks/results/batched_md_h100/). ``fixed_shape`` (BatchedMD: the same batch every step) with mode
    ``"auto"``: CUDA-graph buckets up to ``MD_MAX_EDGES`` edges, and a capture that runs out of GPU memory leaves
    its bucket's step eager (``ForceEngine.oom_eager``: the batch cannot be split). A relaxation's batch shrinks as
    structures converge, and each size would be a capture of its own, so it keeps the engine's default."""
    ladder = {"buckets": BucketLadder(max_edges=MD_MAX_EDGES)} if fixed_shape and mode == "auto" else {}
    engine = ForceEngine(
        model,
        device=device,
        precision=precision,
        mode=mode,
        neighbor_skin=skin,
        **ladder,
        **({"spatial_sort_min_atoms": None} if molecular else {}),
    )
    # The same batch every step cannot be split: a capture out of memory leaves its bucket's step eager.
    engine.oom_eager = fixed_shape
    return engine


class BatchedMD:
    """Advance many independent trajectories together, one batched energy + forces call per step.

    Args:
        model: a :class:`~mlff_distiller.model.StudentModel`, a checkpoint path or ``"builtin:NAME"``.
        structures: ``ase.Atoms`` (one replica each; sizes may differ). Not modified: :meth:`get_atoms` returns
            the current states.
        ensemble: ``"langevin"`` (BAOAB) or ``"nve"`` (velocity Verlet).
        timestep_fs: time step, fs.
        temperature_K: Langevin bath temperature, and the Maxwell-Boltzmann draw of ``velocities="maxwell"``: one
            for all replicas, or one per replica (tempering, annealing: :meth:`set_temperature` changes them between
            runs).
        friction_per_fs: Langevin friction γ, 1/fs.
        velocities: ``"maxwell"`` (drawn at ``temperature_K`` per replica from ``seed``, as
            :func:`~mlff_distiller.ase_compat.maxwell_boltzmann`, replica after replica) or ``"input"`` (each
            structure's own momenta).
        seed: seeds the velocity draw (NumPy) and the Langevin noise (a torch generator on the device).
        fix_com: remove each structure's centre-of-mass momentum (see the module docstring). ``None``: the
            non-periodic structures and those carrying ASE's ``FixCom``. Any other ASE constraint is refused (a
            ``ValueError``): BatchedMD would not apply it.
        device, precision, mode: of the :class:`~mlff_distiller.engine.ForceEngine` (``precision`` is the model's
            arithmetic; the trajectories' state is float64 either way).
        skin: Verlet skin, Å (the list is rebuilt once any atom of any replica moved more than ``skin / 2``).
        cuda_graphs: on a CUDA device, replay the integrator's two halves as CUDA graphs (``False``: launch their
            kernels one by one; the same arithmetic).
        check_domain: with a student that stores its training envelope (:mod:`mlff_distiller.domain`), check every
            replica against it at the start and every ``check_domain`` steps, as
            :class:`~mlff_distiller.StudentCalculator` does; replicas found outside that were not before warn with
            an :class:`~mlff_distiller.domain.OutOfDomainWarning` naming them. The same checks name the replicas
            in which an atom felt a force component above :data:`~mlff_distiller.domain.FORCE_LIMIT` at any step (a
            runaway trajectory whose numbers all stay finite; it stays named in ``domain_findings`` from then on),
            with or without an envelope. ``None``: no checks.
        freeze_force: freeze a replica once an atom of it feels a force component above this (eV/Å), or a
            non-finite one: its momenta are zeroed and it stays where it was while the others go on (a blown-up
            trajectory cannot stop the run or fill the neighbour list with atoms flying off). Frozen replicas are
            named in :attr:`frozen`, in ``info["frozen"]`` of :meth:`get_atoms` and by the domain checks. ``None``
            (default): no freezing; a replica whose state stops being finite stops the run with a
            :class:`~mlff_distiller.batching.NonFiniteOutputError`.

    Attributes:
        engine: the :class:`~mlff_distiller.engine.ForceEngine` (``engine.verlet.n_builds``: the list's builds).
        nsteps: steps taken; ``time_fs``: the run's clock. ``bath_temperatures``: ``[B]`` K (Langevin).
        domain_findings: ``{replica: findings}`` of the last domain check (the replicas outside the envelope).
    """

    def __init__(
        self,
        model: StudentModel | str | Path,
        structures: Sequence,
        *,
        ensemble: str = "langevin",
        timestep_fs: float = 0.5,
        temperature_K: float | Sequence[float] = 300.0,
        friction_per_fs: float = 0.01,
        velocities: str = "maxwell",
        seed: int = 0,
        fix_com: bool | Sequence[bool] | None = None,
        device: torch.device | str | None = None,
        precision: str = "fp32",
        mode: str = "auto",
        skin: float = 1.0,
        cuda_graphs: bool = True,
        check_domain: int | None = DOMAIN_CHECK_EVERY,
        freeze_force: float | None = None,
    ) -> None:
        from ase import units

        from mlff_distiller.checkpoint import load_model

        if ensemble not in ENSEMBLES:
            raise ValueError(f"ensemble must be one of {ENSEMBLES}, got {ensemble!r}")
        if velocities not in ("maxwell", "input"):
            raise ValueError(f"velocities must be 'maxwell' or 'input', got {velocities!r}")
        if not math.isfinite(timestep_fs) or timestep_fs <= 0:
            raise ValueError(f"timestep_fs must be a finite number > 0, got {timestep_fs}")
        if ensemble == "langevin" and (not math.isfinite(friction_per_fs) or friction_per_fs < 0):
            raise ValueError(f"friction_per_fs must be a finite number >= 0, got {friction_per_fs}")
        if skin is None or not skin >= 0:
            raise ValueError(f"skin must be a number of Å >= 0, got {skin}")
        if hasattr(structures, "get_positions"):
            structures = [structures]
        structures = list(structures)
        if not structures:
            raise ValueError("BatchedMD needs at least one structure")
        if not isinstance(model, StudentModel):
            model = load_model(model)
        if check_domain is not None and (isinstance(check_domain, bool) or int(check_domain) < 1):
            raise ValueError(f"check_domain must be None or a number of steps >= 1, got {check_domain!r}")
        if freeze_force is not None and not (math.isfinite(freeze_force) and freeze_force > 0):
            raise ValueError(f"freeze_force must be None or a finite force > 0 eV/Å, got {freeze_force!r}")
        molecular = not any(bool(np.any(a.pbc)) for a in structures)
        self.engine = batch_engine(
            model, molecular, device=device, precision=precision, mode=mode, skin=skin, fixed_shape=True
        )
        dev = self.engine.device
        self.device = dev
        self.ensemble = ensemble
        self.timestep_fs = float(timestep_fs)
        self.friction_per_fs = float(friction_per_fs)
        self.seed = int(seed)

        # The batch the engine sees every step: its positions tensor is the trajectories' state (float64, updated
        # in place); numbers, cell, pbc, batch and ptr stay the same objects (the Verlet test compares positions
        # only).
        self._batch = AtomsBatch.from_atoms(structures, device=dev, dtype=torch.float64)
        self.engine._check_species(self._batch.numbers)  # an unknown element: a ValueError now, not at the first step
        self._exact_pairs_if_far()
        b, n = self._batch.num_structures, self._batch.num_atoms
        counts = (self._batch.ptr[1:] - self._batch.ptr[:-1]).cpu().numpy()
        self._counts = counts
        masses = np.concatenate([a.get_masses() for a in structures]).astype(np.float64)
        if not (np.isfinite(masses).all() and (masses > 0).all()):
            raise ValueError("every atom needs a finite mass > 0 (atoms.get_masses())")
        self._masses = torch.as_tensor(masses, device=dev).unsqueeze(1)  # [N, 1] amu
        periodic = np.array([bool(np.any(a.pbc)) for a in structures])
        # ASE constraints: FixCom is what fix_com does; any other would be dropped, so it is refused.
        from ase.constraints import FixCom

        has_fixcom = np.zeros(b, dtype=bool)
        for k, a in enumerate(structures):
            for c in a.constraints:
                if not isinstance(c, FixCom):
                    raise ValueError(
                        f"structure {k} carries an ASE constraint ({type(c).__name__}) that BatchedMD does not apply; "
                        "remove it, or run that structure alone under ASE's dynamics (StudentCalculator)"
                    )
                has_fixcom[k] = True
        if fix_com is None:
            fix = ~periodic | has_fixcom
        elif isinstance(fix_com, bool | np.bool_):
            fix = np.full(b, bool(fix_com))
        else:
            fix = np.asarray(list(fix_com), dtype=bool)
            if fix.shape != (b,):
                raise ValueError(f"fix_com: one flag per structure ({b}), got {fix.shape[0]}")
        self.fix_com = fix
        self._fix_atoms = torch.as_tensor(np.repeat(fix, counts), device=dev).unsqueeze(1)
        self._any_fix = bool(fix.any())
        total_mass = np.add.reduceat(masses, self._batch.ptr[:-1].cpu().numpy()) if n else np.zeros(b)
        self._total_mass = torch.as_tensor(total_mass, device=dev).unsqueeze(1)  # [B, 1]
        self.dof = 3 * counts - 3 * fix  # degrees of freedom per structure (ASE's count with FixCom)
        temps = self._temperatures_of(temperature_K)

        if velocities == "input":
            missing = [k for k, a in enumerate(structures) if not a.has("momenta")]
            if missing:
                raise ValueError(f"velocities 'input': structure(s) {missing[:10]} have no momenta")
            momenta = np.concatenate([a.get_momenta() for a in structures])
        else:
            from mlff_distiller.ase_compat import maxwell_boltzmann

            rng = np.random.default_rng(self.seed)
            parts = []
            for a, t in zip(structures, temps, strict=True):  # replica after replica from one stream: one replica
                probe = a.copy()  # equals `mlff-distill md`'s draw
                probe.set_constraint()
                maxwell_boltzmann(probe, float(t), rng=rng)
                parts.append(probe.get_momenta())
            momenta = np.concatenate(parts)
        if not np.isfinite(momenta).all():
            raise ValueError("non-finite momenta in the input structures")
        self._momenta = torch.as_tensor(momenta, dtype=torch.float64, device=dev).contiguous()
        if self._any_fix:
            self._remove_com(self._momenta)

        dt = self.timestep_fs * units.fs
        self._dt = dt
        c = math.exp(-self.friction_per_fs / units.fs * dt)
        self._c = c
        # sqrt((1 - c²) m kT) per atom: the Ornstein-Uhlenbeck kick's standard deviation (set_temperature)
        self._noise_scale = torch.zeros_like(self._masses)
        self.set_temperature(temps)
        self._generator = torch.Generator(device=dev)
        self._generator.manual_seed(self.seed)
        self._noise = torch.empty_like(self._momenta)
        self._forces = torch.zeros_like(self._momenta)  # the student's forces (get_atoms reports them)
        self.freeze_force = None if freeze_force is None else float(freeze_force)
        freezing = self.freeze_force is not None
        # what the kicks apply: the student's forces, or a copy (less the net force of fixed structures; zero for
        # frozen replicas)
        self._kick = self._forces if not (self._any_fix or freezing) else torch.zeros_like(self._momenta)
        self._frozen = torch.zeros(b, dtype=torch.bool, device=dev)  # [B] (freeze_force)
        self._alive = torch.ones((n, 1), dtype=torch.bool, device=dev)  # [N, 1]: the atom's replica is not frozen
        self._frozen_named: dict[int, str] = {}
        self._energy = torch.zeros(b, dtype=torch.float64, device=dev)
        self._energies = torch.zeros(n, dtype=torch.float64, device=dev)
        self._templates = [a.copy() for a in structures]
        for a in self._templates:
            a.calc = None
            a.set_constraint()
            a.info = {}
        self.nsteps = 0
        self.time_fs = 0.0
        self._has_forces = False
        self.cuda_graphs = cuda_graphs
        self._captured: tuple | None = None
        self.domain = DomainEnvelope.of_model(model) if check_domain is not None else None
        self._domain_every = int(check_domain) if check_domain is not None else 0
        self.domain_findings: dict[int, list[str]] = {}
        self._peak_force = torch.zeros(self.n_replicas, dtype=torch.float64, device=dev)  # over all steps
        self._runaway: dict[int, str] = {}
        self._numbers_host = self._batch.numbers.cpu().numpy()
        self._cells_host = self._batch.cell.cpu().numpy()
        self._pbc_host = self._batch.pbc.cpu().numpy()

    def _temperatures_of(self, temperature_K) -> np.ndarray:
        b = self.n_replicas
        temps = np.asarray(temperature_K, dtype=np.float64)
        if temps.ndim == 0:
            temps = np.full(b, float(temps))
        if temps.shape != (b,):
            raise ValueError(f"temperature_K: one value, or one per replica ({b}), got {temps.shape[0]}")
        if not (np.isfinite(temps).all() and (temps >= 0).all()):
            raise ValueError(
                f"temperature_K must be finite numbers >= 0, got {temps[~(np.isfinite(temps) & (temps >= 0))][:5]}"
            )
        return temps

    def set_temperature(self, temperature_K: float | Sequence[float]) -> None:
        """The Langevin bath temperature from the next step on: one for all replicas or one per replica (K)."""
        from ase import units

        temps = self._temperatures_of(temperature_K)
        self.bath_temperatures = temps
        kt = torch.as_tensor(units.kB * np.repeat(temps, self._counts), device=self.device).unsqueeze(1)
        # in place: the captured integrator reads this buffer
        self._noise_scale.copy_(torch.sqrt((1.0 - self._c * self._c) * kt * self._masses))

    # ------------------------------------------------------------------------------------------------ state
    @property
    def n_replicas(self) -> int:
        return self._batch.num_structures

    @property
    def positions(self) -> torch.Tensor:
        """``[N, 3]`` float64 positions of all replicas (Å, on the engine's device; the live state)."""
        return self._batch.positions

    @property
    def momenta(self) -> torch.Tensor:
        """``[N, 3]`` float64 momenta (ASE units; the live state)."""
        return self._momenta

    @property
    def ptr(self) -> np.ndarray:
        """``[B + 1]`` offsets: replica ``k``'s atoms are rows ``ptr[k]:ptr[k+1]``."""
        return self._batch.ptr.cpu().numpy()

    def _ensure_forces(self) -> None:
        if not self._has_forces:
            if self._domain_every:
                self._check_domain()
            self._compute_forces()
            self._set_kick()
            self._track_forces()

    def _exact_pairs_if_far(self) -> None:
        """Coordinates of ``PRECISE_PAIRS_FROM`` Å and more (a large box, a molecule far from the origin, or a
        replica that drifted there: the state is in the caller's frame) for an engine below float64: from now on it
        makes the pair vectors from the float64 state itself (the same tensors, ``AtomsBatch.positions64``), not
        from its float32 rounding (0.016 eV/Å off at 10,000 Å). Once on, it stays on. At the start, every
        ``PRECISE_CHECK_EVERY`` steps and at each observation (one device sync)."""
        b = self._batch
        if batch_module.needs_float64_pairs(b, self.engine.dtype):  # (NaN: False; _check_finite names it)
            b.positions64, b.cell64 = b.positions, b.cell

    def _check_domain(self) -> None:
        """Check every replica against the student's training envelope (if it has one) and for a force component
        above ``domain.FORCE_LIMIT`` at any step so far; warn naming the replicas newly found."""
        findings: dict[int, list[str]] = {}
        if self.domain is not None:
            table = FrameTable(
                self._numbers_host, self._batch.positions.cpu().numpy(), self._cells_host, self._pbc_host, self._counts
            )
            found = self.domain.check_many(table, device=self.device)
            findings = {k: list(f) for k, f in enumerate(found) if f}
        peak, limit = self._peak_force.cpu().numpy(), _domain.FORCE_LIMIT
        for k in np.flatnonzero(peak > limit).tolist():
            self._runaway.setdefault(k, _domain.force_finding(float(peak[k]), f"by step {self.nsteps}"))
        for k, finding in self._runaway.items():
            findings.setdefault(k, []).append(finding)
        for k in self.frozen:
            self._frozen_named.setdefault(
                k, f"frozen by step {self.nsteps}: an atom felt a force above freeze_force ({self.freeze_force:g} eV/Å)"
            )
            findings.setdefault(k, []).append(self._frozen_named[k])
        new = sorted(set(findings) - set(self.domain_findings))
        self.domain_findings = findings
        if new:
            more = f" and {len(new) - 10} more" if len(new) > 10 else ""
            warnings.warn(
                OutOfDomainWarning(
                    f"replica(s) {new[:10]}{more} lie outside the student's training data (replica {new[0]}: "
                    + "; ".join(findings[new[0]])
                    + "). Their energies and forces are extrapolations; label such structures with the teacher "
                    "and fine-tune."
                ),
                stacklevel=3,
            )

    @property
    def frozen(self) -> list[int]:
        """The replicas frozen so far (``freeze_force``), in order."""
        if self.freeze_force is None:
            return []
        return torch.nonzero(self._frozen).flatten().cpu().tolist()

    def potential_energies(self) -> np.ndarray:
        """Potential energy per replica, eV."""
        self._ensure_forces()
        return self._energy.cpu().numpy().copy()

    def kinetic_energies(self) -> np.ndarray:
        """Kinetic energy per replica, eV."""
        per_atom = (self._momenta.square().sum(dim=1, keepdim=True) / self._masses).squeeze(1) * 0.5
        ke = torch.zeros(self.n_replicas, dtype=torch.float64, device=self.device)
        ke.index_add_(0, self._batch.batch, per_atom)
        return ke.cpu().numpy()

    def temperatures(self) -> np.ndarray:
        """Kinetic temperature per replica, K (``2 KE / (dof k_B)``; 0 for a replica without degrees of freedom)."""
        from ase import units

        ke = self.kinetic_energies()
        dof = np.maximum(self.dof, 1)
        return np.where(self.dof > 0, 2.0 * ke / (dof * units.kB), 0.0)

    def get_atoms(self, indices: Sequence[int] | None = None) -> list:
        """The current state of the replicas (all, or ``indices``) as new ``ase.Atoms``: positions, momenta, and a
        ``SinglePointCalculator`` with ``energy``, ``free_energy``, ``forces`` and ``energies`` (per atom)."""
        from ase.calculators.singlepoint import SinglePointCalculator

        out = []
        for k, atoms, results in self.states(indices):
            frame = atoms.copy()
            frame.calc = SinglePointCalculator(frame, **results)
            frame.info["replica"] = int(k)
            out.append(frame)
        return out

    def states(self, indices: Sequence[int] | None = None):
        """``(index, atoms, results)`` per replica (all, or ``indices``): ``atoms`` with the current positions and
        momenta, ``results`` its ``energy``, ``free_energy``, ``forces`` and ``energies``, or no results for a
        replica frozen by a non-finite force (``freeze_force``): nothing non-finite leaves here. One host copy of the
        whole state; the ``atoms`` objects are reused from call to call (``mlff-distill md`` writes them as they
        come): :meth:`get_atoms` gives copies to keep."""
        self._ensure_forces()
        pos = self._batch.positions.cpu().numpy()
        mom = self._momenta.cpu().numpy()
        forces = self._forces.cpu().numpy()
        energies = self._energies.cpu().numpy()
        energy = self._energy.cpu().numpy()
        ptr = self.ptr
        frozen = set(self.frozen)
        for k in indices if indices is not None else range(self.n_replicas):
            lo, hi = ptr[k], ptr[k + 1]
            atoms = self._templates[k]
            if k in frozen:
                atoms.info["frozen"] = True
            atoms.arrays["positions"][:] = pos[lo:hi]
            atoms.set_momenta(mom[lo:hi], apply_constraint=False)
            e = float(energy[k])
            results = {"energy": e, "free_energy": e, "forces": forces[lo:hi].copy()}
            results["energies"] = energies[lo:hi].copy()
            if k in frozen and not (np.isfinite(e) and np.isfinite(results["forces"]).all()):
                results = {}  # frozen by a non-finite force: the geometry, no student numbers, is what is left
            yield k, atoms, results

    # ------------------------------------------------------------------------------------------------ steps
    def _compute_forces(self) -> None:
        try:
            out = self.engine.compute(self._batch)
        except torch.OutOfMemoryError as err:
            # the replicas cannot be split: once more with the update blocks' recompute (11 % less peak memory)
            if not recompute_before_retry(self.engine, self._batch.num_atoms, err, "BatchedMD: the replicas"):
                raise
            out = self.engine.compute(self._batch)
        self._forces.copy_(out["forces"])
        self._energy.copy_(out["energy"])
        self._energies.copy_(out["atomic_energies"])
        self._has_forces = True

    def _set_kick(self) -> None:
        """The force the kicks apply: the student's, less a fixed structure's net force (mass-weighted), so the
        kicks leave its centre of mass at rest up to float64 rounding; none on a frozen replica (``freeze_force``),
        whose momenta are zeroed here."""
        if self._any_fix:
            self._remove_com(self._forces, out=self._kick)
        if self.freeze_force is None:
            return
        f = self._forces
        bad = ~torch.isfinite(f).all(dim=1) | (f.abs().amax(dim=1) > self.freeze_force)
        hit = torch.zeros(self.n_replicas, dtype=torch.float64, device=self.device)
        hit.index_add_(0, self._batch.batch, bad.to(torch.float64))
        self._frozen.logical_or_(hit > 0)
        self._alive.copy_(~self._frozen.index_select(0, self._batch.batch).unsqueeze(1))
        if not self._any_fix:
            self._kick.copy_(self._forces)
        self._kick.masked_fill_(~self._alive, 0.0)  # (a fill, not a product: the forces may be NaN there)
        self._momenta.masked_fill_(~self._alive, 0.0)

    def _remove_com(self, momenta: torch.Tensor, out: torch.Tensor | None = None) -> None:
        """Subtract each fixed structure's total (mass-weighted share per atom) from ``momenta``, in place or into
        ``out``: the centre-of-mass momentum, or of forces the net force (ASE's ``FixCom.adjust_forces``)."""
        total = torch.zeros((self.n_replicas, 3), dtype=torch.float64, device=self.device)
        total.index_add_(0, self._batch.batch, momenta)
        share = (total / self._total_mass).index_select(0, self._batch.batch)
        torch.sub(momenta, torch.where(self._fix_atoms, share * self._masses, 0.0), out=momenta if out is None else out)

    def _before_forces(self) -> None:
        """The step up to the force call: half kick, drift (Langevin: half drift, the thermostat on the drawn noise,
        the centre of mass, half drift)."""
        dt, p, r, m = self._dt, self._momenta, self._batch.positions, self._masses
        p.add_(self._kick, alpha=0.5 * dt)
        if self.ensemble == "nve":
            r.add_(p / m, alpha=dt)
            return
        r.add_(p / m, alpha=0.5 * dt)
        p.mul_(self._c).addcmul_(self._noise, self._noise_scale)
        if self.freeze_force is not None:  # no thermal kicks for a frozen replica: it stays where it is
            p.masked_fill_(~self._alive, 0.0)
        if self._any_fix:
            self._remove_com(p)
        r.add_(p / m, alpha=0.5 * dt)

    def _after_forces(self) -> None:
        """The step after the force call: the kick's force, the second half kick, each replica's largest force."""
        self._set_kick()
        self._momenta.add_(self._kick, alpha=0.5 * self._dt)
        self._track_forces()

    def _track_forces(self) -> None:
        """Each replica's largest force component so far (a few kernels, inside the captured half)."""
        f = self._forces.abs().amax(dim=1)
        self._peak_force.scatter_reduce_(0, self._batch.batch, f, reduce="amax", include_self=True)

    def _graphs(self) -> tuple:
        """On CUDA: the two halves of the integrator, each captured as one CUDA graph (about 20 small kernels a step
        otherwise: at a few replicas their launches cost more than the student's replayed step). Captured on
        first use, once; the state is restored after the warm-up runs that precede a capture."""
        if self._captured is None:
            from mlff_distiller.cudagraph import capturing, cuda_graphs_available

            if not (self.cuda_graphs and cuda_graphs_available(self.device)):
                self._captured = (self._before_forces, self._after_forces)
                return self._captured
            state = [t.clone() for t in (self._momenta, self._batch.positions, self._kick)]
            side = torch.cuda.Stream(device=self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self._before_forces()
                self._after_forces()
            torch.cuda.current_stream(self.device).wait_stream(side)
            graphs = []
            for part in (self._before_forces, self._after_forces):
                graph = torch.cuda.CUDAGraph()
                with capturing(graph, mode="thread_local"):
                    part()
                graphs.append(graph.replay)
            for t, saved in zip((self._momenta, self._batch.positions, self._kick), state, strict=True):
                t.copy_(saved)
            self._captured = tuple(graphs)
        return self._captured

    def step(self) -> None:
        """One step of every replica."""
        self._ensure_forces()
        before, after = self._graphs()
        if self.ensemble == "langevin":
            p = self._momenta
            torch.randn(p.shape, generator=self._generator, dtype=p.dtype, device=p.device, out=self._noise)
        before()
        try:
            self._compute_forces()
        except ValueError:
            # A replica that blew up earlier (NaN positions) stops a list rebuild with a ValueError of the
            # neighbour list; name the replica instead, as an observation would.
            self._check_finite()
            raise
        after()
        self.nsteps += 1
        self.time_fs += self.timestep_fs
        if self.nsteps % PRECISE_CHECK_EVERY == 0:
            self._exact_pairs_if_far()
        if self._domain_every and self.nsteps % self._domain_every == 0:
            self._check_domain()

    def run(self, steps: int, *, observer: Callable[[BatchedMD], None] | None = None, interval: int = 1) -> None:
        """Take ``steps`` steps; ``observer(self)`` is called before the first (at ``nsteps == 0`` only) and after
        every ``interval``-th step (as an observer attached to an ASE dynamics). Raises
        :class:`~mlff_distiller.batching.NonFiniteOutputError` naming the replicas whose energy is no longer finite
        (checked at every observation and at the end)."""
        if steps < 0 or interval < 1:
            raise ValueError("steps must be >= 0 and interval >= 1")
        if observer is not None and self.nsteps == 0:
            self._check_finite()
            observer(self)
        for i in range(1, steps + 1):
            self.step()
            if observer is not None and i % interval == 0:
                self._check_finite()
                self._exact_pairs_if_far()
                observer(self)
        self._check_finite()

    def _check_finite(self) -> None:
        if not self._has_forces:
            self._ensure_forces()
        state = torch.cat([self._momenta, self._batch.positions], dim=1)
        bad_atoms = (~torch.isfinite(state).all(dim=1)).to(torch.float64)
        per_structure = torch.zeros(self.n_replicas, dtype=torch.float64, device=self.device)
        per_structure.index_add_(0, self._batch.batch, bad_atoms)
        finite = torch.isfinite(self._energy) & (per_structure == 0)
        if self.freeze_force is not None:  # a frozen replica's student energy may be what froze it
            finite = finite | self._frozen
        if bool(finite.all()):
            return
        bad = torch.nonzero(~finite).flatten().cpu().tolist()
        results = [None if k in set(bad) else dict(res) for k, _, res in self.states()]
        raise NonFiniteOutputError(
            f"MD blew up: replica(s) {bad[:20]} have a non-finite energy, momenta or positions after {self.nsteps} "
            "steps (the other replicas' states: get_atoms(), and this error's results)",
            indices=bad,
            results=results,
        )
