"""The fused scheme's cost from bytes per (sender, receiver) (hspmd.cost.bsr_volume) equals
the cost of its transfers (traffic.estimate of bsr.schedule), on random small switches:
every byte count and the message count exactly, each rank's seconds to the last bits of a
sum taken in another order; and ``switch-cost``'s JSON is what it was."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hspmd.comm.bsr import BsrTable, messages, schedule
from hspmd.comm.plan import volume
from hspmd.comm.topology import LinkClass, Topology
from hspmd.cost.bsr_volume import fused_estimate, pair_bytes
from hspmd.cost.traffic import Estimate, estimate
from hspmd.models import get_config
from hspmd.plan.params import state_annotations
from hspmd.plan.strategy import parse_strategy
from hspmd.switch.cost import SwitchError, switch_tables

RANKS = 32
TOPOLOGIES = {
    "flat": Topology.flat(),
    "nodes of 4": Topology.uniform_nodes(RANKS, ranks_per_node=4),
    "two kinds": Topology.of_kinds(
        [
            ("A", 4, 4, LinkClass("nvlink", 400e9), LinkClass("ib", 50e9)),
            ("B", 4, 4, LinkClass("pcie", 20e9), LinkClass("roce", 25e9)),
        ]
    ),
}


@st.composite
def strategies(draw: st.DrawFn, layers: int = 4) -> str:
    """1-3 pipelines of 1-3 stages, TP 1 or 2, on ranks with random gaps below 32."""
    rank, pipelines = draw(st.integers(0, 3)), []
    for _ in range(draw(st.integers(1, 3))):
        count = draw(st.integers(1, min(3, layers)))
        cuts = sorted(draw(st.sets(st.integers(1, layers - 1), min_size=count - 1,
                                   max_size=count - 1)))  # fmt: skip
        parts = []
        for lo, hi in zip([0, *cuts], [*cuts, layers], strict=True):
            tp = draw(st.sampled_from((1, 2)))
            if rank + tp > RANKS:
                return draw(strategies())  # start over: rarely needed
            parts.append(f"R{rank}-{rank + tp - 1}:L{lo}-{hi - 1}")
            rank += tp + draw(st.integers(0, 2))
        pipelines.append("1x1: " + " ".join(parts))
    return "; ".join(pipelines)


def tables_of(source: str, target: str, failed: set[int], zero1: bool) -> list[BsrTable]:
    config = get_config("llama-tiny")
    old, new = parse_strategy(source), parse_strategy(target)
    before = state_annotations(old, config, zero1=zero1)
    after = state_annotations(new, config, zero1=zero1)
    return switch_tables(before, after, itemsize=12, failed=failed - set(new.ranks))


@settings(max_examples=15, deadline=None)
@given(
    source=strategies(), target=strategies(), failed=st.sets(st.integers(0, RANKS - 1), max_size=2)
)
def test_shared_entries_are_each_tensors_own(source: str, target: str, failed: set[int]) -> None:
    """switch_tables builds equal annotations' entries once: each is the tensor's own."""
    from hspmd.switch.cost import _entries

    config = get_config("llama-tiny")
    old, new = parse_strategy(source), parse_strategy(target)
    before, after = state_annotations(old, config), state_annotations(new, config)
    failed -= set(new.ranks)
    try:
        tables = switch_tables(before, after, itemsize=2, failed=failed)
    except SwitchError:
        return
    own = [_entries(name, before[name], spec, failed) for name, spec in after.items()]
    assert [t.entries for t in tables] == own


def assert_same(got: Estimate, want: Estimate) -> None:
    assert got.sent == want.sent and got.received == want.received
    assert sorted(got.rank_time) == sorted(want.rank_time)
    for rank, seconds in want.rank_time.items():
        assert math.isclose(got.rank_time[rank], seconds, rel_tol=1e-12), rank
    assert math.isclose(got.time, want.time, rel_tol=1e-12)


@settings(max_examples=30, deadline=None)
@given(
    source=strategies(), target=strategies(), topology=st.sampled_from(sorted(TOPOLOGIES)),
    failed=st.sets(st.integers(0, RANKS - 1), max_size=3), zero1=st.booleans(),
)  # fmt: skip
def test_pair_volumes_price_the_scheme_as_its_transfers(
    source: str, target: str, topology: str, failed: set[int], zero1: bool
) -> None:
    topo = TOPOLOGIES[topology]
    try:
        tables = tables_of(source, target, failed, zero1)
    except SwitchError:  # a slice only failed ranks held
        return
    transfers = schedule(tables, topology=topo)
    itemsizes = {t.tensor: t.itemsize for t in tables}
    got, count = fused_estimate(tables, topology=topo)
    assert_same(got, estimate([transfers], topology=topo, itemsizes=itemsizes))
    pairs = messages(transfers)
    assert count == len(pairs)
    src, dst, volumes = pair_bytes(tables, topology=topo)
    assert list(zip(src.tolist(), dst.tolist(), strict=True)) == list(pairs)
    for (s, d), ts in pairs.items():
        assert volumes[list(pairs).index((s, d))] == sum(
            volume(t.region) * itemsizes[t.tensor] for t in ts
        )


def test_nothing_moves() -> None:
    tables = tables_of("1x1: R0-1:L0-3", "1x1: R0-1:L0-3", set(), False)
    est, count = fused_estimate(tables, topology=TOPOLOGIES["nodes of 4"])
    assert (est.sent, est.rank_time, est.time, count) == ({}, {}, 0.0, 0)


def test_switch_cost_json_is_what_the_transfers_give() -> None:
    from dataclasses import replace

    from hspmd.cost.cluster import load_cluster
    from hspmd.switch.cost import _count_messages, plan_tables, scheme_stages, switch_cost

    cluster = load_cluster("h20x32")
    args = {
        "model": "llama-tiny",
        "source": "1x1: R0-1:L0-1 R2-3:L2-3; 1x1: R8-9:L0-3",
        "target": "1x1: R0-1:L0-3; 1x1: R12-13:L0-1 R16-17:L2-3",
        "cluster": cluster,
    }
    cost = switch_cost(**args, algo="fused", failed=(9,))  # type: ignore[arg-type]
    _, _, tables = plan_tables(**args, states="fp32-adam", failed=(9,))  # type: ignore[arg-type]
    stages = scheme_stages(tables, "fused", topology=cluster.topology())
    itemsizes = {t.tensor: t.itemsize for t in tables}
    old = replace(
        cost,
        num_messages=_count_messages(stages, fused=True),
        estimate=estimate(stages, topology=cluster.topology(), itemsizes=itemsizes),
    )
    got, want = cost.to_json(), old.to_json()
    for key in ("rank_seconds", "seconds"):
        assert got.pop(key) == pytest.approx(want.pop(key), rel=1e-12)
    assert got == want and got["messages"] > 0 and got["slowest_rank"] >= 0
