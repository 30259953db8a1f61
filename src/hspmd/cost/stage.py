"""What one stage of a model costs per micro-batch: operators, bytes and seconds.

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
``2*n*H*V/t`` and a vocab-parallel cross-entropy. Each call pays its cost line's overhead, so small models see their launch costs (``hspmd.cost.lines``).

Any other model (``ModelSpec``) is costed from the figures measured on its graph
(``hspmd.models.spec.ModelCost``, from ``hspmd.cost.captured.costed``): per part (pre,
one block, post) the FLOPs, elements and calls of each cost line, split by the TP degree
where deduction found them split, backward twice the forward, and the TP collectives the
deduced plans name (docs/planner.md, "Any model"). The Llama formulas above stay for the
Llama presets.

No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass

from hspmd.cost.lines import CostModel, DeviceCost, LinkCost
from hspmd.models.config import LlamaConfig, ModelConfigError
from hspmd.models.spec import ModelCost, ModelSpec, PartCost

__all__ = [
    "StageWork",
    "embed_params",
    "figures",
    "head_params",
    "layer_params",
    "stage_params",
    "stage_work",
    "trains_sequence_parallel",
]


def trains_sequence_parallel(config: ModelSpec) -> bool:
    """Whether the planner may choose sequence parallelism: for the Llama presets only, as
    a user model's run refuses it (``TrainConfig``: the markers hspmd inserts keep the
    stream whole)."""
    return isinstance(config, LlamaConfig)


def figures(config: ModelSpec) -> ModelCost:
    """The measured cost figures of a model that is not a Llama preset (one line naming
    the fix where it has none)."""
    found = getattr(config, "cost", None)
    if not isinstance(found, ModelCost):
        raise ModelConfigError(
            f"{config.name} has no cost figures: measure them with "
            "hspmd.cost.captured.costed(model) first (hspmd simulate and hspmd plan do)"
        )
    return found


def layer_params(config: ModelSpec) -> int:
    """Parameters of one transformer block (all TP shards together)."""
    if not isinstance(config, LlamaConfig):
        layer = figures(config).layer
        return round(layer.params_split + layer.params_dup)
    H, F = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return H * q + 2 * H * kv + q * H + 3 * H * F + 2 * H


def embed_params(config: ModelSpec) -> int:
    if not isinstance(config, LlamaConfig):
        pre = figures(config).pre
        return round(pre.params_split + pre.params_dup)
    return config.vocab_size * config.hidden_size


def head_params(config: ModelSpec) -> int:
    """Final norm plus the head (nothing but the norm when tied to the embedding)."""
    if not isinstance(config, LlamaConfig):
        post = figures(config).post
        return round(post.params_split + post.params_dup)
    head = 0 if config.tie_embeddings else config.vocab_size * config.hidden_size
    return config.hidden_size + head


def stage_params(config: ModelSpec, num_layers: int, tp: int, *, first: bool, last: bool) -> int:
    """Parameters one rank of a stage holds (embedding and head split over the vocabulary;
    any other model: its split parameters divided, the others whole)."""
    if not isinstance(config, LlamaConfig):
        cost = figures(config)
        parts = [(cost.layer, num_layers), (cost.pre, int(first)), (cost.post, int(last))]
        split = sum(p.params_split * k for p, k in parts)
        whole = sum(p.params_dup * k for p, k in parts)
        return -(-round(split) // tp) + round(whole)
    total = num_layers * layer_params(config)
    if first:
        total += embed_params(config)
    if last:
        total += head_params(config)
    return -(-total // tp)


@dataclass(frozen=True, slots=True)
class StageWork:
    """Seconds of one micro-batch on one stage: ``forward_s`` and ``backward_s`` (both with
    their TP collectives, ``tp_comm_s`` of them, ``forward_comm_s`` in the forward), and the
    activation bytes it sends on."""

    forward_s: float
    backward_s: float
    tp_comm_s: float
    activation_bytes: float
    forward_comm_s: float = 0.0

    @property
    def backward_comm_s(self) -> float:
        return self.tp_comm_s - self.forward_comm_s


def _layer(
    device: DeviceCost, link: LinkCost, config: LlamaConfig, n: int, b: int, s: int, tp: int,
    elt: int, sp: bool,
) -> tuple[float, float, float]:  # fmt: skip
    """(forward compute, backward compute, one direction of TP comm) of one layer."""
    H, F = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    flops = [2 * n * H * q / tp, 2 * n * H * kv / tp, 2 * n * H * kv / tp, 2 * n * q * H / tp]
    flops += [2 * n * H * F / tp] * 3
    attention = 2 * b * (config.num_heads / tp) * s * s * config.head_dim
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
    bwd += device.seconds("elementwise", elementwise[1])  # SwiGLU's silu again (hspmd.ops)
    act = n * H * elt
    if sp:
        comm = 2 * (link.seconds("reduce-scatter", act, tp) + link.seconds("all-gather", act, tp))
    else:
        comm = 2 * link.seconds("all-reduce", act, tp)
    return fwd, bwd, comm


def _ulysses(
    device: DeviceCost, links: tuple[LinkCost, LinkCost], config: LlamaConfig, n: int, b: int,
    s: int, tp: int, cp: int, elt: int,
) -> tuple[float, float, float]:  # fmt: skip
    """(forward compute, backward compute, one direction of comm) of one layer on a stage
    of TP ``tp`` x CP ``cp``: every per-token op on ``n / cp`` tokens, attention on whole
    rows of ``heads / (tp cp)`` heads, the TP all-reduces on local tokens, and the four
    all-to-alls (q, k, v, the output) over the CP group (docs/mixed-length.md)."""
    link, cp_link = links  # of the TP groups and of the CP groups
    lf, lb, lc = _layer(device, link, config, n // cp, b, s, tp, elt, False)
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    # _layer charged attention for b rows of s positions on heads / tp: the CP stage runs
    # it on heads / (tp cp) of the same whole rows
    local = 2 * b * (config.num_heads / tp) * s * s * config.head_dim
    whole = 2 * b * (config.num_heads / (tp * cp)) * s * s * config.head_dim
    lf += device.seconds("attention", whole) - device.seconds("attention", local)
    lb += device.seconds("attention", 2 * whole) - device.seconds("attention", 2 * local)
    moved = (n // cp) * (2 * q + 2 * kv) / tp * elt  # the rank's q, k, v and output
    return lf, lb, lc + cp_link.seconds("all-to-all", moved, cp)


def stage_work(
    cost: CostModel, config: ModelSpec, ranks: tuple[int, ...], num_layers: int, *,
    micro_batch_size: int, seq_len: int, first: bool, last: bool, recompute: bool = False,
    sequence_parallel: bool = False, cp: int = 1, recompute_layers: int = 0,
) -> StageWork:  # fmt: skip
    """The work of one micro-batch on the stage of ``ranks`` holding ``num_layers`` layers.

    The stage runs at the pace of its slowest rank (its TP collectives wait for it). With
    ``cp > 1`` the ranks are TP x CP (context parallelism, Ulysses-style): the layers run
    on ``1/cp`` of the tokens plus four all-to-alls each way, the embedding, head and loss
    on whole rows after an all-gather of the sequence. ``recompute_layers``: with
    ``recompute``, only that many of the layers rerun their forward (0: all of them).
    """
    redo = _recomputed_share(num_layers, recompute, recompute_layers)
    tp = len(ranks) // cp
    device = max((cost.device_of(r) for r in ranks), key=lambda d: d.seconds("matmul", 1e12))
    link = cost.group_link(ranks)
    b, s, elt = micro_batch_size, seq_len, cost.element_bytes
    n = b * s
    sp = sequence_parallel and tp > 1
    if not isinstance(config, LlamaConfig):
        return _measured_work(
            device, link, figures(config), num_layers, b=b, s=s, tp=tp, elt=elt, sp=sp,
            first=first, last=last, redo=redo, hidden=config.hidden_size,
        )  # fmt: skip
    cp_link = cost.group_link(ranks[:cp], tp)  # the first of tp CP groups (consecutive ranks)
    if cp > 1:
        link = cost.group_link(ranks[::cp], cp)  # the first of cp TP groups (every cp-th rank)
        lf, lb, lc = _ulysses(device, (link, cp_link), config, n, b, s, tp, cp, elt)
    else:
        lf, lb, lc = _layer(device, link, config, n, b, s, tp, elt, sp)
    fwd, bwd = num_layers * lf, num_layers * lb
    fwd_comm = bwd_comm = num_layers * lc
    if cp > 1 and last:  # head_in gathers the sequence; its backward is a local slice
        fwd_comm += cp_link.seconds("all-gather", n * config.hidden_size * elt / cp, cp)
    if cp > 1 and first:  # the embedding's gradient, gathered over the CP group
        bwd_comm += cp_link.seconds("all-gather", n * config.hidden_size * elt / cp, cp)
    bwd += redo * fwd
    bwd_comm += redo * fwd_comm
    H, V = config.hidden_size, config.vocab_size
    if sp and cp == 1:  # the layers that keep activations gather attn_in and mlp_in again
        gathers = (1 - redo) * num_layers * 2 + (1 if last else 0)  # and head_in
        bwd_comm += gathers * link.seconds("all-gather", n * H * elt, tp)
    if first:
        fwd += device.seconds("elementwise", n * H * elt)
        bwd += device.seconds("elementwise", 2 * n * H * elt)
        if tp > 1:  # the vocab-parallel embedding's partial rows, summed over the TP group
            if sp and cp == 1:  # and scattered to the sequence shards; dX gathered back
                fwd_comm += link.seconds("reduce-scatter", n * H * elt, tp)
                bwd_comm += link.seconds("all-gather", n * H * elt, tp)
            else:  # on whole rows under CP; the backward of a sum is the identity
                fwd_comm += link.seconds("all-reduce", n * H * elt, tp)
    if last:
        head = 2 * n * H * V / tp
        logits = n * V / tp * 4  # the loss runs in fp32
        fwd += device.seconds("norm", n * H * elt) + device.seconds("matmul", head)
        fwd += 3 * device.seconds("elementwise", logits)
        bwd += device.seconds("norm", 2 * n * H * elt) + 2 * device.seconds("matmul", head)
        bwd += 2 * device.seconds("elementwise", logits)
        # vocab-parallel cross-entropy: the max, the sum of exponentials and the target's
        # logit over the vocabulary shards (hspmd.runtime.vocab_loss)
        fwd_comm += 3 * link.seconds("all-reduce", n * 4, tp)
        # dX of the split head: summed over the TP group, and scattered back to the
        # sequence shards under sequence parallelism (the backward of head_in's gather)
        bwd_comm += link.seconds("reduce-scatter" if sp else "all-reduce", n * H * elt, tp)
        if sp and cp == 1:  # head_in: the sequence shards gathered for the split head
            fwd_comm += link.seconds("all-gather", n * H * elt, tp)
    comm = fwd_comm + bwd_comm
    return StageWork(fwd + fwd_comm, bwd + bwd_comm, comm, n * H * elt / cp, fwd_comm)


def _recomputed_share(num_layers: int, recompute: bool, recompute_layers: int) -> float:
    """The share of a stage's layers whose forward reruns in backward."""
    if not recompute or not num_layers:
        return 0.0
    return min(recompute_layers, num_layers) / num_layers if recompute_layers else 1.0


def _part(
    device: DeviceCost, link: LinkCost, part: PartCost, *, b: int, s: int, tp: int, elt: int,
    sp: bool,
) -> tuple[float, float, float, float, float]:  # fmt: skip
    """(forward compute, backward compute, forward comm, backward comm, the forward's
    all-gathers under sequence parallelism: backward runs them again where the layer keeps
    its activations) of one part: each cost line's calls share its units evenly (the lines
    are affine, so this is the sum of the calls), split lines divided by ``tp``, the
    backward twice the forward."""
    fwd = bwd = fwd_comm = bwd_comm = gathers = 0.0
    for w in part.work:
        if w.calls <= 0:
            continue
        units = w.units.at(b, s) / (tp if (w.split_sp if sp else w.split) else 1)
        if w.line in ("norm", "elementwise"):
            units *= elt  # elements -> bytes
        fwd += w.calls * device.seconds(w.line, units / w.calls)
        bwd += w.calls * device.seconds(w.line, 2 * units / w.calls)
    for c in part.comm:
        if c.sequence_parallel != sp or c.calls <= 0:
            continue
        nbytes = c.elements.at(b, s) * (4 if c.fp32 else elt)
        seconds = c.calls * link.seconds(c.kind, nbytes / c.calls, tp)
        if c.backward:
            bwd_comm += seconds
        else:
            fwd_comm += seconds
            gathers += seconds if sp and c.kind == "all-gather" else 0.0
    return fwd, bwd, fwd_comm, bwd_comm, gathers


def _measured_work(
    device: DeviceCost, link: LinkCost, cost: ModelCost, num_layers: int, *, b: int, s: int,
    tp: int, elt: int, sp: bool, first: bool, last: bool, redo: float, hidden: int,
) -> StageWork:  # fmt: skip
    """``stage_work`` from a model's measured figures (module docstring)."""
    lf, lb, lfc, lbc, lg = _part(device, link, cost.layer, b=b, s=s, tp=tp, elt=elt, sp=sp)
    fwd, bwd = num_layers * lf, num_layers * lb
    fwd_comm, bwd_comm = num_layers * lfc, num_layers * (lbc + (1 - redo) * lg)
    bwd += redo * fwd
    bwd_comm += redo * fwd_comm
    for part, here in ((cost.pre, first), (cost.post, last)):
        if here:
            pf, pb, pfc, pbc, pg = _part(device, link, part, b=b, s=s, tp=tp, elt=elt, sp=sp)
            fwd, bwd, fwd_comm = fwd + pf, bwd + pb, fwd_comm + pfc
            bwd_comm += pbc + pg
    comm = fwd_comm + bwd_comm
    return StageWork(fwd + fwd_comm, bwd + bwd_comm, comm, b * s * hidden * elt, fwd_comm)
