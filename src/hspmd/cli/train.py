"""`hspmd train`: train a Llama preset under a strategy on local processes.

    hspmd train --model llama-tiny --strategy "2x2: R0-1:L0-3; 4x1: R2:L0-3" \\
        --global-batch 8 --seq-len 64 --steps 5 --seed 0 [--json] [--reference] \\
        [--switch 3="2x4: R0-1:L0-1 R2:L2-3" ...] [--save DIR --save-every N] [--resume DIR]

The strategy is checked before any process starts. ``--json`` prints one JSON object per
step (``step``, ``loss``: the global mean token loss, ``tokens``, ``seconds``);
``--reference`` trains the plain model on this process instead, on the same data.
``--switch STEP="STRATEGY"`` moves weights and Adam states in memory to STRATEGY before
STEP (one process per rank of the largest strategy); the step's record carries
``switch_seconds``; with ``--switch-mode weights`` the states stay put and only the compute
weights move; ``--switch-algo relay`` relays single-owner transfers between nodes over
every NIC (nodes from ``--cluster`` or ``--ranks-per-node``). ``--save``/``--resume``: checkpoints that load onto any strategy.
``--slowdown 2=3,5=3``: ranks 2 and 5 sleep twice the time of each compute they run, as on
devices three times slower (the losses do not change).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from hspmd.checkpoint.store import latest, read_manifest
from hspmd.models.llama import PRESETS
from hspmd.plan.strategy import parse_strategy
from hspmd.train.config import AdamConfig, StepRecord, TrainConfig, TrainError
from hspmd.train.faults import parse_injections
from hspmd.train.reference import TrainResult, run_reference
from hspmd.train.trainer import check_config, num_processes, train, train_elastic


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and ``(default: X)`` after every option that has one."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        default = action.default
        if action.help is None or default is None or default is False or default in ([], ""):
            return action.help
        return super()._get_help_string(action)


# Without --global-batch and --strategy (the reference run): this many sequences per step.
REFERENCE_BATCH = 8


def add_config_arguments(parser: argparse.ArgumentParser, *, strategy: str | None) -> None:
    """The arguments of a training run (shared with `hspmd demo`)."""
    trainable = [name for name, c in PRESETS.items() if not c.config_only]
    parser.add_argument("--model", default="llama-tiny", choices=trainable, help="model preset")
    parser.add_argument(
        "--strategy",
        default=strategy,
        help="pipelines 'COUNTxSIZE: R<ranks>:L<first>-<last> ...' separated by ';'",
    )
    parser.add_argument(
        "--global-batch",
        type=int,
        default=None,
        help="sequences per step (default: the strategy's sum of COUNT x SIZE; "
        f"{REFERENCE_BATCH} without a strategy)",
    )
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=5, help="last step (counts from the start)")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights and data order")
    parser.add_argument("--lr", type=float, default=1e-4, help="Adam learning rate")
    parser.add_argument("--data", default=None, help="text or JSONL file (default: stdlib)")
    parser.add_argument(
        "--data-max-bytes", type=int, default=None, help="read at most this much text"
    )
    parser.add_argument(
        "--schedule", default="1f1b", choices=["1f1b", "gpipe"], help="pipeline schedule"
    )
    parser.add_argument(
        "--dtype", default="fp32", choices=["fp32", "bf16"], help="compute dtype (masters fp32)"
    )
    parser.add_argument(
        "--zero1", action="store_true", help="shard fp32 masters and Adam states over pipelines"
    )
    parser.add_argument(
        "--sequence-parallel", action="store_true", help="split the sequence inside each stage"
    )
    parser.add_argument("--recompute", action="store_true", help="recompute each layer in backward")
    parser.add_argument(
        "--no-overlap",
        action="store_true",
        help="sync gradients after the last backward instead of during it (debugging)",
    )
    parser.add_argument(
        "--switch",
        action="append",
        default=[],
        metavar='STEP="STRATEGY"',
        help="switch to STRATEGY in memory before step STEP (repeatable)",
    )
    parser.add_argument(
        "--switch-mode",
        default="states",
        choices=["states", "weights"],
        help="what a switch moves: fp32 masters and Adam states (states, for unstable "
        "devices) or only the compute weights, states kept sharded over all ranks (weights, "
        "for mixed-length data)",
    )
    parser.add_argument(
        "--switch-algo",
        default="fused",
        choices=["fused", "relay"],
        help="how a switch moves the states: one fused BSR, or relayed over every NIC of "
        "the nodes (needs --cluster or --ranks-per-node)",
    )
    parser.add_argument(
        "--cluster", default=None, metavar="FILE_OR_NAME", help="the nodes switches plan on"
    )
    parser.add_argument(
        "--ranks-per-node",
        type=int,
        default=None,
        metavar="N",
        help="fake nodes of N local processes each, for switches (instead of --cluster)",
    )
    parser.add_argument("--save", default=None, metavar="DIR", help="checkpoint directory")
    parser.add_argument(
        "--save-every",
        type=int,
        default=None,
        metavar="N",
        help="with --save: save after every N-th step (default: 1)",
    )
    parser.add_argument("--resume", default=None, metavar="DIR", help="continue from DIR")
    parser.add_argument(
        "--elastic",
        action="store_true",
        help="survive dead and hung ranks in-process: re-plan over the survivors, move the "
        "states from surviving replicas, redo the interrupted step (docs/elastic.md)",
    )
    parser.add_argument(
        "--hang-timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="with --elastic: a rank without progress for S seconds counts as hung",
    )
    parser.add_argument(
        "--inject-failure",
        action="append",
        default=[],
        metavar="RANK@STEP[:PHASE[:kill|hang]]",
        help="fault injection for tests: RANK fails in PHASE (forward, backward, sync, "
        "optimizer, switch, save; default forward) of STEP by SIGKILL or a hang (repeatable)",
    )
    parser.add_argument(
        "--spares",
        type=int,
        default=0,
        metavar="N",
        help="with --elastic: start N more local processes, held back until --grow",
    )
    parser.add_argument(
        "--grow",
        action="append",
        default=[],
        metavar="STEP=N",
        help="with --spares: N spare ranks join before STEP (re-plan, states move to them)",
    )
    parser.add_argument(
        "--slowdown",
        default="",
        metavar="RANK=FACTOR,...",
        help="emulate slower devices: each listed rank sleeps (FACTOR-1) x the time of each "
        "forward, backward and optimizer step it runs, e.g. 2=3,5=3; losses are unchanged",
    )


def parse_switches(values: list[str]) -> tuple[tuple[int, str], ...]:
    """``['3=1x4: R0-1:L0-3']`` -> ``((3, '1x4: R0-1:L0-3'),)``, sorted by step."""
    out = []
    for value in values:
        step, sep, text = value.partition("=")
        if not sep or not step.strip().isdigit() or not text.strip():
            raise TrainError(f'--switch {value!r}: write STEP="STRATEGY", e.g. 3="1x4: R0-1:L0-3"')
        out.append((int(step), text.strip()))
    return tuple(sorted(out))


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


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        model=args.model,
        strategy=args.strategy,
        global_batch=global_batch_of(args),
        seq_len=args.seq_len,
        steps=args.steps,
        seed=args.seed,
        adam=AdamConfig(lr=args.lr),
        data=args.data,
        data_max_bytes=args.data_max_bytes,
        schedule=args.schedule,
        dtype=args.dtype,
        zero1=args.zero1,
        sequence_parallel=args.sequence_parallel,
        recompute=args.recompute,
        overlap=not getattr(args, "no_overlap", False),
        switches=parse_switches(args.switch),
        switch_mode=getattr(args, "switch_mode", "states"),
        switch_algo=getattr(args, "switch_algo", "fused"),
        cluster=getattr(args, "cluster", None),
        ranks_per_node=getattr(args, "ranks_per_node", None),
        save=args.save,
        save_every=args.save_every or 1,
        resume=args.resume,
        slowdown=parse_slowdown(getattr(args, "slowdown", "")),
        elastic=getattr(args, "elastic", False),
        hang_timeout=getattr(args, "hang_timeout", 60.0),
        inject=parse_injections(getattr(args, "inject_failure", [])),
        spares=getattr(args, "spares", 0),
        grow=parse_grow(getattr(args, "grow", [])),
    )


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


def global_batch_of(args: argparse.Namespace) -> int:
    """``--global-batch``, else the strategy's sum of COUNT x SIZE (8 without a strategy)."""
    if args.global_batch is not None:
        return int(args.global_batch)
    if args.strategy is None:
        return REFERENCE_BATCH
    return parse_strategy(args.strategy).global_batch


def warnings_of(args: argparse.Namespace, config: TrainConfig) -> list[str]:
    """Options that do nothing as given (the run goes ahead)."""
    out = []
    if args.save_every is not None and not config.save:
        out.append(f"--save-every {args.save_every} without --save saves nothing: add --save DIR")
    elif config.save and config.save_every > config.steps:
        out.append(
            f"--save-every {config.save_every} is past --steps {config.steps}: nothing is saved"
        )
    for step, text in config.switches:
        if step > config.steps:
            out.append(
                f"--switch {step}={text!r} never runs: step {step} is past --steps {config.steps}"
            )
    return out


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train",
        help="train a Llama preset under a strategy on local processes",
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    add_config_arguments(parser, strategy=None)
    parser.add_argument("--json", action="store_true", help="one JSON object per step")
    parser.add_argument(
        "--reference", action="store_true", help="plain model on one process, no hspmd"
    )
    parser.set_defaults(func=run)


@contextmanager
def progress(
    config: TrainConfig, *, title: str, as_json: bool, done: int = 0
) -> Iterator[Callable[[StepRecord], None]]:
    """A step callback: JSON lines, or a rich progress bar (from step ``done``) with the latest loss."""
    if as_json:
        yield lambda record: print(json.dumps(record.to_json()), flush=True)
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, transient=False) as bar:
        task = bar.add_task(title, total=config.steps, completed=done, loss="-")

        def update(record: StepRecord) -> None:
            if record.switch_seconds is not None:
                bar.console.print(
                    f"switch before step {record.step} to {record.strategy!r}: "
                    f"{record.switch_seconds * 1e3:.1f} ms"
                )
            bar.update(task, advance=1, loss=f"{record.loss:.6f}")
            bar.console.print(
                f"step {record.step:>3}  loss {record.loss:.6f}  "
                f"{record.tokens / max(record.seconds, 1e-9):,.0f} tokens/s"
            )

        yield update


def resumed_step(config: TrainConfig) -> int:
    """The step the checkpoint in ``config.resume`` was saved at (0 without ``--resume``)."""
    if not config.resume:
        return 0
    return read_manifest(latest(config.resume)).step


def resume_text(config: TrainConfig) -> str:
    """``resuming DIR/step-N at step N+1: strategy A -> B`` (what ``--resume`` loads)."""
    assert config.resume is not None
    folder = latest(config.resume)
    manifest = read_manifest(folder)
    now = config.strategy_at(manifest.step + 1)
    change = f"{manifest.strategy!r} -> {now!r}" if manifest.strategy != now else repr(now)
    return (
        f"resuming {folder} (saved after step {manifest.step}) at step {manifest.step + 1}: "
        f"strategy {change}"
    )


def run_config(config: TrainConfig, *, reference: bool, as_json: bool) -> TrainResult:
    """Train (or run the reference) with the progress display; the CLI's core."""
    if reference:
        with progress(config, title="reference", as_json=as_json) as on_step:
            return run_reference(config, on_step=on_step)
    check_config(config)  # before any process starts
    title = f"{num_processes(config)} ranks"
    done = resumed_step(config)  # the bar starts there
    with progress(config, title=title, as_json=as_json, done=done) as on_step:
        if config.elastic:
            on_event = print_event if as_json else lambda e: print(event_text(e), flush=True)
            return train_elastic(config, on_step=on_step, on_event=on_event)
        return train(config, on_step=on_step)


def print_event(event: dict[str, Any]) -> None:
    print(json.dumps(event), flush=True)


def event_text(event: dict[str, Any]) -> str:
    """One readable line for an elastic event (``--json`` prints the object instead).

    >>> event_text({"event": "resumed", "step": 4, "recovery_seconds": 0.5, "moved_bytes": 8e6})
    'resumed at step 4 after 0.500 s of recovery (8.0 MB of states moved)'
    """
    kind = event["event"]
    if kind == "failure":
        how = "hung" if event["cause"] == "hang" else f"died (exit code {event['exit_code']})"
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


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    for warning in warnings_of(args, config):
        print(f"hspmd {args.command}: warning: {warning}", file=sys.stderr)
    if not args.reference and (done := resumed_step(config)) >= config.steps:
        print(
            f"nothing to do: checkpoint is at step {done} (in {config.resume}) and --steps is "
            f"{config.steps}; pass --steps above {done} to train on",
            file=sys.stderr,
        )
        if args.json:
            print(json.dumps({"nothing_to_do": True, "checkpoint_step": done,
                              "steps": config.steps, "resume": config.resume}))  # fmt: skip
        return 0
    if config.resume and not args.reference:
        print(resume_text(config), file=sys.stderr)
    result = run_config(config, reference=args.reference, as_json=args.json)
    if not args.json and result.records:
        print(f"final loss {result.records[-1].loss:.6f}", file=sys.stderr)
    saved = [r.step for r in result.records if r.step % config.save_every == 0]
    if config.save and not args.reference and saved:
        print(f"checkpoint of step {saved[-1]} saved in {latest(config.save)}", file=sys.stderr)
    return 0
