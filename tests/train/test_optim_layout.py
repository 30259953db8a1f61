"""Unit tests without processes: per-slice AdamW, rank roles, refusing bad strategies."""

from __future__ import annotations

import pytest
import torch

from hspmd.errors import StrategyError
from hspmd.plan.strategy import parse_strategy
from hspmd.train.api import train_config
from hspmd.train.config import AdamConfig, TrainError
from hspmd.train.layout import Layout
from hspmd.train.optim import Adam
from hspmd.train.trainer import check_config


def test_adam_equals_torch_adam_bitwise_on_every_slice() -> None:
    torch.manual_seed(0)
    full = torch.randn(6, 5)
    ours_pieces = [full[:4].clone().requires_grad_(), full[4:].clone().requires_grad_()]
    theirs = full.clone().requires_grad_()
    config = AdamConfig(lr=1e-2, weight_decay=0.1)
    ours = Adam(ours_pieces, config)
    torch_adam = torch.optim.AdamW(  # decoupled weight decay
        [theirs], lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, foreach=False
    )
    for _ in range(4):
        grad = torch.randn(6, 5)
        ours_pieces[0].grad, ours_pieces[1].grad = grad[:4].clone(), grad[4:].clone()
        theirs.grad = grad.clone()
        ours.step()
        torch_adam.step()
    assert torch.equal(torch.cat([p.detach() for p in ours_pieces]), theirs.detach())


def test_roles_of_a_heterogeneous_strategy() -> None:
    layout = Layout(parse_strategy("2x2: R0:L0-1 R1:L2-3; 4x1: R2:L0-3"), num_layers=4)
    first, last, other = layout.role(0), layout.role(1), layout.role(2)
    assert first is not None and last is not None and other is not None
    assert (first.is_first, first.is_last, first.next_ranks) == (True, False, (1,))
    assert (last.stage, last.prev_ranks, last.layers) == (1, (0,), (2, 3))
    assert (other.row_offset, other.micro_batches, other.micro_batch_size) == (4, 4, 1)
    assert layout.role(3) is None
    assert layout.holders(2) == (1, 2)


@pytest.mark.parametrize(
    ("strategy", "error", "words"),
    [
        ("2x2: R0:L0-1 R1:L3-3; 4x1: R2:L0-3", StrategyError, "gap"),
        ("2x2: R0:L0-3; 3x1: R1:L0-3", StrategyError, "global batch is 8"),
        ("8x1: R0:L0-5", StrategyError, "layer"),
        ("8x1: R0,1,2:L0-3", StrategyError, "divide"),
        ("4x1: R0:L0-3; 4x1: R0:L0-3", StrategyError, "rank"),
        ("8x1: R1:L0-3", TrainError, "without gaps"),
        ("8x1 R0:L0-3", StrategyError, "COUNTxSIZE"),
    ],
)
def test_bad_strategies_are_refused_before_any_process(
    strategy: str, error: type[Exception], words: str
) -> None:
    with pytest.raises(error, match=words):
        check_config(train_config(strategy=strategy, global_batch=8, seq_len=16))


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(TrainError, match="seq_len"):
        train_config(seq_len=0)
    with pytest.raises(TrainError, match="metadata-only"):
        train_config(model="llama-32b")


def test_zero1_shards_states_over_the_pipelines() -> None:
    from hspmd.models.llama import get_config
    from hspmd.plan.strategy import parse_strategy
    from hspmd.train.zero import zero1_plan

    items = zero1_plan(parse_strategy("2x1: R0:L0-3; 2x1: R1:L0-3"), get_config("llama-tiny"))
    item = items["layers.0.mlp.w_up.weight"]  # (128, 64): state split in two over rank 0, 1
    # (split-)reduce-scatter and (split-)all-gather: resolution picks the variant
    assert len(item.reduce.kinds) == 1 and item.reduce.kinds[0].endswith("reduce-scatter")
    assert len(item.gather.kinds) == 1 and item.gather.kinds[0].endswith("all-gather")
    assert item.reduce.dst.piece(1, item.shape).shape == (128, 32)
