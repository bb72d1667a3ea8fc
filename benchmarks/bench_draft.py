"""Benchmark: speculative decoding by prompt lookup over a layer split, side by side.

Gemma 3 270M over 2 and 4 local nodes (one thread each), greedy, 64 tokens,
on a repetitive prompt (editing text that is already in the prompt, where
lookup finds long matches) and on a free-form one (where it rarely does).
For each node count the same nodes serve both heads' turns: each round runs
"no draft" and "prompt-lookup:N" back to back in alternating order, in one
process per run (ggml's registry is per process). Prints ms per generated
token and the per-round speed ratios; checks that both produced the same text.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_draft.py --rounds 3

A benchmark, not a test: nothing here asserts on timings.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

PROMPTS = {
    "repetitive": ("Fix the typo and repeat the paragraph unchanged otherwise.\n"
                   "Paragraph: The tbrpc head sends each node its graph once; afterwards it only asks the node to "
                   "run it again, so a generated token costs one round trip whatever the number of nodes.\n"
                   "Fixed paragraph: The tbrpc head sends each node its graph once; afterwards it only asks"),
    "free-form": "Write a short story about a lighthouse keeper who finds a strange machine on the beach.",
}

RUN = """
import json, sys, time
import models
import tbrpc
from tbrpc.llama import Llama
from tbrpc.draft import make_draft
endpoints, draft, prompt, n = json.loads(sys.argv[1])
llm = Llama(str(models.ensure("gemma")), cluster=endpoints, n_ctx=1024, verbose=False,
            draft_model=make_draft(draft, None), n_threads=1)
llm.create_completion(prompt, max_tokens=4, temperature=0)   # warm-up: graphs on the nodes
t = time.perf_counter()
out = llm.create_completion(prompt, max_tokens=n, temperature=0)
dt = time.perf_counter() - t
print(json.dumps({"text": out["choices"][0]["text"], "tokens": out["usage"]["completion_tokens"], "seconds": dt}))
"""


def run(endpoints: list[str], draft: str | None, prompt: str, n: int) -> dict[str, object]:
    proc = subprocess.run([sys.executable, "-c", RUN, json.dumps([endpoints, draft, prompt, n])],
                          capture_output=True, text=True, check=True, cwd=Path(__file__).resolve().parent.parent)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--lookup", default="prompt-lookup:10")
    parser.add_argument("--nodes", default="2,4")
    args = parser.parse_args()

    from tbrpc.node_processes import running
    from tbrpc.spec import local_specs

    print(f"| nodes | prompt | no draft ms/token | {args.lookup} ms/token | speed-up (per round) |")
    print("|---:|---|---:|---:|---|")
    for n_nodes in (int(x) for x in args.nodes.split(",")):
        with tempfile.TemporaryDirectory() as logs, running(local_specs(n_nodes, threads=1), Path(logs)) as nodes:
            for kind, prompt in PROMPTS.items():
                plain_ms, draft_ms, ratios = [], [], []
                for r in range(args.rounds):
                    order = [None, args.lookup] if r % 2 == 0 else [args.lookup, None]
                    results = {d: run(nodes.endpoints, d, prompt, args.tokens) for d in order}
                    a, b = results[None], results[args.lookup]
                    if a["text"] != b["text"]:
                        raise SystemExit(f"texts differ ({kind}, {n_nodes} nodes):\n{a['text']!r}\n{b['text']!r}")
                    plain_ms.append(1000 * a["seconds"] / a["tokens"])
                    draft_ms.append(1000 * b["seconds"] / b["tokens"])
                    ratios.append(plain_ms[-1] / draft_ms[-1])
                print(f"| {n_nodes} | {kind} | {statistics.median(plain_ms):.1f} | {statistics.median(draft_ms):.1f} "
                      f"| **{statistics.median(ratios):.2f}x** ({', '.join(f'{x:.2f}' for x in ratios)}) |", flush=True)


if __name__ == "__main__":
    main()
