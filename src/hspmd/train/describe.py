"""What each rank does under a training config, as table rows (for `hspmd demo`).

>>> from hspmd.train.api import train_config
>>> rows = describe_ranks(train_config(strategy="2x1: R0-1:L0-1 R2:L2-3"))
>>> rows[2]
('2', '0', '1 of 2', '2-3', '1', '2 x 1', 'in: bsr', '-', 'Pre F0 B0 F1 B1 Post')
"""

from __future__ import annotations

from hspmd.models.spec import stream_shape
from hspmd.plan.strategy import Stage
from hspmd.specialize.boundary import boundary_plans
from hspmd.specialize.schedule import make_schedule
from hspmd.train.config import TrainConfig
from hspmd.train.layout import Layout
from hspmd.train.sync import grad_sync_plan

__all__ = ["COLUMNS", "describe_ranks"]

COLUMNS = ("rank", "pipe", "stage", "layers", "TP", "micro-batches", "boundary", "Post", "schedule")


def describe_ranks(config: TrainConfig) -> list[tuple[str, ...]]:
    """One row per rank, in ``COLUMNS`` order (communication kinds as resolved)."""
    model = config.model_config()
    strategy = config.require_strategy()
    layout = Layout(strategy, model.num_layers)
    sync = grad_sync_plan(strategy, model)
    rows: list[tuple[str, ...]] = []
    for rank in strategy.ranks:
        role = layout.role(rank)
        assert role is not None
        schedule = make_schedule(
            config.options.schedule, role.num_stages, role.stage, role.micro_batches
        )
        shape = stream_shape(model, role.micro_batch_size, config.batch.seq_len)
        plans = boundary_plans(strategy, model, rank, shape)
        edges = [
            f"{side}: {'+'.join(b.forward.kinds)}"
            for side, b in (("in", plans.incoming), ("out", plans.outgoing))
            if b is not None
        ]
        kinds = sorted({k for item in sync if rank in item.plan.src for k in item.plan.kinds})
        rows.append(
            (
                str(rank),
                str(role.pipeline),
                f"{role.stage} of {role.num_stages}",
                f"{role.layers[0]}-{role.layers[1]}",
                _degrees(strategy.pipelines[role.pipeline].stages[role.stage]),
                f"{role.micro_batches} x {role.micro_batch_size}",
                ", ".join(edges) or "-",
                ", ".join(kinds) or "-",
                str(schedule),
            )
        )
    return rows


def _degrees(stage: Stage) -> str:
    """``2``, or ``2 x CP2`` for a context-parallel stage of TP 2."""
    return f"{stage.tp} x CP{stage.cp}" if stage.cp > 1 else str(stage.tp)
