"""Start N local worker processes with a process group each; collect their results.

The embedded default: gloo on CPU, `cpu_count // nproc` torch threads per rank (at least one;
``threads=`` sets it), a TCPStore rendezvous on 127.0.0.1
at a free port, hosted by the launcher itself (not by rank 0, so any rank may die)::

    def work(world, scale):             # a module-level function (it is pickled)
        return world.rank * scale

    launch(work, 4, args=(10,))         # -> [0, 10, 20, 30]

A worker that raises (or dies) makes the launcher kill the others and raise ``LaunchError``
naming the rank, the exception and its traceback. Every wait is bounded: the process-group
timeout, the launcher's ``timeout_s``, and a short grace period before SIGKILL.

Elastic (``elastic=ElasticLaunch(...)``, docs/elastic.md): the launcher never kills the
survivors. A worker's death, or a heartbeat without progress for the hang timeout (the
launcher kills that worker first), is published in the store as the next generation of
members (``hspmd.runtime.members``); the survivors regroup in-process. A dead rank's
result is None. Several elastic launchers (one per node, ``ElasticLaunch(store=(host,
port), first_member=..., num_members=...)``) share one store, hosted by node 0's
(``serve=True``): each beats in it, node 0's publishes the members of a launcher gone
silent as dead, and a launcher that loses the store ends with one line.

Workers are started with the "forkserver" method by default: a clean server process (never
a fork of the caller) imports torch once, and every worker is forked from it. That is as
safe as "spawn" but avoids importing torch in every worker: 8 workers start in about 0.2 s
instead of 13-18 s with "spawn" on a loaded 2-core machine (after the first launch, which
starts the server). Pass ``start_method="spawn"`` to get fresh interpreters.
``preload("mod", ...)`` adds modules to what the server imports when it starts: the test
suite preloads ``torch._dynamo``, which meta-device runs of user modules import on first
use (2-3 s of CPU per worker; docs/runtime.md).

Across machines, one launcher per node: ``launch(fn, nproc, node=NodeSpec(...))`` starts
ranks ``node_rank * nproc ..`` of ``num_nodes * nproc`` and returns its own ranks' results;
node 0's launcher hosts the store at ``master_addr:master_port`` and waits until every rank
of every node is done before it closes it::

    # on node 0 (address 10.213.0.1) and on node 1, the same call but node_rank=1
    launch(work, 2, args=(10,), node=NodeSpec(0, 2, "10.213.0.1", 29500))   # -> [0, 10]

Or run the same worker function under torchrun with ``run_from_env``.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib
import multiprocessing as mp
import os
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hspmd.errors import HspmdError
from hspmd.runtime.members import Members, NodeBeat
from hspmd.runtime.world import World, pick_gloo_interface

_PRELOAD = ["torch", "torch.distributed", "numpy", "hspmd.runtime.execute"]
_GRACE_S = 2.0


class LaunchError(HspmdError, RuntimeError):
    """A worker raised, died, or did not finish in time."""

    def __init__(self, message: str, *, rank: int | None = None, remote_traceback: str = ""):
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """This launcher's place among ``num_nodes`` launchers (one per machine).

    ``master_addr:master_port`` is where node 0's launcher hosts the store: an address of
    node 0 that every node can reach (not 127.0.0.1 unless all nodes are this machine).
    """

    node_rank: int
    num_nodes: int
    master_addr: str
    master_port: int

    def __post_init__(self) -> None:
        if not 0 <= self.node_rank < self.num_nodes:
            raise LaunchError(
                f"node rank {self.node_rank} of {self.num_nodes} nodes: give 0..{self.num_nodes - 1}"
            )
        if not 0 < self.master_port < 65536:
            raise LaunchError(f"master port {self.master_port}: give a TCP port in 1..65535")

    @staticmethod
    def from_env(env: dict[str, str] | None = None) -> NodeSpec | None:
        """From ``HSPMD_NNODES``, ``HSPMD_NODE_RANK``, ``HSPMD_MASTER_ADDR`` and
        ``HSPMD_MASTER_PORT`` (None when ``HSPMD_NNODES`` is unset or 1)."""
        env = dict(os.environ if env is None else env)
        if int(env.get("HSPMD_NNODES", "1")) <= 1:
            return None
        try:
            return NodeSpec(
                int(env["HSPMD_NODE_RANK"]),
                int(env["HSPMD_NNODES"]),
                env["HSPMD_MASTER_ADDR"],
                int(env.get("HSPMD_MASTER_PORT", "29500")),
            )
        except KeyError as missing:
            raise LaunchError(f"HSPMD_NNODES is set but {missing} is not: set both") from None


_DONE_KEY = "hspmd/launch/done"
_HANG_POLL_S = 0.05  # elastic: how often the launcher looks at the heartbeats


@dataclass(frozen=True, slots=True, kw_only=True)
class ElasticLaunch:
    """An elastic launch: a worker's death or hang is published, never fatal to the others.

    ``hang_timeout_s``: a rank without progress that long is killed and published dead;
    ``on_message(rank, payload)``: what workers send with ``world.notify`` (events)."""

    hang_timeout_s: float
    on_message: Callable[[int, Any], None] | None = None
    on_start: Callable[[list[int]], None] | None = None  # the workers' process ids by rank
    spares: int = 0  # the last ``spares`` processes start outside the group, until a growth
    # several launchers, one per node, acting as one job: the job's store (host, port),
    # hosted elsewhere; this launcher's workers are launch ranks first_member.. of
    # num_members in all. The launcher of first_member 0 publishes generation 0.
    store: tuple[str, int] | None = None
    first_member: int = 0
    num_members: int | None = None
    # host that store here (node 0 of ``hspmd train --elastic --nnodes N``): the job ends
    # with this launcher, which waits until every other launcher finished or went silent
    serve: bool = False


class _Closed(LaunchError):
    """A worker's pipe closed with no result: it died."""


@dataclass(frozen=True, slots=True, kw_only=True)
class _WorkerSpec:
    rank: int
    world_size: int
    host: str
    port: int
    backend: str
    pg_timeout_s: float
    threads: int
    node: NodeSpec | None = None
    local_rank: int = 0
    elastic: bool = False


def launch(
    fn: Callable[..., Any],
    nproc: int,
    *,
    args: Sequence[Any] = (),
    backend: str = "gloo",
    timeout_s: float = 300.0,
    pg_timeout_s: float | None = None,
    threads: int | None = None,
    start_method: str = "forkserver",
    node: NodeSpec | None = None,
    elastic: ElasticLaunch | None = None,
) -> list[Any]:
    """Run ``fn(world, *args)`` on ``nproc`` local processes; return the results by rank.

    Results travel back pickled: keep them small (numbers, numpy arrays, CPU tensors).
    ``threads`` is torch's intra-op thread count per worker (default: cores // nproc, at
    least 1). ``pg_timeout_s`` (default ``timeout_s``) bounds every collective. With
    ``node``, this is one of several launchers: it runs this node's ``nproc`` ranks and
    returns their results (see the module docstring). ``elastic``: the run survives its
    workers (``ElasticLaunch``, docs/elastic.md); a dead rank's result is None, and the
    workers' ``World`` carries the store, its member id and ``notify``.
    """
    _check_launch(nproc, backend)
    meet = _Rendezvous.open(nproc, node=node, elastic=elastic, timeout_s=timeout_s)
    base = _WorkerSpec(
        rank=0, world_size=meet.world_size, host=meet.host, port=meet.port, backend=backend,
        pg_timeout_s=pg_timeout_s or timeout_s,
        threads=threads or max(1, (os.cpu_count() or 1) // nproc), node=node,
        elastic=elastic is not None,
    )  # fmt: skip
    beat: NodeBeat | None = None
    procs: list[Any] = []
    conns: list[Connection] = []
    deadline = time.monotonic() + timeout_s
    try:
        _start_workers(fn, args, base, first=meet.first, nproc=nproc, start_method=start_method,
                       procs=procs, conns=conns)  # fmt: skip
        members = None
        if elastic is not None:
            members, beat = _elastic_members(elastic, meet, procs, nproc=nproc,
                                             timeout_s=timeout_s)  # fmt: skip
        try:
            results = _collect(
                procs, conns, deadline=deadline, first=meet.first, elastic=elastic, members=members
            )
        except (LaunchError, RuntimeError) as error:
            if beat is not None and not _serves(elastic) and not _reachable(meet.host, meet.port):
                raise _store_gone(meet.host, meet.port) from error
            raise
        _wind_down(procs, meet, beat=beat, members=members, serves=_serves(elastic),
                   several_nodes=node is not None, deadline=deadline)  # fmt: skip
        return results
    finally:
        if beat is not None:
            beat.done()
        _stop(procs)
        for conn in conns:
            conn.close()
        del meet


def _wind_down(
    procs: list[Any], meet: _Rendezvous, *, beat: NodeBeat | None, members: Members | None,
    serves: bool, several_nodes: bool, deadline: float,
) -> None:  # fmt: skip
    """Every result is in: let the workers exit cleanly, stop beating, and keep a store
    that other launchers still use until they are done."""
    _stop(procs, exit_s=_GRACE_S)
    if beat is not None:
        beat.done()
    if several_nodes and meet.store is not None:
        _wait_done(meet.store, meet.world_size, deadline=deadline)  # the other nodes use it
    if members is not None and serves:  # the others still use the store
        _wait_others(members, range(meet.world_size), deadline=deadline)


def _check_launch(nproc: int, backend: str) -> None:
    if nproc < 1:
        raise LaunchError(f"nproc={nproc}: start at least one process")
    if backend == "nccl" and torch.cuda.device_count() < nproc:
        raise LaunchError(
            f"backend nccl needs one GPU per rank: {nproc} ranks but "
            f"{torch.cuda.device_count()} GPUs; use backend='gloo'"
        )


@dataclass(slots=True, kw_only=True)
class _Rendezvous:
    """Where the workers meet: the store this launcher holds (None on a node that only
    connects to node 0's), its address, this launcher's first rank and the world size."""

    store: Any
    host: str
    port: int
    first: int
    world_size: int

    @staticmethod
    def open(
        nproc: int, *, node: NodeSpec | None, elastic: ElasticLaunch | None, timeout_s: float
    ) -> _Rendezvous:
        if elastic is not None and elastic.store is not None:  # a node of an elastic job
            host, port = elastic.store
            store = dist.TCPStore(
                host, port, None, elastic.serve, timeout=_seconds(timeout_s),
                wait_for_workers=False,
            )  # fmt: skip
            return _Rendezvous(store=store, host=host, port=port, first=elastic.first_member,
                               world_size=elastic.num_members or nproc)  # fmt: skip
        if node is None:
            spares = elastic.spares if elastic is not None else 0
            store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
            return _Rendezvous(store=store, host="127.0.0.1", port=store.port, first=0,
                               world_size=nproc - spares)  # fmt: skip
        # node 0 hosts the store for every node; the others only connect to it
        host, port = node.master_addr, node.master_port
        hosted = None
        if node.node_rank == 0:
            hosted = dist.TCPStore(host, port, None, True, wait_for_workers=False)
        return _Rendezvous(store=hosted, host=host, port=port, first=node.node_rank * nproc,
                           world_size=node.num_nodes * nproc)  # fmt: skip


def _start_workers(
    fn: Callable[..., Any], args: Sequence[Any], base: _WorkerSpec, *, first: int, nproc: int,
    start_method: str, procs: list[Any], conns: list[Connection],
) -> None:  # fmt: skip
    """Start ranks ``first .. first + nproc - 1`` (appended to ``procs`` and ``conns`` as
    they start, so that a failed start still stops the ones before)."""
    ctx: Any = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)
    for local in range(nproc):
        rank = first + local
        spec = dataclasses.replace(base, rank=rank, local_rank=local)
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_worker_main, args=(fn, tuple(args), spec, writer), name=f"hspmd-rank{rank}"
        )
        proc.start()
        writer.close()
        procs.append(proc)
        conns.append(reader)


def _elastic_members(
    elastic: ElasticLaunch, meet: _Rendezvous, procs: list[Any], *, nproc: int, timeout_s: float
) -> tuple[Members, NodeBeat | None]:
    """The membership this launcher keeps of its workers (and, on a node of several, its
    heartbeat in the job's store)."""
    if elastic.on_start is not None:
        elastic.on_start([proc.pid for proc in procs])
    several, spares = elastic.store is not None, elastic.spares
    first, world_size = meet.first, meet.world_size
    members = Members(
        meet.store, range(first, first + nproc - spares), hang_timeout_s=elastic.hang_timeout_s,
        spares=range(nproc - spares, nproc), everyone=range(world_size) if first == 0 else None,
        watch_nodes=several and first == 0,
    )  # fmt: skip
    beat = None
    if several:
        beat = NodeBeat(
            _client(meet.host, meet.port, timeout_s), first, range(first, first + nproc)
        )
    return members, beat


def _serves(elastic: ElasticLaunch | None) -> bool:
    """This launcher hosts the job's store (node 0 of several)."""
    return elastic is not None and elastic.store is not None and elastic.serve


def _client(host: str, port: int, timeout_s: float) -> Any:
    return dist.TCPStore(host, port, None, False, timeout=_seconds(timeout_s))


def _reachable(host: str, port: int, *, for_s: float = 1.0) -> bool:
    """Something listens at ``host:port`` for ``for_s`` (plain connections: a store client
    that fails logs torch's warnings). Probed again and again: a process that is dying
    closes its connections before its listening socket."""
    end = time.monotonic() + for_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                pass
        except OSError:
            return False
        if time.monotonic() > end:
            return True
        time.sleep(0.05)


def _store_gone(host: str, port: int) -> LaunchError:
    return LaunchError(
        f"the job's store at {host}:{port} is gone (node 0's launcher hosts it and ended): "
        "the run cannot go on without it; start every node again (--resume DIR continues "
        "from a checkpoint)"
    )


def _wait_others(members: Members, everyone: range, *, deadline: float) -> None:
    """The store's host: wait until every other launcher finished or went silent."""
    while not members.others_done(everyone):
        for node, lost in members.lost_nodes():  # the others may still train: watch on
            members.node_died(node, lost)
        if time.monotonic() > deadline:
            raise LaunchError(
                "timed out: other nodes' launchers did not finish; raise timeout_s or look at them"
            )
        time.sleep(0.05)


def _wait_done(store: Any, world_size: int, *, deadline: float) -> None:
    """Wait until every rank of every node counted itself done in the store."""
    while int(store.add(_DONE_KEY, 0)) < world_size:
        if time.monotonic() > deadline:
            done = int(store.add(_DONE_KEY, 0))
            raise LaunchError(
                f"timed out: {world_size - done} ranks of other nodes did not finish; "
                "raise timeout_s or look at the other nodes' launchers"
            )
        time.sleep(0.05)


def _collect(
    procs: list[Any], conns: list[Connection], *, deadline: float, first: int = 0,
    elastic: ElasticLaunch | None = None, members: Members | None = None,
) -> list[Any]:  # fmt: skip
    """Wait for one result per rank; raise on the first error, death or the deadline.

    Ranks in messages are global: local index + ``first``. Elastic (``members`` given): a
    death or a hang is published (``Members``) and the others go on; the dead rank's
    result is None."""
    results: dict[int, Any] = {}
    waiting = {id(c): r for r, c in enumerate(conns)}
    sentinels = {p.sentinel: r for r, p in enumerate(procs)}
    on_message = elastic.on_message if elastic is not None else None
    while len(results) < len(procs):
        left = deadline - time.monotonic()
        if left <= 0:
            missing = sorted(first + r for r in set(range(len(procs))) - set(results))
            beats = "" if members is None else f" ({'; '.join(map(members.describe, missing))})"
            raise LaunchError(f"timed out: ranks {missing} did not finish{beats}; raise timeout_s")
        poll = left if members is None else min(left, _HANG_POLL_S)
        ready = wait([c for c in conns if id(c) in waiting] + list(sentinels), timeout=poll)
        # Exits first: a rank that died is the cause of its peers' errors, not their victim.
        for item in ready:
            if not isinstance(item, Connection) and item in sentinels:
                rank = sentinels.pop(item)
                _check_exit(
                    procs[rank], rank, conns[rank], waiting, results, first, members, on_message
                )
        for item in ready:
            if isinstance(item, Connection) and id(item) in waiting:
                rank = waiting[id(item)]
                try:
                    if _take(item, rank, results, procs[rank], first, on_message):
                        waiting.pop(id(item))
                except _Closed:
                    if members is None:
                        raise
                    waiting.pop(id(item))  # its exit (sentinel) publishes the death
                except LaunchError as error:
                    if members is None:
                        raise _cause_of(error, procs, results, first) from None
                    raise
        if members is not None:
            _watch_members(members, procs, conns, waiting, sentinels, results, first)
    return [results[r] for r in range(len(procs))]


def _watch_members(
    members: Members, procs: list[Any], conns: list[Connection], waiting: dict[int, int],
    sentinels: dict[Any, int], results: dict[int, Any], first: int,
) -> None:  # fmt: skip
    """Elastic: kill and publish hung members, serve growth, let unused spares go."""

    def drop(rank: int) -> None:
        procs[rank].kill()
        procs[rank].join(_GRACE_S)
        sentinels.pop(procs[rank].sentinel, None)
        waiting.pop(id(conns[rank]), None)
        results[rank] = None

    for member in members.stale():  # hung: fence it (kill), then publish
        drop(member - first)
        members.died(member, cause="hang", exitcode=procs[member - first].exitcode)
    if members.watch_nodes:  # a silent launcher: its node is gone, with its members
        for node, lost in members.lost_nodes():
            members.node_died(node, lost)
    if not members.alive and members.generation_empty():
        raise LaunchError("every rank died: nothing left to train on")
    members.serve_growth()
    if all(m - first in results for m in members.alive):  # done: unused spares go
        for rank in members.spares:
            drop(rank)
        members.spares.clear()


# a peer's lost connection: a rank that died a moment ago is the cause (gloo reports "Connection
# reset by peer" or "Connection closed by peer" on the survivors)
_LOST = ("connection reset", "connection closed", "broken pipe")


def _cause_of(
    error: LaunchError, procs: list[Any], results: dict[int, Any], first: int
) -> LaunchError:
    """``error`` (a rank raised), or, where it is a lost connection and another rank exits
    without a result within ``_GRACE_S``, that rank's death: the cause comes first, as when
    both are seen at once (``_collect``)."""
    if not any(word in str(error).lower() for word in _LOST):
        return error
    others = {
        p.sentinel: r for r, p in enumerate(procs) if r not in results and r + first != error.rank
    }
    for sentinel in wait(list(others), timeout=_GRACE_S):
        rank = others[sentinel]
        procs[rank].join(_GRACE_S)
        if procs[rank].exitcode:
            return LaunchError(
                f"rank {first + rank} died with exit code {procs[rank].exitcode} and no result "
                f"(then {error})",
                rank=first + rank,
            )
    return error


def _take(
    conn: Connection, rank: int, results: dict[int, Any], proc: Any, first: int = 0,
    on_message: Callable[[int, Any], None] | None = None,
) -> bool:  # fmt: skip
    """Read one message of rank ``rank`` (a local index; ``first + rank`` in messages):
    True once it was the final one (its result)."""
    name = first + rank
    try:
        status, payload = conn.recv()
    except EOFError:
        proc.join(_GRACE_S)
        raise _Closed(
            f"rank {name} died with exit code {proc.exitcode} and no result", rank=name
        ) from None
    if status == "event":
        if on_message is not None:
            on_message(name, payload)
        return False
    if status == "ok":
        results[rank] = payload
        return True
    kind, text, trace = payload
    where = _user_line(trace)
    at = f" at {where}" if where else ""
    log = _write_log(name, trace)
    raise LaunchError(
        f"rank {name} raised {kind}: {text}{at} (full traceback: {log})",
        rank=name,
        remote_traceback=trace,
    )


def _user_line(trace: str) -> str | None:
    """``file:line`` of the innermost frame of a traceback outside torch and hspmd."""
    found = None
    for line in trace.splitlines():
        line = line.strip()
        if line.startswith('File "') and "/torch/" not in line and "/hspmd/" not in line:
            path, _, rest = line[6:].partition('", line ')
            if not path.startswith("<"):
                found = f"{path}:{rest.split(',')[0]}"
    return found


def _write_log(rank: int, trace: str) -> str:
    """The worker's traceback in a file (the one-line error names it)."""
    folder = Path(tempfile.gettempdir()) / "hspmd-logs"
    try:
        folder.mkdir(exist_ok=True)
        path = folder / f"rank-{rank}-{os.getpid()}-{time.strftime('%Y%m%d-%H%M%S')}.txt"
        path.write_text(trace)
    except OSError:
        return "not written: the temporary folder is not writable"
    return str(path)


def _check_exit(
    proc: Any, rank: int, conn: Connection, waiting: dict[int, int], results: dict[int, Any],
    first: int = 0, members: Members | None = None,
    on_message: Callable[[int, Any], None] | None = None,
) -> None:  # fmt: skip
    """A process ended: fine if its result arrived (or is still in the pipe), else an error
    (elastic: a published death)."""
    try:
        while id(conn) in waiting and conn.poll(0.2):
            if _take(conn, rank, results, proc, first, on_message):
                waiting.pop(id(conn))
    except _Closed:
        if members is None:
            raise
    proc.join(_GRACE_S)
    if rank in results:
        return
    if members is None:
        raise LaunchError(
            f"rank {first + rank} died with exit code {proc.exitcode} and no result",
            rank=first + rank,
        )
    waiting.pop(id(conn), None)
    if first + rank in members.alive:
        members.died(first + rank, cause="exit", exitcode=proc.exitcode)
    results[rank] = None


def _stop(procs: list[Any], *, exit_s: float = 0.0) -> None:
    """Wait up to ``exit_s`` for the workers to exit, terminate what still runs, then kill
    what ignores it; reap everything."""
    deadline = time.monotonic() + exit_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + _GRACE_S
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(_GRACE_S)


def _worker_main(
    fn: Callable[..., Any], args: tuple[Any, ...], spec: _WorkerSpec, conn: Any
) -> None:
    _watch_parent()
    torch.set_num_threads(spec.threads)
    pick_gloo_interface(spec.local_rank)
    try:
        store = dist.TCPStore(
            spec.host,
            spec.port,
            None,
            False,
            timeout=datetime.timedelta(seconds=spec.pg_timeout_s),
        )
        if spec.rank < spec.world_size:
            dist.init_process_group(
                spec.backend,
                store=store,
                rank=spec.rank,
                world_size=spec.world_size,
                timeout=datetime.timedelta(seconds=spec.pg_timeout_s),
                device_id=_device_for(spec),
            )
            world = World.create(timeout_s=spec.pg_timeout_s)
        else:  # a spare: outside any group until a growth takes it (hspmd.runtime.members)
            world = World(-1, 0, torch.device("cpu"), spec.backend, _seconds(spec.pg_timeout_s))
        if spec.elastic:
            world.store, world.member = store, spec.rank
            world.notify = lambda payload: conn.send(("event", payload))
        result = fn(world, *args)
        conn.send(("ok", result))
        if spec.node is not None:
            store.add(_DONE_KEY, 1)  # node 0's launcher keeps the store up until all are done
        if spec.elastic:  # past groups are kept referenced: their destructors would block
            conn.close()
            os._exit(0)
    except BaseException as error:  # noqa: BLE001 - every failure goes back to the launcher
        conn.send(("error", (type(error).__name__, str(error), traceback.format_exc())))
        conn.close()
        os._exit(1)
    conn.close()
    if dist.is_initialized():
        dist.destroy_process_group()


def preload(*modules: str) -> None:
    """Have this process's forkserver import ``modules`` too, once for all its workers (read
    when the server starts: the first forkserver launch)."""
    _PRELOAD.extend(m for m in modules if m not in _PRELOAD)


def _seconds(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def _device_for(spec: _WorkerSpec) -> torch.device | None:
    """nccl: this process's GPU, the ``local_rank``-th of this machine (one GPU per rank;
    ``launch`` refused more local ranks than GPUs)."""
    if spec.backend != "nccl":
        return None
    torch.cuda.set_device(spec.local_rank)
    return torch.device("cuda", torch.cuda.current_device())


def _watch_parent() -> None:
    """Exit when the parent process goes away (no orphans if the launcher is killed)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(3)

    threading.Thread(target=watch, daemon=True, name="hspmd-parent-watch").start()


def run_from_env(fn: Callable[..., Any], *args: Any, backend: str | None = None) -> Any:
    """Run ``fn(world, *args)`` on this process under torchrun (RANK, WORLD_SIZE, ... set).

    The process exits by itself if its parent (torchrun's agent) goes away.
    """
    _watch_parent()
    world = World.from_env(backend=backend)
    try:
        return fn(world, *args)
    finally:
        dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> int:
    """``torchrun ... -m hspmd.runtime package.module:function [ARG...]``.

    Every rank runs ``function(world, *ARGS)`` (arguments as strings); rank 0 prints what
    it returns.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or ":" not in argv[0]:
        print("usage: torchrun [...] -m hspmd.runtime package.module:function [ARG...]")
        return 2
    module, _, name = argv[0].partition(":")
    fn = getattr(importlib.import_module(module), name)
    result = run_from_env(fn, *argv[1:])
    if result is not None and int(os.environ.get("RANK", "0")) == 0:
        print(result)
    return 0
