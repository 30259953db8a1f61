"""The repeat form of the strategy string: many pipelines that are one pipeline shifted by a
rank offset, written once with a count (docs/strategy.md "Repeats").

``COUNT*(PIPELINE)`` stands for ``COUNT`` copies of ``PIPELINE``, copy ``k`` on the ranks of
``PIPELINE`` plus ``k x stride``; the stride is the pipeline's rank count unless
``stride N`` follows the parenthesis (copies that interleave, e.g. TP inside a node and
stages across nodes)::

    text                                          pipelines (ranks of each)
    3*(4x1: R0-1:L0-3 R2-3:L4-7)                  R0-1 R2-3 | R4-5 R6-7 | R8-9 R10-11
    3*(4x1: R0-1:L0-3 R8-9:L4-7) stride 2         R0-1 R8-9 | R2-3 R10-11 | R4-5 R12-13

``str(strategy)`` writes every run of at least ``REPEAT_AT`` consecutive pipelines that are
the same up to one positive shift in this form (stride omitted where it is the rank count)
and shorter runs in full, so that the paper's strategies (a few pipelines each) read as its
tables print them and 65,536 ranks print in one line.

>>> from hspmd.plan.strategy import parse_strategy
>>> s = parse_strategy("8*(2x1: R0:L0-1 R1:L2-3); 1x1: R16-17:L0-3")
>>> len(s.pipelines), str(s.pipelines[7]), str(s)
(9, '2x1: R14:L0-1 R15:L2-3', '8*(2x1: R0:L0-1 R1:L2-3); 1x1: R16-17:L0-3')
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hspmd.plan.strategy import Pipeline

__all__ = ["REPEAT_AT", "expand", "format_pipelines", "repeat_runs"]

# str() writes runs of at least this many copies as COUNT*(...): the paper's tables list up
# to 4 pipelines in full, and tests and docs compare such strings
REPEAT_AT = 8


def expand(pipeline: Pipeline, count: int, stride: int) -> list[Pipeline]:
    """``count`` copies of ``pipeline``, copy ``k`` shifted by ``k * stride`` ranks."""
    return [pipeline.shifted(k * stride) for k in range(count)]


def repeat_runs(pipelines: Sequence[Pipeline]) -> Iterator[tuple[Pipeline, int, int]]:
    """``(first pipeline, count, stride)`` per run of consecutive pipelines, each the one
    before it shifted by ``stride`` ranks (``stride >= 1``); a run shorter than
    ``REPEAT_AT`` comes as runs of one (stride: the pipeline's rank count), so that a long
    run starting inside it is found.

    >>> from hspmd.plan.strategy import parse_strategy
    >>> [(c, d) for _, c, d in repeat_runs(parse_strategy("9*(1x1: R0-1:L0-3) stride 4").pipelines)]
    [(9, 4)]
    """
    i = 0
    while i < len(pipelines):
        first, count, stride = pipelines[i], 1, len(pipelines[i].ranks)
        if i + 1 < len(pipelines) and first.ranks and pipelines[i + 1].ranks:
            shift = pipelines[i + 1].ranks[0] - first.ranks[0]
            while (
                shift >= 1
                and i + count < len(pipelines)
                and pipelines[i + count] == pipelines[i + count - 1].shifted(shift)
            ):
                count += 1
            if count >= REPEAT_AT:
                stride = shift
            else:
                count = 1
        yield first, count, stride
        i += count


def format_pipelines(pipelines: Sequence[Pipeline]) -> str:
    """The canonical text of ``pipelines``: ``"; "`` between them, runs of ``REPEAT_AT`` or
    more as ``COUNT*(PIPELINE)`` (with `` stride N`` where N is not its rank count)."""
    parts = []
    for first, count, stride in repeat_runs(pipelines):
        if count == 1:
            parts.append(str(first))
            continue
        tail = "" if stride == len(first.ranks) else f" stride {stride}"
        parts.append(f"{count}*({first}){tail}")
    return "; ".join(parts)
