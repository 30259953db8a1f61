"""The active strategy: this rank's part in the strategy now running, and how it is built.

``activate(world, config, strategy)`` builds, for ``strategy`` on this rank, what the
training loop (``hspmd.train.loop``) and the elastic loop (``hspmd.train.elastic``) run::

    layout  the strategy with its pipelines' roles (hspmd.train.layout)
    role    this rank's stage, micro-batch rows and TP group (None: idle under it)
    exe     its executable graph, bound to the world (hspmd.specialize.executable)
    plans   the boundary plans of its stage (hspmd.specialize.boundary)
    post    its Post: gradient sync and AdamW (PlainPost, MixedPost, ZeroOne or, for ZeRO
            2 and 3, ShardedPost; HomePost under ``switch_mode="weights"``, on idle ranks
            too)
    meter   with ``measure_memory``: its training state's tracked bytes (hspmd.train.meter)

Under ZeRO-3 the executable's parameters are stored as shards (``hspmd.train.zero_params``):
per layer where the pipelines run in lock step, the graph gets its gather points
(``hspmd.train.zero_units``) before the per-layer recompute split; else once per step.

A switch builds a new ``Active`` (``hspmd.train.loop.switch_to``); ``switch_weights`` is the
mixed-length mode's switch: only the compute weights move, the home state stays.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from hspmd.models.spec import stream_shape
from hspmd.plan.params import lock_step, parameter_annotations
from hspmd.plan.strategy import Strategy, StrategyOptions
from hspmd.runtime.counting import count_comm
from hspmd.runtime.executable import bind_executable
from hspmd.runtime.regather import Regather
from hspmd.runtime.world import World
from hspmd.specialize.boundary import BoundaryPlans, boundary_plans
from hspmd.specialize.executable import Executable, build_executable
from hspmd.specialize.recompute import checkpoint_layers
from hspmd.switch.weights import plan_weight_switch, run_weight_switch
from hspmd.train.clip import owned_names
from hspmd.train.config import TrainConfig
from hspmd.train.home import HomePost, HomeState, home_post
from hspmd.train.layout import Layout, Role
from hspmd.train.meter import StateMeter, state_tensors
from hspmd.train.post import MixedPost, PlainPost, Post
from hspmd.train.sync import grad_sync_plan
from hspmd.train.zero import ZeroItem, ZeroOne, zero1_plan
from hspmd.train.zero_params import ParamStore, StoreAround
from hspmd.train.zero_shards import ShardedPost, shard_buckets, unit_buckets
from hspmd.train.zero_units import Unit, insert_points

__all__ = ["Active", "Built", "activate", "strategy_options", "switch_weights"]


class Built:
    """The executables and boundary plans this rank built under the mixed-length mode
    (``switch_mode="weights"``), by layout: a strategy switched to again, or one that
    differs only in micro-batch counts (the executable does not depend on them), reuses
    them instead of building them again; the switch then only moves (or copies) the
    weights. Holds one copy of the compute weights per layout seen, and its Post (whose
    gradient hooks stay on those weights: one Post per layout, not one per switch)."""

    def __init__(self) -> None:
        self.by_layout: dict[str, tuple[Executable, BoundaryPlans]] = {}
        self.posts: dict[str, HomePost] = {}
        self.reused = 0

    @staticmethod
    def key(strategy: Strategy) -> str:
        """``strategy`` with every micro-batch count 1: ``2x1: R0:L0-3`` -> ``1x1: R0:L0-3``."""
        pipes = (dataclasses.replace(p, num_micro_batches=1) for p in strategy.pipelines)
        return str(Strategy(tuple(pipes)))


@dataclass(frozen=True, slots=True, kw_only=True)
class Active:
    """This rank's part in the strategy now running (role, exe and plans None on an idle
    rank; post None there too, except for the home shards of ``switch_mode="weights"``)."""

    layout: Layout
    role: Role | None = None
    exe: Executable | None = None
    plans: BoundaryPlans | None = None
    post: Post | None = None
    built: Built | None = None  # the mixed-length mode's reusable executables
    meter: StateMeter | None = None  # with measure_memory: the state's tracked bytes

    @property
    def strategy(self) -> Strategy:
        """The strategy now running."""
        return self.layout.strategy

    def gather_params(self) -> None:
        """Make every parameter of the executable whole where ZeRO-3 stores it sharded
        (a collective of the replicas: every rank calls it; the end of a run)."""
        if isinstance(self.post, ShardedPost) and self.post.store is not None:
            self.post.store.gather_all()

    @property
    def home(self) -> HomeState | None:
        """The mixed-length mode's optimizer state this rank holds (None in the states mode
        and outside the run)."""
        return self.post.home if isinstance(self.post, HomePost) else None


def strategy_options(config: TrainConfig, strategy: Strategy) -> StrategyOptions:
    """The options ``strategy`` runs with: the run's, but under length plans its
    recompute is the plans file's for that strategy (a long-row strategy may recompute
    while the others do not; the executable is built per strategy anyway)."""
    options = config.options
    if config.switching.length_plans is None:
        return options
    found = {p.strategy: p.options for p in config.switching.length_plans.plans}.get(strategy)
    if found is None:
        return options
    return dataclasses.replace(
        options, recompute=found.recompute, recompute_layers=found.recompute_layers
    )


def _post(
    config: TrainConfig, exe: Executable, world: World, *, strategy: Strategy,
    units: tuple[Unit, ...], per_layer: bool,
) -> Post:  # fmt: skip
    """The states mode's Post of ``exe``: ZeRO 2 and 3 (with ZeRO-3's parameter store
    bound to the graph), ZeRO-1, or plain gradient sync (bf16: with fp32 masters)."""
    model, adam, params, stage_sync = (
        config.model_config(),
        config.optimizer,
        exe.params,
        exe.grad_sync,
    )
    zero = zero1_plan(strategy, model, shares=config.options.zero_shares) if config.zero1 else {}
    if zero and config.zero >= 2:
        buckets = unit_buckets(zero, units) if units else shard_buckets(
            zero, bucket_bytes=config.runtime.bucket_bytes,
            layer_of=model.param_layer if config.zero == 3 else None,
        )  # fmt: skip
        post = ShardedPost(
            zero, params, config=model, seed=config.seed, adam=adam, world=world,
            zero=config.zero, buckets=buckets,
            every_backward=config.runtime.overlap and _lock_step(config, strategy),
            stage_sync=stage_sync, in_flight=1 if config.runtime.zero_overlap else 0,
        )  # fmt: skip
        if config.zero == 3:
            _attach_store(config, exe, post, zero, units, world, per_layer=per_layer)
        return post
    if zero:
        return ZeroOne(zero, params, config=model, seed=config.seed, adam=adam,
                       world=world, stage_sync=stage_sync)  # fmt: skip
    sync = grad_sync_plan(strategy, model, bucket_bytes=config.runtime.bucket_bytes)
    # the pieces of the parameters this rank counts in the global gradient norm
    owned = owned_names(parameter_annotations(strategy, model), world.rank)
    kind = MixedPost if config.options.dtype == "bf16" else PlainPost
    return kind(params, sync, adam=adam, world=world, stage_sync=stage_sync, owned=owned)


def _attach_store(
    config: TrainConfig, exe: Executable, post: ShardedPost, zero: dict[str, ZeroItem],
    units: tuple[Unit, ...], world: World, *, per_layer: bool,
) -> None:  # fmt: skip
    """ZeRO-3: the executable's parameters stored as shards, gathered at its points."""
    store = ParamStore(
        exe.params, {n: zero[n].gather for n in exe.params}, post.shard, units, world,
        per_layer=per_layer, prefetch=config.runtime.zero_overlap, on_change=lambda: post.meter(),
    )  # fmt: skip
    store.bind(exe.graph_module)
    exe.around = StoreAround(store, exe.around if isinstance(exe.around, Regather) else None)
    post.attach(store)


def activate(
    world: World, config: TrainConfig, strategy: Strategy, *, home: HomeState | None = None,
    built: Built | None = None,
) -> Active:  # fmt: skip
    """Build this rank's executable graph, boundary plans and Post under ``strategy``
    (``home``: the mixed-length mode's optimizer state to keep, ``hspmd.train.home``;
    ``built``: its executables built before, reused by layout)."""
    model = config.model_config()
    layout = Layout(strategy, model.num_layers)
    role = layout.role(world.rank)
    if config.switching.mode == "weights" and built is None:
        built = Built()
    if role is None:
        if config.switching.mode == "weights":  # an idle rank keeps its home shards
            idle = home_post(world, config, layout.strategy, {}, home=home)
            return Active(layout=layout, post=idle, built=built)
        return Active(layout=layout)
    key = f"{Built.key(strategy)} [{strategy_options(config, strategy)}]"
    if built is not None and key in built.by_layout:
        return _reused(world, config, layout, role, built, key=key, home=home)
    exe, units, per_layer = _executable(world, config, strategy)
    shape = stream_shape(model, role.micro_batch_size, config.batch.seq_len)
    plans = boundary_plans(
        strategy, model, world.rank, shape, options=_exe_options(config, strategy)
    )
    if config.options.dtype == "bf16":
        exe.graph_module.to(torch.bfloat16)  # compute copy; Post keeps fp32 masters
    post: Post | None
    if built is not None:
        built.by_layout[key] = (exe, plans)
    if config.switching.mode == "weights":
        post = home_post(world, config, strategy, exe.params, home=home, stage_sync=exe.grad_sync)
        if built is not None and post is not None:
            built.posts[key] = post
    else:  # Post also sums the gradients still partial inside the stage (SP norm weights)
        post = _post(config, exe, world, strategy=strategy, units=units, per_layer=per_layer)
    meter = None
    if config.runtime.measure_memory:
        meter = StateMeter(lambda: state_tensors(exe.params, post))
        if isinstance(post, ShardedPost):
            post.meter = meter.sample
    return Active(
        layout=layout, role=role, exe=exe, plans=plans, post=post, built=built, meter=meter
    )


def _reused(
    world: World, config: TrainConfig, layout: Layout, role: Role, built: Built, *, key: str,
    home: HomeState | None,
) -> Active:  # fmt: skip
    """The mixed-length mode's executable and boundary plans built before for ``key``, with
    a Post over ``home`` (the one built before if it holds the same home)."""
    exe, plans = built.by_layout[key]
    built.reused += 1
    reused = built.posts.get(key)
    if reused is None or reused.home is not home:
        reused = home_post(world, config, layout.strategy, exe.params, home=home,
                           stage_sync=exe.grad_sync)  # fmt: skip
        if reused is not None:
            built.posts[key] = reused
    return Active(layout=layout, role=role, exe=exe, plans=plans, post=reused, built=built)


def _exe_options(config: TrainConfig, strategy: Strategy) -> StrategyOptions:
    """The options the executable is built with: ZeRO and bf16 change only Pre/Post, so
    the executable graph is the fp32 one (sequence parallel and per-layer recompute are
    the executable's)."""
    options = strategy_options(config, strategy)
    return dataclasses.replace(options, zero=0, zero_shares=(), dtype="fp32")


def _executable(
    world: World, config: TrainConfig, strategy: Strategy
) -> tuple[Executable, tuple[Unit, ...], bool]:
    """This rank's executable under ``strategy``, bound to the world; under ZeRO-3 in lock
    step also its gather points (per layer, placed before the recompute split)."""
    model = config.model_config()
    options = _exe_options(config, strategy)
    per_layer = config.zero == 3 and _lock_step(config, strategy)
    exe = bind_executable(build_executable(
        model, _unrecomputed(strategy) if per_layer else strategy,
        dataclasses.replace(options, recompute=False) if per_layer else options,
        world.rank, seq_len=config.batch.seq_len, seed=config.seed,
    ), world)  # fmt: skip
    names = {n: n for n in model.parameter_shapes() if n in exe.params}  # model order
    units = insert_points(exe.graph_module, names) if per_layer else ()
    if per_layer:  # the points ride into the recomputed layers' submodules
        exe.graph_module = _recompute(exe, strategy, options)
    return exe, units, per_layer


def _lock_step(config: TrainConfig, strategy: Strategy) -> bool:
    """Whether the replicas meet every parameter's uses in one order (``lock_step``; packed
    steps drop empty micro-batches per pipeline, so they never do)."""
    return lock_step(strategy) and not config.batch.packed


def _unrecomputed(strategy: Strategy) -> Strategy:
    """``strategy`` with no stage recomputing (``:RC0``): ZeRO-3 splits per layer later."""
    return Strategy(tuple(
        dataclasses.replace(p, stages=tuple(dataclasses.replace(s, recompute=0) for s in p.stages))
        for p in strategy.pipelines
    ))  # fmt: skip


def _recompute(
    exe: Executable, strategy: Strategy, options: StrategyOptions
) -> torch.fx.GraphModule:
    """The executable's graph split for the layers its stage recomputes (as
    ``build_executable`` does; unchanged where none)."""
    stage = strategy.pipelines[exe.pipeline].stages[exe.stage]
    count = stage.recomputed(options)
    if not count:
        return exe.graph_module
    gm = checkpoint_layers(exe.graph_module, upto=stage.first_layer + count - 1)
    kept = {id(p) for p in exe.params.values()}
    assert all(id(p) in kept for p in gm.parameters()), "the split copied a parameter"
    return gm


def switch_weights(
    world: World, config: TrainConfig, active: Active, target: Strategy, *,
    rederive: bool = False,
) -> tuple[Active, int]:  # fmt: skip
    """The mixed-length switch (``hspmd.train.loop.switch_to`` under ``--switch-mode
    weights``): one fused BSR of the compute weights from ``active``'s strategy to ``target``,
    the new strategy built around the same home state. ``rederive``: skip the move and
    gather the new compute weights from home instead (for comparison). Returns the new
    part and the messages this rank sent."""
    model = config.model_config()
    post = active.post if isinstance(active.post, HomePost) else None
    home, built = active.home, active.built
    moved: dict[str, torch.Tensor] = {}
    with count_comm(world) as log:
        if not rederive:
            dtype = post.dtype if post is not None else torch.float32
            source = active.layout.strategy
            plan = plan_weight_switch(model, source, target, itemsize=dtype.itemsize)
            params = active.exe.params if active.exe is not None else {}
            moved = run_weight_switch(plan, params, world, dtype=dtype)
    del active, post  # the old executable goes before the new one is built
    new = activate(world, config, target, home=home, built=built)
    with count_comm(world) as gather, torch.no_grad():
        if rederive and isinstance(new.post, HomePost):
            new.post.refresh()
        elif new.exe is not None:
            for name, param in new.exe.params.items():
                param.copy_(moved[name])
    return new, log.counts().get("send", 0) + gather.counts().get("send", 0)
