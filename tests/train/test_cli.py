"""`hspmd train` and `hspmd demo` through their argument parsers."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from hspmd.cli import demo, train
from hspmd.errors import StrategyError


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="hspmd")
    subparsers = parser.add_subparsers(dest="command", required=True)
    train.register(subparsers)
    demo.register(subparsers)
    return parser.parse_args(list(argv))


def test_reference_json_prints_one_object_per_step(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse(
        "train", "--reference", "--global-batch", "2", "--seq-len", "16", "--steps", "2", "--json"
    )
    assert args.func(args) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    assert all(4.0 < line["loss"] < 7.0 for line in lines)


def test_bad_strategy_is_refused_before_processes() -> None:
    args = parse("train", "--strategy", "2x2: R0:L0-1; 4x1: R1:L0-3", "--global-batch", "8")
    with pytest.raises(StrategyError, match="layer"):
        args.func(args)


def test_unusable_save_folder_and_lr_are_refused_before_processes(tmp_path: Path) -> None:
    from hspmd.train.config import TrainError

    blocker = tmp_path / "file"
    blocker.write_text("")  # a file where the folder would go
    args = parse("train", "--strategy", "1x1: R0:L0-3", "--save", str(blocker / "ckpt"))
    with pytest.raises(TrainError, match="cannot write there"):
        args.func(args)
    args = parse("train", "--strategy", "1x1: R0:L0-3", "--lr", "-1")
    with pytest.raises(TrainError, match="learning rate"):
        args.func(args)


@pytest.mark.multiproc
def test_train_json_equals_reference_json(capsys: pytest.CaptureFixture[str]) -> None:
    common = (
        "--global-batch",
        "4",
        "--seq-len",
        "16",
        "--steps",
        "2",
        "--json",
        "--data-max-bytes",
        "100000",
    )
    args = parse("train", "--strategy", "2x1: R0:L0-1 R1:L2-3; 1x2: R2:L0-3", *common)
    assert args.func(args) == 0
    ours = [json.loads(line)["loss"] for line in capsys.readouterr().out.splitlines()]
    args = parse("train", "--reference", *common)
    assert args.func(args) == 0
    theirs = [json.loads(line)["loss"] for line in capsys.readouterr().out.splitlines()]
    assert ours == pytest.approx(theirs, rel=1e-5)


@pytest.mark.multiproc
def test_demo_matches_the_reference(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse("demo", "--steps", "2", "--seq-len", "16")
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "equal to the reference" in " ".join(out.split())  # rich wraps the line
    assert "R0-1:L0-1" in out
