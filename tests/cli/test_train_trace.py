"""`hspmd train --trace/--timeline/--predict`: flags checked first, then a traced run;
`hspmd simulate --timeline`: the same picture from predicted times; `hspmd timeline`: a
saved trace redrawn."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hspmd.cli import main
from hspmd.runtime.trace import RankTrace, chrome_trace

_RUN = ["train", "--strategy", "2x1: R0:L0-3; 2x1: R1:L0-3", "--seq-len", "16", "--steps", "2"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--predict"], "--predict draws over the measured timeline: add --timeline"),
        (["--timeline", "t.pdf"], "--timeline 't.pdf': pictures are written as .png or .svg"),
        (["--trace", "t.txt"], "--trace 't.txt': traces are JSON files: name it t.json"),
        (["--trace", "nowhere/t.json"], "folder 'nowhere' does not exist"),
        (["--reference", "--trace", "t.json"], "--reference runs the plain model on this process"),
        (["--timeline", "t.png", "--predict", "--predict-profile", "none.json"],
         "--predict-profile 'none.json': no such file"),
    ],
)  # fmt: skip
def test_bad_flags_are_refused_before_any_work(
    extra: list[str], message: str, capsys, monkeypatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main([*_RUN, *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


@pytest.mark.multiproc
def test_trace_and_timeline_of_a_run(tmp_path: Path, capsys) -> None:
    from matplotlib.image import imread

    trace, picture = tmp_path / "run.json", tmp_path / "run.png"
    assert main([*_RUN, "--trace", str(trace), "--timeline", str(picture), "--quiet"]) == 0
    out, err = capsys.readouterr()
    assert out == ""  # --quiet: no progress
    assert f"-> {trace}" in err and f"timeline of 2 steps -> {picture}" in err
    data = json.loads(trace.read_text())
    spans = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    for rank in (0, 1):
        mine = [e for e in spans if e["pid"] == rank]
        assert sum(e["cat"] == "forward" for e in mine) == 4  # 2 micro-batches x 2 steps
        assert sum(e["cat"] == "comm" and e["name"] == "all-reduce" for e in mine) >= 2
    assert data["otherData"]["strategy"] == "2x1: R0:L0-3; 2x1: R1:L0-3"
    assert imread(picture).shape[1] > 500


def test_simulate_timeline_is_the_train_picture_of_predicted_times(tmp_path: Path, capsys) -> None:
    sim = ["simulate", "--model", "llama-32b", "--cluster", "h20x32", "--seq-len", "1024",
           "--strategy", "4x1: R0-3:L0-29 R4-7:L30-59", "--recompute"]  # fmt: skip
    assert main([*sim, "--timeline", str(tmp_path / "t.pdf")]) == 2
    assert "--timeline" in capsys.readouterr().err
    svg = tmp_path / "t.svg"
    assert main([*sim, "--timeline", str(svg)]) == 0
    text = svg.read_text()
    assert "rank 3" in text and "backward" in text and "predicted step" in text


def _train_trace(path: Path) -> Path:
    ms = 1_000_000
    events = []
    for step in (1, 2):
        t = step * 100 * ms
        events += [(f"step {step}", "step", 0, t, t + 90 * ms, {"step": step}),
                   ("F", "forward", 0, t, t + 40 * ms, {"micro_batch": 0, "stage": 0})]  # fmt: skip
    trace = chrome_trace([RankTrace(0, tuple(events), 0, 0, 0)], meta={"strategy": "1x1: R0:L0-3"})
    path.write_text(json.dumps(trace))
    return path


def test_timeline_command_redraws_a_saved_trace(tmp_path: Path, capsys) -> None:
    from matplotlib.image import imread

    saved = _train_trace(tmp_path / "run.json")
    out = tmp_path / "step2.png"
    assert main(["timeline", str(saved), "--out", str(out), "--step", "2"]) == 0
    assert "2 spans of 1 ranks ->" in capsys.readouterr().err  # step 2's frame and its F
    assert imread(out).shape[1] > 500
    sim = tmp_path / "sim.json"
    assert main(["simulate", "--model", "llama-32b", "--cluster", "h20x32", "--seq-len", "1024",
                 "--strategy", "4x1: R0-3:L0-29 R4-7:L30-59", "--recompute",
                 "--trace", str(sim)]) == 0  # fmt: skip
    svg = tmp_path / "sim.svg"
    assert main(["timeline", str(sim), "--out", str(svg)]) == 0
    assert "rank 7" in svg.read_text() and "backward" in svg.read_text()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["none.json", "--out", "x.png"], "'none.json': no such file"),
        (["bad.json", "--out", "x.png"], "'bad.json' is not JSON"),
        (["list.json", "--out", "x.png"], "'list.json' has no traceEvents list"),
        (["run.json", "--out", "x.pdf"], "--out 'x.pdf': pictures are written as .png or .svg"),
        (["run.json", "--out", "x.png", "--step", "9"], "step 9 is not in the trace"),
    ],
)
def test_timeline_command_errors(argv: list[str], message: str, tmp_path: Path, capsys,
                                 monkeypatch) -> None:  # fmt: skip
    monkeypatch.chdir(tmp_path)
    _train_trace(tmp_path / "run.json")
    (tmp_path / "bad.json").write_text("{")
    (tmp_path / "list.json").write_text("[]")
    assert main(["timeline", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
