"""A head process for tests: load a model (alone or split over nodes), run
greedy generation, and write what happened to a JSON file (+ logits .npy).

Tests run it as a subprocess because ggml's device registry is process-wide:
each scenario needs a fresh head. Usage: python tests/head.py SPEC.json OUT.json
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.reference import reference_llama  # noqa: E402  (after the path it needs)


def generate(llm: Any, prompt: str, n_predict: int, kill: dict[str, Any] | None,
             reset_stats: Any = None, forced: list[int] | None = None) -> tuple[list[int], np.ndarray]:
    """Greedy tokens and each step's logits; with `forced`, the next input is
    forced[step] whatever the argmax (teacher forcing: logits comparable step by step)."""
    tokens = llm.tokenize(prompt.encode(), add_bos=True)
    out: list[int] = []
    rows: list[np.ndarray] = []
    if kill and kill["after_tokens"] < 0:
        os.killpg(kill["pid"], kill.get("signal", 9))
        time.sleep(0.5)
    llm.eval(tokens)
    n_vocab = llm.n_vocab()
    for step in range(n_predict):
        # the last row of logits llama.cpp produced (llm.scores is only kept with logits_all)
        logits = np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(n_vocab,)).copy()
        rows.append(logits)
        token = int(np.argmax(logits))
        out.append(token)
        if step == 1 and reset_stats is not None:   # steady state: count only the later tokens
            reset_stats()
        if kill and step == kill["after_tokens"]:
            os.killpg(kill["pid"], kill.get("signal", 9))  # the node and its worker processes
        llm.eval([forced[step] if forced else token])
    return out, np.stack(rows)


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    os.environ.update(spec.get("env", {}))   # before tbrpc reads any of it
    import llama_cpp

    import tbrpc
    from tbrpc.llama import model_params_patch

    result: dict[str, Any] = {"error": None}
    nodes = spec.get("nodes", [])
    kwargs: dict[str, Any] = dict(n_ctx=spec.get("n_ctx", 256), n_threads=1, n_batch=spec.get("n_batch", 512),
                                  verbose=spec.get("verbose", False), seed=0, flash_attn=spec.get("flash_attn", False))
    devices = None
    if nodes:
        tbrpc.connect(nodes, timeout=spec.get("timeout", 10.0), transport=spec.get("transport"),
                      secret_file=spec.get("secret_file"))
        if spec.get("unchecked_load"):   # llama.cpp's own load, without tbrpc's refusal of a split it aborts on
            llama_cpp.llama_cpp.llama_model_load_from_file = llama_cpp.llama_cpp.llama_model_load_from_file.__wrapped__
        for source, target, host in spec.get("peer_addresses", []):   # a cluster file's `links`
            tbrpc.cluster().set_peer_address(source, target, host)
        kwargs.update(n_gpu_layers=spec.get("n_gpu_layers", -1),
                      tensor_split=spec.get("tensor_split") or [1.0] * len(nodes),
                      split_mode=spec.get("split_mode", 1))
        if spec.get("ffn_split"):   # tbrpc's own split rules: one meta device over all the nodes, or one per group
            groups = [[nodes[i] for i in group] for group in spec.get("ffn_groups", [range(len(nodes))])]
            metas = [tbrpc.cluster().ffn_split_device(group, [1.0] * len(group), spec["ffn_split"]) for group in groups]
            devices = (ctypes.c_void_p * (len(metas) + 1))(*metas, None)
            kwargs.update(split_mode=1, tensor_split=(spec.get("tensor_split") or [1.0] * len(metas)) if len(metas) > 1 else None)
    else:
        kwargs.update(n_gpu_layers=0)
    try:
        t0 = time.time()
        if devices is not None:
            with model_params_patch(devices):
                llm = llama_cpp.Llama(spec["model"], **kwargs)
        else:
            llm = llama_cpp.Llama(spec["model"], **kwargs) if nodes else reference_llama(spec["model"], **kwargs)
        result["load_s"] = time.time() - t0
        if nodes:
            result["allocated_after_load"] = [tbrpc.cluster().status(i).bytes_allocated for i in range(len(nodes))]
            result["nodes_after_load"] = [asdict(n) for n in tbrpc.cluster().nodes()]   # counters before the reset
        tokens, logits = generate(llm, spec["prompt"], spec["n_predict"], spec.get("kill"),
                                  tbrpc.cluster().reset_stats if nodes else None, spec.get("forced_tokens"))
        result["tokens"] = tokens
        np.save(spec["logits_path"], logits)
        if nodes:
            result["nodes"] = [asdict(n) for n in tbrpc.cluster().nodes()]
            result["status"] = [vars(tbrpc.cluster().status(i)) for i in range(len(nodes))]   # the nodes' own counters
        if spec.get("then_run"):   # another program, while this head still holds its connections and links
            run = spec["then_run"]
            proc = subprocess.run(run["argv"], capture_output=True, text=True, timeout=300,
                                  env={**os.environ, **run.get("env", {})})
            result["then_run"] = {"returncode": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr[-3000:]}
    except Exception as e:  # the test asserts on type and message
        result["error"] = {"type": type(e).__name__, "message": str(e), "endpoint": getattr(e, "endpoint", None),
                           "peer": getattr(e, "peer", None)}
        if spec.get("decode_again") and "llm" in locals():   # the model used again after its node failed
            try:
                llm.eval([llm.token_bos()])
                result["again"] = None
            except Exception as again:
                result["again"] = {"type": type(again).__name__, "message": str(again),
                                   "endpoint": getattr(again, "endpoint", None)}
        if nodes:  # are the nodes that did not fail still usable?
            result["failed_indexes"] = sorted(tbrpc.cluster().failed_indexes())
            result["survivor_status"] = {}
            for i, node in enumerate(tbrpc.cluster().nodes()):
                if node.failed:
                    continue
                try:
                    result["survivor_status"][node.endpoint] = vars(tbrpc.cluster().status(i))
                except tbrpc.NodeError as status_error:   # e.g. the stalled node, not yet known to be failed
                    result.setdefault("status_errors", {})[node.endpoint] = str(status_error)
    Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
