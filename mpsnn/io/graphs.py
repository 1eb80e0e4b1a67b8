"""The codec of `Graph`: its results, flags and settings, the nodes it runs, and what its own
kernels hold.

A graph is saved as ``Graph.from_results(device, results, results_are_needed)`` plus
``format`` and ``label``: the nodes are objects of the table (`mpsnn.io.graph_nodes` for the
forward recipe, `mpsnn.io.graph_training` for the gradient nodes), so a training graph and an
inference graph saved together share their nodes and data sources after a load. The field
``nodes`` lists every filter node the graph runs, in its order: `load` checks that the
rebuilt graph runs exactly those (the plan is rebuilt, never read from the file).

A graph's kernels are its own (made when it was planned), and some hold values a rebuilt
kernel would not have:

* a convolution's master weights and biases, and the normalizations' gamma, beta and running
  statistics: saved when they differ from their data source's (an inference graph not
  reloaded since training steps; a kernel whose data source was changed in place), else
  ``null`` (a rebuilt kernel reads the data source);
* dropout's encode counter (always): the loaded graph draws the masks the original would
  have drawn next.

Not saved: the destination image allocator (refused unless None), the last encode's
intermediate images and plan report, compiled steps (`Graph.compile`: compile again).
"""

from __future__ import annotations

from typing import Any

import torch

from mpsnn.cnn.convolution.kernels import Convolution, ConvolutionTranspose, FullyConnected
from mpsnn.cnn.dropout import Dropout
from mpsnn.cnn.normalization.batch_norm_forward import BatchNormalization
from mpsnn.cnn.normalization.group_norm import GroupNormalization, InstanceNormalization
from mpsnn.core.descriptor import FeatureChannelFormat
from mpsnn.graph.graph import Graph
from mpsnn.graph.nodes import FilterNode
from mpsnn.io.codec import Encoder, Fields, fail, register_codec, show
from mpsnn.io.graph_nodes import attr, image_ref

__all__: list[str] = []  # the codec is registered at import

_CONVOLUTIONS = (Convolution, FullyConnected, ConvolutionTranspose)
Values = dict[str, torch.Tensor | None]

# ---------------------------------------------------------------------------------------------
# what the graph's kernels hold


def _stateful(kernel: Any) -> Any:
    """The kernel of a node's slot that holds values (batch normalization: the second)."""
    if isinstance(kernel, tuple) and kernel and isinstance(kernel[-1], BatchNormalization):
        return kernel[-1]
    return kernel


def _values(k: Any) -> tuple[Values, Values | None] | None:
    """``(the kernel's values, its data source's)`` by name (None: no data source to agree
    with), or None when the kernel holds nothing to save."""
    if isinstance(k, _CONVOLUTIONS):
        ds = k.data_source
        return {"weights": k.weights, "biases": k.biases}, {
            "weights": ds.weights(),
            "biases": ds.bias_terms(),
        }
    if isinstance(k, BatchNormalization):
        ds = k.data_source
        names = ("gamma", "beta", "mean", "variance")
        return {n: getattr(k, n) for n in names}, {n: getattr(ds, n)() for n in names}
    if isinstance(k, InstanceNormalization | GroupNormalization):
        ds = k.data_source
        return {"gamma": k.gamma, "beta": k.beta}, {"gamma": ds.gamma(), "beta": ds.beta()}
    if isinstance(k, Dropout):
        return {"counter": k._counter}, None
    return None


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    if t.is_floating_point():
        return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()])
    return t


def _same(a: Any, b: Any) -> bool:
    """Bit for bit (so -0.0 differs from 0.0, and NaNs of one payload agree)."""
    if a is None or b is None:
        return a is None and b is None
    if not isinstance(b, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(_bits(a), _bits(b.to(a.device)))


def _enc_kernel(kernel: Any, enc: Encoder) -> Any:
    found = _values(_stateful(kernel))
    if found is None:
        return None
    mine, source = found
    if source is not None and all(_same(mine[n], source.get(n)) for n in mine):
        return None  # what a rebuilt kernel reads from the data source
    return {name: enc.tensor(t, name) for name, t in mine.items()}


def _dec_kernel(f: Fields, where: str, kernel: Any, raw: Any) -> None:
    k = _stateful(kernel)
    found = _values(k)
    if found is None:
        if raw is not None:
            raise fail(
                f"{f.who} field '{where}' must be null (the kernel {type(k).__name__} holds no "
                f"values), got {show(raw)}"
            )
        return
    mine, source = found
    if raw is None and source is not None:
        return  # the rebuilt kernel read its data source
    if type(raw) is not dict or set(raw) != set(mine):
        null = "" if source is None else " or null"
        raise fail(
            f"{f.who} field '{where}' must hold the values {sorted(mine)} of the kernel "
            f"{type(k).__name__}{null}, got {show(raw)}"
        )
    if isinstance(k, _CONVOLUTIONS):
        masters = k._weights
        dtype = masters.weight.dtype
        w = f.resolve_tensor(raw["weights"], f"'{where}.weights'", shape=k.weights.shape,
                             dtypes=(dtype,))  # fmt: skip
        b = None
        if raw["biases"] is not None:
            shape = (k.output_feature_channels,)
            b = f.resolve_tensor(raw["biases"], f"'{where}.biases'", shape=shape, dtypes=(dtype,))
        masters.load_ohwi(w, b)
        if b is None:
            masters.bias = None
        return
    got = {}
    for name, t in mine.items():
        assert t is not None  # normalizations and dropout always hold theirs
        got[name] = f.resolve_tensor(raw[name], f"'{where}.{name}'", shape=t.shape,
                                     dtypes=(t.dtype,))  # fmt: skip
    if isinstance(k, Dropout):
        k._counter.copy_(got["counter"])
        return
    k._affine.load(got["gamma"], got["beta"])
    if isinstance(k, BatchNormalization):
        k._running.load(got["mean"], got["variance"])


# ---------------------------------------------------------------------------------------------
# the graph


def _enc_graph(graph: Graph, enc: Encoder) -> dict[str, Any]:
    if graph.destination_image_allocator is not None:
        raise TypeError(
            "[save] Graph.destination_image_allocator must be None to be saved (an allocator "
            f"is code), got {type(graph.destination_image_allocator).__name__} at {enc.path()}"
        )
    return {
        "label": attr(graph, "label", (str, type(None)), enc),
        "format": FeatureChannelFormat(graph.format).name,
        "recompute_normalization_results": attr(
            graph, "recompute_normalization_results", (bool,), enc
        ),
        "recompute_input_convolution_results": attr(
            graph, "recompute_input_convolution_results", (bool,), enc
        ),
        "output_state_is_temporary": graph.output_state_is_temporary,
        "results": [enc.object(r) for r in graph._results],
        "results_are_needed": list(graph._needed),
        "nodes": [enc.object(n) for n in graph._plan.order],
        "kernels": [_enc_kernel(graph._plan.kernels[n._id], enc) for n in graph._plan.order],
    }


def _dec_graph(f: Fields) -> Graph:
    label = f.get_str("label", optional=True)
    fmt = f.get_enum("format", FeatureChannelFormat)
    raw = f.raw("results")
    if type(raw) is not list or not raw:
        raise fail(f"{f.who} field 'results' must be a non-empty list, got {show(raw)}")
    results = [image_ref(f, r, f"'results.{i}'") for i, r in enumerate(raw)]
    needed = f.raw("results_are_needed")
    if type(needed) is not list or len(needed) != len(results):
        raise fail(
            f"{f.who} field 'results_are_needed' must be a list of {len(results)} booleans, "
            f"got {show(needed)}"
        )
    if any(type(n) is not bool for n in needed):
        raise fail(f"{f.who} field 'results_are_needed' must hold booleans, got {show(needed)}")
    raw = f.raw("nodes")
    if type(raw) is not list:
        raise fail(f"{f.who} field 'nodes' must be a list, got {show(raw)}")
    nodes = [f.resolve_object(r, f"'nodes.{i}'", FilterNode) for i, r in enumerate(raw)]
    graph = Graph.from_results(f.device, results, needed)
    graph.format = fmt
    graph.label = label
    # absent from files written before the option existed: its default
    if f.has("recompute_normalization_results"):
        graph.recompute_normalization_results = f.get_bool("recompute_normalization_results")
    if f.has("recompute_input_convolution_results"):
        graph.recompute_input_convolution_results = f.get_bool(
            "recompute_input_convolution_results"
        )
    if f.has("output_state_is_temporary"):
        graph.output_state_is_temporary = f.get_bool("output_state_is_temporary")
    order = graph._plan.order
    if len(order) != len(nodes) or any(a is not b for a, b in zip(order, nodes, strict=False)):
        planned = [type(n).__name__ for n in order]
        saved = [type(n).__name__ for n in nodes]
        raise fail(
            f"{f.who} field 'nodes' must list the filter nodes the rebuilt graph runs, in its "
            f"order ({show(planned)}), got {show(saved)}"
        )
    kernels = f.raw("kernels")
    if type(kernels) is not list or len(kernels) != len(nodes):
        raise fail(
            f"{f.who} field 'kernels' must be a list of {len(nodes)} entries (one per node), "
            f"got {show(kernels)}"
        )
    for i, (node, entry) in enumerate(zip(nodes, kernels, strict=True)):
        _dec_kernel(f, f"kernels.{i}", graph._plan.kernels[node._id], entry)
    return graph


register_codec(Graph, _enc_graph, _dec_graph)
