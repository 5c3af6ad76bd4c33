"""How ``chunks`` cuts structures into batches of an atom budget: complete, in order, within the budget, and of
nearly equal sizes (so that the batches of a long file land in few padded buckets)."""

import numpy as np
import pytest

from mlff_distiller.batching import _filled, chunks
from mlff_distiller.frames import FrameTable


def _cut(counts, budget):
    """The atom counts of each batch, for structures of ``counts`` atoms (stand-ins with a length)."""
    return [[len(s) for s in c] for c in chunks([[0] * int(n) for n in counts], None, budget)]


@pytest.mark.parametrize("seed", range(200))
def test_batches_are_complete_ordered_and_within_the_budget(seed):
    rng = np.random.default_rng(seed)
    counts = rng.integers(1, 20, size=int(rng.integers(0, 40))).tolist()
    budget = int(rng.integers(1, 60))
    batches = _cut(counts, budget)
    assert [n for b in batches for n in b] == counts
    assert all(sum(b) <= budget or len(b) == 1 for b in batches)
    assert len(batches) <= len(_filled(counts, 0, len(counts), budget))  # never more launches than filling


def test_a_chunk_of_a_long_file_is_cut_into_equal_batches():
    """10,000 small molecules (66,000 atoms) under a 57,000-atom budget: two batches of ~33,000 atoms, not 57,000
    and a remainder of whatever the chunk held (a new bucket for every chunk)."""
    rng = np.random.default_rng(1)
    for _ in range(5):
        counts = rng.integers(2, 12, size=10_000).tolist()
        sizes = [sum(b) for b in _cut(counts, 57_000)]
        assert len(sizes) == 2 and max(sizes) - min(sizes) <= 2 * max(counts)
    sizes = [sum(b) for b in _cut(rng.integers(2, 12, size=10_000).tolist(), 10_000)]
    assert len(sizes) == 7 and max(sizes) - min(sizes) <= 2 * 11


def test_small_cases():
    assert _cut([3, 3, 4, 7, 1, 2], 6) == [[3, 3], [4], [7], [1, 2]]
    assert _cut([4, 4, 4], 6) == [[4], [4], [4]]
    assert _cut([5] * 10, 12) == [[5, 5]] * 5
    assert _cut([10], 3) == [[10]]
    assert _cut([], 3) == []


def test_frame_table_batches_are_views_of_the_same_cuts():
    rng = np.random.default_rng(2)
    counts = rng.integers(1, 9, size=50)
    n = int(counts.sum())
    cells, pbc = np.zeros((50, 3, 3)), np.zeros((50, 3), bool)
    table = FrameTable(np.ones(n, dtype=int), rng.normal(size=(n, 3)), cells, pbc, counts)
    assert [c.atom_counts() for c in chunks(table, None, 40)] == _cut(counts.tolist(), 40)


def test_input_within_the_budget_is_one_batch():
    """Structures whose atoms fit the budget together are one batch (the single molecule of an interactive call
    takes no cutting), a list slice or a table view of all of them; nothing for no structures."""
    assert _cut([3, 4, 5], 12) == [[3, 4, 5]] and _cut([12], 12) == [[12]] and _cut([], 5) == []
    assert _cut([3, 4, 6], 12) == [[3, 4], [6]]
    mols = [[0] * 3, [0] * 4]
    (only,) = list(chunks(mols, None, 7))
    assert only == mols and only is not mols  # a slice, as every batch is
    counts = np.array([3, 4])
    table = FrameTable(np.ones(7, dtype=int), np.zeros((7, 3)), np.zeros((2, 3, 3)), np.zeros((2, 3), bool), counts)
    (view,) = list(chunks(table, None, 7))
    assert view.atom_counts() == [3, 4]
