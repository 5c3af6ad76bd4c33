"""The Triton kernels of :func:`.linear.gemm` (device code only; the host function, its launch choices and the
MLP and readout wrappers are in ``linear.py``).

* :func:`_gemm_kernel`: one ``[BM, BN]`` tile of ``C = act(A' B + bias)`` per program, element-wise loads and
  stores, every prologue (SiLU', residual add, the readout's row gathers, the update block's norm) and epilogue
  (bias, SiLU, addend, the readout's per-species affine map and per-structure sums).
* :func:`_gemm_tma_kernel`: the large-M launch through tensor descriptors (Hopper's copy engine), the same tile
  and arithmetic for the forms without row gathers, so the same bits.
* :func:`_norm_of`: the update block's ‖vv‖, one expression for its norm kernel, its backward and the GEMM's norm
  prologue.
"""

from __future__ import annotations

from ._triton_utils import HAS_TRITON, dot_fin, dot_rn, dot_w, pdl_prologue, tl, triton

if HAS_TRITON:

    @triton.jit
    def _sigmoid(x):
        return 1.0 / (1.0 + tl.exp(-x))

    @triton.jit
    def _round_bf16(x):
        """float32 ``x`` rounded to the nearest bfloat16 (ties to even), as float32: what ``.to(tl.bfloat16)`` does
        on the GPU. A product of two such values is exact in float32."""
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _prologue(a, aux, PRO: tl.constexpr):
        """A's prologue on a loaded tile ``aux`` (both kernels): A ⊙ SiLU'(aux) (PRO 1: the backward of a SiLU folded
        into the load) or A + aux (PRO 2: a residual sum folded into the load)."""
        if PRO == 1:
            sg = _sigmoid(aux)
            return a * (sg * (1.0 + aux * (1.0 - sg)))
        else:
            return a + aux

    @triton.jit
    def _norm_of(v0, v1, v2):
        """``sqrt(v0² + v1² + v2² + 1e-8)``, the update block's ‖vv‖ (its norm kernel and backward, and the GEMM's norm
        prologue: one expression, so one rounding): 1e-8 is ``_NORM_EPS``, as a tensor of the tiles' dtype (a bare
        literal would be rounded to float32 first); the correctly rounded square root in float32 (tl.sqrt is the
        approximate one there)."""
        sq = v0 * v0 + v1 * v1 + v2 * v2 + tl.full(v0.shape, 1e-8, v0.dtype)
        if v0.dtype == tl.float32:
            return tl.sqrt_rn(sq)
        else:
            return tl.sqrt(sq)

    @triton.jit
    def _norm_tile(s_ptr, d_ptr, u_ptr, rows, rm, kk, k, NORM_D: tl.constexpr):
        """A's tile of the norm prologue (PRO 4) at columns ``kk``: ``S + D`` where kk < F = k / 2, ``‖V‖`` from the
        vv halves of U's rows 3i, 3i + 1, 3i + 2 where F <= kk < k, 0 elsewhere (rows past M, columns past K)."""
        f = k // 2
        lo = kk[None, :] < f
        ms = rm & lo
        a = tl.load(s_ptr + rows[:, None] * f + kk[None, :], mask=ms, other=0.0)
        if NORM_D:
            a = _prologue(a, tl.load(d_ptr + rows[:, None] * f + kk[None, :], mask=ms, other=0.0), 2)
        mv = rm & (kk[None, :] >= f) & (kk[None, :] < k)
        base = u_ptr + (3 * rows[:, None]) * k + kk[None, :]
        nrm = _norm_of(
            tl.load(base, mask=mv, other=0.0), tl.load(base + k, mask=mv, other=0.0),
            tl.load(base + 2 * k, mask=mv, other=0.0),
        )  # fmt: skip
        return tl.where(lo, a, tl.where(mv, nrm, 0.0))

    @triton.jit
    def _tile_dot(acc, a, b, bl, DOT: tl.constexpr):
        """``acc + a @ b`` in the launch's dot mode (both kernels, so that they give the same bits): "bf16" / "fp16"
        16-bit MMAs of the rounded tiles with float32 accumulation; "bf16_rn" the interpreter's stand-in for "bf16"
        (its bfloat16 dot is wrong: the same products in float32); "tf32x2w" W exact in TF32, A split here, two TF32
        MMAs; "tf32x3w" b = W_hi and bl = W_lo (made once), A split here, three TF32 MMAs as tf32x3; else
        :func:`dot_rn` ("tf32": both tiles rounded to nearest first, as the MMA alone truncates them)."""
        if DOT == "bf16":
            return acc + tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
        elif DOT == "bf16_rn":
            return acc + tl.dot(_round_bf16(a), _round_bf16(b), input_precision="ieee")
        elif DOT == "fp16":
            return acc + tl.dot(a.to(tl.float16), b.to(tl.float16))
        elif DOT == "tf32x2w" or DOT == "tf32x3w":
            return acc + dot_w(a, b, bl, DOT)
        elif DOT == "tf32x2f":  # "tf32x2w" without dot_w's NaN guard (nan_guard False): same bits for finite A
            return acc + dot_fin(a, b, "tf32x2w")
        else:
            return acc + dot_rn(a, b, DOT)

    @triton.jit(do_not_specialize=["m", "z_numel"])
    def _gemm_kernel(
        a_ptr, b_ptr, bl_ptr, bias_ptr, aux_ptr, c_ptr, pre_ptr, d_ptr, idx_ptr, scale_ptr, shift_ptr, seg_ptr, e_ptr,
        z_ptr, u_ptr, m, n, k, stride_bk, stride_bn, stride_cm, stride_dm, z_numel,
        HAS_BIAS: tl.constexpr, EPI: tl.constexpr, PRO: tl.constexpr, ACC: tl.constexpr, HAS_A: tl.constexpr,
        AFFINE: tl.constexpr, SEGSUM: tl.constexpr, ZERO: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr,
        PDL: tl.constexpr, COL_FAST: tl.constexpr = False, SEG_TILE: tl.constexpr = False, NORM_D: tl.constexpr = False,
    ):  # fmt: skip
        """One [BM, BN] tile of C. A is [m, k] row-major (and so is the prologue's aux: [*, k] rows seg[i] for the
        gather); B is addressed by strides; ACC adds D (rows stride_dm apart; C itself when accumulating) after the
        bias and the activation; AFFINE maps row i to C·scale[idx[i]] + shift[idx[i]]; SEGSUM adds it into
        E[seg[i]]. ZERO: the programs of column tile 0 also zero entries [BM·i, BM·(i + 1)) of Z (z_numel <= m).
        PRO 4 (the norm prologue): A = [S + D | ‖V‖] from a_ptr = S, aux_ptr = D (NORM_D) and u_ptr = U.
        COL_FAST: a 1-D grid whose neighbouring programs are the column tiles of one row tile (they share its A
        tile in L2), else a 2-D grid (row tile, column tile)."""
        pdl_prologue(PDL)
        if COL_FAST:
            n_col = tl.cdiv(n, BN)
            pid_m = tl.program_id(0) // n_col
            pid_n = tl.program_id(0) % n_col
        else:
            pid_m = tl.program_id(0)
            pid_n = tl.program_id(1)
        if ZERO:
            if pid_n == 0:
                zi = pid_m.to(tl.int64) * BM + tl.arange(0, BM)
                tl.store(z_ptr + zi, tl.zeros((BM,), dtype=z_ptr.dtype.element_ty), mask=zi < z_numel)
        rows = pid_m.to(tl.int64) * BM + tl.arange(0, BM)
        cols = pid_n * BN + tl.arange(0, BN)
        rm = rows[:, None] < m
        cm = cols[None, :] < n
        acc = tl.zeros((BM, BN), dtype=tl.float32 if b_ptr.dtype.element_ty == tl.float32 else tl.float64)
        if PRO == 3 or AFFINE:
            idx = tl.load(idx_ptr + rows, mask=rows < m, other=0)
            sc = tl.load(scale_ptr + idx, mask=rows < m, other=0.0)
        if PRO == 3 or SEGSUM:
            seg = tl.load(seg_ptr + rows, mask=rows < m, other=0)
        for k0 in range(0, k, BK):
            kk = k0 + tl.arange(0, BK)
            am = rm & (kk[None, :] < k)
            if PRO == 4:
                a = _norm_tile(a_ptr, aux_ptr, u_ptr, rows, rm, kk, k, NORM_D)
            elif HAS_A:
                a = tl.load(a_ptr + rows[:, None] * k + kk[None, :], mask=am, other=0.0)
            if PRO == 3:  # (A + aux[seg]) ⊙ scale[idx] row-wise: a readout's backward (its gathers) in the load
                # aux may be float64 (the gradient of the float64 energies): rounded to the scale's dtype on load
                g = tl.load(aux_ptr + seg[:, None] * k + kk[None, :], mask=am, other=0.0).to(sc.dtype)
                if HAS_A:
                    a = (a + g) * sc[:, None]
                else:
                    a = g * sc[:, None]
            elif PRO == 1 or PRO == 2:
                a = _prologue(a, tl.load(aux_ptr + rows[:, None] * k + kk[None, :], mask=am, other=0.0), PRO)
            b = tl.load(
                b_ptr + kk[:, None] * stride_bk + cols[None, :] * stride_bn, mask=(kk[:, None] < k) & cm, other=0.0
            )
            bl = b
            if DOT == "tf32x3w":
                bl = tl.load(
                    bl_ptr + kk[:, None] * stride_bk + cols[None, :] * stride_bn, mask=(kk[:, None] < k) & cm, other=0.0
                )
            acc = _tile_dot(acc, a, b, bl, DOT)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=cols < n, other=0.0)[None, :]
        cmask = rm & cm
        cptr = c_ptr + rows[:, None] * stride_cm + cols[None, :]
        if EPI == 1:
            tl.store(pre_ptr + rows[:, None] * n + cols[None, :], acc, mask=cmask)
            acc = acc * _sigmoid(acc)
        if ACC:
            acc += tl.load(d_ptr + rows[:, None] * stride_dm + cols[None, :], mask=cmask, other=0.0)
        if AFFINE:
            acc = acc * sc[:, None] + tl.load(shift_ptr + idx, mask=rows < m, other=0.0)[:, None]
        if SEGSUM:
            # (E may be wider than C: the readout's float64 energy sums)
            wide = acc.to(e_ptr.dtype.element_ty)
            seg_lo = tl.min(tl.where(rows < m, seg, 2**62), axis=0)
            seg_hi = tl.max(tl.where(rows < m, seg, -1), axis=0)
            if SEG_TILE and seg_lo == seg_hi:
                # The tile's rows all in one structure (a large one: every tile of a 24,000-atom box): one atomic
                # per column of the tile's sum, not one per row into the same address.
                tot = tl.sum(tl.where(cmask, wide, 0.0), axis=0)
                tl.atomic_add(e_ptr + seg_lo * n + cols, tot, mask=cols < n, sem="relaxed")
            else:
                tl.atomic_add(e_ptr + seg[:, None] * n + cols[None, :], wide, mask=cmask, sem="relaxed")
        tl.store(cptr, acc, mask=cmask)

    @triton.jit
    def _tma_step(acc, a, b_desc, bl_desc, n0, k0, DOT: tl.constexpr):
        """One K step of :func:`_gemm_tma_kernel`: W's tile (and its low part for "tf32x3w") and the product."""
        b = b_desc.load([n0, k0]).T
        bl = b
        if DOT == "tf32x3w":
            bl = bl_desc.load([n0, k0]).T
        return _tile_dot(acc, a, b, bl, DOT)

    @triton.jit(do_not_specialize=["m", "z_numel"])
    def _gemm_tma_kernel(
        a_desc, b_desc, bl_desc, bias_ptr, aux_desc, c_desc, pre_desc, d_desc, z_ptr, u_desc, m, n, k, z_numel,
        HAS_BIAS: tl.constexpr, EPI: tl.constexpr, PRO: tl.constexpr, ACC: tl.constexpr, ZERO: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr, PDL: tl.constexpr,
        NORM_D: tl.constexpr = False,
    ):  # fmt: skip
        """:func:`_gemm_kernel`'s large-M tile (1-D grid, column tiles of a row tile side by side) with every dense
        operand moved by the copy engine through a tensor descriptor (Hopper's TMA): A, the prologue's aux, W
        ([N, K], K-major) and its low part, and the stores of C and the pre-activation; out-of-range rows and
        columns are the descriptors' zero fill and clipped stores, so no masks or per-element addresses. The same
        arithmetic as _gemm_kernel's, so the same bits. No row gathers (prologue 3, the affine map, segment sums):
        those launches keep _gemm_kernel. PRO 4 (the norm prologue; F = k / 2 a multiple of BK): A = [S + D | ‖V‖]
        from a_desc = S, aux_desc = D (NORM_D) and u_desc = U viewed [M, 6F] (row i: uv_0, vv_0, uv_1, vv_1, uv_2,
        vv_2); rows past M come as ‖0‖ = 1e-4 and their products are clipped at the store."""
        pdl_prologue(PDL)
        n_col = tl.cdiv(n, BN)
        pid_m = tl.program_id(0) // n_col
        pid_n = tl.program_id(0) % n_col
        if ZERO:
            if pid_n == 0:
                zi = pid_m.to(tl.int64) * BM + tl.arange(0, BM)
                tl.store(z_ptr + zi, tl.zeros((BM,), dtype=z_ptr.dtype.element_ty), mask=zi < z_numel)
        m0 = pid_m * BM
        n0 = pid_n * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        if PRO == 4:  # two loops, one per half of K (no branch in a loop: both stay pipelined)
            f = k // 2
            for k0 in range(0, f, BK):
                a = a_desc.load([m0, k0])
                if NORM_D:  # S + D, the residual sum as prologue 2 adds it
                    a = _prologue(a, aux_desc.load([m0, k0]), 2)
                acc = _tma_step(acc, a, b_desc, bl_desc, n0, k0, DOT)
            for k0 in range(f, k, BK):
                a = _norm_of(u_desc.load([m0, k0]), u_desc.load([m0, 2 * f + k0]), u_desc.load([m0, 4 * f + k0]))
                acc = _tma_step(acc, a, b_desc, bl_desc, n0, k0, DOT)
        else:
            for k0 in range(0, k, BK):
                a = a_desc.load([m0, k0])
                if PRO == 1 or PRO == 2:
                    a = _prologue(a, aux_desc.load([m0, k0]), PRO)
                acc = _tma_step(acc, a, b_desc, bl_desc, n0, k0, DOT)
        if HAS_BIAS:
            cols = n0 + tl.arange(0, BN)
            acc += tl.load(bias_ptr + cols, mask=cols < n, other=0.0)[None, :]
        if EPI == 1:
            pre_desc.store([m0, n0], acc)
            acc = acc * _sigmoid(acc)
        if ACC:
            acc += d_desc.load([m0, n0])
        c_desc.store([m0, n0], acc)
