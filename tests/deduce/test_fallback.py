"""The always-correct fallback: an op no rule covers runs whole on gathered inputs."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hspmd.annotation import parse_annotation as A
from hspmd.comm.resolve import resolve
from hspmd.deduce import NoRuleError, deduce


class Cumulative(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(8, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cumsum(F.linear(x, self.w), dim=-1).sum()


def _run(*, strict: bool = False):
    return deduce(
        Cumulative(),
        input_annotations={"x": A("[0,1]{D:2}")},
        param_annotations={"w": A("[0,1]{0:2}")},  # column-parallel: output split on dim -1
        marker_annotations={},
        input_shapes={"x": (3, 4)},
        input_dtypes={"x": torch.float32},
        strict=strict,
    )


def test_an_op_without_a_rule_gathers_its_split_input() -> None:
    ag = _run()
    (fallback,) = ag.fallbacks
    assert fallback.op == "torch.cumsum" and fallback.gathered == ("linear",)
    site = ag.reshard("cumsum.gather.linear")
    assert (str(site.src), str(site.dst)) == ("[0,1]{1:2}", "[0,1]{D:2}")
    assert resolve(site.src, site.dst, site.shape).kinds == ("all-gather",)
    assert str(ag.annotations["cumsum"]) == "[0,1]{D:2}"
    assert ag.fallback_bytes(fallback) == 3 * 8 * 4  # the gathered (3, 8) fp32 input


def test_strict_deduction_refuses_instead() -> None:
    with pytest.raises(NoRuleError, match="cumsum"):
        _run(strict=True)


class Router(nn.Module):
    """A mixture-of-experts router: its weight's gradient flows through ``topk``'s values."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.ones(8, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        values, indices = torch.topk(F.linear(x, self.gate), 2)
        return (values * indices).sum()


def test_an_op_with_several_outputs_runs_whole_and_passes_gradients() -> None:
    ag = deduce(
        Router(),
        input_annotations={"x": A("[0,1]{D:2}")},
        param_annotations={"gate": A("[0,1]{0:2}")},  # the scores split over the experts
        marker_annotations={},
        input_shapes={"x": (3, 4)},
        input_dtypes={"x": torch.float32},
    )
    (fallback,) = ag.fallbacks  # topk of a slice of the experts would pick other ones
    assert fallback.op == "torch.topk" and fallback.gathered == ("linear",)
    values, indices = (n.name for n in ag.module.graph.nodes if n.target is operator.getitem)
    assert str(ag.annotations[values]) == str(ag.annotations[indices]) == "[0,1]{D:2}"
    assert ag.inputs[values] == ("reshard",)  # the gather marker: the gradient reaches gate
    gate = next(n for n, name in ag.params.items() if name == "gate")
    assert str(ag.grads[gate]) == "[0,1]{0:2}"  # was none: topk's outputs read as constants
