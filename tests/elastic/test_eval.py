"""Held-out evaluations in elastic runs: a rank killed during one changes no number.

A PP pipeline beside a TP pipeline, an evaluation after every second step on the last
tenth of the corpus. Rank 1 is killed as the evaluation after step 2 begins: no rank
finishes it (its all-reduce has no part from rank 1), so the survivors re-plan and run it
again under the new strategy, before step 3; the evaluation after step 4 runs under the
new strategy too. Both equal the reference's, each reported once.
"""

from __future__ import annotations

import pytest

from hspmd.train.api import revise
from hspmd.train.config import EvalConfig
from hspmd.train.reference import run_reference
from tests.elastic.helpers import BASE, kinds, run

pytestmark = [pytest.mark.multiproc, pytest.mark.elastic]

HETERO = "2x2: R0:L0-0 R1:L1-1; 2x2: R2-3:L0-1"
EVALUATION = EvalConfig(every=2, batches=2, split=0.1)


def test_an_evaluation_interrupted_by_a_kill_is_redone_on_the_new_plan() -> None:
    result, events = run(HETERO, "1@2:eval", evaluation=EVALUATION)
    reference = run_reference(revise(BASE, elastic=False, evaluation=EVALUATION))
    assert kinds(events) == ["failure", "replan", "resumed"]
    assert next(e for e in events if e["event"] == "failure")["phase"] == "eval"
    assert [e.step for e in result.evaluations] == [2, 4]
    for got, want in zip(result.evaluations, reference.evaluations, strict=True):
        assert got.loss == pytest.approx(want.loss, rel=1e-5), got.step
    for got, want in zip(result.records, reference.records, strict=True):
        assert got.loss == pytest.approx(want.loss, rel=1e-5), got.step
