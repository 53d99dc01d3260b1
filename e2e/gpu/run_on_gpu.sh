#!/usr/bin/env bash
# The GPU check as one device-tool call, from the repository root:
#   run(command="bash e2e/gpu/run_on_gpu.sh", carry=[".flashinfer_aot"], timeout_s=540)
# Extra arguments go to gpu_check.py (e.g. --sections attention,engine --no-sweep).
set -o pipefail
cd "$(dirname "$0")/../.."
if [ -f .flashinfer_aot/manifest.json ]; then
  # The carried flashinfer bundle (e2e/gpu/README.md): trimmed package + sm_90 kernels built ahead of time.
  export PYTHONPATH="$PWD/.flashinfer_aot/site${PYTHONPATH:+:$PYTHONPATH}"
  STALLFREE_FLASHINFER_BACKEND=$(python3 -c "import json; print(json.load(open('.flashinfer_aot/manifest.json'))['kernel_backend'])")
  export STALLFREE_FLASHINFER_BACKEND
fi
OUT_DIR="${OUT:-/tmp/gpu_check_out}"
mkdir -p "$OUT_DIR"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1 | tee "$OUT_DIR/nvidia_smi.txt"
PYTHONUNBUFFERED=1 python3 e2e/gpu/gpu_check.py --budget-s 420 --json "$OUT_DIR/gpu_check.json" "$@" 2>&1 | tee "$OUT_DIR/gpu_check.log"
