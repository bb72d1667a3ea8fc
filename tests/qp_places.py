"""Count the RDMA QPs held right now, per host and device, twice: as tbrpc's
budget sees them (ggml_backend/transport/qp_budget.c: a file per place in
TBRPC_QP_DIR, held by a flock) and as the stand-in verbs provider sees them
(tests/c/verbs_sim.c: an abstract Unix socket per live QP). Both are read
from what the kernel says is held (/proc/locks, /proc/net/unix), never by
taking a place, so counting does not disturb the count. Linux only.

Usage: python tests/qp_places.py QP_DIR TBVSIM_DIR HOST=ADDRESS...
(HOST: a TBRPC_HOST_ID; ADDRESS: that host's TBVSIM_ADDR). Prints JSON:
{"budget": {HOST: {DEVICE: n}}, "stand_in": {HOST: n}}."""

from __future__ import annotations

import ipaddress
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def fnv1a64(data: bytes) -> int:
    """The stand-in's hash of its directory and of a GID (verbs_sim.c hash_bytes)."""
    h = 1469598103934665603
    for b in data:
        h = ((h ^ b) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h


def host_ids(hosts: list[str]) -> dict[str, str]:
    """{host id as in a place's file name: host}, from tbrpc's own tb_rdma_host_id (via the doctor's report)."""
    from tbrpc.facts import rdma_facts

    ids = {}
    for host in hosts:
        os.environ["TBRPC_HOST_ID"] = host
        ids[rdma_facts(qp_probe=0)["host_id"]] = host
    return ids


def flocked_inodes() -> set[tuple[int, int, int]]:
    held = set()
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if "->" in fields or len(fields) < 6 or fields[1] != "FLOCK":   # "->": a waiter, not a holder
            continue
        major, minor, inode = fields[5].split(":")
        held.add((int(major, 16), int(minor, 16), int(inode)))
    return held


def budget_places(qp_dir: Path, ids: dict[str, str]) -> dict[str, dict[str, int]]:
    held = flocked_inodes()
    counts: dict[str, dict[str, int]] = {}
    for place in qp_dir.glob("qp-*"):
        st = place.stat()
        if (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino) not in held:
            continue
        host_id, device = place.name[3:].rsplit(".", 1)[0].split("-", 1)
        host = ids.get(host_id, host_id)
        counts.setdefault(host, {}).setdefault(device, 0)
        counts[host][device] += 1
    return counts


def stand_in_places(sim_dir: str, addresses: dict[str, str]) -> dict[str, int]:
    prefix = f"@tbvsim-{fnv1a64(sim_dir.encode()):016x}-"
    gid_of = {f"{fnv1a64(ipaddress.IPv6Address('::ffff:' + address).packed) & 0xFFFFFFFF:08x}": host
              for host, address in addresses.items()}
    counts: dict[str, int] = {}
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        name = line.split()[-1]
        if name.startswith(prefix) and "-qp-place-" in name:
            gid = name[len(prefix):].split("-", 1)[0]
            host = gid_of.get(gid, gid)
            counts[host] = counts.get(host, 0) + 1
    return counts


def main(qp_dir: str, sim_dir: str, pairs: list[str]) -> None:
    addresses = dict(pair.split("=", 1) for pair in pairs)
    ids = host_ids(list(addresses))
    print(json.dumps({"budget": budget_places(Path(qp_dir), ids), "stand_in": stand_in_places(sim_dir, addresses)}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
