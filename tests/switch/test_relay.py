"""Relayed switches on gloo processes: 4 ranks as 2 fake nodes of 2.

The executor alone: every rank gets exactly its pieces and issues, round by round, one send
per peer the plan names. Training across relayed switches: losses and parameters equal the
reference as tightly as without switching, and bitwise equal the fused switch's run.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hspmd.comm.topology import Topology
from hspmd.plan.strategy import parse_strategy
from hspmd.runtime import World, count_comm, launch
from hspmd.runtime.relay import run_relay
from hspmd.switch.live import SwitchPlan, plan_switch
from hspmd.train.api import revise, train_config
from hspmd.train.config import AdamConfig
from hspmd.train.reference import run_reference
from hspmd.train.trainer import train_many

ONE = "4x1: R0:L0-3"
TP2_NODE1 = "2x2: R2-3:L0-3"
PP_TP = "2x2: R0-1:L0-1 R2-3:L2-3"
MODEL = (("num_layers", 4), ("num_kv_heads", 4))
RELAY = train_config(
    model_kwargs=MODEL, seq_len=16, global_batch=4, adam=AdamConfig(lr=1e-3), steps=6,
    strategy=ONE, switches=((3, TP2_NODE1), (5, PP_TP)), switch_algo="relay", ranks_per_node=2,
)  # fmt: skip
FUSED = revise(RELAY, switch_algo="fused", ranks_per_node=None)


def _plan() -> SwitchPlan:
    topo = Topology.uniform_nodes(4, ranks_per_node=2)
    model = RELAY.model_config()
    return plan_switch(
        model, parse_strategy(ONE), parse_strategy(TP2_NODE1), topology=topo, algo="relay"
    )


def _full(plan: SwitchPlan) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(t.shape, generator=gen) for t in plan.tensors]


def relayed(world: World) -> tuple[list[list[int]], bool]:
    plan = _plan()
    assert plan.relay is not None
    full = _full(plan)
    local = {}
    for i, t in enumerate(plan.tensors):
        if world.rank in t.src.ranks:
            region = t.src.piece(world.rank, t.shape).region
            local[i] = full[i][tuple(slice(a, b) for a, b in region)].clone()
    with count_comm(world) as log:
        out = run_relay(plan.relay, plan.tensors, local, world)
    want = {}
    for i, t in enumerate(plan.tensors):
        if world.rank in t.dst.ranks:
            region = t.dst.piece(world.rank, t.shape).region
            want[i] = full[i][tuple(slice(a, b) for a, b in region)]
    exact = set(out) == set(want) and all(torch.equal(out[i], w) for i, w in want.items())
    batches: list[list[int]] = [[]]  # the peers of this rank's sends, batch by batch
    for event in log.events:
        if event.op == "send":
            batches[-1].append(event.group[1])
        elif event.op == "batch":
            batches.append([])
    return batches[:-1], exact


@pytest.mark.multiproc
def test_relay_executor_rounds_and_pieces() -> None:
    plan = _plan()
    assert plan.relay is not None
    per_rank = launch(relayed, 4, timeout_s=120, threads=1)
    for rank, (batches, exact) in enumerate(per_rank):
        assert exact, f"rank {rank} got wrong pieces"
        # one batch per round this rank takes part in, one send per peer of that round
        rounds = [r for r in plan.relay.rounds if any(rank in (t.src, t.dst) for t in r)]
        want = [sorted({t.dst for t in r if t.src == rank and t.dst != rank}) for r in rounds]
        assert batches == want, f"rank {rank}"
    assert plan.relay.messages()[1] == dict.fromkeys([(0, 2), (1, 3)], 1)  # NIC k to NIC k


@pytest.fixture(scope="module")
def runs() -> dict[str, Any]:
    relay, fused = train_many([RELAY, FUSED], threads=1, timeout_s=300)
    return {"relay": relay, "fused": fused}


@pytest.mark.multiproc
def test_relayed_switches_match_reference(runs: dict[str, Any]) -> None:
    reference = run_reference(revise(RELAY, strategy=None, switches=()))
    result = runs["relay"]
    for got, want in zip(result.losses, reference.losses, strict=True):
        assert got == pytest.approx(want, rel=1e-5)
    for name, want in reference.params.items():
        assert float((result.params[name] - want).norm() / want.norm()) < 1e-4, name
    # a switch moves numbers, never changes them: bitwise the fused switch's run
    assert result.losses == runs["fused"].losses
    for name, value in result.params.items():
        assert torch.equal(value, runs["fused"].params[name]), name


@pytest.mark.multiproc
def test_relayed_switch_messages_match_the_plan(runs: dict[str, Any]) -> None:
    topo = Topology.uniform_nodes(4, ranks_per_node=2)
    model = RELAY.model_config()
    switched = [r for r in runs["relay"].records if r.switch_seconds is not None]
    befores = (ONE, TP2_NODE1)
    for record, before in zip(switched, befores, strict=True):
        plan = plan_switch(
            model, parse_strategy(before), parse_strategy(record.strategy), topology=topo,
            algo="relay",
        )  # fmt: skip
        assert plan.relay is not None and any(plan.relay.rounds[0])
        assert record.switch_messages == plan.num_messages


def test_relay_needs_nodes_and_the_states_mode() -> None:
    from hspmd.train.config import TrainError

    with pytest.raises(TrainError, match="--ranks-per-node"):
        revise(RELAY, ranks_per_node=None)
    with pytest.raises(TrainError, match="--switch-mode states"):
        revise(RELAY, switch_mode="weights")
    with pytest.raises(TrainError, match="choose one of fused, relay"):
        revise(RELAY, switch_algo="ring")
