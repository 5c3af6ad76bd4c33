"""The cache of tensors derived from frozen weights (kernels/_frozen.py): the stacked [U; V] of the fused PaiNN
update and the transposed weights of the Triton GEMMs' backward forms are made once, and never served stale."""

import gc

import torch
from mlff_distiller.kernels._frozen import _CACHE, derived


def _t(w):
    return w.t().contiguous()


def _entries(tag):
    return [key for key in _CACHE if key[0] == tag]


def test_made_once_then_returned():
    w = torch.randn(5, 3)
    first = derived("t", _t, w)
    assert torch.equal(first, w.t()) and first.is_contiguous()
    assert derived("t", _t, w) is first
    assert derived("t2", lambda x: x * 2, w) is not first  # another form of the same weight: its own entry
    assert torch.equal(derived("t2", lambda x: x * 2, w), w * 2)


def test_in_place_edits_are_refreshed_at_the_same_address():
    """An in-place edit (a new version) is copied into the kept tensor, whose address a CUDA graph may hold."""
    w = torch.randn(4, 6)
    kept = derived("t", _t, w)
    address = kept.data_ptr()
    with torch.no_grad():
        w.mul_(-3.0)
    again = derived("t", _t, w)
    assert again.data_ptr() == address and torch.equal(again, w.t())


def test_new_data_or_dtype_is_never_served_stale():
    """``module.to()`` swaps a parameter's data without a version bump: the data address tells."""
    lin = torch.nn.Linear(3, 4)
    kept = derived("t", _t, lin.weight)
    lin.double()
    got = derived("t", _t, lin.weight)
    assert got.dtype == torch.float64 and torch.equal(got, lin.weight.t())
    with torch.no_grad():
        lin.weight.data = torch.randn(4, 3, dtype=torch.float64)
    assert torch.equal(derived("t", _t, lin.weight), lin.weight.t())
    assert kept.dtype == torch.float32  # the old form was replaced, not written over in another dtype


def test_several_weights_and_their_entry_goes_with_them():
    # A tag no model uses: earlier tests' students (collected at any time) hold "uv" entries of their own.
    tag = "test-uv"
    gc.collect()
    u, v = torch.randn(2, 2), torch.randn(2, 2)
    stacked = derived(tag, lambda a, b: torch.cat([a, b]), u, v)
    assert torch.equal(stacked, torch.cat([u, v]))
    with torch.no_grad():
        v.add_(1.0)  # either weight's edit refreshes the form
    assert torch.equal(derived(tag, lambda a, b: torch.cat([a, b]), u, v), torch.cat([u, v]))
    assert len(_entries(tag)) == 1
    del u, v, stacked
    gc.collect()
    assert _entries(tag) == []


def test_inference_tensors_are_not_cached():
    with torch.inference_mode():
        w = torch.randn(3, 3)
    gc.collect()  # no other test's entry may go during the count
    n = len(_CACHE)
    a, b = derived("t", _t, w), derived("t", _t, w)
    assert a is not b and torch.equal(a, w.t()) and len(_CACHE) == n
