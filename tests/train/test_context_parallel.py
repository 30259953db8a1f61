"""Context parallelism trains exactly like the single-device reference (fp32).

Ulysses-style CP (docs/mixed-length.md "Context parallelism"): the residual stream of a
``:C<c>`` stage is split on the sequence over its CP groups, q/k/v and the attention
output are resharded between the sequence split and a heads split (all-to-alls), the
parameters' gradients are partial over the CP group. Checked on llama-tiny with 2 layers:
every step's loss within 1e-5 relative and every parameter after the steps within 1e-4
relative (``hspmd.train.compare``), on fixed batches (also with ZeRO-1, recompute and a
live switch between CP layouts) and on packed documents of varying length (also with
sequence parallelism on the stage after a CP stage); bf16 compute under CP within bf16
tolerances of the fp32 reference. One launch of 4 processes for every config.
"""

from __future__ import annotations

import json
import random
from itertools import islice
from pathlib import Path

import pytest

from hspmd.plan.strategy import parse_strategy
from hspmd.train.api import revise, train_config
from hspmd.train.compare import compare
from hspmd.train.config import AdamConfig, TrainConfig
from hspmd.train.packing import packed_steps
from hspmd.train.reference import run_reference
from hspmd.train.trainer import train_many

pytestmark = pytest.mark.multiproc

SP = {"sequence_parallel": True}
# name -> (strategy, model overrides, packed, other TrainConfig fields)
STRATEGIES: dict[str, tuple[str, tuple, bool, dict]] = {
    # a CP-2 pipeline whose second stage has no CP (the boundary gathers the sequence)
    # beside a pipeline without CP
    "CP per stage and per pipeline": ("1x2: R0-1:L0:C2 R2:L1; 2x1: R3:L0-1", (), False, {}),
    "TP 2 x CP 2": ("1x2: R0-3:L0-1:C2", (("num_kv_heads", 4),), False, {}),  # KV heads / 4
    # ZeRO-1 states over the pipelines, per-layer recompute (the all-to-alls rerun in B),
    # and a switch at step 2 that moves CP to the other pipeline
    "ZeRO-1, recompute, switch": (
        "1x2: R0-1:L0-1:C2; 2x1: R2:L0-1",
        (),
        False,
        {"zero": 1, "recompute": True, "switches": ((2, "2x1: R0:L0-1; 1x2: R1-2:L0-1:C2"),)},
    ),  # fmt: skip
    # packed documents (block-diagonal attention): rows of varying even lengths
    "packed, CP 2 beside no CP": ("2x1: R0-1:L0-1:C2; 2x1: R2:L0-1", (), True, {}),
    # sequence parallelism on the TP-2 stage after a CP-2 stage (the boundary moves the
    # residual from the CP split to the SP split), packed rows
    "packed, CP 2 then SP over TP 2": ("4x1: R0-1:L0:C2 R2-3:L1", (), True, SP),
}

# bf16 compute (fp32 masters) under CP, against the fp32 reference: the tolerances of
# tests/train/test_strategy_matrix.py (bf16 has 8 mantissa bits)
BF16_CP = ("2x1: R0-1:L0-1:C2; 2x1: R2:L0-1", (), False, {"dtype": "bf16"})
BF16_LOSS_RTOL, BF16_PARAM_RTOL = 1e-3, 5e-2


def corpus(directory: Path) -> Path:
    rng = random.Random(0)
    text = Path(random.__file__).read_text()
    lines = []
    for _ in range(200):
        n = min(60, int(rng.paretovariate(1.3) * 6))  # long-tailed, 6 to 60 bytes
        start = rng.randrange(len(text) - n)
        lines.append(json.dumps({"text": text[start : start + n]}))
    path = directory / "docs.jsonl"
    path.write_text("\n".join(lines))
    return path


def config_of(
    strategy: str, overrides: tuple, packed: bool, fields: dict, data: Path
) -> TrainConfig:
    return train_config(
        **fields,
        model_kwargs=(("num_layers", 2), *overrides),
        strategy=strategy,
        global_batch=parse_strategy(strategy).global_batch,
        seq_len=16 if not packed else 32,
        step_tokens=100 if packed else None,
        steps=2,
        adam=AdamConfig(lr=1e-3),
        data=str(data) if packed else None,
        data_max_bytes=1 << 18,
    )


def test_context_parallel_equals_the_reference(tmp_path: Path) -> None:
    data = corpus(tmp_path)
    configs = [config_of(*spec, data) for spec in STRATEGIES.values()]
    low = config_of(*BF16_CP, data)
    *results, low_result = train_many([*configs, low], threads=1)
    low_reference = run_reference(revise(low, dtype="fp32"))
    for got, want in zip(low_result.losses, low_reference.losses, strict=True):
        assert 0 < abs(got - want) <= BF16_LOSS_RTOL * abs(want), (got, want)  # bf16, close
    for pname, want_p in low_reference.params.items():
        error = float((low_result.params[pname] - want_p).norm() / want_p.norm())
        assert error <= BF16_PARAM_RTOL, (pname, error)
    for name, config, result in zip(STRATEGIES, configs, results, strict=True):
        reference = run_reference(config)
        comparison = compare(result, reference)
        assert comparison.ok, f"{name}: {comparison}"
        # one executable per rank and strategy, whatever the lengths
        assert result.builds == 1 + len(config.switching.switches), name
    packed = configs[-1]
    assert packed.strategy is not None
    steps = list(islice(packed_steps(packed, packed.strategy), 2))
    lengths = {n for step in steps for pipe in step.assignment.lengths for n in pipe}
    assert len(lengths) > 1 and all(n % 2 == 0 for n in lengths)  # CP 2: even lengths
