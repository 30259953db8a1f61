"""One rank's program, for people who write their own training loop: ``build``.

``build(model, strategy, world=world, ...)`` runs on every rank of a launch (all ranks, the
same call: it creates the strategy's process groups) and returns this rank's
``RankProgram``, the pieces ``fit``'s loop (``hspmd.train.loop.run_rank``) runs::

    executable   its stage of the model, an fx GraphModule on local slices (None: idle)
    schedule     its pipeline schedule of F and B actions (hspmd.specialize.schedule)
    grad_sync    the resolved plans that synchronize gradients across pipelines
    post         gradient sync and Adam on the local slices (hspmd.train.post)

A loop over it (``examples/own_loop.py``)::

    def work(world):                                  # hspmd.launch(work, num_ranks)
        program = hspmd.build(make, STRATEGY, world=world, lr=1e-3, global_batch=4)
        for batch in program.batches():              # or any (tokens, targets) global batch
            program.zero_grad()
            local = program.forward_backward(batch)   # F and B of this rank's micro-batches
            program.step()                            # gradient sync, then Adam
            print(program.loss(local))                # the global mean token loss
        return program.outcome(records)               # for hspmd.assemble

Every rank feeds the same global batch; each takes its pipeline's rows. The loss is an
all-reduce, so every rank calls ``loss`` (or none does). Not here: switches, elastic
recovery, checkpoints and length plans (``fit`` runs them).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Unpack

import numpy as np
import torch
import torch.distributed as dist

from hspmd.annotation import Region
from hspmd.plan.strategy import Strategy
from hspmd.runtime.world import World
from hspmd.specialize.executable import Executable
from hspmd.specialize.schedule import Action, make_schedule
from hspmd.train.active import Active, activate
from hspmd.train.api import RunOptions, train_config
from hspmd.train.batches import step_batches
from hspmd.train.config import StepRecord, TrainConfig, TrainError
from hspmd.train.layout import Role
from hspmd.train.loop import Batch, prepare_all, run_step
from hspmd.train.packing import packed_steps
from hspmd.train.post import Post
from hspmd.train.sync import SyncItem, grad_sync_plan
from hspmd.train.trainer import check_config

__all__ = ["RankProgram", "build"]

# what fit runs and a RankProgram does not: (field, is it set?)
_NOT_HERE: tuple[tuple[str, Callable[[TrainConfig], bool]], ...] = (
    ("switches", lambda c: bool(c.switching.switches)),
    ("elastic", lambda c: c.elastic.enabled),
    ("save", lambda c: c.checkpoint.save is not None),
    ("resume", lambda c: c.checkpoint.resume is not None),
    ("slowdown", lambda c: bool(c.faults.slowdown)),
    ("switch_mode", lambda c: c.switching.mode != "states"),
)


@dataclass(frozen=True, slots=True, kw_only=True)
class RankProgram:
    """This rank's part of ``config``'s strategy (module docstring)."""

    config: TrainConfig
    world: World
    active: Active
    grad_sync: tuple[SyncItem, ...]  # () under ZeRO-1 (its reduce-scatters live in post)
    _applied: list[int] = field(default_factory=lambda: [0], repr=False)  # ``step`` calls

    @property
    def role(self) -> Role | None:
        """Its pipeline, stage, layers and micro-batch rows (None: idle)."""
        return self.active.role

    @property
    def executable(self) -> Executable | None:
        return self.active.exe

    @property
    def post(self) -> Post | None:
        return self.active.post

    @property
    def schedule(self) -> tuple[Action, ...]:
        role = self.role
        if role is None:
            return ()
        kind = self.config.options.schedule
        return tuple(make_schedule(kind, role.num_stages, role.stage, role.micro_batches))

    def batches(self) -> Iterator[Batch]:
        """The global batches of ``config.steps`` steps: the data ``fit`` and the reference
        train on (packed steps with ``step_tokens``)."""
        if self.config.batch.packed:
            return packed_steps(self.config, self.active.layout.strategy)
        return step_batches(self.config)

    def zero_grad(self) -> None:
        if self.active.post is not None:
            self.active.post.zero_grad()

    def forward_backward(self, batch: Batch, *, step: int | None = None) -> float:
        """F and B of this rank's micro-batches of ``batch`` (with ``config.runtime.overlap``, the
        gradient sync starts during the last B); returns this rank's part of the loss.
        ``step`` (1, 2, ...) keys dropout masks (``hspmd.randomness``; default: one more
        than the ``step()`` calls so far, as ``fit`` counts)."""
        a = self.active
        if a.role is None or a.exe is None or a.plans is None:
            return 0.0
        number = self._applied[0] + 1 if step is None else step
        value = run_step(a.exe, a.role, a.plans, self.config, self.world, batch, step=number,
                         post=a.post)  # fmt: skip
        reporter = a.role.is_last and a.role.rank == a.role.tp_ranks[0]  # one per pipeline
        return value if reporter else 0.0

    def step(self) -> None:
        """Finish the gradient sync across pipelines, then Adam on the local slices."""
        self._applied[0] += 1
        if self.active.post is not None and self.active.role is not None:
            self.active.post.step()

    def loss(self, local: float) -> float:
        """The global mean token loss from every rank's ``forward_backward`` value (an
        all-reduce: every rank calls it)."""
        total = torch.tensor([local], dtype=torch.float64, device=self.world.device)
        dist.all_reduce(total)
        return float(total)

    def train_step(self, batch: Batch) -> float:
        """``zero_grad``, ``forward_backward``, ``step``; returns the global loss."""
        self.zero_grad()
        local = self.forward_backward(batch)
        self.step()
        return self.loss(local)

    def pieces(self) -> dict[str, tuple[Region, np.ndarray]]:
        """Its parameter slices: name -> (global region, fp32 numpy copy)."""
        self.active.gather_params()  # ZeRO-3: collective, whole parameters
        exe = self.active.exe
        if exe is None:
            return {}
        return {
            name: (exe.pieces[name].region, p.detach().float().cpu().numpy().copy())
            for name, p in exe.params.items()
        }

    def outcome(self, records: Sequence[StepRecord]) -> dict[str, Any]:
        """What ``hspmd.assemble(outcomes, config)`` takes from each rank: the records (rank
        0's are reported) and its parameter slices."""
        return {"pieces": self.pieces(), "records": list(records), "builds": 1,
                "rank": self.world.rank, "peak_memory": None}  # fmt: skip

    def record(self, step: int, loss: float, *, began: float) -> StepRecord:
        """A ``StepRecord`` of ``step`` that began at ``began`` (``time.perf_counter()``)."""
        return StepRecord(step=step, loss=loss, tokens=self.config.tokens_per_step,
                          seconds=time.perf_counter() - began)  # fmt: skip


def build(
    model: str | Callable[..., Any],
    strategy: str | Strategy,
    *,
    world: World,
    **options: Unpack[RunOptions],
) -> RankProgram:
    """This rank's program of ``model`` under ``strategy`` (module docstring); ``options``
    are ``fit``'s. Every rank of ``world`` calls it with the same arguments."""
    config = train_config(model, strategy, **options)
    for name, given in _NOT_HERE:
        if given(config):
            raise TrainError(f"build does not take {name} (fit runs it): drop {name}")
    strategy_value = check_config(config)
    if world.world_size <= max(strategy_value.ranks):
        raise TrainError(
            f"{strategy_value} needs {max(strategy_value.ranks) + 1} ranks, the world has "
            f"{world.world_size}: launch more processes"
        )
    prepare_all(world, config)  # every rank, the same groups in the same order
    active = activate(world, config, config.require_strategy())
    sync = () if config.zero1 else grad_sync_plan(
        strategy_value, config.model_config(), bucket_bytes=config.runtime.bucket_bytes
    )  # fmt: skip
    return RankProgram(config=config, world=world, active=active, grad_sync=sync)
