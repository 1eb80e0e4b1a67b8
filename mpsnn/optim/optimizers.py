"""Optimizers (MPS ``MPSNNOptimizerDescriptor``, ``MPSNNOptimizerStochasticGradientDescent``,
``MPSNNOptimizerRMSProp``, ``MPSNNOptimizerAdam``).

Every gradient goes through, in order: clipping (when on), rescaling, regularization (L1 adds
``scale·sign(w)``, L2 ``scale·w``), then the rule; the math is `mpsnn.ops.optim`:

* SGD: ``m = μm + lr·g, w -= m``; Nesterov ``m = μm + g, w -= lr(g + μm)``; without momentum
  vectors ``w -= lr·g``. (torch.optim.SGD keeps ``m = μm + g`` and steps ``w -= lr·m``: the
  two differ when the learning rate changes between steps.)
* RMSProp: ``s = d·s + (1 - d)g², w -= lr·g/(sqrt(s) + ε)`` (torch.optim.RMSprop with
  ``alpha = d``, not centered, no momentum, computes the same).
* Adam: per encode ``t += 1``, ``lr_t = lr·sqrt(1 - β2^t)/(1 - β1^t)``, ``m = β1m + (1 - β1)g``,
  ``v = β2v + (1 - β2)g²``, ``w -= lr_t·m/(sqrt(v) + ε)``; with maximum-velocity vectors,
  AMSGrad (``v̂ = max(v̂, v)`` under the root). torch.optim.Adam puts ε after the bias
  correction: MPS's ε equals torch's ``ε/sqrt(1 - β2^t)``.

The hyperparameters and Adam's step count live in device memory: `learning_rate` can be
changed between steps (also between replays of a captured step), and ``t`` advances on the
device. One encode updates all its tensors with one launch on the GPU (a multi-tensor Triton
kernel), few ``torch._foreach`` operations elsewhere.

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

State vectors are tensors shaped like their parameter (OHWI for convolution weights), on the
optimizer's device, updated in place.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from mpsnn.core._checks import check_enum, check_type
from mpsnn.core.device import CommandBuffer, Device
from mpsnn.core.kernel import Kernel
from mpsnn.ops.optim import (
    RegularizationType,
    UpdateRule,
    apply_update,
    init_state,
    make_hyper,
    make_step,
    set_hyper,
    set_step,
)

__all__ = ["SGD", "Adam", "Optimizer", "OptimizerDescriptor", "RMSProp", "RegularizationType"]

Grads = Callable[[], Sequence[torch.Tensor]]


def _number(who: str, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"[{who}] {name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"[{who}] {name} must be finite, got {value}")
    return float(value)


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
        for t in (*values, *results, *(v for s in states for v in s)):
            if t.device != dev:
                raise ValueError(
                    f"[{who}] tensors must be on the optimizer's device {dev}, got one on "
                    f"{t.device}"
                )
        hyper, clip = self._hyper, self._desc.apply_gradient_clipping
        reg = self._desc.regularization_type
        step = self._adam_step() if rule.name.startswith("ADAM") else None
        values, results = list(values), list(results)
        states = [list(s) for s in states]

        def run() -> None:
            g = list(grads())
            apply_update(
                rule, values, g, results, states, hyper, step, clip=clip, regularization=reg
            )

        if cb is None:
            run()
        else:
            self._check_command_buffer(cb)
            cb.record(f"{who}.update", run)

    def _adam_step(self) -> torch.Tensor:
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

    def _vectors(self, vectors: dict[str, Any], count: int, *, lists: bool) -> list[list[Any]]:
        """The state vectors given, per state keyword (the rule's ones, in order)."""
        who = type(self).__name__
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
            for t in v[:count]:
                check_type(who, key, t, torch.Tensor)
            out.append(v[:count])
        return out

    def _encode_vectors(self, cb: CommandBuffer, form: dict[str, Any], vectors: dict) -> None:
        who = type(self).__name__
        g = check_type(who, "input_gradient_vector", form["input_gradient_vector"], torch.Tensor)
        w = check_type(who, "input_values_vector", form["input_values_vector"], torch.Tensor)
        r = check_type(who, "result_values_vector", form["result_values_vector"], torch.Tensor)
        states = self._vectors(vectors, 1, lists=False)
        for name, t in (("input_gradient_vector", g), ("result_values_vector", r)):
            if t.shape != w.shape:
                raise ValueError(
                    f"[{who}] {name} must have the values' shape {tuple(w.shape)}, "
                    f"got {tuple(t.shape)}"
                )
        for s in states:
            if s[0].shape != w.shape:
                raise ValueError(
                    f"[{who}] state vectors must have the values' shape {tuple(w.shape)}, got "
                    f"{tuple(s[0].shape)}"
                )
        self._update(cb, [w], lambda: [g], [r], states)

    def _encode_convolution(self, cb: CommandBuffer, form: dict[str, Any], vectors: dict) -> None:
        who = type(self).__name__
        gs = form["convolution_gradient_state"]
        if not hasattr(gs, "gradient_for_weights") or not hasattr(gs, "_oihw"):
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
        states = [[_oihw(t) for t in s] for s in self._vectors(vectors, count, lists=True)]
        values = [src._oihw, src._biases][:count]
        results = [res._oihw, res._biases][:count]
        self._update(cb, values, lambda: [gs._sum(0), gs._sum(1)][:count], results, states)

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
        states = self._vectors(vectors, count, lists=True)
        grads = st._gamma_beta_gradients(who)
        values = [st.gamma, st.beta][:count]
        results = [res.gamma, res.beta][:count]
        self._update(cb, values, lambda: list(grads())[:count], results, states)


def _given_length(vectors: dict[str, Any], keys: tuple[str, ...], default: int) -> int:
    """How many parameters the state-vector lists cover (a list of length 1 leaves the
    biases, or beta, alone); ``default`` when no list is given."""
    for key in keys:
        v = vectors.get(key + "s")
        if v is not None:
            return min(len(v), default)
    return default


def _oihw(t: torch.Tensor) -> torch.Tensor:
    """An OHWI state vector as the OIHW view the update works on (biases stay as they are)."""
    return t.permute(0, 3, 1, 2) if t.dim() == 4 else t


class SGD(Optimizer):
    """Stochastic gradient descent (MPS ``MPSNNOptimizerStochasticGradientDescent``).

    Args:
        device: the optimizer's device.
        momentum_scale: μ (0: plain SGD when no momentum vectors are passed).
        use_nesterov_momentum: Nesterov's update (needs momentum vectors).
        descriptor: the common options (None: `OptimizerDescriptor()` defaults).
    """

    _state_keywords = ("input_momentum_vector",)

    def __init__(
        self,
        device: Device,
        momentum_scale: float = 0.0,
        use_nesterov_momentum: bool = False,
        descriptor: OptimizerDescriptor | None = None,
    ) -> None:
        self._momentum = _number("SGD", "momentum_scale", momentum_scale)
        self._nesterov = check_type("SGD", "use_nesterov_momentum", use_nesterov_momentum, bool)
        super().__init__(device, descriptor)

    @property
    def momentum_scale(self) -> float:
        return self._momentum

    @property
    def use_nesterov_momentum(self) -> bool:
        return self._nesterov

    def _rule_hyper(self) -> dict[str, float]:
        return {"momentum_scale": self._momentum}

    def _rule(self, n_states: int) -> UpdateRule:
        if n_states == 0:  # no momentum vectors: w -= lr·g
            return UpdateRule.SGD
        return UpdateRule.SGD_NESTEROV if self._nesterov else UpdateRule.SGD_MOMENTUM

    def _state_names(self) -> tuple[str, ...]:
        keep = self._momentum != 0 or self._nesterov
        return self._rule(1 if keep else 0).state_names

    def _init_state(self, params: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
        if not (self._momentum != 0 or self._nesterov):
            return []  # plain SGD keeps no vectors
        return super()._init_state(params)

    def encode(
        self,
        command_buffer: CommandBuffer,
        *,
        input_gradient_vector: torch.Tensor | None = None,
        input_values_vector: torch.Tensor | None = None,
        input_momentum_vector: torch.Tensor | None = None,
        result_values_vector: torch.Tensor | None = None,
        convolution_gradient_state: Any = None,
        convolution_source_state: Any = None,
        batch_normalization_state: Any = None,
        input_momentum_vectors: Sequence[torch.Tensor] | None = None,
        result_state: Any = None,
    ) -> None:
        """One update (see the module docstring for the forms); without momentum vectors the
        update is ``w -= lr·g``. Nesterov needs momentum vectors."""
        vectors = {
            "input_momentum_vector": input_momentum_vector,
            "input_momentum_vectors": input_momentum_vectors,
        }
        if self._nesterov and input_momentum_vector is None and input_momentum_vectors is None:
            raise ValueError(
                "[SGD] use_nesterov_momentum needs momentum vectors "
                "(input_momentum_vector or input_momentum_vectors), got none"
            )
        self._encode(
            command_buffer,
            {
                "input_gradient_vector": input_gradient_vector,
                "input_values_vector": input_values_vector,
                "result_values_vector": result_values_vector,
                "convolution_gradient_state": convolution_gradient_state,
                "convolution_source_state": convolution_source_state,
                "batch_normalization_state": batch_normalization_state,
                "result_state": result_state,
            },
            vectors,
        )

    def __repr__(self) -> str:
        return f"SGD(momentum_scale={self._momentum}, nesterov={self._nesterov}, {self._desc!r})"


class RMSProp(Optimizer):
    """RMSProp (MPS ``MPSNNOptimizerRMSProp``): ``s = d·s + (1 - d)g²``,
    ``w -= lr·g/(sqrt(s) + ε)``.

    Args:
        device: the optimizer's device.
        decay: d, in [0, 1].
        epsilon: ε (outside the square root).
        descriptor: the common options.
    """

    _state_keywords = ("input_sum_of_squares_vector",)

    def __init__(
        self,
        device: Device,
        decay: float = 0.9,
        epsilon: float = 1e-8,
        descriptor: OptimizerDescriptor | None = None,
    ) -> None:
        self._decay = _number("RMSProp", "decay", decay)
        self._epsilon = _number("RMSProp", "epsilon", epsilon)
        super().__init__(device, descriptor)

    @property
    def decay(self) -> float:
        return self._decay

    @property
    def epsilon(self) -> float:
        return self._epsilon

    def _rule_hyper(self) -> dict[str, float]:
        return {"decay": self._decay, "epsilon": self._epsilon}

    def _rule(self, n_states: int) -> UpdateRule:
        return UpdateRule.RMSPROP

    def encode(
        self,
        command_buffer: CommandBuffer,
        *,
        input_gradient_vector: torch.Tensor | None = None,
        input_values_vector: torch.Tensor | None = None,
        input_sum_of_squares_vector: torch.Tensor | None = None,
        result_values_vector: torch.Tensor | None = None,
        convolution_gradient_state: Any = None,
        convolution_source_state: Any = None,
        batch_normalization_state: Any = None,
        input_sum_of_squares_vectors: Sequence[torch.Tensor] | None = None,
        result_state: Any = None,
    ) -> None:
        """One update; the sum-of-squares vector(s) are required."""
        if input_sum_of_squares_vector is None and input_sum_of_squares_vectors is None:
            raise ValueError("[RMSProp] encode needs input_sum_of_squares_vector(s), got none")
        self._encode(
            command_buffer,
            {
                "input_gradient_vector": input_gradient_vector,
                "input_values_vector": input_values_vector,
                "result_values_vector": result_values_vector,
                "convolution_gradient_state": convolution_gradient_state,
                "convolution_source_state": convolution_source_state,
                "batch_normalization_state": batch_normalization_state,
                "result_state": result_state,
            },
            {
                "input_sum_of_squares_vector": input_sum_of_squares_vector,
                "input_sum_of_squares_vectors": input_sum_of_squares_vectors,
            },
        )

    def __repr__(self) -> str:
        return f"RMSProp(decay={self._decay}, epsilon={self._epsilon}, {self._desc!r})"


class Adam(Optimizer):
    """Adam (MPS ``MPSNNOptimizerAdam``), AMSGrad when maximum-velocity vectors are given.

    Args:
        device: the optimizer's device.
        beta1, beta2: the moment decays, in [0, 1).
        epsilon: ε (outside the square root, before the bias correction: see the module).
        time_step: updates done so far (the next encode uses ``time_step + 1``).
        descriptor: the common options.
        amsgrad: the state vectors a data source keeps include maximum velocities.
    """

    _state_keywords = ("input_momentum_vector", "input_velocity_vector", "maximum_velocity_vector")

    def __init__(
        self,
        device: Device,
        beta1: float = 0.9,
        beta2: float = 0.999,
        epsilon: float = 1e-8,
        time_step: int = 0,
        descriptor: OptimizerDescriptor | None = None,
        *,
        amsgrad: bool = False,
    ) -> None:
        who = "Adam"
        self._beta1 = _number(who, "beta1", beta1)
        self._beta2 = _number(who, "beta2", beta2)
        self._epsilon = _number(who, "epsilon", epsilon)
        if isinstance(time_step, bool) or not isinstance(time_step, int) or time_step < 0:
            raise ValueError(f"[{who}] time_step must be an int >= 0, got {time_step!r}")
        self._amsgrad = check_type(who, "amsgrad", amsgrad, bool)
        super().__init__(device, descriptor)
        self._step = make_step(device.torch_device, time_step)

    @property
    def beta1(self) -> float:
        return self._beta1

    @property
    def beta2(self) -> float:
        return self._beta2

    @property
    def epsilon(self) -> float:
        return self._epsilon

    @property
    def time_step(self) -> int:
        """Updates done so far (reads device memory: waits for the updates in flight)."""
        return int(self._step[0].item())

    @time_step.setter
    def time_step(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"[Adam] time_step must be an int >= 0, got {value!r}")
        set_step(self._step, value)

    def _rule_hyper(self) -> dict[str, float]:
        return {"beta1": self._beta1, "beta2": self._beta2, "epsilon": self._epsilon}

    def _rule(self, n_states: int) -> UpdateRule:
        return UpdateRule.ADAM_AMSGRAD if n_states >= 3 else UpdateRule.ADAM

    def _state_names(self) -> tuple[str, ...]:
        return self._rule(3 if self._amsgrad else 2).state_names

    def _init_state(self, params: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
        state = super()._init_state(params)  # momentum, velocity, maximum velocity
        return state if self._amsgrad else state[:2]

    def _adam_step(self) -> torch.Tensor:
        assert self._step is not None  # made by __init__
        return self._step

    def encode(
        self,
        command_buffer: CommandBuffer,
        *,
        input_gradient_vector: torch.Tensor | None = None,
        input_values_vector: torch.Tensor | None = None,
        input_momentum_vector: torch.Tensor | None = None,
        input_velocity_vector: torch.Tensor | None = None,
        maximum_velocity_vector: torch.Tensor | None = None,
        result_values_vector: torch.Tensor | None = None,
        convolution_gradient_state: Any = None,
        convolution_source_state: Any = None,
        batch_normalization_state: Any = None,
        input_momentum_vectors: Sequence[torch.Tensor] | None = None,
        input_velocity_vectors: Sequence[torch.Tensor] | None = None,
        maximum_velocity_vectors: Sequence[torch.Tensor] | None = None,
        result_state: Any = None,
    ) -> None:
        """One update: ``time_step`` advances by one (weights and biases together count once)."""
        single = (input_momentum_vector, input_velocity_vector)
        lists = (input_momentum_vectors, input_velocity_vectors)
        if any(v is None for v in single) and any(v is None for v in lists):
            raise ValueError(
                "[Adam] encode needs momentum and velocity vectors (input_momentum_vector and "
                "input_velocity_vector, or the *_vectors lists), got "
                f"{sum(v is not None for v in (*single, *lists))} of them"
            )
        self._encode(
            command_buffer,
            {
                "input_gradient_vector": input_gradient_vector,
                "input_values_vector": input_values_vector,
                "result_values_vector": result_values_vector,
                "convolution_gradient_state": convolution_gradient_state,
                "convolution_source_state": convolution_source_state,
                "batch_normalization_state": batch_normalization_state,
                "result_state": result_state,
            },
            {
                "input_momentum_vector": input_momentum_vector,
                "input_velocity_vector": input_velocity_vector,
                "maximum_velocity_vector": maximum_velocity_vector,
                "input_momentum_vectors": input_momentum_vectors,
                "input_velocity_vectors": input_velocity_vectors,
                "maximum_velocity_vectors": maximum_velocity_vectors,
            },
        )

    def __repr__(self) -> str:
        return (
            f"Adam(beta1={self._beta1}, beta2={self._beta2}, epsilon={self._epsilon}, "
            f"amsgrad={self._amsgrad}, {self._desc!r})"
        )
