"""The Triton GEMMs of kernels/linear.py beside the cuBLAS calls they replace, on the student's layer shapes.

    python benchmarks/bench_gemm.py --out benchmarks/results [--rows 64 200 1393 6944 21749]

Each row times one call as the median of a CUDA graph replaying it 20 times (device time per call, the way the
engine runs it), float32, after checking ours against torch (max relative error, normwise). Forms:
``linear`` = x Wᵀ + b; ``linear+silu`` = SiLU(x Wᵀ + b) (torch: addmm + silu); ``g@W`` = g W (a backward GEMM);
``silu'(p)*g@W`` = (g ⊙ SiLU'(p)) W (torch: silu_backward + mm); ``+= g@W`` accumulates into the output (addmm_).
Writes ``bench_gemm_<gpu>.md``.

``floor µs``: the larger of the call's bytes (A, B, C, and the prologue's or accumulator's extra operand, float32)
at this device's measured copy bandwidth, and its products at the measured rate of a large TF32 ``torch.mm``,
three times (tf32x3: three MMAs per product); ``ours / floor`` says how far a call is from what the device allows
(stop 42's profile found the large-M GEMMs of a g2 step at ~28 µs where such a floor is ~4-7 µs).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.nn import functional as nnf

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import back_to_back_us, device_slug, environment, graph_time_per_call_us, write_lines
from mlff_distiller.kernels import gemm

# (form, K, N) of the 128-feature student: φ / mixing / U,V / readout layers and their backward GEMMs.
SHAPES = [
    ("linear", 128, 128),
    ("linear+silu", 128, 128),
    ("linear", 128, 384),
    ("linear", 128, 256),
    ("linear+silu", 256, 128),
    ("g@W", 384, 128),
    ("silu'(p)*g@W", 128, 256),
    ("+= g@W", 256, 128),
]


def _case(form: str, m: int, k: int, n: int, device, grid: bool = False):
    """(ours, torch's) callables of one form; ``grid``: the weights rounded to TF32 values (a student on the
    TF32 grid, whose products take two MMAs)."""
    gen = torch.Generator(device="cpu").manual_seed(m + k + n)
    x = torch.randn(m, k, generator=gen).to(device)
    p = torch.randn(m, k, generator=gen).to(device)
    w_nk = (torch.randn(n, k, generator=gen) * k**-0.5).to(device)  # nn.Linear layout
    w_kn = (torch.randn(k, n, generator=gen) * k**-0.5).to(device)
    if grid:
        from mlff_distiller.kernels._frozen import round_tf32_

        round_tf32_(w_nk)
        round_tf32_(w_kn)
    b = torch.randn(n, generator=gen).to(device)
    out = torch.randn(m, n, generator=gen).to(device)
    if form == "linear":
        return (lambda: gemm(x, w_nk, b)[0]), (lambda: torch.addmm(b, x, w_nk.t()))
    if form == "linear+silu":
        return (lambda: gemm(x, w_nk, b, act="silu")[0]), (lambda: nnf.silu(torch.addmm(b, x, w_nk.t())))
    if form == "g@W":
        return (lambda: gemm(x, w_kn, transpose_w=False)[0]), (lambda: torch.mm(x, w_kn))
    if form == "silu'(p)*g@W":
        return (
            lambda: gemm(x, w_kn, transpose_w=False, prologue_silu_of=p)[0],
            lambda: torch.mm(torch.ops.aten.silu_backward(x, p), w_kn),
        )
    if form == "+= g@W":
        base = out.clone()

        def ours():
            out.copy_(base)
            return gemm(x, w_kn, transpose_w=False, out=out, accumulate=True)[0]

        def ref():
            out.copy_(base)
            return out.addmm_(x, w_kn)

        return ours, ref
    raise ValueError(form)


def _bytes(form: str, m: int, k: int, n: int) -> int:
    """Bytes a call must move at least: A, B, C (+ the SiLU' prologue's P, + the accumulated output's read)."""
    extra = m * k if form == "silu'(p)*g@W" else (m * n if form == "+= g@W" else 0)
    return 4 * (m * k + k * n + m * n + extra)


def device_rates(device) -> tuple[float, float]:
    """(copy bandwidth GB/s counting reads and writes, TF32 TFLOP/s of a large ``torch.mm``), measured here."""
    from harness import copy_bandwidth, time_fn

    bw = copy_bandwidth(device)
    a = torch.randn(8192, 8192, device=device)
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        t = time_fn(lambda: torch.mm(a, a), device).median_us
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    return bw, 2 * 8192**3 / (t * 1e-6) / 1e12


def floor_us(form: str, m: int, k: int, n: int, bw_gbs: float, tf32_tflops: float) -> float:
    """The call's floor: its bytes at ``bw_gbs`` or its tf32x3 products (3 MMAs each) at ``tf32_tflops``."""
    return max(_bytes(form, m, k, n) / (bw_gbs * 1e3), 3 * 2 * m * k * n / (tf32_tflops * 1e6))


def sweep_tiles(args, device) -> None:
    """The large-M tile sweep (``--tiles``): ours per tile beside cuBLAS, every form, rows above ``small_rows``."""
    import importlib

    lin = importlib.import_module("mlff_distiller.kernels.linear")
    env = environment(device, 0.0)
    tiles = []
    for item in args.tiles.split(","):
        parts = item.split(":")
        bm, bn, warps = (int(t) for t in parts[0].split("x"))
        tiles.append((bm, bn, warps, int(parts[1]), int(parts[2]) if len(parts) > 2 else None))
    lines = [
        "# Triton GEMM tiles for large M (kernels/linear.py `_CONFIG['large']`, `block_k`, stages) vs cuBLAS, float32",
        "",
        f"{env.device} · torch {env.torch} · triton {env.triton} · commit {env.commit}. µs per call: a CUDA graph "
        "of 20 calls, median replay / 20. The backward forms (B = W as stored) run on the Triton GEMM here at every "
        "size. `stages`: num_stages of the launch (default: Triton's).",
        "",
        "| rows M | form | K → N | BM x BN / warps | BK | stages | ours µs | cuBLAS µs | cuBLAS/ours | rel. err |",
        "|---:|---|---|---|---:|---|---:|---:|---:|---:|",
    ]
    for m in args.rows:
        for form, k, n in SHAPES:
            ours, ref = _case(form, m, k, n, device)
            r = ref().clone()
            t_ref = graph_time_per_call_us(ref)
            for bm, bn, warps, bk, stages in tiles:
                old = dict(lin._CONFIG)
                lin._CONFIG.update(large=(bm, bn, warps), large_block_k=bk, untransposed_max_rows=10**9, stages=stages)
                try:
                    a = ours().clone()
                    err = ((a - r).norm() / r.norm()).item()
                    t = graph_time_per_call_us(ours)
                    row = f"{t:.2f} | {t_ref:.2f} | {t_ref / t:.2f} | {err:.1e}"
                except Exception as exc:  # a tile that does not compile (shared memory) is a row saying so
                    row = f"failed: {type(exc).__name__} | {t_ref:.2f} | | "
                finally:
                    lin._CONFIG.clear()
                    lin._CONFIG.update(old)
                lines.append(f"| {m} | {form} | {k} → {n} | {bm} x {bn} / {warps} | {bk} | {stages} | {row} |")
                print(lines[-1], flush=True)
    write_lines(lines, Path(args.out), f"bench_gemm_tiles_{device_slug(device)}")


def ceiling(args, device) -> None:
    """``--ceiling``: how far the shipped large-M GEMM is from what the device allows, weights on the TF32 grid (the
    shipped students' form: two TF32 MMAs per product, "tf32x2w"). Beside it, in the same run: our kernel with one
    TF32 MMA (dot "tf32", what the tf32 precision mode runs), cuBLAS in TF32 (one pass; ``allow_tf32``) and in
    strict float32, and the floor: the call's bytes at the measured copy bandwidth or its two-MMA products at the
    measured TF32 rate, whichever is larger. If cuBLAS's one-pass TF32 call is far below ours, a GEMM kernel can
    go that fast on these shapes; if not, the shipped kernel sits at what these shapes allow."""
    import importlib

    lin = importlib.import_module("mlff_distiller.kernels.linear")
    env = environment(device, 0.0)
    bw, tf32 = device_rates(device)
    lines = [
        "# The large-M Triton GEMM against its ceiling: weights on the TF32 grid, float32",
        "",
        f"{env.device} · torch {env.torch} · triton {env.triton} · commit {env.commit}. µs per call: a CUDA graph "
        "of 20 calls, median replay / 20. ours x2: the shipped kernel (two TF32 MMAs, A split in registers); "
        "ours x1: the same kernel with one TF32 MMA (dot tf32); cuBLAS tf32: one TF32 pass (allow_tf32); cuBLAS "
        f"fp32: strict. floor: bytes at {bw:.0f} GB/s or two TF32 products at {tf32:.0f} TFLOP/s (the larger).",
        "",
        "| rows M | form | K → N | ours x2 µs | ours x1 µs | cuBLAS tf32 µs | cuBLAS fp32 µs | floor µs | x2 / floor "
        "| x2 / cuBLAS tf32 | rel. err x2 |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m in args.rows:
        for form, k, n in SHAPES:
            ours, ref = _case(form, m, k, n, device, grid=True)
            a, r = ours().clone(), ref().clone()
            err = ((a - r).norm() / r.norm()).item()
            t2 = graph_time_per_call_us(ours)
            old = dict(lin._CONFIG)
            lin._CONFIG.update(dot="tf32")
            try:
                t1 = graph_time_per_call_us(ours)
            finally:
                lin._CONFIG.clear()
                lin._CONFIG.update(old)
            t_fp32 = graph_time_per_call_us(ref)
            old_tf32 = torch.backends.cuda.matmul.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = True
            try:
                t_tf32 = graph_time_per_call_us(ref)
            finally:
                torch.backends.cuda.matmul.allow_tf32 = old_tf32
            fl = max(_bytes(form, m, k, n) / (bw * 1e3), 2 * 2 * m * k * n / (tf32 * 1e6))
            lines.append(
                f"| {m} | {form} | {k} → {n} | {t2:.2f} | {t1:.2f} | {t_tf32:.2f} | {t_fp32:.2f} | {fl:.2f} | "
                f"{t2 / fl:.1f} | {t2 / t_tf32:.2f} | {err:.1e} |"
            )
            print(lines[-1], flush=True)
    write_lines(lines, Path(args.out), f"bench_gemm_ceiling_{device_slug(device)}")


def host_cost(args, device) -> None:
    """``--host``: the host time of one large-M launch, element-wise against through tensor descriptors (stop 60's
    TMA launches, which describe each operand on every eager call): 2,000 calls back to back, then one sync; the
    wall time per call is the host's cost where it exceeds the device's (small M), the device's otherwise."""
    import importlib

    lin = importlib.import_module("mlff_distiller.kernels.linear")
    env = environment(device, 0.0)
    lines = [
        "# Host time of a large-M GEMM launch: element-wise loads against tensor descriptors (TMA)",
        "",
        f"{env.device} · torch {env.torch} · triton {env.triton} · commit {env.commit}. Wall µs per call of 2,000 "
        "eager calls back to back (one sync at the end), median of 5 rounds; `device µs`: the same call in a CUDA "
        "graph (bench_gemm's timing).",
        "",
        "| rows M | form | K → N | launch | wall µs per call | device µs |",
        "|---:|---|---|---|---:|---:|",
    ]
    for m in args.rows:
        for form, k, n in (("linear", 128, 384), ("linear+silu", 128, 128)):
            ours, _ = _case(form, m, k, n, device, grid=True)
            for tma in (False, True):
                old = dict(lin._CONFIG)
                lin._CONFIG.update(tma=tma, tma_eager_min_rows=0)
                try:
                    wall = back_to_back_us(ours, 2000, warmup=50)
                    dev_us = graph_time_per_call_us(ours)
                finally:
                    lin._CONFIG.clear()
                    lin._CONFIG.update(old)
                label = "descriptors" if tma else "element-wise"
                lines.append(f"| {m} | {form} | {k} → {n} | {label} | {wall:.2f} | {dev_us:.2f} |")
                print(lines[-1], flush=True)
    write_lines(lines, Path(args.out), f"bench_gemm_host_{device_slug(device)}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 200, 600, 1393, 6944, 21749])
    ap.add_argument(
        "--tiles",
        default="",
        help="sweep the large-M tiles instead: BMxBNxWARPS:BK[:STAGES], comma-separated (e.g. 128x64x4:32:3); the "
        "backward forms run on the Triton GEMM at every size here",
    )
    ap.add_argument("--ceiling", action="store_true", help="the shipped kernel against its ceiling (see ceiling())")
    ap.add_argument("--host", action="store_true", help="a launch's host time, with and without descriptors")
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    if args.host:
        return host_cost(args, device)
    if args.ceiling:
        return ceiling(args, device)
    if args.tiles:
        return sweep_tiles(args, device)
    env = environment(device, 0.0)
    bw, tf32 = device_rates(device)
    lines = [
        "# Triton GEMMs (kernels/linear.py) vs cuBLAS on the student's layer shapes, float32",
        "",
        f"{env.device} · torch {env.torch} · triton {env.triton} · commit {env.commit}. µs per call: a CUDA graph "
        "of 20 calls, median replay / 20. `+= g@W` includes a copy that restores the output (both sides). floor: "
        f"the call's bytes at the measured copy bandwidth ({bw:.0f} GB/s) or its products three times at the "
        f"measured TF32 rate of an 8192³ torch.mm ({tf32:.0f} TFLOP/s), whichever is larger.",
        "",
        "| rows M | form | K → N | ours µs | cuBLAS µs | cuBLAS / ours | floor µs | ours / floor | max rel. error |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for m in args.rows:
        for form, k, n in SHAPES:
            ours, ref = _case(form, m, k, n, device)
            a, r = ours().clone(), ref().clone()
            err = ((a - r).norm() / r.norm()).item()
            t_ours, t_ref = graph_time_per_call_us(ours), graph_time_per_call_us(ref)
            fl = floor_us(form, m, k, n, bw, tf32)
            lines.append(
                f"| {m} | {form} | {k} → {n} | {t_ours:.2f} | {t_ref:.2f} | {t_ref / t_ours:.2f} | {fl:.2f} | "
                f"{t_ours / fl:.1f} | {err:.1e} |"
            )
            print(lines[-1], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"bench_gemm_{device_slug(device)}.md"
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
