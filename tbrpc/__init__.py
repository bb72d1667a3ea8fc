"""tbrpc: run GGUF models too big for one machine across several, with llama-cpp-python.

    import tbrpc, llama_cpp
    tbrpc.connect(["10.0.0.2:50052", "10.0.0.3:50052"])
    llm = llama_cpp.Llama("model.gguf", n_gpu_layers=-1, tensor_split=[1, 1])
"""

from __future__ import annotations

from tbrpc.client import (
    AuthenticationError,
    Cluster,
    DuplicateNodeError,
    HandshakeRefused,
    NodeError,
    NodeFailed,
    NodeFullError,
    NodeInfo,
    NodeStatus,
    NodeUnreachable,
    NodeVersionMismatch,
    cluster,
    connect,
    probe,
)
from tbrpc.native import TbrpcError, VersionMismatchError
from tbrpc.node_processes import LaunchError

__all__ = [
    "AuthenticationError", "Cluster", "DuplicateNodeError", "HandshakeRefused", "LaunchError", "Llama", "NodeError", "NodeFailed", "NodeFullError",
    "NodeInfo", "NodeStatus", "NodeUnreachable", "NodeVersionMismatch", "TbrpcError", "VersionMismatchError",
    "cluster", "connect", "probe",
]


def __getattr__(name: str) -> object:
    # tbrpc.Llama imports llama_cpp; loaded on first use so `tbrpc node` and
    # `python -m tbrpc.facts` do not pay for it (or fail with it).
    if name == "Llama":
        from tbrpc.llama import Llama

        return Llama
    raise AttributeError(f"module 'tbrpc' has no attribute {name!r}")
