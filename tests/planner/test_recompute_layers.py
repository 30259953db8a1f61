"""Recomputing only the first k layers of a stage (``--recompute-layers``) in the cost and
memory models: between no recompute and full recompute, linear in k."""

from __future__ import annotations

import pytest

from hspmd.cost.cluster import load_cluster
from hspmd.cost.lines import CostModel
from hspmd.cost.stage import stage_work
from hspmd.errors import StrategyError
from hspmd.models.config import get_config
from hspmd.plan.strategy import StrategyOptions
from hspmd.planner.memory import rank_memory

CONFIG = get_config("llama-32b")
LAYERS = 8


def test_partial_recompute_work_is_linear_in_the_layers() -> None:
    cost = CostModel.of(load_cluster("h20x32"))

    def work(recompute: bool, k: int) -> float:
        w = stage_work(cost, CONFIG, (0, 1), LAYERS, micro_batch_size=1, seq_len=4096,
                       first=True, last=False, recompute=recompute, recompute_layers=k)  # fmt: skip
        return w.forward_s + w.backward_s

    none, full = work(False, 0), work(True, 0)
    assert work(False, 3) == none  # recompute_layers counts only with recompute
    assert work(True, LAYERS) == pytest.approx(full)
    assert work(True, 2) == pytest.approx(none + 2 / LAYERS * (full - none))


def test_partial_recompute_memory_keeps_the_other_layers() -> None:
    def activations(options: StrategyOptions) -> float:
        return rank_memory(CONFIG, rank=0, tp=8, num_layers=LAYERS, first=False, last=False,
                           in_flight_micro_batches=2, micro_batch_size=1, seq_len=8192,
                           replicas=1, options=options).activations  # fmt: skip

    none = activations(StrategyOptions())
    full = activations(StrategyOptions(recompute=True))
    half = activations(StrategyOptions(recompute=True, recompute_layers=LAYERS // 2))
    assert full < half < none
    # half the layers keep everything, half their input only, and one layer's full set
    # for the one recomputing (full recompute counts it once too)
    one_layer = none / (2 * LAYERS)  # one layer's set for one of the 2 micro-batches
    assert half == pytest.approx((none + full - one_layer) / 2 + one_layer, rel=1e-9)
    assert StrategyOptions(recompute=True, recompute_layers=3).recomputed(2) == 2
    with pytest.raises(StrategyError, match="recompute_layers=-1"):
        StrategyOptions(recompute_layers=-1)
