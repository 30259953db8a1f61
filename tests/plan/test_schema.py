"""Plans: activation annotations, the whole plan, and the JSON round trip with checks."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest

from hspmd.errors import StrategyError
from hspmd.models import get_config
from hspmd.plan.identity import ModelIdentity
from hspmd.plan.schema import (
    FORMAT,
    PLAN_SCHEMA,
    SECTIONS,
    activation_annotations,
    build_plan,
    input_annotations,
    marker_names,
    plan_from_json,
    plan_to_json,
)
from hspmd.plan.strategy import StrategyOptions, parse_strategy

TINY = get_config("llama-tiny", num_layers=2, num_kv_heads=4)
HETERO = parse_strategy("1x2: R0-1:L0-1; 2x1: R2:L0-0 R3:L1-1")


def test_marker_names_match_the_traced_model() -> None:
    import torch.fx

    from hspmd.markers import is_reshard_node
    from hspmd.models import Llama

    traced = torch.fx.symbolic_trace(Llama(TINY))
    traced_names = tuple(n.args[1] for n in traced.graph.nodes if is_reshard_node(n))
    assert traced_names == marker_names(TINY)
    assert set(activation_annotations(HETERO, TINY, seq_len=8)) == set(traced_names)


def test_activations_tensor_parallel() -> None:
    acts = activation_annotations(HETERO, TINY, seq_len=8)
    text = {name: str(spec.annotation) for name, spec in acts.items()}
    assert text["embed"] == "h0(2,1): [0,1]{D:2} [2]{}"
    assert text["layers.1.input"] == "h0(2,1): [0,1]{D:2} [3]{}"
    assert text["layers.0.attn_out"] == "h0(2,1): [0,1]{D:2} [2]{}"
    assert text["logits"] == "h0(2,1): [0,1]{2:2} [3]{}"
    assert acts["logits"].shape == (3, 8, 256) and acts["head_in"].shape == (3, 8, 64)


def test_activations_sequence_parallel_and_one_pipeline() -> None:
    strategy = parse_strategy("2x2: R0-1:L0-0 R2-3:L1-1")
    options = StrategyOptions(sequence_parallel=True)
    acts = activation_annotations(strategy, TINY, seq_len=8, options=options)
    text = {name: str(spec.annotation) for name, spec in acts.items()}
    assert text["embed"] == "[0,1]{1:2}"
    assert text["layers.0.input"] == "[0,1]{1:2}"
    assert text["layers.0.attn_in"] == "[0,1]{D:2}"
    assert text["layers.0.mlp_out"] == "[0,1]{1:2}"
    assert text["layers.1.input"] == "[2,3]{1:2}"
    assert text["head_in"] == "[2,3]{D:2}"
    with pytest.raises(StrategyError, match="seq_len=7"):
        activation_annotations(strategy, TINY, seq_len=7, options=options)


def test_even_micro_batches_give_plain_h0() -> None:
    strategy = parse_strategy("4x2: R0:L0-1; 2x2: R1-2:L0-1")
    inputs = input_annotations(strategy, TINY, seq_len=8)
    assert str(inputs["tokens"]) == "tokens [4, 8] h0: [0]{} [1,2]{D:2}"
    pieces = inputs["tokens"].annotation.pieces((4, 8))
    assert pieces[0].region == ((0, 2), (0, 8)) and pieces[2].region == ((2, 4), (0, 8))


def test_json_round_trip() -> None:
    plan = build_plan(
        HETERO, TINY, seq_len=8, options=StrategyOptions(zero=1, dtype="bf16"), global_batch=4
    )
    plan = dataclasses.replace(plan, model=ModelIdentity.of(TINY, source="llama-tiny"))
    data = plan_to_json(plan)
    assert data["format"] == FORMAT and set(data) == set(PLAN_SCHEMA["properties"])
    text = json.dumps(data)
    assert plan_from_json(text) == plan
    assert plan_to_json(plan_from_json(text)) == data
    assert plan.ranks == (0, 1, 2, 3)
    assert str(plan.table("optimizer_states")["layers.0.attn.wq.weight"].annotation) == (
        "h1: [0,1]{0:2} [2]{}"
    )


def test_json_accepts_dict_annotations() -> None:
    plan = build_plan(HETERO, TINY, seq_len=8)
    data = plan_to_json(plan)
    spec = plan.table("parameters")["embed.weight"]
    data["parameters"]["embed.weight"]["annotation"] = spec.annotation.to_json()
    assert plan_from_json(data) == plan


def _valid() -> dict:
    return plan_to_json(build_plan(HETERO, TINY, seq_len=8))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(format="x"), "an annotation plan is 'hspmd.plan/1'"),
        (lambda d: d.update(extra=1), r"unknown plan keys \['extra'\]"),
        (lambda d: d.pop("reshards"), "lacks section"),
        (lambda d: d["optimizer_states"].pop("norm.weight"), r"missing \['norm.weight'\]"),
        (lambda d: d["reshards"]["embed"].update(shape=[3, 0, 64]), "positive ints"),
        (
            lambda d: d["reshards"]["embed"].update(annotation="[0,1]{0:3}"),
            r"reshards\['embed'\]: DS \{0:3\} has 3 devices",
        ),
        (
            lambda d: d["parameters"]["embed.weight"].update(shape=[255, 64]),
            r"parameters\['embed.weight'\]: .*does not divide",
        ),
        (lambda d: d["inputs"].update(tokens=[1]), "must be"),
        (lambda d: d["inputs"]["tokens"].update(annotation=5), "text form"),
        (lambda d: d.update(options={"zero2": True}), "bad plan options"),
    ],
)
def test_json_errors(edit, message: str) -> None:  # type: ignore[no-untyped-def]
    data = _valid()
    edit(data)
    with pytest.raises(StrategyError, match=message):
        plan_from_json(data)


def test_not_json() -> None:
    with pytest.raises(StrategyError, match="not valid JSON"):
        plan_from_json("{")
    with pytest.raises(StrategyError, match="JSON object"):
        plan_from_json("[]")


def test_sections_and_table() -> None:
    plan = build_plan(HETERO, TINY, seq_len=8)
    assert [len(plan.table(s)) for s in SECTIONS] == [2, 21, 21, len(marker_names(TINY))]
    with pytest.raises(StrategyError, match="no plan section"):
        plan.table("params")


def test_paper_scale_plan_is_fast() -> None:
    text = "; ".join(
        f"16x1: R{16 + 8 * i}-{19 + 8 * i}:L0-10 R{20 + 8 * i}-{23 + 8 * i}:L11-21 "
        f"R{4 * i}-{4 * i + 3}:L22-59"
        for i in range(4)
    )
    start = time.perf_counter()
    plan = build_plan(
        parse_strategy(text),
        get_config("llama-32b"),
        seq_len=4096,
        options=StrategyOptions(zero=1),
        global_batch=64,
    )
    plan_from_json(json.dumps(plan_to_json(plan)))
    assert time.perf_counter() - start < 10.0  # a guard against blow-ups, not a target
    assert len(plan.reshards) == 60 * 9 + 3 and len(plan.ranks) == 48


def test_docs_example_is_what_the_code_writes() -> None:
    from pathlib import Path

    doc = Path(__file__).parents[2] / "docs" / "plan-schema.md"
    example = doc.read_text().split("```json\n")[1].split("```")[0]
    plan = build_plan(
        parse_strategy("1x2: R0-1:L0-0; 2x1: R2:L0-0"),
        get_config("llama-tiny", num_layers=1),
        seq_len=16,
        options=StrategyOptions(zero=1),
        global_batch=4,
    )
    assert json.loads(example) == plan_to_json(plan)
    assert plan_from_json(example) == plan
