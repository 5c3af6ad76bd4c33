"""When the engine captures a bucket (``capture_after``) and when it stops its compile-ahead dry runs.

On the CPU the capture is a stand-in (:class:`FakeRunner`: the step run at "capture" and at each "replay"), so that
the policy is tested here; the real captures and their results run in the GPU tests (``test_capture_after_on_cuda``).
"""

from typing import ClassVar

import numpy as np
import pytest
import torch
from ase.build import molecule
from helpers import random_molecule, silicon_cell
from mlff_distiller.kernels import _compile_ahead

from mlff_distiller import AtomsBatch, ForceEngine, kernels, predict_forces
from mlff_distiller import engine_padded as padded_module


class FakeRunner:
    """A "captured" step that runs the step itself at each replay (same contract as ``GraphRunner``)."""

    made: ClassVar[list] = []

    def __init__(self, fn, graph) -> None:
        self.fn, self.graph = fn, graph
        FakeRunner.made.append(self)

    def replay(self):
        return self.fn(*self.graph.inputs())


@pytest.fixture
def fake_graphs(monkeypatch):
    FakeRunner.made = []
    monkeypatch.setattr(padded_module, "GraphRunner", FakeRunner)
    return FakeRunner.made


def _engine(model, **kw) -> ForceEngine:
    engine = ForceEngine(model, device="cpu", pad=True, precision="fp64", **kw)
    engine.mode = "cudagraph"  # what a CUDA engine resolves "cudagraph" to; its capture is the FakeRunner
    return engine


def _batch(mols) -> AtomsBatch:
    return AtomsBatch.from_atoms(mols, dtype=torch.float64)


def _mols(seed=3, n=4):
    rng = np.random.default_rng(seed)
    return [random_molecule(int(k), rng) for k in rng.integers(2, 9, size=n)]


def test_first_calls_of_a_bucket_run_eagerly_then_it_is_captured(model, fake_graphs):
    mols = _mols()
    reference = ForceEngine(model, device="cpu", precision="fp64").compute(_batch(mols))
    for after in (0, 1, 2):
        FakeRunner.made.clear()
        engine = _engine(model, capture_after=after)
        for call in range(4):
            out = engine.compute(_batch(mols))
            assert len(FakeRunner.made) == (1 if call >= after else 0), (after, call)
            np.testing.assert_allclose(out["forces"].numpy(), reference["forces"].numpy(), atol=1e-10)
            np.testing.assert_allclose(out["energy"].numpy(), reference["energy"].numpy(), atol=1e-10)
        assert engine.captured_buckets == [engine.last_bucket]


def test_each_bucket_and_step_kind_counts_its_own_calls(model, fake_graphs):
    engine = _engine(model, capture_after=1)
    small, large = [molecule("H2O")], [molecule("C6H6")] * 40
    engine.compute(_batch(small))
    engine.compute(_batch(large))
    assert FakeRunner.made == []  # two buckets, each met once
    engine.compute(_batch(small))
    assert len(FakeRunner.made) == 1
    engine.compute(_batch(large))
    assert len(FakeRunner.made) == 2 and len(engine.captured_buckets) == 2


def test_warmup_captures_at_once(model, fake_graphs):
    engine = _engine(model, capture_after=3)
    times = engine.warmup(structures=[_mols()])
    assert list(times) == engine.captured_buckets and len(FakeRunner.made) == 1


def test_capture_after_must_be_a_count(model):
    for bad in (-1, True):
        with pytest.raises(ValueError, match="capture_after"):
            ForceEngine(model, device="cpu", capture_after=bad)


def test_predict_captures_a_bucket_on_its_second_use(model, fake_graphs, monkeypatch):
    """``predict_forces`` builds its engines with ``capture_after=1``: a call meets its buckets once and runs them
    eagerly; the same structures again (the engine is kept) capture them."""
    made = []
    original = ForceEngine.__init__

    def spy(self, *args, **kw):
        original(self, *args, **kw)
        self.mode = "cudagraph"
        made.append(self)

    monkeypatch.setattr(ForceEngine, "__init__", spy)
    mols = [molecule("H2O"), molecule("C6H6")]  # two batches of one, two buckets
    settings = {"device": "cpu", "precision": "fp64", "batch_size": 1, "mode": "cudagraph"}
    with pytest.warns(RuntimeWarning, match="padded eager path"):  # on the CPU; the spy then fakes the graphs
        first = predict_forces(model, mols, **settings)
    assert made[0].capture_after == 1 and FakeRunner.made == []
    again = predict_forces(model, mols, **settings)
    assert len(made) == 1 and len(FakeRunner.made) == 2
    for a, b in zip(first, again, strict=True):
        np.testing.assert_allclose(a["forces"], b["forces"], atol=1e-10)


def test_dry_runs_stop_after_two_that_compiled_nothing(model, fake_graphs, monkeypatch):
    """The compile-ahead dry run before a bucket's first step: while one compiles something the engine keeps
    running them; after two in a row that compiled nothing it stops (each costs a step's host work)."""
    compiles = iter([3, 0, 0, 5, 0, 0, 0, 0])  # kernels each dry run hands to the compiler, in call order
    calls = []

    def dry_run(fn, *args, **kw):
        calls.append(fn)
        _compile_ahead.LAST["submitted"] = _compile_ahead.LAST["compiled"] = next(compiles)
        return True

    monkeypatch.setattr(kernels, "precompile", dry_run)
    engine = _engine(model, capture_after=0)
    rng = np.random.default_rng(0)
    for k in range(8):  # eight batches of growing size: a new bucket each
        engine.compute(_batch([random_molecule(4, rng) for _ in range(2 ** (k + 1))]))
    assert len(engine.captured_buckets) >= 6
    # compiled 3 (keep on), 0, 0 (two idle: stop) -> three dry runs only
    assert len(calls) == 3 and engine._idle_dry_runs[False] == 2
    assert torch.is_tensor(engine.compute(_batch(_mols()))["forces"])


def test_predict_file_engine_captures_on_second_use(model, tmp_path, monkeypatch):
    import ase.io

    from mlff_distiller import predict_file

    made = []
    original = ForceEngine.__init__

    def spy(self, *args, **kw):
        original(self, *args, **kw)
        made.append(self)

    monkeypatch.setattr(ForceEngine, "__init__", spy)
    ase.io.write(tmp_path / "in.extxyz", _mols(), format="extxyz")
    predict_file(model, tmp_path / "in.extxyz", tmp_path / "out.extxyz", device="cpu", workers=0)
    assert [e.capture_after for e in made] == [1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_capture_after_on_cuda(model):
    """Real captures: the first call of a bucket runs eagerly (nothing captured), the second captures, the third
    replays; every call equals the eager engine."""
    eager = ForceEngine(model, device="cuda", precision="fp32")
    engine = ForceEngine(model, device="cuda", precision="fp32", mode="cudagraph", capture_after=1)
    batch = AtomsBatch.from_atoms(_mols(n=6))
    ref = eager.compute(batch)
    for call in range(3):
        out = engine.compute(batch)
        assert len(engine.captured_buckets) == (0 if call == 0 else 1), call
        for key in ("energy", "forces"):
            scale = ref[key].abs().max().clamp_min(1e-3)
            assert (out[key] - ref[key]).abs().max() / scale <= 1e-5, (call, key)


def test_the_stress_step_counts_its_own_calls(model, fake_graphs):
    """The step with the strain derivative has its own graphs: its first call of a bucket runs eagerly too, and the
    energy + forces step of the same bucket keeps its own count."""
    batch = AtomsBatch.from_atoms([silicon_cell()], dtype=torch.float64)
    ref = ForceEngine(model, device="cpu", precision="fp64").compute(batch, stress=True)
    engine = _engine(model, capture_after=1)
    for call in range(3):
        out = engine.compute(batch, stress=True)
        assert (len(engine._stress_runners), len(engine._runners)) == ((0 if call == 0 else 1), 0), call
        np.testing.assert_allclose(out["stress"].numpy(), ref["stress"].numpy(), atol=1e-10)
        np.testing.assert_allclose(out["forces"].numpy(), ref["forces"].numpy(), atol=1e-10)
    engine.compute(batch)
    assert not engine._runners  # the energy + forces step of that bucket: its first call, eager
    engine.compute(batch)
    assert list(engine._runners) == list(engine._stress_runners)
