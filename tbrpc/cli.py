"""The ``tbrpc`` command line: each command is a thin layer over the library."""

from __future__ import annotations

import click


@click.group()
def main() -> None:
    """tbrpc: split big GGUF models across machines with llama-cpp-python."""


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0 for all).")
@click.option("--port", default=50052, show_default=True, type=int, help="TCP port (0 picks a free one).")
@click.option("--device", default=None, help="ggml device to serve (default: GPU/Metal if present, else CPU).")
@click.option("--threads", default=0, type=int, help="Compute threads (default: ggml's choice).")
@click.option("--name", default=None, help="Node name shown to clients and in logs.")
@click.option("--log-file", default=None, type=click.Path(dir_okay=False), help="Append log lines here instead of stderr.")
@click.option("--timeout", default=10.0, show_default=True, type=float, help="Seconds a client may stall mid-message.")
def node(host: str, port: int, device: str | None, threads: int, name: str | None, log_file: str | None,
         timeout: float) -> None:
    """Serve this machine's best ggml device to tbrpc heads."""
    from tbrpc.node import NodeConfig, NodeServer
    from tbrpc.native import TbrpcError

    try:
        server = NodeServer(NodeConfig(host=host, port=port, device=device, threads=threads, name=name,
                                       log_path=log_file, timeout=timeout))
    except TbrpcError as e:
        raise click.ClickException(str(e)) from e
    click.echo(f"tbrpc node listening on {host}:{server.port}", err=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
