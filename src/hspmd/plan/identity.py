"""A model's identity, carried by plan files and checkpoints: where it came from (its
source and keyword arguments, for people) and what it is, for the check: a structural
fingerprint (its parameters' names and shapes, in order) and, for a Hugging Face model,
a digest of its config's architecture fields (``ModuleModel.config_digest``: a RoPE base
or a norm epsilon changes no shape, but changes the model).

Two identities match when both agree (the config where both have one): a factory file
copied under another name or moved, an ``hf:DIR`` folder copied elsewhere, or a keyword
that changes no parameter, is the same model to a plan or a checkpoint. A mismatch is one
line naming both models (``check_identity``)::

    >>> from hspmd.models import get_model
    >>> tiny = ModelIdentity.of(get_model("llama-tiny"), source="llama-tiny")
    >>> two = ModelIdentity.of(get_model("llama-tiny", num_layers=2), source="llama-tiny",
    ...                        kwargs={"num_layers": 2})
    >>> str(two)
    "llama-tiny {'num_layers': 2} (21 parameters, fingerprint a21a568118c16226)"
    >>> check_identity(tiny, two, what="plan.json", fix="give its --model")
    Traceback (most recent call last):
    ...
    hspmd.errors.StrategyError: plan.json is for model llama-tiny (39 parameters, fingerprint ...), but this run's model is llama-tiny {'num_layers': 2} (21 parameters, fingerprint ...): give its --model
    >>> ModelIdentity.from_json(two.to_json()) == two
    True
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hspmd.errors import StrategyError
from hspmd.models.spec import ModelSpec

__all__ = ["ModelIdentity", "check_identity"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelIdentity:
    """``source``: a preset name, ``FILE.py:FUNCTION`` or ``hf:DIR``; ``kwargs``: the
    factory's keyword arguments (a preset's overrides) as sorted items; ``fingerprint``: 16
    hex digits of the SHA-256 of every parameter's ``name shape`` line; ``config``: the
    architecture digest of a Hugging Face model ("" for others)."""

    source: str
    kwargs: tuple[tuple[str, Any], ...] = ()
    num_params: int
    fingerprint: str
    config: str = ""

    @classmethod
    def of(
        cls, spec: ModelSpec, *, source: str, kwargs: Mapping[str, Any] | None = None
    ) -> ModelIdentity:
        """The identity of ``spec`` (metadata only: nothing allocated)."""
        shapes = spec.parameter_shapes()
        lines = "".join(f"{name} {list(shape)}\n" for name, shape in shapes.items())
        digest = hashlib.sha256(lines.encode()).hexdigest()[:16]
        items = tuple(sorted((kwargs or {}).items()))
        digest_of = getattr(spec, "config_digest", None)
        config = digest_of() if callable(digest_of) else ""
        return cls(
            source=source, kwargs=items, num_params=len(shapes), fingerprint=digest,
            config=config,
        )  # fmt: skip

    def matches(self, other: ModelIdentity) -> bool:
        configs = self.config == other.config or not self.config or not other.config
        return self.fingerprint == other.fingerprint and configs

    def __str__(self) -> str:
        given = f" {dict(self.kwargs)}" if self.kwargs else ""
        config = f", config {self.config}" if self.config else ""
        return (
            f"{self.source}{given} ({self.num_params} parameters, fingerprint "
            f"{self.fingerprint}{config})"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "kwargs": dict(self.kwargs),
            "num_params": self.num_params,
            "fingerprint": self.fingerprint,
            **({"config": self.config} if self.config else {}),
        }

    @classmethod
    def from_json(cls, data: Any, *, where: str = "the file") -> ModelIdentity:
        """Read ``to_json``'s form (StrategyError naming ``where`` if it is not that)."""
        try:
            kwargs = {k: _frozen(v) for k, v in dict(data["kwargs"]).items()}
            return cls(
                source=str(data["source"]), kwargs=tuple(sorted(kwargs.items())),
                num_params=int(data["num_params"]), fingerprint=str(data["fingerprint"]),
                config=str(data.get("config", "")),
            )  # fmt: skip
        except (KeyError, TypeError, ValueError):
            raise StrategyError(
                f'{where}: its "model" is {json.dumps(data)[:120]}, not '
                '{"source", "kwargs", "num_params", "fingerprint"}: write the file again'
            ) from None


def _frozen(value: Any) -> Any:
    """JSON lists and objects as tuples (identities are hashable values)."""
    if isinstance(value, list):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    return value


def check_identity(saved: ModelIdentity, now: ModelIdentity, *, what: str, fix: str) -> None:
    """StrategyError naming both models when ``saved`` (``what`` carries it: a plan file,
    a checkpoint) is not the structure of ``now`` (this run's model)."""
    if not saved.matches(now):
        raise StrategyError(f"{what} is for model {saved}, but this run's model is {now}: {fix}")
