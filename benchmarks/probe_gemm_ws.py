"""Probe (GPU): a persistent, warp-specialised GEMM through tensor descriptors beside the shipped large-M GEMM.

    python benchmarks/probe_gemm_ws.py --out DIR [--rows 3000 5400 22000 66000]

Stop 60's ceiling bench put the shipped GEMM 2-3x above the floor of its bytes at 22,000-66,000 rows, with cuBLAS's
one-pass TF32 call 1.0-2.1x faster; tiles, persistent grids without warp specialisation, TMA and a fused MLP were
tried since. What was left untried: a persistent kernel whose loads run in a producer warp group while the consumer
groups multiply (Triton's ``tl.range(..., warp_specialize=True)``, Hopper's automatic warp specialisation in Triton
3.5+), so that one tile's epilogue overlaps the next tile's loads. This probe times that kernel (and the same kernel
without warp specialisation, with and without the flattened loop) against ``linear.gemm`` on the student's
forward forms (``linear`` = A Wᵀ + b, ``linear+silu`` also storing the pre-activation), float32 with the weights on
the TF32 grid (the shipped students': two TF32 MMAs, A split in registers by the shipped ``_tile_dot``).

Each variant first has to give the shipped GEMM's bits (same K step, same dot): a variant that does not is reported
and not timed. Times: a CUDA graph replaying 20 calls, median replay / 20 (harness.graph_time_per_call_us).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import graph_time_per_call_us

SHAPES = [("linear", 128, 384), ("linear", 128, 256), ("linear+silu", 128, 128), ("linear+silu", 256, 128)]


try:
    import triton
    import triton.language as tl
    from mlff_distiller.kernels._gemm_kernels import _sigmoid, _tile_dot
    from mlff_distiller.kernels._triton_utils import pdl_prologue

    @triton.jit
    def _gemm_ws_kernel(
        a_desc, b_desc, bias_ptr, c_desc, pre_desc, m, n, k,
        EPI: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr,
        NUM_PROGS: tl.constexpr, WS: tl.constexpr, FLATTEN: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """Persistent: program p takes tiles p, p + NUM_PROGS, ... (column tiles of a row tile side by side), the
        shipped tile's K steps and dot, bias, SiLU with its pre-activation stored."""
        pdl_prologue(PDL)
        n_col = tl.cdiv(n, BN)
        num_tiles = tl.cdiv(m, BM) * n_col
        k_tiles = tl.cdiv(k, BK)
        for tile in tl.range(tl.program_id(0), num_tiles, NUM_PROGS, flatten=FLATTEN, warp_specialize=WS):
            m0 = (tile // n_col) * BM
            n0 = (tile % n_col) * BN
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for ki in range(k_tiles):
                a = a_desc.load([m0, ki * BK])
                b = b_desc.load([n0, ki * BK]).T
                acc = _tile_dot(acc, a, b, b, DOT)
            cols = n0 + tl.arange(0, BN)
            acc += tl.load(bias_ptr + cols, mask=cols < n, other=0.0)[None, :]
            if EPI == 1:
                pre_desc.store([m0, n0], acc)
                acc = acc * _sigmoid(acc)
            c_desc.store([m0, n0], acc)

except ImportError:  # the development machine without Triton: nothing to run here
    _gemm_ws_kernel = None


def _launch(kernel, a, w, b, act, cfg, sms):
    from triton.tools.tensor_descriptor import TensorDescriptor

    bm, bn, bk, warps, stages, ws, flatten, occ = cfg
    m, k = a.shape
    n = w.shape[0]
    out = a.new_empty((m, n))
    pre = a.new_empty((m, n)) if act == "silu" else out
    tiles = -(-m // bm) * -(-n // bn)
    progs = min(tiles, sms * occ)
    d = TensorDescriptor.from_tensor
    kernel[(progs,)](
        d(a, [bm, bk]), d(w, [bn, bk]), b, d(out, [bm, bn]), d(pre, [bm, bn]), m, n, k,
        EPI=1 if act == "silu" else 0, BM=bm, BN=bn, BK=bk, DOT="tf32x2f", NUM_PROGS=progs, WS=ws, FLATTEN=flatten,
        PDL=True, launch_pdl=True, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out, (pre if act == "silu" else None)


# (BM, BN, BK, warps, stages, warp_specialize, flatten, programs per SM)
VARIANTS = [
    (64, 64, 32, 4, 3, False, False, 4),
    (64, 64, 32, 4, 3, False, True, 4),
    (64, 64, 32, 4, 3, True, False, 2),
    (64, 64, 32, 4, 3, True, False, 4),
    (64, 64, 32, 4, 3, True, False, 1),
    (64, 64, 32, 4, 2, True, False, 2),
    (128, 64, 32, 8, 3, True, False, 1),
    (128, 128, 32, 8, 3, True, False, 1),
    (64, 128, 32, 4, 3, True, False, 2),
    (128, 64, 32, 4, 4, True, True, 2),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", type=int, nargs="+", default=[3000, 5400, 22000, 66000])
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    from mlff_distiller.kernels import gemm
    from mlff_distiller.kernels._frozen import round_tf32_

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    import triton

    kernel = _gemm_ws_kernel
    env = f"{torch.cuda.get_device_name(dev)} · torch {torch.__version__} · triton {triton.__version__}"
    lines = [
        "# probe_gemm_ws: a persistent warp-specialised descriptor GEMM beside the shipped large-M GEMM",
        "",
        f"{env} · fp32, weights on the TF32 grid (two TF32 MMAs). µs per call (CUDA graph of 20 calls, median / 20); "
        "ratio = shipped / variant (> 1: the variant is faster); `bits` = equal to the shipped output bit for bit.",
        "",
        "| rows | form | K → N | shipped µs | variant (BM, BN, BK, warps, stages, ws, flatten, progs/SM) | µs | ratio "
        "| bits |",
        "|---:|---|---|---:|---|---:|---:|---|",
    ]
    records = []
    for m in args.rows:
        for form, k, n in SHAPES:
            gen = torch.Generator(device="cpu").manual_seed(m + k + n)
            a = torch.randn(m, k, generator=gen).to(dev)
            w = (torch.randn(n, k, generator=gen) * k**-0.5).to(dev)
            round_tf32_(w)
            b = torch.randn(n, generator=gen).to(dev)
            act = "silu" if form == "linear+silu" else "none"
            ref, ref_pre = gemm(a, w, b, act=act)
            t_ref = graph_time_per_call_us(lambda a=a, w=w, b=b, act=act: gemm(a, w, b, act=act))
            for cfg in VARIANTS:
                rec = {"rows": m, "form": form, "k": k, "n": n, "cfg": cfg, "shipped_us": t_ref}
                try:
                    out, pre = _launch(kernel, a, w, b, act, cfg, sms)
                    torch.cuda.synchronize()
                    same = torch.equal(out, ref) and (pre is None or torch.equal(pre, ref_pre))
                    rel = float((out - ref).abs().max() / ref.abs().max())
                    t = graph_time_per_call_us(
                        lambda cfg=cfg, a=a, w=w, b=b, act=act: _launch(kernel, a, w, b, act, cfg, sms)
                    )
                    rec.update(us=t, ratio=t_ref / t, bits=same, rel=rel)
                    bits = "yes" if same else f"no ({rel:.1e})"
                    lines.append(
                        f"| {m} | {form} | {k} → {n} | {t_ref:.2f} | {cfg} | {t:.2f} | {t_ref / t:.3f} | {bits} |"
                    )
                except Exception as exc:  # a variant that does not compile on this Triton: reported, not fatal
                    rec.update(error=f"{type(exc).__name__}: {str(exc)[:300]}")
                    lines.append(
                        f"| {m} | {form} | {k} → {n} | {t_ref:.2f} | {cfg} | error | — | {type(exc).__name__} |"
                    )
                records.append(rec)
                print(lines[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "probe_gemm_ws.md").write_text("\n".join(lines) + "\n")
    (args.out / "probe_gemm_ws.json").write_text(json.dumps(records, indent=1))
    print(f"wrote {args.out / 'probe_gemm_ws.md'}")


if __name__ == "__main__":
    main()
