"""The kernel backend rule (``MLFF_DISTILLER_KERNELS`` / ``set_backend`` / ``use_backend``) and its memo: every
kernel call resolves the backend, so the answers are cached per (request, device type, TRITON_INTERPRET); a
change of any of them must give a fresh answer, and errors must not be cached."""

import pytest
import torch
from mlff_distiller.kernels import _backend
from mlff_distiller.kernels._backend import get_backend, resolve_backend, set_backend, use_backend


@pytest.fixture(autouse=True)
def _restore_override():
    old = _backend._override
    yield
    _backend._override = old


def test_env_variable_and_python_override(monkeypatch):
    set_backend(None)
    monkeypatch.setenv("MLFF_DISTILLER_KERNELS", "torch")
    assert get_backend() == "torch" and resolve_backend("cpu") == "torch"
    monkeypatch.setenv("MLFF_DISTILLER_KERNELS", "auto")
    assert resolve_backend(torch.device("cpu")) == "torch"  # auto: torch for CPU tensors
    with use_backend("torch"):
        assert resolve_backend("cpu") == "torch"
    set_backend("TORCH ")
    assert get_backend() == "torch"


def test_unknown_backend_is_a_clear_error(monkeypatch):
    set_backend(None)
    monkeypatch.setenv("MLFF_DISTILLER_KERNELS", "cuda-magic")
    with pytest.raises(ValueError, match="unknown kernel backend 'cuda-magic'"):
        resolve_backend("cpu")
    with pytest.raises(ValueError, match="unknown kernel backend"):
        set_backend("fast")


def test_triton_where_it_cannot_run_is_an_error_every_time(monkeypatch):
    """CPU tensors without the interpreter cannot run Triton: a clear error, on every call (not cached), and the
    answer follows TRITON_INTERPRET when it changes."""
    pytest.importorskip("triton")
    set_backend("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for _ in range(2):
        with pytest.raises(RuntimeError, match=r"cannot run here.*TRITON_INTERPRET=1"):
            resolve_backend("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend("cpu") == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="cannot run here"):
        resolve_backend(torch.device("cpu"))


@pytest.mark.gpu
def test_auto_picks_triton_for_cuda_tensors(monkeypatch):
    set_backend(None)
    monkeypatch.setenv("MLFF_DISTILLER_KERNELS", "auto")
    assert resolve_backend("cuda") == "triton" and resolve_backend("cpu") == "torch"


@pytest.mark.parametrize("raw_environment", [True, False])
def test_the_memo_follows_every_environment_change(monkeypatch, raw_environment):
    """The memo is keyed by the environment's raw bytes where os.environ keeps them (POSIX), else by
    ``os.environ.get``: either way setting, changing and deleting the variables through ``os.environ`` gives the
    answer of the full rule at once, and a value that once failed fails again."""
    import os

    if not raw_environment:
        monkeypatch.setattr(_backend, "_ENV_BYTES", None)
    elif _backend._ENV_BYTES is None:
        pytest.skip("os.environ keeps no dict of bytes here")
    set_backend(None)
    monkeypatch.setenv("MLFF_DISTILLER_KERNELS", "torch")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert resolve_backend("cpu") == "torch"
    os.environ["MLFF_DISTILLER_KERNELS"] = "no-such"
    for _ in range(2):
        with pytest.raises(ValueError, match="unknown kernel backend 'no-such'"):
            resolve_backend("cpu")
    del os.environ["MLFF_DISTILLER_KERNELS"]
    assert resolve_backend("cpu") == "torch"  # auto on a CPU tensor
    if _backend._triton_importable():
        os.environ["MLFF_DISTILLER_KERNELS"] = "triton"
        with pytest.raises(RuntimeError, match="cannot run here"):
            resolve_backend("cpu")
        os.environ["TRITON_INTERPRET"] = "1"
        assert resolve_backend("cpu") == "triton"
        with use_backend("torch"):
            assert resolve_backend("cpu") == "torch"
        assert resolve_backend("cpu") == "triton"


def test_an_environ_replaced_by_another_object_is_read_as_it_is(monkeypatch):
    """Code that replaces ``os.environ`` itself (a plain dict, as some test set-ups do) is read through it, not
    through the raw bytes of the environment it replaced."""
    import os

    set_backend(None)
    monkeypatch.setenv("MLFF_DISTILLER_KERNELS", "torch")
    assert resolve_backend("cpu") == "torch"
    monkeypatch.setattr(os, "environ", {"MLFF_DISTILLER_KERNELS": "no-such"})
    with pytest.raises(ValueError, match="unknown kernel backend 'no-such'"):
        resolve_backend("cpu")
