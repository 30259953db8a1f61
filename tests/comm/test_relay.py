"""Relay plans: data derived from a fused scheme, simulated rank by rank with numpy."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from hspmd.annotation import parse_annotation as A
from hspmd.comm.bsr import BsrTable, schedule
from hspmd.comm.plan import local_box
from hspmd.comm.relay import RelayPlan, plan_relay
from hspmd.comm.topology import Topology
from hspmd.cost.traffic import estimate
from hspmd.models.llama import get_config
from hspmd.plan.strategy import parse_strategy
from hspmd.switch.live import plan_switch


def simulate(plan: RelayPlan, tensors: Any, seed: int = 0) -> dict[tuple[int, int], np.ndarray]:
    """Run ``plan`` on numpy pieces, one dict of relay buffers per rank; within a round every
    read happens before any write (a round is one batch). Returns (rank, tensor) -> piece."""
    rng = np.random.default_rng(seed)
    full = [rng.standard_normal(t.shape) for t in tensors]
    out: dict[tuple[int, int], np.ndarray] = {}
    for i, t in enumerate(tensors):
        for rank, piece in t.dst.pieces(t.shape).items():
            out[(rank, i)] = np.full(piece.shape, np.nan)
    buffers: dict[int, dict[Any, np.ndarray]] = {}
    for round_ in plan.rounds:
        reads = []
        for tr in round_:
            t = tensors[tr.tensor]
            if tr.from_relay:  # a KeyError: read before an earlier round filled it
                value = buffers[tr.src][(tr.tensor, tr.region)]
            else:
                old = t.src.piece(tr.src, t.shape)
                value = full[tr.tensor][tuple(slice(a, b) for a, b in old.region)]
                value = value[local_box(old, tr.region)]
            reads.append((tr, value.copy()))
        for tr, value in reads:
            if tr.to_relay:
                buffers.setdefault(tr.dst, {})[(tr.tensor, tr.region)] = value
            else:
                t = tensors[tr.tensor]
                new = t.dst.piece(tr.dst, t.shape)
                out[(tr.dst, tr.tensor)][local_box(new, tr.region)] = value
    for (rank, i), got in out.items():
        region = tensors[i].dst.piece(rank, tensors[i].shape).region
        np.testing.assert_array_equal(got, full[i][tuple(slice(a, b) for a, b in region)])
    return out


MODEL = get_config("llama-tiny", num_layers=4, num_kv_heads=4)
TWO_NODES = Topology.uniform_nodes(4, ranks_per_node=2)
ONE = "4x1: R0:L0-3"
TP2_NODE1 = "2x2: R2-3:L0-3"
PP_TP = "2x2: R0-1:L0-1 R2-3:L2-3"


@pytest.mark.parametrize(("source", "target"), [(ONE, TP2_NODE1), (TP2_NODE1, PP_TP), (PP_TP, ONE)])
def test_relayed_switch_delivers_every_piece(source: str, target: str) -> None:
    plan = plan_switch(
        MODEL, parse_strategy(source), parse_strategy(target), topology=TWO_NODES, algo="relay"
    )
    assert plan.relay is not None
    simulate(plan.relay, plan.tensors)
    # same bytes over the slow links as fused, but spread over both NICs of a node
    fused = estimate([list(plan.transfers)], topology=TWO_NODES)
    relayed = estimate(plan.relay.stages(), topology=TWO_NODES)
    assert relayed.total("ib") == fused.total("ib") > 0


def test_one_owner_to_a_tp_pair_on_the_other_node() -> None:
    plan = plan_switch(
        MODEL, parse_strategy(ONE), parse_strategy(TP2_NODE1), topology=TWO_NODES, algo="relay"
    )
    assert plan.relay is not None
    # round 0: R0 hands half of what leaves to R1; round 1: NIC k of node 0 sends to NIC k
    # of node 1 only (never R0 -> R3 or R1 -> R2: crossed rails share a NIC on the emulated
    # network); round 2: node 1 swaps the halves it relayed
    assert [sorted(per) for per in plan.relay.messages()] == [
        [(0, 1)],
        [(0, 2), (1, 3)],
        [(2, 3), (3, 2)],
    ]
    assert plan.num_messages == 5
    assert plan.relay.buffers(0) == set() and plan.relay.buffers(1)
    text = str(plan.relay)
    assert text.startswith("relay plan: 3 rounds, 5 messages\nround 0 (1 messages)\n  R0 -> R1")
    assert "relay -> relay" in text and "piece -> piece" in text


def test_excluded_and_flat() -> None:
    table = BsrTable.between(A("[0]{}"), A("[2]{}"), (8, 2))
    transfers = schedule([table], topology=TWO_NODES)
    # rank 1 does not run: nothing to relay through, the plan is the fused scheme
    alone = plan_relay([table], transfers, topology=TWO_NODES, exclude={1})
    assert [len(r) for r in alone.rounds] == [0, 1, 0]
    # a flat topology has no nodes: nothing crosses one
    flat = plan_relay([table], transfers, topology=Topology.flat())
    assert [r.transfer for r in flat.rounds[1]] == list(transfers)
    # several owners: the heuristic already balances, nothing is relayed
    shared = BsrTable.between(A("[0,1]{D:2}"), A("[2]{}"), (8, 2))
    plan = plan_relay([shared], schedule([shared], topology=TWO_NODES), topology=TWO_NODES)
    assert not plan.rounds[0] and not plan.rounds[2]
