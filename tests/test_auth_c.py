"""SHA-256 and HMAC-SHA256 of ggml_backend/auth.c against FIPS 180-4, NIST and
RFC 4231's vectors and against hashlib, the constant-time comparison and
nonces: tests/c/auth_tests.c. Built for this machine, and for arm64 with a
cross compiler and run under qemu-user (its CPU "max" has ARMv8's SHA-2
instructions, so the ARMv8 path runs; no CPU model of qemu 7.2 lacks them,
so the portable fallback is reached through TBRPC_SHA256_PORTABLE there)."""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from tbrpc._build import build_program

C_TEST = Path(__file__).parent / "c" / "auth_tests.c"
CROSS_CC, QEMU = "aarch64-linux-gnu-gcc", "qemu-aarch64"
NO_ARM = shutil.which(CROSS_CC) is None or shutil.which(QEMU) is None
needs_arm = pytest.mark.skipif(NO_ARM, reason=f"no {CROSS_CC} or {QEMU} "
                               "(apt-get install gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user)")
ARM_BROKEN = "TB_SHA256_BROKEN_ARMV8_ROUND"


@pytest.fixture(scope="module")
def programs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("auth")
    progs = {"host": build_program(C_TEST, out / "auth_tests", with_ggml=False)}
    if not NO_ARM:
        arm = (CROSS_CC, "-static")
        progs["arm64"] = build_program(C_TEST, out / "auth_tests_arm64", with_ggml=False, compiler=arm)
        progs["arm64-broken"] = build_program(C_TEST, out / "auth_tests_arm64_broken", with_ggml=False,
                                              compiler=arm, defines=(ARM_BROKEN,))
    return progs


def run(programs: dict[str, Path], prog: str, *args: str, portable: bool = False, cpu: str = "max",
        data: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    env = {k: v for k, v in os.environ.items() if k != "TBRPC_SHA256_PORTABLE"}
    if portable:
        env["TBRPC_SHA256_PORTABLE"] = "1"
    cmd = [str(programs[prog]), *args]
    if prog.startswith("arm64"):
        cmd = [QEMU, "-cpu", cpu, *cmd]
    return subprocess.run(cmd, input=data, capture_output=True, env=env, timeout=120)


def impl(proc: subprocess.CompletedProcess[bytes]) -> str:
    first = proc.stdout.decode().splitlines()[0]
    assert first.startswith("sha256: "), first
    return first.removeprefix("sha256: ")


@pytest.mark.parametrize("portable", [False, True])
def test_auth_primitives(programs: dict[str, Path], portable: bool) -> None:
    proc = run(programs, "host", portable=portable)
    assert proc.returncode == 0, proc.stderr.decode()[-4000:]
    assert b"PASS" in proc.stdout
    if portable:
        assert impl(proc) == "portable"


@needs_arm
@pytest.mark.parametrize("cpu", ["max", "cortex-a53"])
@pytest.mark.parametrize("portable", [False, True])
def test_arm64_vectors(programs: dict[str, Path], cpu: str, portable: bool) -> None:
    """The ARMv8 SHA-2 path where the CPU has it, the portable one when told."""
    proc = run(programs, "arm64", portable=portable, cpu=cpu)
    assert proc.returncode == 0, proc.stderr.decode()[-4000:]
    assert b"PASS" in proc.stdout
    assert impl(proc) == ("portable" if portable else "ARMv8 SHA2")


def messages(seed: int) -> list[bytes]:
    """Random messages of random lengths 0..10000, and every length around the
    block and padding boundaries of the first blocks."""
    rng = random.Random(seed)
    lengths = list(range(0, 200)) + [rng.randrange(0, 10001) for _ in range(200)] + [10000]
    return [rng.randbytes(n) for n in lengths]


def digests(programs: dict[str, Path], prog: str, msgs: list[bytes], portable: bool) -> tuple[str, list[str]]:
    data = b"".join(struct.pack("<I", len(m)) + m for m in msgs)
    proc = run(programs, prog, "digests", portable=portable, data=data)
    assert proc.returncode == 0, proc.stderr.decode()[-4000:]
    lines = proc.stdout.decode().splitlines()
    return impl(proc), lines[1:]


@pytest.mark.parametrize("prog", ["host", pytest.param("arm64", marks=needs_arm)])
@pytest.mark.parametrize("portable", [False, True])
def test_random_messages_match_hashlib(programs: dict[str, Path], prog: str, portable: bool) -> None:
    """Each message hashed in one call (many blocks at once) and in uneven pieces."""
    msgs = messages(seed=1234 + portable)
    used, got = digests(programs, prog, msgs, portable)
    if prog == "arm64":
        assert used == ("portable" if portable else "ARMv8 SHA2")
    want = [f"{hashlib.sha256(m).hexdigest()} {hashlib.sha256(m).hexdigest()}" for m in msgs]
    assert len(got) == len(want)
    bad = [(len(m), g) for m, g, w in zip(msgs, got, want) if g != w]
    assert not bad, f"{len(bad)} of {len(msgs)} differ, first (length, got): {bad[0]}"


@needs_arm
def test_a_broken_armv8_round_fails(programs: dict[str, Path]) -> None:
    """A round that takes EFGH from the new ABCD (a plausible slip) fails the
    vectors and hashlib; forced to the portable path the same program passes,
    so the flag does reach past the ARMv8 code."""
    proc = run(programs, "arm64-broken")
    assert proc.returncode == 1
    assert impl(proc) == "ARMv8 SHA2"
    assert b"FAIL sha256 abc" in proc.stderr and b"PASS" not in proc.stdout
    msgs = messages(seed=99)
    _, got = digests(programs, "arm64-broken", msgs, portable=False)
    assert all(line.split()[0] != hashlib.sha256(m).hexdigest() for m, line in zip(msgs, got))
    assert run(programs, "arm64-broken", portable=True).returncode == 0
