"""The Triton kernels of the cell-list backend (:mod:`.cell_list_triton`, whose docstring gives the algorithm):
``_pairs_kernel`` (candidates per receiver, count and key passes), ``_rows_kernel`` (the row sort and decode into
``edge_index``/``shifts``/``shift_vectors``), and the periodic fast path's ``_atoms_kernel`` (wrap, bin, count per
bin) and ``_gather_kernel`` (the per-atom arrays in bin order). Each is ``None`` without Triton: the torch cell list
must not depend on it."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch cell list must not depend on Triton
    triton = None
    tl = None

__all__ = ["HAS_TRITON", "_atoms_kernel", "_gather_kernel", "_pairs_kernel", "_rows_kernel"]

HAS_TRITON = triton is not None

if HAS_TRITON:

    @triton.jit(do_not_specialize=["cap"])
    def _pairs_kernel(
        order_ptr,  # [N] int64: atom at each sorted slot
        px_ptr,  # [N] float64 wrapped positions (Å) in sorted order, one array per component
        py_ptr,
        pz_ptr,
        sbin_ptr,  # [N, 3] int64 bin coordinates, sorted order
        sstruct_ptr,  # [N] int64 structure, sorted order
        itab_ptr,  # [B, 10] int64 per structure: bins per axis (3), stencil half-width (3), periodic 0/1 (3),
        # first bin in cell_start (1)
        basis_ptr,  # [B, basis_stride] float64: lattice rows (Å) in the first 9
        basis_stride,
        cell_start_ptr,  # [n_bins + 1] int64
        cutoff_sq,
        count_ptr,  # [N] int64 out (count and scratch passes)
        row_ptr_ptr,  # [N + 1] int64 in (fill pass)
        key_ptr,  # [E] int64 out (fill pass)
        cap,  # scratch pass: keys of receiver i go to key_ptr[i * cap ...], at most cap of them
        hdr_ptr,  # [3] int64 header (scratch pass): a row longer than cap atomically maxes its length into [1]
        FILL: tl.constexpr,  # 0: count; 1: fill at row_ptr[i]; 2: count and fill scratch rows of cap keys
        SHIFT_BITS: tl.constexpr,
        BLOCK_S: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        p = tl.program_id(0)
        i = tl.load(order_ptr + p)
        b = tl.load(sstruct_ptr + p)
        xi = tl.load(px_ptr + p)
        yi = tl.load(py_ptr + p)
        zi = tl.load(pz_ptr + p)
        cx = tl.load(sbin_ptr + 3 * p)
        cy = tl.load(sbin_ptr + 3 * p + 1)
        cz = tl.load(sbin_ptr + 3 * p + 2)
        it = itab_ptr + 10 * b
        nbx = tl.load(it)
        nby = tl.load(it + 1)
        nbz = tl.load(it + 2)
        rx = tl.load(it + 3)
        ry = tl.load(it + 4)
        rz = tl.load(it + 5)
        perx = tl.load(it + 6)
        pery = tl.load(it + 7)
        perz = tl.load(it + 8)
        off = tl.load(it + 9)
        bs = basis_ptr + basis_stride * b
        a00 = tl.load(bs)
        a01 = tl.load(bs + 1)
        a02 = tl.load(bs + 2)
        a10 = tl.load(bs + 3)
        a11 = tl.load(bs + 4)
        a12 = tl.load(bs + 5)
        a20 = tl.load(bs + 6)
        a21 = tl.load(bs + 7)
        a22 = tl.load(bs + 8)
        wx = 2 * rx + 1
        wy = 2 * ry + 1
        wz = 2 * rz + 1
        n_stencil = wx * wy * wz
        # Adding m * nb before dividing keeps every operand non-negative: Triton's integer division
        # truncates when compiled but floors when interpreted, and the two agree only there.
        mx = rx // nbx + 1
        my = ry // nby + 1
        mz = rz // nbz + 1
        s_lane = tl.arange(0, BLOCK_S)
        k_lane = tl.arange(0, BLOCK_K)
        count = tl.zeros((), dtype=tl.int64)
        base = 0
        if FILL == 1:
            base = tl.load(row_ptr_ptr + i)
        if FILL == 2:
            base = i * cap
        for s0 in range(0, n_stencil, BLOCK_S):
            s = s0 + s_lane
            s_ok = s < n_stencil
            s = tl.where(s_ok, s, 0)
            dz = s % wz - rz
            t = s // wz
            dy = t % wy - ry
            dx = t // wy - rx
            tx = cx + dx
            ty = cy + dy
            tz = cz + dz
            # Image of the stencil bin along periodic axes (0 along non-periodic ones, which never wrap).
            qx = ((tx + mx * nbx) // nbx - mx) * perx
            qy = ((ty + my * nby) // nby - my) * pery
            qz = ((tz + mz * nbz) // nbz - mz) * perz
            ux = tx - qx * nbx
            uy = ty - qy * nby
            uz = tz - qz * nbz
            ok = s_ok & (ux >= 0) & (ux < nbx) & (uy >= 0) & (uy < nby) & (uz >= 0) & (uz < nbz)
            cell = tl.where(ok, off + (ux * nby + uy) * nbz + uz, 0)
            start = tl.load(cell_start_ptr + cell, mask=ok, other=0)
            n = tl.load(cell_start_ptr + cell + 1, mask=ok, other=0) - start
            # Shift vector of the stencil bin's image, Å.
            qxf = qx.to(tl.float64)
            qyf = qy.to(tl.float64)
            qzf = qz.to(tl.float64)
            svx = qxf * a00 + qyf * a10 + qzf * a20
            svy = qxf * a01 + qyf * a11 + qzf * a21
            svz = qxf * a02 + qyf * a12 + qzf * a22
            code = (
                ((qx + (1 << (SHIFT_BITS - 1))) << (2 * SHIFT_BITS))
                | ((qy + (1 << (SHIFT_BITS - 1))) << SHIFT_BITS)
                | (qz + (1 << (SHIFT_BITS - 1)))
            )
            longest = tl.max(n, axis=0)
            for k0 in range(0, longest, BLOCK_K):
                kk = k0 + k_lane
                m = kk[None, :] < n[:, None]
                idx = tl.where(m, start[:, None] + kk[None, :], 0)
                # Same operation order as the torch backends: (wrapped_j - wrapped_i) + S' @ basis.
                vx = (tl.load(px_ptr + idx, mask=m, other=0.0) - xi) + svx[:, None]
                vy = (tl.load(py_ptr + idx, mask=m, other=0.0) - yi) + svy[:, None]
                vz = (tl.load(pz_ptr + idx, mask=m, other=0.0) - zi) + svz[:, None]
                d2 = vx * vx + vy * vy + vz * vz
                # 0 < |r| drops the receiver's own copy (exactly zero) and coincident atoms.
                keep = m & (d2 > 0.0) & (d2 < cutoff_sq)
                keep_i = keep.to(tl.int64)
                if FILL != 0:
                    j = tl.load(order_ptr + idx, mask=keep, other=0)
                    key = (j << (3 * SHIFT_BITS)) | code[:, None]
                    per_row = tl.sum(keep_i, axis=1)
                    row_off = tl.cumsum(per_row, axis=0) - per_row
                    rank = row_off[:, None] + tl.cumsum(keep_i, axis=1) - 1
                    store = keep
                    if FILL == 2:  # a row longer than cap is counted but not stored (the caller redoes it)
                        store = keep & (count + rank < cap)
                    tl.store(key_ptr + (base + count + rank), key, mask=store)
                count += tl.sum(tl.sum(keep_i, axis=1), axis=0)
        if FILL != 1:
            tl.store(count_ptr + i, count)
        if FILL == 2:
            if count > cap:  # rare (clusters in vacuum): no atomics at all in the common case
                tl.atomic_max(hdr_ptr + 1, count)

    # The list length changes with every call: unspecialised, or each new value's divisibility by 16 JIT-compiles
    # a variant (0.7 s inside one MD step on the H100, benchmarks/results/profile_step_h100_run3.txt).
    @triton.jit(do_not_specialize=["n_atoms", "src_stride", "capacity"])
    def _rows_kernel(
        key_ptr,  # [E] int64 pair keys, grouped by receiver
        row_ptr_ptr,  # [N + 1] int64; n_edges = row_ptr[N] is read here, so the launch needs no sync
        image_ptr,  # [N, 3] int64 wrapping images k
        batch_ptr,  # [N] int64
        cell_ptr,  # [B, 9] caller's cell (Å), dtype of the output shift vectors
        ei_ptr,  # [2 * capacity] int64 out: receivers at [e], senders at [n_edges + e] (a [2, E] prefix)
        shifts_ptr,  # [3 * capacity] int64 out ([E, 3] prefix)
        sv_ptr,  # [3 * capacity] out ([E, 3] prefix)
        hdr_ptr,  # [3] int64 header: program 0 copies n_edges into [2], next to the flags the host reads
        n_atoms,
        src_stride,  # > 0: receiver i's keys are at key_ptr[i * src_stride ...], at most src_stride of them
        # (scratch rows); else at row_ptr[i]
        capacity,  # pairs the outputs hold: nothing is written when n_edges exceeds it (the caller redoes it)
        SHIFT_BITS: tl.constexpr,
        BLOCK_R: tl.constexpr,
    ):
        i = tl.program_id(0).to(tl.int64)
        n_edges = tl.load(row_ptr_ptr + n_atoms)
        if i == 0:
            tl.store(hdr_ptr + 2, n_edges)
        start = tl.load(row_ptr_ptr + i)
        n = tl.load(row_ptr_ptr + i + 1) - start
        src = start
        if src_stride > 0:
            src = i * src_stride
            n = tl.minimum(n, src_stride)  # a row that outgrew its scratch row: garbage, discarded by the caller
        n = tl.where(n_edges <= capacity, n, 0)
        o = tl.arange(0, BLOCK_R)
        m = o < n
        key = tl.load(key_ptr + src + o, mask=m, other=0x7FFFFFFFFFFFFFFF)
        # Keys order as (j, S'_x, S'_y, S'_z); for a fixed (i, j) S' and S differ by a constant.
        key = tl.sort(key)
        mask10 = (1 << SHIFT_BITS) - 1
        j = key >> (3 * SHIFT_BITS)
        j = tl.where(m, j, 0)
        bias = 1 << (SHIFT_BITS - 1)
        sx = ((key >> (2 * SHIFT_BITS)) & mask10) - bias
        sy = ((key >> SHIFT_BITS) & mask10) - bias
        sz = (key & mask10) - bias
        sx = sx + tl.load(image_ptr + 3 * i) - tl.load(image_ptr + 3 * j, mask=m, other=0)
        sy = sy + tl.load(image_ptr + 3 * i + 1) - tl.load(image_ptr + 3 * j + 1, mask=m, other=0)
        sz = sz + tl.load(image_ptr + 3 * i + 2) - tl.load(image_ptr + 3 * j + 2, mask=m, other=0)
        b = tl.load(batch_ptr + i)
        c00 = tl.load(cell_ptr + 9 * b)
        c01 = tl.load(cell_ptr + 9 * b + 1)
        c02 = tl.load(cell_ptr + 9 * b + 2)
        c10 = tl.load(cell_ptr + 9 * b + 3)
        c11 = tl.load(cell_ptr + 9 * b + 4)
        c12 = tl.load(cell_ptr + 9 * b + 5)
        c20 = tl.load(cell_ptr + 9 * b + 6)
        c21 = tl.load(cell_ptr + 9 * b + 7)
        c22 = tl.load(cell_ptr + 9 * b + 8)
        fx = sx.to(c00.dtype)
        fy = sy.to(c00.dtype)
        fz = sz.to(c00.dtype)
        e = start + o
        tl.store(ei_ptr + e, tl.zeros_like(j) + i, mask=m)
        tl.store(ei_ptr + n_edges + e, j, mask=m)
        tl.store(shifts_ptr + 3 * e, sx, mask=m)
        tl.store(shifts_ptr + 3 * e + 1, sy, mask=m)
        tl.store(shifts_ptr + 3 * e + 2, sz, mask=m)
        tl.store(sv_ptr + 3 * e, fx * c00 + fy * c10 + fz * c20, mask=m)
        tl.store(sv_ptr + 3 * e + 1, fx * c01 + fy * c11 + fz * c21, mask=m)
        tl.store(sv_ptr + 3 * e + 2, fx * c02 + fy * c12 + fz * c22, mask=m)

    # Periodic fast path, step 1 (one program per BLOCK atoms): fractional coordinates, wrapping image, wrapped
    # position, bin and bin key of each atom, from the per-structure tables (all three axes periodic).
    @triton.jit
    def _atoms_kernel(
        pos_ptr,  # [N, 3] positions (Å), float32 or float64
        batch_ptr,  # [N] int64
        ftab_ptr,  # [B, 18] float64: basis rows (9), inverse (9; frac_a = sum_c x_c inv[c, a])
        itab_ptr,  # [B, 10] int64: see _pairs_kernel
        wrapped_ptr,  # [N, 3] float64 out
        frac_ptr,  # [N, 3] float64 out, wrapped fractional coordinates
        image_ptr,  # [N, 3] int64 out
        bins_ptr,  # [N, 3] int64 out
        key_ptr,  # [N] int64 out: bin key (index into cell_start)
        rank_ptr,  # [N] int64 out: rank of the atom among the atoms of its bin
        cnt_ptr,  # [n_bins + 1] int64, zero on entry: the atoms of bin k are counted at [k + 1]
        flag_ptr,  # [3] int64 header, [0] zero on entry: set to 1 when some coordinate is NaN or inf
        n_atoms,
        BLOCK: tl.constexpr,
    ):
        a = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = a < n_atoms
        b = tl.load(batch_ptr + a, mask=m, other=0)
        x = tl.load(pos_ptr + 3 * a, mask=m, other=0.0).to(tl.float64)
        y = tl.load(pos_ptr + 3 * a + 1, mask=m, other=0.0).to(tl.float64)
        z = tl.load(pos_ptr + 3 * a + 2, mask=m, other=0.0).to(tl.float64)
        # x - x is 0 for finite x and NaN for NaN or inf: one atomic per program, only when it saw one.
        bad = tl.max(((x - x != 0.0) | (y - y != 0.0) | (z - z != 0.0)).to(tl.int64), axis=0)
        if bad > 0:
            tl.atomic_max(flag_ptr, bad)
        ft = ftab_ptr + 18 * b
        it = itab_ptr + 10 * b
        fx = x * tl.load(ft + 9, mask=m, other=0.0) + y * tl.load(ft + 12, mask=m, other=0.0)
        fx = fx + z * tl.load(ft + 15, mask=m, other=0.0)
        fy = x * tl.load(ft + 10, mask=m, other=0.0) + y * tl.load(ft + 13, mask=m, other=0.0)
        fy = fy + z * tl.load(ft + 16, mask=m, other=0.0)
        fz = x * tl.load(ft + 11, mask=m, other=0.0) + y * tl.load(ft + 14, mask=m, other=0.0)
        fz = fz + z * tl.load(ft + 17, mask=m, other=0.0)
        kx = tl.floor(fx)
        ky = tl.floor(fy)
        kz = tl.floor(fz)
        wx = x - (kx * tl.load(ft, mask=m, other=0.0) + ky * tl.load(ft + 3, mask=m, other=0.0))
        wx = wx - kz * tl.load(ft + 6, mask=m, other=0.0)
        wy = y - (kx * tl.load(ft + 1, mask=m, other=0.0) + ky * tl.load(ft + 4, mask=m, other=0.0))
        wy = wy - kz * tl.load(ft + 7, mask=m, other=0.0)
        wz = z - (kx * tl.load(ft + 2, mask=m, other=0.0) + ky * tl.load(ft + 5, mask=m, other=0.0))
        wz = wz - kz * tl.load(ft + 8, mask=m, other=0.0)
        fx = fx - kx
        fy = fy - ky
        fz = fz - kz
        # A NaN coordinate (reported by the caller's finiteness check) goes to bin 0 rather than an undefined one.
        fx = tl.where(fx == fx, fx, 0.0)
        fy = tl.where(fy == fy, fy, 0.0)
        fz = tl.where(fz == fz, fz, 0.0)
        nbx = tl.load(it, mask=m, other=1)
        nby = tl.load(it + 1, mask=m, other=1)
        nbz = tl.load(it + 2, mask=m, other=1)
        # Clamped: a wrapped coordinate may round to 1.0, and a non-finite one must not index out of the table.
        bx = tl.minimum(tl.maximum(tl.floor(fx * nbx.to(tl.float64)), 0.0), (nbx - 1).to(tl.float64)).to(tl.int64)
        by = tl.minimum(tl.maximum(tl.floor(fy * nby.to(tl.float64)), 0.0), (nby - 1).to(tl.float64)).to(tl.int64)
        bz = tl.minimum(tl.maximum(tl.floor(fz * nbz.to(tl.float64)), 0.0), (nbz - 1).to(tl.float64)).to(tl.int64)
        tl.store(wrapped_ptr + 3 * a, wx, mask=m)
        tl.store(wrapped_ptr + 3 * a + 1, wy, mask=m)
        tl.store(wrapped_ptr + 3 * a + 2, wz, mask=m)
        tl.store(frac_ptr + 3 * a, fx, mask=m)
        tl.store(frac_ptr + 3 * a + 1, fy, mask=m)
        tl.store(frac_ptr + 3 * a + 2, fz, mask=m)
        tl.store(image_ptr + 3 * a, kx.to(tl.int64), mask=m)
        tl.store(image_ptr + 3 * a + 1, ky.to(tl.int64), mask=m)
        tl.store(image_ptr + 3 * a + 2, kz.to(tl.int64), mask=m)
        tl.store(bins_ptr + 3 * a, bx, mask=m)
        tl.store(bins_ptr + 3 * a + 1, by, mask=m)
        tl.store(bins_ptr + 3 * a + 2, bz, mask=m)
        key = tl.load(it + 9, mask=m, other=0) + (bx * nby + by) * nbz + bz
        tl.store(key_ptr + a, key, mask=m)
        # Counting sort by bin, instead of torch.sort and searchsorted (6 kernels, 35 µs, and their host time in
        # benchmarks/results/neighbors_h100_run4_profile.txt): ranks within a bin come in the order of the
        # atomics, which is arbitrary and harmless, since every row is sorted by (j, S) after the candidate search.
        rank = tl.atomic_add(cnt_ptr + key + 1, tl.full((BLOCK,), 1, tl.int64), mask=m)
        tl.store(rank_ptr + a, rank, mask=m)

    # Periodic fast path, step 2: the per-atom arrays the pairs kernel reads, in bin order (one scatter to the
    # slot cell_start[key] + rank of each atom).
    @triton.jit
    def _gather_kernel(
        key_ptr,  # [N] int64 bin key of each atom
        rank_ptr,  # [N] int64 rank within its bin
        cell_start_ptr,  # [n_bins + 1] int64
        wrapped_ptr,  # [N, 3] float64
        bins_ptr,  # [N, 3] int64
        batch_ptr,  # [N] int64
        order_ptr,  # [N] int64 out: atom at each sorted slot
        spos_ptr,  # [3, N] float64 out
        sbin_ptr,  # [N, 3] int64 out
        sstruct_ptr,  # [N] int64 out
        n_atoms,
        BLOCK: tl.constexpr,
    ):
        a = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = a < n_atoms
        p = tl.load(cell_start_ptr + tl.load(key_ptr + a, mask=m, other=0), mask=m, other=0)
        p = p + tl.load(rank_ptr + a, mask=m, other=0)
        tl.store(order_ptr + p, a, mask=m)
        for c in tl.static_range(3):
            tl.store(spos_ptr + c * n_atoms + p, tl.load(wrapped_ptr + 3 * a + c, mask=m), mask=m)
            tl.store(sbin_ptr + 3 * p + c, tl.load(bins_ptr + 3 * a + c, mask=m), mask=m)
        tl.store(sstruct_ptr + p, tl.load(batch_ptr + a, mask=m), mask=m)

else:  # pragma: no cover - exercised only without Triton
    _pairs_kernel = _rows_kernel = _atoms_kernel = _gather_kernel = None
