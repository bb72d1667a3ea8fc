"""How each node is reached and started: the launch keys of the cluster file.

The cluster file is the planner's (``tbrpc.node_memory``: ``[[node]]`` tables
with ``name``, ``host``, ``port`` and optionally ``memory``, ...). ``tbrpc launch`` and
``tbrpc doctor`` read these extra keys from the same tables::

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
    links   = { studio1 = "10.0.12.2" }     # how the named nodes reach this one for activations:
                               # this node's address on the cable between them (Thunderbolt
                               # links are point to point, one subnet per cable; default: `host`)
"""

from __future__ import annotations

import os
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tbrpc.client import TRANSPORTS
from tbrpc.node_memory import ClusterError, ClusterNode, Node, read_cluster_file

DEFAULT_FILE_NAME = "tbrpc.toml"
_LOOPBACK = ("127.0.0.1", "localhost", "::1")
_STARTS = ("local", "ssh", "manual")


@dataclass(frozen=True)
class SshTarget:
    host: str
    user: str | None = None
    key: str | None = None
    port: int | None = None
    options: tuple[str, ...] = ()

    @property
    def destination(self) -> str:
        return f"{self.user}@{self.host}" if self.user else self.host

    def human(self, remote_command: str = "true") -> str:
        """The same connection as a person would type it."""
        words = ["ssh"] + (["-i", self.key] if self.key else []) + (["-p", str(self.port)] if self.port else [])
        return " ".join(words + [self.destination, remote_command])

    def argv(self, remote_command: str) -> list[str]:
        """The system ssh client's command line: non-interactive, failing fast, detecting dead links."""
        argv = ["ssh", "-T", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10",
                "-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=3"]
        if self.key:
            argv += ["-i", os.path.expanduser(self.key), "-o", "IdentitiesOnly=yes"]
        if self.port:
            argv += ["-p", str(self.port)]
        for option in self.options:
            argv += ["-o", option]
        return argv + [self.destination, remote_command]


@dataclass(frozen=True)
class NodeSpec:
    """One node as launch and doctor see it."""

    name: str
    host: str                        # the address the head connects to
    port: int                        # 0: a free port, chosen when the node starts (local nodes)
    start: str = "manual"            # "local", "ssh" or "manual"
    ssh: SshTarget | None = None
    python: str | None = None
    model: str | None = None         # the model's path on this node
    device: str | None = None
    threads: int = 0
    listen: str | None = None
    node_log_file: str | None = None
    transport: str | None = None     # "tcp" keeps the head's connection on TCP; None: TBRPC_TRANSPORT, else "auto"
    links: tuple[tuple[str, str], ...] = ()   # (other node's name, the address it dials this node at)
    plan_node: Node | None = field(default=None, compare=False)   # the cluster file's memory figure, a cap;
                                                                   # None: the planner uses what the node reports

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def listen_address(self) -> str:
        return self.listen or self.host

    def plan_entry(self) -> ClusterNode:
        """This node as the planner sizes it (with what it reports at the handshake)."""
        return ClusterNode(self.name, self.host, self.port, self.plan_node)

    def ssh_destination(self) -> str:
        return self.ssh.destination if self.ssh else self.host

    def ssh_argv(self, remote_command: str) -> list[str]:
        if self.ssh is None:
            raise ValueError(f"node {self.name} has no ssh settings")
        return self.ssh.argv(remote_command)

    def describe_start(self) -> str:
        if self.start == "ssh":
            return f"ssh {self.ssh_destination()}"
        return self.start


def _ssh_from(value: Any, host: str, where: str) -> SshTarget:
    if isinstance(value, str):
        user, sep, target = value.rpartition("@")
        return SshTarget(host=target or host, user=user if sep else None)
    if isinstance(value, dict):
        unknown = set(value) - {"user", "host", "key", "port", "options"}
        if unknown:
            raise ClusterError(f"{where}: unknown ssh keys {sorted(unknown)} (use user, host, key, port, options)")
        options = value.get("options", [])
        if not isinstance(options, list):
            raise ClusterError(f"{where}: ssh.options must be a list of ssh -o options")
        return SshTarget(host=str(value.get("host", host)), user=value.get("user"), key=value.get("key"),
                         port=int(value["port"]) if "port" in value else None, options=tuple(map(str, options)))
    raise ClusterError(f'{where}: ssh must be "user@host" or a table {{ user, host, key }}')


def spec_from_table(table: dict[str, Any], plan_node: Node | None, where: str) -> NodeSpec:
    host = str(table.get("host", ""))
    ssh = _ssh_from(table["ssh"], host, where) if "ssh" in table else None
    default_start = "ssh" if ssh else ("local" if host in _LOOPBACK else "manual")
    start = str(table.get("start", default_start))
    if start not in _STARTS:
        raise ClusterError(f"{where}: start must be one of {', '.join(_STARTS)}, not {start!r}")
    if start == "ssh" and ssh is None:
        ssh = SshTarget(host=host)
    transport = table.get("transport")
    if transport is not None and transport not in TRANSPORTS:
        raise ClusterError(f"{where}: transport must be one of {', '.join(TRANSPORTS)}, not {transport!r}")
    links = table.get("links", {})
    if not isinstance(links, dict) or not all(isinstance(v, str) and v for v in links.values()):
        raise ClusterError(f'{where}: links must be a table of node name = "address", e.g. links = {{ studio1 = "10.0.12.2" }}')
    return NodeSpec(
        name=str(table["name"]), host=host, port=int(table.get("port", 0)), start=start, ssh=ssh,
        python=table.get("python"), model=table.get("model"), device=table.get("device"),
        threads=int(table.get("threads", 0)), listen=table.get("listen"), node_log_file=table.get("log_file"),
        transport=transport, links=tuple((str(k), v) for k, v in links.items()), plan_node=plan_node,
    )


def load_specs(path: str | Path) -> list[NodeSpec]:
    """The nodes of a cluster file, with the memory figure the file gives (if any) attached."""
    entries = read_cluster_file(path)
    tables = tomllib.loads(Path(path).read_text())["node"]
    specs = [spec_from_table(t, e.given, f"{path}: node {e.name}") for t, e in zip(tables, entries)]
    names = {s.name for s in specs}
    for s in specs:
        for other, _ in s.links:
            if other not in names or other == s.name:
                raise ClusterError(f"{path}: node {s.name}: links names {other!r}, which is not another node of the file")
    return specs


def cable_gaps(specs: list[NodeSpec]) -> list[str]:
    """Where a file that lists cables (links) has none between two nodes that
    run consecutive layers: their activations go to the next node's `host`,
    which on a ring of Thunderbolt cables is not a cable of theirs."""
    if not any(s.links for s in specs):
        return []
    return [f"no cable listed from {a.name} to {b.name} (links in {b.name}'s table): activations for "
            f"{b.name} go to its host {b.host}" for a, b in zip(specs, specs[1:]) if a.name not in dict(b.links)]


def local_specs(n: int, threads: int | None = None) -> list[NodeSpec]:
    """N nodes on this machine on free loopback ports, sharing its cores (and, as they report it, its memory)."""
    if n < 1:
        raise ClusterError("--local needs at least one node")
    per_node_threads = threads if threads is not None else max(1, (os.cpu_count() or 1) // n)
    return [NodeSpec(name=f"local{i}", host="127.0.0.1", port=0, start="local", threads=per_node_threads)
            for i in range(n)]


def endpoint_specs(endpoints: list[str]) -> list[NodeSpec]:
    """Nodes given as "host:port", started by someone else."""
    specs = []
    for i, endpoint in enumerate(endpoints):
        host, sep, port = endpoint.rpartition(":")
        if not sep or not port.isdigit():
            raise ClusterError(f'node #{i + 1}: expected "host:port", got {endpoint!r}')
        specs.append(NodeSpec(name=endpoint, host=host, port=int(port), start="manual"))
    return specs


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


def choose_cluster(cluster_file: str | os.PathLike[str] | None, local: int | None) -> str | int:
    """--cluster F, else --local N, else the default cluster file; ClusterError when there is none."""
    if cluster_file is not None and local is not None:
        raise ClusterError("use either --cluster FILE or --local N, not both")
    if cluster_file is not None:
        return str(cluster_file)
    if local is not None:
        return local
    found = default_cluster_file()
    if found is None:
        places = ", ".join(str(p) for p in [Path(DEFAULT_FILE_NAME)] + [d / DEFAULT_FILE_NAME for d in config_dirs()])
        raise ClusterError(f"no cluster: pass --cluster FILE or --local N (no cluster file at {places})")
    return str(found)
