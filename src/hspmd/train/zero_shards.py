"""ZeRO-2 and ZeRO-3's Post: each replica keeps only its shard of the gradients (and, with
ZeRO-3, of the parameters between uses), under the state annotation of ZeRO-1
(``hspmd.plan.params``). The plans are ZeRO-1's (``hspmd.train.zero.zero1_plan``): the
gradient's reduce to the shard (a reduce-scatter between the replicas, point to point for
uneven shares) and the parameter's gather back (an all-gather, or a split-all-gather);
what changes is when they run and what is kept::

    stage  gradient reduce (ShardReduce)                    parameter gather
    1      Post, overlapped with the last B (ZeroOne)       Post, after Adam
    2      buckets as backward finishes them; the full      Post, after Adam (one batch)
           gradient freed once its bucket is reduced
    3      as 2                                             around each use (ParamStore)

``ShardReduce`` groups the parameters into buckets of at most ``bucket_bytes`` (fp32, in
reverse model order: the order backward finishes them; the same buckets on every rank, so
the replicas' batches pair up) and issues a bucket as one batch (``start_plans``) as soon as
this rank's gradients in it are accumulated, keeping at most ``in_flight`` buckets in flight
(it waits for the oldest first), so full gradients never pile up. Where the pipelines run in
lock step (``lock_step``: same stage cuts and micro-batch counts), it reduces in every B and
adds the shards up (the full gradient lives for one bucket of one micro-batch, as
DeepSpeed's ZeRO-2); otherwise in the step's last B only (earlier micro-batches accumulate
the full gradient, as the other Posts do). Gradients still partial inside a stage (SP norm
weights) are summed there first, per bucket (``cut_stage_sync``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence

import torch

from hspmd.models.build import initial_parameter
from hspmd.models.spec import ModelSpec
from hspmd.plan.params import ParamSpec
from hspmd.runtime.batched import ZERO_REDUCE, StartedPlans, start_plans
from hspmd.runtime.executable import run_stage_grad_sync
from hspmd.runtime.world import World
from hspmd.specialize.grad_sync import StageGradSync
from hspmd.specialize.localize import local_slice
from hspmd.specialize.sync_plans import ShardBucket, shard_buckets
from hspmd.switch.live import TrainState
from hspmd.train.clip import owned_names
from hspmd.train.config import AdamConfig
from hspmd.train.optim import Adam
from hspmd.train.overlap import cut_stage_sync
from hspmd.train.post import MasterAdam, load_adam
from hspmd.train.sync import grad_of
from hspmd.train.zero import ZeroItem
from hspmd.train.zero_params import ParamStore
from hspmd.train.zero_units import Unit

__all__ = ["ShardBucket", "ShardReduce", "ShardedPost", "shard_buckets", "unit_buckets"]


def unit_buckets(items: Mapping[str, ZeroItem], units: Sequence[Unit]) -> tuple[ShardBucket, ...]:
    """ZeRO-3's buckets where it gathers per layer: one per gather unit, in reverse order,
    so that a bucket's full gradients are at most the unit's parameters that they replace.
    A parameter of two units (tied weights) goes with the first, whose backward finishes
    its gradient. The units are the same on every replica of a stage (lock step)."""
    first: dict[str, int] = {}
    for k, unit in enumerate(units):
        for name in unit.names:
            first.setdefault(name, k)
    out = []
    for k in reversed(range(len(units))):
        names = tuple(n for n in units[k].names if first[n] == k)
        if names:
            out.append(ShardBucket(names, tuple(items[n].reduce for n in names)))
    return tuple(out)


class ShardReduce:
    """This rank's gradient reduces to shards, bucket by bucket (module docstring).

    ``every_backward``: reduce in every B (lock step), else once ``arm()``-ed; ``on_change``:
    called where gradients grow (memory sampling)."""

    def __init__(
        self, buckets: tuple[ShardBucket, ...], params: dict[str, torch.Tensor], world: World,
        *, every_backward: bool, stage_sync: tuple[StageGradSync, ...] = (), in_flight: int = 1,
        on_change: Callable[[], None] | None = None,
    ) -> None:  # fmt: skip
        self.buckets = [b for b in buckets if any(n in params for n in b.names)]
        self.params, self.world, self.every_backward = params, world, every_backward
        self.in_flight, self.on_change = in_flight, on_change or (lambda: None)
        held = [[n for n in b.names if n in params] for b in self.buckets]
        self.pre, self.rest = cut_stage_sync(stage_sync, held, lambda n: tuple(params[n].shape))
        self.owner = {n: i for i, names in enumerate(held) for n in names}
        self.held = held
        self.flying: deque[tuple[int, StartedPlans]] = deque()
        self.shards: dict[str, torch.Tensor] = {}  # the reduced gradients, summed over B
        self.armed = False
        self._reset()
        for name in self.owner:
            params[name].register_post_accumulate_grad_hook(self._hook_for(name))

    def _reset(self) -> None:
        self.missing = [len(names) for names in self.held]
        self.issued = 0

    def arm(self) -> None:
        self.armed = True

    def _hook_for(self, name: str) -> Callable[[torch.Tensor], None]:
        def hook(_param: torch.Tensor) -> None:
            if not (self.every_backward or self.armed):
                return
            self.on_change()  # a gradient was made: the state's peak is now or at a gather
            self.missing[self.owner[name]] -= 1
            while self.issued < len(self.buckets) and self.missing[self.issued] == 0:
                self._issue(self.issued)
            if self.issued == len(self.buckets) and not self.armed:
                self._reset()  # this B is done; the next one starts over

        return hook

    @torch.no_grad()
    def _issue(self, index: int) -> None:
        self.issued += 1
        if self.pre[index]:  # gradients partial inside the stage: summed there first
            run_stage_grad_sync(self.pre[index], self.params, self.world)
        bucket = self.buckets[index]
        local = {
            i: grad_of(self.params[n], n).float()
            for i, n in enumerate(bucket.names)
            if n in self.params
        }
        started = start_plans(bucket.plans, local, self.world, tag=ZERO_REDUCE, kind="zero-reduce")
        self.flying.append((index, started))
        for name in self.held[index]:
            self.params[name].grad = None  # the plan holds it until done
        while len(self.flying) > self.in_flight:
            self._complete()

    def _complete(self) -> None:
        index, started = self.flying.popleft()
        names = self.buckets[index].names
        for i, out in started.wait().items():
            name = names[i]
            if name in self.shards:
                self.shards[name].add_(out)
            else:
                self.shards[name] = out
        self.on_change()

    @torch.no_grad()
    def finish(self) -> dict[str, torch.Tensor]:
        """Reduce what is left, wait for everything: each gradient's shard, summed."""
        for index in range(self.issued, len(self.buckets)):
            self._issue(index)
        if self.rest:
            run_stage_grad_sync(self.rest, self.params, self.world)
        while self.flying:
            self._complete()
        shards, self.shards = self.shards, {}
        self.armed = False
        self._reset()
        return shards


class ShardedPost(MasterAdam):
    """ZeRO-2 or ZeRO-3's Post on this rank (module docstring): fp32 master shards and Adam
    states as ZeRO-1's, gradients reduced into shards by ``reduce``; with ``store`` (ZeRO-3)
    the parameters stay sharded between uses, the stored piece of each being its master (fp32
    compute) or a compute-dtype copy of it."""

    def __init__(
        self, items: dict[str, ZeroItem], params: dict[str, torch.Tensor], *,
        config: ModelSpec, seed: int, adam: AdamConfig, world: World, zero: int,
        buckets: tuple[ShardBucket, ...], every_backward: bool,
        stage_sync: tuple[StageGradSync, ...] = (), in_flight: int = 1,
    ) -> None:  # fmt: skip
        self.items = [items[name] for name in items if name in params]
        self.params, self.world, self.zero = params, world, zero
        self.dtype = next(iter(params.values())).dtype if params else torch.float32
        self.masters: dict[str, torch.Tensor] = {}
        for item in self.items:
            piece = item.reduce.dst.piece(world.rank, item.shape)
            full = initial_parameter(config, item.name, seed=seed)  # on CPU, from the seed
            # a copy: the slice views the whole initial tensor, which would stay alive
            self.masters[item.name] = local_slice(full, piece).to(world.device, copy=True)
        self.adam = Adam(list(self.masters.values()), adam, names=list(self.masters))
        shards = {i.name: ParamSpec(i.name, i.shape, i.reduce.dst) for i in self.items}
        self.owned = owned_names(shards, world.rank)
        self.stored: dict[str, torch.Tensor] = {}  # ZeRO-3, non-fp32 compute: the cast shards
        self._refresh_stored()
        self.store: ParamStore | None = None  # ZeRO-3's, set by attach()
        self.meter: Callable[[], None] = lambda: None
        self.reduce = ShardReduce(
            buckets, params, world, every_backward=every_backward, stage_sync=stage_sync,
            in_flight=in_flight, on_change=lambda: self.meter(),
        )  # fmt: skip

    def shard(self, name: str) -> torch.Tensor:
        """The stored piece of parameter ``name`` under ZeRO-3 (``ParamStore.shard``)."""
        return self.stored.get(name, self.masters[name])

    def attach(self, store: ParamStore) -> None:
        self.store = store

    def _refresh_stored(self) -> None:
        if self.zero == 3 and self.dtype != torch.float32:
            self.stored = {n: m.to(self.dtype) for n, m in self.masters.items()}

    def extra_tensors(self) -> list[torch.Tensor]:
        return [*self.stored.values(), *self.reduce.shards.values()]

    def arm(self) -> None:
        self.reduce.arm()
        if self.store is not None:
            self.store.arm()

    @torch.no_grad()
    def finish_sync(self) -> None:
        """Every gradient's shard (the masters' gradients); masters and moments untouched."""
        for name, shard in self.reduce.finish().items():
            self.masters[name].grad = shard
        self.meter()

    @torch.no_grad()
    def apply(self) -> None:
        """Adam on the shards; the parameters gathered (ZeRO-2) or left to their next use."""
        self.adam.step()
        self.meter()
        self._parameters()

    def _parameters(self, compute: Mapping[str, torch.Tensor] | None = None) -> None:
        if self.zero == 3:
            self._refresh_stored()
            if self.store is not None:
                self.store.step_ends()
            return
        names = [i.name for i in self.items]
        local = {i: self.masters[n].to(self.dtype) for i, n in enumerate(names)}
        outs = {i: self.params[n].data for i, n in enumerate(names)}
        plans = [i.gather for i in self.items]
        got = start_plans(plans, local, self.world, tag=0, outs=outs, kind="zero-gather").wait()
        for i, name in enumerate(names):
            if compute and name in compute:
                self.params[name].copy_(compute[name])
            elif got[i].data_ptr() != self.params[name].data_ptr():
                self.params[name].copy_(got[i])

    def zero_grad(self) -> None:
        super().zero_grad()
        for master in self.masters.values():
            master.grad = None

    @torch.no_grad()
    def load_state(
        self, state: TrainState, *, steps: int, compute: dict[str, torch.Tensor] | None = None
    ) -> None:
        """Masters and moments from ``state``; the parameters follow (ZeRO-2: ``compute``
        where a switch brought them, else gathered; ZeRO-3: at their next use)."""
        load_adam(self.adam, list(self.masters), state, steps)
        self._parameters(compute)
