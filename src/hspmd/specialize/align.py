"""The communication of an align node (``hspmd.deduce.AlignSite``) on every rank.

An align node is a reshard whose output keeps its input's annotation, so its forward plan
``resolve(a, a, shape)`` has no steps; its backward plan takes the gradient its consumers
give to the common one, ``resolve(grad_from, grad_to, shape)``::

    align x -> linear [3, 4]: [0,1]{D:2}; backward [0,1]{P:2} -> [0,1]{D:2}
    forward:  no steps      backward: all-reduce over [0,1]

>>> from hspmd.annotation import parse_annotation as A
>>> from hspmd.deduce import AlignSite
>>> site = AlignSite("align", "x", ("linear",), (3, 4), A("[0,1]{D:2}"),
...     A("[0,1]{P:2}"), A("[0,1]{D:2}"))
>>> forward, backward = align_plans(site)
>>> forward.steps, backward.kinds
((), ('all-reduce',))
"""

from __future__ import annotations

from hspmd.comm.plan import CommPlan
from hspmd.comm.resolve import resolve
from hspmd.deduce import AlignSite

__all__ = ["align_plans"]


def align_plans(site: AlignSite) -> tuple[CommPlan, CommPlan]:
    """``(forward, backward)`` plans of an align site; the forward has no steps."""
    forward = resolve(site.annotation, site.annotation, site.shape)
    assert not forward.steps, f"{site}: an identity resolved to {forward.kinds}"
    return forward, resolve(site.grad_from, site.grad_to, site.shape)
