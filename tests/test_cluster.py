"""Node capacity: cluster files, --node/--nodes flags, Metal's wired-memory limit."""

from __future__ import annotations

import re
import socket
from pathlib import Path
from typing import Any

import pytest

from tbrpc import defaults
from tbrpc.cluster_file import load_cluster_file, load_specs, read_cluster_file
from tbrpc.node_memory import (
    FROM_FILE, ClusterError, ClusterNode, NoAnswer, Node, Report, SecretRefused, make_node, nodes_from_flags, size_nodes,
    with_origin,
)
from tbrpc.spec import endpoint_specs, split_endpoint
from tbrpc.units import GiB, format_size, parse_size


def test_sizes_keep_binary_and_decimal_apart() -> None:
    assert parse_size("512GiB") == 512 * GiB
    assert parse_size("512G") == 512 * GiB
    assert parse_size("512GB") == 512 * 10**9
    assert parse_size("1.5TiB") == int(1.5 * 1024 * GiB)
    assert parse_size("4096") == 4096
    assert format_size(578 * GiB) == "578.0 GiB"
    with pytest.raises(ValueError, match="unknown size unit"):
        parse_size("12 parsecs")


def test_metal_default_limit_is_explicit() -> None:
    node = make_node("mac1", "512GiB")
    assert node.usable_bytes == 384 * GiB
    assert "75%" in node.limit_source and "iogpu.wired_limit_mb" in node.limit_source


def test_overrides_of_the_limit() -> None:
    assert make_node("m", "512GiB", wired_limit="480GiB").usable_bytes == 480 * GiB
    assert make_node("m", "512GiB", usable_memory="500GiB").usable_bytes == 500 * GiB
    assert make_node("m", "512GiB", metal_fraction=0.9).usable_bytes == int(512 * GiB * 0.9)
    assert make_node("linux", "256GiB", kind="cpu").usable_bytes == 256 * GiB
    with pytest.raises(ClusterError, match="exceeds its RAM"):
        make_node("m", "64GiB", usable_memory="65GiB")


def test_cluster_file_reads_every_key_it_knows(tmp_path: Path) -> None:
    path = tmp_path / "cluster.toml"
    path.write_text(
        """
        [[node]]
        name = "mac1"
        host = "10.0.0.1"
        port = 50052
        memory = "512GiB"
        python = "/opt/venv/bin/python"

        [[node]]
        name = "mac2"
        host = "10.0.0.2"
        port = 50053
        memory = "192GiB"
        usable_memory = "180GiB"
        """
    )
    head, second = load_cluster_file(path)
    assert (head.name, head.host, head.port, head.usable_bytes) == ("mac1", "10.0.0.1", 50052, 384 * GiB)
    assert (second.name, second.usable_bytes, second.limit_source) == ("mac2", 180 * GiB,
                                                                       "cluster file (usable_memory set explicitly)")
    assert (second.memory_from, second.reported_bytes) == ("cluster file", None)


@pytest.mark.parametrize("text, message", [
    # a misspelt `memory` would plan with what the node reports, a misspelt `secret_file` start it without one
    ('[[node]]\nname = "s2"\nhost = "h"\nport = 1\nmemroy = "64GiB"\n',
     "node s2: unknown key 'memroy' (did you mean 'memory'?)"),
    ('[[node]]\nname = "s2"\nhost = "h"\nport = 1\nsecret_flie = "/s"\nthreds = 2\n',
     "node s2: unknown keys 'secret_flie' (did you mean 'secret_file'?), 'threds' (did you mean 'threads'?)"),
    ('[[node]]\nnmae = "s2"\nhost = "h"\nport = 1\n',   # not "missing required key 'name'"
     "node #1: unknown key 'nmae' (did you mean 'name'?)"),
    ('secert_file = "/s"\n[[node]]\nname = "s2"\nhost = "h"\nport = 1\n',
     "top level: unknown key 'secert_file' (did you mean 'secret_file'?)"),
    ('ssh_user = "ops"\n[[node]]\nname = "s2"\nhost = "h"\nport = 1\n',
     "top level: unknown key 'ssh_user' (known: secret_file, node)"),
    ('[[node]]\nname = "s2"\nhost = "h"\nport = 1\nssh = { usr = "me" }\n',
     "node s2: ssh: unknown key 'usr' (did you mean 'user'?)"),
])
def test_unknown_keys_are_refused_naming_the_closest(tmp_path: Path, text: str, message: str) -> None:
    """A key tbrpc does not know stops every reader of the file, naming the file, the node, the key and the
    known key it is closest to."""
    path = tmp_path / "tbrpc.toml"
    path.write_text(text)
    for read in (load_specs, load_cluster_file):
        with pytest.raises(ClusterError) as refused:
            read(path)
        assert str(refused.value) == f"{path}: {message}"


def test_cluster_file_errors_name_the_problem(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('[[node]]\nname = "a"\nhost = "h"\nport = 1\n')
    with pytest.raises(ClusterError) as offline:
        load_cluster_file(path)   # offline: nobody to ask
    assert str(offline.value) == ('node a (h:1): the cluster file gives it no `memory` and the nodes were not asked '
                                  '(planning offline): add `memory = "..."` to its [[node]] table, or plan with the '
                                  'node running (`tbrpc plan` without --offline)')
    path.write_text('[[node]]\nname = "a"\nport = 1\nmemory = "1GiB"\n')
    with pytest.raises(ClusterError, match="missing required key 'host'"):
        load_cluster_file(path)
    path.write_text('secret_file = "/s"\n')
    with pytest.raises(ClusterError, match="no \\[\\[node\\]\\]"):
        load_cluster_file(path)


def test_two_nodes_of_one_name_are_refused_naming_the_file_and_both_tables(tmp_path: Path) -> None:
    """Every command reads the file: each says which file and which two tables share the name (it said
    only "node name 'a' is used twice", which names neither the file nor the tables)."""
    path = tmp_path / "bad.toml"
    path.write_text('[[node]]\nname = "a"\nhost = "h"\nport = 1\nmemory = "1GiB"\n'
                    '[[node]]\nname = "b"\nhost = "h"\nport = 2\nmemory = "1GiB"\n'
                    '[[node]]\nname = "a"\nhost = "h"\nport = 3\nmemory = "1GiB"\n')
    for read in (load_cluster_file, load_specs):
        with pytest.raises(ClusterError) as refused:
            read(path)
        assert str(refused.value) == (f"{path}: node #1 and node #3 are both named 'a': "
                                      "give each [[node]] table a name of its own")
    with pytest.raises(ClusterError) as flags:
        nodes_from_flags(["a=1GiB", "a=2GiB"], None)
    assert str(flags.value) == "--node a=... is given twice: give each node a name of its own"


def test_one_node_listed_twice_is_refused_naming_both(tmp_path: Path) -> None:
    """The same port at the same host, by name or by address, is one node: its memory must not count twice."""
    path = tmp_path / "cluster.toml"
    path.write_text('[[node]]\nname = "a"\nhost = "127.0.0.1"\nport = 50061\nmemory = "1GiB"\n'
                    '[[node]]\nname = "b"\nhost = "localhost"\nport = 50061\nmemory = "1GiB"\n')
    for read in (load_cluster_file, load_specs):
        with pytest.raises(ClusterError) as refused:
            read(path)
        assert str(refused.value) == (f"{path}: nodes a (127.0.0.1:50061) and b (localhost:50061) are the same node "
                                      "(127.0.0.1 port 50061): list each node once")
    with pytest.raises(ClusterError, match="nodes 127.0.0.1:50061 and 127.0.0.1:50061 are the same node"):
        endpoint_specs(["127.0.0.1:50061"] * 2)
    # another port, or another host, is another node
    assert len(endpoint_specs(["127.0.0.1:50061", "localhost:50062", "10.1.2.3:50061"])) == 3


def test_only_hosts_sharing_a_port_are_resolved(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every cluster-file load checks for one node listed twice; a name is looked up only when another
    node uses its port, so a slow resolver stalls no `tbrpc status` of a cluster with distinct ports."""
    looked_up: list[str] = []

    def getaddrinfo(host: str, *args: Any, **kwargs: Any) -> list[Any]:
        looked_up.append(host)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.9", 0))]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    assert len(endpoint_specs(["mac1:50061", "mac2:50062", "mac3:50063"])) == 3
    assert looked_up == []
    with pytest.raises(ClusterError, match="nodes mac1:50061 and mac3:50061 are the same node"):
        endpoint_specs(["mac1:50061", "mac2:50062", "mac3:50061"])
    assert sorted(looked_up) == ["mac1", "mac3"]


def test_flags() -> None:
    nodes = nodes_from_flags([], "4x512GiB")
    assert [n.name for n in nodes] == ["node0", "node1", "node2", "node3"]
    assert {n.usable_bytes for n in nodes} == {384 * GiB}
    named = nodes_from_flags(["head=192GiB", "big=512GiB"], None)
    assert [(n.name, n.memory_bytes) for n in named] == [("head", 192 * GiB), ("big", 512 * GiB)]
    with pytest.raises(ClusterError):
        nodes_from_flags(["oops"], None)
    with pytest.raises(ClusterError):
        nodes_from_flags(["a=1GiB"], "2x1GiB")
    with pytest.raises(ClusterError):
        nodes_from_flags([], None)
    assert format_size(nodes[0].usable_bytes) == "384.0 GiB"


# --- memory from the cluster file, from the nodes, or both -----------------------------


def test_memory_is_optional(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(
        """
        [[node]]
        name = "asks"
        host = "10.0.0.1"
        port = 50052

        [[node]]
        name = "capped"
        host = "10.0.0.2"
        port = 50052
        usable_memory = "20GiB"   # a cap on its own

        [[node]]
        name = "wired"
        host = "10.0.0.3"
        port = 50052
        wired_limit = "400GiB"
        """
    )
    asks, capped, wired = read_cluster_file(path)
    assert asks == ClusterNode("asks", "10.0.0.1", 50052, None,
                               start_command="tbrpc node --host 10.0.0.1 --port 50052 --name asks")
    assert capped.given is not None and capped.given.usable_bytes == 20 * GiB
    assert capped.given.limit_source == "cluster file (usable_memory set explicitly)"
    assert wired.given is not None and wired.given.usable_bytes == 400 * GiB
    for keys, message in [("metal_fraction = 0.9", "metal_fraction needs `memory`"),
                          ('kind = "cpu"\nwired_limit = "8GiB"', "wired_limit needs `memory`")]:
        path.write_text(f'[[node]]\nname = "x"\nhost = "h"\nport = 1\n{keys}\n')
        with pytest.raises(ClusterError, match=message):
            read_cluster_file(path)


CPU_24 = Report("CPU", 24 * GiB, 24 * GiB)


def load_node(node: Node) -> Node:
    """`node` as read from a cluster file."""
    return with_origin(node, FROM_FILE)


def test_reported_figures_and_caps() -> None:
    cap = make_node("b", "8GiB", kind="cpu")
    big = make_node("c", "1TiB", kind="cpu")
    entries = [ClusterNode("a", "10.0.0.1", 1, None),
               ClusterNode("b", "10.0.0.2", 1, load_node(cap)),
               ClusterNode("c", "10.0.0.3", 1, load_node(big))]
    a, b, c = size_nodes(entries, [Report("MTL0", 300 * GiB, 384 * GiB), CPU_24, CPU_24])
    assert (a.usable_bytes, a.memory_from, a.reported_bytes) == (300 * GiB, "node", 300 * GiB)
    assert a.limit_source == "reported by the node (MTL0, 300.0 GiB free of 384.0 GiB)"
    assert (b.usable_bytes, b.memory_from, b.reported_bytes) == (8 * GiB, "cluster file", 24 * GiB)
    assert b.limit_source == "cluster file (CPU node: all RAM), below the 24.0 GiB the node reports free"
    assert (c.usable_bytes, c.memory_from, c.reported_bytes) == (24 * GiB, "node", 24 * GiB)
    assert c.limit_source == "reported by the node (CPU, 24.0 GiB free of 24.0 GiB), below the 1.00 TiB in the cluster file"
    # a device that reports no free memory: its total
    (z,) = size_nodes(entries[:1], [Report("CPU", 0, 16 * GiB)])
    assert z.usable_bytes == 16 * GiB


def test_nodes_on_one_machine_share_what_it_reports() -> None:
    entries = [ClusterNode("l0", "127.0.0.1", 1, None), ClusterNode("l1", "localhost", 2, None),
               ClusterNode("l2", "127.0.0.1", 3, load_node(make_node("l2", "4GiB", kind="cpu"))),
               ClusterNode("gpu", "127.0.0.1", 4, None)]
    l0, l1, l2, gpu = size_nodes(entries, [CPU_24, CPU_24, CPU_24, Report("CUDA0", 10 * GiB, 12 * GiB)])
    assert l0.usable_bytes == l1.usable_bytes == 8 * GiB   # 24 GiB over the three CPU nodes on loopback
    assert l0.limit_source == "reported by the node (CPU, 24.0 GiB free of 24.0 GiB), shared by the 3 nodes on this machine"
    assert (l2.usable_bytes, l2.reported_bytes) == (4 * GiB, 8 * GiB)
    assert l2.limit_source == ("cluster file (CPU node: all RAM), below the node's 8.0 GiB share of the 24.0 GiB free "
                               "the 3 nodes on this machine report")
    assert gpu.usable_bytes == 10 * GiB   # another device: not shared


def test_a_node_that_does_not_answer() -> None:
    given = load_node(make_node("b", "8GiB", kind="cpu"))
    entries = [ClusterNode("a", "10.0.0.1", 50052, None, start_command="tbrpc node --port 50052"),
               ClusterNode("b", "10.0.0.2", 50052, given)]
    (b,) = size_nodes(entries[1:], [NoAnswer("connection refused")])
    assert (b.usable_bytes, b.memory_from, b.reported_bytes) == (8 * GiB, "cluster file", None)
    assert b.limit_source == "cluster file (CPU node: all RAM); the node did not answer (connection refused)"
    (b,) = size_nodes(entries[1:], [None])   # offline
    assert b.limit_source == "cluster file (CPU node: all RAM)"
    with pytest.raises(ClusterError) as missing:
        size_nodes(entries, [NoAnswer("connection refused"), NoAnswer("timed out")])
    assert str(missing.value) == (
        "node a (10.0.0.1:50052) did not answer (connection refused) and the cluster file gives it no `memory`: "
        "start the node (`tbrpc node --port 50052`), or add `memory = \"...\"` to its "
        "[[node]] table to plan without it")


def test_a_node_that_refuses_the_heads_authentication() -> None:
    """It runs: the way out is its secret, not starting it."""
    given = load_node(make_node("b", "8GiB", kind="cpu"))
    entries = [ClusterNode("a", "10.0.0.1", 50052, None), ClusterNode("b", "10.0.0.2", 50052, given)]
    (b,) = size_nodes(entries[1:], [SecretRefused("authentication failed")])
    assert b.limit_source == ("cluster file (CPU node: all RAM); the node refused this head's authentication "
                              "(authentication failed)")
    with pytest.raises(ClusterError) as missing:
        size_nodes(entries[:1], [SecretRefused("authentication failed")])
    assert str(missing.value) == (
        "node a (10.0.0.1:50052) refused this head's authentication (authentication failed) and the cluster file "
        "gives it no `memory`: plan with the secret the node was started with (--secret-file PATH, the cluster "
        "file's `secret_file` or TBRPC_SECRET_FILE; none for a node started without one), or add "
        "`memory = \"...\"` to its [[node]] table to plan without it")


RING = """
[[node]]
name = "s1"
host = "lan1"
port = 50052
memory = "1GiB"
links = { s4 = "10.0.41.1" }

[[node]]
name = "s2"
host = "lan2"
port = 50052
memory = "1GiB"
links = { s1 = "10.0.12.2", s3 = "10.0.23.2" }

[[node]]
name = "s3"
host = "lan3"
port = 50052
memory = "1GiB"
{s3_links}

[[node]]
name = "s4"
host = "lan4"
port = 50052
memory = "1GiB"
links = {{ s3 = "10.0.34.4" }}
"""


def test_links_say_which_cable_each_pair_uses(tmp_path: Path) -> None:
    from tbrpc.spec import cable_gaps

    path = tmp_path / "ring.toml"
    path.write_text(RING.replace("{s3_links}", 'links = { s2 = "10.0.23.3", s4 = "10.0.34.3" }').replace("{{", "{")
                    .replace("}}", "}"))
    specs = load_specs(path)
    assert dict(specs[1].links) == {"s1": "10.0.12.2", "s3": "10.0.23.2"}
    assert cable_gaps(specs) == []
    path.write_text(RING.replace("{s3_links}", "").replace("{{", "{").replace("}}", "}"))
    # no cable into s3 listed: the layers start there and follow the others (tests/test_cabling.py)
    assert [s.name for s in load_specs(path)] == ["s3", "s4", "s1", "s2"] and cable_gaps(load_specs(path)) == []
    path.write_text(RING.replace("{s3_links}", 'links = { s9 = "10.0.0.9" }').replace("{{", "{").replace("}}", "}"))
    with pytest.raises(ClusterError, match="node s3: links names 's9', which is not another node of the file"):
        load_specs(path)
    path.write_text(RING.replace("{s3_links}", 'links = { s2 = 7 }').replace("{{", "{").replace("}}", "}"))
    with pytest.raises(ClusterError, match='node s3: links must be a table of node name = "address"'):
        load_specs(path)


def test_the_idle_timeout_default_is_the_nodes_own() -> None:
    """`tbrpc node --idle-timeout`'s default (tbrpc/defaults.py) is the figure the node uses for 0,
    TB_IDLE_MS in the C headers: the two cannot drift apart."""
    headers = "".join(p.read_text() for p in (Path(__file__).resolve().parent.parent / "ggml_backend").glob("*.h"))
    m = re.search(r"#define TB_IDLE_MS\s+\((\d+) \* 1000\)", headers)
    assert m, "TB_IDLE_MS is no longer defined as (seconds * 1000) in ggml_backend/*.h"
    assert defaults.IDLE_TIMEOUT_S == int(m.group(1))


def test_bad_values_name_the_file_the_node_and_the_key(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    for line, message in [('port = "x"', "node a: port must be a whole number from 0 to 65535, not 'x'"),
                          ("port = 70000", "node a: port must be a whole number from 0 to 65535, not 70000"),
                          ('port = 1\nthreads = "many"', "node a: threads must be a whole number, not 'many'"),
                          ('port = 1\nkind = "tpu"', "node a: kind must be one of metal, cpu, not 'tpu'")]:
        path.write_text(f'[[node]]\nname = "a"\nhost = "h"\n{line}\n')
        with pytest.raises(ClusterError) as bad:
            load_specs(path)
        assert str(bad.value) == f"{path}: {message}"


def test_endpoints_are_host_colon_port() -> None:
    assert split_endpoint("10.0.0.2:50052") == ("10.0.0.2", 50052)
    assert split_endpoint("[::1]:50052") == ("::1", 50052)
    for bad in ("10.0.0.2", ":50052", "h:port", "h:70000", "h:"):
        with pytest.raises(ValueError, match=f'expected "host:port", got {re.escape(repr(bad))}'):
            split_endpoint(bad)
    with pytest.raises(ClusterError, match='node #2: expected "host:port"'):
        endpoint_specs(["h:1", "nope"])
