"""Everything ``run_all.py`` times, behind one interface: our student in its engine modes and its peers.

Each implementation is an :class:`Impl`: ``prepare(structures, forces)`` returns a zero-argument callable that
computes energies (eV) and, when ``forces``, forces (eV/Å) of the given ``ase.Atoms`` *from host data to host
results*, so every row of a table measures the same thing (neighbour list, transfers and one backward included).

* :class:`OursImpl` - :class:`mlff_distiller.ForceEngine` in a chosen mode / precision / kernel backend; the
  plain-PyTorch reference is the same weights with ``use_backend("torch")`` and ``mode="eager"``.
* :class:`CalculatorImpl` - our :class:`~mlff_distiller.StudentCalculator`, one ASE call per structure (the
  like-for-like row for SevenNet's ASE calculator).
* :class:`SchNetImpl` - PyG's ``torch_geometric.nn.models.SchNet`` at about our parameter count. SchNet's
  ``forward`` gets its graph from ``self.interaction_graph(pos, batch)`` (by default a
  ``RadiusInteractionGraph`` that needs ``torch_cluster``, absent on the GPU machine, and knows no periodic
  images). We pass ``interaction_graph=`` our own callable, which returns our neighbour list (receiver/sender
  swapped into PyG's ``source → target`` order) and distances recomputed from ``pos`` plus the shift vectors,
  so forces flow through them. SchNet's own forward runs unchanged.
* :class:`SevenNetImpl` - the teacher SevenNet-0 through ``sevenn.calculator.SevenNetCalculator("7net-0")``,
  one ASE call per structure; unavailable (with the reason) when ``sevenn`` or a dependency does not import.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import time
from collections.abc import Callable, Sequence

import torch

from mlff_distiller import AtomsBatch, ForceEngine, StudentCalculator, StudentModel, kernels
from mlff_distiller.neighbors import neighbor_list

__all__ = [
    "CalculatorImpl",
    "Impl",
    "OursImpl",
    "SchNetImpl",
    "SevenNetImpl",
    "StepImpl",
    "TracedImpl",
    "count_params",
    "make_student",
    "matched_schnet",
    "schnet_available",
]


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def make_student(seed: int = 0, **config) -> StudentModel:
    """The default student (hidden 128, 3 layers, 20 Bessel functions, 5 Å, species H/C/N/O) with seeded random
    weights (``harness.STUDENT_WEIGHTS``: on the TF32 grid, as the trainer leaves a student) and a per-species
    energy reference (eV): timings and precision errors do not depend on training."""
    from harness import student_weights

    torch.manual_seed(seed)
    model = StudentModel(**config)
    n = len(model.species_list)
    model.set_energy_reference(shift=-torch.linspace(1.0, 5.0, n), scale=torch.full((n,), 0.5))
    return student_weights(model).eval()  # on the TF32 grid unless MLFF_BENCH_WEIGHTS=as-trained


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclasses.dataclass
class Impl:
    """One implementation as a table row: ``label``, ``kind`` (``ours`` | ``reference`` | ``peer``)."""

    label: str
    kind: str
    device: torch.device
    params: int = 0
    why_unavailable: str | None = None  # None: usable
    note: str = ""
    scope = "e2e"  # e2e: host data to host results; step: the compute step alone (StepImpl)

    @property
    def available(self) -> bool:
        return self.why_unavailable is None

    def prepare(self, structures: Sequence, forces: bool) -> Callable[[], object]:  # pragma: no cover
        raise NotImplementedError

    def context(self):
        """Context every call of this implementation runs in (the kernel backend for ours)."""
        return contextlib.nullcontext()


class OursImpl(Impl):
    """Our :class:`ForceEngine` (``engine_kwargs``: mode, compile_mode, precision, ...) with kernel ``backend``."""

    def __init__(self, label, kind, model, device, backend="auto", **engine_kwargs):
        super().__init__(label=label, kind=kind, device=torch.device(device), params=count_params(model))
        self.backend = backend
        self.engine_kwargs = engine_kwargs
        try:
            with self.context():
                self.engine = ForceEngine(model, device=self.device, **engine_kwargs)
        except (ValueError, RuntimeError) as exc:
            self.engine = None
            self.why_unavailable = f"{type(exc).__name__}: {exc}"[:200]
            return
        # The mode that actually runs (the engine falls back, with a warning, where a mode cannot run).
        if self.engine.mode != engine_kwargs.get("mode", "eager"):
            self.note = f"runs {self.engine.mode}"
        if self.engine.precision != engine_kwargs.get("precision", "fp32"):
            self.note = (self.note + "; " if self.note else "") + f"precision fell back to {self.engine.precision}"

    def context(self):
        return kernels.use_backend(self.backend)

    def prepare(self, structures, forces):
        batch = AtomsBatch.from_atoms(list(structures), dtype=self.engine.dtype)
        engine = self.engine

        def run():
            with self.context():
                return engine.compute(batch, forces=forces, to_host=True)

        return run


class StepImpl(OursImpl):
    """The energy + forces step alone, on a graph prepared once: a replay of the captured step in the padded
    modes, the model + one ``autograd.grad`` in eager mode. No neighbour list, padding or transfers: the
    floor that the end-to-end rows approach. Uses the engine's bucket internals (as bench_engine.py does) and
    reports itself unavailable where this build lacks them."""

    scope = "step"

    def __init__(self, label, kind, model, device, backend="auto", **engine_kwargs):
        super().__init__(label, kind, model, device, backend, **engine_kwargs)
        if self.available and self.engine.pad:
            missing = [a for a in ("_graph", "_run", "buckets") if not hasattr(self.engine, a)]
            if missing:
                self.why_unavailable = f"n/a (not available in this build: ForceEngine lacks {missing})"

    def prepare(self, structures, forces):
        if not forces:
            raise ValueError("step-only rows measure energy + forces")
        engine = self.engine
        dev = AtomsBatch.from_atoms(list(structures), dtype=engine.dtype).to(engine.device)
        if not engine.pad and hasattr(engine, "_spatial_order"):
            dev, _ = engine._spatial_order(dev)  # the atom order the engine's eager path runs in (large boxes)
        with self.context(), torch.no_grad():
            nl = neighbor_list(dev.positions, dev.cell, dev.pbc, dev.batch, dev.ptr, engine.cutoff)
        bucket = engine.buckets.select(dev.num_atoms, nl.num_edges) if engine.pad else None
        if bucket is not None:
            from mlff_distiller.buckets import fill_padded

            graph = engine._graph(bucket)
            shifts = nl.shift_vectors.to(engine.dtype)
            molecule = not any(bool(a.pbc.any()) for a in structures)  # (the engine's dense step may take it)
            fill_padded(
                graph, dev.numbers, dev.positions, dev.batch, dev.num_structures, nl.edge_index, shifts,
                molecule=molecule,
            )  # fmt: skip

            def run():
                with self.context():
                    return engine._run(bucket, graph)

            return run
        model = engine.model
        for p in model.parameters():
            p.requires_grad_(False)
        # As the engine's eager step: the full list promised to the message backward (stop 54), where this build's
        # model takes the promise; asked per call, so a probe's switch (mp:sender_symmetric=0) applies.
        takes_sym = "symmetric_edges" in inspect.signature(model.forward).parameters
        symmetric_walk = getattr(kernels, "symmetric_walk", lambda: False)

        def run():
            with self.context(), _engine_precision(engine), torch.enable_grad():
                pos = dev.positions.detach().requires_grad_(True)
                kw = {"symmetric_edges": symmetric_walk()} if takes_sym else {}
                out = model(dev.numbers, pos, nl.edge_index, nl.shift_vectors, dev.batch, dev.num_structures, **kw)
                return torch.autograd.grad(out["energy"].sum(), pos)

        return run


def _engine_precision(engine):
    """A fresh block of the engine's matmul precision (TF32, 16-bit GEMMs) for an eager step run outside
    ``engine.compute``, as the engine's own eager step holds it (a build without it: no block)."""
    try:
        from mlff_distiller.precision import _matmul_precision

        return _matmul_precision(engine.allow_tf32, getattr(engine, "kernel_matmul_dtype", None))
    except (ImportError, AttributeError, TypeError):
        return contextlib.nullcontext()


class CalculatorImpl(Impl):
    """Our ``StudentCalculator``: one ASE ``calculate`` per structure."""

    def __init__(self, label, model, device, **calc_kwargs):
        super().__init__(label=label, kind="ours", device=torch.device(device), params=count_params(model))
        self.calc = StudentCalculator(model, device=self.device, **calc_kwargs)

    def prepare(self, structures, forces):
        from ase.calculators.calculator import all_changes

        structures = [a.copy() for a in structures]
        props = ["energy", "forces"] if forces else ["energy"]
        calc = self.calc

        def run():
            out = []
            for atoms in structures:
                calc.calculate(atoms, props, all_changes)  # all_changes: never served from ASE's cache
                out.append(calc.results["energy"])
            return out

        return run


class _EnergyOnly(torch.nn.Module):
    """``StudentModel`` with a tensor-only signature (``num_structures`` fixed), so ``torch.jit.trace`` can
    record it."""

    def __init__(self, model: StudentModel, num_structures: int) -> None:
        super().__init__()
        self.model, self.num_structures = model, num_structures

    def forward(self, numbers, positions, edge_index, shift_vectors, batch):
        return self.model(numbers, positions, edge_index, shift_vectors, batch, self.num_structures)["energy"]


def torchscript_script_error(model: StudentModel) -> str | None:
    """Why ``torch.jit.script`` cannot compile the student (None if it can)."""
    try:
        torch.jit.script(model)
    except Exception as exc:  # TorchScript raises its own frontend error types
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return f"{type(exc).__name__}: {first}"[:160]
    return None


class TracedImpl(Impl):
    """TorchScript where it applies: the student's forward recorded by ``torch.jit.trace`` (scripting fails:
    the hot ops are Python functions that choose a backend and validate inputs), forces from
    ``autograd.grad`` outside the traced graph, our neighbour list per call. A trace fixes the structure
    count, so each prepared input set gets its own trace."""

    def __init__(self, label, kind, model, device, backend="torch"):
        super().__init__(label=label, kind=kind, device=torch.device(device), params=count_params(model))
        self.backend = backend
        self.model = model.to(device=self.device, dtype=torch.float32).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)

    def context(self):
        return kernels.use_backend(self.backend)

    def prepare(self, structures, forces):
        import warnings

        batch = AtomsBatch.from_atoms(list(structures), dtype=torch.float32)
        dev = batch.to(self.device)
        nl = neighbor_list(dev.positions, dev.cell, dev.pbc, dev.batch, dev.ptr, self.model.cutoff)
        with self.context(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TracerWarnings about Python values recorded as constants
            pos = dev.positions.detach().requires_grad_(True)
            traced = torch.jit.trace(
                _EnergyOnly(self.model, dev.num_structures),
                (dev.numbers, pos, nl.edge_index, nl.shift_vectors, dev.batch),
                check_trace=False,
            )
        cutoff = self.model.cutoff

        def run():
            with self.context():
                d = batch.to(self.device)
                with torch.no_grad():
                    g = neighbor_list(d.positions, d.cell, d.pbc, d.batch, d.ptr, cutoff)
                with torch.set_grad_enabled(forces):
                    p = d.positions.detach().requires_grad_(forces)
                    e = traced(d.numbers, p, g.edge_index, g.shift_vectors, d.batch)
                    out = {"energy": e.detach().cpu()}
                    if forces:
                        out["forces"] = -torch.autograd.grad(e.sum(), p)[0].cpu()
                return out

        return run


# ---------------------------------------------------------------------------------------------------- SchNet
def schnet_available() -> str | None:
    """None when PyG's SchNet imports, else why not."""
    try:
        from torch_geometric.nn.models import SchNet  # noqa: F401
    except Exception as exc:  # ImportError, or a broken optional extension
        return f"torch_geometric SchNet does not import: {type(exc).__name__}: {exc}"[:200]
    return None


class _OurEdges(torch.nn.Module):
    """``interaction_graph`` for PyG SchNet: our neighbour list, distances differentiable in ``pos``.

    ``edges`` is set before each forward: ``(edge_index [2, E] receiver/sender, shift_vectors [E, 3] Å)``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.edges: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, pos: torch.Tensor, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.edges is None:
            raise ValueError("SchNet peer: no edges set (call through SchNetImpl)")
        edge_index, shifts = self.edges
        i, j = edge_index[0], edge_index[1]
        dist = (pos[j] - pos[i] + shifts).norm(dim=-1)
        # PyG's message passing flows source (row 0) -> target (row 1): sender j first.
        return torch.stack([j, i]), dist


def matched_schnet(target_params: int, cutoff: float, layers: int = 3, n_gaussians: int = 20):
    """A SchNet whose parameter count is the closest to ``target_params`` over hidden = filters widths
    (multiples of 8), with ``layers`` interactions, ``n_gaussians`` Gaussians and ``cutoff`` Å like ours."""
    from torch_geometric.nn.models import SchNet

    best = None
    for width in range(16, 513, 8):
        m = SchNet(
            hidden_channels=width,
            num_filters=width,
            num_interactions=layers,
            num_gaussians=n_gaussians,
            cutoff=cutoff,
            interaction_graph=_OurEdges(),
        )
        gap = abs(count_params(m) - target_params)
        if best is None or gap < best[0]:
            best = (gap, m)
        if count_params(m) > target_params:
            break
    return best[1]


class SchNetImpl(Impl):
    """PyG SchNet (matched size) with our neighbour list; forces from one ``autograd.grad``."""

    def __init__(self, label, target_params, cutoff, device, seed=0):
        super().__init__(label=label, kind="peer", device=torch.device(device))
        self.why_unavailable = schnet_available()
        if not self.available:
            return
        torch.manual_seed(seed)
        self.model = matched_schnet(target_params, cutoff).to(self.device).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.cutoff = cutoff
        self.params = count_params(self.model)
        self.note = f"hidden=filters={self.model.hidden_channels}, {self.model.num_interactions} interactions"

    def energy_forces(self, batch: AtomsBatch, forces: bool) -> dict[str, torch.Tensor]:
        """Energy ``[B]`` (eV, arbitrary scale: random weights) and forces ``[N, 3]`` of a batch on the device."""
        dev = batch.to(self.device, torch.float32)
        nl = neighbor_list(dev.positions, dev.cell, dev.pbc, dev.batch, dev.ptr, self.cutoff)
        self.model.interaction_graph.edges = (nl.edge_index, nl.shift_vectors)
        with torch.set_grad_enabled(forces):
            pos = dev.positions.detach().requires_grad_(forces)
            energy = self.model(dev.numbers, pos, dev.batch).reshape(-1)
            # PyG infers the number of structures from batch.max(): always B here (no structure is empty).
            out = {"energy": energy.detach()}
            if forces:
                (g,) = torch.autograd.grad(energy.sum(), pos)
                out["forces"] = -g
        return out

    def prepare(self, structures, forces):
        batch = AtomsBatch.from_atoms(list(structures), dtype=torch.float32)

        def run():
            return {k: v.cpu() for k, v in self.energy_forces(batch, forces).items()}

        return run


# -------------------------------------------------------------------------------------------------- SevenNet
class SevenNetImpl(Impl):
    """The teacher SevenNet-0 through its ASE calculator (one ``calculate`` per structure; always E+F)."""

    def __init__(self, label, device):
        super().__init__(label=label, kind="peer", device=torch.device(device))
        try:
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "no tensor-product accelerator": expected, stated in the report
                from sevenn.calculator import SevenNetCalculator

                t0 = time.perf_counter()
                self.calc = SevenNetCalculator("7net-0", device=str(self.device))
                self.load_s = time.perf_counter() - t0
        except Exception as exc:  # ImportError of sevenn or of one of its dependencies, missing checkpoint
            self.why_unavailable = f"sevenn unavailable: {type(exc).__name__}: {exc}"[:200]
            return
        self.params = count_params(self.calc.model)
        self.note = "ASE calculator, e3nn tensor products (no cuEquivariance accelerator)"

    def prepare(self, structures, forces):
        from ase.calculators.calculator import all_changes

        structures = [a.copy() for a in structures]
        calc = self.calc

        def run():
            out = []
            for atoms in structures:
                # SevenNet's calculator always computes energy, forces and stress together.
                calc.calculate(atoms, ["energy", "forces"], all_changes)
                out.append(calc.results["energy"])
            _sync(self.device)
            return out

        return run
