"""How ``relax_batch``'s streaming settings trade off (a probe): the batch's atom budget (``max_atoms``) and when
finished structures are replaced (``batched_relax.REFILL_AT``, the fraction of the batch done), on one set of
rattled g2 molecules, the engine kept, each setting timed once after a warm-up call.

    python benchmarks/probe_relax_stream.py --out benchmarks/results --name probe_relax_stream_h100
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_batched_relax import rattled
from harness import environment, sync, write_lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--name", default="probe_relax_stream_h100")
    ap.add_argument("--structures", type=int, default=16384)
    ap.add_argument("--budgets", default="16384,32768,65536")
    ap.add_argument("--refill", default="0.1,0.25,0.5")
    args = ap.parse_args()
    import mlff_distiller.batched_relax as br
    from mlff_distiller import load_model
    from mlff_distiller.engine import ForceEngine

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    env = environment(device, 0.0)
    model = load_model("builtin:chno-gfn2")
    structures = rattled(args.structures)
    atoms = sum(len(a) for a in structures)
    lines = [
        "# relax_batch streaming settings (probe_relax_stream.py)",
        "",
        f"{env.device} · torch {env.torch} · Triton {env.triton} · commit {env.commit} · builtin:chno-gfn2, fp32",
        "",
        f"{args.structures} rattled g2 molecules ({atoms} atoms), fmax 0.05, the engine kept; one timed call per "
        "setting after a warm-up call on 256 of them. Calls: the engine calls (steps of the batch).",
        "",
        "| max_atoms | REFILL_AT | seconds | ms per structure | engine calls |",
        "|---:|---:|---:|---:|---:|",
    ]
    for budget in [int(x) for x in args.budgets.split(",")]:
        for refill in [float(x) for x in args.refill.split(",")]:
            br.REFILL_AT = refill
            br.relax_batch(model, structures[:256], device=device, max_atoms=budget)
            calls = []
            real = ForceEngine.compute
            ForceEngine.compute = _counting(real, calls)
            try:
                sync(device)
                t0 = time.perf_counter()
                br.relax_batch(model, structures, device=device, max_atoms=budget)
                sync(device)
                seconds = time.perf_counter() - t0
            finally:
                ForceEngine.compute = real
            lines.append(
                f"| {budget} | {refill} | {seconds:.3f} | {1e3 * seconds / len(structures):.3f} | {len(calls)} |"
            )
            print(lines[-1], flush=True)
    write_lines(lines, args.out, args.name)


def _counting(compute, calls: list):
    def counted(self, batch, **kw):
        calls.append(1)
        return compute(self, batch, **kw)

    return counted


if __name__ == "__main__":
    main()
