"""Context parallelism as annotations: the ``:C<c>`` notation, its checks, the plan it
writes, and the reshards deduction finds from it (pure metadata, no processes)."""

from __future__ import annotations

import json

import pytest

from hspmd.errors import StrategyError
from hspmd.models.llama import get_config
from hspmd.plan.schema import activation_annotations, build_plan, plan_from_json, plan_to_json
from hspmd.plan.strategy import Strategy, StrategyOptions, check_strategy, parse_strategy
from hspmd.specialize.cut import deduce_pipeline
from hspmd.specialize.executable import executable_groups
from hspmd.specialize.sites import marker_params, marker_sites

KV4 = get_config("llama-tiny", num_layers=2, num_kv_heads=4)  # 4 heads, 4 KV heads
TINY = get_config("llama-tiny", num_layers=2)  # 4 heads, 2 KV heads


def test_notation_round_trips_and_names_the_groups() -> None:
    text = "1x2: R0-3:L0-1:C2; 2x1: R4:L0-0 R5-6:L1-1:C2"
    strategy = parse_strategy(text)
    assert str(strategy) == text
    a, b = strategy.pipelines[0].stages[0], strategy.pipelines[1].stages[1]
    assert (a.tp, a.cp, a.cp_groups, a.tp_groups) == (2, 2, ((0, 1), (2, 3)), ((0, 2), (1, 3)))
    assert (b.tp, b.cp, b.cp_groups) == (1, 2, ((5, 6),))
    assert str(parse_strategy("1x1: R0-1:L0-1:C1")) == "1x1: R0-1:L0-1"  # C1 is the default
    assert executable_groups(strategy) == [(0, 1), (0, 1, 2, 3), (0, 2), (1, 3), (2, 3), (5, 6)]


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("1x1: R0-3:L0-1:C3", "4 ranks, which CP degree 3 does not divide"),
        ("1x1: R0-1:L0-1:C0", "CP degree 0"),
        ("1x1: R0-1:L0-1:c2", "bad stage"),
    ],
)
def test_bad_cp_syntax_is_refused(text: str, match: str) -> None:
    with pytest.raises(StrategyError, match=match):
        parse_strategy(text)


def test_cp_checks_name_the_value_and_the_fix() -> None:
    with pytest.raises(
        StrategyError, match=r"2 heads of marker layers.0.attn.k over TP x CP = 2x2"
    ):
        check_strategy(parse_strategy("1x1: R0-3:L0-1:C2"), TINY)
    with pytest.raises(StrategyError, match="does not divide seq_len=7"):
        check_strategy(parse_strategy("1x1: R0-1:L0-1:C2"), TINY, seq_len=7)
    check_strategy(parse_strategy("1x1: R0-3:L0-1:C2"), KV4, seq_len=8)  # TP 2 x CP 2 fits
    # sequence parallelism splits the TP-4 stage without CP (4 must divide the length); the
    # TP-2 x CP-2 stage takes none (CP 2 alone divides 6)
    sp = StrategyOptions(sequence_parallel=True)
    with pytest.raises(StrategyError, match="sequence parallel splits seq_len=6 over the 4"):
        check_strategy(parse_strategy("1x1: R0-1:L0:C2 R2-5:L1"), KV4, options=sp, seq_len=6)
    check_strategy(parse_strategy("1x1: R0-3:L0-1:C2"), KV4, options=sp, seq_len=6)


def test_sequence_parallel_leaves_cp_stages_alone() -> None:
    sp = StrategyOptions(sequence_parallel=True)
    strategy = parse_strategy("1x1: R0-3:L0:C2 R4-5:L1; 1x1: R6-7:L0-1")
    specs = activation_annotations(strategy, KV4, seq_len=8, options=sp)
    got = {name: str(specs[name].annotation) for name in specs}
    assert got["layers.0.input"] == "h0: [0,1,2,3]{D:2,1:2} [6,7]{1:2}"  # CP; SP
    assert got["layers.1.input"] == "h0: [4,5]{1:2} [6,7]{1:2}"  # SP on both
    norms = marker_params(strategy, KV4, sp)
    # the SP stages' norm weights sum over TP; the CP stage's over CP (its TP copies agree)
    assert str(norms["layers.1.attn_norm.weight"].grad) == "hP: [4,5]{P:2} [6,7]{P:2}"
    assert str(norms["layers.0.attn_norm.weight"].grad) == "hP: [0,1,2,3]{D:2,P:2} [6,7]{P:2}"


def test_plan_json_carries_cp_and_round_trips() -> None:
    strategy = parse_strategy("1x2: R0-3:L0-1:C2; 2x1: R4:L0-1")
    plan = build_plan(strategy, KV4, seq_len=8, global_batch=4)
    data = json.loads(json.dumps(plan_to_json(plan)))
    assert data["strategy"] == str(strategy)
    wq, q = data["parameters"]["layers.0.attn.wq.weight"], data["reshards"]["layers.0.attn.q"]
    assert wq["annotation"] == "hD: [0,1,2,3]{0:2,D:2} [4]{}"
    assert q == {"shape": [3, 8, 4, 16], "annotation": "h0(2,1): [0,1,2,3]{2:4} [4]{}"}
    assert data["reshards"]["head_in"]["annotation"] == "h0(2,1): [0,1,2,3]{D:4} [4]{}"
    assert data["inputs"]["tokens"]["annotation"] == "h0(2,1): [0,1,2,3]{D:4} [4]{}"
    assert plan_from_json(data) == plan


def test_markers_split_the_sequence_inside_the_layers_only() -> None:
    specs = activation_annotations(parse_strategy("1x1: R0-3:L0-1:C2"), KV4, seq_len=8)
    got = {name: str(specs[name].annotation) for name in specs}
    assert got["embed"] == got["layers.1.attn_out"] == "[0,1,2,3]{D:2,1:2}"
    assert got["layers.0.attn.k"] == "[0,1,2,3]{2:4}"
    assert got["layers.0.attn.ctx"] == "[0,1,2,3]{2:2,1:2}"
    assert got["logits"] == "[0,1,2,3]{2:2,D:2}"


@pytest.mark.parametrize(
    ("text", "config", "sp"),
    [
        ("1x1: R0-1:L0-1:C2", TINY, False),
        ("1x1: R0-3:L0-1:C2", KV4, False),
        ("1x1: R0-1:L0:C2 R2-3:L1", TINY, False),  # CP differs per stage: the boundary gathers
        ("1x1: R0-3:L0:C2 R4-5:L1", KV4, True),  # SP on the TP-2 stage, CP 2 x TP 2 before it
    ],
)
def test_deduction_finds_the_ulysses_reshards(text: str, config, sp: bool) -> None:
    """Deduction on the traced model gives every marker the annotations ``marker_sites``
    derives by hand, and every parameter the gradient ``marker_params`` does."""
    strategy, options = parse_strategy(text), StrategyOptions(sequence_parallel=sp)
    pipeline = strategy.pipelines[0]
    ag = deduce_pipeline(config, pipeline, options, seq_len=8)
    for site in marker_sites(Strategy((pipeline,)), config, options, seq_len=8):
        found = ag.reshard(site.name)
        want = (site.src, site.dst, site.grad_out, site.grad_in)
        assert (found.src, found.dst, found.grad_out, found.grad_in) == want, site.name
    for name, layout in marker_params(Strategy((pipeline,)), config, options).items():
        assert ag.param_grads[name] == layout.grad, name


def test_cp_only_resolves_to_all_to_alls_and_all_reduces() -> None:
    strategy, options = parse_strategy("1x1: R0-1:L0-1:C2"), StrategyOptions()
    sites = {s.name: s for s in marker_sites(strategy, TINY, options, seq_len=8)}
    for name in ("layers.0.attn.q", "layers.0.attn.k", "layers.0.attn.ctx"):
        forward, backward = sites[name].forward_plan(), sites[name].backward_plan()
        assert forward.kinds == backward.kinds == ("all-to-all",), name
    assert sites["embed"].forward_plan().kinds == ("local",)  # whole rows, then a slice
    assert sites["head_in"].forward_plan().kinds == ("all-gather",)
    assert sites["head_in"].backward_plan().kinds == ("local",)
    params = marker_params(strategy, TINY, options)
    assert params["layers.0.attn.wq.weight"].sync_plan().kinds == ("all-reduce",)  # over CP
    assert params["head.weight"].sync_plan().kinds == ("identity",)  # saw whole rows


def test_tp_and_cp_resolve_to_all_to_alls_over_the_cp_groups() -> None:
    """``{2:t,1:c} -> {2:tc}``: the resolver refines the axes and finds the all-to-all."""
    strategy, options = parse_strategy("1x1: R0-3:L0-1:C2"), StrategyOptions()
    sites = {s.name: s for s in marker_sites(strategy, KV4, options, seq_len=8)}
    q = sites["layers.0.attn.q"].forward_plan()
    assert q.kinds == ("all-to-all",) and q.steps[0].groups == ((0, 1), (2, 3))
    assert sites["layers.0.attn.ctx"].backward_plan().kinds == ("all-to-all",)
    assert sites["layers.0.attn_out"].forward_plan().steps[0].groups == ((0, 2), (1, 3))
    assert sites["head_in"].forward_plan().kinds == ("all-gather",)
