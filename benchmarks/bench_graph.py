"""The graph benchmarks of the device runs, through ``mpsnn bench``'s measurement (one
mechanism): a LeNet-5 training step at batch 256 float32 (forward, loss, backward, Adam) and a
CIFAR-style ResNet-18 step at batch 512 bfloat16 on 32×32×3 synthetic images, each as an mpsnn
graph encoded eagerly and replayed, beside PyTorch eager and ``torch.compile``; step time, peak
memory and the host time of one eager ``encode_batch``. Then the eager step against PyTorch
eager once more, in alternating runs in one process (``--pairs``, see
`benchmarks.bench_eager_pairs`): the ratio per pair, robust to a host whose speed drifts.

    python -m benchmarks.bench_graph --device cuda --json out.json
    python -m benchmarks.bench_graph --device cuda --only lenet
"""

from __future__ import annotations

import argparse
import json

from benchmarks import bench_eager_pairs
from mpsnn.cli.bench import measure
from mpsnn.core.precision import describe as describe_precision

CASES = {
    "lenet": {"model": "lenet", "batch": 256, "dtype": "float32", "optimizer": "adam"},
    "resnet18": {
        "model": "resnet18",
        "batch": 512,
        "dtype": "bfloat16",
        "optimizer": "sgd",
        "input_shape": (3, 32, 32),
    },
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--only", default=",".join(CASES), help="comma-separated cases")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--compile-modes", default="default")
    parser.add_argument("--pairs", type=int, default=11, help="alternating eager pairs (0: none)")
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--float32-precision",
        default="highest",
        choices=("highest", "high"),
        help="mpsnn.set_float32_matmul_precision for mpsnn's float32 work (high: TF32 allowed, "
        "as PyTorch's cuDNN convolutions use by default)",
    )
    args = parser.parse_args()
    import mpsnn

    mpsnn.set_float32_matmul_precision(args.float32_precision)
    if args.device == "cpu":
        args.steps, args.trials = min(args.steps, 5), min(args.trials, 3)
    modes = tuple(m for m in args.compile_modes.split(",") if m)
    results = []
    for name in args.only.split(","):
        case = CASES[name]
        out = measure(device=args.device, steps=args.steps, trials=args.trials,
                      compile_modes=modes, **case)  # fmt: skip
        out["precision"] = describe_precision()
        results.append(out)
        print(f"# {name}: batch {out['batch']} {out['dtype']} {out['optimizer']}, "
              f"{out['device']}, torch {out['torch']}")  # fmt: skip
        print("# float32 precision: " + ", ".join(f"{k}={v}" for k, v in out["precision"].items()))
        ref = next(r["ms"] for r in out["rows"] if r["variant"] == "pytorch eager")
        print(f"{'variant':<28}{'ms/step':>10}{'vs eager':>10}{'peak MiB':>10}{'loss':>9}")
        for r in out["rows"]:
            peak = "" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}"
            print(f"{r['variant']:<28}{r['ms']:>10.3f}{ref / r['ms']:>9.2f}x{peak:>10}"
                  f"{r['loss']:>9.4f}")  # fmt: skip
        if "host_encode_ms" in out:
            print(f"host encode_batch {out['host_encode_ms']:.3f} ms; {out['memory_plan']}")
        if args.pairs > 0:
            pairs = bench_eager_pairs.measure(name, args.device, args.pairs, args.steps)
            out["interleaved_eager"] = pairs
            r = sorted(pairs["ratios"])
            print(f"eager vs PyTorch eager, {len(r)} alternating pairs of {args.steps} steps: "
                  f"median {pairs['median_ratio']:.2f}x, range {r[0]:.2f}-{r[-1]:.2f}x, "
                  f"{sum(v < 1 for v in r)} below 1")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
