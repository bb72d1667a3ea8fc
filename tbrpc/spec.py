"""How each node is reached and started (``NodeSpec``), from a cluster file
(read by ``tbrpc/cluster_file.py``), from ``--local N`` or from "host:port"
endpoints; and which cable each pair of nodes uses (``links``)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from tbrpc.node_memory import ClusterError, ClusterNode, Node

STARTS = ("local", "ssh", "manual")


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
    secret_file: str | None = None   # the cluster secret's path on that node, for launch to pass it on
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


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """"host:port" ("[::1]:50052" for IPv6) -> (host, port); ValueError saying what is wrong."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f'expected "host:port", got {endpoint!r}')
    return host.removeprefix("[").removesuffix("]"), int(port)


def endpoint_specs(endpoints: list[str]) -> list[NodeSpec]:
    """Nodes given as "host:port", started by someone else."""
    specs = []
    for i, endpoint in enumerate(endpoints):
        try:
            host, port = split_endpoint(endpoint)
        except ValueError as exc:
            raise ClusterError(f"node #{i + 1}: {exc}") from exc
        specs.append(NodeSpec(name=endpoint, host=host, port=port, start="manual"))
    return specs
