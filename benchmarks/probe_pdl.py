"""Probe (GPU, sm90+): does programmatic dependent launch (PDL) shorten a CUDA graph of many small dependent kernels?

A benzene energy + forces replay is ~70 kernels of 2-4 µs each, most of it per-node overhead, not work. With PDL
(Triton's ``launch_pdl=True``; the kernel calls ``gdc_wait`` before touching memory a prior kernel wrote, and may
call ``gdc_launch_dependents`` to let the next grid start early) the next kernel's launch overlaps the current one.
This times a chain of dependent small kernels in one CUDA graph, each reading the previous kernel's output:

    plain      no PDL
    pdl-wait   launch_pdl, gdc_wait first (the implicit trigger at grid exit)
    pdl-early  launch_pdl, gdc_wait first, then gdc_launch_dependents at once
    pdl-late   launch_pdl, gdc_wait first, gdc_launch_dependents before the final store

and a chain where every fourth kernel is a torch (cuBLAS) matmul, which knows nothing of PDL. Every chain's result is
checked against the plain chain's (bitwise: same kernels, same order of operations).

    python benchmarks/probe_pdl.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import write_lines


@triton.jit
def _step_kernel(x_ptr, y_ptr, w_ptr, n, BLOCK: tl.constexpr, MODE: tl.constexpr):
    # MODE 0 plain, 1 wait, 2 wait + early trigger, 3 wait + late trigger
    if MODE >= 1:
        tl.extra.cuda.gdc_wait()
    if MODE == 2:
        tl.extra.cuda.gdc_launch_dependents()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0.0)
    w = tl.load(w_ptr + offs, mask=m, other=0.0)
    y = x * 0.999 + w * tl.sin(x)
    if MODE == 3:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(y_ptr + offs, y, mask=m)


def chain(bufs, w, k, mode, mm_every=0, mat=None):
    """k dependent steps ping-ponging between two buffers; every ``mm_every``-th step a torch matmul instead."""
    n = bufs[0].numel()
    block = 1024
    grid = (triton.cdiv(n, block),)
    for s in range(k):
        src, dst = bufs[s % 2], bufs[(s + 1) % 2]
        if mm_every and s % mm_every == mm_every - 1:
            torch.mm(src.view(-1, mat.shape[0]), mat, out=dst.view(-1, mat.shape[1]))
        else:
            _step_kernel[grid](src, dst, w, n, BLOCK=block, MODE=mode, launch_pdl=mode > 0)
    return bufs[k % 2]


def time_graph(fn) -> tuple[float, torch.cuda.CUDAGraph]:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return triton.testing.do_bench(g.replay, warmup=50, rep=300, return_mode="median") * 1e3, g


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--kernels", type=int, default=70)
    p.add_argument("--name", default="probe_pdl_h100")
    args = p.parse_args()
    dev = torch.device("cuda")
    k = args.kernels
    lines = [
        f"# Programmatic dependent launch in a CUDA graph of {k} small dependent kernels "
        f"({torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__})",
        "",
        "µs per replay (median of do_bench) and per kernel; `same`: the chain's result equals the plain chain's",
        "bitwise.",
        "",
        "| elements per kernel | chain | mode | µs per replay | µs per kernel | vs plain | same |",
        "|---:|---|---|---:|---:|---:|---|",
    ]
    gen = torch.Generator(device=dev).manual_seed(0)
    for n in (1024, 64 * 128, 1024 * 384):
        w = torch.randn(n, generator=gen, device=dev)
        mat = torch.randn(128, 128, generator=gen, device=dev) / 128**0.5
        x0 = torch.randn(n, generator=gen, device=dev)
        for label, mm_every in (("triton only", 0), ("every 4th a torch.mm", 4)):
            if mm_every and n % 128:
                continue
            base = None
            t_plain = None
            for mode, name in enumerate(("plain", "pdl-wait", "pdl-early", "pdl-late")):
                bufs = [x0.clone(), torch.empty_like(x0)]

                def fn(bufs=bufs, mode=mode, mm_every=mm_every, x0=x0, w=w, mat=mat):
                    bufs[0].copy_(x0)
                    return chain(bufs, w, k, mode, mm_every, mat)

                try:
                    t, g = time_graph(fn)
                    g.replay()
                    torch.cuda.synchronize()
                except Exception as exc:  # PDL unsupported here: a row saying so
                    lines.append(f"| {n} | {label} | {name} | failed: {type(exc).__name__}: {str(exc)[:90]} | | | |")
                    print(lines[-1], flush=True)
                    continue
                out = bufs[k % 2].clone()
                if base is None:
                    base, t_plain = out, t
                same = torch.equal(out, base)
                lines.append(f"| {n} | {label} | {name} | {t:.1f} | {t / (k + 1):.2f} | {t_plain / t:.2f}x | {same} |")
                print(lines[-1], flush=True)
    write_lines(lines, args.out, args.name)


if __name__ == "__main__":
    main()
