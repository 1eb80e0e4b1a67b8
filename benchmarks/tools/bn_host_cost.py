"""The host cost of the batch-normalization ops, per call: each op alone and the forward the
standard table times (``bn_statistics`` + ``bn_variance`` + ``bn_forward``), on a tiny tensor
(the GPU has nothing to do: the time is the host's) and at the table's size.

    python -m benchmarks.tools.bn_host_cost                 # CUDA
    python -m benchmarks.tools.bn_host_cost --device cpu    # a smoke run

Each figure: ``--calls`` calls after a warm-up, the device synchronized at the end, best of
``--trials``, in microseconds per call. A tiny PyTorch operation (``x.add_(0)``) is timed the
same way for scale.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from benchmarks.bench_normalization import EPS, RELU
from mpsnn.ops.batch_norm import (
    bn_backward,
    bn_forward,
    bn_gradient_sums,
    bn_statistics,
    bn_variance,
)
from mpsnn.ops.batch_norm_params import BatchNormParams, BatchNormSums


def per_call_us(fn: Callable[[], object], calls: int, trials: int, device: str) -> float:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(20):
        fn()
    sync()
    best = float("inf")
    for _ in range(trials):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t) / calls)
    return best * 1e6


def rows(shape: tuple[int, ...], dtype: torch.dtype, dev: str) -> list[tuple[str, Callable]]:
    """The timed calls for one shape and dtype: ``(name, call)``."""
    x = torch.randn(shape, device=dev).to(dtype)
    g = torch.randn(shape, device=dev).to(dtype)
    w = torch.rand(shape[1], device=dev) + 0.5
    b = torch.randn(shape[1], device=dev)
    count, mean, m2 = bn_statistics(x)
    p = BatchNormParams(mean, bn_variance(count, m2), w, b, EPS, RELU)
    sums = BatchNormSums(*bn_gradient_sums(g, x, p), count)

    def forward() -> object:
        c, mu, q = bn_statistics(x)
        return bn_forward(x, BatchNormParams(mu, bn_variance(c, q), w, b, EPS, RELU))

    return [
        ("x.add_(0) (for scale)", lambda: x.add_(0)),
        ("bn_statistics", lambda: bn_statistics(x)),
        ("bn_variance", lambda: bn_variance(count, m2)),
        ("bn_forward", lambda: bn_forward(x, p)),
        ("bn_gradient_sums", lambda: bn_gradient_sums(g, x, p)),
        ("bn_backward", lambda: bn_backward(g, x, p, sums)),
        ("statistics + variance + forward", forward),
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--trials", type=int, default=5)
    args = parser.parse_args()
    dev = args.device
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    print(f"# {name}, torch {torch.__version__}")
    print(f"{'shape':22s} {'dtype':9s} {'op':38s} {'us/call':>8s}")
    for shape in ((2, 64, 8, 8), (256, 64, 56, 56)):
        if dev == "cpu" and shape[0] > 2:
            continue
        for dtype in (torch.float32, torch.bfloat16):
            for op, fn in rows(shape, dtype, dev):
                us = per_call_us(fn, args.calls, args.trials, dev)
                print(f"{shape!s:22s} {str(dtype)[6:]:9s} {op:38s} {us:8.1f}")


if __name__ == "__main__":
    main()
