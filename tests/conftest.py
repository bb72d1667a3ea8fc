"""Shared fixtures: real node processes on loopback and a head runner."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


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


def start_node(tmp_path: Path, *extra: str, cwd: Path = ROOT) -> NodeProcess:
    """Start `tbrpc node` on a free port and wait until it listens.

    The interpreter runs isolated (-I), as the installed `tbrpc` script does:
    it imports the installed tbrpc, never one from the working directory."""
    log = tmp_path / f"node-{time.monotonic_ns()}.log"
    stderr = open(log, "wb")
    proc = subprocess.Popen([sys.executable, "-I", "-m", "tbrpc.cli", "node", "--port", "0", "--threads", "1", *extra],
                            cwd=cwd, stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True)
    deadline = time.time() + 30
    while time.time() < deadline:
        m = re.search(r"listening on [^:]+:(\d+)", log.read_text(errors="replace"))
        if m:
            return NodeProcess(proc, int(m.group(1)), log)
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"node did not start: {log.read_text(errors='replace')}")


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[Any]:
    """Factory: nodes(n) starts n node processes, all stopped (and checked gone) after the test."""
    started: list[NodeProcess] = []

    def factory(n: int, *extra: str, cwd: Path = ROOT) -> list[NodeProcess]:
        new = [start_node(tmp_path, *extra, cwd=cwd) for _ in range(n)]
        started.extend(new)
        return new

    yield factory
    stop_nodes(started)


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


def run_head(tmp_path: Path, **spec: Any) -> tuple[dict[str, Any], np.ndarray | None]:
    """Run tests/head.py in a fresh process; return its result and logits."""
    tag = time.monotonic_ns()
    spec.setdefault("logits_path", str(tmp_path / f"logits-{tag}.npy"))
    spec_path, out_path = tmp_path / f"spec-{tag}.json", tmp_path / f"out-{tag}.json"
    spec_path.write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "head.py"), str(spec_path), str(out_path)],
                          cwd=ROOT, capture_output=True, timeout=600)
    assert proc.returncode == 0, f"head process died ({proc.returncode}): {proc.stderr.decode(errors='replace')[-3000:]}"
    result = json.loads(out_path.read_text())
    result["stderr"] = proc.stderr.decode(errors="replace")
    logits = np.load(spec["logits_path"]) if Path(spec["logits_path"]).exists() else None
    return result, logits
