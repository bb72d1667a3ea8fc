"""Benchmark: one model split over local nodes, tbrpc against llama.cpp's own RPC.

For every model and node count this runs, each in a fresh set of processes:

  single            the model in one process (the head alone, CPU, n_threads=1)
  single-norepack   the same without the CPU backend's weight repacking, i.e.
                    with the kernels the nodes and RPC servers use
  tbrpc             the head plus N ``tbrpc node`` processes (``--threads 1``)
  rpc               the head plus N llama.cpp RPC servers (``ggml_backend_rpc_start_server``
                    with 1 thread), from a separate venv whose llama-cpp-python 0.3.36
                    was built with -DGGML_RPC=ON (benchmarks/rpc_venv.sh)

and prints one table: load time, prompt tokens/s, generated tokens/s, and
bytes and round trips per generated token.

Traffic is counted the same way for both remote modes, by a small counting
TCP proxy between the head and each server: bytes each way, and "round
trips" = reply bursts (a server-to-client burst that follows client-to-server
bytes, i.e. a request the head waited on). The proxy also splits the request
stream into commands, so it can say which requests were waited on. It adds
latency, so timings come from direct runs (--rounds of them, interleaved
over all configurations) and traffic from one more run through the proxies.
tbrpc's own counters (tbrpc.cluster().nodes()) are printed next to the
proxy's figures as a cross-check.

Decoding is greedy (argmax of the logits, EOS ignored) from a fixed prompt;
the script checks that every run produced the same tokens and prints the
texts when they differ. It exits 1 if runs with the same kernels (all but
"single") disagree.

Usage (from the repo root, with the dev venv):

    benchmarks/rpc_venv.sh                      # once: builds .bench-venv-rpc/
    PYTHONPATH=. .venv/bin/python benchmarks/bench_split.py
    PYTHONPATH=. .venv/bin/python benchmarks/bench_split.py --models gemma --nodes 1,2 --modes single,tbrpc

This is a benchmark, not a test: nothing here asserts on timings.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import json
import os
import platform
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEFAULT_RPC_VENV = REPO / ".bench-venv-rpc"
RESULT_TAG = "BENCH_RESULT "
MODES = ("single", "single-norepack", "tbrpc", "tbrpc-tcp", "rpc")
TBRPC_MODES = ("tbrpc", "tbrpc-tcp")   # "tbrpc": the head's default transport (shared memory on one host)
LOCAL_MODES = ("single", "single-norepack")
MODELS = ("gemma", "deepseek2")

# 29 tokens with Gemma's tokenizer, BOS included (the tiny models' byte-level vocabularies make it ~110).
PROMPT = (
    "The printing press spread across Europe within fifty years of its invention in Mainz. "
    "Historians mostly agree that its most important consequence for ordinary people was"
)


# ---------------------------------------------------------------------------
# Counting TCP proxy
# ---------------------------------------------------------------------------

def _counts_add(a: dict[str, int], b: dict[str, int], sign: int = 1) -> dict[str, int]:
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0) + sign * v
    return {k: v for k, v in out.items() if v}


@dataclass(frozen=True)
class Traffic:
    """Bytes each way and reply bursts ("round trips") on one or more connections.

    `requests` counts requests by command; `waits` the command each reply burst
    answered (the last request sent before it), i.e. which requests cost a
    round trip. Both are empty when the protocol is not parsed.
    """

    bytes_up: int = 0      # head -> server
    bytes_down: int = 0    # server -> head
    round_trips: int = 0
    requests: dict[str, int] = field(default_factory=dict)
    waits: dict[str, int] = field(default_factory=dict)

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(self.bytes_up + other.bytes_up, self.bytes_down + other.bytes_down,
                       self.round_trips + other.round_trips,
                       _counts_add(self.requests, other.requests), _counts_add(self.waits, other.waits))

    def __sub__(self, other: Traffic) -> Traffic:
        return Traffic(self.bytes_up - other.bytes_up, self.bytes_down - other.bytes_down,
                       self.round_trips - other.round_trips,
                       _counts_add(self.requests, other.requests, -1), _counts_add(self.waits, other.waits, -1))

    @property
    def bytes_total(self) -> int:
        return self.bytes_up + self.bytes_down


# llama.cpp RPC, protocol 7.0.0 (ggml-rpc.cpp in llama-cpp-python 0.3.36):
#   request | cmd: u8 | size: u64 | size bytes |
RPC_COMMANDS = (
    "ALLOC_BUFFER", "GET_ALIGNMENT", "GET_MAX_SIZE", "BUFFER_GET_BASE", "FREE_BUFFER", "BUFFER_CLEAR",
    "SET_TENSOR", "SET_TENSOR_HASH", "GET_TENSOR", "COPY_TENSOR", "GRAPH_COMPUTE", "GET_DEVICE_MEMORY",
    "INIT_TENSOR", "GET_ALLOC_SIZE", "HELLO", "DEVICE_COUNT", "GRAPH_RECOMPUTE", "MEMSET_TENSOR",
)


def _tbrpc_command_names() -> dict[int, str]:
    """tbrpc's `enum tb_cmd`, read from ggml_backend/proto.h (it starts at HELLO = 1 and counts up)."""
    names: dict[int, str] = {}
    with contextlib.suppress(OSError):
        text = (REPO / "ggml_backend" / "proto.h").read_text()
        body = text[text.index("enum tb_cmd {"):]
        body = body[:body.index("};")]
        value = 0
        for line in body.splitlines()[1:]:
            name = line.split("//")[0].strip().rstrip(",")
            if not name.startswith("TB_CMD_") or name.startswith("TB_CMD_COUNT"):
                continue
            if "=" in name:
                name, number = (x.strip() for x in name.split("="))
                value = int(number)
            else:
                value += 1
            names[value] = name.removeprefix("TB_CMD_")
    return names


class RequestParser:
    """Splits the head-to-server byte stream into requests and yields their command names."""

    def __init__(self, protocol: str) -> None:
        # header layout, and which of its fields are the command and the payload length
        if protocol == "tbrpc":
            # struct tb_header { u32 magic; u16 cmd; u16 flags; u64 id; u64 len; }
            self._header, self._cmd_field, self._len_field = struct.Struct("<IHHQQ"), 1, 4
            self._names = _tbrpc_command_names()
        elif protocol == "rpc":
            self._header, self._cmd_field, self._len_field = struct.Struct("<BQ"), 0, 1
            self._names = dict(enumerate(RPC_COMMANDS))
        else:
            raise ValueError(protocol)
        self._pending = bytearray()
        self._skip = 0

    def feed(self, data: memoryview) -> list[str]:
        commands: list[str] = []
        i, n = 0, len(data)
        size = self._header.size
        while i < n:
            if self._skip:
                k = min(self._skip, n - i)
                self._skip -= k
                i += k
                continue
            take = min(size - len(self._pending), n - i)
            self._pending += data[i:i + take]
            i += take
            if len(self._pending) == size:
                fields = self._header.unpack(self._pending)
                cmd = int(fields[self._cmd_field])
                self._pending.clear()
                self._skip = int(fields[self._len_field])
                commands.append(self._names.get(cmd, f"cmd{cmd}"))
        return commands


class CountingProxy:
    """Forwards 127.0.0.1:<port> to `upstream`, counting bytes, requests and reply bursts.

    A reply burst starts when server-to-client bytes arrive after the client
    last sent something: however many packets a reply takes, and however many
    replyless ("posted") requests preceded it, it counts once. That is exactly
    one round trip the head had to wait for.
    """

    def __init__(self, upstream: str, protocol: str) -> None:
        host, port = upstream.rsplit(":", 1)
        self._upstream = (host, int(port))
        self._protocol = protocol
        self._lock = threading.Lock()
        self._bytes = {"up": 0, "down": 0}
        self._round_trips = 0
        self._requests: collections.Counter[str] = collections.Counter()
        self._waits: collections.Counter[str] = collections.Counter()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._closed = False
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept_loop, daemon=True, name=f"proxy-{upstream}").start()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self._listener.getsockname()[1]}"

    def snapshot(self) -> Traffic:
        with self._lock:
            return Traffic(self._bytes["up"], self._bytes["down"], self._round_trips,
                           dict(self._requests), dict(self._waits))

    def close(self) -> None:
        self._closed = True
        for s in [self._listener, *self._sockets]:
            with contextlib.suppress(OSError):
                s.close()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self._upstream)
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sockets += [client, server]
            # Shared by both pumps of this connection: direction of the last
            # bytes, and the last request sent (what a reply burst answers).
            state = {"last": "down", "request": "?"}
            parser = RequestParser(self._protocol)
            threading.Thread(target=self._pump, args=(client, server, "up", state, parser), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, "down", state, parser), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, direction: str, state: dict[str, str],
              parser: RequestParser) -> None:
        buf = bytearray(1 << 20)
        view = memoryview(buf)
        try:
            while True:
                n = src.recv_into(buf)
                if n == 0:
                    break
                # Count before forwarding, so a reply can never be seen before its request.
                with self._lock:
                    self._bytes[direction] += n
                    if direction == "up":
                        commands = parser.feed(view[:n])
                        self._requests.update(commands)
                        if commands:
                            state["request"] = commands[-1]
                    elif state["last"] == "up":
                        self._round_trips += 1
                        self._waits[state["request"]] += 1
                    state["last"] = direction
                dst.sendall(view[:n])
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)


# ---------------------------------------------------------------------------
# Worker: one configuration, in its own process
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class RunSpec:
    model: str
    gguf: str
    mode: str              # one of MODES
    endpoints: list[str]   # node / RPC server endpoints (empty for the local modes)
    proxy: bool            # route through counting proxies (traffic run)
    n_gen: int
    n_ctx: int
    repeats: int
    prompt: str


@dataclass
class RunResult:
    spec: RunSpec
    load_s: float
    prompt_tokens: int
    prompt_tps: list[float]            # one per repeat
    gen_tps: list[float]               # one per repeat
    tokens: list[int]                  # generated token ids (first repeat)
    text: str
    # Traffic per phase, from the proxies (traffic run only); gen summed over repeats.
    proxy_load: Traffic | None = None
    proxy_gen: Traffic | None = None
    proxy_first_step: Traffic | None = None   # the part of proxy_gen spent on each repeat's first step
    # tbrpc's own counters for the gen phase, summed over repeats (tbrpc mode only).
    tbrpc_gen: Traffic | None = None
    tbrpc_gen_messages: int | None = None
    devices: list[str] = field(default_factory=list)


def _libggml() -> ctypes.CDLL:
    """The ggml that libllama uses, with the prototypes this file needs.

    Not ctypes.CDLL(<llama_cpp/lib>/libggml.so): llama-cpp-python's wheel holds
    libggml.so and libggml.so.0 as two separate files (wheels cannot carry
    symlinks), libllama links the .so.0, and loading the other one gives a
    second, empty ggml registry. Symbols looked up through libllama's handle
    resolve in the libggml it is linked to.
    """
    import llama_cpp.llama_cpp as llama_lib

    lib: ctypes.CDLL = llama_lib._lib
    protos: dict[str, tuple[Any, list[Any]]] = {
        "ggml_backend_reg_by_name": (ctypes.c_void_p, [ctypes.c_char_p]),
        "ggml_backend_reg_get_proc_address": (ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_char_p]),
        "ggml_backend_register": (None, [ctypes.c_void_p]),
        "ggml_backend_dev_by_type": (ctypes.c_void_p, [ctypes.c_int]),
        "ggml_backend_dev_count": (ctypes.c_size_t, []),
        "ggml_backend_dev_get": (ctypes.c_void_p, [ctypes.c_size_t]),
        "ggml_backend_dev_name": (ctypes.c_char_p, [ctypes.c_void_p]),
    }
    for name, (restype, argtypes) in protos.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def _rpc_proc(ggml: ctypes.CDLL, name: str) -> int:
    """Address of an RPC backend function, found the way llama.cpp's tools do (get_proc_address)."""
    reg = ggml.ggml_backend_reg_by_name(b"RPC")
    if not reg:
        raise RuntimeError("this llama-cpp-python has no RPC backend: build it with benchmarks/rpc_venv.sh")
    address = ggml.ggml_backend_reg_get_proc_address(reg, name.encode())
    if not address:
        raise RuntimeError(f"the RPC backend does not export {name}")
    return int(address)


def _register_rpc_servers(endpoints: Sequence[str]) -> list[str]:
    """What llama.cpp's `--rpc` does (common/arg.cpp add_rpc_devices), via ctypes."""
    ggml = _libggml()
    add_server = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)(_rpc_proc(ggml, "ggml_backend_rpc_add_server"))
    for ep in endpoints:
        reg = add_server(ep.encode())
        if not reg:
            raise RuntimeError(f"ggml_backend_rpc_add_server({ep}) found no devices")
        ggml.ggml_backend_register(reg)
    return [ggml.ggml_backend_dev_name(ggml.ggml_backend_dev_get(i)).decode()
            for i in range(ggml.ggml_backend_dev_count())]


def _tbrpc_traffic() -> tuple[Traffic, int]:
    import tbrpc

    nodes = tbrpc.cluster().nodes()
    return (Traffic(sum(n.bytes_sent for n in nodes), sum(n.bytes_received for n in nodes),
                    sum(n.round_trips for n in nodes)),
            sum(n.messages for n in nodes))


@contextlib.contextmanager
def _weight_repacking(enabled: bool) -> Iterator[None]:
    """Turn off the CPU backend's weight repacking for one Llama() unless `enabled`.

    "single-norepack" is the one-process run with the kernels the remote modes
    use (plain CPU buffers, tbrpc/head_buffers.py); "single" keeps llama.cpp's
    default repacking, which runs other kernels (and aborts on CPUs with AMX).
    """
    if enabled:
        yield
        return
    from tbrpc.head_buffers import plain_cpu_buffers

    with plain_cpu_buffers():
        yield


def run_worker(spec: RunSpec) -> RunResult:
    protocol = "tbrpc" if spec.mode in TBRPC_MODES else spec.mode
    proxies = [CountingProxy(ep, protocol) for ep in spec.endpoints] if spec.proxy else []
    try:
        return _measure(spec, proxies)
    finally:
        for p in proxies:
            p.close()


def _measure(spec: RunSpec, proxies: list[CountingProxy]) -> RunResult:
    import llama_cpp
    import numpy as np

    endpoints = [p.endpoint for p in proxies] if spec.proxy else spec.endpoints

    def proxy_traffic() -> Traffic:
        return sum((p.snapshot() for p in proxies), Traffic())

    t0 = time.perf_counter()
    devices: list[str] = []
    if spec.mode in TBRPC_MODES:
        import tbrpc

        # through the counting proxy the bytes must cross TCP to be counted
        devices = tbrpc.connect(endpoints, transport="tcp" if spec.mode == "tbrpc-tcp" or spec.proxy else "auto")
    elif spec.mode == "rpc":
        devices = _register_rpc_servers(endpoints)
    remote = spec.mode not in LOCAL_MODES
    with _weight_repacking(spec.mode != "single-norepack"):
        llm = llama_cpp.Llama(
            model_path=spec.gguf,
            n_gpu_layers=-1 if remote else 0,
            tensor_split=[1.0] * len(endpoints) if remote else None,
            n_ctx=spec.n_ctx,
            n_threads=1,
            n_threads_batch=1,
            seed=0,
            verbose=False,
        )
    load_s = time.perf_counter() - t0
    after_load = proxy_traffic()
    # Free the model while the proxies still forward: llama.cpp's RPC client
    # talks to its servers on the way out, and at interpreter exit the proxy's
    # daemon threads are gone, which would hang it.
    try:
        n_vocab = llm.n_vocab()
        prompt_tokens = llm.tokenize(spec.prompt.encode(), add_bos=True)

        def next_token() -> int:
            logits = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
            return int(np.argmax(np.ctypeslib.as_array(logits, shape=(n_vocab,))))

        prompt_tps: list[float] = []
        gen_tps: list[float] = []
        first_tokens: list[int] = []
        gen_proxy = Traffic()
        first_step_proxy = Traffic()
        gen_tbrpc = Traffic()
        gen_messages = 0
        for repeat in range(spec.repeats):
            llm.reset()  # type: ignore[no-untyped-call]
            t = time.perf_counter()
            llm.eval(prompt_tokens)
            tok = next_token()
            prompt_tps.append(len(prompt_tokens) / (time.perf_counter() - t))
            generated = [tok]
            proxy_before = proxy_traffic()
            tbrpc_before, messages_before = _tbrpc_traffic() if spec.mode in TBRPC_MODES else (Traffic(), 0)
            t = time.perf_counter()
            for step in range(spec.n_gen):
                llm.eval([tok])
                tok = next_token()
                generated.append(tok)
                if step == 0 and proxies:
                    first_step_proxy += proxy_traffic() - proxy_before
            gen_tps.append(spec.n_gen / (time.perf_counter() - t))
            gen_proxy += proxy_traffic() - proxy_before
            if spec.mode in TBRPC_MODES:
                tbrpc_after, messages_after = _tbrpc_traffic()
                gen_tbrpc += tbrpc_after - tbrpc_before
                gen_messages += messages_after - messages_before
            if repeat == 0:
                first_tokens = generated
        text = llm.detokenize(first_tokens).decode("utf-8", errors="replace")
    finally:
        llm.close()

    return RunResult(
        spec=spec, load_s=load_s, prompt_tokens=len(prompt_tokens), prompt_tps=prompt_tps, gen_tps=gen_tps,
        tokens=first_tokens, text=text,
        proxy_load=after_load if spec.proxy else None,
        proxy_gen=gen_proxy if spec.proxy else None,
        proxy_first_step=first_step_proxy if spec.proxy else None,
        tbrpc_gen=gen_tbrpc if spec.mode in TBRPC_MODES else None,
        tbrpc_gen_messages=gen_messages if spec.mode in TBRPC_MODES else None,
        devices=devices,
    )


def _result_from_json(d: dict[str, Any]) -> RunResult:
    def traffic(v: dict[str, Any] | None) -> Traffic | None:
        return Traffic(**v) if v is not None else None

    d = dict(d)
    d["spec"] = RunSpec(**d["spec"])
    for key in ("proxy_load", "proxy_gen", "proxy_first_step", "tbrpc_gen"):
        d[key] = traffic(d[key])
    return RunResult(**d)


# ---------------------------------------------------------------------------
# llama.cpp RPC server (run by the RPC venv's Python)
# ---------------------------------------------------------------------------

def run_rpc_server(endpoint: str, threads: int) -> None:
    """Serve the CPU device with llama.cpp's RPC server (as tools/rpc/rpc-server.cpp does); blocks until killed."""
    ggml = _libggml()
    cpu = ggml.ggml_backend_dev_by_type(0)  # GGML_BACKEND_DEVICE_TYPE_CPU
    if not cpu:
        raise RuntimeError("no CPU ggml device")
    devices = (ctypes.c_void_p * 1)(cpu)
    # void ggml_backend_rpc_start_server(const char * endpoint, const char * cache_dir,
    #                                    size_t n_threads, size_t n_devices, ggml_backend_dev_t * devices)
    start_server = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t,
                                    ctypes.POINTER(ctypes.c_void_p))(_rpc_proc(ggml, "ggml_backend_rpc_start_server"))
    start_server(endpoint.encode(), None, threads, 1, devices)


# ---------------------------------------------------------------------------
# Orchestrator
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Config:
    model: str
    gguf: str
    mode: str
    n_nodes: int   # 0 for the local modes


@dataclass
class Row:
    config: Config
    timed: list[RunResult]          # one per round
    counted: RunResult | None       # the traffic run (remote modes only)

    @property
    def load_s(self) -> float:
        return statistics.median(t.load_s for t in self.timed)

    @property
    def prompt_tps(self) -> list[float]:
        return [x for t in self.timed for x in t.prompt_tps]

    @property
    def gen_tps(self) -> list[float]:
        return [x for t in self.timed for x in t.gen_tps]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_listening(endpoint: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 60.0) -> None:
    host, port = endpoint.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server for {endpoint} exited with {proc.returncode}:\n{log.read_text()[-2000:]}")
        with contextlib.suppress(OSError), socket.create_connection((host, int(port)), timeout=1):
            return
        time.sleep(0.05)
    raise RuntimeError(f"server for {endpoint} did not listen within {timeout:.0f}s")


class Runner:
    def __init__(self, python: str, rpc_python: str | None, log_dir: Path, n_gen: int, n_ctx: int,
                 repeats: int) -> None:
        self.python = python
        self.rpc_python = rpc_python
        self.log_dir = log_dir
        self.n_gen, self.n_ctx, self.repeats = n_gen, n_ctx, repeats
        self.env = dict(os.environ)
        self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        self.env["GGML_RPC_NO_RDMA"] = "1"   # plain TCP, so the proxy sees everything
        self.env.setdefault("OMP_NUM_THREADS", "1")
        # where heads and nodes start: `python -m` puts the working directory first on sys.path,
        # ahead of PYTHONPATH, so a contender's tree must be the working directory as well
        self.tree = REPO
        self._log_seq = 0

    def new_log(self, name: str) -> Path:
        self._log_seq += 1
        return self.log_dir / f"{self._log_seq:03d}-{name}.log"

    def python_for(self, mode: str) -> str:
        if mode != "rpc":
            return self.python
        assert self.rpc_python is not None
        return self.rpc_python

    @contextlib.contextmanager
    def servers(self, config: Config) -> Iterator[list[str]]:
        procs: list[subprocess.Popen[bytes]] = []
        endpoints: list[str] = []
        try:
            for i in range(config.n_nodes):
                endpoint = f"127.0.0.1:{_free_port()}"
                if config.mode in TBRPC_MODES:
                    cmd = [self.python, "-m", "tbrpc.cli", "node", "--port", endpoint.rsplit(":", 1)[1],
                           "--threads", "1", "--name", f"bench{i}"]
                else:
                    cmd = [self.python_for("rpc"), __file__, "rpc-server", "--endpoint", endpoint, "--threads", "1"]
                log = self.new_log(f"{config.model}-{config.mode}{config.n_nodes}-server{i}")
                with log.open("wb") as out:
                    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env, cwd=self.tree)
                procs.append(proc)
                _wait_listening(endpoint, proc, log)
                endpoints.append(endpoint)
            yield endpoints
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

    def run(self, config: Config, proxy: bool) -> RunResult:
        """One worker run with fresh servers; a failed run is retried once (with a warning naming its log)."""
        try:
            return self._run_once(config, proxy)
        except RuntimeError as e:
            print(f"\nWARNING: {e}\nretrying once", file=sys.stderr, flush=True)
            return self._run_once(config, proxy)

    def _run_once(self, config: Config, proxy: bool) -> RunResult:
        with self.servers(config) as endpoints:
            spec = RunSpec(model=config.model, gguf=config.gguf, mode=config.mode, endpoints=endpoints,
                           proxy=proxy, n_gen=self.n_gen, n_ctx=self.n_ctx, repeats=self.repeats, prompt=PROMPT)
            log = self.new_log(f"{config.model}-{config.mode}{config.n_nodes}-{'traffic' if proxy else 'timed'}")
            with log.open("wb") as err:
                proc = subprocess.run([self.python_for(config.mode), __file__, "worker", json.dumps(asdict(spec))],
                                      check=False, stdout=subprocess.PIPE, stderr=err, env=self.env, cwd=self.tree,
                                      timeout=1800)
            for line in proc.stdout.decode(errors="replace").splitlines():
                if line.startswith(RESULT_TAG):
                    return _result_from_json(json.loads(line[len(RESULT_TAG):]))
            raise RuntimeError(f"{config} failed (exit {proc.returncode}); see {log}:\n{log.read_text()[-3000:]}")


# ---------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------

def _fmt_bytes(n: float) -> str:
    for unit, scale in (("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _mode_label(config: Config) -> str:
    return {"single": "one process", "single-norepack": "one process, no repack", "tbrpc": "tbrpc (shm)",
            "tbrpc-tcp": "tbrpc over TCP", "rpc": "llama.cpp RPC"}[config.mode]


def table(rows: Sequence[Row]) -> str:
    head = ("| model | mode | nodes | load s | load bytes | prompt tok/s | gen tok/s (min-max) "
            "| bytes/gen tok (up + down) | round trips/gen tok | tbrpc's counters: rt/tok, bytes/tok |")
    lines = [head, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        load_bytes = traffic = rt = own = "-"
        if r.counted is not None and r.counted.proxy_gen is not None and r.counted.proxy_load is not None:
            g = r.counted.proxy_gen
            steps = r.counted.spec.n_gen * r.counted.spec.repeats
            load_bytes = _fmt_bytes(r.counted.proxy_load.bytes_total)
            traffic = (f"{_fmt_bytes(g.bytes_total / steps)} "
                       f"({_fmt_bytes(g.bytes_up / steps)} + {_fmt_bytes(g.bytes_down / steps)})")
            rt = f"{g.round_trips / steps:.2f}"
        t = r.timed[0]
        if t.tbrpc_gen is not None:
            steps = t.spec.n_gen * t.spec.repeats
            own = f"{t.tbrpc_gen.round_trips / steps:.2f}, {_fmt_bytes(t.tbrpc_gen.bytes_total / steps)}"
        gen = r.gen_tps
        lines.append(
            f"| {r.config.model} | {_mode_label(r.config)} | {r.config.n_nodes or 1} | {r.load_s:.2f} | {load_bytes} "
            f"| {statistics.median(r.prompt_tps):.1f} | {statistics.median(gen):.1f} ({min(gen):.1f}-{max(gen):.1f}) "
            f"| {traffic} | {rt} | {own} |"
        )
    return "\n".join(lines)


def breakdown(rows: Sequence[Row]) -> str:
    """Requests per generated token by command, which of them waited for a reply, and the first step's share."""
    lines = []
    for r in rows:
        c = r.counted
        if c is None or c.proxy_gen is None or c.proxy_first_step is None:
            continue
        steps = c.spec.n_gen * c.spec.repeats

        def per(counts: dict[str, int], n: int) -> str:
            return ", ".join(f"{name} {v / n:.2f}" for name, v in sorted(counts.items(), key=lambda kv: -kv[1]))

        first = c.proxy_first_step
        later = c.proxy_gen - first
        lines.append(f"  {r.config.model} {_mode_label(r.config)} x{r.config.n_nodes}:\n"
                     f"    requests/tok: {per(c.proxy_gen.requests, steps)}\n"
                     f"    waited on, first step after the prompt: {per(first.waits, c.spec.repeats)}\n"
                     f"    waited on, later steps: {per(later.waits, steps - c.spec.repeats)}")
    return "\n".join(lines)


def _token_groups(rows: Sequence[Row], model: str) -> dict[tuple[int, ...], tuple[list[str], str]]:
    """The distinct generated token sequences of `model`'s runs -> (runs that produced it, its text)."""
    groups: dict[tuple[int, ...], tuple[list[str], str]] = {}
    for r in rows:
        if r.config.model != model:
            continue
        for tag, res in [*((f"round {i + 1}", t) for i, t in enumerate(r.timed)), ("traffic run", r.counted)]:
            if res is not None:
                labels, _ = groups.setdefault(tuple(res.tokens), ([], res.text))
                labels.append(f"{_mode_label(r.config)} x{r.config.n_nodes or 1} {tag}")
    return groups


def text_check(rows: Sequence[Row]) -> tuple[list[str], bool]:
    """Report the groups of runs that generated the same tokens, when there is more than one.

    The second value is True when runs that use the same CPU kernels disagree
    (everything but "single", whose repacked weights legitimately round differently).
    """
    report: list[str] = []
    mismatch = False
    for model in dict.fromkeys(r.config.model for r in rows):
        groups = _token_groups(rows, model)
        if len(groups) > 1:
            report.append(f"{model}: the runs generated {len(groups)} different token sequences")
            for labels, text in groups.values():
                report.append(f"  {', '.join(labels)}:\n    {text!r}")
        same_kernels = [r for r in rows if r.config.mode != "single"]
        mismatch |= len(_token_groups(same_kernels, model)) > 1
    return report, mismatch


def _round_order(rows: Sequence[Row], round_no: int) -> list[Row]:
    """The order of one round of timed runs.

    Every round goes over all configurations, so slow drift on a shared
    machine spreads over all of them. Within a model, the remote modes for the
    same node count run back to back (tbrpc first in odd rounds, llama.cpp
    RPC first in even ones), so paired() compares neighbours in time.
    """
    order: list[Row] = []
    for model in dict.fromkeys(r.config.model for r in rows):
        mine = [r for r in rows if r.config.model == model]
        order += [r for r in mine if r.config.mode in LOCAL_MODES]
        for n in sorted({r.config.n_nodes for r in mine if r.config.mode not in LOCAL_MODES}):
            pair = [r for r in mine if r.config.n_nodes == n and r.config.mode not in LOCAL_MODES]
            order += pair if round_no % 2 else pair[::-1]
    return order


def paired(rows: Sequence[Row]) -> str:
    """tbrpc's gen tok/s over tbrpc-over-TCP's and over llama.cpp RPC's, per round
    (runs adjacent in time): median and range."""
    lines = []
    for a in rows:
        if a.config.mode != "tbrpc":
            continue
        for other in ("tbrpc-tcp", "rpc"):
            b = next((r for r in rows if r.config.mode == other and r.config.model == a.config.model
                      and r.config.n_nodes == a.config.n_nodes), None)
            if b is None:
                continue
            ratios = [statistics.median(x.gen_tps) / statistics.median(y.gen_tps) for x, y in zip(a.timed, b.timed)]
            lines.append(f"  {a.config.model} x{a.config.n_nodes}, tbrpc / {other}: {statistics.median(ratios):.3f} "
                         f"(rounds: {', '.join(f'{r:.3f}' for r in ratios)})")
    return "\n".join(lines)


def machine() -> str:
    cpu = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"{os.cpu_count()} cores, {cpu}, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}, load average {load}, {time.strftime('%Y-%m-%d %H:%M %Z')}")


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------

def _resolve_model(name: str, overrides: dict[str, str]) -> str:
    if name in overrides:
        return overrides[name]
    import models

    return str(models.ensure(name))


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    worker = sub.add_parser("worker", help="(internal) run one configuration, print its result as JSON")
    worker.add_argument("spec")
    server = sub.add_parser("rpc-server", help="(internal) run a llama.cpp RPC server")
    server.add_argument("--endpoint", required=True)
    server.add_argument("--threads", type=int, default=1)

    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated: gemma, deepseek2")
    parser.add_argument("--gguf", action="append", default=[], metavar="NAME=PATH",
                        help="use PATH for model NAME instead of models.ensure(NAME)")
    parser.add_argument("--modes", default=",".join(MODES),
                        help="comma-separated: single (one process), single-norepack (one process without the CPU "
                             "backend's weight repacking, i.e. the nodes' kernels), tbrpc (the head's "
                             "default transport: shared memory here), tbrpc-tcp, rpc")
    parser.add_argument("--nodes", default="1,2,4", help="node counts for tbrpc and rpc")
    parser.add_argument("--tokens", type=int, default=64, help="generated tokens (single-token decode steps)")
    parser.add_argument("--n-ctx", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3, help="prompt+generation runs per load; medians reported")
    parser.add_argument("--rounds", type=int, default=2, help="fresh processes per configuration (interleaved)")
    parser.add_argument("--rpc-venv", default=str(DEFAULT_RPC_VENV), help="venv made by benchmarks/rpc_venv.sh")
    parser.add_argument("--json", type=Path, help="also write all results here")
    parser.add_argument("--log-dir", type=Path, help="keep server and worker logs here (default: a temp dir)")
    args = parser.parse_args(argv)

    if args.command == "worker":
        result = run_worker(RunSpec(**json.loads(args.spec)))
        print(RESULT_TAG + json.dumps(asdict(result)), flush=True)
        return 0
    if args.command == "rpc-server":
        run_rpc_server(args.endpoint, args.threads)
        return 0

    modes = _csv(args.modes)
    unknown = set(modes) - set(MODES)
    if unknown:
        parser.error(f"unknown modes: {', '.join(sorted(unknown))}")
    rpc_python: str | None = None
    if "rpc" in modes:
        rpc_python = str(Path(args.rpc_venv) / "bin" / "python")
        if not Path(rpc_python).exists():
            parser.error(f"{rpc_python} is missing: run benchmarks/rpc_venv.sh first (or drop 'rpc' from --modes)")
    overrides = dict(o.split("=", 1) for o in args.gguf)
    node_counts = [int(n) for n in _csv(args.nodes)]

    configs: list[Config] = []
    for model in _csv(args.models):
        gguf = _resolve_model(model, overrides)
        for mode in modes:
            for n in [0] if mode in LOCAL_MODES else node_counts:
                configs.append(Config(model, gguf, mode, n))

    print(f"machine: {machine()}", flush=True)
    with contextlib.ExitStack() as stack:
        if args.log_dir:
            args.log_dir.mkdir(parents=True, exist_ok=True)
            log_dir = args.log_dir
        else:
            log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench_split-")))
        runner = Runner(sys.executable, rpc_python, log_dir, args.tokens, args.n_ctx, args.repeats)
        rows = [Row(config, [], None) for config in configs]
        for round_no in range(1, args.rounds + 1):
            for row in _round_order(rows, round_no):
                label = f"{row.config.model}: {_mode_label(row.config)} x{row.config.n_nodes or 1}"
                print(f"  round {round_no}/{args.rounds} {label} ...", end=" ", flush=True)
                row.timed.append(runner.run(row.config, proxy=False))
                print(f"gen {statistics.median(row.timed[-1].gen_tps):.1f} tok/s", flush=True)
        for row in rows:
            if row.config.mode not in LOCAL_MODES:
                print(f"  traffic run {row.config.model}: {_mode_label(row.config)} x{row.config.n_nodes}", flush=True)
                row.counted = runner.run(row.config, proxy=True)

    print()
    prompt_tokens = {r.config.model: r.timed[0].prompt_tokens for r in rows}
    prompts = ", ".join(f"{model} {n}" for model, n in prompt_tokens.items())
    print(f"{args.tokens} generated tokens after a fixed prompt (tokens: {prompts}), n_ctx {args.n_ctx}, greedy, "
          f"1 thread per process; medians of {args.rounds} rounds x {args.repeats} runs")
    print(table(rows))
    pairs = paired(rows)
    if pairs:
        print()
        print("gen tok/s ratios, per round (the two runs of a pair ran back to back):")
        print(pairs)
    print()
    print("requests by command, per generated token (counting proxy; the first step after a prompt also sets up "
          "the one-token graph):")
    print(breakdown(rows))
    report, mismatch = text_check(rows)
    print()
    print("\n".join(report) if report else "all runs generated the same tokens")
    if mismatch:
        print("MISMATCH: runs with the same CPU kernels generated different tokens")
    elif report:
        print("(only the one-process run with repacked weights differs: expected, see single-norepack in --help)")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "rows": [asdict(r) for r in rows]}, indent=1))
    return 1 if mismatch else 0


if __name__ == "__main__":
    sys.exit(main())
