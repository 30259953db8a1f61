"""Ops with several outputs (``topk``, ``sort``, ``max.dim``, ``var_mean``): computed whole.

An ATen op that returns a tuple is one node whose outputs are taken by ``getitem`` nodes.
The tuple has no shape, so it gets no annotation of its own; each ``getitem`` stands for
one output and takes the op's data inputs as its own (so the reverse pass gives them the
output's gradient: a router's ``topk`` values carry its weight's gradient)::

    probs {0:2} ──> topk ──> getitem 0 (values)   {D:2}, data input: probs
                        └──> getitem 1 (indices)  {D:2}, data input: probs

No rule covers a tuple, so the op runs whole: its inputs are gathered to duplicate within
their groups first (a ``Fallback`` recorded once, on the op, as for an op without a rule)
and every output is duplicate. A mixture-of-experts router computes its top-k on every
rank of the stage, never on a slice of the tokens or of the experts' scores.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx

from hspmd.annotation import Annotation
from hspmd.deduce.axes import all_duplicate
from hspmd.deduce.rules import DeductionError, target_text
from hspmd.graph.capture import source_line
from hspmd.graph.shapes import ShapeInfo

__all__ = ["TUPLE_WHY", "multi_output_source", "whole_part"]

TUPLE_WHY = "an op with several outputs is computed whole"


def multi_output_source(node: torch.fx.Node, info: ShapeInfo) -> torch.fx.Node | None:
    """The op whose tuple of tensors ``node`` indexes (``topk(x, k)[0]``), else None."""
    if node.op != "call_function" or node.target is not operator.getitem:
        return None
    source = node.args[0]
    if not isinstance(source, torch.fx.Node) or source.op != "call_function":
        return None
    value = info.values.get(source.name)
    if isinstance(value, tuple | list) and any(isinstance(v, torch.Tensor) for v in value):
        return source
    return None


def whole_part(
    source: torch.fx.Node,
    info: ShapeInfo,
    known: Mapping[str, Annotation | None],
    gathered: dict[str, tuple[str, ...]],
) -> tuple[Annotation | None, tuple[torch.fx.Node, ...]]:
    """One output's annotation (None: the op reads constants only) and the op's data
    inputs. The first call for ``source`` records in ``gathered`` the inputs to gather
    (empty where all are duplicate already)."""
    data: list[torch.fx.Node] = []
    torch.fx.node.map_arg(
        (source.args, source.kwargs), lambda n: data.append(n) if n.name in info.specs else n
    )
    live = [(n, known[n.name]) for n in data if known.get(n.name) is not None]
    if not live:
        return None, tuple(data)
    first: Any = live[0][1]
    if any(a.groups != first.groups for _, a in live):  # type: ignore[union-attr]
        groups = " vs ".join(sorted({" ".join(map(str, a.groups)) for _, a in live}))  # type: ignore[union-attr]
        raise DeductionError(
            f"node {source.name} ({target_text(source.target)}) at {source_line(source)}: "
            f"inputs live on different device groups ({groups}). Fix: add a marker "
            "hspmd.reshard(x, name) on one input and give it the other's device groups"
        )
    dup = all_duplicate(first)
    if source.name not in gathered:
        gathered[source.name] = tuple(n.name for n, a in live if a != dup)
    return dup, tuple(data)
