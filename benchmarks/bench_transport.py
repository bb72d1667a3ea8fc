"""Benchmark: one head-to-node connection over each transport, side by side.

For each transport (shared memory, TCP loopback) and each round, in turns:
a fresh connection to one local ``tbrpc node`` measures

  rtt_24B_us        SYNC: a 24-byte request and its 32-byte reply (median, p99)
  rtt_get_4KiB_us   GET_TENSOR of 4 KiB (median, p99)
  rtt_get_1MiB_us   GET_TENSOR of 1 MiB (median, p99)
  set_64MiB_GBps    SET_TENSOR of 64 MiB, posted, then SYNC (best of 5)
  idle CPU          CPU seconds per second of the head and of the node
                    (node process and its worker) while the connection is
                    open and silent for 3 s

and, for scale, this machine's single-thread memcpy bandwidth. The C side
is benchmarks/transport_bench.c (built with tbrpc._build.build_program
against the same sources as the extension). Prints one table and, with
--json, the raw rows.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_transport.py --rounds 3

A benchmark, not a test: nothing here asserts on timings.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tbrpc._build import build_program
from tbrpc.node_processes import running
from tbrpc.spec import local_specs

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


def one_run(exe: Path, endpoint: str, transport: str, node_pgid: int, rounds: int) -> dict[str, Any]:
    proc = subprocess.Popen([str(exe), endpoint, transport, str(rounds)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    first = proc.stdout.readline()
    if not first.startswith("IDLE "):
        proc.kill()
        raise SystemExit(f"transport_bench failed before its idle phase: {first!r}")
    idle_s = float(first.split()[1])
    before = process_group_cpu_s(node_pgid)
    # the C side sleeps idle_s, then waits for our line
    time.sleep(idle_s + 0.05)
    node_idle = (process_group_cpu_s(node_pgid) - before) / idle_s
    proc.stdin.write("go\n")
    proc.stdin.flush()
    row = json.loads(proc.stdout.readline())
    if proc.wait() != 0:
        raise SystemExit("transport_bench failed")
    row["node_idle_cpu"] = node_idle
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="fresh connections per transport, taken in turns")
    parser.add_argument("--calls", type=int, default=2000, help="round trips per measurement")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="tbrpc-bench-") as tmp:
        exe = build_program(HERE / "transport_bench.c", Path(tmp) / "transport_bench")
        with running(local_specs(1, threads=1), Path(tmp)) as nodes:
            pgid = os.getpgid(nodes.pids()[0])
            rows: dict[str, list[dict[str, Any]]] = {t: [] for t in TRANSPORTS}
            for _ in range(args.rounds):
                for transport in TRANSPORTS:
                    rows[transport].append(one_run(exe, nodes.endpoints[0], transport, pgid, args.calls))

    if args.json:
        print(json.dumps(rows, indent=1))

    def med(transport: str, key: str, i: int | None = None) -> float:
        return statistics.median(r[key][i] if i is not None else r[key] for r in rows[transport])

    print(f"{'':24}" + "".join(f"{rows[t][0]['transport'].split(':')[0]:>22}" for t in TRANSPORTS) + f"{'shm / tcp':>12}")
    lines = [("24 B round trip, median us", "rtt_24B_us", 0), ("24 B round trip, p99 us", "rtt_24B_us", 1),
             ("GET 4 KiB, median us", "rtt_get_4KiB_us", 0), ("GET 4 KiB, p99 us", "rtt_get_4KiB_us", 1),
             ("GET 1 MiB, median us", "rtt_get_1MiB_us", 0), ("GET 1 MiB, p99 us", "rtt_get_1MiB_us", 1),
             ("SET 64 MiB, GB/s", "set_64MiB_GBps", None), ("idle CPU, head (s/s)", "head_idle_cpu", None),
             ("idle CPU, node (s/s)", "node_idle_cpu", None)]
    for label, key, i in lines:
        values = [med(t, key, i) for t in TRANSPORTS]
        ratio = values[0] / values[1] if values[1] else float("nan")
        print(f"{label:24}" + "".join(f"{v:>22.4g}" for v in values) + f"{ratio:>12.3f}")
    print(f"memcpy, one thread, GB/s: {med('auto', 'memcpy_GBps'):.2f}   "
          f"({args.rounds} rounds per transport, taken in turns; medians over rounds)")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
