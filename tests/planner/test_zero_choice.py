"""The planner's ZeRO choice (hspmd.planner.zero_choice) and uneven shards' pricing."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from hspmd.cost.cluster import load_cluster
from hspmd.cost.lines import CostModel
from hspmd.models.config import get_config
from hspmd.plan.strategy import StrategyOptions, parse_strategy
from hspmd.planner.closed_form import PLAN_HEADROOM, within_headroom
from hspmd.planner.memory import stage_memory, stage_places
from hspmd.planner.predict import predict
from hspmd.planner.search import plan
from hspmd.planner.shard_parts import exchange_factor
from hspmd.planner.zero_choice import memory_shares, most_saved, zero_predictions

from .conftest import cluster_file

H800_H20 = "8x1: R0-7:L0-59; 8x1: R16-23:L0-59"  # one pipeline of each kind (80 / 96 GB)
OPTS = StrategyOptions(zero=1, sequence_parallel=True, dtype="bf16")


@pytest.fixture(scope="module")
def paper() -> tuple[object, CostModel]:
    return get_config("llama-32b"), CostModel.of(load_cluster("hetu-h800-h20"))


def _room_used(strategy, config, cost, options, seq_len):  # type: ignore[no-untyped-def]
    """Per pipeline, the largest fraction of its room for shards that a rank fills."""
    used: dict[int, float] = {}
    places = stage_places(strategy, config.num_layers, "1f1b", shares=options.zero_shares)
    for p, _, stage, place in places:
        cap = min(cost.device_of(r).memory_bytes for r in stage.ranks) * (1 - PLAN_HEADROOM)
        none = stage_memory(config, stage, replace(place, share=0.0), seq_len=seq_len,
                            options=options).peak  # fmt: skip
        peak = stage_memory(config, stage, place, seq_len=seq_len, options=options).peak
        used[p] = max(used.get(p, 0.0), (peak - none) / (cap - none))
    return used


def test_shares_follow_the_room_each_pipeline_has(paper) -> None:  # type: ignore[no-untyped-def]
    config, cost = paper
    strategy = parse_strategy(H800_H20)
    shares = memory_shares(strategy, config, cost, seq_len=16384, options=OPTS)
    assert len(shares) == 2 and shares[0] == 1.0 and shares[1] > 1.2  # the H20s hold more
    even = _room_used(strategy, config, cost, OPTS, 16384)
    fitted = _room_used(strategy, config, cost, replace(OPTS, zero_shares=shares), 16384)
    assert even[0] > 1 > even[1]  # even shards: the H800 pipeline over its room
    assert fitted[0] == pytest.approx(fitted[1], rel=0.01) and fitted[0] < 1
    same_kind = parse_strategy("8x1: R16-23:L0-59; 8x1: R24-31:L0-59")
    assert memory_shares(same_kind, config, cost, seq_len=16384, options=OPTS) == ()
    assert memory_shares(strategy, config, cost, seq_len=16384, options=replace(OPTS, zero=0)) == ()


def test_more_sharding_only_where_memory_binds(paper) -> None:  # type: ignore[no-untyped-def]
    config, cost = paper
    strategy = parse_strategy(H800_H20)
    short = zero_predictions(strategy, config, cost, seq_len=4096, options=OPTS, stages=(1, 2, 3))
    assert [p.options.zero for p in short] == [1] and not short[0].options.recompute
    tight = zero_predictions(strategy, config, cost, seq_len=16384, options=OPTS, stages=(1, 2, 3))
    # ZeRO-1 recomputes on the H800s; ZeRO-2 fits without: it stops there. The runtime's
    # ZeRO-2 Post is no dearer: its reduces go in batches and it gathers the compute dtype in
    # one batch, where ZeRO-1 gathers each fp32 master alone (the plans the simulator prices)
    assert [(p.options.zero, p.options.recompute) for p in tight] == [(1, True), (2, False)]
    assert all(within_headroom(p, cost) for p in tight)
    assert tight[1].step_time_s <= tight[0].step_time_s
    # a bound no plan without recompute could beat: the first prediction alone
    first = tight[0]
    assert 0 < most_saved(first) < first.step_time_s
    beaten = first.step_time_s - most_saved(first)
    cut = zero_predictions(strategy, config, cost, seq_len=16384, options=OPTS, stages=(1, 2, 3),
                           bound=beaten)  # fmt: skip
    assert [p.options.zero for p in cut] == [1]
    only_one = zero_predictions(strategy, config, cost, seq_len=16384, options=OPTS, stages=(1,))
    # ZeRO-1 alone: the memory-proportional shares drop the recompute instead
    assert only_one[-1].options.zero_shares and not only_one[-1].options.recompute


def test_uneven_shares_cost_the_exchange_and_move_adam(paper) -> None:  # type: ignore[no-untyped-def]
    config, cost = paper
    strategy = parse_strategy(H800_H20)
    even = predict(strategy, config, cost, seq_len=4096, options=OPTS)
    more = predict(strategy, config, cost, seq_len=4096, options=replace(OPTS, zero_shares=(3, 1)))
    assert more.step_time_s > even.step_time_s

    def adam(p, s: str) -> float:  # type: ignore[no-untyped-def]
        span = p.result.span(s)
        return span.end - span.start

    # Adam on 3/4 and 1/4 of each shard instead of 1/2 (an affine line: not exactly)
    assert adam(more, "adam p0s0") == pytest.approx(1.5 * adam(even, "adam p0s0"), rel=1e-3)
    assert adam(more, "adam p1s0") == pytest.approx(0.5 * adam(even, "adam p1s0"), rel=1e-3)
    assert exchange_factor((0.75, 0.25)) == 1.5


def test_the_planner_chooses_the_stage_memory_needs(tmp_path: Path) -> None:
    config = get_config("llama-small")
    tight = CostModel.of(load_cluster(cluster_file(tmp_path / "t.json", fast=2, slow=2,
                                                   memory_mb=3700)))  # fmt: skip
    chosen = plan(config, tight, global_batch=8, seq_len=1024, homogeneous=False)
    forced = plan(config, tight, global_batch=8, seq_len=1024, homogeneous=False, zero=1)
    assert chosen.options.zero > 1 and forced.options.zero == 1
    assert chosen.step_time_s < forced.step_time_s  # it recomputes fewer layers
    data = chosen.to_json(tight)
    assert data["zero"] == chosen.options.zero and data["zero_shares"] == []
    roomy = CostModel.of(load_cluster(cluster_file(tmp_path / "r.json", fast=2, slow=2,
                                                   memory_mb=4000)))  # fmt: skip
    assert plan(config, roomy, global_batch=8, seq_len=1024, homogeneous=False).options.zero == 1
    off = plan(config, roomy, global_batch=8, seq_len=1024, homogeneous=False, zero1="off")
    assert off.options.zero == 0


def test_train_and_explain_take_the_chosen_stage(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from hspmd.cli import main
    from hspmd.train.api import train_config
    from hspmd.train.planfile import config_from_plan, read_plan

    cluster = cluster_file(tmp_path / "c.json", fast=2, slow=2)
    out = tmp_path / "s.json"
    argv = ["plan", "--model", "llama-tiny", "--config", '{"num_layers": 2}', "--cluster",
            str(cluster), "--global-batch", "4", "--seq-len", "32", "--dtype", "fp32",
            "--zero", "2", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    data = json.loads(out.read_text())
    assert data["options"]["zero"] == data["zero"] == 2 and data["zero_shares"] == []
    config = config_from_plan(read_plan(str(out)), train_config(model_kwargs={"num_layers": 2}))
    assert config.zero == 2 and str(config.strategy) == data["strategy"]
    capsys.readouterr()
    argv = ["explain", "--model", "llama-tiny", "--config", '{"num_layers": 2}', "--plan", str(out)]
    assert main(argv) == 0
    assert "zero2" in capsys.readouterr().out
