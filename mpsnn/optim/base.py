"""The optimizer descriptor and the base `Optimizer` (MPS ``MPSNNOptimizerDescriptor``,
``MPSNNOptimizer``): the options every optimizer shares, the hyperparameters in device memory,
the one update path and the encode forms. The rules (SGD, RMSProp, Adam, with their formulas)
are subclasses in `mpsnn.optim.rules`; `mpsnn.optim` gathers both.

Every gradient goes through, in order: clipping (when on), rescaling, regularization (L1 adds
``scale·sign(w)``, L2 ``scale·w``), then the rule; the math is `mpsnn.ops.optim`.

The hyperparameters live in device memory: `learning_rate` can be changed between steps (also
between replays of a captured step). Adam counts its updates twice: ``time_step``, what a client
reads, advances at each encode (as MPS's ``timeStep``); its device copy, which the bias
correction reads, is written by the recorded work when it runs (and advances at each replay of
a captured step). One encode updates all its tensors with one launch on the GPU (a
multi-tensor Triton kernel, whose device tables the optimizer keeps between its updates and
frees with itself: `mpsnn.ops.optim.UpdatePlans`), few ``torch._foreach`` operations elsewhere.

An encode is **out of place**, as in MPS: it reads the input values and writes the results
(which may be the same tensors). Encode forms, selected by the keywords given:

* vectors: ``input_gradient_vector``, ``input_values_vector``, the rule's state vector(s),
  ``result_values_vector``;
* a convolution: ``convolution_gradient_state``, ``convolution_source_state`` (the weights the
  kernel used), lists of state vectors (index 0 weights, 1 biases; a list of length 1 leaves the
  biases alone), ``result_state`` (a `ConvolutionWeightsAndBiasesState`, may be the source);
* a normalization: ``batch_normalization_state`` (also an instance- or group-normalization
  gradient state: an mpsnn extension), lists of state vectors (0 gamma, 1 beta),
  ``result_state`` (a `NormalizationGammaAndBetaState`).

State vectors are tensors shaped like their parameter (OHWI for convolution weights), or flat
(an ``MPSVector``: one dimension holding the parameter's element count, in that order), on the
optimizer's device and in the values' dtype, updated in place (a flat vector through a view of
it: the client's buffer is what the update writes). Shapes, lengths and dtypes are checked at
encode.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from mpsnn.core._checks import check_enum, check_type
from mpsnn.core.command_buffer import CommandBuffer
from mpsnn.core.device import Device
from mpsnn.core.kernel import Kernel
from mpsnn.ops.optim import (
    GRADIENT_DTYPES,
    VALUE_DTYPES,
    UpdatePlans,
    _capturing,
    apply_update,
)
from mpsnn.ops.optim_hyper import (
    RegularizationType,
    UpdateRule,
    init_state,
    make_hyper,
    set_hyper,
)

__all__ = ["Optimizer", "OptimizerDescriptor"]

Grads = Callable[[], Sequence[torch.Tensor]]


def _number(who: str, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"[{who}] {name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"[{who}] {name} must be finite, got {value}")
    return float(value)


def _ranged(
    who: str, name: str, value: Any, high: float | None = None, *, open_high: bool = False
) -> float:
    """A finite number >= 0 (and <= ``high``, or < it with ``open_high``): torch.optim's
    checks of the same hyperparameters."""
    x = _number(who, name, value)
    if high is None:
        if x < 0:
            raise ValueError(f"[{who}] {name} must be >= 0, got {value}")
    elif x < 0 or x > high or (open_high and x == high):
        bracket = ")" if open_high else "]"
        raise ValueError(f"[{who}] {name} must be in [0, {high:g}{bracket}, got {value}")
    return x


def _descriptor(
    who: str, descriptor: OptimizerDescriptor | None, learning_rate: float | None
) -> OptimizerDescriptor | None:
    """The descriptor of MPS's two initializers: ``initWithDevice:learningRate:`` (the other
    options at their defaults) or the descriptor form; both at once is ambiguous."""
    if learning_rate is None:
        return descriptor
    if descriptor is not None:
        raise ValueError(
            f"[{who}] learning_rate and descriptor must not both be given (the descriptor "
            f"holds the learning rate), got both"
        )
    return OptimizerDescriptor(learning_rate=_number(who, "learning_rate", learning_rate))


class _Encode:
    """One encode of an Adam update: the time step its work runs with. A graph's step program
    (`mpsnn.graph.program`) runs the lowered commands again: each of its steps counts at
    encode and binds its own count here when its work runs."""

    __slots__ = ("t",)

    def __init__(self, t: int) -> None:
        self.t = t


# Open journals (`journal`): each encode that counts a time step is appended to every one.
_JOURNALS: list[list[tuple[Any, _Encode]]] = []


@contextmanager
def journal() -> Iterator[list[tuple[Any, _Encode]]]:
    """The time-step-counting encodes made inside the ``with`` block, as ``(optimizer,
    encode)``: what a recorded step must count again each time it runs without encoding."""
    log: list[tuple[Any, _Encode]] = []
    _JOURNALS.append(log)
    try:
        yield log
    finally:
        _JOURNALS.remove(log)


class OptimizerDescriptor:
    """Options shared by every optimizer (MPS ``MPSNNOptimizerDescriptor``).

    Args:
        learning_rate: finite; may be negative (MPS clients use SGD with a negative rate to
            keep running averages).
        gradient_rescale: multiplies every gradient (after clipping).
        apply_gradient_clipping: clamp gradients to [gradient_clip_min, gradient_clip_max].
        gradient_clip_max, gradient_clip_min: the clamp range; min <= max.
        regularization_type: NONE, L1 (adds ``scale·sign(w)``) or L2 (adds ``scale·w``).
        regularization_scale: the regularization's scale.
    """

    __slots__ = (
        "apply_gradient_clipping",
        "gradient_clip_max",
        "gradient_clip_min",
        "gradient_rescale",
        "learning_rate",
        "regularization_scale",
        "regularization_type",
    )

    def __init__(
        self,
        learning_rate: float = 0.001,
        gradient_rescale: float = 1.0,
        apply_gradient_clipping: bool = False,
        gradient_clip_max: float = 1.0,
        gradient_clip_min: float = -1.0,
        regularization_type: RegularizationType = RegularizationType.NONE,
        regularization_scale: float = 0.0,
    ) -> None:
        who = "OptimizerDescriptor"
        self.learning_rate = _number(who, "learning_rate", learning_rate)
        self.gradient_rescale = _number(who, "gradient_rescale", gradient_rescale)
        self.apply_gradient_clipping = check_type(
            who, "apply_gradient_clipping", apply_gradient_clipping, bool
        )
        self.gradient_clip_max = _number(who, "gradient_clip_max", gradient_clip_max)
        self.gradient_clip_min = _number(who, "gradient_clip_min", gradient_clip_min)
        if self.gradient_clip_min > self.gradient_clip_max:
            raise ValueError(
                f"[{who}] gradient_clip_min must be <= gradient_clip_max, got "
                f"{self.gradient_clip_min} > {self.gradient_clip_max}"
            )
        self.regularization_type = check_enum(
            who, "regularization_type", regularization_type, RegularizationType
        )
        self.regularization_scale = _number(who, "regularization_scale", regularization_scale)

    def copy(self) -> OptimizerDescriptor:
        return OptimizerDescriptor(
            self.learning_rate, self.gradient_rescale, self.apply_gradient_clipping,
            self.gradient_clip_max, self.gradient_clip_min, self.regularization_type,
            self.regularization_scale,
        )  # fmt: skip

    def __repr__(self) -> str:
        return (
            f"OptimizerDescriptor(learning_rate={self.learning_rate}, "
            f"gradient_rescale={self.gradient_rescale}, "
            f"apply_gradient_clipping={self.apply_gradient_clipping}, "
            f"clip=[{self.gradient_clip_min}, {self.gradient_clip_max}], "
            f"regularization={self.regularization_type.name}({self.regularization_scale}))"
        )


class Optimizer(Kernel):
    """Base of the optimizers (MPS ``MPSNNOptimizer``): the descriptor's options, the
    hyperparameters in device memory, and the encode forms (see the module docstring)."""

    _state_keywords: tuple[str, ...] = ()  # the rule's state vectors, as encode keywords

    def __init__(self, device: Device, descriptor: OptimizerDescriptor | None) -> None:
        super().__init__(device)
        who = type(self).__name__
        desc = OptimizerDescriptor() if descriptor is None else descriptor
        check_type(who, "descriptor", desc, OptimizerDescriptor)
        self._desc = desc.copy()
        self._hyper = make_hyper(
            device.torch_device,
            learning_rate=desc.learning_rate,
            gradient_rescale=desc.gradient_rescale,
            gradient_clip_min=desc.gradient_clip_min,
            gradient_clip_max=desc.gradient_clip_max,
            regularization_scale=desc.regularization_scale,
            **self._rule_hyper(),
        )
        self._step: torch.Tensor | None = None
        # the checks and device tables of this optimizer's updates: kept between its updates,
        # freed with it (a capture keeps those it recorded for as long as it lives)
        self._plans = UpdatePlans()

    # -- options (read-only, as MPS, except the learning rate and clipping switch) ----------

    @property
    def learning_rate(self) -> float:
        return self._desc.learning_rate

    @learning_rate.setter
    def learning_rate(self, value: float) -> None:
        self.set_learning_rate(value)

    def set_learning_rate(self, value: float) -> None:
        """The rate of later updates (written to device memory: captured steps follow it)."""
        lr = _number(type(self).__name__, "learning_rate", value)
        set_hyper(self._hyper, learning_rate=lr)
        self._desc.learning_rate = lr

    @property
    def gradient_rescale(self) -> float:
        return self._desc.gradient_rescale

    @property
    def apply_gradient_clipping(self) -> bool:
        return self._desc.apply_gradient_clipping

    @apply_gradient_clipping.setter
    def apply_gradient_clipping(self, value: bool) -> None:
        self._desc.apply_gradient_clipping = check_type(
            type(self).__name__, "apply_gradient_clipping", value, bool
        )

    @property
    def gradient_clip_max(self) -> float:
        return self._desc.gradient_clip_max

    @property
    def gradient_clip_min(self) -> float:
        return self._desc.gradient_clip_min

    @property
    def regularization_type(self) -> RegularizationType:
        return self._desc.regularization_type

    @property
    def regularization_scale(self) -> float:
        return self._desc.regularization_scale

    # -- the rule (subclasses) -----------------------------------------------------------

    def _rule_hyper(self) -> dict[str, float]:
        return {}

    def _rule(self, n_states: int) -> UpdateRule:
        raise NotImplementedError

    def _state_names(self) -> tuple[str, ...]:
        """The state vectors a data source keeps for this optimizer."""
        return self._rule(len(self._state_keywords)).state_names

    # -- the one update path ---------------------------------------------------------------

    def _init_state(self, params: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
        """Zero state vectors for ``params``: one list per state name."""
        rule = self._rule(len(self._state_keywords))
        per_param = [init_state(rule, p) for p in params]
        return [[s[k] for s in per_param] for k in range(len(rule.state_names))]

    def _update(
        self,
        cb: CommandBuffer | None,
        values: Sequence[torch.Tensor],
        grads: Grads,
        results: Sequence[torch.Tensor],
        states: Sequence[Sequence[torch.Tensor]],
    ) -> None:
        """Update ``values`` into ``results`` with the gradients ``grads()`` (read when the
        update runs), now (``cb`` None: the CPU update path) or as recorded work."""
        who = type(self).__name__
        rule = self._rule(len(states))
        dev = self._device.torch_device
        # device indices compared (-1: the CPU): no torch.device made per tensor, for the
        # dozens of tensors a training graph's grouped update checks at every step
        index = -1 if dev.index is None else dev.index
        for t in (*values, *results, *(v for s in states for v in s)):
            if t.get_device() != index:
                raise ValueError(
                    f"[{who}] tensors must be on the optimizer's device {dev}, got one on "
                    f"{t.device}"
                )
        _check_dtypes(who, values, results, states)
        if cb is not None:
            self._check_command_buffer(cb)
        hyper, clip = self._hyper, self._desc.apply_gradient_clipping
        reg = self._desc.regularization_type
        step = self._adam_step() if rule.name.startswith("ADAM") else None
        values, results = list(values), list(results)
        states = [list(s) for s in states]
        encode = self._count_encode()  # Adam: time_step advances now, at encode (as MPS)
        plans = self._plans

        narrow = values[0].dtype if values and values[0].dtype is not torch.float64 else None

        def run() -> None:
            g = list(grads())
            if narrow is not None:
                # gradient sums wider than the values: a FLOAT64 graph over float32 data
                # sources sums in float64; the update reads them in the values' precision (an
                # explicit gradient tensor of another dtype is refused at encode instead)
                g = [x.to(narrow) if x.dtype is torch.float64 else x for x in g]
            if encode is not None and not _capturing(hyper):
                # the device copy takes this encode's count (the update adds one); captured
                # work only adds one, so each replay advances it
                step[:1].fill_(encode.t - 1)  # type: ignore[index]
            apply_update(rule, values, g, results, states, hyper, step,
                         clip=clip, regularization=reg, plans=plans)  # fmt: skip

        if cb is None:
            run()
        else:
            cb.record(f"{who}.update", run)

    def _adam_step(self) -> torch.Tensor:
        raise NotImplementedError

    def _count_encode(self) -> _Encode | None:
        """Count one encode (Adam's ``time_step``); None for rules without a step."""
        return None

    def _recount(self, encode: _Encode) -> None:
        """Count ``encode`` again: its recorded work is re-armed or replayed as a new encode
        (Adam: ``time_step`` advances and the work runs with the new count)."""
        raise NotImplementedError

    # -- encode forms -----------------------------------------------------------------------

    def _encode(self, cb: CommandBuffer, form: dict[str, Any], vectors: dict[str, Any]) -> None:
        who = type(self).__name__
        self._check_command_buffer(cb)
        given = {k for k, v in form.items() if v is not None}
        if given == {"input_gradient_vector", "input_values_vector", "result_values_vector"}:
            self._encode_vectors(cb, form, vectors)
        elif given <= {
            "convolution_gradient_state",
            "convolution_source_state",
            "result_state",
        } and ("convolution_gradient_state" in given):
            self._encode_convolution(cb, form, vectors)
        elif given <= {"batch_normalization_state", "result_state"} and (
            "batch_normalization_state" in given
        ):
            self._encode_normalization(cb, form, vectors)
        else:
            raise ValueError(
                f"[{who}] encode needs input_gradient_vector, input_values_vector and "
                "result_values_vector; or convolution_gradient_state (with "
                "convolution_source_state and result_state); or batch_normalization_state "
                f"(with result_state), got {sorted(given)}"
            )

    def _vectors(
        self,
        vectors: dict[str, Any],
        params: Sequence[torch.Tensor],
        *,
        lists: bool,
        ohwi: bool = False,
    ) -> list[list[Any]]:
        """The state vectors given, per state keyword (the rule's ones, in order), shaped
        like ``params`` (see `_shaped`; ``ohwi``: 4-D params are OIHW convolution weights
        whose vectors clients pass OHWI); one per parameter."""
        who = type(self).__name__
        count = len(params)
        out = []
        for key in self._state_keywords:
            v = vectors.get(key + ("s" if lists else ""))
            if v is None:
                continue
            v = list(v) if lists else [v]
            if len(v) < count:
                raise ValueError(
                    f"[{who}] {key}{'s' if lists else ''} must hold {count} tensors (one per "
                    f"updated parameter), got {len(v)}"
                )
            shaped = []
            for i, (t, p) in enumerate(zip(v[:count], params, strict=True)):
                name = f"{key}s[{i}]" if lists else key
                t = check_type(who, name, t, torch.Tensor)
                shaped.append(_shaped(who, name, t, p, ohwi))
            out.append(shaped)
        return out

    def _encode_vectors(self, cb: CommandBuffer, form: dict[str, Any], vectors: dict) -> None:
        who = type(self).__name__
        g = check_type(who, "input_gradient_vector", form["input_gradient_vector"], torch.Tensor)
        w = check_type(who, "input_values_vector", form["input_values_vector"], torch.Tensor)
        r = check_type(who, "result_values_vector", form["result_values_vector"], torch.Tensor)
        for name, t in (("input_gradient_vector", g), ("result_values_vector", r)):
            if t.shape != w.shape:
                raise ValueError(
                    f"[{who}] {name} must have the values' shape {tuple(w.shape)}, "
                    f"got {tuple(t.shape)}"
                )
        _check_gradient_dtype(who, "input_gradient_vector", g, w.dtype)
        states = self._vectors(vectors, [w], lists=False)
        self._update(cb, [w], lambda: [g], [r], states)

    def _encode_convolution(self, cb: CommandBuffer, form: dict[str, Any], vectors: dict) -> None:
        who = type(self).__name__
        gs = form["convolution_gradient_state"]
        # the type's attribute, not the state's: reading the property would materialize zero
        # sums at encode time, which the gradient would then add into instead of storing (a
        # captured step then accumulated across replays)
        if not hasattr(type(gs), "gradient_for_weights") or not hasattr(gs, "_oihw"):
            raise TypeError(
                f"[{who}] convolution_gradient_state must be a ConvolutionGradientState, "
                f"got {type(gs).__name__}"
            )
        src, res = form.get("convolution_source_state"), form.get("result_state")
        for name, st in (("convolution_source_state", src), ("result_state", res)):
            if st is None or not hasattr(st, "_oihw"):
                raise TypeError(
                    f"[{who}] {name} must be a ConvolutionWeightsAndBiasesState, "
                    f"got {type(st).__name__}"
                )
            if tuple(st._oihw.shape) != gs._oihw:
                raise ValueError(
                    f"[{who}] {name} must hold weights of the convolution's shape "
                    f"(OIHW {gs._oihw}), got {tuple(st._oihw.shape)}"
                )
        count = 2 if (src._biases is not None and res._biases is not None) else 1
        count = min(count, _given_length(vectors, self._state_keywords, count))
        values = [src._oihw, src._biases][:count]
        results = [res._oihw, res._biases][:count]
        states = self._vectors(vectors, values, lists=True, ohwi=True)
        self._update(cb, values, lambda: [gs._sum(i) for i in range(count)], results, states)

    def _encode_normalization(self, cb: CommandBuffer, form: dict, vectors: dict) -> None:
        who = type(self).__name__
        st, res = form["batch_normalization_state"], form.get("result_state")
        if not hasattr(st, "_gamma_beta_gradients"):
            raise TypeError(
                f"[{who}] batch_normalization_state must be a normalization state with "
                f"gamma/beta gradients, got {type(st).__name__}"
            )
        if res is None or not hasattr(res, "gamma"):
            raise TypeError(
                f"[{who}] result_state must be a NormalizationGammaAndBetaState, "
                f"got {type(res).__name__}"
            )
        count = _given_length(vectors, self._state_keywords, 2)
        grads = st._gamma_beta_gradients(who)
        values = [st.gamma, st.beta][:count]
        results = [res.gamma, res.beta][:count]
        states = self._vectors(vectors, values, lists=True)
        self._update(cb, values, lambda: list(grads())[:count], results, states)


def _given_length(vectors: dict[str, Any], keys: tuple[str, ...], default: int) -> int:
    """How many parameters the state-vector lists cover (a list of length 1 leaves the
    biases, or beta, alone); ``default`` when no list is given."""
    for key in keys:
        v = vectors.get(key + "s")
        if v is not None:
            return min(len(v), default)
    return default


def _shaped(who: str, name: str, t: torch.Tensor, value: torch.Tensor, ohwi: bool) -> torch.Tensor:
    """State vector ``t`` as a view shaped like ``value``, the parameter it updates: ``t``
    shaped like it (with ``ohwi``, 4-D values are convolution weights held OIHW, whose
    vectors clients pass OHWI); or flat (an ``MPSVector``), holding the parameter's elements
    in that same order. A view, never a copy: the update writes the client's memory."""
    shape = value.shape
    ohwi = ohwi and value.dim() == 4
    if ohwi:
        o, i, kh, kw = shape
        public = (o, kh, kw, i)  # OHWI, the layout of MPS's weights and of the state vectors
    else:
        public = tuple(shape)
    if tuple(t.shape) == public:
        return t.permute(0, 3, 1, 2) if ohwi else t
    if t.dim() == 1 and value.dim() != 1:
        if t.numel() != value.numel():
            raise ValueError(
                f"[{who}] {name} must hold {value.numel()} elements (the parameter's count, "
                f"shape {public}) when flat, got {t.numel()}"
            )
        try:
            view = t.view(public)
        except RuntimeError:
            raise ValueError(
                f"[{who}] {name} must be viewable as {public} (a flat vector with one stride), "
                f"got stride {t.stride()}"
            ) from None
        return view.permute(0, 3, 1, 2) if ohwi else view
    if t.dim() == 1 and value.dim() == 1:
        raise ValueError(
            f"[{who}] {name} must hold {value.numel()} elements (the parameter's count), got "
            f"{t.numel()}"
        )
    raise ValueError(
        f"[{who}] {name} must have the parameter's shape {public} or be flat with "
        f"{value.numel()} elements, got shape {tuple(t.shape)}"
    )


def _check_dtypes(
    who: str,
    values: Sequence[torch.Tensor],
    results: Sequence[torch.Tensor],
    states: Sequence[Sequence[torch.Tensor]],
) -> None:
    """Values float32 or float64; results and state vectors in the values' dtype (checked
    at encode: the update would fail only when it runs)."""
    if not values:
        return
    dt = values[0].dtype
    if dt not in VALUE_DTYPES:
        raise TypeError(f"[{who}] values must be float32 or float64, got {dt}")
    for name, group in (("values", values), ("result_values_vector", results)):
        for t in group:
            if t.dtype != dt:
                raise TypeError(f"[{who}] {name} must have the values' dtype {dt}, got {t.dtype}")
    for s in states:
        for t in s:
            if t.dtype != dt:
                raise TypeError(
                    f"[{who}] state vectors must have the values' dtype {dt}, got {t.dtype}"
                )


def _check_gradient_dtype(who: str, name: str, g: torch.Tensor, dt: torch.dtype) -> None:
    """Gradients: float16, bfloat16, float32, or the values' dtype."""
    if g.dtype not in GRADIENT_DTYPES and g.dtype != dt:
        raise TypeError(
            f"[{who}] {name} must be float16, bfloat16, float32 or the values' dtype {dt}, "
            f"got {g.dtype}"
        )
