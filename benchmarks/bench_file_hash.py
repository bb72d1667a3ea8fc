"""Benchmark: the content hash of a model file (model_file.h), and its cache.

On one file it measures, in turns:

  tree sha256, 1 thread    tb_file_hash_fd with one thread (= plain SHA-256's
                           speed: auth.c's portable C, one stream)
  tree sha256, N threads   the same with N threads (N = online CPUs, <= 8)
  hashlib sha256           OpenSSL's SHA-256 in one stream, for scale (it uses
                           the CPU's SHA instructions where there are some)
  cached                   tb_file_hash_path finding the entry the N-thread
                           pass wrote (what every OPEN_FILE after the first costs)

`--cold` reads the file once per variant without any preparation: on a
file much larger than RAM each pass is mostly a cold read from disk. Without
it the file is read once first, so it should sit in the page cache.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_file_hash.py FILE [--cold] [--skip-hashlib]

A benchmark, not a test: nothing here asserts on timings.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile
import time
from pathlib import Path

from tbrpc.native import load


def tree(path: Path, threads: int) -> tuple[float, bytes]:
    ffi, lib = load()
    out, err = ffi.new("uint8_t[32]"), ffi.new("char[256]")
    fd = os.open(path, os.O_RDONLY)
    try:
        started = time.perf_counter()
        assert lib.tb_file_hash_fd(fd, os.fstat(fd).st_size, threads, ffi.NULL, out, err, 256) == 0, ffi.string(err)
        return time.perf_counter() - started, bytes(out)
    finally:
        os.close(fd)


def openssl(path: Path) -> float:
    started = time.perf_counter()
    h = hashlib.sha256()
    with path.open("rb", buffering=0) as f:
        buf = bytearray(4 << 20)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
    return time.perf_counter() - started


def through_cache(path: Path, cache: str) -> tuple[float, bytes, bool]:
    """tb_file_hash_path as a node calls it: (seconds, hash, computed)."""
    ffi, lib = load()
    out, computed, err = ffi.new("uint8_t[32]"), ffi.new("int *"), ffi.new("char[256]")
    started = time.perf_counter()
    assert lib.tb_file_hash_path(str(path).encode(), cache.encode(), out, computed, err, 256) == 0, ffi.string(err)
    return time.perf_counter() - started, bytes(out), bool(computed[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file", type=Path)
    ap.add_argument("--cold", action="store_true", help="no warm-up read")
    ap.add_argument("--skip-hashlib", action="store_true")
    ap.add_argument("--only-cached", action="store_true", help="only the N-thread pass and the cached lookup")
    args = ap.parse_args()
    size = args.file.stat().st_size
    gb = size / 1e9
    if not args.cold:
        openssl(args.file)
    rows = []
    print(f"{args.file}: {gb:.2f} GB, {'cold' if args.cold else 'warm'}; load {os.getloadavg()[0]:.2f}", flush=True)
    if not args.only_cached:
        t1, _ = tree(args.file, 1)
        rows.append(("tree sha256, 1 thread", t1))
    with tempfile.TemporaryDirectory() as cache:
        tn, _, computed = through_cache(args.file, cache)
        assert computed
        rows.append((f"tree sha256, {os.cpu_count()} threads (as a node)", tn))
        if not args.skip_hashlib and not args.only_cached:
            rows.append(("hashlib sha256 (OpenSSL), 1 stream", openssl(args.file)))
        for name, took in rows:
            print(f"  {name:36s} {took:8.2f} s  {gb / took:6.2f} GB/s")
        took, _, computed = through_cache(args.file, cache)
        assert not computed
        print(f"  {'cached (entry found)':36s} {took * 1e6:8.0f} us; load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
