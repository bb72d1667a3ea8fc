"""The one-process reference every split is compared with.

It loads weights into plain CPU buffers (``use_extra_bufts=False``), the
buffers a CPU node serves, so reference and split run the same kernels on
any CPU: with the defaults a CPU with AMX aborts in llama.cpp, and every
other x86 CPU repacks Q4_K and friends into ``CPU_REPACK`` buffers whose
kernels round differently (tbrpc/head_buffers.py says more). Every test that
builds a one-process ``llama_cpp.Llama`` builds it here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import llama_cpp

from tbrpc.head_buffers import plain_cpu_buffers


def reference_llama(path: str | Path, **kwargs: Any) -> llama_cpp.Llama:
    """``llama_cpp.Llama(path, **kwargs)`` in this process, weights in plain CPU buffers."""
    with plain_cpu_buffers():
        return llama_cpp.Llama(str(path), **kwargs)
