"""Where a neighbour-list call spends its time on the GPU: wall clock vs device kernels, kernel by kernel.

    python benchmarks/profile_neighbors.py --out DIR     # GPU: ~1 minute

Cases (issue 7's neighbour-list targets): one 24,000-atom water box and 1,024 periodic 24-atom water boxes in
one batched call, 5 Å. For each backend that runs here (our Triton cell list; vesin-torch converted to our
contract, and vesin's raw list, when installed; ours with CUDA-graph replay, "fresh" and "clone" outputs, and
without, for an A/B): the median wall time of a full call (host to host, synchronised),
the sum of its device kernel times from ``torch.profiler`` and the kernels that take the most device time. Wall
minus device is host time (Python, launches, syncs) not hidden behind kernels.
"""

# ruff: noqa: B023  (closures are called inside the loop iteration that made them)
from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from systems import water_box

from mlff_distiller.batch import AtomsBatch
from mlff_distiller.neighbors import neighbor_list
from mlff_distiller.neighbors.vesin_backend import _vesin_class, vesin_available

CUTOFF = 5.0


# The periodic Triton path with and without CUDA-graph replay (cell_list_triton, "CUDA graphs"), A/B: "graph
# fresh" (row sort launched after the replay into new capacity outputs) is the default; "graph clone" (row sort in
# the graph, exact copies after the sync); "no graph" is the plain speculative path.
TRITON_VARIANTS = {"graph fresh": (True, "fresh"), "graph clone": (True, "clone"), "no graph": (False, "fresh")}


def triton_call(args_nl, graphs: bool, mode: str):
    """A call of our Triton cell list with the module's graph switch and output mode set for it."""
    clt = importlib.import_module("mlff_distiller.neighbors.cell_list_triton")  # the package exports a function

    def call():
        clt.CUDA_GRAPHS, clt.GRAPH_OUTPUTS = graphs, mode
        try:
            return neighbor_list(*args_nl, method="cell_list", cell_list_impl="triton")
        finally:
            clt.CUDA_GRAPHS, clt.GRAPH_OUTPUTS = True, "fresh"

    return call


def wall_ms(fn, reps: int) -> tuple[float, float, float]:
    """Median, p20 and p80 of ``reps`` synchronised calls, ms."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - t0))
    times.sort()
    return statistics.median(times), times[len(times) // 5], times[(4 * len(times)) // 5]


def kernel_table(fn, reps: int = 5, top: int = 12):
    """Device µs per call summed over all kernels, the ``top`` kernels (name, µs per call, launches per call) and
    the ``top`` host-side ops by self CPU time (name, µs per call, calls per call), from torch.profiler over
    ``reps`` calls (the profiler's own overhead inflates the host times)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    rows, host = {}, {}
    for evt in prof.events():
        name = evt.name[:70]
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            us, n = rows.get(name, (0.0, 0))
            rows[name] = (us + evt.device_time, n + 1)
        else:
            us, n = host.get(name, (0.0, 0))
            host[name] = (us + evt.self_cpu_time_total, n + 1)
    total = sum(us for us, _ in rows.values()) / reps

    def ranked(table):
        best = sorted(table.items(), key=lambda kv: -kv[1][0])[:top]
        return [(name, us / reps, n // reps) for name, (us, n) in best]

    return total, ranked(rows), ranked(host)


def memory_mib(fn) -> tuple[float, float]:
    """GPU memory of one call, MiB: the peak above what was allocated before it, and what its result holds (the
    speculative Triton path returns prefixes of capacity buffers, so this is more than the list's own bytes)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = fn()
    torch.cuda.synchronize()
    peak, held = torch.cuda.max_memory_allocated() - before, torch.cuda.memory_allocated() - before
    del result
    return peak / 2**20, held / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".", help="folder for profile_neighbors.txt and .json")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    import triton

    lines = [
        f"# Neighbour-list profile: {torch.cuda.get_device_name()} · torch {torch.__version__} · triton "
        f"{triton.__version__} · cutoff {CUTOFF} Å",
        "",
    ]
    cases = {
        "1 box, 24000 atoms": [water_box(24000)],
        "1024 boxes x 24 atoms": [water_box(24, seed=k) for k in range(1024)],
    }
    records = []
    for case, structures in cases.items():
        b = AtomsBatch.from_atoms(structures).to(dev)
        args_nl = (b.positions, b.cell, b.pbc, b.batch, b.ptr, CUTOFF)
        impls = {
            f"triton cell list, {label}": triton_call(args_nl, graphs, mode)
            for label, (graphs, mode) in TRITON_VARIANTS.items()
        }
        if vesin_available() and len(structures) == 1:
            impls["vesin, our contract"] = lambda: neighbor_list(*args_nl, method="vesin")
            calc = _vesin_class()(cutoff=CUTOFF, full_list=True)
            pos64, cell64 = b.positions.double(), b.cell[0].double()
            impls["vesin raw i,j,S"] = lambda: calc.compute(pos64, cell64, True, "ijS", copy=False)
        for name, fn in impls.items():
            for _ in range(3):
                fn()
            med, p20, p80 = wall_ms(fn, args.reps)
            device_us, top, host_top = kernel_table(fn)
            peak_mib, held_mib = memory_mib(fn)
            rec = dict(case=case, impl=name, wall_ms=med, p20=p20, p80=p80, device_us=device_us, top=top, host=host_top)
            rec.update(peak_mib=peak_mib, held_mib=held_mib)
            records.append(rec)
            lines += [
                f"## {case}: {name}",
                f"wall median {med:.3f} ms (p20-p80 {p20:.3f}-{p80:.3f}); device kernels {device_us / 1e3:.3f} ms "
                f"per call; host not hidden {med - device_us / 1e3:.3f} ms; GPU memory: peak {peak_mib:.1f} MiB "
                f"during a call, {held_mib:.1f} MiB held by its result",
                "",
                "| kernel | µs per call | launches |",
                "|---|---:|---:|",
                *[f"| `{k}` | {us:.1f} | {n} |" for k, us, n in top],
                "",
                "| host op (self CPU, under the profiler) | µs per call | calls |",
                "|---|---:|---:|",
                *[f"| `{k}` | {us:.1f} | {n} |" for k, us, n in host_top],
                "",
            ]
            print("\n".join(lines[-(len(top) + len(host_top) + 8) :]), flush=True)
    lines += ["## Summary: wall median / device kernels (ms)", "", "| case | impl | wall | p20 | device |",
              "|---|---|---:|---:|---:|"]  # fmt: skip
    lines += [f"| {r['case']} | {r['impl']} | {r['wall_ms']:.3f} | {r['p20']:.3f} | {r['device_us'] / 1e3:.3f} |"
              for r in records]  # fmt: skip
    print("\n".join(lines[-len(records) - 4 :]), flush=True)
    (out / "profile_neighbors.txt").write_text("\n".join(lines) + "\n")
    (out / "profile_neighbors.json").write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
