"""Reading and writing graphs and placements.

Graphs: ``.json`` in the schema of ``data/pardnn`` (see docs/partition.md), or a
``.dot`` file with the ParDNN authors' side files (see :mod:`hspmd.partition.authors`).
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
        raise PartitionError(f"graph file {str(path)!r} does not exist")
    if path.suffix == ".json":
        return graph_from_json(json.loads(path.read_text()), default_name=path.stem)
    if path.suffix in (".dot", ".gv"):
        from hspmd.partition.authors import load_authors_graph

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
    return {"name": graph.name, "nodes": nodes, "edges": edges}


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
