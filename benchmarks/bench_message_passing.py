"""Benchmark the fused message_passing kernel against the torch reference on water-like graphs (GPU).

Graphs: atoms uniformly at liquid-water density (0.100 atoms/Å³, i.e. 1 g/cm³ of H2O) in a periodic cubic box,
all pairs within 5 Å (≈ 52 neighbours per atom, the issue's ≈ 55), atoms numbered cell by cell (5 Å cells,
as a box built molecule by molecule is: neighbours have nearby indices), edges sorted by receiver. F = 128
features, R = 20 basis functions, float32, like the default student.

Modes: ``fwd`` (no autograd), ``fwd+bwd`` (gradients to x, v, rbf, filter_weight and unit: training's first
backward), ``fwd+bwd-forces`` (no filter_weight gradient: inference energy + forces, parameters frozen). The
Triton op is called as the model calls it (no row_ptr): the receiver/sender CSR is built on the first call and
cached for the edge_index tensor, as across the layers of one model evaluation. Each row also records the peak
extra GPU memory of one call (above the inputs), MB. Rows go to <out>/message_passing_<gpu>.{jsonl,md}.

    python benchmarks/bench_message_passing.py               # 3,000 and 24,000 atoms
    python benchmarks/bench_message_passing.py --tune        # also sweep tile sizes x warps at 24,000 atoms
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import BenchRow, copy_bandwidth, environment, time_fn, write_results
from mlff_distiller.kernels import message_passing, message_passing_reference, use_backend

mp_module = importlib.import_module("mlff_distiller.kernels.message_passing")

CUTOFF = 5.0
DENSITY = 0.100  # atoms / Å³ (liquid water)
N_FEAT, N_RBF = 128, 20


def water_like_graph(n_atoms: int, device: torch.device, seed: int = 0):
    """positions-free inputs of the message step: x, v, rbf, filter_weight, unit, edge_index (receiver-sorted)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    box = (n_atoms / DENSITY) ** (1 / 3)
    pos = torch.rand(n_atoms, 3, generator=gen, device=device, dtype=torch.float64) * box
    n_cell = max(1, int(box // CUTOFF))
    cell_id = (pos / box * n_cell).long().clamp_(max=n_cell - 1)
    key = (cell_id[:, 0] * n_cell + cell_id[:, 1]) * n_cell + cell_id[:, 2]
    pos = pos[torch.argsort(key)]
    recv, send, vecs = [], [], []
    for start in range(0, n_atoms, 2048):  # brute force with the minimum image, in row chunks
        d = pos[start : start + 2048, None, :] - pos[None, :, :]
        d -= box * torch.round(d / box)
        r2 = (d * d).sum(-1)
        i, j = torch.nonzero((r2 < CUTOFF**2) & (r2 > 0), as_tuple=True)
        recv.append(i + start)
        send.append(j)
        vecs.append(-d[i, j])  # pos[j] - pos[i]
    ei = torch.stack([torch.cat(recv), torch.cat(send)])
    vec = torch.cat(vecs)
    dist = vec.norm(dim=-1)
    unit = (vec / dist[:, None]).float()
    k = torch.arange(1, N_RBF + 1, device=device, dtype=torch.float64) * math.pi / CUTOFF
    env = 0.5 * (torch.cos(math.pi * dist / CUTOFF) + 1)
    rbf = (math.sqrt(2 / CUTOFF) * torch.sin(k * dist[:, None]) / dist[:, None] * env[:, None]).float()
    x = torch.randn(n_atoms, 3 * N_FEAT, generator=gen, device=device)
    v = torch.randn(n_atoms, 3, N_FEAT, generator=gen, device=device)
    w = torch.randn(3 * N_FEAT, N_RBF, generator=gen, device=device) / math.sqrt(N_RBF)
    return x, v, rbf, w, unit, ei


def _impl(name: str):
    if name == "triton":

        def fn(*a):
            with use_backend("triton"):
                return message_passing(*a)

        return fn
    return message_passing_reference


def closure(fn, inputs, mode: str):
    x, v, rbf, w, unit, ei = inputs
    if mode == "fwd":

        def run():
            with torch.no_grad():
                return fn(x, v, rbf, w, unit, ei)

        return run
    wrt = [x, v, rbf, unit] + ([w] if mode == "fwd+bwd" else [])
    leaves = {id(t): t.detach().requires_grad_(True) for t in wrt}
    args = [leaves.get(id(t), t) for t in (x, v, rbf, w, unit)]
    go = [torch.randn_like(t) for t in fn(*args, ei)]

    def run():
        return torch.autograd.grad(fn(*args, ei), list(leaves.values()), go)

    return run


def peak_extra_mb(run, device) -> float:
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = run()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del out
    return (peak - base) / 2**20


def bench(sizes, modes, env, device, rep_ms) -> list[BenchRow]:
    rows = []
    for n_atoms in sizes:
        inputs = water_like_graph(n_atoms, device)
        e = inputs[-1].shape[1]
        print(f"{n_atoms} atoms, {e} edges ({e / n_atoms:.1f} per atom)", flush=True)
        for mode in modes:
            res = {}
            for impl in ("triton", "eager"):
                try:
                    run = closure(_impl(impl), inputs, mode)
                    t = time_fn(run, device, rep_ms=rep_ms)
                    res[impl] = (t, peak_extra_mb(run, device))
                except torch.OutOfMemoryError:
                    print(f"  {mode} {impl}: out of memory", flush=True)
                torch.cuda.empty_cache()
            # Minimal traffic: node inputs and outputs once, per-edge inputs (rbf, unit, edge_index) once.
            s = 4
            nbytes = n_atoms * 6 * N_FEAT * s + e * (N_RBF + 3) * s + e * 16 + n_atoms * 4 * N_FEAT * s
            if mode != "fwd":
                nbytes *= 2
            for impl, (t, mb) in res.items():
                gbps = nbytes / (t.median_us * 1e-6) / 1e9
                vs = res["eager"][0].median_us / t.median_us if "eager" in res else None
                rows.append(
                    BenchRow(
                        bench="message_passing",
                        variant=f"water {n_atoms} atoms F{N_FEAT} R{N_RBF}",
                        impl=impl,
                        mode=mode,
                        n_edges=e,
                        dtype="float32",
                        median_us=t.median_us,
                        p20_us=t.p20_us,
                        p80_us=t.p80_us,
                        bytes=nbytes,
                        gbps=gbps,
                        frac_copy_bw=gbps / env.copy_gbps,
                        vs_eager=vs,
                        note=f"peak +{mb:.0f} MB",
                        env=env,
                    )
                )
                print(f"  {mode:15s} {impl:7s} {t.median_us:10.1f} us  peak +{mb:8.1f} MB", flush=True)
        del inputs
        torch.cuda.empty_cache()
    return rows


def tune(device, rep_ms) -> list[str]:
    """Sweep the launch configuration at 24,000 atoms; returns markdown lines (best first per mode)."""
    inputs = water_like_graph(24000, device)
    fn = _impl("triton")
    lines = [
        "",
        "## Tuning sweep (24,000 atoms, µs)",
        "",
        "| block_e | block_f | warps | bwd_block_e | fwd | fwd+bwd |",
    ]
    lines.append("|---:|---:|---:|---:|---:|---:|")
    old = dict(mp_module._CONFIG)
    results = []
    for be, bf, nw in itertools.product((16, 32), (32, 64, 128), (4, 8)):
        bbe = 2 * be
        mp_module._CONFIG.update(block_e=be, block_f=bf, num_warps=nw)
        mp_module._CONFIG.update(fwd_atom_block_e=be, fwd_atom_block_f=bf, fwd_atom_warps=nw)
        for k in ("bwd_edge", "bwd_filter"):  # one set of tiles for all kernels, as when this sweep was written
            mp_module._CONFIG.update({f"{k}_block_e": bbe, f"{k}_block_f": bf, f"{k}_warps": nw})
        try:
            t_f = time_fn(closure(fn, inputs, "fwd"), device, rep_ms=rep_ms).median_us
            t_b = time_fn(closure(fn, inputs, "fwd+bwd"), device, rep_ms=rep_ms).median_us
        except Exception as exc:  # a configuration that does not compile (registers, shared memory)
            print(f"  {be} {bf} {nw} {bbe}: {type(exc).__name__}", flush=True)
            continue
        results.append((t_b, t_f, be, bf, nw, bbe))
        print(f"  be={be} bf={bf} warps={nw} bwd_be={bbe}: fwd {t_f:.1f} us, fwd+bwd {t_b:.1f} us", flush=True)
    mp_module._CONFIG.clear()
    mp_module._CONFIG.update(old)
    for t_b, t_f, be, bf, nw, bbe in sorted(results):
        lines.append(f"| {be} | {bf} | {nw} | {bbe} | {t_f:.1f} | {t_b:.1f} |")
    return lines


def probe_tf32x3(device, rep_ms) -> list[str]:
    """What the filter tl.dot in TF32x3 (three TF32 MMAs) in every kernel would give at 24,000 atoms: time and the
    error of ds, dv against the float64 reference, normwise relative, next to the shipped IEEE float32 dot
    (benchmarks/tune_small.py --sections kernels times each kernel under each precision)."""
    inputs = water_like_graph(24000, device)
    ref = message_passing_reference(*(t.double() for t in inputs[:-1]), inputs[-1])
    lines = ["", "## Filter dot precision (24,000 atoms; not the shipped default unless ieee)", ""]
    lines += [
        "| tl.dot input_precision | fwd µs | fwd+bwd µs | max rel. error ds, dv (vs float64) |",
        "|---|---:|---:|---:|",
    ]
    for prec in ("ieee", "tf32x3"):
        try:
            with mp_module._configured(**{f"dot_{k}": prec for k in mp_module._KERNELS}):
                fn = _impl("triton")
                t_f = time_fn(closure(fn, inputs, "fwd"), device, rep_ms=rep_ms).median_us
                t_b = time_fn(closure(fn, inputs, "fwd+bwd"), device, rep_ms=rep_ms).median_us
                with torch.no_grad():
                    out = fn(*inputs)
            err = max(((o.double() - r).abs().max() / r.abs().max()).item() for o, r in zip(out, ref, strict=True))
            lines.append(f"| {prec} | {t_f:.1f} | {t_b:.1f} | {err:.2e} |")
        except Exception as exc:
            lines.append(f"| {prec} | failed: {type(exc).__name__} | | |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[3000, 24000])
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--rep-ms", type=float, default=200)
    ap.add_argument("--probe-tf32x3", action="store_true", help="time and error of tl.dot in tf32x3 (not shipped)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    ap.add_argument("--name", default=None, help="results file stem (default message_passing_<gpu>)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_message_passing.py needs a CUDA device")
    device = torch.device("cuda")
    env = environment(device, copy_bandwidth(device))
    rows = bench(args.sizes, ("fwd", "fwd+bwd", "fwd+bwd-forces"), env, device, args.rep_ms)
    gpu = "h100" if "H100" in env.device else "h200" if "H200" in env.device else "gpu"
    _, md = write_results(rows, args.out, args.name or f"message_passing_{gpu}")
    if args.tune:
        with md.open("a") as f:
            f.write("\n".join(tune(device, args.rep_ms / 2)) + "\n")
    if args.probe_tf32x3:
        with md.open("a") as f:
            f.write("\n".join(probe_tf32x3(device, args.rep_ms)) + "\n")
    print(md.read_text())


if __name__ == "__main__":
    main()
