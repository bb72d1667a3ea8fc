"""``tbrpc.Llama``: ``llama_cpp.Llama`` split across nodes, with one extra argument.

    from tbrpc import Llama
    llm = Llama("model.gguf", cluster=2)                       # two nodes on this machine
    llm = Llama("model.gguf", cluster="tbrpc.toml")            # the nodes of a cluster file
    llm = Llama("model.gguf", cluster=["10.0.0.2:50052", ...])  # nodes someone else started

It starts the nodes it has to, waits for their handshake, plans the split
(refusing when the model does not fit), connects, and loads the model onto
exactly those nodes -- even when other tbrpc devices exist in this process.
Nodes it started are stopped when the model is closed or garbage-collected.
"""

from __future__ import annotations

import ctypes
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import llama_cpp
import llama_cpp.llama_cpp as llama_lib

from tbrpc import defaults
from tbrpc import secret as cluster_secret
from tbrpc.client import cluster as client_cluster
from tbrpc.client import NodeError, connect
from tbrpc.cluster_file import cluster_secret_file, load_cluster_file, load_specs
from tbrpc.gguf_model import GGUFError, load_gguf
from tbrpc.native import TbrpcError
from tbrpc.node_memory import Node, Report, size_nodes
from tbrpc.node_processes import LaunchError, Nodes, head_secret_file, start_nodes
from tbrpc.plan import (
    CACHE_TYPES,
    LLAMA_SPLIT_MODE_LAYER,
    LLAMA_SPLIT_MODE_TENSOR,
    SPLIT_MODES,
    Plan,
    PlanError,
    cache_type_name,
    check_groups,
    check_model_split,
    default_batch,
    format_table,
    plan,
)
from tbrpc.cables import asked, discovers, links_from_cables
from tbrpc.doctor import gather_facts
from tbrpc.spec import (
    NodeSpec, allreduce_of, cable_gaps, cable_order, cable_order_note, endpoint_specs, local_specs, split_endpoint,
)
from tbrpc.units import format_size

ClusterArg = str | os.PathLike[str] | Sequence[str] | int | Nodes
Progress = Callable[[float], Any]
Say = Callable[[str], Any]


class DoesNotFitError(TbrpcError):
    """The planner says the model does not fit on these nodes at this context."""

    step = "plan"

    def __init__(self, message: str, the_plan: Plan) -> None:
        super().__init__(message)
        self.plan = the_plan


def resolve_cluster(cluster: ClusterArg, threads: int | None = None) -> list[NodeSpec]:
    """A cluster file path (its nodes in the order the layers go: along its cables, ``spec.cable_order``),
    a list of "host:port" (one node may come as the string alone, when no file has that name), or N
    (N nodes on this machine). `threads`: compute threads of the nodes to be started that name none."""
    if isinstance(cluster, bool):
        raise TypeError("cluster= takes a cluster file path, a list of \"host:port\" or a number of local nodes")
    if isinstance(cluster, int):
        return local_specs(cluster, threads)
    if isinstance(cluster, Nodes):
        return list(cluster.specs)
    if isinstance(cluster, str) and not os.path.exists(cluster) and _is_endpoint(cluster):
        cluster = [cluster]
    specs = load_specs(os.fspath(cluster)) if isinstance(cluster, (str, os.PathLike)) else endpoint_specs(list(cluster))
    return [replace(s, threads=s.threads or threads or 0) for s in specs]


def _is_endpoint(text: str) -> bool:
    try:
        split_endpoint(text)
    except ValueError:
        return False
    return True


Gather = Callable[[NodeSpec], "tuple[dict[str, Any] | None, str, str]"]


def discover_links(specs: list[NodeSpec], say: Say, gather: Gather | None = None) -> list[NodeSpec]:
    """For a cluster file that lists no `links`: the cables between its nodes' machines, found
    from the addresses each one reports (tbrpc/cables.py), become their `links`, and the nodes
    are ordered along them (``spec.cable_order``). A file with `links` is taken as written, and
    nodes started by hand are not asked. Each node's facts come as doctor's do (`python -m
    tbrpc.facts`, over ssh for a remote node; `gather`: how), all at once; a node that gives
    none keeps its entry, and the run goes on over `host`."""
    if not discovers(specs):
        return specs
    askable = [s for s in specs if asked(s)]
    if gather is None:
        def gather(spec: NodeSpec) -> tuple[dict[str, Any] | None, str, str]:
            return gather_facts(spec, None, timeout=defaults.FACTS_TIMEOUT_S)
    with ThreadPoolExecutor(max_workers=len(askable)) as pool:
        answers = dict(zip((s.name for s in askable), pool.map(gather, askable)))
    facts = {name: f for name, (f, _, _) in answers.items() if f is not None}
    for name, (f, why, _) in answers.items():
        if f is None:
            say(f"warning: no cables looked for from {name} ({why}): its activations go to its `host`")
    found = links_from_cables(specs, facts)
    for line in found.unused:
        say(f"warning: cable not used: {line}")
    if not found.added:
        return specs
    say("links from the cables found (none in the cluster file): " + "; ".join(found.added))
    return cable_order(found.specs)


def cluster_to_plan(path: str | os.PathLike[str], metal_fraction: float = defaults.METAL_FRACTION, *, ask: bool,
                    timeout: float = defaults.ASK_TIMEOUT_S, say: Say, gather: Gather | None = None,
                    ) -> tuple[list[Node], list[NodeSpec]]:
    """What `tbrpc plan --cluster` plans: the file's nodes, sized (``ask``: each asked for its
    memory, as ``load_cluster_file`` does), with the links and in the order launch runs them.
    Asking, the cables are looked for as launch looks for them (``discover_links``), so a file
    without `links` gets the node order and the all-reduce launch will use; offline, nothing is
    asked and the file is planned as written."""
    specs = load_specs(path)
    if ask:
        specs = discover_links(specs, say, gather)
    sized = {n.name: n for n in load_cluster_file(path, metal_fraction, ask=ask, timeout=timeout)}
    return [sized[s.name] for s in specs], specs


def say_cable_order(specs: Sequence[NodeSpec], say: Say) -> None:
    """Say when the nodes run in another order than the cluster file's, to follow its cables
    (``spec.cable_order``), and warn about each pair of consecutive nodes still without one."""
    note = cable_order_note(specs)
    if note:
        say(note)
    for gap in cable_gaps(list(specs)):
        say(f"warning: {gap}")


def with_secret(cluster: ClusterArg, specs: list[NodeSpec], log_dir: Path) -> list[NodeSpec]:
    """The cluster secret for this run: a cluster file's top-level `secret_file` becomes this process's
    (unless --secret-file / TBRPC_SECRET_FILE chose one); N local nodes with none get a fresh one, in
    `log_dir`, that only they and this process know."""
    if isinstance(cluster, (str, os.PathLike)) and cluster_secret.file_for() is None:
        path = cluster_secret_file(os.fspath(cluster))
        if path:
            cluster_secret.use(path)
    if isinstance(cluster, int) and cluster_secret.file_for() is None:
        path = str(cluster_secret.new(log_dir / f"secret-{os.getpid()}-{os.urandom(4).hex()}"))   # a reused log dir holds old ones
        return [replace(s, secret_file=path) for s in specs]
    return specs


def plan_nodes(specs: Sequence[NodeSpec], nodes: Nodes) -> list[Node]:
    """The planner's nodes: what each node reported at the handshake, capped by the cluster file's figure."""
    return size_nodes([spec.plan_entry() for spec in specs],
                      [Report(info.node_device, info.mem_free, info.mem_total) for info in nodes.infos])


def _plan_failed(exc: PlanError | GGUFError) -> TbrpcError:
    """The planner's refusal as step plan's error. A PlanError names what it cannot plan (an
    argument, the node count, the model's shape) and often the way out; only a model file the
    planner cannot read gets the hint to check it."""
    if isinstance(exc, GGUFError):
        return TbrpcError.at("plan", f"{exc}\n  try: check the model file (`tbrpc plan --gguf` reads it)")
    return TbrpcError.at("plan", str(exc))


def check_split(model_path: str | os.PathLike[str], split: str | None, n_nodes: int, llama_kwargs: dict[str, Any],
                groups: int = 1) -> None:
    """Refuse, before any node starts, a model file the planner cannot read, more nodes than a
    layer split has layers, and a tensor or FFN split llama.cpp refuses or aborts on (``plan.check_model_split``):
    ``split`` as ``tbrpc.Llama`` takes it, or llama.cpp's own ``split_mode=3`` among
    ``llama_kwargs``; with ``groups`` (the hybrid) the FFN split within each group
    of ``n_nodes // groups``."""
    tensor = split == "tensor" or llama_kwargs.get("split_mode") == LLAMA_SPLIT_MODE_TENSOR
    try:
        check_groups(split, n_nodes, groups, llama_kwargs.get("tensor_split") is not None)
        model = load_gguf(model_path)
        check_model_split(model, "tensor" if tensor else split or "layer", n_nodes // groups)
    except (PlanError, GGUFError) as exc:
        raise _plan_failed(exc) from exc


def make_plan(model_path: str | os.PathLike[str], specs: Sequence[NodeSpec], nodes: Nodes, ctx: int | None,
              **plan_kwargs: Any) -> Plan:
    """Plan the split; DoesNotFitError (with the planner's table) when it does not fit."""
    try:
        # every node is a TBRPC device; the head keeps only embeddings, inputs and logits (result.head)
        result = plan(model_path, plan_nodes(specs, nodes), ctx=ctx, head_device=defaults.HEAD_DEVICE,
                      **{"allreduce": allreduce_of(specs), **plan_kwargs})
    except (PlanError, GGUFError) as exc:
        raise _plan_failed(exc) from exc
    if not result.fits:
        why = result.shortfall.message if result.shortfall else "does not fit"
        raise DoesNotFitError(
            f"step plan: the model does not fit on these {len(specs)} nodes: {why}\n"
            f"  try: a smaller context (launch --ctx, Llama n_ctx), more nodes, or a smaller quantization\n\n{format_table(result)}", result)
    return result


def context_kwargs(cache_type_k: str | None = None, cache_type_v: str | None = None, flash_attn: bool | None = None,
                   ubatch: int | None = None, batch: int | None = None, threads: int | None = None,
                   split: str | None = None) -> dict[str, Any]:
    """``llama_cpp.Llama`` keyword arguments for llama-server style options (None: not given).
    ``split``: "layer" or "tensor" (llama.cpp's split_mode 1 or 3; tensor turns flash attention on)."""
    kwargs: dict[str, Any] = {}
    if split is not None:
        if split not in ("layer", "tensor"):
            raise TbrpcError(f"split {split!r}: choose layer or tensor")
        kwargs["split_mode"] = LLAMA_SPLIT_MODE_TENSOR if split == "tensor" else LLAMA_SPLIT_MODE_LAYER
    if cache_type_k is not None:
        kwargs["type_k"] = int(CACHE_TYPES[cache_type_name(cache_type_k)])
    if cache_type_v is not None:
        kwargs["type_v"] = int(CACHE_TYPES[cache_type_name(cache_type_v)])
    if flash_attn is not None:
        kwargs["flash_attn"] = flash_attn
    if ubatch is not None:
        kwargs["n_ubatch"] = ubatch
    if batch is not None or ubatch is not None:
        kwargs["n_batch"] = batch if batch is not None else default_batch(ubatch or defaults.BATCH)
    if threads is not None:
        kwargs["n_threads"] = kwargs["n_threads_batch"] = threads
    return kwargs


def check_split_mode(split: str, split_mode: int | None) -> None:
    """Refuse llama.cpp's ``split_mode`` when it is not the one ``split`` loads with (tensor: 3;
    layer, and ffn, whose meta devices llama.cpp layer-splits: 1): the plan would size one split
    while llama.cpp loaded the other."""
    wanted = context_kwargs(split="tensor" if split == "tensor" else "layer")["split_mode"]
    if split_mode is not None and int(split_mode) != wanted:
        raise TbrpcError(f"split={split!r} loads with split_mode={wanted}, not the split_mode={split_mode} given: "
                         "give split or split_mode, not both")


def _offloaded(n_gpu_layers: int, n_layers: int) -> int:
    """How many of a model's layers and its output llama.cpp offloads for ``n_gpu_layers``
    (negative: all of them)."""
    return n_layers + 1 if n_gpu_layers < 0 else min(int(n_gpu_layers), n_layers + 1)


def planned_context(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The planner's options for these ``llama_cpp.Llama`` keyword arguments:
    what llama.cpp will allocate is what gets planned (context, split mode,
    and a draft model, which also makes llama-cpp-python keep all logits)."""
    options: dict[str, Any] = {"ubatch": kwargs.get("n_ubatch", defaults.BATCH), "batch": kwargs.get("n_batch", defaults.BATCH)}
    if kwargs.get("split_mode") is not None:
        mode = int(kwargs["split_mode"])
        if mode not in (LLAMA_SPLIT_MODE_LAYER, LLAMA_SPLIT_MODE_TENSOR):
            raise TbrpcError(f"split_mode={mode}: tbrpc plans layer (1) and tensor (3) splits only")
        options["split"] = "tensor" if mode == LLAMA_SPLIT_MODE_TENSOR else "layer"
    if kwargs.get("tensor_split") is not None:   # the caller's shares: planned as llama.cpp will cut them
        options["tensor_split"] = list(kwargs["tensor_split"])
    draft = kwargs.get("draft_model")
    if draft is not None:
        options["all_logits"] = True   # llama-cpp-python keeps every token's logits with any draft
        draft_llm = getattr(draft, "llm", None)   # tbrpc.draft.GGUFDraft: a small model on this CPU
        if draft_llm is not None and getattr(draft_llm, "model_path", None):
            options["draft_model"] = draft_llm.model_path
            options["draft_ctx"] = draft_llm.n_ctx()
    for arg, option in (("type_k", "cache_type_k"), ("type_v", "cache_type_v")):
        if kwargs.get(arg) is not None:
            options[option] = kwargs[arg]
    if kwargs.get("flash_attn") is not None:
        options["flash_attn"] = bool(kwargs["flash_attn"])
    if kwargs.get("swa_full") is not None:
        options["swa_full"] = bool(kwargs["swa_full"])
    return options


def _cache_words(p: Plan) -> str:
    c = p.context
    return f"KV cache {c.cache_type_k}/{c.cache_type_v}" + (", flash attention" if c.flash_attn else "")


def device_pointers(device_names: Sequence[str]) -> ctypes.Array[ctypes.c_void_p]:
    """A NULL-terminated ggml_backend_dev_t array for llama_model_params.devices."""
    by_name = llama_lib._lib.ggml_backend_dev_by_name
    by_name.restype = ctypes.c_void_p
    by_name.argtypes = [ctypes.c_char_p]
    pointers = []
    for name in device_names:
        dev = by_name(name.encode())
        if not dev:
            raise TbrpcError(f"ggml has no device {name}")
        pointers.append(dev)
    return (ctypes.c_void_p * (len(pointers) + 1))(*pointers, None)


_params_lock = threading.Lock()


@contextmanager
def model_params_patch(devices: ctypes.Array[ctypes.c_void_p] | None,
                       progress: Any = None) -> Iterator[None]:
    """While a Llama is constructed, its model params use exactly `devices` (and a progress callback).

    ``llama_cpp.Llama.__init__`` starts from ``llama_model_default_params()``;
    this wraps that function for the duration of one construction.
    """
    with _params_lock:
        original = llama_lib.llama_model_default_params

        def params() -> Any:
            p = original()
            if devices is not None:
                p.devices = ctypes.cast(devices, ctypes.c_void_p).value
            if progress is not None:
                p.progress_callback = progress
            return p

        llama_lib.llama_model_default_params = params
        try:
            yield
        finally:
            llama_lib.llama_model_default_params = original


class ProgressBar:
    """A text progress bar for model loading (on a terminal; plain lines otherwise).

    It writes to its own copy of stderr: llama-cpp-python points fd 2 at
    /dev/null while it loads a model with verbose=False. ``close()`` closes
    that copy (not a given stream); a serving launch makes one per reload.
    """

    def __init__(self, label: str, stream: Any = None) -> None:
        self.label = label
        self._owns_stream = stream is None
        self.stream = stream if stream is not None else os.fdopen(os.dup(sys.stderr.fileno()), "w")
        self.start: float | None = None     # the first report starts the clock
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last = -1

    def __call__(self, fraction: float) -> None:
        if self.stream.closed:
            return
        if self.start is None:
            self.start = time.monotonic()
        pct = int(fraction * 100)
        if pct == self._last:
            return
        self._last = pct
        if self.tty:
            filled = pct * 30 // 100
            bar = "#" * filled + "." * (30 - filled)
            self.stream.write(f"\r{self.label} [{bar}] {pct:3d}% {time.monotonic() - self.start:5.1f} s")
            if pct >= 100:
                self.stream.write("\n")
        elif pct % 25 == 0:
            self.stream.write(f"{self.label}: {pct}% ({time.monotonic() - self.start:.1f} s)\n")
        self.stream.flush()

    def close(self) -> None:
        """Close the copy of stderr it made; a report after this writes nothing."""
        if self._owns_stream and not self.stream.closed:
            self.stream.close()


class Llama(llama_cpp.Llama):
    """``llama_cpp.Llama`` over tbrpc nodes; every ``llama_cpp.Llama`` argument works as usual.

    ``cluster``: a cluster file path, a list of "host:port", or an int N for N
    nodes on this machine. ``ctx`` defaults to ``n_ctx``. ``progress``: True
    for a bar on stderr, or a callable taking the loaded fraction.
    ``log_dir``: where node logs go (default: a fresh temporary directory).
    ``split``: "layer" (the default), "tensor" (llama.cpp's split_mode=3: every
    layer cut across the nodes) or "ffn" (tbrpc's own rules: the FFN, experts
    and output cut, the rest whole on every node; for deepseek2 and models
    with one KV head such as Gemma 3 270M, which llama.cpp will not
    tensor-split); ``groups`` > 1 with "ffn": that split within groups of
    consecutive nodes, the groups layer-split (the layer+tensor hybrid,
    docs/planner.md). The layer split is the default because it is exact (the
    same logits, bit for bit, as one process running the nodes' kernels, for
    the same decode calls; a tensor split adds partial
    sums in another order), runs every architecture llama.cpp loads, and
    needs no full compute buffer or replicated tensors on every node; a
    tensor split is faster only when every node has compute of its own
    (its own machine or GPU), since each all-reduce waits for every node
    (docs/architecture.md, Tensor split).
    ``secret_file``: the cluster secret (default: the cluster file's, else
    TBRPC_SECRET_FILE; N local nodes without one get a fresh one for the run).
    Unless given, ``tensor_split`` comes from the plan (a given one is planned as llama.cpp cuts
    it); ``n_gpu_layers`` comes from the plan, and a given one must offload what the plan does.

    Once loaded, the node-to-node links the split uses are made (one token
    decoded, the KV cache then emptied: ``_tbrpc_make_links``), so
    ``tbrpc.client.cluster().nodes()`` lists each with its transport and why,
    and the first request does not pay for setting them up.
    """

    def __init__(self, model_path: str, *, cluster: ClusterArg, progress: bool | Progress = False,
                 log_dir: str | os.PathLike[str] | None = None, start_timeout: float = defaults.START_TIMEOUT_S,
                 plan_options: dict[str, Any] | None = None, on_event: Say | None = None, split: str | None = None,
                 groups: int = 1, secret_file: str | os.PathLike[str] | None = None, **kwargs: Any) -> None:
        if groups != 1:   # the hybrid: checked with the node count (check_split) and planned
            plan_options = {**(plan_options or {}), "groups": groups}
        if split is not None:
            if split not in SPLIT_MODES:
                raise TbrpcError(f"split {split!r}: choose one of {', '.join(SPLIT_MODES)}")
            check_split_mode(split, kwargs.get("split_mode"))
            plan_options = {**(plan_options or {}), "split": split}
            if split != "ffn":   # llama.cpp's own split modes
                kwargs = {**context_kwargs(split=split), **kwargs}
        self._tbrpc_nodes: Nodes | None = None
        self._tbrpc_owns_nodes = not isinstance(cluster, Nodes)   # given Nodes stay the caller's to stop
        say: Say = on_event or (lambda message: None)
        if isinstance(cluster, Nodes):
            nodes = cluster
        else:
            if secret_file is not None:
                cluster_secret.use(secret_file)
            logs = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="tbrpc-logs-"))
            specs = resolve_cluster(cluster)
            check_split(model_path, split, len(specs), kwargs, groups)
            if isinstance(cluster, (str, os.PathLike)):
                specs = discover_links(specs, say)
            say_cable_order(specs, say)
            nodes = start_nodes(with_secret(cluster, specs, logs), logs, timeout=start_timeout,
                                on_event=say, head_model=str(model_path))
        self._tbrpc_nodes = nodes
        try:
            self._tbrpc_load(model_path, nodes, progress, plan_options or {}, say, kwargs)
        except BaseException:
            self.close()   # now, not at garbage collection: the nodes that survived free this load's buffers
            raise

    def _tbrpc_load(self, model_path: str, nodes: Nodes, progress: bool | Progress, plan_options: dict[str, Any],
                    say: Say, kwargs: dict[str, Any]) -> None:
        n_ctx = kwargs.get("n_ctx", 512)
        self.tbrpc_plan = make_plan(model_path, nodes.specs, nodes, n_ctx or None,
                                    **{**planned_context(kwargs), **plan_options})
        given = kwargs.get("n_gpu_layers")
        if given is not None and _offloaded(given, self.tbrpc_plan.n_layers) != self.tbrpc_plan.n_gpu_layers:
            raise PlanError(f"n_gpu_layers={given} would keep layers on this machine the plan puts on the nodes "
                            f"(it offloads {self.tbrpc_plan.n_gpu_layers} of {self.tbrpc_plan.n_layers + 1}): "
                            "leave n_gpu_layers out, and the plan chooses it")
        head = self.tbrpc_plan.head
        say("plan: " + ", ".join(f"{n.name} {self.tbrpc_plan.part_of(n)}" for n in self.tbrpc_plan.nodes)
            + f" (context {self.tbrpc_plan.ctx}, {_cache_words(self.tbrpc_plan)}"
            + (f"; this process keeps {format_size(head.total_bytes)})" if head else ")"))
        try:
            self.tbrpc_devices = [connect([e], transport=s.transport, secret_file=head_secret_file(s))[0]
                                  for e, s in zip(nodes.endpoints, nodes.specs)]
        except TbrpcError as exc:
            raise nodes.explained("connect", exc) from exc
        by_name = {s.name: e for s, e in zip(nodes.specs, nodes.endpoints)}
        for spec, endpoint in zip(nodes.specs, nodes.endpoints):
            for source, host in spec.links:   # how the nodes reach each other over their own cables
                client_cluster().set_peer_address(by_name[source], endpoint, host)
        carriers = {info.endpoint: info.transport for info in client_cluster().nodes()}
        say("connected: " + ", ".join(f"{d}={s.name} ({carriers.get(e, '?')})" for d, s, e
                                      in zip(self.tbrpc_devices, nodes.specs, nodes.endpoints)) + "; loading")
        for key, value in self.tbrpc_plan.llama_kwargs().items():
            if key != "n_ctx":   # what the plan chose where the caller did not (flash attention for a quantized V)
                kwargs.setdefault(key, value)
        kwargs["n_ctx"] = n_ctx or self.tbrpc_plan.ctx
        tensor = self.tbrpc_plan.tensor
        if self.tbrpc_plan.split_mode == "ffn" and tensor is not None and tensor.groups > 1:
            # the hybrid: a meta device per group of consecutive nodes, the groups layer-split (plan's tensor_split)
            k = len(nodes.endpoints) // tensor.groups
            metas = [client_cluster().ffn_split_device(nodes.endpoints[i:i + k], tensor.shares, tensor.granularity)
                     for i in range(0, len(nodes.endpoints), k)]
            self._tbrpc_devices_array = (ctypes.c_void_p * (len(metas) + 1))(*metas, None)
        elif self.tbrpc_plan.split_mode == "ffn":   # one meta device over all the nodes, with tbrpc's split rules
            assert tensor is not None
            meta = client_cluster().ffn_split_device(nodes.endpoints, self.tbrpc_plan.tensor_split, tensor.granularity)
            self._tbrpc_devices_array = (ctypes.c_void_p * 2)(meta, None)
        else:
            self._tbrpc_devices_array = device_pointers(self.tbrpc_devices)
        interrupted: list[BaseException] = []
        self._tbrpc_progress_cb = _progress_callback(progress, interrupted)
        self.tbrpc_load_seconds = 0.0
        started = time.monotonic()
        with model_params_patch(self._tbrpc_devices_array, self._tbrpc_progress_cb):
            try:
                super().__init__(model_path, **kwargs)
            except TbrpcError as exc:
                raise nodes.explained("load", exc) from exc
            except ValueError as exc:
                if interrupted:   # Ctrl-C during a progress report aborted the load
                    raise interrupted[0] from None
                failure = nodes.first_failure()
                if failure:
                    raise nodes.explained("load", TbrpcError(failure[1]), failure[0]) from exc
                raise
        self.tbrpc_load_seconds = time.monotonic() - started
        started = time.monotonic()
        if len(nodes.endpoints) > 1 and not self.model_params.vocab_only:   # llama.cpp aborts decoding without weights
            self._tbrpc_make_links()
        self.tbrpc_link_seconds = time.monotonic() - started

    def eval(self, tokens: Sequence[int]) -> None:
        """``llama_cpp.Llama.eval``, with a prompt longer than ``n_batch`` pipelined through the nodes.

        llama-cpp-python decodes a prompt ``n_batch`` tokens at a time and asks for the logits of
        each piece's last token, so llama.cpp waits after every piece for the last node's answer:
        the pieces pass the nodes of a layer split one after another. Without ``logits_all`` only
        the last piece's logits are ever read, so here the pieces before it ask for none; the head
        then waits for no node between them (tbrpc posts requests without waiting, and each node
        runs its own in order), and while a node computes piece i the one before it already
        computes piece i + 1. The pieces are the ones llama-cpp-python makes, so the logits are the
        same, bit for bit. With ``logits_all`` (logprobs, a draft model) every piece's logits are
        kept and this is llama-cpp-python's own."""
        if self._logits_all or len(tokens) <= self.n_batch:
            super().eval(tokens)
            return
        last = (len(tokens) - 1) // self.n_batch * self.n_batch   # where llama-cpp-python's last piece starts
        self._ctx.kv_cache_seq_rm(-1, self.n_tokens, -1)
        for start in range(0, last, self.n_batch):
            piece = list(tokens[start:start + self.n_batch])
            self._batch.set_batch(batch=piece, n_past=self.n_tokens, logits_all=False)
            self._batch.batch.logits[len(piece) - 1] = False   # no output: llama_decode waits for no node
            self._ctx.decode(self._batch)
            self.input_ids[self.n_tokens:self.n_tokens + len(piece)] = piece
            self.n_tokens += len(piece)
            self._requires_eval = True   # no logits are live until the last piece's (super().eval clears it)
        super().eval(tokens[last:])

    def _tbrpc_make_links(self) -> None:
        """Decode one token and forget it: ggml's scheduler copies activations between exactly the
        nodes the graph puts next to each other, and each first copy (or, for a tensor split, the
        all-reduce set-up) makes that link (client_node.c, peer_link). Why this and not links made
        one by one in plan order: it makes the links the graph really uses and no other (an unused
        RDMA link would hold one of a Mac's 10 QPs), and takes their set-up (shared memory segments,
        the RDMA bring-up) out of the first request. The cache is then cleared as llama.cpp made
        it, zeros included, so the first request decodes exactly as it would have; this object's own
        token count never moved (``n_tokens`` is still 0). A decode llama.cpp refuses (a model that
        cannot decode one token alone) leaves the links to the first request."""
        token = self.token_bos() if self.token_bos() >= 0 else 0
        try:
            self._batch.set_batch(batch=[token], n_past=0, logits_all=False)
            self._ctx.decode(self._batch)
        except NodeError:
            raise
        except RuntimeError:
            pass
        finally:
            self._batch.reset()
            self._ctx.kv_cache_clear()

    @property
    def tbrpc_endpoints(self) -> list[str]:
        return list(self._tbrpc_nodes.endpoints) if self._tbrpc_nodes else []

    @property
    def tbrpc_node_pids(self) -> list[int]:
        """Pids of the node processes this Llama started (on their own machines)."""
        return self._tbrpc_nodes.pids() if self._tbrpc_nodes else []

    def _tbrpc_stop(self) -> None:
        nodes, self._tbrpc_nodes = getattr(self, "_tbrpc_nodes", None), None
        if nodes is not None and getattr(self, "_tbrpc_owns_nodes", False):
            nodes.stop()
            try:
                client_cluster().stopped(nodes.endpoints)
            except (AttributeError, TypeError):   # at interpreter exit (__del__), module globals may be gone
                pass

    def close(self) -> None:
        """Free the model (its buffers on the nodes), then stop the nodes this Llama started
        (not those it was given as ``cluster=Nodes``: a serving launch reloads onto them)."""
        try:
            if hasattr(self, "_stack"):
                super().close()
        finally:
            self._tbrpc_stop()

    def __del__(self) -> None:
        self.close()


def _progress_callback(progress: bool | Progress, interrupted: list[BaseException]) -> Any:
    """llama.cpp's progress callback for ``progress``. Python runs a signal's handler during a load
    only in this callback, so a Ctrl-C there (KeyboardInterrupt), which ctypes would print and
    drop (the load then failing as "Failed to load model from file"), aborts the load and is kept
    in ``interrupted`` for the caller to raise."""
    if progress is False or progress is None:
        return None
    report: Progress = ProgressBar("loading") if progress is True else progress  # type: ignore[assignment]

    def on_progress(fraction: float, user_data: Any) -> bool:
        try:
            return report(fraction) is not False   # returning False aborts the load
        except Exception:  # a failing progress display must not abort the load
            return True
        except BaseException as exc:   # KeyboardInterrupt, SystemExit
            interrupted.append(exc)
            return False

    return llama_lib.llama_progress_callback(on_progress)


__all__ = ["DoesNotFitError", "LaunchError", "Llama", "cluster_to_plan", "context_kwargs", "discover_links", "make_plan", "resolve_cluster"]
