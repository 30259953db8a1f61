"""`hspmd explain`: metadata only, fast, shows pipelines, comm kinds and schedules."""

from __future__ import annotations

import argparse
import json
import sys
import time

import pytest

from hspmd.cli import explain
from hspmd.errors import HspmdError

C2 = (
    "33x1: R0-3:L0-14 R4-7:L15-29 R8-11:L30-44 R12-15:L45-59; "
    "31x1: R16-19:L0-15 R20-23:L16-31 R24-27:L32-47 R28-29:L48-55 R30:L56-59"
)


def main(argv: list[str]) -> int:
    """``hspmd.cli.main`` with only this subcommand (the others may not be importable)."""
    parser = argparse.ArgumentParser(prog="hspmd")
    explain.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except HspmdError as error:
        print(f"hspmd explain: error: {error}", file=sys.stderr)
        return 2


def test_c2_explains_quickly(capsys: pytest.CaptureFixture[str]) -> None:
    # About 1 s on an idle 2-core machine; the bound only catches a blow-up (the figure is in
    # the README, from the command itself).
    start = time.perf_counter()
    assert main(["explain", "--model", "llama-32b", "--strategy", C2]) == 0
    elapsed = time.perf_counter() - start
    out = capsys.readouterr().out
    assert elapsed < 30.0, elapsed  # a guard against blow-ups, not a target
    assert (
        "pipeline 1 (31x1): [16,17,18,19] -> [20,21,22,23] -> [24,25,26,27] -> [28,29] -> [30]"
        in out
    )
    assert "split-all-reduce" in out
    assert "rank 30: pipeline 1 stage 4 tp=1 layers 56-59" in out
    # Issue 17: the ranks of a TP group are one block, their peers listed in rank order.
    assert "ranks 0-3: pipeline 0 stage 0 tp=4 layers 0-14" in out
    assert "send-recv x1 to [4],[5],[6],[7] respectively (104.0 MiB)" in out
    assert len(out.splitlines()) < 140  # was 302 lines, one block per rank


def test_c2_json_one_rank(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["explain", "--model", "llama-32b", "--strategy", C2, "--rank", "28", "--json"]) == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert data["pipelines"][1][3] == [28, 29]
    (rank,) = data["ranks"]
    assert (rank["pipeline"], rank["stage"], rank["layers"]) == (1, 3, [48, 55])
    assert rank["forward_comm"]["bsr"] >= 1  # TP4 -> TP2 and TP2 -> TP1 boundaries
    assert set(rank["post_comm"]) == {"split-all-reduce"}
    assert rank["schedule"].startswith("Pre F0 F1 B0") and rank["schedule"].endswith("Post")


def test_tiny_tp_pp(capsys: pytest.CaptureFixture[str]) -> None:
    strategy = "2x2: R0-1:L0-1 R2-3:L2-3"
    assert main(["explain", "--strategy", strategy, "--seq-len", "16", "--rank", "2"]) == 0
    out = capsys.readouterr().out
    assert "pipeline 0 (2x2): [0,1] -> [2,3]" in out
    # Issue 17: peers and bytes. An activation is 2 x 16 x 64 fp32 = 8 KiB per micro-batch.
    # Two layers' row outputs, and the vocab-parallel loss's three all-reduces of one fp32
    # value per token (2 x 16 x 4 B each): 4 x 8 KiB + 384 B.
    assert "F (per micro-batch): all-reduce x7 in [2,3] (32.4 KiB)" in out
    assert "send-recv x1 from [0] (8.0 KiB)" in out
    assert "B (per micro-batch): all-reduce x5 in [2,3] (40.0 KiB)" in out
    assert "schedule: Pre F0 B0 F1 B1 Post" in out


def test_bad_strategy_is_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "--strategy", "1x1: R0:L0-9"]) == 2
    assert "error" in capsys.readouterr().err


def test_sequence_parallel_kinds(capsys: pytest.CaptureFixture[str]) -> None:
    strategy = "1x2: R0-1:L0-3"
    args = ["explain", "--strategy", strategy, "--seq-len", "16", "--rank", "0"]
    assert main([*args, "--sequence-parallel"]) == 0
    out = capsys.readouterr().out
    assert "F (per micro-batch): all-gather x9 in [0,1]" in out
    assert "reduce-scatter x9 in [0,1]" in out
    assert "Post:                all-reduce x9 in [0,1]" in out  # norm weights' partial grads


def test_json_gives_the_full_schedule(capsys: pytest.CaptureFixture[str]) -> None:
    # Issue 17: --json printed "... (N more) ..." in long schedules; the text stays short.
    args = ["explain", "--strategy", "32x1: R0:L0-1 R1:L2-3", "--seq-len", "16", "--rank", "1"]
    assert main([*args, "--json"]) == 0
    (rank,) = json.loads(capsys.readouterr().out)["ranks"]
    words = rank["schedule"].split()
    assert "more)" not in words and len(words) == 2 + 64  # Pre, 32 F and 32 B, Post
    assert main(args) == 0
    assert "(52 more)" in capsys.readouterr().out


def test_json_traffic_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["explain", "--strategy", "2x1: R0:L0-3; 2x1: R1:L0-3", "--seq-len", "16"]
    assert main([*args, "--json", "--rank", "1"]) == 0
    (rank,) = json.loads(capsys.readouterr().out)["ranks"]
    assert rank["forward_traffic"] == [] and rank["backward_traffic"] == []
    (sync,) = rank["post_traffic"]
    # Every gradient is all-reduced in fp32 with the other replica: all parameters' bytes.
    assert sync["kind"] == "all-reduce" and sync["peers"] == "in [0,1]"
    assert sync["bytes"] == rank["param_elements"] * 4
