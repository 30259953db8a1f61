"""``hspmd train --elastic`` flags: bad values are one line and exit 2, before any process
starts; the parsers and the event lines (no processes here)."""

from __future__ import annotations

import pytest

from hspmd.cli import main
from hspmd.cli.train import event_text
from hspmd.train.faults import Injection, InjectionError, parse_injections

TWO = "2x2: R0:L0-3; 2x2: R1:L0-3"
NODES = ["--nnodes", "2", "--master-addr", "127.0.0.1"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--elastic", "--zero1"], "--elastic does not take --zero"),
        (["--elastic", "--switch", "3=2x2: R0:L0-3; 2x2: R1:L0-3"], "does not take --switch"),
        (["--elastic", "--hang-timeout", "0"], "hang_timeout=0.0: give a positive number"),
        (["--elastic", "--inject-failure", "1@x"], "write RANK@STEP[:PHASE[:kill|hang]]"),
        (["--elastic", "--inject-failure", "1@2:lunch"], "phase 'lunch' is none of"),
        (["--elastic", "--inject-failure", "1@2:sync:nap"], "mode 'nap' is not kill or hang"),
        (["--elastic", "--inject-failure", "5@2"], "names a rank the run does not have"),
        (["--inject-failure", "1@2:sync"], "without --elastic only a kill in forward"),
        (["--elastic", "--trace", "run.json"], "--elastic does not take --trace/--timeline"),
        (["--elastic", "--timeline", "run.png"], "--elastic does not take --trace/--timeline"),
        (["--elastic", "--spares", "1", *NODES], "--spares holds processes back on one launcher"),
        (
            ["--elastic", "--nnodes", "3", "--master-addr", "127.0.0.1"],
            "2 ranks do not split evenly over 3 nodes",
        ),
        (["--elastic", "--grow", "3=1"], "--grow adds 1 ranks but --spares is 0"),
    ],
)
def test_bad_elastic_flags_are_one_line(extra: list[str], message: str, capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["train", "--strategy", TWO, "--steps", "2", *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_elastic_needs_two_pipelines(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["train", "--strategy", "2x2: R0-1:L0-3", "--elastic"]) == 2
    assert "--elastic needs data-parallel redundancy" in capsys.readouterr().err


def test_elastic_plans_need_two_pipelines_each(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """Every strategy of a plans file is one the run may choose: each needs replicas."""
    import json

    from tests.cli.test_train_plans import write_inputs

    plans, data = write_inputs(tmp_path)
    content = json.loads(plans.read_text())
    content["strategies"][1]["strategy"] = "1x1: R0-1:L0-1 R2-3:L2-3"
    content["strategies"][1]["pipelines"] = content["strategies"][1]["pipelines"][:1]
    plans.write_text(json.dumps(content))
    argv = ["train", "--plans", str(plans), "--data", str(data), "--elastic", "--steps", "2"]
    assert main(argv) == 2
    assert "--elastic needs data-parallel redundancy" in capsys.readouterr().err


def test_injections_parse_with_defaults() -> None:
    assert parse_injections(["3@2", "0@1:save:hang"]) == (
        Injection(3, 2, "forward", "kill"),
        Injection(0, 1, "save", "hang"),
    )
    with pytest.raises(InjectionError, match="steps count from 1"):
        parse_injections(["1@0"])


def test_event_lines_read_well() -> None:
    failure = {"event": "failure", "rank": 2, "phase": "sync", "step": 3, "cause": "hang",
               "exit_code": -9, "detected_after_s": 3.1}  # fmt: skip
    assert event_text(failure) == "failure: rank 2 hung in sync of step 3; detected after 3.100 s"
    node = dict(failure, cause="node", exit_code=None, detected_after_s=2.0)
    assert event_text(node) == (
        "failure: rank 2 was lost with its node (its launcher went silent) in sync of step 3; "
        "detected after 2.000 s"
    )
    replan = {"event": "replan", "strategy": "2x2: R0:L0-3; 2x2: R1:L0-3", "plan_seconds": 0.05}
    assert event_text(replan) == "replan: '2x2: R0:L0-3; 2x2: R1:L0-3' planned in 50 ms"
