import copy

import torch
from torch import nn

from mlff_distiller import load_model
from mlff_distiller.distill.evaluation import error_metrics, predict_frames
from mlff_distiller.distill.labelling import read_frames

frames = read_frames("/tmp/lbl/test_labels")


def round_bf16(m):
    for mod in m.modules():
        if isinstance(mod, nn.Linear):
            with torch.no_grad():
                mod.weight.copy_(mod.weight.to(torch.bfloat16).to(torch.float32))


for name in ("builtin:chno-gfn2", "builtin:chno-gfn2-small"):
    m = load_model(name)
    b = copy.deepcopy(m)
    round_bf16(b)
    for label, model in (("TF32 grid (shipped)", m), ("bf16 grid", b)):
        met = error_metrics(frames, predict_frames(model, frames, device="cpu", precision="fp32"))
        print(
            name,
            label,
            {k: round(met[k], 4) for k in ("energy_mae_mev_atom", "force_mae_mev_a", "force_rmse_mev_a")},
            flush=True,
        )
