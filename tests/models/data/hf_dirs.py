"""Tiny Hugging Face folders written with ``save_pretrained`` (tests of ``--model hf:DIR``)."""

from pathlib import Path

import torch
import transformers

SMALL = dict(
    num_hidden_layers=4, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=64, vocab_size=256, max_position_embeddings=64,
)  # fmt: skip


def llama_dir(folder: Path, *, seed: int = 7, dtype: torch.dtype = torch.float32,
              shard_size: str | None = None, **overrides: object) -> Path:  # fmt: skip
    """A random Llama (seeded by torch, not hspmd) saved at ``folder``: ``hf:{folder}``."""
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**{**SMALL, **overrides})
    model = transformers.LlamaForCausalLM(config).to(dtype)
    kwargs = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(folder, **kwargs)
    return folder
