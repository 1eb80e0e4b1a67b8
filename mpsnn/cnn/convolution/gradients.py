"""Convolution gradient kernels: `ConvolutionGradient`, `FullyConnectedGradient`,
`ConvolutionTransposeGradient`.

Each reads the incoming gradient (primary, shaped like the forward destination), the forward
source image (secondary) and the forward's `ConvolutionGradientState`, and computes what
``gradient_option`` asks for:

* data: dL/d(source), the exact adjoint of the forward's data map under the recorded geometry
  (offsets, clip rect, channel ranges, edge mode, strides, dilation, groups); written to the
  destination gradient;
* weights and bias: added to the state's ``gradient_for_weights`` (OHWI) and
  ``gradient_for_biases``, summed over every image.

The weights are the forward kernel's master weights as they are when the gradient runs
(recorded in the state's `ConvolutionRecord`); an update encoded after the gradient (the
training graph's order) does not affect it. A fused neuron's gradient is not included (MPS:
apply the neuron gradient first, `NeuronGradient` with this state).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mpsnn.cnn.convolution.data_source import (
    ConvolutionDataSource,
    ConvolutionWeightsAndBiasesState,
    read_data_source,
)
from mpsnn.cnn.convolution.descriptor import ConvolutionGradientOption
from mpsnn.cnn.convolution.kernels import (
    Convolution,
    ConvolutionRecord,
    ConvolutionTranspose,
    FullyConnected,
)
from mpsnn.cnn.convolution.state import ConvolutionGradientState, ConvolutionTransposeGradientState
from mpsnn.cnn.neuron_descriptor import FusedNeuron
from mpsnn.core._checks import check_enum
from mpsnn.core.binary import GradientKernel
from mpsnn.core.command_buffer import CommandBuffer, running_buffer
from mpsnn.core.device import Device
from mpsnn.core.encode import Encoding
from mpsnn.core.geometry import Window
from mpsnn.core.gradient_command import Backward
from mpsnn.core.registry import gradient_of
from mpsnn.core.state import ForwardRecord
from mpsnn.ops.convolution import (
    conv_backward,
    conv_transpose_backward,
    fc_backward,
)

__all__ = ["ConvolutionGradient", "ConvolutionTransposeGradient", "FullyConnectedGradient"]

Grads = tuple["torch.Tensor | None", "torch.Tensor | None", "torch.Tensor | None"]
_WITH_DATA = int(ConvolutionGradientOption.GRADIENT_WITH_DATA)
_WITH_WEIGHTS = int(ConvolutionGradientOption.GRADIENT_WITH_WEIGHTS_AND_BIAS)


@gradient_of(Convolution)
class ConvolutionGradient(GradientKernel):
    """Gradient of `Convolution` (MPS ``MPSCNNConvolutionGradient``).

    Args:
        device: the kernel's device.
        weights: the forward convolution's data source (or one with the same descriptor).

    ``gradient_option`` (default ALL) selects the data gradient, the weight and bias gradients,
    or both. With GRADIENT_WITH_WEIGHTS_AND_BIAS only, ``encode`` returns None and writes no image.
    """

    _state_class = ConvolutionGradientState

    def __init__(self, device: Device, weights: ConvolutionDataSource) -> None:
        who = type(self).__name__
        desc, _, _ = read_data_source(who, weights)
        FusedNeuron.of(who, desc.fused_neuron_descriptor)  # validates it (its gradient is apart)
        super().__init__(
            device,
            secondary_kernel=(desc.kernel_width, desc.kernel_height),
            secondary_dilation=(desc.dilation_rate_x, desc.dilation_rate_y),
        )
        self._data_source = weights
        self._descriptor = desc
        self._option = ConvolutionGradientOption.ALL
        # False: a layer without biases skips their sums (set by a training graph whose update
        # never reads them; the state's gradient_for_biases then raises instead of answering)
        self._bias_sums = True
        # True: in captured work, the weight and bias gradients run on the queue's side
        # stream, beside the commands after this one that may (`CommandBuffer._beside`; set
        # by a data-parallel training graph, whose next collective then overlaps them)
        self._weights_beside = False

    @property
    def gradient_option(self) -> ConvolutionGradientOption:
        return self._option

    @gradient_option.setter
    def gradient_option(self, value: ConvolutionGradientOption) -> None:
        self._option = check_enum(
            type(self).__name__,
            "gradient_option",
            value,
            ConvolutionGradientOption,
            (
                ConvolutionGradientOption.GRADIENT_WITH_DATA,
                ConvolutionGradientOption.GRADIENT_WITH_WEIGHTS_AND_BIAS,
                ConvolutionGradientOption.ALL,
            ),
        )

    @property
    def data_source(self) -> ConvolutionDataSource:
        return self._data_source

    @property
    def source_gradient_feature_channels(self) -> int:
        """Channels of the incoming gradient: the forward's output channels."""
        return self._descriptor.output_feature_channels

    @property
    def source_image_feature_channels(self) -> int:
        """Channels of the forward source: the forward's input channels."""
        return self._descriptor.input_feature_channels

    @property
    def groups(self) -> int:
        return self._descriptor.groups

    @property
    def channel_multiplier(self) -> int:
        return 0

    def reload_weights_and_biases_from_data_source(self) -> None:
        """Re-read the data source's descriptor (it must not change).

        The gradient reads its forward kernel's master weights (through the state), so there
        is no separate copy to refresh; this exists for MPS code that reloads both kernels.
        """
        desc, _, _ = read_data_source(type(self).__name__, self._data_source)
        if desc != self._descriptor:
            raise ValueError(
                f"[{type(self).__name__}] the data source's descriptor must not change, "
                f"got {desc!r}"
            )

    def reload_weights_and_biases(
        self, command_buffer: CommandBuffer, state: ConvolutionWeightsAndBiasesState
    ) -> None:
        """Accepts the reload MPS code encodes on both kernels; drops ``state``'s read count.

        See `reload_weights_and_biases_from_data_source` for why nothing else is needed.
        """
        self._check_command_buffer(command_buffer)
        self._check_state(command_buffer, state, "state", ConvolutionWeightsAndBiasesState)
        self._apply(command_buffer, Encoding(_nothing, (), (state,)))

    # -- gradient-kernel hooks ----------------------------------------------------------

    def _check_forward(self, record: ForwardRecord) -> None:
        who = type(self).__name__
        params: ConvolutionRecord = record.params
        if params.descriptor != self._descriptor:
            raise ValueError(
                f"[{who}] the gradient's data source must describe the forward kernel "
                f"({params.descriptor!r}), got {self._descriptor!r}"
            )

    def _wants_data_gradient(self) -> bool:
        return int(self._option) & _WITH_DATA != 0

    def _grads(self, record: ForwardRecord, need_bias: bool = True) -> Callable[..., Grads]:
        """``(g, x, w, need_data, need_weights) -> (dx, dw, db)``; ``db`` is None when
        ``need_bias`` is False."""
        geom = record.params.geometry  # the forward's windows and edge mode
        return lambda g, x, w, nd, nw: conv_backward(g, x, w, geom, nd, nw, need_bias)

    def _make_backward(
        self, cb: CommandBuffer, record: ForwardRecord, window: Window, states: list[Any]
    ) -> Backward:
        ws = record.params.weights
        need_b = self._bias_sums or ws.bias is not None
        grads = self._grads(record, need_b)
        option = int(self._option)  # an IntFlag's own `&` runs in Python, at every encode
        need_data = option & _WITH_DATA != 0
        need_w = option & _WITH_WEIGHTS != 0
        groups = _group_by_state(states)
        if need_w:
            for state, _ in groups:
                state._bias_sums_skipped = not need_b

        def sums(dw: torch.Tensor, db: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
            # skipped bias sums are not stored (no zeros made at every step): the state's
            # sums are the weights' alone (`ConvolutionGradientState._sum`), also where a
            # subclass's `_grads` sums the bias anyway
            return (dw,) if db is None or not need_b else (dw, db)

        beside = self._weights_beside and need_data and need_w and len(groups) == 1

        def backward(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
            w, _ = ws.cast(x.dtype)
            if beside:
                run = running_buffer()
                # captured work only: an eager step is bound by its host time, which the
                # stream switch adds to while the device has nothing to overlap
                if run is not None and run._captured:
                    dx = grads(g, x, w, True, False)[0]

                    def weights() -> None:
                        _, dw, db = grads(g, x, w, False, True)
                        groups[0][0]._accumulate(cb, sums(dw, db))

                    run._beside(weights, (g, x, w))
                    return dx
            if len(groups) == 1:
                dx, dw, db = grads(g, x, w, need_data, need_w)
                if need_w:
                    groups[0][0]._accumulate(cb, sums(dw, db))
                return dx
            dx = grads(g, x, w, True, False)[0] if need_data else None
            if need_w:  # distinct states per image: each sums its own images
                for state, idx in groups:
                    _, dw, db = grads(g[idx], x[idx], w, False, True)
                    state._accumulate(cb, sums(dw, db))
            return dx

        return backward


def _nothing() -> None:
    """The command of an encode that only consumes a read (its effect is the read count)."""


def _group_by_state(states: list[Any]) -> list[tuple[Any, list[int]]]:
    if states and states.count(states[0]) == len(states):  # one shared state: a C-level check
        return [(states[0], list(range(len(states))))]
    groups: dict[int, tuple[Any, list[int]]] = {}
    for i, s in enumerate(states):
        groups.setdefault(id(s), (s, []))[1].append(i)
    return list(groups.values())


@gradient_of(FullyConnected)
class FullyConnectedGradient(ConvolutionGradient):
    """Gradient of `FullyConnected` (MPS ``MPSCNNFullyConnectedGradient``).

    ``dx(c, h, w) = sum_o E(o) W[o][h][w][c]``, ``dW[o][h][w][c] = sum_batch E(o) x(c, h, w)``,
    ``db[o] = sum_batch E(o)``.
    """

    def _grads(self, record: ForwardRecord, need_bias: bool = True) -> Callable[..., Grads]:
        ws = record.params.weights
        return lambda g, x, w, nd, nw: fc_backward(g, x, w, nd, nw, ws.matrix(w), need_bias)


@gradient_of(ConvolutionTranspose)
class ConvolutionTransposeGradient(ConvolutionGradient):
    """Gradient of `ConvolutionTranspose` (MPS ``MPSCNNConvolutionTransposeGradient``, an
    [13] addition): the exact adjoint, with weight and bias gradients in a
    `ConvolutionTransposeGradientState` laid out as for a convolution."""

    _state_class = ConvolutionTransposeGradientState

    def _grads(self, record: ForwardRecord, need_bias: bool = True) -> Callable[..., Grads]:
        geom = record.params.geometry  # the forward's windows and edge mode
        stride = record.params.stride
        return lambda g, x, w, nd, nw: conv_transpose_backward(
            g, x, w, geom, stride, nd, nw, need_bias
        )
