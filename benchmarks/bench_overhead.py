"""Host time of one tiny convolution: mpsnn encode + commit + wait against ``F.conv2d`` (+ a
device synchronization on CUDA), in one run. The work is tiny (1x4x8x8, 3x3), so the numbers
are the per-command-buffer cost a training loop pays on the host.

    python -m benchmarks.bench_overhead --device cuda --json out.json

Uses only APIs every mpsnn version has, so the same script measures an older tree too
(``PYTHONPATH=<old tree> python benchmarks/bench_overhead.py``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

import mpsnn as m


def precision_info() -> dict:
    """Which float32 arithmetic each side ran: mpsnn's switch (TF32 only under "high" or
    "medium") and PyTorch's flags; an older tree's mpsnn ran under PyTorch's flags."""
    try:
        from mpsnn.core.precision import describe
    except ImportError:
        return {
            "mpsnn_float32_matmul_precision": None,
            "torch_cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
            "torch_matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        }
    return describe()


def _per_call_us(fn, device: str, iters: int, trials: int) -> float:
    for _ in range(50):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    runs = []
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        runs.append((time.perf_counter() - t0) / iters * 1e6)
    return statistics.median(runs)


def measure(device: str, iters: int, trials: int) -> dict:
    dev = m.Device(device)
    q = dev.new_command_queue()
    desc = m.ConvolutionDescriptor(3, 3, 4, 4)
    ds = m.TensorConvolutionDataSource(desc, torch.randn(desc.weights_shape), torch.randn(4))
    conv = m.Convolution(dev, ds)
    x = torch.randn(1, 4, 8, 8, device=device)
    src = m.Image.from_tensor(x)
    w = ds.weights().permute(0, 3, 1, 2).contiguous().to(device)
    b = ds.bias_terms().to(device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def direct() -> None:
        F.conv2d(x, w, b, padding=1)
        sync()

    def mps() -> None:
        cb = q.command_buffer()
        conv.encode(cb, src)
        cb.commit()
        cb.wait_until_completed()

    def encode_only() -> None:
        conv.encode(q.command_buffer(), src)

    # interleave the trials so drift affects both alike
    td, tm, te = [], [], []
    for _ in range(trials):
        td.append(_per_call_us(direct, device, iters, 1))
        tm.append(_per_call_us(mps, device, iters, 1))
        te.append(_per_call_us(encode_only, device, iters, 1))
    d, mm, e = statistics.median(td), statistics.median(tm), statistics.median(te)
    return dict(
        device=dev.name, torch=torch.__version__, mpsnn=getattr(m, "__version__", "?"),
        f_conv2d_us=d, mpsnn_us=mm, encode_only_us=e, ratio=mm / d,
    )  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--iters", type=int, default=1000)
    p.add_argument("--trials", type=int, default=9)
    p.add_argument("--label", default="")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    r = measure(a.device, a.iters, a.trials)
    r["label"] = a.label
    r["precision"] = precision_info()
    print("# float32 precision: " + ", ".join(f"{k}={v}" for k, v in r["precision"].items()))
    print(
        f"{a.label:8s} {r['device']}: F.conv2d{' + sync' if a.device == 'cuda' else ''} "
        f"{r['f_conv2d_us']:.1f} us | mpsnn encode+commit+wait {r['mpsnn_us']:.1f} us "
        f"(encode alone {r['encode_only_us']:.1f} us) | ratio {r['ratio']:.2f}"
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
