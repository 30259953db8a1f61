"""Variable-length steps: packed documents trained under heterogeneous strategies equal the
single-device reference on the same packed batches (fp32), one executable per rank serves
every length, and the records count sequences and tokens per pipeline.

One launch for three configs (4 ranks, 3 steps each, llama-tiny with 2 layers; the third
in bf16 with recompute, within bf16 tolerances of the fp32 reference), on a JSONL
corpus of long-tailed short documents (several per row, some over the maximum length)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from hspmd.plan.strategy import parse_strategy
from hspmd.train.api import revise, train_config
from hspmd.train.compare import compare
from hspmd.train.config import AdamConfig, TrainConfig
from hspmd.train.packing import IGNORE, PackedStep, packed_steps
from hspmd.train.reference import run_reference
from hspmd.train.trainer import train_many

pytestmark = pytest.mark.multiproc

STRATEGIES = {
    # pipelines of different micro-batch counts, rows, TP degrees; a BSR boundary
    "PP x TP, rows differ": ("2x2: R0-1:L0 R2:L1; 3x1: R3:L0-1", False),
    # sequence parallel: lengths are multiples of 2 and the plans split the sequence
    "TP 2 sequence parallel": ("2x2: R0-1:L0-1; 3x1: R2-3:L0-1", True),
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = random.Random(0)
    text = Path(random.__file__).read_text()
    lines = []
    for _ in range(300):
        n = min(150, int(rng.paretovariate(1.3) * 6))  # long-tailed, 6 to 150 bytes
        start = rng.randrange(len(text) - n)
        lines.append(json.dumps({"text": text[start : start + n]}))
    path = tmp_path_factory.mktemp("data") / "docs.jsonl"
    path.write_text("\n".join(lines))
    return path


def config_of(strategy: str, sp: bool, data: Path) -> TrainConfig:
    return train_config(
        model_kwargs=(("num_layers", 2),),
        strategy=strategy,
        global_batch=parse_strategy(strategy).global_batch,
        sequence_parallel=sp,
        seq_len=64,  # the maximum length
        step_tokens=320,
        steps=3,
        adam=AdamConfig(lr=1e-3),
        data=str(data),
    )


# bf16 compute (fp32 masters) with per-layer recompute: close to the fp32 reference, with
# the tolerances of tests/train/test_strategy_matrix.py
BF16_RECOMPUTE = "2x2: R0-1:L0 R2:L1; 3x1: R3:L0-1"
BF16_LOSS_RTOL, BF16_PARAM_RTOL = 1e-3, 5e-2


def documents_per_row(step: PackedStep) -> list[int]:
    out = []
    for pipe in step.micro_batches:
        for mb in pipe:
            for segments, targets in zip(mb.segments, mb.targets, strict=True):
                out.append(len(set(segments[targets != IGNORE].tolist())))
    return out


def test_packed_steps_vary_in_length(corpus: Path) -> None:
    config = config_of(*STRATEGIES["PP x TP, rows differ"], corpus)
    steps = list(packed_steps(config, config.require_strategy()))
    lengths = {n for s in steps for pipe in s.assignment.lengths for n in pipe}
    assert len(lengths) > 2 and max(lengths) <= 64
    assert max(n for s in steps for n in documents_per_row(s)) >= 3  # packed
    for step in steps:
        assert step.tokens <= 320 and sum(step.assignment.tokens_per_pipeline) == step.tokens


def test_packed_training_equals_the_reference(corpus: Path) -> None:
    configs = [config_of(*value, corpus) for value in STRATEGIES.values()]
    low = revise(config_of(BF16_RECOMPUTE, False, corpus), dtype="bf16", recompute=True)
    *results, low_result = train_many([*configs, low], timeout_s=900, threads=1)
    low_reference = run_reference(revise(low, dtype="fp32", recompute=False))
    for got, want in zip(low_result.losses, low_reference.losses, strict=True):
        assert abs(got - want) <= BF16_LOSS_RTOL * abs(want), (got, want)
    for pname, want_p in low_reference.params.items():
        error = float((low_result.params[pname] - want_p).norm() / want_p.norm())
        assert error <= BF16_PARAM_RTOL, (pname, error)
    assert low_result.builds == 1
    for name, config, result in zip(STRATEGIES, configs, results, strict=True):
        reference = run_reference(config)
        comparison = compare(result, reference)
        assert comparison.ok, f"{name}: {comparison}"
        assert result.builds == 1, name  # one executable per rank for every length
        for got, want in zip(result.records, reference.records, strict=True):
            assert got.tokens == want.tokens and got.sequences == want.sequences
            assert got.pipeline_tokens is not None and sum(got.pipeline_tokens) == got.tokens
            assert got.dropped == 0
        assert sum(r.truncated or 0 for r in result.records) > 0
        multiple = 2 if config.options.sequence_parallel else 1
        steps = packed_steps(config, config.require_strategy())
        assert all(n % multiple == 0 for s in steps for p in s.assignment.lengths for n in p)
