"""Capture below Python (hspmd.graph.export): ordinary model code becomes an ATen graph in
hspmd's form, with Python control flow evaluated at capture."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from hspmd.graph.export import ExportError, capture_step
from hspmd.markers import is_reshard_node
from hspmd.models.calling import step_call
from hspmd.models.module import build_module, on_meta

NANOGPT = str(Path(__file__).parents[1] / "models" / "data" / "nanogpt_style.py") + ":make"


def _nanogpt() -> tuple[nn.Module, torch.fx.GraphModule]:
    with on_meta():
        module = build_module(NANOGPT, {})
    return module, capture_step(
        module, call=step_call("positional"), blocks=list(module.transformer.h)
    )


def test_nanogpt_as_written_is_captured_in_hspmds_form() -> None:
    module, gm = _nanogpt()
    nodes = list(gm.graph.nodes)
    assert [n.name for n in nodes if n.op == "placeholder"] == ["tokens", "targets"]
    attrs = {str(n.target) for n in nodes if n.op == "get_attr"}
    assert "transformer.wte.weight" in attrs and "lm_head.weight" not in attrs  # tied: one name
    assert attrs <= {name for name, _ in module.named_parameters()}
    markers = [n.args[1] for n in nodes if is_reshard_node(n)]
    assert markers == ["layers.0.input", "layers.1.input", "layers.2.input"]
    targets = {n.target for n in nodes if n.op == "call_function"}
    assert torch.ops.aten.split.Tensor not in targets  # q, k, v = ...split(): three slices
    slices = [n for n in nodes if n.target is torch.ops.aten.slice.Tensor]
    assert [n.args[1:] for n in slices[:3]] == [(2, 0, 32), (2, 32, 64), (2, 64, 96)]
    sizes = [n for n in nodes if n.target is torch.ops.aten.sym_size.int]
    assert {n.args[1] for n in sizes} == {0, 1}  # B and T stay symbolic


def test_the_captured_graph_computes_the_modules_loss() -> None:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        module = build_module(NANOGPT, {})
    _, gm = _nanogpt()
    for name, value in [*module.named_parameters(), *module.named_buffers()]:
        owner = gm.get_submodule(name.rpartition(".")[0]) if "." in name else gm
        if hasattr(owner, name.rpartition(".")[2]):
            setattr(owner, name.rpartition(".")[2], nn.Parameter(value.detach().clone()))
    tokens = torch.randint(0, 256, (2, 11))
    targets = torch.randint(0, 256, (2, 11))
    assert torch.allclose(gm(tokens, targets), module(tokens, targets)[1], atol=1e-6)


def test_a_data_dependent_forward_names_the_users_line() -> None:
    class Bad(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(8, 4)

        def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            n = int(tokens.max().item())  # a size read from the data
            return self.embed(tokens)[:, :n].mean()

    with pytest.raises(ExportError, match=r"test_export\.py:\d+"):
        capture_step(Bad(), call=step_call("positional"))
