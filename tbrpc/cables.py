"""The cables between machines, found from the addresses each one holds.

Thunderbolt links are point to point and do not route: each cable is its own
subnet, with one address at each end (docs/cluster.md, Four Macs). So a
subnet in which exactly two machines hold an address is taken for a cable
between them; one that three or more share is a network (a LAN, a switch),
not a cable. Loopback and link-local addresses never count (tbrpc/facts.py
leaves them out), and on a Mac only the Thunderbolt ports do, when its
facts list them: two Macs alone on one Ethernet switch would otherwise look
cabled. Two nodes on one host are one machine here.

For a cluster file that lists no `links`, launch and tbrpc.Llama fill them
from what this finds (links_from_cables, via tbrpc/llama.py's
discover_links); `tbrpc doctor` shows the cables and, where a node's entry
misses one, the `links` or `listen` line it needs (tbrpc/doctor.py,
cable_checks).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from tbrpc.spec import NodeSpec


@dataclass(frozen=True)
class End:
    machine: str
    interface: str
    address: str


@dataclass(frozen=True)
class Cable:
    network: str             # "10.0.12.0/24"
    ends: tuple[End, End]    # in the order the machines were given

    def at(self, machine: str) -> End | None:
        """This cable's end on `machine`, or None when it does not reach it."""
        return next((e for e in self.ends if e.machine == machine), None)

    def joins(self, a: str, b: str) -> bool:
        return {a, b} == {e.machine for e in self.ends}


def cable_addresses(facts: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The addresses of one machine's facts that may be a cable's end: every IPv4 address it
    reported, or on a Mac whose facts name its Thunderbolt ports, those on the ports only."""
    addresses = [a for a in facts.get("interfaces", []) if isinstance(a, Mapping)]
    ports = facts.get("macos", {}).get("thunderbolt_ports")
    return [a for a in addresses if a.get("interface") in ports] if ports else addresses


def find_cables(machines: Mapping[str, Sequence[Mapping[str, Any]]]) -> list[Cable]:
    """machine -> its addresses ({"interface", "address", "prefix"}); the cables between them,
    one per subnet that exactly two of them hold an address in, in the order the machines come."""
    order = {name: i for i, name in enumerate(machines)}
    holders: dict[ipaddress.IPv4Network, dict[str, End]] = {}
    for machine, addresses in machines.items():
        for a in addresses:
            try:
                iface = ipaddress.IPv4Interface(f"{a['address']}/{a['prefix']}")
            except (KeyError, TypeError, ValueError):
                continue
            if iface.network.prefixlen == 32:   # room for no other end
                continue
            holders.setdefault(iface.network, {}).setdefault(machine, End(machine, str(a.get("interface", "?")),
                                                                          str(iface.ip)))
    cables = []
    for network, ends in holders.items():
        if len(ends) == 2:
            a, b = sorted(ends.values(), key=lambda e: order[e.machine])
            cables.append(Cable(str(network), (a, b)))
    return sorted(cables, key=lambda c: (order[c.ends[0].machine], order[c.ends[1].machine], c.network))


def machines_of(facts: Mapping[str, Mapping[str, Any]]) -> dict[str, list[str]]:
    """name -> the names that run on the same host as it (its own first), one entry per host: facts
    with the same host id (the RDMA report's, which the transports use to tell hosts apart; its
    hostname where tbrpc's C library did not load) are one machine, named by the first."""
    out: dict[str, list[str]] = {}
    first_of: dict[str, str] = {}
    for name, f in facts.items():
        host_id = f.get("rdma", {}).get("host_id") or f.get("hostname")
        if host_id and host_id in first_of:
            out[first_of[host_id]].append(name)
            continue
        if host_id:
            first_of[host_id] = name
        out[name] = [name]
    return out



@dataclass(frozen=True)
class Cabling:
    """The cables between the machines of some nodes (each node's facts, tbrpc/facts.py)."""
    machines: dict[str, list[str]]    # machine (its first node's name) -> the nodes on it
    machine_of: dict[str, str]        # node -> its machine
    cables: list[Cable]

    def between(self, a: str, b: str) -> tuple[Cable, End] | None:
        """The cable between the machines of nodes a and b, with its end on b's; None when they
        are on one machine, no cable joins them, or either gave no facts."""
        ma, mb = self.machine_of.get(a), self.machine_of.get(b)
        if ma is None or mb is None or ma == mb:
            return None
        cable = next((c for c in self.cables if c.joins(ma, mb)), None)
        end = cable.at(mb) if cable else None
        return (cable, end) if cable and end else None


def cabling(node_facts: Mapping[str, Mapping[str, Any]]) -> Cabling:
    """The machines of the nodes with facts (node name -> facts) and the cables between them."""
    machines = machines_of(node_facts)
    return Cabling(machines, {name: first for first, names in machines.items() for name in names},
                   find_cables({m: cable_addresses(node_facts[m]) for m in machines}))


_ANY_ADDRESS = ("0.0.0.0", "::")


def discovers(specs: Sequence[NodeSpec]) -> bool:
    """Whether launch and tbrpc.Llama find these nodes' links from their cables: the file lists
    none, and at least one node is started over ssh (nodes started by hand are not asked)."""
    return not any(s.links for s in specs) and any(s.start == "ssh" for s in specs)


def asked(spec: NodeSpec) -> bool:
    """A node whose facts launch gathers: started over ssh, or here (`start = "local"`)."""
    return spec.start in ("ssh", "local")


def takes_cables(spec: NodeSpec) -> bool:
    """A node that takes connections on its cables: it listens on every address."""
    return spec.listen in _ANY_ADDRESS


@dataclass(frozen=True)
class Discovered:
    specs: list[NodeSpec]     # the nodes with a `links` entry for each cable into them
    added: list[str]          # "studio2 <- studio1 at 10.0.12.2 (en3, 10.0.12.0/24)", one per entry added
    unused: list[str]         # cables a node cannot take: it listens on its `host` only


def links_from_cables(specs: Sequence[NodeSpec], facts: Mapping[str, Mapping[str, Any]]) -> Discovered:
    """The nodes with `links` filled from the cables between their machines: for each cable
    between the machines of nodes a and b, b's entry gets a = b's end of it (where b names no
    address for a already), so a dials b over the cable. Only a node that listens on every
    address (`listen = "0.0.0.0"`) takes connections on its cables; for the others `unused`
    says which cable they leave aside. Nodes without facts keep their entries."""
    found = cabling({s.name: facts[s.name] for s in specs if s.name in facts})
    out, added, unused = [], [], []
    for b in specs:
        links = dict(b.links)
        for a in specs:
            joined = None if a.name in links else found.between(a.name, b.name)
            if joined is None:
                continue
            cable, end = joined
            if not takes_cables(b) and end.address != b.host:
                unused.append(f"{a.name} - {b.name} ({cable.network}): {b.name} listens on {b.listen_address} only; "
                              f'listen = "0.0.0.0" in its entry lets {a.name} reach it at {end.address}')
                continue
            links[a.name] = end.address
            added.append(f"{b.name} <- {a.name} at {end.address} ({end.interface}, {cable.network})")
        out.append(replace(b, links=tuple(links.items())))
    return Discovered(out, added, unused)
