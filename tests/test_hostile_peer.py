"""A hostile peer on a node-to-node link (ggml_backend/node_links.c): a process
that knows the link key (the node runs without a secret, on loopback) dials
a session's listener by hand, stays on TCP, and then writes what it likes
where the session waits for activations (PEER_RECV). Every bad frame fails
that request with words naming the peer and what was wrong; the session and
the node stay alive."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from typing import Any

import pytest

from tbrpc.native import load
from wire import Wire, header, pack, ready

ffi, lib = load()
UPGRADE_MAGIC = 0x50555442          # transport/upgrade.c: "TBUP"
TRANSPORT_TCP, TRANSPORT_SHM = 0, 1  # transport.h: TB_TRANSPORT_TCP (stay), TB_TRANSPORT_SHM
REPLY_BYTES = 4 + 4 + 16 + 32 + 160 + 4 + 4   # transport.h: struct tb_transport_reply
FLAG_GAVE_UP = 2                    # proto.h: TB_FLAG_GAVE_UP
NAME = b"hostile-peer"


def exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError(f"closed after {len(data)} of {n} bytes")
        data += chunk
    return data


def ask(kind: int, magic: int = UPGRADE_MAGIC) -> bytes:
    """upgrade.c's struct upgrade_ask: {magic, tb_transport_req, why_kind, why[160]}."""
    slots, stride = (16, 256 * 1024) if kind == TRANSPORT_SHM else (0, 0)
    return struct.pack("<I4II160s", magic, kind, slots, stride, 0, lib.TB_WHY_ASKED, b"asked for")


def stay_on_tcp(sock: socket.socket) -> None:
    sock.sendall(ask(TRANSPORT_TCP))


def greet(w: Wire, name: bytes = NAME.ljust(64, b"\0")) -> socket.socket:
    """A fake peer dials w's session listener and proves the link key (the node
    runs without a secret); the session waits in PEER_ACCEPT for its upgrade."""
    """Link a fake peer into w's session: the listener's greeting, our answer
    proving the link key, its confirmation, then an upgrade ask that stays on
    TCP. (our socket, the incoming peer id the session gave the link)."""
    w.send(lib.TB_CMD_PEER_LISTEN)
    status, body = w.reply()
    assert status == 0, body
    token, port = struct.unpack("<QQ", body)
    w.send(lib.TB_CMD_PEER_ACCEPT, struct.pack("<Q", token))
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    greeting = exactly(sock, ffi.sizeof("struct tb_peer_greeting"))
    key = ffi.new("uint8_t[32]")
    lib.tb_peer_key(b"", 0, token, key)
    nonce, mac = os.urandom(32), ffi.new("uint8_t[32]")
    lib.tb_auth_mac(key, 32, b"tbrpc 4 peer dialer", greeting[8:40], nonce, name, len(name), mac)
    sock.sendall(nonce + bytes(mac) + name)
    exactly(sock, 32)   # struct tb_peer_confirm: the listener's MAC
    return sock


def accepted(w: Wire) -> int:
    """The incoming peer id PEER_ACCEPT answers (0: no link)."""
    status, body = w.reply()
    assert status == 0, body
    return struct.unpack("<Q", body[:8])[0]


def dial_in(w: Wire) -> tuple[socket.socket, int]:
    """Link a fake peer into w's session over TCP: (its socket, the incoming peer id)."""
    sock = greet(w)
    stay_on_tcp(sock)
    status, body = w.reply()
    assert status == 0, body
    peer_id = struct.unpack("<Q", body[:8])[0]
    assert peer_id, "the session refused the fake peer's link"
    return sock, peer_id


def peer_range(peer_id: int, handle: int, size: int) -> bytes:
    return struct.pack("<QQQQ", peer_id, handle, 0, size)   # struct tb_peer_range


def frame(cmd: int, payload: bytes, flags: int = 0) -> bytes:
    return pack("struct tb_header", magic=lib.TB_MAGIC, cmd=cmd, flags=flags, id=0, len=len(payload)) + payload


def peer_recv_error(w: Wire, peer_id: int, handle: int, size: int, sock: socket.socket, sent: bytes) -> str:
    w.send(lib.TB_CMD_PEER_RECV, peer_range(peer_id, handle, size))
    sock.sendall(sent)
    return w.sync_error()


def still_serving(node: Any, w: Wire) -> None:
    """The session answers, and the node takes a new client."""
    w.send(lib.TB_CMD_SYNC)
    assert w.reply()[0] == 0
    assert ready(node).alloc(64)


def test_a_gave_up_frame_longer_than_its_limit_is_refused(nodes: Any) -> None:
    """A PEER_SEND flagged GAVE_UP carries at most TB_GAVE_UP_MAX bytes of text
    (read into a buffer of that size): a longer one is a frame of the wrong length."""
    node = nodes(1)[0]
    w = ready(node)
    sock, peer_id = dial_in(w)
    handle = w.alloc(64)
    n = 64 * 1024
    error = peer_recv_error(w, peer_id, handle, 16, sock, frame(lib.TB_CMD_PEER_SEND, b"A" * n, flags=FLAG_GAVE_UP))
    assert error.endswith(f"waiting for activations from node {NAME.decode()}: the peer sent PEER_SEND of {n} bytes, "
                          "expected 16"), error
    still_serving(node, w)


def test_a_gave_up_frame_within_its_limit_names_the_reason(nodes: Any) -> None:
    node = nodes(1)[0]
    w = ready(node)
    sock, peer_id = dial_in(w)
    handle = w.alloc(64)
    why = b"out of \x01patience"
    error = peer_recv_error(w, peer_id, handle, 16, sock, frame(lib.TB_CMD_PEER_SEND, why, flags=FLAG_GAVE_UP))
    assert error.endswith(f"from node {NAME.decode()}: it gave up: out of ?patience"), error
    still_serving(node, w)


def test_a_frame_of_the_wrong_length_or_command_is_refused(nodes: Any) -> None:
    """The frame must be a PEER_SEND of exactly the bytes PEER_RECV names."""
    node = nodes(1)[0]
    w = ready(node)
    handle = w.alloc(64)
    sock, peer_id = dial_in(w)
    error = peer_recv_error(w, peer_id, handle, 16, sock, frame(lib.TB_CMD_PEER_SEND, b"x" * 48))
    assert error.endswith(f"from node {NAME.decode()}: the peer sent PEER_SEND of 48 bytes, expected 16"), error
    sock2, peer2 = dial_in(w)
    error = peer_recv_error(w, peer2, handle, 16, sock2, frame(lib.TB_CMD_SYNC, b"y" * 16))
    assert error.endswith(f"from node {NAME.decode()}: the peer sent SYNC of 16 bytes, expected 16"), error
    still_serving(node, w)


def test_peer_ids_and_directions_are_checked(nodes: Any) -> None:
    """PEER_RECV/PEER_SEND and ALLREDUCE name links of this session in the direction they use."""
    node = nodes(1)[0]
    w = ready(node)
    handle = w.alloc(64)
    sock, peer_id = dial_in(w)         # incoming: PEER_RECV only
    for cmd, pid, words in ((lib.TB_CMD_PEER_RECV, 0, "unknown incoming peer 0"),
                            (lib.TB_CMD_PEER_RECV, peer_id + 1, f"unknown incoming peer {peer_id + 1}"),
                            (lib.TB_CMD_PEER_SEND, peer_id, f"unknown outgoing peer {peer_id}")):
        w.send(cmd, peer_range(pid, handle, 16))
        error = w.sync_error()
        assert error.endswith(words), error
    fields = dict(handle=handle, offset=0, size=16, type=0, n=2, self=0, flags=lib.TB_ALLREDUCE_COMPUTED)
    for out_id, in_id in ((peer_id, peer_id), (0, peer_id), (peer_id + 1, peer_id), (1 << 40, peer_id), (0, 1 << 40)):
        w.send(lib.TB_CMD_ALLREDUCE, pack("struct tb_allreduce", **fields, peer_out=[0, out_id] + [0] * 14,
                                          peer_in=[0, in_id] + [0] * 14))
        error = w.sync_error()
        assert error.endswith(f"ALLREDUCE: no link to and from node 1 (peer ids {out_id}, {in_id})"), error
    big = w.alloc(lib.TB_MAX_PAYLOAD + 4096)        # host memory, untouched: a range the buffer holds
    sock.sendall(frame(lib.TB_CMD_PEER_SEND, b"x" * 4))   # what a receive of any size would read, were it let wait
    w.send(lib.TB_CMD_PEER_RECV, peer_range(peer_id, big, lib.TB_MAX_PAYLOAD + 4))
    error = w.sync_error()
    assert error.endswith(f"a peer transfer of {lib.TB_MAX_PAYLOAD + 4} bytes exceeds the message limit"), error
    w.send(lib.TB_CMD_ALLREDUCE, pack("struct tb_allreduce", handle=big, offset=0, size=lib.TB_MAX_PAYLOAD + 4, type=0,
                                      n=2, self=0, flags=lib.TB_ALLREDUCE_COMPUTED, peer_out=[0, peer_id] + [0] * 14,
                                      peer_in=[0, peer_id] + [0] * 14))
    error = w.sync_error()
    assert error.endswith(f"ALLREDUCE: {lib.TB_MAX_PAYLOAD + 4} bytes of type 0 (F32 up to the message limit only)"), error
    w.send(lib.TB_CMD_ALLREDUCE, pack("struct tb_allreduce", **{**fields, "flags": fields["flags"] | lib.TB_ALLREDUCE_RING},
                                      peer_out=[0, peer_id] + [0] * 14, peer_in=[0, peer_id] + [0] * 14))
    error = w.sync_error()
    assert "has no link to the next node 1 (peer id 1)" in error, error
    still_serving(node, w)


def test_an_upgrade_ask_without_its_magic_ends_the_link(nodes: Any) -> None:
    node = nodes(1)[0]
    w = ready(node)
    sock = greet(w)
    sock.sendall(ask(TRANSPORT_TCP, magic=0x41414141))
    assert accepted(w) == 0
    assert (f"link from peer {NAME.decode()} failed in its upgrade: transport upgrade: "
            "127.0.0.1") in node.log_text(), node.log_text()[-2000:]
    assert "no transport upgrade where one was due" in node.log_text(), node.log_text()[-2000:]
    still_serving(node, w)


def test_a_dialer_that_did_not_map_the_ring_keeps_the_link_on_tcp(nodes: Any) -> None:
    """The listener makes a ring when asked, but switches to it only on the
    dialer's word that it mapped it (1); any other word keeps the link on TCP."""
    node = nodes(1)[0]
    w = ready(node)
    for word in (0, 7):
        sock = greet(w)
        sock.sendall(ask(TRANSPORT_SHM))
        reply = exactly(sock, REPLY_BYTES)
        assert reply[8:15] != b"\0" * 7 and reply[24:31] == b"/tbrpc-", reply[:64]   # an offer, not a refusal
        sock.sendall(struct.pack("<I", word))
        peer_id = accepted(w)
        assert peer_id, "the link was refused"
        assert (f"link from peer {NAME.decode()}: transport tcp: the peer could not map the shared memory"
                in node.log_text()), node.log_text()[-2000:]
        w.send(lib.TB_CMD_PEER_RECV, peer_range(peer_id, w.alloc(64), 4))   # the link works, over TCP
        sock.sendall(frame(lib.TB_CMD_PEER_SEND, b"abcd"))
        assert w.sync_error() == ""
    still_serving(node, w)


def test_a_peer_name_without_its_nul_is_cut_to_its_field(nodes: Any) -> None:
    """The dialer's name fills all 64 bytes of its field: the session keeps 63 of them."""
    node = nodes(1)[0]
    w = ready(node)
    sock = greet(w, name=b"N" * 64)
    stay_on_tcp(sock)
    peer_id = accepted(w)
    assert peer_id
    assert f"link from peer {'N' * 63}: transport tcp: peer: asked for" in node.log_text(), node.log_text()[-2000:]
    error = peer_recv_error(w, peer_id, w.alloc(64), 16, sock, frame(lib.TB_CMD_PEER_SEND, b"x" * 8))
    assert error.endswith(f"waiting for activations from node {'N' * 63}: the peer sent PEER_SEND of 8 bytes, "
                          "expected 16"), error
    still_serving(node, w)


def fake_listener(greeting_mac_ok: bool, confirm_ok: bool) -> tuple[socket.socket, int, list[bytes]]:
    """A listener that greets with the peer magic, a MAC over its nonce (right
    or wrong), then reads the dialer's answer and sends a confirmation (right
    or wrong). (listener, token, [all the dialer sent]) once it is done."""
    token = 0x5151515151515151
    listener = socket.create_server(("127.0.0.1", 0))
    received: list[bytes] = []
    key = ffi.new("uint8_t[32]")
    lib.tb_peer_key(b"", 0, token, key)

    def mac(role: bytes, a: bytes, b: bytes) -> bytes:
        out = ffi.new("uint8_t[32]")
        lib.tb_auth_mac(key, 32, role, a, b, ffi.NULL, 0, out)
        return bytes(out)

    def serve() -> None:
        conn, _ = listener.accept()
        conn.settimeout(5)
        nonce = os.urandom(32)
        greet_mac = mac(b"tbrpc 4 peer greets", nonce, b"\0" * 32)
        conn.sendall(b"TBPEER4\0" + nonce + (greet_mac if greeting_mac_ok else bytes(32)))
        data = b""
        try:
            while len(data) < 128 and (chunk := conn.recv(128 - len(data))):
                data += chunk
            if len(data) == 128:
                confirm = mac(b"tbrpc 4 peer listener", nonce, data[:32])
                conn.sendall(confirm if confirm_ok else bytes(a ^ 1 for a in confirm))
            while chunk := conn.recv(4096):
                data += chunk
        except OSError:
            pass
        received.append(data)
        conn.close()

    threading.Thread(target=serve, daemon=True).start()
    return listener, token, received


@pytest.mark.parametrize("greeting_mac_ok,sent", [(False, 0), (True, 128)])
def test_a_listener_that_does_not_prove_the_link_key_gets_no_link(nodes: Any, greeting_mac_ok: bool, sent: int) -> None:
    """PEER_CONNECT to a listener whose greeting MAC is wrong: the node sends
    nothing. To one whose greeting is right but whose confirmation is wrong: the
    node sends its answer (128 bytes) and nothing more, no upgrade, no data."""
    node = nodes(1, "--timeout", "2")[0]
    w = ready(node)
    listener, token, received = fake_listener(greeting_mac_ok, confirm_ok=False)
    w.send(lib.TB_CMD_PEER_CONNECT, pack("struct tb_peer_connect", host=b"127.0.0.1", port=listener.getsockname()[1],
                                         token=token))
    assert accepted(w) == 0
    deadline = time.time() + 10
    while not received and time.time() < deadline:
        time.sleep(0.05)
    assert [len(r) for r in received] == [sent]
    assert "(it did not prove it is a tbrpc node of this cluster)" in node.log_text(), node.log_text()[-2000:]
    listener.close()
    still_serving(node, w)


def test_peer_accept_with_another_token_waits_for_no_one(nodes: Any) -> None:
    """PEER_ACCEPT names the token PEER_LISTEN gave: with any other the answer
    is no link at once, and a dialer at the listener is not greeted."""
    node = nodes(1, "--timeout", "3")[0]
    w = ready(node)
    w.send(lib.TB_CMD_PEER_LISTEN)
    token, port = struct.unpack("<QQ", w.reply()[1])
    dialer = socket.create_connection(("127.0.0.1", port), timeout=1.5)
    started = time.monotonic()
    w.send(lib.TB_CMD_PEER_ACCEPT, struct.pack("<Q", token ^ 1))
    assert accepted(w) == 0
    assert time.monotonic() - started < 1.0
    with pytest.raises(TimeoutError):
        dialer.recv(1)
    still_serving(node, w)


def test_peer_connect_refuses_a_port_out_of_range(nodes: Any) -> None:
    """A port of 65536 + p is not p: the node dials nothing and says why."""
    node = nodes(1, "--timeout", "2")[0]
    w = ready(node)
    listener, token, received = fake_listener(greeting_mac_ok=True, confirm_ok=True)
    port = listener.getsockname()[1]
    w.send(lib.TB_CMD_PEER_CONNECT, pack("struct tb_peer_connect", host=b"127.0.0.1", port=(1 << 16) + port, token=token))
    status, body = w.reply()
    assert status == 0 and struct.unpack_from("<Q", body)[0] == 0
    transport = ffi.string(ffi.from_buffer("struct tb_peer_connect_reply *", body).transport).decode()
    assert transport == f"none: cannot reach 127.0.0.1:{(1 << 16) + port} (bad port)", transport
    time.sleep(0.3)
    assert received == []          # nothing dialed our listener
    listener.close()
    still_serving(node, w)


def test_peer_connect_cuts_a_host_without_its_nul(nodes: Any) -> None:
    """A host that fills all 256 bytes of its field is read as its first 255."""
    node = nodes(1, "--timeout", "2")[0]
    w = ready(node)
    w.send(lib.TB_CMD_PEER_CONNECT, b"a" * 256 + struct.pack("<QQQQ", 1, 7, 0, 0))   # struct tb_peer_connect
    status, body = w.reply()
    assert status == 0 and struct.unpack_from("<Q", body)[0] == 0
    assert f"cannot reach peer {'a' * 255}:1 (" in node.log_text(), node.log_text()[-2000:]
    still_serving(node, w)



def link_out(w: Wire) -> tuple[socket.socket, int]:
    """The session dials a fake listener that proves the link key and
    declines shared memory: (the listener's end, the outgoing peer id)."""
    token = 0x5252525252525252
    key = ffi.new("uint8_t[32]")
    lib.tb_peer_key(b"", 0, token, key)
    listener = socket.create_server(("127.0.0.1", 0))

    def mac(role: bytes, a: bytes, b: bytes) -> bytes:
        out = ffi.new("uint8_t[32]")
        lib.tb_auth_mac(key, 32, role, a, b, ffi.NULL, 0, out)
        return bytes(out)

    w.send(lib.TB_CMD_PEER_CONNECT, pack("struct tb_peer_connect", host=b"127.0.0.1", port=listener.getsockname()[1],
                                         token=token))
    conn, _ = listener.accept()
    listener.close()
    conn.settimeout(10)
    nonce = os.urandom(32)
    conn.sendall(b"TBPEER4\0" + nonce + mac(b"tbrpc 4 peer greets", nonce, b"\0" * 32))
    answer = exactly(conn, 128)
    conn.sendall(mac(b"tbrpc 4 peer listener", nonce, answer[:32]))
    kind = struct.unpack_from("<I", exactly(conn, 184), 4)[0]     # upgrade.c's struct upgrade_ask
    if kind != TRANSPORT_TCP:
        conn.sendall(bytes(56) + b"not here".ljust(160, b"\0") + struct.pack("<II", lib.TB_WHY_NO_SHM, 0))
    status, body = w.reply()
    assert status == 0, body
    peer_id = struct.unpack_from("<Q", body)[0]
    assert peer_id, ffi.string(ffi.from_buffer("struct tb_peer_connect_reply *", body).transport)
    return conn, peer_id


def test_an_allreduce_over_real_links_stays_inside_its_buffer(nodes: Any) -> None:
    """With links to and from the other node in place, the range ALLREDUCE
    sums into must lie inside its buffer: refused before a byte is sent."""
    node = nodes(1)[0]
    w = ready(node)
    out_sock, out_id = link_out(w)
    in_sock, in_id = dial_in(w)
    handle = w.alloc(64)
    fields = dict(handle=handle, type=0, n=2, self=0, peer_out=[0, out_id] + [0] * 14, peer_in=[0, in_id] + [0] * 14)
    for flags in (lib.TB_ALLREDUCE_COMPUTED, lib.TB_ALLREDUCE_COMPUTED | lib.TB_ALLREDUCE_RING):
        w.send(lib.TB_CMD_ALLREDUCE, pack("struct tb_allreduce", **fields, offset=48, size=64, flags=flags))
        error = w.sync_error()
        assert error.endswith(f"range [48, +64) lies outside buffer {handle} of 64 bytes"), error
    out_sock.settimeout(0.5)
    with pytest.raises(TimeoutError):
        out_sock.recv(1)               # nothing was sent to the next node
    w.send(lib.TB_CMD_ALLREDUCE, pack("struct tb_allreduce", **fields, offset=0, size=64, flags=lib.TB_ALLREDUCE_COMPUTED))
    in_sock.sendall(frame(lib.TB_CMD_PEER_SEND, struct.pack("<16f", *range(16))))   # the other node's partial
    header_bytes = exactly(out_sock, 24)
    assert struct.unpack("<IHHQQ", header_bytes)[4] == 64     # ours went to the other node
    exactly(out_sock, 64)
    assert w.sync_error() == ""
    still_serving(node, w)
