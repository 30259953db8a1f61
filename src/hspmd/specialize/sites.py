"""The reshard sites and parameter layouts of a model under a strategy.

A *site* is one reshard marker with the four annotations specialization needs: the
marker's input (``src``) and output (``dst``) annotations, and those of the gradients that
flow back through it (``grad_out`` arrives, ``grad_in`` leaves). Its forward plan is
``resolve(src, dst, shape)`` and its backward plan ``resolve(grad_out, grad_in, shape)``.

``deduced_sites`` finds them for any model (``ModelSpec``): each pipeline's graph deduced
on the meta device (``hspmd.specialize.cut.deduce_pipeline``), its reshard markers and
align nodes as sites, its parameters' gradients as deduced.

``marker_sites`` derives them from the markers' placements alone (``MarkerSpec``), with no
graph, for a model whose markers stand where Megatron's layout puts them and nothing
between them reshards (``ModelSpec.markers_complete``; tests compare it with deduction).
By role (t = a stage's TP degree, residual = ``{D:t}``, or ``{1:t}`` under sequence
parallelism)::

    marker (placement)            src (input)      dst (output)   grad_out    grad_in
    layers.i.input (residual)     residual (prev)  residual       residual    residual (prev)
    reduced output (residual)     {P:t}            residual       residual    {D:t}
    layer input (dup)             residual         {D:t}          {P:t}       residual
    heads (heads)                 {2:t}            {2:t}          {2:t}       {2:t}
    split on dim d (int)          {d:t}            {d:t}          {d:t}       {d:t}
    (logits_gather: a post int)   {d:t}            {D:t}          {D:t}       {d:t}

(the Llama: ``embed``, ``attn_out``, ``mlp_out`` are reduced outputs, ``attn_in``,
``mlp_in`` and ``head_in`` layer inputs, ``attn.q/k/v`` heads, ``attn.ctx`` and ``logits``
split on dim 2.) On a stage of context-parallel degree c every DS gains the CP axis
(``stage_states``): ``1:c`` (the sequence split) inside the layers, ``D:c`` before the
first block input and in the post part (whole rows); heads markers go from ``{2:t,1:c}``
to ``{2:tc}`` (the all-to-all) and a split marker inside a layer back.

A vocab-parallel cross-entropy (logits split on the classes) is no marker, but it
communicates in the forward pass: three all-reduces of one value per token over the ranks
sharing the tokens (``hspmd.specialize.loss``). ``loss_sites`` gives them as sites
(``{P:g}`` to ``{D:g}`` over each such group, backward an identity), so that what explains
a strategy sees every collective the executable runs, the pipelines' stages included.

Across pipelines every activation is ``h0(b0,b1,..)``: dim 0 (batch) cut into the
pipelines' micro-batch sizes, one subgroup per pipeline (the ranks of the stage holding
that layer there). Parameters are ``hD`` over the pipelines, and their gradients ``hP``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx

from hspmd.annotation import DUP, PARTIAL, Annotation, DeviceGroup, DistributedStates
from hspmd.comm.plan import CommPlan
from hspmd.comm.resolve import resolve
from hspmd.deduce import AnnotatedGraph, Fallback
from hspmd.models.spec import MarkerSpec, ModelSpec
from hspmd.plan.params import stage_states
from hspmd.plan.schema import residual_dim
from hspmd.plan.strategy import Stage, Strategy, StrategyOptions
from hspmd.specialize.loss import CROSS_ENTROPY, vocab_loss_groups

__all__ = [
    "DeducedSites", "ParamLayout", "Site", "deduced_sites", "loss_sites", "marker_loss_sites",
    "marker_params", "marker_sites",
]  # fmt: skip


@dataclass(frozen=True, slots=True)
class Site:
    """One reshard marker: ``name``, global ``shape`` and its four annotations."""

    name: str
    shape: tuple[int, ...]
    src: Annotation
    dst: Annotation
    grad_out: Annotation
    grad_in: Annotation

    def forward_plan(self) -> CommPlan:
        return resolve(self.src, self.dst, self.shape)

    def backward_plan(self) -> CommPlan:
        return resolve(self.grad_out, self.grad_in, self.shape)


@dataclass(frozen=True, slots=True)
class ParamLayout:
    """A parameter's global shape, annotation, and its gradient's annotation."""

    name: str
    shape: tuple[int, ...]
    annotation: Annotation
    grad: Annotation

    def sync_plan(self) -> CommPlan:
        """Post's gradient sync: ``resolve(grad, annotation)``."""
        return resolve(self.grad, self.annotation, self.shape)


def _ds(*entries: tuple[int, int]) -> DistributedStates:
    return DistributedStates(tuple(entries))


def _union(
    stages: list[Stage], states: list[DistributedStates], *, hdim: int, sizes: tuple[int, ...]
) -> Annotation:
    groups = tuple(DeviceGroup(s.ranks) for s in stages)
    hsizes = sizes if hdim >= 0 and len(set(sizes)) > 1 else None
    return Annotation(groups, tuple(states), hdim=hdim, hsizes=hsizes)


class _Builder:
    def __init__(self, strategy: Strategy, options: StrategyOptions) -> None:
        self.strategy, self.sp = strategy, options.sequence_parallel
        self.sizes = tuple(p.micro_batch_size for p in strategy.pipelines)

    def stages(self, layer: int) -> list[Stage]:
        return [p.stage_of_layer(layer) for p in self.strategy.pipelines]

    def act(self, layer: int, kind: str | int, cp: int = 1) -> Annotation:
        """Activation annotation on the stages of ``layer``: residual, D, P or a split dim on
        the TP axis, ``cp`` (1: the sequence, DUP, or a dim) on the CP axis."""
        stages = self.stages(layer)
        states = [
            stage_states(s, residual_dim(s, sequence_parallel=self.sp) if kind == "residual"
                         else kind if isinstance(kind, int) else {"D": DUP, "P": PARTIAL}[kind], cp)
            for s in stages
        ]  # fmt: skip
        return _union(stages, states, hdim=0, sizes=self.sizes)


def marker_sites(
    strategy: Strategy,
    model: ModelSpec,
    options: StrategyOptions,
    *,
    seq_len: int,
    logits_gather: bool = False,
) -> tuple[Site, ...]:
    """Every reshard site of ``model`` in forward order, from its markers' placements (see
    the module docstring). The ``dst`` annotations equal ``activation_annotations``."""
    b = _Builder(strategy, options)
    batch, markers = sum(b.sizes), model.markers()
    first = next((k for k, m in enumerate(markers) if m.name == "layers.0.input"), 0)
    return tuple(
        _marker_site(b, m, (batch, seq_len, *m.trailing), pre=k < first, gather=logits_gather)
        for k, m in enumerate(markers)
    )


def _marker_site(
    b: _Builder, marker: MarkerSpec, shape: tuple[int, ...], *, pre: bool, gather: bool
) -> Site:
    """One marker's site by its role (module docstring)."""
    name, layer, placement = marker.name, marker.layer, marker.placement
    here = b.act(layer, "residual")
    whole = DUP if pre or marker.post else 1  # the CP axis outside the blocks: whole rows
    if name == f"layers.{layer}.input":
        prev = b.act(max(layer - 1, 0), "residual")
        return Site(name, shape, prev, here, here, prev)
    if placement == "residual":
        return Site(name, shape, b.act(layer, "P", whole), here, here, b.act(layer, "D", whole))
    if placement == "dup":
        dup, partial = b.act(layer, "D", whole), b.act(layer, "P", whole)
        return Site(name, shape, here, dup, partial, here)
    if placement == "heads" or placement == "cp_heads":  # cp_heads: TP leaves them whole
        tp = 2 if placement == "heads" else "D"
        seq, heads = b.act(layer, tp), b.act(layer, tp, 2)
        return Site(name, shape, seq, heads, heads, seq)
    if marker.post:
        split = b.act(layer, placement, DUP)
        out = b.act(layer, "D", DUP) if gather else split
        return Site(name, shape, split, out, out, split)
    split, heads = b.act(layer, placement), b.act(layer, placement, placement)
    return Site(name, shape, heads, split, split, heads)  # from the heads split back


def marker_params(
    strategy: Strategy, model: ModelSpec, options: StrategyOptions
) -> dict[str, ParamLayout]:
    """Every parameter's layout (``hspmd.plan.params``) with its gradient's annotation, for
    the models of ``marker_sites``.

    The gradient has the parameter's groups with the top tier partial (each pipeline's
    gradient is a summand); under sequence parallelism a replicate parameter's (a norm's,
    computed on the split stream) is also a summand inside the stage, and on a
    context-parallel stage every parameter's gradient but the vocab-parallel ones (the
    embedding and the head see whole rows) is a summand over the CP group (``{0:t,P:c}``).
    """
    from hspmd.plan.params import parameter_annotations

    out = {}
    for name, spec in parameter_annotations(strategy, model).items():
        ann, kind = spec.annotation, model.param_kind(name)
        stages = [p.stage_of_layer(model.param_layer(name)) for p in strategy.pipelines]
        states = ann.states
        if options.sequence_parallel and kind == "replicate":  # not on CP stages
            states = tuple(
                _ds((PARTIAL, len(g))) if stage.cp == 1 else ds
                for g, ds, stage in zip(ann.groups, states, stages, strict=True)
            )
        if kind != "vocab":
            states = tuple(_cp_partial(ds, stage) for ds, stage in zip(states, stages, strict=True))
        hdim = PARTIAL if ann.hsize > 1 else DUP
        out[name] = ParamLayout(name, spec.shape, ann, Annotation(ann.groups, states, hdim=hdim))
    return out


LOSS_REDUCTIONS = ("max", "sum", "target")
"""The vocab-parallel loss's all-reduces, in order: the max logit, the sum of the
exponentials, the target's logit (``hspmd.runtime.vocab_loss``)."""


def loss_sites(logits: Annotation, shape: tuple[int, ...], *, class_dim: int) -> tuple[Site, ...]:
    """The all-reduces of the vocab-parallel cross-entropy of logits annotated ``logits``
    (global ``shape``, classes on ``class_dim``) as sites named ``loss.max``, ``loss.sum``,
    ``loss.target``: each group's per-token values (``(tokens,)``), partial to duplicate in
    forward, nothing in backward (each rank's logits gradient is its own slice's). None
    where every rank holds all the classes."""
    out = []
    for group, tokens in vocab_loss_groups(logits, shape, class_dim=class_dim).items():
        ranks = (DeviceGroup(group),)
        partial = Annotation(ranks, (_ds((PARTIAL, len(group))),))
        whole = Annotation(ranks, (_ds((DUP, len(group))),))
        out += [Site(f"loss.{r}", (tokens,), partial, whole, whole, whole) for r in LOSS_REDUCTIONS]
    return tuple(out)


def marker_loss_sites(sites: tuple[Site, ...]) -> tuple[Site, ...]:
    """``loss_sites`` of a ``markers_complete`` model, whose last marker is the logits its
    loss reads, classes last (the Llama's ``logits``, ``(B, T, V)``)."""
    logits = sites[-1]
    return loss_sites(logits.dst, logits.shape, class_dim=len(logits.shape) - 1)


def _graph_loss_sites(ag: AnnotatedGraph) -> tuple[Site, ...]:
    """``loss_sites`` of every cross-entropy of a deduced graph whose logits ``(tokens,
    classes)`` are split on the classes: the executable's vocab-parallel losses."""
    out: list[Site] = []
    for node in ag.module.graph.nodes:
        if node.target not in CROSS_ENTROPY or not isinstance(node.args[0], torch.fx.Node):
            continue
        logits = node.args[0].name
        ann = ag.annotations.get(logits)
        if ann is not None and len(ag.shape(logits)) == 2:
            out += loss_sites(ann, ag.shape(logits), class_dim=1)
    return tuple(out)


@dataclass(frozen=True, slots=True)
class DeducedSites:
    """What ``deduced_sites`` found: every pipeline's sites (forward order, pipeline after
    pipeline), every parameter's layout, and the ops of each ``(pipeline, stage)``."""

    sites: tuple[Site, ...]
    params: dict[str, ParamLayout]
    num_ops: dict[tuple[int, int], int]
    fallbacks: tuple[str, ...] = ()  # one line per op computed whole on gathered inputs
    loss: tuple[Site, ...] = ()  # the vocab-parallel losses' all-reduces (loss_sites)


def deduced_sites(
    strategy: Strategy, config: ModelSpec, options: StrategyOptions, *, seq_len: int
) -> DeducedSites:
    """The sites and parameter layouts of any model, by deduction of each pipeline's graph
    (on the meta device). A pipeline's sites name its ranks only; a parameter's gradient
    has the top tier partial over the pipelines holding it and, inside each stage, the
    state deduction found (partial for a norm's weight under sequence parallelism)."""
    from hspmd.plan.params import parameter_annotations
    from hspmd.specialize.cut import cut, deduce_pipeline

    sites: list[Site] = []
    inner: dict[tuple[str, tuple[int, ...]], DistributedStates] = {}
    num_ops: dict[tuple[int, int], int] = {}
    fallbacks: list[str] = []
    loss: list[Site] = []
    for p, pipeline in enumerate(strategy.pipelines):
        ag = deduce_pipeline(config, pipeline, options, seq_len=seq_len)
        fallbacks += [fallback_line(ag, f, pipeline=p) for f in ag.fallbacks]
        loss += _graph_loss_sites(ag)
        for site in ag.reshards:
            grad_out = site.dst if site.grad_out is None else site.grad_out
            grad_in = site.dst if site.grad_in is None else site.grad_in
            sites.append(Site(site.name, site.shape, site.src, site.dst, grad_out, grad_in))
        for align in ag.alignments:
            sites.append(
                Site(align.name, align.shape, align.annotation, align.annotation,
                     align.grad_from, align.grad_to)
            )  # fmt: skip
        for name, grad in ag.param_grads.items():
            for group, state in zip(grad.groups, grad.states, strict=True):
                inner[(name, group.ranks)] = state
        for s, stage in enumerate(pipeline.stages):
            kept = cut(ag, stage, config.num_layers).keep
            num_ops[(p, s)] = sum(1 for n in kept if n.op.startswith("call"))
    params = {}
    for name, spec in parameter_annotations(strategy, config).items():
        ann = spec.annotation
        states = tuple(
            inner.get((name, g.ranks), st) for g, st in zip(ann.groups, ann.states, strict=True)
        )
        hdim = PARTIAL if ann.hsize > 1 else DUP
        params[name] = ParamLayout(name, spec.shape, ann, Annotation(ann.groups, states, hdim=hdim))
    return DeducedSites(tuple(sites), params, num_ops, tuple(fallbacks), tuple(loss))


def fallback_line(ag: AnnotatedGraph, fallback: Fallback, *, pipeline: int) -> str:
    """``pipeline 0: aten.cumsum.default at net.py:11: gathers up (1.5 KiB per micro-batch;
    no deduction rule ...)``: one op computed whole on gathered inputs, and its cost."""
    kib = ag.fallback_bytes(fallback) / 1024
    at = f" at {fallback.where}" if fallback.where else ""
    return (
        f"pipeline {pipeline}: {fallback.op}{at} gathers {', '.join(fallback.gathered)} "
        f"({kib:.1f} KiB per micro-batch): {fallback.why}"
    )


def _cp_partial(ds: DistributedStates, stage: Stage) -> DistributedStates:
    """``ds`` (a parameter's TP DS on ``stage``) with its CP axis partial: ``{0:t,P:c}``."""
    if stage.cp == 1:
        return ds
    tp = [(ds.entries[0][0], stage.tp)] if stage.tp > 1 else []
    return _ds(*tp, (PARTIAL, stage.cp))
