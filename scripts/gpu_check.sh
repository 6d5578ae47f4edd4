#!/usr/bin/env bash
# GPU acceptance check (scripts/gpu_check.py): the CUDA tests, the Triton kernels against their references, a
# short bf16 pretrain of a ~1B Llama-class model (tokens/s, TFLOP/s, MFU) and tp=2 on ranks sharing one GPU.
#
#   bash scripts/gpu_check.sh            # on a GPU node: sets up .venv like scripts/test.sh, then runs
#   bash scripts/gpu_check.sh --cpu      # every phase at toy sizes on the CPU (what CI runs)
#   TPZOO_SYSTEM_PYTHON=1 bash scripts/gpu_check.sh
#                                        # use the current python3's (CUDA) torch instead of a .venv: an image
#                                        # with PyTorch preinstalled; tpzoo is installed into it (editable, no deps)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ "${TPZOO_SYSTEM_PYTHON:-0}" = "1" ]; then
  PY="${PYTHON:-python3}"
  "$PY" -c "import tpzoo.models" 2>/dev/null || \
    "$PY" -m pip install -q --no-deps --no-build-isolation -e "$ROOT"
  cd "$ROOT"
  exec env PYTHONUNBUFFERED=1 "$PY" scripts/gpu_check.py "$@"
fi
source "$ROOT/scripts/env.sh"
exec env PYTHONUNBUFFERED=1 python scripts/gpu_check.py "$@"
