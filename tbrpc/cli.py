"""The ``tbrpc`` command line: each command is a thin layer over the library."""

from __future__ import annotations

import click

from tbrpc import defaults


@click.group()
def main() -> None:
    """tbrpc: split big GGUF models across machines with llama-cpp-python."""


_secret_option = click.option(
    "--secret-file", default=None, type=click.Path(dir_okay=False),
    help="The cluster secret (`tbrpc secret new`); default: $TBRPC_SECRET_FILE, else none.")


def _use_secret(secret_file: str | None) -> None:
    """Make --secret-file this process's secret (checked now: a clear error, not a failed handshake later)."""
    if secret_file is None:
        return
    from tbrpc import secret
    from tbrpc.native import TbrpcError

    try:
        secret.use(secret_file)
    except TbrpcError as e:   # the file's mode or content: exit 1, as every command's bad input file
        raise click.ClickException(str(e)) from e


@main.group(name="secret")
def secret_group() -> None:
    """The cluster secret that heads and nodes prove to each other."""


@secret_group.command(name="new")
@click.argument("path", required=False, default="~/.config/tbrpc/secret")
def secret_new(path: str) -> None:
    """Write a new random secret to PATH (mode 0600; never overwrites). Copy it to every machine."""
    from tbrpc import secret
    from tbrpc.native import TbrpcError

    try:
        written = secret.new(path)
    except TbrpcError as e:
        raise click.ClickException(str(e)) from e
    click.echo(str(written))


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0 for all).")
@click.option("--port", default=defaults.PORT, show_default=True, type=int, help="TCP port (0 picks a free one).")
@click.option("--device", default=None, help="ggml device to serve (default: GPU/Metal if present, else CPU).")
@click.option("--threads", default=0, type=click.IntRange(min=0), help="Compute threads (default, 0: ggml's choice).")
@click.option("--name", default=None, help="Node name shown to clients and in logs.")
@click.option("--log-file", default=None, type=click.Path(dir_okay=False), help="Append log lines here instead of stderr.")
@click.option("--timeout", default=defaults.STALL_TIMEOUT_S, show_default=True, type=float, help="Seconds a client may stall mid-message.")
@click.option("--isolation", type=click.Choice(["auto", "process", "spawn", "thread"]), default="auto", show_default=True,
              help="Serve each client in its own worker process, forked or freshly spawned (a crash ends only that "
                   "client), or in a thread. auto: forked; spawned on macOS, where Metal does not survive fork().")
@click.option("--model-dir", "model_dirs", multiple=True, type=click.Path(file_okay=False, exists=True),
              help="Directory of *.gguf files this node holds: heads load weights from them instead of sending them.")
@_secret_option
@click.option("--insecure", is_flag=True, help="Listen on a non-loopback address without a secret (a network you trust).")
@click.option("--max-clients", default=0, type=click.IntRange(min=0, max=64),
              help="Clients served at once (default and most: 64); one more is told the node is full.")
@click.option("--idle-timeout", default=defaults.IDLE_TIMEOUT_S, show_default=True, type=click.FloatRange(min=0.001),
              help="Seconds a client that holds no buffer may stay silent before its slot is freed.")
def node(host: str, port: int, device: str | None, threads: int, name: str | None, log_file: str | None,
         timeout: float, isolation: str, model_dirs: tuple[str, ...], secret_file: str | None, insecure: bool,
         max_clients: int, idle_timeout: float) -> None:
    """Serve this machine's best ggml device to tbrpc heads."""
    from tbrpc.native import TbrpcError
    from tbrpc.node import NodeConfig, NodeServer

    try:
        server = NodeServer(NodeConfig(host=host, port=port, device=device, threads=threads, name=name,
                                       log_path=log_file, timeout=timeout, isolation=isolation,
                                       model_dirs=list(model_dirs), secret_file=secret_file, insecure=insecure,
                                       max_clients=max_clients, idle_timeout=idle_timeout))
    except TbrpcError as e:
        raise click.ClickException(str(e)) from e
    if server.authenticated:
        click.echo("tbrpc node: heads and peers must prove the cluster secret", err=True)
    click.echo(f"tbrpc node listening on {host}:{server.port}", err=True)
    server.serve_forever()


@main.command()
@click.option("--gguf", "gguf_path", required=True, type=click.Path(exists=True, dir_okay=False), help="Model file, or any shard of a split set.")
@click.option("--cluster", "cluster_file", type=click.Path(exists=True, dir_okay=False),
              help="TOML file with one [[node]] table per machine; nodes without `memory` are asked for theirs "
                   "[default, without --node/--nodes: ./tbrpc.toml, else tbrpc.toml in the user config directory, "
                   "as for launch].")
@click.option("--offline", is_flag=True, help="Do not ask the cluster file's nodes: use its `memory` figures (every node needs one) and its order and `links` as written (no cables looked for).")
@click.option("--timeout", default=defaults.ASK_TIMEOUT_S, show_default=True, type=float,
              help="Seconds each node has to say its memory (looking for cables, a cluster file's machines "
                   f"have {defaults.FACTS_TIMEOUT_S:g} s each to answer over ssh, as for launch).")
@click.option("--node", "node_flags", multiple=True, metavar="NAME=SIZE", help="A node and its RAM, e.g. mac1=512GiB (repeat; first is the head).")
@click.option("--nodes", "nodes_flag", metavar="NxSIZE", help="N identical nodes, e.g. 4x512GiB.")
@click.option("--ctx", type=int, default=None, help="Context length in tokens [default: min(32768, training context)].")
@click.option("--cache-type-k", default="f16", show_default=True, help="KV cache type for K (f16, q8_0, q4_0, ...).")
@click.option("--cache-type-v", default="f16", show_default=True, help="KV cache type for V.")
@click.option("--ubatch", type=int, default=defaults.BATCH, show_default=True, help="Physical batch size (n_ubatch).")
@click.option("--batch", type=int, default=None,
              help=f"Logical batch size (n_batch) [default: {defaults.BATCH}, or --ubatch when larger].")
@click.option("--flash-attn/--no-flash-attn", default=None, help="Plan for flash attention [default: off, on for a quantized V cache].")
@click.option("--swa-full/--no-swa-full", default=True, show_default=True, help="Full-size cache for sliding-window layers (llama.cpp's default).")
@click.option("--margin", default="2GiB", show_default=True, help="Memory kept free on every node.")
@click.option("--metal-fraction", type=float, default=defaults.METAL_FRACTION, show_default=True, help="Share of RAM Metal may wire when a node gives no limit.")
@click.option("--head-device", type=click.Choice(["gpu", "cpu", "none"]), default=defaults.HEAD_DEVICE,
              show_default=True,
              help="Backend the head runs its own layers on: gpu (its own device, e.g. a Mac's MTL0, as node 0), cpu, "
                   "or none: every layer on a node. The default is what `tbrpc launch` and tbrpc.Llama do on any head "
                   "(they give llama.cpp the nodes only); gpu or cpu plan llama.cpp run by hand with the head's own device.")
@click.option("--split", type=click.Choice(["layer", "tensor", "ffn"]), default="layer", show_default=True,
              help="layer: contiguous layer ranges per node; tensor: every layer cut across the nodes (llama.cpp "
                   "split_mode=3, flash attention on; not for deepseek2, one KV head, or a weight cut by rows that is one quant block wide); ffn: the FFN, experts and "
                   "output cut, attention whole (tbrpc's own rules, for those).")
@click.option("--groups", type=click.IntRange(min=1), default=1, show_default=True,
              help="With --split ffn: that many groups of consecutive nodes, each cutting its layers' FFN and experts, "
                   "the groups layer-split (the layer+tensor hybrid; `tbrpc launch --groups` and tbrpc.Llama(groups=) load it).")
@click.option("--tensor-split", "tensor_split", default=None, metavar="A,B,...",
              help="Each node's share: of every layer (--split tensor or ffn) [default: equal, or by free memory when "
                   "equal does not fit], or of the layers (--split layer, cut as llama.cpp cuts them) [default: planned].")
@click.option("--draft-model", default=None, type=click.Path(exists=True, dir_okay=False),
              help="A draft GGUF the head runs for speculative decoding (as `tbrpc launch --draft-model`): planned on the head.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (sizes in bytes).")
@_secret_option
def plan(gguf_path: str, cluster_file: str | None, offline: bool, timeout: float, node_flags: tuple[str, ...],
         nodes_flag: str | None, ctx: int | None,
         cache_type_k: str, cache_type_v: str, ubatch: int, batch: int | None, flash_attn: bool | None, swa_full: bool,
         margin: str, metal_fraction: float, head_device: str, split: str, groups: int, tensor_split: str | None,
         draft_model: str | None, as_json: bool, secret_file: str | None = None) -> None:
    """Say whether a model fits a cluster, which layers go where, and the llama.cpp flags. Exit 1 if it does not fit."""
    _use_secret(secret_file)
    import json

    from tbrpc.cluster_file import choose_cluster, cluster_secret_file
    from tbrpc.node_memory import ClusterError, nodes_from_flags
    from tbrpc.plan import format_table, plan as make_plan
    from tbrpc.spec import allreduce_of, cable_order_note

    if not (node_flags or nodes_flag):
        try:
            cluster_file = str(choose_cluster(cluster_file, None, instead="--node NAME=SIZE or --nodes NxSIZE"))
        except ClusterError as e:
            raise click.UsageError(str(e)) from e
    order_note = None
    allreduce = "mesh"   # nodes without a cluster file list no cables
    try:
        if cluster_file and (node_flags or nodes_flag):
            raise ValueError("use either --cluster or --node/--nodes")
        if cluster_file:
            from tbrpc import secret

            if not offline and secret.file_for() is None:
                _use_secret(cluster_secret_file(cluster_file))   # the nodes it asks may want the secret
            from tbrpc.llama import cluster_to_plan

            nodes, specs = cluster_to_plan(cluster_file, metal_fraction, ask=not offline, timeout=timeout,
                                           say=lambda message: click.echo(f"tbrpc: {message}", err=True))
            order_note = cable_order_note(specs)
            if split != "layer":
                allreduce = allreduce_of(specs)
        else:
            nodes = nodes_from_flags(list(node_flags), nodes_flag, metal_fraction)
        shares = None
        if tensor_split is not None:
            try:
                shares = [float(s) for s in tensor_split.split(",")]
            except ValueError:
                raise ValueError(f"--tensor-split {tensor_split!r}: expected numbers separated by commas") from None
        result = make_plan(gguf_path, nodes, ctx=ctx, cache_type_k=cache_type_k, cache_type_v=cache_type_v, ubatch=ubatch,
                           batch=batch, flash_attn=flash_attn, swa_full=swa_full, margin=margin, head_device=head_device,
                           split=split, groups=groups, tensor_split=shares, draft_model=draft_model, allreduce=allreduce)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
    if order_note:   # the table's rows are in that order already
        result.notes.insert(0, order_note)
    click.echo(json.dumps(result.to_json(), indent=2) if as_json else format_table(result))
    if not result.fits:
        raise SystemExit(1)


def _kv_cache_type(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    from tbrpc.plan import KV_CACHE_TYPES   # imported here: the planner pulls in gguf and numpy

    if value is not None and value.lower() not in KV_CACHE_TYPES:
        raise click.BadParameter(f"{value!r}: choose one of {', '.join(KV_CACHE_TYPES)}")
    return value.lower() if value else None


_cluster_option = click.option("--cluster", "cluster_file", default=None, type=click.Path(dir_okay=False),
                               help="Cluster file (default: ./tbrpc.toml, then the user config directory).")


@main.command()
@click.option("--gguf", required=True, type=click.Path(exists=True, dir_okay=False), help="The model (first shard of a split set).")
@_cluster_option
@click.option("--local", default=None, type=click.IntRange(min=1), help="Run N nodes on this machine instead of a cluster file.")
@click.option("--ctx", default=None, type=click.IntRange(min=1), help="Context size (default: the model's, at most 32768).")
@click.option("--host", default="127.0.0.1", show_default=True, help="HTTP API address.")
@click.option("--port", default=defaults.HTTP_PORT, show_default=True, type=int, help="HTTP API port (0 picks a free one).")
@click.option("--prompt", default=None, help="Print one completion of TEXT and exit.")
@click.option("--chat", is_flag=True, help="Chat in the terminal instead of serving HTTP.")
@click.option("--max-tokens", default=128, show_default=True, type=int, help="Tokens for --prompt/--chat.")
@click.option("--temperature", default=0.0, show_default=True, type=float, help="Sampling temperature for --prompt/--chat (0: greedy).")
@click.option("--alias", default=None, help="Model name in the API (default: the file name).")
@click.option("--chat-format", default=None, help="llama-cpp-python chat format when the GGUF has no template (e.g. gemma, chatml).")
@click.option("--api-key", default=None, envvar="TBRPC_API_KEY", help="Require this bearer token on the HTTP API.")
@click.option("--log-dir", default=None, type=click.Path(file_okay=False), help="Where node logs go (default: a new temporary directory).")
@click.option("--start-timeout", default=defaults.START_TIMEOUT_S, show_default=True, type=float, help="Seconds to wait for every node to answer.")
@click.option("--cache-type-k", callback=_kv_cache_type, default=None, help="KV cache type for K (f16, q8_0, q4_0, ...) [default: f16].")
@click.option("--cache-type-v", callback=_kv_cache_type, default=None,
              help="KV cache type for V [default: f16]; a quantized V turns flash attention on.")
@click.option("--flash-attn/--no-flash-attn", default=None, help="Flash attention [default: off, on for a quantized V cache].")
@click.option("--ubatch", type=click.IntRange(min=1), default=None,
              help=f"Physical batch size (n_ubatch) [default: {defaults.BATCH}].")
@click.option("--batch", type=click.IntRange(min=1), default=None,
              help=f"Logical batch size (n_batch) [default: {defaults.BATCH}, or --ubatch when larger].")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="Compute threads of the head and of every node launch starts that names none "
                   "[default: --local shares the cores; ggml's choice].")
@click.option("--draft", default=None, metavar="prompt-lookup[:N]",
              help="Speculative decoding by prompt lookup: up to N tokens (10) copied from where the text repeats.")
@click.option("--draft-model", default=None, type=click.Path(exists=True, dir_okay=False),
              help="Speculative decoding with a small GGUF of the same vocabulary, run on this machine.")
@click.option("--draft-tokens", type=click.IntRange(min=1), default=None, help="Tokens --draft-model guesses per step [default: 8].")
@click.option("--split", type=click.Choice(["layer", "tensor", "ffn"]), default=None,
              help="layer: contiguous layer ranges per node (default); tensor: every layer cut across the nodes, "
                   "partial sums all-reduced node to node (flash attention on; not for deepseek2, one KV head, or a weight cut by rows that is one quant block wide); ffn: "
                   "tbrpc's own rules, the FFN, experts and output cut, the rest whole on every node (for deepseek2: "
                   "Kimi K2, DeepSeek V3; Gemma 3 270M).")
@click.option("--groups", type=click.IntRange(min=1), default=1, show_default=True,
              help="With --split ffn: that many groups of consecutive nodes, each cutting its layers' FFN and experts, "
                   "the groups layer-split (the layer+tensor hybrid).")
@click.option("--verbose", is_flag=True, help="Show llama.cpp's own log.")
@_secret_option
def launch(gguf: str, cluster_file: str | None, local: int | None, ctx: int | None, host: str, port: int,
           prompt: str | None, chat: bool, max_tokens: int, temperature: float, alias: str | None,
           chat_format: str | None, api_key: str | None, log_dir: str | None, start_timeout: float,
           cache_type_k: str | None, cache_type_v: str | None, flash_attn: bool | None, ubatch: int | None,
           batch: int | None, threads: int | None, draft: str | None, draft_model: str | None,
           draft_tokens: int | None, split: str | None, groups: int, verbose: bool,
           secret_file: str | None = None) -> None:
    """Start the nodes, plan the split, load GGUF and serve it (or --prompt / --chat).
    Memory options (cache types, flash attention, batch sizes) are planned as `tbrpc plan` plans them."""
    from tbrpc.launch_signals import LaunchSignals

    with LaunchSignals() as signals:   # before the imports below: a Ctrl-C during them is launch's to answer
        from pathlib import Path

        from tbrpc.launch import LaunchOptions, launch as run_launch
        from tbrpc.llama import context_kwargs
        from tbrpc.cluster_file import choose_cluster
        from tbrpc.node_memory import ClusterError

        if prompt is not None and chat:
            raise click.UsageError("use either --prompt or --chat")
        _use_secret(secret_file)
        try:
            cluster = choose_cluster(cluster_file, local, instead="--local N")
        except ClusterError as e:
            raise click.UsageError(str(e)) from e
        code = run_launch(LaunchOptions(
            gguf=gguf, cluster=cluster, ctx=ctx, host=host, port=port, prompt=prompt, chat=chat, max_tokens=max_tokens,
            temperature=temperature, alias=alias, api_key=api_key, log_dir=Path(log_dir) if log_dir else None,
            start_timeout=start_timeout, verbose=verbose, threads=threads, draft=draft, draft_model=draft_model,
            draft_tokens=draft_tokens, split=split, groups=groups,
            llama_kwargs={**context_kwargs(cache_type_k, cache_type_v, flash_attn, ubatch, batch, threads),
                          **({"chat_format": chat_format} if chat_format else {})}), signals=signals)
    raise SystemExit(code)



@main.command()
@_cluster_option
@click.option("--gguf", default=None, type=click.Path(dir_okay=False), help="The head's model file, to compare each node's copy with.")
@click.option("--timeout", default=defaults.CHECK_TIMEOUT_S, show_default=True, type=float, help="Seconds per network check.")
@_secret_option
@click.argument("endpoints", nargs=-1)
def doctor(cluster_file: str | None, gguf: str | None, timeout: float, secret_file: str | None,
           endpoints: tuple[str, ...]) -> None:
    """Check every node: reachable, versions, secret, device and memory, model file, ssh, RDMA/Thunderbolt on Macs."""
    _use_secret(secret_file)
    from tbrpc.doctor import diagnose, failed, format_checks
    from tbrpc import secret
    from tbrpc.cluster_file import choose_cluster, read
    from tbrpc.node_memory import ClusterError
    from tbrpc.spec import endpoint_specs

    try:
        path = None if endpoints else choose_cluster(cluster_file, None, instead="the nodes' host:port endpoints")
    except ClusterError as e:   # no cluster named or found: the invocation (exit 2)
        raise click.UsageError(str(e)) from e
    try:
        if path is None:
            specs = endpoint_specs(list(endpoints))
        else:
            cluster = read(path)
            specs = list(cluster.specs)
            if secret.file_for() is None:
                _use_secret(cluster.secret_file)
    except ClusterError as e:   # what the file or an endpoint says (exit 1, as plan and launch)
        raise click.ClickException(str(e)) from e
    checks = diagnose(specs, gguf, timeout)
    click.echo(format_checks(checks))
    raise SystemExit(1 if failed(checks) else 0)


@main.command()
@_cluster_option
@click.option("--timeout", default=defaults.CHECK_TIMEOUT_S, show_default=True, type=float, help="Seconds per node.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: nodes and serving launches (sizes in bytes).")
@_secret_option
@click.argument("endpoints", nargs=-1)
def status(cluster_file: str | None, timeout: float, as_json: bool, secret_file: str | None,
           endpoints: tuple[str, ...]) -> None:
    """Nodes with their memory in use and clients, and what serving launches show on their page
    (default: the launches running here, then ./tbrpc.toml)."""
    _use_secret(secret_file)
    import json

    from tbrpc.cluster_file import default_cluster_file, read
    from tbrpc.node_memory import ClusterError
    from tbrpc.status import format_rows, format_serving, format_tcp, query, rows_json, serving, targets

    if endpoints:
        listed = [(e, e) for e in endpoints]
    else:
        from tbrpc import secret

        path = cluster_file or default_cluster_file()
        try:
            cluster = read(path) if path else None
            listed = [(s.name, s.endpoint) for s in cluster.specs] if cluster else []
            if cluster and secret.file_for() is None:
                _use_secret(cluster.secret_file)
        except ClusterError as e:   # what the file says (exit 1, as plan and launch)
            raise click.ClickException(str(e)) from e
    with_launches = not endpoints and not cluster_file
    nodes = targets(listed, with_launches, timeout)
    if not nodes:
        raise click.UsageError("no nodes: pass --cluster FILE or host:port, or start `tbrpc launch` first")
    rows = query(nodes, timeout)
    launches = serving(timeout) if with_launches else []
    if as_json:
        click.echo(json.dumps(rows_json(rows, launches), indent=1))
    else:
        click.echo(format_rows(rows))
        on_tcp = format_tcp(rows)
        if on_tcp:
            click.echo("\n" + on_tcp)
        if launches:
            click.echo("\n" + format_serving(launches))
    raise SystemExit(1 if any(r.status is None for r in rows) else 0)


if __name__ == "__main__":
    main()
