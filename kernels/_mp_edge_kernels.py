"""The edge-side Triton kernels of :mod:`.message_passing`'s backward (jit kernels and their jit helpers only).

The edge kernel (``_mp_bwd_edge_kernel``: ∂rbf and ∂u of each edge, with its feature or term slices, the chained
slices and the folded p), the sum of its slices' partial rows (``_mp_sum_split_kernel``) and the filter-weight
backward (``_mp_bwd_filter_kernel``, training). The gathers and tile helpers they share with the forward and the
sender kernels live in :mod:`._mp_kernels`; the host side, which chooses and launches them, in
:mod:`.message_passing`. As there, this file holds only ``@triton.jit`` code.
"""

from __future__ import annotations

from ._triton_utils import HAS_TRITON, dot_fin, dot_rn, pdl_prologue, tl, triton, unspecialized

__all__ = ["_mp_bwd_edge_kernel", "_mp_bwd_filter_kernel", "_mp_sum_split_kernel"]

if HAS_TRITON:
    from ._mp_kernels import _edge_ends, _filter_rows, _filter_t, _gamma, _gather, _rbf_tile, _rows3, _unit3

    @triton.jit
    def _edge_grads_w(
        gs_ptr, gv_ptr, x_ptr, v_ptr, i, j, m2, f, ux, uy, uz, N_FEAT: tl.constexpr, HAS_V: tl.constexpr = True,
        FOLD: tl.constexpr = False,
    ):  # fmt: skip
        """Per-edge gradient wrt W_e for a feature chunk, G = (g_s[i] x_a, β x_b, γ x_c), and g_v[i] (3 tiles).
        HAS_V False (v = 0): β = 0, and G_b comes back as zeros without loading v_j or x_b. FOLD: v_ptr holds
        p = x_b ⊙ v, so that G_b = Σ_k g_v[i,k] ⊙ p_j[k] without loading x_b. Everything in the unit vectors'
        dtype, the compute dtype (x, v or the gradients may be stored in 16 bits: half gathers)."""
        g0, g1, g2 = _rows3(gv_ptr, i, m2, f, ux, N_FEAT)
        xrow = x_ptr + j[:, None] * (3 * N_FEAT) + f[None, :]
        gamma = _gamma(g0, g1, g2, ux, uy, uz)
        gsi = _gather(gs_ptr + i[:, None] * N_FEAT + f[None, :], m2, ux)
        xc = _gather(xrow + 2 * N_FEAT, m2, ux)
        G_a = gsi * _gather(xrow, m2, ux)
        G_c = gamma * xc
        if HAS_V:
            vrow = v_ptr + j[:, None] * (3 * N_FEAT) + f[None, :]
            beta = (
                g0 * _gather(vrow, m2, ux)
                + g1 * _gather(vrow + N_FEAT, m2, ux)
                + g2 * _gather(vrow + 2 * N_FEAT, m2, ux)
            )
            if FOLD:
                G_b = beta
            else:
                G_b = beta * _gather(xrow + N_FEAT, m2, ux)
        else:
            G_b = tl.zeros_like(G_a)
        return G_a, G_b, G_c, xc, g0, g1, g2

    @triton.jit
    def _w_rows(w_ptr, BLK: tl.constexpr, f, fm, r, rm, N_FEAT: tl.constexpr, N_RBF: tl.constexpr,
                DOT_PRECISION: tl.constexpr):  # fmt: skip
        """``[BLOCK_F, R_PAD]`` rows of filter block BLK, the right-hand side of the ∂rbf dots ``G @ W``, in the
        orientation that measured fastest for the dot's unit (benchmarks/results/tune_edge_tiles_h100_run2.md):
        the CUDA-core ieee dot with ``tl.trans`` of the ``[R_PAD, BLOCK_F]`` tile (3.5 ms at 24,000 atoms;
        untransposed loads: 56 ms, spilled), the tensor-core dots with the rows loaded as such (tf32x3 64 x 32 /
        4 warps: 2.6 ms)."""
        if DOT_PRECISION == "ieee":
            return tl.trans(_filter_t(w_ptr, BLK, f, fm, r, rm, N_FEAT, N_RBF))
        else:
            return _filter_rows(w_ptr, BLK, f, fm, r, rm, N_FEAT, N_RBF)

    @triton.jit
    def _edge_dot(a, b, DOT: tl.constexpr, GUARD: tl.constexpr):
        """The edge kernel's weight dots: :func:`dot_fin`, or with GUARD :func:`dot_rn` (dot_w's NaN guard kept).
        Same bits for finite operands; which one the compiler schedules faster depends on the variant (see
        ``edge_nan_guard`` in _mp_config.py)."""
        if GUARD:
            return dot_rn(a, b, DOT)
        else:
            return dot_fin(a, b, DOT)

    @triton.jit
    def _edge_chunk_grads(
        gs_ptr, gv_ptr, x_ptr, v_ptr, rb, w_ptr, i, j, ux, uy, uz, em, part, k0, r, rm,
        g_rbf, gu_0, gu_1, gu_2,
        N_FEAT: tl.constexpr, N_RBF: tl.constexpr, BLOCK_F: tl.constexpr, DOT_PRECISION: tl.constexpr,
        SPLIT: tl.constexpr, HAS_V: tl.constexpr, FOLD: tl.constexpr = False, DU_DOT: tl.constexpr = False,
        GUARD: tl.constexpr = False,
    ):  # fmt: skip
        """The edge tile's ∂rbf and ∂u terms of the features ``part * F / SPLIT + k0 + [0, BLOCK_F)``: gu_k are
        ``[BLOCK_E]`` sums, or with DU_DOT (see _mp_bwd_edge_kernel) ``[BLOCK_E, R_PAD]`` dots
        D_k = (x_c ⊙ g_v[i,k]) @ W_c (the c-block of g_rbf is then left to them)."""
        f = part * (N_FEAT // SPLIT) + k0 + tl.arange(0, BLOCK_F)
        fm = f < N_FEAT
        m2 = em[:, None] & fm[None, :]
        G_a, G_b, G_c, xc, g0, g1, g2 = _edge_grads_w(
            gs_ptr, gv_ptr, x_ptr, v_ptr, i, j, m2, f, ux, uy, uz, N_FEAT, HAS_V, FOLD
        )
        g_rbf += _edge_dot(G_a, _w_rows(w_ptr, 0, f, fm, r, rm, N_FEAT, N_RBF, DOT_PRECISION), DOT_PRECISION, GUARD)
        if HAS_V:
            g_rbf += _edge_dot(G_b, _w_rows(w_ptr, 1, f, fm, r, rm, N_FEAT, N_RBF, DOT_PRECISION), DOT_PRECISION, GUARD)
        if DU_DOT:
            # Σ_f over this chunk of c_e ⊙ g_v[i,k] with c_e = x_c ⊙ (rbf_e @ W_cᵀ) is rbf_e · D_k[e], and
            # G_c @ W_c = Σ_k u_e[k] D_k[e] (γ = Σ_k u_k g_v[i,k]): three dots in place of two and of the
            # cross-lane sums over features.
            w_c = _w_rows(w_ptr, 2, f, fm, r, rm, N_FEAT, N_RBF, DOT_PRECISION)
            gu_0 += _edge_dot(xc * g0, w_c, DOT_PRECISION, GUARD)
            gu_1 += _edge_dot(xc * g1, w_c, DOT_PRECISION, GUARD)
            gu_2 += _edge_dot(xc * g2, w_c, DOT_PRECISION, GUARD)
        else:
            g_rbf += _edge_dot(G_c, _w_rows(w_ptr, 2, f, fm, r, rm, N_FEAT, N_RBF, DOT_PRECISION), DOT_PRECISION, GUARD)
            c = xc * _edge_dot(rb, _filter_t(w_ptr, 2, f, fm, r, rm, N_FEAT, N_RBF), DOT_PRECISION, GUARD)
            gu_0 += tl.sum(c * g0, axis=1)
            gu_1 += tl.sum(c * g1, axis=1)
            gu_2 += tl.sum(c * g2, axis=1)
        return g_rbf, gu_0, gu_1, gu_2

    @triton.jit
    def _edge_tile_grads(
        gs_ptr, gv_ptr, x_ptr, v_ptr, rbf_ptr, w_ptr, unit_ptr, ei_ptr, ei_stride, e, em, part, r, rm,
        g_rbf, gu_0, gu_1, gu_2,
        N_FEAT: tl.constexpr, N_RBF: tl.constexpr, BLOCK_F: tl.constexpr, DOT_PRECISION: tl.constexpr,
        SPLIT: tl.constexpr, HAS_V: tl.constexpr, FOLD: tl.constexpr = False, DU_DOT: tl.constexpr = False,
        GUARD: tl.constexpr = False,
    ):  # fmt: skip
        """∂rbf and ∂u of one tile of edges ``e`` (mask ``em``), accumulated over this program's feature slice."""
        i, j = _edge_ends(ei_ptr, ei_stride, e, em)
        rb = _rbf_tile(rbf_ptr, e, em, r, rm, N_RBF)
        ux, uy, uz = _unit3(unit_ptr, e, em)
        if DU_DOT:
            d_0 = tl.zeros_like(g_rbf)
            d_1 = tl.zeros_like(g_rbf)
            d_2 = tl.zeros_like(g_rbf)
        else:
            d_0, d_1, d_2 = gu_0, gu_1, gu_2
        # Unrolled: the same chunks walked in a loop measured 0.88-0.95x on the whole step
        # (benchmarks/results/probe_ncu_sweep_h100_run3.md).
        for k0 in tl.static_range(0, N_FEAT // SPLIT, BLOCK_F):
            g_rbf, d_0, d_1, d_2 = _edge_chunk_grads(
                gs_ptr, gv_ptr, x_ptr, v_ptr, rb, w_ptr, i, j, ux, uy, uz, em, part, k0, r, rm,
                g_rbf, d_0, d_1, d_2, N_FEAT, N_RBF, BLOCK_F, DOT_PRECISION, SPLIT, HAS_V, FOLD, DU_DOT, GUARD,
            )  # fmt: skip
        if DU_DOT:
            g_rbf += ux[:, None] * d_0 + uy[:, None] * d_1 + uz[:, None] * d_2
            gu_0 += tl.sum(rb * d_0, axis=1)
            gu_1 += tl.sum(rb * d_1, axis=1)
            gu_2 += tl.sum(rb * d_2, axis=1)
        else:
            gu_0, gu_1, gu_2 = d_0, d_1, d_2
        return g_rbf, gu_0, gu_1, gu_2

    @triton.jit
    def _store_edge_rows(rbf_out, unit_out, rows, m2, e, em, g_rbf, gu_0, gu_1, gu_2):
        """Stores an edge tile's ∂rbf rows and its ∂u rows (x, y, z)."""
        tl.store(rbf_out + rows, g_rbf, mask=m2)
        tl.store(unit_out + e * 3, gu_0, mask=em)
        tl.store(unit_out + e * 3 + 1, gu_1, mask=em)
        tl.store(unit_out + e * 3 + 2, gu_2, mask=em)

    @triton.jit(**unspecialized("E", "ei_stride", aligned=("live_ptr",)))  # live_ptr: row_ptr[N:]
    def _mp_bwd_edge_kernel(
        gs_ptr,
        gv_ptr,
        x_ptr,
        v_ptr,
        rbf_ptr,
        w_ptr,
        unit_ptr,
        ei_ptr,
        grbf_ptr,
        gunit_ptr,
        out_rbf_ptr,
        out_unit_ptr,
        live_ptr,
        flag_ptr,
        E,
        ei_stride,
        N_FEAT: tl.constexpr,
        N_RBF: tl.constexpr,
        BLOCK_E: tl.constexpr,
        BLOCK_F: tl.constexpr,
        R_PAD: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        SPLIT: tl.constexpr,
        LIVE: tl.constexpr,
        HAS_V: tl.constexpr,
        PDL: tl.constexpr,
        FOLD: tl.constexpr = False,
        OUT0: tl.constexpr = False,
        DU_DOT: tl.constexpr = False,
        GUARD: tl.constexpr = False,
        CHAIN: tl.constexpr = False,
        ACC: tl.constexpr = False,
    ):
        pdl_prologue(PDL)
        # SPLIT > 1: program (tile, s) sums the features [s F/SPLIT, (s+1) F/SPLIT) only and writes partial rows
        # at grbf_ptr + s E N_RBF and gunit_ptr + s E 3; the host sums the SPLIT partials. OUT0: slice 0 writes
        # its rows to out_rbf_ptr / out_unit_ptr (the outputs) and slice s > 0 to plane s - 1 of the partials, so
        # that the partial buffer holds SPLIT - 1 planes (one [E, N_RBF] plane less at the backward's peak).
        # LIVE: only edges before *live_ptr (row_ptr[N]: the edges some receiver owns) are computed; the rows of
        # the others (inert padding past the CSR) are written as zeros, and a tile with none live skips the work.
        # CHAIN (SPLIT 2, edge_split_chain): no sum kernel. Slice 0 writes its rows to the outputs (ACC: to the one
        # partial plane, the outputs holding what to add to) and raises the tile's flag (flag_ptr, zeroed int32 per
        # tile); slice 1 waits for it and writes p0 + p1 (ACC: out + (p0 + p1)), the sum kernel's bits. Slice 1's
        # programs come after every slice-0 program in the grid's order (the waiting one's partner is resident or
        # done: CUTLASS's serial split-K semaphore relies on the same), and read the rows past L1 (".cg").
        e0 = tl.program_id(0).to(tl.int64) * BLOCK_E
        e = e0 + tl.arange(0, BLOCK_E)
        if LIVE:
            n_live = tl.minimum(tl.load(live_ptr), E)
        else:
            n_live = E
        em = e < n_live
        part = tl.program_id(1).to(tl.int64)
        r = tl.arange(0, R_PAD)
        rm = r < N_RBF
        dt = rbf_ptr.dtype.element_ty  # the compute dtype
        g_rbf = tl.zeros((BLOCK_E, R_PAD), dtype=dt)
        gu_0 = tl.zeros((BLOCK_E,), dtype=dt)
        gu_1 = tl.zeros((BLOCK_E,), dtype=dt)
        gu_2 = tl.zeros((BLOCK_E,), dtype=dt)
        if CHAIN:
            tl.static_assert(SPLIT == 2, "CHAIN: two slices per tile")
            if not ACC:  # slice 0's rows go straight to the outputs
                grbf_ptr = out_rbf_ptr
                gunit_ptr = out_unit_ptr
        elif OUT0:
            if part == 0:
                grbf_ptr = out_rbf_ptr
                gunit_ptr = out_unit_ptr
            else:
                grbf_ptr += (part - 1) * E * N_RBF
                gunit_ptr += (part - 1) * E * 3
        else:
            grbf_ptr += part * E * N_RBF
            gunit_ptr += part * E * 3
        if e0 < n_live:
            g_rbf, gu_0, gu_1, gu_2 = _edge_tile_grads(
                gs_ptr, gv_ptr, x_ptr, v_ptr, rbf_ptr, w_ptr, unit_ptr, ei_ptr, ei_stride, e, em, part, r, rm,
                g_rbf, gu_0, gu_1, gu_2, N_FEAT, N_RBF, BLOCK_F, DOT_PRECISION, SPLIT, HAS_V, FOLD, DU_DOT, GUARD,
            )  # fmt: skip
        em = e < E
        rows = e[:, None] * N_RBF + r[None, :]
        m2 = em[:, None] & rm[None, :]
        if CHAIN:
            flag = flag_ptr + tl.program_id(0)
            if part == 0:
                _store_edge_rows(grbf_ptr, gunit_ptr, rows, m2, e, em, g_rbf, gu_0, gu_1, gu_2)
                tl.debug_barrier()  # every thread's rows issued before the flag's release
                tl.atomic_xchg(flag, 1, sem="release", scope="gpu")
            else:
                while tl.atomic_add(flag, 0, sem="acquire", scope="gpu") == 0:
                    pass
                tl.debug_barrier()
                g_rbf = tl.load(grbf_ptr + rows, mask=m2, other=0.0, cache_modifier=".cg") + g_rbf
                gu_0 = tl.load(gunit_ptr + e * 3, mask=em, other=0.0, cache_modifier=".cg") + gu_0
                gu_1 = tl.load(gunit_ptr + e * 3 + 1, mask=em, other=0.0, cache_modifier=".cg") + gu_1
                gu_2 = tl.load(gunit_ptr + e * 3 + 2, mask=em, other=0.0, cache_modifier=".cg") + gu_2
                if ACC:
                    g_rbf = tl.load(out_rbf_ptr + rows, mask=m2, other=0.0) + g_rbf
                    gu_0 = tl.load(out_unit_ptr + e * 3, mask=em, other=0.0) + gu_0
                    gu_1 = tl.load(out_unit_ptr + e * 3 + 1, mask=em, other=0.0) + gu_1
                    gu_2 = tl.load(out_unit_ptr + e * 3 + 2, mask=em, other=0.0) + gu_2
                _store_edge_rows(out_rbf_ptr, out_unit_ptr, rows, m2, e, em, g_rbf, gu_0, gu_1, gu_2)
        else:
            _store_edge_rows(grbf_ptr, gunit_ptr, rows, m2, e, em, g_rbf, gu_0, gu_1, gu_2)

    @triton.jit(**unspecialized("E"))
    def _mp_sum_split_kernel(
        prbf_ptr, punit_ptr, grbf_ptr, gunit_ptr, E,
        N_RBF: tl.constexpr, R_PAD: tl.constexpr, SPLIT: tl.constexpr, BLOCK_E: tl.constexpr,
        PDL: tl.constexpr, ACC: tl.constexpr = False,
    ):  # fmt: skip
        """∂rbf and ∂u of the split edge kernel: its SPLIT partial rows (``[SPLIT, E, N_RBF]``, ``[SPLIT, E, 3]``)
        summed in slice order, both outputs in one launch. ACC: added to what the outputs hold (their old value
        plus the whole sum, as autograd adds one layer's gradient to the others')."""
        pdl_prologue(PDL)
        e = tl.program_id(0).to(tl.int64) * BLOCK_E + tl.arange(0, BLOCK_E)
        em = e < E
        r = tl.arange(0, R_PAD)
        m2 = em[:, None] & (r < N_RBF)[None, :]
        rows = e[:, None] * N_RBF + r[None, :]
        acc = tl.load(prbf_ptr + rows, mask=m2, other=0.0)
        u0 = tl.load(punit_ptr + e * 3, mask=em, other=0.0)
        u1 = tl.load(punit_ptr + e * 3 + 1, mask=em, other=0.0)
        u2 = tl.load(punit_ptr + e * 3 + 2, mask=em, other=0.0)
        # A plane's offset in 64 bits: k E N_RBF passed 2^31 at ~108M edges (a 2,000,004-atom water box, stop 58:
        # an illegal address once the eager step's layers added into a sink through this kernel).
        plane = tl.cast(E, tl.int64)
        for k in tl.static_range(1, SPLIT):
            acc += tl.load(prbf_ptr + k * plane * N_RBF + rows, mask=m2, other=0.0)
            u0 += tl.load(punit_ptr + k * plane * 3 + e * 3, mask=em, other=0.0)
            u1 += tl.load(punit_ptr + k * plane * 3 + e * 3 + 1, mask=em, other=0.0)
            u2 += tl.load(punit_ptr + k * plane * 3 + e * 3 + 2, mask=em, other=0.0)
        if ACC:
            acc = tl.load(grbf_ptr + rows, mask=m2, other=0.0) + acc
            u0 = tl.load(gunit_ptr + e * 3, mask=em, other=0.0) + u0
            u1 = tl.load(gunit_ptr + e * 3 + 1, mask=em, other=0.0) + u1
            u2 = tl.load(gunit_ptr + e * 3 + 2, mask=em, other=0.0) + u2
        tl.store(grbf_ptr + rows, acc, mask=m2)
        tl.store(gunit_ptr + e * 3, u0, mask=em)
        tl.store(gunit_ptr + e * 3 + 1, u1, mask=em)
        tl.store(gunit_ptr + e * 3 + 2, u2, mask=em)

    @triton.jit(**unspecialized("E", "ei_stride", "EDGES_PER_PROG"))
    def _mp_bwd_filter_kernel(
        gs_ptr,
        gv_ptr,
        x_ptr,
        v_ptr,
        rbf_ptr,
        unit_ptr,
        ei_ptr,
        part_ptr,
        E,
        ei_stride,
        EDGES_PER_PROG,
        N_FEAT: tl.constexpr,
        N_RBF: tl.constexpr,
        BLOCK_E: tl.constexpr,
        BLOCK_F: tl.constexpr,
        R_PAD: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        PDL: tl.constexpr,
    ):
        pdl_prologue(PDL)
        p = tl.program_id(0).to(tl.int64)
        f = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
        fm = f < N_FEAT
        r = tl.arange(0, R_PAD)
        rm = r < N_RBF
        dt = rbf_ptr.dtype.element_ty  # the compute dtype
        acc_a = tl.zeros((BLOCK_F, R_PAD), dtype=dt)
        acc_b = tl.zeros((BLOCK_F, R_PAD), dtype=dt)
        acc_c = tl.zeros((BLOCK_F, R_PAD), dtype=dt)
        lo = p * EDGES_PER_PROG
        hi = tl.minimum(lo + EDGES_PER_PROG, E)
        for start in range(lo, hi, BLOCK_E):
            e = start + tl.arange(0, BLOCK_E)
            em = e < hi
            i, j = _edge_ends(ei_ptr, ei_stride, e, em)
            rb = _rbf_tile(rbf_ptr, e, em, r, rm, N_RBF)
            ux, uy, uz = _unit3(unit_ptr, e, em)
            m2 = em[:, None] & fm[None, :]
            G_a, G_b, G_c, _, _, _, _ = _edge_grads_w(gs_ptr, gv_ptr, x_ptr, v_ptr, i, j, m2, f, ux, uy, uz, N_FEAT)
            acc_a += dot_rn(tl.trans(G_a), rb, DOT_PRECISION)
            acc_b += dot_rn(tl.trans(G_b), rb, DOT_PRECISION)
            acc_c += dot_rn(tl.trans(G_c), rb, DOT_PRECISION)
        offs = p * (3 * N_FEAT * N_RBF) + f[:, None] * N_RBF + r[None, :]
        m = fm[:, None] & rm[None, :]
        tl.store(part_ptr + offs, acc_a, mask=m)
        tl.store(part_ptr + offs + N_FEAT * N_RBF, acc_b, mask=m)
        tl.store(part_ptr + offs + 2 * N_FEAT * N_RBF, acc_c, mask=m)
