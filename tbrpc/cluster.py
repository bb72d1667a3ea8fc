"""Which machines there are and how much memory each can give the model.

Sources: a TOML cluster file (one ``[[node]]`` table per machine), repeated
``--node NAME=SIZE`` flags, or ``--nodes NxSIZE``.  The first node is the head:
the machine that runs llama-cpp-python.

On Apple silicon the GPU may only wire part of unified memory: macOS caps it
at about 75% of RAM on large machines unless ``iogpu.wired_limit_mb`` is
raised.  That cap, not the RAM size, is what the model must fit in, so every
node carries an explicit limit and the plan says which one it assumed.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tbrpc.units import format_size, parse_size

# macOS's default GPU wired-memory cap on machines with more than 64 GB of
# RAM (recommendedMaxWorkingSetSize); smaller Macs get about two thirds.
DEFAULT_METAL_FRACTION = 0.75
DEFAULT_PORT = 50052

_KINDS = ("metal", "cpu")


class ClusterError(ValueError):
    """The cluster description is unusable."""


@dataclass(frozen=True)
class Node:
    name: str
    memory_bytes: int  # physical RAM
    usable_bytes: int  # what the model may use on this node
    limit_source: str  # human explanation of how usable_bytes was chosen
    host: str = ""
    port: int = DEFAULT_PORT
    kind: str = "metal"


def _usable(memory: int, kind: str, usable: int | None, wired_limit: int | None, fraction: float) -> tuple[int, str]:
    if usable is not None:
        return usable, "usable_memory set explicitly"
    if kind == "cpu":
        return memory, "CPU node: all RAM"
    if wired_limit is not None:
        return wired_limit, f"Metal wired limit {format_size(wired_limit)} (iogpu.wired_limit_mb raised)"
    limit = int(memory * fraction)
    how = "macOS default" if fraction == DEFAULT_METAL_FRACTION else "set with --metal-fraction"
    return limit, f"Metal wired limit assumed {fraction:.0%} of RAM ({how}); raise iogpu.wired_limit_mb to use more"


def make_node(
    name: str,
    memory: int | str,
    *,
    host: str = "",
    port: int = DEFAULT_PORT,
    kind: str = "metal",
    usable_memory: int | str | None = None,
    wired_limit: int | str | None = None,
    metal_fraction: float = DEFAULT_METAL_FRACTION,
) -> Node:
    if kind not in _KINDS:
        raise ClusterError(f"node {name}: kind must be one of {', '.join(_KINDS)}, not {kind!r}")
    if not 0 < metal_fraction <= 1:
        raise ClusterError(f"Metal fraction must be in (0, 1], got {metal_fraction}")
    mem = parse_size(memory)
    usable_b = None if usable_memory is None else parse_size(usable_memory)
    wired_b = None if wired_limit is None else parse_size(wired_limit)
    usable, source = _usable(mem, kind, usable_b, wired_b, metal_fraction)
    if usable > mem:
        raise ClusterError(f"node {name}: usable memory {format_size(usable)} exceeds its RAM {format_size(mem)}")
    return Node(name, mem, usable, source, host, port, kind)


def load_cluster_file(path: str | Path, metal_fraction: float = DEFAULT_METAL_FRACTION) -> list[Node]:
    """Read ``[[node]]`` tables; keys other than ours are left to other tools (the launcher)."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ClusterError(f"{path}: {exc}") from exc
    tables = data.get("node")
    if not isinstance(tables, list) or not tables:
        raise ClusterError(f"{path}: no [[node]] tables")
    nodes = [_node_from_table(t, i, path, metal_fraction) for i, t in enumerate(tables)]
    _check_unique(nodes)
    return nodes


def _node_from_table(table: dict[str, Any], index: int, path: str | Path, fraction: float) -> Node:
    where = f"{path}: node #{index + 1}"
    for key in ("name", "host", "port", "memory"):
        if key not in table:
            raise ClusterError(f"{where}: missing required key {key!r}")
    try:
        return make_node(
            str(table["name"]),
            table["memory"],
            host=str(table["host"]),
            port=int(table["port"]),
            kind=str(table.get("kind", "metal")),
            usable_memory=table.get("usable_memory"),
            wired_limit=table.get("wired_limit"),
            metal_fraction=float(table.get("metal_fraction", fraction)),
        )
    except ValueError as exc:
        raise ClusterError(f"{where}: {exc}") from exc


_NODES_RE = re.compile(r"^\s*(\d+)\s*[xX×]\s*(\S+)\s*$")


def nodes_from_flags(node_flags: list[str], nodes_flag: str | None, metal_fraction: float = DEFAULT_METAL_FRACTION) -> list[Node]:
    """``--node mac1=512GiB`` (repeatable) or ``--nodes 4x512GiB`` (named node0..N-1)."""
    if node_flags and nodes_flag:
        raise ClusterError("use either --node or --nodes, not both")
    if nodes_flag:
        match = _NODES_RE.match(nodes_flag)
        if not match:
            raise ClusterError(f"--nodes wants COUNTxSIZE like 4x512GiB, got {nodes_flag!r}")
        count = int(match[1])
        if count < 1:
            raise ClusterError("--nodes needs at least one node")
        return [make_node(f"node{i}", match[2], metal_fraction=metal_fraction) for i in range(count)]
    nodes = []
    for flag in node_flags:
        name, sep, size = flag.partition("=")
        if not sep or not name or not size:
            raise ClusterError(f"--node wants NAME=SIZE like mac1=512GiB, got {flag!r}")
        nodes.append(make_node(name, size, metal_fraction=metal_fraction))
    if not nodes:
        raise ClusterError("no nodes: pass --cluster FILE, --node NAME=SIZE or --nodes NxSIZE")
    _check_unique(nodes)
    return nodes


def _check_unique(nodes: list[Node]) -> None:
    seen: set[str] = set()
    for node in nodes:
        if node.name in seen:
            raise ClusterError(f"node name {node.name!r} is used twice")
        seen.add(node.name)
