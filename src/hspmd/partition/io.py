"""Reading and writing graphs and placements.

Graphs: ``.json`` in the schema of ``data/pardnn`` (see docs/partition.md), or a
``.dot`` file with the ParDNN authors' side files next to it (:func:`load_authors_graph`).
Placements: one ``op device`` line per op, ``#`` starts a comment, as the authors'
tools read and write them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from hspmd.errors import PartitionError
from hspmd.partition.graph import OpGraph


def load_graph(path: str | Path) -> OpGraph:
    """Load a graph, choosing the format by suffix (``.json`` or ``.dot``)."""
    path = Path(path)
    if not path.exists():
        raise PartitionError(
            f"graph file {str(path)!r} does not exist: capture one with `hspmd partition-capture "
            "MODEL --out FILE.json` (`--list` shows the models)"
        )
    if path.suffix == ".json":
        try:
            doc = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise PartitionError(
                f"graph file {str(path)!r} cannot be read as JSON ({err}): capture one with "
                "`hspmd partition-capture MODEL --out FILE.json`"
            ) from None
        return graph_from_json(doc, default_name=path.stem)
    if path.suffix in (".dot", ".gv"):
        return load_authors_graph(path)
    raise PartitionError(f"graph file {str(path)!r}: expected a .json or .dot file")


def graph_from_json(doc: dict[str, Any], *, default_name: str = "graph") -> OpGraph:
    """Build an :class:`OpGraph` from the JSON schema (a parsed document)."""
    try:
        nodes = doc["nodes"]
        names = [str(n["id"]) for n in nodes]
        time_us = [float(n.get("time_us", 0.0)) for n in nodes]
        # TensorFlow writes -1 for an unknown size: read it as 0
        out_bytes = [max(int(n.get("out_bytes", 0)), 0) for n in nodes]
        residual = [int(n.get("residual_bytes", 0)) for n in nodes]
        edges = [(str(a), str(b)) for a, b in doc.get("edges", [])]
        coloc_names = [n.get("colocate") for n in nodes]
    except (KeyError, TypeError, ValueError) as err:
        raise PartitionError(
            f"graph JSON does not follow the schema ({err!r}); expected "
            '{"nodes": [{"id", "time_us", "out_bytes", "residual_bytes"}], "edges": [[a, b]]}'
        ) from None
    colocate = None
    if any(c is not None for c in coloc_names):
        index = {n: i for i, n in enumerate(names)}
        missing = [c for c in coloc_names if c is not None and str(c) not in index]
        if missing:
            raise PartitionError(f"colocate target {missing[0]!r} is not a node of the graph")
        colocate = [-1 if c is None else index[str(c)] for c in coloc_names]
    return OpGraph.build(
        str(doc.get("name", default_name)),
        names,
        time_us=time_us,
        out_bytes=out_bytes,
        residual_bytes=residual,
        edges=edges,
        colocate=colocate,
        meta=doc.get("meta") if isinstance(doc.get("meta"), dict) else None,
    )


def graph_to_json(graph: OpGraph) -> dict[str, Any]:
    """The JSON document of ``graph`` (inverse of :func:`graph_from_json`)."""
    nodes: list[dict[str, Any]] = []
    for i, name in enumerate(graph.names):
        node: dict[str, Any] = {
            "id": name,
            "time_us": float(graph.time_us[i]),
            "out_bytes": int(graph.out_bytes[i]),
            "residual_bytes": int(graph.residual_bytes[i]),
        }
        if graph.colocate[i] >= 0:
            node["colocate"] = graph.names[int(graph.colocate[i])]
        nodes.append(node)
    edges = [
        [graph.names[a], graph.names[b]]
        for a, b in zip(graph.src.tolist(), graph.dst.tolist(), strict=True)
    ]
    return {"name": graph.name, "nodes": nodes, "edges": edges, "meta": dict(graph.meta)}


def save_graph_json(path: str | Path, graph: OpGraph) -> None:
    """Write ``graph`` as JSON (one line per node and edge would be larger; this is compact)."""
    Path(path).write_text(json.dumps(graph_to_json(graph), separators=(",", ":")))


def read_placement(path: str | Path, graph: OpGraph) -> np.ndarray:
    """Read ``op device`` lines into a device id per op; every op must be placed once."""
    place = np.full(graph.num_nodes, -1, dtype=np.int64)
    index = graph.index
    for lineno, raw in enumerate(Path(path).read_text().splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, _, device = line.rpartition(" ")
        name = name.strip()
        if not name or not device.lstrip("-").isdigit():
            raise PartitionError(f"{path}:{lineno}: expected 'op device', got {raw!r}")
        if name not in index:
            raise PartitionError(f"{path}:{lineno}: op {name!r} is not in graph {graph.name!r}")
        place[index[name]] = int(device)
    missing = np.flatnonzero(place < 0)
    if missing.size:
        raise PartitionError(
            f"{path}: {missing.size} ops have no device (or a negative one), "
            f"e.g. {graph.names[int(missing[0])]!r}"
        )
    return place


def write_placement(
    path: str | Path, graph: OpGraph, placement: np.ndarray, *, header: str = ""
) -> None:
    """Write one ``op device`` line per op, in node order, after optional ``#`` lines."""
    lines = [f"# {h}" for h in header.splitlines()] if header else []
    lines += [f"{n} {int(d)}" for n, d in zip(graph.names, placement.tolist(), strict=True)]
    Path(path).write_text("\n".join(lines) + "\n")


# ---- the ParDNN authors' formats -------------------------------------------------------

# side files looked for next to the .dot, first match wins (the authors' names)
AUTHORS_FILES = {
    "durations": ("nodes_average_durations_fixed.txt", "nodes_average_durations.txt"),
    "sizes": ("tensors_sz_32_low.txt", "tensors_sz_32.txt", "tensors_sz.txt"),
    "memory": ("memory.txt",),
    "variables": ("var_nodes.txt",),
    "references": ("ref_nodes.txt",),
    "collocations": ("collocations.txt",),
}
_ARTIFICIAL = ("src", "snk")


def load_authors_graph(path: str | Path, **files: str | Path | None) -> OpGraph:
    """Read a ``.dot`` graph with the authors' side files.

    * ``.dot``: ``a->b;`` lines (quotes and spaces ignored; ``src``/``snk`` dropped);
    * durations and sizes: ``name::microseconds`` and ``name::bytes`` lines (missing:
      1 us and 0 bytes; TensorFlow's -1 reads as 0);
    * memory: ``name::bytes``, the residual size of a variable (else its tensor size);
    * variables, references: one name per line; a reference op shares its variable's
      device (the variable among its predecessors);
    * collocations: ``a::b::c`` per line, ops that share a device.

    Side files are found next to the ``.dot`` by the names in :data:`AUTHORS_FILES`,
    or given as keyword arguments (``durations=...``); names match case-insensitively.
    """
    path = Path(path)
    sides = {
        key: files.get(key) or _find(path.parent, names) for key, names in AUTHORS_FILES.items()
    }
    edges = _dot_edges(path)
    names = list(dict.fromkeys(n for edge in edges for n in edge))
    index = {n.lower(): i for i, n in enumerate(names)}
    durations = _pairs(sides["durations"], float)
    sizes = _pairs(sides["sizes"], int)
    memory = _pairs(sides["memory"], int)
    variables = _names(sides["variables"])
    time_us = [durations.get(n.lower(), 1.0) for n in names]
    out_bytes = [max(sizes.get(n.lower(), 0), 0) for n in names]
    residual = [
        max(memory.get(n.lower(), sizes.get(n.lower(), 0)), 0) if n.lower() in variables else 0
        for n in names
    ]
    colocate = _colocation(names, index, edges, sides, variables)
    return OpGraph.build(
        path.stem,
        names,
        time_us=time_us,
        out_bytes=out_bytes,
        residual_bytes=residual,
        edges=[(index[a.lower()], index[b.lower()]) for a, b in edges],
        colocate=colocate,
    )


def _find(folder: Path, names: tuple[str, ...]) -> Path | None:
    return next((folder / n for n in names if (folder / n).exists()), None)


def _clean(token: str) -> str:
    return token.strip().strip(";").strip().strip('"').strip()


def _dot_edges(path: Path) -> list[tuple[str, str]]:
    edges = []
    for raw in path.read_text().splitlines():
        if "->" not in raw:
            continue
        a, b = (_clean(t) for t in raw.split("->", 1))
        b = _clean(b.split("[", 1)[0])
        if a and b and a not in _ARTIFICIAL and b not in _ARTIFICIAL:
            edges.append((a, b))
    if not edges:
        raise PartitionError(f"{path}: no 'a->b' edges found; is it a ParDNN .dot graph?")
    return edges


def _pairs(path: str | Path | None, kind: type) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if path is None:
        return out
    for lineno, raw in enumerate(Path(path).read_text().splitlines(), start=1):
        if "::" not in raw:
            continue
        name, _, value = raw.rpartition("::")
        try:
            out[_clean(name).lower()] = kind(float(value.strip()))
        except ValueError:
            raise PartitionError(f"{path}:{lineno}: expected 'name::number', got {raw!r}") from None
    return out


def _names(path: str | Path | None) -> set[str]:
    if path is None:
        return set()
    return {_clean(line).lower() for line in Path(path).read_text().splitlines() if line.strip()}


def _colocation(
    names: list[str],
    index: dict[str, int],
    edges: list[tuple[str, str]],
    sides: dict[str, Any],
    variables: set[str],
) -> list[int]:
    colocate = [-1] * len(names)
    if sides["collocations"] is not None:
        for raw in Path(sides["collocations"]).read_text().splitlines():
            group = [index[t] for t in (_clean(x).lower() for x in raw.split("::")) if t in index]
            for v in group[1:]:
                colocate[v] = group[0]
    references = _names(sides["references"])
    for a, b in edges:
        if b.lower() in references and a.lower() in variables and colocate[index[b.lower()]] < 0:
            colocate[index[b.lower()]] = index[a.lower()]
    return colocate
