"""``ForceEngine``: energies of a batch, then forces (and stress) from one ``torch.autograd.grad`` call.

Stress is σ = (1/V) ∂E/∂ε for a homogeneous strain ε, taken from the same ``autograd.grad`` call: it also
differentiates with respect to the shift vectors, which gives the gradient over every pair vector r_ij, and
∂E/∂ε = Σ r_ij ⊗ ∂E/∂r_ij per structure (``engine_padded.edge_virial``). ASE's sign convention (pressure =
−trace(σ)/3, as ``ase.Atoms.get_stress`` reports); Voigt order xx, yy, zz, yz, xz, xy.

Modes (``mode=``):

* ``"eager"`` (default): neighbour list → model → one ``autograd.grad``, on the batch's own shapes.
* ``"cudagraph"``: the batch graph is padded into a static-shape bucket (:mod:`mlff_distiller.buckets`) and the
  whole step (forward + the single ``autograd.grad``) is captured once per bucket as a CUDA graph and replayed
  (:mod:`mlff_distiller.cudagraph`); with ``compile_mode`` set, the captured step runs ``torch.compile``d code.
* ``"compile"``: padded buckets through ``torch.compile(dynamic=False, mode=compile_mode)``, where
  ``compile_mode`` is ``"default"``, ``"reduce-overhead"`` (torch's own CUDA graphs) or ``"max-autotune"``.
* ``"auto"``: ``"cudagraph"`` on CUDA, ``"eager"`` elsewhere. Its default ladder stops at
  :func:`auto_max_edges` edges (edges x the student's width up to ``AUTO_MAX_EDGE_FEATURES``: 2^21 edges for a
  student 128 or fewer features wide, ~38,000 water atoms at 5 Å; fewer for wider ones): larger batches run eager.
  End to end a replay beat the eager step at every size measured below that (1.18-2.67x on an H200,
  benchmarks/results/stop52_gpu/b/probe_capture_limit.md); the limit bounds the captured pools' memory.

The neighbour list always runs outside any graph (its size changes); its output is padded into the bucket.
Padded modes serve energy + forces, and stress too: a call with ``stress=True`` runs a second step per bucket
that also returns the strain derivative (its own captured graph; NPT and cell relaxations in ASE replay it every
step, and with a Verlet skin the list is kept across small cell changes). A call without forces, or a batch beyond
the largest bucket, runs the eager path. On a CPU, ``"cudagraph"`` and ``"compile"`` (unless ``compile_backend``
is given) warn and run the padded eager path, so CPU-only machines never break.

Precisions (``precision=``): ``fp64``, ``fp32`` (float32 accuracy in every dot), ``tf32`` (TF32 tensor-core
matmuls, sm80+), ``bf16`` (sm80+) and ``fp16``. The last two run the atom-wise MLP matmuls with 16-bit inputs and
weights and float32 accumulation, and return float32, while positions, shift vectors, edge geometry, the radial
filter, message aggregation, residual feature streams, energies and the force accumulation stay in float32. On the
Triton kernels the GEMMs round their float32 tiles to 16 bits in registers (every fusion kept; see
``kernels/_precision.py``) and the message-passing dots take one TF32 pass, as under ``tf32``; elsewhere (the torch
kernels, torch.compile'd steps) the MLP layers become 16-bit copies for cuBLAS. (Not ``torch.autocast``: it would
hand the message-passing kernel mixed dtypes and re-cast every weight on every call.) One small molecule's dense
step (``dense_small``) computes strict float32 under ``tf32``, ``bf16`` and ``fp16`` too: faster there than their
model step, and within their tolerances. An unsupported precision warns and falls back to ``fp32``.
``TOLERANCES`` documents the accepted
deviation from fp64 (the tests enforce it; the benchmark writes the measured error table).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import time
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import ClassVar

import torch

from mlff_distiller import batch as batch_module
from mlff_distiller import kernels
from mlff_distiller.batch import AtomsBatch
from mlff_distiller.buckets import (
    Bucket,
    BucketLadder,
    PaddedGraph,
    far_shift,
)
from mlff_distiller.compile_cache import configure_compile_cache, kernels_source_digest, raise_recompile_limit
from mlff_distiller.cudagraph import GraphRunner, cuda_graphs_available
from mlff_distiller.devices import KeptCopies, default_device, resolve_device
from mlff_distiller.engine_budget import (  # noqa: F401 - the budget constants stay importable from here
    DEFAULT_ATOM_BUDGET,
    DEFAULT_MEMORY_FRACTION,
    EDGES_PER_ATOM_GUESS,
    OOM_CAP_LIFT,
    BudgetMixin,
)
from mlff_distiller.engine_eager import EagerPaths
from mlff_distiller.engine_padded import DENSE_SLOTS, PaddedPaths
from mlff_distiller.engine_verlet import VerletPaths
from mlff_distiller.model import StudentModel
from mlff_distiller.model import analytic as analytic_path
from mlff_distiller.model.painn import CSRInteraction
from mlff_distiller.neighbors import VerletNeighborList
from mlff_distiller.precision import (
    AUTOCAST,
    PRECISIONS,
    TOLERANCES,
    _reduced_precision_copy,
    _resolve_precision,
)

__all__ = [
    "AUTO_MAX_EDGES",
    "AUTO_MAX_EDGES_CAP",
    "AUTO_MAX_EDGE_FEATURES",
    "COMPILE_MODES",
    "MODES",
    "PRECISIONS",
    "TOLERANCES",
    "ForceEngine",
    "auto_max_edges",
    "configure_compile_cache",
    "default_device",
    "kernels_source_digest",
]

MODES = ("eager", "compile", "cudagraph", "auto")
# Mode "auto" pads a graph into a CUDA-graph bucket while its edges times the student's width stay within
# AUTO_MAX_EDGE_FEATURES, with at least AUTO_MAX_EDGES and at most AUTO_MAX_EDGES_CAP edges (auto_max_edges); larger
# graphs run eager. End to end (ForceEngine.compute: the list, the batch's preparation, the step, the results on the
# host), a captured step beat the eager one at every size measured up to 2^21 edges, for both shipped widths: 128
# wide, 12,000 / 18,000 / 24,000 / 36,000 water atoms (674k / 970k / 1.31M / 2.0M edges) 1.99 / 1.64 / 1.21 / 1.18x;
# 64 wide 2.67 / 2.22 / 2.01 / 1.56x (H200, benchmarks/results/stop52_gpu/b/probe_capture_limit.md). An eager step
# costs several ms of host launches on these hosts that a call's own host work (list, fill, copies) cannot hide.
# Stop 51 had set 1e8 (781,250 edges at 128 wide) from the step alone on a prepared graph, where the 128-wide
# 18,000 / 24,000-atom replays ran 0.97 / 0.95x of eager (stop51_gpu/probe_eager_host_sizes.md); until stop 51 the
# limit was 2^19 edges for every width. What remains is memory: a captured bucket keeps its private pool for the
# engine's life (peak 1.47 GB for the 128-wide 24,000-atom box captured against 1.36 eager, 2.20 against 2.07 GB
# at 36,000), and that grows with atoms x width. So 2^21 edges at 128 wide, proportionally fewer for wider students.
AUTO_MAX_EDGE_FEATURES = 2**21 * 128
AUTO_MAX_EDGES = 2**19
AUTO_MAX_EDGES_CAP = 2**21


def auto_max_edges(hidden: int | None) -> int:
    """The largest edge count mode "auto" captures for a student ``hidden`` features wide (None: 128): see
    AUTO_MAX_EDGE_FEATURES. 128 wide or narrower: 2^21 edges (~38,000 water atoms at 5 Å); 256 wide: 2^20."""
    width = 128 if hidden is None else max(1, int(hidden))
    return max(AUTO_MAX_EDGES, min(AUTO_MAX_EDGES_CAP, AUTO_MAX_EDGE_FEATURES // width))


# The extra atom rung below the ladder's 64 (BucketLadder.small_atoms) of a CUDA engine whose GEMMs are Triton's
# (the 64 is for cuBLAS's 16-row kernels, which those engines do not launch). H200, each against the 64-atom
# bucket in the same run (benchmarks/results/stop46_gpu/probe_ncu_sweep_ladder.md): benzene 1.016x and 4 g2
# molecules 1.022x at 32 atoms; at 16, 0.986x / 1.023x. An extra rung, not min_atoms=32: that ladder's rungs above
# move too (the 193 atoms of a 192-atom water box would pad to 240 instead of 200).
SMALL_ATOMS_RUNG = 32
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")
# Eager batches of at least this many atoms are sorted along a Morton curve before their neighbour list is built
# (mlff_distiller.ordering): the 24,000-atom water step ran 1.12x faster Morton-sorted, 3,000 atoms gained nothing
# (benchmarks/results/probe_locality_h100/). Between the two; not measured closer.
SPATIAL_SORT_MIN_ATOMS = 10_000


def _takes(model, name: str) -> bool:
    """Whether ``model``'s forward takes the keyword ``name`` (False where its signature cannot be read)."""
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _default_ladder(engine: ForceEngine, requested_mode: str) -> BucketLadder:
    """The padded modes' ladder when the caller gives none: up to :func:`auto_max_edges` edges for mode "auto"
    (the student's width); with the SMALL_ATOMS_RUNG on a CUDA engine whose GEMMs are Triton's."""
    ladder = {}
    if requested_mode == "auto":
        config = getattr(getattr(engine, "model", None), "config", None)
        ladder["max_edges"] = auto_max_edges(getattr(config, "hidden", None))
    if engine.device.type == "cuda" and engine._triton_gemms():
        ladder["small_atoms"] = (SMALL_ATOMS_RUNG,)
    return BucketLadder(**ladder)


class ForceEngine(EagerPaths, PaddedPaths, VerletPaths, BudgetMixin):
    """Energy, forces and stress for batches of structures with a :class:`StudentModel`.

    Args:
        model: the student (it is copied only if it must change device or dtype; padded modes keep their own
            frozen copy, so later edits of ``model`` do not reach captured graphs).
        device: ``"cuda"``, ``"cpu"``, ... (default: CUDA when available).
        precision: ``"fp64"``, ``"fp32"``, ``"tf32"``, ``"bf16"`` or ``"fp16"`` (see the module docstring).
        neighbor_method: neighbour-list backend (``"auto"``, ``"brute"``, ``"cell_list"``).
        neighbor_skin: Verlet skin, Å (None: a fresh list every call). The list is built at cutoff + skin and
            reused until an atom moved more than skin/2, the atoms or species changed, or a cell change (NPT, cell
            filters) no longer fits in the skin with the displacements; results are the same as with a fresh list
            (see :class:`~mlff_distiller.neighbors.VerletNeighborList`).
        mode: ``"eager"``, ``"compile"``, ``"cudagraph"`` or ``"auto"`` (see the module docstring).
        compile_mode: for ``"compile"``: ``"default"`` (when None), ``"reduce-overhead"`` or ``"max-autotune"``;
            for ``"cudagraph"``: None captures eager kernels, ``"default"``/``"max-autotune"`` captures compiled
            code (Inductor's own CUDA graphs are switched off inside ours).
        compile_backend: ``torch.compile`` backend (default ``"inductor"``); giving one also enables
            ``"compile"`` on a CPU (e.g. ``"aot_eager"`` in tests).
        buckets: the :class:`BucketLadder` of padded modes (default ``BucketLadder()``; for ``mode="auto"``
            one that stops at :func:`auto_max_edges` edges for the model's width).
        pad: pad eager runs into buckets too (default: only the padded modes pad).
        memory_budget: bytes :meth:`predict` may plan for one batch (default on CUDA: half the free memory at
            first use; on other devices an atom budget of 2048).
        cache_dir: persistent compile cache directory (see :func:`configure_compile_cache`).
        compact_edges: padded modes: drop the pairs beyond the cutoff inside each step
            (:func:`mlff_distiller.kernels.edge_compact`, three small kernels), so that the message passing walks
            only the pairs within it. Default: on with a Verlet skin (its list holds the pairs out to
            cutoff + skin, ~70 % more at 5 Å + 1 Å) unless the step is compiled; same results either way.
        spatial_sort_min_atoms: eager batches of at least this many atoms (default ``SPATIAL_SORT_MIN_ATOMS``) run
            with each structure's atoms sorted along a Morton curve (neighbours close in memory: fewer cache
            misses in the message passing); per-atom results come back in the caller's order, the same results
            up to the order of floating-point sums. None: never. With a Verlet skin (MD) the order is made from
            the first frame and kept for the system.
        analytic: eager steps compute forces and stress with the backward written out
            (:mod:`mlff_distiller.model.analytic`) instead of ``autograd.grad``; the same numbers up to the order
            of floating-point sums. Default: on a CPU (where the step is bound by the overhead of small operations),
            for a student of the plain architecture; False: always autograd.
        capture_after: ``"cudagraph"``: a bucket's first ``capture_after`` calls run its padded step eagerly (the
            same results) and the next one captures it. 0 (default) captures at first use; ``predict_forces`` and
            ``predict_file`` use 1, because a stream of varied batches meets most large buckets once and a capture
            costs ~25 of their steps (100,000 g2 molecules: 20 buckets, 2.9 s of captures). ``warmup`` always
            captures.
        dense_small: padded steps of one non-periodic molecule of at most ``DENSE_MAX_ATOMS`` (64) atoms take the
            dense step (:mod:`mlff_distiller.kernels.dense_step`: two launches a layer, one program per atom, all pairs
            within the cutoff, no neighbour list) instead of the model's forward and ``autograd.grad``; the same
            energies and forces to float32 rounding. Default (None): on CUDA for a student of the shipped
            architecture up to ``DENSE_MAX_HIDDEN`` (64) features, where it measured faster (64 x 3 on an H200,
            stop 72: benzene 49 against 130 µs, biphenyl 61 against 135, C60 106 against 142; 128 x 3 at stop 73:
            benzene 155 against 157, biphenyl 298 against 164, so not there); True: also wider students; False:
            never. Under ``tf32``, ``bf16`` and ``fp16`` it computes in strict float32 (within their tolerances,
            and faster than the model's step in them: one g2 molecule 52 against 117 µs in tf32 and 116 in bf16,
            64 x 3, stop 73), where the model keeps float32 weights (the Triton GEMMs'; the torch kernels' 16-bit
            copy of the MLP layers does not take it).
    """

    # A call on the very batch launched ahead (the calculator's steady MD step) takes the launch without the general
    # path's checks where identities and counters show nothing changed (VerletPaths._take_launched); False: every
    # call goes the general path (tests and probes compare the two).
    express_take: ClassVar[bool] = True
    # The calculator's MD step queues the step after the one it takes, with its positions predicted on the device
    # (VerletPaths.chain_ahead, mlff_distiller._md_chain); False: the host predicts and launches after each step.
    chain: ClassVar[bool] = True
    # Where the calculator would predict the chained step's positions on the host only to compare them with the
    # device's, it keeps the chained step without (VerletPaths.keep_chained) and the next call compares its own
    # positions with the device's; False: the host predicts them every step (probes time the two).
    keep_chained_steps: ClassVar[bool] = True

    def __init__(
        self,
        model: StudentModel,
        *,
        device: torch.device | str | None = None,
        precision: str = "fp32",
        neighbor_method: str = "auto",
        mode: str = "eager",
        compile_mode: str | None = None,
        compile_backend: str | None = None,
        buckets: BucketLadder | None = None,
        pad: bool | None = None,
        memory_budget: int | None = None,
        cache_dir: str | Path | None = None,
        neighbor_skin: float | None = None,
        compact_edges: bool | None = None,
        spatial_sort_min_atoms: int | None = SPATIAL_SORT_MIN_ATOMS,
        analytic: bool | None = None,
        capture_after: int = 0,
        dense_small: bool | None = None,
    ) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"unknown precision {precision!r}; choose one of {sorted(PRECISIONS)}")
        if not isinstance(model, StudentModel):
            raise ValueError(f"ForceEngine needs a StudentModel, got {type(model).__name__}")
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose one of {MODES}")
        if compile_mode is not None and compile_mode not in COMPILE_MODES:
            raise ValueError(f"unknown compile_mode {compile_mode!r}; choose one of {COMPILE_MODES}")
        if buckets is not None and not isinstance(buckets, BucketLadder):
            raise ValueError(f"buckets must be a BucketLadder, got {type(buckets).__name__}")
        if memory_budget is not None and int(memory_budget) < 1:
            raise ValueError(f"memory_budget must be a positive number of bytes, got {memory_budget}")
        if spatial_sort_min_atoms is not None and (
            isinstance(spatial_sort_min_atoms, bool) or int(spatial_sort_min_atoms) < 1
        ):
            raise ValueError(f"spatial_sort_min_atoms must be None or an atom count >= 1, got {spatial_sort_min_atoms}")
        if isinstance(capture_after, bool) or int(capture_after) < 0:
            raise ValueError(f"capture_after must be a count of calls >= 0, got {capture_after}")
        self.capture_after = int(capture_after)
        # A capture that runs out of memory: raised for the batch splitting (predict), or, for a caller whose batch
        # cannot be split (BatchedMD sets it), that bucket's step left eager (engine_padded._capture).
        self.oom_eager = False
        # Buckets of more edges than this are left eager when their capture runs out of memory, whatever oom_eager
        # says: mode "auto" ran them eagerly until stop 51 (auto_max_edges), and a large bucket's private pool is
        # the largest, so its step falls back to what it was rather than failing the call.
        self.oom_eager_edges = AUTO_MAX_EDGES
        # Captured graphs released to make room (release_captures): after an out-of-memory capture, once per
        # engine (a second would trade captures back and forth between buckets that do not fit together).
        self.captures_released = 0
        self._released_for_capture = False
        self._eager_uses: dict[tuple[Bucket, bool], int] = {}  # (bucket, stress step): eager calls before capture
        self._capture_now = False  # warmup: capture new buckets at once
        self._idle_dry_runs = {False: 0, True: 0}  # per step kind: dry runs in a row that compiled nothing
        self.spatial_sort_min_atoms = None if spatial_sort_min_atoms is None else int(spatial_sort_min_atoms)
        self.device = resolve_device(device)
        if self.device.type == "cuda" and self.device.index is None and torch.cuda.is_available():
            # "cuda" → "cuda:<current>": tensors always carry an index, and every same-device test below compares
            # devices (an unindexed engine device made a batch already on the GPU look foreign).
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.requested_precision = precision
        self.precision = _resolve_precision(precision, self.device)
        self.dtype, self.allow_tf32 = PRECISIONS[self.precision]
        self.autocast_dtype = AUTOCAST.get(self.precision)
        self.neighbor_method = neighbor_method
        # A Verlet-skin list (exact: rebuilt when an atom moved > skin/2 or the system changed) for callers that
        # evaluate the same system step after step (MD through StudentCalculator).
        self.verlet = (
            None
            if neighbor_skin is None
            else VerletNeighborList(cutoff=model.cutoff, skin=float(neighbor_skin), method=neighbor_method)
        )
        p = next(model.parameters())
        if p.device != self.device or p.dtype != self.dtype:
            model = copy.deepcopy(model).to(device=self.device, dtype=self.dtype)
        self.cache_dir = configure_compile_cache(cache_dir) if cache_dir is not None else None

        self.requested_mode = mode
        self.mode = self._resolve_mode(mode, compile_mode, compile_backend)
        self.compile_mode = compile_mode
        # bf16 / fp16: the Triton GEMMs multiply 16-bit roundings of their float32 tiles (kernels/_precision.py),
        # keeping every fusion; where they do not run (the torch kernels, torch.compile'd steps) the model's MLP
        # layers become 16-bit copies for cuBLAS instead.
        self.kernel_matmul_dtype = None
        if self.autocast_dtype is not None:
            if self._triton_gemms():
                self.kernel_matmul_dtype = self.autocast_dtype
            else:
                model = _reduced_precision_copy(model, self.autocast_dtype)
        self.model = model.eval()
        self._params = list(self.model.parameters())  # for _frozen
        # The CPU's eager step: the backward written out, 1.10-1.39x faster than autograd's from ethanol to 384-atom
        # water clusters (benchmarks/results/cpu_analytic_ab.md); GPUs keep their fused kernels and captured steps.
        if analytic is None:
            analytic = self.device.type == "cpu"
        self.analytic = bool(analytic) and analytic_path.supports(self.model)
        self._analytic_guard = analytic_path.Guard(self.model) if self.analytic else None
        self.n_analytic = 0  # eager steps that took it
        self.compile_backend = compile_backend or "inductor"
        self.pad = (self.mode != "eager") if pad is None else bool(pad)
        if self.mode != "eager" and not self.pad:
            raise ValueError(f"mode {self.mode!r} needs static shapes: pad=False is only valid for mode='eager'")
        self.buckets = _default_ladder(self, requested_mode=mode) if buckets is None else buckets
        self.memory_budget = None if memory_budget is None else int(memory_budget)
        self.oom_splits = 0  # batches split after an out-of-memory error (see predict)
        self._atom_budget_cap: int | None = None  # lowered after an OOM so later batches start smaller
        self._atom_budget_at_oom = 0  # the uncapped atom budget found at that OOM (see atom_budget)
        self._bytes_scale = 1.0  # measured / analytic memory, from probe_memory()
        self._graphs: dict[Bucket, PaddedGraph] = {}
        self._runners: dict[Bucket, GraphRunner] = {}
        # the dense step's, per slot count (PaddedPaths._dense_of)
        self._dense_runners: dict[int, dict[Bucket, GraphRunner]] = {np_: {} for np_ in DENSE_SLOTS}
        self._dense_calls: dict = {}
        # eager step kinds and size classes whose dry run has run (_eager_dry_run_due)
        self._eager_compiled_ahead: set[tuple[bool, bool, int, int]] = set()
        self._stress_runners: dict[Bucket, GraphRunner] = {}  # the steps with the strain derivative
        # Page-locked host copies of the packed outputs, per (bucket, stress step).
        self._host_out: dict[tuple[Bucket, bool], torch.Tensor] = {}
        # Padded Verlet path (MD): the step captured with its positions read from, and its packed output written
        # to, host buffers in place (cudagraph.HostBuffer), per (bucket, real atoms); see VerletPaths._md_launch.
        # None: on CUDA where the device addresses them (checked once: _zero_copy_works); True/False force it (the
        # tests run it on the CPU, where the buffers are plain tensors).
        self.zero_copy: bool | None = None
        self._zero_copy_works: bool | None = None
        self._md_runners: dict[tuple[Bucket, int], object] = {}
        self._topology: tuple | None = None
        self._checked_numbers: torch.Tensor | None = None
        self._checked_source: tuple | None = None  # (tensor, version) of the numbers last checked
        self._verlet_perm: dict | None = None  # the Verlet path's spatial order (see _verlet_order)
        self._verlet_sorted: bool | None = None  # the order the Verlet list was built in (see _verlet_list_order)
        self.last_bucket: Bucket | None = None  # the bucket of the latest padded call
        # Padded Verlet path: (bucket, graph, verlet build count) of the list now in the static buffers.
        self._verlet_fill: tuple | None = None
        # Padded Verlet path: launch the step on the current list before the displacement test, which then runs on
        # the host while the device computes (a rebuild discards that result and runs again). None: on CUDA, for
        # positions given on the host; True/False force it (tests run it on the CPU). Positions on the device
        # (BatchedMD) are not speculated on: their test is device work queued behind the launched step, so the
        # host would wait for the whole step before it could queue anything else (64 g2 molecules: 0.85 against
        # 0.69 ms a step, benchmarks/results/batched_md_h100_run4/).
        self.speculative_verlet: bool | None = None
        self._while_running = None  # compute's while_running, until run (see _overlap)
        self.capture_failures = 0  # CUDA-graph captures that failed: invalidated (retried) or out of memory (oom_eager)
        self.n_speculated = 0  # steps launched before the displacement test
        self.n_discarded = 0  # speculative steps thrown away because the list was rebuilt (or took a new cell)
        # Steps launched ahead by the caller on positions it predicted (launch_ahead), and how the next call found
        # them: the same positions (taken) or others (thrown away). last_ahead: the last call's (None: none launched).
        self._ahead = None  # engine_verlet._Launch
        self.n_ahead_taken = 0
        self.n_ahead_missed = 0
        self.last_ahead: bool | None = None
        # A launch ahead whose positions would rebuild the Verlet list rebuilds it then, before the launch (instead
        # of launching on the old list, which the next call would throw away to rebuild): rebuild_ahead; the lists
        # so built: n_rebuilt_ahead.
        self.rebuild_ahead = True
        self.n_rebuilt_ahead = 0
        # The step after the one launched ahead, queued with its positions predicted on the device (chain_ahead):
        # the chains per Verlet bucket and atom count, the one queued in this call (_chained), the step the last
        # call took (_taken_md), and counts of queued, kept and dropped ones.
        self._md_chains: dict = {}
        self._chained = None  # engine_verlet._Chained
        self._chain_event = None
        self._taken_md = None
        self._n_computes = 0
        self.n_chained = 0
        self.n_chain_adopted = 0
        self.n_chain_dropped = 0
        self.n_chain_kept = 0  # of the adopted ones, kept without the caller's prediction (keep_chained)
        self._takeable = None  # chain_ahead's _launch_takeable answer (yes) for this call's batch: _takeable_key
        self._ahead_tested = False  # the step launched ahead that this call took had its displacement test run
        self._verlet_inputs = KeptCopies()  # VerletPaths._fill_inputs: a Verlet fill's numbers and batch vector
        self._spec_cell: torch.Tensor | None = None  # the cell tensor of the last Verlet-path call
        self._topology_token = 0
        self._graph_tokens: dict[Bucket, int] = {}
        self._fast_model: StudentModel | None = None
        # Our neighbour lists are full lists: the message backward walks their receiver rows for the senders (no
        # sender sort in a step, none in a bucket's fill). Fixed for the engine's life (its buckets follow it).
        self._symmetric = kernels.symmetric_walk()
        # The eager step passes the promise where the model's forward takes it (a subclass may override forward).
        self._symmetric_kw = {"symmetric_edges": True} if self._symmetric and _takes(model, "symmetric_edges") else {}
        self._forward_impl = None
        # The dense step (kernels/dense_step.py) for one small molecule in a padded bucket: PaddedPaths._dense_of.
        self.dense_small = dense_small
        self._dense = None
        self.compact_edges = False
        if self.pad:
            # A private frozen copy: no parameter graph, no per-call requires_grad toggling, and captured
            # graphs keep pointing at weights nobody else mutates.
            self._fast_model = copy.deepcopy(self.model).eval()
            for q in self._fast_model.parameters():
                q.requires_grad_(False)
            compiled = self.mode == "compile" or (self.mode == "cudagraph" and compile_mode is not None)
            # The dense step packs its weights from the frozen copy before its blocks are wrapped below.
            self._dense = self._make_dense(dense_small, compiled, self._fast_model)
            # symmetric: the buckets hold NeighborLists (full lists) and padding past the CSR rows
            self._csr: dict = {"row_ptr": None, "sender": None, "symmetric": self._symmetric}
            inter = self._fast_model.interactions
            for k in range(len(inter)):
                inter[k] = CSRInteraction(inter[k], self._csr)
            self._forward_impl = self._padded_forward
            # Decided before compiling: the compiled step traces this flag.
            self.compact_edges = (self.verlet is not None and not compiled) if compact_edges is None else compact_edges
            self._far = far_shift(self.cutoff)
            if compiled:
                self._forward_impl = self._make_compiled()

    # ------------------------------------------------------------------------------------------ setup
    def _triton_gemms(self) -> bool:
        """Whether the model's atom-wise GEMMs run on the Triton kernels here: the Triton backend (on a CPU, the
        interpreter), no torch.compile (which traces the torch ops instead), float32."""
        compiled = self.mode == "compile" or self.compile_mode is not None
        triton = kernels.resolve_backend(self.device) == "triton"
        return triton and not compiled and self.dtype == torch.float32

    def _resolve_mode(self, mode: str, compile_mode: str | None, compile_backend: str | None) -> str:
        on_cuda = self.device.type == "cuda"
        if mode == "auto":
            return "cudagraph" if cuda_graphs_available(self.device) else "eager"
        if mode == "cudagraph":
            if compile_mode == "reduce-overhead":
                raise ValueError(
                    "mode='cudagraph' captures its own graph: use compile_mode 'default' or "
                    "'max-autotune' (or mode='compile' with 'reduce-overhead')"
                )
            if not cuda_graphs_available(self.device):
                warnings.warn(
                    f"CUDA graphs need a CUDA device (engine on {self.device}); running the padded eager path instead",
                    RuntimeWarning,
                    stacklevel=3,
                )
                return "padded-eager"
        if mode == "compile" and not on_cuda and compile_backend is None:
            warnings.warn(
                f"mode='compile' targets CUDA (engine on {self.device}); running the padded eager path "
                "instead (pass compile_backend=... to compile on this device anyway)",
                RuntimeWarning,
                stacklevel=3,
            )
            return "padded-eager"
        return mode

    def _make_compiled(self):
        raise_recompile_limit()
        cm = self.compile_mode or "default"
        if self.mode == "cudagraph" and cm == "max-autotune":
            cm = "max-autotune-no-cudagraphs"  # our own graph captures it; Inductor's must stay off
        kwargs = dict(dynamic=False, backend=self.compile_backend)
        if self.compile_backend == "inductor":
            kwargs["mode"] = cm
        return torch.compile(self._padded_forward, **kwargs)

    @property
    def cutoff(self) -> float:
        return self.model.cutoff

    # ------------------------------------------------------------------------------------------ eager path
    def compute(
        self,
        batch: AtomsBatch,
        *,
        forces: bool = True,
        stress: bool = False,
        to_host: bool = False,
        as_numpy: bool = False,
        while_running: Callable[[], object] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Run one batch. Returns tensors on the engine's device (on the CPU with ``to_host``, in one copy
        on the padded path):

        ``energy [B]`` eV (float64 in every precision: the float64 sums of the atomic energies),
        ``atomic_energies [N]`` eV, ``forces [N, 3]`` eV/Å (if ``forces``), and
        ``stress [B, 6]`` eV/Å³ Voigt (if ``stress``; meaningful only for fully periodic structures, whose
        mask is ``stress_valid [B]``). Forces and stress come from a single ``autograd.grad`` call.

        ``as_numpy`` (implies ``to_host``): NumPy arrays (the energies float64, the rest in the engine's dtype)
        instead of CPU tensors; the
        padded path unpacks its one host copy in NumPy (views of it, as the tensors were), a few µs less per
        call than torch slicing (the calculator's MD step).

        ``while_running``: host work of the caller's that does not touch the batch, called at most once: right
        after the step is launched where the device computes ahead of the host (the padded Verlet path's
        speculative launch), else when the results are ready. A call that raises before that point never runs it.
        """
        self._while_running = while_running
        self.last_ahead = None
        self._taken_md = None
        self._n_computes += 1
        try:
            out = None
            if (
                self._ahead is not None
                and forces
                and not stress
                and (to_host or as_numpy)
                and self.pad
                and self.express_take
            ):
                out = self._take_launched(batch, as_numpy)
            if out is None:
                out = self._compute(batch, forces, stress, to_host, as_numpy)
        except BaseException:
            self._while_running = None
            raise
        finally:
            self._ahead_tested = False
            if self._ahead is not None:  # a step launched ahead that this call did not take: never taken later
                self._ahead = None
                self.n_ahead_missed += 1
                self.last_ahead = False
        self._overlap()  # unless the padded Verlet path ran it already
        return out

    def _overlap(self) -> None:
        """Run the caller's ``while_running`` work now (once; see :meth:`compute`)."""
        pending, self._while_running = self._while_running, None
        if pending is not None:
            pending()

    def _compute(self, batch: AtomsBatch, forces: bool, stress: bool, to_host: bool, as_numpy: bool) -> dict:
        to_host = to_host or as_numpy
        self._check_species(batch.numbers)
        batch = self._exact_float64_batch(batch)
        # A system the eager path sorts spatially runs there (a Verlet list must see one atom order at a time)...
        sorts = self.spatial_sort_min_atoms is not None and batch.num_atoms >= self.spatial_sort_min_atoms
        if sorts and self.pad and forces and self.verlet is not None:
            # ...but MD of a large system whose Verlet list fits the ladder takes the padded (captured) path, in the
            # caller's order: an eager step costs ~10 ms of host launches on stop 51's H200 host, more than the
            # device work of a 64-wide student's 24,000-atom step (7.7 ms captured against 11.4 eager,
            # benchmarks/results/stop51_gpu/probe_eager_host.md). A list beyond the ladder (or the first call's,
            # when the padded path finds no bucket for it) goes on eagerly in Morton order; the list is rebuilt
            # whenever the order changes (_verlet_list_order).
            last = self.verlet.last
            sorts = last is not None and self.buckets.select(batch.num_atoms, last.num_edges) is None
        if self.pad and forces and stress:
            # Stress (NPT, cell relaxations, periodic batches): the padded step with the strain derivative. In MD
            # the Verlet list is kept across small cell changes (strain-aware test), else a fresh list per call.
            if self.verlet is not None and not sorts:
                out = self._compute_padded_verlet(batch, to_host, stress=True)
            else:
                out = self._compute_padded(batch, to_host, stress=True)
            if out is not None:
                return {k: v.numpy() for k, v in out.items()} if as_numpy else out
        elif self.pad and forces:
            if self.verlet is not None:
                out = None if sorts else self._compute_padded_verlet(batch, to_host, as_numpy)
            else:
                out = self._compute_padded(batch, to_host)
                if out is not None and as_numpy:
                    out = {k: v.numpy() for k, v in out.items()}
            if out is not None:
                return out
        out = self._compute_eager(batch, forces=forces, stress=stress)
        if as_numpy:
            return {k: v.detach().cpu().numpy() for k, v in out.items()}
        return {k: v.cpu() for k, v in out.items()} if to_host else out

    def _exact_float64_batch(self, batch: AtomsBatch) -> AtomsBatch:
        """A float64 batch for an engine of lower precision whose coordinates reach ``PRECISE_PAIRS_FROM``: its own
        positions and cell as ``positions64``, ``cell64``, so that the pair vectors are made from them in float64
        (``AtomsBatch.from_atoms`` in float32 does the same from its origin). Without it the engine took their
        float32 rounding in the caller's frame: a molecule 10,000 Å from the origin 0.016 eV/Å off. Host batches,
        and device batches of an engine that builds a fresh list every call (its list build waits for the device
        anyway). With a Verlet list (MD, relaxations) a device batch is left as it is: there the test would add a
        sync to a step that needs none, and the callers decide (``BatchedMD``, ``relax_batch``, the calculator)."""
        if batch.device.type != "cpu" and self.verlet is not None:
            return batch
        if not batch_module.needs_float64_pairs(batch, self.dtype):
            return batch
        return dataclasses.replace(batch, positions64=batch.positions.detach(), cell64=batch.cell.detach())

    def _check_species(self, numbers: torch.Tensor) -> None:
        """``model.check_species``, skipped when the numbers equal the last ones checked (MD: every step); the
        very same tensor, not modified in place since (the calculator's MD batches), skips the compare too."""
        src = self._checked_source
        if src is not None and src[0] is numbers and src[1] == numbers._version:
            return
        last = self._checked_numbers
        if last is not None and last.shape == numbers.shape and last.device == numbers.device:
            if torch.equal(last, numbers):
                self._checked_source = (numbers, numbers._version)
                return
        self.model.check_species(numbers)
        self._checked_numbers = numbers.detach().clone()
        self._checked_source = (numbers, numbers._version)

    # ------------------------------------------------------------------------------------------ warm-up
    def warmup(
        self,
        buckets: Iterable[Bucket | tuple[int, int]] | None = None,
        structures: Iterable | None = None,
        *,
        stress: bool = False,
    ) -> dict[Bucket, float]:
        """Compile / capture chosen buckets now rather than on first use.

        Args:
            buckets: :class:`Bucket` s or ``(n_atoms, n_edges)`` sizes (the ladder bucket holding them).
            structures: ``ase.Atoms`` or sequences of them; each is one batch whose bucket is warmed (in eager
                mode they are simply run once, which compiles this package's Triton kernels).
            stress: warm the steps with the strain derivative (what ``compute(..., stress=True)`` runs: NPT,
                cell relaxations) instead of the energy + forces steps.
        Returns:
            Seconds spent per bucket (wall clock, synchronised; the dry run that compiles the Triton kernels of
            several buckets at once is split evenly over them).
        """
        todo: list[Bucket] = []
        for item in buckets or ():
            if isinstance(item, Bucket):
                todo.append(item)
                continue
            n, e = (int(x) for x in item)
            bucket = self.buckets.select(n, e)
            if bucket is None:
                raise ValueError(f"warmup: no bucket holds {n} atoms and {e} edges (ladder {self.buckets})")
            todo.append(bucket)
        if todo and not self.pad:
            raise ValueError("warmup(buckets=...) needs a padded mode (mode='cudagraph'/'compile' or pad=True)")
        times: dict[Bucket, float] = {}
        for s in structures or ():
            batch = AtomsBatch.from_atoms(s, dtype=self.dtype)
            t0 = time.perf_counter()
            self.last_bucket = None
            self._capture_now = True  # whatever capture_after says
            try:
                self.compute(batch, stress=stress)
            finally:
                self._capture_now = False
            self._sync()
            if self.last_bucket is not None:  # the bucket the call ran in (None: eager)
                times[self.last_bucket] = time.perf_counter() - t0
        todo = [b for b in dict.fromkeys(todo) if b not in times]
        captured = self._stress_runners if stress else self._runners
        step = self._step_stress if stress else self._step
        jobs = [(step, b) for b in todo if b not in captured]
        jobs += [(self._dense_call(np_), b) for b in todo for np_ in self._warm_dense_slots(b, stress)]
        if len(jobs) > 1 and self.mode == "cudagraph" and self.compile_mode is None:
            # One dry run over every bucket's step (and each dense step, compiled per slot count) compiles all their
            # Triton kernels on one thread pool (each capture below would otherwise compile its own in parallel, but
            # the captures one after another).
            inputs = [(fn, self._graph(b).inputs()) for fn, b in jobs]
            t0 = time.perf_counter()
            kernels.precompile(lambda: [fn(*x) for fn, x in inputs], device=self.device, for_capture=True)
            shared = (time.perf_counter() - t0) / len(todo)
        else:
            shared = 0.0
        for bucket in todo:
            t0 = time.perf_counter()
            self._run(bucket, self._graph(bucket), stress, capture=True)
            for np_ in self._warm_dense_slots(bucket, stress):  # (after _run, which may have captured one)
                runners = self._dense_runners[np_]
                runners[bucket] = self._capture(self._dense_call(np_), self._graph(bucket), bucket, runners)
            self._sync()
            times[bucket] = time.perf_counter() - t0 + shared
        return times

    def _warm_dense_slots(self, bucket: Bucket, stress: bool) -> list[int]:
        """The dense steps (their slot counts) that ``warmup`` captures in ``bucket`` beside its step: each of
        ``DENSE_SLOTS`` that the bucket holds and that is not captured there yet, so that a molecule of up to 64
        atoms captures nothing at its first call (each slot count compiles kernels of its own: a fresh process's
        first benzene result, 16 slots, took 3.96 s with an empty cache on the H200 host, stop 73). A capture
        records launches on the bucket's current content, whatever it is; a molecule's call replays them on its
        own. None where the dense step would not run: the energy + stress step, modes other than cudagraph, where
        :meth:`_dense_on` is not."""
        if stress or self.mode != "cudagraph" or not self._dense_on():
            return []
        return [np_ for np_ in DENSE_SLOTS if np_ <= bucket.atoms and bucket not in self._dense_runners[np_]]

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @property
    def captured_buckets(self) -> list[Bucket]:
        """Buckets with a captured CUDA graph (the MD path's zero-copy step included)."""
        dense = (b for runners in self._dense_runners.values() for b in runners)
        return sorted(set(self._runners).union(dense, (key[0] for key in self._md_runners)))
