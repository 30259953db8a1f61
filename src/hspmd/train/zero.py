"""ZeRO-1 as annotations: fp32 masters and Adam moments sharded over the pipelines.

The state of each parameter has its own annotation (``hspmd.plan.params.state_annotations``:
the replicas split a dim their stage does not split, as the top tier). Post is then two
resolved reshards around a per-shard Adam, for every parameter the rank holds::

    grad  hP: [stage ranks of each pipeline]  --reduce-->  state  h<d>: ...   (RS / SplitRS)
    (clipping: the global norm over the state shards' gradients, hspmd.train.clip)
    AdamW on the rank's state shard (master, exp_avg, exp_avg_sq: one slice each)
    state h<d>: ...                           --gather-->  param  hD: ...     (AG / SplitAG)

Masters start as the state slice of the plan-free initial value (DESIGN decision 5), so
training equals the single-device run; with fp32 compute they stay bitwise equal to the
matching slice of the parameter. The plans (``ZeroItem``, ``zero1_plan``) are pure metadata in
``hspmd.specialize.sync_plans``, re-exported here (its docstring shows them); the simulator
prices the same ones.
"""

from __future__ import annotations

import torch

from hspmd.models.build import initial_piece
from hspmd.models.spec import ModelSpec
from hspmd.plan.params import ParamSpec
from hspmd.runtime.batched import start_plans
from hspmd.runtime.execute import run_plan
from hspmd.runtime.world import World
from hspmd.specialize.grad_sync import StageGradSync
from hspmd.specialize.sync_plans import ZeroItem, zero1_plan
from hspmd.switch.live import TrainState
from hspmd.train.clip import owned_names
from hspmd.train.config import AdamConfig
from hspmd.train.optim import Adam
from hspmd.train.overlap import GradOverlap
from hspmd.train.post import MasterAdam, load_adam
from hspmd.train.sync import SyncItem

__all__ = ["ZeroItem", "ZeroOne", "zero1_plan"]


class ZeroOne(MasterAdam):
    """This rank's masters and Adam states (its shards), and the Post that uses them."""

    def __init__(
        self, items: dict[str, ZeroItem], params: dict[str, torch.Tensor], *,
        config: ModelSpec, seed: int, adam: AdamConfig, world: World,
        stage_sync: tuple[StageGradSync, ...] = (),
    ) -> None:  # fmt: skip
        self.items = [items[name] for name in items if name in params]
        self.params, self.world = params, world
        self.masters: dict[str, torch.Tensor] = {}
        for item in self.items:
            piece = item.reduce.dst.piece(world.rank, item.shape)
            local = initial_piece(config, item.name, seed=seed, region=piece.region)  # CPU
            self.masters[item.name] = local.to(world.device, copy=True)
        self.adam = Adam(list(self.masters.values()), adam, names=list(self.masters))
        # the state shards' owners count them in the global gradient norm (hspmd.train.clip)
        shards = {i.name: ParamSpec(i.name, i.shape, i.reduce.dst) for i in self.items}
        self.owned = owned_names(shards, world.rank)
        # every rank's reduces in reverse model order (the order backward finishes them)
        reduces = [SyncItem((i.name,), i.reduce, False) for i in reversed(items.values())]
        self.overlap = GradOverlap(reduces, params, world, local=self._local, stage_sync=stage_sync)

    def _local(self, item: SyncItem) -> torch.Tensor:
        grad = self.params[item.names[0]].grad
        assert grad is not None, item.names[0]
        return grad.float()

    def arm(self) -> None:
        self.overlap.arm()

    @torch.no_grad()
    def finish_sync(self) -> None:
        """Reduce every gradient to its shard (the masters' gradients)."""
        for reduced, out in self.overlap.results():
            self.masters[reduced.names[0]].grad = out

    @torch.no_grad()
    def apply(self) -> None:
        """Adam on the shards, then gather the parameters: every gather in one batch, in the
        compute dtype (the cast commutes with moving the values), as ZeRO-2's Post does."""
        self.adam.step()
        names = [i.name for i in self.items]
        local = {k: self.masters[n].to(self.params[n].dtype) for k, n in enumerate(names)}
        outs = {k: self.params[n].data for k, n in enumerate(names)}
        plans = [i.gather for i in self.items]
        got = start_plans(plans, local, self.world, tag=0, outs=outs, kind="zero-gather").wait()
        for k, name in enumerate(names):
            if got[k].data_ptr() != self.params[name].data_ptr():
                self.params[name].copy_(got[k])

    @torch.no_grad()
    def load_state(
        self, state: TrainState, *, steps: int, compute: dict[str, torch.Tensor] | None = None
    ) -> None:
        """Masters and moments from ``state``; the compute weights from ``compute`` where
        given (a switch brings them), else gathered from the masters (a resume)."""
        load_adam(self.adam, list(self.masters), state, steps)
        for item in self.items:
            if compute and item.name in compute:
                self.params[item.name].copy_(compute[item.name])
                continue
            value = run_plan(item.gather, self.masters[item.name], self.world)
            assert value is not None, item.name
            self.params[item.name].copy_(value)
