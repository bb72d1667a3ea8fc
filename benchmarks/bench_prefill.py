"""Benchmark: a long prompt through a layer split, pipelined or piece by piece.

llama-cpp-python decodes a prompt n_batch tokens at a time and asks for the
last token's logits of every piece, so each piece waits for the last node
before the next one leaves: the nodes of a layer split work one after
another. tbrpc.Llama.eval asks for the last piece's logits only, so node k
computes piece i + 1 while node k + 1 computes piece i (tbrpc/llama.py,
Llama.eval). Side by side in one run, modes alternating per round:

  single            the model in one process (n_threads=1), llama.cpp's defaults
  single-norepack   the same with weights in plain CPU buffers (the kernels nodes run)
  own               N local nodes (1 thread each), llama-cpp-python's own eval
  piped             the same nodes, tbrpc.Llama.eval

`own` and `piped` run in one head process over the same nodes, taking turns
within each round. Prints prompt tokens/s (median over rounds) and the
ratios; checks that every mode ends the prompt on the same next token.
`--tensor-split 1,1` overrides the plan's layer ranges.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_prefill.py --model gemma --nodes 2 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

RUN = """
import contextlib, json, sys, time
spec = json.loads(sys.argv[1])
import llama_cpp
import numpy as np
kw = dict(n_ctx=spec["n_ctx"], n_batch=spec["batch"], n_ubatch=spec["ubatch"], n_threads=1, n_threads_batch=1,
          verbose=False, seed=0)
if spec["nodes"]:
    import tbrpc
    if spec["tensor_split"]:
        kw["tensor_split"] = spec["tensor_split"]
    llm = tbrpc.Llama(spec["model"], cluster=spec["nodes"], **kw)
    layers = [list(n.layers) if n.layers else None for n in llm.tbrpc_plan.nodes]
    modes = {"own": lambda t: llama_cpp.Llama.eval(llm, t), "piped": llm.eval}
else:
    from tbrpc.head_buffers import plain_cpu_buffers
    with plain_cpu_buffers() if spec["norepack"] else contextlib.nullcontext():
        llm = llama_cpp.Llama(spec["model"], n_gpu_layers=0, **kw)
    layers = None
    modes = {spec["name"]: llm.eval}
text = " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog, number {i * 7}." for i in range(400))
tokens = llm.tokenize(text.encode())[:spec["tokens"]]
def next_token():
    return int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))))
out = {name: [] for name in modes}
nexts = {}
for r in range(spec["rounds"] + 1):   # round 0 warms up
    for name in (list(modes) if r % 2 == 0 else list(reversed(modes))):
        llm.reset(); llm._ctx.kv_cache_clear()
        t = time.perf_counter(); modes[name](tokens); nexts[name] = next_token(); dt = time.perf_counter() - t
        if r:
            out[name].append(len(tokens) / dt)
print(json.dumps({"tps": out, "next": nexts, "layers": layers}))
"""


def run(spec: dict[str, Any]) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-c", RUN, json.dumps(spec)], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gemma", help="gemma, or a tiny model of models/ (llama, deepseek2, ...)")
    parser.add_argument("--nodes", default="2", help="comma-separated node counts")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=1536)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--ubatch", type=int, default=256)
    parser.add_argument("--tensor-split", default=None, help="e.g. 1,1: the layer split's shares instead of the plan's")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    import models
    from models import gemma

    model = str(gemma.path() if args.model == "gemma" else models.ensure(args.model))
    base = {"model": model, "tokens": args.tokens, "batch": args.batch, "ubatch": args.ubatch,
            "n_ctx": max(2048, args.tokens + 64), "rounds": 1,
            "tensor_split": [float(x) for x in args.tensor_split.split(",")] if args.tensor_split else None}
    counts = [int(n) for n in args.nodes.split(",")]
    if args.tensor_split and any(n != len(args.tensor_split.split(",")) for n in counts):
        parser.error(f"--tensor-split {args.tensor_split} gives shares for {len(args.tensor_split.split(','))} nodes; "
                     f"--nodes {args.nodes} asks for others")
    runs = [("single", 0, False), ("single-norepack", 0, True)] + [(f"{n} nodes", n, False) for n in counts]
    tps: dict[str, list[float]] = {}
    nexts: dict[str, set[int]] = {}
    layers: dict[int, Any] = {}
    for r in range(args.rounds):   # one round per process start: nodes and head start afresh each round
        for name, n, norepack in (runs if r % 2 == 0 else list(reversed(runs))):
            got = run({**base, "name": name, "nodes": n, "norepack": norepack})
            for mode, values in got["tps"].items():
                key = mode if not n else f"{mode}, {n} nodes"
                tps.setdefault(key, []).extend(values)
                nexts.setdefault(key, set()).add(got["next"][mode])
            if n:
                layers[n] = got["layers"]
    single = statistics.median(tps["single-norepack"])
    print(f"{Path(model).name}: a {args.tokens}-token prompt, n_batch {args.batch}, n_ubatch {args.ubatch}, one thread "
          f"per process, {args.rounds} rounds (medians); {os.cpu_count()} cores, load average "
          + ", ".join(f"{x:.2f}" for x in os.getloadavg()))
    for n, ranges in layers.items():   # the plan's ranges; a --tensor-split replaces them (llama.cpp cuts its shares)
        print(f"  {n} nodes: " + (f"tensor_split {args.tensor_split}" if args.tensor_split else f"planned layers {ranges}"))
    print(f"{'mode':22} {'prompt t/s':>10} {'vs one process (no repack)':>27} {'piped / own':>11}")
    for key, values in tps.items():
        med = statistics.median(values)
        own = tps.get(key.replace("piped", "own")) if key.startswith("piped") else None
        ratio = f"{med / statistics.median(own):11.2f}" if own else ""
        print(f"{key:22} {med:10.1f} {med / single:27.2f} {ratio}")
    same = len({t for s in nexts.values() for t in s}) == 1
    print("the same next token in every mode and round" if same else f"NEXT TOKENS DIFFER: {nexts}")


if __name__ == "__main__":
    main()
