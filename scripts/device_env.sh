# Sourced by the GPU scripts on the device machine (repository root, .whl carried): the carried wheels (ASE) on
# PYTHONPATH, the package installed without network, $OUT made. Exits the sourcing script if an install fails.
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=16
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/tmp/i.log 2>&1 || { cat /tmp/i.log; exit 1; }
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
