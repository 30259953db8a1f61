"""A run's records written to a folder: JSON lines, and TensorBoard event files.

``RunLog(folder)`` is a record callback (``train(config, on_step=log)``, ``hspmd train
--log-dir DIR``): one process writes, the one that receives the records (the launcher;
ranks only send them). It appends each record's ``to_json()`` (what ``--json`` prints) as
one line to ``records.jsonl``, and, when the ``tensorboard`` package is installed (the
``logs`` extra), the scalars below through ``torch.utils.tensorboard.SummaryWriter``, with
the step as the global step:

==========================  ======================================================
tag                         value
==========================  ======================================================
``train/loss``              the step's global mean token loss
``train/lr``                its learning rate
``train/grad_norm``         the global gradient norm before clipping (with clipping)
``train/tokens_per_s``      its tokens over its seconds
``train/switch_seconds``    a switch before the step
``eval/loss``               a held-out evaluation's mean token loss
``eval/perplexity``         exp of it
==========================  ======================================================

>>> import json, tempfile
>>> from hspmd.train.config import StepRecord
>>> folder = tempfile.mkdtemp()
>>> with RunLog(folder, tensorboard=False) as log:
...     log(StepRecord(step=1, loss=5.5, tokens=512, seconds=0.25))
>>> json.loads((Path(folder) / "records.jsonl").read_text())
{'step': 1, 'loss': 5.5, 'tokens': 512, 'seconds': 0.25}
"""

from __future__ import annotations

import json
from pathlib import Path
from types import TracebackType
from typing import Any

from hspmd.train.config import EvalRecord, Record, TrainError

__all__ = ["RECORDS", "RunLog", "tensorboard_installed"]

RECORDS = "records.jsonl"
"""The JSON lines file in a log folder."""


def tensorboard_installed() -> bool:
    """The ``tensorboard`` package imports (``pip install 'hspmd[logs]'``)."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


class RunLog:
    """Appends records to ``folder`` (module docstring). ``tensorboard``: write event files
    (None: when the package is installed; True without it is an error)."""

    def __init__(self, folder: str | Path, *, tensorboard: bool | None = None) -> None:
        self.folder = Path(folder)
        if tensorboard is None:
            tensorboard = tensorboard_installed()
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._lines = (self.folder / RECORDS).open("a", encoding="utf-8")
        except OSError as error:
            raise TrainError(
                f"--log-dir {str(folder)!r}: cannot write there ({error.strerror or error}): "
                "give a writable folder"
            ) from None
        self._writer: Any = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.folder))

    @property
    def events(self) -> bool:
        """TensorBoard event files are written."""
        return self._writer is not None

    def __call__(self, record: Record) -> None:
        self._lines.write(json.dumps(record.to_json()) + "\n")
        self._lines.flush()
        if self._writer is None:
            return
        for tag, value in _scalars(record):
            self._writer.add_scalar(tag, value, global_step=record.step)
        self._writer.flush()

    def close(self) -> None:
        self._lines.close()
        if self._writer is not None:
            self._writer.close()

    def __enter__(self) -> RunLog:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _scalars(record: Record) -> list[tuple[str, float]]:
    """The TensorBoard scalars of one record (module docstring's table)."""
    if isinstance(record, EvalRecord):
        return [("eval/loss", record.loss), ("eval/perplexity", record.perplexity)]
    out = [("train/loss", record.loss),
           ("train/tokens_per_s", record.tokens / max(record.seconds, 1e-9))]  # fmt: skip
    if record.lr is not None:
        out.append(("train/lr", record.lr))
    if record.grad_norm is not None:
        out.append(("train/grad_norm", record.grad_norm))
    if record.switch_seconds is not None:
        out.append(("train/switch_seconds", record.switch_seconds))
    return out
