# ruff: noqa: B023  (closures are timed inside the loop iteration that defines them)
"""Neighbour-list benchmark (GPU): brute force, our cell list (Triton and torch) and vesin-torch, on water boxes.

Cases (5 Å cutoff, ~1 g/cm³ water, random molecule centres and orientations): single periodic boxes of 3,000,
24,000 and 100,008 atoms; 1,024 small periodic boxes (24 atoms, 6.2 Å cells) in one batched call, against
vesin called once per box. Every time includes the full contract output (receiver-sorted CSR ``row_ptr``,
(i, j, S) order, integer shifts, shift vectors) except ``vesin raw`` (vesin's own unsorted i, j, S only).

    python benchmarks/bench_neighbors.py --out benchmarks/results/neighbors_h100.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import copy_bandwidth, environment, time_fn

from mlff_distiller.neighbors import neighbor_list
from mlff_distiller.neighbors.vesin_backend import _vesin_class, vesin_available

CUTOFF = 5.0
WATER_PER_A3 = 0.03343  # molecules / Å³ at 1 g/cm³


def water_box(n_mol: int, length: float, rng: np.random.Generator) -> np.ndarray:
    """``[3 n_mol, 3]`` positions (Å): O at random centres, two H at 0.96 Å, 104.5° apart, random orientation."""
    o = rng.uniform(0, length, (n_mol, 3))
    q = rng.normal(size=(n_mol, 4))
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    w, x, y, z = q.T
    rot = np.stack(
        [
            [1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w)],
            [2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w)],
            [2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y)],
        ]
    ).transpose(2, 0, 1)
    half = np.deg2rad(104.5) / 2
    local = 0.96 * np.array([[np.sin(half), np.cos(half), 0.0], [-np.sin(half), np.cos(half), 0.0]])
    h = o[:, None, :] + np.einsum("kb,nab->nka", local, rot)
    return np.concatenate([o[:, None, :], h], axis=1).reshape(-1, 3)


def make_batch(n_struct: int, n_atoms: int, length: float | None, device, rng):
    n_mol = n_atoms // 3
    if length is None:
        length = (n_mol / WATER_PER_A3) ** (1 / 3)
    pos = np.concatenate([water_box(n_mol, length, rng) for _ in range(n_struct)])
    n = 3 * n_mol
    return dict(
        positions=torch.tensor(pos, dtype=torch.float32, device=device),
        cell=torch.eye(3, dtype=torch.float32, device=device).repeat(n_struct, 1, 1) * length,
        pbc=torch.ones(n_struct, 3, dtype=torch.bool, device=device),
        batch=torch.arange(n_struct, device=device).repeat_interleave(n),
        ptr=torch.arange(n_struct + 1, device=device) * n,
    ), length


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/neighbors_h100.md"))
    ap.add_argument("--quick", action="store_true", help="small sizes (smoke run)")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rng = np.random.default_rng(0)
    env = environment(device, copy_bandwidth(device, 1 << 28) if device.type == "cuda" else 0.0)
    sizes = [300, 3000] if args.quick else [3000, 24000, 100_008]
    n_small = 16 if args.quick else 1024
    rows = []

    def run(case, impl, fn, n_atoms, n_struct, pairs, **kw):
        t = time_fn(fn, device, **kw)
        rows.append((case, impl, n_atoms, n_struct, pairs, t))
        print(f"{case:28s} {impl:26s} {t.median_us / 1e3:9.3f} ms  pairs={pairs}", flush=True)
        return t

    cases = [(f"1 box, {n} atoms", 1, n, None) for n in sizes]
    cases.insert(min(2, len(cases)), (f"{n_small} boxes x 24 atoms", n_small, 24, 6.2))
    for case, n_struct, n_atoms, length in cases:
        inp, length = make_batch(n_struct, n_atoms, length, device, rng)
        args_nl = (inp["positions"], inp["cell"], inp["pbc"], inp["batch"], inp["ptr"], CUTOFF)
        ref = neighbor_list(*args_nl, "cell_list")
        pairs = ref.num_edges
        total = inp["positions"].shape[0]
        impls = [("cell_list (triton)", dict(method="cell_list", cell_list_impl="triton"))] * (device.type == "cuda")
        if total <= 30_000:
            impls += [
                ("cell_list (torch)", dict(method="cell_list", cell_list_impl="torch")),
                ("brute", dict(method="brute")),
            ]
        if vesin_available():
            impls += [("vesin (our contract)", dict(method="vesin"))]
        for name, kw in impls:
            method = kw.pop("method")
            got = neighbor_list(*args_nl, method, **kw)
            assert torch.equal(got.edge_index, ref.edge_index), f"{case}: {name} differs from cell_list"
            slow = (name.startswith("vesin") and n_struct > 1) or (name == "brute" and total > 20_000)
            run(
                case,
                name,
                lambda m=method, k=kw: neighbor_list(*args_nl, m, **k),
                total,
                n_struct,
                pairs,
                **(dict(warmup_ms=1, rep_ms=1) if slow else {}),
            )
        if vesin_available():
            calc = _vesin_class()(cutoff=CUTOFF, full_list=True)
            ptr = inp["ptr"].tolist()
            pos64, cell64 = inp["positions"].double(), inp["cell"].double()

            def vesin_raw():
                for b in range(n_struct):
                    calc.compute(pos64[ptr[b] : ptr[b + 1]], cell64[b], True, "ijS", copy=False)

            run(
                case,
                "vesin raw (1 call/box)",
                vesin_raw,
                total,
                n_struct,
                pairs,
                **(dict(warmup_ms=1, rep_ms=1) if n_struct > 1 else {}),
            )

    # Where the time goes for the 24,000-atom box (launch count, top kernels).
    profile = ""
    if device.type == "cuda" and not args.quick:
        inp, _ = make_batch(1, 24000, None, device, rng)
        a = (inp["positions"], inp["cell"], inp["pbc"], inp["batch"], inp["ptr"], CUTOFF)
        neighbor_list(*a, "cell_list")
        torch.cuda.synchronize()
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        ) as prof:
            neighbor_list(*a, "cell_list")
            torch.cuda.synchronize()
        profile = prof.key_averages().table(sort_by="cuda_time_total", row_limit=15)
        print(profile)

    by_case = {}
    for case, impl, *_rest, t in rows:
        by_case.setdefault(case, {})[impl] = t.median_us
    lines = [
        "# Neighbour lists on the GPU (issue 7)",
        "",
        f"{env.device} · torch {env.torch} · triton {env.triton} · commit {env.commit} · "
        f"copy bandwidth {env.copy_gbps:.0f} GB/s",
        "",
        "5 Å cutoff, float32 positions (geometry in float64), water at ~1 g/cm³. Times are medians of "
        "`triton.testing.do_bench` (harness.time_fn) and include the full output contract (receiver-sorted "
        "CSR, (i, j, S) order, shifts, shift vectors) except `vesin raw` (vesin's unsorted i, j, S only).",
        "",
        "| case | impl | atoms | structures | pairs | median ms | p20-p80 ms | vesin raw / this |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for case, impl, n_atoms, n_struct, pairs, t in rows:
        v = by_case[case].get("vesin raw (1 call/box)")
        ratio = f"{v / t.median_us:.1f}" if v else "—"
        lines.append(
            f"| {case} | {impl} | {n_atoms} | {n_struct} | {pairs} | {t.median_us / 1e3:.3f} "
            f"| {t.p20_us / 1e3:.3f}-{t.p80_us / 1e3:.3f} | {ratio} |"
        )
    if profile:
        lines += ["", "Profile of one Triton cell-list call, 24,000 atoms:", "", "```", profile, "```"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
