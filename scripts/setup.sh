#!/usr/bin/env bash
# Set-up for a fresh machine: installs mlff-distiller (editable) with the given extras.
#   bash scripts/setup.sh            # core (demo)
#   bash scripts/setup.sh test       # core + test tools
# Torch: an already installed torch (CPU or CUDA build, 2.11-2.14) is kept. Without one, torch 2.13.0 is
# installed first: on a CPU-only machine of this project's CI that is the small CPU build on local disk, where a
# bare "torch" requirement would pull the multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extras=${1:-}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install -q "torch==2.13.0"
fi
if [ -n "$extras" ]; then spec=".[$extras]"; else spec="."; fi
"$PY" -m pip install -q -e "$spec"
