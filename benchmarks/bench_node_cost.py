"""Benchmark: where the per-added-node cost of a layer split goes, over TCP and shared memory.

For each transport (TCP loopback, shared memory) and node count (1, 2, 4
``tbrpc node --threads 1`` on this machine), in turns, one stepping head
(bench_paired.py's: one decode step per stdin line, timed inside the head)
loads the model and then

1. decodes --steps tokens untimed by anything else: ms per token (median),
   and CPU ms per token of the head and of every node process (its worker
   included), from /proc;
2. decodes --steps more under ``perf record -e cpu-clock`` of all those
   processes: the CPU samples are sorted into buckets by where they fall
   (the function's source file in ggml_backend/, or its library):

     compute          ggml's CPU kernels (libggml-cpu) on the nodes
     dispatch         ggml's graph plumbing (libggml-base) on the nodes
     decode/validate  node_graphs.c, op_rules.c, proto.c, split_rules.c on the nodes
     session          the node's message loop and links (node*.c)
     encode           client.c, client_node.c, proto.c on the head
     scheduling       llama.cpp (libllama) and ggml's scheduler (libggml-base/-cpu) on the head
     python           the head's Python (llama-cpp-python's per-token code)
     wire             the transports (transport.c, transport/*.c) outside their waits
     spin-wait        the transports' wait loops: waiting that burns CPU (shared memory spins)
     kernel           system calls, the scheduler, wake-ups (on-CPU part)
     libc, other      memcpy, malloc, locks, the rest

   and "off-CPU" = wall time per token minus the CPU that is work (all
   buckets but spin-wait), summed over the processes: in a layer split the
   head and the nodes work one after the other, so what is left is time
   nobody computes: wake-up latency, the scheduler handing the core over.
   "sleeps/token" counts the voluntary context switches of all those
   processes per token in phase 1: each is a sleep some wake-up ended.

Per transport it prints the buckets in ms per token at 1, 2, 4 nodes, and
the per-added-node cost ((4 nodes - 1 node) / 3) of each, TCP and shared
memory side by side, with the load average. --node-python NAME=PATH runs
every configuration once more with the nodes started by PATH (a wrapper
that changes into another tree and runs python there with the tree on
PYTHONPATH: `python -m` puts the working directory first on sys.path, so
PYTHONPATH alone does not reach the nodes): a node-side change measured
side by side with this tree, in turns. perf's own CPU perturbs phase 2:
the wall figures come from phase 1, the split from phase 2 scaled to phase
1's CPU totals per process.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_node_cost.py --steps 300 --rounds 2

Needs `perf` (run as root, or perf_event_paranoid <= 1). A benchmark, not a
test: nothing here asserts on timings.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_split as split  # the model paths and the machine line

from tbrpc.node_processes import running
from tbrpc.spec import local_specs

HERE = Path(__file__).resolve().parent
N_CTX = 1024   # room for the prompt, 20 warm-up steps and two phases of --steps
C_DIR = HERE.parent / "ggml_backend"
TRANSPORTS = (("tcp", "tcp"), ("shm", "auto"))   # (label, TBRPC_TRANSPORT); "auto": shared memory on one host
Setup = tuple[str, str, "str | None"]   # (label, transport, the nodes' python: None for this tree's)
BUCKETS = ("compute", "dispatch", "decode/validate", "session", "encode", "scheduling", "python", "wire",
           "spin-wait", "kernel", "libc, other")
NODE_FILES = {"node_graphs.c": "decode/validate", "op_rules.c": "decode/validate", "split_rules.c": "decode/validate",
              "proto.c": "decode/validate", "node.c": "session", "node_session.c": "session",
              "node_links.c": "session", "node_files.c": "session", "model_file.c": "session", "auth.c": "session"}
HEAD_FILES = {"client.c": "encode", "client_node.c": "encode", "proto.c": "encode", "op_rules.c": "encode",
              "split_rules.c": "encode"}
WIRE_FILES = ("transport.c", "tcp.c", "ring.c", "shm.c", "rdma.c", "verbs_load.c")
_DEF = re.compile(r"^(?:static\s+|inline\s+)*[A-Za-z_][\w\s\*]*?\b([A-Za-z_]\w*)\s*\([^;]*$")


def function_files() -> dict[str, str]:
    """C function name -> the file under ggml_backend/ that defines it (by its definition line)."""
    where: dict[str, str] = {}
    for path in [*C_DIR.glob("*.c"), *(C_DIR / "transport").glob("*.c")]:
        for line in path.read_text().splitlines():
            m = _DEF.match(line)
            if m and not line.startswith(("return", "if", "else", "for", "while", "switch", "#", "typedef")):
                where.setdefault(m.group(1), path.name)
    return where


def bucket(head: bool, dso: str, sym: str, files: dict[str, str]) -> str:
    if dso.startswith("[kernel"):
        return "kernel"
    name = sym.removeprefix("[.] ").removeprefix("[k] ").strip().split("@")[0].split(".")[0]   # foo.isra.0 -> foo
    source = files.get(name)
    if source in WIRE_FILES:
        return "spin-wait" if "wait" in name or "spin" in name else "wire"
    if source:
        return (HEAD_FILES if head else NODE_FILES).get(source, "encode" if head else "session")
    if "libggml-cpu" in dso:
        return "scheduling" if head else "compute"
    if "libggml-base" in dso or "libggml.so" in dso:
        return "scheduling" if head else "dispatch"
    if "libllama" in dso:
        return "scheduling"
    if "libpython" in dso or dso.startswith("python") or "numpy" in dso:
        return "python"
    return "libc, other"


def group_pids(pgid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[2]) == pgid:
                    out.append(int(entry.name))
    return out


def cpu_s(pid: int) -> float:
    """On-CPU seconds of every thread of `pid`, in nanoseconds' precision (schedstat, not 10 ms ticks)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


def switches(pid: int) -> int:
    """Context switches of every thread of `pid`: each voluntary one is a sleep that a wake-up ends."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError, ValueError):
            for line in (task / "status").read_text().splitlines():
                if line.startswith("voluntary_ctxt_switches"):
                    total += int(line.split()[1])
    return total


class Head:
    """bench_paired.py's stepping head over `transport` ("tcp" or "auto"). Its mode says which:
    bench_paired's head passes its transport to connect(), which outranks TBRPC_TRANSPORT."""

    def __init__(self, endpoints: list[str], gguf: str, transport: str, n_ctx: int, log: Path) -> None:
        mode = {"tcp": "tbrpc-tcp", "auto": "tbrpc"}[transport]
        self.log = log
        with log.open("wb") as err:
            self.proc = subprocess.Popen([sys.executable, str(HERE / "bench_paired.py"), "head", "--mode", mode,
                                          "--endpoints", ",".join(endpoints), "--gguf", gguf, "--n-ctx", str(n_ctx)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "READY":
            raise SystemExit(f"the head did not load: {log.read_text()[-2000:]}")

    def steps(self, n: int) -> list[float]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        ms = []
        for _ in range(n):
            self.proc.stdin.write("\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
            if not line:
                raise SystemExit(f"the head stopped: {self.log.read_text()[-2000:]}")
            ms.append(float(line.split()[0]))
        return ms

    def close(self) -> None:
        with contextlib.suppress(BrokenPipeError):
            assert self.proc.stdin is not None
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
        self.proc.wait(timeout=60)


CALL_GRAPH = "fp"   # --call-graph: "dwarf" finds the callers of memcpy & co. where frame pointers are missing
TOP: collections.Counter[tuple[str, str, str]] = collections.Counter()   # (bucket, dso, symbol) -> samples, all runs


def perf_buckets(data: Path, head_pids: set[int], files: dict[str, str]) -> dict[tuple[bool, str], int]:
    """Samples per (on the head?, bucket); every sample also counts in TOP. A sample in libc (memcpy,
    malloc, ...) counts for the first caller on its stack that has a bucket of its own, when the stack
    shows one (libraries without frame pointers often cut it short)."""
    out = subprocess.run(["perf", "script", "-i", str(data), "-F", "pid,ip,sym,dso"], capture_output=True, text=True,
                         check=True).stdout
    counts: dict[tuple[bool, str], int] = collections.Counter()
    for block in out.split("\n\n"):
        lines = [line.strip() for line in block.strip().splitlines()]
        if len(lines) < 2 or not lines[0].isdigit():
            continue
        head = int(lines[0]) in head_pids
        frames = []
        for line in lines[1:]:
            sym, _, dso = line.rpartition(" (")
            frames.append((dso.rstrip(")"), sym.split(" ", 1)[1] if " " in sym else sym))
        dso, sym = frames[0]
        name, via = bucket(head, dso, sym, files), ""
        if name == "libc, other":
            for caller_dso, caller in frames[1:]:
                found = bucket(head, caller_dso, caller, files)
                if found not in ("libc, other", "kernel"):
                    name, via = found, f" (from {caller})"
                    break
        counts[(head, name)] += 1
        TOP[(("head " if head else "node ") + name, Path(dso).name, sym + via)] += 1
    return counts


def one_config(gguf: str, setup: Setup, n_nodes: int, steps: int, tmp: Path, files: dict[str, str]) -> dict[str, float]:
    """ms per token: "wall", and per bucket (CPU of head and nodes), "off-CPU"."""
    label, transport, node_python = setup
    specs = [dataclasses.replace(s, python=node_python) for s in local_specs(n_nodes, threads=1)]
    where = label.replace(" ", "-")
    with running(specs, tmp / f"{where}-{n_nodes}") as nodes:
        head = Head(nodes.endpoints, gguf, transport, N_CTX, tmp / f"head-{where}-{n_nodes}.log")
        try:
            head.steps(20)   # warm up
            pids = [head.proc.pid] + [p for pid in nodes.pids() for p in group_pids(os.getpgid(pid))]
            before = {p: cpu_s(p) for p in pids}
            sleeps = sum(switches(p) for p in pids)
            ms = head.steps(steps)
            cpu_ms = {p: (cpu_s(p) - before[p]) * 1e3 / steps for p in pids}
            sleeps = (sum(switches(p) for p in pids) - sleeps) / steps
            data = tmp / f"perf-{where}-{n_nodes}.data"
            perf = subprocess.Popen(["perf", "record", "-q", "--call-graph", CALL_GRAPH, "-e", "cpu-clock", "-F", "999", "-o", str(data),
                                     "-p", ",".join(map(str, pids))], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)   # perf attaches
            head.steps(steps)
            perf.send_signal(signal.SIGINT)
            perf.wait(timeout=60)
        finally:
            head.close()
    samples = perf_buckets(data, {head.proc.pid}, files)
    row: dict[str, float] = {"wall": statistics.median(ms), "sleeps/token": sleeps}
    for side, side_pids in ((True, [pids[0]]), (False, pids[1:])):
        total = sum(v for (h, _), v in samples.items() if h == side) or 1
        cpu = sum(cpu_ms[p] for p in side_pids)   # phase 1's CPU, split in phase 2's proportions
        for (h, name), v in samples.items():
            if h == side:
                row[name] = row.get(name, 0.0) + cpu * v / total
    row["off-CPU"] = row["wall"] - sum(v for k, v in row.items() if k not in ("wall", "spin-wait", "sleeps/token"))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="deepseek2")
    parser.add_argument("--nodes", default="1,2,4")
    parser.add_argument("--steps", type=int, default=400, help="decode steps per phase (two phases per run)")
    parser.add_argument("--rounds", type=int, default=2, help="each configuration this often, in turns; medians")
    parser.add_argument("--top", type=int, default=30, help="list this many of the busiest symbols")
    parser.add_argument("--node-python", action="append", default=[], metavar="NAME=PATH",
                        help="also run every configuration with nodes started by PATH (a wrapper that changes into another "
                             "tree and runs python there, that tree on PYTHONPATH): a node-side change, side by side")
    parser.add_argument("--call-graph", default="dwarf", choices=("fp", "dwarf"),
                        help="how perf walks stacks (dwarf: slower, but sees through libraries without frame pointers)")
    args = parser.parse_args()
    global CALL_GRAPH
    CALL_GRAPH = args.call_graph
    gguf = str(split._resolve_model(args.model, {}))
    counts = [int(n) for n in args.nodes.split(",")]
    files = function_files()
    print(f"machine: {split.machine()}; model {gguf}", flush=True)
    setups: list[Setup] = [(label, transport, None) for label, transport in TRANSPORTS]
    for variant in args.node_python:
        name, _, path = variant.partition("=")
        setups += [(f"{label} {name}", transport, path) for label, transport in TRANSPORTS]
    rows: dict[tuple[str, int], list[dict[str, float]]] = collections.defaultdict(list)
    loads = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="bench_node_cost-") as tmp:
        for _ in range(args.rounds):
            for n in counts:
                for setup in setups:
                    rows[(setup[0], n)].append(one_config(gguf, setup, n, args.steps, Path(tmp), files))
                    loads.append(os.getloadavg()[0])

    def med(label: str, n: int, key: str) -> float:
        return statistics.median(r.get(key, 0.0) for r in rows[(label, n)])

    keys = ("wall", *BUCKETS, "off-CPU", "sleeps/token")
    labels = [setup[0] for setup in setups]
    width = max(9, *(len(f"{label} {n}") + 1 for label in labels for n in counts))
    print(f"{'ms per token':18}" + "".join(f"{label + ' ' + str(n):>{width}}" for label in labels for n in counts)
          + "".join(f"{label + ' +node':>{width + 2}}" for label in labels))
    lo, hi = counts[0], counts[-1]
    for key in keys:
        cells = [med(label, n, key) for label in labels for n in counts]
        added = [(med(label, hi, key) - med(label, lo, key)) / (hi - lo) if hi > lo else 0.0 for label in labels]
        print(f"{key:18}" + "".join(f"{c:{width}.3f}" for c in cells) + "".join(f"{a:{width + 2}.3f}" for a in added))
    print(f"load average (1 min) at the start and after each configuration: {' '.join(f'{x:.2f}' for x in loads)}")
    print(f"{args.rounds} round(s) of {args.steps} steps per configuration, taken in turns; medians over rounds")
    total = sum(TOP.values()) or 1
    print("the symbols with the most samples (all configurations):")
    for (name, dso, sym), v in TOP.most_common(args.top):
        print(f"  {100 * v / total:5.1f}%  {name:22} {dso:28} {sym}")


if __name__ == "__main__":
    main()
