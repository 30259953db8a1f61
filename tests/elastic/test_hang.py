"""Elastic training survives hung ranks: no progress for ``hang_timeout`` and the launcher
kills the rank, the others recover as from a crash (losses equal the reference).

Multi-process (gloo, 4 ranks, llama-tiny with 2 layers, a 3 s hang timeout).
"""

from __future__ import annotations

import os
import signal
import threading

import pytest

from tests.elastic.helpers import assert_matches_reference, run

pytestmark = [pytest.mark.multiproc, pytest.mark.elastic]

HETERO = "2x2: R0:L0-0 R1:L1-1; 2x2: R2-3:L0-1"
HANG_S = 3.0  # short, yet above a loaded machine's stalls


def test_an_injected_hang_is_detected_after_the_timeout() -> None:
    result, events = run(HETERO, "3@2:backward:hang", hang_timeout=HANG_S)
    assert_matches_reference(result)
    failure = next(e for e in events if e["event"] == "failure" and e["rank"] == 3)
    assert (failure["cause"], failure["phase"]) == ("hang", "backward")
    assert HANG_S <= failure["detected_after_s"] < HANG_S + 1.0


@pytest.mark.xfail(
    reason="stop 33: times out intermittently since the merges of 2026-12-06 (2 of 4 runs that day; "
    "cause not found yet, see the stop's note)",
    strict=False,
)
def test_sigstop_from_outside_is_a_hang() -> None:
    pids: list[int] = []
    fired = threading.Event()

    def on_step(record) -> None:  # type: ignore[no-untyped-def]
        if record.step == 2 and not fired.is_set():
            fired.set()
            os.kill(pids[1], signal.SIGSTOP)  # the launcher SIGKILLs it after the timeout

    result, events = run(HETERO, on_step=on_step, on_start=pids.extend, hang_timeout=HANG_S)
    assert_matches_reference(result)
    failure = next(e for e in events if e["event"] == "failure" and e["rank"] == 1)
    assert failure["cause"] == "hang"
    assert failure["detected_after_s"] < HANG_S + 1.0
