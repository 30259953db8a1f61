"""The public API, one import away: ``import hspmd`` then ``hspmd.<name>`` (docs/api.md).

=================  ==========================================================================
values             ``Strategy``, ``StrategyOptions``, ``parse_strategy``, ``Annotation``,
                   ``parse_annotation``, ``TrainConfig``, ``AdamConfig``, ``StepRecord``,
                   ``TrainResult``, ``Comparison``, ``ModelIdentity``
metadata verbs     ``model_spec``, ``resolve``, ``explain``, ``render``, ``simulate``,
                   ``plan_strategy``
                   (no processes)
training           ``fit`` (the run, or the reference), ``train_config``, ``revise``,
                   ``compare``
your own loop      ``launch`` (local processes), ``build`` (one rank's ``RankProgram``),
                   ``assemble`` (the ranks' outcomes as one ``TrainResult``)
markers            ``reshard`` (identity on one device, a marker in the captured graph)
=================  ==========================================================================

>>> import hspmd
>>> hspmd.parse_strategy("2x1: R0-1:L0-3; 1x2: R2:L0-3").global_batch
4
>>> sorted(set(hspmd.__all__) - set(__all__))
['__version__']
"""

from hspmd.annotation import Annotation, parse_annotation
from hspmd.api.verbs import explain, model_spec, plan_strategy, resolve, simulate
from hspmd.markers import reshard
from hspmd.plan.identity import ModelIdentity
from hspmd.plan.strategy import Strategy, StrategyOptions, parse_strategy
from hspmd.runtime.launch import launch
from hspmd.specialize.explain import render
from hspmd.train.api import RunOptions, fit, revise, train_config
from hspmd.train.compare import Comparison, compare
from hspmd.train.config import AdamConfig, StepRecord, TrainConfig
from hspmd.train.program import RankProgram, build
from hspmd.train.reference import TrainResult
from hspmd.train.trainer import assemble

__all__ = [
    "AdamConfig", "Annotation", "Comparison", "ModelIdentity", "RankProgram", "RunOptions",
    "StepRecord", "Strategy", "StrategyOptions", "TrainConfig", "TrainResult", "assemble",
    "build", "compare", "explain", "fit", "launch", "model_spec", "parse_annotation",
    "parse_strategy", "plan_strategy", "render", "reshard", "resolve", "revise", "simulate",
    "train_config",
]  # fmt: skip
