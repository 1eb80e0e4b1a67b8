#!/usr/bin/env bash
# Set up mpsnn on a fresh machine: a virtual environment in .venv with the CPU build of
# torch 2.13.0 (pinned: an unpinned `pip install torch` pulls gigabytes of CUDA packages),
# mpsnn itself (editable, with the `mpsnn` command), matplotlib (for `mpsnn train --plot`), Pillow
# (images of your own: `mpsnn train --dataset DIR`), and
# Fashion-MNIST from Debian's dataset-fashion-mnist package.
#   scripts/setup.sh          what the examples need
#   scripts/setup.sh --dev    plus pytest, ruff, mypy and triton (its interpreter runs GPU kernels on the CPU),
#                             and onnx, onnxscript, onnxruntime (the tests of `mpsnn export` to ONNX)
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q torch==2.13.0 "numpy>=1.24" "safetensors>=0.4" "click>=8.1" "rich>=13" \
  "matplotlib>=3.7" "pillow>=9.1" "setuptools>=68"
.venv/bin/python -m pip install -q --no-deps --no-build-isolation -e .
if [ "${1:-}" = "--dev" ]; then
  .venv/bin/python -m pip install -q "pytest>=8" "ruff>=0.6" "mypy>=1.11" "triton>=3.0" "onnx>=1.17" \
    "onnxscript>=0.5" "onnxruntime>=1.20"
fi

if [ ! -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]; then
  sudo=""
  if [ "$(id -u)" != 0 ]; then sudo="sudo"; fi
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq dataset-fashion-mnist >/dev/null
fi
