"""Species-resolved radial moments: the first PaiNN layer's messages without gathering sender features.

In a PaiNN model's first layer the sender features are φ(s_j) with s_j the embedding row of j's species, and the
vector features are zero, so (see :mod:`.message_passing`) with Φ = φ(embedding) ``[S, 3F]`` (one row per species)
and W = filter_weight:
    Δs_i    = Σ_e Φ_a[z_j] ⊙ (W_a rbf_e)          = Σ_{z,r} P_i[z, r] M_a[(z, r), :]
    Δv_i[k] = Σ_e Φ_c[z_j] ⊙ (W_c rbf_e) u_e[k]   = Σ_{z,r} Q_i[k, z, r] M_c[(z, r), :]
with M_a[(z, r), f] = Φ_a[z, f] W_a[f, r] and M_c[(z, r), f] = Φ_c[z, f] W_c[f, r] (``[S·R, F]``, made once),
and the moments P_i[z, r] = Σ_{e: i, z_j = z} rbf_e[r] and Q_i[k, z, r] = Σ_{e: i, z_j = z} rbf_e[r] u_e[k]. This
module computes the moments ``P [N, S·R]`` and ``Q [N, 3, S·R]``: per edge it reads rbf_e, u_e and the sender's
species, R + 3 + 1 numbers instead of the 2F feature values the message-passing kernel gathers; the two products
with M (K = S·R) are ordinary GEMMs. The backward is as light: ∂rbf_e = ∂P_i[z_j] + Σ_k u_e[k] ∂Q_i[k, z_j] and
∂u_e[k] = ⟨rbf_e, ∂Q_i[k, z_j]⟩, rows of the receiver's own gradients.

The Triton path walks the receiver CSR: one program per ``BLOCK_A`` consecutive receivers sums its edges into the
``[BLOCK_A · S_PAD, R_PAD]`` moment tiles with a one-hot tl.dot over (receiver, species) slots (no atomics, a fixed
order); the backward is one program per tile of edges. First derivatives only (inference, as the model uses it):
a second derivative raises (:class:`._triton_utils.FirstOrderOnly`); the torch reference is differentiable twice.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._backend import resolve_backend
from ._frozen import derived
from ._triton_utils import (
    HAS_TRITON,
    FirstOrderOnly,
    cdiv,
    check_launchable,
    pdl_args,
    tl,
    triton,
    unspecialized,
)

__all__ = ["MAX_SPECIES", "first_layer_messages", "species_moments", "species_moments_reference"]

# Register tiles hold BLOCK_A x next_pow2(S) moment rows (at most _CONFIG["rows"]): more species than this take the
# message-passing kernel.
MAX_SPECIES = 16
# rows: the forward's tile height, BLOCK_A receivers x S_PAD species slots (fewer receivers per program where that
# leaves fewer than programs_per_sm programs per SM: a 192-atom box got 12 programs of 16 receivers).
# model_min_edges, model_min_degree: StudentModel takes its first layer from the moments on graphs of at least this
# many edges and edges per atom (None: never). The whole step, moments against the message kernel's first layer, in
# one H200 call (benchmarks/results/stop44_gpu/probe_ncu_sweep_moments.md, two rounds; water with the 2-species
# water student, the others with the 14-species g2 student): 24,000 water atoms (eager) 1.155x, 3,000 1.127x, 192
# 1.036x; 4,096 g2 molecules (7.5 edges per atom) 0.975x, 1,024 0.962x, benzene (2.5 per atom in its bucket)
# 0.947x. Dense graphs gain (the message kernel's gathers scale with the edges), sparse ones lose (two GEMMs with
# K = S·R more a step), hence the degree bound. rows 16 since stop 45: at 24,000 water atoms (2 species) 16 receivers
# per program instead of 32, the whole eager step 1.018x (benchmarks/results/stop45_gpu/probe_ncu_sweep_recv24k.md;
# rows 32: 1.005x); smaller graphs already took tiles of 16 rows (programs_per_sm). A receiver-by-receiver forward
# with per-species sums on the CUDA cores instead of the one-hot MMA measured 0.98-1.00x at 192, 3,000 and 24,000
# atoms (the same files; moments_recv_dropped.diff): not kept.
_CONFIG = {
    "rows": 16,
    "programs_per_sm": 2,
    "block_e": 32,
    "num_warps": 4,
    "bwd_block_e": 64,
    "model_min_edges": 0,
    "model_min_degree": 16,
    # With the step's edge-gradient sink (kernels.defer_edge_grads: a captured step), the backward adds ∂rbf, ∂u
    # into the sink's sums instead of handing them to autograd, which added them in two kernels. Built at stop 48,
    # on since stop 49: alone 1.011x on 192 water atoms (benzene has no moments layer: 1.001x); with edge_features'
    # zero_in_forward see there (benchmarks/results/stop49_gpu/probe_ncu_sweep_48.md, probe_ncu_sweep_49b.md).
    "into_sink": True,
    # M's two parts [S·R, F] handed to the GEMMs as the same tensors every call (views made once, _frozen.derived),
    # so that the GEMMs' own frozen-weight forms of them (the transpose above 1,024 rows, W's TF32 parts from 2,049)
    # are made once too. M[0] and M[1] were new view objects each call, and the derived forms are keyed by the
    # tensors' identities: every step made two transposes and four TF32 splits again (~22 small kernels in every
    # replay of a 3,000-atom water step; split_tf32 ran 4 times a step in stop 51's cProfile of the eager
    # 24,000-atom step, results/stop51_gpu/probe_eager_host.md). False: the views of before, for A/B sweeps.
    "stable_parts": True,
}


def species_moments_reference(
    rbf: Tensor, unit: Tensor, edge_index: Tensor, species: Tensor, n_species: int, n_atoms: int
) -> tuple[Tensor, Tensor]:
    """Torch reference: ``P [N, S·R]`` (rbf summed per receiver and sender species) and ``Q [N, 3, S·R]`` (the same
    with rbf_e · u_e[k]). ``species [N]``: each atom's species index in ``0 .. S-1``; edges in any order."""
    i, j = edge_index[0], edge_index[1]
    r = rbf.shape[1]
    slot = i * n_species + species.index_select(0, j)
    src = torch.cat([rbf, rbf * unit[:, 0:1], rbf * unit[:, 1:2], rbf * unit[:, 2:3]], 1)  # [E, 4R]
    sums = rbf.new_zeros((n_atoms * n_species, 4 * r)).index_add(0, slot, src)
    sums = sums.view(n_atoms, n_species, 4, r).permute(0, 2, 1, 3)  # [N, 4, S, R]
    p = sums[:, 0].reshape(n_atoms, n_species * r)
    q = sums[:, 1:].reshape(n_atoms, 3, n_species * r)
    return p, q


def _check(rbf, unit, edge_index, species, n_species, row_ptr) -> int:
    """Shapes (host-side, no sync); returns N."""
    n = row_ptr.shape[0] - 1
    if rbf.dim() != 2 or unit.shape != (rbf.shape[0], 3) or edge_index.shape != (2, rbf.shape[0]):
        raise ValueError(
            f"species_moments: rbf [E, R], unit [E, 3], edge_index [2, E] expected, got {tuple(rbf.shape)}, "
            f"{tuple(unit.shape)}, {tuple(edge_index.shape)}"
        )
    if species.shape != (n,) or not 1 <= n_species <= MAX_SPECIES:
        raise ValueError(f"species_moments: species [N = {n}] and 1 <= n_species <= {MAX_SPECIES} expected")
    return n


def species_moments(
    rbf: Tensor,
    unit: Tensor,
    edge_index: Tensor,
    species: Tensor,
    n_species: int,
    row_ptr: Tensor,
) -> tuple[Tensor, Tensor]:
    """:func:`species_moments_reference` (differentiable wrt rbf and unit; once on the Triton path) for edges sorted
    by receiver with CSR offsets ``row_ptr [N + 1]`` (trusted as given; edges past ``row_ptr[N]`` belong to no
    receiver: they add nothing and get zero gradients)."""
    n = _check(rbf, unit, edge_index, species, n_species, row_ptr)
    if HAS_TRITON and resolve_backend(rbf.device) == "triton" and not torch.compiler.is_compiling():
        return _SpeciesMoments.apply(rbf, unit, edge_index, species, int(n_species), row_ptr)
    live = int(row_ptr[n])  # the torch backend: a host read of the live edge count
    return species_moments_reference(rbf[:live], unit[:live], edge_index[:, :live], species, int(n_species), n)


def first_layer_messages(
    rbf: Tensor,
    unit: Tensor,
    edge_index: Tensor,
    species: Tensor,
    n_species: int,
    row_ptr: Tensor,
    m: Tensor,
    edge_sink=None,
) -> tuple[Tensor, Tensor]:
    """``(Δs [N, F], Δv [N, 3, F])`` of a first PaiNN layer: :func:`species_moments` times ``m = [M_a; M_c]``
    ``[2, S·R, F]`` (frozen: no gradient). On the Triton path one autograd node whose two products are the Triton
    GEMMs (first derivatives); elsewhere the moments and two torch matmuls. ``edge_sink``: the step's
    :class:`~mlff_distiller.kernels.edge_sink.EdgeGradSink` (``rbf`` and ``unit`` then come through its
    identity node): the backward adds ∂rbf, ∂u into its sums."""
    n = _check(rbf, unit, edge_index, species, n_species, row_ptr)
    if m.dim() != 3 or m.shape[:2] != (2, n_species * rbf.shape[1]):
        raise ValueError(
            f"first_layer_messages: m must be [2, S·R = {n_species * rbf.shape[1]}, F], got {tuple(m.shape)}"
        )
    if HAS_TRITON and not m.requires_grad:
        from .linear import gemm_fusable

        if gemm_fusable(rbf, m) and resolve_backend(rbf.device) == "triton":
            return _FirstLayerMessages.apply(rbf, unit, edge_index, species, int(n_species), row_ptr, m, edge_sink)
    p, q = species_moments(rbf, unit, edge_index, species, n_species, row_ptr)
    return p @ m[0], (q.reshape(3 * n, -1) @ m[1]).view(n, 3, m.shape[-1])


if HAS_TRITON:
    from ._mp_kernels import _seg_acc
    from ._precision import float32_dot
    from ._triton_utils import pdl_prologue

    @triton.jit(**unspecialized("n_atoms", "ei_stride"))
    def _moments_fwd_kernel(
        rbf_ptr, unit_ptr, ei_ptr, species_ptr, rowptr_ptr, p_ptr, q_ptr, n_atoms, ei_stride,
        N_SPECIES: tl.constexpr, S_PAD: tl.constexpr, N_RBF: tl.constexpr, R_PAD: tl.constexpr,
        BLOCK_A: tl.constexpr, ROWS: tl.constexpr, BLOCK_E: tl.constexpr, DOT_PRECISION: tl.constexpr,
        SEG_SPLIT: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """Moments of BLOCK_A consecutive receivers: rows (a, z) = a * S_PAD + z of the ``[ROWS, R_PAD]`` register
        tiles (ROWS >= BLOCK_A * S_PAD and >= 16 for tl.dot: the rows past BLOCK_A * S_PAD stay zero)."""
        pdl_prologue(PDL)
        a0 = tl.program_id(0).to(tl.int64) * BLOCK_A
        rows = tl.arange(0, ROWS)
        r = tl.arange(0, R_PAD)
        rm = r < N_RBF
        lo = tl.load(rowptr_ptr + a0)
        hi = tl.load(rowptr_ptr + tl.minimum(a0 + BLOCK_A, n_atoms))
        dt = rbf_ptr.dtype.element_ty
        acc_p = tl.zeros((ROWS, R_PAD), dtype=dt)
        acc_0 = tl.zeros((ROWS, R_PAD), dtype=dt)
        acc_1 = tl.zeros((ROWS, R_PAD), dtype=dt)
        acc_2 = tl.zeros((ROWS, R_PAD), dtype=dt)
        for start in range(lo, hi, BLOCK_E):
            e = start + tl.arange(0, BLOCK_E)
            em = e < hi
            i = tl.load(ei_ptr + e, mask=em, other=0).to(tl.int64)
            j = tl.load(ei_ptr + ei_stride + e, mask=em, other=0).to(tl.int64)
            z = tl.load(species_ptr + j, mask=em, other=0).to(tl.int64)
            slot = (i - a0) * S_PAD + z
            onehot = ((slot[None, :] == rows[:, None]) & em[None, :]).to(dt)
            rb = tl.load(rbf_ptr + e[:, None] * N_RBF + r[None, :], mask=em[:, None] & rm[None, :], other=0.0)
            ux = tl.load(unit_ptr + e * 3, mask=em, other=0.0)
            uy = tl.load(unit_ptr + e * 3 + 1, mask=em, other=0.0)
            uz = tl.load(unit_ptr + e * 3 + 2, mask=em, other=0.0)
            acc_p = _seg_acc(acc_p, onehot, rb, DOT_PRECISION, SEG_SPLIT)
            acc_0 = _seg_acc(acc_0, onehot, rb * ux[:, None], DOT_PRECISION, SEG_SPLIT)
            acc_1 = _seg_acc(acc_1, onehot, rb * uy[:, None], DOT_PRECISION, SEG_SPLIT)
            acc_2 = _seg_acc(acc_2, onehot, rb * uz[:, None], DOT_PRECISION, SEG_SPLIT)
        atom = a0 + rows // S_PAD
        z_row = rows % S_PAD
        sr: tl.constexpr = N_SPECIES * N_RBF
        om = ((atom < n_atoms) & (z_row < N_SPECIES) & (rows < BLOCK_A * S_PAD))[:, None] & rm[None, :]
        col = z_row[:, None] * N_RBF + r[None, :]
        tl.store(p_ptr + atom[:, None] * sr + col, acc_p, mask=om)
        qrow = q_ptr + atom[:, None] * (3 * sr) + col
        tl.store(qrow, acc_0, mask=om)
        tl.store(qrow + sr, acc_1, mask=om)
        tl.store(qrow + 2 * sr, acc_2, mask=om)

    @triton.jit(**unspecialized("n_edges", "ei_stride"))
    def _moments_bwd_kernel(
        gp_ptr, gq_ptr, rbf_ptr, unit_ptr, ei_ptr, species_ptr, live_ptr, grbf_ptr, gunit_ptr, n_edges, ei_stride,
        N_SPECIES: tl.constexpr, N_RBF: tl.constexpr, R_PAD: tl.constexpr, BLOCK_E: tl.constexpr, ACC: tl.constexpr,
        PDL: tl.constexpr,
    ):  # fmt: skip
        """∂rbf_e = ∂P_i[z_j] + Σ_k u_e[k] ∂Q_i[k, z_j], ∂u_e[k] = ⟨rbf_e, ∂Q_i[k, z_j]⟩ for a tile of edges; zero rows
        for the edges past row_ptr[N] (no receiver). ACC: added to what the outputs hold."""
        pdl_prologue(PDL)
        e = tl.program_id(0).to(tl.int64) * BLOCK_E + tl.arange(0, BLOCK_E)
        inside = e < n_edges
        em = inside & (e < tl.load(live_ptr))
        r = tl.arange(0, R_PAD)
        rm = r < N_RBF
        m2 = em[:, None] & rm[None, :]
        i = tl.load(ei_ptr + e, mask=em, other=0).to(tl.int64)
        j = tl.load(ei_ptr + ei_stride + e, mask=em, other=0).to(tl.int64)
        z = tl.load(species_ptr + j, mask=em, other=0).to(tl.int64)
        sr: tl.constexpr = N_SPECIES * N_RBF
        col = z[:, None] * N_RBF + r[None, :]
        gp = tl.load(gp_ptr + i[:, None] * sr + col, mask=m2, other=0.0)
        gq = gq_ptr + i[:, None] * (3 * sr) + col
        g0 = tl.load(gq, mask=m2, other=0.0)
        g1 = tl.load(gq + sr, mask=m2, other=0.0)
        g2 = tl.load(gq + 2 * sr, mask=m2, other=0.0)
        rb = tl.load(rbf_ptr + e[:, None] * N_RBF + r[None, :], mask=m2, other=0.0)
        ux = tl.load(unit_ptr + e * 3, mask=em, other=0.0)
        uy = tl.load(unit_ptr + e * 3 + 1, mask=em, other=0.0)
        uz = tl.load(unit_ptr + e * 3 + 2, mask=em, other=0.0)
        g_rbf = gp + ux[:, None] * g0 + uy[:, None] * g1 + uz[:, None] * g2
        gux = tl.sum(rb * g0, axis=1)
        guy = tl.sum(rb * g1, axis=1)
        guz = tl.sum(rb * g2, axis=1)
        out = grbf_ptr + e[:, None] * N_RBF + r[None, :]
        if ACC:
            g_rbf += tl.load(out, mask=inside[:, None] & rm[None, :], other=0.0)
            gux += tl.load(gunit_ptr + e * 3, mask=inside, other=0.0)
            guy += tl.load(gunit_ptr + e * 3 + 1, mask=inside, other=0.0)
            guz += tl.load(gunit_ptr + e * 3 + 2, mask=inside, other=0.0)
        tl.store(out, g_rbf, mask=inside[:, None] & rm[None, :])
        tl.store(gunit_ptr + e * 3, gux, mask=inside)
        tl.store(gunit_ptr + e * 3 + 1, guy, mask=inside)
        tl.store(gunit_ptr + e * 3 + 2, guz, mask=inside)

    def _pow2(n: int) -> int:
        return 1 << max(0, int(n) - 1).bit_length()

    def _block_a(ref: Tensor, n_atoms: int, n_species: int) -> int:
        """Receivers per forward program: as many as ``rows`` holds (a power of two), fewer while that leaves fewer
        than ``programs_per_sm`` programs per SM (down to one)."""
        block = max(1, _CONFIG["rows"] // _pow2(n_species))
        if ref.is_cuda:
            least = _CONFIG["programs_per_sm"] * torch.cuda.get_device_properties(ref.device).multi_processor_count
            while block > 1 and cdiv(n_atoms, block) < least:
                block //= 2
        return block

    def _dot(ref: Tensor) -> tuple[str, bool]:
        """(dot precision, seg_split): the one-hot sums exact in float32 on CUDA (two TF32 MMAs of hi / lo, as the
        message-passing block kernels), one TF32 pass under the engine's reduced precisions; ieee otherwise."""
        if ref.is_cuda and ref.dtype == torch.float32:
            prec = float32_dot("tf32x3")
            return prec, prec == "tf32x3"
        return "ieee", False

    def _forward(rbf, unit, edge_index, species, n_species, row_ptr):
        rbf, unit, species, row_ptr = rbf.contiguous(), unit.contiguous(), species.contiguous(), row_ptr.contiguous()
        n = row_ptr.shape[0] - 1
        e, n_rbf = rbf.shape
        sr = n_species * n_rbf
        p = rbf.new_empty((n, sr))
        q = rbf.new_empty((n, 3, sr))
        if n == 0:
            return p, q
        if e == 0 or n_rbf == 0:
            return p.zero_(), q.zero_()
        prec, split = _dot(rbf)
        block_a = _block_a(rbf, n, n_species)
        check_launchable(_moments_fwd_kernel, rbf)
        _moments_fwd_kernel[(cdiv(n, block_a),)](
            rbf, unit, edge_index, species, row_ptr, p, q, n, edge_index.stride(0),
            N_SPECIES=n_species, S_PAD=_pow2(n_species), N_RBF=n_rbf, R_PAD=max(16, _pow2(n_rbf)), BLOCK_A=block_a,
            ROWS=max(16, block_a * _pow2(n_species)), BLOCK_E=_CONFIG["block_e"], DOT_PRECISION=prec, SEG_SPLIT=split,
            num_warps=_CONFIG["num_warps"],
            **pdl_args(rbf),
        )  # fmt: skip
        return p, q

    def _backward(gp, gq, rbf, unit, edge_index, species, n_species, row_ptr, out=None, accumulate=False):
        """``(∂rbf, ∂u)``; ``out``: the two tensors to write them into (else new ones), or with ``accumulate`` to
        add them to."""
        e, n_rbf = rbf.shape
        n = row_ptr.shape[0] - 1
        g_rbf, g_unit = (torch.empty_like(rbf), torch.empty_like(unit)) if out is None else out
        if e == 0:
            return g_rbf, g_unit
        gp = rbf.new_zeros((n, n_species * n_rbf)) if gp is None else gp.to(rbf.dtype).contiguous()
        gq = rbf.new_zeros((n, 3, n_species * n_rbf)) if gq is None else gq.to(rbf.dtype).contiguous()
        block_e = _CONFIG["bwd_block_e"]
        check_launchable(_moments_bwd_kernel, rbf)
        _moments_bwd_kernel[(cdiv(e, block_e),)](
            gp, gq, rbf, unit, edge_index, species, row_ptr[n:], g_rbf, g_unit, e, edge_index.stride(0),
            N_SPECIES=n_species, N_RBF=n_rbf, R_PAD=max(16, _pow2(n_rbf)), BLOCK_E=block_e, ACC=accumulate,
            num_warps=_CONFIG["num_warps"], **pdl_args(rbf),
        )  # fmt: skip
        return g_rbf, g_unit

    class _SpeciesMoments(torch.autograd.Function):
        @staticmethod
        def forward(ctx, rbf, unit, edge_index, species, n_species, row_ptr):
            ctx.set_materialize_grads(False)
            ctx.n_species = n_species
            rbf, unit = rbf.contiguous(), unit.contiguous()
            ctx.save_for_backward(rbf, unit, edge_index, species, row_ptr)
            return _forward(rbf, unit, edge_index, species, n_species, row_ptr)

        @staticmethod
        def backward(ctx, gp, gq):
            rbf, unit, edge_index, species, row_ptr = ctx.saved_tensors
            if gp is None and gq is None:
                return None, None, None, None, None, None
            with torch.no_grad():
                g_rbf, g_unit = _backward(gp, gq, rbf, unit, edge_index, species, ctx.n_species, row_ptr)
            if torch.is_grad_enabled():  # create_graph=True: a second derivative raises
                depends = [t for t in (gp, gq, rbf, unit) if t is not None]
                g_rbf, g_unit = FirstOrderOnly.apply("the species moments (first layer)", 2, g_rbf, g_unit, *depends)
            return g_rbf, g_unit, None, None, None, None

    def _part0(m: Tensor) -> Tensor:
        return m[0]

    def _part1(m: Tensor) -> Tensor:
        return m[1]

    def _m_parts(m: Tensor) -> tuple[Tensor, Tensor]:
        """``M[0]``, ``M[1]``: the same tensors while M is (``_CONFIG["stable_parts"]``)."""
        if not _CONFIG["stable_parts"]:
            return m[0], m[1]
        return derived("moments_part0", _part0, m), derived("moments_part1", _part1, m)

    class _FirstLayerMessages(torch.autograd.Function):
        """Moments, then the two products with M on the Triton GEMMs; backward: the transposed products, then the
        moments' backward kernel. First derivatives only."""

        @staticmethod
        def forward(ctx, rbf, unit, edge_index, species, n_species, row_ptr, m, sink=None):
            from .linear import gemm, resolved_dot

            ctx.set_materialize_grads(False)
            ctx.n_species, ctx.sink = n_species, sink
            ctx.dot = dot = resolved_dot(rbf)
            rbf, unit = rbf.contiguous(), unit.contiguous()
            ctx.save_for_backward(rbf, unit, edge_index, species, row_ptr, m)
            p, q = _forward(rbf, unit, edge_index, species, n_species, row_ptr)
            n, f = p.shape[0], m.shape[2]
            m0, m1 = _m_parts(m)
            ds, _ = gemm(p, m0, transpose_w=False, dot=dot)
            dv, _ = gemm(q.view(3 * n, -1), m1, transpose_w=False, dot=dot)
            return ds, dv.view(n, 3, f)

        @staticmethod
        def backward(ctx, g_ds, g_dv):
            from .linear import gemm

            rbf, unit, edge_index, species, row_ptr, m = ctx.saved_tensors
            if g_ds is None and g_dv is None:
                return (None,) * 8
            n = row_ptr.shape[0] - 1
            sink = ctx.sink
            # Into the sink's sums where its node runs in this backward (as the message layers' edge kernels do),
            # on this stream after joining the sink's: the node then hands the sums on without adding anything.
            into = sink is not None and _CONFIG["into_sink"] and not torch.is_grad_enabled() and sink.joins()
            with torch.no_grad():
                m0, m1 = _m_parts(m)
                gp = None if g_ds is None else gemm(g_ds.to(m.dtype).contiguous(), m0, dot=ctx.dot)[0]
                gq = None
                if g_dv is not None:
                    gq = gemm(g_dv.to(m.dtype).contiguous().view(3 * n, -1), m1, dot=ctx.dot)[0].view(n, 3, -1)
                args = (gp, gq, rbf, unit, edge_index, species, ctx.n_species, row_ptr)
                if into:
                    _moments_grads_into(sink, *args)
                    return (None,) * 8
                g_rbf, g_unit = _backward(*args)
            if torch.is_grad_enabled():  # create_graph=True: a second derivative raises
                depends = [t for t in (g_ds, g_dv, rbf, unit) if t is not None]
                g_rbf, g_unit = FirstOrderOnly.apply("the first layer's moments", 2, g_rbf, g_unit, *depends)
            return g_rbf, g_unit, None, None, None, None, None, None

    def _moments_grads_into(sink, *args) -> None:
        """The moments' ∂rbf, ∂u added into the sink's sums (written, where no layer has yet) on the caller's
        stream, once it has joined the sink's stream (whose edge kernels write the same sums)."""
        # (stream None: one stream, as the CPU tests make; not forked: no layer's edge kernel ran on it, e.g. a
        # one-layer student's, and a wait on a stream outside the capture would invalidate it.)
        if sink.stream is not None and sink.forked:
            torch.cuda.current_stream(sink.rbf.device).wait_stream(sink.stream)
        _backward(*args, out=sink.buffers(), accumulate=sink.filled)
        sink.filled = True
