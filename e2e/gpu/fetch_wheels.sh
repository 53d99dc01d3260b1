#!/usr/bin/env bash
# Here, before a GPU call: the wheels the GPU image lacks (gpu_image.py's WHEELS: the serve step's web stack and the grammar library),
# for its CPython 3.12, into .whl/ (in .gitignore, carried by the run). About 3 MB.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl
WHEELS=$(python3 -c "import sys; sys.path.insert(0, 'e2e/gpu'); import gpu_image; print(' '.join(gpu_image.WHEELS))")
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl $WHEELS
du -sh .whl
