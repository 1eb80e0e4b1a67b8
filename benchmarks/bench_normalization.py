"""Batch normalization + ReLU (training) through mpsnn's ops vs PyTorch eager, with bytes moved
and the fraction of the memory-bandwidth floor, in one run.

* forward, on (B, 64, 56, 56): ``bn_statistics`` + ``bn_variance`` + ``bn_forward`` with the
  ReLU fused vs ``F.relu(F.batch_norm(x, None, None, w, b, training=True))``.
* backward: ``bn_gradient_sums`` + ``bn_backward`` with the ReLU's gradient fused vs PyTorch
  autograd of the same graph (built once; only ``torch.autograd.grad(..., retain_graph=True)``
  is timed), both giving dL/dx, dL/dgamma and dL/dbeta.

Bytes are the task's minimum for a training step that keeps no tensor between forward and
backward but ``x``: forward reads ``x`` twice (statistics, normalization) and writes ``y``;
backward reads ``g`` and ``x`` twice (sums, then dx) and writes ``dx``. The floor is bytes / the
bandwidth of a large device-to-device copy measured in the same run; each row's fraction is
that floor over its time. (PyTorch's eager graph moves more: its ReLU is a separate pass each
way.) On CUDA with float16/bfloat16/float32 mpsnn runs its Triton kernels; elsewhere the
portable PyTorch path.

    python -m benchmarks.bench_normalization --device cuda --json out.json
    python -m benchmarks.bench_normalization --device cpu --batch 4
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

import mpsnn as m
from benchmarks.bench_convolution import compare
from benchmarks.bench_layers import copy_bandwidth
from mpsnn.ops.batch_norm import (
    bn_backward,
    bn_forward,
    bn_gradient_sums,
    bn_statistics,
    bn_variance,
)
from mpsnn.ops.batch_norm_params import BatchNormParams, BatchNormSums
from mpsnn.ops.neuron import NeuronParams

RELU = NeuronParams(1, 0.0, 0.0, 0.0, None)  # neuron type 1 (ReLU), slope 0
EPS = 1e-5
CHANNELS, SIZE = 64, 56


def _row(case: str, impl: str, t: float, nbytes: int, bw: float, **extra: float) -> dict:
    return dict(case=case, impl=impl, ms=t * 1e3, bytes=nbytes, gbps=nbytes / t / 1e9,
                floor_fraction=nbytes / bw / t, **extra)  # fmt: skip


def _max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference relative to the largest magnitude (a sanity check, not a test)."""
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


def bench_batch_norm(
    device: str, batch: int, dtype: torch.dtype, iters: int, trials: int, bw: float
) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    shape = (batch, CHANNELS, SIZE, SIZE)
    x = (torch.randn(shape, generator=gen) * 2 + 0.5).to(device=device, dtype=dtype)
    g = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    w = (torch.rand(CHANNELS, generator=gen) + 0.5).to(device)
    b = (torch.randn(CHANNELS, generator=gen) * 0.1).to(device)
    name = str(dtype).split(".")[1]
    s, n = x.element_size(), x.numel()

    # forward: statistics + normalization + ReLU
    def torch_fwd() -> torch.Tensor:
        return F.relu(F.batch_norm(x, None, None, w, b, training=True, eps=EPS))

    def mps_fwd() -> torch.Tensor:
        count, mean, m2 = bn_statistics(x)
        return bn_forward(x, BatchNormParams(mean, bn_variance(count, m2), w, b, EPS, RELU))

    fwd_err = _max_error(mps_fwd(), torch_fwd())
    tt_f, tm_f = compare([torch_fwd, mps_fwd], device, iters, trials)

    # backward: autograd of the eager graph vs gradient sums + dx (ReLU's gradient fused)
    xr, wr, br = (t.detach().clone().requires_grad_() for t in (x, w, b))
    y = F.relu(F.batch_norm(xr, None, None, wr, br, training=True, eps=EPS))

    def torch_bwd() -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad(y, (xr, wr, br), g, retain_graph=True)

    count, mean, m2 = bn_statistics(x)
    p = BatchNormParams(mean, bn_variance(count, m2), w, b, EPS, RELU)

    def mps_bwd() -> tuple[torch.Tensor, ...]:
        sum_gy, sum_gy_xhat = bn_gradient_sums(g, x, p)
        dx = bn_backward(g, x, p, BatchNormSums(sum_gy, sum_gy_xhat, count))
        return dx, sum_gy_xhat, sum_gy

    bwd_err = max(_max_error(a, e) for a, e in zip(mps_bwd(), torch_bwd(), strict=True))
    tt_b, tm_b = compare([torch_bwd, mps_bwd], device, iters, trials)

    fwd_bytes = 3 * n * s  # x twice, y once
    bwd_bytes = 5 * n * s  # g and x twice, dx once
    fwd, bwd = f"bn+relu forward {name}", f"bn+relu backward {name}"
    return [
        _row(fwd, "torch", tt_f, fwd_bytes, bw),
        _row(fwd, "mpsnn", tm_f, fwd_bytes, bw, max_rel_error=fwd_err),
        dict(case=fwd, impl="speed-up (torch / mpsnn)", ratio=tt_f / tm_f),
        _row(bwd, "torch", tt_b, bwd_bytes, bw),
        _row(bwd, "mpsnn", tm_b, bwd_bytes, bw, max_rel_error=bwd_err),
        dict(case=bwd, impl="speed-up (torch / mpsnn)", ratio=tt_b / tm_b),
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch", type=int, default=None, help="default 256 on CUDA, 4 on the CPU")
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--trials", type=int, default=7)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    device = args.device
    cuda = device.startswith("cuda")
    batch = args.batch or (256 if cuda else 4)
    iters = args.iters or (20 if cuda else 3)
    bw = copy_bandwidth(device)
    rows: list[dict] = []
    for name in args.dtypes.split(","):
        rows += bench_batch_norm(device, batch, getattr(torch, name), iters, args.trials, bw)
    shape = f"{batch}x{CHANNELS}x{SIZE}x{SIZE}"
    print(f"# {m.Device(device).name} | torch {torch.__version__} | {shape} | "
          f"copy {bw / 1e9:.0f} GB/s")  # fmt: skip
    print(f"{'case':28} {'impl':26} {'ms':>8} {'MB moved':>9} {'GB/s':>7} {'of floor':>8}")
    for r in rows:
        if "ms" in r:
            mb, frac = r["bytes"] / 1e6, r["floor_fraction"]
            line = f"{r['case']:28} {r['impl']:26} {r['ms']:8.3f} {mb:9.1f} "
            err = (
                f"  (max rel. diff vs torch {r['max_rel_error']:.1e})"
                if "max_rel_error" in r
                else ""
            )
            print(line + f"{r['gbps']:7.0f} {frac:8.2f}" + err)
        else:
            print(f"{r['case']:28} {r['impl']:26} {r['ratio']:8.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                dict(device=m.Device(device).name, torch=torch.__version__, shape=shape,
                     copy_bandwidth=bw, rows=rows, time=time.time()),
                f, indent=1,
            )  # fmt: skip


if __name__ == "__main__":
    main()
