"""In-memory switching between strategies: the plan (pure data) and its run on a rank.

A switch from strategy A to strategy B moves every rank's training state to where B wants
it, with ONE fused BSR over all tensors (paper section 7; one message per pair of ranks):

    tensor                     from (A)                  to (B)
    master/<name>              A's state annotation      B's state annotation
    exp_avg/<name>             A's state annotation      B's state annotation
    exp_avg_sq/<name>          A's state annotation      B's state annotation
    param/<name>  (ZeRO-1 B)   A's state annotation      B's parameter annotation

The state annotation is the parameter's, or its ZeRO-1 shard (``hspmd.plan.params``).
Under fp32 the compute weights of B are its masters; under bf16 they are the masters cast;
under ZeRO-1 B needs the whole stage piece too, which the fp32 masters of A hold exactly,
so it rides in the same BSR as a fourth tensor rather than a later all-gather. Adam's step
count is the same on every rank and does not move. Ranks that hold nothing in B send what
they hold and end idle; ranks new to B receive everything.

>>> from hspmd.models.llama import get_config
>>> from hspmd.plan.strategy import parse_strategy
>>> plan = plan_switch(get_config("llama-tiny", num_layers=2),
...                    parse_strategy("2x1: R0:L0-0 R1:L1-1"), parse_strategy("2x1: R0-1:L0-1"))
>>> len(plan.tensors), sorted(plan.messages())
(63, [(0, 1), (1, 0)])
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from hspmd.comm.bsr import BsrTable, messages, schedule
from hspmd.comm.plan import Transfer
from hspmd.comm.relay import RelayPlan, plan_relay
from hspmd.comm.topology import Topology
from hspmd.models.spec import ModelSpec
from hspmd.plan.params import parameter_annotations, state_annotations
from hspmd.plan.strategy import Strategy
from hspmd.runtime.fused import FusedTensor, run_fused_bsr
from hspmd.runtime.relay import run_relay
from hspmd.runtime.world import World
from hspmd.switch.cost import SwitchError

__all__ = [
    "STATE_KINDS",
    "SWITCH_ALGOS",
    "SwitchPlan",
    "TrainState",
    "plan_switch",
    "run_switch",
    "switch_topology",
]

STATE_KINDS = ("master", "exp_avg", "exp_avg_sq")
SWITCH_ALGOS = ("fused", "relay")  # what a live switch can run

# name -> (fp32 master, exp_avg, exp_avg_sq): this rank's pieces under its state annotation
TrainState = dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass(frozen=True, slots=True)
class SwitchPlan:
    """Every tensor a switch moves (``kind/name``), and the fused BSR's transfers."""

    names: tuple[str, ...]
    tensors: tuple[FusedTensor, ...]
    transfers: tuple[Transfer, ...]
    relay: RelayPlan | None = None  # algo "relay": the rounds that run instead

    def messages(self) -> dict[tuple[int, int], int]:
        """Messages per (sender, receiver) pair: one each (local copies are none); under
        relay, summed over the rounds."""
        if self.relay is not None:
            return dict(sum((Counter(per) for per in self.relay.messages()), Counter()))
        return {pair: 1 for pair in messages(self.transfers)}

    @property
    def num_messages(self) -> int:
        """Sends the switch issues, summed over ranks (and rounds)."""
        return sum(self.messages().values())

    def sent_bytes(self) -> Counter[int]:
        """Bytes each rank sends (fp32)."""
        out: Counter[int] = Counter()
        moves = (
            self.transfers
            if self.relay is None
            else [t for stage in self.relay.stages() for t in stage]
        )
        for t in moves:
            if t.src != t.dst:
                n = 4
                for lo, hi in t.region:
                    n *= hi - lo
                out[t.src] += n
        return out

    def __str__(self) -> str:
        pairs = self.messages()
        total = sum(self.sent_bytes().values())
        algo = "fused" if self.relay is None else f"relay ({len(self.relay.rounds)} rounds)"
        return (
            f"switch ({algo}): {len(self.tensors)} tensors, {sum(pairs.values())} messages, "
            f"{total} bytes"
        )


def switch_topology(
    *, cluster: str | None, ranks_per_node: int | None, num_ranks: int
) -> Topology | None:
    """The nodes a live switch plans on: a cluster file or shipped name, or fake nodes of
    ``ranks_per_node`` local processes each; None (flat) when neither is given.

    >>> [n.ranks for n in switch_topology(cluster=None, ranks_per_node=2, num_ranks=4).nodes]
    [(0, 1), (2, 3)]
    """
    if cluster is not None:
        from hspmd.cost.cluster import load_cluster

        return load_cluster(cluster).topology()
    if ranks_per_node is not None:
        return Topology.uniform_nodes(num_ranks, ranks_per_node=ranks_per_node)
    return None


def plan_switch(
    config: ModelSpec,
    source: Strategy,
    target: Strategy,
    *,
    zero1: bool = False,
    shares: tuple[float, ...] = (),
    compute: bool = True,
    topology: Topology | None = None,
    algo: str = "fused",
    num_ranks: int | None = None,
) -> SwitchPlan:
    """The fused BSR moving the training state from ``source`` to ``target`` (metadata only).

    ``shares``: the pipelines' weights of uneven ZeRO shards (the same count in both);
    ``compute=False``: no ``param/`` pieces (ZeRO-3 gathers its parameters at their use).
    ``algo="relay"`` adds the relay plan of that scheme on ``topology``
    (``hspmd.comm.relay``); only ranks below ``num_ranks`` (the processes running) relay."""
    if algo not in SWITCH_ALGOS:
        raise SwitchError(
            f"unknown switch algorithm {algo!r}: use one of {', '.join(SWITCH_ALGOS)}"
        )
    src_states = state_annotations(source, config, zero1=zero1, shares=shares)
    dst_states = state_annotations(target, config, zero1=zero1, shares=shares)
    dst_params = parameter_annotations(target, config)
    names: list[str] = []
    tensors: list[FusedTensor] = []
    for name, spec in src_states.items():
        dst = dst_states[name].annotation
        for kind in STATE_KINDS:
            names.append(f"{kind}/{name}")
            tensors.append(FusedTensor(spec.shape, spec.annotation, dst))
        if compute and dst_params[name].annotation != dst:
            names.append(f"param/{name}")
            tensors.append(FusedTensor(spec.shape, spec.annotation, dst_params[name].annotation))
    topology = topology or Topology.flat()
    tables, transfers = fused_scheme(tensors, topology)
    relay = None
    if algo == "relay":
        absent = [r for n in topology.nodes for r in n.ranks if r >= (num_ranks or 1 << 30)]
        relay = plan_relay(tables, transfers, topology=topology, exclude=absent)
    return SwitchPlan(tuple(names), tuple(tensors), transfers, relay)


def fused_scheme(
    tensors: list[FusedTensor], topology: Topology
) -> tuple[list[BsrTable], tuple[Transfer, ...]]:
    """The BSR tables of fp32 ``tensors`` and the one fused scheme serving them all."""
    tables = [
        BsrTable.between(t.src, t.dst, t.shape, tensor=i, itemsize=4) for i, t in enumerate(tensors)
    ]
    return tables, schedule(tables, topology=topology, fused=True)


def run_switch(
    plan: SwitchPlan, state: TrainState, world: World
) -> tuple[TrainState, dict[str, torch.Tensor]]:
    """This rank's state under the target, and the compute weights that came with it
    (``param/<name>``: only where the target's state annotation differs from the
    parameter's). ``state`` is empty on a rank that holds nothing under the source."""
    local = {}
    for index, key in enumerate(plan.names):
        kind, name = key.split("/", 1)
        if name in state:
            which = 0 if kind == "param" else STATE_KINDS.index(kind)
            local[index] = state[name][which].detach()
    if plan.relay is not None:
        out = run_relay(plan.relay, plan.tensors, local, world)
    else:
        out = run_fused_bsr(plan.transfers, plan.tensors, local, world)
    parts: dict[str, dict[str, torch.Tensor]] = {k: {} for k in (*STATE_KINDS, "param")}
    for index, tensor in out.items():
        kind, name = plan.names[index].split("/", 1)
        parts[kind][name] = tensor
    moved = {
        name: (master, parts["exp_avg"][name], parts["exp_avg_sq"][name])
        for name, master in parts["master"].items()
    }
    return moved, parts["param"]
