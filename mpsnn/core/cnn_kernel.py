"""The unary kernel base `CNNKernel`.

An encode goes through the same steps for every family (`mpsnn.core.encode`):

1. validate the command buffer, images and states (types, device, liveness, shapes);
2. plan, once per configuration: size the destination with the padding policy when none is
   given (the policy's changes to ``offset`` and friends are returned, not kept), resolve the
   `Window` (images, channels, per-axis windows) and let the family check it;
3. build the typed `ForwardRecord` and the command closure (`mpsnn.core.forward_command`);
4. apply: allocate the destination, record the command, write the records into the states,
   set the properties the policy chose, drop the read counts of what was read.

A failed encode leaves the command buffer, images, states and kernel as they were (the kernel's
geometry is restored if anything raised). Nothing in steps 1-3 reads device memory.

Families override a few hooks: ``_destination_channels`` (and its checks), ``_axis_windows``
for non-standard window placement, ``_record_params`` for the typed record their gradient reads,
``_make_forward`` for the math, and ``_gradient_state_class`` for what ``result_state`` returns.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import attrgetter
from typing import Any

import torch

from mpsnn.core._checks import check_enum, check_int, check_positive, check_type
from mpsnn.core.command_buffer import CommandBuffer
from mpsnn.core.descriptor import _FORMAT_TO_DTYPE, ImageDescriptor, _result_format
from mpsnn.core.device import Device
from mpsnn.core.encode import Encoding
from mpsnn.core.forward_command import forward_command
from mpsnn.core.geometry import (
    _HUGE,
    RECT_NO_CLIP,
    AxisWindow,
    DefaultPadding,
    DestinationSpan,
    EdgeMode,
    Offset,
    PaddingMethod,
    Window,
    forward_size,
    padding_offset,
    remainder_first,
    reverse_size,
)
from mpsnn.core.image import Image
from mpsnn.core.image_batch import ImageBatch
from mpsnn.core.kernel import (
    Kernel,
    SharedProperties,
    image_sequences,
    resolve_images,
    resolve_span,
)
from mpsnn.core.state import ForwardRecord, GradientState, State, StateBatch, _unique

__all__ = ["DEFAULT_PADDING_METHOD", "CNNKernel", "Forward", "Records"]

_CUSTOM = int(PaddingMethod.CUSTOM)
DEFAULT_PADDING_METHOD = (
    PaddingMethod.ALIGN_CENTERED | PaddingMethod.ADD_REMAINDER_TO_TOP_LEFT | PaddingMethod.SIZE_SAME
)

Forward = Callable[[torch.Tensor], torch.Tensor]
Records = list[tuple[Any, ForwardRecord]]  # (state, the record written into it) per state


class CNNKernel(SharedProperties, Kernel):
    """A kernel with one source image (MPS ``MPSCNNKernel``).

    Properties (MPS defaults): ``offset`` (0, 0, 0), ``clip_rect`` (`RECT_NO_CLIP`),
    ``destination_feature_channel_offset`` 0, ``source_feature_channel_offset`` 0,
    ``source_feature_channel_max_count`` (no limit), ``edge_mode`` ZERO, ``padding``
    (centred, remainder top-left, same size), ``destination_image_allocator`` (permanent images;
    MPS uses temporary ones, which a Python caller could not read). Read-only: kernel size,
    strides, dilations, ``is_backwards``.
    """

    _default_padding_method: PaddingMethod = DEFAULT_PADDING_METHOD
    _edge_modes: tuple[EdgeMode, ...] = (EdgeMode.ZERO, EdgeMode.CLAMP)
    _gradient_state_class: type[GradientState] | None = None
    _is_backwards = False

    def __init__(
        self,
        device: Device,
        *,
        kernel_width: int = 1,
        kernel_height: int = 1,
        stride_in_pixels_x: int = 1,
        stride_in_pixels_y: int = 1,
        dilation_rate_x: int = 1,
        dilation_rate_y: int = 1,
    ) -> None:
        super().__init__(device)
        who = type(self).__name__
        self._kw = check_positive(who, "kernel_width", kernel_width)
        self._kh = check_positive(who, "kernel_height", kernel_height)
        self._sx = check_positive(who, "stride_in_pixels_x", stride_in_pixels_x)
        self._sy = check_positive(who, "stride_in_pixels_y", stride_in_pixels_y)
        self._dx = check_positive(who, "dilation_rate_x", dilation_rate_x)
        self._dy = check_positive(who, "dilation_rate_y", dilation_rate_y)
        self._offset = Offset()
        self._clip = RECT_NO_CLIP
        self._dco = 0
        self._sco = 0
        self._smax = _HUGE
        self._edge_mode = EdgeMode.ZERO
        self._padding: Any = DefaultPadding(self._default_padding_method)
        self._allocator: Any = Image.default_allocator()
        self._plans: dict[tuple[Any, ...], Any] = {}

    # -- properties -----------------------------------------------------------------------

    @property
    def offset(self) -> Offset:
        """Source position of the first destination pixel's window centre (``z``: first image)."""
        return self._offset

    @offset.setter
    def offset(self, value: Offset) -> None:
        self._offset = check_type(type(self).__name__, "offset", value, Offset)

    @property
    def source_feature_channel_offset(self) -> int:
        return self._sco

    @source_feature_channel_offset.setter
    def source_feature_channel_offset(self, value: int) -> None:
        self._sco = check_int(type(self).__name__, "source_feature_channel_offset", value, 0)

    @property
    def source_feature_channel_max_count(self) -> int:
        return self._smax

    @source_feature_channel_max_count.setter
    def source_feature_channel_max_count(self, value: int) -> None:
        self._smax = check_int(type(self).__name__, "source_feature_channel_max_count", value, 1)

    @property
    def edge_mode(self) -> EdgeMode:
        return self._edge_mode

    @edge_mode.setter
    def edge_mode(self, value: EdgeMode) -> None:
        self._edge_mode = check_enum(
            type(self).__name__, "edge_mode", value, EdgeMode, self._edge_modes
        )

    @property
    def kernel_width(self) -> int:
        return self._kw

    @property
    def kernel_height(self) -> int:
        return self._kh

    @property
    def stride_in_pixels_x(self) -> int:
        return self._sx

    @property
    def stride_in_pixels_y(self) -> int:
        return self._sy

    @property
    def dilation_rate_x(self) -> int:
        return self._dx

    @property
    def dilation_rate_y(self) -> int:
        return self._dy

    @property
    def is_backwards(self) -> bool:
        """True for enlarging kernels (convolution transpose)."""
        return self._is_backwards

    @property
    def is_state_modified(self) -> bool:
        """Whether encode writes the state it is given."""
        return self._gradient_state_class is not None

    # -- family hooks ---------------------------------------------------------------------

    def _destination_channels(self, source_channels: int) -> int:
        """Channels written for ``source_channels`` read; raise ValueError if not acceptable."""
        return source_channels

    def _axis_windows(self, span: DestinationSpan) -> tuple[AxisWindow, AxisWindow]:
        """The standard window model (docs/semantics.md); enlarging or fixed-window kernels
        override it."""
        ey = self._dy * (self._kh - 1) + 1
        ex = self._dx * (self._kw - 1) + 1
        # The offset is the centre of the first output at the clip rect's origin.
        y0 = span.offset.y + self._sy * span.skip_y - ey // 2
        x0 = span.offset.x + self._sx * span.skip_x - ex // 2
        return (
            AxisWindow(y0, span.count_y, self._kh, self._sy, self._dy, span.source_height),
            AxisWindow(x0, span.count_x, self._kw, self._sx, self._dx, span.source_width),
        )

    def _check_window(self, window: Window, src: Image) -> None:
        """Family checks on the resolved window (raise ValueError)."""

    def _make_forward(self, window: Window, records: Records, memo: dict[str, Any]) -> Forward:
        """The math: a function from the source block ``(images, channels, H, W)`` to the
        destination block ``(images, out_channels, y.count, x.count)``; runs at commit.

        ``records``: the states this encode writes and their records (empty for inference).
        ``memo`` lives as long as the encode configuration (window, edge mode) does: families
        keep what they derive from the window there (e.g. the extraction plan; the base class
        keeps the command's layout under ``"command"``). Must not change the kernel:
        everything that depends on the encode goes into the closure."""
        raise NotImplementedError

    def _record_params(self, window: Window, memo: dict[str, Any]) -> Any:
        """The family's typed record (a frozen dataclass) stored in the `ForwardRecord`."""
        return None

    def _state_records(self, record: ForwardRecord, states: list[Any]) -> Records:
        """The record each state receives (default: the same one for every state)."""
        return [(st, record) for st in states]

    # -- padding policy -------------------------------------------------------------------

    def _policy(
        self, source_images: Sequence[Image], source_states: Any
    ) -> tuple[ImageDescriptor, Offset]:
        """Default descriptor and offset, without changing the kernel (the padding policy)."""
        src = source_images[0]
        method = PaddingMethod(self._padding.padding_method)
        style = method.size_style
        x_first, y_first = remainder_first(method)
        align = method.alignment
        n, c, h, w = src.shape
        channels = self._destination_channels(min(self._smax, c - self._sco))
        ey = self._dy * (self._kh - 1) + 1
        ex = self._dx * (self._kw - 1) + 1
        if self._is_backwards:
            dh = reverse_size(h, ey, self._sy, style)
            dw = reverse_size(w, ex, self._sx, style)
        else:
            dh = forward_size(h, ey, self._sy, style)
            dw = forward_size(w, ex, self._sx, style)
        if dh < 1 or dw < 1:
            raise ValueError(
                f"[{type(self).__name__}] the padding policy gives an empty {dw}x{dh} destination "
                f"for a {w}x{h} source and a {ex}x{ey} effective window; use a larger source or "
                "SIZE_SAME"
            )
        offset = Offset(
            padding_offset(w, dw, ex, self._sx, align, x_first),
            padding_offset(h, dh, ey, self._sy, align, y_first),
            self._offset.z,
        )
        images = max(1, n - self._offset.z)
        return ImageDescriptor(src.feature_channel_format, dw, dh, channels, images), offset

    def destination_image_descriptor(
        self, source_images: Sequence[Image], source_states: Any = None
    ) -> ImageDescriptor:
        """Apply the padding policy: set ``offset`` and return the destination descriptor.

        Runs the default computation (the source's format; FLOAT32 for a UNORM8 source), then
        each source state's hook, then the padding object's ``destination_image_descriptor``
        when its method has the CUSTOM bit.
        """
        if isinstance(source_images, Image):
            source_images = [source_images]
        return self._resolve_policy(source_images, source_states)

    def _resolve_policy(
        self, source_images: Sequence[Image], source_states: Any
    ) -> ImageDescriptor:
        desc, offset = self._policy(source_images, source_states)
        fmt = _result_format(desc._fmt)  # a UNORM8 source gives a FLOAT32 destination
        if fmt is not desc._fmt:
            desc = ImageDescriptor._make(fmt, desc._w, desc._h, desc._c, desc._n)
        self._offset = offset
        for st in _as_list(source_states):
            if st is not None:
                desc = st.destination_image_descriptor(source_images, source_states, self, desc)
        if PaddingMethod(self._padding.padding_method) & PaddingMethod.CUSTOM:
            desc = self._padding.destination_image_descriptor(
                source_images, source_states, self, desc
            )
            if not isinstance(desc, ImageDescriptor):
                raise TypeError(
                    f"[{type(self).__name__}] the custom padding policy must return an "
                    f"ImageDescriptor, got {type(desc).__name__}"
                )
        return desc

    # -- states -----------------------------------------------------------------------------

    def result_state(
        self, source_image: Image, source_states: Any = None, destination_image: Image | None = None
    ) -> State | None:
        """The state a training encode fills for the gradient kernel (None if none is needed)."""
        return self._new_state(None)

    def temporary_result_state(
        self,
        command_buffer: CommandBuffer,
        source_image: Image,
        source_states: Any = None,
        destination_image: Image | None = None,
    ) -> State | None:
        """Like `result_state`, but temporary on ``command_buffer`` (read count 1)."""
        self._check_command_buffer(command_buffer)
        return self._new_state(command_buffer)

    def result_state_batch(
        self,
        source_images: ImageBatch,
        source_states: Any = None,
        destination_images: ImageBatch | None = None,
    ) -> StateBatch | None:
        """One state per image, or one shared state repeated (accumulating kernels)."""
        return self._new_state_batch(len(source_images), None)

    def temporary_result_state_batch(
        self,
        command_buffer: CommandBuffer,
        source_images: ImageBatch,
        source_states: Any = None,
        destination_images: ImageBatch | None = None,
    ) -> StateBatch | None:
        self._check_command_buffer(command_buffer)
        return self._new_state_batch(len(source_images), command_buffer)

    def _new_state(self, cb: CommandBuffer | None) -> State | None:
        cls = self._gradient_state_class
        return None if cls is None else cls(self._device, command_buffer=cb)

    def _new_state_batch(self, n: int, cb: CommandBuffer | None) -> StateBatch | None:
        if self._gradient_state_class is None:
            return None
        if self._reused_across_batch:
            shared = self._new_state(cb)
            return StateBatch([shared] * n)
        return StateBatch(self._new_state(cb) for _ in range(n))

    # -- encode -------------------------------------------------------------------------------

    def encode(
        self,
        command_buffer: CommandBuffer,
        source_image: Image,
        destination_image: Image | None = None,
        destination_state: State | None = None,
    ) -> Image:
        """Encode one source into ``destination_image`` (or into a new image sized by the
        padding policy, which sets ``offset``). A ``destination_state`` from `result_state`
        records what the gradient kernel needs. Returns the destination."""
        self._check_command_buffer(command_buffer)
        self._check_image(command_buffer, source_image, "source_image")
        states: list[Any] = []
        if destination_state is not None:
            states = [
                self._check_state(
                    command_buffer, destination_state, "destination_state", self._state_kind()
                )
            ]
        return self._encode(command_buffer, source_image, destination_image, states, batch=False)

    @image_sequences("source_images", destinations=("destination_images",))
    def encode_batch(
        self,
        command_buffer: CommandBuffer,
        source_images: ImageBatch,
        destination_images: ImageBatch | None = None,
        destination_states: Sequence[State] | None = None,
    ) -> ImageBatch:
        """Encode a whole batch as one operation; returns the destination batch. The batches
        may be sequences of `Image` s (see `image_sequences`)."""
        self._check_command_buffer(command_buffer)
        return self._encode_batch(command_buffer, source_images, destination_images,
                                  destination_states)  # fmt: skip

    def _encode_batch(
        self,
        command_buffer: CommandBuffer,
        source_images: ImageBatch,
        destination_images: ImageBatch | None,
        destination_states: Sequence[State] | None,
    ) -> ImageBatch:
        src = self._check_batch(command_buffer, source_images, "source_images")
        dst = None
        if destination_images is not None:
            dst = self._check_batch(command_buffer, destination_images, "destination_images")
        states: list[Any] = []
        if destination_states is not None:
            states = self._check_state_batch(
                command_buffer,
                destination_states,
                "destination_states",
                self._state_kind(),
                len(source_images),
            )
        out = self._encode(command_buffer, src, dst, states, batch=True)
        return destination_images if destination_images is not None else ImageBatch(out)

    def _graph_encode_batch(
        self, command_buffer: CommandBuffer, source_images: ImageBatch, states: Any
    ) -> ImageBatch:
        """`encode_batch` for a graph node (`mpsnn.graph`): the graph checked its command
        buffer and sources when its encode began, and made every other image and state it
        passes on this buffer in this encode (of this device, one state per image), so the
        argument checks are skipped but liveness (a source a user handed the graph may have
        been released by an earlier read in this encode) and the planning's checks. Families
        that override `encode_batch` keep it."""
        if type(self).encode_batch is not CNNKernel.encode_batch:
            return self.encode_batch(command_buffer, source_images, destination_states=states)
        src = source_images._image
        src._root()._check_live(type(self).__name__)
        out = self._encode(command_buffer, src, None, states or [], batch=True)
        return ImageBatch(out)

    def _state_kind(self) -> type:
        if self._gradient_state_class is None:
            raise ValueError(
                f"[{type(self).__name__}] this kernel has no gradient state; "
                "destination_state must be None, got a state"
            )
        return self._gradient_state_class

    def _encode(
        self,
        cb: CommandBuffer,
        src: Image,
        dst: Image | None,
        states: list[Any],
        batch: bool,
        policy_states: Any = None,
    ) -> Image:
        """Validate and plan (restoring the kernel if anything raises), then apply."""
        saved = self._save_geometry()
        try:
            if dst is not None:
                self._check_destination(cb, dst, "destination_image", src)
            desc, props, window, memo = self._plan(src, dst, batch, policy_states, saved)
            for name, value in props.items():  # tentatively: the forward reads them
                object.__setattr__(self, name, value)
            records: Records = []
            if states:  # an inference encode writes no state: no record to make
                dst_shape = desc.shape if dst is None else dst._shape  # type: ignore[union-attr]
                records = self._records(window, memo, src, dst_shape, batch, states)
            forward = self._make_forward(window, records, memo)
            out: Any = dst if dst is not None else desc  # given, or a descriptor to allocate
            out_dtype = out._dtype if dst is not None else _FORMAT_TO_DTYPE[out._fmt]
            run = forward_command(forward, src, window, out_dtype, memo)
        except BaseException:
            self._restore_geometry(saved)
            raise
        enc = Encoding(run, (out,), (src,), records, None, batch)
        return self._apply(cb, enc)[0]  # type: ignore[return-value]

    def _records(
        self, window: Window, memo: dict[str, Any], src: Image, dst_shape: Any, batch: bool,
        states: list[Any],
    ) -> Records:  # fmt: skip
        """The typed record of this encode for each state, checked against what it holds."""
        record = ForwardRecord(
            self, window, self._edge_mode, self._offset, self._clip, src._shape, dst_shape,
            self._record_params(window, memo), batch,
        )  # fmt: skip
        unique = _unique(states)
        for st in unique:
            st._check_record(record, type(self).__name__)
        return self._state_records(record, unique)

    def _record_only(self, src: Image, states: list[Any]) -> None:
        """Write into ``states`` the records a batch encode of ``src`` would, and encode no
        command: a graph that ran this kernel's math inside the kernel before it (a ReLU fused
        into an addition) gives the gradient the state it expects. Validated and planned like
        an encode; the kernel is left as it was."""
        saved = self._save_geometry()
        try:
            desc, _, window, memo = self._plan(src, None, True, None, saved)
            records = self._records(window, memo, src, desc.shape, True, states)  # type: ignore[union-attr]
        finally:
            self._restore_geometry(saved)
        for st, record in records:
            st._forward = record

    # -- planning (pure: the kernel is restored before returning) -----------------------------

    _geometry_attrs: tuple[str, ...] = ("_offset", "_edge_mode", "_clip", "_dco", "_sco", "_smax")
    # Reads `_geometry_attrs` as one tuple, in C: `_save_geometry` runs at every encode.
    _read_geometry = staticmethod(attrgetter(*_geometry_attrs))

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "_geometry_attrs" in cls.__dict__:  # a family that saves more (a tuple: 2+ names)
            cls._read_geometry = staticmethod(attrgetter(*cls._geometry_attrs))

    def _whole_images(self) -> bool:
        """Whether an encode reads the whole source and writes the whole destination: offset,
        clip rect and feature-channel offsets and count at their defaults (no tap then reads
        past an edge, so the edge mode does not matter). What a graph's fused command that
        reads this kernel's source itself needs (`mpsnn.graph.plan_passes._normalized_sums`)."""
        return (
            self._offset == Offset()
            and self._clip == RECT_NO_CLIP
            and self._dco == 0
            and self._sco == 0
            and self._smax == _HUGE
        )

    def _save_geometry(self) -> tuple[Any, ...]:
        """``(config, values of _geometry_attrs)``: what `_restore_geometry` puts back, and
        the kernel's part of the plan-cache key."""
        return (self._config, self._read_geometry(self))

    def _restore_geometry(self, saved: tuple[Any, ...]) -> None:
        object.__setattr__(self, "_config", saved[0])
        for name, value in zip(self._geometry_attrs, saved[1], strict=True):
            object.__setattr__(self, name, value)

    def _plan(
        self, src: Image, dst: Image | None, batch: bool, policy_states: Any, saved: tuple[Any, ...]
    ) -> tuple[ImageDescriptor | None, dict[str, Any], Window, dict[str, Any]]:
        """(descriptor to allocate, properties the policy sets, window, memo), cached per
        configuration (``saved``: the kernel's geometry, `_save_geometry`). Padding policies
        and state hooks may change kernel properties while they run; the changes are returned,
        and the kernel is restored."""
        dst_shape = None if dst is None else dst._shape
        key = (src._shape, src._fmt, dst_shape, batch, saved)
        plan = None if policy_states else self._plans.get(key)
        if plan is not None:
            return plan
        try:
            props: dict[str, Any] = {}
            desc = None
            if dst_shape is None:
                desc = self._resolve_policy([src], policy_states)
                dst_shape = desc.shape
                props = {
                    name: getattr(self, name)
                    for name, old in zip(self._geometry_attrs, saved[1], strict=True)
                    if getattr(self, name) != old
                }
            window = self._window(src._shape, dst_shape, self._offset, batch)
            self._check_window(window, src)
        finally:
            self._restore_geometry(saved)
        plan = (desc, props, window, {})
        custom = int(self._padding.padding_method) & _CUSTOM
        if not policy_states and not (dst is None and custom):
            if len(self._plans) >= 32:  # a kernel seldom sees many configurations
                self._plans.clear()
            self._plans[key] = plan
        return plan

    def _window(
        self, src_shape: tuple[int, ...], dst_shape: tuple[int, ...], offset: Offset, batch: bool
    ) -> Window:
        who = type(self).__name__
        sn, sc, sh, sw = src_shape
        dn, dc, dh, dw = dst_shape
        z_src, z_dst, images = resolve_images(who, sn, dn, offset.z, self._clip, batch)
        if self._sco >= sc:
            raise ValueError(
                f"[{who}] source_feature_channel_offset must be < the source's {sc} channels, "
                f"got {self._sco}"
            )
        n_read = min(self._smax, sc - self._sco)
        n_write = self._destination_channels(n_read)
        if self._dco + n_write > dc:
            raise ValueError(
                f"[{who}] the destination needs destination_feature_channel_offset + "
                f"{n_write} channels = {self._dco + n_write}, got a destination with {dc}"
            )
        clip = self._clip
        y0, ny = resolve_span(who, "y", clip.origin.y, clip.size.height, dh)
        x0, nx = resolve_span(who, "x", clip.origin.x, clip.size.width, dw)
        span = DestinationSpan(offset, y0 - clip.origin.y, ny, x0 - clip.origin.x, nx, sh, sw)
        ay, ax = self._axis_windows(span)
        return Window(ay, ax, z_src, z_dst, images, self._sco, n_read, self._dco, n_write, y0, x0)


def _as_list(states: Any) -> list[Any]:
    if states is None:
        return []
    if isinstance(states, State):
        return [states]
    return list(states)
