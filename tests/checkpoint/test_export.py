"""``hspmd export``: a checkpoint of any strategy back to a Hugging Face folder that
transformers loads (issue 37, item 2); the round trip hf:DIR -> train at lr 0 -> export is
bit-exact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

import transformers  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from hspmd.annotation import parse_annotation  # noqa: E402
from hspmd.checkpoint import commit_rank_states, save_rank_state  # noqa: E402
from hspmd.checkpoint.export import export_checkpoint  # noqa: E402
from hspmd.checkpoint.store import CheckpointError  # noqa: E402
from hspmd.cli import main  # noqa: E402
from hspmd.models.module import load_model  # noqa: E402
from hspmd.plan.params import ParamSpec  # noqa: E402
from hspmd.train.api import train_config
from hspmd.train.config import AdamConfig  # noqa: E402
from hspmd.train.trainer import train  # noqa: E402
from tests.models.data.hf_dirs import llama_dir  # noqa: E402


def _save_split(folder: Path, weights: dict[str, torch.Tensor], config: dict | None) -> None:
    """A 2-rank checkpoint of ``weights``: rows split where they split evenly, else copies."""
    specs = {
        n: ParamSpec(n, tuple(t.shape), parse_annotation("[0,1]{0:2}" if t.shape[0] % 2 == 0
                                                         else "[0,1]{D:2}"))
        for n, t in weights.items()
    }  # fmt: skip
    for rank in (0, 1):
        local = {}
        for name, spec in specs.items():
            region = spec.annotation.piece(rank, spec.shape).region
            local[name] = weights[name][tuple(slice(a, b) for a, b in region)].float()
        zeros = {n: torch.zeros_like(t) for n, t in local.items()}
        save_rank_state(folder, step=3, rank=rank, params=local, exp_avg=zeros,
                        exp_avg_sq=zeros, param_specs=specs)  # fmt: skip
    commit_rank_states(folder, step=3, model="m", strategy="s", param_specs=specs, adam_step=3,
                       data_position=3, model_config=config)  # fmt: skip


def test_a_split_checkpoint_is_one_folder_transformers_loads(tmp_path: Path) -> None:
    source = llama_dir(tmp_path / "source", tie_word_embeddings=True)
    weights = load_file(source / "model.safetensors")
    config = json.loads(load_model(f"hf:{source}").hf_config)
    _save_split(tmp_path / "ckpt", weights, config)
    result = export_checkpoint(tmp_path / "ckpt", tmp_path / "out")
    assert (result.step, result.tensors, result.dtype) == (3, len(weights), "float32")
    exported = load_file(tmp_path / "out" / "model.safetensors")
    assert (
        all(torch.equal(exported[n], weights[n]) for n in weights)
        and exported.keys() == weights.keys()
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied on load
    assert torch.equal(
        model.model.embed_tokens.weight.detach(), weights["model.embed_tokens.weight"]
    )


def test_a_model_without_a_config_exports_weights_only(tmp_path: Path) -> None:
    weights = {"w": torch.arange(12.0).reshape(4, 3), "b": torch.ones(3)}
    _save_split(tmp_path / "ckpt", weights, None)
    with pytest.raises(CheckpointError, match="records no Hugging Face config"):
        export_checkpoint(tmp_path / "ckpt", tmp_path / "out")
    export_checkpoint(tmp_path / "ckpt", tmp_path / "out", format="safetensors", dtype="bfloat16")
    out = load_file(tmp_path / "out" / "model.safetensors")
    assert out["w"].dtype == torch.bfloat16 and torch.equal(out["w"].float(), weights["w"])
    with pytest.raises(CheckpointError, match="already holds weights"):
        export_checkpoint(tmp_path / "ckpt", tmp_path / "out", format="safetensors")


def test_the_cli_says_what_it_wrote_or_one_line_why_not(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _save_split(tmp_path / "ckpt", {"w": torch.ones(4, 2)}, None)
    assert main(["export", str(tmp_path / "ckpt"), "--format", "safetensors", "--out",
                 str(tmp_path / "out"), "--json"]) == 0  # fmt: skip
    assert json.loads(capsys.readouterr().out)["tensors"] == 1
    shard = next((tmp_path / "ckpt").glob("step-*/rank-00001.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-3])
    assert main(["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "again")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "rank-00001.safetensors is truncated" in err


@pytest.mark.multiproc
def test_hf_dir_trained_at_lr_0_under_pp_and_tp_exports_bit_equal(tmp_path: Path) -> None:
    source = llama_dir(tmp_path / "source", dtype=torch.bfloat16)
    config = train_config(model=f"hf:{source}", strategy="1x2: R0:L0-1 R1-2:L2-3", global_batch=2,
                         seq_len=16, steps=1, adam=AdamConfig(lr=0.0), save=str(tmp_path / "ckpt"))  # fmt: skip
    train(config)
    result = export_checkpoint(tmp_path / "ckpt", tmp_path / "out")
    assert result.dtype == "bfloat16"  # the source's dtype, from its config
    before, after = (
        load_file(source / "model.safetensors"),
        load_file(tmp_path / "out" / "model.safetensors"),
    )
    assert before.keys() == after.keys()
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert (tmp_path / "out" / "generation_config.json").is_file()  # copied from the source
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
