"""Node-to-node links (ggml_backend/node_links.c) on every transport: a dialing
node upgrades its link as a head upgrades its connection (transport/upgrade.c),
so two nodes on one host link over shared memory, and TBRPC_TRANSPORT=tcp
keeps the links on TCP too. The link's TCP connection stays open under shared
memory as its anchor, so a node killed across a link is named at its end of
file, as over TCP, not after the timeout. (Links over RDMA: tests/test_rdma.py;
same tokens as one process over shm links: tests/test_split.py.)"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

import models
from helpers import run_head

PROMPT = "The capital of France is"


def test_env_forces_tcp_for_links_too(nodes: Any, tmp_path: Path) -> None:
    a, b, c = nodes(3)
    endpoints = [a.endpoint, b.endpoint, c.endpoint]
    spec = dict(model=str(models.ensure("llama")), prompt=PROMPT, n_predict=6, nodes=endpoints)
    over_shm, _ = run_head(tmp_path, **spec)
    over_tcp, _ = run_head(tmp_path, env={"TBRPC_TRANSPORT": "tcp"}, **spec)
    for result, kind, why in ((over_shm, "shm 16x256K", ""), (over_tcp, "tcp: asked for", "asked")):
        assert result["error"] is None, result["error"]
        assert [n["transport"] for n in result["nodes"]] == [kind] * 3
        assert [n["transport_why"] for n in result["nodes"]] == [why] * 3   # the reason's kind, beside its words
        for node, following in zip(result["nodes"], endpoints[1:]):
            assert node["links"] == f"{following} {kind}", node["links"]
            assert node["peer_links"] == [{"to": following, "usable": True, "transport": kind, "why": why}], node
        assert result["nodes"][-1]["peer_links"] == []
    assert over_shm["tokens"] == over_tcp["tokens"]
    # both ends of a link log what carries it (the dialer names the listener's link port)
    assert re.search(r"link to peer 127\.0\.0\.1:\d+: transport shm 16x256K", a.log_text()), a.log_text()[-2000:]
    assert re.search(r"link to peer 127\.0\.0\.1:\d+: transport tcp: asked for", a.log_text()), a.log_text()[-2000:]
    assert f"link from peer {a.endpoint}: transport shm 16x256K" in b.log_text(), b.log_text()[-2000:]
    assert f"link from peer {a.endpoint}: transport tcp: peer: asked for" in b.log_text(), b.log_text()[-2000:]


@pytest.mark.parametrize("transport,link", [("auto", "shm 16x256K"), ("tcp", "tcp: peer: asked for")])
def test_node_killed_across_a_link_is_named_at_once(transport: str, link: str, nodes: Any, tmp_path: Path) -> None:
    """The upstream node dies while the downstream one waits for its activations over the link:
    the wait ends at the link's end of file (its TCP anchor under shared memory), so the error names
    the dead node without waiting out the head's 30 s timeout, over shm as over TCP."""
    a, b = nodes(2)
    result, _ = run_head(tmp_path, model=str(models.ensure("llama")), prompt=PROMPT, n_predict=12,
                         nodes=[a.endpoint, b.endpoint], timeout=30.0, transport=transport,
                         kill={"pid": a.proc.pid, "after_tokens": 3})
    assert f"link from peer {a.endpoint}: transport {link}" in b.log_text(), b.log_text()[-2000:]
    assert result["error"] is not None and result["error"]["type"] == "NodeFailed", result["error"]
    message = result["error"]["message"]
    assert a.endpoint in message, message
    assert "no answer within" not in message, message
    assert a.proc.wait(timeout=10) == -9
