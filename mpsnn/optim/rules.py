"""The optimizer rules (MPS ``MPSNNOptimizerStochasticGradientDescent``,
``MPSNNOptimizerRMSProp``, ``MPSNNOptimizerAdam``): subclasses of `Optimizer`
(`mpsnn.optim.base`, which has the encode forms) that hold the rule's hyperparameters, pick
its `UpdateRule` from the state vectors given, and spell out its ``encode`` keywords. After
clipping, rescaling and regularization, the math of `mpsnn.ops.optim`:

* SGD: ``m = μm + lr·g, w -= m``; Nesterov ``m = μm + g, w -= lr(g + μm)``; without momentum
  vectors ``w -= lr·g``. (torch.optim.SGD keeps ``m = μm + g`` and steps ``w -= lr·m``: the
  two differ when the learning rate changes between steps.)
* RMSProp: ``s = d·s + (1 - d)g², w -= lr·g/(sqrt(s) + ε)`` (torch.optim.RMSprop with
  ``alpha = d``, not centered, no momentum, computes the same).
* Adam: per encode ``t += 1`` (``time_step``; `Adam` has its device copy),
  ``lr_t = lr·sqrt(1 - β2^t)/(1 - β1^t)``, ``m = β1m + (1 - β1)g``,
  ``v = β2v + (1 - β2)g²``, ``w -= lr_t·m/(sqrt(v) + ε)``; with maximum-velocity vectors,
  AMSGrad (``v̂ = max(v̂, v)`` under the root). torch.optim.Adam puts ε after the bias
  correction: MPS's ε equals torch's ``ε/sqrt(1 - β2^t)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mpsnn.core._checks import check_type
from mpsnn.core.command_buffer import CommandBuffer
from mpsnn.core.device import Device
from mpsnn.ops.optim_hyper import UpdateRule, make_step, set_step
from mpsnn.optim.base import (
    _JOURNALS,
    Optimizer,
    OptimizerDescriptor,
    _descriptor,
    _Encode,
    _ranged,
)

__all__ = ["SGD", "Adam", "RMSProp"]


class SGD(Optimizer):
    """Stochastic gradient descent (MPS ``MPSNNOptimizerStochasticGradientDescent``).

    Args:
        device: the optimizer's device.
        momentum_scale: μ >= 0 (0: plain SGD when no momentum vectors are passed).
        use_nesterov_momentum: Nesterov's update (needs momentum vectors).
        descriptor: the common options (None: `OptimizerDescriptor()` defaults).
        learning_rate: MPS's ``initWithDevice:learningRate:``: the common options at their
            defaults with this learning rate (give it or ``descriptor``, not both).
    """

    _state_keywords = ("input_momentum_vector",)

    def __init__(
        self,
        device: Device,
        momentum_scale: float = 0.0,
        use_nesterov_momentum: bool = False,
        descriptor: OptimizerDescriptor | None = None,
        *,
        learning_rate: float | None = None,
    ) -> None:
        self._momentum = _ranged("SGD", "momentum_scale", momentum_scale)
        self._nesterov = check_type("SGD", "use_nesterov_momentum", use_nesterov_momentum, bool)
        super().__init__(device, _descriptor("SGD", descriptor, learning_rate))

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
        """One update (see `mpsnn.optim.base` for the forms); without momentum vectors the
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
        epsilon: ε >= 0 (outside the square root).
        descriptor: the common options.
        learning_rate: ``initWithDevice:learningRate:`` (give it or ``descriptor``).
    """

    _state_keywords = ("input_sum_of_squares_vector",)

    def __init__(
        self,
        device: Device,
        decay: float = 0.9,
        epsilon: float = 1e-8,
        descriptor: OptimizerDescriptor | None = None,
        *,
        learning_rate: float | None = None,
    ) -> None:
        self._decay = _ranged("RMSProp", "decay", decay, 1.0)
        self._epsilon = _ranged("RMSProp", "epsilon", epsilon)
        super().__init__(device, _descriptor("RMSProp", descriptor, learning_rate))

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
        epsilon: ε >= 0 (outside the square root, before the bias correction: see the module).
        time_step: updates encoded so far (the next encode uses ``time_step + 1``).
        descriptor: the common options.
        amsgrad: the state vectors a data source keeps include maximum velocities.
        learning_rate: ``initWithDevice:learningRate:`` (give it or ``descriptor``).

    Two counters, as MPS counts at encode while the work runs later:

    * ``time_step`` (what a client reads and sets, MPS ``timeStep``) advances when an update
      is **encoded**: once per ``encode`` (a convolution state's weights and biases together
      count once) and once per update a graph step encodes for all the layers sharing this
      optimizer. An encode on a command buffer that is never committed still counts. Setting
      it between encodes sets the base of the next encode (which uses ``time_step + 1``).
      A graph step run from its step program (`Graph.reuse_step`) and a replay of a
      `CompiledGraph` count as encodes.
    * its device copy, which the bias correction reads, is written by the recorded work when
      it runs: each update runs with the count of its own encode, whatever the commit order;
      work captured into a CUDA graph adds one at every replay instead (a
      `CapturedCommandBuffer` you replay yourself advances the device copy only: add its
      replays to ``time_step`` before encoding Adam updates eagerly again).
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
        learning_rate: float | None = None,
    ) -> None:
        who = "Adam"
        self._beta1 = _ranged(who, "beta1", beta1, 1.0, open_high=True)
        self._beta2 = _ranged(who, "beta2", beta2, 1.0, open_high=True)
        self._epsilon = _ranged(who, "epsilon", epsilon)
        _check_time_step(time_step)
        self._amsgrad = check_type(who, "amsgrad", amsgrad, bool)
        super().__init__(device, _descriptor(who, descriptor, learning_rate))
        self._step = make_step(device.torch_device, time_step)  # the device copy
        self._time_step = time_step  # the count at encode

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
        """Updates encoded so far (MPS ``timeStep``): advanced at encode, not when the work
        runs (a host value: reading it waits for nothing)."""
        return self._time_step

    @time_step.setter
    def time_step(self, value: int) -> None:
        """The next encode uses ``value + 1`` (work encoded before keeps its own count)."""
        _check_time_step(value)
        self._time_step = value
        set_step(self._step, value)  # for readers of the device copy before the next encode

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

    def _count_encode(self) -> _Encode:
        encode = _Encode(0)
        self._recount(encode)
        return encode

    def _recount(self, encode: _Encode) -> None:
        self._time_step += 1
        encode.t = self._time_step
        for log in _JOURNALS:
            log.append((self, encode))

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
        """One update: ``time_step`` advances by one now, at encode (weights and biases
        together count once); the work runs with that count."""
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


def _check_time_step(value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"[Adam] time_step must be an int >= 0, got {value!r}")
