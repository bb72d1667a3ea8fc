"""The planner in tensor mode (llama.cpp's split_mode=3) and with a draft model.

Expected bytes are derived here from the GGUF's own tensor list (names,
shapes, types, sizes) and from the model's geometry, not through the
planner's code path; the calibration test loads the plan over real nodes and
compares with what each node allocated.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

import models
from helpers import ENV, assert_gone, http_json, run_head, start_launch
from tbrpc.cli import main as cli_main
from tbrpc.gguf_model import load_gguf
from tbrpc.llama import check_split
from tbrpc.native import TbrpcError
from tbrpc.node_memory import make_node
from tbrpc.plan import PlanError, TensorSplitError, plan
from tbrpc.units import format_size

TINY = dict(n_layer=6, n_embd=128, n_vocab=384, n_head=4, n_head_kv=2, head_dim=32, n_ff=256)
# The matrices llama.cpp's meta device cuts (llama_meta_device_get_split_state):
# Q/K/V by columns (whole heads), attn_output and ffn_down by rows, ffn_gate/up
# by columns, the output head by vocabulary rows. Everything else is mirrored.
SPLIT = re.compile(r"(blk\.\d+\.(attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down)|output)\.weight")

MORE_FFN_DOWN = " (and 5 more like it)"   # the tiny llama's six layers
ONE_BLOCK = ("cuts blk.0.ffn_down.weight (and 5 more like it) along dimension 0 in whole blocks, and it is 256 values "
             "wide, one Q4_K block (256 values): over {n} nodes all but one of them get none of it, and the meta device "
             "of llama-cpp-python 0.3.36 aborts while loading it")


def _cpu_nodes(n: int, size: str = "4GiB") -> list[Any]:
    return [make_node(f"node{i}", size, kind="cpu") for i in range(n)]


def _pad(n: int) -> int:
    return (n + 31) // 32 * 32


@pytest.fixture(scope="module")
def llama_f32() -> Path:
    return models.ensure("llama-f32")


def _classify(path: Path) -> tuple[int, int, int]:
    """(split tensors' bytes, mirrored tensors' bytes, token embeddings' bytes) from the file's tensor list."""
    split = mirrored = embd = 0
    for t in load_gguf(path).tensors:
        if t.name == "token_embd.weight":
            embd += t.n_bytes
        elif SPLIT.fullmatch(t.name):
            split += t.n_bytes
        else:
            mirrored += t.n_bytes
    return split, mirrored, embd


def test_two_nodes_split_and_replicated_bytes(llama_f32: Path) -> None:
    split, mirrored, embd = _classify(llama_f32)
    p = plan(llama_f32, _cpu_nodes(2), ctx=256, split="tensor", head_device="none")
    assert p.fits and p.split_mode == "tensor" and p.tensor is not None
    assert p.tensor_split == [1.0, 1.0]
    # Every split tensor is cut in two halves of whole heads / whole 128-wide FFN blocks.
    assert p.tensor.split_bytes == split
    assert sum(n.split_bytes for n in p.nodes) == split
    assert [n.split_bytes for n in p.nodes] == [split // 2, split // 2]
    # Mirrored tensors (norms) are held whole by every node; the embeddings stay on the head.
    assert p.tensor.replicated_bytes == mirrored
    assert all(n.replicated_bytes == mirrored for n in p.nodes)
    assert p.head is not None and p.head.weights_bytes == embd
    # F32 tensors of these shapes are all multiples of ggml's 32-byte alignment.
    assert all(n.weights_bytes == split // 2 + mirrored for n in p.nodes)
    # KV: half the KV heads of every layer per node, F16, 256 cells.
    kv_per_node = TINY["n_layer"] * 256 * 2 * (TINY["n_head_kv"] // 2 * TINY["head_dim"]) * 2
    assert [n.kv_bytes for n in p.nodes] == [kv_per_node, kv_per_node]
    # Full-size compute buffer on every node: the same on both, and at least the
    # largest a layer split of the same model needs on any one node.
    layer = plan(llama_f32, _cpu_nodes(2), ctx=256, split="layer", head_device="none", flash_attn=True)
    assert p.nodes[0].compute_bytes == p.nodes[1].compute_bytes >= max(n.compute_bytes for n in layer.nodes)
    assert all(n.total_bytes == n.weights_bytes + n.kv_bytes + n.compute_bytes for n in p.nodes)


def test_all_reduces_per_token(llama_f32: Path) -> None:
    for n_nodes, mesh, butterfly in ((2, 2, 2), (3, 6, 4), (4, 12, 8)):
        p = plan(llama_f32, _cpu_nodes(n_nodes), ctx=256, split="tensor", head_device="none")
        t = p.tensor
        assert t is not None
        # one after attention and one after the FFN, per layer; an F32 vector of n_embd values each
        assert t.all_reduces_per_token == 2 * TINY["n_layer"] == 12
        assert t.all_reduce_bytes == TINY["n_embd"] * 4 == 512
        assert t.all_reduce_bytes_per_token == 12 * 512
        # every device a TBRPC node: tbrpc's all-reduce, each node's partial to every other node
        assert t.all_reduce_path == "tbrpc" and t.copies_per_all_reduce == mesh
        assert t.node_to_node_bytes_per_token == 12 * mesh * 512
        assert t.logits_bytes_per_token == TINY["n_vocab"] * 4
        # receive buffers (device) and ALLREDUCE scratch (a CPU node's heap: 2 partials), one 256-token ubatch each
        partial = 256 * TINY["n_embd"] * 4
        assert t.reduce_buffer_bytes == (n_nodes - 1).bit_length() * partial
        assert t.scratch_bytes == [2 * partial] * n_nodes
        # the head's own device first: its registry has no all-reduce, so the meta backend's butterfly
        # (fold the excess over a power of two in and back, log2 rounds over the rest)
        g = plan(llama_f32, _cpu_nodes(n_nodes), ctx=256, split="tensor", head_device="gpu").tensor
        assert g is not None and g.all_reduce_path == "butterfly" and g.copies_per_all_reduce == butterfly
        assert g.scratch_bytes == [0] * n_nodes


def test_ring_all_reduce_transfers_and_scratch(llama_f32: Path) -> None:
    """The ring all-reduce (node_links.c): 2(N-1) steps, every node sending one chunk of 1/N of the
    vector per step: 2N(N-1) transfers moving 2(N-1) vectors in all, against the mesh's N(N-1)
    whole ones; a CPU node's scratch is one 32 KiB piece. Two nodes in a ring are a mesh."""
    for n_nodes in (3, 4):
        t = plan(llama_f32, _cpu_nodes(n_nodes), ctx=256, split="tensor", head_device="none", allreduce="ring").tensor
        mesh = plan(llama_f32, _cpu_nodes(n_nodes), ctx=256, split="tensor", head_device="none").tensor
        assert t is not None and mesh is not None
        assert (t.all_reduce_shape, mesh.all_reduce_shape) == ("ring", "mesh")
        assert t.copies_per_all_reduce == 2 * n_nodes * (n_nodes - 1)
        assert t.node_to_node_bytes_per_token == 12 * 2 * (n_nodes - 1) * 512
        assert mesh.node_to_node_bytes_per_token == 12 * n_nodes * (n_nodes - 1) * 512
        assert t.scratch_bytes == [32 << 10] * n_nodes
    two = plan(llama_f32, _cpu_nodes(2), ctx=256, split="tensor", head_device="none", allreduce="ring").tensor
    assert two is not None and two.all_reduce_shape == "mesh" and two.copies_per_all_reduce == 2
    with pytest.raises(PlanError, match="allreduce must be one of"):
        plan(llama_f32, _cpu_nodes(3), ctx=256, split="tensor", head_device="none", allreduce="star")


def test_the_cluster_files_links_choose_the_all_reduce(monkeypatch: pytest.MonkeyPatch) -> None:
    """spec.allreduce_of asks the head's own rule (client.c) about a cluster's `links`: a ring of
    cables makes a ring, none or every pair a mesh; TBRPC_ALLREDUCE as the head reads it."""
    from tbrpc.spec import NodeSpec, allreduce_of

    names = ["s1", "s2", "s3", "s4"]

    def specs(pairs: set[tuple[str, str]]) -> list[NodeSpec]:   # (a, b): b's links name a
        return [NodeSpec(name=b, host="h", port=1, links=tuple((a, "x") for a in names if (a, b) in pairs)) for b in names]

    ring = {(names[i], names[(i + 1) % 4]) for i in range(4)} | {(names[(i + 1) % 4], names[i]) for i in range(4)}
    every = {(a, b) for a in names for b in names if a != b}
    monkeypatch.delenv("TBRPC_ALLREDUCE", raising=False)
    assert (allreduce_of(specs(ring)), allreduce_of(specs(set())), allreduce_of(specs(every))) == ("ring", "mesh", "mesh")
    monkeypatch.setenv("TBRPC_ALLREDUCE", "mesh")
    assert allreduce_of(specs(ring)) == "mesh"


def test_four_nodes_whole_heads(llama_f32: Path) -> None:
    """Four nodes, two KV heads: llama.cpp gives whole head groups, so per layer
    two nodes hold the attention and two none, rotating by layer; the FFN and
    the output head are cut in quarters."""
    split, mirrored, _ = _classify(llama_f32)
    p = plan(llama_f32, _cpu_nodes(4), ctx=256, split="tensor", head_device="none")
    assert sum(n.split_bytes for n in p.nodes) == split
    assert all(n.replicated_bytes == mirrored for n in p.nodes)
    d, hd, ff, v = TINY["n_embd"], TINY["head_dim"], TINY["n_ff"], TINY["n_vocab"]
    q_group = (d * 2 * hd + 2 * d * hd + 2 * hd * d) * 4  # attn_q (2 heads) + attn_k, attn_v (1 head) + attn_output rows
    ffn_quarter = 3 * d * ff // 4 * 4
    out_quarter = d * v // 4 * 4
    # Rotation: layer il's attention goes to nodes (1+il)%4 and (3+il)%4, so over 6 layers nodes 0 and 2 hold 3 groups each... and so do 1 and 3.
    attention = [(n.split_bytes - 6 * ffn_quarter - out_quarter) for n in p.nodes]
    assert all(a % q_group == 0 for a in attention), attention
    assert sum(attention) == 6 * 2 * q_group
    kv_head = 256 * hd * 2 * 2  # K and V of one KV head, F16, 256 cells
    assert all(n.kv_bytes % kv_head == 0 for n in p.nodes)
    assert sum(n.kv_bytes for n in p.nodes) == TINY["n_layer"] * TINY["n_head_kv"] * kv_head


def test_too_big_for_two_small_nodes(llama_f32: Path) -> None:
    """Nodes a layer split fits on, too small once every node holds the
    replicated tensors and the full-size compute buffer."""
    size = 7_900_000
    nodes = [make_node(f"node{i}", size, kind="cpu") for i in range(2)]
    layer = plan(llama_f32, nodes, ctx=2048, head_device="none", margin=0, flash_attn=True)
    assert layer.fits
    p = plan(llama_f32, nodes, ctx=2048, split="tensor", head_device="none", margin=0)
    assert not p.fits and p.shortfall is not None
    worst = min(p.nodes, key=lambda n: n.headroom_bytes)
    assert worst.total_bytes > size
    msg = p.shortfall.message
    assert f"{worst.name} (1/2 of every layer)" in msg
    assert f"over by {format_size(worst.total_bytes - size)}" in msg
    assert p.shortfall.max_ctx is not None and p.shortfall.max_ctx < 2048
    result = CliRunner().invoke(cli_main, ["plan", "--gguf", str(llama_f32), "--node", f"a={size}", "--node", f"b={size}",
                                           "--ctx", "2048", "--margin", "0", "--split", "tensor", "--head-device", "none"])
    assert result.exit_code == 1, result.output
    assert "DOES NOT FIT" in result.output and "a (1/2 of every layer)" in result.output and "over by" in result.output


def test_deepseek2_refused() -> None:
    path = models.ensure("deepseek2-f32")
    with pytest.raises(PlanError, match=r"refuses architecture 'deepseek2' in tensor mode.*llm_arch_supports_sm_tensor"):
        plan(path, _cpu_nodes(2), ctx=256, split="tensor", head_device="none")
    result = CliRunner().invoke(cli_main, ["plan", "--gguf", str(path), "--nodes", "2x4GiB", "--split", "tensor"])
    assert result.exit_code != 0 and "deepseek2" in result.output and "--split layer" in result.output
    # the layer split is unchanged
    assert plan(path, _cpu_nodes(2), ctx=256, head_device="none").fits


def test_tensor_mode_needs_flash_attention_and_no_cpu_head(llama_f32: Path) -> None:
    with pytest.raises(PlanError, match="flash attention"):
        plan(llama_f32, _cpu_nodes(2), ctx=256, split="tensor", flash_attn=False)
    with pytest.raises(PlanError, match="head's CPU"):
        plan(llama_f32, _cpu_nodes(2), ctx=256, split="tensor", head_device="cpu")


def test_llama_kwargs_and_cli_follow_the_split(llama_f32: Path) -> None:
    p = plan(llama_f32, _cpu_nodes(2), ctx=256, split="tensor", head_device="none")
    kw = p.llama_kwargs()
    assert kw["split_mode"] == 3 and kw["tensor_split"] == [1.0, 1.0] and kw["flash_attn"] is True
    assert kw["n_gpu_layers"] == TINY["n_layer"] + 1
    assert "-sm tensor -ts 1,1" in p.cli_args and p.cli_args.endswith("-fa on")
    layer = plan(llama_f32, _cpu_nodes(2), ctx=256, head_device="none")
    assert layer.llama_kwargs()["split_mode"] == 1 and "-sm layer" in layer.cli_args and layer.tensor is None
    result = CliRunner().invoke(cli_main, ["plan", "--gguf", str(llama_f32), "--nodes", "2x4GiB", "--ctx", "256",
                                           "--split", "tensor", "--head-device", "none", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["split_mode"] == "tensor" and data["tensor"]["all_reduces_per_token"] == 12
    assert [n["split_bytes"] for n in data["nodes"]] == [n.split_bytes for n in p.nodes]
    table = CliRunner().invoke(cli_main, ["plan", "--gguf", str(llama_f32), "--nodes", "2x4GiB", "--ctx", "256",
                                          "--split", "tensor", "--head-device", "none"]).output
    assert "replicated" in table and "all-reduces   12 per token" in table and "split_mode=3" in table
    # shares given by the user are planned as given
    uneven = plan(llama_f32, _cpu_nodes(2), ctx=256, split="tensor", head_device="none", tensor_split=[3, 1])
    assert uneven.tensor_split == [3.0, 1.0]
    assert uneven.nodes[0].split_bytes > uneven.nodes[1].split_bytes
    assert sum(n.split_bytes for n in uneven.nodes) == _classify(llama_f32)[0]


def test_uneven_nodes_get_shares_by_free_memory(llama_f32: Path) -> None:
    """Equal shares first; when they do not fit, shares follow each node's room."""
    big, small = make_node("big", "64MiB", kind="cpu"), make_node("small", "1GiB", kind="cpu")
    p = plan(llama_f32, [big, small], ctx=256, split="tensor", head_device="none", margin=0)
    assert p.tensor_split == [1.0, 1.0]  # plenty of room: equal shares
    fixed = p.nodes[0].total_bytes - p.nodes[0].split_bytes - p.nodes[0].kv_bytes
    tight = make_node("tight", fixed + (p.nodes[0].split_bytes + p.nodes[0].kv_bytes) // 2, kind="cpu")
    q = plan(llama_f32, [tight, small], ctx=256, split="tensor", head_device="none", margin=0)
    assert q.fits and q.tensor_split[0] < q.tensor_split[1]


# --- against real nodes -------------------------------------------------------------


@pytest.mark.parametrize("n_nodes,ctx", [(2, 256), (3, 512), (4, 1024)])
def test_tensor_plan_matches_what_nodes_allocate(n_nodes: int, ctx: int, llama_f32: Path, nodes: Any, tmp_path: Path) -> None:
    """Load the plan's kwargs over real nodes: each node's allocation (weights +
    KV + compute; the all-reduce buffers come with the first decode) is the plan's.
    Measured: 6-12 KiB above the plan (0.2-0.3%), the same on every node."""
    p = plan(llama_f32, _cpu_nodes(n_nodes), ctx=ctx, split="tensor", head_device="none")
    started = nodes(n_nodes)
    kw = p.llama_kwargs()
    result, _ = run_head(tmp_path, model=str(llama_f32), prompt="The capital of France is", n_predict=2,
                         flash_attn=kw["flash_attn"], split_mode=kw["split_mode"], tensor_split=kw["tensor_split"],
                         n_ctx=ctx, nodes=[n.endpoint for n in started])
    assert result["error"] is None, result["error"]
    assert p.tensor is not None and len(result["allocated_after_load"]) == n_nodes
    for n, allocated in zip(p.nodes, result["allocated_after_load"]):
        planned = n.total_bytes - p.tensor.reduce_buffer_bytes - p.tensor.scratch_bytes[p.nodes.index(n)]
        assert abs(planned - allocated) <= max(0.01 * allocated, 64 * 1024), (n.name, planned, allocated)
        # weights and KV are exact: the rest is the compute buffer
        assert allocated - n.weights_bytes - n.kv_bytes > 0


def _one_process(model: Path, prompt: str, max_tokens: int) -> str:
    code = textwrap.dedent(f"""
        import json
        from tests.reference import reference_llama
        llm = reference_llama({str(model)!r}, n_ctx=256, verbose=False, flash_attn=True)
        out = llm.create_completion({prompt!r}, max_tokens={max_tokens}, temperature=0)
        print(json.dumps(out["choices"][0]["text"]))
    """)
    proc = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("model_name,split,says", [
    ("llama-f32", "tensor", ("of every layer", "flash attention")),
    # tbrpc's own rules for deepseek2, which llama.cpp will not tensor-split
    ("deepseek2-f32", "ffn", ("of every FFN and expert",)),
])
def test_launch_split_matches_one_process(model_name: str, split: str, says: tuple[str, ...], tmp_path: Path) -> None:
    """`tbrpc launch --split tensor|ffn` over two nodes: the same greedy text as one process."""
    model = models.ensure(model_name)
    prompt = "The capital of France is"
    want = _one_process(model, prompt, 12)
    launch = start_launch(tmp_path, "--gguf", str(model), "--local", "2", "--ctx", "256", "--split", split,
                          "--prompt", prompt, "--max-tokens", "12")
    assert launch.finish(timeout=180) == 0, launch.stderr
    assert launch.stdout == want + "\n"
    assert all(words in launch.stderr for words in says), launch.stderr
    assert_gone(launch.node_pids())


def test_launch_hybrid_matches_one_process(tmp_path: Path) -> None:
    """`tbrpc launch --local 4 --split ffn --groups 2`: two groups of two nodes, each cutting its
    layers' FFN and experts, the groups layer-split; the same greedy text as one process, the plan
    and the all-reduce said per group."""
    model = models.ensure("deepseek2-f32")
    prompt = "The capital of France is"
    want = _one_process(model, prompt, 12)
    p = plan(model, _cpu_nodes(4), ctx=256, split="ffn", groups=2)
    first, last = p.nodes[0].layers, p.nodes[2].layers
    launch = start_launch(tmp_path, "--gguf", str(model), "--local", "4", "--ctx", "256", "--split", "ffn",
                          "--groups", "2", "--prompt", prompt, "--max-tokens", "12")
    assert launch.finish(timeout=180) == 0, launch.stderr
    assert launch.stdout == want + "\n"
    assert (f"plan: local0 layers {first[0]}-{first[1]}, 1/2 of their FFN and experts, local1 layers "
            f"{first[0]}-{first[1]}, 1/2 of their FFN and experts, local2 layers {last[0]}-{last[1]}") in launch.stderr
    assert "all-reduce: mesh over local0, local1\n" in launch.stderr, launch.stderr
    assert "all-reduce: mesh over local2, local3\n" in launch.stderr, launch.stderr
    assert_gone(launch.node_pids())


# --- draft model --------------------------------------------------------------------


def test_draft_model_is_planned_on_the_head(llama_f32: Path) -> None:
    draft_path = models.ensure("llama")  # quantized tiny llama as the draft of the F32 one: same vocabulary
    draft_file = load_gguf(draft_path)
    expected_weights = sum(_pad(t.n_bytes) for t in draft_file.tensors)
    expected_kv = TINY["n_layer"] * 256 * 2 * (TINY["n_head_kv"] * TINY["head_dim"]) * 2  # K and V, F16, 256 cells
    draft_host = TINY["n_vocab"] * 4 + 512 * TINY["n_vocab"] * 4  # its output buffer + score array

    plain = plan(llama_f32, _cpu_nodes(2), ctx=256, head_device="none")
    p = plan(llama_f32, _cpu_nodes(2), ctx=256, head_device="none", draft_model=draft_path)
    d = p.draft
    assert d is not None and d.ctx == 256
    assert d.weights_bytes == expected_weights
    assert d.kv_bytes == expected_kv
    assert d.host_bytes == draft_host
    assert d.compute_bytes > 0 and d.total_bytes == d.weights_bytes + d.kv_bytes + d.compute_bytes + d.host_bytes
    assert p.head is not None and plain.head is not None
    assert p.head.draft_bytes == d.total_bytes
    # With a draft llama-cpp-python keeps every token's logits: llama.cpp's output buffer holds a whole batch.
    assert p.head.host_bytes - plain.head.host_bytes == (512 - 1) * TINY["n_vocab"] * 4
    assert p.head.total_bytes == plain.head.total_bytes + d.total_bytes + (512 - 1) * TINY["n_vocab"] * 4
    assert [n.total_bytes for n in p.nodes] == [n.total_bytes for n in plain.nodes]  # the nodes are not charged

    # A head that runs layers carries the draft itself, and fits it or not.
    gpu = plan(llama_f32, _cpu_nodes(2), ctx=256, head_device="gpu", draft_model=draft_path)
    assert gpu.nodes[0].draft_bytes == d.total_bytes and gpu.nodes[1].draft_bytes == 0
    assert gpu.nodes[0].total_bytes == (gpu.nodes[0].weights_bytes + gpu.nodes[0].kv_bytes + gpu.nodes[0].compute_bytes
                                        + gpu.nodes[0].host_bytes + d.total_bytes)
    # in tensor mode too
    t = plan(llama_f32, _cpu_nodes(2), ctx=256, split="tensor", head_device="none", draft_model=draft_path)
    assert t.head is not None and t.head.draft_bytes == d.total_bytes

    result = CliRunner().invoke(cli_main, ["plan", "--gguf", str(llama_f32), "--nodes", "2x4GiB", "--ctx", "256",
                                           "--head-device", "none", "--draft-model", str(draft_path)])
    assert result.exit_code == 0, result.output
    assert "draft model" in result.output and format_size(d.total_bytes) in result.output
    data = json.loads(CliRunner().invoke(cli_main, ["plan", "--gguf", str(llama_f32), "--nodes", "2x4GiB", "--ctx", "256",
                                                    "--head-device", "none", "--draft-model", str(draft_path), "--json"]).output)
    assert data["draft"]["weights_bytes"] == expected_weights and data["head"]["draft_bytes"] == d.total_bytes


def test_unused_numpy_guard() -> None:
    assert np.float32(1) == 1


def test_quantized_70b_shape_splits_in_exact_quarters(tmp_path: Path) -> None:
    """A Llama-70B-shaped Q4_K file (headers only): every cut falls on whole
    heads and whole Q4_K blocks, so four equal nodes get exactly a quarter of
    every split tensor; the all-reduces follow the depth: 2 x 80 per token,
    32 KiB each."""
    from gguf import GGMLQuantizationType as QT

    from tests.fixtures_shapes import LlamaGeometry, llama_spec, write_shape_only

    g = LlamaGeometry(n_layer=80, n_embd=8192, n_vocab=128256, n_head=64, n_head_kv=8, n_ff=28672, n_ctx_train=131072)
    spec = llama_spec(g, QT.Q4_K)
    path = write_shape_only(spec, tmp_path / "llama-70b-q4_k.gguf")[0]
    split = sum(t.n_bytes for t in spec.tensors if SPLIT.fullmatch(t.name))
    mirrored = sum(t.n_bytes for t in spec.tensors if not SPLIT.fullmatch(t.name) and t.name != "token_embd.weight")
    nodes = [make_node(f"mac{i}", "128GiB") for i in range(4)]  # Metal: 96 GiB usable each
    p = plan(path, nodes, ctx=8192, split="tensor", head_device="none")
    assert p.fits and p.tensor is not None
    assert [n.split_bytes for n in p.nodes] == [split // 4] * 4 and split % 4 == 0
    assert all(n.replicated_bytes == mirrored for n in p.nodes)
    head_dim = g.n_embd // g.n_head
    kv = g.n_layer * 8192 * 2 * (g.n_head_kv // 4 * head_dim) * 2  # two KV heads per node, F16
    assert [n.kv_bytes for n in p.nodes] == [kv] * 4
    assert p.tensor.all_reduces_per_token == 160 and p.tensor.all_reduce_bytes == 8192 * 4
    two = plan(path, nodes[:2], ctx=8192, split="tensor", head_device="none")
    assert [n.split_bytes for n in two.nodes] == [split // 2] * 2


def test_llama_kwargs_are_planned_as_given() -> None:
    """What tbrpc.Llama / launch pass to llama.cpp is what gets planned: split
    mode, the shares of either split, and a draft model (which keeps all logits)."""
    from tbrpc.llama import context_kwargs, planned_context

    assert context_kwargs(split="tensor") == {"split_mode": 3}
    assert context_kwargs(split="layer") == {"split_mode": 1}
    options = planned_context({"split_mode": 3, "tensor_split": [2, 1], "flash_attn": True})
    assert options["split"] == "tensor" and options["tensor_split"] == [2, 1] and options["flash_attn"] is True
    assert planned_context({"split_mode": 1, "tensor_split": [3, 4]})["split"] == "layer"
    # a layer split's own shares are planned too, as llama.cpp cuts them (tests/test_plan.py)
    assert planned_context({"split_mode": 1, "tensor_split": [3, 4]})["tensor_split"] == [3, 4]
    assert "tensor_split" not in planned_context({"split_mode": 1})

    class FakeLlm:
        model_path = "/models/draft.gguf"

        def n_ctx(self) -> int:
            return 4096

    class FakeDraft:
        llm = FakeLlm()

    options = planned_context({"draft_model": FakeDraft()})
    assert options["draft_model"] == "/models/draft.gguf" and options["draft_ctx"] == 4096 and options["all_logits"]
    assert planned_context({"draft_model": object()}) == {"ubatch": 512, "batch": 512, "all_logits": True}  # prompt lookup


def test_launch_plans_its_draft_model(llama_f32: Path, tmp_path: Path) -> None:
    """`tbrpc launch --draft-model` plans the draft on the head: the head's
    figure launch reports is the plan's with the draft in it."""
    draft = models.ensure("llama")
    want = plan(llama_f32, _cpu_nodes(2), ctx=256, head_device="none", draft_model=draft)
    assert want.head is not None and want.head.draft_bytes > 0
    launch = start_launch(tmp_path, "--gguf", str(llama_f32), "--local", "2", "--ctx", "256", "--draft-model", str(draft),
                          "--draft-tokens", "3", "--prompt", "The capital of France is", "--max-tokens", "4")
    assert launch.finish(timeout=180) == 0, launch.stderr
    assert f"this process keeps {format_size(want.head.total_bytes)})" in launch.stderr, launch.stderr
    assert_gone(launch.node_pids())


@pytest.mark.parametrize("model,split,n_nodes,why,instead", [
    ("deepseek2", "tensor", 2, "refuses architecture 'deepseek2' in tensor mode", "--split layer"),
    ("gemma", "tensor", 2, "one KV head per layer", "--split ffn"),
    ("llama", "tensor", 2, f"cuts blk.0.ffn_down.weight{MORE_FFN_DOWN} along dimension 0", "--split layer"),
    ("llama", "tensor", 4, f"cuts blk.0.ffn_down.weight{MORE_FFN_DOWN} along dimension 0", "--split layer"),
    ("llama", "ffn", 2, "tbrpc's FFN split cuts blk.0.ffn_down.weight", "--split layer"),
])
def test_launch_refuses_split_before_starting_nodes(model: str, split: str, n_nodes: int, why: str, instead: str,
                                                    tmp_path: Path) -> None:
    launch = start_launch(tmp_path, "--gguf", str(models.ensure(model)), "--local", str(n_nodes), "--ctx", "256",
                          "--split", split, "--prompt", "x")
    assert launch.finish(timeout=60) == 1, launch.stderr
    assert "step plan" in launch.stderr and why in launch.stderr and f"use {instead}" in launch.stderr, launch.stderr
    assert "starting" not in launch.stderr and "try: check the model file" not in launch.stderr, launch.stderr


# --- tbrpc's own FFN split (ggml_backend/split_rules.c): deepseek2 -------------------

# cut: every FFN matrix (dense, routed and shared experts) and the output head (by vocabulary)
FFN = re.compile(r"(blk\.\d+\.ffn_(gate|up|down)(_exps|_shexp)?|output)\.weight")


def test_ffn_split_of_deepseek2_bytes() -> None:
    """Only the dense FFN, every routed and shared expert and the output head
    are cut; attention, router, norms and the whole (MLA) KV cache are on
    every node."""
    path = models.ensure("deepseek2-f32")
    model = load_gguf(path)
    ffn = sum(t.n_bytes for t in model.tensors if FFN.fullmatch(t.name))
    rest = sum(t.n_bytes for t in model.tensors if not FFN.fullmatch(t.name) and t.name != "token_embd.weight")
    n_layer = model.get("block_count")
    kv_whole = n_layer * 256 * model.get("attention.key_length") * 2  # one latent row per token and layer, F16
    for n_nodes in (2, 3, 4):
        p = plan(path, _cpu_nodes(n_nodes), ctx=256, split="ffn", head_device="none")
        assert p.fits and p.tensor is not None and p.split_mode == "ffn"
        assert p.tensor.split_bytes == ffn and sum(n.split_bytes for n in p.nodes) == ffn
        assert all(n.replicated_bytes == rest for n in p.nodes)
        assert all(n.kv_bytes == kv_whole for n in p.nodes)
        assert p.tensor.all_reduces_per_token == n_layer  # the FFN's alone
        assert p.tensor.granularity == 1  # F32 weights
    with pytest.raises(PlanError, match="--split ffn"):
        plan(path, _cpu_nodes(2), ctx=256, split="tensor", head_device="none")
    with pytest.raises(PlanError, match="TBRPC nodes only"):
        plan(path, _cpu_nodes(2), ctx=256, split="ffn", head_device="gpu")


def test_ffn_split_of_kimi_shape(tmp_path: Path) -> None:
    """Kimi K2 (headers only, Q4_K experts): 4 x 512 GiB Macs hold it with the
    experts cut in quarters and attention, KV and shared experts on each."""
    from tests.fixtures_shapes import KIMI_K2, deepseek2_spec, write_shape_only

    spec = deepseek2_spec(KIMI_K2, "Kimi K2 (shape only)")
    path = write_shape_only(spec, tmp_path / "Kimi-K2-Q4_K_M.gguf", max_shard_bytes=50 * 10**9)[0]
    p = plan(path, [make_node(f"mac{i}", "512GiB") for i in range(4)], ctx=32768, split="ffn", head_device="none")
    assert p.fits and p.tensor is not None
    ffn = sum(t.n_bytes for t in spec.tensors if FFN.fullmatch(t.name))
    assert sum(n.split_bytes for n in p.nodes) == ffn
    assert p.tensor.granularity == 256  # Q4_K/Q6_K blocks
    assert p.tensor.all_reduces_per_token == 61
    assert all(n.kv_bytes == 61 * 32768 * 576 * 2 for n in p.nodes)  # the whole latent cache on each node


@pytest.mark.parametrize("n_nodes,ctx", [(2, 256), (3, 512), (4, 1024)])
def test_ffn_plan_matches_what_nodes_allocate(n_nodes: int, ctx: int, nodes: Any, tmp_path: Path) -> None:
    """The FFN split loaded through tbrpc's meta device over real nodes.
    Measured: weights and KV exact, compute 172-344 KiB high (1.2-2.5%)."""
    path = models.ensure("deepseek2-f32")
    p = plan(path, _cpu_nodes(n_nodes), ctx=ctx, split="ffn", head_device="none")
    assert p.tensor is not None
    started = nodes(n_nodes)
    result, _ = run_head(tmp_path, model=str(path), prompt="The capital of France is", n_predict=2, flash_attn=True,
                         n_ctx=ctx, nodes=[n.endpoint for n in started], ffn_split=p.tensor.granularity)
    assert result["error"] is None, result["error"]
    for i, (n, allocated) in enumerate(zip(p.nodes, result["allocated_after_load"])):
        planned = n.total_bytes - p.tensor.reduce_buffer_bytes - p.tensor.scratch_bytes[i]
        assert 0 <= planned - allocated <= max(0.03 * allocated, 512 * 1024), (n.name, planned, allocated)


@pytest.mark.parametrize("ctx", [256, 1024])
def test_hybrid_plan_matches_what_nodes_allocate(ctx: int, nodes: Any, tmp_path: Path) -> None:
    """The layer+tensor hybrid (2 groups of 2 nodes, each group one meta device of tbrpc's FFN
    rules, the groups layer-split) loaded over real nodes: each node's allocation is the plan's,
    within the FFN split's bound (weights and KV exact, the compute buffer planned a little high)."""
    path = models.ensure("deepseek2-f32")
    p = plan(path, _cpu_nodes(4), ctx=ctx, split="ffn", groups=2)
    assert p.tensor is not None and p.tensor.groups == 2
    kw = p.llama_kwargs()
    assert kw["tensor_split"] == p.tensor_split and len(p.tensor_split) == 2
    started = nodes(4)
    result, _ = run_head(tmp_path, model=str(path), prompt="The capital of France is", n_predict=2, flash_attn=True,
                         n_ctx=ctx, nodes=[n.endpoint for n in started], ffn_split=p.tensor.granularity,
                         ffn_groups=[[0, 1], [2, 3]], tensor_split=kw["tensor_split"])
    assert result["error"] is None, result["error"]
    for i, (n, allocated) in enumerate(zip(p.nodes, result["allocated_after_load"])):
        planned = n.total_bytes - p.tensor.reduce_buffer_bytes - p.tensor.scratch_bytes[i]
        assert 0 <= planned - allocated <= max(0.03 * allocated, 512 * 1024), (n.name, planned, allocated)
    # each group all-reduces the FFN of the layers the plan gives it, once per decoded token
    for n, node in zip(p.nodes, result["nodes"]):
        first, last = n.layers
        assert node["allreduces"] == (last - first + 1), (n.name, n.layers, node["allreduces"])


def test_hybrid_plan_shape() -> None:
    """Groups of consecutive nodes, each holding its group's layers (the last group the output);
    the FFN cut within a group, the rest of its layers whole; an all-reduce among a group's nodes."""
    path = models.ensure("deepseek2-f32")
    whole = plan(path, _cpu_nodes(4), ctx=256, split="ffn")
    p = plan(path, _cpu_nodes(4), ctx=256, split="ffn", groups=2)
    assert p.tensor is not None and whole.tensor is not None
    assert [n.layers for n in p.nodes][::2] == [p.nodes[1].layers, p.nodes[3].layers]
    assert p.nodes[0].layers[0] == 0 and p.nodes[2].layers[1] == p.n_layers - 1
    assert p.nodes[0].layers[1] + 1 == p.nodes[2].layers[0]
    # every split byte is on some node once per group's share; every node holds less than over all four
    assert p.tensor.split_bytes == whole.tensor.split_bytes
    assert all(h.kv_bytes < w.kv_bytes for h, w in zip(p.nodes, whole.nodes))
    assert p.tensor.copies_per_all_reduce == 2 and whole.tensor.copies_per_all_reduce == 12
    for bad, why in [(dict(groups=3), "4 nodes cannot make 3"), (dict(groups=4), "4 nodes cannot make 4"),
                     (dict(groups=2, split="layer"), "only an ffn split takes groups"),
                     (dict(groups=2, tensor_split=[1, 2, 1, 2]), "it takes no tensor_split")]:
        with pytest.raises(PlanError, match=why):
            plan(path, _cpu_nodes(4), ctx=256, **{"split": "ffn", **bad})
    out = CliRunner().invoke(cli_main, ["plan", "--gguf", str(path), "--nodes", "4x4GiB", "--ctx", "256",
                                        "--split", "ffn", "--groups", "2"])
    assert out.exit_code == 0, out.output
    first, last = p.nodes[0].layers, p.nodes[2].layers
    # too small, the last node smallest: the shortfall names its part of the model in the hybrid's words
    small = [make_node(f"node{i}", "1MiB" if i == 3 else "64MiB", kind="cpu") for i in range(4)]
    short = plan(path, small, ctx=256, split="ffn", groups=2, margin=0)
    assert not short.fits and short.shortfall is not None
    assert f"node3 (layers {last[0]}-{last[1]}, 1/2 of their FFN and experts) needs" in short.shortfall.message
    ffn = plan(path, small, ctx=256, split="ffn", margin=0)   # shares by free memory: node3's is the smallest
    share, total = (f"{x:g}" for x in (ffn.tensor_split[3], sum(ffn.tensor_split)))
    assert ffn.shortfall is not None and f"node3 ({share}/{total} of every FFN and expert) needs" in ffn.shortfall.message
    assert f"node0   {first[0]}-{first[1]}, 1/2" in out.output and f"node3   {last[0]}-{last[1]}, 1/2" in out.output
    assert "hybrid        2 groups of 2 consecutive nodes, layer-split" in out.output
    assert ("library           metas = [tbrpc.cluster().ffn_split_device(endpoints[i:i + 2], [1, 1], "
            f"{p.tensor.granularity}) for i in range(0, 4, 2)]; Llama(devices=metas, split_mode=1, "
            f"tensor_split={[int(x) for x in p.tensor_split]}") in out.output
    out = CliRunner().invoke(cli_main, ["plan", "--gguf", str(path), "--nodes", "4x4GiB", "--groups", "2"])
    assert out.exit_code == 1 and "only an ffn split takes groups" in out.output
    # launch and tbrpc.Llama refuse the same before any node starts, with the planner's words alone
    with pytest.raises(TbrpcError) as refused:
        check_split(path, "ffn", 4, {}, 3)
    assert str(refused.value) == ("step plan: groups: the hybrid is an ffn split over groups of 2 or more nodes each, "
                                  "as many nodes in every group; 4 nodes cannot make 3 such groups")


def test_the_page_shows_each_nodes_share_of_a_tensor_split(llama_f32: Path, tmp_path: Path) -> None:
    with start_launch(tmp_path, "--gguf", str(llama_f32), "--local", "2", "--ctx", "256", "--split", "tensor",
                      "--port", "0") as launch:
        root = launch.http_base().removesuffix("/v1")
        status = http_json(f"{root}/tbrpc/status.json")
        assert [n["share"] for n in status["nodes"]] == ["1/2 of every layer"] * 2, status["nodes"]
        launch.proc.send_signal(signal.SIGINT)
        assert launch.finish() == 0, launch.stderr


def test_the_page_shows_each_nodes_part_of_the_hybrid(tmp_path: Path) -> None:
    model = models.ensure("deepseek2-f32")
    p = plan(model, _cpu_nodes(4), ctx=256, split="ffn", groups=2)
    first, last = p.nodes[0].layers, p.nodes[2].layers
    with start_launch(tmp_path, "--gguf", str(model), "--local", "4", "--ctx", "256", "--split", "ffn",
                      "--groups", "2", "--port", "0") as launch:
        root = launch.http_base().removesuffix("/v1")
        status = http_json(f"{root}/tbrpc/status.json")
        assert [n["share"] for n in status["nodes"]] == [f"layers {first[0]}-{first[1]}, 1/2 of their FFN and experts"] * 2 + [
            f"layers {last[0]}-{last[1]}, 1/2 of their FFN and experts"] * 2, status["nodes"]
        launch.proc.send_signal(signal.SIGINT)
        assert launch.finish() == 0, launch.stderr


@pytest.mark.parametrize("n_nodes", [2, 4])
def test_one_block_wide_cut_refused(n_nodes: int) -> None:
    """The quantized tiny llama's ffn_down (Q4_K, 256 wide: one block per row)
    is cut by rows in whole blocks, so all but one node get none of it, and
    llama.cpp's meta buffer aborts the load on such a slice (its row stride
    is not rescaled: test_tensor_split.py::test_llamas_own_tensor_split_still_aborts).
    The planner refuses it before anything loads, naming the tensor and the
    layer split (tbrpc's FFN split cuts the same tensor the same way)."""
    path = models.ensure("llama")
    with pytest.raises(TensorSplitError) as refused:
        plan(path, _cpu_nodes(n_nodes), ctx=256, split="tensor", head_device="none", margin=0)
    assert str(refused.value) == (
        "tensor split: llama.cpp's tensor split " + ONE_BLOCK.format(n=n_nodes) + " (a slice one block wide keeps the "
        "full row stride, so the upload writes past an empty slice: ggml-backend.cpp:382, tensor write out of bounds); "
        "use --split layer")
    with pytest.raises(TensorSplitError, match=r"^ffn split: tbrpc's FFN split cuts blk\.0\.ffn_down\.weight.*use --split layer$"):
        plan(path, _cpu_nodes(n_nodes), ctx=256, split="ffn", head_device="none")
    result = CliRunner().invoke(cli_main, ["plan", "--gguf", str(path), "--nodes", f"{n_nodes}x4GiB", "--split", "tensor",
                                           "--head-device", "none", "--margin", "0"])
    assert result.exit_code == 1 and ONE_BLOCK.format(n=n_nodes) in " ".join(result.output.split()), result.output
    assert "FITS" not in result.output
    assert plan(path, _cpu_nodes(n_nodes), ctx=256, head_device="none").fits   # the layer split is unchanged
    assert plan(path, _cpu_nodes(1), ctx=256, split="tensor", head_device="none").fits   # one node: nothing is cut
    # F32: an ffn_down row is 256 one-value blocks, cut in 128s; an empty slice's row stride is rescaled to 0
    f32 = plan(models.ensure("llama-f32"), _cpu_nodes(n_nodes), ctx=256, split="tensor", head_device="none", margin=0)
    assert f32.fits and f32.split_mode == "tensor"


def test_an_ffn_split_over_one_node_is_refused() -> None:
    """tbrpc's FFN split is a meta device of 2 to 16 nodes (split_rules.c): over one node (or a
    hybrid group of one) the planner refuses it, and tbrpc.Llama does before any node starts, where
    the plan fitted and the load then failed with a bare ValueError from the meta device."""
    path = models.ensure("gemma")
    with pytest.raises(TensorSplitError, match=r"^ffn split: tbrpc's FFN split cuts the FFN across 2 to 16 nodes, not 1; "
                                               r"use --split layer$"):
        plan(path, _cpu_nodes(1), ctx=256, split="ffn", head_device="none")
    with pytest.raises(TbrpcError, match=r"^step plan: ffn split: .* not 1; use --split layer$"):
        check_split(path, "ffn", 1, {})   # tbrpc.Llama and launch, before any node starts
    assert plan(path, _cpu_nodes(2), ctx=256, split="ffn", head_device="none").fits


def test_one_kv_head_refused_in_tensor_mode() -> None:
    """Gemma 3 270M has one KV head per layer: llama.cpp's tensor split cuts
    attention by whole KV heads, so one node would get all of it, and its meta
    device aborts the process on such a model at the first generated token.
    The planner refuses it with that reason instead, before anything loads."""
    path = models.ensure("gemma")
    with pytest.raises(TensorSplitError, match=r"one KV head per layer.*aborts.*; use --split ffn \(tbrpc's own split"):
        plan(path, _cpu_nodes(2), ctx=256, split="tensor", head_device="none")
    result = CliRunner().invoke(cli_main, ["plan", "--gguf", str(path), "--nodes", "2x4GiB", "--split", "tensor"])
    assert result.exit_code != 0 and "one KV head" in result.output and "use --split ffn" in result.output
    assert plan(path, _cpu_nodes(2), ctx=256, split="ffn", head_device="none").fits   # what it advises plans
    assert plan(path, _cpu_nodes(2), ctx=256, head_device="none").fits   # the layer split is unchanged
    # two KV heads (the tiny llama) are cut, one whole head per node
    assert plan(models.ensure("llama-f32"), _cpu_nodes(2), ctx=256, split="tensor", head_device="none").fits


@pytest.mark.parametrize("how", [{"split": "tensor"}, {"split_mode": 3}, {"split": "ffn"}])
def test_llama_refuses_split_before_starting_nodes(how: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """tbrpc.Llama refuses the quantized tiny llama's tensor or FFN split (llama.cpp
    aborts loading it) as launch does: from the file's header, before any node starts."""
    import tbrpc.llama

    monkeypatch.setattr(tbrpc.llama, "start_nodes", lambda *args, **kwargs: pytest.fail("nodes started"))
    with pytest.raises(TbrpcError) as refused:
        tbrpc.llama.Llama(str(models.ensure("llama")), cluster=4, **how)
    mode = "ffn split: tbrpc's FFN split" if how.get("split") == "ffn" else "tensor split: llama.cpp's tensor split"
    assert str(refused.value).startswith(f"step plan: {mode} cuts blk.0.ffn_down.weight"), refused.value
    assert "over 4 nodes all but one of them get none of it" in str(refused.value)
    assert str(refused.value).endswith("use --split layer")
