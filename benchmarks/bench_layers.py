"""Max-pooling gradient and dropout through mpsnn vs PyTorch, with bytes moved and the fraction
of the memory-bandwidth floor, in one run.

* max-pool gradient, 2x2 stride 2 on (B, 64, 56, 56): mpsnn ``PoolingMaxGradient`` (recomputes
  the argmax from the source, no index tensor) vs ``aten.max_pool2d_with_indices_backward``
  (reads the int64 indices the forward stored). Also the kernel alone (no encode/commit).
* dropout forward + gradient, keep 0.5 on (B, 256, 28, 28): mpsnn ``Dropout`` +
  ``DropoutGradient`` (mask regenerated from a key) vs ``native_dropout`` +
  ``native_dropout_backward`` (a byte per element kept between them). State sizes compared.

Bytes are the minimum each method must move (every tensor it reads or writes, once); the floor
is bytes / the bandwidth of a large device-to-device copy measured in the same run.

    python benchmarks/bench_layers.py --device cuda --json out.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

import mpsnn as m
from benchmarks.bench_convolution import compare

_mp_bwd = torch.ops.aten.max_pool2d_with_indices_backward.default


def copy_bandwidth(device: str, numel: int | None = None) -> float:
    """Bytes per second of a large copy (read + write) of ``numel`` float32 values (default
    2**28 on CUDA, 2**25 elsewhere)."""
    n = numel or ((1 << 28) if device.startswith("cuda") else (1 << 25))
    a = torch.empty(n, dtype=torch.float32, device=device).normal_()
    b = torch.empty_like(a)
    (t,) = compare([lambda: b.copy_(a)], device, 10, 5)
    return 2 * a.numel() * 4 / t


def _row(case: str, impl: str, t: float, nbytes: int, bw: float, **extra: float) -> dict:
    """One timed row: milliseconds, bytes moved, GB/s and the fraction of the copy floor."""
    return dict(case=case, impl=impl, ms=t * 1e3, bytes=nbytes, gbps=nbytes / t / 1e9,
                floor_fraction=nbytes / bw / t, **extra)  # fmt: skip


def bench_maxpool(
    device: str, batch: int, dtype: torch.dtype, iters: int, trials: int, bw: float
) -> list[dict]:
    dev = m.Device(device)
    q = dev.new_command_queue()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 64, 56, 56, generator=gen).to(device=device, dtype=dtype)
    g = torch.randn(batch, 64, 28, 28, generator=gen).to(device=device, dtype=dtype)
    _, idx = F.max_pool2d(x, 2, 2, return_indices=True)
    pool, grad = m.PoolingMax(dev, 2, 2, 2, 2), m.PoolingMaxGradient(dev, 2, 2, 2, 2)
    src, dsrc = m.Image.from_tensor(x), m.Image.from_tensor(g)
    state = pool.result_state(src)
    cb = q.command_buffer()
    pool.encode(cb, src, destination_state=state)
    cb.commit()
    cb.wait_until_completed()
    geom = state.forward.params.geometry  # the typed record of the forward

    def torch_bwd() -> object:
        return _mp_bwd(g, x, [2, 2], [2, 2], [0, 0], [1, 1], False, idx)

    def mps_bwd() -> object:
        cb = q.command_buffer()
        out = grad.encode(cb, dsrc, src, state)
        cb.commit()
        return out

    from mpsnn.ops.pooling import max_pool_backward

    def mps_op() -> object:
        return max_pool_backward(g, x, geom)

    tt, tm, to = compare([torch_bwd, mps_bwd, mps_op], device, iters, trials)
    s = x.element_size()
    nx, ng = x.numel(), g.numel()
    torch_bytes = ng * s + ng * 8 + nx * s  # g, int64 indices, dx
    mps_bytes = nx * s + ng * s + nx * s  # x (argmax recomputed), g, dx
    case = f"max-pool gradient {str(dtype).split('.')[1]}"
    return [
        _row(case, "torch", tt, torch_bytes, bw),
        _row(case, "mpsnn", tm, mps_bytes, bw),
        _row(case, "mpsnn op only", to, mps_bytes, bw),
        dict(case=case, impl="speed-up (torch / mpsnn)", ratio=tt / tm, ratio_op=tt / to),
    ]


def bench_dropout(
    device: str, batch: int, dtype: torch.dtype, iters: int, trials: int, bw: float
) -> list[dict]:
    dev = m.Device(device)
    q = dev.new_command_queue()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 256, 28, 28, generator=gen).to(device=device, dtype=dtype)
    g = torch.randn(batch, 256, 28, 28, generator=gen).to(device=device, dtype=dtype)
    drop, dgrad = m.Dropout(dev, 0.5, seed=1), m.DropoutGradient(dev, 0.5, seed=1)
    src, dsrc = m.Image.from_tensor(x), m.Image.from_tensor(g)
    mask_bytes = []

    def torch_step() -> object:
        y, mask = torch.native_dropout(x, 0.5, True)
        mask_bytes.append(mask.numel() * mask.element_size())
        return torch.ops.aten.native_dropout_backward(g, mask, 2.0), y

    states = []

    def mps_step() -> object:
        cb = q.command_buffer()
        st = drop.result_state(src)
        y = drop.encode(cb, src, destination_state=st)
        dx = dgrad.encode(cb, dsrc, src, st)
        cb.commit()
        states.append(st.resource_size())
        return y, dx

    tt, tm = compare([torch_step, mps_step], device, iters, trials)
    s, n = x.element_size(), x.numel()
    torch_bytes = 2 * n * s + n + 2 * n * s + n  # fwd: x, y, mask; bwd: g, mask, dx
    mps_bytes = 4 * n * s  # fwd: x, y; bwd: g, dx
    case = f"dropout fwd+grad {str(dtype).split('.')[1]}"
    ratio = dict(case=case, impl="ratio (torch / mpsnn)", ratio=tt / tm,
                 state_ratio=mask_bytes[-1] / states[-1])  # fmt: skip
    return [
        _row(case, "torch", tt, torch_bytes, bw, state_bytes=mask_bytes[-1]),
        _row(case, "mpsnn", tm, mps_bytes, bw, state_bytes=states[-1]),
        ratio,
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default=m.Device.default().type)
    p.add_argument("--batch", type=int, default=None, help="default 256 on CUDA, 8 on the CPU")
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--trials", type=int, default=7)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    device = args.device
    cuda = device.startswith("cuda")
    batch = args.batch or (256 if cuda else 8)
    iters = args.iters or (20 if cuda else 3)
    bw = copy_bandwidth(device)
    rows: list[dict] = []
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        rows += bench_maxpool(device, batch, dtype, iters, args.trials, bw)
        rows += bench_dropout(device, batch, dtype, iters, args.trials, bw)
    name = m.Device(device).name
    print(f"# {name} | torch {torch.__version__} | batch {batch} | copy {bw / 1e9:.0f} GB/s")
    print(f"{'case':28} {'impl':26} {'ms':>8} {'MB moved':>9} {'GB/s':>7} {'of floor':>8}")
    for r in rows:
        if "ms" in r:
            mb, frac = r["bytes"] / 1e6, r["floor_fraction"]
            line = f"{r['case']:28} {r['impl']:26} {r['ms']:8.3f} {mb:9.1f} "
            print(line + f"{r['gbps']:7.0f} {frac:8.2f}")
        else:
            extra = (
                f"  (op alone {r['ratio_op']:.2f}x)"
                if "ratio_op" in r
                else f"  state {r['state_ratio']:.0f}x smaller"
            )
            print(f"{r['case']:28} {r['impl']:26} {r['ratio']:8.2f}x{extra}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                dict(
                    device=m.Device(device).name,
                    torch=torch.__version__,
                    batch=batch,
                    copy_bandwidth=bw,
                    rows=rows,
                    time=time.time(),
                ),
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
