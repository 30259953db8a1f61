"""Alignment: align nodes where a tensor's consumers give different gradient annotations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hspmd.annotation import parse_annotation as A
from hspmd.deduce import deduce
from hspmd.graph.capture import capture
from hspmd.markers import align, is_align_node, reshard

TP2 = {"x": "[0,1]{D:2}"}


class Shared(nn.Module):
    """``h`` feeds a column-parallel linear (gradient P) and a pointwise op (gradient D)."""

    def __init__(self, hidden: int = 4, out: int = 6) -> None:
        super().__init__()
        self.a = nn.Linear(hidden, hidden, bias=False)  # replicated
        self.w = nn.Linear(hidden, out, bias=False)  # column-parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = reshard(self.a(x), "h")
        y = reshard(self.w(h), "gather")
        return y.pow(2).mean() + h.tanh().mean()


SHARED_PLAN = {
    "params": {"a.weight": "[0,1]{D:2}", "w.weight": "[0,1]{0:2}"},
    "markers": {"h": "[0,1]{D:2}", "gather": "[0,1]{D:2}"},
}


def run(module_or_graph, *, params, markers, inputs=TP2, shape=(3, 4)):
    return deduce(
        module_or_graph,
        input_annotations={k: A(v) for k, v in inputs.items()},
        param_annotations={k: A(v) for k, v in params.items()},
        marker_annotations={k: A(v) for k, v in markers.items()},
        input_shapes={"x": shape},
        input_dtypes={"x": torch.float32},
    )


def align_nodes(ag) -> list[torch.fx.Node]:
    return [n for n in ag.module.graph.nodes if is_align_node(n)]


def test_one_align_node_before_the_column_parallel_linear() -> None:
    ag = run(Shared(), **SHARED_PLAN)
    (node,) = align_nodes(ag)
    (site,) = ag.alignments
    assert (site.name, site.source, site.consumers) == (node.name, "reshard", ("linear_1",))
    assert (node.args[0].name, node.args[1]) == ("reshard", "reshard->linear_1")
    assert [u.name for u in node.users] == ["linear_1"]
    assert node.next.name == "linear_1"  # right before its consumer
    # forward: the input's annotation; gradient in: the common one; gradient out: the consumer's
    assert str(ag.annotations[node.name]) == "[0,1]{D:2}"
    assert str(ag.grads[node.name]) == "[0,1]{P:2}"
    assert (str(site.grad_from), str(site.grad_to)) == ("[0,1]{P:2}", "[0,1]{D:2}")
    assert str(ag.grads["reshard"]) == "[0,1]{D:2}"
    assert str(ag.param_grads["a.weight"]) == "[0,1]{D:2}"
    assert "align reshard -> linear_1 [3, 4]: [0,1]{D:2}; backward" in str(ag)


def test_a_given_graph_module_is_not_changed() -> None:
    gm = capture(Shared())
    before = [n.name for n in gm.graph.nodes]
    ag = run(gm, **SHARED_PLAN)
    assert [n.name for n in gm.graph.nodes] == before
    assert ag.module is not gm and len(align_nodes(ag)) == 1


class ThreeConsumers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(4, 6, bias=False)
        self.w2 = nn.Linear(4, 6, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y1 = reshard(self.w1(x), "g1")
        y2 = reshard(self.w2(x), "g2")
        return y1.sum() + F.silu(x).sum() + y2.sum()


def test_consumers_giving_one_annotation_share_an_align_node() -> None:
    ag = run(
        ThreeConsumers(),
        params={"w1.weight": "[0,1]{0:2}", "w2.weight": "[0,1]{0:2}"},
        markers={"g1": "[0,1]{D:2}", "g2": "[0,1]{D:2}"},
    )
    (node,) = align_nodes(ag)
    assert sorted(u.name for u in node.users) == ["linear", "linear_1"]
    assert node.next.name == "linear"  # before the group's first consumer
    (site,) = ag.alignments
    assert site.consumers == ("linear", "linear_1") and str(ag.grads["x"]) == "[0,1]{D:2}"


def test_consumers_that_agree_need_no_alignment() -> None:
    ag = run(
        ThreeConsumers(),
        params={"w1.weight": "[0,1]{D:2}", "w2.weight": "[0,1]{D:2}"},
        markers={"g1": "[0,1]{D:2}", "g2": "[0,1]{D:2}"},
    )
    assert align_nodes(ag) == [] and ag.alignments == ()


class ByHand(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Linear(4, 6, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reshard(self.w(align(x, "mine")), "g").sum() + x.sum()


def test_an_align_node_placed_by_hand_is_a_site_and_nothing_more_is_inserted() -> None:
    ag = run(ByHand(), params={"w.weight": "[0,1]{0:2}"}, markers={"g": "[0,1]{D:2}"})
    (node,) = align_nodes(ag)
    assert node.args[1] == "mine" and node.name == "align"
    (site,) = ag.alignments
    assert (str(site.grad_from), str(site.grad_to)) == ("[0,1]{P:2}", "[0,1]{D:2}")
    assert ByHand()(torch.ones(3, 4)).shape == ()  # the identity when run eagerly
