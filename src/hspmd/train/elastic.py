"""Elastic training on one rank: survive dead and hung peers in-process (docs/elastic.md).

The loop of ``hspmd.train.loop`` with a commit point and a recovery (``--resume``: from the
step after the newest checkpoint, loaded onto the first strategy). Every step::

    forward, backward        run_step (tensor-parallel and boundary waits are watched)
    sync                     post.finish_sync(); the pipeline's loss -> store; with
                             --clip-grad-norm the norm's all-reduce and the clipping
    commit                   store counter commit/G/S += 1; wait until every rank of G is in
    optimizer                post.apply() (local); the loss = the reporters' sum (store)
    save                     every --save-every steps
    eval                     every --eval-every steps (hspmd.train.evaluate; watched)

A failure anywhere (``PeerFailure`` from a wait, hspmd.runtime.watch) abandons the step:

1. regroup: rendezvous of generation G' (the launcher published it) and a new default
   process group under a new store prefix;
2. the step in flight committed iff commit/G/S reached G's size (then the ranks that had
   not applied it apply it now, and it is recorded); else nobody applied it;
3. re-plan: rank 0 of G' runs ``hspmd.planner.elastic.replan`` over the surviving ranks
   (``local_cost``), warm-started from the current strategy, and publishes it;
4. move masters and Adam moments from surviving replicas to the new plan, one fused BSR
   (``hspmd.switch.survivors``), build the new executables, load the states;
5. redo the step (same batch) if it had not committed, else go on with the next one (its
   checkpoint and its evaluation, if a failure interrupted them, run on the new plan).

A failure during recovery (phase ``switch``) restarts it from the same source states (the
move never changes them). Where a layer lost every holder: the newest checkpoint of
``--save`` (else of ``--resume``), loaded onto the new plan (steps after it are redone), else a ``TrainError``
naming the lost layers.

Packed variable-length steps (``--tokens-per-step``, ``--plans``): each step's strategy is
chosen from the length-aware set (``hspmd.train.elastic_lengths``), the states switched
to it in place when it changes (phase ``switch``, adopted once every rank has them, as a
recovery's); a re-plan gives a new set for the ranks left (``planner.combined``).

Rank 0 of the current generation reports through ``world.notify``: ``("step", record)``,
``("eval", record)`` and ``("event", {...})`` for ``failure``, ``replan``, ``resumed`` and ``fallback``.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import time
from dataclasses import KW_ONLY, dataclass, field
from functools import partial
from typing import Any

import torch

from hspmd.checkpoint import latest, read_manifest
from hspmd.cost.captured import planning_model
from hspmd.errors import HspmdError
from hspmd.plan.strategy import Strategy, check_strategy, parse_strategy
from hspmd.planner.elastic import replan
from hspmd.planner.local import local_cost
from hspmd.runtime.members import key, read_death
from hspmd.runtime.watch import POLL_S, PeerFailure, Watch, regroup
from hspmd.runtime.world import World
from hspmd.switch.live import run_switch
from hspmd.switch.survivors import lost_states, plan_survivor_switch, renumber_strategy
from hspmd.train.active import Active, Built, activate
from hspmd.train.batches import eval_batches, step_batches
from hspmd.train.clip import clip_gradients
from hspmd.train.config import EvalRecord, StepRecord, TrainConfig, TrainError
from hspmd.train.elastic_lengths import Lengths
from hspmd.train.evaluate import evaluate_rank
from hspmd.train.faults import inject
from hspmd.train.layout import Layout
from hspmd.train.loop import load_checkpoint, prepare_strategies, run_step, save_checkpoint
from hspmd.train.lr import learning_rate
from hspmd.train.packing import record_fields
from hspmd.train.slowdown import slowdown_of

__all__ = ["run_rank_elastic"]


@dataclass(slots=True)
class _Run:
    """What one rank carries across generations."""

    config: TrainConfig
    world: World
    watch: Watch
    active: Active
    members: tuple[int, ...]  # member of each rank of the strategy's generation
    _: KW_ONLY
    gen: int  # the generation the strategy (and the step's commit counter) belongs to
    step: int = 1
    adam_steps: int = 0
    applied: bool = False  # this rank applied the step in flight
    saved: int = 0  # the last step this rank checkpointed
    resave: int = 0  # a step whose checkpoint a failure interrupted (written after recovery)
    grown: list[int] = field(default_factory=list)  # --grow steps served
    builds: int = 0  # executables built on this rank (TrainResult.builds)
    records: list[StepRecord] = field(default_factory=list)
    grad_norm: float | None = None  # of the step in flight, once clipped
    evals: list[EvalRecord] = field(default_factory=list)
    evaluated: int = 0  # the last step this rank evaluated after
    reeval: int = 0  # a step whose evaluation a failure interrupted (run after recovery)
    first: int = 1  # the run's first step here (after --resume: the checkpoint's next)
    held: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # eval batches
    lengths: Lengths | None = None  # packed steps: the length-aware set and the documents
    fields: dict[str, Any] = field(default_factory=dict)  # the step record's packed fields
    switching: tuple[Active, int] | None = None  # a step's switch not yet adopted (its step)

    def store(self, fn: Any) -> Any:
        return self.watch.store_call(fn)

    def notify(self, kind: str, payload: Any) -> None:
        if self.world.rank == 0 and self.world.notify is not None:
            self.world.notify((kind, payload))


def _reporters(active: Active) -> list[int]:
    """The ranks whose loss sum is a pipeline's (its last stage's first rank)."""
    return [p.stages[-1].ranks[0] for p in active.layout.strategy.pipelines]


def _build(world: World, config: TrainConfig, strategy: Strategy, watch: Watch) -> Active:
    """The executables of ``strategy`` on this rank (its groups first: ``new_group`` is a
    collective of the whole generation, so it is watched like any wait)."""
    watch.run(partial(prepare_strategies, world, config, [strategy]))
    watch.unwatched()  # building executables: local work, no hang check
    return activate(world, config, strategy)


def _encode(strategy: Strategy) -> str:
    """A strategy as it crosses the store between ranks (grow requests, published plans):
    its text form, which ``_decode`` reads back exactly (the one decode of a strategy in
    ``train``; every other place passes the value)."""
    return str(strategy)


def _decode(text: str) -> Strategy:
    """``_encode``'s inverse."""
    return parse_strategy(text)


def run_rank_elastic(world: World, config: TrainConfig) -> dict[str, Any]:
    """Train ``config`` elastically on this rank (module docstring); the step records and
    this rank's parameter pieces, as ``hspmd.train.loop.run_rank``."""
    assert config.strategy is not None and world.store is not None
    watch = Watch(world.store, world.member, deadline_s=world.timeout.total_seconds())
    world.waiter = watch.wait
    if world.rank < 0:  # a spare: wait for a growth, then recover into it
        run, data, batch = _spare(world, config, watch)
        data, batch = _recover(run, PeerFailure(run.gen), data, batch)
    else:
        active = _build(world, config, config.strategy, watch)
        run = _Run(config, world, watch, active, tuple(range(world.world_size)), gen=0, builds=1)
        run.lengths = Lengths(config) if config.batch.packed else None
        if config.checkpoint.resume:
            _resume(run, config.checkpoint.resume)
        # packed steps are drawn by step number (``_packed``), fixed batches in order
        data = (
            itertools.repeat(None) if config.batch.packed else step_batches(config, first=run.step)
        )
        batch = next(data, None)  # None: a checkpoint at --steps leaves nothing to do
    try:
        while run.step <= config.steps:
            try:
                _grow(run)
                if run.lengths is not None:
                    batch = _packed(run, run.lengths)
                _step(run, batch)
                if _save_due(run):
                    _save(run)
                if _eval_due(run):
                    _evaluate(run, step=run.step)
            except PeerFailure as failure:
                data, batch = _recover(run, failure, data, batch)
                continue
            run.step += 1
            run.applied = False
            if run.step <= config.steps:
                batch = next(data)
    finally:
        watch.stop()
    pieces = {}
    if run.active.exe is not None:
        for name, p in run.active.exe.params.items():
            region = run.active.exe.pieces[name].region
            pieces[name] = (region, p.detach().float().cpu().numpy().copy())
    return {"pieces": pieces, "records": run.records, "evals": run.evals, "builds": run.builds}


def _resume(run: _Run, directory: str) -> None:
    """``--resume``: the newest checkpoint in ``directory``, loaded onto the first strategy
    (resharded as any checkpoint); the run goes on at the step after it."""
    state = load_checkpoint(run.world, run.config, run.active, directory=directory)
    if state.data_position != state.step:
        raise TrainError(
            f"checkpoint in {directory} has data position {state.data_position} at step "
            f"{state.step}: resume from a checkpoint of hspmd train"
        )
    run.step, run.adam_steps, run.saved = state.step + 1, state.adam_step, state.step
    run.first = run.step


def _grow(run: _Run) -> None:
    """Before a ``--grow`` step: rank 0 asks the launcher for spares (``grow/I``, with the
    run's position for the spares), then every rank waits for the new generation
    (``PeerFailure``: the recovery takes the spares in)."""
    steps = [step for step, _ in run.config.elastic.grow]
    if run.step not in steps or run.step in run.grown:
        return
    run.grown.append(run.step)
    index = steps.index(run.step)
    if run.world.rank == 0:
        request = {
            "count": dict(run.config.elastic.grow)[run.step], "step": run.step, "gen": run.gen,
            "members": list(run.members), "strategy": _encode(run.active.strategy),
            "adam_steps": run.adam_steps, "grown": run.grown,
        }  # fmt: skip
        run.store(lambda s: s.set(key("grow", index), json.dumps(request)))
    run.watch.enter("grow", run.step)
    with run.watch.waiting_on_peers():
        while True:
            run.watch.check()
            time.sleep(POLL_S)


def _spare(world: World, config: TrainConfig, watch: Watch) -> tuple[_Run, Any, Any]:
    """Wait until a growth takes this spare; its run, as an idle rank of the strategy that
    ran then, positioned at the growth's step."""
    name = key("joined", world.member)
    while not watch.store_call(lambda s: s.check([name])):
        time.sleep(POLL_S)
    index = int(watch.store_call(lambda s: s.get(name)))
    request = json.loads(watch.store_call(lambda s: s.get(key("grow", index))))
    model = config.model_config()
    layout = Layout(_decode(request["strategy"]), model.num_layers)
    run = _Run(
        config, world, watch, Active(layout=layout), tuple(request["members"]),
        gen=request["gen"], step=request["step"], adam_steps=request["adam_steps"],
        grown=list(request["grown"]), lengths=Lengths(config) if config.batch.packed else None,
    )  # fmt: skip
    data = itertools.repeat(None) if config.batch.packed else step_batches(config, first=run.step)
    return run, data, next(data)


def _step(run: _Run, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    config, world, watch, active = run.config, run.world, run.watch, run.active
    step, member = run.step, world.member
    begin = time.perf_counter()

    def phase(name: str) -> None:
        watch.enter(name, step)
        inject(config.faults.inject, member=member, step=step, phase=name, watch=watch)

    phase("forward")
    role, exe, plans, post = active.role, active.exe, active.plans, active.post
    if role is not None and exe is not None and plans is not None and post is not None:
        post.zero_grad()
        value = run_step(
            exe, role, plans, config, world, batch, step=step, post=post,
            slow=slowdown_of(config.faults.slowdown, member), on_action=phase,
        )  # fmt: skip
        phase("sync")
        post.finish_sync()
        if world.rank in _reporters(active):
            run.store(lambda s: s.set(key("loss", run.gen, step, world.rank), repr(value)))
    else:
        phase("sync")
    if config.adam.clip_grad_norm is not None:  # every rank, before the commit: watched
        run.grad_norm = float(clip_gradients(post, world, max_norm=config.adam.clip_grad_norm))
    _commit(run)
    phase("optimizer")
    if post is not None:
        post.apply()
    run.applied = True
    run.adam_steps += 1
    _record(run, seconds=time.perf_counter() - begin)


def _commit(run: _Run) -> None:
    """Count this rank in; wait until every rank of the generation is (or a failure)."""
    name = key("commit", run.gen, run.step)
    count = run.store(lambda s: s.add(name, 1))
    pause = 0.0005
    with run.watch.waiting_on_peers():
        while count < len(run.members):
            run.watch.check()
            time.sleep(pause)
            pause = min(pause * 2, POLL_S)
            count = run.store(lambda s: s.add(name, 0))


def _record(run: _Run, *, seconds: float) -> None:
    """The step's loss from the reporters' store entries; rank 0 reports it."""
    losses = [
        float(run.store(lambda s, r=r: s.get(key("loss", run.gen, run.step, r))))
        for r in _reporters(run.active)
    ]
    record = StepRecord(
        step=run.step, loss=float(sum(losses)), seconds=seconds,
        lr=learning_rate(run.config.optimizer, run.adam_steps), grad_norm=run.grad_norm,
        **{"tokens": run.config.tokens_per_step, **run.fields},
    )  # fmt: skip
    run.records.append(record)
    run.notify("step", record)


def _save(run: _Run) -> None:
    run.watch.enter("save", run.step)
    inject(
        run.config.faults.inject,
        member=run.world.member,
        step=run.step,
        phase="save",
        watch=run.watch,
    )
    save_checkpoint(
        run.world, run.config, run.active, directory=run.config.checkpoint.save or "",
        step=run.step, steps=run.adam_steps,
    )  # fmt: skip
    run.saved = run.step


def _save_due(run: _Run) -> bool:
    config = run.config
    return (
        bool(config.checkpoint.save)
        and run.step % config.checkpoint.every == 0
        and run.saved != run.step
    )


def _eval_due(run: _Run) -> bool:
    return run.config.evaluation.due(run.step) and run.evaluated != run.step


def _evaluate(run: _Run, *, step: int) -> None:
    """The held-out evaluation after ``step`` (committed) under the active strategy. Every
    rank that finishes it (its all-reduce had every rank's part) leaves the record in the
    store: a recovery redoes it only where no rank did (``_settle``)."""
    run.watch.enter("eval", step)
    inject(
        run.config.faults.inject, member=run.world.member, step=step, phase="eval", watch=run.watch
    )
    run.held = run.held or eval_batches(run.config)
    record = evaluate_rank(run.world, run.config, run.active, run.held, step=step)
    value = json.dumps([record.loss, record.batches, record.tokens, record.seconds])
    run.store(lambda s: s.set(key("eval", step), value))
    _keep(run, record)


def _keep(run: _Run, record: EvalRecord) -> None:
    """``record`` is this rank's evaluation of its step (once); rank 0 reports it."""
    run.evaluated = max(run.evaluated, record.step)
    if all(e.step != record.step for e in run.evals):
        run.evals.append(record)
        run.notify("eval", record)


def _eval_settled(run: _Run, step: int) -> bool:
    """The evaluation after ``step`` is not due or some rank finished it (then this rank
    keeps its record): nothing to redo."""
    if step < run.first or not run.config.evaluation.due(step):
        return True
    name = key("eval", step)
    if not run.store(lambda s: s.check([name])):
        return False
    loss, batches, tokens, seconds = json.loads(run.store(lambda s: s.get(name)))
    _keep(run, EvalRecord(step=step, loss=loss, batches=batches, tokens=tokens, seconds=seconds))
    return True


@dataclass(frozen=True, slots=True, kw_only=True)
class _Moved:
    """A new generation's state, built and loaded, adopted once every member has it."""

    active: Active
    members: tuple[int, ...]
    gen: int
    moved_bytes: float | None  # None: loaded from a checkpoint
    strategy: Strategy
    plan_seconds: float
    strategies: tuple[Strategy, ...] = ()  # packed steps: the new set (new numbers)


def _recover(run: _Run, failure: PeerFailure, data: Any, batch: Any) -> tuple[Any, Any]:
    """Regroup, settle the step in flight, re-plan, move the states (module docstring);
    the data stream and the batch to run next. Retries while members keep failing: the
    move never changes the source states, and a moved state is adopted only once every
    member of its generation has it (the counter ``moved/G``, decided as commits are)."""
    config, world, watch = run.config, run.world, run.watch
    began = detected = failure.detected_at
    reported: set[int] = set()
    pending: _Moved | None = None
    while True:
        try:
            members = regroup(world, watch)
            _settle_switch(run)
            if pending is not None and _count(run, "moved", pending.gen) >= len(pending.members):
                _adopt(run, pending)
            pending = None
            _report_deaths(run, members, detected, reported)
            joined = [m for m in members if m not in run.members and m not in reported]
            if joined:
                reported.update(joined)
                run.notify("event", {"event": "grow", "ranks": joined, "step": run.step})
            batch = _settle(run, data, batch)
            pending = _replan_and_move(run, members)
            _arrive(run, "moved", pending.gen, len(members))
            _adopt(run, pending)
            break
        except PeerFailure as again:  # a member failed during recovery: again, from settled states
            detected = again.detected_at
    used = set(pending.strategy.ranks)
    if pending.moved_bytes is None and not config.batch.packed:  # the checkpoint's steps again
        data = step_batches(config, first=run.step)
        batch = next(data)
    event = {
        "event": "replan",
        "strategy": str(pending.strategy),
        "plan_seconds": pending.plan_seconds,
        "idle": [m for r, m in enumerate(pending.members) if r not in used],  # launch ranks
    }
    if pending.strategies:  # packed steps: the set the steps now choose from
        event["strategies"] = [str(s) for s in pending.strategies]
    run.notify("event", event)
    run.notify(
        "event",
        {
            "event": "resumed",
            "step": run.step,
            "recovery_seconds": round(time.time() - began, 6),
            "moved_bytes": pending.moved_bytes,
        },
    )
    return data, batch


def _settle(run: _Run, data: Any, batch: Any) -> Any:
    """The step in flight: finished if it committed (apply, record, save), else left to
    redo. Returns the batch to run next."""
    if not run.applied and _count(run, "commit", run.gen, run.step) >= len(run.members):
        if run.active.post is not None:  # every rank had synced and clipped: apply here too
            run.active.post.apply()
        run.applied = True
        run.adam_steps += 1
        _record(run, seconds=0.0)
    if run.applied:
        run.resave = run.step if _save_due(run) else 0
        run.step += 1
        run.applied = False
        if run.step <= run.config.steps:
            batch = next(data)
    # the last committed step's evaluation: every rank decides alike (by the store), the
    # ones that finished it and the ones a failure stopped in it
    run.reeval = 0 if _eval_settled(run, run.step - 1) else run.step - 1
    return batch


def _count(run: _Run, what: str, *parts: int) -> int:
    name = key(what, *parts)
    return int(run.store(lambda s: s.add(name, 0)))


def _arrive(run: _Run, what: str, gen: int, size: int, *more: int) -> None:
    """Count this rank in ``what/gen/...`` and wait for ``size`` (or a failure)."""
    name = key(what, gen, *more)
    count = run.store(lambda s: s.add(name, 1))
    with run.watch.waiting_on_peers():
        while count < size:
            run.watch.check()
            time.sleep(POLL_S)
            count = run.store(lambda s: s.add(name, 0))


def _adopt(run: _Run, moved: _Moved) -> None:
    run.active, run.members, run.gen = moved.active, moved.members, moved.gen
    if run.lengths is not None:
        run.lengths.commit()
    if run.resave:  # the interrupted checkpoint, written again from the new plan
        step, run.step = run.step, run.resave
        _save(run)
        run.step, run.resave = step, 0
    if run.reeval:  # the interrupted evaluation, on the new plan (the same weights)
        _evaluate(run, step=run.reeval)
        run.reeval = 0


def _report_deaths(
    run: _Run, members: tuple[int, ...], detected: float, reported: set[int]
) -> None:
    for member in run.members:
        if member in members or member in reported:
            continue
        reported.add(member)
        death = run.store(lambda s, m=member: read_death(s, m))
        run.notify(
            "event",
            {
                "event": "failure",
                "rank": member,
                "phase": death.phase,
                "step": death.step,
                "cause": death.cause,
                "exit_code": death.exitcode,
                "failed_at": round(death.failed_at, 6),
                "detected_after_s": round(max(0.0, detected - death.failed_at), 6),
            },
        )


def _replan_and_move(run: _Run, members: tuple[int, ...]) -> _Moved:
    """Re-plan over the survivors and move the states there (or load the checkpoint where
    states were lost); the result, not adopted yet."""
    config, world, watch = run.config, run.world, run.watch
    model = config.model_config()
    source = run.active.strategy
    renumbered = {r: members.index(m) for r, m in enumerate(run.members) if m in members}
    dead = [r for r, m in enumerate(run.members) if m not in members]
    joined = [m for m in members if m not in run.members]  # spares: numbered after the old
    renumbered.update({len(run.members) + i: members.index(m) for i, m in enumerate(joined)})
    planned, plan_seconds = _plan(run, members, source, renumbered)
    target = renumber_strategy(planned, renumbered)
    lost = lost_states(model, source, dead)
    if lost:
        return _fallback(run, members, target, lost, plan_seconds)
    watch.enter("switch", run.step)
    inject(config.faults.inject, member=world.member, step=run.step, phase="switch", watch=watch)
    switch = plan_survivor_switch(model, source, target, renumbered=renumbered)
    state = run.active.post.state() if run.active.post is not None else {}
    moved, _ = run_switch(switch, state, world)
    active = _build(world, config, target, watch)
    run.builds += 1
    if active.post is not None:
        active.post.load_state(moved, steps=run.adam_steps)
    sent = float(sum(switch.sent_bytes().values()))
    strategies = run.lengths.pending_strategies() if run.lengths is not None else ()
    return _Moved(active=active, members=members, gen=watch.gen, moved_bytes=sent,
                  strategy=target, plan_seconds=plan_seconds, strategies=strategies)  # fmt: skip


def _plan_record(
    run: _Run, members: tuple[int, ...], source: Strategy, renumbered: dict[int, int]
) -> dict[str, Any]:
    """Rank 0's plan for the ranks left (old numbers): the elastic planner's strategy, or
    under packed steps a length-aware set (``Lengths.replan_record``); a strategy in it
    is a value (``_plan`` encodes it for the store)."""
    config = run.config
    if run.lengths is not None:
        joined = tuple(m for m in members if m not in run.members)
        return run.lengths.replan_record(members=run.members, joined=joined,
                                         alive=sorted(renumbered))  # fmt: skip
    plan = replan(
        planning_model(config.model_config()), local_cost(max(len(run.members), max(renumbered) + 1)),
        alive=sorted(renumbered),
        current=source, global_batch=config.batch.global_batch, seq_len=config.batch.seq_len,
        dtype=config.options.dtype,
    )  # fmt: skip
    check_strategy(
        plan.strategy, config.model_config(), global_batch=config.batch.global_batch,
        options=config.options, seq_len=config.batch.seq_len,
    )  # fmt: skip
    return {"strategy": plan.strategy, "plan_seconds": plan.plan_seconds}


def _plan(
    run: _Run, members: tuple[int, ...], source: Strategy, renumbered: dict[int, int]
) -> tuple[Strategy, float]:
    """Rank 0 of the new generation plans (in the old numbers) and publishes; the others
    read it. Returns the strategy (old numbers) and the planner's seconds."""
    world, watch = run.world, run.watch
    name = key("plan", watch.gen, run.gen, run.step)
    record: dict[str, Any]
    if world.rank == 0:
        watch.unwatched()
        try:
            record = _plan_record(run, members, source, renumbered)
            if "strategy" in record:
                record["strategy"] = _encode(record["strategy"])
        except HspmdError as error:
            record = {"error": f"no plan for the {len(members)} ranks left: {error}"}
        run.store(lambda s: s.set(name, json.dumps(record)))
    else:
        with watch.waiting_on_peers():
            while not run.store(lambda s: s.check([name])):
                watch.check()
                time.sleep(POLL_S)
        record = json.loads(run.store(lambda s: s.get(name)))
    if "error" in record:
        raise TrainError(record["error"])
    if "strategy" in record:
        record["strategy"] = _decode(record["strategy"])
    if run.lengths is not None:  # the redo step's strategy of the new set
        strategy = run.lengths.take(record, step=run.step, renumbered=renumbered)
        return strategy, float(record["plan_seconds"])
    return record["strategy"], float(record["plan_seconds"])


def _fallback(
    run: _Run, members: tuple[int, ...], target: Strategy, lost: list[str], plan_seconds: float
) -> _Moved:
    """Every holder of ``lost`` died: the newest checkpoint, loaded onto ``target``; the
    run goes back to the step after it."""
    config, world = run.config, run.world
    layers = sorted({n.split(".")[1] for n in lost if n.startswith("layers.")}, key=int)
    what = f"layers {', '.join(layers)}" if layers else ", ".join(lost[:3])
    directory = next(
        (d for d in (config.checkpoint.save, config.checkpoint.resume) if d and _has_checkpoint(d)),
        None,
    )
    if directory is None:
        raise TrainError(
            f"every replica of {what} died and there is no checkpoint to fall back to: "
            "train with --save DIR --save-every N"
        )
    active = _build(world, config, target, run.watch)
    run.builds += 1
    state = load_checkpoint(world, config, active, directory=directory)
    run.step, run.adam_steps, run.applied, run.resave = state.step + 1, state.adam_step, False, 0
    run.records = [r for r in run.records if r.step <= state.step]
    # steps after the checkpoint come again, with their evaluations; one of the checkpoint's
    # step that a failure interrupted runs on the loaded weights (the same)
    run.evals = [e for e in run.evals if e.step <= state.step]
    run.evaluated = min(run.evaluated, state.step)
    run.reeval = run.reeval if run.reeval == state.step else 0
    run.notify(
        "event",
        {"event": "fallback", "lost": what, "checkpoint_step": state.step, "strategy": str(target)},
    )
    return _Moved(active=active, members=members, gen=run.watch.gen, moved_bytes=None,
                  strategy=target, plan_seconds=plan_seconds)  # fmt: skip


def _has_checkpoint(directory: str) -> bool:
    try:
        read_manifest(latest(directory))
    except (HspmdError, OSError):
        return False
    return True


def _packed(run: _Run, lengths: Lengths) -> Any:
    """The step's packed batch under the strategy the set chooses for it, switching the
    states to that strategy first where it is not the one running (``_switch``)."""
    choice = lengths.choose(run.step, run.active.strategy)
    switched = None
    if choice.strategy != run.active.strategy:
        began = time.perf_counter()
        _switch(run, choice.strategy)
        switched = round(time.perf_counter() - began, 6)
    run.fields = {
        **record_fields(choice.batch), "strategy": str(run.active.strategy),
        "switch_seconds": switched,
    }  # fmt: skip
    return choice.batch


def _switch(run: _Run, target: Strategy) -> None:
    """Move masters and Adam moments to ``target`` (one fused BSR, the ranks unchanged)
    and build it; adopted once every rank of the generation has it (``switched/G/S``), as
    a recovery's move: a failure during it leaves the states where they were. A target
    that differs in micro-batch counts only keeps the executables and states as they are
    (every rank decides alike, nothing moves)."""
    config, world, watch = run.config, run.world, run.watch
    watch.enter("switch", run.step)
    inject(config.faults.inject, member=world.member, step=run.step, phase="switch", watch=watch)
    layout = Layout(target, config.model_config().num_layers)
    if _only_counts(run.active.layout.strategy, layout.strategy):  # same executables, states
        role = layout.role(world.rank)
        run.active = dataclasses.replace(run.active, layout=layout, role=role)
        return
    same = {r: r for r in range(len(run.members))}
    switch = plan_survivor_switch(
        config.model_config(), run.active.layout.strategy, target, renumbered=same
    )
    state = run.active.post.state() if run.active.post is not None else {}
    moved, _ = run_switch(switch, state, world)
    active = _build(world, config, target, watch)
    run.builds += 1
    if active.post is not None:
        active.post.load_state(moved, steps=run.adam_steps)
    run.switching = (active, run.step)
    _arrive(run, "switched", run.gen, len(run.members), run.step)
    run.active, run.switching = active, None


def _only_counts(a: Strategy, b: Strategy) -> bool:
    """Whether ``a`` and ``b`` differ in micro-batch counts only: the executables, boundary
    plans (built per micro-batch of ``micro_batch_size`` rows) and states are the same."""
    sizes = [p.micro_batch_size for p in a.pipelines] == [p.micro_batch_size for p in b.pipelines]
    return sizes and Built.key(a) == Built.key(b)


def _settle_switch(run: _Run) -> None:
    """After a failure: a step's switch that every rank finished is adopted (some ranks
    may have before the failure), else dropped (the states it moved from are intact)."""
    if run.switching is None:
        return
    active, step = run.switching
    if _count(run, "switched", run.gen, step) >= len(run.members):
        run.active = active
    run.switching = None
