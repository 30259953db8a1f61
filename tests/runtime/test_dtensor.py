"""Every homogeneous reshard DTensor can express gives DTensor.redistribute's local tensors.

DTensor is an outside oracle here, never a dependency of the library. Placements map to our
DS in mesh-dim order (the last mesh dim varies fastest in both): ``(Shard(0), Replicate())``
on a 2 x 2 mesh is ``{0:2,D:2}``; two entries on the same tensor dim merge (``{0:4}``).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from hspmd.annotation import Annotation, DeviceGroup, DistributedStates
from hspmd.comm.resolve import resolve
from hspmd.comm.simulate import assemble, scatter
from hspmd.runtime import World, launch, run_plan

SHAPE = (8, 24)
KINDS = ("S0", "S1", "R", "P")


def annotation(kinds: tuple[str, ...], mesh: tuple[int, ...]) -> Annotation:
    entries: list[tuple[int, int]] = []
    for kind, size in zip(kinds, mesh, strict=True):
        dim = {"S0": 0, "S1": 1, "R": -1, "P": -2}[kind]
        if entries and entries[-1][0] == dim:
            entries[-1] = (dim, entries[-1][1] * size)
        else:
            entries.append((dim, size))
    ranks = tuple(range(int(np.prod(mesh))))
    return Annotation((DeviceGroup(ranks),), (DistributedStates(tuple(entries)),))


Case = tuple[tuple[int, ...], tuple[str, ...], tuple[str, ...]]


def all_cases() -> list[Case]:
    out = []
    for mesh in ((4,), (2, 2)):
        placements = list(itertools.product(KINDS, repeat=len(mesh)))
        out += [(mesh, a, b) for a in placements for b in placements if _expressible(a, b)]
    return out


def _expressible(a: tuple[str, ...], b: tuple[str, ...]) -> bool:
    """DTensor refuses to redistribute into Partial from anything but Partial."""
    return a != b and all(y != "P" or x == "P" for x, y in zip(a, b, strict=True))


def _resolves(case: Case) -> bool:
    mesh, a, b = case
    try:
        resolve(annotation(a, mesh), annotation(b, mesh), SHAPE)
    except Exception:
        return False
    return True


def cases() -> list[Case]:
    """The pairs resolve() handles (the others fail test_every_dtensor_pair_resolves)."""
    return [c for c in all_cases() if _resolves(c)]


def _placement(kind: str) -> object:
    from torch.distributed.tensor import Partial, Replicate, Shard

    return {"S0": Shard(0), "S1": Shard(1), "R": Replicate(), "P": Partial()}[kind]


def both(world: World) -> list[tuple[np.ndarray, np.ndarray]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    meshes = {m: init_device_mesh("cpu", m) for m in ((4,), (2, 2))}
    plans = [resolve(annotation(a, m), annotation(b, m), SHAPE) for m, a, b in cases()]
    world.prepare(plans)
    value = np.random.default_rng(0).standard_normal(SHAPE)
    out = []
    for i, ((mesh, a, b), plan) in enumerate(zip(cases(), plans, strict=True)):
        local = scatter(plan.src, value, rng=np.random.default_rng(i))[world.rank]
        ours = run_plan(plan, torch.from_numpy(local), world)
        placements = [_placement(k) for k in a]
        dt = DTensor.from_local(torch.from_numpy(local), meshes[mesh], placements, run_check=False)
        theirs = dt.redistribute(meshes[mesh], [_placement(k) for k in b]).to_local()
        assert ours is not None
        out.append((ours.numpy(), theirs.numpy()))
    return out


@pytest.mark.multiproc
def test_reshards_match_dtensor_redistribute() -> None:
    per_rank = launch(both, 4, timeout_s=180)
    for i, (mesh, a, b) in enumerate(cases()):
        dst = annotation(b, mesh)
        ours = {r: per_rank[r][i][0] for r in range(4)}
        theirs = {r: per_rank[r][i][1] for r in range(4)}
        name = f"{mesh} {a} -> {b}"
        if "P" in b:  # partial summands may be split differently; their sums must agree
            np.testing.assert_allclose(
                assemble(dst, SHAPE, ours), assemble(dst, SHAPE, theirs), atol=1e-12, err_msg=name
            )
            continue
        for r in range(4):
            np.testing.assert_allclose(ours[r], theirs[r], atol=1e-12, err_msg=f"{name} rank {r}")


def test_every_dtensor_pair_resolves() -> None:
    failing = [c for c in all_cases() if not _resolves(c)]
    assert not failing, f"resolve() raises on {len(failing)} pairs, e.g. {failing[:4]}"
