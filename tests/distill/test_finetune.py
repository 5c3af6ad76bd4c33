"""Fine-tuning: training that starts from an existing student (``train(model=...)``, the CLI's ``--init-model``)."""

import json

import numpy as np
import pytest
import torch
from ase import Atoms
from ase.build import molecule
from ase.calculators.emt import EMT
from ase.calculators.singlepoint import SinglePointCalculator
from distill_helpers import small_train_config

from mlff_distiller import load_model
from mlff_distiller.cli import main
from mlff_distiller.distill import FrameDataset, split_frames
from mlff_distiller.distill.objective import energy_reference_correction, evaluate_dataset
from mlff_distiller.distill.training import TrainConfig, train

# An energy zero of another teacher: eV per atom of each element (H, C, N, O).
OFFSET = {1: -13.6, 6: -1029.0, 7: -1485.0, 8: -2041.0}


def _cfg(**kw):
    """The distillation tests' small student, in float64, without EMA (so a step's weights are the result)."""
    return small_train_config(**{"warmup_steps": 2, "eval_every": 5, "ema_decay": 0.0, "dtype": "float64", **kw})


def _quiet(msg):
    pass


def _shifted(frames):
    """The frames relabelled by a teacher whose energies differ by a per-element constant (forces unchanged)."""
    out = []
    for a in frames:
        b = a.copy()
        energy = a.get_potential_energy() + sum(OFFSET[int(z)] for z in a.numbers)
        b.calc = SinglePointCalculator(b, energy=energy, forces=a.get_forces())
        b.info.update(a.info)
        out.append(b)
    return out


@pytest.fixture(scope="module")
def base(emt_frames):
    """A small student trained briefly on the EMT frames, and the split it was trained on."""
    train_f, val_f = split_frames(emt_frames, 0.2)
    return train(train_f, val_f, _cfg(max_steps=15), log=_quiet).model, train_f, val_f


def test_finetuning_starts_from_the_students_weights_and_architecture(base):
    model, train_f, val_f = base
    before = {k: v.clone() for k, v in model.state_dict().items()}
    # The config asks for another architecture: a starting student's own replaces it. A learning rate of 1e-12
    # leaves the weights where they start, so the result must be the starting student.
    cfg = _cfg(model=dict(hidden=32, layers=3, n_rbf=8, cutoff=4.0), lr=1e-12, max_steps=2)
    lines = []
    res = train(train_f, val_f, cfg, model=model, log=lines.append)
    assert (res.model.config.hidden, res.model.config.layers) == (16, 2)
    assert any("fine-tuning a student of 16 features x 2 layers" in line for line in lines)
    for k, v in res.model.state_dict().items():
        torch.testing.assert_close(v, before[k], atol=1e-9, rtol=0, msg=k)
    for k, v in model.state_dict().items():  # the caller's student is not modified
        assert torch.equal(v, before[k]), k


def test_finetuning_improves_on_the_starting_student(base, emt_test_labels):
    from mlff_distiller.distill import read_frames

    model, train_f, val_f = base
    test = FrameDataset(read_frames(emt_test_labels), cutoff=model.cutoff, dtype=torch.float64)
    start = evaluate_dataset(model, test)["force_mae_mev_a"]
    tuned = train(train_f, val_f, _cfg(max_steps=40, lr=2e-3), model=model, log=_quiet).model
    assert evaluate_dataset(tuned, test)["force_mae_mev_a"] < start


def test_energy_reference_correction_recovers_a_per_element_offset(base):
    model, train_f, _ = base
    plain = FrameDataset(train_f, cutoff=model.cutoff, dtype=torch.float64)
    moved = FrameDataset(_shifted(train_f), cutoff=model.cutoff, dtype=torch.float64)
    species = plain.species()  # H, C, N, O all occur
    d0 = energy_reference_correction(model, plain)
    d1 = energy_reference_correction(model, moved)
    # The correction is linear in the labels, so the offsets' energies come back exactly. (Not the offsets
    # themselves: H2O, CH4 and NH3 are 3 compositions of 4 elements, so the per-element split is not determined.)
    want = torch.tensor([OFFSET.get(z, 0.0) for z in model.species_list], dtype=torch.float64)
    assert set(species) <= set(OFFSET)
    comp = torch.as_tensor(plain.composition(model.species_list))
    torch.testing.assert_close(comp @ (d1 - d0), comp @ want, atol=1e-6, rtol=0)
    # And it is the least-squares fit: the residual left is orthogonal to every species count.
    shifted = model.atomic_shift.double() + d1
    m = type(model)(model.config).double()
    m.load_state_dict(model.state_dict())
    m.set_energy_reference(shifted, model.atomic_scale)
    comp = torch.as_tensor(moved.composition(m.species_list))
    energies = []
    for batch in moved.batches(64):
        a = batch.atoms
        energies.append(
            m(a.numbers, a.positions, batch.edge_index, batch.shift_vectors(), a.batch, a.num_structures)["energy"]
        )
    residual = moved.energy - torch.cat(energies).detach()
    assert comp.T.matmul(residual).abs().max() < 1e-6 * comp.sum()


def test_refit_energy_reference_when_the_teacher_moves_its_energy_zero(base):
    model, train_f, val_f = base
    new_train, new_val = _shifted(train_f), _shifted(val_f)
    cfg = _cfg(lr=1e-12, max_steps=2)
    kept = train(new_train, new_val, cfg, model=model, log=_quiet)
    lines = []
    refit = train(
        new_train, new_val, _cfg(lr=1e-12, max_steps=2, refit_energy_reference=True), model=model, log=lines.append
    )
    assert any("energy reference refitted" in line for line in lines)
    # Keeping the reference leaves the whole offset in the energy error (eV per atom: ~1,000 eV for a C atom);
    # the refit takes it out, back to the starting student's error on the unshifted frames.
    assert kept.best_val["energy_mae_mev_atom"] > 1e5
    start = evaluate_dataset(model, FrameDataset(val_f, cutoff=model.cutoff, dtype=torch.float64))
    assert refit.best_val["energy_mae_mev_atom"] < 2 * start["energy_mae_mev_atom"] + 5.0
    # Forces do not depend on the shift.
    assert refit.best_val["force_mae_mev_a"] == pytest.approx(kept.best_val["force_mae_mev_a"], rel=1e-9)
    torch.testing.assert_close(refit.model.atomic_scale, model.atomic_scale)
    # Without a starting student the switch changes nothing: a new student's reference is always fitted.
    a = train(new_train, new_val, _cfg(max_steps=2), log=_quiet).model
    b = train(new_train, new_val, _cfg(max_steps=2, refit_energy_reference=True), log=_quiet).model
    torch.testing.assert_close(a.atomic_shift, b.atomic_shift)


def test_finetuning_on_an_unknown_element_is_a_clear_error(base):
    model, train_f, val_f = base
    cu = Atoms("Cu2", positions=[(0, 0, 0), (0, 0, 2.3)])
    cu.calc = EMT()
    cu.get_forces()
    cu.calc = SinglePointCalculator(cu, energy=cu.get_potential_energy(), forces=cu.get_forces())
    with pytest.raises(ValueError, match=r"cannot be fine-tuned on these frames: unknown element\(s\) \['Cu'\]"):
        train([*train_f, cu], val_f, _cfg(max_steps=1), model=model, log=_quiet)


def test_refit_energy_reference_must_be_a_bool():
    with pytest.raises(ValueError, match="refit_energy_reference"):
        TrainConfig(refit_energy_reference="yes")


def test_cli_train_init_model(base, emt_labels, tmp_path, capsys):
    model, _, _ = base
    start = tmp_path / "start.pt"
    model.save(start)
    run = tmp_path / "run"
    args = ["train", "--data", str(emt_labels), "--out", str(run), "--init-model", str(start)]
    for s in ("train.max_steps=3", "train.model.hidden=8", "train.device=cpu", "train.refit_energy_reference=true"):
        args += ["--set", s]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == 3
    tuned = load_model(run / "best.pt")
    assert tuned.config.hidden == 16  # the starting student's width, not train.model.hidden
    meta = tuned.metadata
    assert meta["init_model"] == str(start) and meta["train_config"]["refit_energy_reference"] is True
    assert main(["train", "--data", str(emt_labels), "--out", str(tmp_path / "r2"), "--init-model", "nope.pt"]) == 2
    assert "nope.pt" in capsys.readouterr().err


def test_finetuning_the_shipped_student():
    """The user's path: the builtin student, a few frames of their own molecule, two optimiser steps."""
    model = load_model("builtin:chno-gfn2-small")
    frames = []
    rng = np.random.default_rng(0)
    for k in range(6):
        a = molecule("CH3OH")
        a.positions += rng.normal(0, 0.05, a.positions.shape)
        a.calc = EMT()
        a.calc = SinglePointCalculator(a, energy=a.get_potential_energy(), forces=a.get_forces())
        a.info["task"] = k
        frames.append(a)
    res = train(
        frames[:4], frames[4:], _cfg(max_steps=2, dtype="float32", refit_energy_reference=True), model=model, log=_quiet
    )
    assert res.steps == 2 and res.model.config.hidden == model.config.hidden
    assert np.isfinite(res.best_val["force_mae_mev_a"])
