"""tests/interpreter_calls.py: the Triton interpreter's helper calls inside a kernel without the repeated language
patch give the results of Triton's own calls, with one patch a launch (plus one for triton.language's own helpers)
instead of one per helper call."""

import os

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402  (jit'd functions need ``tl`` among this module's globals)

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton interpreter only (TRITON_INTERPRET=1)"
)


@triton.jit
def _twice_plus_sum(x):
    return x * 2 + tl.sum(x, 0)  # tl.sum: triton.language's own jit'd helper (its module names tl.core)


@triton.jit
def _helpers_kernel(x_ptr, y_ptr, N: tl.constexpr):
    o = tl.arange(0, N)
    x = tl.load(x_ptr + o)
    for _ in tl.static_range(3):
        x = _twice_plus_sum(x)
    tl.store(y_ptr + o, x)


def _run(n=8):
    x = torch.arange(n, dtype=torch.float32) / 7
    y = torch.empty_like(x)
    _helpers_kernel[(1,)](x, y, N=n)
    want = x.numpy().astype(np.float64)
    for _ in range(3):
        want = want * 2 + want.sum()
    return y, want


def test_helper_calls_skip_the_repeated_patch_with_the_same_results(monkeypatch):
    import interpreter_calls
    from triton.runtime import interpreter as it

    assert interpreter_calls.install()  # (the suite's conftest installed it already: a second install keeps it)
    patches = []
    stock_patch = it._patch_lang
    monkeypatch.setattr(it, "_patch_lang", lambda fn: patches.append(fn.__name__) or stock_patch(fn))

    fast, want = _run()
    fast_patches = list(patches)
    launch, call = it.InterpretedFunction._mlff_stock_calls
    with monkeypatch.context() as m:
        m.setattr(it.GridExecutor, "__call__", launch)
        m.setattr(it.InterpretedFunction, "__call__", call)
        del patches[:]
        stock, _ = _run()
    np.testing.assert_allclose(fast.numpy(), want, rtol=1e-6)
    assert torch.equal(fast, stock)
    # Triton's own: the launch, then each of the 6 helper calls; ours: the launch, then tl.sum's first call only.
    assert patches == ["_helpers_kernel"] + ["_twice_plus_sum", "sum"] * 3, patches
    assert fast_patches == ["_helpers_kernel", "sum"], fast_patches
    # and a launch after the stock calls' return still takes ours
    del patches[:]
    again, _ = _run()
    assert torch.equal(again, fast) and patches == ["_helpers_kernel", "sum"]


def test_the_type_map_memo_answers_as_tritons_own():
    """Scalars, blocks, pointers and blocks of pointers: the memo's NumPy type is the interpreter's own."""
    import interpreter_calls
    from triton.runtime import interpreter as it

    assert interpreter_calls.install()
    memo = it._get_np_dtype
    stock = memo._mlff_stock
    types = [tl.float32, tl.float64, tl.int32, tl.int64, tl.int1, tl.bfloat16, tl.float16, tl.uint8]
    types += [tl.block_type(t, [4, 8]) for t in types]
    types += [tl.pointer_type(tl.float32), tl.block_type(tl.pointer_type(tl.float64), [16])]
    for t in types * 2:  # the second pass from the memo
        assert memo(t) == stock(t), t
