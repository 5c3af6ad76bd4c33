"""The atom-wise part of a PaiNN layer as one kernel each way, for inference.

Between two message-passing steps everything a PaiNN student does is atom-wise: the residual of the message
(s + Δs, v + Δv), the update block (see :mod:`.painn_update`) and the first MLP of whatever comes next, the filter
network φ of the next interaction or, after the last layer, the readout. With s ``[N,F]``, v ``[N,3,F]``:

    s_m, v_m           = s + Δs, v + Δv
    s_o, v_o           = update(s_m, v_m)                        (painn_update_reference)
    head "phi":        x = W_b SiLU(W_a s_o + b_a) + b_b         ``[N, 3F]``, the next layer's φ(s)
    head "readout":    e = w_b · SiLU(W_a s_o + b_a) + b_b      ``[N]``, the atomic energy before scale and shift

As torch ops this is ~12 kernels forward and ~12 backward per layer (cuBLAS GEMMs on a few hundred rows, SiLU,
the update block's kernels, residual adds and gradient accumulations), each a node of a CUDA graph. Here one
Triton program owns ``BLOCK_N`` atoms with all their features and runs every GEMM of the block as a ``tl.dot`` on
weights read from L2, so the block is one launch forward and one backward. The backward recomputes the forward
from the block's inputs (as activation checkpointing does) rather than storing intermediates.

Inference only, like the fused update: gradients wrt s, Δs, v, Δv (forces need nothing else), frozen weights,
first order. :func:`painn_block_fusable` states when it may run; the torch reference :func:`painn_block_reference`
is the specification and the test oracle. On the GPU it runs float32 with F ≤ 128 (larger or float64 tiles do not
fit the registers and shared memory of one program); the interpreter also runs float64 (the tests' oracle checks).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as nnf

from ._backend import resolve_backend
from ._triton_utils import HAS_TRITON, check_launchable, tl, triton
from .painn_update import painn_update_reference

__all__ = ["HEADS", "painn_block", "painn_block_fusable", "painn_block_reference"]

HEADS = ("phi", "readout")
_EPS = 1e-8  # the update block's constant under the square root (painn_update._EPS)
# GPU launch: atoms per program (16, the smallest tl.dot row count), warps, the feature chunk of every GEMM;
# interp_chunk: the chunk under the interpreter (0: whole rows, one chunk; the tests set 16 to walk the chunk loops).
_CONFIG = {"block_n": 16, "num_warps": 4, "chunk": 32, "max_feat": 128, "dot": "tf32x3", "interp_chunk": 0}


def painn_block_reference(
    s: Tensor | None, ds: Tensor, v: Tensor | None, dv: Tensor, update: tuple, head: str, head_params: tuple
) -> tuple[Tensor, ...]:
    """Torch reference. ``update`` = (U, V, W1, b1, W2, b2) of the update block, ``head_params`` = (W_a, b_a, W_b,
    b_b) as stored by ``nn.Linear`` (phi: ``[F,F], [F], [3F,F], [3F]``; readout: ``[H,F], [H], [1,H], [1]``).
    ``s``/``v`` may be None (zero). Returns ``(s_o, v_o, x)`` for head "phi" and ``(e,)`` for "readout"."""
    s_m = ds if s is None else s + ds
    v_m = dv if v is None else v + dv
    s_o, v_o = painn_update_reference(s_m, v_m, *update)
    w_a, b_a, w_b, b_b = head_params
    out = nnf.linear(nnf.silu(nnf.linear(s_o, w_a, b_a)), w_b, b_b)
    if head == "phi":
        return s_o, v_o, out
    return (out.squeeze(-1),)


def painn_block_fusable(ds: Tensor, *params: Tensor) -> bool:
    """Whether the fused kernels may run: Triton backend for the device, no parameter requiring grad, not inside
    torch.compile, one device and dtype for everything; on the GPU float32 and F ≤ 128 (the interpreter also takes
    float64). Host-side checks only (safe inside CUDA-graph capture)."""
    if torch.compiler.is_compiling() or ds.dtype not in (torch.float32, torch.float64) or ds.dim() != 2:
        return False
    if any(p.requires_grad or p.dtype != ds.dtype or p.device != ds.device for p in params):
        return False
    if ds.is_cuda and (ds.dtype != torch.float32 or ds.shape[1] > _CONFIG["max_feat"]):
        return False
    return resolve_backend(ds.device) == "triton"


def painn_block(
    s: Tensor | None, ds: Tensor, v: Tensor | None, dv: Tensor, update: tuple, head: str, head_params: tuple
) -> tuple[Tensor, ...]:
    """The block (module docstring): fused when :func:`painn_block_fusable` says so, else the torch reference."""
    _check_inputs(s, ds, v, dv, update, head, head_params)
    if painn_block_fusable(ds, *update, *head_params):
        if not HAS_TRITON:  # pragma: no cover - resolve_backend never says "triton" then
            raise RuntimeError("the fused PaiNN block needs triton installed; use MLFF_DISTILLER_KERNELS=torch")
        args = (s, ds, v, dv, head == "phi", *update, *head_params)
        if not torch.is_grad_enabled() or not any(t is not None and t.requires_grad for t in (s, ds, v, dv)):
            return _fused_forward(*args)
        out = _PaiNNBlockFused.apply(*args)
        return out if head == "phi" else (out,)
    return painn_block_reference(s, ds, v, dv, update, head, head_params)


def _check_inputs(s, ds, v, dv, update, head, head_params) -> None:
    """Shapes only (host-side)."""
    if head not in HEADS:
        raise ValueError(f"unknown head {head!r}; choose one of {HEADS}")
    if ds.dim() != 2 or dv.shape != (ds.shape[0], 3, ds.shape[1]):
        raise ValueError(f"ds must be [N, F] and dv [N, 3, F], got {tuple(ds.shape)} and {tuple(dv.shape)}")
    if s is not None and s.shape != ds.shape:
        raise ValueError(f"s must match ds {tuple(ds.shape)}, got {tuple(s.shape)}")
    if v is not None and v.shape != dv.shape:
        raise ValueError(f"v must match dv {tuple(dv.shape)}, got {tuple(v.shape)}")
    f = ds.shape[1]
    if len(update) != 6 or len(head_params) != 4:
        raise ValueError("update takes 6 tensors (U, V, W1, b1, W2, b2), the head 4 (W_a, b_a, W_b, b_b)")
    want = [(f, f), (f, f), (f, 2 * f), (f,), (3 * f, f), (3 * f,)]
    h = head_params[0].shape[0] if head_params[0].dim() == 2 else -1
    want += [(f, f), (f,), (3 * f, f), (3 * f,)] if head == "phi" else [(h, f), (h,), (1, h), (1,)]
    for t, shape in zip((*update, *head_params), want, strict=True):
        if tuple(t.shape) != shape:
            raise ValueError(f"painn_block ({head} head, F = {f}): a weight is {list(t.shape)}, expected {list(shape)}")


# ------------------------------------------------------------------------------------------------------------
# Triton path. Weights are nn.Linear's [out, in], row-major. Feature axes are padded to powers of two (FP, HP)
# with zeros: padded weight rows/columns and biases load as 0, so padded columns stay 0 (SiLU(0) = 0) and the
# padded entries of ‖vv‖ (sqrt(eps)) only meet zero weights.
#
# Register budget. A [16, 128] float32 tile costs 16 registers per thread at 4 warps, a whole [128, 128] weight
# operand (and its tf32x3 hi/lo halves) far more: a first version that held whole weight tiles spilled and ran
# ~17 µs per GEMM on the H100. So every GEMM runs in feature chunks of NC: either its output chunk by chunk from
# a whole-width input held in registers (x Wᵀ[:, c]), or accumulated over input chunks into a whole-width
# accumulator (Σ_c x_c Wᵀ[c, :]); weight tiles are [NC, FP], loaded along the contiguous axis. Chunks that a later
# pass needs again (uv_k, vv_k, p, ∂a, ...) go through ``work``, a per-atom scratch row the program owns (written
# and read back by the same program, with a barrier between passes).
# ------------------------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _ld(w_ptr, ld, r0, c0, r_hi, c_hi, R: tl.constexpr, C: tl.constexpr):
        """``[R, C]`` tile of a row-major matrix at (r0, c0): rows below ``r_hi``, columns below ``c_hi``, else 0."""
        r = r0 + tl.arange(0, R)[:, None]
        c = c0 + tl.arange(0, C)[None, :]
        return tl.load(w_ptr + r * ld + c, mask=(r < r_hi) & (c < c_hi), other=0.0)

    @triton.jit
    def _vec(ptr, off, hi, NP: tl.constexpr):
        """``[1, NP]`` slice of a vector from ``off`` (entries at or beyond ``hi`` are 0)."""
        j = off + tl.arange(0, NP)
        return tl.load(ptr + j, mask=j < hi, other=0.0)[None, :]

    @triton.jit
    def _sigmoid(x):
        return 1.0 / (1.0 + tl.exp(-x))

    @triton.jit
    def _dsilu(x):
        sg = _sigmoid(x)
        return sg * (1.0 + x * (1.0 - sg))

    @triton.jit
    def _rows(ptr, row, width, col, m):
        return tl.load(ptr + row * width + col, mask=m, other=0.0)

    @triton.jit
    def _norm(vv0, vv1, vv2):
        sq = vv0 * vv0 + vv1 * vv1 + vv2 * vv2 + tl.full(vv0.shape, 1e-8, vv0.dtype)
        if vv0.dtype == tl.float32:
            return tl.sqrt_rn(sq)  # tl.sqrt is the approximate one in float32
        return tl.sqrt(sq)

    @triton.jit
    def _s_mid(s_ptr, ds_ptr, row, col, m, F: tl.constexpr, HAS_S: tl.constexpr):
        x = _rows(ds_ptr, row, F, col, m)
        if HAS_S:
            x += _rows(s_ptr, row, F, col, m)
        return x

    @triton.jit
    def _v_mid(v_ptr, dv_ptr, row, k: tl.constexpr, col, m, F: tl.constexpr, HAS_V: tl.constexpr):
        x = _rows(dv_ptr, row, 3 * F, k * F + col, m)
        if HAS_V:
            x += _rows(v_ptr, row, 3 * F, k * F + col, m)
        return x

    @triton.jit
    def _painn_block_fwd_kernel(
        s_ptr, ds_ptr, v_ptr, dv_ptr, uw_ptr, vw_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr,
        ha_ptr, hba_ptr, hb_ptr, hbb_ptr, s_out_ptr, v_out_ptr, out_ptr, work_ptr, n_atoms,
        F: tl.constexpr, FP: tl.constexpr, H: tl.constexpr, HP: tl.constexpr, NC: tl.constexpr,
        HEAD_PHI: tl.constexpr, HAS_S: tl.constexpr, HAS_V: tl.constexpr, STORE_SV: tl.constexpr,
        BLOCK_N: tl.constexpr, DOT: tl.constexpr,
    ):  # fmt: skip
        i = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        row = i[:, None]
        rm = row < n_atoms
        full = tl.arange(0, FP)[None, :]
        mf = rm & (full < F)
        v0 = _v_mid(v_ptr, dv_ptr, row, 0, full, mf, F, HAS_V)
        v1 = _v_mid(v_ptr, dv_ptr, row, 1, full, mf, F, HAS_V)
        v2 = _v_mid(v_ptr, dv_ptr, row, 2, full, mf, F, HAS_V)
        # pass 1, over feature chunks c: uv_k, vv_k, p -> work; pre = W1 [s_m | ‖vv‖] + b1 accumulated over c
        pre = tl.zeros((BLOCK_N, FP), dtype=v0.dtype) + _vec(b1_ptr, 0, F, FP)
        for c in range(0, FP, NC):
            cc = c + tl.arange(0, NC)[None, :]
            mc = rm & (cc < F)
            ut = tl.trans(_ld(uw_ptr, F, c, 0, F, F, NC, FP))
            vt = tl.trans(_ld(vw_ptr, F, c, 0, F, F, NC, FP))
            uv0 = tl.dot(v0, ut, input_precision=DOT)
            uv1 = tl.dot(v1, ut, input_precision=DOT)
            uv2 = tl.dot(v2, ut, input_precision=DOT)
            vv0 = tl.dot(v0, vt, input_precision=DOT)
            vv1 = tl.dot(v1, vt, input_precision=DOT)
            vv2 = tl.dot(v2, vt, input_precision=DOT)
            wr = work_ptr + row * (4 * F) + cc
            tl.store(wr, uv0, mask=mc)
            tl.store(wr + F, uv1, mask=mc)
            tl.store(wr + 2 * F, uv2, mask=mc)
            tl.store(wr + 3 * F, uv0 * vv0 + uv1 * vv1 + uv2 * vv2, mask=mc)
            s_c = _s_mid(s_ptr, ds_ptr, row, cc, mc, F, HAS_S)
            pre += tl.dot(s_c, tl.trans(_ld(w1_ptr, 2 * F, 0, c, F, F, FP, NC)), input_precision=DOT)
            nrm = _norm(vv0, vv1, vv2)
            pre += tl.dot(nrm, tl.trans(_ld(w1_ptr, 2 * F, 0, F + c, F, 2 * F, FP, NC)), input_precision=DOT)
        h = pre * _sigmoid(pre)
        tl.debug_barrier()
        # pass 2: the mixing outputs chunk by chunk, s_o and v_o, and the head's pre-activation over c
        t = tl.zeros((BLOCK_N, HP), dtype=v0.dtype) + _vec(hba_ptr, 0, H, HP)
        for c in range(0, FP, NC):
            cc = c + tl.arange(0, NC)[None, :]
            mc = rm & (cc < F)
            a_vv = tl.dot(h, tl.trans(_ld(w2_ptr, F, c, 0, F, F, NC, FP)), input_precision=DOT)
            a_vv += _vec(b2_ptr, c, F, NC)
            a_sv = tl.dot(h, tl.trans(_ld(w2_ptr, F, F + c, 0, 2 * F, F, NC, FP)), input_precision=DOT)
            a_sv += _vec(b2_ptr, F + c, 2 * F, NC)
            a_ss = tl.dot(h, tl.trans(_ld(w2_ptr, F, 2 * F + c, 0, 3 * F, F, NC, FP)), input_precision=DOT)
            a_ss += _vec(b2_ptr, 2 * F + c, 3 * F, NC)
            wr = work_ptr + row * (4 * F) + cc
            s_o = _s_mid(s_ptr, ds_ptr, row, cc, mc, F, HAS_S) + a_ss + a_sv * tl.load(wr + 3 * F, mask=mc, other=0.0)
            if STORE_SV:
                tl.store(s_out_ptr + row * F + cc, s_o, mask=mc)
                for k in tl.static_range(3):
                    v_o = _v_mid(v_ptr, dv_ptr, row, k, cc, mc, F, HAS_V)
                    v_o += a_vv * tl.load(wr + k * F, mask=mc, other=0.0)
                    tl.store(v_out_ptr + row * (3 * F) + k * F + cc, v_o, mask=mc)
            t += tl.dot(s_o, tl.trans(_ld(ha_ptr, F, 0, c, H, F, HP, NC)), input_precision=DOT)
        t = t * _sigmoid(t)
        if HEAD_PHI:
            for k in tl.static_range(3):
                for c in range(0, FP, NC):
                    cc = c + tl.arange(0, NC)[None, :]
                    wb = tl.trans(_ld(hb_ptr, F, k * F + c, 0, (k + 1) * F, F, NC, HP))
                    x = tl.dot(t, wb, input_precision=DOT) + _vec(hbb_ptr, k * F + c, (k + 1) * F, NC)
                    tl.store(out_ptr + row * (3 * F) + k * F + cc, x, mask=rm & (cc < F))
        else:
            e = tl.sum(t * _vec(hb_ptr, 0, H, HP), axis=1) + tl.load(hbb_ptr)
            tl.store(out_ptr + i, e, mask=i < n_atoms)

    # Backward, given g_o = ∂L/∂s_o, g_w_k = ∂L/∂v_o_k and the head's upstream gradient (∂L/∂x or ∂L/∂e):
    #   head:    g_t = ∂L/∂x W_b (phi) or ∂L/∂e w_b (readout), times SiLU'(t);  g_o += g_t W_a
    #   mixing:  ∂a_vv = Σ_k g_w_k ⊙ uv_k,  ∂a_sv = g_o ⊙ p,  ∂a_ss = g_o,  ∂p = g_o ⊙ a_sv
    #            ∂pre = ([∂a_vv | ∂a_sv | ∂a_ss] W2) ⊙ SiLU'(pre);  [∂s | ∂‖vv‖] = ∂pre W1
    #   vectors: ∂uv_k = g_w_k ⊙ a_vv + ∂p ⊙ vv_k,  ∂vv_k = ∂p ⊙ uv_k + ∂‖vv‖ ⊙ vv_k / ‖vv‖  (‖vv‖ ≥ 1e-4)
    #   inputs:  ∂s_m = g_o + ∂s,  ∂v_m_k = g_w_k + ∂uv_k U + ∂vv_k V   (= the gradients wrt s and Δs, v and Δv)
    # work row (9F): uv_0..2, vv_0..2 (pass A), g_o, ∂p, a_vv (pass C).
    @triton.jit
    def _painn_block_bwd_kernel(
        s_ptr, ds_ptr, v_ptr, dv_ptr, uw_ptr, vw_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr,
        ha_ptr, hba_ptr, hb_ptr, hbb_ptr, gs_ptr, gv_ptr, gout_ptr, g_s_ptr, g_v_ptr, work_ptr, n_atoms,
        F: tl.constexpr, FP: tl.constexpr, H: tl.constexpr, HP: tl.constexpr, NC: tl.constexpr,
        HEAD_PHI: tl.constexpr, HAS_S: tl.constexpr, HAS_V: tl.constexpr, HAS_GS: tl.constexpr,
        HAS_GV: tl.constexpr, HAS_GO: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr,
    ):  # fmt: skip
        i = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        row = i[:, None]
        rm = row < n_atoms
        full = tl.arange(0, FP)[None, :]
        mf = rm & (full < F)
        v0 = _v_mid(v_ptr, dv_ptr, row, 0, full, mf, F, HAS_V)
        v1 = _v_mid(v_ptr, dv_ptr, row, 1, full, mf, F, HAS_V)
        v2 = _v_mid(v_ptr, dv_ptr, row, 2, full, mf, F, HAS_V)
        wrow = work_ptr + row * (9 * F)
        # pass A: uv_k, vv_k -> work; pre
        pre = tl.zeros((BLOCK_N, FP), dtype=v0.dtype) + _vec(b1_ptr, 0, F, FP)
        for c in range(0, FP, NC):
            cc = c + tl.arange(0, NC)[None, :]
            mc = rm & (cc < F)
            ut = tl.trans(_ld(uw_ptr, F, c, 0, F, F, NC, FP))
            vt = tl.trans(_ld(vw_ptr, F, c, 0, F, F, NC, FP))
            tl.store(wrow + cc, tl.dot(v0, ut, input_precision=DOT), mask=mc)
            tl.store(wrow + F + cc, tl.dot(v1, ut, input_precision=DOT), mask=mc)
            tl.store(wrow + 2 * F + cc, tl.dot(v2, ut, input_precision=DOT), mask=mc)
            vv0 = tl.dot(v0, vt, input_precision=DOT)
            vv1 = tl.dot(v1, vt, input_precision=DOT)
            vv2 = tl.dot(v2, vt, input_precision=DOT)
            tl.store(wrow + 3 * F + cc, vv0, mask=mc)
            tl.store(wrow + 4 * F + cc, vv1, mask=mc)
            tl.store(wrow + 5 * F + cc, vv2, mask=mc)
            s_c = _s_mid(s_ptr, ds_ptr, row, cc, mc, F, HAS_S)
            pre += tl.dot(s_c, tl.trans(_ld(w1_ptr, 2 * F, 0, c, F, F, FP, NC)), input_precision=DOT)
            nrm = _norm(vv0, vv1, vv2)
            pre += tl.dot(nrm, tl.trans(_ld(w1_ptr, 2 * F, 0, F + c, F, 2 * F, FP, NC)), input_precision=DOT)
        h = pre * _sigmoid(pre)
        tl.debug_barrier()
        # pass B (head): recompute s_o over c into the head's pre-activation, then g_t = ∂L/∂(W_a s_o + b_a)
        g_t = tl.zeros((BLOCK_N, HP), dtype=v0.dtype)
        if HAS_GO:
            t = tl.zeros((BLOCK_N, HP), dtype=v0.dtype) + _vec(hba_ptr, 0, H, HP)
            for c in range(0, FP, NC):
                cc = c + tl.arange(0, NC)[None, :]
                mc = rm & (cc < F)
                a_sv = tl.dot(h, tl.trans(_ld(w2_ptr, F, F + c, 0, 2 * F, F, NC, FP)), input_precision=DOT)
                a_sv += _vec(b2_ptr, F + c, 2 * F, NC)
                a_ss = tl.dot(h, tl.trans(_ld(w2_ptr, F, 2 * F + c, 0, 3 * F, F, NC, FP)), input_precision=DOT)
                a_ss += _vec(b2_ptr, 2 * F + c, 3 * F, NC)
                p = tl.load(wrow + cc, mask=mc, other=0.0) * tl.load(wrow + 3 * F + cc, mask=mc, other=0.0)
                p += tl.load(wrow + F + cc, mask=mc, other=0.0) * tl.load(wrow + 4 * F + cc, mask=mc, other=0.0)
                p += tl.load(wrow + 2 * F + cc, mask=mc, other=0.0) * tl.load(wrow + 5 * F + cc, mask=mc, other=0.0)
                s_o = _s_mid(s_ptr, ds_ptr, row, cc, mc, F, HAS_S) + a_ss + a_sv * p
                t += tl.dot(s_o, tl.trans(_ld(ha_ptr, F, 0, c, H, F, HP, NC)), input_precision=DOT)
            if HEAD_PHI:
                for k in tl.static_range(3):
                    for c in range(0, FP, NC):
                        cc = c + tl.arange(0, NC)[None, :]
                        g_x = tl.load(gout_ptr + row * (3 * F) + k * F + cc, mask=rm & (cc < F), other=0.0)
                        wb = _ld(hb_ptr, F, k * F + c, 0, (k + 1) * F, F, NC, HP)
                        g_t += tl.dot(g_x, wb, input_precision=DOT)
            else:
                g_e = tl.load(gout_ptr + i, mask=i < n_atoms, other=0.0)
                g_t = g_e[:, None] * _vec(hb_ptr, 0, H, HP)
            g_t = g_t * _dsilu(t)
        # pass C: g_o, the mixing gradients and ∂h accumulated over c; g_o, ∂p, a_vv -> work
        g_h = tl.zeros((BLOCK_N, FP), dtype=v0.dtype)
        for c in range(0, FP, NC):
            cc = c + tl.arange(0, NC)[None, :]
            mc = rm & (cc < F)
            g_o = tl.zeros((BLOCK_N, NC), dtype=v0.dtype)
            if HAS_GS:
                g_o += tl.load(gs_ptr + row * F + cc, mask=mc, other=0.0)
            if HAS_GO:
                g_o += tl.dot(g_t, _ld(ha_ptr, F, 0, c, H, F, HP, NC), input_precision=DOT)
            a_vv = tl.dot(h, tl.trans(_ld(w2_ptr, F, c, 0, F, F, NC, FP)), input_precision=DOT)
            a_vv += _vec(b2_ptr, c, F, NC)
            a_sv = tl.dot(h, tl.trans(_ld(w2_ptr, F, F + c, 0, 2 * F, F, NC, FP)), input_precision=DOT)
            a_sv += _vec(b2_ptr, F + c, 2 * F, NC)
            uv0 = tl.load(wrow + cc, mask=mc, other=0.0)
            uv1 = tl.load(wrow + F + cc, mask=mc, other=0.0)
            uv2 = tl.load(wrow + 2 * F + cc, mask=mc, other=0.0)
            p = uv0 * tl.load(wrow + 3 * F + cc, mask=mc, other=0.0)
            p += uv1 * tl.load(wrow + 4 * F + cc, mask=mc, other=0.0)
            p += uv2 * tl.load(wrow + 5 * F + cc, mask=mc, other=0.0)
            g_h += tl.dot(g_o * p, _ld(w2_ptr, F, F + c, 0, 2 * F, F, NC, FP), input_precision=DOT)
            g_h += tl.dot(g_o, _ld(w2_ptr, F, 2 * F + c, 0, 3 * F, F, NC, FP), input_precision=DOT)
            if HAS_GV:
                g_avv = uv0 * tl.load(gv_ptr + row * (3 * F) + cc, mask=mc, other=0.0)
                g_avv += uv1 * tl.load(gv_ptr + row * (3 * F) + F + cc, mask=mc, other=0.0)
                g_avv += uv2 * tl.load(gv_ptr + row * (3 * F) + 2 * F + cc, mask=mc, other=0.0)
                g_h += tl.dot(g_avv, _ld(w2_ptr, F, c, 0, F, F, NC, FP), input_precision=DOT)
            tl.store(wrow + 6 * F + cc, g_o, mask=mc)
            tl.store(wrow + 7 * F + cc, g_o * a_sv, mask=mc)
            tl.store(wrow + 8 * F + cc, a_vv, mask=mc)
        g_pre = g_h * _dsilu(pre)
        tl.debug_barrier()
        # pass D: ∂s_m per chunk; ∂v_m_k accumulated over c
        gv0 = tl.zeros((BLOCK_N, FP), dtype=v0.dtype)
        gv1 = tl.zeros((BLOCK_N, FP), dtype=v0.dtype)
        gv2 = tl.zeros((BLOCK_N, FP), dtype=v0.dtype)
        for c in range(0, FP, NC):
            cc = c + tl.arange(0, NC)[None, :]
            mc = rm & (cc < F)
            g_s = tl.load(wrow + 6 * F + cc, mask=mc, other=0.0)
            g_s += tl.dot(g_pre, _ld(w1_ptr, 2 * F, 0, c, F, F, FP, NC), input_precision=DOT)
            tl.store(g_s_ptr + row * F + cc, g_s, mask=mc)
            vv0 = tl.load(wrow + 3 * F + cc, mask=mc, other=0.0)
            vv1 = tl.load(wrow + 4 * F + cc, mask=mc, other=0.0)
            vv2 = tl.load(wrow + 5 * F + cc, mask=mc, other=0.0)
            r = tl.dot(g_pre, _ld(w1_ptr, 2 * F, 0, F + c, F, 2 * F, FP, NC), input_precision=DOT)
            r = r / _norm(vv0, vv1, vv2)
            g_p = tl.load(wrow + 7 * F + cc, mask=mc, other=0.0)
            a_vv = tl.load(wrow + 8 * F + cc, mask=mc, other=0.0)
            um = _ld(uw_ptr, F, c, 0, F, F, NC, FP)
            vm = _ld(vw_ptr, F, c, 0, F, F, NC, FP)
            uv0 = tl.load(wrow + cc, mask=mc, other=0.0)
            uv1 = tl.load(wrow + F + cc, mask=mc, other=0.0)
            uv2 = tl.load(wrow + 2 * F + cc, mask=mc, other=0.0)
            g_uv0 = g_p * vv0
            g_uv1 = g_p * vv1
            g_uv2 = g_p * vv2
            if HAS_GV:
                g_uv0 += a_vv * tl.load(gv_ptr + row * (3 * F) + cc, mask=mc, other=0.0)
                g_uv1 += a_vv * tl.load(gv_ptr + row * (3 * F) + F + cc, mask=mc, other=0.0)
                g_uv2 += a_vv * tl.load(gv_ptr + row * (3 * F) + 2 * F + cc, mask=mc, other=0.0)
            gv0 += tl.dot(g_uv0, um, input_precision=DOT) + tl.dot(g_p * uv0 + r * vv0, vm, input_precision=DOT)
            gv1 += tl.dot(g_uv1, um, input_precision=DOT) + tl.dot(g_p * uv1 + r * vv1, vm, input_precision=DOT)
            gv2 += tl.dot(g_uv2, um, input_precision=DOT) + tl.dot(g_p * uv2 + r * vv2, vm, input_precision=DOT)
        if HAS_GV:
            gv0 += _rows(gv_ptr, row, 3 * F, full, mf)
            gv1 += _rows(gv_ptr, row, 3 * F, F + full, mf)
            gv2 += _rows(gv_ptr, row, 3 * F, 2 * F + full, mf)
        tl.store(g_v_ptr + row * (3 * F) + full, gv0, mask=mf)
        tl.store(g_v_ptr + row * (3 * F) + F + full, gv1, mask=mf)
        tl.store(g_v_ptr + row * (3 * F) + 2 * F + full, gv2, mask=mf)

    def _launch_args(ds: Tensor, head_phi: bool, head_params) -> tuple[tuple, dict]:
        n, f = ds.shape
        h = f if head_phi else head_params[0].shape[0]
        fp = max(16, triton.next_power_of_2(f))
        cuda = ds.is_cuda
        if cuda:
            block_n, warps, nc = _CONFIG["block_n"], _CONFIG["num_warps"], min(_CONFIG["chunk"], fp)
        else:  # the interpreter pays per program and per loop step: few large tiles, one chunk
            block_n, warps = max(16, min(128, triton.next_power_of_2(max(n, 1)))), 4
            nc = min(_CONFIG["interp_chunk"] or fp, fp)
        dot = _CONFIG["dot"] if cuda and ds.dtype == torch.float32 else "ieee"
        consts = dict(
            F=f, FP=fp, H=h, HP=max(16, triton.next_power_of_2(h)), NC=nc, HEAD_PHI=bool(head_phi),
            BLOCK_N=block_n, DOT=dot,
        )  # fmt: skip
        return (triton.cdiv(n, block_n),), dict(consts, num_warps=warps)

    def _fused_forward(s, ds, v, dv, head_phi, *params):
        n, f = ds.shape
        ds, dv = ds.contiguous(), dv.contiguous()
        s = ds if s is None else s.contiguous()
        v = dv if v is None else v.contiguous()
        has_s, has_v = s is not ds, v is not dv
        params = [p.contiguous() for p in params]
        if head_phi:
            s_out, v_out, out = torch.empty_like(ds), torch.empty_like(dv), ds.new_empty((n, 3 * f))
        else:
            s_out, v_out, out = ds, dv, ds.new_empty((n,))  # not written (STORE_SV=False)
        if n:
            check_launchable(_painn_block_fwd_kernel, ds)
            work = ds.new_empty((n, 4 * f))
            grid, consts = _launch_args(ds, head_phi, params[6:])
            _painn_block_fwd_kernel[grid](
                s, ds, v, dv, *params, s_out, v_out, out, work, n,
                HAS_S=has_s, HAS_V=has_v, STORE_SV=bool(head_phi), **consts,
            )  # fmt: skip
        return (s_out, v_out, out) if head_phi else (out,)

    def _fused_backward(s, ds, v, dv, head_phi, params, g_s_out, g_v_out, g_out):
        n, f = ds.shape
        g_s, g_v = torch.empty_like(ds), torch.empty_like(dv)
        if n:
            s = ds if s is None else s.contiguous()
            v = dv if v is None else v.contiguous()
            grads = [g.to(ds.dtype).contiguous() if g is not None else ds for g in (g_s_out, g_v_out, g_out)]
            check_launchable(_painn_block_bwd_kernel, ds)
            work = ds.new_empty((n, 9 * f))
            grid, consts = _launch_args(ds, head_phi, params[6:])
            _painn_block_bwd_kernel[grid](
                s, ds.contiguous(), v, dv.contiguous(), *params, *grads, g_s, g_v, work, n,
                HAS_S=s is not ds, HAS_V=v is not dv, HAS_GS=g_s_out is not None, HAS_GV=g_v_out is not None,
                HAS_GO=g_out is not None, **consts,
            )  # fmt: skip
        return g_s, g_v

    class _PaiNNBlockFused(torch.autograd.Function):
        """Inference-only: gradients wrt s, Δs, v, Δv; the weights must not require grad; first-order only."""

        @staticmethod
        def forward(ctx, s, ds, v, dv, head_phi, *params):
            if any(ctx.needs_input_grad[5:]):
                raise RuntimeError("the fused PaiNN block is inference-only: its weights must not require grad")
            params = [p.contiguous() for p in params]
            out = _fused_forward(s, ds, v, dv, head_phi, *params)
            ctx.set_materialize_grads(False)  # unused outputs get no zero-filled gradient (HAS_GS/HAS_GV/HAS_GO)
            ctx.head_phi = head_phi
            ctx.has_s, ctx.has_v = s is not None, v is not None
            ctx.save_for_backward(
                ds if s is None else s, ds, dv if v is None else v, dv, *params
            )  # fmt: skip
            if not head_phi:
                return out[0]
            return out

        @staticmethod
        def backward(ctx, *grads):
            s, ds, v, dv, *params = ctx.saved_tensors
            s = s if ctx.has_s else None
            v = v if ctx.has_v else None
            g_s_out, g_v_out, g_out = grads if ctx.head_phi else (None, None, grads[0])
            with torch.no_grad():
                g_s, g_v = _fused_backward(s, ds, v, dv, ctx.head_phi, params, g_s_out, g_v_out, g_out)
            if torch.is_grad_enabled():
                from .painn_update import _FirstOrderOnly

                upstream = [g for g in grads if g is not None]
                g_s, g_v = _FirstOrderOnly.apply(g_s, g_v, ds, dv, *upstream)
            need = ctx.needs_input_grad
            return (
                g_s if need[0] else None, g_s if need[1] else None, g_v if need[2] else None,
                g_v if need[3] else None, None, *([None] * len(params)),
            )  # fmt: skip
