# ruff: noqa: B023  (closures are called inside the loop iteration that made them)
"""GPU probes behind the engine/kernel tuning (issues 5 and 7): tiny-GEMM kernel choice and the fused
message-passing launch configuration and filter-dot precision, on the graph sizes the engine actually runs.

    python benchmarks/tune_small.py --out DIR

Every time is the median per call of a CUDA graph replaying the op 20 times (what a captured step pays).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import importlib

from bench_message_passing import water_like_graph

# the package re-exports a function of the same name: take the module itself
mp = importlib.import_module("mlff_distiller.kernels.message_passing")


def graph_time_us(fn, reps: int = 20) -> float:
    import triton

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    return triton.testing.do_bench(g.replay, warmup=20, rep=150, return_mode="median") * 1e3 / reps


def gemm_probe(lines: list[str]) -> None:
    dev = "cuda"
    lines += ["## Tiny GEMMs (fp32, µs per call inside a CUDA graph)", ""]
    lines += [
        "| rows M | in→out | blas | F.linear fwd | grad_x = g @ W | x @ Wt (pre-transposed) |",
        "|---|---|---|---:|---:|---:|",
    ]
    for blas in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(blas)
        for m, (k, n) in itertools.product(
            (16, 48, 64, 128, 7008), ((128, 128), (128, 384), (256, 128), (384, 128), (128, 64))
        ):
            x = torch.randn(m, k, device=dev)
            w = torch.randn(n, k, device=dev)
            g = torch.randn(m, n, device=dev)
            wt = w.t().contiguous()
            t1 = graph_time_us(lambda: torch.nn.functional.linear(x, w))
            t2 = graph_time_us(lambda: g @ w)
            t3 = graph_time_us(lambda: x @ wt)
            lines.append(f"| {m} | {k}→{n} | {blas} | {t1:.2f} | {t2:.2f} | {t3:.2f} |")
    torch.backends.cuda.preferred_blas_library("cublas")


def small_graph(n_atoms: int, deg: int, dev: str, seed: int = 0):
    """Receiver-sorted random graph: ``deg`` senders per atom (molecule-like sizes)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    i = torch.arange(n_atoms).repeat_interleave(deg)
    j = torch.randint(0, n_atoms, (n_atoms * deg,), generator=gen)
    f, r = 128, 20
    x = torch.randn(n_atoms, 3 * f, generator=gen)
    v = torch.randn(n_atoms, 3, f, generator=gen)
    rbf = torch.rand(n_atoms * deg, r, generator=gen)
    w = torch.randn(3 * f, r, generator=gen) / r**0.5
    unit = torch.nn.functional.normalize(torch.randn(n_atoms * deg, 3, generator=gen), dim=1)
    ei = torch.stack([i, j])
    return [t.to(dev) for t in (x, v, rbf, w, unit, ei)]


def mp_probe(lines: list[str], records: list) -> None:
    graphs = {
        "16 atoms x 9": small_graph(16, 9, "cuda"),
        "7008 atoms x 9": small_graph(7008, 9, "cuda"),
        "water 3000": water_like_graph(3000, torch.device("cuda")),
        "water 24000": water_like_graph(24000, torch.device("cuda")),
    }
    lines += ["", "## Fused message passing: configuration x dot precision (µs per call in a CUDA graph)", ""]
    lines += [
        "| graph | edges | prec | block_e | block_f | warps | bwd_block_e | fwd | fwd+bwd(x,v,rbf,unit) "
        "| rel err vs fp64 |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    old_cfg, old_prec = dict(mp._CONFIG), mp._DOT_PRECISION
    for name, inputs in graphs.items():
        x, v, rbf, w, unit, ei = inputs
        n = x.shape[0]
        bounds = torch.arange(n + 1, device="cuda")
        row_ptr = torch.searchsorted(ei[0].contiguous(), bounds)
        ref = mp.message_passing_reference(*(t.double() for t in (x, v, rbf, w, unit)), ei)
        xg, vg, rg, ug = (t.clone().requires_grad_(True) for t in (x, v, rbf, unit))
        gs, gv = torch.randn_like(ref[0]).float(), torch.randn_like(ref[1]).float()
        configs = [
            (16, 128, 4, 32),
            (8, 128, 4, 16),
            (16, 64, 4, 32),
            (8, 64, 4, 16),
            (16, 128, 8, 32),
            (32, 128, 8, 64),
        ]
        for prec, (be, bf, nw, bbe) in itertools.product(("ieee", "tf32x3", "tf32"), configs):
            mp._CONFIG.update(block_e=be, block_f=bf, num_warps=nw, bwd_block_e=bbe)
            mp._DOT_PRECISION = prec
            try:
                with torch.no_grad():
                    out = mp.message_passing(x, v, rbf, w, unit, ei, row_ptr=row_ptr)
                err = max(((o.double() - r).norm() / r.norm()).item() for o, r in zip(out, ref, strict=True))
                t_f = graph_time_us(lambda: mp.message_passing(x, v, rbf, w, unit, ei, row_ptr=row_ptr), reps=5)

                def fb():
                    ds, dv = mp.message_passing(xg, vg, rg, w, ug, ei, row_ptr=row_ptr)
                    return torch.autograd.grad((ds, dv), (xg, vg, rg, ug), (gs, gv))

                t_b = graph_time_us(fb, reps=5)
            except Exception as exc:
                lines.append(
                    f"| {name} | {ei.shape[1]} | {prec} | {be} | {bf} | {nw} | {bbe} "
                    f"| failed: {type(exc).__name__} {str(exc)[:60]} | | |"
                )
                continue
            records.append(dict(graph=name, prec=prec, be=be, bf=bf, nw=nw, bbe=bbe, fwd=t_f, fb=t_b, err=err))
            lines.append(
                f"| {name} | {ei.shape[1]} | {prec} | {be} | {bf} | {nw} | {bbe} | {t_f:.1f} | {t_b:.1f} | {err:.1e} |"
            )
            print(lines[-1], flush=True)
    mp._CONFIG.clear()
    mp._CONFIG.update(old_cfg)
    mp._DOT_PRECISION = old_prec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=None)
    ap.add_argument("--skip", default="", help="comma list: gemm,mp")
    args = ap.parse_args()
    import triton

    lines = [
        f"# Tuning probes: {torch.cuda.get_device_name()} · torch {torch.__version__} · triton {triton.__version__}",
        "",
    ]
    records: list = []
    if "gemm" not in args.skip:
        gemm_probe(lines)
        print("\n".join(lines), flush=True)
    if "mp" not in args.skip:
        mp_probe(lines, records)
    text = "\n".join(lines)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "tune_small.md").write_text(text + "\n")
        (Path(args.out) / "tune_small.json").write_text(json.dumps(records, indent=1))
    print(text[-6000:])


if __name__ == "__main__":
    main()
