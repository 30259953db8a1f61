"""Growth: spare processes held back at the start join before a ``--grow`` step; the
planner re-plans for the larger set and the states move to it (losses equal the
reference). Then a joined rank dies, and the run goes on.

Multi-process (gloo, 2 ranks + 2 spares, llama-tiny with 2 layers).
"""

from __future__ import annotations

import pytest

from hspmd.plan.strategy import parse_strategy
from tests.elastic.helpers import assert_matches_reference, kinds, run

pytestmark = [pytest.mark.multiproc, pytest.mark.elastic]


def test_spares_join_then_one_of_them_dies() -> None:
    result, events = run("2x2: R0:L0-1; 2x2: R1:L0-1", "3@4:forward", spares=2, grow=((3, 2),))
    assert_matches_reference(result)
    assert kinds(events) == ["grow", "replan", "resumed", "failure", "replan", "resumed"]
    grow = next(e for e in events if e["event"] == "grow")
    assert (grow["ranks"], grow["step"]) == ([2, 3], 3)
    replans = [e for e in events if e["event"] == "replan"]
    assert parse_strategy(replans[0]["strategy"]).global_batch == 8
    assert max(parse_strategy(replans[0]["strategy"]).ranks) + len(replans[0]["idle"]) == 3
    failure = next(e for e in events if e["event"] == "failure")
    assert (failure["rank"], failure["step"]) == (3, 4)
