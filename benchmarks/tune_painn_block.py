"""Launch sweep of the fused atom-wise PaiNN block (kernels/painn_block.py) against the path it replaces.

    python benchmarks/tune_painn_block.py --out benchmarks/results [--sizes 64 200 6944 21749] [--configs ...]

For each atom count N (F = 128, float32, frozen random weights at nn.Linear scale) it times forward + the
backward of one ``autograd.grad`` wrt Δs and Δv, captured as a CUDA graph (device time, ``harness.time_graph``):

* ``unfused``: what the model ran before, s + Δs, v + Δv, the fused update block (painn_update: Triton + cuBLAS)
  and the next layer's φ MLP in torch;
* ``block BN/W/NC[/DOT]``: painn_block with BLOCK_N atoms per program, W warps, NC-feature GEMM chunks (and the
  tl.dot input precision, default the shipped one).

Each row checks its outputs and gradients against the unfused path first (max relative error, normwise).
Writes ``tune_painn_block_<gpu>.md``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import device_slug, environment, time_graph
from mlff_distiller.kernels import painn_block, painn_update, use_backend

pb = importlib.import_module("mlff_distiller.kernels.painn_block")

CONFIGS = ["16/4/32", "16/4/128", "16/8/128", "32/4/32", "32/8/64", "64/8/32", "64/8/64"]


def _inputs(n: int, f: int, device):
    g = torch.Generator(device="cpu").manual_seed(n)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device)

    s, ds, v, dv = r(n, f), r(n, f).requires_grad_(), r(n, 3, f), r(n, 3, f).requires_grad_()
    upd = (r(f, f, scale=f**-0.5), r(f, f, scale=f**-0.5), r(f, 2 * f, scale=(2 * f) ** -0.5), r(f) * 0.1)
    upd += (r(3 * f, f, scale=f**-0.5), r(3 * f) * 0.1)
    head = (r(f, f, scale=f**-0.5), r(f) * 0.1, r(3 * f, f, scale=f**-0.5), r(3 * f) * 0.1)
    ups = (r(n, f), r(n, 3, f), r(n, 3 * f))
    return s, ds, v, dv, upd, head, ups


def _unfused(s, ds, v, dv, upd, head):
    s_o, v_o = painn_update(s + ds, v + dv, *upd)
    x = torch.nn.functional.linear(torch.nn.functional.silu(torch.nn.functional.linear(s_o, *head[:2])), *head[2:])
    return s_o, v_o, x


def _grad_step(fn, ds, dv, ups):
    def run():
        return torch.autograd.grad(fn(), (ds, dv), ups)

    return run


def _sweep(n: int, f: int, configs: list[str], device) -> list[str]:
    lines = []
    s, ds, v, dv, upd, head, ups = _inputs(n, f, device)
    unf = _grad_step(lambda: _unfused(s, ds, v, dv, upd, head), ds, dv, ups)
    ref_out = [t.detach() for t in _unfused(s, ds, v, dv, upd, head)] + list(unf())
    t_ref = time_graph(unf, device)
    lines.append(f"| {n} | unfused (painn_update + torch φ) | {t_ref.median_us:.1f} | 1.00 | — |")
    print(lines[-1], flush=True)
    for cfg in configs:
        bn, w, nc, *dot = cfg.split("/")
        old = dict(pb._CONFIG)
        pb._CONFIG.update(block_n=int(bn), num_warps=int(w), chunk=int(nc), dot=dot[0] if dot else old["dot"])
        try:
            run = _grad_step(lambda: painn_block(s, ds, v, dv, upd, "phi", head), ds, dv, ups)
            got = [t.detach() for t in painn_block(s, ds, v, dv, upd, "phi", head)] + list(run())
            err = max(((a - b).norm() / b.norm()).item() for a, b in zip(got, ref_out, strict=True))
            t = time_graph(run, device)
            lines.append(f"| {n} | block {cfg} | {t.median_us:.1f} | {t_ref.median_us / t.median_us:.2f} | {err:.1e} |")
        except Exception as exc:  # a config that does not compile is a result too
            lines.append(f"| {n} | block {cfg} | failed: {type(exc).__name__}: {str(exc)[:80]} | | |")
        finally:
            pb._CONFIG.clear()
            pb._CONFIG.update(old)
        print(lines[-1], flush=True)
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 200, 6944, 21749])
    ap.add_argument("--configs", nargs="+", default=CONFIGS)
    ap.add_argument("--features", type=int, default=128)
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    env = environment(device, 0.0)
    lines = [
        "# Fused atom-wise PaiNN block: launch sweep (forward + backward, CUDA-graph replay, µs)",
        "",
        f"{env.device} · torch {env.torch} · triton {env.triton} · commit {env.commit} · F = {args.features}, float32",
        "",
        "| N atoms | variant | µs | vs unfused | max rel. error vs unfused |",
        "|---:|---|---:|---:|---:|",
    ]
    with use_backend("triton"):
        for n in args.sizes:
            lines += _sweep(n, args.features, args.configs, device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"tune_painn_block_{device_slug(device)}.md"
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
