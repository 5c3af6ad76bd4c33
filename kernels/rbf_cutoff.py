"""Radial basis × smooth cutoff: distances ``[E]`` → ``[E, n_rbf]``.

Bases (``basis``):
  * ``bessel``   b_k(d) = sqrt(2/rc) · sin(k π d / rc) / d,   k = 1..n  (the PaiNN/DimeNet basis; finite at d → 0,
                 where it tends to sqrt(2/rc) · k π / rc; we switch to the Taylor series below ``_SMALL``).
  * ``gaussian`` b_k(d) = exp(-γ (d - μ_k)²),  μ_k = k · rc / (n - 1),  γ = 1 / (2 (rc / (n - 1))²)  (SchNet).
Envelopes (``envelope``), x = d / rc, zero for x ≥ 1:
  * ``cosine``     f(x) = ½ (cos(π x) + 1)  (value and slope vanish at the cutoff)
  * ``polynomial`` f(x) = 1 − (p+1)(p+2)/2 xᵖ + p(p+2) xᵖ⁺¹ − p(p+1)/2 xᵖ⁺²,  p = 6  (nequip/DimeNet; C² at rc)
The op returns b_k(d) · f(d). This file holds the torch reference (the CPU path, the test oracle and the
specification); the Triton kernels below plug in through :func:`rbf_cutoff`
(ops ``torch.ops.mlff_distiller.rbf_cutoff*``).
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ._backend import resolve_backend
from ._triton_utils import (
    _TUNING,
    HAS_TRITON,
    LIB,
    check_launchable,
    edge_block,
    num_warps,
    pdl_args,
    pdl_prologue,
    tl,
    triton,
    unspecialized,
    widest_chunk,
)

if HAS_TRITON:
    from ._triton_utils import triton_op, wrap_triton

__all__ = ["BASES", "ENVELOPES", "rbf_cutoff", "rbf_cutoff_reference"]

BASES = ("bessel", "gaussian")
ENVELOPES = ("cosine", "polynomial")
POLY_P = 6
# Below this distance (Å) the Bessel basis uses sin(x)/d ≈ k·π/rc · (1 − x²/6); the error there is < 1e-14 relative.
_SMALL = 1e-4


def _check_args(n_rbf: int, cutoff: float, basis: str, envelope: str) -> None:
    if basis not in BASES:
        raise ValueError(f"unknown radial basis {basis!r}; choose one of {BASES}")
    if envelope not in ENVELOPES:
        raise ValueError(f"unknown cutoff envelope {envelope!r}; choose one of {ENVELOPES}")
    if n_rbf < 1:
        raise ValueError(f"n_rbf must be >= 1, got {n_rbf}")
    if not cutoff > 0:
        raise ValueError(f"cutoff must be > 0, got {cutoff}")


def envelope_reference(dist: torch.Tensor, cutoff: float, envelope: str) -> torch.Tensor:
    """The smooth cutoff f(d) ``[E]``; exactly zero for d ≥ cutoff."""
    x = dist / cutoff
    inside = x < 1.0
    if envelope == "cosine":
        f = 0.5 * (torch.cos(math.pi * x) + 1.0)
    else:
        p = POLY_P
        f = 1.0 - (p + 1) * (p + 2) / 2 * x**p + p * (p + 2) * x ** (p + 1) - p * (p + 1) / 2 * x ** (p + 2)
    return torch.where(inside, f, torch.zeros_like(f))


def basis_reference(dist: torch.Tensor, n_rbf: int, cutoff: float, basis: str) -> torch.Tensor:
    """The radial basis without envelope ``[E, n_rbf]``."""
    d = dist.unsqueeze(-1)
    if basis == "bessel":
        k = torch.arange(1, n_rbf + 1, device=dist.device, dtype=dist.dtype) * (math.pi / cutoff)
        norm = math.sqrt(2.0 / cutoff)
        small = d < _SMALL
        # Double where: neither branch sees an input where it would produce inf/NaN (or NaN gradients).
        d_big = torch.where(small, torch.ones_like(d), d)
        d_small = torch.where(small, d, torch.zeros_like(d))
        big_val = torch.sin(k * d_big) / d_big
        small_val = k * (1.0 - (k * d_small) ** 2 / 6.0)
        return norm * torch.where(small, small_val, big_val)
    mu = torch.linspace(0.0, cutoff, n_rbf, device=dist.device, dtype=dist.dtype)
    width = cutoff / max(n_rbf - 1, 1)
    gamma = 0.5 / width**2
    return torch.exp(-gamma * (d - mu) ** 2)


def rbf_cutoff_reference(
    dist: torch.Tensor, n_rbf: int, cutoff: float, basis: str = "bessel", envelope: str = "cosine"
) -> torch.Tensor:
    """Torch reference of :func:`rbf_cutoff`: ``[E]`` distances (Å) → ``[E, n_rbf]``."""
    _check_args(n_rbf, cutoff, basis, envelope)
    return basis_reference(dist, n_rbf, cutoff, basis) * envelope_reference(dist, cutoff, envelope).unsqueeze(-1)


def rbf_cutoff(
    dist: torch.Tensor, n_rbf: int, cutoff: float, basis: str = "bessel", envelope: str = "cosine"
) -> torch.Tensor:
    """Radial basis × smooth cutoff for distances ``dist [E]`` (Å) → ``[E, n_rbf]``; differentiable twice."""
    if resolve_backend(dist.device) == "triton":
        _check_args(n_rbf, cutoff, basis, envelope)
        return _rbf_cutoff_triton(dist, n_rbf, cutoff, basis, envelope)
    return rbf_cutoff_reference(dist, n_rbf, cutoff, basis, envelope)


# ------------------------------------------------------------------------------------------------------------
# Triton path. Layers: jit helpers and kernels; host functions (allocate, pick blocks, launch); the
# torch.library triton_ops with their autograd; the eager autograd.Functions. Each backward is itself
# differentiable through a second kernel, so double backward (force training) stays on the kernels: rbf_cutoff
# -> _bwd -> _bwd_bwd. The dispatcher uses the triton_ops under torch.compile and the lighter
# autograd.Functions otherwise.
#
# One program owns BLOCK_E edges × all n_rbf columns: per-edge work (envelope, 1/d) is done once per edge, the
# [BLOCK_E, n_rbf] tile is stored row-contiguously, and no atomics are needed.
# ------------------------------------------------------------------------------------------------------------

_BASIS_ID = {name: i for i, name in enumerate(BASES)}
_ENVELOPE_ID = {name: i for i, name in enumerate(ENVELOPES)}


@functools.lru_cache(maxsize=64)
def _rbf_constexprs_cached(n_rbf: int, cutoff: float, basis: str, envelope: str, is_fp64: bool) -> dict:
    _check_args(n_rbf, cutoff, basis, envelope)
    width = cutoff / max(n_rbf - 1, 1)
    return dict(
        IS_FP64=is_fp64,
        N_RBF=int(n_rbf),
        BASIS=_BASIS_ID[basis],
        ENVELOPE=_ENVELOPE_ID[envelope],
        INV_RC=1.0 / cutoff,
        RC=float(cutoff),
        PI_RC=math.pi / cutoff,
        NORM=math.sqrt(2.0 / cutoff),
        GAMMA=0.5 / width**2,
        MU_STEP=width if n_rbf > 1 else 0.0,
    )


def _rbf_constexprs(n_rbf: int, cutoff: float, basis: str, envelope: str, dtype: torch.dtype) -> dict:
    """Compile-time constants of the rbf kernels (computed in double precision); a fresh dict."""
    return dict(_rbf_constexprs_cached(int(n_rbf), float(cutoff), basis, envelope, dtype == torch.float64))


def _check_float(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"the Triton kernels support float32 and float64, got {t.dtype}")


if HAS_TRITON:
    # Taylor coefficients of sin(πr) = r·Σ S_m r^2m and cos(πr) = Σ C_m r^2m on |r| <= 1/2. Float32 uses 7 and
    # 8 terms, float64 11 and 12 (first omitted terms < 7e-10 and < 1e-18 at r = 1/2): no range reduction left
    # to do, no libdevice call, and the same code in both precisions.
    _S = [tl.constexpr((-1) ** m * math.pi ** (2 * m + 1) / math.factorial(2 * m + 1)) for m in range(11)]
    _C = [tl.constexpr((-1) ** m * math.pi ** (2 * m) / math.factorial(2 * m)) for m in range(12)]
    _S0, _S1, _S2, _S3, _S4, _S5, _S6, _S7, _S8, _S9, _S10 = _S
    _C0, _C1, _C2, _C3, _C4, _C5, _C6, _C7, _C8, _C9, _C10, _C11 = _C
    # Series of (x cos x - sin x)/x³ and (2 sin x - 2x cos x - x² sin x)/x³: Σ_m≥1 (-1)^m 2m x^(2m-2)/(2m+1)!
    # and Σ_m≥1 (-1)^m 2m(2m-1) x^(2m-2)/(2m+1)!, five terms each (truncation < 1e-11 relative at x = 0.5).
    _T1_0, _T1_1, _T1_2, _T1_3, _T1_4 = (
        tl.constexpr((-1) ** m * 2 * m / math.factorial(2 * m + 1)) for m in range(1, 6)
    )
    _T2_0, _T2_1, _T2_2, _T2_3, _T2_4 = (
        tl.constexpr((-1) ** m * 2 * m * (2 * m - 1) / math.factorial(2 * m + 1)) for m in range(1, 6)
    )
    _PI = tl.constexpr(math.pi)
    _SMALL_D = tl.constexpr(_SMALL)

    @triton.jit
    def _c64(v: tl.constexpr):
        # A float64 constant built at full precision (a bare Python float may be materialised as float32
        # first).
        return tl.full((), v, tl.float64)

    @triton.jit
    def _cst(v: tl.constexpr, IS_FP64: tl.constexpr):
        if IS_FP64:
            return _c64(v)
        else:
            return tl.full((), v, tl.float32)

    @triton.jit
    def _sincospi_reduced(r, IS_FP64: tl.constexpr, NEED_COS: tl.constexpr):
        """(sin πr, cos πr) for |r| <= 1/2 by their Taylor polynomials; ``cos`` is ``sin`` unless NEED_COS."""
        r2 = r * r
        if IS_FP64:
            ps = _c64(_S9) + r2 * _c64(_S10)
            ps = _c64(_S5) + r2 * (_c64(_S6) + r2 * (_c64(_S7) + r2 * (_c64(_S8) + r2 * ps)))
            ps = _c64(_S0) + r2 * (_c64(_S1) + r2 * (_c64(_S2) + r2 * (_c64(_S3) + r2 * (_c64(_S4) + r2 * ps))))
        else:
            ps = _S0 + r2 * (_S1 + r2 * (_S2 + r2 * (_S3 + r2 * (_S4 + r2 * (_S5 + r2 * _S6)))))
        s = r * ps
        c = s
        if NEED_COS:
            if IS_FP64:
                pc = _c64(_C8) + r2 * (_c64(_C9) + r2 * (_c64(_C10) + r2 * _c64(_C11)))
                pc = _c64(_C4) + r2 * (_c64(_C5) + r2 * (_c64(_C6) + r2 * (_c64(_C7) + r2 * pc)))
                c = _C0 + r2 * (_c64(_C1) + r2 * (_c64(_C2) + r2 * (_c64(_C3) + r2 * pc)))
            else:
                c = _C0 + r2 * (_C1 + r2 * (_C2 + r2 * (_C3 + r2 * (_C4 + r2 * (_C5 + r2 * (_C6 + r2 * _C7))))))
        return s, c

    @triton.jit
    def _sincospi(u, IS_FP64: tl.constexpr, NEED_COS: tl.constexpr):
        """(sin πu, cos πu) by u = j + r, j integer, |r| <= 1/2: sin πu = (-1)^j sin πr, and the same for cos.

        ``cos`` is returned as ``sin`` unless NEED_COS. This is the inner loop of every Bessel kernel.
        """
        j = tl.floor(u + 0.5)
        sign = 1.0 - 2.0 * (j - 2.0 * tl.floor(0.5 * j))
        s, c = _sincospi_reduced(u - j, IS_FP64, NEED_COS)
        return sign * s, sign * c

    @triton.jit
    def _envelope(
        d,
        ORDER: tl.constexpr,
        ENVELOPE: tl.constexpr,
        IS_FP64: tl.constexpr,
        INV_RC: tl.constexpr,
        RC: tl.constexpr,
    ):
        """Envelope f(d) and, up to ORDER, f'(d), f''(d) (else copies of f); zero for d >= cutoff."""
        inv_rc = _cst(INV_RC, IS_FP64)
        x = d * inv_rc
        # 1 - x from rc - d, exact near the cutoff (Sterbenz) where f ~ (1 - x)^2 or (1 - x)^3 needs it to
        # full relative precision (d * (1/rc) alone is off by an ulp of 1, i.e. 1e-4 relative at 1 - x = 1e-3
        # in float32).
        omx = (_cst(RC, IS_FP64) - d) * inv_rc
        inside = x < 1.0
        if ENVELOPE == 0:
            # cosine, in half-angle form to stay accurate next to the cutoff: with y = (1 - x)/2 in [0, 1/2],
            # f = (cos πx + 1)/2 = sin²(πy), f' = -π/(2rc) sin πx = -π/rc sin πy cos πy,
            # f'' = -π²/(2rc²) cos πx = π²/(2rc²) (cos²πy - sin²πy).
            sy, cy = _sincospi_reduced(0.5 * omx, IS_FP64, True)
            f = sy * sy
            k1 = _cst(_PI, IS_FP64) * inv_rc
            f1 = -k1 * (sy * cy)
            f2 = (0.5 * k1 * k1) * (cy - sy) * (cy + sy)
        else:
            # polynomial p = 6: f = 1 - 28x^6 + 48x^7 - 21x^8 in its factored forms, which keep full relative
            # accuracy next to the cutoff (the expanded sum cancels to ~48ε there): f = (1-x)^3 (1 + 3x + 6x²
            # + 10x³ + 15x⁴ + 21x⁵), f' = -168 x^5 (1-x)^2 / rc, f'' = -168 x^4 (1-x)(5-7x) / rc².
            x4 = (x * x) * (x * x)
            f = (omx * omx * omx) * (1.0 + x * (3.0 + x * (6.0 + x * (10.0 + x * (15.0 + 21.0 * x)))))
            f1 = (-168.0 * inv_rc) * (x4 * x) * (omx * omx)
            f2 = (-168.0 * inv_rc * inv_rc) * x4 * omx * (5.0 - 7.0 * x)
        f = tl.where(inside, f, 0.0)
        if ORDER >= 1:
            f1 = tl.where(inside, f1, 0.0)
        else:
            f1 = f
        if ORDER >= 2:
            f2 = tl.where(inside, f2, 0.0)
        else:
            f2 = f
        return f, f1, f2

    @triton.jit
    def _basis(
        d,
        kf,
        ORDER: tl.constexpr,
        BASIS: tl.constexpr,
        IS_FP64: tl.constexpr,
        INV_RC: tl.constexpr,
        PI_RC: tl.constexpr,
        NORM: tl.constexpr,
        GAMMA: tl.constexpr,
        MU_STEP: tl.constexpr,
    ):
        """Basis B_k(d) and, up to ORDER, B_k'(d), B_k''(d): ``d [BE, 1]``, ``kf [1, W]`` = k (1-based)."""
        if BASIS == 0:
            # Bessel: B = N sin(x)/d with x = a d, a = kπ/rc, and sin x = sin(π u), u = k d/rc. The value uses
            # this form at every d (|d| clamped to 1e-30 keeps 0/0 out; it matches the reference's Taylor
            # branch below _SMALL to ~x⁴/120 < 1e-13). B' = N (x cos x - sin x)/d² and B'' = N (2 sin x - 2x
            # cos x - x² sin x)/d³ cancel catastrophically for small x (relative error ~ ε/x²), so below x =
            # 0.5 (float32) / 0.1 (float64) they use their series N a³ d·T1(x²), N a³·T2(x²); below _SMALL,
            # exactly the reference's -N a³ d/3 and -N a³/3.
            norm = _cst(NORM, IS_FP64)
            dc = tl.maximum(tl.abs(d), 1e-30)
            inv_d = 1.0 / dc
            s, c = _sincospi(kf * (dc * _cst(INV_RC, IS_FP64)), IS_FP64, ORDER >= 1)
            b = s * (norm * inv_d)
            b1 = b
            b2 = b
            if ORDER >= 1:
                small = d < _SMALL_D
                inv_d = 1.0 / tl.where(small, 1.0, d)  # the direct formulas are not used below _SMALL: keep them finite
                a = kf * _cst(PI_RC, IS_FP64)
                x = a * d
                x2 = x * x
                if IS_FP64:
                    use_series = (x < 0.1) | small
                    t1 = _c64(_T1_0) + x2 * (_c64(_T1_1) + x2 * (_c64(_T1_2) + x2 * (_c64(_T1_3) + x2 * _c64(_T1_4))))
                else:
                    use_series = (x < 0.5) | small
                    t1 = _T1_0 + x2 * (_T1_1 + x2 * (_T1_2 + x2 * (_T1_3 + x2 * _T1_4)))
                t1 = tl.where(small, -1.0 / 3.0, t1)
                na3 = norm * a * a * a
                b1 = tl.where(use_series, na3 * d * t1, norm * (a * c - s * inv_d) * inv_d)
            if ORDER >= 2:
                if IS_FP64:
                    t2 = _c64(_T2_0) + x2 * (_c64(_T2_1) + x2 * (_c64(_T2_2) + x2 * (_c64(_T2_3) + x2 * _c64(_T2_4))))
                else:
                    t2 = _T2_0 + x2 * (_T2_1 + x2 * (_T2_2 + x2 * (_T2_3 + x2 * _T2_4)))
                t2 = tl.where(small, -1.0 / 3.0, t2)
                b2 = tl.where(
                    use_series, na3 * t2, norm * ((2.0 * s * inv_d - 2.0 * a * c) * inv_d - a * a * s) * inv_d
                )
        else:
            # Gaussian: B = exp(-γ (d - μ)²), μ_k = (k - 1) rc/(n - 1); B' = -2γ (d - μ) B, B'' = 2γ (2γ (d -
            # μ)² - 1) B.
            gamma = _cst(GAMMA, IS_FP64)
            diff = d - (kf - 1.0) * _cst(MU_STEP, IS_FP64)
            b = tl.exp(-gamma * diff * diff)
            b1 = b
            b2 = b
            if ORDER >= 1:
                b1 = (-2.0 * gamma) * diff * b
            if ORDER >= 2:
                b2 = (2.0 * gamma) * (2.0 * gamma * diff * diff - 1.0) * b
        return b, b1, b2

    @triton.jit
    def _rbf_chunk(
        acc1,
        acc2,
        rows,
        rmask,
        d,
        f,
        f1,
        f2,
        scale,
        in_ptr,
        out_ptr,
        MODE: tl.constexpr,
        COL0: tl.constexpr,
        W: tl.constexpr,
        N_RBF: tl.constexpr,
        BASIS: tl.constexpr,
        IS_FP64: tl.constexpr,
        INV_RC: tl.constexpr,
        PI_RC: tl.constexpr,
        NORM: tl.constexpr,
        GAMMA: tl.constexpr,
        MU_STEP: tl.constexpr,
    ):
        """Columns COL0 .. COL0+W-1 (W a power of two) of R = B·f for this program's rows; ``in``/``out`` are
        row-major ``[E, N_RBF]``. Only whole rows are masked, so the tiles move with vector loads and stores.

        MODE 0: out = R.   MODE 1: acc1 += Σ_k in·R'.
        MODE 2: out = scale·R', acc2 += Σ_k in·R''.   MODE 3: as MODE 2, and acc1 += Σ_k in·R'.
        """
        cols = COL0 + tl.arange(0, W)
        offs = rows[:, None] * N_RBF + cols[None, :]
        mask = rmask[:, None]
        kf = (cols + 1).to(d.dtype)[None, :]
        b, b1, b2 = _basis(d[:, None], kf, MODE if MODE < 2 else 2, BASIS, IS_FP64, INV_RC, PI_RC, NORM, GAMMA, MU_STEP)
        f = f[:, None]
        if MODE == 0:
            tl.store(out_ptr + offs, b * f, mask=mask)
        else:
            f1 = f1[:, None]
            g = tl.load(in_ptr + offs, mask=mask, other=0.0)
            r1 = b1 * f + b * f1
            if MODE != 2:
                acc1 += tl.sum(g * r1, axis=1)
            if MODE >= 2:
                tl.store(out_ptr + offs, scale[:, None] * r1, mask=mask)
                r2 = b2 * f + 2.0 * b1 * f1 + b * f2[:, None]
                acc2 += tl.sum(g * r2, axis=1)
        return acc1, acc2

    @triton.jit
    def _rbf_rows(
        rows,
        rmask,
        d,
        scale,
        in_ptr,
        out_ptr,
        MODE: tl.constexpr,
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
        gate,
        gate1,
        gate2,
        GATED: tl.constexpr,
    ):
        """All n_rbf columns for the rows ``rows`` (distances ``d``) in power-of-two column chunks
        (20 = 16 + 4): no padded lanes to compute and no column masks. MODE as in :func:`_rbf_chunk`;
        returns (acc1, acc2). GATED: the basis times a per-row gate g(d) (``gate``, and its derivatives
        ``gate1``, ``gate2`` as MODE needs them; the ZBL wall's, :func:`.repulsion._wall_gate`), folded into the
        envelope: R·g = B·(f g), (f g)' = f' g + f g', (f g)'' = f'' g + 2 f' g' + f g''."""
        f, f1, f2 = _envelope(d, MODE if MODE < 2 else 2, ENVELOPE, IS_FP64, INV_RC, RC)
        if GATED:
            if MODE >= 2:
                f2 = f2 * gate + 2.0 * f1 * gate1 + f * gate2
            if MODE >= 1:
                f1 = f1 * gate + f * gate1
            f = f * gate
        acc1 = tl.zeros_like(d)
        acc2 = tl.zeros_like(d)
        for c in tl.static_range(N_RBF // 128):
            acc1, acc2 = _rbf_chunk(
                acc1,
                acc2,
                rows,
                rmask,
                d,
                f,
                f1,
                f2,
                scale,
                in_ptr,
                out_ptr,
                MODE,
                c * 128,
                128,
                N_RBF,
                BASIS,
                IS_FP64,
                INV_RC,
                PI_RC,
                NORM,
                GAMMA,
                MU_STEP,
            )
        for b in tl.static_range(7):  # then one chunk per set bit of n_rbf % 128: widths 64, 32, ..., 1
            if (N_RBF & (64 >> b)) != 0:
                acc1, acc2 = _rbf_chunk(
                    acc1,
                    acc2,
                    rows,
                    rmask,
                    d,
                    f,
                    f1,
                    f2,
                    scale,
                    in_ptr,
                    out_ptr,
                    MODE,
                    N_RBF - N_RBF % (128 >> b),
                    64 >> b,
                    N_RBF,
                    BASIS,
                    IS_FP64,
                    INV_RC,
                    PI_RC,
                    NORM,
                    GAMMA,
                    MU_STEP,
                )
        return acc1, acc2

    @triton.jit(**unspecialized("E"))
    def _rbf_cutoff_fwd_kernel(
        d_ptr,
        out_ptr,
        E,
        BLOCK_E: tl.constexpr,
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
        PDL: tl.constexpr,
    ):
        pdl_prologue(PDL)
        rows = tl.program_id(0).to(tl.int64) * BLOCK_E + tl.arange(0, BLOCK_E)
        rmask = rows < E
        d = tl.load(d_ptr + rows, mask=rmask, other=1.0)
        _rbf_rows(
            rows,
            rmask,
            d,
            d,
            out_ptr,
            out_ptr,
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
            d,
            d,
            d,
            False,
        )

    # VJP of out[e, k] = R_k(d_e), R = B·f:   g_d[e] = Σ_k go[e, k] · R_k'(d_e),   R' = B'·f + B·f'.
    @triton.jit(**unspecialized("E"))
    def _rbf_cutoff_bwd_kernel(
        go_ptr,
        d_ptr,
        gd_ptr,
        E,
        BLOCK_E: tl.constexpr,
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
        PDL: tl.constexpr,
    ):
        pdl_prologue(PDL)
        rows = tl.program_id(0).to(tl.int64) * BLOCK_E + tl.arange(0, BLOCK_E)
        rmask = rows < E
        d = tl.load(d_ptr + rows, mask=rmask, other=1.0)
        gd, _ = _rbf_rows(
            rows,
            rmask,
            d,
            d,
            go_ptr,
            go_ptr,
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
            d,
            d,
            d,
            False,
        )
        tl.store(gd_ptr + rows, gd, mask=rmask)

    # VJP of the backward g_d[e] = Σ_k go[e, k] R_k'(d_e), given gg[e] = ∂L/∂g_d[e]:
    #   ∂L/∂go[e, k] = gg[e] · R_k'(d_e),     ∂L/∂d[e] = gg[e] · Σ_k go[e, k] · R_k''(d_e),
    #   R'' = B''·f + 2 B'·f' + B·f''.
    @triton.jit(**unspecialized("E"))
    def _rbf_cutoff_bwd_bwd_kernel(
        gg_ptr,
        go_ptr,
        d_ptr,
        ggo_ptr,
        gd_ptr,
        E,
        BLOCK_E: tl.constexpr,
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
        PDL: tl.constexpr,
    ):
        pdl_prologue(PDL)
        rows = tl.program_id(0).to(tl.int64) * BLOCK_E + tl.arange(0, BLOCK_E)
        rmask = rows < E
        d = tl.load(d_ptr + rows, mask=rmask, other=1.0)
        gg = tl.load(gg_ptr + rows, mask=rmask, other=0.0)
        _, s2 = _rbf_rows(
            rows,
            rmask,
            d,
            gg,
            go_ptr,
            ggo_ptr,
            2,
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
            d,
            d,
            d,
            False,
        )
        tl.store(gd_ptr + rows, gg * s2, mask=rmask)

    # -- host functions: allocate, choose blocks, launch -----------------------------------------------------
    # ``launch`` is torch.library.wrap_triton inside the triton_ops (so torch.compile sees the kernels) and
    # the bare kernel on the eager path (no higher-order-op dispatch per launch).

    @functools.lru_cache(maxsize=256)
    def _rbf_plan(
        n_rbf: int,
        cutoff: float,
        basis: str,
        envelope: str,
        is_fp64: bool,
        is_cuda: bool,
        elems: int,
        tune: tuple,
    ) -> tuple[dict, tuple]:
        """Everything a launch needs that depends only on the configuration, built once: the constexprs
        (BLOCK_E included) and a hashable key standing for them. ``elems``: per-program tile budget (float32);
        ``tune``: the tuning knobs the block size depends on, so a sweep never sees a stale plan."""
        consts = dict(_rbf_constexprs_cached(n_rbf, cutoff, basis, envelope, is_fp64))
        device = torch.device("cuda" if is_cuda else "cpu")
        consts["BLOCK_E"] = edge_block(device, widest_chunk(n_rbf), elems // (8 if is_fp64 else 4) * 4)
        return consts, (n_rbf, cutoff, basis, envelope, is_fp64, consts["BLOCK_E"])

    def _plan_for(ref: Tensor, rbf_args: tuple, elems: int) -> tuple[dict, tuple]:
        n_rbf, cutoff, basis, envelope = rbf_args
        return _rbf_plan(
            int(n_rbf),
            float(cutoff),
            basis,
            envelope,
            ref.dtype == torch.float64,
            ref.is_cuda,
            elems,
            (_TUNING["block_scale"], _TUNING["num_warps"]),
        )

    def _launch_rows(launch, kernel, ref: Tensor, plan: tuple[dict, tuple], *args) -> None:
        """Launch a row kernel over ``ref.shape[0]`` edges with the constexprs of ``plan``."""
        consts, _ = plan
        n_rows = ref.shape[0]
        block = consts["BLOCK_E"]
        grid = (n_rows + block - 1) // block
        if not ref.is_cuda:
            check_launchable(kernel, ref)
        launch(kernel)[(grid,)](*args, n_rows, num_warps=num_warps(), **consts, **pdl_args(ref))

    # Per-program tile budget (float32 elements) of the forward and backward kernels: 512 = 32 edges x 16
    # columns over 4 warps. Swept at 1e6 edges on an H100 (graph replays, benchmarks/results/
    # bench_kernels_h100_stop15a.md, tune rows at block_scale 0.25-4 around the former 2048): forward 48.4 ->
    # 34.7 µs (58 -> 81 % of copy bandwidth), forward + backward 97.6 -> 91.8 µs.
    _ROW_ELEMS = 512

    def _rbf_fwd(dist: Tensor, n_rbf: int, cutoff: float, basis: str, envelope: str, launch) -> Tensor:
        _check_float(dist)
        dist = dist.contiguous()
        out = torch.empty((dist.shape[0], n_rbf), dtype=dist.dtype, device=dist.device)
        if dist.shape[0] > 0:
            plan = _plan_for(dist, (n_rbf, cutoff, basis, envelope), _ROW_ELEMS)
            _launch_rows(launch, _rbf_cutoff_fwd_kernel, dist, plan, dist, out)
        return out

    def _rbf_bwd(
        grad_rbf: Tensor, dist: Tensor, n_rbf: int, cutoff: float, basis: str, envelope: str, launch
    ) -> Tensor:
        grad_rbf, dist = grad_rbf.to(dist.dtype).contiguous(), dist.contiguous()
        grad_dist = torch.empty_like(dist)
        if dist.shape[0] > 0:
            plan = _plan_for(dist, (n_rbf, cutoff, basis, envelope), _ROW_ELEMS)
            _launch_rows(launch, _rbf_cutoff_bwd_kernel, dist, plan, grad_rbf, dist, grad_dist)
        return grad_dist

    def _rbf_bwd_bwd(
        gg: Tensor,
        grad_rbf: Tensor,
        dist: Tensor,
        n_rbf: int,
        cutoff: float,
        basis: str,
        envelope: str,
        launch,
    ) -> tuple[Tensor, Tensor]:
        gg = gg.to(dist.dtype).contiguous()
        grad_rbf, dist = grad_rbf.to(dist.dtype).contiguous(), dist.contiguous()
        out_grad_rbf = torch.empty_like(grad_rbf)
        out_dist = torch.empty_like(dist)
        if dist.shape[0] > 0:
            plan = _plan_for(dist, (n_rbf, cutoff, basis, envelope), 1024)
            _launch_rows(launch, _rbf_cutoff_bwd_bwd_kernel, dist, plan, gg, grad_rbf, dist, out_grad_rbf, out_dist)
        return out_grad_rbf, out_dist

    def _bare(kernel):
        return kernel

    # -- torch.library ops (what torch.compile sees) and their autograd --------------------------------------

    @triton_op(f"{LIB}::rbf_cutoff", mutates_args=())
    def _rbf_cutoff_op(dist: Tensor, n_rbf: int, cutoff: float, basis: str, envelope: str) -> Tensor:
        """``dist [E]`` → ``[E, n_rbf]`` (basis × cutoff), computed in the input dtype."""
        return _rbf_fwd(dist, n_rbf, cutoff, basis, envelope, wrap_triton)

    @triton_op(f"{LIB}::rbf_cutoff_bwd", mutates_args=())
    def _rbf_cutoff_bwd_op(
        grad_rbf: Tensor, dist: Tensor, n_rbf: int, cutoff: float, basis: str, envelope: str
    ) -> Tensor:
        """Gradient wrt ``dist [E]`` given ``grad_rbf [E, n_rbf]``."""
        return _rbf_bwd(grad_rbf, dist, n_rbf, cutoff, basis, envelope, wrap_triton)

    @triton_op(f"{LIB}::rbf_cutoff_bwd_bwd", mutates_args=())
    def _rbf_cutoff_bwd_bwd_op(
        grad_grad_dist: Tensor,
        grad_rbf: Tensor,
        dist: Tensor,
        n_rbf: int,
        cutoff: float,
        basis: str,
        envelope: str,
    ) -> tuple[Tensor, Tensor]:
        """Gradients of ``rbf_cutoff_bwd`` wrt ``grad_rbf [E, n_rbf]`` and ``dist [E]``."""
        return _rbf_bwd_bwd(grad_grad_dist, grad_rbf, dist, n_rbf, cutoff, basis, envelope, wrap_triton)

    def _rbf_setup_context(ctx, inputs, output):
        dist, *ctx.rbf_args = inputs
        ctx.save_for_backward(dist)

    def _rbf_backward(ctx, grad_rbf):
        (dist,) = ctx.saved_tensors
        return torch.ops.mlff_distiller.rbf_cutoff_bwd(grad_rbf, dist, *ctx.rbf_args), None, None, None, None

    def _rbf_bwd_setup_context(ctx, inputs, output):
        grad_rbf, dist, *ctx.rbf_args = inputs
        ctx.save_for_backward(grad_rbf, dist)

    def _rbf_bwd_backward(ctx, grad_grad_dist):
        grad_rbf, dist = ctx.saved_tensors
        g_grad_rbf, g_dist = torch.ops.mlff_distiller.rbf_cutoff_bwd_bwd(grad_grad_dist, grad_rbf, dist, *ctx.rbf_args)
        return g_grad_rbf, g_dist, None, None, None, None

    _rbf_cutoff_op.register_autograd(_rbf_backward, setup_context=_rbf_setup_context)
    _rbf_cutoff_bwd_op.register_autograd(_rbf_bwd_backward, setup_context=_rbf_bwd_setup_context)

    # -- eager path: the same host functions under plain autograd.Functions ----------------------------------
    # A torch.library op costs tens of µs of Python dispatch per call; outside torch.compile these Functions
    # run the same kernels with the same double-backward structure for a fraction of that.

    class _RbfCutoff(torch.autograd.Function):
        @staticmethod
        def forward(ctx, dist, n_rbf, cutoff, basis, envelope):
            ctx.rbf_args = (n_rbf, cutoff, basis, envelope)
            ctx.save_for_backward(dist)
            return _rbf_fwd(dist, n_rbf, cutoff, basis, envelope, _bare)

        @staticmethod
        def backward(ctx, grad_rbf):
            (dist,) = ctx.saved_tensors
            if torch.is_grad_enabled():  # create_graph: the backward must itself be differentiable
                grad_dist = _RbfCutoffBwd.apply(grad_rbf, dist, *ctx.rbf_args)
            else:  # a plain backward: skip the second Function's bookkeeping (µs that matter at small E)
                grad_dist = _rbf_bwd(grad_rbf, dist, *ctx.rbf_args, _bare)
            return grad_dist, None, None, None, None

    class _RbfCutoffBwd(torch.autograd.Function):
        @staticmethod
        def forward(ctx, grad_rbf, dist, n_rbf, cutoff, basis, envelope):
            ctx.rbf_args = (n_rbf, cutoff, basis, envelope)
            ctx.save_for_backward(grad_rbf, dist)
            return _rbf_bwd(grad_rbf, dist, n_rbf, cutoff, basis, envelope, _bare)

        @staticmethod
        @once_differentiable
        def backward(ctx, grad_grad_dist):
            grad_rbf, dist = ctx.saved_tensors
            g_grad_rbf, g_dist = _rbf_bwd_bwd(grad_grad_dist, grad_rbf, dist, *ctx.rbf_args, _bare)
            return g_grad_rbf, g_dist, None, None, None, None


def _rbf_cutoff_triton(dist: torch.Tensor, n_rbf: int, cutoff: float, basis: str, envelope: str) -> torch.Tensor:
    """The Triton path: the torch.library op under torch.compile, the lighter autograd.Function otherwise."""
    if not HAS_TRITON:
        raise RuntimeError("the Triton rbf_cutoff path needs triton installed; use MLFF_DISTILLER_KERNELS=torch")
    if torch.compiler.is_compiling():
        return torch.ops.mlff_distiller.rbf_cutoff(dist, int(n_rbf), float(cutoff), basis, envelope)
    if torch.is_grad_enabled() and dist.requires_grad:
        return _RbfCutoff.apply(dist, int(n_rbf), float(cutoff), basis, envelope)
    # Nothing to differentiate: the host function alone (no autograd.Function bookkeeping).
    return _rbf_fwd(dist, int(n_rbf), float(cutoff), basis, envelope, _bare)
