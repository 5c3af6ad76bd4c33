"""A two-layer SiLU MLP's forward, or its backward, in one Triton kernel (large-M launches, tensor descriptors).

The student's MLPs (φ of each message block, the update block's mixing MLP) run as two GEMMs each way on the
Triton path (:mod:`.linear`): ``h, pre = gemm(x, W1, b1, act="silu")`` then ``out = gemm(h, W2, b2)``, and in the
backward ``g_h = g W2`` then ``g_x = (g_h ⊙ SiLU'(pre)) W1``. Between the two launches the hidden rows ``h`` / ``g_h``
``[M, H]`` go to memory and back, and at the sizes of a batch of small molecules (5,000-22,000 rows) each launch is
2-6x above the floor of its bytes (``benchmarks/results/stop60_gpu/a/bench_gemm_ceiling_h200.md``): a fixed cost per
launch and tile, not the MMAs.

Here one program owns ``BM`` rows and the whole hidden width: it accumulates the first product as four
``[BM, H/4]`` tiles (the K steps of the second GEMM's tiles), applies the bias and SiLU (forward, storing ``pre``)
or SiLU' of the stored ``pre`` (backward) in registers, then walks the output columns in ``BN`` steps, each the
four hidden tiles times W2's (or W1's) ``[BN, H/4]`` tiles, with the second bias or the addend in the epilogue. With
H/4 equal to the GEMM's K step (``large_block_k``: H = 128) the arithmetic is that of the two GEMM launches, in the
same order, so the same bits. Every dense operand moves through Triton's host-side tensor descriptors (Hopper's
copy engine; the interpreter runs them on CPU tensors), as :func:`.linear._gemm_tma_kernel` does.

Off until measured (``linear._CONFIG["fused_mlp_min_rows"]`` None): :func:`mlp2_forward` and :func:`mlp2_backward`
return None where the fused launch does not apply, and the caller runs its two GEMMs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._frozen import derived, tf32_exact
from ._triton_utils import HAS_TRITON, cdiv, check_launchable, pdl_args, pdl_prologue, sm90, tl, triton
from .linear import _CONFIG, _contiguous_t, _TensorDescriptor

__all__ = ["mlp2_backward", "mlp2_forward"]


def _kernel_dot(w: Tensor, dot: str, m: int, cuda: bool) -> str | None:
    """The dot the GEMM's launch of ``m`` rows would give ``w`` (:func:`.linear.gemm`'s rules), or None for one the
    fused kernel does not take (tf32x3 with W's parts made once: two weight tiles per product)."""
    if dot == "tf32x3":
        if _CONFIG["w_exact_two_mmas"] and tf32_exact(w):
            return "tf32x2w" if _CONFIG["nan_guard"] else "tf32x2f"
        split_min = _CONFIG["w_split_min_rows"]
        return None if split_min is not None and m >= split_min else "tf32x3"
    if dot == "tf32" and _CONFIG["w_exact_tf32"] and tf32_exact(w):
        return "tf32w"
    if dot == "bf16" and not cuda:
        return "bf16_rn"
    return dot


def _plan(ref: Tensor, m: int, h: int, wa: Tensor, wb: Tensor, dot: str, tensors) -> str | None:
    """The kernel's dot when the fused launch applies to these operands, else None."""
    least = _CONFIG["fused_mlp_min_rows"]
    if least is None or m < least or _TensorDescriptor is None or not HAS_TRITON:
        return None
    if h < 64 or h > 1024 or h & (h - 1):  # four hidden tiles of a power of two, at least 16 wide (the dot's K)
        return None
    for t in tensors:
        if t is None:
            continue
        if t.dtype != torch.float32 or t.dim() != 2 or t.stride(1) != 1 or t.stride(0) % 4 or t.data_ptr() % 16:
            return None
    if ref.is_cuda:
        if not _CONFIG["tma"] or not sm90(ref.device):
            return None
        if m < _CONFIG["tma_eager_min_rows"] and not torch.cuda.is_current_stream_capturing():
            return None  # an eager call pays the descriptors' host time (see tma_eager_min_rows)
    da, db = (_kernel_dot(w, dot, m, ref.is_cuda) for w in (wa, wb))
    return da if da is not None and da == db else None


def mlp2_forward(x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor, dot: str) -> tuple[Tensor, Tensor] | None:
    """``(W2 SiLU(W1 x + b1) + b2, W1 x + b1)`` for ``x [M, K]`` and ``nn.Linear`` weights ``w1 [H, K]``,
    ``w2 [N, H]``, in one launch, or None where it does not apply (``fused_mlp_min_rows``, the descriptors' rules,
    H a power of two from 64, a dot the kernel takes for both weights)."""
    m, k = x.shape
    h, n = w1.shape[0], w2.shape[0]
    if x.is_contiguous() is False:
        return None
    w1, w2 = w1.contiguous(), w2.contiguous()
    kd = _plan(x, m, h, w1, w2, dot, (x, w1, w2))
    if kd is None:
        return None
    out, pre = x.new_empty((m, n)), x.new_empty((m, h))
    _launch_mlp2(x, w1, b1, pre, w2, b2, None, out, m, k, n, h, False, kd)
    return out, pre


def mlp2_backward(g: Tensor, w1: Tensor, w2: Tensor, pre: Tensor, dot: str, addend: Tensor | None = None):
    """``(SiLU'(pre) ⊙ (g W2)) W1`` (``+ addend``) for ``g [M, N]``, the weights as in :func:`mlp2_forward` and
    ``pre [M, H]`` its pre-activation, in one launch, or None where it does not apply. The weights' kept transposes
    (:func:`._frozen.derived`, as the GEMM's large-M backward launches take them) give K-major tiles."""
    m, n = g.shape
    h, k = w1.shape
    if not g.is_contiguous() or not pre.is_contiguous() or (addend is not None and not addend.is_contiguous()):
        return None
    w2t, w1t = derived("t", _contiguous_t, w2), derived("t", _contiguous_t, w1)  # [H, N], [K, H]
    kd = _plan(g, m, h, w2t, w1t, dot, (g, pre, w2t, w1t, addend))
    if kd is None:
        return None
    out = g.new_empty((m, k))
    _launch_mlp2(g, w2t, None, pre, w1t, None, addend, out, m, n, k, h, True, kd)
    return out


def _launch_mlp2(a, wa, ba, pre, wb, bb, addend, out, m, k1, n2, h, bwd, dot, bm=None, bn=None, warps=None):
    """One program per ``BM`` rows (:func:`_mlp2_tma_kernel`). Forward: ``a = x``, ``wa = W1 [H, K1]``, ``ba = b1``,
    ``pre`` written, ``wb = W2 [N2, H]``, ``bb = b2``. Backward: ``a = g``, ``wa = W2ᵀ [H, K1]``, ``pre`` read,
    ``wb = W1ᵀ [N2, H]``, ``addend`` added."""
    desc = _TensorDescriptor.from_tensor
    bm = bm or _CONFIG["fused_mlp_bm"]
    bn = bn or _CONFIG["fused_mlp_bn"]
    bk = _CONFIG["large_block_k"]
    hc = h // 4
    check_launchable(_mlp2_tma_kernel, a)
    a_d = desc(a, [bm, bk])
    wa_d = desc(wa, [hc, bk])
    pre_d = desc(pre, [bm, hc])
    wb_d = desc(wb, [bn, hc])
    out_d = desc(out, [bm, bn])
    d_d = desc(addend, [bm, bn]) if addend is not None else out_d
    launch = {"num_stages": _CONFIG["stages"]} if _CONFIG["stages"] is not None and a.is_cuda else {}
    _mlp2_tma_kernel[(cdiv(m, bm),)](
        a_d, wa_d, ba if ba is not None else out, pre_d, wb_d, bb if bb is not None else out, d_d, out_d,
        m, k1, n2, BWD=bwd, HAS_BA=ba is not None, HAS_BB=bb is not None, ACC=addend is not None,
        BM=bm, HC=hc, BK=bk, BN=bn, DOT=dot, num_warps=warps or _CONFIG["fused_mlp_warps"], **launch,
        **pdl_args(a),
    )  # fmt: skip
    return out


if HAS_TRITON:
    from .linear import _prologue, _sigmoid, _tile_dot

    @triton.jit
    def _hidden_tile(acc, ba_ptr, pre_d, m0, c0, HC: tl.constexpr, BWD: tl.constexpr, HAS_BA: tl.constexpr):
        """One ``[BM, HC]`` tile of the first product turned into the second's operand: forward, ``+ b1``, stored
        as ``pre``, then SiLU (the GEMM's epilogue); backward, times SiLU' of the stored ``pre`` (its prologue)."""
        if BWD:
            return _prologue(acc, pre_d.load([m0, c0]), 1)
        if HAS_BA:
            acc += tl.load(ba_ptr + c0 + tl.arange(0, HC))[None, :]
        pre_d.store([m0, c0], acc)
        return acc * _sigmoid(acc)

    @triton.jit(do_not_specialize=["m"])
    def _mlp2_tma_kernel(
        a_d, wa_d, ba_ptr, pre_d, wb_d, bb_ptr, d_d, out_d, m, k1, n2,
        BWD: tl.constexpr, HAS_BA: tl.constexpr, HAS_BB: tl.constexpr, ACC: tl.constexpr,
        BM: tl.constexpr, HC: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr, DOT: tl.constexpr,
        PDL: tl.constexpr,
    ):  # fmt: skip
        """Rows ``[m0, m0 + BM)`` of ``out = act(A Waᵀ) Wbᵀ`` (see :func:`_launch_mlp2`): the first product as four
        ``[BM, HC]`` tiles over K1 in BK steps, then per BN output columns the four tiles times Wb's, in that order
        (the K steps of the second GEMM when HC = BK). Out-of-range rows and columns are the descriptors' zero fill
        and clipped stores."""
        pdl_prologue(PDL)
        m0 = tl.program_id(0) * BM
        h0 = tl.zeros((BM, HC), dtype=tl.float32)
        h1 = tl.zeros((BM, HC), dtype=tl.float32)
        h2 = tl.zeros((BM, HC), dtype=tl.float32)
        h3 = tl.zeros((BM, HC), dtype=tl.float32)
        for k0 in range(0, k1, BK):
            a = a_d.load([m0, k0])
            b = wa_d.load([0, k0]).T
            h0 = _tile_dot(h0, a, b, b, DOT)
            b = wa_d.load([HC, k0]).T
            h1 = _tile_dot(h1, a, b, b, DOT)
            b = wa_d.load([2 * HC, k0]).T
            h2 = _tile_dot(h2, a, b, b, DOT)
            b = wa_d.load([3 * HC, k0]).T
            h3 = _tile_dot(h3, a, b, b, DOT)
        h0 = _hidden_tile(h0, ba_ptr, pre_d, m0, 0, HC, BWD, HAS_BA)
        h1 = _hidden_tile(h1, ba_ptr, pre_d, m0, HC, HC, BWD, HAS_BA)
        h2 = _hidden_tile(h2, ba_ptr, pre_d, m0, 2 * HC, HC, BWD, HAS_BA)
        h3 = _hidden_tile(h3, ba_ptr, pre_d, m0, 3 * HC, HC, BWD, HAS_BA)
        for n0 in range(0, n2, BN):
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            b = wb_d.load([n0, 0]).T
            acc = _tile_dot(acc, h0, b, b, DOT)
            b = wb_d.load([n0, HC]).T
            acc = _tile_dot(acc, h1, b, b, DOT)
            b = wb_d.load([n0, 2 * HC]).T
            acc = _tile_dot(acc, h2, b, b, DOT)
            b = wb_d.load([n0, 3 * HC]).T
            acc = _tile_dot(acc, h3, b, b, DOT)
            if HAS_BB:
                cols = n0 + tl.arange(0, BN)
                acc += tl.load(bb_ptr + cols, mask=cols < n2, other=0.0)[None, :]
            if ACC:
                acc += d_d.load([m0, n0])
            out_d.store([m0, n0], acc)
