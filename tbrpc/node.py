"""Running a node: the C server (ggml_backend/node.c) driven from Python.

The C loop runs in a thread with the GIL released; the calling thread stays
in Python so SIGINT/SIGTERM handlers can run and stop the server cleanly.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tbrpc import defaults
from tbrpc import secret as cluster_secret
from tbrpc.client import NodeStatus, _status_from_c
from tbrpc.native import TbrpcError, error_buffer, load, text

ISOLATION = {"auto": -1, "thread": 0, "process": 1, "spawn": 2}
PACKAGE_PARENT = str(Path(__file__).resolve().parent.parent)   # the directory this tbrpc is imported from
# argv[1] is PACKAGE_PARENT; the worker's own options follow it
WORKER_BOOTSTRAP = ("import sys; sys.path.insert(0, sys.argv.pop(1)); "
                    "from tbrpc._worker import main; sys.exit(main())")


@dataclass
class NodeConfig:
    host: str = "127.0.0.1"
    port: int = defaults.PORT
    device: str | None = None     # ggml device name; None = the best one (GPU/Metal, else CPU)
    threads: int = 0              # compute threads; 0 = ggml's default
    name: str | None = None
    log_path: str | None = None
    timeout: float = defaults.STALL_TIMEOUT_S   # a client silent mid-message for this long is dropped
    isolation: str = "auto"       # a worker per client: "process" (forked), "spawn" (a fresh process), "thread";
                                  # "auto": process, spawn on macOS (Metal does not survive fork)
    model_dirs: list[str] = field(default_factory=list)  # clients may load weights from *.gguf files here
    secret_file: str | None = None   # the cluster secret heads and peers must prove (None: $TBRPC_SECRET_FILE, else none)
    insecure: bool = False        # serve a non-loopback address without a secret
    max_clients: int = 0          # clients served at once; 0: the most the node allows (64)
    idle_timeout: float = 0.0     # seconds a client holding no buffer may stay silent; 0: ten minutes


def is_loopback(host: str) -> bool:
    """True when `host` can only be reached from this machine."""
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return all(ipaddress.ip_address(a[4][0]).is_loopback for a in socket.getaddrinfo(host, None))
        except OSError:
            return False


def node_secret(config: NodeConfig) -> bytes | None:
    """The node's secret; refuses to serve beyond this machine without one unless told `insecure`."""
    path = cluster_secret.file_for(config.secret_file)
    secret = cluster_secret.read(path) if path else None
    if secret is None and not config.insecure and not is_loopback(config.host):
        raise TbrpcError(
            f"tbrpc node: refusing to listen on {config.host} without a cluster secret: anyone who reaches that "
            "address could use this machine. Give every node and head the same secret (`tbrpc secret new PATH`, "
            "then --secret-file PATH or TBRPC_SECRET_FILE; docs/cluster.md), or pass --insecure on a network "
            "you trust")
    return secret


def worker_command(config: NodeConfig, model_dirs: str) -> list[str]:
    """How the node starts a spawned worker (tbrpc/_worker.py); the C side appends the descriptors.

    The worker must run the very tbrpc this node runs, whatever directory the
    node was started from: ``python -m`` would put the working directory first
    on ``sys.path``, where a source checkout's ``tbrpc`` (without its built
    extension) would win. So the interpreter runs isolated (``-I``: no working
    directory, no PYTHONPATH, no user site) and is told where this tbrpc is.
    """
    secret_file = cluster_secret.file_for(config.secret_file)
    return [sys.executable, "-I", "-c", WORKER_BOOTSTRAP, PACKAGE_PARENT,
            "--host", config.host, "--device", config.device or "",
            "--threads", str(config.threads), "--log-file", os.path.abspath(config.log_path) if config.log_path else "",
            "--timeout-ms", str(int(config.timeout * 1000)), "--model-dirs", model_dirs,
            "--secret-file", os.path.abspath(secret_file) if secret_file else "",
            "--idle-timeout-ms", str(int(config.idle_timeout * 1000))]


class NodeServer:
    """One node. ``start()`` serves in a background thread; ``serve_forever()`` blocks."""

    def __init__(self, config: NodeConfig) -> None:
        ffi, lib = load()
        self._ffi, self._lib = ffi, lib
        self.config = config
        secret = node_secret(config)
        self.authenticated = secret is not None
        dirs = os.pathsep.join(os.path.abspath(d) for d in config.model_dirs)
        keep = [ffi.new("char[]", (s or "").encode())
                for s in (config.host, config.device, config.name, config.log_path, dirs)]
        worker = [ffi.new("char[]", arg.encode()) for arg in worker_command(config, dirs)]
        key = ffi.new("uint8_t[]", secret) if secret else ffi.NULL
        self._keep = keep + worker + [key]   # the C side copies what it keeps, but only when tb_node_create runs
        worker_argv = ffi.new("const char *[]", worker + [ffi.NULL])
        c_cfg = ffi.new("struct tb_node_config *", {
            "host": keep[0], "port": config.port, "device": keep[1], "threads": config.threads,
            "name": keep[2],
            "log_path": keep[3], "timeout_ms": int(config.timeout * 1000),
            "model_dirs": keep[4], "isolation": ISOLATION[config.isolation], "worker_argv": worker_argv,
            "secret": key, "secret_len": len(secret or b""), "max_clients": config.max_clients,
            "idle_timeout_ms": int(config.idle_timeout * 1000),
        })
        err = error_buffer()
        self._node = lib.tb_node_create(c_cfg, err, len(err))
        if self._node == ffi.NULL:
            raise TbrpcError(f"tbrpc node: {text(err)}")
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._lib.tb_node_port(self._node))

    @property
    def endpoint(self) -> str:
        return f"{self.config.host}:{self.port}"

    def start(self) -> "NodeServer":
        self._thread = threading.Thread(target=self._lib.tb_node_serve, args=(self._node,), daemon=True,
                                        name=f"tbrpc-node-{self.port}")
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._node is None:
            return
        self._lib.tb_node_stop(self._node)
        if self._thread is not None:
            self._thread.join()
        self._lib.tb_node_free(self._node)
        self._node = None

    def status(self) -> NodeStatus:
        out = self._ffi.new("struct tb_status *")
        self._lib.tb_node_get_status(self._node, out)
        return _status_from_c(out)

    def serve_forever(self) -> None:
        """Serve until SIGINT or SIGTERM, then stop cleanly (buffers freed, clients closed)."""
        # A plain flag, not threading.Event: the handler runs in the main thread
        # between bytecodes, possibly inside Event.wait() while it holds the
        # Event's (non-reentrant) lock, and Event.set() there would deadlock.
        stop_signal: list[int] = []

        def on_signal(signum: int, frame: Any) -> None:
            stop_signal.append(signum)

        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.start()
            while not stop_signal:
                if self._thread is not None and not self._thread.is_alive():
                    break
                time.sleep(0.2)
        finally:
            self.stop()
            for s, handler in previous.items():
                signal.signal(s, handler)
