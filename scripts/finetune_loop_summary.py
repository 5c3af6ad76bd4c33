"""The table of ``scripts/finetune_loop.sh``: what each step of one fine-tuning round did (its JSON summaries in OUT).

python scripts/finetune_loop_summary.py OUT > OUT/summary.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _load(out: Path, name: str) -> dict:
    return json.loads((out / name).read_text())


def main(out: Path) -> None:
    labelled, train = _load(out, "label.json"), _load(out, "train.json")
    print("# One fine-tuning round from hot MD (scripts/finetune_loop.sh)\n")
    if (out / "harvest.json").exists():
        harvest = _load(out, "harvest.json")
        print(
            f"- harvest: {harvest['frames_read']} frames of {harvest['trajectories']} trajectories; first bad frame "
            f"frozen in {harvest['frozen']}, outside the envelope in {harvest['outside']}, non-finite in "
            f"{harvest['nonfinite']}; {harvest['frames_written']} frames picked"
        )
    else:
        print("- harvest: the frames picked by an earlier run (PICKED)")
    print(
        f"- label --as-given (GFN2-xTB): {labelled['written']} frames written, {labelled['duplicates']} "
        f"near-duplicates dropped, {labelled.get('failed', 0)} the teacher could not do, {labelled['seconds']:.1f} s; "
        "the others "
        "were dropped as unphysical (teacher force above max_force or a pair closer than 0.5 Å)"
    )
    best = train["best_val"]
    weight_file = out / "round_weight.txt"  # written since stop 39 (before, the round was weighted 1)
    weight = weight_file.read_text().strip() if weight_file.exists() else "1 (unweighted)"
    print(
        f"- fine-tune from builtin:chno-gfn2, the round weighted {weight} (--data-weight): {train['steps']} steps in "
        f"{train['seconds']:.0f} s; validation force MAE "
        f"{best['force_mae_mev_a']:.2f} meV/Å, energy MAE {best['energy_mae_mev_atom']:.3f} meV/atom\n"
    )
    print("| frames | student | force MAE (meV/Å) | force RMSE | energy MAE (meV/atom) |")
    print("|---|---|---:|---:|---:|")
    for data, label in (("heldout", "held-out test (300-800 K, 1,830 frames)"), ("round1", "the labelled round")):
        for m, name in (("base", "builtin:chno-gfn2"), ("ft", "fine-tuned")):
            r = _load(out, f"{data}_{m}.json")
            print(
                f"| {label} | {name} | {r['force_mae_mev_a']:.2f} | {r['force_rmse_mev_a']:.2f} | "
                f"{r['energy_mae_mev_atom']:.3f} |"
            )
    hot = [(run, m) for run in ("base", "ft") for m in ("base", "ft") if (out / f"hot_{run}_{m}.json").exists()]
    names = {"base": "builtin:chno-gfn2", "ft": "fine-tuned"}
    for run, m in hot:
        r, lab = _load(out, f"hot_{run}_{m}.json"), _load(out, f"hotlabel_{run}.json")
        print(
            f"| {r['frames']} frames of the {names[run]} student's hot MD (labelled: {lab['written']}) | {names[m]} | "
            f"{r['force_mae_mev_a']:.2f} | {r['force_rmse_mev_a']:.2f} | {r['energy_mae_mev_atom']:.3f} |"
        )
    print("\n| hot MD seed | student | replicas | frozen | seconds |")
    print("|---:|---|---:|---:|---:|")
    for seed in (0, 1, 2):
        for m, name in (("base", "builtin:chno-gfn2"), ("ft", "fine-tuned")):
            path = out / f"md_{m}_seed{seed}.json"
            if path.exists():
                r = json.loads(path.read_text())
                print(f"| {seed} | {name} | {r['replicas']} | {len(r['frozen'])} | {r['seconds']:.1f} |")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
