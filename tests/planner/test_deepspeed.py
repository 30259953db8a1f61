"""DeepSpeed's plans in the simulator (hspmd.planner.deepspeed): ZeRO-3 over DP x SP,
Ulysses all-to-alls, activation checkpointing."""

from __future__ import annotations

import pytest

from hspmd.cost.cluster import load_cluster
from hspmd.cost.lines import CostModel
from hspmd.cost.stage import stage_params, stage_work
from hspmd.models.config import get_config
from hspmd.planner.deepspeed import (
    DeepSpeedError,
    DeepSpeedPlan,
    deepspeed_strategy,
    parse_deepspeed,
    predict_deepspeed,
)

CONFIG = get_config("llama-32b")


@pytest.fixture(scope="module")
def h20() -> CostModel:
    return CostModel.of(load_cluster("h20x32"))


def test_the_papers_notation() -> None:
    assert parse_deepspeed("DP4SP8AC, bs1") == DeepSpeedPlan(4, 8, 1, True)
    assert parse_deepspeed("DP8, bs2") == DeepSpeedPlan(8, 1, 2, False)
    for bad in ("DP0SP2AC, bs1", "TP4PP4, bs1", "DP8SP2AC"):
        with pytest.raises(DeepSpeedError, match="write it as DP<d>SP<s>"):
            parse_deepspeed(bad)


def test_groups_of_consecutive_ranks_and_a_batch_rounded_up() -> None:
    s = deepspeed_strategy(parse_deepspeed("DP24SP2AC, bs1"), 60, global_batch=64,
                           ranks=range(48))  # fmt: skip
    assert len(s.pipelines) == 24 and s.global_batch == 72  # ceil(64 / 24) = 3 each
    assert str(s) == "24*(3x1: R0-1:L0-59:C2)"  # AC: the options' recompute
    s = deepspeed_strategy(parse_deepspeed("DP12SP2AC, bs4"), 60, global_batch=64,
                           ranks=range(24))  # fmt: skip
    assert {(p.num_micro_batches, p.micro_batch_size) for p in s.pipelines} == {
        (2, 3)
    }  # 6 samples: bs 3
    with pytest.raises(DeepSpeedError, match="needs 32 ranks; the cluster has 24"):
        deepspeed_strategy(parse_deepspeed("DP16SP2, bs1"), 60, global_batch=64, ranks=range(24))


def test_step_is_compute_plus_what_the_gathers_expose(h20: CostModel) -> None:
    plan = parse_deepspeed("DP16SP2AC, bs2")
    p = predict_deepspeed(plan, CONFIG, h20, global_batch=64, seq_len=4096)
    work = stage_work(h20, CONFIG, (0, 1), 60, micro_batch_size=2, seq_len=4096, first=True,
                      last=True, recompute=True, cp=2)  # fmt: skip
    plain = stage_work(h20, CONFIG, (0, 1), 60, micro_batch_size=2, seq_len=4096, first=True,
                       last=True, cp=2)  # fmt: skip
    # AC: the layers' forward again in backward (not the embedding's, the head's)
    again = work.backward_s - plain.backward_s
    assert 0.95 * plain.forward_s < again < plain.forward_s
    assert work.tp_comm_s > 0  # Ulysses: the all-to-alls of q, k, v and the output
    compute = 2 * (work.forward_s + work.backward_s)  # two micro-batches of 2
    assert p.step_time_s > compute
    # links 1000x faster: the gathers hide behind compute, all but the first ones
    fast = CostModel.of(_faster(load_cluster("h20x32"), 1000))
    q = predict_deepspeed(plan, CONFIG, fast, global_batch=64, seq_len=4096)
    w = q.work[(0, 0)]
    bare = 2 * (w.forward_s + w.backward_s)
    adam = q.result.span("adam").end - q.result.span("adam").start
    assert bare < q.step_time_s < bare * 1.01 + adam
    # ZeRO-3 over all 32 ranks: every rank holds 1/32 of the masters and Adam states
    params = stage_params(CONFIG, 60, 1, first=True, last=True)
    assert p.memory[31].optimizer == pytest.approx(12 * params / 32)
    assert p.fits and p.options.zero == 3 and p.options.recompute


def test_long_rows_need_more_sp(h20: CostModel) -> None:
    two, eight = parse_deepspeed("DP16SP2AC, bs1"), parse_deepspeed("DP4SP8AC, bs1")
    p = predict_deepspeed(two, CONFIG, h20, global_batch=16, seq_len=32768)
    q = predict_deepspeed(eight, CONFIG, h20, global_batch=16, seq_len=32768)
    assert p.memory[0].activations == pytest.approx(4 * q.memory[0].activations, rel=0.05)
    assert p.memory[0].logits == 4 * q.memory[0].logits  # the head on the sequence shard
    huge = predict_deepspeed(two, CONFIG, h20, global_batch=16, seq_len=131072)
    assert not huge.fits and predict_deepspeed(eight, CONFIG, h20, global_batch=16,
                                               seq_len=131072).fits  # fmt: skip
    with pytest.raises(DeepSpeedError, match="must divide seq_len 1001"):
        predict_deepspeed(parse_deepspeed("DP4SP8AC, bs1"), CONFIG, h20, global_batch=16,
                          seq_len=1001)  # fmt: skip


def _faster(cluster, factor: float):  # type: ignore[no-untyped-def]
    """``cluster`` with every link ``factor`` times faster."""
    import dataclasses

    def link(x):  # type: ignore[no-untyped-def]
        return dataclasses.replace(x, bandwidth=x.bandwidth * factor)

    kinds = tuple(dataclasses.replace(k, intra_link=link(k.intra_link)) for k in cluster.kinds)
    return dataclasses.replace(cluster, kinds=kinds, inter_link=link(cluster.inter_link))


def test_the_best_plan_is_the_fastest_that_fits(h20: CostModel) -> None:
    from hspmd.planner.closed_form import within_headroom
    from hspmd.planner.deepspeed import best_deepspeed

    found = best_deepspeed(CONFIG, h20, global_batch=8, seq_len=16384, sizes=(1,))
    assert found is not None
    plan, best = found
    assert within_headroom(best, h20) and plan.num_ranks == 32
    for sp in (1, 2, 4, 8):
        for ac in (True, False):
            other = predict_deepspeed(DeepSpeedPlan(32 // sp, sp, 1, ac), CONFIG, h20,
                                      global_batch=8, seq_len=16384)  # fmt: skip
            assert not within_headroom(other, h20) or best.step_time_s <= other.step_time_s
