"""Stop 35: where relax_batch's NaN on 1,024 rattled g2 molecules (H100, fp32) comes from. Runs the FIRE loop with a
check per step; on the first non-finite force or position, names the structure and recomputes it alone."""

import sys
import warnings

import numpy as np
import torch

warnings.simplefilter("ignore")
sys.path.insert(0, "benchmarks")
from bench_batched_relax import rattled  # noqa: E402

import mlff_distiller.batched_relax as br  # noqa: E402
from mlff_distiller import load_model, predict_forces  # noqa: E402

model = load_model("builtin:chno-gfn2")
S = rattled(int(sys.argv[1]) if len(sys.argv) > 1 else 1024)
real_compute = None
state = {"k": 0}


def patched(engine_factory):
    def make(*a, **kw):
        eng = engine_factory(*a, **kw)
        orig = eng.compute

        def compute(batch, **k2):
            out = orig(batch, **k2)
            f = out["forces"]
            bad_pos = ~torch.isfinite(batch.positions).all(dim=1)
            bad_f = ~torch.isfinite(f).all(dim=1)
            if bool(bad_pos.any()) or bool(bad_f.any()):
                atoms = torch.nonzero(bad_f | bad_pos).flatten()
                s = batch.batch[atoms].unique().tolist()
                print(
                    "step",
                    state["k"],
                    "non-finite: structures",
                    s[:10],
                    "pos bad",
                    int(bad_pos.sum()),
                    "forces bad",
                    int(bad_f.sum()),
                    "builds",
                    eng.verlet.n_builds,
                    flush=True,
                )
                ptr = batch.ptr.cpu().numpy()
                for k in s[:3]:
                    a = S[k].copy()
                    a.positions = batch.positions[ptr[k] : ptr[k + 1]].cpu().numpy()
                    d = a.get_all_distances()
                    print(
                        " structure",
                        k,
                        a.get_chemical_formula(),
                        "min distance",
                        float(d[d > 0].min()) if (d > 0).any() else None,
                        flush=True,
                    )
                    alone = predict_forces(model, [a], device="cuda")[0]
                    print("  alone on cuda: finite", bool(np.isfinite(alone["forces"]).all()), flush=True)
                    e = eng.verlet.last
                    i = e.edge_index[0]
                    mine = batch.batch[i] == k
                    print("  edges in list", int(mine.sum()), "bucket", eng.last_bucket, flush=True)
                sys.exit(0)
            state["k"] += 1
            return out

        eng.compute = compute
        return eng

    return make


br.batch_engine = patched(br.batch_engine)
out = br.relax_batch(model, S, fmax=0.05, steps=1000, device="cuda")
print("no NaN:", sum(a.info["relax_converged"] for a in out), "converged", flush=True)
