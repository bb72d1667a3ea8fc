"""Weights a head keeps on its own CPU go into plain CPU buffers, on any CPU.

llama.cpp's default puts them into the CPU backend's extra buffer types
(CPU_REPACK, AMX), which abort or crash a split on CPUs with AMX and run
other kernels than a CPU node everywhere else (tbrpc/head_buffers.py). These
tests keep layers on the head on purpose, so they fail on every x86 CPU if
tbrpc stops choosing plain buffers: with AMX the head process dies, without
it the load reports a CPU_REPACK buffer and the logits differ.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import models
from helpers import run_head
from tests import llama_alloc_probe

PROMPT = "The capital of France is"
N_PREDICT = 8


@pytest.mark.parametrize("model_name", ["llama", "deepseek2", "gemma"])
def test_layers_on_the_head_use_plain_buffers(model_name: str, nodes: Any, tmp_path: Path) -> None:
    model = str(models.ensure(model_name))
    started = [n.endpoint for n in nodes(2)]
    # n_gpu_layers=1: every layer but the last stays on the head's CPU (for deepseek2 the MoE experts too)
    split, split_logits = run_head(tmp_path, model=model, prompt=PROMPT, n_predict=N_PREDICT,
                                   nodes=started, n_gpu_layers=1)
    base, base_logits = run_head(tmp_path, model=model, prompt=PROMPT, n_predict=N_PREDICT)
    assert split["error"] is None and base["error"] is None, (split["error"], base["error"])
    assert split["tokens"] == base["tokens"]
    assert np.array_equal(split_logits, base_logits), f"max |diff| {np.max(np.abs(split_logits - base_logits))}"

    alloc = llama_alloc_probe.probe(Path(model), n_ctx=256, n_gpu_layers=1, nodes=started)
    plain = {"CPU", "CPU_Mapped", *alloc.node_devices}
    assert alloc.model and set(alloc.model) <= plain, alloc.model
    assert any(alloc.model.get(d, 0) > 0 for d in alloc.node_devices), alloc.model   # the last layer is remote


def test_which_loads_use_tbrpc_devices() -> None:
    import llama_cpp
    import llama_cpp.llama_cpp as lib

    from tbrpc.head_buffers import device_names, uses_devices

    llama_cpp.llama_backend_init()
    params = lib.llama_model_default_params()
    assert uses_devices(params, ["TBRPC0"])               # NULL devices: every GPU device ggml has, ours too
    assert not uses_devices(params, [])                   # no tbrpc devices in this process
    params.n_gpu_layers = 0
    assert not uses_devices(params, ["TBRPC0"])           # nothing offloaded
    params.n_gpu_layers = -1
    by_type = lib._lib.ggml_backend_dev_by_type
    by_type.restype, by_type.argtypes = ctypes.c_void_p, [ctypes.c_int]
    cpu_only = (ctypes.c_void_p * 2)(by_type(0), None)
    params.devices = ctypes.cast(cpu_only, ctypes.c_void_p).value
    assert device_names(params.devices) == ["CPU"]
    assert not uses_devices(params, ["TBRPC0"])
