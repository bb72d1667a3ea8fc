"""Benchmark: a MoE layer's routed experts cut along their inner width on
every node, or placed whole per node, side by side, in one run.

What each node computes for one layer of Kimi K2 (n_embd 7168, expert
width 2048, 384 experts, 8 used per token, Q4_K), ggml's MUL_MAT_ID on the
CPU backend with one thread (benchmarks/experts_bench.c, built here with
tbrpc._build.build_program against llama-cpp-python's ggml):

  cut    (tbrpc's split_rules.c) every node holds every expert at width
         2048/N and runs all 8 selected experts of every token on its slice:
         the same work on every node, whatever the router picks
  whole  every node holds 384/N experts at full width and runs only the
         (token, expert) pairs whose expert it holds (ids made local); the
         step waits for the node that drew the most

The routing is drawn: each token picks 8 distinct experts uniformly at
random (real routers are skewed: --skew draws expert popularity from a Zipf
law, which only makes the busiest node busier). For each number of nodes
and tokens per step (1: a decoded token; 32 and 512: prompt chunks), every
draw times cut once (all nodes alike) and whole on every node, in a fresh
random order, and keeps the slowest node; each node's cut job relabels the
experts (the same work on other weights, so no job finds another's weights
in the cache). Two clocks: wall time, and the CPU time of the computing
process, which on a busy machine leaves out the time it waited for a core
(the node's own work; the ratio to read). Load statistics come from many
more draws than are timed. --parts also runs every job up to SwiGLU only,
to tell gate and up from the down projection. Both need one all-reduce of n_embd floats per
token afterwards (each node holds a partial sum of the layer's output), so
the network cost is the same and is not timed here.

    PYTHONPATH=. python benchmarks/bench_experts.py [--nodes 2,4] [--tokens 1,32,512]

A benchmark, not a test: nothing here asserts on timings.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_split as split  # the machine line

from tbrpc._build import build_program

HERE = Path(__file__).resolve().parent
N_EMBD, FF, USED, Q4K_BYTES_PER_WEIGHT = 7168, 2048, 8, 144 / 256


def draw(rng: np.random.Generator, tokens: int, experts: int, popularity: np.ndarray | None) -> np.ndarray:
    """[tokens, USED] distinct expert ids per token: uniform, or weighted by `popularity` (Gumbel top-k)."""
    keys = rng.random((tokens, experts))
    if popularity is not None:
        keys = np.log(popularity)[None, :] - np.log(-np.log(keys))
    return np.argpartition(-keys, USED - 1, axis=1)[:, :USED]


def zipf_popularity(rng: np.random.Generator, experts: int, skew: float) -> np.ndarray | None:
    if skew <= 0:
        return None
    weights = 1.0 / np.arange(1, experts + 1) ** skew
    return rng.permutation(weights / weights.sum())   # popular experts spread over the nodes at random


def node_loads(ids: np.ndarray, experts: int, nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows ((token, expert) pairs) and distinct experts per node, experts placed in contiguous blocks."""
    owner = ids.ravel() // (experts // nodes)
    rows = np.bincount(owner, minlength=nodes)
    distinct = np.bincount(np.unique(ids.ravel()) // (experts // nodes), minlength=nodes)
    return rows, distinct


@dataclass
class LoadStats:
    max_rows: float        # expected rows of the busiest node
    mean_rows: float       # USED * tokens / nodes
    max_distinct: float    # expected distinct experts the busiest node reads
    draws: int


def load_stats(rng: np.random.Generator, tokens: int, experts: int, nodes: int, popularity: np.ndarray | None,
               draws: int) -> LoadStats:
    maxes, distincts = [], []
    for _ in range(draws):
        rows, distinct = node_loads(draw(rng, tokens, experts, popularity), experts, nodes)
        busiest = int(np.argmax(rows))
        maxes.append(rows[busiest])
        distincts.append(distinct[busiest])
    return LoadStats(float(np.mean(maxes)), USED * tokens / nodes, float(np.mean(distincts)), draws)


class Harness:
    """experts_bench for one node count: one buffer of weights, jobs over stdin."""

    def __init__(self, exe: Path, experts: int, nodes: int) -> None:
        self.experts, self.nodes = experts, nodes
        self.proc = subprocess.Popen([str(exe), str(N_EMBD), str(FF), str(experts), str(nodes)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if self.proc.stdout is None or self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"experts_bench did not start (exit {self.proc.wait()})")

    def job(self, line: str) -> tuple[float, float]:
        """(wall ms, CPU ms) of one job."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        out = self.proc.stdout.readline().split()
        if len(out) != 2:
            raise RuntimeError(f"experts_bench stopped (exit {self.proc.wait()})")
        return float(out[0]), float(out[1])

    def cut(self, ids: np.ndarray, gate_up_only: bool = False) -> tuple[float, float]:
        mode = "cut-gu" if gate_up_only else "cut"
        return self.job(f"{mode} {USED} {ids.shape[0]} " + " ".join(map(str, ids.ravel())))

    def whole(self, ids: np.ndarray, node: int, gate_up_only: bool = False) -> tuple[float, float]:
        held = self.experts // self.nodes
        flat = ids.ravel()   # (token, expert) pairs in token order
        mine = flat[flat // held == node] - node * held
        mode = "whole-gu" if gate_up_only else "whole"
        return self.job(f"{mode} {len(mine)} " + " ".join(map(str, mine))) if len(mine) else (0.0, 0.0)

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait()


@dataclass
class Timing:
    """One clock (wall or CPU) over the timed draws, medians."""
    cut_ms: float          # the slowest node under cut
    whole_ms: float        # the slowest node under whole
    cut_mean_ms: float     # the nodes' mean under cut
    whole_mean_ms: float   # the nodes' mean under whole: whole perfectly balanced, at this kernel's speed
    ratio: float           # median over draws of cut / whole (slowest nodes)


def timing(draws: list[dict[tuple[str, int], float]], nodes: int) -> Timing:
    def per_draw(layout: str, f: Callable[[list[float]], float]) -> list[float]:
        return [f([d[(layout, j)] for j in range(nodes)]) for d in draws]

    mean = statistics.fmean
    cut, whole = per_draw("cut", max), per_draw("whole", max)
    med = statistics.median
    return Timing(med(cut), med(whole), med(per_draw("cut", mean)), med(per_draw("whole", mean)),
                  med([c / w for c, w in zip(cut, whole)]))


@dataclass
class Parts:
    """CPU ms of the mean node, medians over draws: gate and up (to SwiGLU), and the rest (down)."""
    cut_gate_up: float
    cut_down: float
    whole_gate_up: float
    whole_down: float


@dataclass
class Row:
    nodes: int
    tokens: int
    draws: int
    wall: Timing
    cpu: Timing
    stats: LoadStats
    parts: Parts | None


def parts_of(cpus: list[dict[tuple[str, int], float]], nodes: int) -> Parts:
    def mean_node(layout: str) -> float:
        return statistics.median(statistics.fmean(d[(layout, j)] for j in range(nodes)) for d in cpus)

    cut_gu, whole_gu = mean_node("cut-gu"), mean_node("whole-gu")
    return Parts(cut_gu, mean_node("cut") - cut_gu, whole_gu, mean_node("whole") - whole_gu)


def run_nodes(exe: Path, experts: int, nodes: int, tokens: list[int], draws: dict[int, int],
              rng: np.random.Generator, popularity: np.ndarray | None, stat_draws: dict[int, int],
              parts: bool) -> list[Row]:
    """Every draw times every node's job under both layouts, in a fresh random order. Each
    node's cut job relabels the experts at random (the same work on other weights), so no
    node's job finds another's weights in the cache; both layouts then take the slowest of
    N timings, and the machine's noise weighs on them alike. With `parts`, every job also runs
    up to SwiGLU only (gate and up), in the same shuffled order."""
    harness = Harness(exe, experts, nodes)
    rows = []
    try:
        for t in tokens:
            warm = draw(rng, t, experts, popularity)
            harness.cut(warm)
            harness.whole(warm, 0)
            walls, cpus = [], []
            for _ in range(draws[t]):
                ids = draw(rng, t, experts, popularity)
                layouts = ("cut", "whole", "cut-gu", "whole-gu") if parts else ("cut", "whole")
                jobs = [(layout, j) for layout in layouts for j in range(nodes)]
                wall: dict[tuple[str, int], float] = {}
                cpu: dict[tuple[str, int], float] = {}
                for k in rng.permutation(len(jobs)):
                    layout, j = jobs[k]
                    gate_up_only = layout.endswith("-gu")
                    wall[jobs[k]], cpu[jobs[k]] = \
                        harness.cut(rng.permutation(experts)[ids], gate_up_only) if layout.startswith("cut") \
                        else harness.whole(ids, j, gate_up_only)
                walls.append(wall)
                cpus.append(cpu)
            row = Row(nodes, t, draws[t], timing(walls, nodes), timing(cpus, nodes),
                      load_stats(rng, t, experts, nodes, popularity, stat_draws[t]),
                      parts_of(cpus, nodes) if parts else None)
            rows.append(row)
            print(f"  {nodes} nodes, {t:4d} tokens, slowest node: CPU cut {row.cpu.cut_ms:.2f} ms, whole "
                  f"{row.cpu.whole_ms:.2f} ms, cut/whole {row.cpu.ratio:.2f}; wall cut {row.wall.cut_ms:.2f} ms, "
                  f"whole {row.wall.whole_ms:.2f} ms, cut/whole {row.wall.ratio:.2f}; busiest node "
                  f"{row.stats.max_rows:.1f} of {row.stats.mean_rows:.1f} rows on average", flush=True)
    finally:
        harness.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", default="2,4")
    parser.add_argument("--tokens", default="1,32,512")
    parser.add_argument("--draws", default="1:60,32:12,512:3", help="timed draws per token count")
    parser.add_argument("--experts", type=int, default=384,
                        help="experts per layer (Kimi K2: 384); fewer to fit memory: "
                             "3 x 9.5 GB / 384 x experts / nodes")
    parser.add_argument("--skew", type=float, default=0.0,
                        help="Zipf exponent of expert popularity (0: uniform routing)")
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--parts", action="store_true",
                        help="also time every job up to SwiGLU only: gate and up against down, per node")
    args = parser.parse_args()
    nodes = [int(n) for n in args.nodes.split(",")]
    tokens = [int(t) for t in args.tokens.split(",")]
    draws = {int(k): int(v) for k, v in (kv.split(":") for kv in args.draws.split(","))}
    stat_draws = {t: max(200, 200_000 // (t * 8)) for t in tokens}
    rng = np.random.default_rng(args.seed)
    popularity = zipf_popularity(rng, args.experts, args.skew)
    need = 3 * N_EMBD * FF * args.experts / min(nodes) * Q4K_BYTES_PER_WEIGHT
    avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if need > 0.8 * avail:
        sys.exit(f"the weights of {min(nodes)} nodes need {need / 1e9:.1f} GB and {avail / 1e9:.1f} GB are free: "
                 f"lower --experts")
    print(f"machine: {split.machine()}", flush=True)
    print(f"Kimi K2 experts: n_embd {N_EMBD}, width {FF}, {args.experts} experts, {USED} used, Q4_K, "
          f"routing {'uniform' if args.skew <= 0 else f'Zipf {args.skew:g}'}; one thread; "
          f"all-reduce {N_EMBD * 4} bytes per token for both", flush=True)
    with tempfile.TemporaryDirectory(prefix="tbrpc-experts-") as tmp:
        exe = build_program(HERE / "experts_bench.c", Path(tmp) / "experts_bench")
        rows = [r for n in nodes for r in run_nodes(exe, args.experts, n, tokens, draws, rng, popularity, stat_draws,
                                                     args.parts)]
    print(f"load average at the end: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print()
    print("| nodes | tokens | whole: busiest node's rows (mean) | its distinct experts | cut CPU ms | whole CPU ms "
          "| cut / whole, CPU | cut / whole, wall | mean node CPU ms, cut / whole | draws timed |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---|---:|")
    for r in rows:
        s = r.stats
        print(f"| {r.nodes} | {r.tokens} | {s.max_rows:.1f} ({s.mean_rows:.1f}, x{s.max_rows / s.mean_rows:.2f}) "
              f"| {s.max_distinct:.1f} | {r.cpu.cut_ms:.2f} | {r.cpu.whole_ms:.2f} | **{r.cpu.ratio:.2f}** "
              f"| {r.wall.ratio:.2f} | {r.cpu.cut_mean_ms:.2f} / {r.cpu.whole_mean_ms:.2f} | {r.draws} |")
    if args.parts:
        print()
        print("| nodes | tokens | gate+up CPU ms, cut / whole | down CPU ms, cut / whole | cut / whole, gate+up "
              "| cut / whole, down |")
        print("|---:|---:|---|---|---:|---:|")
        for r in rows:
            if r.parts:
                q = r.parts
                print(f"| {r.nodes} | {r.tokens} | {q.cut_gate_up:.2f} / {q.whole_gate_up:.2f} | {q.cut_down:.2f} / "
                      f"{q.whole_down:.2f} | {q.cut_gate_up / q.whole_gate_up:.2f} | {q.cut_down / q.whole_down:.2f} |")

if __name__ == "__main__":
    main()
