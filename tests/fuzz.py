"""A structure-aware protocol fuzzer for `tbrpc node`.

Each connection says a valid HELLO, then sends mutated requests: every
command with its request struct's fields drawn from values that matter
(0, 1, the handles of real buffers, sizes around those buffers, 2^63,
2^64-1), graphs of one to eight tensors for the ops llama.cpp's graphs use
(shapes, strides, op params, sources and views mutated), and plain garbage,
sometimes with a payload shorter than its header says. After every request
that wants an answer, and every few posted ones (by a SYNC), the node must
answer or close the connection within HANG_S: anything else is a hang.

    python -m tests.fuzz --frames 1000000 [--seed N] [--jobs J] [--node HOST:PORT]

starts a node of its own (unless given one) and prints what it found:
frames, connections, node deaths, hangs, worker crashes (from the node's
log) and the node's RSS before and after. `--jobs J` runs J fuzzing
processes at once against the node (seeds N..N+J-1), each printing its
progress. tests/test_fuzz.py runs a bounded campaign in the suite.

Where the time goes, and why it is spent this way: a new connection costs
the node a worker (a fork) and a HELLO, so the commands after which the
stream cannot go on (HELLO, AUTH, KEEPALIVE, TRANSPORT_SWITCH, a payload
shorter than its header) are drawn less often than the others, as is
OPEN_FILE, whose answer always takes at least 10 ms (node_files.c); every
one of them is still drawn tens of thousands of times in 10^6 frames.
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing
import os
import random
import re
import socket
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tbrpc.native import load
from tbrpc.node_processes import listening_port
from tbrpc.spec import split_endpoint

HEADER = struct.Struct("<IHHQQ")
HANG_S = 20.0              # the node's own limits (10 s timeout, 5 s handshake) are well inside this
FLAG_COMPUTE = 16          # ggml.h GGML_TENSOR_FLAG_COMPUTE
OPS = ("NONE", "ADD", "ADD1", "ACC", "SUB", "MUL", "DIV", "SQR", "SQRT", "SUM_ROWS", "MEAN", "ARGMAX", "REPEAT",
       "CONCAT", "RMS_NORM", "NORM", "MUL_MAT", "MUL_MAT_ID", "SCALE", "SET", "CPY", "CONT", "RESHAPE", "VIEW",
       "PERMUTE", "TRANSPOSE", "GET_ROWS", "SET_ROWS", "DIAG_MASK_INF", "SOFT_MAX", "ROPE", "CLAMP", "PAD", "ROLL",
       "ARGSORT", "TOP_K", "FLASH_ATTN_EXT", "UNARY", "GLU", "FILL", "LEAKY_RELU")
# Request sizes of proto.h's structs (a wrong size is still a request the node must refuse cleanly).
REQUEST_U64S = {"ALLOC_BUFFER": 1, "FREE_BUFFER": 1, "BUFFER_CLEAR": 4, "MEMSET_TENSOR": 4, "GET_TENSOR": 3,
                "COPY_TENSOR": 5, "LOAD_FROM_FILE": 5, "PEER_ACCEPT": 1, "PEER_SEND": 4, "PEER_RECV": 4,
                "TRANSPORT_OFFER": 2, "SET_TENSOR_2D": 5, "LOAD_FROM_FILE_2D": 8, "ALLREDUCE": 37, "AUTH": 4,
                "PEER_CONNECT": 36, "OPEN_FILE": 39, "TRANSPORT_SWITCH": 0}
ENDS_STREAM = ("TRANSPORT_SWITCH", "KEEPALIVE", "HELLO", "AUTH")   # after these the fuzzer reconnects
MODEL_FILE = ("fuzz.gguf", 1 << 20)   # what `main` puts in the node's --model-dir: OPEN_FILE names it often
RARE = {**{name: 0.15 for name in ENDS_STREAM}, "OPEN_FILE": 0.25}   # how often they are drawn, relative to the rest


@dataclass
class Findings:
    frames: int = 0
    connections: int = 0
    hangs: list[str] = field(default_factory=list)
    node_died: bool = False
    worker_crashes: int = 0
    rss_before_kib: int = 0
    rss_after_kib: int = 0

    def summary(self) -> str:
        return (f"{self.frames} frames over {self.connections} connections: node died: {self.node_died}, "
                f"hangs: {len(self.hangs)}, worker crashes: {self.worker_crashes}, "
                f"node RSS {self.rss_before_kib} KiB before, {self.rss_after_kib} KiB after")


def _op_indices() -> dict[str, int]:
    import llama_cpp.llama_cpp as llama_lib

    op_name = llama_lib._lib.ggml_op_name
    op_name.restype = ctypes.c_char_p
    op_name.argtypes = [ctypes.c_int]
    names = {}
    for i in range(200):
        name = op_name(i)
        if name is None:
            break
        names[name.decode()] = i
    return {n: names[n] for n in OPS if n in names}


class Fuzzer:
    def __init__(self, endpoint: str, seed: int, hang_s: float = HANG_S) -> None:
        self.ffi, self.lib = load()
        self.hang_s = hang_s
        self.address = split_endpoint(endpoint)
        self.rng = random.Random(seed)
        self.ops = _op_indices()
        self.commands = _command_numbers()
        self.names = sorted(self.commands)
        self.posted_since_sync = 0
        self.handles: list[tuple[int, int]] = []   # (handle, size) of this connection's buffers
        self.sock: socket.socket | None = None
        self.next_id = 1
        self.findings = Findings()

    # --- framing -------------------------------------------------------------------

    def connect(self) -> None:
        self.close()
        self.sock = socket.create_connection(self.address, timeout=self.hang_s)
        # as the head does: without it a SYNC after posted requests waits for the node's delayed ACK (40 ms)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.findings.connections += 1
        self.handles = []
        hello = self.ffi.new("struct tb_hello *")
        self.lib.tb_abi_fill(self.ffi.addressof(hello.abi))
        hello.keepalive_ms = 1000
        if self.request(self.commands["HELLO"], bytes(self.ffi.buffer(hello))) is None:
            raise RuntimeError("the node refused a valid HELLO")
        for size in (4096, 65536):
            body = self.request(self.commands["ALLOC_BUFFER"], struct.pack("<Q", size))
            if body is not None and len(body) >= 24:
                self.handles.append((struct.unpack("<Q", body[:8])[0], size))

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def send(self, cmd: int, payload: bytes, claimed: int | None = None) -> bool:
        assert self.sock is not None
        self.next_id += 1
        self.findings.frames += 1
        try:
            self.sock.sendall(HEADER.pack(self.lib.TB_MAGIC, cmd, 0, self.next_id,
                                          len(payload) if claimed is None else claimed) + payload)
            return True
        except OSError:
            return False   # the node closed it: fine

    def reply(self, what: str) -> bytes | None:
        """The next reply's body (status 0), None for an error reply or a closed
        connection; a silent, open connection past HANG_S is a hang."""
        assert self.sock is not None
        try:
            while True:
                head = self._exactly(HEADER.size)
                if head is None:
                    return None
                _magic, cmd, _flags, _id, length = HEADER.unpack(head)
                body = self._exactly(length)
                if body is None:
                    return None
                if cmd != self.commands["KEEPALIVE"]:
                    break
        except TimeoutError:
            self.findings.hangs.append(what)
            self.close()
            return None
        status = struct.unpack("<i", body[:4])[0] if len(body) >= 4 else -1
        return body[8:] if status == 0 else None

    def request(self, cmd: int, payload: bytes) -> bytes | None:
        return self.reply(f"command {cmd}, {len(payload)} bytes") if self.send(cmd, payload) else None

    def _exactly(self, n: int) -> bytes | None:
        assert self.sock is not None
        data = b""
        while len(data) < n:
            try:
                chunk = self.sock.recv(n - len(data))
            except (ConnectionResetError, BrokenPipeError):
                return None
            if not chunk:
                return None
            data += chunk
        return data

    # --- values --------------------------------------------------------------------

    def u64(self) -> int:
        r = self.rng.random()
        if r < 0.3 and self.handles:
            return self.rng.choice(self.handles)[0]
        if r < 0.5 and self.handles:
            size = self.rng.choice(self.handles)[1]
            return max(0, size + self.rng.choice((-1, 0, 1, -8, 8, -size, size)))
        return self.rng.choice((0, 1, 2, 7, 8, 64, 4096, 65536, 2**31, 2**32 - 1, 2**63, 2**64 - 1,
                                self.rng.getrandbits(64), self.rng.randrange(0, 1 << 20)))

    def fields(self, n: int) -> bytes:
        return struct.pack(f"<{n}Q", *(self.u64() for _ in range(n)))

    def graph(self) -> bytes:
        n = self.rng.randint(1, 8)
        tensors = []
        for i in range(n):
            t = self.ffi.new("struct tb_wire_tensor *")
            handle, size = self.rng.choice(self.handles) if self.handles else (0, 0)
            t.buffer = handle if self.rng.random() < 0.9 else self.u64()
            t.offset = self.rng.choice((0, 64, 256, size // 2, size, self.u64()))
            t.type = self.rng.choice((0, 0, 0, 1, 8, 12, 24, 26, self.rng.randrange(0, 64)))   # mostly F32
            ne = [self.rng.choice((1, 1, 2, 4, 8, 16, 32)) for _ in range(4)]
            if self.rng.random() < 0.1:
                ne[self.rng.randrange(4)] = self.rng.choice((0, -1, 2**40))
            t.ne = ne
            nb = [4, 4 * ne[0], 4 * ne[0] * ne[1], 4 * ne[0] * ne[1] * ne[2]]
            if self.rng.random() < 0.3:
                nb[self.rng.randrange(4)] = self.rng.choice((0, 1, 4, 2**63, self.u64()))
            t.nb = [max(0, x) % 2**64 for x in nb]
            t.op = self.rng.choice(list(self.ops.values())) if self.rng.random() < 0.95 else self.rng.randrange(0, 200)
            t.op_params = [self.rng.choice((0, 1, -1, 2, 4, 2**31 - 1, -2**31, self.rng.getrandbits(31)))
                           for _ in range(16)]
            t.flags = FLAG_COMPUTE if self.rng.random() < 0.8 else self.rng.getrandbits(31)
            t.view_src = self.rng.randrange(-1, i) if i and self.rng.random() < 0.2 else -1
            t.view_offs = self.rng.choice((0, 4, 64, self.u64()))
            t.src = [self.rng.randrange(-1, i) if i and k < 3 else -1 for k in range(10)]
            t.use_count = self.rng.randint(0, 3)
            tensors.append(bytes(self.ffi.buffer(t)))
        nodes = [self.rng.randrange(0, n) for _ in range(self.rng.randint(1, n))] if self.rng.random() < 0.2 \
            else list(range(n))
        slot = self.rng.choice((0, 1, 31, 32, 2**32 - 1))   # tb_graph_header.slot: where the node keeps it
        return struct.pack("<IIII", n, len(nodes), slot, 0) + b"".join(tensors) + struct.pack(f"<{len(nodes)}I", *nodes)

    # --- one frame -----------------------------------------------------------------

    def step(self) -> None:
        if self.sock is None:
            self.connect()
        name = self.rng.choice(self.names)
        while self.rng.random() > RARE.get(name, 1.0):
            name = self.rng.choice(self.names)
        cmd = self.commands[name]
        claimed = None
        r = self.rng.random()
        if name in ("GRAPH_COMPUTE", "SUPPORTS_OP", "GET_ALLOC_SIZE") and r < 0.8:
            payload = self.graph()
        elif name in ("SET_TENSOR", "SET_TENSOR_2D") and r < 0.8:
            head = self.fields(3 if name == "SET_TENSOR" else 5)
            payload = head + bytes(self.rng.choice((0, 4, 64, 4096)))
        elif name == "OPEN_FILE" and r < 0.5:   # the node's own file, with a size that may match and a forged proof
            file_name, size = MODEL_FILE
            payload = (struct.pack("<Q", self.rng.choice((size, size - 1, self.u64()))) + self.rng.randbytes(48) +
                       file_name.encode().ljust(256, b"\0"))
        elif name in REQUEST_U64S and r < 0.8:
            payload = self.fields(REQUEST_U64S[name])
        else:
            payload = self.rng.randbytes(self.rng.choice((0, 1, 8, 24, 100, 4096)))
            if self.rng.random() < 0.01:
                claimed = len(payload) + self.rng.choice((1, 100))   # a payload that never comes: the node times out
        if not self.send(cmd, payload, claimed):
            self.close()
            return
        if claimed is not None or name in ENDS_STREAM:
            self.close()     # the stream cannot go on: start again
            return
        if self.lib.tb_cmd_posted(cmd):
            self.posted_since_sync += 1
            if self.posted_since_sync < 8:
                return
            self.posted_since_sync = 0
            cmd, name = self.commands["SYNC"], "SYNC after posted requests"
            if not self.send(cmd, b""):
                self.close()
                return
        self.reply(name)
        if self.sock is not None and self.rng.random() < 0.01:
            self.close()


def _command_numbers() -> dict[str, int]:
    """proto.h's enum tb_cmd, from the C library's own names."""
    _, lib = load()
    from tbrpc.native import text

    names = {}
    for cmd in range(1, 64):
        name = text(lib.tb_cmd_name(cmd))
        if name == "UNKNOWN":
            break
        names[name] = cmd
    return names


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def campaign(endpoint: str, frames: int, seed: int, node_pid: int | None, log: Path | None,
             hang_s: float = HANG_S, progress_every: int = 0) -> Findings:
    fuzzer = Fuzzer(endpoint, seed, hang_s)
    found = fuzzer.findings
    if node_pid:
        found.rss_before_kib = rss_kib(node_pid)
    started, reported = time.monotonic(), 0
    while found.frames < frames:
        if progress_every and found.frames - reported >= progress_every:
            reported = found.frames
            print(f"seed {seed}: {found.frames} frames, {found.connections} connections, {len(found.hangs)} hangs, "
                  f"{time.monotonic() - started:.0f} s", flush=True)
        try:
            fuzzer.step()
        except (ConnectionRefusedError, RuntimeError):
            found.node_died = True
            break
        except OSError:
            fuzzer.close()
        if len(found.hangs) >= 3:   # a node that hangs will go on hanging: enough to say so
            break
    fuzzer.close()
    if node_pid:
        try:
            found.rss_after_kib = rss_kib(node_pid)
        except OSError:
            found.node_died = True
    if log is not None:
        found.worker_crashes = len(re.findall(r"died with signal", log.read_text(errors="replace")))
    return found


def _job(args: tuple[str, int, int]) -> Findings:
    endpoint, frames, seed = args
    return campaign(endpoint, frames, seed, None, None, progress_every=20000)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--frames", type=int, default=100000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--jobs", type=int, default=1, help="fuzzing processes at once (default 1)")
    parser.add_argument("--node", default=None, help="HOST:PORT of a running node (default: start one)")
    args = parser.parse_args()
    proc, log = None, None
    endpoint = args.node
    if endpoint is None:
        work = Path(tempfile.mkdtemp(prefix="tbrpc-fuzz-"))
        log = work / "node.log"
        (work / "models").mkdir()
        (work / "models" / MODEL_FILE[0]).write_bytes(os.urandom(MODEL_FILE[1]))
        proc = subprocess.Popen([sys.executable, "-m", "tbrpc.cli", "node", "--port", "0", "--threads", "1",
                                 "--model-dir", str(work / "models")],
                                stdout=subprocess.DEVNULL, stderr=open(log, "wb"), start_new_session=True)
        deadline = time.monotonic() + 30
        while (port := listening_port(log.read_text(errors="replace"))) is None:
            if time.monotonic() > deadline:
                raise SystemExit(f"node did not start: {log.read_text()}")
            time.sleep(0.05)
        endpoint = f"127.0.0.1:{port}"
        print(f"node pid {proc.pid} at {endpoint}, log {log}", flush=True)
    started = time.monotonic()
    load_before = os.getloadavg()
    rss_before = rss_kib(proc.pid) if proc else 0
    try:
        if args.jobs <= 1:
            found = campaign(endpoint, args.frames, args.seed, proc.pid if proc else None, log, progress_every=20000)
        else:
            share = -(-args.frames // args.jobs)
            with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
                parts = pool.map(_job, [(endpoint, share, args.seed + i) for i in range(args.jobs)])
            found = Findings(frames=sum(p.frames for p in parts), connections=sum(p.connections for p in parts),
                             hangs=[h for p in parts for h in p.hangs], node_died=any(p.node_died for p in parts))
            found.rss_before_kib = rss_before
            if proc is not None:
                try:
                    found.rss_after_kib = rss_kib(proc.pid)
                except OSError:
                    found.node_died = True
            if log is not None:
                found.worker_crashes = len(re.findall(r"died with signal", log.read_text(errors="replace")))
    finally:
        if proc is not None:
            alive = proc.poll() is None
            proc.terminate()
            proc.wait(timeout=30)
    load_after = os.getloadavg()
    print(found.summary() + f"; {time.monotonic() - started:.0f} s" + ("" if proc is None or alive else "; NODE EXITED"))
    print(f"load average (1, 5, 15 min) before {load_before}, after {load_after}; {args.jobs} job(s)")
    for hang in found.hangs[:20]:
        print("hang:", hang)
    if log is not None and found.worker_crashes:
        for line in log.read_text(errors="replace").splitlines():
            if "died with signal" in line:
                print(line)


if __name__ == "__main__":
    main()
