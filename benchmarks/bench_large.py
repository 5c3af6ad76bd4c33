"""Large systems (issue 7): energy + forces, neighbour lists and the largest box that fits, ours vs the reference.

Sections, in this order, all in one time-boxed run (``--budget-s``; what the budget leaves out is listed as
skipped in the output, never silently dropped):

1. **Correctness** on the 192-atom water box before any timing: energies and forces of ours (ForceEngine eager,
   kernel backend ``auto``, i.e. Triton on CUDA; and the engine's best mode, ``auto``) against the reference
   (the same weights through the plain-PyTorch kernels, eager; ``reference`` in run_all.py / peers.py), fp32
   tolerance of ``engine.TOLERANCES``.
2. **Energy + forces** on water boxes (default 192, 3,000, 24,000 and 100,008 atoms, ~1 g/cm³): the compute
   step alone (model + one ``autograd.grad`` on a prepared graph: peers.StepImpl) for the reference, ours eager
   and ours in the best mode (captured CUDA-graph replay, only where a padded bucket holds the box), plus ours
   including the neighbour list (``engine.compute`` on a device-resident batch). Median time, µs/atom/step,
   peak GPU memory (``torch.cuda.max_memory_allocated`` over one call after a reset, minus what was allocated
   before the row built its inputs: batch, neighbour list, the step's transients), reference / ours ratio.
   An out-of-memory error is a row ("OOM at N atoms"), never a crash.
3. **Neighbour lists** (5 Å, float32 positions): brute force, our cell list (torch and Triton) and vesin-torch
   (if it imports) on one large box (24,000 atoms) and on 1,024 periodic boxes of 24 atoms (6.2 Å cells):
   ours in ONE batched call, vesin once per box (its raw i, j, S, and through our contract). Ours includes the
   receiver-sorted CSR output. Pair counts (and for our backends the edge lists) are checked to agree.
4. **Largest box that fits**: ours (ForceEngine eager, our cell list unless ``--grow-nl``; neighbour list +
   energy + forces) on growing boxes until an out-of-memory error, the per-call cap (``--grow-cap-s``) or the
   budget stops it.
5. **Targets** (issue 7, H100 fp32) as pass/fail rows.

Timing (after one untimed cold call and one warm call): ``harness.time_fn`` (``triton.testing.do_bench``: CUDA
events, warm-up, median) for calls under 50 ms; longer calls with CUDA events over as many calls as fit in
``--slow-budget-s`` (median); a warm call longer than that is reported alone, a cold call longer than
``--max-single-s`` as it is. Inputs are real water boxes
(``systems.water_box``; a vectorised builder of the same recipe above 24,000 atoms, where the per-molecule
loop would take minutes). Writes ``<out>/bench_large.md`` and ``<out>/bench_large.json`` and prints the table.

    python benchmarks/bench_large.py --out benchmarks/results/large_h100       # GPU, ~2-3 min
    python benchmarks/bench_large.py --quick --out /tmp/large                  # CPU smoke run, seconds
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import environment, time_fn
from peers import OursImpl, StepImpl, make_student
from systems import water_box

from mlff_distiller import AtomsBatch, ForceEngine, kernels
from mlff_distiller.engine import TOLERANCES
from mlff_distiller.neighbors import neighbor_list
from mlff_distiller.neighbors.cell_list_triton import triton_runnable
from mlff_distiller.neighbors.vesin_backend import _vesin_class, vesin_available

__all__ = ["Clock", "Timed", "is_oom", "main", "measure", "water_box_fast"]

CUTOFF = 5.0  # Å, the student's
EF_SIZES = (192, 3000, 24000, 100_008)
EF_SIZES_QUICK = (24, 48)
GROW_SIZES = (100_008, 250_002, 500_001, 1_000_002, 2_000_001)
GROW_SIZES_QUICK = (48, 96, 192)
# systems.water_box loops over molecules (~1.9 s at 24,000 atoms); above this the vectorised builder is used.
LOOP_BUILDER_MAX = 24_000
# Calls shorter than this go through harness.time_fn (do_bench); longer ones are timed call by call.
FAST_CALL_S = 0.05
MAX_SLOW_CALLS = 10
# Targets of issue 7 (H100, fp32).
TARGETS = {
    "ef_24k_ms": 10.0,
    "ef_24k_peak_gb": 4.0,
    "ef_3k_ms": 1.5,
    "nl_24k_ms": 0.7,
    "nl_small_ms": 2.0,
    "nl_small_vs_vesin": 100.0,
    "fit_atoms": 1_000_000,
}


# ------------------------------------------------------------------------------------------------- utilities
class Clock:
    """The run's time budget (s)."""

    def __init__(self, budget_s: float) -> None:
        self.t0 = time.perf_counter()
        self.budget_s = float(budget_s)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float:
        return self.budget_s - self.elapsed()


@dataclasses.dataclass
class Timed:
    """One measurement: median / quantiles (µs) over ``calls`` timed calls, the first (cold) call's time and
    its peak memory (bytes, absolute, None off CUDA), and the value the cold call returned."""

    median_us: float
    p20_us: float
    p80_us: float
    calls: int
    cold_us: float
    peak_bytes: int | None
    how: str  # "do_bench" | "events" | "cold only"
    result: object = None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device: torch.device) -> None:
    """Drop garbage and return cached blocks to the device (never raises: after a sticky CUDA error the results
    so far must still be written)."""
    gc.collect()
    if device.type == "cuda":
        try:
            torch.cuda.empty_cache()
        except RuntimeError as exc:
            print(f"empty_cache failed: {_err(exc)}", flush=True)


def is_oom(exc: BaseException) -> bool:
    """Out of device memory, however it surfaced (torch's allocator, cuBLAS workspaces, Triton launches)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    msg = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in msg or "alloc_failed" in msg)


def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:200]


def allocated(device: torch.device) -> int:
    """Bytes the caching allocator has handed out now (0 off CUDA)."""
    return int(torch.cuda.memory_allocated(device)) if device.type == "cuda" else 0


def _wall(fn: Callable[[], object], device: torch.device) -> tuple[float, object]:
    _sync(device)
    t0 = time.perf_counter()
    result = fn()
    _sync(device)
    return time.perf_counter() - t0, result


def measure(
    fn: Callable[[], object],
    device: torch.device,
    slow_budget_s: float,
    rep_ms: float = 100,
    base: int = 0,
    max_single_s: float = 20.0,
) -> Timed:
    """Time ``fn`` (see the module docstring).

    The first (cold) call pays for compilation, autotuning and captures; it gives the peak memory
    (``torch.cuda.max_memory_allocated`` over that call after a reset, minus ``base``: what was allocated before
    the caller built this measurement's inputs) and its result is kept for sanity checks. Only a cold call longer
    than ``max_single_s`` is reported as it is. Otherwise a second (warm) call decides the method: under 50 ms
    ``harness.time_fn`` (do_bench), over ``slow_budget_s`` that warm call alone, else CUDA events over as many
    calls as fit in ``slow_budget_s`` (at most 10), median."""
    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
    cold, result = _wall(fn, device)
    peak = int(torch.cuda.max_memory_allocated(device)) - base if device.type == "cuda" else None
    if cold > max_single_s:
        return Timed(cold * 1e6, cold * 1e6, cold * 1e6, 1, cold * 1e6, peak, "cold only", result)
    warm, _ = _wall(fn, device)
    if warm < FAST_CALL_S:
        t = time_fn(fn, device, rep_ms=rep_ms)
        return Timed(t.median_us, t.p20_us, t.p80_us, -1, cold * 1e6, peak, "do_bench", result)
    if warm > slow_budget_s:
        return Timed(warm * 1e6, warm * 1e6, warm * 1e6, 1, cold * 1e6, peak, "1 warm call", result)
    n = max(1, min(MAX_SLOW_CALLS, int(slow_budget_s / warm)))
    times = []
    for _ in range(n):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        else:
            t1 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t1) * 1e6)
    q = np.quantile(np.asarray(times), [0.2, 0.8]) if len(times) > 1 else (times[0], times[0])
    return Timed(statistics.median(times), float(q[0]), float(q[1]), n, cold * 1e6, peak, "events", result)


def water_box_fast(n_atoms: int, seed: int = 0, density: float = 1.0):
    """``systems.water_box``'s recipe (jittered cubic lattice of randomly oriented H2O, periodic cube at
    ``density`` g/cm³), vectorised over molecules: an ``ase.Atoms`` of ``3 * (n_atoms // 3)`` atoms."""
    from ase import Atoms
    from ase.build import molecule

    n_mol = max(1, n_atoms // 3)
    side = (n_mol * 18.015 / 6.02214076e23 / density) ** (1 / 3) * 1e8  # Å
    per_side = math.ceil(n_mol ** (1 / 3))
    spacing = side / per_side
    rng = np.random.default_rng(seed)
    sites = np.stack(np.unravel_index(rng.permutation(per_side**3)[:n_mol], (per_side,) * 3), axis=1)
    q, r = np.linalg.qr(rng.normal(size=(n_mol, 3, 3)))
    rot = q * np.sign(np.diagonal(r, axis1=1, axis2=2))[:, None, :]
    centre = (sites + 0.5 + rng.uniform(-0.1, 0.1, (n_mol, 3))) * spacing
    h2o = molecule("H2O")
    pos = np.einsum("ka,nba->nkb", h2o.positions, rot) + centre[:, None, :]
    numbers = np.tile(h2o.numbers, n_mol)
    return Atoms(numbers=numbers, positions=pos.reshape(-1, 3), cell=[side] * 3, pbc=True)


_BOXES: dict[int, object] = {}


def box(n_atoms: int):
    """The water box of ``n_atoms`` (cached: the sections share them)."""
    if n_atoms not in _BOXES:
        _BOXES[n_atoms] = water_box(n_atoms) if n_atoms <= LOOP_BUILDER_MAX else water_box_fast(n_atoms)
    return _BOXES[n_atoms]


def _gb(x: int | None) -> float | None:
    return None if x is None else x / 1e9


def _f(x, spec: str) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


# ------------------------------------------------------------------------------------------------ the runner
class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.clock = Clock(args.budget_s)
        self.model = make_student(hidden=args.hidden, layers=args.layers)
        self.correctness: dict = {}
        self.ef: list[dict] = []
        self.nl: list[dict] = []
        self.grow: list[dict] = []
        self.skipped: list[str] = []
        self.notes: list[str] = []
        self.impls: dict[str, object] = {}

    # The budget a slow measurement may take: a fraction of what is left.
    def slow_budget(self) -> float:
        return max(0.1, min(self.args.slow_budget_s, self.clock.left() / 4))

    def skip(self, what: str, why: str) -> None:
        self.skipped.append(f"{what}: {why}")
        print(f"skipped {what}: {why}", flush=True)

    def impl(self, key: str):
        """Step implementations: ``ref`` (torch kernels, eager), ``ours`` (auto kernels, eager), ``best`` (auto
        kernels, mode auto: what a user gets by default), ``graph`` (mode cudagraph: a replay at every size a
        bucket holds, also where auto runs eager)."""
        if key not in self.impls:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if key == "ref":
                    impl = StepImpl(
                        "reference (torch kernels, eager)",
                        "reference",
                        self.model,
                        self.device,
                        backend="torch",
                        mode="eager",
                    )
                elif key == "ours":
                    impl = StepImpl(
                        f"ours (ForceEngine eager, {self.args.ours_backend} kernels)",
                        "ours",
                        self.model,
                        self.device,
                        backend=self.args.ours_backend,
                        mode="eager",
                    )
                elif key == "graph":
                    impl = StepImpl(
                        "ours CUDA graph (ForceEngine mode cudagraph)",
                        "ours",
                        self.model,
                        self.device,
                        backend=self.args.ours_backend,
                        mode="cudagraph",
                    )
                else:
                    impl = StepImpl(
                        "ours best (ForceEngine mode auto)",
                        "ours",
                        self.model,
                        self.device,
                        backend=self.args.ours_backend,
                        mode="auto",
                    )
            self.impls[key] = impl
        return self.impls[key]

    def _resolved_backend(self) -> str:
        with kernels.use_backend(self.args.ours_backend):
            return kernels.resolve_backend(self.device)

    # -------------------------------------------------------------------------------------- 1. correctness
    def check_correctness(self) -> None:
        n = self.args.check_atoms
        atoms = box(n)
        tol_e, tol_f = TOLERANCES["fp32"]
        out = {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref_impl = OursImpl("reference", "reference", self.model, self.device, backend="torch", mode="eager")
            b = self.args.ours_backend
            impls = {
                "ours eager": OursImpl("ours eager", "ours", self.model, self.device, backend=b, mode="eager"),
                "ours best (mode auto)": OursImpl("ours best", "ours", self.model, self.device, backend=b, mode="auto"),
            }
            with ref_impl.context():
                ref = ref_impl.prepare([atoms], True)()
        e_ref, f_ref = ref["energy"].double(), ref["forces"].double()
        rows = []
        for label, impl in impls.items():
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    with impl.context():
                        got = impl.prepare([atoms], True)()
                de = float((got["energy"].double() - e_ref).abs().max())
                df = float((got["forces"].double() - f_ref).abs().max())
                ok_e = de <= tol_e * max(1.0, float(e_ref.abs().max()))
                ok_f = df <= tol_f * max(1.0, float(f_ref.abs().max()))
                rows.append(dict(impl=label, mode=impl.engine.mode, dE_eV=de, dF_eVA=df, passed=ok_e and ok_f))
            except Exception as exc:
                rows.append(dict(impl=label, error=_err(exc), passed=False))
            print(json.dumps(rows[-1]), flush=True)
        finite = bool(torch.isfinite(f_ref).all()) and float(f_ref.abs().max()) > 0
        out.update(
            atoms=len(atoms),
            energy_ref_eV=float(e_ref.sum()),
            max_abs_force_ref_eVA=float(f_ref.abs().max()),
            forces_finite_nonzero=finite,
            tol_rel_energy=tol_e,
            tol_rel_forces=tol_f,
            kernel_backend_ours=self._resolved_backend(),
            rows=rows,
            passed=finite and all(r["passed"] for r in rows),
        )
        self.correctness = out
        free(self.device)

    # ---------------------------------------------------------------------------------- 2. energy + forces
    def _step_row(self, key: str, atoms, n_edges: int) -> dict:
        impl = self.impl(key)
        row = dict(atoms=len(atoms), edges=n_edges, impl=impl.label, key=key)
        if not impl.available:
            return {**row, "skipped": impl.why_unavailable}
        if key in ("best", "graph"):
            eng = impl.engine
            if not eng.pad:
                return {
                    **row,
                    "skipped": f"mode {eng.requested_mode} runs {eng.mode} on {self.device.type} (= ours eager)",
                }
            if eng.buckets.select(len(atoms), n_edges) is None:
                return {**row, "skipped": "no padded bucket holds this box (it runs eager, = ours eager)"}
        run = t = None
        base = allocated(self.device)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                run = impl.prepare([atoms], True)
                t = measure(run, self.device, self.slow_budget(), self.args.rep_ms, base, self.args.max_single_s)
            res = t.result[0] if isinstance(t.result, tuple) else t.result
            sane = bool(torch.isfinite(res).all()) and float(res.abs().max()) > 0
            row.update(
                step_us=t.median_us,
                p20_us=t.p20_us,
                p80_us=t.p80_us,
                calls=t.calls,
                how=t.how,
                cold_us=t.cold_us,
                us_per_atom=t.median_us / len(atoms),
                peak_bytes=t.peak_bytes,
                finite_nonzero=sane,
            )
        except Exception as exc:
            row.update(oom=True, error=f"OOM at {len(atoms)} atoms") if is_oom(exc) else row.update(error=_err(exc))
        finally:
            run = t = None
            if key in ("best", "graph"):  # a new engine per size: its captured graphs and static buffers go with it
                self.impls.pop(key, None)
            free(self.device)
        return row

    def _e2e_row(self, atoms) -> dict:
        """Ours with the neighbour list: ``engine.compute`` on a device-resident batch (no host copies)."""
        impl = self.impl("ours")
        row = dict(atoms=len(atoms), impl="ours incl. NL (engine.compute, batch on device)", key="ours_nl")
        dev = t = None
        base = allocated(self.device)
        try:
            dev = AtomsBatch.from_atoms(atoms, dtype=impl.engine.dtype).to(self.device)
            engine, backend = impl.engine, self.args.ours_backend

            def run(dev=dev):
                with kernels.use_backend(backend):
                    return engine.compute(dev, forces=True)["forces"]

            t = measure(run, self.device, self.slow_budget(), self.args.rep_ms, base, self.args.max_single_s)
            row.update(e2e_us=t.median_us, calls=t.calls, how=t.how, peak_bytes=t.peak_bytes)
        except Exception as exc:
            row.update(oom=True, error=f"OOM at {len(atoms)} atoms") if is_oom(exc) else row.update(error=_err(exc))
        finally:
            dev = t = None
            free(self.device)
        return row

    def energy_forces(self) -> None:
        sizes = self.args.sizes or (EF_SIZES_QUICK if self.args.quick else EF_SIZES)
        for n in sizes:
            if self.clock.left() < 10:
                self.skip(f"energy+forces, {n} atoms", "time budget")
                continue
            atoms = box(n)
            try:
                d = AtomsBatch.from_atoms(atoms, dtype=torch.float32).to(self.device)
                nl = neighbor_list(d.positions, d.cell, d.pbc, d.batch, d.ptr, CUTOFF)
                n_edges, nl_method = nl.num_edges, nl.method
                del d, nl
            except Exception as exc:
                free(self.device)
                self.ef.append(
                    dict(
                        atoms=len(atoms),
                        impl="all",
                        key="nl",
                        error=f"OOM at {len(atoms)} atoms" if is_oom(exc) else _err(exc),
                    )
                )
                continue
            free(self.device)
            rows = {}
            for key in ("ours", "best", "graph", "ref"):
                if self.clock.left() < 10:
                    self.skip(f"energy+forces {key}, {len(atoms)} atoms", "time budget")
                    continue
                rows[key] = self._step_row(key, atoms, n_edges)
                rows[key]["nl_method"] = nl_method
                self.ef.append(rows[key])
                print(json.dumps({k: v for k, v in rows[key].items() if k != "key"}, default=str), flush=True)
            ref_us = rows.get("ref", {}).get("step_us")
            for r in rows.values():
                if ref_us and r.get("step_us"):
                    r["ref_over_this"] = ref_us / r["step_us"]
            if self.clock.left() >= 10:
                r = self._e2e_row(atoms)
                self.ef.append(r)
                print(json.dumps(r, default=str), flush=True)
                if "ours" in rows and "e2e_us" in r:
                    rows["ours"]["e2e_us"] = r["e2e_us"]
                elif "ours" in rows and "error" in r:
                    rows["ours"]["e2e_error"] = f"incl. NL: {r['error']}"

    # ------------------------------------------------------------------------------------ 3. neighbour lists
    def _nl_case(self, case: str, structures: list) -> None:
        batch = AtomsBatch.from_atoms(structures, dtype=torch.float32).to(self.device)
        args_nl = (batch.positions, batch.cell, batch.pbc, batch.batch, batch.ptr, CUTOFF)
        n_struct, n_atoms = len(structures), batch.positions.shape[0]
        methods = [
            ("brute (1 batched call)", dict(method="brute")),
            ("cell_list torch (1 batched call)", dict(method="cell_list", cell_list_impl="torch")),
            ("cell_list triton (1 batched call)", dict(method="cell_list", cell_list_impl="triton")),
            ("vesin, our contract (1 call/box)", dict(method="vesin")),
        ]
        ref_edges = None
        rows = []
        for name, kw in methods:
            row = dict(case=case, impl=name, atoms=n_atoms, structures=n_struct)
            if kw.get("cell_list_impl") == "triton" and not triton_runnable(self.device):
                why = f"Triton cell list needs CUDA (or TRITON_INTERPRET=1), not {self.device}"
                rows.append({**row, "skipped": why})
                continue
            if kw["method"] == "vesin" and not vesin_available():
                rows.append({**row, "skipped": "vesin-torch does not import"})
                continue
            if kw["method"] == "brute" and n_struct == 1 and n_atoms > self.args.brute_max_atoms:
                why = f"brute force above {self.args.brute_max_atoms} atoms (--brute-max-atoms)"
                rows.append({**row, "skipped": why})
                continue
            if self.clock.left() < 8:
                rows.append({**row, "skipped": "time budget"})
                continue
            try:
                t = measure(
                    lambda kw=kw: neighbor_list(*args_nl, **kw),
                    self.device,
                    self.slow_budget(),
                    self.args.rep_ms,
                    max_single_s=self.args.max_single_s,
                )
                nl = t.result
                row.update(
                    pairs=nl.num_edges,
                    median_us=t.median_us,
                    p20_us=t.p20_us,
                    p80_us=t.p80_us,
                    calls=t.calls,
                    how=t.how,
                )
                csr_ok = bool(nl.row_ptr[-1] == nl.num_edges) and nl.row_ptr.shape[0] == n_atoms + 1
                if ref_edges is None:
                    ref_edges, row["agree"] = nl.edge_index, ("yes (reference)" if csr_ok else "NO: bad CSR")
                else:
                    same = nl.edge_index.shape == ref_edges.shape and torch.equal(nl.edge_index, ref_edges)
                    row["agree"] = "yes" if same and csr_ok else f"NO ({nl.num_edges} vs {ref_edges.shape[1]} pairs)"
                del nl, t
            except Exception as exc:
                row["error"] = f"OOM at {n_atoms} atoms" if is_oom(exc) else _err(exc)
            rows.append(row)
            free(self.device)
        # vesin's own output, one call per box: the peer as its users call it.
        row = dict(case=case, impl="vesin raw i,j,S (1 call/box)", atoms=n_atoms, structures=n_struct)
        if not vesin_available():
            rows.append({**row, "skipped": "vesin-torch does not import"})
        elif self.clock.left() < 8:
            rows.append({**row, "skipped": "time budget"})
        else:
            calc = _vesin_class()(cutoff=CUTOFF, full_list=True)
            ptr = batch.ptr.tolist()
            pos64, cell64 = batch.positions.double(), batch.cell.double()

            def vesin_raw():
                return sum(
                    calc.compute(pos64[ptr[b] : ptr[b + 1]], cell64[b], True, "ijS", copy=False)[0].shape[0]
                    for b in range(n_struct)
                )

            try:
                t = measure(vesin_raw, self.device, self.slow_budget(), self.args.rep_ms, 0, self.args.max_single_s)
                row.update(
                    pairs=int(t.result),
                    median_us=t.median_us,
                    p20_us=t.p20_us,
                    p80_us=t.p80_us,
                    calls=t.calls,
                    how=t.how,
                )
                if ref_edges is not None:
                    row["agree"] = (
                        "yes"
                        if int(t.result) == ref_edges.shape[1]
                        else (f"NO ({int(t.result)} vs {ref_edges.shape[1]} pairs)")
                    )
            except Exception as exc:
                row["error"] = _err(exc)
            rows.append(row)
        vesin_us = next((r["median_us"] for r in rows if r["impl"].startswith("vesin raw") and "median_us" in r), None)
        for r in rows:
            if vesin_us and r.get("median_us"):
                r["vesin_raw_over_this"] = vesin_us / r["median_us"]
            print(json.dumps(r, default=str), flush=True)
        self.nl.extend(rows)
        del batch, ref_edges
        free(self.device)

    def neighbours(self) -> None:
        n_large = self.args.nl_atoms or (96 if self.args.quick else 24000)
        n_small = self.args.n_small or (4 if self.args.quick else 1024)
        if self.clock.left() < 10:
            self.skip("neighbour lists", "time budget")
            return
        self._nl_case(f"1 box, {n_large} atoms", [box(n_large)])
        if self.clock.left() < 10:
            self.skip(f"neighbour lists, {n_small} boxes", "time budget")
            return
        small = [water_box(24, seed=k) for k in range(n_small)]
        self._nl_case(f"{n_small} boxes x 24 atoms ({small[0].cell[0, 0]:.1f} Å)", small)

    # ---------------------------------------------------------------------------------- 4. largest box fits
    def largest(self) -> None:
        sizes = self.args.grow_sizes or (GROW_SIZES_QUICK if self.args.quick else GROW_SIZES)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine = ForceEngine(self.model, device=self.device, mode="eager", neighbor_method=self.args.grow_nl)
        backend = self.args.ours_backend
        last: tuple[int, float] | None = None
        for n in sizes:
            row = dict(atoms=n)
            if last is not None:
                predicted = last[1] * n / last[0]
                if predicted > self.args.grow_cap_s:
                    self.grow.append({**row, "status": f"not run: predicted {predicted:.1f} s/call > cap"})
                    break
                if 4 * predicted + 5 > self.clock.left():
                    self.grow.append({**row, "status": "not run: time budget"})
                    self.skip(f"largest box, {n} atoms", "time budget")
                    break
            elif self.clock.left() < 10:
                self.skip(f"largest box, {n} atoms", "time budget")
                break
            dev = run = t = None
            try:
                t_build = time.perf_counter()
                atoms = box(n)
                row["atoms"] = len(atoms)
                base = allocated(self.device)
                dev = AtomsBatch.from_atoms(atoms, dtype=engine.dtype).to(self.device)
                row["build_s"] = time.perf_counter() - t_build
                with torch.no_grad():
                    nl = neighbor_list(dev.positions, dev.cell, dev.pbc, dev.batch, dev.ptr, CUTOFF, self.args.grow_nl)
                row.update(edges=nl.num_edges, nl_method=nl.method)
                del nl
                free(self.device)

                def run(dev=dev):
                    with kernels.use_backend(backend):
                        return engine.compute(dev, forces=True)["forces"]

                cap = min(self.slow_budget(), 2.5 * self.args.grow_cap_s)
                t = measure(run, self.device, cap, self.args.rep_ms, base, self.args.max_single_s)
                sane = bool(torch.isfinite(t.result).all()) and float(t.result.abs().max()) > 0
                row.update(
                    ms=t.median_us / 1e3,
                    us_per_atom=t.median_us / len(atoms),
                    peak_bytes=t.peak_bytes,
                    calls=t.calls,
                    how=t.how,
                    finite_nonzero=sane,
                    status="ran",
                )
                last = (len(atoms), t.median_us / 1e6)
                stop = t.median_us / 1e6 > self.args.grow_cap_s
            except Exception as exc:
                row["status"] = f"OOM at {n} atoms" if is_oom(exc) else f"error: {_err(exc)}"
                stop = True
            finally:
                dev = run = t = None
                _BOXES.pop(n, None)
                free(self.device)
            self.grow.append(row)
            print(json.dumps(row, default=str), flush=True)
            if stop:
                break

    # --------------------------------------------------------------------------------------------- targets
    def targets(self) -> list[dict]:
        def ours_rows(n):
            return [r for r in self.ef if r["atoms"] == n and r.get("key") in ("ours", "best") and "step_us" in r]

        def nl_row(prefix, impl):
            hits = [r for r in self.nl if r["case"].startswith(prefix) and r["impl"].startswith(impl)]
            return next((r for r in hits if "median_us" in r), None)

        out = []

        def add(name, value, goal, ok):
            out.append(
                dict(
                    target=name,
                    value=value,
                    goal=goal,
                    result="not measured" if ok is None else ("pass" if ok else "FAIL"),
                )
            )

        out.append(
            dict(
                target=f"ours == reference ({self.correctness.get('atoms', self.args.check_atoms)} atoms, fp32)",
                value=", ".join(
                    f"{r['impl']}: ΔE {_f(r.get('dE_eV'), '.1e')} eV, ΔF {_f(r.get('dF_eVA'), '.1e')} eV/Å"
                    for r in self.correctness.get("rows", [])
                )
                or "—",
                goal="engine.TOLERANCES['fp32']",
                result="pass" if self.correctness.get("passed") else ("FAIL" if self.correctness else "not measured"),
            )
        )
        for n, key_ms in ((24000, "ef_24k_ms"), (3000, "ef_3k_ms")):
            rows = ours_rows(n)
            best = min(rows, key=lambda r: r["step_us"]) if rows else None
            add(
                f"{n} atoms energy+forces (best of ours)",
                f"{best['step_us'] / 1e3:.2f} ms ({best['impl']})" if best else "—",
                f"≤ {TARGETS[key_ms]} ms",
                None if best is None else best["step_us"] / 1e3 <= TARGETS[key_ms],
            )
            if n == 24000:
                peak = [r["peak_bytes"] for r in rows if r.get("key") == "ours" and r.get("peak_bytes") is not None]
                add(
                    "24000 atoms peak memory (ours eager)",
                    f"{peak[0] / 1e9:.2f} GB" if peak else "—",
                    f"≤ {TARGETS['ef_24k_peak_gb']} GB",
                    None if not peak else peak[0] / 1e9 <= TARGETS["ef_24k_peak_gb"],
                )
        r = nl_row("1 box", "cell_list triton")
        add(
            "NL one 24,000-atom box (Triton cell list, incl. CSR)",
            f"{r['median_us'] / 1e3:.3f} ms ({r['atoms']} atoms)" if r else "—",
            f"≤ {TARGETS['nl_24k_ms']} ms",
            None if r is None or r["atoms"] < 24000 else r["median_us"] / 1e3 <= TARGETS["nl_24k_ms"],
        )
        r = nl_row(f"{self.args.n_small or 1024} boxes", "cell_list triton")
        full = r is not None and r["structures"] >= 1024
        add(
            "NL 1,024 boxes x 24 atoms, one call",
            f"{r['median_us'] / 1e3:.3f} ms" if r else "—",
            f"≤ {TARGETS['nl_small_ms']} ms",
            None if not full else r["median_us"] / 1e3 <= TARGETS["nl_small_ms"],
        )
        ratio = r.get("vesin_raw_over_this") if r else None
        add(
            "NL 1,024 boxes: vesin (1 call/box) / ours",
            _f(ratio, ".0f") + " ×" if ratio else "—",
            f"≥ {TARGETS['nl_small_vs_vesin']:.0f} ×",
            None if not (full and ratio) else ratio >= 100,
        )
        ran = [g for g in self.grow if g.get("status") == "ran"]
        big = max(ran, key=lambda g: g["atoms"]) if ran else None
        stop = next((g for g in self.grow if g.get("status") != "ran"), None)
        value = "—" if big is None else f"{big['atoms']:,} atoms"
        if stop is not None:
            value += f" (next, {stop['atoms']:,} atoms: {stop['status']})"
        add(
            "largest water box that fits (ours)",
            value,
            f"≥ {TARGETS['fit_atoms']:,} atoms",
            None if big is None else big["atoms"] >= TARGETS["fit_atoms"],
        )
        return out

    # ---------------------------------------------------------------------------------------------- output
    def write(self) -> tuple[Path, Path]:
        out_dir = Path(self.args.out)
        out_dir.mkdir(parents=True, exist_ok=True)
        try:
            env = dataclasses.asdict(environment(self.device, float("nan")))
        except Exception as exc:  # a broken CUDA context must not cost the results
            env = dict(device=str(self.device), torch=torch.__version__, triton="?", commit="?", error=_err(exc))
        env_d = {
            **env,
            "python": platform.python_version(),
            "quick": self.args.quick,
            "budget_s": self.args.budget_s,
            "elapsed_s": round(self.clock.elapsed(), 1),
        }
        if self.device.type == "cuda":
            with contextlib.suppress(Exception):
                env_d["gpu_memory_gb"] = torch.cuda.get_device_properties(self.device).total_memory / 1e9
        targets = self.targets()
        data = dict(
            env=env_d,
            correctness=self.correctness,
            energy_forces=self.ef,
            neighbour_lists=self.nl,
            largest=self.grow,
            targets=targets,
            skipped=self.skipped,
            notes=self.notes,
            model_params=sum(p.numel() for p in self.model.parameters()),
        )
        js = out_dir / "bench_large.json"
        js.write_text(json.dumps(data, indent=1, default=str) + "\n")
        md = out_dir / "bench_large.md"
        md.write_text(self.markdown(env_d, targets))
        return md, js

    def markdown(self, env: dict, targets: list[dict]) -> str:
        quick = " · QUICK (smoke sizes: the numbers mean nothing)" if env["quick"] else ""
        L = [
            "# Large systems (issue 7): energy + forces, neighbour lists, largest box",
            "",
            f"{env['device']} · torch {env['torch']} · triton {env['triton']} · commit {env['commit']} · "
            f"student weights {env.get('weights', 'as-trained')} · "
            f"{env['elapsed_s']} s of a {env['budget_s']:.0f} s budget{quick}",
            "",
            f"Student: PaiNN {self.model.config.hidden} features x {self.model.config.layers} layers "
            f"({sum(p.numel() for p in self.model.parameters()):,} parameters, 5 Å; the shipped default is 128 x 3), "
            "float32, seeded random weights. Water boxes at ~1 g/cm³.",
            "",
            "## Targets",
            "",
            "| target | measured | goal | result |",
            "|---|---|---|---|",
        ]
        L += [f"| {t['target']} | {t['value']} | {t['goal']} | {t['result']} |" for t in targets]
        c = self.correctness
        L += ["", f"## Correctness before timing ({c.get('atoms', '—')}-atom box, ours vs reference)", ""]
        if c:
            L += [
                f"Reference: E = {c['energy_ref_eV']:.4f} eV, max |F| = {c['max_abs_force_ref_eVA']:.3f} eV/Å "
                f"(finite, nonzero: {c['forces_finite_nonzero']}). Tolerance (engine.TOLERANCES['fp32']): "
                f"|ΔE| ≤ {c['tol_rel_energy']:g}·max(1, |E|), max |ΔF| ≤ {c['tol_rel_forces']:g}·max(1, max |F|). "
                f"Kernel backend of ours here: {c['kernel_backend_ours']}.",
                "",
                "| impl | runs as | max abs ΔE eV | max abs ΔF eV/Å | pass |",
                "|---|---|---:|---:|---|",
            ]
            for r in c["rows"]:
                L.append(
                    f"| {r['impl']} | {r.get('mode', '—')} | {_f(r.get('dE_eV'), '.2e')} | "
                    f"{_f(r.get('dF_eVA'), '.2e')} | {'yes' if r['passed'] else 'NO ' + r.get('error', '')} |"
                )
        L += [
            "",
            "## Energy + forces (one water box)",
            "",
            "Step = model + one `autograd.grad` on a prepared graph (peers.StepImpl; best mode: captured replay of "
            "the padded step). Peak = `torch.cuda.max_memory_allocated` over one call after a reset, minus "
            "what was allocated before the row built its inputs: the batch, its neighbour list and the step's "
            "transients (weights, ~2 MB, excluded). `incl. NL` = `engine.compute` on a device-resident batch.",
            "",
            "| atoms | edges | impl | step ms | p20-p80 ms | µs/atom/step | peak GB | ref / this | incl. NL ms "
            "| timing | note |",
            "|---:|---:|---|---:|---:|---:|---:|---:|---:|---|---|",
        ]
        for r in self.ef:
            if r.get("key") == "ours_nl":
                continue
            note = r.get("error") or r.get("skipped") or ("" if r.get("finite_nonzero", True) else "NON-FINITE/ZERO")
            note = "; ".join(x for x in (note, r.get("e2e_error", "")) if x)
            timing = f"{r['how']}" + (f", {r['calls']} calls" if r.get("calls", -1) > 0 else "") if "how" in r else "—"
            L.append(
                f"| {r['atoms']} | {r.get('edges', '—')} | {r['impl']} | "
                f"{_f(r.get('step_us', None) and r['step_us'] / 1e3, '.3f')} | "
                + (f"{r['p20_us'] / 1e3:.3f}-{r['p80_us'] / 1e3:.3f}" if "p20_us" in r else "—")
                + f" | {_f(r.get('us_per_atom'), '.3f')} | {_f(_gb(r.get('peak_bytes')), '.2f')} | "
                f"{_f(r.get('ref_over_this'), '.2f')} | {_f(r.get('e2e_us', None) and r['e2e_us'] / 1e3, '.3f')}"
                + (f" ({r['nl_method']})" if "e2e_us" in r else "")
                + " "
                f"| {timing} | {note} |"
            )
        L += [
            "",
            "## Neighbour lists (5 Å, float32 positions)",
            "",
            "Ours: one call for the whole batch, receiver-sorted CSR included. vesin: one call per box; `raw` is "
            "vesin's unsorted i, j only. `agree`: same edge list as the first backend that ran (vesin raw: same "
            "pair count).",
            "",
            "| case | impl | atoms | structures | pairs | agree | median ms | p20-p80 ms | vesin raw / this | note |",
            "|---|---|---:|---:|---:|---|---:|---:|---:|---|",
        ]
        for r in self.nl:
            note = (
                r.get("error")
                or r.get("skipped")
                or (r.get("how", "") + (f", {r['calls']} calls" if r.get("calls", -1) > 0 else ""))
            )
            L.append(
                f"| {r['case']} | {r['impl']} | {r['atoms']} | {r['structures']} | {r.get('pairs', '—')} | "
                f"{r.get('agree', '—')} | {_f(r.get('median_us', None) and r['median_us'] / 1e3, '.3f')} | "
                + (f"{r['p20_us'] / 1e3:.3f}-{r['p80_us'] / 1e3:.3f}" if "p20_us" in r else "—")
                + f" | {_f(r.get('vesin_raw_over_this'), '.1f')} | {note} |"
            )
        L += [
            "",
            "## Largest box that fits (ours: ForceEngine eager, neighbour list "
            f"`{self.args.grow_nl}` + energy + forces)",
            "",
            "| atoms | edges | NL method | ms/step | µs/atom/step | peak GB | status |",
            "|---:|---:|---|---:|---:|---:|---|",
        ]
        for g in self.grow:
            L.append(
                f"| {g['atoms']} | {g.get('edges', '—')} | {g.get('nl_method', '—')} | {_f(g.get('ms'), '.1f')} | "
                f"{_f(g.get('us_per_atom'), '.3f')} | {_f(_gb(g.get('peak_bytes')), '.2f')} | {g.get('status', '')}"
                + ("" if g.get("finite_nonzero", True) else " NON-FINITE/ZERO")
                + " |"
            )
        ran = [g for g in self.grow if g.get("status") == "ran"]
        if ran:
            big = max(ran, key=lambda g: g["atoms"])
            L += [
                "",
                f"Largest that ran: {big['atoms']:,} atoms, {big['ms']:.1f} ms per step, peak "
                f"{_f(_gb(big.get('peak_bytes')), '.1f')} GB.",
            ]
        if self.skipped or self.notes:
            L += (
                ["", "## Skipped / notes", ""]
                + [f"- skipped {s}" for s in self.skipped]
                + [f"- {s}" for s in self.notes]
            )
        return "\n".join(L) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "large")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (CPU smoke run)")
    ap.add_argument("--budget-s", type=float, default=240.0, help="wall-clock budget of the whole run, s")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--sizes", type=int, nargs="+", default=None, help="energy+forces box sizes (atoms)")
    ap.add_argument("--grow-sizes", type=int, nargs="+", default=None, help="largest-box ladder (atoms)")
    ap.add_argument(
        "--grow-nl",
        default="cell_list",
        choices=("auto", "cell_list", "vesin", "brute"),
        help="neighbour list of the largest-box ladder (default: ours, the cell list; auto = the engine's default)",
    )
    ap.add_argument("--grow-cap-s", type=float, default=20.0, help="stop growing past this time per call, s")
    ap.add_argument(
        "--max-single-s",
        type=float,
        default=None,
        help="a first call longer than this is reported as it is, without a warm call (20 s; quick 2 s)",
    )
    ap.add_argument("--check-atoms", type=int, default=None, help="box of the correctness check (192; quick 48)")
    ap.add_argument("--nl-atoms", type=int, default=None, help="the single large neighbour-list box (atoms)")
    ap.add_argument("--n-small", type=int, default=None, help="number of 24-atom boxes in the batched case")
    ap.add_argument("--brute-max-atoms", type=int, default=30_000, help="largest single box brute force runs on")
    ap.add_argument(
        "--slow-budget-s",
        type=float,
        default=None,
        help="time one slow (> 50 ms) measurement may take (3 s; quick 0.3 s)",
    )
    ap.add_argument(
        "--ours-backend",
        default="auto",
        choices=kernels.BACKENDS,
        help="kernel backend of ours (auto: Triton on CUDA; triton on CPU needs TRITON_INTERPRET=1)",
    )
    ap.add_argument("--sections", default="check,ef,nl,grow", help="comma list of check, ef, nl, grow")
    ap.add_argument("--hidden", type=int, default=128, help="student width (builtin:chno-gfn2-small is 64)")
    ap.add_argument("--layers", type=int, default=3, help="student interaction layers")
    args = ap.parse_args(argv)
    if args.check_atoms is None:
        args.check_atoms = 48 if args.quick else 192
    if args.max_single_s is None:
        args.max_single_s = 2.0 if args.quick else 20.0
    if args.slow_budget_s is None:
        args.slow_budget_s = 0.3 if args.quick else 3.0
    args.rep_ms = 20.0 if args.quick else 100.0
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    bench = Bench(args)
    sections = {s.strip() for s in args.sections.split(",") if s.strip()}
    steps = [
        ("check", "correctness", bench.check_correctness),
        ("ef", "energy + forces", bench.energy_forces),
        ("nl", "neighbour lists", bench.neighbours),
        ("grow", "largest box", bench.largest),
    ]
    for key, name, fn in steps:
        if key not in sections:
            continue
        if bench.clock.left() <= 0:
            bench.skip(name, "time budget spent")
            continue
        print(f"== {name} ({bench.clock.elapsed():.0f} s elapsed)", flush=True)
        try:
            fn()
        except Exception as exc:  # a section's failure must not lose the others' results
            bench.notes.append(f"section {name} failed: {_err(exc)}")
            print(f"section {name} failed: {_err(exc)}", flush=True)
            free(bench.device)
    md, js = bench.write()
    print(md.read_text())
    print(f"wrote {md} and {js}")
    return json.loads(js.read_text())


if __name__ == "__main__":
    main()
