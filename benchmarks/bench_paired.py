"""Benchmark: tbrpc against llama.cpp's RPC, token by token, side by side.

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

Usage (from the repo root, with the dev venv; benchmarks/rpc_venv.sh once):

    PYTHONPATH=. /work/venv/bin/python benchmarks/bench_paired.py
    PYTHONPATH=. /work/venv/bin/python benchmarks/bench_paired.py --models gemma --nodes 1 --rounds 4 --steps 300

This is a benchmark, not a test: nothing here asserts on timings.
"""

from __future__ import annotations

import argparse
import contextlib
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

MODES = ("tbrpc", "rpc")
READY = "READY"


# ---------------------------------------------------------------------------
# A head that decodes one token per line on stdin (run by either venv)
# ---------------------------------------------------------------------------

def run_stepping_head(mode: str, endpoints: Sequence[str], gguf: str, n_ctx: int) -> None:
    """Load the model over `endpoints`, evaluate the prompt, then decode one
    token per line read from stdin and print "<ms> <token>" for each."""
    import llama_cpp
    import numpy as np

    if mode == "tbrpc":
        import tbrpc

        tbrpc.connect(list(endpoints))
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

@dataclass
class Round:
    first: str                      # the mode whose cluster loaded first
    ms: dict[str, list[float]]      # per mode, per step
    same_tokens: bool

    def ratio(self) -> float:
        """Generation speed of tbrpc over llama.cpp RPC (> 1: tbrpc is faster)."""
        return statistics.mean(self.ms["rpc"]) / statistics.mean(self.ms["tbrpc"])


class Head:
    def __init__(self, runner: split.Runner, mode: str, endpoints: list[str], gguf: str, n_ctx: int,
                 log: Path) -> None:
        cmd = [runner.python_for(mode), __file__, "head", "--mode", mode, "--endpoints", ",".join(endpoints),
               "--gguf", gguf, "--n-ctx", str(n_ctx)]
        self.log = log
        with log.open("wb") as err:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                         env=runner.env, cwd=split.REPO, text=True)
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


def run_round(runner: split.Runner, model: str, gguf: str, n_nodes: int, first: str, steps: int,
              n_ctx: int) -> Round:
    order = [first] + [m for m in MODES if m != first]
    with contextlib.ExitStack() as stack:
        heads: dict[str, Head] = {}
        for mode in order:
            config = split.Config(model, gguf, mode, n_nodes)
            endpoints = stack.enter_context(runner.servers(config))
            heads[mode] = Head(runner, mode, endpoints, gguf, n_ctx, runner.new_log(f"{model}-{mode}{n_nodes}-head"))
            stack.callback(heads[mode].close)
        ms: dict[str, list[float]] = {m: [] for m in MODES}
        tokens: dict[str, list[int]] = {m: [] for m in MODES}
        for s in range(steps):
            for mode in (MODES if s % 2 == 0 else MODES[::-1]):
                t, token = heads[mode].step()
                ms[mode].append(t)
                tokens[mode].append(token)
    return Round(first, ms, tokens["tbrpc"] == tokens["rpc"])


def report(model: str, n_nodes: int, rounds: list[Round]) -> str:
    ms = {m: statistics.mean(x for r in rounds for x in r.ms[m]) for m in MODES}
    ratios = [r.ratio() for r in rounds]
    by_first = {f: [r.ratio() for r in rounds if r.first == f] for f in MODES}
    order_note = ", ".join(f"{f} loaded first {statistics.mean(v):.3f}" for f, v in by_first.items() if v)
    return (f"| {model} | {n_nodes} | {ms['tbrpc']:.2f} | {ms['rpc']:.2f} | **{statistics.mean(ratios):.3f}** | "
            f"{', '.join(f'{x:.3f}' for x in ratios)} | {order_note} |")


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
    args = parser.parse_args(argv)
    if args.command == "head":
        run_stepping_head(args.mode, args.endpoints.split(","), args.gguf, args.n_ctx)
        return 0

    rpc_python = Path(args.rpc_venv) / "bin" / "python"
    if not rpc_python.exists():
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
                    first = MODES[r % 2]
                    print(f"  {model} x{n_nodes} round {r + 1}/{args.rounds} ({first} loads first) ...", end=" ",
                          flush=True)
                    rounds.append(run_round(runner, model, gguf, n_nodes, first, args.steps, args.n_ctx))
                    all_same &= rounds[-1].same_tokens
                    print(f"tbrpc/rpc speed {rounds[-1].ratio():.3f}"
                          + ("" if rounds[-1].same_tokens else "  TOKENS DIFFER"), flush=True)
                lines.append(report(model, n_nodes, rounds))
    print(f"\n{args.steps} decode steps per head per round, heads alternating step by step, 1 thread per process")
    print("| model | nodes | tbrpc ms/token | llama.cpp RPC ms/token | speed tbrpc / RPC | per round | by load order |")
    print("|---|---:|---:|---:|---:|---|---|")
    print("\n".join(lines))
    print("\nboth heads generated the same tokens in every round" if all_same else "\nTOKENS DIFFERED in some round")
    return 0 if all_same else 1


if __name__ == "__main__":
    sys.exit(main())
