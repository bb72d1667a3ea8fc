"""Read what a GGUF model is made of: tensors, shards, layers, architecture.

Only headers are read, never tensor data, so a 600 GB split set (or a sparse
fixture of one) is described in well under a second.  The ``gguf`` package
supplies the format's constants (value types, quant block sizes, key names);
the header walk itself is done here because ``gguf.GGUFReader`` materialises
every string of a 160k-token vocabulary as numpy arrays, which takes over a
minute and 500 MB for a Kimi K2 shard.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType

# Arrays longer than this are summarised by their length (vocabularies,
# merges); per-layer hyperparameter arrays are far shorter.
_MAX_DECODED_ARRAY = 4096

_SHARD_RE = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")

_SCALAR_FORMATS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
    GGUFValueType.BOOL: "?",
}


class GGUFError(ValueError):
    """The file (or split set) is not a usable GGUF model."""


@dataclass(frozen=True)
class ArraySummary:
    """A long metadata array (e.g. the vocabulary), kept as its length only."""

    length: int
    item_type: GGUFValueType


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]  # ggml order: ne0 (contiguous) first
    n_bytes: int
    shard: int  # index into GGUFModel.shards
    offset: int  # absolute byte offset of the data in its shard file

    @property
    def n_elements(self) -> int:
        n = 1
        for dim in self.shape:
            n *= dim
        return n

    @property
    def block(self) -> int | None:
        """Layer index for ``blk.N.*`` tensors, None for the rest."""
        if not self.name.startswith("blk."):
            return None
        return int(self.name.split(".", 2)[1])


@dataclass(frozen=True)
class ShardInfo:
    path: Path
    n_tensors: int
    data_offset: int  # where the tensor data region starts
    file_size: int


@dataclass
class _Header:
    metadata: dict[str, Any]
    tensors: list[tuple[str, GGMLQuantizationType, tuple[int, ...], int]]  # name, type, shape, relative offset
    data_offset: int
    file_size: int


class _Cursor:
    """Little-endian reader over a memory map of the header region."""

    def __init__(self, buf: mmap.mmap | bytes, path: Path) -> None:
        self.buf = buf
        self.pos = 0
        self.path = path

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.buf):
            raise GGUFError(f"{self.path}: truncated GGUF header")
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        length = self.unpack("Q")
        raw = self.buf[self.pos : self.pos + length]
        if len(raw) != length:
            raise GGUFError(f"{self.path}: truncated GGUF header")
        self.pos += length
        return bytes(raw).decode("utf-8", errors="replace")

    def skip_string(self) -> None:
        length = self.unpack("Q")  # read first: unpack() itself advances pos
        self.pos += length

    def value(self, vtype: GGUFValueType) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            return self.array()
        fmt = _SCALAR_FORMATS.get(vtype)
        if fmt is None:
            raise GGUFError(f"{self.path}: unknown metadata value type {vtype}")
        return self.unpack(fmt)

    def array(self) -> list[Any] | ArraySummary:
        item_type = GGUFValueType(self.unpack("I"))
        length = self.unpack("Q")
        if length <= _MAX_DECODED_ARRAY:
            return [self.value(item_type) for _ in range(length)]
        # Skip long arrays without building them: the planner needs their length only.
        if item_type == GGUFValueType.STRING:
            for _ in range(length):
                self.skip_string()
        elif item_type == GGUFValueType.ARRAY:
            for _ in range(length):
                self.array()
        else:
            self.pos += length * struct.calcsize("<" + _SCALAR_FORMATS[item_type])
        return ArraySummary(length, item_type)


def _read_header(path: Path) -> _Header:
    file_size = path.stat().st_size
    with open(path, "rb") as fh:
        if file_size < 24:
            raise GGUFError(f"{path}: too small to be a GGUF file")
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse_header(_Cursor(buf, path), file_size)


def _parse_header(cur: _Cursor, file_size: int) -> _Header:
    if cur.unpack("I") != GGUF_MAGIC:
        raise GGUFError(f"{cur.path}: not a GGUF file (bad magic)")
    version = cur.unpack("I")
    if version not in (2, 3):
        raise GGUFError(f"{cur.path}: unsupported GGUF version {version}")
    n_tensors = cur.unpack("Q")
    n_kv = cur.unpack("Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(GGUFValueType(cur.unpack("I")))
    tensors = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.unpack("I")
        shape = tuple(cur.unpack("Q") for _ in range(n_dims))
        ggml_type = GGMLQuantizationType(cur.unpack("I"))
        tensors.append((name, ggml_type, shape, cur.unpack("Q")))
    alignment = int(metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
    data_offset = (cur.pos + alignment - 1) // alignment * alignment
    return _Header(metadata, tensors, data_offset, file_size)


def tensor_nbytes(ggml_type: GGMLQuantizationType, shape: Iterable[int]) -> int:
    """Exact bytes of a tensor, as ggml_nbytes computes them for contiguous data."""
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    dims = list(shape)
    if not dims:
        return type_size
    if dims[0] % block_size:
        raise GGUFError(f"row of {dims[0]} elements is not a multiple of the {ggml_type.name} block ({block_size})")
    n = type_size * (dims[0] // block_size)
    for dim in dims[1:]:
        n *= dim
    return n


def find_shards(path: str | os.PathLike[str]) -> list[Path]:
    """All files of the model ``path`` belongs to, in split order.

    ``NAME-00003-of-00013.gguf`` finds its twelve siblings; a missing one is an
    error rather than a silently smaller model.
    """
    path = Path(path)
    if not path.exists():
        raise GGUFError(f"{path}: no such file")
    match = _SHARD_RE.match(path.name)
    if not match:
        return [path]
    count = int(match["count"])
    if count < 1:
        raise GGUFError(f"{path}: split count is zero")
    shards = [path.with_name(f"{match['prefix']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [s.name for s in shards if not s.exists()]
    if missing:
        raise GGUFError(f"{path}: split set is incomplete, missing {len(missing)} of {count}: {', '.join(missing)}")
    return shards


@dataclass
class GGUFModel:
    """Everything the planner needs from a model's headers."""

    path: Path  # the first shard
    shards: list[ShardInfo]
    metadata: dict[str, Any]
    tensors: list[TensorInfo]
    _by_name: dict[str, TensorInfo] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._by_name = {t.name: t for t in self.tensors}

    @property
    def architecture(self) -> str:
        return str(self.metadata["general.architecture"])

    def get(self, key: str, default: Any = None) -> Any:
        """Architecture-scoped metadata: ``get("block_count")`` reads ``<arch>.block_count``."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def tensor(self, name: str) -> TensorInfo | None:
        return self._by_name.get(name)

    @property
    def weights_bytes(self) -> int:
        return sum(t.n_bytes for t in self.tensors)


def load_gguf(path: str | os.PathLike[str]) -> GGUFModel:
    """Read a single GGUF file or a whole split set from any of its shards."""
    paths = find_shards(path)
    headers = [_read_header(p) for p in paths]
    _check_split_set(paths, headers)
    shards: list[ShardInfo] = []
    tensors: list[TensorInfo] = []
    seen: set[str] = set()
    for index, (p, header) in enumerate(zip(paths, headers)):
        shards.append(ShardInfo(p, len(header.tensors), header.data_offset, header.file_size))
        for name, ggml_type, shape, rel_offset in header.tensors:
            if name in seen:
                raise GGUFError(f"{p}: tensor {name} appears in more than one shard")
            seen.add(name)
            info = TensorInfo(name, ggml_type, shape, tensor_nbytes(ggml_type, shape), index, header.data_offset + rel_offset)
            if info.offset + info.n_bytes > header.file_size:
                raise GGUFError(f"{p}: tensor {name} extends past the end of the file (truncated download?)")
            tensors.append(info)
    metadata = headers[0].metadata
    if "general.architecture" not in metadata:
        raise GGUFError(f"{paths[0]}: no general.architecture key")
    return GGUFModel(paths[0], shards, metadata, tensors)


def _check_split_set(paths: list[Path], headers: list[_Header]) -> None:
    count = len(paths)
    if count == 1 and "split.count" not in headers[0].metadata:
        return
    expected_tensors = headers[0].metadata.get("split.tensors.count")
    for index, (p, header) in enumerate(zip(paths, headers)):
        meta = header.metadata
        if meta.get("split.count", count) != count:
            raise GGUFError(f"{p}: says split.count={meta.get('split.count')}, but the set has {count} files")
        if meta.get("split.no", index) != index:
            raise GGUFError(f"{p}: says split.no={meta.get('split.no')}, expected {index} (mixed-up or renamed shards?)")
        if expected_tensors is not None and meta.get("split.tensors.count", expected_tensors) != expected_tensors:
            raise GGUFError(f"{p}: belongs to a different split set (split.tensors.count differs)")
    total = sum(len(h.tensors) for h in headers)
    if expected_tensors is not None and total != expected_tensors:
        raise GGUFError(f"{paths[0]}: split set holds {total} tensors, header promises {expected_tensors}")


# --- architecture hyperparameters ---------------------------------------------

# Sliding-window layer patterns llama.cpp applies per architecture when the
# file carries no `attention.sliding_window_pattern` (llama-model.cpp /
# src/models/*.cpp: load_swa_pattern(ml, N)).  Architecture defaults, not
# model names: a file that states its own pattern always wins.
_SWA_PATTERN_DEFAULT: dict[str, int] = {"gemma3": 6, "gemma2": 2, "cohere2": 4}


@dataclass(frozen=True)
class ArchParams:
    """The hyperparameters that decide memory, read the way llama.cpp reads them."""

    arch: str
    n_layer_all: int  # block_count, including MTP/nextn blocks
    n_layer_nextn: int
    n_embd: int
    n_vocab: int
    n_ctx_train: int
    n_head: tuple[int, ...]  # per layer
    n_head_kv: tuple[int, ...]
    head_k: int  # attention.key_length (for MLA: kv_lora_rank + rope dims)
    head_v: int
    head_k_swa: int
    head_v_swa: int
    is_mla: bool  # K-only latent cache (deepseek2 with key_length_mla)
    n_expert: int
    n_expert_used: int
    n_ff: tuple[int, ...]
    n_ff_exp: int
    n_expert_shared: int
    n_swa: int  # 0 = no sliding window
    is_swa: tuple[bool, ...]
    head_k_mla: int = 0  # per-head dims after MLA "decompression" (compute graph)
    head_v_mla: int = 0
    n_lora_kv: int = 0
    n_lora_q: int = 0  # MLA query low-rank width (0: a plain wq, the "lite" variants)
    dense_lead: int = 0  # leading blocks with a dense FFN in a MoE model

    @property
    def n_layer(self) -> int:
        """Trunk layers: the ones with a KV cache and in the main graph."""
        return self.n_layer_all - self.n_layer_nextn

    def kv_row_elems(self, il: int) -> tuple[int, int]:
        """Elements per token of layer il's K and V cache (V is 0 under MLA)."""
        k = (self.head_k_swa if self.is_swa[il] else self.head_k) * self.n_head_kv[il]
        v = 0 if self.is_mla else (self.head_v_swa if self.is_swa[il] else self.head_v) * self.n_head_kv[il]
        return k, v


def _per_layer(value: Any, n: int, default: int = 0) -> tuple[int, ...]:
    if value is None:
        return (default,) * n
    if isinstance(value, list):
        if len(value) != n:
            raise GGUFError(f"per-layer array has {len(value)} entries for {n} layers")
        return tuple(int(v) for v in value)
    return (int(value),) * n


def _swa_layers(model: GGUFModel, n_layer_all: int, n_layer_nextn: int) -> tuple[int, tuple[bool, ...]]:
    n_swa = int(model.get("attention.sliding_window", 0) or 0)
    if n_swa <= 0:
        return 0, (False,) * n_layer_all
    pattern = model.get("attention.sliding_window_pattern")
    if isinstance(pattern, list):  # explicit per-layer flags
        return n_swa, tuple(bool(p) for p in pattern) + (False,) * (n_layer_all - len(pattern))
    n_pattern = int(pattern) if pattern is not None else _SWA_PATTERN_DEFAULT.get(model.architecture)
    if n_pattern is None:
        # Unknown layout: treat every layer as global, which can only overestimate the cache.
        return 0, (False,) * n_layer_all
    trunk = n_layer_all - n_layer_nextn
    flags = [n_pattern == 0 or (il % n_pattern < n_pattern - 1) for il in range(trunk)]
    return n_swa, tuple(flags) + (False,) * n_layer_nextn


def arch_params(model: GGUFModel) -> ArchParams:
    n_layer_all = int(model.get("block_count"))
    n_nextn = int(model.get("nextn_predict_layers", 0) or 0)
    n_embd = int(model.get("embedding_length"))
    n_head = _per_layer(model.get("attention.head_count"), n_layer_all)
    n_head_kv_raw = model.get("attention.head_count_kv")
    n_head_kv = n_head if n_head_kv_raw is None else _per_layer(n_head_kv_raw, n_layer_all)
    n_head0 = max(n_head) or 1
    head_k = int(model.get("attention.key_length", n_embd // n_head0))
    head_v = int(model.get("attention.value_length", n_embd // n_head0))
    head_k_mla = int(model.get("attention.key_length_mla", 0) or 0)
    head_v_mla = int(model.get("attention.value_length_mla", 0) or 0)
    n_swa, is_swa = _swa_layers(model, n_layer_all, n_nextn)
    embd = model.tensor("token_embd.weight")
    n_vocab = embd.shape[1] if embd is not None and len(embd.shape) > 1 else int(model.get("vocab_size", 0) or 0)
    n_ff_exp = model.get("expert_feed_forward_length", 0) or 0
    return ArchParams(
        arch=model.architecture,
        n_layer_all=n_layer_all,
        n_layer_nextn=n_nextn,
        n_embd=n_embd,
        n_vocab=n_vocab,
        n_ctx_train=int(model.get("context_length", 0) or 0),
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_k=head_k,
        head_v=head_v,
        head_k_swa=int(model.get("attention.key_length_swa", head_k)),
        head_v_swa=int(model.get("attention.value_length_swa", head_v)),
        is_mla=head_k_mla > 0 and head_v_mla > 0,
        n_expert=int(model.get("expert_count", 0) or 0),
        n_expert_used=int(model.get("expert_used_count", 0) or 0),
        n_ff=_per_layer(model.get("feed_forward_length"), n_layer_all),
        n_ff_exp=int(n_ff_exp[0] if isinstance(n_ff_exp, list) else n_ff_exp),
        n_expert_shared=int(model.get("expert_shared_count", 0) or 0),
        n_swa=n_swa,
        is_swa=is_swa,
        head_k_mla=head_k_mla,
        head_v_mla=head_v_mla,
        n_lora_kv=int(model.get("attention.kv_lora_rank", 0) or 0),
        n_lora_q=int(model.get("attention.q_lora_rank", 0) or 0),
        dense_lead=int(model.get("leading_dense_block_count", 0) or 0),
    )


# --- where each tensor lives --------------------------------------------------

# Non-block tensors llama.cpp keeps with the input (always on the host CPU)
# or with the output layer (the device of the last layer); llama-arch.cpp's
# LLM_TENSOR_LAYER_INPUT / LLM_TENSOR_LAYER_OUTPUT.
_INPUT_TENSORS = ("token_embd.", "token_types.", "position_embd.", "per_layer_token_embd.")
_OUTPUT_TENSORS = ("output.", "output_norm.", "cls.", "cls_out.")


@dataclass(frozen=True)
class LayerWeights:
    """Bytes of one block, split the way people ask about MoE models."""

    index: int
    total: int
    routed_experts: int  # *_exps tensors: the bulk of a MoE layer
    shared_experts: int  # *_shexp tensors
    n_tensors: int
    loaded: bool  # False for MTP blocks llama.cpp skips by default

    @property
    def dense(self) -> int:
        return self.total - self.routed_experts - self.shared_experts


@dataclass(frozen=True)
class WeightLayout:
    layers: tuple[LayerWeights, ...]
    input_bytes: int  # token embeddings: stay on the head's CPU
    output_bytes: int  # output norm + head: on the last layer's device
    output_tied: bool  # no output.weight: the output device holds a copy of token_embd
    tied_bytes: int  # size of that copy (included in output_bytes)
    other_bytes: int  # tiny non-block tensors (rope_freqs...): one copy per device with layers
    tensors_per_layer: tuple[int, ...]


def weight_layout(model: GGUFModel, params: ArchParams, load_mtp: bool = False) -> WeightLayout:
    n = params.n_layer_all
    total = [0] * n
    routed = [0] * n
    shared = [0] * n
    count = [0] * n
    input_bytes = output_bytes = other_bytes = 0
    for t in model.tensors:
        il = t.block
        if il is not None:
            if il >= n:
                raise GGUFError(f"tensor {t.name} belongs to block {il}, but block_count is {n}")
            total[il] += t.n_bytes
            count[il] += 1
            if "_exps." in t.name:
                routed[il] += t.n_bytes
            elif "_shexp." in t.name:
                shared[il] += t.n_bytes
        elif t.name.startswith(_INPUT_TENSORS):
            input_bytes += t.n_bytes
        elif t.name.startswith(_OUTPUT_TENSORS):
            output_bytes += t.n_bytes
        else:
            other_bytes += t.n_bytes
    tied = model.tensor("output.weight") is None and model.tensor("token_embd.weight") is not None
    tied_bytes = model.tensor("token_embd.weight").n_bytes if tied else 0  # type: ignore[union-attr]
    output_bytes += tied_bytes
    layers = tuple(
        LayerWeights(il, total[il], routed[il], shared[il], count[il], loaded=load_mtp or il < params.n_layer)
        for il in range(n)
    )
    return WeightLayout(layers, input_bytes, output_bytes, tied, tied_bytes, other_bytes, tuple(count))
