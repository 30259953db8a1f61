"""Run executable graphs (``hspmd.specialize.executable``) on a world.

Specialization leaves an ``Executable`` as data: its ``ReshardModule`` calls hold their
forward and backward plans and no process group. ``bind_executable(exe, world)`` checks
that the groups the plans need are prepared, gives every ``ReshardModule`` the autograd
reshard (``hspmd.runtime.autograd``) on ``world``, sized to each call's sequence length
(``SizedReshard``), gives a ``VocabParallelLoss`` the
vocab-parallel cross-entropy (``hspmd.runtime.vocab_loss``), and moves the graph to the world's
device. ``sync_grads(exe, world)`` runs the stage's gradient sync plans once per step,
after the last B::

    exe = bind_executable(build_executable(config, strategy, options, rank,
                                           seq_len=16, seed=0), world)
    loss = exe(tokens, targets); loss.backward(); sync_grads(exe, world)
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import torch

from hspmd.comm.plan import CommPlan
from hspmd.comm.sizing import global_shape, sized
from hspmd.runtime.autograd import reshard
from hspmd.runtime.execute import run_plan
from hspmd.runtime.regather import Regather, regatherable
from hspmd.runtime.vocab_loss import vocab_parallel_cross_entropy
from hspmd.runtime.world import World, plan_groups
from hspmd.specialize.cut import ExecutableError
from hspmd.specialize.executable import Executable, ReshardModule, reshard_plans
from hspmd.specialize.grad_sync import StageGradSync
from hspmd.specialize.loss import VocabParallelLoss

__all__ = ["SizedReshard", "bind_executable", "run_stage_grad_sync", "sync_grads"]


def bind_executable(exe: Executable, world: World) -> Executable:
    """``exe`` made runnable on ``world`` (in place; returned for chaining).

    The groups of its plans must be prepared first, on every rank:
    ``world.prepare_groups(executable_groups(strategy))``.
    """
    losses = [m for m in exe.graph_module.modules() if isinstance(m, VocabParallelLoss)]
    groups = plan_groups(reshard_plans(exe.graph_module)) + [m.shard.group for m in losses]
    for group in groups:
        if len(group) < world.world_size and group not in world.groups:
            raise ExecutableError(
                f"process group {list(group)} is not prepared: call "
                "world.prepare_groups(executable_groups(strategy)) on every rank first"
            )
    markers = [m for m in exe.graph_module.modules() if isinstance(m, ReshardModule)]
    gathers = [m for m in markers if regatherable(m.forward_plan, world.rank)]
    regather = exe.around = Regather(world) if gathers else None  # keep the shards, not rows
    for module in markers:
        module.runner = SizedReshard(world, regather if module in gathers else None)
    for loss in losses:
        loss.runner = functools.partial(vocab_parallel_cross_entropy, world=world)
    exe.graph_module.to(world.device)  # parameters stay the same objects (moved in place)
    return exe


class SizedReshard:
    """A marker's runner: its plans, resolved at the maximum length, sized to the length of
    each call (``hspmd.comm.sizing``; the global shape read from the local input), then
    the autograd reshard. Sized plans are kept per shape (a handful of lengths). With
    ``regather`` (a marker whose plan is ``regatherable``: sizing keeps its steps), each
    output is noted so that backward gathers it again (``hspmd.runtime.regather``)."""

    def __init__(self, world: World, regather: Regather | None = None) -> None:
        self.world, self.regather = world, regather
        self.plans: dict[tuple[int, ...], tuple[CommPlan, CommPlan]] = {}

    def __call__(self, x: torch.Tensor, forward: CommPlan, backward: CommPlan) -> torch.Tensor:
        shape = global_shape(forward, self.world.rank, x.shape)
        pair = self.plans.get(shape)
        if pair is None:
            pair = self.plans[shape] = (sized(forward, shape), sized(backward, shape))
        out = reshard(x, *pair, self.world)
        if self.regather is not None:
            self.regather.note(x, out, pair[0])
        return out


def sync_grads(exe: Executable, world: World) -> None:
    """Reshard the stage's partial parameter gradients (e.g. norm weights under sequence
    parallelism) to their parameters' annotation: once per step, after the last B and
    before the gradient sync across pipelines."""
    if exe.grad_sync:
        run_stage_grad_sync(exe.grad_sync, exe.params, world)


@torch.no_grad()
def run_stage_grad_sync(
    items: tuple[StageGradSync, ...], params: Mapping[str, torch.Tensor], world: World
) -> None:
    """Replace each listed local gradient by its synchronized value (in place)."""
    for item in items:
        grads = [params[name].grad for name in item.names]
        assert all(g is not None for g in grads), f"{item}: a parameter got no gradient"
        local = torch.cat([g.reshape(-1) for g in grads])  # type: ignore[union-attr]
        if len(item.names) == 1:
            local = local.view_as(grads[0])  # type: ignore[arg-type]
        out = run_plan(item.plan, local, world)
        assert out is not None
        flat, offset = out.reshape(-1), 0
        for g in grads:
            assert g is not None
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
