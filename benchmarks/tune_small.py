# ruff: noqa: B023  (closures are called inside the loop iteration that made them)
"""GPU probes behind the engine/kernel tuning (issues 5 and 7): tiny-GEMM kernel choice and the fused
message-passing launch configuration and filter-dot precision, on the graph sizes the engine actually runs.

    python benchmarks/tune_small.py --out DIR                     # sections gemm, kernels, variants
    python benchmarks/tune_small.py --skip gemm --out DIR         # kernels, variants (~2 min on an H100)
    python benchmarks/tune_small.py --sections mp --out DIR       # the older whole-op config x precision sweep

Sections:
  gemm      tiny GEMMs: cuBLAS vs cuBLASLt at the engine's row counts.
  mp        the whole fused op (fwd, fwd+bwd) under launch configurations x one global dot precision.
  kernels   each message-passing kernel alone (fwd, bwd_sender, bwd_edge, bwd_filter) under each tl.dot
            precision (ieee, tf32x3, tf32), shipped tiles, with its outputs' error vs float64.
  variants  the "block" forward and sender-backward kernels (BLOCK_A atoms per program, one-hot tl.dot segment
            sum) and the edge / filter kernels' own tiles, over tiles x
            precision, next to the shipped kernels; then a summary of the fastest float32-accurate choice per
            kernel, the fwd+bwd and energy+forces totals, and the _CONFIG that choice implies.
  edgetiles the edge backward kernel over tiles in tf32x3, then a few ieee tilings, on 24,000- and 192-atom
            water and 1,024 g2 molecules (not default).
  sendertiles the atom variants of the forward (small graphs) and the sender backward over tiles, same graphs
            (not default).
The kernels and variants sections run on a 24,000-atom water box (1.3M edges; full sweep) and on 1,024 small g2
molecules (~51k edges; short sweep), water first, and stop adding rows once --budget-s seconds have passed since
they started (the rows left out are listed at the end).

Every time is the median per call of a CUDA graph replaying the op several times (what a captured step pays).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import importlib

from bench_message_passing import water_like_graph
from harness import graph_time_per_call_us
from systems import g2_chno

# the package re-exports a function of the same name: take the module itself
mp = importlib.import_module("mlff_distiller.kernels.message_passing")


def graph_time_us(fn, reps: int = 20) -> float:
    return graph_time_per_call_us(fn, reps)


def gemm_probe(lines: list[str]) -> None:
    dev = "cuda"
    lines += ["## Tiny GEMMs (fp32, µs per call inside a CUDA graph)", ""]
    lines += [
        "| rows M | in→out | blas | F.linear fwd | grad_x = g @ W | x @ Wt (pre-transposed) |",
        "|---|---|---|---:|---:|---:|",
    ]
    for blas in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(blas)
        for m, (k, n) in itertools.product(
            (16, 48, 64, 128, 7008), ((128, 128), (128, 384), (256, 128), (384, 128), (128, 64))
        ):
            x = torch.randn(m, k, device=dev)
            w = torch.randn(n, k, device=dev)
            g = torch.randn(m, n, device=dev)
            wt = w.t().contiguous()
            t1 = graph_time_us(lambda: torch.nn.functional.linear(x, w))
            t2 = graph_time_us(lambda: g @ w)
            t3 = graph_time_us(lambda: x @ wt)
            lines.append(f"| {m} | {k}→{n} | {blas} | {t1:.2f} | {t2:.2f} | {t3:.2f} |")
    torch.backends.cuda.preferred_blas_library("cublas")


def small_graph(n_atoms: int, deg: int, dev: str, seed: int = 0):
    """Receiver-sorted random graph: ``deg`` senders per atom (molecule-like sizes)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    i = torch.arange(n_atoms).repeat_interleave(deg)
    j = torch.randint(0, n_atoms, (n_atoms * deg,), generator=gen)
    f, r = 128, 20
    x = torch.randn(n_atoms, 3 * f, generator=gen)
    v = torch.randn(n_atoms, 3, f, generator=gen)
    rbf = torch.rand(n_atoms * deg, r, generator=gen)
    w = torch.randn(3 * f, r, generator=gen) / r**0.5
    unit = torch.nn.functional.normalize(torch.randn(n_atoms * deg, 3, generator=gen), dim=1)
    ei = torch.stack([i, j])
    return [t.to(dev) for t in (x, v, rbf, w, unit, ei)]


def mp_probe(lines: list[str], records: list) -> None:
    graphs = {
        "16 atoms x 9": small_graph(16, 9, "cuda"),
        "7008 atoms x 9": small_graph(7008, 9, "cuda"),
        "water 3000": water_like_graph(3000, torch.device("cuda")),
        "water 24000": water_like_graph(24000, torch.device("cuda")),
    }
    lines += ["", "## Fused message passing: configuration x dot precision (µs per call in a CUDA graph)", ""]
    lines += [
        "| graph | edges | prec | block_e | block_f | warps | bwd_block_e | fwd | fwd+bwd(x,v,rbf,unit) "
        "| rel err vs fp64 |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, inputs in graphs.items():
        x, v, rbf, w, unit, ei = inputs
        n = x.shape[0]
        bounds = torch.arange(n + 1, device="cuda")
        row_ptr = torch.searchsorted(ei[0].contiguous(), bounds)
        ref = mp.message_passing_reference(*(t.double() for t in (x, v, rbf, w, unit)), ei)
        xg, vg, rg, ug = (t.clone().requires_grad_(True) for t in (x, v, rbf, unit))
        gs, gv = torch.randn_like(ref[0]).float(), torch.randn_like(ref[1]).float()
        configs = [
            (16, 128, 4, 32),
            (8, 128, 4, 16),
            (16, 64, 4, 32),
            (8, 64, 4, 16),
            (16, 128, 8, 32),
            (32, 128, 8, 64),
        ]
        for prec, (be, bf, nw, bbe) in itertools.product(("ieee", "tf32x3", "tf32"), configs):
            every_dot = {f"dot_{k}": prec for k in mp._KERNELS}
            try:
                tiles = dict(block_e=be, block_f=bf, num_warps=nw)
                tiles.update(fwd_atom_block_e=be, fwd_atom_block_f=bf, fwd_atom_warps=nw)
                for k in ("bwd_edge", "bwd_filter"):  # one set of tiles for all kernels, as this sweep was written
                    tiles.update({f"{k}_block_e": bbe, f"{k}_block_f": bf, f"{k}_warps": nw})
                with mp._configured(**tiles, **every_dot):
                    with torch.no_grad():
                        out = mp.message_passing(x, v, rbf, w, unit, ei, row_ptr=row_ptr)
                    err = max(((o.double() - r).norm() / r.norm()).item() for o, r in zip(out, ref, strict=True))
                    t_f = graph_time_us(lambda: mp.message_passing(x, v, rbf, w, unit, ei, row_ptr=row_ptr), reps=5)

                    def fb():
                        ds, dv = mp.message_passing(xg, vg, rg, w, ug, ei, row_ptr=row_ptr)
                        return torch.autograd.grad((ds, dv), (xg, vg, rg, ug), (gs, gv))

                    t_b = graph_time_us(fb, reps=5)
            except Exception as exc:
                lines.append(
                    f"| {name} | {ei.shape[1]} | {prec} | {be} | {bf} | {nw} | {bbe} "
                    f"| failed: {type(exc).__name__} {str(exc)[:60]} | | |"
                )
                continue
            records.append(dict(graph=name, prec=prec, be=be, bf=bf, nw=nw, bbe=bbe, fwd=t_f, fb=t_b, err=err))
            lines.append(
                f"| {name} | {ei.shape[1]} | {prec} | {be} | {bf} | {nw} | {bbe} | {t_f:.1f} | {t_b:.1f} | {err:.1e} |"
            )
            print(lines[-1], flush=True)


# ------------------------------------------------------------------------------------------------------------
# Per-kernel probes (sections "kernels" and "variants"): each kernel launched alone through the module's host
# functions, so its time is its own (plus the allocation of its outputs), and its outputs checked against the
# float64 reference (the forward, or the explicit VJP for the backward kernels).

CUTOFF = 5.0  # Å, as the water graph
N_FEAT, N_RBF = 128, 20
# A row counts as float32-accurate when max |out - ref| / max |ref| is at most ACCURATE or ACCURATE_VS_IEEE times
# the shipped (ieee) kernel's own error on that graph (long float32 sums, e.g. ∂filter_weight over 1.3M edges, may
# sit above 1e-6 even in ieee).
ACCURATE = 1e-6
ACCURATE_VS_IEEE = 2.0
# The outputs each kernel writes: positions in (ds, dv) for fwd, in the five VJP outputs for the others.
# "bwd_sender+edge" is the inference backward (∂x, ∂v, ∂rbf, ∂u): the sender and edge kernels.
OUTPUTS = {"fwd": (0, 1), "bwd_sender": (0, 1), "bwd_edge": (2, 4), "bwd_filter": (3,), "bwd_sender+edge": (0, 1, 2, 4)}
NEED = {
    "bwd_sender": (True, False, False),
    "bwd_edge": (False, True, False),
    "bwd_filter": (False, False, True),
    "bwd_sender+edge": (True, True, False),
}
# Block-variant tiles swept (block_a, block_e, block_f, warps), most promising first (the budget may cut the tail);
# all in tf32x3, the first IEEE_CONFIGS also in ieee (the one-hot sums then run on the CUDA cores).
BLOCK_CONFIGS = [
    (32, 32, 64, 8),
    (16, 32, 64, 8),
    (16, 32, 64, 4),
    (32, 64, 64, 8),
    (64, 32, 64, 8),
    (16, 32, 128, 8),
]
# Edge and filter kernels: (<kernel>_block_e, _block_f, _warps), in tf32x3 (shipped: 32 x 128 / 4).
EDGE_CONFIGS = [(32, 64, 4), (32, 32, 4), (16, 64, 4), (64, 32, 8)]
# Section "edgetiles": tiles (block_e, block_f, warps) of the edge kernel.
# Stop 13 ran the edge kernel's ieee grid (tune_edge_tiles_h100.md: the shipped 32 x 128 / 4 was the fastest of 25);
# since the ∂rbf dots load filter_weight untransposed (_filter_rows, no tl.trans in registers) the tensor-core
# tilings come first: tf32x3 over EDGE_TILE_TF32X3, then the few best ieee tilings of that grid.
EDGE_TILE_TF32X3 = [
    (64, 32, 4), (32, 32, 4), (64, 64, 4), (128, 32, 4), (128, 32, 8), (32, 64, 4), (64, 32, 8), (16, 32, 4),
    (64, 128, 8), (128, 64, 8),
]  # fmt: skip
EDGE_TILE_GRID = [(32, 32, 4), (64, 32, 8), (16, 128, 4)]
# Which kernels the section tunes (bwd_filter only runs in training, where its tiles matter less).
EDGE_TILE_KERNELS = ("bwd_edge",)
# The second graph (g2) runs this many of each list's configurations, tf32x3 only.
SHORT_SWEEP = 2
IEEE_CONFIGS = 2


def g2_graph(count: int, dev: str, seed: int = 0):
    """Inputs of the message step for ``count`` g2 molecules in one batch: all pairs within 5 Å of each molecule
    (no periodicity), receiver-sorted, rbf and features as :func:`water_like_graph` makes them."""
    recv, send, vecs, offset = [], [], [], 0
    for atoms in g2_chno(count, seed=seed):
        pos = torch.as_tensor(atoms.positions, dtype=torch.float64)
        d = pos[None, :, :] - pos[:, None, :]  # pos[j] - pos[i]
        r2 = (d * d).sum(-1)
        i, j = torch.nonzero((r2 < CUTOFF**2) & (r2 > 0), as_tuple=True)  # row-major: sorted by receiver
        recv.append(i + offset)
        send.append(j + offset)
        vecs.append(d[i, j])
        offset += len(atoms)
    ei = torch.stack([torch.cat(recv), torch.cat(send)])
    vec = torch.cat(vecs)
    dist = vec.norm(dim=-1)
    k = torch.arange(1, N_RBF + 1, dtype=torch.float64) * math.pi / CUTOFF
    env = 0.5 * (torch.cos(math.pi * dist / CUTOFF) + 1)
    rbf = math.sqrt(2 / CUTOFF) * torch.sin(k * dist[:, None]) / dist[:, None] * env[:, None]
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(offset, 3 * N_FEAT, generator=gen)
    v = torch.randn(offset, 3, N_FEAT, generator=gen)
    w = torch.randn(3 * N_FEAT, N_RBF, generator=gen) / math.sqrt(N_RBF)
    return [t.to(dev) for t in (x, v, rbf.float(), w, (vec / dist[:, None]).float(), ei)]


class Deadline:
    """Wall-clock budget of the per-kernel sections: rows past it are listed as not run."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds
        self.skipped: list[str] = []

    def over(self, what: str) -> bool:
        if time.monotonic() < self.end:
            return False
        self.skipped.append(what)
        return True


def _chunked_reference(inputs, gs, gv, chunk: int = 1 << 18):
    """Float64 forward and VJP, accumulated over edge chunks (both are sums over edges; the [E, 3F] temporaries
    of a 1.3M-edge graph in float64 would take tens of GB at once)."""
    x, v, rbf, w, unit, ei = inputs
    x, v, rbf, w, unit, gs, gv = (t.double() for t in (x, v, rbf, w, unit, gs, gv))
    ds, dv = torch.zeros_like(gs), torch.zeros_like(gv)
    g_x, g_v, g_w = torch.zeros_like(x), torch.zeros_like(v), torch.zeros_like(w)
    g_rbf, g_unit = [], []
    for lo in range(0, ei.shape[1], chunk):
        sl = slice(lo, lo + chunk)
        s_, v_ = mp.message_passing_reference(x, v, rbf[sl], w, unit[sl], ei[:, sl])
        ds += s_
        dv += v_
        gx, gvv, grbf, gw, gu = mp.message_passing_backward_reference(gs, gv, x, v, rbf[sl], w, unit[sl], ei[:, sl])
        g_x += gx
        g_v += gvv
        g_w += gw
        g_rbf.append(grbf)
        g_unit.append(gu)
    return (ds, dv), (g_x, g_v, torch.cat(g_rbf), g_w, torch.cat(g_unit))


class KernelBench:
    """One graph's inputs, its CSRs, upstream gradients and float64 references; times one kernel at a time."""

    def __init__(self, name: str, inputs):
        self.name = name
        self.inputs = inputs
        x, ei = inputs[0], inputs[-1]
        n = x.shape[0]
        self.edges = ei.shape[1]
        self.row_ptr = torch.searchsorted(ei[0].contiguous(), torch.arange(n + 1, device=ei.device))
        self.perm, self.col_ptr = mp._sender_csr(ei, n)
        gen = torch.Generator(device=x.device).manual_seed(1)
        self.gs = torch.randn(n, N_FEAT, generator=gen, device=x.device)
        self.gv = torch.randn(n, 3, N_FEAT, generator=gen, device=x.device)
        self.ref_fwd, self.ref_bwd = _chunked_reference(inputs, self.gs, self.gv)
        # A 6 ms kernel replayed 20 times per graph would spend seconds per row.
        self.reps = 5 if self.edges > 200_000 else 20
        self.shipped: dict[str, tuple[float, float]] = {}  # kernel -> (µs, error) of the shipped ieee kernel

    def call(self, kernel: str):
        x, v, rbf, w, unit, ei = self.inputs
        if kernel == "fwd":
            return lambda: mp._mp_forward(x, v, rbf, w, unit, ei, self.row_ptr, mp._bare)
        args = (self.gs, self.gv, x, v, rbf, w, unit, ei, self.perm, self.col_ptr, NEED[kernel], mp._bare)
        return lambda: mp._mp_backward(*args)

    def run(self, kernel: str, config: dict) -> tuple[float, float]:
        """(µs per call, max |out - ref| / max |ref| over the kernel's outputs) under ``config``."""
        with mp._configured(**config):
            fn = self.call(kernel)
            out = fn()
            ref = self.ref_fwd if kernel == "fwd" else self.ref_bwd
            err = max(
                ((out[k].double() - ref[k]).abs().max() / ref[k].abs().max().clamp_min(1e-300)).item()
                for k in OUTPUTS[kernel]
            )
            return graph_time_us(fn, reps=self.reps), err


def _kernel_graphs(small_water: bool = False):
    """The graphs of the per-kernel sections, built one at a time (the water box first: issue 7's target;
    ``small_water``: then a 192-atom box, the MD case of issues 5 and 6)."""
    yield KernelBench("water 24000", water_like_graph(24000, torch.device("cuda")))
    if small_water:
        yield KernelBench("water 192", water_like_graph(192, torch.device("cuda")))
    yield KernelBench("g2 x1024", g2_graph(1024, "cuda"))


def _row(records, lines, rec: dict, base: float | None, ieee_err: float | None) -> None:
    """Record and print one timed row; ``base``/``ieee_err``: the shipped ieee kernel's time and error."""
    rec["ok"] = rec["err"] <= max(ACCURATE, ACCURATE_VS_IEEE * (ieee_err if ieee_err is not None else rec["err"]))
    records.append(rec)
    flag = "" if rec["ok"] else " ⚠ inaccurate"
    vs = f"{base / rec['us']:.2f}x" if base else ""
    tiles = rec.get("tiles", "shipped")
    lines.append(
        f"| {rec['graph']} | {rec['edges']} | {rec['kernel']} | {rec['variant']} | {tiles} | {rec['prec']} "
        f"| {rec['us']:.1f} | {vs} | {rec['err']:.1e}{flag} |"
    )
    print(lines[-1], flush=True)


TABLE_HEAD = [
    "| graph | edges | kernel | variant | tiles a x e x f / warps | dot | µs | speed-up vs shipped | max rel err |",
    "|---|---:|---|---|---|---|---:|---:|---:|",
]


KERNELS_HEAD = [
    "",
    "## Message-passing kernels one by one: dot precision (µs per call in a CUDA graph)",
    "",
    "Each kernel alone with the shipped tiles; the error is max |out − ref| / max |ref| over the kernel's",
    f"outputs vs float64 (⚠: above {ACCURATE:g} and above {ACCURATE_VS_IEEE:g}x the shipped ieee kernel's error).",
    "Speed-up is vs the same kernel in ieee (the shipped default).",
    "",
    *TABLE_HEAD,
]
VARIANTS_HEAD = [
    "",
    "## Kernel variants and tiles x dot precision (µs per call in a CUDA graph)",
    "",
    'fwd / bwd_sender "block": BLOCK_A consecutive atoms per program (tiles a x e x f / warps), edge tiles of',
    "BLOCK_E, feature chunk BLOCK_F, one-hot tl.dot segment sum. bwd_sender+edge: the inference backward (∂x, ∂v,",
    '∂rbf, ∂u): the atom sender kernel then the edge kernel (a one-kernel "fused" variant was removed at stop 21).',
    "bwd_edge / bwd_filter: their own tiles (- x <kernel>_block_e x _block_f / _warps). Speed-up vs the shipped",
    "kernel(s) in ieee. Rows in tf32x3 first, ieee rows of the block kernels last (the budget cuts the tail).",
    "",
    *TABLE_HEAD,
]


def _failed(b: KernelBench, kernel: str, variant: str, tiles: str, prec: str, exc: Exception) -> str:
    """A configuration that does not compile or launch (registers, shared memory): a row saying so."""
    why = f"{type(exc).__name__} {str(exc)[:60]}".replace("|", "/").replace("\n", " ")
    return f"| {b.name} | {b.edges} | {kernel} | {variant} | {tiles} | {prec} | failed: {why} | | |"


def kernel_probe(lines: list[str], records: list, b: KernelBench, deadline: Deadline) -> None:
    """Section "kernels", one graph: every kernel (atom variant, shipped tiles) under each dot precision."""
    for kernel in mp._KERNELS:
        for prec in mp._PRECISIONS:
            if deadline.over(f"{b.name} {kernel} {prec}"):
                continue
            cfg = {f"dot_{kernel}": prec}
            if kernel in ("fwd", "bwd_sender"):
                cfg[f"{kernel}_variant"] = "atom"
            try:
                us, err = b.run(kernel, cfg)
            except Exception as exc:
                lines.append(_failed(b, kernel, "atom", "shipped", prec, exc))
                continue
            if prec == "ieee":
                b.shipped[kernel] = (us, err)
            ref = b.shipped.get(kernel, (None, None))
            rec = dict(section="kernels", graph=b.name, edges=b.edges, kernel=kernel, variant="atom", prec=prec)
            _row(records, lines, dict(rec, us=us, err=err, config=cfg), *ref)


def _sweep(full: bool) -> list[tuple[str, str, str, dict]]:
    """(kernel, tiles, precision, _CONFIG changes) of the variants section, in the order they run; ``full``: every
    configuration, else the first SHORT_SWEEP of each list in tf32x3."""
    n_ieee = IEEE_CONFIGS if full else 0

    def head(configs):
        return configs if full else configs[:SHORT_SWEEP]

    out = []
    for kernel in ("fwd", "bwd_sender"):
        out.append((kernel, "shipped", "ieee", {f"{kernel}_variant": "atom", f"dot_{kernel}": "ieee"}))
        for k, (ba, be, bf, nw) in enumerate(head(BLOCK_CONFIGS)):
            for prec in ("tf32x3", "ieee") if k < n_ieee else ("tf32x3",):
                tiles = f"{ba} x {be} x {bf} / {nw}"
                cfg = {f"{kernel}_{key}": val for key, val in zip(("block_a", "block_e", "block_f", "warps"),
                                                                  (ba, be, bf, nw), strict=True)}  # fmt: skip
                out.append((kernel, tiles, prec, {f"{kernel}_variant": "block", f"dot_{kernel}": prec, **cfg}))
    kernel = "bwd_sender+edge"
    out.append((kernel, "shipped", "ieee", {"bwd_sender_variant": "atom", "dot_bwd_sender": "ieee"}))
    for kernel in ("bwd_edge", "bwd_filter"):
        out.append((kernel, "shipped", "ieee", {f"dot_{kernel}": "ieee"}))
        for be, bf, nw in head(EDGE_CONFIGS):
            cfg = {f"{kernel}_block_e": be, f"{kernel}_block_f": bf, f"{kernel}_warps": nw}
            out.append((kernel, f"- x {be} x {bf} / {nw}", "tf32x3", {f"dot_{kernel}": "tf32x3", **cfg}))
    # The ieee rows last: if the budget cuts the sweep, it cuts those (the one-hot sums on CUDA cores).
    return sorted(out, key=lambda row: row[2] == "ieee" and row[1] != "shipped")


EDGE_TILES_HEAD = [
    "## Edge backward kernel: tiles x dot precision (µs per call in a CUDA graph)",
    "",
    "Tiles: - x <kernel>_block_e x _block_f / _warps; speed-up vs the shipped configuration of this commit.",
    "",
    "| graph | edges | kernel | variant | tiles a x e x f / warps | dot | µs | speed-up vs shipped | max rel err |",
    "|---|---:|---|---|---|---|---:|---:|---:|",
]


def edge_tile_probe(lines: list[str], records: list, b: KernelBench, deadline: Deadline) -> None:
    """Section "edgetiles", one graph: the EDGE_TILE_KERNELS over EDGE_TILE_TF32X3 in tf32x3, then EDGE_TILE_GRID in
    ieee, after the shipped configuration."""
    for kernel in EDGE_TILE_KERNELS:
        rows = [("shipped", {})]
        grid = [(t, "tf32x3") for t in EDGE_TILE_TF32X3] + [(t, "ieee") for t in EDGE_TILE_GRID]
        for (be, bf, nw), prec in grid:
            cfg = {f"dot_{kernel}": prec, f"{kernel}_block_e": be, f"{kernel}_block_f": bf, f"{kernel}_warps": nw}
            rows.append((f"- x {be} x {bf} / {nw}", cfg))
        _time_rows(lines, records, b, deadline, "edgetiles", kernel, rows)


def _time_rows(lines, records, b: KernelBench, deadline: Deadline, section: str, kernel: str, rows) -> None:
    """Time ``kernel`` on ``b`` under each ``(tiles, config)`` of ``rows`` (the "shipped" row first: the base of
    the speed-ups), until the deadline; a configuration that fails is a row saying so."""
    for tiles, cfg in rows:
        prec = cfg.get(f"dot_{kernel}", mp._CONFIG[f"dot_{kernel}"])
        variant = cfg.get(f"{kernel}_variant", "atom")
        if deadline.over(f"{b.name} {kernel} {variant} {tiles} {prec}"):
            continue
        try:
            us, err = b.run(kernel, cfg)
        except Exception as exc:
            lines.append(_failed(b, kernel, variant, tiles, prec, exc))
            continue
        if tiles == "shipped":
            b.shipped[kernel] = (us, err)
        rec = dict(section=section, graph=b.name, edges=b.edges, kernel=kernel, variant=variant, prec=prec)
        base = b.shipped.get(kernel, (None, None))
        _row(records, lines, dict(rec, tiles=tiles, us=us, err=err, config=cfg), *base)


# Section "sendertiles": the "atom" variants (one program per atom and feature chunk) of the sender backward
# (keys block_e, block_f, num_warps; every graph size) and of the forward (fwd_atom_*; below block_min_atoms,
# the MD case). Tiles (block_e, block_f, warps), in tf32x3 (their shipped precision), the shipped ones first.
ATOM_TILES = [
    (16, 128, 4), (16, 64, 4), (32, 64, 4), (32, 32, 4), (64, 32, 4), (16, 32, 4), (32, 128, 8), (64, 64, 8),
    (16, 64, 2),
]  # fmt: skip
TILE_KEYS = ("block_e", "block_f", "num_warps")
# ... and the sender backward's "block" variant (block_a, block_e, block_f, warps) on the same graphs.
SENDER_BLOCK_TILES = [(16, 32, 64, 4), (16, 32, 64, 8), (32, 32, 64, 8), (16, 16, 64, 4)]
ATOM_TILES_HEAD = [
    "## Atom-variant forward and sender backward: tiles (µs per call in a CUDA graph)",
    "",
    "Tiles: - x block_e x block_f / num_warps (the sender backward) or fwd_atom_* (the forward), tf32x3;",
    "speed-up vs the shipped tiles of the commit that ran.",
    "",
    *TABLE_HEAD,
]


def atom_tile_probe(lines: list[str], records: list, b: KernelBench, deadline: Deadline) -> None:
    """Section "sendertiles", one graph: bwd_sender (and, below block_min_atoms, fwd) in the atom variant over
    ATOM_TILES, and the block sender backward over SENDER_BLOCK_TILES. The "shipped" row is the atom variant at
    the shipped tiles (the speed-ups' base), whatever variant "auto" would pick for the graph."""
    n_atoms = b.inputs[0].shape[0]
    kernels = ("bwd_sender", "fwd") if n_atoms < mp._CONFIG["block_min_atoms"] else ("bwd_sender",)
    for kernel in kernels:
        pin = {f"{kernel}_variant": "atom"}
        keys = ("fwd_atom_block_e", "fwd_atom_block_f", "fwd_atom_warps") if kernel == "fwd" else TILE_KEYS
        rows = [("shipped", pin)] + [
            (f"- x {be} x {bf} / {nw}", dict(pin, **dict(zip(keys, (be, bf, nw), strict=True))))
            for be, bf, nw in ATOM_TILES
        ]
        if kernel == "bwd_sender":  # the block variant beside it (low-degree graphs: W tiles shared by atoms)
            for ba, be, bf, nw in SENDER_BLOCK_TILES:
                cfg = dict(bwd_sender_variant="block", block_min_atoms=0, bwd_sender_block_a=ba)
                cfg.update(bwd_sender_block_e=be, bwd_sender_block_f=bf, bwd_sender_warps=nw)
                rows.append((f"block {ba} x {be} x {bf} / {nw}", cfg))
        _time_rows(lines, records, b, deadline, "sendertiles", kernel, rows)


def variant_probe(lines: list[str], records: list, b: KernelBench, deadline: Deadline) -> None:
    """Section "variants", one graph: the block forward / sender-backward kernels and the edge / filter kernels
    over tiles x precision, each kernel group after its shipped (atom, ieee) baseline."""
    # Speed-ups and accuracy vs the shipped kernel in ieee: from the kernels section when it ran, else timed here.
    for kernel, tiles, prec, cfg in _sweep(full=b.name.startswith("water")):
        variant = cfg.get(f"{kernel}_variant", cfg.get("bwd_sender_variant", "atom"))
        if tiles == "shipped" and kernel in b.shipped:
            continue
        if deadline.over(f"{b.name} {kernel} {variant} {tiles} {prec}"):
            continue
        try:
            us, err = b.run(kernel, cfg)
        except Exception as exc:
            lines.append(_failed(b, kernel, variant, tiles, prec, exc))
            continue
        if tiles == "shipped":
            b.shipped[kernel] = (us, err)
        rec = dict(section="variants", graph=b.name, edges=b.edges, kernel=kernel, variant=variant, prec=prec)
        _row(records, lines, dict(rec, tiles=tiles, us=us, err=err, config=cfg), *b.shipped.get(kernel, (None, None)))


def summary(lines: list[str], records: list, deadline: Deadline) -> None:
    """Fastest accurate row per graph and kernel, the shipped time, and the _CONFIG the water winners imply."""
    rows = [r for r in records if r.get("section") in ("kernels", "variants")]
    if not rows:
        return
    lines += ["", "## Summary: fastest float32-accurate choice per kernel (µs)", ""]
    lines += [
        "| graph | kernel | shipped (atom, ieee) | fastest accurate | variant | tiles | dot | speed-up |",
        "|---|---|---:|---:|---|---|---|---:|",
    ]
    best_cfg: dict = {}
    for graph in dict.fromkeys(r["graph"] for r in rows):
        shipped, best = {}, {}
        for kernel in (*mp._KERNELS, "bwd_sender+edge"):
            mine = [r for r in rows if r["graph"] == graph and r["kernel"] == kernel]
            base = [r["us"] for r in mine if r["variant"] == "atom" and r["prec"] == "ieee"]
            good = sorted((r for r in mine if r["ok"]), key=lambda r: r["us"])
            if not base or not good:
                continue
            shipped[kernel], best[kernel] = base[0], good[0]
            b = good[0]
            lines.append(
                f"| {graph} | {kernel} | {base[0]:.1f} | {b['us']:.1f} | {b['variant']} "
                f"| {b.get('tiles', 'shipped')} | {b['prec']} | {base[0] / b['us']:.2f}x |"
            )
        # Inference backward: the sender + edge kernels (or the timed pair, when it was faster).
        pair = [best[k] for k in ("bwd_sender", "bwd_edge") if k in best]
        if "bwd_sender+edge" in best and (len(pair) < 2 or best["bwd_sender+edge"]["us"] < sum(r["us"] for r in pair)):
            pair = [best["bwd_sender+edge"]]
        chosen = [best[k] for k in ("fwd",) if k in best] + pair + [best[k] for k in ("bwd_filter",) if k in best]
        if all(k in shipped for k in mp._KERNELS):
            t_ship = sum(shipped[k] for k in mp._KERNELS)
            t_best = sum(r["us"] for r in chosen)
            lines.append(f"| {graph} | **fwd + bwd (all four)** | {t_ship:.1f} | {t_best:.1f} | | | "
                         f"| {t_ship / t_best:.2f}x |")  # fmt: skip
            infer = [r for r in chosen if r["kernel"] != "bwd_filter"]
            t_ship_i = t_ship - shipped["bwd_filter"]
            t_best_i = sum(r["us"] for r in infer)
            lines.append(f"| {graph} | **energy + forces (no bwd_filter)** | {t_ship_i:.1f} | {t_best_i:.1f} | | | "
                         f"| {t_ship_i / t_best_i:.2f}x |")  # fmt: skip
        if graph.startswith("water") and not best_cfg:
            for r in chosen:
                best_cfg.update(r["config"])
    if best_cfg:
        lines += ["", "_CONFIG keys of those choices on the water graph (mp._CONFIG.update(...)):", ""]
        lines += ["```", json.dumps(best_cfg, indent=1), "```"]
    if deadline.skipped:
        lines += ["", f"Not run (time budget): {len(deadline.skipped)} rows: " + "; ".join(deadline.skipped)]


SECTIONS = ("gemm", "mp", "kernels", "variants", "edgetiles", "sendertiles")
DEFAULT_SECTIONS = "gemm,kernels,variants"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--sections", default=DEFAULT_SECTIONS, help=f"comma list of {','.join(SECTIONS)}")
    ap.add_argument("--skip", default="", help="comma list of sections to leave out")
    ap.add_argument("--budget-s", type=float, default=120.0, help="wall-clock budget of kernels+variants, s")
    args = ap.parse_args()
    chosen = [s for s in args.sections.split(",") if s and s not in args.skip.split(",")]
    unknown = set(chosen) - set(SECTIONS)
    if unknown:
        sys.exit(f"unknown sections {sorted(unknown)}; known: {SECTIONS}")
    import triton

    lines = [
        f"# Tuning probes: {torch.cuda.get_device_name()} · torch {torch.__version__} · triton {triton.__version__}",
        "",
    ]
    records: list = []
    if "gemm" in chosen:
        gemm_probe(lines)
        print("\n".join(lines), flush=True)
    if "mp" in chosen:
        mp_probe(lines, records)
    tile_sections = {"edgetiles": (EDGE_TILES_HEAD, edge_tile_probe), "sendertiles": (ATOM_TILES_HEAD, atom_tile_probe)}
    for section, (head, probe) in tile_sections.items():
        if section not in chosen:
            continue
        deadline = Deadline(args.budget_s)
        t_lines = list(head)
        for bench in _kernel_graphs(small_water=True):
            probe(t_lines, records, bench, deadline)
            del bench
            torch.cuda.empty_cache()
        lines += t_lines + ([f"Not run (budget): {', '.join(deadline.skipped)}"] if deadline.skipped else [])
    if "kernels" in chosen or "variants" in chosen:
        # Graph-major (all water rows before any g2 row), so that the budget cuts the less important rows.
        deadline = Deadline(args.budget_s)
        k_lines, v_lines = list(KERNELS_HEAD), list(VARIANTS_HEAD)
        for bench in _kernel_graphs():
            if "kernels" in chosen:
                kernel_probe(k_lines, records, bench, deadline)
            if "variants" in chosen:
                variant_probe(v_lines, records, bench, deadline)
            del bench
            torch.cuda.empty_cache()
        lines += (k_lines if "kernels" in chosen else []) + (v_lines if "variants" in chosen else [])
        summary(lines, records, deadline)
    text = "\n".join(lines)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "tune_small.md").write_text(text + "\n")
        (Path(args.out) / "tune_small.json").write_text(json.dumps(records, indent=1))
    print(text[-8000:])


if __name__ == "__main__":
    main()
