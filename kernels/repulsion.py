"""A short-range pair repulsion under the student: the ZBL universal screened-nuclear potential, switched on
smoothly below a radius per element pair.

A student learns its energy from training frames; at pair distances shorter than any it saw it can say anything,
and a learned energy there is often attractive: a rattled singlet CH2 relaxed with ASE's FIRE pulled an H into
the carbon (0.74 → 0.29 Å in three steps) until the forces were not finite (stop 35, ``relax_batch``). MACE and
nequip add a ZBL pair term for the same reason. Here it is added below the training data only, so that a student
inside its training envelope is unchanged: for a pair of elements (a, b) with radius ``r_off``,

    E_ab(r) = k_e Z_a Z_b / r · φ(r / a_ab) · S(r),   a_ab = 0.8854 a_0 / (Z_a^0.23 + Z_b^0.23),
    φ(x) = 0.18175 e^(-3.19980 x) + 0.50986 e^(-0.94229 x) + 0.28022 e^(-0.40290 x) + 0.02817 e^(-0.20162 x),
    S(r) = 1 - t³ (10 - 15 t + 6 t²),   t = clamp((r - r_on) / (r_off - r_on), 0, 1),

(Ziegler, Biersack and Littmark, 1985), so E, dE/dr and d²E/dr² are exactly 0 from ``r_off`` on, and the full ZBL
below ``r_on``. Each directed edge ``i <- j`` adds half its pair's energy to the receiver ``i``.

It also returns each edge's **gate** ``1 - S(r)`` (1 outside the wall, 0 below ``r_on``), by which the model
multiplies the edge's radial basis: inside the wall the student's own message for that pair fades out, and below
``r_on`` only ZBL acts on it. Without the gate the wall met the student's extrapolation, which in hot MD grew as fast
as the wall (a C-C pair at 0.33 Å: the student's pull ~1,000 eV/Å against ZBL's ~1,400; 5e33 eV/Å at 0.11 Å;
``benchmarks/probe_hot_md.py``). Outside the wall the gate is exactly 1, and the model's results are unchanged bit
for bit.

The op takes the distances of the model's edge geometry, so forces and stress follow through its backward. Layout
of ``table`` (:func:`repulsion_table`): ``[S * S + 3, 4]``, rows ``(r_on, r_off, k_e Z_a Z_b, 1 / a_ab)`` indexed
by ``S · idx_i + idx_j`` over the model's S species (``r_off = 0``: no repulsion for that pair), then the constants
``(c_1..c_4)``, ``(d_1..d_4)`` and ``(R_MIN, 0, 0, 0)`` in the table's dtype: Triton would round literals in a
kernel to float32, 1e-8 off in a float64 step.

Triton (GPU, or CPU under the interpreter): the forward is one launch that evaluates the pairs, writes each edge's
gate and adds its energy into the per-atom and per-structure outputs with atomics, only for edges inside ``r_off``
(in a student's own domain no edge is, and the atomics never fire). The backward is one launch writing dL/dr per
edge.
Its own backward (training differentiates the forces again) is the torch reference's, whose every op is
differentiable. The torch reference is the CPU path, the ``torch`` backend's and ``torch.compile``'s.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor

from ._backend import resolve_backend
from ._triton_utils import HAS_TRITON, cdiv, check_launchable, tl, triton, unspecialized

__all__ = [
    "K_E",
    "add_pair_repulsion",
    "pair_repulsion",
    "pair_repulsion_reference",
    "repulsion_table",
    "wall_gate_reference",
    "wall_touched",
    "zbl_energy",
]

K_E = 14.399645  # e² / (4π ε0), eV Å
_A0 = 0.8854 * 0.529177  # 0.8854 × the Bohr radius, Å
_C = (0.18175, 0.50986, 0.28022, 0.02817)
_D = (3.19980, 0.94229, 0.40290, 0.20162)
ON_FRACTION = 2.0 / 3.0  # r_on = ON_FRACTION · r_off
# Distances are evaluated from this on (Å): coincident atoms get a large finite energy, never inf or NaN.
R_MIN = 1e-4
_BLOCK = 256


def repulsion_table(species: list[int], radii: Mapping[tuple[int, int], float], dtype=torch.float32) -> Tensor:
    """The op's ``[S * S + 3, 4]`` table for a model's ``species`` (sorted atomic numbers) and ``radii``
    ``{(Z_a, Z_b): r_off}`` in Å (either order; pairs left out get no repulsion)."""
    s = len(species)
    table = torch.zeros((s * s + 3, 4), dtype=torch.float64)
    table[s * s] = torch.tensor(_C, dtype=torch.float64)
    table[s * s + 1] = torch.tensor(_D, dtype=torch.float64)
    table[s * s + 2, 0] = R_MIN
    for (za, zb), r_off in radii.items():
        if za not in species or zb not in species:
            raise ValueError(f"repulsion radius for the pair ({za}, {zb}): not among the model's species {species}")
        if not (math.isfinite(r_off) and r_off >= 0):
            raise ValueError(f"repulsion radius for the pair ({za}, {zb}) must be finite and >= 0 Å, got {r_off}")
        if r_off == 0:
            continue
        a, b = species.index(za), species.index(zb)
        row = (ON_FRACTION * r_off, r_off, K_E * za * zb, (za**0.23 + zb**0.23) / _A0)
        table[a * s + b] = torch.tensor(row, dtype=torch.float64)
        table[b * s + a] = table[a * s + b]
    return table.to(dtype)


def _terms(dist: Tensor, p: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(e, de/dr, gate, dgate/dr)`` per edge: half the switched ZBL pair energy, the gate ``1 - S(r)``, and their
    derivatives, from ``p = table[code]``: every op differentiable (the reference's forward and the Triton op's
    double backward)."""
    r_on, r_off, kzz, inv_a = p.unbind(1)
    on = dist < r_off
    width = torch.where(on, r_off - r_on, torch.ones_like(r_off))
    t = ((dist - r_on) / width).clamp(0.0, 1.0)
    sw = 1.0 - t * t * t * (10.0 - 15.0 * t + 6.0 * t * t)
    dsw = torch.where((t > 0) & (t < 1), -30.0 * t * t * (1.0 - t) * (1.0 - t) / width, torch.zeros_like(t))
    r = dist.clamp_min(R_MIN)
    x = r * inv_a
    phi = torch.zeros_like(x)
    dphi = torch.zeros_like(x)
    for c, d in zip(_C, _D, strict=True):
        ex = torch.exp(-d * x)
        phi = phi + c * ex
        dphi = dphi - (c * d) * ex
    energy = kzz / r * phi
    d_energy = kzz / r * (dphi * inv_a - phi / r)
    zero = torch.zeros_like(dist)
    e = torch.where(on, 0.5 * energy * sw, zero)
    de = torch.where(on & (dist >= R_MIN), 0.5 * (d_energy * sw + energy * dsw), zero)
    gate = torch.where(on, 1.0 - sw, torch.ones_like(dist))
    dgate = torch.where(on, -dsw, zero)
    return e, de, gate, dgate


def _n_species(table: Tensor) -> int:
    s = math.isqrt(max(table.shape[0] - 3, 0))
    if table.dim() != 2 or table.shape[1] != 4 or s < 1 or s * s + 3 != table.shape[0]:
        raise ValueError(f"pair_repulsion: table must be [S*S + 3, 4] (repulsion_table), got {tuple(table.shape)}")
    return s


def _params(edge_index: Tensor, idx: Tensor, table: Tensor) -> Tensor:
    s = _n_species(table)
    return table.index_select(0, idx.index_select(0, edge_index[0]) * s + idx.index_select(0, edge_index[1]))


def wall_touched(dist: Tensor, edge_index: Tensor, idx: Tensor, table: Tensor) -> bool:
    """Whether any edge lies inside its pair's wall, and so whether the op can change anything: False means zero
    energies and a gate of exactly 1. Decided on the host for CPU tensors (a few small ops, against ~1 ms of the
    reference's forward and backward on a 2-core CPU for a small molecule); True elsewhere (on a GPU the answer would
    cost a device sync, and a captured step cannot branch) and under ``torch.compile``."""
    if dist.device.type != "cpu" or torch.compiler.is_compiling() or edge_index.shape[1] == 0:
        return dist.device.type != "cpu" or torch.compiler.is_compiling()
    s = _n_species(table)
    r_off = table[:, 1].index_select(0, idx.index_select(0, edge_index[0]) * s + idx.index_select(0, edge_index[1]))
    return bool((dist.detach() < r_off).any())


def wall_gate_reference(dist: Tensor, edge_index: Tensor, idx: Tensor, table: Tensor) -> Tensor:
    """Each edge's gate ``1 - S(r)`` ``[E]`` (1 outside its pair's wall, 0 below ``r_on``) in differentiable torch
    ops: what :func:`~mlff_distiller.kernels.edge_basis` multiplies the radial basis by on its torch path."""
    return _terms(dist, _params(edge_index, idx, table.to(dist.dtype)))[2]


def zbl_energy(r: Tensor, z_a: int, z_b: int) -> Tensor:
    """The unswitched ZBL pair energy (eV) at distances ``r`` (Å): the formula, for tests and plots."""
    x = r * (z_a**0.23 + z_b**0.23) / _A0
    return K_E * z_a * z_b / r * sum(c * torch.exp(-d * x) for c, d in zip(_C, _D, strict=True))


def pair_repulsion_reference(
    dist: Tensor, edge_index: Tensor, idx: Tensor, table: Tensor, batch: Tensor, num_structures: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Torch reference: ``(atomic [N], energy [B], gate [E])``: the repulsion energies (eV) of the edges ``i <- j``
    at distances ``dist [E]``, for atoms of species index ``idx [N]`` in structures ``batch [N]``, and each edge's
    gate (see the module docstring)."""
    e, _, gate, _ = _terms(dist, _params(edge_index, idx, table))
    atomic = e.new_zeros(idx.shape[0]).index_add(0, edge_index[0], e)
    return atomic, e.new_zeros(num_structures).index_add(0, batch, atomic), gate


def _grad_reference(dist, edge_index, idx, table, batch, g_atomic, g_energy, g_gate) -> Tensor:
    """dL/d dist from dL/d atomic, dL/d energy and dL/d gate (each may be None: zero), in differentiable torch ops
    (the double backward)."""
    _, de, _, dgate = _terms(dist, _params(edge_index, idx, table))
    i = edge_index[0]
    g = torch.zeros_like(dist)
    if g_atomic is not None:
        g = g + g_atomic.index_select(0, i)
    if g_energy is not None:
        g = g + g_energy.index_select(0, batch.index_select(0, i)).to(dist.dtype)
    out = de * g
    return out if g_gate is None else out + dgate * g_gate


def pair_repulsion(
    dist: Tensor, edge_index: Tensor, idx: Tensor, table: Tensor, batch: Tensor, num_structures: int
) -> tuple[Tensor, Tensor, Tensor]:
    """``(atomic [N], energy [B], gate [E])``: see :func:`pair_repulsion_reference`; differentiable twice in
    ``dist``."""
    n_edges = edge_index.shape[1]
    _n_species(table)
    if dist.shape != (n_edges,) or idx.shape != batch.shape:
        raise ValueError(
            f"pair_repulsion: dist [E], edge_index [2, E], table [S*S + 3, 4], idx and batch [N] expected; got "
            f"{tuple(dist.shape)}, {tuple(edge_index.shape)}, {tuple(table.shape)}, {tuple(idx.shape)}, "
            f"{tuple(batch.shape)}"
        )
    if n_edges > 0 and not torch.compiler.is_compiling() and resolve_backend(dist.device) == "triton":
        return _PairRepulsion.apply(dist, edge_index, idx, table.to(dist.dtype), batch, num_structures)
    return pair_repulsion_reference(dist, edge_index, idx, table.to(dist.dtype), batch, num_structures)


if HAS_TRITON:

    @triton.jit
    def _switched_zbl(r, r_on, r_off, kzz, inv_a, consts):
        """Half the switched pair energy and its derivative at r (the reference's ``_terms``); ``consts``: the
        table's constant rows."""
        width = r_off - r_on
        t = tl.minimum(tl.maximum((r - r_on) / width, 0.0), 1.0)
        sw = 1.0 - t * t * t * (10.0 - 15.0 * t + 6.0 * t * t)
        dsw = -30.0 * t * t * (1.0 - t) * (1.0 - t) / width
        r_min = tl.load(consts + 8)
        rc = tl.maximum(r, r_min)
        x = rc * inv_a
        c1, c2, c3, c4 = tl.load(consts), tl.load(consts + 1), tl.load(consts + 2), tl.load(consts + 3)
        d1, d2, d3, d4 = tl.load(consts + 4), tl.load(consts + 5), tl.load(consts + 6), tl.load(consts + 7)
        e1 = c1 * tl.exp(-d1 * x)
        e2 = c2 * tl.exp(-d2 * x)
        e3 = c3 * tl.exp(-d3 * x)
        e4 = c4 * tl.exp(-d4 * x)
        phi = e1 + e2 + e3 + e4
        dphi = -(d1 * e1 + d2 * e2 + d3 * e3 + d4 * e4)
        energy = kzz / rc * phi
        d_energy = kzz / rc * (dphi * inv_a - phi / rc)
        de = tl.where(r >= r_min, 0.5 * (d_energy * sw + energy * dsw), 0.0)
        return 0.5 * energy * sw, de, sw, dsw

    @triton.jit
    def _edge_terms(dist, ei, idx, table, n_edges, n_species, BLOCK: tl.constexpr):
        """One program's edges: ``(offs, in range, receivers, inside the wall, e, de/dr, gate, dgate/dr)``."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n_edges
        i = tl.load(ei + offs, mask=m, other=0)
        j = tl.load(ei + n_edges + offs, mask=m, other=0)
        code = tl.load(idx + i, mask=m, other=0) * n_species + tl.load(idx + j, mask=m, other=0)
        r = tl.load(dist + offs, mask=m, other=0.0)
        on, e, de, gate, dgate = _pair_terms(r, code, m, table, n_species)
        return offs, m, i, on, e, de, gate, dgate

    @triton.jit
    def _pair_terms(r, code, m, table, n_species):
        """Pairs at distances ``r`` of species code ``code`` (``S · idx_i + idx_j``; rows ``m``): ``(inside the wall,
        e, de/dr, gate, dgate/dr)``, each a tensor of ``r``'s shape (the edge kernels' and the dense step's,
        :mod:`.dense_step`)."""
        r_off = tl.load(table + code * 4 + 1, mask=m, other=0.0)
        on = m & (r < r_off)
        r_on = tl.load(table + code * 4, mask=on, other=0.0)
        kzz = tl.load(table + code * 4 + 2, mask=on, other=0.0)
        inv_a = tl.load(table + code * 4 + 3, mask=on, other=1.0)
        consts = table + n_species * n_species * 4
        e, de, sw, dsw = _switched_zbl(r, r_on, tl.where(on, r_off, r_on + 1.0), kzz, inv_a, consts)
        return on, e, de, tl.where(on, 1.0 - sw, 1.0), tl.where(on, -dsw, 0.0)

    @triton.jit
    def _wall_gate(i, j, d, m, idx, table, n_species, ORDER: tl.constexpr):
        """The gate ``1 - S(r)`` of the edges ``i <- j`` at distances ``d`` (rows ``m``) and, up to ORDER, its
        first and second derivatives in r (else zeros): what the edge kernels (:mod:`._edge_kernels`) fold into
        the radial basis's envelope, so that the gated basis costs no pass of its own. With t = (r - r_on) /
        (r_off - r_on) in [0, 1]: gate = 10 t³ - 15 t⁴ + 6 t⁵, gate' = 30 t² (1 - t)² / w, gate'' = 60 t (1 - t)
        (1 - 2t) / w²; exactly 1, 0, 0 from r_off on and for pairs without a wall."""
        code = tl.load(idx + i, mask=m, other=0).to(tl.int64) * n_species + tl.load(idx + j, mask=m, other=0)
        r_off = tl.load(table + code * 4 + 1, mask=m, other=0.0)
        on = m & (d < r_off)
        r_on = tl.load(table + code * 4, mask=on, other=0.0)
        width = tl.where(on, r_off - r_on, 1.0)
        inv_w = 1.0 / width
        t = tl.minimum(tl.maximum((d - r_on) * inv_w, 0.0), 1.0)
        omt = 1.0 - t
        gate = tl.where(on, t * t * t * (10.0 - 15.0 * t + 6.0 * t * t), 1.0)
        g1 = tl.zeros_like(gate)
        g2 = tl.zeros_like(gate)
        if ORDER >= 1:
            g1 = tl.where(on, 30.0 * t * t * omt * omt * inv_w, 0.0)
        if ORDER >= 2:
            g2 = tl.where(on, 60.0 * t * omt * (1.0 - 2.0 * t) * inv_w * inv_w, 0.0)
        return gate, g1, g2

    @triton.jit(**unspecialized("n_edges", aligned=("energy",)))
    def _pair_repulsion_fwd_kernel(
        dist, ei, idx, batch, table, atomic, energy, gate_out, n_edges, n_species,
        STORE_GATE: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        offs, m, i, on, e, _, gate, _ = _edge_terms(dist, ei, idx, table, n_edges, n_species, BLOCK)
        if STORE_GATE:
            tl.store(gate_out + offs, gate, mask=m)
        tl.atomic_add(atomic + i, e, mask=on)
        b = tl.load(batch + i, mask=on, other=0)
        tl.atomic_add(energy + b, e.to(energy.dtype.element_ty), mask=on)  # (the sums may be float64)

    # The vector-Jacobian product: atomic_i = Σ_{edges e = (i <- j)} e(r_e), energy_b = Σ_{i in b} atomic_i and
    # gate_e = 1 - S(r_e), so dL/dr_e = e'(r_e) · (dL/d atomic_i + dL/d energy_{batch_i}) + gate'(r_e) · dL/d gate_e;
    # 0 for edges outside their pair's r_off. A gradient without its flag is zero (the engine's steps seed only the
    # energies; a model without the gate's consumer gives none).
    @triton.jit(**unspecialized("n_edges", aligned=("g_atomic", "g_energy")))
    def _pair_repulsion_bwd_kernel(
        dist, ei, idx, batch, table, g_atomic, g_energy, g_gate, g_dist, n_edges, n_species,
        HAS_GA: tl.constexpr, HAS_GE: tl.constexpr, HAS_GG: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        offs, m, i, on, _, de, _, dgate = _edge_terms(dist, ei, idx, table, n_edges, n_species, BLOCK)
        g = tl.zeros_like(de)
        if HAS_GE:
            b = tl.load(batch + i, mask=on, other=0)
            g += tl.load(g_energy + b, mask=on, other=0.0).to(g.dtype)  # (float64 for float64 energies)
        if HAS_GA:
            g += tl.load(g_atomic + i, mask=on, other=0.0)
        out = de * g
        if HAS_GG:
            out += dgate * tl.load(g_gate + offs, mask=on, other=0.0)
        tl.store(g_dist + offs, tl.where(on, out, 0.0), mask=m)


def add_pair_repulsion(
    atomic: Tensor, energy: Tensor, dist: Tensor, edge_index: Tensor, idx: Tensor, table: Tensor, batch: Tensor
) -> tuple[Tensor, Tensor]:
    """``atomic [N]`` and ``energy [B]`` (the student's energies) plus the wall's (:func:`pair_repulsion`'s first two
    outputs), differentiable twice in ``dist``. On the Triton path one copy of both inputs into one buffer and the
    wall's forward adding into it: two launches where the op and two adds took four."""
    if atomic.shape != idx.shape or energy.dim() != 1:
        raise ValueError(
            f"add_pair_repulsion: atomic [N] and energy [B] expected, got {tuple(atomic.shape)}, {tuple(energy.shape)}"
        )
    fused = (
        edge_index.shape[1] > 0
        and not torch.compiler.is_compiling()
        and resolve_backend(dist.device) == "triton"
        and atomic.dtype == dist.dtype
        and energy.dtype in (dist.dtype, torch.float64)
    )
    if fused:
        _n_species(table)
        return _AddPairRepulsion.apply(atomic, energy, dist, edge_index, idx, table.to(dist.dtype), batch)
    a, e, _ = pair_repulsion(dist, edge_index, idx, table, batch, energy.shape[0])
    return atomic + a, energy + e


# Unlike the model's other Triton kernels, the two here are launched without programmatic dependent launch (PDL):
# chained to their neighbours by PDL (a switch built at stop 48) they measured no gain in a captured step on an H200 at
# stop 49 (shipped / PDL: 1.001 benzene, 1.002 192 water atoms, 0.998 1,024 g2 molecules;
# benchmarks/results/stop49_gpu/probe_ncu_sweep_48.md, probe_ncu_sweep_49b.md). Dropped with the readout's wall
# (linear.py); the code is in benchmarks/results/stop49_gpu/wall_packed_pdl_dropped.diff.
def _launch(kernel, dist, edge_index, idx, table, batch, *tensors, **flags) -> None:
    check_launchable(kernel, dist)
    n_edges = edge_index.shape[1]
    grid = (cdiv(n_edges, _BLOCK),)
    kernel[grid](dist, edge_index, idx, batch, table, *tensors, n_edges, _n_species(table), **flags, BLOCK=_BLOCK)


class _PairRepulsion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dist, edge_index, idx, table, batch, num_structures):
        if not HAS_TRITON:
            raise RuntimeError("the Triton pair repulsion needs triton installed; use MLFF_DISTILLER_KERNELS=torch")
        dist, edge_index, idx = dist.contiguous(), edge_index.contiguous(), idx.contiguous()
        table, batch = table.contiguous(), batch.contiguous()
        n = idx.shape[0]
        out = dist.new_zeros(n + num_structures)  # one fill for both sums
        atomic, energy = out[:n], out[n:]
        gate = torch.empty_like(dist)
        _launch(_pair_repulsion_fwd_kernel, dist, edge_index, idx, table, batch, atomic, energy, gate, STORE_GATE=True)
        ctx.save_for_backward(dist, edge_index, idx, table, batch)
        # An output without a gradient stays None in the backward (the engine seeds only the energies): no
        # zeros to fill for it.
        ctx.set_materialize_grads(False)
        return atomic, energy, gate

    @staticmethod
    def backward(ctx, g_atomic, g_energy, g_gate):
        nothing = (None,) * 5
        if not ctx.needs_input_grad[0] or (g_atomic is None and g_energy is None and g_gate is None):
            return None, *nothing
        return _dist_grad(ctx.saved_tensors, g_atomic, g_energy, g_gate), *nothing


def _dist_grad(saved, g_atomic, g_energy, g_gate) -> Tensor:
    """dL/d dist of the Triton ops from the saved ``(dist, edge_index, idx, table, batch)`` and the outputs'
    gradients (None: zero; not all None)."""
    dist, edge_index, idx, table, batch = saved
    if torch.is_grad_enabled():  # the forces are differentiated again (training): the reference's ops
        return _grad_reference(dist, edge_index, idx, table, batch, g_atomic, g_energy, g_gate)
    g_dist = torch.empty_like(dist)
    flags = {"HAS_GA": g_atomic is not None, "HAS_GE": g_energy is not None, "HAS_GG": g_gate is not None}
    # The energies' gradient as it comes (float64 for float64 energies: the kernel rounds it as it loads it).
    g_atomic, g_gate = (None if g is None else g.to(dist.dtype) for g in (g_atomic, g_gate))
    grads = [dist if g is None else g.contiguous() for g in (g_atomic, g_energy, g_gate)]
    _launch(_pair_repulsion_bwd_kernel, dist, edge_index, idx, table, batch, *grads, g_dist, **flags)
    return g_dist


class _AddPairRepulsion(torch.autograd.Function):
    """:func:`add_pair_repulsion` on the Triton kernels: ``cat(atomic, energy)``, then the forward's atomics into
    it; the backward passes the energies' gradients through and computes dL/d dist as :class:`_PairRepulsion`."""

    @staticmethod
    def forward(ctx, atomic, energy, dist, edge_index, idx, table, batch):
        if not HAS_TRITON:
            raise RuntimeError("the Triton pair repulsion needs triton installed; use MLFF_DISTILLER_KERNELS=torch")
        dist, edge_index, idx = dist.contiguous(), edge_index.contiguous(), idx.contiguous()
        table, batch = table.contiguous(), batch.contiguous()
        n = atomic.shape[0]
        if energy.dtype == atomic.dtype:
            out = torch.cat([atomic.detach(), energy.detach()])
            total_atomic, total_energy = out[:n], out[n:]
        else:  # float64 energies (the readout's sums) beside float32 atomic energies: a copy of each
            total_atomic, total_energy = atomic.detach().clone(), energy.detach().clone()
        _launch(
            _pair_repulsion_fwd_kernel, dist, edge_index, idx, table, batch, total_atomic, total_energy, dist,
            STORE_GATE=False,
        )  # fmt: skip
        ctx.save_for_backward(dist, edge_index, idx, table, batch)
        ctx.set_materialize_grads(False)
        return total_atomic, total_energy

    @staticmethod
    def backward(ctx, g_atomic, g_energy):
        g_dist = None
        if ctx.needs_input_grad[2] and (g_atomic is not None or g_energy is not None):
            g_dist = _dist_grad(ctx.saved_tensors, g_atomic, g_energy, None)
        return g_atomic, g_energy, g_dist, None, None, None, None
