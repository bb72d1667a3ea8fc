"""A spawned node worker: serves one client of a ``tbrpc node`` in a fresh process.

The node starts this module (see ``tbrpc.node.worker_command``: an isolated
interpreter told where the node's own tbrpc is) with ``<node options>
--client-fd N --status-fd N --parent-fd N --slot N --name NAME`` for each client when it
serves clients in spawned processes (``--isolation spawn``; the default on
macOS, where Metal does not survive fork()). A request that makes ggml abort
then ends this process only. Not meant to be run by hand.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

from tbrpc import defaults
from tbrpc.native import error_buffer, load, text
from tbrpc.secret import read as read_secret


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tbrpc node worker")
    parser.add_argument("--host", default="")
    parser.add_argument("--device", default="")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--log-file", default="")
    parser.add_argument("--timeout-ms", type=int, default=int(defaults.STALL_TIMEOUT_S * 1000))
    parser.add_argument("--model-dirs", default="")
    parser.add_argument("--secret-file", default="")
    parser.add_argument("--idle-timeout-ms", type=int, default=0)
    parser.add_argument("--name", required=True)
    parser.add_argument("--client-fd", type=int, required=True)
    parser.add_argument("--status-fd", type=int, required=True)
    parser.add_argument("--parent-fd", type=int, required=True)
    parser.add_argument("--slot", type=int, required=True)
    args = parser.parse_args(argv)
    ffi, lib = load()
    keep = [ffi.new("char[]", s.encode()) for s in (args.host, args.device, args.name, args.log_file, args.model_dirs)]
    secret = read_secret(args.secret_file) if args.secret_file else b""   # the node checked it as it started
    key = ffi.new("uint8_t[]", secret) if secret else ffi.NULL
    cfg = ffi.new("struct tb_node_config *", {
        "host": keep[0], "device": keep[1], "threads": args.threads, "name": keep[2], "log_path": keep[3],
        "timeout_ms": args.timeout_ms, "model_dirs": keep[4], "isolation": 2, "secret": key, "secret_len": len(secret),
        "idle_timeout_ms": args.idle_timeout_ms,
    })
    err = error_buffer()
    rc = lib.tb_node_worker_serve(cfg, args.client_fd, args.status_fd, args.slot, args.parent_fd, err, len(err))
    if rc != 0:   # where the node logs, so the reason sits next to "worker N exited with status 1"
        line = f"tbrpc node worker for {args.name}: {text(err)}\n"
        with open(args.log_file, "a") if args.log_file else contextlib.nullcontext(sys.stderr) as out:
            out.write(line)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if rc == 0 else 1)   # no interpreter teardown: ggml's and the device's state go with the process


if __name__ == "__main__":
    sys.exit(main())
