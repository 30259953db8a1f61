"""OpGraph: validation, deduplication, derived orders and levels."""

from __future__ import annotations

import numpy as np
import pytest

from hspmd.errors import PartitionError
from hspmd.partition.graph import OpGraph, longest_paths


def _build(edges, num: int = 4, **kw) -> OpGraph:  # type: ignore[no-untyped-def]
    return OpGraph.build(
        "g",
        [f"n{i}" for i in range(num)],
        time_us=kw.pop("time_us", [1.0] * num),
        out_bytes=kw.pop("out_bytes", [0] * num),
        residual_bytes=[0] * num,
        edges=edges,
        **kw,
    )


def test_dedup_keeps_input_order_of_successors() -> None:
    g = _build([(0, 3), (0, 1), (0, 3), (1, 2)])
    assert g.num_edges == 3
    assert g.dst[g.out_ptr[0] : g.out_ptr[1]].tolist() == [3, 1]
    assert g.topo_order.tolist() == [0, 3, 1, 2]
    assert g.topo_rank[g.topo_order].tolist() == [0, 1, 2, 3]
    assert g.level.tolist() == [0, 1, 2, 1]
    assert g.preds[g.in_ptr[2] : g.in_ptr[3]].tolist() == [1]


def test_edges_by_name_and_index_lookup() -> None:
    g = _build([("n0", "n1"), ("n1", "n2")], num=3)
    assert (g.src.tolist(), g.dst.tolist()) == ([0, 1], [1, 2])
    assert g.index["n2"] == 2
    assert repr(g) == "OpGraph('g', nodes=3, edges=2)"


@pytest.mark.parametrize(
    ("edges", "kw", "message"),
    [
        ([(0, 1), (1, 0)], {}, "cycle"),
        ([(1, 1)], {}, "self loop"),
        ([(0, 9)], {}, "node indices"),
        ([("n0", "zz")], {}, "not a node"),
        ([], {"time_us": [1.0, -1.0, 1.0, 1.0]}, "time_us"),
        ([], {"out_bytes": [0, 0]}, "2 entries"),
        ([], {"colocate": [5, -1, -1, -1]}, "colocate"),
    ],
)
def test_rejects_bad_graphs(edges, kw, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(PartitionError, match=message):
        _build(edges, **kw)


def test_colocation_groups_follow_chains() -> None:
    g = _build([(0, 1)], num=5, colocate=[-1, 3, -1, 0, 1])
    assert g.group_of.tolist() == [0, 0, 2, 0, 0]


def test_longest_paths_match_a_brute_force() -> None:
    rng = np.random.default_rng(0)
    num = 40
    pairs = {(int(a), int(b)) for a, b in rng.integers(0, num, size=(120, 2)) if a < b}
    edges = sorted(pairs)
    g = _build(edges, num=num, time_us=rng.uniform(1, 10, num))
    edge_w = rng.uniform(0, 5, g.num_edges)
    top, bottom = longest_paths(g, node_w=g.time_us, edge_w=edge_w)
    ref_top = np.zeros(num)
    for v in range(num):  # indices are a topological order here
        for e in np.flatnonzero(g.dst == v):
            u = g.src[e]
            ref_top[v] = max(ref_top[v], ref_top[u] + g.time_us[u] + edge_w[e])
    assert np.allclose(top, ref_top)
    assert np.isclose(
        (top + bottom).max(),
        (ref_top + g.time_us).max()
        if not edges
        else max(ref_top[v] + bottom[v] for v in range(num)),
    )
    alive = np.ones(num, dtype=bool)
    alive[::2] = False
    top_a, _ = longest_paths(g, node_w=g.time_us, edge_w=edge_w, alive=alive)
    assert (top_a[~alive] == 0).all()
