"""Malformed and hostile messages against a running node process.

Each case speaks the wire format directly (structs from the C headers via
cffi) and checks the node's answer: an error reply or a dropped connection,
a log line naming the problem, and the node still serving other clients.
"""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import tbrpc
from tbrpc.native import load
from wire import GGML_TENSOR_FLAG_COMPUTE, Wire, ggml_op_index, graph, header, node_workers, pack, ready, tensor

ffi, lib = load()

@pytest.fixture
def node(nodes: Any) -> Any:
    started = nodes(1)[0]
    yield started
    # whatever a case did, the node is alive and serves a new client
    assert started.proc.poll() is None, "node process died"
    info, status = tbrpc.probe(started.endpoint, timeout=5)
    assert info.node_device


# ---- handshake ------------------------------------------------------------------

def test_protocol_version_mismatch_names_both_versions(node: Any) -> None:
    status, body = Wire(node.endpoint).hello(proto_version=99)
    assert status != 0
    assert f"speaks tbrpc protocol {lib.TB_PROTO_VERSION}" in body.decode() and "99" in body.decode()


def test_an_older_hello_of_another_size_still_names_both_versions(node: Any) -> None:
    """Protocol 1's HELLO had no ggml_build: 64 bytes shorter. The node compares
    the leading ABI before the size, so the answer is about versions."""
    hello = ffi.new("struct tb_hello *")
    lib.tb_abi_fill(ffi.addressof(hello.abi))
    hello.abi.proto_version = 1
    w = Wire(node.endpoint)
    w.send(lib.TB_CMD_HELLO, bytes(ffi.buffer(hello))[:-64])
    status, body = w.reply()
    assert status != 0 and f"speaks tbrpc protocol {lib.TB_PROTO_VERSION}" in body.decode(), body
    assert "1" in body.decode().split(f"protocol {lib.TB_PROTO_VERSION}", 1)[1]


def test_a_handshake_message_over_its_limit_is_dropped_unread(node: Any) -> None:
    """Before the handshake is done a message is at most TB_HANDSHAKE_MAX_LEN
    (4096) bytes: a HELLO claiming a megabyte is dropped at its header, so a
    client that proved nothing cannot make the node allocate or wait for it."""
    w = Wire(node.endpoint)
    w.sock.sendall(header(lib.TB_CMD_HELLO, 1 << 20))
    assert w.closed(timeout=5)
    assert "a HELLO of 1048576 bytes; dropping it" in node.log_text()


def test_ggml_abi_mismatch_is_refused(node: Any) -> None:
    status, body = Wire(node.endpoint).hello(ggml_op_count=7)
    assert status != 0 and "ggml ABI mismatch" in body.decode() and "7 ops" in body.decode()
    assert "ggml ABI mismatch" in node.log_text()


def test_silent_peer_is_dropped_after_the_timeout(nodes: Any) -> None:
    node = nodes(1, "--timeout", "1")[0]
    w = Wire(node.endpoint)
    assert w.closed(timeout=10)
    assert "no HELLO within 1000 ms" in node.log_text()


def test_a_trickling_sender_is_dropped(nodes: Any) -> None:
    """One byte every half second is progress by the per-read timeout (1 s),
    but a whole request must arrive within the timeout plus its size at
    1 MiB/s: the node drops the connection and says why."""
    node = nodes(1, "--timeout", "1")[0]
    w = Wire(node.endpoint)
    status, body = w.hello()
    assert status == 0, body
    w.sock.sendall(header(lib.TB_CMD_GET_TENSOR, ffi.sizeof("struct tb_range"), 7))
    started = time.monotonic()
    try:
        while time.monotonic() - started < 10:
            w.sock.sendall(b"\0")
            time.sleep(0.5)
    except (BrokenPipeError, ConnectionResetError):
        pass
    assert time.monotonic() - started < 5, "the node kept reading a trickle"
    assert w.closed(timeout=5)
    assert "message not complete in time (too slow a sender)" in node.log_text()


def test_request_before_hello_drops_the_connection(node: Any) -> None:
    w = Wire(node.endpoint)
    w.send(lib.TB_CMD_STATUS)
    assert w.closed()
    assert "before HELLO" in node.log_text()


# ---- framing --------------------------------------------------------------------

def test_bad_magic_drops_the_connection(node: Any) -> None:
    w = ready(node)
    w.sock.sendall(header(lib.TB_CMD_SYNC, 0, magic=0xDEADBEEF))
    assert w.closed()
    assert "not a tbrpc message" in node.log_text()


def test_oversized_payload_is_refused_before_allocating(node: Any) -> None:
    w = ready(node)
    w.sock.sendall(header(lib.TB_CMD_SET_TENSOR, 1 << 62))
    assert w.closed()
    assert "exceeds" in node.log_text()


def test_unknown_command_drops_the_connection(node: Any) -> None:
    w = ready(node)
    w.sock.sendall(header(999, 0))
    assert w.closed()
    assert "unknown command 999" in node.log_text()


def test_truncated_message_then_close(node: Any) -> None:
    w = ready(node)
    w.sock.sendall(header(lib.TB_CMD_ALLOC_BUFFER, 8) + b"\x01\x02")
    w.sock.close()


def test_wrong_payload_length_gets_an_error_reply(node: Any) -> None:
    w = ready(node)
    w.send(lib.TB_CMD_ALLOC_BUFFER, b"\x00" * 3)
    status, body = w.reply()
    assert status != 0 and "expected 8" in body.decode()


# Commands the generic length rule does not apply to: the handshake's own
# (refused with the connection), the node's keepalive, SET_TENSOR (whose bytes
# stream into the buffer: a short one drops the connection) and
# TRANSPORT_SWITCH (the head switches right after it).
NOT_GENERIC = {"HELLO", "AUTH", "KEEPALIVE", "SET_TENSOR", "TRANSPORT_SWITCH"}


def fixed_length_commands() -> list[int]:
    rows = [(cmd, lib.tb_command(cmd)) for cmd in range(1, lib.TB_CMD_COUNT_)]
    return [cmd for cmd, row in rows if ffi.string(row.name).decode() not in NOT_GENERIC and row.request != lib.TB_LEN_ANY]


def test_the_command_table_covers_every_command() -> None:
    names = [ffi.string(lib.tb_command(cmd).name).decode() for cmd in range(1, lib.TB_CMD_COUNT_)]
    assert "UNKNOWN" not in names and len(set(names)) == len(names)
    assert ffi.string(lib.tb_command(lib.TB_CMD_COUNT_).name) == b"UNKNOWN"


@pytest.mark.parametrize("cmd", fixed_length_commands(), ids=lambda c: ffi.string(lib.tb_command(c).name).decode())
def test_every_command_refuses_a_wrong_length(cmd: int, node: Any) -> None:
    """The table's length rule is enforced for every command: one byte
    short (or one too many for an empty request) is refused, naming the
    command and the length expected, and the session goes on."""
    row = lib.tb_command(cmd)
    name = ffi.string(row.name).decode()
    wrong = row.request_len - 1 if row.request_len else 1
    w = ready(node)
    w.send(cmd, b"\x00" * wrong)
    if row.posted:   # the failure is sticky: the next reply carries it
        w.send(lib.TB_CMD_SYNC)
    status, body = w.reply()
    least = "at least " if row.request == lib.TB_LEN_AT_LEAST else ""
    assert status != 0 and f"{name}: payload is {wrong} bytes, expected {least}{row.request_len}" in body.decode()
    w.send(lib.TB_CMD_SYNC)
    assert w.reply() == (0, b"")


# ---- buffers and ranges -----------------------------------------------------------

def test_set_tensor_outside_the_buffer(node: Any) -> None:
    w = ready(node)
    handle = w.alloc(4096)
    data = b"x" * 100
    w.send(lib.TB_CMD_SET_TENSOR, pack("struct tb_range", handle=handle, offset=4000, size=100) + data)
    error = w.sync_error()
    assert "outside buffer" in error and "SET_TENSOR" in error
    # the connection stays usable after the error was reported
    assert w.sync_error() == ""


def test_set_tensor_must_carry_the_bytes_it_names(node: Any) -> None:
    """A SET_TENSOR whose range names fewer bytes than it carries is refused
    whole: written as named, the rest of its bytes would be read as the next
    message."""
    w = ready(node)
    handle = w.alloc(4096)
    w.send(lib.TB_CMD_SET_TENSOR, pack("struct tb_range", handle=handle, offset=0, size=8) + b"\x01" * 16)
    assert "SET_TENSOR: header says 8 bytes, message carries 16" in w.sync_error()
    assert w.sync_error() == ""   # still in step with the client


def test_strided_writes_stay_inside_the_buffer_and_the_message(node: Any) -> None:
    """SET_TENSOR_2D writes n_copies rows of `size` bytes `stride` apart from
    the message's packed rows. Refused by name, the buffer untouched: rows
    whose span wraps 64 bits (2 * 2^63 is 0: row 1 would land 2^63 bytes
    past the buffer), rows that overlap, and more rows than the message
    carries (they would be copied from the node's memory past the message)."""
    w = ready(node)
    handle = w.alloc(4096)
    w.send(lib.TB_CMD_SET_TENSOR, pack("struct tb_range", handle=handle, offset=0, size=4096) + b"\0" * 4096)

    def set_2d(size: int, n_copies: int, stride: int, rows: bytes) -> str:
        w.send(lib.TB_CMD_SET_TENSOR_2D, struct.pack("<5Q", handle, 0, size, n_copies, stride) + rows)   # tb_range_2d
        return w.sync_error()

    assert (f"SET_TENSOR_2D: 3 rows of 4 bytes, {2**63} apart: not a valid set of rows"
            in set_2d(4, 3, 2**63, b"\x01" * 12))
    assert "SET_TENSOR_2D: 2 rows of 8 bytes, 4 apart: not a valid set of rows" in set_2d(8, 2, 4, b"\x01" * 16)
    assert "SET_TENSOR_2D: 4 rows of 256 bytes, the message carries 16" in set_2d(256, 4, 256, b"\x01" * 16)
    w.send(lib.TB_CMD_GET_TENSOR, pack("struct tb_range", handle=handle, offset=0, size=4096))
    assert w.reply() == (0, b"\0" * 4096)
    assert set_2d(4, 3, 8, b"\x01" * 4 + b"\x02" * 4 + b"\x03" * 4) == ""   # and a valid one is written
    w.send(lib.TB_CMD_GET_TENSOR, pack("struct tb_range", handle=handle, offset=0, size=24))
    assert w.reply() == (0, b"\x01" * 4 + b"\0" * 4 + b"\x02" * 4 + b"\0" * 4 + b"\x03" * 4 + b"\0" * 4)


def test_copies_and_memsets_stay_inside_their_buffers(node: Any) -> None:
    """COPY_TENSOR checks both of its ranges and MEMSET_TENSOR its one, each
    refused by name without a byte written; the session goes on."""
    w = ready(node)
    a, b = w.alloc(4096), w.alloc(4096)

    def copy(src_offset: int, dst_offset: int, size: int = 16) -> str:
        w.send(lib.TB_CMD_COPY_TENSOR, struct.pack("<5Q", a, src_offset, b, dst_offset, size))   # tb_copy_req
        return w.sync_error()

    def memset(handle: int, offset: int, size: int, value: int) -> str:
        w.send(lib.TB_CMD_MEMSET_TENSOR, struct.pack("<3QB7x", handle, offset, size, value))   # tb_memset_req
        return w.sync_error()

    assert memset(a, 0, 4096, 7) == "" and memset(b, 0, 4096, 0) == ""
    assert f"range [4090, +16) lies outside buffer {b} of 4096 bytes" in copy(0, 4090)
    assert f"range [{2**64 - 8}, +16) lies outside buffer {b} of 4096 bytes" in copy(0, 2**64 - 8)
    assert f"range [4090, +16) lies outside buffer {a} of 4096 bytes" in copy(4090, 0)
    assert f"range [4090, +16) lies outside buffer {b} of 4096 bytes" in memset(b, 4090, 16, 9)
    assert f"range [{2**64 - 8}, +16) lies outside buffer {b} of 4096 bytes" in memset(b, 2**64 - 8, 16, 9)
    w.send(lib.TB_CMD_GET_TENSOR, pack("struct tb_range", handle=b, offset=0, size=4096))
    assert w.reply() == (0, b"\0" * 4096)
    assert copy(0, 4080) == ""   # the last 16 bytes: inside
    w.send(lib.TB_CMD_GET_TENSOR, pack("struct tb_range", handle=b, offset=4072, size=24))
    assert w.reply() == (0, b"\0" * 8 + b"\x07" * 16)


def test_offset_overflow_is_caught(node: Any) -> None:
    w = ready(node)
    handle = w.alloc(4096)
    w.send(lib.TB_CMD_GET_TENSOR, pack("struct tb_range", handle=handle, offset=2**64 - 8, size=16))
    status, body = w.reply()
    assert status != 0 and "outside buffer" in body.decode()


def test_unknown_buffer_handle(node: Any) -> None:
    w = ready(node)
    w.send(lib.TB_CMD_GET_TENSOR, pack("struct tb_range", handle=12345, offset=0, size=4))
    status, body = w.reply()
    assert status != 0 and "unknown buffer handle 12345" in body.decode()


def test_huge_alloc_is_refused_not_attempted(node: Any) -> None:
    w = ready(node)
    w.send(lib.TB_CMD_ALLOC_BUFFER, pack("struct tb_alloc_req", size=2**62))
    status, body = w.reply()
    assert status != 0 and any(why in body.decode() for why in ("could not allocate", "exceeds", "refused"))


def test_get_tensor_over_the_message_limit_is_refused(node: Any) -> None:
    """A GET_TENSOR reply is one message: over TB_MAX_PAYLOAD (256 MiB) the
    head would refuse it as too long and fail the node, so the node refuses
    the request by name instead, even inside a buffer large enough."""
    w = ready(node)
    limit = 256 << 20
    handle = w.alloc(limit + 4096)
    w.send(lib.TB_CMD_GET_TENSOR, pack("struct tb_range", handle=handle, offset=0, size=limit + 1))
    status, body = w.reply()
    assert status != 0 and f"GET_TENSOR of {limit + 1} bytes exceeds the message limit" in body.decode(), body
    w.send(lib.TB_CMD_GET_TENSOR, pack("struct tb_range", handle=handle, offset=limit, size=16))
    assert w.reply()[0] == 0


# ---- graphs -------------------------------------------------------------------------

Q8_0 = 8   # ggml.h GGML_TYPE_Q8_0: blocks of 32 values in 34 bytes


def bad_graphs(handle: int) -> dict[str, tuple[bytes, str]]:
    ok = dict(buffer=handle, offset=0)
    return {
        "forward source": (graph([tensor(**ok, src=[1] + [-1] * 9), tensor(**ok)], [0]), "not an earlier tensor"),
        "invalid type": (graph([tensor(**ok, type=200)], [0]), "invalid type 200"),
        "invalid op": (graph([tensor(**ok, op=100000)], [0]), "op 100000 is not allowed"),
        "custom op (host function pointer)": (graph([tensor(**ok, op=ggml_op_index("CUSTOM"))], [0]), "is not allowed"),
        "negative shape": (graph([tensor(**ok, ne=[-4, 1, 1, 1])], [0]), "out of range"),
        "size overflow": (graph([tensor(**ok, ne=[2**40, 2**40, 1, 1], nb=[4, 2**44, 2**50, 2**50])], [0]), "overflows"),
        "data outside buffer": (graph([tensor(buffer=handle, offset=4090)], [0]), "outside its"),
        "unknown buffer": (graph([tensor(buffer=999, offset=0)], [0]), "unknown buffer handle 999"),
        "no buffer": (graph([tensor()], [0]), "has no buffer"),
        "node index out of range": (graph([tensor(**ok)], [5]), "refers to tensor 5"),
        "count mismatch": (pack("struct tb_graph_header", n_tensors=1000, n_nodes=1), "need"),
        "too many tensors": (pack("struct tb_graph_header", n_tensors=2**31, n_nodes=1), "out of range"),
        # each below is accepted (or crashes the worker) with its check in proto.c removed
        "type far off the table": (graph([tensor(**ok, type=2**31 - 1)], [0]), "invalid type 2147483647"),
        "dimension over 2^48": (graph([tensor(**ok, ne=[2**48 + 1, 1, 1, 1], nb=[0, 0, 0, 0])], [0]),
                                "ne[0] = 281474976710657 out of range"),
        "stride over 2^52": (graph([tensor(**ok, nb=[4, 16, 2**53, 16])], [0]), "nb[2] = 9007199254740992 out of range"),
        "quantized stride not a block": (graph([tensor(**ok, type=Q8_0, ne=[32, 1, 1, 1], nb=[1, 34, 34, 34])], [0]),
                                         "quantized rows must hold whole blocks with nb[0] = block size"),
        "invalid op on a source": (graph([tensor(**ok, op=100000), tensor(buffer=handle, offset=64, op=ggml_op_index("SQR"),
                                                                          src=[0] + [-1] * 9)], [1]),
                                   "tensor 0 '': op 100000 is not allowed"),
        "view of itself": (graph([tensor(**ok, view_src=0)], [0]), "view source 0 is not an earlier tensor"),
        "view source below -1": (graph([tensor(**ok, view_src=-5)], [0]), "view source -5 is not an earlier tensor"),
        "source below -1": (graph([tensor(**ok, src=[-5] + [-1] * 9)], [0]), "source 0 = -5 is not an earlier tensor"),
        "offset past the buffer": (graph([tensor(buffer=handle, offset=2**63)], [0]),
                                   f"data [{2**63}, +16) lies outside its 4096-byte buffer"),
        "one byte past the buffer": (graph([tensor(buffer=handle, offset=4081)], [0]),
                                     "data [4081, +16) lies outside its 4096-byte buffer"),
        "view past its source's end": (graph([tensor(**ok), tensor(buffer=handle, offset=8, view_src=0)], [1]),
                                       "view [8, +16) lies outside its source (tensor 0)"),
        "view before its source": (graph([tensor(buffer=handle, offset=64), tensor(buffer=handle, offset=48, view_src=0)], [1]),
                                   "view [48, +16) lies outside its source (tensor 0)"),
    }


@pytest.mark.parametrize("case", list(bad_graphs(1)))
def test_malformed_graph_is_rejected(node: Any, case: str) -> None:
    w = ready(node)
    handle = w.alloc(4096)
    payload, expected = bad_graphs(handle)[case]
    w.send(lib.TB_CMD_GRAPH_COMPUTE, payload)
    error = w.sync_error()
    assert "GRAPH_COMPUTE" in error and expected in error, error
    assert "rejected" in node.log_text()


@pytest.fixture(params=["process", "spawn"])
def isolated_node(request: pytest.FixtureRequest, nodes: Any) -> Any:
    """A node whose workers are forked (Linux's default) or freshly spawned (macOS's)."""
    started = nodes(1, "--isolation", request.param)[0]
    yield started
    assert started.proc.poll() is None, "node process died"


def test_graph_breaking_an_op_contract_is_refused_and_a_dying_worker_ends_only_that_client(isolated_node: Any) -> None:
    """A CPY into a tensor with another element count makes ggml abort;
    the op rules (op_rules.c) refuse it by name, and no graph
    that passes them is known to abort. Isolation still matters for what is
    left (a device driver's crash, a bug of ours): a worker killed by a
    signal ends only its client; the node logs it and keeps serving."""
    node = isolated_node
    bystander = ready(node)
    kept = bystander.alloc(64)
    w = ready(node)
    handle = w.alloc(4096)
    a = tensor(buffer=handle, offset=0, ne=[4, 1, 1, 1], nb=[4, 16, 16, 16])
    b = tensor(buffer=handle, offset=64, ne=[8, 1, 1, 1], nb=[4, 32, 32, 32])
    copy = tensor(buffer=handle, offset=64, ne=[8, 1, 1, 1], nb=[4, 32, 32, 32], op=ggml_op_index("CPY"),
                  src=[0, 1] + [-1] * 8, flags=GGML_TENSOR_FLAG_COMPUTE)
    w.send(lib.TB_CMD_GRAPH_COMPUTE, graph([a, b, copy], [2]))
    error = w.sync_error()
    assert "tensor 2 (CPY" in error and "source has 4 elements, destination 8" in error, error
    os.kill(max(node_workers(node)), signal.SIGABRT)   # the later worker (higher pid) is w's
    assert w.closed()
    deadline = time.time() + 60
    while "died with signal 6" not in node.log_text() and time.time() < deadline:
        time.sleep(0.05)
    assert "died with signal 6" in node.log_text()
    bystander.send(lib.TB_CMD_GET_TENSOR, pack("struct tb_range", handle=kept, offset=0, size=8))
    assert bystander.reply()[0] == 0


def test_alloc_size_is_the_devices_answer(node: Any) -> None:
    w = ready(node)
    x = tensor(ne=[64, 9, 1, 1], nb=[4, 256, 2304, 2304])
    sorted_ = tensor(type=26, ne=[64, 9, 1, 1], nb=[4, 256, 2304, 2304], op=ggml_op_index("ARGSORT"),
                     src=[0] + [-1] * 9)   # type 26: I32
    w.send(lib.TB_CMD_GET_ALLOC_SIZE, graph([x, sorted_], []))
    status, body = w.reply()
    assert status == 0 and struct.unpack("<Q", body)[0] == 64 * 9 * 4   # the CPU sizes it as ggml_nbytes


@pytest.mark.parametrize("cmd", [lib.TB_CMD_SUPPORTS_OP, lib.TB_CMD_GET_ALLOC_SIZE], ids=["SUPPORTS_OP", "GET_ALLOC_SIZE"])
def test_an_op_question_without_tensors_is_refused(node: Any, cmd: int) -> None:
    """The op of SUPPORTS_OP and GET_ALLOC_SIZE is the table's last tensor:
    a table of none has no op (without the check the node read the pointer
    before its tensor array). Refused by name; the session goes on."""
    w = ready(node)
    w.send(cmd, pack("struct tb_graph_header", n_tensors=0, n_nodes=0))
    status, body = w.reply()
    name = ffi.string(lib.tb_command(cmd).name).decode()
    assert status != 0 and f"{name}: 0 tensors / 0 nodes out of range" in body.decode(), body
    w.send(lib.TB_CMD_SYNC)
    assert w.reply() == (0, b"")


def test_alloc_size_is_asked_only_of_ops_the_rules_accept(node: Any) -> None:
    """GET_ALLOC_SIZE hands the op to the device's get_alloc_size, which may
    read its sources (Metal's does for MUL_MAT_ID): a MUL_MAT without its
    second source is refused by the op rules first, naming tensor and rule."""
    w = ready(node)
    shapes_only = [tensor(ne=[4, 2, 1, 1], nb=[4, 16, 32, 32]),
                   tensor(ne=[2, 1, 1, 1], nb=[4, 8, 8, 8], op=ggml_op_index("MUL_MAT"), src=[0] + [-1] * 9)]
    w.send(lib.TB_CMD_GET_ALLOC_SIZE, graph(shapes_only, []))
    status, body = w.reply()
    assert status != 0 and "tensor 1 (MUL_MAT): source 1 is missing" in body.decode(), body
    w.send(lib.TB_CMD_SYNC)
    assert w.reply() == (0, b"")


def test_supports_op_is_the_devices_answer(node: Any) -> None:
    """The CPU multiplies Q4_K weights by F32 or Q8_K rows, not by Q4_0 ones."""
    q4_k, q4_0, f32 = 12, 2, 0   # enum ggml_type
    weights = tensor(type=q4_k, ne=[256, 4, 1, 1], nb=[144, 144, 576, 576])
    mul_mat = ggml_op_index("MUL_MAT")
    answers = []
    for rows_type, block_bytes, row_bytes in ((f32, 4, 1024), (q4_0, 18, 144)):
        rows = tensor(type=rows_type, ne=[256, 3, 1, 1], nb=[block_bytes, row_bytes, 3 * row_bytes, 3 * row_bytes])
        product = tensor(ne=[4, 3, 1, 1], nb=[4, 16, 48, 48], op=mul_mat, src=[0, 1] + [-1] * 8)
        w = ready(node)
        w.send(lib.TB_CMD_SUPPORTS_OP, graph([weights, rows, product], []))
        answers.append(w.reply())
    assert answers == [(0, b"\x01"), (0, b"\x00")]


def test_a_cpu_node_says_so_at_hello(node: Any) -> None:
    """So that a head of the same ggml build answers supports_op itself."""
    status, body = Wire(node.endpoint).hello()
    hello = ffi.from_buffer("struct tb_hello *", bytearray(body))
    mine = ffi.new("char[64]")
    lib.tb_ggml_build(mine, 64)
    assert status == 0 and hello.caps & lib.TB_CAP_SUPPORTS_OP_IS_CPU
    assert ffi.string(hello.ggml_build) == ffi.string(mine) and b" " in ffi.string(mine)


@pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage").exists(), reason="madvise(MADV_HUGEPAGE) is Linux's")
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds workers through /proc")
def test_a_spawned_worker_does_not_outlive_its_node(nodes: Any) -> None:
    """Spawned workers have no PR_SET_PDEATHSIG (macOS has none): they watch a
    pipe from the node and leave when it closes, even after SIGKILL."""
    node = nodes(1, "--isolation", "spawn")[0]
    w = ready(node)
    w.alloc(1 << 20)
    (worker,) = node_workers(node)
    cmdline = Path(f"/proc/{worker}/cmdline").read_bytes().split(b"\0")
    assert any(b"tbrpc._worker" in arg for arg in cmdline), cmdline
    inherited = sorted(int(fd.name) for fd in Path(f"/proc/{worker}/fd").iterdir())
    named = {int(cmdline[cmdline.index(flag) + 1]) for flag in (b"--client-fd", b"--parent-fd")}
    assert named <= set(inherited)
    # the status table's descriptor is closed once the worker mapped its view of it (node.c, map_worker_view)
    assert int(cmdline[cmdline.index(b"--status-fd") + 1]) not in inherited
    node.proc.kill()
    node.proc.wait(timeout=10)
    deadline = time.time() + 10
    while Path(f"/proc/{worker}").exists() and time.time() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{worker}").exists() or "Z" in Path(f"/proc/{worker}/stat").read_text().split()[2]
    assert w.closed(timeout=10)


def test_host_buffers_ask_for_huge_pages(node: Any) -> None:
    """Decode reads every weight once per token: the node asks for
    transparent huge pages on its buffers (VmFlags "hg" in the worker's smaps)."""
    w = ready(node)
    w.send(lib.TB_CMD_ALLOC_BUFFER, pack("struct tb_alloc_req", size=64 << 20))
    status, body = w.reply()
    assert status == 0, body
    _handle, _base, size = struct.unpack("<QQQ", body[:24])   # base is synthetic: find the buffer by its size
    workers = node_workers(node)
    assert len(workers) == 1, workers
    flagged = []
    for line in Path(f"/proc/{workers[0]}/smaps").read_text().splitlines():
        if "-" in line.split()[0] and ":" not in line.split()[0]:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            big = end - start >= size // 2   # the madvise()d part of the buffer is its own mapping
        elif line.startswith("VmFlags:") and big:
            flagged.append(line.split()[1:])
    assert any("hg" in flags for flags in flagged), flagged


def test_recompute_without_graph(node: Any) -> None:
    w = ready(node)
    w.send(lib.TB_CMD_GRAPH_RECOMPUTE, struct.pack("<I", 3))
    assert "slot 3, which holds no graph" in w.sync_error()
    w.send(lib.TB_CMD_GRAPH_RECOMPUTE, struct.pack("<I", lib.TB_KEPT_GRAPHS))
    assert f"slot {lib.TB_KEPT_GRAPHS}, which holds no graph" in w.sync_error()
    # far past the slots: without the bound the node reads kept[4294967295], gigabytes away
    w.send(lib.TB_CMD_GRAPH_RECOMPUTE, struct.pack("<I", 2**32 - 1))
    assert "slot 4294967295, which holds no graph" in w.sync_error()


def test_a_node_keeps_graphs_in_the_slots_named(node: Any) -> None:
    """Two graphs kept in two slots run again by slot, each its own."""
    w = ready(node)
    handle = w.alloc(4096)
    sqr = ggml_op_index("SQR")
    x = tensor(buffer=handle, offset=0)
    for slot, out_offset in ((0, 64), (5, 128)):
        y = tensor(buffer=handle, offset=out_offset, op=sqr, src=[0] + [-1] * 9, flags=GGML_TENSOR_FLAG_COMPUTE)
        body = bytearray(graph([x, y], [1]))
        struct.pack_into("<I", body, 8, slot)   # tb_graph_header.slot
        w.send(lib.TB_CMD_GRAPH_COMPUTE, bytes(body))
    assert w.sync_error() == ""
    w.send(lib.TB_CMD_SET_TENSOR, pack("struct tb_range", handle=handle, offset=0, size=16) + struct.pack("<4f", 1, 2, 3, 4))
    w.send(lib.TB_CMD_GRAPH_RECOMPUTE, struct.pack("<I", 5))   # only slot 5's graph: out at 128
    w.send(lib.TB_CMD_GET_TENSOR, pack("struct tb_range", handle=handle, offset=0, size=192))
    status, body = w.reply()
    assert status == 0 and w.sync_error() == ""
    values = struct.unpack("<48f", body)
    assert values[32:36] == (1, 4, 9, 16) and values[16:20] != (1, 4, 9, 16), values
    body = bytearray(graph([x, tensor(buffer=handle, offset=64, op=sqr, src=[0] + [-1] * 9,
                                      flags=GGML_TENSOR_FLAG_COMPUTE)], [1]))
    struct.pack_into("<I", body, 8, lib.TB_KEPT_GRAPHS)
    w.send(lib.TB_CMD_GRAPH_COMPUTE, bytes(body))
    assert f"slot {lib.TB_KEPT_GRAPHS} (a node keeps {lib.TB_KEPT_GRAPHS} graphs)" in w.sync_error()


def test_one_bad_client_does_not_disturb_another(node: Any) -> None:
    good = ready(node)
    handle = good.alloc(64)
    good.send(lib.TB_CMD_SET_TENSOR, pack("struct tb_range", handle=handle, offset=0, size=8) + b"12345678")
    bad = ready(node)
    bad.sock.sendall(header(lib.TB_CMD_SYNC, 0, magic=1))
    assert bad.closed()
    good.send(lib.TB_CMD_GET_TENSOR, pack("struct tb_range", handle=handle, offset=0, size=8))
    assert good.reply() == (0, b"12345678")
    # the bad client cannot touch the good client's buffer either
    other = ready(node)
    other.send(lib.TB_CMD_GET_TENSOR, pack("struct tb_range", handle=handle, offset=0, size=8))
    status, body = other.reply()
    assert status != 0 and "unknown buffer handle" in body.decode()


def test_disconnect_frees_the_clients_buffers(node: Any) -> None:
    w = ready(node)
    w.alloc(1 << 20)
    _, before = tbrpc.probe(node.endpoint)
    assert before.bytes_allocated >= 1 << 20
    w.sock.close()
    deadline = time.time() + 5
    while time.time() < deadline and tbrpc.probe(node.endpoint)[1].bytes_allocated:
        time.sleep(0.05)
    assert tbrpc.probe(node.endpoint)[1].bytes_allocated == 0



# ---- model files --------------------------------------------------------------------

def open_file(w: Wire, name: str, size: int = 100) -> int:
    w.send(lib.TB_CMD_OPEN_FILE, pack("struct tb_open_file", size=size, name=name.encode()))
    status, body = w.reply()
    assert status == 0, body
    return struct.unpack("<Q", body)[0]


@pytest.mark.parametrize("name", ["../../etc/passwd", "/etc/passwd", ".hidden.gguf", "notes.txt", "missing.gguf"])
def test_open_file_only_serves_plain_gguf_names_from_model_dirs(nodes: Any, tmp_path: Path, name: str) -> None:
    (tmp_path / "notes.txt").write_text("secret")
    node = nodes(1, "--model-dir", str(tmp_path))[0]
    assert open_file(ready(node), name) == 0


def hello_nonce(w: Wire) -> bytes:
    """HELLO, returning the session's OPEN_FILE challenge."""
    status, body = w.hello()
    assert status == 0, body
    return bytes(ffi.from_buffer("struct tb_hello *", bytearray(body)).file_nonce)


def open_held_file(w: Wire, nonce: bytes, path: Path, name: str | None = None, proof_of: Path | None = None,
                   hash_of: Path | None = None) -> int:
    """OPEN_FILE for `path` as the head does it: size, the proof for this
    session (computed over `proof_of`, by default the file itself) and the
    content hash (of `hash_of`, by default the file itself)."""
    err = ffi.new("char[]", 256)
    size = path.stat().st_size
    proof = ffi.new("uint8_t[16]")
    assert lib.tb_file_proof_path(str(proof_of or path).encode(), size, nonce, proof, err, 256) == 0
    content_hash = ffi.new("uint8_t[32]")
    assert lib.tb_file_hash_path(str(hash_of or path).encode(), ffi.NULL, content_hash, ffi.NULL, err, 256) == 0, ffi.string(err)
    w.send(lib.TB_CMD_OPEN_FILE, pack("struct tb_open_file", size=size, content_hash=bytes(content_hash),
                                      proof=bytes(proof), name=(name or path.name).encode()))
    status, body = w.reply()
    assert status == 0, body
    return struct.unpack("<Q", body)[0]


def sampled_only_copy(real: Path, forged: Path) -> None:
    """What a client knowing only the fingerprint's samples can make: the
    sampled ranges of `real` (model_file.c: first and last MiB, 14 evenly
    spaced 64 KiB samples), zeros elsewhere. Same size, same fingerprint."""
    data = real.read_bytes()
    size, edge, sample = len(data), 1 << 20, 64 << 10
    out = bytearray(size)
    ranges = [(0, edge), (max(size - edge, 0), size)] + [(size // 15 * i, size // 15 * i + sample) for i in range(1, 15)]
    for lo, hi in ranges:
        out[lo:hi] = data[lo:hi]
    forged.write_bytes(bytes(out))


def test_open_file_wants_proof_of_the_whole_file(nodes: Any, tmp_path: Path) -> None:
    served = tmp_path / "served"
    served.mkdir()
    real = served / "m.gguf"
    real.write_bytes(os.urandom(8 << 20))
    forged = tmp_path / "forged.gguf"
    sampled_only_copy(real, forged)
    identity = ffi.new("struct tb_file_identity *")
    forged_identity = ffi.new("struct tb_file_identity *")
    err = ffi.new("char[]", 256)
    assert lib.tbrpc_file_identity(str(real).encode(), identity, err, 256) == 0
    assert lib.tbrpc_file_identity(str(forged).encode(), forged_identity, err, 256) == 0
    assert bytes(identity.fingerprint) == bytes(forged_identity.fingerprint), "the forgery must match the samples"
    node = nodes(1, "--model-dir", str(served))[0]

    w = Wire(node.endpoint)
    nonce = hello_nonce(w)
    assert open_held_file(w, nonce, real, proof_of=forged) == 0
    assert "could not prove it holds the whole file" in node.log_text()
    other = Wire(node.endpoint)
    other_nonce = hello_nonce(other)
    assert other_nonce != nonce
    assert open_held_file(w, other_nonce, real) == 0, "a proof for another session must not open the file"
    assert open_held_file(w, nonce, real) == 1


def test_open_file_serves_only_regular_files_inside_the_model_dirs(nodes: Any, tmp_path: Path) -> None:
    served, elsewhere, second = tmp_path / "served", tmp_path / "elsewhere", tmp_path / "second"
    for d in (served, elsewhere, second):
        d.mkdir()
    (elsewhere / "private.gguf").write_bytes(os.urandom(1 << 20))
    (served / "escape.gguf").symlink_to(elsewhere / "private.gguf")
    (second / "shared.gguf").write_bytes(os.urandom(1 << 20))
    (served / "linked.gguf").symlink_to(second / "shared.gguf")
    os.mkfifo(served / "fifo.gguf")
    node = nodes(1, "--model-dir", str(served), "--model-dir", str(second))[0]
    w = Wire(node.endpoint)
    nonce = hello_nonce(w)
    assert open_held_file(w, nonce, elsewhere / "private.gguf", name="escape.gguf") == 0
    assert "outside the model directories" in node.log_text()
    started = time.monotonic()
    assert open_file(w, "fifo.gguf") == 0            # answered, not blocked on a FIFO with no writer
    assert time.monotonic() - started < 5
    assert "fifo.gguf is not a regular file" in node.log_text()
    assert open_held_file(w, nonce, second / "shared.gguf", name="linked.gguf") == 1


def test_open_file_takes_as_long_whether_or_not_the_file_exists(nodes: Any, tmp_path: Path) -> None:
    (tmp_path / "here.gguf").write_bytes(b"\0" * 4096)
    node = nodes(1, "--model-dir", str(tmp_path))[0]
    w = ready(node)
    for name in ("here.gguf", "absent.gguf"):
        started = time.monotonic()
        assert open_file(w, name) == 0                  # size 100 matches neither
        assert time.monotonic() - started >= 0.010      # the node's floor (node_session.c OPEN_FILE_MIN_NS)


def test_load_from_file_checks_ids_and_ranges(nodes: Any, tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"\0" * 4096)
    node = nodes(1, "--model-dir", str(tmp_path))[0]
    w = Wire(node.endpoint)
    file_id = open_held_file(w, hello_nonce(w), model)
    assert file_id == 1
    handle = w.alloc(8192)
    w.send(lib.TB_CMD_LOAD_FROM_FILE, pack("struct tb_file_range", handle=handle, offset=0, size=4096, file_id=7,
                                           file_offset=0))
    assert "unknown file id 7" in w.sync_error()
    w.send(lib.TB_CMD_LOAD_FROM_FILE, pack("struct tb_file_range", handle=handle, offset=0, size=4096, file_id=0,
                                           file_offset=0))
    assert "unknown file id 0" in w.sync_error()   # ids count from 1: 0 is not the entry before the first
    w.send(lib.TB_CMD_LOAD_FROM_FILE, pack("struct tb_file_range", handle=handle, offset=0, size=4096, file_id=1,
                                           file_offset=1))
    assert "outside m.gguf" in w.sync_error()
    w.send(lib.TB_CMD_LOAD_FROM_FILE, pack("struct tb_file_range", handle=handle, offset=0, size=2, file_id=1,
                                           file_offset=2**64 - 1))   # 4096 - offset wraps: the offset is checked first
    assert f"[{2**64 - 1}, +2) lies outside m.gguf" in w.sync_error()
    w.send(lib.TB_CMD_LOAD_FROM_FILE, pack("struct tb_file_range", handle=handle, offset=8000, size=4096, file_id=1,
                                           file_offset=0))
    assert "outside buffer" in w.sync_error()
    w.send(lib.TB_CMD_LOAD_FROM_FILE, pack("struct tb_file_range", handle=handle, offset=10, size=4096, file_id=1,
                                           file_offset=0))
    assert w.sync_error() == ""


def test_load_from_file_2d_checks_ids_and_ranges(nodes: Any, tmp_path: Path) -> None:
    """LOAD_FROM_FILE_2D reads n_copies rows `file_stride` apart in the file
    into rows `stride` apart in the buffer: the file id, the buffer's rows
    (without wrap-around) and the file's rows are each checked, by name,
    before a byte is read or written; a valid one lands where it says."""
    model = tmp_path / "m.gguf"
    model.write_bytes(bytes(range(256)) * 16)
    node = nodes(1, "--model-dir", str(tmp_path))[0]
    w = Wire(node.endpoint)
    assert open_held_file(w, hello_nonce(w), model) == 1
    handle = w.alloc(4096)

    def load_2d(offset: int = 0, size: int = 4, n_copies: int = 3, stride: int = 8, file_id: int = 1,
                file_offset: int = 0, file_stride: int = 16) -> str:
        w.send(lib.TB_CMD_LOAD_FROM_FILE_2D, struct.pack("<8Q", handle, offset, size, n_copies, stride, file_id, file_offset,
                                                         file_stride))   # tb_file_range_2d
        return w.sync_error()

    assert "LOAD_FROM_FILE_2D: unknown file id 0" in load_2d(file_id=0)
    assert "LOAD_FROM_FILE_2D: unknown file id 2" in load_2d(file_id=2)
    assert f"range [4080, +20) lies outside buffer {handle} of 4096 bytes" in load_2d(offset=4080)
    assert (f"LOAD_FROM_FILE_2D: 3 rows of 4 bytes, {2**63} apart: not a valid set of rows"
            in load_2d(stride=2**63))
    assert "LOAD_FROM_FILE_2D: those rows lie outside m.gguf (4096 bytes)" in load_2d(file_offset=4070)
    assert "LOAD_FROM_FILE_2D: those rows lie outside m.gguf (4096 bytes)" in load_2d(file_stride=2**63)
    assert load_2d(offset=100, file_offset=1) == ""
    w.send(lib.TB_CMD_GET_TENSOR, pack("struct tb_range", handle=handle, offset=100, size=20))
    status, body = w.reply()
    assert status == 0 and body[0:4] == bytes([1, 2, 3, 4]) and body[8:12] == bytes([17, 18, 19, 20]), body
    assert body[16:20] == bytes([33, 34, 35, 36]), body


def test_a_spawned_worker_imports_its_nodes_tbrpc(nodes: Any, tmp_path: Path) -> None:
    """A node started from a directory holding another tbrpc (a source
    checkout without its built extension) must not hand its clients to that
    tbrpc's worker: the worker imports exactly the package the node runs."""
    decoy = tmp_path / "checkout"
    (decoy / "tbrpc").mkdir(parents=True)
    marker = tmp_path / "decoy-ran"
    (decoy / "tbrpc" / "__init__.py").write_text("")
    (decoy / "tbrpc" / "_worker.py").write_text(
        f"import pathlib, sys\npathlib.Path({str(marker)!r}).write_text('x')\nsys.exit(3)\n")
    node = nodes(1, "--isolation", "spawn", cwd=decoy)[0]
    w = ready(node)
    handle = w.alloc(4096)
    w.send(lib.TB_CMD_SET_TENSOR, pack("struct tb_range", handle=handle, offset=0, size=4) + b"abcd")
    w.send(lib.TB_CMD_GET_TENSOR, pack("struct tb_range", handle=handle, offset=0, size=4))
    assert w.reply() == (0, b"abcd")
    assert not marker.exists()


@pytest.mark.parametrize("env_value,expected", [(None, "shm "), ("tcp", "tcp: asked for"), ("auto", "shm "),
                                                ("rdma", "TBRPC_TRANSPORT=rdma: choose one of auto, tcp")])
def test_the_head_chooses_its_transport(env_value: str | None, expected: str, nodes: Any) -> None:
    """A node on this host gets shared memory unless TBRPC_TRANSPORT=tcp; the
    node info says what carries the bytes and why."""
    (node,) = nodes(1)
    code = ("import tbrpc\n"
            "try:\n"
            f"    tbrpc.connect([{node.endpoint!r}])\n"
            "    print(tbrpc.cluster().nodes()[0].transport)\n"
            "except ValueError as e:\n    print(e)\n")
    env = {k: v for k, v in os.environ.items() if k != "TBRPC_TRANSPORT"}
    if env_value is not None:
        env["TBRPC_TRANSPORT"] = env_value
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env,
                          cwd=Path(__file__).resolve().parent.parent)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(expected), proc.stdout


def test_a_graph_stops_when_its_client_goes(node: Any) -> None:
    """A client that sends a long graph and leaves does not keep the node
    computing for nobody: the device's abort check sees the closed
    connection, the worker logs why and ends."""
    w = ready(node)
    n = 1024
    handle = w.alloc(3 * n * n * 4)
    w.alloc(32 << 20)   # 2000 products of 2^30 need 32 MiB more held (op_rules.h: 65536 element operations per byte)
    mul_mat = ggml_op_index("MUL_MAT")
    square = dict(buffer=handle, ne=[n, n, 1, 1], nb=[4, 4 * n, 4 * n * n, 4 * n * n])
    tensors = [tensor(**square, offset=0), tensor(**square, offset=4 * n * n)]   # W, x0
    for i in range(2000):   # x(i+1) = W x(i), in two alternating places: minutes of one thread's work
        tensors.append(tensor(**square, offset=4 * n * n * (1 + (i + 1) % 2), op=mul_mat, flags=GGML_TENSOR_FLAG_COMPUTE,
                              src=[0, len(tensors) - 1] + [-1] * 8))
    w.send(lib.TB_CMD_GRAPH_COMPUTE, graph(tensors, list(range(2, len(tensors)))))
    time.sleep(1.0)   # it is computing, its buffers held
    held = 3 * n * n * 4 + (32 << 20)
    assert tbrpc.probe(node.endpoint, timeout=5)[1].bytes_allocated >= held
    w.sock.close()
    deadline = time.monotonic() + 15
    while tbrpc.probe(node.endpoint, timeout=5)[1].bytes_allocated >= held and time.monotonic() < deadline:
        time.sleep(0.2)
    assert tbrpc.probe(node.endpoint, timeout=5)[1].bytes_allocated == 0, "still computing for a client that left"
    assert "graph compute stopped: the client has gone" in node.log_text()


def test_allreduce_refuses_missing_links_and_ids_out_of_range(node: Any) -> None:
    """ALLREDUCE on a session without links: a ring names the two links it
    needs (to the next node, from the previous one) and their ids; a mesh the
    first pair it lacks; node counts, places, sizes and flags out of range are
    refused by name; the session serves on."""
    w = ready(node)
    handle = w.alloc(64)
    ring = lib.TB_ALLREDUCE_COMPUTED | lib.TB_ALLREDUCE_RING

    def allreduce(**changes: Any) -> str:
        fields: dict[str, Any] = dict(handle=handle, offset=0, size=64, type=0, flags=ring, n=4, self=1)
        w.send(lib.TB_CMD_ALLREDUCE, pack("struct tb_allreduce", **{**fields, **changes}))
        error = w.sync_error()   # "earlier ALLREDUCE (request N) failed: <the error>"
        assert error.startswith("earlier ALLREDUCE (request "), error
        return error.split(" failed: ", 1)[1]

    assert allreduce() == ("ALLREDUCE (ring): node 1 of 4 has no link to the next node 2 (peer id 0) "
                           "or from the previous node 0 (peer id 0)")
    assert "next node 2 (peer id 7) or from the previous node 0 (peer id 1)" in allreduce(
        peer_out=[0, 0, 7] + [0] * 13, peer_in=[1] + [0] * 15)
    assert "node 3 of 4 has no link to the next node 0 (peer id 0) or from the previous node 2" in allreduce(self=3)
    assert allreduce(flags=lib.TB_ALLREDUCE_COMPUTED) == "ALLREDUCE: no link to and from node 0 (peer ids 0, 0)"
    assert allreduce(n=lib.TB_MAX_ALLREDUCE_NODES + 1) == "ALLREDUCE: node 1 of 17 (2 to 16 nodes)"
    assert allreduce(self=4) == "ALLREDUCE: node 4 of 4 (2 to 16 nodes)"
    assert allreduce(n=1, self=0) == "ALLREDUCE: node 0 of 1 (2 to 16 nodes)"
    assert allreduce(flags=ring | 4) == "ALLREDUCE: unknown flags 0x7"
    assert "ALLREDUCE: 62 bytes of type 0" in allreduce(size=62)
    assert w.sync_error() == ""   # the session serves on


def test_a_transport_switch_of_the_wrong_length_is_refused(nodes: Any) -> None:
    """TRANSPORT_SWITCH reads its u32 outside the generic length rule (the head
    switches right after it). One without its 4 bytes, sent once a large
    message's scratch was freed (node_session.c, SCRATCH_IDLE), read the u32
    through a NULL scratch: under --isolation thread the whole node died of
    SIGSEGV. It is refused by name and only that connection ends."""
    node = nodes(1, "--isolation", "thread")[0]
    w = ready(node)
    size = 5 << 20   # over the 4 MiB of scratch always kept
    req = pack("struct tb_range", handle=12345, offset=0, size=size)   # unknown handle: read, then refused
    w.sock.sendall(header(lib.TB_CMD_SET_TENSOR, len(req) + size, 99) + req + b"\0" * size)
    assert "unknown buffer handle 12345" in w.sync_error()
    for _ in range(20):   # a run of small requests later the scratch is freed
        w.sync_error()
    for payload in (b"", b"\x01\x00"):
        w.send(lib.TB_CMD_TRANSPORT_SWITCH, payload)
        assert w.closed(timeout=20)
        deadline = time.monotonic() + 5   # the log line comes as the node drops the connection
        while "expected 4" not in node.log_text() and node.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert node.proc.poll() is None, f"node process died ({node.proc.returncode})"
        assert f"TRANSPORT_SWITCH: payload is {len(payload)} bytes, expected 4" in node.log_text()
        w = ready(node)
    assert w.alloc(64)
