"""Output paths: checked before a command does its work (a typo never costs a finished run),
then written with one line on failure."""

from __future__ import annotations

import sys
from pathlib import Path

from hspmd.checkpoint.store import foreign_checkpoint
from hspmd.errors import HspmdError

__all__ = ["check_out_folder", "check_save_folder", "write_out"]


def check_out_folder(path: str, flag: str) -> None:
    """Refuse ``path`` (given as ``flag``) when the folder it goes in does not exist.

    >>> check_out_folder("/nonexistent/p.json", "--out")
    Traceback (most recent call last):
    hspmd.errors.HspmdError: --out '/nonexistent/p.json': folder '/nonexistent' does not exist: create it first
    """
    folder = Path(path).parent
    if not folder.is_dir():
        raise HspmdError(f"{flag} {path!r}: folder {str(folder)!r} does not exist: create it first")


def check_save_folder(save: str | None, resume: str | None) -> None:
    """Refuse ``--save save`` when it already holds a complete checkpoint that this run does
    not continue (``hspmd.checkpoint.store.foreign_checkpoint``).

    >>> import tempfile; d = Path(tempfile.mkdtemp()); (d / "step-00000004").mkdir()
    >>> _ = (d / "step-00000004" / "manifest.json").write_text("{}")
    >>> check_save_folder(str(d), str(d))
    >>> check_save_folder(str(d), None)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    hspmd.errors.HspmdError: --save ... already holds checkpoint step-00000004 of another run: ...
    """
    held = None if save is None else foreign_checkpoint(save, resume)
    if held is None:
        return
    raise HspmdError(
        f"--save {save} already holds checkpoint {held} of another run: saving there "
        "would delete it, or delete this run's own steps as they are written; give --save "
        f"a new folder, or --resume {save} to continue that run"
    )


def write_out(path: str, text: str, flag: str = "--out") -> None:
    """Write ``text`` to ``path`` (given as ``flag``) and say so on stderr; a failure is an
    ``HspmdError`` naming the flag, the path and the reason."""
    try:
        Path(path).write_text(text)
    except OSError as error:
        raise HspmdError(f"cannot write {flag} {path}: {error.strerror or error}") from None
    print(f"wrote {path}", file=sys.stderr)
