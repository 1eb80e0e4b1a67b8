#!/usr/bin/env bash
# One device call for the graph and product work: the CUDA tests of the graph, capture and
# optimizer paths; `mpsnn bench` for LeNet-5 (batch 256, float32) and ResNet-18 (batch 512,
# bfloat16, 32x32x3) beside PyTorch eager and torch.compile; `mpsnn train` on Fashion-MNIST
# beside plain PyTorch; the Apple-sample port. Each part has its own time limit, so one failure
# does not cost the others; every part's output goes to $OUT/session.log, a summary comes last.
#   benchmarks/gpu_session.sh [parts]   parts: tests lenet resnet train resnetc apple (default: all)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 COLUMNS=120
if [ -d .data/fashion-mnist ]; then export MPSNN_DATA=$PWD/.data; fi  # carried: no apt there
OUT=${OUT:-/tmp/mpsnn-out}
mkdir -p "$OUT"
LOG=$OUT/session.log
: > "$OUT/summary.txt"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  git log --oneline -1 2>/dev/null
  date -u
} | tee -a "$OUT/summary.txt"

part() {  # part NAME SECONDS COMMAND...
  local name=$1 limit=$2 start rc
  shift 2
  echo "== $name: $*" | tee -a "$LOG"
  start=$(date +%s)
  timeout "$limit" "$@" >> "$LOG" 2>&1
  rc=$?
  echo "$name: exit $rc in $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.txt" "$LOG"
}

parts=${*:-tests lenet resnet train resnetc apple}
for p in $parts; do
  case $p in
    tests) part tests 90 python -m pytest -q -p no:cacheprovider tests/graph/test_graph_replay.py \
             tests/core/test_capture.py tests/core/test_foundation.py tests/ops/test_optim_ops.py \
             tests/ops/test_optim_triton.py tests/ops/test_optim_cuda_graphs.py ;;
    lenet) part lenet 120 python -m mpsnn.cli bench --model lenet --batch-size 256 \
             --dtype float32 --device cuda --steps 50 --trials 5 --json "$OUT/bench_lenet.json" ;;
    resnet) part resnet 100 python -m mpsnn.cli bench --model resnet18 --batch-size 512 \
             --dtype bfloat16 --optimizer sgd --device cuda --steps 20 --trials 3 \
             --variants mpsnn-eager,mpsnn-replay,torch-eager --json "$OUT/bench_resnet.json" ;;
    resnetc) part resnetc 150 python -m mpsnn.cli bench --model resnet18 --batch-size 512 \
             --dtype bfloat16 --optimizer sgd --device cuda --steps 20 --trials 3 \
             --variants torch-compile --json "$OUT/bench_resnet_compile.json" ;;
    train) part train 90 python -m mpsnn.cli train --device cuda --compare-torch \
             --metrics "$OUT/train.jsonl" --plot "$OUT/train.png" ;;
    apple) part apple 100 python examples/apple_mnist.py --device cuda --compile ;;
  esac
done
echo "== summary"
grep -E "passed|failed|error" "$LOG" | grep -v "^E " | tail -5
grep -E "│|┃" "$LOG" | tail -40
cat "$OUT/summary.txt"
