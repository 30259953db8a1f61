"""``hspmd train --elastic --nnodes 2``: two launchers on this machine as two nodes of one
job (two ``hspmd train`` processes; node 0's hosts the store). The test kills processes
from outside with SIGKILL: a worker of node 1, then node 1's whole launcher (its workers
exit with it), and separately node 0's launcher, which ends node 1 with one line.

Multi-process (gloo, 2 + 2 ranks, llama-tiny with 2 layers); every compute is slowed
(``--slowdown``) so that a step outlasts the reading of a line and the kill after it.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import hspmd
from hspmd.cli import build_parser
from hspmd.cli.train import config_from_args
from hspmd.train.api import revise
from hspmd.train.reference import run_reference

pytestmark = [pytest.mark.multiproc, pytest.mark.elastic]

FOUR_DP = "1x2: R0:L0-1; 1x2: R1:L0-1; 1x2: R2:L0-1; 1x2: R3:L0-1"
ARGV = [
    "--strategy", FOUR_DP, "--config", '{"num_layers": 2}', "--seq-len", "16",
    "--global-batch", "8", "--lr", "1e-3", "--steps", "6", "--elastic", "--hang-timeout", "10",
    "--json", "--nnodes", "2", "--master-addr", "127.0.0.1", "--slowdown", "0=20,1=20,2=20,3=20",
]  # fmt: skip
TIMEOUT_S = 240.0  # a cold start of two interpreters on a loaded 2-core machine


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class _Node:
    """One ``hspmd train`` launcher: its stdout's JSON lines, read as they come."""

    def __init__(self, rank: int, port: int, **env_vars: str) -> None:
        env = dict(os.environ, PYTHONPATH=str(Path(hspmd.__file__).parents[1]), **env_vars)
        argv = [*ARGV, "--master-port", str(port), "--node-rank", str(rank)]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hspmd", "train", *argv], env=env, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        self.lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.seen: list[dict[str, Any]] = []
        self.err: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self._errors = threading.Thread(target=self._read_errors, daemon=True)
        self._errors.start()

    def _read_errors(self) -> None:
        assert self.proc.stderr is not None
        self.err.extend(self.proc.stderr)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.lines.put(json.loads(line))
        self.lines.put(None)

    def until(self, wanted: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        """The first line from now on that ``wanted`` accepts (fails if the run ends)."""
        while True:
            item = self.lines.get(timeout=TIMEOUT_S)
            if item is None:
                raise AssertionError(f"the node ended first: {self.finish()[1][-3000:]}")
            self.seen.append(item)
            if wanted(item):
                return item

    def finish(self) -> tuple[int, str]:
        """Its exit status and stderr, once it ended (every line read)."""
        code = self.proc.wait(TIMEOUT_S)
        while (item := self.lines.get(timeout=TIMEOUT_S)) is not None:
            self.seen.append(item)
        self._errors.join(TIMEOUT_S)
        return code, "".join(self.err)


def _start(**env: str) -> list[_Node]:
    port = _free_port()
    return [_Node(rank, port, **env) for rank in (0, 1)]


def _stop(nodes: list[_Node]) -> None:
    for node in nodes:
        if node.proc.poll() is None:
            node.proc.kill()
            node.proc.wait(TIMEOUT_S)


def _kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_a_worker_of_node_1_then_node_1_itself_die() -> None:
    nodes, pids = _start(), []
    try:
        pids = nodes[1].until(lambda e: e.get("event") == "started")["pids"]  # ranks 2, 3
        nodes[0].until(lambda e: e.get("step") == 1 and "loss" in e)
        os.kill(pids[1], signal.SIGKILL)  # rank 3 dies
        resumed = nodes[0].until(lambda e: e.get("event") == "resumed")
        nodes[0].until(lambda e: e.get("step") == resumed["step"] and "loss" in e)
        # node 1 goes down: its worker stops (it can finish no step), its launcher dies
        os.kill(pids[0], signal.SIGSTOP)  # rank 2
        nodes[1].proc.kill()
        code, err = nodes[0].finish()
        assert nodes[1].proc.wait(TIMEOUT_S) == -signal.SIGKILL
    finally:
        _stop(nodes)
        _kill(pids)
    assert code == 0, err[-3000:]
    failures = [e for e in nodes[0].seen if e.get("event") == "failure"]
    assert [(f["rank"], f["cause"]) for f in failures] == [(3, "exit"), (2, "node")], json.dumps(
        nodes[0].seen
    )
    assert [e.get("event") for e in nodes[0].seen].count("resumed") == 2
    records = [e for e in nodes[0].seen if "loss" in e]
    config = config_from_args(build_parser().parse_args(["train", *ARGV]))
    reference = run_reference(revise(config, elastic=False))
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    for mine, theirs in zip(records, reference.records, strict=True):
        assert abs(mine["loss"] - theirs.loss) <= 1e-5 * max(1.0, abs(theirs.loss))


def test_node_0_launcher_death_ends_node_1_with_one_line() -> None:
    nodes = _start(TORCH_CPP_LOG_LEVEL="ERROR")  # torch warns of each broken connection
    try:
        nodes[0].until(lambda e: e.get("step") == 1 and "loss" in e)
        nodes[0].proc.kill()  # the store's host
        code, err = nodes[1].finish()
    finally:
        _stop(nodes)
    assert code == 2, (code, err[-3000:])
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "the job's store at 127.0.0.1:" in lines[0], err[-3000:]
    assert "is gone (node 0's launcher hosts it and ended)" in lines[0]
