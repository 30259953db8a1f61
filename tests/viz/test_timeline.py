"""The timeline picture: bars from a trace and from the simulator, one step, the files."""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from hspmd.runtime.trace import RankTrace, chrome_trace
from hspmd.sim import Task, simulate
from hspmd.train.api import train_config
from hspmd.train.reference import TrainResult
from hspmd.viz.common import PictureError
from hspmd.viz.timeline import (
    Bar,
    bars_from_result,
    bars_from_trace,
    draw_timeline,
    one_step,
    step_marks,
)

MS = 1_000_000  # ns


def _rank(rank: int, *, late_ms: int = 0) -> RankTrace:
    """Two steps of F0 B0 Post(grad sync) and a send, starting ``late_ms`` later."""
    events = [("setup", "setup", 0, 0, 10 * MS, None)]
    for step in (1, 2):
        t = (10 + 100 * (step - 1) + late_ms) * MS
        events += [
            (f"step {step}", "step", 0, t, t + 90 * MS, {"step": step}),
            ("F", "forward", 0, t, t + 30 * MS, {"micro_batch": 0, "stage": 0}),
            ("send", "comm", 1, t + 30 * MS, t + 31 * MS,
             {"kind": "send", "peers": [rank, 1 - rank], "bytes": 64, "ops": {"send": 1}}),
            ("B", "backward", 0, t + 31 * MS, t + 70 * MS, {"micro_batch": 0, "stage": 0}),
            ("Post", "post", 0, t + 70 * MS, t + 90 * MS, None),
            ("grad sync", "sync", 0, t + 71 * MS, t + 80 * MS, None),
        ]  # fmt: skip
    return RankTrace(rank, tuple(events), 0, 0, 0)


TRACE = chrome_trace([_rank(0), _rank(1, late_ms=2)], meta={"strategy": "1x1: R0:L0-3"})


def test_bars_from_trace_nest_and_label() -> None:
    bars = bars_from_trace(TRACE)
    sync = next(b for b in bars if b.kind == "sync")
    post = next(b for b in bars if b.kind == "post")
    assert (post.depth, sync.depth) == (0, 1)  # Post holds its grad sync; steps do not nest
    assert {b.label for b in bars if b.kind in ("forward", "backward")} == {"F0", "B0"}
    assert [b.step for b in bars if b.kind == "step" and b.rank == 0] == [1, 2]
    send = next(b for b in bars if b.kind == "comm")
    assert send.lane == 1 and send.end - send.start == pytest.approx(0.001)


def test_one_step_keeps_the_last_step_from_zero() -> None:
    step = one_step(bars_from_trace(TRACE))
    assert {b.step for b in step if b.kind == "step"} == {2}
    assert min(b.start for b in step) == pytest.approx(0.0)
    late = next(b for b in step if b.rank == 1 and b.kind == "forward")
    assert late.start == pytest.approx(0.002)  # rank 1 started 2 ms later
    assert len([b for b in step if b.kind == "forward"]) == 2
    with pytest.raises(PictureError, match=r"step 5 is not in the trace \(it has steps \[1, 2\]\)"):
        one_step(bars_from_trace(TRACE), step=5)


def test_bars_from_result_one_bar_per_participant() -> None:
    result = simulate([
        Task("f", 0, "compute", 1.0, category="F", label="F0"),
        Task("ar", 0, "comm", 0.5, category="comm", ranks=(0, 1), deps=("f",), label="AR"),
        Task("adam", 1, "compute", 0.2, category="optimizer", deps=("ar",)),
    ])  # fmt: skip
    bars = bars_from_result(result)
    assert sorted((b.rank, b.kind, b.lane) for b in bars) == [
        (0, "comm", 1), (0, "forward", 0), (1, "comm", 1), (1, "optimizer", 0),
    ]  # fmt: skip
    assert next(b for b in bars if b.kind == "optimizer").start == pytest.approx(1.5)


def test_png_and_svg_are_written(tmp_path: Path) -> None:
    from matplotlib.image import imread

    bars = bars_from_trace(TRACE)
    png = draw_timeline(bars, tmp_path / "t.png", title="two ranks")
    image = imread(png)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 500
    assert image[..., :3].std() > 0.05  # not a blank page
    predicted = [Bar(0, 0, 0.0, 0.05, "forward", "F0"), Bar(1, 1, 0.05, 0.06, "comm")]
    svg = draw_timeline(one_step(bars), tmp_path / "t.svg", predicted=predicted)
    root = ET.parse(svg).getroot()
    assert root.tag.endswith("svg")
    text = svg.read_text()
    assert "rank 1 predicted" in text and "rank 0 measured" in text


def test_a_wrong_suffix_is_refused(tmp_path: Path) -> None:
    with pytest.raises(PictureError, match=r"--timeline .*t\.pdf.*name it t\.png or t\.svg"):
        draw_timeline(bars_from_trace(TRACE), tmp_path / "t.pdf")


def test_write_outputs_draws_measured_over_predicted(tmp_path: Path, capsys) -> None:
    from hspmd.cli.timeline import write_outputs

    config = train_config(strategy="2x1: R0:L0-3; 2x1: R1:L0-3", global_batch=4, seq_len=16,
                         steps=2)  # fmt: skip
    result = TrainResult(records=(), params={}, trace=TRACE)
    out = tmp_path / "vs.svg"
    args = argparse.Namespace(trace=str(tmp_path / "t.json"), timeline=str(out), predict=True,
                              predict_profile=None)  # fmt: skip
    write_outputs(args, config, result)
    err = capsys.readouterr().err
    assert "timeline of step 2: measured 92.0 ms over predicted" in err
    assert "rank 1 predicted" in out.read_text()
    assert (tmp_path / "t.json").read_text().startswith('{"traceEvents"')


def test_a_long_run_marks_every_kth_step(tmp_path: Path) -> None:
    frames = [Bar(0, 0, s * 0.1, s * 0.1 + 0.09, "step", f"step {s}", step=s) for s in range(1, 8)]
    assert step_marks(frames) == frames  # a short run: every step
    many = [Bar(0, 0, s * 0.1, s * 0.1 + 0.09, "step", f"step {s}", step=s) for s in range(1, 101)]
    assert [b.step for b in step_marks(many)] == list(range(1, 101, 4))
    bars = many + [Bar(0, 0, s * 0.1, s * 0.1 + 0.05, "forward", "F0") for s in range(1, 101)]
    assert draw_timeline(bars, tmp_path / "long.png").stat().st_size > 0
