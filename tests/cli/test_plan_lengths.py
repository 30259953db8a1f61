"""`hspmd plan --data`: a plans file of several strategies for a corpus; bad input exits 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hspmd.cli import main
from hspmd.planner.lengths import load_plans


def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "docs.jsonl"
    lengths = [20] * 40 + [60] * 10 + [200] * 2
    path.write_text("".join(json.dumps({"text": "x" * n}) + "\n" for n in lengths))
    return path


def test_plan_data_writes_versioned_plans(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "plans.json"
    argv = ["plan", "--data", str(corpus(tmp_path)), "--max-seq-len", "256",
            "--tokens-per-step", "1024", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "llama-tiny on local-4" in text and "max 256:" in text
    data = json.loads(out.read_text())
    assert data["version"] == 1 and data["max_len"] == 256
    plans, switch = load_plans(data, str(out))
    assert plans[-1].max_len == 256 and len(switch) == len(plans)
    for p in plans:
        assert all(hi <= p.max_len for _, hi in p.intervals)
        assert max(p.strategy.ranks) < 4
        assert p.predicted_s > 0  # a homogeneous pick said "predicted 0 s"
    assert "predicted 0 s" not in text


def test_plan_data_bad_input_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    base = ["plan", "--max-seq-len", "64", "--tokens-per-step", "256"]
    cases = [
        ([*base, "--data", str(empty)], "the data is empty"),
        ([*base, "--data", str(tmp_path / "missing.txt")], "does not exist"),
        (["plan", "--data", str(empty)], "needs --max-seq-len"),
        (base, "needs --model and --cluster and --global-batch (or --data)"),
        ([*base, "--data", str(empty), "--strategies", "0"], "--strategies 0"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err


def test_plan_data_for_alive_ranks_uses_the_one_planner(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--alive`` (elastic): only those ranks, two pipelines each holding every layer, the
    slowed rank (``--slowdown``) a kind of its own: never in a stage with another rank."""
    out = tmp_path / "plans.json"
    argv = ["plan", "--data", str(corpus(tmp_path)), "--max-seq-len", "256",
            "--tokens-per-step", "512", "--nproc", "4", "--alive", "0,1,3",
            "--slowdown", "3=2", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    plans, switch = load_plans(json.loads(out.read_text()), str(out))
    assert len(switch) == len(plans)
    for p in plans:
        assert set(p.strategy.ranks) <= {0, 1, 3} and len(p.strategy.pipelines) >= 2
        for pipe in p.strategy.pipelines:
            assert pipe.stages[0].first_layer == 0 and pipe.stages[-1].last_layer == 3
            assert all(st.ranks == (3,) or 3 not in st.ranks for st in pipe.stages)
    capsys.readouterr()
    assert main([*argv[:-2], "--slowdown", "3"]) == 2
    assert "is not RANK=FACTOR" in capsys.readouterr().err


NANOGPT = f"{Path(__file__).parents[1] / 'models' / 'data' / 'nanogpt_style.py'}:make"


def test_plan_data_plans_a_captured_model_that_train_plans_takes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """nanoGPT as written, costed from its graph (no sequence parallelism: a captured model
    has none yet); `hspmd train --plans` takes its plans (the steps, without a launch)."""
    from hspmd.cli.plan_lengths import apply_plans, read_plans_file
    from hspmd.train.api import train_config
    from hspmd.train.packing import planned_steps

    data, out = corpus(tmp_path), tmp_path / "plans.json"
    argv = ["plan", "--data", str(data), "--max-seq-len", "32", "--tokens-per-step", "128",
            "--model", NANOGPT, "--strategies", "2", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert "nanogpt_style.py:make on local-4" in capsys.readouterr().out
    plans, _ = load_plans(json.loads(out.read_text()), str(out))
    assert plans[-1].max_len == 32
    config = train_config(NANOGPT, data=str(data), step_tokens=128, seq_len=32, steps=2)
    config = apply_plans(config, read_plans_file(str(out))[0], path=str(out))
    assert not config.options.sequence_parallel
    assert all(0 < step.tokens <= 128 for step in planned_steps(config))
    argv[argv.index("32")] = "64"  # nanoGPT's block_size is 32
    assert main(argv) == 2
    assert "--max-seq-len 64 exceeds" in capsys.readouterr().err


# TP cannot split it (a vocabulary of 255 beside a width of 36), so only PP, DP and context
# parallelism (its fused c_attn leaves the heads whole under TP: `cp_heads`) remain
NANOGPT_CP = '{"block_size": 256, "n_embd": 36, "n_head": 4, "vocab_size": 255}'


@pytest.fixture(scope="module")
def cp_plans(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A captured model's plans for 2 local ranks, a step of 256 tokens: many short
    documents and a few that fill the step."""
    folder = tmp_path_factory.mktemp("cp_plans")
    data, out = folder / "docs.jsonl", folder / "plans.json"
    lengths = [20] * 30 + [250] * 6
    data.write_text("".join(json.dumps({"text": "x" * n}) + "\n" for n in lengths))
    argv = ["plan", "--data", str(data), "--max-seq-len", "256", "--tokens-per-step", "256",
            "--nproc", "2", "--model", NANOGPT, "--config", NANOGPT_CP, "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    return data, out


def test_plan_data_gives_a_captured_model_cp_for_its_long_rows(cp_plans: tuple[Path, Path]) -> None:
    # A 250-token document alone in a step: two one-rank pipelines leave one idle, a CP-2
    # stage halves its layers' tokens and its attention's heads. Short documents: DP.
    _, out = cp_plans
    plans, _ = load_plans(json.loads(out.read_text()), str(out))
    assert plans[-1].max_len == 256 and plans[0].max_len <= 128
    assert [stage.cp for _, _, stage in plans[-1].strategy.stages()] == [2]
    assert all(stage.cp == 1 for p in plans[:-1] for _, _, stage in p.strategy.stages())
    assert all(p.predicted_s > 0 for p in plans)


@pytest.mark.multiproc
def test_a_planned_cp_strategy_of_a_captured_model_trains(
    cp_plans: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    data, out = cp_plans
    argv = ["train", "--plans", str(out), "--data", str(data), "--model", NANOGPT,
            "--config", NANOGPT_CP, "--steps", "3", "--json"]  # fmt: skip
    assert main(argv) == 0
    ours = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert main([*argv, "--reference"]) == 0
    theirs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert any(r.get("strategy") == "2x1: R0-1:L0-2:C2" for r in ours)  # a long step: CP
    for a, b in zip(ours, theirs, strict=True):
        assert a["plan"] == b["plan"] and a["loss"] == pytest.approx(b["loss"], rel=1e-5)


def test_plan_data_predicts_every_chosen_strategy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Where the sample steps choose a homogeneous strategy (here CP 2 for rows of 512), its
    predicted step is its mean over them (it had none of its own: "predicted 0 s")."""
    import random

    rng = random.Random(0)
    path = tmp_path / "docs.jsonl"
    lengths = [max(8, min(int(rng.lognormvariate(5, 1.2)), 4000)) for _ in range(300)]
    path.write_text("".join(json.dumps({"text": "x" * n}) + "\n" for n in lengths))
    out = tmp_path / "plans.json"
    argv = ["plan", "--data", str(path), "--max-seq-len", "512", "--tokens-per-step", "2048",
            "--nproc", "4", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert "predicted 0 s" not in capsys.readouterr().out
    plans, _ = load_plans(json.loads(out.read_text()), str(out))
    assert all(p.predicted_s > 0 for p in plans)
