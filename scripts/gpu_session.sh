#!/usr/bin/env bash
# The GPU work queued for a device session, one part per device call (each fits a 10-minute call):
#
#   bash scripts/gpu_session.sh verify    # CUDA tests of the engine/MD/neighbour/kernel changes + step profile
#   bash scripts/gpu_session.sh engine    # bench_engine (latency, MD step, batch sweep) + message-passing tuning
#   bash scripts/gpu_session.sh large     # benchmarks/bench_large.py (issue 7; LARGE_ARGS="--sections check,ef")
#   bash scripts/gpu_session.sh distill   # ethanol from GFN2-xTB in 60 s of training (issue 6)
#   bash scripts/gpu_session.sh ethlong   # ethanol from GFN2-xTB, 420 s of training (the <= 3 meV/Å target)
#   bash scripts/gpu_session.sh builtin   # retrain the shipped builtin:chno-gfn2 (issue 6)
#   bash scripts/gpu_session.sh builtinsmall # builtin:chno-gfn2-small (64 x 3): carried labels, 121 s training
#   bash scripts/gpu_session.sh sevennet  # 192-atom water from SevenNet-0 (issue 6; needs .whl7)
#   bash scripts/gpu_session.sh sevennpt  # an NPT water student from SevenNet-0 (--stress; needs .whl7), ~9.5 min
#   bash scripts/gpu_session.sh tune      # message-passing kernels: each kernel x dot precision, the block variant
#   bash scripts/gpu_session.sh diag      # cudagraph training step vs eager static step, per step count
#   CHECK="tests/a.py tests/b.py::t" CHECK_K="cuda" bash scripts/gpu_session.sh check   # chosen tests, tracebacks
#   bash scripts/gpu_session.sh enginelat # bench_engine latency + MD sections only (reference, eager, cudagraph)
#   bash scripts/gpu_session.sh small     # bench_large (water E+F) + bench_engine for a 64 x 3 student (small builtin)
#   bash scripts/gpu_session.sh stress    # CUDA tests of the padded stress step + bench_stress.py (128 x 3 and 64 x 3)
#   bash scripts/gpu_session.sh npt       # NPT: CUDA tests of the kept Verlet list, bench_stress, the water NPT student
#                                         #   vs SevenNet-0 per NPT step (needs .whl7)
#   bash scripts/gpu_session.sh capture   # CUDA tests of every capture site + stop 23's seven-file sequence with one
#                                         #   capture attempt, repeated (the intermittent invalidation)
#   bash scripts/gpu_session.sh stressprobe # probe_stress_step.py (stress call vs E+F call) + probe_student_size (128x3, 64x3)
#   bash scripts/gpu_session.sh nptab     # the NPT host path: old package (scripts/ab_package.sh prepare) vs the tree, A/B
#   bash scripts/gpu_session.sh startup   # import and start-up: old package (ab_package.sh prepare) vs the tree, A/B
#   bash scripts/gpu_session.sh ahead     # cold start with the compile-ahead dry run off / on (its GPU tests first)
#   bash scripts/gpu_session.sh mdprobe   # one benzene MD step piece by piece (probe_md_step.py)
#   bash scripts/gpu_session.sh mdspeed   # student vs SevenNet-0 per ASE MD step, 192-atom water (needs sevenn)
#   bash scripts/gpu_session.sh profile   # benchmarks/profile_step.py (small molecules and water MD steps;
#                                         #   PROFILE=large: kernel groups of the 3k/24k water energy+forces step)
#   bash scripts/gpu_session.sh kernels   # issue 3: CUDA tests of the edge/rbf kernels + bench_kernels (KERNELS_ARGS)
#   bash scripts/gpu_session.sh probe     # benchmarks/probe_locality.py: E+F with atoms as built vs Morton-sorted
#   bash scripts/gpu_session.sh nlprof    # benchmarks/profile_neighbors.py: wall vs device kernels of one list call
#   bash scripts/gpu_session.sh nlcheck   # CUDA tests of the neighbour lists + profile_neighbors + bench_large nl
#   bash scripts/gpu_session.sh edgetune  # tune_small.py edgetiles: the edge backward over tiles (TUNE_SECTIONS=
#                                         #   sendertiles: the atom-variant forward / sender backward)
#   bash scripts/gpu_session.sh pdl       # probe_pdl.py: programmatic dependent launch in a graph of small kernels
#   bash scripts/gpu_session.sh pdlbench  # bench_pdl.py: the E+F step with programmatic dependent launch off / on
#   bash scripts/gpu_session.sh ncu       # probe_ncu.py: num_stages / GEMM-tile sweep of the step, then Nsight Compute
#                                         #   counters of one 24,000-atom water and one 4,096 g2-molecule step
#   bash scripts/gpu_session.sh hostpipe  # bench_host.py --gpu: host phases, predict, sequential vs pipelined predict
#   bash scripts/gpu_session.sh studentsize # probe_student_size.py: the speed targets' rows per student width/depth
#   bash scripts/gpu_session.sh ethsize   # ethanol from GFN2-xTB per student size (ETH_SIZES="128x3 64x3 64x2"), same
#                                         #   labels and training time each (ETH_TRAIN_S, default 75 s)
#   bash scripts/gpu_session.sh batchedmd # BatchedMD: its CUDA tests, bench_batched_md.py, `mlff-distill md` on 976
#                                         #   trajectories (the 61 g2 molecules x 16 replicas)
#   bash scripts/gpu_session.sh repulsion # the ZBL wall: its CUDA tests (and of the paths it touches), bench_repulsion.py
#                                         #   (its cost in the step), bench_batched_relax.py (1 to 4,096 structures),
#                                         #   probe_hot_md.py (1,500 and 2,000 K, with and without the wall)
#   bash scripts/gpu_session.sh ddp       # 1 vs 2 processes of DDP training (issue 6; needs 2 GPUs: nvidia-h200-x2)
#
# Several parts may share one call: `SCALE=0.5 bash scripts/gpu_session.sh verify large` (every time box × SCALE).
# The distillation parts work in runs/<name>/ (git-ignored): labels made beforehand on a CPU machine (the
# same example, interrupted after its labelling step) can be carried there and are resumed, not relabelled.
# Run from the repository root on the device machine with the wheel folders carried (.whl: ase, tblite, vesin,
# vesin-torch; .whl7: sevenn, braceexpand, matscipy; see README "GPU check"). Everything a part writes lands in
# /tmp/gpu_<part> and is packed into $OUT/<part>.tgz (the device returns at most 8 files), also when a step
# fails or runs out of its time box; the last lines printed are the part's summary.
set -uo pipefail
export PYTHONUNBUFFERED=1
[ $# -ge 1 ] || { echo "usage: gpu_session.sh PART [PART...]  (verify|capture|engine|enginelat|large|distill|ethlong|builtin|builtinsmall|small|stress|npt|sevennet|sevennpt|mdspeed|tune|diag|check|profile|kernels|probe|nlprof|nlcheck|edgetune|pdl|pdlbench|ncu|mdprobe|hostpipe|studentsize|ethsize|stressprobe|nptab|startup|ahead|batchedmd|repulsion|ddp)"; exit 2; }
parts=("$@")
wheels=()
declare -A seen=()
for d in .whl .whl7; do  # a wheel in both folders (.whl7 may carry ase alone, to stay within the carry limit): once
  [ -d "$d" ] || continue
  for w in "$d"/*.whl; do
    b=$(basename "$w"); [ -n "${seen[$b]:-}" ] && continue; seen[$b]=1; wheels+=("$w")
  done
done
if [ ${#wheels[@]} -gt 0 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "${wheels[@]}" || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/tmp/install.log 2>&1 \
  || { cat /tmp/install.log; exit 1; }
pack() { for p in "${parts[@]}"; do [ -d "/tmp/gpu_$p" ] && tar czf "${OUT:-/tmp}/$p.tgz" -C "/tmp/gpu_$p" . ; done; }
trap pack EXIT
# Time boxes: by default each part gets its full single-call box; a call with several parts passes
# SCALE=<fraction> to shrink every box (e.g. SCALE=0.5 for two parts in one 10-minute call).
SCALE=${SCALE:-1}
box() { python3 -c "print(int($1 * $SCALE))"; }
for part in "${parts[@]}"; do
res=/tmp/gpu_$part
mkdir -p "$res"
python3 -c "import torch, triton; print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__)" \
  | tee "$res/device.txt"
git rev-parse --short HEAD 2>/dev/null | tee -a "$res/device.txt"
echo "===== part $part (scale $SCALE)"

case "$part" in
  verify)
    # -v: each test's name and outcome as it finishes, so a run cut by the time box still names its failures.
    # -m "not slow": the compile-ahead file's cold-process tests (~3.5 min) have their own part, ahead.
    timeout $(box 330) python3 -m pytest -v -p no:cacheprovider --timeout=300 --tb=short -k "cuda or gpu" -m "not slow" \
      tests/test_engine_verlet.py tests/test_engine_molecular_lists.py tests/test_engine_modes.py tests/test_engine_capture.py tests/test_engine_memory.py tests/test_calculator.py tests/test_neighbors.py tests/test_neighbors_verlet.py tests/test_buckets.py \
      tests/test_physics.py tests/kernels >"$res/pytest_gpu.log" 2>&1
    grep -cE " PASSED" "$res/pytest_gpu.log"; grep -E " (FAILED|ERROR)" "$res/pytest_gpu.log" | head -20
    tail -3 "$res/pytest_gpu.log"
    timeout $(box 150) python3 benchmarks/profile_step.py --out "$res" >"$res/profile.log" 2>&1
    grep -E "=====|device kernels" "$res/profile.log"
    ;;
  engine)
    timeout $(box 330) python3 benchmarks/bench_engine.py --sections latency,md,sweep --budget-s $(box 300) --out "$res" \
      --name engine_h100 >"$res/bench_engine.log" 2>&1
    timeout $(box 200) python3 benchmarks/tune_small.py --skip gemm --out "$res" >"$res/tune.log" 2>&1
    tail -25 "$res/bench_engine.log"; tail -12 "$res/tune.log"
    ;;
  large)
    timeout $(box 500) python3 benchmarks/bench_large.py --out "$res" --budget-s $(box 400) ${LARGE_ARGS:-} 2>&1 | tee "$res/bench_large.log" \
      | tail -60
    ;;
  distill)
    timeout $(box 200) python3 -m pytest -q -p no:cacheprovider -m gpu tests/distill/test_training_static.py 2>&1 \
      | tee "$res/gpu_train_tests.log" | tail -5
    timeout $(box 330) python3 examples/distill_ethanol.py --workers 16 --deadline $(box 270) --work runs/ethanol_gfn2 \
      --results "$res/ethanol" 2>&1 | tee "$res/distill_ethanol.log" | tail -40
    ;;
  ethlong)
    timeout $(box 580) python3 examples/distill_ethanol.py --workers 16 --kernels torch --time-limit $(box 420) \
      --deadline $(box 560) --md-ps 100 --work runs/ethanol_gfn2 --results "$res/ethanol_long" 2>&1 \
      | tee "$res/distill_ethanol_long.log" | tail -40
    ;;
  builtin)
    # --workers must be the count the labels were started with (label_parallel refuses another): the carried
    # runs/chno_gfn2 labels were made on a 2-core CPU with 2 workers.
    timeout $(box 540) python3 examples/make_builtin_student.py --workers 2 --deadline $(box 330) --work runs/chno_gfn2 \
      --results "$res/chno_gfn2" 2>&1 | tee "$res/builtin.log" | tail -40
    ;;
  builtinsmall)
    # builtin:chno-gfn2-small (64 features x 3 layers): the label configs of builtin:chno-gfn2 (labels carried in
    # runs/chno_gfn2, made with 2 processes; --workers must match them) and its training recipe for the same wall
    # clock as the shipped run 2 (121 s). Then the shipped 128 x 3 student on the same held-out frames, same run.
    timeout $(box 480) python3 examples/make_builtin_student.py --workers ${SMALL_WORKERS:-2} --work ${SMALL_WORK:-runs/chno_gfn2} \
      --name chno-gfn2-small --hidden ${SMALL_HIDDEN:-64} --layers ${SMALL_LAYERS:-3} --time-limit ${SMALL_TRAIN_S:-121} \
      --results "$res/chno_gfn2_small" 2>&1 | tee "$res/builtinsmall.log" | tail -40
    timeout $(box 60) python3 -c "
import json, sys
from mlff_distiller import load_model
from mlff_distiller.distill import error_metrics, predict_frames, read_frames
test = read_frames(sys.argv[1])
out = {}
for name in ('chno-gfn2', 'chno-gfn2-small'):
    m = error_metrics(test, predict_frames(load_model(sys.argv[2] if name.endswith('small') else 'builtin:' + name), test, device='cuda', precision='fp32'))
    out[name] = {k: v for k, v in m.items() if not k.startswith('_')}
print(json.dumps(out, indent=1))
" ${SMALL_WORK:-runs/chno_gfn2}/test_labels "$res/chno_gfn2_small/chno-gfn2-small.pt" 2>&1 | tee "$res/same_run_test.json" | tail -30
    ;;
  sevennet)
    timeout $(box 520) python3 examples/distill_water_sevennet.py --deadline $(box 420) --results "$res/water" --work runs/water_sevennet \
      2>&1 | tee "$res/water.log" | tail -40
    ;;
  sevennpt)
    # An NPT water student from SevenNet-0 (--stress: strained frames with the teacher's stress, stress_weight,
    # held-out stress/pressure errors, both equations of state, Berendsen NPT of teacher and student).
    timeout $(box 560) python3 examples/distill_water_sevennet.py --stress --deadline $(box 530) --results "$res/water_npt" \
      --work runs/water_sevennet_npt 2>&1 | tee "$res/water_npt.log" | tail -32
    ;;
  tune)
    timeout $(box 200) python3 benchmarks/tune_small.py --sections kernels,variants --budget-s $(box 150) \
      --out "$res" >"$res/tune.log" 2>&1
    tail -40 "$res/tune.log"
    ;;
  check)
    timeout $(box 300) python3 -m pytest -v -p no:cacheprovider --timeout=240 --tb=long ${CHECK:-tests -m gpu} ${CHECK_K:+-k "$CHECK_K"} \
      >"$res/pytest_check.log" 2>&1
    grep -cE " PASSED" "$res/pytest_check.log"; grep -E " (FAILED|ERROR)" "$res/pytest_check.log" | head -20
    tail -3 "$res/pytest_check.log"
    ;;
  profile)
    timeout $(box 300) python3 benchmarks/profile_step.py --out "$res" --sections ${PROFILE:-small,water} \
      >"$res/profile.log" 2>&1
    grep -E "=====|device kernels|slowest|^group |^large:" "$res/profile.log"
    ;;
  kernels)
    # Issue 3: CUDA tests of the edge/rbf kernels and the backend rule, then bench_kernels (per call and as
    # graph replays; KERNELS_ARGS="--sizes 1e6 --tune" etc.).
    timeout $(box 200) python3 -m pytest -v -p no:cacheprovider --timeout=180 --tb=short -k "cuda or gpu" \
      tests/kernels/test_edge_features.py tests/kernels/test_rbf_cutoff.py tests/kernels/test_backend.py \
      >"$res/pytest_kernels.log" 2>&1
    grep -cE " PASSED" "$res/pytest_kernels.log"; grep -E " (FAILED|ERROR)" "$res/pytest_kernels.log" | head -20
    tail -2 "$res/pytest_kernels.log"
    timeout $(box 380) python3 benchmarks/bench_kernels.py --out "$res" --name bench_kernels_h100 ${KERNELS_ARGS:-} \
      >"$res/bench_kernels.log" 2>&1
    grep -E "copy bandwidth|not capturable|PASS|MISS" "$res/bench_kernels.log" | head -60
    if [ -n "${KERNELS_MODEL:-}" ]; then  # the whole model, backend triton vs torch (benzene, g2 x1024, water 3000)
      timeout $(box 150) python3 benchmarks/bench_model.py --out "$res" >"$res/bench_model.log" 2>&1
      tail -4 "$res/bench_model.log"
    fi
    if [ -n "${KERNELS_PROFILE:-}" ]; then  # host time per call: building blocks, each op, a cProfile
      timeout $(box 150) python3 benchmarks/profile_kernels.py --sections blocks ops cprofile --out "$res" \
        >"$res/profile_kernels.log" 2>&1
      tail -5 "$res/profile_kernels.log"
    fi
    ;;
  probe)
    # Issue 7: does atom order matter? The E+F step on water boxes as built (random molecule order) and Morton-sorted.
    timeout $(box 300) python3 benchmarks/probe_locality.py --sizes ${PROBE_SIZES:-3000 24000} --out "$res" \
      >"$res/probe_locality.log" 2>&1
    tail -8 "$res/probe_locality.log"
    ;;
  nlprof)
    timeout $(box 150) python3 benchmarks/profile_neighbors.py --out "$res" >"$res/profile_neighbors.log" 2>&1
    tail -60 "$res/profile_neighbors.log"
    ;;
  nlcheck)
    timeout $(box 200) python3 -m pytest -v -p no:cacheprovider --timeout=180 --tb=short -k "cuda or gpu" \
      tests/test_neighbors.py tests/test_neighbors_verlet.py tests/test_neighbors_periodic.py tests/test_engine_verlet.py tests/test_engine_molecular_lists.py tests/test_calculator.py \
      >"$res/pytest_nl.log" 2>&1
    grep -cE " PASSED" "$res/pytest_nl.log"; grep -E " (FAILED|ERROR)" "$res/pytest_nl.log" | head -20
    tail -3 "$res/pytest_nl.log"
    timeout $(box 120) python3 benchmarks/profile_neighbors.py --out "$res" >"$res/profile_neighbors.log" 2>&1
    grep -E "^## |wall median" "$res/profile_neighbors.log"
    timeout $(box 200) python3 benchmarks/bench_large.py --sections check,nl --budget-s $(box 170) --out "$res" \
      >"$res/bench_large.log" 2>&1
    grep -E "NL |ours == ref" "$res/bench_large.log" | head -12
    ;;
  edgetune)
    timeout $(box 300) python3 benchmarks/tune_small.py --sections ${TUNE_SECTIONS:-edgetiles} --budget-s $(box 240) --out "$res" \
      >"$res/tune.log" 2>&1
    grep -E "shipped|Not run" "$res/tune.log" | head; sort -t'|' -k8 -n "$res/tune.log" | grep -E "^\| (water|g2)" | head -30
    ;;
  ncu)
    # probe_ncu.py: launch-option sweep of the step (num_stages, the GEMM tile), then Nsight Compute counters of
    # one step of the 24,000-atom water box and of 4,096 g2 molecules (NCU_SYSTEMS). NCU_SWEEP=0 skips the sweep.
    if [ "${NCU_SWEEP:-1}" = 1 ]; then
      timeout $(box ${SWEEP_BOX:-260}) python3 benchmarks/probe_ncu.py --mode sweep \
        --systems ${SWEEP_SYSTEMS:-water3000,water24000,g2x4096} ${SWEEP_VARIANTS:+--variants "$SWEEP_VARIANTS"} \
        --budget-s $(box $(( ${SWEEP_BOX:-260} - 60 ))) --out "$res" ${SWEEP_ARGS:-} >"$res/sweep.log" 2>&1
      grep -E "^\| " "$res/sweep.log" | tail -40
    fi
    NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    secs=(--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats
          --section SchedulerStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis)
    for s in ${NCU_SYSTEMS:-water24000 g2x4096}; do
      timeout $(box ${NCU_BOX:-150}) "$NCU" --clock-control none --profile-from-start off -c ${NCU_COUNT:-45} \
        -k "regex:${NCU_KERNELS:-_mp_|_gemm_kernel|_edge_bwd|_painn}" "${secs[@]}" \
        --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
        --log-file "$res/ncu_$s.txt" python3 benchmarks/probe_ncu.py --mode ncu --step-mode eager --systems "$s" >"$res/ncu_run_$s.log" 2>&1
      echo "ncu $s rc $?"; tail -3 "$res/ncu_run_$s.log"; grep -c "Section: GPU Speed Of Light" "$res/ncu_$s.txt"
    done
    ;;
  pdl)
    # Programmatic dependent launch: a CUDA graph of small dependent kernels with and without it (probe_pdl.py).
    timeout $(box 150) python3 benchmarks/probe_pdl.py --out "$res" >"$res/probe_pdl.log" 2>&1
    grep -E "^\| " "$res/probe_pdl.log" | tail -30; tail -3 "$res/probe_pdl.log"
    ;;
  pdlbench)
    # The energy + forces step with programmatic dependent launch off and on (bench_pdl.py).
    timeout $(box 300) python3 benchmarks/bench_pdl.py --out "$res" ${PDL_ARGS:-} >"$res/bench_pdl.log" 2>&1
    grep -E "^\| " "$res/bench_pdl.log" | tail -16; tail -3 "$res/bench_pdl.log"
    ;;
  enginelat)
    timeout $(box 240) python3 benchmarks/bench_engine.py --sections ${ENGINE_SECTIONS:-latency,md} --budget-s $(box 200) --out "$res" \
      --name engine_h100_run2 --variants "reference,eager,cudagraph" >"$res/bench_engine.log" 2>&1
    tail -40 "$res/bench_engine.log"
    ;;
  small)
    # The speed targets' benchmarks for a student of builtin:chno-gfn2-small's size (64 x 3; SMALL_HIDDEN/SMALL_LAYERS),
    # the torch reference of the same size beside ours in each run: water E+F (bench_large) and the engine (bench_engine).
    timeout $(box 200) python3 benchmarks/bench_large.py --out "$res/large" --budget-s $(box 170) --sections check,ef \
      --sizes 192 3000 24000 --hidden ${SMALL_HIDDEN:-64} --layers ${SMALL_LAYERS:-3} >"$res/bench_large.log" 2>&1
    grep -E "^\| " "$res/large/bench_large.md" | head -30
    timeout $(box 300) python3 benchmarks/bench_engine.py --sections latency,md,sweep --budget-s $(box 270) --out "$res" \
      --name engine_small_h100 --sizes 1,64,1024,4096 --hidden ${SMALL_HIDDEN:-64} --layers ${SMALL_LAYERS:-3} \
      --variants "eager,=cudagraph,cudagraph fp32,cudagraph tf32" >"$res/bench_engine.log" 2>&1
    tail -45 "$res/engine_small_h100.md"
    ;;
  stress)
    # Stress in the padded modes (stop 22, CPU-tested only so far): its CUDA tests, then bench_stress.py (padded
    # stress step vs the eager path, NPTBerendsen through the calculator) for the shipped and the small student size.
    timeout $(box 200) python3 -m pytest -v -p no:cacheprovider --timeout=180 tests/test_engine_stress.py tests/test_engine_npt.py tests/test_physics.py tests/test_engine_modes.py tests/test_engine_capture.py tests/test_engine_memory.py \
      -k "stress or warmup or virial" >"$res/pytest_stress.log" 2>&1
    grep -cE " PASSED" "$res/pytest_stress.log"; grep -E " (FAILED|ERROR)" "$res/pytest_stress.log" | head; tail -2 "$res/pytest_stress.log"
    timeout $(box 170) python3 benchmarks/bench_stress.py --out "$res" --name stress_h100 >"$res/bench_stress.log" 2>&1
    timeout $(box 170) python3 benchmarks/bench_stress.py --out "$res" --name stress_small_h100 --hidden 64 \
      >"$res/bench_stress_small.log" 2>&1
    grep -E "^\| " "$res/stress_h100.md" "$res/stress_small_h100.md" | head -30; tail -3 "$res/bench_stress.log"
    ;;
  npt)
    # NPT with the Verlet list kept across cell changes: CUDA tests, bench_stress (random 128 x 3, all sections),
    # then the NPT step of the trained water NPT student against SevenNet-0 (needs .whl7).
    timeout $(box 200) python3 -m pytest -v -p no:cacheprovider --timeout=180 tests/test_engine_stress.py tests/test_engine_npt.py tests/test_verlet_strain.py \
      tests/test_engine_verlet.py tests/test_engine_molecular_lists.py -k "cuda or gpu or npt or strain" >"$res/pytest_npt.log" 2>&1
    grep -cE " PASSED" "$res/pytest_npt.log"; grep -E " (FAILED|ERROR)" "$res/pytest_npt.log" | head; tail -2 "$res/pytest_npt.log"
    timeout $(box 170) python3 benchmarks/bench_stress.py --out "$res" --name stress_npt_h100 >"$res/bench_stress.log" 2>&1
    grep -E "^\| |speed-up" "$res/stress_npt_h100.md" | tail -8
    timeout $(box 150) python3 benchmarks/bench_stress.py --out "$res" --name npt_water_student_h100 --skip-compute \
      --student benchmarks/results/water_sevennet_npt_h100/water-sevennet-npt.pt --teacher sevennet-0 --npt-steps 300 \
      --teacher-steps 40 >"$res/bench_npt_student.log" 2>&1
    grep -E "^\| |speed-up" "$res/npt_water_student_h100.md" | tail -8; tail -3 "$res/bench_npt_student.log"
    ;;
  capture)
    # Stop 24 (no device time that stop): the capture changes (garbage collector off during every capture, the
    # retry on a real invalidated capture) and the hunt for stop 23's intermittent stress-step invalidation.
    # 1. CUDA tests of the capture sites: engine steps (incl. the real-invalidation retry test), the stress steps,
    #    the periodic cell list's graphs, the captured training step.
    timeout $(box 260) python3 -m pytest -v -p no:cacheprovider --timeout=200 tests/test_engine_modes.py tests/test_engine_capture.py tests/test_engine_memory.py \
      tests/test_engine_stress.py tests/test_engine_npt.py tests/test_neighbors_periodic.py tests/distill/test_training_static.py \
      tests/distill/test_stress_training.py -k "cuda or gpu" >"$res/pytest_capture.log" 2>&1
    grep -cE " PASSED" "$res/pytest_capture.log"; grep -E " (FAILED|ERROR)" "$res/pytest_capture.log" | head; tail -2 "$res/pytest_capture.log"
    # 2. The seven-file sequence in which stop 23 saw the invalidation, with one capture attempt (no retry: an
    #    invalidation fails its test and names the live Python threads), repeated while the box lasts.
    seven="tests/test_engine_modes.py tests/test_engine_capture.py tests/test_engine_memory.py tests/test_calculator.py tests/test_engine.py tests/test_engine_verlet.py tests/test_engine_molecular_lists.py \
      tests/test_engine_stress.py tests/test_engine_npt.py tests/test_physics.py tests/test_buckets.py"
    end=$(( $(date +%s) + $(box 320) ))
    k=0
    while [ $(( end - $(date +%s) )) -gt 170 ]; do
      k=$((k + 1))
      timeout 200 python3 -c "import sys, pytest, mlff_distiller.engine_padded as e; e.CAPTURE_ATTEMPTS = 1; \
sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '-rfE', '--timeout=150', '-k', 'cuda or gpu', *sys.argv[1:]]))" \
        $seven >"$res/pytest_seven_$k.log" 2>&1
      echo "seven-file run $k: $(tail -1 "$res/pytest_seven_$k.log")"; grep -E "^FAILED|threads alive" "$res/pytest_seven_$k.log" | head -5
    done
    ;;
  stressprobe)
    # Stop 25: why a padded stress call costs more than an energy + forces call of the same box (probe_stress_step.py),
    # then the speed targets' rows for the shipped sizes at the current code (probe_student_size.py, 128 x 3 and 64 x 3).
    timeout $(box 200) python3 benchmarks/probe_stress_step.py --out "$res" >"$res/probe_stress_step.log" 2>&1
    grep -vE "USDT" "$res/probe_stress_step.log" | tail -70
    timeout $(box 330) python3 benchmarks/probe_student_size.py --configs ${SIZE_CONFIGS:-128x3,64x3} --out "$res" \
      --name probe_student_size_h100_run3 >"$res/probe_size.log" 2>&1
    grep -E "^\| " "$res/probe_size.log" | tail -6; tail -3 "$res/probe_size.log"
    ;;
  nptab)
    # The NPT host path, old package against the tree (stop 25's method, results/npt_host_ab_h100.md): first, here,
    # `bash scripts/ab_package.sh prepare <old commit>`; carry .ab and .whl. The CUDA NPT tests of the tree, then
    # AB_PAIRS (default 4) pairs of fresh processes, each timing the phases of 600 NPTBerendsen steps.
    timeout $(box 150) python3 -m pytest -q -p no:cacheprovider -k "cuda or gpu or npt or strain" tests/test_engine_stress.py tests/test_engine_npt.py \
      tests/test_verlet_strain.py tests/test_engine_verlet.py tests/test_engine_molecular_lists.py >"$res/pytest_npt.log" 2>&1
    tail -1 "$res/pytest_npt.log"; grep -E "^FAILED" "$res/pytest_npt.log" | head
    timeout $(box 420) bash scripts/ab_package.sh run ${AB_PAIRS:-4} "$res/ab" -- bash -c \
      'python3 benchmarks/probe_stress_step.py --sizes --npt-steps 600 --out "$0" --name "npt_${AB_RUN}_${AB_SIDE}"' "$res/ab"
    grep -H "whole step" "$res"/ab/npt_*.md
    ;;
  startup)
    # Import and start-up: first, here, `bash scripts/ab_package.sh prepare <old commit>`; carry .ab and .whl. The
    # GPU tests of the engine modes (compile, the cache directory, captures) and of the lazily registered Triton ops
    # (STARTUP_TESTS=0 skips them), then AB_PAIRS (default 3) pairs of fresh bench_startup.py runs (auto, cold and
    # warm, load -> first result profiled), old package against the tree, then the compile variant (its cache, cold
    # and warm) of each side once (STARTUP_COMPILE=0 skips it). STARTUP_PYC=1 first byte-compiles torch, sympy, triton and the wheels: the
    # device's Python environment ships no .pyc files, so every fresh process there compiles the source of each
    # module it imports (2.6 of 4.6 s of one first result in stop 26's first run), which a pip-installed
    # environment does once, at install.
    if [ "${STARTUP_PYC:-0}" = 1 ]; then
      dirs=$(python3 -c "import os, sympy, torch, triton; print(' '.join(os.path.dirname(m.__file__) for m in (torch, sympy, triton)))")
      t0=$SECONDS; timeout $(box 150) python3 -m compileall -q -j 0 $dirs /tmp/site >/dev/null 2>"$res/compileall.log"
      echo "compileall: exit $?, $((SECONDS - t0)) s" | tee -a "$res/compileall.log"
    fi
    if [ "${STARTUP_TESTS:-1}" = 1 ]; then
      timeout $(box 240) python3 -m pytest -q -p no:cacheprovider --timeout=200 tests/kernels/test_triton_utils.py \
        tests/test_engine_modes.py tests/test_engine_capture.py tests/test_engine_memory.py >"$res/pytest_startup.log" 2>&1
      tail -1 "$res/pytest_startup.log"; grep -E "^FAILED" "$res/pytest_startup.log" | head
    fi
    timeout $(box 240) bash scripts/ab_package.sh run ${AB_PAIRS:-3} "$res/ab" -- bash -c \
      'python3 benchmarks/bench_startup.py --device cuda --variants auto --profile --out "$0" --name "startup_${AB_RUN}_${AB_SIDE}"' "$res/ab"
    for side in $([ "${STARTUP_COMPILE:-1}" = 1 ] && echo old new); do
      pp=$PYTHONPATH; [ $side = old ] && pp=$PWD/.ab/old:$PYTHONPATH
      PYTHONPATH=$pp timeout $(box 110) python3 benchmarks/bench_startup.py --device cuda --variants cudagraph --profile \
        --out "$res" --name startup_compile_$side | cut -c1-400
    done
    ;;
  ahead)
    # Cold start with the parallel compile-ahead dry run off / on (kernels/_compile_ahead.py): its GPU tests, then
    # AHEAD_PAIRS (default 2) alternating pairs of bench_startup.py (auto: a cold and a warm process each).
    timeout $(box 150) python3 -m pytest -v -s -p no:cacheprovider --timeout=140 tests/kernels/test_compile_ahead.py \
      >"$res/pytest_ahead.log" 2>&1
    grep -cE " PASSED" "$res/pytest_ahead.log"; grep -E " (FAILED|ERROR)|cold first result" "$res/pytest_ahead.log"
    tail -1 "$res/pytest_ahead.log"
    for i in $(seq ${AHEAD_PAIRS:-2}); do
      for a in 0 1; do
        MLFF_DISTILLER_COMPILE_AHEAD=$a timeout $(box 100) python3 benchmarks/bench_startup.py --device cuda \
          --variants auto --out "$res" --name "startup_ahead${a}_$i" 2>&1 | grep -E '^\{' | cut -c1-330
      done
    done
    ;;
  mdprobe)
    # One benzene MD step piece by piece on the GPU host (probe_md_step.py): ASE, host work, launch, copies.
    timeout $(box 200) python3 benchmarks/probe_md_step.py --out "$res" >"$res/probe_md_step.log" 2>&1
    grep -E "^\| |max" "$res/probe_md_step.log" | tail -14; tail -3 "$res/probe_md_step.log"
    ;;
  hostpipe)
    timeout $(box 300) python3 benchmarks/bench_host.py --gpu --sizes 1024 4096 --reps 9 --pipeline ${PIPE_N:-16384} \
      --out "$res" --name bench_host_h100 >"$res/bench_host.log" 2>&1
    grep -E "^\| " "$res/bench_host.log" | tail -16; tail -3 "$res/bench_host.log"
    ;;
  ethsize)
    for hl in ${ETH_SIZES:-128x3 64x3 64x2}; do
      timeout $(box 190) python3 examples/distill_ethanol.py --workers 16 --kernels torch --time-limit ${ETH_TRAIN_S:-75} \
        --deadline $(box 170) --md-ps 2 --timing-steps 100 --hidden ${hl%x*} --layers ${hl#*x} --work runs/ethanol_gfn2 \
        --results "$res/ethanol_$hl" >"$res/ethanol_$hl.log" 2>&1
      echo "== $hl"; grep -E "^\| test|best validation|Training:" "$res/ethanol_$hl/summary.md" | head -4
    done
    ;;
  studentsize)
    timeout $(box 420) python3 benchmarks/probe_student_size.py --out "$res" ${SIZE_ARGS:-} >"$res/probe_size.log" 2>&1
    grep -E "^\| " "$res/probe_size.log" | tail -8; tail -3 "$res/probe_size.log"
    ;;
  batchedmd)
    timeout $(box 150) python3 -m pytest -v -p no:cacheprovider --timeout=140 --tb=short tests/test_batched_md.py \
      tests/test_md_frames.py >"$res/pytest_gpu.log" 2>&1
    timeout $(box 150) python3 -m pytest -v -p no:cacheprovider --timeout=140 --tb=short -k "cuda or gpu" \
      tests/test_neighbors.py tests/test_neighbors_verlet.py tests/test_engine_verlet.py tests/test_engine_molecular_lists.py tests/test_engine.py >"$res/pytest_gpu_nl.log" 2>&1
    grep -cE " PASSED" "$res/pytest_gpu_nl.log"; grep -E " (FAILED|ERROR)" "$res/pytest_gpu_nl.log" | head -20
    tail -1 "$res/pytest_gpu_nl.log"
    timeout $(box 60) python3 benchmarks/probe_batched_rebuild.py --out "$res" >"$res/probe_rebuild.log" 2>&1
    grep -E "^\| [0-9]" "$res/probe_rebuild.log"
    grep -cE " PASSED" "$res/pytest_gpu.log"; grep -E " (FAILED|ERROR)" "$res/pytest_gpu.log" | head -20
    tail -2 "$res/pytest_gpu.log"
    timeout $(box 300) python3 benchmarks/bench_batched_md.py --out "$res" --budget-s $(box 240) ${BMD_ARGS:-} \
      >"$res/bench_batched_md.log" 2>&1
    grep -E "^\| " "$res/bench_batched_md.log" | tail -24; tail -2 "$res/bench_batched_md.log"
    python3 -c "from mlff_distiller.distill.seeds import g2_chno; import ase.io; ase.io.write('/tmp/g2.extxyz', g2_chno())"
    for r in 1 16; do
      timeout $(box 100) python3 -m mlff_distiller.cli md --input /tmp/g2.extxyz@: --replicas $r --steps 2000 --interval 500 \
        --output "$res/g2_x$r.extxyz" >"$res/md_cli_x$r.json" 2>"$res/md_cli_x$r.err"
      echo "md x$r: $(cat "$res/md_cli_x$r.json")"; tail -2 "$res/md_cli_x$r.err"
      rm -f "$res/g2_x$r.extxyz"
    done
    # the teacher on this host's CPU (needs tblite carried in .whl)
    timeout $(box 120) python3 benchmarks/bench_teacher_md.py --out "$res" >"$res/bench_teacher_md.log" 2>&1
    grep -E "Mean|replica-steps" "$res/bench_teacher_md.log"; tail -2 "$res/bench_teacher_md.log"
    ;;
  repulsion)
    timeout $(box 200) python3 -m pytest -v -p no:cacheprovider --timeout=190 --tb=short -k "cuda or gpu or triton" \
      tests/kernels/test_repulsion.py tests/test_model_repulsion.py tests/test_engine_modes.py tests/test_engine_capture.py \
      tests/test_calculator.py tests/test_batched_md.py tests/test_batched_relax.py >"$res/pytest_gpu.log" 2>&1
    grep -cE " PASSED" "$res/pytest_gpu.log"; grep -E " (FAILED|ERROR)" "$res/pytest_gpu.log" | head -20
    tail -1 "$res/pytest_gpu.log"
    timeout $(box 240) python3 benchmarks/bench_repulsion.py --out "$res" >"$res/bench_repulsion.log" 2>&1
    grep -E "^\| " "$res/bench_repulsion.log"; tail -2 "$res/bench_repulsion.log"
    timeout $(box 150) python3 benchmarks/bench_batched_relax.py --out "$res" >"$res/bench_relax.log" 2>&1
    grep -E "^\| |ASE's" "$res/bench_relax.log"; tail -2 "$res/bench_relax.log"
    timeout $(box 150) python3 benchmarks/probe_hot_md.py --out "$res" --temperatures 1500,2000 --steps 6000 \
      >"$res/probe_hot_md.log" 2>&1
    grep -E "^\| [0-9]" "$res/probe_hot_md.log"; tail -1 "$res/probe_hot_md.log"
    ;;
  mdspeed)
    timeout $(box 240) python3 benchmarks/bench_md_speed.py --out "$res/md_speed" 2>&1 | tee "$res/md_speed.log" | tail -12
    ;;
  diag)
    timeout $(box 150) python3 scripts/diag_graph_train.py 2>&1 | grep -v Warning | tee "$res/diag.log" | tail -25
    ;;
  ddp)
    timeout 540 python3 benchmarks/bench_ddp.py --gpus 2 --steps 300 --out "$res" 2>&1 | tee "$res/bench_ddp.log" \
      | tail -20
    ;;
  *)
    echo "unknown part $part"; exit 2 ;;
esac
pack  # after each part too: a call cut off later still returns the parts that finished
done
