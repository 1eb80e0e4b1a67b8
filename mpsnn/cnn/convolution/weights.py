"""A convolution kernel's master weights (`ConvWeights`): OIHW tensors on its device,
updated in place, and their float16/bfloat16 copies."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mpsnn.core.capture import recording
from mpsnn.core.device import Device
from mpsnn.core.layout import channels_last_only, channels_last_preferred, master_layout
from mpsnn.ops import triton as fast_paths
from mpsnn.ops.convolution import fc_matrix

__all__ = ["ConvWeights"]


class ConvWeights:
    """A kernel's master weights: OIHW ``weight`` and ``(O,)`` ``bias`` on its device, float32
    (float64 when the data source gives float64), updated **in place** by reloads (a training
    graph's updates end with one), so that anything recorded earlier (a captured CUDA graph)
    keeps reading the current values.

    Copies in other dtypes (for float16/bfloat16 images) are tensors of this object, made on
    first use (`cast`) and rewritten in place by the reloads right after the masters, in the
    same command (`load_ohwi`, `copy_oihw`, `refresh_all`): a CUDA graph that records a reload
    rewrites them at every replay, and the forward reads them with no check. Other writes into
    the masters (``kernel.weights`` written in place, a state wrapping it) reach the copies at
    the next reload, as a kernel sees its data source's new values at reload in MPS.
    """

    __slots__ = ("_bias", "_casts", "_channels_last", "_matrix", "source_ohwi", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = weight
        self._bias = bias
        # whether the data source the kernel was made from keeps its weights in OHWI memory
        # (MPS's own order: a contiguous OHWI tensor): a fully connected layer then keeps
        # channels-last (OHWI-memory) masters where they are made so (float32 on the CPU) and
        # computes in that order (`channels_last_casts`)
        self.source_ohwi = False
        # low-precision casts in the convolutions' layout (`_new_cast`); a fully connected
        # layer, which reads its weights as an (O, K) matrix view, turns it off
        self._channels_last = True
        # dtype -> (weights, bias) in that dtype: written by the writers of the masters
        self._casts: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._matrix: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def from_ohwi(
        cls, weights: torch.Tensor, biases: torch.Tensor | None, device: Device
    ) -> ConvWeights:
        dev = device.torch_device
        o, kh, kw, ig = weights.shape
        # Always a copy: a kernel owns its weights and sees a data source's new values only
        # when it reloads them (MPS's contract; a second kernel of the same data source, e.g.
        # an inference graph's, keeps its weights until its own reload).
        # In the layout the convolutions run in (`mpsnn.core.layout`): on the CPU, float32
        # masters are channels-last (OHWI memory, MPS's own order), so that oneDNN neither
        # converts them at every forward and backward nor returns a weight gradient that must
        # be converted back.
        w = torch.empty((o, ig, kh, kw), dtype=weights.dtype, device=dev,
                        memory_format=master_layout(weights.dtype, dev))  # fmt: skip
        w.copy_(weights.permute(0, 3, 1, 2))
        # The biases take the weights' dtype: float64 verification runs are float64 throughout.
        b = biases.to(dev, w.dtype, copy=True) if biases is not None else None
        made = cls(w, b)
        made.source_ohwi = channels_last_only(weights.permute(0, 3, 1, 2))
        return made

    @property
    def bias(self) -> torch.Tensor | None:
        return self._bias

    @bias.setter
    def bias(self, value: torch.Tensor | None) -> None:
        """New bias storage (a layer gaining or losing its bias): the copies follow now."""
        self._bias = value
        for dtype, (w, _) in self._casts.items():
            self._casts[dtype] = (w, None if value is None else value.to(dtype, copy=True))

    @property
    def channels_last_casts(self) -> bool:
        """Whether 4-D casts take the layout the convolutions run in (`_new_cast`)."""
        return self._channels_last

    @channels_last_casts.setter
    def channels_last_casts(self, value: bool) -> None:
        if value != self._channels_last:
            self._channels_last = value
            self._casts.clear()  # made again, in the new layout, at their next use
            if not value and not self.weight.is_contiguous() and not self.source_ohwi:
                # a fully connected layer computes in its masters' memory order (its matrix is
                # a view of them, `mpsnn.ops.convolution.fc_matrix`): OIHW-contiguous, unless
                # its data source keeps OHWI memory and the masters are made channels-last
                # (float32 on the CPU), whose reloads, updates and gradients then need no
                # reordering copy (set when the kernel is made, before anything reads them)
                self.weight = self.weight.contiguous()

    def load_ohwi(self, weights: torch.Tensor, biases: torch.Tensor | None) -> None:
        """Copy new OHWI values into the masters, in place (now, on the current stream), and
        rewrite the copies."""
        if biases is not None and self._bias is None:
            self.bias = torch.zeros_like(biases, dtype=self.weight.dtype, device=self.weight.device)
        self.copy_oihw(weights.permute(0, 3, 1, 2), biases)

    def copy_oihw(self, weights: torch.Tensor, biases: torch.Tensor | None) -> None:
        """Copy OIHW ``weights`` (and ``biases``, when given: the masters have a bias) into
        the masters, in place, then rewrite the copies (now, on the current stream; as
        recorded work, inside a command)."""
        self.weight.copy_(weights)
        if biases is not None:
            self._bias.copy_(biases)  # type: ignore[union-attr]
        self.refresh()

    def refresh(self) -> None:
        """Rewrite the copies from the masters (the writers of the masters call it)."""
        ConvWeights.refresh_all((self,))

    @staticmethod
    def refresh_all(masters: Sequence[ConvWeights]) -> None:
        """`refresh` of several kernels' masters as one multi-tensor copy. In work recorded
        into a CUDA graph, Triton instead: a transpose for each half-precision channels-last
        copy of NCHW float32 masters, and one launch for the other half-precision copies of
        float32 masters; what is left (a float64 cast, say) takes the multi-tensor copy.
        PyTorch's strided copy is several times slower on the device, and its multi-tensor
        copy gives each 64K elements one block; but each is one call from the host, which
        bounds an eager step."""
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        recorded = bool(masters) and recording(masters[0].weight)  # (one device)
        for ws in masters:
            for w, b in tuple(ws._casts.values()):  # (a completion thread may reload)
                if not (recorded and fast_paths.cast_into_channels_last(ws.weight, w)):
                    dst.append(w)
                    src.append(ws.weight)
                if b is not None:
                    dst.append(b)
                    src.append(ws._bias)  # type: ignore[arg-type]
        if dst and recorded:  # the pairs the flat narrowing takes, in one launch
            dst, src = fast_paths.narrow_into(dst, src)
        if dst:
            torch._foreach_copy_(dst, src)

    def cast(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Weights and bias in ``dtype`` (run time: see the class docstring)."""
        if dtype is self.weight.dtype:  # the common case, at every forward (dtypes are singletons)
            return self.weight, self._bias
        got = self._casts.get(dtype)
        if got is None:
            b = self._bias.to(dtype) if self._bias is not None else None
            got = (self._new_cast(dtype), b)
            if recording(self.weight):
                # made by recorded work, in the graph's pool: written only when a replay
                # runs, so it is this use's alone (the graph casts again at every replay)
                return got
            self._casts[dtype] = got
        return got

    def _new_cast(self, dtype: torch.dtype) -> torch.Tensor:
        """The weights in ``dtype``, in the layout the convolutions run in (`mpsnn.core.layout`)
        so that cuDNN does not convert them at every forward and backward; one cast either
        way."""
        w = self.weight
        if self._channels_last and w.dim() == 4:
            # channels-last where that dtype runs channels-last, else NCHW (the CPU's float32
            # masters are channels-last: a float64 or half cast of them is not)
            cl = channels_last_preferred(dtype, w.device)
            return w.to(dtype, memory_format=torch.channels_last if cl else torch.contiguous_format)
        # a fully connected layer's casts: OIHW-contiguous (the images of other dtypes are NCHW
        # on the CPU, and float64 verification keeps the (c, h, w) order), whatever the order
        # of masters kept in their data source's OHWI memory
        return w.to(dtype, memory_format=torch.contiguous_format)

    def matrix(self, w: torch.Tensor) -> torch.Tensor:
        """`fc_matrix` of ``w`` (the masters, or a cast of them from `cast`), kept while ``w``
        is the tensor it was made for: a view, so in-place updates show through it, and a
        fully connected layer makes none at every step."""
        got = self._matrix
        if got is None or got[0] is not w:
            got = self._matrix = (w, fc_matrix(w))
        return got[1]

    @property
    def ohwi(self) -> torch.Tensor:
        return self.weight.permute(0, 2, 3, 1)
