"""The metadata verbs of the public API: values in, values out, no processes.

Each is a thin typed wrapper over what the CLI command of the same name runs: ``resolve``
(``hspmd.comm.resolve``), ``explain`` (``hspmd.specialize.explain``), ``simulate``
(``hspmd.planner.predict``) and ``plan_strategy`` (``hspmd plan``: ``hspmd.planner.search``;
not ``hspmd.plan``, which names the package of plans until it is renamed). Text is parsed here,
at the edge; the functions below take values. ``model`` is anything ``hspmd.fit`` takes,
or a ``ModelSpec`` already read (``model_spec``).

>>> print(resolve("[0,1]{P:2}", "[0,1]{0:2}", (4, 8)).kinds)
('reduce-scatter',)
>>> model_spec("llama-tiny", num_layers=2).num_layers
2
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from hspmd.annotation import Annotation, parse_annotation
from hspmd.comm.plan import CommPlan
from hspmd.comm.resolve import resolve as _resolve
from hspmd.cost.cluster import load_cluster
from hspmd.cost.lines import CostModel
from hspmd.models import get_model
from hspmd.models.config import LlamaConfig
from hspmd.models.spec import ModelSpec, ModelSpecError
from hspmd.plan.strategy import Strategy, StrategyOptions, check_strategy, parse_strategy
from hspmd.planner.predict import Prediction, predict
from hspmd.planner.search import Plan, Zero1
from hspmd.planner.search import plan as _plan
from hspmd.specialize.explain import Explanation
from hspmd.specialize.explain import explain as _explain
from hspmd.train.api import model_source

__all__ = ["explain", "model_spec", "plan_strategy", "resolve", "simulate"]

ModelLike = str | Callable[..., Any] | ModelSpec
"""A preset name, ``FILE.py:FUNCTION``, a module-level factory, or a ``ModelSpec``."""


def model_spec(model: ModelLike = "llama-tiny", **kwargs: Any) -> ModelSpec:
    """``model`` as metadata (its parameters' names, shapes, layers; nothing allocated);
    ``kwargs``: the factory's keyword arguments, or a preset's fields to override."""
    if isinstance(model, str):
        return get_model(model, **kwargs)
    if hasattr(model, "parameter_shapes"):  # a ModelSpec (a protocol: no isinstance)
        return model  # type: ignore[return-value]
    return get_model(model_source(model), **kwargs)


def _strategy(strategy: Strategy | str) -> Strategy:
    return strategy if isinstance(strategy, Strategy) else parse_strategy(strategy)


def _length(spec: ModelSpec, seq_len: int | None) -> int:
    """``seq_len``, else the model's longest; one the model cannot run (past its positions)
    is refused, as training refuses it."""
    if seq_len is not None and seq_len > spec.max_seq_len:
        raise ModelSpecError(
            f"seq_len={seq_len} exceeds {spec.name}'s max_seq_len={spec.max_seq_len} (its "
            f"longest position): give seq_len={spec.max_seq_len} or less, or a model with "
            "more positions"
        )
    return seq_len or spec.max_seq_len


def resolve(src: Annotation | str, dst: Annotation | str, shape: Sequence[int]) -> CommPlan:
    """The per-rank communication plan taking a tensor of ``shape`` from ``src`` to ``dst``
    (annotations or their text forms, docs/notation.md)."""
    a = src if isinstance(src, Annotation) else parse_annotation(src)
    b = dst if isinstance(dst, Annotation) else parse_annotation(dst)
    return _resolve(a, b, shape)


def explain(
    model: ModelLike, strategy: Strategy | str, *, seq_len: int | None = None,
    options: StrategyOptions | None = None, ranks: Sequence[int] | None = None,
    model_kwargs: Mapping[str, Any] | None = None,
) -> Explanation:  # fmt: skip
    """What every rank (or ``ranks``) runs under ``strategy``: pipelines, stages, the
    communication of each phase (``hspmd explain``; ``render(...)`` prints it).
    ``seq_len`` defaults to the model's maximum."""
    spec = model_spec(model, **(model_kwargs or {}))
    chosen, options = _strategy(strategy), options or StrategyOptions()
    length = _length(spec, seq_len)
    check_strategy(chosen, spec, options=options, seq_len=length)
    return _explain(spec, chosen, options, seq_len=length, ranks=ranks)


def _costed(spec: ModelSpec) -> ModelSpec:
    """A preset as it is; any other model with its cost measured on the meta device."""
    if isinstance(spec, LlamaConfig):
        return spec
    from hspmd.cost.captured import planning_model

    return planning_model(spec)


def simulate(
    model: ModelLike, strategy: Strategy | str, *, cluster: str, seq_len: int | None = None,
    options: StrategyOptions | None = None, global_batch: int | None = None,
    model_kwargs: Mapping[str, Any] | None = None,
) -> Prediction:  # fmt: skip
    """One step of ``strategy`` on ``cluster`` (a shipped name or a cluster file),
    simulated: step time, per-rank busy and idle time, memory against each cap
    (``hspmd simulate``). ``options`` default to bf16 compute, as the command's."""
    spec = _costed(model_spec(model, **(model_kwargs or {})))
    chosen, options = _strategy(strategy), options or StrategyOptions(dtype="bf16")
    cost = CostModel.of(load_cluster(cluster), dtype=options.dtype)
    length = _length(spec, seq_len)
    check_strategy(chosen, spec, global_batch=global_batch, options=options, seq_len=length,
                   world_size=cost.num_ranks)  # fmt: skip
    return predict(chosen, spec, cost, seq_len=length, options=options)


def plan_strategy(
    model: ModelLike, *, cluster: str, global_batch: int, seq_len: int | None = None,
    zero1: Zero1 = "auto", dtype: Literal["bf16", "fp32"] = "bf16",
    time_limit: float | None = None, homogeneous: bool = True,
    model_kwargs: Mapping[str, Any] | None = None,
) -> Plan:  # fmt: skip
    """The fastest strategy found for ``model`` on ``cluster`` that fits every rank's
    memory, beside the best homogeneous one (``hspmd plan``; docs/planner.md)."""
    spec = _costed(model_spec(model, **(model_kwargs or {})))
    cost = CostModel.of(load_cluster(cluster), dtype=dtype)
    return _plan(
        spec, cost, global_batch=global_batch, seq_len=_length(spec, seq_len),
        zero1=zero1, dtype=dtype, time_limit=time_limit, homogeneous=homogeneous,
    )  # fmt: skip
