"""Elastic training survives killed ranks: every step's loss equals the reference.

Multi-process (gloo, 4 ranks, llama-tiny with 2 layers): each test is one launch of a
few seconds on an idle machine. Failures come from ``--inject-failure`` (SIGKILL of the
rank itself at a phase) and from outside (SIGKILL of a worker at a random moment).
"""

from __future__ import annotations

import os
import random
import signal
import threading

import pytest

from hspmd.plan.strategy import parse_strategy
from tests.elastic.helpers import assert_matches_reference, kinds, run

pytestmark = [pytest.mark.multiproc, pytest.mark.elastic]

HETERO = "2x2: R0:L0-0 R1:L1-1; 2x2: R2-3:L0-1"  # a PP pipeline and a TP pipeline
FOUR_DP = "1x2: R0:L0-1; 1x2: R1:L0-1; 1x2: R2:L0-1; 1x2: R3:L0-1"


def test_kill_a_nonzero_rank_in_forward() -> None:
    result, events = run(HETERO, "1@2:forward")
    assert_matches_reference(result)
    assert kinds(events) == ["failure", "replan", "resumed"]
    failure, replan, resumed = (e for e in events if e["event"] != "started")
    assert (failure["rank"], failure["phase"], failure["step"]) == (1, "forward", 2)
    assert failure["cause"] == "exit" and failure["exit_code"] == -signal.SIGKILL
    assert 0 <= failure["detected_after_s"] < 2.0
    assert resumed["step"] == 2 and resumed["moved_bytes"] > 0  # layer 1 moves to new holders
    assert parse_strategy(replan["strategy"]).ranks == (0, 1, 2)  # the survivors renumbered


def test_kill_rank_zero_in_sync() -> None:
    result, events = run(HETERO, "0@3:sync")
    assert_matches_reference(result)
    failure = next(e for e in events if e["event"] == "failure")
    assert (failure["rank"], failure["phase"], failure["step"]) == (0, "sync", 3)
    assert next(e for e in events if e["event"] == "resumed")["step"] == 3  # redone


def test_two_failures_in_a_row_one_during_recovery() -> None:
    """Rank 1 dies in backward; rank 2 dies while the states move: the recovery starts
    again from the same states, with ranks 0 and 3."""
    result, events = run(FOUR_DP, "1@2:backward", "2@2:switch")
    assert_matches_reference(result)
    failures = sorted((e["rank"], e["phase"]) for e in events if e["event"] == "failure")
    assert failures == [(1, "backward"), (2, "switch")]
    assert kinds(events).count("resumed") == 1


def test_a_kill_after_the_commit_keeps_the_step() -> None:
    """Rank 3 dies in optimizer: step 2 had committed on every rank, so it counts once."""
    result, events = run(FOUR_DP, "3@2:optimizer")
    assert_matches_reference(result)
    assert next(e for e in events if e["event"] == "resumed")["step"] == 3


def test_sigkill_from_outside_at_a_random_moment() -> None:
    pids: list[int] = []
    when = random.Random(os.getpid()).uniform(0.0, 0.05)
    fired = threading.Event()

    def on_step(record) -> None:  # type: ignore[no-untyped-def]
        if record.step == 1 and not fired.is_set():
            fired.set()
            threading.Timer(when, os.kill, args=(pids[2], signal.SIGKILL)).start()

    result, events = run(HETERO, on_step=on_step, on_start=pids.extend)
    assert_matches_reference(result)
    failure = next(e for e in events if e["event"] == "failure")
    assert failure["rank"] == 2 and failure["exit_code"] == -signal.SIGKILL
