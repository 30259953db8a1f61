"""In-memory switching: the fused BSR plan (pure data) and training across switches.

One launch of 8 processes runs every multi-process case in turn (``train_many``); each
run's losses must equal the single-device reference at every step, and its parameters
after the last step too, exactly as tightly as a run without switching.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from hspmd.comm.plan import local_box
from hspmd.models.llama import get_config
from hspmd.plan.strategy import Strategy, parse_strategy
from hspmd.switch.live import plan_switch
from hspmd.train.api import revise, train_config
from hspmd.train.config import AdamConfig, TrainConfig
from hspmd.train.reference import run_reference
from hspmd.train.trainer import train_many

MODEL = (("num_layers", 4), ("num_kv_heads", 4))  # TP 4 needs the KV heads to divide
BASE = train_config(
    model_kwargs=MODEL, seq_len=16, global_batch=4, adam=AdamConfig(lr=1e-3), steps=10
)

PP_UNEVEN = "4x1: R0:L0-0 R1:L1-3"
TP4 = "2x2: R0-3:L0-3"
DP_PP_TP = "1x2: R0-1:L0-1 R2-3:L2-3; 1x2: R4-5:L0-1 R6-7:L2-3"
ONE = "4x1: R0:L0-3"
HETERO = "2x1: R0-1:L0-2 R2:L3-3; 2x1: R3:L0-1 R4-5:L2-3"

# name -> config: PP <-> TP, uneven <-> even layers, TP degrees 1/2/4, 8 ranks -> 1 -> 6
CASES = {
    "chain of five strategies": revise(
        BASE,
        strategy=PP_UNEVEN,
        switches=((3, TP4), (5, DP_PP_TP), (7, ONE), (9, HETERO)),
    ),
    "ZeRO-1 between data-parallel strategies": revise(
        BASE,
        strategy="2x1: R0:L0-3; 2x1: R1:L0-3",
        switches=((2, "1x2: R0-1:L0-3; 1x2: R2:L0-3"), (4, "2x1: R0:L0-1 R1:L2-3; 2x1: R2-3:L0-3")),
        zero=1,
        steps=5,
    ),
}


def _strategy_before(config: TrainConfig, step: int) -> Strategy:
    return config.strategy_at(step - 1)


# -- pure data --------------------------------------------------------------------------


def _simulate(plan: Any, shapes_seed: int = 0) -> None:
    """Apply the transfers to numpy pieces; every destination piece must equal the source."""
    rng = np.random.default_rng(shapes_seed)
    full = [rng.standard_normal(t.shape) for t in plan.tensors]
    out: dict[tuple[int, int], np.ndarray] = {}
    for i, t in enumerate(plan.tensors):
        for rank, piece in t.dst.pieces(t.shape).items():
            out[(rank, i)] = np.full(piece.shape, np.nan)
    for tr in plan.transfers:
        t = plan.tensors[tr.tensor]
        old = t.src.piece(tr.src, t.shape)
        new = t.dst.piece(tr.dst, t.shape)
        source = full[tr.tensor][tuple(slice(a, b) for a, b in old.region)]
        out[(tr.dst, tr.tensor)][local_box(new, tr.region)] = source[local_box(old, tr.region)]
    for (rank, i), got in out.items():
        t = plan.tensors[i]
        region = t.dst.piece(rank, t.shape).region
        np.testing.assert_array_equal(got, full[i][tuple(slice(a, b) for a, b in region)])


@pytest.mark.parametrize(
    ("source", "target", "zero1"),
    [(PP_UNEVEN, TP4, False), (TP4, DP_PP_TP, False), (DP_PP_TP, ONE, False),
     (ONE, HETERO, False), ("2x1: R0:L0-3; 2x1: R1:L0-3", "1x2: R0-1:L0-3; 1x2: R2:L0-3", True)],
)  # fmt: skip
def test_fused_plan_moves_every_piece(source: str, target: str, zero1: bool) -> None:
    config = get_config("llama-tiny", **dict(MODEL))
    plan = plan_switch(config, parse_strategy(source), parse_strategy(target), zero1=zero1)
    _simulate(plan)
    # one message per pair of ranks, whatever the number of tensors
    pairs = {(t.src, t.dst) for t in plan.transfers if t.src != t.dst}
    assert len(plan.messages()) == len(pairs) > 0


def test_one_rank_to_two_by_layers_messages() -> None:
    config = get_config("llama-tiny", num_layers=2)
    plan = plan_switch(config, parse_strategy("2x1: R0:L0-1"), parse_strategy("2x1: R0:L0 R1:L1"))
    # rank 0 keeps layer 0 and the embedding, sends layer 1, the norm and the head to rank 1
    assert plan.messages() == {(0, 1): 1}
    moved = {plan.names[t.tensor].split("/", 1)[1] for t in plan.transfers if t.dst == 1}
    assert moved == {
        n for n in moved if n.startswith("layers.1.") or n in ("norm.weight", "head.weight")
    }
    assert "head.weight" in moved


def test_zero1_target_brings_compute_pieces() -> None:
    config = get_config("llama-tiny", num_layers=2)
    plan = plan_switch(
        config, parse_strategy("1x1: R0:L0-1"), parse_strategy("1x1: R0:L0-1; 1x1: R1:L0-1"),
        zero1=True,
    )  # fmt: skip
    kinds = {name.split("/")[0] for name in plan.names}
    assert kinds == {"master", "exp_avg", "exp_avg_sq", "param"}
    assert plan.messages() == {(0, 1): 1}


# -- training across switches -------------------------------------------------------------


@pytest.fixture(scope="module")
def runs() -> dict[str, Any]:
    results = train_many(list(CASES.values()), threads=1, timeout_s=300)
    return dict(zip(CASES, results, strict=True))


@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(CASES))
def test_switches_match_reference(runs: dict[str, Any], name: str) -> None:
    config = CASES[name]
    result = runs[name]
    reference = run_reference(revise(config, strategy=None, switches=()))
    assert len(result.records) == config.steps
    for got, want in zip(result.losses, reference.losses, strict=True):
        assert got == pytest.approx(want, rel=1e-5)
    for param, want in reference.params.items():
        diff = float((result.params[param] - want).norm() / want.norm())
        assert diff < 1e-4, (param, diff)


@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(CASES))
def test_switch_records_time_and_one_message_per_pair(runs: dict[str, Any], name: str) -> None:
    config = CASES[name]
    model = config.model_config()
    switched = [r for r in runs[name].records if r.switch_seconds is not None]
    assert [r.step for r in switched] == [step for step, _ in config.switching.switches]
    for record in switched:
        assert record.switch_seconds > 0
        assert record.strategy == str(config.strategy_at(record.step))
        plan = plan_switch(
            model,
            _strategy_before(config, record.step),
            parse_strategy(record.strategy),
            zero1=config.zero1,
        )
        # every rank counted the sends it issued: exactly one per communicating pair
        assert record.switch_messages == len(plan.messages())
