"""Insert the gathers of ops no rule covers (``hspmd.deduce.forward.Fallback``).

Each gathered input gets a reshard marker named ``{op node}.gather.{input}`` whose
annotation is the input's, duplicate on every axis: its forward is the all-gather (or
all-reduce, for a partial input) that makes the input whole within its groups, and its
backward gives the gradient back in the input's layout. Deduction then runs again on the
new graph, where the op sees duplicate inputs::

    before                          after
    x {1:2} ──> cumsum(x, 1)        x {1:2} ──> marker "cumsum.gather.x" {D:2} ──> cumsum

Like ``hspmd.deduce.align``, the pass copies the graph: a shared capture is not changed.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from types import MappingProxyType

import torch.fx

from hspmd.annotation import Annotation
from hspmd.deduce.axes import all_duplicate
from hspmd.deduce.forward import Fallback
from hspmd.graph.shapes import ShapeInfo
from hspmd.markers import reshard

__all__ = ["gather_name", "insert_gathers"]


def gather_name(fallback: Fallback, source: str) -> str:
    """The marker name of one gathered input."""
    return f"{fallback.node}.gather.{source}"


def insert_gathers(
    gm: torch.fx.GraphModule,
    info: ShapeInfo,
    fallbacks: Sequence[Fallback],
    annotations: Mapping[str, Annotation | None],
) -> tuple[torch.fx.GraphModule, ShapeInfo, dict[str, Annotation]]:
    """A copy of ``gm`` with one marker per gathered input, the shapes with the new
    nodes, and the markers' annotations."""
    graph = copy.deepcopy(gm.graph)
    nodes = {node.name: node for node in graph.nodes}
    specs = dict(info.specs)
    markers: dict[str, Annotation] = {}
    for fallback in fallbacks:
        user = nodes[fallback.node]
        for name in fallback.gathered:
            source, ann = nodes[name], annotations[name]
            assert ann is not None, f"{name} is a constant: nothing to gather"
            marker = gather_name(fallback, name)
            with graph.inserting_before(user):
                node = graph.call_function(reshard, (source, marker))
            node.meta = dict(user.meta)
            user.replace_input_with(source, node)
            specs[node.name] = specs[name]
            markers[marker] = all_duplicate(ann)
    graph.lint()
    new = torch.fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    return new, ShapeInfo(MappingProxyType(specs), info.values), markers
