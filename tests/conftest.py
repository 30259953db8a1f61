"""Suite-wide hooks: one summary line when the shared ParDNN graphs are absent; the
forkserver preloads torch._dynamo."""

from __future__ import annotations

from typing import Any

from hspmd.runtime.launch import preload

# The launcher's forkserver imports torch._dynamo once for every worker of the suite's
# in-process launches: meta-device runs of user modules import it on first use
# (docs/runtime.md). Subprocesses (CLI tests) keep the plain preload.
preload("torch._dynamo")

SHARED_SKIP = "shared ParDNN graphs not found"


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Say in one line why tests skipped for want of ``../shared/data/pardnn`` (a fresh clone
    outside the project's workspace has no such folder), instead of leaving it to ``-rs``."""
    skipped = terminalreporter.stats.get("skipped", [])
    missing = [r for r in skipped if SHARED_SKIP in str(getattr(r, "longrepr", ""))]
    if missing:
        terminalreporter.write_line(
            f"note: {len(missing)} ParDNN tests skipped: the authors' graphs are not at "
            "../shared/data/pardnn beside this checkout (the rest of the suite ran)"
        )
