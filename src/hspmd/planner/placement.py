"""Placing a length strategy's pipelines on the alive ranks of a heterogeneous cluster.

The length DP (``hspmd.planner.combined``) decides, per GPU kind, how many pipelines of
which ``TP x CP x PP`` shape serve which lengths; this module gives each of them concrete
ranks (cluster ids):

1. **Homes first** (the warm start): a pipeline of the same kind, shape and recompute as
   one of the previous strategy whose ranks are all alive and free takes exactly those
   ranks, so its states do not move;
2. **Best fit** for the rest: each stage (``tp x cp`` ranks, one node) goes to the node of
   its kind with the fewest free ranks that still hold it.

    >>> from hspmd.planner.length_model import PipeConfig
    >>> free = {"cpu": {0: [0, 1], 1: [2, 3]}}
    >>> place([("cpu", PipeConfig(2, 1)), ("cpu", PipeConfig(1, 2))], free, homes=())
    [((0, 1),), ((2,), (3,))]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hspmd.planner.length_model import PipeConfig

__all__ = ["Home", "place"]

Home = tuple[str, PipeConfig, tuple[tuple[int, ...], ...]]
"""A previous pipeline: its kind, its shape and its stages' ranks."""


def place(
    pipes: Sequence[tuple[str, PipeConfig]],
    free: Mapping[str, Mapping[int, Sequence[int]]],
    *,
    homes: Sequence[Home],
) -> list[tuple[tuple[int, ...], ...]] | None:
    """Per pipeline (``(kind, shape)``), its stages' ranks; ``free[kind][node]`` lists the
    alive ranks of each node; None when a stage finds no node with room."""
    left = {
        kind: {node: list(ranks) for node, ranks in nodes.items()} for kind, nodes in free.items()
    }
    taken = {r for nodes in left.values() for ranks in nodes.values() for r in ranks}
    out: list[tuple[tuple[int, ...], ...] | None] = [None] * len(pipes)
    used_homes: set[int] = set()
    for i, (kind, shape) in enumerate(pipes):  # homes: the same pipeline where it was
        for h, (home_kind, home_shape, stages) in enumerate(homes):
            ranks = [r for st in stages for r in st]
            if h in used_homes or (home_kind, home_shape) != (kind, shape):
                continue
            if all(r in taken for r in ranks):
                used_homes.add(h)
                out[i] = stages
                taken.difference_update(ranks)
                for nodes in left.values():
                    for node in nodes:
                        nodes[node] = [r for r in nodes[node] if r not in ranks]
                break
    for i, (kind, shape) in enumerate(pipes):
        if out[i] is not None:
            continue
        placed: list[tuple[int, ...]] = []
        for _ in range(shape.pp):
            stage = _best_fit(left.get(kind, {}), shape.tp * shape.cp)
            if stage is None:
                return None
            placed.append(stage)
        out[i] = tuple(placed)
    return [stages for stages in out if stages is not None]


def _best_fit(nodes: dict[int, list[int]], width: int) -> tuple[int, ...] | None:
    """``width`` ranks of the node with the fewest free ranks that still holds them
    (taken out of ``nodes``); None when no node does."""
    fits = [node for node, ranks in nodes.items() if len(ranks) >= width]
    if not fits:
        return None
    node = min(fits, key=lambda n: (len(nodes[n]), n))
    stage, nodes[node] = tuple(nodes[node][:width]), nodes[node][width:]
    return stage
