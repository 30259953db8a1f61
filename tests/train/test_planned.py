"""A plan from `hspmd plan` trains on local processes and equals the single-device run."""

from __future__ import annotations

from pathlib import Path

import pytest

from hspmd.cost.cluster import load_cluster
from hspmd.cost.lines import CostModel
from hspmd.models.config import get_config
from hspmd.planner.search import plan
from hspmd.train.api import train_config
from hspmd.train.reference import run_reference
from hspmd.train.trainer import train_many
from tests.planner.conftest import cluster_file
from tests.train.test_strategy_matrix import assert_equal_to_reference


@pytest.mark.multiproc
def test_planned_strategies_equal_the_reference(tmp_path: Path) -> None:
    configs = []
    for name, fast, slow, slowdown, memory_mb in (
        ("mixed", 2, 2, 3.0, 80000),
        ("idle", 2, 2, 50.0, 80000),
        ("even", 4, 0, 1.0, 80000),
        # the 3 GiB overhead and a few hundred KB: the first stage of four (four
        # micro-batches in flight) must recompute its layer, the others need not
        ("tight", 4, 0, 1.0, 3392.47),
    ):
        path = cluster_file(tmp_path / f"{name}.json", fast=fast, slow=slow, slowdown=slowdown,
                            memory_mb=memory_mb)  # fmt: skip
        cost = CostModel.of(load_cluster(path), dtype="fp32")
        chosen = plan(get_config("llama-tiny"), cost, global_batch=8, seq_len=32, dtype="fp32",
                      homogeneous=False)  # fmt: skip
        o = chosen.options
        configs.append(train_config(
            strategy=chosen.strategy, global_batch=8, seq_len=32, steps=3,
            zero=o.zero, sequence_parallel=o.sequence_parallel, recompute=o.recompute,
        ))  # fmt: skip
    strategies = [str(c.strategy) for c in configs]
    assert len(set(strategies)) > 1, strategies  # the clusters get different plans
    assert strategies[-1] == "2x4: R0:L0-0:RC1 R1:L1-1:RC0 R2:L2-2:RC0 R3:L3-3:RC0"  # per stage
    reference = run_reference(train_config(global_batch=8, seq_len=32, steps=3))
    for result in train_many(configs):
        assert_equal_to_reference(result, reference)
