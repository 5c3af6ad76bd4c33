"""``StudentCalculator``: the student as an ASE calculator."""

from __future__ import annotations

import copy
import functools
import math
import os
import warnings
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
from ase import units
from ase.calculators.calculator import Calculator, PropertyNotImplementedError, all_changes

from mlff_distiller import _langevin_ahead
from mlff_distiller import batch as batch_module
from mlff_distiller import domain as _domain
from mlff_distiller._atoms_state import _ARRAY_CHANGES, _array, _changes_from, _close, _snapshot
from mlff_distiller.batch import MIN_VOLUME, AtomsBatch
from mlff_distiller.batching import NonFiniteOutputError, all_finite, nonfinite_message, recompute_before_retry
from mlff_distiller.checkpoint import load_model
from mlff_distiller.domain import DomainEnvelope, OutOfDomainWarning
from mlff_distiller.engine import ForceEngine
from mlff_distiller.model import StudentModel

__all__ = ["StudentCalculator"]


# Calculations after a stress request (answered from the cache or not) that still return the stress with the
# forces: NPTBerendsen's step makes two (forces after the cell scaling, forces after the position update) between
# its stress requests.
STRESS_WINDOW = 3
# Calculations between two checks of the structure against the student's training envelope (the first is checked):
# a CPU neighbour list, ~1 ms for a small molecule, ~0.1 s for 24,000 atoms.
DOMAIN_CHECK_EVERY = 1000
# The next velocity-Verlet step launched ahead (StudentCalculator._launch_ahead): after this many launches in a row
# that the next calculation did not take, the calculator stops predicting for AHEAD_PAUSE calculations.
AHEAD_MISSES = 3
AHEAD_PAUSE = 256
# _exact_step: how many float64 ulps on each side of the least-squares time step are tried.
EXACT_STEP_ULPS = 8


class StudentCalculator(Calculator):
    """ASE calculator for a distilled student.

    Args:
        model: a :class:`StudentModel` or a checkpoint path (``"builtin:<name>"`` included).
        device: default CUDA when available.
        precision: ``"fp64"``, ``"fp32"``, ``"tf32"``, ``"bf16"`` or ``"fp16"``; MD energy conservation wants
            ``"fp64"``.
        neighbor_method: neighbour-list backend.
        mode: ``"auto"`` (default: CUDA-graph replay on CUDA, eager elsewhere), ``"eager"``, ``"compile"`` or
            ``"cudagraph"`` (see :class:`~mlff_distiller.engine.ForceEngine`). MD keeps the atom count fixed, so
            every step after the first few replays the same captured graph (a new one only when the edge count
            leaves its bucket).
        skin: Verlet skin in Å for the neighbour list across MD steps (rebuilt only when an atom moved more
            than skin/2, or the atoms changed, or a cell change no longer fits in the skin: NPT keeps the list across
            small cell changes; exact); ``None`` builds a fresh list every step.
            ``calc.engine.verlet.n_builds`` counts the builds.
        compile_mode: ``torch.compile`` mode for ``"compile"`` (or compiled code inside ``"cudagraph"``).
        cache_dir: persistent compile cache directory (a second process starts fast).
        check_domain: with a student that stores its training envelope (:mod:`mlff_distiller.domain`; trained by
            this package since it records one), check the structure against it on the first calculation and every
            ``check_domain``-th after (default ``DOMAIN_CHECK_EVERY``); a check that finds the structure outside,
            after one that did not, warns with :class:`~mlff_distiller.domain.OutOfDomainWarning`.
            ``calc.domain_findings`` holds the last check's findings. A force component above
            :data:`~mlff_distiller.domain.FORCE_LIMIT` (a collision the student cannot describe, whose numbers all
            stay finite) warns too, once per calculator, with or without an envelope. ``None``: no checks.

    MD on CUDA: the engine's captured step of a Verlet bucket reads the positions from, and writes its results to,
    page-locked host memory (``engine.zero_copy``), and a float32 calculator predicts the positions of ASE's next
    velocity-Verlet call and launches their step before returning (``launch_ahead``, :meth:`_launch_ahead`): the
    next calculation takes it only where its positions are, byte for byte, the ones launched. Where the step is the
    model's captured one (not the dense step of a small student), a calculation that takes its launch first queues
    the step after it, with the positions predicted on the device (:meth:`_chain_ahead`,
    ``ForceEngine.chain_ahead``), so that the device runs one step after the other without waiting for the host:
    the 128 x 3 student's benzene MD step 0.86-0.94x (benchmarks/results/stop81_gpu/f/). Away from a rebuild of the
    neighbour list the calculator then makes no prediction of its own: the next calculation compares its positions
    with the device's (``ForceEngine.keep_chained``).

    Properties: ``energy``, ``free_energy`` (eV), ``forces`` (eV/Å), ``energies`` (per atom, eV) and, for fully
    periodic structures, ``stress`` (eV/Å³, Voigt, ASE sign). Stress runs the engine's padded stress step (a CUDA
    graph on a GPU); for ``STRESS_WINDOW`` calculations after a stress request, a periodic system's forces come
    with its stress, so NPT dynamics find the stress of the current positions already computed. Where such a
    stress goes unread after a cell change (NPTBerendsen's first calculation of a step), the next ones after a
    cell change leave it out, until a stress request finds it missing.
    """

    implemented_properties: ClassVar[list[str]] = ["energy", "free_energy", "forces", "stress", "energies"]
    # The private copy of the atoms made while the engine computes (its while_running); False: before the engine
    # call, as ASE's Calculator.calculate orders it (probes time the two).
    store_while_running: ClassVar[bool] = True
    # check_state's answer from the stored copy's bytes (_snapshot, _changes_from); False: the general comparison
    # every time (probes time the two).
    snapshot_check: ClassVar[bool] = True
    # Predict a velocity-Verlet trajectory's next positions and launch their step before ASE asks for it
    # (_launch_ahead); False: never (probes time the two).
    launch_ahead: ClassVar[bool] = True
    # MD's steady state, where every launch ahead is taken: the batch built for the predicted positions serves the
    # next calculation when its positions are those, byte for byte (no second cast of the same positions), and the
    # time step read off the trajectory is kept while the predictions hold (_ahead_reuse, _verlet_next). False: both
    # made anew every step (probes time the two).
    reuse_ahead: ClassVar[bool] = True

    def __init__(
        self,
        model: StudentModel | str | Path,
        *,
        device: torch.device | str | None = None,
        precision: str = "fp32",
        neighbor_method: str = "auto",
        mode: str = "auto",
        compile_mode: str | None = None,
        cache_dir: str | Path | None = None,
        skin: float | None = 1.0,
        check_domain: int | None = DOMAIN_CHECK_EVERY,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        if not isinstance(model, StudentModel):
            model = load_model(model)
        if check_domain is not None and (isinstance(check_domain, bool) or int(check_domain) < 1):
            raise ValueError(f"check_domain must be None or a number of calculations >= 1, got {check_domain!r}")
        # The training envelope stored with the student (None for students without one):
        # checked on the first calculation and every check_domain-th after; the first finding warns.
        self.domain = DomainEnvelope.of_model(model) if check_domain is not None else None
        self._domain_every = int(check_domain) if check_domain is not None else 0
        self.domain_findings: list[str] = []  # what the last check found outside the envelope
        self._force_warned = False
        self.engine = ForceEngine(
            model,
            device=device,
            precision=precision,
            neighbor_method=neighbor_method,
            mode=mode,
            compile_mode=compile_mode,
            cache_dir=cache_dir,
            neighbor_skin=skin,
        )
        self._last_batch: AtomsBatch | None = None
        # _launch_ahead: the previous calculation's positions, the masses by (numbers, masses) bytes, launches in a
        # row that the next calculation did not take, and calculations left before predicting again.
        self._ahead_prev: np.ndarray | None = None
        self._followed = None  # follow(): the Langevin integrator whose next positions are predicted
        self._ahead_masses: tuple | None = None
        self._ahead_misses = 0
        self._ahead_pause = 0
        # The batch of the predicted positions: (the batch it was made from, the positions' float64 bytes, the batch),
        # and the time step of the last prediction (see reuse_ahead).
        self._ahead_reuse: tuple | None = None
        self._ahead_dt: float | None = None
        # The private copy of the atoms that ASE's Calculator.calculate made (self.atoms after a calculation), kept
        # here because get_property drops self.atoms when the system changed: see _store_atoms.
        self._own_atoms = None
        # The stored copy's contents as bytes, taken with the copy (see _snapshot): check_state's answer "nothing
        # changed" for atoms that still hold exactly these (ASE asks twice more per MD step after the calculation).
        self._snap: tuple | None = None
        # check_state: name -> (dtype, bytes) of the last contents found free of NaN (see _close).
        self._nan_free: dict[str, tuple] = {}
        self._directory_made: str | None = None  # _store_atoms: the directory last made sure of
        # Stress asked for lately (within STRESS_WINDOW calculations, cached answers included): the calculations of
        # a fully periodic system then return the stress with the forces (one padded step for both). NPT dynamics
        # ask for the stress and the forces of the same positions in separate calls and so find it cached (ASE's
        # NPTBerendsen: 3 -> 2 engine calls per step); a single stress request in NVT stops costing after a few.
        self._calculations = 0
        self._stress_asked_at: int | None = None
        # Which of those unrequested stresses get used. NPTBerendsen reads the stress of the positions after its
        # position update, never that of its first calculation after the cell scaling; a cell filter (relaxation)
        # reads the stress right after each cell change. So the first unrequested stress after a cell change that
        # goes unread turns such stresses off (one padded stress step fewer per NPT step), and a stress request
        # that then finds none turns them back on (that request costs one calculation more, once).
        self._unrequested: tuple[bool, bool] | None = None  # the last calculation's: (after a cell change, read)
        self._skip_after_cell_change = False
        self._skipped = False  # the last calculation left its stress out under that rule

    def check_state(self, atoms, tol: float = 1e-15) -> list[str]:
        """ASE's ``compare_atoms`` rule (same result), cheaper: each array is first compared for exact
        equality, and only a differing one goes through ASE's ``allclose(atol=tol)``. ASE's own runs six
        ``allclose`` on every property request, several times per MD step. Equal float arrays still need a NaN
        test (NaN is never close to itself); ``_nan_free`` remembers the last NaN-free contents seen under each
        name, so an MD step pays it once per new content (~3 µs of 192 x 3 positions, ~2 µs of a cell)."""
        old = self.atoms
        if old is None:
            return super().check_state(atoms, tol)
        snap = self._snap
        ignored = self.ignored_changes
        memo = self._nan_free
        if snap is not None and snap[0] is old and self.snapshot_check:
            # Against the stored copy's bytes: no change where every compared content is byte for byte what it
            # held (NaN-free); a content that differs goes through _close as below (an MD step's first request:
            # the positions), the others are settled by their bytes. None: other array names (the full way).
            changes = _changes_from(snap, atoms, tol, ignored, memo)
            if changes is not None:
                return changes
        changes = []
        # The Cell's own array, not the Cell: np.asarray(Cell) is ~3 µs of the ~15 µs of this call.
        if "cell" not in ignored and not _close(_array(old.cell), _array(atoms.cell), tol, memo, "cell"):
            changes.append("cell")
        if "pbc" not in ignored and not _close(old.pbc, atoms.pbc, tol):
            changes.append("pbc")
        a1, a2 = old.arrays, atoms.arrays
        if a1.keys() == a2.keys():
            shared = a1.keys()
        else:
            changes += sorted(p for p in a1.keys() ^ a2.keys() if p in _ARRAY_CHANGES and p not in ignored)
            shared = a1.keys() & a2.keys()
        for p in _ARRAY_CHANGES:  # sorted, as ASE's order
            if p in shared and p not in ignored and not _close(a1[p], a2[p], tol, memo, p):
                changes.append(p)
        return changes

    def _batch(self, system_changes, atoms) -> AtomsBatch:
        """The input batch of ``atoms`` (the caller's, or the stored copy). In MD only the positions change: the
        previous batch is reused with new positions (checked finite), so numbers, cell, pbc, batch and ptr stay
        the same tensors from step to step (the engine's Verlet list then compares them by identity). The new
        batch is a shallow copy of the previous one with a new positions tensor of the same shape: every other
        field was validated when it was built, so ``AtomsBatch.__post_init__`` need not run again
        (``dataclasses.replace`` would: ~15 µs a step)."""
        last = self._last_batch
        changes = set(system_changes)
        cell = None
        if last is not None and changes == {"positions", "cell"} and last.num_structures == 1 and atoms.pbc.all():
            # NPT (the barostat scales cell and positions): a new cell, checked as from_atoms checks a fully
            # periodic one (finite, volume >= MIN_VOLUME); anything else goes the full way below.
            # A copy: ``atoms`` may be the caller's, whose cell ASE changes in place.
            values = np.array(atoms.cell.array, dtype=np.float64)
            if np.isfinite(values).all() and abs(float(np.linalg.det(values))) >= MIN_VOLUME:
                cell = torch.from_numpy(values.reshape(1, 3, 3))  # float64: _moved casts it
                changes = {"positions"}
        if last is not None and changes <= {"positions"}:
            pos = np.asarray(atoms.positions, dtype=np.float64)
            reuse, self._ahead_reuse = self._ahead_reuse, None
            if cell is None and reuse is not None and reuse[0] is last and pos.tobytes() == reuse[1]:
                # The positions the last calculation predicted (_launch_ahead): the batch it made of them is this
                # one (_moved of the same bytes from the same batch), and its launch ahead reads that very tensor.
                self._last_batch = reuse[2]
                return reuse[2]
            batch = self._moved(last, pos, cell)
            if batch is not None:
                self._last_batch = batch
                return batch
        self._last_batch = AtomsBatch.from_atoms(atoms, dtype=self.engine.dtype)  # validates everything
        return self._last_batch

    def _moved(self, last: AtomsBatch, pos: np.ndarray, cell: torch.Tensor | None) -> AtomsBatch | None:
        """``last`` with the new positions ``pos`` (float64, the caller's; and a new ``cell`` if not None), or
        None where the full way must build the batch: positions of another shape or not finite, or a float32
        batch without float64 positions whose coordinates reached ``PRECISE_PAIRS_FROM`` (an MD whose atoms
        drifted out that far; ``from_atoms`` then keeps them, AtomsBatch.positions64)."""
        if pos.shape != last.positions.shape:
            return None
        dtype = self.engine.dtype
        np_dtype = batch_module.NUMPY_FLOATS.get(dtype)
        batch = object.__new__(AtomsBatch)
        batch.__dict__.update(last.__dict__)
        # Always a copy (fp64 too): ``atoms`` may be the caller's, whose positions ASE's integrators update in place.
        if last.positions64 is not None:  # pair vectors made in float64: the float64 positions follow the step
            shifted = pos - last.origin.numpy()
            if not np.isfinite(shifted).all():
                return None
            batch.positions64 = torch.from_numpy(shifted)
            batch.positions = batch.positions64.to(dtype)
            if cell is not None:
                batch.cell64 = cell.to(torch.float64)
        elif np_dtype is not None and last.origin is not None:
            # From the first batch's origin (AtomsBatch.origin): subtracted in float64, rounded once by NumPy's
            # cast into a tensor on the same memory (~3.5 instead of ~10 µs for torch's .to(float32)). One
            # reduction checks both that every entry is finite (a NaN or inf propagates) and that the coordinates
            # stay below PRECISE_PAIRS_FROM (read where from_atoms reads it: a caller's setting holds for both).
            out = np.empty(pos.shape, dtype=np_dtype)
            np.subtract(pos, last.origin.numpy(), out=out, casting="unsafe")
            if not float(np.abs(out).max()) < batch_module.PRECISE_PAIRS_FROM:
                return None
            batch.positions = torch.from_numpy(out)
        else:
            # A finite sum means finite entries (a NaN or inf entry makes it NaN or inf); an overflowing sum of
            # finite entries goes the full way. ~1.3 µs less than np.isfinite(pos).all() for 192 atoms.
            if not (math.isfinite(pos.sum()) or np.isfinite(pos).all()):
                return None
            if np_dtype is None:
                shifted = pos if last.origin is None else pos - last.origin.numpy()
                batch.positions = torch.from_numpy(shifted).to(dtype)
            else:
                batch.positions = torch.from_numpy(pos.astype(np_dtype, copy=True))
        if cell is not None:
            batch.cell = cell.to(dtype)
        return batch

    def _store_atoms(self, atoms, properties, system_changes, finite: bool = False) -> None:
        """``self.atoms = atoms.copy()``, what ASE's ``Calculator.calculate`` does, for less when only positions
        changed: the previous private copy (this calculator's own object, never handed out by ASE, whose
        ``get_atoms`` copies it) gets every array, the cell, pbc, cell displacement and info of ``atoms``
        written in place, which leaves it equal to a fresh ``atoms.copy()`` (~5 instead of ~40 µs for 192 atoms
        on the development CPU). Constraints are deep-copied, as ``atoms.copy()`` does (ASE's ``FixCom`` or
        ``FixAtoms`` in MD: ~2 µs). Anything else (other changes, other arrays, shapes or dtypes, another Atoms
        class) takes ASE's own path."""
        self._snap = None
        own = self._own_atoms
        if (
            atoms is not None
            and own is not None
            and own is not atoms
            and set(system_changes) <= {"positions"}
            and type(own) is type(atoms)
            and own.arrays.keys() == atoms.arrays.keys()
            and all(own.arrays[k].shape == a.shape and own.arrays[k].dtype == a.dtype for k, a in atoms.arrays.items())
        ):
            for k, a in atoms.arrays.items():
                np.copyto(own.arrays[k], a)
            own.cell.array[:] = atoms.cell.array
            own.pbc[:] = atoms.pbc
            own._celldisp = atoms._celldisp.copy()
            own.info = dict(atoms.info)
            if atoms.constraints or own.constraints:
                own.constraints = copy.deepcopy(atoms.constraints)
            self.atoms = own
            if self._directory != self._directory_made:  # as Calculator.calculate, once per directory (a stat
                if not os.path.isdir(self._directory):  # is ~2 µs; this calculator writes no files there)
                    os.makedirs(self._directory)
                self._directory_made = self._directory
            self._snap = _snapshot(own, self._nan_free, finite)
            return
        super().calculate(atoms, properties, system_changes)
        self._own_atoms = self.atoms
        self._snap = _snapshot(self.atoms, self._nan_free)

    def get_property(self, name, atoms=None, allow_calculation=True):
        if name != "stress":
            return super().get_property(name, atoms, allow_calculation)
        self._stress_asked_at = n = self._calculations
        value = super().get_property(name, atoms, allow_calculation)
        if self._calculations == n and self._unrequested is not None:  # answered by an unrequested stress
            self._unrequested = (self._unrequested[0], True)
        return value

    def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes) -> None:
        src = atoms if atoms is not None else self.atoms
        want_stress = "stress" in properties
        periodic = bool(src.pbc.all())
        if want_stress and not periodic:
            self._store_atoms(atoms, properties, system_changes)
            raise PropertyNotImplementedError(
                f"stress needs a fully periodic structure; this one has pbc={self.atoms.pbc.tolist()}"
            )
        self._calculations += 1
        if want_stress and not system_changes and self._skipped:
            self._skip_after_cell_change = False  # the stress left out was wanted after all (see __init__)
        if self._unrequested is not None and self._unrequested[0] and not self._unrequested[1]:
            self._skip_after_cell_change = True  # the last one, after a cell change, went unread
        asked = self._stress_asked_at
        unrequested = not want_stress and periodic and asked is not None and self._calculations - asked <= STRESS_WINDOW
        cell_changed = "cell" in system_changes
        self._skipped = unrequested and cell_changed and self._skip_after_cell_change
        unrequested = unrequested and not self._skipped
        self._unrequested = (cell_changed, False) if unrequested else None
        want_stress = want_stress or unrequested
        batch = self._batch(system_changes, src)
        # as_numpy: one device-to-host copy of all outputs on the padded path, unpacked as NumPy views. The private
        # copy of the atoms (ASE's self.atoms = atoms.copy()) is made while the device computes: the engine calls
        # _store_atoms right after it launched the step (host work off an MD step's critical path).
        store = None
        if self.store_while_running:
            store = functools.partial(self._store_atoms, atoms, properties, system_changes, True)
        else:
            self._store_atoms(atoms, properties, system_changes, True)
        if self.launch_ahead and not want_stress:
            self._chain_ahead(src, system_changes, batch)
        try:
            out = self.engine.compute(batch, forces=True, stress=want_stress, as_numpy=True, while_running=store)
        except torch.OutOfMemoryError as err:
            # a large box that does not fit: once more with the update blocks' recompute (11 % less peak memory)
            if not recompute_before_retry(self.engine, len(src), err, "StudentCalculator: a structure"):
                raise
            out = self.engine.compute(batch, forces=True, stress=want_stress, as_numpy=True, while_running=store)
        energy = float(out["energy"][0])
        forces = out["forces"]
        peak = float(np.abs(forces).max()) if forces.size else 0.0  # NaN or inf when any is (no extra pass)
        if not (math.isfinite(energy) and math.isfinite(peak) and (not want_stress or all_finite(out["stress"][0]))):
            # never NaN or inf to ASE: e.g. a float32 overflow in a structure far outside the training data
            message = nonfinite_message(self.atoms, self.engine.cutoff, "StudentCalculator")
            raise NonFiniteOutputError(message, [0], [None])
        self.results = {
            "energy": energy,
            "free_energy": energy,
            "forces": out["forces"].astype(np.float64, copy=False),
            "energies": out["atomic_energies"].astype(np.float64, copy=False),
        }
        if want_stress:
            self.results["stress"] = out["stress"][0].astype(np.float64, copy=False)
        if self.launch_ahead and not want_stress:
            self._launch_ahead(src, system_changes)
        if self.domain is not None and (self._calculations - 1) % self._domain_every == 0:
            self._check_domain()
        if peak > _domain.FORCE_LIMIT and self._domain_every and not self._force_warned:
            self._force_warned = True  # once per calculator: a runaway trajectory, not a new finding each step
            warnings.warn(
                OutOfDomainWarning(
                    "this structure lies outside anything the student can describe: "
                    + _domain.force_finding(peak, f"in calculation {self._calculations}")
                ),
                stacklevel=4,
            )

    def _launch_ahead(self, atoms, system_changes) -> None:
        """Predict the positions of ASE's next velocity-Verlet call and launch their step now
        (:meth:`ForceEngine.launch_ahead`), so that the device computes it while the host runs the integrator and
        this calculator's bookkeeping; the next calculation takes that step only where its positions are, byte for
        byte, the ones launched (the model's input is then the same), and otherwise launches its own.

        VelocityVerlet (ASE) moves ``x' = x + dt (p + h F + h F) / m`` with ``h = dt / 2``: the momenta ``p`` it
        set before this calculation, the forces ``F`` just computed. ``dt`` is read off the last move
        (``x - x_prev = dt p / m``, least squares over every coordinate): in float64 its error moves the predicted
        coordinates by ~1e-16 Å, which the float32 positions the engine takes do not resolve. Other motion (a
        thermostat's friction and noise, constraints, a relaxation) is not predicted, except ASE's ``Langevin`` where
        the calculator follows it (:meth:`follow`: its noise drawn from a copy of its generator; any constraints
        that do not redistribute the noise, such as ``FixCom``): after ``AHEAD_MISSES``
        launches in a row that the next calculation did not take, the calculator stops for ``AHEAD_PAUSE``
        calculations. A float32 engine only (float64 positions would have to match to the last bit)."""
        eng = self.engine
        if eng.last_ahead is not None:  # the launch before this calculation: taken or not
            self._ahead_misses = 0 if eng.last_ahead else self._ahead_misses + 1
            if self._ahead_misses >= AHEAD_MISSES:
                self._ahead_misses, self._ahead_pause = AHEAD_MISSES - 1, AHEAD_PAUSE
        if not eng.may_launch_ahead():  # a CPU engine, or no zero-copy step captured: no prediction to make
            self._ahead_prev = None
            return
        x = atoms.arrays["positions"]
        prev, self._ahead_prev = self._ahead_prev, x.copy()
        if self._ahead_pause > 0:
            self._ahead_pause -= 1
            return
        last = self._last_batch
        if eng.dtype != torch.float32 or last is None or set(system_changes) != {"positions"}:
            return
        if eng.keep_chained():
            # The step chained in this call (_chain_ahead) is the launch ahead, on the device's prediction of the
            # positions: the next calculation compares its own with those, so the host's prediction is not made
            # (~15 % of the 128 x 3 student's benzene MD step's host work on the H200, results/stop83_gpu/).
            return
        if self._followed is not None:  # ASE's Langevin (follow() takes nothing else)
            x_next = _langevin_ahead.next_positions(self._followed, atoms, self.results["forces"])
        else:
            x_next = self._verlet_next(atoms, x, prev)
        batch = None if x_next is None else self._moved(last, x_next, None)
        if batch is not None:
            if self.reuse_ahead:
                self._ahead_reuse = (last, x_next.tobytes(), batch)
            eng.launch_ahead(batch)

    def _chain_ahead(self, atoms, system_changes, batch: AtomsBatch) -> None:
        """Before this calculation waits for its step (launched ahead at the last one), queue the step after it with
        its positions predicted on the device (:meth:`ForceEngine.chain_ahead`), so that the device goes from one
        step to the next without the host's wait, prediction and launch in between. The same prediction
        :meth:`_verlet_next` makes on the host after this calculation, from the same positions, momenta, masses and
        time step; the next calculation takes the queued step only on the bytes of that host prediction. Velocity
        Verlet with its time step found (``reuse_ahead``), no constraints, a float32 engine."""
        dt = self._ahead_dt
        if dt is None or not self.reuse_ahead or self._followed is not None or self._ahead_pause > 0:
            return
        eng = self.engine
        if eng.dtype != torch.float32 or set(system_changes) != {"positions"} or atoms.constraints:
            return
        p = atoms.arrays.get("momenta")
        if p is not None:
            eng.chain_ahead(batch, atoms.arrays["positions"], p, self._masses(atoms), dt)

    def _verlet_next(self, atoms, x: np.ndarray, prev: np.ndarray | None) -> np.ndarray | None:
        """The positions of ASE's next velocity-Verlet call (see :meth:`_launch_ahead`), or None where the motion is
        not velocity Verlet's to predict (no momenta or previous positions, constraints, no motion)."""
        p = atoms.arrays.get("momenta")
        if p is None or prev is None or prev.shape != x.shape or atoms.constraints:
            return None
        m = self._masses(atoms)
        dt = self._ahead_dt
        if dt is None or not self.reuse_ahead or self.engine.last_ahead is not True:
            # Read off the last move, unless the last prediction made with it was taken: then this step moved by
            # it too, to the last bit of the float32 positions (a changed time step misses once, then is read again).
            v = p / m
            vv = float(np.vdot(v, v))
            last, self._ahead_dt = self._ahead_dt, None
            if not vv > 0.0:
                return None
            dt = float(np.vdot(x - prev, v)) / vv
            if not (dt > 0.0 and math.isfinite(dt)):
                return None
            if self.reuse_ahead:
                dt = _exact_step(dt, prev, x, p, m, last)
            self._ahead_dt = dt
        kick = 0.5 * dt * self.results["forces"]
        p_next = p + kick  # the second half kick of this step, then the first of the next (ASE's order)
        p_next += kick
        return x + dt * p_next / m

    def follow(self, dyn) -> StudentCalculator:
        """Predict the next positions of the integrator ``dyn`` for the launch ahead (see :meth:`_launch_ahead`):
        ASE's ``Langevin`` on this calculator's atoms, whose next positions take the noise its next step draws
        (:mod:`mlff_distiller._langevin_ahead` draws the same numbers from a copy of its generator). Without it, the
        calculator predicts velocity Verlet only. ``None`` stops following. Returns the calculator.

        Opt-in: every launch was taken on an H200 (benchmarks/results/stop68_gpu/), but the prediction's host work
        (~30 µs on the development CPU) sits before the launch, and the step was 1.05-1.1x faster on one host and
        0.8x on another (``benchmarks/probe_langevin_ahead.py``)."""
        if dyn is not None and not _langevin_ahead.is_langevin(dyn):
            raise ValueError(
                f"follow: ASE's Langevin is the integrator followed (velocity Verlet needs no call); got "
                f"{type(dyn).__name__}"
            )
        self._followed = dyn
        return self

    def _masses(self, atoms) -> np.ndarray:
        """``atoms.get_masses()[:, None]``, kept while the numbers and any masses array stay the same."""
        numbers, masses = atoms.arrays["numbers"], atoms.arrays.get("masses")
        key = (numbers.tobytes(), None if masses is None else masses.tobytes())
        cached = self._ahead_masses
        if cached is None or cached[0] != key:
            cached = self._ahead_masses = (key, atoms.get_masses()[:, None])
        return cached[1]

    def _check_domain(self) -> None:
        device = self.domain.check_device(len(self.atoms), self.engine.device)  # large systems: the engine's GPU
        found = self.domain.check(self.atoms, device=device)
        warn = found and not self.domain_findings
        self.domain_findings = found
        if warn:
            warnings.warn(
                OutOfDomainWarning(
                    "this structure lies outside the student's training data: " + "; ".join(found) + ". Its energy "
                    "and forces are extrapolations; label such structures with the teacher and fine-tune."
                ),
                stacklevel=4,
            )


def _exact_step(
    dt: float, prev: np.ndarray, x: np.ndarray, p: np.ndarray, m: np.ndarray, last: float | None = None
) -> float:
    """The time step of ASE's velocity-Verlet move ``x = prev + dt * p / m`` (its own expression: ``p`` the
    half-kicked momenta it stored, ``m`` the masses as a column) reproduced to the last bit, or ``dt``, the
    least-squares estimate, where none is found (another integrator). The estimate is good to ~1e-16 Å over the
    move (``x - prev`` is rounded at the coordinates' scale), so ~1e-11 relative at 0.5 fs: too far for a search
    by ulps. Steps are written as a decimal number of femtoseconds (``0.5 * units.fs``), so that number, rounded
    from the estimate, is tried first, then the estimate and ``EXACT_STEP_ULPS`` float64 ulps on each side of it
    (large moves); the first that reproduces the move is taken (several may: the move's rounding absorbs an ulp).
    With the exact step the predicted positions are ASE's next ones in float64 too, not only after the float32
    cast, so the next calculation takes the prediction's batch (``reuse_ahead``). Run once per run of taken
    predictions. ``last``: the step found before, tried first where it is within 1e-9 of the estimate (a run whose
    launches go untaken, e.g. none launched, reads the step every calculation: one check then, not the search)."""
    target = x.tobytes()
    if last is not None and abs(last - dt) <= 1e-9 * dt and (prev + last * p / m).tobytes() == target:
        return last
    fs = units.fs
    candidates = [round(dt / fs, digits) * fs for digits in (3, 6, 9)]
    up = down = dt
    for _ in range(EXACT_STEP_ULPS):
        up, down = math.nextafter(up, math.inf), math.nextafter(down, 0.0)
        candidates += (up, down)
    candidates.insert(3, dt)
    for c in candidates:
        if c > 0.0 and (prev + c * p / m).tobytes() == target:
            return c
    return dt
