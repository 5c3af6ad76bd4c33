"""Where a Verlet-list rebuild of a BatchedMD step goes: N g2 molecules, positions on the GPU.

    python benchmarks/probe_batched_rebuild.py --out results/ [--sizes 1,64,1024,4096]

Per size: the engine call with the list kept and with a rebuild (``verlet.reset()``), the neighbour list alone on
the device (``neighbor_list``) and on the host (``molecular_pairs`` after a copy of the positions), and a
torch.profiler table of one rebuilt call (host time per op). Writes ``<out>/probe_batched_rebuild.md``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import environment, sync, write_lines


def timed(fn, device, reps: int = 7) -> float:
    fn()
    out = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("results"))
    ap.add_argument("--sizes", default="1,64,1024,4096")
    ap.add_argument("--profile-size", type=int, default=1024)
    args = ap.parse_args()
    from mlff_distiller import load_model
    from mlff_distiller.batched_md import BatchedMD
    from mlff_distiller.distill.seeds import g2_chno
    from mlff_distiller.neighbors import neighbor_list
    from mlff_distiller.neighbors.molecular import molecular_pairs

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    env = environment(device, 0.0)
    model = load_model("builtin:chno-gfn2")
    pool = g2_chno()
    lines = [
        "# probe_batched_rebuild.py: a Verlet-list rebuild in a BatchedMD step",
        "",
        f"{env.device} · torch {env.torch} · Triton {env.triton} · commit {env.commit} · host {env.host}",
        "",
        "ms, median of 7 synchronised calls; N g2 molecules (closed-shell CHNO, cycled), 1 Å skin, fp32.",
        "",
        "| molecules | atoms | engine call, list kept | engine call, rebuilt | device list | host list + copy |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for n in [int(x) for x in args.sizes.split(",") if x]:
        md = BatchedMD(model, [pool[k % len(pool)] for k in range(n)], device=device, seed=0)
        md.run(20)
        b = md._batch
        eng = md.engine
        cut = model.cutoff + eng.verlet.skin
        kept = timed(lambda eng=eng, b=b: eng.compute(b), device)

        def rebuilt(eng=eng, b=b):
            eng.verlet.reset()
            eng.compute(b)

        full = timed(rebuilt, device)
        dev = timed(lambda b=b, cut=cut: neighbor_list(b.positions, b.cell, b.pbc, b.batch, b.ptr, cut), device)
        ptr_host = b.ptr.cpu()

        def host(b=b, ptr_host=ptr_host, cut=cut):
            nl = molecular_pairs(b.positions.cpu(), ptr_host, cut)
            nl.edge_index.to(device, non_blocking=True)

        hst = timed(host, device)
        atoms = b.num_atoms
        lines.append(f"| {n} | {atoms} | {kept:.3f} | {full:.3f} | {dev:.3f} | {hst:.3f} |")
        print(lines[-1], flush=True)
        if n == 1:  # the device list alone, where its fixed cost shows
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            with profile(activities=acts) as prof:
                for _ in range(3):
                    neighbor_list(b.positions, b.cell, b.pbc, b.batch, b.ptr, cut)
                sync(device)
            table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=25)
            lines += ["", "torch.profiler, 3 device lists of one molecule:", "", "```", table, "```", ""]
        if n == args.profile_size:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            with profile(activities=acts) as prof:
                for _ in range(3):
                    rebuilt()
                sync(device)
            table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=30)
            title = f"torch.profiler, 3 rebuilt calls at {n} molecules, by host time:"
            lines += ["", title, "", "```", table, "```", ""]
    write_lines(lines, args.out, "probe_batched_rebuild")


if __name__ == "__main__":
    main()
