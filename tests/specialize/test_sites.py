"""The reshard sites by marker placement (the Llama presets) agree with the plan schema and resolve as Megatron does."""

from __future__ import annotations

import pytest

from hspmd.models.llama import get_config
from hspmd.plan.schema import activation_annotations
from hspmd.plan.strategy import StrategyOptions, parse_strategy
from hspmd.specialize.sites import marker_params, marker_sites

STRATEGIES = [
    "2x2: R0-1:L0-1 R2-3:L2-3",
    "2x1: R0-1:L0-3; 1x2: R2:L0-1 R3:L2-3",
    "3x1: R0-1:L0-2 R4-5:L3-3; 1x1: R6:L0-3",
]


@pytest.mark.parametrize("text", STRATEGIES)
@pytest.mark.parametrize("sp", [False, True])
def test_site_outputs_equal_schema(text: str, sp: bool) -> None:
    config, strategy = get_config("llama-tiny"), parse_strategy(text)
    options = StrategyOptions(sequence_parallel=sp)
    schema = activation_annotations(strategy, config, seq_len=8, options=options)
    sites = marker_sites(strategy, config, options, seq_len=8)
    assert [s.name for s in sites] == list(schema)
    for site in sites:
        assert site.dst == schema[site.name].annotation, site.name
        assert site.shape == schema[site.name].shape


def test_megatron_kinds_tp2_pp2() -> None:
    config, strategy = get_config("llama-tiny"), parse_strategy(STRATEGIES[0])
    sites = {s.name: s for s in marker_sites(strategy, config, StrategyOptions(), seq_len=8)}
    kinds = {name: (s.forward_plan().kinds, s.backward_plan().kinds) for name, s in sites.items()}
    assert kinds["embed"] == (("all-reduce",), ("identity",))
    assert kinds["layers.0.attn_in"] == (("identity",), ("all-reduce",))  # Megatron f
    assert kinds["layers.0.attn_out"] == (("all-reduce",), ("identity",))  # Megatron g
    assert kinds["layers.2.input"] == (("send-recv",), ("send-recv",))


def test_grad_sync_split_all_reduce_between_tp_degrees() -> None:
    config, strategy = get_config("llama-tiny"), parse_strategy(STRATEGIES[1])
    params = marker_params(strategy, config, StrategyOptions())
    wq = params["layers.0.attn.wq.weight"]
    assert str(wq.grad) == "hP: [0,1]{0:2} [2]{}"
    assert "split-all-reduce" in wq.sync_plan().kinds
