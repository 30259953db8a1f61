"""Hand-built comm plans of every step kind for n ranks (independent of comm.resolve)."""

from __future__ import annotations

import numpy as np

from hspmd.annotation import Annotation, DeviceGroup, DistributedStates, parse_annotation
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
from hspmd.errors import AnnotationError
from hspmd.runtime.plan_runs import PlanRun

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
    for name in ("all-reduce", "split-all-reduce", "split-reduce-scatter", "local-partial"):
        plan = plans[name]
        value = rng.standard_normal(plan.shape)
        out.append((f"{name}/donated", PlanRun(plan, value, "float64", seed=7, donate=True)))
    for dtype in ("bfloat16", "float16"):
        for name in ("all-gather-1", "reduce-scatter-1", "bsr-hetero", "split-all-reduce"):
            plan = plans[name]
            value = rng.integers(-4, 5, size=plan.shape).astype(np.float64)
            out.append((f"{name}/{dtype}", PlanRun(plan, value, dtype, seed=None)))
    return out


# One pair per category of the paper's Figure 7 (ranks up to 7; a world of n ranks runs the
# pairs whose ranks are all below n).
FIGURE7 = [
    ("identity", "[0,1]{0:2}", "[0,1]{0:2}"),
    ("SR", "[0,1]{0:2}", "[1,0]{0:2}"),
    ("SR", "[0,1]{0:2}", "[2,3]{0:2}"),
    ("SR partial", "[0,1]{P:2}", "[3,2]{P:2}"),
    ("SR subgroups", "h0: [0,1]{1:2} [2,3]{D:2}", "h0: [4,5]{1:2} [6,7]{D:2}"),
    ("AR", "[0,1]{P:2}", "[0,1]{D:2}"),
    ("AR", "[0,1,2,3]{P:4}", "[0,1,2,3]{D:4}"),
    ("RS", "[0,1,2,3]{P:4}", "[0,1,2,3]{0:4}"),
    ("AG", "[0,1,2,3]{0:4}", "[0,1,2,3]{D:4}"),
    ("A2A", "[0,1,2,3]{0:4}", "[0,1,2,3]{1:4}"),
    ("local", "[0,1]{D:2}", "[0,1]{P:2}"),
    ("RS axis", "[0,1,2,3]{P:2,0:2}", "[0,1,2,3]{1:2,0:2}"),
    ("AG+A2A", "[0,1,2,3]{0:2,1:2}", "[0,1,2,3]{1:2,D:2}"),
    ("AR+local", "[0,1,2,3]{D:2,P:2}", "[0,1,2,3]{P:2,D:2}"),
    ("AR subgroups", "h0: [0,1]{P:2} [2,3]{P:2}", "h0: [0,1]{D:2} [2,3]{D:2}"),
    ("AG subgroups", "hD: [0,1]{0:2} [2,3,4,5]{1:4}", "hD: [0,1]{D:2} [2,3,4,5]{D:4}"),
    ("AG+SR", "h0: [0,1]{0:2} [2,3]{0:2}", "h0: [0,1]{D:2} [3,2]{0:2}"),
    ("BSR", "[0,1,2,3]{0:4}", "[0,1,2,3]{0:2,D:2}"),
    ("BSR", "[0,1]{0:2}", "[0,1,2,3]{1:4}"),
    ("BSR", "[0]{}", "[1]{}"),
    ("AR+BSR", "[0,1,2,3]{P:2,0:2}", "[4,5]{1:2}"),
    ("BSR+local", "[0,1,2,3]{0:4}", "[4,5,6,7]{P:2,D:2}"),
    ("SplitAG", "h0: [0]{} [1]{}", "hD: [0]{} [1]{}"),
    ("SplitAG", "h0: [0,1]{1:2} [2,3]{1:2}", "hD: [0,1]{1:2} [2,3]{1:2}"),
    ("SplitAR", "hP: [0]{} [1]{}", "hD: [0]{} [1]{}"),
    ("SplitAR", "hP: [0,1]{1:2} [2,3,4,5]{1:4}", "hD: [0,1]{1:2} [2,3,4,5]{1:4}"),
    ("SplitRS", "hP: [0]{} [1]{}", "h1: [0]{} [1]{}"),
    ("SplitRS", "hP: [0,1]{0:2} [2,3]{1:2}", "h0: [0,1]{0:2} [2,3]{1:2}"),
    ("top local", "hD: [0,1]{1:2} [2,3]{D:2}", "h0: [0,1]{1:2} [2,3]{D:2}"),
    ("uneven SplitAG", "h0(10,2): [0,1]{1:2} [2]{}", "hD: [0,1]{1:2} [2]{}"),
    ("uneven SplitAG", "h0(10,2): [0]{} [1]{}", "hD: [0]{} [1]{}"),
    ("Fig10 RS+SplitAG", "h0: [0,1]{P:2} [2,3]{1:2}", "hD: [0,1]{1:2} [2,3]{1:2}"),
    ("Fig10 A2A+SplitAR", "hP: [0,1]{0:2} [2,3]{D:2}", "hD: [0,1]{1:2} [2,3]{1:2}"),
    ("hsize change", "[0,1,2,3]{P:2,0:2}", "h0: [0,1]{D:2} [2,3]{1:2}"),
    ("hsize change", "hP: [0,1]{P:2} [2,3]{1:2}", "[4,5]{P:2}"),
    ("uneven BSR", "h0: [0]{} [1]{}", "h0(2,10): [0]{} [1]{}"),
    ("uneven BSR", "h0(2,10): [0,1]{1:2} [2,3,4]{1:3}", "h1: [5,6]{0:2} [7]{}"),
]


def figure7_pairs(n: int) -> list[tuple[str, Annotation, Annotation]]:
    out = []
    for name, a, b in FIGURE7:
        src, dst = A(a), A(b)
        if max(src.ranks + dst.ranks) < n:
            out.append((f"{name}: {a} -> {b}", src, dst))
    return out


def random_annotation(rng: np.random.Generator, n: int, shape: tuple[int, ...]) -> Annotation:
    """A random valid annotation over some of the ranks 0..n-1 (retries until it fits)."""
    factorizations = {1: [()], 2: [(2,)], 3: [(3,)], 4: [(4,), (2, 2)], 8: [(8,), (2, 4)]}
    while True:
        ranks = [int(r) for r in rng.permutation(n)]
        hsize = int(rng.integers(1, 4))
        sizes = [int(rng.choice([s for s in (1, 2, 3, 4, 8) if s <= n])) for _ in range(hsize)]
        if sum(sizes) > n:
            continue
        groups, states, start = [], [], 0
        for size in sizes:
            degrees = factorizations[size][int(rng.integers(len(factorizations[size])))]
            dims = rng.choice([-1, -2, *range(len(shape))], size=len(degrees), replace=False)
            groups.append(DeviceGroup(tuple(ranks[start : start + size])))
            states.append(DistributedStates(tuple(zip(map(int, dims), degrees, strict=True))))
            start += size
        hdim = int(rng.choice([-1, -2, *range(len(shape))]))
        hsizes = None
        if hdim >= 0 and hsize > 1 and rng.random() < 0.5:
            cuts = sorted(rng.choice(range(1, shape[hdim]), size=hsize - 1, replace=False))
            hsizes = tuple(
                int(b - a) for a, b in zip([0, *cuts], [*cuts, shape[hdim]], strict=True)
            )
        try:
            annotation = Annotation(tuple(groups), tuple(states), hdim=hdim, hsizes=hsizes)
            annotation.check_shape(shape)
        except AnnotationError:
            continue
        return annotation


def random_pairs(
    n: int, count: int, shape: tuple[int, ...]
) -> list[tuple[str, Annotation, Annotation]]:
    rng = np.random.default_rng(1000 + n)
    out = []
    for i in range(count):
        src, dst = random_annotation(rng, n, shape), random_annotation(rng, n, shape)
        out.append((f"random {i}: {src} -> {dst}", src, dst))
    return out
