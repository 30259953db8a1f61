"""Every replica of a layer lost: the newest checkpoint, loaded onto the re-planned
strategy (losses still equal the reference), or one error naming the lost layers.

Rank 1 dies in forward of step 3, rank 3 while the states move: both holders of layer 1
are gone. Multi-process (gloo, 4 ranks, llama-tiny with 2 layers).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hspmd.checkpoint import latest, read_manifest
from hspmd.runtime.launch import LaunchError
from tests.elastic.helpers import assert_matches_reference, run

pytestmark = [pytest.mark.multiproc, pytest.mark.elastic]

TWO_PP = "2x2: R0:L0-0 R1:L1-1; 2x2: R2:L0-0 R3:L1-1"
BOTH = ("1@3:forward", "3@3:switch")


def test_a_lost_layer_falls_back_to_the_checkpoint(tmp_path: Path) -> None:
    result, events = run(TWO_PP, *BOTH, save=str(tmp_path), save_every=1)
    assert_matches_reference(result)
    fallback = next(e for e in events if e["event"] == "fallback")
    assert fallback["lost"] == "layers 1" and fallback["checkpoint_step"] == 2
    assert next(e for e in events if e["event"] == "resumed")["moved_bytes"] is None


def test_a_lost_layer_without_checkpoint_names_it() -> None:
    with pytest.raises(LaunchError, match="every replica of layers 1 died and there is no"):
        run(TWO_PP, *BOTH)


def test_a_kill_while_saving_writes_the_checkpoint_again(tmp_path: Path) -> None:
    """Rank 2 dies saving step 2 (committed): step 2 counts once, its checkpoint is written
    again from the new plan, and it loads."""
    result, events = run(TWO_PP, "2@2:save", save=str(tmp_path), save_every=2, steps=3)
    assert_matches_reference(result, steps=3)
    assert next(e for e in events if e["event"] == "resumed")["step"] == 3
    manifest = read_manifest(latest(str(tmp_path)))
    assert manifest.step == 2 and manifest.strategy != TWO_PP  # written by the new plan
