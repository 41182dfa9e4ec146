#!/bin/sh
# GPU check: the tiny bundle (or BUNDLE=dir) on the CPU, CUDA and TensorRT providers, compared with CPU, plus a
# small bench. Providers that are not usable here (no GPU, CPU-only onnxruntime) are skipped with the reason.
# Usage: tools/gpu-check.sh [--bundle DIR] [--json out.json]   (PYTHON=.venv/bin/python by default)
set -eu
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python3
exec "$PYTHON" tools/gpu_check.py "$@"
