"""Probe (GPU): the inference backward of one message step with the edge gradients folded into the sender kernel.

The inference backward of a message step (∂x, ∂v for the layer below, ∂rbf, ∂u for the forces) ran as two passes
over the edges: the sender kernel (per sender, gathering g_s[i], g_v[i]) and the edge kernel (per edge, gathering
g_s[i], g_v[i], x_j and v_j again). With ``bwd_edge_fuse`` the sender kernel also writes each edge's partial
∂rbf / ∂u rows over its feature chunk (it already holds every factor), and one launch sums the chunks. This
times one layer's backward, per call in a CUDA graph, both ways and for a few sender tilings, on water-like
graphs (atom sender kernel) and on a batch of small molecules (~7 pairs per atom: the block sender kernel), and
checks every result against the unfused one.

    python benchmarks/probe_edge_fuse.py --out benchmarks/results [--sizes 192 3000 24000] [--molecules 4096]
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_message_passing import N_FEAT, N_RBF, water_like_graph
from harness import graph_time_per_call_us

mp = importlib.import_module("mlff_distiller.kernels.message_passing")

# (label, launch configuration); the first is the reference the others are checked against.
CONFIGS = [
    ("sender + edge kernels", dict(bwd_edge_fuse=False)),
    ("fused (shipped tiles)", dict(bwd_edge_fuse=True)),
    ("fused 16x128 w4", dict(bwd_edge_fuse=True, block_e=16, block_f=128, num_warps=4)),
    ("fused 16x128 w8", dict(bwd_edge_fuse=True, block_e=16, block_f=128, num_warps=8)),
    ("fused 32x64 w4", dict(bwd_edge_fuse=True, block_e=32, block_f=64, num_warps=4)),
    ("fused 16x32 w4", dict(bwd_edge_fuse=True, block_e=16, block_f=32, num_warps=4)),
    ("fused 32x32 w4", dict(bwd_edge_fuse=True, block_e=32, block_f=32, num_warps=4)),
]
BLOCK_CONFIGS = [
    ("sender + edge kernels", dict(bwd_edge_fuse=False)),
    ("fused (shipped tiles)", dict(bwd_edge_fuse=True)),
    ("fused block 16x16x32 w4", dict(bwd_edge_fuse=True, bwd_sender_block_f=32)),
    ("fused block 16x32x64 w4", dict(bwd_edge_fuse=True, bwd_sender_block_e=32)),
    ("fused block 16x16x128 w8", dict(bwd_edge_fuse=True, bwd_sender_block_f=128, bwd_sender_warps=8)),
]


def molecules_graph(n_mol: int, device: torch.device, seed: int = 0):
    """Inputs of the message step for a batch of small molecules: 2-14 atoms each, every pair within a molecule an
    edge (g2-like: ~7 pairs per atom), receiver-sorted; random features, distances 0.9-3 Å."""
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(2, 15, (n_mol,), generator=gen)
    starts = torch.cumsum(sizes, 0) - sizes
    recv, send = [], []
    for s, k in zip(starts.tolist(), sizes.tolist(), strict=True):
        idx = torch.arange(s, s + k)
        i, j = torch.meshgrid(idx, idx, indexing="ij")
        keep = i != j
        recv.append(i[keep])
        send.append(j[keep])
    ei = torch.stack([torch.cat(recv), torch.cat(send)]).to(device)
    n, e = int(sizes.sum()), ei.shape[1]
    dist = (0.9 + 2.1 * torch.rand(e, generator=gen, dtype=torch.float64)).to(device)
    unit = torch.nn.functional.normalize(torch.randn(e, 3, generator=gen), dim=-1).to(device)
    k = torch.arange(1, N_RBF + 1, device=device, dtype=torch.float64) * math.pi / 5.0
    env = 0.5 * (torch.cos(math.pi * dist / 5.0) + 1)
    rbf = (math.sqrt(2 / 5.0) * torch.sin(k * dist[:, None]) / dist[:, None] * env[:, None]).float()
    x = torch.randn(n, 3 * N_FEAT, generator=gen).to(device)
    v = torch.randn(n, 3, N_FEAT, generator=gen).to(device)
    w = (torch.randn(3 * N_FEAT, N_RBF, generator=gen) / math.sqrt(N_RBF)).to(device)
    return x, v, rbf, w, unit, ei


def probe(label: str, inputs, configs, lines: list[str]) -> None:
    x, v, rbf, w, unit, ei = inputs
    dev = x.device
    n, e = v.shape[0], ei.shape[1]
    row_ptr = mp._receiver_csr(ei, n).row_ptr
    perm, col_ptr = mp._sender_csr(ei, n)
    gen = torch.Generator(device=dev).manual_seed(1)
    gs = torch.randn(n, v.shape[2], generator=gen, device=dev)
    gv = torch.randn(v.shape, generator=gen, device=dev)

    def run():
        return mp._mp_backward(gs, gv, x, v, rbf, w, unit, ei, perm, col_ptr, (True, True, False), mp._bare, row_ptr)

    _, _, variant = mp._launch_config(x, "bwd_sender", v.shape[2], rbf.shape[1], True, n, e)
    ref = None
    base = None
    for name, cfg in configs:
        try:
            with mp._configured(**cfg):
                out = run()
                torch.cuda.synchronize()
                t = graph_time_per_call_us(run)
        except Exception as exc:  # a tiling that does not compile is a row saying so
            lines.append(f"| {label} | {name} | failed: {type(exc).__name__} {str(exc)[:80]} | | |")
            print(lines[-1], flush=True)
            continue
        got = [o.flatten() for o in (out[0], out[1], out[2], out[4])]
        if ref is None:
            ref, base = got, t
        diff = max(((g - r).abs().max() / r.abs().max()).item() for g, r in zip(got, ref, strict=True))
        lines.append(f"| {label} ({n} atoms, {e} pairs, {variant}) | {name} | {t:.1f} | {base / t:.2f} | {diff:.1e} |")
        print(lines[-1], flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--sizes", type=int, nargs="*", default=[192, 3000, 24000])
    p.add_argument("--molecules", type=int, nargs="*", default=[16, 1024, 4096])
    p.add_argument("--name", default="probe_edge_fuse_h100")
    args = p.parse_args()
    dev = torch.device("cuda")
    lines = [
        f"# Inference backward of one message step, edge gradients fused or not ({torch.cuda.get_device_name()}, "
        f"torch {torch.__version__}, triton {triton.__version__})",
        "",
        f"F = {N_FEAT}, R = {N_RBF}, float32, the shipped dot precisions. µs per call (∂x, ∂v, ∂rbf, ∂u of one layer),",
        "20 calls in one CUDA graph, median replay. `speed-up`: the first row's time / this row's. `max rel diff`: the",
        "largest difference of any of the four gradients from the first row's, relative to that gradient's largest",
        "entry. Tiles: block_e x block_f and warps of the sender kernel that runs (atom or block variant).",
        "",
        "| graph | backward | µs | speed-up | max rel diff |",
        "|---|---|---:|---:|---:|",
    ]
    for n in args.sizes:
        probe("water", water_like_graph(n, dev), CONFIGS, lines)
    for m in args.molecules:
        probe(f"{m} molecules", molecules_graph(m, dev), BLOCK_CONFIGS if m >= 256 else CONFIGS, lines)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
