"""SHA-256 and HMAC-SHA256 of ggml_backend/auth.c against FIPS 180-4 and
RFC 4231's vectors, the constant-time comparison and nonces: tests/c/auth_tests.c."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tbrpc._build import build_program


def test_auth_primitives(tmp_path: Path) -> None:
    exe = build_program(Path(__file__).parent / "c" / "auth_tests.c", tmp_path / "auth_tests", with_ggml=False)
    proc = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "PASS" in proc.stdout
