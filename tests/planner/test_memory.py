"""The memory model's activation count against what autograd really keeps in a block."""

from __future__ import annotations

import pytest
import torch

from hspmd.models.config import get_config
from hspmd.models.llama import Block, rope_tables
from hspmd.models.llama_cost import LlamaCost


def _saved_bytes_per_token(dtype: torch.dtype, tokens: int) -> float:
    """Bytes of the distinct storages one Llama block saves for backward (parameters
    excluded), per token."""
    config = get_config("llama-tiny", hidden_size=64, intermediate_size=96, num_heads=8)
    block = Block(config, 0).to(dtype)
    x = torch.randn(1, tokens, config.hidden_size, dtype=dtype, requires_grad=True)
    cos, sin = (t[:tokens].to(dtype).clone() for t in rope_tables(config))
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x, cos, sin)
    return sum(kept.values()) / tokens


@pytest.mark.parametrize("dtype, elt", [(torch.bfloat16, 2), (torch.float32, 4)])
def test_llama_layer_bytes_count_what_autograd_keeps(dtype: torch.dtype, elt: int) -> None:
    config = get_config("llama-tiny", hidden_size=64, intermediate_size=96, num_heads=8)
    formula = LlamaCost(config).token_bytes(1, elt=elt, sequence_parallel=False)
    measured = _saved_bytes_per_token(dtype, tokens=32)
    # beyond the formula: the RoPE tables (cos, sin: 2 x head_dim per position)
    small = 2 * config.head_dim * elt
    assert formula <= measured <= formula + small


def test_sequence_parallel_splits_the_norms_and_the_matmul_inputs() -> None:
    config = get_config("llama-70b")
    H = config.hidden_size
    whole = LlamaCost(config).token_bytes(8, elt=2, sequence_parallel=False)
    split = LlamaCost(config).token_bytes(8, elt=2, sequence_parallel=True)
    # the norms run on the shard; the matmuls keep their inputs' shards (gathered again)
    norms, inputs = 2 * (2 * H + 4), 2 * 2 * H
    assert whole - split == pytest.approx((norms + inputs) * (1 - 1 / 8))
    # Korthikanti's 34 H / t bytes (fp16, a GELU MLP) within a few percent
    assert 0.9 * 34 * H / 8 < split < 1.1 * 34 * H / 8
