"""The repeat form of the strategy string (``COUNT*(PIPELINE) [stride N]``, hspmd.plan.repeat):
expansion, canonical text, round trips, errors, and 65,536 ranks."""

from __future__ import annotations

import dataclasses
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hspmd.errors import StrategyError
from hspmd.models import get_config
from hspmd.plan.repeat import REPEAT_AT
from hspmd.plan.strategy import Pipeline, Stage, Strategy, check_strategy, parse_strategy


def test_expansion_shifts_by_the_rank_count_or_the_stride() -> None:
    s = parse_strategy("3*(4x1: R0-1:L0-3 R2-3:L4-7)")
    assert [p.ranks for p in s.pipelines] == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11)]
    s = parse_strategy("3*(4x1: R0-1:L0-3 R8-9:L4-7) stride 2")
    assert [p.ranks for p in s.pipelines] == [(0, 1, 8, 9), (2, 3, 10, 11), (4, 5, 12, 13)]
    assert [str(p.stages[0]) for p in s.pipelines] == ["R0-1:L0-3", "R2-3:L0-3", "R4-5:L0-3"]
    # the copies keep counts, layers, CP and recompute; parts mix with plain pipelines
    s = parse_strategy("2x1: R0:L0-7; 2*(1x2: R1-4:L0-3:C2:RC1 R5:L4-7)")
    assert str(s.pipelines[2]) == "1x2: R6-9:L0-3:C2:RC1 R10:L4-7"
    assert s.num_ranks == 11 and s.global_batch == 6


def test_canonical_text_repeats_long_runs_only() -> None:
    # runs shorter than REPEAT_AT print in full, as the paper's tables and existing strings do
    short = "; ".join(f"1x1: R{r}:L0-3" for r in range(REPEAT_AT - 1))
    assert str(parse_strategy(f"{REPEAT_AT - 1}*(1x1: R0:L0-3)")) == short
    assert str(Strategy.uniform(dp=2, tp=2, pp=2, num_layers=4)) == (
        "1x1: R0-1:L0-1 R2-3:L2-3; 1x1: R4-5:L0-1 R6-7:L2-3"
    )
    long = "; ".join(f"1x1: R{r}:L0-3" for r in range(REPEAT_AT))
    assert str(parse_strategy(long)) == f"{REPEAT_AT}*(1x1: R0:L0-3)"
    # a run starting after a different pipeline, then another run with its own stride
    text = "1x1: R0-1:L0-3; 8*(2x1: R2:L0-1 R3:L2-3); 9*(1x1: R20,30:L0-3) stride 1"
    assert str(parse_strategy(text)) == text
    # a short run (shift 2) before a long one (shift 1) that shares its last pipeline
    mixed = "1x1: R0:L0-3; 1x1: R2:L0-3; 1x1: R4:L0-3; 8*(1x1: R5:L0-3)"
    assert str(parse_strategy(mixed)) == "1x1: R0:L0-3; 1x1: R2:L0-3; 9*(1x1: R4:L0-3)"


def test_lenient_input_and_newlines() -> None:
    s = parse_strategy(" 8 * ( 1x1 :R0:L0-3 )stride 2 ;\n 2x1: R16:L0-3\n")
    assert str(s) == "8*(1x1: R0:L0-3) stride 2; 2x1: R16:L0-3"
    assert str(parse_strategy("1*(1x1: R0:L0-3)")) == "1x1: R0:L0-3"


def _stage(ranks: list[int], first: int, last: int, cp: int, rc: int | None) -> Stage:
    # what the parser takes: CP dividing the ranks, at most every layer recomputed
    rc = None if rc is None else min(rc, last - first + 1)
    return Stage(tuple(ranks), first, last, cp if len(ranks) % cp == 0 else 1, rc)


_stages = st.builds(
    _stage, st.lists(st.integers(0, 30), min_size=1, max_size=4, unique=True),
    st.integers(0, 5), st.integers(5, 9), st.sampled_from([1, 2]),
    st.one_of(st.none(), st.integers(0, 4)),
)  # fmt: skip
_pipelines = st.builds(
    Pipeline, st.integers(1, 40), st.integers(1, 4), st.lists(_stages, min_size=1, max_size=3).map(tuple)
)  # fmt: skip
# a run: a pipeline, a number of copies, a shift (the rank count, or any positive one)
_runs = st.tuples(_pipelines, st.integers(1, 12), st.one_of(st.none(), st.integers(1, 40)))


@given(st.lists(_runs, min_size=1, max_size=4))
def test_round_trip(runs: list[tuple[Pipeline, int, int | None]]) -> None:
    pipelines = [
        p.shifted(k * (len(p.ranks) if shift is None else shift))
        for p, count, shift in runs
        for k in range(count)
    ]
    strategy = Strategy(tuple(pipelines))
    text = str(strategy)
    assert parse_strategy(text) == strategy
    assert str(parse_strategy(text)) == text


def test_shifted_carries_every_stage_field() -> None:
    # Pipeline.shifted builds each Stage by position: a new field must be passed there too
    assert [f.name for f in dataclasses.fields(Stage)] == [
        "ranks", "first_layer", "last_layer", "cp", "recompute",
    ]  # fmt: skip
    p = parse_strategy("1x2: R0-3:L0-3:C2:RC1 R4:L4-7").pipelines[0]
    assert p.shifted(0) == p and str(p.shifted(3)) == "1x2: R3-6:L0-3:C2:RC1 R7:L4-7"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0*(1x1: R0:L0-3)", r"repeat count 0 at column 0(.|\n)*give at least 1 copy"),
        ("3*(1x1: R0:L0-3", r"without its '\)' at column 2"),
        ("3*( )", "empty repeat at column 3"),
        ("3*(1x1: R0:L0-3) strid 2", r"found 'strid' after a repeat at column 17"),
        ("3*(1x1: R0:L0-3) stride 0", "stride 0 puts every copy on the same ranks"),
        ("3*(1x1: R0:L0-3 R4L5)", r"bad stage 'R4L5'(.|\n)*column 16"),
        ("3*(1x1: R0:L0-3; 1x1: R1:L0-3)", r"without its '\)'"),
        ("3x(1x1: R0:L0-3)", r"with '\*'"),
        ("(1x1: R0:L0-3)*3", "starts with its count"),
        ("3*1x1: R0:L0-3", "in parentheses"),
    ],
)
def test_syntax_errors(text: str, message: str) -> None:
    with pytest.raises(StrategyError, match=message):
        parse_strategy(text)


def test_errors_quote_one_line_or_a_window_of_it() -> None:
    with pytest.raises(StrategyError, match=r"at line 2, column 13:\n  2x1: R1:L0-3 x\n {15}\^"):
        parse_strategy("1x1: R0:L0-3;\n2x1: R1:L0-3 x")
    long = "; ".join(f"1x1: R{r}:L0-3" for r in range(0, 2000, 2)) + "; 1x1: R3"
    with pytest.raises(StrategyError) as error:
        parse_strategy(long)
    quoted = str(error.value).splitlines()[1]
    assert quoted.startswith("  ...") and quoted.endswith("1x1: R3") and len(quoted) < 130


def test_overlapping_copies_parse_and_check_refuses_them() -> None:
    s = parse_strategy("2*(1x1: R0-1:L0-3) stride 1")
    with pytest.raises(StrategyError, match="rank 1 is in two stages"):
        check_strategy(s, get_config("llama-tiny"))


def test_65536_ranks_parse_print_and_check_quickly() -> None:
    text = "1024*(4x1: " + " ".join(
        f"R{8 * s}-{8 * s + 7}:L{10 * s}-{10 * s + 9}" for s in range(8)
    ) + ")"  # fmt: skip
    start = time.perf_counter()
    strategy = parse_strategy(text)
    assert str(strategy) == text and strategy.num_ranks == 65536
    check_strategy(strategy, get_config("llama-70b"), global_batch=4096, world_size=65536)
    assert time.perf_counter() - start < 5  # about 0.3 s on one core
    assert str(Strategy.uniform(dp=65536, tp=1, pp=1, num_layers=80)) == "65536*(1x1: R0:L0-79)"
