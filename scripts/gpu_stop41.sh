#!/usr/bin/env bash
# Stop 41's last GPU call (device machine, repository root; .whl carried): relax_file's array path on CUDA (tests),
# probe_relax_file.py with stop 40's path through ASE's reader beside it, and where a relaxation's first call goes
# in a fresh process: probe_relax_first_call.py twice in two processes sharing one empty Triton cache (the first
# process compiles, the second finds the kernels compiled). Everything lands in $OUT.
set -uo pipefail
source scripts/device_env.sh
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_relax_stream.py tests/test_batched_relax.py \
  >"$OUT/pytest_relax.log" 2>&1; tail -1 "$OUT/pytest_relax.log"
timeout 200 python3 benchmarks/probe_relax_file.py --structures 16384 --chunks 8192,4096 --reps 2 --ase-path \
  --out "$OUT" --name probe_relax_file >"$OUT/probe_relax_file.log" 2>&1; grep -E "^\| " "$OUT/probe_relax_file.log" | tail -6
export TRITON_CACHE_DIR=/tmp/triton_cold_$$ TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cold_$$
for run in cold warm; do
  timeout 90 python3 benchmarks/probe_relax_first_call.py --structures 16384 --settings capture_after=0 \
    --out "$OUT" --name "probe_relax_first_call_$run" >"$OUT/probe_relax_first_call_$run.log" 2>&1
  echo "$run cache:"; grep -E "^\| capture" "$OUT/probe_relax_first_call_$run.md"
done
echo "total ${SECONDS}s"
