"""Who does what: a strategy's pipelines, stages and micro-batches, per rank.

A strategy (the compact text of hspmd.plan.strategy) lists pipelines ``COUNTxSIZE:``
followed by stages ``R<ranks>:L<first>-<last>``. Pipeline ``p`` takes the rows
``offset_p .. offset_p + COUNT*SIZE`` of the global batch, in micro-batches of SIZE rows::

    "2x2: R0:L0-1 R1:L2-3; 4x1: R2:L0-3"   global batch 8
    pipeline 0: rows 0-3, micro-batches [0,2) [2,4); ranks 0 (L0-1), 1 (L2-3)
    pipeline 1: rows 4-7, micro-batches [4,5) .. [7,8); rank 2 (L0-3)

>>> from hspmd.plan.strategy import parse_strategy
>>> layout = Layout(parse_strategy("2x2: R0:L0-1 R1:L2-3; 4x1: R2:L0-3"), num_layers=4)
>>> role = layout.role(1)
>>> role.pipeline, role.stage, role.layers, role.row_offset, role.micro_batches
(0, 1, (2, 3), 0, 2)
"""

from __future__ import annotations

from dataclasses import dataclass

from hspmd.plan.strategy import Pipeline, Strategy

__all__ = ["Layout", "Role"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Role:
    """One rank's part in a strategy."""

    rank: int
    pipeline: int
    stage: int
    num_stages: int
    tp_ranks: tuple[int, ...]
    layers: tuple[int, int]
    micro_batches: int
    micro_batch_size: int
    row_offset: int
    prev_ranks: tuple[int, ...]  # the previous stage's ranks; () on stage 0
    next_ranks: tuple[int, ...]  # the next stage's ranks; () on the last stage

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1


@dataclass(frozen=True, slots=True)
class Layout:
    """A parsed strategy and the model's layer count; answers per-rank questions."""

    strategy: Strategy
    num_layers: int

    @property
    def pipelines(self) -> tuple[Pipeline, ...]:
        return self.strategy.pipelines

    @property
    def ranks(self) -> tuple[int, ...]:
        return self.strategy.ranks

    def role(self, rank: int) -> Role | None:
        """The rank's role, or None if the strategy does not use it."""
        offset = 0
        for index, pipe in enumerate(self.pipelines):
            for number, stage in enumerate(pipe.stages):
                if rank in stage.ranks:
                    return Role(
                        rank=rank,
                        pipeline=index,
                        stage=number,
                        num_stages=len(pipe.stages),
                        tp_ranks=stage.ranks,
                        layers=(stage.first_layer, stage.last_layer),
                        micro_batches=pipe.num_micro_batches,
                        micro_batch_size=pipe.micro_batch_size,
                        row_offset=offset,
                        prev_ranks=pipe.stages[number - 1].ranks if number else (),
                        next_ranks=pipe.stages[number + 1].ranks
                        if number + 1 < len(pipe.stages)
                        else (),
                    )
            offset += pipe.batch_size
        return None

    def holders(self, layer: int) -> tuple[int, ...]:
        """Ranks whose stage holds ``layer`` (-1: the embedding, num_layers: the head)."""
        layer = min(max(layer, 0), self.num_layers - 1)
        return tuple(
            r
            for p in self.pipelines
            for s in p.stages
            if s.first_layer <= layer <= s.last_layer
            for r in s.ranks
        )
