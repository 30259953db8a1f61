"""`hspmd train --plans`: per step the chosen strategy of a plans file, switches of the bf16
weights when it changes; every step's loss equals the one-process reference."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hspmd.cli import main
from hspmd.models.config import get_config
from hspmd.plan.strategy import parse_strategy
from hspmd.switch.weights import plan_weight_switch

SHORT = "2x1: R0:L0-3; 2x1: R1:L0-3; 2x1: R2:L0-1 R3:L2-3"  # three pipelines of rows <= 64
LONG = "1x1: R0-1:L0-3; 2x1: R2:L0-1 R3:L2-3"  # a TP-2 pipeline for rows <= 256, one short


def _pipe(tp: int, pp: int, cap: int, mbs: int) -> dict[str, object]:
    cost = {"o": 0.001, "a": 1e-3, "q": 0.0, "send_o": 0.0, "send_a": 0.0}
    return {"tp": tp, "pp": pp, "max_len": cap, "micro_batches": mbs, "lengths": [1, cap],
            "cost": cost}  # fmt: skip


def write_inputs(tmp_path: Path) -> tuple[Path, Path]:
    plans = {
        "format": "hspmd.length-plans", "version": 1, "model": "llama-tiny",
        "cluster": "local-4", "tokens_per_step": 256, "max_len": 256, "histogram": {},
        "strategies": [
            {"max_len": 64, "strategy": SHORT, "predicted_step_s": 0.1, "sync_s": 0.0,
             "pipelines": [_pipe(1, 1, 64, 2), _pipe(1, 1, 64, 2), _pipe(1, 2, 64, 2)]},
            {"max_len": 256, "strategy": LONG, "predicted_step_s": 0.2, "sync_s": 0.0,
             "pipelines": [_pipe(2, 1, 256, 1), _pipe(1, 2, 64, 2)]},
        ],
        "switch_s": [[0.0, 0.01], [0.01, 0.0]],
    }  # fmt: skip
    path, data = tmp_path / "plans.json", tmp_path / "docs.jsonl"
    path.write_text(json.dumps(plans))
    lengths = [30] * 30 + [150] * 4
    data.write_text("".join(json.dumps({"text": "x" * n}) + "\n" for n in lengths))
    return path, data


def records(capsys: pytest.CaptureFixture[str]) -> list[dict[str, object]]:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


@pytest.mark.multiproc
def test_plans_switch_and_equal_the_reference(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plans, data = write_inputs(tmp_path)
    argv = ["train", "--plans", str(plans), "--data", str(data), "--steps", "6", "--json"]
    assert main(argv) == 0
    ours = records(capsys)
    assert main([*argv, "--reference"]) == 0
    theirs = records(capsys)
    assert [r["plan"] for r in ours] == [0, 1, 1, 1, 1, 0]  # steps 2-5: a 150-token document
    assert ours[1]["strategy"] == LONG and ours[1]["switch_seconds"] > 0  # type: ignore[operator]
    # every rank of LONG holds its weights under SHORT already: nothing to send
    assert ours[1]["switch_messages"] == 0
    assert "switch_seconds" not in ours[2]
    # back to SHORT: its executables are reused (no build: much faster than step 2's)
    assert ours[5]["strategy"] == SHORT and ours[5]["switch_messages"] == 6
    assert ours[5]["switch_seconds"] < ours[1]["switch_seconds"]  # type: ignore[operator]
    for a, b in zip(ours, theirs, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert (a["plan"], a["sequences"]) == (b["plan"], b["sequences"])
        assert len(a["sequences"]) == (3 if a["plan"] == 0 else 2)  # type: ignore[arg-type]
        assert sum(a["pipeline_tokens"]) == a["tokens"] <= 256  # type: ignore[arg-type]


def test_switch_messages_count_what_changes_owner() -> None:
    """The weights switch sends only slices a rank lacks: SHORT -> LONG none (ranks 0 and
    1 each hold the whole model under SHORT), LONG -> SHORT one message per pair: ranks 0
    and 1 need the whole model, TP halves of each other's and layers of ranks 2 and 3."""
    config = get_config("llama-tiny")
    to_long = plan_weight_switch(config, parse_strategy(SHORT), parse_strategy(LONG), itemsize=2)
    to_short = plan_weight_switch(config, parse_strategy(LONG), parse_strategy(SHORT), itemsize=2)
    assert to_long.messages() == {} and sum(to_long.sent_bytes().values()) == 0
    assert sorted(to_short.messages()) == [(0, 1), (1, 0), (2, 0), (2, 1), (3, 0), (3, 1)]


def test_bad_plans_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plans, data = write_inputs(tmp_path)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    old = tmp_path / "old.json"
    old.write_text(json.dumps({**json.loads(plans.read_text()), "version": 0}))
    base = ["train", "--steps", "2"]
    cases = [
        ([*base, "--plans", str(plans), "--data", str(empty)], "the data is empty"),
        ([*base, "--plans", str(tmp_path / "none.json")], "cannot read it"),
        ([*base, "--plans", str(empty)], "not JSON"),
        ([*base, "--plans", str(old)], "this hspmd reads version 1"),
        ([*base, "--plans", str(plans), "--strategy", SHORT], "drop --strategy"),
        # zero is a value, not "take the plans file's": refused, never trained on
        ([*base, "--plans", str(plans), "--max-seq-len", "0"], "--max-seq-len 0"),
        ([*base, "--plans", str(plans), "--tokens-per-step", "0"], "--tokens-per-step 0"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
