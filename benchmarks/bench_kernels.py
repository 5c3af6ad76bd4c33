"""Benchmark the Triton kernels against their torch references, eager and torch.compile'd, in one run (GPU).

For each kernel (rbf_cutoff, edge_features, edge_basis), size (1e4 … 1e7 edges) and mode (fwd, fwd+bwd;
--double adds the force-training double backward) it records the median time and quantiles, the achieved
bandwidth over the minimal traffic (inputs read once, outputs written once), that bandwidth as a fraction of
the device-to-device copy bandwidth measured in the same run, and the speed-up over each reference. Rows are
appended to <out>/bench_kernels.jsonl and the run's table is written to <out>/bench_kernels.md.

    python benchmarks/bench_kernels.py                 # full run
    python benchmarks/bench_kernels.py --quick         # 1e4 and 1e6 edges, one variant per kernel
    python benchmarks/bench_kernels.py --tune          # also sweep tile size x warps at 1e6 edges
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import BenchRow, Environment, copy_bandwidth, environment, time_fn, time_graph, write_results
from mlff_distiller.kernels import (
    edge_basis,
    edge_basis_reference,
    edge_features,
    edge_features_reference,
    rbf_cutoff,
    rbf_cutoff_reference,
    set_backend,
)

CUTOFF = 5.0
N_RBF = 20
NEIGHBOURS = 24  # edges per atom in the random graphs


@dataclasses.dataclass
class Case:
    """One kernel × variant × size: inputs built once, the three implementations as forward functions."""

    bench: str
    variant: str
    n_edges: int
    dtype: torch.dtype
    inputs: dict  # name -> tensor; the differentiable ones are listed in ``wrt``
    wrt: tuple[str, ...]
    fns: dict[str, Callable]  # impl -> f(**inputs) -> tensor or tuple of tensors
    fwd_bytes: int  # minimal forward traffic
    out_bytes: int  # bytes of the forward outputs (= the upstream gradients read by the backward)
    grad_bytes: int  # bytes of the gradients the backward writes


# Suffix of the implementations timed as CUDA-graph replays (device time; see harness.time_graph).
GRAPH = "@graph"


def _graph(n_edges: int, dtype: torch.dtype, device: torch.device):
    """Atoms in a box at liquid-like density; receivers sorted (as neighbour lists are), senders random."""
    n_atoms = max(16, n_edges // NEIGHBOURS)
    box = (n_atoms / 0.1) ** (1 / 3)
    pos = torch.rand(n_atoms, 3, dtype=dtype, device=device) * box
    i = torch.randint(0, n_atoms, (n_edges,), device=device).sort().values
    j = torch.randint(0, n_atoms, (n_edges,), device=device)
    ei = torch.stack([i, j])
    shifts = torch.zeros(n_edges, 3, dtype=dtype, device=device)
    periodic = torch.rand(n_edges, device=device) < 0.3
    shifts[periodic] = box * torch.randint(-1, 2, (int(periodic.sum()), 3), device=device).to(dtype)
    return pos, ei, shifts


def make_case(bench: str, variant: str, n_edges: int, dtype: torch.dtype, device: torch.device) -> Case:
    s = torch.finfo(dtype).bits // 8
    if bench == "rbf_cutoff":
        basis, envelope = variant.split("/")
        d = torch.empty(n_edges, dtype=dtype, device=device).uniform_(0.5, 5.5)

        def ref(dist):
            return rbf_cutoff_reference(dist, N_RBF, CUTOFF, basis, envelope)

        def tri(dist):
            return rbf_cutoff(dist, N_RBF, CUTOFF, basis, envelope)

        return Case(
            bench,
            variant,
            n_edges,
            dtype,
            {"dist": d},
            ("dist",),
            {"triton": tri, "eager": ref},
            fwd_bytes=s * n_edges * (1 + N_RBF),
            out_bytes=s * n_edges * N_RBF,
            grad_bytes=s * n_edges,
        )

    pos, ei, shifts = _graph(n_edges, dtype, device)
    inputs = {"positions": pos, "edge_index": ei, "shift_vectors": shifts}
    in_bytes = pos.numel() * s + ei.numel() * ei.element_size() + shifts.numel() * s
    grad_bytes = (pos.numel() + shifts.numel()) * s
    if bench == "edge_features":
        fns = {"triton": edge_features, "eager": edge_features_reference}
        out_bytes = s * n_edges * 7
    else:
        basis, envelope = variant.split("/")

        def ref(positions, edge_index, shift_vectors):
            return edge_basis_reference(positions, edge_index, shift_vectors, N_RBF, CUTOFF, basis, envelope)

        def tri(positions, edge_index, shift_vectors):
            return edge_basis(positions, edge_index, shift_vectors, N_RBF, CUTOFF, basis, envelope)

        fns = {"triton": tri, "eager": ref}
        out_bytes = s * n_edges * (4 + N_RBF)
    return Case(
        bench,
        variant,
        n_edges,
        dtype,
        inputs,
        ("positions", "shift_vectors"),
        fns,
        fwd_bytes=in_bytes + out_bytes,
        out_bytes=out_bytes,
        grad_bytes=grad_bytes,
    )


def _as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def mode_fn(case: Case, fn: Callable, mode: str) -> tuple[Callable[[], object], int]:
    """The timed closure of ``mode`` and its minimal traffic in bytes."""
    inputs = {k: (v.detach().requires_grad_(k in case.wrt) if mode != "fwd" else v) for k, v in case.inputs.items()}
    wrt = [inputs[k] for k in case.wrt]
    if mode == "fwd":
        return (lambda: fn(**inputs)), case.fwd_bytes
    outs = _as_tuple(fn(**inputs))
    grads_out = [torch.randn_like(o) for o in outs]
    if mode == "fwd+bwd":

        def run():
            return torch.autograd.grad(_as_tuple(fn(**inputs)), wrt, grads_out)

        # inputs + upstream gradients read once; outputs + input gradients written once
        return run, case.fwd_bytes + case.out_bytes + case.grad_bytes
    # double: forward, first gradients with create_graph (forces), then the gradient of a loss on them
    weights = [torch.randn_like(w) for w in wrt]

    def run_double():
        g = torch.autograd.grad(_as_tuple(fn(**inputs)), wrt, grads_out, create_graph=True)
        return torch.autograd.grad(sum((a * b).sum() for a, b in zip(g, weights, strict=True)), wrt)

    return run_double, case.fwd_bytes + case.out_bytes + 3 * case.grad_bytes


def run_case(case: Case, modes, env: Environment, device, args, compile_cache: dict) -> list[BenchRow]:
    rows = []
    for mode in modes:
        impls = dict(case.fns)
        if not args.no_compile and mode != "double":  # compiled graphs do not support double backward
            key = (case.bench, case.variant, case.n_edges if args.static_compile else None)
            if key not in compile_cache:
                compile_cache[key] = torch.compile(case.fns["eager"], dynamic=not args.static_compile)
            impls["compile"] = compile_cache[key]
        timings = {}
        for impl, fn in impls.items():
            try:
                closure, nbytes = mode_fn(case, fn, mode)
                timings[impl] = (time_fn(closure, device, rep_ms=args.rep_ms), nbytes)
                if args.graph:
                    t = time_graph(closure, device, rep_ms=args.rep_ms)
                    if t is not None:
                        timings[impl + GRAPH] = (t, nbytes)
            except torch.OutOfMemoryError:
                print(
                    f"  {case.bench} {case.variant} {mode} {case.n_edges:.0e} {impl}: out of memory",
                    flush=True,
                )
            torch.cuda.empty_cache() if device.type == "cuda" else None
        for impl, (t, nbytes) in timings.items():
            gbps = nbytes / (t.median_us * 1e-6) / 1e9
            # Speed-ups compare like with like: per-call timings with per-call ones, graph replays with replays.
            suffix = GRAPH if impl.endswith(GRAPH) else ""
            vs = {
                ref: timings[ref + suffix][0].median_us / t.median_us if ref + suffix in timings else None
                for ref in ("eager", "compile")
            }
            row = BenchRow(
                bench=case.bench,
                variant=case.variant,
                impl=impl,
                mode=mode,
                n_edges=case.n_edges,
                dtype=str(case.dtype).removeprefix("torch."),
                median_us=t.median_us,
                p20_us=t.p20_us,
                p80_us=t.p80_us,
                bytes=nbytes,
                gbps=gbps,
                frac_copy_bw=gbps / env.copy_gbps,
                vs_eager=vs["eager"],
                vs_compile=vs["compile"],
                env=env,
            )
            rows.append(row)
            print(
                f"  {row.bench:13s} {row.variant:19s} {row.mode:8s} {row.n_edges:8.0e} {row.impl:8s} "
                f"{row.median_us:10.1f} µs {row.gbps:7.0f} GB/s {100 * row.frac_copy_bw:5.0f}% copy"
                f"  vs eager {row.vs_eager or 0:6.2f}  vs compile {row.vs_compile or 0:6.2f}",
                flush=True,
            )
    return rows


def tune(env: Environment, device, dtype, args) -> list[BenchRow]:
    """Sweep the tile budget and warps of the Triton kernels at 1e6 edges (fwd and fwd+bwd)."""
    from mlff_distiller.kernels._triton_utils import tuning

    rows = []
    for bench, variant in [("rbf_cutoff", "bessel/cosine"), ("edge_features", "-"), ("edge_basis", "bessel/cosine")]:
        case = make_case(bench, variant, 10**6, dtype, device)
        for mode in ("fwd", "fwd+bwd"):
            for scale in (0.25, 0.5, 1, 2, 4):
                for warps in (2, 4, 8):
                    with tuning(block_scale=scale, num_warps=warps):
                        closure, nbytes = mode_fn(case, case.fns["triton"], mode)
                        # Tiles change device time only: timed as graph replays where possible.
                        t = time_graph(closure, device, rep_ms=args.rep_ms) or time_fn(
                            closure, device, rep_ms=args.rep_ms
                        )
                    gbps = nbytes / (t.median_us * 1e-6) / 1e9
                    rows.append(
                        BenchRow(
                            bench,
                            variant,
                            "triton",
                            mode,
                            case.n_edges,
                            str(dtype)[6:],
                            t.median_us,
                            t.p20_us,
                            t.p80_us,
                            nbytes,
                            gbps,
                            gbps / env.copy_gbps,
                            note=f"tune scale={scale} warps={warps}",
                            env=env,
                        )
                    )
                    print(
                        f"  tune {bench} {mode} scale={scale} warps={warps}: {t.median_us:.1f} µs "
                        f"({100 * gbps / env.copy_gbps:.0f}% copy)",
                        flush=True,
                    )
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1e4 and 1e6 edges, one variant per kernel, short timing")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results", help="results directory")
    p.add_argument("--name", default="bench_kernels", help="results file stem: <out>/<name>.jsonl and <out>/<name>.md")
    p.add_argument("--sizes", type=float, nargs="+", help="edge counts (default 1e4 1e5 1e6 1e7)")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    p.add_argument("--double", action="store_true", help="also time the force-training double backward")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile'd reference")
    p.add_argument("--static-compile", action="store_true", help="compile the reference per size (dynamic=False)")
    p.add_argument("--tune", action="store_true", help="also sweep tile size x warps at 1e6 edges")
    p.add_argument(
        "--graph",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time each implementation as a CUDA-graph replay (device time without the per-call host path)",
    )
    p.add_argument("--rep-ms", type=float, default=None, help="timing budget per measurement (ms)")
    p.add_argument("--cpu-smoke", action="store_true", help=argparse.SUPPRESS)  # exercise the script on CPU
    args = p.parse_args(argv)

    if torch.cuda.is_available():
        device = torch.device("cuda")
    elif args.cpu_smoke:
        device = torch.device("cpu")
    else:
        print(
            "bench_kernels.py measures the Triton kernels on a CUDA GPU and none is available here. "
            "(On a CPU the kernels run only in the Triton interpreter; tests/kernels covers that.)",
            file=sys.stderr,
        )
        return 2

    dtype = getattr(torch, args.dtype)
    sizes = (
        [int(x) for x in args.sizes]
        if args.sizes
        else ([10**4, 10**6] if args.quick else [10**k for k in (4, 5, 6, 7)])
    )
    if args.cpu_smoke:
        sizes = [int(x) for x in args.sizes] if args.sizes else [100, 1000]
    args.rep_ms = args.rep_ms or (30 if args.quick or args.cpu_smoke else 100)
    rbf_variants = ["bessel/cosine"] if args.quick else ["bessel/cosine", "gaussian/polynomial"]
    benches = [("rbf_cutoff", v) for v in rbf_variants] + [("edge_features", "-")]
    benches += [("edge_basis", v) for v in rbf_variants]
    modes = ["fwd", "fwd+bwd"] + (["double"] if args.double else [])

    set_backend("triton")
    torch.manual_seed(0)
    copy_gbps = copy_bandwidth(device, nbytes=(1 << 30) if device.type == "cuda" else (1 << 26))
    env = environment(device, copy_gbps)
    print(f"{env.device} · torch {env.torch} · triton {env.triton} · commit {env.commit}")
    print(f"device-to-device copy bandwidth: {copy_gbps:.0f} GB/s (read + write)")

    rows, compile_cache = [], {}
    for n_edges in sizes:
        for bench, variant in benches:
            if device.type == "cuda":
                free, _ = torch.cuda.mem_get_info()
                if n_edges * N_RBF * torch.finfo(dtype).bits // 8 * 12 > free:
                    print(f"  skipping {bench} at {n_edges:.0e} edges: not enough GPU memory for the references")
                    continue
            case = make_case(bench, variant, n_edges, dtype, device)
            rows += run_case(case, modes, env, device, args, compile_cache)
            del case
    if args.tune:
        rows += tune(env, device, dtype, args)

    jsonl, md = write_results(rows, args.out, args.name + ("_cpu_smoke" if args.cpu_smoke else ""))
    print(f"\nappended {len(rows)} rows to {jsonl}\nwrote {md}")
    _summary(rows)
    return 0


def _summary(rows: list[BenchRow]) -> None:
    """Targets (fp32, 1e6 edges): forward >= 60 % of copy bandwidth; fwd+bwd >= 3x eager and > compile. Each
    is printed twice when the graph timings exist: per call (host path included) and as graph replays."""
    print("\ntargets at 1e6 edges (per call; @graph: CUDA-graph replay, device time):")
    for r in rows:
        if r.impl not in ("triton", "triton" + GRAPH) or r.n_edges != 10**6 or r.note:
            continue
        tag = f"{r.bench} {r.variant} {r.mode}{' @graph' if r.impl.endswith(GRAPH) else ''}"
        if r.mode == "fwd":
            ok = r.frac_copy_bw >= 0.6
            print(f"  {'PASS' if ok else 'MISS'} {tag}: {100 * r.frac_copy_bw:.0f}% of copy bandwidth")
        if r.mode == "fwd+bwd":
            ok = (r.vs_eager or 0) >= 3 and (r.vs_compile is None or r.vs_compile > 1)
            print(
                f"  {'PASS' if ok else 'MISS'} {tag}: {r.vs_eager or math.nan:.2f}x eager, "
                f"{r.vs_compile or math.nan:.2f}x compile"
            )


if __name__ == "__main__":
    sys.exit(main())
