"""TBRPC_TRACE (ggml_backend/trace.h): the head's connections and the nodes'
sessions record when requests left and came, when graphs ran and when a peer's
activations were in, on the host's one monotonic clock, so a token's critical
path can be laid out across processes (benchmarks/trace_hops.py). The records
must say what happened, in the order the protocol makes it happen, or the
breakdown built on them is fiction."""

from __future__ import annotations

import struct
import time
from pathlib import Path
from typing import Any

import pytest

import models
from helpers import run_head
from tbrpc._native import ffi, lib

PROMPT = "The capital of France is"
EVENT = struct.Struct("<qHHI")


def read_traces(directory: Path, sessions: int) -> list[tuple[str, str, list[tuple[int, int, int]]]]:
    """The traces once `sessions` of them are closed (a node's session closes its file a moment
    after its head has gone: until then its records may sit in the buffer)."""
    deadline = time.monotonic() + 30
    while sum(f.stat().st_size > 0 for f in directory.glob("*.trace")) < sessions and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)
    out = []
    for path in sorted(directory.glob("*.trace")):
        line, _, body = path.read_bytes().partition(b"\n")
        magic, version, role, who = line.decode().split(" ", 3)
        assert (magic, version) == ("tbrpc-trace", "1"), line
        assert len(body) % EVENT.size == 0, f"{path.name}: {len(body)} bytes of records"
        out.append((role, who, [(t, w, c) for t, w, c, _ in EVENT.iter_unpack(body)]))
    return out


def test_a_trace_follows_each_token_across_head_and_nodes(nodes: Any, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    assert EVENT.size == ffi.sizeof("struct tb_trace_event")
    trace_dir = tmp_path / "trace"
    trace_dir.mkdir()
    monkeypatch.setenv("TBRPC_TRACE", str(trace_dir))   # the nodes and the head inherit it
    a = nodes(1, "--name", "first")[0]
    b = nodes(1, "--name", "second")[0]
    n_predict = 6
    result, _ = run_head(tmp_path, model=str(models.ensure("llama")), prompt=PROMPT, n_predict=n_predict,
                         nodes=[a.endpoint, b.endpoint])
    assert result["error"] is None, result["error"]
    traces = read_traces(trace_dir, sessions=4)   # two head connections, two node sessions at least
    for role, who, events in traces:
        assert role in ("head", "node"), role
        assert [t for t, _, _ in events] == sorted(t for t, _, _ in events), f"{who}: time runs backwards"
        assert all(lib.TB_TRACE_FLUSH <= w <= lib.TB_TRACE_PEER_DATA for _, w, _ in events), who
        assert all(0 <= c < lib.TB_CMD_COUNT_ for _, _, c in events), who
    # the sessions that ran the split (the probes before it computed nothing)
    computing = {who: events for role, who, events in traces
                 if role == "node" and any(w == lib.TB_TRACE_GRAPH_START for _, w, _ in events)}
    assert sorted(computing) == ["first", "second"], sorted(computing)
    heads = {who: events for role, who, events in traces
             if role == "head" and any(c == lib.TB_CMD_GRAPH_COMPUTE for _, _, c in events)}
    assert sorted(heads) == sorted([a.endpoint, b.endpoint]), sorted(heads)

    def what(events: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
        return [(w, c) for _, w, c in events]

    first, second = computing["first"], computing["second"]
    # every graph on the first node: requested, started, ended, then done; its activations leave after it
    starts = [i for i, (w, _) in enumerate(what(first)) if w == lib.TB_TRACE_GRAPH_START]
    for i in starts:
        assert what(first)[i + 1][0] == lib.TB_TRACE_GRAPH_END, what(first)[i - 2:i + 3]
        assert what(first)[i - 1][0] == lib.TB_TRACE_REQUEST and what(first)[i - 1][1] in (
            lib.TB_CMD_GRAPH_COMPUTE, lib.TB_CMD_GRAPH_RECOMPUTE), what(first)[i - 2:i + 3]
    sends = [t for t, w, c in first if w == lib.TB_TRACE_REQUEST and c == lib.TB_CMD_PEER_SEND]
    # at least a batch per generated token, each crossing the link once
    assert len(sends) >= n_predict, len(sends)
    # the second node: each of its graphs starts after activations came in (and no graph between)
    events = what(second)
    received = [i for i, (w, c) in enumerate(events) if w == lib.TB_TRACE_PEER_DATA and c == lib.TB_CMD_PEER_RECV]
    assert len(received) == len(sends), (len(received), len(sends))
    for k, i in enumerate(received):
        following = [j for j, (w, _) in enumerate(events) if j > i and w == lib.TB_TRACE_GRAPH_START]
        assert following, f"activations {k} were never used"
        before = received[k + 1] if k + 1 < len(received) else len(events)
        assert following[0] < before, f"no graph between activations {k} and {k + 1}"
    # one clock for all processes: activations arrive after their PEER_SEND was read, and the head's
    # reply with the logits after the second node finished the graph that made them
    arrivals = [second[i][0] for i in received]
    assert all(sent < got for sent, got in zip(sends, arrivals)), list(zip(sends, arrivals))
    last_graph_end = [t for t, w, _ in second if w == lib.TB_TRACE_GRAPH_END][-1]
    logits = [t for t, w, c in heads[b.endpoint] if w == lib.TB_TRACE_REPLY and c == lib.TB_CMD_GET_TENSOR]
    assert logits and logits[-1] > last_graph_end


def test_a_trace_that_cannot_be_written_changes_nothing(nodes: Any, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A measurement aid must never break a run: a TBRPC_TRACE directory that does not exist
    (nothing can be written) leaves the head and the nodes answering as without it."""
    monkeypatch.setenv("TBRPC_TRACE", str(tmp_path / "missing"))
    (a,) = nodes(1)
    traced, _ = run_head(tmp_path, model=str(models.ensure("llama")), prompt=PROMPT, n_predict=4, nodes=[a.endpoint])
    monkeypatch.delenv("TBRPC_TRACE")
    plain, _ = run_head(tmp_path, model=str(models.ensure("llama")), prompt=PROMPT, n_predict=4, nodes=[a.endpoint])
    assert traced["error"] is None and plain["error"] is None, (traced["error"], plain["error"])
    assert traced["tokens"] == plain["tokens"]
    assert not (tmp_path / "missing").exists()
