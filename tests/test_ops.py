"""Op-level tests through the plugin: tests/c/op_tests.c, compiled here
against the same ggml and tbrpc sources, one process per case."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tbrpc._build import build_program

CASES = ["set_get_odd", "memset_clear", "copy_and_views", "ops", "many_nodes", "graph_reuse",
         "allocation_accounting", "supports_op", "asked_answers", "dead_node_answers_yes", "keepalive", "alloc_size",
         "op_query_fields", "asked_about_foreign_sources", "supports_key_layouts", "earlier_results_as_data"]


@pytest.fixture(scope="module")
def op_tests(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_program(Path(__file__).parent / "c" / "op_tests.c", tmp_path_factory.mktemp("c") / "op_tests")


@pytest.mark.parametrize("case", CASES)
def test_op_case(op_tests: Path, case: str) -> None:
    proc = subprocess.run([str(op_tests), case], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"PASS {case}" in proc.stdout
