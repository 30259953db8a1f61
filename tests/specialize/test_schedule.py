"""Schedules: text round-trip, F before B, 1F1B memory bound, consistent p2p order."""

from __future__ import annotations

import itertools

import pytest

from hspmd.errors import HspmdError
from hspmd.specialize.schedule import (
    Action,
    ScheduleError,
    clock_table,
    gpipe,
    make_schedule,
    max_in_flight,
    one_f_one_b,
    parse_actions,
    simulate,
)

CASES = [(s, m) for s, m in itertools.product(range(1, 6), range(1, 9))]


def test_text_round_trip() -> None:
    for stages, m in CASES:
        for stage in range(stages):
            for build in (gpipe, one_f_one_b):
                schedule = build(stages, stage, m)
                assert parse_actions(str(schedule)) == schedule.actions
    assert str(Action("Pre")) == "Pre" and Action.parse("F10") == Action("F", 10)


@pytest.mark.parametrize("bad", ["X1", "F", "Pre3", "f1", "B-1"])
def test_bad_actions(bad: str) -> None:
    with pytest.raises(ScheduleError):
        Action.parse(bad)


def test_errors_are_user_errors() -> None:
    with pytest.raises(HspmdError, match="stage 3"):
        gpipe(3, 3, 2)
    with pytest.raises(ScheduleError, match="num_micro_batches=0"):
        one_f_one_b(2, 0, 0)
    with pytest.raises(ScheduleError, match="choose one of"):
        make_schedule("zb", 2, 0, 2)


@pytest.mark.parametrize("build", [gpipe, one_f_one_b])
def test_every_forward_precedes_its_backward(build) -> None:  # type: ignore[no-untyped-def]
    for stages, m in CASES:
        for stage in range(stages):
            actions = build(stages, stage, m).actions
            assert actions[0] == Action("Pre") and actions[-1] == Action("Post")
            position = {a: i for i, a in enumerate(actions)}
            for i in range(m):
                assert position[Action("F", i)] < position[Action("B", i)]
            assert len(actions) == 2 * m + 2


def test_one_f_one_b_in_flight_bound() -> None:
    for stages, m in CASES:
        for stage in range(stages):
            peak = max_in_flight(one_f_one_b(stages, stage, m).actions)
            assert peak <= stages - stage
            assert peak == min(stages - stage, m)
    assert max_in_flight(gpipe(4, 3, 8).actions) == 8


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_no_deadlock_and_consistent_order(kind: str) -> None:
    for stages, m in CASES:
        timeline = simulate([make_schedule(kind, stages, s, m).actions for s in range(stages)])
        # unit costs: a full pipeline takes 2 * (m + stages - 1) clocks under both schedules
        assert timeline.duration == 2 * (m + stages - 1)


def test_gpipe_survives_rendezvous_sends_but_1f1b_needs_nonblocking_sends() -> None:
    simulate([gpipe(3, s, 4).actions for s in range(3)], rendezvous=True)
    with pytest.raises(ScheduleError, match="deadlock with rendezvous"):
        simulate([one_f_one_b(3, s, 4).actions for s in range(3)], rendezvous=True)


def test_inconsistent_order_is_caught() -> None:
    first = parse_actions("Pre F0 F1 B0 B1 Post")
    swapped = parse_actions("Pre F1 F0 B1 B0 Post")
    with pytest.raises(ScheduleError, match="order"):
        simulate([first, swapped])


def test_deadlock_is_caught() -> None:
    # upstream waits for B0's gradient before sending F1; downstream wants F1 before B0
    upstream = parse_actions("Pre F0 B0 F1 B1 Post")
    downstream = parse_actions("Pre F0 F1 B0 B1 Post")
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate([upstream, downstream])


def test_clock_table() -> None:
    table = clock_table([one_f_one_b(3, s, 4).actions for s in range(3)])
    assert table.splitlines()[2] == "    0 | F0 F1 F2 .  .  B0 F3 B1 .  B2 .  B3"
    assert table.splitlines()[4] == "    2 | .  .  F0 B0 F1 B1 F2 B2 F3 B3 .  ."
