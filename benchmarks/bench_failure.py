"""How fast a head names a failed node: from a node's death (kill -9 of the
node and its workers) or stall (SIGSTOP, against the head's timeout) to the
NodeError raised in the head, mid-generation, over TCP and shared memory.

Each round starts two local nodes and a fresh head process (the tiny llama,
layer split), which generates greedily, kills or stops the second node after
its third token, and measures from the signal to the exception. Prints the
median and the worst per transport and failure.

    .venv/bin/python benchmarks/bench_failure.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_tensor import REPO, start_node  # noqa: E402  (after the path it needs)

HEAD = """
import json, os, signal, sys, time
spec = json.loads(sys.argv[1])
import llama_cpp, numpy as np, tbrpc
tbrpc.connect(spec["nodes"], transport=spec["transport"], timeout=spec["timeout"])
llm = llama_cpp.Llama(spec["model"], n_gpu_layers=-1, tensor_split=[1, 1], n_ctx=256, n_threads=1, verbose=False)
llm.eval(llm.tokenize(b"Once upon a time"))
def next_token():   # llm.scores holds logits only with logits_all: read llama.cpp's last row
    return int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))))
token = next_token()
for step in range(64):
    if step == 3:
        os.killpg(spec["victim"], spec["signal"])
        started = time.perf_counter()
    try:
        llm.eval([token])
    except tbrpc.NodeError as exc:
        print(json.dumps({"seconds": time.perf_counter() - started, "error": type(exc).__name__}))
        break
    token = next_token()
else:
    print(json.dumps({"seconds": None, "error": None}))
"""


def one_round(model: str, transport: str, sig: int, timeout: float, log_dir: Path) -> float:
    nodes = [start_node(log_dir) for _ in range(2)]
    try:
        spec = {"model": model, "nodes": [e for _, e in nodes], "transport": transport, "timeout": timeout,
                "victim": nodes[1][0].pid, "signal": sig}
        proc = subprocess.run([sys.executable, "-c", HEAD, json.dumps(spec)], capture_output=True, text=True,
                              cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
        result = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.stdout.strip() else {}
        if not result.get("seconds"):
            raise RuntimeError(f"{transport}: no NodeError: {proc.stderr[-2000:]}")
        return float(result["seconds"])
    finally:
        for p, _ in nodes:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=2.0, help="the head's stall timeout, seconds")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    import models

    model = str(models.ensure("llama"))
    print(f"load average {os.getloadavg()[0]:.2f}; {args.rounds} rounds; stall timeout {args.timeout:g} s")
    print(f"{'transport':<10} {'failure':<9} {'median ms':>10} {'worst ms':>9}")
    with tempfile.TemporaryDirectory() as tmp:
        for transport in ("tcp", "auto"):
            for name, sig in (("kill -9", signal.SIGKILL), ("SIGSTOP", signal.SIGSTOP)):
                times = [one_round(model, transport, sig, args.timeout, Path(tmp)) * 1000 for _ in range(args.rounds)]
                print(f"{'shm' if transport == 'auto' else transport:<10} {name:<9} {statistics.median(times):>10.1f} "
                      f"{max(times):>9.1f}")
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
