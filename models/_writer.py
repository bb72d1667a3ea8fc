"""Shared plumbing for writing random-weight GGUF files deterministically."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

from models import _tokenizer
from models._quant import quantize

_FLOAT = (QT.F32, QT.F16)


class ModelWriter:
    """Draws weights from one seeded stream, in call order, into a GGUFWriter.

    Shapes are given in ggml order (ne0 = row length first), the order that
    llama.cpp's create_tensor() uses, so specs can be checked against
    llama-model.cpp by eye; numpy wants them reversed.
    """

    def __init__(self, path: Path, arch: str, seed: int, dequantized: bool = False) -> None:
        self.path = Path(path)
        self.dequantized = dequantized
        # Write next to the target and rename, so a crash or a concurrent
        # reader never sees a half-written model under the final name.
        self._tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        self.writer = gguf.GGUFWriter(str(self._tmp), arch)
        self.rng = np.random.default_rng(seed)

    def normal(self, name: str, ne: tuple[int, ...], std: float, qtype: QT) -> np.ndarray:
        data = (self.rng.standard_normal(ne[::-1]) * std).astype(np.float32)
        self.add(name, data, qtype)
        return data

    def norm(self, name: str, n: int) -> None:
        # Not exactly 1.0: a node that dropped the norm weight would then
        # give different logits, which the distributed tests should catch.
        data = (1.0 + 0.1 * self.rng.standard_normal(n)).astype(np.float32)
        self.add(name, data, QT.F32)

    def add(self, name: str, data: np.ndarray, qtype: QT) -> None:
        if qtype in _FLOAT:
            self.writer.add_tensor(name, quantize(data, qtype))
        elif self.dequantized:
            # Same values the quantised file holds, stored as F32: a reference
            # model that isolates the quantised kernels (and our packing).
            self.writer.add_tensor(name, gguf.quants.dequantize(quantize(data, qtype), qtype))
        else:
            self.writer.add_tensor(name, quantize(data, qtype), raw_dtype=qtype)

    def vocab(self, n_vocab: int, pre: str) -> _tokenizer.Vocab:
        vocab = _tokenizer.build_vocab(n_vocab)
        _tokenizer.add_to_writer(self.writer, vocab, pre)
        return vocab

    def finish(self) -> Path:
        w = self.writer
        try:
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_tensors_to_file()
            w.close()
            os.replace(self._tmp, self.path)
        finally:
            self._tmp.unlink(missing_ok=True)  # only left over on failure
        return self.path


class TinyConfig(Protocol):
    n_vocab: int
    n_embd: int
    n_layer: int
    logit_std: float


def write_model(path: Path, arch: str, seed: int, dequantized: bool, cfg: TinyConfig, pre: str,
                types: dict[str, QT], metadata: Callable[[ModelWriter], None],
                layer: Callable[[ModelWriter, int], None]) -> Path:
    """Write a tiny model to `path` (atomically) and return the path: its
    metadata, vocabulary, token embedding, each layer, output norm and head, in
    that order from one seeded stream.

    dequantized=True stores each quantised weight as the F32 values it
    decodes to: same model, float kernels, for checking the quantised ones.
    """
    mw = ModelWriter(path, arch, seed, dequantized)
    metadata(mw)
    vocab = mw.vocab(cfg.n_vocab, pre=pre)
    mw.normal("token_embd.weight", (cfg.n_embd, cfg.n_vocab), 1.0, types["token_embd"])
    for il in range(cfg.n_layer):
        layer(mw, il)
    mw.norm("output_norm.weight", cfg.n_embd)
    output_head(mw, vocab, cfg.n_embd, cfg.logit_std, types["output"])
    return mw.finish()


def output_head(mw: ModelWriter, vocab: _tokenizer.Vocab, n_embd: int, logit_std: float, qtype: QT) -> None:
    """LM head whose control-token rows are zero.

    Random weights would otherwise let greedy decoding pick EOS and stop
    after a token or two; a zero row scores 0, which never beats the max
    of hundreds of random logits.
    """
    data = (mw.rng.standard_normal((vocab.size, n_embd)) * logit_std / np.sqrt(n_embd)).astype(np.float32)
    data[[vocab.bos_id, vocab.eos_id]] = 0.0
    mw.add("output.weight", data, qtype)
