#!/usr/bin/env bash
# The whole GPU run as one device-tool call, from the repository root (e2e/gpu/README.md, "Run plan"):
#   run(command="bash e2e/gpu/run_on_gpu.sh", carry=[".flashinfer_aot", ".whl"], timeout_s=560)
# 1. install what the image lacks (.whl: e2e/gpu/fetch_wheels.sh) and this checkout, for child processes;
# 2. gpu_check.py: backends, correctness, ceilings, engine (decode b=64, mixed), attention (Triton vs flashinfer),
#    fused ops; 3. serve_check.py: `stallfree serve` on the GPU, one chat, `bench engine --quick` rows.
# Extra arguments go to gpu_check.py (e.g. --sections correctness,ceilings,engine --no-sweep).
# Exit status: 0 only if both steps are green; their tables and JSON land in $OUT.
set -o pipefail
cd "$(dirname "$0")/../.."
OUT_DIR="${OUT:-/tmp/gpu_check_out}"
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
SITE=/tmp/stallfree-site
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .whl/*.whl || exit 3
fi
# The checkout itself (setuptools is in the image; nothing is fetched): `python3 -m stallfree.cli` for serve and bench.
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target "$SITE" . || exit 3
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
if [ -f .flashinfer_aot/manifest.json ]; then
  # The carried flashinfer bundle (e2e/gpu/README.md): trimmed package + sm_90 kernels built ahead of time.
  export PYTHONPATH="$PWD/.flashinfer_aot/site:$PYTHONPATH"
  STALLFREE_FLASHINFER_BACKEND=$(python3 -c "import json; print(json.load(open('.flashinfer_aot/manifest.json'))['kernel_backend'])")
  export STALLFREE_FLASHINFER_BACKEND
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1 | tee "$OUT_DIR/nvidia_smi.txt"
python3 -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__)"
timeout 330 python3 e2e/gpu/gpu_check.py --budget-s 270 --json "$OUT_DIR/gpu_check.json" "$@" 2>&1 | tee "$OUT_DIR/gpu_check.log"
check=$?
timeout 200 python3 e2e/gpu/serve_check.py --device cuda --bench --bench-timeout-s 150 \
  --json "$OUT_DIR/serve_check.json" 2>&1 | tee "$OUT_DIR/serve_check.log"
e2e=$?
echo "gpu_check exit $check, serve_check exit $e2e"
[ "$check" -eq 0 ] && [ "$e2e" -eq 0 ]
