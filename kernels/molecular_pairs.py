"""All pairs within the cutoff of many isolated molecules whose positions are on the GPU: the neighbour list of
``mlff_distiller.neighbors.molecular.molecular_pairs_device`` in three launches and one host sync.

The torch enumeration there (the reference: the torch backend, and this path's oracle) materialises all Σ n_b²
candidate pairs with ~20 torch ops, two host syncs (the finiteness check, ``nonzero``) and a few host->device
copies: 0.75-1.5 ms on an H200 at any batch size, the largest piece of a batched call. Here the candidates are
never stored:

1. ``_count_kernel``: one program per block of receiver atoms. Each receiver finds its structure by a binary search
   in ``ptr`` (log2 B masked loads instead of a per-atom structure array built by torch ops), the block walks the
   senders of all its receivers' structures (one contiguous range) in tiles, and writes each receiver's neighbour
   count. A receiver with a non-finite coordinate writes ``N²`` instead: no real total reaches that (at most
   N (N - 1) pairs), so the prefix sum carries the "NaN or inf" flag to the host in the same number as the total.
2. ``torch.cumsum`` of the counts into ``row_ptr[1:]`` and one read of ``row_ptr[N]``: the only host sync (``ptr``
   given on the host goes to the device through pinned memory, without waiting for the stream).
3. ``_write_kernel``: the same walk again, each receiver's neighbours written at ``row_ptr[i]`` in sender order (a
   running count per receiver plus an exclusive ``tl.cumsum`` inside each tile), and the zero shifts of the block's
   edge range (contiguous, since the receivers of a block are consecutive).

The squared lengths are those of the reference bit for bit: float64 differences ``pos[j] - pos[i]``, summed
``(dx² + dy²) + dz²`` with contraction to FMA switched off (``enable_fp_fusion=False``), kept when
``0 < r² < cutoff²``; ``cutoff²`` is rounded once on the host, as there, and reaches the kernels as float64.

Not for a compile-ahead dry run (``kernels/_compile_ahead.py``): the host reads what ``_count_kernel`` wrote, which a
dry run leaves as garbage. The caller takes the torch reference there.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._compile_ahead import dry_run_active
from ._triton_utils import HAS_TRITON, cdiv, check_launchable, pdl_args, pdl_prologue, tl, triton, unspecialized

__all__ = ["MOLECULAR_TRITON_MAX_ATOMS", "molecular_pairs_triton"]

# Atoms up to which the Triton path runs: atom indices in int32 and the flag count N² times N flagged receivers plus
# the real total, N (N - 1), within int64 (N³ < 2^63 up to ~2.1 million atoms; 2^20 leaves a margin).
MOLECULAR_TRITON_MAX_ATOMS = 1 << 20

_NOT_FINITE = "molecular_pairs: positions contain NaN or inf"


def _blocks(device: torch.device) -> tuple[int, int]:
    """(receivers per program, senders per tile). On the GPU 32 receivers of g2 molecules (~5 atoms each) span ~7
    molecules, so their sender range is ~40 atoms: one 64-wide tile, and ~680 programs for 4,096 molecules; a
    2,000-atom molecule takes 63 programs of 32 tiles. The interpreter (CPU) pays per operation, not per element:
    128 x 256 tiles ran a 369-atom batch in 0.17 s against 0.74 s at 32 x 64."""
    return (32, 64) if device.type == "cuda" else (128, 256)


if HAS_TRITON:

    @triton.jit
    def _receivers(pos_ptr, ptr_ptr, i0, N, B, STEP0, LOG, BLOCK_I: tl.constexpr):
        """The block's receivers ``i`` (int32), their float64 coordinates, their structure's atom range ``[s, e)``
        (empty for an atom outside every structure or past N) and the sender range ``[lo, hi)`` that covers all of
        them (structures are contiguous, so the union of their ranges is one range).

        The structure of ``i`` is the largest ``b`` in ``[0, B)`` with ``ptr[b] <= i``, found by binary lifting:
        steps ``STEP0, STEP0 / 2, ..., 1`` (``LOG`` of them, ``STEP0`` the largest power of two <= B - 1); empty
        structures (``ptr[b] == ptr[b + 1]``) are skipped by that rule."""
        i = i0 + tl.arange(0, BLOCK_I)
        m = i < N
        b = tl.zeros((BLOCK_I,), dtype=tl.int32)
        step = STEP0
        for _ in range(LOG):
            cand = b + step
            ok = m & (cand < B)
            take = ok & (tl.load(ptr_ptr + cand, mask=ok, other=0).to(tl.int32) <= i)
            b = tl.where(take, cand, b)
            step = step // 2
        s = tl.load(ptr_ptr + b, mask=m, other=0).to(tl.int32)
        e = tl.load(ptr_ptr + b + 1, mask=m, other=0).to(tl.int32)
        inside = m & (s <= i) & (i < e)
        s = tl.where(inside, s, 0)
        e = tl.where(inside, e, 0)
        lo = tl.min(tl.where(inside, s, N), axis=0)
        hi = tl.max(e, axis=0)
        px = tl.load(pos_ptr + 3 * i, mask=m, other=0.0).to(tl.float64)
        py = tl.load(pos_ptr + 3 * i + 1, mask=m, other=0.0).to(tl.float64)
        pz = tl.load(pos_ptr + 3 * i + 2, mask=m, other=0.0).to(tl.float64)
        return i, m, s, e, lo, hi, px, py, pz

    @triton.jit
    def _pair_tile(pos_ptr, j0, hi, s, e, px, py, pz, cut2, BLOCK_J: tl.constexpr):
        """``[BLOCK_I, BLOCK_J]`` flags of the pairs (receiver row, sender ``j0 + col``) in the receiver's structure
        with ``0 < r² < cut2`` (the reference's float64 arithmetic), and the senders ``j``."""
        j = j0 + tl.arange(0, BLOCK_J)
        mj = j < hi
        qx = tl.load(pos_ptr + 3 * j, mask=mj, other=0.0).to(tl.float64)
        qy = tl.load(pos_ptr + 3 * j + 1, mask=mj, other=0.0).to(tl.float64)
        qz = tl.load(pos_ptr + 3 * j + 2, mask=mj, other=0.0).to(tl.float64)
        dx = qx[None, :] - px[:, None]
        dy = qy[None, :] - py[:, None]
        dz = qz[None, :] - pz[:, None]
        r2 = dx * dx + dy * dy + dz * dz
        same = (j[None, :] >= s[:, None]) & (j[None, :] < e[:, None])
        return same & (r2 > 0.0) & (r2 < cut2), j

    @triton.jit(**unspecialized("N", "B", "STEP0", "LOG", "flag"))
    def _count_kernel(
        pos_ptr, ptr_ptr, cnt_ptr, rowptr_ptr, N, B, STEP0, LOG, cut2: tl.float64, flag,
        BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr,
        PDL: tl.constexpr,
    ):  # fmt: skip
        """``cnt[i]``: the neighbours of receiver i, or ``flag`` (= N², more than any real total) where a coordinate
        of atom i is not finite; program 0 also writes ``row_ptr[0] = 0``."""
        pdl_prologue(PDL)
        i0 = tl.program_id(0) * BLOCK_I
        i, m, s, e, lo, hi, px, py, pz = _receivers(pos_ptr, ptr_ptr, i0, N, B, STEP0, LOG, BLOCK_I)
        n = tl.zeros((BLOCK_I,), dtype=tl.int32)
        for j0 in range(lo, hi, BLOCK_J):
            ok, _ = _pair_tile(pos_ptr, j0, hi, s, e, px, py, pz, cut2, BLOCK_J)
            n += tl.sum(ok.to(tl.int32), axis=1)
        # |x| <= the largest float64 is False for NaN and for ±inf.
        big = 1.7976931348623157e308
        finite = (tl.abs(px) <= big) & (tl.abs(py) <= big) & (tl.abs(pz) <= big)
        tl.store(cnt_ptr + i, tl.where(finite, n.to(tl.int64), flag.to(tl.int64)), mask=m)
        if tl.program_id(0) == 0:
            tl.store(rowptr_ptr, tl.zeros((), dtype=tl.int64))

    @triton.jit(**unspecialized("N", "B", "STEP0", "LOG", "E"))
    def _write_kernel(
        pos_ptr, ptr_ptr, rowptr_ptr, ei_ptr, shifts_ptr, svec_ptr, N, B, STEP0, LOG, E, cut2: tl.float64,
        BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr,
        PDL: tl.constexpr,
    ):  # fmt: skip
        """``edge_index[:, row_ptr[i] + k]`` = (i, k-th neighbour of i in sender order) for the block's receivers,
        and zeros in ``shifts`` and ``shift_vectors`` over the block's edges ``[row_ptr[i0], row_ptr[i_last + 1])``."""
        pdl_prologue(PDL)
        i0 = tl.program_id(0) * BLOCK_I
        i, m, s, e, lo, hi, px, py, pz = _receivers(pos_ptr, ptr_ptr, i0, N, B, STEP0, LOG, BLOCK_I)
        base = tl.load(rowptr_ptr + i, mask=m, other=0)
        n = tl.zeros((BLOCK_I,), dtype=tl.int64)
        for j0 in range(lo, hi, BLOCK_J):
            ok, j = _pair_tile(pos_ptr, j0, hi, s, e, px, py, pz, cut2, BLOCK_J)
            k = ok.to(tl.int64)
            dest = (base + n)[:, None] + tl.cumsum(k, axis=1) - k
            tl.store(ei_ptr + dest, tl.broadcast_to(i[:, None], (BLOCK_I, BLOCK_J)).to(tl.int64), mask=ok)
            tl.store(ei_ptr + E + dest, tl.broadcast_to(j[None, :], (BLOCK_I, BLOCK_J)).to(tl.int64), mask=ok)
            n += tl.sum(k, axis=1)
        z_lo = 3 * tl.load(rowptr_ptr + i0)
        z_hi = 3 * tl.load(rowptr_ptr + tl.minimum(i0 + BLOCK_I, N))
        for z0 in range(z_lo, z_hi, BLOCK_I * BLOCK_J):
            z = z0 + tl.arange(0, BLOCK_I * BLOCK_J)
            mz = z < z_hi
            tl.store(shifts_ptr + z, tl.zeros((BLOCK_I * BLOCK_J,), dtype=tl.int64), mask=mz)
            tl.store(svec_ptr + z, tl.zeros((BLOCK_I * BLOCK_J,), dtype=svec_ptr.dtype.element_ty), mask=mz)


def molecular_pairs_triton(positions: Tensor, ptr: Tensor, cutoff: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The pairs ``(i, j)``, ``i != j``, of the same structure with ``0 < |r_j - r_i|² < cutoff²`` (Å; decided in
    float64), sorted by receiver ``i`` and then sender ``j``, on the device of ``positions``.

    Args:
        positions: ``[N, 3]`` Å on a CUDA device (or the CPU under the Triton interpreter), N <=
            :data:`MOLECULAR_TRITON_MAX_ATOMS`.
        ptr: ``[B + 1]`` atom offsets of the structures (B >= 1), on the host or on any device: it is copied to
            ``positions``' device when elsewhere, never read on the host.
        cutoff: Å.
    Returns:
        ``(edge_index [2, E] int64, row_ptr [N + 1] int64, shifts [E, 3] int64 zeros, shift_vectors [E, 3] zeros of
        positions' dtype)``. Syncs with the host once, to read ``E`` (and the non-finite flag).
    Raises:
        ValueError: a position is NaN or infinite.
    """
    if not HAS_TRITON:
        raise RuntimeError("the Triton molecular pair list needs triton installed; use MLFF_DISTILLER_KERNELS=torch")
    if positions.dim() != 2 or positions.shape[1] != 3:
        raise ValueError(f"molecular_pairs: positions must be [N, 3], got {tuple(positions.shape)}")
    n, n_structures = positions.shape[0], ptr.shape[0] - 1
    if n > MOLECULAR_TRITON_MAX_ATOMS or n_structures < 1:
        raise ValueError(
            f"molecular_pairs_triton: needs 1 <= B and N <= {MOLECULAR_TRITON_MAX_ATOMS}, got B = {n_structures}, "
            f"N = {n}"
        )
    if dry_run_active():
        raise RuntimeError("molecular_pairs_triton reads its counts on the host: not callable in a dry run")
    dev = positions.device
    if n == 0:
        empty = torch.zeros((0, 3), dtype=torch.int64, device=dev)
        return (
            torch.zeros((2, 0), dtype=torch.int64, device=dev),
            torch.zeros(1, dtype=torch.int64, device=dev),
            empty,
            empty.to(positions.dtype),
        )
    check_launchable(_count_kernel, positions)
    pos = positions.detach().contiguous()
    if ptr.device.type == "cpu" and dev.type == "cuda":
        # The engine's case. A copy from pageable memory waits for the stream (torch's memcpy_and_sync: a second
        # host sync, seen with torch.cuda.set_sync_debug_mode); from pinned memory it is queued like a launch.
        ptr_d = ptr.pin_memory().to(dev, non_blocking=True)
    else:
        ptr_d = ptr.to(dev)
    block_i, block_j = _blocks(dev)
    log = (n_structures - 1).bit_length()
    step0 = 1 << (log - 1) if log else 0
    cut2 = float(cutoff) ** 2  # rounded as the reference rounds it
    flag = n * n
    grid = (cdiv(n, block_i),)
    launch = {"BLOCK_I": block_i, "BLOCK_J": block_j, "enable_fp_fusion": False, **pdl_args(pos)}
    counts = torch.empty(n, dtype=torch.int64, device=dev)
    row_ptr = torch.empty(n + 1, dtype=torch.int64, device=dev)
    _count_kernel[grid](pos, ptr_d, counts, row_ptr, n, n_structures, step0, log, cut2, flag, **launch)
    torch.cumsum(counts, 0, out=row_ptr[1:])
    total = int(row_ptr[n])  # the one host sync
    if total >= flag:
        raise ValueError(_NOT_FINITE)
    edge_index = torch.empty((2, total), dtype=torch.int64, device=dev)
    shifts = torch.empty((total, 3), dtype=torch.int64, device=dev)
    shift_vectors = torch.empty((total, 3), dtype=positions.dtype, device=dev)
    if total:
        _write_kernel[grid](
            pos, ptr_d, row_ptr, edge_index, shifts, shift_vectors, n, n_structures, step0, log, total, cut2,
            **launch,
        )  # fmt: skip
    return edge_index, row_ptr, shifts, shift_vectors
