"""Convolution through mpsnn vs the same work done directly in PyTorch, in one run.

Cases (per device and storage format):

* ``forward``: ``Convolution.encode`` + commit vs ``F.conv2d`` (3x3, SAME padding).
* ``gradient``: ``ConvolutionGradient.encode`` (data, weights, bias) + commit vs
  ``aten.convolution_backward`` with the same outputs.
* ``step``: forward and gradient in one command buffer vs conv2d + convolution_backward.
* ``step clamp+offset``: the same step with CLAMP edges, an offset and a clip rect (no
  PyTorch equivalent; compared with mpsnn's own standard step).
* ``encode overhead``: a tiny convolution (1x4x8x8): encode + commit (+ wait) minus the
  direct ``F.conv2d``; on CUDA the host time of encode + commit.

Timing: wall clock around ``iters`` back-to-back iterations, device synchronized at the end,
median of ``trials``; one command buffer per iteration, as a training loop would use.

    python benchmarks/bench_convolution.py --device cuda --json out.json
    python benchmarks/bench_convolution.py --device cpu --batch 8
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import mpsnn as m
from mpsnn.core.precision import describe as describe_precision

_conv_backward = torch.ops.aten.convolution_backward.default


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timeit(
    fn: Callable[[], object], device: str, iters: int, trials: int, warmup: int = 3
) -> float:
    """Median seconds per call over ``trials`` runs of ``iters`` calls."""
    return compare([fn], device, iters, trials, warmup)[0]


def compare(
    fns: list[Callable[[], object]], device: str, iters: int, trials: int, warmup: int = 3
) -> list[float]:
    """Median seconds per call of each function; trials alternate between the functions so
    that drift (clocks, thermal state, other load) affects them alike."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    sync(device)
    runs: list[list[float]] = [[] for _ in fns]
    for _ in range(trials):
        for fn, out in zip(fns, runs, strict=True):
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            sync(device)
            out.append((time.perf_counter() - t0) / iters)
    return [statistics.median(r) for r in runs]


def bench_standard(
    device: str,
    dtype: torch.dtype,
    n: int,
    c: int,
    hw: int,
    iters: int,
    trials: int,
    clamp_offset: bool = True,
    channels_last: bool = False,
) -> list[dict]:
    """Rows of forward, gradient and step (mpsnn vs PyTorch; ``ratio`` = mpsnn / torch), then,
    with ``clamp_offset``, the clamp+offset step against mpsnn's standard one.
    ``channels_last``: both sides get their images and weights channels-last (the layout mpsnn
    stores float16/bfloat16 images in on CUDA, as in a graph step) instead of NCHW (which
    mpsnn converts at each call)."""
    dev = m.Device(device)
    q = dev.new_command_queue()
    gen = torch.Generator().manual_seed(0)
    desc = m.ConvolutionDescriptor(3, 3, c, c)
    ds = m.TensorConvolutionDataSource(
        desc, torch.randn(desc.weights_shape, generator=gen) * 0.05, torch.randn(c, generator=gen)
    )
    conv, grad = m.Convolution(dev, ds), m.ConvolutionGradient(dev, ds)
    x = torch.randn(n, c, hw, hw, generator=gen).to(device=device, dtype=dtype)
    gy = torch.randn(n, c, hw, hw, generator=gen).to(device=device, dtype=dtype)
    w = ds.weights().permute(0, 3, 1, 2).contiguous().to(device=device, dtype=dtype)
    b = ds.bias_terms().to(device=device, dtype=dtype)
    if channels_last:
        x, gy, w = (t.contiguous(memory_format=torch.channels_last) for t in (x, gy, w))
    src, dsrc = m.ImageBatch.from_tensor(x), m.ImageBatch.from_tensor(gy)

    def torch_fwd() -> object:
        return F.conv2d(x, w, b, padding=1)

    def torch_bwd() -> object:
        return _conv_backward(
            gy, x, w, [c], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, True, True]
        )

    def torch_step() -> object:
        F.conv2d(x, w, b, padding=1)
        return _conv_backward(
            gy, x, w, [c], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, True, True]
        )

    def mps_fwd() -> object:
        cb = q.command_buffer()
        out = conv.encode_batch(cb, src)
        cb.commit()
        return out

    states = conv.result_state_batch(src)
    cb0 = q.command_buffer()
    conv.encode_batch(cb0, src, destination_states=states)
    cb0.commit()
    cb0.wait_until_completed()

    def mps_bwd() -> object:
        cb = q.command_buffer()
        out = grad.encode_batch(cb, dsrc, src, states)  # accumulates into the shared state
        cb.commit()
        return out

    def mps_step(kernel: m.Convolution = conv) -> object:
        cb = q.command_buffer()
        st = kernel.result_state_batch(src)
        kernel.encode_batch(cb, src, destination_states=st)
        out = grad.encode_batch(cb, dsrc, src, st)
        cb.commit()
        return out

    odd = m.Convolution(dev, ds)  # non-standard geometry: clamp edges, offset, clip rect
    odd.edge_mode = m.EdgeMode.CLAMP
    odd.offset = m.Offset(2, 1, 0)
    odd.clip_rect = m.Region.make(0, 0, hw, hw)
    odd_dst = m.ImageBatch.from_tensor(torch.zeros(n, c, hw, hw, device=device, dtype=dtype))

    def mps_step_odd() -> object:
        cb = q.command_buffer()
        st = odd.result_state_batch(src)
        odd.encode_batch(cb, src, odd_dst, destination_states=st)
        out = grad.encode_batch(cb, m.ImageBatch.from_tensor(gy), src, st)
        cb.commit()
        return out

    flops = 2 * n * c * c * 9 * hw * hw
    rows = []
    for name, t_fn, m_fn, work in (
        ("forward", torch_fwd, mps_fwd, flops),
        ("gradient", torch_bwd, mps_bwd, 2 * flops),
        ("step", torch_step, mps_step, 3 * flops),
    ):
        tt, tm = compare([t_fn, m_fn], device, iters, trials)
        rows.append(
            dict(
                device=device,
                dtype=str(dtype).split(".")[1],
                case=name,
                layout="channels_last" if channels_last else "nchw",
                torch_ms=tt * 1e3,
                mpsnn_ms=tm * 1e3,
                ratio=tm / tt,
                tflops=work / tm / 1e12,
            )
        )
    if not clamp_offset:
        return rows
    std, to = compare([mps_step, mps_step_odd], device, iters, trials)
    std_ms = std * 1e3
    rows.append(
        dict(
            device=device, dtype=str(dtype).split(".")[1], case="step clamp+offset",
            torch_ms=float("nan"), mpsnn_ms=to * 1e3, ratio=to * 1e3 / std_ms,
            tflops=3 * flops / to / 1e12, vs="mpsnn standard step",
        )
    )  # fmt: skip
    return rows


def bench_overhead(device: str, iters: int, trials: int) -> dict:
    dev = m.Device(device)
    q = dev.new_command_queue()
    desc = m.ConvolutionDescriptor(3, 3, 4, 4)
    ds = m.TensorConvolutionDataSource(desc, torch.randn(desc.weights_shape), torch.randn(4))
    conv = m.Convolution(dev, ds)
    x = torch.randn(1, 4, 8, 8, device=device)
    src = m.Image.from_tensor(x)
    w = ds.weights().permute(0, 3, 1, 2).contiguous().to(device)
    b = ds.bias_terms().to(device)

    def direct() -> object:
        return F.conv2d(x, w, b, padding=1)

    def mps() -> object:
        cb = q.command_buffer()
        out = conv.encode(cb, src)
        cb.commit()
        if device == "cpu":
            cb.wait_until_completed()
        return out

    def encode_only() -> object:
        return conv.encode(q.command_buffer(), src)

    td, tm, te = compare([direct, mps, encode_only], device, iters, trials)
    return dict(
        device=device,
        case="encode overhead (tiny conv)",
        torch_us=td * 1e6,
        mpsnn_us=tm * 1e6,
        overhead_us=(tm - td) * 1e6,
        encode_only_us=te * 1e6,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default=m.Device.default().type)
    p.add_argument("--batch", type=int, default=None, help="default 64 on CUDA, 16 on the CPU")
    p.add_argument("--channels", type=int, default=64)
    p.add_argument("--size", type=int, default=56)
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--trials", type=int, default=7)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--json", default=None)
    p.add_argument("--channels-last", action="store_true",
                   help="images and weights channels-last on both sides")  # fmt: skip
    args = p.parse_args()
    device = args.device
    iters = args.iters or (50 if device.startswith("cuda") else 3)
    args.batch = args.batch or (64 if device.startswith("cuda") else 16)
    info = dict(
        device=m.Device(device).name,
        torch=torch.__version__,
        mpsnn=m.__version__,
        cpu=platform.processor() or platform.machine(),
        threads=torch.get_num_threads(),
        # float32: mpsnn's switch decides mpsnn's side, PyTorch's flags the torch side
        precision=describe_precision(),
        config=f"3x3 {args.channels}->{args.channels}, {args.size}x{args.size}, batch {args.batch}",
    )
    rows = []
    for name in args.dtypes.split(","):
        rows += bench_standard(
            device, getattr(torch, name), args.batch, args.channels, args.size, iters, args.trials,
            channels_last=args.channels_last,
        )  # fmt: skip
    over = bench_overhead(device, 2000 if device == "cpu" else 500, 15)
    print(
        f"# {info['device']} | torch {info['torch']} | {info['config']} | threads {info['threads']}"
    )
    print("# float32 precision: " + ", ".join(f"{k}={v}" for k, v in info["precision"].items()))
    print(f"{'dtype':9} {'case':20} {'torch ms':>10} {'mpsnn ms':>10} {'ratio':>7} {'TFLOP/s':>8}")
    for r in rows:
        print(
            f"{r['dtype']:9} {r['case']:20} {r['torch_ms']:10.3f} {r['mpsnn_ms']:10.3f} "
            f"{r['ratio']:7.3f} {r['tflops']:8.2f}"
        )
    print(
        f"encode+commit overhead, tiny conv: torch {over['torch_us']:.1f} us, "
        f"mpsnn {over['mpsnn_us']:.1f} us, overhead {over['overhead_us']:.1f} us "
        f"(encode alone {over['encode_only_us']:.1f} us)"
    )
    print("(ratio = mpsnn / torch; for 'step clamp+offset': mpsnn / mpsnn's standard step)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(info=info, rows=rows, overhead=over), f, indent=1)


if __name__ == "__main__":
    main()
