"""A NaN or inf output is never returned: predict_forces / ForceEngine.predict compute every other structure and then
raise NonFiniteOutputError (all results kept, None at the bad ones); the calculator raises it; the CLI writes the
finite structures and reports the others."""

import numpy as np
import pytest
import torch
from ase import Atoms
from ase.build import molecule

from mlff_distiller import ForceEngine, NonFiniteOutputError, StudentCalculator, predict_forces
from mlff_distiller.batch import AtomsBatch
from mlff_distiller.batching import result_rows

BAD_SIZE = 2  # structures of this many atoms get a NaN injected into their outputs (see _poison)


def _structures():
    tiny = Atoms("H2", positions=[[0, 0, 0], [0.74, 0, 0]])
    return [molecule("H2O"), tiny, molecule("CH4"), molecule("NH3"), tiny.copy(), molecule("CH3OH")]


def _poison(monkeypatch, what: str):
    """ForceEngine.compute with a NaN (or inf) in the energy / one force / the stress of every BAD_SIZE-atom
    structure."""
    real = ForceEngine.compute

    def compute(self, batch, **kw):
        out = dict(real(self, batch, **kw))
        counts = batch.ptr.diff()
        for b in torch.nonzero(counts == BAD_SIZE).flatten().tolist():
            if what == "energy":
                out["energy"] = _copy(out["energy"])
                out["energy"][b] = float("nan")
            elif what == "forces":
                out["forces"] = _copy(out["forces"])
                out["forces"][int(batch.ptr[b]) + 1, 2] = float("inf")
            else:
                out["stress"] = _copy(out["stress"])
                out["stress"][b, 3] = float("nan")
        return out

    monkeypatch.setattr(ForceEngine, "compute", compute)


def _copy(x):
    return x.copy() if isinstance(x, np.ndarray) else x.clone()  # the calculator asks for NumPy outputs


@pytest.mark.parametrize("what", ["energy", "forces"])
@pytest.mark.parametrize("pipeline", [False, True])
def test_predict_keeps_every_finite_result_and_names_the_bad_ones(model, monkeypatch, what, pipeline):
    structures = _structures()
    want = predict_forces(model, structures, device="cpu", precision="fp64")
    _poison(monkeypatch, what)
    with pytest.raises(NonFiniteOutputError, match=r"structure\(s\) 1, 4") as info:
        ForceEngine(model, device="cpu", precision="fp64").predict(structures, batch_size=2, pipeline=pipeline)
    err = info.value
    assert isinstance(err, ValueError) and err.indices == [1, 4] and len(err.results) == len(structures)
    assert "closest atom pair is 0.74 Å apart" in str(err)
    for k, (got, ref) in enumerate(zip(err.results, want, strict=True)):
        if k in (1, 4):
            assert got is None
        else:
            assert got["energy"] == pytest.approx(ref["energy"], abs=1e-10)
            np.testing.assert_allclose(got["forces"], ref["forces"], atol=1e-10)


def test_predict_stress_nan_is_caught(model, monkeypatch):
    cells = []
    for k, n in enumerate((3, BAD_SIZE, 4)):
        a = Atoms(f"H{n}", positions=np.random.default_rng(k).uniform(0, 4, (n, 3)), cell=[4.5] * 3, pbc=True)
        cells.append(a)
    _poison(monkeypatch, "stress")
    with pytest.raises(NonFiniteOutputError) as info:
        predict_forces(model, cells, device="cpu", stress=True, batch_size=3)
    assert info.value.indices == [1]
    assert info.value.results[0]["stress"].shape == (6,) and info.value.results[2] is not None


@pytest.mark.filterwarnings("ignore:overflow encountered", "ignore:invalid value encountered")
def test_large_finite_outputs_are_not_flagged():
    """Finite values whose sum overflows send a batch to the exact test, which flags nothing."""
    batch = AtomsBatch.from_atoms([molecule("H2O"), molecule("CH4")], dtype=torch.float64)
    n = batch.num_atoms
    out = {
        "energy": torch.tensor([1e308, 1e308], dtype=torch.float64),
        "forces": torch.full((n, 3), 1e308, dtype=torch.float64),
        "atomic_energies": torch.zeros(n, dtype=torch.float64),
    }
    rows = result_rows(batch, out)
    assert all(r is not None for r in rows) and rows[1]["energy"] == 1e308
    out["forces"][5, 0] = float("-inf")  # atom 5 is in structure 1 (H2O has 3 atoms)
    assert [r is None for r in result_rows(batch, out)] == [False, True]


def test_calculator_raises_instead_of_returning_nan(model, monkeypatch):
    _poison(monkeypatch, "forces")
    atoms = Atoms("H2", positions=[[0, 0, 0], [0.74, 0, 0]])
    atoms.calc = StudentCalculator(model, device="cpu", mode="eager")
    with pytest.raises(NonFiniteOutputError, match=r"StudentCalculator: .*not finite"):
        atoms.get_forces()
    fine = molecule("H2O")
    fine.calc = StudentCalculator(model, device="cpu", mode="eager")
    assert np.isfinite(fine.get_forces()).all()


def test_an_overflowing_structure_is_caught_for_real():
    """No injection: a cell of 0.5 Å puts ~8,000 periodic images within the cutoff of every atom and the builtin
    student overflows float32 there."""
    tiny = Atoms("H2", positions=[[0, 0, 0], [0.7, 0, 0]], cell=[0.5] * 3, pbc=True)
    with pytest.raises(NonFiniteOutputError, match="neighbours within"):
        predict_forces("builtin:chno-gfn2", [molecule("H2O"), tiny], device="cpu")


def test_cli_predict_writes_the_finite_structures_and_fails(model, monkeypatch, tmp_path):
    import ase.io

    from mlff_distiller.cli import main

    path = tmp_path / "model.pt"
    model.save(path)
    structures = _structures()
    ase.io.write(tmp_path / "in.xyz", structures)
    _poison(monkeypatch, "energy")
    out = tmp_path / "out.xyz"
    args = ["predict", "--model", str(path), "--input", str(tmp_path / "in.xyz"), "--output", str(out)]
    assert main([*args, "--device", "cpu"]) == 2
    written = ase.io.read(out, index=":")
    assert [len(a) for a in written] == [len(s) for k, s in enumerate(structures) if k not in (1, 4)]
    assert all(np.isfinite(a.get_forces()).all() for a in written)


def test_the_diagnosis_of_an_absurd_density_skips_the_neighbour_list():
    """A 0.02 Å cell would ask ASE for ~1e8 pairs per atom: the message gives the density instead."""
    from mlff_distiller.batching import nonfinite_message

    dense = Atoms("H2", positions=[[0, 0, 0], [0.01, 0, 0]], cell=[0.02] * 3, pbc=True)
    assert "atoms/Å³" in nonfinite_message(dense, 5.0)
    tiny = Atoms("H2", positions=[[0, 0, 0], [0.7, 0, 0]], cell=[0.5] * 3, pbc=True)
    assert "closest atom pair is 0.2 Å apart" in nonfinite_message(tiny, 5.0)
