#!/usr/bin/env bash
# A/B of the edge backward's feature split (bwd_edge_split "auto" vs 1) in the MD-step profile (profile_step.py
# sections water and small), one process each, after scripts/gpu_session.sh installed the wheels (/tmp/site).
# Output: $OUT/ab_edge_split/{auto,1}.log
set -uo pipefail
out=${OUT:-/tmp}/ab_edge_split
mkdir -p "$out"
for split in 1 auto; do
  PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} timeout "${AB_BOX:-150}" python3 - "$split" "$out" <<'PY' >"$out/$split.log" 2>&1
import runpy, sys
split, out = sys.argv[1], sys.argv[2]
import mlff_distiller.kernels.message_passing as mp
mp._CONFIG["bwd_edge_split"] = split if split == "auto" else int(split)
sys.argv = ["profile_step.py", "--out", out + "/" + split, "--sections", "water,small"]
runpy.run_path("benchmarks/profile_step.py", run_name="__main__")
PY
  echo "== bwd_edge_split=$split"; grep -E "=====|device kernels" "$out/$split.log" | head -12
done
