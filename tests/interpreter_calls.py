"""The Triton interpreter's calls of ``@triton.jit`` helpers inside a kernel, made cheaper for the test suite.

Under ``TRITON_INTERPRET=1`` a kernel's launch (``GridExecutor.__call__``) patches ``triton.language`` (its
builtins become the interpreter's) for the whole grid and restores it afterwards. Every call of a jit'd *helper*
from inside that kernel (``InterpretedFunction.__call__``) patches it again: five ``inspect.getmembers`` over the
language's modules and a walk of the helper's module globals, ~0.3 ms a call. The dense step's kernels call their
small helpers (``_sum2``, the node products, ...) tens of thousands of times a step, so these repeated patches were
~40 % of its interpreter time (cProfile, stop 73: 47.6 of 123 s for one 16-slot float64 step).

The repeat changes nothing. The builtins the launch patched are no longer builtins (``tl.core.is_builtin`` is false
for the interpreter's wrappers), so the helper's ``_patch_builtin`` finds none to patch. Its other patches set the
same interpreter functions again, into a scope that is never restored. So a helper call made while a launch has
patched the same language modules (``tl`` and ``tl.core`` as the helper's globals name them) skips the patch and runs
the helper's rewritten function as Triton would. Any other call goes through Triton's own ``__call__``: one made
with no launch active, and the first call in a launch of a helper whose module names a language module that is not
patched yet (triton.language's own jit'd functions name ``tl.core``), after which that module counts as patched.

The interpreter also maps a Triton type to its NumPy one (``_get_np_dtype``) on every operation by building a dict
of 19 types first: ~7 % of the same profile. ``install`` puts a memo of the same map in its place (a block type by
its element type, pointers as ``uint64``, as Triton's function reads them): the dense step's float64 test step
~15 % faster again.

Test-suite only. It changes no kernel result (the kernel tests check every result against torch), and compiled
kernels on the GPU never use the interpreter. A Triton whose interpreter lacks these names keeps its own calls.
"""

from __future__ import annotations

import inspect
import threading

_state = threading.local()


def _langs(fn, cache: dict) -> frozenset:
    """The ids of the language modules (``triton.language``, ``triton.language.core``) that ``fn``'s globals name,
    which are what ``_patch_lang`` patches for ``fn`` (cached per function)."""
    key = id(fn)
    got = cache.get(key)
    if got is None or got[0] is not fn:
        import triton.language as tl

        mods = (tl, tl.core)
        ids = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and any(v is m for m in mods))
        got = cache[key] = (fn, ids)
    return got[1]


def install() -> bool:
    """Make nested helper calls skip the repeated language patch (see the module docstring). Returns whether it was
    installed (False where this Triton's interpreter does not have the structure it relies on)."""
    try:
        from triton.runtime import interpreter as it
    except ImportError:
        return False
    grid_cls, fn_cls = getattr(it, "GridExecutor", None), getattr(it, "InterpretedFunction", None)
    if grid_cls is None or fn_cls is None or not hasattr(it, "_patch_lang") or not hasattr(fn_cls, "rewrite"):
        return False
    if getattr(fn_cls, "_mlff_fast_calls", False):
        return True
    launch, call = grid_cls.__call__, fn_cls.__call__
    cache: dict = {}
    error = getattr(it, "InterpreterError", RuntimeError)

    def launch_patched(self, *args, **kwargs):
        outer = getattr(_state, "langs", None)
        _state.langs = _langs(self.fn, cache)
        try:
            return launch(self, *args, **kwargs)
        finally:
            _state.langs = outer

    def call_in_kernel(self, *args, **kwargs):
        active = getattr(_state, "langs", None)
        if active is None:
            return call(self, *args, **kwargs)
        langs = _langs(self.fn, cache)
        if not langs <= active:
            # Triton's own call patches the modules the launch did not (``tl.core`` for triton.language's own jit'd
            # functions, ``tl.sum`` and the like, whose module names ``core``), into a scope it never restores:
            # they stay patched for the rest of the launch (and after it, as they do without this module).
            out = call(self, *args, **kwargs)
            _state.langs = active | langs
            return out
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # as Triton's own __call__ reports a helper's failure
            raise error(repr(e)) from e

    grid_cls.__call__ = launch_patched
    fn_cls.__call__ = call_in_kernel
    fn_cls._mlff_fast_calls = True
    fn_cls._mlff_stock_calls = (launch, call)  # Triton's own (tests/test_interpreter_calls.py compares them)
    stock_np = getattr(it, "_get_np_dtype", None)
    if stock_np is not None:
        it._get_np_dtype = _np_dtype_memo(stock_np)
    return True


def _np_dtype_memo(stock):
    """``stock`` (the interpreter's ``_get_np_dtype``) with a memo: a block type maps as its element type, a pointer
    (or a block of pointers) to ``uint64``, as ``stock`` maps them; each scalar type is asked of ``stock`` once."""
    import numpy as np
    import triton.language as tl

    memo: dict = {}
    u64 = np.dtype(np.uint64)

    def np_dtype(tt):
        elem = tt.element_ty if isinstance(tt, tl.block_type) else tt
        if isinstance(elem, tl.pointer_type):
            return u64
        got = memo.get(elem)
        if got is None:
            got = memo[elem] = stock(elem)
        return got

    np_dtype._mlff_stock = stock
    return np_dtype
