"""Pipeline schedules as printable data: one stage's ordered list of actions.

Each rank runs four kinds of executable subgraphs (paper, Appendix A.2); an ``Action`` names
one run of one of them. Text form (round-trips through ``parse_actions``)::

    Pre     pre-processing: parameter gather / fp32->bf16 cast (nothing for plain fp32)
    F3      forward of micro-batch 3 (recv activation, compute, send activation)
    B3      backward of micro-batch 3 (recv gradient, compute, send gradient)
    Post    gradient sync (all-reduce / split-all-reduce ...) and the optimizer step

A schedule is written ``Pre F0 F1 B0 F2 B1 B2 Post``. Every pipeline has its own micro-batch
count; all stages of one pipeline run the same count, and every rank ends with ``Post``,
the only place where pipelines meet.

1F1B on 3 stages, 4 micro-batches (``clock_table``, unit-time F and B; ``.`` is idle)::

    stage | 0  1  2  3  4  5  6  7  8  9  10 11
    ------+------------------------------------
        0 | F0 F1 F2 .  .  B0 F3 B1 .  B2 .  B3
        1 | .  F0 F1 .  B0 F2 B1 F3 B2 .  B3 .
        2 | .  .  F0 B0 F1 B1 F2 B2 F3 B3 .  .

Communication order: a stage sends activations to the next stage in the order of its F's
and gradients to the previous stage in the order of its B's; the receiver must run them in
the same order (``simulate`` checks this with FIFO channels). Sends must not block the
sender (``isend``, or a batched send/receive): 1F1B's steady state has neighbours send to
each other at the same time, which deadlocks with rendezvous sends (``simulate(...,
rendezvous=True)`` shows it).
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from hspmd.errors import HspmdError

__all__ = [
    "Action",
    "Schedule",
    "ScheduleError",
    "Timeline",
    "clock_table",
    "forward_only",
    "gpipe",
    "make_schedule",
    "max_in_flight",
    "one_f_one_b",
    "parse_actions",
    "simulate",
]

KINDS = ("Pre", "F", "B", "Post")
SCHEDULES = ("1f1b", "gpipe")


class ScheduleError(HspmdError, ValueError):
    """A schedule that is malformed, out of order between stages, or deadlocks."""


@dataclass(frozen=True, slots=True)
class Action:
    """One scheduled subgraph run: ``Pre``, ``F<mb>``, ``B<mb>`` or ``Post``.

    >>> str(Action("F", 3)), Action.parse("B12")
    ('F3', Action(kind='B', micro_batch=12))
    """

    kind: str
    micro_batch: int = -1

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ScheduleError(f"bad action kind {self.kind!r}: use one of {', '.join(KINDS)}")
        compute = self.kind in ("F", "B")
        if compute and self.micro_batch < 0:
            raise ScheduleError(f"action {self.kind} needs a micro-batch index, e.g. {self.kind}0")
        if not compute and self.micro_batch != -1:
            raise ScheduleError(f"action {self.kind} takes no micro-batch (got {self.micro_batch})")

    def __str__(self) -> str:
        return self.kind if self.micro_batch < 0 else f"{self.kind}{self.micro_batch}"

    @staticmethod
    def parse(text: str) -> Action:
        match = _ACTION_RE.fullmatch(text.strip())
        if not match:
            raise ScheduleError(f"bad action {text!r}: expected Pre, Post, F<n> or B<n> (e.g. F0)")
        kind, index = match.group(1), match.group(2)
        return Action(kind, int(index) if index else -1)


_ACTION_RE = re.compile(r"(Pre|Post|F|B)(\d*)")


def parse_actions(text: str) -> tuple[Action, ...]:
    """``"Pre F0 B0 Post"`` -> the actions; inverse of ``" ".join(map(str, actions))``."""
    return tuple(Action.parse(word) for word in text.split())


@dataclass(frozen=True, slots=True)
class Schedule:
    """The actions of one stage of one pipeline, in order.

    >>> print(one_f_one_b(2, 0, 3))
    Pre F0 F1 B0 F2 B1 B2 Post
    """

    kind: str
    num_stages: int
    stage: int
    num_micro_batches: int
    actions: tuple[Action, ...]

    def __str__(self) -> str:
        return " ".join(map(str, self.actions))

    def __iter__(self) -> Iterator[Action]:
        return iter(self.actions)

    def __len__(self) -> int:
        return len(self.actions)

    def to_json(self) -> dict[str, object]:
        return {
            "kind": self.kind,
            "num_stages": self.num_stages,
            "stage": self.stage,
            "num_micro_batches": self.num_micro_batches,
            "actions": str(self),
        }


def _check(num_stages: int, stage: int, num_micro_batches: int) -> None:
    if num_stages < 1 or not 0 <= stage < num_stages:
        raise ScheduleError(f"stage {stage} is not in 0..{num_stages - 1} ({num_stages=})")
    if num_micro_batches < 1:
        raise ScheduleError(f"{num_micro_batches=} must be at least 1")


def gpipe(num_stages: int, stage: int, num_micro_batches: int) -> Schedule:
    """All forwards, then all backwards (same order on every stage).

    >>> print(gpipe(4, 1, 3))
    Pre F0 F1 F2 B0 B1 B2 Post
    """
    _check(num_stages, stage, num_micro_batches)
    m = range(num_micro_batches)
    actions = (Action("Pre"), *(Action("F", i) for i in m), *(Action("B", i) for i in m))
    return Schedule("gpipe", num_stages, stage, num_micro_batches, (*actions, Action("Post")))


def one_f_one_b(num_stages: int, stage: int, num_micro_batches: int) -> Schedule:
    """Warm up with ``num_stages - stage - 1`` forwards, alternate F and B, drain the B's.

    At most ``num_stages - stage`` micro-batches are in flight (forward done, backward not).

    >>> print(one_f_one_b(3, 2, 2)), print(one_f_one_b(3, 0, 4))
    Pre F0 B0 F1 B1 Post
    Pre F0 F1 F2 B0 F3 B1 B2 B3 Post
    (None, None)
    """
    _check(num_stages, stage, num_micro_batches)
    warmup = min(num_stages - stage - 1, num_micro_batches)
    actions = [Action("Pre"), *(Action("F", i) for i in range(warmup))]
    for i in range(num_micro_batches - warmup):
        actions += [Action("F", warmup + i), Action("B", i)]
    actions += [Action("B", i) for i in range(num_micro_batches - warmup, num_micro_batches)]
    actions.append(Action("Post"))
    return Schedule("1f1b", num_stages, stage, num_micro_batches, tuple(actions))


def forward_only(num_stages: int, stage: int, num_micro_batches: int) -> Schedule:
    """Every forward in order, no backward and no ``Post``: a held-out evaluation (the
    same F actions as ``gpipe``'s, so stages send and receive activations in one order).

    >>> print(forward_only(2, 1, 3))
    Pre F0 F1 F2
    """
    _check(num_stages, stage, num_micro_batches)
    actions = (Action("Pre"), *(Action("F", i) for i in range(num_micro_batches)))
    return Schedule("forward", num_stages, stage, num_micro_batches, actions)


def make_schedule(kind: str, num_stages: int, stage: int, num_micro_batches: int) -> Schedule:
    """``kind`` is ``"1f1b"`` or ``"gpipe"``."""
    builders = {"1f1b": one_f_one_b, "gpipe": gpipe}
    if kind not in builders:
        raise ScheduleError(f"unknown schedule {kind!r}: choose one of {', '.join(SCHEDULES)}")
    return builders[kind](num_stages, stage, num_micro_batches)


def max_in_flight(actions: Sequence[Action]) -> int:
    """Most micro-batches whose forward ran and whose backward has not, at any point."""
    live = peak = 0
    for action in actions:
        live += {"F": 1, "B": -1}.get(action.kind, 0)
        peak = max(peak, live)
    return peak


# -- a tiny discrete simulation of one pipeline ---------------------------------------------


@dataclass(frozen=True, slots=True)
class Timeline:
    """Start clock of every F/B action of every stage: ``starts[stage][i]`` for action i."""

    stages: tuple[tuple[Action, ...], ...]
    starts: tuple[tuple[int, ...], ...]
    duration: int


def simulate(
    stages: Sequence[Sequence[Action]],
    *,
    forward_cost: int = 1,
    backward_cost: int = 1,
    rendezvous: bool = False,
) -> Timeline:
    """Run one pipeline's stage action lists with blocking receives over FIFO channels.

    ``F i`` on stage s > 0 receives activation i from s - 1 and ``B i`` on stage s < last
    receives gradient i from s + 1; a received message must be the next one its sender
    sent, else ScheduleError (the stages disagree on the order). Sends are buffered unless
    ``rendezvous`` (then a send waits for its receiver to reach the matching receive).
    Returns the as-soon-as-possible timeline; raises ScheduleError on a deadlock.
    """
    compute = [tuple(a for a in s if a.kind in ("F", "B")) for s in stages]
    sim = _Sim(compute, {"F": forward_cost, "B": backward_cost}, rendezvous)
    sim.run()
    return Timeline(tuple(compute), tuple(tuple(s) for s in sim.starts), max(sim.clock, default=0))


class _Sim:
    def __init__(self, stages: list[tuple[Action, ...]], cost: dict[str, int], rdv: bool) -> None:
        self.stages, self.cost, self.rendezvous = stages, cost, rdv
        n = len(stages)
        self.next = [0] * n  # index of each stage's next action
        self.phase = [0] * n  # 0: waiting to receive, 1: computed, waiting to send
        self.clock = [0] * n
        self.starts: list[list[int]] = [[] for _ in range(n)]
        # channels[(src, dst)]: FIFO of (micro-batch, ready clock)
        self.channels: dict[tuple[int, int], deque[tuple[int, int]]] = {}

    def _peer(self, stage: int, action: Action, *, receive: bool) -> int | None:
        step = (-1 if receive else 1) if action.kind == "F" else (1 if receive else -1)
        peer = stage + step
        return peer if 0 <= peer < len(self.stages) else None

    def _waiting_receive(self, stage: int, src: int) -> Action | None:
        if self.next[stage] >= len(self.stages[stage]) or self.phase[stage] != 0:
            return None
        action = self.stages[stage][self.next[stage]]
        return action if self._peer(stage, action, receive=True) == src else None

    def _try_receive(self, stage: int, action: Action) -> bool:
        src = self._peer(stage, action, receive=True)
        if src is None:
            start = self.clock[stage]
        else:
            channel = self.channels.setdefault((src, stage), deque())
            if not channel:
                return False
            micro_batch, ready = channel.popleft()
            if micro_batch != action.micro_batch:
                raise ScheduleError(
                    f"stage {stage} runs {action} but stage {src} sent micro-batch {micro_batch} "
                    "first: adjacent stages must order their F's (and B's) the same way"
                )
            start = max(self.clock[stage], ready)
        self.starts[stage].append(start)
        self.clock[stage] = start + self.cost[action.kind]
        self.phase[stage] = 1
        return True

    def _try_send(self, stage: int, action: Action) -> bool:
        dst = self._peer(stage, action, receive=False)
        if dst is not None:
            if self.rendezvous:
                waiting = self._waiting_receive(dst, stage)
                if waiting is None or waiting.kind != action.kind:
                    return False
            channel = self.channels.setdefault((stage, dst), deque())
            channel.append((action.micro_batch, self.clock[stage]))
        self.phase[stage], self.next[stage] = 0, self.next[stage] + 1
        return True

    def _step(self, stage: int) -> bool:
        if self.next[stage] >= len(self.stages[stage]):
            return False
        action = self.stages[stage][self.next[stage]]
        if self.phase[stage] == 0:
            return self._try_receive(stage, action)
        return self._try_send(stage, action)

    def run(self) -> None:
        while True:
            progressed = False
            for stage in range(len(self.stages)):
                while self._step(stage):
                    progressed = True
            if not progressed:
                break
        stuck = [
            f"stage {s} at {self.stages[s][self.next[s]]}"
            for s in range(len(self.stages))
            if self.next[s] < len(self.stages[s])
        ]
        if stuck:
            mode = "rendezvous sends" if self.rendezvous else "buffered sends"
            raise ScheduleError(f"deadlock with {mode}: " + ", ".join(stuck))


def clock_table(
    stages: Sequence[Sequence[Action]], *, forward_cost: int = 1, backward_cost: int = 1
) -> str:
    """The clock-by-stage table of one pipeline (see the module docstring)."""
    timeline = simulate(stages, forward_cost=forward_cost, backward_cost=backward_cost)
    width = max([2, *(len(str(a)) for s in timeline.stages for a in s)])
    grid = [["."] * timeline.duration for _ in timeline.stages]
    for stage, (actions, starts) in enumerate(zip(timeline.stages, timeline.starts, strict=True)):
        for action, start in zip(actions, starts, strict=True):
            cost = forward_cost if action.kind == "F" else backward_cost
            for clock in range(start, start + cost):
                grid[stage][clock] = str(action)
    head = "stage | " + " ".join(str(c).ljust(width) for c in range(timeline.duration))
    lines = [head.rstrip(), "------+-" + "-" * (len(head) - 8)]
    for stage, row in enumerate(grid):
        lines.append(f"{stage:5d} | " + " ".join(cell.ljust(width) for cell in row).rstrip())
    return "\n".join(lines)
