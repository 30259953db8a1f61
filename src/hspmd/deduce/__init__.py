"""Annotation deduction (HSPMD section 6.1): forward annotations and gradient annotations.

    >>> import torch
    >>> from hspmd.annotation import parse_annotation as A
    >>> net = torch.nn.Linear(4, 6, bias=False)
    >>> ag = deduce(net, input_annotations={"input": A("[0,1]{D:2}")},
    ...     param_annotations={"weight": A("[0,1]{0:2}")}, marker_annotations={},
    ...     input_shapes={"input": (3, 4)}, input_dtypes={"input": torch.float32})
    >>> str(ag.annotations["linear"]), str(ag.param_grads["weight"])
    ('[0,1]{1:2}', '[0,1]{0:2}')

Rules live in the family modules (pointwise, contract, views, reduce, misc), registered
in ``hspmd.deduce.rules.RULES`` keyed by fx target.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType

import torch
import torch.fx
from torch import nn

from hspmd.annotation import Annotation
from hspmd.deduce import aten, contract, layers, misc, pointwise, reduce, views  # noqa: F401  (rules)
from hspmd.deduce.align import insert_alignments
from hspmd.deduce.backward import (
    AlignNeed,
    AlignSite,
    BackwardResult,
    ReshardSite,
    backward_annotations,
)
from hspmd.deduce.fallback import insert_gathers
from hspmd.deduce.forward import Fallback, ForwardResult, forward_annotations
from hspmd.deduce.result import AnnotatedGraph
from hspmd.deduce.rules import DeductionError, NoRuleError
from hspmd.graph.capture import capture
from hspmd.graph.shapes import ShapeInfo, TensorSpec, propagate_shapes

__all__ = [
    "AlignNeed",
    "AlignSite",
    "AnnotatedGraph",
    "DeductionError",
    "Fallback",
    "NoRuleError",
    "ReshardSite",
    "deduce",
    "insert_alignments",
]


def deduce(
    module_or_graph: nn.Module | torch.fx.GraphModule,
    *,
    input_annotations: Mapping[str, Annotation | None],
    param_annotations: Mapping[str, Annotation],
    marker_annotations: Mapping[str, Annotation],
    input_shapes: Mapping[str, Sequence[int]],
    input_dtypes: Mapping[str, torch.dtype] | None = None,
    strict: bool = False,
) -> AnnotatedGraph:
    """Capture (unless given a GraphModule), propagate global shapes, deduce annotations.

    Where a tensor's consumers give its gradient different annotations, the returned
    ``ag.module`` is a copy of the graph with align nodes inserted (``hspmd.deduce.align``;
    a given GraphModule is not changed) and ``ag.alignments`` lists them.

    ``input_shapes`` are global per-micro-batch shapes; ``input_dtypes`` default to int64
    (token ids). An input annotated ``None`` is data every rank holds whole (a constant:
    packed documents' ``segments``). Parameters are named as in ``named_parameters()``; markers by their name.

    An op whose rule refuses its inputs' layouts (or that has no rule) runs whole on
    gathered inputs (``ag.fallbacks``, ``hspmd.deduce.fallback``); ``strict=True`` raises
    the rule's ``DeductionError`` instead.
    """
    gm = module_or_graph if isinstance(module_or_graph, torch.fx.GraphModule) else None
    gm = gm or capture(module_or_graph)
    info = _global_shapes(gm, input_shapes, input_dtypes or {})
    markers = dict(marker_annotations)

    def forward(gm: torch.fx.GraphModule, info: ShapeInfo) -> ForwardResult:
        return forward_annotations(
            gm, info, input_annotations=input_annotations, param_annotations=param_annotations,
            marker_annotations=markers, strict=strict,
        )  # fmt: skip

    fwd = forward(gm, info)
    fallbacks = fwd.fallbacks
    if fallbacks:  # ops no rule covers: gather their inputs, then deduce the new graph
        gm, info, gathers = insert_gathers(gm, info, fallbacks, fwd.annotations)
        markers.update(gathers)
        fwd = forward(gm, info)
        if fwd.fallbacks:
            raise DeductionError(f"gathered inputs still have no layout: {fwd.fallbacks[0]}")
    bwd = backward_annotations(gm, info, fwd)
    if bwd.needs:  # consumers disagree on a gradient: align, then deduce the new graph
        gm, info = insert_alignments(gm, info, bwd.needs)
        fwd = forward(gm, info)
        bwd = backward_annotations(gm, info, fwd)
        assert not bwd.needs, f"alignment left consumers disagreeing: {bwd.needs}"
    return _annotated(gm, info, fwd, bwd, fallbacks)


def _global_shapes(
    gm: torch.fx.GraphModule,
    input_shapes: Mapping[str, Sequence[int]],
    dtypes: Mapping[str, torch.dtype],
) -> ShapeInfo:
    """Every node's global shape from the inputs' (dtype int64 unless given)."""
    specs = {
        name: TensorSpec(tuple(shape), dtypes.get(name, torch.int64))
        for name, shape in input_shapes.items()
    }
    return propagate_shapes(gm, specs)


def _annotated(
    gm: torch.fx.GraphModule,
    info: ShapeInfo,
    fwd: ForwardResult,
    bwd: BackwardResult,
    fallbacks: tuple[Fallback, ...],
) -> AnnotatedGraph:
    """The deduction's result as a frozen value (read-only mappings)."""
    param_grads = {fwd.params[n]: bwd.grads[n] for n in fwd.params if n in bwd.grads}
    return AnnotatedGraph(
        module=gm,
        specs=info.specs,
        values=info.values,
        annotations=MappingProxyType(fwd.annotations),
        grads=MappingProxyType(bwd.grads),
        params=MappingProxyType(fwd.params),
        inputs=MappingProxyType(fwd.inputs),
        param_grads=MappingProxyType(param_grads),
        reshards=bwd.reshards,
        alignments=bwd.alignments,
        loss=bwd.loss,
        fallbacks=fallbacks,
    )
