"""The Triton kernels of :mod:`.dense_step` (jit kernels and their jit helpers only).

The host side (the packed weights, :class:`~.dense_step.DenseStep`, which allocates the scratch and launches these
kernels, and the float64 oracle) and the description of the algebra and the scratch layout stay in
:mod:`.dense_step`. This file holds only ``@triton.jit`` code, so an edit here never touches the host path and vice
versa.
"""

from __future__ import annotations

from ._triton_utils import HAS_TRITON, tl, triton

__all__ = ["_dense_bwd_kernel", "_dense_fwd_kernel"]

if HAS_TRITON:
    from ._backend import interpreter_enabled
    from ._triton_utils import pdl_prologue
    from .repulsion import _pair_terms

    @triton.jit
    def _mm(a, b, DOT: tl.constexpr):
        """a @ b in the step's accuracy: 0 ieee (float64, or float32 on the CUDA cores), 1 tf32x3, 2 two TF32
        products with b exact in TF32 (a split into its TF32 high part and the remainder)."""
        if DOT == 0:
            out = tl.dot(a, b, input_precision="ieee")
        elif DOT == 1:
            out = tl.dot(a, b, input_precision="tf32x3")
        else:
            hi = (a.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
            out = tl.dot(hi, b, input_precision="tf32") + tl.dot(a - hi, b, input_precision="tf32")
        return out

    @triton.jit
    def _mat(ptr, R: tl.constexpr, C: tl.constexpr, ld):
        r = tl.arange(0, R)
        c = tl.arange(0, C)
        return tl.load(ptr + r[:, None] * ld + c[None, :])

    @triton.jit
    def _sig(x):
        return 1.0 / (1.0 + tl.exp(-x))

    # Several sums along one axis go through one variadic reduction (one round trip through shared memory, and its
    # barriers, where the axis spans warps, rather than one a sum). The interpreter reduces a tuple element by
    # element in Python (~100x slower than its numpy sum), so there each is a sum of its own: the same values, and
    # the GPU's form is compiled by the sm_90 test and run by the CUDA tests.
    ONE_REDUCTION = tl.constexpr(not interpreter_enabled())

    @triton.jit
    def _add2(a0, a1, b0, b1):
        return a0 + b0, a1 + b1

    @triton.jit
    def _add3(a0, a1, a2, b0, b1, b2):
        return a0 + b0, a1 + b1, a2 + b2

    @triton.jit
    def _add4(a0, a1, a2, a3, b0, b1, b2, b3):
        return a0 + b0, a1 + b1, a2 + b2, a3 + b3

    @triton.jit
    def _add6(a0, a1, a2, a3, a4, a5, b0, b1, b2, b3, b4, b5):
        return a0 + b0, a1 + b1, a2 + b2, a3 + b3, a4 + b4, a5 + b5

    @triton.jit
    def _sum2(x0, x1, axis: tl.constexpr):
        if ONE_REDUCTION:
            y0, y1 = tl.reduce((x0, x1), axis, _add2)
        else:
            y0 = tl.sum(x0, axis)
            y1 = tl.sum(x1, axis)
        return y0, y1

    @triton.jit
    def _sum3(x0, x1, x2, axis: tl.constexpr):
        if ONE_REDUCTION:
            y0, y1, y2 = tl.reduce((x0, x1, x2), axis, _add3)
        else:
            y0 = tl.sum(x0, axis)
            y1 = tl.sum(x1, axis)
            y2 = tl.sum(x2, axis)
        return y0, y1, y2

    @triton.jit
    def _sum4(x0, x1, x2, x3, axis: tl.constexpr):
        if ONE_REDUCTION:
            y0, y1, y2, y3 = tl.reduce((x0, x1, x2, x3), axis, _add4)
        else:
            y0, y1, y2 = _sum3(x0, x1, x2, axis)
            y3 = tl.sum(x3, axis)
        return y0, y1, y2, y3

    @triton.jit
    def _sum6(x0, x1, x2, x3, x4, x5, axis: tl.constexpr):
        if ONE_REDUCTION:
            y0, y1, y2, y3, y4, y5 = tl.reduce((x0, x1, x2, x3, x4, x5), axis, _add6)
        else:
            y0, y1, y2 = _sum3(x0, x1, x2, axis)
            y3, y4, y5 = _sum3(x3, x4, x5, axis)
        return y0, y1, y2, y3, y4, y5

    @triton.jit
    def _mv(x, ptr, K: tl.constexpr, N: tl.constexpr, ld):
        """``x [K] @ M [K, N]`` (row-major at ``ptr``, rows ``ld`` apart) on the CUDA cores."""
        k = tl.arange(0, K)
        n = tl.arange(0, N)
        w = tl.load(ptr + k[:, None] * ld + n[None, :])
        return tl.sum(x[:, None] * w, axis=0)

    @triton.jit
    def _mv3(x0, x1, x2, ptr, K: tl.constexpr, N: tl.constexpr, ld):
        """The same product for three vectors, the matrix loaded once."""
        k = tl.arange(0, K)
        n = tl.arange(0, N)
        w = tl.load(ptr + k[:, None] * ld + n[None, :])
        return _sum3(x0[:, None] * w, x1[:, None] * w, x2[:, None] * w, 0)

    @triton.jit
    def _mvr(x, ptr_t, K: tl.constexpr, N: tl.constexpr, ld_t):
        """The same ``x [K] @ M [K, N]`` from ``M``'s transpose (row-major ``[N, K]`` at ``ptr_t``, rows ``ld_t``
        apart): the sum runs along a tile row, within a warp (no shared-memory round trip)."""
        k = tl.arange(0, K)
        n = tl.arange(0, N)
        w = tl.load(ptr_t + n[:, None] * ld_t + k[None, :])
        return tl.sum(w * x[None, :], axis=1)

    @triton.jit
    def _mvr3(x0, x1, x2, ptr_t, K: tl.constexpr, N: tl.constexpr, ld_t):
        k = tl.arange(0, K)
        n = tl.arange(0, N)
        w = tl.load(ptr_t + n[:, None] * ld_t + k[None, :])
        return _sum3(w * x0[None, :], w * x1[None, :], w * x2[None, :], 1)

    @triton.jit
    def _mvx(x, ptr, ld, ptr_t, ld_t, K: tl.constexpr, N: tl.constexpr, MV: tl.constexpr):
        """``x [K] @ M [K, N]``: ``M`` row-major at ``ptr`` and its transpose at ``ptr_t`` (the packed weights hold
        both); MV 0 sums along the tile's columns (across warps), 1 along its rows (within a warp)."""
        if MV == 0:
            out = _mv(x, ptr, K, N, ld)
        else:
            out = _mvr(x, ptr_t, K, N, ld_t)
        return out

    @triton.jit
    def _mvx3(x0, x1, x2, ptr, ld, ptr_t, ld_t, K: tl.constexpr, N: tl.constexpr, MV: tl.constexpr):
        if MV == 0:
            y0, y1, y2 = _mv3(x0, x1, x2, ptr, K, N, ld)
        else:
            y0, y1, y2 = _mvr3(x0, x1, x2, ptr_t, K, N, ld_t)
        return y0, y1, y2

    @triton.jit
    def _tile(ptr, ld, ptr_t, ld_t, K: tl.constexpr, N: tl.constexpr, MV: tl.constexpr):
        """The tile of ``M [K, N]`` that :func:`_mvx` reads: ``M`` itself (MV 0) or its transpose (MV 1)."""
        if MV == 0:
            w = _mat(ptr, K, N, ld)
        else:
            w = _mat(ptr_t, N, K, ld_t)
        return w

    @triton.jit
    def _xw(x, w, MV: tl.constexpr):
        """The products ``x_k M_kn`` that :func:`_mvx` sums (along axis ``MV``), from :func:`_tile`'s tile."""
        if MV == 0:
            out = x[:, None] * w
        else:
            out = w * x[None, :]
        return out

    @triton.jit
    def _mvs(x0, x1, x2, ptr, dp, ld, ptr_t, dp_t, ld_t, K: tl.constexpr, N: tl.constexpr, MV: tl.constexpr,
             NT: tl.constexpr):  # fmt: skip
        """``sum_t x_t @ M_t`` over ``NT`` (2 or 3) terms, ``M_t`` at ``ptr + t dp`` (its transpose at ``ptr_t + t
        dp_t``): the products summed before one reduction, not reduced one by one and added."""
        acc = _xw(x0, _tile(ptr, ld, ptr_t, ld_t, K, N, MV), MV)
        acc += _xw(x1, _tile(ptr + dp, ld, ptr_t + dp_t, ld_t, K, N, MV), MV)
        if NT == 3:
            acc += _xw(x2, _tile(ptr + 2 * dp, ld, ptr_t + 2 * dp_t, ld_t, K, N, MV), MV)
        return tl.sum(acc, axis=MV)

    @triton.jit
    def _mv2o(x, ptr, dp, ld, ptr_t, dp_t, ld_t, K: tl.constexpr, N: tl.constexpr, MV: tl.constexpr):
        """``(x @ M_0, x @ M_1)`` (as :func:`_mvs`'s ``M_t``) in one reduction."""
        w0 = _tile(ptr, ld, ptr_t, ld_t, K, N, MV)
        w1 = _tile(ptr + dp, ld, ptr_t + dp_t, ld_t, K, N, MV)
        return _sum2(_xw(x, w0, MV), _xw(x, w1, MV), MV)

    @triton.jit
    def _mv3x2(x0, x1, x2, ptr, dp, ld, ptr_t, dp_t, ld_t, K: tl.constexpr, N: tl.constexpr, MV: tl.constexpr):
        """``x_i @ M_0`` and ``x_i @ M_1`` for three vectors (as :func:`_mvs`'s ``M_t``): six results, one
        reduction."""
        w0 = _tile(ptr, ld, ptr_t, ld_t, K, N, MV)
        w1 = _tile(ptr + dp, ld, ptr_t + dp_t, ld_t, K, N, MV)
        return _sum6(
            _xw(x0, w0, MV), _xw(x1, w0, MV), _xw(x2, w0, MV), _xw(x0, w1, MV), _xw(x1, w1, MV), _xw(x2, w1, MV), MV
        )

    @triton.jit
    def _mvs3v(a0, a1, a2, b0, b1, b2, ptr, dp, ld, ptr_t, dp_t, ld_t, K: tl.constexpr, N: tl.constexpr,
               MV: tl.constexpr):  # fmt: skip
        """``a_i @ M_0 + b_i @ M_1`` for three pairs of vectors: three results, one reduction."""
        w0 = _tile(ptr, ld, ptr_t, ld_t, K, N, MV)
        w1 = _tile(ptr + dp, ld, ptr_t + dp_t, ld_t, K, N, MV)
        return _sum3(
            _xw(a0, w0, MV) + _xw(b0, w1, MV), _xw(a1, w0, MV) + _xw(b1, w1, MV), _xw(a2, w0, MV) + _xw(b2, w1, MV), MV
        )

    @triton.jit
    def _vec(ptr, F: tl.constexpr):
        return tl.load(ptr + tl.arange(0, F))

    @triton.jit
    def _silu_grad(h):
        sg = _sig(h)
        return sg * (1.0 + h * (1.0 - sg))

    @triton.jit
    def _indices(idx_ptr, batch_ptr, z2i_ptr, b, i, NP: tl.constexpr, FROM_Z: tl.constexpr):
        """The species indices of the molecule's ``NP`` slots and of atom ``i``: ``(real [NP], real_row [NP] (atom i
        is an atom, on every lane), real_i, ix_i, ix [NP])``, -1 → 0 in ``ix`` and ``ix_i``. ``FROM_Z``: ``idx_ptr``
        holds atomic numbers and ``batch_ptr`` each slot's structure (the engine's padded buffers), the species index
        is ``z2i[Z]`` where the slot belongs to structure ``b``, else -1 (padding)."""
        a = tl.arange(0, NP)
        idx = tl.load(idx_ptr + b * NP + a)
        idx_i = tl.load(idx_ptr + b * NP + i + a * 0)  # (a block: the interpreter masks with blocks only)
        if FROM_Z:
            idx = tl.where(tl.load(batch_ptr + b * NP + a) == b, tl.load(z2i_ptr + idx), -1)
            idx_i = tl.where(tl.load(batch_ptr + b * NP + i + a * 0) == b, tl.load(z2i_ptr + idx_i), -1)
        real = idx >= 0
        ix = tl.where(real, idx, 0)
        real_row = idx_i >= 0
        real_i = tl.max(real_row.to(tl.int32), axis=0) > 0
        ix_i = tl.max(tl.where(real_row, idx_i, 0), axis=0).to(tl.int32)
        return real, real_row, real_i, ix_i, ix

    @triton.jit
    def _geometry(pos_ptr, idx_ptr, batch_ptr, z2i_ptr, table_ptr, consts_ptr, n_species, b, i, NP: tl.constexpr,
                  R: tl.constexpr, RP: tl.constexpr, FROM_Z: tl.constexpr):  # fmt: skip
        """Atom ``i``'s row of pairs ``i <- j`` over the molecule's ``NP`` slots: ``r_ij = pos_j - pos_i``
        (``FROM_Z``: see :func:`_indices`)."""
        real, real_row, real_i, ix_i, ix = _indices(idx_ptr, batch_ptr, z2i_ptr, b, i, NP, FROM_Z)
        a = tl.arange(0, NP)
        base = pos_ptr + b * NP * 3
        rx = tl.load(base + a * 3) - tl.load(base + i * 3)
        ry = tl.load(base + a * 3 + 1) - tl.load(base + i * 3 + 1)
        rz = tl.load(base + a * 3 + 2) - tl.load(base + i * 3 + 2)
        d2 = rx * rx + ry * ry + rz * rz
        cutoff = tl.load(consts_ptr)
        k1 = tl.load(consts_ptr + 1)
        norm = tl.load(consts_ptr + 2)
        c_env = tl.load(consts_ptr + 3)
        valid = real & (a != i) & real_row & (d2 < cutoff * cutoff)
        d = tl.sqrt(tl.where(valid, d2, 1.0))
        inv_d = 1.0 / d  # (not rx / d: Triton 3.6 cannot lay that division out in float64 with FROM_Z)
        ux = tl.where(valid, rx * inv_d, 0.0)
        uy = tl.where(valid, ry * inv_d, 0.0)
        uz = tl.where(valid, rz * inv_d, 0.0)
        kr = tl.arange(0, RP)
        kk = ((kr + 1).to(rx.dtype) * k1)[None, :]
        d2d = d[:, None]
        kd = kk * d2d
        sn = tl.sin(kd)
        basis = norm * sn / d2d
        d_basis = norm * (kk * tl.cos(kd) - sn / d2d) / d2d
        xr = d * k1
        env = tl.where(valid, 0.5 * (tl.cos(xr) + 1.0), 0.0)
        d_env = tl.where(valid, c_env * tl.sin(xr), 0.0)
        code = ix_i * n_species + ix
        on, e, de, gate, d_gate = _pair_terms(d, code, valid, table_ptr, n_species)
        d_env = d_env * gate + env * d_gate
        env = env * gate
        rmask = (kr < R)[None, :]
        rbf = tl.where(rmask, basis * env[:, None], 0.0)
        drbf = tl.where(rmask, d_basis * env[:, None] + basis * d_env[:, None], 0.0)
        return valid, d, ux, uy, uz, rbf, drbf, tl.where(on, e, 0.0), tl.where(on, de, 0.0), real_i, ix_i, ix

    @triton.jit
    def _geo_row(geo_ptr, b, i, NP: tl.constexpr, RP: tl.constexpr):
        """Atom ``i``'s row of the kept geometry: ``[NP, 2 RP + 8]`` floats (rbf, its derivative, u, d, the wall's
        pair energy and its derivative, valid), from ``geo_ptr`` (``[B, NP, NP, 2 RP + 8]``)."""
        return geo_ptr + (b * NP + i) * NP * (2 * RP + 8)

    @triton.jit
    def _geo_store(geo_ptr, b, i, valid, d, ux, uy, uz, rbf, drbf, e_row, de_row, NP: tl.constexpr, RP: tl.constexpr):
        G: tl.constexpr = 2 * RP + 8
        row = _geo_row(geo_ptr, b, i, NP, RP)
        a = tl.arange(0, NP)
        k = tl.arange(0, RP)
        tl.store(row + a[:, None] * G + k[None, :], rbf)
        tl.store(row + a[:, None] * G + RP + k[None, :], drbf)
        tl.store(row + a * G + 2 * RP, ux)
        tl.store(row + a * G + 2 * RP + 1, uy)
        tl.store(row + a * G + 2 * RP + 2, uz)
        tl.store(row + a * G + 2 * RP + 3, d)
        tl.store(row + a * G + 2 * RP + 4, e_row)
        tl.store(row + a * G + 2 * RP + 5, de_row)
        tl.store(row + a * G + 2 * RP + 6, valid.to(d.dtype))

    @triton.jit
    def _geo_load(geo_ptr, idx_ptr, batch_ptr, z2i_ptr, b, i, NP: tl.constexpr, RP: tl.constexpr,
                  FROM_Z: tl.constexpr, DRBF: tl.constexpr):  # fmt: skip
        """:func:`_geometry`'s values from the kept geometry (the first forward's), the indices read again; the
        derivative of the basis only with ``DRBF`` (else zeros, which no caller reads)."""
        G: tl.constexpr = 2 * RP + 8
        _real, _real_row, real_i, ix_i, ix = _indices(idx_ptr, batch_ptr, z2i_ptr, b, i, NP, FROM_Z)
        row = _geo_row(geo_ptr, b, i, NP, RP)
        a = tl.arange(0, NP)
        k = tl.arange(0, RP)
        rbf = tl.load(row + a[:, None] * G + k[None, :])
        if DRBF:
            drbf = tl.load(row + a[:, None] * G + RP + k[None, :])
        else:
            drbf = rbf * 0.0
        ux = tl.load(row + a * G + 2 * RP)
        uy = tl.load(row + a * G + 2 * RP + 1)
        uz = tl.load(row + a * G + 2 * RP + 2)
        d = tl.load(row + a * G + 2 * RP + 3)
        e_row = tl.load(row + a * G + 2 * RP + 4)
        de_row = tl.load(row + a * G + 2 * RP + 5)
        valid = tl.load(row + a * G + 2 * RP + 6) != 0.0
        return valid, d, ux, uy, uz, rbf, drbf, e_row, de_row, real_i, ix_i, ix

    @triton.jit
    def _update_head(s_mid, vm0, vm1, vm2, lw, F: tl.constexpr, RP: tl.constexpr, MV: tl.constexpr):
        """One atom's update block up to ``M1``'s activation: ``(uv (3), vv (3), |vv|, h2, a2, <uv, vv>)``."""
        ut = lw + 8 * F * F + 4 * F + 6 * F * RP
        vt = ut + 2 * F * F
        m1t = vt + 2 * F * F
        mb1 = m1t + 4 * F * F
        # U and V (their blocks 2 F^2 apart in both orientations) on the three components, one reduction
        uv0, uv1, uv2, vv0, vv1, vv2 = _mv3x2(vm0, vm1, vm2, ut, 2 * F * F, F, ut + F * F, 2 * F * F, F, F, F, MV)
        vnorm = tl.sqrt(vv0 * vv0 + vv1 * vv1 + vv2 * vv2 + 1e-8)
        m1 = m1t + 2 * F * F
        h2 = _mvs(s_mid, vnorm, vnorm, m1t, F * F, F, m1, F, 2 * F, F, F, MV, 2)
        h2 += _vec(mb1, F)
        a2 = h2 * _sig(h2)
        dot = uv0 * vv0 + uv1 * vv1 + uv2 * vv2
        return uv0, uv1, uv2, vv0, vv1, vv2, vnorm, h2, a2, dot

    @triton.jit
    def _m2(a2, lw, k, F: tl.constexpr, RP: tl.constexpr, MV: tl.constexpr):
        """Block ``k`` of the update block's ``M2`` (0 a_vv, 1 a_sv, 2 a_ss; ``k`` may be a runtime value)."""
        m2t = lw + 8 * F * F + 4 * F + 6 * F * RP + 8 * F * F + F
        return _mvx(a2, m2t + k * F, 3 * F, m2t + 3 * F * F + k * F * F, F, F, F, MV) + _vec(m2t + 6 * F * F + k * F, F)

    @triton.jit
    def _update_fwd(s_mid, vm0, vm1, vm2, lw, F: tl.constexpr, RP: tl.constexpr, LAST: tl.constexpr, MV: tl.constexpr):
        """One atom's update block."""
        uv0, uv1, uv2, vv0, vv1, vv2, vnorm, h2, a2, dot = _update_head(s_mid, vm0, vm1, vm2, lw, F, RP, MV)
        a_sv = _m2(a2, lw, 1, F, RP, MV)
        a_ss = _m2(a2, lw, 2, F, RP, MV)
        s = s_mid + a_ss + a_sv * dot
        if LAST:
            a_vv = a_sv * 0.0
            v0, v1, v2 = vm0, vm1, vm2
        else:
            a_vv = _m2(a2, lw, 0, F, RP, MV)
            v0 = vm0 + a_vv * uv0
            v1 = vm1 + a_vv * uv1
            v2 = vm2 + a_vv * uv2
        return s, v0, v1, v2, uv0, uv1, uv2, vv0, vv1, vv2, vnorm, h2, a_vv, a_sv, dot

    @triton.jit
    def _update_bwd_of(
        g_s, gv0, gv1, gv2, uv0, uv1, uv2, vv0, vv1, vv2, vnorm, h2, a_vv, a_sv, dot, lw, F: tl.constexpr,
        RP: tl.constexpr, LAST: tl.constexpr, MV: tl.constexpr, PART: tl.constexpr = -1,
    ):  # fmt: skip
        """One atom's update block backward from its saved values: ``(dE/ds_mid, dE/dvm (3))``. ``PART`` -1 makes
        all of it; else one of the three parts that ``fan`` gives programs of their own (the others zero): 0
        dE/ds_mid, 1 ``U``'s share of dE/dvm (with the pass-through ``gv``), 2 ``V``'s share."""
        u = lw + 8 * F * F + 4 * F + 6 * F * RP + F * F
        v = u + 2 * F * F
        m1 = v + 3 * F * F
        m2 = m1 + 2 * F * F + F + 3 * F * F
        zero = g_s * 0.0
        g_smid = zero
        g_dot = g_s * a_sv
        g_uv0 = g_dot * vv0
        g_uv1 = g_dot * vv1
        g_uv2 = g_dot * vv2
        g_vv0 = g_dot * uv0
        g_vv1 = g_dot * uv1
        g_vv2 = g_dot * uv2
        if not LAST:
            g_uv0 += gv0 * a_vv
            g_uv1 += gv1 * a_vv
            g_uv2 += gv2 * a_vv
        if PART != 1:  # dE/dh2
            m2t = m2 - 3 * F * F
            if LAST:  # M2's a_sv and a_ss blocks
                g_mix = _mvs(g_s * dot, g_s, g_s, m2 + F * F, F * F, F, m2t + F, F, 3 * F, F, F, MV, 2)
            else:  # and its a_vv block
                g_vu = gv0 * uv0 + gv1 * uv1 + gv2 * uv2
                g_mix = _mvs(g_vu, g_s * dot, g_s, m2, F * F, F, m2t, F, 3 * F, F, F, MV, 3)
            g_h2 = g_mix * _silu_grad(h2)
            m1t = m1 - 2 * F * F
            if PART == -1:  # M1's two blocks, one reduction
                g_m, g_n = _mv2o(g_h2, m1, F, 2 * F, m1t, F * F, F, F, F, MV)
                g_smid = g_s + g_m
            elif PART == 0:
                g_smid = g_s + _mvx(g_h2, m1, 2 * F, m1t, F, F, F, MV)
            else:
                g_n = _mvx(g_h2, m1 + F, 2 * F, m1t + F * F, F, F, F, MV)
            if PART != 0:
                g_n = g_n / vnorm
                g_vv0 += g_n * vv0
                g_vv1 += g_n * vv1
                g_vv2 += g_n * vv2
        g_vm0, g_vm1, g_vm2 = zero, zero, zero
        if PART == -1:
            g_vm0, g_vm1, g_vm2 = _mvs3v(
                g_uv0, g_uv1, g_uv2, g_vv0, g_vv1, g_vv2, u, 2 * F * F, F, u - F * F, 2 * F * F, F, F, F, MV
            )
        elif PART == 1:
            g_vm0, g_vm1, g_vm2 = _mvx3(g_uv0, g_uv1, g_uv2, u, F, u - F * F, F, F, F, MV)
        elif PART == 2:
            g_vm0, g_vm1, g_vm2 = _mvx3(g_vv0, g_vv1, g_vv2, v, F, v - F * F, F, F, F, MV)
        if not LAST and PART != 0 and PART != 2:
            g_vm0 += gv0
            g_vm1 += gv1
            g_vm2 += gv2
        return g_smid, g_vm0, g_vm1, g_vm2

    @triton.jit
    def _update_rows(row, F: tl.constexpr, LAST: tl.constexpr):
        """The update block's saved values at ``row`` (its slots): ``(uv (3), vv (3), vnorm, h2, a_vv, a_sv,
        <uv, vv>)``, a_vv zero at the last layer."""
        f = tl.arange(0, F)
        uv0 = tl.load(row + f)
        uv1 = tl.load(row + F + f)
        uv2 = tl.load(row + 2 * F + f)
        vv0 = tl.load(row + 3 * F + f)
        vv1 = tl.load(row + 4 * F + f)
        vv2 = tl.load(row + 5 * F + f)
        vnorm = tl.load(row + 6 * F + f)
        h2 = tl.load(row + 7 * F + f)
        if LAST:
            a_vv = h2 * 0.0
        else:
            a_vv = tl.load(row + 8 * F + f)
        a_sv = tl.load(row + 9 * F + f)
        dot = tl.load(row + 10 * F + f)
        return uv0, uv1, uv2, vv0, vv1, vv2, vnorm, h2, a_vv, a_sv, dot

    @triton.jit
    def _store_rows(row, F: tl.constexpr, x0, x1, x2):
        f = tl.arange(0, F)
        tl.store(row + f, x0)
        tl.store(row + F + f, x1)
        tl.store(row + 2 * F + f, x2)

    @triton.jit
    def _dense_fwd_kernel(
        pos_ptr, idx_ptr, batch_ptr, z2i_ptr, w_ptr, table_ptr, consts_ptr, sc_ptr, geo_ptr, atomic_ptr, n_species,
        n_weights, zero_ptr, z_e0, z_e1, z_a0, z_a1, z_f0, z_f1,
        LAYER: tl.constexpr, NL: tl.constexpr, NP: tl.constexpr, F: tl.constexpr, R: tl.constexpr,
        RP: tl.constexpr, SL: tl.constexpr, DOT: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
        FROM_Z: tl.constexpr, MV: tl.constexpr = 0, GEO: tl.constexpr = False, FAN: tl.constexpr = False,
        EARLY: tl.constexpr = False, ZERO: tl.constexpr = False,
    ):  # fmt: skip
        """Layer ``LAYER`` forward for atom ``i`` (program 0) of molecule ``b`` (program 1); the last layer adds
        the readout, its backward and the last update block's backward (its gradient slots). ``FAN``: program 2
        names one of the tails that programs of their own make after a shared head (the messages and the update
        block up to ``M1``): below the last layer 0 the update's saved values and v, 1-3 s and one of the next φ's
        three blocks each; at the last layer 0-2 the parts of the update block's backward (:func:`_update_bwd_of`).
        ``EARLY`` (with PDL, above the first layer): the geometry and the filter products, which read nothing the
        previous launch writes, come before the wait for it (the kept geometry from the second launch on; the first
        is the previous launch's own, so layer 1 computes its geometry again). ``ZERO`` (layer 0): the programs
        also zero ``zero_ptr``'s ranges ``[z_e0, z_e1)``, ``[z_a0, z_a1)`` and ``[z_f0, z_f1)`` (the parts of the
        engine's packed output that no launch writes), so that the engine needs no fill before the step."""
        PRE: tl.constexpr = EARLY and LAYER > 0
        if not PRE:
            pdl_prologue(PDL)
        i = tl.program_id(0)
        b = tl.program_id(1).to(tl.int64)
        role = tl.program_id(2)
        if PREFETCH > 0 and LAYER == 0:
            # the first launch asks L2 for every weight of the step (128-byte lines, PREFETCH of them per program of
            # the first molecule), so that the later products' loads hit L2 rather than memory
            if b == 0 and role == 0:
                line = i * PREFETCH + tl.arange(0, PREFETCH)
                ptrs = w_ptr + tl.minimum(line * 32, n_weights - 1)
                tl.inline_asm_elementwise(
                    "prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
                )
        if ZERO and LAYER == 0:
            if role == 0:
                _zero_range(zero_ptr, z_e0, z_e1, i, NP)
                _zero_range(zero_ptr, z_a0, z_a1, i, NP)
                _zero_range(zero_ptr, z_f0, z_f1, i, NP)
        LS: tl.constexpr = 22 * F * F + 8 * F + 6 * F * RP
        lw = w_ptr + LAYER * LS
        g = w_ptr + NL * LS
        if GEO and LAYER > 0 and not (PRE and LAYER == 1):  # the first forward's geometry, kept
            _valid, _d, ux, uy, uz, rbf, _drbf, e_row, _de_row, real_i, ix_i, ix = _geo_load(
                geo_ptr, idx_ptr, batch_ptr, z2i_ptr, b, i, NP, RP, FROM_Z, False
            )
        else:
            valid, d, ux, uy, uz, rbf, drbf, e_row, de_row, real_i, ix_i, ix = _geometry(
                pos_ptr, idx_ptr, batch_ptr, z2i_ptr, table_ptr, consts_ptr, n_species, b, i, NP, R, RP, FROM_Z
            )
            if GEO and LAYER == 0:
                if role == 0:
                    _geo_store(geo_ptr, b, i, valid, d, ux, uy, uz, rbf, drbf, e_row, de_row, NP, RP)
        a = tl.arange(0, NP)
        f = tl.arange(0, F)
        tiles = sc_ptr + ((b * NP + a[:, None]) * SL) * F + f[None, :]
        own = sc_ptr + ((b * NP + i) * SL) * F
        wft = lw + 8 * F * F + 4 * F
        w_a = _mm(rbf, _mat(wft, RP, F, 3 * F), DOT)
        w_c = _mm(rbf, _mat(wft + 2 * F, RP, F, 3 * F), DOT)
        if LAYER > 0:
            w_b = _mm(rbf, _mat(wft + F, RP, F, 3 * F), DOT)
        if PRE:
            pdl_prologue(PDL)
        if LAYER == 0:
            phi = g + n_species * F
            xa = tl.load(phi + ix[:, None] * (3 * F) + f[None, :])
            xc = tl.load(phi + ix[:, None] * (3 * F) + 2 * F + f[None, :])
            s = tl.load(g + ix_i * F + f)
        else:
            xa = tl.load(tiles + (3 * (LAYER) - 3) * F)
            xc = tl.load(tiles + ((3 * (LAYER) - 3) + 2) * F)
            s = tl.load(own + (7 * (NL - 1) + LAYER - 1) * F + f)
        mc = w_c * xc
        t0 = mc * ux[:, None]
        t1 = mc * uy[:, None]
        t2 = mc * uz[:, None]
        if LAYER > 0:  # (v's own part and the b messages: summed before the one reduction)
            VS: tl.constexpr = 4 * (NL - 1) + 3 * LAYER - 3
            mb = w_b * tl.load(tiles + (3 * LAYER - 2) * F)
            t0 += mb * tl.load(tiles + VS * F)
            t1 += mb * tl.load(tiles + (VS + 1) * F)
            t2 += mb * tl.load(tiles + (VS + 2) * F)
        # the four sums over the slots in one reduction (they span warps: one round trip, not four)
        s_mid, vm0, vm1, vm2 = _sum4(w_a * xa, t0, t1, t2, 0)
        s_mid += s
        if LAYER > 0:
            vm0 += tl.load(own + VS * F + f)
            vm1 += tl.load(own + (VS + 1) * F + f)
            vm2 += tl.load(own + (VS + 2) * F + f)
        LAST: tl.constexpr = LAYER == NL - 1
        upd = own + (8 * (NL - 1) + 11 * LAYER) * F
        nw = w_ptr + (LAYER + 1) * LS
        w2t = nw + 2 * F * F + F
        if FAN:
            uv0, uv1, uv2, vv0, vv1, vv2, vnorm, h2, a2, dot = _update_head(s_mid, vm0, vm1, vm2, lw, F, RP, MV)
            a_sv = _m2(a2, lw, 1, F, RP, MV)
            if not LAST:
                if role == 0:
                    a_vv = _m2(a2, lw, 0, F, RP, MV)
                    _store_rows(upd, F, uv0, uv1, uv2)
                    _store_rows(upd + 3 * F, F, vv0, vv1, vv2)
                    _store_rows(upd + 6 * F, F, vnorm, h2, a_vv)
                    tl.store(upd + 9 * F + f, a_sv)
                    tl.store(upd + 10 * F + f, dot)
                    _store_rows(
                        own + (4 * (NL - 1) + 3 * LAYER) * F, F, vm0 + a_vv * uv0, vm1 + a_vv * uv1, vm2 + a_vv * uv2
                    )
                else:
                    s = s_mid + _m2(a2, lw, 2, F, RP, MV) + a_sv * dot
                    h1 = _mvx(s, nw, F, nw + F * F, F, F, F, MV) + _vec(nw + 2 * F * F, F)
                    act = h1 * _sig(h1)
                    k = role - 1  # the next φ's block
                    xk = _mvx(act, w2t + k * F, 3 * F, w2t + 3 * F * F + k * F * F, F, F, F, MV)
                    tl.store(own + (3 * LAYER + k) * F + f, xk + _vec(w2t + 6 * F * F + k * F, F))
                    if role == 1:
                        tl.store(own + (3 * (NL - 1) + LAYER) * F + f, h1)
                        tl.store(own + (7 * (NL - 1) + LAYER) * F + f, s)
            else:
                s = s_mid + _m2(a2, lw, 2, F, RP, MV) + a_sv * dot
                g_s = _readout(s, g, n_species, ix_i, real_i, e_row, atomic_ptr + b * NP + i, role == 0, F, MV)
                zero = g_s * 0.0
                for part in tl.static_range(3):  # (the part a constexpr: each program runs only its own)
                    if role == part:
                        g_sm, g0, g1, g2 = _update_bwd_of(
                            g_s, zero, zero, zero, uv0, uv1, uv2, vv0, vv1, vv2, vnorm, h2, zero, a_sv, dot, lw, F,
                            RP, True, MV, part,
                        )  # fmt: skip
                        _store_grads(own, f, g_sm, g0, g1, g2, LAYER, NL, F, part)
        else:
            s, v0, v1, v2, uv0, uv1, uv2, vv0, vv1, vv2, vnorm, h2, a_vv, a_sv, dot = _update_fwd(
                s_mid, vm0, vm1, vm2, lw, F, RP, LAST, MV
            )
            if not LAST:
                _store_rows(upd, F, uv0, uv1, uv2)
                _store_rows(upd + 3 * F, F, vv0, vv1, vv2)
                _store_rows(upd + 6 * F, F, vnorm, h2, a_vv)
                tl.store(upd + 9 * F + f, a_sv)
                tl.store(upd + 10 * F + f, dot)
                h1 = _mvx(s, nw, F, nw + F * F, F, F, F, MV) + _vec(nw + 2 * F * F, F)
                act = h1 * _sig(h1)
                b2 = w2t + 6 * F * F
                w2 = w2t + 3 * F * F
                xa_n = _mvx(act, w2t, 3 * F, w2, F, F, F, MV) + _vec(b2, F)
                xb_n = _mvx(act, w2t + F, 3 * F, w2 + F * F, F, F, F, MV) + _vec(b2 + F, F)
                xc_n = _mvx(act, w2t + 2 * F, 3 * F, w2 + 2 * F * F, F, F, F, MV) + _vec(b2 + 2 * F, F)
                _store_rows(own + (3 * (LAYER + 1) - 3) * F, F, xa_n, xb_n, xc_n)
                _store_rows(own + (4 * (NL - 1) + 3 * LAYER) * F, F, v0, v1, v2)
                tl.store(own + (3 * (NL - 1) + LAYER) * F + f, h1)
                tl.store(own + (7 * (NL - 1) + LAYER) * F + f, s)
            else:
                g_s = _readout(s, g, n_species, ix_i, real_i, e_row, atomic_ptr + b * NP + i, True, F, MV)
                zero = g_s * 0.0
                g_sm, g0, g1, g2 = _update_bwd_of(
                    g_s, zero, zero, zero, uv0, uv1, uv2, vv0, vv1, vv2, vnorm, h2, a_vv, a_sv, dot, lw, F, RP, True,
                    MV,
                )  # fmt: skip
                _store_grads(own, f, g_sm, g0, g1, g2, LAYER, NL, F, -1)

    @triton.jit
    def _store_grads(own, f, g_sm, g0, g1, g2, LAYER: tl.constexpr, NL: tl.constexpr, F: tl.constexpr,
                     PART: tl.constexpr):  # fmt: skip
        """Layer ``LAYER``'s gradient slots of atom ``own``: dE/ds_mid and dE/dvm (``PART`` -1), or one part of
        them (:func:`_update_bwd_of`; part 2, dE/dvm's V share, to its own slots)."""
        GS: tl.constexpr = 8 * (NL - 1) + 11 * NL + 4 * LAYER
        if PART == -1 or PART == 0:
            tl.store(own + GS * F + f, g_sm)
        if PART == -1 or PART == 1:
            _store_rows(own + (GS + 1) * F, F, g0, g1, g2)
        if PART == 2:
            _store_rows(own + (8 * (NL - 1) + 15 * NL + 3 * LAYER) * F, F, g0, g1, g2)

    @triton.jit
    def _zero_range(ptr, lo, hi, i, NP: tl.constexpr):
        """Zeros in ``ptr[lo:hi]``, program ``i`` of ``NP`` taking every ``NP``-th block of 64."""
        k = tl.arange(0, 64)
        for start in range(lo + i * 64, hi, NP * 64):
            tl.store(ptr + start + k, tl.zeros([64], dtype=ptr.dtype.element_ty), mask=start + k < hi)

    @triton.jit
    def _readout(s, g, n_species, ix_i, real_i, e_row, atomic_out, store, F: tl.constexpr, MV: tl.constexpr):
        """The readout of atom ``i``: atomic = (r2 . silu(R1 s + rb1) + rb2) scale_z + shift_z (+ the wall's half
        pair energies), stored at ``atomic_out`` where ``store``; returns dE/ds."""
        H: tl.constexpr = F // 2
        r1t = g + n_species * F + n_species * 3 * F
        r1 = r1t + F * H
        rb1 = r1 + H * F
        r2 = rb1 + H
        rb2 = r2 + H
        scale_p = rb2 + 1
        h = _mvx(s, r1t, H, r1, F, F, H, MV) + _vec(rb1, H)
        w_r2 = _vec(r2, H)
        scale = tl.load(scale_p + ix_i)
        shift = tl.load(scale_p + n_species + ix_i)
        keep = real_i.to(h.dtype)
        if store:
            out = tl.sum(h * _sig(h) * w_r2, axis=0) + tl.load(rb2)
            tl.store(atomic_out, (out * scale + shift + tl.sum(e_row, axis=0)) * keep)
        g_h = _silu_grad(h) * w_r2 * (scale * keep)
        return _mvx(g_h, r1, F, r1t, H, H, F, MV)

    @triton.jit
    def _grads(tiles, own, f, LAYER: tl.constexpr, NL: tl.constexpr, F: tl.constexpr, FAN_IN: tl.constexpr):
        """Layer ``LAYER``'s upstream gradients: the receivers' dE/ds_mid and dE/dvm ``[NP, F]`` and atom j's own
        rows (with ``FAN_IN``, dE/dvm's V share added)."""
        GS: tl.constexpr = 8 * (NL - 1) + 11 * NL + 4 * LAYER
        gsm = tl.load(tiles + GS * F)
        gv0 = tl.load(tiles + (GS + 1) * F)
        gv1 = tl.load(tiles + (GS + 2) * F)
        gv2 = tl.load(tiles + (GS + 3) * F)
        gsm_j = tl.load(own + GS * F + f)
        gvj0 = tl.load(own + (GS + 1) * F + f)
        gvj1 = tl.load(own + (GS + 2) * F + f)
        gvj2 = tl.load(own + (GS + 3) * F + f)
        if FAN_IN:
            GB: tl.constexpr = 8 * (NL - 1) + 15 * NL + 3 * LAYER
            gv0 += tl.load(tiles + GB * F)
            gv1 += tl.load(tiles + (GB + 1) * F)
            gv2 += tl.load(tiles + (GB + 2) * F)
            gvj0 += tl.load(own + GB * F + f)
            gvj1 += tl.load(own + (GB + 1) * F + f)
            gvj2 += tl.load(own + (GB + 2) * F + f)
        return gsm, gv0, gv1, gv2, gsm_j, gvj0, gvj1, gvj2

    @triton.jit
    def _bwd_features(
        rbf, own, tiles, lw, w_ptr, w_c, ux, uy, uz, f,
        LAYER: tl.constexpr, NL: tl.constexpr, F: tl.constexpr, RP: tl.constexpr, DOT: tl.constexpr,
        MV: tl.constexpr, PART: tl.constexpr, FAN_IN: tl.constexpr, WAIT: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """Atom ``j``'s φ and v as a sender (sums over its receivers k), its φ backward, and the previous layer's
        update block backward of atom ``j``, stored in that layer's gradient slots (``PART``: one part of it, see
        :func:`_update_bwd_of`; part 2 goes to that layer's V-share slots). ``WAIT``: the wait for the previous
        launch (PDL) comes here, after what reads nothing that launch writes (the forward's values too: the
        update block's saved rows)."""
        LS: tl.constexpr = 22 * F * F + 8 * F + 6 * F * RP
        wft = lw + 8 * F * F + 4 * F
        XS: tl.constexpr = 3 * LAYER - 3
        VS: tl.constexpr = 4 * (NL - 1) + 3 * LAYER - 3
        w1 = lw + F * F
        w2 = w1 + 4 * F * F + F
        w2t = w2 - 3 * F * F
        pw = w_ptr + (LAYER - 1) * LS
        w_a = _mm(rbf, _mat(wft, RP, F, 3 * F), DOT)
        w_b = _mm(rbf, _mat(wft + F, RP, F, 3 * F), DOT)
        xb_j = tl.load(own + (XS + 1) * F + f)
        vj0 = tl.load(own + VS * F + f)
        vj1 = tl.load(own + (VS + 1) * F + f)
        vj2 = tl.load(own + (VS + 2) * F + f)
        h1 = tl.load(own + (3 * (NL - 1) + LAYER - 1) * F + f)
        uv0, uv1, uv2, vv0, vv1, vv2, vnorm, h2, a_vv, a_sv, dot = _update_rows(
            own + (8 * (NL - 1) + 11 * (LAYER - 1)) * F, F, False
        )
        if WAIT:
            pdl_prologue(PDL)
        gsm, gv0, gv1, gv2, gsm_j, gvj0, gvj1, gvj2 = _grads(tiles, own, f, LAYER, NL, F, FAN_IN)
        gamma_s = -(gv0 * ux[:, None] + gv1 * uy[:, None] + gv2 * uz[:, None])
        gmb_s = gv0 * vj0[None, :] + gv1 * vj1[None, :] + gv2 * vj2[None, :]
        bw = w_b * xb_j[None, :]
        # the six sums over the receivers in one reduction (one round trip through shared memory, not six)
        g_xa, g_xb, g_xc, g_vj0, g_vj1, g_vj2 = _sum6(
            gsm * w_a, gmb_s * w_b, gamma_s * w_c, bw * gv0, bw * gv1, bw * gv2, 0
        )
        g_vj0 += gvj0
        g_vj1 += gvj1
        g_vj2 += gvj2
        g_act = _mvs(g_xa, g_xb, g_xc, w2, F * F, F, w2t, F, 3 * F, F, F, MV, 3)
        g_sj = gsm_j + _mvx(g_act * _silu_grad(h1), w1, F, w1 - F * F, F, F, F, MV)
        g_sm, g0, g1, g2 = _update_bwd_of(
            g_sj, g_vj0, g_vj1, g_vj2, uv0, uv1, uv2, vv0, vv1, vv2, vnorm, h2, a_vv, a_sv, dot, pw, F, RP, False, MV,
            PART,
        )  # fmt: skip
        _store_grads(own, f, g_sm, g0, g1, g2, LAYER - 1, NL, F, PART)

    @triton.jit
    def _bwd_geometry(
        rbf, drbf, valid, d, ux, uy, uz, de_row, own, tiles, lw, g, ix, ix_j, n_species, w_c, f, a, b, j, gpos_ptr,
        forces_ptr, energy_ptr, atomic_ptr, LAYER: tl.constexpr, NL: tl.constexpr, NP: tl.constexpr, F: tl.constexpr,
        RP: tl.constexpr, DOT: tl.constexpr, FAN_IN: tl.constexpr, WAIT: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """Atom ``j``'s position gradient from the pairs ``k <- j`` (j the sender, u_kj = -u_jk) and ``j <- k``:
        dE/dpos_j = sum_k [-(dE/dd) u_jk + P_u(g_u^sender - g_u^receiver) / d], the wall on both pairs; added to
        the later layers' (``gpos``), and at the first layer the forces and the molecule's energy."""
        XS: tl.constexpr = 3 * LAYER - 3
        VS: tl.constexpr = 4 * (NL - 1) + 3 * LAYER - 3
        wf = lw + 8 * F * F + 4 * F + 3 * F * RP  # W_f [3F, RP]
        if LAYER == 0:
            phi = g + n_species * F
            xa = tl.load(phi + ix[:, None] * (3 * F) + f[None, :])
            xc = tl.load(phi + ix[:, None] * (3 * F) + 2 * F + f[None, :])
            xa_j = tl.load(phi + ix_j * (3 * F) + f)
            xc_j = tl.load(phi + ix_j * (3 * F) + 2 * F + f)
        else:
            xa = tl.load(tiles + XS * F)
            xc = tl.load(tiles + (XS + 2) * F)
            xa_j = tl.load(own + XS * F + f)
            xc_j = tl.load(own + (XS + 2) * F + f)
        if LAYER > 0:
            xb = tl.load(tiles + (XS + 1) * F)
            xb_j = tl.load(own + (XS + 1) * F + f)
            v0 = tl.load(tiles + VS * F)
            v1 = tl.load(tiles + (VS + 1) * F)
            v2 = tl.load(tiles + (VS + 2) * F)
            vj0 = tl.load(own + VS * F + f)
            vj1 = tl.load(own + (VS + 1) * F + f)
            vj2 = tl.load(own + (VS + 2) * F + f)
        mc_s = w_c * xc_j[None, :]
        mc_r = w_c * xc
        if WAIT:
            pdl_prologue(PDL)
        gsm, gv0, gv1, gv2, gsm_j, gvj0, gvj1, gvj2 = _grads(tiles, own, f, LAYER, NL, F, FAN_IN)
        gamma_s = -(gv0 * ux[:, None] + gv1 * uy[:, None] + gv2 * uz[:, None])
        gamma_r = gvj0[None, :] * ux[:, None] + gvj1[None, :] * uy[:, None] + gvj2[None, :] * uz[:, None]
        g_rbf = _mm(gsm * xa_j[None, :] + gsm_j[None, :] * xa, _mat(wf, F, RP, RP), DOT)
        g_rbf += _mm(gamma_s * xc_j[None, :] + gamma_r * xc, _mat(wf + 2 * F * RP, F, RP, RP), DOT)
        gu0 = tl.sum(mc_s * gv0 - mc_r * gvj0[None, :], axis=1)
        gu1 = tl.sum(mc_s * gv1 - mc_r * gvj1[None, :], axis=1)
        gu2 = tl.sum(mc_s * gv2 - mc_r * gvj2[None, :], axis=1)
        if LAYER > 0:
            gmb_s = gv0 * vj0[None, :] + gv1 * vj1[None, :] + gv2 * vj2[None, :]
            gmb_r = gvj0[None, :] * v0 + gvj1[None, :] * v1 + gvj2[None, :] * v2
            g_rbf += _mm(gmb_s * xb_j[None, :] + gmb_r * xb, _mat(wf + F * RP, F, RP, RP), DOT)
        g_d = tl.sum(g_rbf * drbf, axis=1)
        if LAYER == 0:
            g_d += 2.0 * de_row
        gu = gu0 * ux + gu1 * uy + gu2 * uz
        gx = tl.sum(tl.where(valid, -g_d * ux + (gu0 - gu * ux) / d, 0.0), axis=0)
        gy = tl.sum(tl.where(valid, -g_d * uy + (gu1 - gu * uy) / d, 0.0), axis=0)
        gz = tl.sum(tl.where(valid, -g_d * uz + (gu2 - gu * uz) / d, 0.0), axis=0)
        gp = gpos_ptr + (b * NP + j) * 3
        if LAYER != NL - 1:
            gx += tl.load(gp)
            gy += tl.load(gp + 1)
            gz += tl.load(gp + 2)
        if LAYER == 0:
            fo = forces_ptr + (b * NP + j) * 3
            tl.store(fo, -gx)
            tl.store(fo + 1, -gy)
            tl.store(fo + 2, -gz)
            if j == 0:
                tl.store(energy_ptr + b, tl.sum(tl.load(atomic_ptr + b * NP + a).to(tl.float64), axis=0))
        else:
            tl.store(gp, gx)
            tl.store(gp + 1, gy)
            tl.store(gp + 2, gz)

    @triton.jit
    def _dense_bwd_kernel(
        pos_ptr, idx_ptr, batch_ptr, z2i_ptr, w_ptr, table_ptr, consts_ptr, sc_ptr, geo_ptr, gpos_ptr, atomic_ptr,
        energy_ptr, forces_ptr, n_species,
        LAYER: tl.constexpr, NL: tl.constexpr, NP: tl.constexpr, F: tl.constexpr, R: tl.constexpr, RP: tl.constexpr,
        SL: tl.constexpr, DOT: tl.constexpr, PDL: tl.constexpr, SPLIT: tl.constexpr, FROM_Z: tl.constexpr,
        MV: tl.constexpr = 0, GEO: tl.constexpr = False, FAN: tl.constexpr = False, FAN_IN: tl.constexpr = False,
        EARLY: tl.constexpr = False, ABLATE: tl.constexpr = 0,
    ):  # fmt: skip
        """Layer ``LAYER``'s message backward for atom ``j`` (program 0) of molecule ``b`` (program 1): the pairs
        ``k <- j`` (j the sender) and ``j <- k`` (j the receiver). Above the first layer, ``SPLIT`` gives the two
        parts to two programs (program 2: 0 the features, 1 the geometry), which run side by side; ``FAN`` gives
        the features' three parts (:func:`_update_bwd_of`) to programs 0-2 and the geometry to 3. ``FAN_IN``: this
        layer's gradients came with a V share of dE/dvm of their own (from a launch with ``FAN``). ``EARLY`` (with
        PDL; the host sets it only where the first launch is not this one's predecessor, two layers or more): the
        kept geometry, the filter products and the forward's values come before the wait for the previous launch,
        whose gradients come after it. ``ABLATE`` (a timing instrument, wrong results: the probe's "ablate"
        variants): with ``SPLIT``, 1 leaves the feature programs' work out, 2 the geometry program's, to time each
        program kind alone."""
        if not EARLY:
            pdl_prologue(PDL)
        j = tl.program_id(0)
        b = tl.program_id(1).to(tl.int64)
        LS: tl.constexpr = 22 * F * F + 8 * F + 6 * F * RP
        lw = w_ptr + LAYER * LS
        g = w_ptr + NL * LS
        if GEO:
            valid, d, ux, uy, uz, rbf, drbf, _e_row, de_row, _real_j, ix_j, ix = _geo_load(
                geo_ptr, idx_ptr, batch_ptr, z2i_ptr, b, j, NP, RP, FROM_Z, True
            )
        else:
            valid, d, ux, uy, uz, rbf, drbf, _e_row, de_row, _real_j, ix_j, ix = _geometry(
                pos_ptr, idx_ptr, batch_ptr, z2i_ptr, table_ptr, consts_ptr, n_species, b, j, NP, R, RP, FROM_Z
            )
        a = tl.arange(0, NP)
        f = tl.arange(0, F)
        tiles = sc_ptr + ((b * NP + a[:, None]) * SL) * F + f[None, :]
        own = sc_ptr + ((b * NP + j) * SL) * F
        w_c = _mm(rbf, _mat(lw + 8 * F * F + 4 * F + 2 * F, RP, F, 3 * F), DOT)
        role = tl.program_id(2)
        if SPLIT and LAYER > 0:
            NF: tl.constexpr = 1 + 2 * FAN  # feature programs: the whole, or FAN's three parts
            if role < NF:
                if ABLATE != 1:
                    for p in tl.static_range(NF):
                        if role == p:
                            PART: tl.constexpr = p + FAN - 1  # -1 (the whole) without FAN, else part p
                            _bwd_features(
                                rbf, own, tiles, lw, w_ptr, w_c, ux, uy, uz, f, LAYER, NL, F, RP, DOT, MV, PART,
                                FAN_IN, EARLY, PDL,
                            )  # fmt: skip
            elif ABLATE != 2:
                _bwd_geometry(
                    rbf, drbf, valid, d, ux, uy, uz, de_row, own, tiles, lw, g, ix, ix_j, n_species, w_c, f, a, b, j,
                    gpos_ptr, forces_ptr, energy_ptr, atomic_ptr, LAYER, NL, NP, F, RP, DOT, FAN_IN, EARLY, PDL,
                )  # fmt: skip
        else:
            if LAYER > 0:
                _bwd_features(
                    rbf, own, tiles, lw, w_ptr, w_c, ux, uy, uz, f, LAYER, NL, F, RP, DOT, MV, -1, FAN_IN, EARLY, PDL
                )
            _bwd_geometry(
                rbf, drbf, valid, d, ux, uy, uz, de_row, own, tiles, lw, g, ix, ix_j, n_species, w_c, f, a, b, j,
                gpos_ptr, forces_ptr, energy_ptr, atomic_ptr, LAYER, NL, NP, F, RP, DOT, FAN_IN, EARLY and LAYER == 0,
                PDL,
            )  # fmt: skip
