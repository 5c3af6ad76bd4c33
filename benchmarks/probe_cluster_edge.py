"""A cluster-pair edge backward, timed against the shipped edge kernel (issue 7's large rows; a probe, not shipped).

The shipped edge backward (``_mp_bwd_edge_kernel``) walks receiver-sorted edge tiles and gathers, per edge, the
sender's rows x_a, x_c and p = x_b ⊙ v (5F floats) from L2: at 24,000 water atoms it is gather-bound (1.6 ms a
layer on the H200, its dots ~0.3 ms at peak). ``probe_sender_reuse.py`` counted how much a block of BA
consecutive receivers (spatial order) shares its senders: ~3x at BA = 8, ~4x at 16.

Here each program takes one block of BA receivers and one tile of BS of the block's distinct senders, gathers the
senders' rows once, and computes every (receiver, sender) pair of the tile as a dense [BA x BS] tile, the
non-edges masked (their rows are computed and dropped): per feature chunk the pair products
G = (g_s[i] ⊙ x_a,j, Σ_k g_v[i,k] ⊙ p_j[k], γ_ij ⊙ x_c,j) and their dots with filter_weight (∂rbf), and
w_c = rbf_ij W_cᵀ for ∂u_ij[k] = Σ_f x_c,j w_c g_v[i,k]. Each edge lies in exactly one (block, tile): plain
stores, no atomics. The block-sender structure (``cluster_pairs``) is built once per edge list, outside the timing.

    python benchmarks/probe_cluster_edge.py --out benchmarks/results --name probe_cluster_edge_h200
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import write_lines
from mlff_distiller.kernels._triton_utils import HAS_TRITON, dot_rn, tl, triton


def cluster_pairs(edge_index: torch.Tensor, n_atoms: int, ba: int, bs: int) -> dict:
    """The block-sender structure of receiver-blocked edges: work items (block, sender tile), each with its
    block, its BS senders (-1: padding) and the edge of every (receiver slot, sender slot) pair (-1: no edge)."""
    i, j = edge_index[0].long(), edge_index[1].long()
    dev = edge_index.device
    n_blocks = -(-n_atoms // ba)
    key = (i // ba) * n_atoms + j
    if torch.unique(i * n_atoms + j).numel() != i.numel():
        raise ValueError("cluster_pairs: a (receiver, sender) pair occurs twice (periodic images in a small cell)")
    uniq, inv = torch.unique(key, return_inverse=True)  # distinct (block, sender), sorted
    ublk, uj = uniq // n_atoms, uniq % n_atoms
    counts = torch.bincount(ublk, minlength=n_blocks)
    first = torch.cumsum(counts, 0) - counts
    rank = torch.arange(uniq.numel(), device=dev) - first[ublk]
    tiles = (counts + bs - 1) // bs
    work_first = torch.cumsum(tiles, 0) - tiles
    work = work_first[ublk] + rank // bs
    slot = rank % bs
    n_work = int(tiles.sum())
    senders = torch.full((n_work, bs), -1, dtype=torch.int64, device=dev)
    senders[work, slot] = uj
    pair_edge = torch.full((n_work, ba, bs), -1, dtype=torch.int32, device=dev)
    pair_edge[work[inv], i % ba, slot[inv]] = torch.arange(i.numel(), dtype=torch.int32, device=dev)
    block = torch.repeat_interleave(torch.arange(n_blocks, device=dev), tiles)
    return {"block": block, "senders": senders, "pair_edge": pair_edge, "ba": ba, "bs": bs, "n_work": n_work}


if HAS_TRITON:

    @triton.jit
    def _cluster_edge_kernel(
        gs_ptr, gv_ptr, x_ptr, p_ptr, rbf_ptr, w_ptr, unit_ptr, block_ptr, send_ptr, pe_ptr, grbf_ptr, gunit_ptr,
        n_atoms,
        N_FEAT: tl.constexpr, N_RBF: tl.constexpr, R_PAD: tl.constexpr, BA: tl.constexpr, BS: tl.constexpr,
        BF: tl.constexpr, DOT: tl.constexpr,
    ):  # fmt: skip
        w = tl.program_id(0).to(tl.int64)
        P: tl.constexpr = BA * BS
        blk = tl.load(block_ptr + w)
        ia = blk * BA + tl.arange(0, BA)
        am = ia < n_atoms
        js = tl.load(send_ptr + w * BS + tl.arange(0, BS))
        jm = js >= 0
        js = tl.where(jm, js, 0)
        slots = tl.arange(0, BA)[:, None] * BS + tl.arange(0, BS)[None, :]
        eid = tl.reshape(tl.load(pe_ptr + w * P + slots), (P,)).to(tl.int64)
        pm = eid >= 0
        eid = tl.where(pm, eid, 0)
        r = tl.arange(0, R_PAD)
        rm = r < N_RBF
        rb = tl.load(rbf_ptr + eid[:, None] * N_RBF + r[None, :], mask=pm[:, None] & rm[None, :], other=0.0)
        u0 = tl.reshape(tl.load(unit_ptr + eid * 3, mask=pm, other=0.0), (BA, BS))
        u1 = tl.reshape(tl.load(unit_ptr + eid * 3 + 1, mask=pm, other=0.0), (BA, BS))
        u2 = tl.reshape(tl.load(unit_ptr + eid * 3 + 2, mask=pm, other=0.0), (BA, BS))
        dt = x_ptr.dtype.element_ty
        acc = tl.zeros((P, R_PAD), dtype=dt)
        gu0 = tl.zeros((P,), dtype=dt)
        gu1 = tl.zeros((P,), dtype=dt)
        gu2 = tl.zeros((P,), dtype=dt)
        for f0 in range(0, N_FEAT, BF):
            f = f0 + tl.arange(0, BF)
            ma = am[:, None]
            mj = jm[:, None]
            gs = tl.load(gs_ptr + ia[:, None] * N_FEAT + f[None, :], mask=ma, other=0.0)
            g0 = tl.load(gv_ptr + ia[:, None] * (3 * N_FEAT) + f[None, :], mask=ma, other=0.0)
            g1 = tl.load(gv_ptr + ia[:, None] * (3 * N_FEAT) + N_FEAT + f[None, :], mask=ma, other=0.0)
            g2 = tl.load(gv_ptr + ia[:, None] * (3 * N_FEAT) + 2 * N_FEAT + f[None, :], mask=ma, other=0.0)
            xa = tl.load(x_ptr + js[:, None] * (3 * N_FEAT) + f[None, :], mask=mj, other=0.0)
            xc = tl.load(x_ptr + js[:, None] * (3 * N_FEAT) + 2 * N_FEAT + f[None, :], mask=mj, other=0.0)
            p0 = tl.load(p_ptr + js[:, None] * (3 * N_FEAT) + f[None, :], mask=mj, other=0.0)
            p1 = tl.load(p_ptr + js[:, None] * (3 * N_FEAT) + N_FEAT + f[None, :], mask=mj, other=0.0)
            p2 = tl.load(p_ptr + js[:, None] * (3 * N_FEAT) + 2 * N_FEAT + f[None, :], mask=mj, other=0.0)
            m_a = tl.reshape(gs[:, None, :] * xa[None, :, :], (P, BF))
            beta = g0[:, None, :] * p0[None, :, :] + g1[:, None, :] * p1[None, :, :] + g2[:, None, :] * p2[None, :, :]
            gamma = g0[:, None, :] * u0[:, :, None] + g1[:, None, :] * u1[:, :, None] + g2[:, None, :] * u2[:, :, None]
            xc3 = xc[None, :, :] + tl.zeros((BA, BS, BF), dtype=dt)
            m_c = tl.reshape(gamma * xc3, (P, BF))
            fr = f[:, None]
            wa = tl.load(w_ptr + fr * N_RBF + r[None, :], mask=rm[None, :], other=0.0)
            wb = tl.load(w_ptr + (N_FEAT + fr) * N_RBF + r[None, :], mask=rm[None, :], other=0.0)
            wc = tl.load(w_ptr + (2 * N_FEAT + fr) * N_RBF + r[None, :], mask=rm[None, :], other=0.0)
            acc += dot_rn(m_a, wa, DOT)
            acc += dot_rn(tl.reshape(beta, (P, BF)), wb, DOT)
            acc += dot_rn(m_c, wc, DOT)
            wct = tl.load(w_ptr + (2 * N_FEAT + f[None, :]) * N_RBF + r[:, None], mask=rm[:, None], other=0.0)
            t = dot_rn(rb, wct, DOT) * tl.reshape(xc3, (P, BF))  # x_c,j ⊙ w_c,ij
            gu0 += tl.sum(t * tl.reshape(g0[:, None, :] + tl.zeros((BA, BS, BF), dtype=dt), (P, BF)), axis=1)
            gu1 += tl.sum(t * tl.reshape(g1[:, None, :] + tl.zeros((BA, BS, BF), dtype=dt), (P, BF)), axis=1)
            gu2 += tl.sum(t * tl.reshape(g2[:, None, :] + tl.zeros((BA, BS, BF), dtype=dt), (P, BF)), axis=1)
        tl.store(grbf_ptr + eid[:, None] * N_RBF + r[None, :], acc, mask=pm[:, None] & rm[None, :])
        tl.store(gunit_ptr + eid * 3, gu0, mask=pm)
        tl.store(gunit_ptr + eid * 3 + 1, gu1, mask=pm)
        tl.store(gunit_ptr + eid * 3 + 2, gu2, mask=pm)


def cluster_edge_grads(grad_s, grad_v, x, v, rbf, w, unit, pairs, block_f=32, warps=4, dot=None):
    """``(∂rbf [E, R], ∂u [E, 3])`` of the message step (as ``message_passing_backward_reference``) through the
    cluster-pair kernel; ``pairs`` from :func:`cluster_pairs` on the same edges. p = x_b ⊙ v is made here."""
    n, f = v.shape[0], v.shape[2]
    if f % block_f:
        raise ValueError(f"the probe kernel wants F a multiple of block_f, got F = {f}, block_f = {block_f}")
    p = (x[:, f : 2 * f].unsqueeze(1) * v).contiguous()
    g_rbf, g_unit = torch.zeros_like(rbf), torch.zeros_like(unit)  # rows of no pair (none: every edge is in one)
    if dot is None:
        dot = "tf32x3" if x.is_cuda and x.dtype == torch.float32 else "ieee"
    r_pad = max(16, triton.next_power_of_2(rbf.shape[1]))
    _cluster_edge_kernel[(pairs["n_work"],)](
        grad_s.contiguous(), grad_v.contiguous(), x.contiguous(), p, rbf.contiguous(), w.contiguous(),
        unit.contiguous(), pairs["block"], pairs["senders"], pairs["pair_edge"], g_rbf, g_unit, n,
        N_FEAT=f, N_RBF=rbf.shape[1], R_PAD=r_pad, BA=pairs["ba"], BS=pairs["bs"], BF=block_f, DOT=dot,
        num_warps=warps,
    )  # fmt: skip
    return g_rbf, g_unit


def _water_graph(n_atoms: int, device):
    """A water box in the engine's spatial order, its 5 Å list (receiver-sorted), unit vectors and a radial
    basis of 20 rows per edge (the student's Bessel functions are not needed for timing: any non-zero values)."""
    from systems import water_box

    from mlff_distiller import AtomsBatch
    from mlff_distiller.neighbors import neighbor_list
    from mlff_distiller.ordering import spatial_order

    batch = AtomsBatch.from_atoms(water_box(n_atoms, seed=0), dtype=torch.float32).to(device)
    perm = spatial_order(batch.positions, batch.batch, 1, 2.5)
    pos = batch.positions[perm].contiguous()
    nl = neighbor_list(pos, batch.cell, batch.pbc, batch.batch, batch.ptr, 5.0)
    ei = nl.edge_index
    vec = pos[ei[1]] - pos[ei[0]] + nl.shift_vectors
    d = vec.norm(dim=1, keepdim=True)
    unit = (vec / d).contiguous()
    k = torch.arange(1, 21, device=device, dtype=torch.float32)
    rbf = (torch.sin(k * torch.pi * d / 5.0) / d * (1 - d / 5.0) ** 2).contiguous()
    return ei, rbf, unit, pos.shape[0]


def _rows(n: int, tiles: list[str], device) -> list[str]:
    """One water box: the shipped edge kernel (``_edge_grads``, as a layer's backward runs it, fold included) and
    each cluster tiling, timed in the same process on the same random features, with their largest deviation."""
    from triton.testing import do_bench

    mp = importlib.import_module("mlff_distiller.kernels.message_passing")
    f = 128
    ei, rbf, unit, n_atoms = _water_graph(n, device)
    x = torch.randn(n_atoms, 3 * f, device=device)
    v = torch.randn(n_atoms, 3, f, device=device)
    gs = torch.randn(n_atoms, f, device=device)
    gv = torch.randn(n_atoms, 3, f, device=device)
    w = torch.randn(3 * f, 20, device=device) / 20**0.5
    row_ptr = torch.searchsorted(ei[0].contiguous(), torch.arange(n_atoms + 1, device=device))
    args = (gs, gv, x, v, rbf, w, unit)
    ref = mp._edge_grads(*args, ei, row_ptr, True, mp._bare)
    t_ref = do_bench(lambda: mp._edge_grads(*args, ei, row_ptr, True, mp._bare), warmup=25, rep=200)
    head = f"| {n_atoms} | {ei.shape[1]} |"
    out = []
    for spec in tiles:
        ba, bs, bf, warps = (int(t) for t in spec.split("x"))
        pairs = cluster_pairs(ei, n_atoms, ba, bs)
        try:
            got = cluster_edge_grads(*args, pairs, bf, warps)
            torch.cuda.synchronize()
            t = do_bench(lambda p=pairs, b=bf, k=warps: cluster_edge_grads(*args, p, b, k), warmup=25, rep=200)
        except Exception as exc:  # a tiling that does not compile (shared memory, registers) is a row
            out.append(f"{head} {spec} | {pairs['n_work']} | failed: {type(exc).__name__} | {t_ref:.3f} | | | |")
            continue
        e_rbf = float((got[0] - ref[0]).abs().max() / ref[0].abs().max())
        e_u = float((got[1] - ref[1]).abs().max() / ref[1].abs().max())
        out.append(
            f"{head} {spec} | {pairs['n_work']} | {t:.3f} | {t_ref:.3f} | {t_ref / t:.2f} | {e_rbf:.1e} | {e_u:.1e} |"
        )
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--name", default="probe_cluster_edge_h200")
    ap.add_argument("--sizes", type=int, nargs="+", default=[3000, 24000])
    ap.add_argument("--tiles", default="8x16x32x4,8x16x32x8,8x32x32x8,16x16x32x8,8x16x16x4")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_cluster_edge: needs CUDA")
        return
    torch.manual_seed(0)
    lines = [
        "# probe_cluster_edge.py: the edge backward as cluster pairs against the shipped edge kernel",
        "",
        f"{torch.cuda.get_device_name()} · torch {torch.__version__} · triton {triton.__version__} · F = 128, R = 20,"
        " float32 (tf32x3 dots) · median of do_bench (ms) · both include the fold p = x_b ⊙ v",
        "",
        "| atoms | edges | BA x BS x BF x warps | work items | ms | shipped ms | shipped / this | ∂rbf dev | ∂u dev |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for n in args.sizes:
        lines += _rows(n, args.tiles.split(","), torch.device("cuda"))
    lines += ["", "dev: max |Δ| / max |shipped| over all edges."]
    write_lines(lines, args.out, args.name)


if __name__ == "__main__":
    main()
