"""One rank's training loop: run the schedule, sync gradients, step Adam, report the loss.

Each rank runs its executable graph (``hspmd.specialize.executable``): its stage of the
model on local tensors, tensor-parallel communication inside. Per step, for each action of
the rank's schedule (``hspmd.specialize.schedule``)::

    F m   stage 0 feeds micro-batch m's tokens; other stages receive the activation by
          the boundary's resolved plan (send-recv, or BSR between different TP degrees);
          the last stage's loss is scaled by mb_tokens / global_tokens (decision 6)
    B m   the last stage backpropagates its scaled loss; the others backpropagate the
          gradient received from the next stage; all but stage 0 send their input's grad
    Post  gradients synchronized across pipelines by resolved plans (hspmd.train.sync:
          all-reduce / split-all-reduce), then Adam on the local parameters

The reported loss is one all-reduce (sum) of the scaled losses: the global mean token loss.
Sends are ``isend`` (waited at the end of the step): 1F1B deadlocks with blocking sends.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from hspmd.plan.strategy import StrategyOptions
from hspmd.runtime.world import World
from hspmd.specialize.boundary import BoundaryPlans, Pending, boundary_plans, recv, send
from hspmd.specialize.executable import build_executable, executable_groups
from hspmd.specialize.schedule import make_schedule
from hspmd.train.batches import step_batches
from hspmd.train.config import StepRecord, TrainConfig
from hspmd.train.layout import Layout, Role
from hspmd.train.post import MixedPost, PlainPost, Post
from hspmd.train.sync import SyncItem, grad_sync_plan
from hspmd.train.zero import ZeroItem, ZeroOne, zero1_plan

__all__ = ["StageProgram", "options_of", "run_rank"]


class StageProgram(Protocol):
    """What a rank runs for one micro-batch: ``forward(tokens or activation, targets)``."""

    params: dict[str, torch.Tensor]

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor: ...


def options_of(config: TrainConfig) -> StrategyOptions:
    return StrategyOptions(
        zero1=config.zero1,
        sequence_parallel=config.sequence_parallel,
        recompute=config.recompute,
        schedule=config.schedule,  # type: ignore[arg-type]
        dtype=config.dtype,  # type: ignore[arg-type]
    )


@dataclass(slots=True)
class _Live:
    """Tensors of one step still needed, by micro-batch, and the sends in flight."""

    inputs: dict[int, torch.Tensor] = field(default_factory=dict)
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)
    sends: list[Pending] = field(default_factory=list)
    loss: float = 0.0


def _forward(
    program: StageProgram, role: Role, plans: BoundaryPlans, world: World, live: _Live, *,
    m: int, batch: tuple[torch.Tensor, torch.Tensor], scale: float, dtype: torch.dtype,
    recompute: bool,
) -> None:  # fmt: skip
    tokens, targets = batch
    size = role.micro_batch_size
    rows = slice(role.row_offset + m * size, role.row_offset + (m + 1) * size)
    if plans.incoming is None:
        x = tokens[rows]
    else:
        x = recv(plans.incoming.forward, world, dtype=dtype).requires_grad_(True)
    if recompute:  # keep only the stage input; rerun the stage's forward in backward
        out = checkpoint(program.forward, x, targets[rows], use_reentrant=False)
    else:
        out = program.forward(x, targets[rows])
    if plans.outgoing is None:
        out = out * scale
        live.loss += float(out.detach())
    else:
        live.sends += send(plans.outgoing.forward, out.detach(), world)
    live.inputs[m], live.outputs[m] = x, out


def _backward(plans: BoundaryPlans, world: World, live: _Live, *, m: int) -> None:
    x, out = live.inputs.pop(m), live.outputs.pop(m)
    if plans.outgoing is None:
        out.backward()
    else:
        out.backward(recv(plans.outgoing.backward, world, dtype=out.dtype))
    if plans.incoming is not None:
        assert x.grad is not None
        live.sends += send(plans.incoming.backward, x.grad, world)


def run_step(
    program: StageProgram, role: Role, plans: BoundaryPlans, config: TrainConfig,
    world: World, batch: tuple[torch.Tensor, torch.Tensor],
) -> float:  # fmt: skip
    """Every F and B of the rank's schedule on one global batch; the scaled loss sum."""
    schedule = make_schedule(config.schedule, role.num_stages, role.stage, role.micro_batches)
    live = _Live()
    scale = role.micro_batch_size / config.global_batch  # mb tokens / global tokens
    dtype = torch.bfloat16 if config.dtype == "bf16" else torch.float32
    for action in schedule:
        if action.kind == "F":
            _forward(program, role, plans, world, live, m=action.micro_batch, batch=batch,
                     scale=scale, dtype=dtype, recompute=config.recompute)  # fmt: skip
        elif action.kind == "B":
            _backward(plans, world, live, m=action.micro_batch)
    for pending in live.sends:
        pending.wait()
    return live.loss


def _post(
    config: TrainConfig, params: dict[str, torch.Tensor], sync: tuple[SyncItem, ...],
    zero: dict[str, ZeroItem], world: World,
) -> Post:  # fmt: skip
    if zero:
        model = config.model_config()
        return ZeroOne(zero, params, config=model, seed=config.seed, adam=config.adam, world=world)
    if config.dtype == "bf16":
        return MixedPost(params, sync, adam=config.adam, world=world)
    return PlainPost(params, sync, adam=config.adam, world=world)


def run_rank(world: World, config: TrainConfig, *, report: Any = None) -> dict[str, Any]:
    """Train ``config`` on this rank; ranks outside the strategy only join the loss sum.

    ``report(record)`` is called on rank 0 after each step. Returns the step records and
    this rank's parameter pieces: name -> (global region, numpy array).
    """
    assert config.strategy is not None
    model = config.model_config()
    layout = Layout.from_text(config.strategy, num_layers=model.num_layers)
    role = layout.role(world.rank)
    sync = grad_sync_plan(layout.strategy, model) if not config.zero1 else ()
    zero = zero1_plan(layout.strategy, model) if config.zero1 else {}
    # every rank, idle ones too, in the same order
    world.prepare(
        [item.plan for item in sync] + [p for z in zero.values() for p in (z.reduce, z.gather)]
    )
    world.prepare_groups(executable_groups(layout.strategy))
    exe, plans, post = None, None, None
    if role is not None:
        # ZeRO-1 and bf16 change only Pre/Post, recompute only how F and B are run: the
        # executable graph is the fp32 one
        options = dataclasses.replace(
            options_of(config), zero1=False, dtype="fp32", recompute=False
        )
        exe = build_executable(
            model, layout.strategy, options, world.rank,
            seq_len=config.seq_len, seed=config.seed, world=world,
        )  # fmt: skip
        shape = (role.micro_batch_size, config.seq_len, model.hidden_size)
        plans = boundary_plans(layout.strategy, model, world.rank, shape)
        if config.dtype == "bf16":
            exe.graph_module.to(torch.bfloat16)  # compute copy; Post keeps fp32 masters
        post = _post(config, exe.params, sync, zero, world)
    data = step_batches(config) if role is not None else None
    records = []
    for step in range(1, config.steps + 1):
        batch = next(data) if data is not None else None
        start = time.perf_counter()
        loss = torch.zeros(1, dtype=torch.float64)
        if exe is not None and role is not None and plans is not None and post is not None:
            assert batch is not None
            post.zero_grad()
            value = run_step(exe, role, plans, config, world, batch)
            if role.is_last and role.rank == role.tp_ranks[0]:  # one reporter per pipeline
                loss += value
            post.step()
        dist.all_reduce(loss)
        record = StepRecord(
            step=step, loss=float(loss), tokens=config.tokens_per_step,
            seconds=time.perf_counter() - start,
        )  # fmt: skip
        records.append(record)
        if report is not None and world.rank == 0:
            report(record)
    pieces = {}
    if exe is not None:
        for name, p in exe.params.items():
            # numpy, not tensors: tensors would travel as shared-memory fds
            pieces[name] = (exe.pieces[name].region, p.detach().float().numpy().copy())
    return {"pieces": pieces, "records": records}
