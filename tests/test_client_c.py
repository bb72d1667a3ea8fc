"""The head's tbrpc devices through ggml's backend calls, in C
(tests/c/get_async_tests.c, nodes in threads of one process): a read left in
flight by get_tensor_async is answered while the head waits for nothing, reads
from two nodes are in flight together, a later request to the node settles it
first and in order, and a connection that fails under it gives zeros and a
failure naming the read."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tbrpc._build import build_program


@pytest.fixture(scope="module")
def get_async_tests(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_program(Path(__file__).parent / "c" / "get_async_tests.c",
                         tmp_path_factory.mktemp("c") / "get_async_tests")


@pytest.mark.parametrize("case", ["in_flight", "settles_first", "failed"])
def test_get_tensor_async(get_async_tests: Path, case: str) -> None:
    proc = subprocess.run([str(get_async_tests), case], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "PASS" in proc.stdout
