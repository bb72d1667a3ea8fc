"""The split planner: exact where the file says everything, calibrated where it does not.

Trillion-scale tests use shape-only fixtures (tests/fixtures_shapes.py) that
are written into pytest's tmp dirs as sparse files: real headers, data holes.
Calibration tests ask llama.cpp itself (tests/llama_alloc_probe.py) and hold
the planner to within 5% or 64 MiB, whichever is larger, per device.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner
from gguf import GGMLQuantizationType as QT
import models
from helpers import free_port

from tbrpc import defaults
from tbrpc.cli import main as cli_main
from tbrpc.gguf_model import GGUFError, arch_params, load_gguf, weight_layout
from tbrpc.node_memory import make_node, nodes_from_flags
from tbrpc.plan import ContextParams, Plan, PlanError, compute_bytes, layer_macs, llama_layer_devices, plan
from tbrpc.units import GiB, MiB, format_size
from tests.fixtures_shapes import (
    DEEPSEEK_V3,
    KIMI_K2,
    Deepseek2Geometry,
    Gemma3Geometry,
    LlamaGeometry,
    ModelSpec,
    deepseek2_spec,
    gemma3_spec,
    llama_spec,
    write_shape_only,
)

SHARD = 50 * 10**9  # the 50 GB shards model hubs use


@pytest.fixture(scope="module")
def kimi(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModelSpec, list[Path]]:
    spec = deepseek2_spec(KIMI_K2, "Kimi K2 (shape only)")
    d = tmp_path_factory.mktemp("kimi")
    return spec, write_shape_only(spec, d / "Kimi-K2-Q4_K_M.gguf", max_shard_bytes=SHARD, vocab_strings=KIMI_K2.n_vocab)


@pytest.fixture(scope="module")
def dsv3(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModelSpec, list[Path]]:
    spec = deepseek2_spec(DEEPSEEK_V3, "DeepSeek V3 (shape only)")
    d = tmp_path_factory.mktemp("dsv3")
    return spec, write_shape_only(spec, d / "DeepSeek-V3-Q4_K_M.gguf", max_shard_bytes=SHARD)


# --- reading the model ----------------------------------------------------------


def test_sparse_fixture_uses_no_disk(kimi: tuple[ModelSpec, list[Path]]) -> None:
    _, paths = kimi
    apparent = sum(p.stat().st_size for p in paths)
    on_disk = sum(p.stat().st_blocks * 512 for p in paths)
    assert apparent > 600 * 10**9
    assert on_disk < 64 * MiB


def test_kimi_weights_are_exact_from_any_shard(kimi: tuple[ModelSpec, list[Path]]) -> None:
    spec, paths = kimi
    assert len(paths) == 13
    model = load_gguf(paths[6])  # any shard finds the whole set
    assert [s.path for s in model.shards] == paths
    assert model.weights_bytes == spec.weights_bytes
    assert 570 * GiB < model.weights_bytes < 590 * GiB  # "about 580 GiB" at Q4_K_M
    by_name = {t.name: t for t in spec.tensors}
    for t in model.tensors:
        assert t.n_bytes == by_name[t.name].n_bytes
        assert t.shape == by_name[t.name].ne
    # offsets: each tensor's data lies inside its own shard, in order, aligned
    for shard_index, shard in enumerate(model.shards):
        mine = [t for t in model.tensors if t.shard == shard_index]
        assert mine and all(t.offset % 32 == 0 for t in mine)
        assert all(a.offset + a.n_bytes <= b.offset for a, b in zip(mine, mine[1:]))
        assert mine[-1].offset + mine[-1].n_bytes <= shard.file_size


def test_layers_report_experts_separately(kimi: tuple[ModelSpec, list[Path]]) -> None:
    spec, paths = kimi
    model = load_gguf(paths[0])
    params = arch_params(model)
    layout = weight_layout(model, params)
    g = KIMI_K2
    assert (params.n_layer, params.n_expert, params.n_embd, params.is_mla) == (61, 384, 7168, True)
    dense = layout.layers[0]
    assert dense.routed_experts == 0 and dense.shared_experts == 0
    moe = layout.layers[30]
    q4k_expert = g.n_embd * g.n_ff_exp // 256 * 144  # one Q4_K expert matrix
    assert moe.routed_experts >= 3 * g.n_expert * q4k_expert
    assert moe.shared_experts > 0 and moe.dense > 0
    assert sum(lw.total for lw in layout.layers) + layout.input_bytes + layout.output_bytes == spec.weights_bytes
    assert not layout.output_tied


def test_missing_and_mismatched_shards(tmp_path: Path) -> None:
    spec = llama_spec(LlamaGeometry(n_layer=4, n_embd=256, n_vocab=1024, n_head=4, n_head_kv=2, n_ff=512))
    paths = write_shape_only(spec, tmp_path / "m.gguf", max_shard_bytes=spec.weights_bytes // 3)
    assert len(paths) >= 3
    assert load_gguf(paths[-1]).weights_bytes == spec.weights_bytes
    paths[1].rename(tmp_path / "elsewhere.gguf")
    with pytest.raises(GGUFError, match="missing 1 of"):
        load_gguf(paths[0])
    # a shard of another split set under the right name
    other = write_shape_only(llama_spec(LlamaGeometry(n_layer=2, n_embd=256, n_vocab=1024, n_head=4, n_head_kv=2, n_ff=512)),
                             tmp_path / "other.gguf", max_shard_bytes=1)  # fmt: skip
    os.replace(other[0], paths[1])
    with pytest.raises(GGUFError, match="split"):
        load_gguf(paths[0])


def test_not_a_gguf(tmp_path: Path) -> None:
    bogus = tmp_path / "x.gguf"
    bogus.write_bytes(b"GGML" + b"\0" * 100)
    with pytest.raises(GGUFError, match="magic"):
        load_gguf(bogus)


# --- verdicts at trillion scale -----------------------------------------------------


def test_kimi_verdicts_at_32k(kimi: tuple[ModelSpec, list[Path]]) -> None:
    _, paths = kimi
    four = plan(paths[0], nodes_from_flags([], "4x512GiB"), ctx=32768)
    two = plan(paths[0], nodes_from_flags([], "2x512GiB"), ctx=32768)
    one = plan(paths[0], nodes_from_flags([], "1x512GiB"), ctx=32768)
    assert four.fits and two.fits and not one.fits
    for p in (four, two):
        _assert_consistent(p)
    assert one.shortfall is not None
    assert one.shortfall.over_bytes > 190 * GiB
    assert one.shortfall.max_ctx is None  # the weights alone exceed the Metal limit
    assert one.shortfall.min_nodes == 2
    assert "over by" in one.shortfall.message and "node0" in one.shortfall.message


def test_the_library_plans_what_launch_loads(kimi: tuple[ModelSpec, list[Path]]) -> None:
    """plan() without head_device plans the head `tbrpc plan`, launch and tbrpc.Llama use: no layers
    on the head, every layer on a node."""
    _, paths = kimi
    p = plan(paths[0], nodes_from_flags([], "4x512GiB"), ctx=4096)
    assert p.head_device == defaults.HEAD_DEVICE == "none"
    assert p.head is not None and p.nodes[0].layers[0] == 0


def test_kv_cache_is_mla_latent(kimi: tuple[ModelSpec, list[Path]]) -> None:
    _, paths = kimi
    p = plan(paths[0], nodes_from_flags([], "4x512GiB"), ctx=32768)
    # K only: (kv_lora_rank + rope) = 576 F16 values per token and layer
    assert sum(n.kv_bytes for n in p.nodes) == 61 * 32768 * 576 * 2


def test_dsv3_two_nodes_and_largest_context(dsv3: tuple[ModelSpec, list[Path]]) -> None:
    spec, paths = dsv3
    model = load_gguf(paths[0])
    assert model.weights_bytes == spec.weights_bytes
    assert plan(model, nodes_from_flags([], "2x512GiB"), ctx=32768).fits
    tight = [make_node("small", "512GiB", usable_memory="385GiB")]
    p = plan(model, tight, ctx=131072)
    assert not p.fits and p.shortfall is not None
    best = p.shortfall.max_ctx
    assert best is not None and best % 256 == 0 and best < 131072
    assert plan(model, tight, ctx=best).fits
    assert not plan(model, tight, ctx=best + 256).fits


def test_heterogeneous_nodes_are_loaded_in_proportion(kimi: tuple[ModelSpec, list[Path]]) -> None:
    _, paths = kimi
    nodes = [make_node("head", "256GiB"), make_node("big", "512GiB"), make_node("mid", "384GiB")]
    p = plan(paths[0], nodes, ctx=16384)
    assert p.fits
    _assert_consistent(p)
    share = [n.total_bytes / n.usable_bytes for n in p.nodes]
    assert max(share) - min(share) < 0.06  # balanced to within about a layer
    assert p.nodes[1].n_layers > p.nodes[2].n_layers > p.nodes[0].n_layers


def _assert_consistent(p: Plan) -> None:
    ranges = [n.layers for n in p.nodes]
    assert ranges[0] is not None and ranges[0][0] == 0
    assert all(a is not None and b is not None and a[1] + 1 == b[0] for a, b in zip(ranges, ranges[1:]))
    assert ranges[-1] is not None and ranges[-1][1] == p.n_layers - 1
    for n in p.nodes:
        assert n.total_bytes == n.weights_bytes + n.kv_bytes + n.compute_bytes + n.host_bytes
        assert n.headroom_bytes == n.usable_bytes - p.margin_bytes - n.total_bytes
        assert n.shards
    assert llama_layer_devices(p.tensor_split, p.n_layers, p.n_gpu_layers) == _planned_devices(p)


# --- tensor_split reproduces the ranges exactly ------------------------------------------


def _planned_devices(p: Plan) -> list[int]:
    offset = -1 if p.head_device == "cpu" else 0
    devices = []
    for index, n in enumerate(p.nodes):
        assert n.layers is not None
        devices += [index + offset] * (n.layers[1] - n.layers[0] + 1)
    return devices + [len(p.nodes) - 1 + offset]  # the output layer goes with the last layer


@pytest.mark.parametrize("head_device", ["gpu", "cpu"])
def test_tensor_split_reproduces_ranges(kimi: tuple[ModelSpec, list[Path]], head_device: str) -> None:
    _, paths = kimi
    model = load_gguf(paths[0])
    rng = np.random.default_rng(7)
    for _ in range(10):
        sizes = rng.integers(150, 520, size=int(rng.integers(2, 7)))
        nodes = [make_node(f"n{i}", f"{s}GiB", kind="cpu") for i, s in enumerate(sizes)]
        p = plan(model, nodes, ctx=4096, head_device=head_device)
        _assert_consistent(p)


# --- a layer split's balance: prefill compute when it fits, else memory ---------------------


@pytest.fixture(scope="module")
def gemma_path() -> Path:
    gemma = pytest.importorskip("models.gemma")
    try:
        return Path(gemma.path())
    except gemma.GemmaUnavailable as exc:
        pytest.skip(str(exc))


def _layer_macs(path: Path) -> list[int]:
    model = load_gguf(path)
    params = arch_params(model)
    return layer_macs(model, params, weight_layout(model, params))


def _cpu_nodes(n: int, size: int | str) -> list[Any]:
    return [make_node(f"n{i}", size, kind="cpu") for i in range(n)]


def test_layer_macs_from_the_shapes(kimi: tuple[ModelSpec, list[Path]]) -> None:
    """Kimi K2's prefill multiply-adds per token: every matrix of a layer, routed experts at 8 of 384."""
    _, paths = kimi
    g = KIMI_K2
    attention = (g.n_embd * g.q_lora_rank + g.q_lora_rank * g.n_head * (g.qk_nope + g.qk_rope)
                 + g.n_embd * (g.kv_lora_rank + g.qk_rope) + g.qk_nope * g.kv_lora_rank * g.n_head
                 + g.kv_lora_rank * g.v_head * g.n_head + g.n_head * g.v_head * g.n_embd)  # fmt: skip
    dense = attention + 3 * g.n_embd * g.n_ff
    moe = (attention + g.n_embd * g.n_expert  # the router
           + 3 * g.n_embd * g.n_ff_exp * g.n_expert_used + 3 * g.n_embd * g.n_ff_exp * g.n_expert_shared)
    macs = _layer_macs(paths[0])
    assert g.n_dense_lead == 1 and len(macs) == 61
    assert macs == [dense] + [moe] * 60


@pytest.mark.parametrize("head_device", ["none", "gpu", "cpu"])
def test_gemma_layers_balanced_by_compute(gemma_path: Path, head_device: str) -> None:
    """Gemma 3 270M over 2 and 4 equal nodes with room to spare: equal layer counts (its 18
    layers have one shape), where balancing memory gives the last node (its tied output
    and 512 MiB of logits) almost nothing."""
    macs = _layer_macs(gemma_path)
    assert len(macs) == 18 and len(set(macs)) == 1 and macs[0] > 0
    two = plan(gemma_path, _cpu_nodes(2, "8GiB"), ctx=1024, head_device=head_device)
    assert two.fits and two.balance == "compute"
    assert [n.layers for n in two.nodes] == [(0, 8), (9, 17)]
    assert two.notes[0] == ("layers balanced by compute (prefill pipelines through the nodes): prefill multiply-adds "
                            "per node 50%/50%, nodes taken as equally fast")
    _assert_consistent(two)
    four = plan(gemma_path, _cpu_nodes(4, "8GiB"), ctx=1024, head_device=head_device)
    assert four.fits and four.balance == "compute"
    assert max(n.n_layers for n in four.nodes) == 5  # ceil(18 / 4)
    _assert_consistent(four)
    if head_device == "none":
        # Among the splits with at most 5 layers a node, the most even in memory: the
        # last node, with the output copy and the logits, gets the fewest.
        assert [n.layers for n in four.nodes] == [(0, 4), (5, 9), (10, 14), (15, 17)]
        old = plan(gemma_path, _cpu_nodes(2, "8GiB"), ctx=1024, head_device=head_device, balance="memory")
        assert old.balance == "memory" and [n.layers for n in old.nodes] == [(0, 16), (17, 17)]
        assert old.notes[0].startswith("layers balanced by memory: as asked (balance='memory'); "
                                       "prefill multiply-adds per node 94%/6%")
    else:
        # The head holds the embeddings and the 512 MiB score array: it gets the fewest.
        assert [n.layers for n in four.nodes] == [(0, 2), (3, 7), (8, 12), (13, 17)]


def test_every_token_s_logits_are_prefill_work(gemma_path: Path) -> None:
    """With all logits kept (a draft model), the last node computes every prompt token's
    logits: Gemma's output matrix (262144 x 640) outweighs all 18 layers, so it keeps one."""
    macs = _layer_macs(gemma_path)
    params = arch_params(load_gguf(gemma_path))
    assert params.n_vocab * params.n_embd > sum(macs)
    p = plan(gemma_path, _cpu_nodes(2, "8GiB"), ctx=1024, head_device="none", all_logits=True)
    assert p.balance == "compute" and [n.layers for n in p.nodes] == [(0, 16), (17, 17)]


@pytest.mark.parametrize("head_device,draft", [("none", False), ("gpu", False), ("gpu", True)])
def test_memory_balance_when_compute_balance_does_not_fit(gemma_path: Path, head_device: str, draft: bool) -> None:
    """Nodes large enough for the memory-balanced ranges but not for the compute-balanced
    ones: the plan is the memory-balanced one, and it fits.  With a draft model the head
    (node 0) carries it too, and the compute-balanced ranges must count it."""
    kwargs: dict[str, Any] = dict(ctx=1024, head_device=head_device, margin=0,
                                  draft_model=gemma_path if draft else None)  # fmt: skip
    by_compute = plan(gemma_path, _cpu_nodes(2, "8GiB"), **kwargs)
    by_memory = plan(gemma_path, _cpu_nodes(2, "8GiB"), balance="memory", **kwargs)
    assert by_compute.balance == "compute" and by_memory.balance == "memory"
    need_compute = max(n.total_bytes for n in by_compute.nodes)
    need_memory = max(n.total_bytes for n in by_memory.nodes)
    assert need_memory < need_compute - 2 * MiB
    size = (need_memory + need_compute) // 2
    p = plan(gemma_path, _cpu_nodes(2, size), **kwargs)
    assert p.fits and p.balance == "memory"
    assert [n.layers for n in p.nodes] == [n.layers for n in by_memory.nodes] != [n.layers for n in by_compute.nodes]
    assert p.notes[0].startswith("layers balanced by memory: the compute-balanced ranges do not fit; ")
    assert p.to_json()["balance"] == "memory"


def test_kimi_over_four_nodes_balanced_by_compute(kimi: tuple[ModelSpec, list[Path]]) -> None:
    """Kimi K2 over 4 x 512 GiB: 61 layers of almost equal compute (the dense layer 0 is
    0.5% lighter than an expert layer) give 16 to one node and 15 to the others; of those
    splits the most even in memory gives the 16th to the head, whose layer 0 is light in
    weights (a dense FFN rather than 384 experts)."""
    _, paths = kimi
    p = plan(paths[0], nodes_from_flags([], "4x512GiB"), ctx=32768)
    assert p.fits and p.balance == "compute"
    assert [n.layers for n in p.nodes] == [(0, 15), (16, 30), (31, 45), (46, 60)]
    assert p.tensor_split == [16, 15, 15, 16]
    _assert_consistent(p)


@pytest.mark.parametrize("head_device", ["none", "gpu"])
def test_a_given_layer_tensor_split_is_planned_as_llama_cpp_cuts_it(gemma_path: Path, head_device: str) -> None:
    """A caller's own shares for a layer split (tbrpc.Llama(tensor_split=...), `tbrpc plan --tensor-split`)
    are planned as llama.cpp will cut them, not replaced by the planner's: the ranges follow its rule,
    the fit is checked on them, and the plan says so."""
    nodes = _cpu_nodes(2, "8GiB")
    p = plan(gemma_path, nodes, ctx=1024, head_device=head_device, tensor_split=[1, 8])
    assert p.balance == "given" and p.fits
    devices = llama_layer_devices([1, 8], p.n_layers, p.n_layers + 1)
    assert [n.layers for n in p.nodes] == [(0, devices.index(1) - 1), (devices.index(1), p.n_layers - 1)]
    assert [n.layers for n in p.nodes] == [(0, 2), (3, 17)]   # 19 layers with the output: 3/19 < 1/9 <= 4/19
    assert p.notes[0].startswith("layers as the given tensor_split puts them"), p.notes
    _assert_consistent(p)
    planned = plan(gemma_path, nodes, ctx=1024, head_device=head_device)
    assert planned.balance == "compute" and [n.layers for n in planned.nodes] != [n.layers for n in p.nodes]
    # a node the shares leave without a layer, or shares of the wrong length: said, not planned
    with pytest.raises(PlanError, match=r"gives node 0 no layer"):
        plan(gemma_path, nodes, ctx=1024, head_device=head_device, tensor_split=[0, 8])
    with pytest.raises(PlanError, match=r"tensor_split needs 2 non-negative shares"):
        plan(gemma_path, nodes, ctx=1024, head_device=head_device, tensor_split=[1, 1, 1])


def test_plan_cli_takes_a_layer_tensor_split(gemma_path: Path) -> None:
    out = CliRunner().invoke(cli_main, ["plan", "--gguf", str(gemma_path), "--nodes", "2x8GiB", "--ctx", "1024",
                                        "--head-device", "none", "--tensor-split", "1,8", "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    assert data["balance"] == "given" and [n["layers"] for n in data["nodes"]] == [[0, 2], [3, 17]]


@pytest.mark.parametrize("ubatch,batch,planned", [(256, None, (256, 512)), (1024, None, (1024, 1024)),
                                                   (256, 128, (256, 128))])
def test_plan_and_launch_take_one_batch_for_a_ubatch(gemma_path: Path, ubatch: int, batch: int | None,
                                                    planned: tuple[int, int]) -> None:
    """`tbrpc plan --ubatch` plans the n_batch `tbrpc launch --ubatch` loads: llama-cpp-python's 512,
    or the ubatch when larger (llama.cpp caps n_ubatch at n_batch, so --ubatch 1024 alone would load
    512). The host's score array is n_batch rows of the vocabulary, so a batch planned as the ubatch
    (256) under-counted what launch's 512 allocate."""
    from tbrpc.llama import context_kwargs, planned_context

    args = ["--ubatch", str(ubatch)] + (["--batch", str(batch)] if batch else [])
    out = CliRunner().invoke(cli_main, ["plan", "--gguf", str(gemma_path), "--nodes", "2x8GiB", "--ctx", "1024",
                                        "--json", *args])
    assert out.exit_code == 0, out.output
    context = json.loads(out.output)["context"]
    assert (context["ubatch"], context["batch"]) == planned
    loaded = context_kwargs(ubatch=ubatch, batch=batch)   # what launch gives llama_cpp.Llama
    assert (loaded["n_ubatch"], loaded["n_batch"]) == planned
    assert (planned_context(loaded)["ubatch"], planned_context(loaded)["batch"]) == planned


# --- other architectures ----------------------------------------------------------


def test_gemma3_sliding_window_cache(tmp_path: Path) -> None:
    path = write_shape_only(gemma3_spec(Gemma3Geometry()), tmp_path / "g.gguf")[0]
    nodes = [make_node("a", "8GiB", kind="cpu")]
    full = plan(path, nodes, ctx=32768)
    windowed = plan(path, nodes, ctx=32768, swa_full=False)
    per_layer = 32768 * 256 * 2 * 2  # K + V, one KV head of 256, F16
    assert full.nodes[0].kv_bytes == 18 * per_layer
    # 15 sliding layers keep pad(512 + 512, 256) = 1024 cells; 3 global layers keep all
    assert windowed.nodes[0].kv_bytes == 3 * per_layer + 15 * 1024 * 256 * 2 * 2
    assert any("output layer is tied" in note for note in full.notes)


def test_quantized_cache_types(tmp_path: Path) -> None:
    path = write_shape_only(llama_spec(LlamaGeometry()), tmp_path / "l.gguf")[0]
    nodes = [make_node("a", "64GiB", kind="cpu")]
    f16 = plan(path, nodes, ctx=8192)
    q8 = plan(path, nodes, ctx=8192, cache_type_k="q8_0", cache_type_v="q8_0")
    assert q8.context.flash_attn  # a quantized V cache needs flash attention
    assert q8.nodes[0].kv_bytes * 64 == f16.nodes[0].kv_bytes * 34  # Q8_0: 34 bytes per 32 values
    with pytest.raises(PlanError, match="flash attention"):
        plan(path, nodes, ctx=8192, cache_type_v="q4_0", flash_attn=False)
    with pytest.raises(PlanError, match="unknown cache type"):
        plan(path, nodes, ctx=8192, cache_type_k="q9_9")


def test_mtp_blocks_are_not_loaded(tmp_path: Path) -> None:
    g = Deepseek2Geometry(n_layer=6, n_embd=1024, n_vocab=4096, n_head=8, q_lora_rank=512, n_ff=2048, n_ff_exp=512,
                          n_expert=16, n_expert_used=2, n_nextn=1)  # fmt: skip
    spec = deepseek2_spec(g)
    path = write_shape_only(spec, tmp_path / "mtp.gguf")[0]
    model = load_gguf(path)
    layout = weight_layout(model, arch_params(model))
    assert not layout.layers[6].loaded and layout.layers[5].loaded
    p = plan(model, [make_node("a", "64GiB", kind="cpu")], ctx=4096)
    mtp_bytes = layout.layers[6].total
    assert p.nodes[0].weights_bytes < spec.weights_bytes - mtp_bytes + 64 * 1024
    assert p.n_layers == 7  # llama.cpp still counts the block when splitting


# --- CLI ----------------------------------------------------------------------------


def test_cli_json_and_exit_codes(kimi: tuple[ModelSpec, list[Path]], tmp_path: Path) -> None:
    _, paths = kimi
    runner = CliRunner()
    ok = runner.invoke(cli_main, ["plan", "--gguf", str(paths[2]), "--nodes", "4x512GiB", "--ctx", "32768", "--json"])
    assert ok.exit_code == 0, ok.output
    data = json.loads(ok.output)
    assert data["fits"] is True and data["ctx"] == 32768
    assert data["model"]["architecture"] == "deepseek2" and data["model"]["n_layers"] == 61
    assert len(data["model"]["shards"]) == 13
    assert sum(data["tensor_split"]) == 62
    for node in data["nodes"]:
        for key in ("name", "usable_bytes", "layers", "weights_bytes", "kv_bytes", "compute_bytes", "total_bytes", "headroom_bytes", "shards"):
            assert key in node
    cluster = tmp_path / "c.toml"
    cluster.write_text('[[node]]\nname = "solo"\nhost = "h"\nport = 1\nmemory = "512GiB"\n')
    bad = runner.invoke(cli_main, ["plan", "--gguf", str(paths[0]), "--cluster", str(cluster)])
    assert bad.exit_code == 1
    assert "DOES NOT FIT" in bad.output and "over by" in bad.output and "smallest cluster that fits" in bad.output
    table = runner.invoke(cli_main, ["plan", "--gguf", str(paths[0]), "--node", "a=512GiB", "--node", "b=512GiB", "--ctx", "32768"])
    assert table.exit_code == 0 and "FITS" in table.output and "GiB" in table.output and "-ts 31,31" in table.output
    metal = "command line (Metal wired limit assumed 75% of RAM (macOS default); raise iogpu.wired_limit_mb to use more)"
    assert _usable_section(table.output) == [f"  a  384.0 GiB  {metal}", f"  b  384.0 GiB  {metal}"]
    assert "note: layers balanced by compute (prefill pipelines through the nodes): prefill multiply-adds per node 51%/49%" in table.output
    assert data["balance"] == "compute" and data["notes"][0].startswith("layers balanced by compute")
    assert [(n["memory_from"], n["reported_bytes"]) for n in data["nodes"]] == [("command line", None)] * 4


# --- memory from the nodes themselves -------------------------------------------------


def _reported(endpoint: str) -> tuple[str, int, int]:
    """(device, free, total) as the node reports them at HELLO."""
    from tbrpc import probe

    info, _ = probe(endpoint)
    return info.node_device, info.mem_free, info.mem_total


def _plan_cli(*args: str) -> Any:
    return CliRunner().invoke(cli_main, ["plan", "--gguf", str(_real_model("llama")), "--ctx", "512", "--margin", "0",
                                         *args])


def test_plan_of_a_ring_cluster_file_says_its_all_reduce(tmp_path: Path) -> None:
    """`tbrpc plan --split tensor` over a cluster file cabled as a ring plans the ring all-reduce,
    the one the head will run (the same rule, client.c); the same nodes without `links`, the mesh."""
    def write(links: bool) -> Path:
        names = ["s1", "s2", "s3", "s4"]
        text = ""
        for i, name in enumerate(names):
            prev, nxt = names[i - 1], names[(i + 1) % 4]
            text += (f'[[node]]\nname = "{name}"\nhost = "10.9.0.{i + 1}"\nport = 50052\nmemory = "4GiB"\nkind = "cpu"\n'
                     + (f'links = {{ {prev} = "10.0.{i}.2", {nxt} = "10.0.{i}.1" }}\n' if links else "") + "\n")
        path = tmp_path / f"ring-{links}.toml"
        path.write_text(text)
        return path

    for links, shape in ((True, "ring"), (False, "mesh")):
        out = CliRunner().invoke(cli_main, ["plan", "--gguf", str(_real_model("llama-f32")), "--ctx", "256",
                                            "--margin", "0", "--split", "tensor", "--head-device", "none",
                                            "--cluster", str(write(links)), "--offline", "--json"], env={"TBRPC_ALLREDUCE": ""})
        assert out.exit_code == 0, out.output
        assert json.loads(out.output)["tensor"]["all_reduce_shape"] == shape


def _usable_section(output: str) -> list[str]:
    lines = output.splitlines()
    start = lines.index("usable memory:") + 1
    return lines[start:lines.index("", start)]


def test_plan_asks_nodes_without_memory(nodes: Any, tmp_path: Path) -> None:
    """No `memory`: the node's own figure, shared by the nodes on one machine; `memory` below it: a cap."""
    a, b = nodes(2)
    device, free, total = _reported(a.endpoint)
    assert _reported(b.endpoint) == (device, free, total)   # one machine, one device
    share = (min(free, total) or total) // 2
    assert share > GiB
    cluster = tmp_path / "c.toml"
    cluster.write_text(f'[[node]]\nname = "a"\nhost = "127.0.0.1"\nport = {a.port}\n\n'
                       f'[[node]]\nname = "b"\nhost = "127.0.0.1"\nport = {b.port}\nmemory = "1GiB"\nkind = "cpu"\n')
    out = _plan_cli("--cluster", str(cluster), "--json")
    assert out.exit_code == 0, out.output
    na, nb = json.loads(out.output)["nodes"]
    assert (na["usable_bytes"], na["memory_from"], na["reported_bytes"]) == (share, "node", share)
    assert (nb["usable_bytes"], nb["memory_from"], nb["reported_bytes"]) == (GiB, "cluster file", share)

    out = _plan_cli("--cluster", str(cluster))
    assert out.exit_code == 0, out.output
    size = format_size(share)
    assert _usable_section(out.output) == [
        f"  a  {size}  reported by the node ({device}, {format_size(free)} free of {format_size(total)}), "
        "shared by the 2 nodes on this machine",
        f"  b  {format_size(GiB).rjust(len(size))}  cluster file (CPU node: all RAM), below the node's {size} share "
        f"of the {format_size(min(free, total) or total)} free the 2 nodes on this machine report",
    ]


def test_plan_caps_and_nodes_that_are_down(nodes: Any, tmp_path: Path) -> None:
    """`memory` above what the node reports: the report; a node that is down: the file's figure."""
    (c,) = nodes(1)
    device, free, total = _reported(c.endpoint)
    usable = min(free, total) or total
    down = free_port()
    cluster = tmp_path / "c.toml"
    cluster.write_text(f'[[node]]\nname = "c"\nhost = "127.0.0.1"\nport = {c.port}\nmemory = "1TiB"\nkind = "cpu"\n\n'
                       f'[[node]]\nname = "d"\nhost = "127.0.0.1"\nport = {down}\nmemory = "2GiB"\nkind = "cpu"\n')
    out = _plan_cli("--cluster", str(cluster))
    assert out.exit_code == 0, out.output
    line_c, line_d = _usable_section(out.output)
    width = max(len(format_size(usable)), len(format_size(2 * GiB)))
    assert line_c == (f"  c  {format_size(usable).rjust(width)}  reported by the node ({device}, {format_size(free)} free "
                      f"of {format_size(total)}), below the 1.00 TiB in the cluster file")
    prefix = f"  d  {format_size(2 * GiB).rjust(width)}  cluster file (CPU node: all RAM); the node did not answer ("
    assert line_d.startswith(prefix) and f"127.0.0.1:{down}" in line_d and line_d.endswith(")"), line_d

    out = _plan_cli("--cluster", str(cluster), "--offline", "--json")   # nobody asked: the file's figures
    assert out.exit_code == 0, out.output
    assert [(n["usable_bytes"], n["memory_from"], n["reported_bytes"]) for n in json.loads(out.output)["nodes"]] == [
        (1024 * GiB, "cluster file", None), (2 * GiB, "cluster file", None)]


def test_plan_refuses_a_node_it_cannot_size(nodes: Any, tmp_path: Path) -> None:
    """No `memory` and the node does not answer (or is not asked): an error naming it and both ways out,
    the command that starts it being the one launch would give (its model directory and threads too)."""
    (up,) = nodes(1)
    down = free_port()
    cluster = tmp_path / "c.toml"
    cluster.write_text(f'[[node]]\nname = "up"\nhost = "127.0.0.1"\nport = {up.port}\n\n'
                       f'[[node]]\nname = "gone"\nhost = "127.0.0.1"\nport = {down}\nthreads = 2\n'
                       'model = "/models/k2.gguf"\n')
    out = _plan_cli("--cluster", str(cluster))
    assert out.exit_code == 1
    why = f"tbrpc node 127.0.0.1:{down}: unreachable: 127.0.0.1:{down}: cannot connect: Connection refused"
    assert out.output == (
        f"Error: node gone (127.0.0.1:{down}) did not answer ({why}) and the cluster file gives it no `memory`: "
        f"start the node (`tbrpc node --host 127.0.0.1 --port {down} --name gone --model-dir /models --threads 2`), "
        "or add `memory = \"...\"` to its "
        "[[node]] table to plan without it\n")
    out = _plan_cli("--cluster", str(cluster), "--offline")
    assert out.exit_code == 1
    assert out.output == (
        f"Error: node up (127.0.0.1:{up.port}): the cluster file gives it no `memory` and the nodes were not asked "
        "(planning offline): add `memory = \"...\"` to its [[node]] table, or plan with the node running "
        "(`tbrpc plan` without --offline)\n"
        f"node gone (127.0.0.1:{down}): the cluster file gives it no `memory` and the nodes were not asked "
        "(planning offline): add `memory = \"...\"` to its [[node]] table, or plan with the node running "
        "(`tbrpc plan` without --offline)\n")


def _secured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cluster secret; this process has none of its own (and forgets the one a command chooses)."""
    from tbrpc import secret

    monkeypatch.delenv("TBRPC_SECRET_FILE", raising=False)
    monkeypatch.setattr(secret, "_chosen", None)
    return secret.new(tmp_path / "secret")


def test_plan_finds_the_cluster_file_as_launch_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Neither --cluster nor --node/--nodes: ./tbrpc.toml, and a misspelt key in it is named."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    found = tmp_path / "tbrpc.toml"
    found.write_text('[[node]]\nname = "here"\nhost = "127.0.0.1"\nport = 1\nmemory = "8GiB"\nkind = "cpu"\n')
    out = _plan_cli("--offline", "--json")
    assert out.exit_code == 0, out.output
    assert [(n["name"], n["usable_bytes"]) for n in json.loads(out.output)["nodes"]] == [("here", 8 * GiB)]
    out = _plan_cli("--nodes", "2x4GiB", "--json")   # flags instead of the file
    assert out.exit_code == 0, out.output
    assert [n["name"] for n in json.loads(out.output)["nodes"]] == ["node0", "node1"]

    found.write_text('[[node]]\nname = "here"\nhost = "127.0.0.1"\nport = 1\nmemroy = "8GiB"\n')
    out = _plan_cli("--offline")
    assert out.exit_code == 1
    assert out.output == f"Error: {found}: node here: unknown key 'memroy' (did you mean 'memory'?)\n"


def test_plan_asks_secured_nodes_with_the_secret(nodes: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--secret-file, or the found file's `secret_file`, lets plan ask nodes started with a secret."""
    key = _secured(tmp_path, monkeypatch)
    (node,) = nodes(1, "--secret-file", str(key))
    table = f'[[node]]\nname = "a"\nhost = "127.0.0.1"\nport = {node.port}\n'
    cluster = tmp_path / "c.toml"
    cluster.write_text(table)
    out = _plan_cli("--cluster", str(cluster), "--secret-file", str(key), "--json")
    assert out.exit_code == 0, out.output
    assert [n["memory_from"] for n in json.loads(out.output)["nodes"]] == ["node"]

    monkeypatch.setattr("tbrpc.secret._chosen", None)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tbrpc.toml").write_text(f'secret_file = "{key}"\n{table}')
    out = _plan_cli("--json")
    assert out.exit_code == 0, out.output
    assert [n["memory_from"] for n in json.loads(out.output)["nodes"]] == ["node"]


def test_plan_says_a_node_refused_its_authentication(nodes: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A node started with a secret, asked without one: the refusal, not "start the node"."""
    key = _secured(tmp_path, monkeypatch)
    (node,) = nodes(1, "--secret-file", str(key))
    cluster = tmp_path / "c.toml"
    cluster.write_text(f'[[node]]\nname = "a"\nhost = "127.0.0.1"\nport = {node.port}\n')
    out = _plan_cli("--cluster", str(cluster))
    assert out.exit_code == 1
    assert out.output.startswith(f"Error: node a ({node.endpoint}) refused this head's authentication (tbrpc node "
                                 f"{node.endpoint}"), out.output
    assert out.output.endswith(
        ") and the cluster file gives it no `memory`: plan with the secret the node was started with (--secret-file "
        "PATH, the cluster file's `secret_file` or TBRPC_SECRET_FILE; none for a node started without one), or add "
        "`memory = \"...\"` to its [[node]] table to plan without it\n"), out.output
    assert "requires a cluster secret" in out.output


# --- calibration against llama.cpp's own allocations --------------------------------


def _device_prediction(path: Path, ctx: int, ubatch: int, flash_attn: bool) -> tuple[int, int, int, int]:
    """(weights, kv, compute, output) the planner predicts for a single CPU device."""
    model = load_gguf(path)
    p = plan(model, [make_node("cpu", "1TiB", kind="cpu")], ctx=ctx, ubatch=ubatch, flash_attn=flash_attn, head_device="cpu")
    n = p.nodes[0]
    output = arch_params(model).n_vocab * 4  # llama.cpp's output buffer (one sequence)
    return n.weights_bytes, n.kv_bytes, n.compute_bytes, output


LOG_ROUNDING = 5243  # llama.cpp logs sizes as %.2f MiB


def _within(predicted: int, actual: int) -> bool:
    return abs(predicted - actual) <= max(0.05 * actual, 64 * MiB)


def _real_model(name: str) -> Path:
    models = pytest.importorskip("models")
    try:
        return models.ensure(name)
    except Exception as exc:  # the Gemma download/assembly may be unavailable offline
        pytest.skip(f"model {name} unavailable: {exc}")


CALIBRATION = [
    # (model, ctx, ubatch, flash_attn) on a single CPU device; the split over
    # real nodes (per device TBRPC0..) is tests/test_plan_split.py.
    ("llama", 512, 512, False),
    ("llama", 2048, 512, False),
    ("deepseek2", 512, 512, False),
    ("deepseek2", 4096, 256, False),
    ("gemma", 1024, 512, False),
    ("gemma", 8192, 512, False),
    ("gemma", 32768, 512, True),
]


@pytest.mark.parametrize("name,ctx,ubatch,flash_attn", CALIBRATION)
def test_calibration_single_device(name: str, ctx: int, ubatch: int, flash_attn: bool) -> None:
    probe = pytest.importorskip("tests.llama_alloc_probe")
    pytest.importorskip("llama_cpp")
    path = _real_model(name)
    actual = probe.probe(path, n_ctx=ctx, n_ubatch=ubatch, flash_attn=flash_attn)
    weights, kv, compute, output = _device_prediction(path, ctx, ubatch, flash_attn)
    assert _within(weights, actual.total("model")), (weights, actual.model)
    assert abs(kv - actual.total("kv")) <= LOG_ROUNDING * len(actual.kv)  # exact, up to the log's 0.01 MiB
    predicted = weights + kv + compute + output
    measured = actual.total("model") + actual.total("kv") + actual.total("compute") + actual.total("output")
    assert _within(predicted, measured), (predicted, measured, actual)


@pytest.mark.parametrize("geometry,ctx,ubatch,flash_attn", [
    ("kimi", 32768, 512, False),
    ("kimi", 8192, 512, True),
    ("dsv3", 16384, 512, False),
    ("dsv3", 4096, 1024, True),
])  # fmt: skip
def test_calibration_compute_at_trillion_scale(
    geometry: str, ctx: int, ubatch: int, flash_attn: bool, kimi: tuple[ModelSpec, list[Path]], dsv3: tuple[ModelSpec, list[Path]]
) -> None:
    """llama.cpp simulates (no_alloc) its buffers for the sparse fixtures: compute and KV must agree."""
    probe = pytest.importorskip("tests.llama_alloc_probe")
    pytest.importorskip("llama_cpp")
    path = (kimi if geometry == "kimi" else dsv3)[1][0]
    actual = probe.probe(path, n_ctx=ctx, n_ubatch=ubatch, flash_attn=flash_attn, no_alloc=True)
    model = load_gguf(path)
    params = arch_params(model)
    c = ContextParams(ctx=ctx, ubatch=ubatch, batch=ubatch, flash_attn=flash_attn)
    predicted = compute_bytes(params, range(params.n_layer_all), c, has_output=True, has_input=False)
    measured = actual.total("compute")
    assert abs(predicted - measured) <= max(0.05 * measured, 64 * MiB), (predicted, measured)
    assert actual.kv_logical[0][0] == 61 * pad_ctx(ctx) * 576 * 2


def pad_ctx(ctx: int) -> int:
    return (ctx + 255) // 256 * 256


def test_unused_import_guard() -> None:
    # QT is used by fixtures; keep the import honest for linters
    assert QT.Q4_K.name == "Q4_K"


def test_plan_head_device_default_is_launchs(monkeypatch: pytest.MonkeyPatch) -> None:
    """`tbrpc plan` without --head-device plans what `tbrpc launch` loads on this
    machine: launch's own plan (``tbrpc.llama.make_plan``, four local nodes
    reporting 16 GiB each) has the same head device, tensor_split and
    n_gpu_layers as the command's default (with the head's GPU as node 0,
    Gemma 3's layers would go 3, 5, 5, 6 instead of 5, 5, 5, 4)."""
    import tbrpc.llama
    from tbrpc.spec import local_specs

    path = models.ensure("gemma")
    monkeypatch.setattr(tbrpc.llama, "plan_nodes",
                        lambda specs, nodes: [make_node(s.name, "16GiB", kind="cpu") for s in specs])
    launchs = tbrpc.llama.make_plan(path, local_specs(4), None, None)   # type: ignore[arg-type]
    result = CliRunner().invoke(cli_main, ["plan", "--gguf", str(path), "--nodes", "4x16GiB", "--json"])
    assert result.exit_code == 0, result.output
    planned = json.loads(result.output)
    assert (planned["head_device"], planned["tensor_split"], planned["n_gpu_layers"]) == (
        launchs.head_device, launchs.tensor_split, launchs.n_gpu_layers)
    assert launchs.head_device == "none" and launchs.tensor_split == [5, 5, 5, 4]
