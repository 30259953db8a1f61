"""The discrete-event engine against schedules computed by hand."""

from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hspmd.sim import Result, SimError, Task, simulate


def _compute(id: str, rank: int, duration: float, *deps: str, label: str = "") -> Task:
    return Task(id, rank, "compute", duration, category="compute", deps=deps, label=label)


def _comm(id: str, rank: int, duration: float, *deps: str, resources: tuple[str, ...] = ()) -> Task:
    return Task(id, rank, "comm", duration, category="comm", deps=deps, resources=resources)


def _times(result: Result) -> dict[str, tuple[float, float]]:
    return {s.task_id: (s.start, s.end) for s in result.spans}


def _docstring_example() -> list[Task]:
    return [
        _compute("f0", 0, 1.0),
        _comm("s0", 0, 1.0, "f0", resources=("ib:0->1",)),
        _comm("s1", 1, 1.0, resources=("ib:0->1",)),
        _compute("f1", 1, 1.0, "s0"),
    ]


def test_docstring_worked_example() -> None:
    r = simulate(_docstring_example())
    assert _times(r) == {"f0": (0, 1), "s0": (1, 2), "s1": (0, 1), "f1": (2, 3)}
    assert [(s.cause, s.cause_kind) for s in r.spans] == [
        ("", ""),
        ("f0", "dep"),
        ("", ""),
        ("s0", "dep"),
    ]
    assert r.makespan == 3.0
    assert r.critical_path() == ["f0", "s0", "f1"]
    assert str(r.span("s0")) == "s0@r0/comm[1,2)"
    assert repr(r) == "Result(tasks=4, ranks=[0, 1], makespan=3)"


def test_busy_comm_idle_per_rank() -> None:
    # docstring example: rank 0 runs [0,2), rank 1 runs [0,1) and [2,3); makespan 3
    r = simulate(_docstring_example())
    assert (r.busy, r.comm, r.idle) == ({0: 1.0, 1: 1.0}, {0: 1.0, 1: 1.0}, {0: 1.0, 1: 1.0})
    # streams overlap: compute [0,2) and comm [1,3) on one rank leave no idle time
    r = simulate([_compute("c", 0, 2.0), _compute("x", 1, 1.0), _comm("m", 0, 2.0, "x")])
    assert _times(r) == {"c": (0, 2), "x": (0, 1), "m": (1, 3)}
    assert (r.busy, r.comm, r.idle) == ({0: 2.0, 1: 1.0}, {0: 2.0, 1: 0.0}, {0: 0.0, 1: 2.0})


# 1F1B, 2 stages (rank = stage), 3 micro-batches, F = 1, B = 2; F of stage 1 needs F of
# stage 0, B of stage 0 needs B of stage 1. Stage 0 warms up with one F.
#
#   rank 0: F0 F1 B0 F2 B1 B2        rank 1: F0 B0 F1 B1 F2 B2
#
#   task  rank  start end  waited for           time  0 1 2 3 4 5 6 7 8 9 10 11 12
#   F0.0  0     0     1    -                    r0    F0F1. . B0- F2B1- . . B2-
#   F1.0  0     1     2    F0.0 (stream)        r1    . F0B0- F1B1- F2B2- . .
#   B0.0  0     4     6    B0.1 (dep)
#   F2.0  0     6     7    B0.0 (stream)
#   B1.0  0     7     9    B1.1 (dep; F2.0 too)
#   B2.0  0     10    12   B2.1 (dep)
#   F0.1  1     1     2    F0.0 (dep)
#   B0.1  1     2     4    F0.1 (stream)
#   F1.1  1     4     5    B0.1 (stream; F1.0 ended at 2)
#   B1.1  1     5     7    F1.1 (stream)
#   F2.1  1     7     8    B1.1 (stream; F2.0 also ends at 7: the later-listed finisher)
#   B2.1  1     8     10   F2.1 (stream)
#
# makespan 12; each rank busy 3 * 1 + 3 * 2 = 9, idle 3.
_ORDER = {0: "F0 F1 B0 F2 B1 B2", 1: "F0 B0 F1 B1 F2 B2"}


def _one_f_one_b() -> list[Task]:
    tasks = []
    for stage, order in _ORDER.items():
        for step in order.split():
            kind, mb = step[0], step[1]
            if kind == "F":
                deps = (f"F{mb}.0",) if stage == 1 else ()
            else:
                deps = (f"B{mb}.1",) if stage == 0 else (f"F{mb}.1",)
            tasks.append(
                _compute(f"{step}.{stage}", stage, 1.0 if kind == "F" else 2.0, *deps, label=kind)
            )
    return tasks


def test_one_f_one_b_two_stages_three_micro_batches() -> None:
    r = simulate(_one_f_one_b())
    assert _times(r) == {
        "F0.0": (0, 1), "F1.0": (1, 2), "B0.0": (4, 6), "F2.0": (6, 7), "B1.0": (7, 9),
        "B2.0": (10, 12),
        "F0.1": (1, 2), "B0.1": (2, 4), "F1.1": (4, 5), "B1.1": (5, 7), "F2.1": (7, 8),
        "B2.1": (8, 10),
    }  # fmt: skip
    assert r.makespan == 12.0
    assert (r.busy, r.comm, r.idle) == ({0: 9.0, 1: 9.0}, {0: 0.0, 1: 0.0}, {0: 3.0, 1: 3.0})
    assert r.span("F1.1").cause == "B0.1" and r.span("F1.1").cause_kind == "stream"
    assert r.span("B0.0").cause == "B0.1" and r.span("B0.0").cause_kind == "dep"
    path = r.critical_path()
    assert path == ["F0.0", "F0.1", "B0.1", "F1.1", "B1.1", "F2.1", "B2.1", "B2.0"]
    assert sum(r.span(t).duration for t in path) == r.makespan


def test_collective_waits_for_its_last_participant() -> None:
    # comm streams: r0 p0 [0,1), r1 p1 [0,3), r2 p2 [0,2); ar over all three needs all of them
    tasks = [
        _comm("p0", 0, 1.0),
        _comm("p1", 1, 3.0),
        _comm("p2", 2, 2.0),
        Task("ar", 0, "comm", 2.0, category="comm", ranks=(0, 1, 2)),
        _compute("after", 2, 1.0, "ar"),
        _comm("next", 0, 1.0),
    ]
    r = simulate(tasks)
    assert _times(r) == {
        "p0": (0, 1), "p1": (0, 3), "p2": (0, 2), "ar": (3, 5), "after": (5, 6), "next": (5, 6)
    }  # fmt: skip
    ar = r.span("ar")
    assert (ar.ranks, ar.cause, ar.cause_kind) == ((0, 1, 2), "p1", "stream")
    assert r.comm == {0: 4.0, 1: 5.0, 2: 4.0}
    assert r.idle == {0: 2.0, 1: 1.0, 2: 1.0}  # r0 runs [0,1) [3,6) of 6
    assert r.critical_path() == ["p1", "ar", "after"]


def test_shared_link_serializes_sends_first_come_first_served() -> None:
    # 'late' is listed first but becomes ready at 1 (after 'f'); 'early' is ready at 0
    link = ("ib:node0->node1",)
    r = simulate([
        _compute("f", 0, 1.0),
        _comm("late", 0, 2.0, "f", resources=link),
        _comm("early", 1, 2.0, resources=link),
    ])  # fmt: skip
    assert _times(r) == {"f": (0, 1), "late": (2, 4), "early": (0, 2)}
    assert (r.span("late").cause, r.span("late").cause_kind) == ("early", "resource")
    assert r.critical_path() == ["early", "late"]


def test_link_waiters_served_by_ready_time_then_input_order() -> None:
    # holder h [0,3); x ready at 2, y ready at 1, z ready at 1 listed after y
    link = ("nic:0",)
    r = simulate([
        _comm("h", 0, 3.0, resources=link),
        _compute("a", 1, 2.0), _comm("x", 1, 1.0, "a", resources=link),
        _compute("b", 2, 1.0), _comm("y", 2, 1.0, "b", resources=link),
        _compute("c", 3, 1.0), _comm("z", 3, 1.0, "c", resources=link),
    ])  # fmt: skip
    assert {t: r.span(t).start for t in "hyzx"} == {"h": 0, "y": 3, "z": 4, "x": 5}
    assert r.span("x").cause == "z"


def test_task_holding_two_resources_waits_for_both() -> None:
    r = simulate([
        _comm("a", 0, 2.0, resources=("l0",)),
        _comm("b", 1, 3.0, resources=("l1",)),
        _comm("both", 2, 1.0, resources=("l0", "l1")),
    ])  # fmt: skip
    assert r.span("both").start == 3.0 and r.span("both").cause == "b"


def test_to_json_keys() -> None:
    j = simulate(_docstring_example()).to_json()
    assert set(j) == {"makespan", "num_tasks", "ranks", "time_by_category", "critical_path"}
    assert j["ranks"] == {
        "0": {"busy": 1.0, "comm": 1.0, "idle": 1.0},
        "1": {"busy": 1.0, "comm": 1.0, "idle": 1.0},
    }
    assert j["time_by_category"] == {"comm": 2.0, "compute": 2.0}
    assert (j["makespan"], j["num_tasks"], j["critical_path"]) == (3.0, 4, ["f0", "s0", "f1"])


def test_empty_task_list() -> None:
    r = simulate([])
    assert (r.makespan, r.critical_path(), r.busy) == (0.0, [], {})


@pytest.mark.parametrize("duration", [-1.0, float("nan"), float("inf")])
def test_bad_duration_is_named(duration: float) -> None:
    with pytest.raises(SimError, match=r"task 'F0': duration=.*finite value >= 0"):
        _compute("F0", 0, duration)


def test_collective_rank_must_participate() -> None:
    with pytest.raises(SimError, match=r"task 'ar': rank=3 ranks=\(0, 1\)"):
        Task("ar", 3, "comm", 1.0, category="comm", ranks=(0, 1))


def test_unknown_dep_is_named() -> None:
    with pytest.raises(SimError, match=r"1 dep\(s\) name no task: 'B0' -> 'F9'"):
        simulate([_compute("F0", 0, 1.0), _compute("B0", 0, 1.0, "F9")])


def test_duplicate_id_is_named() -> None:
    with pytest.raises(SimError, match=r"task id 'F0' is used twice \(tasks 0 and 1\)"):
        simulate([_compute("F0", 0, 1.0), _compute("F0", 1, 1.0)])


def test_dep_cycle_is_named() -> None:
    tasks = [_compute("a", 0, 1.0, "c"), _compute("b", 1, 1.0, "a"), _compute("c", 2, 1.0, "b")]
    with pytest.raises(SimError) as err:
        simulate([_compute("ok", 0, 1.0), *tasks])
    assert str(err.value).startswith(
        "a dep cycle: 3 of 4 tasks never ran ('a', 'b', 'c'); 'a' waits for 'c' (dep); "
        "'c' waits for 'b' (dep); 'b' waits for 'a' (dep). Fix:"
    )


def test_collectives_in_opposite_order_deadlock() -> None:
    # rank 0 would issue ar1 before ar0 (written as a dep), rank 1 ar0 before ar1 (the
    # list order): each collective waits for the other. A collective has one place in the
    # list, so the opposite order on one rank can only be written as such a dep.
    tasks = [
        Task("ar0", 0, "comm", 1.0, category="comm", ranks=(0, 1), deps=("ar1",)),
        Task("ar1", 0, "comm", 1.0, category="comm", ranks=(0, 1)),
    ]
    with pytest.raises(SimError) as err:
        simulate(tasks)
    assert str(err.value).startswith(
        "a deadlock: 2 of 2 tasks never ran ('ar0', 'ar1'); 'ar0' waits for 'ar1' (dep); "
        "'ar1' waits for 'ar0' (stream comm of rank 0 has 'ar0' first). Fix:"
    )


def test_unknown_span_is_named() -> None:
    with pytest.raises(SimError, match="no task 'zz' in this result"):
        simulate(_docstring_example()).span("zz")


# ---- random task graphs -------------------------------------------------------------

_DURATIONS = st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.0])


@st.composite
def _task_lists(draw: st.DrawFn, *, forward_deps: bool = False) -> list[Task]:
    n = draw(st.integers(1, 12))
    tasks = []
    for i in range(n):
        rank = draw(st.integers(0, 2))
        others = draw(st.sets(st.integers(0, 2), max_size=2))
        ranks = tuple(sorted(others | {rank})) if others - {rank} else ()
        pool = range(n) if forward_deps else range(i)
        deps = draw(st.sets(st.sampled_from(pool), max_size=3)) if pool else set()
        tasks.append(
            Task(
                f"t{i}",
                rank,
                draw(st.sampled_from(["compute", "comm"])),
                draw(_DURATIONS),
                category=draw(st.sampled_from(["compute", "comm"])),
                deps=tuple(f"t{d}" for d in sorted(deps)),
                resources=tuple(draw(st.sets(st.sampled_from(["l0", "l1"]), max_size=2))),
                ranks=ranks,
            )
        )
    return tasks


@settings(max_examples=40, deadline=None)
@given(_task_lists())
def test_random_dags_respect_every_constraint(tasks: list[Task]) -> None:
    r = simulate(tasks)
    last_on: dict[tuple[int, str], str] = {}
    for t in tasks:
        s = r.span(t.id)
        earliest = max((r.span(d).end for d in t.deps), default=0.0)
        for p in t.participants:
            if (prev := last_on.get((p, t.stream))) is not None:
                earliest = max(earliest, r.span(prev).end)
            last_on[p, t.stream] = t.id
        assert s.start >= earliest and s.end == s.start + t.duration
        if not t.resources:
            assert s.start == earliest  # nothing else may hold a task back
        if s.cause:
            assert r.span(s.cause).end == s.start
    for link in ("l0", "l1"):
        held = sorted(
            (r.span(t.id).start, r.span(t.id).end)
            for t in tasks
            if link in t.resources and t.duration
        )
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in pairwise(held))
    assert r.makespan == max(s.end for s in r.spans)
    path = r.critical_path()
    assert r.span(path[0]).start == 0 and r.span(path[-1]).end == r.makespan


@settings(max_examples=40, deadline=None)
@given(_task_lists(forward_deps=True))
def test_random_graphs_run_or_raise_sim_error(tasks: list[Task]) -> None:
    try:
        r = simulate(tasks)
    except SimError as err:
        assert "never ran" in str(err)
    else:
        assert len(r.spans) == len(tasks)


def test_docs_worked_example() -> None:
    # docs/simulator.md: two sends share rank 2's NIC, then G and an all-reduce over three
    nic = ("nic:2",)
    r = simulate([
        _compute("f0", 0, 1.0, label="F"),
        _compute("f1", 1, 1.5, label="F"),
        _comm("s0", 0, 1.0, "f0", resources=nic),
        _comm("s1", 1, 1.0, "f1", resources=nic),
        _compute("g", 2, 1.0, "s0", "s1", label="G"),
        Task("ar", 2, "comm", 0.5, category="comm", ranks=(0, 1, 2), deps=("g",), label="AR"),
    ])  # fmt: skip
    assert _times(r) == {
        "f0": (0, 1), "f1": (0, 1.5), "s0": (1, 2), "s1": (2, 3), "g": (3, 4), "ar": (4, 4.5)
    }  # fmt: skip
    assert [s.cause_kind for s in r.spans] == ["", "", "dep", "resource", "dep", "dep"]
    assert (r.busy, r.comm, r.idle) == (
        {0: 1.0, 1: 1.5, 2: 1.0},
        {0: 1.5, 1: 1.5, 2: 0.5},
        {0: 2.0, 1: 1.5, 2: 3.0},
    )
    assert r.critical_path() == ["f0", "s0", "s1", "g", "ar"]
    assert r.to_json()["time_by_category"] == {"comm": 3.5, "compute": 3.5}


def test_pool_shares_processors_among_the_tasks_running_at_once() -> None:
    from hspmd.sim import Pool

    # up to 2 tasks at once run alone-speed; 3 at once 1.5x slower each
    pools = {"cores": Pool((1.0, 1.0, 1.5))}

    def task(id: str, rank: int, duration: float, *deps: str) -> Task:
        return Task(id, rank, "compute", duration, category="F", deps=deps, share="cores")

    tasks = [task("a", 0, 1.0), task("b", 1, 2.0), task("c", 2, 1.0), task("d", 3, 1.0, "a")]
    r = simulate(tasks, pools=pools)
    # a, b, c at 1/1.5 until a and c finish at 1.5; then b (1.0 left) and d run alone-speed
    assert _times(r) == {"a": (0.0, 1.5), "b": (0.0, 2.5), "c": (0.0, 1.5), "d": (1.5, 2.5)}
    assert r.busy[1] == pytest.approx(2.5)  # the time it really took
    # a collective weighs its participants: a 2-rank task plus one more is 3 at once
    pair = Task("tp", 0, "compute", 1.0, category="F", ranks=(0, 1), share="cores")
    alone = Task("x", 2, "compute", 1.0, category="F", share="cores")
    assert simulate([pair, alone], pools=pools).makespan == pytest.approx(1.5)
    # without pools= naming it, a shared task is refused
    with pytest.raises(SimError, match="'cores'"):
        simulate(tasks)


def test_task_measured_under_load_is_slowed_only_beyond_it() -> None:
    from hspmd.sim import Pool

    pools = {"cores": Pool((1.0, 1.5, 2.0, 3.0))}
    # a 2-rank collective profiled with its 2 ranks active: as measured at load 2 ...
    ar = Task("ar", 0, "comm", 1.0, category="comm", ranks=(0, 1), share="cores", measured_at=2)
    assert simulate([ar], pools=pools).makespan == pytest.approx(1.0)
    # ... and 3.0 / 1.5 = 2x slower while two more ranks compute beside it (load 4)
    other = Task("f", 2, "compute", 4.0, category="F", ranks=(2, 3), share="cores")
    r = simulate([ar, other], pools=pools)
    assert _times(r)["ar"] == pytest.approx((0.0, 2.0))
    # the compute runs at 1/3 while the collective runs, then at 1/1.5 alone:
    # 2 s do 2/3 of its 4 s alone, the 10/3 left take 5 s
    assert _times(r)["f"] == pytest.approx((0.0, 7.0))
    with pytest.raises(SimError, match="measured_at=0"):
        Task("x", 0, "comm", 1.0, category="comm", measured_at=0)


def test_task_weighs_the_cores_it_keeps_busy() -> None:
    from hspmd.sim import Pool

    pools = {"cores": Pool((1.0, 2.0))}
    # a rank computing a third of the time (an emulated 3x slower device) loads the pool
    # by 1/3: beside a full rank the load is 4/3, a slowdown of 1 + (2 - 1) / 3
    slow = Task("s", 0, "compute", 3.0, category="F", share="cores", weight=1 / 3)
    fast = Task("f", 1, "compute", 1.0, category="F", share="cores")
    r = simulate([slow, fast], pools=pools)
    assert _times(r)["f"] == pytest.approx((0.0, 4 / 3))
    with pytest.raises(SimError, match="weight=-1"):
        Task("x", 0, "compute", 1.0, category="F", weight=-1)


def test_pool_factors_are_checked_and_extrapolated() -> None:
    from hspmd.sim import Pool

    assert Pool((1.0, 2.0)).factor(4) == pytest.approx(4.0)
    assert Pool((1.0, 1.2)).factor(1) == 1.0
    with pytest.raises(SimError, match="factors >= 1"):
        Pool((0.5,))
