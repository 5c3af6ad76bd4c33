import copy
import json

from mlff_distiller import load_model
from mlff_distiller.distill.evaluation import error_metrics, predict_frames
from mlff_distiller.distill.labelling import read_frames

frames = read_frames("/tmp/lbl/test_labels")
out = {"frames": len(frames)}
for name in ("builtin:chno-gfn2", "builtin:chno-gfn2-small"):
    m = load_model(name)
    g = copy.deepcopy(m)
    n = g.round_weights_tf32()
    for label, model in (("as shipped", m), ("TF32 grid", g)):
        for prec in ("fp32", "fp64"):
            met = error_metrics(frames, predict_frames(model, frames, device="cpu", precision=prec))
            row = {
                k: met[k]
                for k in (
                    "energy_mae_mev_atom",
                    "energy_rmse_mev_atom",
                    "force_mae_mev_a",
                    "force_rmse_mev_a",
                    "frames",
                )
            }
            out[f"{name} | {label} | {prec}"] = row
            print(
                name, label, prec, {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}, flush=True
            )
json.dump(out, open("/tmp/eval_grid.json", "w"), indent=1)
