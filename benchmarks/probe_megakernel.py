"""Probe (GPU): the floor of a persistent per-molecule kernel, one CTA walking the whole step's weights.

The idea for issue 5's small-molecule targets (docs/performance.md, stop 20): one launch per step, each program
holding a tile of BM atom rows (one molecule, or several small ones packed) and running every layer in turn,
the weights streamed from L2. Whatever such a kernel also does (message passing, the backward's bookkeeping), it
cannot beat a dependent chain of its GEMMs: this probe times exactly that chain. ``L`` dependent
``h ← SiLU(h W_l)`` steps of [BM, 128] x [128, 128] (fp32, tf32x3 dots like the shipped kernels; tf32 beside), with
``W_l`` read from global memory each time: L = 68 is the default student's weight volume of one energy + forces
step (~0.56 M parameters read in the forward and again in the backward, 2 x 0.56 M / 128² ≈ 68).

Rows: one program (a lone molecule: the latency floor), then 132 x k programs (throughput: µs per tile), for
BM = 16 and 64, num_warps 4 and 8; ``L = 0`` (the launch alone) beside. Timed with ``triton.testing.do_bench``
(median) on random inputs; each configuration is first checked against torch in float64 on a short chain.

    python benchmarks/probe_megakernel.py --out benchmarks/results [--name probe_megakernel_h100]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import write_lines
from mlff_distiller.kernels._triton_utils import HAS_TRITON, tl, triton

F = 128
STEP_LAYERS = 68

if HAS_TRITON:

    @triton.jit
    def _chain_kernel(x_ptr, w_ptr, out_ptr, L, BM: tl.constexpr, F_: tl.constexpr, DOT: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
        f = tl.arange(0, F_)
        h = tl.load(x_ptr + rows[:, None] * F_ + f[None, :])
        for layer in range(L):
            w = tl.load(w_ptr + layer * F_ * F_ + f[:, None] * F_ + f[None, :])
            h = tl.dot(h, w, input_precision=DOT)
            h = h * (1.0 / (1.0 + tl.exp(-h)))
        tl.store(out_ptr + rows[:, None] * F_ + f[None, :], h)


def chain(x: torch.Tensor, w: torch.Tensor, layers: int, bm: int, warps: int, dot: str) -> torch.Tensor:
    """``layers`` steps of ``h ← SiLU(h W_l)`` per ``bm``-row tile of ``x [T·bm, F]`` (``w [L, F, F]``)."""
    out = torch.empty_like(x)
    grid = (x.shape[0] // bm,)
    _chain_kernel[grid](x, w, out, layers, BM=bm, F_=F, DOT=dot if x.is_cuda else "ieee", num_warps=warps)
    return out


def _time(x, w, layers, bm, warps, dot) -> float:
    """Median µs of one launch (``triton.testing.do_bench``)."""
    return 1e3 * triton.testing.do_bench(lambda: chain(x, w, layers, bm, warps, dot), return_mode="median")


def reference(x: torch.Tensor, w: torch.Tensor, layers: int) -> torch.Tensor:
    h = x.double()
    for layer in range(layers):
        h = torch.nn.functional.silu(h @ w[layer].double())
    return h


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--name", default="probe_megakernel_h100")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("probe_megakernel: needs CUDA")
        return
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn((STEP_LAYERS, F, F), device="cuda", generator=gen) * (1.5 / F**0.5)
    lines = [
        "# probe_megakernel.py: a dependent chain of the step's GEMMs in one program per row tile",
        "",
        f"{torch.cuda.get_device_name()} · torch {torch.__version__} · triton {triton.__version__} · {sms} SMs · "
        f"L = {STEP_LAYERS} layers of [BM, {F}] x [{F}, {F}] (fp32 weights, {STEP_LAYERS * F * F * 4 / 1e6:.1f} MB)",
        "",
        "| dot | BM | warps | programs | µs, L = 0 | µs, L = 68 | µs per program-layer | max rel. err. (L = 4) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for dot in ("tf32x3", "tf32"):
        for bm in (16, 64):
            for warps in (4, 8):
                x_small = torch.randn((bm, F), device="cuda", generator=gen)
                try:
                    got = chain(x_small, w, 4, bm, warps, dot)
                except Exception as exc:  # a tile the compiler cannot take (shared memory): report, go on
                    lines.append(f"| {dot} | {bm} | {warps} | — | failed: {type(exc).__name__} | | | |")
                    continue
                want = reference(x_small, w, 4)
                err = float(((got.double() - want).abs().max() / want.abs().max()).item())
                for programs in (1, sms, 4 * sms, 16 * sms):
                    x = torch.randn((programs * bm, F), device="cuda", generator=gen)
                    t0 = _time(x, w, 0, bm, warps, dot)
                    t = _time(x, w, STEP_LAYERS, bm, warps, dot)
                    per = (t - t0) / STEP_LAYERS / max(1, programs // sms)
                    cells = f"{programs} | {t0:.1f} | {t:.1f} | {per:.3f} | {err:.1e}"
                    lines.append(f"| {dot} | {bm} | {warps} | {cells} |")
                    print(lines[-1], flush=True)
    lines += [
        "",
        "µs per program-layer: (t(L = 68) - t(L = 0)) / 68 / (programs per SM): the time one layer of one tile",
        "costs an SM when every SM holds programs. One program: the latency of a lone tile's chain.",
    ]
    write_lines(lines, args.out, args.name)


if __name__ == "__main__":
    main()
