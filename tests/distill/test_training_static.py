"""The padded static-shape training step (``train_step="static"``) and its CUDA-graph capture (``"cudagraph"``)
against the plain step: same batches, same math, same weights."""

import numpy as np
import pytest
import torch
from ase.build import molecule
from ase.calculators.singlepoint import SinglePointCalculator
from distill_helpers import small_train_config
from torch import nn

from mlff_distiller import StudentModel, kernels
from mlff_distiller.distill import FrameDataset, TrainConfig, split_frames, student_forward, train
from mlff_distiller.distill.static_batch import _StaticBatcher, _StaticData
from mlff_distiller.distill.train_steps import _csr_view


def _cfg(mode, **kw):
    # grad_clip 1.0 is small enough to clip: the clipping path is compared too.
    opts = dict(eval_every=5, grad_clip=1.0, dtype="float64", max_steps=10, train_step=mode)
    return small_train_config(**{**opts, **kw})


def _assert_same_run(a, b, atol=1e-10, rel=1e-8):
    sa, sb = a.model.state_dict(), b.model.state_dict()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], atol=atol, rtol=atol, msg=lambda m, k=k: f"{k}: {m}")
    assert [h["step"] for h in a.history] == [h["step"] for h in b.history]
    for ha, hb in zip(a.history, b.history, strict=True):
        for key in ("train_loss", "train_energy_mse", "train_forces_mse", "val_force_mae_mev_a", "lr"):
            assert ha[key] == pytest.approx(hb[key], rel=rel, abs=1e-12), key


def test_static_step_equals_plain_step(emt_frames):
    train_f, val_f = split_frames(emt_frames, 0.2)
    quiet = dict(log=lambda m: None)
    plain = train(train_f, val_f, _cfg("plain"), **quiet)
    static = train(train_f, val_f, _cfg("static"), **quiet)
    assert (plain.train_step, static.train_step) == ("plain", "static")
    assert 0 < static.steady_step_seconds < static.seconds and 0 < plain.steady_step_seconds < plain.seconds
    _assert_same_run(plain, static)
    # Learning rate held by a plateau scheduler and no EMA: the other branches of the step.
    kw = dict(scheduler="plateau", plateau_patience=0, ema_decay=0.0, max_steps=10, eval_every=2, lr=0.05)
    plain = train(train_f, val_f, _cfg("plain", **kw), **quiet)
    static = train(train_f, val_f, _cfg("static", **kw), **quiet)
    assert plain.history[-1]["lr"] < 0.05  # the plateau scheduler did reduce it
    # Ten steps at lr 0.05 amplify the two steps' rounding (float64; the padded step's GEMMs have other shapes):
    # the validation MAE's relative difference grows from ~1e-16 at step 2 to 5e-9 (the last layer's update making
    # v' too) or 1.2e-8 (s' alone, shipped since stop 56) at step 10, while the weights stay within 3e-11.
    _assert_same_run(plain, static, rel=1e-7)


def test_static_step_with_hvp_equals_plain(tmp_path):
    from distill_helpers import emt_seeds, small_sampling

    from mlff_distiller.distill import label, read_frames

    label(emt_seeds()[:1], "emt", tmp_path / "h", small_sampling(md_steps=16, hvp=True), progress=False)
    frames = read_frames(tmp_path / "h")
    kw = dict(hvp_weight=0.1, max_steps=6, eval_every=3)
    plain = train(frames, frames, _cfg("plain", **kw), log=lambda m: None)
    static = train(frames, frames, _cfg("static", **kw), log=lambda m: None)
    assert "train_hvp_mse" in static.history[-1]
    _assert_same_run(plain, static)


def test_static_step_with_huber_equals_plain(emt_frames):
    """``loss: huber`` in both steps: the same run. The delta is small enough that a fresh student's residuals cross
    it (both branches of the Huber term are taken), and a delta above every residual is the mse run exactly."""
    train_f, val_f = split_frames(emt_frames, 0.2)
    quiet = dict(log=lambda m: None)
    kw = dict(loss="huber", huber_delta=0.05)
    plain = train(train_f, val_f, _cfg("plain", **kw), **quiet)
    static = train(train_f, val_f, _cfg("static", **kw), **quiet)
    _assert_same_run(plain, static)
    mse = train(train_f, val_f, _cfg("plain"), **quiet)
    assert abs(mse.history[0]["train_loss"] - plain.history[0]["train_loss"]) > 1e-3 * mse.history[0]["train_loss"]
    wide = train(train_f, val_f, _cfg("static", loss="huber", huber_delta=1e6), **quiet)
    _assert_same_run(mse, wide)


def test_static_resume_continues_exactly(emt_frames, tmp_path):
    import shutil

    from mlff_distiller import load_model

    train_f, val_f = split_frames(emt_frames, 0.2)
    quiet = dict(log=lambda m: None)
    kw = dict(scheduler="none", eval_every=5)
    full = train(train_f, val_f, _cfg("static", max_steps=10, **kw), tmp_path / "full", **quiet)
    train(train_f, val_f, _cfg("plain", max_steps=5, **kw), tmp_path / "part", **quiet)  # saved by the plain step
    shutil.copytree(tmp_path / "part", tmp_path / "part_plain")
    resumed = train(train_f, val_f, _cfg("static", max_steps=10, **kw), tmp_path / "part", resume=True, **quiet)
    train(train_f, val_f, _cfg("plain", max_steps=10, **kw), tmp_path / "part_plain", resume=True, **quiet)
    assert resumed.steps == 10 and resumed.train_step == "static"
    a = load_model(tmp_path / "full" / "last.pt").state_dict()
    b = load_model(tmp_path / "part" / "last.pt").state_dict()
    c = load_model(tmp_path / "part_plain" / "last.pt").state_dict()
    for k in a:
        # As for the plain step (test_training.py): a resumed run matches an uninterrupted one to ~1e-7.
        torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=1e-4, msg=k)
        torch.testing.assert_close(b[k], c[k], atol=1e-12, rtol=1e-12, msg=k)
    assert full.history[-1]["val_force_mae_mev_a"] == pytest.approx(
        resumed.history[-1]["val_force_mae_mev_a"], rel=1e-4
    )


def _frames_of_sizes():
    """Labelled frames of different sizes (2..9 atoms); energies and forces are arbitrary but fixed."""
    rng = np.random.default_rng(0)
    frames = []
    for name in ("H2", "H2O", "CH4", "NH3", "CH3OH", "C2H6", "HCN", "CH3CH2OH"):
        a = molecule(name)
        a.positions += rng.normal(0, 0.05, a.positions.shape)
        a.calc = SinglePointCalculator(a, energy=float(rng.normal()), forces=rng.normal(size=(len(a), 3)))
        frames.append(a)
    return frames


def test_static_batcher_keeps_one_ratio_for_large_batches():
    """Training's ladder steps by its bucket_growth throughout (each bucket is a captured training step kept for
    the run), not by the engine's finer ratio for large buckets."""
    from types import SimpleNamespace

    sizes = np.full(40, 500)  # 10 frames of 500 atoms per batch: capacities well past 2,048 atoms
    data = SimpleNamespace(
        atom_ptr=np.concatenate([[0], np.cumsum(sizes)]), edge_ptr=np.concatenate([[0], np.cumsum(sizes * 40)])
    )
    batcher = _StaticBatcher(data, batch_size=10, growth=1.25)
    for caps in (batcher.atom_caps, batcher.edge_caps):
        ratios = caps[1:] / caps[:-1]
        assert caps[-1] > 4096 and (ratios[:-1] > 1.2).all()  # the last step may be cut by the largest batch


def test_padded_batch_is_inert_and_receiver_sorted():
    torch.manual_seed(0)
    model = StudentModel(species=[1, 6, 7, 8], hidden=16, layers=2, n_rbf=8, cutoff=3.0).double()
    ds = FrameDataset(_frames_of_sizes(), model.cutoff, dtype=torch.float64)
    data = _StaticData(ds, model.species_list[0], model.cutoff)
    batcher = _StaticBatcher(data, batch_size=5, growth=1.25)
    idx = [6, 1, 7]
    bucket, row = batcher.plan(idx)
    a, c, s = bucket.atoms, bucket.edges, batcher.structures
    atom_src, batch, recv, send, edge_src, frame_src = np.split(row, np.cumsum([a, a, c, c, c]))
    ref = ds.batch(idx)
    n, e = ref.atoms.num_atoms, ref.edge_index.shape[1]
    assert bucket.atoms > n and bucket.edges >= e and c > e  # real padding in both
    assert (np.diff(recv) >= 0).all()  # the kernels' CSR contract
    assert (recv[e:] == send[e:]).all() and (recv[e:] >= n).all() and (recv[e:] < a).all()
    assert (atom_src[n:] == data.n_atoms).all() and (batch[n:] == s - 1).all()
    assert (edge_src[e:] == data.n_edges).all() and (frame_src[len(idx) :] == data.n_frames).all()
    np.testing.assert_array_equal(np.stack([recv[:e], send[:e]]), ref.edge_index.numpy())

    # The padded graph through the CSR view gives the unpadded energies and forces, and the padding
    # contributes exactly nothing to the parameters' gradient.
    src, b_t, e_src, f_src = (torch.from_numpy(x) for x in (atom_src, batch, edge_src, frame_src))
    edges = torch.from_numpy(np.stack([recv, send]))
    view = _csr_view(model, {"row_ptr": torch.searchsorted(edges[0].contiguous(), torch.arange(a + 1))})
    pos = data.positions[src].requires_grad_(True)
    energy = view(data.numbers[src], pos, edges, data.shift_vectors[e_src], b_t, s)["energy"]
    mask = (f_src < data.n_frames).double()
    (grad,) = torch.autograd.grad((energy * mask).sum(), pos, create_graph=True)
    e_ref, f_ref = student_forward(model, ref, create_graph=True)
    torch.testing.assert_close(energy[: len(idx)], e_ref, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(-grad[:n], f_ref, atol=1e-12, rtol=1e-12)
    assert (grad[n:] == 0).all()
    g_pad = torch.autograd.grad(grad.square().sum() + (energy * mask).sum(), list(model.parameters()))
    g_ref = torch.autograd.grad(f_ref.square().sum() + e_ref.sum(), list(model.parameters()))
    for x, y in zip(g_pad, g_ref, strict=True):
        torch.testing.assert_close(x, y, atol=1e-10, rtol=1e-10)


def test_train_step_and_kernels_options():
    with pytest.raises(ValueError, match="train_step"):
        TrainConfig(train_step="graph")
    with pytest.raises(ValueError, match="kernels"):
        TrainConfig(kernels="cuda")
    with pytest.raises(ValueError, match="bucket_growth"):
        TrainConfig(bucket_growth=1.0)
    assert TrainConfig(device="cpu").resolved_train_step() == "plain"
    with pytest.raises(ValueError, match="CUDA"):
        TrainConfig(device="cpu", train_step="cudagraph").resolved_train_step()


def test_kernels_option_applies_during_training_only(emt_frames):
    train_f, val_f = split_frames(emt_frames, 0.2)
    seen = []
    before = kernels.get_backend()
    train(
        train_f, val_f, _cfg("static", kernels="torch", max_steps=2), log=lambda m: seen.append(kernels.get_backend())
    )
    assert seen and set(seen) == {"torch"}
    assert kernels.get_backend() == before


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_cudagraph_step_equals_eager_static_step(emt_frames, backend):
    train_f, val_f = split_frames(emt_frames, 0.2)
    kw = dict(device="cuda", kernels=backend, max_steps=12, eval_every=4)
    logs = []
    graph = train(train_f, val_f, _cfg("cudagraph", **kw), log=logs.append)
    eager = train(train_f, val_f, _cfg("static", **kw), log=lambda m: None)
    plain = train(train_f, val_f, _cfg("plain", **kw), log=lambda m: None)
    assert graph.train_step == "cudagraph" and graph.captures >= 1, logs
    assert not any("failed" in m for m in logs), logs
    # Scatter atomics make float64 sums order-dependent at the 1e-16 level; nothing larger may differ.
    _assert_same_run(graph, eager, atol=1e-8)
    _assert_same_run(graph, plain, atol=1e-8)


@pytest.mark.gpu
def test_cudagraph_step_with_huber_equals_plain(emt_frames):
    train_f, val_f = split_frames(emt_frames, 0.2)
    kw = dict(device="cuda", max_steps=8, eval_every=4, loss="huber", huber_delta=0.05)
    graph = train(train_f, val_f, _cfg("cudagraph", **kw), log=lambda m: None)
    plain = train(train_f, val_f, _cfg("plain", **kw), log=lambda m: None)
    assert graph.train_step == "cudagraph" and graph.captures >= 1
    _assert_same_run(graph, plain, atol=1e-8)


class _FakeCapture:
    """CPU stand-ins for the torch.cuda calls of the CUDA-graph path: a 'capture' runs the step body eagerly
    (a real capture only records it), so the fake graph's first replay does nothing and later replays re-run
    the body into the captured output, like a real replay. ``fail=True`` makes every capture raise."""

    def __init__(self, monkeypatch, fail=False):
        import contextlib

        from mlff_distiller.distill import train_steps

        self.capturing = None
        self.captures = 0
        orig_body = train_steps._StaticStep._body
        fake = self

        class Graph:
            def __init__(self):
                self.fn, self.replays = None, 0

            def replay(self):
                self.replays += 1
                if self.replays > 1:
                    self.fn()

        @contextlib.contextmanager
        def graph(g, capture_error_mode="global"):
            assert capture_error_mode in ("global", "thread_local")
            if fail:
                raise RuntimeError("operation not permitted when stream is capturing")
            fake.capturing, fake.captures = g, fake.captures + 1
            try:
                yield
            finally:
                fake.capturing = None

        def body(step, cap):
            out = orig_body(step, cap)
            if fake.capturing is not None:
                fake.capturing.fn = lambda: out.copy_(orig_body(step, cap))
            return out

        class Stream:
            def __init__(self, device=None):
                pass

            def wait_stream(self, other):
                pass

        monkeypatch.setattr(train_steps._StaticStep, "_body", body)
        monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
        monkeypatch.setattr(torch.cuda, "graph", graph)
        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
        monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)


def _run_steps(frames, mode, steps=10, batch_size=20):
    from mlff_distiller.distill.optim import _EMA
    from mlff_distiller.distill.train_steps import _StaticStep
    from mlff_distiller.distill.training import _initial_model

    cfg = _cfg(mode, batch_size=batch_size, grad_clip=1.0)
    ds = FrameDataset(frames, cfg.model.cutoff, dtype=torch.float64)
    model = _initial_model(cfg, ds).double()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)  # not capturable: AdamW refuses that on the CPU
    ema = _EMA(model, 0.9)
    logs = []
    stepper = _StaticStep(model, ds, cfg, opt, ema, mode, logs.append)
    order = np.random.default_rng(0).permutation(len(ds))
    losses = []
    for k in range(steps):
        # Batches of two sizes -> two padded capacities, each warmed up and captured on its own.
        idx = order[(k * batch_size) % len(ds) :][: batch_size if k % 3 else 2]
        stepper.step(idx.tolist(), k, cfg.lr * (1 - 0.05 * k))
        losses.append(stepper.last()[0])
    return model, ema, losses, stepper, logs


@pytest.mark.parametrize("fail", [False, True])
def test_cudagraph_state_machine_on_cpu(emt_frames, monkeypatch, fail):
    """Warm-up steps, capture, replays and the eager fallback after a failed capture, with the CUDA calls faked:
    every step must run exactly once, in order (same weights, EMA and losses as the eager static step)."""
    frames = emt_frames[:40]
    ref_model, ref_ema, ref_losses, _, _ = _run_steps(frames, "static")
    fake = _FakeCapture(monkeypatch, fail=fail)
    model, ema, losses, stepper, logs = _run_steps(frames, "cudagraph")
    assert len(stepper.capacities) == 2
    if fail:
        assert stepper.captures == 0 and sum("failed" in m for m in logs) == 2
        assert all(cap.graph is False for cap in stepper.capacities.values())
    else:
        assert stepper.captures == fake.captures == 2 and not any("failed" in m for m in logs)
    assert losses == pytest.approx(ref_losses, rel=1e-12)
    for a, b in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
    for a, b in zip(ema.shadow, ref_ema.shadow, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("mode", ["plain", "static"])
def test_time_limit_validates_the_last_step(emt_frames, mode):
    train_f, val_f = split_frames(emt_frames, 0.2)
    res = train(train_f, val_f, _cfg(mode, time_limit_s=1e-3, max_steps=0, eval_every=1000), log=lambda m: None)
    assert res.stopped == "time_limit" and res.steps >= 1
    assert [h["step"] for h in res.history] == [res.steps] and res.best_val["step"] == res.steps


@pytest.mark.gpu
def test_capturable_adamw_matches_plain_adamw_in_float64():
    """The CUDA-graph step's AdamW (capturable, bias corrections computed on the device) gives the plain
    AdamW's float64 numbers; with torch's own float32 step counts it parts from them after one step."""
    import copy
    from types import SimpleNamespace

    from mlff_distiller.distill.optim import _optimizer

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    dev = torch.device("cuda")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).to(dev, torch.float64)
    cfg = SimpleNamespace(lr=1e-3, weight_decay=0.01)
    x = torch.randn(32, 8, dtype=torch.float64, device=dev)

    def run(torch_state: bool) -> float:
        a, b = copy.deepcopy(net), copy.deepcopy(net)
        oa = _optimizer(a, cfg, "cudagraph", dev, torch.float64)
        if torch_state:
            oa.state.clear()  # torch creates it at the first step, with float32 step counts
        ob = _optimizer(b, cfg, "static", dev, torch.float64)
        for _ in range(5):
            for mod, o in ((a, oa), (b, ob)):
                o.zero_grad()
                mod(x).square().sum().backward()
                o.step()
        return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters(), strict=True))

    assert run(torch_state=False) < 1e-14
    assert run(torch_state=True) > 1e-12  # the difference the float64 step counts remove
