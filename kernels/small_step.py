"""The whole energy + forces step of a small molecule in one Triton program: a one-kernel step.

Issue 5's latency target (benzene energy + forces in 0.05 ms) is out of reach for a step made of ~60 kernels: each
node of a CUDA graph costs ~1-2 µs before it does any work, and the captured step of the 64 x 3 student replays in
~0.12 ms on an H200. Here one program computes the molecule's whole step, forward and backward, in registers:

- the pairs are dense: ``[NP, NP]`` receivers x senders for a molecule of at most ``NP`` (16) atoms, so a sum over
  senders or receivers is a reduction over an axis, and a sender's features reach every receiver by broadcast (no
  gather, no atomics, no edge list, no neighbour list: a pair beyond the cutoff gets a zero basis);
- the radial filters ``W(r) = rbf(r) W_f^T`` are products of the ``[NP * NP, R]`` basis with the filter weight on the
  tensor cores, made again in the backward rather than kept;
- the layers' values that the backward needs stay in registers from the forward: nothing is stored between phases.

The algebra is :mod:`mlff_distiller.model.analytic`'s (the chain rule of the forward written out), here for the
shipped architecture: PaiNN message and update blocks, the first layer's φ from the species table
(``StudentModel.first_phi_table``), the last layer's update scalars only, the readout with the per-species scale
and shift, and the ZBL wall (:mod:`.repulsion`) with its gate on the basis.

**Measured, and not on any path of the engine** (``benchmarks/results/stop68_gpu/``, H200): benzene 610.7 µs
against the engine's captured step at 131.0 µs (the shipped 64 x 3 student); g2 x 4,096 7.8 µs per structure
against 0.343. Its forces match the float64 oracle (6.9e-6 eV/Å), but one streaming multiprocessor walks the
whole chain: the ``[16, 16, 64]`` pair tiles and the layers' saved values exceed the registers (128 a thread at 16
warps; ptxas spills 18 KB a thread), and the first call compiles for ~150 s. The module stays as the measured
answer to "one program per molecule" (``benchmarks/probe_small_step.py``) and as a float64 check of the written-out
backward on dense pairs (``tests/kernels/test_small_step.py``).

Products in float32 take the tensor cores in ``tf32x3`` (float32 accuracy), or, with weights on the TF32 grid
(``StudentModel.on_tf32_grid``), two TF32 products (``tf32x2``: the weight is exact in TF32, the activation split
into a TF32 high part and its remainder). Float64 takes ``ieee`` products. One program per molecule: a batch of
molecules is a grid of programs.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._triton_utils import HAS_TRITON, tl, triton

if HAS_TRITON:
    from .repulsion import _pair_terms

__all__ = ["MAX_ATOMS", "SmallStep", "layer_size", "pack_weights", "small_step", "small_step_reference", "supports"]

MAX_ATOMS = 16  # NP: the dense pair tile is [NP * NP, F]; 32 atoms would make it 4x larger than registers hold


def layer_size(f: int, rp: int) -> int:
    """Floats of one layer's block in the packed weights (see :func:`pack_weights`)."""
    return 22 * f * f + 8 * f + 6 * f * rp


def _pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << (int(n) - 1).bit_length())


def supports(model) -> str | None:
    """None where the one-kernel step computes ``model``; else why not (a sentence)."""
    from mlff_distiller.model import analytic

    c = model.config
    if not analytic.supports(model):
        return "not the plain architecture (a replaced block or layer, or 16-bit layers)"
    if c.layers != 3:
        return f"{c.layers} layers (the kernel is written for 3)"
    f = c.hidden
    if f < 32 or f & (f - 1) or f > 128:
        return f"hidden {f} (a power of two from 32 to 128)"
    if c.basis != "bessel" or c.envelope != "cosine":
        return f"basis {c.basis!r} with envelope {c.envelope!r} (bessel with cosine only)"
    if not model.last_update_scalars_only or not model.species_table:
        return "the model's switches last_update_scalars_only and species_table must be on"
    if model.first_phi_table() is None:
        return "no first-layer species table (weights that require grad?)"
    return None


def _t(w: Tensor) -> Tensor:
    return w.detach().t().contiguous()


def _pad_cols(w: Tensor, cols: int) -> Tensor:
    out = w.new_zeros((w.shape[0], cols))
    out[:, : w.shape[1]] = w
    return out


def pack_weights(model, dtype: torch.dtype | None = None) -> Tensor:
    """Every weight the kernel reads in one flat tensor: per layer (``layer_size`` floats) ``W1^T, W1, b1, W2^T,
    W2, b2, W_f^T, W_f, U^T, U, V^T, V, M1^T, M1, mb1, M2^T, M2, mb2`` (``W^T`` for the forward's products, ``W``
    for the backward's, both row-major; the filter's basis axis padded to a power of two), then the embedding
    ``[S, F]``, the first layer's φ table ``[S, 3F]``, the readout's ``R1^T, R1, rb1, r2, rb2`` and the
    per-species scale and shift."""
    from mlff_distiller.model import analytic

    c = model.config
    f, rp = c.hidden, _pow2(c.n_rbf)
    layers, (r1, rb1, r2, rb2) = analytic.weights(model)
    parts = []
    for w1, b1, w2, b2, wf, u, v, m1, mb1, m2, mb2 in layers:
        wf = _pad_cols(wf.detach(), rp)
        for w in (_t(w1), w1, b1, _t(w2), w2, b2, _t(wf), wf, _t(u), u, _t(v), v, _t(m1), m1, mb1, _t(m2), m2, mb2):
            parts.append(w.detach().reshape(-1))
    parts += [model.embedding.weight.detach().reshape(-1), model.first_phi_table().reshape(-1)]
    parts += [_t(r1).reshape(-1), r1.detach().reshape(-1), rb1.detach(), r2.detach().reshape(-1)]
    parts += [rb2.detach().reshape(-1), model.atomic_scale.detach(), model.atomic_shift.detach()]
    out = torch.cat([p.to(dtype or model.atomic_scale.dtype) for p in parts]).contiguous()
    expect = c.layers * layer_size(f, rp) + len(c.species) * 4 * f + 2 * f * (f // 2) + 2 * (f // 2) + 1
    assert out.numel() == expect + 2 * len(c.species), (out.numel(), expect)
    return out


if HAS_TRITON:

    @triton.jit
    def _mm(a, b, DOT: tl.constexpr):
        """a @ b in the step's accuracy: 0 ieee (float64, or float32 without tensor cores), 1 tf32x3, 2 two TF32
        products with b exact in TF32 (a split into its TF32 high part and the remainder)."""
        if DOT == 0:
            out = tl.dot(a, b, input_precision="ieee")
        elif DOT == 1:
            out = tl.dot(a, b, input_precision="tf32x3")
        else:
            hi = (a.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
            out = tl.dot(hi, b, input_precision="tf32") + tl.dot(a - hi, b, input_precision="tf32")
        return out

    @triton.jit
    def _mat(ptr, R: tl.constexpr, C: tl.constexpr, ld):
        r = tl.arange(0, R)
        c = tl.arange(0, C)
        return tl.load(ptr + r[:, None] * ld + c[None, :])

    @triton.jit
    def _row(ptr, C: tl.constexpr):
        return tl.load(ptr + tl.arange(0, C))

    @triton.jit
    def _sig(x):
        return 1.0 / (1.0 + tl.exp(-x))

    @triton.jit
    def _phi(s, lw, F: tl.constexpr, DOT: tl.constexpr):
        """φ(s) = W2 silu(W1 s + b1) + b2 in its three blocks, and the hidden h1."""
        w1t = lw
        b1 = lw + 2 * F * F
        w2t = b1 + F
        b2 = w2t + 6 * F * F
        h1 = _mm(s, _mat(w1t, F, F, F), DOT) + _row(b1, F)[None, :]
        a = h1 * _sig(h1)
        xa = _mm(a, _mat(w2t, F, F, 3 * F), DOT) + _row(b2, F)[None, :]
        xb = _mm(a, _mat(w2t + F, F, F, 3 * F), DOT) + _row(b2 + F, F)[None, :]
        xc = _mm(a, _mat(w2t + 2 * F, F, F, 3 * F), DOT) + _row(b2 + 2 * F, F)[None, :]
        return h1, xa, xb, xc

    @triton.jit
    def _filter(rbf, lw, BLOCK: tl.constexpr, NP: tl.constexpr, F: tl.constexpr, RP: tl.constexpr, DOT: tl.constexpr):
        """One block (0: a, 1: b, 2: c) of the filters W(r_ij) ``[NP, NP, F]`` from the basis ``[NP * NP, RP]``
        (one block at a time: three ``[NP, NP, F]`` tiles at once would not fit in registers)."""
        wft = lw + 8 * F * F + 4 * F
        return tl.reshape(_mm(rbf, _mat(wft + BLOCK * F, RP, F, 3 * F), DOT), (NP, NP, F))

    @triton.jit
    def _update(s_mid, vm0, vm1, vm2, lw, F: tl.constexpr, RP: tl.constexpr, LAST: tl.constexpr, DOT: tl.constexpr):
        """The update block: ``s, v0, v1, v2`` and what its backward needs."""
        ut = lw + 8 * F * F + 4 * F + 6 * F * RP
        vt = ut + 2 * F * F
        m1t = vt + 2 * F * F
        mb1 = m1t + 4 * F * F
        m2t = mb1 + F
        mb2 = m2t + 6 * F * F
        u_t = _mat(ut, F, F, F)
        v_t = _mat(vt, F, F, F)
        uv0 = _mm(vm0, u_t, DOT)
        uv1 = _mm(vm1, u_t, DOT)
        uv2 = _mm(vm2, u_t, DOT)
        vv0 = _mm(vm0, v_t, DOT)
        vv1 = _mm(vm1, v_t, DOT)
        vv2 = _mm(vm2, v_t, DOT)
        vnorm = tl.sqrt(vv0 * vv0 + vv1 * vv1 + vv2 * vv2 + 1e-8)
        h2 = _mm(s_mid, _mat(m1t, F, F, F), DOT) + _mm(vnorm, _mat(m1t + F * F, F, F, F), DOT)
        h2 = h2 + _row(mb1, F)[None, :]
        a2 = h2 * _sig(h2)
        dot = uv0 * vv0 + uv1 * vv1 + uv2 * vv2
        a_sv = _mm(a2, _mat(m2t + F, F, F, 3 * F), DOT) + _row(mb2 + F, F)[None, :]
        a_ss = _mm(a2, _mat(m2t + 2 * F, F, F, 3 * F), DOT) + _row(mb2 + 2 * F, F)[None, :]
        s = s_mid + a_ss + a_sv * dot
        if LAST:
            a_vv = a_sv  # (unused)
            v0, v1, v2 = vm0, vm1, vm2
        else:
            a_vv = _mm(a2, _mat(m2t, F, F, 3 * F), DOT) + _row(mb2, F)[None, :]
            v0 = vm0 + a_vv * uv0
            v1 = vm1 + a_vv * uv1
            v2 = vm2 + a_vv * uv2
        return s, v0, v1, v2, uv0, uv1, uv2, vv0, vv1, vv2, vnorm, h2, a_vv, a_sv, dot

    @triton.jit
    def _update_backward(
        g_s, gv0, gv1, gv2, uv0, uv1, uv2, vv0, vv1, vv2, vnorm, h2, a_vv, a_sv, dot, lw,
        F: tl.constexpr, RP: tl.constexpr, LAST: tl.constexpr, DOT: tl.constexpr,
    ):  # fmt: skip
        """``(dE/ds_mid, dE/dv_mid)`` from dE/ds and dE/dv of the block's outputs (dE/dv unused for the last
        layer, whose v' feeds nothing)."""
        u = lw + 8 * F * F + 4 * F + 6 * F * RP + F * F
        v = u + 2 * F * F
        m1 = v + 3 * F * F
        m2 = m1 + 2 * F * F + F + 3 * F * F
        g_dot = g_s * a_sv
        g_uv0 = g_dot * vv0
        g_uv1 = g_dot * vv1
        g_uv2 = g_dot * vv2
        g_vv0 = g_dot * uv0
        g_vv1 = g_dot * uv1
        g_vv2 = g_dot * uv2
        g_mix = _mm(g_s * dot, _mat(m2 + F * F, F, F, F), DOT) + _mm(g_s, _mat(m2 + 2 * F * F, F, F, F), DOT)
        if not LAST:
            g_avv = gv0 * uv0 + gv1 * uv1 + gv2 * uv2
            g_uv0 += gv0 * a_vv
            g_uv1 += gv1 * a_vv
            g_uv2 += gv2 * a_vv
            g_mix += _mm(g_avv, _mat(m2, F, F, F), DOT)
        sg = _sig(h2)
        g_h2 = g_mix * sg * (1.0 + h2 * (1.0 - sg))
        g_smid = g_s + _mm(g_h2, _mat(m1, F, F, 2 * F), DOT)
        g_n = _mm(g_h2, _mat(m1 + F, F, F, 2 * F), DOT) / vnorm
        g_vv0 += g_n * vv0
        g_vv1 += g_n * vv1
        g_vv2 += g_n * vv2
        u_w = _mat(u, F, F, F)
        v_w = _mat(v, F, F, F)
        g_vm0 = _mm(g_uv0, u_w, DOT) + _mm(g_vv0, v_w, DOT)
        g_vm1 = _mm(g_uv1, u_w, DOT) + _mm(g_vv1, v_w, DOT)
        g_vm2 = _mm(g_uv2, u_w, DOT) + _mm(g_vv2, v_w, DOT)
        if not LAST:
            g_vm0 += gv0
            g_vm1 += gv1
            g_vm2 += gv2
        return g_smid, g_vm0, g_vm1, g_vm2

    @triton.jit
    def _messages(
        s, v0, v1, v2, xa, xb, xc, rbf, ux, uy, uz, lw,
        NP: tl.constexpr, F: tl.constexpr, RP: tl.constexpr, V_ZERO: tl.constexpr, DOT: tl.constexpr,
    ):  # fmt: skip
        """``s + Δs, v + Δv``: Δs_i = Σ_j a_ij, Δv_i = Σ_j b_ij v_j + c_ij u_ij, (a, b, c) = φ(s)_j ⊙ W(r_ij)."""
        s_mid = s + tl.sum(_filter(rbf, lw, 0, NP, F, RP, DOT) * xa[None, :, :], axis=1)
        mc = _filter(rbf, lw, 2, NP, F, RP, DOT) * xc[None, :, :]
        vm0 = tl.sum(mc * ux[:, :, None], axis=1)
        vm1 = tl.sum(mc * uy[:, :, None], axis=1)
        vm2 = tl.sum(mc * uz[:, :, None], axis=1)
        if not V_ZERO:
            mb = _filter(rbf, lw, 1, NP, F, RP, DOT) * xb[None, :, :]
            vm0 += v0 + tl.sum(mb * v0[None, :, :], axis=1)
            vm1 += v1 + tl.sum(mb * v1[None, :, :], axis=1)
            vm2 += v2 + tl.sum(mb * v2[None, :, :], axis=1)
        return s_mid, vm0, vm1, vm2

    @triton.jit
    def _messages_backward(
        g_smid, g_vm0, g_vm1, g_vm2, v0, v1, v2, xa, xb, xc, h1, rbf, drbf, ux, uy, uz, lw,
        NP: tl.constexpr, F: tl.constexpr, RP: tl.constexpr, V_ZERO: tl.constexpr, DOT: tl.constexpr,
    ):  # fmt: skip
        """The message block's backward: ``(dE/dd [NP, NP], dE/du_k [NP, NP] x 3, dE/ds, dE/dv_k)`` where dE/ds and
        dE/dv (of the layer's inputs) are zeros for the first layer (its inputs depend on the species alone)."""
        wf = lw + 8 * F * F + 4 * F + 3 * F * RP
        gi0 = g_vm0[:, None, :]
        gi1 = g_vm1[:, None, :]
        gi2 = g_vm2[:, None, :]
        # one filter block at a time (see _filter): c, then a, then b
        wc = _filter(rbf, lw, 2, NP, F, RP, DOT)
        gamma = gi0 * ux[:, :, None] + gi1 * uy[:, :, None] + gi2 * uz[:, :, None]
        g_rbf = _mm(tl.reshape(gamma * xc[None, :, :], (NP * NP, F)), _mat(wf + 2 * F * RP, F, RP, RP), DOT)
        mc = wc * xc[None, :, :]
        g_u0 = tl.sum(mc * gi0, axis=2)
        g_u1 = tl.sum(mc * gi1, axis=2)
        g_u2 = tl.sum(mc * gi2, axis=2)
        g_si = g_smid[:, None, :]
        g_rbf += _mm(tl.reshape(g_si * xa[None, :, :], (NP * NP, F)), _mat(wf, F, RP, RP), DOT)
        if V_ZERO:
            g_s = g_smid * 0.0
            gv0 = g_s
            gv1 = g_s
            gv2 = g_s
        else:
            g_xc = tl.sum(gamma * wc, axis=0)
            g_xa = tl.sum(g_si * _filter(rbf, lw, 0, NP, F, RP, DOT), axis=0)
            wb = _filter(rbf, lw, 1, NP, F, RP, DOT)
            g_mb = gi0 * v0[None, :, :] + gi1 * v1[None, :, :] + gi2 * v2[None, :, :]
            g_rbf += _mm(tl.reshape(g_mb * xb[None, :, :], (NP * NP, F)), _mat(wf + F * RP, F, RP, RP), DOT)
            g_xb = tl.sum(g_mb * wb, axis=0)
            bw = wb * xb[None, :, :]
            gv0 = g_vm0 + tl.sum(bw * gi0, axis=0)
            gv1 = g_vm1 + tl.sum(bw * gi1, axis=0)
            gv2 = g_vm2 + tl.sum(bw * gi2, axis=0)
            w1 = lw + F * F
            w2 = w1 + 4 * F * F + F
            g_a = _mm(g_xa, _mat(w2, F, F, F), DOT) + _mm(g_xb, _mat(w2 + F * F, F, F, F), DOT)
            g_a += _mm(g_xc, _mat(w2 + 2 * F * F, F, F, F), DOT)
            sg = _sig(h1)
            g_s = g_smid + _mm(g_a * sg * (1.0 + h1 * (1.0 - sg)), _mat(w1, F, F, F), DOT)
        g_d = tl.sum(tl.reshape(g_rbf, (NP, NP, RP)) * drbf, axis=2)
        return g_d, g_u0, g_u1, g_u2, g_s, gv0, gv1, gv2

    @triton.jit
    def _small_step_kernel(
        pos_ptr, idx_ptr, w_ptr, table_ptr, consts_ptr, energy_ptr, atomic_ptr, forces_ptr, n_species,
        NP: tl.constexpr, F: tl.constexpr, R: tl.constexpr, RP: tl.constexpr, DOT: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0).to(tl.int64)
        H: tl.constexpr = F // 2
        LS: tl.constexpr = 22 * F * F + 8 * F + 6 * F * RP
        a = tl.arange(0, NP)
        idx = tl.load(idx_ptr + b * NP + a)
        real = idx >= 0
        ix = tl.where(real, idx, 0)
        px = tl.load(pos_ptr + (b * NP + a) * 3)
        py = tl.load(pos_ptr + (b * NP + a) * 3 + 1)
        pz = tl.load(pos_ptr + (b * NP + a) * 3 + 2)
        # pairs i <- j: r_ij = pos_j - pos_i, rows i (receivers), columns j (senders)
        rx = px[None, :] - px[:, None]
        ry = py[None, :] - py[:, None]
        rz = pz[None, :] - pz[:, None]
        d2 = rx * rx + ry * ry + rz * rz
        pair = real[:, None] & real[None, :] & (a[:, None] != a[None, :])
        # the radial constants in the step's dtype (a float argument would be float32): rc, pi / rc,
        # sqrt(2 / rc), -pi / (2 rc)
        cutoff = tl.load(consts_ptr)
        k1 = tl.load(consts_ptr + 1)
        norm = tl.load(consts_ptr + 2)
        c_env = tl.load(consts_ptr + 3)
        valid = pair & (d2 < cutoff * cutoff)
        d = tl.sqrt(tl.where(valid, d2, 1.0))
        ux = tl.where(valid, rx / d, 0.0)
        uy = tl.where(valid, ry / d, 0.0)
        uz = tl.where(valid, rz / d, 0.0)
        # basis x envelope (x the wall's gate) and its derivative in d, [NP, NP, RP]
        kr = tl.arange(0, RP)
        kk = ((kr + 1).to(px.dtype) * k1)[None, None, :]
        d3 = d[:, :, None]
        kd = kk * d3
        sn = tl.sin(kd)
        basis = norm * sn / d3
        d_basis = norm * (kk * tl.cos(kd) - sn / d3) / d3
        xr = d * k1
        env = tl.where(valid, 0.5 * (tl.cos(xr) + 1.0), 0.0)
        d_env = tl.where(valid, c_env * tl.sin(xr), 0.0)
        # the ZBL wall (a model without one has a table of radius 0: no pair is inside)
        code = ix[:, None] * n_species + ix[None, :]
        on, e, de, gate, d_gate = _pair_terms(d, code, valid, table_ptr, n_species)
        e_atom = tl.sum(tl.where(on, e, 0.0), axis=1)
        de_pair = tl.where(on, de, 0.0)
        d_env = d_env * gate + env * d_gate
        env = env * gate
        rmask = (kr < R)[None, None, :]
        rbf3 = tl.where(rmask, basis * env[:, :, None], 0.0)
        drbf = tl.where(rmask, d_basis * env[:, :, None] + basis * d_env[:, :, None], 0.0)
        rbf = tl.reshape(rbf3, (NP * NP, RP))

        g = w_ptr + 3 * LS  # the model-wide block
        f = tl.arange(0, F)
        s0 = tl.load(g + ix[:, None] * F + f[None, :])
        phi = g + n_species * F
        x0a = tl.load(phi + ix[:, None] * (3 * F) + f[None, :])
        x0b = tl.load(phi + ix[:, None] * (3 * F) + F + f[None, :])
        x0c = tl.load(phi + ix[:, None] * (3 * F) + 2 * F + f[None, :])
        zero = s0 * 0.0

        # forward
        l0 = w_ptr
        s_m, vm0, vm1, vm2 = _messages(s0, zero, zero, zero, x0a, x0b, x0c, rbf, ux, uy, uz, l0, NP, F, RP, True, DOT)
        s1, v10, v11, v12, uv00, uv01, uv02, vv00, vv01, vv02, n0, h20, avv0, asv0, dot0 = _update(
            s_m, vm0, vm1, vm2, l0, F, RP, False, DOT
        )
        l1 = w_ptr + LS
        h11, x1a, x1b, x1c = _phi(s1, l1, F, DOT)
        s_m, vm0, vm1, vm2 = _messages(s1, v10, v11, v12, x1a, x1b, x1c, rbf, ux, uy, uz, l1, NP, F, RP, False, DOT)
        s2, v20, v21, v22, uv10, uv11, uv12, vv10, vv11, vv12, n1, h21, avv1, asv1, dot1 = _update(
            s_m, vm0, vm1, vm2, l1, F, RP, False, DOT
        )
        l2 = w_ptr + 2 * LS
        h12, x2a, x2b, x2c = _phi(s2, l2, F, DOT)
        s_m, vm0, vm1, vm2 = _messages(s2, v20, v21, v22, x2a, x2b, x2c, rbf, ux, uy, uz, l2, NP, F, RP, False, DOT)
        s3, _v0, _v1, _v2, uv20, uv21, uv22, vv20, vv21, vv22, n2, h22, avv2, asv2, dot2 = _update(
            s_m, vm0, vm1, vm2, l2, F, RP, True, DOT
        )

        # readout: atomic = (r2 . silu(R1 s + rb1) + rb2) scale_z + shift_z (+ the wall's half pair energies)
        r1t = phi + n_species * 3 * F
        r1 = r1t + F * H
        rb1 = r1 + H * F
        r2 = rb1 + H
        rb2 = r2 + H
        scale_p = rb2 + 1
        h = _mm(s3, _mat(r1t, F, H, H), DOT) + _row(rb1, H)[None, :]
        sg = _sig(h)
        w_r2 = _row(r2, H)[None, :]
        scale = tl.load(scale_p + ix)
        shift = tl.load(scale_p + n_species + ix)
        out = tl.sum(h * sg * w_r2, axis=1) + tl.load(rb2)
        atomic = tl.where(real, out * scale + shift + e_atom, 0.0)
        tl.store(atomic_ptr + b * NP + a, atomic)
        tl.store(energy_ptr + b, tl.sum(atomic.to(tl.float64), axis=0))

        # backward: dE/ds of the readout, then the layers from the last down
        g_h = tl.where(real[:, None], (sg * (1.0 + h * (1.0 - sg))) * w_r2 * scale[:, None], 0.0)
        g_s = _mm(g_h, _mat(r1, H, F, F), DOT)
        g_sm, g_vm0, g_vm1, g_vm2 = _update_backward(
            g_s, zero, zero, zero, uv20, uv21, uv22, vv20, vv21, vv22, n2, h22, avv2, asv2, dot2, l2, F, RP, True, DOT
        )
        g_d, g_u0, g_u1, g_u2, g_s, gv0, gv1, gv2 = _messages_backward(
            g_sm, g_vm0, g_vm1, g_vm2, v20, v21, v22, x2a, x2b, x2c, h12, rbf, drbf, ux, uy, uz, l2,
            NP, F, RP, False, DOT,
        )  # fmt: skip
        g_sm, g_vm0, g_vm1, g_vm2 = _update_backward(
            g_s, gv0, gv1, gv2, uv10, uv11, uv12, vv10, vv11, vv12, n1, h21, avv1, asv1, dot1, l1, F, RP, False, DOT
        )
        dd, du0, du1, du2, g_s, gv0, gv1, gv2 = _messages_backward(
            g_sm, g_vm0, g_vm1, g_vm2, v10, v11, v12, x1a, x1b, x1c, h11, rbf, drbf, ux, uy, uz, l1,
            NP, F, RP, False, DOT,
        )  # fmt: skip
        g_d += dd
        g_u0 += du0
        g_u1 += du1
        g_u2 += du2
        g_sm, g_vm0, g_vm1, g_vm2 = _update_backward(
            g_s, gv0, gv1, gv2, uv00, uv01, uv02, vv00, vv01, vv02, n0, h20, avv0, asv0, dot0, l0, F, RP, False, DOT
        )
        dd, du0, du1, du2, _gs, _g0, _g1, _g2 = _messages_backward(
            g_sm, g_vm0, g_vm1, g_vm2, zero, zero, zero, x0a, x0b, x0c, zero, rbf, drbf, ux, uy, uz, l0,
            NP, F, RP, True, DOT,
        )  # fmt: skip
        g_d += dd + de_pair
        g_u0 += du0
        g_u1 += du1
        g_u2 += du2
        # r_ij -> (d, u): dE/dr = (dE/dd) u + (g_u - (g_u . u) u) / d; forces F_i = -dE/dpos_i
        gu = g_u0 * ux + g_u1 * uy + g_u2 * uz
        gx = tl.where(valid, g_d * ux + (g_u0 - gu * ux) / d, 0.0)
        gy = tl.where(valid, g_d * uy + (g_u1 - gu * uy) / d, 0.0)
        gz = tl.where(valid, g_d * uz + (g_u2 - gu * uz) / d, 0.0)
        fx = tl.sum(gx, axis=1) - tl.sum(gx, axis=0)
        fy = tl.sum(gy, axis=1) - tl.sum(gy, axis=0)
        fz = tl.sum(gz, axis=1) - tl.sum(gz, axis=0)
        tl.store(forces_ptr + (b * NP + a) * 3, fx)
        tl.store(forces_ptr + (b * NP + a) * 3 + 1, fy)
        tl.store(forces_ptr + (b * NP + a) * 3 + 2, fz)


def _dot_mode(model, dtype: torch.dtype, device: torch.device) -> int:
    if dtype == torch.float64 or device.type != "cuda":
        return 0
    return 2 if model.on_tf32_grid() else 1


class SmallStep:
    """The one-kernel step of one model, prepared: the packed weights, the wall's table and the radial constants
    made once in ``dtype`` on ``device`` (a snapshot of the weights: prepare again after changing them), so that a
    call is one launch and nothing else (it can be captured in a CUDA graph). ``dot``: the products' mode (see
    ``_mm``; by default ``ieee`` for float64 or off a GPU, float32 on a GPU ``tf32x2`` where the weights are on the
    TF32 grid, else ``tf32x3``)."""

    def __init__(self, model, dtype=torch.float32, device="cpu", *, dot: int | None = None, num_warps: int = 16):
        with torch.no_grad():
            reason = supports(model)
            if reason is not None:
                raise ValueError(f"small_step: {reason}")
            device = torch.device(device)
            c = model.config
            self.weights = pack_weights(model, dtype).to(device)
            table = model.repulsion_table
            if table is None:  # a wall of radius 0 for every pair: the same compiled kernel, and no pair is inside
                from .repulsion import repulsion_table

                table = repulsion_table(c.species, {})
            self.table = table.to(device=device, dtype=dtype).contiguous()
            rc = float(c.cutoff)
            consts = [rc, math.pi / rc, math.sqrt(2.0 / rc), -0.5 * math.pi / rc]
            self.consts = torch.tensor(consts, dtype=dtype, device=device)
        self.dtype, self.device, self.num_warps = dtype, self.weights.device, num_warps  # (cuda -> cuda:0)
        self.n_species, self.hidden, self.n_rbf = len(c.species), c.hidden, c.n_rbf
        self.dot = _dot_mode(model, dtype, device) if dot is None else dot

    def __call__(self, positions: Tensor, idx: Tensor, out=None) -> tuple[Tensor, Tensor, Tensor]:
        """``(energy [B] float64, atomic [B, NP], forces [B, NP, 3])``: see :func:`small_step`."""
        if positions.dim() != 3 or positions.shape[1:] != (MAX_ATOMS, 3) or idx.shape != positions.shape[:2]:
            raise ValueError(
                f"small_step: positions [B, {MAX_ATOMS}, 3] and idx [B, {MAX_ATOMS}] expected, got "
                f"{tuple(positions.shape)} and {tuple(idx.shape)}"
            )
        if positions.dtype != self.dtype or positions.device != self.device or idx.dtype != torch.int32:
            raise ValueError(
                f"small_step: positions in {self.dtype} on {self.device} and int32 idx expected, got "
                f"{positions.dtype} on {positions.device} and {idx.dtype}"
            )
        b = positions.shape[0]
        if out is None:
            out = (
                torch.empty(b, dtype=torch.float64, device=self.device),
                torch.empty((b, MAX_ATOMS), dtype=self.dtype, device=self.device),
                torch.empty((b, MAX_ATOMS, 3), dtype=self.dtype, device=self.device),
            )
        energy, atomic, forces = out
        if b:
            _small_step_kernel[(b,)](
                positions.contiguous(), idx.contiguous(), self.weights, self.table, self.consts, energy, atomic,
                forces, self.n_species, NP=MAX_ATOMS, F=self.hidden, R=self.n_rbf, RP=_pow2(self.n_rbf),
                DOT=self.dot, num_warps=self.num_warps,
            )  # fmt: skip
        return energy, atomic, forces


def small_step(model, positions: Tensor, idx: Tensor, **kw) -> tuple[Tensor, Tensor, Tensor]:
    """``(energy [B] float64, atomic [B, NP], forces [B, NP, 3])`` of molecules given as ``positions [B, NP, 3]``
    (Å) and species indices ``idx [B, NP]`` (int32; -1 marks a padding slot), NP = :data:`MAX_ATOMS`; no periodic
    images, every pair within the cutoff. Keyword arguments: :class:`SmallStep`'s (made for this one call: keep a
    ``SmallStep`` for repeated calls)."""
    return SmallStep(model, positions.dtype, positions.device, **kw)(positions, idx.to(torch.int32))


def small_step_reference(model, positions: Tensor, idx: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The same outputs from the model's own forward and autograd (one structure at a time, all pairs within the
    cutoff): the oracle of the tests."""
    b = positions.shape[0]
    energy = torch.zeros(b, dtype=torch.float64, device=positions.device)
    atomic = torch.zeros(idx.shape, dtype=positions.dtype, device=positions.device)
    forces = torch.zeros_like(positions)
    species = torch.as_tensor(model.config.species, device=positions.device)
    for k in range(b):
        real = (idx[k] >= 0).nonzero().flatten()
        n = int(real.numel())
        pos = positions[k, real].detach().clone().requires_grad_(True)
        numbers = species[idx[k, real].long()]
        ii, jj = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
        keep = ii != jj
        ei = torch.stack([ii[keep], jj[keep]]).to(positions.device)
        d = (pos.detach()[ei[1]] - pos.detach()[ei[0]]).norm(dim=1)
        ei = ei[:, d < model.cutoff]
        shifts = torch.zeros((ei.shape[1], 3), dtype=positions.dtype, device=positions.device)
        batch = torch.zeros(n, dtype=torch.long, device=positions.device)
        res = model(numbers, pos, ei, shifts, batch, 1)
        (grad,) = torch.autograd.grad(res["energy"].sum(), pos)
        energy[k] = res["energy"][0].detach()
        atomic[k, real] = res["atomic_energies"].detach()
        forces[k, real] = -grad
    return energy, atomic, forces
