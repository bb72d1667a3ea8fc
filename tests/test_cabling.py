"""The order the layers go: along the cables a cluster file lists (`links`,
tbrpc.spec.cable_order), as the planner, `tbrpc plan` and `tbrpc launch` use it.

The ring is docs/cluster.md's Four Macs: the head runs on s1, the layers go
s1 -> s2 -> s3 -> s4, and the logits come home over the s4-s1 cable (s4's
`host`); s1 lists no cable in, the head's own node being first.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

import models
from helpers import PROMPT, assert_gone, baseline, start_launch

from tbrpc.cli import main as cli_main
from tbrpc.cluster_file import load_specs, read_cluster_file
from tbrpc.spec import NodeSpec, cable_gaps, cable_order, cable_order_note

CABLES_IN = {   # each node's links: the node before it on a cable, and its own address on that cable
    "s1": "",
    "s2": 'links = { s1 = "10.0.12.2" }',
    "s3": 'links = { s2 = "10.0.23.3" }',
    "s4": 'links = { s3 = "10.0.34.4" }',
}


def ring_file(path: Path, order: list[str], cables: dict[str, str] = CABLES_IN) -> Path:
    path.write_text("".join(f'[[node]]\nname = "{n}"\nhost = "lan{n[1:]}"\nport = 50052\nmemory = "1GiB"\n'
                            f'kind = "cpu"\n{cables[n]}\n\n' for n in order))
    return path


def names(specs: list[NodeSpec]) -> list[str]:
    return [s.name for s in specs]


def test_a_shuffled_ring_is_put_in_cable_order(tmp_path: Path) -> None:
    specs = load_specs(ring_file(tmp_path / "ring.toml", ["s3", "s1", "s4", "s2"]))
    assert names(specs) == ["s1", "s2", "s3", "s4"]
    assert [s.file_position for s in specs] == [1, 3, 0, 2]
    assert cable_order_note(specs) == "ordered along the cables: s1, s2, s3, s4 (the cluster file lists s3, s1, s4, s2)"
    assert cable_gaps(specs) == []
    # the planner's view of the same file, in the same order, each with its own figure
    assert [n.name for n in read_cluster_file(tmp_path / "ring.toml")] == ["s1", "s2", "s3", "s4"]


def test_an_ordered_file_keeps_its_order(tmp_path: Path) -> None:
    specs = load_specs(ring_file(tmp_path / "ring.toml", ["s1", "s2", "s3", "s4"]))
    assert names(specs) == ["s1", "s2", "s3", "s4"] and cable_order_note(specs) is None
    # a full ring (s1 lists the s4-s1 cable too) allows any rotation: the file's stays
    full = {**CABLES_IN, "s1": 'links = { s4 = "10.0.41.1" }'}
    specs = load_specs(ring_file(tmp_path / "full.toml", ["s3", "s4", "s1", "s2"], full))
    assert names(specs) == ["s3", "s4", "s1", "s2"] and cable_order_note(specs) is None
    # no cables listed: the file's order, whatever it is
    assert names(load_specs(ring_file(tmp_path / "none.toml", ["s3", "s1"], dict.fromkeys(CABLES_IN, "")))) == ["s3", "s1"]


def test_of_the_orders_along_the_cables_the_closest_to_the_file(tmp_path: Path) -> None:
    """A full ring shuffled: four rotations follow the cables; s3 s4 s1 s2 swaps one pair of
    the file's s3 s1 s4 s2 (s4 before s1), s1 s2 s3 s4 three, the other two four."""
    full = {**CABLES_IN, "s1": 'links = { s4 = "10.0.41.1" }'}
    specs = load_specs(ring_file(tmp_path / "full.toml", ["s3", "s1", "s4", "s2"], full))
    assert names(specs) == ["s3", "s4", "s1", "s2"]
    # a tie: cables b -> a, a -> c, c -> b; b a c and a c b each swap one pair of a b c (which
    # has no a -> b cable), and a c b's first node comes first in the file
    tie = [NodeSpec(name="a", host="h", port=1, links=(("b", "x"),), file_position=0),
           NodeSpec(name="b", host="h", port=1, links=(("c", "x"),), file_position=1),
           NodeSpec(name="c", host="h", port=1, links=(("a", "x"),), file_position=2)]
    assert names(cable_order(tie)) == ["a", "c", "b"]
    assert names(cable_order([tie[1], tie[0], tie[2]])) == ["b", "a", "c"]   # the file b a c follows them already


def test_no_order_along_the_cables_keeps_the_file_and_warns(tmp_path: Path) -> None:
    cut = {**CABLES_IN, "s3": ""}   # the s2-s3 cable is not listed: s1 and s3 both have none in
    specs = load_specs(ring_file(tmp_path / "cut.toml", ["s3", "s1", "s4", "s2"], cut))
    assert names(specs) == ["s3", "s1", "s4", "s2"] and cable_order_note(specs) is None
    assert cable_gaps(specs) == [
        "no cable listed from s3 to s1 (links in s1's table): activations for s1 go to its host lan1",
        "no cable listed from s1 to s4 (links in s4's table): activations for s4 go to its host lan4",
        "no cable listed from s4 to s2 (links in s2's table): activations for s2 go to its host lan2",
    ]


def test_plan_assigns_layers_along_the_cables(tmp_path: Path) -> None:
    """`tbrpc plan --cluster` (offline, the file's memory): the first layers on s1, the
    last on s4, whatever the file's order, and the plan says it reordered."""
    path = ring_file(tmp_path / "ring.toml", ["s3", "s1", "s4", "s2"])
    gguf = str(models.ensure("llama"))
    result = CliRunner().invoke(cli_main, ["plan", "--gguf", gguf, "--cluster", str(path), "--offline", "--ctx", "256",
                                           "--margin", "0", "--head-device", "none", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert [n["name"] for n in out["nodes"]] == ["s1", "s2", "s3", "s4"]
    layers = [n["layers"] for n in out["nodes"]]
    assert layers[0][0] == 0 and all(a[1] + 1 == b[0] for a, b in zip(layers, layers[1:])), layers
    assert out["notes"][0] == "ordered along the cables: s1, s2, s3, s4 (the cluster file lists s3, s1, s4, s2)"
    table = CliRunner().invoke(cli_main, ["plan", "--gguf", gguf, "--cluster", str(path), "--offline", "--ctx", "256",
                                          "--margin", "0", "--head-device", "none"])
    rows = [line.split()[:2] for line in table.output.splitlines() if re.match(r"s\d ", line)]
    assert rows == [[n["name"], f"{n['layers'][0]}-{n['layers'][1]}"] for n in out["nodes"]], table.output
    assert "note: ordered along the cables: s1, s2, s3, s4" in table.output


def test_launch_loads_the_layers_along_the_cables(tmp_path: Path) -> None:
    """Three nodes on this machine, the file listing them a, c, b and its cables a -> b -> c:
    launch plans, connects and loads them as a, b, c, says so, and answers as one process."""
    llama = models.ensure("llama")
    want = baseline(llama, PROMPT, 8)
    cluster = tmp_path / "cables.toml"
    cluster.write_text('[[node]]\nname = "a"\nhost = "127.0.0.1"\nport = 0\nthreads = 1\n\n'
                       '[[node]]\nname = "c"\nhost = "127.0.0.1"\nport = 0\nthreads = 1\nlinks = { b = "127.0.0.1" }\n\n'
                       '[[node]]\nname = "b"\nhost = "127.0.0.1"\nport = 0\nthreads = 1\nlinks = { a = "127.0.0.1" }\n')
    with start_launch(tmp_path, "--gguf", str(llama), "--cluster", str(cluster), "--ctx", "256",
                      "--prompt", PROMPT, "--max-tokens", "8") as launch:
        assert launch.finish(timeout=180) == 0, launch.stderr
    assert "tbrpc: ordered along the cables: a, b, c (the cluster file lists a, c, b)" in launch.stderr, launch.stderr
    assert "warning: no cable" not in launch.stderr, launch.stderr
    plan = re.search(r"^tbrpc: plan: a layers 0-(\d+), b layers (\d+)-(\d+), c layers (\d+)-5 ", launch.stderr, re.M)
    assert plan and int(plan[1]) + 1 == int(plan[2]) and int(plan[3]) + 1 == int(plan[4]), launch.stderr
    assert re.search(r"connected: TBRPC\d+=a \(.*\), TBRPC\d+=b \(.*\), TBRPC\d+=c \(", launch.stderr), launch.stderr
    assert launch.stdout == want["text"] + "\n"
    assert_gone(launch.node_pids())


@pytest.mark.parametrize("n", [6, 12])
def test_the_search_backtracks_and_gives_up(n: int) -> None:
    """Cables every way within two halves of the nodes and one from the second half into the
    first: the only orders go through the second half, end at its cabled node, then the first
    half; the file lists the first half first. Then two nodes without a cable in: no order."""
    first, second = [f"n{i}" for i in range(n // 2)], [f"m{i}" for i in range(n // 2)]

    def clique(group: list[str], x: str, extra: tuple[tuple[str, str], ...] = ()) -> tuple[tuple[str, str], ...]:
        return tuple((y, "x") for y in group if y != x) + extra

    specs = [NodeSpec(name=x, host="h", port=1, links=clique(first, x, (("m0", "x"),) * (x == "n0")))
             for x in first] + [NodeSpec(name=x, host="h", port=1, links=clique(second, x)) for x in second]
    specs = [replace(s, file_position=i) for i, s in enumerate(specs)]
    ordered = names(cable_order(specs))
    # the closest: the second half in file order up to m0 last (m1.. then m0), then n0, n1, ...
    assert ordered == second[1:] + ["m0"] + first, ordered
    assert cable_gaps(cable_order(specs)) == []
    sources = [replace(s, links=()) if s.name in ("n1", "m1") else s for s in specs]
    assert names(cable_order(sources)) == names(sources)   # no order: the file's
