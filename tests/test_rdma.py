"""The RDMA wire (ggml_backend/transport/rdma.c) over the stand-in verbs
provider (tests/c/verbs_sim.c), between two real processes: tests/c/rdma_tests.c,
one process pair per case, for each profile the stand-in models.

The stand-in is only worth something if it refuses what real hardware
refuses, so the negative tests build deliberately broken wires and assert that
they FAIL under it: no credits under linux-uc loses frames, a short send under
apple-uc is a length error, a receive posted before RTS under apple-uc is
EINVAL, a send outside the registered memory is a protection error under
every profile. Everything here runs on Linux against the stand-in; nothing
says anything about a Mac or a NIC."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tbrpc._build import build_program, build_verbs_sim, have_verbs_headers

pytestmark = pytest.mark.skipif(not have_verbs_headers(), reason="no <infiniband/verbs.h> (apt-get install libibverbs-dev)")

PROFILES = ["apple-uc", "linux-uc", "linux-rc"]
C_TEST = Path(__file__).parent / "c" / "rdma_tests.c"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("rdma")
    progs = {"good": build_program(C_TEST, out / "rdma_tests", with_ggml=False)}
    for broken in ("NO_CREDITS", "SHORT_APPLE_SEND", "POST_RECV_BEFORE_RTS", "REUSE_SLOT", "REGISTER_RX_ONLY"):
        progs[broken] = build_program(C_TEST, out / f"rdma_tests_{broken.lower()}", with_ggml=False,
                                      defines=(f"TB_RDMA_BROKEN_{broken}",))
    progs["SEQ_WRAP"] = build_program(C_TEST, out / "rdma_tests_seq_wrap", with_ggml=False,
                                      defines=("TB_RING_FIRST_SEQ=0xffffffc0u",))
    progs["FIRST_GID"] = build_program(C_TEST, out / "rdma_tests_first_gid", with_ggml=False,
                                       defines=("TB_RDMA_BROKEN_FIRST_GID",))
    progs["TESTING"] = build_program(C_TEST, out / "rdma_tests_testing", with_ggml=False, defines=("TB_RDMA_TESTING",))
    progs["QP_PROCESS_LOCKS"] = build_program(C_TEST, out / "rdma_tests_qp_process_locks", with_ggml=False,
                                              defines=("TB_QP_BROKEN_PROCESS_LOCKS",))
    progs["sim"] = build_verbs_sim(out / "libtbverbs_sim.so")
    return progs


def run(built: dict[str, Path], case: str, profile: str, tmp_path: Path, prog: str = "good",
        **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("TBVSIM_", "TBRPC_", "CHILD_", "RDMA_TEST_"))}
    full.update(TBRPC_VERBS_LIB=str(built["sim"]), TBVSIM_DIR=str(tmp_path), TBVSIM_PROFILE=profile,
                TBRPC_RDMA_PROFILE=profile, TBRPC_QP_DIR=str(tmp_path / "qp"))
    full.update(env)
    return subprocess.run([str(built[prog]), case], capture_output=True, text=True, timeout=120, env=full)


def passed(proc: subprocess.CompletedProcess[str], case: str) -> None:
    assert proc.returncode == 0 and f"PASS {case}" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]


@pytest.mark.parametrize("profile", PROFILES)
def test_stream_both_ways_identical_bytes(built, profile, tmp_path) -> None:
    proc = run(built, "stream", profile, tmp_path)
    passed(proc, "stream")
    assert "changed before its completion" not in proc.stderr   # the stand-in's late read saw no slot reused
    kind = "RC" if profile == "linux-rc" else "UC"
    geometry = "128Kx16" if profile == "apple-uc" else "256Kx16"
    assert f"parent: rdma simbolt0 {kind} {geometry}" in proc.stdout


@pytest.mark.parametrize("profile", PROFILES)
def test_stream_across_the_seq_wrap(built, profile, tmp_path) -> None:
    """Seqs are 32 bits: a link that has moved 2^32 frames (hours of small frames on a busy link)
    goes on through seq 0. Built to start 64 frames below the wrap, the stream crosses it; a wire
    that takes seq 0 for "none" reads a receive that has not landed, or reuses a send slot early."""
    proc = run(built, "stream", profile, tmp_path, prog="SEQ_WRAP")
    passed(proc, "stream")
    assert "changed before its completion" not in proc.stderr


@pytest.mark.parametrize("profile", PROFILES)
def test_slow_reader_loses_nothing(built, profile, tmp_path) -> None:
    """The reader starts 300 ms late: credits hold the sender back (linux-uc would drop)."""
    passed(run(built, "slow_reader", profile, tmp_path), "slow_reader")


@pytest.mark.parametrize("profile", PROFILES)
# the Nth message the child receives: the bring-up's probe is the first, ring frame seq N-1 the Nth
@pytest.mark.parametrize("fault,words", [("drop:6", "RDMA frame lost from parent (seq 6, expected 5)"),
                                         ("drop:41", "RDMA frame lost from parent (seq 41, expected 40)"),
                                         ("corrupt:8", "RDMA frame from parent is corrupt (seq 7")])
def test_lost_or_corrupt_frame_is_a_named_error(built, profile, fault, words, tmp_path) -> None:
    proc = run(built, "fault", profile, tmp_path, CHILD_TBVSIM_FAULT=fault)
    passed(proc, "fault")
    assert "WRONG BYTES" not in proc.stderr
    assert f"child: {words}" in proc.stdout


@pytest.mark.parametrize("profile", PROFILES)
def test_killed_peer_is_closed_fast(built, profile, tmp_path) -> None:
    proc = run(built, "peer_killed", profile, tmp_path)
    passed(proc, "peer_killed")
    assert "connection closed by peer" in proc.stdout


@pytest.mark.parametrize("profile", ["apple-uc", "linux-rc"])   # backoff sleeps; the completion channel
def test_idle_wait_sleeps(built, profile, tmp_path) -> None:
    passed(run(built, "idle", profile, tmp_path), "idle")


@pytest.mark.parametrize("profile", PROFILES)
def test_a_busy_readers_heartbeat_keeps_a_sender_waiting(built, profile, tmp_path) -> None:
    """A reader that computes and does not read fills its receive slots; its heartbeat (a byte on the
    TCP anchor, no slot) keeps a sender blocked on it waiting, and once it stops the send times out."""
    passed(run(built, "heartbeat", profile, tmp_path), "heartbeat")


@pytest.mark.parametrize("env,reason", [
    ({"CHILD_TBVSIM_PORT": "down"}, "port 1 is not active"),
    ({"CHILD_TBRPC_HOST_ID": "host-a"}, "peer is on this host"),
    ({"CHILD_TBRPC_RDMA_PROFILE": "linux-uc"}, "profiles differ"),
    ({"CHILD_TBVSIM_FAIL_RTR": "1"}, "RTR on simbolt0 failed: Invalid argument"),
    ({"CHILD_TBRPC_VERBS_LIB": "/nonexistent/libibverbs.so"}, "cannot load TBRPC_VERBS_LIB"),
    ({"CHILD_RDMA_TEST_LOCAL": "127.0.0.9"}, "no RDMA device has a GID for 127.0.0.9"),
    ({"CHILD_TBVSIM_MAX_QPS": "0"}, "ibv_create_qp on simbolt0 failed: Cannot allocate memory"),   # QP budget spent
])
def test_any_failure_leaves_both_on_tcp_with_a_reason(built, env, reason, tmp_path) -> None:
    proc = run(built, "stays_on_tcp", "linux-rc", tmp_path, **env)
    passed(proc, "stays_on_tcp")
    assert "parent: tcp" in proc.stdout
    lines = [line for line in proc.stdout.splitlines() if "stays on tcp" in line]
    assert len(lines) == 2 and all(reason in line for line in lines), proc.stdout


@pytest.mark.parametrize("profile", PROFILES)
def test_a_wire_that_moves_nothing_leaves_both_on_tcp(built, profile, tmp_path) -> None:
    """RTR and RTS check no path: a GID that leads nowhere (a stale APIPA address, RoCE v1 against
    v2, a cable to another machine) brings both QPs up and then loses every frame. The bring-up
    must prove the wire with a frame each way before both switch, else the first message after the
    switch times out and the node fails instead of staying on TCP."""
    proc = run(built, "stays_on_tcp", profile, tmp_path, CHILD_TBVSIM_FAULT="unreachable")
    passed(proc, "stays_on_tcp")
    lines = [line for line in proc.stdout.splitlines() if "stays on tcp" in line]
    assert len(lines) == 2 and all("RDMA probe on simbolt0" in line for line in lines), proc.stdout


@pytest.mark.parametrize("profile", PROFILES)
def test_a_side_out_of_memory_for_its_ring_leaves_both_on_tcp(built, profile, tmp_path) -> None:
    """The transport's memory is taken before the last readiness exchange: a side that cannot have it
    says so and both stay on TCP. Taken after both said ready, that side stayed on TCP while its peer
    switched to RDMA, and the connection was lost. (A test build, TB_RDMA_TESTING, fails the
    allocation on RDMA_TEST_RING_ALLOC_FAILS.)"""
    proc = run(built, "stays_on_tcp", profile, tmp_path, prog="TESTING", CHILD_RDMA_TEST_RING_ALLOC_FAILS="1")
    passed(proc, "stays_on_tcp")
    lines = sorted(line for line in proc.stdout.splitlines() if "stays on tcp" in line)
    assert lines == ["child stays on tcp: out of memory for an RDMA ring",
                     "parent stays on tcp: peer: out of memory for an RDMA ring"], proc.stdout


# --- which GID: RoCE v2 over v1, the same type on both sides, no InfiniBand ------------------
# The stand-in lists every address twice on the Linux profiles, RoCE v1 first (index 2) then v2
# (index 3), as mlx5 does; v1 is an Ethernet frame no router forwards, so a v1 GID reaches only
# its own subnet (TBVSIM_ADDR a.b.c.d/NN, /24 unless said); a NIC listing only v1 takes no v2 frame.
# The parent is 127.0.0.1; a child at 127.0.1.3 is on another /24, one router away.

@pytest.mark.parametrize("profile", ["linux-rc", "linux-uc"])
@pytest.mark.parametrize("types_from", ["query_gid_ex", "sysfs"])
def test_roce_v2_reaches_another_subnet(built, profile, types_from, tmp_path) -> None:
    """The address's RoCE v2 GID is chosen, so a peer one router away is reached; the type is known
    from _ibv_query_gid_ex (rdma-core v30+) or, without it, from the kernel's sysfs file. Taking the
    first match (v1) stays on TCP here: see the FIRST_GID test below."""
    env = {"TBVSIM_GID_EX": "0", "TBVSIM_SYSFS": str(tmp_path / "sysfs")} if types_from == "sysfs" else {}
    proc = run(built, "stream", profile, tmp_path, CHILD_TBVSIM_ADDR="127.0.1.3", **env)
    passed(proc, "stream")
    if types_from == "sysfs":
        assert (tmp_path / "sysfs" / "simbolt0" / "ports" / "1" / "gid_attrs" / "types" / "3").read_text() == "RoCE v2\n"


@pytest.mark.parametrize("profile", ["linux-rc", "linux-uc"])
def test_broken_first_gid_is_v1_and_reaches_no_other_subnet(built, profile, tmp_path) -> None:
    """Negative: a build that takes the first GID holding the address (RoCE v1, as before) brings
    both QPs up, but no v1 frame crosses the router: the probe finds no path and both stay on TCP."""
    proc = run(built, "stays_on_tcp", profile, tmp_path, prog="FIRST_GID", CHILD_TBVSIM_ADDR="127.0.1.3")
    passed(proc, "stays_on_tcp")
    lines = [line for line in proc.stdout.splitlines() if "stays on tcp" in line]
    assert len(lines) == 2 and all("RDMA probe on simbolt0" in line for line in lines), proc.stdout


def test_v1_only_nics_on_one_subnet_use_v1(built, tmp_path) -> None:
    """Two NICs that list only RoCE v1 use it (both sides the same type) on one subnet; across a router the
    stand-in loses their frames, which is why v2 is preferred when there is one."""
    passed(run(built, "stream", "linux-rc", tmp_path, TBVSIM_GID_TYPES="v1"), "stream")
    proc = run(built, "stays_on_tcp", "linux-rc", tmp_path, TBVSIM_GID_TYPES="v1", CHILD_TBVSIM_ADDR="127.0.1.3")
    passed(proc, "stays_on_tcp")
    assert proc.stdout.count("RDMA probe on simbolt0") == 2, proc.stdout


def test_gid_types_that_differ_leave_both_on_tcp_naming_both(built, tmp_path) -> None:
    """The child's NIC lists only RoCE v1, the parent's both: the parent takes v2, the child v1. Both
    stay on TCP, each naming both types (without the check the child's NIC drops the v2 probe and the
    reason is a probe timeout that names neither)."""
    proc = run(built, "stays_on_tcp", "linux-rc", tmp_path, CHILD_TBVSIM_GID_TYPES="v1")
    passed(proc, "stays_on_tcp")
    lines = sorted(line for line in proc.stdout.splitlines() if "stays on tcp" in line)
    assert lines == ["child stays on tcp: GID types differ (RoCE v1 here, RoCE v2 on the peer)",
                     "parent stays on tcp: GID types differ (RoCE v2 here, RoCE v1 on the peer)"], proc.stdout


def test_a_forged_gid_type_is_refused(built, tmp_path) -> None:
    passed(run(built, "hostile_gid_type", "linux-rc", tmp_path), "hostile_gid_type")


def test_infiniband_port_stays_on_tcp_saying_it_is_not_supported(built, tmp_path) -> None:
    """An InfiniBand port's GIDs are subnet prefix + GUID, never the TCP address: both sides stay on TCP
    with a reason that says so, not "no RDMA device has a GID for ..."."""
    proc = run(built, "stays_on_tcp", "linux-rc", tmp_path, CHILD_TBVSIM_LINK="ib")
    passed(proc, "stays_on_tcp")
    lines = sorted(line for line in proc.stdout.splitlines() if "stays on tcp" in line)
    words = "RDMA device simbolt0 port 1 is InfiniBand, which tbrpc does not support (no GID holds 127.0.0.3)"
    assert lines == [f"child stays on tcp: {words}", f"parent stays on tcp: peer: {words}"], proc.stdout


def test_apple_profile_refuses_rc_and_loopback(built, tmp_path) -> None:
    """apple-uc has no RC QPs; a peer GID equal to our own (one Mac to itself) is refused at RTR."""
    proc = run(built, "stays_on_tcp", "apple-uc", tmp_path, TBRPC_RDMA_PROFILE="linux-rc",
               CHILD_TBRPC_RDMA_PROFILE="linux-rc")
    passed(proc, "stays_on_tcp")
    assert proc.stdout.count("ibv_create_qp") == 2
    proc = run(built, "stays_on_tcp", "apple-uc", tmp_path, CHILD_TBVSIM_ADDR="127.0.0.1")
    passed(proc, "stays_on_tcp")
    assert "RTR on simbolt0 failed: Invalid argument" in proc.stdout


# --- negative tests: broken wires must fail under the stand-in ---------------------------

def test_broken_no_credits_loses_frames_under_linux_uc(built, tmp_path) -> None:
    proc = run(built, "slow_reader", "linux-uc", tmp_path, prog="NO_CREDITS")
    assert proc.returncode != 0
    assert "WRONG BYTES" not in proc.stderr
    assert "RDMA frame lost from parent" in proc.stderr, proc.stderr[-3000:]
    # RC and Apple hold an unmatched SEND, so there the same wire survives: the rule, not luck
    passed(run(built, "slow_reader", "linux-rc", tmp_path, prog="NO_CREDITS"), "slow_reader")


def test_broken_short_apple_send_is_a_length_error(built, tmp_path) -> None:
    proc = run(built, "stream", "apple-uc", tmp_path, prog="SHORT_APPLE_SEND")
    assert proc.returncode != 0
    assert "local length error" in proc.stderr, proc.stderr[-3000:]
    passed(run(built, "stream", "linux-uc", tmp_path, prog="SHORT_APPLE_SEND"), "stream")


def test_broken_post_recv_before_rts_is_einval_on_apple(built, tmp_path) -> None:
    proc = run(built, "stream", "apple-uc", tmp_path, prog="POST_RECV_BEFORE_RTS")
    assert proc.returncode != 0
    assert "ibv_post_recv before RTS on simbolt0 failed: Invalid argument" in proc.stderr, proc.stderr[-3000:]
    passed(run(built, "stream", "linux-rc", tmp_path, prog="POST_RECV_BEFORE_RTS"), "stream")


@pytest.mark.parametrize("profile", ["apple-uc", "linux-rc"])
def test_broken_slot_reuse_is_caught_by_the_late_read(built, profile, tmp_path) -> None:
    """Two frames in flight share a send slot and nobody waits for completions: the stand-in's
    NIC reads the slot late, says so, and the receiver names the frame it got instead."""
    proc = run(built, "stream", profile, tmp_path, prog="REUSE_SLOT")
    assert proc.returncode != 0
    assert "changed before its completion" in proc.stderr, proc.stderr[-3000:]
    assert "WRONG BYTES" not in proc.stderr
    assert "RDMA frame lost from" in proc.stderr or "is corrupt" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize("profile", PROFILES)
def test_broken_send_outside_its_registered_memory_is_a_protection_error(built, profile, tmp_path) -> None:
    """Only the receive half is registered: every profile refuses a send whose SGE lies outside
    a registered MR with a local protection error, and the bring-up's probe (the first send) names it."""
    proc = run(built, "stream", profile, tmp_path, prog="REGISTER_RX_ONLY")
    assert proc.returncode != 0
    assert "WRONG BYTES" not in proc.stderr
    assert "RDMA probe on simbolt0: send failed: local protection error" in proc.stderr, proc.stderr[-3000:]


def test_builds_without_verbs_headers(tmp_path) -> None:
    """-DTB_NO_VERBS stands for a machine without the headers: rdma.c is a stub that says so."""
    src = tmp_path / "stub.c"
    src.write_text('#include "transport/rdma.h"\n#include <stdio.h>\n#include <string.h>\n'
                   'int main(void) { char why[200]; int kind = 0;\n'
                   '  struct tb_transport * t = tb_rdma_upgrade(NULL, "127.0.0.1", &kind, why, sizeof why);\n'
                   '  printf("%s\\n", why); return t != NULL || strstr(why, "built without verbs headers") == NULL ||\n'
                   '         kind != TB_WHY_NO_RDMA_HERE; }\n')
    exe = build_program(src, tmp_path / "stub", with_ggml=False, defines=("TB_NO_VERBS",))
    proc = subprocess.run([str(exe)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# --- head and nodes: TRANSPORT_OFFER kind RDMA ---------------------------------------------

def start_sim_node(tmp_path: Path, sim_env: dict[str, str], host_id: str, address: str = "127.0.0.3") -> "NodeProcess":
    """`tbrpc node` on `address`, another "host": its own host id and the stand-in's GID ::ffff:<address>."""
    from helpers import start_node

    env = {k: v for k, v in os.environ.items() if not k.startswith(("TBVSIM_", "TBRPC_"))}
    env.update(sim_env, TBVSIM_ADDR=address, TBRPC_HOST_ID=host_id)
    return start_node(tmp_path, "--host", address, env=env)


@pytest.fixture
def sim_nodes(built, tmp_path):
    from helpers import stop_nodes

    started: list = []

    def factory(n: int, profile: str, addresses: list[str] | None = None, host_ids: list[str] | None = None,
                **extra: str) -> list:
        sim_env = dict(TBRPC_VERBS_LIB=str(built["sim"]), TBVSIM_DIR=str(tmp_path / "sim"), TBVSIM_PROFILE=profile,
                       TBRPC_RDMA_PROFILE=profile, TBRPC_QP_DIR=str(tmp_path / "qp"))
        sim_env.update(extra)
        new = [start_sim_node(tmp_path, sim_env, host_ids[i] if host_ids else f"node-{len(started) + i}",
                              *([addresses[i]] if addresses else []))
               for i in range(n)]
        started.extend(new)
        return new

    yield factory
    stop_nodes(started)


def head_env(monkeypatch: pytest.MonkeyPatch, built: dict[str, Path], tmp_path: Path, profile: str) -> None:
    for key in [k for k in os.environ if k.startswith(("TBVSIM_", "TBRPC_"))]:
        monkeypatch.delenv(key)
    for key, value in dict(TBRPC_VERBS_LIB=str(built["sim"]), TBVSIM_DIR=str(tmp_path / "sim"), TBVSIM_PROFILE=profile,
                           TBRPC_RDMA_PROFILE=profile, TBVSIM_ADDR="127.0.0.1", TBRPC_HOST_ID="head",
                           TBRPC_QP_DIR=str(tmp_path / "qp")).items():
        monkeypatch.setenv(key, value)


@pytest.mark.parametrize("profile,describe", [("apple-uc", "rdma simbolt0 UC 128Kx16"),
                                              ("linux-rc", "rdma simbolt0 RC 256Kx16")])
def test_generation_over_rdma_matches_tcp(built, sim_nodes, monkeypatch, profile, describe, tmp_path) -> None:
    import numpy as np

    import models
    from helpers import run_head

    started = sim_nodes(2, profile)
    head_env(monkeypatch, built, tmp_path, profile)
    spec = dict(model=str(models.ensure("llama")), prompt="The capital of France is", n_predict=8,
                nodes=[f"127.0.0.3:{n.port}" for n in started])
    over_tcp, tcp_logits = run_head(tmp_path, transport="tcp", **spec)
    assert over_tcp["error"] is None, over_tcp["error"]
    assert [n["transport"] for n in over_tcp["nodes"]] == ["tcp: asked for"] * 2
    over_rdma, rdma_logits = run_head(tmp_path, **spec)
    assert over_rdma["error"] is None, over_rdma["error"]
    assert [n["transport"] for n in over_rdma["nodes"]] == [describe] * 2, over_rdma["nodes"]
    assert over_rdma["tokens"] == over_tcp["tokens"]
    assert np.array_equal(rdma_logits, tcp_logits)
    for node in started:
        assert f"transport {describe}" in node.log_text(), node.log_text()[-2000:]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory):
    """Greedy tokens and logits of one process without nodes, per model (the reference of tests/test_split.py)."""
    from helpers import run_head

    import models

    cache: dict = {}
    tmp = tmp_path_factory.mktemp("one_process")

    def get(name: str):
        if name not in cache:
            result, logits = run_head(tmp, model=str(models.ensure(name)), prompt="The capital of France is", n_predict=8)
            assert result["error"] is None, result["error"]
            cache[name] = (result, logits)
        return cache[name]

    return get


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("n_nodes", [2, 4])
@pytest.mark.parametrize("model_name", ["deepseek2", "gemma"])
def test_split_over_rdma_matches_one_process(built, sim_nodes, one_process, monkeypatch, model_name, n_nodes, profile,
                                             tmp_path) -> None:
    """tests/test_split.py's check over the stand-in's RDMA: every head connection and every node-to-node
    link really on RDMA (each node its own "host": address, GID, host id), and the same tokens and bitwise
    the same logits as one process."""
    import numpy as np

    import models
    from helpers import run_head

    base, base_logits = one_process(model_name)
    addresses = [f"127.0.0.{3 + i}" for i in range(n_nodes)]
    started = sim_nodes(n_nodes, profile, addresses=addresses)
    head_env(monkeypatch, built, tmp_path, profile)
    endpoints = [f"{address}:{n.port}" for address, n in zip(addresses, started)]
    result, logits = run_head(tmp_path, model=str(models.ensure(model_name)), prompt="The capital of France is",
                              n_predict=8, nodes=endpoints)
    assert result["error"] is None, result["error"]
    assert all(n["transport"].startswith("rdma ") for n in result["nodes"]), result["nodes"]
    for node, following in zip(result["nodes"], endpoints[1:]):
        assert f"{following} rdma " in node["links"], node["links"]   # activations node to node over RDMA
    assert result["tokens"] == base["tokens"]
    assert np.array_equal(logits, base_logits), f"max |diff| {np.max(np.abs(logits - base_logits))}"


def test_node_without_rdma_keeps_tcp_and_says_why(built, sim_nodes, monkeypatch, tmp_path) -> None:
    from helpers import run_head

    import models

    started = sim_nodes(1, "linux-rc", TBRPC_VERBS_LIB="/nonexistent/libibverbs.so.1")
    head_env(monkeypatch, built, tmp_path, "linux-rc")
    result, _ = run_head(tmp_path, model=str(models.ensure("llama")), prompt="Hello", n_predict=2,
                         nodes=[f"127.0.0.3:{started[0].port}"])
    assert result["error"] is None, result["error"]
    assert [n["transport"] for n in result["nodes"]] == ["tcp: peer has no RDMA device"]


def assert_fixes_follow_the_kinds(record: list[dict]) -> None:
    """What `tbrpc status` prints for the connections and links on TCP in
    test_each_connection_and_link_says_why: each with the fix for its kind, naming the machine to fix."""
    from tbrpc.status import connection_lines

    lines = connection_lines(record, fixes=True)
    shown = dict(zip(lines[::2], (fix.removeprefix("  fix: ") for fix in lines[1::2])))
    assert set(shown) == {"connection head -> b: tcp: peer has no RDMA device",
                          "connection head -> c: " + record[2]["transport"],
                          "link a -> b: tcp: peer has no RDMA device",
                          "link b -> c: " + record[1]["links"][0]["transport"]}, lines
    assert shown["connection head -> b: tcp: peer has no RDMA device"].startswith("b lists no RDMA device"), shown
    assert shown["link a -> b: tcp: peer has no RDMA device"].startswith("b lists no RDMA device"), shown
    assert shown["link b -> c: " + record[1]["links"][0]["transport"]].startswith("b lists no RDMA device"), shown
    assert "RDMA bring-up failed" in shown["connection head -> c: " + record[2]["transport"]], shown


def test_each_connection_and_link_says_why(built, sim_nodes, one_process, monkeypatch, tmp_path) -> None:
    """Three "hosts" over the stand-in: a with RDMA, b whose verbs library is missing, c whose port is
    down. Every head connection and node-to-node link says what carries it and, on TCP, a kind beside
    the words (enum tb_why): head -> b and a -> b "peer has no RDMA device" (b's caps), b -> c "no
    RDMA here" (b's own library), head -> c a failed bring-up (c's port). The fix `tbrpc status` and
    `tbrpc doctor` print follows the kind, not the words: the negative check swaps b -> c's kind for
    a -> b's (the words stay) and the fix then names the wrong machine. Same tokens as one process."""
    from dataclasses import replace

    import models
    from helpers import record_of, run_head

    from tbrpc.doctor import WARN, running_checks
    from tbrpc.spec import endpoint_specs

    (a,) = sim_nodes(1, "linux-rc", addresses=["127.0.0.3"])
    (b,) = sim_nodes(1, "linux-rc", addresses=["127.0.0.4"], TBRPC_VERBS_LIB="/nonexistent/libibverbs.so.1")
    (c,) = sim_nodes(1, "linux-rc", addresses=["127.0.0.5"], TBVSIM_PORT="down")
    head_env(monkeypatch, built, tmp_path, "linux-rc")
    endpoints = [f"127.0.0.3:{a.port}", f"127.0.0.4:{b.port}", f"127.0.0.5:{c.port}"]
    result, _ = run_head(tmp_path, model=str(models.ensure("llama")), prompt="The capital of France is", n_predict=8,
                         nodes=endpoints)
    assert result["error"] is None, result["error"]
    assert result["tokens"] == one_process("llama")[0]["tokens"]
    na, nb, nc = result["nodes"]
    assert na["transport"] == "rdma simbolt0 RC 256Kx16" and na["transport_why"] == "", na
    assert (nb["transport"], nb["transport_why"]) == ("tcp: peer has no RDMA device", "peer_no_rdma"), nb
    assert nc["transport"].startswith("tcp: peer: RDMA device simbolt0 port 1 is not active"), nc
    assert nc["transport_why"] == "rdma_failed", nc
    assert [(x["to"], x["usable"], x["transport"], x["why"]) for x in na["peer_links"]] == \
        [(endpoints[1], True, "tcp: peer has no RDMA device", "peer_no_rdma")], na["peer_links"]
    ((to, usable, transport, why),) = [(x["to"], x["usable"], x["transport"], x["why"]) for x in nb["peer_links"]]
    assert (to, usable, why) == (endpoints[2], True, "no_rdma_here") and transport.startswith("tcp: "), nb["peer_links"]
    assert nc["peer_links"] == []

    record = record_of(result["nodes"], ["a", "b", "c"])
    assert_fixes_follow_the_kinds(record)
    wrong = [dict(n, links=[dict(x, why="peer_no_rdma") for x in n["links"]]) if n["name"] == "b" else n for n in record]
    with pytest.raises(AssertionError):   # the words alone would not tell b's missing library from c's
        assert_fixes_follow_the_kinds(wrong)

    # doctor, reading the same record of a running launch: a warning with the fix per connection on TCP
    specs = [replace(s, name=name) for s, name in zip(endpoint_specs(endpoints), "abc")]
    launch = {"pid": 4242, "nodes": [dict(n, endpoint=e) for n, e in zip(record, endpoints)]}
    rows = {(r.node, r.name): r for r in running_checks(specs, [launch])}
    assert rows[("a", "connection from head")].status == "ok", rows
    assert rows[("b", "connection from head")].status == WARN and rows[("b", "connection from head")].fix.startswith(
        "b lists no RDMA device"), rows
    assert rows[("b", "link to c")].status == WARN and "launch 4242: tcp: " in rows[("b", "link to c")].detail, rows
    assert rows[("b", "link to c")].fix.startswith("b lists no RDMA device"), rows


# what carries the head's connection to a stand-in node, per profile (linux-uc: UC as on Apple, Linux's ring)
DESCRIBE = {"apple-uc": "rdma simbolt0 UC 128Kx16", "linux-uc": "rdma simbolt0 UC 256Kx16",
            "linux-rc": "rdma simbolt0 RC 256Kx16"}


@pytest.mark.parametrize("profile", PROFILES)
def test_node_killed_mid_generation_over_rdma(built, sim_nodes, monkeypatch, profile, tmp_path) -> None:
    """As tests/test_failures.py over TCP: NodeError naming the killed node, the head survives, the other
    node serves. Under UC (apple-uc, linux-uc) a dead peer gives no completion error: the TCP anchor names it."""
    import time

    import models
    from helpers import run_head

    a, b = sim_nodes(2, profile)
    head_env(monkeypatch, built, tmp_path, profile)
    endpoints = [f"127.0.0.3:{a.port}", f"127.0.0.3:{b.port}"]
    t0 = time.monotonic()
    result, _ = run_head(tmp_path, model=str(models.ensure("llama")), prompt="The capital of France is", n_predict=12,
                         nodes=endpoints, kill={"pid": b.proc.pid, "after_tokens": 3})
    assert [n["transport"] for n in result["nodes_after_load"]] == [DESCRIBE[profile]] * 2, result["nodes_after_load"]
    assert result["error"] is not None and result["error"]["type"] == "NodeFailed", result["error"]
    message = result["error"]["message"]
    assert endpoints[1] in message and "no answer within" not in message, message   # seen, not waited out
    assert time.monotonic() - t0 < 60   # tests/test_failures.py's bound over TCP
    assert b.proc.wait(timeout=10) == -9
    assert list(result["survivor_status"]) == [endpoints[0]]


@pytest.mark.parametrize("profile", PROFILES)
def test_stalled_node_times_out_over_rdma(built, sim_nodes, monkeypatch, profile, tmp_path) -> None:
    """Only silence times out, as over TCP: a SIGSTOPped node is named with the same words."""
    import signal
    import time

    import models
    from helpers import run_head

    a, b = sim_nodes(2, profile)
    head_env(monkeypatch, built, tmp_path, profile)
    endpoints = [f"127.0.0.3:{a.port}", f"127.0.0.3:{b.port}"]
    try:
        started = time.time()
        result, _ = run_head(tmp_path, model=str(models.ensure("llama")), prompt="The capital of France is",
                             n_predict=12, nodes=endpoints, timeout=2.0,
                             kill={"pid": b.proc.pid, "after_tokens": 2, "signal": int(signal.SIGSTOP)})
        assert result["error"]["type"] == "NodeFailed", result["error"]
        message = result["error"]["message"]
        assert endpoints[1] in message and f"no answer within 2000 ms ({DESCRIBE[profile]})" in message, message
        assert time.time() - started < 60   # tests/test_failures.py's bound over TCP
    finally:
        os.killpg(b.proc.pid, signal.SIGCONT)


# --- node-to-node links over RDMA, and the QP budget --------------------------------------

APPLE = "rdma simbolt0 UC 128Kx16"
OPEN_CONNECTIONS = Path(__file__).parent / "open_connections.py"
# A second head: the budget under test is the node's, so the second head's own budget and its
# stand-in device (the one of the head's address, which the first head's QPs hold too) may hold
# more QPs than Apple's 10.
SECOND_HEAD = {"TBVSIM_MAX_QPS": "64", "TBRPC_RDMA_MAX_QPS": "64", "TBRPC_HOST_ID": "head-2"}


def test_ring_of_four_over_rdma_links_and_the_qp_budget(built, sim_nodes, monkeypatch, tmp_path) -> None:
    """A 4-node layer split on the Apple profile, each node its own "host" (address, GID, host id):
    head connections and node-to-node links all RDMA, the same tokens and logits as over TCP, and
    every node's QPs (head, link in, link out) within Apple's 10. While that head still holds them,
    a second head opens more connections to node 1: they fit up to 10 QPs on its device, counting
    the ring's, and the next is refused by the node with the reason. Each session is a worker
    process of its own, so the count is the node's table, not one process's."""
    import numpy as np

    import models
    from helpers import run_head

    addresses = ["127.0.0.3", "127.0.0.4", "127.0.0.5", "127.0.0.6"]
    started = sim_nodes(4, "apple-uc", addresses=addresses)
    head_env(monkeypatch, built, tmp_path, "apple-uc")
    endpoints = [f"{address}:{n.port}" for address, n in zip(addresses, started)]
    spec = dict(model=str(models.ensure("llama")), prompt="The capital of France is", n_predict=8, nodes=endpoints)
    over_tcp, tcp_logits = run_head(tmp_path, transport="tcp", **spec)
    assert over_tcp["error"] is None, over_tcp["error"]
    for node, following in zip(over_tcp["nodes"], endpoints[1:]):
        assert f"{following} tcp: asked for" in node["links"], node["links"]   # TCP forced for links too

    more = {"argv": [sys.executable, str(OPEN_CONNECTIONS), endpoints[1], "9"], "env": SECOND_HEAD}
    over_rdma, rdma_logits = run_head(tmp_path, then_run=more, **spec)
    assert over_rdma["error"] is None, over_rdma["error"]
    assert [n["transport"] for n in over_rdma["nodes"]] == [APPLE] * 4, over_rdma["nodes"]
    for node, following in zip(over_rdma["nodes"], endpoints[1:]):
        assert f"{following} {APPLE}" in node["links"], node["links"]
    assert over_rdma["tokens"] == over_tcp["tokens"]
    assert np.array_equal(rdma_logits, tcp_logits)
    assert sum(n["peer_copies"] for n in over_rdma["nodes"]) >= 3 * (8 - 1)   # activations node to node
    alone, alone_logits = run_head(tmp_path, model=spec["model"], prompt=spec["prompt"], n_predict=8)   # one process
    assert alone["error"] is None and over_rdma["tokens"] == alone["tokens"]
    assert np.array_equal(rdma_logits, alone_logits)

    # node 1's QPs while the first head holds them: its head connection and every link to or from it
    links_of = [[part for part in n["links"].split("; ") if part] for n in over_rdma["nodes"]]
    held = 1 + len(links_of[1]) + sum(1 for parts in links_of for part in parts if part.startswith(endpoints[1] + " "))
    assert 3 <= held <= 10, links_of
    lines = over_rdma["then_run"]["stdout"].splitlines()
    assert len(lines) == 9, over_rdma["then_run"]
    assert lines[:10 - held] == [f"transport: {APPLE}"] * (10 - held), lines
    assert lines[10 - held:] == ["transport: tcp: peer: QP budget: 10 of 10 in use on simbolt0"] * (held - 1), lines
    assert "stays on tcp: QP budget: 10 of 10 in use on simbolt0" in started[1].log_text()


@pytest.mark.parametrize("budget,eleventh", [
    ("", "tcp: peer: QP budget: 10 of 10 in use on simbolt0"),                         # the node's own count
    ("11", "tcp: peer: RDMA ibv_create_qp on simbolt0 failed: Cannot allocate memory"),  # a budget too large
])
def test_the_eleventh_qp_of_a_device(built, sim_nodes, monkeypatch, budget, eleventh, tmp_path) -> None:
    """Eleven heads on one Apple-profile node, each served by a worker process of its own: ten get
    RDMA, the eleventh stays on TCP with the node's reason. A node whose budget is wrong (11) gets its
    eleventh QP refused by the stand-in itself, which counts a device's QPs over every process: a
    budget counted per process would fail this way on hardware too."""
    node = sim_nodes(1, "apple-uc", **({"TBRPC_RDMA_MAX_QPS": budget} if budget else {}))[0]
    head_env(monkeypatch, built, tmp_path, "apple-uc")
    for key, value in SECOND_HEAD.items():
        monkeypatch.setenv(key, value)
    proc = subprocess.run([sys.executable, str(OPEN_CONNECTIONS), f"127.0.0.3:{node.port}", "11"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines == [f"transport: {APPLE}"] * 10 + [f"transport: {eleventh}"], lines


# --- the QP budget per host and device, over every tbrpc process of the host ------------------

QP_PLACES = Path(__file__).parent / "qp_places.py"


def count_places(tmp_path: Path, hosts: dict[str, str]) -> dict:
    """then_run for run_head: tests/qp_places.py while the head holds its connections and links."""
    return {"argv": [sys.executable, str(QP_PLACES), str(tmp_path / "qp"), str(tmp_path / "sim"),
                     *[f"{host}={address}" for host, address in hosts.items()]]}


def places_counted(result: dict) -> dict:
    assert result["then_run"]["returncode"] == 0, result["then_run"]
    import json

    return json.loads(result["then_run"]["stdout"])


def test_qp_places_are_held_once_per_place(built, tmp_path) -> None:
    """The budget's places (transport/qp_budget.c) within one process (sessions on threads of a node) and
    across processes: a 4th of 3 is refused with the reason, a dead process's place is free at once, other
    hosts and devices count apart, a directory others may write in is refused."""
    proc = run(built, "qp_places", "apple-uc", tmp_path)
    passed(proc, "qp_places")
    names = sorted(p.name for p in (tmp_path / "qp").iterdir())
    assert names == sorted([f"qp-{0xa:016x}-dev0.{k}" for k in range(3)] + [f"qp-{0xb:016x}-dev0.0",
                                                                            f"qp-{0xa:016x}-dev_1.0"]), names


def test_places_held_per_process_fail_the_places_test(built, tmp_path) -> None:
    """Negative: record locks (fcntl), which a process holds once however often it asks, would let two
    sessions on threads of one node hold one place: the test above fails on them."""
    proc = run(built, "qp_places", "apple-uc", tmp_path, prog="QP_PROCESS_LOCKS")
    assert proc.returncode != 0
    assert "a 4th place of 3 in one process" in proc.stderr, proc.stderr[-2000:]


def test_heads_connection_beyond_its_budget_stays_on_tcp(built, sim_nodes, one_process, monkeypatch,
                                                         tmp_path) -> None:
    """The head counts its own QPs: with a budget of one, its second node stays on TCP with the reason on
    both ends, the links between the nodes (QPs of the nodes' hosts) stay on RDMA, and the split still
    gives one process's tokens and logits."""
    import numpy as np

    import models
    from helpers import run_head

    addresses = ["127.0.0.3", "127.0.0.4"]
    started = sim_nodes(2, "apple-uc", addresses=addresses)
    head_env(monkeypatch, built, tmp_path, "apple-uc")
    monkeypatch.setenv("TBRPC_RDMA_MAX_QPS", "1")
    endpoints = [f"{address}:{n.port}" for address, n in zip(addresses, started)]
    result, logits = run_head(tmp_path, model=str(models.ensure("llama")), prompt="The capital of France is",
                              n_predict=8, nodes=endpoints,
                              then_run=count_places(tmp_path, {"head": "127.0.0.1", "node-0": addresses[0]}))
    assert result["error"] is None, result["error"]
    refused = "QP budget: 1 of 1 in use on simbolt0"
    assert [n["transport"] for n in result["nodes"]] == [APPLE, f"tcp: {refused}"], result["nodes"]
    assert [n["transport_why"] for n in result["nodes"]] == ["", "qp_budget"], result["nodes"]
    assert f"stays on tcp: peer: {refused}" in started[1].log_text(), started[1].log_text()[-2000:]
    assert result["nodes"][0]["links"] == f"{endpoints[1]} {APPLE}"
    counted = places_counted(result)
    assert counted["budget"]["head"] == {"simbolt0": 1} and counted["stand_in"]["head"] == 1, counted
    base, base_logits = one_process("llama")
    assert result["tokens"] == base["tokens"]
    assert np.array_equal(logits, base_logits)


def run_beside_a_node_on_the_heads_host(built, sim_nodes, monkeypatch, tmp_path: Path, node_qp_dir: Path) -> dict:
    """A head and node 0 on one "host" (address 127.0.0.1, host id "head", one stand-in device), node 1 on
    another, a budget of one QP on the head's host. The head's connection to node 1 takes that QP (the
    connection to node 0 is shared memory); node 0's link to node 1 would be the second on the host.
    node_qp_dir: where node 0 keeps its places (the head's own: one budget for the host)."""
    import models
    from helpers import run_head

    a = sim_nodes(1, "apple-uc", addresses=["127.0.0.1"], host_ids=["head"], TBRPC_RDMA_MAX_QPS="1",
                  TBRPC_QP_DIR=str(node_qp_dir))[0]
    b = sim_nodes(1, "apple-uc", addresses=["127.0.0.3"], host_ids=["node-1"])[0]
    head_env(monkeypatch, built, tmp_path, "apple-uc")
    monkeypatch.setenv("TBRPC_RDMA_MAX_QPS", "1")
    endpoints = [f"127.0.0.1:{a.port}", f"127.0.0.3:{b.port}"]
    result, logits = run_head(tmp_path, model=str(models.ensure("llama")), prompt="The capital of France is",
                              n_predict=8, nodes=endpoints,
                              then_run=count_places(tmp_path, {"head": "127.0.0.1", "node-1": "127.0.0.3"}))
    return dict(result=result, logits=logits, endpoints=endpoints, downstream_log=b.log_text())


def assert_one_budget_on_the_heads_host(run: dict, base: tuple) -> None:
    import numpy as np

    result, endpoints = run["result"], run["endpoints"]
    assert result["error"] is None, result["error"]
    assert [n["transport"] for n in result["nodes"]] == ["shm 16x256K", APPLE], result["nodes"]
    refused = "QP budget: 1 of 1 in use on simbolt0"
    assert result["nodes"][0]["links"] == f"{endpoints[1]} tcp: {refused}", result["nodes"][0]["links"]
    assert [link["why"] for link in result["nodes"][0]["peer_links"]] == ["qp_budget"], result["nodes"][0]
    # the refusal came from the dialer's own side of the bring-up, the listener heard it as the peer's
    assert f"link from peer {endpoints[0]}: transport tcp: peer: {refused}" in run["downstream_log"]
    counted = places_counted(result)
    assert counted["stand_in"]["head"] == 1, counted   # the device itself: head and node 0 hold one QP together
    assert counted["budget"]["head"] == {"simbolt0": 1}, counted
    assert result["tokens"] == base[0]["tokens"]
    assert np.array_equal(run["logits"], base[1])


def test_head_and_node_on_one_host_share_one_budget(built, sim_nodes, one_process, monkeypatch, tmp_path) -> None:
    """The budget is the host's, not a process's: each of the head and node 0 alone would fit in one QP,
    together they do not, so node 0's link stays on TCP with the reason on both ends."""
    run = run_beside_a_node_on_the_heads_host(built, sim_nodes, monkeypatch, tmp_path, tmp_path / "qp")
    assert_one_budget_on_the_heads_host(run, one_process("llama"))


def test_a_budget_blind_to_the_head_fails_the_shared_budget_test(built, sim_nodes, one_process, monkeypatch,
                                                                 tmp_path) -> None:
    """Negative: node 0 counts its places apart from the head's (a directory of its own), so its budget
    ignores the head's QP, as a node-only count would. The host then holds two QPs on a budget of one,
    and the test above fails on it."""
    run = run_beside_a_node_on_the_heads_host(built, sim_nodes, monkeypatch, tmp_path, tmp_path / "qp-node-alone")
    assert run["result"]["error"] is None, run["result"]["error"]
    assert run["result"]["nodes"][0]["links"] == f"{run['endpoints'][1]} {APPLE}", run["result"]["nodes"]
    assert places_counted(run["result"])["stand_in"]["head"] == 2
    with pytest.raises(AssertionError):
        assert_one_budget_on_the_heads_host(run, one_process("llama"))


def test_ring_of_four_qps_per_host_and_device(built, sim_nodes, one_process, monkeypatch, tmp_path) -> None:
    """A 4-node layer split on the Apple profile, each node its own host: while the head holds its
    connections and the links, the QPs per (host, device) counted twice, by tbrpc's budget (its places)
    and by the stand-in (the device's own count), are equal, are what the head's connections and the
    links say they are carried by, and are within Apple's 10 on every device."""
    import numpy as np

    import models
    from helpers import run_head

    addresses = ["127.0.0.3", "127.0.0.4", "127.0.0.5", "127.0.0.6"]
    hosts = [f"node-{i}" for i in range(4)]
    started = sim_nodes(4, "apple-uc", addresses=addresses, host_ids=hosts)
    head_env(monkeypatch, built, tmp_path, "apple-uc")
    endpoints = [f"{address}:{n.port}" for address, n in zip(addresses, started)]
    result, logits = run_head(tmp_path, model=str(models.ensure("llama")), prompt="The capital of France is",
                              n_predict=8, nodes=endpoints,
                              then_run=count_places(tmp_path, {"head": "127.0.0.1", **dict(zip(hosts, addresses))}))
    assert result["error"] is None, result["error"]
    assert [n["transport"] for n in result["nodes"]] == [APPLE] * 4, result["nodes"]
    links = [[part for part in n["links"].split("; ") if part] for n in result["nodes"]]
    assert [len(parts) for parts in links] == [1, 1, 1, 0], links   # head -> node0 -> node1 -> node2 -> node3
    held = {"head": 4}
    for i, host in enumerate(hosts):
        out = sum(1 for part in links[i] if f" {APPLE}" in part)
        into = sum(1 for parts in links for part in parts if part == f"{endpoints[i]} {APPLE}")
        held[host] = 1 + out + into
    assert held == {"head": 4, "node-0": 2, "node-1": 3, "node-2": 3, "node-3": 2}, held
    counted = places_counted(result)
    assert counted["budget"] == {host: {"simbolt0": n} for host, n in held.items()}, counted
    assert counted["stand_in"] == held, counted
    assert all(n <= 10 for n in held.values())
    base, base_logits = one_process("llama")
    assert result["tokens"] == base["tokens"]
    assert np.array_equal(logits, base_logits)


@pytest.mark.parametrize("profile", PROFILES)
def test_node_killed_across_an_rdma_link_is_named_at_once(built, sim_nodes, monkeypatch, profile, tmp_path) -> None:
    """As tests/test_links.py over shm and TCP: the upstream node dies while the downstream one waits for its
    activations over an RDMA link (a dead UC peer gives no completion error); the link's TCP anchor ends
    the wait, so the error names the dead node without waiting out the head's 30 s timeout."""
    import models
    from helpers import run_head

    addresses = ["127.0.0.3", "127.0.0.4"]
    a, b = sim_nodes(2, profile, addresses=addresses)
    head_env(monkeypatch, built, tmp_path, profile)
    endpoints = [f"{address}:{n.port}" for address, n in zip(addresses, (a, b))]
    result, _ = run_head(tmp_path, model=str(models.ensure("llama")), prompt="The capital of France is", n_predict=12,
                         nodes=endpoints, timeout=30.0, kill={"pid": a.proc.pid, "after_tokens": 3})
    assert f"link from peer {endpoints[0]}: transport rdma simbolt0" in b.log_text(), b.log_text()[-2000:]
    assert result["error"] is not None and result["error"]["type"] == "NodeFailed", result["error"]
    message = result["error"]["message"]
    assert endpoints[0] in message and "no answer within" not in message, message
    assert a.proc.wait(timeout=10) == -9


# --- tensor split: the all-reduce over RDMA links ------------------------------------------

@pytest.mark.parametrize("n_nodes,allreduce", [(2, "mesh"), (4, "mesh"), (4, "ring")])
def test_tensor_split_allreduce_over_rdma_links(built, sim_nodes, monkeypatch, n_nodes, allreduce, tmp_path) -> None:
    """tests/test_tensor_split.py's check over the stand-in's Apple profile, each node its own "host"
    (address, GID, host id): llama.cpp's split_mode=3 on the tiny F32 llama, every node linked to every
    other over RDMA, the partial sums all-reduced over those links (two ALLREDUCEs per layer per token,
    no copies through the head), and one process's greedy tokens with logits within the same 1e-2. The
    ring all-reduce the same way over the links to the next node only (each step in pieces of at most
    32 KiB: a few Apple frames per message)."""
    import numpy as np

    import models
    from helpers import assert_every_pair_linked, assert_ring_linked, run_head

    addresses = [f"127.0.0.{3 + i}" for i in range(n_nodes)]
    started = sim_nodes(n_nodes, "apple-uc", addresses=addresses)
    head_env(monkeypatch, built, tmp_path, "apple-uc")
    spec = dict(model=str(models.ensure("llama-f32")), prompt="The capital of France is", n_predict=8, flash_attn=True)
    alone, alone_logits = run_head(tmp_path, **spec)
    assert alone["error"] is None, alone["error"]
    result, logits = run_head(tmp_path, split_mode=3, nodes=[f"{a}:{n.port}" for a, n in zip(addresses, started)],
                              env={"TBRPC_ALLREDUCE": allreduce}, **spec)
    assert result["error"] is None, result["error"]
    assert [n["transport"] for n in result["nodes"]] == [APPLE] * n_nodes, result["nodes"]
    if allreduce == "ring":
        assert_ring_linked(result, APPLE)
    else:
        assert_every_pair_linked(result, APPLE)
    assert result["tokens"] == alone["tokens"]
    assert logits is not None and float(np.max(np.abs(logits - alone_logits))) <= 1e-2
    for node in result["nodes"]:
        assert node["allreduces"] == 2 * 6 * (8 - 1) and node["peer_copies"] == 0, node   # 6 layers, steady tokens
