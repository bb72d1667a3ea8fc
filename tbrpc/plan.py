"""Split a GGUF model's layers across nodes so that every node really fits.

The memory model mirrors how llama.cpp allocates (see docs/planner.md for the
derivation and the figures it was calibrated on):

* weights: exact bytes from the GGUF headers, per layer; token embeddings stay
  on the head's CPU (llama.cpp never offloads the input layer), the output
  norm and head go with the *last* layer's device;
* KV cache: per layer on the layer's device, ``kv_size`` = context padded to
  256, K only for MLA (deepseek2), window-sized for sliding-window layers
  unless ``swa_full`` (llama.cpp's default is a full-size SWA cache);
* compute buffers: the worst-case prompt graph for one ubatch, per device:
  the largest of the attention, FFN and output phases, plus the graph inputs
  (KQ mask per KV cache, row indices) its layers keep alive;
* head extras: llama.cpp's output buffer and llama-cpp-python's logits array.

Assignment: contiguous layer ranges, head first, realised exactly through
``tensor_split`` layer counts.  Prefill pipelines through a layer split (the
nodes work on different ubatches at once), so its pace is the largest
per-node compute: the ranges minimise that (nodes taken as equally fast;
among such splits the most even in memory) when they fit every node, and
otherwise minimise the largest fraction of usable memory any node needs (so
heterogeneous nodes are loaded in proportion).  ``Plan.balance`` says which.

Who is the head: with ``head_device="gpu"`` or ``"cpu"`` the first node is
the machine running llama.cpp and holds the first layers itself; with
``head_device="none"`` every node is a remote TBRPC device (TBRPC0 first)
and the head process only keeps the token embeddings, the graph inputs and
the logits, reported separately as ``Plan.head``.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from tbrpc import defaults
from tbrpc.gguf_model import (
    _INPUT_TENSORS,
    ArchParams,
    GGUFModel,
    TensorInfo,
    WeightLayout,
    arch_params,
    load_gguf,
    tensor_nbytes,
    weight_layout,
)
from tbrpc.node_memory import Node
from tbrpc.units import GiB, MiB, format_size, pad, parse_size

KV_PAD = 256  # llama-context.cpp: n_ctx = GGML_PAD(n_ctx, 256)
TENSOR_ALIGN = 32  # ggml CPU/RPC buffer alignment; each tensor is padded to it
DEFAULT_CTX = 32768
DEFAULT_MARGIN = 2 * GiB

CACHE_TYPES = {name.lower(): t for name, t in GGMLQuantizationType.__members__.items()}


# The types llama.cpp accepts for its KV cache (llama-server's --cache-type-k/-v).
KV_CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")


def cache_type_name(value: int | str) -> str:
    """A KV cache type as the planner names it ("q8_0"), from a name or llama_cpp's type_k/type_v number."""
    if isinstance(value, str):
        if value.lower() not in CACHE_TYPES:
            raise PlanError(f"unknown cache type {value!r}; choose one of {', '.join(sorted(CACHE_TYPES))}")
        return value.lower()
    try:
        return GGMLQuantizationType(value).name.lower()
    except ValueError:
        raise PlanError(f"unknown cache type number {value}") from None
# "gpu": the head is node 0 and runs its layers on its own device (Metal's MTL0);
# "cpu": the head is node 0 and runs its layers on its CPU backend;
# "none": the head runs no layers, every node is a remote device (TBRPC0, TBRPC1, ...).
HEAD_DEVICES = ("gpu", "cpu", "none")


class PlanError(ValueError):
    """The request cannot be planned at all (as opposed to: it does not fit)."""


class TensorSplitError(PlanError):
    """llama.cpp (or its meta device) will not tensor-split this model or these devices; the message says what to use."""


# --- memory model ---------------------------------------------------------------


def default_batch(ubatch: int) -> int:
    """The logical batch (n_batch) when only the physical one is given: llama-cpp-python's 512, or
    the ubatch when larger, since llama.cpp caps n_ubatch at n_batch (a larger ubatch alone would
    load as 512). What `tbrpc plan` plans and `tbrpc launch` loads."""
    return max(defaults.BATCH, ubatch)


@dataclass(frozen=True)
class ContextParams:
    ctx: int
    ubatch: int = 512
    batch: int = 512
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    flash_attn: bool = False
    swa_full: bool = True
    n_seq: int = 1
    all_logits: bool = False  # logits for every token (speculative decoding: llama-cpp-python sets logits_all)

    @property
    def kv_size(self) -> int:
        return pad(self.ctx, KV_PAD)

    @property
    def n_tokens(self) -> int:
        """Tokens in the worst-case graph llama.cpp reserves: min(n_ctx, n_ubatch)."""
        return min(self.kv_size, self.ubatch, self.batch)


def row_bytes(type_name: str, n_elements: int) -> int:
    block, size = GGML_QUANT_SIZES[CACHE_TYPES[type_name]]
    if n_elements % block:
        raise PlanError(f"cache type {type_name} needs rows divisible by {block}; this model has {n_elements}")
    return n_elements // block * size


def layer_kv_bytes(p: ArchParams, il: int, c: ContextParams) -> int:
    """KV cache bytes llama.cpp allocates for layer ``il`` (0 for MTP blocks)."""
    if il >= p.n_layer:
        return 0  # nextn/MTP blocks are filtered out of the main context's cache
    cells = c.kv_size
    if p.is_swa[il] and not c.swa_full:
        # llama-kv-cache-iswa.cpp: window + ubatch, padded to 256, never above the full size
        cells = min(c.kv_size, pad(p.n_swa * c.n_seq + c.ubatch, 256))
    k_elems, v_elems = p.kv_row_elems(il)
    total = pad(row_bytes(c.cache_type_k, k_elems) * cells, TENSOR_ALIGN)
    if v_elems:
        total += pad(row_bytes(c.cache_type_v, v_elems) * cells, TENSOR_ALIGN)
    return total * c.n_seq if c.n_seq > 1 else total


F32 = 4


def _n_kv(p: ArchParams, il: int, c: ContextParams) -> int:
    if p.is_swa[il] and not c.swa_full:
        return min(c.kv_size, pad(p.n_swa * c.n_seq + c.ubatch, 256))
    return c.kv_size


FULL, SWA = 1, 2  # bits of a device's set of KV-cache kinds


def _cache_kind(p: ArchParams, il: int) -> int:
    """Which KV cache layer il attends (0 for MTP blocks, which are not in the graph)."""
    if il >= p.n_layer:
        return 0
    return SWA if p.is_swa[il] else FULL


def _inputs_bytes(p: ArchParams, c: ContextParams, kind: int) -> int:
    """Graph inputs of one KV cache that a device holding its layers copies in.

    The KQ mask (F16 with flash attention, else F32) lives until the
    device's last layer of that kind has attended; without flash attention
    the V-cache row indices (i64 per value of the transposed V rows) come
    along; MLA has no V cache.  A mixed sliding-window device (gemma3)
    holds both caches' inputs.
    """
    layers = [il for il in range(p.n_layer) if _cache_kind(p, il) == kind]
    if not layers:
        return 0
    n_kv = _n_kv(p, layers[0], c)
    total = n_kv * c.n_tokens * (2 if c.flash_attn else F32)
    if not c.flash_attn and not p.is_mla:
        total += c.n_tokens * max(p.kv_row_elems(il)[1] for il in layers) * 8
    return total


def _kinds_inputs(p: ArchParams, c: ContextParams, kinds: int) -> int:
    return sum(_inputs_bytes(p, c, kind) for kind in (FULL, SWA) if kinds & kind)


def _attention_phase(p: ArchParams, il: int, c: ContextParams) -> int:
    """Bytes live while layer il attends (graph inputs such as the mask not included)."""
    n_kv, u, n_head = _n_kv(p, il, c), c.n_tokens, p.n_head[il]
    per_tok = 2 * p.n_embd * F32  # residual stream + normed input
    fixed = 0
    if p.is_mla:
        # Absorbed MLA (llama.cpp's deepseek2 graph): at the peak, per head the
        # decompressed query (head_k_mla), its RoPE'd part, the query absorbed
        # into the latent space (kv_lora_rank) and the concatenated latent
        # query (kv_lora_rank + rope) are live, plus per token a third
        # n_embd-wide stream and the q_a projection.  Without flash attention
        # V is a transposed copy of the latent cache (in the cache's type),
        # live next to the KQ scores.  Measured with llama.cpp's own
        # no_alloc reservations over 15 geometries (n_embd 4096-10240, 32-128
        # heads, q_lora 512-3072, kv_lora 256-1024, rope 32-128): within 3%
        # for ctx >= 768; at ctx 512 llama.cpp packs the no-FA graph tighter
        # (the model is then up to 30% high).
        rope = p.head_k - p.n_lora_kv
        per_tok += (p.n_embd + p.n_lora_q + n_head * (p.head_k_mla + p.n_lora_kv + p.head_k + rope)) * F32
        if not c.flash_attn:
            fixed += n_kv * row_bytes(c.cache_type_k, p.n_lora_kv)
    else:
        k_elems, v_elems = p.kv_row_elems(il)
        per_tok += (n_head * p.head_k + k_elems + v_elems + 2 * n_head * p.head_v) * F32
    if not c.flash_attn:
        per_tok += n_kv * n_head * F32  # KQ scores; softmax runs in place
    return per_tok * u + fixed


def _ffn_phase(p: ArchParams, il: int, c: ContextParams) -> int:
    per_tok = 2 * p.n_embd * F32
    if _is_moe_layer(p, il):
        per_tok += 3 * p.n_expert_used * p.n_ff_exp * F32  # gate, up, activation per chosen expert
        per_tok += 3 * p.n_expert * F32  # router logits, probabilities, selection
        per_tok += p.n_expert_used * p.n_embd * F32  # expert outputs before the weighted sum
    else:
        per_tok += 3 * p.n_ff[il] * F32
    return per_tok * c.n_tokens


def _is_moe_layer(p: ArchParams, il: int) -> bool:
    return p.n_expert > 0 and p.n_ff_exp > 0 and il >= p.dense_lead


def _output_phase(p: ArchParams, c: ContextParams) -> int:
    """Logits for every token of the reserve graph, plus what survives the last layer.

    The masks are free by then (no layer left to attend).
    """
    u = c.n_tokens
    streams = 4 if p.n_expert else 2  # MoE: the last layer's expert sum is still live
    return u * p.n_vocab * F32 + streams * u * p.n_embd * F32


def compute_bytes(p: ArchParams, layers: range, c: ContextParams, has_output: bool, has_input: bool) -> int:
    """Worst-case compute buffer of one device holding ``layers``.

    ggml-alloc frees intermediates once their last consumer ran, so the
    buffer is the peak of a single phase plus what lives across phases (the
    graph inputs of each KV cache the device's layers use), not a sum over
    layers.
    """
    peak = max((_layer_peak(p, il, c) for il in layers), default=0)
    kinds = 0
    for il in layers:
        kinds |= _cache_kind(p, il)
    return _finish_compute(p, c, peak, _kinds_inputs(p, c, kinds), _output_phase(p, c) if has_output else 0, has_input)


def _layer_peak(p: ArchParams, il: int, c: ContextParams) -> int:
    if il >= p.n_layer:
        return 0  # MTP blocks are not in the main graph
    return max(_attention_phase(p, il, c), _ffn_phase(p, il, c))


def _finish_compute(p: ArchParams, c: ContextParams, layers_peak: int, inputs: int, output_peak: int, has_input: bool) -> int:
    peak = max(layers_peak + inputs if layers_peak else 0, output_peak)
    if has_input:
        peak += c.n_tokens * p.n_embd * F32  # embeddings gathered on the head's CPU, copied to layer 0's device
    return pad(peak, TENSOR_ALIGN)


def head_compute_bytes(p: ArchParams, c: ContextParams) -> int:
    """The head's CPU compute buffer when all layers are on remote devices.

    It holds the token embeddings gathered from the CPU copy of token_embd
    and the graph inputs every device copies from it (per KV cache: the KQ
    mask, without flash attention the V row indices).  Measured against
    llama.cpp's "CPU compute buffer" for split loads (tests/test_plan_split.py).
    """
    u = c.n_tokens
    kinds = 0
    for il in range(p.n_layer):
        kinds |= _cache_kind(p, il)
    total = _kinds_inputs(p, c, kinds) + 2 * u * p.n_embd * F32
    total += 8 * u * 6  # tokens, positions, K row indices, out_ids
    return pad(total, TENSOR_ALIGN)


def host_bytes(p: ArchParams, c: ContextParams) -> int:
    """Head-only buffers outside the devices.

    llama.cpp's output buffer holds logits for n_seq outputs, or for every
    token of a batch when all logits are kept (speculative decoding makes
    llama-cpp-python ask for them: llama_context::output_reserve grows the
    buffer to the batch); llama-cpp-python keeps a float32 score array of
    n_batch x n_vocab.
    """
    outputs = max(1, c.n_seq, c.batch if c.all_logits else 0)
    return p.n_vocab * F32 * outputs + c.batch * p.n_vocab * F32


# --- plan result ----------------------------------------------------------------


@dataclass
class NodePlan:
    name: str
    usable_bytes: int
    limit: str  # where usable_bytes came from, in words (the cluster file, the node's report, ...)
    layers: tuple[int, int] | None  # inclusive [first, last]; None if the node holds none
    weights_bytes: int
    kv_bytes: int
    compute_bytes: int
    host_bytes: int
    total_bytes: int
    headroom_bytes: int  # usable - margin - total; negative means it does not fit
    shards: list[str]
    device: str  # llama.cpp device that holds the layers
    memory_from: str = "given"  # whose figure usable_bytes is: "cluster file", "command line", "node", "given"
    reported_bytes: int | None = None  # what the node reported (its share), when it was asked
    split_bytes: int | None = None  # tensor mode: its slices of the split weights (None in layer mode)
    replicated_bytes: int | None = None  # tensor mode: the mirrored tensors it holds whole
    draft_bytes: int = 0  # the draft model's weights + KV + compute + host, when this node is the head

    @property
    def n_layers(self) -> int:
        return 0 if self.layers is None else self.layers[1] - self.layers[0] + 1


@dataclass
class HeadPlan:
    """What the head process itself holds when it runs no layers (head_device="none").

    Not checked against any node's memory: the head machine is not one of
    the planned nodes (with ``tbrpc launch --local N`` it is the same
    machine, whose RAM the nodes share).
    """

    device: str  # "CPU": the head's ggml CPU backend
    weights_bytes: int  # token embeddings (llama.cpp never offloads the input layer)
    compute_bytes: int  # CPU compute buffer: gathered embeddings and graph inputs
    host_bytes: int  # llama.cpp's output buffer + llama-cpp-python's logits array
    total_bytes: int  # includes draft_bytes
    draft_bytes: int = 0  # the draft model (--draft-model), on this process's CPU


@dataclass
class Shortfall:
    """Why a plan does not fit, with the nearest plans that would."""

    message: str
    over_bytes: int  # by how much the worst node is over
    total_short_bytes: int  # cluster-wide missing memory (lower bound)
    max_ctx: int | None  # largest context that fits on these nodes
    min_nodes: int | None  # smallest count of nodes like the largest one that fits at ctx
    min_nodes_size: int | None


@dataclass
class Plan:
    model_path: str
    architecture: str
    n_layers: int  # block_count, as llama.cpp counts layers for tensor_split
    weights_bytes: int
    shards: list[str]
    context: ContextParams
    margin_bytes: int
    nodes: list[NodePlan]
    fits: bool
    tensor_split: list[float]
    n_gpu_layers: int
    head_device: str
    shortfall: Shortfall | None = None
    notes: list[str] = field(default_factory=list)
    head: HeadPlan | None = None  # the head process's own bytes when head_device="none"
    split_mode: str = "layer"  # "layer" or "tensor"
    tensor: TensorPlan | None = None  # tensor mode: shares, all-reduces and their bytes
    draft: DraftPlan | None = None  # the draft model on the head (--draft-model)
    balance: str | None = None  # layer split: what the ranges follow: "compute" or "memory" (BALANCES), "given" (tensor_split)

    @property
    def ctx(self) -> int:
        return self.context.ctx

    @property
    def cli_args(self) -> str:
        """Flags for llama.cpp's CLI tools that reproduce this split."""
        ts = ",".join(_share_text(x) for x in self.tensor_split)
        args = f"-ngl {self.n_gpu_layers} -sm {self.split_mode} -ts {ts} -c {self.context.kv_size} -ub {self.context.ubatch}"
        if self.split_mode == "ffn":
            return "(none: tbrpc's own meta device, Cluster.ffn_split_device, as the only device of a layer split)"
        return args + (" -fa on" if self.split_mode == "tensor" else "")

    def part_of(self, node: NodePlan) -> str:
        """What of the model `node` (one of `nodes`) holds, in words: the launch's plan line, the
        serving page and a shortfall say it so."""
        layers = f"layers {node.layers[0]}-{node.layers[1]}" if node.layers else "no layers"
        if self.tensor is not None and self.tensor.groups > 1:   # the hybrid: a group's layers, its FFN cut
            return f"{layers}, 1/{len(self.nodes) // self.tensor.groups} of their FFN and experts" if node.layers else layers
        if self.split_mode in ("tensor", "ffn"):
            share = self.tensor_split[self.nodes.index(node)]
            what = "every layer" if self.split_mode == "tensor" else "every FFN and expert"
            return f"{_share_text(share)}/{_share_text(sum(self.tensor_split))} of {what}"
        return layers

    def llama_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for llama_cpp.Llama that reproduce this split."""
        return {
            "n_gpu_layers": self.n_gpu_layers,
            "split_mode": LLAMA_SPLIT_MODE_TENSOR if self.split_mode == "tensor" else LLAMA_SPLIT_MODE_LAYER,
            # ffn: one (meta) device holds every layer, so there is nothing to share out between devices;
            # the hybrid shares the layers out between its groups' meta devices
            "tensor_split": None if self.split_mode == "ffn" and (self.tensor is None or self.tensor.groups == 1)
                            else list(self.tensor_split),
            "n_ctx": self.context.ctx,
            "n_batch": self.context.batch,
            "n_ubatch": self.context.ubatch,
            "flash_attn": self.context.flash_attn,
            "type_k": int(CACHE_TYPES[self.context.cache_type_k]),
            "type_v": int(CACHE_TYPES[self.context.cache_type_v]),
            "swa_full": self.context.swa_full,
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "model": {
                "path": self.model_path,
                "architecture": self.architecture,
                "n_layers": self.n_layers,
                "weights_bytes": self.weights_bytes,
                "shards": self.shards,
            },
            "ctx": self.context.ctx,
            "context": asdict(self.context),
            "margin_bytes": self.margin_bytes,
            "nodes": [_node_json(n) for n in self.nodes],
            "fits": self.fits,
            "tensor_split": self.tensor_split,
            "n_gpu_layers": self.n_gpu_layers,
            "head_device": self.head_device,
            "head": None if self.head is None else asdict(self.head),
            "split_mode": self.split_mode,
            "tensor": None if self.tensor is None else asdict(self.tensor),
            "draft": None if self.draft is None else asdict(self.draft),
            "balance": self.balance,
            "device_order": [n.device for n in self.nodes if n.device != "CPU"],
            "llama_cpp_args": self.cli_args,
            "shortfall": None if self.shortfall is None else asdict(self.shortfall),
            "notes": self.notes,
        }


def _share_text(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


@dataclass
class DraftPlan:
    """A draft model (``tbrpc launch --draft-model``) on the head's CPU: every
    layer there, loaded as ``tbrpc.draft.GGUFDraft`` loads it (llama-cpp-python's
    defaults: n_batch = n_ubatch = 512, F16 cache, flash attention off)."""

    path: str
    architecture: str
    ctx: int
    weights_bytes: int
    kv_bytes: int
    compute_bytes: int
    host_bytes: int  # its own output buffer and score array
    total_bytes: int


def _node_json(n: NodePlan) -> dict[str, Any]:
    data = asdict(n)
    data["layers"] = None if n.layers is None else list(n.layers)
    return data


# --- assignment -------------------------------------------------------------------


@dataclass(frozen=True)
class _Costs:
    """Per-layer sizes as prefix sums, so any range costs O(1) (plus compute)."""

    params: ArchParams
    layout: WeightLayout
    context: ContextParams
    weight_prefix: list[int]
    kv_prefix: list[int]
    layer_peak: list[int]  # compute peak of each layer's attention/FFN phases
    layer_kind: list[int]  # the KV cache (FULL/SWA bit) each layer attends
    kinds_inputs: list[int]  # graph-input bytes of a device, indexed by its set of kinds
    output_peak: int
    head_is_node: bool  # node 0 is the head (embeddings, host buffers) unless head_device="none"
    head_extra: int = 0  # a draft model on the head (node 0 when head_is_node)
    macs_prefix: list[int] = field(default_factory=lambda: [0])  # prefill multiply-adds per token (layer_macs)
    output_macs: int = 0  # the output layer's, on the last node (output_macs)

    def weights(self, first: int, last: int) -> int:
        return self.weight_prefix[last + 1] - self.weight_prefix[first]

    def kv(self, first: int, last: int) -> int:
        return self.kv_prefix[last + 1] - self.kv_prefix[first]

    def macs(self, first: int, last: int) -> int:
        """Prefill multiply-adds per token of a node holding layers first..last (and the output with the last layer)."""
        total = self.macs_prefix[last + 1] - self.macs_prefix[first]
        return total + (self.output_macs if last == self.params.n_layer_all - 1 else 0)


def _costs(params: ArchParams, layout: WeightLayout, c: ContextParams, head_is_node: bool = True, head_extra: int = 0,
           macs: Sequence[int] | None = None) -> _Costs:
    wp, kp, mp = [0], [0], [0]
    for lw in layout.layers:
        wp.append(wp[-1] + (lw.total + TENSOR_ALIGN * lw.n_tensors if lw.loaded else 0))
        kp.append(kp[-1] + layer_kv_bytes(params, lw.index, c))
        mp.append(mp[-1] + (macs[lw.index] if macs is not None else 0))
    peaks = [_layer_peak(params, il, c) for il in range(params.n_layer_all)]
    kinds = [_cache_kind(params, il) for il in range(params.n_layer_all)]
    inputs = [_kinds_inputs(params, c, k) for k in range((FULL | SWA) + 1)]
    return _Costs(params, layout, c, wp, kp, peaks, kinds, inputs, _output_phase(params, c), head_is_node, head_extra,
                  mp, output_macs(params, c) if macs is not None else 0)


# --- prefill compute: what a layer split pipelines --------------------------------
#
# A prompt goes through a layer split ubatch by ubatch, and the nodes work on
# different ubatches at once (while node 1 computes ubatch k, node 0 computes
# ubatch k+1: each node runs its requests in order, the head does not wait
# between ubatches).  Prefill therefore runs at the pace of the node with the
# most compute per token.  Decode does not care: a token passes every node in
# turn, the same total work whatever the split.


def layer_macs(model: GGUFModel, p: ArchParams, layout: WeightLayout) -> list[int]:
    """Prefill compute of each layer: multiply-adds per prompt token, from the tensor shapes.

    Every block tensor of two or more dimensions is a matrix each token is
    multiplied by (a 3-D ``attn_k_b``/``attn_v_b`` is a stack of per-head
    matrices): one multiply-add per element.  Routed experts (``*_exps``,
    the expert index last) count ``n_expert_used / n_expert`` of their
    elements; shared experts and the router count whole.  Vectors (norms,
    biases) are elementwise work, counted as nothing.  Blocks outside the
    main graph (MTP, unloaded) count nothing.

    Not counted: attention's own work (scores and their weighted sum), which
    grows with the prompt's length -- unknown when planning -- and is the
    same for every layer of the same shape, so it moves no boundary much.
    """
    macs = [0] * p.n_layer_all
    for t in model.tensors:
        il = t.block
        if il is None or len(t.shape) < 2 or il >= p.n_layer or not layout.layers[il].loaded:
            continue
        n = t.n_elements
        if "_exps." in t.name and p.n_expert:
            n = n * p.n_expert_used // p.n_expert
        macs[il] += n
    return macs


def output_macs(p: ArchParams, c: ContextParams) -> int:
    """Prefill compute of the output layer per prompt token: nothing, as llama.cpp computes
    the logits of the prompt's last token only, unless every token's logits are kept
    (``all_logits``: a draft model), then the whole output matrix.  The token embeddings
    are a row lookup (get_rows): nothing either."""
    return p.n_vocab * p.n_embd if c.all_logits else 0


def _node_need(costs: _Costs, index: int, first: int, last: int, layers_peak: int | None = None,
               kinds: int | None = None) -> tuple[int, int, int, int]:
    """(weights, kv, compute, host) of node ``index`` holding layers first..last.

    ``layers_peak`` (the max of layer_peak over the range) and ``kinds`` (the
    KV caches its layers use) let the greedy pass extend a range one layer at
    a time without rescanning it.
    """
    p, layout, c = costs.params, costs.layout, costs.context
    if layers_peak is None:
        layers_peak = max(costs.layer_peak[first : last + 1], default=0)
    if kinds is None:
        kinds = 0
        for kind in costs.layer_kind[first : last + 1]:
            kinds |= kind
    is_head, is_last = index == 0 and costs.head_is_node, last == p.n_layer_all - 1
    weights = kv = compute = 0
    if last >= first:
        weights = costs.weights(first, last) + layout.other_bytes
        kv = costs.kv(first, last)
    if is_last:
        weights += layout.output_bytes
        if is_head:
            # Same machine as the embeddings: both views come from one mmap of the file.
            weights -= layout.tied_bytes
    if is_head:
        weights += layout.input_bytes
    # The device of layer 0 receives the embeddings gathered on the head's CPU.
    compute = _finish_compute(p, c, layers_peak, costs.kinds_inputs[kinds], costs.output_peak if is_last else 0, first == 0)
    host = host_bytes(p, c) if is_head else 0
    return weights, kv, compute, host


def _greedy(costs: _Costs, budgets: Sequence[float], cap: int | None = None) -> list[tuple[int, int]] | None:
    """Give each node, head first, as many layers as fit its budget and the compute cap; None if layers remain.

    ``budgets``: bytes per node (``math.inf``: memory not considered);
    ``cap``: the most prefill multiply-adds per token a node may take.  Both
    grow as a range grows, so taking layers while both hold finds a split
    whenever one exists, with one exception: with nodes of unequal memory,
    filling an earlier node can leave a later one a layer it cannot hold
    although another split would fit (then the answer is None).  Each node
    keeps at least one layer for every node after it, so no node is left
    empty while layers remain.
    """
    n_layers = costs.params.n_layer_all
    ranges: list[tuple[int, int]] = []
    first = 0
    n = len(budgets)
    for index, budget in enumerate(budgets):
        remaining_nodes = n - index - 1
        last = first - 1
        limit = n_layers - 1 - remaining_nodes
        peak = kinds = 0
        extra = costs.head_extra if index == 0 and costs.head_is_node else 0
        while last + 1 <= limit:
            grown, more = max(peak, costs.layer_peak[last + 1]), kinds | costs.layer_kind[last + 1]
            if cap is not None and costs.macs(first, last + 1) > cap:
                break
            if budget != math.inf and sum(_node_need(costs, index, first, last + 1, grown, more)) + extra > budget:
                break
            last, peak, kinds = last + 1, grown, more
        if last < first:
            return None
        ranges.append((first, last))
        first = last + 1
    return ranges if first == n_layers else None


BALANCES = ("compute", "memory")  # what a layer split's ranges were balanced by (Plan.balance)


def _least_compute_cap(costs: _Costs, n_nodes: int) -> int:
    """The least, over every split into n_nodes contiguous ranges, of the largest
    per-node prefill compute (memory aside): what a compute balance reaches."""
    lo, hi = -1, costs.macs(0, costs.params.n_layer_all - 1)  # lo never fits, hi always does
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _greedy(costs, [math.inf] * n_nodes, mid) is None:
            lo = mid
        else:
            hi = mid
    return hi


def _memory_balanced(costs: _Costs, usable: list[int], margin: int, cap: int | None = None) -> list[tuple[int, int]] | None:
    """Contiguous ranges minimising the largest (need + margin) / usable over the nodes.

    With ``cap``: among the splits whose nodes all stay within that prefill
    compute, and only if one of them fits (need + margin <= usable), else
    None.  Without: whether or not anything fits (the most even of the
    splits that do not).
    """
    lo, hi = 0.0, 1.0
    while _greedy(costs, [u * hi - margin for u in usable], cap) is None:
        if cap is not None:
            return None
        hi *= 2
        if hi > 1e6:
            raise PlanError("cannot split: a single layer is larger than any budget")
    for _ in range(40):  # ~1e-12 relative precision
        mid = (lo + hi) / 2
        if _greedy(costs, [u * mid - margin for u in usable], cap) is None:
            lo = mid
        else:
            hi = mid
    ranges = _greedy(costs, [u * hi - margin for u in usable], cap)
    assert ranges is not None
    return ranges


def _balanced_ranges(costs: _Costs, nodes: Sequence[Node], margin: int, by_compute: bool = True) -> tuple[list[tuple[int, int]], str]:
    """A layer split's ranges and what they were balanced by ("compute" or "memory").

    Prefill pipelines through the nodes, so its pace is the largest
    per-node compute: when a split reaching the least such compute fits
    every node, plan it ("compute"; among several, the one most even in
    memory).  Otherwise the most even split in memory ("memory").  Nodes
    are taken as equally fast: how fast a node is is not known before it
    runs.  ``by_compute=False``: the memory balance only.
    """
    usable = [max(1, n.usable_bytes) for n in nodes]
    if by_compute:
        ranges = _memory_balanced(costs, usable, margin, _least_compute_cap(costs, len(nodes)))
        if ranges is not None:
            return ranges, "compute"
    ranges = _memory_balanced(costs, usable, margin)
    assert ranges is not None
    return ranges, "memory"


# --- tensor mode (llama.cpp's LLAMA_SPLIT_MODE_TENSOR, the "meta" device) -----------
#
# llama.cpp (as vendored by llama-cpp-python 0.3.36) wraps every device in one
# meta device that cuts each weight matrix across them
# (llama_meta_device_get_split_state in src/llama-model.cpp); the rules are
# replayed here, tensor by tensor, with llama.cpp's float32 arithmetic, so the
# per-node slices are the bytes the nodes allocate.

SPLIT_MODES = ("layer", "tensor", "ffn")
ALLREDUCE_SHAPES = ("mesh", "ring")
RING_PIECE = 32 << 10   # the ring all-reduce's piece, the scratch it needs on a node (node_links.c, ALLREDUCE_INLINE)
LLAMA_SPLIT_MODE_LAYER, LLAMA_SPLIT_MODE_ROW, LLAMA_SPLIT_MODE_TENSOR = 1, 2, 3
META_MAX_DEVICES = 16  # GGML_BACKEND_META_MAX_DEVICES

# llm_arch_supports_sm_tensor() is false for these (src/llama-arch.cpp): llama.cpp
# refuses split_mode=TENSOR for them ("LLAMA_SPLIT_MODE_TENSOR not implemented
# for architecture ...").
TENSOR_REFUSED_ARCHS = frozenset({
    "grok", "mpt", "plamo2", "minicpm3", "gemma3n", "mamba", "mamba2", "jamba", "falcon-h1", "olmo2", "olmoe",
    "deepseek2", "deepseek32", "hy_v4", "dots3note", "glm-dsa", "bitnet", "t5", "nemotron_h", "nemotron_h_moe",
    "granitehybrid", "minimax-01", "minimax-m2", "minimax-m3", "mistral4", "kimi-linear", "bailingmoe3", "kimi-k3",
    "glm5-next", "qwen3tts", "qwen4exp",
})  # fmt: skip
# Allowed by llama.cpp, but with split rules of their own (fused gated Q,
# linear-attention state, DeepSeek-4's grouped output, mirrored-everything)
# that the planner does not replay: planned as an error rather than wrongly.
TENSOR_UNMODELLED_ARCHS = frozenset({"qwen3next", "qwen35", "qwen35moe", "deepseek4", "dflash", "hrm_text", "lfm2", "lfm2moe"})

MIRRORED, PARTIAL = 10, 11  # ggml_backend_meta_split_axis


def _rx(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern)


# The patterns of llama_meta_device_get_split_state, matched in full (std::regex_match).
_P = {
    "q_weight": _rx(r"blk\.\d*\.attn_q.weight"),
    "kv_weight": _rx(r"blk\.\d*\.attn_(k|v).weight"),
    "qkv_weight": _rx(r"blk\.\d*\.attn_qkv.weight"),
    "q_bias": _rx(r"blk\.\d*\.attn_q\.bias"),
    "kv_bias": _rx(r"blk\.\d*\.attn_(k|v)\.bias"),
    "qkv_bias": _rx(r"blk\.\d*\.attn_qkv.bias"),
    "qk_norm": _rx(r"blk\.\d*\.attn_(q|k)_norm\.weight"),
    "kv_cache": _rx(r"cache_(k|v)_l\d*"),
    "attn_sinks": _rx(r"blk\.\d*\.attn_sinks.weight"),
    "attn_out_weight": _rx(r"blk\.\d*\.attn_output.weight"),
    "attn_out_bias": _rx(r"blk\.\d*\.attn_output.bias"),
    "attn_gate_weight": _rx(r"blk\.\d*\.attn_gate.weight"),
    "ssm": _rx(r"blk\.\d*\.ssm_.*"),
    "ffn_up_weight": _rx(r"blk\.\d*\.ffn_up(_exps)?.weight"),
    "ffn_up_bias": _rx(r"blk\.\d*\.ffn_up(_exps)?.bias"),
    "ffn_gate_weight": _rx(r"blk\.\d*\.ffn_gate(_exps)?.weight"),
    "ffn_gate_bias": _rx(r"blk\.\d*\.ffn_gate(_exps)?.bias"),
    "ffn_gate_up_weight": _rx(r"blk\.\d*\.ffn_gate_up(_exps)?.weight"),
    "ffn_down_weight": _rx(r"blk\.\d*\.ffn_down(_exps)?.weight"),
    "ffn_down_bias": _rx(r"blk\.\d*\.ffn_down.bias"),
    "ffn_down_exps_bias": _rx(r"blk\.\d*\.ffn_down_exps.bias"),
    "output_weight": _rx(r"output\.weight"),
    "output_bias": _rx(r"output\.bias"),
}


def _m(key: str, name: str) -> bool:
    return _P[key].fullmatch(name) is not None


@dataclass(frozen=True)
class _MetaTensor:
    """What the split rules look at: a name, a ggml type and a shape (ne0 first)."""

    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]


class _MetaSplitter:
    """llama_meta_device_get_split_state for the standard transformer rules."""

    def __init__(self, model: GGUFModel, p: ArchParams, shares: Sequence[float]) -> None:
        self.model, self.p, self.n = model, p, len(shares)
        self.shares = [np.float32(s) for s in shares]

    def _il_eff(self, il: int) -> int:
        swa = self.p.is_swa[il]
        return sum(1 for prev in range(il) if self.p.is_swa[prev] == swa)

    def _head_k(self, il: int) -> int:
        return self.p.head_k_swa if self.p.is_swa[il] else self.p.head_k

    def _head_v(self, il: int) -> int:
        return self.p.head_v_swa if self.p.is_swa[il] else self.p.head_v

    def _ref(self, prefix: str, suffix: str, fallback: str = "") -> TensorInfo:
        t = self.model.tensor(prefix + suffix)
        if t is None and fallback:
            t = self.model.tensor(prefix + fallback)
        if t is None:
            raise PlanError(f"tensor mode: no {prefix + suffix} to take the split of {prefix}* from")
        return t

    def axis_of(self, t: _MetaTensor) -> tuple[int, GGMLQuantizationType, int, int]:
        """(axis, type of the tensor whose block size sets the granularity, il, rotation)."""
        name = t.name
        if name.startswith("blk."):
            il = int(name.split(".", 2)[1])
            prefix, rotation = f"blk.{il}.", self._il_eff(il) % self.n
        elif name.startswith("cache_"):
            il = int(name.rsplit("_l", 1)[1])
            prefix, rotation = f"blk.{il}.", self._il_eff(il) % self.n
        else:
            il, prefix, rotation = 0, "", self.p.n_layer % self.n

        def cfg(axis: int, suffix: str = "", fallback: str = "") -> tuple[int, GGMLQuantizationType, int, int]:
            ref_type = t.ggml_type if not suffix else self._ref(prefix, suffix, fallback).ggml_type
            return axis, ref_type, il, rotation

        if _m("ssm", name):
            raise PlanError(f"tensor mode: {name}: recurrent (SSM) layers' split rules are not modelled by the planner")
        if _m("q_weight", name) or _m("kv_weight", name) or _m("qkv_weight", name) or _m("attn_gate_weight", name):
            return cfg(1, "attn_output.weight")
        if _m("q_bias", name) or _m("kv_bias", name) or _m("qkv_bias", name):
            return cfg(0, "attn_output.weight")
        if _m("qk_norm", name):
            return cfg(MIRRORED if len(t.shape) < 2 or t.shape[1] == 1 else 1, "attn_output.weight")
        if _m("kv_cache", name) or _m("attn_sinks", name):
            return cfg(0, "attn_output.weight")
        if _m("attn_out_weight", name):
            return cfg(0)
        if _m("attn_out_bias", name):
            return cfg(MIRRORED)
        if _m("ffn_up_weight", name) or _m("ffn_gate_weight", name) or _m("ffn_gate_up_weight", name):
            return cfg(1, "ffn_down.weight", "ffn_down_exps.weight")
        if _m("ffn_up_bias", name) or _m("ffn_gate_bias", name):
            return cfg(0, "ffn_down.weight", "ffn_down_exps.weight")
        if _m("ffn_down_weight", name):
            return cfg(0, "ffn_down.weight", "ffn_down_exps.weight")
        if _m("ffn_down_exps_bias", name):
            return cfg(PARTIAL)  # a full-size copy on every device (summed by the all-reduce)
        if _m("output_weight", name) or _m("output_bias", name):
            return cfg(1 if _m("output_weight", name) else 0)
        return cfg(MIRRORED)

    def _segments(self, t: _MetaTensor, axis: int, il: int) -> list[tuple[int, int]]:
        p, name, ne = self.p, t.name, t.shape[axis]
        if _m("qkv_weight", name) or _m("qkv_bias", name):
            n_q = p.n_head[il] * self._head_k(il)
            n_k, n_v = p.kv_row_elems(il)
            return [(n_q, 1), (n_k, 2)] if n_k == n_v else [(n_q, 1), (n_k, 1), (n_v, 1)]
        if _m("ffn_up_weight", name) or _m("ffn_up_bias", name):
            return [(p.n_ff[il], 2)] if ne == 2 * p.n_ff[il] else [(ne, 1)]
        if _m("ffn_gate_up_weight", name):
            return [(p.n_ff_exp, 2)]
        return [(ne, 1)]

    def _granularity(self, t: _MetaTensor, blck: int, il: int, n_segments: int) -> list[int]:
        p, name = self.p, t.name
        n_head_kv = p.n_head_kv[il]
        n_gqa = p.n_head[il] // n_head_kv if n_head_kv else 0
        head_k, head_v = self._head_k(il), self._head_v(il)
        n_embd_q = n_gqa * head_k
        perf = blck
        while perf < 128 and perf * self.n < n_embd_q:
            perf *= 2
        g_q = math.lcm(n_embd_q, perf)
        g_head = g_q // head_k if head_k else 0
        if _m("attn_sinks", name):
            return [g_head]
        if _m("q_weight", name) or _m("q_bias", name):
            return [g_q]
        if _m("attn_out_weight", name):
            return [g_head * head_v]
        if _m("attn_gate_weight", name):
            return [g_head if t.shape[1] == p.n_head[il] else g_q]
        g_kv = g_q // n_gqa if n_gqa else 0
        g_v = (g_kv // head_k) * head_v if head_k else 0
        if _m("kv_weight", name) or _m("kv_bias", name) or _m("kv_cache", name):
            is_v = "attn_v" in name or "cache_v" in name
            return [g_v if is_v else g_kv]
        if _m("qkv_weight", name) or _m("qkv_bias", name):
            return [g_q, g_kv, g_v] if n_segments == 3 else [g_q, g_kv]
        if any(_m(k, name) for k in ("ffn_up_weight", "ffn_up_bias", "ffn_gate_weight", "ffn_gate_bias",
                                     "ffn_gate_up_weight", "ffn_down_weight")):  # fmt: skip
            return [math.lcm(blck, 128)]
        return [1]

    def slices(self, t: _MetaTensor) -> tuple[int, list[int]]:
        """(axis, elements along that axis on each device); MIRRORED/PARTIAL: the full tensor everywhere."""
        axis, ref_type, il, rotation = self.axis_of(t)
        if axis in (MIRRORED, PARTIAL):
            return axis, []
        n = self.n
        scan: list[np.float32] = []
        for j in range(n):
            v = self.shares[(j + rotation) % n]
            scan.append(np.float32(v + scan[j - 1]) if j > 0 else v)
        segments = self._segments(t, axis, il)
        granularity = self._granularity(t, GGML_QUANT_SIZES[ref_type][0], il, len(segments))
        per_device = [0] * n
        for (ne_s, nr_s), g_s in zip(segments, granularity):
            low = 0
            for j in range(n - 1):
                if scan[-1] == 0:
                    high = ne_s * (j + 1) // n
                else:  # int64 * float / float in C++: float32 arithmetic, truncated
                    high = int(np.float32(np.float32(ne_s) * scan[j]) / scan[-1])
                if g_s and high % g_s:
                    high -= high % g_s
                per_device[(j + rotation) % n] += (high - low) * nr_s
                low = high
            per_device[(n - 1 + rotation) % n] += (ne_s - low) * nr_s
        return axis, per_device


# tbrpc's FFN split also cuts the output head by vocabulary rows (a tied
# output is token_embd's copy on the meta device; the input layer is on the head).
OUTPUT_CUT = {"output.weight": 1, "token_embd.weight": 1, "output.bias": 0}


class _FfnSplitter:
    """tbrpc's own rules for the meta device (ggml_backend/split_rules.c,
    ``Cluster.ffn_split_device``): the feed-forward weights are cut --
    ffn_gate*/ffn_up* by rows (axis 1), ffn_down* by columns (axis 0), dense,
    routed and shared experts alike, in multiples of ``granularity`` -- and
    the output head by vocabulary rows; every other tensor (attention, norms,
    router, KV cache) is whole on every node."""

    def __init__(self, shares: Sequence[float], granularity: int) -> None:
        total = np.float32(0)
        for s in shares:
            total = np.float32(total + np.float32(s))
        self.shares = [np.float32(np.float32(s) / total) for s in shares]
        self.granularity = granularity

    @staticmethod
    def axis(name: str) -> int | None:
        if name in OUTPUT_CUT:
            return OUTPUT_CUT[name]
        if any(k in name for k in ("ffn_gate_inp", "ffn_norm", "exp_probs")) or ".bias" in name:
            return None
        if "ffn_gate" in name or "ffn_up" in name:
            return 1
        if "ffn_down" in name:
            return 0
        return None

    def slices(self, t: _MetaTensor) -> tuple[int, list[int]]:
        axis = self.axis(t.name)
        if axis is None or axis >= len(t.shape) or t.shape[axis] % self.granularity:
            return MIRRORED, []
        units = t.shape[axis] // self.granularity
        counts, done, upto = [], 0, np.float32(0)
        for j, share in enumerate(self.shares):  # cumulative rounding in float32, as the C code does
            upto = np.float32(upto + share)
            cut = units if j + 1 == len(self.shares) else int(np.float32(upto * np.float32(units)) + np.float32(0.5))
            counts.append((cut - done) * self.granularity)
            done = cut
        return axis, counts


def ffn_granularity(model: GGUFModel) -> int:
    """The cut unit for tbrpc's FFN split: the least common multiple of the
    FFN tensors' quant block sizes (a cut by columns must not split a block;
    the output, cut by vocabulary rows, sets none)."""
    g = 1
    for t in model.tensors:
        if t.name not in OUTPUT_CUT and _FfnSplitter.axis(t.name) is not None:
            g = math.lcm(g, GGML_QUANT_SIZES[t.ggml_type][0])
    return g


def _slice_bytes(t: _MetaTensor, axis: int, count: int) -> int:
    shape = list(t.shape)
    shape[axis] = count
    if count == 0:
        return 0
    if axis == 0:
        block, size = GGML_QUANT_SIZES[t.ggml_type]
        if count % block:
            raise PlanError(f"tensor mode: {t.name} would be cut inside a {t.ggml_type.name} block ({count} values)")
    return tensor_nbytes(t.ggml_type, shape)


@dataclass
class TensorModeNode:
    """One node's part of a tensor split, before compute and host buffers."""

    split_bytes: int  # its slices of the split weight matrices (unpadded)
    replicated_bytes: int  # full copies of every mirrored tensor (unpadded)
    weights_bytes: int  # both, each tensor padded to ggml's alignment: what the node allocates
    kv_bytes: int


@dataclass
class TensorPlan:
    """What a tensor split costs beyond memory: all-reduces and the bytes they move.

    Per generated token (one token per all-reduce): the meta backend runs each
    layer as subgraphs on every node and all-reduces a partial sum after
    attention (attn_output cut by rows) and after the FFN (ffn_down cut by
    rows; routed and shared experts merged into one), each an F32 vector of
    n_embd values.  When every device is a TBRPC node (head_device="none"),
    tbrpc's comm provider does it: each node sends its partial to every other
    node, N(N-1) transfers.  When the head's own device is one of them, the
    meta backend asks that device's registry, which has no all-reduce, and
    falls back to its butterfly of node-to-node copies.
    """

    shares: list[float]  # tensor_split
    split_bytes: int  # the split tensors, whole (sum over nodes of their slices)
    replicated_bytes: int  # the mirrored tensors, whole (every node holds them)
    all_reduces_per_token: int
    all_reduce_bytes: int  # one all-reduce's tensor at one token: n_embd x 4
    all_reduce_bytes_per_token: int
    all_reduce_path: str  # "tbrpc" (tbrpc's ALLREDUCE, node to node) or "butterfly" (the meta backend's fallback)
    copies_per_all_reduce: int  # node-to-node transfers of one all-reduce on that path
    node_to_node_bytes_per_token: int  # bytes those transfers move per token, all nodes together
    logits_bytes_per_token: int  # the vocab slices the head gathers: n_vocab x 4
    reduce_buffer_bytes: int  # per node, device memory: the meta backend's ceil(log2 N) receive buffers (one ubatch)
    scratch_bytes: list[int]  # per node, its process's heap: tbrpc's ALLREDUCE scratch (2 or 3 partials of one ubatch)
    all_reduce_shape: str = "mesh"  # tbrpc's all-reduce: "mesh" (every node to every other) or "ring" (neighbours only)
    granularity: int = 0  # ffn split: the cut unit (lcm of the FFN tensors' block sizes); 0 for llama.cpp's rules
    output_cut: bool = True  # the output head is cut by vocabulary rows (ffn split: when n_vocab is a multiple of granularity)
    groups: int = 1  # ffn split: groups of consecutive nodes, layer-split (the hybrid); an all-reduce stays in one group


def tbrpc_copies(n: int) -> int:
    """Transfers of one all-reduce by tbrpc's comm provider: every node to every other."""
    return n * (n - 1)


def ring_copies(n: int) -> int:
    """Transfers of one ring all-reduce (node_links.c): n - 1 reduce-scatter and n - 1 all-gather
    steps, in each of which every node sends one chunk (1/n of the vector) to the next."""
    return 2 * n * (n - 1)


def fallback_copies(n: int) -> int:
    """Node-to-node copies of one all-reduce in ggml-backend-meta's fallback:
    fold the excess over a power of two in, butterfly rounds, copy back."""
    if n < 2:
        return 0
    p2 = 1 << (n.bit_length() - 1)
    return 2 * (n - p2) + p2 * (p2.bit_length() - 1)


def _meta_tensors(model: GGUFModel, p: ArchParams, layout: WeightLayout, layers: tuple[int, int] | None = None,
                  output: bool = True) -> list[_MetaTensor]:
    """The weights llama.cpp puts on the meta device: everything but the input
    layer (token embeddings stay on the head's CPU) and unloaded MTP blocks; a
    tied output is a duplicate of token_embd (mirrored under its own name).
    ``layers`` (first, last): only those blocks; ``output``: with the output
    layer (a hybrid's groups: the last group's meta device holds it)."""
    out: list[_MetaTensor] = []
    for t in model.tensors:
        il = t.block
        if il is not None and not layout.layers[il].loaded:
            continue
        if il is not None and layers is not None and not layers[0] <= il <= layers[1]:
            continue
        if il is None and (t.name.startswith(_INPUT_TENSORS) or not output):
            continue
        out.append(_MetaTensor(t.name, t.ggml_type, t.shape))
    if layout.output_tied and output:
        embd = model.tensor("token_embd.weight")
        assert embd is not None
        out.append(_MetaTensor(embd.name, embd.ggml_type, embd.shape))
    return out


def check_groups(split: str | None, n_nodes: int, groups: int, shares_given: bool = False) -> None:
    """TensorSplitError (a PlanError whose message says the way out) unless ``groups`` of
    ``n_nodes`` make a layer+tensor hybrid (or ``groups`` is 1): an ffn split, groups of 2 or
    more nodes, as many in every group, and no shares of one's own."""
    if groups == 1:
        return
    if split != "ffn":
        raise TensorSplitError(f"groups: only an ffn split takes groups (the layer+tensor hybrid), not a {split or 'layer'} split")
    if groups < 1 or n_nodes % groups or n_nodes // groups < 2:
        raise TensorSplitError(f"groups: the hybrid is an ffn split over groups of 2 or more nodes each, as many nodes in every "
                        f"group; {n_nodes} nodes cannot make {groups} such groups")
    if shares_given:
        raise TensorSplitError("groups: the hybrid gives every group an equal share of the layers and every node of a group an "
                        "equal share of its FFN; it takes no tensor_split")


def _hybrid_nodes(model: GGUFModel, p: ArchParams, layout: WeightLayout, c: ContextParams, nodes: Sequence[Node],
                  margin: int, groups: int, ring: bool = False) -> tuple[list[NodePlan], list[float], TensorPlan]:
    """Node plans for the layer+tensor hybrid: ``groups`` groups of consecutive nodes, each one
    meta device of tbrpc's FFN rules (split_rules.c) over equal shares; the groups layer-split as
    llama.cpp cuts one equal share per group (the last holds the output layer). A node holds its
    group's layers: their FFN and experts cut, everything else of them whole, their KV whole; the
    compute buffer of a layer-split device holding those layers (the meta backend gives every node
    of the group the whole of it), and the receive buffers and scratch of an all-reduce among the
    group's nodes."""
    k = len(nodes) // groups
    ranges = _ranges_of_split([1.0] * groups, p.n_layer_all, "none")
    ring = ring and k > 2
    reduce_b, scratch = _reduce_buffers(p, c, nodes, k, ring, tbrpc=True)
    plans: list[NodePlan] = []
    split_total = replicated = 0
    for g, (first, last) in enumerate(ranges):
        parts, g_split, g_replicated = tensor_mode_nodes(model, p, layout, c, [1.0] * k, ffn_only=True,
                                                         layers=(first, last), output=g == groups - 1)
        split_total += g_split
        replicated += g_replicated
        # as for the FFN split's one meta device: the single-device compute buffer of its layers, which
        # every node of the group allocates whole, the graph inputs included
        compute = compute_bytes(p, range(first, last + 1), c, has_output=g == groups - 1, has_input=True)
        for j, part in enumerate(parts):
            i = g * k + j
            node = nodes[i]
            total = part.weights_bytes + part.kv_bytes + compute + reduce_b + scratch[i]
            plans.append(NodePlan(
                name=node.name, usable_bytes=node.usable_bytes, limit=node.limit_source, layers=(first, last),
                weights_bytes=part.weights_bytes, kv_bytes=part.kv_bytes, compute_bytes=compute + reduce_b + scratch[i],
                host_bytes=0, total_bytes=total, headroom_bytes=node.usable_bytes - margin - total,
                shards=_shards_for(model, layout.output_tied and g == groups - 1, first, last, p.n_layer_all),
                device=f"TBRPC{i}", memory_from=node.memory_from, reported_bytes=node.reported_bytes,
                split_bytes=part.split_bytes, replicated_bytes=part.replicated_bytes, draft_bytes=0,
            ))  # fmt: skip
    split_list, _ = _tensor_split(ranges, p.n_layer_all, "none")
    tensor = _tensor_plan(model, p, [1.0] * k, split_total, replicated, "tbrpc", ring, reduce_b, scratch,
                          ffn_only=True, groups=groups)
    return plans, split_list, tensor


def _reduce_buffers(p: ArchParams, c: ContextParams, nodes: Sequence[Node], n: int, ring: bool,
                    tbrpc: bool) -> tuple[int, list[int]]:
    """An all-reduce among ``n`` nodes: the meta backend's ceil(log2 n) receive buffers per node (its
    fallback's), and per node the heap scratch of tbrpc's ALLREDUCE (node_links.c) when it runs: the
    ring's one piece of a step, the mesh's own partial and a peer's; on a GPU also the sum. Buffers
    are sized for the largest partial sum, one ubatch."""
    partial = pad(c.n_tokens * p.n_embd * F32, TENSOR_ALIGN)
    reduce_b = math.ceil(math.log2(n)) * partial if n > 1 else 0
    scratch = [(RING_PIECE + (0 if node.kind == "cpu" else partial) if ring else
                (2 if node.kind == "cpu" else 3) * partial) if tbrpc else 0 for node in nodes]
    return reduce_b, scratch


def _tensor_plan(model: GGUFModel, p: ArchParams, shares: Sequence[float], split_total: int, replicated: int,
                 path: str, ring: bool, reduce_b: int, scratch: list[int], ffn_only: bool, groups: int = 1) -> TensorPlan:
    """A tensor split's traffic and buffers, among ``len(shares)`` nodes (in the hybrid: a group's)."""
    n = len(shares)
    n_reduce = all_reduces_per_token(model, p, ffn_only)
    s = p.n_embd * F32
    copies = (ring_copies(n) if ring else tbrpc_copies(n)) if path == "tbrpc" else fallback_copies(n)
    moved = n_reduce * 2 * (n - 1) * s if ring else n_reduce * copies * s   # a ring's transfers carry 1/n each
    return TensorPlan(
        shares=list(shares),
        split_bytes=split_total,
        replicated_bytes=replicated,
        all_reduces_per_token=n_reduce,
        all_reduce_bytes=s,
        all_reduce_bytes_per_token=n_reduce * s,
        all_reduce_path=path,
        copies_per_all_reduce=copies,
        node_to_node_bytes_per_token=moved,
        all_reduce_shape="ring" if ring else "mesh",
        logits_bytes_per_token=p.n_vocab * F32,
        reduce_buffer_bytes=reduce_b,
        scratch_bytes=scratch,
        granularity=ffn_granularity(model) if ffn_only else 0,
        output_cut=not ffn_only or p.n_vocab % ffn_granularity(model) == 0,
        groups=groups,
    )


def tensor_mode_nodes(model: GGUFModel, p: ArchParams, layout: WeightLayout, c: ContextParams,
                      shares: Sequence[float], ffn_only: bool = False, layers: tuple[int, int] | None = None,
                      output: bool = True) -> tuple[list[TensorModeNode], int, int]:
    """Per node: slices, replicas, weights and KV under llama.cpp's tensor split
    (or, ``ffn_only``, tbrpc's FFN split) with these shares; plus the whole
    split and replicated bytes. ``layers`` and ``output``: one group of a
    hybrid, holding those layers (and the output layer, if so)."""
    splitter: _MetaSplitter | _FfnSplitter = (
        _FfnSplitter(shares, ffn_granularity(model)) if ffn_only else _MetaSplitter(model, p, shares))
    n = len(shares)
    split = [0] * n
    weights = [0] * n
    kv = [0] * n
    replicated = split_total = 0
    for t in _meta_tensors(model, p, layout, layers, output):
        axis, counts = splitter.slices(t)
        full = tensor_nbytes(t.ggml_type, t.shape)
        if not counts:
            replicated += full
            for j in range(n):
                weights[j] += pad(full, TENSOR_ALIGN)
            continue
        split_total += full
        for j, count in enumerate(counts):
            b = _slice_bytes(t, axis, count)
            split[j] += b
            weights[j] += pad(b, TENSOR_ALIGN)
    cache_types = (CACHE_TYPES[c.cache_type_k], CACHE_TYPES[c.cache_type_v])
    first, last = layers if layers is not None else (0, p.n_layer - 1)
    for il in range(first, min(last, p.n_layer - 1) + 1):
        cells = _n_kv(p, il, c)
        for kind, elems, ctype in (("k", p.kv_row_elems(il)[0], cache_types[0]), ("v", p.kv_row_elems(il)[1], cache_types[1])):
            if not elems:
                continue
            t = _MetaTensor(f"cache_{kind}_l{il}", ctype, (elems, cells, 1))
            axis, counts = splitter.slices(t)
            for j in range(n):
                b = tensor_nbytes(ctype, t.shape) if not counts else _slice_bytes(t, axis, counts[j])
                kv[j] += pad(b, TENSOR_ALIGN)
    nodes = [TensorModeNode(split[j], replicated, weights[j], kv[j]) for j in range(n)]
    return nodes, split_total, replicated


def all_reduces_per_token(model: GGUFModel, p: ArchParams, ffn_only: bool = False) -> int:
    """One after each layer's attention (attn_output is cut by rows) and one after
    its FFN (ffn_down / ffn_down_exps cut by rows; shared experts, mirrored,
    join the routed experts' reduction).  ``ffn_only``: the FFN's alone."""
    count = 0
    for il in range(p.n_layer):
        if not ffn_only and model.tensor(f"blk.{il}.attn_output.weight") is not None:
            count += 1
        if model.tensor(f"blk.{il}.ffn_down.weight") is not None or model.tensor(f"blk.{il}.ffn_down_exps.weight") is not None:
            count += 1
    return count


def check_tensor_mode(arch: str, n_head_kv: Sequence[int] = (), instead: str = "--split layer") -> None:
    """Refuse what llama.cpp's tensor split refuses or aborts on. ``n_head_kv``:
    KV heads per layer (0 where a layer has no attention), when known and not MLA;
    ``instead``: the split to advise for a model llama.cpp would abort on.

    llama.cpp cuts attention by whole KV heads, so a layer with one KV head is
    not shared at all: one node gets the whole of it. Worse, for such a model
    (Gemma 3 270M) the meta device of the llama.cpp in 0.3.36 aborts the
    process at the first one-token decode: the reshape of the [head_dim] K row
    into [head_dim, 1 head, 1 token] has one dimension by ggml_n_dims, so its
    rule (ggml-backend-meta.cpp:622) keeps the split on axis 0, inside the
    head, and the per-row rule of the k-norm RMS_NORM that follows asserts
    (GGML_ASSERT(src_ss[0].axis != GGML_BACKEND_SPLIT_AXIS_0), :543)."""
    if arch in TENSOR_REFUSED_ARCHS:
        raise TensorSplitError(
            f"tensor split: llama.cpp refuses architecture '{arch}' in tensor mode (llm_arch_supports_sm_tensor is false "
            f"for it in the llama.cpp llama-cpp-python 0.3.36 ships"
            + ("; for deepseek2 (Kimi K2, DeepSeek V3) its MLA attention has no tensor split rules"
               if arch == "deepseek2" else "")
            + "); use --split layer"
            + (", or --split ffn: tbrpc's own split of the experts and FFN, attention whole on every node"
               if arch == "deepseek2" else ""))
    if arch in TENSOR_UNMODELLED_ARCHS:
        raise TensorSplitError(f"tensor split: architecture '{arch}' has split rules of its own in llama.cpp that the planner "
                        "does not model; use --split layer")
    if any(n == 1 for n in n_head_kv):
        raise TensorSplitError(
            f"tensor split: this {arch} model has one KV head per layer, which llama.cpp's tensor split gives whole "
            f"to one node (its meta device in llama-cpp-python 0.3.36 aborts on it at the first generated token); "
            f"use {instead}")


def _one_unit_wide(t: _MetaTensor, axis: int) -> bool:
    """Whether ``t`` is one block (axis 0) or one row (axis 1) wide along a cut:
    then its stride above the cut equals the stride at it."""
    width = t.shape[axis] if axis < len(t.shape) else 1
    return (width // GGML_QUANT_SIZES[t.ggml_type][0] if axis == 0 else width) == 1


def check_empty_slices(model: GGUFModel, p: ArchParams, layout: WeightLayout, n_devices: int,
                       ffn_only: bool = False) -> None:
    """Refuse a split the meta buffer of the llama.cpp in 0.3.36 aborts on while loading.

    A slice gets the tensor's strides, those above the cut scaled by the
    slice's share (ggml_backend_meta_buffer_init_tensor_impl: only
    ``nb[i] > nb[axis]``). A weight one block wide along the cut (a Q4_K
    ffn_down whose input is 256 wide: ``nb[1] == nb[0]``) keeps its full row
    stride on every slice, and a cut in whole blocks leaves all of it on one
    device; the upload (ggml_backend_meta_buffer_set_tensor) then writes a
    row of that stride to each device that holds none of it, and
    ggml_backend_tensor_set_2d aborts (ggml-backend.cpp:382, "tensor write out
    of bounds"). Any shares over two or more devices leave some device empty,
    so equal shares stand for all."""
    if n_devices < 2:
        return
    shares = [1.0] * n_devices
    splitter: _MetaSplitter | _FfnSplitter = (
        _FfnSplitter(shares, ffn_granularity(model)) if ffn_only else _MetaSplitter(model, p, shares))
    bad = []
    for t in _meta_tensors(model, p, layout):
        axis, counts = splitter.slices(t)
        if counts and 0 in counts and _one_unit_wide(t, axis):
            bad.append((t, axis))
    if not bad:
        return
    t, axis = bad[0]
    block = GGML_QUANT_SIZES[t.ggml_type][0]
    width = (f"{t.shape[0]} values wide, one {t.ggml_type.name} block ({block} values)" if axis == 0
             else f"one row ({t.ggml_type.name})")
    others = f" (and {len(bad) - 1} more like it)" if len(bad) > 1 else ""
    mode = "ffn split: tbrpc's FFN split" if ffn_only else "tensor split: llama.cpp's tensor split"
    instead = "--split layer" if ffn_only else _instead_of_tensor(model, p, layout, n_devices)
    raise TensorSplitError(
        f"{mode} cuts {t.name}{others} along dimension {axis} in whole {'blocks' if axis == 0 else 'rows'}, "
        f"and it is {width}: "
        f"over {n_devices} nodes all but one of them get none of it, and the meta device of llama-cpp-python "
        f"0.3.36 aborts while loading it (a slice one block wide keeps the full row stride, so the upload writes "
        f"past an empty slice: ggml-backend.cpp:382, tensor write out of bounds); use {instead}")


def _instead_of_tensor(model: GGUFModel, p: ArchParams, layout: WeightLayout, n_devices: int) -> str:
    """What to use where llama.cpp's tensor split aborts: tbrpc's FFN split
    (faster to decode than a layer split) when it can be planned for this
    model over these devices, else the layer split."""
    try:
        check_empty_slices(model, p, layout, n_devices, ffn_only=True)
    except TensorSplitError:
        return "--split layer"
    return "--split ffn (tbrpc's own split of the FFN and output, attention whole on every node; head device none)"


def check_model_split(model: GGUFModel, split: str, n_devices: int, layout: WeightLayout | None = None) -> None:
    """Refuse a ``"layer"``, ``"tensor"`` or ``"ffn"`` split of a model file over
    ``n_devices`` nodes that llama.cpp refuses or aborts on: more nodes than
    layers (layer split) or than its meta device takes, its architecture
    and KV heads (check_tensor_mode, tensor split), its weights' widths along
    the cuts (check_empty_slices). ``layout``: the weights loaded (default:
    without MTP blocks)."""
    params = arch_params(model)
    if split == "layer":
        check_layer_count(params, n_devices)
        return
    if split == "tensor" and n_devices > META_MAX_DEVICES:
        raise TensorSplitError(f"tensor split: llama.cpp's meta device takes at most {META_MAX_DEVICES} devices, "
                               f"not {n_devices}")
    layout = layout or weight_layout(model, params)
    if split == "ffn":
        if not 2 <= n_devices <= META_MAX_DEVICES:   # tbrpc's meta device (split_rules.c): 2 nodes or more
            raise TensorSplitError(f"ffn split: tbrpc's FFN split cuts the FFN across 2 to {META_MAX_DEVICES} nodes, "
                                   f"not {n_devices}; use --split layer")
        check_empty_slices(model, params, layout, n_devices, ffn_only=True)
        return
    refused = params.arch in TENSOR_REFUSED_ARCHS | TENSOR_UNMODELLED_ARCHS
    instead = "--split layer" if refused else _instead_of_tensor(model, params, layout, n_devices)
    check_tensor_mode(params.arch, () if params.is_mla else params.n_head_kv, instead)
    check_empty_slices(model, params, layout, n_devices)


def check_layer_count(params: ArchParams, n_nodes: int) -> None:
    """A layer split gives every node at least one layer: refuse more nodes than the model has layers."""
    if n_nodes > params.n_layer_all:
        raise PlanError(f"{n_nodes} nodes but only {params.n_layer_all} layers to share: a layer split gives every "
                        f"node at least one layer; use at most {params.n_layer_all} nodes")


# --- public API -------------------------------------------------------------------


def _context(model: GGUFModel, params: ArchParams, ctx: int | None, **kwargs: Any) -> ContextParams:
    if ctx is None:
        ctx = min(DEFAULT_CTX, params.n_ctx_train or DEFAULT_CTX)
    if ctx < 1:
        raise PlanError(f"context must be positive, got {ctx}")
    for key in ("cache_type_k", "cache_type_v"):
        kwargs[key] = cache_type_name(kwargs[key])
    if kwargs["flash_attn"] is None:
        # A quantized V cache needs flash attention in llama.cpp; otherwise follow llama-cpp-python's default (off).
        kwargs["flash_attn"] = kwargs["cache_type_v"] not in ("f16", "f32", "bf16")
    elif not kwargs["flash_attn"] and kwargs["cache_type_v"] not in ("f16", "f32", "bf16") and not params.is_mla:
        raise PlanError("a quantized V cache requires flash attention in llama.cpp")
    return ContextParams(ctx=ctx, **kwargs)


def plan(
    gguf: str | os.PathLike[str] | GGUFModel,
    nodes: Sequence[Node],
    *,
    ctx: int | None = None,
    cache_type_k: str = "f16",
    cache_type_v: str = "f16",
    ubatch: int = defaults.BATCH,
    batch: int | None = None,
    flash_attn: bool | None = None,
    swa_full: bool = True,
    margin: int | str = DEFAULT_MARGIN,
    head_device: str = defaults.HEAD_DEVICE,
    load_mtp: bool = False,
    explain_shortfall: bool = True,
    split: str = "layer",
    groups: int = 1,
    draft_model: str | os.PathLike[str] | GGUFModel | None = None,
    draft_ctx: int | None = None,
    all_logits: bool | None = None,
    tensor_split: Sequence[float] | None = None,
    allreduce: str = "mesh",
    balance: str = "compute",
) -> Plan:
    """Plan how ``gguf`` splits over ``nodes`` (head first) at context ``ctx``.

    ``allreduce``: the shape of tbrpc's all-reduce in a tensor or FFN split,
    "mesh" (every node to every other) or "ring" (neighbours only), as
    ``spec.allreduce_of`` says the cluster's `links` make it.

    ``head_device`` says how the head runs its own layers: ``"gpu"`` (a
    device such as Metal's MTL0, listed first in tensor_split), ``"cpu"``
    (the CPU backend; its layers are the ones n_gpu_layers leaves out), or
    ``"none"`` (the default, defaults.HEAD_DEVICE): the head runs no layers
    and ``nodes`` are all remote devices (TBRPC0 first), as with
    ``tbrpc.connect`` + ``n_gpu_layers=-1``, ``tbrpc launch`` and
    ``tbrpc.Llama``; the head's own bytes are in ``Plan.head``.

    ``split``: ``"layer"`` (contiguous layer ranges, llama.cpp's
    LLAMA_SPLIT_MODE_LAYER) or ``"tensor"`` (every layer cut across all nodes,
    LLAMA_SPLIT_MODE_TENSOR; needs flash attention; ``tensor_split`` forces the
    shares, else equal shares, or shares by free memory when equal ones do not
    fit), or ``"ffn"`` (tbrpc's own rules: the FFN, experts and output cut,
    the rest whole on every node); ``groups`` > 1 with ``"ffn"``: that split
    within groups of consecutive nodes, the groups layer-split (the
    layer+tensor hybrid, ``_hybrid_nodes``).  ``draft_model``: a draft GGUF the head also runs (``tbrpc launch
    --draft-model``), planned on the head at ``draft_ctx`` (default: ``ctx``);
    it makes llama-cpp-python keep every token's logits (``all_logits``,
    default: on with a draft).

    ``balance`` (layer split): ``"compute"`` balances the nodes' prefill
    compute when such ranges fit, else memory; ``"memory"`` balances memory
    only.  A layer split given ``tensor_split`` (one share per node, head
    "none" or "gpu") is planned as llama.cpp cuts it (``llama_layer_devices``;
    ``Plan.balance`` "given"), so a caller's own shares are checked for fit
    like the planner's.  ``Plan.balance`` says which the ranges follow.
    """
    if not nodes:
        raise PlanError("no nodes to plan for")
    if allreduce not in ALLREDUCE_SHAPES:
        raise PlanError(f"allreduce must be one of {', '.join(repr(a) for a in ALLREDUCE_SHAPES)}, got {allreduce!r}")
    if head_device not in HEAD_DEVICES:
        raise PlanError(f"head_device must be one of {', '.join(repr(h) for h in HEAD_DEVICES)}, got {head_device!r}")
    if balance not in BALANCES:
        raise PlanError(f"balance must be one of {', '.join(repr(b) for b in BALANCES)}, got {balance!r}")
    if split not in SPLIT_MODES:
        raise PlanError(f"split must be one of {', '.join(repr(s) for s in SPLIT_MODES)}, got {split!r}")
    model = gguf if isinstance(gguf, GGUFModel) else load_gguf(gguf)
    params = arch_params(model)
    layout = weight_layout(model, params, load_mtp=load_mtp)
    check_groups(split, len(nodes), groups, tensor_split is not None)
    if split in ("tensor", "ffn"):
        if split == "ffn" and head_device != "none":
            raise PlanError("ffn split: tbrpc's meta device is made of TBRPC nodes only; use head_device 'none'")
        check_model_split(model, split, len(nodes) // groups, layout)
        if head_device == "cpu":
            raise TensorSplitError("tensor split: the head's CPU is not one of the devices llama.cpp cuts layers across; "
                            "use head_device 'gpu' or 'none'")
        if flash_attn is False:
            raise PlanError(f"{split} split needs flash attention (llama.cpp refuses to create a tensor-split context "
                            "without it; tbrpc's FFN split is tested with it only)")
        flash_attn = True
        if len(nodes) > META_MAX_DEVICES:
            raise TensorSplitError(f"tensor split: llama.cpp's meta device takes at most {META_MAX_DEVICES} devices, not {len(nodes)}")
    else:
        check_layer_count(params, len(nodes))
    if tensor_split is not None and (len(tensor_split) != len(nodes) or any(s < 0 for s in tensor_split) or not sum(tensor_split)):
        raise PlanError(f"tensor_split needs {len(nodes)} non-negative shares, not {list(tensor_split)}")
    margin_b = parse_size(margin)
    context = _context(
        model, params, ctx,
        ubatch=ubatch, batch=batch or default_batch(ubatch), cache_type_k=cache_type_k, cache_type_v=cache_type_v,
        flash_attn=flash_attn, swa_full=swa_full,
        all_logits=draft_model is not None if all_logits is None else all_logits,
    )  # fmt: skip
    draft = None
    if draft_model is not None:
        draft = draft_plan(draft_model, draft_ctx or context.ctx)
    draft_b = draft.total_bytes if draft else 0
    used: str | None = None  # layer split: what the ranges follow
    balance_note: list[str] = []
    if groups > 1:
        node_plans, split_list, tensor = _hybrid_nodes(model, params, layout, context, nodes, margin_b, groups,
                                                       ring=allreduce == "ring")
        ngl = params.n_layer_all + 1
    elif split in ("tensor", "ffn"):
        node_plans, split_list, tensor = _tensor_nodes(model, params, layout, context, nodes, margin_b, head_device,
                                                       draft_b, tensor_split, ffn_only=split == "ffn", ring=allreduce == "ring")
        ngl = params.n_layer_all + 1
    else:
        costs = _costs(params, layout, context, head_is_node=head_device != "none", head_extra=draft_b,
                       macs=layer_macs(model, params, layout))
        if tensor_split is not None:   # the user's shares, cut as llama.cpp will cut them
            ranges, used = _ranges_of_split(tensor_split, params.n_layer_all, head_device), "given"
        else:
            ranges, used = _balanced_ranges(costs, nodes, margin_b, by_compute=balance == "compute")
        if len(ranges) > 1:
            balance_note = [_balance_note(costs, ranges, used, asked=balance)]
        node_plans = [_node_plan(model, costs, nodes, i, r, margin_b, head_device) for i, r in enumerate(ranges)]
        split_list, ngl = _tensor_split(ranges, params.n_layer_all, head_device)
        tensor = None
    fits = all(n.headroom_bytes >= 0 for n in node_plans)
    head = None
    if head_device == "none":
        head = _head_plan(params, layout, context, draft_b)
    result = Plan(
        model_path=str(model.path),
        architecture=params.arch,
        n_layers=params.n_layer_all,
        weights_bytes=model.weights_bytes,
        shards=[str(s.path) for s in model.shards],
        context=context,
        margin_bytes=margin_b,
        nodes=node_plans,
        fits=fits,
        tensor_split=split_list,
        n_gpu_layers=ngl,
        head_device=head_device,
        notes=balance_note + _notes(params, layout, context, head_device, split, draft),
        head=head,
        split_mode=split,
        tensor=tensor,
        draft=draft,
        balance=used if len(nodes) > 1 else None,
    )
    if not fits and explain_shortfall:
        result.shortfall = _shortfall(model, result, nodes, params, layout, margin_b, head_device)
    return result


def draft_plan(gguf: str | os.PathLike[str] | GGUFModel, ctx: int) -> DraftPlan:
    """A draft model on the head's CPU, as ``tbrpc.draft.GGUFDraft`` loads it:
    every layer and the embeddings in plain CPU buffers, its own KV cache at
    ``ctx`` (F16, full-size SWA), llama-cpp-python's default batch (512) and
    flash attention (off), its own output buffer and score array."""
    model = gguf if isinstance(gguf, GGUFModel) else load_gguf(gguf)
    p = arch_params(model)
    layout = weight_layout(model, p)
    c = ContextParams(ctx=ctx)
    costs = _costs(p, layout, c, head_is_node=True)
    _, kv, compute, host = _node_need(costs, 0, 0, p.n_layer_all - 1)
    # Weights: every tensor it loads, each padded to ggml's alignment (a tied
    # output is a view of the same mapping on the CPU: no second copy).
    weights = sum(pad(t.n_bytes, TENSOR_ALIGN) for t in model.tensors if t.block is None or layout.layers[t.block].loaded)
    return DraftPlan(str(model.path), p.arch, ctx, weights, kv, compute, host, weights + kv + compute + host)


def _tensor_nodes(model: GGUFModel, p: ArchParams, layout: WeightLayout, c: ContextParams, nodes: Sequence[Node],
                  margin: int, head_device: str, draft_b: int, forced: Sequence[float] | None, ffn_only: bool = False,
                  ring: bool = False) -> tuple[list[NodePlan], list[float], TensorPlan]:
    """Node plans for a tensor split: equal shares (every node computes the
    same part of each layer, so none waits for another at the all-reduces),
    unless they do not fit and shares by free memory do."""
    n = len(nodes)
    # The meta backend allocates the whole single-device compute buffer on every node
    # (ggml_backend_meta_buffer_type_alloc_buffer), plus ceil(log2 N) receive buffers
    # for the all-reduce fallback, sized for the largest partial sum (one ubatch).
    full_compute = compute_bytes(p, range(p.n_layer_all), c, has_output=True, has_input=True)
    path = "tbrpc" if head_device == "none" and n > 1 else "butterfly"
    ring = ring and path == "tbrpc" and n > 2   # two nodes in a ring are a mesh (client.c, tbrpc_allreduce_choose)
    reduce_b, scratch = _reduce_buffers(p, c, nodes, n, ring, tbrpc=path == "tbrpc")

    def build(shares: Sequence[float]) -> tuple[list[NodePlan], int, int]:
        parts, split_total, replicated = tensor_mode_nodes(model, p, layout, c, shares, ffn_only)
        plans = []
        for i, (node, part) in enumerate(zip(nodes, parts)):
            is_head = i == 0 and head_device != "none"
            weights = part.weights_bytes + (layout.input_bytes if is_head else 0)
            host = host_bytes(p, c) if is_head else 0
            draft = draft_b if is_head else 0
            compute = full_compute + reduce_b + scratch[i]
            total = weights + part.kv_bytes + compute + host + draft
            if head_device == "none":
                device = f"TBRPC{i}"
            else:
                device = "GPU0 (head's own device, e.g. MTL0)" if i == 0 else f"TBRPC{i - 1}"
            plans.append(NodePlan(
                name=node.name, usable_bytes=node.usable_bytes, limit=node.limit_source, layers=(0, p.n_layer_all - 1),
                weights_bytes=weights, kv_bytes=part.kv_bytes, compute_bytes=compute, host_bytes=host,
                total_bytes=total, headroom_bytes=node.usable_bytes - margin - total,
                shards=_shards_for(model, is_head or layout.output_tied, 0, p.n_layer_all - 1, p.n_layer_all),
                device=device, memory_from=node.memory_from, reported_bytes=node.reported_bytes,
                split_bytes=part.split_bytes, replicated_bytes=part.replicated_bytes, draft_bytes=draft,
            ))  # fmt: skip
        return plans, split_total, replicated

    if forced is not None:
        shares = [float(s) for s in forced]
        plans, split_total, replicated = build(shares)
    else:
        shares = [1.0] * n
        plans, split_total, replicated = build(shares)
        if n > 1 and any(x.headroom_bytes < 0 for x in plans):
            # What each node has left for its slices once the parts every node holds whole are counted.
            fixed = [x.total_bytes - (x.split_bytes or 0) - x.kv_bytes for x in plans]
            room = [max(0, node.usable_bytes - margin - f) for node, f in zip(nodes, fixed)]
            if sum(room) and len(set(room)) > 1:
                by_room = [float(max(1, round(1000 * r / sum(room)))) for r in room]
                candidate = build(by_room)
                if min(x.headroom_bytes for x in candidate[0]) > min(x.headroom_bytes for x in plans):
                    shares, (plans, split_total, replicated) = by_room, candidate
    tensor = _tensor_plan(model, p, shares, split_total, replicated, path, ring, reduce_b, scratch, ffn_only=ffn_only)
    return plans, shares, tensor


def llama_layer_devices(tensor_split: Sequence[float], n_layer_all: int, n_gpu_layers: int) -> list[int]:
    """The device llama.cpp puts each layer on, the output layer (index n_layer_all) last; -1 = CPU.

    llama.cpp's own rule (llama-model.cpp load_tensors), in its float32: the
    shares' running sums over their total are split points, and layer il
    goes to the first device whose point exceeds (il - start) / n_offloaded
    (std::upper_bound), the first ``start`` layers staying on the CPU.
    """
    points = np.cumsum(np.array(tensor_split, dtype=np.float32), dtype=np.float32)
    points = (points / points[-1]).astype(np.float32)
    start = max(n_layer_all + 1 - n_gpu_layers, 0)
    offloaded = min(n_gpu_layers, n_layer_all + 1)
    devices = []
    for il in range(n_layer_all + 1):
        if il < start:
            devices.append(-1)
            continue
        devices.append(int(np.searchsorted(points, np.float32(il - start) / np.float32(offloaded), side="right")))
    return devices


def _ranges_of_split(tensor_split: Sequence[float], n_layer_all: int, head_device: str) -> list[tuple[int, int]]:
    """A layer split's ranges as llama.cpp cuts a given ``tensor_split`` (one share per node, every
    layer and the output offloaded: head_device "none" or "gpu"). PlanError when the shares leave a
    node without a layer, or put the output layer apart from the last one: the planner plans
    neither (a node holds at least one layer, the last node the output)."""
    if head_device == "cpu":
        raise PlanError("tensor_split for a layer split with head_device='cpu': give n_gpu_layers-style ranges by "
                        "planning without it (the plan's tensor_split then places the head's layers)")
    devices = llama_layer_devices(tensor_split, n_layer_all, n_layer_all + 1)
    n = len(tensor_split)
    ranges = []
    for d in range(n):
        mine = [il for il in range(n_layer_all) if devices[il] == d]
        if not mine:
            raise PlanError(f"tensor_split {list(tensor_split)} gives node {d} no layer (llama.cpp puts layers "
                            f"{_runs(devices[:n_layer_all])} on nodes 0..{n - 1}): give every node a share of at least "
                            f"one layer in {n_layer_all + 1}")
        ranges.append((mine[0], mine[-1]))
    if devices[n_layer_all] != n - 1:
        raise PlanError(f"tensor_split {list(tensor_split)} puts the output layer on node {devices[n_layer_all]}, "
                        f"not with the last layer on node {n - 1}")
    return ranges


def _runs(devices: Sequence[int]) -> str:
    """Consecutive layers on one device, as "0-8:0, 9-17:1"."""
    out, first = [], 0
    for il in range(1, len(devices) + 1):
        if il == len(devices) or devices[il] != devices[first]:
            out.append(f"{first}-{il - 1}:{devices[first]}" if il - 1 > first else f"{first}:{devices[first]}")
            first = il
    return ", ".join(out)


def _tensor_split(ranges: list[tuple[int, int]], n_layer_all: int, head_device: str) -> tuple[list[float], int]:
    """Layer counts per llama.cpp device; the last device also counts the output layer.

    llama.cpp assigns layer il (0..n_layer, n_layer being the output layer)
    to the first device whose cumulative split fraction exceeds
    il/(n_layer+1) (llama-model.cpp load_tensors); integer counts make those
    boundaries exact.  With a CPU head, layers below n_layer+1-n_gpu_layers
    stay on the CPU, which is where the head's range must start.
    """
    counts = [float(last - first + 1) for first, last in ranges]
    counts[-1] += 1  # the output "layer"
    if head_device == "cpu":
        return counts[1:] if len(counts) > 1 else [], n_layer_all + 1 - int(ranges[0][1] - ranges[0][0] + 1)
    return counts, n_layer_all + 1  # "gpu": the head's device first; "none": TBRPC0 first


def _head_plan(p: ArchParams, layout: WeightLayout, c: ContextParams, draft_b: int = 0) -> HeadPlan:
    weights, compute, host = layout.input_bytes, head_compute_bytes(p, c), host_bytes(p, c)
    return HeadPlan("CPU", weights, compute, host, weights + compute + host + draft_b, draft_b)


def _node_plan(model: GGUFModel, costs: _Costs, nodes: Sequence[Node], index: int, rng: tuple[int, int], margin: int, head_device: str) -> NodePlan:
    node = nodes[index]
    first, last = rng
    weights, kv, compute, host = _node_need(costs, index, first, last)
    draft = costs.head_extra if index == 0 and costs.head_is_node else 0
    total = weights + kv + compute + host + draft
    if head_device == "none":
        device = f"TBRPC{index}"  # every node is remote
    elif index == 0:
        device = "CPU" if head_device == "cpu" else "GPU0 (head's own device, e.g. MTL0)"
    else:
        device = f"TBRPC{index - 1}"  # remote nodes, in cluster order after the head
    return NodePlan(
        name=node.name,
        usable_bytes=node.usable_bytes,
        limit=node.limit_source,
        layers=(first, last),
        weights_bytes=weights,
        kv_bytes=kv,
        compute_bytes=compute,
        host_bytes=host,
        total_bytes=total,
        headroom_bytes=node.usable_bytes - margin - total,
        shards=_shards_for(model, index == 0 and costs.head_is_node, first, last, costs.params.n_layer_all),
        device=device,
        memory_from=node.memory_from,
        reported_bytes=node.reported_bytes,
        draft_bytes=draft,
    )


def _shards_for(model: GGUFModel, is_head: bool, first: int, last: int, n_layer_all: int) -> list[str]:
    """Shard files holding any tensor this node loads."""
    wanted: set[int] = set()
    for t in model.tensors:
        il = t.block
        if il is not None:
            mine = first <= il <= last
        elif t.name.startswith("token_embd."):
            mine = is_head or (last == n_layer_all - 1 and model.tensor("output.weight") is None)
        elif t.name.startswith(("output.", "output_norm.")):
            mine = last == n_layer_all - 1
        else:
            mine = True
        if mine:
            wanted.add(t.shard)
    return [model.shards[i].path.name for i in sorted(wanted)]


def _balance_note(costs: _Costs, ranges: list[tuple[int, int]], used: str, asked: str) -> str:
    """Which balance the layer ranges follow, and each node's share of the prefill compute."""
    total = costs.macs(0, costs.params.n_layer_all - 1) or 1
    shares = "/".join(f"{100 * costs.macs(first, last) / total:.0f}%" for first, last in ranges)
    if used == "compute":
        return (f"layers balanced by compute (prefill pipelines through the nodes): prefill multiply-adds per node "
                f"{shares}, nodes taken as equally fast")
    if used == "given":
        return (f"layers as the given tensor_split puts them (llama.cpp's rule): prefill multiply-adds per node "
                f"{shares}, prefill runs at the pace of the node with the most")
    why = "the compute-balanced ranges do not fit" if asked == "compute" else "as asked (balance='memory')"
    return (f"layers balanced by memory: {why}; prefill multiply-adds per node {shares}, prefill runs at the "
            f"pace of the node with the most")


def _notes(params: ArchParams, layout: WeightLayout, c: ContextParams, head_device: str, split: str = "layer",
           draft: DraftPlan | None = None) -> list[str]:
    notes: list[str] = []
    if split == "ffn":
        notes.append("ffn split (tbrpc's own rules, ggml_backend/split_rules.c): every node holds a slice of each dense "
                     "FFN, of every routed and shared expert and of the output head (by vocabulary), and a whole copy "
                     "of everything else -- attention, the whole KV cache, router, norms -- and a full-size compute "
                     "buffer; one all-reduce per layer.  tbrpc launch --split ffn and tbrpc.Llama(split=\"ffn\") load it.")
    if split == "tensor":
        notes.append("tensor split: every node holds a slice of every layer's attention and FFN matrices plus a whole "
                     "copy of the rest (norms, router, shared experts"
                     + (", the tied output" if layout.output_tied else "") + ") and a full-size compute buffer "
                     "(llama.cpp's meta backend allocates the single-device size on every device).")
    if draft is not None:
        notes.append(f"draft model {Path(draft.path).name} runs on the head's CPU ({format_size(draft.total_bytes)}, "
                     f"context {draft.ctx}); with a draft llama.cpp keeps logits for every token of a batch.")
    if params.is_mla:
        notes.append("MLA (deepseek2): the KV cache holds one latent K row per token and layer; no V cache.")
    if any(params.is_swa) and c.swa_full:
        notes.append("sliding-window layers get a full-size cache (llama.cpp default swa_full=true); --no-swa-full shrinks it.")
    if params.n_layer_nextn:
        notes.append(f"{params.n_layer_nextn} MTP block(s) in the file are not loaded (llama.cpp default load_mtp=false).")
    if head_device == "none":
        notes.append("the head runs no layers: it keeps the token embeddings, graph inputs and logits (see 'head'), "
                     "not checked against any node's memory.")
    if layout.output_tied and split == "layer":
        notes.append("output layer is tied to the token embeddings: the last node holds its own copy (unless it is the head).")
    if not c.flash_attn and split == "layer":
        notes.append("flash attention off (llama-cpp-python default): compute buffers grow with ctx x ubatch x heads.")
    return notes


# --- when it does not fit -----------------------------------------------------------


def _shortfall(model: GGUFModel, result: Plan, nodes: Sequence[Node], params: ArchParams, layout: WeightLayout, margin: int, head_device: str) -> Shortfall:
    worst = min(result.nodes, key=lambda n: n.headroom_bytes)
    over = -worst.headroom_bytes
    total_need = sum(n.total_bytes for n in result.nodes) + margin * len(nodes)
    total_short = max(0, total_need - sum(n.usable_bytes for n in nodes))
    kwargs = _replan_kwargs(result, margin, head_device)
    max_ctx = _largest_fitting_ctx(model, nodes, result.context.ctx, kwargs)
    template = max(nodes, key=lambda n: n.usable_bytes)
    most = META_MAX_DEVICES if result.split_mode in ("tensor", "ffn") else params.n_layer_all
    min_nodes = _smallest_node_count(model, template, len(nodes), most, result.context.ctx, kwargs)
    message = (
        f"does not fit: {worst.name} ({result.part_of(worst)}) needs {format_size(worst.total_bytes)} + {format_size(margin)} margin "
        f"but has {format_size(worst.usable_bytes)} usable: over by {format_size(over)}"
    )
    if total_short:
        message += f"; the cluster as a whole is short by {format_size(total_short)}"
    return Shortfall(message, over, total_short, max_ctx, min_nodes, template.usable_bytes if min_nodes else None)


def _replan_kwargs(result: Plan, margin: int, head_device: str) -> dict[str, Any]:
    c = result.context
    return dict(
        cache_type_k=c.cache_type_k, cache_type_v=c.cache_type_v, ubatch=c.ubatch, batch=c.batch,
        flash_attn=c.flash_attn, swa_full=c.swa_full, margin=margin, head_device=head_device, explain_shortfall=False,
        split=result.split_mode, all_logits=c.all_logits,
        draft_model=result.draft.path if result.draft else None,
    )  # fmt: skip


def _largest_fitting_ctx(model: GGUFModel, nodes: Sequence[Node], ctx: int, kwargs: dict[str, Any]) -> int | None:
    """Binary search over multiples of 256 below the requested context."""
    lo, hi = 0, pad(ctx, KV_PAD) // KV_PAD  # in units of 256 tokens; hi is known not to fit
    if not plan(model, nodes, ctx=KV_PAD, **kwargs).fits:
        return None
    lo = 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if plan(model, nodes, ctx=mid * KV_PAD, **kwargs).fits:
            lo = mid
        else:
            hi = mid
    return lo * KV_PAD


def _smallest_node_count(model: GGUFModel, template: Node, start: int, n_layers: int, ctx: int, kwargs: dict[str, Any]) -> int | None:
    for count in range(start + 1, n_layers + 1):
        clones = [Node(f"{template.name}#{i}", template.memory_bytes, template.usable_bytes, template.limit_source) for i in range(count)]
        if plan(model, clones, ctx=ctx, **kwargs).fits:
            return count
    return None


# --- human output -------------------------------------------------------------------


def format_table(p: Plan) -> str:
    """The plan as a person reads it at a glance."""
    c = p.context
    lines = [
        f"model   {Path(p.model_path).name}  ({p.architecture}, {p.n_layers} layers, {format_size(p.weights_bytes)} weights, {len(p.shards)} shard(s))",
        f"context {c.ctx} tokens (KV {c.cache_type_k}/{c.cache_type_v}, ubatch {c.ubatch}, flash-attn {'on' if c.flash_attn else 'off'}), margin {format_size(p.margin_bytes)} per node",
        f"split   {p.split_mode}" + {"tensor": " (every layer cut across the nodes, llama.cpp split_mode=3)",
                                      "ffn": " (every layer's FFN and experts cut across the nodes, tbrpc's own rules)"
                                      if p.tensor is None or p.tensor.groups == 1 else
                                      " (groups of nodes layer-split, each cutting its layers' FFN and experts: the "
                                      "layer+tensor hybrid)"}
        .get(p.split_mode, " (contiguous layer ranges)"),
        "",
    ]
    tensor = p.split_mode in ("tensor", "ffn")
    draft = p.draft is not None
    header = ("node", "layers" if not tensor else "share", "weights", *(("split", "replicated") if tensor else ()),
              "kv", "compute", "host", *(("draft",) if draft else ()), "total", "usable", "headroom")
    rows = [header]
    hybrid = p.tensor is not None and p.tensor.groups > 1
    for i, n in enumerate(p.nodes):
        if hybrid and n.layers is not None:   # its group's layers, cut in equal shares among the group
            where = f"{n.layers[0]}-{n.layers[1]}, 1/{len(p.nodes) // p.tensor.groups}"
        elif tensor:
            where = f"{_share_text(p.tensor_split[i])}/{_share_text(sum(p.tensor_split))}"
        else:
            where = "-" if n.layers is None else f"{n.layers[0]}-{n.layers[1]}"
        rows.append((n.name, where, format_size(n.weights_bytes),
                     *((format_size(n.split_bytes or 0), format_size(n.replicated_bytes or 0)) if tensor else ()),
                     format_size(n.kv_bytes), format_size(n.compute_bytes), format_size(n.host_bytes),
                     *((format_size(n.draft_bytes),) if draft else ()),
                     format_size(n.total_bytes), format_size(n.usable_bytes), format_size(n.headroom_bytes)))  # fmt: skip
    if p.head is not None:  # the head process itself, when it runs no layers
        h = p.head
        rows.append(("(head)", "-", format_size(h.weights_bytes), *(("-", "-") if tensor else ()), "-",
                     format_size(h.compute_bytes), format_size(h.host_bytes),
                     *((format_size(h.draft_bytes),) if draft else ()), format_size(h.total_bytes), "-", "-"))  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for r in rows:
        lines.append("  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths))).rstrip())
    lines.append("")
    lines.append("usable memory:")
    lines.extend(_usable_lines(p))
    lines.append("")
    lines.append(f"verdict  {'FITS' if p.fits else 'DOES NOT FIT'}")
    if p.shortfall:
        s = p.shortfall
        lines.append(f"         {s.message}")
        lines.append(f"         largest context that fits: {s.max_ctx if s.max_ctx else 'none'}")
        if s.min_nodes:
            lines.append(f"         smallest cluster that fits at {c.ctx}: {s.min_nodes} x {format_size(s.min_nodes_size or 0)} usable")
        else:
            lines.append(f"         no number of such nodes fits at {c.ctx}")
    lines.append("")
    if tensor and p.tensor is not None:
        t = p.tensor
        if t.groups > 1:
            lines.append(f"hybrid        {t.groups} groups of {len(p.nodes) // t.groups} consecutive nodes, layer-split: "
                         f"{format_size(t.split_bytes)} cut across the nodes of the group holding it, "
                         f"{format_size(t.replicated_bytes)} held whole by every node of that group")
        else:
            lines.append(f"tensor split  {format_size(t.split_bytes)} cut across the nodes, {format_size(t.replicated_bytes)} "
                         "held whole by every node")
        after = "FFN" if p.split_mode == "ffn" else "attention and FFN"
        if t.groups > 1:
            after += f", among the {len(p.nodes) // t.groups} nodes of its group"
        lines.append(f"all-reduces   {t.all_reduces_per_token} per token (after each layer's {after}), "
                     f"{format_size(t.all_reduce_bytes)} each = {format_size(t.all_reduce_bytes_per_token)} per token; "
                     + (f"tbrpc's all-reduce ({t.all_reduce_shape}): {t.copies_per_all_reduce} node-to-node "
                        "transfers each" + (" of 1/N of it" if t.all_reduce_shape == "ring" else "")
                        if t.all_reduce_path == "tbrpc" else
                        f"the meta backend's butterfly (the head's device has no all-reduce): "
                        f"{t.copies_per_all_reduce} node-to-node copies each")
                     + f", {format_size(t.node_to_node_bytes_per_token)} per token")
        lines.append(f"logits        {format_size(t.logits_bytes_per_token)} per token "
                     + ("gathered from the nodes' vocab slices" if t.output_cut
                        else "read from one node (the output is whole on every node)"))
        lines.append("")
    if p.draft is not None:
        d = p.draft
        lines.append(f"draft model   {Path(d.path).name} ({d.architecture}) on the head's CPU at context {d.ctx}: "
                     f"weights {format_size(d.weights_bytes)}, kv {format_size(d.kv_bytes)}, compute "
                     f"{format_size(d.compute_bytes)}, host {format_size(d.host_bytes)} = {format_size(d.total_bytes)}")
        lines.append("")
    shares = [_num(x) for x in p.tensor_split]
    split_kw = "split_mode=3, flash_attn=True, " if p.split_mode == "tensor" else ""
    if p.split_mode == "ffn" and p.tensor is not None and p.tensor.groups > 1:
        k = len(p.nodes) // p.tensor.groups
        lines.append(f"library           metas = [tbrpc.cluster().ffn_split_device(endpoints[i:i + {k}], {[1] * k}, "
                     f"{p.tensor.granularity}) for i in range(0, {len(p.nodes)}, {k})]; Llama(devices=metas, "
                     f"split_mode=1, tensor_split={shares}, n_gpu_layers={p.n_gpu_layers}, flash_attn=True)")
    elif p.split_mode == "ffn":
        lines.append(f"library           meta = tbrpc.cluster().ffn_split_device(endpoints, {shares}, "
                     f"{p.tensor.granularity if p.tensor else 1}); Llama(devices=[meta], split_mode=1, "
                     f"n_gpu_layers={p.n_gpu_layers}, flash_attn=True)")
    else:
        lines.append(f"llama-cpp-python  n_gpu_layers={p.n_gpu_layers}, {split_kw}tensor_split={shares}")
    lines.append(f"llama.cpp CLI     {p.cli_args}")
    lines.append("device order      " + ", ".join(f"{n.device}={n.name}" for n in p.nodes))
    if p.head is not None:
        lines.append("head              runs no layers (token embeddings and logits on its CPU)")
    lines.append("")
    lines.append("shards per node:")
    for n in p.nodes:
        lines.append(f"  {n.name}: {_shard_summary(n.shards)}")
    if p.notes:
        lines.append("")
        lines.extend(f"note: {note}" for note in p.notes)
    return "\n".join(lines)


def _usable_lines(p: Plan) -> list[str]:
    """Per node: the usable figure the plan fits it into, and where that figure came from."""
    width = max(len(n.name) for n in p.nodes)
    size_width = max(len(format_size(n.usable_bytes)) for n in p.nodes)
    return [f"  {n.name.ljust(width)}  {format_size(n.usable_bytes).rjust(size_width)}  {n.limit}" for n in p.nodes]


def _num(x: float) -> int | float:
    return int(x) if float(x).is_integer() else x


def _shard_summary(names: list[str]) -> str:
    if len(names) <= 3:
        return ", ".join(names)
    return f"{names[0]} ... {names[-1]} ({len(names)} files)"
