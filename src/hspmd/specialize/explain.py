"""What each rank would run under a strategy, computed from metadata only.

``explain(config, strategy, options, seq_len=...)`` resolves every reshard site's forward
and backward plan, the vocab-parallel loss's all-reduces (``loss_sites``) and every
parameter's gradient sync, constructs the pipelines from the forward communication
(checked against the strategy), and summarizes each rank: its
pipeline and stage, op count, held parameters, communication ops by kind, and schedule.
Nothing is allocated: the graph is traced on the meta device.

Under ZeRO (``options.zero``) Post's plans are each gradient's reduce to its shard and, for
stages 1 and 2, the parameter's gather back; under ZeRO-3 the gathers are listed on their own,
per layer in every F and B where the pipelines run in lock step (``lock_step``), else once
per step (docs/zero.md).

Communication counts are per micro-batch for F and B, per step for Post. A step of a
plan counts once for every rank it names; ``local`` steps (slicing, no traffic) and
identities are not communication. Each rank's communication is also listed by peers: the
group of a collective (``in [0,1]``) or the partners of point-to-point steps
(``to [2] from [0]``), with the bytes this rank's buffers hold for it (``Traffic``).
"""

from __future__ import annotations

import functools
import re
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hspmd.comm.plan import (
    AllGather,
    BatchedSendRecv,
    CommPlan,
    GroupCollective,
    SendRecv,
    SliceCollective,
    Step,
    volume,
)
from hspmd.comm.resolve import resolve
from hspmd.gcpause import paused_gc
from hspmd.models.spec import ModelSpec
from hspmd.plan.params import lock_step, state_annotations
from hspmd.plan.strategy import Strategy, StrategyOptions
from hspmd.specialize.pipeline import PipelineLayout, check_pipelines, construct_pipelines
from hspmd.specialize.schedule import make_schedule
from hspmd.specialize.sites import (
    ParamLayout,
    deduced_sites,
    marker_loss_sites,
    marker_params,
    marker_sites,
)

__all__ = ["Explanation", "RankSummary", "Traffic", "explain", "steps_by_rank", "traffic"]

NOT_COMM = ("local",)


@dataclass(frozen=True, slots=True)
class Traffic:
    """Steps of one kind with the same peers, as one rank sees them.

    ``peers`` is the collective's group (``in [0,1]``) or the point-to-point partners
    (``to [2] from [0]``); ``nbytes`` is the data this rank's buffers hold for those steps:
    the local piece of an all-reduce, reduce-scatter or all-to-all, the gathered piece of an
    all-gather, the slices of a split collective this rank takes part in, and what a
    send-recv or BSR sends plus what it receives.
    """

    kind: str
    peers: str
    count: int
    nbytes: int

    def text(self) -> str:
        return f"{self.kind} x{self.count} {self.peers} ({_size(self.nbytes)})"

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "peers": self.peers, "count": self.count, "bytes": self.nbytes}


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


@functools.lru_cache(maxsize=65536)
def _ranks_text(ranks: tuple[int, ...]) -> str:
    return "[" + ",".join(map(str, sorted(ranks))) + "]"


def _step_traffic(
    plan: CommPlan, index: int, step: Step, rank: int, group: tuple[int, ...] | None
) -> tuple[str, int] | None:
    """(peers, elements) of one step for ``rank`` (``group``: its group in a collective);
    None where it moves nothing."""
    if isinstance(step, GroupCollective):
        if group is None:
            group = next(tuple(g) for g in step.groups if rank in g)
        layout = plan.layouts[index + 1] if isinstance(step, AllGather) else plan.layouts[index]
        elements = volume(layout.piece(rank, plan.shape).region)
        return f"in {_ranks_text(group)}", elements
    if isinstance(step, SliceCollective):
        mine = [s for s in step.slices if rank in s.ranks]
        peers = {r for s in mine for r in s.ranks}
        return f"in {_ranks_text(tuple(peers))}", sum(volume(s.region) for s in mine)
    if isinstance(step, SendRecv):
        sends = {d for s, d in step.pairs if s == rank}
        recvs = {s for s, d in step.pairs if d == rank}
        elements = 0
        if sends:
            elements += volume(plan.layouts[index].piece(rank, plan.shape).region)
        if recvs:
            elements += volume(plan.layouts[index + 1].piece(rank, plan.shape).region)
        return _p2p_text(sends, recvs), elements
    if isinstance(step, BatchedSendRecv):
        moving = [t for t in step.transfers if t.src != t.dst and rank in (t.src, t.dst)]
        if not moving:
            return None
        sends = {t.dst for t in moving if t.src == rank}
        recvs = {t.src for t in moving if t.dst == rank}
        return _p2p_text(sends, recvs), sum(volume(t.region) for t in moving)
    return None


def _p2p_text(sends: set[int], recvs: set[int]) -> str:
    parts = [f"to {_ranks_text(tuple(sends))}"] if sends else []
    parts += [f"from {_ranks_text(tuple(recvs))}"] if recvs else []
    return " ".join(parts)


# a plan, a step's index in it, the step, and for a collective the rank's group in it
Entry = tuple[CommPlan, int, Step, tuple[int, ...] | None]


def steps_by_rank(plans: Sequence[CommPlan]) -> dict[int, list[Entry]]:
    """Every communication step of ``plans`` under each rank it names, in plan order.

    One pass over the steps, so summarizing all ranks costs what the plans hold, not
    ranks x plans (4096 ranks, hundreds of sites)."""
    out: dict[int, list[Entry]] = defaultdict(list)
    for plan in plans:
        for index, step in enumerate(plan.steps):
            if step.kind in NOT_COMM:
                continue
            if isinstance(step, GroupCollective):
                for group in step.groups:
                    for rank in group:
                        out[rank].append((plan, index, step, tuple(group)))
                continue
            for rank in step.ranks:
                out[rank].append((plan, index, step, None))
    return out


def traffic(entries: Sequence[Entry], rank: int, *, itemsize: int) -> tuple[Traffic, ...]:
    """``rank``'s communication in ``entries``, by kind and peers, with bytes (``Traffic``)."""
    count: Counter[tuple[str, str]] = Counter()
    elements: Counter[tuple[str, str]] = Counter()
    for plan, index, step, group in entries:
        found = _step_traffic(plan, index, step, rank, group)
        if found is None:
            continue
        key = (step.kind, found[0])
        count[key] += 1
        elements[key] += found[1]
    return tuple(
        Traffic(kind, peers, count[kind, peers], elements[kind, peers] * itemsize)
        for kind, peers in sorted(count)
    )


@dataclass(frozen=True, slots=True)
class RankSummary:
    rank: int
    pipeline: int
    stage: int
    tp_group: tuple[int, ...]
    layers: tuple[int, int]
    num_ops: int
    num_params: int  # parameter tensors held
    param_elements: int  # their local elements
    forward_comm: tuple[tuple[str, int], ...]  # (kind, count) per micro-batch
    backward_comm: tuple[tuple[str, int], ...]
    post_comm: tuple[tuple[str, int], ...]
    schedule: str  # the full action list (render() shortens long ones)
    forward_traffic: tuple[Traffic, ...] = ()  # per micro-batch
    backward_traffic: tuple[Traffic, ...] = ()
    post_traffic: tuple[Traffic, ...] = ()  # per step
    gather_traffic: tuple[Traffic, ...] = ()  # ZeRO-3's parameter gathers (Explanation.zero)
    cp: int = 1  # the stage's context-parallel degree (tp_group is then TP x CP ranks)

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "pipeline": self.pipeline,
            "stage": self.stage,
            "tp_group": list(self.tp_group),
            "cp": self.cp,
            "layers": list(self.layers),
            "num_ops": self.num_ops,
            "num_params": self.num_params,
            "param_elements": self.param_elements,
            "param_mib_fp32": round(self.param_elements * 4 / 2**20, 1),
            "forward_comm": dict(self.forward_comm),
            "backward_comm": dict(self.backward_comm),
            "post_comm": dict(self.post_comm),
            "forward_traffic": [t.to_json() for t in self.forward_traffic],
            "backward_traffic": [t.to_json() for t in self.backward_traffic],
            "post_traffic": [t.to_json() for t in self.post_traffic],
            "zero3_gather_traffic": [t.to_json() for t in self.gather_traffic],
            "schedule": self.schedule,
        }


@dataclass(frozen=True, slots=True)
class Explanation:
    strategy: Strategy
    options: StrategyOptions
    seq_len: int
    pipelines: PipelineLayout
    ranks: tuple[RankSummary, ...]
    post_kinds: tuple[tuple[str, int], ...]  # gradient sync plans by kind (over all params)
    post_examples: tuple[tuple[str, str], ...] = field(default=())  # (param, plan text)
    # (first layer, last layer, gradient sync kinds of their parameters), consecutive ranges
    layer_sync: tuple[tuple[int, int, tuple[str, ...]], ...] = field(default=())
    fallbacks: tuple[str, ...] = ()  # ops computed whole on gathered inputs (no rule fits)
    zero: tuple[str, ...] = ()  # what ZeRO shards, an example state annotation, how ZeRO-3 gathers

    def to_json(self) -> dict[str, Any]:
        return {
            "strategy": str(self.strategy),
            "zero": list(self.zero),
            "options": str(self.options),
            "seq_len": self.seq_len,
            "pipelines": self.pipelines.to_json(),
            "gradient_sync": dict(self.post_kinds),
            "gradient_sync_by_layers": [
                {"layers": [first, last], "kinds": list(kinds)}
                for first, last, kinds in self.layer_sync
            ],
            "ranks": [r.to_json() for r in self.ranks],
            "fallbacks": list(self.fallbacks),
        }


def _kinds(entries: Sequence[Entry]) -> tuple[tuple[str, int], ...]:
    return tuple(sorted(Counter(step.kind for _, _, step, _ in entries).items()))


@functools.cache
def _ops_per_part(config: ModelSpec) -> tuple[int, int, int]:
    """Ops (call nodes of the captured graph) of (the part before the first block, one
    block, the part after the last one, the loss included).

    Every block has the same ops, so the graphs of a 1- and a 2-block copy of the model on
    the meta device give them (``markers_complete`` models: dataclasses of ``num_layers``).
    """
    import dataclasses

    from hspmd.markers import is_reshard_node
    from hspmd.models.build import model_graph

    assert dataclasses.is_dataclass(config) and not isinstance(config, type)
    totals, embed_ops = [], 0
    for layers in (1, 2):
        small = dataclasses.replace(config, num_layers=layers, max_seq_len=8)
        calls = [n for n in model_graph(small).graph.nodes if n.op.startswith("call")]
        totals.append(len(calls))
        embed_ops = next(
            i for i, n in enumerate(calls) if is_reshard_node(n) and n.args[1] == "layers.0.input"
        )
    per_layer = totals[1] - totals[0]
    return embed_ops, per_layer, totals[0] - per_layer - embed_ops


@paused_gc()  # millions of objects that live on: hspmd.gcpause
def explain(
    config: ModelSpec,
    strategy: Strategy,
    options: StrategyOptions | None = None,
    *,
    seq_len: int,
    ranks: Sequence[int] | None = None,
    by_deduction: bool = False,
) -> Explanation:
    """Metadata-only specialization summary of every rank, or of ``ranks`` only (module
    docstring). The sites of a model whose markers fix them (``markers_complete``: the
    Llama presets) come from the markers' placements (``marker_sites``, no graph); any
    other model's, or with ``by_deduction=True``, by deducing each pipeline's graph on the
    meta device (``deduced_sites``)."""
    options = options or StrategyOptions()
    ops: dict[tuple[int, int], int] | None = None
    fallbacks: tuple[str, ...] = ()
    if config.markers_complete and not by_deduction:
        sites = marker_sites(strategy, config, options, seq_len=seq_len)
        sites, params = sites + marker_loss_sites(sites), marker_params(strategy, config, options)
    else:
        found = deduced_sites(strategy, config, options, seq_len=seq_len)
        sites, params, ops = found.sites + found.loss, found.params, found.num_ops
        fallbacks = found.fallbacks
    forward = [(s.name, s.forward_plan()) for s in sites]
    layout = construct_pipelines(forward, ranks=strategy.ranks)
    check_pipelines(layout, strategy)
    post = {name: p.sync_plan() for name, p in params.items()}
    gathers: dict[str, CommPlan] = {}
    zero: tuple[str, ...] = ()
    if options.zero:
        post, gathers, zero = _zero_plans(strategy, config, options, params)
    in_post = [] if options.zero == 3 else list(gathers.values())
    index = _Index(
        forward=steps_by_rank([plan for _, plan in forward]),
        backward=steps_by_rank([s.backward_plan() for s in sites]),
        held=_held_by_rank(params),
        post_steps=steps_by_rank([*post.values(), *in_post]),
        gathers=steps_by_rank(list(gathers.values()) if options.zero == 3 else []),
    )
    chosen = strategy.ranks if ranks is None else tuple(r for r in strategy.ranks if r in ranks)
    summaries = tuple(
        _summary(rank, strategy, config, options, layout, params, index, ops) for rank in chosen
    )
    kinds: Counter[str] = Counter()
    for plan in post.values():
        kinds.update(k for k in plan.kinds if k not in NOT_COMM)
    examples = _examples(post)
    return Explanation(
        strategy,
        options,
        seq_len,
        layout,
        summaries,
        tuple(sorted(kinds.items())),
        examples,
        _layer_sync(post, config),
        fallbacks,
        zero,
    )


def _zero_plans(
    strategy: Strategy, config: ModelSpec, options: StrategyOptions,
    params: dict[str, ParamLayout],
) -> tuple[dict[str, CommPlan], dict[str, CommPlan], tuple[str, ...]]:  # fmt: skip
    """Under ZeRO: each gradient's reduce to its state shard, each parameter's gather from it,
    and the summary lines."""
    states = state_annotations(strategy, config, zero1=True, shares=options.zero_shares)
    reduce, gather = {}, {}
    for name, p in params.items():
        state = states[name].annotation
        reduce[name] = resolve(p.grad, state, p.shape)
        gather[name] = resolve(state, p.annotation, p.shape)
    what = {1: "fp32 masters and Adam states", 2: "masters, Adam states and gradients",
            3: "masters, Adam states, gradients and parameters (between uses)"}  # fmt: skip
    name = next(iter(params))
    lines = [f"ZeRO-{options.zero}: {what[options.zero]} sharded over the replicas, e.g. "
             f"{name}: {states[name].annotation}"]  # fmt: skip
    if options.zero == 3:
        when = (
            "per layer in every F and B (the pipelines run in lock step)"
            if lock_step(strategy)
            else "once per step, before the first F (the pipelines' schedules differ)"
        )
        lines.append(f"ZeRO-3 gathers each parameter {when}, freed after its last use")
    return reduce, gather, tuple(lines)


@dataclass(frozen=True, slots=True)
class _Index:
    """Per rank: its forward and backward steps, the parameters it holds; the sync plans."""

    forward: dict[int, list[Entry]]
    backward: dict[int, list[Entry]]
    held: dict[int, list[str]]
    post_steps: dict[int, list[Entry]]  # the gradient syncs of the parameters each rank holds
    gathers: dict[int, list[Entry]]  # ZeRO-3's parameter gathers


def _held_by_rank(params: dict[str, ParamLayout]) -> dict[int, list[str]]:
    out: dict[int, list[str]] = defaultdict(list)
    for name, layout in params.items():
        for rank in layout.annotation.ranks:
            out[rank].append(name)
    return out


def _layer_sync(
    post: dict[str, CommPlan], config: ModelSpec
) -> tuple[tuple[int, int, tuple[str, ...]], ...]:
    """Gradient sync kinds per layer, merged into ranges of equal kinds. Each parameter
    counts with its layer (``param_layer``: the embedding with layer 0, the final norm and
    the head with the last layer, where their stages are)."""
    per_layer: list[set[str]] = [set() for _ in range(config.num_layers)]
    for name, plan in post.items():
        per_layer[config.param_layer(name)].update(
            k for k in plan.kinds if k not in NOT_COMM + ("identity",)
        )
    ranges: list[tuple[int, int, tuple[str, ...]]] = []
    for layer, found in enumerate(per_layer):
        kinds = tuple(sorted(found))
        if ranges and ranges[-1][2] == kinds:
            ranges[-1] = (ranges[-1][0], layer, kinds)
        else:
            ranges.append((layer, layer, kinds))
    return tuple(ranges)


def _examples(post: dict[str, CommPlan]) -> tuple[tuple[str, str], ...]:
    seen, out = set(), []
    for name, plan in post.items():
        key = plan.kinds
        if key not in seen:
            seen.add(key)
            out.append((name, f"{plan.src} -> {plan.dst}: {' + '.join(plan.kinds)}"))
    return tuple(out)


def _summary(
    rank: int,
    strategy: Strategy,
    config: ModelSpec,
    options: StrategyOptions,
    layout: PipelineLayout,
    params: dict[str, ParamLayout],
    index: _Index,
    ops: dict[tuple[int, int], int] | None,
) -> RankSummary:
    p, s = layout.locate(rank)
    pipeline = strategy.pipelines[p]
    stage = next(st for st in pipeline.stages if rank in st.ranks)
    if ops is not None:
        num_ops = ops[(p, pipeline.stages.index(stage))]
    else:
        embed_ops, layer_ops, head_ops = _ops_per_part(config)
        num_ops = layer_ops * len(stage.layers)
        num_ops += embed_ops if stage.first_layer == 0 else 0
        num_ops += head_ops if stage.last_layer == config.num_layers - 1 else 0
    held = [params[name] for name in index.held.get(rank, ())]
    elements = sum(_numel(x.annotation.piece(rank, x.shape).shape) for x in held)
    schedule = make_schedule(options.schedule, len(pipeline.stages), s, pipeline.num_micro_batches)
    forward = index.forward.get(rank, [])
    backward = index.backward.get(rank, [])
    grads = index.post_steps.get(rank, [])
    itemsize = 2 if options.dtype == "bf16" else 4
    return RankSummary(
        rank=rank,
        pipeline=p,
        stage=s,
        tp_group=stage.ranks,
        cp=stage.cp,
        layers=(stage.first_layer, stage.last_layer),
        num_ops=num_ops,
        num_params=len(held),
        param_elements=elements,
        forward_comm=_kinds(forward),
        backward_comm=_kinds(backward),
        post_comm=_kinds(grads),
        schedule=str(schedule),
        forward_traffic=traffic(forward, rank, itemsize=itemsize),
        backward_traffic=traffic(backward, rank, itemsize=itemsize),
        post_traffic=traffic(grads, rank, itemsize=4),  # gradients are fp32
        gather_traffic=traffic(index.gathers.get(rank, []), rank, itemsize=itemsize),
    )


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


def _compact(schedule: str, *, limit: int = 14) -> str:
    """Shorten a long action list: ``Pre F0 F1 F2 ... B32 Post`` keeps both ends."""
    words = schedule.split()
    if len(words) <= limit:
        return schedule
    half = limit // 2
    return " ".join([*words[:half], f"... ({len(words) - limit} more) ...", *words[-half:]])


def _comm_text(kinds: tuple[tuple[str, int], ...]) -> str:
    return ", ".join(f"{k} x{n}" for k, n in kinds) or "-"


_PEERS = re.compile(r"\[[\d,]*\]")


def _merge(bodies: list[tuple[str, ...]]) -> list[str]:
    """One text for several ranks' summaries that differ only in their peer lists."""
    out = []
    for lines in zip(*bodies, strict=True):
        if len(set(lines)) == 1:
            out.append(lines[0])
            continue
        columns = zip(*(_PEERS.findall(line) for line in lines), strict=True)
        values = [",".join(dict.fromkeys(c)) for c in columns]
        parts = _PEERS.split(lines[0])
        joined = parts[0] + "".join(v + p for v, p in zip(values, parts[1:], strict=True))
        text, _, size = joined.rpartition(" (")
        out.append(f"{text} respectively ({size}")
    return out


def _traffic_lines(phase: str, found: tuple[Traffic, ...]) -> list[str]:
    head = f"  {phase + ':':<21}"
    texts = [t.text() for t in found] or ["-"]
    return [head + texts[0], *(" " * len(head) + t for t in texts[1:])]


def _gathers_when(e: Explanation) -> str:
    return "gathers (F, B each)" if lock_step(e.strategy) else "gathers (per step)"


def runs_text(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2,5``."""
    out: list[str] = []
    start = prev = ranks[0]
    for r in [*ranks[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ",".join(out)


def render(
    explanation: Explanation, *, rank: int | None = None, kinds: dict[int, str] | None = None
) -> str:
    """The text ``hspmd explain`` prints; ``kinds`` (rank -> GPU kind) names each rank's GPU."""
    e = explanation
    lines = [f"strategy: {e.strategy}", f"options:  {e.options}, seq_len={e.seq_len}", ""]
    lines.append("pipelines (constructed from the forward communication; match the strategy):")
    for p, stages in enumerate(e.pipelines.pipelines):
        pipe = e.strategy.pipelines[p]
        chain = " -> ".join("[" + ",".join(map(str, st)) + "]" for st in stages)
        lines.append(f"  pipeline {p} ({pipe.num_micro_batches}x{pipe.micro_batch_size}): {chain}")
    lines += [
        "",
        "gradient sync (Post), plans by kind over all parameters: " + _comm_text(e.post_kinds),
    ]
    lines += [f"  e.g. {name}: {text}" for name, text in e.post_examples]
    by_layers = "; ".join(f"L{a}-{b} {' + '.join(kinds) or '-'}" for a, b, kinds in e.layer_sync)
    lines.append(f"  by layers: {by_layers}")
    lines += e.zero
    if e.fallbacks:
        lines.append("ops no rule covers, computed whole on gathered inputs (always correct):")
        lines += [f"  {line}" for line in e.fallbacks]
    lines.append("")
    chosen = [r for r in e.ranks if rank is None or r.rank == rank]
    if rank is not None and not chosen:
        from hspmd.errors import StrategyError

        raise StrategyError(f"rank {rank} is not in the strategy (ranks {list(e.strategy.ranks)})")
    blocks: dict[tuple[str, ...], list[tuple[int, tuple[str, ...]]]] = {}
    for r in chosen:
        gpu = f" ({kinds[r.rank]})" if kinds else ""
        body = (
            f"{gpu}: pipeline {r.pipeline} stage {r.stage} tp={len(r.tp_group) // r.cp}"
            f"{f' cp={r.cp}' if r.cp > 1 else ''} "
            f"layers {r.layers[0]}-{r.layers[1]} ops={r.num_ops} params={r.num_params} "
            f"({r.param_elements * 4 / 2**20:.1f} MiB fp32)",
            *_traffic_lines("F (per micro-batch)", r.forward_traffic),
            *_traffic_lines("B (per micro-batch)", r.backward_traffic),
            *_traffic_lines("Post", r.post_traffic),
            *(_traffic_lines(_gathers_when(e), r.gather_traffic) if e.options.zero == 3 else []),
            f"  schedule: {_compact(r.schedule)}",
        )
        key = tuple(_PEERS.sub("[]", line) for line in body)
        blocks.setdefault(key, []).append((r.rank, body))
    if len(chosen) > 1:
        lines.append(
            "per rank (ops = nodes of its executable graph, compute and communication; bytes: "
            "what its buffers hold for those steps; ranks of one stage that differ only in "
            "their peers are merged, their peers listed in rank order):"
        )
    for members in blocks.values():
        ranks = [rank for rank, _ in members]
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {runs_text(ranks)}"
        merged = _merge([body for _, body in members])
        lines += [who + merged[0], *merged[1:]]
    return "\n".join(lines)
