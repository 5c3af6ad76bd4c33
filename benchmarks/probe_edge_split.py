"""Probe (GPU): tiles and feature split of the message-passing edge backward on an MD-sized graph.

The edge backward (∂rbf, ∂u per edge) of a small graph (a 192-atom water box: ~10,000 pairs within 5 Å once the
engine drops the Verlet skin's extra pairs) runs few programs per SM; "auto" splits the features over 2, 4, ...
programs per 64-edge tile and sums the partial rows afterwards (two torch reductions per layer). This times, per
call in a CUDA graph, the edge backward with its partial sums for tiles x split, next to the shipped choice, and
checks each result against the shipped one.

    python benchmarks/probe_edge_split.py --out benchmarks/results [--atoms 192]
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_message_passing import water_like_graph
from harness import graph_time_per_call_us, write_lines

mp = importlib.import_module("mlff_distiller.kernels.message_passing")

# (block_e, block_f, warps, split): "auto" is the shipped rule.
CONFIGS = [
    (64, 32, 4, "auto"),
    (64, 32, 4, 1),
    (64, 32, 4, 2),
    (32, 32, 4, 1),
    (32, 32, 4, 2),
    (32, 32, 4, 4),
    (16, 32, 4, 1),
    (16, 32, 4, 2),
    (16, 64, 4, 1),
    (16, 128, 4, 1),
    (32, 64, 4, 1),
    (32, 32, 2, 1),
    (16, 32, 2, 1),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--atoms", type=int, default=192)
    p.add_argument("--name", default="probe_edge_split_h100")
    p.add_argument("--configs", default="", help="block_e x block_f x warps : split, comma-separated (e.g. 64x32x4:4)")
    args = p.parse_args()
    configs = CONFIGS
    if args.configs:
        configs = [(64, 32, 4, "auto")]
        for item in args.configs.split(","):
            tiles, split = item.split(":")
            be, bf, nw = (int(t) for t in tiles.split("x"))
            configs.append((be, bf, nw, split if split == "auto" else int(split)))
    dev = torch.device("cuda")
    x, v, rbf, w, unit, ei = water_like_graph(args.atoms, dev)
    n, e = v.shape[0], ei.shape[1]
    g = mp._receiver_csr(ei, n)
    row_ptr = g.row_ptr
    perm, col_ptr = mp._sender_csr(ei, n)
    gen = torch.Generator(device=dev).manual_seed(1)
    gs = torch.randn(n, v.shape[2], generator=gen, device=dev)
    gv = torch.randn(v.shape, generator=gen, device=dev)

    def run(need):
        return mp._mp_backward(gs, gv, x, v, rbf, w, unit, ei, perm, col_ptr, need, mp._bare, row_ptr)

    lines = [
        f"# Edge backward: tiles x feature split ({torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"triton {triton.__version__})",
        "",
        f"Water-like graph, {n} atoms, {e} pairs (5 Å), F = {v.shape[2]}, R = {rbf.shape[1]}, float32, tf32x3 dots.",
        "µs per call, 20 calls in one CUDA graph, median replay. `edge`: ∂rbf, ∂u only (the edge kernel and its",
        "partial sums); `bwd`: the whole inference backward of one layer (sender kernel + edge kernel).",
        "",
        "| block_e | block_f | warps | split | programs | edge µs | bwd µs | max rel diff vs shipped |",
        "|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    ref = None
    for be, bf, nw, split in configs:
        cfg = dict(bwd_edge_block_e=be, bwd_edge_block_f=bf, bwd_edge_warps=nw, bwd_edge_split=split)
        try:
            with mp._configured(**cfg):
                out = run((False, True, False))
                torch.cuda.synchronize()
                tiles = -(-e // be)
                s = mp._edge_split(x, tiles, v.shape[2], min(bf, v.shape[2])) if split == "auto" else split
                t_edge = graph_time_per_call_us(lambda: run((False, True, False)))
                t_bwd = graph_time_per_call_us(lambda: run((True, True, False)))
        except Exception as exc:  # a tiling that does not compile is a row saying so
            lines.append(f"| {be} | {bf} | {nw} | {split} | | failed: {type(exc).__name__} {str(exc)[:80]} | | |")
            continue
        got = torch.cat([out[2].flatten(), out[4].flatten()])
        if ref is None:
            ref = got
        diff = ((got - ref).abs().max() / ref.abs().max()).item()
        lines.append(f"| {be} | {bf} | {nw} | {split} ({s}) | {tiles * s} | {t_edge:.1f} | {t_bwd:.1f} | {diff:.1e} |")
        print(lines[-1], flush=True)
    write_lines(lines, args.out, args.name)


if __name__ == "__main__":
    main()
