"""Benchmark: a layer split's decoded token laid out hop by hop, from timestamps.

bench_node_cost.py says where the CPU goes; this says where the *time* of a
token goes on its critical path, which CPU samples cannot: a wake-up that
takes 30 us costs nobody CPU. With TBRPC_TRACE set, the head's connections
and the nodes' sessions record when requests left and arrived, when graphs
started and ended and when a peer's activations were in (ggml_backend/
trace.h), all on the host's monotonic clock. For N local ``tbrpc node
--threads 1`` over TCP and over shared memory, in turns, a stepping head
(bench_node_cost.py's) decodes --steps tokens; then every token is cut into

  head            the head from the last token's logits to its first request
                  of this one (sampling, Python, llama.cpp, ggml's scheduler)
  head: to node 0's graph
                  from that request to the one with node 0's graph (the inputs
                  every node's graph needs go first)
  head -> node 0  from the head handing node 0 its graph to the graph starting
                  (the wire, node 0's wake-up, reading its requests)
  compute k       node k's graph, start to end
  hop k-1 -> k    from node k-1's graph ending to node k's starting, in three:
    to send       node k-1 reads its PEER_SEND request
    send, wake    from that to node k having the activations (the send, the
                  wire, node k's wake-up, the receive)
    to start      node k from the activations to its graph starting (reading
                  and decoding the graph request; waiting for the head's
                  request, if it came later)
  tail            the last node's graph end to the head holding the logits'
                  reply header (reading GET_TENSOR, the reply, the head's wake-up)

and "token - compute", the token's time nobody computed: what the split
adds. Medians over tokens, in microseconds, and the per-added-node cost of each
((N=4) - (N=1)) / 3 where both exist. The parts add up to the token's time
between two replies (the stepping head's turn on stdin falls in "head").

    PYTHONPATH=. .venv/bin/python benchmarks/trace_hops.py --nodes 1,2,4 --steps 300 --rounds 2
    PYTHONPATH=. .venv/bin/python benchmarks/trace_hops.py --nodes 4 --rounds 1 --dump 100   # one token's events

A benchmark, not a test: nothing here asserts on timings.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import struct
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_split as split  # the model paths and the machine line
from bench_node_cost import N_CTX, TRANSPORTS, Head

from tbrpc._native import ffi, lib
from tbrpc.node_processes import running
from tbrpc.spec import local_specs

EVENT = struct.Struct("<qHHI")
assert EVENT.size == ffi.sizeof("struct tb_trace_event")
REQUEST, DONE, FLUSH, REPLY = lib.TB_TRACE_REQUEST, lib.TB_TRACE_DONE, lib.TB_TRACE_FLUSH, lib.TB_TRACE_REPLY
G_START, G_END, PEER_DATA = lib.TB_TRACE_GRAPH_START, lib.TB_TRACE_GRAPH_END, lib.TB_TRACE_PEER_DATA
GRAPHS = (lib.TB_CMD_GRAPH_COMPUTE, lib.TB_CMD_GRAPH_RECOMPUTE)


@dataclass
class Trace:
    role: str
    who: str
    events: list[tuple[int, int, int]]   # (t_ns, what, cmd)

    def first(self, what: int, lo: int, hi: int, cmds: tuple[int, ...] = ()) -> int | None:
        for t, w, c in self.events:
            if lo <= t <= hi and w == what and (not cmds or c in cmds):
                return t
        return None

    def last(self, what: int, lo: int, hi: int, cmds: tuple[int, ...] = ()) -> int | None:
        for t, w, c in reversed(self.events):
            if lo <= t <= hi and w == what and (not cmds or c in cmds):
                return t
        return None


def read_traces(directory: Path) -> list[Trace]:
    out = []
    for path in sorted(directory.glob("*.trace")):
        data = path.read_bytes()
        line, _, body = data.partition(b"\n")
        _, _, role, who = line.decode().split(" ", 3)
        events = [(t, w, c) for t, w, c, _ in EVENT.iter_unpack(body[: len(body) - len(body) % EVENT.size])]
        out.append(Trace(role, who, events))
    return out


def token_parts(traces: list[Trace], endpoints: list[str], names: list[str]) -> dict[str, list[float]]:
    """Per part, its microseconds in every steady decoded token."""
    heads = {t.who: t for t in traces if t.role == "head"}
    # a node's session that computed graphs is the head's (probes and status calls compute none)
    nodes = {t.who: t for t in traces if t.role == "node" and any(w == G_START for _, w, _ in t.events)}
    head = [heads[e] for e in endpoints]
    node = [nodes[n] for n in names]
    ends = [t for t, w, c in head[-1].events if w == REPLY and c == lib.TB_CMD_GET_TENSOR]
    parts: dict[str, list[float]] = collections.defaultdict(list)
    us = 1e-3
    for prev, end in zip(ends[20:], ends[21:]):   # past the warm-up
        flushes = [h.first(FLUSH, prev + 1, end) for h in head]
        start = min(f for f in flushes if f is not None)
        g0 = head[0].first(FLUSH, prev + 1, end, (lib.TB_CMD_GRAPH_COMPUTE,))
        starts = [n.first(G_START, start, end) for n in node]
        stops = [n.last(G_END, start, end) for n in node]
        if g0 is None or None in starts or None in stops:
            continue
        parts["head"].append((start - prev) * us)
        parts["head: to node 0's graph"].append((g0 - start) * us)
        parts["head -> node 0"].append((starts[0] - g0) * us)
        for k in range(len(node)):
            parts[f"compute {k}"].append((stops[k] - starts[k]) * us)
        parts["compute, all"].append(sum(stops[k] - starts[k] for k in range(len(node))) * us)
        hop = {"hop: to send": 0.0, "hop: send, wake": 0.0, "hop: to start": 0.0}
        for k in range(1, len(node)):
            send = node[k - 1].first(REQUEST, stops[k - 1], end, (lib.TB_CMD_PEER_SEND,))
            data = node[k].last(PEER_DATA, start, starts[k])
            if send is None or data is None:
                break
            hop["hop: to send"] += (send - stops[k - 1]) * us
            hop["hop: send, wake"] += (data - send) * us
            hop["hop: to start"] += (starts[k] - data) * us
            parts[f"hop {k - 1} -> {k}"].append((starts[k] - stops[k - 1]) * us)
        else:
            for name, v in hop.items():
                parts[name + " (all hops)"].append(v)
        parts["tail"].append((end - stops[-1]) * us)
        parts["token"].append((end - prev) * us)
        parts["token - compute"].append((end - prev - sum(stops[k] - starts[k] for k in range(len(node)))) * us)
    return parts


WHAT = {REQUEST: "request", DONE: "done", FLUSH: "flush", REPLY: "reply", G_START: "graph start", G_END: "graph end",
        PEER_DATA: "peer data"}
CMD = {getattr(lib, n): n.removeprefix("TB_CMD_") for n in dir(lib) if n.startswith("TB_CMD_")}


def dump_token(traces: list[Trace], endpoints: list[str], names: list[str], index: int) -> None:
    """Every event of decoded token `index` (past the warm-up), in time order, across the processes."""
    heads = {t.who: t for t in traces if t.role == "head"}
    nodes = {t.who: t for t in traces if t.role == "node" and any(w == G_START for _, w, _ in t.events)}
    ends = [t for t, w, c in heads[endpoints[-1]].events if w == REPLY and c == lib.TB_CMD_GET_TENSOR]
    prev, end = ends[20 + index], ends[21 + index]
    rows = [(t, f"head -> node {k}", w, c) for k, e in enumerate(endpoints) for t, w, c in heads[e].events]
    rows += [(t, f"node {k}", w, c) for k, n in enumerate(names) for t, w, c in nodes[n].events]
    for t, who, w, c in sorted(r for r in rows if prev <= r[0] <= end):
        cmd = CMD.get(c, "") if w not in (G_START, G_END) else ""
        print(f"  {(t - prev) / 1e3:9.1f} us  {who:14} {WHAT[w]:12} {cmd}")


def one_config(gguf: str, transport: str, n_nodes: int, steps: int, tmp: Path, dump: int | None = None) -> dict[str, float]:
    trace_dir = tmp / f"trace-{transport}-{n_nodes}-{os.getpid()}-{len(list(tmp.iterdir()))}"
    trace_dir.mkdir()
    os.environ["TBRPC_TRACE"] = str(trace_dir)   # nodes and head inherit it
    try:
        specs = local_specs(n_nodes, threads=1)
        with running(specs, trace_dir / "nodes") as nodes:
            head = Head(nodes.endpoints, gguf, transport, N_CTX, trace_dir / "head.log")
            try:
                head.steps(steps + 21)
            finally:
                head.close()
        endpoints, names = nodes.endpoints, [s.name for s in specs]
    finally:
        del os.environ["TBRPC_TRACE"]
    traces = read_traces(trace_dir)
    if dump is not None:
        print(f"{transport} x{n_nodes}, decoded token {dump}:")
        dump_token(traces, endpoints, names, dump)
    parts = token_parts(traces, endpoints, names)
    return {name: statistics.median(v) for name, v in parts.items() if v}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="deepseek2")
    parser.add_argument("--nodes", default="1,2,4")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=2, help="each configuration this often, in turns; medians")
    parser.add_argument("--dump", type=int, default=None, metavar="K",
                        help="also print every event of the K-th decoded token of each run, in time order")
    args = parser.parse_args()
    gguf = str(split._resolve_model(args.model, {}))
    counts = [int(n) for n in args.nodes.split(",")]
    print(f"machine: {split.machine()}; model {gguf}", flush=True)
    results: dict[tuple[str, int], list[dict[str, float]]] = collections.defaultdict(list)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for _ in range(args.rounds):
            for label, transport in TRANSPORTS:
                for n in counts:
                    results[(label, n)].append(one_config(gguf, transport, n, args.steps, tmp, args.dump))
                    print(f"  {label} x{n}: token {results[(label, n)][-1].get('token', 0):.0f} us", flush=True)
    columns = [(label, n) for label, _ in TRANSPORTS for n in counts]
    names: list[str] = []
    for col in columns:
        for run in results[col]:
            names += [k for k in run if k not in names]
    med = {col: {k: statistics.median(r[k] for r in results[col] if k in r) for k in names
                 if any(k in r for r in results[col])} for col in columns}
    per_node = 1 in counts and 4 in counts
    head = f"{'us per token (median)':32}" + "".join(f"{f'{label} {n}':>10}" for label, n in columns)
    if per_node:
        head += "".join(f"{f'{label} +node':>12}" for label, _ in TRANSPORTS)
    print(head)
    for k in names:
        row = f"{k:32}" + "".join(f"{med[c][k]:10.1f}" if k in med[c] else f"{'':>10}" for c in columns)
        if per_node:
            for label, _ in TRANSPORTS:
                a, b = med[(label, 1)], med[(label, 4)]
                one = a.get(k, 0.0 if k.startswith("hop") else None)
                row += f"{(b[k] - one) / 3:12.1f}" if k in b and one is not None else f"{'':>12}"
        print(row)
    print(f"{args.rounds} round(s) of {args.steps} steps per configuration, in turns; load average "
          f"{open('/proc/loadavg').read().split()[0]} at the end")


if __name__ == "__main__":
    main()
