"""Probe (GPU): a persistent Triton GEMM against the shipped one for the large-row forward forms.

The g2 rows (issue 5) spend about a third of a step in the atom-wise GEMMs: at 7,200 rows a 128 -> 384 product
takes ~14 µs where its bytes and tf32x3 MMAs allow ~5 (benchmarks/bench_gemm.py's floor). The shipped kernel
launches one program per 64 x 64 output tile (678 at 7,200 x 384), each loading its tiles and running a K loop of
four steps before its epilogue. Not tried before: a persistent kernel (one program per SM, or two, walking the
tiles), whose loop Triton can pipeline across tiles, so a tile's loads overlap the previous tile's MMAs and
epilogue (the structure of Triton's persistent-matmul tutorial).

Same arithmetic as the shipped forward form (``C = act(x Wᵀ + b)``, "tf32x3w": W's TF32 parts made once, A split in
registers, three TF32 MMAs, the small products first), so the two agree to float32 rounding; each is timed as the
median of a CUDA graph of 20 calls (``harness.graph_time_per_call_us``). A probe: nothing shipped calls it.

    python benchmarks/probe_gemm_persistent.py --rows 7200 27000 --out DIR
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import graph_time_per_call_us, write_lines
from mlff_distiller.kernels import gemm
from mlff_distiller.kernels._frozen import tf32_parts
from mlff_distiller.kernels._triton_utils import HAS_TRITON, cdiv, dot_w, tl, triton

# (form, K, N): the 128-wide student's large forward GEMMs (φ, the update block's [U; V] on 3N rows, its mixing MLP)
SHAPES = [("linear", 128, 384), ("linear+silu", 128, 128), ("linear", 128, 256), ("linear+silu", 256, 128)]

if HAS_TRITON:

    @triton.jit
    def _sigmoid(x):
        return 1.0 / (1.0 + tl.exp(-x))

    @triton.jit(do_not_specialize=["m"])
    def _gemm_persistent_kernel(
        a_ptr, b_ptr, bl_ptr, bias_ptr, c_ptr, pre_ptr, m, n, k, stride_bk, stride_bn,
        EPI: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PROGRAMS: tl.constexpr,
        STAGES: tl.constexpr, FLATTEN: tl.constexpr,
    ):  # fmt: skip
        """C = act(A Bᵀ... as the shipped forward form, one program walking tiles ``pid, pid + PROGRAMS, ...``
        (row tiles outer, so consecutive tiles of a program share their rows of A in L2)."""
        pid = tl.program_id(0)
        tiles_n = tl.cdiv(n, BN)
        tiles = tl.cdiv(m, BM) * tiles_n
        for tile in tl.range(pid, tiles, PROGRAMS, num_stages=STAGES, flatten=FLATTEN):
            rows = (tile // tiles_n).to(tl.int64) * BM + tl.arange(0, BM)
            cols = (tile % tiles_n) * BN + tl.arange(0, BN)
            rm = rows[:, None] < m
            cm = cols[None, :] < n
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for k0 in range(0, k, BK):
                kk = k0 + tl.arange(0, BK)
                a = tl.load(a_ptr + rows[:, None] * k + kk[None, :], mask=rm & (kk[None, :] < k), other=0.0)
                boffs = kk[:, None] * stride_bk + cols[None, :] * stride_bn
                bmask = (kk[:, None] < k) & cm
                b = tl.load(b_ptr + boffs, mask=bmask, other=0.0)
                bl = tl.load(bl_ptr + boffs, mask=bmask, other=0.0)
                acc += dot_w(a, b, bl, "tf32x3w")
            acc += tl.load(bias_ptr + cols, mask=cols < n, other=0.0)[None, :]
            cmask = rm & cm
            if EPI == 1:
                tl.store(pre_ptr + rows[:, None] * n + cols[None, :], acc, mask=cmask)
                acc = acc * _sigmoid(acc)
            tl.store(c_ptr + rows[:, None] * n + cols[None, :], acc, mask=cmask)


def persistent_gemm(x, w, b, act, *, bm=64, bn=64, bk=32, warps=4, per_sm=2, stages=2, flatten=False):
    """``act(x wᵀ + b)`` (``w`` an nn.Linear weight ``[N, K]``) on the persistent kernel; returns C."""
    m, k = x.shape
    n = w.shape[0]
    parts = tf32_parts(w)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    pre = torch.empty_like(out) if act == "silu" else out
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 2  # (the interpreter)
    programs = min(sms * per_sm, cdiv(m, bm) * cdiv(n, bn))
    _gemm_persistent_kernel[(programs,)](
        x, parts[0], parts[1], b, out, pre, m, n, k, 1, k,
        EPI=1 if act == "silu" else 0, BM=bm, BN=bn, BK=bk, PROGRAMS=programs, STAGES=stages, FLATTEN=flatten,
        num_warps=warps,
    )  # fmt: skip
    return out


VARIANTS = {  # label: keyword arguments of persistent_gemm
    "1/SM, 64x64": dict(per_sm=1),
    "2/SM, 64x64": dict(per_sm=2),
    "2/SM, 64x64, 3 stages": dict(per_sm=2, stages=3),
    "2/SM, 64x64, flattened": dict(per_sm=2, flatten=True),
    "1/SM, 128x64, 8 warps": dict(per_sm=1, bm=128, warps=8),
    "3/SM, 64x32": dict(per_sm=3, bn=32),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[7200, 27000])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default="probe_gemm_persistent")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or not HAS_TRITON:
        print("probe_gemm_persistent: needs a CUDA device and Triton")
        return 0
    device = torch.device("cuda")
    lines = [
        "# probe_gemm_persistent.py: a persistent Triton GEMM against the shipped one (forward forms, tf32x3w)",
        "",
        f"{torch.cuda.get_device_name()} · torch {torch.__version__} · triton {triton.__version__} · float32",
        "",
        "µs per call, the median of a CUDA graph of 20 calls; ratio = shipped / variant (> 1: the variant is faster);",
        "max rel: the variant's largest difference from the shipped result, relative to that result's largest entry.",
        "",
        "| rows | form | K -> N | shipped µs | variant | µs | ratio | max rel |",
        "|---:|---|---|---:|---|---:|---:|---:|",
    ]
    for m in args.rows:
        for form, k, n in SHAPES:
            rows = 3 * m if (k, n) == (128, 256) else m  # [U; V] runs on the 3N rows of v
            gen = torch.Generator().manual_seed(rows + k + n)
            x = torch.randn(rows, k, generator=gen).to(device)
            w = (torch.randn(n, k, generator=gen) * k**-0.5).to(device)
            b = torch.randn(n, generator=gen).to(device)
            act = "silu" if form.endswith("silu") else "none"
            want = gemm(x, w, b, act=act)[0]
            shipped = graph_time_per_call_us(lambda x=x, w=w, b=b, act=act: gemm(x, w, b, act=act))
            for label, kw in VARIANTS.items():
                try:
                    got = persistent_gemm(x, w, b, act, **kw)
                    err = float((got - want).abs().max() / want.abs().max())
                    t = graph_time_per_call_us(lambda x=x, w=w, b=b, a=act, kw=kw: persistent_gemm(x, w, b, a, **kw))
                except Exception as exc:  # a tiling that does not compile: say so, go on
                    lines.append(f"| {rows:,} | {form} | {k} -> {n} | {shipped:.2f} | {label} | failed: "
                                 f"{type(exc).__name__} | | |")  # fmt: skip
                    continue
                lines.append(
                    f"| {rows:,} | {form} | {k} -> {n} | {shipped:.2f} | {label} | {t:.2f} | {shipped / t:.3f} | "
                    f"{err:.1e} |"
                )
            print(lines[-1], flush=True)
    write_lines(lines, Path(args.out), args.name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
