"""The docstring examples of hspmd.viz (rows order, picture path check)."""

from __future__ import annotations

import doctest
from types import ModuleType

import pytest

import hspmd.viz.common
import hspmd.viz.partition
import hspmd.viz.plan
import hspmd.viz.timeline


@pytest.mark.parametrize(
    "module",
    [hspmd.viz.common, hspmd.viz.partition, hspmd.viz.plan, hspmd.viz.timeline],
    ids=lambda m: m.__name__,
)
def test_doctests(module: ModuleType) -> None:
    assert doctest.testmod(module).failed == 0
