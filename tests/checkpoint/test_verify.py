"""Checkpoints name what they need, not where it was (issue 37, item 5): a resume compares
the model's structure, not its file's path; missing, truncated or corrupt shards are one
line before launch."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hspmd.annotation import parse_annotation
from hspmd.checkpoint import load_rank_state, save
from hspmd.checkpoint.store import CheckpointError
from hspmd.checkpoint.verify import check_checkpoint
from hspmd.cli import main
from hspmd.errors import StrategyError
from hspmd.plan.params import ParamSpec
from hspmd.train.api import revise, train_config
from hspmd.train.identity import check_resume_identity
from hspmd.train.reference import run_reference
from hspmd.train.trainer import train

DATA = Path(__file__).parents[1] / "models" / "data"


def _two_shards(folder: Path) -> Path:
    specs = {"param/w": ParamSpec("param/w", (4, 2), parse_annotation("[0,1]{0:2}"))}
    tensors = {0: {"param/w": torch.zeros(2, 2)}, 1: {"param/w": torch.ones(2, 2)}}
    return save(folder, step=1, model="m", strategy="s", specs=specs, tensors_by_rank=tensors)


def test_a_whole_checkpoint_passes(tmp_path: Path) -> None:
    _two_shards(tmp_path)
    assert check_checkpoint(tmp_path).step == 1


@pytest.mark.parametrize(
    ("damage", "says"),
    [
        (lambda p: p.unlink(), "lacks rank-00001.safetensors"),
        (lambda p: p.write_bytes(p.read_bytes()[:-1]), "is truncated"),
        (lambda p: p.write_bytes(b"\x10" + p.read_bytes()[1:]), "corrupt header"),
        (lambda p: p.write_bytes(b"junk"), "is not a safetensors file or is truncated"),
    ],
)
def test_a_damaged_shard_is_named_in_one_line(
    tmp_path: Path, damage: Callable[[Path], object], says: str
) -> None:
    folder = _two_shards(tmp_path)
    damage(folder / "rank-00001.safetensors")
    with pytest.raises(CheckpointError, match=says) as error:
        check_checkpoint(tmp_path)
    assert "\n" not in str(error.value)


def test_resume_with_a_truncated_shard_is_refused_before_launch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _two_shards(tmp_path / "ckpt")
    shard = folder / "rank-00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:-2])
    code = main(["train", "--strategy", "1x1: R0:L0-3", "--steps", "2", "--seq-len", "8",
                 "--resume", str(tmp_path / "ckpt")])  # fmt: skip
    err = capsys.readouterr().err.strip()
    errors = [line for line in err.splitlines() if line.startswith("hspmd train: error")]
    assert code == 2 and len(errors) == 1 and "is truncated" in errors[0], err
    assert "Traceback" not in err


def _copy(tmp_path: Path, name: str) -> str:
    return f"{shutil.copy(DATA / 'nanogpt_style.py', tmp_path / name)}:make"


@pytest.mark.multiproc
def test_a_copy_of_the_model_file_under_another_name_resumes(tmp_path: Path) -> None:
    base = train_config(model=_copy(tmp_path, "model_a.py"), strategy="2x1: R0:L0-2",
                       global_batch=2, seq_len=16, steps=1, save=str(tmp_path / "ckpt"))  # fmt: skip
    train(base)
    copy = revise(base, model=_copy(tmp_path, "model_b.py"), steps=2, save=None,
                               resume=str(tmp_path / "ckpt"))  # fmt: skip
    check_resume_identity(copy)  # by structure: the same model
    resumed = train(copy).losses
    want = run_reference(revise(base, steps=2, save=None, strategy=None)).losses
    assert abs(resumed[-1] - want[-1]) < 1e-5, (resumed, want)
    other = revise(copy, model_kwargs=(("n_layer", 2),))
    with pytest.raises(StrategyError, match="is for model .*model_a.py"):
        check_resume_identity(other)
    state = load_rank_state(tmp_path / "ckpt", rank=0, param_specs={}, model="another name")
    assert state.step == 1  # the source string is not compared where an identity is kept
