"""`hspmd train`: train a Llama preset under a strategy on local processes.

    hspmd train --model llama-tiny --strategy "2x2: R0-1:L0-3; 4x1: R2:L0-3" \\
        --global-batch 8 --seq-len 64 --steps 5 --seed 0 [--json] [--reference | --compare] \\
        [--switch 3="2x4: R0-1:L0-1 R2:L2-3" ...] [--save DIR --save-every N] [--resume DIR]

The strategy is checked before any process starts. ``--json`` prints one JSON object per
step (``step``, ``loss``: the global mean token loss, ``tokens``, ``seconds``);
``--reference`` trains the plain model on this process instead, on the same data;
``--compare`` trains both, the run then the reference (on the ranks' device), and prints
the comparison (losses, and each parameter within a tolerance scaled to it and to its
update: ``hspmd.train.compare``); the exit status is 1 when they differ.
``--switch STEP="STRATEGY"`` moves weights and Adam states in memory to STRATEGY before
STEP (one process per rank of the largest strategy); the step's record carries
``switch_seconds``; with ``--switch-mode weights`` the states stay put and only the compute
weights move; ``--switch-algo relay`` relays single-owner transfers between nodes over
every NIC (nodes from ``--cluster`` or ``--ranks-per-node``). ``--save``/``--resume``: checkpoints that load onto any strategy.
``--tokens-per-step N --max-seq-len L [--long-docs truncate|drop|error]``: variable-length
steps of whole documents packed into the strategy's micro-batches (at most L tokens a row,
no attention across documents, loss the mean over real tokens); the records add
``sequences`` and ``pipeline_tokens`` per pipeline and the long documents ``truncated`` or
``dropped``; one executable per rank serves every length (docs/mixed-length.md).
``--slowdown 2=3,5=3``: ranks 2 and 5 sleep twice the time of each compute they run, as on
devices three times slower (the losses do not change).
``--elastic``: dead and hung ranks (``--hang-timeout S``) are survived in-process: the
others re-plan, move the states from surviving replicas and redo the step (one event line
each: failure, replan, resumed); ``--inject-failure RANK@STEP[:PHASE[:kill|hang]]`` for
tests; ``--spares N --grow STEP=K`` hold back N processes and let K join before STEP;
with ``--nnodes``, node 0's launcher hosts the store and a dead node's ranks are survived
as any dead rank (docs/elastic.md).
``--trace run.json`` writes a Chrome / Perfetto trace of the run (every rank's F, B, Post,
communication steps, switches, saves; docs/pictures.md), ``--timeline run.png`` the same as
a Gantt chart; with ``--predict`` the chart is the last step, measured over predicted
(``hspmd.planner.local``'s cost model, ``--predict-profile`` from ``hspmd profile``).
Progress: a rich bar on a terminal, plain lines otherwise, nothing with ``--quiet``.

``--nnodes 2 --node-rank K --master-addr ADDR [--master-port P]``: one launcher per node
(run the same command on every node, K = 0, 1, ...), each running its share of the ranks;
node 0 hosts the rendezvous at ADDR:P and prints the steps. Under ``hspmd netcluster exec``
the node rank and the master address default to the emulated node's (docs/netcluster.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from hspmd.checkpoint.store import latest, read_manifest
from hspmd.cli.flags import FLAGS, REFERENCE_BATCH, TRAIN_FLAGS, HelpFormatter, shares_of, zero_of
from hspmd.cli.model_input import model_kwargs
from hspmd.cli.paths import check_out_folder, check_save_folder
from hspmd.cli.progress import PlainProgress, eval_line, switch_line
from hspmd.cli.recipe import adam_from_args, eval_from_args
from hspmd.cli.timeline import check_trace_flags, write_outputs
from hspmd.cli.tokenize import byte_progress
from hspmd.data import DEFAULT_MAX_BYTES, data_warnings
from hspmd.data.source import DataSpec, spec_warnings
from hspmd.errors import StrategyError
from hspmd.plan.strategy import Strategy, StrategyOptions, parse_strategy
from hspmd.runtime.launch import NodeSpec
from hspmd.runtime.members import how_lost
from hspmd.train.batches import check_data
from hspmd.train.compare import compare
from hspmd.train.config import (
    BatchConfig,
    CheckpointConfig,
    ElasticConfig,
    EvalConfig,
    EvalRecord,
    FaultConfig,
    LengthPlans,
    ModelChoice,
    Record,
    RuntimeConfig,
    SwitchingConfig,
    TrainConfig,
    TrainError,
)
from hspmd.train.device import gpu_count, reference_device, run_device, where
from hspmd.train.faults import parse_injections
from hspmd.train.logs import RECORDS, RunLog
from hspmd.train.planfile import check_plan, config_from_plan, read_plan, write_plan
from hspmd.train.reference import TrainResult, run_reference
from hspmd.train.trainer import (
    check_config,
    fallbacks,
    node_share,
    num_processes,
    train,
    train_elastic,
)

DEFAULT_SEQ_LEN = FLAGS["--seq-len"].default


def add_config_arguments(parser: argparse.ArgumentParser, *, strategy: str | None) -> None:
    """The arguments of a training run (shared with `hspmd demo`): every flag of
    ``hspmd.cli.flags.TRAIN_FLAGS``, ``--strategy`` defaulting to ``strategy``."""
    for flag in TRAIN_FLAGS:
        flag.add(parser, **({"default": strategy} if flag.name == "--strategy" else {}))


def parse_switches(values: list[str]) -> tuple[tuple[int, Strategy], ...]:
    """``['3=1x4: R0-1:L0-3']`` -> ``((3, Strategy(...)),)``, sorted by step."""
    out = []
    for value in values:
        step, sep, text = value.partition("=")
        if not sep or not step.strip().isdigit() or not text.strip():
            raise TrainError(f'--switch {value!r}: write STEP="STRATEGY", e.g. 3="1x4: R0-1:L0-3"')
        try:
            out.append((int(step), parse_strategy(text.strip())))
        except StrategyError as error:
            raise StrategyError(f"--switch {int(step)}: {error}") from None
    return tuple(sorted(out, key=lambda item: item[0]))


def parse_slowdown(text: str) -> tuple[tuple[int, float], ...]:
    """``'2=3,5=1.5'`` -> ``((2, 3.0), (5, 1.5))``, sorted by rank; ``''`` -> ``()``."""
    out = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        rank, sep, factor = item.partition("=")
        try:
            if not sep:
                raise ValueError(item)
            out.append((int(rank), float(factor)))
        except ValueError:
            raise TrainError(
                f"--slowdown {text!r}: {item!r} is not RANK=FACTOR; write e.g. 2=3,5=3"
            ) from None
    return tuple(sorted(out))


def _packed_args(args: argparse.Namespace) -> tuple[int | None, int | None, LengthPlans | None]:
    """``--tokens-per-step`` and ``--max-seq-len``, else a ``--plans`` file's, and the
    plans (read here, once)."""
    step_tokens = getattr(args, "tokens_per_step", None)
    max_seq_len = getattr(args, "max_seq_len", None)
    plans = None
    if getattr(args, "plans", None):  # length plans (hspmd.cli.plan_lengths)
        from hspmd.cli.plan_lengths import read_plans_file

        plans, data = read_plans_file(args.plans)
        step_tokens = int(data["tokens_per_step"]) if step_tokens is None else step_tokens
        max_seq_len = int(data["max_len"]) if max_seq_len is None else max_seq_len
    if max_seq_len is not None and max_seq_len < 1:
        raise TrainError(f"--max-seq-len {max_seq_len}: give the longest document in tokens (>= 1)")
    if max_seq_len is not None and step_tokens is None:
        raise TrainError(
            f"--max-seq-len {max_seq_len} needs --tokens-per-step N (variable-length steps); "
            "for fixed batches give --seq-len"
        )
    return step_tokens, max_seq_len, plans


def config_from_args(args: argparse.Namespace, *, check_model: bool = True) -> TrainConfig:
    """The run's config from the parsed flags, section by section: every text (strategies,
    plans, lists) parsed here, once; the model checked against it unless ``check_model`` is
    false (``--plan``: checked once the plan's length is in)."""
    step_tokens, max_seq_len, plans = _packed_args(args)
    strategy = None if args.strategy is None else parse_strategy(args.strategy)  # the edge
    config = TrainConfig(
        model=ModelChoice(source=args.model, overrides=model_kwargs(getattr(args, "config", None))),
        strategy=strategy,
        steps=args.steps,
        seed=args.seed,
        batch=BatchConfig(
            global_batch=global_batch_of(args, strategy),
            seq_len=max_seq_len or args.seq_len,
            grad_accum=getattr(args, "grad_accum", 1),
            step_tokens=step_tokens,
            long_docs=getattr(args, "long_docs", "truncate"),
        ),  # fmt: skip
        adam=adam_from_args(args),
        evaluation=eval_from_args(args),
        data=_data_of(args),
        options=StrategyOptions(
            schedule=args.schedule,
            dtype=args.dtype,
            zero=zero_of(args),
            zero_shares=shares_of(args),
            sequence_parallel=args.sequence_parallel,
            recompute=args.recompute,
            recompute_layers=args.recompute_layers,
        ),  # fmt: skip
        runtime=RuntimeConfig(
            overlap=not getattr(args, "no_overlap", False),
            zero_overlap=not getattr(args, "zero_no_overlap", False),
            device=getattr(args, "device", "auto"),
        ),
        switching=SwitchingConfig(
            switches=parse_switches(args.switch),
            mode=getattr(args, "switch_mode", "states"),
            algo=getattr(args, "switch_algo", "fused"),
            cluster=getattr(args, "cluster", None),
            ranks_per_node=getattr(args, "ranks_per_node", None),
        ),  # fmt: skip
        elastic=_elastic_of(args),
        faults=FaultConfig(
            inject=parse_injections(getattr(args, "inject_failure", [])),
            slowdown=parse_slowdown(getattr(args, "slowdown", "")),
        ),
        checkpoint=CheckpointConfig(save=args.save, every=args.save_every or 1, resume=args.resume),
    )
    if check_model:
        config.check_model()  # the model loads once here, at the edge
    if plans is None:
        return config
    from hspmd.cli.plan_lengths import apply_plans

    return apply_plans(config, plans, path=args.plans)


def _data_of(args: argparse.Namespace) -> DataSpec:
    """The data flags (those a command lacks keep their defaults)."""
    return DataSpec(
        path=args.data, dataset=getattr(args, "dataset", None), max_bytes=args.data_max_bytes,
        dtype=getattr(args, "data_dtype", None), eod_id=getattr(args, "eod_id", None),
        tokenizer=getattr(args, "tokenizer", None), cache=getattr(args, "data_cache", None),
    )  # fmt: skip


def _elastic_of(args: argparse.Namespace) -> ElasticConfig:
    """The elastic flags (those a command lacks keep their defaults)."""
    return ElasticConfig(
        enabled=getattr(args, "elastic", False), hang_timeout=getattr(args, "hang_timeout", 60.0),
        spares=getattr(args, "spares", 0), grow=parse_grow(getattr(args, "grow", [])),
    )  # fmt: skip


def parse_grow(values: list[str]) -> tuple[tuple[int, int], ...]:
    """``['3=2']`` -> ``((3, 2),)``, sorted by step."""
    out = []
    for value in values:
        step, sep, count = value.partition("=")
        if not sep or not step.strip().isdigit() or not count.strip().isdigit():
            raise TrainError(
                f"--grow {value!r}: write STEP=N, e.g. 3=2 (2 spares join before step 3)"
            )
        out.append((int(step), int(count)))
    return tuple(sorted(out))


def global_batch_of(args: argparse.Namespace, strategy: Strategy | None) -> int:
    """``--global-batch``, else the strategy's sum of COUNT x SIZE (8 without a strategy)."""
    if args.global_batch is not None:
        return int(args.global_batch)
    if strategy is None:
        return REFERENCE_BATCH
    return strategy.global_batch


def warnings_of(args: argparse.Namespace, config: TrainConfig) -> list[str]:
    """Options that do nothing as given (the run goes ahead)."""
    out = []
    if args.save_every is not None and not config.checkpoint.save:
        out.append(f"--save-every {args.save_every} without --save saves nothing: add --save DIR")
    elif config.checkpoint.save and config.checkpoint.every > config.steps:
        out.append(
            f"--save-every {config.checkpoint.every} is past --steps {config.steps}: nothing is "
            "saved"
        )
    elif config.checkpoint.save and config.steps % config.checkpoint.every:
        every = config.checkpoint.every
        last = every * (config.steps // every)
        out.append(
            f"--save-every {every} does not divide --steps {config.steps}: the last checkpoint "
            f"is step {last}, the steps after it are not saved (give --steps {last + every} "
            f"or a --save-every that divides {config.steps})"
        )
    out += zero_warnings(config)
    spec = config.data
    out += spec_warnings(spec, step_tokens=config.tokens_per_step, steps=config.steps)
    if not spec.tokenized:
        out += data_warnings(
            config.data.path,
            # a fixed batch reads seq_len + 1 bytes a row; packed steps up to step_tokens
            step_bytes=config.batch.step_tokens
            or config.batch.global_batch * (config.batch.seq_len + 1),
            steps=config.steps,
            max_bytes=config.data.max_bytes or DEFAULT_MAX_BYTES,
        )
    if config.batch.packed and args.global_batch is not None:
        out.append(
            f"--global-batch {args.global_batch} does nothing with --tokens-per-step: a step "
            "is whole documents packed into the strategy's micro-batches"
        )
    if getattr(args, "max_seq_len", None) is not None and args.seq_len != DEFAULT_SEQ_LEN:
        out.append(f"--seq-len {args.seq_len} does nothing with --max-seq-len: drop one")
    out += _eval_warnings(args, config)
    for step, strategy in config.switching.switches:
        if step > config.steps:
            out.append(
                f"--switch {step}={str(strategy)!r} never runs: step {step} is past --steps "
                f"{config.steps}"
            )
    return out


def zero_warnings(config: TrainConfig) -> list[str]:
    """``--zero N`` where no strategy of the run has a data-parallel replica to shard over
    (one pipeline, no CP): it runs, sharding nothing."""
    if config.strategy is None or not config.options.zero:
        return []
    if any(
        len(s.pipelines) > 1 or any(t.cp > 1 for _, _, t in s.stages()) for s in config.strategies
    ):
        return []
    return [
        f"--zero {config.options.zero} shards over data-parallel replicas, and "
        f"'{config.strategy}' has one pipeline: it shards nothing (give the strategy a "
        "second pipeline for it to shard over, or drop --zero)"
    ]


def _eval_warnings(args: argparse.Namespace, config: TrainConfig) -> list[str]:
    """Evaluation flags that do nothing as given."""
    ev = config.evaluation
    if ev.every > config.steps:
        return [f"--eval-every {ev.every} is past --steps {config.steps}: nothing is evaluated"]
    if ev.every:
        return []
    out = []
    if ev.split:
        out.append(
            f"--eval-split {ev.split:g} holds the last {ev.split:g} of the data out of training "
            "but nothing evaluates it: add --eval-every N"
        )
    for flag, given in (("--eval-batches", ev.batches != EvalConfig().batches),
                        ("--eval-data", ev.data is not None)):  # fmt: skip
        if given:
            out.append(f"{flag} does nothing without --eval-every N")
    return out


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train",
        help="train a model (a preset or any nn.Module) under a strategy on local processes",
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    add_config_arguments(parser, strategy=None)
    parser.add_argument(
        "--plan",
        default=None,
        metavar="FILE.json",
        help="train this strategy file (hspmd plan --out) or annotation plan (hspmd train "
        "--save-plan; docs/plan-schema.md): its strategy, options, sequence length (and "
        "per-parameter splits); instead of --strategy",
    )
    parser.add_argument(
        "--save-plan",
        default=None,
        metavar="FILE.json",
        help="write the run's annotation plan (of its first strategy) and exit",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per step")
    parser.add_argument(
        "--reference", action="store_true", help="plain model on one process, no hspmd"
    )
    parser.add_argument(
        "--compare",
        action="store_true",
        help="train the run, then the reference, and print the comparison (exit 1 if they differ)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    parser.add_argument(
        "--log-dir",
        default=None,
        metavar="DIR",
        help=f"append the records --json prints to DIR/{RECORDS} and write TensorBoard event "
        "files there (with the tensorboard package: the logs extra)",
    )
    parser.add_argument(
        "--trace", default=None, metavar="FILE.json", help="write a Chrome / Perfetto trace"
    )
    parser.add_argument(
        "--timeline", default=None, metavar="FILE", help="draw the run as a Gantt chart (.png/.svg)"
    )
    parser.add_argument(
        "--predict",
        action="store_true",
        help="with --timeline: the last step measured over the simulator's prediction",
    )
    parser.add_argument(
        "--predict-profile",
        default=None,
        metavar="FILE",
        help="with --predict: compute speeds from this `hspmd profile` file",
    )
    add_node_arguments(parser)
    parser.set_defaults(func=run)


def add_node_arguments(parser: argparse.ArgumentParser) -> None:
    """``--nnodes``, ``--node-rank``, ``--master-addr``, ``--master-port``: one launcher per node."""
    group = parser.add_argument_group("several nodes (one launcher per node)")
    group.add_argument("--nnodes", type=int, default=1, help="launchers, one per node")
    group.add_argument(
        "--node-rank",
        type=int,
        default=int(os.environ.get("HSPMD_NODE", "0")),
        help="this node's index (default: $HSPMD_NODE, set by `hspmd netcluster exec`)",
    )
    group.add_argument(
        "--master-addr",
        default=os.environ.get("HSPMD_MASTER_ADDR"),
        help="node 0's address, where it hosts the rendezvous (default: $HSPMD_MASTER_ADDR)",
    )
    group.add_argument("--master-port", type=int, default=29500, help="rendezvous port")


def node_of(args: argparse.Namespace) -> NodeSpec | None:
    """The ``NodeSpec`` the node arguments give (None for one node)."""
    if args.nnodes < 1:
        raise TrainError(f"--nnodes {args.nnodes}: give the number of launchers, at least 1")
    if args.nnodes == 1:
        return None
    if not args.master_addr:
        raise TrainError(
            f"--nnodes {args.nnodes} needs --master-addr: the address of node 0 that every "
            "node reaches"
        )
    return NodeSpec(args.node_rank, args.nnodes, args.master_addr, args.master_port)


@contextmanager
def progress(
    config: TrainConfig, *, title: str, as_json: bool, done: int = 0, quiet: bool = False,
    terminal: bool | None = None,
) -> Iterator[Callable[[Record], None]]:  # fmt: skip
    """A record callback: JSON lines; nothing (``quiet``); on a terminal (``terminal``,
    default: stdout is one) a rich bar from step ``done`` with loss, tokens/s and ETA;
    otherwise one plain line per step (``hspmd.cli.progress``); a line per evaluation."""
    if as_json:
        yield lambda record: print(json.dumps(record.to_json()), flush=True)
        return
    if quiet:
        yield lambda record: None
        return
    if not (sys.stdout.isatty() if terminal is None else terminal):
        yield PlainProgress(total=config.steps, done=done)
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}  {task.fields[rate]} tokens/s  eta"),
        TimeRemainingColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, transient=False) as bar:
        task = bar.add_task(title, total=config.steps, completed=done, loss="-", rate="-")

        def update(record: Record) -> None:
            if isinstance(record, EvalRecord):
                bar.console.print(eval_line(record))
                return
            if record.switch_seconds is not None:
                bar.console.print(switch_line(record))
            rate = record.tokens / max(record.seconds, 1e-9)
            bar.update(task, advance=1, loss=f"{record.loss:.6f}", rate=f"{rate:,.0f}")
            bar.console.print(
                f"step {record.step:>3}  loss {record.loss:.6f}  {rate:,.0f} tokens/s"
            )

        yield update


def resumed_step(config: TrainConfig) -> int:
    """The step the checkpoint in ``config.checkpoint.resume`` was saved at (0 without
    ``--resume``)."""
    if not config.checkpoint.resume:
        return 0
    return read_manifest(latest(config.checkpoint.resume)).step


def resume_warnings(config: TrainConfig) -> list[str]:
    """Where this run's data and recipe flags differ from those of the run that saved the
    checkpoint."""
    if not config.checkpoint.resume:
        return []
    saved = read_manifest(latest(config.checkpoint.resume)).run
    now, recipe = config.data_identity(), config.recipe_identity()
    return [
        f"resuming with {flag} {now[flag]} where the checkpoint was saved with {old}: the "
        "remaining steps see other samples than the saved run would have"
        for flag, old in saved.items()
        if flag in now and now[flag] != old
    ] + [
        f"resuming with {flag} {recipe[flag]} where the checkpoint was saved with {old}: the "
        "remaining steps follow another optimizer recipe than the saved run would have"
        for flag, old in saved.items()
        if flag in recipe and recipe[flag] != old
    ]


def resume_text(config: TrainConfig) -> str:
    """``resuming DIR/step-N at step N+1: strategy A -> B`` (what ``--resume`` loads)."""
    assert config.checkpoint.resume is not None
    folder = latest(config.checkpoint.resume)
    manifest = read_manifest(folder)
    now = str(config.strategy_at(manifest.step + 1))
    change = f"{manifest.strategy!r} -> {now!r}" if manifest.strategy != now else repr(now)
    return (
        f"resuming {folder} (saved after step {manifest.step}) at step {manifest.step + 1}: "
        f"strategy {change}"
    )


@contextmanager
def run_log(folder: str | None, *, command: str = "train") -> Iterator[RunLog | None]:
    """``--log-dir``: the ``RunLog`` of ``folder`` (None without it), closed after the run;
    one note line when TensorBoard is not installed (JSON lines only)."""
    if folder is None:
        yield None
        return
    with RunLog(folder) as log:
        if not log.events:
            print(
                f"hspmd {command}: note: tensorboard is not installed: --log-dir {folder} gets "
                f"JSON lines only ({RECORDS}); pip install 'hspmd[logs]' for TensorBoard event "
                "files",
                file=sys.stderr,
            )
        yield log


def _tee(
    show: Callable[[Record], None], log: Callable[[Record], None] | None
) -> Callable[[Record], None]:
    """The record callback that shows a record, then logs it."""
    if log is None:
        return show

    def both(record: Record) -> None:
        show(record)
        log(record)

    return both


def run_config(
    config: TrainConfig, *, reference: bool, as_json: bool, quiet: bool = False,
    trace: bool = False, node: NodeSpec | None = None, log: RunLog | None = None,
) -> TrainResult:  # fmt: skip
    """Train (or run the reference) with the progress display; the CLI's core. ``log``:
    ``--log-dir``'s, which gets every record shown."""
    if reference:
        if gpu_count():  # a GPU machine: say which device the reference takes
            print(f"hspmd train: the reference runs {where(reference_device(config))}",
                  file=sys.stderr)  # fmt: skip
        with progress(config, title="reference", as_json=as_json, quiet=quiet) as on_step:
            return run_reference(config, on_step=_tee(on_step, log))
    check_config(config)  # before any process starts
    if gpu_count():  # a GPU machine: say where the ranks run (auto may pick CPU)
        local = num_processes(config) // (node.num_nodes if node is not None else 1)
        device = run_device(config, num_ranks=local + config.elastic.spares)
        print(
            f"hspmd train: {where(device, num_ranks=local + config.elastic.spares)}",
            file=sys.stderr,
        )
    if config.elastic.enabled:
        return run_elastic(config, as_json=as_json, quiet=quiet, trace=trace, node=node, log=log)
    if node is not None and node.node_rank > 0:  # node 0 shows the steps
        # traced on every node: the clock sync and the gathering of the events are
        # collectives of all ranks (a node that skips them leaves node 0's ranks waiting)
        return train(config, node=node, trace=trace)
    title = f"{num_processes(config)} ranks"
    if node is not None:
        title += f" on {node.num_nodes} nodes"
    done = resumed_step(config)  # the bar starts there
    with progress(config, title=title, as_json=as_json, done=done, quiet=quiet) as on_step:
        return train(config, on_step=_tee(on_step, log), trace=trace, node=node)


def run_elastic(
    config: TrainConfig, *, as_json: bool, quiet: bool, trace: bool, node: NodeSpec | None,
    log: RunLog | None = None,
) -> TrainResult:  # fmt: skip
    """``--elastic``: one launcher, or this node's of several (node 0 hosts the store at
    the master address); every node shows the steps and events its launcher hears of
    (the generation's rank 0 reports: node 0's while it has a rank left)."""
    if trace:
        raise TrainError(
            "--elastic does not take --trace/--timeline (a trace gathers every rank's "
            "events at the end, and a dead rank has none): drop --trace/--timeline"
        )
    where, title = None, f"{num_processes(config)} ranks"
    if node is not None:
        if config.elastic.spares:
            raise TrainError(
                "--spares holds processes back on one launcher: drop --spares (or --nnodes)"
            )
        first, count = node_share(config, node)
        where = ((node.master_addr, node.master_port), first, count)
        title += (
            f" on {node.num_nodes} nodes (node {node.node_rank}: ranks {first}-{first + count - 1})"
        )
    done = resumed_step(config)
    with progress(config, title=title, as_json=as_json, done=done, quiet=quiet) as on_step:
        on_event = print_event if as_json else lambda e: print(event_text(e), flush=True)
        return train_elastic(
            config, on_step=_tee(on_step, log), on_event=on_event, node=where,
            serve=node is not None and node.node_rank == 0,
        )  # fmt: skip


def print_event(event: dict[str, Any]) -> None:
    print(json.dumps(event), flush=True)


def event_text(event: dict[str, Any]) -> str:
    """One readable line for an elastic event (``--json`` prints the object instead).

    >>> event_text({"event": "resumed", "step": 4, "recovery_seconds": 0.5, "moved_bytes": 8e6})
    'resumed at step 4 after 0.500 s of recovery (8.0 MB of states moved)'
    """
    kind = event["event"]
    if kind == "failure":
        how = how_lost(event["cause"], event["exit_code"])
        return (
            f"failure: rank {event['rank']} {how} in {event['phase']} of step {event['step']}; "
            f"detected after {event['detected_after_s']:.3f} s"
        )
    if kind == "replan":
        return f"replan: {event['strategy']!r} planned in {event['plan_seconds'] * 1e3:.0f} ms"
    if kind == "resumed":
        moved = event["moved_bytes"]
        what = (
            "states loaded from the checkpoint"
            if moved is None
            else (f"{moved / 1e6:.1f} MB of states moved")
        )
        return (
            f"resumed at step {event['step']} after {event['recovery_seconds']:.3f} s of "
            f"recovery ({what})"
        )
    if kind == "grow":
        return f"growth: ranks {event['ranks']} join before step {event['step']}"
    if kind == "started":
        return f"elastic run started: process ids by rank {event['pids']}"
    if kind == "fallback":
        return (
            f"fallback: every replica of {event['lost']} died; loaded the checkpoint of step "
            f"{event['checkpoint_step']} onto {event['strategy']!r}"
        )
    return json.dumps(event)


def planned_config(args: argparse.Namespace) -> TrainConfig:
    """``config_from_args``, or with ``--plan`` the plan's run (checked against it)."""
    if getattr(args, "plan", None) is None:
        return config_from_args(args)
    if args.strategy is not None:
        raise TrainError("--plan carries the strategy: drop --strategy (or drop --plan)")
    plan = read_plan(args.plan)
    args.strategy = plan.strategy
    config = config_from_plan(plan, config_from_args(args, check_model=False))
    check_plan_flags(args, config)
    config.check_model()
    check_plan(plan, config)
    return config


def check_plan_flags(args: argparse.Namespace, config: TrainConfig) -> None:
    """``--seq-len`` or ``--global-batch`` given beside a ``--plan`` that sets another value
    (the plan's would win, silently): one line."""
    given = [
        ("--seq-len", args.seq_len, config.batch.seq_len, args.seq_len != BatchConfig().seq_len),
        ("--global-batch", args.global_batch, config.batch.global_batch, True),
    ]
    for flag, value, planned, explicit in given:
        if value is not None and explicit and value != planned:
            raise TrainError(
                f"{flag} {value} differs from --plan {args.plan}'s {planned}: the plan carries "
                f"it; drop {flag}, or plan for {value}"
            )


def run(args: argparse.Namespace) -> int:
    config = planned_config(args)
    if args.reference:
        check_reference(config)
    else:
        check_save_folder(config.checkpoint.save, config.checkpoint.resume)
    if args.compare:
        check_compare(args, config, node_of(args))
    if getattr(args, "save_plan", None):
        check_out_folder(args.save_plan, "--save-plan")
        data = write_plan(config, args.save_plan)
        print(
            f"wrote {args.save_plan}: {len(data['parameters'])} parameters, "
            f"{len(data['reshards'])} reshards, strategy {config.strategy}"
        )
        return 0
    for warning in warnings_of(args, config):
        print(f"hspmd {args.command}: warning: {warning}", file=sys.stderr)
    if not args.reference:
        for line in fallbacks(config):  # deduced before launch: also a model that cannot train
            print(f"hspmd {args.command}: note: computed whole: {line}", file=sys.stderr)
    if config.data.kind == "text":  # tokenized once, here, into the cache ranks read
        with byte_progress("tokenizing --data", quiet=getattr(args, "quiet", False)) as bar:
            check_data(config, on_progress=bar)
    if not args.reference and _nothing_to_do(args, config):
        return 0
    wants_trace = check_trace_flags(args)  # before any work
    if config.checkpoint.resume and not args.reference:
        print(resume_text(config), file=sys.stderr)
        for warning in resume_warnings(config):
            print(f"hspmd {args.command}: warning: {warning}", file=sys.stderr)
    node = node_of(args)
    folder = args.log_dir
    if (
        folder is not None
        and node is not None
        and node.node_rank > 0
        and not config.elastic.enabled
    ):
        print(f"hspmd {args.command}: note: --log-dir {folder}: node 0 writes the logs (it "
              "receives the records); this node writes none", file=sys.stderr)  # fmt: skip
        folder = None
    with run_log(folder, command=args.command) as log:
        result = run_config(
            config, reference=args.reference, as_json=args.json,
            quiet=getattr(args, "quiet", False), trace=wants_trace, node=node, log=log,
        )  # fmt: skip
    if node is not None and node.node_rank > 0:
        print(f"node {node.node_rank} of {node.num_nodes}: done", file=sys.stderr)
        return 0
    if wants_trace:
        write_outputs(args, config, result)
    _print_summary(args, config, result)
    return compare_with_reference(args, config, result) if args.compare else 0


def _nothing_to_do(args: argparse.Namespace, config: TrainConfig) -> bool:
    """The checkpoint of ``--resume`` is at ``--steps`` or past it: say so (and in JSON)."""
    done = resumed_step(config)
    if done < config.steps:
        return False
    print(
        f"nothing to do: checkpoint is at step {done} (in {config.checkpoint.resume}) and "
        f"--steps is {config.steps}; pass --steps above {done} to train on",
        file=sys.stderr,
    )
    if args.json:
        print(json.dumps({"nothing_to_do": True, "checkpoint_step": done,
                          "steps": config.steps, "resume": config.checkpoint.resume}))  # fmt: skip
    return True


def _print_summary(args: argparse.Namespace, config: TrainConfig, result: TrainResult) -> None:
    """The run's last lines on stderr: the final loss, GPU peaks, the last checkpoint."""
    if not args.json and result.records:
        print(f"final loss {result.records[-1].loss:.6f}", file=sys.stderr)
    if result.peak_memory:
        peaks = ", ".join(
            f"rank {r} {b / 2**30:.2f}" for r, b in sorted(result.peak_memory.items())
        )
        print(f"peak GPU memory (torch.cuda.max_memory_allocated, GiB): {peaks}", file=sys.stderr)
    saved = [r.step for r in result.records if r.step % config.checkpoint.every == 0]
    if config.checkpoint.save and not args.reference and saved:
        print(
            f"checkpoint of step {saved[-1]} saved in {latest(config.checkpoint.save)}",
            file=sys.stderr,
        )


def check_reference(config: TrainConfig) -> None:
    """``--reference`` beside ``--save`` or ``--resume``, which it does not take (it trained
    from step 1 and saved nothing, silently): one line."""
    for flag, value in (("--save", config.checkpoint.save), ("--resume", config.checkpoint.resume)):
        if value is not None:
            raise TrainError(
                f"--reference does not take {flag} {value} (the reference trains from step 1 "
                f"on one process and writes no checkpoint): drop {flag}, or drop --reference"
            )


def check_compare(args: argparse.Namespace, config: TrainConfig, node: NodeSpec | None) -> None:
    """``--compare`` beside what it cannot compare (one line, before any work)."""
    clashes = [
        ("--reference", args.reference, "--compare runs the reference too"),
        ("--resume", bool(config.checkpoint.resume), "the reference trains from step 1"),
        ("--nnodes", node is not None, "each node holds only its ranks' parameters"),
    ]
    for flag, given, why in clashes:
        if given:
            raise TrainError(f"--compare does not take {flag} ({why}): drop one of them")


def compare_with_reference(
    args: argparse.Namespace, config: TrainConfig, result: TrainResult
) -> int:
    """``--compare``: the reference on the ranks' device, then the comparison (stdout;
    one JSON object with ``--json``); 1 if the run differs from it."""
    device = run_device(config, num_ranks=num_processes(config) + config.elastic.spares)
    runtime = dataclasses.replace(config.runtime, device=device)
    reference = run_config(
        dataclasses.replace(config, runtime=runtime), reference=True, as_json=False,
        quiet=args.json or getattr(args, "quiet", False),
    )  # fmt: skip
    report = compare(result, reference, config=config)
    print(json.dumps({"comparison": report.to_json()}) if args.json else str(report), flush=True)
    return 0 if report.ok else 1
