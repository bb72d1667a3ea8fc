"""The cluster file (``tbrpc.toml``): where it is looked for, and reading and checking all of it.

Every key of the file is read and checked here, once, so each error names
the file, the node and the key. What the keys mean for the planner lives in
``tbrpc/node_memory.py`` (``Node``, ``ClusterNode``), for launch and doctor
in ``tbrpc/spec.py`` (``NodeSpec``); prose and an example: ``docs/cluster.md``.

One ``[[node]]`` table per machine, in the order the layers go (when the
file lists cables, ``spec.cable_order`` keeps that order only if it follows
them)::

    name    = "studio1"        # required
    host    = "10.0.12.1"      # required: the address the head connects to
    port    = 50052            # required (0: a free port, local nodes only)
    # the planner's (all optional; without them the node is asked):
    memory = "512GiB"   usable_memory = "480GiB"   wired_limit = "480GiB"
    metal_fraction = 0.75      kind = "metal"   # or "cpu"
    # how the node is reached and started:
    start   = "ssh"            # "local", "ssh" or "manual" (default: ssh when `ssh` is set,
                               #  local for 127.0.0.1/localhost, else manual: started by hand)
    ssh     = { user = "me", host = "studio2.local", key = "~/.ssh/tbrpc", port = 22 }
                               # or ssh = "me@studio2.local"
    python  = "~/tbrpc/.venv/bin/python"   # interpreter with tbrpc installed on that node
    model   = "/Volumes/models/K2/model-00001-of-00013.gguf"  # model path on that node
    device  = "MTL0"           # ggml device the node serves (default: its best)
    threads = 8
    listen  = "0.0.0.0"        # address the node binds (default: `host`)
    log_file = "/tmp/tbrpc-node.log"        # node log on that machine (default: sent to the head)
    transport = "tcp"          # keep the head's connection on TCP (default: TBRPC_TRANSPORT, else auto)
    links   = { studio1 = "10.0.12.2" }     # how the named nodes reach this one for activations:
                               # this node's address on the cable between them (default: `host`)
    secret_file = "~/.config/tbrpc/secret"  # the cluster secret's path on that machine
                                            # (default: the file's top-level `secret_file`)

and one top-level key::

    secret_file = "~/.config/tbrpc/secret"  # the head's copy of the cluster secret (tbrpc/secret.py);
                                            # also where launch tells ssh-started nodes to find theirs

A key tbrpc does not know is an error naming the file, the node and the key, and the
closest known key (``check_keys``): a misspelt `memory` or `secret_file` would otherwise
change the plan or leave a node without its secret with nothing to say why, and a
warning would scroll past in launch's output. The file is tbrpc's alone.
"""

from __future__ import annotations

import difflib
import os
import sys
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tbrpc import defaults
from tbrpc.client import TRANSPORTS
from tbrpc.node_memory import (
    FROM_FILE,
    KINDS,
    LOOPBACK,
    ClusterError,
    ClusterNode,
    Node,
    ask_nodes,
    check_unique,
    make_node,
    size_nodes,
    with_origin,
)
from tbrpc.node_processes import start_command
from tbrpc.spec import STARTS, NodeSpec, SshTarget, cable_order, check_distinct

DEFAULT_FILE_NAME = "tbrpc.toml"
SSH_KEYS = ("user", "host", "key", "port", "options")
TOP_KEYS = ("secret_file", "node")
NODE_KEYS = ("name", "host", "port", "memory", "usable_memory", "wired_limit", "metal_fraction", "kind", "start", "ssh", "python", "model", "device", "threads", "listen",
             "log_file", "transport", "links", "secret_file")


@dataclass(frozen=True)
class ClusterFile:
    """A cluster file, read and checked: the planner's view and launch's of each node, both in the
    order the layers go (``spec.cable_order``; each spec's `file_position` is its place in the file)."""

    path: str
    secret_file: str | None      # the top-level `secret_file`
    nodes: tuple[ClusterNode, ...]
    specs: tuple[NodeSpec, ...]


# --- where it is ---------------------------------------------------------------------------


def config_dirs() -> list[Path]:
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.expanduser("~/.config")
    dirs = [Path(base) / "tbrpc"]
    if sys.platform == "darwin":
        dirs.append(Path.home() / "Library" / "Application Support" / "tbrpc")
    return dirs


def default_cluster_file() -> Path | None:
    """./tbrpc.toml, else tbrpc.toml in the user config directory, else None."""
    for candidate in [Path.cwd() / DEFAULT_FILE_NAME] + [d / DEFAULT_FILE_NAME for d in config_dirs()]:
        if candidate.is_file():
            return candidate
    return None


def choose_cluster(cluster_file: str | os.PathLike[str] | None, local: int | None, *, instead: str) -> str | int:
    """--cluster F, else --local N, else the default cluster file; ClusterError when there is none,
    saying to pass --cluster FILE or `instead`: what else the command asking takes ("--local N", endpoints)."""
    if cluster_file is not None and local is not None:
        raise ClusterError("use either --cluster FILE or --local N, not both")
    if cluster_file is not None:
        return str(cluster_file)
    if local is not None:
        return local
    found = default_cluster_file()
    if found is None:
        places = ", ".join(str(p) for p in [Path(DEFAULT_FILE_NAME)] + [d / DEFAULT_FILE_NAME for d in config_dirs()])
        raise ClusterError(f"no cluster: pass --cluster FILE or {instead} (no cluster file at {places})")
    return str(found)


# --- reading it ----------------------------------------------------------------------------


def read(path: str | os.PathLike[str], metal_fraction: float = defaults.METAL_FRACTION) -> ClusterFile:
    """Read and check the whole file; ClusterError naming the file, the node and the key otherwise."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ClusterError(f"{path}: {exc}") from exc
    check_keys(data, TOP_KEYS, f"{path}: top level")
    secret_file = data.get("secret_file")
    if secret_file is not None and not isinstance(secret_file, str):
        raise ClusterError(f"{path}: secret_file must be a path")
    tables = data.get("node")
    if not isinstance(tables, list) or not tables:
        raise ClusterError(f"{path}: no [[node]] tables")
    nodes, specs = [], []
    for i, table in enumerate(tables):
        where = f"{path}: node #{i + 1}"
        if not isinstance(table, dict):
            raise ClusterError(f"{where}: must be a [[node]] table")
        if "name" in table:
            where = f"{path}: node {table['name']}"
        check_keys(table, NODE_KEYS, where)   # first: a misspelt `name` is an unknown key, not a missing one
        for key in ("name", "host", "port"):
            if key not in table:
                raise ClusterError(f"{where}: missing required key {key!r}")
        node = _plan_entry(table, where, metal_fraction)
        spec = replace(spec_from_table(table, node.given, where, secret_file), file_position=i)
        nodes.append(replace(node, start_command=start_command(spec)))
        specs.append(spec)
    check_unique(nodes, str(path))
    check_distinct(specs, str(path))
    names = {s.name for s in specs}
    for s in specs:
        for other, _ in s.links:
            if other not in names or other == s.name:
                raise ClusterError(f"{path}: node {s.name}: links names {other!r}, which is not another node of the file")
    ordered = cable_order(specs)   # the order the layers go: along the cables, when the file lists them
    return ClusterFile(str(path), secret_file, tuple(nodes[s.file_position or 0] for s in ordered), tuple(ordered))


def check_keys(table: dict[str, Any], known: tuple[str, ...], where: str) -> None:
    """ClusterError naming each key of `table` not in `known`, with the closest known key when one is close."""
    unknown = [key for key in table if key not in known]
    if not unknown:
        return
    said, guessed = [], True
    for key in unknown:
        close = difflib.get_close_matches(key, known, n=1)
        said.append(f"{key!r} (did you mean {close[0]!r}?)" if close else repr(key))
        guessed = guessed and bool(close)
    listed = "" if guessed else f" (known: {', '.join(known)})"
    raise ClusterError(f"{where}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(said)}{listed}")


def read_cluster_file(path: str | os.PathLike[str], metal_fraction: float = defaults.METAL_FRACTION) -> list[ClusterNode]:
    """The planner's view of each ``[[node]]`` table: where it is, and its memory if the file says."""
    return list(read(path, metal_fraction).nodes)


def load_specs(path: str | os.PathLike[str]) -> list[NodeSpec]:
    """The nodes of a cluster file as launch and doctor see them (with the file's memory figure, if any)."""
    return list(read(path).specs)


def cluster_secret_file(path: str | os.PathLike[str]) -> str | None:
    """The cluster file's top-level `secret_file` (the head's copy of the secret), or None."""
    return read(path).secret_file


def load_cluster_file(path: str | os.PathLike[str], metal_fraction: float = defaults.METAL_FRACTION, *,
                      ask: bool = False, timeout: float = defaults.ASK_TIMEOUT_S) -> list[Node]:
    """The planner's nodes of a cluster file.

    ``ask=False`` plans offline: every node needs `memory` (or `usable_memory`).
    ``ask=True`` asks every node for its memory (``timeout`` seconds each, in
    parallel) and sizes them with ``size_nodes``.
    """
    entries = read_cluster_file(path, metal_fraction)
    return size_nodes(entries, ask_nodes(entries, timeout) if ask else [None] * len(entries))


def _plan_entry(table: dict[str, Any], where: str, fraction: float) -> ClusterNode:
    """The memory keys: a figure the planner may use as a cap, or none (the node is asked)."""
    name, host, kind = str(table["name"]), str(table["host"]), str(table.get("kind", "metal"))
    port = table["port"]
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise ClusterError(f"{where}: port must be a whole number from 0 to 65535, not {port!r}")
    try:
        if kind not in KINDS:
            raise ClusterError(f"kind must be one of {', '.join(KINDS)}, not {kind!r}")
        if "memory" in table:
            ram = table["memory"]
        elif "usable_memory" in table:   # a cap on its own: the node's RAM is what it reports
            ram = table["usable_memory"]
        elif "wired_limit" in table and kind == "metal":
            ram = table["wired_limit"]
        else:
            for key in ("wired_limit", "metal_fraction"):
                if key in table:
                    raise ClusterError(f"{key} needs `memory` (the node's RAM)")
            return ClusterNode(name, host, port, None)
        given = make_node(name, ram, host=host, port=port, kind=kind, usable_memory=table.get("usable_memory"),
                          wired_limit=table.get("wired_limit"),
                          metal_fraction=float(table.get("metal_fraction", fraction)))
    except ValueError as exc:   # ClusterError included
        raise ClusterError(f"{where}: {exc}") from exc
    return ClusterNode(name, host, port, with_origin(given, FROM_FILE))


def _ssh_from(value: Any, host: str, where: str) -> SshTarget:
    if isinstance(value, str):
        user, sep, target = value.rpartition("@")
        return SshTarget(host=target or host, user=user if sep else None)
    if isinstance(value, dict):
        check_keys(value, SSH_KEYS, f"{where}: ssh")
        options = value.get("options", [])
        if not isinstance(options, list):
            raise ClusterError(f"{where}: ssh.options must be a list of ssh -o options")
        return SshTarget(host=str(value.get("host", host)), user=value.get("user"), key=value.get("key"),
                         port=int(value["port"]) if "port" in value else None, options=tuple(map(str, options)))
    raise ClusterError(f'{where}: ssh must be "user@host" or a table {{ user, host, key }}')


def spec_from_table(table: dict[str, Any], plan_node: Node | None, where: str,
                    secret_file: str | None = None) -> NodeSpec:
    """One ``[[node]]`` table's launch keys (`plan_node`: its memory figure, if the file gives one)."""
    host = str(table.get("host", ""))
    ssh = _ssh_from(table["ssh"], host, where) if "ssh" in table else None
    default_start = "ssh" if ssh else ("local" if host in LOOPBACK else "manual")
    start = str(table.get("start", default_start))
    if start not in STARTS:
        raise ClusterError(f"{where}: start must be one of {', '.join(STARTS)}, not {start!r}")
    if start == "ssh" and ssh is None:
        ssh = SshTarget(host=host)
    transport = table.get("transport")
    if transport is not None and transport not in TRANSPORTS:
        raise ClusterError(f"{where}: transport must be one of {', '.join(TRANSPORTS)}, not {transport!r}")
    links = table.get("links", {})
    if not isinstance(links, dict) or not all(isinstance(v, str) and v for v in links.values()):
        raise ClusterError(f'{where}: links must be a table of node name = "address", e.g. links = {{ studio1 = "10.0.12.2" }}')
    port, threads = table.get("port", 0), table.get("threads", 0)
    for key, value in (("port", port), ("threads", threads)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ClusterError(f"{where}: {key} must be a whole number, not {value!r}")
    return NodeSpec(
        name=str(table["name"]), host=host, port=port, start=start, ssh=ssh,
        python=table.get("python"), model=table.get("model"), device=table.get("device"),
        threads=threads, listen=table.get("listen"), node_log_file=table.get("log_file"),
        transport=transport, links=tuple((str(k), v) for k, v in links.items()), plan_node=plan_node,
        secret_file=table.get("secret_file", secret_file),
    )
