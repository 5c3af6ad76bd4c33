#!/usr/bin/env bash
# The CPU test suite in fresh venvs, one per supported combination (stop 80: benchmarks/results/stop80_cpu/compat.md).
# CI runs one combination (Python 3.11, torch 2.13.0+cpu, Triton 3.9); this runs the others, one after another:
#   bash scripts/compat_matrix.sh                    # the default list below
#   bash scripts/compat_matrix.sh 3.12:2.12.1 3.11:2.11.0:numpy==2.4.6
# Each argument is PYTHON_VERSION:TORCH_VERSION[:EXTRA_PIP_SPEC]. The venvs live under ${COMPAT_DIR:-/tmp/mlff_compat}
# (kept between runs; torch's CUDA builds are 3-5 GB each, Triton comes pinned with them). The Python version must be
# installed (pyenv's python3.X here). COMPAT_PYTEST_ARGS limits the run (a test file, -k ...). Prints each run's
# last pytest line; the logs stay beside the venvs.
set -uo pipefail
cd "$(dirname "$0")/.."
dir=${COMPAT_DIR:-/tmp/mlff_compat}
mkdir -p "$dir"
specs=("$@")
[ ${#specs[@]} -eq 0 ] && specs=(3.11:2.11.0 3.12:2.12.1 3.11:2.14.1)
for spec in "${specs[@]}"; do
  IFS=: read -r py torch extra <<<"$spec"
  name="py${py}-torch${torch}${extra:+-${extra//[^A-Za-z0-9.]/}}"
  venv="$dir/$name"
  if [ ! -x "$venv/bin/python" ]; then
    "python$py" -m venv "$venv" || { echo "== $name: no python$py"; continue; }
    "$venv/bin/pip" install -q "torch==$torch" ${extra:+"$extra"} >"$venv.install.log" 2>&1 || {
      echo "== $name: install failed (see $venv.install.log)"; continue; }
  fi
  PYTHON="$venv/bin/python" bash scripts/setup.sh test >>"$venv.install.log" 2>&1 || {
    echo "== $name: setup failed (see $venv.install.log)"; continue; }
  versions=$("$venv/bin/python" -c "import sys, torch, triton, numpy
print(sys.version.split()[0], torch.__version__, triton.__version__, numpy.__version__)")
  OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1 "$venv/bin/python" -m pytest -q -p no:cacheprovider \
    --timeout=900 -n 2 --dist loadfile -rs ${COMPAT_PYTEST_ARGS:-} >"$venv.pytest.log" 2>&1
  echo "== $name ($versions): $(tail -1 "$venv.pytest.log")"
  grep -E "^(FAILED|ERROR)" "$venv.pytest.log" | head -10
done
