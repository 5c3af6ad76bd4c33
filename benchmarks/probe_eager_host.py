"""Probe (GPU): how much of a large eager step is the host's, and what a captured step of the same box costs.

Stop 51 found the 64-wide student's 24,000-atom water step (eager, as mode "auto" runs it beyond ``AUTO_MAX_EDGES``)
at 9.5-11.9 ms on an H200 whose kernels summed to 7.7 ms (``results/stop51_gpu/profile_large_h64.txt``), while the
128-wide student's kernels (14.9 ms) covered its wall time. Per student width and water box this probe reports, on
a graph prepared once (``peers.StepImpl``, the rows of ``bench_large.py`` and ``probe_student_size.py``):

* the eager step's wall median (``triton.testing.do_bench``, synchronised) and the host's own time per step (the
  calls' wall time without a synchronisation in between, over ``--host-reps`` calls, divided by the count: when
  the host is slower than the device this approaches the wall time);
* the captured step (mode "cudagraph", its default ladder up to 2^21 edges), the same box padded into its bucket;
* a cProfile table (internal time) of ``--host-reps`` eager steps: where the host's time goes.

    python benchmarks/probe_eager_host.py --hidden 64,128 --atoms 3000,24000 --out DIR [--name NAME]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import host_us, write_lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", default="64,128")
    ap.add_argument("--atoms", default="3000,24000")
    ap.add_argument("--host-reps", type=int, default=20)
    ap.add_argument("--profile-rows", type=int, default=25)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default="probe_eager_host")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_eager_host: needs a CUDA device")
        return 0
    import triton
    from peers import StepImpl, make_student
    from systems import water_box

    rows, profiles = [], []
    for hidden in (int(h) for h in args.hidden.split(",")):
        model = make_student(hidden=hidden)
        for n in (int(a) for a in args.atoms.split(",")):
            atoms = water_box(n, seed=0)
            row = {"hidden": hidden, "atoms": n}
            for mode in ("eager", "cudagraph"):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    impl = StepImpl(mode, "ours", model, "cuda", mode=mode)
                    run = impl.prepare([atoms], True)
                    run()
                    run()
                torch.cuda.synchronize()
                row[mode] = triton.testing.do_bench(run, warmup=50, rep=300, return_mode="median") * 1e3
                row[f"{mode}_host"] = host_us(run, args.host_reps)
                if mode == "eager":
                    prof = cProfile.Profile()
                    torch.cuda.synchronize()
                    prof.enable()
                    for _ in range(args.host_reps):
                        run()
                    prof.disable()
                    torch.cuda.synchronize()
                    buf = io.StringIO()
                    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(args.profile_rows)
                    profiles.append(f"\n===== hidden {hidden}, {n} water atoms, {args.host_reps} eager steps\n")
                    profiles.append(buf.getvalue())
                else:
                    engine = impl.engine
                    buckets = list(getattr(engine, "_runners", {}))
                    row["bucket"] = str(buckets[0]) if buckets else "none (eager: beyond the ladder)"
                del impl, run
                torch.cuda.empty_cache()
            rows.append(row)
            print(row, flush=True)
    lines = [
        "# probe_eager_host.py: the host's share of a large eager step, and the captured step of the same box",
        "",
        f"{torch.cuda.get_device_name()} · torch {torch.__version__} · triton {triton.__version__} · random-weight "
        "students (peers.make_student), float32, water boxes (systems.water_box), the step alone on a prepared graph",
        "",
        "| hidden | water atoms | eager µs (do_bench) | eager host µs per call | captured µs (do_bench) | "
        "captured host µs per call | eager / captured | bucket |",
        "|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['hidden']} | {r['atoms']:,} | {r['eager']:.0f} | {r['eager_host']:.0f} | {r['cudagraph']:.0f} | "
            f"{r['cudagraph_host']:.0f} | {r['eager'] / r['cudagraph']:.3f} | {r.get('bucket', '')} |"
        )
    lines.append("")
    lines.append("## cProfile of the eager steps (internal time)")
    lines.append("```")
    lines.extend("".join(profiles).splitlines())
    lines.append("```")
    write_lines(lines, Path(args.out), args.name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
