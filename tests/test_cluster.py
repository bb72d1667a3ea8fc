"""Node capacity: cluster files, --node/--nodes flags, Metal's wired-memory limit."""

from __future__ import annotations

from pathlib import Path

import pytest

from tbrpc.cluster import ClusterError, load_cluster_file, make_node, nodes_from_flags
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


def test_cluster_file_ignores_keys_for_other_tools(tmp_path: Path) -> None:
    path = tmp_path / "cluster.toml"
    path.write_text(
        """
        ssh_user = "ops"   # launcher settings live in the same file

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
    assert (second.name, second.usable_bytes, second.limit_source) == ("mac2", 180 * GiB, "usable_memory set explicitly")


def test_cluster_file_errors_name_the_problem(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('[[node]]\nname = "a"\nhost = "h"\nport = 1\n')
    with pytest.raises(ClusterError, match="missing required key 'memory'"):
        load_cluster_file(path)
    path.write_text('[[node]]\nname = "a"\nhost = "h"\nport = 1\nmemory = "1GiB"\n[[node]]\nname = "a"\nhost = "h"\nport = 2\nmemory = "1GiB"\n')
    with pytest.raises(ClusterError, match="used twice"):
        load_cluster_file(path)
    path.write_text("nothing = 1\n")
    with pytest.raises(ClusterError, match="no \\[\\[node\\]\\]"):
        load_cluster_file(path)


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
