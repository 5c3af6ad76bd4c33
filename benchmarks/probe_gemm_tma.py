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

from harness import back_to_back_us, device_slug, environment, graph_time_per_call_us, write_lines
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
                         HAS_BIAS: tl.constexpr, PERSISTENT: tl.constexpr, NUM_PROGS: tl.constexpr,
                         ROW_FAST: tl.constexpr = False):  # fmt: skip
        n_col = tl.cdiv(n, BN)
        if PERSISTENT:
            tiles = tl.cdiv(m, BM) * n_col
            for t in tl.range(tl.program_id(0), tiles, NUM_PROGS):
                _tile(a_desc, w_desc, bias_ptr, c_desc, pre_desc, n, k, t // n_col, t % n_col, EPI, BM, BN, BK, DOT,
                      HAS_BIAS)  # fmt: skip
        elif ROW_FAST:  # 2-D grid, row tile fastest (the element-wise kernel's order before stop 60)
            _tile(a_desc, w_desc, bias_ptr, c_desc, pre_desc, n, k, tl.program_id(0), tl.program_id(1), EPI, BM, BN,
                  BK, DOT, HAS_BIAS)  # fmt: skip
        else:
            pid = tl.program_id(0)
            _tile(a_desc, w_desc, bias_ptr, c_desc, pre_desc, n, k, pid // n_col, pid % n_col, EPI, BM, BN, BK, DOT,
                  HAS_BIAS)  # fmt: skip

    @triton.jit
    def _gemm_devdesc_kernel(a_ptr, w_ptr, bias_ptr, c_ptr, pre_ptr, m, n, k, EPI: tl.constexpr,
                             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr,
                             HAS_BIAS: tl.constexpr):  # fmt: skip
        """The same tile with descriptors made inside the kernel (``tl.make_tensor_descriptor``: no host-side
        descriptor per operand and launch; each program writes its own into a scratch buffer from Triton's
        allocator)."""
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[m, k], strides=[k, 1], block_shape=[BM, BK])
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[n, k], strides=[k, 1], block_shape=[BN, BK])
        c_desc = tl.make_tensor_descriptor(c_ptr, shape=[m, n], strides=[n, 1], block_shape=[BM, BN])
        if EPI == 1:
            pre_desc = tl.make_tensor_descriptor(pre_ptr, shape=[m, n], strides=[n, 1], block_shape=[BM, BN])
        else:
            pre_desc = c_desc
        n_col = tl.cdiv(n, BN)
        pid = tl.program_id(0)
        _tile(a_desc, w_desc, bias_ptr, c_desc, pre_desc, n, k, pid // n_col, pid % n_col, EPI, BM, BN, BK, DOT,
              HAS_BIAS)  # fmt: skip


def _scratch(size: int, alignment: int, stream):
    """Triton's global scratch for descriptors made inside a kernel (``triton.set_allocator``)."""
    return torch.empty(size, dtype=torch.int8, device="cuda" if torch.cuda.is_available() else "cpu")


def gemm_variant(a, w, bias, act, how, out=None, pre=None, tile=(64, 64, 32, 4, 3, 0)):
    """The shipped tile (64 x 64 x 32, 4 warps, 3 stages) launched ``how``: "host" (host-side descriptors, column
    tiles side by side: what kernels/linear.py ships), "host-2d" (host-side descriptors, 2-D grid, row tile
    fastest) or "device" (descriptors made inside the kernel)."""
    if how == "host":
        return gemm_tma(a, w, bias, act, tile, out, pre)
    bm, bn, bk, warps, stages, _ = tile
    m, k = a.shape
    n = w.shape[0]
    out = a.new_empty((m, n)) if out is None else out
    pre = (a.new_empty((m, n)) if act == "silu" else out) if pre is None else pre
    if how == "host-2d":
        from triton.tools.tensor_descriptor import TensorDescriptor

        desc = TensorDescriptor.from_tensor
        _gemm_tma_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
            desc(a, [bm, bk]), desc(w, [bn, bk]), bias if bias is not None else out, desc(out, [bm, bn]),
            desc(pre, [bm, bn]), m, n, k, EPI=1 if act == "silu" else 0, BM=bm, BN=bn, BK=bk, DOT="tf32x2w",
            HAS_BIAS=bias is not None, PERSISTENT=False, NUM_PROGS=1, ROW_FAST=True, num_warps=warps,
            num_stages=stages,
        )  # fmt: skip
    elif how == "device":
        triton.set_allocator(_scratch)
        _gemm_devdesc_kernel[(triton.cdiv(m, bm) * triton.cdiv(n, bn),)](
            a, w, bias if bias is not None else out, out, pre, m, n, k, EPI=1 if act == "silu" else 0, BM=bm, BN=bn,
            BK=bk, DOT="tf32x2w", HAS_BIAS=bias is not None, num_warps=warps, num_stages=stages,
        )  # fmt: skip
    else:
        raise ValueError(how)
    return out, (pre if act == "silu" else None)


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


def launches(args, device, env) -> int:
    """``--launches``: the shipped tile launched three ways (host descriptors 1-D / 2-D grid, descriptors made in
    the kernel) beside kernels/linear.py's gemm (descriptors from its eager threshold on, element-wise below), device
    µs (a CUDA graph of 20 calls) and host µs (eager calls back to back)."""
    lines = [
        "# The GEMM's descriptor launches three ways: host-side 1-D (shipped) and 2-D grids, in-kernel descriptors",
        "",
        f"{env.device} · torch {env.torch} · triton {env.triton} · commit {env.commit}. device µs: a CUDA graph of 20 "
        "calls, median replay / 20; host µs: 1,000 eager calls back to back, one sync, median of 5 rounds. "
        "`gemm()`: kernels/linear.py's call (element-wise eagerly below its threshold, descriptors in the graph).",
        "",
        "| rows M | form | K → N | launch | device µs | host µs | max rel |",
        "|---:|---|---|---|---:|---:|---:|",
    ]
    for m in args.rows:
        for form, k, n in (("linear", 128, 384), ("linear+silu", 128, 128)):
            gen = torch.Generator().manual_seed(m + k + n)
            a = torch.randn(m, k, generator=gen).to(device)
            w = round_tf32_((torch.randn(n, k, generator=gen) * k**-0.5).to(device))
            b = torch.randn(n, generator=gen).to(device)
            act = "silu" if form.endswith("silu") else "none"
            ref = gemm(a, w, b, act=act)[0].clone()
            calls = [("gemm()", lambda a=a, w=w, b=b, act=act: gemm(a, w, b, act=act)[0])]
            for how in ("host", "host-2d", "device"):
                calls.append((how, lambda a=a, w=w, b=b, act=act, how=how: gemm_variant(a, w, b, act, how)[0]))
            for label, fn in calls:
                try:
                    rel = ((fn() - ref).abs().max() / ref.abs().max()).item()
                    dev_us = graph_time_per_call_us(fn)
                    host = back_to_back_us(fn, 1000)
                    row = f"{dev_us:.2f} | {host:.2f} | {rel:.1e}"
                except Exception as exc:  # a launch this Triton cannot make is a row saying so
                    row = f"failed: {type(exc).__name__}: {str(exc)[:60]} | | "
                lines.append(f"| {m} | {form} | {k} → {n} | {label} | {row} |")
                print(lines[-1], flush=True)
    write_lines(lines, Path(args.out), f"probe_gemm_tma_launches_{device_slug(device)}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--rows", type=int, nargs="+", default=[7200, 22000, 66000])
    p.add_argument("--launches", action="store_true", help="the shipped tile's launches compared (see launches())")
    args = p.parse_args(argv)
    if not torch.cuda.is_available() or not HAS_TRITON:
        print("probe_gemm_tma: needs CUDA and Triton")
        return 0
    device = torch.device("cuda")
    env = environment(device, 0.0)
    if args.launches:
        return launches(args, device, env)
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
