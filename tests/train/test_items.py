"""Training on a user's dataset of any items (``--dataset``, issue 37 item 4): an image-style
model on synthetic dict and tuple items under DP, PP, TP and a heterogeneous strategy, each
equal to the single-device reference; and the refusals before launch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hspmd.cli import main
from hspmd.cost.captured import planning_model
from hspmd.errors import HspmdError
from hspmd.models.spec import ModelSpecError
from hspmd.plan.strategy import StrategyOptions, parse_strategy
from hspmd.specialize.executable import build_executable
from hspmd.train.api import train_config
from hspmd.train.batches import step_batches
from hspmd.train.config import TrainConfig
from hspmd.train.reference import run_reference
from hspmd.train.trainer import train_many

DATA = Path(__file__).parents[1] / "models" / "data" / "image_items.py"
MODEL, IMAGES, PAIRS, STREAM = (f"{DATA}:{n}" for n in ("make", "images", "pairs", "stream"))


def _config(strategy: str, dataset: str = IMAGES, **fields: object) -> TrainConfig:
    given = {"model": MODEL, "dataset": dataset, "global_batch": 8, "steps": 2, **fields}
    return train_config(strategy=strategy, **given)  # type: ignore[arg-type]


def test_the_fields_are_the_graphs_inputs_and_tp_splits_the_blocks() -> None:
    model = _config("4x2: R0-1:L0-1").model_config()
    assert [(f.name, f.shape, f.dtype, f.layer) for f in model.batch] == [  # type: ignore[attr-defined]
        ("image", (1, 8, 8), "float32", 0), ("label", (), "int64", 1)]  # fmt: skip
    assert model.stream == (16,) and model.param_kind("layers.0.up.weight") == "column"  # type: ignore[attr-defined]
    exe = build_executable(model, parse_strategy("4x2: R0-1:L0-1"), StrategyOptions(), 1,
                           seq_len=1, seed=0)  # fmt: skip
    assert "def forward(self, image, label, segments = None, key = None):" in (
        exe.graph_module.code
    )
    kept = " ".join(exe.comm)
    assert "layers.1.up.tp_in" in kept and "layers.1.down.tp_out" in kept, exe.comm
    assert exe.params["layers.0.up.weight"].shape == (16, 16)  # (2 * 16) / 2 rows


def test_explain_takes_it_and_simulate_refuses_in_one_line(capsys) -> None:
    model = ["--model", MODEL, "--dataset", IMAGES, "--strategy", "4x2: R0-1:L0 R2:L1"]
    assert main(["explain", *model]) == 0
    out = capsys.readouterr().out
    assert "rank 2: pipeline 0 stage 1 tp=1 layers 1-1" in out, out
    assert "F (per micro-batch): all-reduce x1 in [0,1]" in out, out
    assert main(["simulate", *model, "--cluster", "h200x8"]) == 2
    err = capsys.readouterr().err.strip()
    assert "cannot plan or simulate this one yet" in err and "\n" not in err, err
    with pytest.raises(ModelSpecError, match="cannot plan or simulate"):
        planning_model(_config("4x2: R0:L0 R1:L1").model_config())


def test_a_saved_plan_names_the_fields_and_explain_reads_it(tmp_path: Path, capsys) -> None:
    model = ["--model", MODEL, "--dataset", IMAGES]
    path = str(tmp_path / "plan.json")
    assert main(["train", *model, "--strategy", "4x2: R0-1:L0 R2:L1", "--save-plan", path]) == 0
    inputs = json.loads(Path(path).read_text())["inputs"]
    assert inputs == {"image": {"shape": [2, 1, 8, 8], "annotation": "[0,1]{D:2}"},
                      "label": {"shape": [2], "annotation": "[2]{}"}}  # fmt: skip
    capsys.readouterr()
    assert main(["explain", *model, "--plan", path]) == 0
    assert "rank 2: pipeline 0 stage 1 tp=1 layers 1-1" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"model": "llama-tiny"}, "give --model FILE.py:FACTORY"),
        ({"data": "corpus.txt"}, "does not combine with --data"),
        ({"sequence_parallel": True}, "does not combine with --sequence-parallel"),
        ({"dataset": f"{DATA}:renamed"}, "does not take the dataset's fields label, pixels as keywords"),
        ({"model": f"{DATA}:make_leaky"}, "the field image is read before the first block and after it"),
    ],
)  # fmt: skip
def test_what_a_dataset_run_cannot_do_is_one_line(fields: dict[str, object], words: str) -> None:
    with pytest.raises(HspmdError) as error:
        _config("4x2: R0:L0 R1:L1", **fields)
    assert words in str(error.value) and "\n" not in str(error.value), str(error.value)


CASES: dict[str, tuple[str, str, dict[str, object]]] = {
    "pp": ("4x2: R0:L0 R1:L1", IMAGES, {}),
    "tp": ("4x2: R0-1:L0-1", IMAGES, {}),
    # DP over two pipelines of micro-batches of 2 and 1, PP and TP in the first
    "hetero": ("2x2: R0-1:L0 R2:L1; 4x1: R3:L0-1", IMAGES, {}),
}


@pytest.mark.multiproc
def test_dp_pp_tp_and_heterogeneous_runs_equal_the_reference() -> None:
    configs = {name: _config(s, d, **f) for name, (s, d, f) in CASES.items()}
    results = train_many(list(configs.values()), threads=1, timeout_s=600)
    for (name, config), got in zip(configs.items(), results, strict=True):
        want = run_reference(config)
        for a, b in zip(got.losses, want.losses, strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), (name, got.losses, want.losses)
        for key, value in want.params.items():
            torch.testing.assert_close(got.params[key], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.multiproc
def test_the_cli_trains_tuple_items_equal_to_its_reference(capsys) -> None:
    argv = ["train", "--model", MODEL, "--dataset", PAIRS, "--strategy", "2x2: R0:L0 R1:L1; 4x1: R2:L0-1",
            "--steps", "2", "--grad-accum", "2", "--json", "--quiet"]  # fmt: skip
    assert main(argv) == 0
    got = [json.loads(line)["loss"] for line in capsys.readouterr().out.splitlines()]
    assert main([*argv, "--reference"]) == 0
    want = [json.loads(line)["loss"] for line in capsys.readouterr().out.splitlines()]
    assert len(got) == 2 and max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-5


def test_step_k_drawn_alone_equals_the_streams_kth() -> None:
    """A resume, a switch or an elastic redo at step k reads what step k read."""
    for dataset in (IMAGES, STREAM):
        config = _config("4x2: R0:L0 R1:L1", dataset, steps=4, grad_accum=2)
        every = list(step_batches(config))
        alone = next(step_batches(config, first=3))
        assert [t.shape[0] for t in alone] == [16, 16]
        assert all(torch.equal(a, b) for a, b in zip(alone, every[2], strict=True))
        assert not torch.equal(every[2][0], every[1][0])


def test_bf16_takes_floating_fields_in_bf16() -> None:
    """Under ``--dtype bf16`` the module is captured in bf16 (``hspmd.models.module``), and
    so are its floating fields, as the loop feeds them; integer fields stay as they are."""
    model = _config("4x2: R0:L0-1", dtype="bf16").model_config()
    assert [f.dtype for f in model.batch] == ["bfloat16", "int64"]  # type: ignore[attr-defined]
    exe = build_executable(model, parse_strategy("4x2: R0:L0-1"), StrategyOptions(), 0,
                           seq_len=1, seed=0)  # fmt: skip
    exe.graph_module.to(torch.bfloat16)
    image = torch.randn(2, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    loss = exe.forward(image.bfloat16(), torch.tensor([1, 2]))
    assert loss.dtype == torch.bfloat16 and 1.0 < loss.item() < 4.0, loss
