"""Dropout equal under any strategy (issue 35, item 4; DESIGN decision 17): models with
dropout as their authors wrote it train equal to the plain module on one process, whose
``nn.Dropout``/``F.dropout``/SDPA ``dropout_p`` draw the same masks by position.

One launch runs every case (``train_many``): a nanoGPT-style model with dropout 0.1 on the
embeddings, the attention weights, the residual and the MLP, switching live from a
heterogeneous two-pipeline strategy with TP to uneven PP with TP, then to two pipelines
that recompute their layers; Hugging Face GPT-2 with resid/embd/attn_pdrop 0.1 under DP
with TP and gradient accumulation; HF Llama with attention_dropout 0.1 under TP (each rank
draws its heads of the attention weights) and PP. fp32: losses to 1e-5 relative, parameters
within ``hspmd.train.compare``'s tolerance.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hspmd.train.api import train_config
from hspmd.train.compare import compare
from hspmd.train.config import TrainConfig
from hspmd.train.reference import TrainResult, run_reference
from hspmd.train.trainer import train_many

pytest.importorskip("transformers")
pytestmark = pytest.mark.multiproc

DATA = Path(__file__).parent / "data"
NANOGPT, HF = f"{DATA / 'nanogpt_style.py'}:make_untied", f"{DATA / 'hf_models.py'}"
GPT2_DROPOUT = (("resid_pdrop", 0.1), ("embd_pdrop", 0.1), ("attn_pdrop", 0.1))

# Keyword arguments of each case's TrainConfig, made in the fixture: a TrainConfig reads its
# model, which collection (also of the ``python -O`` pass, which skips this file) must not.
CASES: dict[str, dict[str, Any]] = {
    "nanoGPT: heterogeneous, then PP, then recompute (live switches)": dict(
        model=NANOGPT, model_kwargs=(("dropout", 0.1),), global_batch=4, seq_len=16, steps=3,
        strategy="2x1: R0-1:L0-2; 1x2: R2:L0-2",
        switches=((2, "4x1: R0:L0 R1-2:L1-2"), (3, "2x1: R0:L0-1:RC2 R1:L2; 2x1: R2:L0-2:RC3")),
    ),
    "HF GPT-2: DP beside TP, gradient accumulation": dict(
        model=f"{HF}:gpt2", model_kwargs=GPT2_DROPOUT, global_batch=4, seq_len=16, steps=2,
        strategy="2x1: R0-1:L0-3; 1x2: R2:L0-3", grad_accum=2,
    ),
    "HF Llama: attention dropout on TP heads, PP": dict(
        model=f"{HF}:llama", model_kwargs=(("attention_dropout", 0.1),), global_batch=2,
        seq_len=16, steps=2, strategy="2x1: R0-1:L0-1 R2:L2-3",
    ),
}  # fmt: skip


Runs = dict[str, tuple[TrainConfig, TrainResult]]


@pytest.fixture(scope="module")
def runs() -> Runs:
    configs = [train_config(**kwargs) for kwargs in CASES.values()]
    return dict(zip(CASES, zip(configs, train_many(configs, threads=1), strict=True), strict=True))


@pytest.mark.parametrize("name", list(CASES))
def test_dropout_trains_equal_to_the_reference(runs: Runs, name: str) -> None:
    config, run = runs[name]
    reference = run_reference(config)
    result = compare(run, reference, config=config)
    assert result.max_loss_rel <= 1e-5 and result.ok, str(result)
    # the masks matter: without dropout the losses differ by ten times the tolerance or more
    names = {key for key, _ in config.model.overrides}
    plain = train_config(**{**_fields(config), "model_kwargs": tuple((n, 0.0) for n in names)})
    without = run_reference(plain).losses
    assert max(abs(a - b) / b for a, b in zip(reference.losses, without, strict=True)) > 1e-4


def _fields(config: TrainConfig) -> dict[str, object]:
    batch = config.batch
    return {"model": config.model.source, "global_batch": batch.global_batch,
            "seq_len": batch.seq_len, "steps": config.steps}  # fmt: skip
