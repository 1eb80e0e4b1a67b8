"""The graph engine: the node bases, the automatic training graph, `Graph` (the plan, lowered
to a step program; one call per step) and `CompiledGraph` (a step captured and replayed). The
node families (`ConvolutionNode`, ...) are in `mpsnn.nodes`."""

from mpsnn.graph.compiled import CompiledGraph as CompiledGraph
from mpsnn.graph.graph import Graph as Graph
from mpsnn.graph.nodes import FilterNode as FilterNode
from mpsnn.graph.nodes import GradientFilterNode as GradientFilterNode
from mpsnn.graph.nodes import ImageNode as ImageNode
from mpsnn.graph.nodes import LabelsNode as LabelsNode
from mpsnn.graph.nodes import StateNode as StateNode
from mpsnn.graph.nodes import UnaryGradientNode as UnaryGradientNode
from mpsnn.graph.step import StepCollectives as StepCollectives
from mpsnn.graph.training import training_graph as training_graph

__all__ = [
    "CompiledGraph", "FilterNode", "Graph", "GradientFilterNode", "ImageNode", "LabelsNode",
    "StateNode", "StepCollectives", "UnaryGradientNode", "training_graph",
]  # fmt: skip
