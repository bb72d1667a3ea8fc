"""Weights come from the node's own copy of the model, not over the network.

A node started with --model-dir holds the GGUF; the head (loading with mmap,
llama-cpp-python's default) sends "read this range of your file" instead of
the bytes. A node whose file differs in any byte is detected by its content
hash (a tree SHA-256, cached on disk by device, inode, size, mtime and ctime)
and gets the bytes instead. Either way the tokens are those of one process.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import struct
import time
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

import models
from helpers import PROMPT, layer_weight_bytes, run_head
from test_protocol import Wire, hello_nonce, open_held_file

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


# ---- the content hash and its cache ------------------------------------------------

CHUNK = 4 << 20   # model_file.h TB_FILE_HASH_CHUNK


def content_hash(path: Path, cache: Path | None = None) -> tuple[bytes, bool]:
    """(hash, computed) as the C library gives them."""
    from tbrpc.native import load

    ffi, lib = load()
    out, computed, err = ffi.new("uint8_t[32]"), ffi.new("int *"), ffi.new("char[256]")
    cache_arg = str(cache).encode() if cache else ffi.NULL
    assert lib.tb_file_hash_path(str(path).encode(), cache_arg, out, computed, err, 256) == 0, ffi.string(err)
    return bytes(out), bool(computed[0])


def tree_sha256(data: bytes) -> bytes:
    """The content hash from its definition (model_file.h), with hashlib."""
    leaves = b"".join(hashlib.sha256(data[i:i + CHUNK]).digest() for i in range(0, len(data), CHUNK))
    return hashlib.sha256(b"tbrpc tree-sha256 v1\0" + struct.pack("<QQ", len(data), CHUNK) + leaves).digest()


@pytest.mark.parametrize("size", [0, 1, CHUNK - 1, CHUNK, 3 * CHUNK + 12345])
def test_content_hash_is_the_tree_sha256_of_its_definition(tmp_path: Path, size: int) -> None:
    data = os.urandom(size)
    path = tmp_path / "m.gguf"
    path.write_bytes(data)
    got, computed = content_hash(path)
    assert computed and got == tree_sha256(data)


def test_the_portable_sha256_gives_the_same_hash(tmp_path: Path) -> None:
    """Where the CPU has SHA instructions (auth.c uses them), the portable
    code must still agree: it is what a CPU without them runs."""
    import subprocess
    import sys

    data = os.urandom(CHUNK + 777)
    path = tmp_path / "m.gguf"
    path.write_bytes(data)
    code = ("import sys; sys.path.insert(0, 'tests'); from test_model_files import content_hash; from pathlib import Path; "
            f"print(content_hash(Path({str(path)!r}))[0].hex())")
    for portable in ("1", "0"):
        env = {**os.environ, "TBRPC_SHA256_PORTABLE": portable}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                             cwd=Path(__file__).resolve().parent.parent)
        assert bytes.fromhex(out.stdout.strip().splitlines()[-1]) == tree_sha256(data), portable


def node_log_lines(node: Any, needle: str) -> list[str]:
    return [line for line in node.log_text().splitlines() if needle in line]


def wait_for_log(node: Any, needle: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not node_log_lines(node, needle):
        assert time.monotonic() < deadline, f"{needle!r} not in the node's log:\n{node.log_text()}"
        time.sleep(0.05)


def node_and_head_copies(tmp_path: Path, size: int, differ_at: int) -> tuple[Path, Path]:
    """A node's served/m.gguf of `size` random bytes, and the head's
    head/m.gguf that differs from it in the one byte at `differ_at`."""
    served, head = tmp_path / "served", tmp_path / "head"
    served.mkdir()
    head.mkdir()
    real = served / "m.gguf"
    real.write_bytes(os.urandom(size))
    data = bytearray(real.read_bytes())
    data[differ_at] ^= 0x01
    (head / "m.gguf").write_bytes(bytes(data))
    return real, head / "m.gguf"


def test_one_different_byte_in_the_middle_is_refused(nodes: Any, tmp_path: Path, monkeypatch: Any) -> None:
    """The sampled fingerprint cannot see a byte between its samples, and the
    head's proof samples only 32 blocks; the content hash sees every byte."""
    from tbrpc.native import load

    ffi, lib = load()
    monkeypatch.setenv("TBRPC_HASH_CACHE", str(tmp_path / "cache"))
    real, differs = node_and_head_copies(tmp_path, 8 << 20, 4 << 20)   # between the fingerprint's samples (model_file.c)

    def fingerprint(path: Path) -> bytes:
        out, err = ffi.new("struct tb_file_identity *"), ffi.new("char[256]")
        assert lib.tbrpc_file_identity(str(path).encode(), out, err, 256) == 0
        return bytes(out.fingerprint)

    assert fingerprint(real) == fingerprint(differs), "the old identity would have accepted this copy"
    node = nodes(1, "--model-dir", str(real.parent))[0]
    w = Wire(node.endpoint)
    nonce = hello_nonce(w)
    # a head whose 32 proof blocks all missed the one byte (proof over the node's copy)
    assert open_held_file(w, nonce, differs, proof_of=real) == 0
    assert node_log_lines(node, "differs from the head's copy (content hash)")
    assert open_held_file(w, nonce, real) == 1


def cache_entries(cache: Path) -> list[Path]:
    return sorted(cache.glob("*.hash"))


def test_the_hash_is_computed_once_and_a_changed_mtime_invalidates_it(nodes: Any, tmp_path: Path,
                                                                      monkeypatch: Any) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("TBRPC_HASH_CACHE", str(cache))
    served = tmp_path / "served"
    served.mkdir()
    model = served / "m.gguf"
    model.write_bytes(os.urandom(6 << 20))
    node = nodes(1, "--model-dir", str(served))[0]
    wait_for_log(node, "hashed " + str(model.resolve()))          # the pass at start
    [entry] = cache_entries(cache)
    assert entry.stat().st_mode & 0o777 == 0o600 and cache.stat().st_mode & 0o777 == 0o700
    written = entry.stat().st_mtime_ns, entry.stat().st_ino
    for _ in range(2):                                       # two sessions: both from the cache
        w = Wire(node.endpoint)
        assert open_held_file(w, hello_nonce(w), model) == 1
    assert len(node_log_lines(node, "hashed ")) == 1
    assert len(node_log_lines(node, "hash of " + str(model.resolve()) + " from the cache")) == 2
    assert (entry.stat().st_mtime_ns, entry.stat().st_ino) == written, "the entry was not rewritten"
    # the head's side is cached too: a second hash of the same file reads nothing
    assert content_hash(model, cache) == (content_hash(model, cache)[0], False)

    stat = model.stat()
    os.utime(model, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))   # same bytes, new mtime
    w = Wire(node.endpoint)
    assert open_held_file(w, hello_nonce(w), model) == 1
    assert len(node_log_lines(node, "hashed ")) == 2, "a changed mtime must make the node hash again"
    assert (entry.stat().st_mtime_ns, entry.stat().st_ino) != written


def hostile_entry(cache: Path, model: Path, claimed: bytes, check_ok: bool = True) -> Path:
    """A cache entry (model_file.c struct hash_entry) for `model` as it is
    now, claiming the content hash `claimed`."""
    st = model.stat()
    body = (b"tbrpc-hash-v1".ljust(16, b"\0") + struct.pack("<QQQqq", st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns,
                                                             st.st_ctime_ns) + claimed)
    check = hashlib.sha256(body).digest()
    path = cache / f"{st.st_dev:x}-{st.st_ino:x}.hash"
    path.write_bytes(body + (check if check_ok else bytes(32)))
    return path


@pytest.mark.parametrize("how", ["believed", "writable by others", "a symlink", "bad check", "group-writable dir"])
def test_a_planted_cache_entry_cannot_make_a_different_file_served(nodes: Any, tmp_path: Path, monkeypatch: Any,
                                                                   how: str) -> None:
    """Only entries the node's own user wrote, in a directory no one else can
    write, are believed. "believed" is the control: the same entry, planted
    as the node's user would write it, is taken at its word (that user is
    trusted with its own files), which shows the entries refused below are
    refused for how they were planted, not for their contents."""
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    monkeypatch.setenv("TBRPC_HASH_CACHE", str(cache))
    real, differs = node_and_head_copies(tmp_path, 6 << 20, 3 << 20)
    claimed, _ = content_hash(differs)
    if how == "a symlink":
        target = tmp_path / "elsewhere.hash"
        hostile_entry(cache, real, claimed).rename(target)
        target.chmod(0o600)
        st = real.stat()
        (cache / f"{st.st_dev:x}-{st.st_ino:x}.hash").symlink_to(target)
    else:
        entry = hostile_entry(cache, real, claimed, check_ok=how != "bad check")
        entry.chmod(0o666 if how == "writable by others" else 0o600)
    if how == "group-writable dir":
        cache.chmod(0o770)
    node = nodes(1, "--model-dir", str(real.parent))[0]
    w = Wire(node.endpoint)
    got = open_held_file(w, hello_nonce(w), differs, proof_of=real)
    assert got == (1 if how == "believed" else 0), how
    if how == "group-writable dir":
        assert "no usable cache for content hashes" in node.log_text()
