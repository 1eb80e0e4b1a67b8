"""The measurements behind ``mpsnn check``: one configuration's forward and gradients against
the same kernel in float64 on the CPU and against PyTorch, and the adjoint test.

Errors compare a result ``a`` with a reference ``e`` over the whole tensor: the maximum
absolute error ``max |a - e|`` and the relative error ``||a - e|| / ||e||`` (2-norms; the
absolute 2-norm when ``e`` is zero). A check passes when the relative error is within the
tolerance of the dtype under test (`TOLERANCES`). Inputs are drawn in float64 and rounded to
the dtype under test; every reference computes on those rounded values, so the errors measure
the kernel's arithmetic, not the rounding of its inputs. (The tolerances suit
well-conditioned outputs: a normalization whose statistics hold a handful of elements has a
gradient that cancels, and float32 arithmetic can exceed them; the check then says so.)

The adjoint test runs in float64 on the CPU with the unrounded inputs: for each input ``k`` with
a gradient, random ``v`` (shaped like the input) and ``w`` (like the destination), ``<J_k v, w>``
and ``<v, g_k(w)>`` must agree, ``J_k v`` by central differences of the forward (step 1, exact,
when the forward is affine in that input; else 1e-5), ``g_k(w)`` from the gradient kernel.
A forward-only family (no gradient kernel: MPS defines none) has no gradient checks and no
adjoint test; a family whose gradient is not the derivative of its forward by design (the YOLO
loss with ``rescore``) has no adjoint test either, and the report says why (``adjoint_note``).
A loss computing its own gradient (the gradient of each image's loss summed) takes one
cotangent value per image, which scales that image's gradient (`Family.per_image_cotangent`).
"""

from __future__ import annotations

from typing import Any

import torch

from mpsnn.cli.families import FAMILIES
from mpsnn.cli.family import Config, Outcome, Values
from mpsnn.cli.references import REFERENCES
from mpsnn.cli.references_geometry import NoEquivalent

__all__ = ["ADJOINT_TOLERANCES", "GRADIENT_NAMES", "TOLERANCES", "run_check"]

TOLERANCES = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.float16: 5e-3,
    torch.bfloat16: 4e-2,
}
# (exact differences for affine maps, central differences otherwise)
ADJOINT_TOLERANCES = (1e-9, 1e-6)
_STEP_NONLINEAR = 1e-5

GRADIENT_NAMES = {
    "forward": "forward",
    "x": "data gradient",
    "weights": "weight gradient",
    "bias": "bias gradient",
    "gamma": "gamma gradient",
    "beta": "beta gradient",
    "y": "secondary gradient",
    "labels": "labels gradient",
}


def _errors(a: torch.Tensor, e: torch.Tensor, tol: float, name: str, ref: str) -> dict[str, Any]:
    row: dict[str, Any] = {"name": name, "reference": ref, "tolerance": tol}
    if tuple(a.shape) != tuple(e.shape):
        row.update(
            max_abs_error=None, relative_error=None, passed=False,
            note=f"shape {tuple(a.shape)} != reference shape {tuple(e.shape)}",
        )  # fmt: skip
        return row
    diff = a - e
    max_abs = diff.abs().max().item() if diff.numel() else 0.0
    scale = e.norm().item()
    rel = diff.norm().item() / scale if scale > 0 else diff.norm().item()
    finite = bool(torch.isfinite(a).all())
    row.update(max_abs_error=max_abs, relative_error=rel, passed=finite and rel <= tol)
    if not finite:
        row["note"] = "non-finite values"
    return row


class _Cotangent:
    """One random cotangent per check, created at the destination's shape on first use."""

    def __init__(self, gen: torch.Generator, dtype: torch.dtype) -> None:
        self.gen, self.dtype, self.value = gen, dtype, None

    def __call__(self, shape: tuple[int, ...]) -> torch.Tensor:
        if self.value is None:
            t = torch.randn(shape, generator=self.gen, dtype=torch.float64)
            self.value = t.to(self.dtype).double()
        return self.value


def _torch_reference(
    cfg: Config, q: Values, got: Outcome, cot: torch.Tensor | None
) -> tuple[torch.Tensor, dict[str, torch.Tensor], str]:
    fam = FAMILIES[cfg.family]
    names = fam.gradient_inputs(cfg)
    inputs = {k: v.clone().requires_grad_(k in names) for k, v in q.items()}
    out, text = REFERENCES[cfg.family](got.geometry, inputs)
    g = got.geometry
    block = None if cot is None else cot[:, g.dco : g.dco + g.channels_written]
    if block is not None and fam.per_image_cotangent:
        block = block.expand(out.shape)
    if block is not None and out.shape == block.shape and out.requires_grad:
        out.backward(block)
    grads = {
        k: (inputs[k].grad if inputs[k].grad is not None else torch.zeros_like(q[k])) for k in names
    }
    return out.detach(), grads, text


def _adjoint(cfg: Config, values: Values, dst_shape: tuple[int, ...]) -> list[dict[str, Any]]:
    fam = FAMILIES[cfg.family]
    names = fam.gradient_inputs(cfg)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    w_shape = (dst_shape[0], 1, 1, 1) if fam.per_image_cotangent else dst_shape
    w = torch.randn(w_shape, generator=gen, dtype=torch.float64)
    vs = {k: torch.randn(values[k].shape, generator=gen, dtype=torch.float64) for k in names}
    grads = fam.run(cfg, values, "cpu", torch.float64, lambda shape: w).grads
    rows = []
    for k in names:
        linear = fam.is_linear(cfg, k)
        step = 1.0 if linear else _STEP_NONLINEAR
        plus = fam.run(cfg, {**values, k: values[k] + step * vs[k]}, "cpu", torch.float64).y
        minus = fam.run(cfg, {**values, k: values[k] - step * vs[k]}, "cpu", torch.float64).y
        jv = (plus - minus) / (2 * step)
        lhs = float((jv * w).sum())  # a per-image cotangent broadcasts over each image
        rhs = float((vs[k] * grads[k]).sum())
        tol = ADJOINT_TOLERANCES[0 if linear else 1]
        diff = abs(lhs - rhs) / max(abs(lhs), abs(rhs), 1e-300)
        row = {
            "name": GRADIENT_NAMES[k], "input": k, "lhs": lhs, "rhs": rhs,
            "relative_difference": diff if (lhs or rhs) else 0.0, "tolerance": tol,
            "step": step, "passed": bool(diff <= tol or lhs == rhs == 0.0),
        }  # fmt: skip
        if jv.abs().max().item() == 0:
            row["note"] = "degenerate: J v = 0 (the forward reads nothing of this input)"
        rows.append(row)
    return rows


def run_check(cfg: Config) -> dict[str, Any]:
    """Measure one configuration; returns the report (see ``mpsnn check --json``).

    Raises the kernels' ValueError/TypeError for configurations they refuse, and ValueError
    when even the float64 results are not finite (nothing to compare).
    """
    fam = FAMILIES[cfg.family]
    names = fam.gradient_inputs(cfg)
    tol = TOLERANCES[cfg.dtype]
    gen = torch.Generator().manual_seed(cfg.seed)
    values = fam.inputs(cfg, gen)
    q = {k: v.to(cfg.dtype).double() for k, v in values.items()}  # what every run computes on
    cot = _Cotangent(gen, cfg.dtype)
    got = fam.run(cfg, q, cfg.device, cfg.dtype, cot)
    f64 = fam.run(cfg, q, "cpu", torch.float64, cot)
    for name, t in (
        ("forward", f64.y),
        *((GRADIENT_NAMES[k], f64.grads[k]) for k in names),
    ):
        if not bool(torch.isfinite(t).all()):
            hint = " (use --edge-mode clamp)" if cfg.family == "divide" else ""
            raise ValueError(
                f"the {name} is not finite even in float64 for this configuration (a division "
                f"by zero or a value outside a function's domain){hint}: nothing to compare"
            )
    outputs = [("forward", got.y, f64.y)]
    outputs += [(k, got.grads[k], f64.grads[k]) for k in names]
    base = "mpsnn float64 cpu"
    checks = [_errors(a, e, tol, GRADIENT_NAMES[k], base) for k, a, e in outputs]
    g = got.geometry
    torch_text, torch_note = None, None
    try:
        out, tgrads, torch_text = _torch_reference(cfg, q, got, cot.value)
    except NoEquivalent as e:
        torch_note = str(e)
    else:
        written = got.y[:, g.dco : g.dco + g.channels_written]
        checks.append(_errors(written, out, tol, "forward", "PyTorch"))
        checks += [
            _errors(got.grads[k], tgrads[k], tol, GRADIENT_NAMES[k], "PyTorch autograd")
            for k in names
        ]
    no_adjoint = fam.no_adjoint(cfg) if names else None
    adjoint = _adjoint(cfg, values, tuple(got.y.shape)) if names and no_adjoint is None else []
    failures = [
        f"{c['name']} vs {c['reference']}: "
        + (c.get("note") or f"relative error {c['relative_error']:.2e} > {c['tolerance']:.0e}")
        for c in checks
        if not c["passed"]
    ]
    failures += [
        f"adjoint test of the {a['name']}: relative difference "
        f"{a['relative_difference']:.2e} > {a['tolerance']:.0e}"
        for a in adjoint
        if not a["passed"]
    ]
    forward_kernel, gradient_kernel = fam.kernel_names(cfg)
    return {
        "family": cfg.family,
        "forward_kernel": forward_kernel,
        "gradient_kernel": gradient_kernel,
        "dtype": str(cfg.dtype).removeprefix("torch."),
        "device": cfg.device,
        "seed": cfg.seed,
        "source_shape": list(g.source),
        "destination_shape": list(g.destination),
        "offset": list(g.offset),
        "offset_from": "--offset"
        if cfg.offset is not None
        else ("the padding policy" if got.padding else "the kernel's default"),
        "padding": got.padding,
        "edge_mode": g.edge.name,
        "torch_equivalent": torch_text,
        "torch_note": torch_note,
        "tolerance": tol,
        "checks": checks,
        "adjoint": adjoint,
        "adjoint_note": no_adjoint,
        "passed": not failures,
        "failures": failures,
    }
