"""Forward deduction: one linear pass over the fx graph giving every tensor's annotation.

Leaves take their annotation from the plan (placeholders: ``input_annotations``; parameter
``get_attr`` nodes: ``param_annotations``; reshard markers: ``marker_annotations`` for their
output; align nodes: their input's). Buffers and whatever is computed from buffers and sizes only (the RoPE tables)
are *constants*: annotation ``None``, present wherever a consumer needs them, duplicate on
every axis. Every other op keeps the device groups of its inputs (which must agree) and
gets its DS per subgroup, and its ``hdim``, from the per-axis rule of its target::

    subgroup s:  line up the inputs' DS on common axes -> rule per axis -> merge to a DS
    top tier:    rule on the inputs' hdims (one more axis); part sizes scale with the dim
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from hspmd.annotation import DUP, Annotation
from hspmd.deduce.axes import (
    AxesError,
    all_duplicate,
    axis_placements,
    common_degrees,
    merge_axes,
)
from hspmd.deduce.parts import TUPLE_WHY, multi_output_source, whole_part
from hspmd.deduce.rules import (
    DeductionError,
    NoRuleError,
    OpCall,
    RuleEntry,
    RuleError,
    TensorArg,
    lookup,
    target_text,
)
from hspmd.errors import AnnotationError
from hspmd.graph.capture import source_line
from hspmd.graph.shapes import ShapeInfo
from hspmd.markers import is_align_node, is_reshard_node
from hspmd.randomness import seeded_random


@dataclass(frozen=True, slots=True)
class Fallback:
    """An op no rule covers for its inputs' layouts: its ``gathered`` inputs are resharded
    to duplicate within their groups first, and the op runs whole on every rank of them
    (always correct). ``why``: the rule's refusal, or that the op has none."""

    node: str
    op: str
    where: str | None  # the user's file:line
    gathered: tuple[str, ...]
    why: str

    def __str__(self) -> str:
        at = f" at {self.where}" if self.where else ""
        return f"{self.op}{at}: gathers {', '.join(self.gathered)} ({self.why})"


@dataclass(frozen=True, slots=True)
class ForwardResult:
    annotations: dict[str, Annotation | None]  # tensor nodes; None = constant
    params: dict[str, str]  # get_attr node name -> parameter name
    inputs: dict[str, tuple[str, ...]]  # node name -> names of its data inputs
    fallbacks: tuple[Fallback, ...] = ()  # ops whose inputs must be gathered first


def _node_text(node: torch.fx.Node) -> str:
    where = source_line(node)
    at = f" at {where}" if where else ""
    return f"node {node.name} ({target_text(node.target)}){at}"


def _constant_inputs(
    node: torch.fx.Node, info: ShapeInfo, known: Mapping[str, Annotation | None]
) -> bool:
    """True if ``node`` reads only constant tensors and sizes (or nothing: ``arange``)."""

    def constant(n: torch.fx.Node) -> bool:
        if n.name in info.specs:
            return known.get(n.name) is None
        value = info.values.get(n.name)
        return isinstance(value, int | float | bool | str | torch.device | torch.dtype | None) or (
            isinstance(value, tuple) and all(isinstance(v, int) for v in value)
        )

    return all(constant(n) for n in node.all_input_nodes)


def _data_inputs(node: torch.fx.Node, entry: RuleEntry, info: ShapeInfo) -> list[torch.fx.Node]:
    args = node.args if entry.inputs is None else [node.args[i] for i in entry.inputs]
    found: list[torch.fx.Node] = []
    for value in (args, node.kwargs) if entry.inputs is None else (args,):
        torch.fx.node.map_arg(value, lambda n: found.append(n) if n.name in info.specs else n)
    return found


def _op_call(node: torch.fx.Node, data: list[torch.fx.Node], info: ShapeInfo) -> OpCall:
    positions = {n.name: i for i, n in enumerate(data)}
    tensors = tuple(TensorArg(i, info.specs[n.name].shape) for i, n in enumerate(data))

    def convert(n: torch.fx.Node) -> Any:
        if n.name in positions:
            return tensors[positions[n.name]]
        return info.values.get(n.name, info.specs.get(n.name))

    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), convert)
    shape = info.specs[node.name].shape
    return OpCall(target_text(node.target), tuple(args), dict(kwargs), tensors, shape)


def _scaled_hsizes(
    call: OpCall, anns: list[Annotation | None], out_hdim: int
) -> tuple[int, ...] | None:
    """Top-tier part sizes of the output: an input's sizes scaled by the dim's growth."""
    found: set[tuple[int, ...]] = set()
    explicit = False
    for x, ann in zip(call.inputs, anns, strict=True):
        if ann is None or ann.hdim < 0 or out_hdim < 0:
            continue
        explicit |= ann.hsizes is not None
        sizes = ann.hsizes or (x.shape[ann.hdim] // ann.hsize,) * ann.hsize
        length, new = x.shape[ann.hdim], call.out_shape[out_hdim]
        if any(s * new % length for s in sizes):
            raise RuleError(
                f"top-tier part sizes {list(sizes)} of dim {ann.hdim} (length {length}) do "
                f"not map onto output dim {out_hdim} (length {new})",
                "reshard before this op so that the parts stay whole",
            )
        found.add(tuple(s * new // length for s in sizes))
    if len(found) > 1:
        raise RuleError(
            f"inputs cut the top tier into different parts {sorted(found)}",
            "reshard one input to the other's top-tier part sizes",
        )
    return found.pop() if found and explicit else None


def apply_rule(entry: RuleEntry, call: OpCall, anns: list[Annotation | None]) -> Annotation:
    """The output annotation from the inputs' (``None``: constant, duplicate everywhere)."""
    live = [a for a in anns if a is not None]
    base = live[0]
    states = []
    for s in range(base.hsize):
        present = tuple(a.states[s] for a in live)
        degrees = common_degrees(present)
        per_input = [
            (DUP,) * len(degrees) if a is None else axis_placements(a.states[s], degrees)
            for a in anns
        ]
        out = tuple(entry.fn(call, tuple(p[i] for p in per_input)) for i in range(len(degrees)))
        states.append(merge_axes(out, degrees))
    hdim, hsizes = DUP, None
    if base.hsize > 1:
        hdim = entry.fn(call, tuple(DUP if a is None else a.hdim for a in anns))
        hsizes = _scaled_hsizes(call, anns, hdim)
    return Annotation(base.groups, tuple(states), hdim=hdim, hsizes=hsizes)


def _fail(node: torch.fx.Node, data: list[torch.fx.Node], anns: list[Any], why: str) -> str:
    shown = ", ".join(
        f"{n.name}: {'constant' if a is None else a}" for n, a in zip(data, anns, strict=True)
    )
    return f"{_node_text(node)} with inputs {shown}: {why}"


def deduce_node(
    node: torch.fx.Node, data: list[torch.fx.Node], entry: RuleEntry, info: ShapeInfo,
    known: Mapping[str, Annotation | None], memo: dict[Any, Annotation],
) -> Annotation | None:  # fmt: skip
    """``memo`` holds results by call and input annotations (layers of a stage repeat)."""
    anns = [known[n.name] for n in data]
    live = [a for a in anns if a is not None]
    if not live:
        return None
    if any(a.groups != live[0].groups for a in live):
        groups = " vs ".join(sorted({" ".join(map(str, a.groups)) for a in live}))
        raise DeductionError(
            _fail(node, data, anns, f"inputs live on different device groups ({groups}). "
                  "Fix: add a marker hspmd.reshard(x, name) on one input and give it the "
                  "other's device groups in the plan")
        )  # fmt: skip
    call = _op_call(node, data, info)
    key = (entry, call.op, repr(call.args), repr(call.kwargs), call.out_shape, tuple(anns))
    if key in memo:
        return memo[key]
    try:
        out = apply_rule(entry, call, anns)
        out.check_shape(call.out_shape)
    except RuleError as error:
        failed = DeductionError(_fail(node, data, anns, f"{error.reason}. Fix: {error.fix}"))
        failed.reason = error.reason  # type: ignore[attr-defined]  # for a Fallback's why
        raise failed from None
    except (AxesError, AnnotationError) as error:
        raise DeductionError(
            _fail(node, data, anns, f"{error}. Fix: add a reshard marker before this op")
        ) from None
    memo[key] = out
    return out


def _leaf(
    node: torch.fx.Node, params: Mapping[str, Annotation],
    inputs: Mapping[str, Annotation | None], module: torch.nn.Module,
) -> Annotation | None:  # fmt: skip
    if node.op == "placeholder":
        if node.target not in inputs:
            raise DeductionError(
                f"input {node.target!r} has no annotation: pass input_annotations="
                f"{{{node.target!r}: ...}}"
            )
        return inputs[str(node.target)]  # None: data every rank holds whole (a constant)
    if node.name in params:  # a tied weight's node on one stage (hspmd.specialize.cut)
        return params[node.name]
    name = str(node.target)
    if name in params:
        return params[name]
    if isinstance(_attr(module, name), torch.nn.Parameter):
        raise DeductionError(f"parameter {name!r} has no annotation: add it to param_annotations")
    return None  # a buffer: constant


def _attr(module: torch.nn.Module, target: str) -> Any:
    obj: Any = module
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _marker(node: torch.fx.Node, markers: Mapping[str, Annotation]) -> Annotation:
    name = node.args[1]
    if name not in markers:
        raise DeductionError(
            f"reshard marker {name!r} (node {node.name}) has no annotation: add it to "
            "marker_annotations"
        )
    return markers[str(name)]


def forward_annotations(
    gm: torch.fx.GraphModule,
    info: ShapeInfo,
    *,
    input_annotations: Mapping[str, Annotation | None],
    param_annotations: Mapping[str, Annotation],
    marker_annotations: Mapping[str, Annotation],
    strict: bool = False,
) -> ForwardResult:
    """Annotate every tensor node of ``gm`` (shapes from ``propagate_shapes``). An op no
    rule covers is a ``Fallback`` (its inputs gathered), or with ``strict`` an error."""
    known: dict[str, Annotation | None] = {}
    params: dict[str, str] = {}
    inputs: dict[str, tuple[str, ...]] = {}
    memo: dict[Any, Annotation] = {}
    fallbacks: list[Fallback] = []
    wholes: dict[str, tuple[str, ...]] = {}  # ops with several outputs: inputs to gather
    for node in gm.graph.nodes:
        if node.name not in info.specs:
            continue  # sizes and other non-tensor values; the output node
        if node.op in ("placeholder", "get_attr"):
            ann = _leaf(node, param_annotations, input_annotations, gm)
            if node.op == "get_attr" and ann is not None:
                params[node.name] = str(node.target)
        elif is_reshard_node(node):
            ann = _marker(node, marker_annotations)
            inputs[node.name] = (node.args[0].name,)
        elif is_align_node(node):  # identity: the output keeps the input's annotation
            ann = known[node.args[0].name]
            inputs[node.name] = (node.args[0].name,)
        elif (source := multi_output_source(node, info)) is not None:
            _refuse_seeded_random(source)
            ann, read = _part(source, info, known, wholes, fallbacks)
            inputs[node.name] = tuple(n.name for n in read)
        else:
            _refuse_seeded_random(node)
            entry = lookup(node.target)
            if entry is None and _constant_inputs(node, info, known):
                known[node.name] = None  # made from sizes and buffers only: a constant
                continue
            data = _data_inputs(node, entry or _EVERY_TENSOR, info)
            try:
                if entry is None:
                    raise NoRuleError(
                        f"{_node_text(node)}: no deduction rule for {target_text(node.target)}. "
                        "Fix: register one in src/hspmd/deduce/ (hspmd.deduce.rules.register)"
                    )
                ann = deduce_node(node, data, entry, info, known, memo)
            except DeductionError as error:
                if strict:
                    raise
                ann = _fallback(node, data, known, error, fallbacks)
            inputs[node.name] = tuple(n.name for n in data)
        if ann is not None:
            _check_shape(node, ann, info)
        known[node.name] = ann
    return ForwardResult(known, params, inputs, tuple(fallbacks))


def _part(
    source: torch.fx.Node, info: ShapeInfo, known: Mapping[str, Annotation | None],
    wholes: dict[str, tuple[str, ...]], fallbacks: list[Fallback],
) -> tuple[Annotation | None, tuple[torch.fx.Node, ...]]:  # fmt: skip
    """One output of an op with several outputs (``hspmd.deduce.parts``); its gathers
    are one ``Fallback`` on the op."""
    first = source.name not in wholes
    ann, data = whole_part(source, info, known, wholes)
    if first and wholes.get(source.name):
        op = target_text(source.target).removeprefix("torch.ops.")
        where = source_line(source)
        fallbacks.append(Fallback(source.name, op, where, wholes[source.name], TUPLE_WHY))
    return ann, data


def _refuse_seeded_random(node: torch.fx.Node) -> None:
    """No layout, nor the fallback, draws one device's numbers from torch's generator."""
    if seeded_random(node):
        raise DeductionError(
            f"{_node_text(node)}: {target_text(node.target)} draws from torch's random "
            "generator, so each rank would draw other numbers than one device does. "
            "Fix: use nn.Dropout or F.dropout, whose masks hspmd draws by position "
            '(docs/decisions.md, "Dropout equal under any strategy"), or drop the op'
        )


def _check_shape(node: torch.fx.Node, ann: Annotation, info: ShapeInfo) -> None:
    try:
        ann.check_shape(info.specs[node.name].shape)
    except AnnotationError as error:
        raise DeductionError(f"{_node_text(node)}: {error}") from None


_EVERY_TENSOR = RuleEntry(lambda call, placements: DUP)  # data inputs of an op with no rule


def _fallback(
    node: torch.fx.Node,
    data: list[torch.fx.Node],
    known: Mapping[str, Annotation | None],
    error: DeductionError,
    fallbacks: list[Fallback],
) -> Annotation:
    """The always-correct layout of an op no rule covers: every input duplicate within
    its groups, the op computed whole. Records which inputs must be gathered; refuses
    (re-raises) where the inputs already are duplicate and a rule still says no, or where
    they live on different groups."""
    live = [(n, known[n.name]) for n in data if known[n.name] is not None]
    if not live or any(a.groups != live[0][1].groups for _, a in live):  # type: ignore[union-attr]
        raise error
    dup = all_duplicate(live[0][1])  # type: ignore[arg-type]
    gathered = tuple(n.name for n, a in live if a != dup)
    if not gathered:
        if isinstance(error, NoRuleError):
            return dup  # duplicate inputs: the op runs whole on every rank
        raise error
    why = getattr(error, "reason", "no deduction rule")
    op = target_text(node.target).removeprefix("torch.ops.")
    fallbacks.append(Fallback(node.name, op, source_line(node), gathered, why))
    return dup
