"""The update math of MPS's optimizers (SGD, RMSProp, Adam) over lists of tensors.

Optimizers as two small functions: `init_state` makes a parameter's state vectors once, and one
update rule per optimizer is applied to a whole list of parameters by `apply_update` (for
contiguous float32 CUDA tensors one Triton launch for the whole list, one per gradient dtype
present, `mpsnn.ops.triton.optim`; otherwise a few ``torch._foreach_*`` operations per step).
`sgd_update`, `rmsprop_update` and `adam_update` name the arguments. On the CPU, Adam and
AMSGrad over float32 lists run PyTorch's fused kernel (one pass over each parameter, where the
portable path makes seven): the same function, with ``eps`` rescaled as below, in other
roundings (a few float32 ulps per update; `mpsnn.ops.optim_portable.cpu_fused_adam`).

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
from collections.abc import Sequence
from typing import Any

import torch

from mpsnn.core.capture import keep_for_replays, recording
from mpsnn.core.device import _raw_stream
from mpsnn.ops import triton as fast_paths
from mpsnn.ops.optim_hyper import (
    _ADAM_RULES,
    RegularizationType,
    UpdateRule,
    _check_hyper,
    _check_step,
)
from mpsnn.ops.optim_portable import cpu_fused_adam, portable_update

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
        and cpu_fused_adam(values, grads, results, states, hyper, step, clip, regularization)
    ):
        return
    portable_update(rule, values, grads, results, states, hyper, step, clip, regularization)


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
    """`mpsnn.core.capture.recording` of the update's device (a seam tests replace)."""
    return recording(hyper)


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
