# ruff: noqa: B023  (closures are called inside the loop iteration that made them)
"""Probe (GPU): a two-layer MLP in one kernel against the two Triton GEMMs the student runs now, at small M.

A benzene step launches 72 kernels, 30 of them GEMMs of 32 rows (~2.6-4.5 µs each in a CUDA-graph replay with
PDL); every MLP (the filter network φ, the update block's mixing MLP) is two of them forward and two backward.
``kernels/linear.py``'s ``mlp_fused_forward`` / ``mlp_fused_backward`` run each direction in one kernel whose
programs recompute the hidden layer for their output columns. This probe times, per M and MLP shape, the two-GEMM
form (``gemm`` + ``gemm``, as ``_MLP`` runs it) and the fused kernel at several tilings, each as a CUDA graph of
``--reps`` dependent-stream calls (the step's launch setting: PDL on where the GPU has it), median of
``triton.testing.do_bench`` over graph replays, per call. Every form is first checked against torch in float64.

    python benchmarks/probe_fused_mlp.py --out DIR [--name probe_fused_mlp]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

SHAPES = {"phi 128-128-384": (128, 128, 384), "update 256-128-384": (256, 128, 384)}
FWD_TILES = [(16, 64, 128), (16, 32, 128), (16, 128, 128), (16, 64, 64), (32, 64, 128), (16, 32, 64)]
BWD_TILES = [(16, 64, 128), (16, 32, 128), (16, 128, 128), (16, 64, 64), (16, 32, 64), (32, 64, 64)]


def _graph_time(fn, reps: int) -> float:
    """µs per call: ``reps`` calls captured in one CUDA graph, replayed (do_bench median)."""
    import triton

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    return 1e3 * triton.testing.do_bench(g.replay, return_mode="median") / reps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--name", default="probe_fused_mlp")
    p.add_argument("--rows", default="32,64,200,512")
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_fused_mlp: needs CUDA")
        return 0
    from mlff_distiller.kernels.linear import gemm, mlp_fused_backward, mlp_fused_forward
    from torch.nn import functional as nnf

    dev = torch.device("cuda")
    lines = [
        f"# probe_fused_mlp: {torch.cuda.get_device_name(dev)} · torch {torch.__version__}",
        "",
        f"µs per MLP call, {args.reps} calls per CUDA graph, fp32 (tf32x3 dots). fused: (BM, BH, BN) tiles.",
        "",
        "| shape | M | direction | two GEMMs | best fused (tiles) | ratio | all fused tilings |",
        "|---|---:|---|---:|---|---:|---|",
    ]
    gen = torch.Generator().manual_seed(0)
    for label, (k, h, n2) in SHAPES.items():
        for m in [int(r) for r in args.rows.split(",")]:

            def rnd(*shape, scale=1.0):
                return (torch.randn(*shape, generator=gen) * scale).to(dev)

            x, w1, b1 = rnd(m, k), rnd(h, k, scale=k**-0.5), rnd(h)
            w2, b2, g = rnd(n2, h, scale=h**-0.5), rnd(n2), rnd(m, n2)
            x64 = x.double().requires_grad_(True)
            pre_ref = nnf.linear(x64, w1.double(), b1.double())
            out_ref = nnf.linear(nnf.silu(pre_ref), w2.double(), b2.double())
            (gx_ref,) = torch.autograd.grad(out_ref, x64, g.double())

            def err(a, ref):
                return float((a.double() - ref).norm() / ref.norm())

            pre = pre_ref.detach().float()
            # forward
            two = _graph_time(lambda: gemm(gemm(x, w1, b1, act="silu")[0], w2, b2), args.reps)
            rows = []
            for t in FWD_TILES:
                out, _ = mlp_fused_forward(x, w1, b1, w2, b2, tiles=t)
                e = err(out, out_ref.detach())
                if e > 1e-5:
                    rows.append((float("inf"), t, f"error {e:.1e}"))
                    continue
                rows.append((_graph_time(lambda t=t: mlp_fused_forward(x, w1, b1, w2, b2, tiles=t), args.reps), t, ""))
            best = min(rows)
            alls = ", ".join(f"{t}: {us:.2f}{note}" for us, t, note in rows)
            lines.append(
                f"| {label} | {m} | forward | {two:.2f} | {best[0]:.2f} {best[1]} | {two / best[0]:.2f} | {alls} |"
            )
            # backward
            two = _graph_time(
                lambda: gemm(gemm(g, w2, transpose_w=False)[0], w1, transpose_w=False, prologue_silu_of=pre),
                args.reps,
            )
            rows = []
            for t in BWD_TILES:
                gx = mlp_fused_backward(g, w2, pre, w1, tiles=t)
                e = err(gx, gx_ref)
                if e > 1e-5:
                    rows.append((float("inf"), t, f"error {e:.1e}"))
                    continue
                rows.append((_graph_time(lambda t=t: mlp_fused_backward(g, w2, pre, w1, tiles=t), args.reps), t, ""))
            best = min(rows)
            alls = ", ".join(f"{t}: {us:.2f}{note}" for us, t, note in rows)
            lines.append(
                f"| {label} | {m} | backward | {two:.2f} | {best[0]:.2f} {best[1]} | {two / best[0]:.2f} | {alls} |"
            )
            print(lines[-2], lines[-1], sep="\n", flush=True)
    text = "\n".join(lines)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"{args.name}.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
