"""Hand-built comm plans of every step kind for n ranks (independent of comm.resolve)."""

from __future__ import annotations

import numpy as np

from hspmd.annotation import Annotation, parse_annotation
from hspmd.comm.plan import (
    AllGather,
    AllReduce,
    AllToAll,
    BatchedSendRecv,
    CommPlan,
    Local,
    ReduceScatter,
    SendRecv,
    SliceReduce,
    SplitAllGather,
    SplitAllReduce,
    SplitReduceScatter,
    Transfer,
    intersect,
)
from hspmd.runtime.reshard_cli import PlanRun

A = parse_annotation


def bsr(src: Annotation, dst: Annotation, shape: tuple[int, ...]) -> CommPlan:
    """A BSR plan for a src without partial: each dst piece from the distinct src pieces."""
    src_pieces, transfers = src.pieces(shape), []
    owners: dict[tuple, list[int]] = {}
    for rank, piece in src_pieces.items():
        assert not piece.partial
        owners.setdefault(piece.region, []).append(rank)
    for d, piece in dst.pieces(shape).items():
        for region, ranks in owners.items():
            common = intersect(region, piece.region)
            if common is not None:
                owner = d if d in ranks else ranks[(d + len(transfers)) % len(ranks)]
                transfers.append(Transfer(owner, d, common))
    return CommPlan(src, dst, shape, (BatchedSendRecv(tuple(transfers)),))


def _all(n: int) -> str:
    return "[" + ",".join(map(str, range(n))) + "]"


def bottom_plans(n: int, rows: int = 8, cols: int = 24) -> dict[str, CommPlan]:
    """Bottom-tier collectives, send-recv and local steps on ranks 0..n-1."""
    g, shape, group = _all(n), (rows, cols), (tuple(range(n)),)
    rev = "[" + ",".join(map(str, reversed(range(n)))) + "]"
    out = {
        "all-reduce": CommPlan(A(f"{g}{{P:{n}}}"), A(f"{g}{{D:{n}}}"), shape, (AllReduce(group),)),
        "reduce-scatter-0": CommPlan(
            A(f"{g}{{P:{n}}}"), A(f"{g}{{0:{n}}}"), shape, (ReduceScatter(group, dim=0),)
        ),
        "reduce-scatter-1": CommPlan(
            A(f"{g}{{P:{n}}}"), A(f"{g}{{1:{n}}}"), shape, (ReduceScatter(group, dim=1),)
        ),
        "all-gather-0": CommPlan(
            A(f"{g}{{0:{n}}}"), A(f"{g}{{D:{n}}}"), shape, (AllGather(group, dim=0),)
        ),
        "all-gather-1": CommPlan(
            A(f"{g}{{1:{n}}}"), A(f"{g}{{D:{n}}}"), shape, (AllGather(group, dim=1),)
        ),
        "all-to-all": CommPlan(
            A(f"{g}{{0:{n}}}"),
            A(f"{g}{{1:{n}}}"),
            shape,
            (AllToAll(group, split_dim=1, concat_dim=0),),
        ),
        "all-gather-unsorted": CommPlan(
            A(f"{rev}{{1:{n}}}"),
            A(f"{rev}{{D:{n}}}"),
            shape,
            (AllGather((tuple(reversed(range(n))),), dim=1),),
        ),
        "reduce-scatter-unsorted": CommPlan(
            A(f"{rev}{{P:{n}}}"),
            A(f"{rev}{{1:{n}}}"),
            shape,
            (ReduceScatter((tuple(reversed(range(n))),), dim=1),),
        ),
        "all-to-all-unsorted": CommPlan(
            A(f"{rev}{{1:{n}}}"),
            A(f"{rev}{{0:{n}}}"),
            shape,
            (AllToAll((tuple(reversed(range(n))),), split_dim=0, concat_dim=1),),
        ),
        "send-recv": CommPlan(
            A(f"{g}{{0:{n}}}"),
            A(f"{rev}{{0:{n}}}"),
            shape,
            (SendRecv(tuple((r, n - 1 - r) for r in range(n) if r != n - 1 - r)),),
        ),
        "local-split": CommPlan(
            A(f"{g}{{D:{n}}}"), A(f"{g}{{0:{n}}}"), shape, (Local(tuple(range(n))),)
        ),
        "local-partial": CommPlan(
            A(f"{g}{{D:{n}}}"), A(f"{g}{{P:{n}}}"), shape, (Local((0,), tuple(range(1, n))),)
        ),
    }
    if n >= 4:
        half = n // 2
        two = f"[{','.join(map(str, range(n)))}]{{0:2,P:{half}}}"
        out["all-reduce-subgroups"] = CommPlan(
            A(two),
            A(f"{g}{{0:2,D:{half}}}"),
            shape,
            (AllReduce((tuple(range(half)), tuple(range(half, n)))),),
        )
        out["send-recv-half"] = CommPlan(
            A(f"[{','.join(map(str, range(half)))}]{{1:{half}}}"),
            A(f"[{','.join(map(str, range(half, n)))}]{{1:{half}}}"),
            shape,
            (SendRecv(tuple((r, r + half) for r in range(half))),),
        )
    return out


def top_plans(n: int, rows: int = 8, cols: int = 24) -> dict[str, CommPlan]:
    """Split collectives across two subgroups, uneven top tiers, and BSR."""
    half = n // 2
    a = "[" + ",".join(map(str, range(half))) + "]"
    b = "[" + ",".join(map(str, range(half, n))) + "]"
    ds = f"{{0:{half}}}" if half > 1 else "{}"
    shape = (rows, cols)
    src, dst = A(f"hP: {a}{ds} {b}{ds}"), A(f"hD: {a}{ds} {b}{ds}")
    pieces = src.pieces(shape)
    regions = sorted({p.region for p in pieces.values()})
    split_ar = SplitAllReduce(
        tuple(
            SliceReduce(reg, tuple(r for r, p in pieces.items() if p.region == reg))
            for reg in regions
        )
    )
    h1 = A(f"h1: {a}{ds} {b}{ds}")
    rs_slices = tuple(
        SliceReduce(
            p.region, tuple(r for r, q in pieces.items() if intersect(q.region, p.region)), root=d
        )
        for d, p in h1.pieces(shape).items()
    )
    h1_pieces = h1.pieces(shape)
    ag_slices = []
    for d, p in dst.pieces(shape).items():
        if d >= half:
            continue
        ranks = tuple(r for r, q in dst.pieces(shape).items() if q.region == p.region)
        owners = tuple((r, q.region) for r, q in h1_pieces.items() if intersect(q.region, p.region))
        ag_slices.append(SliceReduce(p.region, ranks, owners=owners))
    uneven_src = A(f"h0({rows - 2},2): {a}{{}} {b}{{}}") if half == 1 else None
    out = {
        "split-all-reduce": CommPlan(src, dst, shape, (split_ar,)),
        "split-reduce-scatter": CommPlan(src, h1, shape, (SplitReduceScatter(rs_slices),)),
        "split-all-gather": CommPlan(h1, dst, shape, (SplitAllGather(tuple(ag_slices)),)),
        "bsr-dim-change": bsr(A(f"{_all(n)}{{0:{n}}}"), A(f"{_all(n)}{{1:{n}}}"), shape),
        "bsr-hetero": bsr(
            A(f"h0({rows - 2},2): {a}{{1:{half}}} {b}{{D:{half}}}".replace("{1:1}", "{}")),
            A(f"h1: {b}{ds} {a}{{D:{half}}}".replace("{D:1}", "{}")),
            shape,
        ),
    }
    if uneven_src is not None:
        full = tuple((0, s) for s in shape)
        owners = tuple((r, p.region) for r, p in uneven_src.pieces(shape).items())
        out["split-all-gather-uneven"] = CommPlan(
            uneven_src,
            A(f"hD: {a}{{}} {b}{{}}"),
            shape,
            (SplitAllGather((SliceReduce(full, (0, 1), owners=owners),)),),
        )
    return out


def runs_for(n: int, *, dtypes: tuple[str, ...] = ("float32",)) -> list[tuple[str, PlanRun]]:
    """Every hand-built plan for n ranks on a random value, plus tiny half-precision runs."""
    rng = np.random.default_rng(n)
    out = []
    plans = {**bottom_plans(n), **top_plans(n)}
    for i, (name, plan) in enumerate(sorted(plans.items())):
        value = rng.standard_normal(plan.shape)
        for dtype in dtypes:
            out.append((f"{name}/{dtype}", PlanRun(plan, value, dtype, seed=i)))
    for dtype in ("bfloat16", "float16"):
        for name in ("all-gather-1", "reduce-scatter-1", "bsr-hetero", "split-all-reduce"):
            plan = plans[name]
            value = rng.integers(-4, 5, size=plan.shape).astype(np.float64)
            out.append((f"{name}/{dtype}", PlanRun(plan, value, dtype, seed=None)))
    return out
