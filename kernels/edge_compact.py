"""Drop the edges beyond the cutoff from a static-shape edge list, inside a captured step.

In MD the engine keeps a Verlet-skin list: built at ``cutoff + skin`` and reused for many steps, so about
``((cutoff + skin) / cutoff)³ - 1`` of its pairs (73 % more pairs than the cutoff sphere holds at 5 Å + 1 Å)
lie beyond the cutoff, where every message is exactly zero. They still cost the message-passing kernels their
full work. :func:`edge_compact` moves the pairs within the cutoff to the front of the list, in order, and
rewrites both CSRs so that the rest belongs to no atom; the kernels then never visit them (the forward and
sender backward walk the CSRs, the edge backward stops at ``row_ptr[N]``).

Shapes stay static (a CUDA graph replays it every step): the output has the input's ``C`` slots, the kept pairs
first, then inert padding edges: slot ``k`` joins atom ``k mod A`` to itself, shifted by ``far`` > cutoff (radial
basis × envelope and its derivative are exactly 0 there, so every gradient through them is an exact 0). They are
spread over all atoms rather than piled on one: the edge-geometry backward scatters to the positions with atomics,
and ~7,000 dropped pairs of a 192-atom water box on one atom cost that kernel 31 µs instead of 7 µs (H100). No
host sync.

The test is conservative: a pair is kept when ``|r| < cutoff · (1 + 1e-5)``; every pair it drops has an envelope of
exactly 0 in the model's own arithmetic, so energies and forces equal those of the uncompacted list.

Triton (GPU, or CPU under the interpreter): three launches, ``_keep_kernel`` (the within-cutoff flags of each tile
of edges, in receiver and in sender order, and their counts), ``_compact_kernel`` (each tile's offset from the
counts of the tiles before it, a ``tl.cumsum`` inside the tile, the scatter of the kept edges, the padding tail and
the exclusive prefix sums) and ``_remap_kernel`` (the sender permutation in new edge ids, and both CSR offset
arrays through the prefix sums). The torch reference (the torch backend, and under ``torch.compile``) does the same
with cumsum and index writes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._backend import resolve_backend
from ._compile_ahead import dry_run_active
from ._triton_utils import HAS_TRITON, cdiv, check_launchable, next_pow2, pdl_args, pdl_prologue, tl, triton

__all__ = ["edge_compact", "edge_compact_reference"]

# Relative margin of the keep test: dropped pairs are beyond the cutoff by more than float rounding.
MARGIN = 1e-5


# Edges per program of the Triton kernels: 256 up to 65,536 edge slots (a 192-atom water box's ~17,000 slots in
# 67 programs; at 1,024 per program its 17 programs took 16 µs for the three kernels on an H100), 1,024 above
# (each program of _compact_kernel reads all tile counts: at most 2,048 of them).
def _block(n_edges: int) -> int:
    return 256 if n_edges <= 65536 else 1024


def _check_inputs(positions, edge_index, shift_vectors, row_ptr, sender_perm, sender_ptr) -> None:
    a, c = positions.shape[0], edge_index.shape[-1]
    if positions.dim() != 2 or positions.shape[1] != 3:
        raise ValueError(f"positions must be [A, 3], got {tuple(positions.shape)}")
    if a < 1:
        raise ValueError("edge_compact needs at least one atom (the padding atom the dropped edges point to)")
    if edge_index.shape != (2, c) or shift_vectors.shape != (c, 3):
        raise ValueError(
            f"edge_index must be [2, C] and shift_vectors [C, 3], got {tuple(edge_index.shape)}, "
            f"{tuple(shift_vectors.shape)}"
        )
    if row_ptr.shape != (a + 1,) or sender_ptr.shape != (a + 1,) or sender_perm.shape != (c,):
        raise ValueError(
            f"row_ptr and sender_ptr must be [A + 1] = [{a + 1}] and sender_perm [C] = [{c}], got "
            f"{tuple(row_ptr.shape)}, {tuple(sender_ptr.shape)}, {tuple(sender_perm.shape)}"
        )


def edge_compact(
    positions: Tensor,
    edge_index: Tensor,
    shift_vectors: Tensor,
    row_ptr: Tensor,
    sender_perm: Tensor,
    sender_ptr: Tensor,
    cutoff: float,
    far: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The pairs of a padded, receiver-sorted edge list that lie within ``cutoff``, compacted to the front.

    Args:
        positions: ``[A, 3]`` Å (no gradient is taken through this selection).
        edge_index: ``[2, C]`` int64 receiver i, sender j, sorted by receiver.
        shift_vectors: ``[C, 3]`` Å, r_ij = pos[j] − pos[i] + shift.
        row_ptr: ``[A + 1]`` int64 receiver CSR; edges at or past ``row_ptr[A]`` are dead (dropped).
        sender_perm, sender_ptr: ``[C]`` edge ids in a stable order by sender and ``[A + 1]`` offsets into it.
        cutoff: Å; ``far``: the length of the padding edges' shift (must exceed the cutoff).
    Returns:
        ``(edge_index, shift_vectors, row_ptr, sender_perm, sender_ptr)`` of the same shapes: the kept pairs
        first in their original order (so the first ``row_ptr[A]`` edges stay sorted by receiver), then in slot
        ``k`` the self-pair ``(k mod A, k mod A)`` with shift ``(far, 0, 0)``, which no CSR row contains
        (``row_ptr[A] = sender_ptr[A]`` = the number kept).
    """
    _check_inputs(positions, edge_index, shift_vectors, row_ptr, sender_perm, sender_ptr)
    if not far > cutoff:
        raise ValueError(f"far ({far}) must exceed the cutoff ({cutoff})")
    args = (positions.detach(), edge_index, shift_vectors.detach(), row_ptr, sender_perm, sender_ptr)
    if edge_index.shape[1] > 0 and not torch.compiler.is_compiling() and resolve_backend(positions.device) == "triton":
        return _edge_compact_triton(*args, float(cutoff), float(far))
    return edge_compact_reference(*args, cutoff, far)


def edge_compact_reference(
    positions: Tensor,
    edge_index: Tensor,
    shift_vectors: Tensor,
    row_ptr: Tensor,
    sender_perm: Tensor,
    sender_ptr: Tensor,
    cutoff: float,
    far: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Torch reference of :func:`edge_compact` (static shapes, no host sync: capturable and compilable)."""
    a, c = positions.shape[0], edge_index.shape[1]
    dev = positions.device
    i, j = edge_index[0], edge_index[1]
    d = positions.index_select(0, j) - positions.index_select(0, i) + shift_vectors
    cut = float(cutoff) * (1.0 + MARGIN)
    ids = torch.arange(c, device=dev)
    keep = ((d * d).sum(1) < cut * cut) & (ids < row_ptr[-1])
    # excl[e]: kept edges before e (excl[C]: all kept), the new id of a kept edge e; slot C catches the dropped.
    excl = torch.nn.functional.pad(keep.to(torch.int64).cumsum(0), (1, 0))
    dest = torch.where(keep, excl[:-1], c)
    out_ei = (torch.arange(c + 1, device=dev) % a).to(edge_index.dtype).expand(2, -1).clone()
    out_ei[:, dest] = edge_index
    out_shift = torch.zeros((c + 1, 3), dtype=shift_vectors.dtype, device=dev)
    out_shift[:, 0] = far
    out_shift[dest] = shift_vectors
    keep_s = keep[sender_perm]
    excl_s = torch.nn.functional.pad(keep_s.to(torch.int64).cumsum(0), (1, 0))
    dest_s = torch.where(keep_s, excl_s[:-1], c)
    out_perm = torch.arange(c + 1, dtype=sender_perm.dtype, device=dev)  # the padding tail maps to itself
    out_perm[dest_s] = excl[:-1][sender_perm].to(sender_perm.dtype)
    return (
        out_ei[:, :c].contiguous(),
        out_shift[:c].contiguous(),
        excl[row_ptr].to(row_ptr.dtype),
        out_perm[:c].contiguous(),
        excl_s[sender_ptr].to(sender_ptr.dtype),
    )


if HAS_TRITON:

    @triton.jit
    def _within(pos_ptr, ei_ptr, shift_ptr, ei_stride, e, m, cut2):
        """1 where edge ``e`` (mask ``m``) is shorter than sqrt(cut2), else 0 (int32)."""
        i = tl.load(ei_ptr + e, mask=m, other=0).to(tl.int64)
        j = tl.load(ei_ptr + ei_stride + e, mask=m, other=0).to(tl.int64)
        dx = tl.load(pos_ptr + 3 * j, mask=m, other=0.0) - tl.load(pos_ptr + 3 * i, mask=m, other=0.0)
        dy = tl.load(pos_ptr + 3 * j + 1, mask=m, other=0.0) - tl.load(pos_ptr + 3 * i + 1, mask=m, other=0.0)
        dz = tl.load(pos_ptr + 3 * j + 2, mask=m, other=0.0) - tl.load(pos_ptr + 3 * i + 2, mask=m, other=0.0)
        dx += tl.load(shift_ptr + 3 * e, mask=m, other=0.0)
        dy += tl.load(shift_ptr + 3 * e + 1, mask=m, other=0.0)
        dz += tl.load(shift_ptr + 3 * e + 2, mask=m, other=0.0)
        return (m & (dx * dx + dy * dy + dz * dz < cut2)).to(tl.int32)

    @triton.jit
    def _keep_kernel(
        pos_ptr, ei_ptr, shift_ptr, perm_ptr, live_ptr, keep_ptr, cnt_ptr, C, ei_stride, T, cut2,
        BLOCK: tl.constexpr,
        PDL: tl.constexpr,
    ):  # fmt: skip
        """Flags of tile t in receiver order (keep[0, e]) and in sender order (keep[1, p] = flag of perm[p]), and
        their counts cnt[0, t], cnt[1, t]. The sender-order flags recompute the distances of perm[p] rather than
        gather keep[0]: the other tiles' flags are not written yet, and a gather pass would cost a launch more."""
        pdl_prologue(PDL)
        t = tl.program_id(0)
        e = t.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = e < C
        live = tl.load(live_ptr)
        kr = _within(pos_ptr, ei_ptr, shift_ptr, ei_stride, e, m & (e < live), cut2)
        tl.store(keep_ptr + e, kr, mask=m)
        ep = tl.load(perm_ptr + e, mask=m, other=0).to(tl.int64)
        ks = _within(pos_ptr, ei_ptr, shift_ptr, ei_stride, ep, m & (ep < live), cut2)
        tl.store(keep_ptr + C + e, ks, mask=m)
        tl.store(cnt_ptr + t, tl.sum(kr, axis=0))
        tl.store(cnt_ptr + T + t, tl.sum(ks, axis=0))

    @triton.jit
    def _tile_prefix(keep_ptr, cnt_ptr, e, m, t, T, T_PAD: tl.constexpr):
        """Exclusive prefix sums of the flags of tile t (global: the counts of tiles 0..t-1 added), the flags and
        the total over all tiles."""
        tt = tl.arange(0, T_PAD)
        cnt = tl.load(cnt_ptr + tt, mask=tt < T, other=0)
        offset = tl.sum(tl.where(tt < t, cnt, 0), axis=0)
        total = tl.sum(cnt, axis=0)
        k = tl.load(keep_ptr + e, mask=m, other=0)
        excl = offset + tl.cumsum(k, axis=0) - k
        return excl.to(tl.int64), k, total.to(tl.int64)

    @triton.jit
    def _compact_kernel(
        ei_ptr, shift_ptr, keep_ptr, cnt_ptr, out_ei_ptr, out_shift_ptr, pre_ptr, C, ei_stride, T, A, far,
        BLOCK: tl.constexpr, T_PAD: tl.constexpr,
        PDL: tl.constexpr,
    ):  # fmt: skip
        """Tile t: writes the kept edges at their new ids, the padding self-pairs at the new ids >= total that fall
        in this tile's range, and the exclusive prefix sums pre[0, :] (receiver order), pre[1, :] (sender order);
        pre[., C] = total."""
        pdl_prologue(PDL)
        t = tl.program_id(0)
        e = t.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = e < C
        excl, k, total = _tile_prefix(keep_ptr, cnt_ptr, e, m, t, T, T_PAD)
        tl.store(pre_ptr + e, excl, mask=m)
        kept = m & (k != 0)
        tl.store(out_ei_ptr + excl, tl.load(ei_ptr + e, mask=kept, other=0), mask=kept)
        tl.store(out_ei_ptr + C + excl, tl.load(ei_ptr + ei_stride + e, mask=kept, other=0), mask=kept)
        for d in tl.static_range(3):
            tl.store(out_shift_ptr + 3 * excl + d, tl.load(shift_ptr + 3 * e + d, mask=kept, other=0.0), mask=kept)
        tail = m & (e >= total)
        pad = e % A
        tl.store(out_ei_ptr + e, pad, mask=tail)
        tl.store(out_ei_ptr + C + e, pad, mask=tail)
        zero = tl.zeros((BLOCK,), dtype=out_shift_ptr.dtype.element_ty)
        tl.store(out_shift_ptr + 3 * e, zero + far, mask=tail)
        tl.store(out_shift_ptr + 3 * e + 1, zero, mask=tail)
        tl.store(out_shift_ptr + 3 * e + 2, zero, mask=tail)
        excl_s, _, total_s = _tile_prefix(keep_ptr + C, cnt_ptr + T, e, m, t, T, T_PAD)
        tl.store(pre_ptr + (C + 1) + e, excl_s, mask=m)
        if t == 0:
            tl.store(pre_ptr + C, total)
            tl.store(pre_ptr + (C + 1) + C, total_s)

    @triton.jit
    def _remap_kernel(
        perm_ptr, keep_ptr, pre_ptr, rowptr_ptr, sptr_ptr, out_perm_ptr, out_rowptr_ptr, out_sptr_ptr, C, A1,
        BLOCK: tl.constexpr,
        PDL: tl.constexpr,
    ):  # fmt: skip
        """The sender permutation in new edge ids (kept entries in order, the padding tail to itself) and both CSR
        offset arrays, offset -> number kept before it."""
        pdl_prologue(PDL)
        p = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = p < C
        kept = m & (tl.load(keep_ptr + C + p, mask=m, other=0) != 0)
        ep = tl.load(perm_ptr + p, mask=kept, other=0).to(tl.int64)
        new_id = tl.load(pre_ptr + ep, mask=kept, other=0)
        dest = tl.load(pre_ptr + (C + 1) + p, mask=kept, other=0)
        tl.store(out_perm_ptr + dest, new_id, mask=kept)
        total = tl.load(pre_ptr + C)
        tl.store(out_perm_ptr + p, p, mask=m & (p >= total))
        am = p < A1
        rp = tl.load(rowptr_ptr + p, mask=am, other=0).to(tl.int64)
        tl.store(out_rowptr_ptr + p, tl.load(pre_ptr + rp, mask=am, other=0), mask=am)
        sp = tl.load(sptr_ptr + p, mask=am, other=0).to(tl.int64)
        tl.store(out_sptr_ptr + p, tl.load(pre_ptr + (C + 1) + sp, mask=am, other=0), mask=am)


def _edge_compact_triton(positions, edge_index, shift_vectors, row_ptr, sender_perm, sender_ptr, cutoff, far):
    if not HAS_TRITON:
        raise RuntimeError("the Triton edge compaction needs triton installed; use MLFF_DISTILLER_KERNELS=torch")
    check_launchable(_keep_kernel, positions)
    a, c = positions.shape[0], edge_index.shape[1]
    dev = positions.device
    positions, shift_vectors = positions.contiguous(), shift_vectors.contiguous()
    edge_index, sender_perm = edge_index.contiguous(), sender_perm.contiguous()
    row_ptr, sender_ptr = row_ptr.contiguous(), sender_ptr.contiguous()
    block = _block(c)
    n_tiles = cdiv(c, block)
    t_pad = max(16, next_pow2(n_tiles))
    cut = float(cutoff) * (1.0 + MARGIN)
    keep = torch.empty((2, c), dtype=torch.int32, device=dev)
    cnt = torch.empty((2, n_tiles), dtype=torch.int32, device=dev)
    pre = torch.empty((2, c + 1), dtype=torch.int64, device=dev)
    out_ei = torch.empty((2, c), dtype=torch.int64, device=dev)
    out_shift = torch.empty_like(shift_vectors)
    out_perm = torch.empty((c,), dtype=torch.int64, device=dev)
    out_rowptr = torch.empty((a + 1,), dtype=torch.int64, device=dev)
    out_sptr = torch.empty((a + 1,), dtype=torch.int64, device=dev)
    pdl = pdl_args(positions)
    _keep_kernel[(n_tiles,)](
        positions, edge_index, shift_vectors, sender_perm, row_ptr[a:], keep, cnt, c, edge_index.stride(0), n_tiles,
        cut * cut, BLOCK=block, **pdl,
    )  # fmt: skip
    _compact_kernel[(n_tiles,)](
        edge_index, shift_vectors, keep, cnt, out_ei, out_shift, pre, c, edge_index.stride(0), n_tiles, a,
        float(far), BLOCK=block, T_PAD=t_pad, **pdl,
    )  # fmt: skip
    _remap_kernel[(max(n_tiles, cdiv(a + 1, block)),)](
        sender_perm, keep, pre, row_ptr, sender_ptr, out_perm, out_rowptr, out_sptr, c, a + 1, BLOCK=block, **pdl,
    )  # fmt: skip
    if dry_run_active():  # no kernel ran (kernels/_compile_ahead.py): valid indices for the torch ops that follow
        for t in (out_ei, out_shift, out_rowptr, out_perm, out_sptr):
            t.zero_()
    return out_ei, out_shift, out_rowptr, out_perm, out_sptr
