"""Megatron's pairs read from a captured graph, for a model that gives no ``tp_rules``.

The projection names (``COMMON_TP_RULES``) miss most families: GPT-NeoX's
``query_key_value``/``dense``/``dense_h_to_4h``/``dense_4h_to_h``, OPT's ``out_proj``, GPT-J's
``fc_in``/``fc_out``. And a name alone can be wrong: Phi-3's ``o_proj`` and ``down_proj``
are named as rows, but their inputs come from fused projections that must stay whole, so
their split weights were gathered for every micro-batch. The graph says which pairs exist.

One forward pass carries, from every ``nn.Linear`` of a block with a ``(B, T, ...)`` output,
the contiguous split of its output features (``Split``: the dim it lands on, the linears it
comes from) through the ops that keep it: elementwise ops with each other or with constants
(an activation, ``gate * up``, RoPE's tables), views (the split lands on the leading factor:
``(B, T, 192) -> (B, T, 4 heads, 48)``), transposes, dropout, slices and concatenations of
other dims (RoPE's halves, GPT-NeoX's per-head ``q | k | v``), and the attention (q, k, v
split on the heads). A linear whose input arrives split on its last dim is a **row**, its
sources **columns** (their biases with them)::

    x -> query_key_value -> view (B,T,heads,3hd) -> chunk(dim=-1) -> rope -> sdpa -> dense
         column             split on heads         other dim         consts  heads   row

A cut along the split dim loses it: nanoGPT's ``c_attn(x).split(C, dim=2)``, Phi-3's
``qkv_proj`` and ``gate_up_proj``, GPT-BigCode's multi-query ``c_attn`` would give a rank the
q of some heads and no k. So does mixing with the stream or with an unsplit tensor, or any
other op (a norm, a matmul with ALiBi). Those linears replicate; deduction checks every
split that remains, and a head count TP does not divide is refused with the strategy.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.fx
from torch import nn

from hspmd.markers import is_reshard_node

__all__ = ["structural_kinds"]

aten = torch.ops.aten
_LINEAR = aten.linear.default
_ATTENTION = aten.scaled_dot_product_attention.default
_SAME = frozenset(
    {
        aten.clone.default, aten.contiguous.default, aten.alias.default, aten._to_copy.default,
        aten.to.dtype, aten.type_as.default, aten.dropout.default, aten.expand.default,
    }
)  # fmt: skip
_VIEWS = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default,
                    aten.flatten.using_ints, aten.unflatten.int})  # fmt: skip
_CUTS = frozenset({aten.slice.Tensor, aten.select.int, aten.cat.default, aten.stack.default})

Split = tuple[int, frozenset[str]]
"""A tensor cut along one dim by the contiguous split of some linears' output features:
``(dim, their weights)``."""


def _linear_weight(node: torch.fx.Node, linears: Mapping[str, nn.Module]) -> str | None:
    """The weight's name if ``node`` is an ``nn.Linear``'s own linear with a (B, T, ...)
    output, else None."""
    if node.op != "call_function" or node.target is not _LINEAR:
        return None
    weight, val = node.args[1], node.meta.get("val")
    if not isinstance(weight, torch.fx.Node) or weight.op != "get_attr":
        return None
    if not isinstance(val, torch.Tensor) or val.dim() < 3:
        return None  # OPT's (B * T, H): a marker cuts (batch, seq, ...) tensors only
    name = str(weight.target)
    return name if name.rsplit(".", 1)[0] in linears else None


def _is_tensor(node: torch.fx.Node) -> bool:
    """A tensor, also where hspmd inserted the node after capture (no ``val``)."""
    val = node.meta.get("val")
    if val is None:
        return is_reshard_node(node) or isinstance(node.target, torch._ops.OpOverload)
    return isinstance(val, torch.Tensor)


def _constants(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """Nodes made from sizes and buffers only (RoPE's tables, ``arange(T)``)."""
    module = graph.owning_module
    assert module is not None
    params = dict(module.named_parameters())
    out: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if node.op == "get_attr":
            if str(node.target) not in params:
                out.add(node)
        elif (
            node.op == "call_function"
            and not is_reshard_node(node)
            and all(n in out for n in node.all_input_nodes if _is_tensor(n))
        ):
            out.add(node)
    return out


def _shape(node: torch.fx.Node, shapes: Mapping[torch.fx.Node, tuple[Any, ...]]) -> Any:
    """``node``'s shape, also for a marker or transpose hspmd inserted (no ``val``)."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return tuple(val.shape)
    x = node.args[0] if node.args else None
    before = shapes.get(x) if isinstance(x, torch.fx.Node) else None
    if before is None or not (is_reshard_node(node) or node.target is aten.transpose.int):
        return None
    if is_reshard_node(node):
        return before
    a, b = (int(d) % len(before) for d in node.args[1:3])  # type: ignore[arg-type]
    out = list(before)
    out[a], out[b] = out[b], out[a]
    return tuple(out)


def _key(dims: tuple[Any, ...]) -> tuple[tuple[str, ...], int]:
    """A product of sizes, symbols apart: equal keys, equal products."""
    symbols, number = [], 1
    for d in dims:
        if isinstance(d, int):
            number *= d
        else:
            symbols.append(str(d))
    return tuple(sorted(symbols)), number


def _view_dim(dim: int, before: tuple[Any, ...], after: tuple[Any, ...]) -> int | None:
    """Where a view puts split ``dim``: the first dim of ``after`` past the same prefix
    product, where the split's leading factor lands (a merge keeps it as the leading part)."""
    prefix = _key(before[:dim])
    for k, size in enumerate(after):
        if _key(after[:k]) == prefix and size != 1:
            return k if isinstance(size, int) else None
    return None


def _propagate(
    node: torch.fx.Node,
    splits: Mapping[torch.fx.Node, Split],
    shapes: Mapping[torch.fx.Node, Any],
    constants: set[torch.fx.Node],
) -> Split | None:
    """The split of ``node``'s output from its inputs' (module docstring); None if it has
    none or loses it."""
    tensors = [n for n in node.all_input_nodes if _is_tensor(n) and n not in constants]
    cut = [splits.get(n) for n in tensors]
    if node.target is _ATTENTION:
        qkv = [splits.get(n) for n in node.args[:3] if isinstance(n, torch.fx.Node)]
        if len(qkv) == 3 and all(s is not None and s[0] == 1 for s in qkv):
            return 1, frozenset().union(*(s[1] for s in qkv if s is not None))
        return None
    known = [s for s in cut if s is not None]
    if not tensors or len(known) != len(cut) or len({s[0] for s in known}) != 1:
        return None  # mixed with the stream or unsplit tensors, or cut on two dims
    dim, weights = known[0][0], frozenset().union(*(s[1] for s in known))
    out = shapes.get(node)
    if is_reshard_node(node) or (out is not None and node.target in _SAME):
        return dim, weights
    before = shapes.get(tensors[0])
    moved = None if out is None or before is None else _moved(node, dim, before, out)
    return None if moved is None else (moved, weights)


def _int(value: object) -> int:
    assert isinstance(value, int), value
    return value


def _moved(
    node: torch.fx.Node, dim: int, before: tuple[Any, ...], out: tuple[Any, ...]
) -> int | None:
    """Where ``node`` moves split ``dim`` of its first input (shape ``before``); None where
    it loses the split."""
    target, args = node.target, node.args
    if target in _VIEWS:
        return _view_dim(dim, before, out)
    if target is aten.transpose.int:
        a, b = (_int(d) % len(out) for d in args[1:3])
        return {a: b, b: a}.get(dim, dim)
    if target is aten.permute.default:
        assert isinstance(args[1], list | tuple)
        return [_int(d) % len(out) for d in args[1]].index(dim)
    if target is aten.unsqueeze.default:
        return dim + 1 if _int(args[1]) % len(out) <= dim else dim
    if target in _CUTS:
        along = _int(args[1] if len(args) > 1 else node.kwargs.get("dim", 0))
        if target is aten.stack.default:
            return dim + 1 if along % len(out) <= dim else dim
        if along % len(before) == dim:
            return None  # cuts the features: a rank would get the q of some heads, no k
        return dim - 1 if target is aten.select.int and along % len(before) < dim else dim
    if isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags:
        return dim + len(out) - len(before)  # broadcast adds leading dims
    return None


def _pairs(gm: torch.fx.GraphModule, linears: Mapping[str, nn.Module]) -> dict[str, frozenset[str]]:
    """``{row weight: its column weights}``: one forward pass carrying each linear's split."""
    constants = _constants(gm.graph)
    splits: dict[torch.fx.Node, Split] = {}
    shapes: dict[torch.fx.Node, Any] = {}
    pairs: dict[str, frozenset[str]] = {}
    for node in gm.graph.nodes:
        shape = _shape(node, shapes)
        if shape is not None:
            shapes[node] = shape
        if node.op != "call_function" or node in constants:
            continue
        weight = _linear_weight(node, linears)
        if weight is None:
            found = _propagate(node, splits, shapes, constants)
            if found is not None:
                splits[node] = found
            continue
        x = splits.get(node.args[0]) if isinstance(node.args[0], torch.fx.Node) else None
        if x is not None and x[0] == len(shape) - 1:
            pairs[weight] = x[1]
        splits[node] = (len(shape) - 1, frozenset({weight}))
    return pairs


def structural_kinds(gm: torch.fx.GraphModule, module: nn.Module, blocks: str) -> dict[str, str]:
    """``{parameter: "column" | "row" | "replicate"}`` for every ``nn.Linear`` of the
    blocks (under the module path ``blocks``) of ``gm`` (module docstring): row and column
    where a pair is found, replicate for the others. A linear that would be both is
    replicate with every linear of its pairs."""
    linears = {
        name: m for name, m in module.named_modules()
        if isinstance(m, nn.Linear) and name.startswith(f"{blocks}.")
    }  # fmt: skip
    pairs = _pairs(gm, linears)
    columns = frozenset().union(*pairs.values())
    clash = {r for r in pairs if r in columns or any(c in pairs for c in pairs[r])}
    kinds = {f"{n}.{p}": "replicate" for n, m in linears.items() for p, _ in m.named_parameters()}
    for row, sources in pairs.items():
        if row in clash:
            continue
        kinds[row] = "row"
        for column in sources:
            prefix = column.rsplit(".", 1)[0]
            kinds.update({f"{prefix}.{p}": "column" for p, _ in linears[prefix].named_parameters()})
    return kinds
