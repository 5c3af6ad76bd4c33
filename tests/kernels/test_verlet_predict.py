"""kernels/verlet_predict.py: ASE's velocity-Verlet prediction on the device, bit for bit.

The oracle is the calculator's NumPy arithmetic (``StudentCalculator._verlet_next``, then ``_moved``'s float32
cast), as ``benchmarks/probe_verlet_predict.numpy_predict`` writes it (checked against ASE's VelocityVerlet). The
Triton kernel (CPU interpreter, and CUDA when present) and the torch reference must give its bits exactly, since the
chained MD step is taken only where they do.
"""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from mlff_distiller.kernels import use_backend
from mlff_distiller.kernels.verlet_predict import verlet_predict, verlet_predict_reference

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import probe_verlet_predict as probe

FS = probe.FS  # ase.units.fs


def _numpy_predict(f32, x, p, m, origin, dt):
    """The calculator's float32 input: the probe's NumPy reference, which tests/test_probe_verlet_predict.py checks
    against ASE's VelocityVerlet bit for bit."""
    return probe.numpy_predict(x, p, f32, m, origin, dt)[1]


def _inputs(n: int, seed: int, dt_fs: float):
    rng = np.random.default_rng(seed)
    x = rng.uniform(-20.0, 20.0, (n, 3)) + rng.normal(0, 1e-9, (n, 3))
    p = rng.normal(0.0, 0.3, (n, 3))
    f32 = rng.normal(0.0, 2.0, (n, 3)).astype(np.float32)
    m = rng.choice([1.008, 12.011, 15.999, 14.007, 32.06], n)[:, None]
    origin = rng.normal(0.0, 5.0, (1, 3))
    return f32, x, p, m, origin, dt_fs * FS


def _on(device, f32, x, p, m, origin, dt):
    n = x.shape[0]
    consts = torch.tensor(np.concatenate([[0.5 * dt, dt], origin.reshape(3), m.reshape(-1)]), device=device)
    t = {
        "forces": torch.from_numpy(f32).to(device),
        "x": torch.from_numpy(x).to(device),
        "p": torch.from_numpy(p).to(device),
        "consts": consts,
        "out": torch.full((n, 3), float("nan"), dtype=torch.float32, device=device),
        "also": torch.full((n, 3), float("nan"), dtype=torch.float32, device=device),
    }
    return t


@pytest.mark.parametrize("n", [1, 12, 43, 200])
@pytest.mark.parametrize("dt_fs", [0.5, 1.0, 0.013])
def test_triton_and_reference_give_numpys_bits(triton_device, n, dt_fs):
    inputs = _inputs(n, seed=n * 7 + int(dt_fs * 1000), dt_fs=dt_fs)
    expected = _numpy_predict(*inputs)
    for backend, fn in (("triton", verlet_predict), ("torch", verlet_predict_reference)):
        t = _on(triton_device, *inputs)
        with use_backend(backend):
            fn(**t)
        for name in ("out", "also"):
            got = t[name].cpu().numpy()
            differ = int(np.count_nonzero(got.view(np.int32) != expected.view(np.int32)))
            assert differ == 0, f"{backend} on {triton_device}: {differ} of {3 * n} coordinates of {name} differ"


def test_the_forces_move_the_prediction(triton_device):
    """The kernel reads the forces, momenta, masses and origin (a prediction that ignored one would still match
    x itself on zero inputs: every input here is non-zero, and changing each changes the output)."""
    f32, x, p, m, origin, dt = _inputs(20, seed=3, dt_fs=1.0)
    base = _on(triton_device, f32, x, p, m, origin, dt)
    with use_backend("triton"):
        verlet_predict(**base)
    for changed in ("forces", "p", "m", "origin"):
        args = [f32, x, p, m, origin, dt]
        i = {"forces": 0, "p": 2, "m": 3, "origin": 4}[changed]
        args[i] = args[i] * 1.5
        t = _on(triton_device, *args)
        with use_backend("triton"):
            verlet_predict(**t)
        assert not torch.equal(t["out"], base["out"]), changed


def test_bad_shapes_and_dtypes_raise_value_errors():
    f32, x, p, m, origin, dt = _inputs(4, seed=1, dt_fs=0.5)
    t = _on("cpu", f32, x, p, m, origin, dt)
    with pytest.raises(ValueError, match=r"must all be \[n, 3\]"):
        verlet_predict(**{**t, "p": t["p"][:3]})
    with pytest.raises(ValueError, match=r"consts must be \[5 \+ n\]"):
        verlet_predict(**{**t, "consts": t["consts"][:-1]})
    with pytest.raises(ValueError, match="must be float64"):
        verlet_predict(**{**t, "x": t["x"].float()})
    with pytest.raises(ValueError, match="one dtype"):
        verlet_predict(**{**t, "also": t["also"].double()})
    with pytest.raises(ValueError, match="contiguous"):
        verlet_predict(**{**t, "forces": t["forces"].t().contiguous().t()})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_kernel_on_cuda_gives_numpys_bits_on_fresh_inputs():
    """In a CUDA graph (as in the chained step), replayed on inputs written after the capture."""
    n = 30
    f32, x, p, m, origin, dt = _inputs(n, seed=11, dt_fs=0.5)
    t = _on("cuda", f32, x, p, m, origin, dt)
    with use_backend("triton"):
        verlet_predict(**t)  # compiled before the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            verlet_predict(**t)
    for seed in range(5):
        g, xx, pp, _, _, _ = _inputs(n, seed=100 + seed, dt_fs=0.5)
        t["forces"].copy_(torch.from_numpy(g))
        t["x"].copy_(torch.from_numpy(xx))
        t["p"].copy_(torch.from_numpy(pp))
        graph.replay()
        torch.cuda.synchronize()
        expected = _numpy_predict(g, xx, pp, m, origin, dt)
        assert np.array_equal(t["out"].cpu().numpy().view(np.int32), expected.view(np.int32))
        assert np.array_equal(t["also"].cpu().numpy().view(np.int32), expected.view(np.int32))
