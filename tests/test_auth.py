"""The cluster secret: heads and nodes prove it to each other (AUTH after HELLO),
peer links prove it too, and nothing is served to anyone who has not.

Real node processes on loopback; raw-wire cases speak the protocol with the
C headers' structs (tests/wire.py's Wire) and compute MACs with the
node's own tb_auth_mac.
"""

from __future__ import annotations

import os
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import models
import tbrpc
from helpers import ENV, ROOT, run_head, start_node, stop_nodes
from tbrpc import secret
from tbrpc.native import load
from wire import Wire, pack

ffi, lib = load()
PROMPT = "Once upon a time"


@pytest.fixture
def key(tmp_path: Path) -> Path:
    return secret.new(tmp_path / "secret")


def other_key(tmp_path: Path) -> Path:
    return secret.new(tmp_path / "other-secret")


def mac(secret_bytes: bytes, role: bytes, nonce_a: bytes, nonce_b: bytes) -> bytes:
    out = ffi.new("uint8_t[32]")
    lib.tb_auth_mac(secret_bytes, len(secret_bytes), role, nonce_a, nonce_b, ffi.NULL, 0, out)
    return bytes(out)


class AuthWire(Wire):
    """A raw client that can do the AUTH step by hand."""

    def hello_nonce(self, nonce: bytes = b"\x01" * 32) -> tuple[int, Any]:
        hello = ffi.new("struct tb_hello *")
        lib.tb_abi_fill(ffi.addressof(hello.abi))
        hello.keepalive_ms = 1000
        hello.nonce = nonce
        self.send(lib.TB_CMD_HELLO, bytes(ffi.buffer(hello)))
        status, body = self.reply()
        rep = ffi.new("struct tb_hello *")
        if status == 0:
            ffi.memmove(rep, body, ffi.sizeof(rep[0]))
        return status, rep

    def authenticate(self, secret_bytes: bytes) -> tuple[int, bytes, bytes]:
        """HELLO + AUTH; (status, body, the AUTH message as sent)."""
        head_nonce = os.urandom(32)
        status, rep = self.hello_nonce(head_nonce)
        assert status == 0
        auth = mac(secret_bytes, b"tbrpc 4 head", head_nonce, bytes(rep.nonce))
        self.send(lib.TB_CMD_AUTH, auth)
        status, body = self.reply()
        return status, body, auth


# ---- heads and nodes ---------------------------------------------------------------

def test_right_secret_generates_the_same_tokens(nodes: Any, key: Path, tmp_path: Path) -> None:
    model = str(models.ensure("llama"))
    open_a, open_b = nodes(2)
    plain, _ = run_head(tmp_path, model=model, prompt=PROMPT, n_predict=8, nodes=[open_a.endpoint, open_b.endpoint])
    a, b = nodes(2, "--secret-file", str(key))
    secured, _ = run_head(tmp_path, model=model, prompt=PROMPT, n_predict=8,
                          nodes=[a.endpoint, b.endpoint], secret_file=str(key))
    assert plain["error"] is None and secured["error"] is None, secured["error"]
    assert secured["tokens"] == plain["tokens"]
    # activations went node to node over an authenticated link, not through the head
    assert sum(n["peer_copies"] for n in secured["nodes"]) > 0
    assert "authenticated" in a.log_text()


def test_wrong_secret_is_refused_naming_the_node(nodes: Any, key: Path, tmp_path: Path) -> None:
    node = nodes(1, "--secret-file", str(key))[0]
    with pytest.raises(tbrpc.AuthenticationError, match=f"{node.endpoint}.*authentication failed"):
        tbrpc.probe(node.endpoint, timeout=5, secret_file=other_key(tmp_path))
    time.sleep(0.3)
    log = node.log_text()
    assert "authentication failed" in log and "client 127.0.0.1:" in log   # who tried


def test_the_drop_in_raises_what_connect_raises(nodes: Any, key: Path, tmp_path: Path) -> None:
    """tbrpc.Llama(cluster=["host:port"]) fails a handshake with connect()'s class for the same cause
    (users catch tbrpc.NodeError and its subclasses), its message naming the node and step."""
    node = nodes(1, "--secret-file", str(key))[0]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        nobody = f"127.0.0.1:{s.getsockname()[1]}"
    script = (
        "import sys, tbrpc, models\n"
        "m = str(models.ensure('llama'))\n"
        "for endpoint, extra in [(sys.argv[1], {}), (sys.argv[2], {'secret_file': sys.argv[3]})]:\n"
        "    try:\n"
        "        tbrpc.Llama(m, cluster=[endpoint], n_ctx=256, verbose=False, start_timeout=2, **extra)\n"
        "    except tbrpc.NodeError as e:\n"
        "        print(type(e).__name__, e.endpoint, str(e).replace(chr(10), ' '))\n")
    proc = subprocess.run([sys.executable, "-c", script, nobody, node.endpoint, str(other_key(tmp_path))], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    lines = proc.stdout.splitlines()
    assert len(lines) == 2, proc.stdout + proc.stderr[-3000:]
    assert lines[0].startswith(f"NodeUnreachable {nobody} node 127.0.0.1:"), lines[0]
    assert "step handshake" in lines[0] and "try: is the node running" in lines[0], lines[0]
    assert lines[1].startswith(f"AuthenticationError {node.endpoint} node 127.0.0.1:"), lines[1]
    assert "step handshake" in lines[1] and "authentication failed" in lines[1], lines[1]


def test_doctor_shows_a_wrong_secret_in_its_table_only(nodes: Any, key: Path, tmp_path: Path) -> None:
    """The refusal is the `secret` row of doctor's table; no line of the library's comes before it."""
    node = nodes(1, "--secret-file", str(key))[0]
    proc = subprocess.run([sys.executable, "-m", "tbrpc.cli", "doctor", "--secret-file", str(other_key(tmp_path)),
                           node.endpoint], env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "authentication failed" in proc.stdout, proc.stdout
    assert "tbrpc node" not in proc.stderr, proc.stderr


def test_no_secret_against_a_secured_node(nodes: Any, key: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TBRPC_SECRET_FILE", raising=False)
    node = nodes(1, "--secret-file", str(key))[0]
    with pytest.raises(tbrpc.AuthenticationError, match=f"{node.endpoint}.*requires a cluster secret"):
        tbrpc.probe(node.endpoint, timeout=5)


def test_secured_head_against_an_open_node(nodes: Any, key: Path) -> None:
    node = nodes(1)[0]
    with pytest.raises(tbrpc.AuthenticationError, match=f"{node.endpoint}.*asks for none"):
        tbrpc.probe(node.endpoint, timeout=5, secret_file=key)


def test_secret_from_the_environment(nodes: Any, key: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TBRPC_SECRET_FILE", str(key))
    node = nodes(1)[0]                       # the node reads it from the environment too
    info, _ = tbrpc.probe(node.endpoint, timeout=5)
    assert info.node_device


def test_a_client_that_skips_auth_gets_only_the_refusal(nodes: Any, key: Path) -> None:
    node = nodes(1, "--secret-file", str(key))[0]
    w = AuthWire(node.endpoint)
    status, rep = w.hello_nonce()
    assert status == 0 and rep.caps & lib.TB_CAP_AUTH
    # before AUTH the node says nothing about itself
    assert rep.mem_total == 0 and ffi.string(rep.device_name) == b"" and ffi.string(rep.node_name) == b""
    w.send(lib.TB_CMD_ALLOC_BUFFER, pack("struct tb_alloc_req", size=1 << 20))
    status, body = w.reply()
    assert status == lib.TB_STATUS_AUTH and b"requires authentication" in body
    assert w.closed(timeout=10)
    assert "without authenticating" in node.log_text()


@pytest.mark.parametrize("command", ["STATUS", "SET_TENSOR", "GRAPH_COMPUTE", "PEER_CONNECT", "OPEN_FILE"])
def test_every_command_before_auth_is_refused_unread(nodes: Any, key: Path, command: str) -> None:
    node = nodes(1, "--secret-file", str(key))[0]
    w = AuthWire(node.endpoint)
    assert w.hello_nonce()[0] == 0
    # a header announcing 200 MiB: refused before the node reads (or allocates for) any of it
    w.sock.sendall(struct.pack("<IHHQQ", lib.TB_MAGIC, getattr(lib, f"TB_CMD_{command}"), 0, 7, 200 << 20))
    status, body = w.reply()
    assert status == lib.TB_STATUS_AUTH, body
    assert w.closed(timeout=10)


def test_a_replayed_auth_fails(nodes: Any, key: Path) -> None:
    node = nodes(1, "--secret-file", str(key))[0]
    first = AuthWire(node.endpoint)
    head_nonce = os.urandom(32)
    status, hello = first.hello_nonce(head_nonce)
    assert status == 0
    captured = mac(secret.read(key), b"tbrpc 4 head", head_nonce, bytes(hello.nonce))
    first.send(lib.TB_CMD_AUTH, captured)
    status, body = first.reply()
    assert status == 0, body
    # the node's proof comes back, over both nonces
    assert len(body) == ffi.sizeof("struct tb_auth_reply")
    # the replay uses the same head nonce (the head's is the attacker's to choose): only the
    # node's fresh nonce makes the captured MAC stale
    again = AuthWire(node.endpoint)
    status, hello_again = again.hello_nonce(head_nonce)
    assert status == 0 and bytes(hello_again.nonce) != bytes(hello.nonce)
    again.send(lib.TB_CMD_AUTH, captured)
    status, body = again.reply()
    assert status == lib.TB_STATUS_AUTH and b"authentication failed" in body
    assert again.closed(timeout=10)


def test_the_handshake_has_one_deadline(nodes: Any, key: Path) -> None:
    """A byte every half second keeps a per-read timeout happy; the handshake deadline is total."""
    node = nodes(1, "--secret-file", str(key), "--timeout", "2")[0]
    w = AuthWire(node.endpoint)
    hello = ffi.new("struct tb_hello *")
    lib.tb_abi_fill(ffi.addressof(hello.abi))
    message = struct.pack("<IHHQQ", lib.TB_MAGIC, lib.TB_CMD_HELLO, 0, 1, ffi.sizeof(hello[0])) + bytes(ffi.buffer(hello))
    started = time.monotonic()
    dropped = False
    for byte in message:
        try:
            w.sock.send(bytes([byte]))
        except OSError:
            dropped = True
            break
        time.sleep(0.5)
        if time.monotonic() - started > 10:
            break
    assert dropped or w.closed(timeout=5)
    assert time.monotonic() - started < 10
    log = node.log_text()
    assert "not complete in time" in log or "no HELLO within" in log or "past the deadline" in log, log


# ---- node-to-node links ------------------------------------------------------------

def authed(node: Any, key: Path) -> AuthWire:
    w = AuthWire(node.endpoint)
    status, body, _ = w.authenticate(secret.read(key))
    assert status == 0, body
    return w


def test_peer_connect_to_a_port_that_is_not_a_node_sends_nothing(nodes: Any, key: Path) -> None:
    """The node dials what PEER_CONNECT names but sends not one byte (token, name, data) to a
    listener that has not proven it knows the link key: no pivot, no port scanner."""
    node = nodes(1, "--secret-file", str(key), "--timeout", "1")[0]
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    received: list[bytes] = []

    def serve() -> None:
        conn, _ = listener.accept()
        conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n" + b"\0" * 80)   # talks first, like many services
        conn.settimeout(5)
        data = b""
        try:
            while chunk := conn.recv(4096):
                data += chunk
        except OSError:
            pass
        received.append(data)
        conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    w = authed(node, key)
    payload = pack("struct tb_peer_connect", host=b"127.0.0.1", port=listener.getsockname()[1], token=0x4141414141414141)
    w.send(lib.TB_CMD_PEER_CONNECT, payload)
    status, body = w.reply()
    assert status == 0 and struct.unpack_from("<Q", body)[0] == 0   # no link
    thread.join(10)
    assert received == [b""]
    assert "did not prove it is a tbrpc node" in node.log_text()
    listener.close()


def test_peer_listener_refuses_a_dialer_without_the_key(nodes: Any, key: Path) -> None:
    node = nodes(1, "--secret-file", str(key), "--timeout", "2")[0]
    w = authed(node, key)
    w.send(lib.TB_CMD_PEER_LISTEN)
    status, body = w.reply()
    assert status == 0
    token, port = struct.unpack("<QQ", body)
    assert port
    w.send(lib.TB_CMD_PEER_ACCEPT, struct.pack("<Q", token))   # answered when a dialer proved itself, or after 2 s
    dialer = socket.create_connection(("127.0.0.1", port), timeout=5)
    greeting = dialer.recv(ffi.sizeof("struct tb_peer_greeting"), socket.MSG_WAITALL)
    assert greeting[:7] == b"TBPEER4"
    # an answer that knows the token but not the secret: the link key needs both
    dialer.sendall(os.urandom(32) + os.urandom(32) + b"intruder".ljust(64, b"\0"))
    assert dialer.recv(64) == b""     # closed, no confirmation
    status, body = w.reply()
    assert status == 0 and struct.unpack("<Q", body)[0] == 0
    assert "did not prove it knows the link key" in node.log_text()


def test_a_session_cannot_link_to_itself(nodes: Any, key: Path) -> None:
    """A link to its own listener would let a session keep itself alive with its own keepalives."""
    node = nodes(1, "--secret-file", str(key), "--timeout", "1")[0]
    w = authed(node, key)
    w.send(lib.TB_CMD_PEER_LISTEN)
    token, port = struct.unpack("<QQ", w.reply()[1])
    w.send(lib.TB_CMD_PEER_CONNECT, pack("struct tb_peer_connect", host=b"127.0.0.1", port=port, token=token))
    status, body = w.reply()
    assert status == 0 and struct.unpack_from("<Q", body)[0] == 0


# ---- bounds ------------------------------------------------------------------------

def test_a_full_node_says_so(nodes: Any) -> None:
    node = nodes(1, "--max-clients", "1")[0]
    holder = Wire(node.endpoint)
    assert holder.hello()[0] == 0
    with pytest.raises(tbrpc.NodeFullError, match=r"is full \(1 clients\)"):
        tbrpc.probe(node.endpoint, timeout=5)
    holder.sock.close()
    deadline = time.time() + 10
    while True:   # the slot frees as soon as the worker is reaped
        try:
            tbrpc.probe(node.endpoint, timeout=5)
            break
        except tbrpc.NodeFullError:
            assert time.time() < deadline
            time.sleep(0.2)


# ---- the secret file ---------------------------------------------------------------

def test_secret_new_writes_0600_and_never_overwrites(tmp_path: Path) -> None:
    path = tmp_path / "s"
    cli = [sys.executable, "-m", "tbrpc.cli", "secret", "new", str(path)]
    first = subprocess.run(cli, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert first.returncode == 0, first.stderr
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(bytes.fromhex(path.read_text().strip())) == 32
    before = path.read_text()
    second = subprocess.run(cli, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert second.returncode != 0 and "exists already" in second.stderr
    assert path.read_text() == before


def test_a_secret_file_others_can_read_is_refused(tmp_path: Path, key: Path) -> None:
    os.chmod(key, 0o644)
    with pytest.raises(secret.SecretFileError, match="chmod 600"):
        secret.read(key)
    proc = subprocess.run([sys.executable, "-m", "tbrpc.cli", "node", "--port", "0", "--secret-file", str(key)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "open to group or others" in proc.stderr
    with pytest.raises(secret.SecretFileError):
        tbrpc.connect(["127.0.0.1:1"], secret_file=key)


def test_a_node_on_the_network_needs_a_secret_or_insecure(tmp_path: Path, key: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TBRPC_SECRET_FILE", raising=False)
    proc = subprocess.run([sys.executable, "-m", "tbrpc.cli", "node", "--host", "0.0.0.0", "--port", "0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60, env={**os.environ})
    assert proc.returncode != 0
    assert "without a cluster secret" in proc.stderr and "--insecure" in proc.stderr
    for extra in (["--insecure"], ["--secret-file", str(key)]):
        stop_nodes([start_node(tmp_path, "--host", "0.0.0.0", *extra)])   # it listens (or start_node raises)


# ---- launch and Llama -------------------------------------------------------------

def test_local_nodes_get_a_fresh_secret_per_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--local N` / Llama(cluster=N) without a secret: one is made for the run, 0600, given to each node."""
    from tbrpc.llama import with_secret
    from tbrpc.node_processes import _node_argv, head_secret_file
    from tbrpc.spec import local_specs

    monkeypatch.delenv("TBRPC_SECRET_FILE", raising=False)
    first = with_secret(2, local_specs(2), tmp_path)
    second = with_secret(2, local_specs(2), tmp_path)          # the same log dir again
    paths = {s.secret_file for s in first} | {s.secret_file for s in second}
    assert len(paths) == 2 and all(p for p in paths)
    for path in paths:
        assert stat.S_IMODE(Path(path).stat().st_mode) == 0o600 and len(secret.read(path)) == 32
    argv = _node_argv(first[0], 0)
    assert argv[argv.index("--secret-file") + 1] == first[0].secret_file
    assert head_secret_file(first[0]) == first[0].secret_file


def test_a_cluster_files_secret_reaches_the_nodes_launch_starts(tmp_path: Path, key: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from tbrpc.node_processes import _node_argv
    from tbrpc.cluster_file import cluster_secret_file, load_specs

    monkeypatch.delenv("TBRPC_SECRET_FILE", raising=False)
    cluster = tmp_path / "c.toml"
    cluster.write_text(f'secret_file = "{key}"\n[[node]]\nname = "a"\nhost = "10.0.0.2"\nport = 50052\n'
                       'ssh = "me@a.local"\n[[node]]\nname = "b"\nhost = "10.0.0.3"\nport = 50052\n'
                       'ssh = "me@b.local"\nsecret_file = "~/other/secret"\n')
    a, b = load_specs(cluster)
    assert cluster_secret_file(cluster) == str(key)
    assert _node_argv(a, 50052)[-2:] == ["--secret-file", str(key)]
    assert _node_argv(b, 50052)[-2:] == ["--secret-file", "~/other/secret"]


def test_two_sessions_waiting_on_each_other_do_not_live_forever(nodes: Any) -> None:
    """Two sessions linked both ways, each in PEER_RECV from the other, heads gone: a session that
    only waits sends no keepalives to its peers, so both time out and free their slots."""
    node = nodes(1, "--timeout", "2")[0]
    w1, w2 = AuthWire(node.endpoint), AuthWire(node.endpoint)
    for w in (w1, w2):
        assert w.hello_nonce()[0] == 0            # keepalive 1000 ms: a peer link times out after 3 s

    def link(listener: AuthWire, dialer: AuthWire) -> tuple[int, int]:
        listener.send(lib.TB_CMD_PEER_LISTEN)
        token, port = struct.unpack("<QQ", listener.reply()[1])
        listener.send(lib.TB_CMD_PEER_ACCEPT, struct.pack("<Q", token))
        dialer.send(lib.TB_CMD_PEER_CONNECT, pack("struct tb_peer_connect", host=b"127.0.0.1", port=port, token=token))
        out_id = struct.unpack_from("<Q", dialer.reply()[1])[0]
        in_id = struct.unpack("<Q", listener.reply()[1])[0]
        assert out_id and in_id
        return out_id, in_id

    _, in1 = link(w1, w2)       # w2 -> w1
    _, in2 = link(w2, w1)       # w1 -> w2
    for w, peer in ((w1, in1), (w2, in2)):
        handle = w.alloc(64)
        w.send(lib.TB_CMD_PEER_RECV, struct.pack("<QQQQ", peer, handle, 0, 16))   # tb_peer_range
    time.sleep(0.5)
    w1.sock.close()
    w2.sock.close()
    deadline = time.time() + 20
    while True:
        _, status = tbrpc.probe(node.endpoint, timeout=5)
        if status.clients == 1:                    # only this probe
            break
        assert time.time() < deadline, f"{status.clients - 1} session(s) still alive"
        time.sleep(0.5)


@pytest.mark.parametrize("isolation", ["spawn", "thread"])
def test_secret_in_every_isolation(nodes: Any, key: Path, tmp_path: Path, isolation: str) -> None:
    """A spawned worker reads the secret file itself; a thread shares the node's."""
    node = nodes(1, "--secret-file", str(key), "--isolation", isolation)[0]
    info, _ = tbrpc.probe(node.endpoint, timeout=10, secret_file=key)
    assert info.node_device
    with pytest.raises(tbrpc.AuthenticationError):
        tbrpc.probe(node.endpoint, timeout=10, secret_file=other_key(tmp_path))


def test_an_idle_client_holding_nothing_gives_its_slot_back(nodes: Any) -> None:
    node = nodes(1, "--idle-timeout", "1")[0]
    idle, holding = Wire(node.endpoint), Wire(node.endpoint)
    assert idle.hello()[0] == 0 and holding.hello()[0] == 0
    holding.alloc(4096)                           # a loaded head holds buffers: never idle-dropped
    assert idle.closed(timeout=10)
    assert "holding nothing; dropping it" in node.log_text()
    time.sleep(1.5)
    holding.send(lib.TB_CMD_SYNC)
    assert holding.reply()[0] == 0


def test_status_reaches_the_nodes_of_a_local_launch_with_its_run_secret(tmp_path: Path) -> None:
    """`tbrpc launch --local 1` makes a secret for its node; `tbrpc status` finds it in the launch's record."""
    import json

    from helpers import ENV, start_launch

    env = {**ENV, "XDG_RUNTIME_DIR": str(tmp_path / "run")}
    env.pop("TBRPC_SECRET_FILE", None)
    with start_launch(tmp_path, "--gguf", str(models.ensure("llama")), "--local", "1", "--ctx", "256",
                      "--port", "0", env=env) as launch:
        launch.http_base()
        shown = subprocess.run([sys.executable, "-m", "tbrpc.cli", "status", "--json"], cwd=tmp_path, env=env,
                               capture_output=True, text=True, timeout=60)
        (row,) = json.loads(shown.stdout)["nodes"]
        assert row["up"] and row["bytes_allocated"] > 0, row
        endpoint = row["endpoint"]
        with pytest.raises(tbrpc.AuthenticationError):       # without the run's secret: refused
            tbrpc.probe(endpoint, timeout=5)
