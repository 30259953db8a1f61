"""Elastic runs of packed variable-length steps (issue 39 item 2): per-step strategy choice
from a length-aware set, real kills (twice in a row, rank 0 during the recovery) and a
hang of a slowed rank; the survivors re-plan a set for the ranks left
(``planner.combined``) and every step's loss equals the one-process reference.

Multi-process (gloo, 3-4 ranks, llama-tiny)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hspmd.cli import main
from hspmd.plan.strategy import parse_strategy
from hspmd.train.api import revise, train_config
from hspmd.train.config import AdamConfig
from hspmd.train.faults import parse_injections
from hspmd.train.reference import run_reference
from hspmd.train.trainer import train_elastic
from tests.cli.test_train_plans import LONG, SHORT, records, write_inputs

pytestmark = [pytest.mark.multiproc, pytest.mark.elastic]


def test_plans_survive_two_kills_in_a_row(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rank 1 dies in backward of step 3, rank 0 in the recovery's move: the two ranks left
    get a set of their own and the steps go on choosing from it."""
    plans, data = write_inputs(tmp_path)
    argv = ["train", "--plans", str(plans), "--data", str(data), "--steps", "4", "--json"]
    faults = ["--inject-failure", "1@3:backward", "--inject-failure", "0@3:switch"]
    assert main([*argv, "--elastic", "--hang-timeout", "20", *faults]) == 0
    out = records(capsys)
    assert main([*argv, "--elastic", "--reference"]) == 0
    theirs = records(capsys)
    events = [r for r in out if "event" in r]
    steps = [r for r in out if "step" in r and "event" not in r]
    assert sorted(e["rank"] for e in events if e["event"] == "failure") == [0, 1]
    replans = [e for e in events if e["event"] == "replan"]
    assert replans and all(len(e["strategies"]) >= 1 for e in replans)  # type: ignore[arg-type]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert [r["strategy"] for r in steps[:2]] == [SHORT, LONG]  # chosen per step
    assert all(r["strategy"] for r in steps)
    for a, b in zip(steps, theirs, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["tokens"] == b["tokens"]


def test_a_hang_of_a_slowed_rank_is_survived_and_a_spare_planned_in(tmp_path: Path) -> None:
    """Rank 2 runs twice as slow (``--slowdown``) and hangs in forward of step 2: the
    launcher kills it after the timeout; the planner, which knows its speed, plans the
    two ranks left, and the redone step has the same documents. A spare joins before
    step 3 and the next set uses it."""
    _, data = write_inputs(tmp_path)
    config = train_config(
        model_kwargs={"num_layers": 2}, seq_len=256, step_tokens=256, steps=3,
        data=str(data), adam=AdamConfig(lr=1e-3), elastic=True, hang_timeout=3.0,
        strategy="2x1: R0:L0-1; 2x1: R1:L0-0 R2:L1-1", slowdown=((2, 2.0),),
        inject=parse_injections(["2@2:forward:hang"]), spares=1, grow=((3, 1),),
        global_batch=8,
    )  # fmt: skip
    events: list[dict[str, object]] = []
    result = train_elastic(config, on_event=events.append, timeout_s=120.0, threads=1)
    ref = run_reference(revise(config, inject=()))
    failure = next(e for e in events if e["event"] == "failure")
    assert (failure["rank"], failure["cause"], failure["phase"]) == (2, "hang", "forward")
    assert [r.step for r in result.records] == [1, 2, 3]
    for mine, theirs in zip(result.records, ref.records, strict=True):
        assert mine.loss == pytest.approx(theirs.loss, rel=1e-5)
        assert mine.tokens == theirs.tokens
    assert [e["ranks"] for e in events if e["event"] == "grow"] == [[3]]
    assert len(parse_strategy(result.records[-1].strategy or "").ranks) == 3  # the spare too
