#!/usr/bin/env bash
# A/B of two source trees in one device call: alternately install each tree (editable) and run the same
# command in it, ROUNDS times, each run writing into $AB_OUT/<label>_<round> (the command sees it as $AB_DIR).
#   bash scripts/gpu_ab.sh OLD_TREE NEW_TREE ROUNDS 'python3 benchmarks/bench_engine.py --out "$AB_DIR" ...'
# Wheels in .whl (ase, ...) of the current directory are installed once into /tmp/site.
set -uo pipefail
old=$(realpath "$1"); new=$(realpath "$2"); rounds=$3; cmd=$4
out=${AB_OUT:-${OUT:-/tmp}/ab}
mkdir -p "$out"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
for r in $(seq 1 "$rounds"); do
  for label in old new; do
    tree=$old; [ "$label" = new ] && tree=$new
    (cd "$tree" && python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/tmp/ab_install.log 2>&1) \
      || { cat /tmp/ab_install.log; exit 1; }
    export AB_DIR="$out/${label}_$r"
    mkdir -p "$AB_DIR"
    echo "===== $label round $r ($(cat "$tree/COMMIT" 2>/dev/null || echo "$tree"))"
    (cd "$tree" && eval "$cmd") >"$AB_DIR/log.txt" 2>&1
    echo "rc $?"; grep -E "^\| " "$AB_DIR/log.txt" | tail -${AB_TAIL:-12}
  done
done
