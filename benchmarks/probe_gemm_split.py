"""Where a large-M float32 GEMM of the student loses its time on a Hopper GPU: a probe, not a shipped kernel.

    python benchmarks/probe_gemm_split.py --out benchmarks/results [--rows 7200 27000] [--configs ...]

Stop 42's profile put the Triton GEMMs of a 1,024-molecule g2 step at ~28 µs each where the call's bytes and its
tf32x3 products allow ~4-7 µs. ``tl.dot(..., input_precision="tf32x3")`` splits *both* tiles into a TF32 "big" and
"small" part in registers after they are loaded (Triton's F32DotTC pass) and runs three TF32 dots. On Hopper the
``wgmma`` instruction reads B from shared memory, so the split B tiles must go back to shared memory before every
MMA. Our weights are frozen: W's two parts could be stored once (``W_hi = tf32(W)``, ``W_lo = W - W_hi``), and B
then goes from global to shared memory to the tensor cores untouched. This probe times C = A Wᵀ (W ``[N, K]`` as
``nn.Linear`` keeps it) with one standalone kernel in several modes, per tile configuration, beside cuBLAS (strict
float32 and TF32) and the shipped :func:`mlff_distiller.kernels.gemm`:

- ``x3``: ``tl.dot(a, b, input_precision="tf32x3")`` (what the shipped kernel does; the control);
- ``presplit_w``: W's two parts from memory, A split in registers, three TF32 dots (float32 accuracy);
- ``presplit_aw``: A's parts from memory too (a bound: the producers would have to write them);
- ``tf32``: one TF32 dot (a bound, not float32 accuracy);
- ``ieee``: the CUDA cores' float32 FMAs.

Each row also says whether the compiled PTX holds ``wgmma`` (Hopper's warpgroup MMA) or only ``mma.sync``, and the
error against a float64 product (normwise relative). Times: a CUDA graph of 20 calls, median replay / 20.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import triton
import triton.language as tl
from harness import device_slug, environment, graph_time_per_call_us, write_lines

MODES = ("x3", "presplit_w", "presplit_aw", "tf32", "ieee")


@triton.jit
def _split_hi(x):
    """The TF32 part of float32 ``x`` (its low 13 mantissa bits cleared): exact in TF32, x - hi exact in float32."""
    return (x.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)


@triton.jit
def _probe_gemm_kernel(
    a_ptr, al_ptr, b_ptr, bl_ptr, c_ptr, m, n,
    K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, MODE: tl.constexpr,
):  # fmt: skip
    """One [BM, BN] tile of C = A Bᵀ, A [m, K] and B [n, K] row-major (B's tile is loaded K-major: [BK, BN])."""
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    rm = rows[:, None] < m
    cm = cols[None, :] < n
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        a = tl.load(a_ptr + rows[:, None] * K + kk[None, :], mask=rm, other=0.0)
        b = tl.load(b_ptr + cols[None, :] * K + kk[:, None], mask=cm, other=0.0)
        if MODE == 0:
            acc = tl.dot(a, b, acc, input_precision="tf32x3")
        elif MODE == 1:
            bl = tl.load(bl_ptr + cols[None, :] * K + kk[:, None], mask=cm, other=0.0)
            a_hi = _split_hi(a)
            acc = tl.dot(a - a_hi, b, acc, input_precision="tf32")
            acc = tl.dot(a_hi, bl, acc, input_precision="tf32")
            acc = tl.dot(a_hi, b, acc, input_precision="tf32")
        elif MODE == 2:
            bl = tl.load(bl_ptr + cols[None, :] * K + kk[:, None], mask=cm, other=0.0)
            al = tl.load(al_ptr + rows[:, None] * K + kk[None, :], mask=rm, other=0.0)
            acc = tl.dot(al, b, acc, input_precision="tf32")
            acc = tl.dot(a, bl, acc, input_precision="tf32")
            acc = tl.dot(a, b, acc, input_precision="tf32")
        elif MODE == 3:
            acc = tl.dot(a, b, acc, input_precision="tf32")
        else:
            acc = tl.dot(a, b, acc, input_precision="ieee")
    tl.store(c_ptr + rows[:, None] * n + cols[None, :], acc, mask=rm & cm)


def _split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    hi = (x.view(torch.int32) & -8192).view(torch.float32)  # 0xFFFFE000 as a signed int32
    return hi, x - hi


def _parse_configs(text: str) -> list[tuple[int, int, int, int, int | None]]:
    out = []
    for item in text.split(","):
        parts = item.split(":")
        bm, bn, warps = (int(t) for t in parts[0].split("x"))
        out.append((bm, bn, warps, int(parts[1]), int(parts[2]) if len(parts) > 2 and parts[2] else None))
    return out


def _shape_rows(m: int, k: int, n: int, configs, modes, gemm, device) -> list[str]:
    """The report's section for C [m, n] = A [m, k] Wᵀ: cuBLAS, the shipped gemm, then every config x mode."""
    gen = torch.Generator(device="cpu").manual_seed(m * 7 + k * 3 + n)
    a = torch.randn(m, k, generator=gen).to(device)
    w = (torch.randn(n, k, generator=gen) * k**-0.5).to(device)
    ref = (a.double() @ w.double().t()).double()
    a_hi, a_lo = _split(a)
    w_hi, w_lo = _split(w)
    c = torch.empty(m, n, device=device)

    def err(x):
        return ((x.double() - ref).norm() / ref.norm()).item()

    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    t_cublas = graph_time_per_call_us(lambda: torch.mm(a, w.t(), out=c))
    torch.backends.cuda.matmul.allow_tf32 = True
    t_cublas_tf32 = graph_time_per_call_us(lambda: torch.mm(a, w.t(), out=c))
    torch.backends.cuda.matmul.allow_tf32 = old
    ours = gemm(a, w)[0]
    t_ship = graph_time_per_call_us(lambda: gemm(a, w))
    lines = [
        f"## M = {m}, K = {k} → N = {n}",
        "",
        f"cuBLAS strict fp32 {t_cublas:.2f} µs, cuBLAS TF32 {t_cublas_tf32:.2f} µs, shipped `gemm` "
        f"{t_ship:.2f} µs (err {err(ours):.1e})",
        "",
        "| tile BM x BN / warps | BK | stages | mode | µs | shipped / this | err | wgmma | regs | smem KB |",
        "|---|---:|---|---|---:|---:|---:|---|---:|---:|",
    ]
    print("\n".join(lines), flush=True)
    for bm, bn, warps, bk, stages in configs:
        if k % bk:
            continue
        for mode in modes:
            mi = MODES.index(mode)
            kw = {"num_warps": warps}
            if stages is not None:
                kw["num_stages"] = stages
            grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
            args_ = (a_hi if mi == 2 else a, a_lo, w_hi if mi in (1, 2) else w, w_lo, c, m, n)

            def run(args_=args_, kw=kw, grid=grid, mi=mi, bm=bm, bn=bn, bk=bk):
                return _probe_gemm_kernel[grid](*args_, K=k, BM=bm, BN=bn, BK=bk, MODE=mi, **kw)

            try:
                compiled = run()
                torch.cuda.synchronize()
                e = err(c)
                t = graph_time_per_call_us(run)
                ptx = compiled.asm.get("ptx", "")
                mma = "wgmma" if "wgmma" in ptx else ("mma.sync" if "mma.sync" in ptx else "none")
                regs = getattr(compiled, "n_regs", None)
                smem = getattr(compiled.metadata, "shared", 0) / 1024
                row = f"{t:.2f} | {t_ship / t:.2f} | {e:.1e} | {mma} | {regs} | {smem:.0f}"
            except Exception as exc:  # a tile that does not compile is a row saying so
                row = f"failed: {type(exc).__name__}: {str(exc)[:60]} | | | | |"
            lines.append(f"| {bm} x {bn} / {warps} | {bk} | {stages} | {mode} | {row} |")
            print(lines[-1], flush=True)
    lines.append("")
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--rows", type=int, nargs="+", default=[7200, 27000])
    ap.add_argument("--shapes", default="128x384,128x128,384x128", help="KxN pairs, comma-separated")
    ap.add_argument(
        "--configs",
        default="64x64x4:32,128x64x8:32,128x128x8:32:3,64x128x4:32:3,128x64x4:64:3,128x128x8:64:2,64x64x4:128:1",
        help="BMxBNxWARPS:BK[:STAGES], comma-separated; the first is the shipped large-M tile",
    )
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--name", default=None)
    args = ap.parse_args(argv)
    from mlff_distiller.kernels import gemm

    device = torch.device("cuda")
    env = environment(device, 0.0)
    configs = _parse_configs(args.configs)
    modes = args.modes.split(",")
    lines = [
        "# A large-M float32 GEMM on Hopper: tf32x3 as Triton splits it, against W split once (probe)",
        "",
        f"{env.device} · torch {env.torch} · triton {env.triton} · commit {env.commit}. C = A Wᵀ, no bias. µs per "
        "call: a CUDA graph of 20 calls, median replay / 20. err: normwise relative error against a float64 product. "
        "`wgmma`: the compiled PTX holds Hopper's warpgroup MMA (else `mma.sync`, or none for ieee). Modes: see "
        "benchmarks/probe_gemm_split.py.",
        "",
    ]
    for m in args.rows:
        for shape in args.shapes.split(","):
            k, n = (int(t) for t in shape.split("x"))
            lines += _shape_rows(m, k, n, configs, modes, gemm, device)
    write_lines(lines, Path(args.out), args.name or f"probe_gemm_split_{device_slug(device)}")


if __name__ == "__main__":
    main()
