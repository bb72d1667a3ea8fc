"""`tbrpc doctor` on a healthy cluster and on broken ones: a node down, a wrong
model file, a protocol version mismatch (a fake node), ssh that fails. The
macOS rows (RDMA, Thunderbolt, wired memory) are checked with recorded facts:
this machine is not a Mac."""

from __future__ import annotations

import re
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import models
import tbrpc
from helpers import ENV, free_port

from tbrpc.doctor import FAIL, OK, WARN, Check, _check_linux, _check_macos, _Node, diagnose, failed, format_checks
from tbrpc.facts import file_fingerprint, linux_facts, macos_facts, model_identity, sampled_ranges
from tbrpc.cluster_file import load_cluster_file, load_specs
from tbrpc.node_memory import ClusterError
from tbrpc.spec import NodeSpec, endpoint_specs
from tbrpc.units import format_size


def write_cluster(path: Path, nodes: list[dict[str, Any]]) -> Path:
    text = ""
    for n in nodes:
        text += "[[node]]\n" + "".join(f"{k} = {v!r}\n" if isinstance(v, str) else f"{k} = {v}\n"
                                       for k, v in n.items()).replace("'", '"')
    path.write_text(text)
    return path


def node_table(name: str, port: int, **extra: Any) -> dict[str, Any]:
    return {"name": name, "host": "127.0.0.1", "port": port, "memory": "1GiB", "kind": "cpu", "start": "manual", **extra}


def by(checks: list[Check], node: str, name: str) -> Check:
    found = [c for c in checks if c.node == node and c.name == name]
    assert found, format_checks(checks)
    return found[0]


def test_healthy_cluster(nodes: Any, tmp_path: Path) -> None:
    model = models.ensure("llama")
    a, b = nodes(2, "--model-dir", str(model.parent))
    cluster = write_cluster(tmp_path / "tbrpc.toml", [node_table("a", a.port, model=str(model)),
                                                      node_table("b", b.port)])
    checks = diagnose(load_specs(cluster), str(model))
    table = format_checks(checks)
    assert not failed(checks), table
    for node in ("a", "b"):
        for name in ("reachable", "handshake", "device", "versions", "model"):
            assert by(checks, node, name).status == OK, table
    assert "same as the head's" in by(checks, "a", "model").detail
    thp_on = linux_facts()["transparent_hugepage"] in ("always", "madvise")
    assert by(checks, "a", "huge pages").status == (OK if thp_on else WARN), table
    assert ("all checks passed" in table) == thp_on, table

    proc = subprocess.run([sys.executable, "-m", "tbrpc.cli", "doctor", "--cluster", str(cluster), "--gguf", str(model)],
                          env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ("all checks passed" in proc.stdout) == thp_on, proc.stdout


def test_cluster_file_without_memory(nodes: Any, tmp_path: Path) -> None:
    """Every node reports its memory at HELLO: doctor needs no `memory` and says what plan and launch will use."""
    from tbrpc import probe

    model = models.ensure("llama")
    a, b = nodes(2)
    tables = [{k: v for k, v in node_table(name, n.port).items() if k != "memory"} for name, n in (("a", a), ("b", b))]
    cluster = write_cluster(tmp_path / "tbrpc.toml", tables)
    assert "memory" not in cluster.read_text()
    checks = diagnose(load_specs(cluster), str(model))
    table = format_checks(checks)
    assert not failed(checks), table
    for name, n in (("a", a), ("b", b)):
        info, _ = probe(n.endpoint)
        device = by(checks, name, "device")
        assert device.status == OK, table
        assert device.detail == (f"{info.node_device} ({info.description}), {format_size(info.mem_free)} free of "
                                 f"{format_size(info.mem_total)}; no `memory` given: plan and launch use what the "
                                 "node reports")
    proc = subprocess.run([sys.executable, "-m", "tbrpc.cli", "doctor", "--cluster", str(cluster), "--gguf", str(model)],
                          env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no `memory` given: plan and launch use what the node reports" in proc.stdout


def test_idle_nodes_have_no_other_client(nodes: Any) -> None:
    """Doctor's own connections are not counted as other clients (its reachability check's included,
    which the node frees a moment after it closes); one that is really there is."""
    a, b, c = nodes(3)
    with socket.create_connection(("127.0.0.1", c.port)) as other:
        time.sleep(0.2)   # accepted: the node has a slot in use for it
        checks = diagnose(endpoint_specs([f"127.0.0.1:{n.port}" for n in (a, b, c)]), launches=[])
    table = format_checks(checks)
    shown = [re.search(r"(\d+) other client\(s\)", ch.detail) for ch in checks if ch.name == "handshake"]
    assert [int(m.group(1)) if m else None for m in shown] == [0, 0, 1], table


def test_node_down_fails_with_a_fix(nodes: Any, tmp_path: Path) -> None:
    (a,) = nodes(1)
    closed = free_port()
    cluster = write_cluster(tmp_path / "c.toml", [node_table("up", a.port), node_table("down", closed)])
    proc = subprocess.run([sys.executable, "-m", "tbrpc.cli", "doctor", "--cluster", str(cluster)],
                          env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout
    checks = diagnose(load_specs(cluster))
    down = by(checks, "down", "reachable")
    assert down.status == FAIL and f"127.0.0.1:{closed}" in down.detail
    assert f"tbrpc node --host 127.0.0.1 --port {closed}" in down.fix
    assert by(checks, "up", "handshake").status == OK
    assert "fix: start it on 127.0.0.1" in proc.stdout


def test_one_node_at_two_addresses_fails(nodes: Any, tmp_path: Path) -> None:
    """Two entries whose addresses differ (127.0.0.1, 127.0.0.2) but reach one node process listening on
    every address: the second fails, naming the first; a second node of the same name passes."""
    (a,) = nodes(1, "--host", "0.0.0.0", "--insecure", "--name", "same")
    (other,) = nodes(1, "--name", "same")
    cluster = write_cluster(tmp_path / "c.toml", [node_table("a", a.port), node_table("b", a.port, host="127.0.0.2"),
                                                 node_table("c", other.port)])
    checks = diagnose(load_specs(cluster))
    row = by(checks, "b", "distinct")
    assert row.status == FAIL, format_checks(checks)
    assert row.detail == f"127.0.0.2:{a.port} is the node process of a (127.0.0.1:{a.port}), reached at another address"
    assert row.fix == "list each node once: remove b or a"
    assert not [c for c in checks if c.name == "distinct" and c.node != "b"], format_checks(checks)
    # planning with what the nodes report would count its memory twice
    with pytest.raises(ClusterError) as refused:
        load_cluster_file(cluster, ask=True)
    assert str(refused.value) == (f"nodes a (127.0.0.1:{a.port}) and b (127.0.0.2:{a.port}) are one node process "
                                  "reached at two addresses (it answers both with the same node id): list each node once")


def test_wrong_and_missing_model_file(nodes: Any, tmp_path: Path) -> None:
    head_model = models.ensure("llama")
    impostor = tmp_path / "node-b" / head_model.name     # same name, other bytes
    impostor.parent.mkdir()
    shutil.copy(models.ensure("deepseek2"), impostor)
    a, b = nodes(2)
    cluster = write_cluster(tmp_path / "c.toml", [
        node_table("a", a.port, model=str(tmp_path / "nowhere.gguf")),
        node_table("b", b.port, model=str(impostor)),
    ])
    checks = diagnose(load_specs(cluster), str(head_model))
    missing, wrong = by(checks, "a", "model"), by(checks, "b", "model")
    assert missing.status == FAIL and "missing" in missing.detail and "copy the model" in missing.fix
    assert wrong.status == FAIL and "differs from the head's copy" in wrong.detail and "rsync" in wrong.fix
    assert failed(checks)

    renamed = tmp_path / "node-c" / "other-name.gguf"      # the right bytes under another name
    renamed.parent.mkdir()
    shutil.copy(head_model, renamed)
    cluster = write_cluster(tmp_path / "c2.toml", [node_table("c", a.port, model=str(renamed)),
                                                   node_table("d", b.port)])   # d: no `model`, head's path checked
    checks = diagnose(load_specs(cluster), str(tmp_path / "elsewhere" / head_model.name))
    assert by(checks, "c", "model").status == WARN   # the head's file is missing: nothing to compare with
    checks = diagnose(load_specs(cluster), str(head_model))
    named = by(checks, "c", "model")
    assert named.status == FAIL and "file names" in named.detail and "name the node's copy" in named.fix
    assert by(checks, "d", "model").status == OK


def test_model_identity_covers_every_shard(tmp_path: Path) -> None:
    parts = [tmp_path / f"m-0000{i}-of-00002.gguf" for i in (1, 2)]
    for i, p in enumerate(parts):
        p.write_bytes(bytes([i]) * (3 << 20))
    ident = model_identity(parts[0])
    assert ident["exists"] and len(ident["files"]) == 2 and ident["size"] == 6 << 20
    before = ident["fingerprint"]
    with open(parts[1], "r+b") as f:      # a change in the head of the second shard (the header)
        f.seek(10)
        f.write(b"\xff")
    assert model_identity(parts[0])["fingerprint"] != before
    assert file_fingerprint(parts[0]) == file_fingerprint(parts[0])
    parts[1].unlink()
    partial = model_identity(parts[0])
    assert partial["missing"] == [str(parts[1])] and partial["fingerprint"] is None
    assert partial["files"][0]["size"] == 3 << 20 and partial["files"][1] == {"name": parts[1].name, "missing": True}


def test_doctor_and_nodes_agree_on_same_file(tmp_path: Path) -> None:
    """Doctor's fingerprint (Python, blake2b) and a node's (C, FNV) sample the
    same bytes: a change is seen by both or by neither."""
    from tbrpc.native import load

    ffi, lib = load()

    def node_fingerprint(path: Path) -> bytes:
        out, err = ffi.new("struct tb_file_identity *"), ffi.new("char[256]")
        assert lib.tbrpc_file_identity(str(path).encode(), out, err, 256) == 0, ffi.string(err)
        return bytes(out.fingerprint)

    size = (5 << 20) + 12345
    original = bytes(range(256)) * (size // 256) + bytes(size % 256)
    path = tmp_path / "m.gguf"
    ranges = sampled_ranges(size)
    assert len(ranges) == 16 and ranges[0] == (0, 1 << 20) and ranges[-1] == (size - (1 << 20), 1 << 20)
    edges = {o for start, length in ranges for o in (start - 1, start, start + length - 1, start + length)}
    seen = {o: any(start <= o < start + length for start, length in ranges) for o in edges if 0 <= o < size}
    assert sum(seen.values()) >= 20 and sum(not v for v in seen.values()) >= 20   # both kinds are tried
    path.write_bytes(original)
    doctor_before, node_before = file_fingerprint(path), node_fingerprint(path)
    for offset, expected in seen.items():
        changed = bytearray(original)
        changed[offset] ^= 0xFF
        path.write_bytes(changed)
        by_doctor, by_node = file_fingerprint(path) != doctor_before, node_fingerprint(path) != node_before
        assert (by_doctor, by_node) == (expected, expected), offset


def test_a_running_node_without_model_dir_is_named_with_the_command_that_fixes_it(nodes: Any, tmp_path: Path) -> None:
    """A node started by hand without --model-dir receives every weight over the network, whatever copy of
    the model its machine holds: doctor said "model ok, same as the head's" and nothing else. Now its
    handshake's answer makes a row: FAIL for a node whose `model` the file names, WARN for one that only
    has the head's path, each with the `tbrpc node` command that gives it the model's directory."""
    model = models.ensure("llama")
    (bare,) = nodes(1)
    (served,) = nodes(1, "--model-dir", str(model.parent))
    cluster = write_cluster(tmp_path / "c.toml", [node_table("a", bare.port, model=str(model)),
                                                  node_table("c", served.port, model=str(model))])
    checks = diagnose(load_specs(cluster), str(model), launches=[])
    row = by(checks, "a", "model dir")
    assert (row.status, row.detail) == (FAIL, f"{bare.endpoint}: the running node was started without --model-dir: it "
                                        f"cannot read {model.name} from its own disk, so launch sends it its weights "
                                        "over the network")
    assert row.fix == (f"restart it with the model's directory: `tbrpc node --host 127.0.0.1 --port {bare.port} "
                       f"--name a --model-dir {model.parent}`")
    assert not [c for c in checks if c.node == "c" and c.name == "model dir"], format_checks(checks)
    assert by(checks, "a", "model").status == OK   # the machine holds the file: the node does not read it
    assert failed(checks)
    listed = diagnose(endpoint_specs([bare.endpoint]), str(model), launches=[])   # no `model`: the head's path
    assert by(listed, bare.endpoint, "model dir").status == WARN and not failed(listed), format_checks(listed)


def test_a_node_with_only_its_shards(nodes: Any, tmp_path: Path) -> None:
    """A split set: a node holding some shards is a warning (the rest streams), a different shard fails."""
    head_dir, node_dir = tmp_path / "head", tmp_path / "node"
    head_dir.mkdir(), node_dir.mkdir()
    names = [f"m-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    for i, name in enumerate(names):
        (head_dir / name).write_bytes(bytes([i + 1]) * (1 << 20))
    shutil.copy(head_dir / names[1], node_dir / names[1])
    (a,) = nodes(1)
    cluster = write_cluster(tmp_path / "c.toml", [node_table("a", a.port, model=str(node_dir / names[0]))])
    row = by(diagnose(load_specs(cluster), str(head_dir / names[0])), "a", "model")
    assert row.status == WARN and "1 of 3 file(s)" in row.detail and "tbrpc plan" in row.fix
    (node_dir / names[2]).write_bytes(b"\0" * (1 << 20))
    row = by(diagnose(load_specs(cluster), str(head_dir / names[0])), "a", "model")
    assert row.status == FAIL and names[2] in row.detail


@pytest.fixture
def fake_node() -> Iterator[int]:
    """A socket server that answers HELLO like a node speaking tbrpc protocol 99."""
    from tbrpc.native import load

    ffi, lib = load()
    hello = ffi.new("struct tb_hello *")
    lib.tb_abi_fill(ffi.addressof(hello.abi))
    hello.abi.proto_version = 99
    hello.alignment = 32
    hello.mem_total = hello.mem_free = 1 << 30
    hello.node_name = b"from-the-future"
    body = struct.pack("<iI", 0, 0) + bytes(ffi.buffer(hello))
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.1)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(10)
            with conn:
                header = conn.recv(24, socket.MSG_WAITALL)
                if len(header) < 24:
                    continue
                magic, cmd, flags, ident, length = struct.unpack("<IHHQQ", header)
                conn.recv(length, socket.MSG_WAITALL)
                conn.sendall(struct.pack("<IHHQQ", magic, cmd, 1, ident, len(body)) + body)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    server.close()
    thread.join(timeout=5)


def test_version_mismatch(fake_node: int, tmp_path: Path) -> None:
    cluster = write_cluster(tmp_path / "c.toml", [node_table("future", fake_node)])
    checks = diagnose(load_specs(cluster))
    hs = by(checks, "future", "handshake")
    assert hs.status == FAIL and "protocol version mismatch" in hs.detail and "99" in hs.detail
    assert "same tbrpc and llama-cpp-python" in hs.fix


def test_a_port_that_answers_but_not_as_a_node_says_how_to_find_what_holds_it(tmp_path: Path) -> None:
    """An HTTP server on the node's port: the handshake row says what answered, and the fix says how
    to see what holds the port; "restart it" (the old fix) fails there, the port being taken."""
    import http.server

    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = server.server_address[1]
        checks = diagnose(load_specs(write_cluster(tmp_path / "c.toml", [node_table("web", port)])))
    finally:
        server.shutdown()
        server.server_close()
    hs = by(checks, "web", "handshake")
    assert hs.status == FAIL and "not a tbrpc message" in hs.detail
    assert f"ss -ltnp 'sport = :{port}'" in hs.fix and f"lsof -nP -iTCP:{port} -sTCP:LISTEN" in hs.fix
    assert f"--port {port}" in hs.fix and "restart it" not in hs.fix


def test_ssh_that_fails_says_how_to_fix(tmp_path: Path) -> None:
    port = free_port()   # nothing listens: ssh fails at once
    spec_file = write_cluster(tmp_path / "c.toml", [{
        "name": "remote", "host": "127.0.0.1", "port": free_port(), "memory": "1GiB", "kind": "cpu",
    }])
    spec_file.write_text(spec_file.read_text() + f'ssh = {{ host = "127.0.0.1", port = {port} }}\n')
    (spec,) = load_specs(spec_file)
    assert spec.start == "ssh"
    if shutil.which("ssh") is None:
        pytest.skip("no ssh client")
    checks = diagnose([spec])
    ssh = by(checks, "remote", "ssh")
    assert ssh.status == FAIL and "ssh 127.0.0.1 failed" in ssh.detail
    assert "must work without a password" in ssh.fix
    assert by(checks, "remote", "reachable").status == WARN   # not running: launch would start it


MAC_FACTS: dict[str, Any] = {
    "rdma_ctl": {"rc": 0, "output": "disabled"},
    "ibv_devices": {"rc": 0, "output": ""},
    "wired_limit_mb": 0,
    "memsize": 512 << 30,
    "thunderbolt_ports": ["en2", "en3"],
    "link": {"address": "10.0.12.2", "interface": "en2", "ports": ["Thunderbolt 1"], "thunderbolt": True,
             "active": True},
}


def test_macos_rows_from_recorded_facts(tmp_path: Path) -> None:
    cluster = write_cluster(tmp_path / "c.toml", [{"name": "mac2", "host": "10.0.12.2", "port": 50052,
                                                   "memory": "512GiB", "usable_memory": "480GiB"}])
    (spec,) = load_specs(cluster)
    n = _Node(spec)
    _check_macos(n, MAC_FACTS)
    rows = {c.name: c for c in n.checks}
    assert rows["rdma"].status == WARN and "rdma_ctl enable" in rows["rdma"].fix
    assert rows["thunderbolt"].status == OK and "en2 (Thunderbolt 1), active" in rows["thunderbolt"].detail
    wired = rows["wired memory"]
    assert wired.status == FAIL and "sudo sysctl iogpu.wired_limit_mb=" in wired.fix   # default 75% < 480 GiB

    n = _Node(spec)
    _check_macos(n, {**MAC_FACTS, "rdma_ctl": {"rc": 0, "output": "RDMA is enabled"}, "wired_limit_mb": 500 * 1024,
                     "link": {**MAC_FACTS["link"], "interface": "en0", "ports": ["Wi-Fi"], "thunderbolt": False}})
    rows = {c.name: c for c in n.checks}
    assert rows["rdma"].status == WARN and "Thunderbolt 5" in rows["rdma"].fix   # enabled, but no device
    assert rows["wired memory"].status == OK
    assert rows["thunderbolt"].status == WARN and "`links`" in rows["thunderbolt"].fix

    n = _Node(spec)
    _check_macos(n, {**MAC_FACTS, "rdma_ctl": {"rc": 0, "output": "RDMA is enabled"},
                     "ibv_devices": {"rc": 0, "output": "    device          node GUID\n    ------\n    rdma_en2   0000"},
                     "link": {**MAC_FACTS["link"], "interface": "bridge0"}})
    rows = {c.name: c for c in n.checks}
    assert rows["rdma"].status == OK and "rdma_en2" in rows["rdma"].detail
    assert rows["thunderbolt"].status == WARN and "'Thunderbolt Bridge' off" in rows["thunderbolt"].fix

    # a node the head reaches over the LAN, whose activations come over its cables: fine
    ring = write_cluster(tmp_path / "ring.toml", [
        {"name": "mac2", "host": "10.0.12.2", "port": 50052, "memory": "512GiB"},
        {"name": "mac3", "host": "192.168.1.3", "port": 50052, "memory": "512GiB", "links": '{ mac2 = "10.0.23.3" }'}])
    text = ring.read_text().replace("links = \"{ mac2 = \"10.0.23.3\" }\"", 'links = { mac2 = "10.0.23.3" }')
    ring.write_text(text)
    n = _Node(load_specs(ring)[1])
    _check_macos(n, {**MAC_FACTS, "link": {**MAC_FACTS["link"], "interface": "en0", "ports": ["Ethernet"],
                                           "thunderbolt": False}})
    rows = {c.name: c for c in n.checks}
    assert rows["thunderbolt"].status == OK and "cables in `links`" in rows["thunderbolt"].detail


def test_macos_too_old_row_from_recorded_facts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Mac before 26.2 has no rdma_ctl: the facts record rc 127 (tbrpc/facts.py), and doctor says to
    update macOS, not to enable RDMA. Recorded here with PATH holding only a stand-in for the tools
    a Mac has; the same facts with an rdma_ctl that says "disabled" give the other row."""
    tools = tmp_path / "bin"
    tools.mkdir()
    monkeypatch.setenv("PATH", str(tools))
    (spec,) = load_specs(write_cluster(tmp_path / "c.toml", [{"name": "mac2", "host": "10.0.12.2", "port": 50052,
                                                              "memory": "512GiB"}]))
    rows = {}
    for rdma_ctl in (None, "#!/bin/sh\necho 'RDMA is disabled'\n"):
        if rdma_ctl:
            (tools / "rdma_ctl").write_text(rdma_ctl)
            (tools / "rdma_ctl").chmod(0o755)
        facts = macos_facts(None)
        n = _Node(spec)
        _check_macos(n, facts)
        rows[rdma_ctl is None] = (facts["rdma_ctl"], {c.name: c for c in n.checks}["rdma"])
    recorded, row = rows[True]
    assert recorded == {"rc": 127, "output": "rdma_ctl: not found"}
    assert row.status == WARN and "needs macOS 26.2 or later" in row.detail and row.fix.startswith("update macOS")
    assert "rdma_ctl enable" not in row.fix
    recorded, row = rows[False]
    assert recorded == {"rc": 0, "output": "RDMA is disabled"}
    assert row.status == WARN and "rdma_ctl enable" in row.fix and "macOS 26.2" not in row.detail


def test_probe_and_doctor_connections_are_never_upgraded(nodes: Any, tmp_path: Path) -> None:
    """A probe asks one question: no shared-memory segment, no RDMA queue pair (a Mac has ten) for it.
    The node logs every switch of a connection; a probe and a doctor run leave none, while a head's
    connection to the same node, which offers shared memory, does switch."""
    (a,) = nodes(1)
    info, _ = tbrpc.probe(a.endpoint, timeout=5)
    assert info.transport == "tcp: a probe connection"
    checks = diagnose(load_specs(write_cluster(tmp_path / "c.toml", [node_table("a", a.port)])))
    assert by(checks, "a", "handshake").status == OK, format_checks(checks)

    def log_when(pattern: str, count: int) -> str:
        deadline = time.monotonic() + 20
        while len(re.findall(pattern, a.log_text())) < count and time.monotonic() < deadline:
            time.sleep(0.1)
        return a.log_text()

    log = log_when(r"client \S+ disconnected", 2)   # the probe's and doctor's, at least
    assert len(re.findall(r"client \S+ disconnected", log)) >= 2, log[-3000:]
    assert ": transport " not in log and "stays on tcp" not in log, log[-3000:]
    head = subprocess.run([sys.executable, "-c", f"import tbrpc; tbrpc.connect([{a.endpoint!r}]); "
                           "print(tbrpc.cluster().nodes()[0].transport)"],
                          env={k: v for k, v in ENV.items() if k != "TBRPC_TRANSPORT"}, capture_output=True, text=True,
                          timeout=60)
    assert head.returncode == 0 and head.stdout.startswith("shm "), head.stdout + head.stderr
    log = log_when(r"client \S+: transport shm ", 1)
    assert re.search(r"client \S+: transport shm ", log), log[-3000:]


def test_huge_pages_row(tmp_path: Path) -> None:
    """Nodes ask for transparent huge pages; a Linux node where THP is off decodes slower, and doctor says how to fix it."""
    (spec,) = load_specs(write_cluster(tmp_path / "c.toml", [node_table("l", 50052)]))
    rows = {}
    for mode in ("always", "madvise", "never", None):
        n = _Node(spec)
        _check_linux(n, {"transparent_hugepage": mode})
        rows[mode] = n.checks[0]
    assert rows["always"].status == OK and rows["madvise"].status == OK and "madvise" in rows["madvise"].detail
    assert rows["never"].status == WARN and "echo madvise | sudo tee /sys/kernel/mm/transparent_hugepage/enabled" in rows["never"].fix
    assert rows[None].status == WARN and "CONFIG_TRANSPARENT_HUGEPAGE" in rows[None].fix


def test_table_format() -> None:
    checks = [Check("a", "reachable", OK, "fine"), Check("bb", "model", FAIL, "differs", "copy it")]
    table = format_checks(checks)
    assert "fix: copy it" in table and "1 failed check(s)" in table
    assert isinstance(NodeSpec("x", "h", 1), NodeSpec)


def test_secret_checked_per_node(nodes: Any, tmp_path: Path) -> None:
    """A cluster file's secret_file is the head's; doctor says which node proves it and which does not."""
    from tbrpc import secret

    key = secret.new(tmp_path / "secret")
    other = secret.new(tmp_path / "other")
    (good,) = nodes(1, "--secret-file", str(key))
    (wrong,) = nodes(1, "--secret-file", str(other))
    (open_node,) = nodes(1)
    cluster = write_cluster(tmp_path / "c.toml", [node_table("good", good.port), node_table("wrong", wrong.port),
                                                   node_table("open", open_node.port)])
    cluster.write_text(f'secret_file = "{key}"\n' + cluster.read_text())
    proc = subprocess.run([sys.executable, "-m", "tbrpc.cli", "doctor", "--cluster", str(cluster)],
                          env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout
    try:
        secret.use(key)
        checks = diagnose(load_specs(cluster))
    finally:
        secret.use(None)
    assert by(checks, "good", "secret").status == OK
    for name, words in (("wrong", "authentication failed"), ("open", "asks for none")):
        check = by(checks, name, "secret")
        assert check.status == FAIL and words in check.detail and "--secret-file" in check.fix, check
    assert "secret" in proc.stdout
