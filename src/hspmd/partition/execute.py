"""Run a placement: each fx node of a module's forward + loss on one rank, send-recv on cuts.

The module (with its loss) is traced by ``torch.fx`` at module level; each node gets a
cost (FLOPs by ``torch.utils.flop_counter`` on a roofline :class:`Device`, output bytes
by shape propagation, parameter and optimizer-state bytes as residual), the resulting
:class:`OpGraph` is partitioned (ParDNN by default, under an optional memory cap), and
the placement becomes an :class:`ExecPlan`: a rank per node and the transfers, in
forward order. Each rank then runs its nodes; a cut edge is a pair of autograd
Functions, ``_Send`` and ``_Recv``, whose backward sends the gradient back.

All communication ops of a rank are chained by a zero-size *token* (every op takes the
previous token and makes the next), so autograd runs their backwards in exactly the
reverse of the forward order. Forward order is the same plan on every rank, so the
backward sends and receives pair up in the same order too: no deadlock.

    plan = make_plan(tiny_net(), batch, loss_fn=F.cross_entropy, num_ranks=2)
    print(plan)                       # node -> rank, and the transfers
    spec = RunSpec(tiny_net, F.cross_entropy, batch, plan)
    results = run_plan(spec)          # one RankResult per rank: loss, grads, updated
    reference(spec)                   # the same step in one process: equal
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp
from torch.utils.flop_counter import FlopCounterMode

from hspmd.errors import PartitionError
from hspmd.partition.capture import DEVICES, Device
from hspmd.partition.graph import OpGraph
from hspmd.runtime.launch import launch
from hspmd.runtime.world import World

ModelFactory = Callable[[], nn.Module]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class TinyNet(nn.Module):
    """Two branches that can run side by side, then a head: the smallest useful split."""

    def __init__(self, width: int = 16, classes: int = 4) -> None:
        super().__init__()
        self.left = nn.Sequential(
            nn.Linear(width, 2 * width), nn.Tanh(), nn.Linear(2 * width, width)
        )
        self.right = nn.Sequential(
            nn.Linear(width, 2 * width), nn.ReLU(), nn.Linear(2 * width, width)
        )
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.left(x) + self.right(x)) + x)


def tiny_net() -> nn.Module:
    """A picklable factory (workers rebuild the model from the seed)."""
    return TinyNet()


class WithLoss(nn.Module):
    """``model(*inputs)`` followed by ``loss_fn(output, target)``: what gets traced."""

    def __init__(self, model: nn.Module, loss_fn: LossFn) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, inputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(self.model(inputs), target)


@dataclass(frozen=True, slots=True)
class Transfer:
    """The output of ``node`` goes from rank ``src`` to rank ``dst`` (shape, dtype)."""

    node: str
    src: int
    dst: int
    shape: tuple[int, ...]
    dtype: str

    def __str__(self) -> str:
        return f"{self.node}: {self.src} -> {self.dst} {list(self.shape)} {self.dtype}"


@dataclass(frozen=True, slots=True)
class ExecPlan:
    """Rank of each traced node (inputs live on every rank: -1) and the transfers."""

    num_ranks: int
    ranks: tuple[tuple[str, int], ...]  # in graph order
    transfers: tuple[Transfer, ...]  # in forward order
    makespan_us: float = 0.0
    peak_bytes: tuple[int, ...] = field(default=())

    def rank_of(self) -> dict[str, int]:
        return dict(self.ranks)

    def __str__(self) -> str:
        lines = [f"ExecPlan on {self.num_ranks} ranks, emulated {self.makespan_us:.1f} us"]
        for rank in range(self.num_ranks):
            nodes = [n for n, r in self.ranks if r == rank]
            lines.append(f"  rank {rank}: {' '.join(nodes)}")
        lines += [f"  send {t}" for t in self.transfers]
        return "\n".join(lines)


def trace(model: nn.Module, loss_fn: LossFn) -> fx.GraphModule:
    """The module and its loss as one fx graph (module-level nodes)."""
    return fx.symbolic_trace(WithLoss(model, loss_fn))


def op_graph(
    traced: fx.GraphModule,
    batch: tuple[torch.Tensor, torch.Tensor],
    *,
    device: Device = DEVICES["v100"],
    state_factor: int = 2,
) -> OpGraph:
    """Costs of the traced nodes: roofline time, output bytes, parameters as residual.

    ``state_factor`` optimizer-state bytes per parameter byte (2 for Adam) count as
    residual too. Nodes that call the same module or read the same attribute are
    colocated (their parameter gradients must add up on one rank).
    """
    ShapeProp(traced).propagate(*batch)
    flops = _node_flops(traced, batch)
    nodes = [n for n in traced.graph.nodes if n.op != "output"]
    index = {n.name: i for i, n in enumerate(nodes)}
    times, outs, residual, colocate = [], [], [], []
    first_user: dict[str, int] = {}
    for i, node in enumerate(nodes):
        out = _out_bytes(node)
        params = _param_bytes(traced, node)
        if node.op == "placeholder":
            times.append(0.0)
        else:
            times.append(device.time_us(flops=flops.get(node.name, 0.0), num_bytes=out + params))
        outs.append(out)
        key = str(node.target) if node.op in ("call_module", "get_attr") else ""
        first = first_user.setdefault(key, i) if key else i
        colocate.append(-1 if first == i else first)
        residual.append(params * (1 + state_factor) if first == i else 0)
    edges = [(index[a.name], index[n.name]) for n in nodes for a in n.all_input_nodes]
    return OpGraph.build(
        "fx",
        [n.name for n in nodes],
        time_us=times,
        out_bytes=outs,
        residual_bytes=residual,
        edges=np.asarray(edges, dtype=np.int64).reshape(-1, 2),
        colocate=colocate,
    )


def _node_flops(traced: fx.GraphModule, batch: tuple[torch.Tensor, ...]) -> dict[str, float]:
    """FLOPs of each node, counted while an interpreter runs it once."""
    counts: dict[str, float] = {}

    class Counting(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            with FlopCounterMode(display=False) as counter:
                out = super().run_node(n)
            counts[n.name] = float(counter.get_total_flops())
            if not counts[n.name] and isinstance(out, torch.Tensor):
                counts[n.name] = float(out.numel())  # elementwise: one per element
            return out

    with torch.no_grad():
        Counting(traced).run(*batch)
    return counts


def _out_bytes(node: fx.Node) -> int:
    meta = node.meta.get("tensor_meta")
    if meta is None or not hasattr(meta, "shape"):
        return 0
    return int(np.prod(meta.shape)) * torch.empty((), dtype=meta.dtype).element_size()


def _param_bytes(traced: fx.GraphModule, node: fx.Node) -> int:
    if node.op == "call_module":
        module = traced.get_submodule(str(node.target))
        return sum(p.numel() * p.element_size() for p in module.parameters())
    if node.op == "get_attr":
        value = _attr(traced, str(node.target))
        return value.numel() * value.element_size() if isinstance(value, nn.Parameter) else 0
    return 0


def _attr(root: nn.Module, target: str) -> Any:
    value: Any = root
    for part in target.split("."):
        value = getattr(value, part)
    return value


def plan_from_placement(
    traced: fx.GraphModule, graph: OpGraph, placement: np.ndarray, *, num_ranks: int
) -> ExecPlan:
    """Turn a placement of ``graph`` (from :func:`op_graph`) into an :class:`ExecPlan`."""
    from hspmd.partition.emulate import emulate

    place = np.asarray(placement, dtype=np.int64)
    if place.max() >= num_ranks:
        raise PartitionError(f"placement uses rank {int(place.max())} but {num_ranks=}")
    nodes = {n.name: n for n in traced.graph.nodes}
    rank = {name: int(place[i]) for i, name in enumerate(graph.names)}
    for name in rank:
        if nodes[name].op == "placeholder":
            rank[name] = -1  # the batch is on every rank
    transfers = []
    for name in graph.names:
        src = rank[name]
        if src < 0:
            continue
        users = sorted({rank[u.name] for u in nodes[name].users if u.op != "output"} - {src})
        meta = nodes[name].meta.get("tensor_meta")
        for dst in users:
            if meta is None or not hasattr(meta, "shape"):
                raise PartitionError(f"node {name!r} crosses ranks but its output is no tensor")
            transfers.append(Transfer(name, src, dst, tuple(meta.shape), str(meta.dtype)))
    em = emulate(graph, place)
    return ExecPlan(
        num_ranks=num_ranks,
        ranks=tuple(rank.items()),
        transfers=tuple(transfers),
        makespan_us=em.makespan_us,
        peak_bytes=tuple(
            int(em.peak_bytes[r]) if r < len(em.peak_bytes) else 0 for r in range(num_ranks)
        ),
    )


def make_plan(
    model: nn.Module,
    batch: tuple[torch.Tensor, torch.Tensor],
    *,
    loss_fn: LossFn,
    num_ranks: int,
    memory_bytes: int | None = None,
    placement: np.ndarray | None = None,
) -> ExecPlan:
    """Trace, cost and partition ``model`` (ParDNN unless a ``placement`` is given)."""
    traced = trace(model, loss_fn)
    graph = op_graph(traced, batch)
    if placement is None:
        from hspmd.partition.pardnn import partition

        placement = partition(graph, num_devices=num_ranks, memory_bytes=memory_bytes).placement
    return plan_from_placement(traced, graph, np.asarray(placement), num_ranks=num_ranks)


# ---- running a plan ----------------------------------------------------------------


class _Send(torch.autograd.Function):
    """Forward: send ``value`` to ``dst``. Backward: receive its gradient from ``dst``."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, token: torch.Tensor, dst: int) -> torch.Tensor:
        ctx.dst, ctx.shape = dst, value.shape
        ctx.dtype = value.dtype if value.is_floating_point() else torch.float32
        dist.send(value.detach().contiguous(), dst)
        return token.detach().clone()

    @staticmethod
    def backward(ctx: Any, grad_token: torch.Tensor) -> Any:
        grad = torch.empty(ctx.shape, dtype=ctx.dtype)
        dist.recv(grad, ctx.dst)
        return grad, grad_token, None


class _Recv(torch.autograd.Function):
    """Forward: receive a value from ``src``. Backward: send its gradient back to ``src``."""

    @staticmethod
    def forward(
        ctx: Any, token: torch.Tensor, src: int, shape: tuple[int, ...], dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.src, ctx.shape = src, shape
        ctx.dtype = dtype if dtype.is_floating_point else torch.float32
        value = torch.empty(shape, dtype=dtype)
        dist.recv(value, src)
        if not dtype.is_floating_point:
            ctx.mark_non_differentiable(value)
        return value, token.detach().clone()

    @staticmethod
    def backward(ctx: Any, grad_value: torch.Tensor, grad_token: torch.Tensor) -> Any:
        grad = grad_value if grad_value is not None else torch.zeros(ctx.shape)
        dist.send(grad.to(ctx.dtype).contiguous(), ctx.src)
        return grad_token, None, None, None


@dataclass(frozen=True, slots=True)
class RunSpec:
    """What every rank needs: how to build the model, the batch, the plan, the update."""

    make_model: ModelFactory
    loss_fn: LossFn
    batch: tuple[torch.Tensor, torch.Tensor]
    plan: ExecPlan
    seed: int = 0
    lr: float = 0.1


@dataclass(frozen=True, slots=True)
class RankResult:
    rank: int
    loss: float | None
    grads: dict[str, np.ndarray]  # parameter name -> gradient, for the rank's parameters
    updated: dict[str, np.ndarray]  # parameter name -> value after one SGD step


def run_rank(rank: int, spec: RunSpec) -> RankResult:
    """One rank's forward, backward and SGD step under ``spec.plan`` (process group up)."""
    torch.manual_seed(spec.seed)
    traced = trace(spec.make_model(), spec.loss_fn)
    loss, owned = forward_backward(rank, spec, traced)
    return _rank_result(rank, traced, owned, loss, lr=spec.lr)


def forward_backward(
    rank: int, spec: RunSpec, traced: fx.GraphModule
) -> tuple[torch.Tensor | None, list[str]]:
    """Run this rank's nodes and transfers, then backward; the loss (on its rank) and
    the targets of the modules and attributes this rank ran."""
    interp = fx.Interpreter(traced)
    rank_of = spec.plan.rank_of()
    sends: dict[str, list[Transfer]] = {}
    for t in spec.plan.transfers:
        sends.setdefault(t.node, []).append(t)
    token = torch.zeros((), requires_grad=True)
    inputs = iter(spec.batch)
    loss: torch.Tensor | None = None
    owned: list[str] = []
    for node in traced.graph.nodes:
        if node.op == "placeholder":
            interp.env[node] = next(inputs)
            continue
        if node.op == "output":
            loss = interp.env.get(node.args[0])
            continue
        if rank_of[node.name] == rank:
            interp.env[node] = interp.run_node(node)
            if node.op in ("call_module", "get_attr"):
                owned.append(str(node.target))
        for t in sends.get(node.name, ()):
            if t.src == rank:
                token = _Send.apply(interp.env[node], token, t.dst)
            elif t.dst == rank:
                dtype = getattr(torch, t.dtype.removeprefix("torch."))
                interp.env[node], token = _Recv.apply(token, t.src, t.shape, dtype)
    roots, grads = [token], [torch.zeros_like(token)]
    if loss is not None:
        roots.append(loss)
        grads.append(torch.ones_like(loss))
    torch.autograd.backward(roots, grads)
    return loss, owned


def _rank_result(
    rank: int, traced: fx.GraphModule, owned: list[str], loss: torch.Tensor | None, *, lr: float
) -> RankResult:
    params: dict[str, nn.Parameter] = {}
    for target in owned:
        value = _attr(traced, target)
        if isinstance(value, nn.Module):
            params.update({f"{target}.{k}": p for k, p in value.named_parameters()})
        elif isinstance(value, nn.Parameter):
            params[target] = value
    grads = {k: p.grad.numpy().copy() for k, p in params.items() if p.grad is not None}
    torch.optim.SGD(list(params.values()), lr=lr).step()
    updated = {k: p.detach().numpy().copy() for k, p in params.items()}
    return RankResult(rank, None if loss is None else loss.item(), grads, updated)


def reference(spec: RunSpec) -> RankResult:
    """The same step in one process, no plan: the oracle."""
    torch.manual_seed(spec.seed)
    model = WithLoss(spec.make_model(), spec.loss_fn)
    loss = model(*spec.batch)
    loss.backward()
    params = dict(model.named_parameters())
    grads = {k: p.grad.numpy().copy() for k, p in params.items() if p.grad is not None}
    torch.optim.SGD(list(params.values()), lr=spec.lr).step()
    updated = {k: p.detach().numpy().copy() for k, p in params.items()}
    return RankResult(-1, loss.item(), grads, updated)


def run_plan(spec: RunSpec, *, timeout_s: float = 120.0) -> list[RankResult]:
    """Run ``spec`` on ``spec.plan.num_ranks`` local gloo processes; results by rank."""
    return launch(_world_entry, spec.plan.num_ranks, args=(spec,), timeout_s=timeout_s, threads=1)


def _world_entry(world: World, spec: RunSpec) -> RankResult:
    return run_rank(world.rank, spec)
