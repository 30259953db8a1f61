"""Megatron's pairs from the captured graph (``hspmd.models.tp_structure``): a model without
``tp_rules`` gets column and row where its graph keeps a split of the features from one
linear to the next, whatever the projections are named; a fused projection cut on its
features stays whole, and so does a row by name that reads it."""

from __future__ import annotations

from pathlib import Path

import pytest

from hspmd.models.module import load_model

SOURCE = f"{Path(__file__).parent / 'data' / 'unnamed_pairs.py'}:make"


def _kinds(**kwargs: object) -> dict[str, str]:
    model = load_model(SOURCE, kwargs)
    return {n.removeprefix("layers.0."): model.param_kind(n) for n in model.parameter_shapes()
            if n.startswith("layers.0.")}  # fmt: skip


def test_unnamed_attention_and_mlp_pairs_are_column_then_row() -> None:
    kinds = _kinds()
    for name in ("query", "key", "value", "fc1"):
        assert kinds[f"{name}.weight"] == kinds[f"{name}.bias"] == "column", name
    assert kinds["o_proj.weight"] == kinds["fc2.weight"] == "row"
    assert kinds["o_proj.bias"] == kinds["fc2.bias"] == kinds["norm.weight"] == "replicate"


def test_a_projection_cut_on_its_features_stays_whole_with_its_row() -> None:
    kinds = _kinds(fused=True)
    assert kinds["qkv.weight"] == "replicate"  # split(c, dim=2): q of some heads, no k
    assert kinds["o_proj.weight"] == "replicate"  # named as a row, but its input is whole
    assert kinds["fc1.weight"] == "column" and kinds["fc2.weight"] == "row"


def test_hugging_face_gpt_neox_fused_per_head_qkv_is_column() -> None:
    pytest.importorskip("transformers")
    model = load_model(f"{Path(__file__).parent / 'data' / 'hf_models.py'}:neox")
    kind = model.param_kind
    # view (B, T, heads, 3 hd) then q | k | v per head: a contiguous split keeps whole heads
    assert kind("gpt_neox.layers.0.attention.query_key_value.weight") == "column"
    assert kind("gpt_neox.layers.0.attention.dense.weight") == "row"
    assert kind("gpt_neox.layers.0.mlp.dense_h_to_4h.bias") == "column"
    assert kind("gpt_neox.layers.0.mlp.dense_4h_to_h.weight") == "row"


@pytest.mark.multiproc
def test_gpt_neox_trains_under_tp_beside_a_one_rank_pipeline_equal_to_the_reference() -> None:
    """The pairs found in GPT-NeoX's graph (its fused per-head qkv column, dense row, the
    MLP) under TP 2 beside a one-rank pipeline: losses and parameters as the reference's."""
    pytest.importorskip("transformers")
    from hspmd.train.api import train_config
    from hspmd.train.compare import compare
    from hspmd.train.reference import run_reference
    from hspmd.train.trainer import train

    config = train_config(model=f"{Path(__file__).parent / 'data' / 'hf_models.py'}:neox",
                          strategy="2x1: R0-1:L0-1; 1x2: R2:L0-1", global_batch=4,
                          seq_len=16, steps=2)  # fmt: skip
    report = compare(train(config), run_reference(config), config=config)
    assert report.ok, report
