"""The vocab-parallel cross-entropy equals ``F.cross_entropy`` of the gathered logits.

Two gloo processes hold classes 0-3 and 4-9 of 10 (uneven on purpose), float64, with one
ignored token; mean, sum and none reductions; loss and logits gradient both. Forward
issues exactly three all-reduces of one number per token; backward issues nothing.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from hspmd.runtime import World, count_comm, launch
from hspmd.runtime.vocab_loss import vocab_parallel_cross_entropy
from hspmd.specialize.loss import VocabShard

pytestmark = pytest.mark.multiproc

SPLIT = {0: (0, 4), 1: (4, 10)}


def compared(world: World) -> dict[str, Any]:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    full = torch.randn(6, 10, generator=g, dtype=torch.float64)
    targets = torch.randint(0, 10, (6,), generator=g)
    targets[2] = -100
    out: dict[str, Any] = {}
    for reduction in ("mean", "sum", "none"):
        ref = full.clone().requires_grad_()
        ref_loss = F.cross_entropy(ref, targets, reduction=reduction)
        grad = torch.arange(6.0, dtype=torch.float64) if reduction == "none" else None
        ref_loss.backward(grad if grad is not None else torch.tensor(1.5, dtype=torch.float64))
        lo, hi = SPLIT[world.rank]
        x = full[:, lo:hi].clone().requires_grad_()
        shard = VocabShard(group=(0, 1), vocab_start=lo, vocab_size=10, reduction=reduction)
        with count_comm(world) as forward:
            loss = vocab_parallel_cross_entropy(x, targets, shard, world=world)
        with count_comm(world) as backward:
            loss.backward(grad if grad is not None else torch.tensor(1.5, dtype=torch.float64))
        assert x.grad is not None and ref.grad is not None
        out[reduction] = (
            float((loss - ref_loss).abs().max()),
            float((x.grad - ref.grad[:, lo:hi]).abs().max()),
            forward.counts(),
            forward.nbytes(),
            backward.counts(),
        )
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return launch(compared, 2, timeout_s=60)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_equals_cross_entropy_of_the_gathered_logits(
    results: list[dict[str, Any]], reduction: str
) -> None:
    for per_rank in results:
        loss_err, grad_err, *_ = per_rank[reduction]
        assert loss_err < 1e-12 and grad_err < 1e-12


def test_three_small_all_reduces_forward_none_backward(results: list[dict[str, Any]]) -> None:
    for per_rank in results:
        for reduction in ("mean", "sum", "none"):
            _, _, forward, nbytes, backward = per_rank[reduction]
            assert forward == {"all_reduce": 3}
            assert nbytes == 3 * 6 * 8  # one float64 per token, three times
            assert backward == {}
