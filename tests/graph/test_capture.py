import time

import torch
import torch.nn.functional as F
from torch import nn

from hspmd.graph import TensorSpec, capture, propagate_shapes
from hspmd.markers import is_reshard_node, reshard


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.proj = nn.Linear(8, 8, bias=False)
        self.register_buffer("table", torch.ones(32, 8))

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        T = tokens.shape[1]
        x = reshard(self.embed(tokens), "embed")
        x = self.proj(x) * torch.narrow(self.table, 0, 0, T)
        return F.cross_entropy(x.flatten(0, 1), targets.flatten())


def test_capture_inlines_modules_and_keeps_markers() -> None:
    gm = capture(Tiny())
    nodes = {n.name: n for n in gm.graph.nodes}
    assert {str(n.target) for n in nodes.values() if n.op == "get_attr"} == {
        "embed.weight",
        "proj.weight",
        "table",
    }
    assert not [n for n in nodes.values() if n.op == "call_module"]
    markers = [n for n in nodes.values() if is_reshard_node(n)]
    assert [m.args[1] for m in markers] == ["embed"]


def test_shapes_on_meta_with_sizes() -> None:
    gm = capture(Tiny())
    spec = TensorSpec((4, 6), torch.int64)
    info = propagate_shapes(gm, {"tokens": spec, "targets": spec})
    assert info.specs["embedding"] == TensorSpec((4, 6, 8), torch.float32)
    assert info.specs["narrow"].shape == (6, 8)
    assert info.values["getitem"] == 6
    assert info.specs["cross_entropy"].shape == ()


def test_llama_32b_shapes_without_allocation() -> None:
    from hspmd.models.llama import Llama, get_config

    config = get_config("llama-32b", num_layers=4)
    with torch.device("meta"):
        model = Llama(config)
    gm = capture(model)
    spec = TensorSpec((2, 4096), torch.int64)
    start = time.perf_counter()
    info = propagate_shapes(gm, {"tokens": spec, "targets": spec})
    elapsed = time.perf_counter() - start
    print(f"llama-32b (4 layers) shapes: {elapsed:.3f} s")
    logits = [n for n in gm.graph.nodes if is_reshard_node(n) and n.args[1] == "logits"][0]
    assert info.specs[logits.name].shape == (2, 4096, 50304)


def test_llama_capture_equals_the_one_traced_under_the_meta_device() -> None:
    """Issue 12: the preset's graph is traced outside the meta device context and its code
    generated lazily; the graph is the one traced inside the context, as before."""
    from hspmd.graph.capture import InliningTracer
    from hspmd.models.build import model_graph
    from hspmd.models.config import get_config
    from hspmd.models.llama import Llama

    config = get_config("llama-tiny", num_layers=2)
    with torch.device("meta"):
        module = Llama(config)
        before = torch.fx.GraphModule(module, InliningTracer().trace(module))
    now = model_graph(config)
    assert [(n.op, n.name, str(n.target)) for n in now.graph.nodes] == [
        (n.op, n.name, str(n.target)) for n in before.graph.nodes
    ]
    assert now.code == before.code  # generated when read
