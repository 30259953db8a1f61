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


def test_the_llama_preset_is_captured_like_every_model() -> None:
    """The preset goes through torch.export (``capture_step``): ATen ops, its own markers,
    a ``segments`` input that defaults to None, and its fused ops as one node each, the
    Python functions themselves (so executables run their backwards, and no dtype cast
    inside the norm is frozen at capture)."""
    from hspmd.attention import causal_attention
    from hspmd.fused_ops import rms_norm, swiglu
    from hspmd.models.build import model_graph
    from hspmd.models.config import get_config

    gm = model_graph(get_config("llama-tiny", num_layers=2))
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert [n.name for n in inputs] == ["tokens", "targets", "segments"]
    assert inputs[2].args == (None,)  # the default: one document per row
    calls = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert calls.count(rms_norm) == 5 and calls.count(swiglu) == calls.count(causal_attention) == 2
    assert torch.ops.aten.linear.default in calls and torch.ops.aten.to.dtype not in calls[:-3]
    attention = next(n for n in gm.graph.nodes if n.target is causal_attention)
    assert attention.args[3] is inputs[2] and attention.kwargs == {
        "scale": None,
        "enable_gqa": True,
    }
