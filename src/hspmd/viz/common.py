"""The picture file: its format from the suffix, a bare Agg figure, saving it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hspmd.errors import HspmdError

__all__ = ["PALETTE", "PICTURE_FORMATS", "PictureError", "check_picture_path", "new_figure", "save"]

PICTURE_FORMATS = ("png", "svg")
# Colour-blind-safe categorical colours (seaborn "colorblind"), one per pipeline or algorithm.
PALETTE = (
    "#0173b2", "#de8f05", "#029e73", "#d55e00", "#cc78bc",
    "#ca9161", "#fbafe4", "#949494", "#ece133", "#56b4e9",
)  # fmt: skip


class PictureError(HspmdError, ValueError):
    """A picture that cannot be written: a wrong suffix, a missing folder, no matplotlib."""


def check_picture_path(path: str | Path, *, flag: str = "--picture") -> str:
    """The format (``"png"`` or ``"svg"``) of ``path``, or PictureError naming the fix.

    >>> check_picture_path("plan.svg")
    'svg'
    """
    out = Path(path)
    fmt = out.suffix.lower().lstrip(".")
    if fmt not in PICTURE_FORMATS:
        raise PictureError(
            f"{flag} {str(path)!r}: pictures are written as .png or .svg, chosen by the "
            f"suffix: name it {out.stem or 'picture'}.png or {out.stem or 'picture'}.svg"
        )
    if not out.parent.is_dir():
        raise PictureError(
            f"{flag} {str(path)!r}: folder {str(out.parent)!r} does not exist: create it first"
        )
    return fmt


def new_figure(*, width: float, height: float) -> Any:
    """A matplotlib Figure on an Agg canvas (no pyplot, no global state, no display)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise PictureError(
            "pictures need matplotlib: pip install matplotlib (or pip install 'hspmd[viz]')"
        ) from None
    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig


def save(fig: Any, path: str | Path) -> Path:
    """Write ``fig`` to ``path`` in the format of its suffix; return the path."""
    out = Path(path)
    fig.savefig(out, format=check_picture_path(out), dpi=100, metadata=_metadata(out))
    return out


def _metadata(path: Path) -> dict[str, Any]:
    # No creation date in the files, so a picture regenerated from the same plan is the same file.
    return {"Date": None} if path.suffix.lower() == ".svg" else {"Software": "hspmd"}
