"""Test helpers: real processes, real sockets. Node processes and a head
runner (used by the `nodes` fixture in conftest.py and by the split tests),
and `tbrpc launch` processes for the launch, doctor and drop-in tests.

Every process these helpers start is tracked by PID, and `assert_gone`
checks that none is left behind.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from tbrpc.node_processes import listening_port

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
PROMPT = "The capital of France is"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is gone for every purpose but the parent's wait
    try:
        return Path(f"/proc/{pid}/status").read_text().find("State:\tZ") < 0
    except OSError:
        return True


def assert_gone(pids: list[int], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    left = [p for p in pids if alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert not left, f"processes left behind: {left}"


def with_descendants(pids: list[int]) -> list[int]:
    """`pids` and every process below them (a node's per-client workers), from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    found, todo = [], list(pids)
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def node_pids(log_dir: Path) -> list[int]:
    """The node pids that the nodes printed in their logs (local and ssh alike)."""
    pids = []
    for log in sorted(log_dir.glob("*.log")):
        m = re.search(r"tbrpc node pid (\d+)", log.read_text(errors="replace"))
        if m:
            pids.append(int(m.group(1)))
    return pids


CHAT = [{"role": "user", "content": "Name a French city."}]


@cache
def spy_on_starts() -> list[Any]:
    """The nodes tbrpc.Llama and launch start from now on in this process, as they start them
    (tbrpc.node_processes.start_process watched)."""
    import tbrpc.node_processes as processes

    started: list[Any] = []
    original = processes.start_process

    def spy(*args: Any) -> Any:
        node = original(*args)
        started.append(node)
        return node

    processes.start_process = spy
    return started


def layer_weight_bytes(model: Path) -> int:
    """Bytes of all repeating-layer tensors (blk.*), which a split must all put on the nodes."""
    reader = gguf.GGUFReader(model)
    return sum(int(t.n_bytes) for t in reader.tensors if t.name.startswith("blk."))


def baseline(model: Path, prompt: str, max_tokens: int, n_ctx: int = 256, chat_format: str | None = None) -> dict[str, Any]:
    """Greedy completion (and chat, with chat_format) in one plain process with the kernels nodes use
    (use_extra_bufts=False)."""
    code = textwrap.dedent(f"""
        import json
        from tests.reference import reference_llama
        llm = reference_llama({str(model)!r}, n_ctx={n_ctx}, verbose=False, chat_format={chat_format!r})
        out = llm.create_completion({prompt!r}, max_tokens={max_tokens}, temperature=0)
        result = {{"text": out["choices"][0]["text"], "usage": out["usage"]}}
        if {chat_format!r}:
            chat = llm.create_chat_completion(messages={CHAT!r}, max_tokens={max_tokens}, temperature=0)
            result["chat"] = chat["choices"][0]["message"]["content"]
        print(json.dumps(result))
    """)
    proc = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@dataclass
class Launch:
    """`tbrpc launch` running as a child process, its stderr collected by a thread."""

    proc: subprocess.Popen[str]
    log_dir: Path
    stdout_path: Path
    err_lines: list[str] = field(default_factory=list)

    @property
    def stderr(self) -> str:
        return "".join(self.err_lines)

    @property
    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout: float = 120.0) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(pattern, self.stderr)
            if m:
                return m
            if self.proc.poll() is not None:
                time.sleep(0.2)
                m = re.search(pattern, self.stderr)
                if m:
                    return m
                raise AssertionError(f"launch exited ({self.proc.returncode}) before {pattern!r}:\n{self.stderr}")
            time.sleep(0.02)
        raise AssertionError(f"no {pattern!r} after {timeout} s:\n{self.stderr}")

    def http_base(self) -> str:
        return self.wait_for(r"serving OpenAI-compatible API on (http://\S+/v1)").group(1)

    def finish(self, timeout: float = 60.0) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"launch did not stop in {timeout} s:\n{self.stderr}")

    def node_pids(self) -> list[int]:
        return node_pids(self.log_dir)

    def __enter__(self) -> "Launch":
        return self

    def __exit__(self, *exc: object) -> None:
        """A launch a test leaves running (it failed midway) is killed, not left behind."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def start_launch(tmp_path: Path, *args: str, stdin_text: str | None = None, shadow: Path | None = None,
                 env: dict[str, str] | None = None) -> Launch:
    """`tbrpc launch ARGS` in the background; `shadow` is a directory put first on its PYTHONPATH."""
    log_dir = tmp_path / f"logs-{time.monotonic_ns()}"
    stdout_path = tmp_path / f"stdout-{time.monotonic_ns()}.txt"
    out = open(stdout_path, "w")
    stdin: Any = subprocess.DEVNULL
    if stdin_text is not None:
        stdin = open(tmp_path / f"stdin-{time.monotonic_ns()}.txt", "w+")
        stdin.write(stdin_text)
        stdin.seek(0)
    proc = subprocess.Popen([sys.executable, "-m", "tbrpc.cli", "launch", "--log-dir", str(log_dir), *args],
                            cwd=tmp_path, env=_shadowed(shadow) if shadow else env or ENV, stdin=stdin, stdout=out, stderr=subprocess.PIPE,
                            text=True)
    out.close()
    launch = Launch(proc, log_dir, stdout_path)

    def pump() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            launch.err_lines.append(line)

    threading.Thread(target=pump, daemon=True).start()
    return launch


def _shadowed(first: Path) -> dict[str, str]:
    return {**ENV, "PYTHONPATH": os.pathsep.join((str(first), ENV["PYTHONPATH"]))}


def http_json(url: str, body: dict[str, Any] | None = None, timeout: float = 120.0) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def http_stream(url: str, body: dict[str, Any], timeout: float = 120.0) -> list[dict[str, Any]]:
    """Server-sent events of a streaming request, as JSON objects (without [DONE])."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    events = []
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def python_wrapper(tmp_path: Path) -> Path:
    """An interpreter path that imports this checkout's tbrpc (what `python =` names on a node)."""
    wrapper = tmp_path / "python-with-tbrpc"
    wrapper.write_text(f"#!/bin/sh\nPYTHONPATH={ROOT} exec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    return wrapper


@dataclass
class Sshd:
    proc: subprocess.Popen[bytes]
    port: int
    key: Path
    known_hosts: Path

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_sshd(tmp_path: Path) -> Sshd | str:
    """A private sshd on a free loopback port that accepts a key made here; a reason string if it cannot run."""
    sshd = shutil.which("sshd") or ("/usr/sbin/sshd" if Path("/usr/sbin/sshd").exists() else None)
    if sshd is None or shutil.which("ssh") is None or shutil.which("ssh-keygen") is None:
        return "no OpenSSH server/client on this machine (apt-get install openssh-server openssh-client)"
    d = tmp_path / "sshd"
    d.mkdir()
    key, host_key = d / "id_ed25519", d / "host_ed25519"
    for path in (key, host_key):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
    authorized = d / "authorized_keys"
    authorized.write_text((d / "id_ed25519.pub").read_text())
    authorized.chmod(0o600)
    port = free_port()
    config = d / "sshd_config"
    config.write_text(textwrap.dedent(f"""\
        Port {port}
        ListenAddress 127.0.0.1
        HostKey {host_key}
        AuthorizedKeysFile {authorized}
        PasswordAuthentication no
        KbdInteractiveAuthentication no
        UsePAM no
        StrictModes no
        PidFile none
        AllowUsers {os.environ.get("USER") or _user()}
        """))
    Path("/run/sshd").mkdir(exist_ok=True) if os.geteuid() == 0 else None
    log = d / "sshd.log"
    proc = subprocess.Popen([sshd, "-D", "-e", "-f", str(config)], stdout=subprocess.DEVNULL, stderr=open(log, "wb"))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"sshd cannot run here: {log.read_text(errors='replace')[-500:]}"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return Sshd(proc, port, key, d / "known_hosts")
        except OSError:
            time.sleep(0.1)
    proc.kill()
    proc.wait()
    return "sshd did not start listening in 10 s"


def _user() -> str:
    import pwd

    return pwd.getpwuid(os.getuid()).pw_name


# --- node processes and a head process -----------------------------------------


@dataclass
class NodeProcess:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def start_node(tmp_path: Path, *extra: str, cwd: Path = ROOT, env: dict[str, str] | None = None) -> NodeProcess:
    """Start `tbrpc node` on a free port and wait until it listens (`env`: its whole environment).

    The interpreter runs isolated (-I), as the installed `tbrpc` script does:
    it imports the installed tbrpc, never one from the working directory."""
    log = tmp_path / f"node-{time.monotonic_ns()}.log"
    stderr = open(log, "wb")
    proc = subprocess.Popen([sys.executable, "-I", "-m", "tbrpc.cli", "node", "--port", "0", "--threads", "1", *extra],
                            cwd=cwd, stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True, env=env)
    deadline = time.time() + 30
    while time.time() < deadline:
        port = listening_port(log.read_text(errors="replace"))
        if port is not None:
            return NodeProcess(proc, port, log)
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"node did not start: {log.read_text(errors='replace')}")


def stop_nodes(started: list[NodeProcess]) -> None:
    """SIGTERM every node; fail the test if one ignores it (it is killed then)."""
    for node in started:
        if node.proc.poll() is None:
            node.proc.terminate()
    for node in started:
        try:
            node.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            where = _threads_of(node.proc.pid)
            node.proc.kill()
            node.proc.wait()
            pytest.fail(f"node {node.endpoint} ignored SIGTERM; its threads were:\n{where}\n"
                        f"log:\n{node.log_text()[-2000:]}")


def _threads_of(pid: int) -> str:
    """State and kernel wait channel of every thread of pid and its children (Linux), to see where it hangs."""
    lines = []
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            for task in sorted(Path(f"/proc/{p}/task").iterdir()):
                stat = (task / "stat").read_text()
                name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
                lines.append(f"  pid {p} tid {task.name} {name!r} state {rest[0]} wchan {(task / 'wchan').read_text()}")
                todo += [int(c) for c in (task / "children").read_text().split()]
        except OSError as e:
            lines.append(f"  pid {p}: {e}")
    return "\n".join(lines)


def assert_every_pair_linked(result: dict[str, Any], kind: str) -> None:
    """Each node of a head's result has a link to every other node (what an
    all-reduce needs), and each link is carried by `kind` ("shm 16x256K", ...)."""
    endpoints = [n["endpoint"] for n in result["nodes"]]
    for node in result["nodes"]:
        links = {link["to"]: (link["usable"], link["transport"]) for link in node["peer_links"]}
        want = {e: (True, kind) for e in endpoints if e != node["endpoint"]}
        assert links == want, (node["endpoint"], node["peer_links"])


def assert_ring_linked(result: dict[str, Any], kind: str) -> None:
    """Each node of a head's result has exactly one link, to the next node in
    node order (the last to the first), carried by `kind`; its all-reduce is a ring."""
    endpoints = [n["endpoint"] for n in result["nodes"]]
    for i, node in enumerate(result["nodes"]):
        links = {link["to"]: (link["usable"], link["transport"]) for link in node["peer_links"]}
        assert links == {endpoints[(i + 1) % len(endpoints)]: (True, kind)}, (node["endpoint"], node["peer_links"])
        assert node["allreduce"] == "ring", node


def record_of(result_nodes: list[dict], names: list[str]) -> list[dict]:
    """A launch record's nodes (tbrpc/status.py, connection_records) from tests/head.py's node infos."""
    from tbrpc.client import NodeInfo, PeerLink
    from tbrpc.status import connection_records

    infos = [NodeInfo(**{**n, "peer_links": tuple(PeerLink(**link) for link in n["peer_links"])}) for n in result_nodes]
    by_endpoint = dict(zip((n["endpoint"] for n in result_nodes), names))
    found = connection_records(infos, by_endpoint)
    return [{"name": name, **found[n["endpoint"]]} for n, name in zip(result_nodes, names)]


def head_process(tmp_path: Path, **spec: Any) -> tuple[subprocess.CompletedProcess[bytes], Path]:
    """Run tests/head.py in a fresh process, whatever becomes of it: the finished
    process and the path its result is written to (absent if it died)."""
    tag = time.monotonic_ns()
    spec.setdefault("logits_path", str(tmp_path / f"logits-{tag}.npy"))
    spec_path, out_path = tmp_path / f"spec-{tag}.json", tmp_path / f"out-{tag}.json"
    spec_path.write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "head.py"), str(spec_path), str(out_path)],
                          cwd=ROOT, capture_output=True, timeout=600)
    return proc, out_path


def run_head(tmp_path: Path, **spec: Any) -> tuple[dict[str, Any], np.ndarray | None]:
    """Run tests/head.py in a fresh process; return its result and logits."""
    spec.setdefault("logits_path", str(tmp_path / f"logits-{time.monotonic_ns()}.npy"))
    proc, out_path = head_process(tmp_path, **spec)
    assert proc.returncode == 0, f"head process died ({proc.returncode}): {proc.stderr.decode(errors='replace')[-3000:]}"
    result = json.loads(out_path.read_text())
    result["stderr"] = proc.stderr.decode(errors="replace")
    logits = np.load(spec["logits_path"]) if Path(spec["logits_path"]).exists() else None
    return result, logits
