"""What it costs programs of one launch to exchange a feature vector through global memory (GPU only).

The 128 x 3 student's dense step (``kernels/dense_step.py``) runs one program per atom, and each program does 4x the
64-wide student's node products: 154.7 µs for benzene against the model's captured step's 157 (stop 73), where the
64-wide step takes 48 µs. Splitting each atom's features over S programs (each the output columns ``F / S`` of every
product) brings a program's products back to the 64-wide one's, but every product in a chain reads the whole input
vector: the S programs of an atom must exchange their column blocks between the products of one launch (five times
in a forward launch: after the messages, U/V, M1, the update, W1). This probe measures one such exchange:

each of ``G x S`` programs writes its ``F / S`` floats, a barrier of its warps, one release atomic on its group's
counter, a spin on an acquire read of it until all S have arrived, then it reads the group's ``F`` floats (L2, not
L1) and makes its next block from them; ``ROUNDS`` times in one launch (double-buffered rows: a program can be one
round ahead of a partner, never two). Timed as a CUDA graph of ``--launches`` launches back to back (median replay),
against the same kernel with ``ROUNDS = 0``; the exchange's cost is the difference over the rounds. A launch
boundary (the other way to exchange, one more graph node) is measured beside it: an empty-bodied launch per round.

Every program of a launch must be resident at once (spinning programs wait for partners): ``G x S`` is kept at or
below the SM count (one program per SM at 8 warps). The values are checked against a torch model of the rounds.

    python benchmarks/probe_cta_exchange.py [--groups 16] [--splits 2,4] [--features 128] [--rounds 0,8,32]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import triton
import triton.language as tl
from harness import capture_graph


@triton.jit
def _exchange_kernel(buf, flags, x_ptr, out_ptr, G, ROUNDS: tl.constexpr, S: tl.constexpr, F: tl.constexpr):
    g = tl.program_id(0)
    s = tl.program_id(1)
    B: tl.constexpr = F // S
    cols = s * B + tl.arange(0, B)
    every = tl.arange(0, F)
    x = tl.load(x_ptr + g * F + cols)
    for r in range(ROUNDS):
        row = buf + ((r % 2) * G + g) * F
        tl.store(row + cols, x)
        tl.debug_barrier()  # every warp's store issued before the release below
        tl.atomic_add(flags + g, 1, sem="release", scope="gpu")
        target = S * (r + 1)
        seen = tl.atomic_add(flags + g, 0, sem="acquire", scope="gpu")
        while seen < target:
            seen = tl.atomic_add(flags + g, 0, sem="acquire", scope="gpu")
        full = tl.load(row + every, cache_modifier=".cg")
        # the next block from the whole vector (as a product would read it): a rotation less the vector's mean, plus
        # one (the mean stays 1: bounded values over any number of rounds)
        x = tl.load(row + (cols + 1) % F, cache_modifier=".cg") - tl.sum(full, axis=0) / F + 1.0
    tl.store(out_ptr + g * F + cols, x)


@triton.jit
def _empty_kernel(x_ptr, out_ptr, F: tl.constexpr):
    g = tl.program_id(0)
    cols = tl.arange(0, F)
    tl.store(out_ptr + g * F + cols, tl.load(x_ptr + g * F + cols) + 1.0)


def reference(x: torch.Tensor, rounds: int) -> torch.Tensor:
    x = x.double()
    for _ in range(rounds):
        x = torch.roll(x, -1, dims=1) - x.mean(dim=1, keepdim=True) + 1.0
    return x


def replay_us(fn, launches: int, reps: int = 50) -> float:
    """Median µs of one launch: a CUDA graph of ``launches`` calls of ``fn`` (``harness.capture_graph``), replayed
    ``reps`` times."""
    graph = capture_graph(fn, calls=launches)
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / launches)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> list[str]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--groups", type=int, default=16, help="atoms (groups of S programs)")
    p.add_argument("--splits", default="2,4")
    p.add_argument("--features", type=int, default=128)
    p.add_argument("--rounds", default="0,8,32")
    p.add_argument("--warps", type=int, default=8)
    p.add_argument("--launches", type=int, default=20)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_cta_exchange needs CUDA (its programs spin on each other: the Triton interpreter runs them one "
              "after the other)")  # fmt: skip
        return []
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    g, f = args.groups, args.features
    rounds = [int(r) for r in args.rounds.split(",")]
    lines = [
        f"# Exchanges between the programs of one launch through global memory: {torch.cuda.get_device_name(dev)}, "
        f"torch {torch.__version__}, triton {triton.__version__}, {sms} SMs",
        "",
        f"{g} groups, {f} features, {args.warps} warps a program; µs per launch, the median replay of a graph of "
        f"{args.launches} launches. Max |error| against a float64 torch model of the rounds.",
        "",
        "| S (programs a group) | programs | rounds | µs a launch | µs an exchange (vs 0 rounds) | max abs err |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(g, f, device=dev, generator=gen)
    for s in [int(v) for v in args.splits.split(",")]:
        if g * s > sms:
            lines.append(f"| {s} | {g * s} | - | skipped: more programs than SMs ({sms}) | | |")
            continue
        base = None
        for r in rounds:
            buf = torch.empty(2 * g * f, device=dev)
            flags = torch.zeros(g, dtype=torch.int32, device=dev)
            out = torch.empty_like(x)

            def launch(r=r, buf=buf, flags=flags, out=out, s=s):
                flags.zero_()
                _exchange_kernel[(g, s)](buf, flags, x, out, g, ROUNDS=r, S=s, F=f, num_warps=args.warps)

            launch()
            torch.cuda.synchronize()
            err = float((out.double() - reference(x, r)).abs().max())
            us = replay_us(launch, args.launches)
            if r == 0:
                base = us
            per = "" if r == 0 or base is None else f"{(us - base) / r:.3f}"
            lines.append(f"| {s} | {g * s} | {r} | {us:.2f} | {per} | {err:.1e} |")
    out = torch.empty_like(x)
    for n in (1, 8):

        def empties(n=n):
            for _ in range(n):
                _empty_kernel[(g,)](x, out, F=f, num_warps=args.warps)

        us = replay_us(empties, args.launches)
        lines.append(
            f"\nA launch boundary instead: {n} small launch(es) of {g} programs in a graph: {us:.2f} µs "
            f"({us / n:.2f} µs a launch; the rows above include one zero fill's node a launch)"
        )
    print("\n".join(lines))
    return lines


if __name__ == "__main__":
    main()
