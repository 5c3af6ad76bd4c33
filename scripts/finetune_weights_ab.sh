#!/usr/bin/env bash
# Loss weights and the Huber loss on one fine-tuning round (docs/distillation.md, "Fine-tune where the student
# fails"): the same labelled round, split by trajectory into a trained half and a held-out half of hot frames
# (scripts/split_round.py), and builtin:chno-gfn2 fine-tuned on the original labels + the trained half under each
# VARIANT, each for the same wall-clock time; then every student on the held-out 300-800 K frames and on the held-out
# hot frames.
#
#   bash scripts/finetune_weights_ab.sh LABELS TEST ROUND PICKED OUT [TIME_LIMIT_S]
#
# LABELS / TEST: builtin:chno-gfn2's training and held-out labels (configs/chno_gfn2_label.yaml / _test.yaml).
# ROUND: `mlff-distill label --seeds PICKED --as-given` of a harvest's frames PICKED (e.g.
# benchmarks/results/finetune_loop_h100/run2/picked.extxyz). VARIANTS: "name|extra train options" entries, ';'-separated,
# run in that order; COMMON: train options of all of them. HOT_SEED: also each student's hot MD (frozen replicas).
set -euo pipefail
LABELS=$1
TEST=$2
ROUND=$3
PICKED=$4
OUT=$5
LIMIT=${6:-120}
LR=${LR:-2e-4}
WORK=${WORK:-/tmp/finetune_ab}
VARIANTS=${VARIANTS:-"unweighted|;hot 0.2|--data-weight 1 --data-weight 0.2;huber|--set train.loss=huber"}
COMMON=${COMMON:-}  # train options of every variant, e.g. "--set train.seed=1"
HOT_SEED=${HOT_SEED:-}  # set: each student (and the shipped one) also runs finetune_loop.sh's hot MD with this seed
mkdir -p "$OUT" "$WORK"
stamp() { echo "$(date -u +%T) $*" >&2; }
python3 scripts/split_round.py "$ROUND" "$PICKED" "$WORK/round_train.extxyz" "$WORK/round_test.extxyz" | tee "$OUT/split.txt"
if [ -n "$HOT_SEED" ]; then
  python3 -c "import ase.io; from mlff_distiller.distill.seeds import g2_chno; ase.io.write('$WORK/g2.xyz', g2_chno())"
fi
hot() {  # model tag: 16 replicas of each of the 61 g2 molecules, 2,000 K, 6,000 steps, frozen above 100 eV/Å
  [ -n "$HOT_SEED" ] || return 0
  mlff-distill md --model "$1" --input "$WORK/g2.xyz@:" --replicas 16 --temperature 2000 --steps 6000 \
    --interval 100 --freeze-force 100 --seed "$HOT_SEED" --output "$WORK/hot_$2.extxyz" > "$OUT/md_$2.json"
}
evaluate() {  # model tag
  mlff-distill evaluate --model "$1" --data "$TEST" --out "$WORK/eval_$2_test" --set precision=fp32 > /dev/null
  cp "$WORK/eval_$2_test/metrics.json" "$OUT/heldout_$2.json"
  mlff-distill evaluate --model "$1" --data "$WORK/round_test.extxyz" --out "$WORK/eval_$2_hot" --set precision=fp32 \
    > /dev/null
  cp "$WORK/eval_$2_hot/metrics.json" "$OUT/hot_$2.json"
}
stamp "evaluate builtin:chno-gfn2"
evaluate builtin:chno-gfn2 base
hot builtin:chno-gfn2 base
IFS=';' read -ra items <<< "$VARIANTS"
for item in "${items[@]}"; do
  name=${item%%|*}
  extra=${item#*|}
  tag=$(echo "$name" | tr -c 'A-Za-z0-9\n' '_')
  stamp "fine-tune: $name ($LIMIT s)"
  # shellcheck disable=SC2086
  mlff-distill train --config configs/chno_gfn2_train.yaml --data "$LABELS" --data "$WORK/round_train.extxyz" \
    --init-model builtin:chno-gfn2 --out "$WORK/ft_$tag" --set train.time_limit_s="$LIMIT" --set train.lr="$LR" \
    --set train.warmup_steps=200 --set train.eval_every=1000 $COMMON $extra > "$OUT/train_$tag.json"
  evaluate "$WORK/ft_$tag/best.pt" "$tag"
  hot "$WORK/ft_$tag/best.pt" "$tag"
  echo "$tag|$name|$extra" >> "$OUT/variants.txt"
done
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = [("base", "builtin:chno-gfn2 (not fine-tuned)", "")]
rows += [tuple(line.split("|", 2)) for line in (out / "variants.txt").read_text().splitlines()]
hot = (out / "md_base.json").exists()
print("| student | held-out 300-800 K: force MAE (meV/Å) | RMSE | energy MAE (meV/atom) "
      "| held-out hot frames: force MAE | RMSE | energy MAE | training steps |"
      + (" hot MD: replicas frozen |" if hot else ""))
print("|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if hot else ""))
for tag, name, extra in rows:
    h = json.loads((out / f"heldout_{tag}.json").read_text())
    t = json.loads((out / f"hot_{tag}.json").read_text())
    steps = ""
    if (out / f"train_{tag}.json").exists():
        steps = json.loads((out / f"train_{tag}.json").read_text()).get("steps", "")
    label = name + (f" (`{extra.strip()}`)" if extra.strip() else "")
    frozen = ""
    if hot:
        md = json.loads((out / f"md_{tag}.json").read_text())
        frozen = f" {len(md['frozen'])} of {md['replicas']} |"
    print(f"| {label} | {h['force_mae_mev_a']:.2f} | {h['force_rmse_mev_a']:.2f} | {h['energy_mae_mev_atom']:.3f} "
          f"| {t['force_mae_mev_a']:.1f} | {t['force_rmse_mev_a']:.1f} | {t['energy_mae_mev_atom']:.2f} | {steps} |"
          + frozen)
PY
