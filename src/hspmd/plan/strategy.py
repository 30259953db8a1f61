"""The compact strategy string, in the paper's notation (HSPMD Tables 9, 11, 12).

Pipelines are separated by ``;``. Each starts with ``COUNTxSIZE:`` (its number of
micro-batches and the micro-batch size), then its stages in order, each
``R<ranks>:L<first>-<last>``. The ranks of a stage form its tensor-parallel group, in
that order; ranks are written ``0-3``, ``0,2,5`` or mixed, ``0-3,8``. Layers are
inclusive. The embedding lives with layer 0's stage, the final norm and head with the
last layer's. The paper's C2 on 31 ranks::

    33x1: R0-3:L0-14 R4-7:L15-29 R8-11:L30-44 R12-15:L45-59; 31x1: R16-19:L0-15 R20-23:L16-31 R24-27:L32-47 R28-29:L48-55 R30:L56-59

    pipeline  micro-batches  stages (TP degree: layers)
    0         33 x 1         4:0-14  4:15-29  4:30-44  4:45-59
    1         31 x 1         4:0-15  4:16-31  4:32-47  2:48-55  1:56-59

Many pipelines that are one pipeline shifted by a rank offset are written once:
``1024*(4x1: R0-7:L0-39 R8-15:L40-79)`` is 1024 pipelines on 16,384 ranks, copy ``k`` on
ranks ``16k`` up (``hspmd.plan.repeat``; `` stride N`` after the parenthesis for another
shift).

``str(parse_strategy(text))`` is the canonical text: ``"; "`` between pipelines, one
space between stages, consecutive ascending ranks as ``a-b``, layers always ``a-b``, runs
of 8 or more shifted copies in the repeat form. ``parse_strategy`` also accepts ``L5`` for
one layer and any spacing, newlines included.

Context parallelism: a stage may end in ``:C<degree>`` (``R0-3:L0-7:C2``). Its ranks then
form TP x CP: groups of ``degree`` consecutive ranks split the sequence (the CP groups, CP
varying fastest), and the TP degree is the rank count over it (TP 2 x CP 2 above: CP
groups 0,1 and 2,3; TP groups 0,2 and 1,3). ``:C1`` is the default and is not written.

Recompute per stage: a stage may end in ``:RC<count>`` (``R0-7:L0-29:RC4``, after ``:C``
where both are written): its first ``count`` layers recompute their activations in
backward, whatever ``--recompute`` says (``:RC0``: none). A stage without it follows the
options (``--recompute``, ``--recompute-layers``). Planners write it where memory differs
between stages, so that only the stages that need it pay for it.

``check_strategy`` refuses what cannot work on a model and batch, before any process
starts, with a StrategyError that names the value and the fix.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from hspmd.errors import StrategyError
from hspmd.plan.repeat import expand, format_pipelines

if TYPE_CHECKING:
    from hspmd.models.spec import ModelSpec

__all__ = [
    "Pipeline",
    "Stage",
    "Strategy",
    "StrategyOptions",
    "check_strategy",
    "format_ranks",
    "parse_ranks",
    "parse_strategy",
    "uniform_recompute",
]

Schedule = Literal["1f1b", "gpipe"]
Dtype = Literal["fp32", "bf16"]


@dataclass(frozen=True, slots=True)
class Stage:
    """One pipeline stage: its ranks, its inclusive layer range and its context-parallel
    degree (the ranks are TP x CP, CP varying fastest; module docstring).

    >>> stage = parse_strategy("1x1: R0-3:L0-1:C2").pipelines[0].stages[0]
    >>> stage.tp, stage.cp, stage.cp_groups, stage.tp_groups
    (2, 2, ((0, 1), (2, 3)), ((0, 2), (1, 3)))
    """

    ranks: tuple[int, ...]
    first_layer: int
    last_layer: int
    cp: int = 1
    recompute: int | None = None  # its first layers that recompute (None: as the options say)

    @property
    def tp(self) -> int:
        """The tensor-parallel degree: the number of ranks over the CP degree."""
        return len(self.ranks) // self.cp

    @property
    def cp_groups(self) -> tuple[tuple[int, ...], ...]:
        """The ranks that split one sequence (consecutive ranks), one group per TP index."""
        c = self.cp
        return tuple(self.ranks[j * c : (j + 1) * c] for j in range(self.tp))

    @property
    def tp_groups(self) -> tuple[tuple[int, ...], ...]:
        """The ranks that split the weights (every ``cp``-th rank), one group per CP index."""
        return tuple(self.ranks[i :: self.cp] for i in range(self.cp))

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.last_layer + 1)

    def recomputed(self, options: StrategyOptions) -> int:
        """How many of its first layers recompute in backward: its own count, else the
        options'.

        >>> stage = parse_strategy("1x1: R0:L0-3:RC2").pipelines[0].stages[0]
        >>> stage.recomputed(StrategyOptions()), stage.recomputed(StrategyOptions(recompute=True))
        (2, 2)
        """
        if self.recompute is None:
            return options.recomputed(len(self.layers))
        return min(self.recompute, len(self.layers))

    def __str__(self) -> str:
        cp = f":C{self.cp}" if self.cp > 1 else ""
        rc = f":RC{self.recompute}" if self.recompute is not None else ""
        return f"R{format_ranks(self.ranks)}:L{self.first_layer}-{self.last_layer}{cp}{rc}"


@dataclass(frozen=True, slots=True)
class Pipeline:
    """Stages in order, run on ``num_micro_batches`` micro-batches of ``micro_batch_size``."""

    num_micro_batches: int
    micro_batch_size: int
    stages: tuple[Stage, ...]

    @property
    def batch_size(self) -> int:
        """Samples this pipeline processes per step: count x size."""
        return self.num_micro_batches * self.micro_batch_size

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(r for stage in self.stages for r in stage.ranks)

    def stage_of_layer(self, layer: int) -> Stage:
        """The stage that holds ``layer`` (assumes a checked strategy)."""
        for stage in self.stages:
            if stage.first_layer <= layer <= stage.last_layer:
                return stage
        raise StrategyError(f"no stage of pipeline {self} holds layer {layer}")

    def shifted(self, offset: int) -> Pipeline:
        """The same pipeline on ranks ``offset`` higher (the repeat form's copies)."""
        # built directly: dataclasses.replace costs 3x as much (65,536 copies in a repeat)
        stages = tuple(
            Stage(tuple(r + offset for r in st.ranks), st.first_layer, st.last_layer, st.cp,
                  st.recompute)
            for st in self.stages
        )  # fmt: skip
        return Pipeline(self.num_micro_batches, self.micro_batch_size, stages)

    def __str__(self) -> str:
        stages = " ".join(map(str, self.stages))
        return f"{self.num_micro_batches}x{self.micro_batch_size}: {stages}"


@dataclass(frozen=True, slots=True)
class Strategy:
    """Pipelines that run side by side; data parallel across pipelines.

    >>> s = parse_strategy("2x1: R0-1:L0-3; 1x2: R2:L0-1 R3:L2-3")
    >>> s.global_batch, s.ranks, [st.tp for st in s.pipelines[0].stages]
    (4, (0, 1, 2, 3), [2])
    >>> str(s)
    '2x1: R0-1:L0-3; 1x2: R2:L0-1 R3:L2-3'
    """

    pipelines: tuple[Pipeline, ...]

    @staticmethod
    def parse(text: str) -> Strategy:
        return parse_strategy(text)

    @staticmethod
    def uniform(
        *, dp: int, tp: int, pp: int, num_layers: int, num_micro_batches: int = 1,
        micro_batch_size: int = 1,
    ) -> Strategy:  # fmt: skip
        """The homogeneous DP x TP x PP strategy, ranks numbered pipeline-major, layers as
        even as possible (the first stages take the remainder).

        >>> str(Strategy.uniform(dp=2, tp=2, pp=2, num_layers=4))
        '1x1: R0-1:L0-1 R2-3:L2-3; 1x1: R4-5:L0-1 R6-7:L2-3'
        """
        if pp > num_layers:
            raise StrategyError(f"pp={pp} stages but only {num_layers} layers: use pp <= layers")
        bounds = [num_layers * s // pp for s in range(pp + 1)]
        counts = [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
        counts.sort(reverse=True)
        pipelines = []
        for d in range(dp):
            stages, layer = [], 0
            for s, count in enumerate(counts):
                base = (d * pp + s) * tp
                stages.append(Stage(tuple(range(base, base + tp)), layer, layer + count - 1))
                layer += count
            pipelines.append(Pipeline(num_micro_batches, micro_batch_size, tuple(stages)))
        return Strategy(tuple(pipelines))

    @property
    def ranks(self) -> tuple[int, ...]:
        """Every rank, sorted."""
        return tuple(sorted(r for p in self.pipelines for r in p.ranks))

    @property
    def num_ranks(self) -> int:
        return sum(len(p.ranks) for p in self.pipelines)

    @property
    def global_batch(self) -> int:
        return sum(p.batch_size for p in self.pipelines)

    def recomputed(self, options: StrategyOptions) -> tuple[tuple[int, ...], ...]:
        """Per pipeline, per stage: how many of its first layers recompute (``Stage.recomputed``).

        >>> parse_strategy("1x1: R0:L0-1:RC1 R1:L2-3; 1x1: R2:L0-3").recomputed(StrategyOptions())
        ((1, 0), (0,))
        """
        return tuple(tuple(st.recomputed(options) for st in p.stages) for p in self.pipelines)

    def stages(self) -> Iterator[tuple[int, int, Stage]]:
        """``(pipeline index, stage index, stage)`` for every stage."""
        for p, pipeline in enumerate(self.pipelines):
            for s, stage in enumerate(pipeline.stages):
                yield p, s, stage

    def __str__(self) -> str:
        return format_pipelines(self.pipelines)


@dataclass(frozen=True, slots=True, kw_only=True)
class StrategyOptions:
    """Switches that apply to every pipeline (CLI: ``--zero`` ``--zero-shares``
    ``--sequence-parallel`` ``--recompute`` ``--recompute-layers`` ``--schedule``
    ``--dtype``).

    ``zero``: what is sharded over the data-parallel replicas (the pipelines holding a
    parameter; docs/zero.md): 0 nothing, 1 fp32 masters and Adam states (ZeRO-1), 2 also
    the gradients, 3 also the parameters between uses. ``zero_shares``: one weight per
    pipeline, the replicas' parts of those shards in proportion (``()``: even).

    >>> o = StrategyOptions(zero=3, zero_shares=(3, 1))
    >>> o.zero1, str(o)
    (True, 'zero3 zero_shares=3,1 schedule=1f1b dtype=fp32')
    """

    zero: int = 0  # ZeRO stage: 0, 1 (states), 2 (+ gradients), 3 (+ parameters)
    zero_shares: tuple[float, ...] = ()  # per pipeline: its part of the shards (even if empty)
    sequence_parallel: bool = False  # split the residual stream's seq dim inside a stage
    recompute: bool = False  # recompute each layer's activations in backward
    recompute_layers: int = 0  # with recompute: only the first k layers of a stage (0: all)
    schedule: Schedule = "1f1b"  # pipeline schedule
    dtype: Dtype = "fp32"  # compute dtype; bf16 keeps fp32 masters

    def recomputed(self, num_layers: int) -> int:
        """How many of a stage's ``num_layers`` layers recompute in backward (its first
        ones): none without ``recompute``, else ``recompute_layers`` (every one if 0).

        >>> StrategyOptions(recompute=True, recompute_layers=2).recomputed(5)
        2
        """
        if not self.recompute:
            return 0
        return min(self.recompute_layers, num_layers) if self.recompute_layers else num_layers

    @property
    def zero1(self) -> bool:
        """Whether the optimizer states are sharded (ZeRO 1, 2 or 3)."""
        return self.zero >= 1

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StrategyOptions:
        """Options from their JSON form (``dataclasses.asdict``), files written before the
        ZeRO stages too (``"zero1": true`` is ``"zero": 1``); TypeError for unknown keys.

        >>> StrategyOptions.from_dict({"zero1": True, "dtype": "bf16"}).zero
        1
        """
        fields = dict(data)
        legacy = fields.pop("zero1", None)
        if legacy and not fields.get("zero"):
            fields["zero"] = 1
        if "zero_shares" in fields:
            fields["zero_shares"] = tuple(fields["zero_shares"])
        return cls(**fields)

    def __post_init__(self) -> None:
        if self.zero not in (0, 1, 2, 3):
            raise StrategyError(f"zero={self.zero!r}: choose a ZeRO stage 0, 1, 2 or 3")
        shares = tuple(float(w) for w in self.zero_shares)
        object.__setattr__(self, "zero_shares", shares)  # a list from JSON: a tuple
        if shares and (self.zero == 0 or not all(w > 0 for w in shares)):
            raise StrategyError(
                f"zero_shares={','.join(_weight(w) for w in shares)}: give positive weights, "
                "one per pipeline, with a ZeRO stage (--zero 1|2|3)"
            )
        if self.recompute_layers < 0:
            raise StrategyError(
                f"recompute_layers={self.recompute_layers}: give 0 (every layer) or more"
            )
        if self.schedule not in ("1f1b", "gpipe"):
            raise StrategyError(f"unknown schedule {self.schedule!r}: use 1f1b or gpipe")
        if self.dtype not in ("fp32", "bf16"):
            raise StrategyError(f"unknown dtype {self.dtype!r}: use fp32 or bf16")

    def __str__(self) -> str:
        flags = [f"zero{self.zero}"] if self.zero else []
        if self.zero_shares:
            flags.append(f"zero_shares={','.join(_weight(w) for w in self.zero_shares)}")
        flags += [name for name in ("sequence_parallel", "recompute") if getattr(self, name)]
        if self.recompute and self.recompute_layers:
            flags.append(f"recompute_layers={self.recompute_layers}")
        return " ".join([*flags, f"schedule={self.schedule}", f"dtype={self.dtype}"])


def _weight(w: float) -> str:
    """``3.0`` -> ``3``, ``1.5`` -> ``1.5``."""
    return str(int(w)) if float(w).is_integer() else str(w)


def uniform_recompute(
    strategy: Strategy, options: StrategyOptions
) -> tuple[Strategy, StrategyOptions]:
    """``strategy`` and ``options`` recomputing as before, in the plainest form: where every
    stage recomputes alike (its first ``k`` layers, or all of them) the options say so and
    no stage carries ``:RC``; where stages differ, every stage carries its count (``:RC0``
    on those that keep everything) and the options say recompute, so that a reader of the
    options alone errs towards less memory.

    >>> s = parse_strategy("1x1: R0:L0-1:RC2 R1:L2-3:RC2")
    >>> [str(x) for x in uniform_recompute(s, StrategyOptions())[0].pipelines]
    ['1x1: R0:L0-1 R1:L2-3']
    >>> t, o = uniform_recompute(parse_strategy("1x1: R0:L0-1:RC1 R1:L2-3"), StrategyOptions())
    >>> str(t), o.recompute
    ('1x1: R0:L0-1:RC1 R1:L2-3:RC0', True)
    """
    stages = [st for _, _, st in strategy.stages()]
    counts = [st.recomputed(options) for st in stages]
    top = max(counts, default=0)
    alike = all(k == min(top, len(st.layers)) for k, st in zip(counts, stages, strict=True))
    if not alike:  # stages differ: each says its own
        out = dataclasses.replace(options, recompute=True, recompute_layers=0)
        return _with_counts(strategy, lambda st: st.recomputed(options)), out
    if top:
        whole = top >= max(len(st.layers) for st in stages)
        out = dataclasses.replace(options, recompute=True, recompute_layers=0 if whole else top)
    else:
        out = dataclasses.replace(options, recompute=False, recompute_layers=0)
    return _with_counts(strategy, lambda st: None), out


def _with_counts(strategy: Strategy, count: Callable[[Stage], int | None]) -> Strategy:
    return Strategy(tuple(
        dataclasses.replace(p, stages=tuple(dataclasses.replace(st, recompute=count(st)) for st in p.stages))
        for p in strategy.pipelines
    ))  # fmt: skip


# -- ranks -----------------------------------------------------------------------------------


def format_ranks(ranks: Sequence[int]) -> str:
    """``(0, 1, 2, 3, 8)`` -> ``'0-3,8'``; only ascending runs of 2 or more use ``-``."""
    parts: list[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(f"{ranks[i]}-{ranks[j]}" if j > i else str(ranks[i]))
        i = j + 1
    return ",".join(parts)


def parse_ranks(text: str) -> tuple[int, ...]:
    """``'0-3,8'`` -> ``(0, 1, 2, 3, 8)``; order is kept (it is the device order)."""
    ranks: list[int] = []
    for item in text.split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", item.strip())
        if not match:
            raise StrategyError(f"bad ranks {text!r}: expected e.g. 0-3, 0,2,5 or 0-3,8")
        first = int(match.group(1))
        last = first if match.group(2) is None else int(match.group(2))
        if last < first:
            raise StrategyError(f"bad rank range {item!r} in {text!r}: write it low-high")
        ranks.extend(range(first, last + 1))
    if len(set(ranks)) != len(ranks):
        raise StrategyError(f"a rank is listed twice in R{text}: list each rank once")
    return tuple(ranks)


# -- parsing ---------------------------------------------------------------------------------

_HEAD = re.compile(r"\s*(\d+)\s*x\s*(\d+)\s*:")
_STAGE = re.compile(r"R([0-9,\-]+):L(\d+)(?:-(\d+))?(?::C(\d+))?(?::RC(\d+))?")
_REPEAT = re.compile(r"\s*(\d+)\s*\*\s*\(")  # COUNT*( opens the repeat form (plan.repeat)
_STRIDE = re.compile(r"\s*(?:stride\s*(\d+))?\s*")  # what may follow its ')'
_EXAMPLE = "e.g. '4x2: R0-3:L0-11 R4-7:L12-23; 8x1: R8,9:L0-23'"
_SHOWN = 120  # an error quotes at most this much of a line of the text


def _syntax_error(text: str, column: int, what: str, *, hint: str = "") -> StrategyError:
    """``what`` at offset ``column`` of ``text``, its line quoted (a window of it where it is
    long: a strategy read from a file may be megabytes) with a pointer under the column."""
    start = text.rfind("\n", 0, column) + 1
    end = len(text) if (found := text.find("\n", column)) < 0 else found
    line, col = text[start:end], column - start
    where = f"column {col}" if "\n" not in text else f"line {text.count(chr(10), 0, start) + 1}, column {col}"  # fmt: skip
    if len(line) > _SHOWN:
        low = max(0, min(col - _SHOWN // 2, len(line) - _SHOWN))
        left = "..." if low else ""
        right = "..." if low + _SHOWN < len(line) else ""
        line, col = f"{left}{line[low : low + _SHOWN]}{right}", col - low + len(left)
    pointer = " " * col + "^"
    last = f"{hint}; {_EXAMPLE}" if hint else _EXAMPLE
    return StrategyError(f"{what} at {where}:\n  {line}\n  {pointer}\n{last}")


def parse_strategy(text: str) -> Strategy:
    """Parse the strategy string (module docstring; ``COUNT*(PIPELINE)``: ``plan.repeat``);
    syntax only, see ``check_strategy``."""
    if not text.strip():
        raise StrategyError(f"empty strategy: give at least one pipeline, {_EXAMPLE}")
    pipelines: list[Pipeline] = []
    offset = 0
    for part in text.split(";"):
        pipelines.extend(_parse_part(text, part, offset))
        offset += len(part) + 1
    return Strategy(tuple(pipelines))


def _parse_part(text: str, part: str, offset: int) -> list[Pipeline]:
    """One ``;``-separated part at ``offset``: a pipeline, or ``COUNT*(PIPELINE) [stride N]``."""
    repeat = _REPEAT.match(part)
    if not repeat:
        return [_parse_pipeline(text, part, offset)]
    count, close = int(repeat.group(1)), part.rfind(")")
    if count < 1:
        raise _syntax_error(text, offset + repeat.start(1), f"repeat count {count}",
                            hint="give at least 1 copy, or drop the pipeline")  # fmt: skip
    if close < 0:
        raise _syntax_error(text, offset + repeat.end() - 1, "repeat without its ')'",
                            hint="write COUNT*(PIPELINE), one pipeline in parentheses")  # fmt: skip
    inner, tail = part[repeat.end() : close], part[close + 1 :]
    if not inner.strip():
        raise _syntax_error(text, offset + repeat.end(), "empty repeat",
                            hint="write COUNT*(PIPELINE), one pipeline in parentheses")  # fmt: skip
    stride = _STRIDE.fullmatch(tail)
    if stride is None:
        column = offset + close + 1 + len(tail) - len(tail.lstrip())
        raise _syntax_error(text, column, f"found {tail.split()[0]!r} after a repeat", hint="a "
                            "repeat may end in ' stride N'; separate pipelines with ';'")  # fmt: skip
    pipeline = _parse_pipeline(text, inner, offset + repeat.end())
    step = len(pipeline.ranks) if stride.group(1) is None else int(stride.group(1))
    if step < 1:
        raise _syntax_error(text, offset + close + 1 + stride.start(1), "stride 0 puts every "
                            "copy on the same ranks", hint="give a stride of at least 1")  # fmt: skip
    return expand(pipeline, count, step)


def _parse_pipeline(text: str, part: str, offset: int) -> Pipeline:
    head = _HEAD.match(part)
    if not head:
        column = offset + len(part) - len(part.lstrip())
        if not part.strip():
            raise _syntax_error(text, column, "empty pipeline (two ';' or a trailing ';')")
        token = part.split()[0]
        raise _syntax_error(
            text, column, f"found {token!r} where a pipeline starts with COUNTxSIZE: (e.g. 33x1:)",
            hint=_head_hint(part),
        )  # fmt: skip
    count, size = int(head.group(1)), int(head.group(2))
    if count < 1 or size < 1:
        column = offset + len(part) - len(part.lstrip())
        raise _syntax_error(text, column, f"pipeline {count}x{size}: runs {count} micro-batches "
                            f"of {size}", hint="both numbers must be at least 1")  # fmt: skip
    stages = []
    for found in re.finditer(r"\S+", part[head.end() :]):
        column = offset + head.end() + found.start()
        match = _STAGE.fullmatch(found.group())
        if not match:
            raise _syntax_error(
                text,
                column,
                f"bad stage {found.group()!r}, expected "
                "R<ranks>:L<first>-<last>[:C<cp>][:RC<recomputed layers>]",
                hint=_stage_hint(found.group(), part[head.end() + found.start() :]),
            )
        try:
            ranks = parse_ranks(match.group(1))
        except StrategyError as error:
            raise _syntax_error(text, column, str(error)) from None
        first = int(match.group(2))
        last = first if match.group(3) is None else int(match.group(3))
        cp = 1 if match.group(4) is None else int(match.group(4))
        if cp < 1 or len(ranks) % cp:
            raise _syntax_error(
                text, column, f"stage {found.group()!r} has {len(ranks)} ranks, which CP degree "
                f"{cp} does not divide", hint="the ranks of a stage are TP x CP: use a CP "
                f"degree that divides {len(ranks)}, or list TP x CP ranks",
            )  # fmt: skip
        recompute = None if match.group(5) is None else int(match.group(5))
        if recompute is not None and last >= first and recompute > last - first + 1:
            raise _syntax_error(
                text, column, f"stage {found.group()!r} recomputes {recompute} layers but holds "
                f"{last - first + 1}", hint=f"write :RC{last - first + 1} (all) or fewer",
            )  # fmt: skip
        stages.append(Stage(ranks, first, last, cp, recompute))
    if not stages:
        raise _syntax_error(text, offset + head.end(), "pipeline without stages")
    return Pipeline(count, size, tuple(stages))


def _head_hint(part: str) -> str:
    """A likely fix for a pipeline that does not start with ``COUNTxSIZE:``."""
    if re.match(r"\s*\d+\s*[xX]\s*\(", part):
        return "write a repeat as COUNT*(PIPELINE), with '*'"
    if re.match(r"\s*\d+\s*\*", part):
        return "put the repeated pipeline in parentheses: COUNT*(PIPELINE)"
    if part.lstrip().startswith("("):
        return "a repeat starts with its count: COUNT*(PIPELINE)"
    return ""


def _stage_hint(token: str, rest: str) -> str:
    """A likely fix for a bad stage token (``rest``: the pipeline text from the token on)."""
    if re.search(r",\s*\d+\s*x\s*\d+\s*:", rest):
        return "separate pipelines with ';', not ','"
    if _STAGE.fullmatch(token.replace("r", "R").replace("l", "L")):
        return f"write R and L in capitals: {token.replace('r', 'R').replace('l', 'L')!r}"
    return ""


# -- checking against a model and a batch ----------------------------------------------------


def check_strategy(
    strategy: Strategy,
    config: ModelSpec,
    *,
    global_batch: int | None = None,
    options: StrategyOptions | None = None,
    seq_len: int | None = None,
    world_size: int | None = None,
) -> None:
    """Raise StrategyError unless ``strategy`` can train ``config``.

    Checks: at least one pipeline, each with micro-batches and stages; no rank in two
    stages; ranks below ``world_size``; in each pipeline the stages cover layers
    0..num_layers-1 in order without gap or overlap; each stage's TP degree divides the
    heads, kv heads and FFN size, and the vocabulary on the stages holding the embedding
    or head; tied embeddings share one stage; the micro-batches add up to
    ``global_batch``; ``zero_shares`` has one weight per pipeline; under sequence
    parallelism the TP degree divides ``seq_len``. A stage
    of CP degree c > 1 needs the model's attention-head markers (placement ``heads``) on
    its layers, each head count divisible by TP x CP (the all-to-all splits heads over
    both) and c dividing ``seq_len``; sequence parallelism applies to the other stages
    only (``hspmd.plan.schema.residual_dim``).
    """
    options = options or StrategyOptions()
    if not strategy.pipelines:
        raise StrategyError(f"strategy has no pipelines: {_EXAMPLE}")
    _check_ranks(strategy, world_size)
    for p, pipeline in enumerate(strategy.pipelines):
        _check_pipeline(p, pipeline, config, options=options, seq_len=seq_len)
    shares = options.zero_shares
    if shares and len(shares) != len(strategy.pipelines):
        raise StrategyError(
            f"zero_shares has {len(shares)} weights for {len(strategy.pipelines)} pipelines: "
            "give one weight per pipeline, e.g. --zero-shares "
            + ",".join(["1"] * len(strategy.pipelines))
        )
    if global_batch is not None and strategy.global_batch != global_batch:
        sums = " + ".join(f"{p.num_micro_batches}x{p.micro_batch_size}" for p in strategy.pipelines)
        raise StrategyError(
            f"the pipelines process {sums} = {strategy.global_batch} samples per step, but the "
            f"global batch is {global_batch}: change the micro-batch counts or the global batch"
        )


def _check_pipeline(
    p: int, pipeline: Pipeline, config: ModelSpec, *, options: StrategyOptions, seq_len: int | None
) -> None:
    """Pipeline ``p``'s micro-batches, layers, and each stage's TP, SP and CP."""
    if pipeline.num_micro_batches < 1 or pipeline.micro_batch_size < 1:
        raise StrategyError(
            f"pipeline {p} ({pipeline}) has {pipeline.num_micro_batches}x"
            f"{pipeline.micro_batch_size} micro-batches: both numbers must be at least 1"
        )
    _check_layers(p, pipeline, config)
    for s, stage in enumerate(pipeline.stages):
        _check_tp(p, s, stage, config)
        sp = options.sequence_parallel and stage.cp == 1  # CP stages: no SP
        if sp and seq_len is not None and seq_len % stage.tp:
            raise StrategyError(
                f"sequence parallel splits seq_len={seq_len} over the {stage.tp} ranks of "
                f"stage {stage} (pipeline {p}), which does not divide: change seq_len or TP"
            )
        if stage.cp > 1:
            _check_cp(p, stage, config, seq_len)
    if config.tie_embeddings and len(pipeline.stages) > 1 and not config.tied:
        raise StrategyError(
            f"tied embeddings need layer 0 and layer {config.num_layers - 1} on one stage, "
            f"but pipeline {p} ({pipeline}) has {len(pipeline.stages)} stages: "
            "put each pipeline on one stage, or untie the weights in the model "
            "(a preset: --config '{\"tie_embeddings\": false}')"
        )


def _check_ranks(strategy: Strategy, world_size: int | None) -> None:
    owner: dict[int, Stage] = {}
    for p, s, stage in strategy.stages():
        for rank in stage.ranks:
            if rank in owner:
                raise StrategyError(
                    f"rank {rank} is in two stages, {owner[rank]} and {stage} (pipeline {p}, "
                    f"stage {s}): each rank runs exactly one stage"
                )
            if world_size is not None and rank >= world_size:
                raise StrategyError(
                    f"rank {rank} in stage {stage} does not exist with {world_size} processes: "
                    f"use ranks 0-{world_size - 1} or more processes"
                )
            owner[rank] = stage


def _check_layers(p: int, pipeline: Pipeline, config: ModelSpec) -> None:
    num_layers, expected = config.num_layers, 0
    for index, stage in enumerate(pipeline.stages):
        if stage.last_layer < stage.first_layer:
            raise StrategyError(
                f"stage {stage} of pipeline {p} ends before it starts: write L<first>-<last>"
            )
        if stage.last_layer >= num_layers:
            raise StrategyError(
                f"stage {stage} of pipeline {p} holds layers up to {stage.last_layer}, but the "
                f"model has {num_layers} layers (0-{num_layers - 1}): end the last stage at "
                f"L{num_layers - 1}"
            )
        if stage.first_layer > expected:
            raise StrategyError(
                f"pipeline {p} has a gap before stage {stage}: no stage holds layer {expected}, "
                f"so it should start at layer {expected} (stages cover layers 0-{num_layers - 1} in order, "
                "each layer once)"
            )
        if stage.first_layer < expected:
            raise StrategyError(_overlap(p, pipeline, index, num_layers))
        expected = stage.last_layer + 1
    if expected != num_layers:
        raise StrategyError(
            f"pipeline {p} ({pipeline}) stops at layer {expected - 1}, but the model has "
            f"{num_layers} layers: the last stage must end at L{num_layers - 1}"
        )


def _overlap(p: int, pipeline: Pipeline, index: int, num_layers: int) -> str:
    """The message for stage ``index`` starting at a layer an earlier stage holds."""
    stage = pipeline.stages[index]
    layer = stage.first_layer
    owner = next(i for i, st in enumerate(pipeline.stages[:index]) if layer in st.layers)
    held = pipeline.stages[owner]
    message = (
        f"pipeline {p} has an overlap at stage {stage}: layer {layer} is already held by "
        f"stage {owner} ({held}); "
    )
    after = pipeline.stages[index - 1].last_layer + 1
    if after >= num_layers:
        return message + (
            f"the stages before it already hold every layer 0-{num_layers - 1}: drop {stage} "
            f"or end stage {index - 1} sooner (each layer on one stage)"
        )
    return message + f"start it at layer {after} (each layer on one stage, in order)"


def _check_tp(p: int, s: int, stage: Stage, config: ModelSpec) -> None:
    sizes = config.tp_sizes(stage.first_layer, stage.last_layer)
    if stage.tp > 1 and not sizes:
        raise StrategyError(
            f"stage {stage} (pipeline {p}) has TP degree {stage.tp}, but {config.name} splits "
            f"none of the parameters of layers {stage.first_layer}-{stage.last_layer}: every "
            "rank would repeat the same work; give the model TP rules (docs/models.md) or "
            "use TP 1 there"
        )
    for name, size in sizes.items():
        if size % stage.tp:
            valid = [d for d in range(1, stage.tp + 1) if all(n % d == 0 for n in sizes.values())]
            raise StrategyError(
                f"stage {stage} (pipeline {p}) has TP degree {stage.tp}, which does not divide "
                f"{name}={size}: use a TP degree that divides it (up to {stage.tp}: "
                f"{', '.join(map(str, valid))})"
            )


_HEADS = ("heads", "cp_heads")  # hspmd.models.spec.HEADS (plan imports no model at run time)


def _check_cp(p: int, stage: Stage, config: ModelSpec, seq_len: int | None) -> None:
    """A context-parallel stage (``check_strategy``)."""
    where = f"stage {stage} (pipeline {p}) has CP degree {stage.cp}"
    if seq_len is not None and seq_len % stage.cp:
        raise StrategyError(
            f"{where}, which does not divide seq_len={seq_len}: use a length that is a "
            f"multiple of {stage.cp}"
        )
    heads = [m for m in config.markers() if m.placement in _HEADS and m.layer in stage.layers]
    if not heads:
        raise StrategyError(
            f"{where}, but {config.name} has no attention-head markers on those layers to "
            "split the heads over (hspmd marks F.scaled_dot_product_attention on q, k, v of "
            "shape (B, heads, T, head_dim); docs/models.md): use :C1 there"
        )
    for marker in heads:
        count = marker.trailing[0]
        tp = stage.tp if marker.placement == "heads" else 1  # cp_heads: TP keeps them whole
        if count % (tp * stage.cp):
            over = f"TP x CP = {tp}x{stage.cp}" if tp > 1 else "CP"
            raise StrategyError(
                f"{where}: the all-to-all splits the {count} heads of marker {marker.name} "
                f"over {over} = {tp * stage.cp} ranks, which does not divide: use {over[:7]} "
                f"dividing {count}"
            )
