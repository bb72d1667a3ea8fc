"""Benchmark: layer split and tensor split side by side, with tbrpc's all-reduce.

One model, one thread per process, in one run and in alternating order per
round:

  single            the model in one process (n_threads=1, flash attention)
  single-norepack   the same without the CPU backend's weight repacking: the
                    kernels the nodes run (they hold weights in plain buffers)
  norepack-x2       two single-norepack processes decoding at once, their
                    tokens/s added: what this machine gives two one-thread
                    decoders of the model side by side, the ceiling of any
                    split over 2 nodes here (two vCPUs may share a core, its
                    caches and the memory bus)
  norepack-x2-lockstep
                    the same two, each waiting for the other after every token
                    (a pipe each way), so their phases line up as a tensor
                    split's nodes' do: both stream the output head at the same
                    moment, both compute the layers at the same moment. What
                    two one-thread decoders in step get from this machine: the
                    tighter ceiling of a split whose nodes work in step
  layer             head + 2 local nodes, llama.cpp's layer split
  tensor            head + 2 local nodes, split_mode=3 with tbrpc's ALLREDUCE
  tensor-butterfly  the same with TBRPC_NO_ALLREDUCE=1: llama.cpp's own butterfly
                    of node-to-node copies and one-node ADD graphs
  tensor-ring       tensor with TBRPC_ALLREDUCE=ring: the ring all-reduce (links to
                    the next node only) instead of the mesh local nodes get
  ffn               head + 2 local nodes, tbrpc's own split (split_rules.c: the
                    FFN cut, the rest whole on each node) as the only device of
                    a layer split
  ffn-ring          ffn with TBRPC_ALLREDUCE=ring

For each: prompt and decode tokens/s (greedy, fixed prompt), and for the
tensor modes all-reduces per decoded token, bytes per all-reduce (n_embd
floats per token) and the time the nodes spent in ALLREDUCE per token
(from their STATUS counters, averaged over the nodes), and the CPU time
per decoded token of the head and of the nodes (each node's process group,
summed over the nodes). Checks that every mode decoded the same tokens.

--model llama-f32 (the default) runs every mode; --model gemma (Gemma 3
270M, Q4_K_M) runs single, layer and ffn: llama.cpp's tensor split aborts
on a model with one KV head (the planner refuses it; docs/architecture.md,
Tensor split); --model deepseek2 (the tiny DeepSeek V3 / Kimi K2 MoE,
quantized) and deepseek2-f32 run single, layer and ffn: llama.cpp refuses
its tensor split for deepseek2. In the quantized one the ffn split cuts
only the dense FFN of the first layer (1 all-reduce per token): its 64-wide
experts are narrower than one 256-wide Q4_K cut and its 384-token
vocabulary is not a multiple of it, so they stay whole on every node;
deepseek2-f32 has every expert and the output cut (6 all-reduces per
token), as Kimi K2's 2048-wide Q4_K experts are. On tiny models every mode measures per-graph overhead, not
compute; a two-core machine runs head and nodes on the same cores.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_tensor.py --rounds 3 [--model gemma]
    PYTHONPATH=. .venv/bin/python benchmarks/bench_tensor.py --model deepseek2-f32 --nodes 4 --modes single,ffn,ffn-ring

--modes runs only those (in that order, alternated per round); the ratio
columns need single and single-norepack among them.

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

from tbrpc.node_processes import listening_port

REPO = Path(__file__).resolve().parent.parent
MODES = ("single", "single-norepack", "norepack-x2", "norepack-x2-lockstep", "layer", "tensor", "tensor-butterfly", "tensor-ring", "ffn",
         "ffn-ring")
MODES_OF = {"llama-f32": MODES,
            "gemma": ("single", "single-norepack", "norepack-x2", "norepack-x2-lockstep", "layer", "ffn", "ffn-ring"),
            "deepseek2": ("single", "single-norepack", "norepack-x2", "norepack-x2-lockstep", "layer", "ffn", "ffn-ring"),
            "deepseek2-f32": ("single", "single-norepack", "norepack-x2", "norepack-x2-lockstep", "layer", "ffn", "ffn-ring")}
ENV_OF = {"tensor-butterfly": {"TBRPC_NO_ALLREDUCE": "1"}, "tensor-ring": {"TBRPC_ALLREDUCE": "ring"},
          "ffn-ring": {"TBRPC_ALLREDUCE": "ring"}}
PROMPT = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is"

RUN = """
import contextlib, json, os, sys, time
spec = json.loads(sys.argv[1])
os.environ.update(spec["env"])
import llama_cpp
import numpy as np
import tbrpc
from tbrpc.llama import model_params_patch
kwargs = dict(n_ctx=512, n_threads=1, n_batch=512, verbose=False, seed=0, flash_attn=True)
devices = None
if spec["nodes"]:
    tbrpc.connect(spec["nodes"])
    kwargs.update(n_gpu_layers=-1, tensor_split=[1.0] * len(spec["nodes"]), split_mode=spec["split_mode"])
    if spec["ffn_granularity"]:
        import ctypes
        meta = tbrpc.cluster().ffn_split_device(spec["nodes"], [1.0] * len(spec["nodes"]), spec["ffn_granularity"])
        devices = (ctypes.c_void_p * 2)(meta, None)
        kwargs.update(split_mode=1, tensor_split=None)
else:
    kwargs.update(n_gpu_layers=0)
from tbrpc.head_buffers import plain_cpu_buffers
with plain_cpu_buffers() if spec["norepack"] else contextlib.nullcontext(), model_params_patch(devices):
    llm = llama_cpp.Llama(spec["model"], **kwargs)
prompt = llm.tokenize(spec["prompt"].encode())
def status():
    return [tbrpc.cluster().status(i) for i in range(len(spec["nodes"]))]
sys.path.insert(0, "benchmarks")
from bench_node_cost import cpu_s, group_pids
def group_cpu_s(pgid):
    return sum(cpu_s(pid) for pid in group_pids(pgid))   # a node and its session workers
t = time.perf_counter(); llm.eval(prompt); prompt_s = time.perf_counter() - t
if spec.get("barrier"):   # norepack-x2: decode when every process is ready to
    open(spec["barrier"] + f".{os.getpid()}", "w").close()
    while not os.path.exists(spec["barrier"]):
        time.sleep(0.001)
def next_token():   # llm.scores holds logits only with logits_all: read llama.cpp's last row
    return int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))))
token = next_token()
before = status()
cpu_before = [time.process_time()] + [group_cpu_s(g) for g in spec["node_pgids"]]
tokens = []
t = time.perf_counter()
lock = spec.get("lockstep")   # norepack-x2-lockstep: [fd to write, fd to read] of the pipes to the other
for _ in range(spec["n"]):
    tokens.append(token)
    llm.eval([token])
    token = next_token()
    if lock:
        os.write(lock[0], b"t")
        os.read(lock[1], 1)
decode_s = time.perf_counter() - t
cpu_after = [time.process_time()] + [group_cpu_s(g) for g in spec["node_pgids"]]
after = status()
print(json.dumps({
    "prompt_tps": len(prompt) / prompt_s, "decode_tps": spec["n"] / decode_s, "tokens": tokens,
    "allreduces": [a.allreduces - b.allreduces for a, b in zip(after, before)],
    "allreduce_s": [a.allreduce_s - b.allreduce_s for a, b in zip(after, before)],
    "cpu_s": [a - b for a, b in zip(cpu_after, cpu_before)], "n_embd": llm.n_embd()}))
"""


def start_node(log_dir: Path) -> tuple[subprocess.Popen[bytes], str]:
    log = log_dir / f"node-{time.monotonic_ns()}.log"
    proc = subprocess.Popen([sys.executable, "-m", "tbrpc.cli", "node", "--port", "0", "--threads", "1"],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=open(log, "wb"), start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        port = listening_port(log.read_text(errors="replace"))
        if port is not None:
            return proc, f"127.0.0.1:{port}"
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"node did not start: {log.read_text()}")


def run(mode: str, model: str, nodes: list[tuple[subprocess.Popen[bytes], str]], n: int,
        granularity: int) -> dict[str, Any]:
    if mode.startswith("norepack-x2"):
        return run_side_by_side(model, n, lockstep=mode.endswith("lockstep"))
    remote = not mode.startswith("single")
    spec = {"model": model, "norepack": mode == "single-norepack", "prompt": PROMPT, "n": n, "nodes": [e for _, e in nodes] if remote else [],
            "node_pgids": [p.pid for p, _ in nodes] if remote else [],
            "split_mode": 3 if mode.startswith("tensor") else 1,
            "ffn_granularity": granularity if mode.startswith("ffn") else 0, "env": ENV_OF.get(mode, {})}
    proc = subprocess.run([sys.executable, "-c", RUN, json.dumps(spec)], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    if proc.returncode != 0:
        raise RuntimeError(f"{mode}: {proc.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def run_side_by_side(model: str, n: int, lockstep: bool = False) -> dict[str, Any]:
    """Two single-norepack processes that decode at the same moment (a barrier after their prompts):
    their tokens/s added, their CPU time added. `lockstep`: each waits for the other after every
    token (a pipe each way)."""
    barrier = Path(tempfile.mkdtemp(prefix="bench-x2-")) / "go"
    spec = {"model": model, "norepack": True, "prompt": PROMPT, "n": n, "nodes": [], "node_pgids": [],
            "split_mode": 1, "ffn_granularity": 0, "env": {}, "barrier": str(barrier)}
    pipes = [os.pipe(), os.pipe()] if lockstep else []   # pipes[i]: to process i
    procs = []
    for i in range(2):
        locks = [pipes[1 - i][1], pipes[i][0]] if lockstep else []
        procs.append(subprocess.Popen([sys.executable, "-c", RUN, json.dumps({**spec, "lockstep": locks})],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                                      env={**os.environ, "PYTHONPATH": str(REPO)}, pass_fds=locks))
    for fd in (fd for pair in pipes for fd in pair):
        os.close(fd)
    while len(list(barrier.parent.glob("go.*"))) < len(procs) and all(p.poll() is None for p in procs):
        time.sleep(0.001)
    barrier.touch()
    outs = [p.communicate() for p in procs]
    if any(p.returncode != 0 for p in procs):
        raise RuntimeError(f"norepack-x2{'-lockstep' if lockstep else ''}: {[err[-2000:] for _, err in outs]}")
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    return {"prompt_tps": sum(r["prompt_tps"] for r in results), "decode_tps": sum(r["decode_tps"] for r in results),
            "tokens": results[0]["tokens"], "allreduces": [], "allreduce_s": [],
            "cpu_s": [sum(r["cpu_s"][0] for r in results)], "n_embd": results[0]["n_embd"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--model", choices=sorted(MODES_OF), default="llama-f32")
    parser.add_argument("--modes", help="comma-separated modes to run (default: every mode the model has)")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    import models
    from tbrpc.gguf_model import load_gguf
    from tbrpc.plan import ffn_granularity

    model = str(models.ensure(args.model))
    modes = MODES_OF[args.model]
    if args.modes:
        wanted = tuple(args.modes.split(","))
        if not set(wanted) <= set(modes):
            parser.error(f"--modes: {args.model} has {', '.join(modes)}")
        modes = wanted
    granularity = ffn_granularity(load_gguf(model))
    log_dir = Path(tempfile.mkdtemp(prefix="bench-tensor-"))
    nodes = [start_node(log_dir) for _ in range(args.nodes)]
    results: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    try:
        for r in range(args.rounds):
            order = modes if r % 2 == 0 else tuple(reversed(modes))
            for mode in order:
                results[mode].append(run(mode, model, nodes, args.tokens, granularity))
    finally:
        for proc, _ in nodes:
            proc.terminate()
    single = statistics.median(x["decode_tps"] for x in results["single"]) if "single" in results else float("nan")
    norepack = (statistics.median(x["decode_tps"] for x in results["single-norepack"]) if "single-norepack" in results
                else float("nan"))
    print(f"{Path(model).name}, {args.nodes} local nodes, 1 thread each, {args.tokens} decoded tokens, "
          f"{args.rounds} rounds (medians); {os.cpu_count()} cores, load average "
          + ", ".join(f"{x:.2f}" for x in os.getloadavg()))
    print(f"{'mode':18} {'prompt t/s':>10} {'decode t/s':>10} {'vs single':>9} {'vs norepack':>11} {'AR/token':>8} {'B/AR':>6} "
          f"{'AR ms/token':>11} {'CPU ms/token: head':>18} {'nodes':>6}")
    for mode in modes:
        rows = results[mode]
        decode = statistics.median(x["decode_tps"] for x in rows)
        prompt = statistics.median(x["prompt_tps"] for x in rows)
        per_token = statistics.median(statistics.mean(x["allreduces"]) / args.tokens for x in rows) if rows[0]["allreduces"] else 0
        ar_ms = statistics.median(statistics.mean(x["allreduce_s"]) / args.tokens * 1e3 for x in rows) if rows[0]["allreduces"] else 0
        bytes_per = rows[0]["n_embd"] * 4 if per_token else 0
        head_ms = statistics.median(x["cpu_s"][0] / args.tokens * 1e3 for x in rows)
        nodes_ms = statistics.median(sum(x["cpu_s"][1:]) / args.tokens * 1e3 for x in rows)
        print(f"{mode:18} {prompt:10.1f} {decode:10.1f} {decode / single:9.2f} {decode / norepack:11.2f} {per_token:8.1f} {bytes_per:6d} {ar_ms:11.3f}"
              f" {head_ms:18.2f} {nodes_ms:6.2f}")
    texts = {mode: {tuple(x["tokens"]) for x in rows} for mode, rows in results.items()}
    same = len({t for ts in texts.values() for t in ts}) == 1
    print("same tokens in every mode and round" if same else f"TOKENS DIFFER: {texts}")


if __name__ == "__main__":
    main()
