"""``tbrpc status``: the nodes, their memory in use and their clients.

Nodes come from a cluster file, from "host:port" arguments, or from the
launches running on this machine: ``tbrpc launch`` records its nodes in a
small JSON file for as long as it runs (``launch-<pid>.json`` in
``runtime_dir()``), so ``tbrpc status`` alone finds nodes on free ports too.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tbrpc.client import NodeError, NodeInfo, NodeStatus, probe
from tbrpc.units import format_size


@dataclass(frozen=True)
class Row:
    name: str
    endpoint: str
    info: NodeInfo | None
    status: NodeStatus | None
    error: str = ""
    launch: str = ""      # "launch <pid> (<model>)" when found through a running launch


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


def query(nodes: Sequence[tuple[str, str, str]], timeout: float = 5.0) -> list[Row]:
    """Probe each (name, endpoint, launch) node; failures become rows with the error."""
    rows = []
    for name, endpoint, launch in nodes:
        try:
            info, status = probe(endpoint, timeout=timeout)
            rows.append(Row(name, endpoint, info, status, launch=launch))
        except NodeError as exc:
            rows.append(Row(name, endpoint, None, None, str(exc), launch))
    return rows


def format_rows(rows: Sequence[Row]) -> str:
    header = ("node", "endpoint", "device", "in use", "from files", "buffers", "clients", "graphs", "free/total", "")
    table = [header]
    for r in rows:
        if r.status is None or r.info is None:
            table.append((r.name, r.endpoint, "-", "-", "-", "-", "-", "-", "-", f"DOWN: {r.error}"))
            continue
        s = r.status
        table.append((r.name, r.endpoint, s.device, format_size(s.bytes_allocated), format_size(s.bytes_from_files),
                      str(s.buffers), str(s.clients),
                      str(s.graphs_computed), f"{format_size(s.mem_free)}/{format_size(s.mem_total)}", r.launch))
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table)
