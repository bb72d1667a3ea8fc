"""A bounded fuzzing campaign against a running node (tests/fuzz.py): valid
handshakes, then mutated requests of every command and random graphs of the
ops llama.cpp uses. The node never dies or hangs, and no worker crashes."""

from __future__ import annotations

import socket
import struct
import threading
from typing import Any

import pytest

from fuzz import HEADER, campaign
from tbrpc.native import load


@pytest.mark.parametrize("seed", [1, 2])
def test_fuzzed_requests_neither_crash_nor_hang_the_node(seed: int, nodes: Any) -> None:
    node = nodes(1)[0]
    found = campaign(node.endpoint, frames=1500, seed=seed, node_pid=node.proc.pid, log=node.log)
    assert found.frames >= 1500 and found.connections > 10, found.summary()
    assert not found.node_died and node.proc.poll() is None, found.summary()
    assert found.hangs == [], found.summary()
    assert found.worker_crashes == 0, found.summary() + "\n" + node.log_text()[-3000:]


def test_a_node_that_stops_answering_is_a_hang() -> None:
    """The fuzzer is honest: a "node" that answers HELLO and ALLOC_BUFFER and
    then reads requests without ever answering or closing is reported as hung."""
    ffi, lib = load()
    server = socket.create_server(("127.0.0.1", 0))
    hello = bytes(ffi.buffer(ffi.new("struct tb_hello *")))

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            answered = 0
            with conn:
                while True:
                    head = conn.recv(HEADER.size, socket.MSG_WAITALL)
                    if len(head) < HEADER.size:
                        break
                    _m, cmd, _f, req_id, length = HEADER.unpack(head)
                    if length:
                        conn.recv(length, socket.MSG_WAITALL)
                    if answered < 3:   # HELLO and the two buffers
                        body = struct.pack("<iI", 0, 0) + (hello if answered == 0 else struct.pack("<QQQ", answered, 0, 4096))
                        conn.sendall(HEADER.pack(lib.TB_MAGIC, cmd, 1, req_id, len(body)) + body)
                        answered += 1

    threading.Thread(target=serve, daemon=True).start()
    try:
        found = campaign(f"127.0.0.1:{server.getsockname()[1]}", frames=200, seed=1, node_pid=None, log=None, hang_s=0.5)
    finally:
        server.close()
    assert found.hangs, found.summary()
