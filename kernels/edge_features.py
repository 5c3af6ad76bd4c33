"""Edge geometry: positions ``[N,3]``, ``edge_index [2,E]``, shift vectors ``[E,3]`` → vectors, distances, unit vectors.

Convention (the same as ``ase.neighborlist.neighbor_list('ijS')``): ``edge_index[0]`` is the centre/receiver i,
``edge_index[1]`` the neighbour/sender j, and ``vec = pos[j] − pos[i] + shift_vector``. At ``vec = 0`` (two
coincident atoms) the distance is 0, the unit vector is 0 and every gradient is finite: no NaN.

This file holds the torch reference and the host side of the Triton path (its kernels are in
:mod:`._edge_kernels`); :func:`edge_features` and :func:`edge_basis`
(edge features fused with the radial basis × cutoff) dispatch to Triton (``torch.ops.mlff_distiller.edge_*``)
when the backend says so.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ._backend import resolve_backend
from ._edge_kernels import _TINY2
from ._triton_utils import (
    _TUNING,
    HAS_TRITON,
    LIB,
    check_launchable,
    edge_block,
    num_warps,
    pdl_args,
    widest_chunk,
)
from .rbf_cutoff import _check_args, _check_float, _rbf_constexprs_cached, rbf_cutoff_reference
from .repulsion import _n_species, wall_gate_reference, wall_touched

if HAS_TRITON:
    from ._edge_kernels import _edge_bwd_bwd_kernel, _edge_bwd_kernel, _edge_fwd_kernel
    from ._triton_utils import triton_op, wrap_triton

__all__ = ["edge_basis", "edge_basis_reference", "edge_features", "edge_features_reference"]


def edge_features_reference(
    positions: torch.Tensor, edge_index: torch.Tensor, shift_vectors: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference: returns ``vec [E,3]`` (Å), ``dist [E]`` (Å), ``unit [E,3]``."""
    i, j = edge_index[0], edge_index[1]
    vec = positions.index_select(0, j) - positions.index_select(0, i) + shift_vectors
    d2 = (vec * vec).sum(-1)
    nonzero = d2 > _TINY2
    # Double where keeps sqrt'(0) = inf out of the graph.
    dist = torch.where(nonzero, torch.sqrt(torch.where(nonzero, d2, torch.ones_like(d2))), torch.zeros_like(d2))
    unit = vec / torch.where(nonzero, dist, torch.ones_like(dist)).unsqueeze(-1)
    return vec, dist, unit


def edge_basis_reference(
    positions: torch.Tensor,
    edge_index: torch.Tensor,
    shift_vectors: torch.Tensor,
    n_rbf: int,
    cutoff: float,
    basis: str = "bessel",
    envelope: str = "cosine",
    wall: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference of the fused op: ``dist [E]``, ``unit [E,3]``, ``rbf [E,n_rbf]`` (basis × cutoff, times
    the ZBL wall's gate with ``wall``; see :func:`edge_basis`)."""
    _, dist, unit = edge_features_reference(positions, edge_index, shift_vectors)
    rbf = rbf_cutoff_reference(dist, n_rbf, cutoff, basis, envelope)
    if wall is not None:
        idx, table = wall
        table = table.to(dist.dtype)
        if wall_touched(dist, edge_index, idx, table):  # else the gate is exactly 1 (on CPU tensors: skipped)
            rbf = rbf * wall_gate_reference(dist, edge_index, idx, table).unsqueeze(-1)
    return dist, unit, rbf


def edge_features(
    positions: torch.Tensor, edge_index: torch.Tensor, shift_vectors: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Edge vectors ``[E,3]``, distances ``[E]`` and unit vectors ``[E,3]``; differentiable twice."""
    if resolve_backend(positions.device) == "triton":
        return _edge_features_triton(positions, edge_index, shift_vectors)
    return edge_features_reference(positions, edge_index, shift_vectors)


def edge_basis(
    positions: torch.Tensor,
    edge_index: torch.Tensor,
    shift_vectors: torch.Tensor,
    n_rbf: int,
    cutoff: float,
    basis: str = "bessel",
    envelope: str = "cosine",
    wall: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Edge features fused with the radial basis × cutoff: ``dist [E]``, ``unit [E,3]``, ``rbf [E,n_rbf]``.

    ``wall``: ``(idx [N], table)``, the atoms' species indices and a ZBL wall's table
    (:func:`~mlff_distiller.kernels.repulsion.repulsion_table`): the basis is multiplied by each edge's gate
    ``1 - S(r)`` (:mod:`.repulsion`; exactly 1 outside the wall). The Triton kernels fold the gate into the
    envelope (forward, backward and the backward's backward), so it costs no pass over the ``[E, n_rbf]`` basis."""
    _check_args(n_rbf, cutoff, basis, envelope)
    if wall is not None:
        idx, table = wall
        if idx.shape != positions.shape[:1] or idx.dtype.is_floating_point:
            raise ValueError(
                f"edge_basis: the wall's species indices must be integers [N], got {tuple(idx.shape)} {idx.dtype}"
            )
        _n_species(table)
        wall = (idx.contiguous(), table.to(positions.dtype).contiguous())
    if resolve_backend(positions.device) == "triton":
        return _edge_basis_triton(positions, edge_index, shift_vectors, n_rbf, cutoff, basis, envelope, wall)
    return edge_basis_reference(positions, edge_index, shift_vectors, n_rbf, cutoff, basis, envelope, wall)


# ------------------------------------------------------------------------------------------------------------
# Triton path. Three kernels serve both ops (flags STORE_VEC / WITH_RBF): forward (gather, norm, optional
# fused rbf tile), backward (per-edge gradient of vec, written as the shift gradient and scattered to the
# positions with atomics), and the backward of the backward (gathers only). The ops wrap them as
# torch.library.triton_ops:
#   edge_features -> edge_features_bwd -> edge_features_bwd_bwd
#   edge_basis -> edge_basis_bwd -> edge_basis_bwd_bwd
# The backward ops take the forward's outputs (dist, unit) rather than vec, so the fused op never materialises
# vec. Outside torch.compile the dispatchers use plain autograd.Functions over the same host functions
# (cheaper per call).
# ------------------------------------------------------------------------------------------------------------

# Implementation switches for A/B profiling (benchmarks/profile_kernels.py); the defaults are what ships.
# ``segmented_receivers``: the backward sums each run of equal receivers in a block before its atomic add (on
# CUDA). The interpreter runs a custom scan element by element in Python (seconds per block) and its atomics
# never contend, so CPU tensors use the per-edge atomics unless ``segmented_receivers_cpu`` (tests) is set.
# "zero_in_forward": edge_basis's eager forward also zeroes its backward's position gradient (no fill kernel in the
# backward; False: a fill of its own there). Built at stop 48, on since stop 49: with the moments' ``into_sink``,
# a captured step 1.013x on benzene and 1.016x on 192 water atoms, 1.002x at 1,024 g2 molecules and 3,000 water
# atoms (benchmarks/results/stop49_gpu/probe_ncu_sweep_49b.md; alone 1.010x / 1.007x in probe_ncu_sweep_48.md).
_OPTIONS = {"segmented_receivers": True, "segmented_receivers_cpu": False, "zero_in_forward": True}

# Placeholder rbf constants for the kernels' rbf arguments when WITH_RBF is off.
_NO_RBF = dict(N_RBF=1, BASIS=0, ENVELOPE=0, INV_RC=1.0, RC=1.0, PI_RC=1.0, NORM=1.0, GAMMA=1.0, MU_STEP=0.0)

if HAS_TRITON:
    # -- host functions: allocate, choose blocks, launch -----------------------------------------------------
    # ``launch`` is torch.library.wrap_triton inside the triton_ops and the bare kernel on the eager path.

    @functools.lru_cache(maxsize=256)
    def _edge_plan(
        rbf: tuple | None,
        is_fp64: bool,
        is_cuda: bool,
        elems: int,
        has_vec: str | None,
        seg_i: bool,
        tune: tuple,
    ) -> tuple[dict, tuple]:
        """The constexprs of one edge-kernel configuration (BLOCK_E and the flags included) and a hashable
        key standing for them, built once. ``elems``: per-program rbf tile budget (float32); ``has_vec``: the
        name of the kernel's vec flag (STORE_VEC / HAS_VEC), set when ``rbf`` is None; ``seg_i``: the
        backward's segmented receiver reduction (None for kernels without it); ``tune``: the knobs the block
        depends on."""
        if rbf is None:
            consts = dict(_NO_RBF, IS_FP64=is_fp64, WITH_RBF=False)
        else:
            consts = dict(_rbf_constexprs_cached(*rbf, is_fp64), WITH_RBF=True)
        consts[has_vec] = rbf is None
        if seg_i is not None:
            consts["SEG_I"] = seg_i
        cols = widest_chunk(consts["N_RBF"]) if rbf is not None else 4
        device = torch.device("cuda" if is_cuda else "cpu")
        consts["BLOCK_E"] = edge_block(device, cols, elems // (8 if is_fp64 else 4) * 4)
        return consts, (rbf, is_fp64, has_vec, seg_i, consts["BLOCK_E"])

    def _launch_edges(
        launch,
        kernel,
        ref: Tensor,
        edge_index: Tensor,
        rbf: tuple | None,
        elems: int,
        flag: str,
        seg_i,
        *args,
        **switches,
    ) -> None:
        """Launch an edge kernel over ``edge_index.shape[1]`` edges (``ref`` fixes device and dtype); ``switches``:
        constexprs beyond the plan's."""
        consts, _ = _edge_plan(
            rbf,
            ref.dtype == torch.float64,
            ref.is_cuda,
            elems,
            flag,
            seg_i,
            (_TUNING["block_scale"], _TUNING["num_warps"]),
        )
        n_edges = edge_index.shape[1]
        block = consts["BLOCK_E"]
        grid = (n_edges + block - 1) // block
        if not ref.is_cuda:
            check_launchable(kernel, ref)
        launch(kernel)[(grid,)](
            *args, n_edges, edge_index.stride(0), num_warps=num_warps(), **consts, **switches, **pdl_args(ref)
        )

    def _row_elems(rbf: tuple | None) -> int:
        """Per-program tile budget (float32 elements) of the forward and backward kernels. Without the basis
        (edge_features) 512, i.e. 128 edges per program: swept at 1e6 edges on an H100 (graph replays,
        benchmarks/results/bench_kernels_h100_stop15a.md, tune rows), forward 41.1 -> 28.8 µs (46 -> 65 % of
        copy bandwidth), forward + backward 106.7 -> 87.0 µs. With the basis the former 2048 stays the best
        measured (forward 59.8 µs, forward + backward 135.6 µs; 133.5 at half the tile and 2 warps)."""
        return 512 if rbf is None else 2048

    def _prepare(positions: Tensor, edge_index: Tensor, shift_vectors: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        _check_float(positions, shift_vectors)
        if shift_vectors.dtype != positions.dtype:
            raise TypeError(
                f"shift_vectors ({shift_vectors.dtype}) and positions ({positions.dtype}) must share a dtype"
            )
        return positions.contiguous(), edge_index.contiguous(), shift_vectors.contiguous()

    def _wall_args(wall: tuple | None, ref: Tensor, launch) -> tuple[tuple, dict]:
        """The kernels' wall arguments: ``(idx, table)`` pointers and the ``WALL`` / ``n_species`` switches. Without
        a wall, placeholders (``ref`` on the eager path; fresh empty tensors under torch.compile, which takes no
        tensor twice)."""
        if wall is not None:
            return wall, {"WALL": True, "n_species": _n_species(wall[1])}
        if launch is _bare:
            return (ref, ref), {"WALL": False, "n_species": 0}
        return (ref.new_empty(0, dtype=torch.long), ref.new_empty(0)), {"WALL": False, "n_species": 0}

    def _edge_forward(
        positions: Tensor,
        edge_index: Tensor,
        shift_vectors: Tensor,
        rbf: tuple | None,
        launch,
        wall=None,
        zero: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``(vec, dist, unit, rbf)`` of the edges. ``zero``: a contiguous tensor the kernel also fills with zeros
        (eager path only; the edges must be some)."""
        positions, edge_index, shift_vectors = _prepare(positions, edge_index, shift_vectors)
        e, kw = edge_index.shape[1], dict(dtype=positions.dtype, device=positions.device)
        dist = torch.empty((e,), **kw)
        unit = torch.empty((e, 3), **kw)
        # The output the op does not return: on the eager path not allocated, ``dist`` stands in for its pointer
        # (the kernel's STORE_VEC / WITH_RBF flag keeps it untouched; one allocation fewer per call); under
        # torch.compile an empty tensor, so that no tensor is passed twice to a wrapped kernel.
        vec = torch.empty((e, 3), **kw) if rbf is None else None
        out_rbf = torch.empty((e, rbf[0]), **kw) if rbf is not None else None
        if launch is not _bare:
            vec = torch.empty((0, 3), **kw) if vec is None else vec
            out_rbf = torch.empty((e, 0), **kw) if out_rbf is None else out_rbf
        if e > 0:
            wall_ptrs, wall_switches = _wall_args(wall, dist, launch)
            if zero is None:  # no tensor passed twice to a wrapped kernel (torch.compile): an empty one
                zero = dist if launch is _bare else torch.empty((0,), **kw)
                wall_switches["ZERO"] = False
            else:
                wall_switches["ZERO"] = True
            _launch_edges(
                launch,
                _edge_fwd_kernel,
                positions,
                edge_index,
                rbf,
                _row_elems(rbf),
                "STORE_VEC",
                None,
                positions,
                edge_index,
                shift_vectors,
                dist if vec is None else vec,
                dist,
                unit,
                dist if out_rbf is None else out_rbf,
                *wall_ptrs,
                zero,
                zero.numel() if wall_switches["ZERO"] else 0,
                **wall_switches,
            )
        return vec, dist, unit, out_rbf

    def _edge_backward(
        grad_vec: Tensor | None,
        grad_dist: Tensor | None,
        grad_unit: Tensor,
        grad_rbf: Tensor | None,
        dist: Tensor,
        unit: Tensor,
        edge_index: Tensor,
        n_atoms: int,
        rbf: tuple | None,
        launch,
        wall=None,
        zeroed: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """``grad_pos [N,3]``, ``grad_shift [E,3]``; ``grad_dist`` None stands for zeros (no fill, no read).
        ``zeroed``: an ``[N, 3]`` tensor of zeros (filled by the forward's kernel) to add ``grad_pos`` into."""
        dt = dist.dtype
        dist, unit, edge_index = dist.contiguous(), unit.contiguous(), edge_index.contiguous()
        has_gdist = grad_dist is not None
        grad_unit = grad_unit.to(dt).contiguous()
        grad_dist = grad_dist.to(dt).contiguous() if has_gdist else dist
        grad_vec = grad_unit if grad_vec is None else grad_vec.to(dt).contiguous()
        grad_rbf = grad_dist if grad_rbf is None else grad_rbf.to(dt).contiguous()
        if zeroed is not None and zeroed.shape == (n_atoms, 3) and zeroed.dtype == dt:
            grad_pos = zeroed
        else:
            grad_pos = torch.zeros((n_atoms, 3), dtype=dt, device=dist.device)
        grad_shift = torch.empty_like(unit)
        if edge_index.shape[1] > 0:
            wall_ptrs, wall_switches = _wall_args(wall, dist, launch)
            _launch_edges(
                launch,
                _edge_bwd_kernel,
                dist,
                edge_index,
                rbf,
                _row_elems(rbf),
                "HAS_VEC",
                _OPTIONS["segmented_receivers" if dist.is_cuda else "segmented_receivers_cpu"],
                grad_vec,
                grad_dist,
                grad_unit,
                grad_rbf,
                dist,
                unit,
                edge_index,
                grad_pos,
                grad_shift,
                *wall_ptrs,
                HAS_GDIST=has_gdist,  # always given: wrap_triton (the compiled op) passes no defaults
                **wall_switches,
            )
        return grad_pos, grad_shift

    def _edge_backward_backward(
        gg_pos: Tensor,
        gg_shift: Tensor,
        grad_dist: Tensor,
        grad_unit: Tensor,
        grad_rbf: Tensor | None,
        dist: Tensor,
        unit: Tensor,
        edge_index: Tensor,
        rbf: tuple | None,
        launch,
        wall=None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        dt = dist.dtype
        dist, unit, edge_index = dist.contiguous(), unit.contiguous(), edge_index.contiguous()
        gg_pos, gg_shift = gg_pos.to(dt).contiguous(), gg_shift.to(dt).contiguous()
        grad_dist, grad_unit = grad_dist.to(dt).contiguous(), grad_unit.to(dt).contiguous()
        grad_rbf = grad_dist if grad_rbf is None else grad_rbf.to(dt).contiguous()
        o_gvec = torch.empty_like(unit) if rbf is None else unit.new_empty((0, 3))
        o_gdist, o_gunit = torch.empty_like(dist), torch.empty_like(unit)
        o_grbf = dist.new_empty((0, 0)) if rbf is None else torch.empty_like(grad_rbf)
        o_dist, o_unit = torch.empty_like(dist), torch.empty_like(unit)
        if edge_index.shape[1] > 0:
            wall_ptrs, wall_switches = _wall_args(wall, dist, launch)
            _launch_edges(
                launch,
                _edge_bwd_bwd_kernel,
                dist,
                edge_index,
                rbf,
                1024,
                "HAS_VEC",
                None,
                gg_pos,
                gg_shift,
                grad_dist,
                grad_unit,
                grad_rbf,
                dist,
                unit,
                edge_index,
                o_gvec,
                o_gdist,
                o_gunit,
                o_grbf,
                o_dist,
                o_unit,
                *wall_ptrs,
                **wall_switches,
            )
        return o_gvec, o_gdist, o_gunit, o_grbf, o_dist, o_unit

    def _bare(kernel):
        return kernel

    # -- torch.library ops (what torch.compile sees) ---------------------------------------------------------

    @triton_op(f"{LIB}::edge_features", mutates_args=())
    def _edge_features_op(
        positions: Tensor, edge_index: Tensor, shift_vectors: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``vec [E,3]``, ``dist [E]``, ``unit [E,3]`` from positions, edge_index and shift vectors."""
        vec, dist, unit, _ = _edge_forward(positions, edge_index, shift_vectors, None, wrap_triton)
        return vec, dist, unit

    @triton_op(f"{LIB}::edge_features_bwd", mutates_args=())
    def _edge_features_bwd_op(
        grad_vec: Tensor,
        grad_dist: Tensor,
        grad_unit: Tensor,
        dist: Tensor,
        unit: Tensor,
        edge_index: Tensor,
        n_atoms: int,
    ) -> tuple[Tensor, Tensor]:
        """Gradients wrt ``positions [N,3]`` and ``shift_vectors [E,3]``."""
        return _edge_backward(grad_vec, grad_dist, grad_unit, None, dist, unit, edge_index, n_atoms, None, wrap_triton)

    @triton_op(f"{LIB}::edge_features_bwd_bwd", mutates_args=())
    def _edge_features_bwd_bwd_op(
        grad_grad_pos: Tensor,
        grad_grad_shift: Tensor,
        grad_dist: Tensor,
        grad_unit: Tensor,
        dist: Tensor,
        unit: Tensor,
        edge_index: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """Gradients of ``edge_features_bwd`` wrt grad_vec, grad_dist, grad_unit, dist, unit."""
        o_gvec, o_gdist, o_gunit, _, o_dist, o_unit = _edge_backward_backward(
            grad_grad_pos,
            grad_grad_shift,
            grad_dist,
            grad_unit,
            None,
            dist,
            unit,
            edge_index,
            None,
            wrap_triton,
        )
        return o_gvec, o_gdist, o_gunit, o_dist, o_unit

    @triton_op(f"{LIB}::edge_basis", mutates_args=())
    def _edge_basis_op(
        positions: Tensor,
        edge_index: Tensor,
        shift_vectors: Tensor,
        n_rbf: int,
        cutoff: float,
        basis: str,
        envelope: str,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``dist [E]``, ``unit [E,3]``, ``rbf [E,n_rbf]`` in one pass."""
        rbf_args = (n_rbf, cutoff, basis, envelope)
        _, dist, unit, rbf = _edge_forward(positions, edge_index, shift_vectors, rbf_args, wrap_triton)
        return dist, unit, rbf

    @triton_op(f"{LIB}::edge_basis_bwd", mutates_args=())
    def _edge_basis_bwd_op(
        grad_dist: Tensor,
        grad_unit: Tensor,
        grad_rbf: Tensor,
        dist: Tensor,
        unit: Tensor,
        edge_index: Tensor,
        n_atoms: int,
        n_rbf: int,
        cutoff: float,
        basis: str,
        envelope: str,
    ) -> tuple[Tensor, Tensor]:
        """Gradients wrt ``positions [N,3]`` and ``shift_vectors [E,3]``."""
        rbf = (n_rbf, cutoff, basis, envelope)
        return _edge_backward(None, grad_dist, grad_unit, grad_rbf, dist, unit, edge_index, n_atoms, rbf, wrap_triton)

    @triton_op(f"{LIB}::edge_basis_bwd_bwd", mutates_args=())
    def _edge_basis_bwd_bwd_op(
        grad_grad_pos: Tensor,
        grad_grad_shift: Tensor,
        grad_dist: Tensor,
        grad_unit: Tensor,
        grad_rbf: Tensor,
        dist: Tensor,
        unit: Tensor,
        edge_index: Tensor,
        n_rbf: int,
        cutoff: float,
        basis: str,
        envelope: str,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """Gradients of ``edge_basis_bwd`` wrt grad_dist, grad_unit, grad_rbf, dist, unit."""
        rbf = (n_rbf, cutoff, basis, envelope)
        _, o_gdist, o_gunit, o_grbf, o_dist, o_unit = _edge_backward_backward(
            grad_grad_pos,
            grad_grad_shift,
            grad_dist,
            grad_unit,
            grad_rbf,
            dist,
            unit,
            edge_index,
            rbf,
            wrap_triton,
        )
        return o_gdist, o_gunit, o_grbf, o_dist, o_unit

    # -- autograd of the ops ---------------------------------------------------------------------------------

    def _ef_setup_context(ctx, inputs, output):
        positions, edge_index, _ = inputs
        _, dist, unit = output
        ctx.n_atoms = positions.shape[0]
        ctx.save_for_backward(dist, unit, edge_index)

    def _ef_backward(ctx, grad_vec, grad_dist, grad_unit):
        dist, unit, edge_index = ctx.saved_tensors
        grad_pos, grad_shift = torch.ops.mlff_distiller.edge_features_bwd(
            grad_vec, grad_dist, grad_unit, dist, unit, edge_index, ctx.n_atoms
        )
        return grad_pos, None, grad_shift

    def _ef_bwd_setup_context(ctx, inputs, output):
        _, grad_dist, grad_unit, dist, unit, edge_index, _ = inputs
        ctx.save_for_backward(grad_dist, grad_unit, dist, unit, edge_index)

    def _ef_bwd_backward(ctx, grad_grad_pos, grad_grad_shift):
        grad_dist, grad_unit, dist, unit, edge_index = ctx.saved_tensors
        grads = torch.ops.mlff_distiller.edge_features_bwd_bwd(
            grad_grad_pos, grad_grad_shift, grad_dist, grad_unit, dist, unit, edge_index
        )
        return (*grads, None, None)

    def _eb_setup_context(ctx, inputs, output):
        positions, edge_index, _, *ctx.rbf_args = inputs
        dist, unit, _ = output
        ctx.n_atoms = positions.shape[0]
        ctx.save_for_backward(dist, unit, edge_index)

    def _eb_backward(ctx, grad_dist, grad_unit, grad_rbf):
        dist, unit, edge_index = ctx.saved_tensors
        grad_pos, grad_shift = torch.ops.mlff_distiller.edge_basis_bwd(
            grad_dist, grad_unit, grad_rbf, dist, unit, edge_index, ctx.n_atoms, *ctx.rbf_args
        )
        return grad_pos, None, grad_shift, None, None, None, None

    def _eb_bwd_setup_context(ctx, inputs, output):
        grad_dist, grad_unit, grad_rbf, dist, unit, edge_index, _, *ctx.rbf_args = inputs
        ctx.save_for_backward(grad_dist, grad_unit, grad_rbf, dist, unit, edge_index)

    def _eb_bwd_backward(ctx, grad_grad_pos, grad_grad_shift):
        grad_dist, grad_unit, grad_rbf, dist, unit, edge_index = ctx.saved_tensors
        grads = torch.ops.mlff_distiller.edge_basis_bwd_bwd(
            grad_grad_pos,
            grad_grad_shift,
            grad_dist,
            grad_unit,
            grad_rbf,
            dist,
            unit,
            edge_index,
            *ctx.rbf_args,
        )
        return (*grads, None, None, None, None, None, None)

    _edge_features_op.register_autograd(_ef_backward, setup_context=_ef_setup_context)
    _edge_features_bwd_op.register_autograd(_ef_bwd_backward, setup_context=_ef_bwd_setup_context)
    _edge_basis_op.register_autograd(_eb_backward, setup_context=_eb_setup_context)
    _edge_basis_bwd_op.register_autograd(_eb_bwd_backward, setup_context=_eb_bwd_setup_context)

    # -- eager path: the same host functions under plain autograd.Functions (no torch.library dispatch cost) -

    class _EdgeFeatures(torch.autograd.Function):
        @staticmethod
        def forward(ctx, positions, edge_index, shift_vectors):
            vec, dist, unit, _ = _edge_forward(positions, edge_index, shift_vectors, None, _bare)
            ctx.n_atoms = positions.shape[0]
            ctx.save_for_backward(dist, unit, edge_index)
            return vec, dist, unit

        @staticmethod
        def backward(ctx, grad_vec, grad_dist, grad_unit):
            dist, unit, edge_index = ctx.saved_tensors
            grad_pos, grad_shift = _edge_bwd_dispatch(
                grad_vec, grad_dist, grad_unit, None, dist, unit, edge_index, ctx.n_atoms, None
            )
            return grad_pos, None, grad_shift

    class _EdgeBasis(torch.autograd.Function):
        @staticmethod
        def forward(ctx, positions, edge_index, shift_vectors, n_rbf, cutoff, basis, envelope, wall):
            # The model uses unit and rbf, never dist: its gradient comes as None instead of a zero fill.
            ctx.set_materialize_grads(False)
            ctx.rbf = (n_rbf, cutoff, basis, envelope)
            ctx.wall = wall  # (idx, table) or None: integer indices and a constant table, nothing to differentiate
            # The backward's position gradient, zeroed by this forward's kernel: no fill kernel in the backward,
            # where it would sit on the step's path just before the last kernel.
            ctx.zeroed = None
            if ctx.needs_input_grad[0] and edge_index.shape[1] > 0 and _OPTIONS["zero_in_forward"]:
                ctx.zeroed = torch.empty((positions.shape[0], 3), dtype=positions.dtype, device=positions.device)
            args = (positions, edge_index, shift_vectors, ctx.rbf, _bare, wall, ctx.zeroed)
            _, dist, unit, rbf = _edge_forward(*args)
            ctx.n_atoms = positions.shape[0]
            ctx.save_for_backward(dist, unit, edge_index)
            return dist, unit, rbf

        @staticmethod
        def backward(ctx, grad_dist, grad_unit, grad_rbf):
            dist, unit, edge_index = ctx.saved_tensors
            if grad_unit is None and grad_rbf is None and grad_dist is None:
                return None, None, None, None, None, None, None, None
            if grad_unit is None:
                grad_unit = torch.zeros_like(unit)
            if grad_rbf is None:
                grad_rbf = dist.new_zeros((dist.shape[0], ctx.rbf[0]))
            if grad_dist is None and torch.is_grad_enabled():  # the double-backward Function wants all three
                grad_dist = torch.zeros_like(dist)
            args = (None, grad_dist, grad_unit, grad_rbf, dist, unit, edge_index, ctx.n_atoms, ctx.rbf)
            if torch.is_grad_enabled() or ctx.zeroed is None:
                grad_pos, grad_shift = _edge_bwd_dispatch(*args, wall=ctx.wall)
            else:  # the forward's zeros, once (a second backward over the same graph gets new ones)
                zeroed, ctx.zeroed = ctx.zeroed, None
                grad_pos, grad_shift = _edge_backward(*args, _bare, ctx.wall, zeroed)
            return grad_pos, None, grad_shift, None, None, None, None, None

    def _edge_bwd_dispatch(*args, wall=None):
        """The backward of both eager Functions: differentiable (``_EdgeBwd``) when autograd records it
        (create_graph), else the bare host function, which skips a second Function's bookkeeping."""
        if torch.is_grad_enabled():
            return _EdgeBwd.apply(*args, wall)
        return _edge_backward(*args, _bare, wall)

    class _EdgeBwd(torch.autograd.Function):
        """Backward of both ops (``grad_vec`` is None for edge_basis, ``grad_rbf`` and ``rbf`` None for
        edge_features); its own backward is the double-backward kernel."""

        @staticmethod
        def forward(ctx, grad_vec, grad_dist, grad_unit, grad_rbf, dist, unit, edge_index, n_atoms, rbf, wall):
            ctx.rbf, ctx.wall = rbf, wall
            ctx.save_for_backward(grad_dist, grad_unit, grad_rbf, dist, unit, edge_index)
            args = (grad_vec, grad_dist, grad_unit, grad_rbf, dist, unit, edge_index, n_atoms, rbf)
            return _edge_backward(*args, _bare, wall)

        @staticmethod
        @once_differentiable
        def backward(ctx, grad_grad_pos, grad_grad_shift):
            grad_dist, grad_unit, grad_rbf, dist, unit, edge_index = ctx.saved_tensors
            o_gvec, o_gdist, o_gunit, o_grbf, o_dist, o_unit = _edge_backward_backward(
                grad_grad_pos,
                grad_grad_shift,
                grad_dist,
                grad_unit,
                grad_rbf,
                dist,
                unit,
                edge_index,
                ctx.rbf,
                _bare,
                ctx.wall,
            )
            if ctx.rbf is None:
                return o_gvec, o_gdist, o_gunit, None, o_dist, o_unit, None, None, None, None
            return None, o_gdist, o_gunit, o_grbf, o_dist, o_unit, None, None, None, None


def _need_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError("the Triton edge kernels need triton installed; use MLFF_DISTILLER_KERNELS=torch")


def _edge_features_triton(
    positions: torch.Tensor, edge_index: torch.Tensor, shift_vectors: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _need_triton()
    if torch.compiler.is_compiling():
        return torch.ops.mlff_distiller.edge_features(positions, edge_index, shift_vectors)
    if torch.is_grad_enabled() and (positions.requires_grad or shift_vectors.requires_grad):
        return _EdgeFeatures.apply(positions, edge_index, shift_vectors)
    # Nothing to differentiate: the host function alone (no autograd.Function bookkeeping).
    return _edge_forward(positions, edge_index, shift_vectors, None, _bare)[:3]


def _edge_basis_triton(
    positions: torch.Tensor,
    edge_index: torch.Tensor,
    shift_vectors: torch.Tensor,
    n_rbf: int,
    cutoff: float,
    basis: str,
    envelope: str,
    wall: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _need_triton()
    args = (positions, edge_index, shift_vectors, int(n_rbf), float(cutoff), basis, envelope)
    if torch.compiler.is_compiling():  # the op without the wall, then the reference gate (Inductor fuses it)
        dist, unit, rbf = torch.ops.mlff_distiller.edge_basis(*args)
        if wall is not None:
            rbf = rbf * wall_gate_reference(dist, edge_index, *wall).unsqueeze(-1)
        return dist, unit, rbf
    if torch.is_grad_enabled() and (positions.requires_grad or shift_vectors.requires_grad):
        return _EdgeBasis.apply(*args, wall)
    return _edge_forward(positions, edge_index, shift_vectors, args[3:], _bare, wall)[1:]
