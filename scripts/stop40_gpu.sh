#!/usr/bin/env bash
# Stop 40's one GPU call (device machine, repository root; .whl carried): the fold_xb sweep of the whole step
# against the shipped kernels (and a no-op variant for the spread), the folded kernels' CUDA tests, relax_file on
# CUDA (tests and probe_relax_file.py), then the GPU-marked tests outside tests/kernels. Everything lands in $OUT.
set -uo pipefail
source scripts/device_env.sh
git log --oneline -1 2>/dev/null | tee "$OUT/tree.txt"
timeout 200 python3 benchmarks/probe_ncu.py --mode sweep --systems water3000,water24000,g2x4096 \
  --variants "mp:fold_xb_min_edges=0;mp:seg_split=1;mp:fold_xb_min_edges=0" --budget-s 170 --out "$OUT" \
  >"$OUT/sweep.log" 2>&1
grep -E "^\| " "$OUT/sweep.log" | tail -12
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_message_passing.py tests/kernels/test_message_passing_launch.py \
  -k "fold or large_water or v_zero" >"$OUT/pytest_fold.log" 2>&1; tail -2 "$OUT/pytest_fold.log"
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_relax_stream.py >"$OUT/pytest_relax_stream.log" 2>&1
tail -1 "$OUT/pytest_relax_stream.log"
timeout 150 python3 benchmarks/probe_relax_file.py --structures 16384 --chunks 8192,4096 --reps 2 --out "$OUT" \
  >"$OUT/probe_relax_file.log" 2>&1; tail -6 "$OUT/probe_relax_file.log"
left=$(( ${LIMIT_S:-560} - SECONDS - 10 ))
[ "$left" -gt 60 ] && timeout "$left" python3 -m pytest -q -p no:cacheprovider -m gpu tests --ignore=tests/kernels \
  >"$OUT/pytest_gpu_nonkernel.log" 2>&1; tail -2 "$OUT/pytest_gpu_nonkernel.log"
echo "total ${SECONDS}s"
