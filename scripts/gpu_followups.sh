#!/usr/bin/env bash
# The GPU work stop 40 left for the next session (device machine, repository root; carry .whl):
#   bash scripts/gpu_followups.sh large+relax   # ~6 min: bench_large at 3,000 / 24,000 water atoms with the fold
#                                               #   shipped (the README's large rows are stop 27's), then
#                                               #   probe_relax_first_call.py (where a relaxation's first call goes)
#   bash scripts/gpu_followups.sh autotune      # ~8 min: compile max-autotune for H2, H2O, CH4 and benzene
#                                               #   (stop 40 timed benzene only: its first call autotuned for 330 s,
#                                               #   the others share its bucket and its autotuning cache)
# Each part has its own time limit and writes under $OUT; the tables' tails are printed.
set -uo pipefail
source scripts/device_env.sh
case "${1:-}" in
  large+relax)
    timeout 200 python3 benchmarks/bench_large.py --out "$OUT/large" --budget-s 180 --sections check,ef \
      --sizes 3000 24000 >"$OUT/bench_large.log" 2>&1
    grep -E "^\| " "$OUT/large/bench_large.md" | head -12
    timeout 150 python3 benchmarks/probe_relax_first_call.py --structures 16384 \
      --settings "capture_after=0,capture_after=1" --out "$OUT" >"$OUT/probe_relax_first_call.log" 2>&1
    tail -6 "$OUT/probe_relax_first_call.log"
    ;;
  autotune)
    timeout 560 python3 benchmarks/bench_engine.py --sections latency --variants "=compile max-autotune" \
      --budget-s 550 --out "$OUT" --name engine_h100_autotune_all >"$OUT/bench_engine.log" 2>&1
    grep -E "max-autotune|reference" "$OUT/engine_h100_autotune_all.md" | head -10
    ;;
  *) echo "usage: bash scripts/gpu_followups.sh large+relax|autotune" >&2; exit 2 ;;
esac
echo "total ${SECONDS}s"
