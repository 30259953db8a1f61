"""Packing without processes: rows hold their documents in order, padding is ignored and
its own segment, weights sum to one; the docstring examples of the new modules."""

from __future__ import annotations

import doctest
from types import ModuleType

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hspmd.attention
import hspmd.comm.sizing
import hspmd.data
import hspmd.train.packing
from hspmd.data import DocumentStep
from hspmd.plan.dispatch import DispatchError, balanced
from hspmd.plan.strategy import parse_strategy
from hspmd.train.api import train_config
from hspmd.train.packing import IGNORE, pack, safe_step_tokens


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


@given(
    lengths=st.lists(st.integers(1, 48), min_size=1, max_size=40),
    slots=st.lists(st.tuples(st.integers(1, 3), st.integers(1, 2)), min_size=1, max_size=3),
)
@settings(max_examples=300, deadline=None)
def test_steps_within_the_safe_bound_always_pack(
    lengths: list[int], slots: list[tuple[int, int]]
) -> None:
    """``safe_step_tokens``: whole documents of any lengths up to that many tokens pack
    (at least one document per micro-batch, as ``document_steps`` guarantees)."""
    strategy = parse_strategy("; ".join(f"{m}x{r}: R{p}:L0-1" for p, (m, r) in enumerate(slots)))
    bound = safe_step_tokens(strategy, 48)
    kept: list[int] = []
    for n in lengths:  # a step: documents while they fit the bound
        if sum(kept) + n > bound:
            break
        kept.append(n)
    if len(kept) < sum(m for m, _ in slots):
        return  # too few documents for every micro-batch: document_steps would take more
    balanced(kept, slots=slots, max_len=48)


def test_half_a_row_plus_one_is_the_bound() -> None:
    strategy = parse_strategy("2x1: R0:L0-1; 1x2: R1:L0-1")  # 4 rows
    assert safe_step_tokens(strategy, 48) == 4 * 25
    with pytest.raises(DispatchError, match="fits no row"):  # a fifth document of 25
        balanced([25] * 5, slots=[(2, 1), (1, 2)], max_len=48)


def test_packed_documents_refuse_a_model_that_drops() -> None:
    """Dropout masks are keyed by the row of the step's batch (DESIGN decision 17): packed
    rows have none, so packing a model that drops is one line before launch."""
    from pathlib import Path

    from hspmd.train.config import TrainError
    from hspmd.train.packing import check_packed_dropout

    nanogpt = f"{Path(__file__).parents[1] / 'models' / 'data' / 'nanogpt_style.py'}:make"
    config = train_config(model=nanogpt, model_kwargs=(("dropout", 0.1),), step_tokens=64,
                         seq_len=16, strategy="2x1: R0:L0-2")  # fmt: skip
    with pytest.raises(TrainError, match=r"drops \(10 dropout ops, the first dropout in "):
        check_packed_dropout(config)
    check_packed_dropout(train_config(model=nanogpt, step_tokens=64, seq_len=16))  # p = 0
