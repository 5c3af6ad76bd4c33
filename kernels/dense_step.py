"""A small molecule's energy + forces step in two Triton launches a layer, one program per atom: the dense step.

Issue 5's latency row (benzene energy + forces in 0.05 ms) is out of reach for the engine's captured step of ~60
kernels (0.13 ms for the 64 x 3 student on an H200): each node of a CUDA graph costs ~1-2 µs before it does any work.
Stop 68's one-program step had one launch, but one streaming multiprocessor walked the whole chain and its
``[16, 16, F]`` pair tiles spilled (0.61 ms; dropped at stop 69: ``benchmarks/results/stop69_gpu/
small_step_dropped.diff``). Here the step is cut only where the algebra needs every atom's values:

- **a forward launch per layer** (three for the shipped students): program ``(i, b)`` makes the messages that atom
  ``i`` receives (its row of pairs, ``[NP, F]`` tiles over the senders), the update block of atom ``i`` and the next
  layer's φ of atom ``i``; the last one adds the readout, its backward and the last update block's backward;
- **a backward launch per layer**, from the last: program ``(j, b)`` walks atom ``j``'s row of pairs in
  both roles, as sender (the gradients of its φ and v, whose sums run over the receivers) and as receiver, makes
  the position gradient of atom ``j`` from both (no atomics, no scatter), and then the previous layer's update
  block backward of atom ``j`` (with ``split``, the feature part and the geometry part in programs of their own).

Since stop 71 a third program axis fans each forward's serial tail out over programs that share its head (``fan``),
the first forward keeps the pair geometry for the other launches (``geometry``), and under programmatic dependent
launch each launch does what reads nothing its predecessor writes before it waits for that launch (``early``): the
six launches overlap. :meth:`DenseStep.plan` lists them with their grids and constexprs.

Between launches the values live in a scratch of ``[B, NP, slots, F]`` (written once, read by the next launch: in
L2 for a small molecule). Pairs are dense: all ``NP`` partners of an atom, a pair beyond the cutoff or with a padding
slot gets a zero basis, so no neighbour list is needed. The node products are matrix-vector products of one atom's
row on the CUDA cores (exact float32, no TF32 split); the radial filters ``rbf W_f^T`` are ``[NP, R] x [R, F]``
products (``tl.dot``, ``ieee`` by default).

The algebra is :mod:`mlff_distiller.model.analytic`'s (the chain rule of the forward written out) for the shipped
architecture, with the ZBL wall and its gate on the basis (:mod:`.repulsion`): PaiNN message and update blocks, the
first layer's φ from the species table, the last layer's update scalars only, the readout with the per-species
scale and shift; any number of layers. Molecules of up to ``MAX_ATOMS`` atoms, no periodic images. The engine takes
it for one small molecule (``ForceEngine(dense_small=...)``); measured in ``benchmarks/results/stop69_gpu/`` to
``stop71_gpu/``. The jit kernels are in :mod:`._dense_kernels`; this module is the host side.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._triton_utils import HAS_TRITON, pdl_args

if HAS_TRITON:
    from ._dense_kernels import _dense_bwd_kernel, _dense_fwd_kernel

__all__ = [
    "MAX_ATOMS",
    "DenseStep",
    "dense_step",
    "dense_step_reference",
    "layer_size",
    "pack_weights",
    "padded_atoms",
    "supports",
]

MAX_ATOMS = 64  # an atom's row is [NP, F]: 64 partners x 128 features still fits a program's registers
FAN_SMS = 132  # the SMs "auto" fan assumes off CUDA (an H100's or H200's; on CUDA the device's own count)

# Scratch slots (each F floats) per atom, for layer l of NL (the kernels compute them from their LAYER and NL
# constexprs: Triton kernels read no global tuples): φ_l's three blocks at 3 (l - 1) (layers 1 to NL - 1; layer 0's
# come from the species table), φ_l's hidden at 3 (NL - 1) + l - 1, v_l's three components at 4 (NL - 1) + 3 (l - 1),
# s_l at 7 (NL - 1) + l - 1, the update block's saved values at 8 (NL - 1) + 11 l (uv (3), vv (3), |vv|, h2, a_vv,
# a_sv, <uv, vv>), dE/ds_mid and dE/dvm (3) of the layer's messages at 8 (NL - 1) + 11 NL + 4 l, and with ``fan``
# the V share of that dE/dvm (3; the slots before hold the U share) at 8 (NL - 1) + 15 NL + 3 l.


def slots(nl: int) -> int:
    """Scratch slots per atom of a student of ``nl`` layers (70 for 3)."""
    return 8 * (nl - 1) + 18 * nl


def padded_atoms(n: int) -> int:
    """The program tile's partner count for a molecule of ``n`` atoms (a power of two, at least 16: the filter
    products need 16 rows)."""
    return _pow2(max(int(n), 1), 16)


def layer_size(f: int, rp: int) -> int:
    """Floats of one layer's block in the packed weights (see :func:`pack_weights`)."""
    return 22 * f * f + 8 * f + 6 * f * rp


def _pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << (int(n) - 1).bit_length())


def supports(model) -> str | None:
    """None where the dense step computes ``model``; else why not (a sentence)."""
    from mlff_distiller.model import analytic

    c = model.config
    if not analytic.supports(model):
        return "not the plain architecture (a replaced block or layer, or 16-bit layers)"
    if c.layers < 1:
        return f"{c.layers} layers"
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


class DenseStep:
    """The dense step of one model, prepared: the packed weights (:func:`pack_weights`), the wall's
    table and the radial constants made once in ``dtype`` on ``device`` (a snapshot of the weights: prepare again
    after changing them). A call is two launches a layer into buffers kept per batch shape, so it can be captured in
    a CUDA graph. Launch options, each measured on an H200 (``benchmarks/results/stop69_gpu/``, benzene, the 64 x 3
    student, against the engine's captured step of 130 µs):

    - ``prefetch`` (on): the first launch asks L2 for every weight of the step (133 → 113 µs, L2 flushed before
      each step as the benchmarks do);
    - ``split`` (on): each backward's feature and geometry parts in programs of their own (113 → 92 µs);
    - ``pdl`` (on, where :func:`pdl_args` allows it: sm_90 and later, ``MLFF_DISTILLER_PDL``): programmatic
      dependent launch, which the engine's other kernels take (stop 69: 135 → 158 µs with the wait first; stop 71:
      65.1 → 63.3 for benzene, 70.2 → 81.0 for biphenyl, and with ``early`` 55.7 and 66.2);
    - ``num_warps`` (an int, or a pair: forward, backward; by default 8 up to 64 features, else 16, with ``rows``;
      4 and 8 without);
    - ``dot``: the filter products' ``tl.dot`` precision (0 ``ieee``, the default; 1 ``tf32x3``: no faster);
    - ``rows`` (on; or a pair: forward, backward): the node products read each weight's transpose and sum along
      a tile row, within a warp, rather than along a column across warps and then convert the result's layout (on
      sm_90: about half the barriers, 15 % more instructions);
    - ``geometry`` (on): the first forward keeps each pair's basis, its derivative, direction, distance and wall
      terms in a ``[B, NP, NP, 2 RP + 8]`` scratch and the other launches read them instead of computing them again
      (on sm_90, 8 warps: ~700 instructions a thread in a forward, ~1,080 in a backward, of 2,400-4,300; stop 71:
      benzene 69.1 → 67.1 µs, biphenyl 92.5 → 72.7);
    - ``fan`` ("auto": the forward's where its programs, four an atom, fit one an SM, the backward's off; a bool
      sets both, a pair each; the backward's only with ``split``): the serial tail of
      each launch goes to programs of their own after a head they all compute: below the last layer the update's
      saved values and v in one program and each of the next φ's three blocks in another (15 → 12 matrix-vector
      products on the longest chain), in the last forward and in each backward's feature part the update block's
      backward in three (dE/ds_mid; dE/dvm's U share; its V share, which the next launch adds: 22 → 18 and
      15 → 11). Stop 71 (``stop71_gpu/b/``): forward benzene 65.5 → 62.6 µs, biphenyl 72.6 → 68.5 (128
      programs); the backward's is slower (72.8 and 87.3: its geometry part is the longer one); C60 in 64 slots
      (256 programs, two waves; ``e/``): 159.5 with it, 110.3 without;
    - ``early`` (on; with ``pdl``): what a launch reads that its predecessor does not write (the kept geometry, the
      filter products, the forward's values in a backward and, since stop 72, the backward's update-block rows) comes
      before its wait for that launch, so that it overlaps the predecessor's work (``stop71_gpu/c/``: benzene
      65.1 → 55.7 µs, biphenyl 70.2 → 66.2; the update rows ``stop72_gpu/b/``: 55.6 → 54.1; results equal after
      back-to-back replays; an L1 prefetch of the weight tiles before the wait as well measured no faster, 55.1).
      Safe because a launch starts only after its predecessor has passed its own wait, so every launch before the
      predecessor has finished: the kept geometry (the first launch's) is read early from the third launch on (the
      second computes its own), and nothing is written before the wait.

    Not an option: the kernels sum along one axis in one variadic ``tl.reduce`` where several sums share it (a
    launch's slot sums, U and V, M1's blocks) and reduce summed node products once (``_dense_kernels._sum2`` ...;
    the interpreter sums each alone, its generic reduce being ~100x slower): on sm_90 the backward's 3,072 → 2,824
    instructions, 87 → 77 barriers; ``stop72_gpu/e/``: benzene 54.1 → 47.8 µs alone, 48.8 through the engine.

    ``ablate`` (0) is a timing instrument, not an option: 1 leaves a split backward's feature programs' work out, 2
    its geometry program's, so that a probe can time each kind of program alone (the results are wrong)."""

    def __init__(
        self, model, dtype=torch.float32, device="cpu", *, dot: int = 0, num_warps: int | tuple[int, int] | None = None,
        prefetch: bool = True, split: bool = True, pdl: bool = True, rows: bool | tuple[bool, bool] = True,
        geometry: bool = True, fan: bool | str | tuple = "auto", early: bool = True, ablate: int = 0,
    ):  # fmt: skip
        with torch.no_grad():
            reason = supports(model)
            if reason is not None:
                raise ValueError(f"dense_step: {reason}")
            device = torch.device(device)
            c = model.config
            self.weights = pack_weights(model, dtype).to(device)
            table = model.repulsion_table
            if table is None:  # a wall of radius 0 for every pair: no pair is inside
                from .repulsion import repulsion_table

                table = repulsion_table(c.species, {})
            self.table = table.to(device=device, dtype=dtype).contiguous()
            rc = float(c.cutoff)
            consts = [rc, math.pi / rc, math.sqrt(2.0 / rc), -0.5 * math.pi / rc]
            self.consts = torch.tensor(consts, dtype=dtype, device=device)
        self.dtype, self.device = dtype, self.weights.device
        self.n_species, self.hidden, self.n_rbf, self.layers = len(c.species), c.hidden, c.n_rbf, c.layers
        self.dot = dot
        self.prefetch = prefetch and self.device.type == "cuda"  # (PTX: not on the interpreter)
        self.split, self.pdl = split, pdl
        self.rows = (rows, rows) if isinstance(rows, bool) else tuple(rows)
        self.geometry = geometry
        if fan == "auto":
            fan = ("auto", False)
        fan = (fan, fan) if isinstance(fan, bool) else tuple(fan)
        if len(fan) != 2 or fan[0] not in (True, False, "auto") or fan[1] not in (True, False):
            raise ValueError(f"dense_step: fan {fan!r}: a bool, 'auto' or a pair (forward, backward) expected")
        self.fan = (fan[0], bool(fan[1]) and split)
        # a forward's programs with "auto" fan: at most one an SM (each takes a whole SM's registers at 8 warps)
        self.sm_count = FAN_SMS
        if self.device.type == "cuda":
            self.sm_count = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.early = early
        self.ablate = int(ablate)  # a timing instrument (wrong results): see the docstring
        z2i = torch.full((max(c.species) + 1,), -1, dtype=torch.int32)
        z2i[torch.as_tensor(c.species)] = torch.arange(len(c.species), dtype=torch.int32)
        self.z2i = z2i.to(self.device)
        if num_warps is None:
            num_warps = (8 if self.hidden <= 64 else 16) if all(self.rows) else (4 if self.hidden <= 64 else 8)
        self.num_warps = (num_warps, num_warps) if isinstance(num_warps, int) else tuple(num_warps)
        assert self.weights.numel() >= self.layers * layer_size(self.hidden, _pow2(self.n_rbf))
        self._scratch: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}

    def scratch(self, b: int, np_: int) -> tuple[Tensor, Tensor, Tensor]:
        """The ``[B, NP, slots, F]`` scratch, the ``[B, NP, 3]`` position-gradient buffer and, with ``geometry``,
        the kept geometry ``[B, NP, NP, 2 RP + 8]`` (else one element, never read) of a batch shape."""
        key = (b, np_)
        if key not in self._scratch:
            geo = (b, np_, np_, 2 * _pow2(self.n_rbf) + 8) if self.geometry else (1,)
            self._scratch[key] = (
                torch.empty((b, np_, slots(self.layers), self.hidden), dtype=self.dtype, device=self.device),
                torch.empty((b, np_, 3), dtype=self.dtype, device=self.device),
                torch.empty(geo, dtype=self.dtype, device=self.device),
            )
        return self._scratch[key]

    def __call__(self, positions: Tensor, idx: Tensor, out=None) -> tuple[Tensor, Tensor, Tensor]:
        """``(energy [B] float64, atomic [B, NP], forces [B, NP, 3])`` of molecules given as ``positions [B, NP,
        3]`` (Å, NP a power of two from 16 to :data:`MAX_ATOMS`) and species indices ``idx [B, NP]`` (int32; -1
        marks a padding slot). Shapes, dtypes and devices are checked here; the indices' range is the caller's
        promise (a check would read them back from the device, which a captured call cannot)."""
        if positions.dim() != 3 or positions.shape[2] != 3 or idx.shape != positions.shape[:2]:
            raise ValueError(
                f"dense_step: positions [B, NP, 3] and idx [B, NP] expected, got {tuple(positions.shape)} and "
                f"{tuple(idx.shape)}"
            )
        b, np_ = positions.shape[:2]
        if np_ < 16 or np_ > MAX_ATOMS or np_ & (np_ - 1):
            raise ValueError(f"dense_step: NP = {np_} slots; a power of two from 16 to {MAX_ATOMS} expected")
        if positions.dtype != self.dtype or positions.device != self.device or idx.dtype != torch.int32:
            raise ValueError(
                f"dense_step: positions in {self.dtype} on {self.device} and int32 idx expected, got "
                f"{positions.dtype} on {positions.device} and {idx.dtype}"
            )
        if out is None:
            out = (
                torch.empty(b, dtype=torch.float64, device=self.device),
                torch.empty((b, np_), dtype=self.dtype, device=self.device),
                torch.empty((b, np_, 3), dtype=self.dtype, device=self.device),
            )
        if b:
            self._launch(positions.contiguous(), idx.contiguous(), idx, False, b, np_, out)
        return out

    def from_numbers(
        self, positions: Tensor, numbers: Tensor, batch: Tensor, np_: int, out, zero: tuple | None = None
    ) -> None:
        """The step of structure 0 of the engine's padded buffers (``positions [A, 3]``, ``numbers [A]`` and
        ``batch [A]``, int64, A ≥ ``np_``): its atoms are the slots among the first ``np_`` whose ``batch`` is 0,
        their species from their atomic numbers in the kernels. Writes ``out`` = (energy [1] float64, atomic
        [1, np_], forces [1, np_, 3]): a launch sequence with no other operation, for a captured step. ``zero``:
        ``(flat, ranges)``, a flat tensor in the step's dtype and three ``(start, end)`` element ranges of it that
        the first launch fills with zeros (the engine's packed output beyond what the step writes, so that it needs
        no fill kernel of its own)."""
        self._launch(positions, numbers, batch, True, 1, np_, out, zero)

    def plan(self, b: int, np_: int, from_z: bool, pdl: dict | None = None, zero: bool = False) -> list[tuple]:
        """The launches of a step, in order: ``(kernel, grid, constexprs and launch options)`` (the kernels'
        tensor and integer arguments are :meth:`_launch`'s); ``pdl``: :func:`pdl_args`'s (off where None);
        ``zero``: the first launch zeros ranges of the engine's output (:meth:`from_numbers`)."""
        nl = self.layers
        meta = dict(NL=nl, NP=np_, F=self.hidden, R=self.n_rbf, RP=_pow2(self.n_rbf), SL=slots(nl), DOT=self.dot)
        meta["FROM_Z"], meta["GEO"] = from_z, self.geometry
        meta |= pdl if pdl is not None else {"PDL": False}
        n_w = self.weights.numel()
        pf = _pow2(-(-n_w // (32 * np_)), 1) if self.prefetch else 0
        fan_f, fan_b = self.fan
        if fan_f == "auto":
            fan_f = b * np_ * 4 <= self.sm_count
        out = []
        for layer in range(nl):
            roles = (3 if layer == nl - 1 else 4) if fan_f else 1
            kw = dict(LAYER=layer, PREFETCH=pf, MV=int(self.rows[0]), FAN=fan_f, EARLY=self.early)
            kw["ZERO"] = zero and layer == 0
            kw["num_warps"] = self.num_warps[0]
            out.append((_dense_fwd_kernel, (np_, b, roles), kw | meta))
        for layer in reversed(range(nl)):
            split = self.split and layer > 0
            kw = dict(LAYER=layer, SPLIT=split, MV=int(self.rows[1]), FAN=fan_b and split, num_warps=self.num_warps[1])
            kw["FAN_IN"] = fan_f if layer == nl - 1 else fan_b
            kw["EARLY"] = self.early and nl > 1  # (one layer: the kept geometry is the previous launch's)
            kw["ABLATE"] = self.ablate
            out.append((_dense_bwd_kernel, (np_, b, (4 if fan_b else 2) if split else 1), kw | meta))
        return out

    def _launch(self, pos: Tensor, ix: Tensor, batch: Tensor, from_z: bool, b: int, np_: int, out, zero=None) -> None:
        energy, atomic, forces = out
        sc, gpos, geo = self.scratch(b, np_)
        common = (pos, ix, batch, self.z2i, self.weights, self.table, self.consts, sc, geo)
        if zero is None:
            zargs = (atomic, 0, 0, 0, 0, 0, 0)
        else:
            flat, ranges = zero
            if flat.dtype != self.dtype or flat.dim() != 1 or len(ranges) != 3:
                raise ValueError("dense_step: zero = (a flat tensor in the step's dtype, three (start, end) ranges)")
            zargs = (flat, *(int(v) for r in ranges for v in r))
        for kernel, grid, kw in self.plan(b, np_, from_z, pdl_args(pos) if self.pdl else None, zero is not None):
            if kernel is _dense_fwd_kernel:
                kernel[grid](*common, atomic, self.n_species, self.weights.numel(), *zargs, **kw)
            else:
                kernel[grid](*common, gpos, atomic, energy, forces, self.n_species, **kw)


def dense_step(model, positions: Tensor, idx: Tensor, **kw) -> tuple[Tensor, Tensor, Tensor]:
    """``(energy [B] float64, atomic [B, NP], forces [B, NP, 3])``: :class:`DenseStep` made for this one call
    (keep a ``DenseStep`` for repeated calls)."""
    return DenseStep(model, positions.dtype, positions.device, **kw)(positions, idx.to(torch.int32))


def dense_step_reference(model, positions: Tensor, idx: Tensor) -> tuple[Tensor, Tensor, Tensor]:
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
