"""Probe: the large-M GEMM with Hopper's bulk tensor copies (TMA descriptors) against the shipped kernel.

    python benchmarks/probe_gemm_tma.py --out DIR [--rows 7200 22000 66000]

``bench_gemm.py --ceiling`` (stop 60) found the shipped Triton GEMM (kernels/linear.py) 1.2-2.1x slower than cuBLAS's
one-pass TF32 kernels on the student's large-M shapes, and its one-MMA form no faster than its two-MMA one: the
MMAs are not what bounds it. The difference from cuBLAS that remains is how the tiles move: ours loads A and B
and stores C element-wise from registers (masked, 64-bit addresses), cuBLAS by the copy engine. This probe runs
the same arithmetic ("tf32x2w": W on the TF32 grid, A split in registers, two TF32 MMAs; the bias and the SiLU
epilogue) with A, W and C (and the pre-activation) moved through tensor descriptors, one program per tile (col-fast
order, as shipped) or persistent, and times it beside the shipped call on the forward forms (µs per call, the
median of a CUDA graph of 20 calls). Results must equal the shipped kernel's to rounding (max rel. shown).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import device_slug, environment, graph_time_per_call_us, write_lines
from mlff_distiller.kernels import gemm
from mlff_distiller.kernels._frozen import round_tf32_
from mlff_distiller.kernels._triton_utils import HAS_TRITON, dot_w, tl, triton

FORMS = [("linear", 128, 128), ("linear+silu", 128, 128), ("linear", 128, 384), ("linear+silu", 256, 128),
         ("linear", 384, 128), ("uv", 128, 256)]  # fmt: skip

if HAS_TRITON:

    @triton.jit
    def _sig(x):
        return 1.0 / (1.0 + tl.exp(-x))

    @triton.jit
    def _tile(a_desc, w_desc, bias_ptr, c_desc, pre_desc, n, k, pid_m, pid_n, EPI: tl.constexpr, BM: tl.constexpr,
              BN: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr, HAS_BIAS: tl.constexpr):  # fmt: skip
        m0 = pid_m * BM
        n0 = pid_n * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, k, BK):
            a = a_desc.load([m0, k0])
            b = w_desc.load([n0, k0])
            acc += dot_w(a, b.T, b.T, DOT)
        if HAS_BIAS:
            cols = n0 + tl.arange(0, BN)
            acc += tl.load(bias_ptr + cols, mask=cols < n, other=0.0)[None, :]
        if EPI == 1:
            pre_desc.store([m0, n0], acc)
            acc = acc * _sig(acc)
        c_desc.store([m0, n0], acc)

    @triton.jit
    def _gemm_tma_kernel(a_desc, w_desc, bias_ptr, c_desc, pre_desc, m, n, k, EPI: tl.constexpr,
                         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr,
                         HAS_BIAS: tl.constexpr, PERSISTENT: tl.constexpr, NUM_PROGS: tl.constexpr):  # fmt: skip
        n_col = tl.cdiv(n, BN)
        if PERSISTENT:
            tiles = tl.cdiv(m, BM) * n_col
            for t in tl.range(tl.program_id(0), tiles, NUM_PROGS):
                _tile(a_desc, w_desc, bias_ptr, c_desc, pre_desc, n, k, t // n_col, t % n_col, EPI, BM, BN, BK, DOT,
                      HAS_BIAS)  # fmt: skip
        else:
            pid = tl.program_id(0)
            _tile(a_desc, w_desc, bias_ptr, c_desc, pre_desc, n, k, pid // n_col, pid % n_col, EPI, BM, BN, BK, DOT,
                  HAS_BIAS)  # fmt: skip


def gemm_tma(a, w, bias, act, tile, out=None, pre=None):
    """``act(a wᵀ + bias)`` through tensor descriptors; tile = (BM, BN, BK, warps, stages, persistent per SM)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    bm, bn, bk, warps, stages, per_sm = tile
    m, k = a.shape
    n = w.shape[0]
    out = a.new_empty((m, n)) if out is None else out
    pre = (a.new_empty((m, n)) if act == "silu" else out) if pre is None else pre
    a_d = TensorDescriptor.from_tensor(a, [bm, bk])
    w_d = TensorDescriptor.from_tensor(w, [bn, bk])
    c_d = TensorDescriptor.from_tensor(out, [bm, bn])
    p_d = TensorDescriptor.from_tensor(pre, [bm, bn])
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    if per_sm:
        progs = min(tiles, per_sm * torch.cuda.get_device_properties(a.device).multi_processor_count)
    else:
        progs = tiles
    _gemm_tma_kernel[(progs,)](
        a_d, w_d, bias if bias is not None else out, c_d, p_d, m, n, k,
        EPI=1 if act == "silu" else 0, BM=bm, BN=bn, BK=bk, DOT="tf32x2w", HAS_BIAS=bias is not None,
        PERSISTENT=bool(per_sm), NUM_PROGS=progs, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out, (pre if act == "silu" else None)


TILES = [
    (64, 64, 32, 4, 3, 0),
    (64, 128, 32, 4, 3, 0),
    (128, 64, 32, 4, 3, 0),
    (128, 128, 32, 8, 3, 0),
    (64, 64, 32, 4, 3, 2),
    (128, 128, 32, 8, 3, 1),
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--rows", type=int, nargs="+", default=[7200, 22000, 66000])
    args = p.parse_args(argv)
    if not torch.cuda.is_available() or not HAS_TRITON:
        print("probe_gemm_tma: needs CUDA and Triton")
        return 0
    device = torch.device("cuda")
    env = environment(device, 0.0)
    lines = [
        "# The large-M GEMM through tensor descriptors (TMA) against the shipped kernel (tf32x2w, float32)",
        "",
        f"{env.device} · torch {env.torch} · triton {env.triton} · commit {env.commit}. µs per call: a CUDA graph of "
        "20 calls, median replay / 20; ratio = shipped / TMA (> 1: TMA faster). tile: BM x BN x BK / warps / stages "
        "/ programs per SM (0: one program per tile).",
        "",
        "| rows M | form | K → N | shipped µs | tile | TMA µs | ratio | max rel |",
        "|---:|---|---|---:|---|---:|---:|---:|",
    ]
    for m in args.rows:
        for form, k, n in FORMS:
            rows = 3 * m if form == "uv" else m
            gen = torch.Generator().manual_seed(rows + k + n)
            a = torch.randn(rows, k, generator=gen).to(device)
            w = round_tf32_((torch.randn(n, k, generator=gen) * k**-0.5).to(device))
            b = None if form == "uv" else torch.randn(n, generator=gen).to(device)
            act = "silu" if form.endswith("silu") else "none"
            ref = gemm(a, w, b, act=act)[0].clone()
            t_ref = graph_time_per_call_us(lambda a=a, w=w, b=b, act=act: gemm(a, w, b, act=act)[0])
            for tile in TILES:
                try:
                    got = gemm_tma(a, w, b, act, tile)[0]
                    rel = ((got - ref).abs().max() / ref.abs().max()).item()
                    t = graph_time_per_call_us(
                        lambda a=a, w=w, b=b, act=act, tile=tile: gemm_tma(a, w, b, act, tile)[0]
                    )
                    row = f"{t:.2f} | {t_ref / t:.3f} | {rel:.1e}"
                except Exception as exc:  # a tile that does not fit is a row saying so
                    row = f"failed: {type(exc).__name__}: {str(exc)[:60]} | | "
                label = "{}x{}x{} / {} / {} / {}".format(*tile)
                lines.append(f"| {rows} | {form} | {k} → {n} | {t_ref:.2f} | {label} | {row} |")
                print(lines[-1], flush=True)
    write_lines(lines, Path(args.out), f"probe_gemm_tma_{device_slug(device)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
