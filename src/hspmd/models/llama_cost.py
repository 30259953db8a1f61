"""The Llama's own cost function: its operators, bytes and seconds by formula.

A stage (``TP`` ranks, a run of layers, maybe the embedding or the head) runs, per
micro-batch of ``b`` sequences of ``s`` tokens (``n = b * s``), each layer as
Megatron does (H hidden, F FFN, ``q = heads * head_dim``, ``kv = kv_heads * head_dim``,
every width divided by the TP degree ``t``):

==============  ==========================================  =========================
operator        forward units (per layer)                   backward
==============  ==========================================  =========================
matmul          wq, wk, wv, wo, w_gate, w_up, w_down:        two matmuls of the same
                ``2*n*H*q/t`` ... (FLOPs, one call each)     FLOPs each (dX and dW)
attention       ``2*b*(heads/t)*s*s*head_dim`` (causal)      twice the FLOPs
norm            2 RMS norms of ``n*H`` elements (bytes)       twice the bytes
elementwise     RoPE, SwiGLU, 2 residual adds (bytes)        twice the bytes (SwiGLU
                                                            thrice: silu again)
TP collective   2 all-reduces of ``n*H`` elements            2 more
==============  ==========================================  =========================

With sequence parallelism the two all-reduces become a reduce-scatter and an all-gather
each (the same ring bytes), backward gathers each gathered input again (two per layer that
keeps its activations, and the head's: ``hspmd.runtime.regather``), and norms run on
``n/t`` tokens. Recompute runs the forward again inside the backward. The first stage
adds the embedding gather and, under TP, the vocab-parallel embedding's all-reduce (a
reduce-scatter under SP, whose backward all-gathers); the last the final norm, the head
``2*n*H*V/t`` and a vocab-parallel cross-entropy. Each call pays its cost line's
overhead, so small models see their launch costs (``hspmd.cost.lines``).

With context parallelism (Ulysses-style, ``cp > 1``) every per-token op runs on ``n/cp``
tokens, attention on whole rows of ``heads/(t cp)`` heads, plus the all-to-alls of q, k,
v and the output over the CP group (docs/mixed-length.md).

This is what a captured graph's figures (``hspmd.models.cost_function.ModelCost``) give
for the Llama, within the tolerances of tests/cost/test_captured.py, without a graph:
llama-70b is costed in microseconds. No torch here.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hspmd.models.cost_function import ComputeLines, LinkLines, StageShape, StageWork

if TYPE_CHECKING:
    from hspmd.models.config import LlamaConfig

__all__ = ["LlamaCost", "llama_cost"]

Totals = tuple[float, float, float, float]  # forward, backward, forward comm, backward comm


@functools.cache
def llama_cost(config: LlamaConfig) -> LlamaCost:
    """The cost function of ``config``, one per config (the planner asks it ~10^5 times)."""
    return LlamaCost(config)


@dataclass(frozen=True, slots=True)
class LlamaCost:
    """The cost function (``hspmd.models.cost_function.CostFunction``) of one Llama."""

    config: LlamaConfig
    _parts: tuple[int, int, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_parts", self._part_params())

    @property
    def sequence_parallel(self) -> bool:
        return True

    @property
    def context_parallel(self) -> bool:
        return True

    @property
    def vocab_split(self) -> bool:
        return True

    def part_params(self) -> tuple[int, int, int]:
        """The embedding; one block; the final norm plus the head (nothing but the norm
        when tied to the embedding)."""
        return self._parts

    def _part_params(self) -> tuple[int, int, int]:
        c = self.config
        H, F = c.hidden_size, c.intermediate_size
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        layer = H * q + 2 * H * kv + q * H + 3 * H * F + 2 * H
        head = 0 if c.tie_embeddings else c.vocab_size * H
        return c.vocab_size * H, layer, H + head

    def stage_params(self, num_layers: int, tp: int, *, first: bool, last: bool) -> int:
        """Everything divided by TP (the embedding and head split over the vocabulary)."""
        embed, layer, head = self._parts
        total = num_layers * layer + (embed if first else 0) + (head if last else 0)
        return -(-total // tp)

    def saved_bytes(self, b: int, s: int, tp: int, *, elt: int, sequence_parallel: bool) -> float:
        """``b * s`` tokens of ``token_bytes``."""
        sp = sequence_parallel and tp > 1
        return s * b * self.token_bytes(tp, elt=elt, sequence_parallel=sp)

    def token_bytes(self, tp: int, *, elt: int, sequence_parallel: bool) -> float:
        """Bytes one block keeps for its backward per token of a micro-batch on a rank of
        TP degree ``tp``: two norms' inputs and fp32 statistics, the two gathered inputs
        (shards under SP: gathered again), q, k, v and the attention's output and fp32
        log-sum-exp, the MLP's gate, up and their product.

        >>> from hspmd.models.config import get_config
        >>> c = get_config("llama-tiny", hidden_size=64, intermediate_size=96, num_heads=8)
        >>> LlamaCost(c).token_bytes(1, elt=2, sequence_parallel=False)  # 1480 less RoPE
        1448.0
        """
        c = self.config
        H, F, heads = c.hidden_size, c.intermediate_size, c.num_heads
        q, kv = heads * c.head_dim, c.num_kv_heads * c.head_dim
        norms = 2 * (elt * H + 4) / (tp if sequence_parallel else 1)
        inputs = 2 * elt * H / (tp if sequence_parallel else 1)  # shards: gathered again
        attention = elt * (2 * q + 2 * kv) + 4 * heads
        mlp = 3 * elt * F  # gate, up, their SwiGLU product
        return norms + inputs + (attention + mlp) / tp

    def stage_work(
        self, shape: StageShape, *, device: ComputeLines, link: LinkLines, cp_link: LinkLines
    ) -> StageWork:
        """The module docstring's table over the stage's layers, parts and collectives."""
        tp, cp, b, s, elt = shape.tp, shape.cp, shape.b, shape.s, shape.element_bytes
        n, sp, redo = b * s, shape.sequence_parallel, shape.recomputed
        if cp > 1:
            lf, lb, lc = self._ulysses(device, (link, cp_link), n, b, s, tp, cp, elt)
        else:
            lf, lb, lc = self._layer(device, link, n, b, s, tp, elt, sp)
        fwd, bwd = shape.num_layers * lf, shape.num_layers * lb
        fwd_comm = bwd_comm = shape.num_layers * lc
        H = self.config.hidden_size
        if cp > 1 and shape.last:  # head_in gathers the sequence; its backward is a local slice
            fwd_comm += cp_link.seconds("all-gather", n * H * elt / cp, cp)
        if cp > 1 and shape.first:  # the embedding's gradient, gathered over the CP group
            bwd_comm += cp_link.seconds("all-gather", n * H * elt / cp, cp)
        bwd += redo * fwd
        bwd_comm += redo * fwd_comm
        if sp and cp == 1:  # the layers that keep activations gather attn_in and mlp_in again
            gathers = (1 - redo) * shape.num_layers * 2 + (1 if shape.last else 0)  # and head_in
            bwd_comm += gathers * link.seconds("all-gather", n * H * elt, tp)
        totals = (fwd, bwd, fwd_comm, bwd_comm)
        if shape.first:
            totals = self._embedding(totals, device, link, n, tp, elt, sp and cp == 1)
        if shape.last:
            totals = self._head(totals, device, link, n, tp, elt, sp, sp and cp == 1)
        fwd, bwd, fwd_comm, bwd_comm = totals
        comm = fwd_comm + bwd_comm
        return StageWork(fwd + fwd_comm, bwd + bwd_comm, comm, n * H * elt / cp, fwd_comm)

    def _layer(
        self, device: ComputeLines, link: LinkLines, n: int, b: int, s: int, tp: int, elt: int,
        sp: bool,
    ) -> tuple[float, float, float]:  # fmt: skip
        """(forward compute, backward compute, one direction of TP comm) of one layer."""
        c = self.config
        H, F = c.hidden_size, c.intermediate_size
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        flops = [2 * n * H * q / tp, 2 * n * H * kv / tp, 2 * n * H * kv / tp, 2 * n * q * H / tp]
        flops += [2 * n * H * F / tp] * 3
        attention = 2 * b * (c.num_heads / tp) * s * s * c.head_dim
        norm_bytes = n * H * elt / (tp if sp else 1)
        elementwise = [n * (q + kv) / tp * elt, n * 2 * F / tp * elt, n * H * elt, n * H * elt]
        fwd = sum(device.seconds("matmul", f) for f in flops)
        fwd += device.seconds("attention", attention)
        fwd += 2 * device.seconds("norm", norm_bytes)
        fwd += sum(device.seconds("elementwise", e) for e in elementwise)
        bwd = 2 * sum(device.seconds("matmul", f) for f in flops)
        bwd += device.seconds("attention", 2 * attention)
        bwd += 2 * device.seconds("norm", 2 * norm_bytes)
        bwd += sum(device.seconds("elementwise", 2 * e) for e in elementwise)
        bwd += device.seconds(
            "elementwise", elementwise[1]
        )  # SwiGLU's silu again (hspmd.fused_ops)
        act = n * H * elt
        if sp:
            rs, ag = link.seconds("reduce-scatter", act, tp), link.seconds("all-gather", act, tp)
            comm = 2 * (rs + ag)
        else:
            comm = 2 * link.seconds("all-reduce", act, tp)
        return fwd, bwd, comm

    def _ulysses(
        self, device: ComputeLines, links: tuple[LinkLines, LinkLines], n: int, b: int, s: int,
        tp: int, cp: int, elt: int,
    ) -> tuple[float, float, float]:  # fmt: skip
        """(forward compute, backward compute, one direction of comm) of one layer on a
        stage of TP ``tp`` x CP ``cp``: every per-token op on ``n / cp`` tokens, attention on
        whole rows of ``heads / (tp cp)`` heads, the TP all-reduces on local tokens, and the
        four all-to-alls (q, k, v, the output) over the CP group (docs/mixed-length.md)."""
        link, cp_link = links  # of the TP groups and of the CP groups
        c = self.config
        lf, lb, lc = self._layer(device, link, n // cp, b, s, tp, elt, False)
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        # _layer charged attention for b rows of s positions on heads / tp: the CP stage runs
        # it on heads / (tp cp) of the same whole rows
        local = 2 * b * (c.num_heads / tp) * s * s * c.head_dim
        whole = 2 * b * (c.num_heads / (tp * cp)) * s * s * c.head_dim
        lf += device.seconds("attention", whole) - device.seconds("attention", local)
        lb += device.seconds("attention", 2 * whole) - device.seconds("attention", 2 * local)
        moved = (n // cp) * (2 * q + 2 * kv) / tp * elt  # the rank's q, k, v and output
        return lf, lb, lc + cp_link.seconds("all-to-all", moved, cp)

    def _embedding(
        self, totals: Totals, device: ComputeLines, link: LinkLines, n: int, tp: int, elt: int,
        sp: bool,
    ) -> Totals:  # fmt: skip
        """``totals`` (forward, backward, forward comm, backward comm) plus the embedding:
        its gather, and under TP the vocab-parallel embedding's partial rows summed over the
        TP group (scattered to the sequence shards under SP, whose backward gathers dX back;
        on whole rows otherwise, and under CP: the backward of a sum is the identity)."""
        fwd, bwd, fwd_comm, bwd_comm = totals
        H = self.config.hidden_size
        fwd += device.seconds("elementwise", n * H * elt)
        bwd += device.seconds("elementwise", 2 * n * H * elt)
        if tp > 1:
            if sp:
                fwd_comm += link.seconds("reduce-scatter", n * H * elt, tp)
                bwd_comm += link.seconds("all-gather", n * H * elt, tp)
            else:
                fwd_comm += link.seconds("all-reduce", n * H * elt, tp)
        return fwd, bwd, fwd_comm, bwd_comm

    def _head(
        self, totals: Totals, device: ComputeLines, link: LinkLines, n: int, tp: int, elt: int,
        sp: bool, gathers: bool,
    ) -> Totals:  # fmt: skip
        """``totals`` plus the final norm, the split head and the vocab-parallel
        cross-entropy (the max, the sum of exponentials and the target's logit over the
        vocabulary shards: ``hspmd.runtime.vocab_loss``); dX of the head summed over the TP
        group and scattered back to the sequence shards under SP (the backward of head_in's
        gather, which ``gathers`` prices where it runs)."""
        fwd, bwd, fwd_comm, bwd_comm = totals
        H, V = self.config.hidden_size, self.config.vocab_size
        head = 2 * n * H * V / tp
        logits = n * V / tp * 4  # the loss runs in fp32
        fwd += device.seconds("norm", n * H * elt) + device.seconds("matmul", head)
        fwd += 3 * device.seconds("elementwise", logits)
        bwd += device.seconds("norm", 2 * n * H * elt) + 2 * device.seconds("matmul", head)
        bwd += 2 * device.seconds("elementwise", logits)
        fwd_comm += 3 * link.seconds("all-reduce", n * 4, tp)
        bwd_comm += link.seconds("reduce-scatter" if sp else "all-reduce", n * H * elt, tp)
        if gathers:  # head_in: the sequence shards gathered for the split head
            fwd_comm += link.seconds("all-gather", n * H * elt, tp)
        return fwd, bwd, fwd_comm, bwd_comm
