"""``tbrpc launch`` as a library call: nodes up, plan, load, then serve, complete or chat.

Whatever happens -- success, a failed step, Ctrl-C, SIGTERM -- every node
this call started is stopped before it returns; nodes that were already
running are left as they were. While it serves HTTP, a failed node does not
stop it: it waits for the node and reloads (tbrpc/outage.py).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from tbrpc import defaults
from tbrpc import secret as cluster_secret
from tbrpc.client import NodeError, cluster as client_cluster
from tbrpc.draft import DraftError, GGUFDraft, check_options as check_draft, logits_bytes, make_draft
from tbrpc.gguf_model import GGUFError, load_gguf
from tbrpc.launch_signals import Interrupted, LaunchSignals
from tbrpc.llama import (ClusterArg, DoesNotFitError, Llama, ProgressBar, check_split, discover_links, resolve_cluster,
                         say_cable_order, with_secret)
from tbrpc.native import TbrpcError
from tbrpc.node import is_loopback
from tbrpc.node_memory import ClusterError
from tbrpc.node_processes import Nodes, head_secret_file, start_nodes
from tbrpc.outage import Serving
from tbrpc.serve import chat, chat_format_warning, complete_once, listen, require_server, serve_http
from tbrpc.spec import NodeSpec
from tbrpc.status import connection_lines, connection_records, launch_record, note_connections, note_serving
from tbrpc.units import format_size

EXIT_OK, EXIT_FAILED, EXIT_DOES_NOT_FIT, EXIT_INTERRUPTED = 0, 1, 2, 130


@dataclass
class LaunchOptions:
    gguf: str
    cluster: ClusterArg
    ctx: int | None = None
    host: str = "127.0.0.1"
    port: int = defaults.HTTP_PORT
    prompt: str | None = None
    chat: bool = False
    max_tokens: int = 128
    temperature: float = 0.0
    seed: int | None = None
    alias: str | None = None
    api_key: str | None = None
    log_dir: Path | None = None
    start_timeout: float = defaults.START_TIMEOUT_S
    verbose: bool = False
    threads: int | None = None   # the head's, and those of started nodes that name none
    draft: str | None = None        # "prompt-lookup[:N]"
    draft_model: str | None = None  # a small GGUF with the model's vocabulary, run on this machine
    draft_tokens: int | None = None # tokens the draft model guesses per step
    split: str | None = None        # "layer", "tensor" or "ffn" (tbrpc.Llama's split); None: layer
    groups: int = 1                 # ffn split: groups of consecutive nodes, layer-split (the hybrid)
    llama_kwargs: dict[str, Any] = field(default_factory=dict)   # context options: llama.context_kwargs()


def _cluster_specs(opts: LaunchOptions, log_dir: Path) -> list[NodeSpec]:
    """The nodes to start or reach, with this run's secret. A cluster file with a mistake is step
    start's error naming the file, the node and the key, and the fix: not the hint to check the
    model file and the node logs that a failed load gets (no node has started)."""
    try:
        return with_secret(opts.cluster, resolve_cluster(opts.cluster, opts.threads), log_dir)
    except ClusterError as exc:
        if isinstance(exc, NodeError):   # an entry of a list of "host:port": tbrpc.connect's error, as it is
            raise
        raise TbrpcError.at("start", f"{exc}\n  try: fix the cluster file (docs/cluster.md, The cluster file, "
                            "explains every key)") from exc


def _first_load(opts: LaunchOptions, nodes: Nodes, signals: LaunchSignals, say: Callable[[str], None], record: Path) -> Llama:
    """The launch's load: a signal during it aborts it at the next progress report."""
    signals.loading = True
    try:
        llm = _load(opts, nodes, say, lambda: signals.received is not None, record)
    except (ValueError, TbrpcError):
        if signals.received is not None:
            raise Interrupted(signal.Signals(signals.received).name) from None
        raise
    finally:
        signals.loading = False
    if signals.received is not None:
        llm.close()
        raise Interrupted(signal.Signals(signals.received).name)
    return llm


def _read_from_files(nodes: Nodes) -> int:
    """What the launch's nodes read from their own model files so far, as this head counts it."""
    return sum(i.bytes_from_files for i in client_cluster().nodes() if i.endpoint in nodes.endpoints)


def _load(opts: LaunchOptions, nodes: Nodes, say: Callable[[str], None], aborted: Callable[[], bool],
          record: Path) -> Llama:
    """Plan, connect and load (again, when a failed node is back); the load stops at its next
    progress report once `aborted()`. Then say what carries each connection and each link the
    split uses (tbrpc.Llama made them), and why for those on TCP, and write it to the launch's
    `record` for `tbrpc status`, `tbrpc doctor` and the /tbrpc page."""
    bar = ProgressBar("tbrpc: loading")

    def progress(fraction: float) -> bool:
        bar(fraction)
        return not aborted()

    kwargs = dict(opts.llama_kwargs)
    kwargs.setdefault("verbose", opts.verbose)
    kwargs["n_ctx"] = opts.ctx if opts.ctx is not None else kwargs.get("n_ctx", 0)   # 0: the plan's context
    draft = make_draft(opts.draft, opts.draft_model, opts.draft_tokens, kwargs["n_ctx"], opts.threads)
    if draft is not None:
        kwargs["draft_model"] = draft
    started = time.monotonic()
    read_before = _read_from_files(nodes)   # the head's counters run on across reloads: this load's is the difference
    try:
        llm = Llama(opts.gguf, cluster=nodes, progress=progress, on_event=say, split=opts.split, groups=opts.groups,
                    **kwargs)
    finally:
        bar.close()   # its copy of stderr: one per load, and a serving launch reloads
    cluster = client_cluster()
    from_files = _read_from_files(nodes) - read_before
    say(f"model loaded in {time.monotonic() - started:.1f} s on {', '.join(llm.tbrpc_devices)}"
        + (f"; the nodes read {format_size(from_files)} of weights from their own model files" if from_files else ""))
    names = dict(zip(nodes.endpoints, (s.name for s in nodes.specs)))
    found = connection_records([i for i in cluster.nodes() if i.endpoint in names], names)
    for line in connection_lines([{"name": names[e], **found[e]} for e in nodes.endpoints if e in found]):
        say(line)
    note_connections(record, cluster.nodes())
    if draft is not None:
        if isinstance(draft, GGUFDraft):
            try:
                draft.check_vocabulary(llm)
            except DraftError:
                llm.close()
                raise
        say(f"speculative decoding: {opts.draft or Path(opts.draft_model or '').name} guesses, the nodes check; "
            f"this process keeps every position's logits ({format_size(logits_bytes(llm.n_ctx(), llm.n_vocab()))})")
    return llm


def _serve(opts: LaunchOptions, serving: Serving, sock: socket.socket, record: Path,
           say: Callable[[str], None]) -> int:
    host, port = sock.getsockname()[:2]
    reachable = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)   # how status here asks
    note_serving(record, f"http://{f'[{reachable}]' if ':' in reachable else reachable}:{port}", opts.api_key)
    alias = opts.alias or Path(opts.gguf).name.removesuffix(".gguf")
    # Said once the app is built: a signal from then on stops the server, never interrupts building it.
    serve_http(serving, sock, alias, opts.api_key, on_ready=lambda: say(
        f"serving OpenAI-compatible API on http://{host}:{port}/v1 (model {alias!r}); Ctrl-C stops it"))
    say("stopped")
    return EXIT_OK


def launch(opts: LaunchOptions, out: TextIO = sys.stdout, err: TextIO = sys.stderr,
           signals: LaunchSignals | None = None) -> int:
    """Run `tbrpc launch`; returns the process exit code. `signals`: the handler the caller installed
    already (the CLI, before importing this module); by default launch installs its own."""

    def say(message: str) -> None:
        err.write(f"tbrpc: {message}\n")
        err.flush()

    log_dir = opts.log_dir or Path(tempfile.mkdtemp(prefix="tbrpc-logs-"))
    nodes: Nodes | None = None
    llm: Llama | None = None
    serving: Serving | None = None
    step = "start"
    with ExitStack() as records:
        if signals is None:
            signals = records.enter_context(LaunchSignals())
        try:
            signals.arm()
            specs = _cluster_specs(opts, log_dir)
            if isinstance(opts.cluster, (str, os.PathLike)):
                specs = discover_links(specs, say)
            say_cable_order(specs, say)
            step = "plan"
            try:   # a header read: refuse a file that is not a model before starting anything
                model = load_gguf(opts.gguf)
            except GGUFError as exc:
                raise TbrpcError.at("plan", f"{exc}\n  try: --gguf must be a GGUF model "
                                    "(for a split set, its first shard)") from exc
            if opts.prompt is None and (warning := chat_format_warning(model, opts.llama_kwargs.get("chat_format"))):
                say(warning)   # chats, in the terminal or over HTTP, need a format: said before anything starts
            check_split(opts.gguf, opts.split, len(specs), opts.llama_kwargs, opts.groups)
            sock: socket.socket | None = None
            if opts.prompt is None and not opts.chat:
                require_server()
                # Held from now on: a port in use is said before a node starts or the model is read.
                sock = records.enter_context(listen(opts.host, opts.port))
                if opts.api_key is None and not is_loopback(opts.host):
                    say(f"warning: --host {opts.host} without --api-key: anyone who can reach this machine on the "
                        "network can use the API (--api-key KEY or TBRPC_API_KEY makes requests bring the key)")
            check_draft(opts.draft, opts.draft_model, opts.gguf)
            step = "start"
            say(f"{len(specs)} node(s); node logs in {log_dir}")
            nodes = start_nodes(specs, log_dir, timeout=opts.start_timeout, on_event=say, head_model=opts.gguf)
            record = records.enter_context(launch_record(opts.gguf, [s.name for s in nodes.specs], nodes.endpoints,
                                                         [head_secret_file(s) or cluster_secret.file_for()
                                                          for s in nodes.specs]))
            step = "load"
            llm = _first_load(opts, nodes, signals, say, record)
            step = "generate"
            if opts.prompt is not None:
                complete_once(llm, opts.prompt, out, opts.max_tokens, opts.temperature, opts.seed)
                return EXIT_OK
            if opts.chat:
                chat(llm, opts.max_tokens, opts.temperature, out=out)
                return EXIT_OK
            step = "serve"
            assert sock is not None   # serving: the socket was opened before the nodes started
            serving = Serving(llm, nodes, lambda aborted: _load(opts, nodes, say, aborted, record), say, opts.gguf)
            llm = None   # the server's now: it frees and reloads it when a node fails
            return _serve(opts, serving, sock, record, say)
        except (Interrupted, KeyboardInterrupt) as exc:
            if step == "serve":   # the normal way to stop a server
                say(f"stopping ({exc or 'SIGINT'}): the model, then the nodes started here")
                return EXIT_OK
            say(f"interrupted ({exc or 'SIGINT'}) during step {step}; stopping the nodes")
            return EXIT_INTERRUPTED
        except DoesNotFitError as exc:
            say(str(exc))
            return EXIT_DOES_NOT_FIT
        except TbrpcError as exc:   # LaunchError included: it names its node and step
            if exc.step is not None:
                say(str(exc))
            else:
                say(nodes.explain(step, exc) if nodes else f"step {step}: {exc}")
            return EXIT_FAILED
        except ValueError as exc:  # llama-cpp-python's "Failed to load model" and friends
            failure = nodes.first_failure() if nodes else None
            if failure and nodes:
                say(nodes.explain(step, failure[1], failure[0]))
            else:
                logs = f" and the node logs in {log_dir}" if nodes else ""
                say(f"step {step}: {exc}\n  try: check the model file (`tbrpc plan --gguf` reads it){logs}")
            return EXIT_FAILED
        finally:
            signals.loading = True   # a second Ctrl-C must not interrupt the cleanup
            if llm is not None:
                llm.close()
            if serving is not None:
                serving.close()
            if nodes is not None:
                nodes.stop()
            if opts.log_dir is None and not any(log_dir.glob("*.log*")):
                shutil.rmtree(log_dir, ignore_errors=True)   # no node started: it holds no log, only this run's secret
