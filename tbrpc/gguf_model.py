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
