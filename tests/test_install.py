"""A plain `pip install` of this checkout, as a new user would run it.

Into a new venv (empty, or holding llama-cpp-python already), `pip install
<checkout>` with no flags must give a working `tbrpc`: launch splits Gemma 3
270M over two local nodes and prints the text of one plain process. pip
builds llama-cpp-python once and keeps the wheel in its cache (`make setup`
already did), so each case costs a venv and the downloads of the API's
packages.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import models
from helpers import PROMPT, baseline

ROOT = Path(__file__).resolve().parent.parent
MAX_TOKENS = 8


def checkout_copy(dest: Path) -> Path:
    """The files a clone of this checkout holds (tracked, or new and not ignored), without builds or venvs."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def run(cmd: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home())}   # nothing of this test's venv leaks in
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.mark.parametrize("first", [[], ["llama-cpp-python==0.3.36"]], ids=["empty-venv", "llama-cpp-python-first"])
def test_pip_install_then_launch(first: list[str], tmp_path: Path) -> None:
    gemma = models.ensure("gemma")
    want = baseline(gemma, PROMPT, MAX_TOKENS)["text"]
    source = checkout_copy(tmp_path / "checkout")
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(venv)], tmp_path, 120)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    if first:
        run(pip + first, tmp_path, 1800)
    run(pip + [str(source)], tmp_path, 1800)
    work = tmp_path / "elsewhere"   # not the checkout: what runs is what pip installed
    work.mkdir()
    done = run([str(venv / "bin" / "tbrpc"), "launch", "--gguf", str(gemma), "--local", "2", "--ctx", "256",
                "--prompt", PROMPT, "--max-tokens", str(MAX_TOKENS), "--log-dir", str(tmp_path / "logs")], work, 600)
    assert done.stdout == want + "\n", done.stderr
    installed = run([str(venv / "bin" / "python"), "-c", "import tbrpc._native as n; print(n.__file__)"], work, 60)
    assert installed.stdout.startswith(str(venv)), installed.stdout
