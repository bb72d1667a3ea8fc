"""`tbrpc doctor` explains RDMA per machine and per link, driven by the stand-in
verbs provider (tests/c/verbs_sim.c): each machine's facts come from a real
`python -m tbrpc.facts` process whose verbs library is the stand-in, configured
to say "port down", "no IPv4 GID", "no device", "QP limit 10 with 9 used",
"open refused"; the judging (tbrpc/doctor.py) then has to name each reason.
Only the macOS facts (OS build, the Thunderbolt Bridge) are recorded: this
machine is not a Mac. Nothing here says anything about a Mac or a NIC."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from helpers import ENV

from tbrpc import doctor
from tbrpc._build import build_verbs_sim, have_verbs_headers
from tbrpc.doctor import OK, SKIP, WARN, Check, _link_rdma_row, _machine_rdma_rows, diagnose, format_checks
from tbrpc.cluster_file import load_specs

pytestmark = pytest.mark.skipif(not have_verbs_headers(), reason="no <infiniband/verbs.h> (apt-get install libibverbs-dev)")


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_verbs_sim(tmp_path_factory.mktemp("sim") / "libtbverbs_sim.so")


def sim_env(sim: Path, tmp_path: Path, **config: str) -> dict[str, str]:
    env = {k: v for k, v in ENV.items() if not k.startswith(("TBVSIM_", "TBRPC_"))}
    env.update(TBRPC_VERBS_LIB=str(sim), TBVSIM_DIR=str(tmp_path / "sim"), TBVSIM_PROFILE="apple-uc",
               TBRPC_RDMA_PROFILE="apple-uc", TBVSIM_ADDR="127.0.0.1")
    env.update(config)
    return env


def facts_of(env: dict[str, str], toward: tuple[str, ...] = (), memlock: int | None = None) -> dict[str, Any]:
    """What a machine configured by `env` says about itself: a real `python -m tbrpc.facts`."""
    argv = [sys.executable, "-m", "tbrpc.facts"] + [w for a in toward for w in ("--toward", a)]

    def lower_memlock() -> None:
        if memlock is not None:
            resource.setrlimit(resource.RLIMIT_MEMLOCK, (memlock, resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]))

    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, preexec_fn=lower_memlock)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def machine(facts: dict[str, Any], *addresses: str) -> dict[str, tuple[str, str, str]]:
    return {check: (status, detail, fix) for check, status, detail, fix in _machine_rdma_rows("n1", facts, addresses)}


# --- the facts: what the verbs library says, per device ---------------------------------------

@pytest.mark.parametrize("config,kind,words", [
    ({}, "usable", "simbolt0 port 1 ACTIVE"),
    ({"TBVSIM_PORT": "down"}, "port_down", "simbolt0 port 1 is DOWN, not ACTIVE"),
    ({"TBVSIM_PORT": "init"}, "port_down", "simbolt0 port 1 is INIT, not ACTIVE"),
    ({"TBVSIM_ADDR": "none"}, "no_gid", "has no IP address GID"),
    ({"TBVSIM_MAX_QPS": "10", "TBVSIM_QPS_USED": "10"}, "qp_budget", "grants no more QPs (10 at most)"),
    ({"TBVSIM_OPEN_ERRNO": "13"}, "open_failed", "cannot open simbolt0: Permission denied"),
])
def test_report_kind_per_device(sim, tmp_path, config, kind, words) -> None:
    f = facts_of(sim_env(sim, tmp_path, **config))
    assert f["rdma"]["kind"] == "usable" and f["rdma"]["library"] == str(sim)
    (device,) = f["rdma"]["devices"]
    assert (device["kind"], device["name"]) == (kind, "simbolt0")
    assert words in device["text"]


def test_report_counts_ports_gids_and_qps(sim, tmp_path) -> None:
    f = facts_of(sim_env(sim, tmp_path, TBVSIM_ADDR="127.0.0.3", TBVSIM_MAX_QPS="10", TBVSIM_QPS_USED="9",
                         TBRPC_HOST_ID="mac-a"), toward=("127.0.0.1",))
    (d,) = f["rdma"]["devices"]
    assert (d["port"], d["port_state"], d["active_mtu"], d["max_qp"], d["qp_free"]) == (1, 4, 4096, 10, 1)
    assert "::ffff:127.0.0.3" in d["gids"]
    assert f["rdma"]["profile"] == "apple-uc" and f["rdma"]["ring_bytes"] == 2 * 16 * 128 * 1024
    assert f["sources"] == {"127.0.0.1": "127.0.0.1"}
    other = facts_of(sim_env(sim, tmp_path, TBRPC_HOST_ID="mac-b"))
    assert other["rdma"]["host_id"] != f["rdma"]["host_id"]
    assert facts_of(sim_env(sim, tmp_path, TBRPC_HOST_ID="mac-a"))["rdma"]["host_id"] == f["rdma"]["host_id"]


# --- per machine ---------------------------------------------------------------------------

def test_no_library_names_the_path_tried(sim, tmp_path) -> None:
    f = facts_of(sim_env(sim, tmp_path, TBRPC_VERBS_LIB="/nonexistent/libibverbs.so.1"))
    assert f["rdma"]["kind"] == "no_library" and f["rdma"]["library"] == "/nonexistent/libibverbs.so.1"
    status, detail, fix = machine(f, "127.0.0.1")["rdma devices"]
    assert status == WARN and "no verbs library: cannot load TBRPC_VERBS_LIB=/nonexistent/libibverbs.so.1" in detail
    assert "libibverbs1" in fix   # Linux: how to install it
    # the system library, as this machine has it: absent, or present without a device
    system = facts_of({k: v for k, v in sim_env(sim, tmp_path).items() if k != "TBRPC_VERBS_LIB"})
    assert system["rdma"]["kind"] in ("no_library", "no_device")
    assert system["rdma"]["library"] == "libibverbs.so.1"


def test_no_device(sim, tmp_path) -> None:
    f = facts_of(sim_env(sim, tmp_path, TBVSIM_DEVICES="0"))
    assert f["rdma"]["kind"] == "no_device" and not f["rdma"]["devices"]
    status, detail, fix = machine(f, "127.0.0.1")["rdma devices"]
    assert status == WARN and f"{sim} lists no RDMA device" in detail
    if not f["linux"]["infiniband"]["exists"]:
        assert "there is no /dev/infiniband" in detail and "modprobe" in fix
    # nothing crosses hosts: no RDMA is needed, so it is no warning
    assert machine(f)["rdma devices"][0] == SKIP


def test_port_down(sim, tmp_path) -> None:
    assert_port_down_reported(facts_of(sim_env(sim, tmp_path, TBVSIM_PORT="down")))


def assert_port_down_reported(f: dict[str, Any]) -> None:
    status, detail, fix = machine(f, "127.0.0.1")["rdma devices"]
    assert status == WARN and "port 1 is DOWN, not ACTIVE" in detail, detail
    assert "rdma_ctl status" in fix and "Thunderbolt 4" in fix


def test_doctor_blind_to_port_state_fails_the_port_test(sim, tmp_path, monkeypatch) -> None:
    """Negative: a report that ignores port state (calls a DOWN port usable) must fail test_port_down."""
    f = facts_of(sim_env(sim, tmp_path, TBVSIM_PORT="down"))
    blind = json.loads(json.dumps(f))
    for d in blind["rdma"]["devices"]:
        d.update(kind="usable", text=f"{d['name']} port 1 ACTIVE, {len(d['gids'])} GID(s)")
    with pytest.raises(AssertionError):
        assert_port_down_reported(blind)
    # and a judge that looks past the kind at nothing but GIDs lets the link through: the link test catches it
    a = facts_of(sim_env(sim, tmp_path, TBRPC_HOST_ID="a"))
    monkeypatch.setattr(doctor, "_rdma_usable", lambda facts: bool(facts["rdma"].get("devices")))
    monkeypatch.setattr(doctor, "_rdma_device_for", lambda facts, address: dict(facts["rdma"]["devices"][0], kind="usable"))
    with pytest.raises(AssertionError):
        assert_link_refused_for_port(a, f)


def assert_link_refused_for_port(a: dict[str, Any], b: dict[str, Any]) -> None:
    status, detail, _ = _link_rdma_row("a", a, "127.0.0.1", "b", b, "127.0.0.1")
    assert status == WARN and "b has no usable RDMA device" in detail, detail


def test_link_to_a_port_down_node_stays_on_tcp(sim, tmp_path) -> None:
    a = facts_of(sim_env(sim, tmp_path, TBRPC_HOST_ID="a"))
    b = facts_of(sim_env(sim, tmp_path, TBRPC_HOST_ID="b", TBVSIM_PORT="down"))
    assert_link_refused_for_port(a, b)


def test_no_gid(sim, tmp_path) -> None:
    f = facts_of(sim_env(sim, tmp_path, TBVSIM_ADDR="none"))
    status, detail, fix = machine(f, "127.0.0.1")["rdma devices"]
    assert status == WARN and "has no IP address GID" in detail and "IPv4 address" in fix


LINUX = {"TBVSIM_PROFILE": "linux-rc", "TBRPC_RDMA_PROFILE": "linux-rc"}


def test_report_says_which_gid_type_a_port_uses(sim, tmp_path) -> None:
    """A RoCE port lists the address twice (v1 at 2, v2 at 3): the report types each entry and marks the one a
    connection from the address takes, RoCE v2, as the bring-up chooses; Apple's one entry has no type."""
    f = facts_of(sim_env(sim, tmp_path, TBVSIM_ADDR="127.0.0.3", **LINUX))
    (d,) = f["rdma"]["devices"]
    entries = [(g, i, t, c) for g, i, t, c in zip(d["gids"], d["gid_index"], d["gid_types"], d["gid_chosen"])
               if g.startswith("::ffff:")]
    assert entries == [("::ffff:127.0.0.3", 2, "RoCE v1", False), ("::ffff:127.0.0.3", 3, "RoCE v2", True)]
    status, detail, _ = machine(f, "127.0.0.3")["rdma devices"]
    assert status == OK and "::ffff:127.0.0.3 uses GID 3, RoCE v2" in detail
    # without _ibv_query_gid_ex the kernel's sysfs files say the same
    f = facts_of(sim_env(sim, tmp_path, TBVSIM_ADDR="127.0.0.3", TBVSIM_GID_EX="0", TBVSIM_SYSFS=str(tmp_path / "sys"),
                         **LINUX))
    assert "::ffff:127.0.0.3 uses GID 3, RoCE v2" in machine(f, "127.0.0.3")["rdma devices"][1]
    apple = facts_of(sim_env(sim, tmp_path, TBVSIM_ADDR="127.0.0.3"))
    detail = machine(apple, "127.0.0.3")["rdma devices"][1]
    assert "::ffff:127.0.0.3 uses GID 1," in detail and "RoCE" not in detail


def test_infiniband_port_is_not_supported(sim, tmp_path) -> None:
    f = facts_of(sim_env(sim, tmp_path, TBVSIM_LINK="ib", **LINUX))
    (d,) = f["rdma"]["devices"]
    assert d["kind"] == "infiniband" and d["link_layer"] == 1 and d["gid_types"] == ["IB"]
    status, detail, fix = machine(f, "127.0.0.1")["rdma devices"]
    assert status == WARN and "is InfiniBand: tbrpc does not support RDMA over InfiniBand" in detail
    assert "stay on TCP" in fix and "RoCE" in fix


def test_link_between_gid_types(sim, tmp_path) -> None:
    """One end's NIC lists only RoCE v1, the other's v2 too: the bring-up would refuse the pair, doctor says so."""
    a = facts_of(sim_env(sim, tmp_path, TBRPC_HOST_ID="a", TBVSIM_GID_TYPES="v1", **LINUX))
    b = facts_of(sim_env(sim, tmp_path, TBRPC_HOST_ID="b", TBVSIM_ADDR="127.0.0.3", **LINUX))
    status, detail, fix = _link_rdma_row("a", a, "127.0.0.1", "b", b, "127.0.0.3")
    assert status == WARN and "GID types differ (a RoCE v1, b RoCE v2)" in detail and "RoCE v2" in fix
    b1 = facts_of(sim_env(sim, tmp_path, TBRPC_HOST_ID="b", TBVSIM_ADDR="127.0.0.3", TBVSIM_GID_TYPES="v1", **LINUX))
    status, detail, _ = _link_rdma_row("a", a, "127.0.0.1", "b", b1, "127.0.0.3")
    assert status == OK and "(127.0.0.1, GID 1, RoCE v1) to b simbolt0 (127.0.0.3, GID 1, RoCE v1)" in detail


def test_qp_budget_ten_with_nine_used(sim, tmp_path) -> None:
    """A middle node of a ring needs 3 QPs on its device (head, link in, link out): 1 left is too few."""
    f = facts_of(sim_env(sim, tmp_path, TBVSIM_MAX_QPS="10", TBVSIM_QPS_USED="9"))
    rows = machine(f, "127.0.0.1", "127.0.0.1", "127.0.0.1")
    status, detail, fix = rows["rdma QPs"]
    assert status == WARN and "simbolt0 grants 1 more QP(s) (10 at most" in detail and "needs 3 on it" in detail
    assert "at most 10 per device" in fix
    assert "rdma QPs" not in machine(f, "127.0.0.1")   # one link: the one QP left suffices
    roomy = facts_of(sim_env(sim, tmp_path, TBVSIM_MAX_QPS="10", TBVSIM_QPS_USED="7"))
    assert "rdma QPs" not in machine(roomy, "127.0.0.1", "127.0.0.1", "127.0.0.1")
    full = facts_of(sim_env(sim, tmp_path, TBVSIM_MAX_QPS="10", TBVSIM_QPS_USED="10"))
    status, detail, _ = machine(full, "127.0.0.1")["rdma devices"]
    assert status == WARN and "grants no more QPs" in detail


def test_open_refused_names_the_device_files(sim, tmp_path) -> None:
    f = facts_of(sim_env(sim, tmp_path, TBVSIM_OPEN_ERRNO="13"))
    assert f["rdma"]["devices"][0]["errno"] == 13
    recorded = {**f, "linux": {**f["linux"], "infiniband": {"exists": True, "devices": [
        {"name": "uverbs0", "access": False}]}}}   # what /dev/infiniband looks like to a user without access
    status, detail, fix = machine(recorded, "127.0.0.1")["rdma devices"]
    assert status == WARN and "Permission denied" in detail
    assert fix.startswith("/dev/infiniband/uverbs0: not readable and writable by you")


def test_infiniband_facts_see_permissions(tmp_path) -> None:
    from tbrpc.facts import infiniband_facts

    assert infiniband_facts(tmp_path / "absent") == {"exists": False, "devices": []}
    (tmp_path / "uverbs0").write_bytes(b"")
    (tmp_path / "uverbs1").write_bytes(b"")
    (tmp_path / "rdma_cm").write_bytes(b"")
    (tmp_path / "uverbs1").chmod(0o400)
    got = infiniband_facts(tmp_path)
    assert got["exists"] and [d["name"] for d in got["devices"]] == ["uverbs0", "uverbs1"]
    assert got["devices"][0]["access"] is True
    assert got["devices"][1]["access"] is (os.geteuid() == 0)   # root reads and writes anything


def test_locked_memory_limit(sim, tmp_path) -> None:
    """Linux: each connection registers (locks) its rings; `ulimit -l` must hold them all."""
    env = sim_env(sim, tmp_path, TBVSIM_PROFILE="linux-rc", TBRPC_RDMA_PROFILE="linux-rc")
    f = facts_of(env, memlock=1 << 20)
    assert f["linux"]["memlock"] == 1 << 20 and f["rdma"]["ring_bytes"] == 2 * 16 * 256 * 1024
    status, detail, fix = machine(f, "127.0.0.1", "127.0.0.1")["locked memory"]
    assert status == WARN and "ulimit -l is 1.0 MiB" in detail and "2 here need 16.0 MiB" in detail, detail
    assert "ulimit -l unlimited" in fix
    small = facts_of({**env, "TBRPC_RDMA_SLOTS": "4"}, memlock=4 << 20)   # 2 x 4 x 256 KiB per connection
    assert small["rdma"]["ring_bytes"] == 2 << 20
    assert "locked memory" not in machine(small, "127.0.0.1", "127.0.0.1")   # 4 MiB for two: just enough
    assert "locked memory" in machine(small, "127.0.0.1", "127.0.0.1", "127.0.0.1")


# --- per link ------------------------------------------------------------------------------

def test_link_between_two_hosts_is_possible(sim, tmp_path) -> None:
    a = facts_of(sim_env(sim, tmp_path, TBRPC_HOST_ID="a"), toward=("127.0.0.1",))
    b = facts_of(sim_env(sim, tmp_path, TBRPC_HOST_ID="b"))
    status, detail, _ = _link_rdma_row("a", a, a["sources"]["127.0.0.1"], "b", b, "127.0.0.1")
    assert status == OK and "RDMA possible: a simbolt0 (127.0.0.1, GID 1) to b simbolt0 (127.0.0.1, GID 1), apple-uc" in detail


def test_link_within_one_host_is_shared_memory(sim, tmp_path) -> None:
    a = facts_of(sim_env(sim, tmp_path, TBRPC_HOST_ID="same"))
    b = facts_of(sim_env(sim, tmp_path, TBRPC_HOST_ID="same", TBVSIM_PORT="down"))
    status, detail, _ = _link_rdma_row("a", a, "127.0.0.1", "b", b, "127.0.0.1")
    assert (status, detail) == (SKIP, "same host: shared memory carries it, not RDMA")


def test_link_address_without_gid_and_the_bridge(sim, tmp_path) -> None:
    a = facts_of(sim_env(sim, tmp_path, TBRPC_HOST_ID="a"))
    b = facts_of(sim_env(sim, tmp_path, TBRPC_HOST_ID="b", TBVSIM_ADDR="127.0.0.3"))
    status, detail, fix = _link_rdma_row("a", a, "127.0.0.1", "b", b, "127.0.0.1")
    assert status == WARN and "no RDMA device of b has a GID for 127.0.0.1" in detail and "`links`" in fix
    # the node's address is on the Thunderbolt Bridge (recorded macOS facts): that is why
    on_bridge = {**b, "macos": {"link": {"address": "127.0.0.1", "interface": "bridge0"}}}
    status, detail, fix = _link_rdma_row("a", a, "127.0.0.1", "b", on_bridge, "127.0.0.1")
    assert status == WARN and "on the Thunderbolt Bridge bridge0, which gives RDMA no GID" in detail
    assert "'Thunderbolt Bridge' off" in fix


def test_link_between_macs_of_different_builds(sim, tmp_path) -> None:
    a = facts_of(sim_env(sim, tmp_path, TBRPC_HOST_ID="a"))
    b = facts_of(sim_env(sim, tmp_path, TBRPC_HOST_ID="b"))
    mac_a, mac_b = {**a, "os": "Darwin", "os_build": "25C56"}, {**b, "os": "Darwin", "os_build": "25D5"}
    status, detail, fix = _link_rdma_row("a", mac_a, "127.0.0.1", "b", mac_b, "127.0.0.1")
    assert status == WARN and "macOS builds differ (a 25C56, b 25D5)" in detail and "same macOS build" in fix
    status, _, _ = _link_rdma_row("a", mac_a, "127.0.0.1", "b", {**mac_b, "os_build": "25C56"}, "127.0.0.1")
    assert status == OK


def test_link_between_profiles(sim, tmp_path) -> None:
    a = facts_of(sim_env(sim, tmp_path, TBRPC_HOST_ID="a"))
    b = facts_of(sim_env(sim, tmp_path, TBRPC_HOST_ID="b", TBVSIM_PROFILE="linux-rc", TBRPC_RDMA_PROFILE="linux-rc"))
    status, detail, _ = _link_rdma_row("a", a, "127.0.0.1", "b", b, "127.0.0.1")
    assert status == WARN and "profiles differ (a apple-uc, b linux-rc)" in detail


# --- the whole doctor: facts over ssh, rows per machine and per link --------------------------

FAKE_SSH = """#!{python}
# ssh stand-in: runs the remote command on this machine, in the environment
# recorded for the destination (user@host) in {envs}/<destination>.json
import json, os, sys
destination, command = sys.argv[-2], sys.argv[-1]
env = dict(os.environ, **json.load(open(os.path.join({envs!r}, destination + ".json"))))
os.execvpe("sh", ["sh", "-c", command], env)
"""


def test_doctor_rows_per_machine_and_per_link(sim, tmp_path, monkeypatch) -> None:
    """Head and two nodes on three "hosts" (host ids) of one stand-in fabric; node b's port is down.
    The head's facts come from a facts process too: this test process may have loaded another
    verbs library already (it is loaded once per process)."""
    bin_dir, envs = tmp_path / "bin", tmp_path / "envs"
    bin_dir.mkdir()
    envs.mkdir()
    ssh = bin_dir / "ssh"
    ssh.write_text(FAKE_SSH.format(python=sys.executable, envs=str(envs)))
    ssh.chmod(0o755)
    for name, config in (("a", {"TBRPC_HOST_ID": "a"}), ("b", {"TBRPC_HOST_ID": "b", "TBVSIM_PORT": "down"})):
        (envs / f"{name}@127.0.0.1.json").write_text(json.dumps(sim_env(sim, tmp_path, **config)))
    cluster = tmp_path / "c.toml"
    cluster.write_text("".join(f'[[node]]\nname = "{n}"\nhost = "127.0.0.1"\nport = {i + 1}\nmemory = "1GiB"\n'
                               f'start = "ssh"\nssh = "{n}@127.0.0.1"\npython = "{sys.executable}"\n'
                               for i, n in enumerate("ab")))   # two nodes: two ports
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    head_env = sim_env(sim, tmp_path, TBRPC_HOST_ID="head")
    monkeypatch.setattr(doctor, "collect", lambda model, host, toward: facts_of(head_env, tuple(toward)))
    checks = diagnose(load_specs(cluster), timeout=2.0)
    table = format_checks(checks)

    def row(node: str, name: str) -> Check:
        found = [c for c in checks if (c.node, c.name) == (node, name)]
        assert len(found) == 1, table
        return found[0]

    assert row(doctor.HEAD, "rdma devices").status == OK, table
    assert row("a", "rdma devices").status == OK, table
    assert row("b", "rdma devices").status == WARN and "port 1 is DOWN" in row("b", "rdma devices").detail, table
    assert row("a", f"rdma from {doctor.HEAD}").status == OK, table
    assert row("b", f"rdma from {doctor.HEAD}").detail == "TCP: b has no usable RDMA device (its `rdma devices` row says why)"
    assert row("b", "rdma from a").status == WARN, table
    assert "2 node(s)" in table   # the head's rows are not a node
