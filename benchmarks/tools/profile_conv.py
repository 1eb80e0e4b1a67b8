"""Which GPU kernels one convolution gradient (and one forward-and-gradient step) runs, mpsnn
beside PyTorch (NCHW and channels-last), with each kernel's time and the host's time per call:
the tool behind the bfloat16 convolution-gradient investigation (3x3, 64->64, 56x56, batch 64
by default).

    python -m benchmarks.tools.profile_conv --dtype bfloat16 [--python]

Three times per call: "wall" (back-to-back calls, the device synchronized at the end: what
the standard table measures), "host" (one call's own duration, started on an idle device and
queue, median of many: the time the device waits for when the host is the slower side) and
"kernels" (the sum of the profiler's GPU kernel times). A call is host-bound when host > kernels.
``--python`` adds a cProfile listing of mpsnn's calls (Python functions per call, the most
expensive first). ``--ops`` times instead, back-to-back at this size and at 1xCx8x8 (where the
device work is negligible: host time alone), PyTorch's call, the operations one mpsnn gradient
runs issued directly (transposes, cuDNN, channel sums, widening, accumulation; NCHW and
channels-last operands) and ``ConvolutionGradient``'s encode and commit around them.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import mpsnn as m

_bwd = torch.ops.aten.convolution_backward.default


def _kernels(fn: Callable[[], object], iters: int = 20) -> tuple[float, list[tuple[str, float]]]:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / iters * 1e3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" and e.device_time_total > 0:
            rows.append((e.key[:90], e.device_time_total / iters / 1e3))
    rows.sort(key=lambda r: -r[1])
    return wall, rows


def _host(fn: Callable[[], object], iters: int = 100) -> float:
    """Median ms of one call's own duration, each started on an idle device."""
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e3


def _python(name: str, fn: Callable[[], object], iters: int = 200) -> None:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof)
    print(f"== {name}: {stats.total_calls / iters:.0f} Python calls per call")  # type: ignore[attr-defined]
    stats.sort_stats("tottime").print_stats(18)


def _back_to_back(fn: Callable[[], object], iters: int = 300, runs: int = 5) -> tuple[float, float]:
    """(minimum, median) µs per call over ``runs`` runs of ``iters`` back-to-back calls."""
    for _ in range(20):
        fn()
    times = []
    for _ in range(runs):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / iters * 1e6)
    return min(times), statistics.median(times)


def _torch_gradient(gy: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> object:
    """PyTorch's 3x3 (padding 1) convolution gradient: data, weights and bias."""
    return _bwd(gy, x, w, [w.shape[0]], [1, 1], [1, 1], [1, 1], False, [0, 0], 1,
                [True, True, True])  # fmt: skip


def _encode(
    q: m.CommandQueue,
    conv: m.Convolution,
    grad: m.ConvolutionGradient,
    states: list[object] | None,
) -> Callable[[m.ImageBatch, m.ImageBatch], Callable[[], object]]:
    """``(gradients, sources) -> call``: one `ConvolutionGradient` encode and commit per call,
    into ``states`` (None: a new state from a forward encoded in the same buffer)."""

    def of(dy: m.ImageBatch, xs: m.ImageBatch) -> Callable[[], object]:
        def run() -> object:
            cb = q.command_buffer()
            st = states
            if st is None:
                st = conv.result_state_batch(xs)
                conv.encode_batch(cb, xs, destination_states=st)
            out = grad.encode_batch(cb, dy, xs, st)
            cb.commit()
            return out

        return run

    return of


def _forward_states(q: m.CommandQueue, conv: m.Convolution, src: m.ImageBatch) -> list[object]:
    """The gradient states of one forward of ``src``, run to completion."""
    states = conv.result_state_batch(src)
    cb = q.command_buffer()
    conv.encode_batch(cb, src, destination_states=states)
    cb.commit()
    cb.wait_until_completed()
    return states


def _ops(n: int, c: int, hw: int, dt: torch.dtype) -> dict[str, Callable[[], object]]:
    """PyTorch's gradient call, mpsnn's operations for one gradient issued directly, and
    mpsnn's encode, for a 3x3 convolution of (n, c, hw, hw) images."""
    from mpsnn.ops.triton.batch_norm_nhwc import nhwc_channel_sums
    from mpsnn.ops.triton.layout import channels_last_copy

    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, c, hw, hw, generator=g).cuda().to(dt)
    gy = torch.randn(n, c, hw, hw, generator=g).cuda().to(dt)
    w = (torch.randn(c, c, 3, 3, generator=g) * 0.05).cuda().to(dt)
    cl = torch.channels_last
    xcl, gycl, wcl = (t.contiguous(memory_format=cl) for t in (x, gy, w))
    acc_w, acc_b = torch.zeros(c, c, 3, 3, device="cuda"), torch.zeros(c, device="cuda")
    one, pad = [1, 1], [1, 1]

    def ops(gi: torch.Tensor, xi: torch.Tensor) -> Callable[[], object]:
        def run() -> object:
            gt, xt = channels_last_copy(gi), channels_last_copy(xi)
            dx, dw, _ = _bwd(gt, xt, wcl, None, one, pad, one, False, [0, 0], 1,
                             [True, True, False])  # fmt: skip
            db = nhwc_channel_sums(gt)
            wide = dw.to(torch.float32, memory_format=torch.contiguous_format)
            torch._foreach_add_([acc_w, acc_b], [wide, db])
            return dx

        return run

    dev = m.Device("cuda")
    q = dev.new_command_queue()
    desc = m.ConvolutionDescriptor(3, 3, c, c)
    ds = m.TensorConvolutionDataSource(desc, w.float().cpu().permute(0, 2, 3, 1), torch.zeros(c))
    conv, grad = m.Convolution(dev, ds), m.ConvolutionGradient(dev, ds)

    def encode(gi: torch.Tensor, xi: torch.Tensor) -> Callable[[], object]:
        src, dsrc = m.ImageBatch.from_tensor(xi), m.ImageBatch.from_tensor(gi)
        return _encode(q, conv, grad, _forward_states(q, conv, src))(dsrc, src)

    return {
        "PyTorch's call, NCHW": lambda: _torch_gradient(gy, x, w),
        "mpsnn's operations, NCHW": ops(gy, x),
        "mpsnn's operations, channels-last": ops(gycl, xcl),
        "mpsnn's encode + commit, NCHW": encode(gy, x),
        "mpsnn's encode + commit, channels-last": encode(gycl, xcl),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--channels", type=int, default=64)
    p.add_argument("--size", type=int, default=56)
    p.add_argument("--python", action="store_true", help="cProfile mpsnn's calls")
    p.add_argument("--ops", action="store_true", help="time the operations of one gradient")
    a = p.parse_args()
    dt = getattr(torch, a.dtype)
    n, c, hw = a.batch, a.channels, a.size
    if a.ops:
        small, full = _ops(1, c, 8, dt), _ops(n, c, hw, dt)
        head = f"{'sequence (µs per call: min / median)':<42}{f'1x{c}x8x8':>16}"
        print(head + f"{f'{n}x{c}x{hw}x{hw}':>18}")
        for name in full:
            s_min, s_med = _back_to_back(small[name])
            f_min, f_med = _back_to_back(full[name])
            print(f"{name:<42}{s_min:>8.0f} / {s_med:<5.0f}{f_min:>10.0f} / {f_med:<5.0f}")
        return
    dev = m.Device("cuda")
    q = dev.new_command_queue()
    g = torch.Generator().manual_seed(0)
    desc = m.ConvolutionDescriptor(3, 3, c, c)
    oihw = torch.randn(c, c, 3, 3, generator=g) * 0.05
    ds = m.TensorConvolutionDataSource(desc, oihw.permute(0, 2, 3, 1), torch.zeros(c))
    conv, grad = m.Convolution(dev, ds), m.ConvolutionGradient(dev, ds)
    x = torch.randn(n, c, hw, hw, generator=g).cuda().to(dt)
    gy = torch.randn(n, c, hw, hw, generator=g).cuda().to(dt)
    w = oihw.cuda().to(dt)
    xcl, gycl = (t.contiguous(memory_format=torch.channels_last) for t in (x, gy))
    wcl = w.contiguous(memory_format=torch.channels_last)
    src, dsrc = m.ImageBatch.from_tensor(x), m.ImageBatch.from_tensor(gy)
    srccl, dsrccl = m.ImageBatch.from_tensor(xcl), m.ImageBatch.from_tensor(gycl)
    mps = _encode(q, conv, grad, _forward_states(q, conv, src))
    mps_step = _encode(q, conv, grad, None)

    def torch_step(xt: torch.Tensor, gt: torch.Tensor, wt: torch.Tensor) -> Callable[[], object]:
        def run() -> object:
            F.conv2d(xt, wt, None, padding=1)
            return _torch_gradient(gt, xt, wt)

        return run

    cases = {
        "torch NCHW": lambda: _torch_gradient(gy, x, w),
        "torch channels-last": lambda: _torch_gradient(gycl, xcl, wcl),
        "mpsnn NCHW images": mps(dsrc, src),
        "mpsnn channels-last images": mps(dsrccl, srccl),
        "torch step NCHW": torch_step(x, gy, w),
        "mpsnn step NCHW images": mps_step(dsrc, src),
        "torch step channels-last": torch_step(xcl, gycl, wcl),
        "mpsnn step channels-last images": mps_step(dsrccl, srccl),
    }
    summary = []
    for name, fn in cases.items():
        wall, rows = _kernels(fn)
        host = _host(fn)
        print(f"== {name}: {wall:.3f} ms/call (wall), {host:.3f} ms host, kernels:")
        for k, ms in rows[:8]:
            print(f"   {ms:8.3f} ms  {k}")
        summary.append((name, wall, host, sum(ms for _, ms in rows)))
        if a.python and name.startswith("mpsnn"):
            _python(name, fn)
    print(f"{'case':<34}{'wall ms':>10}{'host ms':>10}{'kernel ms':>11}")
    for name, wall, host, kms in summary:
        print(f"{name:<34}{wall:>10.3f}{host:>10.3f}{kms:>11.3f}")


if __name__ == "__main__":
    main()
