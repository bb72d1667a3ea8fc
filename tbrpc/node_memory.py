"""Which machines there are and how much memory each can give the model.

Sources: a cluster file's memory keys (read by ``tbrpc/cluster_file.py``),
repeated ``--node NAME=SIZE`` flags, or ``--nodes NxSIZE``.  The first node is
the head: the machine that runs llama-cpp-python.

A cluster file may leave out ``memory``: every node reports its device's
memory when a client says HELLO, so the planner can ask it instead
(``cluster_file.load_cluster_file(..., ask=True)``, ``size_nodes``).  A figure the file
does give is a cap: with the node's answer the planner takes the smaller of
the two, without it (planning offline, or the node is down) the file's.

On Apple silicon the GPU may only wire part of unified memory: macOS caps it
at about 75% of RAM on large machines unless ``iogpu.wired_limit_mb`` is
raised.  That cap, not the RAM size, is what the model must fit in, so a
node given by its RAM carries an explicit limit and the plan says which one
it assumed.  A Metal node that is asked reports the cap itself (ggml-metal:
recommendedMaxWorkingSetSize, less what the node process has allocated).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from tbrpc import defaults
from tbrpc.units import format_size, parse_size


KINDS = ("metal", "cpu")
LOOPBACK = ("127.0.0.1", "localhost", "::1")

# Where a node's usable figure came from (Node.memory_from)
GIVEN = "given"                  # make_node's caller
FROM_FILE = "cluster file"
FROM_FLAGS = "command line"      # --node / --nodes
FROM_NODE = "node"               # what the node reported at HELLO


class ClusterError(ValueError):
    """The cluster description is unusable."""


@dataclass(frozen=True)
class Node:
    """A node as the planner sees it: a name and the bytes the model may use there."""

    name: str
    memory_bytes: int  # physical RAM (for a figure the node reported: its device's total)
    usable_bytes: int  # what the model may use on this node
    limit_source: str  # human explanation of where usable_bytes came from and how it was chosen
    host: str = ""
    port: int = defaults.PORT
    kind: str = "metal"
    memory_from: str = GIVEN  # FROM_FILE, FROM_FLAGS, FROM_NODE or GIVEN: whose figure usable_bytes is
    reported_bytes: int | None = None  # what the node reported (its share of it), when it was asked


def _usable(memory: int, kind: str, usable: int | None, wired_limit: int | None, fraction: float) -> tuple[int, str]:
    if usable is not None:
        return usable, "usable_memory set explicitly"
    if kind == "cpu":
        return memory, "CPU node: all RAM"
    if wired_limit is not None:
        return wired_limit, f"Metal wired limit {format_size(wired_limit)} (iogpu.wired_limit_mb raised)"
    limit = int(memory * fraction)
    how = "macOS default" if fraction == defaults.METAL_FRACTION else "set with --metal-fraction"
    return limit, f"Metal wired limit assumed {fraction:.0%} of RAM ({how}); raise iogpu.wired_limit_mb to use more"


def make_node(
    name: str,
    memory: int | str,
    *,
    host: str = "",
    port: int = defaults.PORT,
    kind: str = "metal",
    usable_memory: int | str | None = None,
    wired_limit: int | str | None = None,
    metal_fraction: float = defaults.METAL_FRACTION,
) -> Node:
    if kind not in KINDS:
        raise ClusterError(f"node {name}: kind must be one of {', '.join(KINDS)}, not {kind!r}")
    if not 0 < metal_fraction <= 1:
        raise ClusterError(f"Metal fraction must be in (0, 1], got {metal_fraction}")
    mem = parse_size(memory)
    usable_b = None if usable_memory is None else parse_size(usable_memory)
    wired_b = None if wired_limit is None else parse_size(wired_limit)
    usable, source = _usable(mem, kind, usable_b, wired_b, metal_fraction)
    if usable > mem:
        raise ClusterError(f"node {name}: usable memory {format_size(usable)} exceeds its RAM {format_size(mem)}")
    return Node(name, mem, usable, source, host, port, kind)


def with_origin(node: Node, origin: str) -> Node:
    """`node`, its figure labelled as coming from `origin` (the cluster file, the command line)."""
    return replace(node, memory_from=origin, limit_source=f"{origin} ({node.limit_source})")


@dataclass(frozen=True)
class ClusterNode:
    """One ``[[node]]`` table as the planner reads it: where the node is, and its memory if the file says."""

    name: str
    host: str
    port: int
    given: Node | None  # the file's figure (`memory`, `usable_memory`, ...): a cap; None: ask the node
    start_command: str | None = None  # what starts it by hand on its machine (node_processes.start_command)

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class Report:
    """What a node said about its device's memory at HELLO."""

    device: str  # the node's ggml device (CPU, MTL0, ...)
    free: int
    total: int
    node_id: str = ""   # the node process's id (HELLO): the same at every address it answers at

    @property
    def usable(self) -> int:
        """Free memory (a device that reports no free figure: its total)."""
        return min(self.free, self.total) or self.total


@dataclass(frozen=True)
class NoAnswer:
    """A node that was asked for its memory and did not answer."""

    why: str


@dataclass(frozen=True)
class SecretRefused(NoAnswer):
    """A node that answered but refused this head's authentication (`client.AuthenticationError`): it
    runs, so the way out is the secret it was started with, not starting it."""


def ask_nodes(entries: Sequence[ClusterNode], timeout: float = defaults.ASK_TIMEOUT_S) -> list[Report | NoAnswer]:
    """Ask every node for its memory (a handshake, in parallel); a node without a fixed port cannot be asked.
    ClusterError naming both entries when two answer as one node process (at two addresses)."""
    try:
        from tbrpc.client import AuthenticationError, probe
        from tbrpc.native import TbrpcError, load

        load()
    except (ImportError, RuntimeError) as exc:   # tbrpc's C library unbuilt, or the wrong llama-cpp-python
        return [NoAnswer(f"cannot ask nodes from here: {exc}")] * len(entries)

    def ask(entry: ClusterNode) -> Report | NoAnswer:
        if not entry.port:
            return NoAnswer("port 0: it has a port only while `tbrpc launch` runs it")
        try:
            info, _ = probe(entry.endpoint, timeout=timeout)
        except AuthenticationError as exc:
            return SecretRefused(str(exc))
        except TbrpcError as exc:
            return NoAnswer(str(exc))
        return Report(info.node_device, info.mem_free, info.mem_total, info.node_id)

    if not entries:
        return []
    with ThreadPoolExecutor(max_workers=min(16, len(entries))) as pool:
        answers = list(pool.map(ask, entries))
    first: dict[str, ClusterNode] = {}
    for entry, answer in zip(entries, answers):
        if isinstance(answer, Report) and answer.node_id:
            seen = first.setdefault(answer.node_id, entry)
            if seen is not entry:
                raise ClusterError(f"nodes {seen.name} ({seen.endpoint}) and {entry.name} ({entry.endpoint}) are one node "
                                   "process reached at two addresses (it answers both with the same node id): "
                                   "list each node once")
    return answers


def _machine(host: str) -> str:
    return "this machine" if host in LOOPBACK else host


def size_nodes(entries: Sequence[ClusterNode], answers: Sequence[Report | NoAnswer | None]) -> list[Node]:
    """The planner's nodes from the cluster file's figures and what the nodes answered (None: not asked).

    A node's figure is the file's when the node was not asked or did not
    answer; what it reported when the file gives none; the smaller of the two
    otherwise.  Nodes on one machine (the same `host`, loopback counting as
    one) that report the same device share what it reports equally.  A node
    with neither figure is a ClusterError naming every such node.
    """
    if len(entries) != len(answers):
        raise ValueError(f"{len(entries)} nodes but {len(answers)} answers")
    sharing: dict[tuple[str, str], int] = {}
    for entry, answer in zip(entries, answers):
        if isinstance(answer, Report):
            key = (_machine(entry.host), answer.device)
            sharing[key] = sharing.get(key, 0) + 1
    nodes: list[Node] = []
    missing: list[str] = []
    for entry, answer in zip(entries, answers):
        if isinstance(answer, Report):
            nodes.append(_sized(entry, answer, sharing[(_machine(entry.host), answer.device)]))
        elif entry.given is not None:
            why = f"; the node {_did_not(answer)} ({answer.why})" if isinstance(answer, NoAnswer) else ""
            nodes.append(replace(entry.given, limit_source=entry.given.limit_source + why))
        else:
            missing.append(_missing(entry, answer))
    if missing:
        raise ClusterError("\n".join(missing))
    return nodes


def _sized(entry: ClusterNode, report: Report, shared_by: int) -> Node:
    share = report.usable // shared_by
    seen = f"reported by the node ({report.device}, {format_size(report.free)} free of {format_size(report.total)})"
    if shared_by > 1:
        seen += f", shared by the {shared_by} nodes on {_machine(entry.host)}"
        reported = (f"node's {format_size(share)} share of the {format_size(report.usable)} free the {shared_by} "
                    f"nodes on {_machine(entry.host)} report")
    else:
        reported = f"{format_size(share)} the node reports free"
    given = entry.given
    if given is not None and given.usable_bytes <= share:
        relation = "below" if given.usable_bytes < share else "equal to"
        return replace(given, limit_source=f"{given.limit_source}, {relation} the {reported}", reported_bytes=share)
    if given is not None:
        seen += f", below the {format_size(given.usable_bytes)} in the {given.memory_from}"
    # kind "cpu": the figure is all the device offers, no Metal share of RAM to apply
    return Node(entry.name, max(report.total, share), share, seen, entry.host, entry.port, "cpu", FROM_NODE, share)


def _missing(entry: ClusterNode, answer: NoAnswer | None) -> str:
    add = "add `memory = \"...\"` to its [[node]] table"
    if answer is None:
        return (f"node {entry.name} ({entry.endpoint}): the cluster file gives it no `memory` and the nodes were not "
                f"asked (planning offline): {add}, or plan with the node running (`tbrpc plan` without --offline)")
    if isinstance(answer, SecretRefused):
        way_out = ("plan with the secret the node was started with (--secret-file PATH, the cluster file's "
                   "`secret_file` or TBRPC_SECRET_FILE; none for a node started without one)")
    else:
        way_out = f"start the node (`{entry.start_command}`)" if entry.start_command else "start the node"
    return (f"node {entry.name} ({entry.endpoint}) {_did_not(answer)} ({answer.why}) and the cluster file gives it "
            f"no `memory`: {way_out}, or {add} to plan without it")


def _did_not(answer: NoAnswer) -> str:
    return "refused this head's authentication" if isinstance(answer, SecretRefused) else "did not answer"


_NODES_RE = re.compile(r"^\s*(\d+)\s*[xX×]\s*(\S+)\s*$")


def nodes_from_flags(node_flags: list[str], nodes_flag: str | None, metal_fraction: float = defaults.METAL_FRACTION) -> list[Node]:
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
        return [with_origin(make_node(f"node{i}", match[2], metal_fraction=metal_fraction), FROM_FLAGS)
                for i in range(count)]
    nodes = []
    for flag in node_flags:
        name, sep, size = flag.partition("=")
        if not sep or not name or not size:
            raise ClusterError(f"--node wants NAME=SIZE like mac1=512GiB, got {flag!r}")
        nodes.append(with_origin(make_node(name, size, metal_fraction=metal_fraction), FROM_FLAGS))
    if not nodes:
        raise ClusterError("no nodes: pass --cluster FILE, --node NAME=SIZE or --nodes NxSIZE")
    check_unique(nodes)
    return nodes


def check_unique(nodes: Sequence[Node | ClusterNode], cluster_file: str | None = None) -> None:
    """ClusterError when two nodes share a name: of `cluster_file`'s [[node]] tables (the message names
    the file and both tables), else of the --node flags."""
    first: dict[str, int] = {}
    for i, node in enumerate(nodes):
        if node.name not in first:
            first[node.name] = i
        elif cluster_file is not None:
            raise ClusterError(f"{cluster_file}: node #{first[node.name] + 1} and node #{i + 1} are both named "
                               f"{node.name!r}: give each [[node]] table a name of its own")
        else:
            raise ClusterError(f"--node {node.name}=... is given twice: give each node a name of its own")
