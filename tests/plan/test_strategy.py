"""The strategy string: parsing, canonical text, and refusals before any process starts."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hspmd.errors import StrategyError
from hspmd.models import get_config
from hspmd.plan.strategy import (
    Pipeline,
    Stage,
    Strategy,
    StrategyOptions,
    check_strategy,
    format_ranks,
    parse_ranks,
    parse_strategy,
)

C2 = (
    "33x1: R0-3:L0-14 R4-7:L15-29 R8-11:L30-44 R12-15:L45-59; "
    "31x1: R16-19:L0-15 R20-23:L16-31 R24-27:L32-47 R28-29:L48-55 R30:L56-59"
)
# Table 12, C6: different stage counts, TP degrees 4, 2 and 1 in one pipeline.
C6 = (
    "33x1: R16-19:L0-5 R20-23:L6-11 R24-27:L12-17 R0-3:L18-38 R4-7:L39-59; "
    "31x1: R28-31:L0-5 R32-35:L6-11 R36-39:L12-17 R8-11:L18-39 R12-13:L40-52 R14:L53-59"
)
# Table 9, 70B on 16 H800 + 32 H20.
T9_70B = (
    "32x1: R16-23:L0-16 R24-31:L17-33 R0-7:L34-79; 32x1: R32-39:L0-16 R40-47:L17-33 R8-15:L34-79"
)
BIG = get_config("llama-32b")


@pytest.mark.parametrize("text", [C2, C6, "4x2: R0-3,8:L0-3", "1x1: R3,2,1,0:L0-3"])
def test_round_trip(text: str) -> None:
    strategy = parse_strategy(text)
    assert str(strategy) == text
    assert parse_strategy(str(strategy)) == strategy


def test_c2_structure() -> None:
    s = parse_strategy(C2)
    check_strategy(s, BIG, global_batch=64, world_size=31)
    assert s.num_ranks == 31 and s.ranks == tuple(range(31))
    assert [p.num_micro_batches for p in s.pipelines] == [33, 31]
    assert [st.tp for st in s.pipelines[1].stages] == [4, 4, 4, 2, 1]
    assert s.pipelines[1].stage_of_layer(50) == Stage((28, 29), 48, 55)


def test_table_examples_check() -> None:
    # The paper's plans pass the checks (check_strategy raises on any violation), and a
    # global batch the plan does not sum to is refused.
    for text, config in ((C6, BIG), (T9_70B, get_config("llama-70b"))):
        strategy = parse_strategy(text)
        check_strategy(strategy, config, global_batch=64)
        assert strategy.global_batch == 64
        assert [s.last_layer for s in strategy.pipelines[0].stages][-1] == config.num_layers - 1
        with pytest.raises(StrategyError):
            check_strategy(strategy, config, global_batch=63)


def test_lenient_spacing_and_single_layer() -> None:
    s = parse_strategy(" 2 x 1 :R0:L0  R1:L1-3 ;1x2:   R2-3:L0-3 ")
    assert str(s) == "2x1: R0:L0-0 R1:L1-3; 1x2: R2-3:L0-3"


def test_ranks_text() -> None:
    assert parse_ranks("0-3,8") == (0, 1, 2, 3, 8)
    assert format_ranks((0, 1, 2, 3, 8)) == "0-3,8"
    assert format_ranks((0, 2, 5)) == "0,2,5"
    assert format_ranks((5, 4)) == "5,4"


@given(st.lists(st.integers(0, 40), min_size=1, max_size=12, unique=True))
def test_ranks_round_trip(ranks: list[int]) -> None:
    assert parse_ranks(format_ranks(ranks)) == tuple(ranks)


def test_uniform() -> None:
    s = Strategy.uniform(dp=2, tp=2, pp=3, num_layers=8, num_micro_batches=4)
    assert str(s) == ("4x1: R0-1:L0-2 R2-3:L3-5 R4-5:L6-7; 4x1: R6-7:L0-2 R8-9:L3-5 R10-11:L6-7")
    check_strategy(s, get_config("llama-tiny", num_layers=8), global_batch=8)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty strategy"),
        ("33x1: R0-3:L0-14 R4-7L15-29", r"bad stage 'R4-7L15-29'(.|\n)*column 17"),
        ("33x1 R0-3:L0-59", "found '33x1'"),
        ("1x1: R0-3:L0-59;", "empty pipeline"),
        ("1x1:", "without stages"),
        ("1x1: R0-3,2:L0-59", "listed twice"),
        ("1x1: R3-0:L0-59", "low-high"),
        # issue 17: the likely fix for two typos
        ("4x1: R0-1:L0-3, 2x1: R2:L0-3", "separate pipelines with ';', not ','"),
        ("4x1: r0:L0-3", "write R and L in capitals: 'R0:L0-3'"),
        ("4x1: R0-1:l0-3", "write R and L in capitals: 'R0-1:L0-3'"),
        # a zero count was refused later as "global_batch=0", naming no pipeline
        ("1x1: R0:L0-3; 0x2: R1:L0-3", r"pipeline 0x2: runs 0 micro-batches of 2 at column 14"),
        ("2x0: R0:L0-3", r"runs 2 micro-batches of 0(.|\n)*both numbers must be at least 1"),
    ],
)
def test_syntax_errors(text: str, message: str) -> None:
    with pytest.raises(StrategyError, match=message):
        parse_strategy(text)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("2x1: R0-3:L0-59; 2x1: R3-6:L0-59", "rank 3 is in two stages"),
        ("4x1: R0-3:L0-10 R4:L12-59", "gap before stage R4:L12-59.*start at layer 11"),
        ("4x1: R0-3:L0-10 R4:L10-59", "overlap at stage R4:L10-59.*start it at layer 11"),
        # issue 17: said "should start at layer 60" on a 60-layer model
        ("4x1: R0-3:L0-59 R4:L59-59", "layer 59 is already held by stage 0.*drop R4:L59-59"),
        ("4x1: R0-3:L0-64", "holds layers up to 64.*60 layers"),
        ("4x1: R0-3:L0-50", "stops at layer 50"),
        ("4x1: R0-2:L0-59", "TP degree 3.*num_heads=64"),
        ("2x1: R0-3:L0-59", r"2x1 = 2 samples.*global batch is 4"),
        ("0x1: R0-3:L0-59", "at least 1"),
        ("4x1: R0-3:L5-2 R4:L3-59", "ends before it starts"),
    ],
)
def test_refusals(text: str, message: str) -> None:
    with pytest.raises(StrategyError, match=message):
        check_strategy(parse_strategy(text), BIG, global_batch=4)


def test_refusals_needing_other_inputs() -> None:
    kv = get_config("llama-tiny")  # 2 kv heads
    with pytest.raises(StrategyError, match=r"num_kv_heads=2.*\(up to 4: 1, 2\)"):
        check_strategy(parse_strategy("1x1: R0-3:L0-3"), kv)
    odd_vocab = get_config("llama-tiny", vocab_size=258, num_kv_heads=4)
    with pytest.raises(StrategyError, match="vocab_size=258"):
        check_strategy(parse_strategy("1x1: R0-3:L0-3"), odd_vocab)
    check_strategy(parse_strategy("1x1: R4:L0-0 R0-3:L1-2 R5:L3-3"), odd_vocab)
    tied = get_config("llama-tiny", tie_embeddings=True)
    with pytest.raises(StrategyError, match="untie"):
        check_strategy(parse_strategy("1x1: R0:L0-1 R1:L2-3"), tied)
    check_strategy(parse_strategy("1x1: R0-1:L0-3"), tied)
    with pytest.raises(StrategyError, match="seq_len=10"):
        check_strategy(
            parse_strategy("1x1: R0-3:L0-3"),
            get_config("llama-tiny", num_kv_heads=4),
            options=StrategyOptions(sequence_parallel=True),
            seq_len=10,
        )
    with pytest.raises(StrategyError, match="rank 4 .* 4 processes"):
        check_strategy(parse_strategy("1x1: R1-4:L0-3"), odd_vocab, world_size=4)
    with pytest.raises(StrategyError, match="no pipelines"):
        check_strategy(Strategy(()), kv)


def test_options() -> None:
    assert str(StrategyOptions()) == "schedule=1f1b dtype=fp32"
    assert str(StrategyOptions(zero=1, dtype="bf16")) == "zero1 schedule=1f1b dtype=bf16"
    with pytest.raises(StrategyError, match="gpipe"):
        StrategyOptions(schedule="zb")  # type: ignore[arg-type]
    with pytest.raises(StrategyError, match="bf16"):
        StrategyOptions(dtype="fp16")  # type: ignore[arg-type]


def test_values_are_hashable() -> None:
    a = Pipeline(1, 1, (Stage((0,), 0, 3),))
    assert len({Strategy((a,)), parse_strategy("1x1: R0:L0-3")}) == 1


def test_docs_examples_round_trip_and_check() -> None:
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "strategy.md").read_text()
    blocks = [b.split("```")[0].strip() for b in doc.split("```\n")[1:]]
    examples = [b for b in blocks if b and b[0].isdigit()]
    assert len(examples) == 4
    for text in examples:
        strategy = parse_strategy(text)
        assert str(strategy) == text
        config = get_config("llama-70b" if "-79" in text else "llama-32b")
        # the paper's three at its global batch 64; the repeat at 65,536 ranks at its own
        check_strategy(strategy, config, global_batch=4096 if "*(" in text else 64)
