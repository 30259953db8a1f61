"""ZeRO-3's gather points: where an executable graph starts and stops using its parameters.

Every node of an executable graph carries its layer (``node.meta["layer"]``: ``i`` for
``layers.i``, None for the embedding, the final norm, the head and the loss;
``hspmd.specialize.recompute``). A *unit* is the parameters one layer's nodes use: the nodes
before the first layer (the embedding), each layer, and the nodes after the last (norm +
head); an untagged node between two layers (a reshard's communication) counts with the
layer before it. Units depend on the model, not on the rank's TP degree, so the replicas of a
layer gather the same parameters in the same order (their model order). Before a unit's
first node the pass inserts ``enter(k)`` (its parameters must be gathered), after its last
``leave(k)`` (the forward is done with them); both are calls of a ``UnitPoint`` module,
whose ``hook`` the runtime sets (``hspmd.train.zero_params``)::

    stage L0-1              forward                         backward
    zero_enter_0            gather unit 0 (embed)           -
    embedding ...
    zero_leave_0            free it
    zero_enter_1            gather unit 1 (layers.0)        gathered again when autograd
    rms_norm ... linear                                     unpacks a weight it saved
    zero_leave_1            free it                         freed once its grads are in

A unit whose parameters only an embedding lookup reads (its backward needs the indices, not
the weight) is not gathered again in backward (``Unit.backward`` False). Points carry their
unit's layer, so ``checkpoint_layers`` puts them into the layer's recomputed submodule: a
recomputed layer's ``enter`` runs again in backward and gathers it there.

>>> class Two(nn.Module):
...     def __init__(self) -> None:
...         super().__init__()
...         self.emb, self.w = nn.Parameter(torch.ones(8, 4)), nn.Parameter(torch.ones(4, 4))
...     def forward(self, x: torch.Tensor) -> torch.Tensor:
...         return F.linear(F.embedding(x, self.emb), self.w)
>>> gm = torch.fx.symbolic_trace(Two())
>>> for node in gm.graph.nodes:
...     node.meta["layer"] = 0 if node.name == "linear" else None
>>> [(u.names, u.backward) for u in insert_points(gm, {"emb": "embed", "w": "layers.0.w"})]
[(('embed',), False), (('layers.0.w',), True)]
>>> [n.name for n in gm.graph.nodes if n.op == "call_module"]
['zero_enter_0', 'zero_leave_0', 'zero_enter_1', 'zero_leave_1']
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from hspmd.specialize.localize import vocab_parallel_embedding

__all__ = ["Unit", "UnitPoint", "insert_points"]

_LOOKUPS = (F.embedding, torch.ops.aten.embedding.default, vocab_parallel_embedding)


@dataclass(frozen=True, slots=True)
class Unit:
    """Parameters gathered together, in graph order; ``backward``: gathered again for it."""

    names: tuple[str, ...]
    backward: bool


class UnitPoint(nn.Module):
    """``enter`` or ``leave`` of unit ``unit`` in an executable graph; ``hook(kind, unit)``
    is the runtime's (None: does nothing, as on one device)."""

    def __init__(self, kind: str, unit: int) -> None:
        super().__init__()
        self.kind, self.unit = kind, unit
        self.hook: Callable[[str, int], None] | None = None

    def forward(self) -> None:
        if self.hook is not None:
            self.hook(self.kind, self.unit)

    def extra_repr(self) -> str:
        return f"{self.kind} unit {self.unit}"


_PRE, _POST = -1, 1 << 30  # the keys of the nodes before the first layer and after the last


def _spans(
    gm: torch.fx.GraphModule,
) -> tuple[dict[torch.fx.Node, int], dict[int, list[torch.fx.Node]]]:
    """Each compute node's key (its layer; ``_PRE``/``_POST`` outside the layers; an
    untagged node between layers: the layer before it) and each key's nodes in order."""
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    tags = [n.meta.get("layer") for n in nodes]
    later = [False] * len(nodes)  # a layer's node comes after this one
    for i in range(len(nodes) - 2, -1, -1):
        later[i] = later[i + 1] or isinstance(tags[i + 1], int)
    key_of: dict[torch.fx.Node, int] = {}
    spans: dict[int, list[torch.fx.Node]] = {}
    last: int | None = None
    for i, (node, tag) in enumerate(zip(nodes, tags, strict=True)):
        if isinstance(tag, int):
            last = key = tag
        else:
            key = _PRE if last is None else last if later[i] else _POST
        key_of[node] = key
        spans.setdefault(key, []).append(node)
    return key_of, spans


def insert_points(gm: torch.fx.GraphModule, names: Mapping[str, str]) -> tuple[Unit, ...]:
    """Insert every unit's ``enter`` and ``leave`` into ``gm`` (unsplit: before
    ``checkpoint_layers``) and return the units in forward order. ``names``: the graph's
    parameter targets -> the model's parameter names, in model order (those to gather;
    others stay)."""
    key_of, spans = _spans(gm)
    order = {name: i for i, name in enumerate(names.values())}
    used: dict[int, dict[str, bool]] = {}  # key -> name -> read by more than a lookup
    for node in gm.graph.nodes:
        if node.op != "get_attr" or str(node.target) not in names:
            continue
        name = names[str(node.target)]
        for user in node.users:
            seen = used.setdefault(key_of[user], {})
            seen[name] = seen.get(name, False) or user.target not in _LOOKUPS
    units: list[Unit] = []
    for key in sorted(used):
        span, k = spans[key], len(units)
        unit_names = tuple(sorted(used[key], key=order.__getitem__))
        units.append(Unit(unit_names, any(used[key].values())))
        for kind, anchor in (("enter", span[0]), ("leave", span[-1])):
            target = f"zero_{kind}_{k}"
            gm.add_submodule(target, UnitPoint(kind, k))
            where = gm.graph.inserting_before if kind == "enter" else gm.graph.inserting_after
            with where(anchor):
                point = gm.graph.call_module(target, ())
            point.meta["layer"] = anchor.meta.get("layer")
    gm.recompile()
    return tuple(units)
