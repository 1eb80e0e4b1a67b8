"""The update math of MPS's optimizers (SGD, RMSProp, Adam) over lists of tensors.

Optimizers as two small functions: `init_state` makes a parameter's state vectors once, and one
update rule per optimizer is applied to a whole list of parameters by `apply_update` (for
contiguous float32 CUDA tensors one Triton launch for the whole list, one per gradient dtype
present, `mpsnn.ops.triton.optim`; otherwise a few ``torch._foreach_*`` operations per step).
`sgd_update`, `rmsprop_update` and `adam_update` name the arguments. On the CPU, Adam and
AMSGrad over float32 lists run PyTorch's fused kernel (one pass over each parameter, where the
portable path makes seven): the same function, with ``eps`` rescaled as below, in other
roundings (a few float32 ulps per update; `_cpu_fused_adam`).

The rules and the regularization types (`UpdateRule`, `RegularizationType`), the
hyperparameter tensor (`Hyper`, `HYPER_SIZE`, `make_hyper`, `set_hyper`), Adam's step tensor
(`make_step`, `set_step`) and the state vectors (`init_state`) live in `mpsnn.ops.optim_hyper`,
which documents their layout; import them from there.

Every gradient ``g`` of a value ``w`` goes through, in order (float32 arithmetic for float32
values, float64 for float64; float16/bfloat16 gradients are read as float32):

1. clipping (``clip=True``): ``g = clamp(g, gradient_clip_min, gradient_clip_max)``;
2. rescaling: ``g = gradient_rescale * g``;
3. regularization: L1 adds ``regularization_scale * sign(w)`` (sign(0) = sign(NaN) = 0), L2 adds
   ``regularization_scale * w``, NONE nothing;
4. the rule, with ``lr`` the learning rate (it may be negative):

   * SGD: ``w_new = w - lr g``. With momentum: ``m = mu m + lr g; w_new = w - m``. Nesterov:
     ``m = mu m + g; w_new = w - lr (g + mu m)``. (torch.optim.SGD keeps ``m = mu m + g`` and
     steps ``w - lr m`` in both cases: the plain momentum differs when ``lr`` changes.)
   * RMSProp: ``s = decay s + (1 - decay) g²; w_new = w - lr g / (sqrt(s) + eps)``; the same as
     torch.optim.RMSprop(alpha=decay, eps, centered=False, momentum=0).
   * Adam: ``t += 1; lr_t = lr sqrt(1 - beta2^t) / (1 - beta1^t)``, ``m = beta1 m + (1 - beta1)
     g``, ``v = beta2 v + (1 - beta2) g²``, ``w_new = w - lr_t m / (sqrt(v) + eps)``; AMSGrad:
     ``vmax = max(vmax, v)`` replaces ``v`` under the root. torch.optim.Adam divides by
     ``sqrt(v) / sqrt(1 - beta2^t) + eps``: MPS's ``eps`` equals torch's
     ``eps / sqrt(1 - beta2^t)``, so they agree only for eps = 0 (or up to that rescaling).
     ``lr_t`` is computed in float64 from the float64 hyperparameters.

The update is out of place: ``w`` is read from ``values`` and ``w_new`` written to ``results``
(each result either is its value tensor, in place, or overlaps no input). State vectors are
updated in place.

CUDA graphs: updates can be captured and replayed. The first update of a list of tensors (same
tensors, same rule and options) checks the lists and builds the Triton kernel's tables. Their
owner is an `UpdatePlans` (each `mpsnn.optim` optimizer holds one; pass it as ``plans=``):
outside a capture it caches them per list and stream, keyed on the addresses, dtypes, shapes and
contiguity of all tensors but the gradients (their addresses and dtypes only) and the current
stream; it holds 64 lists at most, the least recently used going first, and its tables die
with it. Later updates copy nothing from the host and never wait for the device. Gradients at
new addresses at every step (a training graph's gradients are new tensors at every step) cost
a check of the gradients alone (the other lists' checks are kept per list, keyed on everything
but the gradient addresses) and a small copy of the address table, which never waits for the
device either. Without ``plans`` an update checks its lists and builds its tables every time,
and drops them when it returns. A list first seen inside a capture gets tables staged through
pinned host memory for that capture alone. Examples are gradients allocated in the captured
region, as in a compiled training step. The graph copies those tables again at each replay, a
few kilobytes, and they are not cached. Every table a capture records, built there or taken
from the cache, is handed to the capture being recorded (`mpsnn.core.capture.keep_for_replays`):
the captured buffer keeps it for as long as it lives, so neither eviction from the cache nor
the owner's death frees it, and it is freed with the capture. A capture of your own
(``torch.cuda.graph``) that records an update on the Triton path must run inside
`mpsnn.core.capture.keeping_for_replays` and keep the list it yields with the graph (else
`ValueError`). Still run one update with the same rule and options before capturing, so that
the Triton kernel is compiled outside the capture. The portable path needs no warm-up beyond
PyTorch's own. New gradients are always checked (shape, dtype, contiguity against their values).
"""

from __future__ import annotations

import operator
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from mpsnn.core.capture import keep_for_replays
from mpsnn.core.device import _raw_stream
from mpsnn.ops import triton as fast_paths
from mpsnn.ops.optim_hyper import (
    _ADAM_RULES,
    Hyper,
    RegularizationType,
    UpdateRule,
    _check_hyper,
    _check_step,
)

__all__ = [
    "UpdatePlans",
    "adam_update",
    "apply_update",
    "rmsprop_update",
    "sgd_update",
]


# ---------------------------------------------------------------------------------------------
# updates


def sgd_update(
    values: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    results: Sequence[torch.Tensor],
    momenta: Sequence[torch.Tensor] | None,
    hyper: torch.Tensor,
    *,
    nesterov: bool = False,
    clip: bool = False,
    regularization: RegularizationType = RegularizationType.NONE,
    plans: UpdatePlans | None = None,
) -> None:
    """MPSNNOptimizerStochasticGradientDescent: ``w - lr g`` without momenta; with them
    ``m = mu m + lr g, w - m``, or Nesterov's ``m = mu m + g, w - lr (g + mu m)``."""
    if momenta is None:
        if nesterov:
            raise ValueError("[sgd_update] Nesterov momentum needs momentum vectors")
        apply_update(UpdateRule.SGD, values, grads, results, (), hyper,
                     clip=clip, regularization=regularization, plans=plans)  # fmt: skip
        return
    rule = UpdateRule.SGD_NESTEROV if nesterov else UpdateRule.SGD_MOMENTUM
    apply_update(rule, values, grads, results, (momenta,), hyper,
                 clip=clip, regularization=regularization, plans=plans)  # fmt: skip


def rmsprop_update(
    values: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    results: Sequence[torch.Tensor],
    sums_of_squares: Sequence[torch.Tensor],
    hyper: torch.Tensor,
    *,
    clip: bool = False,
    regularization: RegularizationType = RegularizationType.NONE,
    plans: UpdatePlans | None = None,
) -> None:
    """MPSNNOptimizerRMSProp: ``s = decay s + (1 - decay) g², w - lr g / (sqrt(s) + eps)``."""
    apply_update(UpdateRule.RMSPROP, values, grads, results, (sums_of_squares,), hyper,
                 clip=clip, regularization=regularization, plans=plans)  # fmt: skip


def adam_update(
    values: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    results: Sequence[torch.Tensor],
    momenta: Sequence[torch.Tensor],
    velocities: Sequence[torch.Tensor],
    max_velocities: Sequence[torch.Tensor] | None,
    hyper: torch.Tensor,
    step: torch.Tensor,
    *,
    clip: bool = False,
    regularization: RegularizationType = RegularizationType.NONE,
    plans: UpdatePlans | None = None,
) -> None:
    """MPSNNOptimizerAdam (AMSGrad when ``max_velocities`` are given); advances ``step`` once
    for the whole list. See the module docstring for ``lr_t`` and the eps placement."""
    states: tuple[Sequence[torch.Tensor], ...]
    if max_velocities is None:
        rule, states = UpdateRule.ADAM, (momenta, velocities)
    else:
        rule, states = UpdateRule.ADAM_AMSGRAD, (momenta, velocities, max_velocities)
    apply_update(rule, values, grads, results, states, hyper, step,
                 clip=clip, regularization=regularization, plans=plans)  # fmt: skip


@torch.no_grad()
def apply_update(
    rule: UpdateRule,
    values: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    results: Sequence[torch.Tensor],
    states: Sequence[Sequence[torch.Tensor]],
    hyper: torch.Tensor,
    step: torch.Tensor | None = None,
    *,
    clip: bool = False,
    regularization: RegularizationType = RegularizationType.NONE,
    plans: UpdatePlans | None = None,
) -> None:
    """One update of ``rule`` over a list of parameters (the module docstring has the math).

    ``values``, ``results``, ``states[k]`` (one list per entry of ``rule.state_names``): float32,
    or float64 (portable path); ``grads``: float16, bfloat16 or float32 (float64 with float64
    values); same shape per parameter, all on ``hyper``'s device. ``step``: Adam's step tensor.
    ``plans``: the owner of the checks and tables kept between updates (see the module
    docstring); None: nothing is kept past this update (but what a capture records).
    """
    rule = UpdateRule(rule)
    regularization = RegularizationType(regularization)
    _check_hyper(hyper)
    if rule in _ADAM_RULES:
        if step is None:
            raise ValueError(f"[apply_update] {rule.name} needs a step tensor (make_step)")
        _check_step(step)
    if not values:
        if step is not None and rule in _ADAM_RULES:
            step[:1].add_(1)  # an update of nothing still counts
        return
    lists = (values, grads, results, *states)
    fast = _plan(rule, lists, hyper, plans)
    if fast is not None:
        fast.launch(rule, hyper, step, clip, regularization)
        return
    if (
        step is not None  # (Adam's rules have one: checked above)
        and rule in _ADAM_RULES
        and _cpu_fused_adam(values, grads, results, states, hyper, step, clip, regularization)
    ):
        return
    _portable(rule, values, grads, results, states, hyper, step, clip, regularization)


# ---------------------------------------------------------------------------------------------
# checks and the per-list cache

_MAX_PLANS = 64
# what an update takes: values (results and states alike) and, besides those, gradients
VALUE_DTYPES = (torch.float32, torch.float64)
GRADIENT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

_data_ptr = torch.Tensor.data_ptr
_shape = operator.attrgetter("shape")
_dtype = operator.attrgetter("dtype")
_contiguous = torch.Tensor.is_contiguous


class UpdatePlans:
    """The checks and Triton tables of one owner's updates (an optimizer's), kept between its
    updates and freed with it (see the module docstring).

    ``_plans``: tables per list (None: the portable path), keyed on every address, dtype, shape
    and contiguity and the stream; ``_checked``: the lists checked already, keyed on everything
    but the gradient addresses (new gradients of checked lists need only their own check). Both
    hold `_MAX_PLANS` lists at most, the least recently used going first. Tables a capture
    records are the capture's (`mpsnn.core.capture.keep_for_replays`), never entered here."""

    __slots__ = ("__weakref__", "_checked", "_plans")

    def __init__(self) -> None:
        self._plans: OrderedDict[int, tuple[tuple, Any]] = OrderedDict()
        self._checked: OrderedDict[int, tuple] = OrderedDict()

    def __len__(self) -> int:
        """How many lists have their tables (or their portable-path answer) kept."""
        return len(self._plans)

    def clear(self) -> None:
        """Drop every kept check and table (captures keep those they recorded)."""
        self._plans.clear()
        self._checked.clear()


def _stream(device: torch.device) -> int:
    """The current CUDA stream of ``device`` (0 elsewhere)."""
    if device.type != "cuda":
        return 0
    if _raw_stream is not None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        return _raw_stream(index)
    return torch.cuda.current_stream(device).cuda_stream


def _plan(
    rule: UpdateRule,
    lists: tuple[Sequence[torch.Tensor], ...],
    hyper: torch.Tensor,
    plans: UpdatePlans | None,
) -> Any:
    """The Triton tables for ``lists``, or None for the portable path. With ``plans`` the lists
    are checked once per key and the answer kept there. The key (it is built at every step, so
    it is lean): the addresses of every tensor, the shapes of the values (the kernel's element
    counts), the gradient dtypes; the shape of a gradient or state tensor is checked against
    its value's when the key is new.

    CUDA graphs: tables built during a capture are that capture's own (their device contents
    exist once a replay ran): never cached. Every table a capture records, built there or
    cached, is handed to the capture (`_keep_for_capture`), so that neither its eviction nor
    the owner's death frees what the graph reads (`mpsnn.ops.triton.optim`)."""
    if plans is None:
        _check_lists(rule, lists, hyper.device)
        capturing = _capturing(hyper)
        plan = fast_paths.optimizer_tables(lists, capturing=capturing)
        if capturing and plan is not None:
            _keep_for_capture(plan)
        return plan
    others = [t for k, lst in enumerate(lists) if k != 1 for t in lst]
    grads = lists[1]
    # the gradient addresses last: the key without them is the key of the lists' checks.
    # Every other tensor's address, dtype, shape and contiguity are in it (a tensor of another
    # layout at a checked address is checked again), and the stream: tables are copied on the
    # stream that first needs them, and used on that stream only.
    key = (
        fast_paths.enabled(), _stream(hyper.device), *map(len, lists), hyper.device,
        *map(_data_ptr, others), *map(_dtype, others), *map(_shape, others),
        *map(_contiguous, others), *map(_dtype, grads), *map(_contiguous, grads),
        *map(_data_ptr, grads),
    )  # fmt: skip
    h = hash(key)  # hashed once: a long tuple does not cache its hash
    cache = plans._plans
    entry = cache.get(h)
    if entry is not None and entry[0] == key:
        cache.move_to_end(h)
        plan = entry[1]
        if plan is not None and _capturing(hyper):
            _keep_for_capture(plan)  # this capture records the cached tables' addresses
        return plan
    checked = key[: len(key) - len(grads)]
    hc = hash(checked)
    if plans._checked.get(hc) == checked:
        plans._checked.move_to_end(hc)
        _check_lists(rule, lists, hyper.device, only_grads=True)
    else:
        _check_lists(rule, lists, hyper.device)
        plans._checked[hc] = checked
        if len(plans._checked) > _MAX_PLANS:
            plans._checked.popitem(last=False)
    capturing = _capturing(hyper)
    plan = fast_paths.optimizer_tables(lists, capturing=capturing)
    if capturing and plan is not None:
        _keep_for_capture(plan)
        return plan  # staged for this capture and kept by it; not for other uses
    cache[h] = (key, plan)
    if len(cache) > _MAX_PLANS:
        cache.popitem(last=False)
    return plan


def _keep_for_capture(plan: Any) -> None:
    """Hand ``plan`` to the capture being recorded in this thread, which keeps it for its
    replays; raise when no recording of mpsnn's is in progress (nothing would keep it)."""
    if not keep_for_replays(plan):
        raise ValueError(
            "[apply_update] a CUDA graph that records the multi-tensor update must keep its "
            "tables: capture it with CommandBuffer.capture, or inside "
            "mpsnn.core.capture.keeping_for_replays() (keep the list it yields with the "
            "graph), got a capture with neither"
        )


def _capturing(hyper: torch.Tensor) -> bool:
    """Whether a CUDA graph is being captured on the current stream (CUDA tensors only: CPU
    builds of PyTorch have no capture status)."""
    return hyper.is_cuda and torch.cuda.is_current_stream_capturing()


def _check_lists(
    rule: UpdateRule,
    lists: tuple[Sequence[torch.Tensor], ...],
    device: torch.device,
    only_grads: bool = False,
) -> None:
    """Raise unless the lists fit the rule (see `apply_update`); ``only_grads``: the other
    lists passed this check already (the key of `UpdatePlans._checked` covers what it read of
    them)."""
    who = f"[apply_update {rule.name}]"
    names = ("values", "grads", "results", *rule.state_names)
    if len(lists) != len(names):
        raise ValueError(
            f"{who} expects {len(names) - 3} state lists {rule.state_names}, got {len(lists) - 3}"
        )
    n = len(lists[0])
    dtype = lists[0][0].dtype
    if dtype not in VALUE_DTYPES:
        raise TypeError(f"{who} values must be float32 or float64, got {dtype}")
    for name, lst in zip(names, lists, strict=True):
        if only_grads and name != "grads":
            continue
        if len(lst) != n:
            raise ValueError(f"{who} {name} has {len(lst)} tensors, values has {n}")
        for i, t in enumerate(lst):
            if t.device != device:
                raise ValueError(f"{who} {name}[{i}] is on {t.device}, hyper on {device}")
            if t.shape != lists[0][i].shape:
                raise ValueError(
                    f"{who} {name}[{i}] has shape {tuple(t.shape)}, values[{i}] "
                    f"{tuple(lists[0][i].shape)}"
                )
            if name == "grads":
                ok = t.dtype in GRADIENT_DTYPES or t.dtype == dtype
            else:
                ok = t.dtype == dtype
            if not ok:
                raise TypeError(f"{who} {name}[{i}] is {t.dtype} with {dtype} values")


# ---------------------------------------------------------------------------------------------
# the portable path: torch._foreach_* over the lists
#
# Hyperparameters are "scalars": 0-dim device tensors off the CPU (read by the device when the
# work runs: nothing waits, a captured graph follows them), Python floats on the CPU (read for
# free, and they let the CPU use torch's fused foreach ops). Either way they hold the values'
# dtype (float32 for float32 values: MPS computes in float32, and so does the Triton kernel).

_TensorList = list[torch.Tensor]
_Scalar = float | torch.Tensor


def _axpy_(y: _TensorList, x: Sequence[torch.Tensor], a: _Scalar) -> None:
    """``y += a x``."""
    if isinstance(a, torch.Tensor):
        torch._foreach_add_(y, torch._foreach_mul(x, a))  # type: ignore[call-overload]  # lists or tuples, as torch's stubs want
    else:
        torch._foreach_add_(y, x, alpha=a)  # type: ignore[call-overload]  # lists or tuples, as torch's stubs want


def _add_(y: _TensorList, a: _Scalar) -> None:
    """``y += a``."""
    if isinstance(a, torch.Tensor):
        # the 0-dim tensor overload of _foreach_add_ breaks CUDA-graph capture (PyTorch 2.11;
        # that of _foreach_mul_ does not); a list of 0-dim tensors runs tensor by tensor
        torch._foreach_add_(y, [a] * len(y))
    else:
        torch._foreach_add_(y, a)


def _addcmul_(y: _TensorList, x1: _TensorList, x2: _TensorList, a: _Scalar) -> None:
    """``y += a (x1 x2)``."""
    if isinstance(a, torch.Tensor):
        t = torch._foreach_mul(x1, x2)
        torch._foreach_mul_(t, a)
        torch._foreach_add_(y, t)
    else:
        torch._foreach_addcmul_(y, x1, x2, a)


def _addcdiv_(y: _TensorList, x1: _TensorList, x2: _TensorList, a: _Scalar) -> None:
    """``y += a (x1 / x2)``."""
    if isinstance(a, torch.Tensor):
        t = torch._foreach_div(x1, x2)
        torch._foreach_mul_(t, a)
        torch._foreach_add_(y, t)
    else:
        torch._foreach_addcdiv_(y, x1, x2, a)


def _clamped(g: _TensorList, lo: _Scalar, hi: _Scalar) -> _TensorList:
    """``clamp(g, lo, hi)`` as new tensors (NaN stays NaN)."""
    if isinstance(lo, torch.Tensor):
        # no foreach clamp takes tensor bounds; maximum/minimum take a list of 0-dim tensors
        # (one launch per tensor on CUDA, where this path runs only when Triton does not)
        out = torch._foreach_maximum(g, [lo] * len(g))
        torch._foreach_minimum_(out, [hi] * len(g))  # type: ignore[list-item]  # a tensor, as lo
    else:
        out = torch._foreach_maximum(g, lo)
        torch._foreach_minimum_(out, hi)  # type: ignore[arg-type]  # a float, as lo
    return list(out)


def _gradients(
    values: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    h: Sequence[_Scalar],
    clip: bool,
    regularization: RegularizationType,
) -> _TensorList:
    """Clipped, rescaled, regularized gradients, to be read only: new tensors, or on the CPU
    the callers' own when nothing changes them (saves a copy; the callers' are never written)."""
    dt = values[0].dtype
    g = [x if x.dtype == dt else x.to(dt) for x in grads]
    rescale = h[Hyper.GRADIENT_RESCALE]
    if not (clip or regularization or isinstance(rescale, torch.Tensor)) and rescale == 1.0:
        return g
    if clip:
        g = _clamped(g, h[Hyper.GRADIENT_CLIP_MIN], h[Hyper.GRADIENT_CLIP_MAX])
        torch._foreach_mul_(g, h[Hyper.GRADIENT_RESCALE])
    else:
        g = list(torch._foreach_mul(g, h[Hyper.GRADIENT_RESCALE]))
    if regularization == RegularizationType.L1:
        sign = torch._foreach_sign(values)  # type: ignore[arg-type]  # lists or tuples, as torch's stubs want
        _axpy_(g, sign, h[Hyper.REGULARIZATION_SCALE])
    elif regularization == RegularizationType.L2:
        _axpy_(g, values, h[Hyper.REGULARIZATION_SCALE])
    return g


# Each rule: (g, states, h, hyper, step) -> (x, den, c) with w_new = w - c x / den (den None:
# w - c x; c None: w - x), updating the state in place; g is only read.
_Step = tuple[_TensorList, _TensorList | None, _Scalar | None]


def _sgd(g: _TensorList, states, h, hyper, step) -> _Step:
    return g, None, h[Hyper.LEARNING_RATE]


def _sgd_momentum(g: _TensorList, states, h, hyper, step) -> _Step:
    (m,) = states
    torch._foreach_mul_(m, h[Hyper.MOMENTUM_SCALE])
    _axpy_(m, g, h[Hyper.LEARNING_RATE])
    return m, None, None


def _sgd_nesterov(g: _TensorList, states, h, hyper, step) -> _Step:
    (m,) = states
    mu = h[Hyper.MOMENTUM_SCALE]
    torch._foreach_mul_(m, mu)
    torch._foreach_add_(m, g)
    x = list(torch._foreach_mul(m, mu))
    torch._foreach_add_(x, g)
    return x, None, h[Hyper.LEARNING_RATE]


def _rmsprop(g: _TensorList, states, h, hyper, step) -> _Step:
    (s,) = states
    decay = h[Hyper.DECAY]
    torch._foreach_mul_(s, decay)
    _addcmul_(s, g, g, 1 - decay)
    den = list(torch._foreach_sqrt(s))
    _add_(den, h[Hyper.EPSILON])
    return g, den, h[Hyper.LEARNING_RATE]


def _adam(g: _TensorList, states, h, hyper, step) -> _Step:
    m, v = states[0], states[1]
    # t += 1 and lr_t, on the device in float64 (tensor ops: nothing read back to the host)
    step[:1].add_(1)
    corr = 1 - torch.pow(hyper[Hyper.BETA1 : Hyper.BETA2 + 1], step[0])
    lr_t = (hyper[Hyper.LEARNING_RATE] * corr[1].sqrt() / corr[0]).to(g[0].dtype)
    if not isinstance(h[0], torch.Tensor):
        lr_t = lr_t.item()  # the CPU
    b1, b2 = h[Hyper.BETA1], h[Hyper.BETA2]
    torch._foreach_mul_(m, b1)
    _axpy_(m, g, 1 - b1)
    torch._foreach_mul_(v, b2)
    _addcmul_(v, g, g, 1 - b2)
    if len(states) == 3:
        torch._foreach_maximum_(states[2], v)
        den = list(torch._foreach_sqrt(states[2]))
    else:
        den = list(torch._foreach_sqrt(v))
    _add_(den, h[Hyper.EPSILON])
    return m, den, lr_t


# PyTorch's fused Adam (``torch.optim.Adam(fused=True)``'s kernel), where this PyTorch has it
_FUSED_ADAM: Callable[..., None] | None = getattr(torch, "_fused_adam_", None)


def _cpu_fused_adam(
    values: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    results: Sequence[torch.Tensor],
    states: Sequence[Sequence[torch.Tensor]],
    hyper: torch.Tensor,
    step: torch.Tensor,
    clip: bool,
    regularization: RegularizationType,
) -> bool:
    """Adam (AMSGrad with a third state list) on CPU float32 lists as PyTorch's fused kernel:
    one pass over each parameter's tensors, where the portable path makes seven (each a pass
    over memory, the CPU's cost). False, with nothing done, where it does not apply (another
    device or dtype, a non-contiguous tensor, no fused kernel in this PyTorch).

    The same function as the portable path: PyTorch's kernel divides by ``sqrt(v) / sqrt(1 -
    beta2^t) + eps'`` and steps by ``lr / (1 - beta1^t)``, so with ``eps' = eps / sqrt(1 -
    beta2^t)`` its update is ``lr_t m / (sqrt(v) + eps)`` (module docstring). Its roundings
    differ (a few float32 ulps of ``m``, ``v`` and the step)."""
    if _FUSED_ADAM is None or hyper.device.type != "cpu":
        return False
    lists = (values, grads, results, *states)
    for ts in lists:
        for x in ts:
            if x.dtype is not torch.float32 or not x.is_contiguous():
                return False
    h64 = hyper.tolist()  # float64: lr, betas and eps as `_adam` computes lr_t
    b1, b2 = h64[Hyper.BETA1], h64[Hyper.BETA2]
    t = int(step[0]) + 1  # this update's (the CPU: no wait)
    corr2 = 1.0 - b2**t
    if not corr2 > 0.0:  # beta2 >= 1 or NaN: the portable path's arithmetic
        return False
    h32 = hyper.to(torch.float32).tolist()  # the gradients' preparation, as `_portable`'s
    g = _gradients(values, grads, h32, clip, regularization)
    if not all(r is w for r, w in zip(results, values, strict=True)):
        torch._foreach_copy_(list(results), list(values))  # then update the copies
    step[:1].add_(1)
    steps = [torch.tensor(float(t))] * len(values)
    amsgrad = len(states) == 3
    _FUSED_ADAM(
        list(results), list(g), list(states[0]), list(states[1]),
        list(states[2]) if amsgrad else [], steps,
        lr=h64[Hyper.LEARNING_RATE], beta1=b1, beta2=b2, weight_decay=0.0,
        eps=h64[Hyper.EPSILON] / corr2**0.5, amsgrad=amsgrad, maximize=False,
    )  # fmt: skip
    return True


_PORTABLE_RULES: dict[UpdateRule, Callable[..., _Step]] = {
    UpdateRule.SGD: _sgd,
    UpdateRule.SGD_MOMENTUM: _sgd_momentum,
    UpdateRule.SGD_NESTEROV: _sgd_nesterov,
    UpdateRule.RMSPROP: _rmsprop,
    UpdateRule.ADAM: _adam,
    UpdateRule.ADAM_AMSGRAD: _adam,
}


def _portable(
    rule: UpdateRule,
    values: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    results: Sequence[torch.Tensor],
    states: Sequence[Sequence[torch.Tensor]],
    hyper: torch.Tensor,
    step: torch.Tensor | None,
    clip: bool,
    regularization: RegularizationType,
) -> None:
    """The update with ``torch._foreach_*`` ops: a few launches per step whatever the count of
    tensors (on CUDA; the CPU loops over the tensors inside each op)."""
    h_dt = hyper.to(values[0].dtype)  # hyperparameters rounded once to the values' dtype
    h: list[_Scalar] = list(h_dt.unbind()) if h_dt.device.type != "cpu" else h_dt.tolist()
    g = _gradients(values, grads, h, clip, regularization)
    x, den, c = _PORTABLE_RULES[rule](g, [list(s) for s in states], h, hyper, step)
    target = list(results)
    if not all(r is w for r, w in zip(results, values, strict=True)):
        # copy, then update the copy: also right where only some results are their values
        torch._foreach_copy_(target, list(values))
    if c is None:
        torch._foreach_sub_(target, x)
    elif den is None:
        _axpy_(target, x, -c)
    else:
        _addcdiv_(target, x, den, -c)
