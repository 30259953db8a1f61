"""Elastic training with sequence parallelism: the norm weights' in-stage gradient sums run
inside backward's hooks (``hspmd.train.overlap``), so a rank lost in backward must not
leave its TP peer waiting there."""

from __future__ import annotations

import pytest

from tests.elastic.helpers import assert_matches_reference, kinds, run

pytestmark = [pytest.mark.multiproc, pytest.mark.elastic]

TP_PIPELINES = "2x2: R0-1:L0-1; 2x2: R2-3:L0-1"  # two TP-2 pipelines: SP norms in each


def test_kill_a_tp_rank_in_backward_under_sequence_parallelism() -> None:
    result, events = run(TP_PIPELINES, "3@2:backward", sequence_parallel=True)
    assert_matches_reference(result)
    assert kinds(events) == ["failure", "replan", "resumed"]
    failure = next(e for e in events if e["event"] == "failure")
    assert (failure["rank"], failure["phase"], failure["step"]) == (3, "backward", 2)
