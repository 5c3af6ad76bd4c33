"""``FrameTable``: many structures as concatenated arrays, predicted without an ``ase.Atoms`` each, with the rows,
batches, errors and out-of-memory splits of a list of ``Atoms``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import random_molecule, silicon_cell

from mlff_distiller import AtomsBatch, ForceEngine, FrameTable, predict_forces
from mlff_distiller.batching import chunks


def _structures(n: int = 13, seed: int = 3) -> list:
    rng = np.random.default_rng(seed)
    out = [random_molecule(int(k), rng) for k in rng.integers(1, 12, size=n)]
    if n > 4:
        out[4] = silicon_cell(seed=2)  # a periodic one among them
    return out


def _table(structures: list) -> FrameTable:
    return FrameTable(
        np.concatenate([a.numbers for a in structures]),
        np.concatenate([a.positions for a in structures]),
        np.stack([a.cell.array for a in structures]),
        np.stack([a.pbc for a in structures]),
        [len(a) for a in structures],
    )


def _same_rows(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for a, b in zip(want, got, strict=True):
        assert a.keys() == b.keys()
        assert a["energy"] == b["energy"]
        for key in ("forces", "energies", "stress"):
            if key in a:
                np.testing.assert_array_equal(a[key], b[key])


def test_indexing_and_slices_give_the_structures():
    structures = _structures()
    table = _table(structures)
    assert len(table) == len(structures) and table.atom_counts() == [len(a) for a in structures]
    for k in (0, 4, -1):
        atoms = table[k]
        np.testing.assert_array_equal(atoms.numbers, structures[k].numbers)
        np.testing.assert_array_equal(atoms.positions, structures[k].positions)
        np.testing.assert_array_equal(atoms.cell.array, structures[k].cell.array)
        np.testing.assert_array_equal(atoms.pbc, structures[k].pbc)
    with pytest.raises(IndexError):
        table[len(structures)]
    part = table[3:7]
    assert isinstance(part, FrameTable) and part.atom_counts() == [len(a) for a in structures[3:7]]
    np.testing.assert_array_equal(part[1].positions, structures[4].positions)
    assert len(table[9:2]) == 0
    with pytest.raises(ValueError, match="step 1"):
        table[::2]
    both = FrameTable.concat([table[:5], table[5:]])
    np.testing.assert_array_equal(both.positions, table.positions)
    assert [a.get_chemical_formula() for a in both] == [a.get_chemical_formula() for a in structures]


def test_bad_tables_are_refused_by_name():
    structures = _structures(3)
    good = _table(structures)
    args = [good.numbers, good.positions, good.cells, good.pbc, good.counts]
    with pytest.raises(ValueError, match="positions must be"):
        FrameTable(*args[:1], good.positions[:-1], *args[2:])
    with pytest.raises(ValueError, match="cells must be"):
        FrameTable(*args[:2], good.cells[:2], *args[3:])
    with pytest.raises(ValueError, match="counts sum to"):
        FrameTable(*args[:4], good.counts + 1)
    with pytest.raises(ValueError, match="structure 1 has no atoms"):
        FrameTable(*args[:4], [int(good.counts[0]) + int(good.counts[1]), 0, int(good.counts[2])])
    with pytest.raises(ValueError, match="numbers integers"):
        FrameTable(good.numbers.astype(float), *args[1:])


def test_a_batch_from_a_table_is_the_batch_from_its_atoms():
    structures = _structures()
    want, got = AtomsBatch.from_atoms(structures), AtomsBatch.from_atoms(_table(structures))
    for name in ("numbers", "positions", "cell", "pbc", "batch", "ptr"):
        assert torch.equal(getattr(want, name), getattr(got, name)), name
    bad = [a.copy() for a in structures]
    bad[6].positions[1, 2] = np.nan
    with pytest.raises(ValueError) as from_list:
        AtomsBatch.from_atoms(bad)
    with pytest.raises(ValueError) as from_table:
        AtomsBatch.from_atoms(_table(bad))
    assert str(from_table.value) == str(from_list.value) and "structure 6" in str(from_table.value)
    with pytest.raises(ValueError, match="at least one structure"):
        AtomsBatch.from_atoms(_table(structures)[2:2])


@pytest.mark.parametrize("batching", [{"batch_size": 4}, {"atom_budget": 20}])
def test_predictions_equal_those_of_a_list(model, batching):
    """The same rows as the list of Atoms (CPU, float64: bit for bit), batches cut the same way, stress of the
    periodic structure included."""
    structures = _structures()
    table = _table(structures)
    engine = ForceEngine(model, device="cpu", precision="fp64")
    sizes = [len(c) for c in chunks(table, batching.get("batch_size"), batching.get("atom_budget", 1))]
    assert sizes == [len(c) for c in chunks(structures, batching.get("batch_size"), batching.get("atom_budget", 1))]
    assert len(sizes) > 1
    _same_rows(engine.predict(table, stress=True, **batching), engine.predict(structures, stress=True, **batching))
    assert "stress" in engine.predict(table, stress=True, **batching)[4]
    _same_rows(
        predict_forces(model, table, device="cpu", precision="fp64"),
        predict_forces(model, structures, device="cpu", precision="fp64"),
    )


def test_out_of_memory_splits_a_table_and_keeps_order(model, monkeypatch):
    structures = _structures(17, seed=7)
    want = ForceEngine(model, device="cpu", precision="fp64").predict(structures, batch_size=1)
    engine = ForceEngine(model, device="cpu", precision="fp64")
    real = ForceEngine.compute

    def flaky(self, batch, **kw):
        if batch.num_atoms > 20:
            raise torch.OutOfMemoryError("CUDA out of memory (injected by the test)")
        return real(self, batch, **kw)

    monkeypatch.setattr(ForceEngine, "compute", flaky)
    got = engine.predict(_table(structures), atom_budget=10_000)
    assert engine.oom_splits >= 2
    for a, b in zip(want, got, strict=True):
        assert a["energy"] == pytest.approx(b["energy"], abs=1e-10)
        np.testing.assert_allclose(a["forces"], b["forces"], atol=1e-10)


def test_batches_fill_up_to_the_atom_budget():
    """Batches of whole structures up to the budget; one larger than the budget is a batch of its own."""
    counts = [3, 3, 4, 7, 1, 2]
    table = FrameTable(
        np.ones(sum(counts), int), np.zeros((sum(counts), 3)), np.zeros((6, 3, 3)), np.zeros((6, 3)), counts
    )
    assert [c.atom_counts() for c in chunks(table, None, 6)] == [[3, 3], [4], [7], [1, 2]]
    assert [c.atom_counts() for c in chunks(table, 4, 1)] == [[3, 3, 4, 7], [1, 2]]


def test_float32_batches_store_each_structure_from_its_first_atom():
    """``AtomsBatch.from_atoms`` in float32: positions relative to each structure's first atom (``origin``, float64
    on the CPU, kept by ``to``), the same whatever else is in the batch; ``to_atoms`` gives the positions back;
    float64 batches keep them as given."""
    import numpy as np
    import torch
    from ase.build import molecule

    from mlff_distiller import AtomsBatch

    a, b = molecule("H2O"), molecule("CH4")
    a.positions += 5000.0
    b.positions -= 20.0
    batch = AtomsBatch.from_atoms([a, b], dtype=torch.float32)
    assert batch.origin.dtype == torch.float64 and batch.origin.shape == (2, 3)
    np.testing.assert_array_equal(batch.origin.numpy(), [a.positions[0], b.positions[0]])
    assert batch.positions.abs().max() < 3.0  # each molecule from its own first atom
    alone = AtomsBatch.from_atoms([b], dtype=torch.float32)
    assert torch.equal(alone.positions, batch.positions[3:])  # bit for bit, as in a batch of its own
    back = batch.to(dtype=torch.float64).to_atoms()
    for got, want in zip(back, (a, b), strict=True):
        np.testing.assert_allclose(got.positions, want.positions, rtol=0, atol=1e-6)
    assert batch.to(dtype=torch.float64).origin is batch.origin
    assert AtomsBatch.from_atoms([a, b], dtype=torch.float64).origin is None
    np.testing.assert_array_equal(AtomsBatch.from_atoms(a).positions.numpy(), a.positions)
