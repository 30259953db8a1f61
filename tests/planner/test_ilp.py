"""The two ILPs against answers worked out by hand."""

from __future__ import annotations

import pytest

from hspmd.planner.ilp import IlpError, layers_per_stage, micro_batches_per_pipeline

BIG = 1e18


def test_layers_follow_speed_when_memory_is_plenty() -> None:
    # stage 1 is 3x faster: 8 layers split 2 + 6 gives stage times 6 and 6 (the optimum:
    # 3 + 5 gives 9, 1 + 7 gives 7 on stage 1 but 3 on stage 0 ... max 7 > 6).
    got = layers_per_stage(8, 4, [3.0, 1.0], [0.0, 0.0], [1.0, 1.0], [0.0, 0.0], [BIG, BIG])
    assert got == [2, 6]


def test_layers_respect_the_memory_cap() -> None:
    # stage 1 can hold only 4 layers (4 * 10 + 5 <= 45): the rest go to the slow stage
    got = layers_per_stage(8, 4, [3.0, 1.0], [0.0, 0.0], [10.0, 10.0], [5.0, 5.0], [BIG, 45.0])
    assert got == [4, 4]


def test_layers_infeasible_gives_none() -> None:
    assert layers_per_stage(8, 4, [1.0, 1.0], [0, 0], [10.0, 10.0], [0, 0], [30.0, 30.0]) is None
    assert layers_per_stage(1, 4, [1.0, 1.0], [0, 0], [0, 0], [0, 0], [BIG, BIG]) is None
    with pytest.raises(IlpError, match="different lengths"):
        layers_per_stage(4, 1, [1.0], [0.0, 1.0], [0.0], [0.0], [1.0])


def test_micro_batches_balance_pipeline_times() -> None:
    # pipeline 1 is twice as slow per micro-batch: 12 micro-batches split 8 + 4 gives
    # (8-1)*1 + 3 = 10 and (4-1)*2 + 6 = 12; 9 + 3 gives 11 and 10 -> max 11, the optimum.
    assert micro_batches_per_pipeline(12, 1, [1.0, 2.0], [3.0, 6.0]) == [9, 3]
    assert micro_batches_per_pipeline(8, 2, [1.0, 1.0], [3.0, 3.0]) == [2, 2]
    assert micro_batches_per_pipeline(7, 2, [1.0], [1.0]) is None  # 7 does not split in 2s
    assert micro_batches_per_pipeline(2, 1, [1.0] * 3, [1.0] * 3) is None  # one each at least
