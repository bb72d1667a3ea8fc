"""``tbrpc status``: the nodes, their memory in use and their clients.

Nodes come from a cluster file, from "host:port" arguments, or from the
launches running on this machine: ``tbrpc launch`` records its nodes in a
small JSON file for as long as it runs (``launch-<pid>.json`` in
``runtime_dir()``), so ``tbrpc status`` alone finds nodes on free ports too.
Once its model is loaded a launch adds what carries each of its connections
("shm 16x64K", "tcp: the node is on another host"), which status shows.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tbrpc.client import NodeError, NodeInfo, NodeStatus, probe
from tbrpc.units import format_size


@dataclass(frozen=True)
class Target:
    """A node to ask about, and what a running launch on this machine knows of it."""
    name: str
    endpoint: str
    launch: str = ""      # "launch <pid> (<model>)" when a running launch uses it
    transport: str = ""   # that launch's connection to it


@dataclass(frozen=True)
class Row:
    target: Target
    info: NodeInfo | None
    status: NodeStatus | None
    error: str = ""


def runtime_dir() -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return Path(base) / f"tbrpc-{os.getuid()}"


@contextmanager
def launch_record(model: str, names: Sequence[str], endpoints: Sequence[str], http: str = "") -> Iterator[Path]:
    """Record a running launch (its nodes) until the block ends."""
    directory = runtime_dir()
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = directory / f"launch-{os.getpid()}.json"
    path.write_text(json.dumps({"pid": os.getpid(), "model": model, "http": http,
                                "nodes": [{"name": n, "endpoint": e} for n, e in zip(names, endpoints)]}))
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)


def note_transports(record: Path, transports: dict[str, str]) -> None:
    """Add to a launch record what carries the launch's connection to each endpoint."""
    data = json.loads(record.read_text())
    for node in data["nodes"]:
        node["transport"] = transports.get(node["endpoint"], "")
    partial = record.with_suffix(".partial")
    partial.write_text(json.dumps(data))
    partial.replace(record)


def running_launches() -> list[dict[str, Any]]:
    """Records of launches still running on this machine (stale ones are removed)."""
    found = []
    for path in sorted(runtime_dir().glob("launch-*.json")):
        try:
            record = json.loads(path.read_text())
            os.kill(int(record["pid"]), 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
            continue
        except (OSError, ValueError, KeyError):
            continue
        found.append(record)
    return found


def targets(listed: Sequence[tuple[str, str]], with_launches: bool) -> list[Target]:
    """The (name, endpoint) nodes listed, then (if asked) the running launches'
    other nodes; a listed node that a launch uses carries that launch's facts."""
    found = [Target(name, endpoint) for name, endpoint in listed]
    if not with_launches:
        return found
    for launch in running_launches():
        tag = f"launch {launch['pid']} ({launch['model']})"
        for node in launch["nodes"]:
            known = next((i for i, t in enumerate(found) if t.endpoint == node["endpoint"]), None)
            target = Target(found[known].name if known is not None else node["name"], node["endpoint"], tag,
                            node.get("transport", ""))
            if known is None:
                found.append(target)
            elif not found[known].launch:
                found[known] = target
    return found


def query(nodes: Sequence[Target], timeout: float = 5.0) -> list[Row]:
    """Probe each node; failures become rows with the error."""
    rows = []
    for target in nodes:
        try:
            info, status = probe(target.endpoint, timeout=timeout)
            rows.append(Row(target, info, status))
        except NodeError as exc:
            rows.append(Row(target, None, None, str(exc)))
    return rows


def format_rows(rows: Sequence[Row]) -> str:
    header = ("node", "endpoint", "device", "in use", "from files", "buffers", "clients", "graphs", "free/total",
              "transport", "")
    table = [header]
    for r in rows:
        t = r.target
        if r.status is None or r.info is None:
            table.append((t.name, t.endpoint, "-", "-", "-", "-", "-", "-", "-", "-", f"DOWN: {r.error}"))
            continue
        s = r.status
        table.append((t.name, t.endpoint, s.device, format_size(s.bytes_allocated), format_size(s.bytes_from_files),
                      str(s.buffers), str(s.clients), str(s.graphs_computed),
                      f"{format_size(s.mem_free)}/{format_size(s.mem_total)}", t.transport or "-", t.launch))
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table)


def rows_json(rows: Sequence[Row]) -> list[dict[str, Any]]:
    """The rows as `tbrpc status --json` prints them: sizes in bytes, a node that
    did not answer with "up": false and its error."""
    out = []
    for r in rows:
        row: dict[str, Any] = {"name": r.target.name, "endpoint": r.target.endpoint, "up": r.status is not None,
                               "launch": r.target.launch or None, "transport": r.target.transport or None}
        if r.status is not None and r.info is not None:
            row.update(node_name=r.info.node_name, description=r.info.description, **asdict(r.status))
        else:
            row["error"] = r.error
        out.append(row)
    return out
