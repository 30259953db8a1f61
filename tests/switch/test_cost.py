"""switch-cost: the C1 -> C2 reconfiguration of the paper, small cases, errors, the CLI."""

from __future__ import annotations

import json

import pytest

from hspmd.cli import main
from hspmd.errors import HspmdError
from hspmd.switch import ALGOS, SwitchError, load_cluster, switch_cost

C1 = (
    "16x2: R0-3:L0-14 R4-7:L15-29 R8-11:L30-44 R12-15:L45-59; "
    "16x2: R16-19:L0-14 R20-23:L15-29 R24-27:L30-44 R28-31:L45-59"
)
C2 = (
    "33x1: R0-3:L0-14 R4-7:L15-29 R8-11:L30-44 R12-15:L45-59; "
    "31x1: R16-19:L0-15 R20-23:L16-31 R24-27:L32-47 R28-29:L48-55 R30:L56-59"
)


def test_c1_to_c2_all_algorithms() -> None:
    cluster = load_cluster("h20x32")
    costs = {
        algo: switch_cost(
            model="llama-32b", source=C1, target=C2, cluster=cluster, algo=algo, failed=(31,)
        )
        for algo in ALGOS
    }
    plain = costs["fused"].estimate.total()
    assert costs["naive"].estimate.total() == plain == costs["per-tensor"].estimate.total()
    assert costs["naive"].estimate.total("nvlink") == 0  # the lowest owner is in pipeline 0
    assert costs["fused"].estimate.total("nvlink") > 0.5 * plain
    assert costs["fused"].estimate.time <= costs["naive"].estimate.time
    assert costs["relay"].estimate.time <= 0.5 * costs["fused"].estimate.time
    assert costs["fused"].num_messages < costs["per-tensor"].num_messages
    assert 31 not in costs["relay"].estimate.sent
    bf16 = switch_cost(
        model="llama-32b", source=C1, target=C2, cluster=cluster, algo="fused", states="bf16",
        failed=(31,),
    )  # fmt: skip
    assert bf16.estimate.total() * 6 == pytest.approx(plain)


def test_small_switch_exact_volumes() -> None:
    # llama-tiny, TP2 on ranks 0-1 -> one rank 8 (other node): rank 0 and 1 each send half.
    cost = switch_cost(
        model="llama-tiny", source="1x1: R0-1:L0-3", target="1x1: R8:L0-3",
        cluster=load_cluster("h20x32"), algo="naive", states="bf16",
    )  # fmt: skip
    sent = cost.estimate.sent
    assert set(sent) == {0, 1} and set(sent[0]) == {"ib"}
    total = sum(2 * n for n in _numels("llama-tiny"))
    assert cost.estimate.total() == total
    assert cost.slowest_rank == 8


def _numels(model: str) -> list[int]:
    import math

    from hspmd.models import get_config, parameter_shapes

    return [math.prod(s) for s in parameter_shapes(get_config(model)).values()]


def test_errors() -> None:
    cluster = load_cluster("h20x32")
    with pytest.raises(HspmdError, match="unknown model"):
        switch_cost(model="gpt", source=C1, target=C2, cluster=cluster, algo="fused")
    with pytest.raises(HspmdError, match="rank 32"):
        switch_cost(model="llama-32b", source=C1, target="1x1: R32-35:L0-59", cluster=cluster,
                    algo="fused")  # fmt: skip
    with pytest.raises(HspmdError, match="layers"):
        switch_cost(model="llama-tiny", source=C1, target=C2, cluster=cluster, algo="fused")
    with pytest.raises(SwitchError, match="only by failed ranks"):
        switch_cost(model="llama-tiny", source="1x1: R0:L0-3", target="1x1: R1:L0-3",
                    cluster=cluster, algo="fused", failed=(0,))  # fmt: skip
    with pytest.raises(SwitchError, match="in the new strategy"):
        switch_cost(model="llama-tiny", source="1x1: R0:L0-3", target="1x1: R1:L0-3",
                    cluster=cluster, algo="fused", failed=(1,))  # fmt: skip
    with pytest.raises(SwitchError, match="algorithm"):
        switch_cost(model="llama-tiny", source="1x1: R0:L0-3", target="1x1: R1:L0-3",
                    cluster=cluster, algo="magic")  # fmt: skip


def test_cli(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["switch-cost", "--model", "llama-32b", "--from", C1, "--to", C2,
            "--cluster", "h20x32", "--algo", "relay", "--failed", "31"]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "slowest rank R29" in text and "nvlink GB" in text and "recv GB" in text
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["algo"] == "relay" and data["slowest_rank"] == 29 and data["seconds"] < 0.2
    assert main([*argv[:-2], "--cluster", "hetu-h800-h20", "--model", "llama-70b"]) == 2
    assert "80 layers" in capsys.readouterr().err


def test_cli_received_bytes_and_small_units(capsys: pytest.CaptureFixture[str]) -> None:
    # Issue 17: receivers are rows too (a rank's busy time depends on what it receives), and
    # a tiny model's volumes print in a unit that shows them.
    argv = ["switch-cost", "--model", "llama-tiny", "--cluster", "h20x32",
            "--from", "4x1: R0:L0-1 R1:L2-3", "--to", "4x1: R1:L0-1 R0:L2-3"]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "nvlink KB" in text and "recv KB" in text
    rows = {line.split()[0]: line.split()[1:] for line in text.splitlines()[2:-1]}
    assert float(rows["R0"][0]) > 0 and float(rows["R1"][0]) > 0  # each sends its half
    assert rows["R0"][2] == rows["R1"][0] and rows["R1"][2] == rows["R0"][0]  # the other gets it
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    sent = sum(sum(per.values()) for per in data["sent_bytes"].values())
    received = sum(sum(per.values()) for per in data["received_bytes"].values())
    assert sent == received == data["total_bytes"] > 0
