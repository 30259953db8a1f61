"""docs/cli.md's preset table matches the presets."""

from __future__ import annotations

from pathlib import Path

from hspmd.cost.stage import embed_params, head_params, layer_params
from hspmd.models.config import PRESETS

DOC = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


def test_preset_table_matches_the_code() -> None:
    text = DOC.read_text()
    for name, c in PRESETS.items():
        p = c.num_layers * layer_params(c) + embed_params(c) + head_params(c)
        row = (
            f"| `{name}` | {c.num_layers} | {c.hidden_size} | {c.intermediate_size} | "
            f"{c.num_heads} | {c.num_kv_heads} | {c.vocab_size} | {c.max_seq_len} | "
            f"{p / 1e6:,.1f}M |"
        )
        assert row in text, row
