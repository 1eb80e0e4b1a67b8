"""Forward node classes that declare their saved fields (``saved_fields`` in their family's
module) are saved and loaded by one generic node codec: the file format is the one the
hand-written node codecs wrote (a checked-in file of theirs,
tests/io/data/declared_nodes.safetensors, made by tests/io/_declared_node_cases.py, loads to
equal nodes and is written again field for field, in the same key order), every converted
class round-trips, a user's own node class is saved with no codec registered, and a bad
declaration is refused when the class is made (or, for what only an instance shows, at save).
"""

from __future__ import annotations

import enum
from typing import Any

import pytest

import mpsnn as m
from mpsnn.core.saved import Field, declared_class, saved_fields
from mpsnn.graph.nodes import COMMON_SAVED, UnaryGradientNode, UnaryNode
from mpsnn.io import registered_types
from tests.io._declared_node_cases import cases
from tests.io._helpers import CPU, ROOT, _equal, _parts, _roundtrip, _write
from tests.io.test_declared_fields import _plain
from tests.nodes.test_a_family_in_one_place import ScaledCube, ScaledCubeNode

FIXTURE = ROOT / "tests" / "io" / "data" / "declared_nodes.safetensors"
CASES = cases()
#: the forward node classes whose codecs stay hand-written (what a field list cannot say)
HAND_WRITTEN = {
    "ImageNode", "ConvolutionTransposeNode", "ReshapeNode", "PadNode", "ConcatenationNode",
    "AdditionNode", "SubtractionNode", "MultiplicationNode", "DivisionNode", "ComparisonNode",
    "SpatialNormalizationNode", "LocalContrastNormalizationNode",
    "CrossChannelNormalizationNode", "LossNode", "YOLOLossNode", "CropAndResizeBilinearNode",
    "NeuronNode", "NeuronReLUNode",
}  # fmt: skip


def _image(img: m.ImageNode) -> tuple:
    producer = None if img.producer is None else type(img.producer).__name__
    return (img.handle, img.format, img.export_from_graph, img.stop_gradient, producer)


def _value(v: Any) -> Any:
    """A field's value as comparable plain values (data sources by their tensors)."""
    if isinstance(v, m.ImageNode):
        return ("image", _image(v))
    if isinstance(v, m.ConvolutionDataSource):
        return (type(v).__name__, _plain(v.weights()), _plain(v.bias_terms()))
    if hasattr(v, "gamma") and callable(v.gamma):
        return (type(v).__name__, _plain(v.gamma()), _plain(v.beta()))
    return _plain(v)


def _attributes(node: Any) -> dict:
    """What a node is configured with: what every node saves and its declared fields."""
    pad = node.padding_policy
    state = node.result_state
    out = {
        "sources": [_image(s) for s in node.source_images],
        "label": node.label,
        "padding_policy": None if pad is None else (pad.padding_method, pad.label),
        "trainable": node.trainable,
        "result_image": _image(node.result_image),
        "result_state": None if state is None else (state.handle, state.export_from_graph),
    }
    for f in saved_fields(type(node)) or ():
        out[f.name] = _value(getattr(node, f.attr))
    return out


# ---------------------------------------------------------------------------------------------
# the file format


def test_every_case_class_declares_its_fields() -> None:
    for node in CASES.values():
        assert declared_class(type(node).__name__) is type(node)
        assert registered_types()[type(node).__name__] is type(node)
    assert len({type(n) for n in CASES.values()}) == 37
    for name in HAND_WRITTEN:  # kept: their codecs are registered
        assert declared_class(name) is None and name in registered_types()


def test_the_files_written_are_those_of_the_hand_written_codecs(tmp_path) -> None:
    """Same objects, types, JSON fields and values (in the same key order), tensor names and
    values."""
    old, old_tensors = _parts(FIXTURE)
    path = tmp_path / "new.safetensors"
    m.save(list(CASES.values()), path)
    new, new_tensors = _parts(path)
    for o in new["objects"]:  # a field added after the fixture: a data source's memory order
        if o["type"] == "TensorConvolutionDataSource":
            assert o["fields"].pop("weights_memory", "ohwi") == "ohwi"
    assert [o["type"] for o in new["objects"]] == [o["type"] for o in old["objects"]]
    for o, n in zip(old["objects"], new["objects"], strict=True):
        assert n == o, o["type"]
        assert list(n["fields"]) == list(o["fields"]), o["type"]
    assert new == old
    assert new_tensors.keys() == old_tensors.keys()
    assert len(old_tensors) == 12  # the data sources' weights, biases and statistics
    assert all(_equal(new_tensors[key], old_tensors[key]) for key in old_tensors)


def test_a_file_of_the_hand_written_codecs_loads_to_equal_nodes(tmp_path) -> None:
    loaded = m.load(FIXTURE, "cpu")
    assert len(loaded) == len(CASES)
    for node, want in zip(loaded, CASES.values(), strict=True):
        assert type(node) is type(want)
        assert _attributes(node) == _attributes(want), type(node).__name__
    by_key = dict(zip(CASES, loaded, strict=True))
    assert by_key["DilatedPoolingMaxNode"].dilation_rate_x == 4
    assert by_key["ConvolutionNode"].accumulator_precision is (
        m.ConvolutionAccumulatorPrecisionOption.HALF
    )
    # shared objects stay shared: the graph input, the loss descriptor, the forward loss
    assert len({id(n.source_images[0]) for n in loaded[:10]}) == 1
    assert by_key["ForwardLossNode"].descriptor is by_key["ForwardLossNode (no weights)"].descriptor
    assert by_key["InitialGradientNode"].source_images[0].producer is by_key["ForwardLossNode"]
    # ... and a loaded file is written again as it was
    path = tmp_path / "again.safetensors"
    m.save(loaded, path)
    (old, old_tensors), (new, new_tensors) = _parts(FIXTURE), _parts(path)
    assert new == old and new_tensors.keys() == old_tensors.keys()
    assert all(_equal(new_tensors[key], old_tensors[key]) for key in old_tensors)


@pytest.mark.parametrize("key", list(CASES))
def test_each_declared_class_round_trips(tmp_path, key) -> None:
    node = CASES[key]
    back = _roundtrip(node, tmp_path)
    assert type(back) is type(node)
    assert _attributes(back) == _attributes(node)
    structure, _ = _parts(tmp_path / "obj.safetensors")
    fields = structure["objects"][-1]["fields"]
    assert set(fields) == set(COMMON_SAVED) | {f.name for f in saved_fields(type(node)) or ()}


def test_a_loaded_scale_node_keeps_its_saved_stop_gradient(tmp_path) -> None:
    node = m.BilinearScaleNode(m.ImageNode("x"), m.Size(4, 4, 1))
    node.result_image.stop_gradient = False  # the constructor's True is replaced by the file's
    assert _roundtrip(node, tmp_path).result_image.stop_gradient is False


# ---------------------------------------------------------------------------------------------
# a user's own node class


def test_a_user_node_class_is_saved_with_no_codec_registered(tmp_path) -> None:
    assert declared_class("ScaledCubeNode") is ScaledCubeNode
    assert declared_class("ScaledCube") is ScaledCube
    node = ScaledCubeNode(m.ImageNode("x"), 0.625)
    node.label = "cube"
    back = _roundtrip(node, tmp_path)
    assert type(back) is ScaledCubeNode and back.factor == 0.625 and back.label == "cube"
    structure, _ = _parts(tmp_path / "obj.safetensors")
    assert structure["objects"][-1]["type"] == "ScaledCubeNode"
    assert structure["objects"][-1]["fields"]["factor"] == 0.625


class _Tagged(enum.Enum):
    RED = 1
    BLUE = 2


class TaggedCubeNode(ScaledCubeNode):
    """A node with a field set after construction, an optional object and a second source."""

    saved_fields = (
        Field("factor", float),
        Field("other", m.ImageNode, optional=True, attr="_other"),
        Field("tag", _Tagged, init=False),
        Field("size", m.Size, init=False, attr="_size"),
    )

    def __init__(self, source: m.ImageNode, factor: float = 1.0, other: Any = None) -> None:
        UnaryNode.__init__(self, source)
        if other is not None:
            self._sources.append(other)
        self.factor, self._other = factor, other
        self.tag = _Tagged.RED
        self._size = m.Size(1, 1, 1)


def test_a_user_node_with_a_second_source_and_fields_set_after_construction(tmp_path) -> None:
    x, y = m.ImageNode("x"), m.ImageNode("y")
    node = TaggedCubeNode(x, 2.0, y)
    node.tag, node._size = _Tagged.BLUE, m.Size(3, 2, 1)
    back = _roundtrip(node, tmp_path)
    assert [s.handle for s in back.source_images] == ["x", "y"]
    assert back._other is back.source_images[1]
    assert (back.factor, back.tag, back._size) == (2.0, _Tagged.BLUE, m.Size(3, 2, 1))
    fields = _parts(tmp_path / "obj.safetensors")[0]["objects"][-1]["fields"]
    assert list(fields)[:5] == ["source", "factor", "other", "tag", "size"]
    assert (fields["tag"], fields["size"]) == ("BLUE", [3, 2, 1])


# ---------------------------------------------------------------------------------------------
# bad declarations


def test_a_gradient_node_may_not_declare_saved_fields() -> None:
    with pytest.raises(ValueError, match=r"\[BadCubeGradientNode\] a gradient node is saved as"):

        class BadCubeGradientNode(UnaryGradientNode):
            saved_fields = ()


def test_a_field_may_not_take_a_name_every_node_saves() -> None:
    with pytest.raises(
        ValueError,
        match=r"\[LabelledCubeNode\] saved field names must not be those its base class saves "
        r"already \(source, trainable, label, .*\), got \['label'\]",
    ):

        class LabelledCubeNode(ScaledCubeNode):
            saved_fields = (Field("factor", float), Field("label", str, init=False))


def test_an_init_field_must_name_a_constructor_parameter() -> None:
    with pytest.raises(
        ValueError, match=r"\[GainCubeNode\] the init field 'gain' must name a parameter"
    ):

        class GainCubeNode(ScaledCubeNode):
            saved_fields = (Field("gain", float),)


def test_saved_fields_must_be_a_tuple_of_field() -> None:
    with pytest.raises(TypeError, match=r"\[ListCubeNode\] saved_fields must be a tuple of Field"):

        class ListCubeNode(ScaledCubeNode):
            saved_fields = [Field("factor", float)]  # type: ignore[assignment]  # noqa: RUF012


def test_code_attributes_must_be_a_tuple_of_names() -> None:
    with pytest.raises(
        TypeError,
        match=r"\[CodeCubeNode\] code_attributes must be a tuple of attribute names, "
        r"got 'call_back'",
    ):

        class CodeCubeNode(ScaledCubeNode):
            code_attributes = "call_back"  # type: ignore[assignment]


class CallbackCubeNode(ScaledCubeNode):
    saved_fields = (Field("factor", float),)
    code_attributes = ("call_back",)

    def __init__(self, source: m.ImageNode, factor: float = 1.0) -> None:
        super().__init__(source, factor)
        self.call_back: Any = None


def test_save_refuses_code_attributes_and_values_of_the_wrong_kind(tmp_path) -> None:
    node = CallbackCubeNode(m.ImageNode("x"), 0.5)
    assert _roundtrip(node, tmp_path).call_back is None  # None: saved
    node.call_back = print
    with pytest.raises(
        TypeError,
        match=r"\[save\] CallbackCubeNode\.call_back must be None to be saved \(it is code, "
        r"which a file does not hold: set it again after loading\), got builtin_function_or_"
        r"method at root\.CallbackCubeNode",
    ):
        m.save(node, tmp_path / "f.safetensors")
    node.call_back, node.factor = None, "0.5"
    with pytest.raises(
        TypeError,
        match=r"\[save\] CallbackCubeNode field 'factor' must be a number, got str at "
        r"root\.CallbackCubeNode",
    ):
        m.save(node, tmp_path / "f.safetensors")


class TwoSourceCubeNode(ScaledCubeNode):
    saved_fields = (Field("factor", float),)

    def __init__(self, source: m.ImageNode, factor: float = 1.0) -> None:
        super().__init__(source, factor)
        self._sources.append(m.ImageNode("hidden"))


def test_save_refuses_a_second_source_no_field_holds(tmp_path) -> None:
    with pytest.raises(
        TypeError,
        match=r"\[save\] TwoSourceCubeNode has 2 sources: the first is saved as 'source', each "
        r"other must be the value of one of its ImageNode fields, got sources \[1\] in none",
    ):
        m.save(TwoSourceCubeNode(m.ImageNode("x")), tmp_path / "f.safetensors")


def test_load_refuses_a_bad_field_of_a_declared_node(tmp_path) -> None:
    path = tmp_path / "obj.safetensors"
    m.save(m.PoolingMaxNode(m.ImageNode("x"), 2), path)
    structure, tensors = _parts(path)
    structure["objects"][-1]["fields"]["kernel_width"] = 0
    _write(path, structure, tensors)
    with pytest.raises(
        m.CheckpointError,
        match=r"\[load\] object 1 \(PoolingMaxNode\) field 'kernel_width' must be an int >= 1, "
        r"got 0",
    ):
        m.load(path, CPU)
    structure["objects"][-1]["fields"]["kernel_width"] = 2
    structure["objects"][-1]["fields"]["extra"] = 1
    _write(path, structure, tensors)
    with pytest.raises(m.CheckpointError, match=r"must have only the fields its type reads"):
        m.load(path, CPU)
