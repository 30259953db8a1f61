"""Bytes per rank pair of a switch agree with the traffic model's per-rank volumes."""

from __future__ import annotations

import doctest

import pytest

import hspmd.switch.pairs
from hspmd.switch import SwitchError, load_cluster, switch_cost
from hspmd.switch.pairs import switch_pairs

SOURCE = "2x1: R0-1:L0-3; 2x1: R8-9:L0-3"
TARGET = "1x1: R8-9:L0-1 R4:L2-3; 1x1: R0:L0-3"


def test_doctest() -> None:
    assert doctest.testmod(hspmd.switch.pairs).failed == 0


def test_pairs_match_estimate() -> None:
    cluster = load_cluster("h20x32")
    algos = ("naive", "per-tensor", "fused", "relay")
    traffics = switch_pairs(
        model="llama-tiny", source=SOURCE, target=TARGET, cluster=cluster, algos=algos
    )
    assert [t.algo for t in traffics] == list(algos)
    for traffic in traffics:
        cost = switch_cost(
            model="llama-tiny", source=SOURCE, target=TARGET, cluster=cluster, algo=traffic.algo
        )
        sent = {r: sum(per.values()) for r, per in cost.estimate.sent.items()}
        assert traffic.sent() == pytest.approx(sent)
        assert traffic.time == pytest.approx(cost.estimate.time)
        for src, dst, link, size in traffic.pairs:
            assert src != dst and size > 0
            assert link == cluster.topology().link(src, dst).name
    naive, _, fused, relay = traffics
    assert naive.received() == pytest.approx(fused.received())  # same data, other senders
    assert relay.total() >= fused.total()  # relays forward pieces twice


def test_unknown_algo() -> None:
    with pytest.raises(SwitchError, match="unknown switch algorithm 'fast'"):
        switch_pairs(
            model="llama-tiny", source=SOURCE, target=TARGET, cluster=load_cluster("h20x32"),
            algos=("fused", "fast"),
        )  # fmt: skip
