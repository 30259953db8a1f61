"""Train on local processes: check the strategy, launch one process per rank, collect.

>>> from hspmd.plan.strategy import parse_strategy
>>> strategy = parse_strategy("2x2: R0:L0-3; 2x2: R1:L0-3")
>>> config = TrainConfig(strategy=strategy, steps=1)
>>> check_config(config).ranks
(0, 1)

Several configs can share one launch (``train_many``): processes start once and run the
configs one after another; ranks a config does not use only join its loss all-reduce.

Across nodes (``node=NodeSpec(...)``), one launcher per node runs an equal share of the
ranks; each returns the records (the global losses) and the parameter pieces of its own
ranks, the rest of every parameter NaN: ``merge`` joins the nodes' results.
"""

from __future__ import annotations

import dataclasses
import functools
import multiprocessing as mp
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from hspmd.errors import StrategyError
from hspmd.models.build import Sent, check_weights, receive_graphs, sent_graphs
from hspmd.models.spec import ModelSpec
from hspmd.plan.strategy import Strategy, StrategyOptions, check_strategy
from hspmd.runtime.launch import ElasticLaunch, NodeSpec, launch
from hspmd.runtime.trace import NULL, Recorder, chrome_trace, gather_parts
from hspmd.runtime.world import World
from hspmd.specialize.sites import deduced_sites
from hspmd.train.batches import check_data
from hspmd.train.config import Record, TrainConfig, TrainError
from hspmd.train.device import backend_of, run_device
from hspmd.train.elastic import run_rank_elastic
from hspmd.train.elastic_lengths import Lengths
from hspmd.train.identity import check_resume_identity
from hspmd.train.loop import run_rank
from hspmd.train.packing import check_packed_dropout, check_packing, planned_steps
from hspmd.train.reference import TrainResult

__all__ = [
    "assemble", "check_config", "merge", "node_share", "num_processes", "train", "train_elastic",
    "train_many",
]  # fmt: skip


def check_config(config: TrainConfig) -> Strategy:
    """The parsed (first) strategy, refused with a StrategyError if it, or a strategy the
    run switches to, cannot train ``config``."""
    if config.strategy is None:
        raise TrainError("no strategy: give --strategy '...' or use --reference")
    config.check_model()
    _check_strategies(config)
    strategies = config.strategies
    fallbacks(config)  # a model that cannot specialize: one line now, not from a rank later
    strategy = strategies[0]
    used = sorted({r for s in strategies for r in s.ranks})
    if used != list(range(len(used))):
        raise TrainError(
            f"the run's strategies use ranks {used}: number them 0..{len(used) - 1} "
            "without gaps (one local process per rank)"
        )
    slow = [rank for rank, _ in config.faults.slowdown if rank not in used]
    if slow:
        raise TrainError(
            f"slowdown names ranks {slow} that the run's strategies do not use (ranks "
            f"0..{len(used) - 1}): drop them or pick ranks of the strategy"
        )
    for each in strategies if config.elastic.enabled else strategies[:1]:  # each needs replicas
        _check_elastic(config, each, used)
    check_resume_identity(config)  # the checkpoint is whole and holds this model
    check_weights(config.model_config())  # hf:DIR: its weights fit the config, files whole
    if config.checkpoint.save:
        _check_writable(config.checkpoint.save)
    check_data(config)  # one line before launch: empty, too short, ids past the vocabulary
    check_packed_dropout(config)  # packed rows have no batch rows to key dropout by
    _check_first_steps(config, strategy)
    return strategy


def _check_strategies(config: TrainConfig) -> None:
    """Each strategy of the run against the model and the batch, named by its flag when
    the run has several (issue 17)."""
    labels = ["--strategy", *(f"--switch {step}" for step, _ in config.switching.switches)]
    if config.switching.length_plans is not None:
        labels = [f"--plans strategy {str(s)!r}" for s in config.strategies]
    batch = config.batch
    for label, strategy in zip(labels, config.strategies, strict=True):
        try:
            check_strategy(
                strategy,
                config.model_config(),
                # packed steps: rows are documents, not a global batch of samples
                global_batch=strategy.global_batch if batch.packed else batch.global_batch,
                options=config.options,
                seq_len=batch.seq_len,
            )
        except StrategyError as error:
            if len(labels) == 1:
                raise
            raise StrategyError(f"{label}: {error}") from None


def _check_first_steps(config: TrainConfig, strategy: Strategy) -> None:
    """Packed steps: the data and the first step's choice (elastic, length plans), or every
    step's dispatch, before any process starts."""
    batch = config.batch
    if batch.packed and config.elastic.enabled:  # the first step's choice (a later step
        Lengths(config).choose(1, None)  # that does not pack is widened: elastic_lengths)
    elif config.switching.length_plans is not None:  # the data and the first choice
        next(planned_steps(dataclasses.replace(config, steps=1)), None)
    elif batch.packed:
        rows = sum(p.batch_size for p in strategy.pipelines)
        if (batch.step_tokens or 0) > rows * batch.seq_len:
            raise TrainError(
                f"--tokens-per-step {batch.step_tokens} is more than the strategy's {rows} "
                f"rows of --max-seq-len {batch.seq_len} hold ({rows * batch.seq_len}): "
                "lower it, raise --max-seq-len, or give the pipelines more micro-batches"
            )
        check_packing(config, strategy)  # every step's documents fit the rows


def fallbacks(config: TrainConfig) -> tuple[str, ...]:
    """Deduce every pipeline of the run's strategies on the meta device, as ``explain``
    does, and return the ops computed whole on gathered inputs (``hspmd.deduce.fallback``)."""
    model = config.model_config()
    options = config.options
    lines: list[str] = []
    for strategy in dict.fromkeys(config.strategies):
        lines += _deduced(strategy, model, options, config.batch.seq_len)
    return tuple(dict.fromkeys(lines))


@functools.lru_cache(maxsize=8)
def _deduced(
    strategy: Strategy, model: ModelSpec, options: StrategyOptions, seq_len: int
) -> tuple[str, ...]:
    return deduced_sites(strategy, model, options, seq_len=seq_len).fallbacks


def _check_writable(folder: str) -> None:
    """``--save`` must take files before the run spends any time: a checkpoint that fails
    after the steps loses them."""
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".hspmd-probe-"):
            pass
    except OSError as error:
        raise TrainError(
            f"--save {folder!r}: cannot write there ({error.strerror or error}): give a "
            "writable folder"
        ) from None


def _check_elastic(config: TrainConfig, strategy: Strategy, used: list[int]) -> None:
    ranks = len(used) + config.elastic.spares  # spares are the launch ranks after the strategy's
    outside = [str(i) for i in config.faults.inject if i.rank >= ranks]
    if outside:
        raise TrainError(
            f"--inject-failure {outside[0]} names a rank the run does not have (ranks "
            f"0..{ranks - 1})"
        )
    if config.elastic.enabled and len(strategy.pipelines) < 2:
        raise TrainError(
            f"--elastic needs data-parallel redundancy: {strategy} has one pipeline, so a "
            "lost rank loses its layers' only states; give two pipelines or more (e.g. "
            "'2x2: R0:L0-3; 2x2: R1:L0-3')"
        )


def num_processes(config: TrainConfig) -> int:
    """Processes a run needs: the most ranks of any of its strategies (checked first)."""
    check_config(config)
    return 1 + max(max(strategy.ranks) for strategy in config.strategies)


def _rank_work(
    world: World, configs: Sequence[TrainConfig], events: Any, trace: bool, graphs: Sent
) -> list[dict[str, Any]]:
    receive_graphs(graphs)  # the launcher's captures: no rank captures the model again

    def report_for(index: int) -> Callable[[Record], None]:
        return lambda record: events.put((index, record))

    outcomes = []
    for index, config in enumerate(configs):
        rec = Recorder.start(world) if trace else NULL
        outcome = run_rank(world, config, report=report_for(index), rec=rec)
        if isinstance(rec, Recorder):  # every rank's events, on rank 0 (any node)
            outcome["trace"] = gather_parts(world, rec)
        outcomes.append(outcome)
    if world.rank == 0:
        events.put(None)
    return outcomes


def train_many(
    configs: Sequence[TrainConfig],
    *,
    on_step: Callable[[int, Record], None] | None = None,
    timeout_s: float = 600.0,
    threads: int | None = None,
    trace: bool = False,
    node: NodeSpec | None = None,
) -> list[TrainResult]:
    """Train every config in one launch of ``max(ranks)`` processes; results in order.

    ``threads``: torch threads per rank (default: the launcher's, cores // ranks). With
    ``node``, this launcher runs its node's share of the ranks (see the module docstring).
    ``trace``: each result carries the run's Chrome trace (``hspmd.runtime.trace``).
    """
    nproc = max(num_processes(c) for c in configs)
    if node is not None:
        nproc = _even_share(nproc, node)
    devices = {run_device(c, num_ranks=nproc) for c in configs}
    if len(devices) > 1:
        raise TrainError(
            "the configs of one launch run on one device: give them all the same device"
        )
    # A SimpleQueue: rank 0's puts are synchronous (no feeder thread), so every event is in
    # the pipe before its result is sent, and the launcher's clean-up of finished workers
    # can never interrupt a put. Only rank 0 writes; only this thread reads.
    events = mp.get_context("forkserver").SimpleQueue()
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["results"] = launch(
                _rank_work,
                nproc,
                args=(list(configs), events, trace, _graphs(configs)),
                backend=backend_of(devices.pop()),
                timeout_s=timeout_s,
                threads=threads,
                node=node,
            )
        except BaseException as error:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = error

    thread = threading.Thread(target=run, name="hspmd-train-launch", daemon=True)
    thread.start()
    while thread.is_alive() or not events.empty():
        if events.empty():
            thread.join(0.05)
            continue
        event = events.get()
        if event is not None and on_step is not None:
            on_step(*event)
    thread.join()
    if "error" in box:
        raise box["error"]
    return _assemble(box["results"], configs)


def assemble(outcomes: Sequence[dict[str, Any]], config: TrainConfig) -> TrainResult:
    """A result from ``run_rank``'s outcomes of one config, one per rank run (any launcher:
    under torchrun, every rank's outcome gathered by hand); missing pieces stay NaN."""
    return _assemble([[o] for o in outcomes], [config])[0]


def _assemble(
    per_rank: list[list[dict[str, Any]]], configs: Sequence[TrainConfig]
) -> list[TrainResult]:
    results = []
    for index, config in enumerate(configs):
        shapes = config.model_config().parameter_shapes()
        params = {name: torch.full(shape, float("nan")) for name, shape in shapes.items()}
        for outcome in per_rank:
            for name, (region, value) in outcome[index]["pieces"].items():
                _place(params, name, region, torch.from_numpy(value))
        records = tuple(per_rank[0][index]["records"])
        evals = tuple(per_rank[0][index].get("evals", ()))
        parts = next((o[index]["trace"] for o in per_rank if o[index].get("trace")), None)
        meta = {
            "model": config.model.source,
            "strategy": str(config.strategy),
            "steps": config.steps,
        }
        trace = chrome_trace(parts, meta=meta) if parts else None
        builds = max(outcome[index]["builds"] for outcome in per_rank)
        peaks = {o[index]["rank"]: o[index]["peak_memory"] for o in per_rank
                 if o[index].get("peak_memory") is not None}  # fmt: skip
        states = {o[index]["rank"]: o[index]["state_peak"] for o in per_rank
                  if o[index].get("state_peak")}  # fmt: skip
        results.append(
            TrainResult(
                records=records,
                params=params,
                trace=trace,
                builds=builds,
                peak_memory=peaks,
                evaluations=evals,
                state_peak=states,
            )  # fmt: skip
        )
    return results


def _place(params: dict[str, torch.Tensor], name: str, region: Any, value: torch.Tensor) -> None:
    """Write one piece into the global parameter (copies of a region must agree)."""
    full = params[name]
    index = tuple(slice(a, b) for a, b in region)
    here = full[index]
    same = torch.isnan(here) | torch.isclose(here, value, rtol=1e-6, atol=0.0)
    if not bool(same.all()):
        raise TrainError(
            f"copies of {name} {region} differ between ranks: the ranks diverged "
            "(report it: replicas must stay equal)"
        )
    full[index] = value


def train(
    config: TrainConfig,
    *,
    on_step: Callable[[Record], None] | None = None,
    threads: int | None = None,
    trace: bool = False,
    node: NodeSpec | None = None,
) -> TrainResult:
    """Train one config on local processes (one per rank of its strategy, or this node's
    share of them with ``node``); with ``trace``, ``result.trace`` is the run's Chrome trace
    (``hspmd.runtime.trace``)."""
    callback = None if on_step is None else (lambda _index, record: on_step(record))
    return train_many([config], on_step=callback, threads=threads, trace=trace, node=node)[0]


def merge(results: Sequence[TrainResult]) -> TrainResult:
    """One result from the nodes' results of one run: each parameter element from the node
    that holds it (where several do, they agree); the records of the first."""
    params = {}
    for name, first in results[0].params.items():
        full = first.clone()
        for other in results[1:]:
            value = other.params[name]
            both = ~torch.isnan(full) & ~torch.isnan(value)
            if not bool(torch.isclose(full[both], value[both], rtol=1e-6, atol=0.0).all()):
                raise TrainError(f"nodes disagree on {name}: the ranks diverged (report it)")
            full = torch.where(torch.isnan(full), value, full)
        params[name] = full
    return TrainResult(
        records=results[0].records, params=params, evaluations=results[0].evaluations
    )


def train_elastic(
    config: TrainConfig,
    *,
    on_step: Callable[[Record], None] | None = None,
    on_event: Callable[[dict[str, Any]], None] | None = None,
    timeout_s: float = 600.0,
    threads: int | None = None,
    node: tuple[tuple[str, int], int, int] | None = None,
    serve: bool = False,
) -> TrainResult:
    """Train ``config`` (``elastic=True``) on local processes that survive each other's
    death (``hspmd.train.elastic``); ``on_event`` gets the failure, replan, resumed and
    fallback events. The result's parameters are the survivors' pieces (of this node).

    ``node=((host, port), first, count)``: this launcher is one node of a job of several:
    it starts launch ranks ``first .. first + count - 1`` against the job's store at
    ``host:port`` (docs/elastic.md, "Several machines"); the records come from the node
    whose rank is the generation's rank 0 (the others' records are empty of events).
    ``serve``: this launcher hosts that store (node 0 of ``hspmd train --nnodes``); it
    returns once every other launcher finished or went silent. A launcher whose workers
    all died returns no records and NaN parameters."""
    nproc = num_processes(config) + config.elastic.spares
    run_device(config, num_ranks=nproc)  # CPU: elastic runs are gloo only (refuses cuda)
    store, first, total = None, 0, None
    if node is not None:
        (store, first, count), total = node, nproc
        nproc = count
    on_message = _elastic_messages(on_step, on_event)

    def on_start(pids: list[int]) -> None:  # for tests and users that kill ranks from outside
        if on_event is not None:
            on_event({"event": "started", "pids": pids})

    elastic = ElasticLaunch(
        hang_timeout_s=config.elastic.hang_timeout, on_message=on_message, on_start=on_start,
        spares=config.elastic.spares, store=store, first_member=first, num_members=total,
        serve=serve,
    )  # fmt: skip
    results = launch(
        _elastic_rank, nproc, args=(config, _graphs([config])), timeout_s=timeout_s,
        threads=threads, elastic=elastic,
    )  # fmt: skip
    alive = [[r] for r in results if r is not None]
    if not alive:  # this node's ranks all died; the others trained on
        shapes = config.model_config().parameter_shapes()
        nan = {name: torch.full(shape, float("nan")) for name, shape in shapes.items()}
        return TrainResult(records=(), params=nan)
    return _assemble(alive, [config])[0]


def _graphs(configs: Sequence[TrainConfig]) -> Sent:
    """The runs' captured graphs, for the workers (the checks before launch captured them)."""
    return sent_graphs(lambda: [config.model_config() for config in configs])


def _elastic_rank(world: World, config: TrainConfig, graphs: Sent) -> dict[str, Any]:
    receive_graphs(graphs)
    return run_rank_elastic(world, config)


def _elastic_messages(
    on_step: Callable[[Record], None] | None, on_event: Callable[[dict[str, Any]], None] | None
) -> Callable[[int, Any], None]:
    """The launcher's handler of the ranks' messages in an elastic run: records to
    ``on_step``, events to ``on_event``. A step (an evaluation) reported again across a
    failure (by a new rank 0) is dropped; after a fallback to a checkpoint, the steps after
    it are reported again."""
    last = {"step": 0, "eval": 0}

    def on_message(_rank: int, payload: Any) -> None:
        kind, value = payload
        if kind in last:
            if value.step > last[kind]:
                last[kind] = value.step
                if on_step is not None:
                    on_step(value)
            return
        if value.get("event") == "fallback":
            last["step"] = last["eval"] = value["checkpoint_step"]
        if on_event is not None:
            on_event(value)

    return on_message


def _even_share(total: int, node: NodeSpec) -> int:
    """The ranks of one node: ``total`` split evenly over the nodes (else one line)."""
    if total % node.num_nodes:
        raise TrainError(
            f"{total} ranks do not split evenly over {node.num_nodes} nodes: use a "
            f"strategy whose rank count is a multiple of {node.num_nodes}"
        )
    return total // node.num_nodes


def node_share(config: TrainConfig, node: NodeSpec) -> tuple[int, int]:
    """The first launch rank and the rank count of ``node`` (an even share of the run's
    processes; checked before any process starts)."""
    share = _even_share(num_processes(config), node)
    return node.node_rank * share, share
