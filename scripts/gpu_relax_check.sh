#!/usr/bin/env bash
# Stop 35's last device call: the CUDA tests of BatchedMD / relax_batch / the md command's frames, then
# bench_batched_relax.py. Run from the repository root on the device with .whl carried; results land in $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1
OUTDIR=${OUT:-/tmp/out}; mkdir -p "$OUTDIR"
timeout 150 python3 -m pytest -v -p no:cacheprovider --timeout=140 --tb=short tests/test_batched_md.py \
  tests/test_batched_relax.py >"$OUTDIR/pytest_gpu.log" 2>&1
grep -cE " PASSED" "$OUTDIR/pytest_gpu.log"; grep -E " (FAILED|ERROR)" "$OUTDIR/pytest_gpu.log" | head; tail -1 "$OUTDIR/pytest_gpu.log"
timeout 120 python3 benchmarks/bench_batched_relax.py --out "$OUTDIR" >"$OUTDIR/bench_relax.log" 2>&1
grep -E "^\| |ASE's" "$OUTDIR/bench_relax.log"; tail -2 "$OUTDIR/bench_relax.log"
