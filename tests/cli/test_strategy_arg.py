"""``@FILE`` wherever the CLI takes a strategy (hspmd.cli.strategy_arg): the file's strategy
is used as given inline; a missing, unreadable, empty or unparsable file is one error
naming the path."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from hspmd.cli import build_parser, main
from hspmd.cli.strategy_arg import switch_argument
from hspmd.cli.train import parse_switches
from hspmd.plan.strategy import parse_strategy

TEXT = "2*(1x1: R0-1:L0-1 R2-3:L2-3)"  # two pipelines of llama-tiny on 8 ranks


def _error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    return err


def test_explain_reads_the_strategy_from_a_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "s.txt"
    path.write_text("2*(1x1: R0-1:L0-1\n     R2-3:L2-3)\n")  # any spacing, newlines too
    base = ["explain", "--model", "llama-tiny", "--seq-len", "16", "--json"]
    assert main([*base, "--strategy", f"@{path}"]) == 0
    from_file = json.loads(capsys.readouterr().out)
    assert main([*base, "--strategy", TEXT]) == 0
    assert from_file == json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, r"no strategy file '.*missing.txt': give an existing file after '@'"),
        ("", r"strategy file '.*s.txt' is empty: write the strategy into it"),
        ("1x1: R0:L0-3;\n1x1: R1 L0\n", r"strategy file '.*s.txt': bad stage 'R1'.* line 2"),
    ],
)
def test_file_errors_name_the_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None, message: str
) -> None:
    path = tmp_path / ("missing.txt" if content is None else "s.txt")
    if content is not None:
        path.write_text(content)
    err = _error(capsys, ["explain", "--strategy", f"@{path}"])
    assert err.startswith("hspmd explain: error: argument --strategy: ")
    assert re.search(message, err, flags=re.S), err
    if content is None or content == "":
        assert "\n" not in err  # one line


def test_a_folder_or_no_path_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert "cannot read strategy file" in _error(capsys, ["explain", "--strategy", f"@{tmp_path}"])
    assert "'@' without a path" in _error(capsys, ["explain", "--strategy", "@"])


def test_every_strategy_flag_takes_a_file(tmp_path: Path) -> None:
    old, new = tmp_path / "old.txt", tmp_path / "new.txt"
    old.write_text("1x1: R0-3:L0-3\n")
    new.write_text("2x1: R0-1:L0-3; 2x1: R2-3:L0-3\n")
    parser = build_parser()
    args = parser.parse_args(["switch-cost", "--model", "llama-tiny", "--cluster", "h20x32",
                              "--from", f"@{old}", "--to", f"@{new}"])  # fmt: skip
    assert (args.source, args.target) == ("1x1: R0-3:L0-3", "2x1: R0-1:L0-3; 2x1: R2-3:L0-3")
    args = parser.parse_args(["plan", "--current", f"@{old}"])
    assert args.current == "1x1: R0-3:L0-3"
    required = {"simulate": ["--model", "llama-tiny", "--cluster", "h20x32"]}
    for command in ("train", "simulate", "demo"):
        args = parser.parse_args([command, *required.get(command, []), "--strategy", f"@{new}"])
        assert args.strategy == new.read_text().strip()
    args = parser.parse_args(["train", "--switch", f"3=@{new}", "--switch", "5=1x1: R0:L0-3"])
    assert parse_switches(args.switch) == (
        (3, parse_strategy(new.read_text())),
        (5, parse_strategy("1x1: R0:L0-3")),
    )
    assert switch_argument("3=1x1: R0:L0-3") == "3=1x1: R0:L0-3"
