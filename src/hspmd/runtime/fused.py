"""Fused BSR: many tensors, each from its own source to its own destination annotation,
moved by one ``batch_isend_irecv`` with one packed buffer per pair of ranks.

``transfers`` come from ``hspmd.comm.bsr.schedule`` over one table per tensor
(``Transfer.tensor`` is the index into ``tensors``). Both sides of a pair walk the same
transfer tuple in order, so the sender's packing order is the receiver's unpacking order::

    tensors = [FusedTensor((4, 2), A("[0]{}"), A("[0,1]{0:2}"))]
    transfers = schedule([BsrTable.between(t.src, t.dst, t.shape, tensor=0) ...])
    out = run_fused_bsr(transfers, tensors, {0: w} if rank == 0 else {}, world)
    # rank 0: {0: w[0:2]}; rank 1: {0: w[2:4]} (one message 0 -> 1)

Every tensor of one call has the same dtype (one buffer per pair). A rank that holds
nothing at the end gets an empty dict.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from hspmd.annotation import Annotation, Piece
from hspmd.comm.plan import Transfer, local_box
from hspmd.errors import HspmdError
from hspmd.runtime.p2p import Exchange
from hspmd.runtime.trace import comm_span
from hspmd.runtime.world import World

__all__ = ["FusedInputError", "FusedTensor", "RankEnds", "rank_ends", "run_fused_bsr"]


class FusedInputError(HspmdError, ValueError):
    """A rank that holds a source piece but passed no tensor for it."""


@dataclass(frozen=True, slots=True)
class FusedTensor:
    """One tensor of a fused BSR: global shape, where it lives before and after."""

    shape: tuple[int, ...]
    src: Annotation
    dst: Annotation

    def __str__(self) -> str:
        return f"{list(self.shape)} {self.src} -> {self.dst}"


@dataclass(frozen=True, slots=True)
class RankEnds:
    """One rank's two ends of a move, by tensor index: its source pieces (``old``, whose
    values the caller passed), its destination pieces (``new``) and the empty tensors of
    those it fills (``out``, returned at the end)."""

    old: dict[int, Piece]
    new: dict[int, Piece]
    out: dict[int, torch.Tensor]


def rank_ends(
    tensors: Sequence[FusedTensor],
    local: Mapping[int, torch.Tensor],
    rank: int,
    *,
    dtype: torch.dtype,
    device: torch.device,
) -> RankEnds:
    """``rank``'s pieces before and after moving ``tensors`` (the fused and relay executors'
    setup); ``FusedInputError`` when it holds a source piece that ``local`` lacks.

    >>> from hspmd.annotation import parse_annotation as A
    >>> t = FusedTensor((4, 2), A("[0]{}"), A("[0,1]{0:2}"))
    >>> cpu = torch.device("cpu")
    >>> ends = rank_ends([t], {0: torch.zeros(4, 2)}, 0, dtype=torch.float32, device=cpu)
    >>> ends.old[0].region, ends.new[0].region, tuple(ends.out[0].shape)
    (((0, 4), (0, 2)), ((0, 2), (0, 2)), (2, 2))
    >>> rank_ends([t], {}, 0, dtype=torch.float32, device=cpu)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    hspmd.runtime.fused.FusedInputError: rank 0 holds a piece of tensor 0 (...) but passed none: ...
    """
    ends = RankEnds({}, {}, {})
    for index, t in enumerate(tensors):
        if rank in t.dst.ranks:
            ends.new[index] = t.dst.piece(rank, t.shape)
            ends.out[index] = torch.empty(ends.new[index].shape, dtype=dtype, device=device)
        if rank in t.src.ranks:
            ends.old[index] = t.src.piece(rank, t.shape)
            if index not in local:
                raise FusedInputError(
                    f"rank {rank} holds a piece of tensor {index} ({t}) but passed none: "
                    f"pass local[{index}], this rank's piece under {t.src}"
                )
    return ends


def run_fused_bsr(
    transfers: Sequence[Transfer],
    tensors: Sequence[FusedTensor],
    local: Mapping[int, torch.Tensor],
    world: World,
    *,
    dtype: torch.dtype = torch.float32,
) -> dict[int, torch.Tensor]:
    """This rank's piece of every tensor it holds after the move, by tensor index.

    ``local`` maps the index of every tensor whose source piece this rank holds to that
    piece. One message per (sender, receiver) pair, whatever the number of tensors.
    """
    rank = world.rank
    ends = rank_ends(tensors, local, rank, dtype=dtype, device=world.device)
    old, new, out = ends.old, ends.new, ends.out
    exchange = Exchange(world)
    for tr in transfers:
        i = tr.tensor
        if tr.src == tr.dst == rank:
            out[i][local_box(new[i], tr.region)] = local[i][local_box(old[i], tr.region)]
        elif tr.src == rank:
            exchange.send(tr.dst, [local[i][local_box(old[i], tr.region)]])
        elif tr.dst == rank:
            exchange.recv(tr.src, [out[i][local_box(new[i], tr.region)]])
    with comm_span(world, "fused-bsr"):
        exchange.run()
    return out
