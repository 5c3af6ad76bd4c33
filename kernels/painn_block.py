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
# GPU launch: atoms per program and warps. 16 is the smallest tl.dot row count; the backward holds ~15 live
# [BLOCK_N, F] tiles, which at F = 128 wants 8 warps to stay in registers.
_CONFIG = {"block_n": 16, "num_warps": 8, "max_feat": 128, "dot": "tf32x3"}


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
# Triton path. Weights are nn.Linear's [out, in], row-major. A forward GEMM y = x Wᵀ reads the tile of Wᵀ
# (_wt), a backward one g_x = g_y W the tile of W (_w). Feature axes are padded to powers of two (FP, HP) with
# zeros: padded weight rows/columns and biases load as 0, so every padded column stays 0 (SiLU(0) = 0) and the
# padded rows of ‖vv‖ (sqrt(eps)) only meet zero weights.
# ------------------------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _wt(w_ptr, ld, row0, col0, n_out, n_in, KP: tl.constexpr, NP: tl.constexpr):
        """``[KP, NP]`` tile of Wᵀ: element (k, n) = w[row0 + n, col0 + k] (zero beyond n_in × n_out)."""
        k = tl.arange(0, KP)[:, None]
        n = tl.arange(0, NP)[None, :]
        return tl.load(w_ptr + (row0 + n) * ld + col0 + k, mask=(k < n_in) & (n < n_out), other=0.0)

    @triton.jit
    def _w(w_ptr, ld, row0, col0, n_out, n_in, KP: tl.constexpr, NP: tl.constexpr):
        """``[KP, NP]`` tile of W: element (k, n) = w[row0 + k, col0 + n] (zero beyond n_out × n_in)."""
        k = tl.arange(0, KP)[:, None]
        n = tl.arange(0, NP)[None, :]
        return tl.load(w_ptr + (row0 + k) * ld + col0 + n, mask=(k < n_out) & (n < n_in), other=0.0)

    @triton.jit
    def _vec(ptr, off, n, NP: tl.constexpr):
        """``[1, NP]`` row of a bias (zero beyond n)."""
        j = tl.arange(0, NP)
        return tl.load(ptr + off + j, mask=j < n, other=0.0)[None, :]

    @triton.jit
    def _sigmoid(x):
        return 1.0 / (1.0 + tl.exp(-x))

    @triton.jit
    def _recompute(
        s_ptr, ds_ptr, v_ptr, dv_ptr, uw_ptr, vw_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, row, col, m,
        F: tl.constexpr, FP: tl.constexpr, HAS_S: tl.constexpr, HAS_V: tl.constexpr, DOT: tl.constexpr,
    ):  # fmt: skip
        """The update block of one tile: s_m, v_m, uv_k, vv_k, ‖vv‖, p = Σ_k uv_k vv_k, pre = W1 [s_m|‖vv‖] + b1,
        SiLU(pre) and the three mixing outputs."""
        sf = row * F + col
        s = tl.load(ds_ptr + sf, mask=m, other=0.0)
        if HAS_S:
            s += tl.load(s_ptr + sf, mask=m, other=0.0)
        vf = row * (3 * F) + col
        v0 = tl.load(dv_ptr + vf, mask=m, other=0.0)
        v1 = tl.load(dv_ptr + vf + F, mask=m, other=0.0)
        v2 = tl.load(dv_ptr + vf + 2 * F, mask=m, other=0.0)
        if HAS_V:
            v0 += tl.load(v_ptr + vf, mask=m, other=0.0)
            v1 += tl.load(v_ptr + vf + F, mask=m, other=0.0)
            v2 += tl.load(v_ptr + vf + 2 * F, mask=m, other=0.0)
        ut = _wt(uw_ptr, F, 0, 0, F, F, FP, FP)
        uv0 = tl.dot(v0, ut, input_precision=DOT)
        uv1 = tl.dot(v1, ut, input_precision=DOT)
        uv2 = tl.dot(v2, ut, input_precision=DOT)
        vt = _wt(vw_ptr, F, 0, 0, F, F, FP, FP)
        vv0 = tl.dot(v0, vt, input_precision=DOT)
        vv1 = tl.dot(v1, vt, input_precision=DOT)
        vv2 = tl.dot(v2, vt, input_precision=DOT)
        sq = vv0 * vv0 + vv1 * vv1 + vv2 * vv2 + tl.full(vv0.shape, 1e-8, vv0.dtype)
        if vv0.dtype == tl.float32:
            nrm = tl.sqrt_rn(sq)  # tl.sqrt is the approximate one in float32
        else:
            nrm = tl.sqrt(sq)
        p = uv0 * vv0 + uv1 * vv1 + uv2 * vv2
        pre = tl.dot(s, _wt(w1_ptr, 2 * F, 0, 0, F, F, FP, FP), input_precision=DOT)
        pre += tl.dot(nrm, _wt(w1_ptr, 2 * F, 0, F, F, F, FP, FP), input_precision=DOT)
        pre += _vec(b1_ptr, 0, F, FP)
        h = pre * _sigmoid(pre)
        a_vv = tl.dot(h, _wt(w2_ptr, F, 0, 0, F, F, FP, FP), input_precision=DOT) + _vec(b2_ptr, 0, F, FP)
        a_sv = tl.dot(h, _wt(w2_ptr, F, F, 0, F, F, FP, FP), input_precision=DOT) + _vec(b2_ptr, F, F, FP)
        a_ss = tl.dot(h, _wt(w2_ptr, F, 2 * F, 0, F, F, FP, FP), input_precision=DOT) + _vec(b2_ptr, 2 * F, F, FP)
        return s, v0, v1, v2, uv0, uv1, uv2, vv0, vv1, vv2, nrm, p, pre, a_vv, a_sv, a_ss

    @triton.jit
    def _painn_block_fwd_kernel(
        s_ptr, ds_ptr, v_ptr, dv_ptr, uw_ptr, vw_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr,
        ha_ptr, hba_ptr, hb_ptr, hbb_ptr, s_out_ptr, v_out_ptr, out_ptr, n_atoms,
        F: tl.constexpr, FP: tl.constexpr, H: tl.constexpr, HP: tl.constexpr, HEAD_PHI: tl.constexpr,
        HAS_S: tl.constexpr, HAS_V: tl.constexpr, STORE_SV: tl.constexpr, BLOCK_N: tl.constexpr,
        DOT: tl.constexpr,
    ):  # fmt: skip
        i = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        row = i[:, None]
        col = tl.arange(0, FP)[None, :]
        m = (row < n_atoms) & (col < F)
        s, v0, v1, v2, uv0, uv1, uv2, _vv0, _vv1, _vv2, _nrm, p, _pre, a_vv, a_sv, a_ss = _recompute(
            s_ptr, ds_ptr, v_ptr, dv_ptr, uw_ptr, vw_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, row, col, m,
            F, FP, HAS_S, HAS_V, DOT,
        )  # fmt: skip
        s_o = s + a_ss + a_sv * p
        if STORE_SV:
            tl.store(s_out_ptr + row * F + col, s_o, mask=m)
            vf = row * (3 * F) + col
            tl.store(v_out_ptr + vf, v0 + a_vv * uv0, mask=m)
            tl.store(v_out_ptr + vf + F, v1 + a_vv * uv1, mask=m)
            tl.store(v_out_ptr + vf + 2 * F, v2 + a_vv * uv2, mask=m)
        if HEAD_PHI:
            t = tl.dot(s_o, _wt(ha_ptr, F, 0, 0, F, F, FP, FP), input_precision=DOT) + _vec(hba_ptr, 0, F, FP)
            t = t * _sigmoid(t)
            for k in tl.static_range(3):
                x = tl.dot(t, _wt(hb_ptr, F, k * F, 0, F, F, FP, FP), input_precision=DOT)
                x += _vec(hbb_ptr, k * F, F, FP)
                tl.store(out_ptr + row * (3 * F) + k * F + col, x, mask=m)
        else:
            t = tl.dot(s_o, _wt(ha_ptr, F, 0, 0, H, F, FP, HP), input_precision=DOT) + _vec(hba_ptr, 0, H, HP)
            t = t * _sigmoid(t)
            e = tl.sum(t * _vec(hb_ptr, 0, H, HP), axis=1) + tl.load(hbb_ptr)
            tl.store(out_ptr + i, e, mask=i < n_atoms)

    # Backward, given g_o = ∂L/∂s_o, g_w_k = ∂L/∂v_o_k and the head's upstream gradient (∂L/∂x or ∂L/∂e):
    #   head:    g_t = ∂L/∂x W_b (phi) or ∂L/∂e w_b (readout);  g_o += (g_t ⊙ SiLU'(t_pre)) W_a
    #   mixing:  ∂a_vv = Σ_k g_w_k ⊙ uv_k,  ∂a_sv = g_o ⊙ p,  ∂a_ss = g_o,  ∂p = g_o ⊙ a_sv
    #            ∂pre = ([∂a_vv | ∂a_sv | ∂a_ss] W2) ⊙ SiLU'(pre);  [∂s | ∂‖vv‖] = ∂pre W1
    #   vectors: ∂uv_k = g_w_k ⊙ a_vv + ∂p ⊙ vv_k,  ∂vv_k = ∂p ⊙ uv_k + ∂‖vv‖ ⊙ vv_k / ‖vv‖  (‖vv‖ ≥ 1e-4)
    #   inputs:  ∂s_m = g_o + ∂s,  ∂v_m_k = g_w_k + ∂uv_k U + ∂vv_k V   (= the gradients wrt s and Δs, v and Δv)
    @triton.jit
    def _painn_block_bwd_kernel(
        s_ptr, ds_ptr, v_ptr, dv_ptr, uw_ptr, vw_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr,
        ha_ptr, hba_ptr, hb_ptr, hbb_ptr, gs_ptr, gv_ptr, gout_ptr, g_s_ptr, g_v_ptr, n_atoms,
        F: tl.constexpr, FP: tl.constexpr, H: tl.constexpr, HP: tl.constexpr, HEAD_PHI: tl.constexpr,
        HAS_S: tl.constexpr, HAS_V: tl.constexpr, HAS_GS: tl.constexpr, HAS_GV: tl.constexpr,
        HAS_GO: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr,
    ):  # fmt: skip
        i = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        row = i[:, None]
        col = tl.arange(0, FP)[None, :]
        m = (row < n_atoms) & (col < F)
        s, _v0, _v1, _v2, uv0, uv1, uv2, vv0, vv1, vv2, nrm, p, pre, a_vv, a_sv, a_ss = _recompute(
            s_ptr, ds_ptr, v_ptr, dv_ptr, uw_ptr, vw_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, row, col, m,
            F, FP, HAS_S, HAS_V, DOT,
        )  # fmt: skip
        sf = row * F + col
        g_o = tl.zeros((BLOCK_N, FP), dtype=s.dtype)
        if HAS_GS:
            g_o += tl.load(gs_ptr + sf, mask=m, other=0.0)
        if HAS_GO:
            s_o = s + a_ss + a_sv * p
            if HEAD_PHI:
                t = tl.dot(s_o, _wt(ha_ptr, F, 0, 0, F, F, FP, FP), input_precision=DOT) + _vec(hba_ptr, 0, F, FP)
                g_t = tl.zeros((BLOCK_N, FP), dtype=s.dtype)
                for k in tl.static_range(3):
                    g_x = tl.load(gout_ptr + row * (3 * F) + k * F + col, mask=m, other=0.0)
                    g_t += tl.dot(g_x, _w(hb_ptr, F, k * F, 0, F, F, FP, FP), input_precision=DOT)
                sg = _sigmoid(t)
                g_t = g_t * (sg * (1.0 + t * (1.0 - sg)))
                g_o += tl.dot(g_t, _w(ha_ptr, F, 0, 0, F, F, FP, FP), input_precision=DOT)
            else:
                t = tl.dot(s_o, _wt(ha_ptr, F, 0, 0, H, F, FP, HP), input_precision=DOT) + _vec(hba_ptr, 0, H, HP)
                g_e = tl.load(gout_ptr + i, mask=i < n_atoms, other=0.0)
                sg = _sigmoid(t)
                g_t = g_e[:, None] * _vec(hb_ptr, 0, H, HP) * (sg * (1.0 + t * (1.0 - sg)))
                g_o += tl.dot(g_t, _w(ha_ptr, F, 0, 0, H, F, HP, FP), input_precision=DOT)
        vf = row * (3 * F) + col
        if HAS_GV:
            gw0 = tl.load(gv_ptr + vf, mask=m, other=0.0)
            gw1 = tl.load(gv_ptr + vf + F, mask=m, other=0.0)
            gw2 = tl.load(gv_ptr + vf + 2 * F, mask=m, other=0.0)
            g_avv = gw0 * uv0 + gw1 * uv1 + gw2 * uv2
        else:
            gw0 = tl.zeros((BLOCK_N, FP), dtype=s.dtype)
            gw1 = gw0
            gw2 = gw0
            g_avv = gw0
        g_p = g_o * a_sv
        g_h = tl.dot(g_avv, _w(w2_ptr, F, 0, 0, F, F, FP, FP), input_precision=DOT)
        g_h += tl.dot(g_o * p, _w(w2_ptr, F, F, 0, F, F, FP, FP), input_precision=DOT)
        g_h += tl.dot(g_o, _w(w2_ptr, F, 2 * F, 0, F, F, FP, FP), input_precision=DOT)
        sg = _sigmoid(pre)
        g_pre = g_h * (sg * (1.0 + pre * (1.0 - sg)))
        g_s = g_o + tl.dot(g_pre, _w(w1_ptr, 2 * F, 0, 0, F, F, FP, FP), input_precision=DOT)
        tl.store(g_s_ptr + sf, g_s, mask=m)
        r = tl.dot(g_pre, _w(w1_ptr, 2 * F, 0, F, F, F, FP, FP), input_precision=DOT) / nrm
        u = _w(uw_ptr, F, 0, 0, F, F, FP, FP)
        w = _w(vw_ptr, F, 0, 0, F, F, FP, FP)
        g0 = gw0 + tl.dot(gw0 * a_vv + g_p * vv0, u, input_precision=DOT)
        g0 += tl.dot(g_p * uv0 + r * vv0, w, input_precision=DOT)
        tl.store(g_v_ptr + vf, g0, mask=m)
        g1 = gw1 + tl.dot(gw1 * a_vv + g_p * vv1, u, input_precision=DOT)
        g1 += tl.dot(g_p * uv1 + r * vv1, w, input_precision=DOT)
        tl.store(g_v_ptr + vf + F, g1, mask=m)
        g2 = gw2 + tl.dot(gw2 * a_vv + g_p * vv2, u, input_precision=DOT)
        g2 += tl.dot(g_p * uv2 + r * vv2, w, input_precision=DOT)
        tl.store(g_v_ptr + vf + 2 * F, g2, mask=m)

    def _launch_args(ds: Tensor, head_phi: bool, head_params) -> tuple[tuple, dict]:
        n, f = ds.shape
        h = f if head_phi else head_params[0].shape[0]
        cuda = ds.is_cuda
        if cuda:
            block_n, warps = _CONFIG["block_n"], _CONFIG["num_warps"]
        else:  # the interpreter pays per program: few large tiles
            block_n, warps = max(16, min(128, triton.next_power_of_2(max(n, 1)))), 4
        dot = _CONFIG["dot"] if cuda and ds.dtype == torch.float32 else "ieee"
        consts = dict(
            F=f, FP=max(16, triton.next_power_of_2(f)), H=h, HP=max(16, triton.next_power_of_2(h)),
            HEAD_PHI=bool(head_phi), BLOCK_N=block_n, DOT=dot,
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
            grid, consts = _launch_args(ds, head_phi, params[6:])
            _painn_block_fwd_kernel[grid](
                s, ds, v, dv, *params, s_out, v_out, out, n,
                HAS_S=has_s, HAS_V=has_v, STORE_SV=bool(head_phi), **consts,
            )  # fmt: skip
        return (s_out, v_out, out) if head_phi else (out,)

    def _fused_backward(s, ds, v, dv, head_phi, params, g_s_out, g_v_out, g_out):
        n = ds.shape[0]
        g_s, g_v = torch.empty_like(ds), torch.empty_like(dv)
        if n:
            s = ds if s is None else s.contiguous()
            v = dv if v is None else v.contiguous()
            grads = [g.to(ds.dtype).contiguous() if g is not None else ds for g in (g_s_out, g_v_out, g_out)]
            check_launchable(_painn_block_bwd_kernel, ds)
            grid, consts = _launch_args(ds, head_phi, params[6:])
            _painn_block_bwd_kernel[grid](
                s, ds.contiguous(), v, dv.contiguous(), *params, *grads, g_s, g_v, n,
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
