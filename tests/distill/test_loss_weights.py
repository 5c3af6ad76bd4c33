"""Per-frame loss weights: a frame's ``info["config_weight"]`` and ``mlff-distill train --data-weight`` (one per
``--data`` source), in the plain and the padded static step (the CUDA-graph step runs the static step's body)."""

import json
import math

import ase.io
import numpy as np
import pytest
import torch
from ase.calculators.singlepoint import SinglePointCalculator
from distill_helpers import small_train_config
from test_stress_training import _frames as _stress_frames

from mlff_distiller import load_model
from mlff_distiller.cli import main
from mlff_distiller.cli_distill import _read_labelled
from mlff_distiller.distill import FrameDataset, read_frames, train
from mlff_distiller.distill.objective import (
    _loss,
    _weighted_mean,
    residual_loss,
    student_forward,
    student_forward_stress,
)
from mlff_distiller.distill.train_steps import _StaticStep
from mlff_distiller.distill.training import _initial_model

KINDS = ("plain", "static")


def _cfg(**kw):
    return small_train_config(**{"dtype": "float64", "ema_decay": 0.0, **kw})


def _weighted(frames, weights):
    """Copies of ``frames`` (same labels) with ``info["config_weight"]`` set where ``weights`` is not None."""
    out = []
    for a, w in zip(frames, weights, strict=True):
        b = a.copy()
        b.calc = SinglePointCalculator(b, **a.calc.results)
        if w is not None:
            b.info["config_weight"] = w
        out.append(b)
    return out


def _relabelled(frames, k, seed=0):
    """``frames`` with frame ``k``'s energy, forces (and stress) replaced by other numbers."""
    rng = np.random.default_rng(seed)
    out = _weighted(frames, [a.info.get("config_weight") for a in frames])
    r = dict(out[k].calc.results)
    r["energy"] = r["energy"] + 3.0
    r["forces"] = r["forces"] + rng.normal(size=r["forces"].shape)
    if "stress" in r:
        r["stress"] = np.asarray(r["stress"]) + 0.01 * rng.normal(size=np.shape(r["stress"]))
    out[k].calc = SinglePointCalculator(out[k], **r)
    return out


@pytest.fixture(params=["molecules", "stress"])
def setting(request, emt_frames):
    """(frames, config overrides): EMT molecules with energies and forces, or Cu cells trained on their stress and
    a molecule without a stress label."""
    if request.param == "molecules":
        return emt_frames[:6], {}
    return _stress_frames(5), {"stress_weight": 1.0}


def _student(frames, cfg):
    """A fresh float64 student for ``frames`` (the one every loss of a test is taken of)."""
    return _initial_model(cfg, FrameDataset(frames, cfg.model.cutoff, dtype=torch.float64)).double()


def _loss_and_grad(model, frames, idx, kind, cfg):
    """The training loss of the frames ``idx`` of a dataset of ``frames``, its parts and the parameters' gradient,
    by the plain or the static step's loss."""
    data = FrameDataset(frames, cfg.model.cutoff, dtype=torch.float64)
    if kind == "plain":
        loss, parts = _loss(model, data.batch(idx), cfg)
        parts = list(parts.values())
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        step = _StaticStep(model, data, cfg, opt, None, "static", lambda m: None)
        bucket, row = step.batcher.plan(idx)
        cap = step._capacity(bucket)
        step._upload(cap, row)
        with torch.enable_grad():
            loss, parts = step._batch_loss(cap)
        parts = [float(p.detach()) for p in parts]
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    grads = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)]
    return loss.detach(), parts, grads


def _assert_same(a, b, exact=False):
    (la, pa, ga), (lb, pb, gb) = a, b
    if exact:
        assert torch.equal(la, lb) and pa == pb
        assert all(torch.equal(x, y) for x, y in zip(ga, gb, strict=True))
        return
    torch.testing.assert_close(la, lb, atol=1e-12, rtol=1e-11)
    assert pa == pytest.approx(pb, rel=1e-11, abs=1e-14)
    for x, y in zip(ga, gb, strict=True):
        torch.testing.assert_close(x, y, atol=1e-12, rtol=1e-10)


# ------------------------------------------------------------------------------------------------ the loss
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(1,), (2,), (97,), (1, 3), (13, 3), (1000, 3), (7, 6)])
def test_weighted_mean_with_unit_weights_is_the_mean_bit_for_bit(shape, dtype):
    v = torch.randn(shape, generator=torch.Generator().manual_seed(shape[0]), dtype=dtype).square()
    assert torch.equal(_weighted_mean(v, torch.ones(shape[0], dtype=dtype)), v.mean())
    w = torch.rand(shape[0], generator=torch.Generator().manual_seed(1), dtype=dtype)
    expect = (v * (w if v.dim() == 1 else w[:, None])).sum() / (w.sum() * (v.numel() // shape[0]))
    torch.testing.assert_close(_weighted_mean(v, w), expect)
    assert _weighted_mean(v, torch.zeros_like(w)).item() == 0.0  # every weight 0: 0, not nan


@pytest.mark.parametrize("loss", ["mse", "huber"])
def test_unit_weights_give_the_unweighted_loss_exactly(setting, loss):
    """config_weight 1.0 on every frame (or none at all) gives the loss of plain means, bit for bit: recomputed
    here as it was before weights, ``.mean()`` of the energy and force terms, the stress term over labelled frames."""
    frames, kw = setting
    cfg = _cfg(loss=loss, huber_delta=0.05, **kw)
    idx = [4, 0, 5, 2, 1]
    model = _student(frames, cfg)
    ones = _loss_and_grad(model, _weighted(frames, [1.0] * len(frames)), idx, "plain", cfg)
    _assert_same(ones, _loss_and_grad(model, frames, idx, "plain", cfg), exact=True)

    batch = FrameDataset(frames, cfg.model.cutoff, dtype=torch.float64).batch(idx)
    if cfg.stress_weight > 0:
        energy, forces, stress = student_forward_stress(model, batch, create_graph=True)
    else:
        energy, forces = student_forward(model, batch, create_graph=True)
    n = batch.atoms.counts.to(energy.dtype)
    e = residual_loss((energy - batch.energy) / n, cfg).mean()
    f = residual_loss(forces - batch.forces, cfg).mean()
    ref = cfg.energy_weight * e + cfg.force_weight * f
    if cfg.stress_weight > 0:
        scale = torch.linalg.det(batch.atoms.cell).abs() / n
        mask = batch.stress_mask.to(stress.dtype)
        sq = (((stress - batch.stress) * scale[:, None]) ** 2).mean(dim=1)
        ref = ref + cfg.stress_weight * (sq * mask).sum() / mask.sum().clamp_min(1.0)
    assert torch.equal(ones[0], ref.detach())
    # The static step with unit weights: the plain step's loss (the padded sums run in another order).
    _assert_same(_loss_and_grad(model, frames, idx, "static", cfg), ones)


@pytest.mark.parametrize("loss", ["mse", "huber"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_frame_of_weight_zero_leaves_loss_and_gradient_alone(setting, kind, loss):
    """Changing the labels of a frame of weight 0 changes neither the loss nor its gradient (exactly); changing a
    weighted frame's labels does (so the comparison can fail)."""
    frames, kw = setting
    cfg = _cfg(loss=loss, huber_delta=0.05, **kw)
    frames = _weighted(frames, [1.0, 0.5, 0.0, 2.0, 1.0] + [None] * (len(frames) - 5))
    model = _student(frames, cfg)
    idx = [0, 1, 2, 3, 4, 5]
    ref = _loss_and_grad(model, frames, idx, kind, cfg)
    assert ref[0] > 0 and any(g.abs().sum() > 0 for g in ref[2])
    _assert_same(_loss_and_grad(model, _relabelled(frames, 2), idx, kind, cfg), ref, exact=True)
    other = _loss_and_grad(model, _relabelled(frames, 1), idx, kind, cfg)
    assert not torch.equal(other[0], ref[0])
    assert not all(torch.equal(x, y) for x, y in zip(other[2], ref[2], strict=True))


@pytest.mark.parametrize("kind", KINDS)
def test_weight_two_is_the_frame_twice_in_the_batch(setting, kind):
    """Weighted means: a frame of weight 2 in a batch = that frame twice at weight 1 (loss, parts and gradient);
    and the weights are not ignored (weight 2 differs from weight 1)."""
    frames, kw = setting
    cfg = _cfg(**kw)
    idx = [0, 3, 5, 1]
    model = _student(frames, cfg)
    doubled = _loss_and_grad(model, _weighted(frames, [2.0] + [None] * (len(frames) - 1)), idx, kind, cfg)
    _assert_same(doubled, _loss_and_grad(model, frames, [0, 0, 3, 5, 1], kind, cfg))
    assert not torch.allclose(doubled[0], _loss_and_grad(model, frames, idx, kind, cfg)[0], rtol=1e-6)


@pytest.mark.parametrize("loss", ["mse", "huber"])
def test_static_step_equals_plain_step_with_weights(setting, loss):
    frames, kw = setting
    cfg = _cfg(loss=loss, huber_delta=0.05, **kw)
    rng = np.random.default_rng(3)
    frames = _weighted(frames, list(rng.uniform(0, 3, len(frames))))
    model = _student(frames, cfg)
    for idx in ([0, 1, 2, 3], [5], [3, 5, 1]):
        _assert_same(
            _loss_and_grad(model, frames, idx, "static", cfg), _loss_and_grad(model, frames, idx, "plain", cfg)
        )


def test_captured_step_reads_each_batchs_weights(emt_frames, monkeypatch):
    """The CUDA-graph step (its captures faked on the CPU, as in test_training_static): replays of one captured
    graph see each batch's own weights (the same losses and weights as the eager static step), and the weights
    count (the unweighted run differs)."""
    from test_training_static import _FakeCapture, _run_steps

    rng = np.random.default_rng(0)
    weights = list(rng.uniform(0, 2, 40))
    weights[3] = weights[11] = 0.0
    frames = _weighted(emt_frames[:40], weights)
    ref_model, _, ref_losses, _, _ = _run_steps(frames, "static")
    _, _, plain_losses, _, _ = _run_steps(emt_frames[:40], "static")
    _FakeCapture(monkeypatch)
    model, _, losses, stepper, _ = _run_steps(frames, "cudagraph")
    assert stepper.captures == 2
    assert losses == pytest.approx(ref_losses, rel=1e-12)
    for a, b in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
    assert not np.allclose(losses[1:], plain_losses[1:], rtol=1e-6)
    # The weights live in the static buffers like the labels: one row per frame, then 0 for the padding row.
    data = stepper.data
    expect = torch.tensor([*weights, 0.0], dtype=torch.float64)
    torch.testing.assert_close(data.weight, expect)


# ------------------------------------------------------------------------------------------- the frames
def test_config_weight_of_a_frame_is_read_and_checked(emt_frames, tmp_path):
    frames = _weighted(emt_frames[:4], [0.5, None, 0.0, 3.0])
    path = tmp_path / "weighted.extxyz"
    ase.io.write(path, frames, format="extxyz")
    for read in (read_frames(path),):
        ds = FrameDataset(read, 4.0)
        assert ds.weight.tolist() == [0.5, 1.0, 0.0, 3.0]
        assert ds.batch([3, 0]).weight.tolist() == [3.0, 0.5]
    from ase.db import connect

    db = connect(tmp_path / "weighted.db")
    for a in frames:
        db.write(a, **({"config_weight": a.info["config_weight"]} if "config_weight" in a.info else {}))
    assert FrameDataset(read_frames(tmp_path / "weighted.db"), 4.0).weight.tolist() == [0.5, 1.0, 0.0, 3.0]
    for bad in (-1.0, math.nan, math.inf, "heavy"):
        with pytest.raises(ValueError, match="frame 1: config_weight"):
            FrameDataset(_weighted(emt_frames[:2], [1.0, bad]), 4.0)


def test_training_needs_a_frame_of_nonzero_weight(emt_frames):
    frames = _weighted(emt_frames[:6], [0.0] * 6)
    with pytest.raises(ValueError, match="every training frame has loss weight 0"):
        train(frames, emt_frames[6:8], _cfg(max_steps=1), log=lambda m: None)


def test_data_weight_multiplies_the_frames_config_weight(emt_labels, emt_test_labels, tmp_path):
    extra = _weighted(read_frames(emt_test_labels)[:6], [2.0, None, 0.0, 1.0, 4.0, None])
    ase.io.write(tmp_path / "b.extxyz", extra, format="extxyz")
    n_a = len(read_frames(emt_labels))
    frames = _read_labelled([str(emt_labels), str(tmp_path / "b.extxyz")], [1.0, 0.25])
    weights = [a.info["config_weight"] for a in frames]
    assert weights == [1.0] * n_a + [0.5, 0.25, 0.0, 0.25, 1.0, 0.25]
    assert all(a.info["task"].startswith("1:") for a in frames[n_a:])
    # No --data-weight: the frames keep their own config_weight (or none).
    frames = _read_labelled([str(emt_labels), str(tmp_path / "b.extxyz")])
    assert [a.info.get("config_weight") for a in frames[n_a:]] == [2.0, None, 0.0, 1.0, 4.0, None]


@pytest.mark.parametrize(
    ("weights", "says"),
    [
        ([1.0], "given 1 time"),
        ([1.0, 0.5, 0.5], "given 3 time"),
        ([1.0, -0.2], "must be finite and >= 0, got -0.2"),
        ([math.nan, 1.0], "must be finite and >= 0, got nan"),
        ([1.0, math.inf], "must be finite and >= 0, got inf"),
        ([0.0, 0.0], "every --data source has weight 0"),
        (["x", 1.0], "must be a number"),
    ],
)
def test_bad_data_weights_are_clear_errors(emt_labels, emt_test_labels, weights, says):
    with pytest.raises(ValueError, match=says):
        _read_labelled([str(emt_labels), str(emt_test_labels)], weights)


def test_cli_train_data_weight(emt_labels, emt_test_labels, tmp_path, capsys, monkeypatch):
    """``--data A --data B --data-weight 1 --data-weight 0.2``: B's frames reach training with weight 0.2 and the
    run records the weights; a bad count is exit status 2 with the reason; the YAML key is ``data_weight``."""
    from mlff_distiller.distill import training

    seen = {}
    real_train = training.train

    def spy(train_frames, val_frames, *args, **kwargs):
        seen["train"], seen["val"] = train_frames, val_frames
        return real_train(train_frames, val_frames, *args, **kwargs)

    monkeypatch.setattr(training, "train", spy)
    run = tmp_path / "run"
    base = ["train", "--data", str(emt_labels), "--data", str(emt_test_labels), "--set", "train.max_steps=2"]
    base += ["--set", "train.device=cpu", "--set", "train.model.hidden=8", "--set", "train.model.layers=1"]
    assert main([*base, "--out", str(run), "--data-weight", "1", "--data-weight", "0.2"]) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == 2
    for frames in (seen["train"], seen["val"]):  # the weights travel with the frames through the split
        for a in frames:
            assert a.info["config_weight"] == (1.0 if a.info["task"].startswith("0:") else 0.2)
    assert {a.info["config_weight"] for a in seen["train"]} == {1.0, 0.2}
    assert load_model(run / "best.pt").metadata["data_weight"] == [1.0, 0.2]

    assert main([*base, "--out", str(tmp_path / "r2"), "--data-weight", "0.5"]) == 2
    assert "--data-weight (data_weight) given 1 time(s) for 2 --data source(s)" in capsys.readouterr().err
    assert main([*base, "--out", str(tmp_path / "r3"), "--data-weight", "0", "--data-weight", "0"]) == 2
    assert "every --data source has weight 0" in capsys.readouterr().err

    config = tmp_path / "train.yaml"
    config.write_text(f"data: [{emt_labels}, {emt_test_labels}]\ndata_weight: [0.3, 1]\n")
    args = ["train", "--config", str(config), "--out", str(tmp_path / "r4"), *base[5:]]
    assert main(args) == 0
    capsys.readouterr()
    assert {a.info["config_weight"] for a in seen["train"]} == {0.3, 1.0}


def test_reference_fits_weigh_the_frames(emt_frames):
    """A new student's energy reference and force scale, and a fine-tuning refit of the reference, are fitted with
    the frames' weights: a frame of weight 0 does not move them, weight 2 counts it twice, all 1.0 is unweighted."""
    from mlff_distiller.distill.objective import energy_reference_correction

    cfg = _cfg()

    def dataset(frames):
        return FrameDataset(frames, cfg.model.cutoff, dtype=torch.float64)

    frames = emt_frames[:10]
    zero = _weighted(frames, [1.0] * 4 + [0.0] + [1.0] * 5)
    fits = [_initial_model(cfg, dataset(f)) for f in (zero, _relabelled(zero, 4), _relabelled(frames, 4))]
    for name in ("atomic_shift", "atomic_scale"):
        assert torch.equal(getattr(fits[0], name), getattr(fits[1], name))
        assert not torch.equal(getattr(fits[0], name), getattr(fits[2], name))
    model = fits[0].double()
    for f in (frames, _weighted(frames, [1.0] * 10)):
        assert torch.equal(
            _initial_model(cfg, dataset(f)).atomic_shift, _initial_model(cfg, dataset(frames)).atomic_shift
        )
    moved = _relabelled(zero, 4)
    torch.testing.assert_close(
        energy_reference_correction(model, dataset(zero)),
        energy_reference_correction(model, dataset(moved)),
        rtol=0,
        atol=0,
    )
    twice = energy_reference_correction(model, dataset(_weighted(frames, [2.0] + [None] * 9)))
    torch.testing.assert_close(twice, energy_reference_correction(model, dataset([frames[0], *frames])))


# ------------------------------------------------------------------------------------------------ weight_norm: count
@pytest.mark.parametrize("kind", KINDS)
def test_count_normalisation_scales_a_batch_absolutely(setting, kind):
    """``weight_norm: count`` (MACE's): a batch whose frames all weigh c has c times the unweighted loss and
    gradient (``sum`` gives the unweighted ones: the weights cancel), and unit weights give the same loss as
    ``sum`` (exactly on the plain step)."""
    frames, kw = setting
    idx = [0, 3, 1, 4]
    count, plain = _cfg(weight_norm="count", **kw), _cfg(**kw)
    model = _student(frames, plain)
    ref = _loss_and_grad(model, frames, idx, kind, plain)
    _assert_same(_loss_and_grad(model, frames, idx, kind, count), ref, exact=kind == "plain")
    light = _weighted(frames, [0.2] * len(frames))
    _assert_same(_loss_and_grad(model, light, idx, kind, plain), ref)
    loss, parts, grads = _loss_and_grad(model, light, idx, kind, count)
    torch.testing.assert_close(loss, 0.2 * ref[0], atol=1e-14, rtol=1e-12)
    assert parts == pytest.approx([0.2 * p for p in ref[1]], rel=1e-12, abs=1e-16)
    for g, r in zip(grads, ref[2], strict=True):
        torch.testing.assert_close(g, 0.2 * r, atol=1e-14, rtol=1e-10)


@pytest.mark.parametrize("loss", ["mse", "huber"])
def test_static_step_equals_plain_step_with_count_normalisation(setting, loss):
    """The padded static step (padding frames and atoms out of the count) gives the plain step's loss, parts and
    gradient under ``weight_norm: count`` with random weights, one of them 0 (it still counts), batches of several
    sizes."""
    frames, kw = setting
    cfg = _cfg(loss=loss, huber_delta=0.05, weight_norm="count", **kw)
    weights = list(np.random.default_rng(5).uniform(0, 3, len(frames)))
    weights[1] = 0.0
    frames = _weighted(frames, weights)
    model = _student(frames, cfg)
    for idx in ([0, 1, 2, 3], [5], [3, 5, 1]):
        _assert_same(
            _loss_and_grad(model, frames, idx, "static", cfg), _loss_and_grad(model, frames, idx, "plain", cfg)
        )
    # A frame of weight 0 counts: the batch [0, 1] is the frame 0 alone at half its share.
    alone = _loss_and_grad(model, frames, [0], "plain", cfg)
    pair = _loss_and_grad(model, frames, [0, 1], "plain", cfg)
    torch.testing.assert_close(pair[1][0] * 2, alone[1][0], rtol=1e-12, atol=0)  # the energy term: per frame


def test_weight_norm_is_checked():
    with pytest.raises(ValueError, match="weight_norm must be 'sum' or 'count'"):
        _cfg(weight_norm="mean")


def test_cli_train_weight_norm(emt_labels, emt_test_labels, tmp_path, capsys, monkeypatch):
    """``--set train.weight_norm=count`` reaches the training config; a wrong value is exit status 2 naming it."""
    from mlff_distiller.distill import training

    seen = {}
    real_train = training.train

    def spy(train_frames, val_frames, cfg, *args, **kwargs):
        seen["cfg"] = cfg
        return real_train(train_frames, val_frames, cfg, *args, **kwargs)

    monkeypatch.setattr(training, "train", spy)
    base = ["train", "--data", str(emt_labels), "--data", str(emt_test_labels), "--set", "train.max_steps=2"]
    base += ["--set", "train.device=cpu", "--set", "train.model.hidden=8", "--set", "train.model.layers=1"]
    base += ["--data-weight", "1", "--data-weight", "0.2"]
    assert main([*base, "--out", str(tmp_path / "r"), "--set", "train.weight_norm=count"]) == 0
    capsys.readouterr()
    assert seen["cfg"].weight_norm == "count"
    assert main([*base, "--out", str(tmp_path / "r2"), "--set", "train.weight_norm=mean"]) == 2
    assert "weight_norm must be 'sum' or 'count'" in capsys.readouterr().err
