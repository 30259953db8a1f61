"""The package layering of docs/decisions.md, enforced on every import in src/hspmd."""

from __future__ import annotations

import ast
import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "hspmd"


@functools.cache
def _table() -> dict[str, tuple[set[str], bool]]:
    text = (ROOT / "docs" / "decisions.md").read_text()
    block = re.search(r"<!-- layering:.*?-->\n(.*?)<!-- /layering -->", text, re.S)
    assert block, "docs/decisions.md lost its layering table"
    table: dict[str, tuple[set[str], bool]] = {}
    for line in block.group(1).splitlines():
        words = line.split()
        if not words:
            continue
        torch_free = words[-1] == "torch-free"
        allowed = set(words[1 : -1 if torch_free else None]) - {"-"}
        table[words[0]] = (allowed, torch_free)
    return table


def _package(module: str) -> str | None:
    """The table's row of ``module``: its package, or the longest dotted row that names it
    (``models.spec``, ``cost.measure``)."""
    parts = module.split(".")
    if parts[0] != "hspmd" or len(parts) < 2 or parts[1] in ("__init__", "__main__"):
        return None
    rows = _table()
    for end in range(len(parts), 2, -1):
        if (row := ".".join(parts[1:end])) in rows:
            return row
    return parts[1]


def _modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out.append((name, path))
    return out


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def test_every_package_is_in_the_table() -> None:
    table = _table()
    packages = {p for name, _ in _modules() if (p := _package(name))}
    assert packages <= set(table), f"add to docs/decisions.md: {sorted(packages - set(table))}"


def test_imports_follow_the_table() -> None:
    table = _table()
    wrong = []
    for name, path in _modules():
        me = _package(name)
        if me is None or "*" in table[me][0]:
            continue
        allowed = table[me][0] | {me}
        for imported in _imports(path):
            other = _package(imported)
            if other is not None and other not in allowed:
                wrong.append(f"{name} imports {imported} ({me} -> {other})")
    assert not wrong, "imports the layering table does not allow:\n" + "\n".join(wrong)


def _torch_free_modules() -> list[str]:
    table = _table()
    return [name for name, _ in _modules() if (p := _package(name)) and table[p][1]]


@pytest.mark.parametrize("chunk", [0, 1])
def test_torch_free_packages_import_no_torch(chunk: int) -> None:
    names = _torch_free_modules()[chunk::2]
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        "    if 'torch' in sys.modules:\n"
        "        print(name)\n"
        "        break\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout == "", f"{out.stdout.strip()} imports torch (or a module it imports does)"


def test_the_planner_names_no_model() -> None:
    """The planner, the simulator and the cost model read a model through ``ModelSpec`` and
    its own cost function (``ModelSpec.cost``): no model class appears in their code."""
    models = {"LlamaConfig", "LlamaCost", "ModuleModel", "get_config"}
    wrong = []
    for name, path in _modules():
        if _package(name) not in ("planner", "sim", "cost"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            found = node.id if isinstance(node, ast.Name) else getattr(node, "attr", None)
            if isinstance(node, ast.alias):
                found = node.name
            if found in models:
                wrong.append(f"{name}:{node.lineno} names {found}")
    assert not wrong, "\n".join(wrong)
