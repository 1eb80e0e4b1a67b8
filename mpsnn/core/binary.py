"""Two-input kernel bases: `BinaryKernel` and `GradientKernel`.

A `BinaryKernel` reads a primary and a secondary image, each with its own offset, edge mode,
channel offset and count, kernel size, stride and dilation.

A `GradientKernel` is the backward pass of a forward kernel: primary = the incoming gradient
(shaped like the forward destination), secondary = the forward source image (or the forward
result, for the families that say so). Its geometry comes from the `GradientState` the forward
encode filled: the result has the forward source's shape, pixels no window reached and channels
the forward did not read get 0. The MPS geometry properties (``primary_offset``,
``secondary_offset``, ``kernel_offset_x/y``, the secondary edge mode, strides and channel
ranges) are *reported* from the state by `GradientKernel.destination_image_descriptor` and by
every encode; a value set by hand that contradicts the forward raises `UnsupportedError` at
encode, because mpsnn computes the exact adjoint of what the forward did. The command a
window-model gradient records (`Backward`, `_backward_command`) lives in
`mpsnn.core.gradient_command`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from mpsnn.core._checks import check_enum, check_int, check_type
from mpsnn.core.cnn_kernel import DEFAULT_PADDING_METHOD
from mpsnn.core.command_buffer import CommandBuffer
from mpsnn.core.descriptor import ImageDescriptor, _result_format
from mpsnn.core.device import Device
from mpsnn.core.encode import Encoding
from mpsnn.core.geometry import (
    _HUGE,
    RECT_NO_CLIP,
    DefaultPadding,
    EdgeMode,
    Offset,
    Window,
)
from mpsnn.core.gradient_command import Backward, _backward_command
from mpsnn.core.image import Image
from mpsnn.core.image_batch import ImageBatch
from mpsnn.core.kernel import Kernel, SharedProperties, image_sequences, resolve_span
from mpsnn.core.state import ForwardRecord, GradientState, State, _unique
from mpsnn.errors import UnsupportedError

__all__ = ["BinaryKernel", "GradientKernel"]


def _geometry_property(name: str, kind: str, minimum: int | None = None) -> property:
    attr = "_" + name

    def get(self: BinaryKernel) -> Any:
        record = self._last_record
        if record is None or name in self._explicit:
            return getattr(self, attr)
        # a gradient kernel (the kernels with a record) reports its forward's geometry
        return self._derived(record)[name]  # type: ignore[attr-defined]

    def set_(self: BinaryKernel, value: Any) -> None:
        who = type(self).__name__
        if kind == "offset":
            check_type(who, name, value, Offset)
        elif kind == "edge":
            check_enum(who, name, value, EdgeMode, self._edge_modes)
        else:
            check_int(who, name, value, minimum)
        setattr(self, attr, value)
        self._explicit.add(name)

    return property(get, set_, doc=f"MPS ``{name}`` (see the class docstring).")


class BinaryKernel(SharedProperties, Kernel):
    """A kernel with a primary and a secondary source (MPS ``MPSCNNBinaryKernel``).

    Each source has its own ``*_offset``, ``*_edge_mode``, ``*_source_feature_channel_offset``
    and ``*_max_count``, ``*_stride_in_pixels_x/y`` (read-write) and kernel size and dilation
    (read-only). ``clip_rect``, ``destination_feature_channel_offset``, ``padding`` and
    ``destination_image_allocator`` are shared.
    """

    _edge_modes: tuple[EdgeMode, ...] = (EdgeMode.ZERO, EdgeMode.CLAMP)
    _is_backwards = False

    primary_offset = _geometry_property("primary_offset", "offset")
    secondary_offset = _geometry_property("secondary_offset", "offset")
    primary_edge_mode = _geometry_property("primary_edge_mode", "edge")
    secondary_edge_mode = _geometry_property("secondary_edge_mode", "edge")
    primary_stride_in_pixels_x = _geometry_property("primary_stride_in_pixels_x", "int", 0)
    primary_stride_in_pixels_y = _geometry_property("primary_stride_in_pixels_y", "int", 0)
    secondary_stride_in_pixels_x = _geometry_property("secondary_stride_in_pixels_x", "int", 0)
    secondary_stride_in_pixels_y = _geometry_property("secondary_stride_in_pixels_y", "int", 0)
    primary_source_feature_channel_offset = _geometry_property(
        "primary_source_feature_channel_offset", "int", 0
    )
    secondary_source_feature_channel_offset = _geometry_property(
        "secondary_source_feature_channel_offset", "int", 0
    )
    primary_source_feature_channel_max_count = _geometry_property(
        "primary_source_feature_channel_max_count", "int", 1
    )
    secondary_source_feature_channel_max_count = _geometry_property(
        "secondary_source_feature_channel_max_count", "int", 1
    )

    def __init__(
        self,
        device: Device,
        *,
        primary_kernel: tuple[int, int] = (1, 1),
        secondary_kernel: tuple[int, int] = (1, 1),
        primary_dilation: tuple[int, int] = (1, 1),
        secondary_dilation: tuple[int, int] = (1, 1),
    ) -> None:
        super().__init__(device)
        self._explicit: set[str] = set()
        self._last_record: ForwardRecord | None = None  # gradient kernels: the last forward
        self._primary_kernel = primary_kernel
        self._secondary_kernel = secondary_kernel
        self._primary_dilation = primary_dilation
        self._secondary_dilation = secondary_dilation
        self._primary_offset = Offset()
        self._secondary_offset = Offset()
        self._primary_edge_mode = EdgeMode.ZERO
        self._secondary_edge_mode = EdgeMode.ZERO
        self._primary_stride_in_pixels_x = 1
        self._primary_stride_in_pixels_y = 1
        self._secondary_stride_in_pixels_x = 1
        self._secondary_stride_in_pixels_y = 1
        self._primary_source_feature_channel_offset = 0
        self._secondary_source_feature_channel_offset = 0
        self._primary_source_feature_channel_max_count = _HUGE
        self._secondary_source_feature_channel_max_count = _HUGE
        self._clip = RECT_NO_CLIP
        self._dco = 0
        self._padding: Any = DefaultPadding(DEFAULT_PADDING_METHOD)
        self._allocator: Any = Image.default_allocator()

    # -- shared and read-only properties -----------------------------------------------------

    @property
    def primary_kernel_width(self) -> int:
        return self._primary_kernel[0]

    @property
    def primary_kernel_height(self) -> int:
        return self._primary_kernel[1]

    @property
    def secondary_kernel_width(self) -> int:
        r = self._last_record
        return r.window.x.kernel if r is not None else self._secondary_kernel[0]

    @property
    def secondary_kernel_height(self) -> int:
        r = self._last_record
        return r.window.y.kernel if r is not None else self._secondary_kernel[1]

    @property
    def primary_dilation_rate_x(self) -> int:
        return self._primary_dilation[0]

    @property
    def primary_dilation_rate_y(self) -> int:
        return self._primary_dilation[1]

    @property
    def secondary_dilation_rate_x(self) -> int:
        r = self._last_record
        return r.window.x.dilation if r is not None else self._secondary_dilation[0]

    @property
    def secondary_dilation_rate_y(self) -> int:
        r = self._last_record
        return r.window.y.dilation if r is not None else self._secondary_dilation[1]

    @property
    def is_backwards(self) -> bool:
        return self._is_backwards

    @property
    def is_state_modified(self) -> bool:
        return False

    # -- forward binary encode (families implement the math) -----------------------------

    def result_state(
        self,
        primary_image: Image,
        secondary_image: Image,
        source_states: Any = None,
        destination_image: Image | None = None,
    ) -> State | None:
        """The state a training encode fills (None when the family needs none)."""
        return None

    def encode(
        self,
        command_buffer: CommandBuffer,
        primary_image: Image,
        secondary_image: Image,
        destination_image: Image | None = None,
        destination_state: State | None = None,
    ) -> Image:
        """Combine ``primary_image`` and ``secondary_image`` into the destination."""
        raise NotImplementedError(f"{type(self).__name__} does not implement a forward encode")

    def encode_batch(
        self,
        command_buffer: CommandBuffer,
        primary_images: ImageBatch,
        secondary_images: ImageBatch,
        destination_images: ImageBatch | None = None,
        destination_states: Sequence[State] | None = None,
    ) -> ImageBatch:
        raise NotImplementedError(f"{type(self).__name__} does not implement a forward encode")


class GradientKernel(BinaryKernel):
    """Base of every gradient kernel (MPS ``MPSCNNGradientKernel``).

    Subclasses are registered with `mpsnn.core.registry.gradient_of` (which sets the forward
    kernel class the state must come from), set ``_state_class`` (what ``gradient_state`` must
    be) and ``_secondary_is_result`` (True when the secondary image is the forward *result*),
    and implement ``_check_forward(record)`` (their parameters must match the forward's typed
    record, ``record.params``) and ``_make_backward(cb, record, window, states)``: a function from
    the incoming-gradient block (the region the forward wrote) and the secondary block to the
    gradient of the channels the forward read, ``(images, src_channels, H, W)``, or None when
    no data gradient is wanted. A family whose geometry is not the window model overrides
    ``_plan_gradient`` instead; either way the encode ends in one `Encoding`.

    Images of different formats may be mixed (MPS reads every format as float): the math runs
    in the wider of the incoming gradient's and the secondary image's dtypes, and the result
    takes the destination's format (the incoming gradient's for returned images).
    """

    _state_class: type[GradientState] = GradientState
    _forward_class: type | None = None  # set by `mpsnn.core.registry.gradient_of`
    _secondary_is_result = False
    _shared_state_batch = False  # True: a batch's states must repeat one state
    # Set by a graph around one encode (never by users): ``(transform, image)``, a function
    # applied to the incoming-gradient block before the family's math, and the image it
    # reads at run time (a plain ReLU's gradient fused into the convolution gradient after
    # it). Only the window model (`_plan_gradient` below) applies it.
    _incoming_gradient: tuple[Callable[[torch.Tensor], torch.Tensor], Image] | None = None

    def __init__(self, device: Device, **kwargs: Any) -> None:
        super().__init__(device, **kwargs)
        self._kernel_offset_x = 0
        self._kernel_offset_y = 0

    kernel_offset_x = _geometry_property("kernel_offset_x", "int")
    kernel_offset_y = _geometry_property("kernel_offset_y", "int")

    # -- family hooks ---------------------------------------------------------------------

    def _check_forward_kernel(self, record: ForwardRecord) -> None:
        """Raise ValueError when the state was not filled by a ``_forward_class`` encode."""
        want, fwd = self._forward_class, record.kernel
        if want is None:
            return
        if not isinstance(fwd, want):
            raise ValueError(
                f"[{type(self).__name__}] gradient_state must come from a {want.__name__} encode, "
                f"got one from {type(fwd).__name__}"
            )

    def _check_forward(self, record: ForwardRecord) -> None:
        """Raise ValueError when this kernel's parameters do not match the forward kernel's
        (the forward kernel's class is already checked)."""

    def _make_backward(
        self, cb: CommandBuffer, record: ForwardRecord, window: Window, states: list[Any]
    ) -> Backward:
        raise NotImplementedError

    def _wants_data_gradient(self) -> bool:
        """False when the encode only updates states (e.g. weights-only convolution gradient)."""
        return True

    # -- geometry from the state ------------------------------------------------------------

    def _derived(self, record: ForwardRecord) -> dict[str, Any]:
        """The MPS property values that describe the forward encode ``record``."""
        w = record.window
        fwd = record.kernel
        sx = getattr(fwd, "stride_in_pixels_x", 1)
        sy = getattr(fwd, "stride_in_pixels_y", 1)
        # MPS: primaryOffset = 0 and kernelOffset = -o + (E even) for the stride-1 correlation
        # over the zero-inserted gradient (effective offset = primaryOffset*stride + kernelOffset).
        ex, ey = w.x.extent, w.y.extent
        return {
            "primary_offset": Offset(w.dst_x, w.dst_y, w.dst_image),
            "secondary_offset": record.offset,
            "kernel_offset_x": -record.offset.x + (1 - ex % 2),
            "kernel_offset_y": -record.offset.y + (1 - ey % 2),
            "primary_edge_mode": EdgeMode.ZERO,
            "secondary_edge_mode": record.edge_mode,
            "primary_stride_in_pixels_x": 1,
            "primary_stride_in_pixels_y": 1,
            "secondary_stride_in_pixels_x": sx,
            "secondary_stride_in_pixels_y": sy,
            "primary_source_feature_channel_offset": w.dst_channel,
            "primary_source_feature_channel_max_count": w.dst_channels,
            "secondary_source_feature_channel_offset": (
                w.dst_channel if self._secondary_is_result else w.src_channel
            ),
            "secondary_source_feature_channel_max_count": (
                w.dst_channels if self._secondary_is_result else w.src_channels
            ),
        }

    def _check_explicit(self, derived: dict[str, Any]) -> None:
        for name in sorted(self._explicit):
            want = derived[name]
            have = getattr(self, "_" + name)
            if have != want:
                raise UnsupportedError(
                    f"[{type(self).__name__}] {name} must match the forward encode recorded in the "
                    f"gradient state ({want!r}), got {have!r}; mpsnn computes the exact adjoint of "
                    "the forward, so gradient geometry cannot be set independently"
                )

    def destination_image_descriptor(
        self, source_images: Sequence[Image], source_states: Any = None
    ) -> ImageDescriptor:
        """Copy the forward properties from the state and return the forward source's descriptor.

        Args:
            source_images: ``[source_gradient, source_image]``.
            source_states: ``[gradient_state]`` (or the state itself).
        """
        state = source_states[0] if isinstance(source_states, Sequence) else source_states
        if not isinstance(state, self._state_class):
            raise TypeError(
                f"[{type(self).__name__}] source_states must hold a {self._state_class.__name__}, "
                f"got {type(state).__name__}"
            )
        record = state._require_forward(type(self).__name__)
        self._last_record = record  # the geometry properties now report this forward
        n, c, h, w = record.source_shape
        fmt = _result_format(source_images[0].feature_channel_format)
        return ImageDescriptor(fmt, w, h, c, n)

    # -- encode ---------------------------------------------------------------------------

    def encode(  # type: ignore[override]
        self,
        command_buffer: CommandBuffer,
        source_gradient: Image,
        source_image: Image,
        gradient_state: GradientState,
        destination_gradient: Image | None = None,
    ) -> Image | None:
        """Encode the gradient of the forward that filled ``gradient_state``.

        Args:
            command_buffer: where to record the work.
            source_gradient: dL/d(forward destination), shaped like the forward destination.
            source_image: the forward source (or result, see the class).
            gradient_state: the state the forward encode filled.
            destination_gradient: where dL/d(forward source) goes; allocated when None.

        Returns:
            The destination gradient (None when the family computes no data gradient).
        """
        self._check_command_buffer(command_buffer)
        self._check_image(command_buffer, source_gradient, "source_gradient")
        self._check_image(command_buffer, source_image, "source_image")
        state = self._check_state(
            command_buffer, gradient_state, "gradient_state", self._state_class
        )
        return self._encode(
            command_buffer,
            source_gradient,
            source_image,
            [state],
            destination_gradient,
            batch=False,
        )

    @image_sequences("source_gradients", "source_images", destinations=("destination_gradients",))
    def encode_batch(  # type: ignore[override]
        self,
        command_buffer: CommandBuffer,
        source_gradients: ImageBatch,
        source_images: ImageBatch,
        gradient_states: Sequence[GradientState],
        destination_gradients: ImageBatch | None = None,
    ) -> ImageBatch | None:
        """Batch form of `encode`: one state per image (a shared state may repeat). The
        batches may be sequences of `Image` s (see `image_sequences`)."""
        self._check_command_buffer(command_buffer)
        return self._encode_batch(
            command_buffer, source_gradients, source_images, gradient_states,
            destination_gradients,
        )  # fmt: skip

    def _encode_batch(
        self,
        command_buffer: CommandBuffer,
        source_gradients: ImageBatch,
        source_images: ImageBatch,
        gradient_states: Sequence[GradientState],
        destination_gradients: ImageBatch | None,
    ) -> ImageBatch | None:
        g = self._check_batch(command_buffer, source_gradients, "source_gradients")
        x = self._check_batch(command_buffer, source_images, "source_images")
        if len(source_gradients) != len(source_images):
            raise ValueError(
                f"[{type(self).__name__}] source_gradients and source_images must have the same "
                f"length, got {len(source_gradients)} and {len(source_images)}"
            )
        states = self._check_state_batch(
            command_buffer,
            gradient_states,
            "gradient_states",
            self._state_class,
            len(source_images),
            shared=self._shared_state_batch,
        )
        dst = None
        if destination_gradients is not None:
            dst = self._check_batch(command_buffer, destination_gradients, "destination_gradients")
        out = self._encode(command_buffer, g, x, states, dst, batch=True)
        if out is None:
            return None
        return destination_gradients if destination_gradients is not None else ImageBatch(out)

    def _graph_encode_batch(
        self,
        command_buffer: CommandBuffer,
        source_gradients: ImageBatch,
        source_images: ImageBatch,
        gradient_states: list[Any],
    ) -> ImageBatch | None:
        """`encode_batch` for a graph node, without the argument checks (see
        `CNNKernel._graph_encode_batch`): the states are still checked against their forward
        record and the images against its shapes. Families that override `encode_batch` keep
        it."""
        cb, g, x, states = command_buffer, source_gradients, source_images, gradient_states
        if type(self).encode_batch is not GradientKernel.encode_batch:
            return self.encode_batch(cb, g, x, states)
        who = type(self).__name__
        g._image._root()._check_live(who)  # a user's source may have been released already
        x._image._root()._check_live(who)
        out = self._encode(cb, g._image, x._image, states, None, batch=True)
        return None if out is None else ImageBatch(out)

    def _encode(
        self,
        cb: CommandBuffer,
        grad: Image,
        src: Image,
        states: list[Any],
        dst: Image | None,
        batch: bool,
    ) -> Image | None:
        """Validate the states against their forward, let the family plan, then apply."""
        who = type(self).__name__
        unique = _unique(states)
        record = unique[0]._require_forward(who)
        for st in unique[1:]:
            other = st._require_forward(who)
            if not record.same_geometry(other):
                raise ValueError(
                    f"[{who}] every gradient state of a batch must come from one forward geometry, "
                    f"got {record.window} and {other.window}"
                )
        self._check_forward_kernel(record)
        self._check_forward(record)
        if dst is not None:
            self._check_destination(cb, dst, "destination_gradient", grad, src)
        enc = self._plan_gradient(cb, grad, src, record, states, dst, batch)
        return self._apply(cb, enc)[0]

    def _plan_gradient(
        self,
        cb: CommandBuffer,
        grad: Image,
        src: Image,
        record: ForwardRecord,
        states: list[Any],
        dst: Image | None,
        batch: bool,
    ) -> Encoding:
        """The window-model gradient: the result has the forward source's shape; families
        supply the math (`_make_backward`). Families with another geometry override this."""
        who = type(self).__name__
        if self._explicit:
            self._check_explicit(self._derived(record))
        fw = record.window
        # Which images: those given (a batch, or images of a forward batch taken one by one), or
        # the images the forward's window mapped (its first source and result image, its count).
        if batch or record.batch:
            z_src, z_dst, images = 0, 0, grad.number_of_images
        else:
            z_src, z_dst, images = fw.src_image, fw.dst_image, fw.images
        grad_shape = record.destination_shape
        sec_shape = record.destination_shape if self._secondary_is_result else record.source_shape
        self._check_shape(grad, grad_shape, z_dst, images, batch, "source_gradient", "destination")
        self._check_shape(
            src,
            sec_shape,
            z_dst if self._secondary_is_result else z_src,
            images,
            batch,
            "source_image",
            "result" if self._secondary_is_result else "source",
        )
        n, c, h, w = record.source_shape
        out: Image | ImageDescriptor | None = dst
        if dst is None:
            if self._wants_data_gradient():
                fmt = _result_format(grad._fmt)
                out = ImageDescriptor._make(fmt, w, h, c, images if batch else n)
        else:
            dn, dc, dh, dw = dst._shape
            if (dh, dw) != (h, w) or dn < z_src + images or dc < self._dco + c:
                raise ValueError(
                    f"[{who}] destination_gradient must be {w}x{h} (the forward source) with at "
                    f"least destination_feature_channel_offset + {c} = {self._dco + c} channels "
                    f"and {z_src + images} images, got {dw}x{dh}x{dc} with {dn} images"
                )
        y0, ny = resolve_span(who, "y", self._clip.origin.y, self._clip.size.height, h)
        x0, nx = resolve_span(who, "x", self._clip.origin.x, self._clip.size.width, w)
        backward = self._make_backward(cb, record, fw, states)
        extra: tuple[Image, ...] = ()
        if self._incoming_gradient is not None:
            pre, read = self._incoming_gradient
            family = backward
            extra = (read,)

            def backward(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
                return family(pre(g), x)

        run = _backward_command(
            backward,
            grad,
            src,
            fw,
            self._secondary_is_result,
            (z_src, z_dst, images),
            c,
            self._dco,
            (y0, ny, x0, nx),
        )
        # reads: each distinct state once (a batch repeats a shared state once per image, and
        # the reads are walked in Python at every encode)
        reads = (grad, src, *extra, *_unique(states))
        return Encoding(run, (out,), reads, (), {"_last_record": record}, batch)

    def _check_shape(
        self,
        image: Image,
        want: tuple[int, int, int, int],
        z0: int,
        images: int,
        batch: bool,
        name: str,
        what: str,
    ) -> None:
        n, c, h, w = image._shape
        if (c, h, w) != want[1:] or n < z0 + images:
            raise ValueError(
                f"[{type(self).__name__}] {name} must have the forward {what}'s shape "
                f"{want[3]}x{want[2]}x{want[1]} (width x height x channels) and at least "
                f"{z0 + images} images, got {w}x{h}x{c} with {n} images"
            )
