"""The BSR scheduler's caches (rule 2 per owner set and node, int keys) change no pick: it
gives the transfers the plain per-(slice, needer) scheduler gives, fused or not, on flat
and two-kind topologies, for a switch of the metadata benchmark's shape (issue 12)."""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Sequence

import numpy as np
import pytest

from hspmd.comm.bsr import BsrTable, schedule
from hspmd.comm.plan import Transfer, volume
from hspmd.comm.slices import merge_boxes
from hspmd.comm.topology import LinkClass, Topology
from hspmd.cost.traffic import estimate
from hspmd.models import get_config
from hspmd.plan.params import state_annotations
from hspmd.plan.strategy import parse_strategy
from hspmd.switch.cost import switch_tables


def reference(
    tables: Sequence[BsrTable], topology: Topology, *, method: str, fused: bool
) -> tuple[Transfer, ...]:
    """The scheduler as it was before the caches: rule 2 computed per slice and node."""
    node = functools.cache(topology.node_of)
    ranks = sorted({r for t in tables for e in t.entries for r in e.owners})
    num_ranks = 1 + max(ranks)
    nodes = np.full(num_ranks, -1)
    for r in ranks:
        nodes[r] = topology.node_of(r)
    intra = np.array([n.intra.bandwidth for n in topology.nodes])
    nic = np.array([n.nic.bandwidth for n in topology.nodes])

    def fastest(owners: tuple[int, ...], home: int) -> np.ndarray:
        array = np.array(sorted(owners))
        if not topology.nodes:
            return array
        on = nodes[array]
        bw = np.where(on == home, intra[home], np.minimum(nic[on], nic[home]))
        return array[bw == bw.max()]

    loads = np.zeros(num_ranks)
    picked: dict[tuple[int, int, int], list] = defaultdict(list)
    for table in tables:
        if not fused:
            loads[:] = 0.0
        for entry in table.entries:
            size = volume(entry.region) * table.itemsize
            for needer in entry.needers:
                if needer in entry.owners:
                    picked[(needer, needer, table.tensor)].append(entry.region)
                    continue
                if method == "naive":
                    owner = entry.owners[0]
                else:
                    owners = fastest(entry.owners, node(needer))
                    owner = int(owners[loads[owners].argmin()])
                    loads[owner] += size
                picked[(owner, needer, table.tensor)].append(entry.region)
    return tuple(
        Transfer(s, d, box, t) for (s, d, t), boxes in sorted(picked.items())
        for box in merge_boxes(boxes)
    )  # fmt: skip


def strategy(pipelines: int, stages: int, tp: int, layers: int) -> str:
    """The benchmark's strategies (benchmarks/metadata_scale.py), small."""
    per, rank, out = layers // stages, 0, []
    for _ in range(pipelines):
        parts = []
        for s in range(stages):
            parts.append(f"R{rank}-{rank + tp - 1}:L{s * per}-{(s + 1) * per - 1}")
            rank += tp
        out.append("2x1: " + " ".join(parts))
    return "; ".join(out)


def two_kinds() -> Topology:
    """Nodes of 4 with two NIC speeds (a far node's answer depends on its NIC) and a slow
    intra link on some (a same-node owner is then not always the fastest)."""
    fast, slow = LinkClass("ib", 50e9), LinkClass("roce", 25e9)
    return Topology.of_kinds([
        ("A", 4, 4, LinkClass("nvlink", 400e9), fast),
        ("B", 4, 4, LinkClass("pcie", 20e9), slow),
    ])  # fmt: skip


@pytest.mark.parametrize(
    "topology", [Topology.flat(), Topology.uniform_nodes(32, ranks_per_node=4), two_kinds()]
)
def test_scheduler_equals_the_reference(topology: Topology) -> None:
    config = get_config("llama-tiny")  # 4 layers
    old = parse_strategy(strategy(4, 4, 2, config.num_layers))  # 32 ranks
    new = parse_strategy(strategy(8, 2, 2, config.num_layers))
    before, after = state_annotations(old, config), state_annotations(new, config)
    tables = switch_tables(before, after, itemsize=12, failed=(5,))
    for method, fused in (("heuristic", True), ("heuristic", False), ("naive", False)):
        got = schedule(tables, topology=topology, method=method, fused=fused)
        assert got == reference(tables, topology, method=method, fused=fused), (method, fused)
    if topology.nodes:
        fused_ = schedule(tables, topology=topology)
        itemsizes = {t.tensor: t.itemsize for t in tables}
        assert estimate([fused_], topology=topology, itemsizes=itemsizes).time > 0


def test_tensor_indices_need_not_start_at_zero() -> None:
    config = get_config("llama-tiny")
    old = parse_strategy(strategy(2, 2, 2, config.num_layers))
    new = parse_strategy(strategy(4, 1, 2, config.num_layers))
    tables = switch_tables(
        state_annotations(old, config), state_annotations(new, config), itemsize=2
    )
    shifted = [BsrTable(t.entries, tensor=t.tensor + 7, itemsize=t.itemsize) for t in tables]
    topo = Topology.uniform_nodes(8, ranks_per_node=4)
    got = schedule(shifted, topology=topo)
    assert got == reference(shifted, topo, method="heuristic", fused=True)
    assert min(t.tensor for t in got) == 7
