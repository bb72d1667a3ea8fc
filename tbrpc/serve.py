"""Serving a loaded model: llama-cpp-python's own OpenAI-compatible server, a
one-shot completion, or a terminal chat.

The HTTP API is llama-cpp-python's ``[server]`` extra (FastAPI + uvicorn):
``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` (streaming
included) and the rest of its routes, over the model already loaded on the
nodes instead of one it would load itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
from collections.abc import Callable
from typing import Any, TextIO

import llama_cpp
from llama_cpp import llama_chat_format

from tbrpc.abandoned import ClientWatch, method_without_cycle, stop_completions, stop_when_client_gone
from tbrpc.client import NodeError
from tbrpc.gguf_model import GGUFModel
from tbrpc.native import SUPPORTED_LLAMA_CPP_PYTHON, TbrpcError
from tbrpc.outage import OutageGuard, Serving


class ServeError(TbrpcError):
    """The HTTP server could not start."""


def require_server() -> None:
    """Raise ServeError naming the missing piece if the HTTP API cannot be served here.

    The API's packages are dependencies of tbrpc, so this fails only in an
    environment changed after install; `tbrpc launch` asks before it starts
    a node or reads a byte of the model."""
    try:
        import llama_cpp.server.app  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise ServeError.at("serve", f"the HTTP API needs llama-cpp-python's server extra ({exc.name} is missing)\n"
                            f"  try: pip install 'llama-cpp-python[server]=={SUPPORTED_LLAMA_CPP_PYTHON}', "
                            "or use --prompt / --chat") from exc


def make_app(serving: Serving, alias: str, api_key: str | None = None) -> Any:
    """llama-cpp-python's FastAPI app, serving `serving`'s model as model `alias`
    (with 503s while it waits for a node: tbrpc/outage.py)."""
    require_server()
    import llama_cpp.server.app as app_module
    from llama_cpp.server.model import LlamaProxy
    from llama_cpp.server.settings import ModelSettings, ServerSettings

    from tbrpc.dashboard import TIMED_PATHS, install

    settings = ModelSettings(model=str(serving.shown.model_path), model_alias=alias)

    class LoadedProxy(LlamaProxy):
        """The proxy over the model the launch loaded (it never loads or frees one itself)."""

        def __init__(self) -> None:
            self._model_settings_dict = {alias: settings}
            self._current_model_alias = alias
            self._default_model_settings = settings
            self._default_model_alias = alias

        @property
        def _current_model(self) -> llama_cpp.Llama:   # type: ignore[override]
            """The last model loaded; kept here, the first one would outlive every reload."""
            return serving.shown

        def __call__(self, model: str | None = None) -> llama_cpp.Llama:
            return stop_when_client_gone(refuse_logprobs(serving.model()))   # each load's model, once

        def free(self) -> None:
            pass

    _node_errors_through(app_module.router)
    proxy = LoadedProxy()
    original = app_module.set_llama_proxy
    app_module.set_llama_proxy = lambda model_settings: setattr(app_module, "_llama_proxy", proxy)
    try:
        # Requests take turns on the one model (llama-cpp-python's lock); a new one waits for the
        # running one instead of cutting it short (the server's default, interrupt_requests, would).
        app = app_module.create_app(server_settings=ServerSettings(api_key=api_key, interrupt_requests=False),
                                    model_settings=[settings])
    finally:
        app_module.set_llama_proxy = original
    app.add_middleware(ClientWatch, paths=TIMED_PATHS)   # a completion whose client left stops
    app.add_middleware(OutageGuard, serving=serving)
    install(app, serving, alias, api_key)   # /tbrpc, /tbrpc/status.json, /metrics (outermost: sees the 503s)
    return app


def refuse_logprobs(llm: llama_cpp.Llama) -> llama_cpp.Llama:
    """A request for logprobs gets 400 saying why, unless `llm` keeps every token's logits (with a
    draft it does). Launch loads without `logits_all`, which a layer split would pay for with every
    prompt token's logits sent from the last node; llama-cpp-python refused with a 500
    internal_server_error naming that Llama argument. Returns `llm`; a second call changes nothing."""
    if llm._logits_all or getattr(llm, "_tbrpc_refuses_logprobs", False):
        return llm
    from fastapi import HTTPException
    create_completion = method_without_cycle(llm, "create_completion")

    def create_completion_without_logprobs(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("logprobs") is not None:   # chats' logprobs with top_logprobs come as this too
            raise HTTPException(status_code=400, detail=NO_LOGPROBS)
        return create_completion(*args, **kwargs)

    llm.create_completion = create_completion_without_logprobs   # type: ignore[method-assign]
    llm._tbrpc_refuses_logprobs = True   # type: ignore[attr-defined]
    return llm


NO_LOGPROBS = ("this server gives no logprobs (nor top_logprobs): tbrpc launch loads the model without "
               "logits_all, as the nodes would send every prompt token's logits to the head; ask without them")


def _node_errors_through(router: Any) -> None:
    """llama-cpp-python's routes answer any error a request raises with a 500 and a traceback on
    stderr. A node's failure is not theirs to answer: it goes up to OutageGuard, which answers 503
    and says it in one line. Other errors keep their 500 and traceback: nobody handled them.
    (These routes are llama-cpp-python's module-level router's, shared by the apps of a process.)"""
    from llama_cpp.server.errors import ErrorResponse, RouteErrorHandler

    class NodeErrorsThrough(RouteErrorHandler):
        def error_message_wrapper(self, error: Exception, body: Any = None) -> tuple[int, ErrorResponse]:
            if isinstance(error, NodeError):
                raise error
            return super().error_message_wrapper(error, body)

    for route in router.routes:
        if type(route) is RouteErrorHandler:
            route.__class__ = NodeErrorsThrough   # its handler asks self for the wrapper at each error


def chat_format_warning(model: GGUFModel, chat_format: str | None) -> str | None:
    """One line when chats with `model` (the HTTP API's and --chat's) would be formatted as it was not
    trained: llama-cpp-python chooses a format by the GGUF's `tokenizer.chat_template`, and without one
    and without `chat_format` falls back to llama-2's, which e.g. Gemma answers with nothing. It cannot
    tell the right format without the template, so neither does this: it names llama-cpp-python's format
    of the model's family when there is one (gemma3: gemma) for the user to choose. None when all is well."""
    if chat_format is not None or "tokenizer.chat_template" in model.metadata:
        return None
    family = model.architecture.rstrip("0123456789")
    try:
        llama_chat_format.get_chat_completion_handler(family)
        choice = f"--chat-format {family}"
    except llama_chat_format.LlamaChatCompletionHandlerNotFoundException:
        choice = "--chat-format NAME, the llama-cpp-python chat format this model was trained with (e.g. chatml)"
    return (f"warning: {model.path.name} has no chat template (tokenizer.chat_template): chats would use "
            f"llama-cpp-python's fallback, the llama-2 format, which a {model.architecture} model may answer "
            f"with nothing; try {choice}")


def model_lock() -> Any:
    """What a request holds while it uses the model (llama-cpp-python's locks): held, no request is in it."""
    import llama_cpp.server.app as app_module

    return contextlib.asynccontextmanager(app_module.get_llama_proxy)()


def listen(host: str, port: int) -> socket.socket:
    """A listening socket (port 0 picks a free one), or ServeError saying what to do."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise ServeError.at("serve", f"cannot listen on {host}:{port}: {exc.strerror or exc}\n"
                            "  try: another --port (0 picks a free one), or stop what uses this one") from exc
    return sock


def serve_http(serving: Serving, sock: socket.socket, alias: str, api_key: str | None = None,
               log_level: str = "warning", on_ready: Callable[[], None] | None = None) -> None:
    """Serve until SIGINT/SIGTERM, through failed nodes (tbrpc/outage.py).
    `on_ready` runs once the app is built, just before requests are taken."""
    app = make_app(serving, alias, api_key)
    import uvicorn

    class Server(uvicorn.Server):
        async def serve(self, sockets: list[socket.socket] | None = None) -> None:
            watcher = asyncio.create_task(serving.watch(model_lock), name="tbrpc-node-watch")
            # a watcher that broke stops the server (its error shows when it is awaited below)
            watcher.add_done_callback(lambda t: setattr(self, "should_exit", True) if not t.cancelled() else None)
            try:
                await super().serve(sockets)
            finally:
                serving.stopping.set()   # also when it ends without a shutdown (it did not start)
                await asyncio.to_thread(stop_completions)   # none is left in the model when launch frees it
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            # from now on requests get 503 (OutageGuard), and a reload under way stops at its next progress report
            serving.stopping.set()
            await super().shutdown(sockets)

    # A stop does not wait for long streams to finish: 3 s, then open requests are cut.
    server = Server(uvicorn.Config(app, log_level=log_level, lifespan="off", timeout_graceful_shutdown=3))
    if on_ready is not None:
        on_ready()
    server.run(sockets=[sock])


def complete_once(llm: llama_cpp.Llama, prompt: str, out: TextIO, max_tokens: int, temperature: float,
                  seed: int | None = None) -> str:
    """Stream one completion of `prompt` to `out`; return the text."""
    pieces = []
    for chunk in llm.create_completion(prompt, max_tokens=max_tokens, temperature=temperature, seed=seed,
                                       stream=True):
        piece = str(chunk["choices"][0]["text"])  # type: ignore[index]
        pieces.append(piece)
        out.write(piece)
        out.flush()
    out.write("\n")
    return "".join(pieces)


def chat(llm: llama_cpp.Llama, max_tokens: int, temperature: float, stdin: TextIO = sys.stdin,
         out: TextIO = sys.stdout) -> None:
    """A terminal chat: one line per turn; an empty line or Ctrl-D ends it."""
    messages: list[dict[str, str]] = []
    out.write("chat: type a message, Enter to send; Ctrl-D or an empty line quits\n")
    while True:
        out.write("> ")
        out.flush()
        line = stdin.readline()
        if not line or not line.strip():
            out.write("\n")
            return
        messages.append({"role": "user", "content": line.strip()})
        reply = []
        for chunk in llm.create_chat_completion(messages=messages, max_tokens=max_tokens,  # type: ignore[arg-type]
                                                temperature=temperature, stream=True):
            delta = str(chunk["choices"][0]["delta"].get("content") or "")  # type: ignore[index,union-attr]
            reply.append(delta)
            out.write(delta)
            out.flush()
        out.write("\n")
        messages.append({"role": "assistant", "content": "".join(reply)})
