"""`hspmd train --compare`: the run and the reference in one command, the comparison
printed, the exit status 1 when they differ (``hspmd.train.compare``'s rule)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hspmd.cli import main

# The GPT-2 example with every bias starting at zero, as Hugging Face's GPT-2 starts: the
# key bias then only ever sees fp32 noise as its gradient (the softmax ignores it).
ZERO_BIASES = """
import torch
from hspmd.models.examples import gpt2

def make(**kwargs):
    model = gpt2(**kwargs)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.zero_()
    return model
"""


@pytest.mark.multiproc
def test_compare_trains_both_and_passes_noise_in_a_key_bias(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "zero_biases.py").write_text(ZERO_BIASES)
    argv = ["train", "--model", f"{tmp_path / 'zero_biases.py'}:make",
            "--config", '{"tie": false, "num_layers": 2}',
            "--strategy", "1x1: R0:L0-1; 1x1: R1:L0-1", "--seq-len", "32",
            "--steps", "3", "--lr", "1e-3", "--data-max-bytes", "1048576", "--compare", "--json"]  # fmt: skip
    assert main(argv) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["step"] for r in lines[:-1]] == [1, 2, 3]  # the run's steps, then the verdict
    report = lines[-1]["comparison"]
    assert report["ok"] and report["max_loss_rel"] < 1e-5, report
    # the key biases' gradients were fp32 noise in the reference: not judged, within reach
    noise = report["noise_only"]
    assert noise["parameters"] == ["layers.0.attn.k.bias", "layers.1.attn.k.bias"], noise
    assert noise["ok"] and noise["max_difference"] < noise["reach"], noise


def test_compare_refuses_what_it_cannot_compare(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["train", "--strategy", "1x1: R0:L0-3", "--compare"]
    cases = [
        ([*base, "--reference"], "--compare does not take --reference"),
        ([*base, "--resume", "/nonexistent"], "--compare does not take --resume"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
