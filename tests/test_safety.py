"""The node's memory safety: op rules, index checks,
handles on the wire, the client table, allocation bounds.

tests/c/safety_tests.c runs the node's graph path (proto.c decoding, the op
rules, the device's supports_op, tb_graph_compute_checked) over random graphs
for every allowed op against buffers between guard pages; it is built with
TB_OP_RULES_TESTING so that one rule family can be switched off, which must
make the same property fail. The rest speaks the wire to a running node.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import tbrpc
from tbrpc import secret as cluster_secret
from tbrpc._build import build_program
from tbrpc.native import load
from wire import GGML_TENSOR_FLAG_COMPUTE, ggml_op_index, graph, node_workers, pack, ready, tensor

ffi, lib = load()

# op_rules.h, TB_OP_RULES_TESTING: the rule families a run may switch off
RULE_FAMILIES = {"op_params": 1, "shapes": 2, "layout": 4, "indices": 8, "sources": 16}
TB_FAKE_BASE, TB_FAKE_BASE_GAP = 1 << 44, 1 << 30   # proto.h


@pytest.fixture(scope="module")
def safety_tests(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_program(Path(__file__).parent / "c" / "safety_tests.c", tmp_path_factory.mktemp("c") / "safety_tests",
                         defines=("TB_OP_RULES_TESTING",))


def run(program: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, GGML_NO_BACKTRACE="1")   # an abort must not start gdb
    return subprocess.run([str(program), *args], capture_output=True, text=True, timeout=600, env=env)


@pytest.mark.parametrize("seed", ["1", "2", "3"])
def test_random_graphs_never_touch_memory_outside_their_buffers(safety_tests: Path, seed: str) -> None:
    """20,000 graphs per seed, every allowed op: each refused, or run without a
    fault, an abort or a changed canary; every op both runs and is refused."""
    proc = run(safety_tests, "property", seed, "20000")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "PASS property" in proc.stdout


@pytest.mark.parametrize("family", list(RULE_FAMILIES))
def test_without_a_rule_family_the_property_fails(safety_tests: Path, family: str) -> None:
    """The negative test: the same generator, one family of rules off, and
    graphs reach memory outside their buffers or a ggml abort."""
    proc = run(safety_tests, "property", "1", "20000", str(RULE_FAMILIES[family]))
    assert proc.returncode != 0, f"the property held with the {family} rules off:\n{proc.stdout[-2000:]}"
    assert "FAULT signal" in proc.stderr or "CANARY" in proc.stderr, proc.stderr[-2000:]


def test_the_reported_attacks_are_refused_by_name(safety_tests: Path) -> None:
    proc = run(safety_tests, "attacks")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in ("SET wrap-around", "SET rows wrapping 64 bits", "ACC +-2 GiB", "PAD overlapping rows", "ROLL out of range", "NULL source",
                 "nb[1] = 0 output", "SOFT_MAX sinks nb[0] = 0", "FLASH_ATTN sinks nb[0] = 0", "op off the list",
                 "ROPE n_dims past the row", "ROPE too few positions", "SOFT_MAX mask too few rows",
                 "FLASH_ATTN mask short of n_kv", "GET_ROWS past the slices", "SET_ROWS rows too short",
                 "CONCAT dimension 7", "PAD negative padding", "ADD_ID too few ids"):
        assert f"refused {name}" in proc.stdout


def test_bad_row_indices_are_refused_before_the_op(safety_tests: Path) -> None:
    proc = run(safety_tests, "bad_indices")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS bad_indices" in proc.stdout
    # and without the run-time check, the same graph reaches ggml's abort (or worse)
    assert run(safety_tests, "bad_indices", str(RULE_FAMILIES["indices"])).returncode != 0


def test_expert_ids_computed_in_the_graph_are_checked_before_use(safety_tests: Path) -> None:
    """TOP_K makes the ids MUL_MAT_ID reads: the graph runs in two segments
    and the ids are checked in between (valid ones run, bad ones are refused)."""
    proc = run(safety_tests, "produced_indices")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS produced_indices" in proc.stdout
    assert run(safety_tests, "produced_indices", str(RULE_FAMILIES["indices"])).returncode != 0


# ---- over the wire ------------------------------------------------------------------

def test_alloc_buffer_reply_carries_no_address(nodes: Any) -> None:
    node = nodes(1)[0]
    w = ready(node)
    bases = []
    for size in (4096, 1 << 20, 4096):
        w.send(lib.TB_CMD_ALLOC_BUFFER, pack("struct tb_alloc_req", size=size))
        status, body = w.reply()
        assert status == 0
        _handle, base, _size = struct.unpack("<QQQ", body[:24])
        bases.append(base)
    # synthetic: the documented sequence, identical for every client and worker
    assert bases[0] == TB_FAKE_BASE
    assert all(b % TB_FAKE_BASE_GAP == 0 for b in bases) and len(set(bases)) == 3
    maps = Path(f"/proc/{node_workers(node)[0]}/maps").read_text() if Path("/proc").exists() else ""
    for line in maps.splitlines():
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        assert not any(lo <= b < hi for b in bases), line


def test_a_client_may_not_allocate_more_than_the_device_has(nodes: Any) -> None:
    node = nodes(1)[0]
    w = ready(node)
    w.send(lib.TB_CMD_GET_MEMORY)
    status, body = w.reply()
    total = struct.unpack("<QQ", body)[1]
    w.send(lib.TB_CMD_ALLOC_BUFFER, pack("struct tb_alloc_req", size=1 << 40))   # 1 TiB
    status, body = w.reply()
    assert status != 0 and "refused" in body.decode() and str(total) in body.decode(), body
    # nor in pieces: what it already holds counts
    w.alloc(total // 2)
    w.send(lib.TB_CMD_ALLOC_BUFFER, pack("struct tb_alloc_req", size=total // 2 + (1 << 30)))
    status, body = w.reply()
    assert status != 0 and "would hold" in body.decode(), body


def test_repeated_node_indices_are_refused(nodes: Any) -> None:
    node = nodes(1)[0]
    w = ready(node)
    h = w.alloc(4096)
    a = tensor(buffer=h, offset=0)
    s = tensor(buffer=h, offset=64, op=ggml_op_index("SQR"), src=[0] + [-1] * 9, flags=GGML_TENSOR_FLAG_COMPUTE)
    w.send(lib.TB_CMD_GRAPH_COMPUTE, graph([a, s], [1] * 1000))
    error = w.sync_error()
    assert "node 1 repeats tensor 1" in error, error


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads a worker's mappings through /proc")
@pytest.mark.parametrize("isolation", ["process", "spawn"])
def test_a_worker_can_write_only_its_own_counters(nodes: Any, isolation: str) -> None:
    """The client table: a worker maps it read-only, except its own counters
    page; in_use and pid live in the node's private memory."""
    node = nodes(1, "--isolation", isolation)[0]
    w = ready(node)
    w.alloc(4096)
    (worker,) = node_workers(node)
    table = [line for line in Path(f"/proc/{worker}/maps").read_text().splitlines() if "/tbrpc-" in line]
    assert table, "the status table is not mapped"
    writable = [line for line in table if line.split()[1].startswith("rw")]
    page = os.sysconf("SC_PAGE_SIZE")
    assert len(writable) == 1, table
    lo, hi = (int(x, 16) for x in writable[0].split()[0].split("-"))
    assert hi - lo == page, writable
    # the descriptor is closed: the worker cannot map it again writable
    fds = [os.readlink(f"/proc/{worker}/fd/{fd}") for fd in os.listdir(f"/proc/{worker}/fd")]
    assert not any("/tbrpc-" in target for target in fds), fds
    # STATUS still adds up everyone's counters
    w.send(lib.TB_CMD_STATUS)
    status, body = w.reply()
    assert status == 0
    buffers, allocated, clients = struct.unpack("<QQQ", body[:24])
    assert (buffers, clients) == (1, 1) and allocated >= 4096


def test_scratch_shrinks_after_a_large_message(nodes: Any) -> None:
    """A rejected 200 MiB SET_TENSOR must not pin 200 MiB of scratch."""
    node = nodes(1, "--isolation", "process")[0]
    w = ready(node)
    w.alloc(4096)
    (worker,) = node_workers(node)

    def rss() -> int:
        return int(next(line for line in Path(f"/proc/{worker}/status").read_text().splitlines()
                        if line.startswith("VmRSS")).split()[1]) * 1024

    size = 200 << 20
    req = pack("struct tb_range", handle=12345, offset=0, size=size)   # unknown handle: read, then refused
    w.sock.sendall(struct.pack("<IHHQQ", lib.TB_MAGIC, lib.TB_CMD_SET_TENSOR, 0, 99, len(req) + size) + req)
    chunk = b"\0" * (1 << 20)
    for _ in range(size >> 20):
        w.sock.sendall(chunk)
    w.sync_error()
    for _ in range(20):   # a run of small requests later (node_session.c, SCRATCH_IDLE), the scratch is gone
        w.sync_error()
    assert rss() < 100 << 20, rss()


# ---- --isolation thread ------------------------------------------------------------------

def test_thread_isolation_survives_a_null_source(nodes: Any) -> None:
    """A MUL_MAT without its second source would segfault the whole node when
    clients are served by threads: the rules refuse it, also when asked through
    SUPPORTS_OP (whose device answer dereferences the sources)."""
    node = nodes(1, "--isolation", "thread")[0]
    w = ready(node)
    h = w.alloc(4096)
    a = tensor(buffer=h, offset=0, ne=[4, 2, 1, 1], nb=[4, 16, 32, 32])
    mm = tensor(buffer=h, offset=256, ne=[2, 1, 1, 1], nb=[4, 8, 8, 8], op=ggml_op_index("MUL_MAT"),
                src=[0] + [-1] * 9, flags=GGML_TENSOR_FLAG_COMPUTE)
    w.send(lib.TB_CMD_GRAPH_COMPUTE, graph([a, mm], [1]))
    error = w.sync_error()
    assert "tensor 1 (MUL_MAT" in error and "source 1 is missing" in error, error
    shapes_only = [tensor(ne=[4, 2, 1, 1], nb=[4, 16, 32, 32]),
                   tensor(ne=[2, 1, 1, 1], nb=[4, 8, 8, 8], op=ggml_op_index("MUL_MAT"), src=[0] + [-1] * 9)]
    w.send(lib.TB_CMD_SUPPORTS_OP, graph(shapes_only, []))
    assert w.reply() == (0, b"\x00")
    assert node.proc.poll() is None
    assert ready(node).alloc(64)


def test_thread_isolation_hands_out_cleared_buffers(nodes: Any) -> None:
    """Threads share one heap: a buffer another client freed must not reach
    the next one with its bytes."""
    node = nodes(1, "--isolation", "thread")[0]
    size = 4096
    first = ready(node)
    h = first.alloc(size)
    secret = b"\xa5" * size
    first.sock.sendall(struct.pack("<IHHQQ", lib.TB_MAGIC, lib.TB_CMD_SET_TENSOR, 0, 77, 24 + size)
                       + pack("struct tb_range", handle=h, offset=0, size=size) + secret)
    assert first.sync_error() == ""
    first.send(lib.TB_CMD_FREE_BUFFER, struct.pack("<Q", h))
    assert first.sync_error() == ""
    second = ready(node)
    for _ in range(4):   # whichever allocation the heap hands back
        h2 = second.alloc(size)
        second.send(lib.TB_CMD_GET_TENSOR, pack("struct tb_range", handle=h2, offset=0, size=size))
        status, body = second.reply()
        assert status == 0 and body == b"\0" * size


# ---- graph cost (op_rules.h tb_op_cost, node_graphs.c check_cost) -------------------

MIB = 1 << 20
COST_PER_BYTE = 65536   # op_rules.h TB_COST_PER_BYTE


def costly_mul_mat(h: int, flags: int) -> bytes:
    """Three tensors, ~700 bytes: a 4096 x 1024 product over rows of 2^21
    floats. The sources repeat one 8 MiB row (nb[1] = 0 is fine for a
    source), the result fills 16 MiB: every tensor lies in its buffer, and
    the work is 4096 * 1024 * 2^21 = 2^43 multiply-adds."""
    k = 1 << 21
    a = tensor(buffer=h, offset=0, ne=[k, 4096, 1, 1], nb=[4, 0, 4 * k, 4 * k])
    b = tensor(buffer=h, offset=0, ne=[k, 1024, 1, 1], nb=[4, 0, 4 * k, 4 * k])
    out = tensor(buffer=h, offset=16 * MIB, ne=[4096, 1024, 1, 1], nb=[4, 4 * 4096, 16 * MIB, 16 * MIB],
                 op=ggml_op_index("MUL_MAT"), src=[0, 1] + [-1] * 8, flags=flags)
    return graph([a, b, out], [2])


def test_a_small_graph_of_enormous_cost_is_refused_at_validation(nodes: Any) -> None:
    node = nodes(1)[0]
    w = ready(node)
    h = w.alloc(32 * MIB)
    message = costly_mul_mat(h, GGML_TENSOR_FLAG_COMPUTE)
    assert len(message) < 1024, len(message)
    w.send(lib.TB_CMD_GRAPH_COMPUTE, message)
    error = w.sync_error()
    limit = 32 * MIB * COST_PER_BYTE
    assert f"GRAPH_COMPUTE: the graph costs {1 << 43} element operations, over this client's limit of {limit}" in error, error
    w.send(lib.TB_CMD_STATUS)
    status, body = w.reply()
    assert status == 0 and ffi.from_buffer("struct tb_status *", bytearray(body)).graphs_computed == 0


def test_a_kept_graph_never_outlives_the_limit_it_was_checked_against(nodes: Any) -> None:
    """The limit follows the buffers a client holds. A graph accepted while
    it held 128 MiB runs again by GRAPH_RECOMPUTE (checked again each time);
    freeing a buffer, the only way the limit shrinks, drops the kept graphs,
    so a costly graph cannot be kept past the memory that paid for it.
    (The product is not flagged for computing, so the CPU backend skips it:
    the cost counts every node the client sends, flagged or not.)"""
    node = nodes(1)[0]
    w = ready(node)
    h = w.alloc(32 * MIB)
    extra = w.alloc(96 * MIB)
    w.send(lib.TB_CMD_GRAPH_COMPUTE, costly_mul_mat(h, 0))
    assert w.sync_error() == ""
    w.send(lib.TB_CMD_GRAPH_RECOMPUTE, struct.pack("<I", 0))
    assert w.sync_error() == ""
    w.send(lib.TB_CMD_FREE_BUFFER, struct.pack("<Q", extra))
    w.send(lib.TB_CMD_GRAPH_RECOMPUTE, struct.pack("<I", 0))
    assert "slot 0, which holds no graph" in w.sync_error()
    w.send(lib.TB_CMD_GRAPH_COMPUTE, costly_mul_mat(h, 0))
    assert f"over this client's limit of {32 * MIB * COST_PER_BYTE}" in w.sync_error()


# ---- a hostile node, seen from the head ----------------------------------------------

def fake_node(alloc_reply: Any = None, caps: int = 0, answers: dict[int, Any] | None = None,
              alignment: int = 32) -> tuple[Any, int]:
    """A listener that speaks just enough of a node for a head to connect and
    allocate: a HELLO reply with `caps` and `alignment`, ALLOC_BUFFER answered by
    alloc_reply(size) -> (handle, base, size), and `answers`: command ->
    function(payload) -> reply body (None: no reply; a tuple (command, id offset,
    body): a reply labelled with another command or id). Returns (socket, port)."""
    import socket
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def serve() -> None:
        conn, _ = srv.accept()

        def exactly(n: int) -> bytes:
            data = b""
            while len(data) < n:
                chunk = conn.recv(n - len(data))
                if not chunk:
                    raise EOFError
                data += chunk
            return data

        def reply(cmd: int, req_id: int, body: bytes) -> None:
            conn.sendall(struct.pack("<IHHQQ", lib.TB_MAGIC, cmd, 1, req_id, 8 + len(body)) + struct.pack("<iI", 0, 0) + body)

        try:
            while True:
                _magic, cmd, _flags, req_id, length = struct.unpack("<IHHQQ", exactly(24))
                payload = exactly(length)
                if answers and cmd in answers:
                    body = answers[cmd](payload)
                    if isinstance(body, tuple):   # (command, id offset, body): a reply labelled otherwise
                        label, offset, body = body
                        conn.sendall(struct.pack("<IHHQQ", lib.TB_MAGIC, label, 1, req_id + offset, 8 + len(body))
                                     + struct.pack("<iI", 0, 0) + body)
                    elif body is not None:
                        reply(cmd, req_id, body)
                elif cmd == lib.TB_CMD_HELLO:
                    hello = ffi.new("struct tb_hello *")
                    lib.tb_abi_fill(ffi.addressof(hello.abi))
                    hello.ggml_build = ffi.from_buffer("struct tb_hello *", payload).ggml_build
                    hello.mem_free = hello.mem_total = 1 << 30
                    hello.alignment, hello.max_size, hello.caps = alignment, 1 << 40, caps
                    hello.device_name, hello.node_name, hello.node_id = b"Fake", b"fake", bytes(range(16))
                    reply(cmd, req_id, bytes(ffi.buffer(hello)))
                elif cmd == lib.TB_CMD_ALLOC_BUFFER:
                    reply(cmd, req_id, struct.pack("<QQQ", *alloc_reply(struct.unpack("<Q", payload)[0])))
                elif cmd == lib.TB_CMD_STATUS:
                    reply(cmd, req_id, b"\0" * ffi.sizeof("struct tb_status"))
                elif not lib.tb_cmd_posted(cmd):
                    reply(cmd, req_id, b"")
        except (EOFError, OSError):
            pass
        finally:
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    return srv, srv.getsockname()[1]


HEAD_ALLOCATES = """
import ctypes, os, sys, llama_cpp, tbrpc
names = tbrpc.connect(["127.0.0.1:%d"], transport="tcp")
libdir = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
ggml, base = (ctypes.CDLL(os.path.join(libdir, name)) for name in ("libggml.so.0", "libggml-base.so.0"))
for lib, name, args in ((ggml, "ggml_backend_dev_by_name", [ctypes.c_char_p]),
                        (base, "ggml_backend_dev_buffer_type", [ctypes.c_void_p]),
                        (base, "ggml_backend_buft_alloc_buffer", [ctypes.c_void_p, ctypes.c_size_t]),
                        (base, "ggml_backend_buffer_get_base", [ctypes.c_void_p])):
    getattr(lib, name).restype, getattr(lib, name).argtypes = ctypes.c_void_p, args
buft = base.ggml_backend_dev_buffer_type(ggml.ggml_backend_dev_by_name(names[0].encode()))
buf = base.ggml_backend_buft_alloc_buffer(buft, 1 << 20)
if buf:
    print("base", base.ggml_backend_buffer_get_base(buf), flush=True)   # what every ggml allocator asks first
print("failed:", tbrpc.cluster().exception(0) if tbrpc.cluster().failed_indexes() else "no", flush=True)
"""


def head_process(code: str, srv: Any) -> subprocess.CompletedProcess[str]:
    """A head process running `code` against a fake node (fake_node's server `srv`, closed after)."""
    try:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                              cwd=Path(__file__).resolve().parent.parent, env=dict(os.environ, GGML_NO_BACKTRACE="1"))
    finally:
        srv.close()


def head_allocates_from(answer: Any, answers: dict[int, Any] | None = None) -> subprocess.CompletedProcess[str]:
    """A head process allocating one buffer on a fake node that answers ALLOC_BUFFER with `answer(asked)`
    (or as `answers` says: fake_node)."""
    srv, port = fake_node(answer, answers=answers)
    return head_process(HEAD_ALLOCATES % port, srv)


@pytest.mark.parametrize("base,size", [(0, 1 << 20), (TB_FAKE_BASE + 1, 1 << 20), (2**64 - 4096, 1 << 20),
                                       (TB_FAKE_BASE, 4096)], ids=["null", "unaligned", "wraps", "short"])
def test_a_node_cannot_hand_the_head_an_address_ggml_aborts_on(base: int, size: int) -> None:
    """ALLOC_BUFFER's base is the head's ggml address of the buffer. A node
    that answered base 0 aborted the head's process (ggml_backend_buffer_get_base:
    "backend buffer base cannot be NULL"); one whose base + size wraps would
    abort it in ggml_backend_tensor_alloc. The head refuses such a reply (and
    an unaligned base, or less than it asked for): no buffer, the node failed
    with the reason, the process lives."""
    proc = head_allocates_from(lambda asked: (1, base, size))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "base" not in proc.stdout.split("failed:")[0], proc.stdout
    assert "failed during ALLOC_BUFFER: a buffer of 1048576 bytes came back as" in proc.stdout, proc.stdout
    assert "not a range ggml can address" in proc.stdout


@pytest.mark.parametrize("alignment", [0, 48])
def test_a_node_whose_hello_gives_no_usable_alignment_is_refused(alignment: int) -> None:
    """The head checks every ALLOC_BUFFER base against the alignment the
    node's HELLO gave (base % alignment): 0 would end the head's process with
    SIGFPE at the first buffer, and one that is not a power of two is no
    alignment ggml knows. The handshake refuses it, naming the value."""
    srv, port = fake_node(lambda asked: (1, TB_FAKE_BASE, asked), alignment=alignment)
    code = (f"import tbrpc\ntry:\n    tbrpc.connect(['127.0.0.1:{port}'], transport='tcp')\n"
            "except tbrpc.NodeError as e:\n    print('refused:', e, flush=True)\n")
    proc = head_process(code, srv)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"handshake: invalid alignment {alignment}" in proc.stdout, proc.stdout


BAD_REPLIES = {   # an ALLOC_BUFFER reply: (command, id offset, body), and what the head says
    "longer": ((lib.TB_CMD_ALLOC_BUFFER, 0, struct.pack("<4Q", 1, TB_FAKE_BASE, 1 << 20, 0)), "reply of 32 bytes, expected 24"),
    "another command": ((lib.TB_CMD_STATUS, 0, struct.pack("<3Q", 1, TB_FAKE_BASE, 1 << 20)), "out-of-order reply (STATUS #"),
    "another id": ((lib.TB_CMD_ALLOC_BUFFER, 1, struct.pack("<3Q", 1, TB_FAKE_BASE, 1 << 20)), "out-of-order reply (ALLOC_BUFFER #"),
}


@pytest.mark.parametrize("case", list(BAD_REPLIES))
def test_a_reply_the_head_did_not_ask_for_fails_the_node(case: str) -> None:
    """A reply is believed only with the command, id and length of the
    request it answers (client_node.c, node_call_reply_locked): otherwise the
    head would take another message's bytes for this one, or leave some to be
    read as the next header. The node fails with the reason; no buffer."""
    body, expected = BAD_REPLIES[case]
    proc = head_allocates_from(None, answers={lib.TB_CMD_ALLOC_BUFFER: lambda payload: body})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "base" not in proc.stdout.split("failed:")[0], proc.stdout
    assert f"failed during ALLOC_BUFFER: {expected}" in proc.stdout, proc.stdout


def test_a_node_that_answers_alloc_buffer_well_is_believed() -> None:
    """The same fake node, answering as a node does, gives the head its buffer."""
    proc = head_allocates_from(lambda asked: (1, TB_FAKE_BASE, asked))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"base {TB_FAKE_BASE}" in proc.stdout and "failed: no" in proc.stdout, proc.stdout


SHM_MAGIC, TB_CAP_SHM = 0x314D485342525442, 4   # transport/shm.c, proto.h


def test_the_head_maps_no_shared_memory_but_its_own_users() -> None:
    """A node on the head's host offers a shared-memory segment by name. A
    hostile one (another user's process on a port the head was told) offered
    a segment of its own, writable by anyone and owned by its user: the head
    mapped it, switched, and the node truncated it under the head's ring: the
    head's next request died of SIGBUS. The head maps only a segment of its
    own user that no one else may write; this one leaves it on TCP, saying why."""
    import secrets

    name = f"/tbrpc-{secrets.token_hex(8)}"
    path = Path("/dev/shm") / name[1:]
    slots, stride = 4, 4096
    nonce = secrets.token_bytes(16)

    def offer(payload: bytes) -> bytes:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
        os.fchmod(fd, 0o666)   # whoever may open it (the umask does not decide for a hostile node)
        if os.geteuid() == 0:
            os.fchown(fd, 65534, 65534)   # and another user's
        os.ftruncate(fd, 4096 + 2 * slots * stride)
        os.pwrite(fd, struct.pack("<Q16sII", SHM_MAGIC, nonce, slots, stride), 0)
        os.close(fd)
        return struct.pack("<II16s32s", slots, stride, nonce, name.encode()) + b"\0" * (160 + 8)

    def switch(payload: bytes) -> None:
        if payload == struct.pack("<I", 1):
            os.truncate(path, 0)   # under the head's mapping
        return None

    srv, port = fake_node(caps=TB_CAP_SHM, answers={lib.TB_CMD_TRANSPORT_OFFER: offer, lib.TB_CMD_TRANSPORT_SWITCH: switch})
    code = (f"import tbrpc\ntbrpc.connect(['127.0.0.1:{port}'], transport='auto')\n"
            "print('transport:', tbrpc.cluster().nodes()[0].transport, flush=True)\n"
            "print('clients:', tbrpc.cluster().status(0).clients, flush=True)\n")
    try:
        proc = head_process(code, srv)
    finally:
        path.unlink(missing_ok=True)
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    assert f"transport: tcp: shared memory {name} is not this user's alone" in proc.stdout, proc.stdout
    assert "clients: 0" in proc.stdout


@pytest.mark.parametrize("right", [False, True])
def test_a_node_that_does_not_prove_the_secret_is_refused_by_the_head(tmp_path: Path, right: bool) -> None:
    """The node answers AUTH with its own MAC over both nonces: a node that
    cannot (one that knows not the secret, or replays another session's
    answer) is refused with AuthenticationError naming it, before the head
    believes a word of its HELLO; the right MAC is accepted."""
    key = cluster_secret.new(tmp_path / "secret")
    heard: dict[str, bytes] = {}

    def hello(payload: bytes) -> bytes:
        heard["head_nonce"] = bytes(ffi.from_buffer("struct tb_hello *", payload).nonce)
        rep = ffi.new("struct tb_hello *")
        lib.tb_abi_fill(ffi.addressof(rep.abi))
        rep.ggml_build = ffi.from_buffer("struct tb_hello *", payload).ggml_build
        rep.caps, rep.nonce = lib.TB_CAP_AUTH, b"\x07" * 32
        return bytes(ffi.buffer(rep))

    def auth(payload: bytes) -> bytes:
        node_mac = ffi.new("uint8_t[32]")
        k = cluster_secret.read(key)
        lib.tb_auth_mac(k, len(k), b"tbrpc 4 node", heard["head_nonce"], b"\x07" * 32, ffi.NULL, 0, node_mac)
        mac = bytes(node_mac) if right else bytes(node_mac)[:31] + bytes([node_mac[31] ^ 1])   # the last byte wrong
        rep = ffi.new("struct tb_hello *")
        lib.tb_abi_fill(ffi.addressof(rep.abi))
        rep.mem_free = rep.mem_total = 1 << 30
        rep.alignment, rep.max_size, rep.caps = 32, 1 << 40, lib.TB_CAP_AUTH
        rep.device_name, rep.node_name, rep.node_id = b"Fake", b"fake", bytes(range(16))
        return mac + bytes(ffi.buffer(rep))

    srv, port = fake_node(answers={lib.TB_CMD_HELLO: hello, lib.TB_CMD_AUTH: auth})
    try:
        if right:
            info, _ = tbrpc.probe(f"127.0.0.1:{port}", timeout=5, secret_file=key)
            assert info.node_name == "fake"
        else:
            with pytest.raises(tbrpc.AuthenticationError) as raised:
                tbrpc.probe(f"127.0.0.1:{port}", timeout=5, secret_file=key)
            assert str(raised.value) == (f"tbrpc node 127.0.0.1:{port}: authentication failed: the node does not know "
                                         "this head's secret"), str(raised.value)
    finally:
        srv.close()
