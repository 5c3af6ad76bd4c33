"""ASE's velocity-Verlet position update on the device, bit for bit (a probe for moving the MD step's prediction
off the host; nothing shipped uses it).

The calculator launches the next MD step ahead on the positions it predicts for ASE's ``VelocityVerlet``
(``StudentCalculator._verlet_next``, NumPy in float64): ``kick = 0.5 * dt * F``, ``p' = p + kick``, ``p' += kick``,
``x' = x + dt * p' / m``, then the float32 input ``(x' - origin)`` rounded once. That work sits on the host between one
step's forces and the next launch. On the device, the next step could be queued behind the current one, with no host
in between, if the device's x' equals NumPy's to the last bit: the next calculation takes a launch only on the same
bytes.

This probe computes the same update on random MD-like inputs in NumPy (the reference) and on the device in four
forms, and counts the coordinates that differ in float64 and after the float32 cast:

- ``torch``: the same elementwise ops in torch (one kernel each, no contraction);
- ``torch graph``: those ops captured in a CUDA graph and replayed (CUDA only);
- ``triton``: one Triton kernel, the compiler's default floating-point fusion (it may contract ``x + a * b`` into
  an FMA, rounded once instead of twice);
- ``triton, no fusion``: the same kernel launched with ``enable_fp_fusion=False``, eager and captured in a CUDA graph
  (``triton graph, no fusion``: what one more node of the MD step's graph would cost).

It also times each device form (CUDA events, median), beside NumPy on the host.

    python benchmarks/probe_verlet_predict.py --out DIR        # GPU (or CPU: torch and the Triton interpreter)
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import write_lines
from mlff_distiller.kernels._triton_utils import HAS_TRITON, INTERPRETING, tl, triton

FS = 0.09822694788464063  # ase.units.fs (ASE time units per femtosecond), as a literal: no ASE import needed

if HAS_TRITON:

    @triton.jit
    def _verlet_kernel(x_ptr, p_ptr, f_ptr, m_ptr, origin_ptr, coef_ptr, out64_ptr, out32_ptr, n3,
                       BLOCK: tl.constexpr):  # fmt: skip
        # The two coefficients come from a float64 tensor: Triton passes a Python float as a float32 scalar.
        half_dt = tl.load(coef_ptr)
        dt = tl.load(coef_ptr + 1)
        k = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = k < n3
        x = tl.load(x_ptr + k, mask=ok, other=0.0)
        p = tl.load(p_ptr + k, mask=ok, other=0.0)
        f = tl.load(f_ptr + k, mask=ok, other=0.0).to(tl.float64)
        m = tl.load(m_ptr + k // 3, mask=ok, other=1.0)
        o = tl.load(origin_ptr + k % 3, mask=ok, other=0.0)
        kick = half_dt * f
        pn = p + kick
        pn = pn + kick
        xn = x + dt * pn / m
        tl.store(out64_ptr + k, xn, mask=ok)
        tl.store(out32_ptr + k, (xn - o).to(tl.float32), mask=ok)


def numpy_predict(x, p, f32, m, origin, dt):
    """The calculator's prediction (``_verlet_next``, then ``_moved``'s cast): float64 x' and the float32 input."""
    kick = 0.5 * dt * f32.astype(np.float64)
    pn = p + kick
    pn += kick
    xn = x + dt * pn / m
    out = np.empty(xn.shape, dtype=np.float32)
    np.subtract(xn, origin, out=out, casting="unsafe")
    return xn, out


def torch_predict(x, p, f32, m, origin, half_dt, dt, out64, out32):
    """The same ops in torch, one kernel each, into the given outputs (capturable)."""
    kick = f32.to(torch.float64) * half_dt
    pn = p + kick
    pn += kick
    torch.add(x, (pn * dt) / m, out=out64)
    out32.copy_(out64 - origin)


def triton_predict(x, p, f32, m, origin, half_dt, dt, out64, out32, fusion: bool, coef=None):
    """One Triton kernel; ``coef``: the float64 tensor (half_dt, dt) on the device (``_forms`` makes it once; made
    here if None)."""
    n3 = x.numel()
    block = 128
    extra = {} if fusion or INTERPRETING else {"enable_fp_fusion": False}
    coef = torch.tensor([half_dt, dt], dtype=torch.float64, device=x.device) if coef is None else coef
    _verlet_kernel[(triton.cdiv(n3, block),)](
        x, p, f32, m.reshape(-1), origin, coef, out64, out32, n3, BLOCK=block, **extra
    )


def _inputs(n: int, seed: int, rng_scale: float = 1.0):
    rng = np.random.default_rng(seed)
    masses = np.array([1.008, 12.011, 14.007, 15.999])
    m = masses[rng.integers(0, 4, n)][:, None]
    x = rng.uniform(-8.0, 8.0, (n, 3)) * rng_scale
    p = rng.normal(0.0, 0.3, (n, 3)) * np.sqrt(m)  # ~300 K momenta, amu Å / ASE time unit
    f32 = rng.normal(0.0, 1.5, (n, 3)).astype(np.float32)
    origin = x.min(axis=0) - 0.5
    return x, p, f32, m, origin


def _mismatch(a: np.ndarray, b: np.ndarray) -> int:
    return int((a.view(np.uint8).reshape(a.size, -1) != b.view(np.uint8).reshape(b.size, -1)).any(axis=1).sum())


def _time_us(fn, device: torch.device, reps: int = 200) -> float:
    if device.type != "cuda":
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(ts)
    for _ in range(10):
        fn()
    torch.cuda.synchronize(device)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def _forms(dev: list[torch.Tensor], dt: float, device: torch.device) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """The device forms as callables over ``dev`` = (x, p, f32, m, origin) on ``device``, and their two outputs."""
    n = dev[0].shape[0]
    out64 = torch.empty((n, 3), dtype=torch.float64, device=device)
    out32 = torch.empty((n, 3), dtype=torch.float32, device=device)
    args = (*dev, 0.5 * dt, dt, out64, out32)
    forms = {"torch": functools.partial(torch_predict, *args)}
    if HAS_TRITON and (device.type == "cuda" or INTERPRETING):
        coef = torch.tensor([0.5 * dt, dt], dtype=torch.float64, device=device)
        forms["triton"] = functools.partial(triton_predict, *args, True, coef)
        forms["triton, no fusion"] = functools.partial(triton_predict, *args, False, coef)
    if device.type == "cuda":
        torch_predict(*args)  # warm-up before the capture
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            torch_predict(*args)
        forms["torch graph"] = graph.replay
        if "triton, no fusion" in forms:
            forms["triton, no fusion"]()  # compiled before the capture
            torch.cuda.synchronize(device)
            tgraph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(tgraph):
                forms["triton, no fusion"]()
            forms["triton graph, no fusion"] = tgraph.replay
    return forms, out64, out32


def run(sizes: list[int], trials: int, device: torch.device, dts_fs: list[float]) -> list[dict]:
    """One row per (size, time step, form): the coordinates compared over ``trials`` random inputs, how many
    differ from NumPy's in float64 and after the float32 cast, and the median µs of one prediction."""
    rows = []
    for n in sizes:
        for dt_fs in dts_fs:
            dt = dt_fs * FS
            counts: dict[str, list[int]] = {}
            for t in range(trials):
                host = _inputs(n, seed=1000 * n + t)
                ref64, ref32 = numpy_predict(*host, dt)
                forms, out64, out32 = _forms([torch.from_numpy(a).to(device) for a in host], dt, device)
                for name, fn in forms.items():
                    out64.zero_()
                    out32.zero_()
                    fn()
                    c = counts.setdefault(name, [0, 0])
                    c[0] += _mismatch(out64.cpu().numpy(), ref64)
                    c[1] += _mismatch(out32.cpu().numpy(), ref32)
            timing = {"numpy (host)": _time_us(functools.partial(numpy_predict, *host, dt), torch.device("cpu"))}
            for name, fn in forms.items():
                timing[name] = _time_us(fn, device)
            counts["numpy (host)"] = [0, 0]
            for name, (d64, d32) in counts.items():
                rows.append({
                    "atoms": n, "dt_fs": dt_fs, "form": name, "coords": 3 * n * trials, "differ64": d64,
                    "differ32": d32, "us": timing[name],
                })  # fmt: skip
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--name", default="probe_verlet_predict")
    ap.add_argument("--sizes", type=int, nargs="+", default=[12, 192, 3000])
    ap.add_argument("--dt-fs", type=float, nargs="+", default=[0.5, 1.0, 0.013])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--device", default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rows = run(args.sizes, args.trials, device, args.dt_fs)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    lines = [
        "# ASE's velocity-Verlet prediction on the device, against NumPy bit for bit",
        "",
        f"{name} · torch {torch.__version__} · triton {triton.__version__ if HAS_TRITON else '-'}"
        f"{' (interpreter)' if INTERPRETING else ''}",
        "",
        "`differ64` / `differ32`: coordinates whose float64 x' / float32 input differ from NumPy's in any bit; "
        "`µs`: one prediction (CUDA events, median; NumPy: the host's wall clock).",
        "",
        "| atoms | dt fs | form | coordinates | differ64 | differ32 | µs |",
        "|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        us = "—" if r["us"] is None else f"{r['us']:.1f}"
        lines.append(
            f"| {r['atoms']} | {r['dt_fs']} | {r['form']} | {r['coords']} | {r['differ64']} | {r['differ32']} | {us} |"
        )
    write_lines(lines, args.out, args.name)  # (prints them too)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
