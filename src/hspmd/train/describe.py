"""What each rank does under a training config, as table rows (for `hspmd demo`).

>>> from hspmd.train.config import TrainConfig
>>> rows = describe_ranks(TrainConfig(strategy="2x1: R0:L0-1 R1:L2-3", global_batch=2))
>>> rows[1]
('1', '0', '1 of 2', '2-3', '1', '2 x 1', 'Pre F0 B0 F1 B1 Post', '-')
"""

from __future__ import annotations

from hspmd.plan.strategy import parse_strategy
from hspmd.specialize.schedule import make_schedule
from hspmd.train.config import TrainConfig
from hspmd.train.layout import Layout
from hspmd.train.sync import grad_sync_plan

__all__ = ["describe_ranks"]


def describe_ranks(config: TrainConfig) -> list[tuple[str, ...]]:
    """Rows ``rank, pipeline, stage, layers, TP, micro-batches, schedule, Post comm``."""
    assert config.strategy is not None
    model = config.model_config()
    strategy = parse_strategy(config.strategy)
    layout = Layout(strategy, model.num_layers)
    sync = grad_sync_plan(strategy, model)
    rows: list[tuple[str, ...]] = []
    for rank in strategy.ranks:
        role = layout.role(rank)
        assert role is not None
        schedule = make_schedule(config.schedule, role.num_stages, role.stage, role.micro_batches)
        kinds = sorted({k for item in sync if rank in item.plan.src for k in item.plan.kinds})
        rows.append(
            (
                str(rank),
                str(role.pipeline),
                f"{role.stage} of {role.num_stages}",
                f"{role.layers[0]}-{role.layers[1]}",
                str(len(role.tp_ranks)),
                f"{role.micro_batches} x {role.micro_batch_size}",
                str(schedule),
                ", ".join(kinds) or "-",
            )
        )
    return rows
