"""The engine's CUDA-graph captures: when a bucket is captured (``capture_after``), when the compile-ahead dry runs
stop, and what a capture that CUDA refuses or invalidates does (retried, then left eager; the collector kept off).

On the CPU the capture is a stand-in (:class:`FakeRunner`: the step run at "capture" and at each "replay"), so that
the policy is tested here; the real captures and their results run in the GPU tests (``test_capture_after_on_cuda``,
``test_capture_invalidated_by_cuda_is_retried_on_cuda``).
"""

import gc
import warnings

import numpy as np
import pytest
import torch
from ase.build import molecule
from helpers import FakeRunner, assert_close_to, random_molecule, silicon_cell
from helpers import random_molecules as _mols
from mlff_distiller.kernels import _compile_ahead

from mlff_distiller import AtomsBatch, ForceEngine, kernels, predict_forces
from mlff_distiller import engine_padded as padded_module

gpu = pytest.mark.gpu


def _engine(model, **kw) -> ForceEngine:
    engine = ForceEngine(model, device="cpu", pad=True, precision="fp64", **kw)
    engine.mode = "cudagraph"  # what a CUDA engine resolves "cudagraph" to; its capture is the FakeRunner
    return engine


def _batch(mols) -> AtomsBatch:
    return AtomsBatch.from_atoms(mols, dtype=torch.float64)


def _few(n=4):
    """``n`` small molecules of 2-8 atoms."""
    return _mols(n, seed=3, lo=2, hi=9)


def test_first_calls_of_a_bucket_run_eagerly_then_it_is_captured(model, fake_graphs):
    mols = _few()
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
    times = engine.warmup(structures=[_few()])
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
    assert torch.is_tensor(engine.compute(_batch(_few()))["forces"])


def test_an_eager_dry_run_per_step_kind_and_size_class(model):
    """The eager path's compile-ahead dry run (on CUDA) comes before the first step of each kind (forces, stress)
    and each size class (the powers of two of atoms and edges): a relaxation whose batch shrinks meets new launch
    configurations, which it compiled one by one at their first launch before."""
    engine = ForceEngine(model, device="cpu", mode="eager")
    due = engine._eager_dry_run_due
    with kernels.use_backend("torch"):  # no Triton kernel to compile: never a dry run
        assert not due(True, False, 5000, 40_000) and not engine._eager_compiled_ahead
    if not kernels.triton_available("cpu"):  # a GPU host's test run: Triton compiled for CUDA, no interpreter
        pytest.skip("the Triton backend on CPU tensors needs TRITON_INTERPRET=1 (set for CPU-only runs)")
    with kernels.use_backend("triton"):  # (the interpreter)
        _due_rule(due)
    assert len(engine._eager_compiled_ahead) == 5


def _due_rule(due) -> None:
    assert due(True, False, 5000, 40_000)
    assert not due(True, False, 5000, 40_000)
    assert not due(True, False, 4097, 32_768)  # the same class: 4097-8191 atoms, 32,768-65,535 edges
    assert due(True, True, 5000, 40_000)  # the stress step: another kind
    assert due(True, False, 4000, 40_000)  # fewer atoms: a class down
    assert due(True, False, 4000, 30_000)  # fewer edges
    assert due(False, False, 4000, 30_000)  # energies only
    assert not due(True, False, 2048, 16_384)  # 2048-4095 atoms with 16,384-32,767 edges: met by (4000, 30,000)


def test_predict_file_engine_captures_on_second_use(model, tmp_path, monkeypatch):
    import ase.io

    from mlff_distiller import predict_file

    made = []
    original = ForceEngine.__init__

    def spy(self, *args, **kw):
        original(self, *args, **kw)
        made.append(self)

    monkeypatch.setattr(ForceEngine, "__init__", spy)
    ase.io.write(tmp_path / "in.extxyz", _few(), format="extxyz")
    predict_file(model, tmp_path / "in.extxyz", tmp_path / "out.extxyz", device="cpu", workers=0)
    assert [e.capture_after for e in made] == [1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_capture_after_on_cuda(model):
    """Real captures: the first call of a bucket runs eagerly (nothing captured), the second captures, the third
    replays; every call equals the eager engine."""
    eager = ForceEngine(model, device="cuda", precision="fp32")
    engine = ForceEngine(model, device="cuda", precision="fp32", mode="cudagraph", capture_after=1)
    batch = AtomsBatch.from_atoms(_few(6))
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


@gpu
@pytest.mark.parametrize("fails", [1, 2])
def test_capture_invalidated_by_cuda_is_retried_on_cuda(model, monkeypatch, fails):
    """A real invalidated capture on the GPU: the step makes an unsafe call (a device synchronisation) inside its
    first ``fails`` captures. CUDA refuses it; the engine captures again (fails = 1: a graph that replays) or leaves
    the bucket eager with a warning (fails = 2). Results equal the eager engine's; the device stays usable."""
    from mlff_distiller import cudagraph, engine_padded

    left, gc_during_capture = [fails], []

    class Invalidating(cudagraph.GraphRunner):
        def __init__(self, fn, graph):
            def step(*args):
                out = fn(*args)
                if torch.cuda.is_current_stream_capturing():
                    gc_during_capture.append(gc.isenabled())
                if torch.cuda.is_current_stream_capturing() and left[0] > 0:
                    left[0] -= 1
                    torch.cuda.synchronize()  # not allowed while the stream captures
                return out

            super().__init__(step, graph)

    monkeypatch.setattr(engine_padded, "GraphRunner", Invalidating)
    monkeypatch.setattr(engine_padded, "CAPTURE_ATTEMPTS", 2)  # the default, whatever a session script set
    mols = _mols(6, seed=4)
    batch = AtomsBatch.from_atoms(mols)
    want = ForceEngine(model, device="cuda", mode="eager").compute(batch)
    engine = ForceEngine(model, device="cuda", mode="cudagraph")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # the second call replays (or runs the eager step again)
            got = engine.compute(batch)
            assert_close_to(got, want, "fp32", len(mols))
    assert engine.capture_failures == fails and left[0] == 0
    assert gc_during_capture and not any(gc_during_capture) and gc.isenabled()  # no collection while capturing
    assert torch.cuda.current_stream() == torch.cuda.default_stream()  # the failed captures gave the stream back
    runner = engine._runners[engine.last_bucket]
    assert isinstance(runner, engine_padded._EagerRunner) == (fails == 2)
    assert any("runs eagerly" in str(w.message) for w in caught) == (fails == 2)


@gpu
def test_a_collection_inside_a_capture_cannot_destroy_an_old_graph(model, monkeypatch):
    """Since torch 2.9 ``torch.cuda.graph`` no longer collects garbage before it captures (pytorch#158193), and an
    automatic collection during a capture that finalises an unreachable CUDA graph invalidates the capture
    (pytorch#161037; NVIDIA TransformerEngine#2092). Here the step, while it is being captured, drops a cycle that
    holds a captured graph and then allocates enough Python objects to trigger collections: the engine's
    captures keep the collector off, so nothing is retried and the result equals eager."""
    from mlff_distiller import cudagraph, engine_padded

    class Cycle:
        def __init__(self, obj):
            self.obj, self.me = obj, self

    def old_graph():
        g, x = torch.cuda.CUDAGraph(), torch.zeros(1, device="cuda")
        with torch.cuda.graph(g):
            x.add_(1)
        return g

    class Littering(cudagraph.GraphRunner):
        def __init__(self, fn, graph):
            def step(*args):
                out = fn(*args)
                if torch.cuda.is_current_stream_capturing():
                    if held:
                        Cycle(held.pop())  # the graph's only reference, in an unreachable cycle: GC frees it
                    junk = [[] for _ in range(20_000)]  # well past gen-0's threshold: collections if enabled
                    del junk
                return out

            super().__init__(step, graph)

    held = [old_graph()]
    monkeypatch.setattr(engine_padded, "GraphRunner", Littering)
    batch = AtomsBatch.from_atoms(_mols(5, seed=8))
    engine = ForceEngine(model, device="cuda", mode="cudagraph")
    got = engine.compute(batch)
    assert engine.capture_failures == 0
    assert_close_to(got, ForceEngine(model, device="cuda", mode="eager").compute(batch), "fp32", 5)
    assert not held
    gc.collect()  # the old graph goes now, outside any capture


def test_capture_failures_are_told_apart_from_other_errors():
    """The messages CUDA gives for a refused or invalidated capture count as capture failures (retried); any other
    error does not (raised as it is)."""
    from mlff_distiller.cudagraph import is_capture_failure

    for msg in (
        "CUDA error: operation failed due to a previous error during capture",
        "CUDA error: operation not permitted when stream is capturing",
        "CUDA error: capture was invalidated (cudaErrorStreamCaptureInvalidated)",
    ):
        assert is_capture_failure(RuntimeError(msg)), msg
    assert not is_capture_failure(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not is_capture_failure(ValueError("capture"))


def test_capturing_keeps_the_collector_off_and_restores_it(monkeypatch):
    """``cudagraph.capturing`` with a stand-in ``torch.cuda.graph``: the collector is off inside, back on after
    (also after a failure, which carries the capture mode and the live threads as a note), and left off if the
    caller had it off."""
    import contextlib

    from mlff_distiller.cudagraph import capturing

    seen = []

    @contextlib.contextmanager
    def graph(g, capture_error_mode="global"):
        seen.append(capture_error_mode)
        yield

    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gc.isenabled()
    with capturing(object(), mode="thread_local"):
        assert not gc.isenabled()
    assert gc.isenabled() and seen == ["thread_local"]
    with pytest.raises(RuntimeError, match="stream is capturing") as info:
        with capturing(object()):
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
    assert gc.isenabled() and any(
        "Python threads alive: " in note and "MainThread" in note for note in info.value.__notes__
    )
    gc.disable()
    try:
        with capturing(object()):
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.parametrize("fails", [1, 2])
def test_an_invalidated_capture_is_retried_then_left_eager(model, monkeypatch, fails):
    """A capture that CUDA invalidates (seen once, intermittently, on the H100) is tried again; a second failure
    leaves that bucket's step eager with a warning instead of ending the run. Results equal the eager path's; any
    other error is raised. (A CPU stand-in for GraphRunner: the capture logic is what is tested.)"""
    from mlff_distiller import engine_padded

    class Flaky:
        left = fails

        def __init__(self, fn, graph):
            if Flaky.left > 0:
                Flaky.left -= 1
                raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
            self.fn, self.graph = fn, graph

        def replay(self):
            return self.fn(*self.graph.inputs())

    monkeypatch.setattr(engine_padded, "GraphRunner", Flaky)
    engine = ForceEngine(model, device="cpu", precision="fp64", pad=True)
    engine.mode = "cudagraph"  # the captured path's bookkeeping, on the CPU
    batch = AtomsBatch.from_atoms(_mols(4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = engine.compute(batch)
    assert_close_to(out, ForceEngine(model, device="cpu", precision="fp64").compute(batch), "fp64", 4)
    assert engine.capture_failures == fails
    runner = engine._runners[engine.last_bucket]
    eager = isinstance(runner, engine_padded._EagerRunner)
    assert eager == (fails == 2) and any("runs eagerly" in str(w.message) for w in caught) == eager
    monkeypatch.setattr(engine_padded, "GraphRunner", lambda fn, graph: (_ for _ in ()).throw(RuntimeError("other")))
    fresh = ForceEngine(model, device="cpu", precision="fp64", pad=True)
    fresh.mode = "cudagraph"
    with pytest.raises(RuntimeError, match="other"):  # not a capture failure: raised as it is
        fresh.compute(batch)
    assert fresh.capture_failures == 0


@pytest.mark.parametrize("oom_eager", [False, True, "large bucket"])
def test_a_capture_out_of_memory(model, monkeypatch, oom_eager):
    """A capture that runs out of GPU memory: raised as it is for the batch splitting (predict's engines), or with
    ``oom_eager`` (BatchedMD's engine: its batch cannot be split) the bucket's step left eager with a warning, the
    same results, no capture tried again for that bucket; the same for a bucket of more than ``oom_eager_edges``
    edges (the buckets beyond AUTO_MAX_EDGES that mode "auto" captures since stop 51: here every bucket, with the
    limit at 0). (A CPU stand-in for GraphRunner, as above.)"""
    from mlff_distiller import engine_padded
    from mlff_distiller.engine import AUTO_MAX_EDGES

    tries = []

    def out_of_memory(fn, graph):
        tries.append(1)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(engine_padded, "GraphRunner", out_of_memory)
    engine = ForceEngine(model, device="cpu", precision="fp64", pad=True)
    engine.mode = "cudagraph"  # the captured path's bookkeeping, on the CPU
    assert engine.oom_eager_edges == AUTO_MAX_EDGES
    engine.oom_eager = oom_eager is True
    if oom_eager == "large bucket":
        engine.oom_eager_edges = 0
    batch = AtomsBatch.from_atoms(_mols(4))
    if not oom_eager:
        with pytest.raises(torch.OutOfMemoryError):
            engine.compute(batch)
        assert not engine._runners and engine.capture_failures == 0
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = engine.compute(batch)
        again = engine.compute(batch)
    want = ForceEngine(model, device="cpu", precision="fp64").compute(batch)
    assert_close_to(out, want, "fp64", 4)
    assert_close_to(again, want, "fp64", 4)
    assert isinstance(engine._runners[engine.last_bucket], engine_padded._EagerRunner)
    assert len(tries) == 1 and engine.capture_failures == 1
    assert sum("ran out of GPU memory" in str(w.message) for w in caught) == 1


def test_batched_md_engine_leaves_out_of_memory_captures_eager(model):
    """BatchedMD's engine (fixed shape) sets oom_eager; a relaxation's (whose batch the caller may split) does not."""
    from mlff_distiller.batched_md import batch_engine

    kw = dict(device="cpu", precision="fp64", mode="auto", skin=0.5)
    assert batch_engine(model, True, fixed_shape=True, **kw).oom_eager
    assert not batch_engine(model, True, **kw).oom_eager
    assert not ForceEngine(model, device="cpu").oom_eager


def test_an_out_of_memory_capture_releases_the_other_buckets_once(model, monkeypatch):
    """A capture that runs out of memory while other buckets hold captured graphs (each with a private pool for
    the engine's life) releases them (with a warning) and captures once more; results unchanged. Only once per
    engine: a later out-of-memory capture goes the old way (raised for the batch splitting, or left eager with
    ``oom_eager``) instead of trading captures between buckets that do not fit together. ``release_captures``
    keeps the bucket asked for and the buckets left eager, and drops the stress steps' graphs too."""
    engine = _engine(model)
    small, large = _few(2), [molecule("C6H6")] * 30
    made = []

    def fits_alone(fn, graph):  # a capture fits only while no other bucket holds a captured graph
        if any(isinstance(r, FakeRunner) for r in engine._runners.values()):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        made.append(FakeRunner(fn, graph))
        return made[-1]

    monkeypatch.setattr(padded_module, "GraphRunner", fits_alone)
    want_small = ForceEngine(model, device="cpu", precision="fp64").compute(_batch(small))
    want_large = ForceEngine(model, device="cpu", precision="fp64").compute(_batch(large))
    out = engine.compute(_batch(small))
    first = engine.last_bucket
    assert len(made) == 1 and engine.captured_buckets == [first]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out_large = engine.compute(_batch(large))
    second = engine.last_bucket
    assert second != first and engine.captured_buckets == [second] and len(made) == 2
    assert engine.captures_released == 1 and engine.capture_failures == 0
    assert sum("released the captured graphs of 1 other bucket" in str(w.message) for w in caught) == 1
    assert_close_to(out, want_small, "fp64", 2)
    assert_close_to(out_large, want_large, "fp64", 30)
    with pytest.raises(torch.OutOfMemoryError):  # the first bucket again: no second release
        engine.compute(_batch(small))
    assert engine.captured_buckets == [second] and engine.captures_released == 1
    engine.oom_eager = True
    with pytest.warns(RuntimeWarning, match="this bucket's step runs eagerly"):
        again = engine.compute(_batch(small))
    assert_close_to(again, want_small, "fp64", 2)
    assert isinstance(engine._runners[first], padded_module._EagerRunner)
    engine._stress_runners[first] = FakeRunner(None, None)
    assert engine.release_captures(keep=second) == 1  # the stress graph; the eager bucket and `keep` stay
    assert set(engine._runners) == {first, second} and not engine._stress_runners
    assert engine.release_captures() == 1 and list(engine._runners) == [first]
    assert engine.captures_released == 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_release_captures_frees_their_pools_on_cuda(model):
    """Real captures of two buckets: release_captures drops both graphs, their private pools go back to the device
    (reserved memory falls by at least a bucket's pool), and the next calls capture again with the same results."""
    from ase.build import molecule

    engine = ForceEngine(model, device="cuda", precision="fp32", mode="cudagraph")
    batches = [AtomsBatch.from_atoms(_few(6)), AtomsBatch.from_atoms([molecule("C6H6")] * 200)]
    first = [engine.compute(b) for b in batches]
    assert len(engine.captured_buckets) == 2
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    held = torch.cuda.memory_reserved()
    assert engine.release_captures() == 2 and engine.captured_buckets == []
    freed = held - torch.cuda.memory_reserved()
    assert freed > 0, (held, freed)
    again = [engine.compute(b) for b in batches]
    assert len(engine.captured_buckets) == 2
    for a, b in zip(first, again, strict=True):
        for key in ("energy", "forces"):  # (the position gradient's atomics add in any order)
            scale = a[key].abs().max().clamp_min(1e-3)
            assert (a[key] - b[key]).abs().max() / scale <= 1e-6, key
