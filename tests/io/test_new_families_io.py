"""Round trips of the Gram matrix, comparison, reduction, local correlation, resize and scale
kernels and nodes: the configuration comes back, the loaded kernels compute the same on random
float64 inputs (the gradients too), a saved graph of the new nodes (an inference graph of all
of them, a training graph through the Gram matrix and the resizes) reloads and computes the
same, and what is code (a Gram matrix callback, a scale transform provider) is refused."""

from __future__ import annotations

import pytest
import torch

import mpsnn as m
from tests.io._graphs import DEV, F64, run, same
from tests.io._helpers import _object, _parts, _roundtrip, _write

REGIONS = [(0.1, 0.05, 0.7, 0.8), (0.9, 1.1, -0.6, -1.2)]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _x(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


def _ties(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """Values on a half-integer grid: comparisons meet equal values."""
    return torch.randint(-3, 4, shape, generator=gen).double() / 2


def _destination(k, *sources: m.Image) -> m.Image:
    """The destination the padding policy sizes, with the channels before
    ``destination_feature_channel_offset`` too (filled with a value of its own)."""
    n, c, h, w = k.destination_image_descriptor(list(sources)).shape
    dco = k.destination_feature_channel_offset
    return m.Image.from_tensor(torch.full((n, dco + c, h, w), -7.0, dtype=torch.float64))


def _unary(k, x: torch.Tensor) -> torch.Tensor:
    cb = DEV.new_command_queue().command_buffer()
    src = m.Image.from_tensor(x)
    dst = _destination(k, src)
    k.encode(cb, src, dst)
    cb.commit()
    cb.wait_until_completed()
    return dst.tensor


def _binary(k, a: torch.Tensor, b: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    cb = DEV.new_command_queue().command_buffer()
    ai, bi = m.Image.from_tensor(a), m.Image.from_tensor(b)
    dst = m.Image.from_tensor(torch.full(shape, -7.0, dtype=torch.float64))
    k.encode(cb, ai, bi, dst)
    cb.commit()
    cb.wait_until_completed()
    return dst.tensor


def _gradient(fwd, grad, x: torch.Tensor, g_seed: int) -> torch.Tensor:
    """The forward (``fwd``, unchanged) then ``grad`` on a random incoming gradient."""
    cb = DEV.new_command_queue().command_buffer()
    src = m.Image.from_tensor(x)
    st = fwd.result_state(src)
    y = fwd.encode(cb, src, None, st)
    g = m.Image.from_tensor(_x(_gen(g_seed), *y.shape))
    dx = grad.encode(cb, g, src, st)
    cb.commit()
    cb.wait_until_completed()
    return dx.tensor


_SHARED = ("label", "options", "clip_rect", "destination_feature_channel_offset")
_UNARY = (
    *_SHARED, "offset", "edge_mode", "source_feature_channel_offset",
    "source_feature_channel_max_count",
)  # fmt: skip
_BINARY = (
    *_SHARED, "primary_offset", "secondary_offset", "primary_edge_mode", "secondary_edge_mode",
    "primary_stride_in_pixels_x", "primary_stride_in_pixels_y", "secondary_stride_in_pixels_x",
    "secondary_stride_in_pixels_y", "primary_source_feature_channel_offset",
    "secondary_source_feature_channel_offset", "primary_source_feature_channel_max_count",
    "secondary_source_feature_channel_max_count",
)  # fmt: skip


def _same_configuration(a, b, names) -> None:
    assert type(a) is type(b)
    for name in names:
        assert getattr(a, name) == getattr(b, name), name
        assert type(getattr(a, name)) is type(getattr(b, name)), name
    assert b.padding.padding_method == a.padding.padding_method
    assert b.padding.label == a.padding.label


def _label(k) -> None:
    k.label = "mine"
    k.options = m.KernelOptions.ALLOW_REDUCED_PRECISION
    k.padding = m.DefaultPadding(m.PaddingMethod.SIZE_SAME, label="policy")


# -- kernels ------------------------------------------------------------------------------------


def test_gram_matrix_and_its_gradient_round_trip(tmp_path) -> None:
    fwd = m.GramMatrixCalculation(DEV, 0.375)
    _label(fwd)
    fwd.source_feature_channel_offset = 1
    fwd.source_feature_channel_max_count = 3
    fwd.destination_feature_channel_offset = 1
    grad = m.GramMatrixCalculationGradient(DEV, 0.375)
    grad.label = "its gradient"
    grad.primary_edge_mode = m.EdgeMode.ZERO  # set by hand (it matches the forward)
    fwd2, grad2 = _roundtrip([fwd, grad], tmp_path)
    _same_configuration(fwd, fwd2, (*_UNARY, "alpha"))
    assert (grad2.alpha, grad2.label, grad2._explicit) == (
        0.375,
        "its gradient",
        {"primary_edge_mode"},
    )
    x = _x(_gen(1), 2, 5, 4, 3)
    assert torch.equal(_unary(fwd2, x), _unary(fwd, x))
    plain = m.GramMatrixCalculation(DEV, 0.375)  # the gradients of one forward
    assert torch.equal(_gradient(plain, grad2, x, 2), _gradient(plain, grad, x, 2))


def test_compare_keeps_its_arithmetic_and_comparison_fields(tmp_path) -> None:
    k = m.Compare(DEV)
    k.comparison_type = m.ComparisonType.LESS_OR_EQUAL
    k.threshold = 0.5
    k.primary_scale, k.secondary_scale, k.bias = 2.0, -1.0, 0.25
    k.minimum_value, k.maximum_value = 0.0, 1.0
    k.secondary_stride_in_feature_channels = 0
    k.primary_offset = m.Offset(1, 0, 0)
    k.primary_edge_mode = m.EdgeMode.CLAMP
    k.clip_rect = m.Region.make(0, 1, 3, 2, 0, 2)
    k.destination_feature_channel_offset = 1
    k.label = "cmp"
    path = tmp_path / "cmp.safetensors"
    m.save(k, path)
    fields = _object(_parts(path)[0], "Compare")["fields"]  # its own type, not an arithmetic's
    assert (fields["comparison_type"], fields["threshold"]) == ("LESS_OR_EQUAL", 0.5)
    k2 = m.load(path)
    arithmetic = ("primary_scale", "secondary_scale", "bias", "minimum_value", "maximum_value")
    strides = ("primary_stride_in_feature_channels", "secondary_stride_in_feature_channels")
    _same_configuration(k, k2, (*_BINARY, *arithmetic, *strides, "comparison_type", "threshold"))
    g = _gen(3)
    a, b = _ties(g, 2, 3, 4, 5), _ties(g, 2, 1, 4, 5)
    y = _binary(k, a, b, (2, 4, 4, 5))
    assert torch.equal(_binary(k2, a, b, (2, 4, 4, 5)), y)
    assert set(y[:, 1:, 1:3, :3].unique().tolist()) == {0.25, 1.0}  # holds + bias, and not


def test_a_subclass_of_compare_is_not_saved_as_compare(tmp_path) -> None:
    class MyCompare(m.Compare):
        pass

    with pytest.raises(TypeError, match=r"objects must be of a registered type .* MyCompare"):
        m.save(MyCompare(DEV), tmp_path / "sub.safetensors")


UNARY_REDUCTIONS = [
    m.ReduceRowMin, m.ReduceRowMax, m.ReduceRowMean, m.ReduceRowSum,
    m.ReduceColumnMin, m.ReduceColumnMax, m.ReduceColumnMean, m.ReduceColumnSum,
    m.ReduceFeatureChannelsMin, m.ReduceFeatureChannelsMax, m.ReduceFeatureChannelsMean,
    m.ReduceFeatureChannelsSum, m.ReduceFeatureChannelsArgumentMin,
    m.ReduceFeatureChannelsArgumentMax,
]  # fmt: skip


@pytest.mark.parametrize("cls", UNARY_REDUCTIONS, ids=lambda c: c.__name__)
def test_unary_reductions_round_trip(cls, tmp_path) -> None:
    k = cls(DEV)
    _label(k)
    k.clip_rect_source = m.Region.make(1, 1, 4, 3, 0, 2)
    k.source_feature_channel_offset = 1
    k.destination_feature_channel_offset = 1
    if cls is m.ReduceFeatureChannelsSum:
        k.weight = 0.75
    k2 = _roundtrip(k, tmp_path)
    extra = ("clip_rect_source", "weight") if cls is m.ReduceFeatureChannelsSum else ("clip_rect_source",)  # fmt: skip
    _same_configuration(k, k2, (*_UNARY, *extra))
    x = _x(_gen(4), 3, 4, 5, 6)
    assert torch.equal(_unary(k2, x), _unary(k, x))


@pytest.mark.parametrize(
    "make",
    [
        lambda: m.ReduceFeatureChannelsAndWeightsMean(DEV),
        lambda: m.ReduceFeatureChannelsAndWeightsSum(DEV),
        lambda: m.ReduceFeatureChannelsAndWeightsSum(DEV, True),
        lambda: m.LocalCorrelation(DEV, 2, 1, 1, 2),
    ],
    ids=["weights-mean", "weights-sum", "weights-sum-non-zero", "local-correlation"],
)
def test_binary_reductions_and_local_correlation_round_trip(make, tmp_path) -> None:
    k = make()
    _label(k)
    k.primary_source_clip_rect = m.Region.make(1, 0, 4, 4, 0, 2)
    k.primary_source_feature_channel_offset = 1
    k.secondary_source_feature_channel_offset = 1
    k.destination_feature_channel_offset = 1
    correlation = isinstance(k, m.LocalCorrelation)
    if not correlation:
        k.secondary_source_clip_rect = m.Region.make(2, 1, 1, 1, 0, 2)  # one weight per channel
    k2 = _roundtrip(k, tmp_path)
    names = ("primary_source_clip_rect", "secondary_source_clip_rect")
    if correlation:
        names += ("window_in_x", "window_in_y", "stride_in_x", "stride_in_y")
    elif isinstance(k, m.ReduceFeatureChannelsAndWeightsSum):
        names += ("do_weighted_sum_by_non_zero_weights",)
    _same_configuration(k, k2, (*_BINARY, *names))
    g = _gen(5)
    a, b = _x(g, 2, 4, 5, 6), _x(g, 2, 4, 5, 6)
    b[:, 2] = 0  # a zero weight (the non-zero-weights division)
    shape = (2, 16 if correlation else 2, 4, 4)
    y = _binary(k, a, b, shape)
    assert torch.equal(_binary(k2, a, b, shape), y) and bool(y[:, 1:].abs().sum() > 0)


def test_resize_bilinear_and_its_gradient_round_trip(tmp_path) -> None:
    fwd = m.ResizeBilinear(DEV, 7, 3, True)
    fwd.edge_mode = m.EdgeMode.ZERO
    fwd.offset = m.Offset(1, 0, 0)
    fwd.clip_rect = m.Region.make(1, 0, 5, 3, 0, 2)
    fwd.label = "resize"
    grad = m.ResizeBilinearGradient(DEV, 7, 3, True)
    fwd2, grad2 = _roundtrip((fwd, grad), tmp_path)
    _same_configuration(fwd, fwd2, (*_UNARY, "resize_width", "resize_height", "align_corners"))
    assert (grad2.resize_width, grad2.resize_height, grad2.align_corners) == (7, 3, True)
    assert grad2._explicit == set()
    x = _x(_gen(6), 2, 3, 5, 6)
    dst = torch.zeros(2, 3, 3, 7, dtype=torch.float64)
    outs = []
    for k in (fwd, fwd2):
        cb = DEV.new_command_queue().command_buffer()
        d = m.Image.from_tensor(dst.clone())
        k.encode(cb, m.Image.from_tensor(x), d)
        cb.commit()
        cb.wait_until_completed()
        outs.append(d.tensor)
    assert torch.equal(outs[0], outs[1]) and bool(outs[0].abs().sum() > 0)
    plain = m.ResizeBilinear(DEV, 7, 3, True)
    assert torch.equal(_gradient(plain, grad2, x, 7), _gradient(plain, grad, x, 7))


def test_crop_and_resize_and_its_gradient_round_trip(tmp_path) -> None:
    fwd = m.CropAndResizeBilinear(DEV, 4, 3, 2, REGIONS)
    _label(fwd)
    fwd.source_feature_channel_offset = 1
    grad = m.CropAndResizeBilinearGradient(DEV, 4, 3, 2, REGIONS)
    grad.secondary_edge_mode = m.EdgeMode.ZERO
    fwd2, grad2 = _roundtrip([fwd, grad], tmp_path)
    _same_configuration(fwd, fwd2, (*_UNARY, "resize_width", "resize_height", "regions"))
    assert grad2.regions == grad.regions == tuple(REGIONS) and grad2.number_of_regions == 2
    assert grad2._explicit == {"secondary_edge_mode"}
    x = _x(_gen(8), 2, 3, 5, 6)
    assert torch.equal(_unary(fwd2, x), _unary(fwd, x))
    plain = m.CropAndResizeBilinear(DEV, 4, 3, 2, REGIONS)
    assert torch.equal(_gradient(plain, grad2, x, 9), _gradient(plain, grad, x, 9))


def test_malformed_new_kernel_fields_are_rejected(tmp_path) -> None:
    path = tmp_path / "k.safetensors"
    m.save(m.CropAndResizeBilinear(DEV, 4, 3, 2, REGIONS), path)
    structure, tensors = _parts(path)
    _object(structure, "CropAndResizeBilinear")["fields"]["regions"] = [[0.1, 0.2, 0.3]]
    _write(path, structure, tensors)
    with pytest.raises(m.CheckpointError, match="field 'regions' must be a non-empty list"):
        m.load(path)
    m.save(m.Compare(DEV), path)
    structure, tensors = _parts(path)
    _object(structure, "Compare")["fields"]["comparison_type"] = "ABOUT"
    _write(path, structure, tensors)
    with pytest.raises(m.CheckpointError, match="'comparison_type' must be one of the Compari"):
        m.load(path)
    m.save(m.ResizeBilinearGradient(DEV, 2, 2), path)
    structure, tensors = _parts(path)
    _object(structure, "ResizeBilinearGradient")["fields"]["geometry"] = {"stride": 1}
    _write(path, structure, tensors)
    with pytest.raises(m.CheckpointError, match="field 'geometry' must map some of"):
        m.load(path)


# -- nodes and graphs -----------------------------------------------------------------------


REDUCTION_NODES = [
    m.nodes.UnaryReductionNode, m.ReductionRowMinNode, m.ReductionRowMaxNode,
    m.ReductionRowMeanNode, m.ReductionRowSumNode, m.ReductionColumnMinNode,
    m.ReductionColumnMaxNode, m.ReductionColumnMeanNode, m.ReductionColumnSumNode,
    m.ReductionFeatureChannelsMinNode, m.ReductionFeatureChannelsMaxNode,
    m.ReductionFeatureChannelsMeanNode, m.ReductionFeatureChannelsSumNode,
    m.ReductionFeatureChannelsArgumentMinNode, m.ReductionFeatureChannelsArgumentMaxNode,
]  # fmt: skip


def _inference_nodes() -> tuple[list[m.ImageNode], dict[str, object]]:
    x, y = m.ImageNode("x"), m.ImageNode("y")
    nodes: dict[str, object] = {
        "gram": m.GramMatrixCalculationNode(x, 0.25),
        "cmp": m.ComparisonNode(x, y),
        "resize": m.ResizeBilinearNode(x, 9, 4, align_corners=True),
        "crop": m.CropAndResizeBilinearNode(x, 3, 5, 2, REGIONS),
        "bilinear": m.BilinearScaleNode(x, m.Size(5, 7, 1)),
        "lanczos": m.LanczosScaleNode(x, m.Size(4, 3, 1)),
    }
    cmp = nodes["cmp"]
    cmp.comparison_type = m.ComparisonType.GREATER_OR_EQUAL
    cmp.threshold = 0.5
    cmp.primary_scale = 2.0
    for cls in REDUCTION_NODES:
        node = cls(x)
        node.clip_rect_source = m.Region.make(1, 0, 4, 5, 0, 2)
        if cls is m.ReductionFeatureChannelsSumNode:
            node.weight = -0.5
        nodes[cls.__name__] = node
    nodes["resize"].label = "resized"
    nodes["lanczos"].result_image.export_from_graph = True
    return [n.result_image for n in nodes.values()], nodes


def test_an_inference_graph_of_every_new_node_reloads_and_computes_the_same(tmp_path) -> None:
    results, nodes = _inference_nodes()
    graph = m.Graph.from_results(DEV, results)
    graph.format = F64
    loaded = _roundtrip({"graph": graph, "nodes": nodes}, tmp_path)
    graph2, nodes2 = loaded["graph"], loaded["nodes"]
    for name, node in nodes.items():
        node2 = nodes2[name]
        assert type(node2) is type(node), name
        assert node2.label == node.label
        assert node2.result_image.stop_gradient == node.result_image.stop_gradient
        assert node2.result_image.export_from_graph == node.result_image.export_from_graph
    assert nodes2["gram"].alpha == 0.25
    assert nodes2["cmp"].properties == nodes["cmp"].properties
    assert nodes2["cmp"].comparison_type is m.ComparisonType.GREATER_OR_EQUAL
    assert (nodes2["resize"].resize_width, nodes2["resize"].align_corners) == (9, True)
    assert nodes2["crop"].regions == tuple(REGIONS)
    assert nodes2["bilinear"].output_size == m.Size(5, 7, 1)
    assert nodes2["lanczos"].result_image.stop_gradient  # a scale node ends training graphs
    for cls in REDUCTION_NODES:
        assert nodes2[cls.__name__].clip_rect_source == m.Region.make(1, 0, 4, 5, 0, 2)
    assert nodes2["ReductionFeatureChannelsSumNode"].weight == -0.5
    g = _gen(10)
    inputs = {"x": _ties(g, 2, 3, 6, 7), "y": _ties(g, 2, 3, 6, 7)}
    outs = []
    for gr in (graph, graph2):
        assert gr.source_image_handles == graph.source_image_handles
        first = run(gr, [inputs[h] for h in gr.source_image_handles])
        outs.append([first.tensor] + [b.tensor for b in gr.intermediate_images])
    assert len(outs[0]) == len(results) == len(outs[1])
    for a, b in zip(*outs, strict=True):
        assert same(a, b)


def test_a_training_graph_through_gram_and_resizes_reloads_and_steps_the_same(tmp_path) -> None:
    g = _gen(11)
    desc = m.ConvolutionDescriptor(3, 3, 2, 3)
    ds = m.TensorConvolutionDataSource(
        desc, _x(g, *desc.weights_shape) / 4, _x(g, 3) / 10,
        m.SGD(DEV, descriptor=m.OptimizerDescriptor(learning_rate=0.1)),
    )  # fmt: skip
    x = m.ImageNode("x")
    conv = m.ConvolutionNode(x, ds)
    resized = m.ResizeBilinearNode(conv.result_image, 7, 5)
    crop = m.CropAndResizeBilinearNode(resized.result_image, 4, 4, 2, REGIONS)
    gram = m.GramMatrixCalculationNode(crop.result_image, 0.1)
    loss = m.LossNode(
        gram.result_image,
        m.LossDescriptor(m.LossType.MEAN_SQUARED_ERROR, m.ReductionType.SUM, weight=0.5),
    )
    made: list[str] = []
    (terminal,) = loss.training_graph(None, lambda node, *_: made.append(type(node).__name__))
    assert {"GramMatrixCalculationGradientNode", "CropAndResizeBilinearGradientNode",
            "ResizeBilinearGradientNode"} <= set(made)  # fmt: skip
    graph = m.Graph(DEV, terminal.result_image, False)
    graph.format = F64
    path = tmp_path / "train.safetensors"
    m.save(graph, path)
    types = [o["type"] for o in _parts(path)[0]["objects"]]
    assert "GramMatrixCalculationGradientNode" in types and "ResizeBilinearGradientNode" in types
    graph2 = m.load(path)
    ds2 = graph2._plan.order[0].data_source
    for step in range(2):
        xt, target = _x(g, 2, 2, 6, 6), _x(g, 2, 6, 1, 6)
        losses = []
        for gr in (graph, graph2):
            labels = m.LossLabels(DEV, target.clone())
            run(gr, [xt], [labels])
            losses.append(labels.loss_image().tensor.clone())
        assert same(losses[0], losses[1]), step
        assert same(ds.weights(), ds2.weights()) and same(ds.bias_terms(), ds2.bias_terms())
    assert not torch.equal(ds.weights(), graph2._plan.order[0].data_source.weights() * 0)


def test_code_on_a_node_is_refused_with_a_clear_message(tmp_path) -> None:
    class Alpha:
        def alpha(self, source_image, destination_image):
            return 0.5

    class Provider:
        def transform_for_source_image(self, source_image, handle):
            return None

    x = m.ImageNode("x")
    gram = m.GramMatrixCalculationNode(x)
    gram.property_call_back = Alpha()
    path = tmp_path / "code.safetensors"
    with pytest.raises(
        TypeError,
        match=r"GramMatrixCalculationNode\.property_call_back must be None to be saved \(it is "
        r"code, which a file does not hold: set it again after loading\), got Alpha",
    ):
        m.save(m.Graph(DEV, gram.result_image), path)
    assert not path.exists()
    for cls in (m.BilinearScaleNode, m.LanczosScaleNode):
        node = cls(x, m.Size(3, 3, 1), Provider())
        with pytest.raises(
            TypeError, match=rf"{cls.__name__}\.transform_provider must be None .* got Provider"
        ):
            m.save(node.result_image, path)
    cmp = m.ComparisonNode(x, x)
    cmp.comparison_type = 2  # not a ComparisonType: the kernel would refuse it too
    with pytest.raises(
        TypeError, match=r"ComparisonNode\.comparison_type must be a ComparisonType"
    ):
        m.save(cmp, path)
    assert not path.exists()


def test_a_file_naming_the_abstract_scale_node_is_rejected(tmp_path) -> None:
    node = m.BilinearScaleNode(m.ImageNode("x"), m.Size(3, 3, 1))
    path = tmp_path / "scale.safetensors"
    m.save(node, path)
    structure, tensors = _parts(path)
    _object(structure, "BilinearScaleNode")["type"] = "ScaleNode"
    _write(path, structure, tensors)
    with pytest.raises(m.CheckpointError, match="ScaleNode is abstract"):
        m.load(path)


# -- the YOLO loss --------------------------------------------------------------------------

ANCHORS = [(1.0, 2.0), (1.5, 1.0)]


def _yolo_descriptor() -> m.YOLOLossDescriptor:
    d = m.YOLOLossDescriptor(
        m.LossType.MEAN_SQUARED_ERROR, m.LossType.HUBER, m.LossType.SIGMOID_CROSS_ENTROPY,
        m.LossType.SOFTMAX_CROSS_ENTROPY, m.ReductionType.SUM, ANCHORS, rescore=False,
        scale_xy=3.0, scale_wh=4.5, scale_no_object=0.5, scale_object=7.0, scale_class=1.25,
        min_iou_for_object_presence=0.6, max_iou_for_object_absence=0.2,
    )  # fmt: skip
    d.wh_loss_descriptor.delta = 0.75  # a sub-descriptor's own field
    d.classes_loss_descriptor.label_smoothing = 0.1
    return d


_YOLO_FIELDS = (
    "reduction_type", "rescore", "anchor_boxes", "number_of_anchor_boxes", "scale_xy", "scale_wh",
    "scale_no_object", "scale_object", "scale_class", "min_iou_for_object_presence",
    "max_iou_for_object_absence",
)  # fmt: skip


def test_yolo_descriptor_kernel_and_node_round_trip(tmp_path) -> None:
    from tests.cnn._yolo_reference import random_labels

    d = _yolo_descriptor()
    kernel = m.YOLOLoss(DEV, d)
    kernel.label = "yolo"
    x = m.ImageNode("x")
    node = m.YOLOLossNode(x, d)
    node.input_labels.handle = "labels"
    d2, kernel2, node2 = _roundtrip([d, kernel, node], tmp_path)
    assert node2.descriptor is d2  # the node keeps the descriptor it was given, as saved
    for name in _YOLO_FIELDS:
        assert getattr(d2, name) == getattr(d, name), name
        assert getattr(kernel2, name) == getattr(kernel, name), name
    assert d2.wh_loss_descriptor.delta == 0.75 and d2.classes_loss_descriptor.label_smoothing == 0.1
    assert [getattr(d2, s).loss_type for s in ("xy_loss_descriptor", "classes_loss_descriptor")] == [
        m.LossType.MEAN_SQUARED_ERROR, m.LossType.SOFTMAX_CROSS_ENTROPY,
    ]  # fmt: skip
    assert kernel2.label == "yolo" and node2.input_labels.handle == "labels"
    g = _gen(12)
    n, h, w, k = 2, 3, 4, 2
    preds = _x(g, n, 2 * (5 + k), h, w)
    labels = random_labels(n, ANCHORS, k, h, w, seed=13)
    grads, losses = [], []
    for kern in (kernel, kernel2):
        lab = m.LossLabels(DEV, labels.clone(), loss_image_size=m.Size(1, 1, 1))
        cb = DEV.new_command_queue().command_buffer()
        out = kern.encode_batch(cb, m.ImageBatch.from_tensor(preds), lab)
        cb.commit()
        cb.wait_until_completed()
        grads.append(out.tensor)
        losses.append(lab.loss_image().tensor)
    assert same(grads[0], grads[1]) and same(losses[0], losses[1])
    assert bool(grads[0].abs().sum() > 0)

    # a training graph ending in the YOLO loss node reloads and computes the same
    desc = m.ConvolutionDescriptor(1, 1, 3, 2 * (5 + k))
    ds = m.TensorConvolutionDataSource(
        desc, _x(g, *desc.weights_shape) / 2, _x(g, desc.output_feature_channels) / 10,
        m.SGD(DEV, descriptor=m.OptimizerDescriptor(learning_rate=0.01)),
    )  # fmt: skip
    loss = m.YOLOLossNode(m.ConvolutionNode(m.ImageNode("x"), ds).result_image, d)
    (terminal,) = loss.training_graph()
    graph = m.Graph(DEV, terminal.result_image, False)
    graph.format = F64
    graph2 = _roundtrip(graph, tmp_path)
    xt = _x(g, n, 3, h, w)
    losses = []
    for gr in (graph, graph2):
        lab = m.LossLabels(DEV, labels.clone(), loss_image_size=m.Size(1, 1, 1))
        run(gr, [xt], [lab])
        losses.append(lab.loss_image().tensor)
    assert same(losses[0], losses[1])
    assert same(ds.weights(), graph2._plan.order[0].data_source.weights())


def test_malformed_anchor_boxes_are_rejected(tmp_path) -> None:
    path = tmp_path / "d.safetensors"
    m.save(_yolo_descriptor(), path)
    for bad in ([], [[1.0, 2.0], [3.0]], [[1.0, "2"]], "boxes"):
        structure, tensors = _parts(path)
        _object(structure, "YOLOLossDescriptor")["fields"]["anchor_boxes"] = bad
        bad_path = tmp_path / "bad.safetensors"
        _write(bad_path, structure, tensors)
        with pytest.raises(
            m.CheckpointError,
            match=r"field 'anchor_boxes' must be a non-empty list of \[width, height\] numbers",
        ):
            m.load(bad_path)
