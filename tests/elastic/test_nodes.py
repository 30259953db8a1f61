"""Two launchers on this machine acting as two nodes of one job, sharing one store (hosted
here, as a job's rendezvous host would): a rank of the second node dies, the other node's
launcher never hears of it but from the store, and all survivors recover together.

Multi-process (gloo, 2 + 2 ranks, llama-tiny with 2 layers).
"""

from __future__ import annotations

import datetime
import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist

from hspmd.plan.strategy import parse_strategy
from hspmd.train.api import revise
from hspmd.train.faults import parse_injections
from hspmd.train.reference import TrainResult
from hspmd.train.trainer import train_elastic
from tests.elastic.helpers import BASE, TIMEOUT_S, assert_matches_reference

pytestmark = [pytest.mark.multiproc, pytest.mark.elastic]

FOUR_DP = "1x2: R0:L0-1; 1x2: R1:L0-1; 1x2: R2:L0-1; 1x2: R3:L0-1"


def test_two_launchers_one_loses_a_rank() -> None:
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False, timeout=timeout)
    config = revise(BASE, strategy=FOUR_DP, inject=parse_injections(["3@2:backward"]))
    address = ("127.0.0.1", store.port)
    events: list[dict[str, Any]] = []
    out: dict[str, Any] = {}

    def node(name: str, first: int) -> None:
        try:
            out[name] = train_elastic(
                config, on_event=events.append, timeout_s=TIMEOUT_S, threads=1,
                node=(address, first, 2),
            )  # fmt: skip
        except BaseException as error:  # noqa: BLE001 - re-raised below
            out[name] = error

    other = threading.Thread(target=node, args=("b", 2), daemon=True)
    other.start()
    node("a", 0)
    other.join(TIMEOUT_S)
    for name in ("a", "b"):
        if isinstance(out.get(name), BaseException):
            raise out[name]
    a, b = out["a"], out["b"]
    assert [(r.step, r.loss) for r in a.records] == [(r.step, r.loss) for r in b.records]
    params = {n: torch.where(torch.isnan(p), b.params[n], p) for n, p in a.params.items()}
    assert_matches_reference(TrainResult(records=a.records, params=params))
    failure = next(e for e in events if e["event"] == "failure")
    assert (failure["rank"], failure["phase"]) == (3, "backward")
    replan = next(e for e in events if e["event"] == "replan")
    assert parse_strategy(replan["strategy"]).global_batch == 8
    assert [e["event"] for e in events].count("resumed") == 1  # reported by rank 0 only
