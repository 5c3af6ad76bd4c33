"""Stop 85: install stop85a's 64 x 3 student (new64a) as ``builtin:chno-gfn2-small``, with the metadata the shipped
students carry. Run from the repository root after unpacking stop85a's s85.tgz into /tmp/r85:

    python benchmarks/results/stop85_gpu/install_small.py /tmp/r85/s85/a/chno-gfn2-85a.pt

* the weights and config as trained (the trainer rounded its nn.Linear weights onto the TF32 grid);
* ``domain``: the trainer's envelope of the training split, computed again here on the CPU from the same labels
  (runs/chno_gfn2, relabelled at stop 85 on the 2-core development CPU: 14,117 frames, 1,133 duplicates, as at stops
  22 and 30) and the same split (val_fraction 0.05, split_seed 0); its repulsion radii (0.9 x the shortest pairs)
  equal the checkpoint's wall bit for bit, which this script checks;
* the held-out errors of the same-run table (``a/compare_students.json``, H200, fp32).
"""

import json
import sys
from pathlib import Path

import torch

from mlff_distiller import load_model
from mlff_distiller.distill import read_frames, split_frames
from mlff_distiller.distill.dataset import FrameDataset
from mlff_distiller.domain import DomainEnvelope

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]


def main(src: str) -> None:
    model = load_model(src)
    assert (model.config.hidden, model.config.layers) == (64, 3) and model.on_tf32_grid()
    frames = read_frames(ROOT / "runs/chno_gfn2/train_labels")
    train, _ = split_frames(frames, 0.05, seed=0)
    domain = DomainEnvelope.from_dataset(FrameDataset(train, model.config.cutoff, device="cpu", dtype=torch.float32))
    radii = domain.repulsion_radii(model.species_list)
    wall = {(a, b): r for a, b, r in model.config.repulsion}
    got = {tuple(k): r for k, r in radii.items()}
    assert got.keys() == wall.keys() and all(abs(got[k] - wall[k]) <= 1e-12 for k in wall), (got, wall)
    test = json.loads((HERE / "a/compare_students.json").read_text())["students"]["new64a"]["all"]
    meta = dict(model.metadata)
    meta.update(
        description=(
            "PaiNN student (64 features x 3 layers) of GFN2-xTB on closed-shell CHNO molecules of ASE g2, 300-800 K; "
            "the default student since stop 85"
        ),
        recipe=(
            "stop 85 (scripts/gpu_followups.sh stop85a, T85=300): python examples/make_builtin_student.py --workers 2 "
            "--work runs/s85a --name chno-gfn2-85a --layers 3 --hidden 64 --time-limit 300, one of three trainings "
            "side by side on one H200 (10.4 ms a step there, 27,768 steps); labels relabelled on the 2-core "
            "development CPU (configs/chno_gfn2_label.yaml, chno_gfn2_test.yaml, 2 workers)"
        ),
        test_energy_mae_mev_atom=test["energy_mae_mev_atom"],
        test_energy_rmse_mev_atom=test["energy_rmse_mev_atom"],
        test_force_mae_mev_a=test["force_mae_mev_a"],
        test_force_rmse_mev_a=test["force_rmse_mev_a"],
        test_frames=test["frames"],
        domain=domain.to_dict(),
        domain_source=(
            "stop 85: the trainer's envelope of the training split (13,179 frames), computed again on the CPU from "
            "the same labels and split; its repulsion radii equal the trained wall"
        ),
        tf32_grid=True,
        tf32_grid_source="stop 85: the trainer's own rounding (TrainConfig.tf32_grid, 23 nn.Linear weights)",
        val_tf32_grid={"force_mae_mev_a": 13.774, "as_trained_force_mae_mev_a": 13.773},
        commit="2e125cc",
        replaces=(
            "the stop-22 student of the same size (121 s on an H100): held-out force MAE 19.46 meV/Å, RMSE 32.92, "
            "energy MAE 0.606 meV/atom (0.610 on the TF32 grid)"
        ),
    )
    out = ROOT / "src/mlff_distiller/data/chno-gfn2-small.pt"
    model.save(out, metadata=meta)
    back = load_model(out)
    assert back.metadata["test_force_mae_mev_a"] == test["force_mae_mev_a"]
    print(f"wrote {out} ({out.stat().st_size} bytes)")


if __name__ == "__main__":
    main(sys.argv[1])
