"""What uneven ZeRO shards cost: the parts the replicas hold, and the exchange they slow.

``--zero-shares`` gives each pipeline a weight; the replicas of a parameter (one stage per
pipeline) hold parts of its shard in proportion (``StrategyOptions.zero_shares``). The
runtime moves shards point to point (split-reduce-scatter, split-all-gather;
docs/zero.md): in an all-gather, replica ``i`` holding part ``a_i`` of the tensor sends
it to each of the other ``n - 1`` replicas and receives the ``1 - a_i`` it lacks; a
reduce-scatter is the same traffic reversed. The slowest replica sets the pace, so against
even parts (``(n - 1) / n`` each way on every replica, what a ring moves) an exchange takes

    max_i max(a_i (n - 1), 1 - a_i) / ((n - 1) / n)

times as long: 1 for even parts, 1.4 for (0.7, 0.3), 1.6 for (0.4, 0.2, 0.2, 0.2).
Adam runs on the part a rank holds: ``a_i`` of the whole, not ``1 / n``.

>>> exchange_factor((0.7, 0.3)), exchange_factor((0.25,) * 4)
(1.4, 1.0)
>>> shard_parts((3, 1, 1, 1))
(0.5, 0.16666666666666666, 0.16666666666666666, 0.16666666666666666)
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["exchange_factor", "shard_parts"]


def shard_parts(shares: Sequence[float]) -> tuple[float, ...]:
    """Each pipeline's part of every shard: its weight over the sum."""
    total = float(sum(shares))
    return tuple(w / total for w in shares)


def exchange_factor(parts: Sequence[float]) -> float:
    """How much longer a gather or reduce between replicas holding ``parts`` (summing to
    1) takes than between even parts (module docstring); 1 for fewer than two parts."""
    n = len(parts)
    if n < 2:
        return 1.0
    slowest = max(max(a * (n - 1), 1 - a) for a in parts)
    return round(slowest / ((n - 1) / n), 12)
