"""The frame ring over shared memory (ggml_backend/transport/ring.c, shm.c),
and the upgrade a node-to-node link runs onto it (transport/upgrade.c),
between two real processes: tests/c/ring_tests.c, one process per case."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tbrpc._build import build_program

CASES = ["stream", "one_way", "peer_killed", "bell_to_a_dead_peer", "peer_closes", "silence_times_out_idle", "forged_frames", "frame_taken_back", "attach_rules", "upgrade", "forged_reply",
         "room", "heartbeat_keeps_a_sender", "quiet_reader_times_out", "rendezvous_spins"]


@pytest.fixture(scope="module")
def ring_tests(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_program(Path(__file__).parent / "c" / "ring_tests.c", tmp_path_factory.mktemp("c") / "ring_tests",
                         with_ggml=False)


@pytest.mark.parametrize("case", CASES)
def test_ring_case(ring_tests: Path, case: str) -> None:
    proc = subprocess.run([str(ring_tests), case], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"PASS {case}" in proc.stdout
