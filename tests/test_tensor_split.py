"""llama.cpp's tensor split (split_mode=3) over tbrpc nodes: every layer cut
across the nodes, partial sums all-reduced node to node.

llama.cpp wraps the TBRPC devices in its "meta" device, which slices the
weights and runs each layer as subgraphs on every node, with an all-reduce
after each partial result (a butterfly of node-to-node copies, tbrpc's
PEER_SEND/PEER_RECV, and one-node ADD graphs). Reference: one process with
the same flash attention (tensor mode requires it). Partial sums are added
in another order than one process adds them, so logits agree to a
tolerance, not bitwise; greedy tokens agree exactly.

The model is the tiny llama with F32 weights: llama.cpp's meta backend
aborts on a quantized row that is exactly one block wide (the tiny model's
Q4_K ffn_down; real models are wider) and on a model with one KV head
(Gemma 3 270M; the planner refuses that, tests/test_plan_tensor.py), in
code that tbrpc does not control; test_llamas_own_tensor_split_still_aborts
pins both aborts (past tbrpc's load wrapper, which refuses both with the
reason: test_a_plain_tensor_split_llama_cpp_aborts_on_is_refused). Gemma 3 and the tiny deepseek2 run with tbrpc's own
split rules instead (FFN and output cut, the rest whole on every node).
Nodes here share one host, so every all-reduce link is shared memory; the
same all-reduce over RDMA links: tests/test_rdma.py.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

import models
from helpers import assert_every_pair_linked, assert_ring_linked, head_process, record_of, run_head
from tbrpc.native import load as load_native
from tbrpc.client import allreduce_choice
from tbrpc.status import connection_lines
from tbrpc.node_memory import make_node
from tbrpc.plan import plan

PROMPT = "The capital of France is"
N_PREDICT = 12
LOGIT_TOLERANCE = 1e-2   # measured: at most 8e-4 on this model
N_LAYER = 6              # models/tiny_llama.py
DEEPSEEK2_LAYERS = 6     # models/tiny_deepseek2.py: 1 dense + 5 MoE layers, one FFN all-reduce each
STEADY_TOKENS = N_PREDICT - 1   # head.py counts from the second decode on
SHM = "shm 16x256K"      # what carries a link between two nodes of one host (transport/shm.c)


@pytest.mark.parametrize("n_nodes", [2, 4])
def test_tensor_split_matches_single_process(n_nodes: int, nodes: Any, tmp_path: Path) -> None:
    model = str(models.ensure("llama-f32"))
    base, base_logits = run_head(tmp_path, model=model, prompt=PROMPT, n_predict=N_PREDICT, flash_attn=True)
    assert base["error"] is None, base["error"]
    started = nodes(n_nodes)
    result, logits = run_head(tmp_path, model=model, prompt=PROMPT, n_predict=N_PREDICT, flash_attn=True,
                              split_mode=3, nodes=[n.endpoint for n in started])
    assert result["error"] is None, result["error"]
    assert result["tokens"] == base["tokens"]
    assert logits is not None and logits.shape == base_logits.shape
    diff = float(np.max(np.abs(logits - base_logits)))
    assert diff <= LOGIT_TOLERANCE, diff
    assert_every_pair_linked(result, SHM)   # the all-reduce's links, node to node over shared memory
    names = [f"n{k}" for k in range(n_nodes)]
    assert connection_lines(record_of(result["nodes"], names))[-1] == "all-reduce: mesh over " + ", ".join(names)

    # Every node holds a slice of the weights, and the partial sums went node to
    # node inside ALLREDUCE: two per layer (attention output, FFN down) per
    # decoded token, each one posted request per node, and no butterfly copies.
    assert all(a > 0 for a in result["allocated_after_load"]), result["allocated_after_load"]
    # Each node's slice of a row-split weight (attn_output, ffn_down: n_embd rows of 128 per layer) goes
    # in one strided write (SET_TENSOR_2D), not one message per row.
    for node in result["nodes_after_load"]:
        assert node["messages"] < 2 * N_LAYER * 128, node
    for node in result["nodes"]:
        assert node["allreduces"] == 2 * N_LAYER * STEADY_TOKENS, node
        assert node["peer_copies"] == 0, node
        # each token's subgraphs are kept on the node and run again by slot, not sent again
        assert node["graphs_sent"] == 0 and node["graphs_reused"] >= 2 * N_LAYER * STEADY_TOKENS, node
        assert not node["failed"], node["error"]


def test_without_the_allreduce_provider_the_butterfly_still_works(nodes: Any, tmp_path: Path) -> None:
    """TBRPC_NO_ALLREDUCE=1: llama.cpp's own butterfly of node-to-node copies
    and one-node ADD graphs; the same tokens."""
    model = str(models.ensure("llama-f32"))
    started = nodes(2)
    spec = dict(model=model, prompt=PROMPT, n_predict=N_PREDICT, flash_attn=True, split_mode=3,
                nodes=[n.endpoint for n in started])
    with_provider, _ = run_head(tmp_path, **spec)
    without, _ = run_head(tmp_path, **spec, env={"TBRPC_NO_ALLREDUCE": "1"})
    assert with_provider["error"] is None and without["error"] is None, (with_provider["error"], without["error"])
    assert without["tokens"] == with_provider["tokens"]
    for node in without["nodes"]:
        assert node["allreduces"] == 0 and node["peer_copies"] >= 2 * N_LAYER * STEADY_TOKENS, node


@pytest.mark.parametrize("n_nodes,own_copy", [(2, True), (3, False), (4, False)])
def test_deepseek2_with_its_ffn_split_across_nodes(n_nodes: int, own_copy: bool, nodes: Any, tmp_path: Path) -> None:
    """llama.cpp refuses its tensor split for deepseek2 (Kimi K2, DeepSeek V3).
    tbrpc's own rules (split_rules.c) cut the dense FFN and every routed and
    shared expert along its inner width and keep attention whole: the same
    greedy tokens as one process, one ALLREDUCE per layer per token."""
    model = str(models.ensure("deepseek2-f32"))
    base, base_logits = run_head(tmp_path, model=model, prompt=PROMPT, n_predict=N_PREDICT, flash_attn=True)
    assert base["error"] is None, base["error"]
    started = nodes(n_nodes, *(["--model-dir", str(Path(model).parent)] if own_copy else []))
    result, logits = run_head(tmp_path, model=model, prompt=PROMPT, n_predict=N_PREDICT, flash_attn=True,
                              nodes=[n.endpoint for n in started], ffn_split=1)
    assert result["error"] is None, result["error"]
    assert result["tokens"] == base["tokens"]
    assert logits is not None and logits.shape == base_logits.shape
    diff = float(np.max(np.abs(logits - base_logits)))
    assert diff <= LOGIT_TOLERANCE, diff
    assert_every_pair_linked(result, SHM)
    loaded = result["allocated_after_load"]
    assert all(a > 0 for a in loaded), loaded
    if own_copy:   # each node read its slices of the experts from its own file (LOAD_FROM_FILE_2D), not over the wire
        experts = sum(int(t.n_bytes) for t in gguf.GGUFReader(model).tensors if "_exps" in t.name)
        for node in result["nodes_after_load"]:
            assert node["bytes_from_files"] >= experts // n_nodes, (node, experts)
    for node in result["nodes"]:
        assert node["allreduces"] == DEEPSEEK2_LAYERS * STEADY_TOKENS, node
        assert not node["failed"], node["error"]


def _head_bytes_per_token(result: dict[str, Any]) -> list[tuple[float, float]]:
    """(sent, received) per decoded token on each of the head's node connections."""
    return [(n["bytes_sent"] / STEADY_TOKENS, n["bytes_received"] / STEADY_TOKENS) for n in result["nodes"]]


def _reply_bytes(payload: int) -> int:
    """What one reply carrying `payload` bytes costs on the wire: frame header, status, payload."""
    ffi, _ = load_native()
    return ffi.sizeof("struct tb_header") + ffi.sizeof("struct tb_reply_status") + payload


@pytest.mark.parametrize("env", [{}, {"TBRPC_NO_ALLREDUCE": "1"}], ids=["allreduce", "butterfly"])
def test_no_allreduce_byte_crosses_the_heads_connections(env: dict[str, str], nodes: Any, tmp_path: Path) -> None:
    """Counted on the head's own connections (the transport's byte counters):
    per decoded token the head receives from each node exactly one reply, its
    slice of the logits, and nothing else -- so not one byte of the 2 x 6
    partial sums of n_embd floats. A partial sum is made on a node, so it
    could only reach the head's sending side after crossing its receiving
    side. With tbrpc's ALLREDUCE and with llama.cpp's butterfly of PEER_SEND
    copies alike, the partial sums go over the nodes' own links."""
    model = str(models.ensure("llama-f32"))
    started = nodes(2)
    result, _ = run_head(tmp_path, model=model, prompt=PROMPT, n_predict=N_PREDICT, flash_attn=True, split_mode=3,
                         nodes=[n.endpoint for n in started], env=env)
    assert result["error"] is None, result["error"]
    meta = gguf.GGUFReader(model)
    n_vocab = int(meta.fields["llama.vocab_size"].parts[-1][0])
    n_embd = int(meta.fields["llama.embedding_length"].parts[-1][0])
    logits_slice = n_vocab // 2 * 4   # output.weight is cut by vocabulary rows: half each, gathered by the head
    partials = 2 * N_LAYER * n_embd * 4   # what the all-reduces of one token move, per node
    for (sent, received), node in zip(_head_bytes_per_token(result), result["nodes"]):
        assert received == _reply_bytes(logits_slice), (received, node)
        assert received < partials
        assert node["allreduces"] + node["peer_copies"] >= 2 * N_LAYER * STEADY_TOKENS, node   # the reductions did run


def test_the_byte_count_sees_an_allreduce_through_the_head(nodes: Any, tmp_path: Path) -> None:
    """The negative of the test above: with no peer links (TBRPC_NO_PEER_LINKS),
    tbrpc offers neither ALLREDUCE nor node-to-node copies, so llama.cpp's
    butterfly copies every partial through the head (a GET_TENSOR from one
    node, a SET_TENSOR to the other). The same counters then show each
    partial arriving: the assertion above fails in this mode."""
    model = str(models.ensure("llama-f32"))
    started = nodes(2)
    result, _ = run_head(tmp_path, model=model, prompt=PROMPT, n_predict=N_PREDICT, flash_attn=True, split_mode=3,
                         nodes=[n.endpoint for n in started], env={"TBRPC_NO_PEER_LINKS": "1"})
    assert result["error"] is None, result["error"]
    n_embd = int(gguf.GGUFReader(model).fields["llama.embedding_length"].parts[-1][0])
    partials = 2 * N_LAYER * n_embd * 4
    for (sent, received), node in zip(_head_bytes_per_token(result), result["nodes"]):
        assert node["allreduces"] == 0 and node["peer_copies"] == 0 and node["links"] == "", node
        assert received >= partials and sent >= partials, (sent, received, node)



TWO_META_DEVICES = """
import ctypes, json, sys
import llama_cpp.llama_cpp as L
import tbrpc
nodes = sys.argv[1:]
tbrpc.connect(nodes)
lib = L._lib
for name, restype in (("ggml_backend_dev_buffer_type", ctypes.c_void_p), ("ggml_backend_buft_name", ctypes.c_char_p),
                      ("ggml_backend_dev_name", ctypes.c_char_p)):
    getattr(lib, name).restype = restype
    getattr(lib, name).argtypes = [ctypes.c_void_p]
devices = [tbrpc.cluster().ffn_split_device(group, [1, 1], 1) for group in (nodes, nodes[::-1])]
bufts = [lib.ggml_backend_dev_buffer_type(d) for d in devices]
print(json.dumps({"devices": devices, "bufts": bufts, "names": [lib.ggml_backend_buft_name(b).decode() for b in bufts],
                  "device_names": [lib.ggml_backend_dev_name(d).decode() for d in devices]}))
"""


def test_meta_devices_are_named_apart(nodes: Any) -> None:
    """llama.cpp files weights and KV cache by buffer type *name* (llama-model-loader.h,
    llama-kv-cache.cpp), and the ggml of llama-cpp-python 0.3.36 names every meta device and its
    buffer type "Meta()": two meta devices in one model would share one buffer and ggml aborts at
    load. tbrpc names each of its meta devices apart (split_rules.c, name_meta_device)."""
    started = nodes(2)
    proc = subprocess.run([sys.executable, "-c", TWO_META_DEVICES, *[n.endpoint for n in started]],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(set(seen["devices"])) == 2 and len(set(seen["bufts"])) == 2, seen
    assert len(set(seen["names"])) == 2 and len(set(seen["device_names"])) == 2, seen
    assert all(name.startswith("Meta") for name in seen["names"] + seen["device_names"]), seen


def test_a_layer_split_over_groups_that_each_cut_their_ffn(nodes: Any, tmp_path: Path) -> None:
    """The layer+tensor hybrid: four nodes in two groups, each group a meta device that cuts its
    layers' FFN and experts (tbrpc's rules), the two groups layer-split. Same greedy tokens as one
    process; every node all-reduces only its group's layers, and a node of each group together
    reduce every layer once per token."""
    model = str(models.ensure("deepseek2-f32"))
    base, base_logits = run_head(tmp_path, model=model, prompt=PROMPT, n_predict=N_PREDICT, flash_attn=True)
    assert base["error"] is None, base["error"]
    started = nodes(4)
    result, logits = run_head(tmp_path, model=model, prompt=PROMPT, n_predict=N_PREDICT, flash_attn=True,
                              nodes=[n.endpoint for n in started], ffn_split=1, ffn_groups=[[0, 1], [2, 3]])
    assert result["error"] is None, result["error"]
    assert result["tokens"] == base["tokens"]
    assert logits is not None and logits.shape == base_logits.shape
    diff = float(np.max(np.abs(logits - base_logits)))
    assert diff <= LOGIT_TOLERANCE, diff
    assert all(a > 0 for a in result["allocated_after_load"]), result["allocated_after_load"]
    reduced = [node["allreduces"] for node in result["nodes"]]
    assert reduced[0] == reduced[1] > 0 and reduced[2] == reduced[3] > 0, reduced
    assert reduced[0] + reduced[2] == DEEPSEEK2_LAYERS * STEADY_TOKENS, reduced
    assert not any(node["failed"] for node in result["nodes"]), result["nodes"]


# Where the llama.cpp that llama-cpp-python 0.3.36 ships aborts the process in its tensor mode, on models
# tbrpc therefore does not run in that mode.
UPSTREAM_ABORTS = {
    # Gemma 3 270M, one KV head, at the first generated token: the reshape of the one-head K row keeps the
    # split inside the head (ggml-backend-meta.cpp:622), and the k-norm's per-row rule asserts
    "gemma": "ggml-backend-meta.cpp:543: GGML_ASSERT(src_ss[0].axis != GGML_BACKEND_SPLIT_AXIS_0) failed",
    # the quantized tiny llama (Q4_K ffn_down rows exactly one block wide), while loading: a slice keeps the
    # full row stride (nb[1] == nb[0] is not rescaled), so the upload writes a row to the node whose slice is empty
    "llama": 'ggml-backend.cpp:382: GGML_ASSERT(offset + (n_copies-1)*stride_tensor + size <= ggml_nbytes(tensor)'
             ' && "tensor write out of bounds") failed',
}


@pytest.mark.parametrize("model_name", sorted(UPSTREAM_ABORTS))
def test_llamas_own_tensor_split_still_aborts(model_name: str, nodes: Any, tmp_path: Path) -> None:
    """Why tensor mode is refused for a model with one KV head (Gemma 3 270M)
    and for the quantized tiny llama: llama.cpp's meta backend aborts the head
    process, at the assertion named above, in code tbrpc does not control
    (the planner refuses both with the reason, check_model_split,
    tests/test_plan_tensor.py). Run here in a head of its own over real
    nodes, which outlive it. When this test fails, upstream has fixed the
    abort: then run these models in tensor mode and lift the refusal."""
    started = nodes(2)
    proc, out_path = head_process(tmp_path, model=str(models.ensure(model_name)), prompt=PROMPT, n_predict=2,
                                  flash_attn=True, split_mode=3, nodes=[n.endpoint for n in started],
                                  unchecked_load=True,   # past tbrpc's refusal (the next test)
                                  verbose=True)   # llama-cpp-python silences stderr while it loads, unless verbose
    stderr = proc.stderr.decode(errors="replace")
    assert proc.returncode == -signal.SIGABRT, f"upstream no longer aborts? ({proc.returncode}) {stderr[-3000:]}"
    assert UPSTREAM_ABORTS[model_name] in stderr, stderr[-3000:]
    assert not out_path.exists()
    assert all(n.proc.poll() is None for n in started), [n.log_text()[-2000:] for n in started]


@pytest.mark.parametrize("model_name", [*sorted(UPSTREAM_ABORTS), "deepseek2-f32"])
def test_a_plain_tensor_split_llama_cpp_aborts_on_is_refused(model_name: str, nodes: Any) -> None:
    """tbrpc.connect, then a plain llama_cpp.Llama(split_mode=3) of a model llama.cpp's tensor mode
    aborts the process on (the models above) or refuses without a word ("Failed to load model
    from file": deepseek2): tbrpc's load wrapper raises TensorSplitError, a ValueError saying why
    and what to use, as tbrpc.Llama(split="tensor") does; the process lives on and loads the
    model in a layer split over the same nodes."""
    started = nodes(2)
    script = (
        "import json, sys, llama_cpp, tbrpc\n"
        "from tbrpc.plan import TensorSplitError\n"
        "tbrpc.connect(sys.argv[2:])\n"
        "kw = dict(n_gpu_layers=-1, n_ctx=256, flash_attn=True, verbose=False)\n"
        "try:\n"
        "    llama_cpp.Llama(sys.argv[1], split_mode=3, **kw)\n"
        "    refused = None\n"
        "except ValueError as e:\n"
        "    refused = [isinstance(e, TensorSplitError), str(e)]\n"
        "llm = llama_cpp.Llama(sys.argv[1], split_mode=1, **kw)\n"
        "text = llm('The capital of France is', max_tokens=2, temperature=0)['choices'][0]['text']\n"
        "print(json.dumps({'refused': refused, 'text': text}))\n")
    proc = subprocess.run([sys.executable, "-c", script, str(models.ensure(model_name)), *[n.endpoint for n in started]],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["refused"] and out["refused"][0] and out["refused"][1].startswith("tensor split: "), out
    assert "use --split" in out["refused"][1], out
    assert out["text"], out


def test_a_plain_row_split_over_tbrpc_devices_says_why(nodes: Any) -> None:
    """split_mode=2 (row) needs split buffers, which only CUDA devices have: llama.cpp refuses it
    for tbrpc devices in its log only ("Failed to load model from file" with verbose=False);
    tbrpc's load wrapper raises a PlanError (a ValueError) saying so and what to use."""
    started = nodes(2)
    script = (
        "import json, sys, llama_cpp, tbrpc\n"
        "tbrpc.connect(sys.argv[2:])\n"
        "try:\n"
        "    llama_cpp.Llama(sys.argv[1], n_gpu_layers=-1, n_ctx=256, split_mode=2, verbose=False)\n"
        "    print(json.dumps(None))\n"
        "except ValueError as e:\n"
        "    print(json.dumps(str(e)))\n")
    proc = subprocess.run([sys.executable, "-c", script, str(models.ensure("llama-f32")), *[n.endpoint for n in started]],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = json.loads(proc.stdout.strip().splitlines()[-1])
    assert said == ("split_mode=2 (row) needs devices with split buffers (CUDA's), and tbrpc devices have none: "
                    "use split_mode=1 (layer) or 3 (tensor)"), said


def test_a_plain_tensor_split_without_flash_attention_says_so(nodes: Any) -> None:
    """llama.cpp creates no tensor-split context with flash attention off and says why only in its
    log: a plain llama_cpp.Llama(split_mode=3) over tbrpc devices raises a PlanError (a ValueError)
    saying to pass flash_attn=True, not llama-cpp-python's bare "Failed to create llama_context";
    with it, the same model loads, and a layer split at the same address needs no flash attention."""
    started = nodes(2)
    script = (
        "import json, sys, llama_cpp, tbrpc\n"
        "tbrpc.connect(sys.argv[2:])\n"
        "kw = dict(n_gpu_layers=-1, n_ctx=256, verbose=False)\n"
        "try:\n"
        "    llama_cpp.Llama(sys.argv[1], split_mode=3, **kw)\n"
        "    refused = None\n"
        "except ValueError as e:\n"
        "    refused = str(e)\n"
        "texts = []\n"
        "for mode, fa in ((3, True), (1, False)):\n"
        "    llm = llama_cpp.Llama(sys.argv[1], split_mode=mode, flash_attn=fa, **kw)\n"
        "    texts.append(llm('The capital of France is', max_tokens=4, temperature=0)['choices'][0]['text'])\n"
        "    llm.close()\n"
        "print(json.dumps({'refused': refused, 'texts': texts}))\n")
    proc = subprocess.run([sys.executable, "-c", script, str(models.ensure("llama-f32")), *[n.endpoint for n in started]],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["refused"] and "needs flash attention" in out["refused"] and "flash_attn=True" in out["refused"], out
    assert len(out["texts"]) == 2 and all(out["texts"]), out


GEMMA3_LAYERS = 18           # Gemma 3 270M: one FFN all-reduce per layer
GEMMA3_LOGIT_TOLERANCE = 1.5   # measured: at most 1.06, 1.15, 0.83 over 2, 3, 4 nodes (see the docstring)
GEMMA3_CLEAR_MARGIN = 0.25     # a greedy choice with a top-two gap this wide must not change


@pytest.mark.parametrize("n_nodes", [2, 3, 4])
def test_gemma3_with_its_ffn_split_across_nodes(n_nodes: int, nodes: Any, tmp_path: Path) -> None:
    """Gemma 3 270M over 2, 3 and 4 nodes with tbrpc's split (split_rules.c:
    the FFN cut in equal shares, the output by vocabulary, attention whole on
    each node; llama.cpp's own tensor split aborts on its one KV head,
    test_llamas_own_tensor_split_still_aborts).

    Teacher-forced on one process's greedy tokens, every step's logits are
    compared. They are not as close as the tiny models': Gemma 3 amplifies
    the order partial sums are added in (one process alone moves its logits
    by 0.43 when the prompt is evaluated in one batch instead of token by
    token with an F32 FFN), so the split's logits are within 1.5 (measured
    1.06, 1.15 and 0.83 over 2, 3 and 4 nodes), and every greedy choice
    whose top-two gap is clear is the same;
    "The capital of France is" has one near tie (a 0.02 gap at step 5, where
    the split picks the runner-up)."""
    model = models.ensure("gemma")
    the_plan = plan(model, [make_node(f"n{i}", "4GiB", kind="cpu") for i in range(n_nodes)], ctx=256, split="ffn",
                    head_device="none")
    assert the_plan.fits and the_plan.tensor is not None and the_plan.tensor.output_cut
    base, base_logits = run_head(tmp_path, model=str(model), prompt=PROMPT, n_predict=N_PREDICT, flash_attn=True)
    assert base["error"] is None, base["error"]
    started = nodes(n_nodes)
    result, logits = run_head(tmp_path, model=str(model), prompt=PROMPT, n_predict=N_PREDICT, flash_attn=True,
                              nodes=[n.endpoint for n in started], ffn_split=the_plan.tensor.granularity,
                              forced_tokens=base["tokens"])
    assert result["error"] is None, result["error"]
    assert logits is not None and logits.shape == base_logits.shape
    diff = np.abs(logits - base_logits).max(axis=1)
    top2 = np.sort(base_logits, axis=1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] >= GEMMA3_CLEAR_MARGIN
    assert float(diff.max()) <= GEMMA3_LOGIT_TOLERANCE, diff
    assert int(clear.sum()) >= N_PREDICT - 2, clear   # not a vacuous check
    assert [t for t, c in zip(result["tokens"], clear) if c] == [t for t, c in zip(base["tokens"], clear) if c]
    assert_every_pair_linked(result, SHM)
    # the output head cut by vocabulary in whole granules: per token the head receives from each node one
    # reply with its slice of the logits, the slices add up to the vocabulary, and none is bigger than its share
    n_vocab = base_logits.shape[1]
    slices = [received - _reply_bytes(0) for _, received in _head_bytes_per_token(result)]
    assert sum(slices) == n_vocab * 4, slices
    granule = the_plan.tensor.granularity * 4
    assert all(s % granule == 0 and abs(s - n_vocab * 4 / n_nodes) <= granule for s in slices), (slices, granule)
    for node in result["nodes"]:
        assert node["allreduces"] == GEMMA3_LAYERS * STEADY_TOKENS, node
        assert not node["failed"], node["error"]


# ---- the ring all-reduce (TB_ALLREDUCE_RING) ---------------------------------------------------
# TBRPC_ALLREDUCE=ring forces it on one host; a cluster file whose `links` give a cable for each node's
# link to the next but not for every pair chooses it (test_the_allreduce_choice below).
RING = {"TBRPC_ALLREDUCE": "ring"}
# A prompt long enough that its all-reduce (n_tokens x n_embd floats, 1 KiB per token for the tiny deepseek2)
# cuts each ring step into several 32 KiB pieces, with a token count that 3 does not divide (uneven chunks).
LONG_PROMPT = " ".join(["The capital of France is Paris, and the capital of Italy is Rome."] * 5) + " The capital of France is"


def _ring_matches_single_process(tmp_path: Path, started: list[Any], model: str, prompt: str, per_token: int,
                                 **split: Any) -> None:
    base, base_logits = run_head(tmp_path, model=model, prompt=prompt, n_predict=N_PREDICT, flash_attn=True)
    assert base["error"] is None, base["error"]
    result, logits = run_head(tmp_path, model=model, prompt=prompt, n_predict=N_PREDICT, flash_attn=True,
                              nodes=[n.endpoint for n in started], env=RING, **split)
    assert result["error"] is None, result["error"]
    assert [n["allreduce"] for n in result["nodes"]] == ["ring"] * len(started), result["nodes"]
    assert "all-reduce over" not in result["stderr"], result["stderr"][-2000:]   # said in llama.cpp's log: verbose only
    assert result["tokens"] == base["tokens"]
    assert logits is not None and logits.shape == base_logits.shape
    diff = float(np.max(np.abs(logits - base_logits)))
    assert diff <= LOGIT_TOLERANCE, diff
    assert_ring_linked(result, SHM)
    names = [f"n{k}" for k in range(len(started))]   # what launch's load summary and `tbrpc status` say
    assert connection_lines(record_of(result["nodes"], names))[-1] == "all-reduce: ring over " + " -> ".join(names + names[:1])
    for node, status in zip(result["nodes"], result["status"]):
        assert node["allreduces"] == per_token * STEADY_TOKENS, node
        assert node["peer_copies"] == 0, node
        assert status["allreduces"] >= per_token * STEADY_TOKENS, status   # counted by the node: they ran there
        assert not node["failed"], node["error"]


@pytest.mark.parametrize("n_nodes", [3, 4])
def test_deepseek2_ffn_split_over_a_ring(n_nodes: int, nodes: Any, tmp_path: Path) -> None:
    """The tiny deepseek2's FFN split with the ring all-reduce: links to the
    next node only, one process's greedy tokens, logits within the mesh's
    tolerance, one ALLREDUCE per layer per token, run on every node."""
    _ring_matches_single_process(tmp_path, nodes(n_nodes), str(models.ensure("deepseek2-f32")), PROMPT,
                                 DEEPSEEK2_LAYERS, ffn_split=1)


def test_deepseek2_ring_with_a_long_prompt(nodes: Any, tmp_path: Path) -> None:
    """A prompt whose all-reduces are larger than 3 x 32 KiB: each ring step
    goes as several pieces, over chunks of unequal size."""
    model = str(models.ensure("deepseek2-f32"))
    from llama_cpp import Llama
    n_tokens = len(Llama(model, vocab_only=True, verbose=False).tokenize(LONG_PROMPT.encode(), add_bos=True))
    n_embd = int(gguf.GGUFReader(model).fields["deepseek2.embedding_length"].parts[-1][0])
    assert n_tokens * n_embd * 4 > 3 * 2 * 32 * 1024 and n_tokens * n_embd % 3 != 0, n_tokens   # several pieces, uneven chunks
    _ring_matches_single_process(tmp_path, nodes(3), model, LONG_PROMPT, DEEPSEEK2_LAYERS, ffn_split=1)


def test_llama_tensor_split_over_a_ring(nodes: Any, tmp_path: Path) -> None:
    """llama.cpp's own tensor split of the tiny llama over 4 nodes with the
    ring all-reduce: two ALLREDUCEs per layer per token, neighbours only."""
    _ring_matches_single_process(tmp_path, nodes(4), str(models.ensure("llama-f32")), PROMPT, 2 * N_LAYER,
                                 split_mode=3)


def test_mesh_is_said_too(nodes: Any, tmp_path: Path) -> None:
    """Nodes on one host with no links in a cluster file: a mesh, and NodeInfo and the log (llama.cpp's,
    shown with verbose=True) say so, and why."""
    started = nodes(3)
    result, _ = run_head(tmp_path, model=str(models.ensure("deepseek2-f32")), prompt=PROMPT, n_predict=3,
                         flash_attn=True, nodes=[n.endpoint for n in started], ffn_split=1, verbose=True)
    assert result["error"] is None, result["error"]
    assert "all-reduce over 3 nodes: mesh (no links in the cluster" in result["stderr"], result["stderr"][-2000:]
    assert [n["allreduce"] for n in result["nodes"]] == ["mesh"] * 3
    assert_every_pair_linked(result, SHM)


def _choose(addressed: set[tuple[int, int]], n: int, forced: str | None = None) -> tuple[str, str]:
    return allreduce_choice([[(a, b) in addressed for b in range(n)] for a in range(n)], forced)


def test_the_allreduce_choice() -> None:
    """comm_init's rule (client.c): a ring when the cluster gives an address
    (a cable) for each node's link to the next (node i dials i+1 mod n) but
    not for every pair; a mesh with addresses for every pair, with none, or
    with some that make no ring; TBRPC_ALLREDUCE forces either."""
    ring4 = {(0, 1), (1, 2), (2, 3), (3, 0)}
    every4 = {(a, b) for a in range(4) for b in range(4) if a != b}
    assert _choose(ring4, 4)[0] == "ring"
    assert _choose(ring4 | {(1, 0), (2, 1)}, 4)[0] == "ring"            # more cables than the ring's, not all
    assert _choose(every4, 4) == ("mesh", "the cluster's links give an address for every pair")
    assert _choose(set(), 4) == ("mesh", "no links in the cluster: every node reaches every other")
    assert _choose(ring4 - {(3, 0)}, 4)[0] == "mesh"                      # a layer split's cables: no way back
    assert _choose({(1, 0), (2, 1), (3, 2), (0, 3)}, 4)[0] == "mesh"      # a ring the other way round
    assert _choose({(0, 1), (1, 2), (2, 0)}, 3)[0] == "ring"
    assert _choose({(0, 1), (1, 0)}, 2)[0] == "mesh"                      # two nodes: the ring is every pair
    assert _choose(set(), 4, "ring") == ("ring", "TBRPC_ALLREDUCE=ring")
    assert _choose(ring4, 4, "mesh") == ("mesh", "TBRPC_ALLREDUCE=mesh")
    kind, why = _choose(ring4, 4, "rign")
    assert kind == "ring" and "neither ring nor mesh: ignored" in why, why


@pytest.mark.parametrize("env", [RING, {}], ids=["ring", "mesh"])
def test_a_node_killed_during_allreduces_is_named_at_once(env: dict[str, str], nodes: Any, tmp_path: Path) -> None:
    """Node 1 of 3 dies while they decode: the head's error names it at
    once, not after the 30 s timeout, and the other nodes stay up. In the
    ring node 0 never hears from node 1 (its previous node is 2): node 2,
    which does, gives up with the reason and tells node 0 so (a PEER_SEND
    frame flagged TB_FLAG_GAVE_UP), instead of going on to its next
    all-reduce, whose frames node 0 would take for this one's."""
    started = nodes(3)
    t0 = time.monotonic()
    result, _ = run_head(tmp_path, model=str(models.ensure("deepseek2-f32")), prompt=PROMPT, n_predict=N_PREDICT,
                         flash_attn=True, nodes=[n.endpoint for n in started], ffn_split=1, env=env, timeout=30.0,
                         kill={"pid": started[1].proc.pid, "after_tokens": 3})
    assert time.monotonic() - t0 < 25, "the head waited out its timeout"
    assert result["error"] is not None and result["error"]["type"] == "NodeFailed", result["error"]
    message = result["error"]["message"]
    assert started[1].endpoint in message and "no answer within" not in message, message
    assert started[1].proc.wait(timeout=10) == -9
    assert started[0].proc.poll() is None and started[2].proc.poll() is None
