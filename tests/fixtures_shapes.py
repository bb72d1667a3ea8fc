"""Shape-only GGUF fixtures: real trillion-parameter geometry, no disk used.

Each generated file has a genuine GGUF header (metadata + tensor infos) and a
data region that is a sparse hole made with ``truncate``: ``ls`` shows 600 GB,
``du`` shows a few MB.  The planner only reads headers, and llama.cpp can even
load these files with ``no_alloc`` (or mmap them: holes read as zeros), so the
same fixtures serve both the planner's tests and its calibration.

Everything here is written into a temporary directory by the tests; nothing
is checked in.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

from tbrpc.gguf_model import tensor_nbytes


@dataclass(frozen=True)
class TensorSpec:
    name: str
    ne: tuple[int, ...]  # ggml order, ne0 first
    qtype: QT

    @property
    def n_bytes(self) -> int:
        return tensor_nbytes(self.qtype, self.ne)


@dataclass
class ModelSpec:
    arch: str
    metadata: dict[str, Any]
    tensors: list[TensorSpec] = field(default_factory=list)

    @property
    def weights_bytes(self) -> int:
        return sum(t.n_bytes for t in self.tensors)


def write_shape_only(spec: ModelSpec, path: Path, max_shard_bytes: int = 0, vocab_strings: int = 0) -> list[Path]:
    """Write ``spec`` as one GGUF or a ``-0000N-of-0000M`` split set; return the shard paths.

    ``vocab_strings`` adds a tokenizer token list of that many strings, so the
    header is as large (and as slow to parse) as a real model's first shard.
    """
    writer = gguf.GGUFWriter(str(path), spec.arch, split_max_size=max_shard_bytes)
    for key, value in spec.metadata.items():
        _add_kv(writer, key, value)
    if vocab_strings:
        writer.add_array("tokenizer.ggml.tokens", [f"<t{i}>" for i in range(vocab_strings)])
    for t in spec.tensors:
        # GGUFWriter wants numpy order (outermost first); it writes ggml order back.
        writer.add_tensor_info(t.name, tuple(reversed(t.ne)), np.dtype(np.float32), t.n_bytes, raw_dtype=t.qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    assert writer.fout is not None
    shard_paths = [Path(f.name) for f in writer.fout]
    data_sizes = [sum(gguf.GGUFWriter.ggml_pad(ti.nbytes, writer.data_alignment) for ti in shard.values()) for shard in writer.tensors]
    for fout, data_size in zip(writer.fout, data_sizes):
        fout.flush()
        header_end = gguf.GGUFWriter.ggml_pad(fout.tell(), writer.data_alignment)
        # The hole: the file gets its full length without a byte of data written.
        os.truncate(fout.fileno(), header_end + data_size)
    writer.close()
    return shard_paths


def _add_kv(writer: gguf.GGUFWriter, key: str, value: Any) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    else:
        writer.add_array(key, list(value))


# --- DeepSeek V3 / Kimi K2 (llama.cpp arch `deepseek2`, MLA + MoE) -----------------


@dataclass(frozen=True)
class Deepseek2Geometry:
    n_layer: int = 61
    n_embd: int = 7168
    n_vocab: int = 163840
    n_head: int = 64
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope: int = 128
    qk_rope: int = 64
    v_head: int = 128
    n_ff: int = 18432  # dense FFN of the leading layers
    n_ff_exp: int = 2048
    n_expert: int = 384
    n_expert_used: int = 8
    n_expert_shared: int = 1
    n_dense_lead: int = 1
    n_ctx_train: int = 131072
    n_nextn: int = 0  # MTP blocks appended after the trunk


KIMI_K2 = Deepseek2Geometry()
DEEPSEEK_V3 = Deepseek2Geometry(n_vocab=129280, n_head=128, n_expert=256, n_dense_lead=3, n_ctx_train=163840)


def _more_bits(il: int, n_layer: int) -> bool:
    # llama.cpp's Q4_K_M rule: the first and last eighth, and every third layer between.
    return il < n_layer // 8 or il >= 7 * n_layer // 8 or (il - n_layer // 8) % 3 == 2


def deepseek2_spec(g: Deepseek2Geometry, name: str = "shape-only deepseek2") -> ModelSpec:
    """A Q4_K_M-like deepseek2 model with the MLA tensor layout of current converters."""
    n_layer_all = g.n_layer + g.n_nextn
    meta: dict[str, Any] = {
        "general.name": name,
        "general.file_type": 15,  # MOSTLY_Q4_K_M
        "deepseek2.block_count": n_layer_all,
        "deepseek2.context_length": g.n_ctx_train,
        "deepseek2.embedding_length": g.n_embd,
        "deepseek2.feed_forward_length": g.n_ff,
        "deepseek2.attention.head_count": g.n_head,
        "deepseek2.attention.head_count_kv": 1,
        "deepseek2.rope.freq_base": 50000.0,
        "deepseek2.attention.layer_norm_rms_epsilon": 1e-6,
        "deepseek2.expert_used_count": g.n_expert_used,
        "deepseek2.leading_dense_block_count": g.n_dense_lead,
        "deepseek2.vocab_size": g.n_vocab,
        "deepseek2.attention.q_lora_rank": g.q_lora_rank,
        "deepseek2.attention.kv_lora_rank": g.kv_lora_rank,
        "deepseek2.attention.key_length": g.kv_lora_rank + g.qk_rope,
        "deepseek2.attention.value_length": g.kv_lora_rank,
        "deepseek2.attention.key_length_mla": g.qk_nope + g.qk_rope,
        "deepseek2.attention.value_length_mla": g.v_head,
        "deepseek2.expert_feed_forward_length": g.n_ff_exp,
        "deepseek2.expert_count": g.n_expert,
        "deepseek2.expert_shared_count": g.n_expert_shared,
        "deepseek2.expert_weights_scale": 2.5,
        "deepseek2.expert_weights_norm": True,
        "deepseek2.expert_gating_func": 2,  # sigmoid
        "deepseek2.rope.dimension_count": g.qk_rope,
        # llama.cpp accepts "none" with a vocab size: dummy tokens, so these
        # fixtures load in llama.cpp for calibration without a real tokenizer.
        "tokenizer.ggml.model": "none",
    }
    if g.n_nextn:
        meta["deepseek2.nextn_predict_layers"] = g.n_nextn
    spec = ModelSpec("deepseek2", meta)
    add = spec.tensors.append
    add(TensorSpec("token_embd.weight", (g.n_embd, g.n_vocab), QT.Q4_K))
    for il in range(n_layer_all):
        for t in _deepseek2_block(g, il):
            add(t)
    add(TensorSpec("output_norm.weight", (g.n_embd,), QT.F32))
    add(TensorSpec("output.weight", (g.n_embd, g.n_vocab), QT.Q6_K))
    return spec


def _deepseek2_block(g: Deepseek2Geometry, il: int) -> Iterator[TensorSpec]:
    p = f"blk.{il}."
    down = QT.Q6_K if _more_bits(il, g.n_layer) else QT.Q4_K
    yield TensorSpec(p + "attn_norm.weight", (g.n_embd,), QT.F32)
    yield TensorSpec(p + "attn_q_a_norm.weight", (g.q_lora_rank,), QT.F32)
    yield TensorSpec(p + "attn_kv_a_norm.weight", (g.kv_lora_rank,), QT.F32)
    yield TensorSpec(p + "attn_q_a.weight", (g.n_embd, g.q_lora_rank), QT.Q4_K)
    yield TensorSpec(p + "attn_q_b.weight", (g.q_lora_rank, g.n_head * (g.qk_nope + g.qk_rope)), QT.Q4_K)
    yield TensorSpec(p + "attn_kv_a_mqa.weight", (g.n_embd, g.kv_lora_rank + g.qk_rope), QT.Q6_K)
    yield TensorSpec(p + "attn_k_b.weight", (g.qk_nope, g.kv_lora_rank, g.n_head), QT.Q8_0)
    yield TensorSpec(p + "attn_v_b.weight", (g.kv_lora_rank, g.v_head, g.n_head), QT.Q8_0)
    yield TensorSpec(p + "attn_output.weight", (g.n_head * g.v_head, g.n_embd), QT.Q4_K)
    yield TensorSpec(p + "ffn_norm.weight", (g.n_embd,), QT.F32)
    if il < g.n_dense_lead:
        yield TensorSpec(p + "ffn_gate.weight", (g.n_embd, g.n_ff), QT.Q4_K)
        yield TensorSpec(p + "ffn_up.weight", (g.n_embd, g.n_ff), QT.Q4_K)
        yield TensorSpec(p + "ffn_down.weight", (g.n_ff, g.n_embd), down)
    else:
        yield TensorSpec(p + "ffn_gate_inp.weight", (g.n_embd, g.n_expert), QT.F32)
        yield TensorSpec(p + "exp_probs_b.bias", (g.n_expert,), QT.F32)
        yield TensorSpec(p + "ffn_gate_exps.weight", (g.n_embd, g.n_ff_exp, g.n_expert), QT.Q4_K)
        yield TensorSpec(p + "ffn_up_exps.weight", (g.n_embd, g.n_ff_exp, g.n_expert), QT.Q4_K)
        yield TensorSpec(p + "ffn_down_exps.weight", (g.n_ff_exp, g.n_embd, g.n_expert), down)
        shared = g.n_ff_exp * g.n_expert_shared
        yield TensorSpec(p + "ffn_gate_shexp.weight", (g.n_embd, shared), QT.Q4_K)
        yield TensorSpec(p + "ffn_up_shexp.weight", (g.n_embd, shared), QT.Q4_K)
        yield TensorSpec(p + "ffn_down_shexp.weight", (shared, g.n_embd), QT.Q6_K)
    if il >= g.n_layer:  # MTP block extras
        yield TensorSpec(p + "nextn.eh_proj.weight", (2 * g.n_embd, g.n_embd), QT.Q8_0)
        yield TensorSpec(p + "nextn.enorm.weight", (g.n_embd,), QT.F32)
        yield TensorSpec(p + "nextn.hnorm.weight", (g.n_embd,), QT.F32)
        yield TensorSpec(p + "nextn.shared_head_norm.weight", (g.n_embd,), QT.F32)


# --- llama (GQA) and gemma3 (sliding window) of arbitrary size -------------------


@dataclass(frozen=True)
class LlamaGeometry:
    n_layer: int = 16
    n_embd: int = 2048
    n_vocab: int = 32000
    n_head: int = 32
    n_head_kv: int = 8
    n_ff: int = 8192
    n_ctx_train: int = 8192


def _llama_like_meta(arch: str, g: LlamaGeometry | Gemma3Geometry, rms_eps: float) -> dict[str, Any]:
    """The metadata keys llama and gemma3 share, under their architecture's prefix."""
    return {
        "general.name": f"shape-only {arch}",
        f"{arch}.block_count": g.n_layer,
        f"{arch}.context_length": g.n_ctx_train,
        f"{arch}.embedding_length": g.n_embd,
        f"{arch}.feed_forward_length": g.n_ff,
        f"{arch}.attention.head_count": g.n_head,
        f"{arch}.attention.head_count_kv": g.n_head_kv,
        f"{arch}.attention.layer_norm_rms_epsilon": rms_eps,
        f"{arch}.vocab_size": g.n_vocab,
        "tokenizer.ggml.model": "none",
    }


def _qkv(p: str, n_embd: int, q: int, kv: int, qtype: QT) -> list[TensorSpec]:
    return [TensorSpec(p + "attn_q.weight", (n_embd, q), qtype), TensorSpec(p + "attn_k.weight", (n_embd, kv), qtype),
            TensorSpec(p + "attn_v.weight", (n_embd, kv), qtype)]


def _swiglu(p: str, n_embd: int, n_ff: int, qtype: QT) -> list[TensorSpec]:
    return [TensorSpec(p + "ffn_gate.weight", (n_embd, n_ff), qtype), TensorSpec(p + "ffn_up.weight", (n_embd, n_ff), qtype),
            TensorSpec(p + "ffn_down.weight", (n_ff, n_embd), qtype)]


def llama_spec(g: LlamaGeometry, qtype: QT = QT.Q8_0) -> ModelSpec:
    head_dim = g.n_embd // g.n_head
    spec = ModelSpec("llama", {**_llama_like_meta("llama", g, 1e-5), "llama.rope.dimension_count": head_dim})
    add = spec.tensors.append
    add(TensorSpec("token_embd.weight", (g.n_embd, g.n_vocab), qtype))
    for il in range(g.n_layer):
        p = f"blk.{il}."
        add(TensorSpec(p + "attn_norm.weight", (g.n_embd,), QT.F32))
        spec.tensors += _qkv(p, g.n_embd, g.n_embd, g.n_head_kv * head_dim, qtype)
        add(TensorSpec(p + "attn_output.weight", (g.n_embd, g.n_embd), qtype))
        add(TensorSpec(p + "ffn_norm.weight", (g.n_embd,), QT.F32))
        spec.tensors += _swiglu(p, g.n_embd, g.n_ff, qtype)
    add(TensorSpec("output_norm.weight", (g.n_embd,), QT.F32))
    add(TensorSpec("output.weight", (g.n_embd, g.n_vocab), qtype))
    return spec


@dataclass(frozen=True)
class Gemma3Geometry:
    """Defaults are Gemma 3 270M's shapes."""

    n_layer: int = 18
    n_embd: int = 640
    n_vocab: int = 262144
    n_head: int = 4
    n_head_kv: int = 1
    head_dim: int = 256
    n_ff: int = 2048
    n_swa: int = 512
    n_ctx_train: int = 32768


def gemma3_spec(g: Gemma3Geometry, qtype: QT = QT.Q8_0) -> ModelSpec:
    """Gemma 3: 5 sliding-window layers per global one, tied output embedding."""
    meta: dict[str, Any] = {
        **_llama_like_meta("gemma3", g, 1e-6),
        "gemma3.attention.key_length": g.head_dim,
        "gemma3.attention.value_length": g.head_dim,
        "gemma3.attention.sliding_window": g.n_swa,
        "gemma3.rope.freq_base": 1000000.0,
    }
    spec = ModelSpec("gemma3", meta)
    add = spec.tensors.append
    q, kv = g.n_head * g.head_dim, g.n_head_kv * g.head_dim
    add(TensorSpec("token_embd.weight", (g.n_embd, g.n_vocab), qtype))
    for il in range(g.n_layer):
        p = f"blk.{il}."
        for norm in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            add(TensorSpec(p + norm + ".weight", (g.n_embd,), QT.F32))
        spec.tensors += _qkv(p, g.n_embd, q, kv, qtype)
        add(TensorSpec(p + "attn_q_norm.weight", (g.head_dim,), QT.F32))
        add(TensorSpec(p + "attn_k_norm.weight", (g.head_dim,), QT.F32))
        add(TensorSpec(p + "attn_output.weight", (q, g.n_embd), qtype))
        spec.tensors += _swiglu(p, g.n_embd, g.n_ff, qtype)
    add(TensorSpec("output_norm.weight", (g.n_embd,), QT.F32))
    return spec
