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

CASES = {
    "nanoGPT: heterogeneous, then PP, then recompute (live switches)": train_config(
        model=NANOGPT, model_kwargs=(("dropout", 0.1),), global_batch=4, seq_len=16, steps=3,
        strategy="2x1: R0-1:L0-2; 1x2: R2:L0-2",
        switches=((2, "4x1: R0:L0 R1-2:L1-2"), (3, "2x1: R0:L0-1:RC2 R1:L2; 2x1: R2:L0-2:RC3")),
    ),
    "HF GPT-2: DP beside TP, gradient accumulation": train_config(
        model=f"{HF}:gpt2", model_kwargs=GPT2_DROPOUT, global_batch=4, seq_len=16, steps=2,
        strategy="2x1: R0-1:L0-3; 1x2: R2:L0-3", grad_accum=2,
    ),
    "HF Llama: attention dropout on TP heads, PP": train_config(
        model=f"{HF}:llama", model_kwargs=(("attention_dropout", 0.1),), global_batch=2,
        seq_len=16, steps=2, strategy="2x1: R0-1:L0-1 R2:L2-3",
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def runs() -> dict[str, TrainResult]:
    return dict(zip(CASES, train_many(list(CASES.values()), threads=1), strict=True))


@pytest.mark.parametrize("name", list(CASES))
def test_dropout_trains_equal_to_the_reference(runs: dict[str, TrainResult], name: str) -> None:
    config = CASES[name]
    reference = run_reference(config)
    result = compare(runs[name], reference, config=config)
    assert result.max_loss_rel <= 1e-5 and result.ok, str(result)
    # the masks matter: without dropout the losses differ by ten times the tolerance or more
    names = {key for key, _ in config.model_overrides}
    plain = train_config(**{**_fields(config), "model_kwargs": tuple((n, 0.0) for n in names)})
    without = run_reference(plain).losses
    assert max(abs(a - b) / b for a, b in zip(reference.losses, without, strict=True)) > 1e-4


def _fields(config: TrainConfig) -> dict[str, object]:
    return {f: getattr(config, f) for f in ("model", "global_batch", "seq_len", "steps")}
