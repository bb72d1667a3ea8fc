"""Op-level tests through the plugin: tests/c/op_tests.c, compiled here
against the same ggml and tbrpc sources, one process per case."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tbrpc._build import C_DIR, C_SOURCES, SYSTEM_LIBS, llama_cpp_paths

CASES = ["set_get_odd", "memset_clear", "copy_and_views", "ops", "many_nodes", "graph_reuse",
         "allocation_accounting", "supports_op", "asked_answers", "dead_node_answers_yes", "keepalive", "alloc_size",
         "op_query_fields", "asked_about_foreign_sources", "supports_key_layouts"]


@pytest.fixture(scope="module")
def op_tests(tmp_path_factory: pytest.TempPathFactory) -> Path:
    include, lib, _ = llama_cpp_paths()
    exe = tmp_path_factory.mktemp("c") / "op_tests"
    link = ["-l:libggml.so.0", "-l:libggml-base.so.0"] if sys.platform != "darwin" else ["-lggml", "-lggml-base"]
    cmd = ["cc", "-std=gnu11", "-O2", "-Wall", "-Werror", "-Wno-unused-parameter", "-Wno-format-truncation",
           f"-I{C_DIR}", f"-I{include}", str(Path(__file__).parent / "c" / "op_tests.c"),
           *[str(C_DIR / s) for s in C_SOURCES], f"-L{lib}", *link, f"-Wl,-rpath,{lib}", *SYSTEM_LIBS, "-o", str(exe)]
    subprocess.run(cmd, check=True)
    return exe


@pytest.mark.parametrize("case", CASES)
def test_op_case(op_tests: Path, case: str) -> None:
    proc = subprocess.run([str(op_tests), case], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"PASS {case}" in proc.stdout
