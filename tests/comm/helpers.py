"""Shared checks for the comm tests: run a plan in the simulator against the global tensor."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hspmd.annotation import Annotation, parse_annotation
from hspmd.comm.plan import BatchedSendRecv, CommPlan
from hspmd.comm.resolve import resolve
from hspmd.comm.simulate import assemble, scatter, simulate


def check_plan(plan: CommPlan, *, seed: int = 0) -> None:
    """Simulate ``plan`` on a random global tensor; every destination rank holds its piece."""
    rng = np.random.default_rng(seed)
    value = rng.standard_normal(plan.shape)
    for layout in plan.layouts:
        layout.check_shape(plan.shape)
    out = simulate(plan, scatter(plan.src, value, rng=rng))
    assert set(out) == set(plan.dst.ranks)
    np.testing.assert_allclose(assemble(plan.dst, plan.shape, out), value, atol=1e-9)
    for rank, piece in plan.dst.pieces(plan.shape).items():
        assert out[rank].shape == piece.shape
        if not piece.partial:
            box = tuple(slice(a, b) for a, b in piece.region)
            np.testing.assert_allclose(out[rank], value[box], atol=1e-9)
    check_bsr_moves(plan)


def check_bsr_moves(plan: CommPlan) -> None:
    """Every BSR step sends a message, and each of its ranks sends, receives or changes
    its piece (a rank copying its whole piece unchanged moves nothing: issue 17)."""
    for index, step in enumerate(plan.steps):
        if not isinstance(step, BatchedSendRecv):
            continue
        assert any(t.src != t.dst for t in step.transfers), f"step {index} of {plan}: no message"
        before, after = plan.layouts[index], plan.layouts[index + 1]
        for rank in step.ranks:
            if any(t.src != t.dst for t in step.transfers if rank in (t.src, t.dst)):
                continue
            old = before.piece(rank, plan.shape).region
            assert old != after.piece(rank, plan.shape).region, (
                f"step {index} of {plan.src} -> {plan.dst}: rank {rank} copies {old} unchanged"
            )


def check(src: str | Annotation, dst: str | Annotation, shape: Sequence[int]) -> CommPlan:
    """Resolve ``src -> dst`` and check it in the simulator; returns the plan."""
    a = parse_annotation(src) if isinstance(src, str) else src
    b = parse_annotation(dst) if isinstance(dst, str) else dst
    plan = resolve(a, b, shape)
    check_plan(plan)
    return plan
