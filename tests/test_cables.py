"""Cables between machines found from their addresses (tbrpc/cables.py), the addresses as the
machines report them (tbrpc/facts.py), and doctor's rows about them (tbrpc/doctor.py,
cable_checks), from recorded facts and from real interfaces in network namespaces."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from dataclasses import replace

from tbrpc import secret as cluster_secret
from tbrpc.cables import End, cable_addresses, find_cables, machines_of
from tbrpc.doctor import OK, WARN, cable_checks
from tbrpc.facts import parse_ifconfig, parse_ip_addr_json
from tbrpc.llama import discover_links
from tbrpc.spec import NodeSpec, SshTarget

ROOT = Path(__file__).resolve().parent.parent
LAN = "192.168.1.0/24"


def addr(interface: str, address: str, prefix: int = 24) -> dict[str, Any]:
    return {"interface": interface, "address": address, "prefix": prefix}


def ring_of_four() -> dict[str, list[dict[str, Any]]]:
    """docs/cluster.md's four Macs: one subnet per cable, 10.0.12/24 between studio1 and studio2 and
    so on round the ring, and every Mac on the LAN (en0) as well."""
    return {
        "studio1": [addr("en0", "192.168.1.11"), addr("en3", "10.0.12.1"), addr("en4", "10.0.41.1")],
        "studio2": [addr("en0", "192.168.1.12"), addr("en3", "10.0.12.2"), addr("en4", "10.0.23.2")],
        "studio3": [addr("en0", "192.168.1.13"), addr("en3", "10.0.23.3"), addr("en4", "10.0.34.3")],
        "studio4": [addr("en0", "192.168.1.14"), addr("en3", "10.0.34.4"), addr("en4", "10.0.41.4")],
    }


def test_a_ring_of_four_cables_and_not_the_lan() -> None:
    cables = find_cables(ring_of_four())
    found = {(c.ends[0].machine, c.ends[1].machine, c.network) for c in cables}
    assert found == {("studio1", "studio2", "10.0.12.0/24"), ("studio1", "studio4", "10.0.41.0/24"),
                     ("studio2", "studio3", "10.0.23.0/24"), ("studio3", "studio4", "10.0.34.0/24")}
    one_two = next(c for c in cables if c.joins("studio2", "studio1"))
    assert one_two.at("studio1") == End("studio1", "en3", "10.0.12.1")
    assert one_two.at("studio2") == End("studio2", "en3", "10.0.12.2")
    assert one_two.at("studio3") is None


def test_a_subnet_three_machines_share_is_a_network_not_a_cable() -> None:
    three = {m: [addr("en0", f"10.9.0.{i}")] for i, m in enumerate(("a", "b", "c"), 1)}
    assert find_cables(three) == []
    two = {m: [addr("en0", f"10.9.0.{i}")] for i, m in enumerate(("a", "b"), 1)}
    assert [c.network for c in find_cables(two)] == ["10.9.0.0/24"]


def test_a_full_mesh_of_four_is_six_cables() -> None:
    names = ["m0", "m1", "m2", "m3"]
    machines: dict[str, list[dict[str, Any]]] = {m: [] for m in names}
    for i in range(4):
        for j in range(i + 1, 4):
            machines[names[i]].append(addr(f"en{j}", f"10.1.{i * 4 + j}.1", 30))
            machines[names[j]].append(addr(f"en{i}", f"10.1.{i * 4 + j}.2", 30))
    assert len(find_cables(machines)) == 6


def test_addresses_that_cannot_be_a_cable_end() -> None:
    machines = {"a": [addr("x", "10.0.0.1", 32), addr("y", "not an address"), {"interface": "z"}, addr("p2p", "10.5.0.0", 31)],
                "b": [addr("x", "10.0.0.2", 32), addr("p2p", "10.5.0.1", 31)]}
    assert [(c.network, c.at("b")) for c in find_cables(machines)] == [("10.5.0.0/31", End("b", "p2p", "10.5.0.1"))]


def test_a_mac_counts_its_thunderbolt_ports_only() -> None:
    facts = {"interfaces": [addr("en0", "192.168.1.11"), addr("en3", "10.0.12.1")],
             "macos": {"thunderbolt_ports": ["en3", "en4"]}}
    assert [a["interface"] for a in cable_addresses(facts)] == ["en3"]
    assert [a["interface"] for a in cable_addresses({"interfaces": facts["interfaces"]})] == ["en0", "en3"]
    # two Macs alone on one Ethernet switch are not cabled
    macs = {m: cable_addresses({"interfaces": [addr("en0", f"192.168.1.{i}")], "macos": {"thunderbolt_ports": ["en3"]}})
            for i, m in ((1, "a"), (2, "b"))}
    assert find_cables(macs) == []


def test_nodes_on_one_host_are_one_machine() -> None:
    facts = {"n0": {"rdma": {"host_id": "aa"}}, "n1": {"rdma": {"host_id": "aa"}}, "n2": {"rdma": {"host_id": "bb"}},
             "n3": {}, "n4": {"rdma": {"kind": "unavailable"}, "hostname": "h"}, "n5": {"hostname": "h"}}
    assert machines_of(facts) == {"n0": ["n0", "n1"], "n2": ["n2"], "n3": ["n3"], "n4": ["n4", "n5"]}


IP_JSON = json.dumps([
    {"ifindex": 1, "ifname": "lo", "addr_info": [{"family": "inet", "local": "127.0.0.1", "prefixlen": 8}]},
    {"ifindex": 4, "ifname": "eth0", "addr_info": [{"family": "inet", "local": "192.0.2.2", "prefixlen": 24},
                                                   {"family": "inet6", "local": "fe80::1", "prefixlen": 64}]},
    {"ifindex": 5, "ifname": "tb0", "addr_info": [{"family": "inet", "local": "169.254.3.7", "prefixlen": 16},
                                                  {"family": "inet", "local": "10.0.12.1", "prefixlen": 24}]},
])

IFCONFIG = """lo0: flags=8049<UP,LOOPBACK,RUNNING,MULTICAST> mtu 16384
\tinet 127.0.0.1 netmask 0xff000000
en0: flags=8863<UP,BROADCAST,SMART,RUNNING,SIMPLEX,MULTICAST> mtu 1500
\tether 3c:a6:f6:00:00:01
\tinet 192.168.1.11 netmask 0xffffff00 broadcast 192.168.1.255
en3: flags=8863<UP,BROADCAST,SMART,RUNNING,SIMPLEX,MULTICAST> mtu 1500
\tinet6 fe80::1%en3 prefixlen 64 scopeid 0x9
\tinet 10.0.12.1 netmask 0xfffffffc broadcast 10.0.12.3
\tstatus: active
bridge0: flags=8863<UP,BROADCAST,SMART,RUNNING,SIMPLEX,MULTICAST> mtu 1500
\tinet 169.254.10.20 netmask 0xffff0000 broadcast 169.254.255.255
"""


def test_addresses_from_linux_ip_json() -> None:
    assert parse_ip_addr_json(IP_JSON) == [addr("eth0", "192.0.2.2"), addr("tb0", "10.0.12.1")]
    assert parse_ip_addr_json("not json") == [] and parse_ip_addr_json('{"x": 1}') == []


def test_addresses_from_macos_ifconfig() -> None:
    assert parse_ifconfig(IFCONFIG) == [addr("en0", "192.168.1.11"), addr("en3", "10.0.12.1", 30)]


def spec(name: str, host: str, **links: str) -> NodeSpec:
    return NodeSpec(name=name, host=host, port=50052, links=tuple(links.items()))


def ring_facts() -> dict[str, dict[str, Any]]:
    return {m: {"interfaces": a, "rdma": {"host_id": f"host-{m}"}} for m, a in ring_of_four().items()}


def rows(checks: list[Any]) -> dict[tuple[str, str], Any]:
    return {(c.node, c.name): c for c in checks}


def test_doctor_says_which_cables_a_file_without_links_misses() -> None:
    """The nodes reached over the LAN, no `links`: every hop misses its cable, and the fix is
    the `links` line for that node's entry, with the address of its end of each cable."""
    specs = [spec(f"studio{i}", f"192.168.1.1{i}") for i in range(1, 5)]
    got = rows(cable_checks(specs, ring_facts()))
    assert got[("studio1", "cables")].status == OK
    assert got[("studio1", "cables")].detail == ("to studio2: en3 10.0.12.1 - en3 10.0.12.2 (10.0.12.0/24); "
                                                 "to studio4: en4 10.0.41.1 - en4 10.0.41.4 (10.0.41.0/24)")
    hop = got[("studio2", "cable from studio1")]
    assert hop.status == WARN and "they go to its host 192.168.1.12" in hop.detail
    assert hop.fix == """in studio2's entry of the cluster file: links = { studio1 = "10.0.12.2", studio3 = "10.0.23.2" }"""
    assert got[("studio4", "cable from studio3")].fix.endswith(
        'links = { studio1 = "10.0.41.4", studio3 = "10.0.34.4" }')
    # the way back, studio4 -> studio1, is a cable too: the last link of a tensor split's ring all-reduce
    back = got[("studio1", "cable from studio4")]
    assert back.status == WARN and back.detail.startswith("a tensor split's ring all-reduce from studio4 miss"), back
    assert back.fix.endswith('links = { studio2 = "10.0.12.1", studio4 = "10.0.41.1" }'), back


def test_doctor_passes_links_on_the_cables_and_names_a_wrong_one() -> None:
    specs = [spec("studio1", "192.168.1.11"), spec("studio2", "10.0.12.2"),
             spec("studio3", "192.168.1.13", studio2="10.0.23.3"), spec("studio4", "192.168.1.14", studio3="10.0.23.9")]
    got = rows(cable_checks(specs, ring_facts()))
    assert got[("studio2", "cable from studio1")].status == OK and "`host`" in got[("studio2", "cable from studio1")].detail
    assert got[("studio3", "cable from studio2")].status == OK and "`links`" in got[("studio3", "cable from studio2")].detail
    wrong = got[("studio4", "cable from studio3")]
    assert wrong.status == WARN and "`links` says studio3 reaches it at 10.0.23.9" in wrong.detail
    assert "en3 10.0.34.4" in wrong.detail and 'studio3 = "10.0.34.4"' in wrong.fix


def test_doctor_on_a_cabled_cluster_names_a_missing_cable() -> None:
    facts = ring_facts()
    facts["studio3"]["interfaces"] = [a for a in facts["studio3"]["interfaces"] if a["interface"] != "en3"]
    got = rows(cable_checks([spec(f"studio{i}", f"192.168.1.1{i}") for i in range(1, 5)], facts))
    assert got[("studio3", "cable from studio2")].status == WARN
    assert "no cable found between studio2 and studio3" in got[("studio3", "cable from studio2")].detail


def test_doctor_checks_only_consecutive_nodes_it_has_facts_for() -> None:
    """studio3 did not answer: no row for the hops into or out of it, and studio4's hop is not
    taken for one from studio2 (they run no consecutive layers)."""
    facts = ring_facts()
    del facts["studio3"]
    got = rows(cable_checks([spec(f"studio{i}", f"192.168.1.1{i}") for i in range(1, 5)], facts))
    assert [k for k in got if k[1].startswith("cable from")] == [("studio2", "cable from studio1"),
                                                                  ("studio1", "cable from studio4")]


def test_doctor_has_nothing_to_say_without_cables() -> None:
    """Nodes on one LAN, or several on one host: no cable rows at all."""
    lan = {m: {"interfaces": [addr("eth0", f"10.9.0.{i}")], "rdma": {"host_id": m}} for i, m in enumerate("abc", 1)}
    assert cable_checks([spec(m, f"10.9.0.{i}") for i, m in enumerate("abc", 1)], lan) == []
    one_host = {m: {"interfaces": [addr("eth0", "10.9.0.1")], "rdma": {"host_id": "same"}} for m in "ab"}
    assert cable_checks([spec(m, "10.9.0.1") for m in "ab"], one_host) == []


def _netns(*argv: str) -> None:
    subprocess.run(["ip", *argv], check=True, capture_output=True)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None,
                    reason="network namespaces need root and iproute2 (the parsing is tested above without them)")
def test_cables_between_network_namespaces(tmp_path: Path) -> None:
    """Three "machines" (network namespaces) in a line of veth "cables", each cable its own subnet,
    all three on one more subnet (a bridge: the LAN): tbrpc.facts in each sees its real interfaces,
    and the cables found are the two veth pairs, not the LAN."""
    tag = f"tb{os.getpid() % 10000}"
    spaces = [f"{tag}{i}" for i in range(3)]
    try:
        for ns in spaces:
            _netns("netns", "add", ns)
        _netns("netns", "exec", spaces[0], "ip", "link", "add", "lan", "type", "bridge")
        _netns("netns", "exec", spaces[0], "ip", "link", "set", "lan", "up")
        _netns("netns", "exec", spaces[0], "ip", "addr", "add", "10.77.0.1/24", "dev", "lan")
        for i in (1, 2):   # the others' LAN ports on the bridge in namespace 0
            _netns("link", "add", f"{tag}l{i}", "netns", spaces[i], "type", "veth", "peer", "name", f"{tag}p{i}",
                   "netns", spaces[0])
            _netns("netns", "exec", spaces[0], "ip", "link", "set", f"{tag}p{i}", "master", "lan", "up")
            _netns("netns", "exec", spaces[i], "ip", "addr", "add", f"10.77.0.{i + 1}/24", "dev", f"{tag}l{i}")
            _netns("netns", "exec", spaces[i], "ip", "link", "set", f"{tag}l{i}", "up")
        for i in (0, 1):   # cables: 0-1 on 10.0.1x/24, 1-2 on 10.0.2x/24
            a, b = spaces[i], spaces[i + 1]
            _netns("link", "add", f"{tag}c{i}a", "netns", a, "type", "veth", "peer", "name", f"{tag}c{i}b", "netns", b)
            _netns("netns", "exec", a, "ip", "addr", "add", f"10.0.{i + 1}{i + 2}.1/24", "dev", f"{tag}c{i}a")
            _netns("netns", "exec", b, "ip", "addr", "add", f"10.0.{i + 1}{i + 2}.2/24", "dev", f"{tag}c{i}b")
            _netns("netns", "exec", a, "ip", "link", "set", f"{tag}c{i}a", "up")
            _netns("netns", "exec", b, "ip", "link", "set", f"{tag}c{i}b", "up")
        seen = {}
        for ns in spaces:
            out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c",
                                  "import json; from tbrpc.facts import interface_addresses; "
                                  "print(json.dumps(interface_addresses()))"],
                                 capture_output=True, text=True, check=True, cwd=ROOT,
                                 env={**os.environ, "PYTHONPATH": str(ROOT)})
            seen[ns] = json.loads(out.stdout)
        assert {a["address"] for a in seen[spaces[1]]} == {"10.77.0.2", "10.0.12.2", "10.0.23.1"}, seen
        cables = find_cables(seen)
        assert [(c.ends[0].machine, c.ends[1].machine, c.network) for c in cables] == [
            (spaces[0], spaces[1], "10.0.12.0/24"), (spaces[1], spaces[2], "10.0.23.0/24")]
        assert cables[0].at(spaces[1]) == End(spaces[1], f"{tag}c0b", "10.0.12.2")
    finally:
        for ns in spaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


# ---- launch and tbrpc.Llama: a cluster file without `links` takes them from the cables found ----

def ssh_spec(name: str, host: str, position: int, listen: str | None = "0.0.0.0") -> NodeSpec:
    return NodeSpec(name=name, host=host, port=50052, start="ssh", ssh=SshTarget(host=host), listen=listen,
                    file_position=position)


def recorded(facts: dict[str, dict[str, Any]], asked: list[str]) -> Any:
    def gather(spec: NodeSpec) -> tuple[dict[str, Any] | None, str, str]:
        asked.append(spec.name)
        return (facts[spec.name], "", "") if spec.name in facts else (None, f"ssh {spec.host} failed", "ssh")
    return gather


def test_links_and_order_come_from_the_cables_found() -> None:
    """The file lists the Macs out of ring order and names no cable: the links become each node's end of
    each of its cables, and the nodes go round the ring (cable_order), as a file with those links would."""
    hosts = {f"studio{i}": f"192.168.1.1{i}" for i in range(1, 5)}
    specs = [ssh_spec(n, hosts[n], i) for i, n in enumerate(["studio1", "studio3", "studio2", "studio4"])]
    said: list[str] = []
    asked: list[str] = []
    got = discover_links(specs, said.append, recorded(ring_facts(), asked))
    assert sorted(asked) == sorted(hosts)
    assert [s.name for s in got] == ["studio1", "studio2", "studio3", "studio4"]
    assert {s.name: dict(s.links) for s in got} == {
        "studio1": {"studio2": "10.0.12.1", "studio4": "10.0.41.1"},
        "studio2": {"studio1": "10.0.12.2", "studio3": "10.0.23.2"},
        "studio3": {"studio2": "10.0.23.3", "studio4": "10.0.34.3"},
        "studio4": {"studio3": "10.0.34.4", "studio1": "10.0.41.4"}}
    assert any(line.startswith("links from the cables found") and "studio2 <- studio1 at 10.0.12.2 (en3, 10.0.12.0/24)"
               in line for line in said), said
    # doctor then finds every hop on its cable
    assert {c.status for c in cable_checks(got, ring_facts())} == {OK}


def test_doctor_on_a_file_launch_will_find_the_cables_for() -> None:
    """No `links` and nodes started over ssh: launch takes each cable a node listens on, so doctor
    passes those hops, and for a node listening on its `host` only says the `listen` line instead."""
    specs = [ssh_spec(f"studio{i}", f"192.168.1.1{i}", i - 1, listen=None if i == 3 else "0.0.0.0") for i in range(1, 5)]
    got = rows(cable_checks(specs, ring_facts()))
    hop = got[("studio2", "cable from studio1")]
    assert hop.status == OK and hop.detail.endswith("launch finds it (no `links` in the file)"), hop
    deaf = got[("studio3", "cable from studio2")]
    assert deaf.status == WARN and "studio3 listens on 192.168.1.13 only" in deaf.detail, deaf
    assert deaf.fix == 'listen = "0.0.0.0" in studio3\'s entry (launch then finds the cable itself)'
    assert got[("studio1", "cable from studio4")].status == OK


def test_a_node_listening_on_its_host_only_keeps_its_cables_unused() -> None:
    specs = [ssh_spec("studio1", "192.168.1.11", 0), ssh_spec("studio2", "192.168.1.12", 1, listen=None)]
    facts = {k: v for k, v in ring_facts().items() if k in ("studio1", "studio2")}
    said: list[str] = []
    got = discover_links(specs, said.append, recorded(facts, []))
    # studio1 takes its cable, so studio2 goes first: its activations reach studio1 over it
    assert [(s.name, dict(s.links)) for s in got] == [("studio2", {}), ("studio1", {"studio2": "10.0.12.1"})]
    assert any("cable not used: studio1 - studio2 (10.0.12.0/24): studio2 listens on 192.168.1.12 only; "
               'listen = "0.0.0.0" in its entry lets studio1 reach it at 10.0.12.2' in line for line in said), said


def test_a_file_with_links_or_without_ssh_nodes_is_taken_as_written() -> None:
    asked: list[str] = []
    written = [ssh_spec("studio1", "192.168.1.11", 0), replace(ssh_spec("studio2", "192.168.1.12", 1), links=(("studio1", "10.9.9.9"),))]
    assert discover_links(written, lambda m: None, recorded(ring_facts(), asked)) == written
    by_hand = [replace(s, start="manual", ssh=None) for s in written]
    assert discover_links(by_hand, lambda m: None, recorded(ring_facts(), asked)) == by_hand
    assert asked == []


def test_a_node_without_facts_keeps_its_entry_and_says_so() -> None:
    hosts = {f"studio{i}": f"192.168.1.1{i}" for i in range(1, 5)}
    specs = [ssh_spec(n, h, i) for i, (n, h) in enumerate(hosts.items())]
    facts = ring_facts()
    del facts["studio3"]
    said: list[str] = []
    got = {s.name: dict(s.links) for s in discover_links(specs, said.append, recorded(facts, []))}
    assert got["studio3"] == {} and got["studio2"] == {"studio1": "10.0.12.2"} and got["studio4"] == {"studio1": "10.0.41.4"}
    assert any("no cables looked for from studio3 (ssh 192.168.1.13 failed)" in line for line in said), said


def _start_node_in(ns: str, tmp_path: Path, host_id: str, secret: Path) -> tuple[subprocess.Popen[bytes], int]:
    from tbrpc.node_processes import listening_port

    log = tmp_path / f"node-{ns}.log"
    proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-I", "-m", "tbrpc.cli", "node", "--host", "0.0.0.0",
                             "--port", "0", "--threads", "1", "--secret-file", str(secret)], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=open(log, "wb"), env={**os.environ, "TBRPC_HOST_ID": host_id})
    for _ in range(600):
        port = listening_port(log.read_text(errors="replace"))
        if port is not None:
            return proc, port
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"node in {ns} did not start: {log.read_text(errors='replace')}")


def _head_in(ns: str, tmp_path: Path, **spec: Any) -> dict[str, Any]:
    tag = time.monotonic_ns()
    spec_path, out_path = tmp_path / f"spec-{tag}.json", tmp_path / f"out-{tag}.json"
    spec_path.write_text(json.dumps({"logits_path": str(tmp_path / f"logits-{tag}.npy"), **spec}))
    proc = subprocess.run(["ip", "netns", "exec", ns, sys.executable, str(ROOT / "tests" / "head.py"), str(spec_path),
                           str(out_path)], cwd=ROOT, capture_output=True, timeout=600)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")[-3000:]
    return json.loads(out_path.read_text())


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None,
                    reason="network namespaces need root and iproute2 (the parsing is tested above without them)")
def test_a_ring_of_cables_between_namespaces_carries_the_split(tmp_path: Path) -> None:
    """Four nodes, each in a network namespace of its own ("a Mac"), cabled in a ring by veth pairs, one
    subnet per cable, and each reachable from the head's namespace over a link of its own; the head's
    namespace does not forward, so a node reaches another only over a cable between them, as on a
    Thunderbolt ring. The links found from the nodes' own facts (tbrpc.facts run in each namespace,
    discover_links) let every node send activations to the next over their cable: the same tokens as
    one process. Without them each next node's `host` is out of reach from the one before, no link is
    made, and the head carries every hop (the same tokens, the slow way)."""
    import models

    tag = f"tc{os.getpid() % 10000}"
    head_ns, spaces = f"{tag}h", [f"{tag}n{k}" for k in range(4)]
    started: list[subprocess.Popen[bytes]] = []
    try:
        for ns in (head_ns, *spaces):
            _netns("netns", "add", ns)
            _netns("netns", "exec", ns, "ip", "link", "set", "lo", "up")
        for k, ns in enumerate(spaces):   # the head's link to node k: 10.88.k.0/30
            _netns("link", "add", f"{tag}h{k}", "netns", head_ns, "type", "veth", "peer", "name", f"{tag}u{k}", "netns", ns)
            _netns("netns", "exec", head_ns, "ip", "addr", "add", f"10.88.{k}.1/30", "dev", f"{tag}h{k}")
            _netns("netns", "exec", ns, "ip", "addr", "add", f"10.88.{k}.2/30", "dev", f"{tag}u{k}")
            _netns("netns", "exec", head_ns, "ip", "link", "set", f"{tag}h{k}", "up")
            _netns("netns", "exec", ns, "ip", "link", "set", f"{tag}u{k}", "up")
        for k in range(4):   # the cable from node k to node k+1: 10.50.k.0/24, .1 at k, .2 at k+1
            a, b = spaces[k], spaces[(k + 1) % 4]
            _netns("link", "add", f"{tag}c{k}a", "netns", a, "type", "veth", "peer", "name", f"{tag}c{k}b", "netns", b)
            _netns("netns", "exec", a, "ip", "addr", "add", f"10.50.{k}.1/24", "dev", f"{tag}c{k}a")
            _netns("netns", "exec", b, "ip", "addr", "add", f"10.50.{k}.2/24", "dev", f"{tag}c{k}b")
            _netns("netns", "exec", a, "ip", "link", "set", f"{tag}c{k}a", "up")
            _netns("netns", "exec", b, "ip", "link", "set", f"{tag}c{k}b", "up")
        secret = cluster_secret.new(tmp_path / "secret")   # nodes listening on every address need one
        ports = []
        for ns in spaces:
            proc, port = _start_node_in(ns, tmp_path, ns, secret)
            started.append(proc)
            ports.append(port)
        specs = [ssh_spec(f"node{k}", f"10.88.{k}.2", k) for k in range(4)]
        for k, s in enumerate(specs):
            specs[k] = replace(s, port=ports[k])

        def gather(spec: NodeSpec) -> tuple[dict[str, Any] | None, str, str]:   # the node's own facts, in its namespace
            ns = spaces[int(spec.name[-1])]
            out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-m", "tbrpc.facts"], cwd=ROOT,
                                 capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT),
                                                                      "TBRPC_HOST_ID": ns}, timeout=120)
            return (json.loads(out.stdout), "", "") if out.returncode == 0 else (None, out.stderr[-300:], "node facts")

        said: list[str] = []
        found = discover_links(specs, said.append, gather)
        assert [s.name for s in found] == ["node0", "node1", "node2", "node3"], said
        assert {s.name: dict(s.links) for s in found} == {
            "node0": {"node1": "10.50.0.1", "node3": "10.50.3.2"}, "node1": {"node0": "10.50.0.2", "node2": "10.50.1.1"},
            "node2": {"node1": "10.50.1.2", "node3": "10.50.2.1"}, "node3": {"node2": "10.50.2.2", "node0": "10.50.3.1"}}
        by_name = {s.name: s.endpoint for s in found}
        addresses = [[by_name[a], s.endpoint, host] for s in found for a, host in s.links]
        run = dict(model=str(models.ensure("llama")), prompt="The capital of France is", n_predict=6,
                   nodes=[s.endpoint for s in found], env={"TBRPC_TRANSPORT": "tcp"}, transport="tcp",
                   secret_file=str(secret))
        alone = _head_in(head_ns, tmp_path, **{k: v for k, v in run.items() if k in ("model", "prompt", "n_predict")})
        cabled = _head_in(head_ns, tmp_path, **run, peer_addresses=addresses)
        relayed = _head_in(head_ns, tmp_path, **run)
        for result in (alone, cabled, relayed):
            assert result["error"] is None, result["error"]
        assert cabled["tokens"] == alone["tokens"] == relayed["tokens"]
        endpoints = [s.endpoint for s in found]
        for k in range(3):   # each node's link to the next: over their cable, or none
            cabled_link = {x["to"]: x for x in cabled["nodes"][k]["peer_links"]}[endpoints[k + 1]]
            assert cabled_link["usable"] and cabled_link["transport"].startswith("tcp"), cabled_link
            assert cabled["nodes"][k]["peer_copies"] > 0, cabled["nodes"][k]
            relayed_link = {x["to"]: x for x in relayed["nodes"][k]["peer_links"]}.get(endpoints[k + 1])
            assert relayed_link is None or not relayed_link["usable"], relayed_link
            assert relayed["nodes"][k]["peer_copies"] == 0, relayed["nodes"][k]
    finally:
        for proc in started:
            proc.kill()
            proc.wait()
        for ns in (head_ns, *spaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_plan_looks_for_the_cables_launch_will_use(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`tbrpc plan --cluster` on a file without `links` finds the cables as launch does: the nodes
    planned in ring order and the ring all-reduce, as launch will run them; `--offline` asks
    nothing and plans the file as written (its order, a mesh)."""
    import models
    from click.testing import CliRunner

    from tbrpc.cli import main as cli_main

    order = ["studio1", "studio3", "studio2", "studio4"]
    path = tmp_path / "macs.toml"
    path.write_text("".join(f'[[node]]\nname = "{n}"\nhost = "192.168.1.1{n[-1]}"\nport = 50052\nstart = "ssh"\n'
                            f'listen = "0.0.0.0"\nmemory = "4GiB"\nkind = "cpu"\n\n' for n in order))
    asked: list[str] = []
    monkeypatch.setattr("tbrpc.llama.gather_facts", lambda spec, secret, timeout: recorded(ring_facts(), asked)(spec))

    def planned(*flags: str) -> tuple[dict[str, Any], str]:
        out = CliRunner().invoke(cli_main, ["plan", "--gguf", str(models.ensure("llama-f32")), "--ctx", "256", "--margin", "0",
                                            "--split", "tensor", "--head-device", "none", "--cluster", str(path),
                                            "--timeout", "0.3", "--json", *flags], env={"TBRPC_ALLREDUCE": ""})
        assert out.exit_code == 0, out.output + out.stderr
        return json.loads(out.stdout), out.stderr

    found, said = planned()
    assert sorted(asked) == sorted(order)
    assert [n["name"] for n in found["nodes"]] == ["studio1", "studio2", "studio3", "studio4"]
    assert found["tensor"]["all_reduce_shape"] == "ring"
    assert "links from the cables found" in said and "studio2 <- studio1 at 10.0.12.2" in said, said
    assert any("ordered along the cables" in note for note in found["notes"]), found["notes"]
    asked.clear()
    written, _ = planned("--offline")
    assert asked == []
    assert [n["name"] for n in written["nodes"]] == order and written["tensor"]["all_reduce_shape"] == "mesh"
