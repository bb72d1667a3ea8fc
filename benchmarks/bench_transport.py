"""Benchmark: one head-to-node connection over each transport, side by side.

For each transport (shared memory, TCP loopback, and RDMA through the
stand-in verbs provider tests/c/verbs_sim.c in its apple-uc and linux-rc
profiles) and each round, in turns: fresh connections to local
``tbrpc node`` processes measure

  rtt_24B_us        SYNC: a 24-byte request and its 32-byte reply (median, p99)
  rtt_get_4KiB_us   GET_TENSOR of 4 KiB (median, p99)
  rtt_get_1MiB_us   GET_TENSOR of 1 MiB (median, p99)
  set_64MiB_GBps    SET_TENSOR of 64 MiB, posted, then SYNC (best of 5)
  peer_64MiB_GBps   PEER_SEND of 64 MiB from one node to another (best of 5)
  CPU s per GB      of the head and of the nodes, over the 5 SET_TENSORs
                    and over the 5 PEER_SENDs
  idle CPU          CPU seconds per second of the head and of the nodes
                    while the connections are open and silent for 3 s

and, for scale, this machine's single-thread memcpy bandwidth, with the load
average at the start and at the end. RDMA runs against nodes on 127.0.0.3
with their own host ids (another "host" to the head); the stand-in moves
frames through Unix sockets and NIC threads of its own, so its figures say
how much the RDMA code path costs here, nothing about hardware speed.
The C side is benchmarks/transport_bench.c (built with
tbrpc._build.build_program against the same sources as the extension).
Prints one table and, with --json, the raw rows.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_transport.py --rounds 3

A benchmark, not a test: nothing here asserts on timings.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tbrpc._build import build_program, build_verbs_sim
from tbrpc.node_processes import running
from tbrpc.spec import NodeSpec, local_specs

HERE = Path(__file__).resolve().parent
TRANSPORTS = ("auto", "tcp")   # "auto" is shared memory for a node on this host


def process_group_cpu_s(pgid: int) -> float:
    """User + system seconds of every live process in a process group (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:   # fields after ")" start at the state (field 3): pgrp is field 5
            total += int(fields[11]) + int(fields[12])
    return total / tick


def one_run(exe: Path, endpoints: list[str], transport: str, pgids: list[int], rounds: int,
            env: dict[str, str]) -> dict[str, Any]:
    """One transport_bench run; the nodes' CPU seconds are read at each of its marks."""
    proc = subprocess.Popen([str(exe), *endpoints[:1], transport, str(rounds), *endpoints[1:2]], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdin is not None and proc.stdout is not None
    cpu: dict[str, float] = {}
    while True:
        line = proc.stdout.readline()
        if not line.startswith("MARK "):
            break
        cpu[line.split()[1]] = sum(process_group_cpu_s(g) for g in pgids)
        proc.stdin.write("go\n")
        proc.stdin.flush()
    if proc.wait() != 0 or not line.startswith("{"):
        raise SystemExit(f"transport_bench ({transport}) failed: {line!r}")
    row = json.loads(line)
    gb = 5 * row["bulk_bytes"] / 1e9
    row["node_cpu_s_per_GB_set"] = (cpu["peer" if "peer" in cpu else "idle"] - cpu["bulk"]) / gb
    row["node_cpu_s_per_GB_peer"] = (cpu["idle"] - cpu["peer"]) / gb if "peer" in cpu else float("nan")
    row["node_idle_cpu"] = (cpu["end"] - cpu["idle"]) / IDLE_S
    return row


IDLE_S = 3   # transport_bench.c's IDLE_S
RDMA_PROFILES = ("apple-uc", "linux-rc")


def sim_env(sim: Path, sim_dir: Path, profile: str, addr: str, host_id: str) -> dict[str, str]:
    return {"TBRPC_VERBS_LIB": str(sim), "TBVSIM_DIR": str(sim_dir), "TBVSIM_PROFILE": profile,
            "TBRPC_RDMA_PROFILE": profile, "TBVSIM_ADDR": addr, "TBRPC_HOST_ID": host_id}


@contextlib.contextmanager
def environment(extra: dict[str, str]) -> Iterator[None]:
    """os.environ with `extra`, for the node processes started inside (they inherit it)."""
    saved = dict(os.environ)
    os.environ.update(extra)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="fresh connections per transport, taken in turns")
    parser.add_argument("--calls", type=int, default=2000, help="round trips per measurement")
    parser.add_argument("--no-rdma", action="store_true", help="leave out the stand-in (no verbs headers here)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    load_before = load_average()
    with tempfile.TemporaryDirectory(prefix="tbrpc-bench-") as tmp, contextlib.ExitStack() as stack:
        exe = build_program(HERE / "transport_bench.c", Path(tmp) / "transport_bench")
        local = stack.enter_context(running(local_specs(2, threads=1), Path(tmp)))
        plain = {k: v for k, v in os.environ.items() if not k.startswith(("TBRPC_", "TBVSIM_"))}
        setups = {t: (local.endpoints, [os.getpgid(p) for p in local.pids()], t, plain) for t in TRANSPORTS}
        if not args.no_rdma:
            sim = build_verbs_sim(Path(tmp) / "libtbverbs_sim.so")
            for profile in RDMA_PROFILES:
                sim_dir = Path(tmp) / f"sim-{profile}"
                specs = [NodeSpec(name=f"{profile}-{i}", host="127.0.0.3", port=0, start="local", threads=1)
                         for i in range(2)]
                started = []
                for i, spec in enumerate(specs):   # each node its own "host"
                    with environment(sim_env(sim, sim_dir, profile, "127.0.0.3", f"node-{profile}-{i}")):
                        started.append(stack.enter_context(running([spec], Path(tmp) / spec.name)))
                head = {**plain, **sim_env(sim, sim_dir, profile, "127.0.0.1", "head")}
                setups[f"rdma {profile}"] = ([e for s in started for e in s.endpoints],
                                             [os.getpgid(s.pids()[0]) for s in started], "auto", head)
        rows: dict[str, list[dict[str, Any]]] = {t: [] for t in setups}
        for _ in range(args.rounds):
            for name, (endpoints, pgids, transport, env) in setups.items():
                rows[name].append(one_run(exe, endpoints, transport, pgids, args.calls, env))
    load_after = load_average()

    if args.json:
        print(json.dumps(rows, indent=1))

    def med(name: str, key: str, i: int | None = None) -> float:
        return statistics.median(r[key][i] if i is not None else r[key] for r in rows[name])

    names = list(rows)
    for t in names:
        print(f"{t}: {rows[t][0]['transport']}")
    print(f"{'':30}" + "".join(f"{t if t.startswith('rdma') else rows[t][0]['transport'].split(':')[0]:>22}"
                               for t in names) + f"{'shm / tcp':>12}")
    lines = [("24 B round trip, median us", "rtt_24B_us", 0), ("24 B round trip, p99 us", "rtt_24B_us", 1),
             ("GET 4 KiB, median us", "rtt_get_4KiB_us", 0), ("GET 4 KiB, p99 us", "rtt_get_4KiB_us", 1),
             ("GET 1 MiB, median us", "rtt_get_1MiB_us", 0), ("GET 1 MiB, p99 us", "rtt_get_1MiB_us", 1),
             ("SET 64 MiB, GB/s", "set_64MiB_GBps", None), ("PEER_SEND 64 MiB, GB/s", "peer_64MiB_GBps", None),
             ("SET: head CPU s/GB", "head_cpu_s_per_GB_set", None), ("SET: nodes CPU s/GB", "node_cpu_s_per_GB_set", None),
             ("PEER: head CPU s/GB", "head_cpu_s_per_GB_peer", None),
             ("PEER: nodes CPU s/GB", "node_cpu_s_per_GB_peer", None),
             ("idle CPU, head (s/s)", "head_idle_cpu", None), ("idle CPU, nodes (s/s)", "node_idle_cpu", None)]
    for label, key, i in lines:
        values = [med(t, key, i) for t in names]
        ratio = values[0] / values[1] if values[1] else float("nan")
        print(f"{label:30}" + "".join(f"{v:>22.4g}" for v in values) + f"{ratio:>12.3f}")
    print(f"memcpy, one thread, GB/s: {med('auto', 'memcpy_GBps'):.2f}   "
          f"({args.rounds} rounds per transport, taken in turns; medians over rounds)")
    print(f"load average (1, 5, 15 min): {load_before} before, {load_after} after")
    print("rdma columns: the stand-in verbs provider (tests/c/verbs_sim.c), not hardware: they say what the RDMA "
          "code path costs on this machine, nothing about RDMA speed")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
