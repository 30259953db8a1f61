"""BSR: finest slices, the table, the owner-choice heuristics, fused schemes, topology."""

from __future__ import annotations

import pytest

from hspmd.annotation import parse_annotation as A
from hspmd.comm.bsr import BsrTable, messages, schedule
from hspmd.comm.plan import Transfer
from hspmd.comm.relay import plan_relay
from hspmd.comm.slices import holders_table, merge_boxes
from hspmd.comm.topology import LinkClass, Topology, TopologyError
from hspmd.cost.traffic import estimate
from hspmd.errors import ResolutionError


def test_finest_slices_cut_at_every_boundary() -> None:
    rows = holders_table({0: ((0, 4),), 1: ((4, 8),)}, {2: ((0, 6),), 3: ((6, 8),)}, (8,))
    assert rows == [(((0, 4),), (0,), (2,)), (((4, 6),), (1,), (2,)), (((6, 8),), (1,), (3,))]


def test_table_lists_owners_and_needers() -> None:
    table = BsrTable.between(A("[0,1,2,3]{D:2,0:2}"), A("[4,5]{0:2}"), (4, 2))
    assert [(e.owners, e.needers) for e in table.entries] == [((0, 2), (4,)), ((1, 3), (5,))]


def test_table_rejects_partial() -> None:
    with pytest.raises(ResolutionError, match="partial"):
        BsrTable.between(A("[0,1]{P:2}"), A("[2]{}"), (4,))


def test_local_copy_first() -> None:
    table = BsrTable.between(A("[0,1]{D:2}"), A("[1,2]{0:2}"), (4,))
    assert (1, 1) in {(t.src, t.dst) for t in schedule([table])}


def test_faster_link_wins() -> None:
    topo = Topology.uniform_nodes(16, ranks_per_node=8)
    table = BsrTable.between(A("[0,9]{D:2}"), A("[8]{}"), (4,))
    assert [(t.src, t.dst) for t in schedule([table], topology=topo)] == [(9, 8)]
    assert [(t.src, t.dst) for t in schedule([table], method="naive")] == [(0, 8)]


def test_ties_balance_cumulative_load() -> None:
    table = BsrTable.between(A("[0,1]{D:2}"), A("[2,3,4,5]{0:4}"), (8,))
    senders = [t.src for t in sorted(schedule([table]), key=lambda t: t.dst)]
    assert senders == [0, 1, 0, 1]


def test_fused_scheme_shares_the_load_across_tensors() -> None:
    tables = [BsrTable.between(A("[0,1]{D:2}"), A("[2]{}"), (4,), tensor=i) for i in range(4)]
    fused = {t.tensor: t.src for t in schedule(tables)}
    per_tensor = {t.tensor: t.src for t in schedule(tables, fused=False)}
    assert fused == {0: 0, 1: 1, 2: 0, 3: 1}
    assert per_tensor == {0: 0, 1: 0, 2: 0, 3: 0}
    assert list(messages(schedule(tables))) == [(0, 2), (1, 2)]


def test_adjacent_slices_merge_per_pair() -> None:
    table = BsrTable.between(A("[0,1]{0:2}"), A("[2,3,4,5]{1:4}"), (4, 8))
    transfers = schedule([table])
    assert Transfer(0, 2, ((0, 2), (0, 2))) in transfers
    assert len(transfers) == 8
    assert merge_boxes([((0, 1), (0, 2)), ((1, 2), (0, 2)), ((0, 2), (2, 4))]) == [((0, 2), (0, 4))]


def test_unknown_method() -> None:
    with pytest.raises(ResolutionError, match="unknown BSR method"):
        schedule([], method="fastest")


def test_topology_links() -> None:
    h800 = LinkClass("nvlink", 400e9)
    slow_ib = LinkClass("ib", 25e9)
    topo = Topology.of_kinds(
        [
            ("H800", 1, 8, h800, slow_ib),
            ("H20", 1, 8, LinkClass("nvlink", 900e9), LinkClass("ib", 50e9)),
        ]
    )
    assert topo.link(0, 1) == h800
    assert topo.link(8, 9).bandwidth == 900e9
    assert topo.link(0, 8) == slow_ib
    assert topo.link(3, 3).name == "local"
    assert topo.link_classes == ("nvlink", "ib")
    assert Topology.flat().bandwidth(0, 99) == 1.0
    with pytest.raises(TopologyError, match="rank 99"):
        topo.link(0, 99)
    with pytest.raises(TopologyError, match="two nodes"):
        Topology((topo.nodes[0], topo.nodes[0]))


def test_estimate_and_relay_spread_a_single_owner() -> None:
    topo = Topology.uniform_nodes(16, ranks_per_node=8)
    table = BsrTable.between(A("[0]{}"), A("[8]{}"), (64, 8), itemsize=4)
    direct = schedule([table], topology=topo)
    plain = estimate([direct], topology=topo, itemsizes={0: 4})
    assert plain.sent == {0: {"ib": 64 * 8 * 4}}
    assert plain.time == pytest.approx(64 * 8 * 4 / 50e9)
    stages = plan_relay([table], direct, topology=topo, exclude={7}).stages()
    relayed = estimate(stages, topology=topo, itemsizes={0: 4})
    assert relayed.total("ib") == plain.total("ib")
    assert len({t.src for t in stages[1]}) == 7  # every live NIC of node 0
    # a seventh of the bytes per NIC, plus the NVLink hops on both sides (450 GB/s each way)
    assert relayed.time < plain.time / 2.5
