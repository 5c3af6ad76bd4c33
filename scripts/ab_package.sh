#!/usr/bin/env bash
# A/B timing of the package at an older commit against the working tree, in fresh processes that alternate, on
# one machine in one call: the way to see a host-side change of a few percent when the device hosts vary by up to
# 2x from call to call (stop 25, results/npt_host_ab_h100.md).
#
#   bash scripts/ab_package.sh prepare <commit>          # here: .ab/old/mlff_distiller = the package at <commit>
#   bash scripts/ab_package.sh run <pairs> <out> -- CMD  # there (carry .ab): CMD per side, order old new new old ...
#
# `prepare` copies src/mlff_distiller and kernels/ of <commit> into .ab/old (git-ignored through .git/info/exclude;
# carry it with the device tool). `run` puts .ab/old first on PYTHONPATH for the "old" side, so `import
# mlff_distiller` finds the old package before the editable install of the tree; the "new" side runs the tree.
# Each run writes <out>/ab_<k>_<side>.log (stdout and stderr of CMD) and prints its last line; CMD sees AB_SIDE
# (old|new) and AB_RUN (k). The benchmark scripts themselves come from the tree: they must not need what the old
# package lacks (probe_stress_step.py skips the phases an older package does not have).
set -euo pipefail
cmd=${1:-}
case "$cmd" in
  prepare)
    commit=${2:?usage: ab_package.sh prepare <commit>}
    rm -rf .ab/old .ab/tmp
    mkdir -p .ab/tmp .ab/old
    git archive "$commit" src/mlff_distiller kernels | tar x -C .ab/tmp
    mv .ab/tmp/src/mlff_distiller .ab/old/mlff_distiller
    rm -rf .ab/old/mlff_distiller/kernels
    mv .ab/tmp/kernels .ab/old/mlff_distiller/kernels  # installed as mlff_distiller.kernels
    rm -rf .ab/tmp
    echo "$commit" > .ab/old/COMMIT
    mkdir -p .git/info
    grep -qx ".ab/" .git/info/exclude 2>/dev/null || echo ".ab/" >> .git/info/exclude
    echo "prepared .ab/old at $(cat .ab/old/COMMIT) ($(du -sh .ab/old | cut -f1)); carry .ab"
    ;;
  run)
    pairs=${2:?usage: ab_package.sh run <pairs> <out> -- CMD}
    out=${3:?usage: ab_package.sh run <pairs> <out> -- CMD}
    shift 3
    [ "${1:-}" = "--" ] && shift
    [ $# -ge 1 ] || { echo "ab_package.sh run: no command after --" >&2; exit 2; }
    [ -d .ab/old/mlff_distiller ] || { echo "ab_package.sh run: .ab/old is missing (run prepare here, carry .ab)" >&2; exit 2; }
    mkdir -p "$out"
    base=${PYTHONPATH:-}
    k=0
    for ((p = 0; p < pairs; p++)); do
      if ((p % 2 == 0)); then order="old new"; else order="new old"; fi
      for side in $order; do
        k=$((k + 1))
        if [ "$side" = old ]; then pp=".ab/old${base:+:$base}"; else pp="$base"; fi
        where=$(PYTHONPATH="$pp" python3 -c "import mlff_distiller; print(mlff_distiller.__file__)")
        status=0
        AB_SIDE=$side AB_RUN=$k PYTHONPATH="$pp" "$@" >"$out/ab_${k}_${side}.log" 2>&1 || status=$?
        echo "== run $k, $side ($where; exit $status): $(tail -1 "$out/ab_${k}_${side}.log")"
      done
    done
    ;;
  *)
    echo "usage: ab_package.sh prepare <commit> | run <pairs> <out> -- CMD" >&2
    exit 2
    ;;
esac
