"""The one planner for heterogeneous ranks, failures and mixed lengths (planner.combined)."""

from __future__ import annotations

import pytest

from hspmd.models.config import get_config
from hspmd.plan.strategy import StrategyOptions, check_strategy
from hspmd.planner.combined import LengthPlanner, StatesSwitch, _dp
from hspmd.planner.elastic import moved_bytes
from hspmd.planner.length_model import Histogram, LengthPlanError, PipeConfig
from hspmd.planner.lengths import plan_lengths
from hspmd.planner.local import local_cost
from hspmd.planner.placement import place

TINY = get_config("llama-tiny")
HIST = Histogram.of([12] * 40 + [30] * 10 + [60] * 3, max_len=64, smallest=16)
SAMPLES = [[60, 30, 12, 12, 12, 12, 30, 12], [30, 30, 12, 12, 12, 12, 12], [12] * 10]


def _check(plans, alive, kinds_of=None) -> None:
    for p in plans:
        check_strategy(p.strategy, TINY, options=StrategyOptions(), seq_len=p.max_len)
        assert set(p.strategy.ranks) <= set(alive)
        assert len(p.strategy.pipelines) >= 2  # two holders of every state
        for pipe in p.strategy.pipelines:
            assert [layer for st in pipe.stages for layer in st.layers] == list(range(4))
            for st in pipe.stages:
                if kinds_of is not None:
                    assert len({kinds_of(r) for r in st.ranks}) == 1


def test_dp_with_one_kind_is_the_length_planners() -> None:
    """One kind, no replica bound: the DP over kinds finds the length planner's optimum."""
    cost = local_cost(4)
    pool = LengthPlanner(TINY, cost).pool("cpu", 64)
    ours = _dp(HIST, {"cpu": pool}, {"cpu": 4}, 256, 1)
    theirs = plan_lengths(HIST, pool, gpus=4, step_tokens=256)
    assert ours[0][0] == pytest.approx(theirs.predicted_s, rel=1e-12)
    assert sorted(str(s.model.config) for _, s, _ in ours[0][1]) == sorted(
        str(p.model.config) for p in theirs.pipes
    )


def test_set_for_slowed_ranks_keeps_kinds_apart_and_two_replicas() -> None:
    cost = local_cost(6, slowdown={4: 3.0, 5: 3.0})
    planner = LengthPlanner(TINY, cost)
    found = planner.plan(HIST, alive=range(6), step_tokens=256, count=3, samples=SAMPLES)
    assert [p.max_len for p in found.plans] == sorted({p.max_len for p in found.plans})
    _check(found.plans, range(6), cost.kind_of)
    switch = StatesSwitch(found.plans, TINY, cost)
    assert all(x >= 0 for row in switch.matrix() for x in row)


def test_replan_after_a_death_uses_exactly_the_alive_ranks_and_moves_less_warm() -> None:
    cost = local_cost(6)
    planner = LengthPlanner(TINY, cost)
    first = planner.plan(HIST, alive=range(6), step_tokens=256, count=2, samples=SAMPLES)
    alive = [0, 1, 2, 4, 5]
    warm = planner.plan(HIST, alive=alive, step_tokens=256, count=2, samples=SAMPLES,
                        previous=first)  # fmt: skip
    cold = planner.plan(HIST, alive=alive, step_tokens=256, count=2, samples=SAMPLES)
    _check(warm.plans, alive)
    assert warm.alive == tuple(alive)
    old, dead = first.plans[-1].strategy, [3]
    assert moved_bytes(old, warm.plans[-1].strategy, TINY, dead=dead) <= moved_bytes(
        old, cold.plans[-1].strategy, TINY, dead=dead
    )


def test_growth_plans_the_new_ranks_in() -> None:
    cost = local_cost(6)  # the memory of this machine's 6th parts (8ths are too small)
    planner = LengthPlanner(TINY, cost)
    small = planner.plan(HIST, alive=range(3), step_tokens=512, count=1, samples=SAMPLES)
    grown = planner.plan(HIST, alive=range(6), step_tokens=512, count=1, samples=SAMPLES,
                         previous=small)  # fmt: skip
    _check(grown.plans, range(6))
    assert set(grown.plans[-1].strategy.ranks) - set(range(3))


def test_too_few_ranks_is_one_line() -> None:
    planner = LengthPlanner(TINY, local_cost(4))
    with pytest.raises(LengthPlanError, match="1 alive ranks cannot hold 2 pipelines"):
        planner.plan(HIST, alive=[2], step_tokens=256)


def test_placement_keeps_homes_and_fits_stages_in_nodes() -> None:
    free = {"a": {0: [0, 1, 2, 3], 1: [4, 5]}}
    homes = [("a", PipeConfig(2, 1), ((4, 5),))]
    got = place([("a", PipeConfig(2, 1)), ("a", PipeConfig(2, 2))], free, homes=homes)
    assert got == [((4, 5),), ((0, 1), (2, 3))]
    assert place([("a", PipeConfig(4, 1)), ("a", PipeConfig(4, 1))], free, homes=()) is None
