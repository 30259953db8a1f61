"""Launchers of several nodes in one store (``hspmd.runtime.members``): a silent launcher's
members are published dead at once, a finished one is not lost. In-process, one store, no
workers (the multi-process runs are tests/elastic/test_nodes.py and test_cli_nodes.py)."""

from __future__ import annotations

import datetime
import re
import time
from typing import Any

import pytest
import torch.distributed as dist

from hspmd.runtime import members as members_module
from hspmd.runtime.members import (
    Members,
    NodeBeat,
    key,
    latest_generation,
    read_death,
    read_generation,
)


@pytest.fixture
def store() -> Any:
    timeout = datetime.timedelta(seconds=10)
    return dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False, timeout=timeout)


def _node_1(store: Any, beat: int = 1) -> None:
    """A second launcher with members 2 and 3 (registered, one beat), by hand."""
    for member in (2, 3):
        store.set(key("owner", member), "2")
    store.set(key("nodebeat", 2), str(beat))


def test_a_silent_launcher_loses_its_members_in_one_generation(store, monkeypatch) -> None:
    monkeypatch.setattr(members_module, "NODE_TIMEOUT_S", 0.0)  # silent: unchanged once seen
    node0 = Members(store, [0, 1], hang_timeout_s=10.0, everyone=range(4), watch_nodes=True)
    _node_1(store)
    assert node0.lost_nodes() == []  # the first sight of its beat
    store.set(key("nodebeat", 2), "2")
    assert node0.lost_nodes() == []  # it beat since: alive
    assert node0.lost_nodes() == [(2, [2, 3])]  # no beat since
    deaths = node0.node_died(2, [2, 3])
    assert [(d.member, d.cause, d.exitcode) for d in deaths] == [
        (2, "node", None),
        (3, "node", None),
    ]
    assert read_death(store, 3).describe().startswith("rank 3 was lost with its node")
    assert latest_generation(store) == 1 and read_generation(store, 1) == (0, 1)
    assert node0.lost_nodes() == []  # nothing of it left in the generation
    assert node0.others_done(range(4))  # a silent launcher counts as ended


def test_a_finished_launcher_is_not_lost(store, monkeypatch) -> None:
    monkeypatch.setattr(members_module, "NODE_TIMEOUT_S", 0.0)
    node0 = Members(store, [0, 1], hang_timeout_s=10.0, everyone=range(4), watch_nodes=True)
    assert not node0.others_done(range(4))  # node 1 has not started yet
    _node_1(store)
    store.set(key("nodedone", 2), "1")
    assert node0.lost_nodes() == [] and node0.lost_nodes() == []
    assert node0.others_done(range(4))
    assert latest_generation(store) == 0


def test_node_beat_registers_beats_and_says_done(store) -> None:
    node0 = Members(store, [0, 1], hang_timeout_s=10.0, everyone=range(4), watch_nodes=True)
    client = dist.TCPStore("127.0.0.1", store.port, None, False, timeout=store.timeout)
    beat = NodeBeat(client, 2, [2, 3])
    assert int(store.get(key("owner", 3))) == 2 and int(store.get(key("nodebeat", 2))) >= 1
    assert not node0.others_done(range(4))
    beat.done()
    assert node0.others_done(range(4)) and beat.lost is None


def test_a_time_out_names_each_rank_s_last_heartbeat(store) -> None:
    """The launcher's time-out message says where each unfinished rank was (a hang that
    the heartbeat did not catch is diagnosable from the message alone)."""
    members = Members(store, [0, 1, 2], hang_timeout_s=10.0)
    store.set(key("hb", 0), "0.000000 setup 0")
    store.set(key("hb", 1), f"{time.time() - 2.0:.6f} backward 3")
    assert members.describe(0) == "rank 0: setup of step 0, unwatched"
    assert re.fullmatch(
        r"rank 1: backward of step 3, last progress 2\.\d s ago", members.describe(1)
    )
    assert members.describe(2) == "rank 2: no heartbeat"
