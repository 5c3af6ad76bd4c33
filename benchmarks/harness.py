"""A small benchmark harness: timing with warm-up and quantiles, the run's environment in every row, the
device's copy bandwidth as the yardstick, results appended as JSON lines and rewritten as a markdown table.

Timing uses ``triton.testing.do_bench`` on CUDA (CUDA events, L2 flushed between repetitions, warm-up first);
on other devices a plain wall-clock loop (only for smoke runs: CPU numbers mean nothing for GPU kernels).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import os
import platform
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import torch

from mlff_distiller.cudagraph import capturing

__all__ = [
    "BenchRow",
    "Environment",
    "Timing",
    "copy_bandwidth",
    "device_slug",
    "environment",
    "peak_memory_bytes",
    "sync",
    "time_fn",
    "time_graph",
    "write_results",
]

QUANTILES = (0.5, 0.2, 0.8)


@dataclasses.dataclass(frozen=True)
class Timing:
    """Per-call time of a function, µs: median and the 20 % / 80 % quantiles."""

    median_us: float
    p20_us: float
    p80_us: float


@dataclasses.dataclass(frozen=True)
class Environment:
    """What produced a number: written into every row."""

    device: str
    torch: str
    triton: str
    commit: str
    host: str
    copy_gbps: float  # device-to-device copy bandwidth measured in the same run (bytes read + written per second)
    weights: str = "tf32-grid"  # the benchmark students' weights (STUDENT_WEIGHTS)


# The benchmark students' weights (peers.make_student, bench_engine.make_student; seeded random draws): "tf32-grid"
# (every nn.Linear weight rounded to the nearest TF32 value, StudentModel.round_weights_tf32: the form of the shipped
# students and of the trainer's results since stop 59, whose fp32 weight products take two TF32 MMAs instead of three)
# or "as-trained" (the float32 draws as they are: a student trained with TrainConfig.tf32_grid=False, or from before
# stop 59). MLFF_BENCH_WEIGHTS sets it for a run; every results header names it.
STUDENT_WEIGHTS = os.environ.get("MLFF_BENCH_WEIGHTS", "tf32-grid")
_WEIGHTS = ("tf32-grid", "as-trained")


def student_weights(model):
    """``model`` with its weights in the form of ``STUDENT_WEIGHTS`` (rounded in place for "tf32-grid")."""
    if STUDENT_WEIGHTS not in _WEIGHTS:
        raise ValueError(f"MLFF_BENCH_WEIGHTS must be one of {_WEIGHTS}, got {STUDENT_WEIGHTS!r}")
    if STUDENT_WEIGHTS == "tf32-grid":
        model.round_weights_tf32()
    return model


@dataclasses.dataclass
class BenchRow:
    """One measurement. ``bytes`` is the minimal traffic (inputs read once, outputs written once)."""

    bench: str
    variant: str
    impl: str  # triton | eager | compile
    mode: str  # fwd | fwd+bwd | ...
    n_edges: int
    dtype: str
    median_us: float
    p20_us: float
    p80_us: float
    bytes: int
    gbps: float
    frac_copy_bw: float
    vs_eager: float | None = None  # eager time / this time (> 1: faster than eager)
    vs_compile: float | None = None  # compiled-reference time / this time
    note: str = ""
    env: Environment | None = None
    timestamp: str = dataclasses.field(default_factory=lambda: _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"))


def git_commit() -> str:
    """Short commit of this checkout, with ``-dirty`` when tracked files have changes; ``unknown`` outside git."""
    try:
        root = Path(__file__).resolve().parent
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True
        ).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def environment(device: torch.device, copy_gbps: float) -> Environment:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return Environment(
        device=name,
        torch=torch.__version__,
        triton=triton_version,
        commit=git_commit(),
        host=platform.node(),
        copy_gbps=copy_gbps,
        weights=STUDENT_WEIGHTS,
    )


def time_fn(fn: Callable[[], object], device: torch.device, warmup_ms: float = 25, rep_ms: float = 100) -> Timing:
    """Median and quantiles of one call of ``fn``; it runs once untimed first (compilation, autotuning)."""
    fn()
    if device.type == "cuda":
        import triton.testing

        torch.cuda.synchronize()
        q = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=list(QUANTILES))
        return Timing(*(1e3 * float(x) for x in q))
    times = []
    deadline = time.perf_counter() + rep_ms / 1e3
    while len(times) < 3 or time.perf_counter() < deadline:
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    t = torch.tensor(times, dtype=torch.float64)
    return Timing(*(float(torch.quantile(t, q)) for q in QUANTILES))


def wall_us(fn: Callable[[], object], reps: int, warmup: int = 20) -> tuple[float, float]:
    """Median and 20th percentile (µs) of ``reps`` wall-clock calls of ``fn`` after ``warmup`` untimed ones: for
    host-bound calls that wait for their own results (end-to-end latency, MD steps), where device events would
    miss the host's share."""
    for _ in range(warmup):
        fn()
    t = np.empty(reps)
    for i in range(reps):
        t0 = time.perf_counter()
        fn()
        t[i] = time.perf_counter() - t0
    return float(np.median(t) * 1e6), float(np.percentile(t, 20) * 1e6)


def host_us(fn: Callable[[], object], reps: int) -> float:
    """Mean host µs per call of ``reps`` calls of ``fn`` issued back to back on the current CUDA device, one
    synchronisation before and after, outside the clock: the host's own time per call while the device keeps up (when
    the launch queue fills, the host waits, so this bounds the host's time from above)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / reps * 1e6


def back_to_back_us(fn: Callable[[], object], calls: int, rounds: int = 5, warmup: int = 20) -> float:
    """Wall µs per call of ``calls`` eager calls of ``fn`` back to back and one synchronisation after them, the
    median of ``rounds``: the host's cost of a launch where it exceeds the device's, the device's otherwise (unlike
    :func:`host_us`, the clock runs until the device is done)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        per_call.append((time.perf_counter() - t0) / calls * 1e6)
    return sorted(per_call)[len(per_call) // 2]


class CaptureFailed(RuntimeError):
    """``fn`` ran, but could not be captured as a CUDA graph (a host sync inside it, ...)."""


def capture_graph(fn: Callable[[], object], calls: int = 1, warmup: int = 3) -> torch.cuda.CUDAGraph:
    """``calls`` calls of ``fn`` captured as one CUDA graph, after ``warmup`` calls on a side stream (allocator,
    autotuning, lazy initialisation outside the capture); the collector off while capturing (see
    mlff_distiller.cudagraph). An error of a warm-up call propagates as it is; a failed capture raises
    :class:`CaptureFailed`."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with capturing(graph):
            for _ in range(calls):
                fn()
    except Exception as exc:
        raise CaptureFailed(f"{type(exc).__name__}: {exc}") from exc
    return graph


def time_graph(fn: Callable[[], object], device: torch.device, rep_ms: float = 100) -> Timing | None:
    """Device time of one call of ``fn``: ``fn`` captured once as a CUDA graph and its replays timed like
    :func:`time_fn` (L2 flushed between repetitions). A replay costs ~10 µs of host time whatever ``fn`` does,
    so this measures the GPU work alone, not the Python and autograd host path of each call, which
    :func:`time_fn` includes whenever it exceeds the GPU time. None off CUDA, or when ``fn`` cannot be captured
    (a host sync inside it)."""
    if device.type != "cuda":
        return None
    try:
        graph = capture_graph(fn)
    except CaptureFailed as exc:  # reported as "not capturable"
        print(f"  (not capturable as a CUDA graph: {str(exc)[:140]})", flush=True)
        torch.cuda.synchronize()
        return None
    try:
        return time_fn(graph.replay, device, rep_ms=rep_ms)
    finally:
        del graph
        torch.cuda.empty_cache()


def graph_time_per_call_us(fn: Callable[[], object], reps: int = 20) -> float:
    """Device µs per call of ``fn``: ``reps`` calls captured in one CUDA graph (after a warm-up on a side stream),
    the replay's median (``triton.testing.do_bench``) divided by ``reps``. For ops of a few µs, where one call per
    graph would measure the launch."""
    import triton.testing

    graph = capture_graph(fn, calls=reps, warmup=2)
    return triton.testing.do_bench(graph.replay, warmup=20, rep=150, return_mode="median") * 1e3 / reps


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth, GB/s, counting the bytes read plus the bytes written."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    t = time_fn(lambda: dst.copy_(src), device)
    return 2 * nbytes / (t.median_us * 1e-6) / 1e9


def _fmt(x, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def write_lines(lines: list[str], out_dir: Path, name: str) -> Path:
    """A probe's markdown report: ``lines`` written to ``out_dir/<name>.md`` (made if missing) and printed."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.md"
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return path


def write_results(rows: Iterable[BenchRow], out_dir: Path, name: str) -> tuple[Path, Path]:
    """Append ``rows`` to ``<out_dir>/<name>.jsonl`` and write this run's table to ``<out_dir>/<name>.md``."""
    rows = list(rows)
    out_dir.mkdir(parents=True, exist_ok=True)
    jsonl, md = out_dir / f"{name}.jsonl", out_dir / f"{name}.md"
    with jsonl.open("a") as f:
        for r in rows:
            f.write(json.dumps(dataclasses.asdict(r)) + "\n")
    env = rows[0].env if rows else None
    lines = [f"# {name}", ""]
    if env is not None:
        lines += [
            f"{env.device} · torch {env.torch} · triton {env.triton} · commit {env.commit} · "
            f"copy bandwidth {env.copy_gbps:.0f} GB/s · student weights {env.weights} · {rows[0].timestamp}",
            "",
        ]
    lines += [
        "| bench | variant | mode | edges | dtype | impl | median µs | p20-p80 µs | GB/s | % copy BW "
        "| vs eager | vs compile |",
        "|---|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.bench} | {r.variant} | {r.mode} | {r.n_edges:.0e} | {r.dtype} "
            f"| {r.impl}{' ' + r.note if r.note else ''} "
            f"| {r.median_us:.1f} | {r.p20_us:.1f}-{r.p80_us:.1f} | {r.gbps:.0f} "
            f"| {100 * r.frac_copy_bw:.0f} "
            f"| {_fmt(r.vs_eager, '.2f')} | {_fmt(r.vs_compile, '.2f')} |"
        )
    md.write_text("\n".join(lines) + "\n")
    return jsonl, md


# ---------------------------------------------------------------------------------------------------------------
# Additions for run_all.py and the bench_*.py files built on it.


def sync(device: torch.device | str) -> None:
    """Wait for the device's queued work (a no-op off CUDA), so wall-clock intervals measure finished work."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_slug(device: torch.device | str) -> str:
    """A short file-name tag for the device: ``h100``, ``h200``, ``a100``... for NVIDIA GPUs, ``cpu`` else."""
    import re

    device = torch.device(device)
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device)
    m = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", name)
    tag = m.group(1) if m else name
    return re.sub(r"[^a-z0-9]+", "-", tag.lower()).strip("-") or "gpu"


def peak_memory_bytes(fn: Callable[[], object], device: torch.device | str) -> int | None:
    """Peak device memory (bytes) allocated during one call of ``fn`` above what was allocated before it
    (CUDA caching-allocator statistics); None off CUDA, where it is not measured."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device) - base)


def profile_tables(prof, top: int, keys: tuple[str, ...] = ("tottime", "cumtime"), title: str = "") -> str:
    """A ``cProfile.Profile``'s functions sorted by each of ``keys`` (the ``top`` rows each), as markdown sections
    under ``## {title} by {key}``: the host's view of a probe's calls (cProfile inflates small Python functions:
    read the ranking, not the µs)."""
    import io
    import pstats

    parts = []
    for key in keys:
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(top)
        parts.append(f"\n## {(title + ' ') if title else ''}by {key}\n\n{buf.getvalue()}")
    return "\n".join(parts)


def host_work_us(reps: int = 400) -> float:
    """Median µs of a fixed piece of host work the size of a calculator's bookkeeping (20 small NumPy ops and float
    reads): how fast the host runs right now. On the H200 guests here it takes either ~47 µs or ~90 µs, by phase
    (stop 77, benchmarks/results/stop77_gpu/a/), and host-bound rows such as the ASE MD step follow it."""
    import numpy as np

    a = np.random.default_rng(0).normal(size=(12, 3))

    def one() -> float:
        s = 0.0
        for _ in range(20):
            b = a * 1.0001 + 0.5
            s += float(np.abs(b).max())
        return s

    return wall_us(one, reps)[0]
