"""Fault injection for elastic tests: ``--inject-failure RANK@STEP[:PHASE[:kill|hang]]``.

The named rank (its launch index) fails when it reaches PHASE of STEP: ``kill`` sends
itself SIGKILL (a crash: the process is gone), ``hang`` stops making progress forever (a
stuck device: the process stays, its heartbeat goes stale). Phases, in step order::

    forward    the rank's first forward of the step
    backward   its first backward
    sync       gradient synchronization (before the step commits)
    optimizer  after the commit, before Adam applies
    switch     while a recovery moves states (a failure during recovery)
    save       before the checkpoint of the step is written
    eval       before the held-out evaluation after the step (--eval-every)

>>> parse_injections(["2@3", "0@4:sync:hang"])
(Injection(rank=2, step=3, phase='forward', mode='kill'), Injection(rank=0, step=4, phase='sync', mode='hang'))

Before it acts, the rank writes ``elastic/dying/M`` (time, phase, step) in the launcher's
store, so the failure event can say when it happened, and one line on stderr.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hspmd.errors import HspmdError

__all__ = ["MODES", "PHASES", "Injection", "inject", "parse_injections"]

PHASES = ("forward", "backward", "sync", "optimizer", "switch", "save", "eval")
MODES = ("kill", "hang")


class InjectionError(HspmdError, ValueError):
    """An ``--inject-failure`` value that does not parse."""


@dataclass(frozen=True, slots=True)
class Injection:
    rank: int
    step: int
    phase: str = "forward"
    mode: str = "kill"

    def __str__(self) -> str:
        return f"{self.rank}@{self.step}:{self.phase}:{self.mode}"


def parse_injections(values: Sequence[str]) -> tuple[Injection, ...]:
    """``RANK@STEP[:PHASE[:MODE]]`` values (module docstring)."""
    out = []
    for value in values:
        head, *rest = value.split(":")
        rank, sep, step = head.partition("@")
        if not sep or not rank.strip().isdigit() or not step.strip().isdigit() or len(rest) > 2:
            raise InjectionError(
                f"--inject-failure {value!r}: write RANK@STEP[:PHASE[:kill|hang]], e.g. 2@3 or "
                "0@4:sync:hang"
            )
        phase = rest[0] if rest else "forward"
        mode = rest[1] if len(rest) > 1 else "kill"
        if phase not in PHASES:
            raise InjectionError(
                f"--inject-failure {value!r}: phase {phase!r} is none of {', '.join(PHASES)}"
            )
        if mode not in MODES:
            raise InjectionError(f"--inject-failure {value!r}: mode {mode!r} is not kill or hang")
        if int(step) < 1:
            raise InjectionError(f"--inject-failure {value!r}: steps count from 1")
        out.append(Injection(int(rank), int(step), phase, mode))
    return tuple(out)


def inject(
    injections: Sequence[Injection], *, member: int, step: int, phase: str, watch: Any = None
) -> None:
    """Fail here if an injection names this rank, step and phase (module docstring)."""
    for injection in injections:
        if (injection.rank, injection.step, injection.phase) != (member, step, phase):
            continue
        now = time.time()
        if watch is not None:  # hspmd.runtime.watch.Watch: its store, under its lock
            stamp = f"{now:.6f} {phase} {step}"
            watch.store_call(lambda s, v=stamp: s.set(f"elastic/dying/{member}", v))
        print(
            f"hspmd: injected {injection.mode} of rank {member} in {phase} of step {step} "
            f"at {now:.6f}",
            file=sys.stderr,
            flush=True,
        )
        if injection.mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if watch is not None:
            watch.frozen = True
        while True:  # a hang: no progress, ever (the launcher kills this process)
            time.sleep(1.0)
