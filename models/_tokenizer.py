"""A tiny byte-level BPE tokenizer (GPT-2 style) built in code.

The vocabulary is 256 byte tokens, a fixed number of merges learned from a
short embedded English text, and two control tokens. Because every byte has
a token, any text (ASCII or not) tokenises; the merges only make common
English words shorter so the tokenizer behaves like a real one. Training is
deterministic (ties are broken lexicographically), so the GGUF bytes never
depend on dict ordering or the Python version.
"""

from __future__ import annotations

import itertools
import re
from collections import Counter
from dataclasses import dataclass
from functools import cache

import gguf

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"

# Enough ordinary English for ~120 merges with real frequencies behind them.
_CORPUS = """
Hello world. The quick brown fox jumps over the lazy dog. Once upon a time
there was a small model that lived inside a file. It was split across many
machines, and each machine held a few of its layers. When a request came in,
the first machine read the tokens, computed its layers, and sent the hidden
state to the next machine over the network. The next machine did the same,
and so on, until the last machine produced the logits for the next token.
This is how we test the system: we write tiny models with random weights, we
load them, and we check that the output is the same on one machine and on
many machines. The weights are random, so the text is not meaningful, but the
numbers must match. Hello again, world! Is this the end? No, there is more to
say about the model, the tokens, the layers and the experts. A mixture of
experts routes each token to a few of its experts, and a shared expert sees
every token. The attention uses a compressed latent for the keys and values,
which makes the cache small. We hope that the tests are fast and that they
tell us when something is wrong. Thank you for reading this text.
"""

# GPT-2 style pre-tokenisation: words keep their leading space.
_WORD_RE = re.compile(r" ?[A-Za-z]+| ?[0-9]| ?[^\sA-Za-z0-9]+|\s+")


@cache
def byte_to_unicode() -> dict[int, str]:
    """The GPT-2 byte-to-printable-character map llama.cpp's BPE expects.

    Printable Latin-1 bytes map to themselves; the rest are shifted past 255
    so every token text is a printable, whitespace-free string.
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    mapping = {b: chr(b) for b in keep}
    shift = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shift)
            shift += 1
    return mapping


def _encode_word(word: str) -> tuple[str, ...]:
    table = byte_to_unicode()
    return tuple(table[b] for b in word.encode("utf-8"))


def _best_pair(words: Counter[tuple[str, ...]]) -> tuple[str, str] | None:
    pairs: Counter[tuple[str, str]] = Counter()
    for word, count in words.items():
        for pair in itertools.pairwise(word):
            pairs[pair] += count
    if not pairs:
        return None
    # Highest count first, then lexicographic, so training is reproducible.
    return min(pairs, key=lambda p: (-pairs[p], p))


def _apply_merge(word: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    out: list[str] = []
    i = 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(word[i] + word[i + 1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def train_merges(n_merges: int) -> list[tuple[str, str]]:
    """Learn up to n_merges BPE merges from the embedded corpus."""
    words = Counter(_encode_word(w) for w in _WORD_RE.findall(_CORPUS))
    merges: list[tuple[str, str]] = []
    while len(merges) < n_merges:
        pair = _best_pair(words)
        if pair is None:
            break
        merges.append(pair)
        merged: Counter[tuple[str, ...]] = Counter()
        for word, count in words.items():
            merged[_apply_merge(word, pair)] += count
        words = merged
    return merges


@dataclass(frozen=True)
class Vocab:
    tokens: list[str]
    types: list[int]
    merges: list[str]
    bos_id: int
    eos_id: int

    @property
    def size(self) -> int:
        return len(self.tokens)


@cache
def build_vocab(n_vocab: int = 384) -> Vocab:
    """Bytes, then merges, then BOS/EOS; exactly n_vocab tokens."""
    table = byte_to_unicode()
    tokens = [table[b] for b in range(256)]
    merges = train_merges(n_vocab - 256 - 2)
    if len(merges) != n_vocab - 258:
        raise ValueError(f"corpus too small for n_vocab={n_vocab}: {len(merges)} merges")
    tokens += [a + b for a, b in merges]
    types = [gguf.TokenType.NORMAL] * len(tokens)
    tokens += [BOS, EOS]
    types += [gguf.TokenType.CONTROL] * 2
    return Vocab(
        tokens=tokens,
        types=[int(t) for t in types],
        merges=[f"{a} {b}" for a, b in merges],
        bos_id=len(tokens) - 2,
        eos_id=len(tokens) - 1,
    )


def add_to_writer(writer: gguf.GGUFWriter, vocab: Vocab, pre: str) -> None:
    """Write the tokenizer metadata llama.cpp needs for a `gpt2` BPE vocab."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    writer.add_token_merges(vocab.merges)
    writer.add_bos_token_id(vocab.bos_id)
    writer.add_eos_token_id(vocab.eos_id)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
