"""Failures become Python exceptions that name the node; the head survives.

Every scenario runs a real head process against real node processes.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
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
from helpers import ROOT, free_port, run_head
from tbrpc._build import build_program
from tbrpc.native import load

PROMPT = "Once upon a time"


def test_unreachable_node_is_named(tmp_path: Path) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    started = time.time()
    with pytest.raises(tbrpc.NodeUnreachable, match=f"{endpoint}.*unreachable"):
        tbrpc.connect([endpoint], timeout=2)
    assert time.time() - started < 5
    with pytest.raises(tbrpc.NodeUnreachable):
        tbrpc.probe(endpoint, timeout=2)


def test_an_unknown_host_is_unreachable() -> None:
    with pytest.raises(tbrpc.NodeUnreachable, match="no-such-host.invalid:50052: cannot resolve host"):
        tbrpc.connect(["no-such-host.invalid:50052"], timeout=2)


def test_a_node_that_never_answers_the_connect_is_unreachable_too() -> None:
    """No answer in time is the same kind as refused (tbrpc.h): the text tells them apart.
    A listener whose accept queue is full drops further requests unanswered (Linux, BSD)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        endpoint = f"127.0.0.1:{listener.getsockname()[1]}"
        held: list[socket.socket] = []
        try:
            for _ in range(64):   # fill the queue until a request goes unanswered
                try:
                    held.append(socket.create_connection(listener.getsockname(), timeout=0.4))
                except TimeoutError:
                    break
            else:
                pytest.fail("64 connections into a listener with backlog 0 all connected")
            with pytest.raises(tbrpc.NodeUnreachable, match=f"{endpoint}: unreachable: .*cannot connect: timed out"):
                tbrpc.connect([endpoint], timeout=0.5)
        finally:
            for s in held:
                s.close()


@pytest.fixture(scope="module")
def dial_tests(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_program(ROOT / "tests" / "c" / "dial_tests.c", tmp_path_factory.mktemp("c") / "dial_tests",
                         with_ggml=False)


@pytest.mark.parametrize("case", ["answered", "refused", "unknown_host", "not_from_here", "no_answer"])
def test_a_failed_dial_has_a_kind(dial_tests: Path, case: str) -> None:
    """tb_dial's kind (enum tb_io_error) for each way a connect fails: tests/c/dial_tests.c."""
    proc = subprocess.run([str(dial_tests), case], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"PASS {case}" in proc.stdout


@pytest.fixture(scope="module")
def tcp_send_tests(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_program(ROOT / "tests" / "c" / "tcp_send_tests.c", tmp_path_factory.mktemp("c") / "tcp_send_tests",
                         with_ggml=False)


@pytest.mark.parametrize("case", ["busy_peer", "silent_peer", "one_way", "one_way_data"])
def test_a_blocked_tcp_send_waits_for_a_busy_peer_not_a_silent_one(tcp_send_tests: Path, case: str) -> None:
    """A send the peer does not read (a node computing, in a pipelined prompt) lasts as long as the peer
    sends signs of life, and fails with TB_IO_TIMEOUT once it goes silent; on a one-way peer link the
    receiver's heartbeat is such a sign, read away by the sender (anything else it writes fails the link):
    tests/c/tcp_send_tests.c."""
    proc = subprocess.run([str(tcp_send_tests), case], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"PASS {case}" in proc.stdout


@pytest.fixture(scope="module")
def chain_tests(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_program(ROOT / "tests" / "c" / "chain_tests.c", tmp_path_factory.mktemp("c") / "chain_tests")


def test_a_chain_of_blocked_senders_waits_for_the_node_computing_at_its_end(chain_tests: Path) -> None:
    """Z sends to A while A, blocked, sends to B, which computes for seconds (a prompt pipelined
    through three nodes, the last the slowest): A shows life to Z while its own send waits on a node
    that computes, so with a 1 s stall timeout both copies arrive intact: tests/c/chain_tests.c."""
    proc = subprocess.run([str(chain_tests)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "PASS" in proc.stdout


def test_malformed_endpoint_is_a_clear_error() -> None:
    with pytest.raises(tbrpc.NodeError, match="not host:port"):
        tbrpc.connect(["no-port-here"])


@pytest.mark.parametrize("transport", ["auto", "tcp"])
@pytest.mark.parametrize("model_name", ["deepseek2", "gemma"])
def test_node_killed_mid_generation(model_name: str, transport: str, nodes: Any, tmp_path: Path) -> None:
    a, b = nodes(2)
    result, _ = run_head(tmp_path, model=str(models.ensure(model_name)), prompt=PROMPT, n_predict=12,
                         nodes=[a.endpoint, b.endpoint], kill={"pid": b.proc.pid, "after_tokens": 3},
                         transport=transport, decode_again=True)
    # the head process survived (run_head checks its exit code) and raised NodeError naming node b,
    # of the class that says it failed mid-run
    assert result["error"] is not None
    assert result["error"]["type"] == "NodeFailed"
    assert b.endpoint in result["error"]["message"]
    assert "no answer within" not in result["error"]["message"]   # its end of file, not the head's timeout
    assert b.proc.wait(timeout=10) == -9
    assert result["failed_indexes"] == [1]   # the cheap check around every decode knows which one
    # the model used again: the same kind and node, and what to do about it
    again = result["again"]
    assert again is not None and (again["type"], again["endpoint"]) == ("NodeFailed", b.endpoint), again
    assert "before this call: a model using that node cannot go on; close it" in again["message"], again
    # the other node is still usable, through the same head
    assert list(result["survivor_status"]) == [a.endpoint]
    assert result["survivor_status"][a.endpoint]["clients"] >= 1


class CuttingProxy:
    """Between the head and one node: passes every byte, and ends both
    connections halfway through the node's `cut_at`-th GET_TENSOR reply that
    carries data (with a model on one node, the reads of the logits)."""

    def __init__(self, node_endpoint: str, cut_at: int) -> None:
        self.node_endpoint, self.cut_at, self.seen = node_endpoint, cut_at, 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        head, _ = self.listener.accept()
        host, port = self.node_endpoint.rsplit(":", 1)
        node = socket.create_connection((host, int(port)))
        threading.Thread(target=self._pump, args=(head, node), daemon=True).start()
        ffi, lib = load()
        size = ffi.sizeof("struct tb_header")
        try:
            while True:
                raw = self._exactly(node, size)
                _magic, cmd, flags, _id, length = struct.unpack("<IHHQQ", raw)
                body = self._exactly(node, length)
                if cmd == lib.TB_CMD_GET_TENSOR and flags & 1 and length > 8:
                    self.seen += 1
                    if self.seen == self.cut_at:
                        head.sendall(raw + body[:length // 2])
                        break
                head.sendall(raw + body)
        except OSError:
            pass
        for s in (head, node):
            s.close()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while chunk := source.recv(65536):
                sink.sendall(chunk)
        except OSError:
            pass

    @staticmethod
    def _exactly(sock: socket.socket, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            if not chunk:
                raise ConnectionError("closed")
            data += chunk
        return data


def test_a_node_failing_while_the_logits_come_is_raised_by_that_decode(nodes: Any) -> None:
    """llama.cpp leaves the read of a decode's logits in flight (tbrpc's
    get_tensor_async) until they are asked for; tbrpc's llama_decode reads
    it before returning, so a connection that ends in the middle of the
    logits fails that very decode with NodeError naming the node, and no
    caller ever sees the zeros the failed read leaves in their place."""
    (a,) = nodes(1)
    proxy = CuttingProxy(a.endpoint, cut_at=2)   # the prompt's logits pass, the first generated token's are cut
    script = (
        "import json, sys\n"
        "import numpy as np, llama_cpp, tbrpc\n"
        "tbrpc.connect([sys.argv[2]], transport='tcp')\n"
        "llm = llama_cpp.Llama(sys.argv[1], n_gpu_layers=-1, n_ctx=256, n_threads=1, verbose=False)\n"
        "seen = []\n"
        "def last_row():\n"
        "    return np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(llm.n_vocab(),)).copy()\n"
        "try:\n"
        "    llm.eval(llm.tokenize(b'Once upon a time', add_bos=True))\n"
        "    for step in range(3):\n"
        "        row = last_row()\n"
        "        seen.append({'step': step, 'zeros': bool(not row.any())})\n"
        "        llm.eval([int(np.argmax(row))])\n"
        "except tbrpc.NodeError as e:\n"
        "    seen.append({'raised': type(e).__name__, 'message': str(e)})\n"
        "print(json.dumps(seen))\n")
    proc = subprocess.run([sys.executable, "-c", script, str(models.ensure("llama")), proxy.endpoint], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen[:1] == [{"step": 0, "zeros": False}], seen   # the prompt's logits, read whole
    assert seen[1]["raised"] == "NodeFailed" and len(seen) == 2, seen   # raised by the decode of step 0's token
    assert proxy.endpoint in seen[1]["message"] and "GET_TENSOR" in seen[1]["message"], seen
    assert a.proc.poll() is None   # the node itself lives on


def test_node_dead_before_the_first_decode(nodes: Any, tmp_path: Path) -> None:
    """The head learns of the death inside its first decode after it (a CPU
    node's supports_op is answered on the head, so the first request is a
    posted tensor write); the decode must fail softly, not make ggml's
    scheduler abort the head."""
    a, b = nodes(2)
    result, _ = run_head(tmp_path, model=str(models.ensure("llama")), prompt=PROMPT, n_predict=4,
                         nodes=[a.endpoint, b.endpoint], kill={"pid": b.proc.pid, "after_tokens": -1})
    assert result["error"]["type"] == "NodeFailed" and b.endpoint in result["error"]["message"]


def test_a_failure_is_raised_not_printed(nodes: Any, tmp_path: Path) -> None:
    """A node killed before a saved state is read: llama_state_get_data raises the node's NodeError
    (the zeros of the failed reads never become a state), probe raises for a node that is gone, and
    the library writes no line of its own to stderr for either."""
    a, b = nodes(2)
    script = (
        "import sys, os, signal, time, tbrpc, llama_cpp, models\n"
        "tbrpc.connect(sys.argv[1:3])\n"
        "llm = llama_cpp.Llama(str(models.ensure('llama')), n_gpu_layers=-1, tensor_split=[1, 1], n_ctx=256,\n"
        "                      verbose=False)\n"
        "llm.eval(llm.tokenize(b'Once upon a time'))\n"
        "os.kill(int(sys.argv[3]), signal.SIGKILL); time.sleep(0.5)\n"
        "try:\n    llm.save_state()\nexcept tbrpc.NodeError as e:\n    print('STATE', type(e).__name__, e.endpoint)\n"
        "try:\n    tbrpc.probe(sys.argv[2], timeout=2)\nexcept tbrpc.NodeError as e:\n    print('PROBE', type(e).__name__)\n")
    proc = subprocess.run([sys.executable, "-c", script, a.endpoint, b.endpoint, str(b.proc.pid)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.stdout.splitlines() == [f"STATE NodeFailed {b.endpoint}", "PROBE NodeUnreachable"], \
        proc.stdout + proc.stderr[-3000:]
    assert "tbrpc node" not in proc.stderr, proc.stderr


def test_an_old_failure_does_not_fail_a_new_model(tmp_path: Path) -> None:
    script = (
        "import os, signal, time\n"
        "import models\n"
        "from tbrpc import Llama, NodeError\n"
        "m = str(models.ensure('llama'))\n"
        "a = Llama(m, cluster=1, n_ctx=256, verbose=False)\n"
        "os.kill(a.tbrpc_node_pids[0], signal.SIGKILL); time.sleep(0.5)\n"
        "try:\n    a('hi', max_tokens=2)\nexcept NodeError as e:\n    print('FIRST', e)\n"
        "a.close()\n"
        "b = Llama(m, cluster=1, n_ctx=256, verbose=False)\n"
        "print('SECOND', len(b('hi', max_tokens=4, temperature=0)['choices'][0]['text']))\n"
        "b.close()\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "FIRST tbrpc node" in proc.stdout and "SECOND" in proc.stdout, proc.stdout


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_stalled_node_times_out(transport: str, nodes: Any, tmp_path: Path) -> None:
    a, b = nodes(2)
    try:
        started = time.time()
        result, _ = run_head(tmp_path, model=str(models.ensure("llama")), prompt=PROMPT, n_predict=12,
                             nodes=[a.endpoint, b.endpoint], timeout=2.0, transport=transport,
                             kill={"pid": b.proc.pid, "after_tokens": 2, "signal": int(signal.SIGSTOP)})
        assert result["error"]["type"] == "NodeFailed"
        assert b.endpoint in result["error"]["message"] and "no answer within 2000 ms" in result["error"]["message"]
        assert time.time() - started < 60
    finally:
        os.killpg(b.proc.pid, signal.SIGCONT)


def test_stalled_upstream_node_is_named(nodes: Any, tmp_path: Path) -> None:
    """With node-to-node links the head waits on the last node only; when the
    first node stalls, the last one says whose activations never came."""
    a, b = nodes(2)
    try:
        result, _ = run_head(tmp_path, model=str(models.ensure("llama")), prompt=PROMPT, n_predict=12,
                             nodes=[a.endpoint, b.endpoint], timeout=2.0,
                             kill={"pid": a.proc.pid, "after_tokens": 2, "signal": int(signal.SIGSTOP)})
        assert result["error"]["type"] == "NodeFailed"
        message = result["error"]["message"]
        assert f"waiting for activations from node 127.0.0.1:{a.port}" in message, message
        # the same as data: the node whose link failed (b's), for a caller to blame (launch does)
        assert result["error"]["endpoint"] == b.endpoint and result["error"]["peer"] == a.endpoint, result["error"]
    finally:
        os.killpg(a.proc.pid, signal.SIGCONT)


def fake_node(hello_changes: dict[str, int]) -> tuple[str, threading.Thread]:
    """A server that answers HELLO like a node of another version would."""
    ffi, lib = load()
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)

    def answer() -> None:
        conn, _ = server.accept()
        header = conn.recv(24, socket.MSG_WAITALL)
        _magic, cmd, _flags, req_id, length = struct.unpack("<IHHQQ", header)
        conn.recv(length, socket.MSG_WAITALL)
        hello = ffi.new("struct tb_hello *")
        lib.tb_abi_fill(ffi.addressof(hello.abi))
        for key, value in hello_changes.items():
            setattr(hello.abi, key, value)
        hello.alignment = 64
        body = struct.pack("<iI", 0, 0) + bytes(ffi.buffer(hello))
        conn.sendall(struct.pack("<IHHQQ", lib.TB_MAGIC, cmd, 1, req_id, len(body)) + body)
        conn.close()
        server.close()

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    return f"127.0.0.1:{server.getsockname()[1]}", thread


def test_client_refuses_a_node_of_another_protocol_version() -> None:
    endpoint, thread = fake_node({"proto_version": 42})
    _, lib = load()
    with pytest.raises(tbrpc.NodeVersionMismatch, match=f"{endpoint}.*protocol {lib.TB_PROTO_VERSION}.*node speaks 42") as raised:
        tbrpc.connect([endpoint], timeout=5)
    assert isinstance(raised.value, tbrpc.NodeError) and isinstance(raised.value, tbrpc.VersionMismatchError)
    thread.join(5)


def test_client_refuses_a_node_with_another_ggml() -> None:
    endpoint, thread = fake_node({"ggml_type_count": 3})
    with pytest.raises(tbrpc.NodeVersionMismatch, match="ggml ABI mismatch.*3 types"):
        tbrpc.connect([endpoint], timeout=5)
    thread.join(5)


def test_a_node_refusing_our_version_is_a_version_mismatch(nodes: Any) -> None:
    """The node's own refusal (an error reply to HELLO) carries its kind on the wire."""
    node = nodes(1)[0]
    ffi, lib = load()
    hello = ffi.new("struct tb_hello *")
    lib.tb_abi_fill(ffi.addressof(hello.abi))
    hello.abi.proto_version = 99
    with socket.create_connection(("127.0.0.1", node.port), timeout=5) as conn:
        body = bytes(ffi.buffer(hello))
        conn.sendall(struct.pack("<IHHQQ", lib.TB_MAGIC, lib.TB_CMD_HELLO, 0, 1, len(body)) + body)
        _magic, _cmd, _flags, _id, length = struct.unpack("<IHHQQ", conn.recv(24, socket.MSG_WAITALL))
        status, _ = struct.unpack("<iI", conn.recv(8, socket.MSG_WAITALL))
    assert status == lib.TB_STATUS_VERSION


def test_something_that_is_not_a_node_fails_the_handshake() -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)

    def answer() -> None:
        conn, _ = server.accept()
        conn.recv(1024)
        conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n" + b"x" * 64)
        conn.close()
        server.close()

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    with pytest.raises(tbrpc.HandshakeRefused):
        tbrpc.probe(f"127.0.0.1:{server.getsockname()[1]}", timeout=5)
    thread.join(5)


def test_other_llama_cpp_python_versions_are_refused() -> None:
    code = ("import llama_cpp; llama_cpp.__version__ = '0.3.99'\n"
            "import tbrpc\n"
            "try:\n    tbrpc.connect(['127.0.0.1:1'])\n"
            "except tbrpc.VersionMismatchError as e:\n    print('REFUSED', e)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "REFUSED" in proc.stdout, proc.stderr
    assert "0.3.36" in proc.stdout and "0.3.99" in proc.stdout


def test_two_nodes_on_one_host_are_independent(nodes: Any) -> None:
    a, b = nodes(2)
    assert a.port != b.port
    ia, sa = tbrpc.probe(a.endpoint)
    ib, sb = tbrpc.probe(b.endpoint)
    assert ia.node_name != ib.node_name
    assert sa.bytes_allocated == sb.bytes_allocated == 0


@pytest.mark.parametrize("when", ["weights", "context"])
def test_a_failed_load_leaves_nothing_on_the_surviving_node(when: str, nodes: Any) -> None:
    """A node killed while the drop-in loads (during the weights, or after them,
    when the context is made): the NodeError names it, and the node that
    survives holds none of that load's buffers once the error is raised."""
    a, b = nodes(2)
    threshold = 0.5 if when == "weights" else 1.0
    script = (
        "import os, signal\n"
        "import models, tbrpc\n"
        "from tbrpc import Llama, NodeError\n"
        f"def progress(f):\n    if f >= {threshold}: os.kill({b.proc.pid}, signal.SIGKILL)\n"
        "try:\n"
        f"    Llama(str(models.ensure('gemma')), cluster=['{a.endpoint}', '{b.endpoint}'], n_ctx=256,\n"
        "          progress=progress, verbose=False)\n"
        "except NodeError as e:\n"
        "    print('FAILED', e)\n"
        f"    print('LEFT', tbrpc.probe('{a.endpoint}')[1].buffers)\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "FAILED node" in proc.stdout and b.endpoint in proc.stdout, proc.stdout
    assert "LEFT 0" in proc.stdout, proc.stdout


def test_a_node_restarted_on_its_endpoint_serves_this_process_again(nodes: Any, tmp_path: Path) -> None:
    """A long-running head outlives a node: after the NodeError, a new model
    loads onto the node restarted on the same endpoint (the same ggml device)
    and gives the tokens the first one gave. While the failed model is open,
    loading again is refused with what to do."""
    a, b = nodes(2)
    killed, restarted = tmp_path / "killed", tmp_path / "restarted"
    script = (
        "import os, signal, time\n"
        "from pathlib import Path\n"
        "import models, tbrpc\n"
        "from tbrpc import Llama, NodeError\n"
        f"m, eps = str(models.ensure('llama')), ['{a.endpoint}', '{b.endpoint}']\n"
        "def run(llm):\n    return llm('Once upon a time', max_tokens=8, temperature=0)['choices'][0]['text']\n"
        "first = Llama(m, cluster=eps, n_ctx=256, verbose=False)\n"
        "want = run(first)\n"
        f"os.kill({b.proc.pid}, signal.SIGKILL); time.sleep(0.3)\n"
        "try:\n    run(first)\nexcept NodeError as e:\n    print('FAILED', e)\n"
        f"Path('{killed}').touch()\n"
        f"while not Path('{restarted}').exists():\n    time.sleep(0.05)\n"
        "try:\n    Llama(m, cluster=eps, n_ctx=256, verbose=False)\nexcept NodeError as e:\n    print('REFUSED', e)\n"
        "first.close()\n"
        "second = Llama(m, cluster=eps, n_ctx=256, verbose=False)\n"
        "print('DEVICES', second.tbrpc_devices == first.tbrpc_devices, 'SAME', run(second) == want)\n"
        "second.close()\n")
    head = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 180
    while not killed.exists() and head.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    b.proc.wait(timeout=10)
    nodes(1, "--port", str(b.port))
    restarted.touch()
    out, err = head.communicate(timeout=180)
    assert head.returncode == 0, err[-3000:]
    assert re.search(rf"^FAILED .*{b.endpoint}", out, re.M), out
    assert "REFUSED" in out and "close that model (Llama.close())" in out, out
    assert "DEVICES True SAME True" in out, out


@pytest.mark.parametrize("links, transport, socket_buffer", [
    ("node to node", "tcp", None), ("through the head", "tcp", None),
    ("node to node", "auto", None), ("through the head", "auto", None),
    ("node to node", "tcp", 65536)])
def test_a_pipelined_prompt_outlasts_the_stall_timeout(links: str, transport: str, socket_buffer: int | None,
                                                       nodes: Any, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt pipelined through a layer split (the pieces before the last ask for no logits, as
    tbrpc.Llama.eval sends them) keeps a sender blocked while the next node computes its piece: the
    head, on that node's inputs (its attention mask, n_ctx x n_ubatch x 2 B = 32 MiB here, more than
    a socket takes), and with a link between them the node before it, on its activations (5 MiB,
    which 4 MiB socket buffers each way take whole; 64 KiB ones do not, as Kimi K2's 14.7 MB pieces
    would not on a Mac). With a 1 s stall timeout and pieces of seconds, the node computing keeps
    both waiting: over TCP its keepalives to the head and a heartbeat byte back on the link (bytes
    that arrive count as progress), over shared memory (transport "auto": the head's connections
    and the link) its heartbeat, which takes no slot of a ring the node does not read. The prompt
    completes, where without them a sender fails the node after 1 s ("send timed out", "no answer
    within 999 ms")."""
    if socket_buffer is not None:
        monkeypatch.setenv("TBRPC_TCP_BUFFER", str(socket_buffer))   # the nodes' and the head's sockets
    a, b = nodes(2, "--timeout", "1")
    script = (
        "import json, time\n"
        "import llama_cpp, models, tbrpc\n"
        f"tbrpc.connect(['{a.endpoint}', '{b.endpoint}'], timeout=1.0, transport='{transport}')\n"
        "llm = llama_cpp.Llama(str(models.ensure('gemma')), n_gpu_layers=-1, split_mode=1, tensor_split=[1, 8],\n"
        "                      n_ctx=8192, n_batch=2048, n_ubatch=2048, n_threads=1, verbose=False)\n"
        "text = ' '.join(f'Item {i}: the quick brown fox jumps over the lazy dog, number {i * 7}.' for i in range(800))\n"
        "tokens = llm.tokenize(text.encode())[:4096]\n"
        "llm.eval(tokens[:1]); llm.reset(); llm._ctx.kv_cache_clear()   # the link, made while the nodes idle\n"
        "started = time.monotonic()\n"
        "for start in range(0, len(tokens), llm.n_batch):\n"
        "    piece = tokens[start:start + llm.n_batch]\n"
        "    llm._batch.set_batch(batch=piece, n_past=llm.n_tokens, logits_all=False)\n"
        "    if start + llm.n_batch < len(tokens):\n"
        "        llm._batch.batch.logits[len(piece) - 1] = False\n"
        "    llm._ctx.decode(llm._batch)\n"
        "    llm.n_tokens += len(piece)\n"
        "llama_cpp.llama_get_logits_ith(llm.ctx, -1)\n"
        "took = time.monotonic() - started\n"
        "print(json.dumps({'took': took, 'links': [i.links for i in tbrpc.client.cluster().nodes()],\n"
        "                  'failed': [i.error for i in tbrpc.client.cluster().nodes() if i.failed]}))\n")
    env = {**os.environ, **({"TBRPC_NO_PEER_LINKS": "1"} if links == "through the head" else {})}
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["failed"] == []
    assert out["took"] > 2.0, out   # pieces of seconds: a sender waited past the 1 s timeout
    carrier = "tcp" if transport == "tcp" else "shm"
    assert out["links"][0].startswith(f"{b.endpoint} {carrier}") == (links == "node to node"), out["links"]


@pytest.mark.parametrize("isolation", ["process", "spawn", "thread"])
def test_one_node_at_two_addresses_is_one_device(nodes: Any, isolation: str) -> None:
    """A node process reached at localhost and at 127.0.0.1 answers HELLO with the same node id
    (its workers too, spawned ones included): connect() refuses the second address, naming both,
    and a node listed twice; another node with the same name is another node."""
    a, b = nodes(2, "--isolation", isolation, "--name", "same")
    script = (
        "import sys, tbrpc\n"
        "a, a_again, b = sys.argv[1:]\n"
        "print(tbrpc.connect([a]))\n"
        "for endpoints in ([a_again], [b, b]):\n"
        "    try:\n"
        "        tbrpc.connect(endpoints)\n"
        "    except tbrpc.DuplicateNodeError as e:\n"
        "        print(type(e).__name__, e.endpoint, '|', e)\n"
        "print(tbrpc.connect([b]), len({n.node_id for n in tbrpc.cluster().nodes()}))\n")
    proc = subprocess.run([sys.executable, "-c", script, a.endpoint, f"localhost:{a.port}", b.endpoint], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines == [
        "['TBRPC0']",
        f"DuplicateNodeError localhost:{a.port} | tbrpc node localhost:{a.port} is node {a.endpoint} (TBRPC0), which "
        "this process is connected to already: the same node process answers at both addresses; list each node once",
        f"DuplicateNodeError {b.endpoint} | tbrpc node {b.endpoint} is listed twice (entries #1 and #2): "
        "list each node once",
        "['TBRPC1'] 2",
    ], proc.stdout
