"""A completion whose HTTP client has gone stops generating.

llama-cpp-python's server looks for a disconnect before a non-streaming
completion starts, and between a stream's chunks; once a non-streaming
completion runs, nobody asks. A client that gives up on a long answer (a
timeout, Ctrl-C, a closed tab) would leave the model -- every node of the
cluster -- generating up to `max_tokens` for nobody, and the next request
waiting for the model's lock all that time.

Two halves, joined by a context variable (anyio copies the request task's
context into the worker thread a completion runs in):

- `ClientWatch`, ASGI middleware on the completion routes: once the app has
  read the request's body, one task waits for the connection's next message,
  which is `http.disconnect` when the client goes (or when the response has
  been sent). The app may ask `receive` too (Starlette's `is_disconnected`,
  sse-starlette's listener): it awaits that same message, not a second
  concurrent read of the connection, which ASGI does not promise to be safe.
  Starlette asks under a cancelled scope; the watch is shielded from it.
- `stop_when_client_gone(llm)`: the served model's completions get a
  stopping criterion that is true once its request's client has gone; the
  completion ends at the next token as if a stop word came, and its answer
  goes nowhere.

A client that stays connected but stops reading (a paused process, a peer
gone without a reset) is gone too, once a piece of its answer has waited
`CLIENT_STALL_TIMEOUT_S` to be sent: a stream's send waits for the reader,
and the stream holds the model meanwhile, so without this every later
request would wait as long as that client kept its connection. The rest of
its answer is dropped; uvicorn then closes the connection ("ASGI callable
returned without completing response").
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from llama_cpp import StoppingCriteriaList

from tbrpc import defaults
from tbrpc.outage import ASGIApp, Message, Receive, Scope, Send

_client_gone: contextvars.ContextVar[threading.Event | None] = contextvars.ContextVar("tbrpc_client_gone",
                                                                                       default=None)


def _is_disconnect(task: asyncio.Task[Message]) -> bool:
    return not task.cancelled() and task.exception() is None and task.result().get("type") == "http.disconnect"


class ClientWatch:
    """ASGI middleware: marks the requests to `paths` whose client has gone (see the module's doc)."""

    def __init__(self, app: ASGIApp, paths: Iterable[str], stall_timeout: float | None = None) -> None:
        self.app = app
        self.paths = frozenset(paths)
        self.stall_timeout = defaults.CLIENT_STALL_TIMEOUT_S if stall_timeout is None else stall_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") not in self.paths:
            await self.app(scope, receive, send)
            return
        gone = threading.Event()
        watch: asyncio.Task[Message] | None = None

        async def watched_receive() -> Message:
            nonlocal watch
            if watch is not None:   # shielded: a caller's cancelled scope must not cancel the watch
                return await asyncio.shield(watch)
            message = await receive()
            if message["type"] == "http.disconnect":
                gone.set()
            elif not message.get("more_body", False):   # the whole body is in: watch what comes next
                watch = asyncio.ensure_future(receive())
                watch.add_done_callback(lambda t: gone.set() if _is_disconnect(t) else None)
            return message

        async def watched_send(message: Message) -> None:
            if gone.is_set():   # it left, or stopped reading: the rest of its answer goes nowhere
                return
            try:
                async with asyncio.timeout(self.stall_timeout):
                    await send(message)
            except TimeoutError:
                gone.set()

        mark = _client_gone.set(gone)
        try:
            await self.app(scope, watched_receive, watched_send)
        finally:
            _client_gone.reset(mark)
            if watch is not None and not watch.done():
                watch.cancel()


class _InModel:
    """The watched completions inside the model now (a thread running one, or a stream's next
    chunk), each with its client's `gone`."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._gone: list[threading.Event] = []

    @contextlib.contextmanager
    def inside(self, gone: threading.Event) -> Iterator[None]:
        with self._changed:
            self._gone.append(gone)
        try:
            yield
        finally:
            with self._changed:
                self._gone.remove(gone)
                self._changed.notify_all()

    def stop_all(self) -> None:
        with self._changed:
            for gone in self._gone:
                gone.set()
            self._changed.wait_for(lambda: not self._gone)


_in_model = _InModel()


def stop_completions() -> None:
    """The server stops: every watched completion stops at its next token; return once none is in
    the model. uvicorn cuts a request still open after its grace period, but the thread running its
    completion goes on, and the model freed under it crashed the process."""
    _in_model.stop_all()


def _stepped(chunks: Iterator[Any], gone: threading.Event) -> Iterator[Any]:
    """A stream's chunks, each made inside the model as `_in_model` counts it."""
    while True:
        with _in_model.inside(gone):
            chunk = next(chunks, _END)
        if chunk is _END:
            return
        yield chunk


_END = object()


def method_without_cycle(obj: Any, name: str) -> Callable[..., Any]:
    """`obj.name` as it is now, callable without holding `obj`: for a wrapper stored on `obj` itself.

    A wrapper that kept the bound method would make a reference cycle (obj -> wrapper -> bound
    method -> obj): a closed model would then wait for the cyclic garbage collector, which in a
    serving launch can take many reloads, keeping its arrays and its progress bar's descriptor
    (tests/test_launch.py, test_the_served_model_is_freed_without_the_garbage_collector). A wrapper already on `obj` holds
    no `obj` itself; the class's method is called through a weak reference."""
    own = vars(obj).get(name)
    if own is not None:
        return own
    method, ref = getattr(type(obj), name), weakref.ref(obj)

    def call(*args: Any, **kwargs: Any) -> Any:
        target = ref()
        if target is None:
            raise ReferenceError(f"{name}: the model is gone")
        return method(target, *args, **kwargs)

    return call


def stop_when_client_gone(llm: Any) -> Any:
    """Give `llm`'s completions (chat completions go through them) a stopping criterion that turns
    true once the client of the request calling it has gone, and count them in while they run
    (`stop_completions`); outside a watched request it adds nothing. Returns `llm`; a second call
    changes nothing."""
    if getattr(llm, "_tbrpc_stops_when_client_gone", False):
        return llm
    create_completion = method_without_cycle(llm, "create_completion")

    def create_completion_until_gone(*args: Any, **kwargs: Any) -> Any:
        gone = _client_gone.get()
        if gone is None:
            return create_completion(*args, **kwargs)
        kwargs["stopping_criteria"] = StoppingCriteriaList(
            [*(kwargs.get("stopping_criteria") or []), lambda _ids, _logits: gone.is_set()])
        if kwargs.get("stream"):   # a generator: it runs as the stream takes its chunks
            return _stepped(iter(create_completion(*args, **kwargs)), gone)
        with _in_model.inside(gone):
            return create_completion(*args, **kwargs)

    llm.create_completion = create_completion_until_gone
    llm._tbrpc_stops_when_client_gone = True
    return llm
