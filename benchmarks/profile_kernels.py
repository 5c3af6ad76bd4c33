"""Where the fixed per-call cost of the Triton kernels goes (GPU): host time vs device time, piece by piece.

The kernels' time is flat below ~1e6 edges, i.e. a fixed cost per call. This script separates it:

* ``host``: host µs per call — N calls back to back without synchronising, divided by N (the GPU keeps up,
  so this is the Python/launch path) — and ``synced`` µs per call (each call followed by a synchronise:
  host + launch latency + kernel). Measured for the building blocks (an allocation, a no-op
  autograd.Function, ``kernel[grid](...)``) and for each op's forward and forward+backward, next to the
  eager torch reference.
* ``kernels``: device time of every CUDA kernel of one forward+backward at 1e6 edges (torch.profiler), with
  the backward's receiver reduction segmented and as plain atomics.
* ``bench``: the benchmark's own measure (``triton.testing.do_bench`` medians, L2 flushed) for each variant.
* ``cprofile``: the Python functions that take the host time of one edge_features forward+backward.

    python benchmarks/profile_kernels.py --out benchmarks/results     # writes profile_kernels_<gpu>.md/.json
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import importlib
import io
import json
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_kernels import CUTOFF, N_RBF, make_case, mode_fn
from harness import copy_bandwidth, environment, time_fn
from mlff_distiller.kernels import set_backend

rbf_mod = importlib.import_module("mlff_distiller.kernels.rbf_cutoff")
edge_mod = importlib.import_module("mlff_distiller.kernels.edge_features")

BENCHES = [
    ("rbf_cutoff", "bessel/cosine"),
    ("rbf_cutoff", "gaussian/polynomial"),
    ("edge_features", "-"),
    ("edge_basis", "bessel/cosine"),
    ("edge_basis", "gaussian/polynomial"),
]


# Scale of the sizes and repetitions: 1 on the GPU; --cpu-smoke shrinks them to exercise the script on the
# CPU interpreter (numbers meaningless there).
SCALE = {"edges": 1, "reps": 1}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def host_time(fn, n: int = 300) -> tuple[float, float]:
    """(host µs per call without synchronising, µs per call with a synchronise after each call)."""
    n = max(3, n // SCALE["reps"])
    for _ in range(min(20, n)):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    sync()
    host = (t1 - t0) / n * 1e6
    t0 = time.perf_counter()
    for _ in range(n // 3):
        fn()
        sync()
    synced = (time.perf_counter() - t0) / (n // 3) * 1e6
    return host, synced


@contextlib.contextmanager
def segmented(on: bool):
    old = edge_mod._OPTIONS["segmented_receivers"]
    edge_mod._OPTIONS["segmented_receivers"] = on
    try:
        yield
    finally:
        edge_mod._OPTIONS["segmented_receivers"] = old


def building_blocks(device) -> list[dict]:
    """Host cost of the pieces every call is made of, at 1e4 edges (kernels of a few µs)."""
    rows = []
    e = 10**4 // SCALE["edges"]
    d = torch.rand(e, device=device) * 5
    out = torch.empty(e, N_RBF, device=device)

    class Noop(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            return g

    x = d.clone().requires_grad_(True)
    go = torch.ones_like(x)
    pieces = {
        "torch.empty": lambda: torch.empty(e, N_RBF, device=device),
        "torch.zeros": lambda: torch.zeros(e, 3, device=device),
        "x.contiguous()": lambda: d.contiguous(),
        "autograd.Function.apply (no-op)": lambda: Noop.apply(x),
        "apply + autograd.grad (no-op)": lambda: torch.autograd.grad(Noop.apply(x), x, go),
    }
    plan = rbf_mod._plan_for(d, (N_RBF, CUTOFF, "bessel", "cosine"), 2048)
    consts, _ = plan
    grid = (e + consts["BLOCK_E"] - 1) // consts["BLOCK_E"]
    kern = rbf_mod._rbf_cutoff_fwd_kernel
    pieces["rbf fwd kernel[grid](...)"] = lambda: kern[(grid,)](d, out, e, num_warps=4, **consts)
    pieces["rbf plan lookup"] = lambda: rbf_mod._plan_for(d, (N_RBF, CUTOFF, "bessel", "cosine"), 2048)
    for name, fn in pieces.items():
        h, s = host_time(fn)
        rows.append({"section": "blocks", "name": name, "host_us": h, "synced_us": s})
        print(f"  {name:36s} host {h:7.1f} µs   synced {s:7.1f} µs", flush=True)
    return rows


def op_host_times(device) -> list[dict]:
    """Host and synced µs per call of each op (fwd, fwd+bwd) vs the eager reference."""
    rows = []
    for n_edges in (10**4 // SCALE["edges"], 10**6 // SCALE["edges"]):
        for bench, variant in BENCHES:
            case = make_case(bench, variant, n_edges, torch.float32, device)
            for mode in ("fwd", "fwd+bwd"):
                for impl in ("triton", "eager"):
                    closure, _ = mode_fn(case, case.fns[impl], mode)
                    h, s = host_time(closure, n=150)
                    label = impl
                    rows.append(
                        {
                            "section": "ops",
                            "bench": bench,
                            "variant": variant,
                            "mode": mode,
                            "n_edges": n_edges,
                            "impl": label,
                            "host_us": h,
                            "synced_us": s,
                        }
                    )
                    print(
                        f"  {bench:13s} {variant:19s} {mode:8s} {n_edges:7.0e} {label:18s} "
                        f"host {h:7.1f} µs  synced {s:7.1f} µs",
                        flush=True,
                    )
            del case
    return rows


def kernel_times(device) -> list[dict]:
    """Device time per CUDA kernel of one fwd+bwd at 1e6 edges (mean over 20 iterations)."""
    from torch.profiler import ProfilerActivity, profile

    rows = []
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for bench, variant in BENCHES:
        case = make_case(bench, variant, 10**6 // SCALE["edges"], torch.float32, device)
        for seg in (True, False) if bench != "rbf_cutoff" else (True,):
            with segmented(seg):
                closure, _ = mode_fn(case, case.fns["triton"], "fwd+bwd")
                for _ in range(5):
                    closure()
                sync()
                with profile(activities=activities) as prof:
                    for _ in range(20):
                        closure()
                    sync()
            for ev in prof.key_averages():
                dev_us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
                if dev_us <= 0 or ev.key.startswith("cuda") or ev.key.startswith("aten::"):
                    continue
                rows.append(
                    {
                        "section": "kernels",
                        "bench": bench,
                        "variant": variant,
                        "segmented": seg,
                        "kernel": ev.key[:60],
                        "calls_per_iter": ev.count / 20,
                        "device_us_per_iter": dev_us / 20,
                    }
                )
                print(
                    f"  {bench:13s} {variant:19s} seg={seg!s:5s} {ev.key[:48]:48s} "
                    f"x{ev.count / 20:.0f}  {dev_us / 20:8.1f} µs",
                    flush=True,
                )
        del case
    return rows


def bench_times(device, env, rep_ms: float) -> list[dict]:
    """The benchmark's measure (do_bench median, L2 flushed) for each implementation choice."""
    rows = []
    for n_edges in (10**4 // SCALE["edges"], 10**5 // SCALE["edges"], 10**6 // SCALE["edges"]):
        for bench, variant in BENCHES:
            case = make_case(bench, variant, n_edges, torch.float32, device)
            for mode in ("fwd", "fwd+bwd"):
                choices = [("eager", True), ("triton", True)]
                if bench != "rbf_cutoff" and mode == "fwd+bwd":
                    choices.append(("triton", False))
                times = {}
                for impl, seg in choices:
                    with segmented(seg):
                        closure, nbytes = mode_fn(case, case.fns[impl], mode)
                        t = time_fn(closure, device, rep_ms=rep_ms)
                    label = impl if impl == "eager" else f"triton seg={seg}"
                    times[label] = t.median_us
                    gbps = nbytes / (t.median_us * 1e-6) / 1e9
                    rows.append(
                        {
                            "section": "bench",
                            "bench": bench,
                            "variant": variant,
                            "mode": mode,
                            "n_edges": n_edges,
                            "impl": label,
                            "median_us": t.median_us,
                            "frac_copy_bw": gbps / env.copy_gbps,
                            "vs_eager": None,
                        }
                    )
                for r in rows[-len(choices) :]:
                    r["vs_eager"] = times["eager"] / r["median_us"]
                    print(
                        f"  {bench:13s} {variant:19s} {mode:8s} {n_edges:7.0e} {r['impl']:28s} "
                        f"{r['median_us']:8.1f} µs  {100 * r['frac_copy_bw']:4.0f}% copy  "
                        f"{r['vs_eager']:5.2f}x eager",
                        flush=True,
                    )
            del case
    return rows


def python_profile(device) -> str:
    """cProfile of 300 edge_features fwd+bwd calls at 1e4 edges: where the host time goes."""
    case = make_case("edge_features", "-", 10**4 // SCALE["edges"], torch.float32, device)
    closure, _ = mode_fn(case, case.fns["triton"], "fwd+bwd")
    for _ in range(20):
        closure()
    sync()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(300 // SCALE["reps"]):
        closure()
    prof.disable()
    sync()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(18)
    return buf.getvalue()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--rep-ms", type=float, default=60.0, help="do_bench budget per measurement (ms)")
    p.add_argument(
        "--sections", nargs="+", default=["blocks", "ops", "kernels", "bench", "cprofile"], help="what to run"
    )
    p.add_argument("--cpu-smoke", action="store_true", help=argparse.SUPPRESS)  # exercise the script on CPU
    args = p.parse_args(argv)
    if torch.cuda.is_available():
        device = torch.device("cuda")
    elif args.cpu_smoke:
        device = torch.device("cpu")
        SCALE.update(edges=1000, reps=100)
        args.rep_ms = 5
    else:
        print("profile_kernels.py profiles the Triton kernels on a CUDA GPU; none here.", file=sys.stderr)
        return 2
    set_backend("triton")
    torch.manual_seed(0)
    copy_bytes = (1 << 30) if device.type == "cuda" else (1 << 22)
    env = environment(device, copy_bandwidth(device, nbytes=copy_bytes))
    print(f"{env.device} · torch {env.torch} · triton {env.triton} · commit {env.commit}")
    print(f"copy bandwidth {env.copy_gbps:.0f} GB/s")
    rows, text = [], ""
    sections = {
        "blocks": building_blocks,
        "ops": op_host_times,
        "kernels": kernel_times,
    }
    for name in args.sections:
        print(f"\n== {name}", flush=True)
        try:
            if name in sections:
                rows += sections[name](device)
            elif name == "bench":
                rows += bench_times(device, env, args.rep_ms)
            elif name == "cprofile":
                text = python_profile(device)
                print(text)
        except Exception as exc:  # keep the other sections' numbers when one fails
            print(f"  section {name} failed: {exc!r}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    tag = env.device.replace(" ", "_").lower()
    out = args.out / f"profile_kernels_{tag}.json"
    out.write_text(
        json.dumps(
            {
                "env": {k: getattr(env, k) for k in ("device", "torch", "triton", "commit", "copy_gbps")},
                "rows": rows,
                "cprofile": text,
            },
            indent=1,
        )
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
