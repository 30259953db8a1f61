"""Metadata scales: every parameter of the 32B Llama on 48 ranks resolves quickly."""

from __future__ import annotations

import time

from hspmd.comm.resolve import _resolve, resolve
from hspmd.comm.topology import Topology
from hspmd.models import get_config
from hspmd.plan.params import parameter_annotations, state_annotations
from hspmd.plan.strategy import parse_strategy

# Table 9 (16 H800 + 32 H20, 32B) and Table 12 C4: both on 48 ranks.
TABLE9 = "; ".join(
    f"16x1: R{16 + 8 * i}-{19 + 8 * i}:L0-10 R{20 + 8 * i}-{23 + 8 * i}:L11-21 "
    f"R{4 * i}-{4 * i + 3}:L22-59"
    for i in range(4)
)
C4 = (
    "32x1: R16-19:L0-4 R20-23:L5-10 R24-27:L11-16 R28-31:L17-22 R0-3:L23-40 R4-7:L41-59; "
    "32x1: R32-35:L0-4 R36-39:L5-10 R40-43:L11-16 R44-47:L17-22 R8-11:L23-40 R12-15:L41-59"
)


def test_llama_32b_on_48_ranks_resolves_fast() -> None:
    config = get_config("llama-32b")
    before = parameter_annotations(parse_strategy(C4), config)
    after = parameter_annotations(parse_strategy(TABLE9), config)
    states = state_annotations(parse_strategy(TABLE9), config, zero1=True)
    topology = Topology.uniform_nodes(48)
    _resolve.cache_clear()
    start = time.perf_counter()
    kinds = set()
    for name, spec in before.items():
        kinds.add(
            resolve(spec.annotation, after[name].annotation, spec.shape, topology=topology).kinds
        )
        kinds.add(resolve(states[name].annotation, after[name].annotation, spec.shape).kinds)
    elapsed = time.perf_counter() - start
    assert kinds == {("bsr",), ("all-gather",)}  # the two pipelines line up
    assert elapsed < 25.0, f"resolving {len(before)} parameters twice took {elapsed:.2f} s"
