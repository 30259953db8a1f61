"""The Llama model: equal to transformers' LlamaForCausalLM, traceable, plan-free init."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
import torch.fx
import torch.nn.functional as F

import hspmd
from hspmd.markers import MARKER_TARGET, is_reshard_node, reshard
from hspmd.models import (
    PRESETS,
    Llama,
    LlamaConfig,
    ModelConfigError,
    get_config,
    init_parameter,
    init_weights,
    parameter_shapes,
)


def _hf_model(config: LlamaConfig, ours: Llama) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    hf_config = transformers.LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        max_position_embeddings=config.max_seq_len,
        rms_norm_eps=config.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        tie_word_embeddings=config.tie_embeddings,
        attention_bias=False,
        mlp_bias=False,
    )
    hf_config._attn_implementation = "eager"
    hf = transformers.LlamaForCausalLM(hf_config).eval()
    names = {
        "embed.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight",
        "head.weight": "lm_head.weight",
    }
    parts = {
        "attn_norm": "input_layernorm",
        "mlp_norm": "post_attention_layernorm",
        "attn.wq": "self_attn.q_proj",
        "attn.wk": "self_attn.k_proj",
        "attn.wv": "self_attn.v_proj",
        "attn.wo": "self_attn.o_proj",
        "mlp.w_gate": "mlp.gate_proj",
        "mlp.w_up": "mlp.up_proj",
        "mlp.w_down": "mlp.down_proj",
    }
    for i in range(config.num_layers):
        for ours_part, hf_part in parts.items():
            names[f"layers.{i}.{ours_part}.weight"] = f"model.layers.{i}.{hf_part}.weight"
    hf_params = dict(hf.named_parameters())
    with torch.no_grad():
        for name, param in ours.named_parameters():
            hf_params[names[name]].copy_(param)
    return hf


@pytest.mark.parametrize("tie", [False, True])
def test_loss_equals_transformers(tie: bool) -> None:
    config = dataclasses.replace(PRESETS["llama-tiny"], num_layers=2, tie_embeddings=tie)
    model = Llama(config, seed=3)
    hf = _hf_model(config, model)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (2, 24), generator=generator)
    targets = torch.randint(0, config.vocab_size, (2, 24), generator=generator)
    with torch.no_grad():
        ours = model(tokens, targets)
        hf_logits = hf(input_ids=tokens).logits
        theirs = F.cross_entropy(hf_logits.flatten(0, 1).float(), targets.flatten())
        torch.testing.assert_close(model.logits(tokens), hf_logits, rtol=1e-5, atol=1e-5)
    assert abs(ours.item() - theirs.item()) <= 1e-5 * abs(theirs.item())


def test_trace_shows_markers_in_order() -> None:
    config = get_config("llama-tiny", num_layers=2)
    model = Llama(config)
    traced = torch.fx.symbolic_trace(model)
    markers = [n for n in traced.graph.nodes if is_reshard_node(n)]
    names = [n.args[1] for n in markers]
    expected = ["embed"]
    for i in range(2):
        expected += [
            f"layers.{i}.{p}"
            for p in (
                "input",
                "attn_in",
                "attn.q",
                "attn.k",
                "attn.v",
                "attn.ctx",
                "attn_out",
                "mlp_in",
                "mlp_out",
            )  # fmt: skip
        ]
    assert names == [*expected, "head_in", "logits"]
    assert MARKER_TARGET in traced.code.replace("hspmd_markers_reshard", MARKER_TARGET)
    assert torch.fx.node._get_qualified_name(markers[0].target) == MARKER_TARGET
    tokens = torch.randint(0, 256, (2, 8))
    torch.testing.assert_close(traced(tokens, tokens), model(tokens, tokens), rtol=0, atol=0)


def test_reshard_is_identity_and_exported() -> None:
    x = torch.randn(3)
    assert reshard(x, "a") is x
    assert hspmd.reshard is reshard


def test_importing_hspmd_does_not_import_torch_for_pure_modules() -> None:
    import subprocess

    code = "import hspmd, hspmd.annotation, sys; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_parameter_shapes_match_model() -> None:
    for tie in (False, True):
        config = get_config("llama-tiny", tie_embeddings=tie)
        model = Llama(config)
        actual = {name: tuple(p.shape) for name, p in model.named_parameters()}
        assert list(actual.items()) == list(parameter_shapes(config).items())


def test_init_is_deterministic_and_plan_free() -> None:
    config = get_config("llama-tiny")
    a, b = Llama(config, seed=7), init_weights(Llama(config, seed=1), 7)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name
        assert torch.equal(pa, init_parameter(name, config, seed=7))
    c = Llama(config, seed=8)
    assert not torch.equal(a.embed.weight, c.embed.weight)
    assert torch.all(a.norm.weight == 1)


def test_big_presets_are_metadata_only() -> None:
    config = PRESETS["llama-32b"]
    shapes = parameter_shapes(config)
    total = sum(torch.Size(s).numel() for s in shapes.values())
    assert 32e9 < total < 33.5e9
    total_70 = sum(torch.Size(s).numel() for s in parameter_shapes(PRESETS["llama-70b"]).values())
    assert 68e9 < total_70 < 71e9
    with pytest.raises(ModelConfigError, match="meta"):
        Llama(config)
    with torch.device("meta"):
        model = Llama(get_config("llama-32b", num_layers=2))
    traced = torch.fx.symbolic_trace(model)
    assert sum(is_reshard_node(n) for n in traced.graph.nodes) == 1 + 2 * 9 + 2


def test_bad_configs() -> None:
    with pytest.raises(ModelConfigError, match="num_kv_heads=3"):
        LlamaConfig(num_heads=4, num_kv_heads=3)
    with pytest.raises(ModelConfigError, match="unknown model 'llama-huge'"):
        get_config("llama-huge")
    with pytest.raises(ModelConfigError, match="no parameter"):
        init_parameter("head.weight", get_config("llama-tiny", tie_embeddings=True), seed=0)
