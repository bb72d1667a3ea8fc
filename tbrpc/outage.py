"""A serving ``tbrpc launch`` through a node's failure: it waits for the node, then reloads.

When a node fails while the HTTP API is served, the server stays up:

1. every request for the model gets ``503`` with a JSON error naming the
   node and saying the server waits for it (``Retry-After`` too); requests
   that were running when it failed get the same answer (a stream already
   under way ends without ``[DONE]``: its 200 was sent before the failure),
   and the log says so in one line naming the node (no traceback: it is handled);
   ``/tbrpc``, its JSON, ``/metrics`` and ``/v1/models`` keep answering and
   say what the server waits for (``tbrpc status`` shows it as well);
2. the model is freed (its buffers on the nodes that survive, and on this
   machine), which is also what lets the failed node's device reconnect;
3. a node process the launch started itself (``--local N``, ``start =
   "local"`` or ``"ssh"``) that exited is started again on the port it had;
   any other node is probed at its endpoint, with a backoff from
   ``FIRST_PROBE_S`` to ``MAX_PROBE_S`` between tries;
4. once every failed node answers the handshake, the head reconnects to it
   (the same ggml device, a fresh session) and loads the model again with
   the same plan (the plan is made from what the nodes said when the launch
   started them, which has not changed), then serves again.

A node that never returns is waited for as long as the launch runs; Ctrl-C
or SIGTERM stops it as usual. Each step is logged on stderr.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import threading
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from tbrpc.client import cluster as client_cluster
from tbrpc.client import NodeError, default_transport
from tbrpc.native import TbrpcError
from tbrpc.node_processes import Nodes, answers, head_secret_file, how_it_ended

WATCH_EVERY_S = 0.5         # how often the server looks for a failed node
FIRST_PROBE_S = 0.5         # the first wait between two probes of a failed node; it doubles ...
MAX_PROBE_S = 5.0           # ... up to this
PROBE_TIMEOUT_S = 1.0
STILL_WAITING_EVERY_S = 60.0   # how often the log says it still waits
RETRY_AFTER_S = 5
STOPPING = "the server is stopping"   # the 503 of requests cut or refused once a stop began
MODEL_PATHS = ("/v1/", "/extras/")   # routes that use the model get 503 while it is away ...
ALWAYS_ANSWERED = ("/v1/models",)    # ... except this one

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
Reload = Callable[[Callable[[], bool]], Any]   # reload(aborted) -> a loaded model


class ModelAway(TbrpcError):
    """A request reached the model while it was freed, waiting for a node (answered with 503)."""


@dataclass
class Outage:
    """What the server waits for: the failed nodes and the step it is at."""

    nodes: list[str]            # "local1 (127.0.0.1:40123)"
    error: str                  # what failed, as the head saw it
    since: float = field(default_factory=time.time)
    state: str = "waiting"      # "waiting" for the nodes, "restarting" one, "reloading" the model
    probes: int = 0
    last_probe: str = ""        # why the last probe failed

    def message(self) -> str:
        names = ", ".join(self.nodes)
        what = {"waiting": "waiting for it to answer again, then the model reloads",
                "restarting": "restarting it, then the model reloads",
                "reloading": "it answers again; the model is reloading"}[self.state]
        return f"node {names} failed: {self.error}; {what}"

    def as_json(self) -> dict[str, Any]:
        return {"nodes": list(self.nodes), "error": self.error, "since": self.since, "state": self.state,
                "probes": self.probes, "last_probe": self.last_probe or None, "message": self.message()}


class Serving:
    """The model a serving launch answers with, and what it does while a node is gone.

    `reload(aborted)` loads the model again on the same nodes (the launch's
    own load; `aborted()` turns true when the server stops). `head_model` is
    what restarted local nodes may read weights from."""

    def __init__(self, llm: Any, nodes: Nodes, reload: Reload, say: Callable[[str], None],
                 head_model: str | None = None) -> None:
        self.llm: Any = llm        # None while the model is freed
        self.shown: Any = llm      # the last model loaded: what the page describes meanwhile
        self.outage: Outage | None = None
        self.nodes = nodes
        self._reload = reload
        self._say = say
        self._head_model = head_model
        self.stopping = threading.Event()
        self.on_loaded: list[Callable[[], None]] = []   # run after each reload, before a request uses it

    def model(self) -> Any:
        """The loaded model; ModelAway while it waits for a node."""
        llm, outage = self.llm, self.outage
        if llm is None or outage is not None:
            raise ModelAway(outage.message() if outage else "the model is not loaded")
        return llm

    def unavailable(self) -> str | None:
        """Why the model cannot answer now (the server stops, a failed node, or the wait for one), else None."""
        if self.stopping.is_set():
            return STOPPING
        if self.outage is not None:
            return self.outage.message()
        failed = self.nodes.failed()   # before the watcher noticed: what it is about to do
        return self._outage(failed).message() if failed else None

    def request_failed(self, error: NodeError) -> None:
        """Say in one line that a request failed because a node did (its answer is the 503)."""
        index = self.nodes.endpoints.index(error.endpoint) if error.endpoint in self.nodes.endpoints else None
        node = f"node {self.nodes.specs[index].name} ({error.endpoint}): " if index is not None else ""
        self._say(f"a request failed: {node}{error}")

    def close(self) -> None:
        self.stopping.set()
        if self.llm is not None:
            self.llm.close()
            self.llm = None

    async def watch(self, model_lock: Callable[[], Any]) -> None:
        """Run beside the server until cancelled: notice a failed node and see the server through it.
        `model_lock()`: the async context manager requests hold while they use the model."""
        while not self.stopping.is_set():
            await asyncio.sleep(WATCH_EVERY_S)
            failed = await asyncio.to_thread(self.nodes.failed)
            if failed:
                await self._through(failed, model_lock)

    def _outage(self, failed: dict[int, str]) -> Outage:
        names = {i: f"{self.nodes.specs[i].name} ({self.nodes.endpoints[i]})" for i in failed}
        restart = any((n := self.nodes.started_here(i)) is not None and not n.alive() for i in failed)
        return Outage([names[i] for i in sorted(failed)],
                      "; ".join(failed[i].removeprefix(f"node {names[i]}: ") for i in sorted(failed)),
                      state="restarting" if restart else "waiting")

    def _reconnect(self) -> None:
        """Every node's device connects again, a fresh session (the model that used them is freed by
        now). The failed nodes' sessions are gone; those of the nodes that stayed up may still hold
        what the failure left: the error of an all-reduce posted before the failure was known, which
        their next reply would carry (a tensor split's reload then failed its first buffer and
        llama.cpp aborted), and links to the dead peer."""
        for i, endpoint in enumerate(self.nodes.endpoints):
            client_cluster().reconnect(endpoint, self.nodes.specs[i].transport or default_transport())

    async def _through(self, failed: dict[int, str], model_lock: Callable[[], Any]) -> None:
        indices = sorted(failed)
        self.outage = self._outage(failed)
        self._say(f"{self.outage.message()}; requests get 503 meanwhile")
        async with model_lock():   # wait for requests still in the model (they fail: the node is gone)
            old, self.llm = self.llm, None
            if old is not None:
                await asyncio.to_thread(old.close)
            del old
            await asyncio.to_thread(return_freed_memory)
        self._say("model freed on the nodes that are left and on this machine")
        while True:
            for i in indices:
                if not await self._until_back(i):
                    return   # the server stops
            self.outage.state = "reloading"
            self._say(f"node {', '.join(self.outage.nodes)}: answers again; reconnecting and reloading the model "
                      "with the same plan")
            started = time.monotonic()
            try:
                async with model_lock():
                    await asyncio.to_thread(self._reconnect)
                    llm = await asyncio.to_thread(self._reload, self.stopping.is_set)
                    for hook in self.on_loaded:
                        hook()
                    self.llm = self.shown = llm
            except (TbrpcError, ValueError) as exc:   # a node failed again: wait again
                if self.stopping.is_set():
                    return
                failed = await asyncio.to_thread(self.nodes.failed) or {i: f"reload failed: {exc}" for i in indices}
                indices = sorted(failed)
                self.outage = self._outage(failed)
                self._say(f"{self.outage.message()}")
                continue
            self.outage = None
            self._say(f"model reloaded in {time.monotonic() - started:.1f} s; serving again")
            return

    async def _until_back(self, index: int) -> bool:
        """Restart node `index` if this launch started it and its process exited; else probe it with a
        backoff until it answers the handshake. False: the server stops meanwhile."""
        assert self.outage is not None
        spec, endpoint = self.nodes.specs[index], self.nodes.endpoints[index]
        wait, last_said = FIRST_PROBE_S, time.monotonic()
        while not self.stopping.is_set():
            running = self.nodes.started_here(index)
            if running is not None and not running.alive():
                self.outage.state = "restarting"
                self._say(f"node {spec.name} ({endpoint}): restarting it (its process "
                          f"{how_it_ended(running.proc.returncode)}); old log: {running.log_path}.1")
                try:
                    await asyncio.to_thread(self.nodes.restart, index, self._head_model)
                    self._say(f"node {spec.name} ({endpoint}): restarted")
                    return True
                except NodeError as exc:   # LaunchError, or why it would not answer
                    self.outage.last_probe = str(exc)
                    self._say(f"node {spec.name}: restart failed ({exc}); trying again in {wait:.1f} s")
            else:
                self.outage.state = "waiting"
                info, why = await asyncio.to_thread(answers, endpoint, PROBE_TIMEOUT_S, head_secret_file(spec))
                self.outage.probes += 1
                if info is not None:
                    return True
                self.outage.last_probe = str(why)
                if self.outage.probes == 1 or time.monotonic() - last_said >= STILL_WAITING_EVERY_S:
                    last_said = time.monotonic()
                    self._say(f"node {spec.name} ({endpoint}): waiting for it ({self.outage.probes} probe(s), "
                              f"last: {why}); Ctrl-C stops the server")
            await asyncio.sleep(wait)
            wait = min(wait * 2, MAX_PROBE_S)
        return False


def return_freed_memory() -> None:
    """Give the memory of a freed model back to the system (glibc's malloc_trim; elsewhere nothing).

    glibc keeps freed memory in the arena of the thread that allocated it, and a serving launch
    loads and answers from several threads (a reload runs in a worker thread, requests in others),
    so without this the launch's RSS grew with every reload (benchmarks/soak.py)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim.argtypes = [ctypes.c_size_t]
    trim(0)


def error_body(message: str) -> bytes:
    """The JSON a refused request gets (the shape of llama-cpp-python's own errors, plus the reason)."""
    return json.dumps({"error": {"message": message, "type": "node_unavailable", "code": 503}}).encode()


def _is_stream(start: Message) -> bool:
    return int(start["status"]) == 200 and any(name.lower() == b"content-type" and value.startswith(b"text/event-stream")
                                               for name, value in start.get("headers") or [])


def _first(group: BaseExceptionGroup) -> BaseException:
    exc: BaseException = group.exceptions[0]
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


class OutageGuard:
    """ASGI middleware: while the server waits for a node, requests for the model get 503 naming it;
    a request that fails because a node failed under it (llama-cpp-python's 500) gets the same.
    Once the server stops, new requests and those it cuts after its grace period get 503 STOPPING."""

    def __init__(self, app: ASGIApp, serving: Serving) -> None:
        self.app = app
        self.serving = serving

    async def _refuse(self, send: Send, message: str) -> None:
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json"), (b"retry-after", str(RETRY_AFTER_S).encode())]})
        await send({"type": "http.response.body", "body": error_body(message)})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith(MODEL_PATHS) or path in ALWAYS_ANSWERED:
            await self.app(scope, receive, send)
            return
        why = await asyncio.to_thread(self.serving.unavailable)   # also a failure the watcher is yet to see
        if why:
            await self._refuse(send, why)
            return
        replaced = started = False
        held: Message | None = None   # a stream's 200, sent with its first bytes

        async def guarded_send(message: Message) -> None:
            nonlocal replaced, started, held
            if message["type"] == "http.response.start" and int(message["status"]) >= 500:
                why = await asyncio.to_thread(self.serving.unavailable)
                if why:
                    replaced = True
                    await self._refuse(send, why)
                    return
            if replaced:
                return
            if message["type"] == "http.response.start" and _is_stream(message):
                # A stream's headers go out before it reaches the model: held until it says something,
                # a node failing while it waits for the model is still answered with the 503
                held = message
                return
            if held is not None and message["type"] == "http.response.body":
                if not message.get("body"):   # nothing said yet; its end waits too (an error may follow it)
                    if not message.get("more_body", False):
                        ends.append(message)
                    return
                started = True
                await send(held)
                held = None
            started = started or message["type"] == "http.response.start"
            await send(message)

        ends: list[Message] = []   # a held stream's empty end
        try:
            refused = await self._through_nodes(scope, receive, guarded_send, lambda: started)
            if held is not None and not replaced and not refused:   # a stream that ended saying nothing, no error
                await send(held)
                for end in ends:
                    await send(end)
        except asyncio.CancelledError:   # the server stops: uvicorn cuts what is open after its grace period
            if started or replaced or not self.serving.stopping.is_set():
                raise
            await self._refuse(send, STOPPING)   # answered, and the request's task ends without a traceback

    async def _through_nodes(self, scope: Scope, receive: Receive, send: Send, started: Callable[[], bool]) -> bool:
        """The app; a node that failed under the request gets its one log line and the 503. Whether
        this answered the request (the 503)."""
        why: str | None = None
        try:
            await self.app(scope, receive, send)
        except* NodeError as failed:   # a node failed under the request (the routes let it through: serve.py;
            exc = _first(failed)         # a stream's arrives in its task groups' ExceptionGroups)
            assert isinstance(exc, NodeError)
            self.serving.request_failed(exc)
            why = str(exc)
        except* ModelAway as away:   # a stream that reached the model after it was freed (a plain request's
            why = str(_first(away))  # 500 for it is replaced in guarded_send)
        if why is None or started():   # a stream under way just ends, without [DONE]
            return False
        await self._refuse(send, await asyncio.to_thread(self.serving.unavailable) or why)
        return True

