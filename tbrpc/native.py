"""Loading the C library, after llama-cpp-python's own ggml.

The order matters: ``tbrpc._native`` links to ggml by SONAME, so importing
llama_cpp first makes the loader hand us the copies libllama already uses.
"""

from __future__ import annotations

import functools
from typing import Any

SUPPORTED_LLAMA_CPP_PYTHON = "0.3.36"


class TbrpcError(RuntimeError):
    """Base of every error tbrpc raises.

    ``step``: the step of ``tbrpc launch`` (start, plan, connect, load, ...)
    the message already names ("step plan: ..."), else None."""

    step: str | None = None

    @classmethod
    def at(cls, step: str, message: str) -> TbrpcError:
        """This error in `step`: its message is "step STEP: message"."""
        error = cls(f"step {step}: {message}")
        error.step = step
        return error


class VersionMismatchError(TbrpcError):
    """The installed llama-cpp-python is not the one tbrpc's ggml ABI was written for."""


@functools.cache
def load() -> tuple[Any, Any]:
    """Return (ffi, lib) of tbrpc's C library, refusing an unknown llama-cpp-python."""
    import llama_cpp  # noqa: F401  (loads libllama and its ggml first)

    if llama_cpp.__version__ != SUPPORTED_LLAMA_CPP_PYTHON:
        raise VersionMismatchError(
            f"tbrpc's ggml backend ABI was written for llama-cpp-python {SUPPORTED_LLAMA_CPP_PYTHON}, "
            f"but {llama_cpp.__version__} is installed; install llama-cpp-python=={SUPPORTED_LLAMA_CPP_PYTHON}"
        )
    from tbrpc._native import ffi, lib

    return ffi, lib


def error_buffer(size: int = 1024) -> Any:
    ffi, _ = load()
    return ffi.new("char[]", size)


def text(cdata: Any) -> str:
    ffi, _ = load()
    return ffi.string(cdata).decode("utf-8", "replace")
