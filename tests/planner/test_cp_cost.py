"""Context parallelism in the cost and memory models and the step prediction."""

from __future__ import annotations

import pytest

from hspmd.cost.cluster import load_cluster
from hspmd.cost.lines import CostModel
from hspmd.cost.stage import stage_work
from hspmd.models.config import get_config
from hspmd.plan.strategy import StrategyOptions, parse_strategy
from hspmd.planner.memory import rank_memory
from hspmd.planner.predict import predict

CONFIG = get_config("llama-32b")


@pytest.fixture(scope="module")
def cost() -> CostModel:
    return CostModel.of(load_cluster("h20x32"))


def test_cp_splits_the_layer_work_and_adds_all_to_alls(cost: CostModel) -> None:
    def work(ranks: tuple[int, ...], cp: int) -> tuple[float, float]:
        w = stage_work(cost, CONFIG, ranks, 4, micro_batch_size=1, seq_len=4096,
                       first=False, last=False, cp=cp)  # fmt: skip
        return w.forward_s + w.backward_s, w.tp_comm_s

    one, none = work((0,), 1)
    two, comm = work((0, 1), 2)
    assert none == 0.0 and comm > 0.0  # the all-to-alls
    assert 0.45 * one < two - comm < 0.55 * one  # half the tokens, half the heads per row
    tp2, tp_comm = work((0, 1), 1)
    assert two - comm == pytest.approx(tp2 - tp_comm, rel=0.05)  # the same compute as TP 2


def test_cp_keeps_the_weights_and_splits_the_activations() -> None:
    def memory(tp: int, cp: int):
        return rank_memory(CONFIG, rank=0, tp=tp, num_layers=4, first=False, last=False,
                           in_flight_micro_batches=1, micro_batch_size=1, seq_len=4096,
                           replicas=1, options=StrategyOptions(), cp=cp)  # fmt: skip

    base, cp2 = memory(2, 1), memory(2, 2)
    assert cp2.weights == base.weights  # duplicated over the CP group
    assert cp2.activations == pytest.approx(base.activations / 2)


def test_prediction_runs_a_cp_strategy_with_its_grad_sync(cost: CostModel) -> None:
    strategy = parse_strategy("1x1: R0,8,1,9,2,10,3,11,4,12,5,13,6,14,7,15:L0-59:C2")
    result = predict(strategy, CONFIG, cost, seq_len=4096, options=StrategyOptions(recompute=True))
    assert result.step_time_s > 0
    assert result.fits
    assert any(span.task_id == "cpsync p0s0" for span in result.result.spans)
