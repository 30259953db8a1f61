"""The dispatcher (hspmd.plan.dispatch): every document placed once, rows within max_len,
micro-batches non-empty, packed lengths multiples, pipelines balanced; clear refusals."""

from __future__ import annotations

import doctest
import random

import pytest

import hspmd.plan.dispatch
from hspmd.plan.dispatch import DispatchError, attention_cost, balanced


def long_tailed(count: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [min(256, max(1, int(rng.paretovariate(1.2) * 8))) for _ in range(count)]


def rows_of(a: object, lengths: list[int]) -> dict[tuple[int, int, int], int]:
    out: dict[tuple[int, int, int], int] = {}
    for slot, n in zip(a.slots, lengths, strict=True):  # type: ignore[attr-defined]
        out[slot] = out.get(slot, 0) + n
    return out


@pytest.mark.parametrize("seed", range(5))
def test_assignment_is_valid_and_balanced(seed: int) -> None:
    lengths = long_tailed(60, seed)
    slots = [(2, 2), (4, 1)]
    a = balanced(lengths, slots=slots, max_len=1024, multiple=4)
    rows = rows_of(a, lengths)
    for (p, m, r), used in rows.items():
        assert m < slots[p][0] and r < slots[p][1]
        assert used <= 1024
        assert a.lengths[p][m] >= used and a.lengths[p][m] % 4 == 0
    assert all(any((p, m, r) in rows for r in range(slots[p][1]))
               for p in range(2) for m in range(slots[p][0]))  # fmt: skip
    assert sum(a.tokens_per_pipeline) == sum(lengths)
    assert sum(a.sequences_per_pipeline) == len(lengths)
    # longest-first greedy: the pipelines differ by at most the largest document
    spread = max(a.tokens_per_pipeline) - min(a.tokens_per_pipeline)
    assert spread <= max(lengths)


def test_speeds_and_cost_shift_the_load() -> None:
    lengths = [100] * 12
    even = balanced(lengths, slots=[(2, 1), (2, 1)], max_len=1000)
    fast = balanced(lengths, slots=[(2, 1), (2, 1)], max_len=1000, speeds=[3.0, 1.0])
    assert even.tokens_per_pipeline == (600, 600)
    assert fast.tokens_per_pipeline == (900, 300)
    mixed = [200] + [10] * 40
    by_tokens = balanced(mixed, slots=[(1, 1), (1, 1)], max_len=400)
    by_cost = balanced(mixed, slots=[(1, 1), (1, 1)], max_len=400,
                       cost=lambda n: attention_cost(n, hidden=4))  # fmt: skip
    assert by_tokens.tokens_per_pipeline == (300, 300)
    assert by_cost.tokens_per_pipeline == (200, 400)  # the long one costs more than its tokens


def test_refusals() -> None:
    with pytest.raises(DispatchError, match="fits no row"):
        balanced([60, 60, 60], slots=[(1, 1), (1, 1)], max_len=100)
    with pytest.raises(DispatchError, match="empty"):
        balanced([5], slots=[(2, 1)], max_len=100)
    with pytest.raises(DispatchError, match="multiple of 4"):
        balanced([5], slots=[(1, 1)], max_len=30, multiple=4)


def test_doctests() -> None:
    assert doctest.testmod(hspmd.plan.dispatch).failed == 0


def test_every_micro_batch_gets_a_document() -> None:
    # five documents, five micro-batches: the cheap pipeline must not take two
    a = balanced([100, 90, 10, 5, 3], slots=[(2, 2), (3, 1)], max_len=128)
    assert sorted({(p, m) for p, m, _ in a.slots}) == [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)]
