"""``--elastic --resume DIR``: an elastic run goes on from a checkpoint (loaded onto its
strategy, resharded) and still survives a kill after it, with the reference's losses.

Multi-process (gloo, 2 then 3 ranks, llama-tiny with 2 layers).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.elastic.helpers import kinds, reference, run

pytestmark = [pytest.mark.multiproc, pytest.mark.elastic]


def test_resume_onto_another_strategy_then_survive_a_kill(tmp_path: Path) -> None:
    saved, _ = run("1x4: R0:L0-1; 1x4: R1:L0-1", steps=2, save=str(tmp_path))
    assert [r.step for r in saved.records] == [1, 2]
    result, events = run(
        "1x2: R0:L0-1; 1x2: R1:L0-1; 1x4: R2:L0-1", "1@3:backward", resume=str(tmp_path)
    )
    assert [r.step for r in result.records] == [3, 4]
    assert kinds(events) == ["failure", "replan", "resumed"]
    ref = reference()
    for mine, theirs in zip(result.records, ref.records[2:], strict=True):
        assert abs(mine.loss - theirs.loss) <= 1e-5 * max(1.0, abs(theirs.loss)), (mine, theirs)
    for name, expected in ref.params.items():
        torch.testing.assert_close(result.params[name], expected, rtol=1e-5, atol=1e-5)
