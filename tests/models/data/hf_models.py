"""Hugging Face causal LMs as their authors ship them, built from a config (random init,
no download): the factories the tests name with --model FILE.py:FACTORY."""

import transformers

SMALL = dict(
    num_hidden_layers=4, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=64, vocab_size=256, max_position_embeddings=64,
)  # fmt: skip


def llama(**overrides):
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**SMALL, **overrides}))


def mistral(**overrides):
    return transformers.MistralForCausalLM(transformers.MistralConfig(**{**SMALL, **overrides}))


def qwen2(**overrides):
    config = {**SMALL, "tie_word_embeddings": False, **overrides}
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**config))


def gpt2(**overrides):
    config = dict(
        n_layer=4, n_embd=32, n_head=4, vocab_size=256, n_positions=64, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**config, **overrides}))


def phi(**overrides):
    """Phi: biases on q, k and v, RoPE on half of each head's dimensions, sdpa."""
    config = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=64, attn_implementation="sdpa",
    )  # fmt: skip
    return transformers.PhiForCausalLM(transformers.PhiConfig(**{**config, **overrides}))


def neox(**overrides):
    """GPT-NeoX: one fused ``query_key_value``, viewed per head as ``q | k | v``."""
    config = dict(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
        vocab_size=256, max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    return transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**{**config, **overrides}))


def mixtral(**overrides):
    """Mixtral: a top-2 router over 4 experts held as 3D parameters (``MixtralExperts``)."""
    config = {**SMALL, "num_hidden_layers": 1, "num_local_experts": 4, **overrides}
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(**config))
