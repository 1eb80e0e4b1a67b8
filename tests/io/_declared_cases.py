"""One kernel of each class whose saved fields are declared (and of the hand-written kernel
codecs that share their helpers), each set up away from its defaults: the cases of
tests/io/test_declared_fields.py.

Uses the public API only, so that the file format can be compared across versions of the
package: ``python tests/io/_declared_cases.py OUT.safetensors`` saves the cases' list (the
checked-in tests/io/data/declared_kernels.safetensors was written this way by the version whose
codecs were written by hand).
"""

from __future__ import annotations

import sys

import mpsnn as m

REGIONS = [(0.1, 0.05, 0.7, 0.8), (0.9, 1.1, -0.6, -1.2)]
ANCHORS = [(1.0, 1.5), (2.0, 0.5)]


def _common(k, label: str) -> None:
    """A one-source kernel's configuration, away from the defaults."""
    k.label = label
    k.options = m.KernelOptions.INSERT_DEBUG_GROUPS
    k.offset = m.Offset(1, 2, 0)
    k.clip_rect = m.Region(m.Origin(1, 0, 0), m.Size(5, 6, 1))
    k.edge_mode = m.EdgeMode.CLAMP
    k.source_feature_channel_offset = 1
    k.source_feature_channel_max_count = 3
    k.destination_feature_channel_offset = 2


def _binary(k, label: str) -> None:
    """A two-source kernel's configuration, away from the defaults."""
    k.label = label
    k.options = m.KernelOptions.VERBOSE
    k.primary_offset = m.Offset(1, 0, 0)
    k.secondary_offset = m.Offset(0, 2, 0)
    k.primary_edge_mode = m.EdgeMode.CLAMP
    k.secondary_stride_in_pixels_x = 2
    k.primary_source_feature_channel_offset = 1
    k.secondary_source_feature_channel_max_count = 5
    k.clip_rect = m.Region(m.Origin(0, 1, 0), m.Size(4, 3, 1))
    k.destination_feature_channel_offset = 1


def _loss_descriptor() -> m.LossDescriptor:
    return m.LossDescriptor(
        m.LossType.HUBER, m.ReductionType.SUM_BY_NON_ZERO_WEIGHTS, weight=0.5, delta=0.75
    )


def cases(device: m.Device) -> dict[str, object]:
    """Class name -> one kernel of that class, configured away from its defaults."""
    out: dict[str, object] = {}

    def add(k, common=_common) -> None:
        if common is not None:
            common(k, f"{type(k).__name__} label")
        out[type(k).__name__] = k

    add(m.PoolingMax(device, 3, 2, 2, 1, dilation_rate_x=2, dilation_rate_y=1))
    avg = m.PoolingAverage(device, 2, 3, 1, 2, dilation_rate_x=1, dilation_rate_y=3)
    avg.zero_pad_size_x, avg.zero_pad_size_y = 1, 2
    add(avg)
    add(m.PoolingL2Norm(device, 4, 1, 3, 2))
    add(m.DilatedPoolingMax(device, 2, 3, 4, 2, 1, 3))
    add(m.Neuron(device, m.NeuronDescriptor(m.NeuronType.ELU, a=0.7)))
    drop = m.Dropout(device, 0.625, seed=11, mask_stride_in_pixels=m.Size(1, 0, 1))
    drop._counter.fill_(5)  # five encodes so far
    add(drop)
    add(m.SoftMax(device))
    add(m.LogSoftMax(device))
    add(m.Loss(device, _loss_descriptor()), common=None)
    out["Loss"].label = "Loss label"
    add(m.GramMatrixCalculation(device, 0.375))
    for cls in (
        m.ReduceRowMin, m.ReduceRowMax, m.ReduceRowMean, m.ReduceRowSum, m.ReduceColumnMin,
        m.ReduceColumnMax, m.ReduceColumnMean, m.ReduceColumnSum, m.ReduceFeatureChannelsMin,
        m.ReduceFeatureChannelsMax, m.ReduceFeatureChannelsMean, m.ReduceFeatureChannelsSum,
        m.ReduceFeatureChannelsArgumentMin, m.ReduceFeatureChannelsArgumentMax,
        m.ReduceSpatialMean,
    ):  # fmt: skip
        k = cls(device)
        k.clip_rect_source = m.Region(m.Origin(1, 1, 0), m.Size(3, 2, 1))
        add(k)
    out["ReduceFeatureChannelsSum"].weight = 2.5
    add(m.ResizeBilinear(device, 5, 3, True))
    add(m.CropAndResizeBilinear(device, 4, 2, len(REGIONS), REGIONS), common=None)
    out["CropAndResizeBilinear"].label = "crop"

    compare = m.Compare(device)
    _binary(compare, "compare")
    compare.primary_scale, compare.secondary_scale, compare.bias = 2.0, -0.5, 0.25
    compare.minimum_value, compare.maximum_value = -3.0, float("inf")
    compare.primary_stride_in_feature_channels = 1
    compare.secondary_stride_in_feature_channels = 0
    compare.comparison_type = m.ComparisonType.GREATER_OR_EQUAL
    compare.threshold = 0.125
    add(compare, common=None)
    for k in (
        m.ReduceFeatureChannelsAndWeightsMean(device),
        m.ReduceFeatureChannelsAndWeightsSum(device, True),
        m.LocalCorrelation(device, 2, 1, 2, 3),
    ):
        _binary(k, type(k).__name__)
        k.primary_source_clip_rect = m.Region(m.Origin(0, 1, 0), m.Size(4, 4, 1))
        k.secondary_source_clip_rect = m.Region(m.Origin(1, 0, 0), m.Size(2, 5, 1))
        add(k, common=None)

    for k in (
        m.GramMatrixCalculationGradient(device, 0.75),
        m.ReduceSpatialMeanGradient(device),
        m.ResizeBilinearGradient(device, 6, 2, True),
        m.CropAndResizeBilinearGradient(device, 3, 3, len(REGIONS), REGIONS),
    ):
        k.label = type(k).__name__
        k.options = m.KernelOptions.VERBOSE
        k.clip_rect = m.Region(m.Origin(0, 0, 0), m.Size(3, 3, 1))
        k.destination_feature_channel_offset = 1
        k.primary_offset = m.Offset(1, 1, 0)  # set by hand: saved
        k.secondary_edge_mode = m.EdgeMode.CLAMP
        k.kernel_offset_x = -1
        add(k, common=None)

    yolo = m.YOLOLossDescriptor(
        m.LossType.MEAN_SQUARED_ERROR, m.LossType.HUBER, m.LossType.SIGMOID_CROSS_ENTROPY,
        m.LossType.SOFTMAX_CROSS_ENTROPY, m.ReductionType.SUM, ANCHORS, rescore=False,
        scale_xy=3.0, scale_object=7.0,
    )  # fmt: skip
    add(m.YOLOLoss(device, yolo), common=None)
    out["YOLOLoss"].label = "yolo"
    add(m.ForwardLoss(device, _loss_descriptor(), reduce_across_batch=True), common=None)
    out["ForwardLoss"].label = "forward loss"
    lg = m.LossGradient(
        device, _loss_descriptor(), reduce_across_batch=True, compute_label_gradients=True
    )
    lg.label = "loss gradient"
    add(lg, common=None)
    add(m.InitialGradient(device), common=None)
    out["InitialGradient"].label = "initial"
    return out


if __name__ == "__main__":
    dev = m.Device("cpu")
    m.save(list(cases(dev).values()), sys.argv[1])
    print(f"saved {len(cases(dev))} kernels to {sys.argv[1]}")
