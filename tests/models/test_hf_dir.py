"""``--model hf:DIR``: a Hugging Face folder saved with ``save_pretrained`` (issue 37, item
2): the architecture from its config.json, weights read a slice at a time from its
safetensors files, bad folders refused in one line before launch."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

import transformers  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from hspmd.cli import main  # noqa: E402
from hspmd.models.build import check_weights, initial_piece  # noqa: E402
from hspmd.models.module import load_model  # noqa: E402
from hspmd.plan.identity import ModelIdentity  # noqa: E402
from hspmd.train.api import train_config
from hspmd.train.batches import step_batches  # noqa: E402
from hspmd.train.trainer import train  # noqa: E402
from tests.models.data.hf_dirs import llama_dir  # noqa: E402


def _stored(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in folder.glob("*.safetensors"):
        out |= load_file(path)
    return out


def test_the_architecture_comes_from_config_json(tmp_path: Path) -> None:
    model = load_model(f"hf:{llama_dir(tmp_path)}")
    assert model.convention == "hf" and model.blocks == "model.layers"
    assert (model.num_layers, model.hidden_size, model.vocab_size) == (4, 32, 256)
    assert json.loads(model.hf_config)["model_type"] == "llama"
    assert model.param_kind("model.layers.0.self_attn.q_proj.weight") == "column"
    two = load_model(f"hf:{tmp_path}", {"num_hidden_layers": 2})  # --config overrides
    assert two.num_layers == 2 and json.loads(two.hf_config)["num_hidden_layers"] == 2


@pytest.mark.parametrize("shards", [None, "20KB"])
def test_weights_are_read_slice_by_slice(tmp_path: Path, shards: str | None) -> None:
    folder = llama_dir(tmp_path, shard_size=shards)
    assert (folder / "model.safetensors.index.json").is_file() == (shards is not None)
    model, stored = load_model(f"hf:{folder}"), _stored(folder)
    for name, shape in model.parameter_shapes().items():
        region = ((0, shape[0] // 2),) + tuple((1, n) for n in shape[1:])
        part = initial_piece(model, name, seed=0, region=region)
        assert torch.equal(part, stored[name][tuple(slice(a, b) for a, b in region)]), name


def test_bf16_weights_become_exact_fp32_masters(tmp_path: Path) -> None:
    folder = llama_dir(tmp_path, dtype=torch.bfloat16)
    model, stored = load_model(f"hf:{folder}"), _stored(folder)
    name = "model.layers.1.mlp.down_proj.weight"
    value = initial_piece(model, name, seed=0, region=None)
    assert value.dtype == torch.float32 and torch.equal(value.to(torch.bfloat16), stored[name])


def test_tied_weights_are_read_under_the_name_the_file_keeps(tmp_path: Path) -> None:
    folder = llama_dir(tmp_path, tie_word_embeddings=True)
    model = load_model(f"hf:{folder}")
    assert model.tie_embeddings and "lm_head.weight" not in _stored(folder)
    embed = initial_piece(model, "model.embed_tokens.weight", seed=0, region=None)
    assert torch.equal(embed, _stored(folder)["model.embed_tokens.weight"])


def test_without_weights_the_models_own_initialization_starts_it(tmp_path: Path) -> None:
    folder = llama_dir(tmp_path)
    (folder / "model.safetensors").unlink()
    model = load_model(f"hf:{folder}")
    check_weights(model)  # nothing to check
    q = initial_piece(model, "model.layers.0.self_attn.q_proj.weight", seed=0, region=None)
    assert q.std().item() == pytest.approx(0.02, rel=0.15)  # initializer_range
    assert torch.equal(
        initial_piece(model, "model.norm.weight", seed=0, region=None), torch.ones(32)
    )


def test_identity_carries_the_architecture_not_the_folder(tmp_path: Path) -> None:
    one = llama_dir(tmp_path / "one")
    two = Path(shutil.copytree(one, tmp_path / "two"))
    ids = [ModelIdentity.of(load_model(f"hf:{f}"), source=f"hf:{f}") for f in (one, two)]
    assert ids[0].config and ids[0].matches(ids[1])
    three = Path(shutil.copytree(one, tmp_path / "three"))
    config = json.loads((three / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5  # the same shapes, another model
    (three / "config.json").write_text(json.dumps(config))
    other = ModelIdentity.of(load_model(f"hf:{three}"), source=f"hf:{three}")
    assert not ids[0].matches(other)


def _refused(folder: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> str:
    code = main(["train", "--model", f"hf:{folder}", "--strategy", "1x1: R0:L0-3",
                 "--seq-len", "8", "--steps", "1", *extra])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    return err


def test_bad_folders_are_one_line_before_launch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--model", f"hf:{tmp_path / 'none'}"])
    assert "config.json" in capsys.readouterr().err
    folder = llama_dir(tmp_path / "llama")
    err = _refused(folder, capsys, "--config", '{"intermediate_size": 48}')
    assert "holds model.layers.0.mlp.gate_proj.weight as [64, 32]" in err
    path = folder / "model.safetensors"
    weights = load_file(path)
    save_file({**weights, "model.norm.weight": torch.ones(32, dtype=torch.int32)}, path)
    assert "holds model.norm.weight as I32, not a floating-point dtype" in _refused(folder, capsys)
    save_file(weights, path)
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 100)
    assert "is truncated" in _refused(folder, capsys)
    path.unlink()
    (folder / "pytorch_model.bin").write_bytes(b"pickle")
    assert "safetensors only" in _refused(folder, capsys)
    other = tmp_path / "other"  # a new folder: this process has read the first already
    other.mkdir()
    config = json.loads((folder / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "no-such-model"}))
    assert "trust_remote_code is off" in _refused(other, capsys)


@pytest.mark.multiproc
def test_the_first_loss_is_the_loss_transformers_computes(tmp_path: Path) -> None:
    folder = llama_dir(tmp_path)
    config = train_config(model=f"hf:{folder}", strategy="1x2: R0:L0-1 R1-2:L2-3",
                         global_batch=2, seq_len=16, steps=1)  # fmt: skip
    got = train(config).losses[0]
    tokens, targets = next(step_batches(config))
    whole = torch.cat([tokens, targets[:, -1:]], dim=1)  # targets are tokens shifted by one
    assert torch.equal(whole[:, 1:], targets)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        want = hf(input_ids=whole, labels=whole).loss.item()  # transformers shifts the labels
    assert abs(got - want) < 1e-5, (got, want)
