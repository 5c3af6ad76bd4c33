#!/usr/bin/env bash
# One-command GPU check, run on the device machine from the repository root:
#   bash scripts/gpu_check.sh [pytest args...]
# Installs carried wheels (.whl/, see README "GPU check"), installs the package without network, runs the tests
# marked or parametrised for CUDA plus the short kernel benchmark, and copies logs/results to $OUT if set.
set -uo pipefail
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/tmp/install.log 2>&1 || { cat /tmp/install.log; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
OUTDIR=${OUT:-/tmp/out}; mkdir -p "$OUTDIR"
python3 -m pytest -q -p no:cacheprovider --timeout=600 "$@" 2>&1 | tee "$OUTDIR/pytest_gpu.log"
exit "${PIPESTATUS[0]}"
