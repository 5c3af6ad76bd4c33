"""The small torch kernels of one padded energy + forces step (what a CUDA-graph replay runs besides the Triton
kernels), counted on the Triton path under the interpreter, and the step's results against the torch backend.

On the GPU each of these ops is a ~1-1.5 µs kernel and a graph node. The fused update takes the message block's
residual terms, caches [U; V], and gets None for unused gradients; φ's backward adds the residual gradient; the
readout fuses the per-species scale/shift and the per-structure sum; edge_basis needs no zero gradient for dist.
What is left (3 layers): the engine's own ops (the scalar seed's 1, cat), the
message-passing backward's zeroed outputs and gradient sums (kernels/message_passing.py), the initial v, the
species lookup and embedding, and the zeroed sums that atomics accumulate into (energies, forces).
"""

import importlib
import warnings
from collections import Counter

import numpy as np
import pytest
import torch
from ase import Atoms
from ase.build import molecule
from mlff_distiller.kernels import triton_available, use_backend
from torch.utils._python_dispatch import TorchDispatchMode

from mlff_distiller import AtomsBatch, ForceEngine, StudentModel

# The step runs on CPU tensors: the Triton kernels under the interpreter (tests/conftest.py sets it without CUDA).
pytestmark = pytest.mark.skipif(not triton_available("cpu"), reason="needs the Triton interpreter (TRITON_INTERPRET=1)")

FILLS = {"zeros", "zeros_like", "new_zeros", "zero_", "fill_", "ones", "ones_like", "new_ones", "full", "new_full"}
ELEMENTWISE = {"add", "add_", "sub", "sub_", "mul", "mul_", "div", "div_", "neg", "silu", "silu_backward", "where"}
COPIES = {"clone", "copy_", "_to_copy", "contiguous"}
INDEX = {"index", "index_select", "index_add", "index_add_", "embedding", "gather", "scatter", "scatter_add_"}
# At most this many per padded step of a 3-layer student (the counts reached: the engine seeds the gradient with
# the bucket's static seed through a scalar, whose 1 is one fill, in place of negating a mask; the message passing
# reuses one zero for unused gradients; before: 9 fills, 4 cats, 20 elementwise, 6 index ops, 40 torch ops in all).
# The first layer's φ(s) is one gather of the model's species table (an index op, in place of two GEMM launches).
# The one copy (stop 50): the per-structure energies, summed in float64, rounded to float32 (0.4-0.6 % of a benzene
# step; float32 sums were off by 7e-4 of a 200,001-atom box's energy).
LIMITS = {"fill": 4, "cat": 1, "elementwise": 6, "copy": 1, "index": 3, "all torch ops": 15}


def _water_box(n_mol: int = 8, seed: int = 0) -> Atoms:
    """``n_mol`` randomly oriented water molecules on a jittered cubic lattice at ~1 g/cm³, periodic."""
    per_side = int(np.ceil(n_mol ** (1 / 3)))
    side = (n_mol * 18.015 / 6.02214076e23) ** (1 / 3) * 1e8
    rng = np.random.default_rng(seed)
    h2o, pos = molecule("H2O"), []
    sites = [(i, j, k) for i in range(per_side) for j in range(per_side) for k in range(per_side)][:n_mol]
    for site in sites:
        q, r = np.linalg.qr(rng.normal(size=(3, 3)))
        centre = (np.array(site) + 0.5 + rng.uniform(-0.1, 0.1, 3)) * side / per_side
        pos.append(h2o.positions @ (q * np.sign(np.diag(r))).T + centre)
    return Atoms(numbers=list(h2o.numbers) * n_mol, positions=np.concatenate(pos), cell=[side] * 3, pbc=True)


def _engine(dtype_name: str, backend: str) -> ForceEngine:
    torch.manual_seed(0)
    model = StudentModel(species=[1, 8], hidden=32, layers=3, n_rbf=8, cutoff=4.0)
    n = len(model.config.species)
    model.set_energy_reference(shift=-torch.arange(1, n + 1, dtype=torch.float32), scale=torch.full((n,), 0.5))
    with warnings.catch_warnings(), use_backend(backend):
        warnings.simplefilter("ignore")  # "cudagraph" on a CPU: the padded eager path, the same step
        return ForceEngine(model, device="cpu", mode="cudagraph", precision=dtype_name)


class _TorchOps(TorchDispatchMode):
    """The aten ops that compute (not views, not allocations) outside the Triton kernels (whose interpreter moves
    arguments with torch ops of its own), by overload-packet name; Triton launches by kernel name."""

    def __init__(self):
        super().__init__()
        self.ops, self.triton, self.depth = [], [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        view = any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)
        if self.depth == 0 and not view and not name.startswith(("empty", "new_empty", "detach", "lift_fresh")):
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def _step_ops(monkeypatch, engine, atoms) -> tuple[list, list, torch.Tensor]:
    """One padded step of ``atoms`` on ``engine`` (Triton backend): (torch ops, Triton launches, packed output)."""
    interp = importlib.import_module("triton.runtime.interpreter")
    mode = _TorchOps()
    call = interp.GridExecutor.__call__

    def launch(self, *args, **kwargs):
        mode.triton.append(self.fn.__name__)
        mode.depth += 1
        try:
            return call(self, *args, **kwargs)
        finally:
            mode.depth -= 1

    monkeypatch.setattr(interp.GridExecutor, "__call__", launch)
    with use_backend("triton"):
        engine.compute(AtomsBatch.from_atoms(atoms))  # fills the bucket (and warms the caches)
        graph = engine._graphs[engine.last_bucket]
        mode.triton.clear()
        with mode:
            packed = engine._step(*graph.inputs())
    monkeypatch.setattr(interp.GridExecutor, "__call__", call)
    return mode.ops, mode.triton, packed


@pytest.fixture
def step_ops(monkeypatch):
    """Runs one padded step of a 24-atom water box (float32, Triton backend) and returns (torch ops, Triton
    launches)."""
    return _step_ops(monkeypatch, _engine("fp32", "triton"), [_water_box()])[:2]


def test_padded_step_small_kernels(step_ops):
    """The padded step (model forward + one autograd.grad) on the Triton path issues at most LIMITS small torch
    ops of each kind; a change that brings one back fails here."""
    ops, launches = step_ops
    kinds = Counter()
    for op in ops:
        kind = next(
            (k for k, names in (("fill", FILLS), ("elementwise", ELEMENTWISE), ("copy", COPIES), ("index", INDEX))
             if op in names),
            "cat" if op == "cat" else "other",
        )  # fmt: skip
        kinds[kind] += 1
    kinds["all torch ops"] = len(ops)
    summary = f"{dict(kinds)}: {Counter(ops)}"
    for kind, limit in LIMITS.items():
        assert kinds[kind] <= limit, f"{kind}: {kinds[kind]} > {limit} ({summary})"
    # The positive control: the step did run the Triton inference path (fused update, Triton GEMMs, readout).
    assert launches.count("_painn_update_out_kernel") == 3 and launches.count("_gemm_kernel") >= 30, launches


@pytest.mark.parametrize("dtype_name, tol", [("fp64", 1e-12), ("fp32", 1e-5)])
def test_padded_step_triton_matches_torch(dtype_name, tol):
    """The padded step's energies and forces on the Triton path (fused update, residual and readout epilogues)
    vs the torch backend, normwise relative."""
    atoms = [_water_box(), _water_box(5, seed=1)]
    out = {}
    for backend in ("triton", "torch"):
        engine = _engine(dtype_name, backend)
        with use_backend(backend):
            out[backend] = engine.compute(AtomsBatch.from_atoms(atoms))
    for key in ("energy", "atomic_energies", "forces"):
        got, want = out["triton"][key].double(), out["torch"][key].double()
        assert got.shape == want.shape and torch.isfinite(got).all()
        err = (got - want).norm().item()
        assert err <= tol * want.norm().item(), f"{key}: {err:.3e} vs |ref| {want.norm().item():.3e}"


def test_the_forces_zeros_made_by_the_edge_forward(monkeypatch):
    """With the forward's zeros for the position gradient (``edge_features._OPTIONS["zero_in_forward"]``, shipped
    on), a padded step of a student whose wall some pairs reach makes one fill fewer (the forces' zeros) and no
    other torch op changes, and it returns the packed output bit for bit as the step with the fill does. (The
    readout's wall and the packed output written in place by the kernels, tested here with it until stop 49, gained
    nothing on the GPU and were dropped: benchmarks/results/stop49_gpu/wall_packed_pdl_dropped.diff.)"""
    ef = importlib.import_module("mlff_distiller.kernels.edge_features")

    torch.manual_seed(0)
    model = StudentModel(species=[1, 8], hidden=32, layers=2, n_rbf=8, cutoff=4.0)
    model.set_repulsion({(1, 8): 1.2, (1, 1): 1.7, (8, 8): 1.0})  # every O-H bond inside its wall
    with warnings.catch_warnings(), use_backend("triton"):
        warnings.simplefilter("ignore")  # "cudagraph" on a CPU: the padded eager path, the same step
        engine = ForceEngine(model, device="cpu", mode="cudagraph", precision="fp32")
    runs = {}
    for zero in (False, True):  # (read by each forward: one engine serves both)
        monkeypatch.setitem(ef._OPTIONS, "zero_in_forward", zero)
        ops, _, packed = _step_ops(monkeypatch, engine, [_water_box(4)])
        runs[zero] = (Counter(ops), packed)
    (off, packed_off), (on, packed_on) = runs[False], runs[True]
    fewer = off - on
    assert sum(fewer.values()) == 1 and set(fewer) <= FILLS and not on - off, (off, on)
    assert torch.equal(packed_on, packed_off)
