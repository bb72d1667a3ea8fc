"""Test models for tbrpc: tiny random-weight GGUFs and the real Gemma 3 270M.

`ensure(name)` returns a ready GGUF path, writing it into models/out/ (which
is gitignored) the first time. The tiny models are deterministic functions of
their seed and generator version, and the version and seed are in the file
name, so an existing file is always the right one and is never rewritten.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

OUT_DIR = Path(__file__).resolve().parent / "out"
NAMES = ("llama", "deepseek2", "gemma", "llama-f32", "deepseek2-f32")


class TinyModel(Protocol):
    """What models.tiny_llama and models.tiny_deepseek2 provide."""

    def file_name(self, seed: int = 0) -> str: ...

    def write(self, path: Path, seed: int = 0, dequantized: bool = False) -> Path: ...


def ensure(name: str, out_dir: Path | None = None) -> Path:
    """Path to model `name` (one of NAMES), created if missing. A "-f32" name
    is the tiny model with every quantized weight stored as the F32 values it
    decodes to: the same model on float kernels."""
    out = Path(out_dir) if out_dir is not None else OUT_DIR
    if name == "gemma":
        from models import gemma

        return gemma.path(out)
    dequantized = name.endswith("-f32")
    module = _tiny_module(name.removesuffix("-f32"))
    target = out / module.file_name().replace(".gguf", "-f32.gguf" if dequantized else ".gguf")
    if not target.exists():
        out.mkdir(parents=True, exist_ok=True)
        module.write(target, dequantized=dequantized)
    return target


def _tiny_module(name: str) -> TinyModel:
    # Imported lazily so `models.gemma` works without numpy/gguf installed.
    if name == "llama":
        from models import tiny_llama

        return tiny_llama
    if name == "deepseek2":
        from models import tiny_deepseek2

        return tiny_deepseek2
    raise ValueError(f"unknown model {name!r}; expected one of {', '.join(NAMES)}")
