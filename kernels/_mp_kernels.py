"""The Triton kernels of :mod:`.message_passing` (jit kernels and their jit helpers only).

The edge backward (∂rbf, ∂u), its slices' sum and the filter-weight backward are in :mod:`._mp_edge_kernels`, which
takes its gathers and tile helpers from here.

The host side, which chooses tiles and variants, allocates and launches these kernels, the torch.library ops and
the autograd Functions, stays in :mod:`.message_passing` together with the torch reference and the long comment
on the launch configuration. The formulas and the layout of every kernel are described there (the forward, the
three backward kernels and the second derivative). This file holds only ``@triton.jit`` code, so an edit here never
touches the host path and vice versa.
"""

from __future__ import annotations

from ._triton_utils import HAS_TRITON, dot_fin, dot_rn, pdl_prologue, tf32_hi, tl, triton, unspecialized

__all__ = [
    "_mp_bwd_sender_block_kernel",
    "_mp_bwd_sender_kernel",
    "_mp_fwd_block_kernel",
    "_mp_fwd_kernel",
]

if HAS_TRITON:

    @triton.jit
    def _filter_t(w_ptr, BLK: tl.constexpr, f, fm, r, rm, N_FEAT: tl.constexpr, N_RBF: tl.constexpr):
        """``[R_PAD, BLOCK_F]`` tile of filter_weightᵀ for block BLK (a/b/c) and features ``f``; zero padding."""
        offs = (BLK * N_FEAT + f[None, :]).to(tl.int64) * N_RBF + r[:, None]
        return tl.load(w_ptr + offs, mask=rm[:, None] & fm[None, :], other=0.0)

    @triton.jit
    def _filter_tiles(w_ptr, f, fm, r, rm, N_FEAT: tl.constexpr, N_RBF: tl.constexpr):
        """The a, b and c tiles of filter_weightᵀ (``_filter_t``) for features ``f``."""
        wa = _filter_t(w_ptr, 0, f, fm, r, rm, N_FEAT, N_RBF)
        wb = _filter_t(w_ptr, 1, f, fm, r, rm, N_FEAT, N_RBF)
        wc = _filter_t(w_ptr, 2, f, fm, r, rm, N_FEAT, N_RBF)
        return wa, wb, wc

    @triton.jit
    def _filter_rows(w_ptr, BLK: tl.constexpr, f, fm, r, rm, N_FEAT: tl.constexpr, N_RBF: tl.constexpr):
        """``[BLOCK_F, R_PAD]`` tile of filter_weight itself (rows ``BLK * F + f``): the right-hand side of the
        ∂rbf dots ``G @ W`` loaded in that orientation, not as ``tl.trans`` of a ``_filter_t`` tile (a layout
        change in registers, which made the tensor-core dots of the edge kernel spill)."""
        offs = (BLK * N_FEAT + f[:, None]).to(tl.int64) * N_RBF + r[None, :]
        return tl.load(w_ptr + offs, mask=fm[:, None] & rm[None, :], other=0.0)

    @triton.jit
    def _chunk_setup(w_ptr, f, N_FEAT: tl.constexpr, N_RBF: tl.constexpr, R_PAD: tl.constexpr):
        """Feature mask, radial range and mask, and the filter tiles a program holds for its feature chunk ``f``."""
        fm = f < N_FEAT
        r = tl.arange(0, R_PAD)
        rm = r < N_RBF
        wa, wb, wc = _filter_tiles(w_ptr, f, fm, r, rm, N_FEAT, N_RBF)
        return fm, r, rm, wa, wb, wc

    @triton.jit
    def _atom_block(n_atoms, BLOCK_A: tl.constexpr):
        """First atom, atom ids and mask of this program's BLOCK_A consecutive atoms (program axis 0)."""
        a0 = tl.program_id(0).to(tl.int64) * BLOCK_A
        atoms = a0 + tl.arange(0, BLOCK_A)
        am = atoms < n_atoms
        return a0, atoms, am

    @triton.jit
    def _block_edge_range(csr_ptr, a0, n_atoms, BLOCK_A: tl.constexpr):
        """CSR range ``lo .. hi`` of the edges of atoms ``a0 .. a0 + BLOCK_A`` (contiguous in the sorted list)."""
        lo = tl.load(csr_ptr + a0)
        hi = tl.load(csr_ptr + tl.minimum(a0 + BLOCK_A, n_atoms))
        return lo, hi

    @triton.jit
    def _zeros5(ref_ptr, BLOCK_A: tl.constexpr, BLOCK_F: tl.constexpr):
        """Five ``[BLOCK_A, BLOCK_F]`` accumulators in the compute dtype, ref_ptr's (the block sender backward's
        sums)."""
        dt = ref_ptr.dtype.element_ty
        z0 = tl.zeros((BLOCK_A, BLOCK_F), dtype=dt)
        z1 = tl.zeros((BLOCK_A, BLOCK_F), dtype=dt)
        z2 = tl.zeros((BLOCK_A, BLOCK_F), dtype=dt)
        z3 = tl.zeros((BLOCK_A, BLOCK_F), dtype=dt)
        z4 = tl.zeros((BLOCK_A, BLOCK_F), dtype=dt)
        return z0, z1, z2, z3, z4

    @triton.jit
    def _perm_tile(perm_ptr, start, hi, BLOCK_E: tl.constexpr):
        """Edge ids ``e`` and mask of the tile of the sender-sorted edge list ``perm`` at ``start .. hi``."""
        p = start + tl.arange(0, BLOCK_E)
        pm = p < hi
        e = tl.load(perm_ptr + p, mask=pm, other=0).to(tl.int64)
        return e, pm

    @triton.jit
    def _sender_tile(perm_ptr, start, hi, BLOCK_E: tl.constexpr, SYM: tl.constexpr):
        """The sender backward's tile of edges at ``start .. hi``: through ``perm`` (the sender-sorted order), or
        with SYM the positions themselves. SYM: the edge list is symmetric (every edge (i ← j) has a partner
        (j ← i) with the same basis row and unit vector -u, as a full neighbour list has), so the edges that atom
        j sends are the partners of the edges it receives: the kernel walks j's own receiver row (contiguous
        rows of rbf and u, no permutation, no sort) with i the partner's sender and γ's sign flipped."""
        if SYM:
            e = start + tl.arange(0, BLOCK_E)
            return e, e < hi
        else:
            return _perm_tile(perm_ptr, start, hi, BLOCK_E)

    @triton.jit
    def _edge_ends(ei_ptr, ei_stride, e, em):
        """Receivers i (row 0) and senders j (row 1) of edges ``e``."""
        i = tl.load(ei_ptr + e, mask=em, other=0).to(tl.int64)
        j = tl.load(ei_ptr + ei_stride + e, mask=em, other=0).to(tl.int64)
        return i, j

    @triton.jit
    def _onehot(atoms, idx, em, ref_ptr):
        """``[BLOCK_A, BLOCK_E]`` one-hot in ref_ptr's dtype: 1 where edge t's atom ``idx[t]`` is ``atoms[k]``
        (masked edges: none)."""
        return ((idx[None, :] == atoms[:, None]) & em[None, :]).to(ref_ptr.dtype.element_ty)

    @triton.jit
    def _gather(ptr, mask, like):
        """A load of feature rows in ``like``'s dtype (the compute dtype): a no-op cast for rows stored in it, the
        widening of rows stored in 16 bits (the half gathers, see ``message_passing._gathered_rows``)."""
        return tl.load(ptr, mask=mask, other=0.0).to(like.dtype)

    @triton.jit
    def _seg_acc(acc, onehot, m, DOT_PRECISION: tl.constexpr, SEG_SPLIT: tl.constexpr):
        """``acc + onehot @ m``: the one-hot segment sum of messages ``m`` into a block's atoms. SEG_SPLIT (float32
        "tf32x3" kernels on CUDA): the one-hot factor is exact in TF32, so two TF32 MMAs of m's high and low parts
        (m = hi + lo, hi rounded to TF32) carry what tf32x3's three do, the third (the one-hot's low part) being 0.
        hi in integer ops (``tf32_hi``: the bits of ``cvt.rna.tf32.f32``, which compiles to a compare more)."""
        if SEG_SPLIT:
            hi = tf32_hi(m)
            acc = tl.dot(onehot, hi, acc, input_precision="tf32")
            return tl.dot(onehot, m - hi, acc, input_precision="tf32")
        elif DOT_PRECISION == "tf32x2w":  # (the filter weight's dots; m is no weight)
            return acc + dot_rn(onehot, m, "tf32x3")
        elif DOT_PRECISION == "tf32w":  # (likewise: m is rounded as "tf32" rounds it)
            return acc + dot_rn(onehot, m, "tf32")
        else:
            return acc + dot_rn(onehot, m, DOT_PRECISION)

    @triton.jit
    def _rbf_tile(rbf_ptr, e, em, r, rm, N_RBF: tl.constexpr):
        """``[BLOCK_E, R_PAD]`` rows of rbf for edges ``e``; zero for masked edges and padding."""
        return tl.load(rbf_ptr + e[:, None] * N_RBF + r[None, :], mask=em[:, None] & rm[None, :], other=0.0)

    @triton.jit
    def _unit3(unit_ptr, e, em):
        """The x, y, z components of the unit vectors of edges ``e`` (zero for masked edges)."""
        ux = tl.load(unit_ptr + e * 3, mask=em, other=0.0)
        uy = tl.load(unit_ptr + e * 3 + 1, mask=em, other=0.0)
        uz = tl.load(unit_ptr + e * 3 + 2, mask=em, other=0.0)
        return ux, uy, uz

    @triton.jit
    def _rows3(ptr, idx, m2, f, like, N_FEAT: tl.constexpr):
        """The three ``[BLOCK_E, BLOCK_F]`` blocks (k = 0, 1, 2) of rows ``idx`` of a ``[N, 3F]`` tensor, in
        ``like``'s dtype."""
        row = ptr + idx[:, None] * (3 * N_FEAT) + f[None, :]
        r0 = _gather(row, m2, like)
        r1 = _gather(row + N_FEAT, m2, like)
        r2 = _gather(row + 2 * N_FEAT, m2, like)
        return r0, r1, r2

    @triton.jit
    def _sender_tile_loads(
        gs_ptr, gv_ptr, rbf_ptr, unit_ptr, e, pm, i, f, fm, r, rm, N_FEAT: tl.constexpr, N_RBF: tl.constexpr
    ):
        """What a sender-backward tile of edges ``e`` (receivers ``i``) reads besides x_j, v_j: rbf rows, the edge
        mask over features, g_v[i] (three blocks), the unit vectors and g_s[i]."""
        rb = _rbf_tile(rbf_ptr, e, pm, r, rm, N_RBF)
        m2 = pm[:, None] & fm[None, :]
        g0, g1, g2 = _rows3(gv_ptr, i, m2, f, rb, N_FEAT)
        ux, uy, uz = _unit3(unit_ptr, e, pm)
        gsi = _gather(gs_ptr + i[:, None] * N_FEAT + f[None, :], m2, rb)
        return rb, m2, g0, g1, g2, ux, uy, uz, gsi

    @triton.jit
    def _gamma(g0, g1, g2, ux, uy, uz):
        """γ_e = Σ_k g_v[i,k] u_e[k] over a tile (``[BLOCK_E, BLOCK_F]``)."""
        return g0 * ux[:, None] + g1 * uy[:, None] + g2 * uz[:, None]

    @triton.jit
    def _store3(out, t0, t1, t2, mask, N_FEAT: tl.constexpr):
        """Stores the three blocks (k = 0, 1, 2, F apart) of a ``[.., 3F]`` row at ``out``."""
        tl.store(out, t0, mask=mask)
        tl.store(out + N_FEAT, t1, mask=mask)
        tl.store(out + 2 * N_FEAT, t2, mask=mask)

    @triton.jit
    def _store_sender_grads(
        x_ptr, v_ptr, gx_ptr, gvout_ptr, gvadd_ptr, row, mask, acc_a, acc_c, t_0, t_1, t_2, N_FEAT: tl.constexpr,
        ADD_GV: tl.constexpr,
    ):  # fmt: skip
        """Writes the sender backward's ∂x_j = (acc_a, Σ_k v_j[k] ⊙ T_k, acc_c) and ∂v_j[k] = x_b,j ⊙ T_k at ``row``
        (offsets of sender rows of ``[N, 3F]``, 1-D for one sender or 2-D for a block). ADD_GV: ∂v plus the rows of
        ``gvadd`` (the gradient of v's residual alias: autograd's add kernel, in this store)."""
        v0 = tl.load(v_ptr + row, mask=mask, other=0.0)
        v1 = tl.load(v_ptr + row + N_FEAT, mask=mask, other=0.0)
        v2 = tl.load(v_ptr + row + 2 * N_FEAT, mask=mask, other=0.0)
        xb = tl.load(x_ptr + row + N_FEAT, mask=mask, other=0.0)
        tl.store(gx_ptr + row, acc_a, mask=mask)
        tl.store(gx_ptr + row + N_FEAT, v0 * t_0 + v1 * t_1 + v2 * t_2, mask=mask)
        tl.store(gx_ptr + row + 2 * N_FEAT, acc_c, mask=mask)
        gv0 = xb * t_0
        gv1 = xb * t_1
        gv2 = xb * t_2
        if ADD_GV:
            gv0 += tl.load(gvadd_ptr + row, mask=mask, other=0.0)
            gv1 += tl.load(gvadd_ptr + row + N_FEAT, mask=mask, other=0.0)
            gv2 += tl.load(gvadd_ptr + row + 2 * N_FEAT, mask=mask, other=0.0)
        tl.store(gvout_ptr + row, gv0, mask=mask)
        tl.store(gvout_ptr + row + N_FEAT, gv1, mask=mask)
        tl.store(gvout_ptr + row + 2 * N_FEAT, gv2, mask=mask)

    @triton.jit(**unspecialized("ei_stride"))
    def _mp_fwd_kernel(
        x_ptr,
        v_ptr,
        rbf_ptr,
        w_ptr,
        unit_ptr,
        ei_ptr,
        rowptr_ptr,
        ds_ptr,
        dv_ptr,
        ei_stride,
        N_FEAT: tl.constexpr,
        N_RBF: tl.constexpr,
        BLOCK_E: tl.constexpr,
        BLOCK_F: tl.constexpr,
        R_PAD: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        HAS_V: tl.constexpr,
        PDL: tl.constexpr,
    ):
        pdl_prologue(PDL)
        # HAS_V False: the caller promised v = 0 (the first layer), so the b-terms (x_b W_b v_j) are skipped.
        i = tl.program_id(0).to(tl.int64)
        f = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
        fm, r, rm, wa, wb, wc = _chunk_setup(w_ptr, f, N_FEAT, N_RBF, R_PAD)
        dt = rbf_ptr.dtype.element_ty  # the compute dtype (x and v may be stored in 16 bits: half gathers)
        acc_s = tl.zeros((BLOCK_F,), dtype=dt)
        acc_0 = tl.zeros((BLOCK_F,), dtype=dt)
        acc_1 = tl.zeros((BLOCK_F,), dtype=dt)
        acc_2 = tl.zeros((BLOCK_F,), dtype=dt)
        lo = tl.load(rowptr_ptr + i)
        hi = tl.load(rowptr_ptr + i + 1)
        for start in range(lo, hi, BLOCK_E):
            e = start + tl.arange(0, BLOCK_E)
            em = e < hi
            j = tl.load(ei_ptr + ei_stride + e, mask=em, other=0).to(tl.int64)
            rb = _rbf_tile(rbf_ptr, e, em, r, rm, N_RBF)
            m2 = em[:, None] & fm[None, :]
            xrow = x_ptr + j[:, None] * (3 * N_FEAT) + f[None, :]
            vrow = v_ptr + j[:, None] * (3 * N_FEAT) + f[None, :]
            # Masked edges have rb = 0 and x = 0, so they add exact zeros.
            a = _gather(xrow, m2, rb) * dot_fin(rb, wa, DOT_PRECISION)
            c = _gather(xrow + 2 * N_FEAT, m2, rb) * dot_fin(rb, wc, DOT_PRECISION)
            ux, uy, uz = _unit3(unit_ptr, e, em)
            acc_s += tl.sum(a, axis=0)
            if HAS_V:
                b = _gather(xrow + N_FEAT, m2, rb) * dot_fin(rb, wb, DOT_PRECISION)
                acc_0 += tl.sum(b * _gather(vrow, m2, rb) + c * ux[:, None], axis=0)
                acc_1 += tl.sum(b * _gather(vrow + N_FEAT, m2, rb) + c * uy[:, None], axis=0)
                acc_2 += tl.sum(b * _gather(vrow + 2 * N_FEAT, m2, rb) + c * uz[:, None], axis=0)
            else:
                acc_0 += tl.sum(c * ux[:, None], axis=0)
                acc_1 += tl.sum(c * uy[:, None], axis=0)
                acc_2 += tl.sum(c * uz[:, None], axis=0)
        tl.store(ds_ptr + i * N_FEAT + f, acc_s, mask=fm)
        out = dv_ptr + i * (3 * N_FEAT) + f
        _store3(out, acc_0, acc_1, acc_2, fm, N_FEAT)

    # "block" forward: one program per (BLOCK_A consecutive receivers, feature chunk). Their edges are one contiguous
    # range of the receiver-sorted list (row_ptr[a0] .. row_ptr[a0 + BLOCK_A]), walked in BLOCK_E tiles that may
    # straddle receivers; each tile's messages [BLOCK_E, BLOCK_F] are summed into the BLOCK_A receivers by a
    # one-hot [BLOCK_A, BLOCK_E] tl.dot (a segment sum on the tensor cores, no atomics). The one-hot factor is
    # exact, so the sum carries only the dot's rounding of the messages (none in "ieee", ~fp32 in "tf32x3").
    # Against one program per atom it loads the filter chunk once per BLOCK_A atoms instead of once per atom and
    # runs MMAs of BLOCK_E >= 32 rows instead of one atom's ~55 edges padded to 16-row tiles.

    @triton.jit(**unspecialized("n_atoms", "ei_stride"))  # no recompile per count class (_triton_utils)
    def _mp_fwd_block_kernel(
        x_ptr,
        v_ptr,
        rbf_ptr,
        w_ptr,
        unit_ptr,
        ei_ptr,
        rowptr_ptr,
        ds_ptr,
        dv_ptr,
        n_atoms,
        ei_stride,
        N_FEAT: tl.constexpr,
        N_RBF: tl.constexpr,
        BLOCK_A: tl.constexpr,
        BLOCK_E: tl.constexpr,
        BLOCK_F: tl.constexpr,
        R_PAD: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        HAS_V: tl.constexpr,
        SEG_SPLIT: tl.constexpr,
        PDL: tl.constexpr,
        FOLD: tl.constexpr = False,
    ):
        # FOLD: v_ptr holds p = x_b ⊙ v (per sender, made by the host), so b_e ⊙ v_j = W_b,e ⊙ p_j needs no x_b load
        pdl_prologue(PDL)
        a0, atoms, am = _atom_block(n_atoms, BLOCK_A)
        f = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
        fm, r, rm, wa, wb, wc = _chunk_setup(w_ptr, f, N_FEAT, N_RBF, R_PAD)
        dt = rbf_ptr.dtype.element_ty  # the compute dtype (x and v may be stored in 16 bits: half gathers)
        acc_s = tl.zeros((BLOCK_A, BLOCK_F), dtype=dt)
        acc_0 = tl.zeros((BLOCK_A, BLOCK_F), dtype=dt)
        acc_1 = tl.zeros((BLOCK_A, BLOCK_F), dtype=dt)
        acc_2 = tl.zeros((BLOCK_A, BLOCK_F), dtype=dt)
        lo, hi = _block_edge_range(rowptr_ptr, a0, n_atoms, BLOCK_A)
        for start in range(lo, hi, BLOCK_E):
            e = start + tl.arange(0, BLOCK_E)
            em = e < hi
            i, j = _edge_ends(ei_ptr, ei_stride, e, em)
            # onehot[k, t] = 1 where edge t of the tile goes to atom a0 + k (masked edges match no atom).
            onehot = _onehot(atoms, i, em, rbf_ptr)
            rb = _rbf_tile(rbf_ptr, e, em, r, rm, N_RBF)
            m2 = em[:, None] & fm[None, :]
            xrow = x_ptr + j[:, None] * (3 * N_FEAT) + f[None, :]
            vrow = v_ptr + j[:, None] * (3 * N_FEAT) + f[None, :]
            a = _gather(xrow, m2, rb) * dot_fin(rb, wa, DOT_PRECISION)
            acc_s = _seg_acc(acc_s, onehot, a, DOT_PRECISION, SEG_SPLIT)
            c = _gather(xrow + 2 * N_FEAT, m2, rb) * dot_fin(rb, wc, DOT_PRECISION)
            ux, uy, uz = _unit3(unit_ptr, e, em)
            m_0 = c * ux[:, None]
            m_1 = c * uy[:, None]
            m_2 = c * uz[:, None]
            if HAS_V:
                if FOLD:
                    b = dot_fin(rb, wb, DOT_PRECISION)
                else:
                    b = _gather(xrow + N_FEAT, m2, rb) * dot_fin(rb, wb, DOT_PRECISION)
                m_0 += b * _gather(vrow, m2, rb)
                m_1 += b * _gather(vrow + N_FEAT, m2, rb)
                m_2 += b * _gather(vrow + 2 * N_FEAT, m2, rb)
            acc_0 = _seg_acc(acc_0, onehot, m_0, DOT_PRECISION, SEG_SPLIT)
            acc_1 = _seg_acc(acc_1, onehot, m_1, DOT_PRECISION, SEG_SPLIT)
            acc_2 = _seg_acc(acc_2, onehot, m_2, DOT_PRECISION, SEG_SPLIT)
        om = am[:, None] & fm[None, :]
        tl.store(ds_ptr + atoms[:, None] * N_FEAT + f[None, :], acc_s, mask=om)
        out = dv_ptr + atoms[:, None] * (3 * N_FEAT) + f[None, :]
        _store3(out, acc_0, acc_1, acc_2, om, N_FEAT)

    # Backward (the VJP; see message_passing_backward_reference): with β_e = Σ_k g_v[i,k] v_j[k] and
    # γ_e = Σ_k g_v[i,k] u_e[k],
    #   ∂x_j = Σ_{e: sender j} (g_s[i] ⊙ W_a,e,  β_e ⊙ W_b,e,  γ_e ⊙ W_c,e),   ∂v_j[k] = x_b,j ⊙ T_k,
    #   with T_k = Σ_{e: sender j} W_b,e ⊙ g_v[i,k], so that also Σ_e β_e ⊙ W_b,e = Σ_k v_j[k] ⊙ T_k;
    #   G_e = (g_s[i] ⊙ x_a,j, β_e ⊙ x_b,j, γ_e ⊙ x_c,j):  ∂rbf_e = filter_weightᵀ G_e,  ∂u_e[k] = Σ_f c_e g_v[i,k],
    #   ∂filter_weight = Σ_e G_e ⊗ rbf_e.
    # Three kernels, none with atomics:
    #   * _mp_bwd_sender_kernel: ∂x, ∂v are sums over the edges of each *sender*: one program per (sender, feature
    #     chunk) walks the transposed CSR (edges sorted by sender: an argsort per graph, cached across layers)
    #     and reduces in registers, the mirror image of the forward. Atomics instead would put 6F scattered
    #     atomic adds per edge on the hottest output (and make it non-deterministic). On a symmetric (full) list
    #     (SYM, stop 54) it walks the sender's own receiver row instead: the partners of the edges it sends.
    #   * _mp_bwd_edge_kernel: ∂rbf_e and ∂u_e reduce over all 3F features of one edge: one program per tile of
    #     edges loops over the feature chunks and writes each edge's row once. With DU_DOT (shipped since stop 55)
    #     the c-terms go through D_k = (x_c,j ⊙ g_v[i,k]) @ W_c ([E, R], summed over the chunks):
    #     ∂u_e[k] = rbf_e · D_k[e] and (G_c @ W_c)_e = Σ_k u_e[k] D_k[e], so no feature sums across lanes.
    #   * _mp_bwd_filter_kernel: ∂filter_weight reduces over all edges: each program sums a contiguous range of
    #     edges for one feature chunk into a [BLOCK_F, R_PAD] register tile (a tl.dot with K = edges) and
    #     writes one partial; the host sums the few hundred partials (deterministic, no contention).

    @triton.jit
    def _fold_half(x, BLOCK_E: tl.constexpr, BLOCK_F: tl.constexpr):
        """``[BLOCK_E, BLOCK_F]`` → ``[BLOCK_E // 2, BLOCK_F]``: rows r and r + BLOCK_E / 2 added."""
        return tl.sum(tl.reshape(x, (2, BLOCK_E // 2, BLOCK_F)), axis=0)

    @triton.jit(**unspecialized("ei_stride"))
    def _mp_bwd_sender_kernel(
        gs_ptr,
        gv_ptr,
        x_ptr,
        v_ptr,
        rbf_ptr,
        w_ptr,
        unit_ptr,
        ei_ptr,
        perm_ptr,
        colptr_ptr,
        gx_ptr,
        gvout_ptr,
        gvadd_ptr,
        ei_stride,
        N_FEAT: tl.constexpr,
        N_RBF: tl.constexpr,
        BLOCK_E: tl.constexpr,
        BLOCK_F: tl.constexpr,
        R_PAD: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        ADD_GV: tl.constexpr,
        PDL: tl.constexpr,
        SYM: tl.constexpr = False,
        FOLD_HALF: tl.constexpr = False,
    ):
        # SYM: the edge list is symmetric (see _sym_tile): colptr_ptr is the receiver CSR, perm_ptr unused.
        # FOLD_HALF (sender_fold_half): the five sums kept as [BLOCK_E / 2, BLOCK_F] tiles, each tile's rows r and
        # r + BLOCK_E / 2 added into them in the loop (the same thread holds both in the MMA's layout: no shuffle),
        # and summed over the rows once after it; else [BLOCK_F] sums, each tile summed across its rows in the loop.
        pdl_prologue(PDL)
        j = tl.program_id(0).to(tl.int64)
        f = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
        fm, r, rm, wa, wb, wc = _chunk_setup(w_ptr, f, N_FEAT, N_RBF, R_PAD)
        # [BLOCK_F] sums, each tile's edges summed in its iteration. [BLOCK_E, BLOCK_F] accumulators summed once
        # after the loop cut the loop's instructions by ~24 % (stop 61, probe_sass.py) but measured slower on the
        # water steps: spills under the 128-register cap, fewer programs per SM without it (stop61_gpu/b/).
        if FOLD_HALF:
            acc_a, acc_c, t_0, t_1, t_2 = _zeros5(rbf_ptr, BLOCK_E // 2, BLOCK_F)
        else:
            dt = rbf_ptr.dtype.element_ty
            acc_a = tl.zeros((BLOCK_F,), dtype=dt)
            acc_c = tl.zeros((BLOCK_F,), dtype=dt)
            t_0 = tl.zeros((BLOCK_F,), dtype=dt)
            t_1 = tl.zeros((BLOCK_F,), dtype=dt)
            t_2 = tl.zeros((BLOCK_F,), dtype=dt)
        lo = tl.load(colptr_ptr + j)
        hi = tl.load(colptr_ptr + j + 1)
        for start in range(lo, hi, BLOCK_E):
            e, pm = _sender_tile(perm_ptr, start, hi, BLOCK_E, SYM)
            if SYM:  # e = (j ← i), the partner of (i ← j): i is its sender
                i = tl.load(ei_ptr + ei_stride + e, mask=pm, other=0).to(tl.int64)
            else:
                i = tl.load(ei_ptr + e, mask=pm, other=0).to(tl.int64)
            rb, _, g0, g1, g2, ux, uy, uz, gsi = _sender_tile_loads(
                gs_ptr, gv_ptr, rbf_ptr, unit_ptr, e, pm, i, f, fm, r, rm, N_FEAT, N_RBF
            )
            w_a = dot_fin(rb, wa, DOT_PRECISION)
            w_b = dot_fin(rb, wb, DOT_PRECISION)
            w_c = dot_fin(rb, wc, DOT_PRECISION)
            if FOLD_HALF:
                acc_a += _fold_half(gsi * w_a, BLOCK_E, BLOCK_F)
                acc_c += _fold_half(_gamma(g0, g1, g2, ux, uy, uz) * w_c, BLOCK_E, BLOCK_F)
                t_0 += _fold_half(w_b * g0, BLOCK_E, BLOCK_F)
                t_1 += _fold_half(w_b * g1, BLOCK_E, BLOCK_F)
                t_2 += _fold_half(w_b * g2, BLOCK_E, BLOCK_F)
            else:
                acc_a += tl.sum(gsi * w_a, axis=0)
                acc_c += tl.sum(_gamma(g0, g1, g2, ux, uy, uz) * w_c, axis=0)
                t_0 += tl.sum(w_b * g0, axis=0)
                t_1 += tl.sum(w_b * g1, axis=0)
                t_2 += tl.sum(w_b * g2, axis=0)
        if FOLD_HALF:
            acc_a = tl.sum(acc_a, axis=0)
            acc_c = tl.sum(acc_c, axis=0)
            t_0 = tl.sum(t_0, axis=0)
            t_1 = tl.sum(t_1, axis=0)
            t_2 = tl.sum(t_2, axis=0)
        if SYM:  # γ was summed with the partners' unit vectors, -u
            acc_c = -acc_c
        row = j * (3 * N_FEAT) + f
        _store_sender_grads(
            x_ptr, v_ptr, gx_ptr, gvout_ptr, gvadd_ptr, row, fm, acc_a, acc_c, t_0, t_1, t_2, N_FEAT, ADD_GV
        )

    # "block" sender backward: the mirror of _mp_fwd_block_kernel over the transposed CSR (BLOCK_A consecutive
    # senders, their edges contiguous in perm), the five per-sender sums as one-hot tl.dots.

    @triton.jit(**unspecialized("n_atoms", "ei_stride"))  # no recompile per count class (_triton_utils)
    def _mp_bwd_sender_block_kernel(
        gs_ptr,
        gv_ptr,
        x_ptr,
        v_ptr,
        rbf_ptr,
        w_ptr,
        unit_ptr,
        ei_ptr,
        perm_ptr,
        colptr_ptr,
        gx_ptr,
        gvout_ptr,
        gvadd_ptr,
        n_atoms,
        ei_stride,
        N_FEAT: tl.constexpr,
        N_RBF: tl.constexpr,
        BLOCK_A: tl.constexpr,
        BLOCK_E: tl.constexpr,
        BLOCK_F: tl.constexpr,
        R_PAD: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        SEG_SPLIT: tl.constexpr,
        ADD_GV: tl.constexpr,
        PDL: tl.constexpr,
        SYM: tl.constexpr = False,
    ):
        pdl_prologue(PDL)
        a0, atoms, am = _atom_block(n_atoms, BLOCK_A)
        f = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
        fm, r, rm, wa, wb, wc = _chunk_setup(w_ptr, f, N_FEAT, N_RBF, R_PAD)
        acc_a, acc_c, t_0, t_1, t_2 = _zeros5(rbf_ptr, BLOCK_A, BLOCK_F)
        lo, hi = _block_edge_range(colptr_ptr, a0, n_atoms, BLOCK_A)
        for start in range(lo, hi, BLOCK_E):
            e, pm = _sender_tile(perm_ptr, start, hi, BLOCK_E, SYM)
            if SYM:  # the partners (j ← i) of the block's edges: j, this program's atom, receives
                j, i = _edge_ends(ei_ptr, ei_stride, e, pm)
            else:
                i, j = _edge_ends(ei_ptr, ei_stride, e, pm)
            onehot = _onehot(atoms, j, pm, rbf_ptr)
            rb, _, g0, g1, g2, ux, uy, uz, gsi = _sender_tile_loads(
                gs_ptr, gv_ptr, rbf_ptr, unit_ptr, e, pm, i, f, fm, r, rm, N_FEAT, N_RBF
            )
            w_a = dot_fin(rb, wa, DOT_PRECISION)
            acc_a = _seg_acc(acc_a, onehot, gsi * w_a, DOT_PRECISION, SEG_SPLIT)
            w_c = dot_fin(rb, wc, DOT_PRECISION)
            gamma = _gamma(g0, g1, g2, ux, uy, uz)
            acc_c = _seg_acc(acc_c, onehot, gamma * w_c, DOT_PRECISION, SEG_SPLIT)
            w_b = dot_fin(rb, wb, DOT_PRECISION)
            t_0 = _seg_acc(t_0, onehot, w_b * g0, DOT_PRECISION, SEG_SPLIT)
            t_1 = _seg_acc(t_1, onehot, w_b * g1, DOT_PRECISION, SEG_SPLIT)
            t_2 = _seg_acc(t_2, onehot, w_b * g2, DOT_PRECISION, SEG_SPLIT)
        if SYM:  # γ was summed with the partners' unit vectors, -u
            acc_c = -acc_c
        om = am[:, None] & fm[None, :]
        row = atoms[:, None] * (3 * N_FEAT) + f[None, :]
        _store_sender_grads(
            x_ptr, v_ptr, gx_ptr, gvout_ptr, gvadd_ptr, row, om, acc_a, acc_c, t_0, t_1, t_2, N_FEAT, ADD_GV
        )
