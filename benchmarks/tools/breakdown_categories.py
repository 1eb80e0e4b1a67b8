"""The categories of `benchmarks.tools.breakdown_step` and its floor arithmetic.

Every CUDA kernel of a profiled step is put in a category by its name (`classify`); the
categories come in groups (`GROUPS`), in the table's order. A step's work is its convolutions
(`Conv`: FLOPs per pass) and the bytes each memory-bound category moves at least (`Workload`);
a floor is FLOPs over the tensor-core peak or bytes over the measured copy bandwidth
(`floors`), and the step's floor the sum of the floors that are not sums of others
(`total_floor`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

# -- categories ----------------------------------------------------------------------------

#: group name -> its categories, in the table's order
GROUPS: dict[str, tuple[str, ...]] = {
    "convolution": ("conv forward", "conv data gradient", "conv weight gradient",
                    "conv other (cuDNN helpers)", "layout conversion (NCHW/NHWC)"),
    "batch norm": ("bn statistics", "bn forward", "bn gradient sums", "bn backward"),
    "elementwise": ("elementwise: mpsnn Triton", "elementwise: add/sub", "elementwise: mul/div",
                    "elementwise: relu/threshold", "elementwise: copy/cast", "elementwise: fill",
                    "elementwise: other", "elementwise: foreach"),
    "rest": ("optimizer", "loss", "pooling", "bias gradient sums", "dropout", "reduction",
             "GEMM (fully connected)", "memcpy", "memset", "other"),
}  # fmt: skip
CONV_FWD, CONV_DGRAD, CONV_WGRAD, CONV_OTHER, LAYOUT = GROUPS["convolution"]
BN_STATS, BN_FWD, BN_SUMS, BN_BWD = GROUPS["batch norm"]
EW_TRITON, EW_ADD, EW_MUL, EW_RELU, EW_COPY, EW_FILL, EW_OTHER, FOREACH = GROUPS["elementwise"]
OPTIMIZER, LOSS, POOLING, BIAS_SUMS, DROPOUT, REDUCTION, GEMM, MEMCPY, MEMSET, OTHER = GROUPS[
    "rest"
]
CATEGORIES: tuple[str, ...] = tuple(c for cats in GROUPS.values() for c in cats)

#: mpsnn's Triton kernels (``mpsnn/ops/triton/*.py``: the launched ones, each a `FastKernel`)
TRITON_KERNELS: dict[str, str] = {
    "_stats_partial": BN_STATS,
    "_stats_combine": BN_STATS,
    "_stats_partial_nhwc": BN_STATS,
    "_running_updates": BN_STATS,
    "_merge_rows": BN_STATS,
    "_forward": BN_FWD,
    "_forward_nhwc": BN_FWD,
    "_gradient_sums_partial": BN_SUMS,
    "_gradient_sums_partial_nhwc": BN_SUMS,
    "_backward": BN_BWD,
    "_backward_nhwc": BN_BWD,
    "_forward_add_relu_nhwc": BN_FWD,
    "_add_relu": EW_TRITON,
    "_relu_times": EW_TRITON,
    "_sum_relu_gradient": EW_TRITON,
    "_multi_tensor_update": OPTIMIZER,
    "_softmax_cross_entropy": LOSS,
    "_max_pool_bwd": POOLING,
    "_channel_sums_partial": BIAS_SUMS,
    "_dropout_flat": DROPOUT,
    "_dropout_planes": DROPOUT,
    "_nchw_to_nhwc": LAYOUT,
    "_nhwc_to_nchw": LAYOUT,
    "_narrow_flat": EW_COPY,
    "_few_channel_conv": CONV_FWD,
    "_few_channel_conv_wgrad": CONV_WGRAD,
}

# older Triton versions append the argument specialization (``_forward_0d1d2d3de``)
_TRITON_SUFFIX = re.compile(r"_(?:\d+[a-z]*)+$")


def classify(name: str) -> str:
    """The category of a CUDA kernel (or memcpy/memset) by its profiler name.

    The convolution passes are told apart by cuDNN's and CUTLASS's names (``fprop``,
    ``dgrad``, ``wgrad``; the legacy ``*convolve*`` kernels count as forward); cuDNN kernels
    that are none of these (offset tables, split-K reductions) are its helpers, except the
    layout conversions (``nchwToNhwc``/``nhwcToNchw``), a category of their own. PyTorch's
    elementwise kernels are split by the functor in their name."""
    s = name.lower()
    if s.startswith("memcpy"):
        return MEMCPY
    if s.startswith("memset"):
        return MEMSET
    bare = name.strip()
    triton = TRITON_KERNELS.get(bare) or TRITON_KERNELS.get(_TRITON_SUFFIX.sub("", bare))
    if triton is not None:
        return triton
    for needles, category in _BY_NAME:
        if any(n in s for n in needles):
            return _functor(s) if category is None else category
    return OTHER


# checked in order on the lowercased name; None: PyTorch elementwise, split by `_FUNCTORS`
_BY_NAME: tuple[tuple[tuple[str, ...], str | None], ...] = (
    (("nchwtonhwc", "nhwctonchw"), LAYOUT),
    (("wgrad",), CONV_WGRAD),
    (("dgrad",), CONV_DGRAD),
    (("fprop", "convolve", "conv2d", "winograd"), CONV_FWD),
    (("cudnn",), CONV_OTHER),
    (("gemm", "gemv", "cublas", "cutlass"), GEMM),
    (("reduce_kernel",), REDUCTION),
    (("multi_tensor_apply",), FOREACH),
    (("elementwise_kernel",), None),
    (("pool",), POOLING),
    (("softmax", "nll_loss", "cross_entropy"), LOSS),
)
_FUNCTORS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("fill",), EW_FILL),
    (("copy", "cast"), EW_COPY),
    (("threshold", "relu", "clamp"), EW_RELU),
    (("mul", "div"), EW_MUL),
    (("add", "sub"), EW_ADD),
)


# template noise in PyTorch's kernel names that is no functor
_NOT_FUNCTOR = re.compile(r"(load|store)with(out)?cast|_nocast|tensoriterator")


def _functor(s: str) -> str:
    s = _NOT_FUNCTOR.sub("", s)
    return next((c for needles, c in _FUNCTORS if any(n in s for n in needles)), EW_OTHER)


# -- the work of one step and its floors ----------------------------------------------------


@dataclass(frozen=True)
class Conv:
    """One convolution (or fully connected) layer of the step: batch ``n``, output
    ``ho``×``wo``, and which gradients the step computes."""

    label: str
    n: int
    cin: int
    cout: int
    kh: int
    kw: int
    groups: int
    ho: int
    wo: int
    data_gradient: bool
    weight_gradient: bool
    fully_connected: bool = False
    recomputed: bool = False  # its forward runs again before the backward

    @property
    def flops(self) -> int:
        """FLOPs of one pass (forward, data gradient or weight gradient: the same count)."""
        kernel = (self.cin // self.groups) * self.kh * self.kw
        return 2 * self.n * self.ho * self.wo * self.cout * kernel


@dataclass
class Workload:
    """What one step must do at least: the convolutions, the bytes each memory-bound category
    (or group) moves, with the reason of each term, and the parameter count."""

    convs: list[Conv] = field(default_factory=list)
    traffic: dict[str, int] = field(default_factory=dict)
    notes: dict[str, list[str]] = field(default_factory=dict)
    parameters: int = 0

    def add(self, key: str, nbytes: int, note: str) -> None:
        self.traffic[key] = self.traffic.get(key, 0) + int(nbytes)
        self.notes.setdefault(key, []).append(note)


def conv_flops(convs: Sequence[Conv]) -> dict[str, int]:
    """FLOPs per category: the convolutions' three passes, the fully connected layers' as GEMM."""
    out = {CONV_FWD: 0, CONV_DGRAD: 0, CONV_WGRAD: 0, GEMM: 0}
    for c in convs:
        if c.fully_connected:
            out[GEMM] += c.flops * (1 + c.recomputed + c.data_gradient + c.weight_gradient)
            continue
        out[CONV_FWD] += c.flops * (1 + c.recomputed)
        out[CONV_DGRAD] += c.flops if c.data_gradient else 0
        out[CONV_WGRAD] += c.flops if c.weight_gradient else 0
    return out


@dataclass(frozen=True)
class Floor:
    """A floor in ms and how it was found; ``derived``: the sum of other floors (a group's)."""

    ms: float
    basis: str
    derived: bool = False


def floors(w: Workload, peak_tflops: float, bandwidth_gbs: float) -> dict[str, Floor]:
    """Floor per category (and per group where only the group has one): FLOPs over the peak,
    bytes over the measured copy bandwidth (GB/s = 1e9 B/s)."""
    out: dict[str, Floor] = {}
    for cat, flops in conv_flops(w.convs).items():
        if flops:
            ms = flops / (peak_tflops * 1e12) * 1e3
            out[cat] = Floor(ms, f"{flops / 1e9:.4g} GFLOP @ {peak_tflops:g} TFLOP/s")
    for key, nbytes in w.traffic.items():
        if nbytes:
            ms = nbytes / (bandwidth_gbs * 1e9) * 1e3
            out[key] = Floor(ms, f"{nbytes / 2**20:.4g} MiB @ {bandwidth_gbs:.0f} GB/s")
    for group, cats in GROUPS.items():
        if group in out or group == "rest":
            continue
        parts = [out[c].ms for c in cats if c in out]
        if parts:
            out[group] = Floor(sum(parts), "sum of its categories' floors", derived=True)
    return out


def total_floor(fl: dict[str, Floor]) -> float:
    """The step's floor: every floor that is not a sum of others, added (the operations run
    one after another)."""
    return sum(f.ms for f in fl.values() if not f.derived)
