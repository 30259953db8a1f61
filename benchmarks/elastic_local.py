"""Elastic recovery on local processes, side by side: in-process against checkpoint+restart.

One rank of a local ``hspmd train`` run is killed (SIGKILL, by ``--inject-failure
RANK@STEP``, which stamps the time of the kill) and the time from the kill to the next
completed step is measured two ways in one run of this script:

- **in-process** (``--elastic``): the survivors detect the death, regroup, re-plan, move
  the states from surviving replicas and redo the step;
- **restart**: the same run without ``--elastic``, saving a checkpoint after every step
  (``--save DIR --save-every 1``); the kill ends it, and it is relaunched at once with
  ``--resume DIR`` on the plan the in-process run chose (the survivors), as
  ``torchrun --max-restarts`` would, minus torchrun's own rendezvous.

The clock is the kill's own stamp and the arrival of the next step's JSON line here, so
the restart's time includes the failed run's teardown, the new interpreter, process start,
executables and the checkpoint load. Work lost: the step in flight in both, plus the
completed steps done again ("steps redone": none with a checkpoint every step; the
restart's checkpoints cost time every step instead). Both runs' losses from the kill on
must agree (fp32, 1e-5): the check runs every time.

    .venv/bin/python benchmarks/elastic_local.py
    .venv/bin/python benchmarks/elastic_local.py --kill 0@4 --repeats 3 --steps 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

STRATEGY = "2x2: R0:L0-1 R1:L2-3; 2x2: R2-3:L0-3"  # a PP pipeline and a TP pipeline
LINE = "hspmd: injected kill of rank"


@dataclass
class Run:
    """One ``hspmd train`` process: its JSON lines and stderr lines with arrival times."""

    lines: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    errors: list[tuple[float, str]] = field(default_factory=list)
    code: int = 0
    ended: float = 0.0  # when the process exited

    def steps(self) -> list[tuple[float, dict[str, Any]]]:
        return [(t, x) for t, x in self.lines if "step" in x and "event" not in x]

    def events(self, kind: str) -> list[dict[str, Any]]:
        return [x for _, x in self.lines if x.get("event") == kind]

    def kill_time(self) -> float:
        for _, text in self.errors:
            if text.startswith(LINE):
                return float(text.rsplit(" at ", 1)[1])
        raise RuntimeError("no injected kill in the run's stderr:\n" + self.stderr())

    def stderr(self) -> str:
        return "\n".join(text for _, text in self.errors[-20:])


def train(args: list[str], *, timeout_s: float) -> Run:
    """Run ``hspmd train ARGS --json``; collect its lines as they arrive."""
    command = [sys.executable, "-m", "hspmd", "train", *args, "--json"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run = Run()

    def read_err() -> None:
        assert proc.stderr is not None
        for text in proc.stderr:
            run.errors.append((time.time(), text.rstrip()))

    reader = threading.Thread(target=read_err, daemon=True)
    reader.start()
    assert proc.stdout is not None
    for text in proc.stdout:
        if text.startswith("{"):
            run.lines.append((time.time(), json.loads(text)))
    try:
        run.code = proc.wait(timeout_s)
        run.ended = time.time()
    except subprocess.TimeoutExpired:
        proc.kill()
        raise RuntimeError(f"{' '.join(command)} ran past {timeout_s} s") from None
    reader.join(5.0)
    return run


def first_step_after(run: Run, moment: float, *, step: int) -> tuple[float, dict[str, Any]]:
    """The record of ``step`` (the one the kill interrupted, done again) arriving after
    ``moment`` (a record of the step before may arrive after the kill: skipped)."""
    return next((t, x) for t, x in run.steps() if t > moment and x["step"] >= step)


def one_trial(common: list[str], *, kill: str, timeout_s: float) -> dict[str, Any]:
    """The in-process run, then the restart pair; the figures of both."""
    elastic = train([*common, "--elastic", "--inject-failure", kill], timeout_s=timeout_s)
    if elastic.code != 0 or not elastic.events("resumed"):
        raise RuntimeError("the elastic run did not recover:\n" + elastic.stderr())
    killed = elastic.kill_time()
    failure = elastic.events("failure")[0]
    at, record = first_step_after(elastic, killed, step=failure["step"])
    resumed = elastic.events("resumed")[0]
    survivors = elastic.events("replan")[-1]["strategy"]
    with tempfile.TemporaryDirectory() as folder:
        first = train([*common, "--save", folder, "--save-every", "1", "--inject-failure", kill],
                      timeout_s=timeout_s)  # fmt: skip
        if first.code == 0:
            raise RuntimeError("the restart baseline's run survived the kill")
        restart_killed = first.kill_time()
        index = common.index("--strategy")
        again = [*common[:index], *common[index + 2 :], "--strategy", survivors]
        second = train([*again, "--resume", folder], timeout_s=timeout_s)
        if second.code != 0:
            raise RuntimeError("the resumed run failed:\n" + second.stderr())
    restart_at, restart_record = second.steps()[0]
    _check_same_losses(elastic, second, since=restart_record["step"])
    return {
        "inprocess_s": at - killed,
        "detected_s": failure["detected_after_s"],
        "recovery_s": resumed["recovery_seconds"],
        "moved_bytes": resumed["moved_bytes"],
        # completed steps done again: (the kill's step - 1) - (the next step run) + 1
        "inprocess_lost_steps": failure["step"] - record["step"],
        "restart_s": restart_at - restart_killed,
        "restart_teardown_s": first.ended - restart_killed,
        "restart_lost_steps": failure["step"] - restart_record["step"],
        "survivors": survivors,
    }


def _check_same_losses(a: Run, b: Run, *, since: int) -> None:
    mine = {x["step"]: x["loss"] for _, x in a.steps()}
    for _, x in b.steps():
        if x["step"] >= since and abs(mine[x["step"]] - x["loss"]) > 1e-5 * abs(x["loss"]):
            raise RuntimeError(
                f"step {x['step']}: in-process loss {mine[x['step']]} but restart {x['loss']}"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--strategy", default=STRATEGY)
    parser.add_argument("--kill", default="1@4", metavar="RANK@STEP", help="who dies, when")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per train run")
    args = parser.parse_args(argv)
    common = [
        "--model", "llama-tiny", "--strategy", args.strategy, "--global-batch", "8",
        "--seq-len", "64", "--steps", str(args.steps), "--hang-timeout", "30",
    ]  # fmt: skip
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    trials = [
        one_trial(common, kill=args.kill, timeout_s=args.timeout) for _ in range(args.repeats)
    ]
    med = {k: statistics.median(t[k] for t in trials) for k in trials[0] if k != "survivors"}
    print(f"llama-tiny, {args.strategy!r}, kill {args.kill} (SIGKILL), {args.repeats} trial(s), "
          f"medians; survivors re-planned to {trials[0]['survivors']!r}")  # fmt: skip
    print(f"{'path':<28} {'kill -> next step':>18} {'steps redone':>13}")
    print(f"{'in-process (--elastic)':<28} {med['inprocess_s']:>16.3f} s "
          f"{med['inprocess_lost_steps']:>13.0f}")  # fmt: skip
    print(f"{'checkpoint + restart':<28} {med['restart_s']:>16.3f} s "
          f"{med['restart_lost_steps']:>13.0f}")  # fmt: skip
    print(f"in-process: detected after {med['detected_s']:.3f} s, recovered in "
          f"{med['recovery_s']:.3f} s, {med['moved_bytes'] / 1e6:.2f} MB of states moved")  # fmt: skip
    print(f"restart: the killed run ended {med['restart_teardown_s']:.3f} s after the kill; "
          f"the relaunch took the rest (interpreter, processes, executables, checkpoint)")  # fmt: skip
    ratio = med["restart_s"] / med["inprocess_s"]
    print(f"restart / in-process: {ratio:.1f}x (goal >= 5x)")
    print(json.dumps({
        "benchmark": "elastic_local", "strategy": args.strategy, "kill": args.kill,
        "repeats": args.repeats, **{k: round(v, 6) for k, v in med.items()},
        "restart_over_inprocess": round(ratio, 3), "trials": trials,
    }))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
