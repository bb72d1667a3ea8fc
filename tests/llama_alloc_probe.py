"""Ask llama.cpp itself what it allocates for a model and context.

Runs llama-cpp-python in a child process (llama.cpp's logger is global and a
failed load can abort), captures its log through ``llama_log_set`` and parses
the buffer sizes it reports per buffer type: model weights, KV cache, output
and compute buffers.  With ``no_alloc`` llama.cpp only simulates allocations,
which makes it possible to ask about trillion-parameter sparse fixtures.

The result is keyed by buffer name ("CPU", "CPU_Mapped", "MTL0", "TBRPC1", ...)
so a split run (several devices) is the same call with a ``tensor_split``;
with ``nodes`` the child first connects to those tbrpc nodes (they become
TBRPC0..N) and also reports what each node says it has allocated.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MiB = 1024**2

_CHILD = r"""
import ctypes, json, sys
import llama_cpp

args = json.loads(sys.argv[1])
lines = []
devices = []
if args["nodes"]:
    import tbrpc  # before the backend init: the TBRPC devices join ggml's registry
    devices = tbrpc.connect(args["nodes"])

def allocated():  # bytes each node reports allocated (over all its clients)
    c = tbrpc.cluster()
    return [c.status(i).bytes_allocated for i in range(len(devices))]

before_load = allocated() if devices else []

@llama_cpp.llama_log_callback
def _log(level, text, user_data):
    lines.append(text.decode("utf-8", errors="replace"))

llama_cpp.llama_log_set(_log, ctypes.c_void_p(0))
llama_cpp.llama_backend_init()
# plain CPU buffers, as on a tbrpc head (tbrpc/head_buffers.py): the planner predicts those
from tbrpc.head_buffers import plain_cpu
mp = plain_cpu(llama_cpp.llama_model_default_params())
mp.n_gpu_layers = args["n_gpu_layers"]
mp.no_alloc = args["no_alloc"]
if args["no_alloc"]:
    mp.load_mode = llama_cpp.LLAMA_LOAD_MODE_NONE
if args["tensor_split"]:
    ts = (ctypes.c_float * llama_cpp.LLAMA_MAX_DEVICES)(*args["tensor_split"])
    mp.tensor_split = ts
model = llama_cpp.llama_model_load_from_file(args["path"].encode(), mp)
if not model:
    print(json.dumps({"error": "load failed", "log": "".join(lines)[-4000:]}))
    sys.exit(0)
after_load = allocated() if devices else []
cp = llama_cpp.llama_context_default_params()
cp.n_ctx = args["n_ctx"]
cp.n_batch = args["n_batch"]
cp.n_ubatch = args["n_ubatch"]
cp.n_threads = 1
cp.n_threads_batch = 1
cp.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if args["flash_attn"] else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
cp.type_k = args["type_k"]
cp.type_v = args["type_v"]
if args["swa_full"] is not None:
    cp.swa_full = args["swa_full"]
ctx = llama_cpp.llama_init_from_model(model, cp)
if not ctx:
    print(json.dumps({"error": "context failed", "log": "".join(lines)[-4000:]}))
    sys.exit(0)
print(json.dumps({"log": "".join(lines), "node_devices": devices, "allocated_before_load": before_load,
                  "allocated_after_load": after_load, "allocated_after_context": allocated() if devices else []}))
"""

_MODEL_RE = re.compile(r"load_tensors:\s+(\S+) model buffer size =\s+([\d.]+) MiB")
_KV_RE = re.compile(r"llama_kv_cache:\s+(\S+) KV buffer size =\s+([\d.]+) MiB")
_KV_TOTAL_RE = re.compile(r"llama_kv_cache: size =\s+([\d.]+) MiB \(\s*(\d+) cells")
_OUTPUT_RE = re.compile(r"llama_context:\s+(\S+)\s+output buffer size =\s+([\d.]+) MiB")
_LAYER_RE = re.compile(r"load_tensors: layer\s+(\d+) assigned to device (\S+?),")
_COMPUTE_RE = re.compile(r"(?:llama_context|sched_reserve):\s+(\S+) compute buffer size =\s+([\d.]+) MiB")


@dataclass
class Allocation:
    """Bytes per buffer name, as llama.cpp logged them (MiB with 2 decimals)."""

    model: dict[str, int] = field(default_factory=dict)
    kv: dict[str, int] = field(default_factory=dict)
    kv_logical: list[tuple[int, int]] = field(default_factory=list)  # (bytes, cells) per KV cache
    output: dict[str, int] = field(default_factory=dict)
    compute: dict[str, int] = field(default_factory=dict)
    layer_devices: dict[int, str] = field(default_factory=dict)  # layer -> device; n_layer = the output layer
    log: str = ""
    # With nodes: their ggml device names (TBRPC0, ...) and the bytes each node
    # reported allocated before the load, after the model load and after the
    # context (KV + compute).
    node_devices: list[str] = field(default_factory=list)
    allocated_before_load: list[int] = field(default_factory=list)
    allocated_after_load: list[int] = field(default_factory=list)
    allocated_after_context: list[int] = field(default_factory=list)

    def total(self, kind: str) -> int:
        return sum(getattr(self, kind).values())


def _mib(text: str) -> int:
    return round(float(text) * MiB)


def parse_log(log: str) -> Allocation:
    alloc = Allocation(log=log)
    for regex, target in ((_MODEL_RE, alloc.model), (_KV_RE, alloc.kv), (_OUTPUT_RE, alloc.output), (_COMPUTE_RE, alloc.compute)):
        for name, size in regex.findall(log):
            target[name] = target.get(name, 0) + _mib(size)
    alloc.layer_devices = {int(il): dev for il, dev in _LAYER_RE.findall(log)}
    alloc.kv_logical = [(_mib(size), int(cells)) for size, cells in _KV_TOTAL_RE.findall(log)]
    return alloc


def probe(
    path: Path,
    *,
    n_ctx: int,
    n_ubatch: int = 512,
    n_batch: int | None = None,
    flash_attn: bool = False,
    type_k: int = 1,  # GGML_TYPE_F16
    type_v: int = 1,
    no_alloc: bool = False,
    n_gpu_layers: int = -1,
    tensor_split: list[float] | None = None,
    swa_full: bool | None = None,
    nodes: list[str] | None = None,
    timeout: float = 600,
) -> Allocation:
    """llama.cpp's allocations for ``path``; with ``nodes`` ("host:port") the
    child connects to them first, so they are the TBRPC devices the split uses."""
    args: dict[str, Any] = {
        "path": str(path),
        "n_ctx": n_ctx,
        "n_ubatch": n_ubatch,
        "n_batch": n_batch or n_ubatch,
        "flash_attn": flash_attn,
        "type_k": type_k,
        "type_v": type_v,
        "no_alloc": no_alloc,
        "n_gpu_layers": n_gpu_layers,
        "tensor_split": tensor_split,
        "swa_full": swa_full,
        "nodes": list(nodes or []),
    }
    proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(args)], capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 or not proc.stdout.strip():
        raise RuntimeError(f"llama.cpp probe crashed ({proc.returncode}): {proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if "error" in result:
        raise RuntimeError(f"llama.cpp probe: {result['error']}\n{result['log']}")
    alloc = parse_log(result["log"])
    alloc.node_devices = result.get("node_devices", [])
    alloc.allocated_before_load = result.get("allocated_before_load", [])
    alloc.allocated_after_load = result.get("allocated_after_load", [])
    alloc.allocated_after_context = result.get("allocated_after_context", [])
    return alloc
