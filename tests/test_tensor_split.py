"""llama.cpp's tensor split (split_mode=3) over tbrpc nodes: every layer cut
across the nodes, partial sums all-reduced node to node.

llama.cpp wraps the TBRPC devices in its "meta" device, which slices the
weights and runs each layer as subgraphs on every node, with an all-reduce
after each partial result (a butterfly of node-to-node copies, tbrpc's
PEER_SEND/PEER_RECV, and one-node ADD graphs). Reference: one process with
the same flash attention (tensor mode requires it). Partial sums are added
in another order than one process adds them, so logits agree to a
tolerance, not bitwise; greedy tokens agree exactly.

The model is the tiny llama with F32 weights: llama.cpp's meta backend
aborts on a quantized row that is exactly one block wide (the tiny model's
Q4_K ffn_down; real models are wider) and on Gemma 3's attention, in code
that tbrpc does not control, so those are not run here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import models
from helpers import run_head

PROMPT = "The capital of France is"
N_PREDICT = 12
LOGIT_TOLERANCE = 1e-2   # measured: at most 8e-4 on this model


@pytest.mark.parametrize("n_nodes", [2, 4])
def test_tensor_split_matches_single_process(n_nodes: int, nodes: Any, tmp_path: Path) -> None:
    model = str(models.ensure("llama-f32"))
    base, base_logits = run_head(tmp_path, model=model, prompt=PROMPT, n_predict=N_PREDICT, flash_attn=True)
    assert base["error"] is None, base["error"]
    started = nodes(n_nodes)
    result, logits = run_head(tmp_path, model=model, prompt=PROMPT, n_predict=N_PREDICT, flash_attn=True,
                              split_mode=3, nodes=[n.endpoint for n in started])
    assert result["error"] is None, result["error"]
    assert result["tokens"] == base["tokens"]
    assert logits is not None and logits.shape == base_logits.shape
    diff = float(np.max(np.abs(logits - base_logits)))
    assert diff <= LOGIT_TOLERANCE, diff

    # Every node holds a slice of the weights, and the partial sums went node to node.
    assert all(a > 0 for a in result["allocated_after_load"]), result["allocated_after_load"]
    for node in result["nodes"]:
        assert node["peer_copies"] >= N_PREDICT - 1, node
        assert not node["failed"], node["error"]
