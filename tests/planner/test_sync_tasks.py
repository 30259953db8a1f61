"""The simulator's gradient sync is the runtime's: the plans the trainer builds (through
``hspmd.train``'s own functions), priced here collective by collective with the cost lines,
add up to the simulated sync tasks."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import pytest

from hspmd.comm.plan import (
    AllGather,
    CommPlan,
    GroupCollective,
    Local,
    ReduceScatter,
    SplitAllGather,
    SplitAllReduce,
    SplitReduceScatter,
    volume,
)
from hspmd.cost.cluster import load_cluster
from hspmd.cost.lines import CostModel
from hspmd.models.llama import get_config
from hspmd.plan.strategy import StrategyOptions, parse_strategy
from hspmd.planner.predict import step_tasks
from hspmd.train.sync import BUCKET_BYTES, grad_sync_plan
from hspmd.train.zero import zero1_plan
from hspmd.train.zero_shards import shard_buckets

CONFIG = get_config("llama-tiny")  # 4 layers, 2 KV heads: TP 1 or 2
DP = "2x1: R0:L0-3; 2x1: R8:L0-3"  # two nodes of H800
TP_DP = "2x1: R0-1:L0-3; 2x1: R8-9:L0-3"
# TP 2 in two stages on H800 beside TP 1 in one stage on an H20: split-all-reduce
HETERO = "2x1: R0-1:L0-1 R2-3:L2-3; 2x1: R16:L0-3"


@pytest.fixture(scope="module")
def cost() -> CostModel:
    return CostModel.of(load_cluster("hetu-h800-h20"), dtype="bf16")


def _direct(plans: Sequence[CommPlan], cost: CostModel, element_bytes: int) -> float:
    """Plans started together, priced by hand: each collective by ``cost.collective`` as the
    runtime issues it (one-step reduce-scatters and all-gathers over the same groups packed
    into one, as ``start_plans`` does), the point-to-point messages summed per pair and sent
    by ``cost.send`` (per rank max(sent, received)); steps one after another."""
    total, pairs = 0.0, defaultdict(float)
    packed: dict[tuple, dict[tuple[int, ...], int]] = defaultdict(lambda: defaultdict(int))
    for plan in plans:
        step = plan.steps[0]
        if len(plan.steps) == 1 and isinstance(step, ReduceScatter | AllGather):
            for g in step.groups:
                n = volume(plan.src.piece(g[0], plan.shape).region) * element_bytes
                packed[(step.kind, step.groups)][g] += n * (
                    len(g) if step.kind == "all-gather" else 1
                )
            continue
        for step, before in zip(plan.steps, plan.layouts, strict=False):
            if isinstance(step, Local):
                continue
            if isinstance(step, GroupCollective):
                sizes = [volume(before.piece(g[0], plan.shape).region) * element_bytes
                         * (len(g) if isinstance(step, AllGather) else 1) for g in step.groups]  # fmt: skip
                total += max(cost.collective(step.kind, n, g, len(step.groups))
                             for n, g in zip(sizes, step.groups, strict=True))  # fmt: skip
            elif isinstance(step, SplitAllReduce):
                total += _split_all_reduce(step, cost, element_bytes)
            elif isinstance(step, SplitReduceScatter):
                for s in step.slices:
                    for r in s.ranks:
                        if r != s.root and r not in s.zero:
                            pairs[(r, s.root)] += volume(s.region) * element_bytes
            else:
                assert isinstance(step, SplitAllGather), step.kind
                for s in step.slices:
                    for owner, region in s.owners:
                        for r in s.ranks:
                            if r != owner:
                                pairs[(owner, r)] += volume(region) * element_bytes
    for (kind, groups), sizes in packed.items():
        total += max(cost.collective(kind, sizes[g], g, len(groups)) for g in groups)
    sent, received = defaultdict(float), defaultdict(float)
    for (src, dst), nbytes in pairs.items():
        seconds = cost.send(nbytes, src, dst)
        sent[src] += seconds
        received[dst] += seconds
    return total + max([*sent.values(), *received.values(), 0.0])


def _split_all_reduce(step: SplitAllReduce, cost: CostModel, element_bytes: int) -> float:
    """One all-reduce per rank set, a rank's sets one after another."""
    sets: dict[tuple[int, ...], int] = defaultdict(int)
    for s in step.slices:
        sets[tuple(sorted(s.ranks))] += volume(s.region) * element_bytes
    per_rank: dict[int, list[tuple[int, ...]]] = defaultdict(list)
    for ranks in sets:
        for r in ranks:
            per_rank[r].append(ranks)
    rings = -(-len(sets) // max(len(v) for v in per_rank.values()))
    return max(sum(cost.collective("all-reduce", sets[k], k, rings) for k in mine)
               for mine in per_rank.values())  # fmt: skip


def _simulated(strategy: str, cost: CostModel, options: StrategyOptions, prefix: str) -> float:
    tasks, _ = step_tasks(parse_strategy(strategy), CONFIG, cost, seq_len=64, options=options)
    return sum(t.duration for t in tasks if t.id.startswith(prefix))


@pytest.mark.parametrize("strategy", [DP, TP_DP, HETERO])
def test_plain_sync_is_the_runtime_plans(cost: CostModel, strategy: str) -> None:
    items = grad_sync_plan(parse_strategy(strategy), CONFIG, bucket_bytes=BUCKET_BYTES)
    kinds = {k for item in items for k in item.plan.kinds}
    assert kinds == ({"split-all-reduce"} if strategy == HETERO else {"all-reduce"})
    want = sum(_direct([item.plan], cost, 4) for item in items)  # fp32 gradients, one by one
    got = _simulated(strategy, cost, StrategyOptions(dtype="bf16"), "sync")
    assert got == pytest.approx(want, rel=1e-12) and want > 0


@pytest.mark.parametrize(("strategy", "zero"), [(TP_DP, 2), (HETERO, 2), (HETERO, 3)])
def test_sharded_reduces_are_the_runtime_buckets(cost: CostModel, strategy: str, zero: int) -> None:
    """ZeRO-2/3: the buckets the runtime issues (``ShardReduce`` built by ``active._post``;
    ZeRO-3 on HETERO, whose pipelines are not in lock step: in lock step the runtime buckets
    per gather unit, docs/planner.md), each one batch."""
    items = zero1_plan(parse_strategy(strategy), CONFIG)
    layer_of = CONFIG.param_layer if zero == 3 else None
    buckets = shard_buckets(items, bucket_bytes=BUCKET_BYTES, layer_of=layer_of)
    want = sum(_direct(bucket.plans, cost, 4) for bucket in buckets)
    options = StrategyOptions(dtype="bf16", zero=zero)
    assert _simulated(strategy, cost, options, "sync") == pytest.approx(want, rel=1e-12)


def test_zero1_reduces_one_by_one_and_gathers_in_a_batch(cost: CostModel) -> None:
    """ZeRO-1: each reduce started alone; after Adam the gathers in one batch, bf16 (one
    stage per pipeline: one set of ranks)."""
    items = zero1_plan(parse_strategy(TP_DP), CONFIG)
    options = StrategyOptions(dtype="bf16", zero=1)
    reduces = sum(_direct([i.reduce], cost, 4) for i in items.values())
    gathers = _direct([i.gather for i in items.values()], cost, 2)
    assert _simulated(TP_DP, cost, options, "sync") == pytest.approx(reduces, rel=1e-12)
    assert _simulated(TP_DP, cost, options, "gather") == pytest.approx(gathers, rel=1e-12)


def test_shared_pricer_prices_as_a_fresh_one(cost: CostModel) -> None:
    """``PlanPricer.of``: one pricer per cost object across calls (a search's predicts),
    a fresh one past its byte bound; a plan priced after others costs what a fresh pricer
    says, alone and in a batch."""
    from hspmd.cost import comm_plans
    from hspmd.cost.comm_plans import PlanPricer

    items = list(zero1_plan(parse_strategy(HETERO), CONFIG).values())
    shared = PlanPricer.of(cost)
    assert PlanPricer.of(cost) is shared
    assert PlanPricer.of(CostModel.of(load_cluster("hetu-h800-h20"))) is not shared
    shared = PlanPricer.of(cost)
    for item in items:  # every plan priced once through the shared pricer
        shared.plan(item.gather, element_bytes=2)
    for item in items[::-1]:
        fresh = PlanPricer(cost)
        assert shared.plan(item.reduce, element_bytes=4) == fresh.plan(item.reduce, element_bytes=4)
    reduces = [i.reduce for i in items[:5]]
    assert shared.batch(reduces, element_bytes=4) == PlanPricer(cost).batch(
        reduces, element_bytes=4
    )
    shared.kept_bytes = comm_plans.SHARED_BYTES + 1
    assert PlanPricer.of(cost) is not shared
