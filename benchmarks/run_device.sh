#!/usr/bin/env bash
# One call on the device machine: the test suite on CUDA, or the benchmarks on GPU (and CPU).
#   benchmarks/run_device.sh tests            the whole suite on CUDA
#   benchmarks/run_device.sh bench [names]    benchmarks (default: every benchmarks/bench_*.py)
# With a tree of an earlier version in .before/ (carried), the benchmarks that existed there
# also run against it in the same call ("before" rows), for before/after comparisons.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
if [ -d .data/fashion-mnist ]; then export MPSNN_DATA=$PWD/.data; fi  # carried: no apt there
OUT=${OUT:-/tmp/mpsnn-out}
mkdir -p "$OUT"
what=${1:-tests}
shift || true
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
git log --oneline -1 2>/dev/null || true
if [ "$what" = tests ]; then
  python -m pytest -q -p no:cacheprovider "$@" 2>&1 | tee "$OUT/pytest.log" | tail -25
  exit 0
fi
names=${*:-$(ls benchmarks/bench_*.py | xargs -n1 basename | sed 's/\.py$//')}
for name in $names; do
  if [ -f ".before/benchmarks/$name.py" ]; then
    echo "== $name (before)"
    (cd .before && PYTHONPATH=$PWD python -m "benchmarks.$name" --device cuda --json "$OUT/${name}_before.json") 2>&1 | tail -30
  fi
  echo "== $name"
  python -m "benchmarks.$name" --device cuda --json "$OUT/${name}_cuda.json" 2>&1 | tail -40
done
