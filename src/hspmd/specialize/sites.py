"""The reshard sites and parameter layouts of the Llama model under a strategy.

A *site* is one reshard marker with the four annotations specialization needs: the
marker's input (``src``) and output (``dst``) annotations, and those of the gradients that
flow back through it (``grad_out`` arrives, ``grad_in`` leaves). Its forward plan is
``resolve(src, dst, shape)`` and its backward plan ``resolve(grad_out, grad_in, shape)``.

The Llama model's markers fix where sites are, so their annotations follow from the
strategy alone (Megatron's layout, t = a stage's TP degree, residual = ``{D:t}``, or
``{1:t}`` under sequence parallelism)::

    site              src (input)       dst (output)   grad_out      grad_in
    embed             {P:t}             residual       residual      {D:t}
    layers.i.input    residual (prev)   residual       residual      residual (prev)
    layers.i.attn_in  residual          {D:t}          {P:t}         residual
    layers.i.attn.q   {2:t}             {2:t}          {2:t}         {2:t}
    (attn.k, attn.v, attn.ctx as attn.q)
    layers.i.attn_out {P:t}             residual       residual      {D:t}
    (mlp_in / mlp_out as attn_in / attn_out)
    head_in           residual          {D:t}          {P:t}         residual
    logits            {2:t}             {2:t}          {2:t}         {2:t}
    (logits_gather)   {2:t}             {D:t}          {D:t}         {2:t}

On a stage of context-parallel degree c every DS gains the CP axis (``stage_states``):
``1:c`` (the sequence split) inside the layers, ``D:c`` for the embedding's output before
its marker and after ``head_in`` (the post part runs on whole rows); ``attn.q/k/v`` go
from ``{2:t,1:c}`` to ``{2:tc}`` (the all-to-all) and ``attn.ctx`` back.

Across pipelines every activation is ``h0(b0,b1,..)``: dim 0 (batch) cut into the
pipelines' micro-batch sizes, one subgroup per pipeline (the ranks of the stage holding
that layer there). Parameters are ``hD`` over the pipelines, and their gradients ``hP``.

This is the deduction's answer for this one model, derived directly so that ``hspmd
explain`` needs no graph; ``hspmd.deduce`` computes the same annotations for any graph
(tests compare the two). ``deduced_sites`` is that path, for any model (``ModelSpec``):
each pipeline's graph deduced on the meta device (``hspmd.specialize.cut.deduce_pipeline``),
its reshard markers and align nodes as sites, its parameters' gradients as deduced.
"""

from __future__ import annotations

from dataclasses import dataclass

from hspmd.annotation import DUP, PARTIAL, Annotation, DeviceGroup, DistributedStates
from hspmd.comm.plan import CommPlan
from hspmd.comm.resolve import resolve
from hspmd.deduce import AnnotatedGraph, Fallback
from hspmd.models.config import LlamaConfig
from hspmd.models.spec import ModelSpec
from hspmd.plan.params import stage_states
from hspmd.plan.schema import residual_dim
from hspmd.plan.strategy import Stage, Strategy, StrategyOptions

__all__ = ["DeducedSites", "ParamLayout", "Site", "deduced_sites", "llama_params", "llama_sites"]


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
    def __init__(self, strategy: Strategy, config: LlamaConfig, options: StrategyOptions) -> None:
        self.strategy, self.config, self.sp = strategy, config, options.sequence_parallel
        self.sizes = tuple(p.micro_batch_size for p in strategy.pipelines)

    def stages(self, layer: int) -> list[Stage]:
        return [p.stage_of_layer(layer) for p in self.strategy.pipelines]

    def act(self, layer: int, kind: str, cp: int = 1) -> Annotation:
        """Activation annotation on the stages of ``layer``: residual, D, P or S(2) on the
        TP axis, ``cp`` (1: the sequence, DUP, or 2: the heads) on the CP axis."""
        stages = self.stages(layer)
        states = [
            stage_states(s, residual_dim(s, sequence_parallel=self.sp) if kind == "residual"
                         else {"D": DUP, "P": PARTIAL, "S2": 2}[kind], cp)
            for s in stages
        ]  # fmt: skip
        return _union(stages, states, hdim=0, sizes=self.sizes)


def llama_sites(
    strategy: Strategy,
    config: LlamaConfig,
    options: StrategyOptions,
    *,
    seq_len: int,
    logits_gather: bool = False,
) -> tuple[Site, ...]:
    """Every reshard site of the model in forward order (see the module docstring).

    The ``dst`` annotations equal ``hspmd.plan.schema.activation_annotations``.
    """
    b = _Builder(strategy, config, options)
    batch, H, V = sum(b.sizes), config.hidden_size, config.vocab_size
    hidden, last = (batch, seq_len, H), config.num_layers - 1
    first = b.act(0, "residual")
    embed_src, embed_grad = b.act(0, "P", DUP), b.act(0, "D", DUP)
    sites = [Site("embed", hidden, embed_src, first, first, embed_grad)]
    nh, nkv, hd = config.num_heads, config.num_kv_heads, config.head_dim
    for i in range(config.num_layers):
        prev = b.act(max(i - 1, 0), "residual")
        here = b.act(i, "residual")
        sites.append(Site(f"layers.{i}.input", hidden, prev, here, here, prev))
        for part in ("attn", "mlp"):
            sites.append(
                Site(f"layers.{i}.{part}_in", hidden, here, b.act(i, "D"), b.act(i, "P"), here)
            )
            if part == "attn":  # Ulysses all-to-alls on a CP stage; nothing without CP
                seq, heads = b.act(i, "S2"), b.act(i, "S2", 2)
                for name, n in (("q", nh), ("k", nkv), ("v", nkv)):
                    shape = (batch, seq_len, n, hd)
                    sites.append(Site(f"layers.{i}.attn.{name}", shape, seq, heads, heads, seq))
                sites.append(Site(f"layers.{i}.attn.ctx", (batch, seq_len, nh, hd), heads, seq, seq, heads))  # fmt: skip
            sites.append(Site(f"layers.{i}.{part}_out", hidden, b.act(i, "P"), here, here, b.act(i, "D")))  # fmt: skip
    final = b.act(last, "residual")
    whole = b.act(last, "D", DUP)
    sites.append(Site("head_in", hidden, final, whole, b.act(last, "P", DUP), final))
    # hspmd.plan.schema keeps the logits vocab-split ({2:t}, a vocab-parallel loss); the
    # training design's alternative all-gathers them ({D:t}): logits_gather=True.
    logits_src = b.act(last, "S2", DUP)
    logits_dst = whole if logits_gather else logits_src
    sites.append(
        Site("logits", (batch, seq_len, V), logits_src, logits_dst, logits_dst, logits_src)
    )
    return tuple(sites)


def llama_params(
    strategy: Strategy, config: LlamaConfig, options: StrategyOptions
) -> dict[str, ParamLayout]:
    """Every parameter's layout (``hspmd.plan.params``) with its gradient's annotation.

    The gradient has the parameter's groups with the top tier partial (each pipeline's
    gradient is a summand); under sequence parallelism a norm weight's gradient is also a
    summand inside the stage, and on a context-parallel stage every parameter's gradient
    but the embedding's and the head's (which see whole rows) is a summand over the CP
    group (``{0:t,P:c}``).
    """
    from hspmd.plan.params import parameter_annotations

    out = {}
    for name, spec in parameter_annotations(strategy, config).items():
        ann = spec.annotation
        states = ann.states
        layer = config.param_layer(name) if name not in ("embed.weight", "head.weight") else -1
        stages = [p.stage_of_layer(max(layer, 0)) for p in strategy.pipelines]
        if options.sequence_parallel and name.endswith("norm.weight"):  # not on CP stages
            states = tuple(
                _ds((PARTIAL, len(g))) if stage.cp == 1 else ds
                for g, ds, stage in zip(ann.groups, states, stages, strict=True)
            )
        if layer >= 0:
            states = tuple(_cp_partial(ds, stage) for ds, stage in zip(states, stages, strict=True))
        hdim = PARTIAL if ann.hsize > 1 else DUP
        grad = Annotation(ann.groups, states, hdim=hdim)
        out[name] = ParamLayout(name, spec.shape, ann, grad)
    return out


@dataclass(frozen=True, slots=True)
class DeducedSites:
    """What ``deduced_sites`` found: every pipeline's sites (forward order, pipeline after
    pipeline), every parameter's layout, and the ops of each ``(pipeline, stage)``."""

    sites: tuple[Site, ...]
    params: dict[str, ParamLayout]
    num_ops: dict[tuple[int, int], int]
    fallbacks: tuple[str, ...] = ()  # one line per op computed whole on gathered inputs


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
    for p, pipeline in enumerate(strategy.pipelines):
        ag = deduce_pipeline(config, pipeline, options, seq_len=seq_len)
        fallbacks += [fallback_line(ag, f, pipeline=p) for f in ag.fallbacks]
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
    return DeducedSites(tuple(sites), params, num_ops, tuple(fallbacks))


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
