"""End to end: greedy generation split across 1, 2 and 4 node processes gives
exactly the tokens and logits of a single process, and the weights really
live on the nodes.

Baseline: one process with CPU-only layers and use_extra_bufts=False. Nodes
serve plain CPU buffers; a default single process would repack Q4_K and
friends into CPU_REPACK buffers, whose kernels round differently. With the
same kernels on both sides the logits are bitwise identical (measured for
all three models; see docs/architecture.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import models
from helpers import PROMPT, layer_weight_bytes, run_head

N_PREDICT = 12


@pytest.fixture(scope="module")
def baselines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict[str, Any], np.ndarray]]:
    cache_: dict[str, tuple[dict[str, Any], np.ndarray]] = {}
    tmp = tmp_path_factory.mktemp("baseline")

    def get(name: str) -> tuple[dict[str, Any], np.ndarray]:
        if name not in cache_:
            result, logits = run_head(tmp, model=str(models.ensure(name)), prompt=PROMPT, n_predict=N_PREDICT)
            assert result["error"] is None, result["error"]
            cache_[name] = (result, logits)
        return cache_[name]

    return get  # type: ignore[return-value]


# The head's connections: "shm" is what "auto" picks for nodes on this host.
TRANSPORT_ASKED = {"shm": "auto", "tcp": "tcp"}


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("n_nodes", [1, 2, 4])
@pytest.mark.parametrize("model_name", ["llama", "deepseek2", "gemma"])
def test_split_matches_single_process(model_name: str, n_nodes: int, transport: str, nodes: Any, baselines: Any,
                                      tmp_path: Path) -> None:
    base, base_logits = baselines(model_name)
    started = nodes(n_nodes)
    result, logits = run_head(tmp_path, model=str(models.ensure(model_name)), prompt=PROMPT, n_predict=N_PREDICT,
                              nodes=[n.endpoint for n in started], transport=TRANSPORT_ASKED[transport])
    assert result["error"] is None, result["error"]
    assert [n["transport"].split(":")[0].split(" ")[0] for n in result["nodes"]] == [transport] * n_nodes, \
        [n["transport"] for n in result["nodes"]]
    assert result["tokens"] == base["tokens"]
    assert logits is not None and logits.shape == base_logits.shape
    assert np.array_equal(logits, base_logits), f"max |diff| {np.max(np.abs(logits - base_logits))}"
    # Activations went node to node over links of the same transport (not silently TCP).
    link_kind = {"shm": "shm 16x256K", "tcp": "tcp: asked for"}[transport]
    for node, following in zip(result["nodes"], started[1:]):
        assert f"{following.endpoint} {link_kind}" in node["links"], node["links"]

    # The weights are on the nodes, not silently on the head's CPU.
    allocated = result["allocated_after_load"]
    assert all(a > 0 for a in allocated), allocated
    assert sum(allocated) >= layer_weight_bytes(models.ensure(model_name))

    # Steady state (counters reset before the second decode): each node already
    # holds its graph, so only "run it again" crosses the wire; activations go
    # node to node, so the head waits once per token (the logits), not once
    # per node.
    steady_tokens = N_PREDICT - 1   # decodes after the reset
    for node in result["nodes"]:
        assert node["graphs_reused"] == steady_tokens and node["graphs_sent"] == 0, node
        assert not node["failed"], node["error"]
    assert sum(node["round_trips"] for node in result["nodes"]) == steady_tokens
    assert sum(node["peer_copies"] for node in result["nodes"]) >= (n_nodes - 1) * steady_tokens


def test_split_over_spawned_workers(nodes: Any, baselines: Any, tmp_path: Path) -> None:
    """macOS's way of serving clients (a fresh worker process each), run here:
    the same tokens and logits, activations still going node to node."""
    base, base_logits = baselines("deepseek2")
    started = nodes(2, "--isolation", "spawn")
    result, logits = run_head(tmp_path, model=str(models.ensure("deepseek2")), prompt=PROMPT, n_predict=N_PREDICT,
                              nodes=[n.endpoint for n in started])
    assert result["error"] is None, result["error"]
    assert result["tokens"] == base["tokens"] and np.array_equal(logits, base_logits)
    assert all(a > 0 for a in result["allocated_after_load"])
    assert sum(node["peer_copies"] for node in result["nodes"]) >= N_PREDICT - 1
