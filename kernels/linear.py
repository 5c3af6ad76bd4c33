"""Small-row GEMMs of the student's atom-wise layers, for inference: ``act(x Wᵀ + b)`` in one Triton kernel.

The atom-wise layers of a PaiNN student (the filter network φ, the update block's U, V and mixing MLP, the
readout) are GEMMs of a few hundred rows by 128-384 columns when one molecule or one MD box runs. cuBLAS takes
5-10 µs for each of them in strict float32 on the H100 (``benchmarks/results/tiny_gemm_h100.md``; ~40 per force
evaluation of a 3-layer model), plus a separate kernel for each SiLU and its derivative. Here one Triton kernel
per GEMM tiles the output over many small programs (16 x 32 tiles for small M), runs ``tl.dot`` in "tf32x3"
(float32 accuracy on the tensor cores, ~3e-7 relative) and fuses the bias and the activation into the epilogue;
the backward fuses SiLU' into the loading of its input (the prologue) and may accumulate into its output.

:func:`gemm` is the kernel's host function (no autograd); :func:`mlp` is a two-layer MLP ``W2 SiLU(W1 x + b1) + b2``
with a first-order backward for frozen weights (gradients wrt x only), what the model's φ and readout run on the
inference path (:func:`gemm_fusable`). The torch references are ``F.linear`` / ``nn.Sequential``.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as nnf

from ._backend import resolve_backend
from ._triton_utils import HAS_TRITON, FirstOrderOnly, check_launchable, tl, triton

__all__ = ["gemm", "gemm_fusable", "mlp", "mlp_reference"]

# Launch: rows at or below small_rows use 16 x 32 output tiles (many programs for few rows), larger ones 64 x 64;
# K is walked in block_k steps. untransposed_max_rows: above it the backward forms (B = W as stored, [K, N]) run
# on cuBLAS: on the H100 ours took 0.56-0.84x cuBLAS's time there at 6,944 and 21,749 rows, 1.16-1.71x at 600
# rows and 0.86-1.27x at 1,393 (benchmarks/results/bench_gemm_h100.md); the forward forms were 1.13-5.3x faster
# at every size measured (64-21,749 rows), so they always run here.
_CONFIG = {
    "small_rows": 2048,
    "small": (16, 32, 4),
    "large": (64, 64, 4),
    "block_k": 64,
    "dot": "tf32x3",
    "untransposed_max_rows": 1024,
}
_EPI = {"none": 0, "silu": 1}
_PRO_SILU, _PRO_ADD = 1, 2  # the A-operand prologues of _gemm_kernel (0: none)


def mlp_reference(x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor) -> Tensor:
    """``W2 SiLU(W1 x + b1) + b2`` in torch (``nn.Linear`` weights ``[out, in]``)."""
    return nnf.linear(nnf.silu(nnf.linear(x, w1, b1)), w2, b2)


def gemm_fusable(x: Tensor, *params: Tensor) -> bool:
    """Whether the Triton GEMMs may run: Triton backend for the device, no parameter requiring grad (inference),
    not inside torch.compile, float32 on the GPU (float64 too under the interpreter), one device and dtype."""
    if torch.compiler.is_compiling() or x.dtype not in (torch.float32, torch.float64):
        return False
    if any(p.requires_grad or p.dtype != x.dtype or p.device != x.device for p in params):
        return False
    if x.is_cuda and x.dtype != torch.float32:
        return False
    return resolve_backend(x.device) == "triton"


def mlp(x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor) -> Tensor:
    """Two-layer SiLU MLP on ``x [..., K]``: Triton GEMMs when :func:`gemm_fusable`, else the torch reference."""
    if (
        x.shape[-1] != w1.shape[1]
        or w2.shape[1] != w1.shape[0]
        or b1.shape != (w1.shape[0],)
        or b2.shape != (w2.shape[0],)
    ):
        raise ValueError(
            f"mlp: x [..., {x.shape[-1]}] does not chain with W1 {list(w1.shape)}, b1 {list(b1.shape)}, "
            f"W2 {list(w2.shape)}, b2 {list(b2.shape)}"
        )
    if not gemm_fusable(x, w1, b1, w2, b2):
        return mlp_reference(x, w1, b1, w2, b2)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if not torch.is_grad_enabled() or not x.requires_grad:
        out = gemm(gemm(x2, w1, b1, act="silu")[0], w2, b2)[0]
    else:
        out = _MLP.apply(x2, w1, b1, w2, b2)
    return out.reshape(*lead, w2.shape[0])


def gemm(
    a: Tensor,
    w: Tensor,
    bias: Tensor | None = None,
    *,
    act: str = "none",
    transpose_w: bool = True,
    prologue_silu_of: Tensor | None = None,
    prologue_add: Tensor | None = None,
    out: Tensor | None = None,
    accumulate: bool = False,
    addend: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """``C = act(A' B + bias)`` with ``B = Wᵀ`` (``transpose_w``, W an ``nn.Linear`` weight ``[N, K]``) or ``W``
    (``[K, N]``), and ``A' = A ⊙ SiLU'(P)`` when ``prologue_silu_of = P`` (the backward of a SiLU), ``A' = A + Q``
    when ``prologue_add = Q`` (a residual sum that then need not be stored: the same rounded sum as ``A + Q``), else
    ``A``. ``act`` "silu" also returns the pre-activation. ``accumulate`` adds into ``out``; ``addend = D``
    (``[M, N]``, no ``act``) adds D instead, so that ``out`` need not hold it (a gradient sum autograd would
    otherwise add in a kernel of its own). Returns ``(C, pre)``."""
    m, k = a.shape
    n = w.shape[0] if transpose_w else w.shape[1]
    if (w.shape[1] if transpose_w else w.shape[0]) != k:
        raise ValueError(f"gemm: A is [{m}, {k}] but W is {list(w.shape)} (transpose_w={transpose_w})")
    if prologue_silu_of is not None and prologue_add is not None:
        raise ValueError("gemm: one prologue at a time (prologue_silu_of or prologue_add)")
    if addend is not None and (accumulate or act != "none" or tuple(addend.shape) != (m, n)):
        raise ValueError(f"gemm: addend must be [{m}, {n}], without accumulate or act")
    a, w = a.contiguous(), w.contiguous()
    if out is None:
        if accumulate:
            raise ValueError("gemm: accumulate needs out")
        out = a.new_empty((m, n))
    pre = a.new_empty((m, n)) if act == "silu" else None
    if m == 0 or n == 0:
        if addend is not None:
            out.copy_(addend)
        elif not accumulate:
            out.zero_()
        return out, pre
    if not transpose_w and m > _CONFIG["untransposed_max_rows"]:
        if prologue_add is not None:
            a = a + prologue_add
        out = _torch_gemm(a, w, bias, act, transpose_w, prologue_silu_of, out, accumulate)
        if addend is not None:  # after the product (as the Triton epilogue adds), not as addmm's beta·C
            out.add_(addend)
        return out, None
    if not HAS_TRITON:  # pragma: no cover - gemm_fusable never says yes then
        raise RuntimeError("gemm needs triton installed")
    check_launchable(_gemm_kernel, a)
    stride_bk, stride_bn = (1, k) if transpose_w else (n, 1)
    if a.is_cuda:
        bm, bn, warps = _CONFIG["small"] if m <= _CONFIG["small_rows"] else _CONFIG["large"]
        bk = min(_CONFIG["block_k"], max(16, triton.next_power_of_2(k)))
        # The engine's "tf32" precision allows TF32 matmuls: one TF32 pass, like cuBLAS there; else tf32x3.
        tf32 = a.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32
        dot = "tf32" if tf32 else (_CONFIG["dot"] if a.dtype == torch.float32 else "ieee")
    else:  # the interpreter pays per program: few large tiles
        bm = max(16, min(128, triton.next_power_of_2(m)))
        bn = max(16, min(128, triton.next_power_of_2(n)))
        bk, warps, dot = max(16, min(128, triton.next_power_of_2(k))), 4, "ieee"
    aux = prologue_silu_of if prologue_silu_of is not None else prologue_add
    aux = aux.contiguous() if aux is not None else a
    pro = _PRO_SILU if prologue_silu_of is not None else (_PRO_ADD if prologue_add is not None else 0)
    if addend is not None:
        addend = addend.contiguous()
    elif accumulate:
        addend = out
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _gemm_kernel[grid](
        a, w, bias if bias is not None else a, aux, out, pre if pre is not None else out,
        addend if addend is not None else out, m, n, k,
        stride_bk, stride_bn, out.stride(0), addend.stride(0) if addend is not None else 0,
        HAS_BIAS=bias is not None, EPI=_EPI[act], PRO=pro, ACC=addend is not None,
        BM=bm, BN=bn, BK=bk, DOT=dot, num_warps=warps,
    )  # fmt: skip
    return out, pre


def _torch_gemm(a, w, bias, act, transpose_w, prologue_silu_of, out, accumulate) -> Tensor:
    """:func:`gemm` in torch ops (cuBLAS), for the shapes where cuBLAS is faster; only without ``act``."""
    if act != "none":
        raise ValueError("the cuBLAS fallback of gemm has no fused activation")
    if prologue_silu_of is not None:
        a = torch.ops.aten.silu_backward(a, prologue_silu_of)
    b = w.t() if transpose_w else w
    if accumulate:
        return out.addmm_(a, b) if bias is None else out.add_(torch.addmm(bias, a, b))
    if bias is None:
        return torch.mm(a, b, out=out)
    return torch.addmm(bias, a, b, out=out)


if HAS_TRITON:

    @triton.jit
    def _sigmoid(x):
        return 1.0 / (1.0 + tl.exp(-x))

    @triton.jit(do_not_specialize=["m"])
    def _gemm_kernel(
        a_ptr, b_ptr, bias_ptr, aux_ptr, c_ptr, pre_ptr, d_ptr, m, n, k, stride_bk, stride_bn, stride_cm, stride_dm,
        HAS_BIAS: tl.constexpr, EPI: tl.constexpr, PRO: tl.constexpr, ACC: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr,
    ):  # fmt: skip
        """One [BM, BN] tile of C. A is [m, k] row-major (and so is the prologue's aux); B is addressed by strides;
        ACC adds D (rows stride_dm apart; C itself when accumulating) after the bias and the activation."""
        rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        rm = rows[:, None] < m
        cm = cols[None, :] < n
        acc = tl.zeros((BM, BN), dtype=tl.float32 if a_ptr.dtype.element_ty == tl.float32 else tl.float64)
        for k0 in range(0, k, BK):
            kk = k0 + tl.arange(0, BK)
            am = rm & (kk[None, :] < k)
            a = tl.load(a_ptr + rows[:, None] * k + kk[None, :], mask=am, other=0.0)
            if PRO == 1:  # A ⊙ SiLU'(aux): the backward of a SiLU folded into the load
                p = tl.load(aux_ptr + rows[:, None] * k + kk[None, :], mask=am, other=0.0)
                sg = _sigmoid(p)
                a = a * (sg * (1.0 + p * (1.0 - sg)))
            elif PRO == 2:  # A + aux: a residual sum folded into the load
                a = a + tl.load(aux_ptr + rows[:, None] * k + kk[None, :], mask=am, other=0.0)
            b = tl.load(
                b_ptr + kk[:, None] * stride_bk + cols[None, :] * stride_bn, mask=(kk[:, None] < k) & cm, other=0.0
            )
            acc += tl.dot(a, b, input_precision=DOT)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=cols < n, other=0.0)[None, :]
        cmask = rm & cm
        cptr = c_ptr + rows[:, None] * stride_cm + cols[None, :]
        if EPI == 1:
            tl.store(pre_ptr + rows[:, None] * n + cols[None, :], acc, mask=cmask)
            acc = acc * _sigmoid(acc)
        if ACC:
            acc += tl.load(d_ptr + rows[:, None] * stride_dm + cols[None, :], mask=cmask, other=0.0)
        tl.store(cptr, acc, mask=cmask)

    class _MLP(torch.autograd.Function):
        """``W2 SiLU(W1 x + b1) + b2`` for frozen weights: gradient wrt x only, first order (2 kernels each way)."""

        @staticmethod
        def forward(ctx, x, w1, b1, w2, b2):
            if any(ctx.needs_input_grad[1:]):
                raise RuntimeError("the Triton MLP is inference-only: its weights must not require grad")
            h, pre = gemm(x, w1, b1, act="silu")
            out, _ = gemm(h, w2, b2)
            ctx.save_for_backward(x, pre, w1, w2)
            return out

        @staticmethod
        def backward(ctx, g):
            x, pre, w1, w2 = ctx.saved_tensors
            with torch.no_grad():
                g_h, _ = gemm(g.contiguous(), w2, transpose_w=False)
                g_x, _ = gemm(g_h, w1, transpose_w=False, prologue_silu_of=pre)
            if torch.is_grad_enabled():  # create_graph=True: raise on a second derivative (FirstOrderOnly)
                g_x = FirstOrderOnly.apply("the Triton MLP", 1, g_x, x, g)
            return g_x, None, None, None, None
