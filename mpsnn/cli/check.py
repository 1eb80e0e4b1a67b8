"""``mpsnn check``: run one kernel configuration, forward and gradient, against references.

The measurements are in `mpsnn.cli.checking`, the kernel drivers in `mpsnn.cli.families`, the
PyTorch equivalents in `mpsnn.cli.references`; this module parses the command line and prints.
"""

from __future__ import annotations

import json
from math import inf
from typing import Any

import click

from mpsnn.cli.common import SEED_MAX
from mpsnn.cli.common import OneLineCommand as _Command
from mpsnn.cli.common import OneLineError as _OneLineError
from mpsnn.cli.families import COMPARISONS, FAMILIES, NEURON_TYPES, make_config
from mpsnn.cli.families_loss import LOSS_TYPES, REDUCTIONS
from mpsnn.cli.families_more import REDUCE_OPS
from mpsnn.cli.policies import PADDING_HELP, padding_policy

__all__ = ["check"]

_EDGE_MODES = ["zero", "clamp", "mirror", "mirror-with-edge", "constant"]
_DTYPES = ["float32", "float16", "bfloat16", "float64"]
# Options every family takes; the others apply to the families that list them.
_COMMON = {"family", "size", "batch", "dtype", "device", "seed", "as_json"}


class _Dims(click.ParamType):
    """``8x8x4``: positive integers separated by x."""

    def __init__(self, *names: str, example: str) -> None:
        self.names, self.example = names, example
        self.name = "x".join(names)

    def get_metavar(self, param: Any, ctx: Any = None) -> str:
        return self.name

    def convert(self, value: Any, param: Any, ctx: Any) -> tuple[int, ...]:
        if isinstance(value, tuple):
            return value
        try:
            nums = tuple(int(p) for p in str(value).lower().split("x"))
        except ValueError:
            nums = ()
        if len(nums) != len(self.names) or min(nums) < 1:
            self.fail(
                f"expected {self.name} with positive integers (e.g. {self.example}), got {value!r}",
                param,
                ctx,
            )
        return nums


class _Ints(click.ParamType):
    """``X,Y[,Z]``: integers separated by commas, each at least its field's minimum."""

    def __init__(self, *fields: tuple[str, int | None], optional: int = 0) -> None:
        self.fields, self.optional = fields, optional
        names = [f for f, _ in fields]
        cut = len(names) - optional
        self.name = ",".join(names[:cut]) + "".join(f"[,{n}]" for n in names[cut:])

    def get_metavar(self, param: Any, ctx: Any = None) -> str:
        return self.name

    def convert(self, value: Any, param: Any, ctx: Any) -> tuple[int, ...]:
        if isinstance(value, tuple):
            return value
        n = len(self.fields)
        try:
            nums = tuple(int(p) for p in str(value).split(","))
        except ValueError:
            nums = ()
        lows = [low for _, low in self.fields]
        if not (
            n - self.optional <= len(nums) <= n
            and all(low is None or v >= low for v, low in zip(nums, lows, strict=False))
        ):
            limits = ", ".join(f"{f} >= {low}" for f, low in self.fields if low is not None)
            self.fail(
                f"expected {self.name} as integers{f' ({limits})' if limits else ''}, "
                f"got {value!r}",
                param,
                ctx,
            )
        return nums + (0,) * (n - len(nums))


class _Region(click.ParamType):
    """``X,Y,W,H``: four real numbers (a normalized crop region)."""

    name = "X,Y,W,H"

    def convert(self, value: Any, param: Any, ctx: Any) -> tuple[float, ...]:
        if isinstance(value, tuple):
            return value
        try:
            nums = tuple(float(p) for p in str(value).split(","))
        except ValueError:
            nums = ()
        if len(nums) != 4:
            self.fail(
                f"expected X,Y,W,H as 4 numbers (e.g. 0.1,0.2,0.5,0.5), got {value!r}", param, ctx
            )
        return nums


class _Anchors(click.ParamType):
    """``WxH,WxH,...``: anchor boxes, positive numbers in grid cells."""

    name = "WxH[,WxH...]"

    def convert(self, value: Any, param: Any, ctx: Any) -> tuple[tuple[float, float], ...]:
        if isinstance(value, tuple):
            return value
        try:
            pairs = [tuple(float(v) for v in p.lower().split("x")) for p in str(value).split(",")]
        except ValueError:
            pairs = []
        if not pairs or any(len(p) != 2 or not min(p) > 0 or max(p) == inf for p in pairs):
            self.fail(
                f"expected WxH[,WxH...] with positive finite numbers (e.g. 1x2,1x1,2x1), "
                f"got {value!r}",
                param,
                ctx,
            )
        return tuple((p[0], p[1]) for p in pairs)


class _Padding(click.ParamType):
    name = "POLICY"

    def convert(self, value: Any, param: Any, ctx: Any) -> str:
        try:
            padding_policy(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)
        return value


_HELP = f"""Run ONE kernel configuration, forward and gradient, and print its errors.

FAMILY is one of: {", ".join(FAMILIES)}.

\b
What is measured (inputs drawn in float64 with --seed, rounded to --dtype):
  * forward and every gradient (data; weights and bias; gamma and beta; the
    secondary source) in --dtype on --device, against the same kernel in
    float64 on the CPU, and against PyTorch's equivalent (F.conv2d,
    F.max_pool2d, F.avg_pool2d, F.interpolate, ... with the padding the
    policy implies; autograd for the gradients) where this geometry has one;
  * the adjoint test of every gradient kernel in float64: <J v, w> against
    <v, g(w)> for random v and w.
compare, reduce, local-correlation and forward-loss check the forward only (MPS
defines no gradient for the first three); reduce runs the kernel --op names.
loss-gradient checks ForwardLoss and the LossGradient of the predictions and
of the labels (--loss picks the loss type, --reduction its reduction).
yolo-loss checks YOLOLoss's loss image and its gradient (the destination; one
cotangent value per image scales that image's gradient) against a float64
restatement of the documented loss (--anchors, --classes, --rescore,
--reduction; --size's channels are A·(5+K)); with --rescore the gradient
holds the IoU target constant and has no adjoint test.
\b
Errors: max |a - e| and the relative error ||a - e|| / ||e|| (2-norms).
Tolerances on the relative error: float64 1e-10, float32 1e-5, float16 5e-3,
bfloat16 4e-2 (TF32 is turned off); they suit well-conditioned outputs (a
normalization over a handful of elements has a cancelling gradient that
float32 cannot meet them on). Adjoint test: relative difference 1e-9
for maps affine in that input (J v by exact differences), 1e-6 otherwise
(central differences, step 1e-5).
\b
Exit status: 0 every check within tolerance, 1 some check failed (listed),
2 usage error. The destination is sized by the kernel's padding policy, which
also sets the offset; --offset replaces it and --destination-size the size,
as an explicit destination does.
"""


@click.command("check", cls=_Command, help=_HELP)
@click.argument("family", type=click.Choice(list(FAMILIES)), metavar="FAMILY")
@click.option(
    "--size",
    type=_Dims("W", "H", "C", example="8x8x4"),
    default="8x8x4",
    show_default=True,
    help="Source width x height x channels.",
)
@click.option(
    "--batch",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="Images in the source.",
)
@click.option(
    "--kernel",
    type=_Dims("KW", "KH", example="3x3"),
    help="Window (convolution 3x3, pooling 2x2, fully connected: the source).",
)
@click.option("--stride", type=_Dims("SX", "SY", example="2x2"), help="Strides.")
@click.option("--dilation", type=_Dims("DX", "DY", example="2x2"), help="Dilation rates.")
@click.option("--out-channels", type=click.IntRange(min=1), help="Output channels (4).")
@click.option(
    "--groups",
    type=click.IntRange(min=1),
    help="Convolution groups (1); group normalization groups (2).",
)
@click.option(
    "--offset",
    type=_Ints(("X", None), ("Y", None), ("Z", 0), optional=1),
    help="Kernel offset (replaces the padding policy's).",
)
@click.option(
    "--clip",
    type=_Ints(("X", None), ("Y", None), ("W", 1), ("H", 1)),
    help="Clip rect in the destination (all images).",
)
@click.option(
    "--edge-mode",
    type=click.Choice(_EDGE_MODES),
    help="Edge mode (mirror, mirror-with-edge, constant: pad only).",
)
@click.option("--padding", type=_Padding(), help=f"Padding policy: {PADDING_HELP}.")
@click.option(
    "--source-channel-offset", "sco", type=click.IntRange(min=0), help="First source channel read."
)
@click.option(
    "--destination-channel-offset",
    "dco",
    type=click.IntRange(min=0),
    help="First destination channel written.",
)
@click.option(
    "--destination-size",
    type=_Dims("W", "H", example="6x6"),
    help="Destination width x height (else the padding policy's).",
)
@click.option("--neuron", type=click.Choice(list(NEURON_TYPES)), help="Neuron type (relu).")
@click.option("--a", type=float, help="Neuron parameter a.")
@click.option("--b", type=float, help="Neuron parameter b.")
@click.option("--c", type=float, help="Neuron parameter c.")
@click.option("--scale", type=_Dims("SX", "SY", example="2x2"), help="Upsampling factors (2x2).")
@click.option("--align-corners", is_flag=True, default=None, help="Bilinear upsampling.")
@click.option(
    "--keep-probability",
    type=click.FloatRange(0, 1, min_open=True, max_open=True),
    help="Dropout keep probability (0.5).",
)
@click.option(
    "--pad-before", type=_Ints(("X", 0), ("Y", 0), ("C", 0)), help="Pad sizes before (1,2,0)."
)
@click.option(
    "--pad-after", type=_Ints(("X", 0), ("Y", 0), ("C", 0)), help="Pad sizes after (2,1,0)."
)
@click.option("--fill-value", type=float, help="Pad fill value (0).")
@click.option(
    "--secondary-size",
    type=_Dims("W", "H", "C", example="8x8x1"),
    help="Arithmetic, compare: secondary source size, a 1 broadcasts (default: the "
    "source's); reduce with weights (1x1xC), local correlation (the source's).",
)
@click.option("--alpha", type=float, help="Gram matrix scale (0.25).")
@click.option(
    "--comparison", type=click.Choice(list(COMPARISONS)), help="Compare: the comparison (equal)."
)
@click.option(
    "--threshold", type=click.FloatRange(min=0), help="Compare: the tolerance of equality (0)."
)
@click.option(
    "--op",
    type=click.Choice(list(REDUCE_OPS)),
    help="The reduction (row-sum); feature-channels-and-weights-*: the secondary source holds "
    "the weights (--secondary-size, 1x1 by default).",
)
@click.option(
    "--weight",
    type=float,
    help="Reduce feature-channels-sum: the factor; forward-loss, loss-gradient: the loss "
    "descriptor's weight (1).",
)
@click.option(
    "--source-clip",
    type=_Ints(("X", None), ("Y", None), ("W", 1), ("H", 1)),
    help="Reduce, local correlation: the source region read (all images).",
)
@click.option(
    "--window",
    type=_Ints(("X", 0), ("Y", 0)),
    help="Local correlation: offsets -window..window strides (2,1; --stride 1x2).",
)
@click.option(
    "--resize", type=_Dims("W", "H", example="11x5"), help="Resize size (11x5; crop 4x3)."
)
@click.option(
    "--region",
    "regions",
    type=_Region(),
    multiple=True,
    help="Crop and resize: a normalized region (repeat for several; 3 by default).",
)
@click.option(
    "--loss",
    type=click.Choice(list(LOSS_TYPES)),
    help="Forward-loss, loss-gradient: the loss type (softmax-cross-entropy).",
)
@click.option(
    "--reduction",
    type=click.Choice(list(REDUCTIONS)),
    help="Forward-loss, loss-gradient, yolo-loss: the reduction per image (mean).",
)
@click.option(
    "--reduce-across-batch",
    is_flag=True,
    default=None,
    help="Forward-loss, loss-gradient: one loss value for the batch (in image 0).",
)
@click.option(
    "--loss-weights",
    is_flag=True,
    default=None,
    help="Forward-loss, loss-gradient, yolo-loss: a weights image (random, some of it 0).",
)
@click.option(
    "--anchors",
    type=_Anchors(),
    help="Yolo-loss: the anchor boxes' width x height in grid cells (1x2,1x1,2x1).",
)
@click.option("--classes", type=click.IntRange(min=1), help="Yolo-loss: the classes (2).")
@click.option(
    "--rescore/--no-rescore",
    default=None,
    help="Yolo-loss: the confidence target times the predicted box's IoU (on).",
)
@click.option("--dtype", type=click.Choice(_DTYPES), default="float32", show_default=True)
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option(
    "--seed",
    type=click.IntRange(0, SEED_MAX),
    default=0,
    show_default=True,
    help="Seeds the inputs (and dropout's masks).",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.pass_context
def check(ctx: click.Context, **options: Any) -> None:
    import torch

    from mpsnn.cli.checking import run_check
    from mpsnn.core import precision
    from mpsnn.core.geometry import EdgeMode
    from mpsnn.errors import UnsupportedError

    family = FAMILIES[options["family"]]
    flags = {p.name: p.opts[0] for p in ctx.command.params}
    given = {
        name
        for name in options
        if ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE
    }
    wrong = sorted(given - _COMMON - family.options)
    if wrong:
        takes = (
            ", ".join(sorted(flags[n] for n in family.options)) or "none besides the common ones"
        )
        raise _OneLineError(
            f"{flags[wrong[0]]} does not apply to {family.name} (its options: {takes})", ctx
        )
    if options["device"] == "cuda" and not torch.cuda.is_available():
        raise _OneLineError("--device cuda: CUDA is not available on this machine (valid: cpu)")
    if (options["sco"] or 0) >= options["size"][2]:
        raise _OneLineError(
            f"--source-channel-offset must be < the source's {options['size'][2]} channels "
            f"(--size), got {options['sco']}"
        )
    keep = (given | _COMMON) - {"family", "as_json"}
    values = {k: v for k, v in options.items() if v is not None and k in keep}
    values["dtype"] = getattr(torch, options["dtype"])
    if "edge_mode" in values:
        values["edge_mode"] = EdgeMode[values["edge_mode"].upper().replace("-", "_")]
    # float32 is checked as float32 arithmetic (no TF32), whatever the process set before
    saved = precision.get_float32_matmul_precision()
    precision.set_float32_matmul_precision("highest")
    try:
        report = run_check(make_config(family, family.complete(values, given)))
    except (ValueError, TypeError, UnsupportedError) as e:
        raise _OneLineError(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
    except (MemoryError, RuntimeError) as e:
        if not _allocation_failure(e):
            raise
        raise _OneLineError(
            f"this configuration needs more memory than can be allocated here ({_short(e)}): "
            "use smaller sizes"
        ) from None
    finally:
        precision.set_float32_matmul_precision(saved)
    if options["as_json"]:
        click.echo(json.dumps(report, indent=2))
    else:
        _render(report)
    if not report["passed"]:
        ctx.exit(1)


def _allocation_failure(e: BaseException) -> bool:
    """An allocation that failed (CPU or GPU), or sizes whose byte count overflows."""
    import torch

    text = str(e)
    return (
        isinstance(e, MemoryError | torch.OutOfMemoryError)
        or "can't allocate memory" in text
        or "Storage size calculation overflowed" in text
        or "out of memory" in text.lower()
    )


def _short(e: BaseException) -> str:
    """The allocation's size, from PyTorch's message where it states one."""
    import re

    text = str(e)
    size = re.search(r"allocate (\d+) bytes", text)
    if size is not None:
        return f"a tensor of {int(size.group(1)) / 2**30:,.1f} GiB"
    sizes = re.search(r"sizes=(\[[\d, ]*\])", text)
    if sizes is not None:
        return f"a tensor of sizes {sizes.group(1)}, more bytes than an address can count"
    return type(e).__name__


def _shape(dims: list[int]) -> str:
    return "×".join(map(str, dims)) + " (N×C×H×W)"


def _render(r: dict[str, Any]) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console(highlight=False)
    title = f"mpsnn check {r['family']}: {r['dtype']} on {r['device']}, seed {r['seed']}"
    console.print(Text(title, style="bold"))
    head = Table.grid(padding=(0, 2))
    head.add_column(style="cyan", no_wrap=True)
    head.add_column(overflow="fold")
    kernels = f"{r['forward_kernel']}, {r['gradient_kernel']}"
    if r["gradient_kernel"] is None:
        kernels = f"{r['forward_kernel']} (forward only: no gradient kernel)"
    rows = [
        ("kernels", kernels),
        ("source", _shape(r["source_shape"])),
    ]
    if r["padding"]:
        rows.append(("padding policy", r["padding"]))
    rows += [
        ("destination", _shape(r["destination_shape"])),
        ("offset", f"{tuple(r['offset'])}, set by {r['offset_from']}"),
        ("edge mode", r["edge_mode"]),
        ("PyTorch", r["torch_equivalent"] or r["torch_note"]),
    ]
    for key, value in rows:
        head.add_row(key, Text(value))
    console.print(head)

    def table(*columns: str) -> Table:
        t = Table(box=box.SIMPLE_HEAD, pad_edge=False)
        for i, name in enumerate(columns):
            t.add_column(name, justify="right" if i >= 3 else "left", no_wrap=i != 2)
        return t

    errors = table("", "output", "reference", "max |a-e|", "rel. err", "tol.")
    for c in r["checks"]:
        rel = "—" if c["relative_error"] is None else f"{c['relative_error']:.2e}"
        mx = "—" if c["max_abs_error"] is None else f"{c['max_abs_error']:.2e}"
        tol = f"{c['tolerance']:.0e}"
        errors.add_row(_mark(c["passed"]), c["name"], c["reference"], mx, rel, tol)
    console.print(errors)
    if not r["adjoint"]:
        why = r.get("adjoint_note") or "no gradient"
        console.print(Text(f"adjoint test in float64 on the cpu: none ({why})", style="bold"))
    adj = table("", "gradient", "inner products", "rel. diff", "tol.")
    for a in r["adjoint"]:
        products = f"<J v, w>  = {a['lhs']:.15g}\n<v, g(w)> = {a['rhs']:.15g}"
        name = a["name"] + ("\n(J v = 0)" if a.get("note") else "")
        diff, tol = f"{a['relative_difference']:.1e}", f"{a['tolerance']:.0e}"
        adj.add_row(_mark(a["passed"]), name, products, diff, tol)
    if r["adjoint"]:
        console.print(Text("adjoint test in float64 on the cpu", style="bold"))
        console.print(adj)
    if r["passed"]:
        n = len(r["checks"]) + len(r["adjoint"])
        console.print(Text(f"PASSED: all {n} checks within tolerance", style="bold green"))
    else:
        for f in r["failures"]:
            console.print(Text(f"FAILED: {f}", style="bold red"))


def _mark(passed: bool) -> Any:
    from rich.text import Text

    return Text("ok", style="green") if passed else Text("FAIL", style="bold red")
