"""PaiNN message step: sender features, radial filter and edge directions → per-receiver scalar/vector updates.

For edge e = (i ← j) with radial basis r_e ``[R]`` (already × cutoff) and unit vector u_e ``[3]``:
    W_e      = filter_weight @ r_e                        ``[3F]`` (no bias, so messages vanish at the cutoff)
    φ_e      = x_j ⊙ W_e  = (a_e, b_e, c_e)               three ``[F]`` blocks
    Δs_i     = Σ_e a_e                                      ``[N, F]``
    Δv_i     = Σ_e b_e ⊙ v_j + c_e ⊗ u_e                   ``[N, 3, F]``
The torch reference materialises ``[E, 3F]`` (and autograd keeps it for the backward). The Triton path never does:
one program per (receiving atom, feature chunk) walks that atom's edges (CSR offsets ``row_ptr`` over the
receiver-sorted edge list), gathers the sender features, builds its chunk of W_e from ``rbf_e`` on the fly and
reduces into registers, so the forward needs no atomics and keeps nothing per edge for the backward (a "block"
variant of the forward and of the sender backward, chosen by the launch configuration ``_CONFIG``, gives each
program BLOCK_A consecutive atoms and sums their edges with a one-hot tl.dot instead). The backward is fused as
well (three kernels, see the comment before them); the second derivative is a composite of the same two fused ops
(exact, see ``_double_backward``), so force training never materialises ``[E, 3F]`` either. Under the engine's
bf16 / fp16 the kernels gather 16-bit copies of the rows they read per edge (``_gathered_rows``, the half gathers)
and widen them in registers; every sum stays float32.

This file holds the torch reference (the CPU path, the test oracle and the specification), the explicit VJP in
torch (:func:`message_passing_backward_reference`, the spec of the backward kernels) and the Triton path
(``torch.ops.mlff_distiller.message_passing`` / ``message_passing_bwd``), selected by :func:`message_passing`. The
jit kernels are in ``_mp_kernels.py`` (the edge backward's in ``_mp_edge_kernels.py``); the receiver and sender
CSRs the kernels walk, and their cache, in ``_mp_csr.py``; the step's sink of ∂rbf, ∂u (:func:`defer_edge_grads`)
in ``edge_sink.py``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._backend import resolve_backend
from ._mp_config import (  # noqa: F401 (the launch configuration: benchmarks and tests reach it through here too)
    _CONFIG,
    _CPU_TILES,
    _KERNELS,
    _PRECISIONS,
    _VARIANTS,
    _configured,
    _edge_chain,
    _edge_guard,
    _edge_split,
    _fold_xb,
    _half_gathers,
    _launch_config,
    _launch_config_for,
    _pow2,
    _sm_count,
)
from ._mp_csr import _offsets, _receiver_csr, _sender_csr, _sender_order  # tests replace the builders here
from ._triton_utils import HAS_TRITON, LIB, cdiv, check_launchable, pdl_args
from .edge_sink import EdgeGradSink, defer_edge_grads

if HAS_TRITON:
    from ._triton_utils import triton_op, wrap_triton

__all__ = [
    "EdgeGradSink",
    "defer_edge_grads",
    "message_passing",
    "message_passing_backward_reference",
    "message_passing_reference",
    "symmetric_walk",
]


def symmetric_walk() -> bool:
    """Whether callers that hold a full neighbour list promise it (``message_passing(symmetric=True)``): the
    switch ``_CONFIG["sender_symmetric"]`` (on; benchmarks turn it off to time the sender-sorted walk). The engine
    reads it once, when it is made, since its padded buckets then skip the sender sort."""
    return bool(_CONFIG["sender_symmetric"])


def message_passing_reference(
    x: torch.Tensor,
    v: torch.Tensor,
    rbf: torch.Tensor,
    filter_weight: torch.Tensor,
    unit: torch.Tensor,
    edge_index: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference. ``x [N,3F]``, ``v [N,3,F]``, ``rbf [E,R]``, ``filter_weight [3F,R]``, ``unit [E,3]``,
    ``edge_index [2,E]`` (row 0 receiver i, row 1 sender j) → ``ds [N,F]``, ``dv [N,3,F]``."""
    n, f = v.shape[0], v.shape[2]
    i, j = edge_index[0], edge_index[1]
    phi = x.index_select(0, j) * (rbf @ filter_weight.t())
    a, b, c = torch.split(phi, f, dim=-1)
    ds = torch.zeros((n, f), dtype=x.dtype, device=x.device).index_add(0, i, a)
    dv_e = b.unsqueeze(1) * v.index_select(0, j) + c.unsqueeze(1) * unit.unsqueeze(-1)
    dv = torch.zeros((n, 3, f), dtype=v.dtype, device=v.device).index_add(0, i, dv_e)
    return ds, dv


def message_passing_backward_reference(
    grad_s: torch.Tensor,
    grad_v: torch.Tensor,
    x: torch.Tensor,
    v: torch.Tensor,
    rbf: torch.Tensor,
    filter_weight: torch.Tensor,
    unit: torch.Tensor,
    edge_index: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The VJP of :func:`message_passing_reference`, written out in torch (the spec of the backward kernels).

    With g_s = ``grad_s [N,F]``, g_v = ``grad_v [N,3,F]`` and, per edge e = (i ← j),
    β_e = Σ_k g_v[i,k] ⊙ v_j[k] and γ_e = Σ_k g_v[i,k] u_e[k] (both ``[F]``):
        ∂x_j  += (g_s[i] ⊙ W_a,  β_e ⊙ W_b,  γ_e ⊙ W_c)            (a scatter over senders)
        ∂v_j  += (x_b,j ⊙ W_b) ⊗ g_v[i]                               (a scatter over senders)
        G_e    = (g_s[i] ⊙ x_a,j,  β_e ⊙ x_b,j,  γ_e ⊙ x_c,j)        ``[3F]``, the gradient wrt W_e
        ∂rbf_e = filter_weightᵀ G_e,   ∂filter_weight = Σ_e G_e ⊗ rbf_e,   ∂u_e[k] = Σ_f c_e ⊙ g_v[i,k]
    Returns ``(grad_x [N,3F], grad_v [N,3,F], grad_rbf [E,R], grad_filter_weight [3F,R], grad_unit [E,3])``.
    """
    f = v.shape[2]
    i, j = edge_index[0], edge_index[1]
    w_a, w_b, w_c = torch.split(rbf @ filter_weight.t(), f, dim=-1)
    x_a, x_b, x_c = torch.split(x.index_select(0, j), f, dim=-1)
    gs_i, gv_i = grad_s.index_select(0, i), grad_v.index_select(0, i)
    beta = (gv_i * v.index_select(0, j)).sum(1)
    gamma = (gv_i * unit.unsqueeze(-1)).sum(1)
    g_w = torch.cat([gs_i * x_a, beta * x_b, gamma * x_c], dim=-1)
    g_x = torch.zeros_like(x).index_add(0, j, torch.cat([gs_i * w_a, beta * w_b, gamma * w_c], dim=-1))
    g_v = torch.zeros_like(v).index_add(0, j, (x_b * w_b).unsqueeze(1) * gv_i)
    g_unit = ((x_c * w_c).unsqueeze(1) * gv_i).sum(-1)
    return g_x, g_v, g_w @ filter_weight, g_w.t() @ rbf, g_unit


def _check_inputs(x, v, rbf, filter_weight, unit, edge_index, row_ptr, sender_csr=None) -> None:
    """Shapes, dtypes and devices (host-side only: no device sync)."""
    if v.dim() != 3 or v.shape[1] != 3:
        raise ValueError(f"v must be [N, 3, F], got shape {tuple(v.shape)}")
    n, f = v.shape[0], v.shape[2]
    if x.shape != (n, 3 * f):
        raise ValueError(f"x must be [N, 3F] = [{n}, {3 * f}] to match v {tuple(v.shape)}, got {tuple(x.shape)}")
    if edge_index.dim() != 2 or edge_index.shape[0] != 2:
        raise ValueError(f"edge_index must be [2, E], got shape {tuple(edge_index.shape)}")
    if edge_index.dtype.is_floating_point or edge_index.dtype == torch.bool:
        raise ValueError(f"edge_index must be an integer tensor, got {edge_index.dtype}")
    e = edge_index.shape[1]
    if rbf.dim() != 2 or rbf.shape[0] != e:
        raise ValueError(f"rbf must be [E, R] with E = {e}, got shape {tuple(rbf.shape)}")
    if filter_weight.shape != (3 * f, rbf.shape[1]):
        raise ValueError(f"filter_weight must be [3F, R] = [{3 * f}, {rbf.shape[1]}], got {tuple(filter_weight.shape)}")
    if unit.shape != (e, 3):
        raise ValueError(f"unit must be [E, 3] with E = {e}, got shape {tuple(unit.shape)}")
    tensors = {"x": x, "v": v, "rbf": rbf, "filter_weight": filter_weight, "unit": unit}
    if len({t.dtype for t in tensors.values()}) != 1:
        raise ValueError(
            f"x, v, rbf, filter_weight and unit must share one dtype, got { {k: t.dtype for k, t in tensors.items()} }"
        )
    devices = {t.device for t in (*tensors.values(), edge_index)}
    if row_ptr is not None:
        devices.add(row_ptr.device)
        if row_ptr.shape != (n + 1,) or row_ptr.dtype.is_floating_point:
            raise ValueError(
                f"row_ptr must be an integer [N + 1] = [{n + 1}] tensor, got {tuple(row_ptr.shape)} {row_ptr.dtype}"
            )
    if sender_csr is not None:
        if not isinstance(sender_csr, (tuple, list)) or len(sender_csr) != 2:
            raise ValueError("sender_csr must be a pair (perm [E], col_ptr [N + 1])")
        perm, col_ptr = sender_csr
        devices.update((perm.device, col_ptr.device))
        if perm.shape != (e,) or perm.dtype.is_floating_point or perm.dtype == torch.bool:
            raise ValueError(
                f"sender_csr perm must be an integer [E] = [{e}] tensor, got {tuple(perm.shape)} {perm.dtype}"
            )
        if col_ptr.shape != (n + 1,) or col_ptr.dtype.is_floating_point or col_ptr.dtype == torch.bool:
            raise ValueError(
                f"sender_csr col_ptr must be an integer [N + 1] = [{n + 1}] tensor, got {tuple(col_ptr.shape)} "
                f"{col_ptr.dtype}"
            )
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {sorted(str(d) for d in devices)}")


def message_passing(
    x: torch.Tensor,
    v: torch.Tensor,
    rbf: torch.Tensor,
    filter_weight: torch.Tensor,
    unit: torch.Tensor,
    edge_index: torch.Tensor,
    row_ptr: torch.Tensor | None = None,
    sender_csr: tuple[torch.Tensor, torch.Tensor] | None = None,
    v_zero: bool = False,
    edge_sink: EdgeGradSink | None = None,
    v_residual: bool = False,
    symmetric: bool = False,
) -> tuple[torch.Tensor, ...]:
    """PaiNN message aggregation (see the module docstring); differentiable twice.

    Args:
        x: ``[N, 3F]`` sender features (the φ(s) of the interaction block).
        v: ``[N, 3, F]`` vector features.
        rbf: ``[E, R]`` radial basis × cutoff of each edge.
        filter_weight: ``[3F, R]`` the bias-free radial filter.
        unit: ``[E, 3]`` unit vectors of the edges (receiver → sender direction, dimensionless).
        edge_index: ``[2, E]`` row 0 receiver i, row 1 sender j.
        row_ptr: optional ``[N + 1]`` CSR offsets of the receivers (edges of atom i are
            ``row_ptr[i]:row_ptr[i+1]``), as :class:`~mlff_distiller.neighbors.NeighborList` provides; when given,
            the edges must be sorted by receiver and it is trusted as is (no check, no device sync).
        sender_csr: optional ``(perm [E], col_ptr [N + 1])``, the transposed CSR the backward walks: ``perm`` the
            edge ids in a stable order by sender (so each sender's edges keep receiver order), ``col_ptr`` the
            offsets of each sender's run in ``perm``. Trusted as given, like ``row_ptr`` (static-shape callers
            compute it once per edge list, outside their captured graphs; see
            :class:`~mlff_distiller.buckets.PaddedGraph`); when absent the backward builds it (a stable argsort,
            cached per ``edge_index`` tensor). Used only by the eager Triton path for edges given in receiver
            order: under ``torch.compile`` the backward op builds its own, and edges this function has to sort
            ignore it.
        v_zero: the caller promises that ``v`` is all zeros (a PaiNN model's first layer): the Triton forward and
            edge backward then skip the terms that carry v (the same result: they add zeros; bitwise under the
            interpreter, to rounding on the GPU, where the two compiled variants may order their sums
            differently). The promise is not checked (that would take a device sync); ``v`` must still be given.
        edge_sink: from :func:`defer_edge_grads` (rbf and unit must be the ones it returned): the backward's edge
            kernel then runs on a second stream and adds ∂rbf, ∂u into the sink, which hands them to autograd
            once, after every layer's backward (its own node). Only inside a CUDA-graph capture, on the eager
            Triton path, for first derivatives of a backward that reaches the sink's node; ignored elsewhere
            (autograd then gets the gradients as usual).
        v_residual: also return v' (v itself, for the caller's residual sum v + dv): on the eager Triton path an
            alias of v whose gradient the sender kernel adds to ∂v as it stores it, instead of autograd adding the
            two gradients of v in a kernel of its own (the same sum; elsewhere v' is v).
        symmetric: the caller promises that the edge list is symmetric: every edge (i ← j) has a partner (j ← i)
            with the same ``rbf`` row and the unit vector ``-u`` (a full neighbour list, as every list of
            :mod:`mlff_distiller.neighbors` is; to rounding of the distance is enough, as a pair at the cutoff
            carries a zero basis row). The eager Triton backward then walks each atom's own receiver row for the
            edges it sends: no sender sort, contiguous edge rows, and ``sender_csr`` is not used. Not checked (a
            device sync); a list that is not symmetric gives wrong gradients wrt x and v. Callers that may
            promise it ask :func:`symmetric_walk` first (the switch that benchmarks turn off). Ignored by the
            torch reference and under ``torch.compile``.
    Returns:
        ``ds [N, F]``, ``dv [N, 3, F]`` (the units of x times those of the filter output); with ``v_residual``,
        ``v'`` third.

    The Triton path wants the edges sorted by receiver (our neighbour lists are). Without ``row_ptr`` it builds
    the offsets itself and checks the order (once per ``edge_index`` tensor: the result is cached while that
    tensor lives and is not modified in place; one device sync); edges that are not sorted are sorted here (a
    stable argsort, and a gather of ``rbf``/``unit`` per call): correct, but slower. Sender indices outside
    ``[0, N)`` raise ``ValueError`` on that path. The torch reference ignores ``row_ptr``.
    """
    _check_inputs(x, v, rbf, filter_weight, unit, edge_index, row_ptr, sender_csr)
    if resolve_backend(x.device) == "triton":
        return _message_passing_triton(
            x, v, rbf, filter_weight, unit, edge_index, row_ptr, sender_csr, v_zero, edge_sink, v_residual, symmetric
        )
    out = message_passing_reference(x, v, rbf, filter_weight, unit, edge_index)
    return (*out, v) if v_residual else out


# ------------------------------------------------------------------------------------------------------------
# Triton path. Layers: jit kernels (in _mp_kernels.py and _mp_edge_kernels.py); host functions (allocate, choose
# blocks, launch); torch.library triton_ops with their autograd (what torch.compile sees); the eager
# autograd.Functions over the same host functions.
#
# The filter W_e (a [3F] vector per edge) is a [BLOCK_E, R_PAD] × [R_PAD, BLOCK_F] tl.dot per edge tile and
# feature chunk, with the chunk of filter_weightᵀ held in registers for the whole program. The input_precision of
# those dots is chosen per kernel (``_CONFIG["dot_<kernel>"]``): "ieee" is full float32 accuracy on CUDA cores;
# "tf32x3" (three TF32 MMAs, hi/lo split) measured the same error vs float64 on the H100 forward (1.9e-7 max
# relative) at 2.6x the speed; "tf32" costs ~1e-3 relative, too much for float32 forces: it runs under the engine's
# tf32 / bf16 / fp16 only (reduced_dots in _mp_config.py), its operands rounded to nearest (_triton_utils.dot_rn).
# Float64 always runs "ieee" (TF32 does not apply) and so does the CPU interpreter.
# ------------------------------------------------------------------------------------------------------------

if HAS_TRITON:
    from ._mp_edge_kernels import _mp_bwd_edge_kernel, _mp_bwd_filter_kernel, _mp_sum_split_kernel
    from ._mp_kernels import (
        _mp_bwd_sender_block_kernel,
        _mp_bwd_sender_kernel,
        _mp_fwd_block_kernel,
        _mp_fwd_kernel,
    )

    # -- host functions: allocate, choose blocks, launch -----------------------------------------------------
    # ``launch`` is torch.library.wrap_triton inside the triton_ops and the bare kernel on the eager path.

    _ZERO_SCALARS: dict = {}

    def _zero_scalar(ref: Tensor) -> Tensor:
        """A zero scalar of ``ref``'s device and dtype, made once (a fresh one for tensor subclasses: the fake and
        functional tensors of torch.compile's tracing must not meet a real one)."""
        if torch.compiler.is_compiling() or type(ref) is not torch.Tensor:  # fake / functional tensors: tracing
            return ref.new_zeros(())
        key = (ref.device, ref.dtype)
        zero = _ZERO_SCALARS.get(key)
        if zero is None:
            zero = _ZERO_SCALARS[key] = torch.zeros((), dtype=ref.dtype, device=ref.device)
        return zero

    def _prep(*tensors: Tensor) -> list[Tensor]:
        return [t.contiguous() for t in tensors]

    def _folded(x: Tensor, v: Tensor) -> Tensor:
        """p = x_b ⊙ v ``[N, 3, F]`` (``fold_xb_min_edges``): what the FOLD kernels gather in place of v."""
        f = v.shape[2]
        return (x[:, f : 2 * f].unsqueeze(1) * v).contiguous()

    def _gathered_rows(x: Tensor, v: Tensor, rbf: Tensor, w: Tensor, has_v: bool) -> tuple | None:
        """The half gathers (``_CONFIG["half_gathers"]``): ``(x, v or p, fold)`` stored in the engine's 16-bit
        type, which the block forward gathers and the backward's edge kernel again (the forward keeps them), with
        ``fold`` whether the second is p = x_b ⊙ v (``fold_xb_min_edges``; the product taken in float32, then
        rounded once). None where the mode is off or the forward runs its atom variant (small graphs: the copies
        would cost more launches than their bytes save)."""
        half = _half_gathers(x)
        n, f = v.shape[0], v.shape[2]
        e = rbf.shape[0]
        if half is None or n == 0 or f == 0 or e == 0:
            return None
        if _launch_config(x, "fwd", f, rbf.shape[1], n_atoms=n, weight=w)[2] != "block":
            return None
        fold = has_v and _fold_xb(x, e, n)
        xg = x.to(half, memory_format=torch.contiguous_format)
        if not has_v:  # v = 0 is never loaded
            vg = v
        elif fold:
            vg = torch.mul(x[:, f : 2 * f].unsqueeze(1), v, out=torch.empty(v.shape, dtype=half, device=v.device))
        else:
            vg = v.to(half, memory_format=torch.contiguous_format)
        return xg, vg, fold

    def _mp_forward(
        x, v, rbf, w, unit, edge_index, row_ptr, launch, has_v=True, gathered=None
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        """``(Δs, Δv)``; ``gathered``: the half gathers' rows (``_gathered_rows``), which the block forward then
        gathers in place of x and v."""
        x, v, rbf, w, unit, edge_index, row_ptr = _prep(x, v, rbf, w, unit, edge_index, row_ptr)
        n, f = v.shape[0], v.shape[2]
        ds = torch.empty((n, f), dtype=x.dtype, device=x.device)
        dv = torch.empty((n, 3, f), dtype=x.dtype, device=x.device)
        if n == 0 or f == 0:
            return ds, dv
        c, warps, variant = _launch_config(x, "fwd", f, rbf.shape[1], n_atoms=n, weight=w)
        n_fb = cdiv(f, c["BLOCK_F"])
        if variant == "block":
            # Folded on the eager and captured path only (``_bare``); the torch.compile ops keep the launch that
            # their GPU tests cover.
            if gathered is not None and launch is _bare:
                xg, vg, fold = gathered
            else:
                fold = has_v and launch is _bare and _fold_xb(x, rbf.shape[0], n)
                xg, vg = x, (_folded(x, v) if fold else v)
            check_launchable(_mp_fwd_block_kernel, x)
            launch(_mp_fwd_block_kernel)[(cdiv(n, c["BLOCK_A"]), n_fb)](
                xg, vg, rbf, w, unit, edge_index, row_ptr, ds, dv, n, edge_index.stride(0),
                num_warps=warps, HAS_V=has_v, FOLD=fold, **c, **pdl_args(x),
            )  # fmt: skip
        else:
            check_launchable(_mp_fwd_kernel, x)
            launch(_mp_fwd_kernel)[(n, n_fb)](
                x, v, rbf, w, unit, edge_index, row_ptr, ds, dv, edge_index.stride(0), num_warps=warps,
                HAS_V=has_v, **c, **pdl_args(x),
            )  # fmt: skip
        return ds, dv

    def _mp_backward(
        grad_s, grad_v, x, v, rbf, w, unit, edge_index, perm, col_ptr, need, launch, row_ptr=None, has_v=True,
        sink=None, gv_add=None, symmetric=False, gathered=None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
        """The five gradients (x, v, rbf, filter_weight, unit); ``need`` = (x/v, rbf/unit, filter_weight): the
        groups not needed come back as expanded zeros (no kernel, no memory). ``row_ptr``: the receiver CSR, when
        known; the edge kernel then computes only the edges before ``row_ptr[N]`` (those past it belong to no
        receiver: inert padding, whose ∂rbf / ∂u rows are written as zeros). ``has_v`` False: v is all zeros (the
        edge kernel skips its terms). ``sink`` (an :class:`EdgeGradSink`, first derivatives inside a capture): ∂rbf
        and ∂u are added into it on its stream, and come back here as zeros. ``gv_add`` ``[N, 3, F]``: added to ∂v
        (the gradient of v's residual alias, in the sender kernel's store; ∂v is gv_add itself when x and v need
        no gradient). ``symmetric`` (with ``row_ptr``): the sender kernel walks the receiver CSR (see
        ``message_passing``); ``perm`` and ``col_ptr`` are then not read. ``gathered``: the forward's half gathers
        (``_gathered_rows``), which the edge kernel gathers in place of x and v; with them, and ``half_grads`` on a
        graph of at least ``half_grads_min_degree`` edges per atom, the sender and edge kernels gather 16-bit
        copies of g_s and g_v (``half_grads_type``; their sums and outputs stay float32)."""
        dt = x.dtype
        grad_s, grad_v = grad_s.to(dt), grad_v.to(dt)
        grad_s, grad_v, x, v, rbf, w, unit, edge_index = _prep(grad_s, grad_v, x, v, rbf, w, unit, edge_index)
        n, f = v.shape[0], v.shape[2]
        e, n_rbf = rbf.shape
        # What the sender and edge kernels gather (the half gathers): (g_s, g_v, x, v or p, fold), or None: their own.
        rows = None
        if gathered is not None and launch is _bare:
            dense = e >= _CONFIG["half_grads_min_degree"] * n
            gh = _half_gathers(x, "half_grads") if dense else None
            gs_g, gv_g = (grad_s, grad_v) if gh is None else (grad_s.to(gh), grad_v.to(gh))
            rows = (gs_g, gv_g, *gathered)
        # Placeholders of the groups not needed: expanded views of one cached zero (no fill kernel per call).
        zero = _zero_scalar(x)
        g_x, g_v = zero.expand(x.shape), zero.expand(v.shape)
        g_rbf, g_unit, g_w = zero.expand(rbf.shape), zero.expand(unit.shape), zero.expand(w.shape)
        # With a sink the edge kernel (∂rbf, ∂u) goes to its second stream, forked before the sender kernel is queued.
        if sink is not None and need[1] and e > 0 and f > 0 and launch is _bare:
            _edge_grads_into(sink, grad_s, grad_v, x, v, rbf, w, unit, edge_index, row_ptr, has_v, rows)
            need = (need[0], False, need[2])
        if gv_add is not None:
            gv_add = gv_add.to(dt).contiguous()
            if not need[0] or n == 0 or f == 0:
                g_v = gv_add

        def edge_grads():
            if f == 0:
                return torch.zeros_like(rbf), torch.zeros_like(unit)
            return _edge_grads(grad_s, grad_v, x, v, rbf, w, unit, edge_index, row_ptr, has_v, launch, rows=rows)

        # The edge kernel first (edge_grads_first): its transients (the split's partial rows, the folded p) are
        # gone before g_x and g_v are made, so they never share the backward's peak (probe_memory_peak.py).
        edge_first = need[1] and e > 0 and _CONFIG["edge_grads_first"]
        if edge_first:
            g_rbf, g_unit = edge_grads()
        if need[0]:
            g_x = torch.empty_like(x)
            if n > 0 and f > 0:
                g_v = torch.empty_like(v)
                c, warps, variant = _launch_config(x, "bwd_sender", f, n_rbf, n_atoms=n, n_edges=e, weight=w)
                grid = (cdiv(n, c.get("BLOCK_A", 1)), cdiv(f, c["BLOCK_F"]))
                sym = bool(symmetric) and row_ptr is not None
                gs_g, gv_g = rows[:2] if rows else (grad_s, grad_v)
                if sym:  # the receiver CSR stands for the sender CSR (perm is not read)
                    perm = col_ptr = row_ptr.contiguous()
                else:
                    perm, col_ptr = perm.contiguous(), col_ptr.contiguous()
                if variant == "block":
                    check_launchable(_mp_bwd_sender_block_kernel, x)
                    launch(_mp_bwd_sender_block_kernel)[grid](
                        gs_g, gv_g, x, v, rbf, w, unit, edge_index, perm, col_ptr, g_x, g_v,
                        g_v if gv_add is None else gv_add, n, edge_index.stride(0), num_warps=warps,
                        ADD_GV=gv_add is not None, SYM=sym, **c, **pdl_args(x),
                    )  # fmt: skip
                else:
                    check_launchable(_mp_bwd_sender_kernel, x)
                    launch(_mp_bwd_sender_kernel)[grid](
                        gs_g, gv_g, x, v, rbf, w, unit, edge_index, perm, col_ptr, g_x, g_v,
                        g_v if gv_add is None else gv_add, edge_index.stride(0), num_warps=warps,
                        ADD_GV=gv_add is not None, SYM=sym, FOLD_HALF=bool(_CONFIG["sender_fold_half"]), **c,
                        **pdl_args(x),
                    )  # fmt: skip
        if need[1] and e > 0 and not edge_first:
            g_rbf, g_unit = edge_grads()
        if need[2]:
            g_w = torch.zeros_like(w)
            if e > 0 and f > 0:
                c, warps, _ = _launch_config(x, "bwd_filter", f, n_rbf)
                n_fb = cdiv(f, c["BLOCK_F"])
                # About four programs per SM in all, each a contiguous range of whole edge tiles.
                target = 4 * torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
                per_prog = c["BLOCK_E"] * max(1, cdiv(cdiv(e, max(1, target // n_fb)), c["BLOCK_E"]))
                n_prog = cdiv(e, per_prog)
                part = torch.empty((n_prog, 3 * f, n_rbf), dtype=dt, device=x.device)
                check_launchable(_mp_bwd_filter_kernel, x)
                launch(_mp_bwd_filter_kernel)[(n_prog, n_fb)](
                    grad_s, grad_v, x, v, rbf, unit, edge_index, part, e, edge_index.stride(0), per_prog,
                    num_warps=warps, **c, **pdl_args(x),
                )  # fmt: skip
                g_w = part.sum(0)
        return g_x, g_v, g_rbf, g_w, g_unit

    def _edge_grads(
        grad_s, grad_v, x, v, rbf, w, unit, edge_index, row_ptr, has_v, launch, out=None, accumulate=False, rows=None
    ):  # fmt: skip
        """``(∂rbf [E, R], ∂u [E, 3])`` by the edge kernel (and, when its feature loop is split, the sum of its
        partial rows); ``out``: the two tensors to write them into (else new ones), or with ``accumulate`` to add
        them to (in the sum kernel's epilogue when there is one). Inputs as ``_mp_backward`` prepared them
        (contiguous, one dtype, ``f > 0``, ``e > 0``); ``rows``: what the kernel gathers in place of g_s, g_v, x and
        v, with its fold (the half gathers, see ``_mp_backward``)."""
        n, f = v.shape[0], v.shape[2]
        e, n_rbf = rbf.shape
        c, warps, _ = _launch_config(x, "bwd_edge", f, n_rbf, n_edges=e, weight=w)
        tiles = cdiv(e, c["BLOCK_E"])
        split = _edge_split(x, tiles, f, c["BLOCK_F"])
        g_rbf, g_unit = (torch.empty_like(rbf), torch.empty_like(unit)) if out is None else out
        if accumulate and split == 1:  # no sum kernel to add in: the kernel's rows, then one add each
            sums = _edge_grads(grad_s, grad_v, x, v, rbf, w, unit, edge_index, row_ptr, has_v, launch, rows=rows)
            g_rbf.add_(sums[0])
            g_unit.add_(sums[1])
            return g_rbf, g_unit
        # Partial rows per feature slice, summed below (deterministic, no atomics). Writing afresh, slice 0 writes
        # straight into the outputs (OUT0) and the partials hold the other slices only: one [E, R] and one [E, 3]
        # plane less at the peak of a large backward (80 + 12 B per edge; probe_memory_peak.py). Adding into
        # ``out`` (accumulate), every slice goes to the partials and the sum kernel adds them to what out holds.
        # Chained (edge_split_chain): two slices, the second adding the first's rows itself; no sum kernel, and one
        # partial plane (when adding into out) or none.
        if rows is not None:
            gs_g, gv_g, xg, vg, fold = rows
        else:
            fold = has_v and launch is _bare and _fold_xb(x, e, n)
            gs_g, gv_g, xg, vg = grad_s, grad_v, x, (_folded(x, v) if fold else v)
        chain = split == 2 and _edge_chain(fold) and tiles >= _CONFIG["edge_chain_min_tiles"]
        out0 = split > 1 and not accumulate and _CONFIG["edge_split_out0"] and not chain
        planes = (1 if accumulate else 0) if chain else (split - 1 if out0 else split)
        if split > 1 and planes:
            part_rbf = torch.empty((planes, *rbf.shape), dtype=rbf.dtype, device=x.device)
            part_unit = torch.empty((planes, *unit.shape), dtype=unit.dtype, device=x.device)
        else:
            part_rbf, part_unit = g_rbf, g_unit
        flags = torch.zeros(tiles, dtype=torch.int32, device=x.device) if chain else part_unit
        live = row_ptr is not None
        check_launchable(_mp_bwd_edge_kernel, x)
        launch(_mp_bwd_edge_kernel)[(tiles, split)](
            gs_g, gv_g, xg, vg, rbf, w, unit, edge_index, part_rbf, part_unit,
            g_rbf, g_unit, row_ptr[n:] if live else part_unit, flags, e, edge_index.stride(0), num_warps=warps,
            SPLIT=split, LIVE=live, HAS_V=has_v, FOLD=fold, OUT0=out0, GUARD=_edge_guard(fold),
            CHAIN=chain, ACC=chain and accumulate, **c, **pdl_args(x),
        )  # fmt: skip
        if split > 1 and not chain:  # one launch for both sums (two torch reductions cost ~3.4 µs each, 192-atom MD)
            launch(_mp_sum_split_kernel)[(cdiv(e, 128),)](
                part_rbf, part_unit, g_rbf, g_unit, e, N_RBF=n_rbf, R_PAD=c["R_PAD"], SPLIT=planes, BLOCK_E=128,
                ACC=accumulate or out0, **pdl_args(x),
            )  # fmt: skip
        return g_rbf, g_unit

    def _edge_grads_into(sink, grad_s, grad_v, x, v, rbf, w, unit, edge_index, row_ptr, has_v, rows=None) -> None:
        """The edge kernel on the sink's stream (the caller's for a one-stream sink), its ∂rbf, ∂u added into the
        sink. With a second stream the caller's stream does not wait
        for it before the sink's node, so every tensor it reads is held by the sink until then. Held, they keep
        their memory from the caching allocator, and they are not modified in place: autograd adds a gradient into
        an incoming one in place when nobody else holds it (this layer's g_v, which is also the gradient of the
        previous layer's v, gets the sender kernel's ∂v added that way), which raced with this kernel before."""
        # The first layer's backward to run writes the sums, the others add to them.
        args = (grad_s, grad_v, x, v, rbf, w, unit, edge_index, row_ptr, has_v, _bare)
        side = sink.stream
        if side is None:  # a sink on the caller's stream: in order with everything else, nothing to hold or join
            _edge_grads(*args, out=sink.buffers(), accumulate=sink.filled, rows=rows)
        else:
            held = (grad_s, grad_v, x, v, rbf, w, unit, edge_index, row_ptr, *(rows[:4] if rows else ()))
            sink.keep.extend(t for t in held if t is not None)
            side.wait_stream(torch.cuda.current_stream(x.device))
            sink.forked = True
            with torch.cuda.stream(side):
                _edge_grads(*args, out=sink.buffers(), accumulate=sink.filled, rows=rows)
        sink.filled = True

    def _bare(kernel):
        return kernel

    # -- second derivative: a composite of the two fused ops -------------------------------------------------
    # The forward M(x, v, rbf, W, u) is multilinear: linear in x, in rbf and in W in every term; v appears only
    # in the b-term (Δv) and u only in the c-term (Δv); Δs (the a-term) has neither. The backward
    # B = ⟨(g_s, g_v), M⟩' is linear in (g_s, g_v), so for upstream gradients gg = (gg_x, gg_v, gg_rbf, gg_W,
    # gg_u) of B's five outputs:
    #   ∂/∂(g_s, g_v) = the JVP of M along gg = M(gg_x, v, ·) + M(·, rbf→gg_rbf) + M(·, W→gg_W)
    #                   + Δv of M(x, gg_v, rbf, W, gg_u)   (v and u enter linearly and in separate terms)
    #   ∂/∂θ          = Σ_{θ' ≠ θ} the θ-part of B with θ' replaced by gg_θ' (the mixed second derivatives of a
    #                   multilinear map), where the (v, u) pair shares no term: the call with v→gg_v, u→gg_u
    #                   contributes only to x, rbf, W, and g_s = 0 there, since Δs depends on neither.
    # So four forward and four backward calls of the fused kernels: exact, nothing of size [E, 3F], and itself
    # differentiable (the ops' own autograd), which gradgradcheck verifies.

    def _double_backward(fwd, bwd, gg, grad_s, grad_v, x, v, rbf, w, unit):
        gg_x, gg_v, gg_rbf, gg_w, gg_u = gg
        ds1, dv1 = fwd(gg_x, v, rbf, w, unit)
        ds2, dv2 = fwd(x, v, gg_rbf, w, unit)
        ds3, dv3 = fwd(x, v, rbf, gg_w, unit)
        _, dv4 = fwd(x, gg_v, rbf, w, gg_u)
        out_s = ds1 + ds2 + ds3
        out_v = dv1 + dv2 + dv3 + dv4
        _, bv1, brbf1, bw1, bu1 = bwd(grad_s, grad_v, gg_x, v, rbf, w, unit)
        bx2, bv2, _, bw2, bu2 = bwd(grad_s, grad_v, x, v, gg_rbf, w, unit)
        bx3, bv3, brbf3, _, bu3 = bwd(grad_s, grad_v, x, v, rbf, gg_w, unit)
        bx4, _, brbf4, bw4, _ = bwd(torch.zeros_like(grad_s), grad_v, x, gg_v, rbf, w, gg_u)
        return (
            out_s,
            out_v,
            bx2 + bx3 + bx4,
            bv1 + bv2 + bv3,
            brbf1 + brbf3 + brbf4,
            bw1 + bw2 + bw4,
            bu1 + bu2 + bu3,
        )

    # -- torch.library ops (what torch.compile sees) ---------------------------------------------------------

    @triton_op(f"{LIB}::message_passing", mutates_args=())
    def _mp_op(
        x: Tensor,
        v: Tensor,
        rbf: Tensor,
        filter_weight: Tensor,
        unit: Tensor,
        edge_index: Tensor,
        row_ptr: Tensor,
    ) -> tuple[Tensor, Tensor]:
        """``ds [N,F]``, ``dv [N,3,F]``; edges sorted by receiver with CSR offsets ``row_ptr [N+1]``."""
        return _mp_forward(x, v, rbf, filter_weight, unit, edge_index, row_ptr, wrap_triton)

    @triton_op(f"{LIB}::message_passing_bwd", mutates_args=())
    def _mp_bwd_op(
        grad_s: Tensor,
        grad_v: Tensor,
        x: Tensor,
        v: Tensor,
        rbf: Tensor,
        filter_weight: Tensor,
        unit: Tensor,
        edge_index: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """Gradients wrt x, v, rbf, filter_weight, unit (builds the sender CSR itself: an argsort)."""
        n = v.shape[0]
        send = edge_index[1]
        perm = _sender_order(send, n)
        col_ptr = _offsets(send[perm].contiguous(), n)
        outs = _mp_backward(
            grad_s,
            grad_v,
            x,
            v,
            rbf,
            filter_weight,
            unit,
            edge_index,
            perm,
            col_ptr,
            (True, True, True),
            wrap_triton,
        )
        return tuple(o.contiguous() for o in outs)

    def _op_fwd(edge_index, row_ptr):
        return lambda x, v, rbf, w, unit: torch.ops.mlff_distiller.message_passing(
            x, v, rbf, w, unit, edge_index, row_ptr
        )

    def _op_bwd(edge_index):
        return lambda gs, gv, x, v, rbf, w, unit: torch.ops.mlff_distiller.message_passing_bwd(
            gs, gv, x, v, rbf, w, unit, edge_index
        )

    def _mp_setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def _mp_backward_op(ctx, grad_s, grad_v):
        x, v, rbf, w, unit, edge_index, _ = ctx.saved_tensors
        grads = torch.ops.mlff_distiller.message_passing_bwd(grad_s, grad_v, x, v, rbf, w, unit, edge_index)
        return (*grads, None, None)

    def _mp_bwd_setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def _mp_bwd_backward_op(ctx, *gg):
        grad_s, grad_v, x, v, rbf, w, unit, edge_index = ctx.saved_tensors
        n = v.shape[0]
        row_ptr = _offsets(edge_index[0].contiguous(), n)  # the op's edges are receiver-sorted
        out = _double_backward(
            _op_fwd(edge_index, row_ptr), _op_bwd(edge_index), gg, grad_s, grad_v, x, v, rbf, w, unit
        )
        return (*out, None)

    _mp_op.register_autograd(_mp_backward_op, setup_context=_mp_setup_context)
    _mp_bwd_op.register_autograd(_mp_bwd_backward_op, setup_context=_mp_bwd_setup_context)

    # -- eager path: the same host functions under plain autograd.Functions ----------------------------------

    class _MessagePassing(torch.autograd.Function):
        @staticmethod
        def forward(
            ctx, x, v, rbf, w, unit, edge_index, row_ptr, perm=None, col_ptr=None, v_zero=False, sink=None,
            v_residual=False, symmetric=False,
        ):  # fmt: skip
            # perm / col_ptr: the caller's sender CSR (None: the backward builds it, see _sender_csr); v_zero,
            # sink, v_residual, symmetric: see message_passing.
            ctx.save_for_backward(x, v, rbf, w, unit, edge_index, row_ptr, perm, col_ptr)
            ctx.v_zero = v_zero
            ctx.sink = sink
            ctx.symmetric = symmetric
            # The half gathers' 16-bit rows, made here and kept for the first derivative's edge kernel (the double
            # backward's composite runs on the float32 tensors saved above).
            ctx.gathered = gathered = _gathered_rows(x, v, rbf, w, not v_zero)
            ds, dv = _mp_forward(x, v, rbf, w, unit, edge_index, row_ptr, _bare, not v_zero, gathered)
            return (ds, dv, v.view_as(v)) if v_residual else (ds, dv)

        @staticmethod
        def backward(ctx, grad_s, grad_v, g_alias=None):
            x, v, rbf, w, unit, edge_index, row_ptr, perm, col_ptr = ctx.saved_tensors
            nx, nv, nrbf, nw, nu = ctx.needs_input_grad[:5]
            need = (nx or nv, nrbf or nu, nw)
            # The sink takes ∂rbf, ∂u of first derivatives only (grad mode is on in a backward that builds a graph).
            # A backward that will not run the sink's node (over the weights alone) leaves it out.
            sink = ctx.sink if need[1] and not torch.is_grad_enabled() else None
            if sink is not None and not sink.joins():
                sink = None
            grads = _MessagePassingBwd.apply(
                grad_s, grad_v, x, v, rbf, w, unit, edge_index, row_ptr, need, perm, col_ptr, ctx.v_zero, sink,
                g_alias if nv else None, ctx.symmetric, ctx.gathered,
            )  # fmt: skip
            if sink is not None:  # added into the sink, which hands them to autograd itself
                nrbf = nu = False
            return (
                *(g if ok else None for g, ok in zip(grads, (nx, nv, nrbf, nw, nu), strict=True)),
                *(None,) * 8,
            )

    class _MessagePassingBwd(torch.autograd.Function):
        @staticmethod
        def forward(
            ctx,
            grad_s,
            grad_v,
            x,
            v,
            rbf,
            w,
            unit,
            edge_index,
            row_ptr,
            need,
            perm=None,
            col_ptr=None,
            v_zero=False,
            sink=None,
            gv_add=None,
            symmetric=False,
            gathered=None,
        ):
            # gv_add: the gradient of v's residual alias, added to ∂v (its own gradient is the one of ∂v);
            # gathered: the forward's half gathers (_gathered_rows).
            ctx.save_for_backward(grad_s, grad_v, x, v, rbf, w, unit, edge_index, row_ptr, perm, col_ptr)
            if not symmetric and (perm is None or col_ptr is None):
                perm, col_ptr = _sender_csr(edge_index, v.shape[0])
            return _mp_backward(
                grad_s, grad_v, x, v, rbf, w, unit, edge_index, perm, col_ptr, need, _bare, row_ptr.contiguous(),
                not v_zero, sink, gv_add, symmetric, gathered,
            )  # fmt: skip

        @staticmethod
        def backward(ctx, *gg):
            grad_s, grad_v, x, v, rbf, w, unit, edge_index, row_ptr, perm, col_ptr = ctx.saved_tensors
            zero = x.new_zeros(())
            gg = [zero.expand(t.shape) if g is None else g for g, t in zip(gg, (x, v, rbf, w, unit), strict=True)]

            # No symmetric walk here: the composite runs the kernels with gg_rbf and gg_u in place of rbf and u,
            # which are not symmetric between partners.

            def fwd(*args):
                return _MessagePassing.apply(*args, edge_index, row_ptr, perm, col_ptr)

            def bwd(*args):
                return _MessagePassingBwd.apply(*args, edge_index, row_ptr, (True, True, True), perm, col_ptr)

            grads = _double_backward(fwd, bwd, gg, grad_s, grad_v, x, v, rbf, w, unit)
            g_add = gg[1] if ctx.needs_input_grad[14] else None  # ∂(∂v)/∂gv_add is the identity
            return (*grads, None, None, None, None, None, None, None, g_add, None, None)


def _message_passing_triton(
    x, v, rbf, filter_weight, unit, edge_index, row_ptr, sender_csr=None, v_zero=False, edge_sink=None,
    v_residual=False, symmetric=False,
):  # fmt: skip
    if not HAS_TRITON:
        raise RuntimeError("the Triton message-passing kernels need triton installed; use MLFF_DISTILLER_KERNELS=torch")
    from .rbf_cutoff import _check_float

    _check_float(x)
    n = v.shape[0]
    if row_ptr is not None:
        row_ptr = row_ptr.to(torch.int64)
    else:
        g = _receiver_csr(edge_index, n)
        row_ptr, sorted_index = g.row_ptr, g.edge_index
        if g.order is not None:
            rbf, unit = rbf.index_select(0, g.order), unit.index_select(0, g.order)
            sender_csr = None  # it described the caller's edge order, not the sorted one
            edge_sink = None  # the sink's rows are the caller's edges: their gradients go through the gather
        edge_index = sorted_index
    if torch.compiler.is_compiling():
        out = torch.ops.mlff_distiller.message_passing(x, v, rbf, filter_weight, unit, edge_index, row_ptr)
        return (*out, v) if v_residual else out
    perm, col_ptr = (None, None) if sender_csr is None else sender_csr
    # A symmetric list stays symmetric when sorted above (the same edges), so the promise holds for edge_index here.
    return _MessagePassing.apply(
        x, v, rbf, filter_weight, unit, edge_index, row_ptr, perm, col_ptr, bool(v_zero), edge_sink, bool(v_residual),
        bool(symmetric),
    )  # fmt: skip
