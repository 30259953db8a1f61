"""`hspmd train --eval-every N --log-dir DIR`: evaluation records beside the steps', the
same JSON lines in DIR as on stdout, TensorBoard event files (or one note without
tensorboard), and warnings for evaluation flags that do nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hspmd.cli import build_parser, main
from hspmd.cli.train import config_from_args, warnings_of
from hspmd.train import logs

SMALL = ["--config", '{"num_layers": 2}', "--seq-len", "16", "--data-max-bytes", "262144"]
EVAL = ["--eval-every", "1", "--eval-split", "0.1", "--eval-batches", "2"]


def _lines(text: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


@pytest.mark.multiproc
def test_the_log_folder_holds_what_json_prints(tmp_path: Path, capsys) -> None:
    argv = ["train", "--strategy", "2x1: R0:L0 R1:L1", "--steps", "2", *SMALL, *EVAL]
    assert main([*argv, "--json", "--log-dir", str(tmp_path)]) == 0
    out = _lines(capsys.readouterr().out)
    assert [("eval" in r, r["step"]) for r in out] == [(False, 1), (True, 1), (False, 2), (True, 2)]
    assert _lines((tmp_path / logs.RECORDS).read_text()) == out
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path))
    events.Reload()
    losses = [(p.step, p.value) for p in events.Scalars("eval/loss")]
    assert losses == [(r["step"], pytest.approx(r["eval"]["loss"])) for r in out if "eval" in r]  # type: ignore[index]


def test_without_tensorboard_json_lines_and_one_note(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(logs, "tensorboard_installed", lambda: False)
    argv = ["train", "--reference", "--global-batch", "2", "--steps", "1", *SMALL, *EVAL]
    assert main([*argv, "--log-dir", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert "eval after step 1: loss " in out and "perplexity" in out
    notes = [line for line in err.splitlines() if "note:" in line]
    assert notes == [
        f"hspmd train: note: tensorboard is not installed: --log-dir {tmp_path} gets JSON lines "
        "only (records.jsonl); pip install 'hspmd[logs]' for TensorBoard event files"
    ]
    assert [("eval" in r) for r in _lines((tmp_path / logs.RECORDS).read_text())] == [False, True]
    assert not list(tmp_path.glob("events.out.tfevents.*"))


@pytest.mark.parametrize(
    ("flags", "warning"),
    [
        (["--eval-split", "0.05"], "--eval-split 0.05 holds the last 0.05 of the data out of "
         "training but nothing evaluates it: add --eval-every N"),
        (["--eval-batches", "8"], "--eval-batches does nothing without --eval-every N"),
        (["--eval-every", "9", "--eval-split", "0.1"], "--eval-every 9 is past --steps 5: "
         "nothing is evaluated"),
    ],
)  # fmt: skip
def test_evaluation_flags_that_do_nothing_are_warned(flags: list[str], warning: str) -> None:
    args = build_parser().parse_args(["train", "--strategy", "1x1: R0:L0-3", *flags])
    assert warning in warnings_of(args, config_from_args(args))
