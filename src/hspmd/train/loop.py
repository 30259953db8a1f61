"""One rank's training loop: run the schedule, sync gradients, step Adam, report the loss.

Per step, for each action of the rank's schedule (hspmd.specialize.schedule)::

    F m   stage 0 feeds micro-batch m's tokens; other stages receive the activation;
          the last stage's loss is scaled by mb_tokens / global_tokens (decision 6)
    B m   the last stage backpropagates its scaled loss; the others backpropagate the
          gradient received from the next stage; all but stage 0 send their input's grad
    Post  gradients synchronized across pipelines by resolved plans (hspmd.train.sync:
          all-reduce / split-all-reduce), then Adam on the local parameters

The reported loss is one all-reduce (sum) of the scaled losses: the global mean token loss.
Sends are ``isend`` (waited at the end of the step): 1F1B deadlocks with blocking sends.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from hspmd.models.llama import LlamaConfig
from hspmd.runtime.world import World
from hspmd.specialize.schedule import make_schedule
from hspmd.train.batches import step_batches
from hspmd.train.config import StepRecord, TrainConfig, TrainError
from hspmd.train.layout import Layout, Role
from hspmd.train.optim import Adam
from hspmd.train.stage import EagerStage
from hspmd.train.sync import grad_sync_plan, run_grad_sync

__all__ = ["StageProgram", "run_rank"]


class StageProgram(Protocol):
    """What a rank runs for one micro-batch: ``forward(tokens or activation, targets)``."""

    params: dict[str, torch.Tensor]

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor: ...


def param_layer(name: str, config: LlamaConfig) -> int:
    """The layer whose stage holds a parameter (embedding: 0; norm and head: the last)."""
    if name.startswith("layers."):
        return int(name.split(".")[1])
    return 0 if name.startswith("embed.") else config.num_layers - 1


@dataclass(slots=True)
class _Step:
    """Live tensors of one step, by micro-batch."""

    inputs: dict[int, torch.Tensor] = field(default_factory=dict)
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)
    sends: list[Any] = field(default_factory=list)
    loss: float = 0.0


def _run_step(
    program: StageProgram, role: Role, config: TrainConfig, batch: tuple[torch.Tensor, ...], *,
    hidden: int,
) -> float:  # fmt: skip
    """Run every F and B of the rank's schedule on one global batch; return its loss sum."""
    tokens, targets = batch
    schedule = make_schedule(config.schedule, role.num_stages, role.stage, role.micro_batches)
    size, live = role.micro_batch_size, _Step()
    scale = size / config.global_batch  # mb tokens / global tokens (equal seq lengths)
    for action in schedule:
        m = action.micro_batch
        rows = slice(role.row_offset + m * size, role.row_offset + (m + 1) * size)
        if action.kind == "F":
            if role.is_first:
                x = tokens[rows]
            else:
                x = torch.empty(size, config.seq_len, hidden)
                dist.recv(x, role.prev_ranks[0])
                x.requires_grad_(True)
            out = program.forward(x, targets[rows])
            if role.is_last:
                out = out * scale
                live.loss += float(out.detach())
            else:
                live.sends.append(dist.isend(out.detach(), role.next_ranks[0]))
            live.inputs[m], live.outputs[m] = x, out
        elif action.kind == "B":
            x, out = live.inputs.pop(m), live.outputs.pop(m)
            if role.is_last:
                out.backward()
            else:
                grad = torch.empty_like(out)
                dist.recv(grad, role.next_ranks[0])
                out.backward(grad)
            if not role.is_first:
                assert x.grad is not None
                live.sends.append(dist.isend(x.grad, role.prev_ranks[0]))
    for work in live.sends:
        work.wait()
    return live.loss


def build_program(config: TrainConfig, role: Role) -> StageProgram:
    """The rank's stage program (stand-in: eager layers; TP degree 1 only)."""
    if len(role.tp_ranks) > 1:
        raise TrainError(
            f"stage of rank {role.rank} has TP degree {len(role.tp_ranks)}: tensor parallel "
            "training needs specialized executable graphs (hspmd.specialize), not ready yet"
        )
    first, last = role.layers
    return EagerStage(config.model_config(), first=first, last=last, seed=config.seed)


def run_rank(world: World, config: TrainConfig, *, report: Any = None) -> dict[str, Any]:
    """Train ``config`` on this rank; ranks outside the strategy only join the loss sum.

    ``report(record)`` is called on rank 0 after each step. Returns the parameters this
    rank is first to hold (name -> tensor) and the step records.
    """
    assert config.strategy is not None
    model = config.model_config()
    layout = Layout.from_text(config.strategy, num_layers=model.num_layers)
    role = layout.role(world.rank)
    sync = grad_sync_plan(layout.strategy, model)
    world.prepare(item.plan for item in sync)
    program = build_program(config, role) if role is not None else None
    optimizer = Adam(list(program.params.values()), config.adam) if program else None
    data = step_batches(config) if program is not None else None
    records = []
    for step in range(1, config.steps + 1):
        batch = next(data) if data is not None else None
        start = time.perf_counter()
        loss = torch.zeros(1, dtype=torch.float64)
        if program is not None and role is not None and optimizer is not None:
            assert batch is not None
            optimizer.zero_grad()
            value = _run_step(program, role, config, batch, hidden=model.hidden_size)
            if role.is_last and role.rank == role.tp_ranks[0]:  # one reporter per pipeline
                loss += value
            run_grad_sync(sync, program.params, world)
            optimizer.step()
        dist.all_reduce(loss)
        record = StepRecord(
            step=step, loss=float(loss), tokens=config.tokens_per_step,
            seconds=time.perf_counter() - start,
        )  # fmt: skip
        records.append(record)
        if report is not None and world.rank == 0:
            report(record)
    mine = {}
    if program is not None:
        for name, p in program.params.items():
            if min(layout.holders(param_layer(name, model))) == world.rank:
                mine[name] = p.detach().numpy().copy()  # tensors would travel as shared-memory fds
    return {"params": mine, "records": records}
