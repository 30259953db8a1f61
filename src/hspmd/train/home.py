"""The mixed-length mode's optimizer: fp32 masters and Adam states under a fixed home layout.

Under ``--switch-mode weights`` the fp32 master and both Adam moments of every parameter
live under a *home* annotation that depends only on the model and the number of ranks N of
the run, never on the strategy: each parameter split N ways over ranks 0..N-1 along dim 0
(or the first dim that divides; as even as possible on the longest dim otherwise)::

    layers.0.attn.wq.weight [64, 64]  [0,1,2,3]{0:4}
    norm.weight [64]                  [0,1,2,3]{0:4}
    (N = 3)                           h0(22,21,21): [0]{} [1]{} [2]{}

Post under strategy S, on every rank of the run (idle ones too: they hold home shards)::

    grads   S's gradient sync (hP -> hD: all-reduce / split-all-reduce, hspmd.train.sync),
            then one fused BSR from S's parameter annotations to home (fp32)
    Adam    on the home shards (elementwise: equal to Adam on any other layout)
    weights masters cast to the compute dtype on home, one fused BSR from home to S's
            parameter annotations (the Pre reshard of the paper, done at the end of Post)

The compute weights (bf16 or fp32) are then kept across steps, so a switch moves only them
(``hspmd.switch.weights``, ``hspmd.train.active.switch_weights``) and the states stay put.

>>> from hspmd.models.llama import get_config
>>> homes = home_annotations(get_config("llama-tiny", num_layers=1), num_ranks=3)
>>> str(homes["layers.0.attn.wq.weight"]), str(homes["embed.weight"])
('layers.0.attn.wq.weight [64, 64] h0(22,21,21): [0]{} [1]{} [2]{}', 'embed.weight [256, 64] h0(86,85,85): [0]{} [1]{} [2]{}')
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

from hspmd.annotation import Annotation, DeviceGroup, DistributedStates
from hspmd.comm.bsr import BsrTable, schedule
from hspmd.comm.plan import Transfer
from hspmd.comm.topology import Topology
from hspmd.errors import StrategyError
from hspmd.models.build import initial_piece
from hspmd.models.spec import ModelSpec
from hspmd.plan.params import ParamSpec, parameter_annotations
from hspmd.plan.strategy import Strategy
from hspmd.runtime.fused import FusedTensor, run_fused_bsr
from hspmd.runtime.world import World
from hspmd.specialize.grad_sync import StageGradSync
from hspmd.switch.live import TrainState
from hspmd.train.clip import owned_names
from hspmd.train.config import AdamConfig, TrainConfig
from hspmd.train.optim import Adam
from hspmd.train.overlap import GradOverlap
from hspmd.train.sync import SyncItem, gathered_fp32, grad_of, grad_sync_plan, scatter_back

__all__ = [
    "HomePlan", "HomePost", "HomeState", "home_annotations", "home_plan", "home_post",
    "run_ranks",
]  # fmt: skip


def _home(shape: tuple[int, ...], num_ranks: int, name: str) -> Annotation:
    ranks = tuple(range(num_ranks))
    for dim, length in enumerate(shape):
        if length % num_ranks == 0:
            return Annotation((DeviceGroup(ranks),), (DistributedStates(((dim, num_ranks),)),))
    dim = max(range(len(shape)), key=lambda d: shape[d])
    length = shape[dim]
    if length < num_ranks:
        raise StrategyError(
            f"{name} {list(shape)} cannot be split over the run's {num_ranks} ranks for the "
            "mixed-length mode's home layout: use fewer ranks or --switch-mode states"
        )
    sizes = tuple(length // num_ranks + (i < length % num_ranks) for i in range(num_ranks))
    groups = tuple(DeviceGroup((r,)) for r in ranks)
    return Annotation(groups, tuple(DistributedStates(()) for _ in ranks), hdim=dim, hsizes=sizes)


@functools.cache
def home_annotations(config: ModelSpec, *, num_ranks: int) -> Mapping[str, ParamSpec]:
    """Every parameter's home annotation (module docstring), in model order; read-only, as
    it is cached and shared."""
    return MappingProxyType(
        {
            name: ParamSpec(name, shape, _home(shape, num_ranks, name))
            for name, shape in config.parameter_shapes().items()
        }
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class HomePlan:
    """Post's communication under one strategy: gradient sync, grads to home, weights out."""

    names: tuple[str, ...]
    sync: tuple[SyncItem, ...]
    grads: tuple[FusedTensor, ...]  # parameter annotation -> home (fp32)
    grad_transfers: tuple[Transfer, ...]
    weights: tuple[FusedTensor, ...]  # home -> parameter annotation (compute dtype)
    weight_transfers: tuple[Transfer, ...]

    def __str__(self) -> str:
        return (
            f"home post: {len(self.sync)} syncs, {len(self.grad_transfers)} grad transfers, "
            f"{len(self.weight_transfers)} weight transfers"
        )


@functools.cache
def home_plan(strategy: Strategy, config: ModelSpec, *, num_ranks: int, itemsize: int) -> HomePlan:
    """The plan of Post under ``strategy`` (pure metadata; cached)."""
    params = parameter_annotations(strategy, config)
    homes = home_annotations(config, num_ranks=num_ranks)
    names = tuple(params)
    grads = tuple(FusedTensor(params[n].shape, params[n].annotation, homes[n].annotation) for n in names)  # fmt: skip
    weights = tuple(FusedTensor(t.shape, t.dst, t.src) for t in grads)

    def fused(tensors: tuple[FusedTensor, ...], size: int) -> tuple[Transfer, ...]:
        tables = [
            BsrTable.between(t.src, t.dst, t.shape, tensor=i, itemsize=size)
            for i, t in enumerate(tensors)
        ]
        return schedule(tables, topology=Topology.flat(), fused=True)

    sync = grad_sync_plan(strategy, config)
    return HomePlan(
        names=names,
        sync=sync,
        grads=grads,
        grad_transfers=fused(grads, 4),
        weights=weights,
        weight_transfers=fused(weights, itemsize),
    )


class HomeState:
    """One rank's home shards: fp32 masters and Adam over them (kept across switches).

    Masters start as the initial value rounded to the compute dtype, as the unstable-devices
    mode's masters (copies of the bf16 compute weights) and Megatron's do, so both modes
    give the same numbers.
    """

    def __init__(
        self, config: ModelSpec, *, rank: int, num_ranks: int, seed: int, adam: AdamConfig,
        dtype: torch.dtype, device: torch.device | None = None,
    ) -> None:  # fmt: skip
        self.homes = home_annotations(config, num_ranks=num_ranks)
        self.num_ranks = num_ranks
        self.masters: dict[str, torch.Tensor] = {}
        for name, spec in self.homes.items():
            piece = spec.annotation.piece(rank, spec.shape)
            local = initial_piece(config, name, seed=seed, region=piece.region)  # CPU
            self.masters[name] = local.to(dtype).float().to(device or torch.device("cpu"))
        self.adam = Adam(list(self.masters.values()), adam, names=list(self.masters))
        self.owned = owned_names(self.homes, rank)  # all of them: home pieces are disjoint

    def state(self) -> TrainState:
        names = list(self.masters)
        adam = self.adam
        return {
            n: (p, m, v)
            for n, p, m, v in zip(names, adam.params, adam.exp_avg, adam.exp_avg_sq, strict=True)
        }


class HomePost:
    """Post of the mixed-length mode under one strategy (``params``: empty on idle ranks)."""

    def __init__(
        self, home: HomeState, params: dict[str, torch.Tensor], plan: HomePlan, *,
        dtype: torch.dtype, world: World, stage_sync: tuple[StageGradSync, ...] = (),
    ) -> None:  # fmt: skip
        self.home, self.params, self.plan, self.world = home, params, plan, world
        self.dtype = dtype  # of the compute weights (an idle rank casts its shards to it)
        # S's gradient sync (and the in-stage sums of SP norm weights) as the other Posts
        # issue it: overlapped with the last backward once armed (hspmd.train.overlap)
        self.overlap = GradOverlap(
            plan.sync, params, world, local=self._local, donate=True, stage_sync=stage_sync
        )

    def _local(self, item: SyncItem) -> torch.Tensor:
        return gathered_fp32(item, self.params)

    def arm(self) -> None:
        self.overlap.arm()

    @property
    def owned(self) -> frozenset[str]:
        return self.home.owned

    def grads(self) -> dict[str, torch.Tensor]:
        """The home shards' gradients (after ``finish_sync``)."""
        return {n: m.grad for n, m in self.home.masters.items() if m.grad is not None}

    @torch.no_grad()
    def step(self) -> None:
        """Sync grads, move them to home, Adam on home, move the new weights back."""
        self.finish_sync()
        self.apply()

    @torch.no_grad()
    def finish_sync(self) -> None:
        """Sync grads and move them to home (the home masters' gradients)."""
        synced = self.overlap.results()
        grads = {n: grad_of(p, n).float() for n, p in self.params.items()}
        for item, out in synced:
            scatter_back(out, [grads[n] for n in item.names])
        local = {i: grads[n] for i, n in enumerate(self.plan.names) if n in grads}
        moved = run_fused_bsr(self.plan.grad_transfers, self.plan.grads, local, self.world)
        for index, grad in moved.items():
            self.home.masters[self.plan.names[index]].grad = grad

    @torch.no_grad()
    def apply(self) -> None:
        """Adam on home, then the new compute weights moved back."""
        self.home.adam.step()
        self.refresh()

    @torch.no_grad()
    def refresh(self) -> None:
        """The compute weights from the home masters (cast, then one fused BSR)."""
        local = {i: self.home.masters[n].to(self.dtype) for i, n in enumerate(self.plan.names)}
        out = run_fused_bsr(self.plan.weight_transfers, self.plan.weights, local, self.world, dtype=self.dtype)  # fmt: skip
        for index, value in out.items():
            self.params[self.plan.names[index]].copy_(value)

    def zero_grad(self) -> None:
        for param in self.params.values():
            param.grad = None
        for master in self.home.masters.values():
            master.grad = None

    def state(self) -> TrainState:
        return self.home.state()

    def load_state(
        self, state: TrainState, *, steps: int, compute: dict[str, torch.Tensor] | None = None
    ) -> None:
        """Take over home state (same layout) and refresh the compute weights from it."""
        with torch.no_grad():
            for name, (master, exp_avg, exp_avg_sq) in state.items():
                index = list(self.home.masters).index(name)
                self.home.adam.params[index].copy_(master)
                self.home.adam.exp_avg[index].copy_(exp_avg)
                self.home.adam.exp_avg_sq[index].copy_(exp_avg_sq)
        self.home.adam.steps = steps
        self.refresh()


def run_ranks(config: TrainConfig) -> int:
    """N: the ranks of the run (0..N-1), those of its largest strategy; the home spans them."""
    return 1 + max(max(strategy.ranks) for strategy in config.strategies)


def home_post(
    world: World, config: TrainConfig, strategy: Strategy, params: dict[str, torch.Tensor],
    *, home: HomeState | None = None, stage_sync: tuple[StageGradSync, ...] = (),
) -> HomePost | None:  # fmt: skip
    """This rank's Post under ``strategy`` in the mixed-length mode, keeping ``home`` (a new
    one from the seed when None); None on a rank outside the run (a larger launch)."""
    num_ranks = run_ranks(config)
    if world.rank >= num_ranks:
        return None
    model = config.model_config()
    dtype = torch.bfloat16 if config.options.dtype == "bf16" else torch.float32
    if home is None:
        home = HomeState(
            model, rank=world.rank, num_ranks=num_ranks, seed=config.seed, adam=config.optimizer,
            dtype=dtype, device=world.device,
        )  # fmt: skip
    plan = home_plan(strategy, model, num_ranks=num_ranks, itemsize=_size(dtype))
    return HomePost(home, params, plan, dtype=dtype, world=world, stage_sync=stage_sync)


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
