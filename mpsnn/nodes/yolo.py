"""The YOLO loss node (MPS ``MPSCNNYOLOLossNode``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mpsnn.cnn.yolo import YOLOLoss, YOLOLossDescriptor
from mpsnn.core._checks import check_type
from mpsnn.core.device import Device
from mpsnn.graph.nodes import FilterNode, ImageNode, LabelsNode
from mpsnn.nodes.loss import LossNode

__all__ = ["YOLOLossNode"]


class YOLOLossNode(LossNode):
    """A YOLO loss (MPS ``MPSCNNYOLOLossNode``): like `LossNode`, its result image **is** the
    gradient of the loss with respect to its source (a training graph starts from it:
    ``yolo_node.training_graph()``), and the loss goes into the labels (``input_labels``, a
    `LabelsNode`: one `LossLabels` per image, or one for the batch, in the predictions'
    layout; see `mpsnn.cnn.yolo.YOLOLoss`).

    Args:
        source: the raw predictions, ``number_of_anchor_boxes · (5 + classes)`` channels.
        loss_descriptor: a `YOLOLossDescriptor` (kept, as MPS does: changes before the graph
            is built take effect; its sub-losses' types are checked here).
    """

    def __init__(self, source: ImageNode, loss_descriptor: YOLOLossDescriptor) -> None:
        FilterNode.__init__(self, [source])
        who = "YOLOLossNode"
        self.descriptor = check_type(who, "loss_descriptor", loss_descriptor, YOLOLossDescriptor)
        loss_descriptor._params(who)
        self.input_labels = LabelsNode()

    def _make_kernel(self, device: Device) -> Any:
        k = YOLOLoss(device, self.descriptor)
        self._configure(k)
        return k

    def gradient_filters(self, sources: Sequence[ImageNode]) -> list[Any]:
        raise ValueError(
            "[YOLOLossNode] a loss node has no gradient filter: its result image is the "
            "gradient (use yolo_loss_node.training_graph())"
        )
