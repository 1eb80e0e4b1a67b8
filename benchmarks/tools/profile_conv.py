"""Kernel-level breakdown (torch.profiler) of the convolution benchmark's cases on CUDA.

python benchmarks/tools/profile_conv.py
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

import mpsnn as m

_bwd = torch.ops.aten.convolution_backward.default


def main() -> None:
    dev = m.Device("cuda")
    q = dev.new_command_queue()
    n, c, hw, dt = 64, 64, 56, torch.bfloat16
    desc = m.ConvolutionDescriptor(3, 3, c, c)
    ds = m.TensorConvolutionDataSource(desc, torch.randn(desc.weights_shape) * 0.05, torch.randn(c))
    conv, grad = m.Convolution(dev, ds), m.ConvolutionGradient(dev, ds)
    x = torch.randn(n, c, hw, hw, device="cuda", dtype=dt)
    gy = torch.randn(n, c, hw, hw, device="cuda", dtype=dt)
    w = ds.weights().permute(0, 3, 1, 2).contiguous().cuda().to(dt)
    src, dsrc = m.ImageBatch.from_tensor(x), m.ImageBatch.from_tensor(gy)
    odd = m.Convolution(dev, ds)
    odd.edge_mode = m.EdgeMode.CLAMP
    odd.offset = m.Offset(2, 1, 0)

    def torch_grad():
        _bwd(gy, x, w, [c], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, True, True])

    st = conv.result_state_batch(src)
    cb = q.command_buffer()
    conv.encode_batch(cb, src, destination_states=st)
    cb.commit()

    def mps_grad():
        cb = q.command_buffer()
        grad.encode_batch(cb, dsrc, src, st)
        cb.commit()

    def mps_odd_step():
        cb = q.command_buffer()
        s = odd.result_state_batch(src)
        odd.encode_batch(cb, src, destination_states=s)
        grad.encode_batch(cb, dsrc, src, s)
        cb.commit()

    for name, fn in (
        ("torch gradient", torch_grad),
        ("mpsnn gradient", mps_grad),
        ("mpsnn clamp+offset step", mps_odd_step),
    ):
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
        print(f"== {name} (20 iterations)")
        print(
            prof.key_averages().table(
                sort_by="cuda_time_total", row_limit=12, max_name_column_width=60
            )
        )


if __name__ == "__main__":
    main()
