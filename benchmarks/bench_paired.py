"""Benchmark: tbrpc against llama.cpp's RPC (or any contenders), token by token, side by side.

bench_split.py runs each configuration in its own processes, one after the
other. On a shared VM that mixes two effects into every ratio: drift of the
machine's speed over seconds, and an order effect (here the set of
processes that loads second runs its decode steps 2-4 % faster, whichever
protocol it is; see docs/benchmarks.md). This script removes both:

- both clusters are up at once: N ``tbrpc node`` processes with a tbrpc head,
  and N llama.cpp RPC servers with a head from the RPC venv;
- the heads take turns, one decode step each (the one that goes first
  alternates every step), so both see the same machine at the same moment;
- which cluster loads first alternates every round, and the result is the
  mean over rounds, so the order effect cancels instead of picking a winner.

Per model and node count it prints milliseconds per generated token for
both, the speed ratio tbrpc / llama.cpp RPC per round and overall, and the
ratio split by load order. Decoding is greedy from bench_split's prompt; the
script checks that both heads generate the same tokens.

``--contenders`` takes any number of clusters, the first being the reference
of every ratio: ``tbrpc`` (the default transport: shared memory on one
host), ``tbrpc-tcp``, ``rpc``, each optionally ``@NAME`` for a tree given by
``--tree NAME=PATH`` (a checkout whose ``tbrpc`` and built extension go first
on PYTHONPATH for that cluster's head and nodes): a change measured against
the tree it changes, or shared memory against TCP, at the same moments.
``--apart`` brings one contender's cluster up at a time instead (each takes
its steps in a row, the rounds rotating who goes first): the machine as a
lone cluster finds it, at the price of the drift between runs.

Usage (from the repo root, with the dev venv; benchmarks/rpc_venv.sh once):

    PYTHONPATH=. .venv/bin/python benchmarks/bench_paired.py
    PYTHONPATH=. .venv/bin/python benchmarks/bench_paired.py --models gemma --nodes 1 --rounds 4 --steps 300
    PYTHONPATH=. .venv/bin/python benchmarks/bench_paired.py --contenders tbrpc-tcp,tbrpc,tbrpc-tcp@old,tbrpc@old \
        --tree old=/path/to/checkout

This is a benchmark, not a test: nothing here asserts on timings.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_split as split  # (after the path: the servers, the RPC venv and the prompt are shared)

MODES = ("tbrpc", "tbrpc-tcp", "rpc")
READY = "READY"


# ---------------------------------------------------------------------------
# A head that decodes one token per line on stdin (run by either venv)
# ---------------------------------------------------------------------------

def run_stepping_head(mode: str, endpoints: Sequence[str], gguf: str, n_ctx: int) -> None:
    """Load the model over `endpoints`, evaluate the prompt, then decode one
    token per line read from stdin and print "<ms> <token>" for each."""
    import llama_cpp
    import numpy as np

    if mode in ("tbrpc", "tbrpc-tcp"):
        import tbrpc

        # a tree from before the transport layer has no `transport` (and speaks only TCP)
        asked = {"transport": "tcp" if mode == "tbrpc-tcp" else "auto"}
        tbrpc.connect(list(endpoints), **(asked if "transport" in inspect.signature(tbrpc.connect).parameters else {}))
        # A column labelled with a transport must have run over it (a tree from before the transport layer
        # reports none): "tbrpc" is shared memory on one host, "tbrpc-tcp" TCP.
        want = "tcp" if mode == "tbrpc-tcp" else "shm"
        got = [getattr(n, "transport", None) for n in tbrpc.cluster().nodes()] if hasattr(tbrpc.Cluster, "nodes") else []
        wrong = [t for t in got if t is not None and t.split()[0].rstrip(":") != want]
        if wrong:
            raise SystemExit(f"{mode} head: asked for {want}, but the connections run over {wrong}")
    else:
        split._register_rpc_servers(endpoints)
    llm = llama_cpp.Llama(model_path=gguf, n_gpu_layers=-1, tensor_split=[1.0] * len(endpoints), n_ctx=n_ctx,
                          n_threads=1, n_threads_batch=1, seed=0, verbose=False)
    n_vocab = llm.n_vocab()

    def next_token() -> int:
        logits = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(logits, shape=(n_vocab,))))

    llm.eval(llm.tokenize(split.PROMPT.encode(), add_bos=True))
    token = next_token()
    print(READY, flush=True)
    for line in sys.stdin:
        if line.strip() == "quit":
            break
        started = time.perf_counter()
        llm.eval([token])
        token = next_token()
        print(f"{(time.perf_counter() - started) * 1e3:.3f} {token}", flush=True)
    del llm   # llama.cpp's RPC client talks to its servers on the way out


# ---------------------------------------------------------------------------
# Orchestrator
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Contender:
    name: str                       # "tbrpc-tcp@old"
    mode: str                       # one of MODES
    tree: Path | None               # a checkout put first on PYTHONPATH, or None for this one

    @staticmethod
    def parse(text: str, trees: dict[str, Path]) -> Contender:
        mode, _, tree = text.partition("@")
        if mode not in MODES:
            raise SystemExit(f"contender {text}: the mode must be one of {', '.join(MODES)}")
        if tree and tree not in trees:
            raise SystemExit(f"contender {text}: no --tree {tree}=PATH")
        return Contender(text, mode, trees[tree] if tree else None)


@dataclass
class Round:
    first: str                      # the contender whose cluster loaded first
    ms: dict[str, list[float]]      # per contender, per step
    same_tokens: bool

    def ratio(self, a: str, b: str) -> float:
        """Generation speed of b over a (> 1: b is faster)."""
        return statistics.mean(self.ms[a]) / statistics.mean(self.ms[b])


def runner_for(base: split.Runner, contender: Contender) -> split.Runner:
    """The runner whose heads and nodes import the contender's tree."""
    if contender.tree is None:
        return base
    runner = split.Runner(base.python, base.rpc_python, base.log_dir, base.n_gen, base.n_ctx, base.repeats)
    runner.env["PYTHONPATH"] = str(contender.tree)   # its logs' names carry the contender's
    runner.tree = contender.tree
    return runner


class Head:
    def __init__(self, runner: split.Runner, mode: str, endpoints: list[str], gguf: str, n_ctx: int,
                 log: Path) -> None:
        cmd = [runner.python_for(mode), __file__, "head", "--mode", mode, "--endpoints", ",".join(endpoints),
               "--gguf", gguf, "--n-ctx", str(n_ctx)]
        self.log = log
        with log.open("wb") as err:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                         env=runner.env, cwd=runner.tree, text=True)
        if self._line() != READY:
            raise RuntimeError(f"{mode} head did not load; see {log}:\n{log.read_text()[-3000:]}")

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"head exited with {self.proc.wait()}; see {self.log}:\n{self.log.read_text()[-3000:]}")
        return line.strip()

    def step(self) -> tuple[float, int]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        ms, token = self._line().split()
        return float(ms), int(token)

    def close(self) -> None:
        with contextlib.suppress(BrokenPipeError):
            assert self.proc.stdin is not None
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def run_round(runner: split.Runner, contenders: list[Contender], model: str, gguf: str, n_nodes: int, first: int,
              steps: int, n_ctx: int) -> Round:
    """Every contender's cluster up at once (loaded from contenders[first] on, in turn), then one decode
    step each in turns. Two contenders alternate which goes first. More take a fresh random order every
    step (seeded, so a run repeats): every contender takes every place, and follows every other one,
    equally often on average. A fixed rotation would have each contender always follow the same one, and
    whose caches it finds after it is a systematic effect (measured: up to 10 % on the tiny model);
    reversing the order would leave the middle places to the same contenders."""
    order = contenders[first:] + contenders[:first]
    with contextlib.ExitStack() as stack:
        heads: dict[str, Head] = {}
        for c in order:
            run = runner_for(runner, c)
            endpoints = stack.enter_context(run.servers(split.Config(model, gguf, c.mode, n_nodes)))
            heads[c.name] = Head(run, c.mode, endpoints, gguf, n_ctx, run.new_log(f"{model}-{c.name}{n_nodes}-head"))
            stack.callback(heads[c.name].close)
        names = [c.name for c in contenders]
        shuffle = random.Random(first)
        ms: dict[str, list[float]] = {n: [] for n in names}
        tokens: dict[str, list[int]] = {n: [] for n in names}
        for s in range(steps):
            turn = names[s % 2:] + names[:s % 2] if len(names) == 2 else shuffled(names, shuffle)
            for name in turn:
                t, token = heads[name].step()
                ms[name].append(t)
                tokens[name].append(token)
    return Round(order[0].name, ms, all(tokens[n] == tokens[names[0]] for n in names))


def run_apart(runner: split.Runner, contenders: list[Contender], model: str, gguf: str, n_nodes: int, first: int,
              steps: int, n_ctx: int) -> Round:
    """--apart: one contender's cluster at a time, its steps one after another, then gone before the
    next one's comes up (contenders[first] first): the machine as one cluster finds it, with no other
    cluster's processes sharing the caches. The round's contenders still run minutes apart at most,
    and the rounds rotate who goes first."""
    order = contenders[first:] + contenders[:first]
    ms: dict[str, list[float]] = {}
    tokens: dict[str, list[int]] = {}
    for c in order:
        run = runner_for(runner, c)
        with run.servers(split.Config(model, gguf, c.mode, n_nodes)) as endpoints:
            head = Head(run, c.mode, endpoints, gguf, n_ctx, run.new_log(f"{model}-{c.name}{n_nodes}-head"))
            try:
                steps_taken = [head.step() for _ in range(steps)]
            finally:
                head.close()
        ms[c.name] = [t for t, _ in steps_taken]
        tokens[c.name] = [token for _, token in steps_taken]
    names = [c.name for c in contenders]
    return Round(order[0].name, ms, all(tokens[n] == tokens[names[0]] for n in names))


def shuffled(names: list[str], rng: random.Random) -> list[str]:
    order = list(names)
    rng.shuffle(order)
    return order


def report(model: str, n_nodes: int, names: list[str], rounds: list[Round]) -> str:
    """One table row: ms per token of each contender, then each one's speed over the first's (mean over
    rounds, and per round), and the ratio by which contender loaded first."""
    ms = {n: statistics.mean(x for r in rounds for x in r.ms[n]) for n in names}
    cells = [f"{ms[n]:.3f}" for n in names]
    for n in names[1:]:
        ratios = [r.ratio(names[0], n) for r in rounds]
        by_first = {f: [r.ratio(names[0], n) for r in rounds if r.first == f] for f in names}
        order_note = ", ".join(f"{f} first {statistics.mean(v):.3f}" for f, v in by_first.items() if v)
        cells.append(f"**{statistics.mean(ratios):.3f}** ({', '.join(f'{x:.3f}' for x in ratios)}; {order_note})")
    return f"| {model} | {n_nodes} | " + " | ".join(cells) + " |"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    head = sub.add_parser("head", help="(internal) a head that decodes one token per stdin line")
    head.add_argument("--mode", choices=MODES, required=True)
    head.add_argument("--endpoints", required=True)
    head.add_argument("--gguf", required=True)
    head.add_argument("--n-ctx", type=int, required=True)
    parser.add_argument("--models", default="gemma,deepseek2")
    parser.add_argument("--gguf", action="append", default=[], metavar="NAME=PATH")
    parser.add_argument("--nodes", default="1,2,4")
    parser.add_argument("--rounds", type=int, default=4, help="fresh clusters per configuration; load order alternates")
    parser.add_argument("--steps", type=int, default=200, help="decode steps per head per round")
    parser.add_argument("--n-ctx", type=int, default=512)
    parser.add_argument("--rpc-venv", default=str(split.DEFAULT_RPC_VENV))
    parser.add_argument("--log-dir", type=Path)
    parser.add_argument("--contenders", default="tbrpc,rpc",
                        help="clusters stepping in turns, the first the reference: MODE or MODE@TREE, MODE one of "
                             + ", ".join(MODES))
    parser.add_argument("--tree", action="append", default=[], metavar="NAME=PATH",
                        help="a checkout (with its extension built) that MODE@NAME runs")
    parser.add_argument("--apart", action="store_true",
                        help="one cluster up at a time, each taking its steps in a row (rounds rotate the order)")
    args = parser.parse_args(argv)
    if args.command == "head":
        run_stepping_head(args.mode, args.endpoints.split(","), args.gguf, args.n_ctx)
        return 0

    trees = {name: Path(path).resolve() for name, _, path in (t.partition("=") for t in args.tree)}
    contenders = [Contender.parse(c, trees) for c in split._csv(args.contenders)]
    names = [c.name for c in contenders]
    if len(set(names)) != len(names) or len(names) < 2:
        parser.error("--contenders: two or more, each once")
    rpc_python = Path(args.rpc_venv) / "bin" / "python"
    if any(c.mode == "rpc" for c in contenders) and not rpc_python.exists():
        parser.error(f"{rpc_python} is missing: run benchmarks/rpc_venv.sh first")
    if args.steps + 128 > args.n_ctx:
        parser.error("--steps must leave room for the prompt in --n-ctx")
    overrides = dict(o.split("=", 1) for o in args.gguf)
    print(f"machine: {split.machine()}", flush=True)
    lines: list[str] = []
    all_same = True
    with contextlib.ExitStack() as stack:
        log_dir = args.log_dir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench_paired-")))
        log_dir.mkdir(parents=True, exist_ok=True)
        runner = split.Runner(sys.executable, str(rpc_python), log_dir, args.steps, args.n_ctx, 1)
        for model in split._csv(args.models):
            gguf = split._resolve_model(model, overrides)
            for n_nodes in (int(n) for n in split._csv(args.nodes)):
                rounds = []
                for r in range(args.rounds):
                    first = r % len(contenders)
                    print(f"  {model} x{n_nodes} round {r + 1}/{args.rounds} ({names[first]} loads first) ...",
                          end=" ", flush=True)
                    one_round = run_apart if args.apart else run_round
                    rounds.append(one_round(runner, contenders, model, gguf, n_nodes, first, args.steps, args.n_ctx))
                    all_same &= rounds[-1].same_tokens
                    print(", ".join(f"{n}/{names[0]} speed {rounds[-1].ratio(names[0], n):.3f}" for n in names[1:])
                          + ("" if rounds[-1].same_tokens else "  TOKENS DIFFER"), flush=True)
                lines.append(report(model, n_nodes, names, rounds))
    how = "one cluster at a time" if args.apart else "heads alternating step by step"
    print(f"\n{args.steps} decode steps per head per round, {how}, 1 thread per process")
    print("| model | nodes | " + " | ".join(f"{n} ms/token" for n in names) + " | "
          + " | ".join(f"speed {n} / {names[0]} (per round; by load order)" for n in names[1:]) + " |")
    print("|---|---:|" + "---:|" * len(names) + "---|" * (len(names) - 1))
    print("\n".join(lines))
    print("\nall heads generated the same tokens in every round" if all_same else "\nTOKENS DIFFERED in some round")
    return 0 if all_same else 1


if __name__ == "__main__":
    sys.exit(main())
