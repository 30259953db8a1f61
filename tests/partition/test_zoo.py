import numpy as np
import pytest
import torch

from hspmd.errors import PartitionError
from hspmd.partition.emulate import emulate
from hspmd.partition.zoo import PRESETS, Preset, capture_preset

TINY = {
    "word_lstm": {"vocab": 50, "embed": 8, "hidden": 8, "num_layers": 2},
    "char_cnn": {
        "chars": 20,
        "char_embed": 4,
        "widths": (1, 2),
        "filters": 2,
        "highways": 1,
        "hidden": 8,
        "num_layers": 1,
        "vocab": 30,
    },
    "wrn": {"depth": 10, "widen": 1},
    "transformer": {"vocab": 40, "dim": 16, "heads": 2, "ff": 32, "num_layers": 1},
}
BATCH = {
    "word_lstm": (((2, 5), 50), ((2, 5), 50)),
    "char_cnn": (((2, 3, 7), 20), ((2, 3), 30)),
    "wrn": (((2, 3, 32, 32), 0), ((2,), 10)),
    "transformer": (((2, 6), 40), ((2, 4), 40), ((2, 4), 40)),
}


@pytest.mark.parametrize("family", sorted(TINY))
def test_tiny_models_train_on_cpu(family: str) -> None:
    preset = Preset(family, TINY[family], BATCH[family])
    torch.manual_seed(0)
    model = preset.build()
    *inputs, target = preset.make_batch()
    logits = model(*inputs)
    assert logits.shape[:-1] == target.shape
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), target.reshape(-1)
    )
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("name", ["word_lstm-tiny", "wrn-small"])
def test_capture_presets(name: str) -> None:
    graph = capture_preset(name)
    assert graph.num_nodes > 300
    assert graph.residual_bytes.sum() > 0 and (graph.colocate >= 0).any()
    em = emulate(graph, np.zeros(graph.num_nodes, dtype=np.int64))
    assert em.makespan_us == pytest.approx(graph.time_us.sum())


def test_presets_cover_the_paper_families() -> None:
    families = {p.family for p in PRESETS.values()}
    assert families == {"word_lstm", "char_cnn", "wrn", "transformer"}
    assert {n.split("-")[1] for n in PRESETS} >= {"small", "large"}
    with pytest.raises(PartitionError, match="not known"):
        capture_preset("lenet-small")


def test_cli_writes_a_graph_the_loader_reads(tmp_path) -> None:
    import argparse

    from hspmd.cli import partition_capture
    from hspmd.partition.io import load_graph

    parser = argparse.ArgumentParser()
    partition_capture.register(parser.add_subparsers())
    out = tmp_path / "tiny.json"
    args = parser.parse_args(["partition-capture", "word_lstm-tiny", "--out", str(out)])
    assert args.func(args) == 0
    graph = load_graph(out)
    assert graph.num_nodes == capture_preset("word_lstm-tiny").num_nodes
    assert (graph.colocate >= 0).any()


def test_capture_leaves_the_callers_random_state_alone() -> None:
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    capture_preset("transformer-small")
    assert torch.equal(torch.rand(3), expected)
