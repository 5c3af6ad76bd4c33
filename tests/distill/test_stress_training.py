"""Training on the teacher's stress (``stress_weight``): the student's stress in training, the loss term, config."""

import numpy as np
import pytest
import torch
from ase.build import bulk, molecule
from ase.calculators.emt import EMT
from ase.calculators.singlepoint import SinglePointCalculator

from mlff_distiller import AtomsBatch, ForceEngine, StudentModel
from mlff_distiller.distill import FrameDataset, TrainConfig, evaluate_dataset, train
from mlff_distiller.distill.objective import student_forward, student_forward_stress


def _frames(n=12, seed=0):
    rng = np.random.default_rng(seed)
    frames = []
    for k in range(n):
        a = bulk("Cu", "fcc", a=3.6 * (0.96 + 0.08 * rng.random()), cubic=True)
        a.rattle(0.05, seed=k)
        a.calc = EMT()
        out = a.copy()
        out.calc = SinglePointCalculator(
            out, energy=a.get_potential_energy(), forces=a.get_forces(), stress=a.get_stress()
        )
        frames.append(out)
    m = molecule("CH4")
    m.calc = EMT()
    out = m.copy()
    out.calc = SinglePointCalculator(out, energy=m.get_potential_energy(), forces=m.get_forces())
    frames.append(out)  # a molecule in the same dataset: no stress label
    return frames


def _model(seed=0):
    torch.manual_seed(seed)
    return StudentModel(species=[1, 6, 29], hidden=16, layers=1, cutoff=4.0).double()


def test_student_stress_in_training_equals_the_engine():
    model, frames = _model(), _frames(4)
    data = FrameDataset(frames, model.cutoff, dtype=torch.float64)
    assert data.has_stress and data.stress_mask.tolist() == [True] * 4 + [False]
    batch = data.batch(range(len(data)))
    energy, forces, stress = student_forward_stress(model, batch, create_graph=False)
    e2, f2 = student_forward(model, batch, create_graph=False)
    torch.testing.assert_close(energy, e2)
    torch.testing.assert_close(forces, f2)
    ref = ForceEngine(model, device="cpu", precision="fp64").compute(AtomsBatch.from_atoms(frames), stress=True)
    torch.testing.assert_close(stress[:4], ref["stress"][:4], rtol=1e-9, atol=1e-12)
    assert stress[:4].abs().max() > 1e-4


def test_stress_weight_fits_the_stress():
    """The same start, data and steps: with stress_weight the training-set stress error falls well below the run
    without it (whose stress is only what energies and forces imply)."""
    frames = _frames()
    results = {}
    for w in (0.0, 10.0):
        cfg = TrainConfig(
            model={"hidden": 16, "layers": 1, "n_rbf": 8, "cutoff": 4.0},
            batch_size=4,
            lr=5e-3,
            max_steps=150,
            warmup_steps=5,
            eval_every=150,
            patience=0,
            ema_decay=0.0,
            energy_weight=1.0,
            force_weight=1.0,
            stress_weight=w,
            device="cpu",
            dtype="float64",
            seed=3,
        )
        res = train(frames, frames[:6], cfg, None)
        data = FrameDataset(frames, 4.0, dtype=torch.float64)
        results[w] = evaluate_dataset(res.model.double(), data)["stress_mae_mev_a3"]
    assert results[10.0] < 0.5 * results[0.0], results


def test_stress_weight_needs_labels():
    frames = [f for f in _frames(3) if not f.pbc.all()] * 4  # molecules only: no stress labels
    for step in ("plain", "static"):
        cfg = TrainConfig(
            model={"hidden": 8, "layers": 1, "n_rbf": 4, "cutoff": 4.0},
            max_steps=2,
            stress_weight=1.0,
            device="cpu",
            batch_size=2,
            train_step=step,
        )
        with pytest.raises(ValueError, match="labelled with a teacher stress"):
            train(frames, frames[:2], cfg, None)
    assert TrainConfig(stress_weight=1.0, train_step="auto").resolved_train_step(torch.device("cpu")) == "plain"
    with pytest.raises(ValueError, match="stress_weight must be >= 0"):
        TrainConfig(stress_weight=-1.0)


def _stress_cfg(step, **kw):
    opts = dict(
        model={"hidden": 16, "layers": 2, "n_rbf": 8, "cutoff": 4.0},
        batch_size=4,
        lr=3e-3,
        max_steps=10,
        warmup_steps=3,
        eval_every=5,
        patience=0,
        ema_decay=0.9,
        grad_clip=1.0,
        energy_weight=1.0,
        force_weight=1.0,
        stress_weight=10.0,
        device="cpu",
        dtype="float64",
        seed=3,
        train_step=step,
    )
    opts.update(kw)
    return TrainConfig(**opts)


def _assert_same_run(a, b, atol):
    sa, sb = a.model.state_dict(), b.model.state_dict()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], atol=atol, rtol=atol, msg=lambda m, k=k: f"{k}: {m}")
    for ha, hb in zip(a.history, b.history, strict=True):
        for key in ("train_loss", "train_stress_mse", "val_stress_mae_mev_a3", "val_force_mae_mev_a"):
            assert ha[key] == pytest.approx(hb[key], rel=1e-8, abs=1e-12), key


def test_static_step_with_stress_equals_plain():
    """The padded static step fits the stress with the same math as the plain step (cells of several sizes and a
    molecule without a stress label in the batches): the same weights and loss parts after the same steps."""
    frames = _frames()
    quiet = dict(log=lambda m: None)
    plain = train(frames, frames[:6], _stress_cfg("plain"), **quiet)
    static = train(frames, frames[:6], _stress_cfg("static"), **quiet)
    assert (plain.train_step, static.train_step) == ("plain", "static")
    assert static.history[-1]["train_stress_mse"] > 0
    _assert_same_run(plain, static, atol=1e-10)


@pytest.mark.gpu
def test_cudagraph_step_with_stress_equals_plain():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    frames = _frames()
    logs = []
    graph = train(frames, frames[:6], _stress_cfg("cudagraph", device="cuda", max_steps=12), log=logs.append)
    plain = train(frames, frames[:6], _stress_cfg("plain", device="cuda", max_steps=12), log=lambda m: None)
    assert graph.train_step == "cudagraph" and graph.captures >= 1, logs
    assert not any("failed" in m for m in logs), logs
    _assert_same_run(graph, plain, atol=1e-8)


def test_rattle_strain_labels_strained_cells_and_old_runs_still_resume(tmp_path):
    import json

    from mlff_distiller.distill import SamplingConfig, label, read_frames

    cell = bulk("Cu", "fcc", a=3.6, cubic=True)
    seeds = [cell, molecule("CH4")]
    plain = SamplingConfig(temperatures=[300], md_steps=4, sample_every=4, rattle_per_seed=4, dedup_rms=0.0)
    label(seeds, "emt", tmp_path / "plain", plain, progress=False)
    recorded = json.loads((tmp_path / "plain" / "label_config.json").read_text())["sampling"]
    assert "rattle_strain" not in recorded  # the default is left out: directories from before the option resume
    again = label(seeds, "emt", tmp_path / "plain", plain, progress=False)
    assert again.written == 0 and again.tasks_skipped > 0

    strained = SamplingConfig(**{**plain.__dict__, "rattle_strain": 0.02})
    label(seeds, "emt", tmp_path / "strained", strained, progress=False)
    frames = read_frames(tmp_path / "strained")
    rattled_cells = [a for a in frames if a.info["kind"] == "rattle" and a.pbc.all()]
    volumes = np.array([a.get_volume() for a in rattled_cells])
    assert len(rattled_cells) == 4 and np.abs(volumes / cell.get_volume() - 1).max() > 1e-3
    assert all("stress" in a.calc.results for a in rattled_cells)
    rattled_molecules = [a for a in frames if a.info["kind"] == "rattle" and not a.pbc.any()]
    assert rattled_molecules and all(np.allclose(a.cell.array, 0) for a in rattled_molecules)
    with pytest.raises(ValueError, match="sampling"):  # another strain is another run
        label(seeds, "emt", tmp_path / "strained", SamplingConfig(**{**plain.__dict__, "rattle_strain": 0.03}))
    with pytest.raises(ValueError, match="rattle_strain"):
        SamplingConfig(rattle_strain=-0.1)
