"""Shared fixtures: real node processes on loopback (helpers: tests/helpers.py)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from helpers import ROOT, NodeProcess, start_node, stop_nodes  # noqa: E402  (after the path it needs)


@pytest.fixture(autouse=True)
def no_cluster_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test starts without a cluster secret: none from the developer's environment, and none
    chosen by an earlier test's command (`--secret-file` makes tbrpc.secret.use() remember its path
    for the process). A test that wants one sets it."""
    from tbrpc import secret

    monkeypatch.delenv(secret.ENV, raising=False)
    monkeypatch.setattr(secret, "_chosen", None)


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[Any]:
    """Factory: nodes(n) starts n node processes, all stopped (and checked gone) after the test."""
    started: list[NodeProcess] = []

    def factory(n: int, *extra: str, cwd: Path = ROOT) -> list[NodeProcess]:
        new = [start_node(tmp_path, *extra, cwd=cwd) for _ in range(n)]
        started.extend(new)
        return new

    yield factory
    stop_nodes(started)
