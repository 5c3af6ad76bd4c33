"""Probe (GPU): where a large box's call goes beyond its step, end to end (``ForceEngine.compute``).

Stop 52 measured a 128-wide student's 24,000-atom water call at 19.8 ms captured end to end
(``probe_capture_limit.md``) against ~15 ms for the replay alone (stop 51): ~5 ms of neighbour list, padding,
copies and waits. Per water box this probe reports, for the shipped engine (mode "auto"):

* the median ms of ``--calls`` calls of ``compute(batch, to_host=True)``, and of the captured step alone (a replay
  of the bucket the call used, synchronised);
* a cProfile table of ``--calls`` calls sorted by cumulative time (the host's view: a wait on the device shows in
  the call that waits, such as a copy to the host or a synchronisation);
* the device kernels of one call grouped by name (torch profiler), so the list's and the fill's device time can be
  set beside the step's.

    python benchmarks/probe_e2e_profile.py --hidden 128 --atoms 24000 --out DIR [--name NAME]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
import warnings
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import sync, write_lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--atoms", default="24000")
    ap.add_argument("--calls", type=int, default=15)
    ap.add_argument("--profile-rows", type=int, default=45)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default="probe_e2e_profile")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_e2e_profile: needs a CUDA device")
        return 0
    import triton
    from peers import make_student
    from systems import water_box
    from torch.profiler import ProfilerActivity, profile

    from mlff_distiller import AtomsBatch, ForceEngine

    device = torch.device("cuda")
    model = make_student(hidden=args.hidden)
    lines = [
        "# probe_e2e_profile.py: a large box's call end to end, beyond its step",
        "",
        f"{torch.cuda.get_device_name()} · torch {torch.__version__} · triton {triton.__version__} · random-weight "
        f"student {args.hidden} wide (peers.make_student), float32, mode auto, compute(batch, to_host=True)",
        "",
    ]
    for n in (int(a) for a in args.atoms.split(",")):
        batch = AtomsBatch.from_atoms([water_box(n, seed=0)], dtype=torch.float32)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine = ForceEngine(model, device=device, mode="auto")
            for _ in range(3):
                engine.compute(batch, to_host=True)
        times = []
        for _ in range(args.calls):
            sync(device)
            t0 = time.perf_counter()
            engine.compute(batch, to_host=True)
            times.append((time.perf_counter() - t0) * 1e3)
        bucket = engine.last_bucket
        replay = float("nan")
        if bucket is not None and bucket in engine._runners:
            runner = engine._runners[bucket]
            rt = []
            for _ in range(args.calls):
                sync(device)
                t0 = time.perf_counter()
                runner.replay()
                sync(device)
                rt.append((time.perf_counter() - t0) * 1e3)
            replay = statistics.median(rt)
        prof = cProfile.Profile()
        sync(device)
        prof.enable()
        for _ in range(args.calls):
            engine.compute(batch, to_host=True)
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(args.profile_rows)
        with profile(activities=[ProfilerActivity.CUDA]) as tp:
            engine.compute(batch, to_host=True)
            sync(device)
        groups: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        for e in tp.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                g = groups[e.name[:70]]
                g[0] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
                g[1] += 1
        total = sum(v[0] for v in groups.values())
        lines += [
            f"## {n:,} water atoms, bucket {bucket}",
            "",
            f"compute(): median **{statistics.median(times):.2f} ms** of {args.calls} calls; the captured step alone "
            f"(replay + sync): **{replay:.2f} ms**; device kernels of one call sum to {total / 1e3:.2f} ms.",
            "",
            "| device kernel (one call) | µs | launches |",
            "|---|---:|---:|",
        ]
        for name, (us, k) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:25]:
            lines.append(f"| `{name}` | {us:.0f} | {k} |")
        lines += ["", "cProfile (cumulative), the host's view:", "```", *buf.getvalue().splitlines(), "```", ""]
        print(n, statistics.median(times), replay, flush=True)
        del engine
        torch.cuda.empty_cache()
    write_lines(lines, Path(args.out), args.name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
