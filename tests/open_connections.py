"""Open N head connections to one node, each from a client of its own (so
each is a session, in a worker process of its own, on the node), and print
what carries each one. All stay open until the program ends, so the last
one meets everything the earlier ones hold.

Usage: python tests/open_connections.py ENDPOINT N"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tbrpc.native import load  # noqa: E402  (after the path it needs)


def main(endpoint: str, count: int) -> None:
    ffi, lib = load()
    clients = []
    for _ in range(count):
        client = lib.tbrpc_client_new()
        err = ffi.new("char[512]")
        index = lib.tbrpc_client_add_node(client, endpoint.encode(), 10000, b"auto", ffi.NULL, 0, err, len(err))
        if index < 0:
            print(f"error: {ffi.string(err).decode()}", flush=True)
            continue
        info = ffi.new("struct tbrpc_node_info *")
        lib.tbrpc_client_node_info(client, index, info)
        print(f"transport: {ffi.string(info.transport).decode()}", flush=True)
        clients.append(client)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
