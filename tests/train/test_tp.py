"""Tensor-parallel training with executable graphs equals the single-device reference.

The step loop below is the trainer's (hspmd.train.loop._run_step) with the pipeline
boundaries run by their resolved plans (hspmd.specialize.boundary) instead of a
``dist.recv`` from the previous stage's first rank: the change the trainer needs for
TP > 1 stages. Checks: first-step loss within 1e-5 relative, every parameter after 3
Adam steps within 1e-4 relative. All strategies share one launch of 4 processes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from hspmd.plan.strategy import StrategyOptions, parse_strategy
from hspmd.runtime.counting import count_comm
from hspmd.runtime.launch import launch
from hspmd.runtime.world import World
from hspmd.specialize.boundary import BoundaryPlans, boundary_plans, recv, send
from hspmd.specialize.executable import Executable, build_executable, executable_groups
from hspmd.specialize.schedule import make_schedule
from hspmd.train.batches import step_batches
from hspmd.train.config import AdamConfig, TrainConfig
from hspmd.train.layout import Layout, Role
from hspmd.train.optim import Adam
from hspmd.train.reference import run_reference
from hspmd.train.sync import grad_sync_plan, run_grad_sync

pytestmark = pytest.mark.multiproc

TWO = (("num_layers", 2),)  # llama-tiny with 2 layers: the same code paths, half the time
KV4 = (*TWO, ("num_kv_heads", 4))  # TP 4 needs the KV heads to divide
STRATEGIES = {
    "TP 2": ("4x1: R0-1:L0-1", TWO),
    "TP 4": ("2x2: R0-3:L0-1", KV4),
    "PP 2 x TP 2": ("2x2: R0-1:L0 R2-3:L1", TWO),
    "TP 2 then TP 1 (BSR boundary)": ("4x1: R0-1:L0 R2:L1", TWO),
    "pipelines with TP 2 and TP 1": ("2x1: R0-1:L0-1; 2x1: R2:L0-1", TWO),
}


def config(strategy: str, overrides: tuple[tuple[str, Any], ...]) -> TrainConfig:
    return TrainConfig(
        strategy=strategy, global_batch=4, seq_len=16, steps=3, adam=AdamConfig(lr=1e-3),
        model_overrides=overrides, data_max_bytes=1 << 16,
    )  # fmt: skip


def run_step(
    exe: Executable, role: Role, plans: BoundaryPlans, cfg: TrainConfig, world: World,
    batch: tuple[torch.Tensor, torch.Tensor],
) -> float:  # fmt: skip
    tokens, targets = batch
    schedule = make_schedule(cfg.schedule, role.num_stages, role.stage, role.micro_batches)
    size, loss, sends = role.micro_batch_size, 0.0, []
    inputs: dict[int, torch.Tensor] = {}
    outputs: dict[int, torch.Tensor] = {}
    for action in schedule:
        m = action.micro_batch
        rows = slice(role.row_offset + m * size, role.row_offset + (m + 1) * size)
        if action.kind == "F":
            if role.is_first:
                x = tokens[rows]
            else:
                assert plans.incoming is not None
                x = recv(plans.incoming.forward, world).requires_grad_(True)
            out = exe.forward(x, targets[rows])
            if role.is_last:
                out = out * (size / cfg.global_batch)
                loss += float(out.detach())
            else:
                assert plans.outgoing is not None
                sends += send(plans.outgoing.forward, out.detach(), world)
            inputs[m], outputs[m] = x, out
        elif action.kind == "B":
            x, out = inputs.pop(m), outputs.pop(m)
            if role.is_last:
                out.backward()
            else:
                assert plans.outgoing is not None
                out.backward(recv(plans.outgoing.backward, world))
            if not role.is_first:
                assert plans.incoming is not None and x.grad is not None
                sends += send(plans.incoming.backward, x.grad, world)
    for pending in sends:
        pending.wait()
    return loss


def train_rank(world: World, cfg: TrainConfig) -> dict[str, Any]:
    assert cfg.strategy is not None
    model, strategy = cfg.model_config(), parse_strategy(cfg.strategy)
    role = Layout(strategy, model.num_layers).role(world.rank)
    sync = grad_sync_plan(strategy, model)
    world.prepare(item.plan for item in sync)
    world.prepare_groups(executable_groups(strategy))  # every rank, idle ones too
    losses: list[float] = []
    if role is None:
        for _ in range(cfg.steps):
            dist.all_reduce(loss := torch.zeros(1, dtype=torch.float64))
            losses.append(float(loss))
        return {"losses": losses, "params": {}, "comm": {}}
    exe = build_executable(
        model, strategy, StrategyOptions(), world.rank, seq_len=cfg.seq_len, seed=cfg.seed,
        world=world,
    )  # fmt: skip
    shape = (role.micro_batch_size, cfg.seq_len, model.hidden_size)
    plans = boundary_plans(strategy, model, world.rank, shape)
    optimizer = Adam(list(exe.params.values()), cfg.adam)
    comm: dict[str, int] = {}
    for batch in step_batches(cfg):
        optimizer.zero_grad()
        with count_comm(world) as log:
            value = run_step(exe, role, plans, cfg, world, batch)
        comm = comm or log.counts()  # the first step's F and B
        run_grad_sync(sync, exe.params, world)
        optimizer.step()
        reporter = role.is_last and world.rank == role.tp_ranks[0]
        loss = torch.tensor([value if reporter else 0.0], dtype=torch.float64)
        dist.all_reduce(loss)
        losses.append(float(loss))
    params = {n: (exe.pieces[n].region, p.detach().numpy().copy()) for n, p in exe.params.items()}
    return {"losses": losses, "params": params, "comm": comm}


def train_all(world: World, configs: list[TrainConfig]) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    return [train_rank(world, cfg) for cfg in configs]


def assemble(per_rank: list[dict[str, Any]], shapes: dict[str, torch.Size]) -> dict[str, Any]:
    """Global parameters from every rank's pieces; copies of one region must agree."""
    out = {name: torch.full(shape, float("nan")) for name, shape in shapes.items()}
    for outcome in per_rank:
        for name, (region, value) in outcome["params"].items():
            index = tuple(slice(a, b) for a, b in region)
            here = out[name][index]
            same = torch.isnan(here) | torch.isclose(here, torch.from_numpy(value), rtol=1e-6)
            assert bool(same.all()), f"copies of {name} {region} differ"
            out[name][index] = torch.from_numpy(value)
    return out


@pytest.fixture(scope="module")
def trained() -> dict[str, tuple[list[float], dict[str, Any]]]:
    configs = [config(*spec) for spec in STRATEGIES.values()]
    per_rank = launch(train_all, 4, args=(configs,), timeout_s=180)
    out = {}
    for index, name in enumerate(STRATEGIES):
        outcomes = [r[index] for r in per_rank]
        out[name] = (outcomes[0]["losses"], outcomes)
    return out


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_tensor_parallel_equals_reference(name: str, trained: dict[str, Any]) -> None:
    reference = run_reference(config(*STRATEGIES[name]))
    losses, outcomes = trained[name]
    first, expected = losses[0], reference.losses[0]
    assert abs(first - expected) <= 1e-5 * abs(expected), (first, expected)
    params = assemble(outcomes, {n: p.shape for n, p in reference.params.items()})
    for pname, want in reference.params.items():
        got = params[pname]
        assert not bool(torch.isnan(got).any()), f"{pname}: some region held by no rank"
        error = float((got - want).norm() / want.norm())
        assert error <= 1e-4, (pname, error)


# Per micro-batch: forward all-reduces embed (stage 0) and attn_out/mlp_out per layer and
# all-gathers the logits (last stage); backward all-reduces attn_in/mlp_in per layer and
# head_in (last stage); boundaries send one buffer per peer. 2 layers.
EXPECTED_COMM = {
    "TP 2": [{"all_reduce": 4 * 10, "all_gather": 4}] * 2 + [{}] * 2,  # 4 mbs; ranks 2-3 idle
    "PP 2 x TP 2": [{"all_reduce": 2 * 5, "send": 2, "recv": 2}] * 2  # stage 0: 2 mbs
    + [{"all_reduce": 2 * 5, "all_gather": 2, "send": 2, "recv": 2}] * 2,  # stage 1
}


@pytest.mark.parametrize("name", list(EXPECTED_COMM))
def test_communication_counts(name: str, trained: dict[str, Any]) -> None:
    _, outcomes = trained[name]
    assert [o["comm"] for o in outcomes] == EXPECTED_COMM[name]
