"""Whole-model energy + forces with kernel backend ``triton`` vs ``torch`` (same weights, same graph, one run).

Systems: benzene, a batch of 1,024 small g2 molecules, a 3,000-atom water box. Two timings per backend: the
model + one ``autograd.grad`` on a prebuilt graph (what the kernels change), and the whole ``ForceEngine.compute``
(neighbour list included). Also checks the two backends agree before timing.

    python benchmarks/bench_model.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import environment, time_fn
from mlff_distiller.kernels import use_backend
from systems import g2_chno, water_box

from mlff_distiller import AtomsBatch, ForceEngine, StudentModel
from mlff_distiller.neighbors import neighbor_list


def _systems(quick: bool):
    from ase.build import molecule

    yield "benzene", [molecule("C6H6")]
    yield "g2 x1024", g2_chno(64 if quick else 1024)
    yield "water 3000", [water_box(300 if quick else 3000)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="small systems (CPU smoke run)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = StudentModel()  # issue defaults: hidden 128, 3 layers, 20 rbf, 5 Å
    engine = ForceEngine(model, device=device, precision="fp32")
    env = environment(device, float("nan"))
    rows = []
    for name, structures in _systems(args.quick):
        batch = AtomsBatch.from_atoms(structures, dtype=torch.float32).to(device)
        nl = neighbor_list(batch.positions, batch.cell, batch.pbc, batch.batch, batch.ptr, model.cutoff)
        m = engine.model

        def model_step(batch=batch, nl=nl, m=m):
            pos = batch.positions.detach().requires_grad_(True)
            e = m(batch.numbers, pos, nl.edge_index, nl.shift_vectors, batch.batch, batch.num_structures)["energy"]
            (g,) = torch.autograd.grad(e.sum(), pos)
            return e, g

        res = {}
        for backend in ("torch", "triton"):
            if backend == "triton" and device.type != "cuda":
                continue
            with use_backend(backend):
                e, g = model_step()
                res[backend] = {
                    "energy": e.detach(),
                    "forces": -g,
                    "model_us": time_fn(model_step, device).median_us,
                    "engine_us": time_fn(lambda b=batch: engine.compute(b), device).median_us,
                }
        row = {
            "system": name,
            "atoms": batch.num_atoms,
            "structures": batch.num_structures,
            "edges": int(nl.edge_index.shape[1]),
        }
        for backend, r in res.items():
            row[f"{backend}_model_us"] = r["model_us"]
            row[f"{backend}_engine_us"] = r["engine_us"]
        if "triton" in res:
            t, r = res["triton"], res["torch"]
            row["max_rel_energy_diff"] = float(((t["energy"] - r["energy"]).abs() / r["energy"].abs()).max())
            row["max_abs_force_diff"] = float((t["forces"] - r["forces"]).abs().max())
            row["speedup_model"] = r["model_us"] / t["model_us"]
            row["speedup_engine"] = r["engine_us"] / t["engine_us"]
        rows.append(row)
        print(json.dumps(row), flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    tag = "cpu" if device.type == "cpu" else "gpu"
    header = f"{env.device} · torch {env.torch} · triton {env.triton} · commit {env.commit}"
    lines = [
        "# bench_model: StudentModel (128/3/20/5 Å) energy+forces, kernels triton vs torch, fp32",
        "",
        header,
        "",
        "| system | atoms | edges | torch model µs | triton model µs | speed-up | torch engine µs "
        "| triton engine µs | speed-up | max rel ΔE | max |ΔF| eV/Å |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:

        def f(k, spec=".1f", r=r):
            return format(r[k], spec) if k in r else "—"

        lines.append(
            f"| {r['system']} | {r['atoms']} | {r['edges']} | {f('torch_model_us')} | {f('triton_model_us')} "
            f"| {f('speedup_model', '.2f')} | {f('torch_engine_us')} | {f('triton_engine_us')} "
            f"| {f('speedup_engine', '.2f')} | {f('max_rel_energy_diff', '.1e')} | {f('max_abs_force_diff', '.1e')} |"
        )
    (args.out / f"bench_model_{tag}.md").write_text("\n".join(lines) + "\n")
    with (args.out / f"bench_model_{tag}.jsonl").open("a") as fh:
        for r in rows:
            fh.write(json.dumps({**r, "env": env.__dict__}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
