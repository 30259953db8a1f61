"""Build, measure, use and tear down the emulated network (needs root and iproute2).

    with session(NetSpec(2, 2, inter_gbps=0.4)) as spec:   # up; down on exit, error, signal
        proc = spawn(1, [sys.executable, "-c", "print('in node 1')"])

``up`` runs ``spec.up_commands`` and removes everything again if one fails (or on Ctrl-C);
``down`` is idempotent: it deletes every namespace with the ``hspmd-nc-`` prefix, whoever
made it. Processes in a node get ``GLOO_SOCKET_IFNAME`` set to the node's veth, so gloo
binds the address on the bridge (traffic to the node's own address still goes through its
loopback) and ``HSPMD_NODE``/``HSPMD_MASTER_ADDR`` for launchers.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from types import FrameType
from typing import Any

from hspmd.netcluster.describe import Measured
from hspmd.netcluster.spec import (
    NODE_IFNAME,
    PREFIX,
    SUBNET,
    Command,
    NetClusterError,
    NetSpec,
    down_commands,
    node_namespace,
    parse_netns_list,
    render,
    up_commands,
)

MEASURE_PORT = 29650
PROBE = f"{PREFIX}probe"


def check_permission(*, probe: bool = False) -> None:
    """Raise a one-line NetClusterError unless this process can make network namespaces.

    ``probe``: also make and delete a namespace (``hspmd-nc-probe``) and set a link up in
    it, which root without CAP_SYS_ADMIN / CAP_NET_ADMIN (a container) cannot."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise NetClusterError(
            f"{' and '.join(missing)} not found: install iproute2 to emulate a network"
        )
    if os.geteuid() != 0:
        raise NetClusterError(
            "network namespaces need root (CAP_NET_ADMIN): run as root, e.g. with sudo"
        )
    if probe:
        made = _run(("ip", "netns", "add", PROBE), check=False)
        tried = _run(("ip", "-n", PROBE, "link", "set", "lo", "up"), check=False)
        _run(("ip", "netns", "del", PROBE), check=False)
        for proc in (made, tried):
            if proc.returncode != 0:
                reason = (proc.stderr.strip().splitlines() or ["failed"])[-1]
                raise NetClusterError(
                    f"cannot make network namespaces here ({reason}): run as root with "
                    "CAP_SYS_ADMIN and CAP_NET_ADMIN (a privileged container)"
                )


def _run(command: Command, *, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(command, capture_output=True, text=True, timeout=60)
    if check and proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip().splitlines()
        if "netem" in command and "unknown" in proc.stderr:
            raise NetClusterError(
                "this kernel has no netem qdisc (module sch_netem), so no latency can be "
                "emulated: drop --latency-ms (bandwidth shaping with htb still works)"
            )
        raise NetClusterError(
            f"`{render(command)}` failed ({detail[-1] if detail else proc.returncode}): "
            "run `hspmd netcluster down` and retry"
        )
    return proc


def existing() -> tuple[str, ...]:
    """Namespaces with this package's prefix that exist now."""
    names = parse_netns_list(_run(("ip", "netns", "list")).stdout)
    return tuple(n for n in names if n.startswith(PREFIX))


def down() -> tuple[str, ...]:
    """Delete every ``hspmd-nc-*`` namespace (and with them, the veths and the bridge)."""
    check_permission()
    commands = down_commands(existing())
    for command in commands:
        _run(command, check=False)
    left = existing()
    if left:
        raise NetClusterError(f"could not delete {', '.join(left)}: `ip netns del` them by hand")
    return tuple(c[-1] for c in commands)


class Signals:
    """Turn SIGTERM/SIGHUP into SystemExit while active, so ``finally`` blocks run."""

    def __enter__(self) -> None:
        self.saved: dict[int, Any] = {}
        for sig in (signal.SIGTERM, signal.SIGHUP):
            with contextlib.suppress(ValueError):  # not the main thread: leave them
                self.saved[sig] = signal.signal(sig, self._exit)

    @staticmethod
    def _exit(signum: int, _frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    def __exit__(self, *_exc: object) -> None:
        for sig, handler in self.saved.items():
            signal.signal(sig, handler)


def up(spec: NetSpec) -> None:
    """Build ``spec``; on any failure (or signal) remove what was built and re-raise."""
    check_permission(probe=True)
    if existing():
        raise NetClusterError(
            f"a netcluster is already up ({', '.join(existing())}): "
            "run `hspmd netcluster down` first"
        )
    with Signals():
        try:
            for command in up_commands(spec):
                _run(command)
        except BaseException:
            down()
            raise


@contextlib.contextmanager
def session(spec: NetSpec) -> Iterator[NetSpec]:
    """``up(spec)``, yield it, and ``down()`` whatever happens (error, Ctrl-C, SIGTERM)."""
    with Signals():
        up(spec)
        try:
            yield spec
        finally:
            down()


def nics_of(node: int) -> tuple[str, ...]:
    """The veths inside ``node`` (``("nc0",)``, or one per rank), in index order."""
    out = _run(("ip", "-n", node_namespace(node), "-o", "link", "show")).stdout
    names = [line.split(":")[1].strip().split("@")[0] for line in out.splitlines()]
    nics = [n for n in names if n.startswith("nc") and n[2:].isdigit()]
    return tuple(sorted(nics, key=lambda n: int(n[2:]))) or (NODE_IFNAME,)


def node_env(node: int) -> dict[str, str]:
    """The environment of a process in ``node``: gloo's interface (``HSPMD_GLOO_IFNAMES``:
    one per local rank where each rank has a NIC), the node and the master."""
    master = f"{SUBNET}.1"  # node 0's address, whatever the spec
    nics = nics_of(node)
    return {
        **os.environ,
        "GLOO_SOCKET_IFNAME": nics[0],
        "HSPMD_GLOO_IFNAMES": ",".join(nics),
        "HSPMD_NODE": str(node),
        "HSPMD_MASTER_ADDR": master,
    }


def exec_argv(node: int, argv: Sequence[str]) -> list[str]:
    """``ip netns exec hspmd-nc-nK ARGV...``."""
    return ["ip", "netns", "exec", node_namespace(node), *argv]


def spawn(node: int, argv: Sequence[str], **popen: Any) -> subprocess.Popen[str]:
    """Start ``argv`` inside ``node`` in a session of its own (kill it with its group)."""
    return subprocess.Popen(
        exec_argv(node, argv),
        env={**node_env(node), **popen.pop("env", {})},
        text=True,
        start_new_session=True,
        **popen,
    )


def stop(proc: subprocess.Popen[str], *, grace_s: float = 5.0) -> None:
    """Wait ``grace_s`` for ``proc`` to end, then kill its whole process group."""
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _stream(*, server: int, client: int, host: str, nbytes: int) -> float:
    """Best bytes/s of one TCP stream from ``client`` to ``server`` (nodes), 3 transfers."""
    tool = [sys.executable, "-m", "hspmd.netcluster.measure"]
    args = [host, str(MEASURE_PORT), str(nbytes), "3"]
    receiver = spawn(server, [*tool, "serve", *args], stdout=subprocess.PIPE)
    try:
        assert receiver.stdout is not None
        if receiver.stdout.readline().strip() != "ready":
            raise NetClusterError(f"the throughput receiver in node {server} did not start")
        sender = spawn(client, [*tool, "send", *args], stdout=subprocess.PIPE)
        out, _ = sender.communicate(timeout=300)
        if sender.returncode != 0:
            raise NetClusterError(f"the throughput test from node {client} to {host} failed")
        return float(json.loads(out)["best_Bps"])
    finally:
        stop(receiver)


def measure(spec: NetSpec, *, loopback_bytes: int = 256 << 20) -> Measured:
    """Loopback inside node 0, and node 0 -> node 1 across the bridge (the shaped link).

    The inter-node transfer is sized to take about a second at the shaped rate.
    """
    loopback = _stream(server=0, client=0, host="127.0.0.1", nbytes=loopback_bytes)
    inter_bytes = max(1 << 20, int(spec.inter_gbps * 1e9 / 8))
    inter = _stream(server=1, client=0, host=spec.address(1), nbytes=inter_bytes)
    return Measured(loopback, inter)


def host_memory_mb() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20
