"""Attention-head markers of a captured model: where context parallelism trades the
sequence split for a heads split and back (Ulysses all-to-alls).

Every attention op of the captured graph (``aten.scaled_dot_product_attention``, or
``hspmd.attention.causal_attention`` for packed documents) takes ``q, k, v`` of shape
``(B, heads, T, hd)`` (grouped-query attention: ``k, v`` have fewer heads). For each, hspmd
inserts the markers the hand-written Llama places itself, in its layout ``(B, T, heads, hd)``
(a transpose on each side, free views)::

    q = rope(transpose(view(q_proj(x))))      # a captured Llama, before
    q = rope(t(reshard(t(transpose(view(q_proj(x)))), "<attn>.q")))    # after; t: transpose(1, 2)
    y = reshard(t(attention(q, k, v)), "<attn>.ctx")  ->  t(y) to the model's next op

``<attn>`` is the attention's module path (``model.layers.0.self_attn``). The q/k/v marker
stands on the input's *entry*: walking back from the attention through ops that mix it
only with constants (RoPE's tables, scalars), the earliest tensor every path passes through
with the input's shape. So rotary embeddings run after the all-to-all, on the whole
sequence of the rank's heads, with tables computed from global positions; learned positions
are added before the first block, where the stream is whole.

Placements (``hspmd.plan.schema.activation_annotations``): an input computed by a
column-parallel projection is ``heads`` (heads split over TP, and over TP x CP on a CP
stage, as the Llama's); one that TP leaves whole (a fused replicate ``c_attn``) is
``cp_heads`` (duplicate over TP, heads split over CP). The output is split on the heads by
TP (``2``) or ``dup``, like its q. Without CP both equal what deduction finds: the markers
resolve to nothing.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.fx

from hspmd.attention import causal_attention
from hspmd.markers import is_reshard_node, reshard
from hspmd.models.spec import Placement

__all__ = ["PLACEMENT", "insert_head_markers"]

PLACEMENT = "hspmd_placement"
"""The meta key of a marker node whose placement is not read from its name."""

_ATTENTION = (torch.ops.aten.scaled_dot_product_attention.default, causal_attention)
_LINEAR = torch.ops.aten.linear.default
_TRANSPOSE = torch.ops.aten.transpose.int
_ROLES = ("q", "k", "v", "ctx")


def _shape(node: object) -> str | None:
    """A node's symbolic shape as text (sizes are SymInts: ``s0`` is the batch), or None."""
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return str(tuple(val.shape)) if isinstance(val, torch.Tensor) else None


def _constants(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """Nodes made from sizes, buffers and the step's inputs only (RoPE's tables, also from
    packed documents' restarting positions; ``arange(T)``): what every rank of a stage
    holds whole, the stream never mixed in."""
    out: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if node.op == "placeholder":  # tokens, targets, segments: whole on every rank
            out.add(node)
        elif node.op == "get_attr":
            if not isinstance(_attr(node), torch.nn.Parameter):
                out.add(node)
        elif node.op == "call_function" and all(
            n in out for n in node.all_input_nodes if _shape(n) is not None
        ):
            out.add(node)
    return out


def _attr(node: torch.fx.Node) -> object:
    obj: object = node.graph.owning_module
    for part in str(node.target).split("."):
        obj = getattr(obj, part)
    return obj


def entry(x: torch.fx.Node, constants: set[torch.fx.Node]) -> torch.fx.Node:
    """The earliest node every data path into ``x`` passes through whose shape is
    ``x``'s, with only per-position mixing by ``constants`` between (module docstring)."""
    order = {n: i for i, n in enumerate(x.graph.nodes)}
    frontier, best, shape = {x}, x, _shape(x)
    while True:
        latest = max(frontier, key=order.__getitem__)
        if latest.op != "call_function" or is_reshard_node(latest):
            return best
        repeated = _repeated_heads(latest) if len(frontier) == 1 else None
        if repeated is not None:  # GQA's repeat_kv: the KV heads before it
            frontier, best, shape = {repeated}, repeated, _shape(repeated)
            continue
        frontier.remove(latest)
        frontier.update(
            n for n in latest.all_input_nodes
            if n not in constants and (n.op == "get_attr" or _shape(n) is not None)
        )  # fmt: skip
        if len(frontier) == 1:
            (only,) = frontier
            if _shape(only) != shape:
                return best
            best = only


_REPEAT = (torch.ops.aten.unsqueeze.default, torch.ops.aten.expand.default)
_MERGE = (torch.ops.aten.reshape.default, torch.ops.aten.view.default,
          torch.ops.aten._unsafe_view.default)  # fmt: skip


def _repeated_heads(node: torch.fx.Node) -> torch.fx.Node | None:
    """``y`` if ``node`` is ``reshape(expand(unsqueeze(y, 2)), (B, heads * n, T, hd))``, the
    ``repeat_kv`` of transformers' eager and masked attention: each of ``y``'s heads
    repeated ``n`` times, in order, so a split of ``y``'s heads is a split of ``node``'s."""
    chain = [node]
    for target in (_MERGE, _REPEAT[1:], _REPEAT[:1]):
        x = chain[-1]
        if x.op != "call_function" or x.target not in target:
            return None
        chain.append(x.args[0])  # type: ignore[arg-type]
    merge, expand, unsqueeze, y = chain
    if unsqueeze.args[1] != 2 or not isinstance(y, torch.fx.Node):
        return None
    vals = [n.meta.get("val") for n in (merge, expand, y)]
    if not all(isinstance(v, torch.Tensor) for v in vals):
        return None
    out, wide, kv = (tuple(v.shape) for v in vals)  # type: ignore[union-attr]
    n = wide[2]
    return y if len(kv) == 4 and out == (kv[0], kv[1] * n, *kv[2:]) else None


def _tp_split(x: torch.fx.Node, kinds: Mapping[str, str]) -> bool:
    """True if ``x`` comes from a column-parallel projection inside its block (no marker
    between): its heads are then split by TP already."""
    seen, stack = set(), [x]
    while stack:
        node = stack.pop()
        if node in seen or is_reshard_node(node) or node.op != "call_function":
            continue
        seen.add(node)
        if node.target is _LINEAR and kinds.get(str(node.args[1].target)) == "column":  # type: ignore[union-attr]
            return True
        stack.extend(node.all_input_nodes)
    return False


def _module_path(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    path = list(stack.values())[-1][0] if stack else ""
    return path or node.name


def _heads_layout(attention: torch.fx.Node, seq: str) -> bool:
    """q, k, v and the output 4-D ``(B, heads, T, hd)`` with T the tokens' length."""
    nodes = [attention, *attention.args[:3]]
    shapes = [n.meta.get("val") if isinstance(n, torch.fx.Node) else None for n in nodes]
    return all(
        isinstance(v, torch.Tensor) and v.dim() == 4 and str(v.shape[2]) == seq for v in shapes
    )


def _mark(graph: torch.fx.Graph, x: torch.fx.Node, name: str, placement: Placement) -> None:
    """``t(reshard(t(x), name))`` in place of ``x`` for its users; ``t``: transpose(1, 2)."""
    users = list(x.users)
    with graph.inserting_after(x):
        there = graph.call_function(_TRANSPOSE, (x, 1, 2))
    with graph.inserting_after(there):
        marked = graph.call_function(reshard, (there, name))
    with graph.inserting_after(marked):
        back = graph.call_function(_TRANSPOSE, (marked, 1, 2))
    marked.meta[PLACEMENT] = placement
    for user in users:
        user.replace_input_with(x, back)


def insert_head_markers(gm: torch.fx.GraphModule, kinds: Mapping[str, str]) -> int:
    """Mark the heads of every attention of ``gm`` whose q, k, v and output are
    ``(B, heads, T, hd)`` (module docstring); returns how many attentions were marked."""
    tokens = next(n for n in gm.graph.nodes if n.op == "placeholder")
    seq = str(tokens.meta["val"].shape[1]) if "val" in tokens.meta else ""
    graph, marked = gm.graph, 0
    names = {str(n.args[1]) for n in graph.nodes if is_reshard_node(n)}  # the model's own
    constants, done = _constants(graph), set()
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _ATTENTION:
            continue
        if not seq or not _heads_layout(node, seq):
            continue
        path = _module_path(node)
        while any(f"{path}.{role}" in names for role in _ROLES):
            path += "_"  # a second attention in one module, or the model's own names
        names.update(f"{path}.{role}" for role in _ROLES)
        first: Placement | None = None
        for x, role in zip(node.args[:3], _ROLES, strict=False):
            assert isinstance(x, torch.fx.Node)
            at = entry(x, constants)
            placement: Placement = "heads" if _tp_split(at, kinds) else "cp_heads"
            first = first or placement
            if at not in done:  # one tensor in two roles (q is k): marked once
                done.add(at)
                _mark(graph, at, f"{path}.{role}", placement)
        _mark(graph, node, f"{path}.ctx", 2 if first == "heads" else "dup")  # as its q
        marked += 1
    graph.lint()
    gm.recompile()
    return marked
