"""How each node is reached and started (``NodeSpec``), from a cluster file
(read by ``tbrpc/cluster_file.py``), from ``--local N`` or from "host:port"
endpoints; and which cable each pair of nodes uses (``links``)."""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field

from tbrpc.client import DuplicateNodeError, NodeError
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
    file_position: int | None = field(default=None, compare=False)  # its [[node]] table's place in the file (0: first)

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


def cable_order(specs: Sequence[NodeSpec]) -> list[NodeSpec]:
    """The nodes in the order the layers go: along the cables the file lists.

    A layer split sends activations from each node to the next one only, so
    when any node lists cables (`links`), every consecutive pair a, b needs
    one: b's `links` naming a. The file's order when it already has that (or
    when no node lists a cable); else, of the orders that do, the one closest
    to the file's: fewest pairs of nodes the other way round from the file
    (Kendall tau distance), ties to the order whose first differing node comes
    earlier in the file. When no order follows the cables, the file's
    (`cable_gaps` says which cables are missing). The head's own hops, to the
    first node and back from the last, are its connections to their `host`:
    not cables of `links`, so not part of the choice.

    A search for a Hamiltonian path (NP-complete in general; clusters are a few
    nodes): depth first, nodes tried in file order, cut where the inversions so
    far plus those already fixed (a node still to place after a placed node
    that comes later in the file) reach the best found, where a node left has
    no cable in from the nodes left or the last one, or where the same set of
    placed nodes ending at the same node was reached before at no higher cost.
    At most O(2^n * n^2) steps and O(2^n * n) memory; two nodes no cable
    reaches (or leaves) end it at once; a ring of cables leaves one way on from
    each node, so the search is a few steps per node."""
    n, everyone = len(specs), (1 << len(specs)) - 1
    index = {s.name: i for i, s in enumerate(specs)}
    into = [sum(1 << index[other] for other in dict(s.links)) for s in specs]   # bit k of into[i]: a cable k -> i
    if not any(into) or all(into[i] >> (i - 1) & 1 for i in range(1, n)):
        return list(specs)
    out_of = [sum(1 << j for j in range(n) if into[j] >> i & 1) for i in range(n)]
    if sum(not m for m in into) > 1 or sum(not m for m in out_of) > 1:   # two nodes no cable reaches, or leaves
        return list(specs)
    best_order: list[int] = []
    best_cost = n * n   # more inversions than any order has
    seen: dict[tuple[int, int], int] = {}   # (placed nodes as bits, the last one) -> fewest inversions reaching it

    def bound(placed: int) -> int:   # each node still to place comes after every placed one
        return sum((placed >> (r + 1)).bit_count() for r in range(n) if not placed >> r & 1)

    def stranded(placed: int, last: int) -> bool:   # a node left that only placed nodes before `last` cable into
        return any(not into[r] & (everyone & ~placed | 1 << last) for r in range(n) if not placed >> r & 1)

    def extend(order: list[int], placed: int, inversions: int) -> None:
        nonlocal best_order, best_cost
        if placed == everyone:
            best_order, best_cost = list(order), inversions
            return
        for j in range(n):
            if placed >> j & 1 or (order and not into[j] >> order[-1] & 1):
                continue
            cost, now = inversions + (placed >> (j + 1)).bit_count(), placed | 1 << j
            if cost + bound(now) >= best_cost or seen.get((now, j), best_cost) <= cost or stranded(now, j):
                continue
            seen[now, j] = cost
            order.append(j)
            extend(order, now, cost)
            order.pop()

    extend([], 0, 0)
    return [specs[i] for i in best_order] if best_order else list(specs)


def allreduce_of(specs: Sequence[NodeSpec]) -> str:
    """The all-reduce a tensor or FFN split over these nodes (in this order) runs: "ring" when
    their `links` give each node's link to the next but not every pair, else "mesh"; the head's
    rule, asked of tbrpc's C library (tbrpc.client.allreduce_choice), with TBRPC_ALLREDUCE as it."""
    from tbrpc.client import allreduce_choice

    addressed = [[a.name in dict(b.links) for b in specs] for a in specs]
    return allreduce_choice(addressed, os.environ.get("TBRPC_ALLREDUCE"))[0]


def cable_order_note(specs: Sequence[NodeSpec]) -> str | None:
    """What a plan or launch says when `specs` (as ``cable_order`` put them) are not in the file's order."""
    placed = [s.file_position for s in specs]
    if None in placed or placed == sorted(placed):   # type: ignore[type-var]
        return None
    in_file = sorted(specs, key=lambda s: s.file_position or 0)
    return (f"ordered along the cables: {', '.join(s.name for s in specs)} "
            f"(the cluster file lists {', '.join(s.name for s in in_file)})")


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


class EndpointError(ClusterError, NodeError):
    """An entry of a list of nodes that is not "host:port": a ClusterError of the cluster given, and
    the NodeError ``tbrpc.connect`` raises for it (``tbrpc.Llama`` raises connect's classes)."""

    def __init__(self, message: str, endpoint: str | None = None) -> None:
        NodeError.__init__(self, message, endpoint)


class DuplicateEntryError(ClusterError, DuplicateNodeError):
    """Two entries of a cluster that are one node: a ClusterError of the cluster given, and the
    DuplicateNodeError ``tbrpc.connect`` raises for a node listed twice."""

    def __init__(self, message: str, endpoint: str | None = None) -> None:
        DuplicateNodeError.__init__(self, message, endpoint)


def endpoint_specs(endpoints: list[str]) -> list[NodeSpec]:
    """Nodes given as "host:port", started by someone else."""
    specs = []
    for i, endpoint in enumerate(endpoints):
        try:
            host, port = split_endpoint(endpoint)
        except ValueError as exc:
            raise EndpointError(f"node #{i + 1}: {exc}", endpoint) from exc
        specs.append(NodeSpec(name=endpoint, host=host, port=port, start="manual"))
    check_distinct(specs, "cluster")
    return specs


def _addresses(host: str) -> frozenset[str]:
    """The addresses `host` stands for (itself, lower-cased, when it does not resolve)."""
    try:
        return frozenset(str(info[4][0]) for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM))
    except (OSError, UnicodeError):
        return frozenset({host.lower()})


def _label(spec: NodeSpec) -> str:
    return spec.name if spec.name == spec.endpoint else f"{spec.name} ({spec.endpoint})"


def check_distinct(specs: Sequence[NodeSpec], where: str) -> None:
    """DuplicateEntryError (a ClusterError) naming both entries when two nodes are one: the same port at the same host, by
    name or by address (localhost and 127.0.0.1), so a machine's memory is not counted twice.
    Nodes whose port is chosen at start (0) cannot collide. Connecting finds the rest (one node
    process reached at two addresses, tbrpc.connect)."""
    by_port: dict[int, list[NodeSpec]] = {}
    for spec in specs:
        if spec.port:
            by_port.setdefault(spec.port, []).append(spec)
    for port, sharing in by_port.items():
        if len(sharing) < 2:
            continue        # names are resolved only where two nodes share a port: a slow resolver stalls no other load
        seen: list[tuple[NodeSpec, frozenset[str]]] = []
        for spec in sharing:
            addresses = _addresses(spec.host)
            for other, theirs in seen:
                if addresses & theirs:
                    raise DuplicateEntryError(f"{where}: nodes {_label(other)} and {_label(spec)} are the same node "
                                              f"({sorted(addresses & theirs)[0]} port {port}): list each node once",
                                              spec.endpoint)
            seen.append((spec, addresses))
