"""Annotation plans as data and as JSON; the activation annotations a strategy implies.

A plan gives an annotation to every leaf tensor (inputs, parameters, optimizer states) and
to every ``reshard`` marker, by name. Everything else is deduced. JSON form (documented in
docs/plan-schema.md; ``PLAN_SCHEMA`` is the JSON Schema)::

    {"format": "hspmd.plan/1",
     "strategy": "1x2: R0-1:L0-3; 2x1: R2:L0-3",       # informational, may be null
     "options": {"zero": 0, "zero_shares": [], "sequence_parallel": false, "recompute": false,
                 "recompute_layers": 0, "schedule": "1f1b", "dtype": "fp32"},
     "model": {"source": "llama-tiny", "kwargs": {}, "num_params": 39,   # optional
               "fingerprint": "..."},                   # (hspmd.plan.identity)
     "inputs":           {"tokens": {"shape": [3, 16], "annotation": "h0(2,1): [0,1]{D:2} [2]{}"}, ...},
     "parameters":       {"embed.weight": {"shape": [256, 64], "annotation": "..."}, ...},
     "optimizer_states": {...same keys as parameters...},
     "reshards":         {"embed": {"shape": [3, 16, 64], "annotation": "..."}, ...}}

Under ``"zero": 2`` the gradients, and under ``"zero": 3`` also the parameters between their
uses, are kept under the ``optimizer_states`` annotation; ``parameters`` is where they are
used (docs/zero.md). Annotations are written in their text form; ``plan_from_json`` also accepts the dict form
of ``Annotation.to_json``.

Shapes of inputs and markers are per micro-batch: the executor cuts each pipeline's share
of the global batch into its micro-batches, and micro-batch ``j`` of every pipeline
together make one global tensor whose batch dim is the sum of the pipelines'
micro-batch sizes, split over the pipelines by the top tier ``h0`` (uneven sizes when the
micro-batch sizes differ). A pipeline with fewer micro-batches simply has no part in the
later ones.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from hspmd.annotation import DUP, Annotation, DeviceGroup
from hspmd.errors import AnnotationError, StrategyError
from hspmd.models.spec import HEADS, ModelSpec, row_dims
from hspmd.plan.identity import ModelIdentity
from hspmd.plan.params import ParamSpec, parameter_annotations, stage_states, state_annotations
from hspmd.plan.strategy import Stage, Strategy, StrategyOptions, check_strategy

__all__ = [
    "FORMAT",
    "PLAN_SCHEMA",
    "SECTIONS",
    "Plan",
    "activation_annotations",
    "build_plan",
    "input_annotations",
    "marker_names",
    "plan_from_json",
    "plan_to_json",
    "residual_dim",
]

FORMAT = "hspmd.plan/1"
SECTIONS = ("inputs", "parameters", "optimizer_states", "reshards")

_ENTRY_SCHEMA = {
    "type": "object",
    "required": ["shape", "annotation"],
    "additionalProperties": False,
    "properties": {
        "shape": {"type": "array", "items": {"type": "integer", "minimum": 1}},
        "annotation": {
            "description": "text form, e.g. 'h0: [0,1]{0:2} [2]{}', or Annotation.to_json()",
            "type": ["string", "object"],
        },
    },
}
_SECTION_SCHEMA = {"type": "object", "additionalProperties": _ENTRY_SCHEMA}
PLAN_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "hspmd annotation plan",
    "type": "object",
    "required": ["format", *SECTIONS],
    "additionalProperties": False,
    "properties": {
        "format": {"const": FORMAT},
        "strategy": {"type": ["string", "null"], "description": "the strategy string, if any"},
        "model": {
            "type": "object",
            "description": "the model the plan is for (hspmd.plan.identity): checked on load",
            "required": ["source", "kwargs", "num_params", "fingerprint"],
            "additionalProperties": False,
            "properties": {
                "source": {"type": "string"},
                "kwargs": {"type": "object"},
                "num_params": {"type": "integer", "minimum": 0},
                "fingerprint": {"type": "string"},
                "config": {"type": "string"},
            },
        },
        "options": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "zero": {"enum": [0, 1, 2, 3], "description": "ZeRO stage (docs/zero.md)"},
                "zero_shares": {
                    "type": "array",
                    "items": {"type": "number", "exclusiveMinimum": 0},
                    "description": "per pipeline: its part of the ZeRO shards ([]: even)",
                },
                "zero1": {"type": "boolean", "description": "read only: older files' zero 1"},
                "sequence_parallel": {"type": "boolean"},
                "recompute": {"type": "boolean"},
                "recompute_layers": {"type": "integer", "minimum": 0},
                "schedule": {"enum": ["1f1b", "gpipe"]},
                "dtype": {"enum": ["fp32", "bf16"]},
            },
        },
        **{section: _SECTION_SCHEMA for section in SECTIONS},
    },
}


@dataclass(frozen=True, slots=True)
class Plan:
    """An annotation plan: one ``ParamSpec`` per leaf tensor and per marker.

    ``optimizer_states`` holds one spec per parameter, shared by its fp32 master and Adam
    moments. Look-ups by name: ``plan.table("reshards")["layers.0.attn_out"]``.
    """

    inputs: tuple[ParamSpec, ...]
    parameters: tuple[ParamSpec, ...]
    optimizer_states: tuple[ParamSpec, ...]
    reshards: tuple[ParamSpec, ...]
    strategy: str | None = None
    options: StrategyOptions = field(default_factory=StrategyOptions)
    model: ModelIdentity | None = None  # whose parameters these are (None: not recorded)

    def table(self, section: str) -> dict[str, ParamSpec]:
        """The specs of ``section`` (one of ``SECTIONS``) by name."""
        if section not in SECTIONS:
            raise StrategyError(f"no plan section {section!r}: use one of {', '.join(SECTIONS)}")
        return {spec.name: spec for spec in getattr(self, section)}

    @property
    def ranks(self) -> tuple[int, ...]:
        """Every rank any annotation names, sorted."""
        found = {r for s in SECTIONS for spec in getattr(self, s) for r in spec.annotation.ranks}
        return tuple(sorted(found))

    def __str__(self) -> str:
        lines = [f"plan: {self.strategy or '(no strategy string)'}  [{self.options}]"]
        for section in SECTIONS:
            lines.append(f"{section}:")
            lines.extend(f"  {spec}" for spec in getattr(self, section))
        return "\n".join(lines)


# -- activations --------------------------------------------------------------------------------


def marker_names(config: ModelSpec) -> tuple[str, ...]:
    """Every marker of the model, in the order the forward pass meets them."""
    return tuple(spec.name for spec in config.markers())


def residual_dim(stage: Stage, *, sequence_parallel: bool) -> int:
    """The TP axis of the residual stream on ``stage``: the sequence (dim 1) under sequence
    parallelism, else duplicate. A context-parallel stage keeps it duplicate over TP: its
    sequence is split over its CP groups already, and SP there is not combined (the two
    splits of one dim would interleave the positions; docs/mixed-length.md)."""
    return 1 if sequence_parallel and stage.cp == 1 else DUP


def _batch_annotation(
    strategy: Strategy, layer: int, dim: int, cp_dim: int = DUP, *, sequence_parallel: bool = False
) -> Annotation:
    """Subgroups: the stage holding ``layer`` in each pipeline, DS ``{dim:t}`` (``{dim:t,
    cp_dim:c}`` on a context-parallel stage, ``stage_states``); top tier: the batch (dim 0)
    split by the pipelines' micro-batch sizes. ``sequence_parallel``: ``dim`` is the
    residual's, per stage (``residual_dim``)."""
    stages = [p.stage_of_layer(layer) for p in strategy.pipelines]
    sizes = tuple(p.micro_batch_size for p in strategy.pipelines)
    dims = [residual_dim(s, sequence_parallel=True) if sequence_parallel else dim for s in stages]
    return Annotation(
        tuple(DeviceGroup(s.ranks) for s in stages),
        tuple(stage_states(s, d, cp_dim) for s, d in zip(stages, dims, strict=True)),
        hdim=0,
        hsizes=None if len(set(sizes)) == 1 else sizes,
    )


def activation_annotations(
    strategy: Strategy, config: ModelSpec, *, seq_len: int, options: StrategyOptions | None = None
) -> dict[str, ParamSpec]:
    """The annotation each marker imposes, with its per-micro-batch global shape.

    ``B`` is the sum of the pipelines' micro-batch sizes (the top tier ``h0`` gives each
    pipeline its own), ``T = seq_len``. Inside a stage of TP degree t:

        marker                      shape      DS      under sequence parallel  produced as
        embed                       (B,T,H)    {D:t}   {1:t}                    partial {P:t}
        layers.i.input              (B,T,H)    {D:t}   {1:t}                    previous stage
        layers.i.attn_in / mlp_in   (B,T,H)    {D:t}   {D:t} (all-gather seq)   like input
        layers.i.attn.q / k / v     (B,T,n,hd) {2:t}   {2:t}                    {2:t}
        layers.i.attn.ctx           (B,T,nh,hd){2:t}   {2:t}                    {2:t}
        layers.i.attn_out / mlp_out (B,T,H)    {D:t}   {1:t} (reduce-scatter)   partial {P:t}
        head_in                     (B,T,H)    {D:t}   {D:t}                    like input
        logits                      (B,T,V)    {2:t}   {2:t}                    {2:t}

    On a stage of context-parallel degree c (TP x CP ranks, CP varying fastest) every DS
    gains the CP axis ``1:c`` (the sequence split), e.g. the residual ``{D:t,1:c}``,
    except: the heads markers ``q/k/v`` split the heads over both, ``{2:tc}`` (deduction
    finds ``{2:t,1:c}`` before them: the Ulysses all-to-all; ``ctx`` is its way back;
    ``cp_heads`` markers, of an attention TP leaves whole, are ``{D:t}`` and ``{D:t,2:c}``), and
    the post markers (``head_in``, ``logits``) are duplicate on it (the sequence is
    gathered before the head, so the loss runs on whole rows), as are a captured model's
    markers before its first block (``_whole_rows``). Sequence parallelism applies
    to the stages without CP only (``residual_dim``): a CP stage's residual is ``{D:t,1:c}``
    with or without it.

    The last column is what deduction finds before the marker on a Megatron-split layer;
    so ``attn_out`` resolves to an all-reduce (or a reduce-scatter under SP) and
    ``layers.i.input`` to a send/receive at a stage boundary. ``embed`` is on layer 0's
    stage, ``head_in`` and ``logits`` on the last layer's.
    """
    options = options or StrategyOptions()
    check_strategy(strategy, config, options=options, seq_len=seq_len)
    B = sum(p.micro_batch_size for p in strategy.pipelines)
    specs = {}
    whole = _whole_rows(config)
    for marker in config.markers():
        placement = marker.placement
        named = {"residual": DUP, "dup": DUP, "heads": 2, "cp_heads": DUP}
        dim = placement if isinstance(placement, int) else named[placement]
        cp_dim = 2 if placement in HEADS else DUP if marker.name in whole else 1
        shape = (*row_dims(config, B, seq_len), *marker.trailing)
        split = options.sequence_parallel and placement == "residual"
        specs[marker.name] = ParamSpec(
            marker.name, shape,
            _batch_annotation(strategy, marker.layer, dim, cp_dim, sequence_parallel=split),
        )  # fmt: skip
    return specs


def _whole_rows(config: ModelSpec) -> set[str]:
    """The markers whose tensors are whole on a CP stage's sequence: the post ones (the
    loss runs on whole rows) and, in a captured model, those before the first block: its
    stream is split at ``layers.0.input``, after what the model adds before its blocks
    (learned positions). The Llama's ``embed`` is its split point itself."""
    markers = config.markers()
    names = [m.name for m in markers]
    first = names.index("layers.0.input") if "layers.0.input" in names else 0
    pre = set() if config.markers_complete else set(names[:first])
    return pre | {m.name for m in markers if m.post}


def input_annotations(
    strategy: Strategy, config: ModelSpec, *, seq_len: int
) -> dict[str, ParamSpec]:
    """``tokens`` on layer 0's stages and ``targets`` on the last layer's, both (B, T) int64,
    batch split over the pipelines as for the markers, duplicate inside a stage; a
    dataset's fields (``ModuleModel.batch``) each on its layer's stages, (B, *item shape)."""
    B = sum(p.micro_batch_size for p in strategy.pipelines)
    fields = getattr(config, "batch", ())
    if fields:
        return {
            f.name: ParamSpec(f.name, (B, *f.shape), _batch_annotation(strategy, f.layer, DUP))
            for f in fields
        }
    return {
        "tokens": ParamSpec("tokens", (B, seq_len), _batch_annotation(strategy, 0, DUP)),
        "targets": ParamSpec(
            "targets", (B, seq_len), _batch_annotation(strategy, config.num_layers - 1, DUP)
        ),
    }


def build_plan(
    strategy: Strategy,
    config: ModelSpec,
    *,
    seq_len: int,
    options: StrategyOptions | None = None,
    global_batch: int | None = None,
) -> Plan:
    """The whole plan a strategy writes for the Llama model (StrategyError if it cannot)."""
    options = options or StrategyOptions()
    check_strategy(strategy, config, global_batch=global_batch, options=options, seq_len=seq_len)
    return Plan(
        inputs=tuple(input_annotations(strategy, config, seq_len=seq_len).values()),
        parameters=tuple(parameter_annotations(strategy, config).values()),
        optimizer_states=tuple(
            state_annotations(
                strategy, config, zero1=options.zero1, shares=options.zero_shares
            ).values()
        ),
        reshards=tuple(
            activation_annotations(strategy, config, seq_len=seq_len, options=options).values()
        ),
        strategy=str(strategy),
        options=options,
    )


# -- JSON ---------------------------------------------------------------------------------------


def plan_to_json(plan: Plan) -> dict[str, Any]:
    """The plan as a JSON-ready dict (``json.dumps`` it); ``plan_from_json`` reads it back."""
    out: dict[str, Any] = {"format": FORMAT, "strategy": plan.strategy}
    options = asdict(plan.options)
    out["options"] = {**options, "zero_shares": list(options["zero_shares"])}
    if plan.model is not None:
        out["model"] = plan.model.to_json()
    for section in SECTIONS:
        out[section] = {
            spec.name: {"shape": list(spec.shape), "annotation": str(spec.annotation)}
            for spec in getattr(plan, section)
        }
    return out


def plan_from_json(data: Mapping[str, Any] | str) -> Plan:
    """Read a plan from a dict or a JSON string, checking it (StrategyError names the entry).

    Checks: the format tag; no unknown keys; every section present; each entry's shape and
    annotation well formed and the annotation fitting the shape; optimizer states for
    exactly the parameters.
    """
    if isinstance(data, str):
        try:
            data = json.loads(data)
        except json.JSONDecodeError as error:
            raise StrategyError(f"plan is not valid JSON: {error}") from None
    if not isinstance(data, Mapping):
        raise StrategyError(f"a plan is a JSON object, not {type(data).__name__}")
    if data.get("format") != FORMAT:
        raise StrategyError(
            f"plan format is {data.get('format')!r}: an annotation plan is {FORMAT!r} "
            "(hspmd train --save-plan writes one; hspmd.plan.choice lists the formats)"
        )
    unknown = set(data) - {"format", "strategy", "options", "model", *SECTIONS}
    if unknown:
        allowed = ", ".join(PLAN_SCHEMA["properties"])
        raise StrategyError(f"unknown plan keys {sorted(unknown)}: allowed are {allowed}")
    missing = [s for s in SECTIONS if s not in data]
    if missing:
        raise StrategyError(f"plan lacks section(s) {missing}: give each, possibly empty ({{}})")
    sections = {s: tuple(_read_section(s, data[s])) for s in SECTIONS}
    params = {spec.name for spec in sections["parameters"]}
    states = {spec.name for spec in sections["optimizer_states"]}
    if params != states:
        raise StrategyError(
            f"optimizer_states must name exactly the parameters: missing "
            f"{sorted(params - states)}, extra {sorted(states - params)}"
        )
    strategy = data.get("strategy")
    if strategy is not None and not isinstance(strategy, str):
        raise StrategyError(f"plan strategy must be a string or null, not {strategy!r}")
    model = data.get("model")
    return Plan(
        **sections, strategy=strategy, options=_read_options(data.get("options") or {}),
        model=None if model is None else ModelIdentity.from_json(model, where="the plan"),
    )  # fmt: skip


def _read_options(data: Any) -> StrategyOptions:
    try:
        return StrategyOptions.from_dict(data)
    except TypeError:
        raise StrategyError(
            f"bad plan options {data!r}: allowed keys are "
            f"{list(PLAN_SCHEMA['properties']['options']['properties'])}"
        ) from None


def _read_section(section: str, entries: Any) -> Iterable[ParamSpec]:
    if not isinstance(entries, Mapping):
        raise StrategyError(f"plan section {section!r} must be an object of name: entry")
    for name, entry in entries.items():
        where = f"{section}[{name!r}]"
        if not isinstance(entry, Mapping) or set(entry) != {"shape", "annotation"}:
            raise StrategyError(f'{where} must be {{"shape": [...], "annotation": "..."}}')
        shape = entry["shape"]
        if not isinstance(shape, list) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in shape
        ):
            raise StrategyError(f"{where} has shape {shape!r}: expected a list of positive ints")
        if not isinstance(entry["annotation"], str | dict):
            raise StrategyError(f"{where} annotation must be its text form or a JSON object")
        try:
            annotation = Annotation.from_json(entry["annotation"])
            annotation.check_shape(shape)
        except AnnotationError as error:
            raise StrategyError(f"{where}: {error}") from None
        yield ParamSpec(name, tuple(shape), annotation)
