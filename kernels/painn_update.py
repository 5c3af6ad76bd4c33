"""PaiNN update block: atom-wise mixing of scalar and vector channels, fused for inference.

With s ``[N,F]``, v ``[N,3,F]`` and k = x, y, z:
    uv_k, vv_k   = U v_k, V v_k                          (bias-free linear maps on the feature axis)
    ‖vv‖         = sqrt(Σ_k vv_k² + 1e-8)                (+1e-8 keeps it differentiable at v = 0, the first layer)
    (a_vv, a_sv, a_ss) = W2 SiLU(W1 [s | ‖vv‖] + b1) + b2    three ``[N,F]`` blocks
    s_out        = s + a_ss + a_sv ⊙ Σ_k uv_k ⊙ vv_k
    v_out_k      = v_k + a_vv ⊙ uv_k
Run as plain torch this is ~17 kernels forward and ~25 backward per layer, nearly all of them small elementwise
ops and reductions over k. The fused path keeps the four GEMMs on cuBLAS (``torch.mm``/``addmm``; U and V as one
GEMM over the ``[3N, F]`` view of v) and does everything around them in two Triton kernels each way.

It is for inference only: its backward gives the gradients wrt s and v (forces need nothing else), not wrt the
weights, and it is first-order: differentiating it twice raises. :func:`painn_update_fusable` states when it may run;
:func:`painn_update` dispatches on it. The torch reference :func:`painn_update_reference` is the specification,
the test oracle and what the model runs otherwise (training, torch.compile, the torch backend).

A model's last layer needs s_out only (its readout reads s): with ``need_v=False`` neither path makes a_vv or v_out,
and the mixing MLP's last GEMM runs over the a_sv, a_ss rows of W2, b2 (2F wide instead of 3F).

The block's input may be given as a residual sum, ``s + ds`` and ``v + dv`` (the message block's output): the
fused path then adds inside its kernels (the norm kernel, the U/V GEMM's prologue, the out kernel) the same
rounded sums that two torch adds would have stored, so those two launches go, and its backward hands the same
gradient to both terms.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as nnf

from ._backend import resolve_backend
from ._frozen import derived
from ._triton_utils import (
    _TUNING,
    HAS_TRITON,
    FirstOrderOnly,
    cdiv,
    check_launchable,
    next_pow2,
    num_warps,
    pdl_args,
    pdl_prologue,
    tl,
    triton,
    unspecialized,
)
from .linear import _NORM_EPS, gemm, gemm_fusable, resolved_dot, tma_norm_prologue

__all__ = ["painn_update", "painn_update_fusable", "painn_update_reference"]

# Added to Σ_k vv_k² under the square root (the model's constant; changing it changes the model). One definition,
# in linear.py beside _norm_of, the kernels' ‖vv‖ (the norm kernel's and the GEMM's norm prologue's).
_EPS = _NORM_EPS
_DTYPES = (torch.float32, torch.float64)


def painn_update_reference(
    s: Tensor,
    v: Tensor,
    u_w: Tensor,
    v_w: Tensor,
    w1: Tensor,
    b1: Tensor,
    w2: Tensor,
    b2: Tensor,
    *,
    ds: Tensor | None = None,
    dv: Tensor | None = None,
    need_v: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """Torch reference of the update block: ``s [N,F]``, ``v [N,3,F]`` → ``s_out [N,F]``, ``v_out [N,3,F]``.

    ``u_w``, ``v_w`` ``[F,F]`` (U, V), ``w1 [F,2F]``, ``b1 [F]``, ``w2 [3F,F]``, ``b2 [3F]`` (the mixing MLP), as
    stored by ``nn.Linear``. Numerically the same ops as ``PaiNNUpdate``'s torch path. With ``ds`` / ``dv`` the
    block's input is ``s + ds`` / ``v + dv``. ``need_v`` False (a model's last layer, whose v nobody reads): v_out
    is None and a_vv is not made (the MLP's last layer keeps the rows of a_sv and a_ss only).
    """
    if ds is not None:
        s = s + ds
    if dv is not None:
        v = v + dv
    f = s.shape[-1]
    uv, vv = nnf.linear(v, u_w), nnf.linear(v, v_w)
    vnorm = torch.sqrt((vv * vv).sum(dim=1) + _EPS)
    h = nnf.silu(nnf.linear(torch.cat([s, vnorm], dim=-1), w1, b1))
    if not need_v:
        a_sv, a_ss = torch.split(nnf.linear(h, w2[f:], b2[f:]), f, dim=-1)
        return s + a_ss + a_sv * (uv * vv).sum(dim=1), None
    a_vv, a_sv, a_ss = torch.split(nnf.linear(h, w2, b2), f, dim=-1)
    return s + a_ss + a_sv * (uv * vv).sum(dim=1), v + a_vv.unsqueeze(1) * uv


def painn_update_fusable(s: Tensor, v: Tensor, *params: Tensor) -> bool:
    """Whether the fused inference path may run for these inputs and the block's parameters.

    All of: the kernel backend resolves to ``triton`` for the device, no parameter requires grad (the inference
    engine freezes its model; training needs weight gradients and the double backward of the torch path), not
    inside torch.compile (which fuses the torch path itself), and s, v and the parameters share one device and one
    dtype, float32 or float64. Host-side checks only (no device sync), so safe inside CUDA-graph capture.
    ``params`` may end with the residual terms ``ds`` / ``dv`` (they too may require grad).
    """
    if torch.compiler.is_compiling() or s.dtype not in _DTYPES or v.dtype != s.dtype or v.device != s.device:
        return False
    if any(p.requires_grad or p.dtype != s.dtype or p.device != s.device for p in params[:6]):
        return False
    if any(d.dtype != s.dtype or d.device != s.device for d in params[6:]):
        return False
    return resolve_backend(s.device) == "triton"


def painn_update(
    s: Tensor,
    v: Tensor,
    u_w: Tensor,
    v_w: Tensor,
    w1: Tensor,
    b1: Tensor,
    w2: Tensor,
    b2: Tensor,
    *,
    ds: Tensor | None = None,
    dv: Tensor | None = None,
    need_v: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """The update block (see the module docstring) of ``s [N,F]`` (plus ``ds [N,F]`` when given) and ``v [N,3,F]``
    (plus ``dv [N,3,F]``): fused Triton path when :func:`painn_update_fusable` says so, else the torch reference.
    Returns ``s_out [N,F]``, ``v_out [N,3,F]``; with ``need_v`` False (the last layer: nothing reads its v) v_out
    is None and neither path makes a_vv or v_out (the mixing MLP's last GEMM 2F wide, not 3F)."""
    _check_inputs(s, v, u_w, v_w, w1, b1, w2, b2)
    for name, d, ref in (("ds", ds, s), ("dv", dv, v)):
        if d is not None and d.shape != ref.shape:
            raise ValueError(f"{name} must have the shape of its term, {list(ref.shape)}, got {list(d.shape)}")
    deltas = [d for d in (ds, dv) if d is not None]
    if painn_update_fusable(s, v, u_w, v_w, w1, b1, w2, b2, *deltas):
        if not HAS_TRITON:  # pragma: no cover - resolve_backend never says "triton" then
            raise RuntimeError("the fused update block needs triton installed; use MLFF_DISTILLER_KERNELS=torch")
        out = _PaiNNUpdateFused.apply(s, v, u_w, v_w, w1, b1, w2, b2, ds, dv, bool(need_v))
        return out if need_v else (out, None)
    return painn_update_reference(s, v, u_w, v_w, w1, b1, w2, b2, ds=ds, dv=dv, need_v=need_v)


def _check_inputs(s, v, u_w, v_w, w1, b1, w2, b2) -> None:
    """Shapes only (host-side)."""
    if s.dim() != 2 or v.dim() != 3 or v.shape != (s.shape[0], 3, s.shape[1]):
        raise ValueError(f"s must be [N, F] and v [N, 3, F], got {tuple(s.shape)} and {tuple(v.shape)}")
    f = s.shape[1]
    want = {"u_w": (f, f), "v_w": (f, f), "w1": (f, 2 * f), "b1": (f,), "w2": (3 * f, f), "b2": (3 * f,)}
    for (name, shape), t in zip(want.items(), (u_w, v_w, w1, b1, w2, b2), strict=True):
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must be {list(shape)} for F = {f}, got {list(t.shape)}")


def _stacked_uv(u_w: Tensor, v_w: Tensor) -> Tensor:
    """``torch.cat([u_w, v_w])`` ``[2F, F]``, made once while neither weight changes (concatenating them anew cost a
    launch per layer per step; see :mod:`._frozen` for when the kept copy is refreshed)."""
    return derived("uv", _cat2, u_w, v_w)


def _cat2(u_w: Tensor, v_w: Tensor) -> Tensor:
    return torch.cat([u_w, v_w])


def _tail(w: Tensor) -> Tensor:
    """Rows F.. of the mixing MLP's last weight ``[3F, F]`` or bias ``[3F]`` (a_sv, a_ss), as a tensor of its own,
    made once per weight version (:func:`.derived`), so that the GEMMs' frozen-weight forms are made once too."""
    return derived("tail", _rows_from_third, w)


def _rows_from_third(w: Tensor) -> Tensor:
    return w[w.shape[0] // 3 :].contiguous()


# ------------------------------------------------------------------------------------------------------------
# Triton path. Buffers (row-major):
#   uvvv [3N, 2F]  row 3i+k = [uv_k | vv_k] of atom i (one GEMM: v.view(3N, F) @ [U; V]ᵀ)
#   x    [N, 2F]   [s | ‖vv‖], the MLP input (written by the norm kernel: no torch.cat)
#   pre  [N, F]    W1 x + b1;   mix [N, 3F] = [a_vv | a_sv | a_ss] = W2 SiLU(pre) + b2
# Forward: mm · norm kernel · addmm · silu · addmm · out kernel (6 launches; [U; V] is concatenated once per weight
# version); with the Triton GEMMs of linear.py (float32 on the GPU; SiLU in the epilogue) 5.
# Backward: out-bwd kernel · mm · silu_backward · mm · norm-bwd kernel · addmm_ (6 launches); with the Triton GEMMs
# (SiLU' in the prologue) 5.
# Each kernel program owns a [BLOCK_N atoms, BLOCK_F features] tile; F need not be a power of two (masks).
# ------------------------------------------------------------------------------------------------------------

# Launch of the update block's elementwise kernels on the GPU: elements per float32 tile (half for float64) and
# warps per program (None: the package's num_warps). 256 elements (4 atoms x 64 features at 4 warps): the whole
# step 1.005-1.033x against the 1,024 of stops 14-42, two rounds in one H200 call, the small graphs gaining most
# (benzene 1.033, 192 water atoms 1.021, 1,024 g2 molecules 1.014, 4,096 1.007, 3,000 water atoms 1.005); 2,048
# and 4,096 were slower, 8 warps and 2 warps no better (benchmarks/results/stop43_gpu/probe_ncu_sweep_update*.md);
# 512 and 128 measured 0.985-1.004x at stop 56 (benchmarks/results/stop56_gpu/j/).
_CONFIG: dict = {
    "elems": 256,
    "num_warps": None,
    # Stop 48's one-kernel forms (U/V GEMM + norm kernel, second MLP GEMM + out kernel, g_x GEMM + norm backward)
    # were slower at stop 49 (H200 step, shipped/variant, benzene & 192 water atoms: 0.948 & 0.978, 0.977 & 0.992,
    # ~1.00, all three 0.933 & 0.973, narrower tiles 0.930 & 0.929) and were dropped (benchmarks/results/stop49_gpu:
    # probe_ncu_sweep_48b.md, gx_norm's second round probe_ncu_sweep_49b.md; one_kernel_forms_dropped.diff).
    # From this many atoms on, the backward makes uvvv [3N, 2F] again (one GEMM of the U/V product, as the forward
    # made it) instead of keeping it from the forward: 3 kB per atom and layer less at a large step's peak memory
    # (stop 47's probe: every layer's uvvv was alive at the peak, 9 of ~52 kB per atom at 1M water atoms), for one
    # more GEMM per layer in the backward. None: always kept. Measured at stop 49 (H200, eager water, from 0 atoms):
    # peak 1.350 -> 1.199 GB at 24,000 atoms, 51.4 -> 45.5 GB at 1,000,002, for 0.973-0.977x of the 24,000-atom
    # step (benchmarks/results/stop49_gpu/probe_memory_peak_recompute.md, probe_ncu_sweep_recompute24k.md). Off:
    # 1M atoms fit in 80 GB without it; set it to fit a box ~12 % larger.
    "recompute_uv_min_atoms": None,
    # norm_in_gemm: on the Triton GEMMs, the mixing MLP's first GEMM makes its input [s + ds | ‖vv‖] in its load
    # (linear.gemm's prologue_norm) from s, ds and the [U; V] rows, so the norm kernel and its [N, 2F] output go
    # (the backward takes ‖vv‖ again from the vv rows it loads anyway). The norm kernel's bytes were ~7 N·F floats
    # a layer (26 µs of a 4,096-g2-molecule step's layer on an H200, stop 61's kernel table). Built at stop 62.
    # H200 whole step, on against off (stop 63, benchmarks/results/stop63_gpu/a/): 4,096 g2 molecules 1.010x,
    # 24,000 water atoms 1.006x, but 192 water atoms 0.955x, benzene 0.979x, 3,000 atoms and 1,024 g2 molecules
    # 0.997-0.998x; so only from norm_in_gemm_min_atoms on (b/: with the two switches below, 1.029x at 4,096 g2
    # molecules, 1.007x at 24,000 atoms, 1.001-1.008x on the rest).
    "norm_in_gemm": True,
    # ...from this many atoms on: below it the GEMM's few programs compute the norms that the norm kernel
    # spreads over many (4,096 g2 molecules are ~21,700 atoms, 1,024 ~5,400). And only on the GEMM's descriptor
    # kernel (captured steps; eager ones from linear's tma_eager_min_rows): see _norm_in_gemm.
    "norm_in_gemm_min_atoms": 8192,
    # gv_as_addend: on the Triton GEMMs the backward's last GEMM (g_v = g_v_out + [∂uv | ∂vv] [U; V]) takes g_v_out
    # as its epilogue's addend (linear.gemm's addend: the same sum, the same bits) instead of accumulating into a
    # copy the norm backward made: that kernel reads and writes 3 N·F floats fewer a layer (of its 20). Built at
    # stop 62; H200 whole step at stop 63 (stop63_gpu/a/, b/): 1.004-1.017x on every system of two sweeps.
    "gv_as_addend": True,
    # dvv_in_norm_bwd: ∂vv_k = g_s ⊙ a_sv ⊙ uv_k + (∂‖vv‖ / ‖vv‖) ⊙ vv_k written once by the norm backward (which
    # then reads uv and a_sv) instead of its first term by the out backward and the second added to it: 3 N·F
    # floats fewer a layer of the two kernels' 41. Built at stop 62; H200 whole step at stop 63 (stop63_gpu/a/,
    # b/): alone 0.994-1.004x; over gv_as_addend 1.003x at 4,096 g2 molecules (1.029x with all three against
    # 1.021x without it), within the noise elsewhere (0.994-1.002x). On: it moves fewer bytes.
    "dvv_in_norm_bwd": True,
}

if HAS_TRITON:
    from ._gemm_kernels import _norm_of  # ‖vv‖ as the first GEMM's norm prologue computes it

    @triton.jit
    def _tile(n_atoms, N_FEAT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        f = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
        m = (i < n_atoms)[:, None] & (f < N_FEAT)[None, :]
        return i[:, None], f[None, :], m

    @triton.jit(**unspecialized("n_atoms"))
    def _painn_update_norm_kernel(
        s_ptr,
        ds_ptr,
        uvvv_ptr,
        x_ptr,
        n_atoms,
        N_FEAT: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_F: tl.constexpr,
        HAS_DS: tl.constexpr,
        PDL: tl.constexpr,
    ):
        pdl_prologue(PDL)
        i, f, m = _tile(n_atoms, N_FEAT, BLOCK_N, BLOCK_F)
        vv = uvvv_ptr + i * (6 * N_FEAT) + N_FEAT + f
        vv0 = tl.load(vv, mask=m, other=0.0)
        vv1 = tl.load(vv + 2 * N_FEAT, mask=m, other=0.0)
        vv2 = tl.load(vv + 4 * N_FEAT, mask=m, other=0.0)
        norm = _norm_of(vv0, vv1, vv2)  # (the GEMM's norm prologue computes it so too: norm_in_gemm)
        x = x_ptr + i * (2 * N_FEAT) + f
        tl.store(x, _load_sum(s_ptr, ds_ptr, i * N_FEAT + f, m, HAS_DS), mask=m)
        tl.store(x + N_FEAT, norm, mask=m)

    @triton.jit
    def _load_sum(a_ptr, d_ptr, offs, m, HAS_D: tl.constexpr):
        """``a + d`` at ``offs`` (the residual sum of the block's input, rounded once like a torch add), or ``a``."""
        a = tl.load(a_ptr + offs, mask=m, other=0.0)
        if HAS_D:
            a = a + tl.load(d_ptr + offs, mask=m, other=0.0)
        return a

    @triton.jit
    def _load_uvvv(uvvv_ptr, i, f, m, N_FEAT: tl.constexpr):
        """The six ``[BLOCK_N, BLOCK_F]`` tiles uv_k, vv_k (k = 0, 1, 2) of rows ``i`` of the ``[N, 3, 2F]`` GEMM
        output (per row: uv_0, vv_0, uv_1, vv_1, uv_2, vv_2, F apart)."""
        uv = uvvv_ptr + i * (6 * N_FEAT) + f
        uv0 = tl.load(uv, mask=m, other=0.0)
        vv0 = tl.load(uv + N_FEAT, mask=m, other=0.0)
        uv1 = tl.load(uv + 2 * N_FEAT, mask=m, other=0.0)
        vv1 = tl.load(uv + 3 * N_FEAT, mask=m, other=0.0)
        uv2 = tl.load(uv + 4 * N_FEAT, mask=m, other=0.0)
        vv2 = tl.load(uv + 5 * N_FEAT, mask=m, other=0.0)
        return uv0, vv0, uv1, vv1, uv2, vv2

    @triton.jit(**unspecialized("n_atoms"))
    def _painn_update_out_kernel(
        s_ptr,
        ds_ptr,
        v_ptr,
        dv_ptr,
        uvvv_ptr,
        mix_ptr,
        s_out_ptr,
        v_out_ptr,
        n_atoms,
        N_FEAT: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_F: tl.constexpr,
        HAS_DS: tl.constexpr,
        HAS_DV: tl.constexpr,
        PDL: tl.constexpr,
        VOUT: tl.constexpr = True,
    ):
        # VOUT False (the last layer): mix is [N, 2F] = [a_sv | a_ss] and only s_out is written.
        pdl_prologue(PDL)
        i, f, m = _tile(n_atoms, N_FEAT, BLOCK_N, BLOCK_F)
        if VOUT:
            mix = mix_ptr + i * (3 * N_FEAT) + f
            a_vv = tl.load(mix, mask=m, other=0.0)
            a_sv = tl.load(mix + N_FEAT, mask=m, other=0.0)
            a_ss = tl.load(mix + 2 * N_FEAT, mask=m, other=0.0)
        else:
            mix = mix_ptr + i * (2 * N_FEAT) + f
            a_vv = tl.zeros([BLOCK_N, BLOCK_F], s_out_ptr.dtype.element_ty)  # unused
            a_sv = tl.load(mix, mask=m, other=0.0)
            a_ss = tl.load(mix + N_FEAT, mask=m, other=0.0)
        _out_store(s_ptr, ds_ptr, v_ptr, dv_ptr, uvvv_ptr, s_out_ptr, v_out_ptr, i, f, m, a_vv, a_sv, a_ss,
                   N_FEAT, HAS_DS, HAS_DV, VOUT)  # fmt: skip

    @triton.jit
    def _out_store(
        s_ptr, ds_ptr, v_ptr, dv_ptr, uvvv_ptr, s_out_ptr, v_out_ptr, i, f, m, a_vv, a_sv, a_ss,
        N_FEAT: tl.constexpr, HAS_DS: tl.constexpr, HAS_DV: tl.constexpr, VOUT: tl.constexpr = True,
    ):  # fmt: skip
        """s_out = s + a_ss + a_sv ⊙ Σ_k uv_k ⊙ vv_k and v_out_k = v_k + a_vv ⊙ uv_k for the tile ``(i, f, m)``, given
        its three mix coefficients (the out kernel's work); VOUT False: s_out only."""
        uv0, vv0, uv1, vv1, uv2, vv2 = _load_uvvv(uvvv_ptr, i, f, m, N_FEAT)
        sf = i * N_FEAT + f
        s = _load_sum(s_ptr, ds_ptr, sf, m, HAS_DS)
        tl.store(s_out_ptr + sf, s + a_ss + a_sv * (uv0 * vv0 + uv1 * vv1 + uv2 * vv2), mask=m)
        if VOUT:
            vf = i * (3 * N_FEAT) + f
            tl.store(v_out_ptr + vf, _load_sum(v_ptr, dv_ptr, vf, m, HAS_DV) + a_vv * uv0, mask=m)
            tl.store(v_out_ptr + vf + N_FEAT, _load_sum(v_ptr, dv_ptr, vf + N_FEAT, m, HAS_DV) + a_vv * uv1, mask=m)
            v2 = _load_sum(v_ptr, dv_ptr, vf + 2 * N_FEAT, m, HAS_DV)
            tl.store(v_out_ptr + vf + 2 * N_FEAT, v2 + a_vv * uv2, mask=m)

    # VJP of the out kernel, given g_s = ∂L/∂s_out and g_v = ∂L/∂v_out (g_s also flows to s unchanged, added in
    # the norm backward; without HAS_GV, g_v is 0: v_out was not used, and autograd passes None, not zeros):
    #   ∂a_vv = Σ_k g_v_k ⊙ uv_k      ∂a_sv = g_s ⊙ Σ_k uv_k ⊙ vv_k      ∂a_ss = g_s
    #   ∂uv_k = g_v_k ⊙ a_vv + g_s ⊙ a_sv ⊙ vv_k      ∂vv_k = g_s ⊙ a_sv ⊙ uv_k   (the norm backward adds its term)
    @triton.jit(**unspecialized("n_atoms"))
    def _painn_update_out_bwd_kernel(
        gs_ptr,
        gv_ptr,
        uvvv_ptr,
        mix_ptr,
        g_mix_ptr,
        g_uvvv_ptr,
        n_atoms,
        N_FEAT: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_F: tl.constexpr,
        HAS_GV: tl.constexpr,
        PDL: tl.constexpr,
        VOUT: tl.constexpr = True,
        VV: tl.constexpr = True,
    ):
        # VOUT False (the last layer, no a_vv): mix and g_mix are [N, 2F] = [a_sv | a_ss]; HAS_GV is then False.
        # VV False (dvv_in_norm_bwd): ∂vv is left to the norm backward, which writes both of its terms.
        pdl_prologue(PDL)
        i, f, m = _tile(n_atoms, N_FEAT, BLOCK_N, BLOCK_F)
        uv0, vv0, uv1, vv1, uv2, vv2 = _load_uvvv(uvvv_ptr, i, f, m, N_FEAT)
        if VOUT:
            mix = mix_ptr + i * (3 * N_FEAT) + N_FEAT + f  # a_sv
            g_mix = g_mix_ptr + i * (3 * N_FEAT) + N_FEAT + f  # ∂a_sv; ∂a_vv F before
        else:
            mix = mix_ptr + i * (2 * N_FEAT) + f
            g_mix = g_mix_ptr + i * (2 * N_FEAT) + f
        a_sv = tl.load(mix, mask=m, other=0.0)
        gs = tl.load(gs_ptr + i * N_FEAT + f, mask=m, other=0.0)
        tl.store(g_mix, gs * (uv0 * vv0 + uv1 * vv1 + uv2 * vv2), mask=m)
        tl.store(g_mix + N_FEAT, gs, mask=m)
        c = gs * a_sv
        g_uv = g_uvvv_ptr + i * (6 * N_FEAT) + f
        if HAS_GV:
            a_vv = tl.load(mix - N_FEAT, mask=m, other=0.0)
            gv = gv_ptr + i * (3 * N_FEAT) + f
            gv0 = tl.load(gv, mask=m, other=0.0)
            gv1 = tl.load(gv + N_FEAT, mask=m, other=0.0)
            gv2 = tl.load(gv + 2 * N_FEAT, mask=m, other=0.0)
            tl.store(g_mix - N_FEAT, gv0 * uv0 + gv1 * uv1 + gv2 * uv2, mask=m)
            tl.store(g_uv, gv0 * a_vv + c * vv0, mask=m)
            tl.store(g_uv + 2 * N_FEAT, gv1 * a_vv + c * vv1, mask=m)
            tl.store(g_uv + 4 * N_FEAT, gv2 * a_vv + c * vv2, mask=m)
        else:  # the terms of g_v are exact zeros: (±0) + c·vv_k = c·vv_k
            if VOUT:
                tl.store(g_mix - N_FEAT, tl.zeros([BLOCK_N, BLOCK_F], a_sv.dtype), mask=m)
            tl.store(g_uv, c * vv0, mask=m)
            tl.store(g_uv + 2 * N_FEAT, c * vv1, mask=m)
            tl.store(g_uv + 4 * N_FEAT, c * vv2, mask=m)
        if VV:
            tl.store(g_uv + N_FEAT, c * uv0, mask=m)
            tl.store(g_uv + 3 * N_FEAT, c * uv1, mask=m)
            tl.store(g_uv + 5 * N_FEAT, c * uv2, mask=m)

    # VJP of the norm kernel, given g_x = ∂L/∂[s | ‖vv‖] (= ∂pre @ W1):
    #   ∂s = g_s_out + g_x[:, :F]      ∂vv_k += g_x[:, F:] ⊙ vv_k / ‖vv‖   (‖vv‖ ≥ 1e-4: no division by zero)
    # It also copies g_v_out into the buffer that the last GEMM then accumulates into in place (addmm_), which
    # saves that GEMM's own copy of its C operand (one launch less); without HAS_GV (g_v_out = 0) the GEMM writes.
    @triton.jit(**unspecialized("n_atoms"))
    def _painn_update_norm_bwd_kernel(
        gs_out_ptr,
        gv_out_ptr,
        g_x_ptr,
        uvvv_ptr,
        x_ptr,
        g_s_ptr,
        g_v_ptr,
        g_uvvv_ptr,
        mix_ptr,
        n_atoms,
        N_FEAT: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_F: tl.constexpr,
        HAS_GV: tl.constexpr,
        PDL: tl.constexpr,
        NORM_VV: tl.constexpr = False,
        DVV: tl.constexpr = False,
        MIX3: tl.constexpr = True,
    ):
        # NORM_VV (norm_in_gemm: no x was stored): ‖vv‖ from the vv rows, as the first GEMM's prologue made it.
        # HAS_GV: copy g_v_out into g_v (the last GEMM accumulates there; not with gv_as_addend). DVV
        # (dvv_in_norm_bwd): write ∂vv_k = c ⊙ uv_k + r ⊙ vv_k whole, c = g_s_out ⊙ a_sv (a_sv at column F of a
        # [N, 3F] mix, MIX3, or 0 of the last layer's [N, 2F]), where the out backward wrote none of it.
        pdl_prologue(PDL)
        i, f, m = _tile(n_atoms, N_FEAT, BLOCK_N, BLOCK_F)
        sf = i * N_FEAT + f
        g_x = g_x_ptr + i * (2 * N_FEAT) + f
        gs_out = tl.load(gs_out_ptr + sf, mask=m, other=0.0)
        g_s = gs_out + tl.load(g_x, mask=m, other=0.0)
        tl.store(g_s_ptr + sf, g_s, mask=m)
        vf = i * (6 * N_FEAT) + N_FEAT + f
        vv0 = tl.load(uvvv_ptr + vf, mask=m, other=0.0)
        vv1 = tl.load(uvvv_ptr + vf + 2 * N_FEAT, mask=m, other=0.0)
        vv2 = tl.load(uvvv_ptr + vf + 4 * N_FEAT, mask=m, other=0.0)
        if NORM_VV:
            norm = _norm_of(vv0, vv1, vv2)
        else:
            norm = tl.load(x_ptr + i * (2 * N_FEAT) + N_FEAT + f, mask=m, other=1.0)
        r = tl.load(g_x + N_FEAT, mask=m, other=0.0) / norm
        if DVV:
            if MIX3:
                a_sv = tl.load(mix_ptr + i * (3 * N_FEAT) + N_FEAT + f, mask=m, other=0.0)
            else:
                a_sv = tl.load(mix_ptr + i * (2 * N_FEAT) + f, mask=m, other=0.0)
            c = gs_out * a_sv  # (the out backward's c)
        else:
            c = r  # unread
        _store_dvv(g_uvvv_ptr, uvvv_ptr, vf, vv0, c, r, m, N_FEAT, DVV)
        _store_dvv(g_uvvv_ptr, uvvv_ptr, vf + 2 * N_FEAT, vv1, c, r, m, N_FEAT, DVV)
        _store_dvv(g_uvvv_ptr, uvvv_ptr, vf + 4 * N_FEAT, vv2, c, r, m, N_FEAT, DVV)
        if HAS_GV:
            gvf = i * (3 * N_FEAT) + f
            for k in tl.static_range(3):
                tl.store(g_v_ptr + gvf + k * N_FEAT, tl.load(gv_out_ptr + gvf + k * N_FEAT, mask=m, other=0.0), mask=m)

    @triton.jit
    def _store_dvv(g_uvvv_ptr, uvvv_ptr, offs, vv, c, r, m, N_FEAT: tl.constexpr, DVV: tl.constexpr):
        """∂vv_k at ``offs`` (the vv half of one of an atom's three [uv | vv] rows) with the norm's term r ⊙ vv_k:
        added to the out backward's c ⊙ uv_k there, or (DVV) both terms written here, uv_k F entries before."""
        g = g_uvvv_ptr + offs
        if DVV:
            first = c * tl.load(uvvv_ptr + offs - N_FEAT, mask=m, other=0.0)
        else:
            first = tl.load(g, mask=m, other=0.0)
        tl.store(g, first + r * vv, mask=m)

    def _launch(kernel, t: Tensor, n: int, f: int, *args, **flags) -> None:
        """One program per ``[BLOCK_N, BLOCK_F]`` tile of atoms × features (``flags``: the kernel's constexpr
        switches); nothing to do when N = 0."""
        if n == 0 or f == 0:
            return
        check_launchable(kernel, t)
        block_f = next_pow2(f)
        if t.is_cuda:
            # ~13 live [BLOCK_N, BLOCK_F] values in the backward kernel: at most about 1024 (fp32) / 512 (fp64)
            # elements per tile keep them in registers at 4 warps; fewer (_CONFIG) give small graphs more programs.
            block_f = min(block_f, 64)
            base = _CONFIG["elems"]
            elems = int((base if t.dtype == torch.float32 else base // 2) * _TUNING["block_scale"])
        else:
            elems = 65536  # the interpreter pays per program: few large tiles
        rows = max(1, min(elems // block_f, next_pow2(n)))
        block_n = 1 << (rows.bit_length() - 1)
        grid = (cdiv(n, block_n), cdiv(f, block_f))
        kernel[grid](
            *args, n, N_FEAT=f, BLOCK_N=block_n, BLOCK_F=block_f, num_warps=_CONFIG["num_warps"] or num_warps(),
            **flags, **pdl_args(t),
        )  # fmt: skip

    def _fused_forward(s, v, u_w, v_w, w1, b1, w2, b2, ds=None, dv=None, keep_uvvv=True, need_v=True):
        """``s_out``, ``v_out``, what the backward keeps (``x``, ``pre``, ``uvvv``, ``mix``, ``w_uv``) and the dot
        of the Triton GEMMs, None when they ran on cuBLAS (the backward does the same). The input is ``s + ds``,
        ``v + dv`` where given. ``keep_uvvv`` False: uvvv is None among the kept tensors (:func:`_uvvv_again`
        makes it again). ``need_v`` False: v_out is None and mix is ``[N, 2F]`` (w2, b2 given as their a_sv, a_ss
        rows, :func:`_tail`)."""
        n, f = s.shape
        s, v = s.contiguous(), v.contiguous()
        ds = ds.contiguous() if ds is not None else None
        w_uv = _stacked_uv(u_w, v_w)  # [2F, F]
        # The Triton GEMMs' dot (the engine's precision; the backward keeps it), or None: cuBLAS.
        dot = resolved_dot(s) if gemm_fusable(s, u_w, v_w, w1, b1, w2, b2) else None
        if dot is not None:  # Triton GEMMs: bias + SiLU in the epilogue, v + dv in the prologue (linear.py)
            dv = dv.contiguous() if dv is not None else None
            dv_add = dv.view(3 * n, f) if dv is not None else None
            uvvv = gemm(v.view(3 * n, f), w_uv, prologue_add=dv_add, dot=dot)[0]
            if _norm_in_gemm(s):  # [s + ds | ‖vv‖] made in the first GEMM's load: no norm kernel, no x
                x = None
                h, pre = gemm(None, w1, b1, act="silu", prologue_norm=(s, ds, uvvv), dot=dot)
            else:
                x = s.new_empty((n, 2 * f))
                _launch(_painn_update_norm_kernel, s, n, f, s, _or(ds, s), uvvv, x, HAS_DS=ds is not None)
                h, pre = gemm(x, w1, b1, act="silu", dot=dot)
            mix = gemm(h, w2, b2, dot=dot)[0]
        else:
            if dv is not None:  # cuBLAS has no prologue: the sum is stored once
                v, dv = v + dv, None
            uvvv = torch.mm(v.view(3 * n, f), w_uv.t())
            x = s.new_empty((n, 2 * f))
            _launch(_painn_update_norm_kernel, s, n, f, s, _or(ds, s), uvvv, x, HAS_DS=ds is not None)
            pre = torch.addmm(b1, x, w1.t())
            mix = torch.addmm(b2, nnf.silu(pre), w2.t())
        s_out = torch.empty_like(s)
        v_out = torch.empty_like(v) if need_v else None
        _launch(
            _painn_update_out_kernel,
            s,
            n,
            f,
            s,
            _or(ds, s),
            v,
            _or(dv, v),
            uvvv,
            mix,
            s_out,
            _or(v_out, s_out),
            HAS_DS=ds is not None,
            HAS_DV=dv is not None,
            VOUT=need_v,
        )
        return s_out, v_out, (x, pre, uvvv if keep_uvvv else None, mix, w_uv), dot

    def _uvvv_again(v, dv, w_uv, dot) -> Tensor:
        """uvvv = (v + dv) [U; V]ᵀ as :func:`_fused_forward` made it (the same GEMM, prologue and dot: the same
        values), for a backward that did not keep it."""
        n, _, f = v.shape
        v = v.contiguous()
        if dot is not None:
            dv_add = dv.contiguous().view(3 * n, f) if dv is not None else None
            return gemm(v.view(3 * n, f), w_uv, prologue_add=dv_add, dot=dot)[0]
        if dv is not None:
            v = v + dv
        return torch.mm(v.view(3 * n, f), w_uv.t())

    def _or(t: Tensor | None, dummy: Tensor) -> Tensor:
        """A kernel's optional pointer argument (unread when its switch is off)."""
        return dummy if t is None else t

    def _norm_in_gemm(s: Tensor) -> bool:
        """Whether the first GEMM makes its input [s + ds | ‖vv‖] in its load (``norm_in_gemm``): from
        ``norm_in_gemm_min_atoms`` atoms, on the GEMM's tensor-descriptor kernel on a GPU (the interpreter's
        kernel on the CPU): ``linear.tma_norm_prologue``, which also asks for F a multiple of the K tile. On the
        pointer kernel (an eager step below ``linear``'s ``tma_eager_min_rows``, or F = 48) it cost the
        24,000-atom eager step 0.985x at 128 features and 0.857x at 64 (stop 63, H200,
        benchmarks/results/stop63_gpu/d/)."""
        n, f = s.shape
        if not _CONFIG["norm_in_gemm"] or n < _CONFIG["norm_in_gemm_min_atoms"]:
            return False
        return not s.is_cuda or tma_norm_prologue(s, n, f)

    def _fused_backward(grad_s, grad_v, x, pre, uvvv, mix, w_uv, w1, w2, dot=None):
        """Gradients wrt ``s [N,F]`` and ``v [N,3,F]``; ``grad_v`` None means zero (v_out unused)."""
        n, f = pre.shape
        if grad_s is None:  # s_out unused (rare: the model always uses it)
            grad_s = pre.new_zeros((n, f))
        grad_s = grad_s.to(pre.dtype).contiguous()
        has_gv = grad_v is not None
        grad_v = grad_v.to(pre.dtype).contiguous() if has_gv else None
        vout = mix.shape[1] == 3 * f  # [N, 2F]: the last layer's (no a_vv, no v_out, so no g_v)
        g_mix, g_uvvv = mix.new_empty(mix.shape), uvvv.new_empty((3 * n, 2 * f))
        gv_arg = _or(grad_v, grad_s)
        dvv = bool(_CONFIG["dvv_in_norm_bwd"])
        _launch(
            _painn_update_out_bwd_kernel, pre, n, f, grad_s, gv_arg, uvvv, mix, g_mix, g_uvvv, HAS_GV=has_gv,
            VOUT=vout, VV=not dvv,
        )  # fmt: skip
        # As decided in the forward (the backward may run outside the backend context); SiLU' in a GEMM prologue.
        if dot is not None:
            g_h = gemm(g_mix, w2, transpose_w=False, dot=dot)[0]
            g_x = gemm(g_h, w1, transpose_w=False, prologue_silu_of=pre, dot=dot)[0]
        else:
            g_x = torch.mm(torch.ops.aten.silu_backward(torch.mm(g_mix, w2), pre), w1)  # [N, 2F]
        g_s, g_v = torch.empty_like(grad_s), pre.new_empty((n, 3, f))
        # g_v_out as the last Triton GEMM's addend (gv_as_addend), or copied into g_v by the norm backward
        addend = dot is not None and has_gv and _CONFIG["gv_as_addend"]
        _launch(
            _painn_update_norm_bwd_kernel, pre, n, f, grad_s, gv_arg, g_x, uvvv, _or(x, pre), g_s, g_v, g_uvvv, mix,
            HAS_GV=has_gv and not addend, NORM_VV=x is None, DVV=dvv, MIX3=vout,
        )  # fmt: skip
        # g_v = g_v_out (when there is one) + [∂uv | ∂vv] @ [U; V]
        if addend:
            gemm(g_uvvv, w_uv, transpose_w=False, out=g_v.view(3 * n, f), addend=grad_v.view(3 * n, f), dot=dot)
        elif dot is not None:
            gemm(g_uvvv, w_uv, transpose_w=False, out=g_v.view(3 * n, f), accumulate=has_gv, dot=dot)
        elif has_gv:
            g_v.view(3 * n, f).addmm_(g_uvvv, w_uv)
        else:
            torch.mm(g_uvvv, w_uv, out=g_v.view(3 * n, f))
        return g_s, g_v

    class _PaiNNUpdateFused(torch.autograd.Function):
        """Inference-only: gradients wrt s and v (and the same ones wrt the residual terms ds, dv, when given);
        the weights must not require grad; first-order only."""

        @staticmethod
        def forward(ctx, s, v, u_w, v_w, w1, b1, w2, b2, ds=None, dv=None, need_v=True):
            if any(ctx.needs_input_grad[2:8]):
                raise RuntimeError("the fused PaiNN update is inference-only: its weights must not require grad")
            # A v_out nobody uses (the last layer's) gets None, not a zero-filled gradient (one fill less).
            ctx.set_materialize_grads(False)
            limit = _CONFIG["recompute_uv_min_atoms"]
            keep = limit is None or s.shape[0] < limit
            if not need_v:  # s_out alone: the MLP's last GEMM makes a_sv, a_ss only
                w2, b2 = _tail(w2), _tail(b2)
            s_out, v_out, saved, ctx.dot = _fused_forward(
                s, v, u_w, v_w, w1, b1, w2, b2, ds, dv, keep_uvvv=keep, need_v=need_v
            )
            ctx.has_ds, ctx.has_dv = ds is not None, dv is not None
            ctx.save_for_backward(s, v, ds, dv, *saved, w1, w2)
            return (s_out, v_out) if need_v else s_out

        @staticmethod
        def backward(ctx, grad_s, grad_v=None):
            s, v, ds, dv, *saved = ctx.saved_tensors
            with torch.no_grad():
                if saved[2] is None:  # uvvv not kept (recompute_uv_min_atoms): made again
                    saved[2] = _uvvv_again(v, dv, saved[4], ctx.dot)
                g_s, g_v = _fused_backward(grad_s, grad_v, *saved, dot=ctx.dot)
            if torch.is_grad_enabled():  # create_graph=True: raise on a second derivative (FirstOrderOnly)
                depends = [t for t in (grad_s, grad_v, s, v, ds, dv) if t is not None]
                g_s, g_v = FirstOrderOnly.apply("the fused PaiNN update", 2, g_s, g_v, *depends)
            g_ds = g_s if ctx.has_ds else None
            g_dv = g_v if ctx.has_dv else None
            return g_s, g_v, None, None, None, None, None, None, g_ds, g_dv, None
