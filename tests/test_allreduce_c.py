"""tbrpc's ALLREDUCE, mesh and ring, through the comm functions llama.cpp
calls: tests/c/allreduce_tests.c, nodes in threads of one process (every
link TCP), exact sums and the same bits on every node at sizes a model never
makes (empty ring chunks, uneven chunks, several pieces per ring step)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tbrpc._build import build_program


@pytest.fixture(scope="module")
def allreduce_tests(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_program(Path(__file__).parent / "c" / "allreduce_tests.c",
                         tmp_path_factory.mktemp("c") / "allreduce_tests")


@pytest.mark.parametrize("mode,n", [("ring", 3), ("ring", 4), ("ring", 5), ("mesh", 3)])
def test_allreduce_sums_at_every_size(allreduce_tests: Path, mode: str, n: int) -> None:
    proc = subprocess.run([str(allreduce_tests), mode, str(n)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "PASS" in proc.stdout
