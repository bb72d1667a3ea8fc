"""Failures become Python exceptions that name the node; the head survives.

Every scenario runs a real head process against real node processes.
"""

from __future__ import annotations

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
from tbrpc.native import load

PROMPT = "Once upon a time"


def test_unreachable_node_is_named(tmp_path: Path) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    started = time.time()
    with pytest.raises(tbrpc.NodeError, match=f"{endpoint}.*unreachable"):
        tbrpc.connect([endpoint], timeout=2)
    assert time.time() - started < 5


def test_malformed_endpoint_is_a_clear_error() -> None:
    with pytest.raises(tbrpc.NodeError, match="not host:port"):
        tbrpc.connect(["no-port-here"])


@pytest.mark.parametrize("transport", ["auto", "tcp"])
@pytest.mark.parametrize("model_name", ["deepseek2", "gemma"])
def test_node_killed_mid_generation(model_name: str, transport: str, nodes: Any, tmp_path: Path) -> None:
    a, b = nodes(2)
    result, _ = run_head(tmp_path, model=str(models.ensure(model_name)), prompt=PROMPT, n_predict=12,
                         nodes=[a.endpoint, b.endpoint], kill={"pid": b.proc.pid, "after_tokens": 3},
                         transport=transport)
    # the head process survived (run_head checks its exit code) and raised NodeError naming node b
    assert result["error"] is not None
    assert result["error"]["type"] == "NodeError"
    assert b.endpoint in result["error"]["message"]
    assert b.proc.wait(timeout=10) == -9
    # the other node is still usable, through the same head
    assert list(result["survivor_status"]) == [a.endpoint]
    assert result["survivor_status"][a.endpoint]["clients"] >= 1


def test_node_dead_before_the_first_decode(nodes: Any, tmp_path: Path) -> None:
    """The head learns of the death inside its first decode after it (a CPU
    node's supports_op is answered on the head, so the first request is a
    posted tensor write); the decode must fail softly, not make ggml's
    scheduler abort the head."""
    a, b = nodes(2)
    result, _ = run_head(tmp_path, model=str(models.ensure("llama")), prompt=PROMPT, n_predict=4,
                         nodes=[a.endpoint, b.endpoint], kill={"pid": b.proc.pid, "after_tokens": -1})
    assert result["error"]["type"] == "NodeError" and b.endpoint in result["error"]["message"]


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
        assert result["error"]["type"] == "NodeError"
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
        assert result["error"]["type"] == "NodeError"
        message = result["error"]["message"]
        assert f"waiting for activations from node 127.0.0.1:{a.port}" in message, message
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
    with pytest.raises(tbrpc.NodeError, match=f"{endpoint}.*protocol {lib.TB_PROTO_VERSION}.*node speaks 42"):
        tbrpc.connect([endpoint], timeout=5)
    thread.join(5)


def test_client_refuses_a_node_with_another_ggml() -> None:
    endpoint, thread = fake_node({"ggml_type_count": 3})
    with pytest.raises(tbrpc.NodeError, match="ggml ABI mismatch.*3 types"):
        tbrpc.connect([endpoint], timeout=5)
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
