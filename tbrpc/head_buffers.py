"""Which buffer types hold the weights a head keeps on its own CPU.

ggml's CPU backend offers *extra* buffer types that repack weights for other
kernels: ``CPU_REPACK`` on most CPUs, ``AMX`` on Intel CPUs with AMX. llama.cpp
uses them when ``llama_model_params.use_extra_bufts`` is set, its default.

tbrpc loads every model that uses tbrpc devices with ``use_extra_bufts`` off:

- On a CPU with AMX, llama.cpp 0.3.36's choice breaks as soon as any layer
  stays on the CPU: expert weights (``MUL_MAT_ID``) land in the AMX buffer
  type, which no backend then runs, and ``ggml_backend_sched_split_graph``
  aborts the process (``GGML_ASSERT(*cur_backend_id != -1)``); dense models
  die of SIGILL or SIGSEGV in the AMX kernels. Seen on this project's Linux
  machines for the tiny llama, the tiny deepseek2 and Gemma 3 270M.
- Layers the head keeps then run the same kernels as a CPU node's (nodes
  serve plain buffers), so a layer computes the same bits wherever the plan
  puts it, and the planner's prediction (plain buffers) is what is allocated.
- What it costs: repacked kernels are faster for layers computed on the
  head's CPU. A head that runs every layer on nodes (tbrpc's plan, the
  default) keeps only the token embeddings, which are never repacked.

``plain_cpu_buffers()`` applies the same choice to a one-process Llama, which
is how tests and benchmarks build the reference a split is compared with.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import llama_cpp.llama_cpp as llama_lib


def _ggml(name: str, restype: Any, argtypes: list[Any]) -> Callable[..., Any]:
    """A ggml function resolved through libllama's handle (the ggml llama.cpp uses)."""
    function = getattr(llama_lib._lib, name)
    function.restype = restype
    function.argtypes = argtypes
    return function


def device_names(devices: int | None) -> list[str] | None:
    """ggml names of a NULL-terminated ggml_backend_dev_t array (llama_model_params.devices);
    None when the pointer is NULL, which means "every GPU device ggml has"."""
    if not devices:
        return None
    array = ctypes.cast(devices, ctypes.POINTER(ctypes.c_void_p))
    name = _ggml("ggml_backend_dev_name", ctypes.c_char_p, [ctypes.c_void_p])
    names = []
    i = 0
    while array[i]:
        names.append(name(array[i]).decode())
        i += 1
    return names


def uses_devices(params: Any, ours: Sequence[str]) -> bool:
    """Would llama.cpp place layers of a model loaded with ``params`` on any of the devices ``ours``?"""
    if not ours or params.n_gpu_layers == 0:
        return False
    names = device_names(params.devices)
    return names is None or any(n in ours for n in names)


def plain_cpu(params: Any) -> Any:
    """``params`` with the CPU backend's extra buffer types off (see the module docstring)."""
    params.use_extra_bufts = False
    return params


_defaults_lock = threading.Lock()


@contextmanager
def plain_cpu_buffers() -> Iterator[None]:
    """While it is active, ``llama_cpp.Llama(...)`` loads weights into plain CPU buffers.

    ``Llama()`` has no argument for ``use_extra_bufts``; it starts from
    ``llama_model_default_params()``, which this wraps.
    """
    with _defaults_lock:
        original = llama_lib.llama_model_default_params
        llama_lib.llama_model_default_params = lambda: plain_cpu(original())
        try:
            yield
        finally:
            llama_lib.llama_model_default_params = original
