"""Insert align nodes where a tensor's consumers give its gradient different annotations.

The reverse pass (``hspmd.deduce.backward``) lists every ``AlignNeed``: a tensor, a group
of its consumers, the gradient annotation they give and the common one. This pass copies
the graph and puts one ``hspmd.markers.align`` node before the group's first consumer,
which then reads the align node instead of the tensor::

    before                              after
    x ──> linear (grad P)               x ──> align "x->linear" ──> linear
     └──> mul    (grad D)                └──> mul

Autograd then adds only gradients of one annotation at ``x``: the align node's backward
turns ``P`` into ``D`` (an all-reduce) first. The pass is pure: the input graph (shared,
e.g. a cached capture) is not changed; shapes of the new nodes are their sources'.

>>> import torch
>>> from hspmd.annotation import parse_annotation as A
>>> from hspmd.deduce.backward import AlignNeed
>>> from hspmd.graph.capture import capture
>>> from hspmd.graph.shapes import TensorSpec, propagate_shapes
>>> class Two(torch.nn.Module):
...     def forward(self, x): return x.exp().sum() + x.sin().sum()
>>> gm = capture(Two())
>>> info = propagate_shapes(gm, {"x": TensorSpec((2,))})
>>> need = AlignNeed("x", ("exp",), A("[0,1]{P:2}"), A("[0,1]{D:2}"))
>>> new, _ = insert_alignments(gm, info, (need,))
>>> [n.name for n in new.graph.nodes][:3]
['x', 'align', 'exp']
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from types import MappingProxyType

import torch.fx

from hspmd.deduce.backward import AlignNeed
from hspmd.graph.shapes import ShapeInfo
from hspmd.markers import align

__all__ = ["insert_alignments"]


def insert_alignments(
    gm: torch.fx.GraphModule, info: ShapeInfo, needs: Sequence[AlignNeed]
) -> tuple[torch.fx.GraphModule, ShapeInfo]:
    """A copy of ``gm`` with one align node per need, and the shapes with the new nodes."""
    graph = copy.deepcopy(gm.graph)
    nodes = {node.name: node for node in graph.nodes}
    order = {node: i for i, node in enumerate(graph.nodes)}
    specs = dict(info.specs)
    for need in needs:
        source = nodes[need.source]
        users = [nodes[name] for name in need.consumers]
        with graph.inserting_before(min(users, key=order.__getitem__)):
            node = graph.call_function(align, (source, need.name))
        for user in users:
            user.replace_input_with(source, node)
        specs[node.name] = specs[source.name]
    graph.lint()
    new = torch.fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    return new, ShapeInfo(MappingProxyType(specs), info.values)
