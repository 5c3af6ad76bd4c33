"""ASE's velocity-Verlet prediction of the next positions, on the device and bit for bit (the chained MD step).

The chained MD step (``mlff_distiller._md_chain``) predicts on the device the positions that ASE's
``VelocityVerlet.step`` will hand the calculator next, from the forces of the step before and the positions and
momenta of the calculation before, and runs the next step on them. It is taken only where the prediction equals the
host's byte for byte, so the arithmetic must be NumPy's, op for op, in float64:

    kick = F * (0.5 dt);  p' = p + kick;  p' += kick;  x' = x + (p' * dt) / m;  input = float32(x' - origin)

:func:`verlet_predict_reference` is those ops as torch elementwise kernels (about ten launches in the step's graph,
several of them reading page-locked host memory across the bus). :func:`verlet_predict` is one Triton kernel that
reads each input once and writes the rounded positions both to the host buffer the calculator compares and to the
step's own input. Two things keep its bits NumPy's (``benchmarks/results/stop81_gpu/d/probe_verlet_predict.md``: with
the compiler's default, 1-36 of 1,800-28,800 coordinates differed in the last bit):

- it is compiled with ``enable_fp_fusion=False``, so that no ``a + b * c`` becomes a fused multiply-add;
- the two coefficients are read from a float64 tensor: Triton passes a Python float as a float32 scalar.

Triton's float64 division is IEEE's (``div.rn.f64``), and the cast to float32 rounds to nearest, as NumPy's.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._backend import resolve_backend
from ._triton_utils import HAS_TRITON, INTERPRETING, cdiv, tl, triton

__all__ = ["verlet_predict", "verlet_predict_reference"]

_BLOCK = 128

if HAS_TRITON:

    @triton.jit
    def _verlet_predict_kernel(f_ptr, x_ptr, p_ptr, c_ptr, out_ptr, also_ptr, n3, BLOCK: tl.constexpr):
        # c: float64 [0.5 dt, dt, origin (3), masses (n)]; f: the forces in the engine's dtype; x, p: float64.
        k = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = k < n3
        half_dt = tl.load(c_ptr)
        dt = tl.load(c_ptr + 1)
        o = tl.load(c_ptr + 2 + k % 3, mask=ok, other=0.0)
        m = tl.load(c_ptr + 5 + k // 3, mask=ok, other=1.0)
        f = tl.load(f_ptr + k, mask=ok, other=0.0).to(tl.float64)
        x = tl.load(x_ptr + k, mask=ok, other=0.0)
        p = tl.load(p_ptr + k, mask=ok, other=0.0)
        kick = f * half_dt
        pn = p + kick
        pn = pn + kick
        xn = x + (pn * dt) / m
        y = (xn - o).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + k, y, mask=ok)
        tl.store(also_ptr + k, y, mask=ok)


def _check(forces: Tensor, x: Tensor, p: Tensor, consts: Tensor, out: Tensor, also: Tensor) -> int:
    n = x.shape[0]
    if x.shape != (n, 3) or p.shape != (n, 3) or forces.shape != (n, 3) or out.shape != (n, 3) or also.shape != (n, 3):
        raise ValueError(
            f"verlet_predict: forces {tuple(forces.shape)}, x {tuple(x.shape)}, p {tuple(p.shape)}, out "
            f"{tuple(out.shape)} and also {tuple(also.shape)} must all be [n, 3]"
        )
    if consts.shape != (5 + n,):
        raise ValueError(f"verlet_predict: consts must be [5 + n] = [{5 + n}] (0.5 dt, dt, origin, masses), got "
                         f"{tuple(consts.shape)}")  # fmt: skip
    if x.dtype != torch.float64 or p.dtype != torch.float64 or consts.dtype != torch.float64:
        raise ValueError("verlet_predict: x, p and consts must be float64 (NumPy's arithmetic is float64)")
    if out.dtype != also.dtype:
        raise ValueError(f"verlet_predict: out ({out.dtype}) and also ({also.dtype}) must have one dtype")
    for name, t in (("forces", forces), ("x", x), ("p", p), ("out", out), ("also", also)):
        if not t.is_contiguous():
            raise ValueError(f"verlet_predict: {name} must be contiguous")
    return n


def verlet_predict_reference(forces: Tensor, x: Tensor, p: Tensor, consts: Tensor, out: Tensor, also: Tensor) -> None:
    """The prediction as torch elementwise ops (see the module docstring), into ``out`` and ``also``."""
    n = _check(forces, x, p, consts, out, also)
    half_dt, dt, origin, m = consts[0], consts[1], consts[2:5], consts[5:].view(n, 1)
    kick = forces.to(torch.float64) * half_dt
    pn = p + kick
    pn += kick
    xn = x + (pn * dt) / m
    out.copy_(xn - origin)  # rounded once to out's dtype, as the calculator's NumPy cast
    if also.dtype.itemsize % 4 == 0 and also.device == out.device:
        # bit for bit as an elementwise kernel (a same-dtype copy_ would be a DMA copy: cudagraph.copy_bits)
        torch.add(out.view(torch.int32), 0, out=also.view(torch.int32))
    else:
        also.copy_(out)


def verlet_predict(forces: Tensor, x: Tensor, p: Tensor, consts: Tensor, out: Tensor, also: Tensor) -> None:
    """ASE's next positions from the forces ``[n, 3]`` of the step before and the float64 positions ``x`` and momenta
    ``p`` ``[n, 3]`` of the calculation before; ``consts`` float64 ``[5 + n]``: ``0.5 dt``, ``dt``, the origin
    subtracted from the positions (3) and the masses (n). Writes ``float32(x' - origin)`` (``out``'s dtype) into both
    ``out`` and ``also``. One Triton kernel where the backend is Triton, else :func:`verlet_predict_reference`; the
    two give the same bits. Capturable in a CUDA graph (no host synchronisation, no allocation on the Triton path)."""
    n = _check(forces, x, p, consts, out, also)
    if resolve_backend(out.device) != "triton":
        verlet_predict_reference(forces, x, p, consts, out, also)
        return
    options = {} if INTERPRETING else {"enable_fp_fusion": False}
    _verlet_predict_kernel[(cdiv(3 * n, _BLOCK),)](forces, x, p, consts, out, also, 3 * n, BLOCK=_BLOCK,
                                                          **options)  # fmt: skip
