"""The step with its kernels' counts unspecialised (shipped) against Triton's default specialisation (a probe, GPU).

Since stop 42 the kernels take their edge and atom counts, the edge list's row stride and a few size-dependent
pointers unspecialised (``kernels/_triton_utils.unspecialized``): a batch of a new size no longer compiles them
again. Triton's default knows more about those values (divisibility by 16, 16-byte alignment) and may emit wider
loads. This probe times the step both ways. The switch ``MLFF_DISTILLER_SPECIALIZE_COUNTS=1`` is read when the
kernels are defined, so each side runs in its own process; the processes alternate (A B A B ...), all sharing one
Triton cache, and each prints the medians of ``triton.testing.do_bench`` per system (a CUDA-graph replay unless the
system is given as ``name:eager``).

    python benchmarks/probe_specialize_counts.py --rounds 2 --out benchmarks/results --name probe_specialize_counts
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

DEFAULT_SYSTEMS = "benzene,g2x1024,g2x4096,water3000,water24000:eager"


def child(systems: list[str]) -> dict:
    import torch
    import triton
    from probe_ncu import step, structures

    device = torch.device("cuda")
    out = {}
    for spec in systems:
        name, _, mode = spec.partition(":")
        atoms, model = structures(name)
        run = step(name, atoms, model.to(device), device, mode or "cudagraph")
        run()
        out[spec] = triton.testing.do_bench(run, warmup=50, rep=400, return_mode="median")
        del run
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> list[str]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--systems", default=DEFAULT_SYSTEMS)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--name", default="probe_specialize_counts")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    if args.child:
        print("RESULT " + json.dumps(child(systems)), flush=True)
        return []

    import torch
    from harness import environment, write_lines

    env = environment(torch.device("cuda"), 0.0)
    runs: dict[str, list[dict]] = {"0": [], "1": []}
    for r in range(args.rounds):
        for switch in ("0", "1") if r % 2 == 0 else ("1", "0"):
            t0 = time.perf_counter()
            done = subprocess.run(
                [sys.executable, __file__, "--child", "--systems", args.systems],
                env={**os.environ, "MLFF_DISTILLER_SPECIALIZE_COUNTS": switch},
                capture_output=True,
                text=True,
            )
            line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
            if done.returncode != 0 or not line:
                raise RuntimeError(f"child (switch {switch}) failed:\n{done.stderr[-3000:]}")
            runs[switch].append(json.loads(line[-1][7:]))
            print(f"round {r} switch {switch}: {time.perf_counter() - t0:.1f} s {runs[switch][-1]}", flush=True)
    lines = [
        "# Kernels with counts unspecialised (shipped) against Triton's default (probe_specialize_counts.py)",
        "",
        f"{env.device} · torch {env.torch} · Triton {env.triton} · commit {env.commit}",
        "",
        f"Median ms of `triton.testing.do_bench` (step alone, CUDA-graph replay unless `:eager`), {args.rounds} "
        "processes per side, alternating; ratio = specialised / unspecialised (> 1: the shipped unspecialised "
        "kernels are faster).",
        "",
        "| system | unspecialised (shipped), runs | specialised (Triton default), runs | ratio of medians |",
        "|---|---|---|---:|",
    ]
    import statistics

    for spec in systems:
        a = [r[spec] for r in runs["0"]]
        b = [r[spec] for r in runs["1"]]
        ratio = statistics.median(b) / statistics.median(a)
        fa, fb = ", ".join(f"{x:.4f}" for x in a), ", ".join(f"{x:.4f}" for x in b)
        lines.append(f"| {spec} | {fa} | {fb} | {ratio:.3f} |")
    write_lines(lines, args.out, args.name)
    print("\n".join(lines))
    return lines


if __name__ == "__main__":
    main()
