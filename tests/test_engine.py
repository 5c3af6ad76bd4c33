"""ForceEngine and predict_forces: API contract, one autograd.grad per batch, chunking, bad input."""

import numpy as np
import pytest
import torch
from ase import Atoms
from ase.build import molecule
from helpers import random_molecule, silicon_cell

from mlff_distiller import AtomsBatch, ForceEngine, predict_forces


def test_exactly_one_autograd_grad_per_batch(model, monkeypatch):
    calls = []
    real = torch.autograd.grad

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.autograd, "grad", counting)
    batch = AtomsBatch.from_atoms([molecule("H2O"), silicon_cell(), molecule("CH4")])
    # autograd's backward: one call for the whole batch; the CPU's written-out backward (the default there): none
    for analytic, want in ((False, 1), (True, 0)):
        calls.clear()
        engine = ForceEngine(model, device="cpu", precision="fp64", analytic=analytic)
        out = engine.compute(batch, forces=True, stress=True)
        assert len(calls) == want and engine.n_analytic == int(analytic)
        assert out["forces"].shape == (batch.num_atoms, 3) and out["stress"].shape == (3, 6)
        assert out["stress_valid"].tolist() == [False, True, False]


def test_inference_keeps_no_parameter_graph(model):
    engine = ForceEngine(model, device="cpu", precision="fp32")
    out = engine.compute(AtomsBatch.from_atoms(molecule("C6H6")))
    assert not out["energy"].requires_grad and not out["forces"].requires_grad
    assert all(p.grad is None for p in engine.model.parameters())
    assert all(p.requires_grad for p in model.parameters())  # the user's model is left as it was


def test_shared_model_is_frozen_during_the_call_and_restored(model):
    """The eager path runs the caller's own model when device and dtype match: its parameters require no grad
    inside the call (no parameter graph), and each keeps its own flag afterwards, a frozen one included."""
    dtype = next(model.parameters()).dtype
    frozen = next(model.parameters())
    frozen.requires_grad_(False)
    try:
        engine = ForceEngine(model, device="cpu", precision="fp64" if dtype == torch.float64 else "fp32")
        assert engine.model is model  # shared, not copied
        seen = []
        hook = model.register_forward_pre_hook(lambda mod, _: seen.append([p.requires_grad for p in mod.parameters()]))
        try:
            engine.compute(AtomsBatch.from_atoms(molecule("H2O")))
        finally:
            hook.remove()
        assert seen and not any(seen[0])
        assert [p.requires_grad for p in model.parameters()] == [p is not frozen for p in model.parameters()]
    finally:
        frozen.requires_grad_(True)


def test_predict_contract(model, device):
    mols = [molecule("H2O"), silicon_cell(), molecule("NH3")]
    res = predict_forces(model, mols, device=device, stress=True)
    assert len(res) == 3
    for atoms, row in zip(mols, res, strict=True):
        assert isinstance(row["energy"], float)
        assert isinstance(row["forces"], np.ndarray) and row["forces"].shape == (len(atoms), 3)
        assert np.isfinite(row["forces"]).all()
    assert "stress" not in res[0] and "stress" not in res[2]
    assert res[1]["stress"].shape == (6,)
    assert predict_forces(model, [], device=device) == []
    assert "stress" not in predict_forces(model, mols[:1], device=device)[0]


def _spy_engines(monkeypatch) -> list:
    """The ForceEngines that predict_forces makes, recorded."""
    import mlff_distiller.predict as predict_module

    made = []

    class Spy(ForceEngine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(predict_module, "ForceEngine", Spy)
    return made


def test_predict_forces_defaults_to_mode_auto(model, monkeypatch):
    """predict_forces runs mode "auto" unless told otherwise: eager on a CPU (as before), captured buckets on CUDA
    (2-3x faster with small batches, bench_host_h100_pipeline.md)."""
    made = _spy_engines(monkeypatch)
    predict_forces(model, [molecule("H2O")], device="cpu")
    predict_forces(model, [molecule("H2O")], device="cpu", mode="eager")
    assert [(e.requested_mode, e.mode) for e in made] == [("auto", "eager"), ("eager", "eager")]


@pytest.mark.gpu
def test_predict_forces_default_captures_on_cuda(model, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    rng = np.random.default_rng(12)
    mols = [random_molecule(int(n), rng) for n in rng.integers(1, 20, size=12)]
    made = _spy_engines(monkeypatch)
    auto = predict_forces(model, mols, device="cuda", batch_size=4)
    # capture_after=1: the buckets met once ran eagerly; the same call again (the engine kept) captures them.
    again = predict_forces(model, mols, device="cuda", batch_size=4)
    eager = predict_forces(model, mols, device="cuda", batch_size=4, mode="eager")
    assert [e.mode for e in made] == ["cudagraph", "eager"] and made[0].capture_after == 1
    assert made[0].captured_buckets and not made[1].captured_buckets
    for a, c, b in zip(auto, again, eager, strict=True):
        assert c["energy"] == pytest.approx(b["energy"], rel=1e-5, abs=1e-5)
        np.testing.assert_allclose(c["forces"], b["forces"], atol=1e-4)
        assert a["energy"] == pytest.approx(b["energy"], rel=1e-5, abs=1e-5)
        np.testing.assert_allclose(a["forces"], b["forces"], atol=1e-4)


def test_chunking_keeps_order_and_values(model):
    rng = np.random.default_rng(11)
    mols = [random_molecule(int(n), rng) for n in rng.integers(1, 20, size=25)]
    whole = predict_forces(model, mols, precision="fp64", batch_size=100)
    by3 = predict_forces(model, mols, precision="fp64", batch_size=3)
    budget = ForceEngine(model, device="cpu", precision="fp64").predict(mols, atom_budget=17)
    for a, b, c in zip(whole, by3, budget, strict=True):
        assert a["energy"] == pytest.approx(b["energy"], abs=1e-10) == pytest.approx(c["energy"], abs=1e-10)
        np.testing.assert_allclose(a["forces"], c["forces"], atol=1e-10)


def test_fp32_close_to_fp64(model, device):
    mols = [molecule("C6H6"), silicon_cell()]
    r64 = predict_forces(model, mols, precision="fp64", device=device)
    r32 = predict_forces(model, mols, precision="fp32", device=device)
    for a, b in zip(r64, r32, strict=True):
        assert abs(a["energy"] - b["energy"]) < 1e-4 * max(1, abs(a["energy"]))
        np.testing.assert_allclose(b["forces"], a["forces"], atol=1e-4)


def test_unknown_element_is_a_value_error(model):
    with pytest.raises(ValueError, match=r"unknown element.*'Au'"):
        predict_forces(model, [Atoms("Au2", positions=[[0, 0, 0], [2.5, 0, 0]])])


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_positions_are_a_value_error(model, bad):
    atoms = molecule("H2O")
    atoms.positions[1, 2] = bad
    with pytest.raises(ValueError, match="non-finite position for atom 1"):
        predict_forces(model, [atoms])


def test_zero_volume_cell_is_a_value_error(model):
    atoms = Atoms("Si2", positions=[[0, 0, 0], [1.3, 1.3, 1.3]], cell=[[5, 0, 0], [0, 5, 0], [5, 5, 0]], pbc=True)
    with pytest.raises(ValueError, match="zero-volume cell"):
        predict_forces(model, [atoms])
    slab = Atoms(
        "Si2", positions=[[0, 0, 0], [1.3, 1.3, 1.3]], cell=[[5, 0, 0], [0, 5, 0], [0, 0, 0]], pbc=[True, True, False]
    )
    assert np.isfinite(predict_forces(model, [slab])[0]["forces"]).all()  # a slab's zero c-vector is fine


@pytest.mark.parametrize(
    ("field", "bad", "message"),
    [
        ("numbers", torch.ones(2, 1, dtype=torch.long), r"numbers must be \[N\], got \(2, 1\)"),
        ("positions", torch.zeros(3, 3), r"positions must be \[2, 3\], got \(3, 3\)"),
        ("cell", torch.zeros(1, 3), r"cell must be \[B, 3, 3\], got \(1, 3\)"),
        ("pbc", torch.zeros(1, 2, dtype=torch.bool), r"pbc must be \[1, 3\], got \(1, 2\)"),
        ("batch", torch.zeros(3, dtype=torch.long), r"batch must be \[2\], got \(3,\)"),
        ("ptr", torch.tensor([0, 1, 2]), r"ptr must be \[2\], got \(3,\)"),
        ("positions64", torch.zeros(2, 3, dtype=torch.float64), "positions64 and cell64 come together"),
        ("both64", (torch.zeros(3, 3, dtype=torch.float64), torch.zeros(1, 3, 3)), r"positions64 must be \[2, 3\]"),
        ("both64", (torch.zeros(2, 3, dtype=torch.float64), torch.zeros(2, 3, 3)), r"cell64 must be \[1, 3, 3\]"),
    ],
)
def test_mismatched_shapes_are_a_value_error_naming_the_field(field, bad, message):
    """Every shape the batch contract fixes, broken alone, gives its own message (the first broken one in the
    contract's order), and a well-formed batch passes."""
    fields = dict(
        numbers=torch.tensor([1, 1]),
        positions=torch.zeros(2, 3),
        cell=torch.zeros(1, 3, 3),
        pbc=torch.zeros(1, 3, dtype=torch.bool),
        batch=torch.zeros(2, dtype=torch.long),
        ptr=torch.tensor([0, 2]),
    )
    AtomsBatch(**fields)
    if field == "both64":
        fields["positions64"], fields["cell64"] = bad
    else:
        fields[field] = bad
    with pytest.raises(ValueError, match=f"AtomsBatch: {message}"):
        AtomsBatch(**fields)


def test_a_bad_device_is_a_value_error(model, monkeypatch):
    """Unknown, unsupported or unavailable devices are a ValueError that says what to use, from every entry point
    (engine, predict_forces, calculator, training config), not a torch error at the first tensor."""
    from mlff_distiller import StudentCalculator
    from mlff_distiller.devices import default_device, resolve_device
    from mlff_distiller.distill import TrainConfig

    assert resolve_device(None) == resolve_device("auto") == default_device()
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="unknown device 'gpu0'"):
        resolve_device("gpu0")
    with pytest.raises(ValueError, match="runs on 'cpu' or 'cuda'"):
        ForceEngine(model, device="meta")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for make in (
        lambda: ForceEngine(model, device="cuda"),
        lambda: predict_forces(model, [molecule("H2O")], device="cuda:0"),
        lambda: StudentCalculator(model, device="cuda"),
        lambda: TrainConfig(device="cuda").resolved_device(),
    ):
        with pytest.raises(ValueError, match="CUDA is not available"):
            make()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"'cuda:3' requested but only 1 CUDA device\(s\)"):
        resolve_device("cuda:3")


def test_bad_arguments(model):
    with pytest.raises(ValueError, match="unknown precision"):
        predict_forces(model, [molecule("H2O")], precision="fp8")
    with pytest.raises(ValueError, match="batch_size"):
        predict_forces(model, [molecule("H2O")], batch_size=0)
    with pytest.raises(ValueError, match=r"not an ase\.Atoms"):
        predict_forces(model, [np.zeros((3, 3))])


def test_batched_validation_names_the_first_bad_structure():
    """from_atoms checks the whole batch at once, yet reports the first structure that fails any check with the
    message a one-by-one check gives it."""
    good = molecule("H2O")
    nan_pos = molecule("CH4")
    nan_pos.positions[2, 0] = np.nan
    bad_z = Atoms("H2", positions=[[0, 0, 0], [0.7, 0, 0]])
    bad_z.numbers[1] = 0
    flat = Atoms("Si2", positions=[[0, 0, 0], [1.3, 1.3, 1.3]], cell=[[5, 0, 0], [0, 5, 0], [5, 5, 0]], pbc=True)
    wire = Atoms("Si2", positions=[[0, 0, 0], [1.3, 1.3, 1.3]], cell=[[5, 0, 0], [0, 0, 0], [0, 0, 0]], pbc=[0, 1, 0])
    nan_cell = silicon_cell()
    nan_cell.cell[0, 0] = np.inf
    cases = [
        (nan_pos, r"structure 2: non-finite position for atom 2"),
        (bad_z, r"structure 2: atomic numbers must be in 1\.\.118, got \[0, 1\]"),
        (flat, r"structure 2: zero-volume cell"),
        (wire, r"structure 2: zero-volume cell"),  # its one periodic vector has zero length
        (nan_cell, r"structure 2: non-finite cell"),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError, match=message):
            AtomsBatch.from_atoms([good, silicon_cell(), bad, nan_pos, flat])
        # one structure alone (its own shorter path since stop 74): the same error, as structure 0
        with pytest.raises(ValueError, match=message.replace("structure 2", "structure 0")):
            AtomsBatch.from_atoms(bad)
    with pytest.raises(ValueError, match="structure 1 has no atoms"):
        AtomsBatch.from_atoms([good, Atoms(), nan_pos])
    big_z = Atoms("H2", positions=[[0, 0, 0], [0.7, 0, 0]])
    big_z.numbers[0] = 119
    with pytest.raises(ValueError, match=r"atomic numbers must be in 1\.\.118"):
        AtomsBatch.from_atoms(big_z)
    # accepted alone: a slab whose non-periodic vector is zero, a wire along a real vector, a full cell, element 118
    slab = Atoms("Si2", positions=[[0, 0, 0], [1.3, 1.3, 1.3]], cell=[[5, 0, 0], [0, 5, 0], [0, 0, 0]], pbc=[1, 1, 0])
    line = Atoms("Si2", positions=[[0, 0, 0], [1.3, 1.3, 1.3]], cell=[[0, 0, 0], [0, 6, 0], [0, 0, 0]], pbc=[0, 1, 0])
    og = Atoms("Og", positions=[[0, 0, 0]])
    for fine in (slab, line, silicon_cell(), og, good):
        assert AtomsBatch.from_atoms(fine).num_atoms == len(fine)


def test_from_atoms_reads_subclasses_through_their_getters_and_copies():
    """A subclass of Atoms is read through its (possibly overridden) getters; the batch owns its memory."""

    class Shifted(Atoms):
        def get_positions(self, wrap=False, **kw):
            return super().get_positions(wrap, **kw) + 1.0

    mol = molecule("H2O")
    shifted = Shifted(numbers=mol.numbers, positions=mol.positions)
    batch = AtomsBatch.from_atoms([mol, shifted])
    np.testing.assert_allclose(batch.positions[3:].numpy(), mol.positions + 1.0)
    mol.positions[0] = 99.0
    assert float(batch.positions[0, 0]) != 99.0


def test_atoms_batch_roundtrip():
    mols = [molecule("H2O"), silicon_cell(), molecule("CH4")]
    batch = AtomsBatch.from_atoms(mols)
    assert batch.ptr.tolist() == [0, 3, 5, 10] and batch.batch.tolist() == [0] * 3 + [1] * 2 + [2] * 5
    back = batch.to(dtype=torch.float32).to_atoms()
    for a, b in zip(mols, back, strict=True):
        assert (a.numbers == b.numbers).all() and (a.pbc == b.pbc).all()
        np.testing.assert_allclose(a.positions, b.positions, atol=1e-5)
        np.testing.assert_allclose(a.cell.array, b.cell.array, atol=1e-5)
    assert [t.shape[0] for t in batch.split(batch.positions)] == [3, 2, 5]


def test_predict_with_a_batch_size_skips_the_atom_budget(model, monkeypatch):
    """With batch_size given, predict sizes batches by it alone and never asks for the memory-based atom budget
    (a device query on CUDA)."""
    engine = ForceEngine(model, device="cpu")
    monkeypatch.setattr(engine, "atom_budget", lambda: pytest.fail("atom_budget asked for"))
    out = engine.predict([molecule("H2O"), molecule("CH4"), molecule("NH3")], batch_size=2)
    assert [len(r["forces"]) for r in out] == [3, 5, 4]


def _water_lattice(n_side: int, spacing: float = 3.1) -> Atoms:
    """n_side³ rattled water molecules on a cubic lattice, periodic (3 n_side³ atoms at about 1 g/cm³)."""
    h2o = molecule("H2O")
    grid = np.stack(np.meshgrid(*(np.arange(n_side),) * 3, indexing="ij"), -1).reshape(-1, 1, 3) * spacing
    pos = (grid + h2o.positions[None]).reshape(-1, 3)
    atoms = Atoms(np.tile(h2o.numbers, n_side**3), positions=pos, cell=[n_side * spacing] * 3, pbc=True)
    atoms.rattle(0.05, seed=3)
    return atoms


@pytest.mark.parametrize("mode", ["eager", "auto"])
def test_a_large_structure_energy_is_its_atomic_energies_summed_in_float64(device, mode):
    """A 1,536-atom water box in float32 with the shipped student (about -46 eV an atom: -7e4 eV in all): its
    energy is the float64 sum of its own atomic energies, returned in float64 (float32's spacing there is 0.0078
    eV; 0.125 eV at 24,000 atoms, 4 eV at 1M), eagerly and on the padded path (mode "auto"), through the engine,
    ``predict_forces`` and the calculator; and within 1e-6 relative of the float64 engine's. Summed in float32 it
    was off by 2.3 spacings here on a CPU (in order; 10 at 3,000 atoms), and on an H200's atomics by ~1e-5 relative
    at 24,000 atoms and 7e-4 at 200,001 (results/stop50_gpu/probe_energy_sum.md); until stop 53 the float64 sum
    was rounded once to float32 (within half a spacing)."""
    from mlff_distiller import StudentCalculator, load_model

    model = load_model("builtin:chno-gfn2")
    atoms = _water_lattice(8)
    engine = ForceEngine(model, device=device, precision="fp32", mode=mode, pad=mode == "auto")
    out = engine.compute(AtomsBatch.from_atoms([atoms], dtype=torch.float32), to_host=True)
    assert out["energy"].dtype == torch.float64 and out["atomic_energies"].dtype == torch.float32
    assert bool(engine._graphs) == (mode == "auto")  # the padded path ran where asked
    e32 = float(out["energy"][0])
    exact = float(out["atomic_energies"].double().sum())
    assert abs(e32 - exact) <= 1e-6, (e32, exact)  # float64 roundoff; float32 rounding: up to 0.0039 eV
    row = predict_forces(model, [atoms], precision="fp32", device=device)[0]
    assert abs(row["energy"] - float(np.sum(row["energies"], dtype=np.float64))) <= 1e-6
    calc = StudentCalculator(model, device=device, precision="fp32")
    e_calc = calc.get_potential_energy(atoms)
    assert abs(e_calc - float(np.sum(calc.results["energies"], dtype=np.float64))) <= 1e-6
    e64 = predict_forces(model, [atoms], precision="fp64", device=device)[0]["energy"]
    assert abs(e32 - e64) <= 1e-6 * abs(e64), (e32, e64)


def test_a_structure_far_from_the_origin_keeps_float32_accuracy(device):
    """float32 keeps ~7 digits of a coordinate: a benzene 10,000 Å from the origin had forces 0.05 eV/Å off its
    float64 ones (and 2.5e-3 at 1,000 Å) until batches stored each structure from its first atom
    (``AtomsBatch.origin``). Now the same 5e-6 as at the origin: through ``predict_forces``, through the calculator's
    first step and its MD steps (positions only), and for a periodic box whose atoms sit far outside its cell."""
    from mlff_distiller import StudentCalculator, load_model

    model = load_model("builtin:chno-gfn2")
    far = molecule("C6H6")
    far.rattle(0.05, seed=1)
    far.positions += 1e4
    water = _water_lattice(2)
    water.positions += 3e3  # unwrapped: 3,000 Å outside its 6.2 Å cell
    for atoms in (far, water):
        r32 = predict_forces(model, [atoms], precision="fp32", device=device)[0]
        r64 = predict_forces(model, [atoms], precision="fp64", device=device)[0]
        np.testing.assert_allclose(r32["forces"], r64["forces"], rtol=0, atol=1e-4)
        assert r32["energy"] == pytest.approx(r64["energy"], rel=1e-6)
    calc32 = StudentCalculator(model, device=device, precision="fp32")
    calc64 = StudentCalculator(model, device=device, precision="fp64")
    for step in range(3):  # the first call builds the batch, the next ones only replace its positions
        moved = far.copy()
        moved.positions[0] += 0.02 * step
        f32 = calc32.get_forces(moved)
        f64 = calc64.get_forces(moved)
        np.testing.assert_allclose(f32, f64, rtol=0, atol=1e-4, err_msg=f"step {step}")
