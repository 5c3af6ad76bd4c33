import os

import pytest
import torch

# Triton kernels run on CPU tensors only under the interpreter, which must be chosen before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from mlff_distiller import StudentModel  # noqa: E402

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


def make_model(seed: int = 0, **kw) -> StudentModel:
    """A small random student with non-trivial energy scale, for physics tests."""
    torch.manual_seed(seed)
    cfg = dict(species=[1, 6, 7, 8, 14, 29], hidden=32, layers=2, n_rbf=8, cutoff=4.0)
    cfg.update(kw)
    model = StudentModel(**cfg)
    n = len(model.config.species)
    model.set_energy_reference(shift=-torch.arange(1, n + 1, dtype=torch.float32), scale=torch.full((n,), 0.5))
    return model


@pytest.fixture
def model():
    return make_model()
