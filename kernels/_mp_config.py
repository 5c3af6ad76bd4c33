"""Launch configuration of the message-passing kernels (:mod:`.message_passing`): tiles, warps, variants, dot
precisions, register caps and the edge kernel's feature split, per kernel and graph size, with the measurements
behind each choice. Host-side Python only; benchmarks and tests change it through :func:`_configured`."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
from torch import Tensor

from ._frozen import tf32_exact
from ._precision import float32_dot, reduced_matmul_dtype
from ._triton_utils import num_warps

# Launch configuration (GPU only; the interpreter uses fixed large tiles, since each program costs Python overhead
# there). Keys:
#   block_e, block_f, num_warps: the one-program-per-atom ("atom") sender-backward kernel (every graph size);
#     fwd_atom_block_e / _block_f / _warps: the atom forward (graphs below block_min_atoms). First tuned together
#     (benchmarks/bench_message_passing.py --tune, 24,000-atom water, F = 128: 16 x 128 x 4 warps, the fastest
#     fwd+bwd of 12 configurations when all kernels shared these tiles); re-tuned per kernel at stop 14
#     (tune_small.py sendertiles, benchmarks/results/tune_atom_tiles_h100.md): the sender backward 16 x 64 / 4
#     (1.06x at 24,000 atoms, 1.26x for 192-atom water, 1.02x for 1,024 g2 molecules), the small-graph forward
#     64 x 32 / 4 (1.32x for 192-atom water).
#   fwd_variant, bwd_sender_variant: "atom" (one program per atom and feature chunk) or "block" (BLOCK_A
#     consecutive atoms per program and a one-hot tl.dot segment sum, see _mp_fwd_block_kernel). A third sender
#     variant, "fused" (whole feature rows per program, the edge kernel's ∂rbf and ∂u computed in the same pass),
#     was removed at stop 21: rows of 128 features did not fit the H100's shared memory at any tile tried
#     (benchmarks/results/tune_mp_h100_run2.md), and for a 64-wide student, where it ran, the whole step was
#     0.62-0.83x as fast as with the shipped kernels (benchmarks/results/probe_ncu_sweep_h100_f64.md). On the
#     symmetric walk (a program of atom j and a 64-feature slice writing its partners' ∂rbf, ∂u) again at stop 56:
#     0.62x at 24,000 water atoms (benchmarks/results/stop56_gpu/a/, code in fused_dropped.diff there).
#   <kernel>_block_a / _block_e / _block_f / _warps: the tiles of the block variants of fwd and bwd_sender,
#     and of the edge and filter kernels (their own keys: bwd_filter_* 32 x 128 / 4 warps, the shared tiles of
#     the tuning above; bwd_edge_* 64 x 64 / 4 warps in tf32x3 (64 x 32 on small graphs), see below).
#   dot_fwd, dot_bwd_sender, dot_bwd_edge, dot_bwd_filter: tl.dot input_precision of each kernel (float32 only).
#   seg_split: the block kernels' one-hot segment sums in tf32x3 as two TF32 MMAs of the messages' high and low
#     parts (the one-hot factor is exact in TF32, so tf32x3's third MMA adds zeros); see _seg_acc. Shipped on:
#     the whole step 1.03x at 3,000 and 24,000 atoms, 1.02x for 4,096 g2 molecules (H100,
#     benchmarks/results/probe_ncu_sweep_h100_run3.md), float32 tests vs float64 pass on CUDA.
#   <kernel>_stages: num_stages of the kernel's GPU launch (None: Triton's default), for benchmarks/probe_ncu.py.
#   <kernel>_maxnreg: the launch's register cap per thread (None or 0: the compiler's choice, 255 for the heavy
#     kernels, which leaves 2 programs of 4 warps per SM), for the same sweeps; bwd_sender_atom_maxnreg: the cap of
#     the atom-variant sender backward when bwd_sender_maxnreg is None.
#   bwd_sender_variant "auto" (shipped): "block" on GPU graphs of at least block_min_atoms atoms with at most
#     sender_block_max_degree edges per atom, else "atom". Few edges per atom leave the atom variant reloading
#     the filter tiles for every atom: 1,024 g2 molecules (~7.5 edges per atom) ran the block sender backward
#     (16 x 16 x 64 / 4 warps) 1.74x faster, water (~54 per atom) 1.17x slower at 24,000 atoms
#     (benchmarks/results/tune_atom_tiles_h100_run2.md). 16 lies between; not measured closer.
#   block_min_atoms: graphs with fewer atoms run the "atom" variant whatever fwd_variant / bwd_sender_variant say
#     (GPU only). A block program covers BLOCK_A atoms, so a small graph gets too few programs to fill the GPU:
#     on the H100 the block forward took 168 us per layer for 216 atoms (28 programs) inside a 1.37 ms replay
#     of a 192-atom water box (benchmarks/results/profile_step_h100_run3.txt), vs 1.55 ms for 24,000 atoms.
#     Whole replays, all block / all atom (benchmarks/results/profile_variants_h100.txt): benzene 716 / 674 us,
#     192-atom water 1422 / 1058, 3,000-atom water 5775 / 5999, 6,850 atoms of g2 molecules 3613 / 4121: the
#     crossover lies between 192 and 3,000 atoms; 1024 is the threshold (not measured closer).
#   bwd_edge_split: feature slices of the edge kernel ("auto" or an int): "auto" gives small graphs 2, 4, ... programs
#     per edge tile (each sums F / split features into partial ∂rbf / ∂u rows that the host adds) until the grid
#     has edge_split_programs_per_sm programs per SM; a 24,000-atom box keeps one slice. In a 192-atom water MD
#     replay the unsplit kernel ran 265 programs for ~17,000 edges at 57 µs per layer, benzene 3 programs at
#     24 µs (benchmarks/results/profile_step_h100_run6.txt).
#   edge_split_feat: the least split of "auto" is F / edge_split_feat slices (when the feature chunks allow it),
#     slices of 64 features. F = 128, 2 slices: a 3,000-atom water box (163,000 pairs, 2,450 tiles, "enough"
#     programs without a split) ran its edge backward in 349 µs with two slices against 515 µs with one
#     (benchmarks/results/probe_edge_split_3000_h100.md); the 192-atom box keeps its four (31 µs, the fastest of
#     13 tilings in probe_edge_split_h100.md). At 24,000 atoms two slices gave 2.85 ms per layer against 4.74 ms
#     unsplit and 3.13 ms with four (probe_edge_split_24000*_h100.md); 64 x 32 tiles stayed the fastest of the
#     tilings tried at 3,000 and 24,000 atoms. F = 64, 1 slice: the whole step of a 64-wide student 1.063x faster
#     unsplit than in two slices at 3,000 atoms, 1.077x at 24,000, 1.026x for 4,096 g2 molecules
#     (benchmarks/results/probe_ncu_sweep_h100_f64.md). Wider students (F / 64 slices) are not measured.
# benchmarks/tune_small.py times every kernel under every choice; _configured() sets some keys temporarily.
# Shipped: the fastest float32-accurate choice per kernel of the H100 sweep on 24,000-atom water
# (benchmarks/results/tune_mp_h100.md, 2026-11-23): block forward 16 x 32 x 64 / 4 warps with tf32x3 (6.04 ->
# 1.55 ms), atom sender backward with tf32x3 (6.79 -> 1.98 ms), both at the ieee kernels' error vs float64
# (~3e-7); the filter kernel stays ieee (tf32x3 did not make it faster there). The edge kernel: tf32x3 at
# 64 edges x 32 features / 4 warps, with its ∂rbf dots on untransposed filter tiles (stop 14,
# benchmarks/results/tune_edge_tiles_h100_run2.md): 2.6 ms at 24,000 atoms (ieee 32 x 128: 3.5 ms), 32 µs for a
# 192-atom water box, error vs float64 2.9e-7 (ieee 8.5e-7). Its ieee path keeps the tl.trans tiles. Since stop 55
# 64 x 64 from edge_wide_min_edges edges on, with ∂u as dots (edge_du, bwd_edge_block_f below).
_CONFIG = {
    "block_e": 16,
    "block_f": 64,
    "num_warps": 4,
    "fwd_atom_block_e": 64,
    "fwd_atom_block_f": 32,
    "fwd_atom_warps": 4,
    "fwd_variant": "block",
    "fwd_block_a": 16,
    "fwd_block_e": 32,
    "fwd_block_f": 64,
    "fwd_warps": 4,
    "bwd_sender_variant": "auto",
    "bwd_sender_block_a": 16,
    "bwd_sender_block_e": 16,
    "bwd_sender_block_f": 64,
    "bwd_sender_warps": 4,
    "sender_block_max_degree": 16,
    "bwd_edge_block_e": 64,
    # 64-feature chunks since stop 55 (with edge_du "dot", whose ∂rbf and D_k dots then run K = 64): the whole step
    # 1.017x at 3,000 water atoms, 1.045x at 24,000 (eager), 1.018 / 1.028x for 1,024 / 4,096 g2 molecules, but
    # 0.993x on benzene and the 192-atom box (benchmarks/results/stop55_gpu/c/): graphs of fewer than
    # edge_wide_min_edges edges keep 32 (bwd_edge_small_block_f; g2 x 1,024 has ~40,000 edges, the 192-atom box
    # ~17,000). 32-edge tiles, 8 warps, a register cap, 128-feature chunks and one 128-feature slice: 0.33-0.99x.
    "bwd_edge_block_f": 64,
    "bwd_edge_small_block_f": 32,
    "edge_wide_min_edges": 32768,
    "bwd_edge_warps": 4,
    "bwd_edge_split": "auto",
    "edge_split_programs_per_sm": 4,
    "edge_split_feat": 64,
    # The split edge kernel's slice 0 writes straight into ∂rbf / ∂u (stop 47): the partial buffer holds
    # split - 1 planes; False: all split planes, summed into fresh outputs (the probes time both).
    "edge_split_out0": True,
    # The backward runs the edge kernel before the sender kernel (stop 47), so that the edge kernel's transients
    # and the sender kernel's outputs g_x, g_v are never live together; False: the sender kernel first.
    "edge_grads_first": True,
    "bwd_filter_block_e": 32,
    "bwd_filter_block_f": 128,
    "bwd_filter_warps": 4,
    "dot_fwd": "tf32x3",
    "dot_bwd_sender": "tf32x3",
    "dot_bwd_edge": "tf32x3",
    "dot_bwd_filter": "ieee",
    # Under the engine's tf32 / bf16 / fp16 the tf32x3 dots above take one TF32 pass (kernels/_precision.py);
    # False keeps them tf32x3 in every precision (benchmarks/probe_precision.py times and measures both).
    "reduced_dots": True,
    # half_gathers: under the engine's bf16 / fp16 (kernels/_precision.matmul_dtype) the rows that the message
    # kernels gather per edge, x and v (or the folded p) of the senders, are stored in that 16-bit type (a copy made
    # once per layer and kept for the backward's edge kernel), and widened to float32 in registers; every product and
    # sum stays float32. half_grads: the same for the upstream gradient rows (g_s, g_v of the receivers) that the
    # backward's sender and edge kernels gather, on graphs of at least half_grads_min_degree edges per atom (the
    # copies cost a cast per layer over the atoms, the gathers save bytes per edge), in half_grads_type: "mode", the
    # engine's 16-bit type, or "bf16", bfloat16 whatever the mode. Under fp16 a gradient row past float16's range
    # (65,504) becomes inf, so the step's output is not finite and the engine raises NonFiniteOutputError instead of
    # returning it, as for the fp16 GEMMs' operands, which carry the same gradients through float16 already.
    # False: float32 rows, as before stop 65. Each precision's step, off /
    # x and v / both (H200, 128 x 3; benchmarks/results/stop65_gpu/b/): water 3,000 atoms 1.345 / 1.238 / 1.161 ms,
    # 24,000 9.51 / 9.02 / 8.47 ms, 4,096 g2 molecules (~7.5 edges per atom) 0.627 / 0.601 / 0.604 µs per structure,
    # 1,024 0.778 / 0.758 / 0.764. Force RMSE against fp64 on rattled g2 molecules, bf16 2.0 / 2.7 / 2.8 meV/Å, fp16
    # 0.92 / 0.98 / 1.35 (gradient rows bfloat16); water 3,000 bf16 2.22 / 2.32 / 2.40, fp16 0.30 / 0.31 / 0.66 with
    # bfloat16 gradient rows, 0.32 with float16 ones at the same speed (stop65_gpu/f/): hence "mode".
    "half_gathers": True,
    "half_grads": True,
    "half_grads_min_degree": 16,
    "half_grads_type": "mode",
    "block_min_atoms": 1024,
    "seg_split": True,
    # The filter-weight dots (forward, sender and edge kernels) as two TF32 MMAs where the weight lies on the TF32
    # grid (_frozen.tf32_exact; the same sums as tf32x3, whose third product is then zero): 1.039-1.087x a whole
    # step alone, 1.07-1.12x with the GEMMs' (linear._CONFIG["w_exact_two_mmas"]; stop59_gpu/b/). False: tf32x3.
    "w_exact_two_mmas": True,
    # w_exact_tf32: under the engine's tf32 precision ("tf32" dots), a filter weight on the TF32 grid takes "tf32w"
    # (only the other operand rounded; the same bits). The GEMM has the same switch (linear._CONFIG); both on
    # against both off, the tf32 step (H200, stop 61, benchmarks/results/stop61_gpu/i/): g2 x 4,096 1.012x, water
    # 3,000 1.018x, benzene 1.021x.
    "w_exact_tf32": True,
    # Whether callers holding a full neighbour list (the engine) promise it to message_passing (``symmetric``,
    # message_passing.symmetric_walk): the sender backward then walks each atom's receiver row for the partners
    # of the edges it sends (SYM in _mp_kernels._sender_tile) instead of the sender-sorted permutation, and the
    # engine's buckets sort no senders. False: the permutation, as before stop 54. The edge kernel on the same
    # promise (each row given its partner's ∂rbf, ∂u: the senders' g rows gathered, the receivers' x, v shared)
    # measured 0.93-0.95x on water at stop 56 (benchmarks/results/stop56_gpu/b/, partner_dropped.diff there).
    "sender_symmetric": True,
    # edge_du: how the edge backward forms ∂u (DU_DOT in _mp_kernels): "sum" reduces c ⊙ g_v across each feature
    # chunk (three cross-lane sums per chunk, and c = x_c ⊙ (rbf @ W_cᵀ) as a dot whose output the sums need in
    # their own layout); "dot" as rbf_e · D_k with D_k = (x_c ⊙ g_v[i,k]) @ W_c (three dots, no feature sums;
    # G_c @ W_c = Σ_k u_k D_k). The same sums in another order (float32 rounding). Whole step, "dot" against "sum",
    # one H200 call (stop 55, benchmarks/results/stop55_gpu/a/probe_ncu_sweep_sums_*.md): 1.014x on 192 water atoms
    # and 4,096 g2 molecules, 1.031x at 3,000 water atoms, 1.028x at 24,000 (eager). Dropped there (code in
    # stop55_gpu/sums_dropped.diff): the chunk sums kept as [BLOCK_E, BLOCK_F] products and reduced once per slice
    # (0.93-1.00x), and in the atom sender kernel the five sums kept as 2-D accumulators (0.987-1.011x) or as radial
    # moments Σ_e rbf_eᵀ g_e with the filter applied after the loop (0.90-1.00x).
    "edge_du": "dot",
    # edge_nan_guard: whether the edge backward's weight dots keep dot_w's NaN guard (GUARD in _mp_kernels:
    # dot_rn) or drop it (dot_fin, as the forward and sender kernels do since stop 61; same bits for finite
    # operands). "fold": kept where the kernel takes the folded p = x_b ⊙ v (FOLD, dense graphs such as water),
    # dropped elsewhere. Per kernel, dropped against kept (stop 61, one H200 step each, kernel tables in
    # benchmarks/results/stop61_gpu/d/): the FOLD variant 0.887x at 24,000 water atoms and 0.880x at 3,000, though
    # it compiles to 6 % fewer instructions (ptxas's schedule of a 255-register kernel that spills); the unfolded
    # variant 1.057x for 4,096 g2 molecules.
    "edge_nan_guard": "fold",
    # Measured and dropped (stop 62; removed at stop 63, benchmarks/results/stop63_gpu/edge_split_terms_dropped.diff):
    # the edge kernel's two programs per tile splitting its terms (a and c; b) instead of its features. Compiled for
    # sm_90: a 256-byte stack against the feature split's 432; on the H200 0.977-0.987x the whole step at 3,000 and
    # 24,000 water atoms and for g2 batches (benchmarks/results/stop62_gpu/a/).
    # edge_split_chain: an edge kernel of two slices per tile (and at least edge_chain_min_tiles tiles, so that a
    # tile's two slices seldom run at once) adds its slices itself, the second waiting on a per-tile flag for the
    # first (CHAIN in _mp_kernels: CUTLASS's serial split-K), in place of the sum kernel (_mp_sum_split_kernel: 120
    # µs a layer at 24,000 water atoms, 36 at 3,000, 21 for 4,096 g2 molecules; stop61_gpu/d/), with the same bits.
    # Compiled for sm_90 on the development machine: a 352-byte stack against 432. "fold": where the kernel takes
    # the folded p (dense graphs), as edge_nan_guard. Whole step on the H200, chained against the sum kernel (stop
    # 62, benchmarks/results/stop62_gpu/b/): 1.029-1.031x at 3,000 and 24,000 water atoms (with sender_fold_half
    # 1.047x at both), but 0.991x for 4,096 g2 molecules (unfolded; at a threshold of 2,048 tiles too) and
    # 0.999-1.001x at 1,024 g2 molecules and 192 water atoms. Its edge and sender stages re-swept under it: 0.98-1.00x.
    "edge_split_chain": "fold",
    "edge_chain_min_tiles": 1024,
    # Measured and dropped (stop 85, benchmarks/results/stop85_gpu/d/, edge_acc_epilogue_dropped.diff): an edge
    # kernel of one slice (the 64-wide student's) adding its ∂rbf, ∂u into the sink in its own epilogue, in place of
    # the four torch adds a step of stop 78's kernel table (~30 µs of 1.22 ms, g2 x 4,096 under bf16). The same bits;
    # but the adds run on the second stream beside the critical path: off against on 1.000-1.003x (g2 x 1,024 and
    # x 4,096, fp32 and bf16, 64 x 3).
    # sender_fold_half: the atom sender backward keeps its five sums as [BLOCK_E / 2, BLOCK_F] tiles, adding each
    # edge tile's two row halves into them in the loop (in-thread in the MMA's layout) and summing across rows once
    # after it (FOLD_HALF in _mp_kernels), instead of a sum across the tile's rows (lanes and warps) each iteration.
    # Compiled for sm_90 on the development machine under the 128-register cap of large graphs: 422 instructions a
    # loop iteration against 536, 14 spill instructions against 6 (the full [BLOCK_E, BLOCK_F] tiles, measured
    # slower at stops 55 and 61, spill under the cap). Whole step on the H200, against the per-tile sums (stop 62,
    # benchmarks/results/stop62_gpu/a/ and b/): 1.019-1.020x at 3,000 and 24,000 water atoms, 1.009x at 192,
    # 1.000-1.003x for g2 batches. (On 32-edge tiles: 0.87x on water.)
    "sender_fold_half": True,
    # The forward at 2 pipeline stages (Triton's default is 3) since stop 45, on the H200: the whole step 1.017x at
    # 24,000 water atoms, 1.020-1.022x at 3,000, 1.000-1.005x for g2 batches, 192 water atoms and benzene; 1 stage
    # 0.97-0.99x; the sender backward at 2 stages 0.993-1.007x (benchmarks/results/stop45_gpu/
    # probe_ncu_sweep_stages*.md, probe_ncu_sweep_tiles*.md: every other tile, warp and stage option of the three
    # kernels re-swept there measured 0.71-1.01x).
    "fwd_stages": 2,
    "bwd_sender_stages": None,
    "bwd_edge_stages": None,
    "bwd_filter_stages": None,
    "fwd_maxnreg": None,
    "bwd_sender_maxnreg": None,
    "bwd_edge_maxnreg": None,
    "bwd_filter_maxnreg": None,
    # The atom-variant sender backward capped at 128 registers on graphs of bwd_sender_cap_min_atoms atoms or more
    # (168 uncapped: 3 programs of 4 warps per SM, 4 when capped). The whole step, capped vs uncapped in the same
    # run: 1.032x at 24,000 atoms of water, 1.01-1.03x at 3,000, 0.98-0.99x on the 192-atom box, 1.00x benzene;
    # the block variant (g2 batches) was 0.973x, so it stays uncapped (benchmarks/results/
    # probe_ncu_sweep_h100_run7.md, run8.md).
    "bwd_sender_atom_maxnreg": 128,
    "bwd_sender_cap_min_atoms": 1000,
    # fold_xb_min_edges / fold_xb_min_degree: on graphs of at least this many edges (None: never) and at least
    # this many edges per atom, the block forward and the edge backward take p = x_b ⊙ v [N, 3, F] (one elementwise
    # kernel per call) in place of v, so that per edge they gather 5F (forward) and 9F (edge backward) floats of
    # the sender instead of 6F and 10F: W_b,e ⊙ p_j is b_e ⊙ v_j, and Σ_k g_v[i,k] ⊙ p_j[k] is β_e ⊙ x_b,j. The
    # same sums in another order (float32 rounding). The whole step, every graph folded, against the shipped
    # kernels in the same H100 call (benchmarks/results/stop40_gpu/probe_ncu_sweep_fold.md; two runs each, a no-op
    # variant between them at 0.999-1.003x): 3,000 water atoms (54 edges per atom) 1.007 / 1.013x, 24,000
    # 1.015 / 1.014x, 4,096 g2 molecules (7.5 per atom: the extra kernel costs more than the gathers it saves)
    # 0.978 / 0.979x. Hence the degree bound. Below 100,000 edges, on the H200 (stop 46, against the old bound of
    # 100,000 in the same call, benchmarks/results/stop46_gpu/probe_ncu_sweep_rules.md): the 192-atom water box
    # (10,848 edge slots, ~55 per atom) 1.074x; benzene (11 per atom) and 1,024 g2 molecules, below the degree
    # bound, 1.00x. Hence no edge bound: the degree decides (probe_ncu_sweep_fold_small.md: smaller boxes).
    # The forward's p kept for the edge backward instead of made again measured 0.993x at 3,000 and 24,000 atoms
    # (stop 56: the fresh p is in L2 for the edge kernel; benchmarks/results/stop56_gpu/d/, fold_keep_dropped.diff).
    "fold_xb_min_edges": 0,
    "fold_xb_min_degree": 24,
    # edge_stream_max_edges: inside a CUDA-graph capture, on graphs of at most this many edges (None: never), the
    # model's layers put their backward's edge kernel (∂rbf, ∂u, with its partial sums) on a second stream, adding
    # into a sink (defer_edge_grads); one join before the geometry's backward hands the sums to autograd. The whole
    # step against it off, two rounds in one H200 call (benchmarks/results/stop44_gpu/probe_ncu_sweep_stop44d.md):
    # benzene 1.10x, 192 water atoms 1.066x, 1,024 g2 molecules 1.051x, 4,096 1.015x, 3,000 water atoms 1.010x.
    # A join right after each layer's sender kernel gave 1.00x on benzene, 1.04x on 1,024 g2 molecules
    # (probe_ncu_sweep_stop44.md): removed. Larger graphs: the captured 24,000-atom water step (1.3M edges) with the
    # limit raised over it 1.005 / 1.001x (stop 55, benchmarks/results/stop55_gpu/f/), noise: off there.
    "edge_stream_max_edges": 1 << 20,
    # edge_sink_one_stream: where the second stream does not apply (eager steps, captures over
    # edge_stream_max_edges), an inference step's layers still add their ∂rbf, ∂u into one sink, on the caller's
    # stream (defer_edge_grads(..., one_stream=True)), in place of autograd's two adds per layer. False: as before
    # stop 57.
    "edge_sink_one_stream": True,
}
_KERNELS = ("fwd", "bwd_sender", "bwd_edge", "bwd_filter")
_VARIANTS = {"fwd": ("atom", "block"), "bwd_sender": ("auto", "atom", "block")}
_PRECISIONS = ("ieee", "tf32x3", "tf32")
_EDGE_DU = {"sum": False, "dot": True}
# Under the interpreter: block kernels take 16 atoms x 32 edges (so that tiles straddle atoms even in small test
# graphs), the others whole feature rows and 64-edge tiles.
_CPU_TILES = {"block_a": 16, "block_e_block": 32, "block_e": 64, "block_f": 128}


@contextlib.contextmanager
def _configured(**changes) -> Iterator[None]:
    """Temporarily change keys of ``_CONFIG`` (benchmarks and tests); unknown keys raise ``KeyError``."""
    unknown = set(changes) - set(_CONFIG)
    if unknown:
        raise KeyError(f"unknown launch configuration keys {sorted(unknown)}; known: {sorted(_CONFIG)}")
    old = dict(_CONFIG)
    _CONFIG.update(changes)
    try:
        yield
    finally:
        _CONFIG.clear()
        _CONFIG.update(old)


@functools.lru_cache(maxsize=16)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _edge_split(ref: Tensor, tiles: int, n_feat: int, block_f: int) -> int:
    """Feature slices of the edge kernel (``bwd_edge_split``): "auto" splits the feature loop over
    ``n_feat / edge_split_feat`` programs per edge tile, then 2x more (powers of two dividing the feature
    chunks) while the grid has fewer than ``edge_split_programs_per_sm`` programs per SM, so that small graphs (a
    molecule, a 192-atom box in MD) spread over the GPU instead of walking all features in a few programs."""
    want = _CONFIG["bwd_edge_split"]
    chunks = max(1, n_feat // block_f) if n_feat % block_f == 0 else 1
    if want != "auto":
        split = int(want)
        return split if split >= 1 and chunks % split == 0 else 1
    if not ref.is_cuda:
        return 1
    target = _CONFIG["edge_split_programs_per_sm"] * _sm_count(ref.device)
    least = max(1, n_feat // _CONFIG["edge_split_feat"])
    split = least if least & (least - 1) == 0 and chunks % least == 0 else 1
    while chunks % (2 * split) == 0 and tiles * split < target:
        split *= 2
    return split


def _launch_config(
    ref: Tensor,
    kernel: str,
    n_feat: int,
    n_rbf: int,
    n_atoms: int | None = None,
    n_edges: int | None = None,
    weight: Tensor | None = None,
) -> tuple[dict, int, str]:
    """Constexprs, warps and the variant that runs ("atom" or "block"), for ``kernel`` in ``_KERNELS`` on
    ``ref``'s device and dtype; ``n_atoms``: the graph's atoms (below ``block_min_atoms`` the atom variant runs
    on the GPU); ``n_edges``: its edges (the "auto" sender variant looks at edges per atom, the edge kernel's
    feature chunks at ``edge_wide_min_edges``); ``weight``: the filter weight of the forward, sender or edge
    kernel, whose dots take two TF32 MMAs ("tf32x2w", the sums of tf32x3) where it lies on the TF32 grid
    (``w_exact_two_mmas``). Every DOT_PRECISION dot of those kernels multiplies by the weight or is a one-hot
    segment sum (SEG_SPLIT, or tf32x3 for "tf32x2w" in ``_seg_acc``); the filter-gradient kernel multiplies by
    rbf and takes no weight here."""
    c, warps, variant = _launch_config_for(ref.device.type, ref.dtype, kernel, n_feat, n_rbf, n_atoms, n_edges)
    if weight is not None and kernel not in ("fwd", "bwd_sender", "bwd_edge"):
        raise ValueError(f"_launch_config: {kernel!r} takes no weight (its dots are not all weight dots)")
    if weight is not None and c["DOT_PRECISION"] == "tf32x3" and _CONFIG["w_exact_two_mmas"] and tf32_exact(weight):
        c = {**c, "DOT_PRECISION": "tf32x2w"}
    elif weight is not None and c["DOT_PRECISION"] == "tf32" and _CONFIG["w_exact_tf32"] and tf32_exact(weight):
        c = {**c, "DOT_PRECISION": "tf32w"}
    return c, warps, variant


def _launch_config_for(
    device_type: str,
    dtype,
    kernel: str,
    n_feat: int,
    n_rbf: int,
    n_atoms: int | None = None,
    n_edges: int | None = None,
) -> tuple[dict, int, str]:
    cuda = device_type == "cuda"
    variant = _CONFIG.get(f"{kernel}_variant", "atom")  # the edge and filter kernels have one variant
    if variant == "auto":
        sparse = n_atoms is not None and n_edges is not None
        sparse = sparse and int(n_edges) <= _CONFIG["sender_block_max_degree"] * int(n_atoms)
        big = n_atoms is not None and int(n_atoms) >= _CONFIG["block_min_atoms"]
        variant = "block" if cuda and sparse and big else "atom"
    if cuda and n_atoms is not None and int(n_atoms) < _CONFIG["block_min_atoms"] and variant != "atom":
        variant = "atom"
    prec = _CONFIG[f"dot_{kernel}"]
    variants = _VARIANTS.get(kernel, ("atom",))
    if variant not in variants or prec not in _PRECISIONS:
        raise ValueError(f"{kernel}: variant {variant!r} (one of {variants}), precision {prec!r} ({_PRECISIONS})")
    blocked = variant != "atom"
    block_a = 0
    if not cuda:  # interpreter: few, large programs
        be = _CPU_TILES["block_e_block" if blocked else "block_e"]
        block_a, bf, warps = _CPU_TILES["block_a"], _CPU_TILES["block_f"], num_warps()
    elif blocked or kernel in ("bwd_edge", "bwd_filter"):
        block_a, be = _CONFIG.get(f"{kernel}_block_a", 0), _CONFIG[f"{kernel}_block_e"]
        bf, warps = _CONFIG[f"{kernel}_block_f"], _CONFIG[f"{kernel}_warps"]
        if kernel == "bwd_edge" and n_edges is not None and int(n_edges) < _CONFIG["edge_wide_min_edges"]:
            bf = _CONFIG["bwd_edge_small_block_f"]
    elif kernel == "fwd":
        be, bf, warps = _CONFIG["fwd_atom_block_e"], _CONFIG["fwd_atom_block_f"], _CONFIG["fwd_atom_warps"]
    else:
        be, bf, warps = _CONFIG["block_e"], _CONFIG["block_f"], _CONFIG["num_warps"]
    if cuda and dtype == torch.float64:
        # Float64 tiles of 16 x 128 failed on the H100 (F = 128); 16 x 32 and 32 x 32 passed the same tests.
        bf, be = min(bf, 32), min(be, 32)
    c = dict(
        N_FEAT=int(n_feat),
        N_RBF=int(n_rbf),
        BLOCK_E=max(16, be),
        BLOCK_F=max(16, min(bf, _pow2(n_feat))),
        R_PAD=max(16, _pow2(n_rbf)),
        DOT_PRECISION=_dot_precision(prec) if cuda and dtype == torch.float32 else "ieee",
    )
    if kernel == "bwd_edge":
        c["DU_DOT"] = _choice(_EDGE_DU, "edge_du")
    if blocked:
        c["BLOCK_A"] = max(16, block_a)  # tl.dot needs >= 16 rows
        c["SEG_SPLIT"] = bool(_CONFIG["seg_split"]) and c["DOT_PRECISION"] == "tf32x3"
    stages = _CONFIG[f"{kernel}_stages"]
    if cuda and stages is not None:
        c["num_stages"] = int(stages)  # a launch option, passed with the constexprs
    maxnreg = _CONFIG[f"{kernel}_maxnreg"]
    if maxnreg is None and kernel == "bwd_sender" and variant == "atom" and n_atoms is not None:
        if int(n_atoms) >= _CONFIG["bwd_sender_cap_min_atoms"]:
            maxnreg = _CONFIG["bwd_sender_atom_maxnreg"]
    if cuda and maxnreg:  # None or 0: uncapped
        c["maxnreg"] = int(maxnreg)  # registers per thread at most (more programs per SM, maybe spills)
    return c, warps, variant


def _choice(options: dict, key: str):
    """The constexpr of the configured choice ``_CONFIG[key]`` among ``options`` (a clear error for others)."""
    value = _CONFIG[key]
    if value not in options:
        raise ValueError(f"{key}: {value!r} is not one of {sorted(options)}")
    return options[value]


def _by_fold(key: str, fold: bool) -> bool:
    """A switch of the edge backward that may be ``"fold"`` (on where the launch takes the folded p, FOLD =
    ``fold``), True or False (1 or 0)."""
    choice = _CONFIG[key]
    if choice == "fold":
        return bool(fold)
    if isinstance(choice, bool) or choice in (0, 1):
        return bool(choice)
    raise ValueError(f"{key}: {choice!r} is not one of 'fold', True, False")


def _edge_guard(fold: bool) -> bool:
    """GUARD of the edge backward (``edge_nan_guard``) for a launch with FOLD = ``fold``."""
    return _by_fold("edge_nan_guard", fold)


def _edge_chain(fold: bool) -> bool:
    """Whether an edge backward of two slices with FOLD = ``fold`` chains them (``edge_split_chain``; the tile
    count, ``edge_chain_min_tiles``, is checked apart)."""
    return _by_fold("edge_split_chain", fold)


def _fold_xb(ref: Tensor, n_edges: int, n_atoms: int) -> bool:
    """Whether the forward and edge backward take p = x_b ⊙ v for this graph (``fold_xb_min_edges``,
    ``fold_xb_min_degree``)."""
    least = _CONFIG["fold_xb_min_edges"]
    dense = int(n_edges) >= _CONFIG["fold_xb_min_degree"] * int(n_atoms)
    return least is not None and int(n_edges) >= int(least) and dense


def _half_gathers(ref: Tensor, key: str = "half_gathers") -> torch.dtype | None:
    """The 16-bit type in which the Triton message kernels gather rows of float32 tensors like ``ref`` (``key``:
    ``"half_gathers"`` for x and v, ``"half_grads"`` for the backward's gradient rows), or None: float32 rows. On
    the CPU interpreter too, which is how the CPU tests run it."""
    low = reduced_matmul_dtype()
    if low is None or not _CONFIG[key] or ref.dtype != torch.float32:
        return None
    if key == "half_grads" and _CONFIG["half_grads_type"] != "mode":
        if _CONFIG["half_grads_type"] != "bf16":
            raise ValueError(f"half_grads_type: {_CONFIG['half_grads_type']!r} is not one of 'mode', 'bf16'")
        return torch.bfloat16
    return low


def _dot_precision(prec: str) -> str:
    """A kernel's configured dot on float32 CUDA tensors under the engine's precision: one TF32 pass in place of
    tf32x3 when the engine runs tf32, bf16 or fp16 (:mod:`._precision`); "ieee" stays "ieee"."""
    return float32_dot(prec) if prec == "tf32x3" and _CONFIG["reduced_dots"] else prec
