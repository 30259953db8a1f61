"""The house rule: no function in src/hspmd over 60 lines (``def`` to its last line,
docstring included), outside an explicit allow-list."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "hspmd"
MAX_LINES = 60

# "path/under/src/hspmd.py:function" -> why it may be longer. Keep it short and explained.
ALLOWED: dict[str, str] = {}


@functools.cache
def _lengths(root: Path = SRC) -> dict[str, int]:
    """Lines of every function and method (nested ones too) under ``root``, by
    ``path:name``; the longest where a file repeats a name."""
    out: dict[str, int] = {}
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                assert node.end_lineno is not None
                key = f"{path.relative_to(root).as_posix()}:{node.name}"
                out[key] = max(out.get(key, 0), node.end_lineno - node.lineno + 1)
    return out


def test_no_function_over_60_lines() -> None:
    long = {k: n for k, n in _lengths().items() if n > MAX_LINES and k not in ALLOWED}
    assert not long, (
        f"functions over {MAX_LINES} lines (split them into named steps): "
        + ", ".join(f"{k} ({n})" for k, n in sorted(long.items(), key=lambda kv: -kv[1]))
    )


def test_the_allow_list_holds_only_long_functions() -> None:
    lengths = _lengths()
    stale = [k for k in ALLOWED if lengths.get(k, 0) <= MAX_LINES]
    assert not stale, f"no longer over {MAX_LINES} lines (or gone): drop from ALLOWED: {stale}"


def test_the_measure_counts_def_to_last_line_methods_included(tmp_path: Path) -> None:
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_LINES - 1))
    (tmp_path / "m.py").write_text(f'class C:\n    def f(self):\n        """Doc."""\n{body}\n')
    assert _lengths(tmp_path) == {"m.py:f": MAX_LINES + 1}
