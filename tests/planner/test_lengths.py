"""The length-aware planner: histogram, DP, dispatch, choice per step (no processes)."""

from __future__ import annotations

import json

import pytest

from hspmd.cost.cluster import load_cluster
from hspmd.cost.lines import CostModel
from hspmd.models.config import get_config
from hspmd.plan.dispatch import DispatchError
from hspmd.plan.strategy import StrategyOptions, parse_strategy
from hspmd.planner.length_model import _quadratic
from hspmd.planner.lengths import (
    Histogram,
    LengthPlanError,
    LengthStrategy,
    PipeConfig,
    PipeModel,
    PipeSpec,
    choose,
    dispatch,
    fixed_dispatcher,
    load_plans,
    plan_lengths,
    plan_strategies,
    plans_json,
    switch_matrix,
)

# a "short" configuration: cheap per token, fits rows of 1024; a "long" one fits 4096
SHORT = PipeModel(PipeConfig(1, 1), o=0.0, a=1.0, q=0.0, send_o=0.0, send_a=0.0, fit_len=1024)
LONG = PipeModel(PipeConfig(2, 1), o=0.0, a=2.4, q=0.0, send_o=0.0, send_a=0.0, fit_len=4096)


def test_histogram_bins_and_truncates() -> None:
    h = Histogram.of([10, 600, 1024, 1025, 9000], max_len=4096, smallest=512)
    assert h.edges == (512, 1024, 2048, 4096)
    assert h.counts == (1, 2, 1, 1)
    assert h.tokens == (10, 1624, 1025, 4096)  # 9000 counts as 4096
    assert h.upto(1).edges == (512, 1024)
    with pytest.raises(LengthPlanError, match="no documents"):
        Histogram.of([], max_len=64)


def test_quadratic_fit_is_exact() -> None:
    assert _quadratic(lambda n: 3 + 2 * n + 0.5 * n * n) == pytest.approx((3, 2, 0.5))


def test_pipeline_seconds_adds_fill_and_drain() -> None:
    m = PipeModel(PipeConfig(1, 3), o=1.0, a=0.5, q=0.25, send_o=0.1, send_a=0.0, fit_len=8)
    rows = [(2, 4), (4, 8)]  # row times 1 + 1 + 1 = 3 and 1 + 2 + 2 = 5
    assert m.seconds(rows) == pytest.approx(3 + 5 + 2 * (5 + 2 * 0.1))


def test_dp_gives_long_documents_their_own_pipeline() -> None:
    # 90% of tokens in short documents, a few 3000-token ones that only LONG holds
    h = Histogram.of([500] * 90 + [3000] * 2, max_len=4096, smallest=1024)
    plan = plan_lengths(h, [SHORT, LONG], gpus=4, step_tokens=h.tokens[0] + h.tokens[2])
    kinds = sorted((p.model.config.tp, p.row_len) for p in plan.pipes)
    assert kinds == [(1, 1024), (1, 1024), (2, 4096)]  # heterogeneous: 2 short + 1 long
    # two short pipelines take the short documents, the long one the long ones
    assert plan.predicted_s == pytest.approx(max(45000 / 2 * 1.0, 6000 * 2.4))
    homogeneous = plan_lengths(h, [LONG], gpus=4, step_tokens=51000)
    assert plan.predicted_s < homogeneous.predicted_s


def test_dp_refuses_what_no_pipeline_holds() -> None:
    h = Histogram.of([5000], max_len=8192, smallest=1024)
    with pytest.raises(LengthPlanError, match="fits a row of 8192"):
        plan_lengths(h, [SHORT, LONG], gpus=4, step_tokens=5000)


def _plan(*specs: PipeSpec, max_len: int = 4096) -> LengthStrategy:
    return LengthStrategy(max_len, specs, tuple((1, s.row_len) for s in specs), 0.0)


def test_dispatch_holds_caps_and_balances() -> None:
    plan = _plan(PipeSpec(SHORT, 1024), PipeSpec(SHORT, 1024), PipeSpec(LONG, 4096))
    lengths = [3000, 900, 800, 700, 600, 500, 400, 300, 200, 100]
    pipes = dispatch(lengths, plan)
    placed = sorted(i for p in pipes for row in p.docs for i in row)
    assert placed == list(range(len(lengths)))
    assert 0 in [i for row in pipes[2].docs for i in row]  # only LONG holds 3000
    for p in pipes:
        assert all(r[0] <= p.spec.row_len for r in p.rows)
    # the long pipeline (3000 x 2.4 s) is the slowest: it takes nothing more; the short
    # pipelines share the rest within one document
    assert pipes[2].docs == [[0]]
    assert abs(pipes[0].seconds() - pipes[1].seconds()) <= 900
    with pytest.raises(LengthPlanError, match="longer than every pipeline"):
        dispatch([5000], plan)


def test_choose_weighs_the_switch() -> None:
    fast = _plan(PipeSpec(SHORT, 1024), PipeSpec(SHORT, 1024), max_len=1024)
    slow = _plan(PipeSpec(LONG, 4096), max_len=4096)
    step = [500, 500, 400]
    assert choose(step, [fast, slow], current=None, switch=lambda a, b: 0.0)[0] == 0
    k, t, s = choose(step, [fast, slow], current=1, switch=lambda a, b: 1e9)
    assert (k, s) == (1, 0.0) and t == pytest.approx(1400 * 2.4)
    assert choose([3000], [fast, slow], current=0, switch=lambda a, b: 1e9)[0] == 1


def test_fixed_dispatcher_fills_micro_batches_and_every_pipeline() -> None:
    plan = _plan(PipeSpec(SHORT, 16, 2), PipeSpec(LONG, 48, 1), max_len=48)
    run = fixed_dispatcher(plan)
    a = run([40, 10, 9, 8, 3], slots=[(2, 1), (1, 1)], max_len=48)
    assert a.slots[0][0] == 1  # 40 only fits the long pipeline
    assert all(n for pipe in a.lengths for n in pipe)  # enough documents: none empty
    for (p, _m, _), n in zip(a.slots, a.doc_lengths, strict=True):
        assert p == 1 or n <= 16
    # two documents for three micro-batches: one stays empty (the runtime skips it), but
    # each pipeline gets one (the last document goes to the pipeline without any)
    b = run([40, 10], slots=[(2, 1), (1, 1)], max_len=48)
    assert b.lengths == ((10, 0), (40,))
    with pytest.raises(DispatchError, match="without one"):
        run([40], slots=[(2, 1), (1, 1)], max_len=48)


def test_plan_strategies_on_the_paper_cluster_round_trip() -> None:
    config = get_config("llama-32b")
    cost = CostModel.of(load_cluster("h20x32"))
    lengths = [300] * 500 + [2000] * 50 + [12000] * 3
    hist = Histogram.of(lengths, max_len=16384, smallest=1024)
    options = StrategyOptions(sequence_parallel=True, dtype="bf16", zero=1)
    plans = plan_strategies(config, cost, hist, step_tokens=200_000, options=[options])
    assert [p.max_len for p in plans] == sorted({p.max_len for p in plans})
    assert plans[-1].max_len == 16384 and all(p.gpus <= 32 for p in plans)
    switch = switch_matrix(plans, config, cost)
    assert all(switch[i][i] == 0 for i in range(len(plans)))
    data = plans_json(plans, hist, model="llama-32b", cluster="h20x32", step_tokens=200_000,
                      switch=switch)  # fmt: skip
    back, back_switch = load_plans(json.loads(json.dumps(data)), "plans.json")
    assert [(p.max_len, str(p.strategy)) for p in back] == [
        (p.max_len, str(p.strategy)) for p in plans
    ]
    assert back_switch == switch
    step = [300] * 300 + [2000] * 20 + [12000]
    assert choose(step, back, current=None, switch=lambda a, b: 0.0) == choose(
        step, plans, current=None, switch=lambda a, b: 0.0
    )
    assert parse_strategy(str(plans[-1].strategy)).ranks[-1] < 32
    with pytest.raises(LengthPlanError, match="version 1"):
        load_plans({**data, "version": 2}, "plans.json")
