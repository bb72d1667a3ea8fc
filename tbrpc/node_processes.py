"""Starting and stopping nodes: on this machine, or on others over ssh.

A node is started as ``python -m tbrpc._supervised <tbrpc node options>``
with a pipe on its standard input (through ``ssh`` for remote nodes), so it
stops by itself when its launcher goes away, however that happens. A node
that already answers the handshake at its address is used as it is and left
running at the end: ``launch`` stops exactly what it started.

Every failure names the node, the step (start, handshake, ...) and what to
try. A node that answers but whose handshake fails raises the NodeError of
that cause, as ``tbrpc.connect`` does (``NodeUnreachable``,
``AuthenticationError``, ...); a node process that would not start or stop
raises ``LaunchError``, a NodeError too.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

from tbrpc import defaults
from tbrpc import secret as cluster_secret
from tbrpc.client import (
    AuthenticationError,
    NodeError,
    NodeInfo,
    NodeUnreachable,
    NodeVersionMismatch,
    probe,
)
from tbrpc.client import cluster as client_cluster
from tbrpc.native import TbrpcError
from tbrpc.spec import NodeSpec, split_endpoint

_LISTENING_RE = re.compile(r"tbrpc node listening on \S+?:(\d+)")   # what `tbrpc node` prints (cli.py)
_PID_RE = re.compile(r"tbrpc node pid (\d+)")


def step_message(node: str, step: str, what: str, hint: str = "") -> str:
    """node NODE, step STEP: WHAT, then the hint on a line of its own."""
    message = f"node {node}, step {step}: {what}"
    return message + f"\n  try: {hint}" if hint else message


class LaunchError(NodeError):
    """A node process could not be started or stopped; the message names it, the step and a fix."""

    kind = "launch"

    def __init__(self, node: str, step: str, what: str, hint: str = "", endpoint: str | None = None) -> None:
        super().__init__(step_message(node, step, what, hint), endpoint)
        self.node, self.step, self.what, self.hint = node, step, what, hint


def listening_port(log: str) -> int | None:
    """The port a node's log (its stderr) says it listens on, once it does; else None."""
    m = _LISTENING_RE.search(log)
    return int(m.group(1)) if m else None


def step_error(spec: NodeSpec, step: str, what: str, hint: str = "") -> LaunchError:
    return LaunchError(f"{spec.name} ({spec.endpoint})", step, what, hint, spec.endpoint)


def handshake_error(spec: NodeSpec, error: NodeError) -> NodeError:
    """`error` (why `spec`'s node did not complete the handshake) again, of the same class, its
    message naming the node and step handshake, with what to try."""
    again = type(error)(step_message(f"{spec.name} ({spec.endpoint})", "handshake", str(error),
                                     handshake_hint(spec, error)), error.endpoint or spec.endpoint, error.peer)
    again.step = "handshake"
    return again


# Handshake failures that waiting will not cure: launch stops at once.
FINAL = (NodeVersionMismatch, AuthenticationError)


def handshake_hint(spec: NodeSpec, error: NodeError) -> str:
    """What to try when the handshake with a node failed with `error`."""
    if isinstance(error, NodeVersionMismatch):
        return ("install the same tbrpc and llama-cpp-python versions on the head and on this node "
                "(`python -c 'import tbrpc, llama_cpp; print(llama_cpp.__version__)'` on both)")
    if isinstance(error, AuthenticationError):
        return ("give the head and this node the same secret file: `--secret-file PATH` (or TBRPC_SECRET_FILE, "
                "or `secret_file` in the cluster file); `tbrpc secret new PATH` makes one (docs/cluster.md)")
    if isinstance(error, NodeUnreachable):
        how = {"local": "it is started by launch; see its log",
               "ssh": f"check that {spec.ssh_destination()} can start it: see its log",
               "manual": f"start it there by hand: {start_command(spec)}"}
        return (f"is the node running and listening on {spec.endpoint}? {how[spec.start]}; "
                "a firewall may also block the port")
    return "see the node's log; run `tbrpc doctor` for a check of every node"


def start_command(spec: NodeSpec) -> str:
    """The command that starts `spec`'s node by hand on its machine (a node of ``start = "manual"``):
    the options launch gives the nodes it starts itself (`_node_argv`), as one types them there."""
    return " ".join(_remote_word(w) for w in ["tbrpc", "node", *_node_argv(spec, spec.port)])


def head_secret_file(spec: NodeSpec) -> str | None:
    """The secret file this process proves to `spec`'s node: the node's own for a node on this
    machine that has one, else None (this process's: tbrpc/secret.py)."""
    return spec.secret_file if spec.start == "local" and spec.secret_file else None


def _tail(path: Path | None, lines: int = 12) -> str:
    if path is None or not path.exists():
        return ""
    text = path.read_text(errors="replace").strip().splitlines()
    return "\n    ".join(text[-lines:])


@dataclass
class RunningNode:
    """A node this process started (``proc`` is the node itself, or the ssh client holding it)."""

    spec: NodeSpec
    proc: subprocess.Popen[bytes]
    log_path: Path
    port: int = 0
    pid: int | None = None     # the node's own pid, on the machine it runs on
    listening: bool = False    # its log says it listens (and, for port 0, on which port)
    started: float = field(default_factory=time.monotonic)   # when it was started, for "not listening after"

    @property
    def endpoint(self) -> str:
        return f"{self.spec.host}:{self.port}"

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def read_log_facts(self) -> None:
        text = self.log_text()   # read once: the port and "listening" must come from the same text
        if self.pid is None and (m := _PID_RE.search(text)):
            self.pid = int(m.group(1))
        if not self.listening and (port := listening_port(text)) is not None:
            self.listening = True
            self.port = self.port or port

    def begin_stop(self) -> None:
        """Ask the node to stop: end of its stdin (over ssh too), and SIGTERM to a local node, then
        SIGCONT to its process group: a node someone stopped (SIGSTOP, ^Z) would otherwise hold
        the SIGTERM until the stop timeout kills it."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        if self.proc.poll() is None and self.spec.start == "local":
            self._signal(signal.SIGTERM)
            try:
                os.killpg(self.proc.pid, signal.SIGCONT)   # its own group (start_new_session), workers included
            except (ProcessLookupError, PermissionError):
                pass

    def finish_stop(self, deadline: float) -> None:
        """Wait until `deadline` (monotonic), then make sure: ssh kill by pid, SIGKILL."""
        try:
            self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            if self.spec.start == "ssh":
                self._remote_kill()
            self._signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self, timeout: float = defaults.STOP_TIMEOUT_S) -> None:
        """Stop the node: end of its stdin, then SIGTERM, then SIGKILL. Idempotent."""
        self.begin_stop()
        self.finish_stop(time.monotonic() + timeout)

    def _signal(self, sig: int) -> None:
        try:
            self.proc.send_signal(sig)
        except ProcessLookupError:
            pass

    def _remote_kill(self) -> None:
        if self.pid is None:
            return
        cmd = f"kill -TERM {self.pid} 2>/dev/null; sleep 2; kill -KILL {self.pid} 2>/dev/null; true"
        subprocess.run(self.spec.ssh_argv(cmd), stdin=subprocess.DEVNULL, capture_output=True, timeout=30)


def model_dir(spec: NodeSpec, head_model: str | None) -> str | None:
    """The directory a node may load weights from: that of its `model`, else (local nodes) the head's."""
    path = spec.model or (head_model if spec.start == "local" else None)
    if not path:
        return None
    parent = os.path.dirname(path)
    if spec.start == "local":
        return os.path.abspath(os.path.expanduser(parent or "."))
    return parent or "."


def _node_argv(spec: NodeSpec, port: int, head_model: str | None = None) -> list[str]:
    args = ["--host", spec.listen_address, "--port", str(port), "--name", spec.name]
    directory = model_dir(spec, head_model)
    if directory:
        args += ["--model-dir", directory]
    if spec.device:
        args += ["--device", spec.device]
    if spec.threads:
        args += ["--threads", str(spec.threads)]
    if spec.node_log_file:
        args += ["--log-file", spec.node_log_file]
    # This process's secret is a path on this machine: for a node over ssh only its own `secret_file`
    # is one; a node started by hand is told the head's path when it has none (the same path everywhere).
    secret_file = spec.secret_file or (cluster_secret.file_for() if spec.start != "ssh" else None)
    if secret_file:
        args += ["--secret-file", secret_file]
    return args


def _remote_word(word: str) -> str:
    """Quote for the remote shell, keeping a leading ~/ expandable."""
    if word.startswith("~/"):
        return '"$HOME"/' + shlex.quote(word[2:])
    return shlex.quote(word)


def start_process(spec: NodeSpec, log_dir: Path, head_model: str | None = None) -> RunningNode:
    """Start the node process (without waiting for it to answer).

    The node may load weights from the directory of its `model` (local nodes:
    of the head's model), so they need not cross the network.
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{spec.name}.log"
    port = spec.port
    if spec.start == "local":
        python = spec.python or sys.executable
        argv = [python, "-m", "tbrpc._supervised", *_node_argv(spec, port, head_model)]
        env = dict(os.environ)
        here = str(Path(__file__).resolve().parent.parent)
        if not spec.python:  # the same tbrpc as this process, wherever it is imported from
            env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    elif spec.start == "ssh":
        python = spec.python or "python3"
        remote = " ".join(_remote_word(w) for w in [python, "-m", "tbrpc._supervised",
                                                     *_node_argv(spec, port, head_model)])
        argv = spec.ssh_argv("exec " + remote)
        env = None
    else:
        raise ValueError(f"node {spec.name} is started by hand (start = \"manual\")")
    with open(log_path, "wb") as log:
        log.write(f"$ {shlex.join(argv)}\n".encode())
        log.flush()
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=log, stderr=log, env=env,
                                    start_new_session=True)
        except OSError as exc:
            raise step_error(spec, "start", f"cannot run {argv[0]}: {exc}",
                             "install OpenSSH's client" if spec.start == "ssh" else "check `python` in the cluster file") from exc
    return RunningNode(spec=spec, proc=proc, log_path=log_path, port=port)


def how_it_ended(returncode: int) -> str:
    """How a process that has ended ended, from its Popen return code, in words a user acts on:
    "exited with code 3", or, for a signal, which and what usually sends it ("was killed by SIGKILL
    (the kernel's out-of-memory killer, or kill -9)")."""
    if returncode >= 0:
        return f"exited with code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        return f"was killed by signal {-returncode}"
    why = {"SIGKILL": "the kernel's out-of-memory killer, or kill -9", "SIGTERM": "asked to stop: kill, or a service manager",
           "SIGINT": "Ctrl-C, or kill -INT", "SIGHUP": "its terminal or ssh session closed",
           "SIGSEGV": "a crash: its log may say where", "SIGBUS": "a crash: a mapped file shrank, or a bad access",
           "SIGABRT": "an abort: its log says which check failed", "SIGFPE": "a crash: its log may say where",
           "SIGILL": "a crash: an instruction this CPU lacks"}.get(name)
    return f"was killed by {name}" + (f" ({why})" if why else "")


def _wait_listening(node: RunningNode, deadline: float) -> None:
    spec = node.spec
    while time.monotonic() < deadline:
        node.read_log_facts()
        if node.listening:
            return
        if not node.alive():
            how = "ssh" if spec.start == "ssh" else "the node process"
            raise step_error(spec, "start", f"{how} {how_it_ended(node.proc.returncode)} before listening; "
                             f"its log ({node.log_path}):\n    {_tail(node.log_path)}", _start_hint(spec, node.log_text()))
        time.sleep(0.05)
    raise step_error(spec, "start", f"not listening after {time.monotonic() - node.started:.0f} s; its log ({node.log_path}):\n    "
                     f"{_tail(node.log_path)}", _start_hint(spec, node.log_text()))


def until_answering(spec: NodeSpec, node: RunningNode | None, deadline: float) -> tuple[str, NodeInfo]:
    """Wait for a node to listen (one started here: its log says so) and to answer the handshake;
    returns its endpoint and what it said. A NodeError naming the node and step otherwise."""
    endpoint = spec.endpoint
    if node is not None:
        _wait_listening(node, deadline)
        endpoint = node.endpoint
    return endpoint, wait_handshake(spec, endpoint, deadline, node)


def _start_hint(spec: NodeSpec, log: str) -> str:
    if "Address already in use" in log or "address already in use" in log.lower():
        return f"port {spec.port} is taken on {spec.host} by something that is not a tbrpc node: pick another port"
    python = spec.python or (sys.executable if spec.start == "local" else "python3")
    where = "this machine" if spec.start == "local" else spec.ssh_destination()
    if "No module named 'tbrpc._native'" in log:
        return (f"tbrpc's C library is not built for {python} on {where}: reinstall tbrpc there "
                "(pip install tbrpc, or `make setup` in a checkout)")
    if "No module named" in log:
        return (f"tbrpc is not importable by {python} on {where}: install tbrpc there, "
                "or set `python = \"/path/to/venv/bin/python\"` for this node in the cluster file")
    if spec.start == "ssh" and ("Permission denied" in log or "Host key verification failed" in log
                                or "Could not resolve" in log or "Connection refused" in log):
        return (f"`{shlex.join(spec.ssh_argv('true'))}` must work by hand without a password "
                "(key in the cluster file, host key accepted once)")
    return "read the node's log above; `tbrpc doctor` checks every node"


def wait_handshake(spec: NodeSpec, endpoint: str, deadline: float, node: RunningNode | None = None) -> NodeInfo:
    """Probe `endpoint` until it answers the handshake; raise the NodeError of why not, naming the
    node and the step (LaunchError when the node process started here exited)."""
    last: NodeError = NodeUnreachable(f"tbrpc node {endpoint}: no answer yet")
    while True:
        try:
            return probe(endpoint, timeout=max(0.5, min(5.0, deadline - time.monotonic())),
                         secret_file=head_secret_file(spec))[0]
        except NodeError as exc:
            last = exc
            if isinstance(exc, FINAL):
                raise handshake_error(spec, exc) from exc
        if node is not None and not node.alive():
            raise step_error(spec, "start", f"the node {how_it_ended(node.proc.returncode)}; its log "
                             f"({node.log_path}):\n    {_tail(node.log_path)}", _start_hint(spec, node.log_text()))
        if time.monotonic() >= deadline:
            raise handshake_error(spec, last)
        time.sleep(0.1)


def answers(endpoint: str, timeout: float = 1.0, secret_file: str | None = None) -> tuple[NodeInfo | None, NodeError | None]:
    """(info, None) when a tbrpc node answers at `endpoint`, else (None, why)."""
    try:
        with socket.create_connection(split_endpoint(endpoint), timeout=timeout):
            pass
    except OSError as exc:
        return None, NodeUnreachable(f"unreachable: {exc}")
    try:
        return probe(endpoint, timeout=timeout * 5, secret_file=secret_file)[0], None
    except NodeError as exc:
        return None, exc


@dataclass
class Nodes:
    """The nodes of one cluster, up and answering; ``stop()`` stops those started here."""

    specs: list[NodeSpec]
    endpoints: list[str]
    infos: list[NodeInfo]
    started: list[RunningNode] = field(default_factory=list)
    _stopped: bool = False

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        stop_all(self.started)

    def failed(self) -> dict[int, str]:
        """Index -> what happened, for each node of this cluster that has failed: a node process
        started here that exited, or a connection of this process's Cluster that failed."""
        out: dict[int, str] = {}
        running = {n.endpoint: n for n in self.started}
        for i, (spec, endpoint) in enumerate(zip(self.specs, self.endpoints)):
            node = running.get(endpoint)
            if node is not None and not node.alive():
                out[i] = f"node {spec.name} ({endpoint}): the node process {how_it_ended(node.proc.returncode)}"
        for info in client_cluster().nodes():
            if info.failed and info.endpoint in self.endpoints:
                out.setdefault(self.endpoints.index(info.endpoint), info.error)
        return out

    def started_here(self, index: int) -> RunningNode | None:
        """The process this launch started for node `index`, if it started one."""
        return next((n for n in self.started if n.endpoint == self.endpoints[index]), None)

    def restart(self, index: int, head_model: str | None, timeout: float = defaults.START_TIMEOUT_S) -> NodeInfo:
        """Start node `index` again, on the port it had, after its process exited; wait until it
        answers. Its old log is kept beside the new one (NAME.log.1). A NodeError naming it otherwise."""
        old = self.started_here(index)
        if old is None or old.alive():
            raise ValueError(f"node {self.specs[index].name} was not started here, or still runs")
        old.stop()
        spec = replace(old.spec, port=old.port)
        old.log_path.replace(old.log_path.with_name(old.log_path.name + ".1"))
        new = start_process(spec, old.log_path.parent, head_model)
        self.started[self.started.index(old)] = new
        try:
            return until_answering(spec, new, time.monotonic() + timeout)[1]
        except BaseException:
            new.stop()
            raise

    def exited(self) -> int | None:
        """The index of the first node whose process, started here, has exited; else None."""
        return next((i for i in range(len(self.endpoints))
                     if (node := self.started_here(i)) is not None and not node.alive()), None)

    def blamed(self, error: TbrpcError | str, index: int | None = None) -> int | None:
        """The node to blame for `error`: `index` when given; else one whose process, started here,
        has exited (a node that could not reach an upstream node that died only witnessed it);
        else the node at the other end of the link the NodeError's node says failed it (``peer``:
        one that stopped answering has not exited); else the node a NodeError names by its
        endpoint; else None."""
        if index is not None or not isinstance(error, NodeError) or error.endpoint not in self.endpoints:
            return index
        dead = self.exited()
        if dead is not None:
            return dead
        return self.endpoints.index(error.peer if error.peer in self.endpoints else error.endpoint)

    def explain(self, step: str, error: TbrpcError | str, index: int | None = None) -> str:
        """`error` as: node NAME (endpoint), step STEP: ... try: ..., for node `index`, else the node
        to blame (``blamed``); otherwise: step STEP: ... When the blamed node is not the one the
        NodeError came from, what that one saw follows. A failure() message (a str) already says
        how the process ended; for a NodeError of a node whose process exited, that is added."""
        message = str(error)
        index = self.blamed(error, index)
        if index is None:
            return f"step {step}: {message}\n  try: `tbrpc doctor` checks every node"
        spec, endpoint, node = self.specs[index], self.endpoints[index], self.started_here(index)
        if isinstance(error, NodeError) and error.endpoint != endpoint and error.endpoint in self.endpoints:
            witness = self.specs[self.endpoints.index(error.endpoint)].name
            message = f"node {witness} ({error.endpoint}) saw: {message}"
        if node is not None and not node.alive() and isinstance(error, NodeError):
            died = f"the node process {how_it_ended(node.proc.returncode)}"
            message = f"{message} ({died})" if error.endpoint == endpoint else f"{died}; {message}"
        log = f"its log: {node.log_path}" if node else f"its log on {spec.host}"
        hint = f"{log}; `tbrpc status` shows its memory in use; `tbrpc doctor` checks every node; then launch again"
        message = message.removeprefix(f"node {spec.name} ({endpoint}): ")
        return f"node {spec.name} ({endpoint}), step {step}: {message}\n  try: {hint}"

    def explained(self, step: str, error: TbrpcError, index: int | None = None) -> TbrpcError:
        """`error` again, of the same class, its message explained (``explain``), its step set and,
        for a NodeError, the endpoint of the node blamed."""
        if isinstance(error, LaunchError):   # it names its node and step already
            return error
        if isinstance(error, NodeError):
            blamed = self.blamed(error, index)
            endpoint = error.endpoint if blamed is None else self.endpoints[blamed]
            again: TbrpcError = type(error)(self.explain(step, error, index), endpoint, error.peer)
        else:
            again = type(error)(self.explain(step, error, index))
        again.step = step
        return again

    def first_failure(self) -> tuple[int, str] | None:
        """(index, what happened) of the first failed node (``failed``), else None."""
        return next(iter(self.failed().items()), None)

    def pids(self) -> list[int]:
        """Pids of the node processes started here (on their own machines)."""
        return [n.pid for n in self.started if n.pid is not None]

    def __enter__(self) -> Nodes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def stop_all(nodes: Sequence[RunningNode], timeout: float = defaults.STOP_TIMEOUT_S) -> None:
    """Stop nodes in parallel, without threads (this also runs from __del__ at interpreter exit)."""
    for node in nodes:
        node.begin_stop()
    deadline = time.monotonic() + timeout
    for node in nodes:
        node.finish_stop(deadline)


def start_nodes(specs: Sequence[NodeSpec], log_dir: Path, timeout: float = defaults.START_TIMEOUT_S,
                on_event: object = None, head_model: str | None = None) -> Nodes:
    """Start (or find already running) every node and wait until each answers the handshake.

    `head_model`: the model the head will load (local nodes read its weights
    from disk). On any failure every node started here is stopped before the
    LaunchError is raised.
    """
    say = on_event if callable(on_event) else (lambda message: None)
    deadline = time.monotonic() + timeout
    started: list[RunningNode] = []
    slots: list[RunningNode | None] = []
    try:
        for spec in specs:
            found = None
            if spec.port:
                found, why = answers(spec.endpoint, secret_file=head_secret_file(spec))
                if found is None and isinstance(why, FINAL):
                    raise handshake_error(spec, why)
            if found is not None:
                say(f"node {spec.name}: already running at {spec.endpoint}, using it")
                slots.append(None)
            elif spec.start == "manual":   # said at once: nothing else shows while launch waits for it
                say(f"node {spec.name}: waiting up to {timeout:g} s for it to answer at {spec.endpoint} "
                    f"(start = \"manual\": launch does not start it); start it there: {start_command(spec)}")
                slots.append(None)
            else:
                say(f"node {spec.name}: starting ({spec.describe_start()})")
                new = start_process(spec, log_dir, head_model)
                started.append(new)
                slots.append(new)
        endpoints, infos = [], []
        for spec, slot in zip(specs, slots):
            endpoint, info = until_answering(spec, slot, deadline)
            say(f"node {spec.name}: {endpoint} answers ({info.node_device}, {info.mem_total / 2**30:.1f} GiB)")
            endpoints.append(endpoint)
            infos.append(info)
        return Nodes(list(specs), endpoints, infos, started)
    except BaseException:
        stop_all(started)
        raise


@contextmanager
def running(specs: Sequence[NodeSpec], log_dir: Path, timeout: float = defaults.START_TIMEOUT_S) -> Iterator[Nodes]:
    nodes = start_nodes(specs, log_dir, timeout)
    try:
        yield nodes
    finally:
        nodes.stop()
