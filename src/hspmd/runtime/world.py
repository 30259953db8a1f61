"""One rank's handle on the job: rank, world size, device, and cached subgroups.

Subgroup process groups must be created by every rank, in the same order (gloo needs every
rank to call ``new_group`` for every group; ``use_local_synchronization`` hangs once ranks
belong to different numbers of groups). So a ``World`` never creates a group lazily inside a
collective: ``prepare(plans)`` collects every group a set of plans needs, sorts them, and
creates them all up front on every rank::

    world.prepare([plan_a, plan_b])      # on every rank, same plans, same order
    out = run_plan(plan_a, local, world)  # uses world.group((0, 2)) etc.

Groups are keyed by their sorted rank tuple; the whole world maps to the default group.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from hspmd.comm.plan import CommPlan, GroupCollective, SplitAllReduce
from hspmd.errors import HspmdError

if TYPE_CHECKING:
    from hspmd.runtime.counting import CommLog
    from hspmd.runtime.trace import Recorder

Ranks = tuple[int, ...]


class WorldError(HspmdError, RuntimeError):
    """A process-group request that cannot be served (a group not prepared, a bad rank)."""


def plan_groups(plans: Iterable[CommPlan]) -> list[Ranks]:
    """Sorted rank tuples of every subgroup collective the plans issue, sorted, deduplicated.

    >>> from hspmd.annotation import parse_annotation
    >>> from hspmd.comm.plan import AllGather
    >>> a = parse_annotation("[0,1]{0:2}")
    >>> b = parse_annotation("[0,1]{D:2}")
    >>> plan_groups([CommPlan(a, b, (4,), (AllGather(((1, 0),), dim=0),))])
    [(0, 1)]

    Point-to-point steps (send-recv, BSR, split-reduce-scatter, split-all-gather) run on the
    default group and need none.
    """
    out: set[Ranks] = set()
    for plan in plans:
        for step in plan.steps:
            if isinstance(step, GroupCollective):
                out.update(tuple(sorted(g)) for g in step.groups if len(g) > 1)
            elif isinstance(step, SplitAllReduce):
                out.update(tuple(sorted(s.ranks)) for s in step.slices if len(s.ranks) > 1)
    return sorted(out)


def pick_gloo_interface(local_rank: int) -> None:
    """Set ``GLOO_SOCKET_IFNAME`` to this rank's NIC from ``HSPMD_GLOO_IFNAMES`` (a comma list,
    one NIC per local rank, round robin; ``hspmd netcluster`` sets it), if that is set."""
    names = [n for n in os.environ.get("HSPMD_GLOO_IFNAMES", "").split(",") if n]
    if names:
        os.environ["GLOO_SOCKET_IFNAME"] = names[local_rank % len(names)]


@dataclass(slots=True, eq=False)
class World:
    """This rank's view of an initialized default process group.

    Not a value: it owns the cached subgroups and the active counting logs
    (``hspmd.runtime.counting``). Create it with ``World.create`` (after
    ``init_process_group``) or ``World.from_env`` (under ``torchrun``).
    """

    rank: int
    world_size: int
    device: torch.device
    backend: str
    timeout: datetime.timedelta
    _: KW_ONLY
    groups: dict[Ranks, dist.ProcessGroup] = field(default_factory=dict)
    logs: list[CommLog] = field(default_factory=list)
    waiter: Callable[[Sequence[Any]], None] | None = None
    # elastic runs (hspmd.runtime.watch): the launcher's store, this process's launch index
    # (its rank in generation 0, fixed for the run) and a channel to the launcher
    store: Any = None
    member: int = -1
    notify: Callable[[Any], None] | None = None
    tracer: Recorder | None = None  # hspmd.runtime.trace: set while a run is traced

    @staticmethod
    def create(*, timeout_s: float = 300.0) -> World:
        """Wrap the already initialized default process group."""
        if not dist.is_initialized():
            raise WorldError("no process group: call init_process_group (or use launch) first")
        backend = str(dist.get_backend())
        device = torch.device("cpu")
        if backend == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        return World(
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            device=device,
            backend=backend,
            timeout=datetime.timedelta(seconds=timeout_s),
        )

    @staticmethod
    def from_env(*, backend: str | None = None, timeout_s: float = 300.0) -> World:
        """Initialize from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...).

        The backend defaults to nccl when CUDA is present (one GPU per rank, picked by
        LOCAL_RANK), gloo otherwise.
        """
        for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            if name not in os.environ:
                raise WorldError(f"{name} is not set: start the script with torchrun")
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        pick_gloo_interface(int(os.environ.get("LOCAL_RANK", "0")))
        device_id = None
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            device_id = torch.device("cuda", torch.cuda.current_device())
        else:
            torch.set_num_threads(_threads_per_rank())
        dist.init_process_group(
            backend,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device_id,
        )
        return World.create(timeout_s=timeout_s)

    # -- groups ------------------------------------------------------------------------

    def prepare(self, plans: Iterable[CommPlan]) -> None:
        """Create every subgroup ``plans`` need; call on every rank with the same plans."""
        self.prepare_groups(plan_groups(plans))

    def prepare_groups(self, groups: Iterable[Sequence[int]]) -> None:
        """Create the given groups (any order, duplicates allowed) in sorted order."""
        wanted = sorted({tuple(sorted(g)) for g in groups if len(g) > 1})
        for ranks in wanted:
            if ranks in self.groups or len(ranks) == self.world_size:
                continue
            if ranks[-1] >= self.world_size:
                raise WorldError(
                    f"group {list(ranks)} names rank {ranks[-1]} but the world has "
                    f"{self.world_size} ranks: start more processes"
                )
            group = dist.new_group(list(ranks), timeout=self.timeout)
            self.groups[ranks] = group

    def group(self, ranks: Sequence[int]) -> dist.ProcessGroup | None:
        """The process group of ``ranks`` (None is the default group, the whole world)."""
        key = tuple(sorted(ranks))
        if len(key) == self.world_size:
            return None
        found = self.groups.get(key)
        if found is None:
            raise WorldError(
                f"process group {list(key)} was not prepared: call world.prepare(plans) "
                "on every rank before running them"
            )
        return found

    def wait(self, works: Sequence[Any]) -> None:
        """Wait for issued operations (the executors issue everything with ``async_op``).

        Blocks in ``work.wait()``, bounded by the process-group timeout, unless ``waiter``
        is set: the elastic layer installs one that polls ``is_completed()`` and watches for
        dead peers (DESIGN.md decision 9).
        """
        if self.waiter is not None:
            self.waiter(works)
            return
        for work in works:
            if work is not None:
                work.wait()

    def post(self, issue: Callable[[], list[Any]]) -> list[Any]:
        """``issue()``: post operations. gloo raises while posting to a peer whose
        connection closed; under a ``waiter`` that error takes the waiter's path (an elastic
        run then sees the peer's failure, not a bare ``RuntimeError``)."""
        try:
            return issue()
        except RuntimeError as error:
            if self.waiter is None:
                raise
            self.waiter([_Failed(error)])
            raise

    def record(self, op: str, *, group: Sequence[int], nbytes: int) -> None:
        """Add one issued operation to every active counting log (and the trace)."""
        for log in self.logs:
            log.add(op, group=tuple(group), nbytes=nbytes)
        if self.tracer is not None:
            self.tracer.op(op, tuple(group), nbytes)

    def __str__(self) -> str:
        return f"rank {self.rank}/{self.world_size} on {self.device} ({self.backend})"


def _threads_per_rank() -> int:
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, (os.cpu_count() or 1) // max(1, local))


class _Failed:
    """A posted operation that failed while being posted: completed, with its error."""

    def __init__(self, error: RuntimeError) -> None:
        self.error = error

    def is_completed(self) -> bool:
        return True

    def wait(self) -> bool:
        raise self.error
