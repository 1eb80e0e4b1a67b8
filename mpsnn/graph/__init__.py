"""The graph API: nodes, the automatic training graph, and `Graph` (one call per step)."""

from mpsnn.graph.compiled import CompiledGraph as CompiledGraph
from mpsnn.graph.forward_nodes import *  # noqa: F403
from mpsnn.graph.forward_nodes import __all__ as _forward
from mpsnn.graph.gradient_nodes import *  # noqa: F403
from mpsnn.graph.gradient_nodes import __all__ as _gradient
from mpsnn.graph.graph import Graph as Graph
from mpsnn.graph.loss_nodes import *  # noqa: F403
from mpsnn.graph.loss_nodes import __all__ as _loss
from mpsnn.graph.neuron_nodes import *  # noqa: F403
from mpsnn.graph.neuron_nodes import __all__ as _neuron
from mpsnn.graph.nodes import FilterNode as FilterNode
from mpsnn.graph.nodes import GradientFilterNode as GradientFilterNode
from mpsnn.graph.nodes import ImageNode as ImageNode
from mpsnn.graph.nodes import LabelsNode as LabelsNode
from mpsnn.graph.nodes import StateNode as StateNode
from mpsnn.graph.normalization_nodes import *  # noqa: F403
from mpsnn.graph.normalization_nodes import __all__ as _normalization
from mpsnn.graph.reduction_nodes import *  # noqa: F403
from mpsnn.graph.reduction_nodes import __all__ as _reduction
from mpsnn.graph.resize_nodes import *  # noqa: F403
from mpsnn.graph.resize_nodes import __all__ as _resize
from mpsnn.graph.step import StepCollectives as StepCollectives
from mpsnn.graph.training import training_graph as training_graph
from mpsnn.graph.yolo_nodes import YOLOLossNode as YOLOLossNode

__all__ = sorted(
    {
        "CompiledGraph", "FilterNode", "Graph", "GradientFilterNode", "ImageNode", "LabelsNode",
        "StateNode", "StepCollectives", "YOLOLossNode",
        *_forward, *_gradient, *_loss, *_neuron, *_normalization, *_reduction, *_resize,
    }
)  # fmt: skip
