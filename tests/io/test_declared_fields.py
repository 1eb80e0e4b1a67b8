"""Kernel classes that declare their saved fields (`mpsnn.core.saved`) are saved and loaded by
one generic codec: the file format is the one the hand-written codecs wrote (a checked-in file
of theirs, tests/io/data/declared_kernels.safetensors, made by tests/io/_declared_cases.py, is
written again field for field and loads to equal kernels), every converted class round-trips,
a user's own kernel class is saved with no codec registered, and a bad declaration is refused
when the class is made (or, for what only an instance shows, at save)."""

from __future__ import annotations

import enum
import math

import pytest
import torch

import mpsnn as m
from mpsnn.core.saved import Field, declared_class, saved_fields
from mpsnn.io import register_codec, registered_types
from tests.io._declared_cases import cases
from tests.io._helpers import CPU, ROOT, _equal, _parts, _roundtrip, _write

FIXTURE = ROOT / "tests" / "io" / "data" / "declared_kernels.safetensors"
CASES = cases(CPU)
HAND_WRITTEN = {"Compare", "CropAndResizeBilinear", "CropAndResizeBilinearGradient"}
CONFIGURATION = (
    "label", "options", "offset", "clip_rect", "edge_mode", "source_feature_channel_offset",
    "source_feature_channel_max_count", "destination_feature_channel_offset", "primary_offset",
    "secondary_offset", "primary_edge_mode", "secondary_edge_mode", "primary_stride_in_pixels_x",
    "primary_stride_in_pixels_y", "secondary_stride_in_pixels_x", "secondary_stride_in_pixels_y",
    "primary_source_feature_channel_offset", "secondary_source_feature_channel_offset",
    "primary_source_feature_channel_max_count", "secondary_source_feature_channel_max_count",
    "kernel_offset_x", "kernel_offset_y",
)  # fmt: skip


def _plain(v, depth: int = 0):
    """``v`` as comparable plain values: tensors by dtype, shape and values, objects by their
    slots or attributes (recursively), NaN as a string."""
    if isinstance(v, torch.Tensor):
        return ("tensor", v.dtype, tuple(v.shape), v.tolist())
    if isinstance(v, float) and math.isnan(v):
        return "nan"
    if isinstance(v, list | tuple):
        return (type(v).__name__, [_plain(x, depth + 1) for x in v])
    slots = [s for c in type(v).__mro__ for s in getattr(c, "__slots__", ())]
    if slots and depth < 4 and not isinstance(v, enum.Enum):
        return (type(v).__name__, {s: _plain(getattr(v, s), depth + 1) for s in slots})
    return v


def _attributes(k) -> dict:
    """What a kernel is configured with: its configuration properties, the padding, a gradient
    kernel's properties set by hand, and its declared fields."""
    out = {name: _plain(getattr(k, name)) for name in CONFIGURATION if hasattr(k, name)}
    out["padding"] = (k.padding.padding_method, k.padding.label, k.padding._sets_clamp)
    if isinstance(k, m.GradientKernel):  # what it reports from a forward is not its own
        out["explicit"] = sorted(k._explicit)
    for f in saved_fields(type(k)) or ():
        out[f.name] = _plain(getattr(k, f.attr))
    return out


def _declared_names(kind: type) -> set[str]:
    return {f.name for f in saved_fields(kind) or ()}


# ---------------------------------------------------------------------------------------------
# the file format


def test_every_case_class_declares_its_fields_or_keeps_its_codec() -> None:
    for name, k in CASES.items():
        declared = declared_class(name) is type(k)
        assert declared != (name in {"CropAndResizeBilinear", "CropAndResizeBilinearGradient"})
    assert len(CASES) == 39


def test_the_files_written_are_those_of_the_hand_written_codecs(tmp_path) -> None:
    """Same objects, types, JSON fields and values, tensor names and values (JSON objects are
    unordered: only some classes list their fields in another order)."""
    old, old_tensors = _parts(FIXTURE)
    path = tmp_path / "new.safetensors"
    m.save(list(CASES.values()), path)
    new, new_tensors = _parts(path)
    assert [o["type"] for o in new["objects"]] == [o["type"] for o in old["objects"]]
    for o, n in zip(old["objects"], new["objects"], strict=True):
        assert n == o, o["type"]
    assert new == old
    assert new_tensors.keys() == old_tensors.keys() == {"0.Dropout.counter"}
    assert all(_equal(new_tensors[key], old_tensors[key]) for key in old_tensors)


def test_a_file_of_the_hand_written_codecs_loads_to_equal_kernels(tmp_path) -> None:
    loaded = m.load(FIXTURE, "cpu")
    assert [type(k).__name__ for k in loaded] == list(CASES)
    for k, want in zip(loaded, CASES.values(), strict=True):
        assert type(k) is type(want)
        assert _attributes(k) == _attributes(want), type(k).__name__
    assert int(loaded[list(CASES).index("Dropout")]._counter) == 5
    yolo = loaded[list(CASES).index("YOLOLoss")]
    assert yolo._desc.scale_object == 7.0 and yolo._desc.rescore is False


@pytest.mark.parametrize("name", sorted(set(CASES) - HAND_WRITTEN))
def test_each_declared_class_round_trips(tmp_path, name) -> None:
    k = CASES[name]
    back = _roundtrip(k, tmp_path)
    assert type(back) is type(k)
    assert _attributes(back) == _attributes(k)
    structure, _ = _parts(tmp_path / "obj.safetensors")
    fields = structure["objects"][-1]["fields"]
    assert _declared_names(type(k)) <= set(fields)


def test_a_loaded_dropout_keeps_its_own_counter_tensor(tmp_path) -> None:
    d = m.Dropout(CPU, 0.5, seed=2)
    d._counter.fill_(9)
    back = _roundtrip(d, tmp_path)
    assert back._counter.item() == 9 and back._counter.dtype == torch.int64
    assert back._device_index == back._counter.get_device()


def test_malformed_declared_fields_are_refused_as_the_hand_written_codecs_did(tmp_path) -> None:
    path = tmp_path / "k.safetensors"
    m.save(m.PoolingMax(CPU, 2, 2), path)
    structure, tensors = _parts(path)
    structure["objects"][0]["fields"]["kernel_width"] = 0
    _write(path, structure, tensors)
    with pytest.raises(
        m.CheckpointError,
        match=r"\[load\] object 0 \(PoolingMax\) field 'kernel_width' must be an int >= 1, got 0",
    ):
        m.load(path)
    m.save(m.Compare(CPU), path)
    structure, tensors = _parts(path)
    structure["objects"][0]["fields"]["comparison_type"] = "ABOUT"
    _write(path, structure, tensors)
    with pytest.raises(m.CheckpointError, match=r"field 'comparison_type' must be one of the Comp"):
        m.load(path)
    m.save(m.Dropout(CPU, 0.5), path)
    structure, tensors = _parts(path)
    del structure["objects"][0]["fields"]["seed"]
    _write(path, structure, tensors)
    with pytest.raises(m.CheckpointError, match=r"\(Dropout\) must have the field 'seed'"):
        m.load(path)


def test_a_subclass_that_declares_nothing_is_refused_at_save(tmp_path) -> None:
    class MyPooling(m.PoolingMax):
        pass

    with pytest.raises(TypeError, match=r"objects must be of a registered type .* MyPooling"):
        m.save(MyPooling(CPU, 2, 2), tmp_path / "k.safetensors")


# ---------------------------------------------------------------------------------------------
# a user's kernel class


class Mode(enum.Enum):
    FAST = "fast"
    EXACT = "exact"


class DeclaredScaledSoftMax(m.SoftMax):
    """A user's kernel: saves its constructor's gain and every other kind of field."""

    saved_fields = (
        Field("gain", float),
        Field("steps", int, minimum=1),
        Field("mode", Mode, init=False),
        Field("tag", str, init=False, optional=True),
        Field("stride", m.Size, init=False),
        Field("shift", m.Offset, init=False),
        Field("window", m.Region, init=False),
        Field("neuron", m.NeuronDescriptor, init=False, optional=True),
        Field("table", torch.Tensor, init=False, attr="_table"),
        Field("extra", torch.Tensor, init=False, optional=True),
        Field("flag", bool, init=False),
    )

    def __init__(self, device: m.Device, gain: float, steps: int = 1) -> None:
        super().__init__(device)
        self.gain, self.steps = gain, steps
        self.mode, self.tag, self.flag = Mode.FAST, None, False
        self.stride, self.shift = m.Size(1, 1, 1), m.Offset(0, 0, 0)
        self.window = m.RECT_NO_CLIP
        self.neuron: m.NeuronDescriptor | None = None
        self._table = torch.zeros(3, dtype=torch.float64)
        self.extra: torch.Tensor | None = None


def test_a_user_kernel_class_round_trips_with_no_codec_registered(tmp_path) -> None:
    assert registered_types()["DeclaredScaledSoftMax"] is DeclaredScaledSoftMax
    k = DeclaredScaledSoftMax(CPU, 2.5, steps=3)
    k.mode, k.tag, k.flag = Mode.EXACT, "mine", True
    k.stride, k.shift = m.Size(2, 1, 1), m.Offset(1, -1, 0)
    k.window = m.Region(m.Origin(1, 2, 0), m.Size(3, 4, 1))
    relu = m.NeuronDescriptor(m.NeuronType.RELU, a=0.25)
    k.neuron = relu
    k._table.copy_(torch.tensor([0.5, -1.25, 3.0], dtype=torch.float64))
    k.extra = torch.arange(4, dtype=torch.int32)
    k.label, k.edge_mode = "scaled", m.EdgeMode.CLAMP
    table = k._table
    back, same = _roundtrip({"k": k, "relu": relu}, tmp_path).values()
    assert type(back) is DeclaredScaledSoftMax
    assert (back.gain, back.steps, back.mode, back.tag) == (2.5, 3, Mode.EXACT, "mine")
    assert back.flag is True
    assert (back.stride, back.shift, back.window) == (k.stride, k.shift, k.window)
    assert back.neuron is same and same.a == 0.25  # one object, referenced twice
    assert _equal(back._table, table) and _equal(back.extra, k.extra)
    assert (back.label, back.edge_mode) == ("scaled", m.EdgeMode.CLAMP)
    structure, _ = _parts(tmp_path / "obj.safetensors")
    fields = structure["objects"][1]["fields"]
    assert (fields["gain"], fields["mode"], fields["window"]) == (2.5, "EXACT", [1, 2, 0, 3, 4, 1])
    assert list(fields)[:2] == ["gain", "steps"] and list(fields)[-1] == "flag"

    k.tag, k.neuron, k.extra = None, None, None  # the optional fields
    back = _roundtrip(k, tmp_path)
    assert (back.tag, back.neuron, back.extra) == (None, None, None)


def test_a_registered_codec_replaces_a_declaration(tmp_path) -> None:
    class DeclaredButCoded(m.SoftMax):
        saved_fields = (Field("gain", float, init=False),)

    def encode(k, enc):
        return {"special": k.gain * 2}

    def decode(f):
        k = DeclaredButCoded(f.device)
        k.gain = f.get_float("special") / 2
        return k

    register_codec(DeclaredButCoded, encode, decode)
    k = DeclaredButCoded(CPU)
    k.gain = 1.5
    assert _roundtrip(k, tmp_path).gain == 1.5
    structure, _ = _parts(tmp_path / "obj.safetensors")
    assert structure["objects"][0]["fields"] == {"special": 3.0}


# ---------------------------------------------------------------------------------------------
# bad declarations: when the field or the class is made, else at save


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: Field("x", list), ValueError, r"\[Field\] kind must be int, float, bool, str, an "
         r"Enum class, Size, Offset, Origin, Region, torch.Tensor or a savable class, got list"),
        (lambda: Field("x", dict), ValueError, r"\[Field\] kind must be .* got dict for 'x'"),
        (lambda: Field("x", "int"), TypeError, r"\[Field\] kind must be a class .* got str 'int'"),
        (lambda: Field("x", int | None), TypeError, r"\[Field\] kind must be a class"),
        (lambda: Field("not a name", int), ValueError, r"\[Field\] name must be a Python ident"),
        (lambda: Field("x", float, minimum=0), ValueError, r"\[Field\] minimum must be an int, "
         r"for an int field only, got 0 for the float field 'x'"),
        (lambda: Field("x", int, init=1), TypeError, r"\[Field\] init must be a bool, got int"),
        (lambda: Field("x", int, attr="a-b"), ValueError, r"\[Field\] attr must be a Python"),
    ],
)  # fmt: skip
def test_a_bad_field_is_refused_when_made(make, error, match) -> None:
    with pytest.raises(error, match=match):
        make()


def test_a_bad_declaration_is_refused_when_the_class_is_made() -> None:
    with pytest.raises(ValueError, match=r"\[BadInit\] the init field 'gain' must name a "
                       r"parameter of BadInit.__init__ .*, got the parameters \(device, kernel_width"):  # fmt: skip

        class BadInit(m.SoftMax):
            saved_fields = (Field("gain", float),)

    with pytest.raises(TypeError, match=r"\[BadList\] saved_fields must be a tuple of Field, "
                       r"got list"):  # fmt: skip

        class BadList(m.SoftMax):
            saved_fields = [Field("gain", float, init=False)]  # type: ignore[assignment]  # noqa: RUF012

    with pytest.raises(TypeError, match=r"\[BadItem\] .* got tuple holding other values"):

        class BadItem(m.SoftMax):
            saved_fields = ("gain",)  # type: ignore[assignment]

    with pytest.raises(ValueError, match=r"\[Twice\] saved field names must be distinct, got "
                       r"\['gain'\] twice"):  # fmt: skip

        class Twice(m.SoftMax):
            saved_fields = (Field("gain", float, init=False), Field("gain", int, init=False))

    with pytest.raises(ValueError, match=r"\[ReadOnly\] the field 'device' \(init=False\) must "
                       r"be settable after construction, got the read-only property 'device'"):  # fmt: skip

        class ReadOnly(m.SoftMax):
            saved_fields = (Field("device", m.Device, init=False),)

    with pytest.raises(ValueError, match=r"\[PoolingMax\] a saved name must be declared by one "
                       r"class, got 'PoolingMax' again \(declared by mpsnn.cnn.pooling.Pooling"):  # fmt: skip

        class PoolingMax(m.SoftMax):
            saved_fields = ()

    assert declared_class("PoolingMax") is m.PoolingMax
    assert all(declared_class(n) is None for n in ("BadInit", "BadList", "Twice", "ReadOnly"))


def test_a_class_defined_again_replaces_its_declaration() -> None:
    made = []
    for _ in range(2):

        class DefinedTwice(m.SoftMax):
            saved_fields = ()

        made.append(DefinedTwice)
    assert declared_class("DefinedTwice") is made[1] is not made[0]


def test_what_only_an_instance_shows_is_refused_at_save(tmp_path) -> None:
    path = tmp_path / "k.safetensors"

    class Lacking(m.SoftMax):
        saved_fields = (Field("gain", float, init=False),)

    with pytest.raises(TypeError, match=r"\[save\] Lacking must have the attribute 'gain' its "
                       r"saved field 'gain' reads, got none at root.Lacking"):  # fmt: skip
        m.save(Lacking(CPU), path)

    k = Lacking(CPU)
    k.gain = "high"
    with pytest.raises(TypeError, match=r"\[save\] Lacking field 'gain' must be a number, got str"):
        m.save(k, path)
    k.gain = None
    with pytest.raises(TypeError, match=r"field 'gain' must be a number, got NoneType"):
        m.save(k, path)

    class Clash(m.SoftMax):
        saved_fields = (Field("label", str, init=False),)

    with pytest.raises(TypeError, match=r"\[save\] Clash's saved field names must differ from the "
                       r"kernel configuration's, got \['label'\]"):  # fmt: skip
        m.save(Clash(CPU), path)

    class NotACNNKernel(m.Kernel):
        saved_fields = ()

    with pytest.raises(TypeError, match=r"\[save\] NotACNNKernel declares saved fields, so it must "
                       r"be a CNNKernel, BinaryKernel or GradientKernel"):  # fmt: skip
        m.save(NotACNNKernel(CPU), path)


def test_a_declared_name_and_a_registered_name_never_meet(tmp_path) -> None:
    class Convolution(m.SoftMax):  # a user's class named like mpsnn's own
        saved_fields = ()

    try:
        with pytest.raises(TypeError, match=r"\[save\] a class saved by its declared fields must "
                           r"not be named like a registered type, got .*Convolution named "
                           r"'Convolution' \(registered for mpsnn.cnn.convolution"):  # fmt: skip
            m.save(Convolution(CPU), tmp_path / "k.safetensors")
    finally:
        from mpsnn.core import saved

        del saved._DECLARED["Convolution"]  # leave the registry as the library made it

    class TakenName(m.SoftMax):
        saved_fields = ()

    with pytest.raises(ValueError, match=r"\[register_codec\] a name must be registered once, "
                       r"got 'TakenName', the saved name of .*TakenName"):  # fmt: skip
        register_codec(dict, lambda o, e: {}, lambda f: {}, name="TakenName")
