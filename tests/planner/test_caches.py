"""The planner's caches (issue 12: 4096 ranks) give what the uncached functions give: a
stage's work is keyed by its ranks' kinds and TP link, a gradient sync by its units' kinds
and degrees, and a layers ILP by its inputs."""

from __future__ import annotations

import itertools
from pathlib import Path

from hspmd.cost.cluster import load_cluster
from hspmd.cost.lines import CostModel
from hspmd.cost.stage import stage_work
from hspmd.models import get_config
from hspmd.plan.strategy import StrategyOptions
from hspmd.planner.closed_form import StageCosts, Unit
from hspmd.planner.ilp import layers_per_stage
from hspmd.planner.search import _Search
from tests.planner.conftest import cluster_file


def test_cached_stage_work_and_sync_equal_the_plain_ones(tmp_path: Path) -> None:
    # nodes of 2: ranks 0-3 fast, 4-7 slow; stages within a node, across nodes, across kinds
    cost = CostModel.of(load_cluster(cluster_file(tmp_path / "c.json", fast=4, slow=4)))
    config = get_config("llama-tiny")
    costs = StageCosts(cost, config, 64)
    groups = [(0,), (5,), (0, 1), (2, 3), (4, 5), (1, 2), (3, 4), (4, 3), (0, 0), (0, 1, 2, 3)]
    for ranks, layers, first, last, rc, sp in itertools.product(
        groups, (0, 1, 3), (False, True), (False, True), (False, True), (False, True)
    ):
        got = costs.work(ranks, layers, 2, first, last, rc, sp)
        want = stage_work(
            cost, config, ranks, layers, micro_batch_size=2, seq_len=64, first=first,
            last=last, recompute=rc, sequence_parallel=sp,
        )  # fmt: skip
        assert got == want, ranks
    units = [Unit("fast", (0, 1), 0), Unit("slow", (4, 5), 2), Unit("slow", (6,), 3)]
    for chosen, d, zero1 in itertools.product(
        ([0, 1], [1, 0], [1, 2], [0, 2]), (1, 2, 4), (False, True)
    ):
        picked = [units[i] for i in chosen]
        options = StrategyOptions(zero=int(zero1))
        for layers in ([2, 2], [3, 1]):
            assert costs.sync(picked, layers, d, options) == costs._sync(picked, layers, d, options)


def test_layers_ilp_solved_once_per_input(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    cost = CostModel.of(load_cluster(cluster_file(tmp_path / "c.json", fast=4, slow=4)))
    config = get_config("llama-tiny")
    search = _Search(config, cost, 8, 64, "auto", "bf16", None, None, 1)
    calls = []

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(args)
        return layers_per_stage(*args, **kwargs)

    monkeypatch.setattr("hspmd.planner.search.layers_per_stage", counted)
    options = StrategyOptions()
    a = (Unit("fast", (0, 1), 0), Unit("slow", (4, 5), 2))
    b = (Unit("fast", (2, 3), 1), Unit("slow", (6, 7), 3))  # the same kinds: the same ILP
    first = search._layers(a, 2, 2, 1, options)
    assert search._layers(b, 2, 2, 1, options) == first and len(calls) == 1
    costs = search.costs.stage_lines(a, 1, 2, 2, options)
    assert first == layers_per_stage(config.num_layers, 2, *costs)
    search._layers(a, 3, 2, 1, options)  # another micro-batch count: solved again
    assert len(calls) == 2
