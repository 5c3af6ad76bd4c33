"""The edge backward (∂rbf, ∂u) alone: the shipped "tile" kernel against the "recv" kernel (one program per receiver,
its rows g_s[i], g_v[i] folded into the filter tiles; kernels/_mp_kernels.py), GPU only.

    python benchmarks/probe_edge_recv.py --out benchmarks/results [--graphs water24000,water3000,water192,g2x1024]

Each graph (bench_message_passing's water-like boxes, ~55 edges per atom; tune_small's g2 batches, ~7.5) gets the
shipped configuration first, then every variant below, each as a CUDA-graph replay of one kernel call (µs, the
harness's per-call time), with its error vs the float64 VJP (max |out - ref| / max |ref| over ∂rbf and ∂u). Both
the full layer (v given) and the first layer (v = 0, ``has_v=False``) are timed. Writes ``probe_edge_recv.md``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_message_passing import water_like_graph
from harness import write_lines
from tune_small import NEED, KernelBench, g2_graph, graph_time_us

mp = importlib.import_module("mlff_distiller.kernels.message_passing")

# (label, launch configuration): the shipped tile kernel, then recv tilings (block_e x block_f / warps, split).
VARIANTS = [("tile (shipped)", {})]
for be, bf, w, split in (
    (64, 32, 4, 1), (64, 32, 4, 2), (64, 64, 4, 1), (64, 32, 8, 1), (64, 64, 8, 1), (32, 32, 4, 1), (32, 64, 4, 1),
    (16, 32, 4, 1), (16, 64, 4, 1), (64, 128, 8, 1), (128, 32, 8, 1),
):  # fmt: skip
    cfg = dict(bwd_edge_variant="recv", bwd_edge_recv_block_e=be, bwd_edge_recv_block_f=bf)
    VARIANTS.append((f"recv {be}x{bf}/{w} split {split}", cfg | dict(bwd_edge_recv_warps=w, bwd_edge_recv_split=split)))


class EdgeBench(KernelBench):
    """KernelBench whose backward call passes the receiver CSR (the recv kernel needs it; the engine passes it)."""

    has_v = True

    def call(self, kernel: str):
        x, v, rbf, w, unit, ei = self.inputs
        if not self.has_v:
            v = torch.zeros_like(v)
        args = (self.gs, self.gv, x, v, rbf, w, unit, ei, self.perm, self.col_ptr, NEED[kernel], mp._bare)
        return lambda: mp._mp_backward(*args, self.row_ptr, self.has_v)


def graphs(names):
    for name in names:
        if name.startswith("water"):
            yield name, water_like_graph(int(name[5:]), torch.device("cuda"))
        else:
            yield name, g2_graph(int(name.split("x")[1]), "cuda")


def main() -> int:
    import triton

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--graphs", default="water24000,water3000,water192,g2x1024")
    p.add_argument("--budget-s", type=float, default=240.0)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs CUDA")
    lines = [
        "# probe_edge_recv.py: the edge backward, tile vs recv kernel",
        "",
        f"{torch.cuda.get_device_name()} · torch {torch.__version__} · triton {triton.__version__}",
        "",
        "One kernel call per CUDA-graph replay (µs); error = max |out - ref| / max |ref| over ∂rbf, ∂u vs float64; "
        "ratio = shipped µs / variant µs (> 1: faster). v = 0 is the first layer (its b-terms skipped).",
        "",
        "| graph | edges | variant | µs | ratio | error | µs, v = 0 | ratio, v = 0 |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    end = time.monotonic() + args.budget_s
    for name, inputs in graphs(args.graphs.split(",")):
        b = EdgeBench(name, inputs)
        base = base0 = None
        for label, cfg in VARIANTS:
            if time.monotonic() > end:
                lines.append(f"| {name} | {b.edges} | {label} | skipped: budget | | | | |")
                continue
            try:
                b.has_v = True
                t, err = b.run("bwd_edge", cfg)
                b.has_v = False
                with mp._configured(**cfg):
                    t0 = graph_time_us(b.call("bwd_edge"), reps=b.reps)
            except Exception as exc:  # a tiling the kernel cannot take (registers, shared memory): report, go on
                lines.append(
                    f"| {name} | {b.edges} | {label} | failed: {type(exc).__name__}: {str(exc)[:60]} | | | | |"
                )
                print(lines[-1], flush=True)
                continue
            base, base0 = base or t, base0 or t0
            lines.append(
                f"| {name} | {b.edges} | {label} | {t:.1f} | {base / t:.3f} | {err:.2e} | {t0:.1f} | {base0 / t0:.3f} |"
            )
            print(lines[-1], flush=True)
        del b
        torch.cuda.empty_cache()
    print(write_lines(lines, args.out, "probe_edge_recv"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
