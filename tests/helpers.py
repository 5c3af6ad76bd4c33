"""Structures shared by the tests."""

import numpy as np
import torch
from ase import Atoms
from ase.build import bulk, molecule

from mlff_distiller import StudentModel
from mlff_distiller.engine import TOLERANCES


def random_molecule(n: int, rng: np.random.Generator, species=(1, 6, 7, 8), spacing: float = 1.2) -> Atoms:
    """n atoms placed with a minimum separation, so the geometry is chemical-ish and never coincident."""
    pos: list[np.ndarray] = []
    box = max(2.0, (n ** (1 / 3)) * 2.0)
    while len(pos) < n:
        p = rng.uniform(0, box, size=3)
        if all(np.linalg.norm(p - q) > spacing for q in pos):
            pos.append(p)
        else:
            box *= 1.01
    return Atoms(numbers=rng.choice(species, size=n), positions=np.array(pos))


def silicon_cell(rattle: float = 0.05, seed: int = 1) -> Atoms:
    atoms = bulk("Si", "diamond", a=5.43)
    atoms.rattle(rattle, seed=seed)
    return atoms


def triclinic_cu(seed: int = 2) -> Atoms:
    """A 2-atom triclinic cell much smaller than the cutoff (many periodic images)."""
    rng = np.random.default_rng(seed)
    cell = np.array([[2.6, 0.0, 0.0], [0.7, 2.5, 0.0], [0.4, 0.5, 2.7]])
    frac = rng.uniform(0, 1, size=(2, 3))
    return Atoms("Cu2", scaled_positions=frac, cell=cell, pbc=True)


def benzene() -> Atoms:
    return molecule("C6H6")


def random_molecules(n: int = 12, seed: int = 5, lo: int = 1, hi: int = 14) -> list[Atoms]:
    """``n`` molecules of :func:`random_molecule`, of ``lo`` to ``hi - 1`` atoms each."""
    rng = np.random.default_rng(seed)
    return [random_molecule(int(k), rng) for k in rng.integers(lo, hi, size=n)]


def make_model(seed: int = 0, **kw) -> StudentModel:
    """A small random student with non-trivial energy scale, for physics tests."""
    torch.manual_seed(seed)
    cfg = dict(species=[1, 6, 7, 8, 14, 29], hidden=32, layers=2, n_rbf=8, cutoff=4.0)
    cfg.update(kw)
    model = StudentModel(**cfg)
    n = len(model.config.species)
    model.set_energy_reference(shift=-torch.arange(1, n + 1, dtype=torch.float32), scale=torch.full((n,), 0.5))
    return model


def assert_bucket_csr(graph) -> None:
    """A PaddedGraph's static CSR buffers describe its current edge list exactly (recomputed here on the host by
    a different route: counts and a NumPy stable argsort). A stale CSR would give wrong forces silently. A graph
    without a sender CSR (``sender_csr`` False: the step walks the receiver rows of a full list) must hold a
    symmetric list instead, which is what that walk relies on: every real edge (i ← j, shift s) has its partner
    (j ← i, -s); its sender buffers were never written (zeros)."""
    ei = graph.edge_index.cpu().numpy()
    a = graph.bucket.atoms
    recv_ptr = np.concatenate([[0], np.cumsum(np.bincount(ei[0], minlength=a))])
    send_ptr = np.concatenate([[0], np.cumsum(np.bincount(ei[1], minlength=a))])
    assert (np.diff(ei[0]) >= 0).all(), "padded edges must stay sorted by receiver"
    # the padding edges (the slots past n_edges) belong to no row
    np.testing.assert_array_equal(graph.row_ptr.cpu().numpy(), np.minimum(recv_ptr, graph.n_edges))
    if graph.sender_csr:
        np.testing.assert_array_equal(graph.sender_perm.cpu().numpy(), np.argsort(ei[1], kind="stable"))
        np.testing.assert_array_equal(graph.sender_ptr.cpu().numpy(), np.minimum(send_ptr, graph.n_edges))
        return
    assert not graph.sender_perm.any() and not graph.sender_ptr.any(), "no sender CSR is written"
    assert_symmetric_edges(ei[:, : graph.n_edges], graph.shift_vectors[: graph.n_edges].cpu().numpy())


def edge_partners(edge_index, shifts, what: str = "the edge list") -> np.ndarray:
    """The partner of every edge of a full (symmetric) list: edge (i <- j, s) is paired with (j <- i, -s), shifts
    compared exactly (integer image shifts, or shift vectors where negation is exact). Fails unless the multiset of
    (i, j, s) equals that of (j, i, -s); returns ``partner [E]`` (edge ids)."""
    ei, sh = np.asarray(edge_index), np.asarray(shifts)
    fwd = sorted(zip(ei[0].tolist(), ei[1].tolist(), map(tuple, sh.tolist()), range(ei.shape[1]), strict=True))
    rev = sorted(zip(ei[1].tolist(), ei[0].tolist(), map(tuple, (-sh + 0).tolist()), range(ei.shape[1]), strict=True))
    assert [t[:3] for t in fwd] == [t[:3] for t in rev], f"{what} is not a full list"
    partner = np.empty(ei.shape[1], dtype=np.int64)
    partner[[t[3] for t in fwd]] = [t[3] for t in rev]
    return partner


def assert_symmetric_edges(edge_index, shift_vectors) -> None:
    """The edge list is symmetric: the multiset of (i, j, s) equals that of (j, i, -s), shifts compared exactly."""
    edge_partners(edge_index, np.asarray(shift_vectors, dtype=np.float64))


def assert_close_to(out, ref, precision, n_structures):
    """The documented tolerance: |ΔE| ≤ tol_E·max(1, |E|), max|ΔF| ≤ tol_F·max(1, max|F|)."""
    tol_e, tol_f = TOLERANCES[precision]
    e, e_ref = out["energy"].double().cpu(), ref["energy"].double().cpu()
    f, f_ref = out["forces"].double().cpu(), ref["forces"].double().cpu()
    assert e.shape == (n_structures,) and torch.isfinite(e).all() and torch.isfinite(f).all()
    assert ((e - e_ref).abs() <= tol_e * e_ref.abs().clamp_min(1.0)).all(), (
        precision,
        (e - e_ref).abs().max(),
    )
    assert (f - f_ref).abs().max() <= tol_f * max(1.0, float(f_ref.abs().max())), precision


def rattled_molecules(names: list[str], n: int, amount: float) -> list[Atoms]:
    """``n`` molecules cycling through ``names``, each rattled by ``amount`` Å with its own seed."""
    out = []
    for k in range(n):
        a = molecule(names[k % len(names)])
        a.rattle(amount, seed=k)
        out.append(a)
    return out


class InterruptAt:
    """Wraps ``real``: raises KeyboardInterrupt at call ``at`` (1-based; None: never) and counts the calls (the
    interrupted runs of the chunked file commands)."""

    def __init__(self, real, at: int | None) -> None:
        self.real, self.at, self.calls = real, at, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt
        return self.real(*args, **kwargs)


def capture_spy(monkeypatch, module: str, name: str) -> list:
    """Records, for each call of ``module.name`` from now on, whether a CUDA-graph capture was running (False on a
    machine without CUDA)."""
    import importlib

    mod = importlib.import_module(module)
    calls = []
    real = getattr(mod, name)

    def spy(*args, **kwargs):
        calls.append(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
        return real(*args, **kwargs)

    monkeypatch.setattr(mod, name, spy)
    return calls


def edge_sink_spy(monkeypatch) -> list:
    """Records, for each time a layer's backward feeds the second stream's sink
    (``kernels.message_passing._edge_grads_into``), whether a CUDA-graph capture was running."""
    return capture_spy(monkeypatch, "mlff_distiller.kernels.message_passing", "_edge_grads_into")


class FakeRunner:
    """A "captured" step that runs the step itself at each replay (``GraphRunner``'s contract): the CPU stand-in
    for a CUDA-graph capture (the ``fake_graphs`` fixture); ``made`` lists the runners made since the fixture."""

    made: list = []  # noqa: RUF012

    def __init__(self, fn, graph) -> None:
        self.fn, self.graph = fn, graph
        FakeRunner.made.append(self)

    def replay(self):
        return self.fn(*self.graph.inputs())


def our_pairs(nl, lo: int = 0, hi: int | None = None) -> list[tuple]:
    """Edges of the :class:`~mlff_distiller.neighbors.NeighborList` ``nl`` whose receiver lies in [lo, hi), with
    indices relative to ``lo``, as (i, j, S) tuples (S: the integer image shift)."""
    i, j = nl.edge_index.cpu().tolist()
    shifts = nl.shifts.cpu().tolist()
    hi = len(nl.row_ptr) - 1 if hi is None else hi
    return [(a - lo, b - lo, tuple(s)) for a, b, s in zip(i, j, shifts, strict=True) if lo <= a < hi]


def skin_and_fresh_engines(model, device, skin):
    """Two float64 eager engines of ``model``: the padded one with a Verlet skin of ``skin`` Å (None: a fresh list
    per call) and the plain reference with a fresh list every call."""
    from mlff_distiller import ForceEngine

    fast = ForceEngine(model, device=device, precision="fp64", mode="eager", pad=True, neighbor_skin=skin)
    ref = ForceEngine(model, device=device, precision="fp64", mode="eager")
    return fast, ref
