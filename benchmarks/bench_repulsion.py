"""What the ZBL wall (``kernels/repulsion.py``) costs in the step, and what its op costs alone (GPU).

The wall is evaluated on every edge of every step, also where it is zero (inside the training envelope, which is
almost always). So the question is its price in the hot paths of issues 5 and 7: the same student with and
without the wall, timed alternately in one process (three passes each, the median of each pass's median):

* benzene: the captured energy + forces step (replay) and one ASE velocity-Verlet step through
  ``StudentCalculator``;
* 1,024 and 4,096 g2 molecules: the captured step, µs per structure;
* water boxes of 3,000 (mode auto) and 24,000 atoms (eager);
* the op alone (forward + backward) on the 4,096-g2 edge list, Triton against the torch reference.

Random weights of the default size (128 × 3, 20 Bessel functions, 5 Å, the 14 g2 species); the radii are those
of the shipped student's envelope for H/C/N/O and the covalent fallback for the rest (``repulsion_radii``).

    python benchmarks/bench_repulsion.py --out benchmarks/results --name repulsion_h100
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import g2_batch
from harness import time_fn, write_lines
from peers import make_student
from probe_md_step import _benzene, _md_us
from probe_student_size import _step_us
from systems import water_box

from mlff_distiller import StudentCalculator, load_model
from mlff_distiller.domain import DomainEnvelope

G2_SPECIES = (1, 3, 4, 5, 6, 7, 8, 9, 11, 13, 14, 15, 16, 17)


def _md(model, steps: int) -> float:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calc = StudentCalculator(model, device="cuda")
    return _md_us(_benzene(), calc, steps)[0]


def _op_rows(model, structures) -> list[str]:
    """The op alone (forward + backward of the per-structure energies) on the engine's edge list of
    ``structures``, Triton and the torch reference."""
    from mlff_distiller.kernels import edge_basis, pair_repulsion, use_backend

    from mlff_distiller import AtomsBatch
    from mlff_distiller.neighbors import neighbor_list

    b = AtomsBatch.from_atoms(structures).to("cuda")
    nl = neighbor_list(b.positions, b.cell, b.pbc, b.batch, b.ptr, model.cutoff)
    idx = model.z_to_index.to("cuda")[b.numbers]
    table = model.repulsion_table.to("cuda")
    c = model.config
    pos = b.positions.requires_grad_(True)
    dist = edge_basis(pos, nl.edge_index, nl.shift_vectors, c.n_rbf, c.cutoff, c.basis, c.envelope)[0].detach()
    dist.requires_grad_(True)
    out = []
    for backend in ("triton", "torch"):
        with use_backend(backend):

            def run():
                _, energy, _ = pair_repulsion(dist, nl.edge_index, idx, table, b.batch, b.num_structures)
                torch.autograd.grad(energy.sum(), dist)

            t = time_fn(run, torch.device("cuda"), warmup_ms=25, rep_ms=200).median_us
        out.append((backend, t))
    n_edges = nl.edge_index.shape[1]
    return [f"| the op alone, {len(structures):,} g2 molecules ({n_edges:,} edges), {k} | {t:.1f} µs |" for k, t in out]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--name", default="repulsion_h100")
    p.add_argument("--md-steps", type=int, default=1000)
    p.add_argument("--passes", type=int, default=3)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_repulsion: needs CUDA")
        return
    import triton

    shipped = DomainEnvelope.of_model(load_model("builtin:chno-gfn2"))
    bare = make_student(species=list(G2_SPECIES), hidden=128, layers=3, n_rbf=20, cutoff=5.0)
    walled = make_student(species=list(G2_SPECIES), hidden=128, layers=3, n_rbf=20, cutoff=5.0)
    walled.set_repulsion(shipped.repulsion_radii(walled.species_list))
    rows = {
        "benzene step µs": lambda m: _step_us(m, [_benzene()], mode="cudagraph"),
        "benzene ASE MD step µs": lambda m: _md(m, args.md_steps),
        "g2 ×1,024 µs / structure": lambda m: _step_us(m, g2_batch(1024), mode="cudagraph") / 1024,
        "g2 ×4,096 µs / structure": lambda m: _step_us(m, g2_batch(4096), mode="cudagraph") / 4096,
        "water 3,000 atoms ms": lambda m: _step_us(m, [water_box(3000, seed=0)], mode="auto") / 1e3,
        "water 24,000 atoms ms (eager)": lambda m: _step_us(m, [water_box(24000, seed=0)], mode="eager") / 1e3,
    }
    lines = [
        "# The ZBL wall's cost in the step (bench_repulsion.py)",
        "",
        f"{torch.cuda.get_device_name()} · torch {torch.__version__} · triton {triton.__version__} · "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        "Random-weight 128 × 3 student (the 14 g2 species), fp32, with and without the wall, alternating in one "
        f"process: {args.passes} passes, each the median of a timed run; the table gives the median pass.",
        "",
        "| row | without | with the wall | with / without | passes without | passes with |",
        "|---|---:|---:|---:|---|---|",
    ]
    for name, fn in rows.items():
        t0 = time.perf_counter()
        without, with_ = [], []
        for _ in range(args.passes):
            without.append(fn(bare))
            with_.append(fn(walled))
        a, b = statistics.median(without), statistics.median(with_)
        lines.append(
            f"| {name} | {a:.3f} | {b:.3f} | {b / a:.3f} | {', '.join(f'{x:.3f}' for x in without)} | "
            f"{', '.join(f'{x:.3f}' for x in with_)} |"
        )
        print(lines[-1], f"({time.perf_counter() - t0:.0f} s)", flush=True)
    lines += ["", "| op | median |", "|---|---:|", *_op_rows(walled, g2_batch(4096))]
    print("\n".join(lines[-2:]), flush=True)
    print(f"wrote {write_lines(lines, args.out, args.name)}")


if __name__ == "__main__":
    main()
