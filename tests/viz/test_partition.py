"""The placement picture's data: memory curves that reach the emulated peaks, busy spans."""

from __future__ import annotations

import numpy as np
import pytest

from hspmd.partition.emulate import emulate
from hspmd.partition.generate import layered_graph
from hspmd.viz.partition import busy_intervals, memory_curve


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_memory_curve_peaks_are_the_emulated_peaks(seed: int) -> None:
    graph = layered_graph(300, seed=seed)
    placement = np.random.default_rng(seed).integers(0, 3, graph.num_nodes)
    emulation = emulate(graph, placement)
    for device in range(3):
        times, live = memory_curve(graph, placement, emulation, device)
        assert np.all(np.diff(times) >= 0)
        assert live.max() == emulation.peak_bytes[device]
        # every output is freed by the end: only the residual state stays
        assert live[-1] == graph.residual_bytes[placement == device].sum()


def test_busy_intervals_cover_every_op() -> None:
    rng = np.random.default_rng(0)
    start = np.sort(rng.uniform(0, 100, 50))
    finish = start + rng.uniform(0, 3, 50)
    spans = busy_intervals(start, finish, resolution=0.5)
    for s, f in zip(start, finish, strict=True):
        assert any(a <= s and f <= a + w + 1e-9 for a, w in spans)
    assert all(b[0] > a[0] + a[1] + 0.5 for a, b in zip(spans, spans[1:], strict=False))
