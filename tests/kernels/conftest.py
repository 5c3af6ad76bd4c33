"""Fixtures for the Triton kernel tests.

Triton kernels run on CPU tensors only under the interpreter, and ``triton.jit`` chooses interpreter or
compiler when a kernel is *defined* (when ``mlff_distiller.kernels`` is first imported), so
``TRITON_INTERPRET`` must be set before that import. tests/conftest.py sets it for the whole session; setting
it again here keeps ``pytest tests/kernels`` right on its own. Devices whose kernels cannot run (CPU kernels
compiled for the GPU, e.g. when a plugin imported the package first) are skipped with the reason rather than
failing.
"""

import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from mlff_distiller.kernels import triton_available


def _kernels_run_on(device: str) -> tuple[bool, str]:
    if not triton_available(device):
        return False, f"Triton kernels cannot run on {device} here (CPU needs TRITON_INTERPRET=1)"
    if device == "cpu":
        import importlib

        from triton.runtime.interpreter import InterpretedFunction

        rbf = importlib.import_module("mlff_distiller.kernels.rbf_cutoff")
        if not isinstance(rbf._rbf_cutoff_fwd_kernel, InterpretedFunction):
            return False, "mlff_distiller.kernels was imported before TRITON_INTERPRET=1 was set"
    return True, ""


def _device_params() -> list:
    params = []
    for device in ("cpu", "cuda"):
        if device == "cuda" and not torch.cuda.is_available():
            continue
        ok, why = _kernels_run_on(device)
        params.append(pytest.param(device, marks=() if ok else pytest.mark.skip(reason=why)))
    return params


@pytest.fixture(params=_device_params())
def triton_device(request) -> torch.device:
    """Every device the Triton kernels can run on here: CPU (interpreter) and CUDA when present."""
    return torch.device(request.param)


@pytest.fixture
def poison():
    """Leave a NaN-filled block in the allocator cache, so that an output the kernel misses shows as NaN.

    Effective on CUDA (caching allocator); best effort on CPU.
    """

    def _poison(numel: int, dtype: torch.dtype, device: torch.device) -> None:
        block = torch.full((max(int(numel), 1),), float("nan"), dtype=dtype, device=device)
        del block

    return _poison


@pytest.fixture(params=["atom", "block"])
def variant(request):
    """The message-passing tests (test_message_passing*.py): run the forward and the sender backward with this
    kernel variant (the launch configuration). Tests elsewhere that parametrize a ``variant`` of their own get
    theirs (a direct parametrization overrides a fixture)."""
    import importlib

    mp_module = importlib.import_module("mlff_distiller.kernels.message_passing")
    # block_min_atoms=0: the test graphs are small, and the variant asked for must be the one that runs on CUDA.
    with mp_module._configured(fwd_variant=request.param, bwd_sender_variant=request.param, block_min_atoms=0):
        yield request.param


def pytest_configure(config):
    """Let ``from conftest import ...`` in test modules elsewhere keep working.

    Under pytest's default (prepend) import mode this file is imported as the module ``conftest`` as well, and
    then shadows tests/conftest.py in ``sys.modules``; expose the root conftest's public names from here too.
    """
    root = Path(__file__).resolve().parent.parent / "conftest.py"
    here = sys.modules[__name__]
    for plugin in config.pluginmanager.get_plugins():
        if getattr(plugin, "__file__", None) and Path(plugin.__file__).resolve() == root:
            for name, value in vars(plugin).items():
                hook_or_fixture = name.startswith("pytest") or "fixture" in type(value).__name__.lower()
                if not (name.startswith("_") or hook_or_fixture or hasattr(here, name)):
                    setattr(here, name, value)
