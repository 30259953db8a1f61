"""The reverse pass: the annotation of every tensor's gradient.

The loss gradient is duplicate everywhere (``hD``, ``D`` inside each stage: every summand
of a partial loss gets the whole gradient). Walking the graph backwards, each op gives
each of its float inputs ``x`` a gradient annotation, per device axis (top tier included)::

    grad(x) = P            if grad(out) is P, or x is D while out is not D
              D            if x is P (the gradient of a sum reaches every summand whole)
              x            otherwise

    column-parallel linear  x D,    W S(0), out S(-1)       -> grad x P,    grad W S(0)
    row-parallel linear     x S(-1), W S(1), out P, g D     -> grad x S(-1), grad W S(1)
    batch-split top tier    W hD, out h0                    -> grad W hP

A reshard marker gives its input ``g_in`` = the input's annotation with every P made D;
its backward is ``resolve(g_out, g_in)``. An align node (``hspmd.markers.align``) is a
marker whose output keeps its input's annotation: identity forward, the same ``g_in``.
Where the consumers of one tensor give different gradient annotations, the tensor's
gradient is its annotation without P (what a marker would give, reachable from every
consumer's gradient by reducing its P axes), and each group of consumers giving one other
annotation is an ``AlignNeed``: ``deduce`` puts an align node before the group
(``hspmd.deduce.align``) and runs the passes again, which then find an ``AlignSite``::

    x {D:2} -> linear (column-parallel: gives P) and mul (gives D)
    need:   AlignNeed(source="x", consumers=("linear",), grad_from={P:2}, grad_to={D:2})
    after:  x -> align -> linear, x -> mul; align's backward is an all-reduce
"""

from __future__ import annotations

import functools
from collections import defaultdict
from dataclasses import dataclass

import torch.fx

from hspmd.annotation import DUP, PARTIAL, Annotation
from hspmd.deduce.axes import (
    AxesError,
    all_duplicate,
    axis_placements,
    common_degrees,
    merge_axes,
    without_partial,
)
from hspmd.deduce.forward import ForwardResult
from hspmd.deduce.rules import DeductionError
from hspmd.graph.shapes import ShapeInfo
from hspmd.markers import is_align_node, is_reshard_node

__all__ = [
    "AlignNeed",
    "AlignSite",
    "BackwardResult",
    "ReshardSite",
    "backward_annotations",
    "grad_of_input",
]


@dataclass(frozen=True, slots=True)
class ReshardSite:
    """A marker: forward ``src -> dst``, backward ``grad_out -> grad_in`` (None: no gradient)."""

    name: str
    node_name: str
    src: Annotation
    dst: Annotation
    shape: tuple[int, ...]
    grad_out: Annotation | None
    grad_in: Annotation | None

    def __str__(self) -> str:
        grad = "no gradient" if self.grad_out is None else f"{self.grad_out} -> {self.grad_in}"
        return f"{self.name} {list(self.shape)}: {self.src} -> {self.dst}; backward {grad}"


@dataclass(frozen=True, slots=True)
class AlignNeed:
    """Consumers of ``source`` that give its gradient ``grad_from`` instead of ``grad_to``."""

    source: str
    consumers: tuple[str, ...]
    grad_from: Annotation
    grad_to: Annotation

    @property
    def name(self) -> str:
        """The name deduction gives the align node: ``"x->linear"``."""
        return f"{self.source}->{'+'.join(self.consumers)}"


@dataclass(frozen=True, slots=True)
class AlignSite:
    """Align node ``name`` between ``source`` and its ``consumers``: identity forward
    (``annotation`` both sides), backward reshard of the gradient from ``grad_from`` (what
    the consumers give) to ``grad_to`` (the source's annotation without P)."""

    name: str
    source: str
    consumers: tuple[str, ...]
    shape: tuple[int, ...]
    annotation: Annotation
    grad_from: Annotation
    grad_to: Annotation

    def __str__(self) -> str:
        return (
            f"align {self.source} -> {', '.join(self.consumers)} {list(self.shape)}: "
            f"{self.annotation}; backward {self.grad_from} -> {self.grad_to}"
        )


@dataclass(frozen=True, slots=True)
class BackwardResult:
    grads: dict[str, Annotation]
    reshards: tuple[ReshardSite, ...]
    alignments: tuple[AlignSite, ...]
    needs: tuple[AlignNeed, ...]  # empty once deduce has inserted the align nodes
    loss: str


def _grad_axis(x: int, out: int, g: int) -> int:
    if g == PARTIAL and x >= 0:
        raise AxesError(f"a partial gradient reaches an input split on dim {x}")
    if g == PARTIAL or (x == DUP and out != DUP):
        return PARTIAL
    return DUP if x == PARTIAL else x


@functools.cache
def grad_of_input(x: Annotation, out: Annotation, g_out: Annotation) -> Annotation:
    """The gradient annotation an op with output ``out`` gives its input ``x``."""
    states = []
    for xs, os, gs in zip(x.states, out.states, g_out.states, strict=True):
        degrees = common_degrees((xs, os, gs))
        axes = zip(*(axis_placements(ds, degrees) for ds in (xs, os, gs)), strict=True)
        states.append(merge_axes(tuple(_grad_axis(*a) for a in axes), degrees))
    hdim = _grad_axis(x.hdim, out.hdim, g_out.hdim) if x.hsize > 1 else DUP
    hsizes = x.hsizes if hdim == x.hdim and hdim >= 0 else None
    return Annotation(x.groups, tuple(states), hdim=hdim, hsizes=hsizes)


def _loss_node(gm: torch.fx.GraphModule, info: ShapeInfo) -> torch.fx.Node:
    output = next(n for n in gm.graph.nodes if n.op == "output")
    loss = output.args[0]
    if not isinstance(loss, torch.fx.Node) or loss.name not in info.specs:
        raise DeductionError(
            f"forward returns {loss!r}: return the loss tensor alone (forward(...) -> loss)"
        )
    return loss


def _settle(
    name: str, given: list[tuple[str, Annotation]], ann: Annotation, needs: list[AlignNeed]
) -> Annotation:
    """The gradient of ``name`` from what its consumers give (listed in reverse order)."""
    distinct = {a for _, a in given}
    if len(distinct) == 1:
        return given[0][1]
    common = without_partial(ann)
    groups: dict[Annotation, list[str]] = {}
    for consumer, grad in reversed(given):
        if grad != common and consumer not in groups.setdefault(grad, []):
            groups[grad].append(consumer)
    needs[:0] = [AlignNeed(name, tuple(c), g, common) for g, c in groups.items()]
    return common


def backward_annotations(
    gm: torch.fx.GraphModule, info: ShapeInfo, fwd: ForwardResult
) -> BackwardResult:
    """Gradient annotations, reshard sites and alignment sites of an annotated graph."""
    loss = _loss_node(gm, info)
    anns = fwd.annotations
    given: dict[str, list[tuple[str, Annotation]]] = defaultdict(list)
    grads: dict[str, Annotation] = {}
    sites: list[ReshardSite] = []
    aligns: list[AlignSite] = []
    needs: list[AlignNeed] = []
    for node in reversed(gm.graph.nodes):
        ann = anns.get(node.name)
        if ann is None:
            continue
        grad: Annotation | None = None
        if node is loss:
            grad = all_duplicate(ann)
        elif node.name in given:
            grad = _settle(node.name, given[node.name], ann, needs)
        if grad is not None:
            grads[node.name] = grad
        if is_reshard_node(node):
            sites.append(_marker_site(node, anns, grad, info, given))
            continue
        if is_align_node(node):
            aligns.extend(_align_site(node, anns, grad, info, given))
            continue
        if grad is None:
            continue
        for name in fwd.inputs.get(node.name, ()):
            x = anns[name]
            if x is None or not info.specs[name].is_float:
                continue
            try:
                given[name].append((node.name, grad_of_input(x, ann, grad)))
            except AxesError as error:
                raise DeductionError(
                    f"no gradient layout for input {name} of node {node.name} "
                    f"({x} -> {ann}, gradient {grad}): {error}. Fix: add a reshard marker"
                ) from None
    return BackwardResult(
        grads, tuple(reversed(sites)), tuple(reversed(aligns)), tuple(needs), loss.name
    )


def _marker_site(
    node: torch.fx.Node, anns: dict[str, Annotation | None], grad: Annotation | None,
    info: ShapeInfo, given: dict[str, list[tuple[str, Annotation]]],
) -> ReshardSite:  # fmt: skip
    source = node.args[0]
    assert isinstance(source, torch.fx.Node)
    src, dst = anns[source.name], anns[node.name]
    if src is None or dst is None:
        raise DeductionError(
            f"reshard marker {node.args[1]!r} (node {node.name}) is applied to a constant: "
            "mark a tensor computed from inputs or parameters"
        )
    grad_in = None
    if grad is not None and info.specs[source.name].is_float:
        grad_in = without_partial(src)
        given[source.name].append((node.name, grad_in))
    shape = info.specs[node.name].shape
    return ReshardSite(str(node.args[1]), node.name, src, dst, shape, grad, grad_in)


def _align_site(
    node: torch.fx.Node, anns: dict[str, Annotation | None], grad: Annotation | None,
    info: ShapeInfo, given: dict[str, list[tuple[str, Annotation]]],
) -> list[AlignSite]:  # fmt: skip
    """An align node gives its source the source's annotation without P (as a marker)."""
    source = node.args[0]
    assert isinstance(source, torch.fx.Node)
    ann = anns[source.name]
    if grad is None or ann is None or not info.specs[source.name].is_float:
        return []
    grad_in = without_partial(ann)
    given[source.name].append((node.name, grad_in))
    users = tuple(user.name for user in node.users)
    return [
        AlignSite(node.name, source.name, users, info.specs[node.name].shape, ann, grad, grad_in)
    ]
