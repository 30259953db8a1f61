"""Packing without processes: rows hold their documents in order, padding is ignored and
its own segment, weights sum to one; the docstring examples of the new modules."""

from __future__ import annotations

import doctest
from types import ModuleType

import pytest
import torch

import hspmd.attention
import hspmd.comm.sizing
import hspmd.data
import hspmd.train.packing
from hspmd.data import DocumentStep
from hspmd.plan.dispatch import balanced
from hspmd.train.packing import IGNORE, pack


def test_rows_hold_their_documents_and_padding_is_ignored() -> None:
    docs = tuple(torch.arange(100 * i, 100 * i + n + 1) for i, n in enumerate((7, 3, 5, 2, 6)))
    step = DocumentStep(docs, truncated=1)
    assignment = balanced(step.lengths, slots=[(2, 2), (1, 1)], max_len=12, multiple=4)
    packed = pack(step, assignment)
    assert packed.tokens == sum(step.lengths) == 23 and packed.truncated == 1
    weights = [packed.scale(p, m) for p, pipe in enumerate(packed.micro_batches)
               for m in range(len(pipe))]  # fmt: skip
    assert sum(weights) == pytest.approx(1.0)
    for (p, m, r), doc in zip(assignment.slots, docs, strict=True):
        mb = packed.micro_batches[p][m]
        assert mb.tokens.shape == (assignment.rows[p], assignment.lengths[p][m])
        assert mb.tokens.shape[1] % 4 == 0
        row_tokens = mb.tokens[r][mb.targets[r] != IGNORE].tolist()
        assert all(t in row_tokens for t in doc[:-1].tolist())  # the whole document, in its row
    for pipe in packed.micro_batches:
        for mb in pipe:
            pad = mb.targets == IGNORE
            assert int((~pad).sum()) == mb.real_tokens
            for row in range(mb.tokens.shape[0]):  # padding: one segment after the documents
                ids = mb.segments[row][pad[row]]
                assert ids.numel() == 0 or (ids == ids[0]).all()
                if ids.numel() and (~pad[row]).any():
                    assert int(ids[0]) > int(mb.segments[row][~pad[row]].max())


@pytest.mark.parametrize(
    "module",
    [hspmd.attention, hspmd.comm.sizing, hspmd.data, hspmd.train.packing],
    ids=lambda m: m.__name__,
)
def test_doctests(module: ModuleType) -> None:
    assert doctest.testmod(module).failed == 0
