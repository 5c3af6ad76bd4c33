#!/usr/bin/env bash
# GPU work for a session (device machine, repository root; carry .whl): one recipe per device call, named by the
# stop that ran it (benchmarks/results/stop<N>_gpu/README.md says what each found). Recipes of stops 41-59 are in
# scripts/gpu_followups_archive.sh; a name not found here is handed to it.
# Each part has its own time limit and writes under $OUT; the tables' tails are printed.
set -uo pipefail
source scripts/device_env.sh

# The target rows (probe_student_size.py, both student widths), then bench_large.py's energy + forces at 3,000 and
# 24,000 atoms with its check against the torch reference. $1, $2: the two parts' time limits (s); $3: bench_large's
# budget (s).
rows() {
  timeout "$1" python3 benchmarks/probe_student_size.py --configs 128x3,64x3 --md-steps 300 --out "$OUT" \
    --name probe_student_size_h200 >"$OUT/probe_student_size.log" 2>&1
  grep -E "^\| " "$OUT/probe_student_size_h200.md" | tail -4
  timeout "$2" python3 benchmarks/bench_large.py --out "$OUT/large" --budget-s "$3" --sections check,ef \
    --sizes 3000 24000 >"$OUT/bench_large.log" 2>&1
  grep -E "ours|reference|check|pass|FAIL" "$OUT/bench_large.log" | tail -12
}

# Issue 5's MD row in three fresh processes (bench_engine's MD section): $1 student width, $2 the reports' name stem
# (engine_<stem><k>_h200.md), $3 / $4 each process's time limit / budget (s), $5 the logs' folder, $6 "rm": a log
# removed where its report came back (the device returns 8 files a call).
md_rows() {
  local k md log
  for k in 1 2 3; do
    md="$OUT/engine_$2${k}_h200.md"; log="$5/bench_engine_md$1_${k}.log"
    [ "$1" = 64 ] && log="$5/bench_engine_md${k}.log"
    timeout "$3" python3 benchmarks/bench_engine.py --hidden "$1" --sections md --budget-s "$4" --out "$OUT" \
      --name "engine_$2${k}_h200" >"$log" 2>&1
    grep -E "auto = cudagraph" "$md" || tail -5 "$log"
    [ "${6:-}" = rm ] && [ -f "$md" ] && rm -f "$log"
  done
}

# The -m gpu tests outside tests/kernels in two processes side by side (stop77c's gpu1 / gpu2 halves, split at
# tests/test_engine_modes.py); $1 each one's time limit (s); more pytest jobs of the caller's may run beside them.
gpu_halves() {
  local n1 n2
  n1=$(find tests -name 'test_*.py' -not -path 'tests/kernels/*' | sort | awk '$0 < "tests/test_engine_modes.py"' | tr '\n' ' ')
  n2=$(find tests -name 'test_*.py' -not -path 'tests/kernels/*' | sort | awk '$0 >= "tests/test_engine_modes.py"' | tr '\n' ' ')
  timeout "$1" python3 -m pytest -q -p no:cacheprovider -rs --tb=short -m gpu $n1 >"$OUT/pytest_gpu1.log" 2>&1 &
  timeout "$1" python3 -m pytest -q -p no:cacheprovider -rs --tb=short -m gpu $n2 >"$OUT/pytest_gpu2.log" 2>&1 &
}

case "${1:-}" in
  stop60)
    # The large-M GEMM against its ceiling (weights on the TF32 grid: ours with two MMAs and with one, cuBLAS TF32 and
    # strict fp32, the bytes / products floor), then Nsight Compute counters of the current step's Triton kernels
    # (registers, occupancy, stalls, L2 / DRAM): the last such reading was stop 19's, on the H100.
    timeout 150 python3 benchmarks/bench_gemm.py --ceiling --rows 3000 7200 22000 66000 --out "$OUT" \
      >"$OUT/bench_gemm_ceiling.log" 2>&1
    grep -hE "^\| " "$OUT/bench_gemm_ceiling.log" | head -40; tail -2 "$OUT/bench_gemm_ceiling.log"
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    echo "ncu: $NCU"
    secs=(--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats
          --section MemoryWorkloadAnalysis)
    for s in g2x4096 water24000; do
      timeout 170 "$NCU" --clock-control none --profile-from-start off -c 40 \
        -k "regex:_mp_|_gemm_kernel|_edge_bwd|_painn|_moments" "${secs[@]}" \
        --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
        --log-file "$OUT/ncu_$s.txt" python3 benchmarks/probe_ncu.py --mode ncu --step-mode eager --systems "$s" \
        >"$OUT/ncu_run_$s.log" 2>&1
      echo "ncu $s rc $?"; tail -3 "$OUT/ncu_run_$s.log"
    done
    python3 benchmarks/probe_ncu.py --mode summary "$OUT"/ncu_g2x4096.txt "$OUT"/ncu_water24000.txt \
      >"$OUT/ncu_summary.md" 2>&1
    head -70 "$OUT/ncu_summary.md"
    ;;
  stop60b)
    # The GEMM's 1-D grid with a row tile's column tiles side by side (linear._CONFIG["col_fast"]) and the readout's
    # tile sums (segsum_tile): CUDA cases of the GEMM tests, the GEMM against its ceiling again, then the whole step
    # with each off, and the large tiles again under the new order.
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_linear.py -k cuda \
      >"$OUT/pytest_linear_cuda.log" 2>&1; tail -3 "$OUT/pytest_linear_cuda.log"
    timeout 100 python3 benchmarks/bench_gemm.py --ceiling --rows 7200 22000 66000 --out "$OUT" \
      >"$OUT/bench_gemm_ceiling.log" 2>&1
    grep -hE "^\| " "$OUT/bench_gemm_ceiling.log" | head -40; tail -2 "$OUT/bench_gemm_ceiling.log"
    timeout 330 python3 benchmarks/probe_ncu.py --mode sweep --budget-s 315 --out "$OUT" \
      --systems benzene,water3000,g2x1024,g2x4096,water24000 \
      --variants "gemm:col_fast=0;gemm:segsum_tile=0;gemm:large=64x128x4;gemm:large=128x64x8" \
      >"$OUT/probe_ncu_sweep.log" 2>&1
    cp "$OUT/probe_ncu_sweep.md" "$OUT/probe_ncu_sweep_colfast.md"
    grep -hE "^\| " "$OUT/probe_ncu_sweep_colfast.md"; tail -2 "$OUT/probe_ncu_sweep.log"
    ;;
  stop60c)
    # The large-M GEMM through tensor descriptors (TMA loads and stores), one program per tile or persistent,
    # against the shipped kernel (benchmarks/probe_gemm_tma.py).
    timeout 400 python3 benchmarks/probe_gemm_tma.py --rows 7200 22000 --out "$OUT" >"$OUT/probe_gemm_tma.log" 2>&1
    grep -hE "^\| " "$OUT/probe_gemm_tma.log" | head -90; tail -3 "$OUT/probe_gemm_tma.log"
    ;;
  stop60d)
    # The large-M GEMM launches through tensor descriptors (linear._CONFIG["tma"], _gemm_tma_kernel): the GEMM
    # tests' CUDA cases (TMA against the element-wise kernel, bit for bit), then the whole step with it off, and
    # with it and the column-fast grid off (stop 59's GEMM).
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_linear.py -k "cuda or tma" \
      >"$OUT/pytest_linear_tma.log" 2>&1; tail -3 "$OUT/pytest_linear_tma.log"
    timeout 330 python3 benchmarks/probe_ncu.py --mode sweep --budget-s 315 --out "$OUT" \
      --systems benzene,water3000,g2x1024,g2x4096,water24000 \
      --variants "gemm:tma=0;gemm:tma=0+gemm:col_fast=0+gemm:segsum_tile=0" \
      >"$OUT/probe_ncu_sweep.log" 2>&1
    cp "$OUT/probe_ncu_sweep.md" "$OUT/probe_ncu_sweep_tma.md"
    grep -hE "^\| " "$OUT/probe_ncu_sweep_tma.md"; tail -2 "$OUT/probe_ncu_sweep.log"
    ;;
  stop60e)
    # With the GEMM's TMA launches: its tiles, K step and pipeline depth again (the descriptor loads change the
    # registers and shared memory they take), the GEMM tests' CUDA cases, and every GPU test outside tests/kernels.
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_linear.py -k "cuda or tma" \
      >"$OUT/pytest_linear_tma.log" 2>&1; tail -3 "$OUT/pytest_linear_tma.log"
    timeout 200 python3 benchmarks/probe_ncu.py --mode sweep --budget-s 185 --out "$OUT" \
      --systems water3000,g2x1024,g2x4096 \
      --variants "gemm:large=64x128x4;gemm:large_block_k=64;gemm:stages=4;gemm:stages=2;gemm:large=128x64x8" \
      >"$OUT/probe_ncu_sweep.log" 2>&1
    cp "$OUT/probe_ncu_sweep.md" "$OUT/probe_ncu_sweep_tmatiles.md"
    grep -hE "^\| " "$OUT/probe_ncu_sweep_tmatiles.md"; tail -2 "$OUT/probe_ncu_sweep.log"
    timeout 330 python3 -m pytest -q -p no:cacheprovider -m gpu tests --ignore=tests/kernels \
      >"$OUT/pytest_gpu_all.log" 2>&1; tail -5 "$OUT/pytest_gpu_all.log"
    ;;
  stop60f)
    # The rows at the stop's final code (the GEMM's column-fast grid, tile sums and TMA launches): every target row
    # for both student widths, then bench_large at 3,000 and 24,000 atoms with its check against the reference.
    rows 330 200 170
    ;;
  stop60g)
    # The message kernels' streamed edge data with "evict_first" (_triton_utils.STREAM_EVICT): their CUDA tests, then
    # A/B in separate processes (MLFF_DISTILLER_STREAM_EVICT=1 / 0, alternating, two rounds), each timing the step
    # twice (a no-op variant), and whether the compiled kernels carry the policy.
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_message_passing.py tests/kernels/test_message_passing_launch.py -k cuda \
      >"$OUT/pytest_mp_cuda.log" 2>&1; tail -2 "$OUT/pytest_mp_cuda.log"
    for r in 1 2; do
      for ev in 1 0; do
        mkdir -p "$OUT/ev${ev}_r$r"
        MLFF_DISTILLER_STREAM_EVICT=$ev timeout 140 python3 benchmarks/probe_ncu.py --mode sweep --budget-s 120 \
          --out "$OUT/ev${ev}_r$r" --systems water3000,g2x4096,water24000 --variants "gemm:segsum_tile=1" \
          >"$OUT/ev${ev}_r$r/sweep.log" 2>&1
        echo "== evict $ev round $r"; grep -hE "^\| (water|g2)" "$OUT/ev${ev}_r$r/probe_ncu_sweep.md"
      done
    done
    echo "ptx with evict_first: $(grep -l evict_first ~/.triton/cache/*/*.ptx 2>/dev/null | wc -l) of $(ls ~/.triton/cache/*/*.ptx 2>/dev/null | wc -l)"
    ;;
  stop60h)
    # Eager calls take the GEMM's descriptor launch only from tma_eager_min_rows rows on (its host cost): the GEMM
    # tests' CUDA cases, the host time of a launch either way (bench_gemm.py --host), and the eager steps with the
    # threshold at 0 and out of reach.
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_linear.py -k "cuda or tma" \
      >"$OUT/pytest_linear_tma.log" 2>&1; tail -2 "$OUT/pytest_linear_tma.log"
    timeout 120 python3 benchmarks/bench_gemm.py --host --rows 3000 22000 --out "$OUT" >"$OUT/bench_gemm_host.log" 2>&1
    grep -hE "^\| " "$OUT/bench_gemm_host.log"; tail -2 "$OUT/bench_gemm_host.log"
    timeout 200 python3 benchmarks/probe_ncu.py --mode sweep --step-mode eager --budget-s 185 --out "$OUT" \
      --systems water3000,g2x4096,water24000 \
      --variants "gemm:tma_eager_min_rows=0;gemm:tma_eager_min_rows=100000000" >"$OUT/probe_ncu_sweep.log" 2>&1
    cp "$OUT/probe_ncu_sweep.md" "$OUT/probe_ncu_sweep_eager_tma.md"
    grep -hE "^\| " "$OUT/probe_ncu_sweep_eager_tma.md"; tail -2 "$OUT/probe_ncu_sweep.log"
    ;;
  stop60i)
    # The final code (eager descriptor launches from 65,536 rows): the TMA tests on CUDA, bench_large at 3,000 and
    # 24,000 atoms, and the eager steps against the threshold at 16,384.
    timeout 100 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_linear.py \
      -k "tma_equals or eager_only or declines" >"$OUT/pytest_tma.log" 2>&1; tail -2 "$OUT/pytest_tma.log"
    timeout 200 python3 benchmarks/bench_large.py --out "$OUT/large" --budget-s 170 --sections check,ef \
      --sizes 3000 24000 >"$OUT/bench_large.log" 2>&1
    grep -E "ours|reference|check|pass|FAIL" "$OUT/bench_large.log" | tail -12
    timeout 120 python3 benchmarks/probe_ncu.py --mode sweep --step-mode eager --budget-s 100 --out "$OUT" \
      --systems g2x4096,water24000 --variants "gemm:tma_eager_min_rows=16384" >"$OUT/probe_ncu_sweep.log" 2>&1
    cp "$OUT/probe_ncu_sweep.md" "$OUT/probe_ncu_sweep_eager_threshold.md"
    grep -hE "^\| " "$OUT/probe_ncu_sweep_eager_threshold.md"; tail -2 "$OUT/probe_ncu_sweep.log"
    ;;
  tmalaunch)
    # For the next stop (not run at stop 60, whose device time was spent): the GEMM's shipped descriptor tile
    # launched three ways, host-side descriptors on the 1-D (shipped) and 2-D grids and descriptors made inside the
    # kernel (no host-side descriptor per launch), device and host µs beside kernels/linear.py's gemm().
    timeout 300 python3 benchmarks/probe_gemm_tma.py --launches --rows 3000 7200 22000 66000 --out "$OUT" \
      >"$OUT/probe_gemm_tma_launches.log" 2>&1
    grep -hE "^\| " "$OUT/probe_gemm_tma_launches.log"; tail -3 "$OUT/probe_gemm_tma_launches.log"
    ;;
  stop61b)
    # The message kernels' lean instructions (stop 61: dot_fin without the NaN guard, the segment sums' high part in
    # integer ops, the atom kernels' [BLOCK_E, BLOCK_F] accumulators summed once after the loop): new against old
    # code (lean_kernels.diff reversed) in separate processes, then launch variants the atom kernels now suit
    # (64-edge tiles on the warpgroup MMAs; the sender's register cap).
    D=benchmarks/results/stop61_gpu/lean_kernels.diff
    for v in new old; do
      [ "$v" = old ] && { patch -R -p1 -s <"$D" || echo "PATCH -R FAILED"; }
      mkdir -p "/tmp/ab_$v"
      timeout 150 python3 benchmarks/probe_ncu.py --mode sweep --budget-s 130 --out "/tmp/ab_$v" \
        --systems water3000,g2x4096,water24000 --variants "mp:seg_split=1" >"/tmp/ab_$v/sweep.log" 2>&1
      [ "$v" = old ] && patch -p1 -s <"$D"
      { echo "== code $v"; grep -hE "^\| (water|g2)" "/tmp/ab_$v/probe_ncu_sweep.md"; tail -2 "/tmp/ab_$v/sweep.log"; } \
        | tee -a "$OUT/ab_old_new.md"
    done
    A="mp:fwd_variant=atom,fwd_atom_block_e=64,fwd_atom_block_f=32"
    S="mp:block_e=64,block_f=32,bwd_sender_atom_maxnreg=0"
    timeout 260 python3 benchmarks/probe_ncu.py --mode sweep --budget-s 240 --out "$OUT" \
      --systems water3000,g2x4096,water24000 \
      --variants "$A;$S;mp:bwd_sender_atom_maxnreg=0;$A+$S" >"$OUT/probe_ncu_sweep.log" 2>&1
    grep -hE "^\| " "$OUT/probe_ncu_sweep.md"; tail -2 "$OUT/probe_ncu_sweep.log"
    ;;
  stop61c)
    # The lean dots alone (the atom kernels' after-loop sums went back, stop61b): the message kernels' and the TF32
    # grid's CUDA tests, then new against old code (lean_kernels.diff reversed) in separate processes, two rounds.
    timeout 280 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_message_passing.py tests/kernels/test_message_passing_launch.py \
      tests/kernels/test_tf32_grid.py -k "cuda or gpu or tf32_hi or dot_fin" >"$OUT/pytest_mp_cuda.log" 2>&1
    tail -2 "$OUT/pytest_mp_cuda.log"
    D=benchmarks/results/stop61_gpu/lean_kernels.diff
    for r in 1 2; do
      for v in new old; do
        [ "$v" = old ] && { patch -R -p1 -s <"$D" || echo "PATCH -R FAILED"; }
        mkdir -p "/tmp/ab_${v}_$r"
        timeout 150 python3 benchmarks/probe_ncu.py --mode sweep --budget-s 130 --out "/tmp/ab_${v}_$r" \
          --systems water3000,g2x4096,water24000 --variants "mp:seg_split=1" >"/tmp/ab_${v}_$r/sweep.log" 2>&1
        [ "$v" = old ] && patch -p1 -s <"$D"
        { echo "== code $v round $r"; grep -hE "^\| (water|g2)" "/tmp/ab_${v}_$r/probe_ncu_sweep.md";
          tail -1 "/tmp/ab_${v}_$r/sweep.log"; } | tee -a "$OUT/ab_old_new.md"
      done
    done
    ;;
  stop61d)
    # Which kernels the lean dots slow on water and speed on g2 (stop61c): one step's kernel table, new and old code.
    D=benchmarks/results/stop61_gpu/lean_kernels.diff
    for v in new old; do
      [ "$v" = old ] && { patch -R -p1 -s <"$D" || echo "PATCH -R FAILED"; }
      timeout 200 python3 benchmarks/probe_kernel_table.py --systems water24000,water3000,g2x4096 --out "$OUT" \
        --name "kernel_table_$v" >"$OUT/kernel_table_$v.log" 2>&1
      [ "$v" = old ] && patch -p1 -s <"$D"
      tail -3 "$OUT/kernel_table_$v.log"
    done
    ;;
  stop61e)
    # The edge backward's NaN guard per variant (edge_nan_guard "fold", shipped): its CUDA test and the message
    # kernels' CUDA cases, the whole step with the guard everywhere / nowhere, then bench_large's rows and check.
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_message_passing.py tests/kernels/test_message_passing_launch.py \
      tests/kernels/test_tf32_grid.py -k "nan_guard or seg_split or auto_sender or two_mmas or tf32_hi or dot_fin" \
      >"$OUT/pytest_mp_cuda.log" 2>&1; tail -2 "$OUT/pytest_mp_cuda.log"
    timeout 150 python3 benchmarks/probe_ncu.py --mode sweep --budget-s 130 --out "$OUT" \
      --systems water3000,g2x4096,water24000 --variants "mp:edge_nan_guard=True;mp:edge_nan_guard=False" \
      >"$OUT/probe_ncu_sweep.log" 2>&1
    grep -hE "^\| " "$OUT/probe_ncu_sweep.md"; tail -1 "$OUT/probe_ncu_sweep.log"
    timeout 200 python3 benchmarks/bench_large.py --out "$OUT/large" --budget-s 170 --sections check,ef \
      --sizes 3000 24000 >"$OUT/bench_large.log" 2>&1
    grep -E "ours|reference|check|pass|FAIL" "$OUT/bench_large.log" | tail -12
    ;;
  stop61f)
    # The edge backward's guard everywhere (1) / nowhere (0) against "fold" (stop61e's sweep passed the words as
    # strings), then the rows at the stop's final code, both student widths (probe_student_size: issue 5's rows).
    timeout 150 python3 benchmarks/probe_ncu.py --mode sweep --budget-s 130 --out "$OUT" \
      --systems water3000,g2x4096,water24000 --variants "mp:edge_nan_guard=1;mp:edge_nan_guard=0" \
      >"$OUT/probe_ncu_sweep.log" 2>&1
    grep -hE "^\| " "$OUT/probe_ncu_sweep.md"; tail -1 "$OUT/probe_ncu_sweep.log"
    timeout 330 python3 benchmarks/probe_student_size.py --configs 128x3,64x3 --md-steps 300 --out "$OUT" \
      --name probe_student_size_h200 >"$OUT/probe_student_size.log" 2>&1
    grep -E "^\| " "$OUT/probe_student_size_h200.md" | tail -4
    ;;
  stop61g)
    # The message kernels' tiles again after the lean dots: the block forward's edge tile and atom block, the block
    # sender's edge tile (g2), the atom sender's register cap and edge tile (water).
    timeout 420 python3 benchmarks/probe_ncu.py --mode sweep --budget-s 400 --out "$OUT" \
      --systems g2x4096,water3000,water24000,g2x1024 \
      --variants "mp:fwd_block_e=64;mp:fwd_block_a=32;mp:bwd_sender_block_e=32;mp:bwd_sender_atom_maxnreg=168;mp:bwd_sender_atom_maxnreg=0;mp:block_e=32" \
      >"$OUT/probe_ncu_sweep.log" 2>&1
    grep -hE "^\| " "$OUT/probe_ncu_sweep.md"; tail -1 "$OUT/probe_ncu_sweep.log"
    ;;
  stop61h)
    # The GEMM's two-MMA launches without dot_w's NaN guard (linear._CONFIG["nan_guard"] False, kernel dot
    # "tf32x2f"): its CUDA test (same bits), then the whole step with it, every row's system.
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_linear.py -k "nan_guard" \
      >"$OUT/pytest_linear_guard.log" 2>&1; tail -2 "$OUT/pytest_linear_guard.log"
    timeout 300 python3 benchmarks/probe_ncu.py --mode sweep --budget-s 280 --out "$OUT" \
      --systems benzene,g2x1024,g2x4096,water3000,water24000 \
      --variants "gemm:nan_guard=0;gemm:nan_guard=0+mp:edge_nan_guard=0" >"$OUT/probe_ncu_sweep.log" 2>&1
    grep -hE "^\| " "$OUT/probe_ncu_sweep.md"; tail -1 "$OUT/probe_ncu_sweep.log"
    ;;
  stop61i)
    # TF32 dots with the weight on the grid ("tf32w": the other operand alone rounded, in integer ops): the GEMM's
    # and the message kernels' CUDA tests (same bits as "tf32"), the tf32 step with it off, then the rows.
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_linear.py tests/kernels/test_tf32_grid.py \
      -k "nan_guard or rounds_a_alone or rounds_rbf_alone or tf32_hi or dot_fin" >"$OUT/pytest_tf32w.log" 2>&1
    tail -2 "$OUT/pytest_tf32w.log"
    timeout 200 python3 benchmarks/probe_ncu.py --mode sweep --precision tf32 --budget-s 180 --out "$OUT" \
      --systems g2x4096,water3000,benzene --variants "gemm:w_exact_tf32=0+mp:w_exact_tf32=0" \
      >"$OUT/probe_ncu_sweep.log" 2>&1
    grep -hE "^\| " "$OUT/probe_ncu_sweep.md"; tail -1 "$OUT/probe_ncu_sweep.log"
    timeout 200 python3 benchmarks/probe_student_size.py --configs 128x3,64x3 --md-steps 300 --out "$OUT" \
      --name probe_student_size_h200 >"$OUT/probe_student_size.log" 2>&1
    grep -E "^\| " "$OUT/probe_student_size_h200.md" | tail -4
    ;;
  stop61j)
    # The benzene MD step (probe_student_size: 226.6 µs at stop 60, 293-312 now): probe_md_step's breakdown at the
    # stop's kernels and at stop 60's (stop61_kernels.diff reversed), alternating.
    D=benchmarks/results/stop61_gpu/stop61_kernels.diff
    for v in new old new; do
      [ "$v" = old ] && { patch -R -p1 -s <"$D" || echo "PATCH -R FAILED"; }
      timeout 150 python3 benchmarks/probe_md_step.py --steps 1000 --out /tmp --name "md_$v" >"/tmp/md_$v.log" 2>&1
      [ "$v" = old ] && patch -p1 -s <"$D"
      { echo "== kernels $v"; grep -E "^\| " "/tmp/md_$v.md" | head -24; tail -1 "/tmp/md_$v.log"; } | tee -a "$OUT/md_step_old_new.md"
    done
    ;;
  stop61k)
    # The final code's GPU tests outside the kernel files (engine, calculator, capture, precision, ...).
    timeout 390 python3 -m pytest -q -p no:cacheprovider -m gpu tests --ignore=tests/kernels -x \
      >"$OUT/pytest_gpu_all.log" 2>&1; tail -3 "$OUT/pytest_gpu_all.log"
    ;;
  prepared61)
    # For the next stop (built at stop 61, its device time spent): the edge backward's two slices split by terms
    # (edge_split_terms), and chained, the second adding the first's rows after a per-tile flag in place of the sum
    # kernel (edge_split_chain); the atom sender backward's half-tile sums (sender_fold_half). Their CUDA tests (the
    # chain's bits against the sum kernel's), then the whole step with each, and all three.
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_message_passing.py tests/kernels/test_message_passing_launch.py \
      -k "(term_split or chained or fold_half) and cuda" >"$OUT/pytest_prepared.log" 2>&1
    tail -2 "$OUT/pytest_prepared.log"
    timeout 330 python3 benchmarks/probe_ncu.py --mode sweep --budget-s 310 --out "$OUT" \
      --systems water3000,water24000,g2x4096,g2x1024 \
      --variants "mp:edge_split_terms=1;mp:edge_split_chain=1;mp:sender_fold_half=1;mp:sender_fold_half=1,block_e=32;mp:edge_split_terms=1,edge_split_chain=1,sender_fold_half=1" \
      >"$OUT/probe_ncu_sweep.log" 2>&1
    grep -hE "^\| " "$OUT/probe_ncu_sweep.md"; tail -1 "$OUT/probe_ncu_sweep.log"
    ;;
  stop62)
    # Stop 62: the prepared switches' CUDA tests (tolerances of the float32 cross-checks at the rows' scale), then
    # the chain and the half-tile sender together, each again alone, the chain's tile threshold and the edge and
    # sender kernels' pipeline depths under both.
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_message_passing.py tests/kernels/test_message_passing_launch.py \
      -k "(term_split or chained or fold_half) and cuda" >"$OUT/pytest_prepared.log" 2>&1
    tail -2 "$OUT/pytest_prepared.log"
    CH="mp:edge_split_chain=1,sender_fold_half=1"
    timeout 360 python3 benchmarks/probe_ncu.py --mode sweep --budget-s 340 --out "$OUT" \
      --systems water3000,water24000,g2x4096,g2x1024,water192 \
      --variants "$CH;mp:edge_split_chain=1;mp:sender_fold_half=1;$CH,edge_chain_min_tiles=2048;$CH,bwd_edge_stages=2;$CH,bwd_edge_stages=4;$CH,bwd_sender_stages=2" \
      >"$OUT/probe_ncu_sweep.log" 2>&1
    grep -hE "^\| " "$OUT/probe_ncu_sweep.md"; tail -1 "$OUT/probe_ncu_sweep.log"
    ;;
  stop62c)
    # The shipped chain ("fold") and half-tile sender: the message kernels' CUDA cases, the rows, bench_large.
    timeout 220 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_message_passing.py tests/kernels/test_message_passing_launch.py -k cuda \
      >"$OUT/pytest_mp_cuda.log" 2>&1; tail -2 "$OUT/pytest_mp_cuda.log"
    rows 200 170 150
    ;;
  stop62d)
    # Where a water step goes now (kernel table), and the GEMM's tiles at mid-size M (3,000 rows fill 94 programs of
    # 64 x 64 for a 128-wide output on 132 SMs): the small tiles up to 4,096 rows, 32-row and 32-column large tiles.
    timeout 150 python3 benchmarks/probe_kernel_table.py --systems water3000,water24000 --out "$OUT" \
      --name kernel_table >"$OUT/kernel_table.log" 2>&1; tail -2 "$OUT/kernel_table.log"
    timeout 300 python3 benchmarks/probe_ncu.py --mode sweep --budget-s 280 --out "$OUT" \
      --systems water3000,water24000,g2x4096,g2x1024 \
      --variants "gemm:small_rows=4096;gemm:large=32x64x4;gemm:large=64x32x4;gemm:large=32x64x2;gemm:large_block_k=64,large=32x64x4" \
      >"$OUT/probe_ncu_sweep.log" 2>&1
    grep -hE "^\| " "$OUT/probe_ncu_sweep.md"; tail -1 "$OUT/probe_ncu_sweep.log"
    ;;
  stop62e)
    # The torch ops behind the captured water step's four elementwise kernels (eager step, shapes).
    # (probe_torch_ops.py then; its table is probe_kernel_table.py --ops since stop 63)
    timeout 200 python3 benchmarks/probe_kernel_table.py --systems water3000,water24000 --step-mode eager --ops \
      --out "$OUT" --name probe_torch_ops >"$OUT/probe_torch_ops.log" 2>&1; grep -A45 "aten ops" "$OUT/probe_torch_ops.txt"
    ;;
  stop62f)
    # A finer ladder above 2,048 atoms (fine_growth 1.04 / 1.03 against 1.0625: 4,096 g2 molecules pad 1.7-1.8 %
    # instead of 4.7 %, 1,024 1.3-2.9 % instead of 3.7 %, 3,000 water atoms 1.9-3.7 % instead of 2.7 %), then the
    # GPU tests outside the kernel files at the final kernels.
    timeout 150 python3 benchmarks/probe_ncu.py --mode sweep --budget-s 130 --out "$OUT" \
      --systems g2x4096,g2x1024,water3000 --variants "ladder:fine_growth=1.03;ladder:fine_growth=1.04" \
      >"$OUT/probe_ncu_sweep.log" 2>&1
    grep -hE "^\| " "$OUT/probe_ncu_sweep.md"; tail -1 "$OUT/probe_ncu_sweep.log"
    timeout 400 python3 -m pytest -q -p no:cacheprovider -m gpu tests --ignore=tests/kernels -x \
      >"$OUT/pytest_gpu_all.log" 2>&1; tail -3 "$OUT/pytest_gpu_all.log"
    ;;
  stop62g)
    # The rows with the finer ladder (fine_growth 1.03), and the GPU tests stop62f's time limit cut (its last files).
    timeout 200 python3 benchmarks/probe_student_size.py --configs 128x3,64x3 --md-steps 300 --out "$OUT" \
      --name probe_student_size_h200 >"$OUT/probe_student_size.log" 2>&1
    grep -E "^\| " "$OUT/probe_student_size_h200.md" | tail -4
    timeout 110 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_neighbors_periodic.py \
      tests/test_predict_cache.py tests/test_predict_stream.py >"$OUT/pytest_gpu_tail.log" 2>&1
    tail -3 "$OUT/pytest_gpu_tail.log"
    ;;
  stop62h)
    # The two-layer MLP in one launch (kernels.mlp_fused, off): its CUDA test (the two GEMM launches' bits), then
    # the whole step with it from 2,049 rows (captured steps), over 8 warps (shipped launch) and 4.
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_mlp_fused.py -m gpu \
      >"$OUT/pytest_mlp_fused.log" 2>&1; tail -2 "$OUT/pytest_mlp_fused.log"
    timeout 150 python3 benchmarks/probe_ncu.py --mode sweep --budget-s 130 --out "$OUT" \
      --systems g2x1024,g2x4096,water3000 \
      --variants "gemm:fused_mlp_min_rows=2049;gemm:fused_mlp_min_rows=2049,fused_mlp_warps=4" \
      >"$OUT/probe_ncu_sweep.log" 2>&1
    grep -hE "^\| " "$OUT/probe_ncu_sweep.md"; tail -1 "$OUT/probe_ncu_sweep.log"
    ;;
  stop62i)
    # The atom sender backward with its half-tile sums (shipped at this stop) against its register cap and tile:
    # uncapped, a 168 cap, 32-edge tiles (the cap and tiles were chosen before the half-tile sums).
    timeout 200 python3 benchmarks/probe_ncu.py --mode sweep --budget-s 180 --out "$OUT" \
      --systems water3000,water24000 \
      --variants "mp:bwd_sender_atom_maxnreg=0;mp:bwd_sender_atom_maxnreg=168;mp:bwd_sender_block_e=32" \
      >"$OUT/probe_ncu_sweep.log" 2>&1
    grep -hE "^\| " "$OUT/probe_ncu_sweep.md"; tail -1 "$OUT/probe_ncu_sweep.log"
    ;;
  prepared62)
    # For the next stop (built at stop 62, its device time spent), three switches of the update block, off: the
    # mixing MLP's first GEMM making [s + ds | ‖vv‖] in its load (norm_in_gemm, linear.gemm's prologue_norm; no norm
    # kernel), g_v_out as the backward's last GEMM's addend (gv_as_addend; no copy), ∂vv written once by the norm
    # backward (dvv_in_norm_bwd). Their CUDA tests, then the whole step with each and with all three.
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_linear.py tests/kernels/test_painn_update.py \
      -k "norm_prologue_equals or ((norm_prologue or norm_in_gemm or byte_switches) and cuda)" >"$OUT/pytest_prepared.log" 2>&1
    tail -2 "$OUT/pytest_prepared.log"
    timeout 300 python3 benchmarks/probe_ncu.py --mode sweep --budget-s 280 --out "$OUT" \
      --systems g2x4096,g2x1024,water3000,water24000,water192,benzene \
      --variants "update:norm_in_gemm=1;update:gv_as_addend=1;update:dvv_in_norm_bwd=1;update:norm_in_gemm=1,gv_as_addend=1,dvv_in_norm_bwd=1" \
      >"$OUT/probe_ncu_sweep.log" 2>&1
    grep -hE "^\| " "$OUT/probe_ncu_sweep.md"; tail -1 "$OUT/probe_ncu_sweep.log"
    # The g2 batches' edge backward unsplit (no sum kernel; split 2 was measured on water only, 1.5-1.7x better there).
    timeout 100 python3 benchmarks/probe_ncu.py --mode sweep --budget-s 80 --out "$OUT/g2split" \
      --systems g2x4096,g2x1024 --variants "mp:bwd_edge_split=1" >"$OUT/probe_ncu_sweep_g2split.log" 2>&1
    grep -hE "^\| " "$OUT/g2split/probe_ncu_sweep.md"
    # Why the captured 24,000-atom step (10.81 ms) is 3.4 % slower than the eager one (10.45) at stop 62: both
    # modes' kernel tables.
    for mode in eager cudagraph; do
      timeout 120 python3 benchmarks/probe_kernel_table.py --systems water24000 --step-mode $mode --out "$OUT" \
        --name "kernel_table_24k_$mode" >"$OUT/kernel_table_24k_$mode.log" 2>&1
      grep -E "=====|^group" "$OUT/kernel_table_24k_$mode.txt"
    done
    ;;
  stop63a)
    # Stop 63, round 2 of prepared62's switches: gv_as_addend (1.001-1.017x alone) as the base of each variant;
    # norm_in_gemm only from 8,192 atoms (it lost 2-5 % on benzene and 192 water atoms, won 0.6-1 % at ~22,000).
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_painn_update.py \
      -k "(norm_in_gemm or byte_switches) and cuda" >"$OUT/pytest_update.log" 2>&1
    tail -2 "$OUT/pytest_update.log"
    G="update:gv_as_addend=1"
    timeout 330 python3 benchmarks/probe_ncu.py --mode sweep --budget-s 310 --out "$OUT" \
      --systems g2x4096,g2x1024,water3000,water24000,water192,benzene \
      --variants "$G;$G,dvv_in_norm_bwd=1;$G,norm_in_gemm=1,norm_in_gemm_min_atoms=8192;$G,dvv_in_norm_bwd=1,norm_in_gemm=1,norm_in_gemm_min_atoms=8192" \
      >"$OUT/probe_ncu_sweep.log" 2>&1
    grep -hE "^\| " "$OUT/probe_ncu_sweep.md"; tail -1 "$OUT/probe_ncu_sweep.log"
    # The captured step keeps the caller's atom order (the eager one sorts from 10,000 atoms): the box as built
    # against Morton-sorted, captured.
    timeout 120 python3 benchmarks/probe_locality.py --mode cudagraph --sizes 12000 24000 --out "$OUT/locality" \
      >"$OUT/probe_locality.log" 2>&1
    grep -E "atoms|speedup" "$OUT/probe_locality.log"
    ;;
  stop63b)
    # The three update-block switches as shipped at stop 63: the update block's and GEMM's CUDA cases, the rows,
    # bench_large.
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_painn_update.py tests/kernels/test_linear.py \
      -k cuda >"$OUT/pytest_update_cuda.log" 2>&1; tail -2 "$OUT/pytest_update_cuda.log"
    rows 200 170 150
    ;;
  stop63c)
    # The GPU tests outside tests/kernels at the final code (~400 s).
    timeout 560 python3 -m pytest -q -p no:cacheprovider -m gpu tests --ignore=tests/kernels -x \
      >"$OUT/pytest_gpu.log" 2>&1; tail -3 "$OUT/pytest_gpu.log"
    ;;
  stop63d)
    # stop63b's eager 24,000-atom rows read slower than stop 62's (128 wide 10.60 against 10.45 ms, 64 wide 9.32
    # against 7.98) while the captured ones gained: the switches off, one at a time, in the eager step, both widths;
    # and the 64-wide student's captured rows.
    V="update:norm_in_gemm=0;update:gv_as_addend=0,dvv_in_norm_bwd=0;update:norm_in_gemm=0,gv_as_addend=0,dvv_in_norm_bwd=0"
    for h in 128 64; do
      timeout 100 python3 benchmarks/probe_ncu.py --mode sweep --budget-s 85 --out "$OUT/eager$h" --step-mode eager \
        --hidden $h --systems water24000 --variants "$V" >"$OUT/probe_ncu_sweep_eager$h.log" 2>&1
      grep -hE "^\| " "$OUT/eager$h/probe_ncu_sweep.md"
    done
    timeout 150 python3 benchmarks/probe_ncu.py --mode sweep --budget-s 130 --out "$OUT/graph64" --hidden 64 \
      --systems g2x4096,water3000,water24000 --variants "$V" >"$OUT/probe_ncu_sweep_graph64.log" 2>&1
    grep -hE "^\| " "$OUT/graph64/probe_ncu_sweep.md"
    ;;
  stop63e)
    # norm_in_gemm only on the GEMM's descriptor kernel (stop63d: on the eager pointer kernel it cost the 24,000-atom
    # step 0.985x / 0.857x at 128 / 64 features): the CUDA cases, the eager A/B again, the rows.
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_painn_update.py tests/kernels/test_linear.py \
      -k cuda >"$OUT/pytest_update_cuda.log" 2>&1; tail -2 "$OUT/pytest_update_cuda.log"
    for h in 128 64; do
      timeout 60 python3 benchmarks/probe_ncu.py --mode sweep --budget-s 45 --out "$OUT/eager$h" --step-mode eager \
        --hidden $h --systems water24000 --variants "update:norm_in_gemm=0" >"$OUT/probe_ncu_sweep_eager$h.log" 2>&1
      grep -hE "^\| " "$OUT/eager$h/probe_ncu_sweep.md"
    done
    rows 200 170 150
    ;;
  stop63f)
    # After the GEMM kernels moved to _gemm_kernels.py: the GEMM users' CUDA cases, and probe_kernel_table --ops
    # (probe_torch_ops.py folded in).
    F="tests/kernels/test_linear.py tests/kernels/test_painn_update.py tests/kernels/test_tf32_grid.py"
    F="$F tests/kernels/test_precision_dots.py tests/kernels/test_species_moments.py"
    timeout 300 python3 -m pytest -q -p no:cacheprovider $F -k cuda >"$OUT/pytest_gemm_cuda.log" 2>&1
    tail -2 "$OUT/pytest_gemm_cuda.log"
    timeout 150 python3 -m pytest -q -p no:cacheprovider $F -m gpu -k "not cuda" >"$OUT/pytest_gemm_gpu.log" 2>&1
    tail -2 "$OUT/pytest_gemm_gpu.log"
    timeout 100 python3 benchmarks/probe_kernel_table.py --systems water3000 --step-mode eager --ops --out "$OUT" \
      --name kernel_table_ops >"$OUT/kernel_table_ops.log" 2>&1; grep -E "=====|^group" "$OUT/kernel_table_ops.txt"
    grep -A8 "aten ops" "$OUT/kernel_table_ops.txt"
    ;;
  stop63g)
    # After test_message_passing.py's split: the message kernels' CUDA cases in both files (111 at stop 62).
    timeout 270 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_message_passing.py \
      tests/kernels/test_message_passing_launch.py -k cuda >"$OUT/pytest_mp_cuda.log" 2>&1
    tail -2 "$OUT/pytest_mp_cuda.log"
    ;;
  prepared63)
    # For the next stop's first call (stop 63's device time was spent): the GPU tests of the edge-gradient sink after
    # its move to kernels/edge_sink.py (its second stream inside captures), then the whole GPU suite outside
    # tests/kernels (~330 s).
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_edge_sink.py -m gpu \
      >"$OUT/pytest_sink_gpu.log" 2>&1; tail -2 "$OUT/pytest_sink_gpu.log"
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_edge_sink.py \
      tests/kernels/test_species_moments.py -k cuda >"$OUT/pytest_sink_cuda.log" 2>&1; tail -2 "$OUT/pytest_sink_cuda.log"
    timeout 380 python3 -m pytest -q -p no:cacheprovider -m gpu tests --ignore=tests/kernels -x \
      >"$OUT/pytest_gpu.log" 2>&1; tail -3 "$OUT/pytest_gpu.log"
    ;;
  stop64a)
    # A persistent warp-specialised descriptor GEMM (tl.range warp_specialize, Hopper autoWS in Triton 3.5+)
    # against the shipped large-M GEMM, bits first; then where the captured g2 x 1,024 and water 3,000 steps go
    # (their GEMMs' share: the lever for both rows).
    timeout 300 python3 benchmarks/probe_gemm_ws.py --out "$OUT" >"$OUT/probe_gemm_ws.log" 2>&1; tail -3 "$OUT/probe_gemm_ws.log"
    timeout 200 python3 benchmarks/probe_kernel_table.py --systems g2x1024,water3000 --out "$OUT" \
      >"$OUT/kernel_table.log" 2>&1; tail -2 "$OUT/kernel_table.log"
    ;;
  stop64b)
    # The GEMM's persistent descriptor launch (linear._CONFIG["persist"], off): its CUDA bits against one program per
    # tile, then the whole step with it on, by threshold, tile and programs per SM (the last: not persistent, the
    # 128-row tile alone).
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_linear.py -k "tma and cuda" \
      >"$OUT/pytest_linear_cuda.log" 2>&1; tail -2 "$OUT/pytest_linear_cuda.log"
    timeout 360 python3 benchmarks/probe_ncu.py --mode sweep --budget-s 345 --out "$OUT" \
      --systems water3000,g2x1024,g2x4096,water24000 \
      --variants "gemm:persist=16000x128x64x4x4x2;gemm:persist=16000x128x64x4x4x1;gemm:persist=16000x64x64x4x3x4;gemm:persist=16000x128x64x4x4x1000;gemm:persist=6000x128x64x4x4x2" \
      >"$OUT/probe_ncu_sweep.log" 2>&1
    grep -hE "^\| " "$OUT/probe_ncu_sweep.md"; tail -2 "$OUT/probe_ncu_sweep.log"
    ;;
  stop64d)
    # The final tree of stop 64: the update block's CUDA cases (the norm prologue's gate now asks linear's
    # tma_norm_prologue), then every target row of issues 5 and 7 in one call: both widths' rows, bench_large's
    # check and energy + forces, and its neighbour lists (one 24,000-atom box, 1,024 small boxes, vesin beside).
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_painn_update.py -k cuda \
      >"$OUT/pytest_update_cuda.log" 2>&1; tail -2 "$OUT/pytest_update_cuda.log"
    rows 200 170 150
    timeout 100 python3 benchmarks/bench_large.py --out "$OUT/large_nl" --budget-s 80 --sections nl \
      >"$OUT/bench_large_nl.log" 2>&1
    grep -E "^\| " "$OUT/bench_large_nl.log" | head -20; tail -2 "$OUT/bench_large_nl.log"
    ;;
  stop64e)
    # stop64d's 8 failed CUDA cases: test_norm_in_gemm_matches_the_norm_kernel expected the prologue at 7 and 33
    # rows, which the gate now sends to the norm kernel (at most small_rows rows: the pointer kernel); the test asks
    # the gate and gained a 2,100-row case, where the descriptor kernel takes the prologue.
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_painn_update.py -k cuda \
      >"$OUT/pytest_update_cuda.log" 2>&1; tail -2 "$OUT/pytest_update_cuda.log"
    ;;
  stop64f)
    # The atom order of a large box beyond the eager path's Morton sort (bins of half the cutoff): a 3-D Hilbert
    # curve and other bin sizes, timed on the captured step (which keeps the order given), 12,000 and 24,000 atoms.
    timeout 300 python3 benchmarks/probe_locality.py --mode cudagraph --sizes 12000 24000 --out "$OUT/locality" \
      --orders engine,hilbert:2.5,hilbert:1.25,hilbert:5.0,engine:1.25,engine:5.0,morton,built \
      >"$OUT/probe_locality.log" 2>&1; grep -E "^\| " "$OUT/probe_locality.log"; tail -2 "$OUT/probe_locality.log"
    ;;
  stop64g)
    # (Needs benchmarks/results/stop64_gpu/g/padded_sort_dropped.diff applied: the switch and the probe.)
    # The padded path's per-call Morton sort of large periodic batches (engine.padded_sort_min_atoms, off): its
    # CUDA tests (the sorted numbers rewritten into a bucket whose topology is unchanged), then end to end against
    # the shipped unsorted padded path, both widths.
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_ordering.py >"$OUT/pytest_ordering.log" 2>&1
    tail -2 "$OUT/pytest_ordering.log"
    timeout 300 python3 benchmarks/probe_padded_sort.py --hidden 128,64 --atoms 12000,18000,24000,36000 \
      --out "$OUT" >"$OUT/probe_padded_sort.log" 2>&1; grep -E "^\| " "$OUT/probe_padded_sort.log"
    tail -2 "$OUT/probe_padded_sort.log"
    ;;
  stop64h)
    # Whether stop64g's per-call cost was the Morton sort's lowest corner (a float64 scatter-amin of every atom onto
    # three addresses, now a plain reduction for one structure): spatial_order alone, old against new; then, with
    # padded_sort_dropped.diff applied in the working tree, the padded path's sort end to end again, its CUDA tests,
    # and bench_large's 24,000-atom rows (its eager call sorts per call too).
    timeout 120 python3 benchmarks/probe_spatial_order.py --out "$OUT" >"$OUT/probe_spatial_order.log" 2>&1
    grep -E "^\| " "$OUT/probe_spatial_order.log"; tail -1 "$OUT/probe_spatial_order.log"
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_ordering.py >"$OUT/pytest_ordering.log" 2>&1
    tail -1 "$OUT/pytest_ordering.log"
    if [ -f benchmarks/probe_padded_sort.py ]; then
      timeout 240 python3 benchmarks/probe_padded_sort.py --hidden 128,64 --atoms 12000,18000,24000,36000 \
        --out "$OUT" >"$OUT/probe_padded_sort.log" 2>&1; grep -E "^\| " "$OUT/probe_padded_sort.log"
    fi
    timeout 150 python3 benchmarks/bench_large.py --out "$OUT/large" --budget-s 130 --sections ef --sizes 24000 \
      >"$OUT/bench_large.log" 2>&1; grep -E "^\| 24000" "$OUT/bench_large.log" | head -6
    ;;
  stop64i)
    # (Its probe_padded_sort part needs benchmarks/results/stop64_gpu/g/padded_sort_dropped.diff applied.)
    # stop64h: spatial_order took 0.66-0.78 ms a call either way (its ~55 launches, not the scatter). With the spread
    # bits from a table (~12 launches): spatial_order old against new, the ordering tests on CUDA, the padded path's
    # sort end to end again (the switch is in this tree, off), bench_large's 24,000-atom rows.
    timeout 120 python3 benchmarks/probe_spatial_order.py --out "$OUT" >"$OUT/probe_spatial_order.log" 2>&1
    grep -E "^\| " "$OUT/probe_spatial_order.log" | tail -5
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_ordering.py >"$OUT/pytest_ordering.log" 2>&1
    tail -1 "$OUT/pytest_ordering.log"
    timeout 240 python3 benchmarks/probe_padded_sort.py --hidden 128,64 --atoms 12000,24000,36000 \
      --out "$OUT" >"$OUT/probe_padded_sort.log" 2>&1; grep -E "^\| " "$OUT/probe_padded_sort.log" | tail -7
    timeout 150 python3 benchmarks/bench_large.py --out "$OUT/large" --budget-s 130 --sections ef --sizes 24000 \
      >"$OUT/bench_large.log" 2>&1; grep -E "^\| 24000" "$OUT/bench_large.log" | head -6
    ;;
  stop65a)
    # The half gathers (message_passing._CONFIG half_gathers / half_grads, on under bf16 / fp16): their tests and the
    # message-passing and precision tests on CUDA (the kernels' loads changed for every dtype), then each precision's
    # step time and error against fp64 with the switches off / x, v only / both (128 x 3, water 24,000 included).
    timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_half_gathers.py \
      tests/kernels/test_precision_dots.py tests/kernels/test_message_passing.py -k "cuda or gpu" \
      >"$OUT/pytest_half.log" 2>&1; tail -3 "$OUT/pytest_half.log"
    timeout 330 python3 benchmarks/probe_precision.py --out "$OUT" --name probe_precision_h200 --rounds 1 --large \
      >"$OUT/probe_precision.log" 2>&1
    grep -E "^\| " "$OUT/probe_precision_h200.md" | head -30; tail -3 "$OUT/probe_precision.log"
    ;;
  stop65b)
    # stop65a again with the tests' dots kept at tf32x3 (on CUDA the 16-bit mode had given them one TF32 pass, which
    # hid the gathers' rounding from the exact check) and the error sets on the block path (the rattled sets four
    # copies each, ~2,200 atoms, and a 3,000-atom water box); then the 64 x 3 student's rows.
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_half_gathers.py \
      tests/kernels/test_precision_dots.py -k "cuda or gpu" >"$OUT/pytest_half.log" 2>&1; tail -3 "$OUT/pytest_half.log"
    timeout 250 python3 benchmarks/probe_precision.py --out "$OUT" --name probe_precision_h200 --rounds 1 --large \
      >"$OUT/probe_precision.log" 2>&1
    grep -E "^\| " "$OUT/probe_precision_h200.md" | head -30; tail -3 "$OUT/probe_precision.log"
    timeout 140 python3 benchmarks/probe_precision.py --out "$OUT" --name probe_precision_64x3_h200 --rounds 1 \
      --hidden 64 >"$OUT/probe_precision_64x3.log" 2>&1
    grep -E "^\| " "$OUT/probe_precision_64x3_h200.md" | head -30; tail -3 "$OUT/probe_precision_64x3.log"
    ;;
  stop65c)
    # The half gathers' tests with the engine case (a 1,536-atom water box, eager and captured, bf16 / fp16 against
    # fp64), and the CUDA cases of the tests of the host paths they changed (the edge sink, the launch choices).
    timeout 420 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_half_gathers.py \
      tests/kernels/test_edge_sink.py tests/kernels/test_message_passing_launch.py -k "cuda or gpu" \
      >"$OUT/pytest_half.log" 2>&1; tail -3 "$OUT/pytest_half.log"
    ;;
  stop65d)
    # The final tree of stop 65: every target row (both widths; the kernels' loads now widen to the compute dtype,
    # a no-op for float32 rows), bench_large's check and energy + forces, then the 64 x 3 student's precisions again
    # with half_grads_min_degree (g2 batches keep float32 gradient rows).
    rows 200 170 150
    timeout 140 python3 benchmarks/probe_precision.py --out "$OUT" --name probe_precision_64x3_h200 --rounds 1 \
      --hidden 64 >"$OUT/probe_precision_64x3.log" 2>&1
    grep -E "^\| " "$OUT/probe_precision_64x3_h200.md" | head -12; tail -1 "$OUT/probe_precision_64x3.log"
    ;;
  stop65e)
    # The GPU tests outside tests/kernels at the final tree (the engine, calculator, MD, NPT, ... paths over the
    # changed kernels).
    timeout 500 python3 -m pytest -q -p no:cacheprovider -m gpu tests --ignore=tests/kernels \
      >"$OUT/pytest_gpu.log" 2>&1; tail -3 "$OUT/pytest_gpu.log"
    ;;
  stop65f)
    # Under fp16 the gradient rows now float16 (half_grads_type "mode"; stop65b had them bfloat16, 0.30 -> 0.66 meV/Å
    # force RMSE on water 3,000): the half gathers' tests on CUDA, then the precisions again (128 x 3).
    timeout 130 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_half_gathers.py -k "cuda or gpu" \
      >"$OUT/pytest_half.log" 2>&1; tail -2 "$OUT/pytest_half.log"
    timeout 160 python3 benchmarks/probe_precision.py --out "$OUT" --name probe_precision_h200 --rounds 1 \
      >"$OUT/probe_precision.log" 2>&1
    grep -E "^\| " "$OUT/probe_precision_h200.md" | head -12; tail -1 "$OUT/probe_precision.log"
    ;;
  stop66a)
    # The benzene MD step piece by piece at stop 65's tree (probe_md_step: the engine's device path against the
    # copies captured in the graph), and the benzene replay's kernels in start order (probe_kernel_order).
    timeout 150 python3 benchmarks/probe_md_step.py --steps 1000 --out "$OUT" --name probe_md_step_h200 \
      >"$OUT/probe_md_step.log" 2>&1; grep -E "^\| " "$OUT/probe_md_step_h200.md" | head -30; tail -2 "$OUT/probe_md_step.log"
    timeout 120 python3 benchmarks/probe_kernel_order.py --out "$OUT" >"$OUT/probe_kernel_order.log" 2>&1
    tail -3 "$OUT/probe_kernel_order.log"
    ;;
  stop66b)
    # The MD step's two transfers as zero-copy accesses of page-locked host memory inside the graph
    # (probe_zero_copy: engine path / memcpy nodes / zero-copy in + out / zero-copy out), benzene and 192 water.
    timeout 200 python3 benchmarks/probe_zero_copy.py --steps 2000 --out "$OUT" >"$OUT/probe_zero_copy.log" 2>&1
    grep -E "^\| " "$OUT/probe_zero_copy_h200.md"; tail -3 "$OUT/probe_zero_copy.log"
    ;;
  stop66c)
    # The zero-copy MD step (ForceEngine.zero_copy, on by default on CUDA): its GPU tests and the Verlet path's, then
    # probe_md_step (the zero-copy step off / on alternating) and the target rows of both widths.
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_engine_zero_copy.py tests/test_engine_verlet.py \
      -m gpu >"$OUT/pytest_zero_copy.log" 2>&1; tail -3 "$OUT/pytest_zero_copy.log"
    timeout 150 python3 benchmarks/probe_md_step.py --steps 1000 --out "$OUT" --name probe_md_step_h200 \
      >"$OUT/probe_md_step.log" 2>&1; grep -E "^\| " "$OUT/probe_md_step_h200.md" | head -34; tail -2 "$OUT/probe_md_step.log"
    timeout 220 python3 benchmarks/probe_student_size.py --configs 128x3,64x3 --md-steps 1000 --out "$OUT" \
      --name probe_student_size_h200 >"$OUT/probe_student_size.log" 2>&1
    grep -E "^\| " "$OUT/probe_student_size_h200.md" | tail -4; tail -2 "$OUT/probe_student_size.log"
    ;;
  stop66d)
    # The GPU tests outside tests/kernels (engine, calculator, MD, NPT, ... over the zero-copy MD step).
    timeout 560 python3 -m pytest -q -p no:cacheprovider -m gpu tests --ignore=tests/kernels \
      >"$OUT/pytest_gpu.log" 2>&1; tail -3 "$OUT/pytest_gpu.log"
    ;;
  stop66e)
    # The next velocity-Verlet step launched ahead (StudentCalculator.launch_ahead) with the zero-copy step: their GPU
    # tests and the Verlet path's, probe_md_step (launch ahead off / on alternating) and the target rows.
    timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_launch_ahead.py tests/test_engine_zero_copy.py \
      tests/test_engine_verlet.py tests/test_calculator.py -m gpu >"$OUT/pytest_ahead.log" 2>&1; tail -3 "$OUT/pytest_ahead.log"
    timeout 170 python3 benchmarks/probe_md_step.py --steps 1000 --out "$OUT" --name probe_md_step_h200 \
      >"$OUT/probe_md_step.log" 2>&1; grep -E "^\| " "$OUT/probe_md_step_h200.md" | head -40; tail -2 "$OUT/probe_md_step.log"
    timeout 220 python3 benchmarks/probe_student_size.py --configs 128x3,64x3 --md-steps 1000 --out "$OUT" \
      --name probe_student_size_h200 >"$OUT/probe_student_size.log" 2>&1
    grep -E "^\| " "$OUT/probe_student_size_h200.md" | tail -3; tail -2 "$OUT/probe_student_size.log"
    ;;
  stop66f)
    # stop66e read the 64 x 3 random student's MD step at 237 µs with launches ahead (190 at stop66c without): the
    # shipped 64 x 3 student's step piece by piece (launches ahead off / on, taken and missed counted), and the rows
    # with the widths in the other order (each MD run's launches ahead printed).
    timeout 170 python3 benchmarks/probe_md_step.py --steps 1000 --model builtin:chno-gfn2-small --out "$OUT" \
      --name probe_md_step_64x3_h200 >"$OUT/probe_md_step_64x3.log" 2>&1
    grep -E "^\| " "$OUT/probe_md_step_64x3_h200.md" | head -30; tail -2 "$OUT/probe_md_step_64x3.log"
    timeout 220 python3 benchmarks/probe_student_size.py --configs 64x3,128x3 --md-steps 1000 --out "$OUT" \
      --name probe_student_size_h200 >"$OUT/probe_student_size.log" 2>&1
    grep -E "^\| |MD: " "$OUT/probe_student_size.log" | tail -6; tail -1 "$OUT/probe_student_size.log"
    ;;
  stop66g)
    # The final tree: the zero-copy and launch-ahead GPU tests, then bench_engine's MD section (the issue's benchmark:
    # benzene velocity Verlet through StudentCalculator, reference / eager / auto / cudagraph+compile, mean per step).
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_launch_ahead.py tests/test_engine_zero_copy.py \
      -m gpu >"$OUT/pytest_final.log" 2>&1; tail -2 "$OUT/pytest_final.log"
    timeout 300 python3 benchmarks/bench_engine.py --sections md --budget-s 280 --out "$OUT" --name engine_md_h200 \
      >"$OUT/bench_engine_md.log" 2>&1; grep -E "'md'|step_us" "$OUT/bench_engine_md.log" | tail -6; tail -2 "$OUT/bench_engine_md.log"
    ;;
  stop66h)
    # bench_engine's MD section at 0.5 fs (median and mean, launches ahead counted), and `mlff-distill md` as a user
    # runs it (Langevin with FixCom, the default: the zero-copy step only; --ensemble nve: the launches ahead too).
    timeout 200 python3 benchmarks/bench_engine.py --sections md --budget-s 180 --out "$OUT" --name engine_md_h200 \
      >"$OUT/bench_engine_md.log" 2>&1; grep -E "^\| " "$OUT/engine_md_h200.md" | tail -6; tail -1 "$OUT/bench_engine_md.log"
    timeout 300 python3 benchmarks/probe_md_cli.py --out "$OUT" --steps 3000 >"$OUT/probe_md_cli.log" 2>&1
    grep -E "^\| " "$OUT/probe_md_cli.md" | head -12; tail -2 "$OUT/probe_md_cli.log"
    ;;
  stop66i)
    # A molecule's Verlet rebuild filled on the host (fill_padded_host; stop66h: ~1.6 ms a rebuild step): the Verlet
    # path's GPU tests, then the MD rows again (bench_engine md: median and mean; probe_md_cli: the build steps).
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_engine_verlet.py tests/test_engine_zero_copy.py \
      tests/test_launch_ahead.py -m gpu >"$OUT/pytest_verlet.log" 2>&1; tail -2 "$OUT/pytest_verlet.log"
    timeout 200 python3 benchmarks/bench_engine.py --sections md --budget-s 180 --out "$OUT" --name engine_md_h200 \
      >"$OUT/bench_engine_md.log" 2>&1; grep -E "^\| " "$OUT/engine_md_h200.md" | tail -6; tail -1 "$OUT/bench_engine_md.log"
    timeout 300 python3 benchmarks/probe_md_cli.py --out "$OUT" --steps 3000 >"$OUT/probe_md_cli.log" 2>&1
    grep -E "^\| " "$OUT/probe_md_cli.md" | head -12; tail -2 "$OUT/probe_md_cli.log"
    ;;
  stop66j)
    # A molecule's Verlet rebuild step, host fill against device fill, alternating in one process (dropped: the probe
    # and the switch are in benchmarks/results/stop66_gpu/j/verlet_host_fill_dropped.diff; git apply restores both).
    timeout 200 python3 benchmarks/probe_verlet_fill.py --steps 3000 --rounds 2 --out "$OUT" >"$OUT/probe_verlet_fill.log" 2>&1
    grep -E "^\| " "$OUT/probe_verlet_fill_h200.md"; tail -2 "$OUT/probe_verlet_fill.log"
    ;;
  stop66k)
    # Where an MD step that rebuilds its Verlet list goes (1.3-2.1 ms against ~0.19): cProfile of the calculations that
    # rebuilt, against those that kept the list.
    timeout 150 python3 benchmarks/probe_rebuild_step.py --steps 3000 --out "$OUT" >"$OUT/probe_rebuild_step.log" 2>&1
    grep -E "calculations, median" "$OUT/probe_rebuild_step_h200.md"; sed -n '/## rebuild: cumulative/,/## rebuild: own/p' "$OUT/probe_rebuild_step_h200.md" | head -60
    ;;
  stop66l)
    # The reviewed tree: the GPU tests of the zero-copy step, the launches ahead and the Verlet path; probe_zero_copy on
    # the shipped HostBuffer and copy_bits.
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_engine_zero_copy.py tests/test_launch_ahead.py \
      tests/test_engine_verlet.py -m gpu >"$OUT/pytest_review.log" 2>&1; tail -2 "$OUT/pytest_review.log"
    timeout 100 python3 benchmarks/probe_zero_copy.py --steps 1000 --rounds 1 --out "$OUT" >"$OUT/probe_zero_copy.log" 2>&1
    grep -E "^\| " "$OUT/probe_zero_copy_h200.md"; tail -2 "$OUT/probe_zero_copy.log"
    ;;
  stop67a)
    # Complete Verlet lists kept (benzene builds its list once) and rebuilds made ahead of the launch for the predicted
    # positions: the Verlet path's GPU tests, the rebuild probe by system (with its torch.profiler tables), the MD rows.
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_engine_verlet.py tests/test_engine_zero_copy.py \
      tests/test_launch_ahead.py tests/test_calculator.py -m gpu >"$OUT/pytest_verlet.log" 2>&1; tail -2 "$OUT/pytest_verlet.log"
    timeout 260 python3 benchmarks/probe_md_rebuilds.py --steps 1000 --profile at-stack --out "$OUT" \
      >"$OUT/probe_md_rebuilds.log" 2>&1; grep -E "^\| " "$OUT/probe_md_rebuilds_h200.md" | head -16; tail -2 "$OUT/probe_md_rebuilds.log"
    timeout 130 python3 benchmarks/bench_engine.py --sections md --budget-s 110 --out "$OUT" --name engine_md_h200 \
      >"$OUT/bench_engine_md.log" 2>&1; grep -E "^\| " "$OUT/engine_md_h200.md" | tail -6; tail -1 "$OUT/bench_engine_md.log"
    ;;
  stop67b)
    # stop67a's failures mended (the zero-copy test's count of discarded steps; a molecule past 100 Å on the padded
    # Verlet path: its host pairs to the device before the float64 pair vectors), then the rebuild probe without the
    # adenine-thymine stack (the student heats it apart), with torch.profiler tables of the uracil dimer's rebuilds.
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_engine_verlet.py tests/test_engine_zero_copy.py \
      tests/test_launch_ahead.py tests/test_calculator.py tests/test_exact_pairs.py -m gpu >"$OUT/pytest_verlet.log" 2>&1
    tail -2 "$OUT/pytest_verlet.log"
    timeout 300 python3 benchmarks/probe_md_rebuilds.py --steps 1000 --profile uracil-dimer --out "$OUT" \
      >"$OUT/probe_md_rebuilds.log" 2>&1; grep -E "^\| " "$OUT/probe_md_rebuilds_h200.md" | head -16; tail -2 "$OUT/probe_md_rebuilds.log"
    ;;
  stop67c)
    # A molecule's Verlet rebuild filled on the host again (fill_padded_host; stop66j found no gain while a launched
    # step was in flight, which rebuild_ahead removes), the taken launch's second displacement test skipped, no
    # [E, 3, 3] product for a molecule's zero shifts: the Verlet path's GPU tests, the rebuild probe, the MD rows.
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_engine_verlet.py tests/test_engine_zero_copy.py \
      tests/test_launch_ahead.py tests/test_calculator.py tests/test_exact_pairs.py -m gpu >"$OUT/pytest_verlet.log" 2>&1
    tail -2 "$OUT/pytest_verlet.log"
    timeout 300 python3 benchmarks/probe_md_rebuilds.py --steps 1000 --profile uracil-dimer --out "$OUT" \
      >"$OUT/probe_md_rebuilds.log" 2>&1; grep -E "^\| " "$OUT/probe_md_rebuilds_h200.md" | head -16; tail -2 "$OUT/probe_md_rebuilds.log"
    ;;
  stop67d)
    # Stop 66's MD behaviour (every list rebuilt by the displacement test after a launch on the old list, its bucket
    # filled on the device) against stop 67's (complete lists kept, rebuilds ahead, host fill), alternating, two
    # rounds per system; then bench_engine's MD section (benzene: the issue's row).
    timeout 300 python3 benchmarks/probe_md_rebuilds.py --steps 1000 --ab 2 --out "$OUT" --name probe_md_rebuilds_ab_h200 \
      >"$OUT/probe_md_rebuilds_ab.log" 2>&1; grep -E "^\| " "$OUT/probe_md_rebuilds_ab_h200.md" | head -24; tail -2 "$OUT/probe_md_rebuilds_ab.log"
    timeout 130 python3 benchmarks/bench_engine.py --sections md --budget-s 110 --out "$OUT" --name engine_md_h200 \
      >"$OUT/bench_engine_md.log" 2>&1; grep -E "^\| " "$OUT/engine_md_h200.md" | tail -6; tail -1 "$OUT/bench_engine_md.log"
    ;;
  stop67e)
    # Where a periodic box's Verlet rebuild goes (192 water atoms: ~2.7-3.7 ms against ~0.35 for a kept step, its
    # list built on the device): torch.profiler tables of rebuilding and keeping calculations.
    timeout 200 python3 benchmarks/probe_md_rebuilds.py --steps 500 --systems water192-pbc --profile water192-pbc \
      --out "$OUT" --name probe_md_rebuilds_pbc_h200 >"$OUT/probe_md_rebuilds_pbc.log" 2>&1
    grep -E "^\| " "$OUT/probe_md_rebuilds_pbc_h200.md" | head -4; tail -2 "$OUT/probe_md_rebuilds_pbc.log"
    ;;
  stop67f)
    # The GPU tests outside tests/kernels at stop 67's code (complete lists, rebuilds ahead, the host fill).
    timeout 560 python3 -m pytest -q -p no:cacheprovider -m gpu tests --ignore=tests/kernels \
      >"$OUT/pytest_gpu.log" 2>&1; tail -3 "$OUT/pytest_gpu.log"
    ;;
  stop67g)
    # A periodic box's rebuild with its device inputs kept (the Verlet build's cell / pbc / batch / ptr, the fill's
    # numbers and batch vector, the molecular test from the cached host geometry): GPU tests of the lists and the
    # Verlet path, the MD A/B (caches off / on, alternating), torch.profiler of the rebuilds.
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_neighbors.py tests/test_engine_verlet.py \
      tests/test_engine_npt.py tests/test_exact_pairs.py tests/test_launch_ahead.py -m gpu >"$OUT/pytest_lists.log" 2>&1
    tail -2 "$OUT/pytest_lists.log"
    timeout 150 python3 benchmarks/probe_md_rebuilds.py --steps 1000 --systems water192-pbc --caches-ab 3 --out "$OUT" \
      --name probe_md_rebuilds_caches_h200 >"$OUT/probe_md_rebuilds_caches.log" 2>&1
    grep -E "^\| " "$OUT/probe_md_rebuilds_caches_h200.md" | head -10; tail -2 "$OUT/probe_md_rebuilds_caches.log"
    timeout 100 python3 benchmarks/probe_md_rebuilds.py --steps 300 --systems water192-pbc --profile water192-pbc \
      --out "$OUT" --name probe_md_rebuilds_pbc_h200 >"$OUT/probe_md_rebuilds_pbc.log" 2>&1
    grep -E "^## |cudaStreamSynchronize|cudaMemcpyAsync|Self CPU time total" "$OUT/probe_md_rebuilds_pbc_h200.md" | head -12
    ;;
  stop67h)
    # The final tree (review: comments, the kept device inputs across a reset): the GPU tests of the lists, the Verlet
    # path, the zero-copy step, the launches ahead, NPT, float64 pairs and the calculator; bench_engine's MD row.
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_neighbors.py tests/test_engine_verlet.py \
      tests/test_engine_zero_copy.py tests/test_launch_ahead.py tests/test_engine_npt.py tests/test_exact_pairs.py \
      tests/test_calculator.py tests/test_batched_md.py -m gpu >"$OUT/pytest_final.log" 2>&1; tail -2 "$OUT/pytest_final.log"
    timeout 130 python3 benchmarks/bench_engine.py --sections md --budget-s 110 --out "$OUT" --name engine_md_h200 \
      >"$OUT/bench_engine_md.log" 2>&1; grep -E "^\| " "$OUT/engine_md_h200.md" | tail -6; tail -1 "$OUT/bench_engine_md.log"
    ;;
  stop67i)
    # The review's one cache of kept device copies (devices.KeptCopies) under the Verlet build and fill: the GPU tests.
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_neighbors.py tests/test_engine_verlet.py \
      tests/test_engine_zero_copy.py tests/test_launch_ahead.py tests/test_engine_npt.py tests/test_exact_pairs.py \
      tests/test_calculator.py tests/test_batched_md.py -m gpu >"$OUT/pytest_review.log" 2>&1; tail -2 "$OUT/pytest_review.log"
    ;;
  stop68d)
    # Langevin followed by the calculator (its next positions predicted, noise included): the CUDA tests of the launch
    # ahead, then the MD step followed / not followed / velocity Verlet, benzene and ethanol, the shipped student.
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_launch_ahead.py -m gpu >"$OUT/pytest_ahead.log" 2>&1
    tail -3 "$OUT/pytest_ahead.log"
    timeout 200 python3 benchmarks/probe_langevin_ahead.py --out "$OUT" --name probe_langevin_ahead_h200 \
      >"$OUT/probe_langevin_ahead.log" 2>&1; tail -16 "$OUT/probe_langevin_ahead.log"
    ;;
  stop68e)
    # stop68d: every followed launch taken, but the followed step slower (316 against 250 µs): the prediction's deepcopy
    # of the NumPy Generator (~57 µs). Now a twin generator whose state is copied (~4 µs): the same rows.
    timeout 200 python3 benchmarks/probe_langevin_ahead.py --out "$OUT" --name probe_langevin_ahead_h200 \
      >"$OUT/probe_langevin_ahead.log" 2>&1; tail -16 "$OUT/probe_langevin_ahead.log"
    timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_launch_ahead.py -m gpu >"$OUT/pytest_ahead.log" 2>&1
    tail -2 "$OUT/pytest_ahead.log"
    ;;
  stop68f)
    # mlff-distill md's own pace (run_md, its defaults: the 128 x 3 student, Langevin with FixCom), its Langevin followed
    # or not, two rounds alternating (the README's row was stop 33's, on the H100).
    timeout 200 python3 benchmarks/probe_langevin_ahead.py --out "$OUT" --name probe_langevin_cli_h200 --systems C6H6 \
      --steps 300 --cli-steps 3000 >"$OUT/probe_langevin_cli.log" 2>&1; tail -14 "$OUT/probe_langevin_cli.log"
    ;;
  stop68g)
    # stop68f's host ran the followed Langevin slower (467-492 against 363-393 µs), as e/'s second benzene round did
    # (425): the prediction now makes FixCom's adjustments itself (30 µs against 56 on the development CPU), and the
    # integrators' order rotates from round to round. Benzene and ethanol, then mlff-distill md's own pace.
    timeout 150 python3 benchmarks/probe_langevin_ahead.py --out "$OUT" --name probe_langevin_ahead_h200 \
      --steps 800 --rounds 2 --cli-steps 2000 >"$OUT/probe_langevin_ahead.log" 2>&1
    tail -22 "$OUT/probe_langevin_ahead.log"
    ;;
  stop69a)
    # the dense step (kernels/dense_step.py: six launches, one program per atom) against the engine's captured step;
    # its CUDA tests; the repulsion's GPU tests owed since stop 68's _pair_terms helper
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_dense_step.py -x >"$OUT/pytest_dense.log" 2>&1
    tail -3 "$OUT/pytest_dense.log"
    timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_repulsion.py tests/test_model_repulsion.py \
      >"$OUT/pytest_repulsion.log" 2>&1
    tail -3 "$OUT/pytest_repulsion.log"
    timeout 230 python3 benchmarks/probe_dense_step.py --out "$OUT" --name probe_dense_step_h200 >"$OUT/probe_dense_step.log" 2>&1
    tail -40 "$OUT/probe_dense_step.log"
    ;;
  stop69b)
    # the dense step: its CUDA tests; benzene and water against the engine's captured step, L2 flushed and warm, its
    # kernels' device times, an L2 prefetch of the weights; then stop68g's followed Langevin (owed since stop 68)
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_dense_step.py >"$OUT/pytest_dense.log" 2>&1
    tail -2 "$OUT/pytest_dense.log"
    timeout 200 python3 benchmarks/probe_dense_step.py --out "$OUT" --name probe_dense_step_h200 --molecules C6H6,H2O \
      --variants "pdl off;pdl off + L2 prefetch;default" --g2 1024 >"$OUT/probe_dense_step.log" 2>&1
    grep -E "^\| |^- " "$OUT/probe_dense_step_h200.md" | tail -16
    timeout 150 python3 benchmarks/probe_langevin_ahead.py --out "$OUT" --name probe_langevin_ahead_h200 \
      --steps 800 --rounds 2 --cli-steps 2000 >"$OUT/probe_langevin_ahead.log" 2>&1
    tail -22 "$OUT/probe_langevin_ahead.log"
    ;;
  stop69c)
    # Nsight Compute on the dense step's six kernels (benzene, 64 x 3, L2 prefetch, PDL off): stalls, then the
    # per-instruction stall samples of the layer-1 forward and backward
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    echo "ncu: $NCU"
    secs=(--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats
          --section MemoryWorkloadAnalysis --section SourceCounters)
    timeout 150 "$NCU" --clock-control none -k "regex:_dense" --launch-skip 30 -c 6 "${secs[@]}" \
      --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
      --log-file "$OUT/ncu_dense.txt" python3 benchmarks/probe_dense_step.py --loop 8 >"$OUT/ncu_run.log" 2>&1
    echo "ncu rc $?"; tail -3 "$OUT/ncu_run.log"
    grep -E "_dense|Duration|Registers Per|Warp Cycles Per Issued|Issue Slots Busy|Executed Ipc A|stalled_(long|short|barrier|wait|math|mio|lg|no_inst|branch|dispatch|not_sel|selected|sleep|drain|membar|tex|imc)[a-z_]*_per" "$OUT/ncu_dense.txt" | head -120
    for k in 1 4; do
      timeout 120 "$NCU" --clock-control none -k "regex:_dense" --launch-skip $((30 + k)) -c 1 --section SourceCounters \
        --page source --print-source sass --log-file "$OUT/ncu_source_$k.txt" python3 benchmarks/probe_dense_step.py \
        --loop 8 >"$OUT/ncu_source_run_$k.log" 2>&1
      echo "source $k rc $?"; tail -2 "$OUT/ncu_source_run_$k.log"; wc -l "$OUT/ncu_source_$k.txt"; gzip "$OUT/ncu_source_$k.txt"
    done
    ;;
  stop69d)
    # the dense step's launch variants after Nsight Compute (c/: a latency chain, ~10 cycles an instruction): more
    # warps, each backward's feature and geometry parts in programs of their own; benzene and water, both students
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_dense_step.py >"$OUT/pytest_dense.log" 2>&1
    tail -2 "$OUT/pytest_dense.log"
    timeout 330 python3 benchmarks/probe_dense_step.py --out "$OUT" --name probe_dense_step_h200 --molecules C6H6,H2O \
      --variants "pdl off + L2 prefetch;prefetch, 8 warps;prefetch, split;prefetch, split, 8 warps;prefetch, split, 16 warps" \
      --g2 "" >"$OUT/probe_dense_step.log" 2>&1
    grep -E "^\| |^- " "$OUT/probe_dense_step_h200.md" | tail -24
    ;;
  stop69e)
    # the dense step in the engine (ForceEngine(dense_small=None): on CUDA for students up to 64 features): its GPU
    # tests, the benzene step through the engine against dense_small=False, and the ASE MD step on and off
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_dense_step.py tests/test_engine_dense.py \
      >"$OUT/pytest_dense.log" 2>&1
    tail -3 "$OUT/pytest_dense.log"
    timeout 200 python3 benchmarks/probe_dense_step.py --out "$OUT" --name probe_dense_step_h200 --molecules C6H6 \
      --variants "shipped" --g2 "" --md-steps 400 >"$OUT/probe_dense_step.log" 2>&1
    grep -E "^\| |^- " "$OUT/probe_dense_step_h200.md" | tail -24
    ;;
  stop69f)
    # stop69e's GPU test again (its CPU tests' Triton fixture had set the CUDA test's reference engine on the
    # interpreter-less CPU), then the MD paths' other CUDA tests with the dense step in the engine
    timeout 140 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_engine_dense.py tests/test_launch_ahead.py \
      tests/test_engine_zero_copy.py >"$OUT/pytest_dense_engine.log" 2>&1
    tail -4 "$OUT/pytest_dense_engine.log"
    ;;
  stop69g)
    # stop69f's tests (the engine's CUDA test of the dense step, the MD paths' CUDA tests with it), then the dense
    # step on BDA (16 atoms) and biphenyl (22 atoms: 32 slots) against the model's step: DENSE_MAX_ATOMS 16 or 32?
    timeout 140 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_engine_dense.py tests/test_launch_ahead.py \
      tests/test_engine_zero_copy.py >"$OUT/pytest_dense_engine.log" 2>&1
    tail -4 "$OUT/pytest_dense_engine.log"
    timeout 200 python3 benchmarks/probe_dense_step.py --out "$OUT" --name probe_dense_step_h200 \
      --molecules C6H6,BDA,biphenyl --variants "shipped" --g2 "" >"$OUT/probe_dense_step.log" 2>&1
    grep -E "^\| |^- " "$OUT/probe_dense_step_h200.md" | tail -16
    ;;
  stop70b)
    # stop69g's CUDA tests again after the float64 compile fix (Triton 3.6 could not compile rx / d in the engine's
    # float64 launch) and the fallback, then the node products summed along tile rows (DenseStep(rows=...)).
    timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_engine_dense.py tests/test_launch_ahead.py \
      tests/test_engine_zero_copy.py tests/kernels/test_dense_step.py >"$OUT/pytest_dense_engine.log" 2>&1
    tail -4 "$OUT/pytest_dense_engine.log"
    timeout 330 python3 benchmarks/probe_dense_step.py --out "$OUT" --name probe_dense_rows_h200 \
      --students builtin:chno-gfn2-small --molecules C6H6 --g2 "" \
      --variants "shipped;rows;rows, forward;rows, backward;rows, 8 warps" >"$OUT/probe_dense_step.log" 2>&1
    grep -E "^\| " "$OUT/probe_dense_rows_h200.md" | tail -12
    ;;
  stop70c)
    # the node products along tile rows with more warps (stop70b: rows + 8 warps 69.4 against 90.6 us), both
    # students; the engine with DENSE_MAX_HIDDEN 128 for this run; MD steps with the new defaults
    timeout 520 python3 benchmarks/probe_dense_step.py --out "$OUT" --name probe_dense_warps_h200 \
      --molecules C6H6 --g2 "" --dense-max-hidden 128 --md-steps 300 \
      --variants "shipped;stop 69;rows, 16 warps;rows, 16 / 8 warps;rows, 8 / 16 warps" >"$OUT/probe_dense_step.log" 2>&1
    grep -E "^\| " "$OUT/probe_dense_warps_h200.md" | head -30
    ;;
  stop70d)
    # the CUDA tests at the new defaults (rows, 8 warps), then the dense step on BDA (16 atoms) and biphenyl (22
    # atoms: 32 slots) against the model's step again: does DENSE_MAX_ATOMS 32 pay now?
    timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_engine_dense.py tests/test_launch_ahead.py \
      tests/test_engine_zero_copy.py tests/kernels/test_dense_step.py >"$OUT/pytest_dense_engine.log" 2>&1
    tail -4 "$OUT/pytest_dense_engine.log"
    timeout 200 python3 benchmarks/probe_dense_step.py --out "$OUT" --name probe_dense_sizes_h200 \
      --students builtin:chno-gfn2-small --molecules C6H6,BDA,biphenyl --g2 "" --variants "shipped" \
      >"$OUT/probe_dense_step.log" 2>&1
    grep -E "^\| " "$OUT/probe_dense_sizes_h200.md" | head -12
    ;;
  stop70e)
    # DENSE_MAX_ATOMS 32 (16 or 32 slots): the CUDA tests, then the engine's own choice on benzene and biphenyl
    timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_engine_dense.py tests/test_launch_ahead.py \
      tests/test_engine_zero_copy.py >"$OUT/pytest_dense_engine.log" 2>&1
    tail -4 "$OUT/pytest_dense_engine.log"
    timeout 200 python3 benchmarks/probe_dense_step.py --out "$OUT" --name probe_dense_engine32_h200 \
      --students builtin:chno-gfn2-small --molecules C6H6,biphenyl --g2 "" --variants "shipped" \
      >"$OUT/probe_dense_step.log" 2>&1
    grep -E "^\| " "$OUT/probe_dense_engine32_h200.md" | head -9
    ;;
  stop70f)
    # the scratch rows written in joined tiles (DenseStep(join=True): the forward's barriers 87 -> 63 on sm_90):
    # the dense kernel and engine CUDA tests, then benzene against stop 70's rows-only launch. Dropped after it
    # (no gain): check out 5ad5164 to run it again (benchmarks/results/stop70_gpu/join_dropped.diff applies at 167881f).
    timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_engine_dense.py tests/kernels/test_dense_step.py \
      >"$OUT/pytest_dense_engine.log" 2>&1
    tail -2 "$OUT/pytest_dense_engine.log"
    timeout 130 python3 benchmarks/probe_dense_step.py --out "$OUT" --name probe_dense_join_h200 \
      --students builtin:chno-gfn2-small --molecules C6H6 --g2 "" --variants "shipped;stop 70, rows" \
      >"$OUT/probe_dense_step.log" 2>&1
    grep -E "^\| " "$OUT/probe_dense_join_h200.md" | head -12 || tail -8 "$OUT/probe_dense_step.log"
    ;;
  stop71a)
    # prepared at stop 70 (not run): the first forward's pair geometry kept for the other five launches
    # (DenseStep(geometry=True): on sm_90 the six kernels' instructions a warp 20,000 -> 15,700). The kernel tests on
    # CUDA (float64 against autograd with it), then benzene and biphenyl against the shipped launch, each with and
    # without PDL (slower at stop 69's launch on 4 warps; the kept geometry leaves the launches' prologues short).
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_dense_step.py tests/test_engine_dense.py \
      >"$OUT/pytest_dense.log" 2>&1
    tail -2 "$OUT/pytest_dense.log"
    timeout 300 python3 benchmarks/probe_dense_step.py --out "$OUT" --name probe_dense_geometry_h200 \
      --students builtin:chno-gfn2-small --molecules C6H6,biphenyl --g2 "" \
      --variants "shipped;geometry kept;pdl;geometry kept, pdl" \
      >"$OUT/probe_dense_step.log" 2>&1
    grep -E "^\| " "$OUT/probe_dense_geometry_h200.md" | head -12 || tail -8 "$OUT/probe_dense_step.log"
    ;;
  stop71b)
    # stop 71: the kept geometry on by default (stop71a: benzene 69.1 -> 67.1 us, biphenyl 92.5 -> 72.7); fan
    # (DenseStep(fan=...)): each launch's serial tail in programs of their own after a shared head. The CUDA cases of
    # the dense tests (stop71a's run of the whole files, interpreter cases included, ran past its 120 s), then benzene
    # and biphenyl with fan in both directions, either alone, and without the kept geometry; the 128 x 3 student's
    # benzene with and without fan (its dense step lost to the engine's 159 us at stop 70: 194).
    timeout 240 python3 -m pytest -q -p no:cacheprovider -k cuda tests/kernels/test_dense_step.py \
      tests/test_engine_dense.py >"$OUT/pytest_dense.log" 2>&1
    tail -3 "$OUT/pytest_dense.log"
    timeout 240 python3 benchmarks/probe_dense_step.py --out "$OUT" --name probe_dense_fan_h200 \
      --students builtin:chno-gfn2-small --molecules C6H6,biphenyl --g2 "" \
      --variants "shipped;fan;fan forward;fan backward;no geometry" >"$OUT/probe_dense_step.log" 2>&1
    grep -E "^\| " "$OUT/probe_dense_fan_h200.md" | head -14 || tail -8 "$OUT/probe_dense_step.log"
    timeout 120 python3 benchmarks/probe_dense_step.py --out "$OUT" --name probe_dense_fan_128_h200 \
      --students builtin:chno-gfn2 --molecules C6H6 --g2 "" --variants "shipped;fan" \
      >"$OUT/probe_dense_step_128.log" 2>&1
    grep -E "^\| " "$OUT/probe_dense_fan_128_h200.md" | head -6 || tail -8 "$OUT/probe_dense_step_128.log"
    ;;
  stop71c)
    # stop 71: fan forward on by default (stop71b: benzene 65.5 -> 62.6 us, biphenyl 72.6 -> 68.5). early: with PDL,
    # each launch's geometry, filter products and (backward) the forward's values before its wait for the previous
    # launch, overlapping that launch. Against the shipped launch and PDL alone; the errors are checked again after
    # the back-to-back replays (a race between overlapping launches would show there).
    timeout 300 python3 benchmarks/probe_dense_step.py --out "$OUT" --name probe_dense_early_h200 \
      --students builtin:chno-gfn2-small --molecules C6H6,biphenyl --g2 "" \
      --variants "shipped;pdl;early;early, fan both;early, no geometry" >"$OUT/probe_dense_step.log" 2>&1
    grep -E "^\| " "$OUT/probe_dense_early_h200.md" | head -14 || tail -8 "$OUT/probe_dense_step.log"
    timeout 100 python3 benchmarks/probe_dense_step.py --out "$OUT" --name probe_dense_early_128_h200 \
      --students builtin:chno-gfn2 --molecules C6H6 --g2 "" --variants "shipped;early" \
      >"$OUT/probe_dense_step_128.log" 2>&1
    grep -E "^\| " "$OUT/probe_dense_early_128_h200.md" | head -6 || tail -8 "$OUT/probe_dense_step_128.log"
    ;;
  stop71d)
    # stop 71's defaults (the kept geometry, fan forward, PDL with early; stop71c: benzene 55.7 us, biphenyl 66.2):
    # the CUDA cases of the dense tests (with the new back-to-back replay test of the overlapping launches), then
    # benzene and biphenyl through the engine and the ASE MD step, dense step on and off, two rounds.
    timeout 240 python3 -m pytest -q -p no:cacheprovider -k cuda tests/kernels/test_dense_step.py \
      tests/test_engine_dense.py >"$OUT/pytest_dense.log" 2>&1
    tail -3 "$OUT/pytest_dense.log"
    timeout 300 python3 benchmarks/probe_dense_step.py --out "$OUT" --name probe_dense_final_h200 \
      --students builtin:chno-gfn2-small --molecules C6H6,biphenyl --g2 "" --variants "shipped" --md-steps 400 \
      >"$OUT/probe_dense_step.log" 2>&1
    grep -E "^\| " "$OUT/probe_dense_final_h200.md" | head -14 || tail -8 "$OUT/probe_dense_step.log"
    ;;
  stop71e)
    # 64 slots, untimed so far (the engine's dense step stops at 32 atoms): C60 (60 atoms) through DenseStep with
    # stop 71's defaults (fan forward: 256 programs a forward launch), without fan, and with stop 70's launch,
    # against the engine's captured step; benzene's rows again with PDL on for "shipped" (run d's had it off).
    timeout 300 python3 benchmarks/probe_dense_step.py --out "$OUT" --name probe_dense_64slots_h200 \
      --students builtin:chno-gfn2-small --molecules C60,C6H6 --g2 "" --variants "shipped;no fan;stop 70 launch" \
      >"$OUT/probe_dense_step.log" 2>&1
    grep -E "^\| " "$OUT/probe_dense_64slots_h200.md" | head -14 || tail -8 "$OUT/probe_dense_step.log"
    ;;
  stop71f)
    # the engine's dense step up to 64 atoms (DENSE_SLOTS 16, 32, 64) and fan "auto" (off at 64 slots): C60 and
    # benzene through the engine, then the engine's CUDA test in fp32 (benzene, biphenyl, C60, MD)
    timeout 120 python3 benchmarks/probe_dense_step.py --out "$OUT" --name probe_dense_engine64_h200 \
      --students builtin:chno-gfn2-small --molecules C60,C6H6 --g2 "" --variants "shipped" \
      >"$OUT/probe_dense_step.log" 2>&1
    grep -E "^\| " "$OUT/probe_dense_engine64_h200.md" | head -8 || tail -8 "$OUT/probe_dense_step.log"
    timeout 110 python3 -m pytest -q -p no:cacheprovider -k "cuda and fp32" tests/test_engine_dense.py \
      >"$OUT/pytest_engine_dense.log" 2>&1
    tail -3 "$OUT/pytest_engine_dense.log"
    ;;
  stop72a)
    # prepared at stop 71 (not run): DENSE_ZERO_IN_KERNEL (the dense step's first launch zeros the engine's packed
    # output instead of a fill node before it) and the backward's ablation instrument (DenseStep(ablate=1 / 2): a
    # split backward's feature or geometry programs left out, wrong results, to see which kind is the long one).
    # The CUDA tests first (the engine's with C60 in fp64 has not run on a GPU), then benzene and biphenyl through
    # the engine with the zeroing off and on, and the ablation variants beside the shipped launch.
    timeout 240 python3 -m pytest -q -p no:cacheprovider -k cuda tests/kernels/test_dense_step.py \
      tests/test_engine_dense.py >"$OUT/pytest_dense.log" 2>&1
    tail -3 "$OUT/pytest_dense.log"
    timeout 300 python3 benchmarks/probe_dense_step.py --out "$OUT" --name probe_dense_zero_h200 \
      --students builtin:chno-gfn2-small --molecules C6H6,biphenyl --g2 "" --dense-zero both \
      --variants "shipped;ablate features;ablate geometry" >"$OUT/probe_dense_step.log" 2>&1
    grep -E "^\| " "$OUT/probe_dense_zero_h200.md" | head -14 || tail -8 "$OUT/probe_dense_step.log"
    ;;
  stop72b)
    # stop 72: the backward's update-block rows now load before its wait (always), and the L1 prefetch option
    # (DenseStep(l1=True): each launch asks L1 for the weight tiles of the products after its wait, before it);
    # the fan both ways again beside it (stop 71: slower, before early loads). Benzene, biphenyl, C60.
    timeout 420 python3 benchmarks/probe_dense_step.py --out "$OUT" --name probe_dense_l1_h200 \
      --students builtin:chno-gfn2-small --molecules C6H6,biphenyl,C60 --g2 "" \
      --variants "shipped;l1;l1, fan both;fan both" >"$OUT/probe_dense_step.log" 2>&1
    grep -E "^\| " "$OUT/probe_dense_l1_h200.md" | head -18 || tail -8 "$OUT/probe_dense_step.log"
    ;;
  stop72c)
    # stop 72's code (the backward's update-block rows before its wait; stop72b: benzene 55.6 -> 54.1 us alone, 56.5
    # -> 55.3 through the engine): the CUDA cases of the dense tests (the back-to-back replays of the overlapping
    # launches, the engine's three molecules in fp32 and fp64), then benzene, biphenyl and C60 through the engine and
    # the ASE MD step, dense step on and off.
    timeout 240 python3 -m pytest -q -p no:cacheprovider -k cuda tests/kernels/test_dense_step.py \
      tests/test_engine_dense.py >"$OUT/pytest_dense.log" 2>&1
    tail -3 "$OUT/pytest_dense.log"
    timeout 300 python3 benchmarks/probe_dense_step.py --out "$OUT" --name probe_dense_final_h200 \
      --students builtin:chno-gfn2-small --molecules C6H6,biphenyl,C60 --g2 "" --variants "shipped" --md-steps 400 \
      >"$OUT/probe_dense_step.log" 2>&1
    grep -E "^\| " "$OUT/probe_dense_final_h200.md" | head -16 || tail -8 "$OUT/probe_dense_step.log"
    ;;
  stop72d)
    # stop72c's MD rows spread (on: 175.2 then 197.3 us; off: 218.6 then 193.2; stop 71: 157.4 / 159.8 on): the ASE MD
    # step again, twice in two processes, with the host's load beside it (the step is host-bound).
    uptime; nproc
    for k in 1 2; do
      timeout 200 python3 benchmarks/probe_dense_step.py --out "$OUT" --name probe_dense_md${k}_h200 \
        --students builtin:chno-gfn2-small --molecules C6H6 --g2 "" --variants "shipped" --md-steps 400 \
        >"$OUT/probe_dense_md${k}.log" 2>&1
      grep -E "^\| builtin.* \| (on|off) \|" "$OUT/probe_dense_md${k}_h200.md" || tail -8 "$OUT/probe_dense_md${k}.log"
      uptime
    done
    ;;
  stop72e)
    # stop 72's fused reductions (the sums over the slots in one variadic reduction a launch; summed node products
    # reduced once; U and V, M1's two blocks, M2's blocks one reduction each; sm_90 SASS: the backward 3,064 -> 2,824
    # instructions, 87 -> 77 barriers): the CUDA cases of the dense tests, then benzene, biphenyl and C60 alone
    # (shipped and fan both ways) and through the engine, against stop72c (54.1 / 54.8, 65.1 / 66.8, 108.3 / 111.5).
    timeout 240 python3 -m pytest -q -p no:cacheprovider -k cuda tests/kernels/test_dense_step.py \
      tests/test_engine_dense.py >"$OUT/pytest_dense.log" 2>&1
    tail -3 "$OUT/pytest_dense.log"
    timeout 300 python3 benchmarks/probe_dense_step.py --out "$OUT" --name probe_dense_fused_h200 \
      --students builtin:chno-gfn2-small --molecules C6H6,biphenyl,C60 --g2 "" --variants "shipped;fan both" \
      >"$OUT/probe_dense_step.log" 2>&1
    grep -E "^\| " "$OUT/probe_dense_fused_h200.md" | head -16 || tail -8 "$OUT/probe_dense_step.log"
    ;;
  stop73a)
    # stop72e's rows again (benzene 47.8 us alone, 48.8 through the engine: one run, 1.2 us under the 0.05 ms target)
    # in two processes, with the MD step; then the 128 x 3 student's dense step against its engine step (stop 71:
    # 175.0 against 156.9, before the update rows and the fused reductions), which the engine does not take
    # (engine_padded.DENSE_MAX_HIDDEN = 64). First the grouped sums' own test on CUDA and warmup's dense steps of
    # every slot count replayed (both new at stop 73).
    timeout 150 python3 -m pytest -q -p no:cacheprovider -k "cuda and (reductions or products or sums or warmed)" \
      tests/kernels/test_dense_reductions.py tests/test_engine_dense.py >"$OUT/pytest_reductions.log" 2>&1
    tail -2 "$OUT/pytest_reductions.log"
    for k in 1 2; do
      timeout 200 python3 benchmarks/probe_dense_step.py --out "$OUT" --name probe_dense_repeat${k}_h200 \
        --students builtin:chno-gfn2-small --molecules C6H6,biphenyl,C60 --g2 "" --variants "shipped" \
        --md-steps 400 >"$OUT/probe_dense_repeat${k}.log" 2>&1
      grep -E "^\| builtin" "$OUT/probe_dense_repeat${k}_h200.md" | head -12 || tail -8 "$OUT/probe_dense_repeat${k}.log"
    done
    timeout 150 python3 benchmarks/probe_dense_step.py --out "$OUT" --name probe_dense_128_h200 \
      --students builtin:chno-gfn2 --molecules C6H6,biphenyl --g2 "" --variants "shipped" \
      >"$OUT/probe_dense_step_128.log" 2>&1
    grep -E "^\| builtin" "$OUT/probe_dense_128_h200.md" | head -6 || tail -8 "$OUT/probe_dense_step_128.log"
    ;;
  stop73b)
    # issue 5's benchmark for a 64 x 3 student (random weights, the g2 species: the dense step applies): the
    # single-molecule table in every mode beside the torch reference, the MD step, and the cold / warm start of a
    # fresh process (the dense step's kernels compiled, then from the cache: not measured before; the last such
    # table, engine_small_h100.md, predates the dense step)
    timeout 560 python3 benchmarks/bench_engine.py --hidden 64 --sections latency,md,startup --budget-s 520 \
      --out "$OUT" --name engine_small_h200 >"$OUT/bench_engine_small.log" 2>&1
    grep -E "^\| " "$OUT/engine_small_h200.md" | head -40 || tail -8 "$OUT/bench_engine_small.log"
    ;;
  stop73c)
    # issue 5's table for a 64 x 3 student again (b/ timed the model's step in its "step" column where compute
    # takes the dense step: fixed), each row naming the step it took, the start-up rows too (was b/'s cold 4.21 s
    # the dense step's compile, or the model's step?); then the batch sweep (1, 16, 1,024, 4,096 g2 molecules) and
    # the precision table for the same student, fp32 / tf32 / bf16 captured
    timeout 290 python3 benchmarks/bench_engine.py --hidden 64 --sections latency,md,startup \
      --variants "=cudagraph,=eager (triton)" --budget-s 260 --out "$OUT" --name engine_small_h200 \
      >"$OUT/bench_engine_small.log" 2>&1
    grep -E "^\| " "$OUT/engine_small_h200.md" | head -30 || tail -8 "$OUT/bench_engine_small.log"
    timeout 230 python3 benchmarks/bench_engine.py --hidden 64 --sections sweep,errors --sizes 1,16,1024,4096 \
      --variants "=cudagraph fp32,=cudagraph tf32,=cudagraph bf16" --budget-s 200 --out "$OUT" \
      --name engine_small_h200 >"$OUT/bench_engine_small_sweep.log" 2>&1
    grep -E "^\| " "$OUT/engine_small_h200.md" | tail -28 || tail -8 "$OUT/bench_engine_small_sweep.log"
    ;;
  stop73d)
    # The dense step under tf32 / bf16 / fp16 (new at e615cf6: strict float32 where the weights stay float32): the
    # CUDA tests of the engine's dense step (the shipped student's now in bf16 too); one g2 molecule per precision
    # (c/: tf32 116.7, bf16 115.5 µs with the model's step, fp32 51.7 with the dense step); then bench_engine's MD
    # section twice more (c/: 133.6 µs; a/'s probe rounds 149-218: how far a round spreads)
    timeout 240 python3 -m pytest -q -p no:cacheprovider -k cuda tests/test_engine_dense.py \
      >"$OUT/pytest_engine_dense.log" 2>&1
    tail -3 "$OUT/pytest_engine_dense.log"
    timeout 150 python3 benchmarks/bench_engine.py --hidden 64 --sections sweep --sizes 1,16 \
      --variants "=cudagraph fp32,=cudagraph tf32,=cudagraph bf16,=cudagraph fp16" --budget-s 130 --out "$OUT" \
      --name engine_small_b1_h200 >"$OUT/bench_engine_b1.log" 2>&1
    grep -E "^\| " "$OUT/engine_small_b1_h200.md" | tail -12 || tail -8 "$OUT/bench_engine_b1.log"
    for k in 1 2; do
      timeout 100 python3 benchmarks/bench_engine.py --hidden 64 --sections md --budget-s 90 --out "$OUT" \
        --name engine_small_md${k}_h200 >"$OUT/bench_engine_md${k}.log" 2>&1
      grep -E "^\| " "$OUT/engine_small_md${k}_h200.md" | tail -4 || tail -8 "$OUT/bench_engine_md${k}.log"
    done
    ;;
  stop73e)
    # The GPU tests outside tests/kernels (engine, calculator, MD, NPT, ...), last run whole at stop 67 (89 passed);
    # since then the dense step (stops 69-72) and its tf32 / bf16 / fp16 use (stop 73)
    timeout 430 python3 -m pytest -q -p no:cacheprovider -m gpu tests --ignore=tests/kernels --timeout=300 \
      >"$OUT/pytest_gpu.log" 2>&1; tail -3 "$OUT/pytest_gpu.log"; grep -E "^(FAILED|ERROR)" "$OUT/pytest_gpu.log" | head -20
    ;;
  stop74a)
    # Owed from stop 73: the mended GPU test (its engine dense_small=False), then every GPU test under tests/kernels
    # (the dense step's, the kernels'; -m gpu and the CUDA parametrisations), then bench_engine's 64 x 3 MD section
    # twice (stop 73: 133.6 on one machine, 226.5 / 250.6 on another: the host's spread)
    timeout 120 python3 -m pytest -q -p no:cacheprovider \
      "tests/test_engine_modes.py::test_captured_steps_sum_the_edge_gradients_on_a_second_stream" \
      >"$OUT/pytest_mended.log" 2>&1; tail -2 "$OUT/pytest_mended.log"
    timeout 300 python3 -m pytest -q -p no:cacheprovider -k "cuda or gpu" tests/kernels --timeout=240 \
      >"$OUT/pytest_kernels_gpu.log" 2>&1; tail -2 "$OUT/pytest_kernels_gpu.log"
    grep -E "^(FAILED|ERROR)" "$OUT/pytest_kernels_gpu.log" | head -10
    for k in 1 2; do
      timeout 80 python3 benchmarks/bench_engine.py --hidden 64 --sections md --budget-s 70 --out "$OUT" \
        --name engine_small_md${k}_h200 >"$OUT/bench_engine_md${k}.log" 2>&1
      grep -E "^\| " "$OUT/engine_small_md${k}_h200.md" | tail -4 || tail -8 "$OUT/bench_engine_md${k}.log"
    done
    ;;
  stop74b)
    # Stop 74: where one call beyond its step goes (bench_small_e2e --parts: the host list, the fill, the device lists
    # beside them; cProfile of benzene), 64 and 128 wide; then the mended GPU test and the MD section twice (stop74a's
    # first and last parts; its tests/kernels part runs at the end of the stop, on the final code)
    for h in 64 128; do
      timeout 200 python3 benchmarks/bench_small_e2e.py --hidden $h --batches 16,256,1024,4096 --parts --profile \
        --reps 300 --out "$OUT" --name small_e2e_h${h}_h200 >"$OUT/small_e2e_h${h}.log" 2>&1
      grep -E "^\| " "$OUT/small_e2e_h${h}_h200.md" || tail -15 "$OUT/small_e2e_h${h}.log"
    done
    timeout 120 python3 -m pytest -q -p no:cacheprovider \
      "tests/test_engine_modes.py::test_captured_steps_sum_the_edge_gradients_on_a_second_stream" \
      >"$OUT/pytest_mended.log" 2>&1; tail -2 "$OUT/pytest_mended.log"
    for k in 1 2; do
      timeout 80 python3 benchmarks/bench_engine.py --hidden 64 --sections md --budget-s 70 --out "$OUT" \
        --name engine_small_md${k}_h200 >"$OUT/bench_engine_md${k}.log" 2>&1
      grep -E "^\| " "$OUT/engine_small_md${k}_h200.md" | tail -4 || tail -8 "$OUT/bench_engine_md${k}.log"
    done
    ;;
  stop74c)
    # Stop 74 after the changes: one molecule for the dense step without its list, molecular batches past 32,768
    # candidates listed on the device. bench_small_e2e --parts --profile 64 and 128 wide (one log for both: the
    # device returns 8 files at most); the new and touched GPU tests; every -m gpu test outside tests/kernels.
    for h in 64 128; do
      timeout 170 python3 benchmarks/bench_small_e2e.py --hidden $h --batches 16,256,1024,4096 --parts --profile \
        --reps 300 --out "$OUT" --name small_e2e_h${h}_h200 >>"$OUT/small_e2e.log" 2>&1
      grep -E "^\| " "$OUT/small_e2e_h${h}_h200.md" || tail -15 "$OUT/small_e2e.log"
    done
    timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests --ignore=tests/kernels \
      >"$OUT/pytest_gpu.log" 2>&1
    tail -2 "$OUT/pytest_gpu.log"; grep -E "^(FAILED|ERROR)" "$OUT/pytest_gpu.log" | head -10
    ;;
  stop74d)
    # Stop 74: this stop's lists against stop 73's in one process (bench_small_e2e --ab), 64 and 128 wide; then the
    # -m gpu tests outside tests/kernels that stop74c's 300 s did not reach (it passed the first 46, to
    # test_engine_modes.py's 11th), from test_engine_modes.py on
    for h in 64 128; do
      timeout 100 python3 benchmarks/bench_small_e2e.py --hidden $h --batches 16,256,1024,4096 --ab \
        --reps 300 --out "$OUT" --name small_e2e_ab_h${h}_h200 >>"$OUT/small_e2e_ab.log" 2>&1
      grep -E "^\| " "$OUT/small_e2e_ab_h${h}_h200.md" | tail -9 || tail -15 "$OUT/small_e2e_ab.log"
    done
    timeout 390 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_engine_verlet.py tests/test_engine_modes.py \
      tests/test_engine_npt.py tests/test_engine_stress.py tests/test_engine_zero_copy.py tests/test_predict_cache.py \
      tests/test_predict_stream.py tests/test_exact_pairs.py tests/test_first_layer_moments.py \
      tests/test_launch_ahead.py tests/test_model_repulsion.py tests/test_neighbors_periodic.py \
      >"$OUT/pytest_gpu_rest.log" 2>&1
    tail -2 "$OUT/pytest_gpu_rest.log"; grep -E "^(FAILED|ERROR)" "$OUT/pytest_gpu_rest.log" | head -10
    ;;
  stop74e)
    # Stop 74's last call: test_engine_verlet's GPU tests (the mended host-fill test, a large molecule's device-built
    # Verlet list, large molecular batches listed on the device); one large molecule's rebuilds on the host (stop 73)
    # against the device (stop 74) per MD step; then every GPU test under tests/kernels (owed since stop 73)
    timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_engine_verlet.py \
      >"$OUT/pytest_verlet_gpu.log" 2>&1
    tail -2 "$OUT/pytest_verlet_gpu.log"; grep -E "^(FAILED|ERROR)" "$OUT/pytest_verlet_gpu.log" | head -10
    timeout 130 python3 -W ignore benchmarks/probe_molecule_rebuild.py --waters 167,500 --steps 300 --rounds 2 \
      --out "$OUT" --name probe_molecule_rebuild_h200 >"$OUT/probe_molecule_rebuild.log" 2>&1
    grep -E "^\| " "$OUT/probe_molecule_rebuild_h200.md" | tail -4 || tail -15 "$OUT/probe_molecule_rebuild.log"
    timeout 290 python3 -m pytest -q -p no:cacheprovider -k "cuda or gpu" tests/kernels \
      >"$OUT/pytest_kernels_gpu.log" 2>&1; tail -2 "$OUT/pytest_kernels_gpu.log"
    grep -E "^(FAILED|ERROR)" "$OUT/pytest_kernels_gpu.log" | head -10
    ;;
  stop75a)
    # Stop 75: the dry run for a capture in two passes (the warm-up's pointer kernels and the capture's descriptor
    # kernels): every test of test_compile_ahead on the GPU (cold children), then stop 74's review (the dense step's
    # slot helper, the molecular list guard) under the GPU tests of the engine's Verlet, dense and bucket files
    timeout 400 python3 -m pytest -q -p no:cacheprovider -rs tests/kernels/test_compile_ahead.py \
      >"$OUT/pytest_compile_ahead.log" 2>&1
    tail -2 "$OUT/pytest_compile_ahead.log"; grep -E "^(FAILED|ERROR)|^E  " "$OUT/pytest_compile_ahead.log" | head -12
    timeout 170 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_engine_verlet.py tests/test_engine_dense.py \
      tests/test_buckets.py >"$OUT/pytest_engine_gpu.log" 2>&1
    tail -2 "$OUT/pytest_engine_gpu.log"; grep -E "^(FAILED|ERROR)" "$OUT/pytest_engine_gpu.log" | head -10
    ;;
  stop76a)
    # Stop 76: the Triton molecular pairs (kernels/molecular_pairs.py) on the GPU (its tests), then end to end: one
    # call's pieces (host list, Triton and torch device enumeration) and this tree's lists against stop 75's with
    # other host-list limits beside (the 64 x 3 student: parts + A/B; the 128 x 3: A/B)
    timeout 120 python3 -m pytest -q -p no:cacheprovider -rs tests/kernels/test_molecular_pairs.py \
      >"$OUT/pytest_molecular_pairs.log" 2>&1
    tail -2 "$OUT/pytest_molecular_pairs.log"; grep -E "^(FAILED|ERROR)|^E  " "$OUT/pytest_molecular_pairs.log" | head -8
    timeout 230 python3 benchmarks/bench_small_e2e.py --out "$OUT" --name small_e2e_h64 --hidden 64 --parts --ab \
      --ab-limits 2048,8192 --batches 16,64,256,1024,4096 --reps 150 >"$OUT/small_e2e_h64.log" 2>&1
    tail -3 "$OUT/small_e2e_h64.log"; grep -E "^\| " "$OUT/small_e2e_h64.md" | tail -22
    timeout 150 python3 benchmarks/bench_small_e2e.py --out "$OUT" --name small_e2e_h128 --hidden 128 --ab \
      --ab-limits 2048,8192 --batches 16,64,256,1024,4096 --reps 150 >"$OUT/small_e2e_h128.log" 2>&1
    tail -3 "$OUT/small_e2e_h128.log"; grep -E "^\| " "$OUT/small_e2e_h128.md" | tail -10
    ;;
  stop76b)
    # Stop 76: which earlier file makes stop 75's full kernel run fail test_linear's descriptor test and most CUDA
    # cases of test_message_passing (each passed alone): three groups of the files run before them, each followed by
    # those tests, in their own processes
    tgt="tests/kernels/test_linear.py::test_gemm_tma_eager_only_from_its_row_threshold tests/kernels/test_message_passing.py"
    k=0
    for grp in "tests/kernels/test_backend.py tests/kernels/test_dense_reductions.py tests/kernels/test_dense_step.py" \
      "tests/kernels/test_edge_compact.py tests/kernels/test_edge_sink.py" "tests/kernels/test_edge_features.py"; do
      k=$((k + 1))
      timeout 150 python3 -m pytest -q -p no:cacheprovider -p no:randomly --tb=short -k "cuda or gpu" $grp $tgt \
        >"$OUT/bisect_$k.log" 2>&1
      echo "group $k: $grp"; tail -1 "$OUT/bisect_$k.log"; grep -E "^FAILED" "$OUT/bisect_$k.log" | head -3
    done
    ;;
  stop76c)
    # Stop 76: stop76b's first group again with room (its 150 s ran out inside test_dense_step), followed by the
    # descriptor test and test_message_passing's reference tests only; stops at the third failure
    timeout 430 python3 -m pytest -q -p no:cacheprovider -p no:randomly --tb=short --maxfail=3 -k "cuda or gpu" \
      tests/kernels/test_backend.py tests/kernels/test_dense_reductions.py tests/kernels/test_dense_step.py \
      tests/kernels/test_linear.py::test_gemm_tma_eager_only_from_its_row_threshold \
      tests/kernels/test_message_passing.py::test_matches_reference >"$OUT/bisect_group1.log" 2>&1
    tail -1 "$OUT/bisect_group1.log"; grep -E "^FAILED|^E  " "$OUT/bisect_group1.log" | head -12
    ;;
  stop77a)
    # Stop 77: why the benzene MD step (64 x 3, the dense step) takes ~135 µs in one process and ~230 in the next on
    # one machine: the machine's CPUs and the GPU's affinity, then probe_md_affinity in fresh processes, unpinned and
    # pinned to each CPU (taskset), one JSON line each; the table of them
    { nproc; lscpu | head -25; cat /sys/devices/system/node/node*/cpulist 2>/dev/null; nvidia-smi topo -m;
      grep MHz /proc/cpuinfo | head -32; cat /proc/loadavg; } >"$OUT/machine.txt" 2>&1
    head -12 "$OUT/machine.txt"
    rows="$OUT/md_affinity.jsonl"
    timeout 60 python3 benchmarks/probe_md_affinity.py --label "unpinned (cold)" --steps 300 >>"$rows" 2>"$OUT/md_affinity.err"
    for k in 1 2 3; do
      timeout 60 python3 benchmarks/probe_md_affinity.py --label "unpinned $k" >>"$rows" 2>>"$OUT/md_affinity.err"
    done
    n=$(nproc)
    for c in $(seq 0 $((n - 1))); do
      timeout 60 taskset -c "$c" python3 benchmarks/probe_md_affinity.py --label "core $c" >>"$rows" 2>>"$OUT/md_affinity.err"
      [ "$SECONDS" -gt 480 ] && { echo "time: stopped before core $((c + 1))"; break; }
    done
    for k in 4 5; do
      timeout 60 python3 benchmarks/probe_md_affinity.py --label "unpinned $k" >>"$rows" 2>>"$OUT/md_affinity.err"
    done
    python3 benchmarks/probe_md_affinity.py --table "$rows" | tee "$OUT/md_affinity.md"
    tail -5 "$OUT/md_affinity.err"
    ;;
  stop77c)
    # Stop 77: every GPU test of the tree in one call, six pytest processes side by side spread over the machine's GPUs
    # (CUDA_VISIBLE_DEVICES; two on one GPU where there are fewer than six): three shards of tests/kernels' CUDA cases,
    # test_compile_ahead, and the rest's -m gpu tests in two halves (before / from test_engine_modes.py)
    g=$(nvidia-smi -L | wc -l); echo "GPUs: $g"
    k1="tests/kernels/test_backend.py tests/kernels/test_dense_reductions.py tests/kernels/test_dense_step.py
      tests/kernels/test_edge_compact.py tests/kernels/test_edge_sink.py tests/kernels/test_frozen.py
      tests/kernels/test_half_gathers.py"
    k2="tests/kernels/test_edge_features.py tests/kernels/test_linear.py tests/kernels/test_linear_tma.py"
    k3=$(ls tests/kernels/test_*.py | grep -v -e test_compile_ahead $(for f in $k1 $k2; do echo "-e $f"; done) | tr '\n' ' ')
    n1=$(find tests -name 'test_*.py' -not -path 'tests/kernels/*' | sort | awk '$0 < "tests/test_engine_modes.py"' | tr '\n' ' ')
    n2=$(find tests -name 'test_*.py' -not -path 'tests/kernels/*' | sort | awk '$0 >= "tests/test_engine_modes.py"' | tr '\n' ' ')
    i=0
    for job in "kernels1|-k cuda or gpu|$k1" "kernels2|-k cuda or gpu|$k2" "kernels3|-k cuda or gpu|$k3" \
      "compile_ahead||tests/kernels/test_compile_ahead.py" "gpu1|-m gpu|$n1" "gpu2|-m gpu|$n2"; do
      name=${job%%|*}; rest=${job#*|}; sel=${rest%%|*}; files=${rest#*|}
      if [ -n "$sel" ]; then set -- "${sel%% *}" "${sel#* }"; else set --; fi
      CUDA_VISIBLE_DEVICES=$((i % g)) timeout 540 python3 -m pytest -q -p no:cacheprovider -rs --tb=short "$@" \
        $files >"$OUT/pytest_$name.log" 2>&1 &
      i=$((i + 1))
    done
    wait
    for name in kernels1 kernels2 kernels3 compile_ahead gpu1 gpu2; do
      echo "== $name: $(tail -1 "$OUT/pytest_$name.log")"; grep -E "^(FAILED|ERROR)" "$OUT/pytest_$name.log" | head -8
    done
    ;;
  stop77e)
    # Stop 77: predict_forces of one small molecule (the model's state read from the modules' own dicts; one batch not
    # pipelined): the probe's rows, then the GPU tests of the kept engine, the pipeline and the readout control
    timeout 150 python3 benchmarks/probe_predict_one.py --calls 2000 >"$OUT/predict_one.txt" 2>&1
    sed -n 1,16p "$OUT/predict_one.txt"
    timeout 300 python3 -m pytest -q -p no:cacheprovider --tb=short -rs tests/test_predict_cache.py \
      tests/test_engine_modes.py::test_one_batch_on_cuda_is_not_pipelined \
      tests/test_engine_modes.py::test_pipelined_predict_on_cuda tests/test_engine_memory.py tests/test_engine_stress.py \
      "tests/kernels/test_linear.py::test_readout_sums_many_atoms_to_float32_accuracy" >"$OUT/pytest_predict.log" 2>&1
    tail -1 "$OUT/pytest_predict.log"; grep -E "^(FAILED|ERROR)|^E  " "$OUT/pytest_predict.log" | head -10
    ;;
  stop77f)
    # Stop 77: predict_forces of one small molecule at the stop's final code (the state walk, one batch unpipelined,
    # chunks' one batch, no free-memory query for a small call): the probe, then the GPU tests of those paths
    timeout 120 python3 benchmarks/probe_predict_one.py --calls 2000 >"$OUT/predict_one.txt" 2>&1
    sed -n 1,16p "$OUT/predict_one.txt"
    timeout 150 python3 -m pytest -q -p no:cacheprovider --tb=short -rs tests/test_predict_cache.py \
      tests/test_engine_modes.py::test_one_batch_on_cuda_is_not_pipelined \
      tests/test_engine_modes.py::test_pipelined_predict_on_cuda tests/test_engine_memory.py \
      tests/test_batching_chunks.py >"$OUT/pytest_predict.log" 2>&1
    tail -1 "$OUT/pytest_predict.log"; grep -E "^(FAILED|ERROR)|^E  " "$OUT/pytest_predict.log" | head -10
    ;;
  stop78a)
    # Prepared at stop 77 for the next stop: predict_forces of one benzene with stop 77's last host changes
    # (from_atoms cast in NumPy, messages only on failure), the host's speed beside it, and bench_engine's MD section
    # (64 x 3) in two fresh processes with its new host-work column. Then run stop77c (every GPU test, ~450 s).
    python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from harness import host_work_us; print('host work us', host_work_us())"
    timeout 120 python3 benchmarks/probe_predict_one.py --calls 2000 >"$OUT/predict_one.txt" 2>&1
    sed -n 1,16p "$OUT/predict_one.txt"
    for k in 1 2; do
      timeout 100 python3 benchmarks/bench_engine.py --hidden 64 --sections md --budget-s 90 --out "$OUT" \
        --name engine_md${k}_h200 >"$OUT/bench_engine_md${k}.log" 2>&1
      grep -E "^\| " "$OUT/engine_md${k}_h200.md" | tail -5 || tail -8 "$OUT/bench_engine_md${k}.log"
    done
    ;;
  stop78b)
    # Stop 78: stop78a's rows, then the MD step's pieces by manual timers (probe_md_phases.py) in two fresh
    # processes, each with the host's speed before and after.
    bash scripts/gpu_followups.sh stop78a
    for k in 1 2; do
      timeout 120 python3 benchmarks/probe_md_phases.py --steps 3000 >"$OUT/md_phases${k}.txt" 2>&1
      cat "$OUT/md_phases${k}.txt" | tail -30
    done
    ;;
  stop78c)
    # Stop 78: the MD steady state's reuse (StudentCalculator.reuse_ahead: the prediction's batch and the exact time
    # step) A/B in one process, twice, with the pieces' timers; then the GPU tests of the paths it touches.
    for k in 1 2; do
      timeout 150 python3 benchmarks/probe_md_phases.py --steps 3000 --ab-rounds 3 >"$OUT/md_phases_ab${k}.txt" 2>&1
      tail -42 "$OUT/md_phases_ab${k}.txt"
    done
    timeout 300 python3 -m pytest -q -m gpu tests/test_launch_ahead.py tests/test_langevin_ahead.py \
      tests/test_engine_zero_copy.py tests/test_calculator.py tests/test_engine_verlet.py >"$OUT/tests.txt" 2>&1
    tail -5 "$OUT/tests.txt"
    ;;
  stop78d)
    # Stop 78: the MD step's pieces with the finer timers (launch_ahead's checks, the Verlet path's, ASE's requests),
    # in two fresh processes, with reuse_ahead off / on alternating after them.
    for k in 1 2; do
      timeout 150 python3 benchmarks/probe_md_phases.py --steps 3000 --ab-rounds 2 >"$OUT/md_phases_fine${k}.txt" 2>&1
      tail -46 "$OUT/md_phases_fine${k}.txt"
    done
    ;;
  stop78e)
    # Stop 78: the MD step's pieces after the stream-wait and backend-memo cuts (two fresh processes, reuse_ahead A/B
    # after them); then the g2 x 4,096 step's kernels of the 64 x 3 student in fp32, tf32 and bf16 (issue 5's
    # tf32 / bf16 row: 0.313 / 0.300 against 0.3 µs a structure at stop 73).
    for k in 1 2; do
      timeout 150 python3 benchmarks/probe_md_phases.py --steps 3000 --ab-rounds 2 >"$OUT/md_phases_e${k}.txt" 2>&1
      sed -n 1,12p "$OUT/md_phases_e${k}.txt"; tail -6 "$OUT/md_phases_e${k}.txt"
    done
    timeout 240 python3 benchmarks/probe_kernel_table.py --systems g2x4096 --hidden 64 --precisions fp32,tf32,bf16 \
      --out "$OUT" --name kernels_g2x4096_h64 >"$OUT/kernels.log" 2>&1
    grep -E "=====|^\| " "$OUT/kernels_g2x4096_h64.txt" | head -90 || tail -20 "$OUT/kernels.log"
    ;;
  stop78g)
    # Stop 78: the MD step through StudentCalculator at the final code, bench_engine's MD section in four fresh
    # processes, each with the host's speed before and after each variant (the guest's fast / slow phases).
    for k in 1 2 3 4; do
      timeout 100 python3 benchmarks/bench_engine.py --hidden 64 --sections md --budget-s 80 --out "$OUT" \
        --name engine_md${k}_h200 >"$OUT/bench_engine_md${k}.log" 2>&1
      grep -E "auto = cudagraph" "$OUT/engine_md${k}_h200.md" || tail -5 "$OUT/bench_engine_md${k}.log"
    done
    ;;
  stop79a)
    # Prepared at stop 78 for the next stop: issue 5's tf32 / bf16 row for the 64 x 3 student (g2 x 4,096: 0.311 /
    # 0.299 µs a structure at stop 78, target 0.3). The launch configurations were tuned on the 128-wide student;
    # this sweeps the GEMM's large tile, K step and stages and the message kernels' tiles on the 64-wide step, in tf32
    # and bf16 (each variant against a fresh shipped run of the same system, probe_ncu.py's ratio).
    v="gemm:large=128x64x4;gemm:large=128x64x8;gemm:large=64x128x4;gemm:large_block_k=64;gemm:stages=3"
    v="$v;gemm:stages=2;mp:bwd_edge_block_e=32;mp:bwd_edge_block_e=128;mp:bwd_edge_warps=8;mp:bwd_edge_stages=3"
    v="$v;mp:fwd_block_e=64;mp:fwd_block_e=16;mp:fwd_block_a=32;mp:bwd_sender_block_a=32;mp:bwd_sender_warps=8"
    for prec in tf32 bf16; do
      timeout 280 python3 benchmarks/probe_ncu.py --mode sweep --systems g2x4096 --hidden 64 --precision $prec \
        --budget-s 240 --variants "$v" --out "$OUT" >"$OUT/sweep_$prec.log" 2>&1
      mv "$OUT/probe_ncu_sweep.md" "$OUT/sweep_$prec.md" 2>/dev/null
      grep -E "^\| g2" "$OUT/sweep_$prec.md" | head -20 || tail -8 "$OUT/sweep_$prec.log"
    done
    ;;
  stop79b)
    # Prepared at stop 78 for the next stop: the MD step after stop 78's last host cuts (measured on the development
    # CPU only: check_state against the snapshot for changed atoms, no NaN test of known-finite positions, one runner
    # lookup; probe_md_host_cpu.py 58.9-60.0 -> 52.9-54.5 µs a step there): bench_engine's MD section in four fresh
    # processes (recipe stop78g), then the pieces' timers once (the host's phase read beside each).
    bash scripts/gpu_followups.sh stop78g
    timeout 120 python3 benchmarks/probe_md_phases.py --steps 3000 >"$OUT/md_phases.txt" 2>&1
    sed -n 1,40p "$OUT/md_phases.txt"
    ;;
  stop79c)
    # Prepared at stop 78 for the next stop: issue 7's water rows for both students at today's code. The 128 x 3
    # student's 3,000- and 24,000-atom rows (1.501 / 10.39 ms against 1.5 / 10) were last measured at stops 63-64,
    # before stops 65-78's kernel and host changes; the 64 x 3 student's at stop 63 (0.881 / 7.69).
    for h in 128 64; do
      timeout 200 python3 benchmarks/bench_large.py --out "$OUT/large_h$h" --budget-s 170 --sections check,ef \
        --sizes 3000 24000 --hidden $h >"$OUT/bench_large_h$h.log" 2>&1
      grep -E "ours|reference|check|pass|FAIL" "$OUT/bench_large_h$h.log" | tail -12
    done
    ;;
  stop79d)
    # Stop 79: the MD step with the engine's express take of the launch ahead (ForceEngine.express_take): the phase
    # timers with express_take off / on alternating in one process (three pairs), then bench_engine's MD section in
    # three fresh processes (the host's phase read beside each).
    timeout 150 python3 benchmarks/probe_md_phases.py --steps 3000 --ab-rounds 3 --ab-switch express_take \
      >"$OUT/md_phases_ab.txt" 2>&1
    sed -n 1,8p "$OUT/md_phases_ab.txt"; grep -E "Engine.compute|_take_launched|_compute_padded_verlet" "$OUT/md_phases_ab.txt"
    tail -8 "$OUT/md_phases_ab.txt"
    md_rows 64 md 100 80 "$OUT"
    ;;
  stop79e)
    # Stop 79: the GPU tests outside tests/kernels (-m gpu; the express take is host code) in two processes, as stop
    # 77c's gpu1 / gpu2 halves.
    gpu_halves 560
    wait
    for name in gpu1 gpu2; do
      echo "== $name: $(tail -1 "$OUT/pytest_$name.log")"; grep -E "^(FAILED|ERROR)" "$OUT/pytest_$name.log" | head -8
    done
    ;;
  stop79f)
    # Stop 79, the last call: the MD step at the stop's final code, bench_engine's MD section in five fresh processes
    # (more samples of the host's slow phase, where the step sat at issue 5's 0.20 ms line before the express take),
    # then the phase timers once.
    for k in 1 2 3 4 5; do
      timeout 100 python3 benchmarks/bench_engine.py --hidden 64 --sections md --budget-s 80 --out "$OUT" \
        --name engine_md${k}_h200 >"/tmp/bench_engine_md${k}.log" 2>&1
      grep -E "auto = cudagraph" "$OUT/engine_md${k}_h200.md" || tail -5 "/tmp/bench_engine_md${k}.log"
      rm -f "$OUT/engine_md${k}_h200.json"  # (at most 8 files come back: the five tables and the timers; the logs stay in /tmp)
    done
    timeout 120 python3 benchmarks/probe_md_phases.py --steps 3000 >"$OUT/md_phases.txt" 2>&1
    sed -n 1,45p "$OUT/md_phases.txt"
    ;;
  stop80a)
    # Prepared at stop 79 for the next stop: the 128 x 3 student's MD step with the express take (last measured at
    # stop 66: 0.181-0.192 ms; it runs the model's captured step, ~150 µs of device work, not the dense step), three
    # fresh processes of bench_engine's MD section, the host's phase beside each.
    md_rows 128 md128_ 110 90 /tmp
    ;;
  stop80b)
    # Stop 80: issue 5's whole benchmark at today's tree for the shipped 64 x 3 student's shape (random weights, the
    # g2 species): the single-molecule table in every mode beside the torch reference, the MD step, cold / warm start
    timeout 575 python3 benchmarks/bench_engine.py --hidden 64 --sections latency,md,startup --budget-s 545 \
      --out "$OUT" --name engine_small_h200 >"$OUT/bench_engine_small.log" 2>&1
    grep -E "^\| " "$OUT/engine_small_h200.md" | head -60 || tail -8 "$OUT/bench_engine_small.log"
    ;;
  stop80c)
    # Stop 80: issue 5's batch sweep (all nine sizes) and precision error table for the 64 x 3 student, then the
    # 128 x 3 student's MD step with the express take in two fresh processes (stop80a's measurement, shortened)
    timeout 330 python3 benchmarks/bench_engine.py --hidden 64 --sections sweep,errors \
      --variants "=eager fp32,=cudagraph fp32,=cudagraph tf32,=cudagraph bf16,=cudagraph fp16" --budget-s 300 \
      --out "$OUT" --name engine_small_sweep_h200 >"$OUT/bench_engine_small_sweep.log" 2>&1
    grep -E "^\| " "$OUT/engine_small_sweep_h200.md" | tail -60 || tail -8 "$OUT/bench_engine_small_sweep.log"
    for k in 1 2; do
      timeout 105 python3 benchmarks/bench_engine.py --hidden 128 --sections md --budget-s 85 --out "$OUT" \
        --name engine_md128_${k}_h200 >"/tmp/bench_engine_md128_${k}.log" 2>&1
      grep -E "auto = cudagraph" "$OUT/engine_md128_${k}_h200.md" || tail -5 "/tmp/bench_engine_md128_${k}.log"
      rm -f "$OUT/engine_md128_${k}_h200.json"
    done
    ;;
  stop80d)
    # Stop 80: why the compiled fast path's warm start (11.5 s) is no faster than its cold one (10.6 s): torch's
    # cache counters, bypass reasons and Dynamo's compile times in a cold and a warm fresh process
    timeout 500 python3 benchmarks/probe_compile_cache.py --out "$OUT" --name probe_compile_cache_h200 \
      >"$OUT/probe_compile_cache.log" 2>&1
    tail -80 "$OUT/probe_compile_cache.log"
    ;;
  stop80e)
    # Stop 80: the start-up rows after the cache fix, in a process that compiled first (as bench_engine's full run
    # does: Inductor then holds its cache variables in os.environ, which children inherited): the compiled path's
    # cold row must now be cold, and its warm row faster
    timeout 400 python3 benchmarks/bench_engine.py --hidden 64 --sections latency,startup \
      --variants "=cudagraph+compile" --budget-s 370 --out "$OUT" --name engine_startup_h200 \
      >"$OUT/bench_engine_startup.log" 2>&1
    grep -E "^\| " "$OUT/engine_startup_h200.md" | tail -16 || tail -8 "$OUT/bench_engine_startup.log"
    ;;
  stop81a)
    # Prepared at stop 80 for the next stop: the GPU tests of what stop 80 changed after its device calls (the
    # explicit compile cache directory, the kernels' wrap_triton import, the Triton compatibility tests, the
    # neighbour list's degenerate cell), then bench_engine's start-up rows with the targets table
    timeout 420 python3 -m pytest -q -p no:cacheprovider -rs --tb=short -m gpu tests/test_engine_modes.py \
      tests/test_neighbors.py tests/test_bench_engine_report.py >"$OUT/pytest_engine_modes.log" 2>&1 &
    timeout 420 python3 -m pytest -q -p no:cacheprovider -rs --tb=short -k "cuda or gpu" \
      tests/kernels/test_rbf_cutoff.py tests/kernels/test_edge_features.py tests/kernels/test_message_passing.py \
      tests/kernels/test_triton_compat.py tests/kernels/test_compile_ahead.py >"$OUT/pytest_kernels.log" 2>&1 &
    wait
    for f in engine_modes kernels; do
      echo "== $f: $(tail -1 "$OUT/pytest_$f.log")"; grep -E "^(FAILED|ERROR)" "$OUT/pytest_$f.log" | head
    done
    timeout 150 python3 benchmarks/bench_engine.py --hidden 64 --sections startup --budget-s 130 --out "$OUT" \
      --name engine_startup_h200 >"$OUT/bench_engine_startup.log" 2>&1
    grep -E "^\| " "$OUT/engine_startup_h200.md" | head -20 || tail -8 "$OUT/bench_engine_startup.log"
    ;;
  stop81b)
    # Stop 81: issue 7's whole benchmark for the 128 x 3 student at today's tree in one run (the correctness check,
    # energy + forces at 192 / 3,000 / 24,000 / 100,008 atoms, the neighbour lists with vesin beside ours, the
    # largest box at 1,000,002 atoms), then the CUDA tests stop81a's kernel shard had no time left for
    # (test_triton_compat, test_compile_ahead), after the timing so they do not share the GPU with it.
    timeout 270 python3 benchmarks/bench_large.py --out "$OUT/large_h128" --budget-s 240 \
      --sections check,ef,nl,grow --sizes 192 3000 24000 100008 --grow-sizes 1000002 --hidden 128 \
      >"$OUT/bench_large_h128.log" 2>&1
    grep -E "^\| " "$OUT/large_h128/bench_large.md" | head -12 || tail -8 "$OUT/bench_large_h128.log"
    timeout 270 python3 -m pytest -q -p no:cacheprovider -rs --tb=short -k "cuda or gpu" \
      tests/kernels/test_triton_compat.py tests/kernels/test_compile_ahead.py >"$OUT/pytest_compat_ahead.log" 2>&1
    echo "== compat_ahead: $(tail -1 "$OUT/pytest_compat_ahead.log")"
    grep -E "^(FAILED|ERROR)" "$OUT/pytest_compat_ahead.log" | head
    ;;
  stop81c)
    # Stop 81: where the 128 x 3 student's eager 24,000-atom step goes at today's tree (the kernel table with the
    # aten ops; stop 63's was the last), then issue 7's water rows for the 64 x 3 student at the same tree.
    timeout 150 python3 benchmarks/probe_kernel_table.py --systems water24000 --step-mode eager --ops --out "$OUT" \
      --name kernel_table_24k_eager >"$OUT/kernel_table_24k_eager.log" 2>&1
    grep -E "=====|^group" "$OUT/kernel_table_24k_eager.txt" || tail -5 "$OUT/kernel_table_24k_eager.log"
    timeout 200 python3 benchmarks/bench_large.py --out "$OUT/large_h64" --budget-s 170 --sections check,ef \
      --sizes 3000 24000 --hidden 64 >"$OUT/bench_large_h64.log" 2>&1
    grep -E "^\| " "$OUT/large_h64/bench_large.md" | head -6 || tail -8 "$OUT/bench_large_h64.log"
    ;;
  stop81d)
    # Stop 81: can the MD step's velocity-Verlet prediction move onto the device? ASE's update in float64, torch
    # ops (eager and in a CUDA graph) and one Triton kernel (default fusion / enable_fp_fusion=False) against NumPy,
    # bit for bit, and the time of each.
    timeout 200 python3 benchmarks/probe_verlet_predict.py --out "$OUT" --trials 50 >"$OUT/probe_verlet_predict.log" 2>&1
    grep -E "^\| " "$OUT/probe_verlet_predict.md" || tail -12 "$OUT/probe_verlet_predict.log"
    # The 128 x 3 student's MD step by phase timers: the wait for the device against the host's serial piece.
    timeout 150 python3 benchmarks/probe_md_phases.py --steps 2000 --model builtin:chno-gfn2 >"$OUT/md_phases_h128.txt" 2>&1
    cat "$OUT/md_phases_h128.txt" | head -40
    ;;
  stop81e)
    # Stop 81: the MD step with the next step queued behind it, its positions predicted on the device
    # (ForceEngine.chain_ahead). Its CUDA tests and the launch-ahead and zero-copy ones, then the phase timers with
    # the chain off / on alternating (three pairs) for the 128 x 3 and the 64 x 3 shipped students, then
    # bench_engine's MD section for both widths (chain on, the default).
    timeout 240 python3 -m pytest -q -p no:cacheprovider -rs --tb=short -m gpu tests/test_md_chain.py \
      tests/test_launch_ahead.py tests/test_engine_zero_copy.py >"$OUT/pytest_chain.log" 2>&1
    echo "== chain tests: $(tail -1 "$OUT/pytest_chain.log")"; grep -E "^(FAILED|ERROR)" "$OUT/pytest_chain.log" | head
    for m in chno-gfn2 chno-gfn2-small; do
      timeout 150 python3 benchmarks/probe_md_phases.py --steps 2000 --model builtin:$m --ab-rounds 3 \
        --ab-switch chain >"$OUT/md_phases_chain_$m.txt" 2>&1
      sed -n 2,4p "$OUT/md_phases_chain_$m.txt"; grep -E "chain|_wait|Stream.synchronize" "$OUT/md_phases_chain_$m.txt"
      tail -8 "$OUT/md_phases_chain_$m.txt"
    done
    ;;
  stop81f)
    # Stop 81, after stop81e: the chain off behind the dense step, its event on the cached current stream. The chain's
    # CUDA tests, the 128 x 3 student's phase timers with the chain off / on (three pairs), then bench_engine's MD
    # section for the 128 x 3 student (chain on, the default).
    timeout 120 python3 -m pytest -q -p no:cacheprovider -rs --tb=short -m gpu tests/test_md_chain.py \
      tests/test_engine_zero_copy.py >"$OUT/pytest_chain.log" 2>&1
    echo "== chain tests: $(tail -1 "$OUT/pytest_chain.log")"; grep -E "^(FAILED|ERROR)" "$OUT/pytest_chain.log" | head
    timeout 100 python3 benchmarks/probe_md_phases.py --steps 2000 --model builtin:chno-gfn2 --ab-rounds 3 \
      --ab-switch chain >"$OUT/md_phases_chain_chno-gfn2.txt" 2>&1
    sed -n 2,4p "$OUT/md_phases_chain_chno-gfn2.txt"; grep -E "chain|_wait|current_stream" "$OUT/md_phases_chain_chno-gfn2.txt"
    tail -7 "$OUT/md_phases_chain_chno-gfn2.txt"
    timeout 110 python3 benchmarks/bench_engine.py --hidden 128 --sections md --budget-s 90 --out "$OUT" \
      --name engine_md128_chain_h200 >"$OUT/bench_engine_md128.log" 2>&1
    grep -E "auto = cudagraph|MD step" "$OUT/engine_md128_chain_h200.md" | head -6 || tail -5 "$OUT/bench_engine_md128.log"
    ;;
  stop82b)
    # Prepared at stop 81 for the next stop (after stop77c's every GPU test): the 128 x 3 student's MD row with the
    # chained step in more fresh processes (stop 81: 189.9 / 177.4 µs in two), each with the host's phase beside it,
    # and the chain off / on in one process for the 128 x 3 student (stop 81: 0.86x in the pair at one host speed).
    md_rows 128 md128_chain 95 75 "$OUT"
    timeout 100 python3 benchmarks/probe_md_phases.py --steps 2000 --model builtin:chno-gfn2 --ab-rounds 4 \
      --ab-switch chain >"$OUT/md_phases_chain_ab.txt" 2>&1
    tail -10 "$OUT/md_phases_chain_ab.txt"
    # Stop 82: the chain's prediction as one Triton kernel (kernels/verlet_predict.py) against the torch ops
    timeout 100 python3 benchmarks/probe_md_phases.py --steps 2000 --model builtin:chno-gfn2 --ab-rounds 4 \
      --ab-switch device_kernel >"$OUT/md_phases_kernel_ab.txt" 2>&1
    tail -10 "$OUT/md_phases_kernel_ab.txt"
    ;;
  stop82c)
    # Stop 82: issue 5's targets for the shipped default's shape (128 x 3, random weights over the g2 species) at
    # today's tree in one report: the single-molecule table (the captured and eager modes beside the reference), the
    # batch sweep in captured fp32 / tf32 / bf16, cold / warm start (the MD row: stop82b's three processes); then the
    # MD step's phase timers with the chain's Triton prediction (stop 81's d/ and f/ were before it)
    timeout 420 python3 benchmarks/bench_engine.py --hidden 128 --sections latency,sweep,startup \
      --variants "=eager (triton),=cudagraph,=cudagraph fp32,=cudagraph tf32,=cudagraph bf16" \
      --sizes 1,16,256,1024,4096 --budget-s 390 --out "$OUT" --name issue5_128x3_h200 >"$OUT/bench_engine_128.log" 2>&1
    grep -E "^\| " "$OUT/issue5_128x3_h200.md" | head -12 || tail -8 "$OUT/bench_engine_128.log"
    timeout 100 python3 benchmarks/probe_md_phases.py --steps 2000 --model builtin:chno-gfn2 \
      >"$OUT/md_phases_h128_kernel.txt" 2>&1
    head -12 "$OUT/md_phases_h128_kernel.txt"
    ;;
  stop83a)
    # Stop 83: the chained MD step kept without the host's prediction (ForceEngine.keep_chained): the GPU tests of
    # the MD paths, then keep_chained_steps off / on in one process for the 128 x 3 student (probe_md_phases A/B,
    # with its phase timers), then issue 5's MD row in three fresh processes
    timeout 150 python3 -m pytest -q -p no:cacheprovider -rs --tb=short -m gpu tests/test_md_chain.py \
      tests/test_launch_ahead.py tests/test_engine_verlet.py tests/test_calculator.py >"$OUT/pytest_md_gpu.log" 2>&1
    tail -3 "$OUT/pytest_md_gpu.log"; grep -E "^(FAILED|ERROR)" "$OUT/pytest_md_gpu.log" | head -8
    timeout 110 python3 benchmarks/probe_md_phases.py --steps 2000 --model builtin:chno-gfn2 --ab-rounds 4 \
      --ab-switch keep_chained_steps >"$OUT/md_phases_keep_ab.txt" 2>&1
    head -4 "$OUT/md_phases_keep_ab.txt"; tail -10 "$OUT/md_phases_keep_ab.txt"
    md_rows 128 md128_keep 95 75 "$OUT" rm
    ;;
  stop83b)
    # Stop 83: every -m gpu test outside tests/kernels (stop77c's gpu1 and gpu2 halves, side by side) and the chain's
    # prediction kernel's CUDA tests, at the tree with keep_chained (the kernels unchanged since stop 82's a/); then
    # keep_chained_steps off / on again for the 128 x 3 student (stop83a's pairs ran at a fast-phase host)
    gpu_halves 420
    timeout 420 python3 -m pytest -q -p no:cacheprovider -rs --tb=short tests/kernels/test_verlet_predict.py \
      >"$OUT/pytest_verlet_predict.log" 2>&1 &
    wait
    for name in gpu1 gpu2 verlet_predict; do
      echo "== $name: $(tail -1 "$OUT/pytest_$name.log")"; grep -E "^(FAILED|ERROR)" "$OUT/pytest_$name.log" | head -8
    done
    timeout 150 python3 benchmarks/probe_md_phases.py --steps 2000 --model builtin:chno-gfn2 --ab-rounds 6 \
      --ab-switch keep_chained_steps >"$OUT/md_phases_keep_ab.txt" 2>&1
    head -4 "$OUT/md_phases_keep_ab.txt"; tail -14 "$OUT/md_phases_keep_ab.txt"
    ;;
  stop83c)
    # Stop 83: keep_chained on / off where the neighbour list rebuilds (water boxes, skins 1.0 and 0.3 Å) and where it
    # is complete (benzene), 128 x 3: the counters, µs a step, and the same bits both ways
    timeout 400 python3 benchmarks/probe_keep_chained.py --systems benzene,water192,water1500,water3000 --steps 400 \
      --rounds 2 --skins 1.0,0.3 >"$OUT/probe_keep_chained.md" 2>&1
    cat "$OUT/probe_keep_chained.md" | tail -36
    ;;
  stop83d)
    # Stop 83: the CUDA tests of the chained MD step with the one where the list rebuilds (27 waters)
    timeout 200 python3 -m pytest -q -p no:cacheprovider -rs --tb=short -m gpu tests/test_md_chain.py \
      tests/test_launch_ahead.py >"$OUT/pytest_md_chain_gpu.log" 2>&1
    tail -3 "$OUT/pytest_md_chain_gpu.log"; grep -E "^(FAILED|ERROR)|assert" "$OUT/pytest_md_chain_gpu.log" | head -12
    ;;
  stop83e)
    # Stop 83: issue 5's MD row for the 128 x 3 student in three more fresh processes (a/ had two slow-phase hosts and
    # a fast one), through the md_rows helper
    md_rows 128 md128_keepb 80 60 "$OUT" rm
    ;;
  stop84a)
    # Stop 84: what an exchange of a feature vector between the programs of one launch costs (through global memory,
    # a release / acquire counter per group: the lever for a 128-wide dense step split over several programs an
    # atom), then the GPU tests of the MD paths (chain_ahead's takeable answer kept for the take) and issue 5's MD
    # row for the 128 x 3 student in three fresh processes
    timeout 90 python3 benchmarks/probe_cta_exchange.py --groups 16 --splits 2,4,8 --rounds 0,8,32 \
      >"$OUT/probe_cta_exchange.md" 2>&1
    timeout 60 python3 benchmarks/probe_cta_exchange.py --groups 32 --splits 2,4 --rounds 0,8,32 --warps 4 \
      >>"$OUT/probe_cta_exchange.md" 2>&1
    cat "$OUT/probe_cta_exchange.md" | tail -40
    timeout 150 python3 -m pytest -q -p no:cacheprovider -rs --tb=short -m gpu tests/test_md_chain.py \
      tests/test_launch_ahead.py tests/test_engine_verlet.py tests/test_calculator.py >"$OUT/pytest_md_gpu.log" 2>&1
    tail -3 "$OUT/pytest_md_gpu.log"; grep -E "^(FAILED|ERROR)" "$OUT/pytest_md_gpu.log" | head -8
    md_rows 128 md128_memo 95 75 "$OUT" rm
    ;;
  stop84b)
    # Stop 84: the exchange probe again with bounded values (a/'s model doubled the mean each round: its 32-round
    # errors were float32 rounding of ~1e9 values), then where the 128 x 3 student's captured benzene step goes,
    # kernel by kernel (issue 5's "roughly 40 kernels" against ours)
    timeout 90 python3 benchmarks/probe_cta_exchange.py --groups 16 --splits 2,4 --rounds 0,8,32 \
      >"$OUT/probe_cta_exchange_bounded.md" 2>&1
    tail -16 "$OUT/probe_cta_exchange_bounded.md"
    timeout 150 python3 benchmarks/probe_kernel_table.py --systems benzene --hidden 128 --precisions fp32 \
      --out "$OUT" --name kernel_table_benzene_h128 >"$OUT/kernel_table_benzene_h128.log" 2>&1
    grep -A30 "kernel groups" "$OUT"/kernel_table_benzene_h128*.txt | head -40; tail -3 "$OUT/kernel_table_benzene_h128.log"
    ;;
  stop84c)
    # Stop 84: one forward layer of a dense step split over S programs an atom (probe_split_dense.py: three
    # exchanges a launch), 64 and 128 features, S = 1 (unsplit), 2, 4, 8, at 8 and 4 warps a program: does S = 4 at
    # 128 features cost what the unsplit 64-wide layer costs plus three exchanges?
    for w in 8 4; do
      timeout 150 python3 benchmarks/probe_split_dense.py --features 64,128 --splits 1,2,4,8 --warps $w \
        >"$OUT/probe_split_dense_w$w.md" 2>&1
      tail -12 "$OUT/probe_split_dense_w$w.md"
    done
    ;;
  stop84d)
    # Stop 84: the dense step's warps with the shipped launch (PDL, early loads), benzene: the 64 x 3 student at 4
    # (shipped 8; probe_split_dense's layer ran 1.6x faster at 4, and compiled for sm_90 its launches keep 202-255
    # registers with at most 16 bytes of stack there) and the 128 x 3 at 8 (shipped 16; 4 spills up to 9 KB a thread,
    # results/stop84_gpu/sass_dense128.md)
    timeout 200 python3 benchmarks/probe_dense_step.py --students builtin:chno-gfn2-small --molecules C6H6 --g2 "" \
      --variants "shipped;4 warps, pdl;4 / 8 warps, pdl" --out "$OUT" --name probe_dense_64_warps \
      >"$OUT/probe_dense_64_warps.log" 2>&1
    grep -E "^\| builtin" "$OUT/probe_dense_64_warps.md" | head -8; tail -2 "$OUT/probe_dense_64_warps.log"
    timeout 200 python3 benchmarks/probe_dense_step.py --students builtin:chno-gfn2 --molecules C6H6 --g2 "" \
      --variants "shipped;8 warps, pdl" --out "$OUT" --name probe_dense_128_warps >"$OUT/probe_dense_128_warps.log" 2>&1
    grep -E "^\| builtin" "$OUT/probe_dense_128_warps.md" | head -8; tail -2 "$OUT/probe_dense_128_warps.log"
    ;;
  stop84e)
    # Stop 84: the split layer's two forms, one launch with spinning exchanges against four launches with launch
    # boundaries (the form the interpreter, and so CI, can run at S > 1), 4 warps
    timeout 120 python3 benchmarks/probe_split_dense.py --features 64,128 --splits 1,4 --warps 4 --phased \
      >"$OUT/probe_split_dense_phased.md" 2>&1
    tail -9 "$OUT/probe_split_dense_phased.md"
    ;;
  stop85a)
    # Stop 85: can a 64 x 3 student (the width the dense step serves) trained longer be as accurate as the shipped
    # 128 x 3? Three trainings side by side on the one GPU, each on its own copy of the carried labels (runs/
    # chno_gfn2, made with 2 workers): 64 x 3 with the shipped recipe (a), 64 x 3 at batch 32 (b), 128 x 3 with the
    # recipe (c, the control at the same wall clock), each ${T85:-320} s of training. Then every new checkpoint and
    # both shipped students on the same held-out frames in one process (compare_students.py). One tarball back.
    T=${T85:-320}; mkdir -p "$OUT/s85"; tar xzf runs/labels.tgz -C runs
    for v in a b c; do rm -rf runs/s85$v; cp -r runs/chno_gfn2 runs/s85$v; done
    opts=(a "--hidden 64" b "--hidden 64 --batch-size 32 --lr 1.4e-3" c "--hidden 128")
    for i in 0 2 4; do
      v=${opts[$i]}
      timeout 560 python3 examples/make_builtin_student.py --workers 2 --work runs/s85$v --name chno-gfn2-85$v \
        --layers 3 ${opts[$((i + 1))]} --time-limit "$T" --results "$OUT/s85/$v" >"$OUT/s85/train_$v.log" 2>&1 &
    done
    wait
    for v in a b c; do tail -3 "$OUT/s85/train_$v.log"; done
    timeout 90 python3 benchmarks/compare_students.py --test runs/chno_gfn2/test_labels --by temperature \
      --model shipped128=builtin:chno-gfn2 --model shipped64=builtin:chno-gfn2-small \
      --model new64a="$OUT/s85/a/chno-gfn2-85a.pt" --model new64b="$OUT/s85/b/chno-gfn2-85b.pt" \
      --model new128c="$OUT/s85/c/chno-gfn2-85c.pt" --out "$OUT/compare_students" >"$OUT/s85/compare.log" 2>&1
    cat "$OUT/compare_students.md" || tail -20 "$OUT/s85/compare.log"
    tar czf "$OUT/s85.tgz" -C "$OUT" s85 && rm -rf "$OUT/s85"
    ;;
  stop85b)
    # Stop 85: issue 5's benchmark at today's tree for the default student's shape (64 x 3, random weights on the
    # TF32 grid, the g2 species; since stop 85 builtin:chno-gfn2-small is the default): the MD step, cold / warm start,
    # the batch sweep (fp32, tf32, bf16, fp16, beside the torch reference), the precision errors of the shipped
    # default student itself, then the single-molecule table (eager, cudagraph and the reference; stop 80 timed every
    # compiled mode). Sections in that order, so that the budget cuts the last one first.
    timeout 580 python3 benchmarks/bench_engine.py --hidden 64 --sections md,startup,sweep,errors_builtin,latency \
      --variants "=eager (triton),=cudagraph,=eager fp32,=cudagraph fp32,=cudagraph tf32,=cudagraph bf16,=cudagraph fp16" \
      --budget-s 520 --out "$OUT" --name engine_default_h200 >"$OUT/bench_engine_default.log" 2>&1
    grep -E "^\| " "$OUT/engine_default_h200.md" | head -90 || tail -8 "$OUT/bench_engine_default.log"
    ;;
  stop85c)
    # Stop 85: what tf32 / bf16 / fp16 cost the default student (retrained at stop 85) against its fp64 result, beside
    # the 128 x 3 student and the stop-22 64 x 3 one (runs/old-small.pt, carried): probe_precision's error columns
    # (g2 CHNO molecules as built and rattled, a water box). Then the -m gpu tests of the files that load the
    # shipped students.
    for s in default:"" wide:builtin:chno-gfn2 old64:runs/old-small.pt; do
      n=${s%%:*}; m=${s#*:}
      timeout 150 python3 benchmarks/probe_precision.py --errors-only ${m:+--student "$m"} --out "$OUT" \
        --name "precision_$n" >"/tmp/precision_$n.log" 2>&1 || tail -5 "/tmp/precision_$n.log"
      grep -E "^\| (fp32|tf32|bf16|fp16) " "$OUT/precision_$n.md" | cut -c1-400
    done
    timeout 280 python3 -m pytest -q -p no:cacheprovider -rs --tb=short -m gpu tests/kernels/test_dense_step.py \
      tests/test_engine_dense.py tests/test_md_chain.py tests/distill/test_builtin.py tests/test_probe_md_phases.py \
      >"$OUT/pytest_gpu85.log" 2>&1; tail -5 "$OUT/pytest_gpu85.log"
    ;;
  stop85d)
    # Stop 85: the edge kernel's accumulating epilogue (mp._CONFIG["edge_acc_epilogue"]: one slice adds its ∂rbf, ∂u
    # into the sink itself, in place of four torch adds a step for the 64-wide student). Its CUDA tests first, then
    # the whole step with it off against on (probe_ncu's sweep, fp32 and bf16, g2 x 1,024 and x 4,096, 64 x 3), then
    # issue 5's two g2 rows in bench_engine's sweep beside the torch reference.
    timeout 200 python3 -m pytest -q -p no:cacheprovider -rs --tb=short tests/kernels/test_edge_sink.py \
      tests/kernels/test_half_gathers.py tests/kernels/test_message_passing_launch.py >"$OUT/pytest_acc.log" 2>&1
    tail -3 "$OUT/pytest_acc.log"
    for prec in fp32 bf16; do
      timeout 100 python3 benchmarks/probe_ncu.py --mode sweep --systems g2x1024,g2x4096 --hidden 64 \
        --precision $prec --budget-s 80 --variants "mp:edge_acc_epilogue=0" --out "$OUT" >"/tmp/sweep_$prec.log" 2>&1
      mv "$OUT/probe_ncu_sweep.md" "$OUT/sweep_acc_$prec.md" 2>/dev/null
      grep -E "^\| g2" "$OUT/sweep_acc_$prec.md" || tail -8 "/tmp/sweep_$prec.log"
    done
    timeout 150 python3 benchmarks/bench_engine.py --hidden 64 --sections sweep --sizes 1024,4096 \
      --variants "=cudagraph fp32,=cudagraph tf32,=cudagraph bf16,=cudagraph fp16" --budget-s 130 --out "$OUT" \
      --name engine_g2_h200 >"/tmp/bench_engine_g2.log" 2>&1
    grep -E "^\| " "$OUT/engine_g2_h200.md" | head -30 || tail -8 /tmp/bench_engine_g2.log
    ;;
  stop85e)
    # Stop 85: issue 5's g2 x 4,096 rows (fp32, tf32, bf16) and the MD row once more for the default student's shape,
    # in a fresh process at the stop's final tree (the bf16 row sits at the 0.3 µs line)
    timeout 170 python3 benchmarks/bench_engine.py --hidden 64 --sections sweep,md --sizes 1024,4096 \
      --variants "=cudagraph fp32,=cudagraph tf32,=cudagraph bf16" --budget-s 150 --out "$OUT" \
      --name engine_final_h200 >"$OUT/bench_engine_final.log" 2>&1
    grep -E "^\| " "$OUT/engine_final_h200.md" | head -30 || tail -8 "$OUT/bench_engine_final.log"
    ;;
  *)
    if [ -n "${1:-}" ] && grep -qxF "  $1)" scripts/gpu_followups_archive.sh; then
      exec bash scripts/gpu_followups_archive.sh "$1"
    fi
    echo "usage: bash scripts/gpu_followups.sh stop60|stop60b|stop60c|stop60d|stop60e|stop60f|stop60g|stop60h|stop60i|tmalaunch|stop61b|stop61c|stop61d|stop61e|stop61f|stop61g|stop61h|stop61i|stop61j|stop61k|prepared61|stop62|stop62c|stop62d|stop62e|stop62f|stop62g|stop62h|stop62i|prepared62|stop63a|stop63b|stop63c|stop63d|stop63e|stop63f|stop63g|prepared63|stop64a|stop64b|stop64d|stop64e|stop64f|stop64g|stop64h|stop64i|stop65a|stop65b|stop65c|stop65d|stop65e|stop65f|stop66a|stop66b|stop66c|stop66d|stop66e|stop66f|stop66g|stop66h|stop66i|stop66j|stop66k|stop66l|stop67a|stop67b|stop67c|stop67d|stop67e|stop67f|stop67g|stop67h|stop67i|stop68d|stop68e|stop68f|stop68g|stop69a|stop69b|stop69c|stop69d|stop69e|stop69f|stop69g|stop70b|stop70c|stop70d|stop70e|stop70f|stop71a|stop71b|stop71c|stop71d|stop71e|stop71f|stop72a|stop72b|stop72c|stop72d|stop72e|stop73a|stop73b|stop73c|stop73d|stop73e|stop74a|stop74b|stop74c|stop74d|stop74e|stop75a|stop76a|stop76b|stop76c|stop77a|stop77c|stop77e|stop77f|stop78a|stop78b|stop78c|stop78d|stop78e|stop78g|stop79a|stop79b|stop79c|stop79d|stop79e|stop79f|stop80a|stop80b|stop80c|stop80d|stop80e|stop81a|stop81b|stop81c|stop81d|stop81e|stop81f|stop82b|stop82c|stop83a|stop83b|stop83c|stop83d|stop83e|stop84a|stop84b|stop84c|stop84d|stop84e|stop85a|stop85b|stop85c|stop85d|stop85e (older: scripts/gpu_followups_archive.sh)" >&2; exit 2 ;;
esac
echo "total ${SECONDS}s"
