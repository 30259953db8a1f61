"""The stage cut: where a rank is, its pipeline's deduced graph, and the stage's slice of it.

``locate`` finds a rank's ``(pipeline, stage)``; ``deduce_pipeline`` deduces the model's
defined graph (``hspmd.models.build.model_graph``) under that pipeline's plan at its micro-batch shapes; ``cut`` selects the
nodes of one stage: from the tokens (stage 0) or the ``layers.{first}.input`` marker's
output to the loss (last stage) or the residual stream entering ``layers.{last+1}.input``.
Earlier stages' tensors that the stage reads only for their shape or dtype are
``swap``ped for the stage input::

    stage L1 of "2x1: R0:L0 R1:L1"   start = layers.1.input   end = the loss

>>> from hspmd.plan.strategy import parse_strategy
>>> locate(parse_strategy("2x1: R0:L0 R1:L1"), 1)
(0, 1)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from hspmd.annotation import DUP, Annotation, DistributedStates
from hspmd.deduce import AnnotatedGraph, deduce
from hspmd.errors import HspmdError
from hspmd.markers import is_reshard_node
from hspmd.models.build import model_graph
from hspmd.models.spec import TIED_LAYER, ModelSpec
from hspmd.plan.params import parameter_annotations
from hspmd.plan.schema import activation_annotations, input_annotations
from hspmd.plan.strategy import Pipeline, Stage, Strategy, StrategyOptions

__all__ = ["Cut", "ExecutableError", "cut", "deduce_pipeline", "locate"]


class ExecutableError(HspmdError, ValueError):
    """A strategy, option or rank that no executable graph can be built for (yet)."""


def locate(strategy: Strategy, rank: int) -> tuple[int, int]:
    """``(pipeline index, stage index)`` of ``rank``."""
    for p, s, stage in strategy.stages():
        if rank in stage.ranks:
            return p, s
    raise ExecutableError(
        f"rank {rank} is in no stage of {strategy}: build executables for its ranks "
        f"{list(strategy.ranks)} only"
    )


def _gathered_logits(annotation: Annotation) -> Annotation:
    states = tuple(DistributedStates(((DUP, len(g)),)) for g in annotation.groups)
    return dataclasses.replace(annotation, states=states)


def deduce_pipeline(
    config: ModelSpec,
    pipeline: Pipeline,
    options: StrategyOptions,
    *,
    seq_len: int,
    gather_logits: bool = False,
) -> AnnotatedGraph:
    """The model's graph deduced under one pipeline's plan, at its micro-batch shapes.

    Every rank runs only its own pipeline's ops, so the pipeline's plan (one subgroup per
    annotation, ``hsize == 1``) is all a stage needs; gradient sync across pipelines is
    Post's (``hspmd.train.sync``). The ``logits`` marker keeps the plan's vocab split
    (``{2:t}``: the loss is vocab-parallel); ``gather_logits=True`` overrides it to duplicate
    inside the stage, so cross-entropy runs on full logits (docs/decisions.md, "The loss is
    vocab-parallel").
    """
    sub = Strategy((pipeline,))
    # one pipeline of the run: ZeRO's per-pipeline shares shape no activation
    options = dataclasses.replace(options, zero_shares=())
    inputs = input_annotations(sub, config, seq_len=seq_len)
    markers = {
        name: spec.annotation
        for name, spec in activation_annotations(
            sub, config, seq_len=seq_len, options=options
        ).items()
    }
    if gather_logits:
        markers["logits"] = _gathered_logits(markers["logits"])
    params = {name: spec.annotation for name, spec in parameter_annotations(sub, config).items()}
    gm = model_graph(config)
    annotations: dict[str, Annotation | None] = {n: s.annotation for n, s in inputs.items()}
    shapes = {name: spec.shape for name, spec in inputs.items()}
    if _takes_segments(gm):  # packed documents' ids: data every rank of the stage holds whole
        annotations["segments"], shapes["segments"] = None, inputs["tokens"].shape
    return deduce(
        gm,
        input_annotations=annotations,
        param_annotations={**params, **tied_annotations(gm, pipeline, params, config)},
        marker_annotations=markers,
        input_shapes=shapes,
        input_dtypes={f.name: getattr(torch, f.dtype) for f in getattr(config, "batch", ())},
    )


def _takes_segments(gm: torch.fx.GraphModule) -> bool:
    """True if the graph needs ``segments`` (a captured model's packed step); the Llama's
    is optional (``segments=None``)."""
    return any(n.op == "placeholder" and n.target == "segments" and not n.args
               for n in gm.graph.nodes)  # fmt: skip


def tied_annotations(
    gm: torch.fx.GraphModule,
    pipeline: Pipeline,
    params: dict[str, Annotation],
    config: ModelSpec,
) -> dict[str, Annotation]:
    """By ``get_attr`` node name, a tied weight's annotation on the one stage that reads it
    there: the embedding's node on layer 0's stage, the head's (``TIED_LAYER``) on the last
    layer's. The weight's own annotation spans both stages (``parameter_annotations``)."""
    tied = dict(config.tied)
    out = {}
    for node in gm.graph.nodes:
        name = str(node.target)
        if node.op != "get_attr" or name not in tied:
            continue
        layer = tied[name] if node.meta.get(TIED_LAYER) == "last" else config.param_layer(name)
        ranks = pipeline.stage_of_layer(layer).ranks
        ann = params[name]
        s = next(i for i, g in enumerate(ann.groups) if g.ranks == ranks)
        out[node.name] = Annotation((ann.groups[s],), (ann.states[s],), hdim=DUP)
    return out


def _markers(gm: torch.fx.GraphModule) -> dict[str, torch.fx.Node]:
    return {str(n.args[1]): n for n in gm.graph.nodes if is_reshard_node(n)}


def _ancestors(start: torch.fx.Node | None) -> set[torch.fx.Node]:
    """``start`` and everything it depends on (empty for None)."""
    seen: set[torch.fx.Node] = set()
    stack = [] if start is None else [start]
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(node.all_input_nodes)
    return seen


@dataclass(frozen=True, slots=True)
class Cut:
    """The stage's slice of the defined graph."""

    start: torch.fx.Node | None  # the marker whose output is the stage input (None: tokens)
    end: torch.fx.Node  # the value the stage returns
    keep: frozenset[torch.fx.Node]  # nodes copied into the executable (start excluded)
    swap: frozenset[torch.fx.Node]  # earlier stages' tensors read for shape/dtype: the input


def cut(ag: AnnotatedGraph, stage: Stage, num_layers: int) -> Cut:
    """The nodes of ``stage`` in the deduced graph ``ag`` (see the module docstring)."""
    gm, markers = ag.module, _markers(ag.module)
    first, last = stage.first_layer, stage.last_layer
    start = markers[f"layers.{first}.input"] if first > 0 else None
    if last < num_layers - 1:
        end = markers[f"layers.{last + 1}.input"].args[0]
    else:
        end = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    assert isinstance(end, torch.fx.Node)
    before = _ancestors(start)
    keep: set[torch.fx.Node] = set()
    swap: set[torch.fx.Node] = set()
    stack = [end, *(n for n in gm.graph.nodes if n.op == "placeholder")]
    while stack:
        node = stack.pop()
        if node in keep or node is start:
            continue
        if node in before and ag.annotations.get(node.name) is not None:
            swap.add(node)  # data of an earlier stage (constants and sizes are recomputed)
            continue
        keep.add(node)
        stack.extend(node.all_input_nodes)
    for node in swap:
        _check_swap(node, keep, start)
    return Cut(start, end, frozenset(keep), frozenset(swap))


_TYPE_AS = ("type_as", torch.ops.aten.type_as.default)  # the fx method form and the ATen form


def _check_swap(node: torch.fx.Node, keep: set[torch.fx.Node], start: Any) -> None:
    """A pre-stage value used by the stage only for its shape (B, T) or dtype."""
    if node.op == "placeholder":
        return  # tokens: the stage receives an activation of the same B and T instead
    for user in node.users:
        if user not in keep:
            continue
        shape_read = (user.target is getattr and user.args[1] in ("shape", "device")) or (
            user.target is torch.ops.aten.sym_size.int
        )
        dtype_read = user.target in _TYPE_AS and user.args[1] is node
        if not (shape_read or dtype_read):
            raise ExecutableError(
                f"node {user.name} ({user.format_node()}) of a later stage reads "
                f"{node.name}, which an earlier stage computes: only shapes and dtypes "
                f"may cross a stage boundary outside the {start.name} marker"
            )
