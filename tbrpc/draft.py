"""Speculative decoding for ``tbrpc launch``: cheap guesses the split model checks in one step.

In a layer split a decode step visits every node in turn, and checking N
guessed tokens costs about one such step (one graph per node, one round
trip), so every accepted guess saves a whole trip through the cluster.
llama-cpp-python verifies the guesses (``Llama(draft_model=...)``): every
token it keeps is the argmax of the logits of the batch that checked it. A
batch rounds differently from one token in llama.cpp's CPU kernels, so where
a position's top two choices are nearly tied the text can differ from
one-token greedy decoding, in one process as over a split (docs/cluster.md,
Speculative decoding); elsewhere the guesses only change speed.

- ``prompt-lookup[:N]``: llama-cpp-python's prompt lookup, up to N tokens
  copied from where the text so far repeats itself (code edits, quoting).
- a small GGUF with the same vocabulary, run on the head's CPU
  (``GGUFDraft``): it decodes N tokens greedily ahead of the big model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from llama_cpp.llama_speculative import LlamaDraftModel, LlamaPromptLookupDecoding

from tbrpc.native import TbrpcError

DEFAULT_LOOKUP_TOKENS = 10
DEFAULT_MODEL_TOKENS = 8


class DraftError(TbrpcError):
    """The draft option or the draft model cannot be used with this model."""


def make_draft(lookup: str | None, model_path: str | None, n_tokens: int | None = None, n_ctx: int = 0,
               n_threads: int | None = None) -> LlamaDraftModel | None:
    """The draft `--draft` / `--draft-model` ask for, or None."""
    if lookup and model_path:
        raise DraftError("use either --draft prompt-lookup or --draft-model, not both")
    if lookup:
        return prompt_lookup(lookup)
    if model_path:
        return GGUFDraft(model_path, n_ctx, n_tokens or DEFAULT_MODEL_TOKENS, n_threads)
    return None


def check_options(lookup: str | None, model_path: str | None, main_path: str) -> None:
    """What can be checked before anything starts: the option's form, and a
    draft model's vocabulary size from the GGUF headers."""
    if lookup and model_path:
        raise DraftError("use either --draft prompt-lookup or --draft-model, not both")
    if lookup:
        prompt_lookup(lookup)
    if model_path:
        from tbrpc.gguf_model import GGUFError, arch_params, load_gguf

        try:
            draft_vocab, main_vocab = (arch_params(load_gguf(p)).n_vocab for p in (model_path, main_path))
        except GGUFError as exc:
            raise DraftError(f"--draft-model {model_path}: {exc}") from exc
        if draft_vocab != main_vocab:
            raise DraftError(f"--draft-model {model_path} has {draft_vocab} tokens, the model {main_vocab}: "
                             "a draft must share the model's vocabulary")


def logits_bytes(n_ctx: int, n_vocab: int) -> int:
    """What llama-cpp-python keeps on the head with a draft: every position's logits (float32)."""
    return n_ctx * n_vocab * 4


def prompt_lookup(spec: str) -> LlamaDraftModel:
    """A draft from "prompt-lookup" or "prompt-lookup:N"."""
    name, _, count = spec.partition(":")
    if name != "prompt-lookup" or (count and not (count.isdigit() and int(count) > 0)):
        raise DraftError(f"--draft {spec!r}: expected prompt-lookup or prompt-lookup:N (N tokens, at least 1)")
    return LlamaPromptLookupDecoding(num_pred_tokens=int(count) if count else DEFAULT_LOOKUP_TOKENS)


class GGUFDraft(LlamaDraftModel):
    """A small model on the head's CPU guessing `n_tokens` greedy tokens ahead.

    It keeps its own context in step with the text: each call evaluates only
    what differs from what it saw last (the big model may have rejected part
    of its last guess). It never touches the nodes: it is loaded with no
    devices at all, on plain CPU buffers like every model tbrpc loads."""

    def __init__(self, model_path: str, n_ctx: int, n_tokens: int = DEFAULT_MODEL_TOKENS,
                 n_threads: int | None = None) -> None:
        import llama_cpp

        from tbrpc.head_buffers import plain_cpu_buffers
        from tbrpc.llama import device_pointers, model_params_patch

        if n_tokens < 1:
            raise DraftError(f"draft tokens must be at least 1, not {n_tokens}")
        self.n_tokens = n_tokens
        self._no_devices = device_pointers([])
        try:
            with plain_cpu_buffers(), model_params_patch(self._no_devices):
                self.llm = llama_cpp.Llama(model_path, n_ctx=n_ctx, n_gpu_layers=0, n_threads=n_threads,
                                           verbose=False)
        except ValueError as exc:
            raise DraftError(f"--draft-model {model_path}: cannot load it: {exc}") from exc
        self._eos = self.llm.token_eos()

    def check_vocabulary(self, main: Any) -> None:
        """Refuse a draft whose tokens mean other text than the main model's."""
        if self.llm.n_vocab() != main.n_vocab():
            raise DraftError(f"the draft model has {self.llm.n_vocab()} tokens, the model {main.n_vocab()}: "
                             "a draft must share the model's vocabulary")
        sample = range(0, main.n_vocab(), max(1, main.n_vocab() // 512))
        differ = [t for t in sample if self.llm.detokenize([t]) != main.detokenize([t])]
        if differ:
            raise DraftError(f"the draft model's token {differ[0]} is {self.llm.detokenize([differ[0]])!r}, "
                             f"the model's {main.detokenize([differ[0]])!r}: a draft must share the vocabulary")

    def __call__(self, input_ids: npt.NDArray[np.intc], /, **kwargs: Any) -> npt.NDArray[np.intc]:
        ids = [int(t) for t in input_ids]
        room = self.llm.n_ctx() - len(ids)
        if room <= 1 or not ids:
            return np.array([], dtype=np.intc)
        seen = self.llm.input_ids[: self.llm.n_tokens]
        prefix = _common_prefix(ids, seen)
        self.llm.n_tokens = min(prefix, len(ids) - 1)   # at least the last token again: its logits are needed
        self.llm.eval(ids[self.llm.n_tokens:])
        drafted: list[int] = []
        for _ in range(min(self.n_tokens, room - 1)):
            logits = np.ctypeslib.as_array(self.llm._ctx.get_logits_ith(-1), shape=(self.llm.n_vocab(),))
            token = int(np.argmax(logits))
            drafted.append(token)
            if token == self._eos or len(drafted) == self.n_tokens:
                break
            self.llm.eval([token])
        return np.array(drafted, dtype=np.intc)

    def close(self) -> None:
        self.llm.close()


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
