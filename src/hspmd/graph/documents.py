"""Packed documents in a captured graph: each causal attention stays inside its document.

A packed row holds several documents; the captured step takes their ids as a third input,
``segments`` (B, T) int64 (``hspmd.train.packing``). Every call of
``aten.scaled_dot_product_attention`` that is causal, without a mask and without dropout
becomes ``hspmd.attention.causal_attention(q, k, v, segments, scale=, enable_gqa=)``: the
same attention inside each document, none across (the op the Llama preset calls, with its
deduction rule)::

    scaled_dot_product_attention(q, k, v, None, 0.0, True, scale=0.35, enable_gqa=True)
        -> causal_attention(q, k, v, segments, scale=0.35, enable_gqa=True)

An attention with a mask is left as it is and reported: the mask is the model's, and
hspmd cannot tell whether it keeps documents apart. One with dropout is left too (its
weights are dropped by position: ``hspmd.randomness``), and reported apart: packed rows
have no positions in the step's batch, so packing refuses a model that drops
(``hspmd.train.packing.check_packed_dropout``).

>>> import torch
>>> graph = torch.fx.Graph()
>>> q, segments = graph.placeholder("q"), graph.placeholder("segments")
>>> sdpa = torch.ops.aten.scaled_dot_product_attention.default
>>> _ = graph.output(graph.call_function(sdpa, (q, q, q), {"is_causal": True}))
>>> keep_documents_apart(graph, segments)
DocumentAttention(replaced=1, masked=(), dropped=())
>>> [n.target.__name__ for n in graph.nodes if n.op == "call_function"]
['causal_attention']
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from hspmd.attention import causal_attention, plain_causal

__all__ = ["DocumentAttention", "keep_documents_apart"]

_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")


@dataclass(frozen=True, slots=True)
class DocumentAttention:
    """What ``keep_documents_apart`` did: attentions replaced, and the nodes of those it
    left: ``masked`` (a mask, or not causal) and ``dropped`` (causal with dropout)."""

    replaced: int
    masked: tuple[torch.fx.Node, ...]
    dropped: tuple[torch.fx.Node, ...]


def keep_documents_apart(graph: torch.fx.Graph, segments: torch.fx.Node) -> DocumentAttention:
    """Replace each plain causal SDPA of ``graph`` by ``causal_attention`` on ``segments``
    (module docstring)."""
    replaced = 0
    masked: list[torch.fx.Node] = []
    dropped: list[torch.fx.Node] = []
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _SDPA:
            continue
        bound = dict(zip(_SDPA_ARGS, node.args, strict=False)) | dict(node.kwargs)
        if not plain_causal(bound):
            causal = plain_causal({**bound, "dropout_p": 0.0})
            (dropped if causal else masked).append(node)
            continue
        kwargs = {"scale": bound.get("scale"), "enable_gqa": bool(bound.get("enable_gqa", False))}
        with graph.inserting_before(node):
            new = graph.call_function(
                causal_attention, (bound["query"], bound["key"], bound["value"], segments), kwargs
            )
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        replaced += 1
    return DocumentAttention(replaced, tuple(masked), tuple(dropped))
