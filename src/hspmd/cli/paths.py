"""Output paths: checked before a command does its work (a typo never costs a finished run),
then written with one line on failure."""

from __future__ import annotations

import sys
from pathlib import Path

from hspmd.errors import HspmdError

__all__ = ["check_out_folder", "write_out"]


def check_out_folder(path: str, flag: str) -> None:
    """Refuse ``path`` (given as ``flag``) when the folder it goes in does not exist.

    >>> check_out_folder("/nonexistent/p.json", "--out")
    Traceback (most recent call last):
    hspmd.errors.HspmdError: --out '/nonexistent/p.json': folder '/nonexistent' does not exist: create it first
    """
    folder = Path(path).parent
    if not folder.is_dir():
        raise HspmdError(f"{flag} {path!r}: folder {str(folder)!r} does not exist: create it first")


def write_out(path: str, text: str, flag: str = "--out") -> None:
    """Write ``text`` to ``path`` (given as ``flag``) and say so on stderr; a failure is an
    ``HspmdError`` naming the flag, the path and the reason."""
    try:
        Path(path).write_text(text)
    except OSError as error:
        raise HspmdError(f"cannot write {flag} {path}: {error.strerror or error}") from None
    print(f"wrote {path}", file=sys.stderr)
