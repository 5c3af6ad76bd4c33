"""The Triton kernels of :mod:`.edge_features` (jit kernels and their jit helpers only).

The host side, which chooses blocks, allocates and launches these kernels, the torch.library ops and the autograd
Functions, stays in :mod:`.edge_features` together with the torch reference and the description of the three
kernels (forward, backward, backward of the backward) that serve both ops. As with :mod:`._mp_kernels`, an edit
here never touches the host path and vice versa.
"""

from __future__ import annotations

from ._triton_utils import HAS_TRITON, pdl_prologue, tl, triton, unspecialized

__all__ = ["_TINY2", "_edge_bwd_bwd_kernel", "_edge_bwd_kernel", "_edge_fwd_kernel"]

# Squared distance (Å²) below which an edge counts as zero-length.
_TINY2 = 1e-20

if HAS_TRITON:
    from .rbf_cutoff import _rbf_rows
    from .repulsion import _wall_gate

    _TINY2_C = tl.constexpr(_TINY2)

    @triton.jit
    def _load3(ptr, idx, mask):
        base = ptr + idx * 3
        return (
            tl.load(base, mask=mask, other=0.0),
            tl.load(base + 1, mask=mask, other=0.0),
            tl.load(base + 2, mask=mask, other=0.0),
        )

    @triton.jit
    def _store3(ptr, idx, x, y, z, mask):
        base = ptr + idx * 3
        tl.store(base, x, mask=mask)
        tl.store(base + 1, y, mask=mask)
        tl.store(base + 2, z, mask=mask)

    @triton.jit(**unspecialized("E", "ei_stride"))
    def _edge_fwd_kernel(
        pos_ptr,
        ei_ptr,
        shift_ptr,
        vec_ptr,
        dist_ptr,
        unit_ptr,
        rbf_ptr,
        idx_ptr,
        table_ptr,
        zero_ptr,
        n_zero,
        E,
        ei_stride,
        n_species,
        BLOCK_E: tl.constexpr,
        STORE_VEC: tl.constexpr,
        WITH_RBF: tl.constexpr,
        N_RBF: tl.constexpr,
        BASIS: tl.constexpr,
        ENVELOPE: tl.constexpr,
        IS_FP64: tl.constexpr,
        INV_RC: tl.constexpr,
        RC: tl.constexpr,
        PI_RC: tl.constexpr,
        NORM: tl.constexpr,
        GAMMA: tl.constexpr,
        MU_STEP: tl.constexpr,
        WALL: tl.constexpr,
        ZERO: tl.constexpr,
        PDL: tl.constexpr,
    ):
        pdl_prologue(PDL)
        if ZERO:  # the n_zero entries at zero_ptr filled with zeros (the backward's position gradient: no fill kernel)
            z = tl.arange(0, 128)
            for start in range(tl.program_id(0) * 128, n_zero, tl.num_programs(0) * 128):
                tl.store(
                    zero_ptr + start + z, tl.zeros((128,), dtype=zero_ptr.dtype.element_ty), mask=start + z < n_zero
                )
        rows = tl.program_id(0).to(tl.int64) * BLOCK_E + tl.arange(0, BLOCK_E)
        m = rows < E
        i = tl.load(ei_ptr + rows, mask=m, other=0).to(tl.int64)
        j = tl.load(ei_ptr + ei_stride + rows, mask=m, other=0).to(tl.int64)
        pix, piy, piz = _load3(pos_ptr, i, m)
        pjx, pjy, pjz = _load3(pos_ptr, j, m)
        sx, sy, sz = _load3(shift_ptr, rows, m)
        vx = (pjx - pix) + sx
        vy = (pjy - piy) + sy
        vz = (pjz - piz) + sz
        d2 = vx * vx + vy * vy + vz * vz
        nonzero = d2 > _TINY2_C
        dist = tl.where(nonzero, tl.sqrt(tl.where(nonzero, d2, 1.0)), 0.0)
        inv = 1.0 / tl.where(nonzero, dist, 1.0)
        if STORE_VEC:
            _store3(vec_ptr, rows, vx, vy, vz, m)
        tl.store(dist_ptr + rows, dist, mask=m)
        _store3(unit_ptr, rows, vx * inv, vy * inv, vz * inv, m)
        if WITH_RBF:
            g0 = dist
            if WALL:
                g0, _, _ = _wall_gate(i, j, dist, m, idx_ptr, table_ptr, n_species, 0)
            _rbf_rows(
                rows,
                m,
                dist,
                dist,
                rbf_ptr,
                rbf_ptr,
                0,
                N_RBF,
                BASIS,
                ENVELOPE,
                IS_FP64,
                INV_RC,
                RC,
                PI_RC,
                NORM,
                GAMMA,
                MU_STEP,
                g0,
                g0,
                g0,
                WALL,
            )

    @triton.jit
    def _segmented_add(fa, xa, ya, za, fb, xb, yb, zb):
        # Segmented sum, b following a: a run restarts where b's start flag is set.
        keep = fb == 0
        return fa | fb, tl.where(keep, xa + xb, xb), tl.where(keep, ya + yb, yb), tl.where(keep, za + zb, zb)

    # VJP. With u = vec/d (d > 0) and G = g_dist + Σ_k g_rbf[k] R_k'(d) (fused op), the gradient wrt vec is
    #   g_v = g_vec + G u + (g_unit - (g_unit·u) u) / d;   for a zero-length edge (d = 0): g_vec + g_unit,
    # as in the reference (dist's where() passes no gradient, unit = vec / 1). Then g_shift = g_v, and
    # g_pos[j] += g_v, g_pos[i] -= g_v (atomics: many edges share an atom).
    @triton.jit(**unspecialized("E", "ei_stride"))
    def _edge_bwd_kernel(
        gvec_ptr,
        gdist_ptr,
        gunit_ptr,
        grbf_ptr,
        dist_ptr,
        unit_ptr,
        ei_ptr,
        gpos_ptr,
        gshift_ptr,
        idx_ptr,
        table_ptr,
        E,
        ei_stride,
        n_species,
        BLOCK_E: tl.constexpr,
        HAS_VEC: tl.constexpr,
        SEG_I: tl.constexpr,
        WITH_RBF: tl.constexpr,
        N_RBF: tl.constexpr,
        BASIS: tl.constexpr,
        ENVELOPE: tl.constexpr,
        IS_FP64: tl.constexpr,
        INV_RC: tl.constexpr,
        RC: tl.constexpr,
        PI_RC: tl.constexpr,
        NORM: tl.constexpr,
        GAMMA: tl.constexpr,
        MU_STEP: tl.constexpr,
        HAS_GDIST: tl.constexpr,
        WALL: tl.constexpr,
        PDL: tl.constexpr,
    ):
        pdl_prologue(PDL)
        rows = tl.program_id(0).to(tl.int64) * BLOCK_E + tl.arange(0, BLOCK_E)
        m = rows < E
        d = tl.load(dist_ptr + rows, mask=m, other=1.0)
        ux, uy, uz = _load3(unit_ptr, rows, m)
        gx, gy, gz = _load3(gunit_ptr, rows, m)
        if HAS_GDIST:
            big_g = tl.load(gdist_ptr + rows, mask=m, other=0.0)
        else:  # dist unused (edge_basis in the model): exact zeros, as the zero-filled gradient had
            big_g = tl.zeros([BLOCK_E], d.dtype)
        if WITH_RBF:
            g0 = d
            g1 = d
            if WALL:
                wi = tl.load(ei_ptr + rows, mask=m, other=0).to(tl.int64)
                wj = tl.load(ei_ptr + ei_stride + rows, mask=m, other=0).to(tl.int64)
                g0, g1, _ = _wall_gate(wi, wj, d, m, idx_ptr, table_ptr, n_species, 1)
            g_rbf, _ = _rbf_rows(
                rows,
                m,
                d,
                d,
                grbf_ptr,
                grbf_ptr,
                1,
                N_RBF,
                BASIS,
                ENVELOPE,
                IS_FP64,
                INV_RC,
                RC,
                PI_RC,
                NORM,
                GAMMA,
                MU_STEP,
                g0,
                g1,
                g1,
                WALL,
            )
            big_g += g_rbf
        nonzero = d > 0.0
        inv = 1.0 / tl.where(nonzero, d, 1.0)
        gu = gx * ux + gy * uy + gz * uz
        vx = tl.where(nonzero, big_g * ux + (gx - gu * ux) * inv, gx)
        vy = tl.where(nonzero, big_g * uy + (gy - gu * uy) * inv, gy)
        vz = tl.where(nonzero, big_g * uz + (gz - gu * uz) * inv, gz)
        if HAS_VEC:
            ax, ay, az = _load3(gvec_ptr, rows, m)
            vx += ax
            vy += ay
            vz += az
        _store3(gshift_ptr, rows, vx, vy, vz, m)
        i = tl.load(ei_ptr + rows, mask=m, other=0)
        j3 = tl.load(ei_ptr + ei_stride + rows, mask=m, other=0).to(tl.int64) * 3
        tl.atomic_add(gpos_ptr + j3, vx, mask=m, sem="relaxed")
        tl.atomic_add(gpos_ptr + j3 + 1, vy, mask=m, sem="relaxed")
        tl.atomic_add(gpos_ptr + j3 + 2, vz, mask=m, sem="relaxed")
        if SEG_I:
            # Receivers come sorted from the neighbour lists, so the edges of one atom i sit next to each
            # other: sum each run of equal i inside the block with a segmented scan and issue one atomic
            # per run (at its last edge) instead of one per edge, all of which would hit the same address.
            # Correct for any order; unsorted receivers only make the runs shorter.
            lane = tl.arange(0, BLOCK_E)
            i_prev = tl.load(ei_ptr + rows - 1, mask=m & (lane > 0), other=-1)
            i_next = tl.load(ei_ptr + rows + 1, mask=(rows + 1 < E) & (lane < BLOCK_E - 1), other=-1)
            start = ((lane == 0) | (i != i_prev)).to(tl.int32)
            _, sx, sy, sz = tl.associative_scan((start, vx, vy, vz), 0, _segmented_add)
            last = m & (i != i_next)
            i3 = i.to(tl.int64) * 3
            tl.atomic_add(gpos_ptr + i3, -sx, mask=last, sem="relaxed")
            tl.atomic_add(gpos_ptr + i3 + 1, -sy, mask=last, sem="relaxed")
            tl.atomic_add(gpos_ptr + i3 + 2, -sz, mask=last, sem="relaxed")
        else:
            i3 = i.to(tl.int64) * 3
            tl.atomic_add(gpos_ptr + i3, -vx, mask=m, sem="relaxed")
            tl.atomic_add(gpos_ptr + i3 + 1, -vy, mask=m, sem="relaxed")
            tl.atomic_add(gpos_ptr + i3 + 2, -vz, mask=m, sem="relaxed")

    # VJP of the backward, as a function of (g_vec, g_dist, g_unit, g_rbf, d, u) with d and u independent
    # inputs (autograd chains their gradients into the forward op). Given ∂L/∂g_pos and ∂L/∂g_shift, the
    # gradient wrt g_v is w = ∂L/∂g_shift[e] + ∂L/∂g_pos[j] - ∂L/∂g_pos[i] (gathers, no atomics). For d > 0,
    # with G as in the backward and H = Σ_k g_rbf[k] R_k''(d):
    #   ∂/∂g_vec = w      ∂/∂g_dist = w·u      ∂/∂g_rbf[k] = (w·u) R_k'(d)      ∂/∂g_unit = (w - (w·u) u) / d
    #   ∂/∂u = G w - ((w·u) g_unit + (g_unit·u) w) / d      ∂/∂d = (w·u) H - (w·g_unit - (g_unit·u)(w·u)) / d²
    # and for d = 0 (g_v = g_vec + g_unit): ∂/∂g_vec = ∂/∂g_unit = w, all others 0.
    @triton.jit(**unspecialized("E", "ei_stride"))
    def _edge_bwd_bwd_kernel(
        ggpos_ptr,
        ggshift_ptr,
        gdist_ptr,
        gunit_ptr,
        grbf_ptr,
        dist_ptr,
        unit_ptr,
        ei_ptr,
        o_gvec_ptr,
        o_gdist_ptr,
        o_gunit_ptr,
        o_grbf_ptr,
        o_dist_ptr,
        o_unit_ptr,
        idx_ptr,
        table_ptr,
        E,
        ei_stride,
        n_species,
        BLOCK_E: tl.constexpr,
        HAS_VEC: tl.constexpr,
        WITH_RBF: tl.constexpr,
        N_RBF: tl.constexpr,
        BASIS: tl.constexpr,
        ENVELOPE: tl.constexpr,
        IS_FP64: tl.constexpr,
        INV_RC: tl.constexpr,
        RC: tl.constexpr,
        PI_RC: tl.constexpr,
        NORM: tl.constexpr,
        GAMMA: tl.constexpr,
        MU_STEP: tl.constexpr,
        WALL: tl.constexpr,
        PDL: tl.constexpr,
    ):
        pdl_prologue(PDL)
        rows = tl.program_id(0).to(tl.int64) * BLOCK_E + tl.arange(0, BLOCK_E)
        m = rows < E
        i = tl.load(ei_ptr + rows, mask=m, other=0).to(tl.int64)
        j = tl.load(ei_ptr + ei_stride + rows, mask=m, other=0).to(tl.int64)
        wx, wy, wz = _load3(ggshift_ptr, rows, m)
        ax, ay, az = _load3(ggpos_ptr, j, m)
        bx, by, bz = _load3(ggpos_ptr, i, m)
        wx += ax - bx
        wy += ay - by
        wz += az - bz
        d = tl.load(dist_ptr + rows, mask=m, other=1.0)
        ux, uy, uz = _load3(unit_ptr, rows, m)
        gx, gy, gz = _load3(gunit_ptr, rows, m)
        big_g = tl.load(gdist_ptr + rows, mask=m, other=0.0)
        nonzero = d > 0.0
        inv = 1.0 / tl.where(nonzero, d, 1.0)
        wu = wx * ux + wy * uy + wz * uz
        gu = gx * ux + gy * uy + gz * uz
        wg = wx * gx + wy * gy + wz * gz
        s = tl.where(nonzero, wu, 0.0)
        big_h = tl.zeros_like(d)
        if WITH_RBF:
            g0 = d
            g1 = d
            g2 = d
            if WALL:
                g0, g1, g2 = _wall_gate(i, j, d, m, idx_ptr, table_ptr, n_species, 2)
            g_rbf, big_h = _rbf_rows(
                rows,
                m,
                d,
                s,
                grbf_ptr,
                o_grbf_ptr,
                3,
                N_RBF,
                BASIS,
                ENVELOPE,
                IS_FP64,
                INV_RC,
                RC,
                PI_RC,
                NORM,
                GAMMA,
                MU_STEP,
                g0,
                g1,
                g2,
                WALL,
            )
            big_g += g_rbf
        if HAS_VEC:
            _store3(o_gvec_ptr, rows, wx, wy, wz, m)
        tl.store(o_gdist_ptr + rows, s, mask=m)
        _store3(
            o_gunit_ptr,
            rows,
            tl.where(nonzero, (wx - wu * ux) * inv, wx),
            tl.where(nonzero, (wy - wu * uy) * inv, wy),
            tl.where(nonzero, (wz - wu * uz) * inv, wz),
            m,
        )
        _store3(
            o_unit_ptr,
            rows,
            tl.where(nonzero, big_g * wx - (wu * gx + gu * wx) * inv, 0.0),
            tl.where(nonzero, big_g * wy - (wu * gy + gu * wy) * inv, 0.0),
            tl.where(nonzero, big_g * wz - (wu * gz + gu * wz) * inv, 0.0),
            m,
        )
        tl.store(o_dist_ptr + rows, tl.where(nonzero, wu * big_h - (wg - gu * wu) * inv * inv, 0.0), mask=m)
