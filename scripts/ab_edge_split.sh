#!/usr/bin/env bash
# A/B of the edge backward's feature split (bwd_edge_split 1 vs "auto"): profile_step.py (sections water, small)
# and, with AB_MDSPEED=1 (needs sevenn), bench_md_speed.py, one process each, after scripts/gpu_session.sh
# installed the wheels into /tmp/site. Output: $OUT/ab_edge_split/<split>/ and <split>.log.
set -uo pipefail
out=${OUT:-/tmp}/ab_edge_split
mkdir -p "$out"
run() {  # run <split> <script> <args...>: the script under runpy with _CONFIG["bwd_edge_split"] set first
  local split=$1; shift
  PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} timeout "${AB_BOX:-150}" python3 - "$split" "$@" <<'PY'
import importlib, runpy, sys
split, script, args = sys.argv[1], sys.argv[2], sys.argv[3:]
mp = importlib.import_module("mlff_distiller.kernels.message_passing")
mp._CONFIG["bwd_edge_split"] = split if split == "auto" else int(split)
sys.argv = [script, *args]
runpy.run_path(script, run_name="__main__")
PY
}
for split in 1 auto; do
  mkdir -p "$out/$split"
  run "$split" benchmarks/profile_step.py --out "$out/$split" --sections water,small >"$out/$split.log" 2>&1
  if [ -n "${AB_MDSPEED:-}" ]; then
    run "$split" benchmarks/bench_md_speed.py --out "$out/$split/md_speed" >>"$out/$split.log" 2>&1
  fi
  echo "== bwd_edge_split=$split"; grep -E "=====|device kernels|median ms|student \||sevennet-0 \||Speed-up" "$out/$split.log" | head -16
done
