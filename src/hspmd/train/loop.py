"""One rank's training loop: run the schedule, sync gradients, step Adam, report the loss.

Each rank runs its executable graph (``hspmd.specialize.executable``): its stage of the
model on local tensors, tensor-parallel communication inside. Per step, for each action of
the rank's schedule (``hspmd.specialize.schedule``)::

    F m   stage 0 feeds micro-batch m's tokens (``--dataset``: its rows of every field,
          the first as the stage input); other stages receive the activation by
          the boundary's resolved plan (send-recv, or BSR between different TP degrees);
          every stage gets the dropout key: the step and the micro-batch's rows of the
          step's global batch (decision 17, ``hspmd.randomness``); the last stage's loss
          is scaled by mb_tokens / global_tokens (decision 6; a dataset's: items)
    B m   the last stage backpropagates its scaled loss; the others backpropagate the
          gradient received from the next stage; all but stage 0 send their input's grad
    Post  gradients synchronized across pipelines by resolved plans (hspmd.train.sync:
          all-reduce / split-all-reduce), clipped to the global norm (hspmd.train.clip;
          with ``clip_grad_norm``), then AdamW on the local parameters at the step's
          learning rate (hspmd.train.lr); the plans start during the rank's last B, as
          gradients become final (hspmd.train.overlap; ``TrainConfig.runtime.overlap=False``: all
          after it)

With ``TrainConfig.batch.grad_accum`` N the schedule runs N times per step, once per global
batch, the gradients adding up (each micro-batch's loss weighted by 1/N more); Post runs
once, after the last.

With ``TrainConfig.batch.step_tokens`` each step is packed documents of varying length
(``hspmd.train.packing``): the executable and boundary plans are built once, at the maximum
length ``seq_len``, and sized to each micro-batch (``hspmd.comm.sizing``); no rebuild.

With ``TrainConfig.faults.slowdown`` a listed rank sleeps ``(factor - 1)`` times the wall time of
each F and B compute and of Post's step after it (``hspmd.train.slowdown``).

With ``TrainConfig.evaluation``, every N-th step is followed by a held-out evaluation: the
forward-only schedule on fixed batches, no backward (``hspmd.train.evaluate``).

The reported loss is one all-reduce (sum) of the scaled losses: the global mean token loss.
Sends are ``isend`` (waited at the end of the step): 1F1B deadlocks with blocking sends.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, Protocol

import torch
import torch.distributed as dist

from hspmd.checkpoint import (
    RankState,
    commit_rank_states,
    latest,
    load_rank_state,
    read_manifest,
    save_rank_state,
)
from hspmd.models.spec import ModelSpec, stream_shape
from hspmd.plan.params import ParamSpec, state_annotations
from hspmd.plan.strategy import Strategy
from hspmd.randomness import dropout_key
from hspmd.runtime.boundary import Pending, recv, send
from hspmd.runtime.counting import count_comm
from hspmd.runtime.trace import NULL, Recorder, Spans
from hspmd.runtime.world import World, plan_groups
from hspmd.specialize.boundary import BoundaryPlans, sized_boundaries
from hspmd.specialize.executable import executable_groups
from hspmd.specialize.schedule import Action, Schedule, make_schedule
from hspmd.switch.live import plan_switch, run_switch, switch_topology
from hspmd.train.active import Active, activate, switch_weights
from hspmd.train.batches import accumulation_passes, eval_batches, step_batches
from hspmd.train.clip import clip_gradients
from hspmd.train.config import EvalRecord, Record, StepRecord, TrainConfig, TrainError
from hspmd.train.evaluate import evaluate_rank
from hspmd.train.faults import inject
from hspmd.train.home import home_annotations, run_ranks
from hspmd.train.identity import model_identity
from hspmd.train.layout import Role
from hspmd.train.lr import learning_rate
from hspmd.train.meter import StateMeter
from hspmd.train.packing import (
    PackedStep,
    packed_steps,
    planned_steps,
    record_fields,
)
from hspmd.train.plan_ahead import PlanAhead
from hspmd.train.post import Post
from hspmd.train.slowdown import Slowdown, slowdown_of
from hspmd.train.sync import grad_sync_plan
from hspmd.train.zero import zero1_plan

__all__ = [
    "StageProgram",
    "load_checkpoint",
    "save_checkpoint",
    "prepare_all",
    "prepare_strategies",
    "post_step",
    "run_rank",
    "switch_to",
]


class StageProgram(Protocol):
    """What a rank runs for one micro-batch: ``forward(tokens or activation, targets,
    segments, key)`` (segments: packed documents' ids, or None; key: the dropout key,
    ``hspmd.randomness.dropout_key``)."""

    params: dict[str, torch.Tensor]

    def forward(
        self,
        x: torch.Tensor,
        targets: torch.Tensor | tuple[torch.Tensor, ...],
        segments: torch.Tensor | None = None,
        key: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


Batch = tuple[torch.Tensor, ...] | PackedStep
"""A step's data: the global batch ``(tokens, targets)`` (a dataset's fields: one tensor
each, in the model's input order), or packed micro-batches."""
Rest = torch.Tensor | tuple[torch.Tensor, ...]  # targets, or a dataset's other fields
MicroData = tuple[torch.Tensor, Rest, torch.Tensor | None, float, range | None]


def _micro_batch(
    batch: Batch, role: Role, config: TrainConfig, m: int, *, first_row: int = 0
) -> MicroData:
    """Micro-batch ``m`` of the rank's pipeline: tokens, targets, segments, loss weight
    (its tokens over the step's: DESIGN decision 6), and its rows of the step's batch
    (``first_row``: the accumulation pass's first; None for packed documents), which key
    its dropout masks (decision 17)."""
    if isinstance(batch, PackedStep):
        mb = batch.micro_batches[role.pipeline][m]
        return mb.tokens, mb.targets, mb.segments, batch.scale(role.pipeline, m), None
    size = role.micro_batch_size  # batch: one global batch (an accumulation pass)
    rows = range(role.row_offset + m * size, role.row_offset + (m + 1) * size)
    weight = size / (config.batch.global_batch * config.batch.grad_accum)
    place = range(first_row + rows.start, first_row + rows.stop)
    first, *rest = (t[rows.start : rows.stop] for t in batch)
    return first, rest[0] if len(rest) == 1 else tuple(rest), None, weight, place


@dataclass(slots=True, kw_only=True)
class _Live:
    """Tensors of one step still needed, by micro-batch, and the sends in flight."""

    inputs: dict[int, torch.Tensor] = field(default_factory=dict)
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)
    plans: dict[int, BoundaryPlans] = field(default_factory=dict)  # sized to each length
    sends: list[Pending] = field(default_factory=list)
    loss: float = 0.0
    slow: Slowdown = field(default_factory=Slowdown)  # this rank's emulated slowdown


def _forward(
    program: StageProgram, plans: BoundaryPlans, world: World, live: _Live, *,
    m: int, micro: MicroData, model: ModelSpec, dtype: torch.dtype, step: int,
) -> None:  # fmt: skip
    tokens, targets, segments, scale, rows = micro
    # the data is made on CPU (every rank draws the same stream): onto this rank's device
    # (a dataset's floating fields in the compute dtype, as the weights: --dtype bf16)
    tokens, targets = _to(tokens, world.device, dtype), _to(targets, world.device, dtype)
    segments = None if segments is None else segments.to(world.device)
    key = None if rows is None else dropout_key(step, rows).to(world.device)
    # boundary plans are resolved at the maximum length: sized to this micro-batch's
    length = tokens.shape[1] if tokens.dim() > 1 else 0
    plans = live.plans[m] = sized_boundaries(plans, stream_shape(model, len(tokens), length))
    if plans.incoming is None:
        x = tokens
    else:
        x = recv(plans.incoming.forward, world, dtype=dtype).requires_grad_(True)
    with live.slow:  # the compute only, not the receive
        out = program.forward(x, targets, segments, key)  # recompute: per layer, in the exe
    if plans.outgoing is None:
        out = out * scale
        live.loss += float(out.detach())
    else:
        live.sends += send(plans.outgoing.forward, out.detach(), world)
    live.inputs[m], live.outputs[m] = x, out


def _to(rest: Rest, device: torch.device, dtype: torch.dtype) -> Any:
    """``rest`` on ``device``, its floating tensors in ``dtype`` (integers as they are)."""
    if isinstance(rest, tuple):
        return tuple(_to(t, device, dtype) for t in rest)
    return rest.to(device, dtype if rest.is_floating_point() else rest.dtype)


def _backward(world: World, live: _Live, *, m: int) -> None:
    x, out, plans = live.inputs.pop(m), live.outputs.pop(m), live.plans.pop(m)
    grad = None if plans.outgoing is None else recv(plans.outgoing.backward, world, dtype=out.dtype)
    with live.slow:  # the compute only, not the receive
        out.backward(grad)
    if plans.incoming is not None:
        assert x.grad is not None
        live.sends += send(plans.incoming.backward, x.grad, world)


def run_step(
    program: StageProgram, role: Role, plans: BoundaryPlans, config: TrainConfig,
    world: World, batch: Batch, *, step: int, post: Post | None = None,
    slow: Slowdown | None = None, rec: Spans = NULL,
    on_action: Callable[[str], None] | None = None,
) -> float:  # fmt: skip
    """Every F and B of the rank's schedule on one step's batch, once per accumulation
    pass (``config.batch.grad_accum``: the gradients add up); the scaled loss sum. ``step`` (1,
    2, ...) keys dropout masks with the rows (``hspmd.randomness``): a redone step draws
    the same ones.

    With ``post`` (and ``config.runtime.overlap``), ``post.arm()`` runs before the last B of the
    last pass. With ``slow``, each F and B compute is followed by its sleep
    (``hspmd.train.slowdown``). ``rec`` records a span per F and B
    (``hspmd.runtime.trace``). ``on_action("forward" | "backward")`` runs before each
    action (elastic runs: phase tracking and fault injection)."""
    if isinstance(batch, PackedStep) or config.batch.grad_accum == 1:
        passes: list[Batch] = [batch]
    else:
        passes = list(accumulation_passes(batch, config))
    total = 0.0
    for k, part in enumerate(passes):
        last = k == len(passes) - 1
        total += _run_pass(program, role, plans, config, world, part, post=post if last else None,
                           slow=slow, rec=rec, on_action=on_action, step=step,
                           first_row=k * config.batch.global_batch)  # fmt: skip
    return total


def _run_pass(
    program: StageProgram, role: Role, plans: BoundaryPlans, config: TrainConfig,
    world: World, batch: Batch, *, post: Post | None, slow: Slowdown | None, rec: Spans,
    on_action: Callable[[str], None] | None, step: int, first_row: int,
) -> float:  # fmt: skip
    """One pass of ``run_step``: the schedule on one global batch (``first_row``: its
    first row's place in the step's rows)."""
    schedule = _without_empty(
        make_schedule(config.options.schedule, role.num_stages, role.stage, role.micro_batches),
        batch, role,
    )  # fmt: skip
    live = _Live(slow=slow or Slowdown())
    model = config.model_config()
    dtype = torch.bfloat16 if config.options.dtype == "bf16" else torch.float32
    last_b = max((i for i, a in enumerate(schedule) if a.kind == "B"), default=-1)
    for index, action in enumerate(schedule):
        if on_action is not None:
            on_action("forward" if action.kind == "F" else "backward")
        if action.kind == "F":
            micro = _micro_batch(batch, role, config, action.micro_batch, first_row=first_row)
            with rec.span("F", cat="forward", micro_batch=action.micro_batch, stage=role.stage):
                _forward(program, plans, world, live, m=action.micro_batch, micro=micro,
                         model=model, dtype=dtype, step=step)  # fmt: skip
        elif action.kind == "B":
            if index == last_b and post is not None and config.runtime.overlap:
                post.arm()
            with rec.span("B", cat="backward", micro_batch=action.micro_batch, stage=role.stage):
                _backward(world, live, m=action.micro_batch)
    with rec.span("wait sends", cat="wait"):
        for pending in live.sends:
            pending.wait()
    return live.loss


def _without_empty(schedule: Schedule, batch: Batch, role: Role) -> list[Action]:
    """The schedule's actions but the F and B of empty micro-batches (a packed step with
    fewer documents than a pipeline's micro-batches): every stage of the pipeline drops
    the same ones, so the sends and receives still pair up."""
    if not isinstance(batch, PackedStep):
        return list(schedule)
    empty = {m for m, mb in enumerate(batch.micro_batches[role.pipeline]) if mb.real_tokens == 0}
    return [a for a in schedule if a.kind not in ("F", "B") or a.micro_batch not in empty]


def prepare_all(world: World, config: TrainConfig) -> None:
    """Create the process groups of every strategy of the run, on every rank, at once
    (one deterministic order: DESIGN decision 8)."""
    prepare_strategies(world, config, config.strategies)


def prepare_strategies(world: World, config: TrainConfig, strategies: Sequence[Strategy]) -> None:
    """Create the process groups of ``strategies`` on every rank."""
    model = config.model_config()
    plans, groups = [], []
    for strategy in dict.fromkeys(strategies):
        if config.zero1:
            zero = zero1_plan(strategy, model, shares=config.options.zero_shares)
            plans += [p for z in zero.values() for p in (z.reduce, z.gather)]
        else:
            plans += [
                item.plan
                for item in grad_sync_plan(
                    strategy, model, bucket_bytes=config.runtime.bucket_bytes
                )
            ]
        groups += executable_groups(strategy)
    world.prepare_groups([*plan_groups(plans), *groups])


def switch_to(
    world: World, config: TrainConfig, active: Active, target: Strategy, *, steps: int
) -> tuple[Active, int]:
    """Move the training state from ``active``'s strategy to ``target`` in memory (one fused
    BSR, ``hspmd.switch.live``) and continue under it; ``steps``: Adam's step count.
    Returns the new part and the messages this rank sent. Under ``switch_mode="weights"``
    only the compute weights move (``hspmd.train.home.switch_weights``)."""
    if config.switching.mode == "weights":
        return switch_weights(world, config, active, target)
    model = config.model_config()
    nodes = switch_topology(
        cluster=config.switching.cluster,
        ranks_per_node=config.switching.ranks_per_node,
        num_ranks=world.world_size,
    )
    plan = plan_switch(
        model, active.strategy, target, zero1=config.zero1,
        shares=config.options.zero_shares, compute=config.zero < 3, topology=nodes,
        algo=config.switching.algo, num_ranks=world.world_size,
    )  # fmt: skip
    state = active.post.state() if active.post is not None else {}
    with count_comm(world) as log:
        moved, compute = run_switch(plan, state, world)
    del state, active  # the old strategy's tensors go before the new ones are built
    new = activate(world, config, target)
    if new.post is not None:
        new.post.load_state(moved, steps=steps, compute=compute)
    return new, log.counts().get("send", 0)


def post_step(
    post: Post | None, world: World, config: TrainConfig, *, loss: torch.Tensor,
    meter: StateMeter | None = None,
) -> torch.Tensor | None:  # fmt: skip
    """Post of one step on every rank of the world (``post`` None: idle under the
    strategy): the gradient sync, clipping to ``config.adam.clip_grad_norm`` (one all-reduce
    over the world, ``hspmd.train.clip``, which sums ``loss`` over the world too), the
    optimizer. Returns the global gradient norm before clipping (None without clipping:
    then ``loss`` is still this rank's). ``meter`` samples the state after the sync."""
    if post is not None:
        post.finish_sync()
    if meter is not None:
        meter.sample()
    norm = None
    if config.adam.clip_grad_norm is not None:
        norm = clip_gradients(post, world, max_norm=config.adam.clip_grad_norm, carry=loss)
    if post is not None:
        post.apply()
    return norm


def _timed_switch(
    world: World, config: TrainConfig, active: Active, target: Strategy, *, steps: int
) -> tuple[Active, float, int]:
    """``switch_to`` on every rank; the slowest rank's seconds and the messages sent."""
    begin = time.perf_counter()
    active, sent = switch_to(world, config, active, target, steps=steps)
    took = torch.tensor([time.perf_counter() - begin], dtype=torch.float64, device=world.device)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    messages = torch.tensor([sent], dtype=torch.int64, device=world.device)
    dist.all_reduce(messages)
    return active, float(took), int(messages)


def _state_specs(config: TrainConfig, active: Active) -> dict[str, ParamSpec]:
    """Where the fp32 masters and Adam moments live: the strategy's state annotations, or
    under ``switch_mode="weights"`` the run's home layout (it depends on the run's number
    of ranks, not on the strategy), e.g. ``[0,1,2,3]{0:4}`` for a [64, 64] weight."""
    model = config.model_config()
    if config.switching.mode == "weights":
        return dict(home_annotations(model, num_ranks=run_ranks(config)))
    return state_annotations(
        active.layout.strategy, model, zero1=config.zero1, shares=config.options.zero_shares
    )


def save_checkpoint(
    world: World, config: TrainConfig, active: Active, *, directory: str, step: int, steps: int
) -> None:
    """Write a checkpoint of step ``step`` on every rank (docs/switching.md, "the trainer's
    calls"); masters and moments are saved with their state annotation (their home
    annotation under ``switch_mode="weights"``)."""
    specs = _state_specs(config, active)
    if active.post is not None:
        state = active.post.state()
        save_rank_state(
            directory, step=step, rank=world.rank, param_specs=specs,
            params={n: m for n, (m, _, _) in state.items()},
            exp_avg={n: v for n, (_, v, _) in state.items()},
            exp_avg_sq={n: v for n, (_, _, v) in state.items()},
        )  # fmt: skip
    world.wait([dist.barrier(async_op=True)])  # through the waiter: elastic runs go on
    if world.rank == 0:
        commit_rank_states(
            directory, step=step, model=config.model.source, strategy=str(active.strategy),
            param_specs=specs, adam_step=steps, data_position=step,
            run={**config.data_identity(), **config.recipe_identity()},
            identity=model_identity(config), model_config=_hf_config(config),
        )  # fmt: skip
    world.wait([dist.barrier(async_op=True)])


def _hf_config(config: TrainConfig) -> dict[str, Any] | None:
    """A Hugging Face model's config, for ``hspmd export --format hf`` (None: another model)."""
    text = config.model_config().hf_config
    return json.loads(text) if text else None


def load_checkpoint(
    world: World, config: TrainConfig, active: Active, *, directory: str
) -> RankState:
    """Load the newest checkpoint in ``directory`` into ``active`` (any strategy: resharded
    on load); returns what was loaded (step, Adam step, data position). Under
    ``switch_mode="weights"`` the states load into this run's home layout and the compute
    weights of ``active``'s strategy are derived from them (``HomePost.load_state``)."""
    specs = _state_specs(config, active)
    state = load_rank_state(
        directory, rank=world.rank, param_specs=specs, model=config.model.source
    )
    if active.post is not None:
        moved = {n: (m, state.exp_avg[n], state.exp_avg_sq[n]) for n, m in state.params.items()}
        active.post.load_state(moved, steps=state.adam_step)
    return state


def _resume(world: World, config: TrainConfig) -> tuple[Active, int, int]:
    """The active strategy loaded from ``config.checkpoint.resume``, the first step and
    Adam's steps."""
    assert config.checkpoint.resume is not None
    first = read_manifest(latest(config.checkpoint.resume)).step + 1
    active = activate(world, config, config.strategy_at(first))
    state = load_checkpoint(world, config, active, directory=config.checkpoint.resume)
    if state.data_position != state.step or state.step + 1 != first:
        raise TrainError(
            f"checkpoint in {config.checkpoint.resume} changed while loading or has data position "
            f"{state.data_position} at step {state.step}: resume from a checkpoint of hspmd train"
        )
    return active, first, state.adam_step


@dataclass(slots=True, kw_only=True)
class _RankRun:
    """What ``run_rank`` carries from step to step on one rank."""

    active: Active
    adam_steps: int  # Adam's steps so far
    slow: Slowdown  # this rank's emulated slowdown
    planned: list[Strategy]  # under length plans: the strategies, by plan index
    records: list[StepRecord] = field(default_factory=list)
    evals: list[EvalRecord] = field(default_factory=list)
    executables: set[int] = field(default_factory=set)  # one per strategy, whatever the lengths
    held: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # eval batches
    state_peak: int = 0  # with measure_memory: the state's tracked bytes (hspmd.train.meter)

    def sample_peak(self) -> None:
        meter = self.active.meter
        self.state_peak = max(self.state_peak, meter.peak if meter else 0)


@dataclass(slots=True)
class _Data:
    """The step data of one rank: every rank reads the stream (a rank idle now may train
    after a switch). A worker thread draws the next steps' data while this one trains (a
    step's data depends on its number only, not on when it is drawn); under length plans
    it also plans them, and the loop draws a step before its switch (``ahead``)."""

    stream: Iterator[Batch]
    worker: PlanAhead[Batch]
    ahead: bool

    @staticmethod
    def open(config: TrainConfig, strategy: Strategy, first: int) -> _Data:
        if config.switching.length_plans is not None:
            worker: PlanAhead[Batch] = PlanAhead(planned_steps(config))
            return _Data(islice(worker, first - 1, None), worker, ahead=True)
        worker = PlanAhead(
            islice(packed_steps(config, strategy), first - 1, None)
            if config.batch.packed
            else step_batches(config, first=first)  # drawn by step: nothing replayed
        )
        return _Data(worker, worker, ahead=False)


def run_rank(
    world: World,
    config: TrainConfig,
    *,
    report: Callable[[Record], None] | None = None,
    rec: Spans = NULL,
) -> dict[str, Any]:
    """Train ``config`` on this rank; ranks outside the strategy only join the loss sum.

    ``report(record)`` is called on rank 0 after each step, and after each evaluation
    (``config.evaluation``: every N-th step, ``hspmd.train.evaluate``). Switches
    (``config.switching.switches``) run before their step on every rank. Returns the step records and this rank's
    parameter pieces: name -> (global region, numpy array). ``rec``: a trace
    ``Recorder`` (``hspmd.runtime.trace``) records steps, F, B, Post, switches, saves and
    every communication step.
    """
    if world.device.type == "cuda":  # this run's peak (a launch may run several configs)
        torch.cuda.reset_peak_memory_stats(world.device)
    world.tracer = rec if isinstance(rec, Recorder) else None
    end_setup = rec.begin("setup", cat="setup")  # groups, executables (and a resume)
    prepare_all(world, config)  # every rank, idle ones too, in the same order
    if config.checkpoint.resume:
        active, first, adam_steps = _resume(world, config)
    else:
        active, first, adam_steps = activate(world, config, config.require_strategy()), 1, 0
    run = _RankRun(
        active=active, adam_steps=adam_steps, planned=_planned_strategies(config),
        slow=slowdown_of(config.faults.slowdown, world.rank, device=world.device),
    )  # fmt: skip
    data = _Data.open(config, active.strategy, first)
    end_setup()
    switches = dict(config.switching.switches)
    for step in range(first, config.steps + 1):
        batch = next(data.stream) if data.ahead else None
        target = (
            run.planned[batch.plan or 0] if isinstance(batch, PackedStep) else switches.get(step)
        )
        switched, messages = None, None
        if target is not None and target != run.active.strategy and (data.ahead or step != first):
            run.sample_peak()
            with rec.span("switch", cat="switch", step=step, to=str(target)):
                run.active, switched, messages = _timed_switch(
                    world, config, run.active, target, steps=run.adam_steps
                )
        end_step = rec.begin(f"step {step}", cat="step", step=step)
        batch = next(data.stream) if batch is None else batch
        inject(config.faults.inject, member=world.rank, step=step, phase="forward")  # ends the run
        start = time.perf_counter()
        total, grad_norm = _train_step(world, config, run, batch, step=step, rec=rec)
        end_step()
        run.records.append(StepRecord(
            step=step, loss=total, seconds=time.perf_counter() - start,
            lr=learning_rate(config.optimizer, run.adam_steps), grad_norm=grad_norm,
            switch_seconds=switched, switch_messages=messages,
            strategy=str(run.active.strategy) if switched is not None else None,
            **{"tokens": config.tokens_per_step, **_record_fields(batch)},
        ))  # fmt: skip
        _after_step(world, config, run, step=step, report=report, rec=rec)
    data.worker.close()
    return _outcome(world, run)


def _train_step(
    world: World, config: TrainConfig, run: _RankRun, batch: Batch, *, step: int, rec: Spans
) -> tuple[float, float | None]:
    """One optimizer step on this rank (an idle one joins Post's collectives and the loss
    sum): the global loss and, with clipping, the global gradient norm."""
    active, slow = run.active, run.slow
    loss = torch.zeros(1, dtype=torch.float64, device=world.device)
    role, exe, plans, post = active.role, active.exe, active.plans, active.post
    if role is not None and exe is not None and plans is not None and post is not None:
        post.zero_grad()
        value = run_step(
            exe, role, plans, config, world, batch, step=step, post=post, slow=slow, rec=rec
        )  # fmt: skip
        run.executables.add(id(exe))
        if active.meter is not None:  # every gradient made (ZeRO-0, 1: the peak)
            active.meter.sample()
        end_post = rec.begin("Post", cat="post")
        if role.is_last and role.rank == role.tp_ranks[0]:  # one reporter per pipeline
            loss += value
        with slow:
            grad_norm = post_step(post, world, config, loss=loss, meter=active.meter)
        end_post()
    else:  # an idle rank: its home shards (switch_mode="weights"), the clipping norm
        grad_norm = None
        if post is not None or config.adam.clip_grad_norm is not None:
            with rec.span("Post", cat="post"), slow:
                grad_norm = post_step(post, world, config, loss=loss)
    run.adam_steps += 1
    with rec.span("loss all-reduce", cat="wait"):  # waits for the slowest rank
        if grad_norm is None:  # else summed with the norm's squares (hspmd.train.clip)
            dist.all_reduce(loss)
        total = float(loss)  # on CUDA: waits for the step's kernels too
    return total, None if grad_norm is None else float(grad_norm)


def _after_step(
    world: World, config: TrainConfig, run: _RankRun, *, step: int,
    report: Callable[[Record], None] | None, rec: Spans,
) -> None:  # fmt: skip
    """Report the step's record, then its checkpoint and its evaluation, if due."""
    if report is not None and world.rank == 0:
        report(run.records[-1])
    if config.checkpoint.save and step % config.checkpoint.every == 0:
        with rec.span("save", cat="checkpoint", step=step):
            save_checkpoint(
                world, config, run.active, directory=config.checkpoint.save, step=step,
                steps=run.adam_steps,
            )  # fmt: skip
    if config.evaluation.due(step):
        run.held = run.held or eval_batches(config)
        with rec.span("eval", cat="eval", step=step):
            run.evals.append(evaluate_rank(world, config, run.active, run.held, step=step))
        if report is not None and world.rank == 0:
            report(run.evals[-1])


def _outcome(world: World, run: _RankRun) -> dict[str, Any]:
    """What a rank returns: its parameter pieces, the records, builds and peaks."""
    run.sample_peak()
    active = run.active
    active.gather_params()  # ZeRO-3: the pieces are read whole
    pieces = {}
    if active.exe is not None:
        for name, p in active.exe.params.items():
            # numpy, not tensors: tensors would travel as shared-memory fds
            pieces[name] = (active.exe.pieces[name].region, p.detach().float().cpu().numpy().copy())
    world.tracer = None
    cuda = world.device.type == "cuda"
    peak = torch.cuda.max_memory_allocated(world.device) if cuda else None
    return {"pieces": pieces, "records": run.records, "evals": run.evals,
            "builds": len(run.executables), "rank": world.rank, "peak_memory": peak,
            "state_peak": run.state_peak}  # fmt: skip


def _planned_strategies(config: TrainConfig) -> list[Strategy]:
    """The strategies of a length-plans run, by plan index (empty otherwise)."""
    if config.switching.length_plans is None:
        return []
    return [plan.strategy for plan in config.switching.length_plans.plans]


def _record_fields(batch: Batch) -> dict[str, Any]:
    return record_fields(batch) if isinstance(batch, PackedStep) else {}
