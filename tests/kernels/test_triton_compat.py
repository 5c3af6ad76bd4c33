"""The kernels' interpreter shims for older torch and Triton (``_triton_utils.wrap_triton``,
``mend_interpreter_index``): the CPU suite on torch 2.11 with its pinned Triton 3.6 failed in every interpreted op
test (torch's ``wrap_triton`` refused interpreted kernels) and, with NumPy 2.4, in every kernel with a tensor used as a
Python index (stop 80). CI runs newer versions, so each shim is tested here against a stand-in of the old behaviour."""

import importlib
import operator
import types
import warnings

import numpy as np
import pytest
import torch
from mlff_distiller.kernels import _triton_utils

pytestmark = pytest.mark.skipif(not _triton_utils.INTERPRETING, reason="needs the Triton interpreter (CPU tests)")


def test_every_launching_module_wraps_through_the_shim():
    """The op modules launch through ``_triton_utils.wrap_triton``, not torch's own (bound at their import)."""
    for name in ("edge_features", "message_passing", "rbf_cutoff"):
        module = importlib.import_module(f"mlff_distiller.kernels.{name}")  # the modules, not the functions
        assert module.wrap_triton is _triton_utils.wrap_triton is _triton_utils._wrap_interpreted, module.__name__


def test_interpreted_kernels_pass_through_where_torch_refuses_them(monkeypatch):
    """With torch's wrap_triton refusing anything but a compiled kernel (torch 2.11 / 2.12), an interpreted kernel
    still launches, and an op built on the shim runs and matches its reference."""
    from triton.runtime.jit import JITFunction

    rbf_cutoff = importlib.import_module("mlff_distiller.kernels.rbf_cutoff")

    def old_wrap_triton(kernel):
        if not isinstance(kernel, JITFunction):
            raise RuntimeError("wrap_triton only works on functions annotated with triton.jit or triton.autotune")
        return kernel

    monkeypatch.setattr(torch.library, "wrap_triton", old_wrap_triton)
    kernel = rbf_cutoff._rbf_cutoff_fwd_kernel
    assert _triton_utils.wrap_triton(kernel) is kernel
    with pytest.raises(RuntimeError, match="only works on"):
        _triton_utils.wrap_triton(object())  # anything else still goes to torch's
    dist = torch.linspace(0.3, 5.5, 37, dtype=torch.float64)
    got = torch.ops.mlff_distiller.rbf_cutoff(dist, 8, 5.0, "bessel", "cosine")  # the triton_op: wrap_triton inside
    want = rbf_cutoff.rbf_cutoff_reference(dist, 8, 5.0)
    torch.testing.assert_close(got, want)


class _Scope:
    """Triton's ``_LangPatchScope``: setattr, remembering the old values."""

    def __init__(self):
        self.changes = []

    def set_attr(self, obj, name, value):
        self.changes.append((obj, name, getattr(obj, name, None)))
        setattr(obj, name, value)


def _triton36_patch_lang_tensor(tensor, scope):
    # Triton 3.6's form (triton/runtime/interpreter.py): int() of a one-element 1-D array
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data))
    scope.set_attr(tensor, "__bool__", lambda self: bool(self.handle.data))


def _triton37_patch_lang_tensor(tensor, scope):
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))


def _index_of_a_1d_tensor(patch):
    class Tensor:
        def __init__(self, data):
            self.handle = types.SimpleNamespace(data=data)

    patch(Tensor, _Scope())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # NumPy 1.25-2.3 deprecate what 2.4 refuses
        return operator.index(Tensor(np.array([7], dtype=np.int32)))


def test_the_interpreters_index_is_mended_where_it_needs_it():
    old = types.ModuleType("interpreter_36")
    old._patch_lang_tensor = _triton36_patch_lang_tensor
    with pytest.raises((TypeError, DeprecationWarning)):
        _index_of_a_1d_tensor(old._patch_lang_tensor)  # the failure seen on torch 2.11's Triton with NumPy 2.4
    assert _triton_utils.mend_interpreter_index(old) is True
    assert _index_of_a_1d_tensor(old._patch_lang_tensor) == 7
    assert _triton_utils.mend_interpreter_index(old) is False  # once
    new = types.ModuleType("interpreter_37")
    new._patch_lang_tensor = _triton37_patch_lang_tensor
    assert _triton_utils.mend_interpreter_index(new) is False and new._patch_lang_tensor is _triton37_patch_lang_tensor
    assert _triton_utils.mend_interpreter_index(types.ModuleType("no_such_function")) is False
