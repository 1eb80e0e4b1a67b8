#!/usr/bin/env bash
# One call on the device machine: the test suite on CUDA, then the benchmarks on GPU and CPU.
#   benchmarks/run_device.sh [tests|bench|all]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
if [ -d .data/fashion-mnist ]; then export MPSNN_DATA=$PWD/.data; fi  # carried: no apt there
OUT=${OUT:-/tmp/mpsnn-out}
mkdir -p "$OUT"
what=${1:-all}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
if [ "$what" = tests ] || [ "$what" = all ]; then
  python -m pytest -q -p no:cacheprovider 2>&1 | tee "$OUT/pytest.log" | tail -15
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  for b in benchmarks/bench_*.py; do
    name=$(basename "$b" .py)
    python -m "benchmarks.$name" --device cuda --json "$OUT/${name}_cuda.json" 2>&1 | tee "$OUT/${name}_cuda.txt"
    timeout 240 python -m "benchmarks.$name" --device cpu --iters 3 --trials 7 --json "$OUT/${name}_cpu.json" 2>&1 | tee "$OUT/${name}_cpu.txt"
  done
fi
