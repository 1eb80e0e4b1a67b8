"""One forward node of each class whose saved fields are declared, each set up away from its
defaults (its own settings and what every filter node saves: label, padding policy,
``trainable``, its result image's and state's attributes): the cases of
tests/io/test_declared_node_fields.py.

Uses the public API only, so that the file format can be compared across versions of the
package: ``python tests/io/_declared_node_cases.py OUT.safetensors`` saves the cases' list (the
checked-in tests/io/data/declared_nodes.safetensors was written this way by the version whose
node codecs were written by hand).
"""

from __future__ import annotations

import sys

import torch

import mpsnn as m

REDUCTIONS = (
    "UnaryReductionNode", "ReductionRowMinNode", "ReductionRowMaxNode", "ReductionRowMeanNode",
    "ReductionRowSumNode", "ReductionColumnMinNode", "ReductionColumnMaxNode",
    "ReductionColumnMeanNode", "ReductionColumnSumNode", "ReductionFeatureChannelsMinNode",
    "ReductionFeatureChannelsMaxNode", "ReductionFeatureChannelsMeanNode",
    "ReductionFeatureChannelsArgumentMinNode", "ReductionFeatureChannelsArgumentMaxNode",
    "ReductionFeatureChannelsSumNode", "ReductionSpatialMeanNode",
)  # fmt: skip


def _common(node, i: int) -> None:
    """What every filter node saves, away from the defaults (varied with ``i``)."""
    node.label = f"{type(node).__name__} label"
    if i % 2 == 0:
        node.padding_policy = m.DefaultPadding(m.PaddingMethod.SIZE_SAME, label=f"pad {i}")
    if i % 3 == 0:
        node.trainable = False
    img = node.result_image
    img.handle = {"name": f"out {i}", "index": i, "tags": [True, 0.5, None]}
    img.format = m.FeatureChannelFormat.FLOAT16 if i % 2 else m.FeatureChannelFormat.FLOAT32
    img.export_from_graph = i % 2 == 1
    img.stop_gradient = i % 4 == 1
    if node.result_state is not None:
        node.result_state.handle = f"state {i}"
        node.result_state.export_from_graph = i % 3 == 1


def _conv_ds(seed: int, cin: int, cout: int) -> m.TensorConvolutionDataSource:
    g = torch.Generator().manual_seed(seed)
    desc = m.ConvolutionDescriptor(3, 3, cin, cout)
    w = torch.rand(*desc.weights_shape, generator=g, dtype=torch.float32) - 0.5
    b = torch.rand(cout, generator=g, dtype=torch.float32) - 0.5
    return m.TensorConvolutionDataSource(desc, w, b)


def cases() -> dict[str, object]:
    """Class name -> one node of that class, configured away from its defaults (the graph
    inputs they read are shared; the forward loss is there with and without weights)."""
    x, labels, weights = m.ImageNode("x"), m.ImageNode("labels"), m.ImageNode.exported("w")
    x.format = m.FeatureChannelFormat.FLOAT32
    labels.stop_gradient = True
    out: dict[str, object] = {}

    def add(node, key: str = "") -> None:
        _common(node, len(out))
        out[key or type(node).__name__] = node

    add(m.PoolingMaxNode(x, 3, 2))
    avg = m.PoolingAverageNode(x, kernel_width=2, kernel_height=3, stride_in_pixels_x=1)
    avg.edge_mode = m.EdgeMode.ZERO
    add(avg)
    add(m.PoolingL2NormNode(x, 4, 1, kernel_height=2, stride_in_pixels_y=3))
    dil = m.DilatedPoolingMaxNode(x, 2, 3, 4, kernel_width=5)
    dil.dilation_rate_y = 1
    dil.edge_mode = m.EdgeMode.ZERO
    add(dil)
    add(m.SoftMaxNode(x))
    add(m.LogSoftMaxNode(x))
    add(m.DropoutNode(x, 0.625, seed=11, mask_stride_in_pixels=m.Size(1, 0, 1)))
    add(m.UpsamplingNearestNode(x, 3, 2))
    add(m.UpsamplingBilinearNode(x, 2, 4, align_corners=True))
    add(m.SliceNode(x, 2, 3))
    for name in REDUCTIONS:
        node = getattr(m, name)(x)
        node.clip_rect_source = m.Region(m.Origin(1, 2, 0), m.Size(3, 2, 1))
        add(node)
    out["ReductionFeatureChannelsSumNode"].weight = 2.5
    add(m.ResizeBilinearNode(x, 5, 3, True))
    add(m.BilinearScaleNode(x, m.Size(7, 5, 1)))
    add(m.LanczosScaleNode(x, m.Size(3, 9, 2)))
    add(m.GramMatrixCalculationNode(x, 0.375))
    desc = m.LossDescriptor(m.LossType.HUBER, m.ReductionType.SUM, weight=0.5, delta=0.75)
    add(m.ForwardLossNode(x, labels, desc, weights, reduce_across_batch=True))
    add(m.ForwardLossNode(x, labels, desc), "ForwardLossNode (no weights)")
    add(m.InitialGradientNode(out["ForwardLossNode"].result_image))

    conv = m.ConvolutionNode(x, _conv_ds(1, 2, 3))
    conv.accumulator_precision = m.ConvolutionAccumulatorPrecisionOption.HALF
    add(conv)
    add(m.FullyConnectedNode(x, _conv_ds(2, 2, 4)))  # accumulator_precision None
    g = torch.Generator().manual_seed(3)
    bn_ds = m.TensorBatchNormalizationDataSource(
        3, torch.rand(3, generator=g) + 0.5, torch.rand(3, generator=g), momentum=0.3
    )
    add(m.BatchNormalizationNode(conv.result_image, bn_ds))
    inst = m.TensorInstanceNormalizationDataSource(2, torch.rand(2, generator=g), epsilon=0.01)
    add(m.InstanceNormalizationNode(x, inst))
    grp = m.TensorGroupNormalizationDataSource(4, 2, None, torch.rand(4, generator=g))
    add(m.GroupNormalizationNode(x, grp))
    return out


if __name__ == "__main__":
    nodes = list(cases().values())
    m.save(nodes, sys.argv[1])
    print(f"saved {len(nodes)} nodes to {sys.argv[1]}")
