"""`hspmd plan` and `hspmd simulate` on the command line: output, files, one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hspmd.cli import main
from tests.planner.conftest import cluster_file


def _err(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


def test_plan_json_has_the_documented_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = cluster_file(tmp_path / "c.json", fast=2, slow=2)
    out = tmp_path / "plan.json"
    argv = ["plan", "--model", "llama-tiny", "--cluster", str(path), "--global-batch", "8",
            "--seq-len", "32", "--dtype", "fp32", "--json", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert {"strategy", "zero1", "recompute", "step_time_s", "plan_seconds", "homogeneous"} <= set(
        data
    )
    assert json.loads(out.read_text())["strategy"] == data["strategy"]


def test_plan_text_shows_the_baseline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = cluster_file(tmp_path / "c.json", fast=2, slow=2)
    argv = ["plan", "--model", "llama-tiny", "--cluster", str(path), "--global-batch", "8",
            "--seq-len", "32", "--dtype", "fp32"]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "strategy: " in text and "best homogeneous: " in text and "predicted step time" in text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "llama-7b", "--cluster", "h20x32"], "'llama-7b' is neither a preset"),
        (["--model", "llama-tiny", "--cluster", "nosuch"], "no cluster file 'nosuch'"),
    ],
)
def test_plan_bad_input_is_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        code = main(["plan", *argv, "--global-batch", "8"])
    except SystemExit as exit_:  # a usage error: argparse's own exit
        code = exit_.code  # type: ignore[assignment]
    assert code == 2
    assert message in _err(capsys)


def test_plan_malformed_cluster_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "hspmd.cluster/1", "name": "x"')
    assert (
        main(["plan", "--model", "llama-tiny", "--cluster", str(bad), "--global-batch", "8"]) == 2
    )
    assert "bad.json" in _err(capsys)


def test_plan_nothing_fits_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = cluster_file(tmp_path / "c.json", fast=2, slow=0, memory_mb=1)
    argv = ["plan", "--model", "llama-tiny", "--cluster", str(path), "--global-batch", "8"]
    assert main(argv) == 2
    assert "nothing fits" in _err(capsys)


def test_simulate_writes_json_trace_and_timeline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = cluster_file(tmp_path / "c.json", fast=2, slow=2)
    trace, timeline = tmp_path / "t.json", tmp_path / "t.png"
    argv = ["simulate", "--model", "llama-tiny", "--cluster", str(path), "--seq-len", "32",
            "--dtype", "fp32", "--strategy", "2x2: R0-1:L0-1 R2:L2-3; 2x2: R3:L0-3",
            "--zero1", "--json", "--trace", str(trace), "--timeline", str(timeline)]  # fmt: skip
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] and data["step_time_s"] > 0 and set(data["ranks"]) == {"0", "1", "2", "3"}
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["pid"] for e in events if e.get("ph") == "X"} >= {0, 2, 3}
    assert timeline.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulate_over_memory_names_rank_peak_and_cap(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = cluster_file(tmp_path / "c.json", fast=2, slow=0, memory_mb=1)
    argv = ["simulate", "--model", "llama-tiny", "--cluster", str(path), "--seq-len", "32",
            "--strategy", "4x2: R0:L0-1 R1:L2-3"]  # fmt: skip
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "does not fit: rank 0 (fast) needs" in out and "has 0.0 GiB" in out


def test_simulate_bad_strategy_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = cluster_file(tmp_path / "c.json", fast=2, slow=2)
    argv = [
        "simulate",
        "--model",
        "llama-tiny",
        "--cluster",
        str(path),
        "--strategy",
        "2x2: R0:L0-2",
    ]
    assert main(argv) == 2
    assert "layer" in _err(capsys)


def test_simulate_trace_into_a_missing_folder_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = cluster_file(tmp_path / "c.json", fast=2, slow=2)
    argv = ["simulate", "--model", "llama-tiny", "--cluster", str(path),
            "--strategy", "2x1: R0:L0-3", "--trace", str(tmp_path / "no" / "t.json")]  # fmt: skip
    assert main(argv) == 2
    assert "does not exist" in _err(capsys)


def test_plan_alive_current_replans(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = cluster_file(tmp_path / "c.json", fast=4, slow=0)
    argv = ["plan", "--model", "llama-tiny", "--cluster", str(path), "--global-batch", "8",
            "--seq-len", "32", "--dtype", "fp32", "--alive", "0-2", "--json",
            "--current", "4x1: R0:L0-3; 4x1: R3:L0-3"]  # fmt: skip
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert {"strategy", "step_time_s", "plan_seconds", "moved_bytes", "switch_seconds"} <= set(data)
    assert data["alive"] == "0-2" and data["zero1"] is False
    assert data["strategy"].count(";") >= 1 and "R3" not in data["strategy"]
    assert main(argv[:-3] + ["--current", "4x1: R0:L0-3; 4x1: R3:L0-3"]) == 0
    assert "switch from the current strategy:" in capsys.readouterr().out


def test_plan_alive_too_few_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = cluster_file(tmp_path / "c.json", fast=4, slow=0)
    argv = ["plan", "--model", "llama-tiny", "--cluster", str(path), "--global-batch", "8",
            "--seq-len", "32", "--dtype", "fp32", "--alive", "2"]  # fmt: skip
    assert main(argv) == 2
    assert "no elastic strategy for 1 alive ranks" in _err(capsys)


def test_simulate_table_columns_fit_long_kind_names(capsys: pytest.CaptureFixture[str]) -> None:
    """A kind name longer than the column (an emulated network's ``netns-cpu``) widens it
    instead of running into the layers."""
    cluster = Path(__file__).parents[1] / "planner" / "data" / "netcluster-2x2.json"
    assert main(["simulate", "--model", "llama-small", "--cluster", str(cluster), "--strategy",
                 "4x1: R0-3:L0-7", "--global-batch", "4", "--seq-len", "64", "--dtype",
                 "fp32"]) == 0  # fmt: skip
    row = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("p0s0"))
    assert row.split()[:4] == ["p0s0", "R0-3", "netns-cpu", "0-7"]
