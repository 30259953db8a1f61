"""Gradient sync overlapped with the last backward: static issue order, and bitwise the
same training as the synchronous Post."""

from __future__ import annotations

import pytest
import torch

from hspmd.annotation import parse_annotation as A
from hspmd.comm.plan import CommPlan
from hspmd.specialize.grad_sync import StageGradSync
from hspmd.train.api import revise, train_config
from hspmd.train.config import AdamConfig
from hspmd.train.overlap import GradOverlap
from hspmd.train.sync import SyncItem
from hspmd.train.trainer import train_many


class _OneRank:
    rank = 0


def _item(name: str) -> SyncItem:
    return SyncItem((name,), CommPlan(A("[0]{}"), A("[0]{}"), (2,), ()), False)


def _overlap(stage: tuple[StageGradSync, ...] = ()) -> tuple[GradOverlap, list[str], dict]:
    params = {n: torch.ones(2, requires_grad=True) for n in "abcx"}  # x: in no item
    order: list[str] = []

    def local(item: SyncItem) -> torch.Tensor:
        order.append(item.names[0])
        grad = params[item.names[0]].grad
        assert grad is not None
        return grad

    items = [_item("c"), _item("b"), _item("a")]  # static order
    overlap = GradOverlap(items, params, _OneRank(), local=local, stage_sync=stage)
    return overlap, order, params


def test_items_are_issued_in_static_order_as_they_complete() -> None:
    overlap, order, p = _overlap()
    (p["a"] * 2).sum().backward()  # not armed: an earlier micro-batch, nothing issued
    assert overlap.issued == 0
    overlap.arm()
    (p["b"] * 2).sum().backward()  # b is final, but c (first in order) is not
    assert order == []
    (p["c"] * 2 + p["a"]).sum().backward()
    assert order == ["c", "b", "a"]
    outs = overlap.finish()
    assert [o.tolist() for o in outs] == [[2.0, 2.0], [2.0, 2.0], [3.0, 3.0]]
    assert overlap.issued == 0 and not overlap.armed  # ready for the next step


def test_partial_gradients_are_summed_in_the_stage_just_before_their_item(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stage bucket over b, a and a name no item holds (x): b's and a's parts run right
    before their items, during backward; x's in finish."""
    import hspmd.train.overlap as overlap_module

    bucket = StageGradSync(("b", "x", "a"), CommPlan(A("[0]{}"), A("[0]{}"), (6,), ()))
    overlap, order, p = _overlap((bucket,))
    monkeypatch.setattr(
        overlap_module, "run_stage_grad_sync",
        lambda syncs, params, world: order.extend(f"stage {n}" for s in syncs for n in s.names),
    )  # fmt: skip
    overlap.arm()
    (p["a"] + p["b"] + p["c"]).sum().backward()
    assert order == ["c", "stage b", "b", "stage a", "a"]  # all issued during backward
    overlap.finish()
    assert order[5:] == ["stage x"]
    assert [[s.names for s in pre] for pre in overlap.pre] == [[], [("b",)], [("a",)]]
    assert [s.plan.shape for s in overlap.pre[1]] == [(2,)]  # the bucket cut to b's size


def test_without_arm_everything_runs_in_finish() -> None:
    overlap, order, p = _overlap()
    (p["a"] + p["b"] + p["c"]).sum().backward()
    assert order == []
    overlap.finish()
    assert order == ["c", "b", "a"]


BASE = train_config(
    global_batch=4,
    seq_len=32,
    steps=3,
    adam=AdamConfig(lr=1e-3),
    model_kwargs=(("num_layers", 2),),
    bucket_bytes=1 << 16,  # several flat buckets: most start during backward
)
# name -> (strategy, options); every one runs with and without overlap
CASES = {
    "DP 2": ("2x1: R0:L0-1; 2x1: R1:L0-1", {}),
    "TP 2 x DP 2": ("2x1: R0-1:L0-1; 2x1: R2-3:L0-1", {}),
    "ZeRO-1 DP 2": ("2x1: R0:L0-1; 2x1: R1:L0-1", {"zero": 1}),
    "ZeRO-1 heterogeneous (SplitRS, not startable)": (
        "1x2: R0-1:L0-1; 2x1: R2:L0-1",
        {"zero": 1},
    ),
    "SP + bf16, TP differs per pipeline (norm weights summed in the stage first)": (
        "2x1: R0-1:L0-1; 1x2: R2:L0 R3:L1",
        {"sequence_parallel": True, "dtype": "bf16"},
    ),
    "mixed-length home Post, SP, a switch there and back": (
        "2x1: R0-1:L0-1; 2x1: R2-3:L0-1",
        {
            "sequence_parallel": True,
            "switch_mode": "weights",
            "switches": (
                (2, "1x2: R0-1:L0-1; 2x1: R2:L0 R3:L1"),
                (3, "2x1: R0-1:L0-1; 2x1: R2-3:L0-1"),
            ),
        },
    ),
}


@pytest.mark.multiproc
def test_overlap_trains_bitwise_like_the_synchronous_post() -> None:
    configs = []
    for strategy, options in CASES.values():
        for overlap in (True, False):
            configs.append(revise(BASE, strategy=strategy, overlap=overlap, **options))
    results = train_many(configs, threads=1)
    for i, name in enumerate(CASES):
        on, off = results[2 * i], results[2 * i + 1]
        assert [r.loss for r in on.records] == [r.loss for r in off.records], name
        for param, value in on.params.items():
            assert torch.equal(value, off.params[param]), (name, param)
