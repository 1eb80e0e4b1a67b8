"""One Adam step over ResNet-18's parameters: mpsnn's multi-tensor update vs torch.optim.Adam.

The 62 parameter tensors of torchvision's resnet18 for 1000 classes (11,689,512 float32
values: convolution weights, batch-norm gamma/beta, the fully connected weight and bias), with
fixed gradients. Implementations, timed in the same run with interleaved trials:

* ``mpsnn adam_update``: `mpsnn.ops.optim.adam_update` (on CUDA one Triton launch for the
  62 tensors, hyperparameters and step read from device memory);
* ``mpsnn portable``: the same with the Triton paths off (``torch._foreach_*``; CUDA only);
* ``torch Adam foreach``: ``torch.optim.Adam(foreach=True)``;
* ``torch Adam fused``: ``torch.optim.Adam(fused=True)`` (CUDA only).

Bytes are the minimum one step moves: read w, g, m, v and write w, m, v (28 bytes a value);
the floor is bytes / the bandwidth of a large device copy measured in the same run.

    python -m benchmarks.bench_optim --device cuda --json out.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import mpsnn as m
from benchmarks.bench_convolution import compare
from benchmarks.bench_layers import copy_bandwidth
from mpsnn.ops import optim, optim_hyper
from mpsnn.ops import triton as fast_paths


def resnet18_shapes(classes: int = 1000) -> list[tuple[int, ...]]:
    """Parameter shapes of torchvision's resnet18, in ``named_parameters`` order."""
    shapes: list[tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]  # conv1, bn1
    c_in = 64
    for c in (64, 128, 256, 512):
        for block in range(2):
            down = block == 0 and c != c_in
            shapes += [(c, c_in, 3, 3), (c,), (c,), (c, c, 3, 3), (c,), (c,)]
            if down:  # downsample: 1x1 convolution with stride 2, then batch norm
                shapes += [(c, c_in, 1, 1), (c,), (c,)]
            c_in = c
    return [*shapes, (classes, 512), (classes,)]


def bench_adam(
    device: str, iters: int, trials: int, bw: float, shapes: list[tuple[int, ...]] | None = None
) -> list[dict]:
    """Rows of each implementation's step over ``shapes`` (default: ResNet-18's parameters),
    then the ratios ``torch / mpsnn``."""
    shapes = shapes or resnet18_shapes()
    gen = torch.Generator().manual_seed(0)

    def make(scale: float) -> list[torch.Tensor]:
        return [(scale * torch.randn(s, generator=gen)).to(device) for s in shapes]

    lr, betas, eps = 1e-3, (0.9, 0.999), 1e-8
    # mpsnn: values updated in place, state made once per parameter
    w = make(0.05)
    g = make(1.0)
    st = [optim_hyper.init_state(optim_hyper.UpdateRule.ADAM, x) for x in w]
    mm, vv = [s[0] for s in st], [s[1] for s in st]
    hyper = optim_hyper.make_hyper(
        device, learning_rate=lr, beta1=betas[0], beta2=betas[1], epsilon=eps
    )
    step = optim_hyper.make_step(device)
    plans = optim.UpdatePlans()  # the tables an optimizer keeps between its updates

    def mps_adam() -> object:
        optim.adam_update(w, g, w, mm, vv, None, hyper, step, plans=plans)
        return w

    w2 = [x.clone() for x in w]
    st2 = [optim_hyper.init_state(optim_hyper.UpdateRule.ADAM, x) for x in w2]
    mm2, vv2 = [s[0] for s in st2], [s[1] for s in st2]
    step2 = optim_hyper.make_step(device)

    def mps_portable() -> object:
        fast_paths.set_enabled(False)
        try:
            optim.adam_update(w2, g, w2, mm2, vv2, None, hyper, step2, plans=plans)
        finally:
            fast_paths.set_enabled(True)
        return w2

    def torch_opt(**kw: bool) -> tuple[torch.optim.Optimizer, list[torch.nn.Parameter]]:
        params = [torch.nn.Parameter(x.clone()) for x in w]
        for p, x in zip(params, g, strict=True):
            p.grad = x.clone()
        return torch.optim.Adam(params, lr=lr, betas=betas, eps=eps, **kw), params

    foreach, _ = torch_opt(foreach=True)
    fns = {"mpsnn adam_update": mps_adam, "torch Adam foreach": foreach.step}
    if device.startswith("cuda"):
        fns["mpsnn portable"] = mps_portable
        fused, _ = torch_opt(fused=True)
        fns["torch Adam fused"] = fused.step
    with torch.no_grad():
        times = dict(zip(fns, compare(list(fns.values()), device, iters, trials), strict=True))
    n = sum(x.numel() for x in w)
    nbytes = 7 * 4 * n  # read w, g, m, v; write w, m, v (float32)
    model = "resnet18" if shapes == resnet18_shapes() else "parameters"
    case = f"Adam step, {model} ({len(shapes)} tensors, {n / 1e6:.2f}M values)"
    rows = [
        dict(
            case=case,
            impl=impl,
            ms=t * 1e3,
            bytes=nbytes,
            gbps=nbytes / t / 1e9,
            floor_fraction=nbytes / bw / t,
        )
        for impl, t in times.items()
    ]
    mine = times["mpsnn adam_update"]
    for impl in ("torch Adam foreach", "torch Adam fused"):
        if impl in times:
            rows.append(dict(case=case, impl=f"ratio ({impl} / mpsnn)", ratio=times[impl] / mine))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default=m.Device.default().type)
    p.add_argument("--iters", type=int, default=None, help="default 50 on CUDA, 3 on the CPU")
    p.add_argument("--trials", type=int, default=7)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    device = args.device
    iters = args.iters or (50 if device.startswith("cuda") else 3)
    bw = copy_bandwidth(device)
    rows = bench_adam(device, iters, args.trials, bw)
    name = m.Device(device).name
    print(f"# {name} | torch {torch.__version__} | copy {bw / 1e9:.0f} GB/s | median of "
          f"{args.trials} interleaved trials x {iters} steps")  # fmt: skip
    print(f"{'impl':36} {'ms':>8} {'MB moved':>9} {'GB/s':>7} {'of floor':>8}")
    for r in rows:
        if "ms" in r:
            mb, frac = r["bytes"] / 1e6, r["floor_fraction"]
            print(f"{r['impl']:36} {r['ms']:8.3f} {mb:9.1f} {r['gbps']:7.0f} {frac:8.2f}")
        else:
            print(f"{r['impl']:36} {r['ratio']:8.2f}x")
    print(f"({rows[0]['case']})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                dict(device=name, torch=torch.__version__, copy_bandwidth=bw, iters=iters,
                     trials=args.trials, rows=rows, time=time.time()),
                f, indent=1,
            )  # fmt: skip


if __name__ == "__main__":
    main()
