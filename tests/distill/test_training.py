"""Dataset, training forward, losses and the end-to-end label → train → evaluate run."""

import numpy as np
import pytest
import torch
from ase.build import molecule
from ase.calculators.singlepoint import SinglePointCalculator
from distill_helpers import small_train_config

from mlff_distiller import ForceEngine, StudentModel, load_model
from mlff_distiller.batch import AtomsBatch
from mlff_distiller.distill import (
    FrameDataset,
    TrainConfig,
    error_metrics,
    evaluate_dataset,
    fit_energy_reference,
    learning_curve_plot,
    md_step_timing,
    nve_drift,
    parity_plot,
    predict_frames,
    read_frames,
    split_frames,
    student_forward,
    train,
)
from mlff_distiller.distill.objective import _student_hvp

# The stated bar of the end-to-end test: held-out force MAE below 15 % of the mean |teacher force component|
# (EMT forces here average ~1 eV/Å) and at most a fifth of the untrained student's error.
E2E_RELATIVE_FORCE_MAE = 0.15


def _model(seed=0, **kw):
    torch.manual_seed(seed)
    cfg = dict(species=[1, 6, 7, 8], hidden=16, layers=2, n_rbf=8, cutoff=4.0)
    cfg.update(kw)
    return StudentModel(**cfg)


def test_dataset_batch_matches_atoms_batch_and_engine(emt_frames):
    model = _model().double()
    ds = FrameDataset(emt_frames, model.cutoff, dtype=torch.float64)
    idx = [3, 0, 17, 5]
    batch = ds.batch(idx)
    ref = AtomsBatch.from_atoms([emt_frames[k] for k in idx])
    torch.testing.assert_close(batch.atoms.positions, ref.positions)
    torch.testing.assert_close(batch.atoms.ptr, ref.ptr)
    energies = [emt_frames[k].get_potential_energy() for k in idx]
    torch.testing.assert_close(batch.energy, torch.tensor(energies, dtype=torch.float64))
    energy, forces = student_forward(model, batch, create_graph=False)
    out = ForceEngine(model, device="cpu", precision="fp64").compute(ref)
    torch.testing.assert_close(energy, out["energy"], atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(forces, out["forces"], atol=1e-10, rtol=1e-10)


def test_dataset_rejects_unlabelled_and_nonfinite():
    a = molecule("H2O")
    with pytest.raises(ValueError, match="no teacher energy"):
        FrameDataset([a], 4.0)
    a.calc = SinglePointCalculator(a, energy=float("nan"), forces=np.zeros((3, 3)))
    with pytest.raises(ValueError, match="non-finite"):
        FrameDataset([a], 4.0)
    with pytest.raises(ValueError, match="at least one"):
        FrameDataset([], 4.0)


def test_energy_reference_least_squares_recovers_species_energies():
    mu = {1: -13.6, 6: -1030.0, 7: -1480.0, 8: -2040.0}
    frames = []
    for name in ("H2O", "CH4", "NH3", "CO2", "HCN", "CH3OH", "N2O"):
        a = molecule(name)
        e = sum(mu[int(z)] for z in a.numbers)
        a.calc = SinglePointCalculator(a, energy=e, forces=np.zeros((len(a), 3)))
        frames.append(a)
    ds = FrameDataset(frames, 4.0)
    np.testing.assert_allclose(fit_energy_reference(ds, [1, 6, 7, 8]), [mu[z] for z in (1, 6, 7, 8)], rtol=1e-6)


def test_split_keeps_trajectories_together(emt_frames):
    train_f, val_f = split_frames(emt_frames, 0.25, seed=1)
    assert len(train_f) + len(val_f) == len(emt_frames) and val_f
    assert not {a.info["task"] for a in train_f} & {a.info["task"] for a in val_f}
    with pytest.raises(ValueError, match="val_fraction"):
        split_frames(emt_frames, 1.5)


def test_student_hvp_matches_autograd_hessian(emt_frames):
    model = _model(seed=2).double()
    ds = FrameDataset(emt_frames[:3], model.cutoff, dtype=torch.float64)
    batch = ds.batch([0, 1, 2])
    rng = torch.Generator().manual_seed(0)
    v = torch.randn(batch.atoms.positions.shape, generator=rng, dtype=torch.float64)
    batch.hvp_dir = v / v.norm()
    # Central differences converge as ε² (measured: 1e-3 → 5e-4, 1e-5 → 5e-8 here).
    fd = _student_hvp(model, batch, 1e-5)

    def total_energy(pos):
        sv = batch.shift_vectors()
        a = batch.atoms
        return model(a.numbers, pos, batch.edge_index, sv, a.batch, a.num_structures)["energy"].sum()

    _, exact = torch.autograd.functional.hvp(total_energy, batch.atoms.positions, batch.hvp_dir)
    torch.testing.assert_close(fd, exact, atol=1e-6, rtol=1e-5)
    assert exact.abs().max() > 1e-2  # a non-trivial Hessian


def test_train_config_validation():
    with pytest.raises(ValueError, match="lr"):
        TrainConfig(lr=0)
    with pytest.raises(ValueError, match="scheduler"):
        TrainConfig(scheduler="step")
    with pytest.raises(ValueError, match="at least one"):
        TrainConfig(energy_weight=0, force_weight=0)
    with pytest.raises(ValueError, match="ema_decay"):
        TrainConfig(ema_decay=1.0)


def test_hvp_loss_needs_hvp_labels(emt_frames):
    train_f, val_f = split_frames(emt_frames, 0.2)
    with pytest.raises(ValueError, match="Hessian-vector"):
        train(train_f, val_f, small_train_config(hvp_weight=1.0, max_steps=2), log=lambda m: None)


def test_training_with_hvp_loss_runs(tmp_path):
    from distill_helpers import emt_seeds, small_sampling

    from mlff_distiller.distill import label

    label(emt_seeds()[:1], "emt", tmp_path / "h", small_sampling(md_steps=16, hvp=True), progress=False)
    frames = read_frames(tmp_path / "h")
    res = train(frames, frames, small_train_config(hvp_weight=0.1, max_steps=6, eval_every=3), log=lambda m: None)
    assert "train_hvp_mse" in res.history[-1] and np.isfinite(res.history[-1]["train_hvp_mse"])


def test_resume_continues_exactly(emt_frames, tmp_path):
    train_f, val_f = split_frames(emt_frames, 0.2)
    cfg = small_train_config(scheduler="none", max_steps=30)
    full = train(train_f, val_f, cfg, tmp_path / "full", log=lambda m: None)
    part = train(
        train_f, val_f, small_train_config(scheduler="none", max_steps=20), tmp_path / "part", log=lambda m: None
    )
    assert part.steps == 20
    resumed = train(train_f, val_f, cfg, tmp_path / "part", resume=True, log=lambda m: None)
    assert resumed.steps == 30
    a = load_model(tmp_path / "full" / "last.pt").state_dict()
    b = load_model(tmp_path / "part" / "last.pt").state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="no training state"):
        train(train_f, val_f, cfg, tmp_path / "nothing", resume=True, log=lambda m: None)
    assert full.history[-1]["step"] == 30


def test_the_last_step_is_validated_and_saved(emt_frames, tmp_path):
    """A run shorter than eval_every (max_steps, or its epochs) still validates and checkpoints its last step."""
    train_f, val_f = split_frames(emt_frames, 0.2)
    res = train(train_f, val_f, small_train_config(max_steps=3, eval_every=100), tmp_path / "a", log=lambda m: None)
    assert res.stopped == "max_steps" and [row["step"] for row in res.history] == [3]
    assert np.isfinite(res.best_val["force_mae_mev_a"]) and res.best_val["step"] == 3
    assert (tmp_path / "a" / "best.pt").exists() and (tmp_path / "a" / "last.pt").exists()
    per_epoch = -(-len(train_f) // 8)  # batch_size 8
    res = train(train_f, val_f, small_train_config(epochs=1, eval_every=1000), tmp_path / "b", log=lambda m: None)
    assert res.stopped == "epochs" and [row["step"] for row in res.history] == [per_epoch]
    assert (tmp_path / "b" / "best.pt").exists()
    # Early stopping does not claim a run that ended by its step budget.
    res = train(train_f, val_f, small_train_config(lr=1e-9, max_steps=4, eval_every=2, patience=1, min_delta=1.0))
    assert res.stopped == "max_steps" and res.steps == 4


def test_early_stopping(emt_frames):
    train_f, val_f = split_frames(emt_frames, 0.2)
    res = train(
        train_f,
        val_f,
        small_train_config(lr=1e-9, patience=2, min_delta=1.0, eval_every=2, epochs=50),
        log=lambda m: None,
    )
    assert res.stopped == "early_stopping" and res.steps == 6


def test_label_train_evaluate_end_to_end(emt_frames, emt_test_labels, tmp_path):
    test = read_frames(emt_test_labels)
    train_f, val_f = split_frames(emt_frames, 0.2, seed=0)
    cfg = small_train_config(
        model=dict(hidden=32, layers=2, n_rbf=12, cutoff=4.0),
        lr=5e-3,
        warmup_steps=20,
        max_steps=300,
        epochs=1000,
        eval_every=50,
        ema_decay=0.99,
        force_weight=10.0,
    )
    untrained = StudentModel(cfg.model)
    before = error_metrics(test, predict_frames(untrained, test, device="cpu"))
    res = train(train_f, val_f, cfg, tmp_path / "run", metadata={"teacher": "emt"}, log=lambda m: None)
    assert res.stopped == "max_steps" and res.history
    model = load_model(tmp_path / "run" / "best.pt")
    assert model.metadata["teacher"] == "emt" and "val" in model.metadata
    after = error_metrics(test, predict_frames(model, test, device="cpu"))
    scale = float(np.mean([np.abs(a.get_forces()).mean() for a in test]))
    assert after["force_mae_mev_a"] < E2E_RELATIVE_FORCE_MAE * 1000 * scale, (after, scale)
    assert after["force_mae_mev_a"] < before["force_mae_mev_a"] / 5
    # The training-path metric equals the inference-path metric on the same frames.
    ds = FrameDataset(test, model.cutoff, dtype=torch.float64)
    same = evaluate_dataset(model.double(), ds)
    assert abs(same["force_mae_mev_a"] - after["force_mae_mev_a"]) < 1e-3 * after["force_mae_mev_a"] + 1e-3
    assert parity_plot(after, tmp_path / "parity.png").stat().st_size > 1000
    assert learning_curve_plot(res.history, tmp_path / "curve.png").stat().st_size > 1000
    from ase.calculators.emt import EMT

    from mlff_distiller import StudentCalculator

    timing = md_step_timing(test[0], StudentCalculator(model, device="cpu"), EMT(), steps=3, warmup=1)
    assert timing["student_s_per_step"] > 0 and timing["teacher_s_per_step"] > 0
    for who in ("student", "teacher"):  # medians of per-step times, with the mean and the worst step beside them
        assert 0 < timing[f"{who}_s_per_step"] <= timing[f"{who}_max_s_per_step"]
        assert timing[f"{who}_mean_s_per_step"] <= timing[f"{who}_max_s_per_step"]
    drift = nve_drift(test[0], model, steps=40, device="cpu")
    assert np.isfinite(drift["drift_mev_atom_per_ps"]) and drift["max_abs_dev_mev_atom"] < 50


def test_error_metrics_values_and_errors():
    a = molecule("H2O")
    a.calc = SinglePointCalculator(a, energy=-3.0, forces=np.zeros((3, 3)))
    pred = [{"energy": -2.97, "forces": np.full((3, 3), 0.01)}]
    m = error_metrics([a], pred)
    assert m["energy_mae_mev_atom"] == pytest.approx(10.0)
    assert m["force_mae_mev_a"] == pytest.approx(10.0)
    with pytest.raises(ValueError, match="predictions"):
        error_metrics([a], [])
    with pytest.raises(ValueError, match="non-finite"):
        error_metrics([a], [{"energy": float("nan"), "forces": np.zeros((3, 3))}])


def test_residual_loss_is_mse_below_delta_and_linear_beyond():
    """The Huber term of ``loss: huber``: the square up to delta, 2 delta |r| - delta^2 beyond; value and slope
    continuous at |r| = delta; and a bad setting is an error naming it."""
    from mlff_distiller.distill.objective import residual_loss

    r = torch.tensor([-3.0, -0.5, -0.2, 0.0, 0.1, 0.5, 2.0], dtype=torch.float64, requires_grad=True)
    huber = TrainConfig(loss="huber", huber_delta=0.5)
    out = residual_loss(r, huber)
    expect = torch.tensor([2.75, 0.25, 0.04, 0.0, 0.01, 0.25, 1.75], dtype=torch.float64)
    torch.testing.assert_close(out, expect)
    (grad,) = torch.autograd.grad(out.sum(), r)
    torch.testing.assert_close(grad, torch.tensor([-1.0, -1.0, -0.4, 0.0, 0.2, 1.0, 1.0], dtype=torch.float64))
    torch.testing.assert_close(residual_loss(r, TrainConfig()), r.square())
    for bad, says in ((dict(loss="l1"), "loss must be 'mse' or 'huber'"), (dict(huber_delta=0.0), "huber_delta")):
        with pytest.raises(ValueError, match=says):
            TrainConfig(**bad)


def test_the_trained_student_lands_on_the_tf32_grid(emt_frames, tmp_path):
    """``tf32_grid`` (the default): the returned student and ``best.pt`` have every Linear weight on the TF32 grid
    (two TF32 MMAs per weight product on a GPU), validated again, the numbers in the result and the metadata, close
    to the weights as trained; ``last.pt`` (the state to resume from) keeps them as trained; off, nothing moves."""
    train_f, val_f = split_frames(emt_frames, 0.2)
    res = train(train_f, val_f, small_train_config(max_steps=6, eval_every=3), tmp_path / "a", log=lambda m: None)
    best = load_model(tmp_path / "a" / "best.pt")
    assert res.model.on_tf32_grid() and best.on_tf32_grid()
    assert not load_model(tmp_path / "a" / "last.pt").on_tf32_grid()
    grid = res.val_tf32_grid
    assert grid == best.metadata["val_tf32_grid"] and best.metadata["tf32_grid"] is True
    assert "val" in best.metadata and "domain" in best.metadata  # the checkpoint's own metadata kept
    as_trained = res.best_val["force_mae_mev_a"]
    assert grid["force_mae_mev_a"] != as_trained
    assert abs(grid["force_mae_mev_a"] - as_trained) < 0.01 * as_trained
    for k, v in best.state_dict().items():
        torch.testing.assert_close(v, res.model.state_dict()[k].cpu(), rtol=0, atol=0)
    off = train(
        train_f,
        val_f,
        small_train_config(max_steps=6, eval_every=3, tf32_grid=False),
        tmp_path / "b",
        log=lambda m: None,
    )
    assert off.val_tf32_grid is None and not off.model.on_tf32_grid()
    assert not load_model(tmp_path / "b" / "best.pt").on_tf32_grid()
