"""Chrome trace JSON and the Gantt picture of a simulated step."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from xml.etree import ElementTree

import pytest

from hspmd.sim import Result, SimError, Task, chrome_trace, draw_timeline, simulate, write_trace


def _result() -> Result:
    # listed out of time order on rank 0: 'late' (compute, [2,3)) before 'send' (comm, [1,2))
    return simulate([
        Task("f0", 0, "compute", 1.0, category="compute", label="F"),
        Task("late", 0, "compute", 1.0, category="compute", deps=("send",), label="F"),
        Task("send", 0, "comm", 1.0, category="comm", deps=("f0",), resources=("ib:0->1",)),
        Task("ar", 1, "comm", 0.5, category="comm", ranks=(1, 2), label="AR"),
        Task("b1", 1, "compute", 2.0, category="compute", deps=("send",), label="B"),
    ])  # fmt: skip


def _spans(trace: dict) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] == "X"]


def test_chrome_trace_events_per_rank_in_microseconds() -> None:
    trace = chrome_trace(_result(), rank_names={0: "node0/gpu0"})
    events = _spans(trace)
    by_rank = {r: [e for e in events if e["pid"] == r] for r in (0, 1, 2)}
    assert [e["args"]["task_id"] for e in by_rank[0]] == ["f0", "send", "late"]
    assert [e["args"]["task_id"] for e in by_rank[1]] == ["ar", "b1"]
    assert [e["args"]["task_id"] for e in by_rank[2]] == ["ar"]
    for rank_events in by_rank.values():
        starts = [e["ts"] for e in rank_events]
        assert starts == sorted(starts)
    send = next(e for e in events if e["args"]["task_id"] == "send")
    assert (send["ts"], send["dur"], send["name"], send["cat"]) == (1e6, 1e6, "send", "comm")
    assert send["args"]["waited_for"] == "f0 (dep)"
    ar = next(e for e in by_rank[2])
    assert (ar["name"], ar["dur"], ar["args"]["ranks"]) == ("AR", 0.5e6, "1,2")
    meta = {(e["pid"], e["name"]): e["args"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert meta[0, "process_name"] == {"name": "node0/gpu0"}
    assert meta[1, "process_name"] == {"name": "rank 1"}
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in trace["traceEvents"]
        if e["name"] == "thread_name"
    }
    assert threads[0, send["tid"]] == "comm"
    assert trace["otherData"] == {"makespan_s": 4.0}  # b1 runs [2,4)


def test_write_trace_is_json(tmp_path: Path) -> None:
    path = write_trace(_result(), tmp_path / "step.json")
    with path.open() as f:
        loaded = json.load(f)
    assert loaded == json.loads(json.dumps(chrome_trace(_result())))
    assert len(_spans(loaded)) == 6  # five tasks, the collective once on each of two ranks


def test_draw_timeline_png(tmp_path: Path) -> None:
    import matplotlib.image

    path = draw_timeline(_result(), tmp_path / "step.png", title="toy step")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _ = matplotlib.image.imread(path).shape
    assert width > height > 0


def test_draw_timeline_svg(tmp_path: Path) -> None:
    path = draw_timeline(_result(), tmp_path / "step.svg")
    root = ElementTree.parse(path).getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"


def test_draw_timeline_of_nothing_warns_nothing(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        draw_timeline(simulate([]), tmp_path / "empty.png")


def test_draw_timeline_names_the_suffixes() -> None:
    with pytest.raises(
        SimError, match=r"writes \.png or \.svg, got path='step\.pdf'; name it step\.png"
    ):
        draw_timeline(_result(), "step.pdf")
