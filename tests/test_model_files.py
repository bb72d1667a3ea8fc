"""Weights come from the node's own copy of the model, not over the network.

A node started with --model-dir holds the GGUF; the head (loading with mmap,
llama-cpp-python's default) sends "read this range of your file" instead of
the bytes. A node whose file differs is detected by size and fingerprint and
gets the bytes instead. Either way the tokens are those of one process.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

import models
from helpers import PROMPT, layer_weight_bytes, run_head

N_PREDICT = 8
FILE_MIN = 256 << 10   # client.c: smaller writes are sent, larger ones read from the node's file


def large_layer_tensor_bytes(model: Path) -> int:
    """Bytes of the blk.* tensors big enough to be read from the node's file."""
    reader = gguf.GGUFReader(model)
    return sum(int(t.n_bytes) for t in reader.tensors if t.name.startswith("blk.") and int(t.n_bytes) >= FILE_MIN)


def baseline(tmp_path: Path, model: Path) -> tuple[dict[str, Any], np.ndarray]:
    result, logits = run_head(tmp_path, model=str(model), prompt=PROMPT, n_predict=N_PREDICT)
    assert result["error"] is None, result["error"]
    return result, logits


@pytest.mark.parametrize("model_name", ["deepseek2", "gemma"])
def test_weights_load_from_the_nodes_copy(model_name: str, nodes: Any, tmp_path: Path) -> None:
    model = models.ensure(model_name)
    base, base_logits = baseline(tmp_path, model)
    started = nodes(2, "--model-dir", str(model.parent))
    result, logits = run_head(tmp_path, model=str(model), prompt=PROMPT, n_predict=N_PREDICT,
                              nodes=[n.endpoint for n in started])
    assert result["error"] is None, result["error"]
    assert result["tokens"] == base["tokens"] and np.array_equal(logits, base_logits)
    from_files = sum(n["bytes_from_files"] for n in result["nodes_after_load"])
    sent = sum(n["bytes_sent"] for n in result["nodes_after_load"])
    large = large_layer_tensor_bytes(model)
    assert large > 0 and from_files >= large, (from_files, large)
    # what still crossed: the small tensors, inputs and graphs, not the large weights
    assert sent <= layer_weight_bytes(model) - large + (8 << 20), sent
    assert all("come from this node's" in n.log_text() for n in started)


def test_a_different_file_under_the_same_name_streams_instead(nodes: Any, tmp_path: Path) -> None:
    model = models.ensure("deepseek2")
    base, base_logits = baseline(tmp_path, model)
    other_dir = tmp_path / "node-models"
    other_dir.mkdir()
    tampered = other_dir / model.name
    shutil.copyfile(model, tampered)
    data = bytearray(tampered.read_bytes())
    data[-100] ^= 0xFF                      # one weight byte differs
    tampered.write_bytes(bytes(data))
    started = nodes(2, "--model-dir", str(other_dir))
    result, logits = run_head(tmp_path, model=str(model), prompt=PROMPT, n_predict=N_PREDICT,
                              nodes=[n.endpoint for n in started])
    assert result["error"] is None, result["error"]
    assert result["tokens"] == base["tokens"] and np.array_equal(logits, base_logits)
    assert all(n["bytes_from_files"] == 0 for n in result["nodes_after_load"])
    assert any("differs from the head's copy" in n.log_text() for n in started)


def test_file_identity_sees_a_changed_byte(tmp_path: Path) -> None:
    from tbrpc.native import error_buffer, load

    ffi, lib = load()

    def identity(path: Path) -> tuple[int, bytes]:
        out = ffi.new("struct tb_file_identity *")
        err = error_buffer()
        assert lib.tbrpc_file_identity(str(path).encode(), out, err, len(err)) == 0
        return out.size, bytes(out.fingerprint)

    a = tmp_path / "a.gguf"
    a.write_bytes(bytes(range(256)) * 40000)
    before = identity(a)
    data = bytearray(a.read_bytes())
    data[5] ^= 1
    a.write_bytes(bytes(data))
    assert identity(a)[0] == before[0] and identity(a)[1] != before[1]
