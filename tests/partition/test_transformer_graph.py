import numpy as np
import pytest

from hspmd.errors import PartitionError
from hspmd.partition.transformer_graph import TransformerShape, num_layers_for, transformer_graph


@pytest.mark.parametrize(("layers", "heads"), [(1, 16), (3, 1), (5, 4)])
def test_size_per_layer(layers: int, heads: int) -> None:
    shape = TransformerShape(dim=256, heads=heads)
    graph = transformer_graph(layers, shape=shape)
    assert graph.num_nodes == layers * shape.ops_per_layer + 22
    assert len(graph.topo_order) == graph.num_nodes  # a DAG
    # every weight: value + 2 moments (residual, same size), 3 updates colocated with it
    weights = [i for i, n in enumerate(graph.names) if n.endswith(".weight") and ":" not in n]
    assert len(weights) == 8 * layers + 2
    for w in weights:
        group = np.flatnonzero(graph.group_of == graph.group_of[w])
        assert len(group) == 6
        assert (graph.residual_bytes[group] > 0).sum() == 3


def test_updates_wait_for_the_gradient_that_reads_the_weight() -> None:
    graph = transformer_graph(2, shape=TransformerShape(dim=64, heads=2, seq=16, vocab=100))
    index = graph.index
    edges = set(zip(graph.src.tolist(), graph.dst.tolist(), strict=True))
    for layer in range(2):
        for name in ("q", "ff1"):
            w = index[f"layer{layer}.{name}.weight"]
            update = index[f"update:layer{layer}.{name}.weight"]
            reader = index[f"grad:layer{layer}.{name}"]
            assert (w, reader) in edges and (reader, update) in edges
            assert (
                graph.topo_rank[index[f"grad:layer{layer}.{name}.weight"]] < graph.topo_rank[update]
            )


def test_seeded_and_sized() -> None:
    a, b, c = (transformer_graph(4, seed=s) for s in (1, 1, 2))
    assert np.array_equal(a.time_us, b.time_us) and not np.array_equal(a.time_us, c.time_us)
    assert np.array_equal(a.src, c.src)  # the structure does not depend on the seed
    n = num_layers_for(100_000)
    assert abs(transformer_graph(1).num_nodes + (n - 1) * 174 - 100_000) < 174


def test_bad_input() -> None:
    with pytest.raises(PartitionError, match="num_layers=0"):
        transformer_graph(0)
    with pytest.raises(PartitionError, match="divisible"):
        TransformerShape(dim=100, heads=3)
