"""Energy and its gradients of a :class:`~mlff_distiller.model.StudentModel` with the backward written out: the
CPU path of :class:`~mlff_distiller.engine.ForceEngine`.

On a CPU the torch reference path is bound by the overhead of its small operations, forward and autograd's
backward together ~1,400 ATen calls per step for ethanol (``benchmarks/results/cpu_md_student_vs_gfn2.md``: 4-7 ms
per MD step whatever the molecule's size below ~20 atoms). Here the layers' backward is written out in torch as
the chain rule of the forward (the same algebra as ``kernels.message_passing``'s backward kernels, whose torch spec
is ``message_passing_backward_reference``): no graph is recorded, no tensor saved twice, and the first layer's
zero vector features skip their terms in the backward too. The geometry (pair vectors → distances, unit vectors,
radial basis × cutoff) is computed with ``kernels.edge_basis_reference``'s own operations and its derivative
written out (:func:`_closed_geometry`); where the ZBL wall acts or two atoms (nearly) coincide, the reference op
runs on autograd over [E]-sized tensors, its handling of those cases exactly. From a few thousand edges on, the
messages' per-edge work runs in cache-sized chunks of edges (:func:`_edge_chunks`).

First derivatives only (forces and stress; training differentiates the forces again and stays on autograd).
Checked against the autograd path in float64 and against finite differences (``tests/test_analytic.py``).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from mlff_distiller import kernels
from mlff_distiller.kernels.rbf_cutoff import POLY_P

__all__ = ["Guard", "energy_and_gradients", "hooked", "supports", "weights"]

silu = torch.nn.functional.silu
silu_backward = torch.ops.aten.silu_backward  # grad * d SiLU(h) / dh, one op (SiLU's own backward)


def supports(model: nn.Module) -> bool:
    """The student is the plain architecture this module writes out: PaiNN message and update blocks and the
    readout as built by :class:`~mlff_distiller.model.StudentModel`, every layer a plain ``nn.Linear`` (not the
    16-bit copies of :mod:`mlff_distiller.precision`, not a replaced block)."""
    from mlff_distiller.model.painn import PaiNNInteraction, PaiNNUpdate, StudentModel

    if type(model) is not StudentModel:
        return False
    linears = [model.readout[0], model.readout[2]]
    for inter, upd in zip(model.interactions, model.updates, strict=True):
        if type(inter) is not PaiNNInteraction or type(upd) is not PaiNNUpdate:
            return False
        linears += [inter.phi[0], inter.phi[2], inter.filter, upd.U, upd.V, upd.mix[0], upd.mix[2]]
    acts = [model.readout[1], *(i.phi[1] for i in model.interactions), *(u.mix[1] for u in model.updates)]
    return all(type(m) is nn.Linear for m in linears) and all(type(a) is nn.SiLU for a in acts)


def hooked(model: nn.Module, modules: list[nn.Module] | None = None) -> bool:
    """Some module of ``model`` (or of ``modules``, its modules listed before) has a forward hook, or a global one is
    set: whoever set it expects the forward to run, so the step takes the model's own forward and autograd."""
    from torch.nn.modules import module as module_globals

    if module_globals._global_forward_hooks or module_globals._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in (model.modules() if modules is None else modules))


class Guard:
    """:func:`supports` and not :func:`hooked` for one model, checked again at each call in a few µs: every
    parent-child link of the module tree found at the first check is tested for identity (a replaced block breaks
    one, and the architecture is then checked again from the top), and the modules found then for hooks (a full
    :func:`supports` and :func:`hooked` walk costs ~100 µs, 3 % of a small molecule's CPU step)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._scan()

    def _scan(self) -> None:
        self.links = [(p, name, c) for p in self.model.modules() for name, c in p._modules.items()]
        self.modules = [self.model, *(c for _, _, c in self.links if c is not None)]
        self.plain = supports(self.model)

    def applicable(self) -> bool:
        if any(p._modules.get(name) is not c for p, name, c in self.links):
            self._scan()
        return self.plain and not hooked(self.model, self.modules)

    def weights(self) -> tuple:
        """:func:`weights` of the model (call after :meth:`applicable`), kept while the same parameter objects sit
        in the same modules (their data may change: a parameter is read at each use). Fetching ~35 parameters
        through the module tree cost ~0.1 ms per call, 6 % of a small molecule's CPU step."""
        kept = getattr(self, "_weights", None)
        if kept is None or any(m._parameters.get(name) is not w for m, name, w in kept[1]):
            kept = self._weights = _weights_and_owners(self.model)
        return kept[0]


def weights(model: nn.Module) -> tuple:
    """``(layers, readout)``: per layer ``(φ W1, b1, W2, b2, filter W, U, V, mix W1, b1, W2, b2)`` and the readout's
    ``(W1, b1, W2, b2)``, the parameters :func:`energy_and_gradients` reads, of a model it :func:`supports`."""
    return _weights_and_owners(model)[0]


def _weights_and_owners(model: nn.Module) -> tuple[tuple, list]:
    linears = []
    for inter, upd in zip(model.interactions, model.updates, strict=True):
        linears.append((inter.phi[0], inter.phi[2], inter.filter, upd.U, upd.V, upd.mix[0], upd.mix[2]))
    owners = []

    def take(m: nn.Module, name: str) -> torch.Tensor:
        w = m._parameters[name]
        owners.append((m, name, w))
        return w

    layers = []
    for phi1, phi2, filt, u, v, mix1, mix2 in linears:
        layers.append(
            (
                *(take(phi1, "weight"), take(phi1, "bias"), take(phi2, "weight"), take(phi2, "bias")),
                *(take(filt, "weight"), take(u, "weight"), take(v, "weight")),
                *(take(mix1, "weight"), take(mix1, "bias"), take(mix2, "weight"), take(mix2, "bias")),
            )
        )
    r1, r2 = model.readout[0], model.readout[2]
    readout = (take(r1, "weight"), take(r1, "bias"), take(r2, "weight"), take(r2, "bias"))
    return (tuple(layers), readout), owners


# Distances below this (Å) take the geometry on autograd: the Bessel basis's series branch, coincident atoms.
_CLOSED_MIN_DIST = 1e-4


def _closed_geometry(vec: torch.Tensor, c) -> tuple[torch.Tensor, ...] | None:
    """``(dist [E], unit [E, 3], rbf [E, n_rbf], d rbf / d dist [E, n_rbf])`` of the pair vectors: the values of
    ``kernels.edge_basis_reference`` (the same operations on the branch every pair takes here) with the
    derivative of basis x envelope written out; None when some pair is closer than ``_CLOSED_MIN_DIST`` (the
    reference's other branches: the Bessel series, coincident atoms)."""
    dist = torch.sqrt((vec * vec).sum(-1))
    if dist.numel() and float(dist.min()) < _CLOSED_MIN_DIST:
        return None
    unit = vec / dist.unsqueeze(-1)
    rc = float(c.cutoff)
    d = dist.unsqueeze(-1)
    if c.basis == "bessel":
        k = torch.arange(1, c.n_rbf + 1, device=dist.device, dtype=dist.dtype) * (math.pi / rc)
        norm = math.sqrt(2.0 / rc)
        kd = k * d
        sin_d = torch.sin(kd) / d
        basis = norm * sin_d
        d_basis = norm * (k * torch.cos(kd) - sin_d) / d  # (norm sin(kd) / d)'
    else:
        mu = torch.linspace(0.0, rc, c.n_rbf, device=dist.device, dtype=dist.dtype)
        width = rc / max(c.n_rbf - 1, 1)
        basis = torch.exp(-(0.5 / width**2) * (d - mu) ** 2)
        d_basis = (-1.0 / width**2) * (d - mu) * basis
    x = dist / rc
    inside = x < 1.0
    if c.envelope == "cosine":
        env = 0.5 * (torch.cos(math.pi * x) + 1.0)
        d_env = (-0.5 * math.pi / rc) * torch.sin(math.pi * x)
    else:
        p = POLY_P
        env = 1.0 - (p + 1) * (p + 2) / 2 * x**p + p * (p + 2) * x ** (p + 1) - p * (p + 1) / 2 * x ** (p + 2)
        d_env = (-(p + 1) * (p + 2) / 2 * p * x ** (p - 1) + p * (p + 2) * (p + 1) * x**p
                 - p * (p + 1) / 2 * (p + 2) * x ** (p + 1)) / rc  # fmt: skip
    zero = torch.zeros_like(env)
    env, d_env = torch.where(inside, env, zero).unsqueeze(-1), torch.where(inside, d_env, zero).unsqueeze(-1)
    return dist, unit, basis * env, d_basis * env + basis * d_env


# The messages' per-edge work in chunks of CHUNK_FLOATS / 3F edges (512 for F = 128, 1,024 for F = 64; ~0.8 MB per
# [chunk, 3F] tensor) once a layer's [E, 3F] tensors hold at least CHUNK_MIN_FLOATS values (E >= 1,563 for F = 128,
# 3,125 for F = 64): each elementwise op then works in the caches instead of in memory, on tensors small enough for
# the allocator to keep (the one-piece step's time at 1,912 edges, F = 64, varied 3.4-8.7 ms between runs; the
# chunked one's 3.8-4.0 ms). On the development CPU (2 threads, results/cpu_md_stop41_chunks.md),
# energy_and_gradients on water clusters, chunks against one piece: F = 128, 1,912 / 2,306 edges 1.63-1.73x /
# 1.64-1.94x (two runs) and 2,790 / 6,608 / 14,180 edges 1.82-2.44 / 2.94 / 1.82x; F = 64, 3,648 / 6,608 / 14,180
# edges 2.75 / 2.47 / 2.79x; one batch of 1,024 g2 molecules (49,482 edges) 4.1x. Below the threshold the runs
# disagreed (F = 128 at 1,060 / 1,430 edges: 0.96-1.26 / 1.09-1.49x; F = 64 at 1,060-2,790: 0.84-1.00x in one run,
# up to 2.28x in another) and small graphs lost (0.92x at 600 edges), so those go in one piece, their per-edge
# tensors kept for the backward (a chunk's are made again there). Chunks of 256-2,048 edges were timed; these sizes
# were the best or within 10 % of it.
CHUNK_FLOATS = 512 * 384
CHUNK_MIN_FLOATS = 600_000


def _edge_chunks(n_edges: int, f: int) -> list[tuple[int, int]] | None:
    """Edge ranges of the messages' chunks; None: all edges in one piece (kept for the backward)."""
    if n_edges * 3 * f < CHUNK_MIN_FLOATS:
        return None
    size = max(64, CHUNK_FLOATS // (3 * f))
    return [(a, min(a + size, n_edges)) for a in range(0, n_edges, size)]


def _messages(x, v, s, rbf, wfilt, unit_k, i, j, bounds):
    """``(s_mid, v_mid, kept)``: s + Σ_j a_ij and v + Σ_j (b_ij v_j + c_ij u_ij), (a, b, c) = φ(s)_j ⊙ W(r_ij);
    ``kept``: ``(W, φ_j, v_j)`` over all edges for the backward, or None (edges in chunks: made again there)."""
    f = s.shape[1]
    if bounds is None:
        wf = rbf @ wfilt.t()  # W(r_ij) [E, 3F]
        xj = x.index_select(0, j)
        m = xj * wf
        s_mid = s.index_add(0, i, m[:, :f])
        dv_e = m[:, None, 2 * f :] * unit_k
        vj = None
        if v is not None:
            vj = v.index_select(0, j)
            dv_e = torch.addcmul(dv_e, m[:, None, f : 2 * f], vj)
            v_mid = v.index_add(0, i, dv_e)
        else:
            v_mid = s.new_zeros((s.shape[0], 3, f)).index_add_(0, i, dv_e)
        return s_mid, v_mid, (wf, xj, vj)
    s_mid = s.clone()
    v_mid = v.clone() if v is not None else s.new_zeros((s.shape[0], 3, f))
    for a, b in bounds:
        jc, ic = j[a:b], i[a:b]
        m = x.index_select(0, jc) * (rbf[a:b] @ wfilt.t())
        s_mid.index_add_(0, ic, m[:, :f])
        dv_e = m[:, None, 2 * f :] * unit_k[a:b]
        if v is not None:
            dv_e = torch.addcmul(dv_e, m[:, None, f : 2 * f], v.index_select(0, jc))
        v_mid.index_add_(0, ic, dv_e)
    return s_mid, v_mid, None


def _moments(rbf, unit, slot, n_slots, bounds):
    """The first layer's species-resolved radial moments (:mod:`mlff_distiller.kernels.species_moments`, in torch):
    ``[N·S, 4R]`` rows (receiver, species) of Σ rbf_e, Σ rbf_e u_e[k] over ``slot = i·S + z_j``, edges in chunks."""
    r = rbf.shape[1]
    sums = rbf.new_zeros((n_slots, 4 * r))
    for a, b in [(0, rbf.shape[0])] if bounds is None else bounds:
        rb, u = rbf[a:b], unit[a:b]
        sums.index_add_(0, slot[a:b], torch.cat([rb, rb * u[:, 0:1], rb * u[:, 1:2], rb * u[:, 2:3]], 1))
    return sums


def _moments_backward(gp, gq, rbf, unit, slot, bounds, g_rbf, g_unit) -> None:
    """Adds the moments' pull-back onto rbf and unit: ∂rbf_e = ∂P[slot_e] + Σ_k u_e[k] ∂Q_k[slot_e],
    ∂u_e[k] = ⟨rbf_e, ∂Q_k[slot_e]⟩, from ``gp [N·S, R]`` and ``gq [N·S, 3R]``."""
    r = rbf.shape[1]
    for a, b in [(0, rbf.shape[0])] if bounds is None else bounds:
        sl, rb, u = slot[a:b], rbf[a:b], unit[a:b]
        gpe, gqe = gp.index_select(0, sl), gq.index_select(0, sl).view(-1, 3, r)
        g_rbf[a:b] += gpe + (u.unsqueeze(-1) * gqe).sum(1)
        g_unit[a:b] += (rb.unsqueeze(1) * gqe).sum(-1)


def _messages_backward(g_smid, g_vmid, x, v, kept, rbf, wfilt, unit_k, i, j, bounds, g_rbf, g_unit, need_x=True):
    """``(dE/dφ(s) [N, 3F], dE/dv [N, 3, F] or None)`` through :func:`_messages`, from dE/ds_mid and dE/dv_mid;
    adds dE/dW's pull-back onto rbf into ``g_rbf`` and dE/du into ``g_unit`` (in place). ``need_x`` False (the
    first layer, whose φ(s) and v depend on the species alone): only the geometry's part; dE/dφ(s) comes back
    None."""
    n, f = g_smid.shape
    g_v = g_vmid.clone() if v is not None else None
    g_x = x.new_zeros((n, 3 * f)) if need_x else None
    for a, b in [(0, rbf.shape[0])] if bounds is None else bounds:
        jc, ic = (j, i) if bounds is None else (j[a:b], i[a:b])
        if kept is not None:
            wf, xj, vj = kept
        else:
            wf, xj = rbf[a:b] @ wfilt.t(), x.index_select(0, jc)
            vj = None if v is None else v.index_select(0, jc)
        gs_i, gv_i = g_smid.index_select(0, ic), g_vmid.index_select(0, ic)
        gamma = (gv_i * unit_k[a:b]).sum(1)
        if vj is None:
            g_m = torch.cat([gs_i, torch.zeros_like(gs_i), gamma], 1)
        else:
            g_m = torch.cat([gs_i, (gv_i * vj).sum(1), gamma], 1)
            g_v.index_add_(0, jc, (xj[:, f : 2 * f] * wf[:, f : 2 * f]).unsqueeze(1) * gv_i)
        g_rbf[a:b] += (g_m * xj) @ wfilt
        g_unit[a:b] += ((xj[:, 2 * f :] * wf[:, 2 * f :]).unsqueeze(1) * gv_i).sum(-1)
        if need_x:
            g_x.index_add_(0, jc, g_m * wf)
    return g_x, g_v


@torch.no_grad()
def energy_and_gradients(
    model: nn.Module,
    numbers: torch.Tensor,
    positions: torch.Tensor,
    edge_index: torch.Tensor,
    shift_vectors: torch.Tensor,
    batch: torch.Tensor,
    num_structures: int,
    params: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(energy [B], atomic_energies [N], dE/dpositions [N, 3], dE/dshift_vectors [E, 3])`` of ``model`` (one that
    :func:`supports`) on a graph, the arguments as for ``StudentModel.forward``. The gradient over the shift vectors
    is the one over each pair vector r_ij = pos[j] - pos[i] + shift (the engine's stress, ``edge_virial``).
    ``params``: :func:`weights` of the model (fetched here when None; :meth:`Guard.weights` keeps them)."""
    c = model.config
    f = c.hidden
    i, j = edge_index[0], edge_index[1]
    idx = model.z_to_index[numbers]
    n = positions.shape[0]
    vec = positions.index_select(0, j) - positions.index_select(0, i) + shift_vectors
    # The geometry (distances, unit vectors, basis x envelope) and its derivative written out, with the values of
    # kernels.edge_basis_reference; where the ZBL wall acts or two atoms (nearly) coincide, the reference op itself
    # on autograd over [E]-sized tensors (pair vectors as "shift vectors" of atoms all at the origin).
    closed = _closed_geometry(vec, c)
    table = model.repulsion_table
    if table is not None and closed is not None and not kernels.wall_touched(closed[0], edge_index, idx, table):
        table = None  # no edge inside the wall: it changes nothing (kernels.repulsion.wall_touched)
    if closed is not None and table is None:
        _, unit_g, rbf_g, d_rbf = closed
    else:
        closed = None
        with torch.enable_grad():
            vec = vec.requires_grad_(True)
            dist_g, unit_g, rbf_g = kernels.edge_basis_reference(
                torch.zeros_like(positions), torch.zeros_like(edge_index), vec, c.n_rbf, c.cutoff, c.basis, c.envelope
            )
            if table is not None and not kernels.wall_touched(dist_g, edge_index, idx, table):
                table = None
            if table is not None:  # the ZBL wall (kernels.repulsion), on autograd over [E]-sized tensors
                rep_atomic, rep_energy, gate = kernels.pair_repulsion_reference(
                    dist_g, edge_index, idx, table.to(dist_g.dtype), batch, num_structures
                )
                rbf_g = rbf_g * gate.unsqueeze(-1)  # the student's message fades out inside the wall
    unit, rbf = unit_g.detach(), rbf_g.detach()
    unit_k = unit.unsqueeze(-1)  # [E, 3, 1]

    layers, (r1, rb1, r2, rb2) = weights(model) if params is None else params
    s = model.embedding.weight.index_select(0, idx)
    v = None  # the first layer's vector features are zeros: their terms are skipped, forward and backward
    bounds = _edge_chunks(rbf.shape[0], f)
    saved = []
    # The first layer's φ(s) from the species table (StudentModel.first_phi_table), when the model keeps one; on
    # dense graphs the whole first layer from species-resolved radial moments (first_layer_moment_weights).
    phi_table = model.first_phi_table()
    moment_w = model.first_layer_moment_weights(n, rbf.shape[0])
    if moment_w is not None:
        n_species = len(model.config.species)
        slot = i * n_species + idx.index_select(0, j)
    # The last layer's v and a_vv feed nothing (the readout reads s): its mixing GEMM takes the a_sv, a_ss rows only
    # (StudentModel.last_update_scalars_only).
    s_only = len(layers) - 1 if model.last_update_scalars_only else -1
    for k, layer in enumerate(layers):
        w1, b1, w2, b2, wfilt, wu, wv, m1, mb1, m2, mb2 = layer
        if k == 0 and moment_w is not None:  # Δs = P M_a, Δv_k = Q_k M_c (v = 0 before the first layer)
            h1 = x = kept = None
            sums = _moments(rbf, unit, slot, n * n_species, bounds).view(n, n_species, 4, -1).transpose(1, 2)
            s_mid = torch.addmm(s, sums[:, 0].reshape(n, -1), moment_w[0])
            v_mid = (sums[:, 1:].reshape(3 * n, -1) @ moment_w[1]).view(n, 3, f)
        else:
            if k == 0 and phi_table is not None:
                h1, x = None, phi_table.index_select(0, idx)
            else:
                h1 = torch.addmm(b1, s, w1.t())
                x = torch.addmm(b2, silu(h1), w2.t())  # φ(s) [N, 3F]
            s_mid, v_mid, kept = _messages(x, v, s, rbf, wfilt, unit_k, i, j, bounds)
        uv, vv = v_mid @ wu.t(), v_mid @ wv.t()
        vnorm = torch.sqrt((vv * vv).sum(1) + 1e-8)
        h2 = torch.addmm(mb1, torch.cat([s_mid, vnorm], 1), m1.t())
        dot = (uv * vv).sum(1)
        if k == s_only:  # mix = [a_sv | a_ss]; no v after it
            mix = torch.addmm(mb2[f:], silu(h2), m2[f:].t())
            saved.append((layer, h1, x, v, kept, uv, vv, vnorm, h2, mix, dot))
            s = torch.addcmul(s_mid + mix[:, f:], mix[:, :f], dot)
            continue
        mix = torch.addmm(mb2, silu(h2), m2.t())
        saved.append((layer, h1, x, v, kept, uv, vv, vnorm, h2, mix, dot))
        # (addcmul, addmm below: one op where two or three would do; on a CPU a small molecule's step is ~270
        # ops at ~3-5 µs each)
        s = torch.addcmul(s_mid + mix[:, 2 * f :], mix[:, f : 2 * f], dot)
        v = torch.addcmul(v_mid, mix[:, None, :f], uv)

    h = torch.addmm(rb1, s, r1.t())
    scale = model.atomic_scale.index_select(0, idx)
    atomic = torch.addmm(rb2, silu(h), r2.t()).squeeze(-1) * scale + model.atomic_shift.index_select(0, idx)
    energy = kernels.linear.structure_sums(atomic, batch, num_structures, keep_wide=True)  # float64
    if table is not None:
        atomic, energy = atomic + rep_atomic.detach(), energy + rep_energy.detach()

    # Backward: g_s = dE/ds, g_v = dE/dv of the current layer's output, from the readout down.
    g_s = silu_backward(scale.unsqueeze(1) * r2, h) @ r1
    g_v = None
    g_rbf = torch.zeros_like(rbf)
    g_unit = torch.zeros_like(unit)
    for k in reversed(range(len(saved))):
        layer, h1, x, v_in, kept, uv, vv, vnorm, h2, mix, dot = saved[k]
        w1, b1, w2, b2, wfilt, wu, wv, m1, mb1, m2, mb2 = layer
        # s = s_mid + a_ss + a_sv * dot;  v = v_mid + a_vv * uv;  dot = Σ_k uv vv (the s-only layer: no a_vv, no v)
        a_sv = mix[:, f : 2 * f] if k != s_only else mix[:, :f]
        g_dot = g_s * a_sv
        g_uv = g_dot.unsqueeze(1) * vv
        g_vv = g_dot.unsqueeze(1) * uv
        if k == s_only:
            g_h2 = silu_backward(torch.cat([g_s * dot, g_s], 1) @ m2[f:], h2)
        else:
            a_vv = mix[:, :f]
            if g_v is not None:
                g_avv = (g_v * uv).sum(1)
                g_uv = torch.addcmul(g_uv, g_v, a_vv.unsqueeze(1))
            else:
                g_avv = torch.zeros_like(a_vv)
            g_h2 = silu_backward(torch.cat([g_avv, g_s * dot, g_s], 1) @ m2, h2)
        g_in = g_h2 @ m1  # over [s_mid, vnorm]
        g_smid = g_s + g_in[:, :f]
        g_vv = torch.addcmul(g_vv, (g_in[:, f:] / vnorm).unsqueeze(1), vv)
        g_vmid = g_uv.reshape(-1, f) @ wu if g_v is None else torch.addmm(g_v.reshape(-1, f), g_uv.reshape(-1, f), wu)
        g_vmid = torch.addmm(g_vmid, g_vv.reshape(-1, f), wv).view(n, 3, f)
        # The first layer's inputs (the embedding rows and v = 0) depend on the species alone: from its messages
        # only the geometry's part is needed, and no dE/ds below it.
        if k == 0 and moment_w is not None:
            gp = (g_smid @ moment_w[0].t()).view(n * n_species, -1)  # [N·S, R]
            gq = (g_vmid.reshape(3 * n, f) @ moment_w[1].t()).view(n, 3, n_species, -1)
            gq = gq.transpose(1, 2).reshape(n * n_species, -1)  # [N·S, 3R], rows (receiver, species)
            _moments_backward(gp, gq, rbf, unit, slot, bounds, g_rbf, g_unit)
            continue
        g_x, g_v = _messages_backward(
            g_smid, g_vmid, x, v_in, kept, rbf, wfilt, unit_k, i, j, bounds, g_rbf, g_unit, need_x=k > 0
        )
        if k > 0:
            g_s = torch.addmm(g_smid, silu_backward(g_x @ w2, h1), w1)
    if closed is not None:  # r_ij -> (d, u): dE/dr = (dE/dd) u + (g_u - (g_u . u) u) / d
        g_d = (g_rbf * d_rbf).sum(-1, keepdim=True)
        g_vec = g_d * unit + (g_unit - (g_unit * unit).sum(-1, keepdim=True) * unit) / closed[0].unsqueeze(-1)
    else:
        with torch.enable_grad():
            outs, grads = [unit_g, rbf_g], [g_unit, g_rbf]
            if table is not None:  # d(Σ_b E_b) / d rep_energy = 1
                outs.append(rep_energy)
                grads.append(torch.ones_like(rep_energy))
            (g_vec,) = torch.autograd.grad(outs, [vec], grads)
    g_pos = torch.zeros_like(positions).index_add_(0, j, g_vec).index_add_(0, i, -g_vec)
    return energy, atomic, g_pos, g_vec
