"""The head side: connect to nodes so llama.cpp sees them as ggml devices.

ggml keeps one process-wide registry of backends, and devices cannot be
removed from it. tbrpc mirrors that honestly: one ``Cluster`` per process
(``tbrpc.connect`` returns it), owning one C registry named "TBRPC" whose
devices TBRPC0, TBRPC1, ... are the nodes in the order they were first
connected.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tbrpc import defaults
from tbrpc.native import TbrpcError, VersionMismatchError, error_buffer, load, text

TRANSPORTS = ("auto", "tcp")


class NodeError(TbrpcError):
    """A node is unreachable, refused the handshake, died or stopped answering.

    Each kind of failure is a subclass (``kind`` names it too); the message
    names the node and says what happened, ``endpoint`` is the node's
    "host:port" (None when not known). ``peer``: the endpoint of the node at
    the other end of the node-to-node link whose failure failed this one (it
    waited for that node's activations, or sent it some), else None: the
    node to look at first. Callers branch on the class."""

    kind = "error"

    def __init__(self, message: str, endpoint: str | None = None, peer: str | None = None) -> None:
        super().__init__(message)
        self.endpoint = endpoint
        self.peer = peer


class NodeUnreachable(NodeError):
    """Nothing answers at the node's address: refused, unknown host, no answer to connect.

    One class for all three (the remedy is the same); the message says which."""

    kind = "unreachable"


class HandshakeRefused(NodeError):
    """Something answered but the handshake did not complete (not a tbrpc node, closed, silent)."""

    kind = "handshake"


class NodeVersionMismatch(NodeError, VersionMismatchError):
    """The node speaks another tbrpc protocol or ggml ABI than this head."""

    kind = "version"


class NodeFailed(NodeError):
    """The node failed after the handshake: it closed, stopped answering, or reported an error."""

    kind = "failed"


class AuthenticationError(NodeError):
    """The node and this head do not share the same secret (or one side has none)."""

    kind = "auth"


class NodeFullError(NodeError):
    """The node already serves as many clients as it may."""

    kind = "full"


class DuplicateNodeError(NodeError):
    """The node is one this process is connected to already, at another address (or listed twice):
    one node as two devices would count its memory twice."""

    kind = "duplicate"


# enum tbrpc_error_kind (ggml_backend/tbrpc.h) -> the class raised for it
_ERROR_CLASSES: dict[int, type[NodeError]] = {
    1: NodeUnreachable, 2: HandshakeRefused, 3: NodeVersionMismatch, 4: NodeFailed,
    5: AuthenticationError, 6: NodeFullError, 8: DuplicateNodeError,
}


def node_error(kind: int, message: str, endpoint: str | None = None, peer: str | None = None) -> NodeError:
    """The NodeError subclass for a C error kind (positive or negative), with `message`."""
    return _ERROR_CLASSES.get(abs(kind), NodeError)(message, endpoint, peer)


# enum tb_why (ggml_backend/transport.h): why a connection or link is on TCP (or has no link) when it
# might have moved. Python reads the kind, never the words beside it; the fix for each is doctor's
# (tbrpc/doctor.py, transport_fix).
WHY_NAMES = ("asked", "peer_no_rdma", "no_rdma_here", "qp_budget", "no_shm", "shm_failed", "rdma_failed", "peer_old",
             "no_link")


def why_name(kind: int) -> str:
    """The name of an enum tb_why value: "" for TB_WHY_NONE, "unknown" for one this head does not know."""
    if kind == 0:
        return ""
    _, lib = load()
    return next((name for name in WHY_NAMES if getattr(lib, f"TB_WHY_{name.upper()}") == kind), "unknown")


@dataclass(frozen=True)
class PeerLink:
    """A node-to-node link the head asked a node to make (the activations of a layer split, an all-reduce)."""
    to: str              # the endpoint of the node it reaches
    usable: bool         # False: there is none, and activations to `to` go through the head
    transport: str       # what carries it, and why: "shm 16x256K", "tcp: asked for", "none: cannot reach ..."
    why: str = ""        # the kind of the reason (WHY_NAMES) when it is on TCP or missing; "" when it moved


@dataclass(frozen=True)
class NodeInfo:
    endpoint: str
    device_name: str          # ggml device name on the head (TBRPC0, ...)
    node_name: str
    node_device: str          # the node's own ggml device (CPU, Metal, ...)
    description: str
    mem_free: int
    mem_total: int
    failed: bool
    error: str
    bytes_sent: int
    bytes_received: int
    round_trips: int
    messages: int
    graphs_sent: int
    graphs_reused: int
    bytes_from_files: int     # weights the node read from its own copy of the model
    peer_copies: int = 0      # activations it sent straight to the next node
    transport: str = ""       # what carries the bytes, and why: "shm 16x256K", "tcp: the node is on another host"
    links: str = ""           # its links to other nodes and what carries each: "127.0.0.1:5001 shm 16x256K; ..."
    allreduces: int = 0       # tensor split: all-reduces it took part in, node to node
    allreduce: str = ""       # which: "mesh" (a link per pair) or "ring" (neighbours only); "" before the first
    bytes_allocated: int = 0  # this process's buffers on the node, now
    error_kind: int = 0       # enum tbrpc_error_kind of the failure (tbrpc.h); node_error() makes its exception
    transport_why: str = ""   # the kind of the reason in `transport` when it is TCP (WHY_NAMES); "" when it moved
    peer_links: tuple[PeerLink, ...] = ()   # its links to other nodes, made or not, with their kinds
    failed_peer: str = ""     # the node at the other end of the link whose failure failed this one; "" none
    node_id: str = ""         # the node process's random id (hex): the same at every address it answers at
    model_files: bool = False  # it was started with --model-dir: it can read weights from its own model files

    def exception(self) -> NodeError:
        """The NodeError of this node's failure (its class says the kind)."""
        return node_error(self.error_kind, self.error, self.endpoint, self.failed_peer or None)


@dataclass(frozen=True)
class NodeStatus:
    buffers: int
    bytes_allocated: int
    clients: int
    graphs_computed: int
    bytes_received: int
    bytes_from_files: int
    mem_free: int
    mem_total: int
    device: str
    allreduces: int = 0        # tensor split: all-reduces done, and the seconds they took
    allreduce_s: float = 0.0


def _status_from_c(s: Any) -> NodeStatus:
    return NodeStatus(
        buffers=s.buffers, bytes_allocated=s.bytes_allocated, clients=s.clients,
        graphs_computed=s.graphs_computed, bytes_received=s.bytes_received, bytes_from_files=s.bytes_from_files,
        mem_free=s.mem_free, mem_total=s.mem_total, device=text(s.device_name),
        allreduces=s.allreduces, allreduce_s=s.allreduce_ns / 1e9,
    )


class Cluster:
    """The nodes this process has connected to, as ggml devices."""

    def __init__(self) -> None:
        ffi, lib = load()
        self._ffi, self._lib = ffi, lib
        self._client = lib.tbrpc_client_new()
        if self._client == ffi.NULL:
            raise MemoryError("tbrpc: cannot allocate the client registry")
        self._endpoints: list[str] = []
        self._stopped: set[str] = set()   # nodes a tbrpc.Llama stopped on close: their devices stay registered
        self._lock = threading.Lock()

    def add(self, endpoint: str, timeout: float, transport: str = "auto", secret: bytes | None = None) -> str:
        """Connect to `endpoint` (once) and return its ggml device name.

        transport: "auto" (shared memory with a node on this host, else TCP) or "tcp".
        secret: the cluster secret proven in the handshake (None: none)."""
        if transport not in TRANSPORTS:
            raise ValueError(f"transport {transport!r}: choose one of {', '.join(TRANSPORTS)}")
        with self._lock:
            if endpoint in self._endpoints:
                index = self._endpoints.index(endpoint)
                if self.info(index).failed:   # restarted since? connect again, as the same device
                    self._reconnect(index, transport)
                self._stopped.discard(endpoint)
                return self.info(index).device_name
            err = error_buffer()
            key = self._ffi.NULL if secret is None else self._ffi.new("uint8_t[]", secret)
            index = self._lib.tbrpc_client_add_node(self._client, endpoint.encode(), int(timeout * 1000),
                                                    transport.encode(), key, len(secret or b""), err, len(err))
            if index < 0:
                raise node_error(index, text(err), endpoint)
            self._endpoints.append(endpoint)
            self._lib.tbrpc_client_register(self._client, err, len(err))
            name = self.info(index).device_name
            _check_visible_to_libllama(name, endpoint)
            return name

    def reconnect(self, endpoint: str, transport: str = "auto") -> None:
        """Connect again to the node at `endpoint` (restarted there, or its connection lost), as the
        same device with a fresh session. NodeError when it does not answer, or while buffers of the
        old session are still open on this head (close the model that used it first)."""
        if transport not in TRANSPORTS:
            raise ValueError(f"transport {transport!r}: choose one of {', '.join(TRANSPORTS)}")
        with self._lock:
            self._reconnect(self._endpoints.index(endpoint), transport)
            self._stopped.discard(endpoint)

    def _reconnect(self, index: int, transport: str) -> None:
        err = error_buffer()
        rc = self._lib.tbrpc_client_reconnect_node(self._client, index, transport.encode(), err, len(err))
        if rc != 0:
            raise node_error(rc, text(err), self._endpoints[index])

    def __len__(self) -> int:
        return len(self._endpoints)

    def ffn_split_device(self, endpoints: Sequence[str], shares: Sequence[float], granularity: int) -> int:
        """A ggml meta device over these nodes that cuts only the feed-forward
        weights by `shares` (in multiples of `granularity`) and keeps the rest
        whole on each: llama.cpp's tensor split for architectures it refuses one
        for (deepseek2). Returns the ggml_backend_dev_t, for llama_model_params.devices
        with a layer split."""
        indices = [self._endpoints.index(e) for e in endpoints]
        err = error_buffer()
        dev = self._lib.tbrpc_client_ffn_split_device(self._client, self._ffi.new("size_t[]", indices), len(indices),
                                                      self._ffi.new("float[]", list(shares)), granularity, err, len(err))
        if dev == self._ffi.NULL:
            raise ValueError(text(err))
        return int(self._ffi.cast("uintptr_t", dev))

    def set_peer_address(self, source: str, target: str, host: str) -> None:
        """Node `source` dials node `target` at `host` (target's address on the cable
        between them) for activations, instead of target's endpoint host."""
        err = error_buffer()
        i, j = self._endpoints.index(source), self._endpoints.index(target)
        if self._lib.tbrpc_client_set_peer_address(self._client, i, j, host.encode(), err, len(err)) != 0:
            raise ValueError(text(err))

    @property
    def endpoints(self) -> list[str]:
        return list(self._endpoints)

    def info(self, index: int) -> NodeInfo:
        out = self._ffi.new("struct tbrpc_node_info *")
        if self._lib.tbrpc_client_node_info(self._client, index, out) != 0:
            raise IndexError(f"no tbrpc node {index}")
        h = out.hello
        links = tuple(PeerLink(to=self._endpoints[k.to] if k.to < len(self._endpoints) else "?", usable=bool(k.usable),
                               transport=text(k.transport), why=why_name(k.why))
                      for k in list(out.link_info)[:out.n_link_info])
        return NodeInfo(
            endpoint=text(out.endpoint), device_name=text(out.device_name), node_name=text(h.node_name),
            node_device=text(h.device_name), description=text(h.device_description),
            mem_free=h.mem_free, mem_total=h.mem_total, failed=bool(out.failed), error=text(out.error),
            bytes_sent=out.bytes_sent, bytes_received=out.bytes_received, round_trips=out.round_trips,
            messages=out.messages, graphs_sent=out.graphs_sent, graphs_reused=out.graphs_reused,
            bytes_from_files=out.bytes_from_files, peer_copies=out.peer_copies, transport=text(out.transport), links=text(out.links),
            error_kind=out.error_kind,
            allreduces=out.allreduces, allreduce=text(out.allreduce), bytes_allocated=out.bytes_allocated,
            transport_why=why_name(out.transport_why), peer_links=links,
            failed_peer=self._endpoints[out.failed_peer] if 0 <= out.failed_peer < len(self._endpoints) else "",
            node_id=bytes(h.node_id).hex(),
        )

    def device_names(self) -> list[str]:
        """The ggml names of this process's tbrpc devices (TBRPC0, ...)."""
        return [self.info(i).device_name for i in range(len(self._endpoints))]

    def nodes(self) -> list[NodeInfo]:
        return [self.info(i) for i in range(len(self._endpoints))]

    def status(self, index: int) -> NodeStatus:
        """Ask node `index` for its live status (buffers, bytes allocated, clients)."""
        out = self._ffi.new("struct tb_status *")
        err = error_buffer()
        rc = self._lib.tbrpc_client_node_status(self._client, index, out, err, len(err))
        if rc != 0:
            raise node_error(rc, text(err), self._endpoints[index])
        return _status_from_c(out)

    def reset_stats(self) -> None:
        self._lib.tbrpc_client_reset_stats(self._client)

    def failed_indexes(self) -> frozenset[int]:
        """The indexes of the nodes that have failed: one C call and no strings,
        so the check around every decode costs the same at any node count."""
        n = len(self._endpoints)
        flags = self._ffi.new("uint8_t[]", max(n, 1))
        if self._lib.tbrpc_client_failed_nodes(self._client, flags, n) == 0:
            return frozenset()
        return frozenset(i for i in range(n) if flags[i])

    def stopped(self, endpoints: Sequence[str]) -> None:
        """These nodes were stopped on purpose (tbrpc.Llama.close() of the nodes it started). ggml
        cannot forget their devices, so a later load that asks them fails; its NodeError then says
        why (``exception``) instead of only "connection closed"."""
        with self._lock:
            self._stopped.update(e for e in endpoints if e in self._endpoints)

    def earlier_failure(self, indexes: Sequence[int]) -> NodeError:
        """The NodeError of a call that failed on nodes that had failed before it (the first one's
        class, endpoint and peer): what happened to them, and that a model on them cannot go on."""
        first = self.exception(indexes[0])
        words = "; ".join(str(self.exception(i)) for i in indexes)
        if all(self.info(i).endpoint in self._stopped for i in indexes):   # its words say what to do
            return type(first)(words, first.endpoint, first.peer)
        return type(first)(f"{words} (before this call: a model using that node cannot go on; close it, and "
                           "load it again once the node is back)", first.endpoint, first.peer)

    def exception(self, index: int) -> NodeError:
        """The NodeError of node `index`'s failure, saying so when tbrpc stopped the node itself."""
        info = self.info(index)
        if info.endpoint not in self._stopped:
            return info.exception()
        return node_error(info.error_kind, f"{info.error} (tbrpc.Llama.close() stopped this node; ggml keeps its "
                          "device registered for the life of this process, and a plain llama_cpp.Llama takes every "
                          "such device: load it in a new process, or start the node again on its endpoint and call "
                          f"tbrpc.connect(['{info.endpoint}']))",
                          info.endpoint, info.failed_peer or None)

    def failures(self) -> dict[str, NodeInfo]:
        """endpoint -> info of every node that has failed (``info.exception()`` is its NodeError)."""
        return {info.endpoint: info for info in (self.info(i) for i in sorted(self.failed_indexes()))}


def _check_visible_to_libllama(device_name: str, endpoint: str) -> None:
    """The device must be in the registry libllama reads, not in a second copy of libggml."""
    import llama_cpp.llama_cpp as llama_lib

    by_name = llama_lib._lib.ggml_backend_dev_by_name
    by_name.restype = ctypes.c_void_p
    by_name.argtypes = [ctypes.c_char_p]
    if not by_name(device_name.encode()):
        raise TbrpcError(
            f"tbrpc registered {device_name} ({endpoint}) but libllama's ggml does not list it: "
            "tbrpc._native is linked to a different copy of libggml than libllama"
        )


_cluster: Cluster | None = None
_cluster_lock = threading.Lock()


def cluster() -> Cluster:
    """This process's Cluster (created on first use)."""
    global _cluster
    with _cluster_lock:
        if _cluster is None:
            _cluster = Cluster()
            _install_error_hooks(_cluster)
        return _cluster


def default_transport() -> str:
    """TBRPC_TRANSPORT=tcp keeps every connection on TCP; otherwise "auto"."""
    chosen = os.environ.get("TBRPC_TRANSPORT", "auto") or "auto"
    if chosen not in TRANSPORTS:
        raise ValueError(f"TBRPC_TRANSPORT={chosen}: choose one of {', '.join(TRANSPORTS)}")
    return chosen


def connect(nodes: Sequence[str], timeout: float = defaults.STALL_TIMEOUT_S, transport: str | None = None,
            secret_file: str | os.PathLike[str] | None = None) -> list[str]:
    """Connect to each "host:port" node; return their ggml device names, in order.

    `transport` ("auto" or "tcp"; default: TBRPC_TRANSPORT, else "auto")
    applies to connections made now; ``nodes()`` says what each one got.
    `secret_file`: the cluster secret the nodes were started with (default:
    TBRPC_SECRET_FILE; tbrpc/secret.py); a wrong or missing one raises
    AuthenticationError naming the node.

    After this, a plain ``llama_cpp.Llama(..., n_gpu_layers=-1, tensor_split=[...])``
    places layers on the nodes. Raises NodeError naming the first node that is
    unreachable or refuses the handshake; DuplicateNodeError for a node listed
    twice, or one that answers as a node this process is connected to at
    another address.
    """
    if isinstance(nodes, str):
        raise TypeError('connect() takes a list of "host:port" strings')
    for i, endpoint in enumerate(nodes):
        if endpoint in nodes[:i]:
            raise DuplicateNodeError(f"tbrpc node {endpoint} is listed twice (entries #{nodes.index(endpoint) + 1} "
                                     f"and #{i + 1}): list each node once", endpoint)
    from tbrpc import secret as cluster_secret

    key = cluster_secret.load(secret_file)
    c = cluster()
    return [c.add(endpoint, timeout, transport or default_transport(), key) for endpoint in nodes]


# One llama_decode at a time in this process. A decode posts its requests to each node in turn (its
# graphs, the copies of activations node to node, the all-reduces), holding one node's connection at
# a time, and every node runs its requests in the order they came. Two decodes from two threads (two
# models over the same nodes) would interleave them: a node would take one model's activations for
# the other's, or add one's partial sums to the other's, and answer wrong tokens without an error.
# Whole decodes one after the other keep every node's order the same.
_one_decode = threading.Lock()


def _install_error_hooks(c: Cluster) -> None:
    """Make llama-cpp-python raise NodeError (naming the node) when a node fails.

    ggml's backend interface has no error path for most calls; our C side
    marks the node failed (printing nothing) and makes ggml's calls fail
    softly. These wrappers, around the entry points llama-cpp-python uses for
    loading, context creation, decoding and reading the state, turn that
    state into a Python exception. Decodes run one at a time (``_one_decode``). The load
    wrapper also turns off the CPU's extra buffer types for a model that uses
    tbrpc devices (why: tbrpc/head_buffers.py).
    """
    import llama_cpp.llama_cpp as llama_lib

    from tbrpc.head_buffers import plain_cpu, uses_devices

    def wrap(name: str) -> None:
        original: Callable[..., Any] = getattr(llama_lib, name)
        if getattr(original, "_tbrpc_wrapped", False):
            return

        def checked(*args: Any) -> Any:
            if name == "llama_decode":
                with _one_decode:
                    return checked_call(*args)
            return checked_call(*args)

        def checked_call(*args: Any) -> Any:
            if name == "llama_model_load_from_file" and uses_devices(args[1], c.device_names()):
                plain_cpu(args[1])   # extra buffer types abort split graphs on some CPUs (head_buffers.py)
                _refuse_split_llama_cpp_fails_on(args[0], args[1], c.device_names())
            if name == "llama_init_from_model":
                _refuse_tensor_context_without_flash_attn(args[0], args[1])
            # Only failures of this call count: a node that failed under an
            # earlier model must not fail a later one that does not use it.
            before = c.failed_indexes()
            result = original(*args)
            if name == "llama_model_load_from_file":
                _remember_split_mode(result, args[1])
            if name == "llama_decode" and result == 0:
                # llama.cpp leaves the outputs' reads in flight (tbrpc's get_tensor_async) until the
                # caller asks for them; a node failing during them must fail this call, not hand
                # zeroed logits to the sampler
                llama_lib.llama_synchronize(args[0])
            new = sorted(c.failed_indexes() - before)
            if new:
                _free_result(llama_lib, name, result)
                raise c.exception(new[0])
            if before and _call_failed(name, result):   # it may have run on a node that failed earlier
                raise c.earlier_failure(sorted(before))
            return result

        checked._tbrpc_wrapped = True  # type: ignore[attr-defined]
        checked.__wrapped__ = original  # type: ignore[attr-defined]
        setattr(llama_lib, name, checked)

    # the state reads copy KV cache bytes from the nodes: a node failing under them must not hand
    # back zeros as a saved state
    for entry_point in ("llama_decode", "llama_model_load_from_file", "llama_init_from_model",
                        "llama_state_get_data", "llama_state_seq_get_data"):
        wrap(entry_point)


def _refuse_split_llama_cpp_fails_on(path: bytes, params: Any, ours: Sequence[str]) -> None:
    """A plain ``llama_cpp.Llama(..., split_mode=...)`` over tbrpc devices that llama.cpp would
    abort the process on or refuse with only "Failed to load model from file" (its reason goes to
    its log): PlanError (a ValueError) saying why and what to use instead. split_mode=2 (row)
    needs a device's split buffers (CUDA's; a tbrpc device has none). split_mode=3 (tensor) of a
    model llama.cpp's meta device aborts on (one KV head, weights one block wide along a cut) or
    refuses (deepseek2): TensorSplitError, as ``tbrpc.Llama(split="tensor")`` refuses it
    (``plan.check_model_split``); the split takes the devices ``params`` names, else every
    GPU-type device ggml has: tbrpc's. A file tbrpc cannot read is left to llama.cpp to report."""
    from tbrpc.gguf_model import GGUFError, load_gguf
    from tbrpc.head_buffers import device_names
    from tbrpc.plan import LLAMA_SPLIT_MODE_ROW, LLAMA_SPLIT_MODE_TENSOR, PlanError, check_model_split

    if params.split_mode == LLAMA_SPLIT_MODE_ROW:
        raise PlanError("split_mode=2 (row) needs devices with split buffers (CUDA's), and tbrpc devices have none: "
                        "use split_mode=1 (layer) or 3 (tensor)")
    if params.split_mode != LLAMA_SPLIT_MODE_TENSOR:
        return
    try:
        model = load_gguf(os.fsdecode(path))
    except GGUFError:
        return
    check_model_split(model, "tensor", len(device_names(params.devices) or ours))


_tensor_models: set[int] = set()   # addresses of the models loaded now in llama.cpp's tensor mode


def _remember_split_mode(model: Any, params: Any) -> None:
    """Whether the model just loaded (at an address an earlier one may have had) is in tensor mode."""
    from tbrpc.plan import LLAMA_SPLIT_MODE_TENSOR

    address = ctypes.c_void_p(model).value
    if address is None:
        return
    if params.split_mode == LLAMA_SPLIT_MODE_TENSOR:
        _tensor_models.add(address)
    else:
        _tensor_models.discard(address)


def _refuse_tensor_context_without_flash_attn(model: Any, params: Any) -> None:
    """llama.cpp creates no context of a tensor-split model with flash attention off, and says why
    only in its log (llama-cpp-python: "Failed to create llama_context"): a PlanError (a ValueError)
    that says what to pass, as ``tbrpc.plan`` refuses it for ``tbrpc.Llama(split="tensor")``."""
    from tbrpc.plan import PlanError

    if ctypes.c_void_p(model).value in _tensor_models and params.flash_attn_type == 0:   # LLAMA_FLASH_ATTN_TYPE_DISABLED
        raise PlanError("tensor split (split_mode=3) needs flash attention: llama.cpp creates no tensor-split "
                        "context without it; pass flash_attn=True")


def _free_result(llama_lib: Any, name: str, result: Any) -> None:
    """A model or context that a failed node left half made is freed here:
    the caller gets an exception, not the pointer, so nobody else could free
    it, and the surviving nodes would keep its buffers for as long as the
    process lives."""
    free = {"llama_model_load_from_file": "llama_model_free", "llama_init_from_model": "llama_free"}.get(name)
    if free and result:
        getattr(llama_lib, free)(result)


def _call_failed(name: str, result: Any) -> bool:
    """llama_decode: a negative code is an error (positive ones are "no KV slot" and the like);
    loading and context creation: a NULL pointer; the state reads: nothing copied."""
    return result < 0 if name == "llama_decode" else not result


def allreduce_choice(addressed: Sequence[Sequence[bool]], forced: str | None = None) -> tuple[str, str]:
    """The all-reduce a tensor split over n nodes runs ("mesh" or "ring") and why, by the rule
    the head's comm_init applies (client.c, tbrpc_allreduce_choose): `addressed[a][b]` when the
    cluster gives an address at which node a dials node b (b's `links` name a); `forced`: what
    TBRPC_ALLREDUCE would say."""
    ffi, lib = load()
    n = len(addressed)
    matrix = ffi.new("uint8_t[]", [1 if addressed[a][b] else 0 for a in range(n) for b in range(n)] or [0])
    why = error_buffer()
    kind = lib.tbrpc_allreduce_choose(matrix, n, forced.encode() if forced else ffi.NULL, why, len(why))
    return ("ring" if kind == lib.TBRPC_ALLREDUCE_RING else "mesh"), text(why)


def probe(endpoint: str, timeout: float = defaults.STALL_TIMEOUT_S,
          secret_file: str | os.PathLike[str] | None = None) -> tuple[NodeInfo, NodeStatus]:
    """Connect, handshake, read status and disconnect (for doctor and launch).

    `secret_file`: as for connect() (default: this process's, tbrpc/secret.py)."""
    from tbrpc import secret as cluster_secret

    key = cluster_secret.load(secret_file)
    ffi, lib = load()
    hello = ffi.new("struct tb_hello *")
    status = ffi.new("struct tb_status *")
    err = error_buffer()
    c_key = ffi.NULL if key is None else ffi.new("uint8_t[]", key)
    rc = lib.tbrpc_probe(endpoint.encode(), int(timeout * 1000), c_key, len(key or b""), hello, status, err, len(err))
    if rc != 0:
        raise node_error(rc, text(err), endpoint)
    info = NodeInfo(
        endpoint=endpoint, device_name="", node_name=text(hello.node_name), node_device=text(hello.device_name),
        description=text(hello.device_description), mem_free=hello.mem_free, mem_total=hello.mem_total,
        failed=False, error="", bytes_sent=0, bytes_received=0, round_trips=0, messages=0, graphs_sent=0,
        graphs_reused=0, bytes_from_files=0, transport="tcp: a probe connection", node_id=bytes(hello.node_id).hex(),
        model_files=bool(hello.caps & lib.TB_CAP_MODEL_FILES),
    )
    return info, _status_from_c(status)
