"""`hspmd train --tokens-per-step N --max-seq-len L`: packed documents through the CLI;
the JSON records equal the reference's; bad data and options: one line, exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hspmd.cli import main

STRATEGY = "4x1: R0:L0-1 R1:L2-3; 4x1: R2:L0-3"
PACKED = ["--tokens-per-step", "256", "--max-seq-len", "48", "--steps", "2", "--json",
          "--data-max-bytes", "200000", "--lr", "1e-3"]  # fmt: skip


def records(capsys: pytest.CaptureFixture[str]) -> list[dict[str, object]]:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


@pytest.mark.multiproc
def test_packed_json_records_equal_the_reference(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["train", "--model", "llama-tiny", "--strategy", STRATEGY, *PACKED]
    assert main([*argv, "--long-docs", "drop"]) == 0
    ours = records(capsys)
    assert main([*argv, "--long-docs", "drop", "--reference"]) == 0
    theirs = records(capsys)
    assert [r["step"] for r in ours] == [1, 2]
    for a, b in zip(ours, theirs, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["sequences"] == b["sequences"] and len(a["sequences"]) == 2  # type: ignore[arg-type]
        assert sum(a["pipeline_tokens"]) == a["tokens"] <= 256  # type: ignore[arg-type]
        assert a["truncated"] == 0
    assert sum(r["dropped"] for r in ours) > 0  # type: ignore[misc]


def test_bad_data_and_options_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    base = ["train", "--strategy", STRATEGY, *PACKED]
    cases = [
        ([*base, "--data", str(empty)], "the data is empty"),
        ([*base, "--data", str(tmp_path / "missing.txt")], "does not exist"),
        ([*base, "--long-docs", "error"], "more than the maximum sequence length 48"),
        (["train", "--strategy", STRATEGY, "--max-seq-len", "48"], "needs --tokens-per-step"),
        (
            ["train", "--strategy", STRATEGY, "--tokens-per-step", "16", "--max-seq-len", "48"],
            "below --max-seq-len",
        ),
        (
            ["train", "--strategy", STRATEGY, "--tokens-per-step", "800", "--max-seq-len", "48"],
            "8 rows of --max-seq-len 48 hold (384)",
        ),  # fmt: skip
        (  # exactly rows x length: whole documents leave gaps (refused before launch)
            ["train", "--strategy", STRATEGY, "--tokens-per-step", "384", "--max-seq-len", "48"],
            "at most 200 tokens a step (8 rows x 25) always pack",
        ),  # fmt: skip
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err


def test_options_that_do_nothing_warn(capsys: pytest.CaptureFixture[str]) -> None:
    from hspmd.cli import build_parser
    from hspmd.cli.train import config_from_args, warnings_of

    argv = ["train", "--strategy", STRATEGY, "--tokens-per-step", "256", "--max-seq-len", "48",
            "--global-batch", "8", "--seq-len", "32"]  # fmt: skip
    args = build_parser().parse_args(argv)
    words = " ".join(warnings_of(args, config_from_args(args)))
    assert "--global-batch 8 does nothing" in words and "--seq-len 32 does nothing" in words
