"""The reshard marker: an identity on one device, a named node in a torch.fx graph.

The user's single-device program marks the points where a plan may change a tensor's
annotation::

    x = reshard(embed(tokens), "embed")

Run eagerly, ``reshard`` returns ``x`` unchanged. Traced by ``torch.fx.symbolic_trace``, it
is a leaf: the graph gets one ``call_function`` node whose target is this function
(qualified name ``hspmd.markers.reshard``) and whose args are ``(x, "embed")``. Deduction
reads the name to look the annotation up in the plan; specialization replaces the node
with the resolved communication.

The leaf behaviour does not depend on how the function was imported (``hspmd.reshard``,
``from hspmd.markers import reshard``...): when its input is an fx ``Proxy`` it records
itself instead of running. (``torch.fx.wrap`` would only patch the name in one module's
globals, which misses the other import paths.)

``align(x, name)`` is the same kind of leaf: an identity forward everywhere, whose
gradient is resharded to ``x``'s annotation without partial axes (docs/deduction.md,
"Alignment"). Deduction inserts one before each group of ``x``'s consumers that gives
``x`` a gradient of another annotation; a program may also call it by hand.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.fx

__all__ = [
    "ALIGN_TARGET",
    "MARKER_TARGET",
    "align",
    "capturing",
    "eager_function",
    "is_capturing",
    "record_as",
    "is_align_node",
    "is_reshard_node",
    "reshard",
]

_CAPTURING = contextvars.ContextVar("hspmd_capturing", default=False)


@torch.library.custom_op("hspmd::marker", mutates_args=())
def _marker_op(x: torch.Tensor, name: str) -> torch.Tensor:
    """A marker as an ATen-level op, so that ``torch.export`` records it (capture only)."""
    return x.clone()


@_marker_op.register_fake
def _(x: torch.Tensor, name: str) -> torch.Tensor:
    return torch.empty_like(x)


_EAGER: dict[Any, Callable[..., Any]] = {}


def record_as(op: Any, function: Callable[..., Any]) -> None:
    """Capture records ``function`` (a Python function hspmd's graphs call, e.g. a fused
    norm with its own backward) as the custom op ``op``, an opaque node that export keeps
    whole; ``graph.export`` puts ``function`` back in its place (``eager_function``), so
    deduction rules and executables see the function, as they would in an eager run."""
    _EAGER[op] = function


def eager_function(op: Any) -> Callable[..., Any] | None:
    """The Python function that custom op ``op`` stands for at capture (``record_as``)."""
    return _EAGER.get(op)


def is_capturing() -> bool:
    """Whether a capture (``capturing()``) is running: functions registered with
    ``record_as`` then call their custom op instead of computing."""
    return _CAPTURING.get()


@contextmanager
def capturing() -> Iterator[None]:
    """Within: ``reshard`` records itself as ``torch.ops.hspmd.marker`` (``graph.export``)."""
    token = _CAPTURING.set(True)
    try:
        yield
    finally:
        _CAPTURING.reset(token)


def reshard(x: torch.Tensor, name: str) -> torch.Tensor:
    """Mark ``x`` as the reshard point ``name``; the identity on one device.

    >>> import torch
    >>> t = torch.ones(2)
    >>> reshard(t, "embed") is t
    True
    """
    if isinstance(x, torch.fx.Proxy):
        return x.tracer.create_proxy("call_function", reshard, (x, name), {})
    if _CAPTURING.get():
        return _marker_op(x, name)
    return x


record_as(torch.ops.hspmd.marker.default, reshard)

MARKER_TARGET = "hspmd.markers.reshard"
"""The qualified name fx prints for a marker node's target."""


def is_reshard_node(node: torch.fx.Node) -> bool:
    """True for an fx node created by ``reshard``; its name is ``node.args[1]``."""
    return node.op == "call_function" and node.target is reshard


def align(x: torch.Tensor, name: str) -> torch.Tensor:
    """Mark ``x`` as the alignment point ``name``; the identity on one device.

    >>> import torch
    >>> t = torch.ones(2)
    >>> align(t, "x->linear") is t
    True
    """
    if isinstance(x, torch.fx.Proxy):
        return x.tracer.create_proxy("call_function", align, (x, name), {})
    return x


ALIGN_TARGET = "hspmd.markers.align"
"""The qualified name fx prints for an alignment node's target."""


def is_align_node(node: torch.fx.Node) -> bool:
    """True for an fx node created by ``align`` (by hand or by deduction)."""
    return node.op == "call_function" and node.target is align
