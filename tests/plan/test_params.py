"""Parameter and optimizer-state annotations under a strategy."""

from __future__ import annotations

import math
import time

import pytest

from hspmd.errors import StrategyError
from hspmd.models import get_config, parameter_shapes
from hspmd.plan.params import parameter_annotations, state_annotations
from hspmd.plan.strategy import parse_strategy

C2 = (
    "33x1: R0-3:L0-14 R4-7:L15-29 R8-11:L30-44 R12-15:L45-59; "
    "31x1: R16-19:L0-15 R20-23:L16-31 R24-27:L32-47 R28-29:L48-55 R30:L56-59"
)
T9_32B_48 = "; ".join(
    f"16x1: R{16 + 8 * i}-{19 + 8 * i}:L0-10 R{20 + 8 * i}-{23 + 8 * i}:L11-21 "
    f"R{4 * i}-{4 * i + 3}:L22-59"
    for i in range(4)
)
BIG = get_config("llama-32b")
TINY = get_config("llama-tiny", num_kv_heads=4)


def test_c2_annotations() -> None:
    specs = parameter_annotations(parse_strategy(C2), BIG)
    assert list(specs) == list(parameter_shapes(BIG))
    text = {name: str(spec.annotation) for name, spec in specs.items()}
    assert text["layers.50.attn.wq.weight"] == "hD: [12,13,14,15]{0:4} [28,29]{0:2}"
    assert text["layers.50.mlp.w_down.weight"] == "hD: [12,13,14,15]{1:4} [28,29]{1:2}"
    assert text["layers.15.attn_norm.weight"] == "hD: [4,5,6,7]{D:4} [16,17,18,19]{D:4}"
    assert text["embed.weight"] == "hD: [0,1,2,3]{0:4} [16,17,18,19]{0:4}"
    assert text["head.weight"] == "hD: [12,13,14,15]{0:4} [30]{}"
    assert text["norm.weight"] == "hD: [12,13,14,15]{D:4} [30]{}"
    assert specs["layers.0.attn.wk.weight"].shape == (6656, 6656)


def test_one_pipeline_is_one_subgroup() -> None:
    specs = parameter_annotations(parse_strategy("2x1: R0-1:L0-1 R2-3:L2-3"), TINY)
    assert str(specs["embed.weight"]) == "embed.weight [256, 64] [0,1]{0:2}"
    assert str(specs["layers.3.mlp.w_up.weight"].annotation) == "[2,3]{0:2}"
    assert str(specs["head.weight"].annotation) == "[2,3]{0:2}"
    assert state_annotations(parse_strategy("1x1: R0-1:L0-3"), TINY, zero1=True) == (
        parameter_annotations(parse_strategy("1x1: R0-1:L0-3"), TINY)
    )


def test_kinds() -> None:
    config = get_config("llama-tiny")
    assert config.param_kind("layers.3.attn.wv.weight") == "column"
    assert config.param_kind("layers.3.mlp.w_down.weight") == "row"
    assert config.param_kind("head.weight") == "vocab"
    assert config.param_kind("layers.0.mlp_norm.weight") == "replicate"
    assert config.param_layer("head.weight") == config.num_layers - 1
    assert config.param_layer("layers.2.attn.wq.weight") == 2


def test_tied_needs_one_stage() -> None:
    tied = get_config("llama-tiny", tie_embeddings=True)
    with pytest.raises(StrategyError, match="untie"):
        parameter_annotations(parse_strategy("1x1: R0:L0-1 R1:L2-3"), tied)
    specs = parameter_annotations(parse_strategy("1x1: R0-1:L0-3; 1x1: R2:L0-3"), tied)
    assert "head.weight" not in specs
    assert str(specs["embed.weight"].annotation) == "hD: [0,1]{0:2} [2]{}"


def test_zero1_states_c2() -> None:
    states = state_annotations(parse_strategy(C2), BIG, zero1=True)
    assert str(states["layers.50.attn.wq.weight"].annotation) == (
        "h1: [12,13,14,15]{0:4} [28,29]{0:2}"
    )
    assert str(states["layers.50.attn.wo.weight"].annotation) == (
        "h0: [12,13,14,15]{1:4} [28,29]{1:2}"
    )
    assert str(states["norm.weight"].annotation) == "h0: [12,13,14,15]{D:4} [30]{}"


@pytest.mark.parametrize(
    "text",
    [
        "1x1: R0-1:L0-3; 1x1: R2:L0-3",
        "1x1: R0-3:L0-1 R4:L2-3; 2x1: R5:L0-0 R6-7:L1-3; 1x1: R8-9:L0-3",
        "1x1: R0,1:L0-3; 1x1: R2,3:L0-3; 1x1: R4,5:L0-3",  # 3 parts of 64: uneven (22,21,21)
    ],
)
def test_zero1_state_is_a_slice_of_the_own_shard(text: str) -> None:
    """Each rank's state lies inside its compute shard, and the states cover the tensor."""
    strategy = parse_strategy(text)
    params = parameter_annotations(strategy, TINY)
    states = state_annotations(strategy, TINY, zero1=True)
    for name, spec in params.items():
        compute = spec.annotation.pieces(spec.shape)
        state = states[name].annotation.pieces(spec.shape)
        assert state.keys() == compute.keys()
        for rank, piece in state.items():
            inner, outer = piece.region, compute[rank].region
            assert all(a >= c and b <= d for (a, b), (c, d) in zip(inner, outer, strict=True))
        distinct = {p.region for p in state.values()}
        volume = sum(math.prod(b - a for a, b in region) for region in distinct)
        assert volume == math.prod(spec.shape), name


def test_zero1_uneven_text() -> None:
    strategy = parse_strategy("1x1: R0,1:L0-3; 1x1: R2,3:L0-3; 1x1: R4,5:L0-3")
    states = state_annotations(strategy, TINY, zero1=True)
    assert str(states["norm.weight"].annotation) == "h0(22,21,21): [0,1]{D:2} [2,3]{D:2} [4,5]{D:2}"


def test_fast_on_paper_scale() -> None:
    strategy = parse_strategy(T9_32B_48)
    assert strategy.num_ranks == 48
    start = time.perf_counter()
    params = parameter_annotations(strategy, BIG)
    states = state_annotations(strategy, BIG, zero1=True)
    elapsed = time.perf_counter() - start
    assert len(params) == len(states) == 60 * 9 + 3
    assert elapsed < 5.0, elapsed  # a guard against blow-ups, not a target
