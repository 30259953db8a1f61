"""Align nodes on real processes: TP2 loss and gradients equal the single-device module's.

Each rank specializes the deduced graph of ``tests.deduce.test_align.Shared`` by hand (the
module has no views or embeddings): parameters become the rank's slices, markers and align
nodes ``ReshardModule`` calls with their resolved plans. As a control, the same graph with
its align node left out (an identity) gets the replicated weight's gradient wrong: the
partial gradient from the column-parallel linear is added to the duplicate one from tanh.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
import torch.fx

from hspmd.comm.resolve import resolve
from hspmd.deduce import AnnotatedGraph
from hspmd.markers import is_align_node, is_reshard_node
from hspmd.runtime import World, launch
from hspmd.runtime.autograd import reshard
from hspmd.specialize.align import align_plans
from hspmd.specialize.executable import ReshardModule
from hspmd.specialize.localize import local_slice

from ..deduce.test_align import SHARED_PLAN, Shared, run

SHAPE = (3, 4)


def _deduced() -> tuple[Shared, AnnotatedGraph]:
    torch.manual_seed(0)
    model = Shared()
    return model, run(model, **SHARED_PLAN, shape=SHAPE)


def _module(node: torch.fx.Node, ag: AnnotatedGraph, world: World) -> ReshardModule | None:
    if is_reshard_node(node):
        site = ag.reshard(str(node.args[1]))
        assert site.grad_out is not None and site.grad_in is not None
        return ReshardModule(
            site.name,
            resolve(site.src, site.dst, site.shape),
            resolve(site.grad_out, site.grad_in, site.shape),
            runner=functools.partial(reshard, world=world),
        )
    align_site = ag.alignment(node.name)
    assert align_site is not None
    return ReshardModule(
        str(node.args[1]), *align_plans(align_site), runner=functools.partial(reshard, world=world)
    )


def specialize(ag: AnnotatedGraph, world: World, *, skip_align: bool) -> torch.fx.GraphModule:
    """The rank's graph: local parameter slices, resharding modules for markers."""
    graph, env, root = torch.fx.Graph(), {}, {}
    for node in ag.module.graph.nodes:
        if node.op == "get_attr":
            piece = ag.annotations[node.name].piece(world.rank, ag.shape(node.name))
            full = ag.module.get_parameter(str(node.target)).detach()
            root[node.name] = torch.nn.Parameter(local_slice(full, piece))
            env[node] = graph.get_attr(node.name)
        elif is_reshard_node(node) or (is_align_node(node) and not skip_align):
            root[node.name] = _module(node, ag, world)
            env[node] = graph.call_module(node.name, (env[node.args[0]],))
        elif is_align_node(node):
            env[node] = env[node.args[0]]
        else:
            env[node] = graph.node_copy(node, env.__getitem__)
    return torch.fx.GraphModule(root, graph)


def train_step(world: World, skip_align: bool) -> tuple[float, dict[str, np.ndarray]]:
    torch.set_num_threads(1)
    _, ag = _deduced()
    gm = specialize(ag, world, skip_align=skip_align)
    world.prepare(m.backward_plan for m in gm.modules() if isinstance(m, ReshardModule))
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1)).requires_grad_()
    loss = gm(x)
    loss.backward()
    grads = {"x": x.grad.numpy()}
    grads |= {ag.params[n]: p.grad.numpy() for n, p in gm.named_parameters()}
    return loss.item(), grads


@pytest.mark.multiproc
def test_tp2_with_an_align_node_equals_one_device() -> None:
    model, ag = _deduced()
    assert len(ag.alignments) == 1
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1)).requires_grad_()
    loss = model(x)
    loss.backward()
    want = {"x": x.grad, "a.weight": model.a.weight.grad, "w.weight": model.w.weight.grad}
    runs = {skip: launch(train_step, 2, args=(skip,), timeout_s=120) for skip in (False, True)}
    for rank, (got_loss, grads) in enumerate(runs[False]):
        assert got_loss == pytest.approx(loss.item(), rel=1e-6)
        rows = slice(3 * rank, 3 * rank + 3)  # w.weight (6, 4) is split on dim 0
        np.testing.assert_allclose(grads["w.weight"], want["w.weight"][rows], rtol=1e-5)
        np.testing.assert_allclose(grads["a.weight"], want["a.weight"], rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(grads["x"], want["x"], rtol=1e-5, atol=1e-7)
    for _, grads in runs[True]:  # the control: without the align node, a.weight is wrong
        assert not np.allclose(grads["a.weight"], want["a.weight"], rtol=1e-3)
