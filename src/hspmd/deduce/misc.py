"""Ops with their own rule: cat, embedding, attention, cross-entropy.

embedding ``(ids, W[V, H])`` on one axis::

    ids    W       out
    S(d)   D       S(d)     batch/sequence split
    D      S(0)    P        vocab-parallel: rows outside the local vocab give zeros
    D      S(1)    S(-1)    hidden split
    D      P       P

``scaled_dot_product_attention(q, k, v)``: q, k, v equal, split only on batch or heads
(grouped-query attention keeps whole groups when the degree divides the kv heads); the
same for ``hspmd.attention.causal_attention(q, k, v, segments)`` (packed documents).

``cross_entropy(logits[N, C, ...], targets[N, ...])``: split on N (and the extra dims) on
both gives a partial loss: each part holds the mean over its tokens, a summand once the
trainer weights it by its share of the tokens (DESIGN decision 6). Logits split on the
class dim (dim 1) with duplicate targets give a duplicate loss: the vocab-parallel
cross-entropy (max, sum-exp and target-logit all-reduces over the axis; specialization
makes it ``hspmd.specialize.loss.VocabParallelLoss``), whose logits gradient keeps the
class split::

    logits  targets  loss
    D       D        D
    S(0)    S(0)     P        token split: per-part mean losses
    S(1)    D        D        vocab-parallel
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hspmd.attention import causal_attention
from hspmd.deduce.rules import (
    DUP,
    PARTIAL,
    OpCall,
    RuleError,
    normalize_dim,
    placements_text,
    register,
)


@register(torch.cat, torch.concat, torch.concatenate)
def cat(call: OpCall, placements: tuple[int, ...]) -> int:
    dim = normalize_dim(call.arg(1, "dim", 0), len(call.out_shape))
    if len(set(placements)) != 1:
        raise RuleError(
            f"cat of inputs {placements_text(placements)}: they must match",
            "reshard the inputs to one layout first",
        )
    if placements[0] == dim:
        raise RuleError(
            f"cat along dim {dim}, which is split",
            "cat along a dim that is not split, or reshard to gather it first",
        )
    return placements[0]


@register(F.embedding, inputs=(0, 1))
def embedding(call: OpCall, placements: tuple[int, ...]) -> int:
    ids, weight = placements
    if ids == PARTIAL:
        raise RuleError("embedding ids are partial", "reshard the ids to duplicate")
    if ids >= 0 and weight == DUP:
        return ids
    if ids == DUP:
        return {DUP: DUP, PARTIAL: PARTIAL, 0: PARTIAL, 1: len(call.out_shape) - 1}[weight]
    raise RuleError(
        f"embedding with ids {placements_text((ids,))} and weight "
        f"{placements_text((weight,))} on one device axis",
        "split either the ids or the weight on an axis, not both",
    )


@register(torch._C._nn.scaled_dot_product_attention, F.scaled_dot_product_attention)
@register(causal_attention, inputs=(0, 1, 2))  # segments: data every rank holds whole
def attention(call: OpCall, placements: tuple[int, ...]) -> int:
    if len(call.inputs) != 3:
        raise RuleError(
            "scaled_dot_product_attention with attn_mask has no rule",
            "use is_causal=True, or build the mask into the inputs",
        )
    p = placements[0]
    q_ndim = call.inputs[0].ndim
    if len(set(placements)) != 1 or p == PARTIAL or p >= q_ndim - 2:
        raise RuleError(
            f"attention on q, k, v {placements_text(placements)}: all three must be split "
            "alike on a batch or heads dim (not sequence or head_dim), or duplicate",
            "reshard q, k and v to split the heads dim (tensor parallel) or to duplicate",
        )
    return p


@register(F.cross_entropy, inputs=(0, 1))
def cross_entropy(call: OpCall, placements: tuple[int, ...]) -> int:
    logits, targets = placements
    if call.kwargs.get("weight") is not None:
        raise RuleError("cross_entropy with class weights has no rule", "drop weight=")
    if logits == DUP and targets == DUP:
        return DUP
    if logits == 1 and targets == DUP:
        if call.kwargs.get("label_smoothing", 0.0):
            raise RuleError(
                "cross_entropy with label_smoothing on logits split on the class dim",
                "drop label_smoothing=, or reshard the logits to duplicate first",
            )
        return DUP
    matching = logits >= 0 and logits != 1 and targets == (logits if logits == 0 else logits - 1)
    if not matching:
        raise RuleError(
            f"cross_entropy of logits {placements_text((logits,))} and targets "
            f"{placements_text((targets,))}: both must be split on the same tokens, both "
            "duplicate, or the logits split on the class dim (1) with duplicate targets",
            "reshard the logits and targets to one of these layouts first",
        )
    reduction = call.kwargs.get("reduction", "mean")
    return targets if reduction == "none" else PARTIAL
