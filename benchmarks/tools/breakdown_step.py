"""Where one replayed training step's GPU time goes, operation by operation, against each
operation's floor (the least time the work could take on this GPU).

    python -m benchmarks.tools.breakdown_step --batch 512 --dtype bfloat16 --json out.json

CUDA: the model's training graph (as ``benchmarks.tools.twin.mpsnn_graph_step`` builds it, SGD)
is compiled (``graph.compile``) and called 3 times to warm up (eager, recorded, replayed);
3 replays give the peak memory (``max_memory_allocated`` above what was allocated before
them), 3 × 10 replays the step time (CUDA events, median), then 5 replays are profiled
(``torch.profiler``, CUDA activity). Every kernel is put in a category by its name
(`classify`); per category: ms per step, % of the step's kernel time, launches per step.

Floors are lower bounds, from the graph's plan and the image shapes of one eager step:

* convolutions and the fully connected layer: ``2·N·Ho·Wo·Cout·(Cin/groups)·kh·kw`` FLOPs for
  the forward pass, as many for the data gradient (skipped for the first layer when the plan
  says so) and the weight gradient, over ``--peak-tflops`` (dense tensor-core peak);
* memory-bound operations: the bytes each must read and write at least (``E`` = elements of
  the activation, in the storage dtype), over the copy bandwidth measured in the same run
  (a 1 GiB device-to-device copy; read + write bytes over its time). Batch normalization:
  statistics read ``E``; forward (and each recomputation of a freed result) reads and writes
  ``E``; gradient sums read the gradient and the input (``2E``); backward reads both and writes
  the data gradient (``3E``). Elementwise (additions, unfused neurons, ReLU gradients: all the
  elementwise kernels, mpsnn's and PyTorch's, as one group): each reads its sources and writes
  its result once; a gradient passed on (an addition's gradient) moves nothing. Optimizer (SGD
  with momentum, float32 master weights): per parameter, read and write weight and momentum
  (16 B), read the gradient and, below float32, write the weight copy (storage dtype each).
  Layout conversions, reductions, copies and the loss have no floor.

``--device cpu``: a smoke run without the profiler: two eager steps of a small batch, then the
FLOP counts, the byte estimates and the floors (the bandwidth is a CPU copy's).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from benchmarks.tools.breakdown_categories import (
    BN_BWD,
    BN_FWD,
    BN_STATS,
    BN_SUMS,
    CATEGORIES,
    GROUPS,
    OPTIMIZER,
    POOLING,
    Conv,
    Floor,
    Workload,
    classify,
    conv_flops,
    floors,
    total_floor,
)

# -- the work of one step, from the plan ----------------------------------------------------


def record_shapes(graph: Any, step: Callable[[], Any]) -> dict[int, tuple[int, int, int, int]]:
    """Run ``step`` (the graph's first encode: later ones may run its step program and
    allocate nothing) and return the ``(n, c, h, w)`` of every image the graph allocated, by
    allocation node id."""
    shapes: dict[int, tuple[int, int, int, int]] = {}
    allocate = graph._allocate

    def recording(cb: Any, node: Any, desc: Any) -> Any:
        shapes[node._id] = tuple(desc.shape)
        return allocate(cb, node, desc)

    graph._allocate = recording  # an instance attribute: removed below
    try:
        step()
    finally:
        del graph._allocate
    return shapes


def workload(
    graph: Any,
    shapes: dict[int, tuple[int, int, int, int]],
    source_shape: tuple[int, int, int, int],
    storage_bytes: int,
) -> Workload:
    """The convolutions and byte estimates of ``graph``'s step (see the module docstring),
    from its plan and the shapes `record_shapes` found (``source_shape``: the input's)."""
    from mpsnn.graph.plan import _Fused, _PassGradient
    from mpsnn.nodes import (
        BatchNormalizationGradientNode,
        BatchNormalizationNode,
        ConvolutionNode,
        FullyConnectedNode,
        NeuronGradientNode,
    )
    from mpsnn.nodes.arithmetic import _ArithmeticNode
    from mpsnn.nodes.convolution import _ConvolutionGradientNode
    from mpsnn.nodes.neuron import NeuronNode
    from mpsnn.nodes.pooling import _PoolingNode

    plan = graph.plan
    sources = plan.topology.source_ids

    def shape(image: Any) -> tuple[int, int, int, int]:
        if image._id in sources:
            return source_shape
        alloc = plan.liveness.alloc_nodes.get(image._id)
        if alloc is not None and alloc._id in shapes:
            return shapes[alloc._id]
        producer = image.producer
        target = plan.fusion.fused_into.get(producer._id) if producer is not None else None
        if target is not None:  # a fused neuron: the image of the node it runs inside
            return shape(target.result_image)
        if producer is not None and producer.source_images:  # passed on: its source's shape
            return shape(producer.source_images[0])
        raise ValueError(f"[breakdown_step] no shape recorded for {image!r}")

    def elements(image: Any) -> int:
        n, c, h, w = shape(image)
        return n * c * h * w

    s = storage_bytes
    out = Workload()
    gradients = {
        n.inference_node._id: n for n in plan.order if isinstance(n, _ConvolutionGradientNode)
    }
    selected = plan.recompute.selected(
        graph.recompute_normalization_results, graph.recompute_input_convolution_results
    )
    recomputed = {r.node._id for rs in selected.values() for r in rs}
    for node in plan.order:
        kernel = plan.kernels[node._id]
        if isinstance(kernel, (_Fused, _PassGradient)):
            continue  # runs inside another node's kernel or passes its input on
        if isinstance(node, ConvolutionNode):
            d = node.data_source.descriptor()
            n, _, ho, wo = shape(node.result_image)
            g = gradients.get(node._id)
            first = node.source_images[0]._id in sources
            fc = isinstance(node, FullyConnectedNode)
            out.convs.append(Conv(
                label=("fc" if fc else f"{d.kernel_height}x{d.kernel_width}")
                      + f" {d.input_feature_channels}->{d.output_feature_channels} out {ho}x{wo}",
                n=n, cin=d.input_feature_channels, cout=d.output_feature_channels,
                kh=d.kernel_height, kw=d.kernel_width, groups=d.groups, ho=ho, wo=wo,
                data_gradient=g is not None and not (first and plan.skips_data_gradient),
                weight_gradient=g is not None,
                fully_connected=fc,
                recomputed=node._id in recomputed,
            ))  # fmt: skip
            bias = node.data_source.bias_terms()
            out.parameters += math.prod(d.weights_shape) + (0 if bias is None else bias.numel())
        elif isinstance(node, BatchNormalizationNode):
            e = elements(node.result_image)
            out.parameters += 2 * shape(node.result_image)[1]
            out.add(BN_STATS, e * s, f"read E={e}")
            if node._id in plan.fusion.normalized_by:  # inside the addition: one pass for both
                out.add(BN_FWD, 3 * e * s, f"with the residual addition: read 2, write 1 x E={e}")
            else:
                out.add(BN_FWD, 2 * e * s, f"read + write E={e}")
            if node._id in recomputed:
                out.add(BN_FWD, 2 * e * s, f"recomputed result: read + write E={e}")
        elif isinstance(node, BatchNormalizationGradientNode):
            e = elements(node.result_image)
            out.add(BN_SUMS, 2 * e * s, f"read gradient + input E={e}")
            out.add(BN_BWD, 3 * e * s, f"read gradient + input, write E={e}")
        elif isinstance(node, _ArithmeticNode) and node._id in plan.fusion.normalized_sums:
            continue  # counted with the normalization it runs
        elif isinstance(node, _ArithmeticNode):
            e, k = elements(node.result_image), len(node.source_images)
            out.add("elementwise", (k + 1) * e * s,
                    f"{type(node).__name__}: read {k}, write 1 x E={e}")  # fmt: skip
        elif isinstance(node, NeuronGradientNode):
            e = elements(node.result_image)
            out.add("elementwise", 3 * e * s, f"neuron gradient: read 2, write 1 x E={e}")
        elif isinstance(node, NeuronNode):
            e = elements(node.result_image)
            out.add("elementwise", 2 * e * s, f"neuron: read 1, write 1 x E={e}")
        elif isinstance(node, _PoolingNode):
            e_in, e_out = elements(node.source_images[0]), elements(node.result_image)
            note = f"forward and gradient: each reads/writes E_in={e_in} + E_out={e_out}"
            out.add(POOLING, 2 * (e_in + e_out) * s, note)
    for _, image in plan.pre_gradient.values():
        e = elements(image)
        out.add("elementwise", 3 * e * s, f"ReLU gradient before a layer gradient: 3 x E={e}")
    copy = s if s < 4 else 0  # the low-precision weight copy the layers read
    per = 16 + s + copy
    tail = f", weight copy write in {s} B)" if copy else ")"
    out.add(OPTIMIZER, out.parameters * per,
            f"{out.parameters} parameters x {per} B (weight + momentum read/write in float32, "
            f"gradient read in {s} B{tail}")  # fmt: skip
    return out


# -- the table ---------------------------------------------------------------------------


@dataclass
class Row:
    category: str
    ms: float | None
    pct: float | None
    launches: float | None
    floor_ms: float | None
    floor_basis: str
    ratio: float | None
    group: bool = False


def summarize(kernels: Sequence[tuple[str, float]], steps: int) -> dict[str, dict[str, Any]]:
    """``kernels``: (name, duration in µs) of every kernel of ``steps`` steps. Per category:
    ms and launches per step, and the kernels' names with their ms per step, largest first."""
    out: dict[str, dict[str, Any]] = {}
    for name, us in kernels:
        c = out.setdefault(classify(name), {"ms": 0.0, "launches": 0.0, "kernels": {}})
        c["ms"] += us / 1e3 / steps
        c["launches"] += 1 / steps
        c["kernels"][name] = c["kernels"].get(name, 0.0) + us / 1e3 / steps
    for c in out.values():
        c["kernels"] = dict(sorted(c["kernels"].items(), key=lambda kv: -kv[1]))
    return out


def rows(per_cat: dict[str, dict[str, Any]] | None, fl: dict[str, Floor]) -> list[Row]:
    """The table's rows: every category that ran or has a floor, then each group's total.
    ``per_cat`` None: no measurement (the floors only)."""
    per_cat = per_cat or {}
    total = sum(c["ms"] for c in per_cat.values()) or None
    out = []

    def row(key: str, ms: float | None, launches: float | None, label: str = "") -> Row:
        f = fl.get(key)
        return Row(
            label or key, ms, None if ms is None or total is None else 100 * ms / total, launches,
            None if f is None else f.ms, "" if f is None else f.basis,
            None if f is None or ms is None or f.ms <= 0 else ms / f.ms, bool(label),
        )  # fmt: skip

    for cat in CATEGORIES:
        if cat in per_cat or cat in fl:
            c = per_cat.get(cat)
            out.append(row(cat, c and c["ms"], c and c["launches"]))
    for group, cats in GROUPS.items():
        ran = [per_cat[c] for c in cats if c in per_cat]
        if group != "rest" and (ran or group in fl):
            ms = sum(c["ms"] for c in ran) if ran else None
            launches = sum(c["launches"] for c in ran) or None
            out.append(row(group, ms, launches, f"{group} (all)"))
    launches = sum(c["launches"] for c in per_cat.values()) or None
    floor = total_floor(fl)
    out.append(Row("total", total, 100.0 if total else None, launches, floor,
                   "sum of the floors above (groups counted once)",
                   None if total is None or floor <= 0 else total / floor, True))  # fmt: skip
    return out


def table(rs: Sequence[Row]) -> str:
    """A markdown table of ``rs``."""

    def num(v: float | None, fmt: str) -> str:
        return "—" if v is None else format(v, fmt)

    lines = ["| category | ms/step | % | launches | floor ms | floor basis | ratio to floor |",
             "|---|---:|---:|---:|---:|---|---:|"]  # fmt: skip
    for r in rs:
        name = f"**{r.category}**" if r.group else r.category
        lines.append(
            f"| {name} | {num(r.ms, '.3f')} | {num(r.pct, '.1f')} | {num(r.launches, '.0f')} | "
            f"{num(r.floor_ms, '.3f')} | {r.floor_basis or '—'} | {num(r.ratio, '.1f')} |"
        )
    return "\n".join(lines)


# -- measurement ---------------------------------------------------------------------------


def _seconds(fn: Callable[[], Any], cuda: bool) -> float:
    """Wall time of ``fn`` (CUDA: between events recorded around it on the current stream)."""
    if not cuda:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def copy_bandwidth(device: torch.device, nbytes: int, trials: int = 10) -> float:
    """GB/s of a device-to-device copy of ``nbytes``: (read + write bytes) over the median time
    of ``trials`` copies (after two that warm up)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = [_seconds(lambda: dst.copy_(src), device.type == "cuda") for _ in range(trials + 2)]
    return 2 * nbytes / statistics.median(times[2:]) / 1e9


def profile_kernels(fn: Callable[[], Any], steps: int) -> tuple[list[tuple[str, float]], float]:
    """The CUDA kernels (and memcpy/memset) of ``steps`` calls of ``fn``: (name, µs) each, and
    the span from the first kernel's start to the last one's end, in µs."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    events = [  # kernels, copies and fills (not the GPU ranges of annotations)
        e
        for e in prof.events()
        if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
    ]
    kernels = [(e.name, float(e.time_range.elapsed_us())) for e in events]
    span = 0.0
    if events:
        span = max(e.time_range.end for e in events) - min(e.time_range.start for e in events)
    return kernels, float(span)


def _print_workload(w: Workload) -> None:
    flops = conv_flops(w.convs)
    print("# FLOPs per step: " + ", ".join(f"{k} {v / 1e9:.2f} G" for k, v in flops.items()))
    print(f"#   {len(w.convs)} layers: 2·N·Ho·Wo·Cout·Cin/groups·kh·kw per pass; data gradient "
          f"in {sum(c.data_gradient for c in w.convs)}, weight gradient in "
          f"{sum(c.weight_gradient for c in w.convs)}")  # fmt: skip
    for c in w.convs:
        print(f"#   {c.label:28s} {c.flops / 1e9:8.3f} GFLOP/pass"
              + ("" if c.data_gradient else "  (no data gradient)"))  # fmt: skip
    print("# bytes per step (lower bounds, storage dtype):")
    for key, nbytes in w.traffic.items():
        notes = w.notes[key]
        print(f"#   {key:22s} {nbytes / 2**20:10.2f} MiB from {len(notes)} terms, e.g. {notes[0]}")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    from benchmarks.tools.twin import mpsnn_graph_step
    from mpsnn.cli.common import model_class, parse_device

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet18")
    p.add_argument("--batch", type=int, default=None, help="512 on CUDA, 2 on the CPU")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--peak-tflops", type=float, default=989.0,
                   help="dense tensor-core peak (989: bf16 on H100/H200 SXM)")  # fmt: skip
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    a = p.parse_args(argv)
    cuda = a.device == "cuda"
    batch = a.batch or (512 if cuda else 2)
    dev = parse_device(a.device)
    shape = model_class(a.model).input_shape
    x = torch.randn(batch, *shape, device=dev.torch_device)
    y = torch.randint(0, 10, (batch,), device=dev.torch_device)
    run = mpsnn_graph_step(a.model, dev, x, y, a.dtype, "sgd")
    storage = {"bfloat16": 2, "float16": 2, "float32": 4}[a.dtype]
    shapes = record_shapes(run.graph, lambda: run.step().wait_until_completed())
    w = workload(run.graph, shapes, tuple(x.shape), storage)
    bandwidth = copy_bandwidth(dev.torch_device, 2**30 if cuda else 2**26)
    print(f"# {a.model}, batch {batch}, {a.dtype} storage, SGD; device {a.device}"
          + (f" ({torch.cuda.get_device_name()})" if cuda else ""))  # fmt: skip
    print(f"# copy bandwidth {bandwidth:.0f} GB/s (read + write bytes of a "
          f"{'1 GiB' if cuda else '64 MiB'} copy over its median time); peak {a.peak_tflops:g} "
          "TFLOP/s (--peak-tflops)")  # fmt: skip
    _print_workload(w)
    fl = floors(w, a.peak_tflops, bandwidth)
    result: dict[str, Any] = {
        "model": a.model, "batch": batch, "dtype": a.dtype, "device": a.device,
        "peak_tflops": a.peak_tflops, "copy_bandwidth_gbs": bandwidth,
        "flops": conv_flops(w.convs), "bytes": w.traffic, "byte_terms": w.notes,
        "parameters": w.parameters, "convolutions": [asdict(c) for c in w.convs],
    }  # fmt: skip
    per_cat = None
    if cuda:
        per_cat = _measure(run, result)
    else:
        run.step().wait_until_completed()  # the second eager step
    rs = rows(per_cat, fl)
    print()
    print(table(rs))
    if per_cat is not None:
        print(f"\nkernel time {result['kernel_ms_per_step']:.3f} ms/step; GPU span "
              f"{result['span_ms_per_step']:.3f} ms/step; replay (timed, no profiler) "
              f"{result['replay_ms']:.3f} ms/step")  # fmt: skip
        print(f"peak memory of the replays: {result['replay_peak_mib']:.1f} MiB above the "
              f"{result['allocated_before_mib']:.0f} MiB allocated before them (the step's "
              f"working memory lives in the recording's pool: the eager and capture calls "
              f"peaked {result['capture_peak_mib']:.1f} MiB above)")  # fmt: skip
        print("\nthe largest kernels of each category (ms/step):")
        for cat in CATEGORIES:
            for name, ms in list(per_cat.get(cat, {}).get("kernels", {}).items())[:3]:
                print(f"  [{cat}] {ms:.3f}  {name[:110]}")
    result["rows"] = [asdict(r) for r in rs]
    result["categories"] = per_cat
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


def _peak_mib(fn: Callable[[], Any], calls: int) -> tuple[float, float]:
    """MiB allocated before ``calls`` calls of ``fn``, and their peak above it (CUDA)."""
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return before / 2**20, (torch.cuda.max_memory_allocated() - before) / 2**20


def _measure(run: Any, result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Compile, warm up, measure memory and time, profile 5 replays (CUDA)."""
    compiled = run.graph.compile(run.queue)

    def replay() -> Any:
        return compiled(run.images, run.labels)

    torch.cuda.synchronize()
    _, result["capture_peak_mib"] = _peak_mib(replay, 3)  # eager, capture (+ replay), replay
    if not compiled.is_captured:
        raise RuntimeError(f"[breakdown_step] the step was not recorded: {compiled.eager_reason}")
    result["allocated_before_mib"], result["replay_peak_mib"] = _peak_mib(replay, 3)
    with torch.cuda.stream(run.queue.stream):  # the events on the stream the replays run on
        ten = [_seconds(lambda: [replay() for _ in range(10)], True) for _ in range(3)]
    result["replay_ms"] = statistics.median(ten) / 10 * 1e3
    steps = 5
    kernels, span = profile_kernels(replay, steps)
    per_cat = summarize(kernels, steps)
    result["kernel_ms_per_step"] = sum(c["ms"] for c in per_cat.values())
    result["span_ms_per_step"] = span / 1e3 / steps
    return per_cat


if __name__ == "__main__":
    main()
