"""Elastic recovery of models as their authors wrote them (issue 35): a Hugging Face Llama
loses a rank, the survivors re-plan and redo the step, every loss equals the reference."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hspmd.train.api import train_config
from hspmd.train.faults import parse_injections
from hspmd.train.reference import run_reference
from hspmd.train.trainer import train_elastic

pytest.importorskip("transformers")
pytestmark = [pytest.mark.multiproc, pytest.mark.elastic]

HF = str(Path(__file__).parents[1] / "models" / "data" / "hf_models.py")


def test_hf_llama_survives_a_kill_equal_to_the_reference() -> None:
    config = train_config(model=f"{HF}:llama", strategy="2x1: R0:L0-1 R1:L2-3; 2x1: R2:L0-3",
                         global_batch=4, seq_len=16, steps=4, elastic=True,
                         inject=parse_injections(["1@2:forward"]))  # fmt: skip
    events: list[dict] = []
    result = train_elastic(config, on_event=events.append, timeout_s=300, threads=1)
    assert [e["event"] for e in events if e["event"] != "started"] == [
        "failure",
        "replan",
        "resumed",
    ]
    want = run_reference(config).losses
    got = result.losses
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-5, (got, want)


def test_hf_llama_packed_steps_replan_a_length_aware_set_after_a_kill(tmp_path: Path) -> None:
    """Packed documents on a captured model: the survivors' re-plan is the length planner's
    set, costed from the model's own graph (its three inputs: tokens, targets, segments),
    and every step's loss equals the reference on the same documents."""
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": "x" * n}) + "\n" for n in [30] * 30 + [60] * 6))
    config = train_config(model=f"{HF}:llama", strategy="2x1: R0:L0-1 R1:L2-3; 2x1: R2:L0-3",
                         data=str(data), step_tokens=256, seq_len=64, steps=3, elastic=True,
                         hang_timeout=20.0, inject=parse_injections(["1@2:backward"]))  # fmt: skip
    events: list[dict] = []
    result = train_elastic(config, on_event=events.append, timeout_s=300, threads=1)
    replan = next(e for e in events if e["event"] == "replan")
    assert replan["strategies"], replan  # a set, not the fixed-batch planner's one strategy
    want = run_reference(config).losses
    got = result.losses
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-5 * max(want), (got, want)
