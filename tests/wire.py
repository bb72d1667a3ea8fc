"""A raw client of the wire format for tests: structs from the C headers via
cffi, one connection that sends requests and reads replies, and the pieces of
a graph message (used by the protocol, safety and authentication tests)."""

from __future__ import annotations

import ctypes
import socket
import struct
from pathlib import Path
from typing import Any

from tbrpc.native import load
from tbrpc.spec import split_endpoint

ffi, lib = load()
GGML_TENSOR_FLAG_COMPUTE = 16  # ggml.h: nodes without it are skipped by the CPU backend


def pack(ctype: str, **fields: Any) -> bytes:
    obj = ffi.new(f"{ctype} *", fields)
    return bytes(ffi.buffer(obj))


def header(cmd: int, payload_len: int, req_id: int = 1, magic: int | None = None) -> bytes:
    return pack("struct tb_header", magic=lib.TB_MAGIC if magic is None else magic, cmd=cmd, flags=0, id=req_id,
                len=payload_len)


class Wire:
    """A raw client connection to a node."""

    def __init__(self, endpoint: str) -> None:
        self.sock = socket.create_connection(split_endpoint(endpoint), timeout=10)
        self.next_id = 1

    def send(self, cmd: int, payload: bytes = b"") -> int:
        self.next_id += 1
        self.sock.sendall(header(cmd, len(payload), self.next_id) + payload)
        return self.next_id

    def reply(self) -> tuple[int, bytes]:
        """(status, body) of the next reply, skipping keepalives."""
        while True:
            raw = self._exactly(ffi.sizeof("struct tb_header"))
            _magic, cmd, flags, _id, length = struct.unpack("<IHHQQ", raw)
            if cmd != lib.TB_CMD_KEEPALIVE:
                break
        assert flags & 1, "expected a reply"
        body = self._exactly(length)
        status = struct.unpack("<i", body[:4])[0]
        return status, body[8:]

    def closed(self, timeout: float = 60) -> bool:
        """True when the node closes the connection (keepalives before that are fine)."""
        self.sock.settimeout(timeout)
        try:
            while True:
                raw = self.sock.recv(ffi.sizeof("struct tb_header"), socket.MSG_WAITALL)
                if not raw:
                    return True
                if struct.unpack("<IHHQQ", raw)[1] != lib.TB_CMD_KEEPALIVE:
                    return False
        except ConnectionResetError:
            return True

    def _exactly(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                raise ConnectionError("node closed the connection")
            data += chunk
        return data

    def hello(self, **abi_changes: int) -> tuple[int, bytes]:
        hello = ffi.new("struct tb_hello *")
        lib.tb_abi_fill(ffi.addressof(hello.abi))
        for key, value in abi_changes.items():
            setattr(hello.abi, key, value)
        self.send(lib.TB_CMD_HELLO, bytes(ffi.buffer(hello)))
        return self.reply()

    def alloc(self, size: int) -> int:
        self.send(lib.TB_CMD_ALLOC_BUFFER, pack("struct tb_alloc_req", size=size))
        status, body = self.reply()
        assert status == 0, body
        return struct.unpack("<Q", body[:8])[0]

    def sync_error(self) -> str:
        """Send SYNC; return the sticky error of earlier posted requests ('' if none)."""
        self.send(lib.TB_CMD_SYNC)
        status, body = self.reply()
        return body.decode(errors="replace") if status else ""


def ready(node: Any) -> Wire:
    w = Wire(node.endpoint)
    status, body = w.hello()
    assert status == 0, body
    return w


def tensor(**fields: Any) -> Any:
    t = ffi.new("struct tb_wire_tensor *")
    t.type = 0  # F32
    t.ne = [4, 1, 1, 1]
    t.nb = [4, 16, 16, 16]
    t.src = [-1] * 10
    t.view_src = -1
    for key, value in fields.items():
        setattr(t, key, value)
    return t


def graph(tensors: list[Any], nodes_idx: list[int]) -> bytes:
    body = pack("struct tb_graph_header", n_tensors=len(tensors), n_nodes=len(nodes_idx))
    body += b"".join(bytes(ffi.buffer(t)) for t in tensors)
    return body + struct.pack(f"<{len(nodes_idx)}I", *nodes_idx)


def ggml_op_index(name: str) -> int:
    import llama_cpp.llama_cpp as llama_lib

    op_name = llama_lib._lib.ggml_op_name
    op_name.restype = ctypes.c_char_p
    op_name.argtypes = [ctypes.c_int]
    for i in range(200):
        if op_name(i) == name.encode():
            return i
    raise LookupError(name)


def node_workers(node: Any) -> list[int]:
    """The node process's per-client workers (its children, from /proc)."""
    return [int(pid) for task in Path(f"/proc/{node.proc.pid}/task").iterdir()
            for pid in (task / "children").read_text().split()]
