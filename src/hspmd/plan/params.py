"""Annotations of a model's parameters, fp32 masters and Adam states under a strategy.

A parameter lives on the stage that holds its layer (``ModelSpec.param_layer``), one stage
per pipeline. Each such stage is one subgroup; the pipelines are data-parallel replicas,
so the top tier is duplicate (``hD:``). Inside a stage the split is the parameter's TP kind
(duplicate over the CP groups of a context-parallel stage: ``{0:t,D:c}``, ``stage_states``)
(``ModelSpec.param_kind``: column ``{0:t}``, row ``{1:t}``, vocab ``{0:t}``, replicate
``{D:t}``; hspmd.models.spec). The Llama's kinds are Megatron's::

    parameter                          DS on a stage of TP degree t
    attn.wq / wk / wv, mlp.w_gate/w_up {0:t}   column parallel (output features)
    attn.wo, mlp.w_down                {1:t}   row parallel (input features)
    attn_norm, mlp_norm, norm          {D:t}   duplicate
    embed, head                        {0:t}   vocab parallel (rows are tokens)

``embed.weight`` goes with layer 0's stage, ``norm.weight`` and ``head.weight`` with the
last layer's. On the C2 strategy, layer 50's ``wq`` is::

    hD: [12,13,14,15]{0:4} [28,29]{0:2}

Optimizer states (the fp32 master and both Adam moments share one annotation):

- without ZeRO-1, the parameter's annotation;
- with ZeRO-1 (``state_annotations(..., zero1=True)``), the replicas split the state
  among themselves along a dim the stage does not split (dim 1 for a column-parallel or
  vocab-parallel weight, dim 0 for a row-parallel weight or a norm), as the top tier:
  ``h1: [12,13,14,15]{0:4} [28,29]{0:2}``. Each rank's state is then a slice of its own
  compute shard (rank 12 holds rows 0-1/4 of columns 0-1/2; rank 28 rows 0-1/2 of
  columns 1/2-1), so the gradient's reshard to the state is a reduce-scatter across
  replicas (SplitRS when the TP degrees differ) and the parameter's reshard back is an
  all-gather (SplitAG). Parts are even when the dim divides, else as even as possible
  (``h1(3,2):``). Duplicates inside a stage stay duplicates, as in Megatron's
  distributed optimizer. With one pipeline there is nothing to shard over.
- with ``shares`` (one weight per pipeline, ``--zero-shares``), the parts are in proportion
  to the weights (``share_sizes``): ``h1(48,16): ...`` for weights 3,1 on 64 columns, so
  that a device with more memory left holds more of the state.

ZeRO-2 and ZeRO-3 shard the gradients and the stored parameters over the same annotation
(hspmd.train.zero, docs/zero.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from hspmd.annotation import DUP, Annotation, DeviceGroup, DistributedStates
from hspmd.errors import AnnotationError, StrategyError
from hspmd.models.spec import ModelSpec, ModelSpecError
from hspmd.plan.strategy import Pipeline, Stage, Strategy, check_strategy

__all__ = [
    "ParamSpec", "lock_step", "parameter_annotations", "share_sizes", "stage_states",
    "state_annotations",
]  # fmt: skip


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """A named leaf tensor: its global shape and annotation. Text: ``name [shape] annotation``.

    Also used for optimizer states, inputs and markers (see ``hspmd.plan.schema``).
    """

    name: str
    shape: tuple[int, ...]
    annotation: Annotation

    def __str__(self) -> str:
        return f"{self.name} {list(self.shape)} {self.annotation}"


_STAGE_DIM = {"column": 0, "row": 1, "vocab": 0, "replicate": DUP}


def _state_dim(kind: str, shape: tuple[int, ...]) -> int | None:
    """The dim ZeRO-1 splits across replicas: one the stage does not split (the last one
    for a column or vocab weight, dim 0 for a row weight or a replicated one); None for a
    1-D column-parallel bias, whose only dim TP splits: its state stays with its shard."""
    if kind in ("column", "vocab"):
        return len(shape) - 1 if len(shape) > 1 else None
    return 0


def stage_states(stage: Stage, tp_dim: int, cp_dim: int = DUP) -> DistributedStates:
    """The DS of a tensor on ``stage``: its TP axis (outer) on ``tp_dim``, its CP axis
    (inner: consecutive ranks, ``Stage.cp_groups``) on ``cp_dim``; split or duplicate
    ``-1``. Equal dims merge (TP outer, CP inner is the merged order).

    >>> from hspmd.plan.strategy import Stage
    >>> stage = Stage((0, 1, 2, 3), 0, 1, cp=2)
    >>> [str(stage_states(stage, d, c)) for d, c in ((0, DUP), (DUP, 1), (2, 2), (DUP, DUP))]
    ['{0:2,D:2}', '{D:2,1:2}', '{2:4}', '{D:4}']
    """
    t, c = stage.tp, stage.cp
    if c == 1 or t == 1 or tp_dim == cp_dim:
        dim = cp_dim if t == 1 and c > 1 else tp_dim
        return DistributedStates(((dim, t * c),))
    return DistributedStates(((tp_dim, t), (cp_dim, c)))


def _holders(strategy: Strategy, layer: int) -> tuple[Stage, ...]:
    return tuple(p.stage_of_layer(layer) for p in strategy.pipelines)


def _layers_of(config: ModelSpec, name: str, layer: int) -> tuple[int, ...]:
    """The layers whose stages hold ``name``: a tied weight's two (``ModuleModel``)."""
    layers = getattr(config, "param_layers", None)
    return (layer,) if layers is None else tuple(layers(name))


def _tied_holders(strategy: Strategy, layers: tuple[int, ...]) -> tuple[Stage, ...]:
    """The stages holding any of ``layers``, pipeline by pipeline, each once: a tied
    weight (embedding and head) lives on its first and last stage, and its gradient sync
    sums the two as it sums the pipelines' (Megatron's embedding group)."""
    if len(layers) == 1:
        return _holders(strategy, layers[0])
    found: list[Stage] = []
    for pipeline in strategy.pipelines:
        for layer in layers:
            stage = pipeline.stage_of_layer(layer)
            if stage not in found:
                found.append(stage)
    return tuple(found)


def _annotation(
    stages: tuple[Stage, ...],
    kind: str,
    parts: dict[tuple[Stage, int], tuple[DeviceGroup, DistributedStates]],
) -> Annotation:
    """The annotation over ``stages``; ``parts`` holds each (stage, dim)'s group and DS, built
    once per strategy (65,536 ranks: 8,191 stages in each of some 250 annotations)."""
    dim = _STAGE_DIM[kind]
    pairs = []
    for s in stages:
        pair = parts.get((s, dim))
        if pair is None:
            pair = parts[(s, dim)] = (DeviceGroup(s.ranks), stage_states(s, dim))
        pairs.append(pair)
    return Annotation(tuple(g for g, _ in pairs), tuple(d for _, d in pairs), hdim=DUP)


def parameter_annotations(strategy: Strategy, config: ModelSpec) -> dict[str, ParamSpec]:
    """Every parameter's ``ParamSpec``, in ``named_parameters()`` order.

    Checks the strategy against the model first (StrategyError). Pure metadata: llama-32b
    on 48 ranks takes a few milliseconds.

    >>> from hspmd.models import get_config
    >>> from hspmd.plan.strategy import parse_strategy
    >>> specs = parameter_annotations(parse_strategy("1x1: R0-1:L0-3"), get_config("llama-tiny"))
    >>> str(specs["layers.0.attn.wo.weight"])
    'layers.0.attn.wo.weight [64, 64] [0,1]{1:2}'
    """
    check_strategy(strategy, config)
    # one annotation per (holding stages, kind): the layers of one stage share it (65,536
    # ranks: 8,191 stages per annotation, 4 built for the 80 layers of one-stage pipelines)
    holders: dict[tuple[int, ...], tuple[Stage, ...]] = {}
    cache: dict[tuple[tuple[int, ...], str], Annotation] = {}
    parts: dict[tuple[Stage, int], tuple[DeviceGroup, DistributedStates]] = {}
    checked: set[tuple[tuple[tuple[int, ...], str], tuple[int, ...]]] = set()
    specs = {}
    for name, shape in config.parameter_shapes().items():
        kind, layer = config.param_kind(name), config.param_layer(name)
        if kind == "row" and len(shape) < 2:
            raise ModelSpecError(
                f"{name} {list(shape)} is 1-D, so it cannot be row-parallel: make it "
                "replicate (a row-parallel layer's bias is added after the all-reduce)"
            )
        layers = _layers_of(config, name, layer)
        if layers not in holders:
            holders[layers] = _tied_holders(strategy, layers)
        key = (tuple(map(id, holders[layers])), kind)  # the stages live as long as strategy
        if key not in cache:
            cache[key] = _annotation(holders[layers], kind, parts)
        if (key, shape) in checked:  # every layer of a stage: one check per shape
            specs[name] = ParamSpec(name, shape, cache[key])
        else:
            specs[name] = _spec(name, shape, cache[key])
            checked.add((key, shape))
    return specs


def share_sizes(length: int, weights: tuple[float, ...]) -> tuple[int, ...]:
    """``length`` cut into ``len(weights)`` parts in proportion to ``weights`` (largest
    remainders; each part at least 1); equal weights give the even split of ``h1(3,2):``.

    >>> share_sizes(64, (3.0, 1.0)), share_sizes(5, (1.0, 1.0)), share_sizes(4, (100.0, 1.0, 1.0))
    ((48, 16), (3, 2), (2, 1, 1))
    """
    parts = len(weights)
    total = sum(weights)
    spare = length - parts  # every part gets 1, the rest in proportion
    exact = [spare * w / total for w in weights]
    sizes = [1 + int(e) for e in exact]
    order = sorted(range(parts), key=lambda i: (-(exact[i] - int(exact[i])), i))
    for i in order[: length - sum(sizes)]:
        sizes[i] += 1
    return tuple(sizes)


def state_annotations(
    strategy: Strategy, config: ModelSpec, *, zero1: bool = False, shares: tuple[float, ...] = (),
    params: dict[str, ParamSpec] | None = None,
) -> dict[str, ParamSpec]:  # fmt: skip
    """The annotation of each parameter's fp32 master and Adam moments (module docstring);
    ``shares``: the pipelines' weights for uneven parts (``()``: even); ``params``: the
    strategy's ``parameter_annotations`` where the caller has them.

    >>> from hspmd.models import get_config
    >>> from hspmd.plan.strategy import parse_strategy
    >>> s = parse_strategy("1x1: R0-1:L0-3; 1x1: R2:L0-3")
    >>> str(state_annotations(s, get_config("llama-tiny"), zero1=True)["norm.weight"])
    'norm.weight [64] h0: [0,1]{D:2} [2]{}'
    """
    params = parameter_annotations(strategy, config) if params is None else params
    if not zero1 or len(strategy.pipelines) == 1:
        return params
    if shares and len(shares) != len(strategy.pipelines):
        raise StrategyError(
            f"zero_shares has {len(shares)} weights for {len(strategy.pipelines)} pipelines: "
            "give one weight per pipeline"
        )
    # every layer of a stage shares its parameters' annotations, so their states: built and
    # checked once per (annotation, kind, shape)
    made: dict[tuple[int, str, tuple[int, ...]], Annotation] = {}
    out = {}
    for name, spec in params.items():
        key = (id(spec.annotation), config.param_kind(name), spec.shape)
        if key not in made:
            made[key] = _zero1_spec(spec, key[1], shares).annotation
        out[name] = ParamSpec(name, spec.shape, made[key])
    return out


def lock_step(strategy: Strategy) -> bool:
    """Whether every pipeline runs the same schedule: the same stages' layers and the same
    number of micro-batches (TP and CP may differ). The replicas of a layer then meet its
    uses in one order, so ZeRO-3 can gather it per layer in every F and B; otherwise once per
    step (docs/zero.md).

    >>> from hspmd.plan.strategy import parse_strategy
    >>> lock_step(parse_strategy("2x1: R0:L0-1 R1:L2-3; 2x2: R2-3:L0-1 R4:L2-3"))
    True
    >>> lock_step(parse_strategy("2x1: R0:L0-3; 1x2: R1:L0-3"))
    False
    """

    def shape(p: Pipeline) -> tuple[object, ...]:
        return (tuple(s.layers for s in p.stages), p.num_micro_batches)

    return len({shape(p) for p in strategy.pipelines}) == 1


def _zero1_spec(spec: ParamSpec, kind: str, shares: tuple[float, ...] = ()) -> ParamSpec:
    param = spec.annotation
    dim = _state_dim(kind, spec.shape)
    if dim is None:
        return spec
    length, parts = spec.shape[dim], param.hsize
    if length < parts:
        raise StrategyError(
            f"ZeRO-1 cannot split {spec.name} (dim {dim} of {list(spec.shape)}) over {parts} "
            "data-parallel replicas: use fewer pipelines or turn zero1 off"
        )
    sizes = share_sizes(length, shares or (1.0,) * parts)
    even = len(set(sizes)) == 1
    state = Annotation(param.groups, param.states, hdim=dim, hsizes=None if even else sizes)
    return _spec(spec.name, spec.shape, state)


def _spec(name: str, shape: tuple[int, ...], annotation: Annotation) -> ParamSpec:
    try:
        annotation.check_shape(shape)
    except AnnotationError as error:
        raise StrategyError(f"{name} {list(shape)} cannot be sharded as planned: {error}") from None
    return ParamSpec(name, shape, annotation)
