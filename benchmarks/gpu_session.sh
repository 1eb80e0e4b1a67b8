#!/usr/bin/env bash
# One device call for the graph and product work: the CUDA tests of the graph, capture and
# optimizer paths; the graph benchmarks (LeNet-5 fp32, ResNet-18 bf16) beside PyTorch eager and
# torch.compile; `mpsnn train` on Fashion-MNIST beside plain PyTorch; the Apple-sample port.
# Each part has its own time limit, so one failure does not cost the others; a summary last.
#   benchmarks/gpu_session.sh [parts]     parts: tests bench train apple (default: all)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
if [ -d .data/fashion-mnist ]; then export MPSNN_DATA=$PWD/.data; fi  # carried: no apt there
OUT=${OUT:-/tmp/mpsnn-out}
mkdir -p "$OUT"
: > "$OUT/summary.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/summary.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/summary.txt"
git log --oneline -1 2>/dev/null | tee -a "$OUT/summary.txt"

part() {  # part NAME SECONDS COMMAND...
  local name=$1 limit=$2 start rc
  shift 2
  echo "== $name"
  start=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  tail -n 30 "$OUT/$name.log"
  echo "$name: exit $rc in $(( $(date +%s) - start )) s" >> "$OUT/summary.txt"
}

parts=${*:-tests bench train apple}
for p in $parts; do
  case $p in
    tests) part tests 200 python -m pytest -q -p no:cacheprovider tests/graph tests/core \
             tests/ops/test_optim_ops.py tests/cnn/test_batch_norm.py tests/models ;;
    bench) part bench 330 python -m benchmarks.bench_graph --device cuda --json "$OUT/bench.json" ;;
    train) part train 150 python -m mpsnn.cli train --device cuda --compare-torch \
             --metrics "$OUT/train.jsonl" --plot "$OUT/train.png" ;;
    apple) part apple 150 python examples/apple_mnist.py --device cuda --compile ;;
  esac
done
echo "== summary"
cat "$OUT/summary.txt"
