import os

import pytest
import torch

# Triton kernels run on CPU tensors only under the interpreter, which must be chosen before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from helpers import make_model

if os.environ.get("TRITON_INTERPRET") == "1":
    # The interpreter's helper calls without their repeated language patch (tests/interpreter_calls.py: the dense
    # step's interpreter tests ~44 % faster, the same results).
    import interpreter_calls

    interpreter_calls.install()

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


@pytest.fixture
def model():
    return make_model()


@pytest.fixture(autouse=True)
def _fresh_predict_engines():
    """Each test starts without the engines predict_forces keeps across calls (and frees them after)."""
    from mlff_distiller.predict import clear_engine_cache

    clear_engine_cache()
    yield
    clear_engine_cache()


@pytest.fixture(autouse=True)
def _recompute_limit_restored():
    """A structure out of memory in predict lowers the update blocks' recompute limit for the whole process
    (batching._recompute_from): a test that injects one must not leave it to the next tests."""
    import importlib

    config = importlib.import_module("mlff_distiller.kernels.painn_update")._CONFIG
    before = config["recompute_uv_min_atoms"]
    yield
    config["recompute_uv_min_atoms"] = before


@pytest.fixture
def fake_graphs(monkeypatch):
    """The engine's captures replaced by :class:`helpers.FakeRunner` (the step run at each "replay"); returns the
    list of runners made."""
    from helpers import FakeRunner

    from mlff_distiller import engine_padded

    FakeRunner.made = []
    monkeypatch.setattr(engine_padded, "GraphRunner", FakeRunner)
    return FakeRunner.made
