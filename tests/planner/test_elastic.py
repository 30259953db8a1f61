"""Elastic re-planning: alive ranks only, two replicas, ZeRO-1 off, warm start, errors."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from hspmd.cost.cluster import ClusterError, load_cluster
from hspmd.cost.lines import CostModel
from hspmd.models.config import get_config
from hspmd.plan.strategy import check_strategy, parse_strategy
from hspmd.planner.elastic import (
    ElasticPlan,
    ElasticPlanError,
    lost_layers,
    moved_bytes,
    repair,
    replan,
    switch_estimate,
)
from hspmd.planner.local import local_cost
from hspmd.planner.memory import layer_holders
from hspmd.planner.search import plan
from hspmd.switch.cost import switch_cost
from tests.planner.conftest import cluster_file

SMALL = get_config("llama-small")


def _cost(tmp_path: Path, *, fast: int = 8, slow: int = 0, per_node: int = 4) -> CostModel:
    path = cluster_file(tmp_path / "c.json", fast=fast, slow=slow, per_node=per_node)
    return CostModel.of(load_cluster(path), dtype="fp32")


def _replan(cost: CostModel, alive: object, current: object = None, **kw: object) -> ElasticPlan:
    return replan(
        SMALL, cost, alive=alive, current=current, global_batch=16, seq_len=256,  # type: ignore[arg-type]
        dtype="fp32", **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def _check_elastic(p: ElasticPlan, alive: set[int], replicas: int = 2) -> None:
    assert set(p.strategy.ranks) <= alive
    assert len(p.strategy.pipelines) >= replicas
    assert min(layer_holders(p.strategy, SMALL.num_layers)) >= replicas
    assert not p.options.zero1
    assert p.prediction.fits
    check_strategy(p.strategy, SMALL, global_batch=16, options=p.options, seq_len=256)


def test_after_a_failure_the_plan_uses_alive_ranks_only(tmp_path: Path) -> None:
    cost = _cost(tmp_path)
    first = _replan(cost, range(8))
    _check_elastic(first, set(range(8)))
    dead = first.strategy.pipelines[0].stages[0].ranks[0]
    alive = set(range(8)) - {dead}
    after = _replan(cost, sorted(alive), first.strategy)
    _check_elastic(after, alive)
    assert after.moved_bytes is not None and after.moved_bytes > 0
    assert after.switch is not None and after.switch.seconds > 0
    assert after.plan_seconds < 10.0  # a guard against blow-ups, not a target
    assert set(after.to_json(cost)) >= {"strategy", "step_time_s", "plan_seconds", "moved_bytes"}


def test_min_replicas_three(tmp_path: Path) -> None:
    p = _replan(_cost(tmp_path), range(6), min_replicas=3)
    _check_elastic(p, set(range(6)), replicas=3)


def test_no_change_keeps_the_current_plan_and_moves_nothing(tmp_path: Path) -> None:
    cost = _cost(tmp_path)
    first = _replan(cost, range(8))
    again = _replan(cost, range(8), first.strategy)
    assert again.strategy == first.strategy
    assert again.moved_bytes == 0
    assert again.source == "repaired"


def test_among_close_plans_the_fewest_moved_bytes_win(tmp_path: Path) -> None:
    cost = _cost(tmp_path)
    first = _replan(cost, range(8))
    alive = list(range(7))
    tight = _replan(cost, alive, first.strategy, margin=0.0)
    loose = _replan(cost, alive, first.strategy, margin=10.0)
    assert loose.moved_bytes is not None and tight.moved_bytes is not None
    assert loose.moved_bytes <= tight.moved_bytes
    assert tight.step_time_s <= loose.step_time_s
    assert tight.step_time_s == pytest.approx(tight.fastest_step_time_s)


def test_growth_uses_the_new_ranks(tmp_path: Path) -> None:
    cost = _cost(tmp_path)  # at 256 tokens 4 ranks are as fast as 8: take 1024
    small = replan(SMALL, cost, alive=range(4), current=None, global_batch=32, seq_len=1024,
                   dtype="fp32")  # fmt: skip
    grown = replan(SMALL, cost, alive=range(8), current=small.strategy, global_batch=32,
                   seq_len=1024, dtype="fp32")  # fmt: skip
    assert len(grown.strategy.pipelines) >= 2 and not grown.options.zero1
    assert len(grown.strategy.ranks) > 4
    assert grown.step_time_s < small.step_time_s


def test_too_few_ranks_is_a_typed_error_naming_the_count(tmp_path: Path) -> None:
    cost = _cost(tmp_path)
    current = parse_strategy("8x1: R0:L0-7; 8x1: R1:L0-7")
    with pytest.raises(ElasticPlanError, match=r"1 alive ranks \(dead or gone: R1\): 2 data"):
        _replan(cost, [0], current)
    with pytest.raises(ElasticPlanError, match="rank 9"):
        _replan(cost, [0, 9])
    with pytest.raises(ElasticPlanError, match="global_batch=1 cannot feed 2"):
        replan(SMALL, cost, alive=range(4), current=None, global_batch=1, seq_len=256)


def test_nothing_fits_says_what_would(tmp_path: Path) -> None:
    path = cluster_file(tmp_path / "c.json", fast=4, slow=0, per_node=2, memory_mb=40000)
    cost = CostModel.of(load_cluster(path))
    with pytest.raises(ElasticPlanError, match=r"4 alive ranks: 2 data-parallel .* 2 x \d+ ranks"):
        replan(get_config("llama-32b"), cost, alive=range(4), current=None, global_batch=8,
               seq_len=1024)  # fmt: skip


def test_repair_splits_a_stage_that_lost_a_rank(tmp_path: Path) -> None:
    cost = CostModel.of(load_cluster("h20x32"))
    c1 = parse_strategy(
        "16x2: R0-3:L0-14 R4-7:L15-29 R8-11:L30-44 R12-15:L45-59; "
        "16x2: R16-19:L0-14 R20-23:L15-29 R24-27:L30-44 R28-31:L45-59"
    )
    layout = repair(c1, range(31), cost, get_config("llama-32b"))
    assert layout is not None
    assert [[u.ranks for u in p] for p in layout][1][-2:] == [(28, 29), (30,)]
    gone = repair(c1, [r for r in range(32) if not 4 <= r < 8], cost, get_config("llama-32b"))
    assert gone is not None and [len(p) for p in gone] == [3, 4]


def test_lost_layers_need_every_shard() -> None:
    s = parse_strategy("1x1: R0-1:L0-1 R2-3:L2-3; 1x1: R4-5:L0-1 R6-7:L2-3")
    assert lost_layers(s, [1, 2, 3, 4, 6, 7], 4) == ()  # R0 and R5: other shards
    assert lost_layers(s, [1, 2, 3, 5, 6, 7], 4) == (0, 1)  # R0 and R4: shard 0 of L0-1


def test_switch_estimate_matches_the_switch_cost_model() -> None:
    cluster = load_cluster("h20x32")
    old = "1x1: R0-1:L0-1 R2-3:L2-3; 1x1: R4-5:L0-1 R6-7:L2-3"
    new = "1x1: R1:L0-1 R2-3:L2-3; 1x1: R4-5:L0-1 R6-7:L2-3"
    ours = switch_estimate(
        parse_strategy(old), parse_strategy(new), get_config("llama-tiny"), CostModel.of(cluster)
    )
    theirs = switch_cost(model="llama-tiny", source=old, target=new, cluster=cluster,
                         algo="fused", failed=[0])  # fmt: skip
    assert ours.moved_bytes == pytest.approx(theirs.estimate.total()) and ours.moved_bytes > 0
    assert moved_bytes(parse_strategy(old), parse_strategy(new), get_config("llama-tiny")) == (
        pytest.approx(ours.moved_bytes)
    )


def test_plan_restricted_to_ranks_and_pipelines(tmp_path: Path) -> None:
    cost = _cost(tmp_path)
    p = plan(SMALL, cost, global_batch=16, seq_len=256, zero1="off", dtype="fp32",
             homogeneous=False, ranks=[0, 1, 2, 4, 5], min_pipelines=2)  # fmt: skip
    assert set(p.strategy.ranks) <= {0, 1, 2, 4, 5}
    assert len(p.strategy.pipelines) >= 2
    assert set(p.unused_ranks) <= {0, 1, 2, 4, 5}
    assert p.alternatives[0] == p.prediction


def test_random_alive_sets_give_valid_plans_or_the_typed_error(tmp_path: Path) -> None:
    # fast ranks 0-3 (one node), 1.3x slower ranks 4-7 (another), llama-tiny; a chain of
    # random failures and returns, each plan warm-started from the one before
    path = cluster_file(tmp_path / "c.json", fast=4, slow=4, per_node=4, slowdown=1.3)
    cost = CostModel.of(load_cluster(path), dtype="fp32")
    tiny = get_config("llama-tiny")
    rng = random.Random(0)
    current = None
    for _ in range(12):
        alive = sorted(rng.sample(range(8), rng.randint(1, 8)))
        try:
            p = replan(tiny, cost, alive=alive, current=current, global_batch=8, seq_len=32,
                       dtype="fp32")  # fmt: skip
        except ElasticPlanError as error:
            assert len(alive) < 2 and f"{len(alive)} alive ranks" in str(error)
            continue
        assert set(p.strategy.ranks) <= set(alive) and len(p.strategy.pipelines) >= 2
        assert min(layer_holders(p.strategy, tiny.num_layers)) >= 2
        check_strategy(p.strategy, tiny, global_batch=8, options=p.options, seq_len=32)
        assert (p.switch is None) == (current is None or bool(p.lost_layers))
        current = p.strategy


def test_one_rank_of_each_kind_makes_two_pipelines(tmp_path: Path) -> None:
    path = cluster_file(tmp_path / "c.json", fast=2, slow=2, per_node=2, slowdown=1.3)
    cost = CostModel.of(load_cluster(path), dtype="fp32")
    p = replan(get_config("llama-tiny"), cost, alive=[1, 2], current=None, global_batch=8,
               seq_len=32, dtype="fp32")  # fmt: skip
    assert sorted(p.strategy.ranks) == [1, 2] and len(p.strategy.pipelines) == 2


def test_local_cost_plans_local_processes() -> None:
    cost = local_cost(5)
    assert cost.num_ranks == 5 and cost.kind_of(4) == "cpu"
    p = replan(get_config("llama-tiny"), cost, alive=[0, 1, 3, 4], current=None, global_batch=8,
               seq_len=32, dtype="fp32")  # fmt: skip
    assert set(p.strategy.ranks) <= {0, 1, 3, 4} and len(p.strategy.pipelines) >= 2
    assert p.plan_seconds < 10.0
    with pytest.raises(ClusterError, match="ranks_per_node"):
        local_cost(5, ranks_per_node=2)
