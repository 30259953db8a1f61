"""Unit tests of the training recipe, no processes: AdamW against torch, the learning-rate
schedules against torch's schedulers, the weight-decay rule, and the owner rule of the
global gradient norm (every piece of every parameter counted once, under any annotation)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from hspmd.models.llama import get_config
from hspmd.plan.params import parameter_annotations, state_annotations
from hspmd.plan.strategy import parse_strategy
from hspmd.train.api import train_config
from hspmd.train.clip import owned_names
from hspmd.train.config import AdamConfig, TrainError
from hspmd.train.home import home_annotations
from hspmd.train.lr import learning_rate
from hspmd.train.optim import Adam, decays
from hspmd.train.reference import param_groups


def test_adamw_equals_torch_adamw_bitwise_on_every_slice_with_a_schedule() -> None:
    torch.manual_seed(0)
    shapes = {"w": (6, 5), "b": (5,)}
    full = {n: torch.randn(s) for n, s in shapes.items()}
    config = AdamConfig(lr=1e-2, weight_decay=0.1, lr_schedule="cosine", warmup_steps=2,
                        decay_steps=5, min_lr=1e-3, beta2=0.95)  # fmt: skip
    pieces = {n: [t[:3].clone().requires_grad_(), t[3:].clone().requires_grad_()]
              for n, t in full.items()}  # fmt: skip
    ours = Adam([p for n in shapes for p in pieces[n]], config,
                names=[n for n in shapes for _ in range(2)])  # fmt: skip
    theirs = {n: t.clone().requires_grad_() for n, t in full.items()}
    torch_adamw = torch.optim.AdamW(
        [{"params": [theirs["w"]], "weight_decay": 0.1}, {"params": [theirs["b"]], "weight_decay": 0.0}],
        lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=False,
    )  # fmt: skip
    for step in range(1, 7):
        for name, shape in shapes.items():
            grad = torch.randn(shape)
            pieces[name][0].grad, pieces[name][1].grad = grad[:3].clone(), grad[3:].clone()
            theirs[name].grad = grad.clone()
        ours.step()
        for group in torch_adamw.param_groups:
            group["lr"] = learning_rate(config, step)
        torch_adamw.step()
    for name in shapes:
        assert torch.equal(torch.cat([p.detach() for p in pieces[name]]), theirs[name].detach())
    assert ours.decay == [True, True, False, False]


def _torch_lrs(config: AdamConfig, steps: int) -> list[float]:
    """The learning rates of torch's schedulers, stepped once per optimizer step: LinearLR
    warm-up, then CosineAnnealingLR or a LinearLR decay (or ConstantLR) for the rest."""
    from torch.optim import lr_scheduler as s

    param = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([param], lr=config.lr)
    warmup, horizon = config.warmup_steps, config.decay_steps or steps
    if config.lr_schedule == "cosine":
        decay: Any = s.CosineAnnealingLR(opt, T_max=horizon - warmup, eta_min=config.min_lr)
    elif config.lr_schedule == "linear":
        decay = s.LinearLR(opt, 1.0, config.min_lr / config.lr, total_iters=horizon - warmup)
    else:
        decay = s.ConstantLR(opt, factor=1.0, total_iters=0)
    if warmup:
        warm = s.LinearLR(opt, 1 / warmup, 1.0, total_iters=warmup - 1)
        scheduler: Any = s.SequentialLR(opt, [warm, decay], milestones=[warmup])
    else:
        scheduler = decay
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    return out


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize(
    "config",
    [
        AdamConfig(lr=3e-4, lr_schedule="cosine", warmup_steps=4, decay_steps=20, min_lr=3e-5),
        AdamConfig(lr=3e-4, lr_schedule="cosine", warmup_steps=0, decay_steps=12),
        AdamConfig(lr=1e-3, lr_schedule="linear", warmup_steps=3, decay_steps=10, min_lr=1e-4),
        AdamConfig(lr=1e-3, lr_schedule="constant", warmup_steps=5),
        AdamConfig(lr=1e-3),
    ],
    ids=["cosine", "cosine no warm-up", "linear", "constant after warm-up", "constant"],
)
def test_schedules_equal_torch_schedulers(config: AdamConfig) -> None:
    steps = config.decay_steps or 12  # torch's cosine turns back up after T_max
    ours = [learning_rate(config, s) for s in range(1, steps + 1)]
    assert ours == pytest.approx(_torch_lrs(config, steps), rel=1e-12, abs=1e-15)


def test_schedule_shape_and_after_the_horizon() -> None:
    config = AdamConfig(lr=1.0, lr_schedule="linear", warmup_steps=2, decay_steps=6, min_lr=0.2)
    lrs = [learning_rate(config, s) for s in range(1, 10)]
    assert lrs[:3] == [0.5, 1.0, 1.0]  # warm-up reaches the peak at step W
    assert lrs[2:6] == sorted(lrs[2:6], reverse=True)
    assert lrs[6:] == [0.2, 0.2, 0.2]  # min_lr from the horizon on


def test_decay_steps_default_to_the_runs_steps() -> None:
    config = train_config(steps=10, adam=AdamConfig(lr=1.0, lr_schedule="cosine"))
    assert config.optimizer.decay_steps == 10
    assert learning_rate(config.optimizer, 1) == 1.0
    assert learning_rate(config.optimizer, 11) == 0.0
    with pytest.raises(TrainError, match="decay_steps"):
        learning_rate(config.adam, 2)


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"lr_schedule": "cosine", "warmup_steps": 5, "decay_steps": 5}, "--decay-steps 5"),
        ({"min_lr": 1.0}, "--min-lr"),
        ({"beta1": 1.0}, "--betas"),
        ({"weight_decay": -0.1}, "--weight-decay"),
        ({"warmup_steps": -1}, "--warmup-steps"),
        ({"lr_schedule": "step"}, "--lr-schedule"),
    ],
)
def test_bad_recipes_name_the_flag(changes: dict[str, Any], words: str) -> None:
    with pytest.raises(TrainError, match=words):
        AdamConfig(lr=1e-3, **changes)


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"clip_grad_norm": 0.0}, "--clip-grad-norm"),
        ({"grad_accum": 0}, "grad_accum"),
        ({"adam": AdamConfig(lr_schedule="cosine", warmup_steps=5), "steps": 5}, "--warmup-steps"),
        ({"grad_accum": 2, "step_tokens": 256, "strategy": "1x1: R0:L0-3"}, "--grad-accum"),
    ],
)
def test_bad_run_recipes_are_refused(changes: dict[str, Any], words: str) -> None:
    with pytest.raises(TrainError, match=words):
        train_config(**changes)


def test_weight_decay_rule_and_reference_groups() -> None:
    assert decays("layers.0.mlp.w1.weight", 2, None) and not decays(
        "layers.0.mlp_norm.weight", 1, None
    )
    assert not decays("embed.weight", 2, ("embed.*",))
    assert decays("norm.weight", 1, ())  # an empty pattern list: every parameter decays
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    groups = param_groups(model, AdamConfig(weight_decay=0.1))
    assert [len(g["params"]) for g in groups] == [1, 3]
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]


STRATEGIES = [
    "2x2: R0:L0-3; 2x2: R1:L0-3",  # DP
    "4x1: R0:L0 R1:L1 R2:L2 R3:L3",  # PP
    "2x2: R0-3:L0-3",  # TP 4
    "2x1: R0-1:L0-1 R2:L2-3; 1x2: R3:L0-3",  # TP per stage and per pipeline differ
    "2x1: R0-3:L0-2 R4:L3; 2x1: R5-6:L0 R7:L1-3",
    "1x2: R0-1:L0-1 R2-3:L2-3; 1x2: R4:L0-1 R5-6:L2-3; 2x1: R7:L0-3",
]


def _check_counted_once(specs: Any, seed: int = 0) -> None:
    """Every element of every parameter lies in exactly one owned piece, and the owned
    pieces' squares sum to the global squared norm."""
    ranks = sorted({r for s in specs.values() for r in s.annotation.ranks})
    owned = {r: owned_names(specs, r) for r in ranks}
    torch.manual_seed(seed)
    for name, spec in specs.items():
        grad = torch.randn(spec.shape, dtype=torch.float64)
        count = torch.zeros(spec.shape, dtype=torch.int64)
        total = 0.0
        for rank in ranks:
            if name not in owned[rank]:
                continue
            box = tuple(slice(a, b) for a, b in spec.annotation.piece(rank, spec.shape).region)
            count[box] += 1
            total += float(grad[box].square().sum())
        assert bool((count == 1).all()), (name, str(spec.annotation))
        assert total == pytest.approx(float(grad.square().sum()), rel=1e-12)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_owners_count_each_parameter_piece_once(strategy: str) -> None:
    model = get_config("llama-tiny", num_kv_heads=4)
    _check_counted_once(parameter_annotations(parse_strategy(strategy), model))


@pytest.mark.parametrize("strategy", [s for s in STRATEGIES if ";" in s])
def test_owners_count_each_zero1_state_shard_once(strategy: str) -> None:
    model = get_config("llama-tiny", num_kv_heads=4)
    _check_counted_once(state_annotations(parse_strategy(strategy), model, zero1=True))


@pytest.mark.parametrize("num_ranks", [1, 3, 4])
def test_owners_of_the_home_layout_are_its_ranks(num_ranks: int) -> None:
    homes = home_annotations(get_config("llama-tiny", num_layers=1), num_ranks=num_ranks)
    _check_counted_once(homes)
    assert all(owned_names(homes, r) == frozenset(homes) for r in range(num_ranks))


def test_duplicates_are_counted_by_the_lowest_rank_of_the_first_replica() -> None:
    specs = parameter_annotations(
        parse_strategy("2x1: R2-3:L0-3; 2x1: R0-1:L0-3"), get_config("llama-tiny")
    )
    norm = "layers.0.attn_norm.weight"  # duplicated in each TP group
    assert [norm in owned_names(specs, r) for r in range(4)] == [False, False, True, False]
    assert math.prod(specs[norm].shape) == 64
