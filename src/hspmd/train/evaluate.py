"""A held-out evaluation: the forward of every micro-batch, no backward, no optimizer.

After every ``--eval-every`` N-th step (its optimizer step applied, its checkpoint saved),
every rank runs its stage's forward-only schedule
(``hspmd.specialize.schedule.forward_only``: ``Pre F0 F1 ..``) on each of the
``--eval-batches`` K global batches (``hspmd.train.batches.eval_batches``, the same at
every evaluation), through the executables and boundary plans it trains with, under
``torch.no_grad``. Each pipeline's last stage weighs its micro-batches' mean token losses
by their share of the global batch (decision 6), as a step does, and one all-reduce sums
them over the world (through ``World.wait``: elastic runs watch it)::

    eval loss   = 1/K  sum_k  sum_pipelines  sum_m  rows(m) / global_batch  x  loss(k, m)
    perplexity  = exp(eval loss)

The reference (``evaluate_reference``) runs the plain module in eval mode under no_grad
on the whole batches, one after another, and takes the mean of their losses.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from hspmd.models.build import step_loss
from hspmd.runtime.boundary import Pending, recv, send
from hspmd.runtime.world import World
from hspmd.specialize.boundary import BoundaryPlans, sized_boundaries
from hspmd.specialize.executable import Executable
from hspmd.specialize.schedule import forward_only
from hspmd.train.active import Active
from hspmd.train.config import EvalRecord, TrainConfig
from hspmd.train.layout import Role

__all__ = ["evaluate_rank", "evaluate_reference"]

Batch = tuple[torch.Tensor, torch.Tensor]


def evaluate_rank(
    world: World, config: TrainConfig, active: Active, batches: Sequence[Batch], *, step: int
) -> EvalRecord:
    """The evaluation after ``step`` on this rank (every rank of the world calls it; ranks
    idle under the strategy only join the sum); the same record on every rank."""
    begin = time.perf_counter()
    total = torch.zeros(1, dtype=torch.float64, device=world.device)
    role, exe, plans = active.role, active.exe, active.plans
    if role is not None and exe is not None and plans is not None:
        value = sum(_pass(exe, role, plans, config, world, batch) for batch in batches)
        if role.is_last and role.rank == role.tp_ranks[0]:  # one reporter per pipeline
            total += value
    world.record("all_reduce", group=tuple(range(world.world_size)), nbytes=total.nbytes)
    world.wait([dist.all_reduce(total, async_op=True)])
    count = len(batches)
    return EvalRecord(
        step=step, loss=float(total) / count, batches=count,
        tokens=count * config.batch.global_batch * config.batch.seq_len,
        seconds=time.perf_counter() - begin,
    )  # fmt: skip


@torch.no_grad()
def _pass(
    exe: Executable, role: Role, plans: BoundaryPlans, config: TrainConfig, world: World,
    batch: Batch,
) -> float:  # fmt: skip
    """The forward-only schedule on one global batch; this rank's weighted loss sum (0
    but on a pipeline's last stage)."""
    tokens, targets = batch
    size = role.micro_batch_size
    hidden = config.model_config().hidden_size
    dtype = torch.bfloat16 if config.options.dtype == "bf16" else torch.float32
    loss, sends = 0.0, list[Pending]()
    for action in forward_only(role.num_stages, role.stage, role.micro_batches):
        if action.kind != "F":
            continue
        rows = slice(role.row_offset + action.micro_batch * size,
                     role.row_offset + (action.micro_batch + 1) * size)  # fmt: skip
        x, y = tokens[rows].to(world.device), targets[rows].to(world.device)
        sized = sized_boundaries(plans, (*x.shape, hidden))
        if sized.incoming is not None:
            x = recv(sized.incoming.forward, world, dtype=dtype)
        out = exe.forward(x, y, None)
        if sized.outgoing is None:
            loss += float(out * (size / config.batch.global_batch))
        else:
            sends += send(sized.outgoing.forward, out, world)
    for pending in sends:
        pending.wait()
    return loss


@torch.no_grad()
def evaluate_reference(
    config: TrainConfig, model: nn.Module, batches: Sequence[Batch], *, step: int,
    device: torch.device,
) -> EvalRecord:  # fmt: skip
    """The evaluation after ``step`` of the plain module (module docstring)."""
    begin = time.perf_counter()
    spec = config.model_config()
    was_training = model.training
    model.eval()
    try:
        losses = [
            float(step_loss(spec, model, tokens.to(device), targets.to(device)))
            for tokens, targets in batches
        ]
    finally:
        model.train(was_training)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return EvalRecord(
        step=step, loss=sum(losses) / len(losses), batches=len(batches),
        tokens=len(batches) * config.batch.global_batch * config.batch.seq_len,
        seconds=time.perf_counter() - begin,
    )  # fmt: skip
