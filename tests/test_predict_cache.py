"""predict_forces keeps its engine across calls: reused for the same student and settings, never for an edited
student, a changed checkpoint file, other settings or another thread; bounded and clearable."""

from __future__ import annotations

import copy
import os
import threading

import numpy as np
import pytest
import torch
from ase.build import molecule

import mlff_distiller.predict as predict_module
from mlff_distiller import ForceEngine, StudentModel, load_model, predict_forces
from mlff_distiller.predict import ENGINE_CACHE_SIZE, clear_engine_cache


@pytest.fixture
def built(monkeypatch):
    """Counts ForceEngine constructions."""
    count = {"n": 0}
    real = ForceEngine.__init__

    def init(self, *args, **kwargs):
        count["n"] += 1
        real(self, *args, **kwargs)

    monkeypatch.setattr(ForceEngine, "__init__", init)
    return count


def _student(seed: int = 0) -> StudentModel:
    torch.manual_seed(seed)
    return StudentModel(species=[1, 6, 7, 8], hidden=16, layers=2, n_rbf=8, cutoff=4.0)


def _structures():
    return [molecule("CH3CH2OH"), molecule("H2O")]


def _forces(results):
    return np.concatenate([r["forces"] for r in results])


def test_a_second_call_reuses_the_engine(built):
    model = _student()
    first = predict_forces(model, _structures(), device="cpu")
    second = predict_forces(model, _structures(), device="cpu")
    assert built["n"] == 1
    np.testing.assert_array_equal(_forces(first), _forces(second))


def test_other_settings_and_threads_get_their_own_engine(built):
    model = _student()
    predict_forces(model, _structures(), device="cpu")
    predict_forces(model, _structures(), device="cpu", precision="fp64")
    assert built["n"] == 2
    worker = threading.Thread(target=predict_forces, args=(model, _structures()), kwargs={"device": "cpu"})
    worker.start()
    worker.join()
    assert built["n"] == 3  # an engine is not shared between threads (its buffers are not)


@pytest.mark.parametrize(
    "edit", ["in_place", "load_state_dict", "optimizer_step", "data_swap", "new_parameter", "new_submodule"]
)
def test_an_edited_student_gets_a_new_engine(built, edit):
    """The padded path (mode 'cudagraph', the padded eager step on a CPU) computes with a frozen copy of the
    weights: a kept engine would give the old student's forces."""
    model = _student()
    before = predict_forces(model, _structures(), device="cpu", mode="cudagraph", precision="fp64")
    if edit == "in_place":
        with torch.no_grad():
            next(model.parameters()).mul_(1.5)
    elif edit == "load_state_dict":
        model.load_state_dict(_student(seed=1).state_dict())
    elif edit == "optimizer_step":
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
    elif edit == "data_swap":  # new storage under the same parameter, its version counter unchanged
        p = next(model.parameters())
        p.data = p.data * 1.5
    elif edit == "new_parameter":  # a parameter replaced by attribute assignment deep in the module tree
        owner, name = next((m, n) for m in model.modules() for n, p in m._parameters.items() if p is not None)
        setattr(owner, name, torch.nn.Parameter(getattr(owner, name).detach() * 1.5))
    else:  # a whole submodule replaced by a copy of other weights
        parent, name = next((m, n) for m in model.modules() for n, c in m._modules.items() if c is not None)
        child = copy.deepcopy(getattr(parent, name))
        with torch.no_grad():
            for p in child.parameters():
                p.mul_(1.5)
        setattr(parent, name, child)
    after = predict_forces(model, _structures(), device="cpu", mode="cudagraph", precision="fp64")
    assert built["n"] == 2
    fresh = ForceEngine(model, device="cpu", mode="eager", precision="fp64").predict(_structures())
    np.testing.assert_allclose(_forces(after), _forces(fresh), atol=1e-10)
    assert not np.allclose(_forces(after), _forces(before))


def test_the_cache_is_bounded_and_clearable(built):
    models = [_student(seed) for seed in range(ENGINE_CACHE_SIZE + 1)]
    for m in models:
        predict_forces(m, _structures(), device="cpu")
    assert len(predict_module._engines) == ENGINE_CACHE_SIZE
    predict_forces(models[-1], _structures(), device="cpu")  # the newest is kept
    assert built["n"] == ENGINE_CACHE_SIZE + 1
    predict_forces(models[0], _structures(), device="cpu")  # the oldest was dropped
    assert built["n"] == ENGINE_CACHE_SIZE + 2
    clear_engine_cache()
    assert not predict_module._engines
    predict_forces(models[0], _structures(), device="cpu")
    assert built["n"] == ENGINE_CACHE_SIZE + 3


def test_a_checkpoint_path_is_loaded_again_only_when_its_file_changes(tmp_path, monkeypatch):
    loads = []
    real = predict_module.load_model
    monkeypatch.setattr(predict_module, "load_model", lambda spec: loads.append(spec) or real(spec))
    path = tmp_path / "student.pt"
    _student(seed=0).save(path)
    first = predict_forces(str(path), _structures(), device="cpu")
    again = predict_forces(path, _structures(), device="cpu")
    assert len(loads) == 1
    np.testing.assert_array_equal(_forces(first), _forces(again))
    stat = path.stat()
    _student(seed=1).save(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # a new time even on a coarse clock
    changed = predict_forces(path, _structures(), device="cpu")
    assert len(loads) == 2
    expected = predict_forces(load_model(path), _structures(), device="cpu")
    np.testing.assert_array_equal(_forces(changed), _forces(expected))
    predict_forces("builtin:chno-gfn2", _structures(), device="cpu")
    predict_forces("builtin:chno-gfn2", _structures(), device="cpu")
    assert loads[2:] == ["builtin:chno-gfn2"]
    with pytest.raises(ValueError, match="no built-in model"):
        predict_forces("builtin:nope", _structures(), device="cpu")
    with pytest.raises(FileNotFoundError):
        predict_forces(tmp_path / "missing.pt", _structures(), device="cpu")


def test_out_of_memory_beside_kept_engines_frees_them_and_retries(monkeypatch):
    other, model = _student(seed=0), _student(seed=1)
    predict_forces(other, _structures(), device="cpu")
    real = predict_module.run_predictions
    calls = []

    def once_out_of_memory(engine, *args, **kwargs):
        calls.append(engine)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return real(engine, *args, **kwargs)

    monkeypatch.setattr(predict_module, "run_predictions", once_out_of_memory)
    results = predict_forces(model, _structures(), device="cpu")
    assert len(calls) == 2 and calls[0] is calls[1] and len(results) == 2
    assert [e for _, _, e in predict_module._engines.values()] == [calls[0]]  # the other engine was dropped
    calls.clear()
    monkeypatch.setattr(
        predict_module, "run_predictions", lambda *a, **k: (_ for _ in ()).throw(torch.OutOfMemoryError("x"))
    )
    with pytest.raises(torch.OutOfMemoryError):  # nothing left to free: the error is the caller's
        predict_forces(model, _structures(), device="cpu")


@pytest.mark.parametrize("mode", ["auto", "cudagraph"])
@pytest.mark.parametrize("precision", ["fp32", "fp64"])
def test_results_of_an_earlier_call_are_not_overwritten(mode, precision):
    """A kept engine reuses its buffers: the rows it returned before must not be views of them."""
    model = _student()
    first_in, second_in = _structures(), [molecule("C6H6"), molecule("NH3")]
    first = predict_forces(model, first_in, device="cpu", mode=mode, precision=precision)
    kept = [(r["energy"], r["forces"].copy(), r["energies"].copy()) for r in first]
    predict_forces(model, second_in, device="cpu", mode=mode, precision=precision)
    for r, (e, f, ea) in zip(first, kept, strict=True):
        assert r["energy"] == e
        np.testing.assert_array_equal(r["forces"], f)
        np.testing.assert_array_equal(r["energies"], ea)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("pipeline", [None, False])
def test_kept_engine_on_the_gpu(built, pipeline):
    """On CUDA (captured buckets, page-locked outputs): the second call reuses the engine and captures nothing
    new, earlier rows stay intact, and an in-place edit of the student gives a new engine with its forces."""
    model = _student().cuda()
    a, b = _structures(), [molecule("C6H6"), molecule("NH3")]
    predict_forces(model, a, pipeline=pipeline)  # capture_after=1: each bucket met once runs eagerly
    first = predict_forces(model, a, pipeline=pipeline)  # captured now: these rows come from replays
    kept = _forces(first).copy()
    predict_forces(model, b, pipeline=pipeline)
    predict_forces(model, b, pipeline=pipeline)
    engine = next(iter(predict_module._engines.values()))[2]
    graphs = {bucket: id(g) for bucket, g in engine._graphs.items()}
    captured = list(engine.captured_buckets)
    again = predict_forces(model, a, pipeline=pipeline)
    assert built["n"] == 1 and captured and engine.captured_buckets == captured  # no new capture
    assert graphs and {bucket: id(g) for bucket, g in engine._graphs.items()} == graphs
    np.testing.assert_array_equal(_forces(first), kept)  # bit for bit: the earlier rows are not overwritten
    # The same structures computed again: equal up to the last bits that CUDA's float32 atomics leave to the order
    # of the additions (bit equality here failed 1 run in 4 on the H100, 1e-10 eV/Å apart).
    np.testing.assert_allclose(_forces(again), kept, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        next(model.parameters()).mul_(1.5)
    edited = predict_forces(model, a, pipeline=pipeline)
    assert built["n"] == 2
    fresh = ForceEngine(model, device="cuda", mode="eager").predict(a)
    np.testing.assert_allclose(_forces(edited), _forces(fresh), atol=1e-4)
    assert not np.allclose(_forces(edited), kept, atol=1e-4)


def test_a_student_of_inference_tensors_is_not_kept(built, monkeypatch):
    """Inference tensors have no version counter: no engine is kept for them. On the CPU's written-out backward such
    a student gives forces (no autograd through its weights); through autograd, the engine's own error says why it
    cannot."""
    with torch.inference_mode():
        model = _student()
    want = ForceEngine(_student(), device="cpu").predict(_structures())
    for _ in range(2):
        got = predict_forces(model, _structures(), device="cpu")
        np.testing.assert_allclose(_forces(got), _forces(want), rtol=1e-6, atol=1e-6)
    assert built["n"] == 3 and not predict_module._engines
    real = ForceEngine.__init__
    monkeypatch.setattr(ForceEngine, "__init__", lambda self, *a, **kw: real(self, *a, **{**kw, "analytic": False}))
    with pytest.raises(RuntimeError, match=r"(?i)inference tensor"):
        predict_forces(model, _structures(), device="cpu")
    assert not predict_module._engines
