"""Small-row GEMMs of the student's atom-wise layers, for inference: ``act(x Wᵀ + b)`` in one Triton kernel.

The atom-wise layers of a PaiNN student (the filter network φ, the update block's U, V and mixing MLP, the
readout) are GEMMs of a few hundred rows by 128-384 columns when one molecule or one MD box runs. cuBLAS takes
5-10 µs for each of them in strict float32 on the H100 (``benchmarks/results/tiny_gemm_h100.md``; ~40 per force
evaluation of a 3-layer model), plus a separate kernel for each SiLU and its derivative. Here one Triton kernel
per GEMM tiles the output over many small programs (16 x 32 tiles for small M), runs ``tl.dot`` in "tf32x3"
(float32 accuracy on the tensor cores, ~3e-7 relative) and fuses the bias and the activation into the epilogue;
the backward fuses SiLU' into the loading of its input (the prologue) and may accumulate into its output.

:func:`gemm` is the kernels' host function (no autograd; the kernels are in ``_gemm_kernels.py``); :func:`mlp`
is a two-layer MLP ``W2 SiLU(W1 x + b1) + b2`` with a first-order backward for frozen weights (gradients wrt x
only), what the model's φ runs on the inference path (:func:`gemm_fusable`); :func:`readout` is that MLP with one
output, the per-species energy scale and shift and the per-structure sum in its last GEMM's epilogue (its backward
gathers them in the first GEMM's prologue), which saves the five small torch kernels (two gathers, mul, add,
index_add) forward and two backward. The torch references are ``F.linear`` / ``nn.Sequential`` /
:func:`readout_reference`.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as nnf

from ._backend import resolve_backend
from ._compile_ahead import dry_run_for_capture
from ._frozen import derived, tf32_exact, tf32_parts
from ._precision import dot_mode
from ._triton_utils import (
    HAS_TRITON,
    FirstOrderOnly,
    cdiv,
    check_launchable,
    next_pow2,
    pdl_args,
    sm90,
)

try:  # Triton's host-side tensor descriptors (the large-M launch's TMA path; None: that path is off)
    from triton.tools.tensor_descriptor import TensorDescriptor as _TensorDescriptor
except ImportError:  # pragma: no cover - an older or absent Triton
    _TensorDescriptor = None

__all__ = ["gemm", "gemm_fusable", "mlp", "mlp_reference", "readout", "readout_reference"]

# Launch: rows at or below small_rows use 16 x 32 output tiles (many programs for few rows) and walk K in block_k
# steps; larger ones 64 x 64 tiles over 4 warps with BK = large_block_k = 32. A sweep at 6,944 and 21,749 rows
# (benchmarks/results/bench_gemm_tiles_h100.md) found 128 x 64 over 8 warps with BK 32 faster for every forward
# form alone (128 -> 384 at 21,749 rows 48.1 -> 40.3 µs); in the whole step (benchmarks/probe_ncu.py,
# results/probe_ncu_sweep_h100_run2.md) BK 32 on the 64 x 64 tile did best: 1.035x for 4,096 g2 molecules,
# 1.01x at 3,000 and 24,000 atoms of water, against 1.00-1.02x for the 128 x 64 tile. Nsight Compute
# (results/ncu_summary_h100.md) showed why: with K = 128 and BK 64 the three pipeline stages took 131 KB of shared
# memory, one 4-warp program per SM.
# untransposed_max_rows: above it the backward forms (B = W as stored, [K, N], N-major) run as forward forms on W's
# kept transpose (K-major B tiles: the layout the TF32 MMAs take; on the interpreter, torch's product). Loading W
# N-major, our kernel was slower than cuBLAS's strict-fp32 kernels there (1.2-1.8x at 6,944 and 21,749 rows,
# benchmarks/results/bench_gemm_h100.md), which ran them until stop 27; the forward forms were 1.13-5.3x faster
# than cuBLAS at every size measured (64-21,749 rows). The kept transpose in the whole step, against cuBLAS
# (results/probe_ncu_sweep_h100_run13.md): 1.068x for 4,096 g2 molecules, 1.057x for 1,024, 1.028x for 3,000
# water atoms. Below the threshold the N-major loads stay: at every size there (benzene, 192 water atoms) the
# transpose measured 0.95-0.99x.
# w_split_min_rows: "tf32x3" (float32 accuracy from three TF32 MMAs) as Triton's tl.dot does it splits both tiles
# into their TF32 part and the rest in registers after every load. On Hopper the B tile must then go back to shared
# memory for the warpgroup MMA, every K step. W is frozen here, so its two parts are made once (_frozen.tf32_parts)
# and the kernel loads them as they are; only A is split in registers (benchmarks/probe_gemm_split.py; the shipped
# kernel at 7,200 rows, 128 -> 384: 17.0 -> 13.9 us on an H200, results/stop43_gpu/bench_gemm_*_h200.md). The whole
# step, split once against Triton's split (H200, results/stop43_gpu/probe_ncu_sweep_wsplit.md): 1.058x for 1,024 g2
# molecules, 1.043x for 4,096, 1.017x for 3,000 water atoms; the small-tile launches (mma.sync, at most small_rows
# rows) gained nothing (benzene 0.99x), hence the threshold just above small_rows.
_CONFIG = {
    "small_rows": 2048,
    "small": (16, 32, 4),
    "large": (64, 64, 4),
    "block_k": 64,
    "large_block_k": 32,
    "dot": "tf32x3",
    "untransposed_max_rows": 1024,
    "stages": None,  # num_stages of the launch on the GPU (None: Triton's default)
    "large_maxnreg": None,  # register cap per thread of the large-M launches (None: the compiler's choice)
    # tf32x3 with W split once (_frozen.tf32_parts) for launches of at least this many rows; None: Triton's own split.
    "w_split_min_rows": 2049,
    # A weight whose entries are all TF32 values (_frozen.tf32_exact: a student on the TF32 grid) takes "tf32x2w":
    # A split in registers, two TF32 MMAs, the same sums as tf32x3 (its A_hi W_lo product is exactly zero). With
    # the message passing's filter dots the same way, 1.07-1.12x a whole step on the H200 (benzene 1.068, 3,000
    # water atoms 1.098, g2 x 1,024 1.112, x 4,096 1.117, 24,000 atoms 1.111; the GEMMs' share alone 1.02-1.07x;
    # benchmarks/results/stop59_gpu/b/probe_ncu_sweep_x2.md). False: tf32x3 for every weight (probes time the two).
    "w_exact_two_mmas": True,
    # nan_guard False (shipped since stop 61): the "tf32x2w" launches drop dot_w's NaN guard (kernel dot "tf32x2f",
    # :func:`dot_fin`), as the message kernels' forward and sender dots do; the same bits for finite operands, a NaN
    # in place of an inf otherwise. The guard is 64 of a 64 x 64 tile's ~475 instructions per K step
    # (probe_sass.py). Whole step without it (H200, benchmarks/results/stop61_gpu/h/): benzene 1.023x, g2 x 1,024
    # 1.023x, x 4,096 1.010x, water 3,000 1.010x, 24,000 1.003x. True: the guard kept (probes time the two).
    "nan_guard": False,
    # w_exact_tf32: "tf32" launches (the engine's tf32 precision) with W on the TF32 grid take "tf32w": A alone
    # rounded to nearest, W as it is (the same bits as "tf32", whose rounding leaves such a W unchanged), so the
    # warpgroup MMA reads W's tile from shared memory as copied, not through registers and back (the tf32 step
    # 1.012-1.021x with the message kernels' switch, benchmarks/results/stop61_gpu/i/).
    "w_exact_tf32": True,
    # The readout's per-structure sums zeroed by its first GEMM (stop 47: one fill kernel fewer a step); False: a
    # zero fill of their own (probes time the two).
    "readout_zero_in_gemm": True,
    # The per-structure energy sums accumulated in float64 and returned so (since stop 53; until then rounded once
    # to the model's dtype, a cast kernel that cost 0.4-0.6 % of a benzene step). In float32 atomics a 200,001-atom
    # water box's energy (-9.2e6 eV with the shipped students' ~-46 eV atomic energies) came out 6,300 eV (7e-4) off
    # on an H200, 15 eV apart between calls: each add rounds at the sum's spacing (1 eV there), with one sign for
    # atoms of one species (stop 50; benchmarks/results/stop50_gpu/probe_energy_sum.md). False: float32 sums in the
    # model's dtype (probes time the two).
    "energy_sum_f64": True,
    # Column tiles of one row tile launched next to each other (a 1-D grid), so that they read A's tile from L2:
    # with the 2-D grid (row tile fastest) A streamed from DRAM once per column tile where it does not stay in L2,
    # as in [U; V]'s 3N rows (g2 x 4,096: 84 µs at 80 % of DRAM bandwidth for ~100 MB of operands, Nsight Compute,
    # benchmarks/results/stop60_gpu/a/). False: the 2-D grid (probes time the two).
    "col_fast": True,
    # The readout's per-structure sums: a tile whose rows all belong to one structure adds its column sums with one
    # atomic each instead of one per row into the same address (a 24,000-atom box: 47.6 µs, all of its 24,000
    # float64 atomics on E[0]; stop60_gpu/a/). Atomics had no fixed order before either. False: one atomic per row
    # (probes time the two).
    "segsum_tile": True,
    # The large-M launches (above small_rows) move A, W, the prologue's operand, C, the pre-activation and the
    # addend through tensor descriptors (Hopper's copy engine, _gemm_tma_kernel) where every one of them allows
    # it: the same tile and arithmetic, the same bits, 1.07-1.28x a call on the H200 at 7,200-66,000 rows
    # (benchmarks/results/stop60_gpu/c/probe_gemm_tma_h200.md). False: element-wise loads and stores.
    "tma": True,
    # ... but outside a CUDA-graph capture only from this many rows on. A descriptor launch costs more host time
    # (H200 host, bench_gemm.py --host: 73-122 µs a call against 42-47 element-wise; stop60_gpu/h/), which a
    # captured step pays once and an eager step on every call, and mid-size eager steps are host-bound: eager, with
    # the descriptors at every size, water 3,000 0.69x and g2 x 4,096 (21,749 atoms) 0.89x; a 24,000-atom water
    # step, device-bound, 1.00x (with none: 0.99x). From 65,536 rows (a 3N-row [U; V] product of 21,846 atoms;
    # boxes past the captured ladder) the device's share wins.
    "tma_eager_min_rows": 65536,
    # Measured and dropped (stop 64, benchmarks/results/stop64_gpu/c/, gemm_persist_dropped.diff): the descriptor
    # launch as a persistent grid (2 or 1 programs per SM walking their tiles in one flattened loop; alone 1.03-1.11x
    # on the forward forms at 22,000-66,000 rows, stop64_gpu/b/probe_gemm_ws.md). The whole step from 16,000 rows:
    # g2 x 4,096 0.93-0.97x, water 24,000 0.98-0.99x, g2 x 1,024 0.98-0.99x; the 128-row tile alone 0.93-0.98x.
    # Warp specialisation (tl.range warp_specialize, Triton's Hopper autoWS) lost alone already: 0.42-0.84x, and
    # gave wrong sums for a 64 x 128 tile on Triton 3.6.
    # Measured and dropped (stop 62, benchmarks/results/stop62_gpu/h/, mlp_fused_dropped.diff): a two-layer MLP's
    # forward or backward as one launch, one program per 64 rows holding the hidden rows in registers (four K-step
    # tiles) and walking the output columns. The whole step from 2,049 rows: g2 x 1,024 0.89-0.90x, x 4,096
    # 0.90-0.95x, water 3,000 0.93-0.95x (8 and 4 warps): a grid of one program per row tile, each a long chain of
    # dependent MMAs, in place of 2-6x as many short ones.
}
_EPI = {"none": 0, "silu": 1}
_DOTS = ("tf32x3", "tf32", "ieee", "bf16", "fp16")
_DOT16 = ("bf16", "fp16")
_PRO_SILU, _PRO_ADD, _PRO_GATHER, _PRO_NORM = 1, 2, 3, 4  # the A-operand prologues of _gemm_kernel (0: none)
_NORM_EPS = 1e-8  # the update block's constant under ‖vv‖'s square root (painn_update._EPS; the model's)


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


def mlp(
    x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor, residual: bool = False
) -> Tensor | tuple[Tensor, Tensor]:
    """Two-layer SiLU MLP on ``x [..., K]``: Triton GEMMs when :func:`gemm_fusable`, else the torch reference.

    ``residual``: also return ``x`` itself, for a caller that uses x again besides the MLP (a residual sum). On the
    Triton path that second output is an alias of x whose gradient the MLP's backward adds in its last GEMM's
    epilogue, instead of autograd adding the two gradients of x in a kernel of its own (the same sum)."""
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
        out = mlp_reference(x, w1, b1, w2, b2)
        return (out, x) if residual else out
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if not torch.is_grad_enabled() or not x.requires_grad:
        out = gemm(gemm(x2, w1, b1, act="silu")[0], w2, b2)[0]
        return (out.reshape(*lead, w2.shape[0]), x) if residual else out.reshape(*lead, w2.shape[0])
    if not residual:
        return _MLP.apply(x2, w1, b1, w2, b2, False).reshape(*lead, w2.shape[0])
    out, alias = _MLP.apply(x2, w1, b1, w2, b2, True)
    return out.reshape(*lead, w2.shape[0]), alias.view(x.shape)


def readout_reference(
    x: Tensor,
    w1: Tensor,
    b1: Tensor,
    w2: Tensor,
    b2: Tensor,
    scale: Tensor,
    shift: Tensor,
    species: Tensor,
    batch: Tensor,
    num_structures: int,
) -> tuple[Tensor, Tensor]:
    """Per-structure and per-atom energies (eV): ``ε_i = MLP(x_i) · scale[species_i] + shift[species_i]`` and
    ``E_b = Σ_{i: batch_i = b} ε_i``, with ``MLP = W2 SiLU(W1 x + b1) + b2`` of one output. Returns ``E [B]``,
    ``ε [N]``."""
    atomic = mlp_reference(x, w1, b1, w2, b2).squeeze(-1) * scale[species] + shift[species]
    return structure_sums(atomic, batch, num_structures, keep_wide=True), atomic


def structure_sums(atomic: Tensor, batch: Tensor, num_structures: int, *, keep_wide: bool = False) -> Tensor:
    """``E_b = Σ_{i: batch_i = b} ε_i`` (``[B, ...]`` from ``[N, ...]``), accumulated in float64
    (``_CONFIG["energy_sum_f64"]``): a float32 sum over many atoms rounds at each add (6,300 eV off on a 200,001-atom
    water box on a GPU's atomics). ``keep_wide``: returned in float64 (the energies: a float32 total of a 24,000-atom
    water box, ~-1.1e6 eV, is only good to its spacing of 0.125 eV, 4 eV at 1M atoms), else rounded once to
    ``atomic``'s dtype (the stress's per-structure virial sums, ``engine_padded.edge_virial``: an intensive
    quantity). Differentiable (twice: training on forces)."""
    shape = (num_structures, *atomic.shape[1:])
    if atomic.dtype == torch.float64 or not _CONFIG["energy_sum_f64"]:
        # In place into fresh zeros: the out-of-place index_add would first copy them (a kernel more).
        return atomic.new_zeros(shape).index_add_(0, batch, atomic)
    wide = atomic.new_zeros(shape, dtype=torch.float64).index_add_(0, batch, atomic.to(torch.float64))
    return wide if keep_wide else wide.to(atomic.dtype)


# The pair repulsion (ZBL wall) is added after the readout by the model (kernels.add_pair_repulsion). Its forward adding
# into the readout's own outputs and its backward inside the readout's (a switch built at stop 48: one copy of the two
# outputs fewer) measured no gain in a captured step on an H200 at stop 49 (shipped / wall in the readout: 0.997
# benzene, 1.000 192 water atoms, 0.999 1,024 g2 molecules; benchmarks/results/stop49_gpu/probe_ncu_sweep_48.md,
# probe_ncu_sweep_49b.md) and was dropped, with the step's packed output written in place that it fed. The code is in
# benchmarks/results/stop49_gpu/wall_packed_pdl_dropped.diff.
def readout(
    x: Tensor,
    w1: Tensor,
    b1: Tensor,
    w2: Tensor,
    b2: Tensor,
    scale: Tensor,
    shift: Tensor,
    species: Tensor,
    batch: Tensor,
    num_structures: int,
) -> tuple[Tensor, Tensor]:
    """:func:`readout_reference` (``x [N, K]``, ``species`` and ``batch`` ``[N]`` indices into ``scale``/``shift``
    and the B structures): two Triton GEMMs with the scale, shift and sum fused when :func:`gemm_fusable` (frozen
    weights; gradient wrt x only, first order), else the torch reference. Returns ``E [B]`` (float64 for a float32
    x: :func:`structure_sums`), ``ε [N]`` (x's dtype), in eV."""
    if x.dim() != 2 or w2.shape[0] != 1 or species.shape != x.shape[:1] or batch.shape != x.shape[:1]:
        raise ValueError(
            f"readout: x must be [N, K] with species and batch [N], W2 one output row; got x {list(x.shape)}, "
            f"species {list(species.shape)}, batch {list(batch.shape)}, W2 {list(w2.shape)}"
        )
    if not gemm_fusable(x, w1, b1, w2, b2, scale, shift):
        return readout_reference(x, w1, b1, w2, b2, scale, shift, species, batch, num_structures)
    if not torch.is_grad_enabled() or not x.requires_grad:
        return _readout_forward(x.contiguous(), w1, b1, w2, b2, scale, shift, species, batch, num_structures)[:2]
    return _Readout.apply(x.contiguous(), w1, b1, w2, b2, scale, shift, species, batch, num_structures)


def _readout_forward(x, w1, b1, w2, b2, scale, shift, species, batch, num_structures, dot=None):
    """``E [B]``, ``ε [N]`` and the pre-activation of the hidden layer (for the backward)."""
    # The per-structure sums start at zero: filled by the first GEMM's kernel (no fill kernel) where it has
    # enough rows (a structure has at least one atom: always, but for a caller's empty structures).
    wide = torch.float64 if _CONFIG["energy_sum_f64"] else x.dtype  # the sums' dtype (see _CONFIG)
    if 0 < num_structures <= x.shape[0] and _CONFIG["readout_zero_in_gemm"]:
        energy = x.new_empty((num_structures, 1), dtype=wide)
        h, pre = gemm(x, w1, b1, act="silu", dot=dot, zero=energy)
    else:
        energy = x.new_zeros((num_structures, 1), dtype=wide)
        h, pre = gemm(x, w1, b1, act="silu", dot=dot)
    species, batch = species.contiguous(), batch.contiguous()
    atomic, _ = gemm(h, w2, b2, row_affine=(species, scale, shift), segment_sum=(batch, energy), dot=dot)
    return energy.view(num_structures), atomic.view(-1), pre  # E as summed: float64 (see structure_sums)


def gemm(
    a: Tensor | None,
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
    prologue_gather: tuple[Tensor, Tensor, Tensor, Tensor] | None = None,
    row_affine: tuple[Tensor, Tensor, Tensor] | None = None,
    segment_sum: tuple[Tensor, Tensor] | None = None,
    dot: str | None = None,
    zero: Tensor | None = None,
    prologue_norm: tuple[Tensor, Tensor | None, Tensor] | None = None,
) -> tuple[Tensor, Tensor | None]:
    """``C = act(A' B + bias)`` with ``B = Wᵀ`` (``transpose_w``, W an ``nn.Linear`` weight ``[N, K]``) or ``W``
    (``[K, N]``), and ``A' = A ⊙ SiLU'(P)`` when ``prologue_silu_of = P`` (the backward of a SiLU), ``A' = A + Q``
    when ``prologue_add = Q`` (a residual sum that then need not be stored: the same rounded sum as ``A + Q``), else
    ``A``. ``act`` "silu" also returns the pre-activation. ``accumulate`` adds into ``out``; ``addend = D``
    (``[M, N]``, no ``act``) adds D instead, so that ``out`` need not hold it (a gradient sum autograd would
    otherwise add in a kernel of its own). Returns ``(C, pre)``.

    Per-row gathers (the per-species affine map and per-structure sum of a readout, and their backward):
    ``prologue_gather = (G [S, K], seg [M], scale [T], idx [M])``: ``A' = (A + G[seg]) ⊙ scale[idx]`` (row-wise; A
    may be None: ``A' = G[seg] ⊙ scale[idx]``). ``row_affine = (idx [M], scale [T], shift [T])``: after the bias,
    ``C = C ⊙ scale[idx] + shift[idx]`` (row-wise; rounded as the two torch ops would, no fused multiply-add).
    ``segment_sum = (seg [M], E [S, N])``: also adds the rows of C into ``E[seg]`` (atomics: the caller zeroes E).

    ``zero``: a contiguous tensor of at most M entries that the kernel also fills with zeros (the per-structure
    sums of a later ``segment_sum``: no fill kernel of their own).

    ``prologue_norm = (S [M, F], D [M, F] or None, U [3M, 2F])`` with A None: ``A' = [S + D | ‖V‖]`` (K = 2F), where
    ``‖V‖_i = sqrt(Σ_k U[3i + k, F:]² + 1e-8)``: the update block's MLP input made in the load from its
    ``[uv | vv]`` rows (painn_update's norm kernel, whose ``[M, 2F]`` output then need not be stored).

    ``dot``: the tiles' product, one of ``_DOTS``: "tf32x3" (float32 accuracy), "tf32", "ieee", or "bf16" / "fp16"
    (A' and B tiles rounded to that type in registers, float32 accumulation). None: :func:`._precision.dot_mode`,
    the engine's precision ("ieee" on the interpreter unless a 16-bit type is set).
    """
    if dot is not None and dot not in _DOTS:
        raise ValueError(f"gemm: dot {dot!r} is not one of {_DOTS}")
    if a is None:
        if prologue_norm is not None:
            s_in, d_in, u_in = prologue_norm
            m, k = s_in.shape[0], 2 * s_in.shape[1]
            if prologue_gather is not None or s_in.dim() != 2 or tuple(u_in.shape) != (3 * m, k):
                raise ValueError(f"gemm: prologue_norm wants S [M, F] and U [3M, 2F], got {list(s_in.shape)}, "
                                 f"{list(u_in.shape)}")  # fmt: skip
            if d_in is not None and d_in.shape != s_in.shape:
                raise ValueError(f"gemm: prologue_norm's D must be S's shape {list(s_in.shape)}")
        elif prologue_gather is None:
            raise ValueError("gemm: A may be None only with prologue_gather or prologue_norm")
        else:
            m, k = prologue_gather[1].shape[0], prologue_gather[0].shape[1]
    elif prologue_norm is not None:
        raise ValueError("gemm: prologue_norm makes A: pass A as None")
    else:
        m, k = a.shape
    n = w.shape[0] if transpose_w else w.shape[1]
    if (w.shape[1] if transpose_w else w.shape[0]) != k:
        raise ValueError(f"gemm: A is [{m}, {k}] but W is {list(w.shape)} (transpose_w={transpose_w})")
    if prologue_silu_of is not None and prologue_add is not None:
        raise ValueError("gemm: one prologue at a time (prologue_silu_of or prologue_add)")
    if addend is not None and (accumulate or act != "none" or tuple(addend.shape) != (m, n)):
        raise ValueError(f"gemm: addend must be [{m}, {n}], without accumulate or act")
    if (prologue_gather is not None or prologue_norm is not None) and (
        prologue_silu_of is not None or prologue_add is not None
    ):
        raise ValueError("gemm: one prologue at a time")
    if (row_affine is not None or segment_sum is not None) and (act != "none" or accumulate or addend is not None):
        raise ValueError("gemm: row_affine and segment_sum take no act, accumulate or addend")
    if zero is not None and (zero.numel() > m or not zero.is_contiguous()):
        raise ValueError(f"gemm: zero must be a contiguous tensor of at most {m} entries, got {list(zero.shape)}")
    a = a.contiguous() if a is not None else None
    if prologue_norm is not None:
        prologue_norm = tuple(t.contiguous() if t is not None else None for t in prologue_norm)
        ref = prologue_norm[0]
    else:
        ref = w if a is None else a
    # The engine's precision: tf32x3 (fp32), one TF32 pass (tf32, like cuBLAS there), 16-bit MMAs (bf16, fp16).
    dot = dot or resolved_dot(ref)
    # W on the TF32 grid (a student rounded there): tf32x3's third product is zero, two MMAs give the same sums.
    w_exact = dot == "tf32x3" and _CONFIG["w_exact_two_mmas"] and tf32_exact(w)
    w = w.contiguous()
    if dot in _DOT16 and ref.dtype != torch.float32:
        raise ValueError(f"gemm: dot {dot!r} takes float32 operands, got {ref.dtype}")
    if out is None:
        if accumulate:
            raise ValueError("gemm: accumulate needs out")
        out = ref.new_empty((m, n))
    pre = ref.new_empty((m, n)) if act == "silu" else None
    if zero is not None and (m == 0 or n == 0):  # no kernel launched below
        zero.zero_()
        zero = None
    if m == 0 or n == 0:
        if addend is not None:
            out.copy_(addend)
        elif not accumulate:
            out.zero_()
        return out, pre
    if not transpose_w and m > _CONFIG["untransposed_max_rows"] and w.is_cuda:
        # B = W as stored is N-major. W's kept transpose (it is frozen here: _frozen.derived) makes the same product
        # a transpose_w one, whose B tiles are K-major, as the tensor cores' TF32 MMAs take them.
        w, transpose_w = derived("t", _contiguous_t, w), True
    if not transpose_w and m > _CONFIG["untransposed_max_rows"]:  # the interpreter: torch's product
        if prologue_norm is not None:
            a = _norm_input(*prologue_norm)
        if zero is not None:
            zero.zero_()
        if prologue_add is not None:
            a = a + prologue_add
        if prologue_gather is not None:
            src, seg, scale, idx = prologue_gather
            g = src.index_select(0, seg).to(scale.dtype)  # (the gradient of a float64 E: rounded, as the kernel does)
            a = (g if a is None else a + g) * scale.index_select(0, idx)[:, None]
        out = _torch_gemm(a, w, bias, act, transpose_w, prologue_silu_of, out, accumulate, dot)
        if addend is not None:  # after the product (as the Triton epilogue adds), not as addmm's beta·C
            out.add_(addend)
        if row_affine is not None:
            idx, scale, shift = row_affine
            out.mul_(scale.index_select(0, idx)[:, None]).add_(shift.index_select(0, idx)[:, None])
        if segment_sum is not None:
            segment_sum[1].index_add_(0, segment_sum[0], out.to(segment_sum[1].dtype))
        return out, None
    if not HAS_TRITON:  # pragma: no cover - gemm_fusable never says yes then
        raise RuntimeError("gemm needs triton installed")
    check_launchable(_gemm_kernel, ref)
    w_lo = w  # unread unless the kernel's dot is "tf32x3w"
    split_min = _CONFIG["w_split_min_rows"]
    if w_exact:
        dot = "tf32x2w"
    elif dot == "tf32x3" and w.dtype == torch.float32 and split_min is not None and m >= split_min:
        parts = tf32_parts(w)
        w, w_lo, dot = parts[0], parts[1], "tf32x3w"
    stride_bk, stride_bn = (1, k) if transpose_w else (n, 1)
    if ref.is_cuda:
        small = m <= _CONFIG["small_rows"]
        bm, bn, warps = _CONFIG["small"] if small else _CONFIG["large"]
        bk = _block_k(k, small)
        kernel_dot = "tf32x2f" if dot == "tf32x2w" and not _CONFIG["nan_guard"] else dot
        if dot == "tf32" and _CONFIG["w_exact_tf32"] and tf32_exact(w):
            kernel_dot = "tf32w"
    else:  # the interpreter pays per program: few large tiles
        bm = max(16, min(128, next_pow2(m)))
        bn = max(16, min(128, next_pow2(n)))
        bk, warps = max(16, min(128, next_pow2(k))), 4
        kernel_dot = "bf16_rn" if dot == "bf16" else dot
    aux = prologue_silu_of if prologue_silu_of is not None else prologue_add
    pro = _PRO_SILU if prologue_silu_of is not None else (_PRO_ADD if prologue_add is not None else 0)
    # Row gathers: (idx, scale) of the prologue or of the epilogue's affine map, seg of either, shift, E.
    idx = scale = shift = seg = seg_out = None
    if prologue_gather is not None:
        aux, seg, scale, idx = prologue_gather
        pro = _PRO_GATHER
    u_op = ref  # the norm prologue's [uv | vv] rows (unread otherwise)
    norm_d = False
    if prologue_norm is not None:
        a, aux, u_op = prologue_norm  # A' = [S + D | ‖V‖]; D unread when None (NORM_D)
        pro, norm_d = _PRO_NORM, aux is not None
    if row_affine is not None:
        idx, scale, shift = row_affine
    if segment_sum is not None:
        seg, seg_out = segment_sum
        if seg_out.shape[1:] != (n,) or not seg_out.is_contiguous():
            raise ValueError(f"gemm: segment_sum's output must be a contiguous [S, {n}]")
    aux = aux.contiguous() if aux is not None else ref
    if addend is not None:
        addend = addend.contiguous()
    elif accumulate:
        addend = out
    if (
        tma_launches(ref, m)
        and not small
        and transpose_w
        and pro != _PRO_GATHER
        and row_affine is None
        and segment_sum is None
        and _tma_ok(
            a, w, w_lo, aux if pro else None, out, pre, addend, u_op.view(m, 3 * k) if pro == _PRO_NORM else None
        )
        and (pro != _PRO_NORM or (k // 2) % bk == 0)
    ):
        return _launch_tma(
            a, w, w_lo, bias, aux, out, pre, addend, zero, m, n, k, act, pro, bm, bn, bk, warps, kernel_dot,
            u=u_op if pro == _PRO_NORM else None, norm_d=norm_d,
        )  # fmt: skip
    col_fast = _CONFIG["col_fast"]
    grid = (cdiv(m, bm) * cdiv(n, bn),) if col_fast else (cdiv(m, bm), cdiv(n, bn))
    # The affine epilogue (x·scale + shift) must round like torch's mul then add: no contraction into an FMA.
    fusion = {"enable_fp_fusion": False} if row_affine is not None and ref.is_cuda else {}
    if ref.is_cuda and _CONFIG["stages"] is not None:
        fusion["num_stages"] = _CONFIG["stages"]
    if ref.is_cuda and not small and _CONFIG["large_maxnreg"] is not None:
        fusion["maxnreg"] = _CONFIG["large_maxnreg"]
    _gemm_kernel[grid](
        a if a is not None else ref, w, w_lo, bias if bias is not None else ref, aux, out,
        pre if pre is not None else out,
        addend if addend is not None else out, _or(idx, ref), _or(scale, ref), _or(shift, ref), _or(seg, ref),
        _or(seg_out, out), _or(zero, out), u_op, m, n, k,
        stride_bk, stride_bn, out.stride(0), addend.stride(0) if addend is not None else 0,
        zero.numel() if zero is not None else 0,
        HAS_BIAS=bias is not None, EPI=_EPI[act], PRO=pro, ACC=addend is not None, HAS_A=a is not None,
        AFFINE=row_affine is not None, SEGSUM=segment_sum is not None, ZERO=zero is not None,
        BM=bm, BN=bn, BK=bk, DOT=kernel_dot, COL_FAST=col_fast,
        SEG_TILE=segment_sum is not None and _CONFIG["segsum_tile"], NORM_D=norm_d,
        num_warps=warps, **fusion, **pdl_args(ref),
    )  # fmt: skip
    return out, pre


def tma_launches(ref: Tensor, m: int) -> bool:
    """Whether :func:`gemm`'s large-M launches of ``m`` rows go through tensor descriptors now (when their operands
    allow, :func:`_tma_ok`): ``_CONFIG["tma"]`` on a Hopper or newer GPU with Triton's host-side descriptors,
    inside a capture (or a dry run's pass standing in for one, so that it compiles the capture's kernels) or from
    ``tma_eager_min_rows`` rows. A caller choosing a form by what it costs on that kernel asks this (the update
    block's norm prologue)."""
    if not (ref.is_cuda and _CONFIG["tma"] and _TensorDescriptor is not None and sm90(ref.device)):
        return False
    if m >= _CONFIG["tma_eager_min_rows"] or torch.cuda.is_current_stream_capturing():
        return True
    return dry_run_for_capture()


def tma_norm_prologue(ref: Tensor, m: int, f: int) -> bool:
    """Whether :func:`gemm` with ``prologue_norm`` (``S [m, f]``, K = 2f) would take the tensor-descriptor kernel:
    :func:`tma_launches`, above ``small_rows``, and each half of K a whole number of the large launch's K tiles
    (the kernel walks the halves in two loops; F = 48 or 80 against BK 32 does not qualify and takes the pointer
    kernel, where the prologue is slow). Its operands' layout (:func:`_tma_ok`) is the caller's: the update block
    passes fresh contiguous float32 tensors."""
    if m <= _CONFIG["small_rows"] or not tma_launches(ref, m):
        return False
    return f % _block_k(2 * f, small=False) == 0


def _block_k(k: int, small: bool) -> int:
    """The K step of :func:`gemm`'s GPU launches of depth ``k`` (its small- or large-M tile), which
    :func:`tma_norm_prologue` must agree with."""
    return min(_CONFIG["block_k" if small else "large_block_k"], max(16, next_pow2(k)))


def _tma_ok(*tensors: Tensor | None) -> bool:
    """Whether the large-M launch may move these operands through tensor descriptors (:func:`tma_launches` said
    the launch may): every operand a float32 matrix with unit column stride and 16-byte aligned rows and start
    (what the copy engine takes)."""
    for t in tensors:
        if t is None:
            continue
        if t.dtype != torch.float32 or t.dim() != 2 or t.stride(1) != 1 or t.stride(0) % 4 or t.data_ptr() % 16:
            return False
    return True


def _launch_tma(
    a, w, w_lo, bias, aux, out, pre, addend, zero, m, n, k, act, pro, bm, bn, bk, warps, dot, u=None, norm_d=False
):
    """:func:`gemm`'s large-M launch through tensor descriptors (:func:`_gemm_tma_kernel`); returns ``(C, pre)``.
    With the norm prologue (``pro`` 4): ``a`` = S, ``aux`` = D (read when ``norm_d``), ``u`` = U ``[3M, 2F]``."""
    desc = _TensorDescriptor.from_tensor
    a_d = desc(a, [bm, bk])
    b_d = desc(w, [bn, bk])
    bl_d = desc(w_lo, [bn, bk]) if dot == "tf32x3w" else b_d
    c_d = desc(out, [bm, bn])
    pre_d = desc(pre, [bm, bn]) if pre is not None else c_d
    d_d = desc(addend, [bm, bn]) if addend is not None else c_d
    aux_d = desc(aux, [bm, bk]) if pro else a_d
    u_d = desc(u.view(m, 3 * k), [bm, bk]) if u is not None else a_d
    launch = {"num_stages": _CONFIG["stages"]} if _CONFIG["stages"] is not None else {}
    if _CONFIG["large_maxnreg"] is not None:
        launch["maxnreg"] = _CONFIG["large_maxnreg"]
    _gemm_tma_kernel[(cdiv(m, bm) * cdiv(n, bn),)](
        a_d, b_d, bl_d, bias if bias is not None else out, aux_d, c_d, pre_d, d_d, _or(zero, out), u_d, m, n, k,
        zero.numel() if zero is not None else 0,
        HAS_BIAS=bias is not None, EPI=_EPI[act], PRO=pro, ACC=addend is not None, ZERO=zero is not None,
        BM=bm, BN=bn, BK=bk, DOT=dot, NORM_D=norm_d, num_warps=warps, **launch,
        **pdl_args(a),
    )  # fmt: skip
    return out, pre


def _norm_input(s_in: Tensor, d_in: Tensor | None, u_in: Tensor) -> Tensor:
    """``[S + D | ‖V‖]`` of the norm prologue in torch (``prologue_norm``'s operand where torch multiplies)."""
    m, f = s_in.shape
    vv = u_in.view(m, 3, 2 * f)[:, :, f:]
    x = s_in if d_in is None else s_in + d_in
    return torch.cat([x, torch.sqrt((vv * vv).sum(dim=1) + _NORM_EPS)], dim=1)


def resolved_dot(ref: Tensor) -> str:
    """The ``dot`` that :func:`gemm` would take for ``ref`` now (for an autograd Function to keep for its
    backward, which may run after the engine's precision block or on autograd's thread)."""
    return dot_mode(ref, _CONFIG["dot"] if ref.is_cuda else "ieee", gemm=True)


def _or(t: Tensor | None, dummy: Tensor) -> Tensor:
    """A kernel's optional pointer argument (unread when its switch is off)."""
    return dummy if t is None else t


def _contiguous_t(w: Tensor) -> Tensor:
    return w.t().contiguous()


def _torch_gemm(a, w, bias, act, transpose_w, prologue_silu_of, out, accumulate, dot=None) -> Tensor:
    """:func:`gemm` in torch ops, only without ``act``: the untransposed forms above ``untransposed_max_rows`` off
    the GPU (the interpreter is slow on large tiles). A 16-bit ``dot`` rounds the operands as the kernel does."""
    if act != "none":
        raise ValueError("the cuBLAS fallback of gemm has no fused activation")
    if prologue_silu_of is not None:
        a = torch.ops.aten.silu_backward(a, prologue_silu_of)
    b = w.t() if transpose_w else w
    if dot in _DOT16:
        low = torch.bfloat16 if dot == "bf16" else torch.float16
        a, b = a.to(low).to(a.dtype), b.to(low).to(b.dtype)
    if accumulate:
        return out.addmm_(a, b) if bias is None else out.add_(torch.addmm(bias, a, b))
    if bias is None:
        return torch.mm(a, b, out=out)
    return torch.addmm(bias, a, b, out=out)


if HAS_TRITON:
    # The device code (both GEMM kernels and their tile helpers) is in _gemm_kernels.py; _norm_of is there too,
    # shared with the update block's norm kernel.
    from ._gemm_kernels import _gemm_kernel, _gemm_tma_kernel

    class _MLP(torch.autograd.Function):
        """``W2 SiLU(W1 x + b1) + b2`` for frozen weights: gradient wrt x only, first order (2 kernels each way).
        With ``residual`` it also returns an alias of x, whose gradient the backward adds to its own (epilogue)."""

        @staticmethod
        def forward(ctx, x, w1, b1, w2, b2, residual):
            if any(ctx.needs_input_grad[1:5]):
                raise RuntimeError("the Triton MLP is inference-only: its weights must not require grad")
            ctx.set_materialize_grads(False)  # an unused output's gradient comes as None: nothing to add or fill
            ctx.dot = dot = resolved_dot(x)  # the backward's GEMMs multiply as the forward's did
            h, pre = gemm(x, w1, b1, act="silu", dot=dot)
            out, _ = gemm(h, w2, b2, dot=dot)
            ctx.save_for_backward(x, pre, w1, w2)
            return (out, x.view_as(x)) if residual else out

        @staticmethod
        def backward(ctx, g, g_alias=None):
            x, pre, w1, w2 = ctx.saved_tensors
            if g is None:
                return g_alias, None, None, None, None, None
            with torch.no_grad():
                g_h, _ = gemm(g.contiguous(), w2, transpose_w=False, dot=ctx.dot)
                g_x, _ = gemm(g_h, w1, transpose_w=False, prologue_silu_of=pre, addend=g_alias, dot=ctx.dot)
            if torch.is_grad_enabled():  # create_graph=True: raise on a second derivative (FirstOrderOnly)
                depends = (x, g) if g_alias is None else (x, g, g_alias)
                g_x = FirstOrderOnly.apply("the Triton MLP", 1, g_x, *depends)
            return g_x, None, None, None, None, None

    class _Readout(torch.autograd.Function):
        """:func:`readout` for frozen weights: gradient wrt x only, first order (2 GEMMs each way). Backward:
        ∂ε_i = g_ε_i + g_E[batch_i] (what autograd would sum), ∂MLP_i = ∂ε_i · scale[species_i], both gathered in
        the first GEMM's prologue; SiLU' in the second's."""

        @staticmethod
        def forward(ctx, x, w1, b1, w2, b2, scale, shift, species, batch, num_structures):
            if any(ctx.needs_input_grad[1:7]):
                raise RuntimeError("the Triton readout is inference-only: its weights must not require grad")
            ctx.set_materialize_grads(False)  # the engine differentiates E only: ε's gradient comes as None
            ctx.dot = dot = resolved_dot(x)
            energy, atomic, pre = _readout_forward(x, w1, b1, w2, b2, scale, shift, species, batch, num_structures, dot)
            ctx.save_for_backward(x, pre, w1, w2, scale, species, batch)
            return energy, atomic

        @staticmethod
        def backward(ctx, g_energy, g_atomic):
            x, pre, w1, w2, scale, species, batch = ctx.saved_tensors
            if g_energy is None and g_atomic is None:
                return (None,) * 10
            with torch.no_grad():
                if g_energy is None:  # (rare) only ε is differentiated: no sum to gather
                    g_e, seg = x.new_zeros((1, 1)), torch.zeros_like(batch)
                else:
                    # float64 (E's dtype) as it comes: the GEMM's prologue rounds it as it loads it
                    g_e, seg = g_energy.contiguous().view(-1, 1), batch
                a = g_atomic.to(x.dtype).contiguous().view(-1, 1) if g_atomic is not None else None
                g_h, _ = gemm(a, w2, transpose_w=False, prologue_gather=(g_e, seg, scale, species), dot=ctx.dot)
                g_x, _ = gemm(g_h, w1, transpose_w=False, prologue_silu_of=pre, dot=ctx.dot)
            if torch.is_grad_enabled():  # create_graph=True: raise on a second derivative (FirstOrderOnly)
                depends = [t for t in (x, g_energy, g_atomic) if t is not None]
                g_x = FirstOrderOnly.apply("the Triton readout", 1, g_x, *depends)
            return g_x, None, None, None, None, None, None, None, None, None
