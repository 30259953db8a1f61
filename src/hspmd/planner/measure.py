"""Timing of operator families on the machine at hand (torch); units as in hspmd.planner.profile.

Each sample is the median of several timed repetitions after one warm-up.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.nn.functional as F

from hspmd.planner.profile import Sample


def median_seconds(fn: Callable[[], object], reps: int) -> float:
    """Median wall time of ``fn`` over ``reps`` runs, after one warm-up run."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_matmul(
    sizes: Sequence[int], reps: int, dtype: torch.dtype = torch.float32
) -> list[Sample]:
    """F.linear forward (``2*M*N*K`` FLOPs) and backward (twice that) on square sizes."""
    out = []
    for n in sizes:
        x = torch.randn(n, n, dtype=dtype, requires_grad=True)
        w = torch.randn(n, n, dtype=dtype, requires_grad=True)
        flops = 2.0 * n * n * n
        out.append(Sample("matmul", flops, median_seconds(partial(F.linear, x, w), reps)))
        y = F.linear(x, w)
        g = torch.ones_like(y)
        backward = partial(torch.autograd.grad, y, (x, w), g, retain_graph=True)
        out.append(Sample("matmul", 2 * flops, median_seconds(backward, reps)))
    return out


def measure_elementwise(sizes: Sequence[int], reps: int) -> list[Sample]:
    """silu(a) * b and a + b, per input byte."""
    out = []
    for n in sizes:
        a, b = torch.randn(n), torch.randn(n)
        nbytes = 2.0 * n * a.element_size()
        out.append(Sample("elementwise", nbytes, median_seconds(partial(_silu_mul, a, b), reps)))
        out.append(Sample("elementwise", nbytes, median_seconds(partial(torch.add, a, b), reps)))
    return out


def _silu_mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.silu(a) * b
