"""``tbrpc doctor``: check every node of a cluster, say what is wrong and how to fix it.

Per node: reachable; handshake (protocol and ggml ABI) and package versions;
device and usable memory against the cluster file; the model file on the
node against the head's copy (size and a fast fingerprint); ssh and, on
macOS nodes, rdma_ctl, the Thunderbolt link of the node's address and the GPU
wired-memory limit. Then, for the head and every node, whether RDMA can
carry its connections and why not, and per link of a layer split whether
both ends can meet over RDMA (rdma_checks). Then, for a launch running on
this machine with these nodes, what its connections and links actually
negotiated, and for each on TCP the reason's kind and its fix
(running_checks, transport_fix). A node's own facts come from
``python -m tbrpc.facts``, run over ssh, or in this process for nodes on
this machine.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from tbrpc import defaults
from tbrpc.cables import Cabling, asked, cabling, discovers, takes_cables
from tbrpc import secret as cluster_secret
from tbrpc.client import AuthenticationError, NodeError, NodeVersionMismatch, probe
from tbrpc.facts import QP_PROBE, collect, model_identity, package_version, tbrpc_version
from tbrpc.node_processes import _remote_word, start_command
from tbrpc.spec import NodeSpec
from tbrpc.units import format_size

OK, WARN, FAIL, SKIP = "ok", "warn", "FAIL", "-"
_SAME_VERSIONS = "install the same tbrpc and llama-cpp-python on the head and this node, then restart the node"
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class Check:
    node: str
    name: str
    status: str
    detail: str
    fix: str = ""


class _Node:
    """Collects the checks of one node."""

    def __init__(self, spec: NodeSpec) -> None:
        self.spec = spec
        self.checks: list[Check] = []

    def add(self, name: str, status: str, detail: str, fix: str = "") -> None:
        self.checks.append(Check(self.spec.name, name, status, detail, fix))


def _tcp(endpoint_host: str, port: int, timeout: float) -> tuple[bool, str]:
    started = time.monotonic()
    try:
        with socket.create_connection((endpoint_host, port), timeout=timeout):
            return True, f"{(time.monotonic() - started) * 1000:.1f} ms to connect"
    except OSError as exc:
        return False, str(exc.strerror or exc)


_LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def _secret_fix(spec: NodeSpec) -> str:
    return (f"give {spec.name} and this head the same secret file: `tbrpc node --secret-file PATH` there, and "
            "--secret-file PATH (or `secret_file` in the cluster file, or TBRPC_SECRET_FILE) here")


def gather_facts(spec: NodeSpec, model: str | None, timeout: float,
           toward: Sequence[str] = ()) -> tuple[dict[str, Any] | None, str, str]:
    """(facts, "", "") or (None, why, the check that failed: "ssh", "node facts" or "")."""
    if spec.start == "ssh" and spec.ssh is not None:
        words = [spec.python or "python3", "-m", "tbrpc.facts", "--host", spec.host]
        if model:
            words += ["--model", model]
        for address in toward:
            words += ["--toward", address]
        argv = spec.ssh_argv("exec " + " ".join(_remote_word(w) for w in words))
        try:
            proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return None, f"ssh {spec.ssh_destination()} did not answer in {timeout:.0f} s", "ssh"
        except OSError as exc:
            return None, f"cannot run ssh: {exc}", "ssh"
        stderr = proc.stderr.strip()
        if proc.returncode == 255:
            return None, f"ssh {spec.ssh_destination()} failed: {stderr[-400:]}", "ssh"
        if proc.returncode != 0:
            if "No module named" in stderr:
                return None, (f"tbrpc is not importable by {spec.python or 'python3'} on {spec.ssh_destination()}"
                              f" ({stderr.splitlines()[-1]})"), "node facts"
            return None, f"python -m tbrpc.facts failed ({proc.returncode}): {stderr[-400:]}", "node facts"
        try:
            return json.loads(proc.stdout.strip().splitlines()[-1]), "", ""
        except (ValueError, IndexError):
            return None, f"unexpected answer from {spec.ssh_destination()}: {proc.stdout.strip()[-200:]}", "node facts"
    if spec.start == "local" or spec.host in _LOOPBACK:
        return collect(model, spec.host, toward), "", ""
    return None, "no ssh access configured: only the network checks ran", ""


def _check_reachable(n: _Node, timeout: float) -> tuple[bool, Any]:
    spec = n.spec
    if not spec.port:
        n.add("reachable", SKIP, "no fixed port: started by launch on a free one")
        return False, None
    # The handshake before the connection that times reaching the node: a node frees a client's
    # slot a moment after it closes, so that connection would still count as a client of the
    # node when the probe reads how many it has.
    try:
        answer: tuple[Any, Any] | NodeError = probe(spec.endpoint, timeout=timeout)
    except NodeError as exc:
        answer = exc
    up, how = _tcp(spec.host, spec.port, timeout)
    if not up:
        if spec.start in ("local", "ssh"):
            n.add("reachable", WARN, f"{spec.endpoint}: not running ({how}); `tbrpc launch` starts it ({spec.describe_start()})")
        else:
            n.add("reachable", FAIL, f"{spec.endpoint}: {how}",
                  f"start it on {spec.host}: `{start_command(spec)}`; check that a firewall lets port {spec.port} in")
        return False, None
    n.add("reachable", OK, f"{spec.endpoint}: {how}")
    if isinstance(answer, AuthenticationError):
        n.add("handshake", OK, "protocol and ggml ABI match")
        n.add("secret", FAIL, str(answer), _secret_fix(spec))
        return False, None
    if isinstance(answer, NodeError):
        if isinstance(answer, NodeVersionMismatch):
            fix = _SAME_VERSIONS
        else:
            fix = (f"see what holds port {spec.port} on {spec.host} (`ss -ltnp 'sport = :{spec.port}'` on Linux, "
                   f"`lsof -nP -iTCP:{spec.port} -sTCP:LISTEN` on macOS): another program (stop it, or give the "
                   f"node another port), or a node that hangs (stop it, then `{start_command(spec)}`)")
        n.add("handshake", FAIL, str(answer), fix)
        return False, None
    info, status = answer
    others = max(0, status.clients - 1)   # this probe is a client too
    n.add("handshake", OK, f"protocol and ggml ABI match; node {info.node_name!r}, {others} other client(s)")
    if cluster_secret.file_for() is not None:
        n.add("secret", OK, f"the node and this head prove the same secret ({cluster_secret.file_for()})")
    else:
        n.add("secret", OK if spec.host in _LOOPBACK_HOSTS else WARN,
              "none: the node serves whoever reaches its port",
              "" if spec.host in _LOOPBACK_HOSTS else
              "make a cluster secret (`tbrpc secret new`) and give it to every node and head (docs/cluster.md)")
    return True, (info, status)


def _check_distinct(n: _Node, info: Any, answered: dict[str, NodeSpec]) -> None:
    """A FAIL row when this entry's node answers with the node id of an earlier entry's: one node
    process reached at two addresses, whose memory a plan would count twice."""
    first = answered.setdefault(info.node_id, n.spec) if info.node_id else n.spec
    if first is not n.spec:
        n.add("distinct", FAIL, f"{n.spec.endpoint} is the node process of {first.name} ({first.endpoint}), "
              "reached at another address", f"list each node once: remove {n.spec.name} or {first.name}")


def _check_device(n: _Node, info: Any) -> None:
    spec = n.spec
    detail = (f"{info.node_device} ({info.description}), {format_size(info.mem_free)} free of "
              f"{format_size(info.mem_total)}")
    if spec.device and spec.device != info.node_device:
        n.add("device", FAIL, f"{detail}; the cluster file asks for {spec.device}",
              f"restart the node with --device {spec.device} (or fix `device` in the cluster file)")
        return
    declared = spec.plan_node.usable_bytes if spec.plan_node else None
    if declared is None:
        n.add("device", OK, f"{detail}; no `memory` given: plan and launch use what the node reports")
    elif declared > info.mem_total:
        n.add("device", FAIL, f"{detail}; the cluster file counts on {format_size(declared)} usable",
              f"lower `usable_memory`/`memory` for {spec.name} to at most {format_size(info.mem_total)}")
    elif declared > info.mem_free:
        n.add("device", WARN, f"{detail}; the cluster file counts on {format_size(declared)} usable",
              "free memory on the node (other processes, another model loaded?) or lower `usable_memory`")
    else:
        n.add("device", OK, f"{detail}; the cluster file counts on {format_size(declared)}")


def _check_model_dir(n: _Node, info: Any, model: str | None) -> None:
    """The running node reads weights from its own disk only when started with --model-dir (its
    handshake says whether it was): launch uses a node it finds running as it is, so without one
    every weight crosses the network, whatever copy of the model that machine holds."""
    if model is None or info.model_files:
        return
    spec = n.spec
    n.add("model dir", FAIL if spec.model is not None else WARN,
          f"{spec.endpoint}: the running node was started without --model-dir: it cannot read "
          f"{os.path.basename(model)} from its own disk, so launch sends it its weights over the network",
          f"restart it with the model's directory: `{start_command(replace(spec, model=model))}`")


def _check_versions(n: _Node, facts: dict[str, Any]) -> None:
    mine = {"tbrpc": tbrpc_version(), "llama-cpp-python": package_version("llama_cpp_python")}
    theirs = {"tbrpc": facts.get("tbrpc"), "llama-cpp-python": facts.get("llama_cpp_python")}
    differ = [f"{k} {theirs[k]} (head: {mine[k]})" for k in mine if theirs[k] != mine[k]]
    where = f"{facts.get('os')} {facts.get('machine')}, Python {facts.get('python')}"
    if differ:
        n.add("versions", FAIL, f"{where}: " + ", ".join(differ),
              f"on {n.spec.name}: pip install 'llama-cpp-python=={mine['llama-cpp-python']}' and the head's tbrpc")
    else:
        n.add("versions", OK, f"{where}: tbrpc {mine['tbrpc']}, llama-cpp-python {mine['llama-cpp-python']}")


def _check_model(n: _Node, facts: dict[str, Any], reference: dict[str, Any] | None) -> None:
    """The node's copy of the model, which it loads weights from (``tbrpc node --model-dir``).

    Compared file by file with the head's (a node needs only the shards of
    its layers: `tbrpc plan` lists them). With `model` set in the cluster
    file, no copy at all or a different file fails; without it, the head's
    path is looked up on the node only to say whether weights will cross the
    network.
    """
    spec, got = n.spec, facts.get("model")
    if got is None:
        return
    configured = spec.model is not None
    bad = FAIL if configured else WARN
    source = reference["path"] if reference else "MODEL"
    copy = f"rsync -a --progress {source} {spec.ssh_destination() + ':' if spec.start == 'ssh' else ''}{got['path']}"
    files = got.get("files", [])
    present = [f for f in files if not f.get("missing")]
    if not present:
        streamed = "" if configured else "; launch will send this node its weights over the network"
        n.add("model", bad, f"{got['path']}: missing{streamed}",
              f"copy the model to the node (`{copy}`)" + (" or fix `model` in the cluster file" if configured
                                                          else " and set `model` for it in the cluster file"))
        return
    where = f"{got['path']}: {len(present)} of {len(files)} file(s), {format_size(sum(f['size'] for f in present))}"
    if reference is None:
        n.add("model", OK, where + " (no head copy to compare: pass --gguf)")
        return
    if not reference["exists"]:
        n.add("model", WARN, where + f"; the head's {reference['path']} is incomplete or missing",
              "pass the head's model with --gguf")
        return
    head_files = {f["name"]: f for f in reference["files"]}
    differ = [f["name"] for f in present
              if f["name"] not in head_files or (f["size"], f["fingerprint"]) != (head_files[f["name"]]["size"],
                                                                                  head_files[f["name"]]["fingerprint"])]
    if [f["name"] for f in files] != list(head_files):
        n.add("model", bad, f"{where}: named {files[0]['name']!r}, the head's is {reference['files'][0]['name']!r}; "
              "the node looks for the head's file names", "name the node's copy (every shard) like the head's")
    elif differ:
        n.add("model", bad, f"{where}: differs from the head's copy in {', '.join(differ[:3])}"
              + (f" and {len(differ) - 3} more" if len(differ) > 3 else ""),
              f"the node's file is not the head's model: copy the head's (`{copy}`)")
    elif len(present) < len(files):
        n.add("model", WARN, f"{where}, same as the head's; the weights of the missing shards will cross the network",
              "copy the shards this node needs (`tbrpc plan --gguf MODEL --cluster FILE` lists them)")
    else:
        n.add("model", OK, f"{where}, fingerprint {got['fingerprint'][:12]}, same as the head's")


def _check_macos(n: _Node, mac: dict[str, Any]) -> None:
    spec = n.spec
    rdma = mac.get("rdma_ctl", {})
    if rdma.get("rc") == 127:
        n.add("rdma", WARN, "rdma_ctl not found: RDMA over Thunderbolt needs macOS 26.2 or later",
              "update macOS; tbrpc uses TCP meanwhile")
    elif "enabled" in rdma.get("output", "").lower() and "disabled" not in rdma.get("output", "").lower():
        devices = [w for w in mac.get("ibv_devices", {}).get("output", "").split() if w.startswith("rdma_")]
        if devices:
            n.add("rdma", OK, f"rdma_ctl: enabled; devices {' '.join(devices)}")
        else:
            n.add("rdma", WARN, "rdma_ctl: enabled, but ibv_devices lists no device",
                  "RDMA needs Thunderbolt 5 on both Macs and a TB5 cable (Thunderbolt 4 Macs list none); tbrpc uses TCP")
    else:
        n.add("rdma", WARN, f"rdma_ctl status: {rdma.get('output', '?')[:80]}",
              "boot into Recovery, run `rdma_ctl enable` in Terminal, restart (tbrpc uses TCP meanwhile)")
    link = mac.get("link")
    if link is not None:
        ports = ", ".join(link.get("ports", []))
        if link.get("interface") is None:
            n.add("thunderbolt", FAIL, f"no interface on this Mac has {spec.host}",
                  f"assign {spec.host} to the port of the cable it names, or correct `host` (docs/cluster.md, Four Macs)")
        elif str(link["interface"]).startswith("bridge"):
            n.add("thunderbolt", WARN, f"{spec.host} is on the Thunderbolt Bridge ({link['interface']}: {ports})",
                  "RDMA has no address on a bridge: turn it off (networksetup -setnetworkserviceenabled "
                  "'Thunderbolt Bridge' off) and give each cable its own subnet (docs/cluster.md, Four Macs)")
        elif not link.get("thunderbolt"):
            if spec.links:
                n.add("thunderbolt", OK, f"{spec.host} is on {link['interface']} ({ports}): the head's connection; "
                      f"activations come over the cables in `links`")
            else:
                n.add("thunderbolt", WARN, f"{spec.host} is on {link['interface']} ({ports}), not Thunderbolt",
                      "use this node's address on the cable from the head as `host`, or list its cables in `links`")
        elif not link.get("active"):
            n.add("thunderbolt", FAIL, f"{spec.host} is on {link['interface']} (Thunderbolt), link not active",
                  "check the cable (a TB5 cable, not in the port next to Ethernet on a Mac Studio)")
        else:
            n.add("thunderbolt", OK, f"{spec.host} on {link['interface']} ({ports}), active")
    limit_mb, memsize = mac.get("wired_limit_mb"), mac.get("memsize")
    declared = spec.plan_node.usable_bytes if spec.plan_node else None
    if memsize:
        effective = limit_mb * 2**20 if limit_mb else int(memsize * defaults.METAL_FRACTION)
        how = f"iogpu.wired_limit_mb={limit_mb}" if limit_mb else "macOS default (about 75% of RAM)"
        detail = f"GPU wired limit {format_size(effective)} ({how}) of {format_size(memsize)} RAM"
        if declared and declared > effective:
            want = (declared + (4 << 30)) // 2**20
            n.add("wired memory", FAIL, f"{detail}; the cluster file counts on {format_size(declared)}",
                  f"on {spec.name}: sudo sysctl iogpu.wired_limit_mb={min(want, memsize // 2**20 - 8192)} "
                  "(add it to /etc/sysctl.conf to keep it after a restart), or lower `usable_memory`")
        else:
            n.add("wired memory", OK, detail)


def _check_linux(n: _Node, linux: dict[str, Any]) -> None:
    """Nodes madvise their buffers for transparent huge pages: decode streams every weight per token."""
    mode = linux.get("transparent_hugepage")
    enable = "echo madvise | sudo tee /sys/kernel/mm/transparent_hugepage/enabled"
    if mode in ("always", "madvise"):
        n.add("huge pages", OK, f"transparent huge pages: {mode} (node buffers get 2 MiB pages)")
    elif mode is None:
        n.add("huge pages", WARN, "this kernel has no transparent huge pages: decode runs on 4 KiB pages, "
              "about 8% slower here (docs/benchmarks.md)", "use a kernel built with CONFIG_TRANSPARENT_HUGEPAGE")
    else:
        n.add("huge pages", WARN, f"transparent huge pages: {mode}: decode runs on 4 KiB pages, about 8% slower "
              "here (docs/benchmarks.md)", f"on {n.spec.name}: {enable}")


# --- RDMA: per machine and per link -----------------------------------------------------------
#
# Judged from facts (tbrpc/facts.py): `rdma` is the verbs library's own report
# (tb_rdma_report: a kind per device, the port state, the GID table, QPs still
# granted), `sources` the address a machine sends from toward a peer, `os_build`
# macOS's build. The head is judged like a node, under the name HEAD. Links are
# the connections a layer split makes: the head to each node, and each node to
# the next in the file's order (at the address in the next node's `links`, else
# its `host`). Everything is decided by kinds and addresses, never by words.

HEAD = "(head)"
_RDMA_ON_A_MAC = "RDMA needs Thunderbolt 5 on this Mac, enabled from Recovery (`rdma_ctl enable`)"
_DEVICE_FIX = {
    "open_failed": "the verbs device files must be readable and writable by the user running tbrpc "
                   "(`ls -l /dev/infiniband`; add the user to their group, or a udev rule)",
    "port_down": "the port comes up when both ends have RDMA enabled and a TB5 cable joins them: check `rdma_ctl "
                 "status` on the peer, the cable, and that it is not in a Mac Studio's port next to Ethernet (no RDMA) "
                 "or a Thunderbolt 4 link; on Linux `ibv_devinfo` shows the port and the switch side",
    "no_gid": "give the interface of this device an IPv4 address (its GID follows it; a link-local 169.254 address "
              "can take minutes after boot): `sudo networksetup -setmanual <service> 10.0.12.1 255.255.255.252`",
    "infiniband": "tbrpc's RDMA is RoCE (and Apple's Thunderbolt) only: over InfiniBand connections stay on TCP "
                  "(IPoIB carries them); for RDMA use the NIC's Ethernet mode (`mlxconfig ... LINK_TYPE_P1=2`) or "
                  "a RoCE NIC (docs/protocol.md, Transports: RDMA)",
    "qp_budget": "every connection and node link takes a QP (Apple: at most 10 per device): stop other heads or "
                 "sessions using this node (`tbrpc status`), or use fewer nodes per device",
}


def _mapped_gid(address: str) -> str:
    """The GID text an address has on a device: ::ffff:a.b.c.d for IPv4, the address itself for IPv6."""
    return address if ":" in address else f"::ffff:{address}"


def _rdma_device_for(facts: dict[str, Any], address: str | None) -> dict[str, Any] | None:
    """The device of `facts` whose GID table holds `address`."""
    if not address:
        return None
    gid = _mapped_gid(address)
    return next((d for d in facts.get("rdma", {}).get("devices", []) if gid in d.get("gids", [])), None)


def _gid_used(d: dict[str, Any], address: str) -> str:
    """Which GID of device `d` a connection from `address` would use, as rdma.c chooses it: 'GID 3, RoCE v2'."""
    gid = _mapped_gid(address)
    for g, index, kind, chosen in zip(d.get("gids", []), d.get("gid_index", []), d.get("gid_types", []),
                                      d.get("gid_chosen", [])):
        if g == gid and chosen:
            return f"GID {index}" + ("" if kind == "untyped" else f", {kind}")
    return "GID ?"


def _rdma_usable(facts: dict[str, Any]) -> bool:
    rdma = facts.get("rdma", {})
    return rdma.get("kind") == "usable" and any(d["kind"] == "usable" for d in rdma.get("devices", []))


def _library_row(name: str, facts: dict[str, Any], needed: bool) -> tuple[str, str, str]:
    """(status, detail, fix) for a machine whose verbs library gives no device at all."""
    rdma, mac = facts.get("rdma", {}), facts.get("os") == "Darwin"
    kind, text = rdma.get("kind"), rdma.get("text", "no RDMA facts")
    status = WARN if needed else SKIP
    if kind == "unavailable":
        return status, text, f"install tbrpc and llama-cpp-python {package_version('llama_cpp_python')} on {name}"
    if kind == "no_headers":
        return status, text, ("build tbrpc with the macOS SDK (Xcode command line tools)" if mac else
                              "sudo apt-get install libibverbs-dev, then reinstall tbrpc")
    if kind == "no_library":
        return status, f"no verbs library: {text}", ("RDMA over Thunderbolt needs macOS 26.2 or later "
                                                    "(/usr/lib/librdma.dylib): update macOS" if mac else
                                                    "sudo apt-get install libibverbs1 ibverbs-providers (rdma-core)")
    ib = facts.get("linux", {}).get("infiniband", {})
    if not mac and not ib.get("exists", True):
        return status, f"{text}; there is no /dev/infiniband", ("load the NIC's RDMA driver (e.g. `sudo modprobe "
                                                                 "mlx5_ib ib_uverbs`) or use TCP")
    return status, text, (_RDMA_ON_A_MAC if mac else "no RDMA NIC here: connections use TCP")


def _device_summary(d: dict[str, Any]) -> str:
    free = d.get("qp_free", -1)
    qps = "" if free < 0 else f", {'at least ' if free >= QP_PROBE else ''}{free} QP(s) free of {d.get('max_qp') or '?'}"
    gids = ", ".join(f"{g} uses {_gid_used(d, g.removeprefix('::ffff:'))}" for g, chosen in
                     zip(d.get("gids", []), d.get("gid_chosen", [True] * len(d.get("gids", []))))
                     if chosen and not g.startswith("fe80")) or "no IP GID"
    return f"{d['text']} ({gids}{qps})"


def _machine_rdma_rows(name: str, facts: dict[str, Any], addresses: Sequence[str | None]) -> list[tuple[str, str, str, str]]:
    """(check, status, detail, fix) rows for one machine; `addresses`: its end of each link that crosses hosts."""
    rdma = facts.get("rdma", {})
    needed = bool(addresses)
    if rdma.get("kind") != "usable":
        return [("rdma devices", *_library_row(name, facts, needed))]
    devices = rdma["devices"]
    rows: list[tuple[str, str, str, str]] = []
    summary = "; ".join(_device_summary(d) for d in devices)
    usable = [d for d in devices if d["kind"] == "usable"]
    if usable:
        rows.append(("rdma devices", OK, summary, ""))
    else:
        fix = _DEVICE_FIX.get(devices[0]["kind"], "")
        bad = [f"/dev/infiniband/{f['name']}" for f in facts.get("linux", {}).get("infiniband", {}).get("devices", [])
               if not f["access"]]
        if devices[0]["kind"] == "open_failed" and bad:
            fix = f"{', '.join(bad)}: not readable and writable by you; " + fix
        rows.append(("rdma devices", WARN if needed else SKIP, summary, fix))
    need: dict[str, int] = {}
    for address in addresses:
        d = _rdma_device_for(facts, address)
        if d is not None:
            need[d["name"]] = need.get(d["name"], 0) + 1
    for d in devices:
        wanted, free = need.get(d["name"], 0), d.get("qp_free", -1)
        if wanted and 0 <= free < wanted:
            rows.append(("rdma QPs", WARN, f"{d['name']} grants {free} more QP(s) ({d.get('max_qp') or '?'} at most, "
                         f"QPs of running sessions count); this cluster needs {wanted} on it: the rest stay on TCP",
                         _DEVICE_FIX["qp_budget"]))
    memlock, total = facts.get("linux", {}).get("memlock", None), rdma.get("ring_bytes", 0) * sum(need.values())
    if facts.get("os") == "Linux" and usable and total and memlock is not None and memlock < total:
        rows.append(("locked memory", WARN, f"ulimit -l is {format_size(memlock)}; each RDMA connection registers "
                     f"{format_size(rdma['ring_bytes'])} ({rdma.get('profile')}), {sum(need.values())} here need "
                     f"{format_size(total)}", f"on {name}: `ulimit -l unlimited` where the node starts, or a memlock "
                     "line in /etc/security/limits.conf (systemd: LimitMEMLOCK=infinity)"))
    return rows


def _cable_fix(end: str, a: str, b: str) -> str:
    return f"use {end}'s address on the cable between {a} and {b} (`host`, or `links` in the cluster file)"


def _link_rdma_row(a: str, a_facts: dict[str, Any], a_addr: str | None,
                   b: str, b_facts: dict[str, Any], b_addr: str) -> tuple[str, str, str]:
    """(status, detail, fix) for the connection from machine a (at a_addr) to machine b (at b_addr)."""
    ra, rb = a_facts.get("rdma", {}), b_facts.get("rdma", {})
    if ra.get("host_id") and ra.get("host_id") == rb.get("host_id"):
        return SKIP, "same host: shared memory carries it, not RDMA", ""
    for end, facts in ((a, a_facts), (b, b_facts)):
        if not _rdma_usable(facts):
            return WARN, f"TCP: {end} has no usable RDMA device (its `rdma devices` row says why)", ""
    if ra.get("profile") != rb.get("profile"):
        return WARN, f"TCP: profiles differ ({a} {ra.get('profile')}, {b} {rb.get('profile')})", \
            "set the same TBRPC_RDMA_PROFILE on both, or none"
    if a_facts.get("os") == b_facts.get("os") == "Darwin" and a_facts.get("os_build") != b_facts.get("os_build"):
        return WARN, (f"TCP: macOS builds differ ({a} {a_facts.get('os_build')}, {b} {b_facts.get('os_build')}); "
                      "RDMA over Thunderbolt needs the same build on both Macs"), "update both Macs to the same macOS build"
    for end, facts, address in ((a, a_facts, a_addr), (b, b_facts, b_addr)):
        if address is None:
            return WARN, f"TCP: {end} has no route to {b_addr}", f"give {end} an address on the cable to {b}"
        d = _rdma_device_for(facts, address)
        if d is None:
            on = facts.get("macos", {}).get("link", {})
            bridge = on.get("address") == address and str(on.get("interface", "")).startswith("bridge")
            why = f" ({address} is on the Thunderbolt Bridge {on.get('interface')}, which gives RDMA no GID)" if bridge else ""
            return WARN, f"TCP: no RDMA device of {end} has a GID for {address}{why}", (
                "turn the Thunderbolt Bridge off (networksetup -setnetworkserviceenabled 'Thunderbolt Bridge' off) "
                "and give each cable its own subnet (docs/cluster.md, Four Macs)" if bridge else
                _cable_fix(end, a, b))
        if d["kind"] != "usable":
            return WARN, f"TCP: {end}: {d['text']}", _DEVICE_FIX.get(d["kind"], "")
    da, db = _rdma_device_for(a_facts, a_addr), _rdma_device_for(b_facts, b_addr)
    ga, gb = _gid_used(da, a_addr), _gid_used(db, b_addr)  # type: ignore[arg-type]
    ta, tb = ga.partition(", ")[2] or "untyped", gb.partition(", ")[2] or "untyped"
    if ta != tb:
        return WARN, f"TCP: GID types differ ({a} {ta}, {b} {tb}): both ends must send the same kind of RoCE frame", \
            "enable RoCE v2 on the NIC that lists only v1 (a newer driver, or its RoCE mode setting), or use TCP"
    return OK, (f"RDMA possible: {a} {da['name']} ({a_addr}, {ga}) to {b} {db['name']} ({b_addr}, {gb}), "  # type: ignore[index]
                f"{ra.get('profile')}"), ""


def rdma_links(specs: Sequence[NodeSpec]) -> list[tuple[str, str, str]]:
    """The connections of a layer split: (from, to, the address `from` dials `to` at)."""
    links = [(HEAD, s.name, s.host) for s in specs]
    return links + [(a.name, b.name, dict(b.links).get(a.name, b.host)) for a, b in zip(specs, specs[1:])]


def rdma_checks(specs: Sequence[NodeSpec], head_facts: dict[str, Any],
                node_facts: dict[str, dict[str, Any]]) -> list[Check]:
    """RDMA rows for the head and every node with facts, then one row per link whose ends both have facts."""
    facts = {HEAD: head_facts, **node_facts}
    ends: dict[str, list[str | None]] = {name: [] for name in facts}
    link_rows: list[Check] = []
    for a, b, b_addr in rdma_links(specs):
        if a not in facts or b not in facts:
            continue
        a_addr = facts[a].get("sources", {}).get(b_addr)
        status, detail, fix = _link_rdma_row(a, facts[a], a_addr, b, facts[b], b_addr)
        link_rows.append(Check(b, f"rdma from {a}", status, detail, fix))
        if status != SKIP:   # a link between hosts: both ends need a device and a QP for it
            ends[a].append(a_addr)
            ends[b].append(b_addr)
    machine_rows = [Check(name, check, status, detail, fix) for name in facts
                    for check, status, detail, fix in _machine_rdma_rows(name, facts[name], ends[name])]
    return machine_rows + link_rows


# --- the cables between the nodes' machines (tbrpc/cables.py) ----------------------------------

def _links_table(node: NodeSpec, found: Cabling, specs: Sequence[NodeSpec]) -> str:
    """The `links` line for `node`'s entry: every other node's name with node's end of their cable."""
    ends = [(other.name, joined[1].address) for other in specs if (joined := found.between(other.name, node.name))]
    return "links = { " + ", ".join(f'{name} = "{address}"' for name, address in ends) + " }"


def cable_checks(specs: Sequence[NodeSpec], node_facts: Mapping[str, Mapping[str, Any]]) -> list[Check]:
    """Per machine the cables found to the other nodes' machines, and per pair of nodes that run
    consecutive layers whether activations use the cable between them: the file's `links`, or
    the node's `host` when that is the cable's end. Nothing when no machine has a cable."""
    found = cabling({s.name: node_facts[s.name] for s in specs if s.name in node_facts})
    if not found.cables:
        return []
    checks: list[Check] = []
    for m in found.machines:
        mine = [(c.at(m), next(e for e in c.ends if e.machine != m), c) for c in found.cables if c.at(m)]
        detail = "; ".join(f"to {', '.join(found.machines[o.machine])}: {e.interface} {e.address} - {o.interface} "
                           f"{o.address} ({c.network})" for e, o, c in mine if e)
        checks.append(Check(m, "cables", OK if mine else WARN, detail or "none to the other nodes' machines", "" if mine
                            else "cable this machine to the next one (a ring: docs/cluster.md, Four Macs)"))
    # consecutive layers, and the way back from the last node to the first where a cable joins them:
    # the last link of a tensor split's ring all-reduce. A node without facts leaves its pairs out.
    found_at_launch = discovers(specs)   # no `links`: launch takes each cable a node listens on
    pairs = [(a, b, "activations") for a, b in zip(specs, specs[1:])]
    if len(specs) > 2 and found.between(specs[-1].name, specs[0].name):
        pairs.append((specs[-1], specs[0], "a tensor split's ring all-reduce"))
    for a, b, what in pairs:
        if a.name not in found.machine_of or b.name not in found.machine_of or \
                found.machine_of[a.name] == found.machine_of[b.name]:
            continue
        joined = found.between(a.name, b.name)
        listed = dict(b.links).get(a.name)
        target = listed or b.host
        end = joined[1] if joined else None
        on = f"{end.interface} {end.address}, {joined[0].network}" if joined and end else ""
        if end is None:
            checks.append(Check(b.name, f"cable from {a.name}", WARN, f"no cable found between {a.name} and {b.name}: "
                                f"{what} go to {target} over the network", f"cable {a.name} to {b.name}, or "
                                "order the nodes along the cables (`links`)"))
        elif target == end.address:
            how = "`links`" if listed else "`host`"
            checks.append(Check(b.name, f"cable from {a.name}", OK, f"{what} from {a.name} come over the cable ({on}; {how})"))
        elif found_at_launch and asked(a) and asked(b) and takes_cables(b):
            checks.append(Check(b.name, f"cable from {a.name}", OK, f"{what} from {a.name} come over the cable ({on}): "
                                "launch finds it (no `links` in the file)"))
        elif found_at_launch and asked(a) and asked(b):
            checks.append(Check(b.name, f"cable from {a.name}", WARN, f"{what} from {a.name} miss the cable between "
                                f"them ({on}): {b.name} listens on {b.listen_address} only",
                                f'listen = "0.0.0.0" in {b.name}\'s entry (launch then finds the cable itself)'))
        else:
            said = f"`links` says {a.name} reaches it at {listed}" if listed else f"they go to its host {b.host}"
            checks.append(Check(b.name, f"cable from {a.name}", WARN,
                                f"{what} from {a.name} miss the cable between them ({on}): {said}",
                                f"in {b.name}'s entry of the cluster file: {_links_table(b, found, specs)}"))
    return checks


# --- what a running launch negotiated ----------------------------------------------------------
#
# A launch records, per connection (head to node) and per node-to-node link, what carries it and
# the kind of the reason when it is TCP or missing (tbrpc/status.py, note_connections; the kinds
# are enum tb_why, ggml_backend/transport.h). The fix is chosen by that kind, never by its words.

RECORD_HEAD = "head"   # the source of a head's connection in a launch record's lines


def transport_fix(why: str, source: str, target: str) -> str:
    """What a user types so the connection or link from `source` (RECORD_HEAD for the head) to
    `target` moves off TCP, for a reason of kind `why` (tbrpc.client.WHY_NAMES)."""
    nodes = target if source == RECORD_HEAD else f"{target} or {source}"

    def no_device(name: str) -> str:
        row = HEAD if name == RECORD_HEAD else name
        return (f"{name} lists no RDMA device: `tbrpc doctor --cluster FILE` says why on {row}'s `rdma devices` row "
                f"(on a Mac: {_RDMA_ON_A_MAC})")

    fixes = {
        "asked": f"TCP was asked for (TBRPC_TRANSPORT=tcp, or `transport = \"tcp\"` for {nodes} in the cluster file): "
                 "drop it to let tbrpc choose",
        "peer_no_rdma": no_device(target),
        "no_rdma_here": no_device(source),
        "qp_budget": _DEVICE_FIX["qp_budget"],
        "no_shm": f"start {nodes} without `--isolation thread`: shared memory needs a worker process per client",
        "shm_failed": f"shared memory could not be made or mapped between {source} and {target}: check that /dev/shm "
                      "has room (`df -h /dev/shm`) and read the node's log",
        "rdma_failed": f"the RDMA bring-up failed (the reason names the side and step): `tbrpc doctor --cluster FILE` "
                       f"checks the link from {source} to {target} (GIDs, port state, profiles, macOS builds); "
                       + _DEVICE_FIX["port_down"],
        "peer_old": _SAME_VERSIONS,
        "no_link": _cable_fix(target, source, target) + f"; and let {source} reach {target}'s peer port (a firewall)",
    }
    return fixes.get(why, f"no fix known for a reason of kind {why!r}: read {source}'s and {target}'s logs")


def record_carriers(node: dict[str, Any]) -> list[tuple[str, str, str, str, str]]:
    """(source, target, transport, why, "connection" or "link") for the head's connection to a node of
    a launch record and each of that node's links."""
    carriers = [(RECORD_HEAD, node["name"], node.get("transport", ""), node.get("transport_why", ""), "connection")]
    return carriers + [(node["name"], link["to"], link["transport"], link["why"], "link") for link in node.get("links", [])]


def running_checks(specs: Sequence[NodeSpec], launches: Sequence[dict[str, Any]]) -> list[Check]:
    """Per connection and link of each running launch (its record, tbrpc/status.py) that uses one of
    `specs` (by endpoint, or by name where the spec has no fixed port): what carries it; on TCP for
    a reason other than being asked to, a warning with the fix."""
    endpoints = {s.endpoint for s in specs if s.port}
    names = {s.name for s in specs if not s.port}   # a node launch starts on a free port
    checks = []
    for launch in launches:
        nodes = [n for n in launch["nodes"] if "transport" in n]
        if not any(n["endpoint"] in endpoints or n["name"] in names for n in nodes):
            continue
        tag = f"launch {launch['pid']}"
        for node in nodes:
            for source, target, transport, why, what in record_carriers(node):
                status = OK if why in ("", "asked") else WARN
                checks.append(Check(target if what == "connection" else source,
                                    f"{what} from {source}" if what == "connection" else f"link to {target}",
                                    status, f"{tag}: {transport}", transport_fix(why, source, target) if why else ""))
    return checks


def diagnose(specs: Sequence[NodeSpec], gguf: str | None = None, timeout: float = defaults.CHECK_TIMEOUT_S,
             launches: Sequence[dict[str, Any]] | None = None) -> list[Check]:
    """Every check of every node, in order. `launches`: launch records to read what was negotiated
    from (default: those of the launches running on this machine)."""
    reference = model_identity(gguf) if gguf else None
    checks: list[Check] = []
    toward: dict[str, list[str]] = {}
    for a, _, address in rdma_links(specs):
        toward.setdefault(a, []).append(address)
    node_facts: dict[str, dict[str, Any]] = {}
    answered: dict[str, NodeSpec] = {}   # node id -> the first entry whose node answered with it
    for spec in specs:
        n = _Node(spec)
        up, answer = _check_reachable(n, timeout)
        if up:
            _check_distinct(n, answer[0], answered)
            _check_device(n, answer[0])
            _check_model_dir(n, answer[0], spec.model or gguf)
        model = spec.model or gguf
        facts, why, failing = gather_facts(spec, model, timeout=max(defaults.FACTS_TIMEOUT_S, timeout),
                                           toward=toward.get(spec.name, []))
        if facts is None:
            if failing == "ssh":
                n.add("ssh", FAIL, why, f"`{spec.ssh.human() if spec.ssh else 'ssh'}` must work without a password "
                      "(BatchMode): ssh-copy-id, the right `key`, and accept the host key once")
            elif failing:
                n.add(failing, FAIL, why, "install tbrpc on the node, or set `python = \"/path/to/venv/bin/python\"` "
                      "for it in the cluster file")
            else:
                n.add("node facts", SKIP, why)
        else:
            if spec.start == "ssh":
                n.add("ssh", OK, f"{spec.ssh_destination()}: {facts.get('os')} {facts.get('release')}")
            _check_versions(n, facts)
            _check_model(n, facts, reference)
            if "macos" in facts:
                _check_macos(n, facts["macos"])
            if "linux" in facts:
                _check_linux(n, facts["linux"])
            node_facts[spec.name] = facts
        checks.extend(n.checks)
    if launches is None:
        from tbrpc.status import running_launches   # status shows these fixes too: it imports this module

        launches = running_launches()
    return checks + cable_checks(specs, node_facts) + \
        rdma_checks(specs, collect(None, None, toward.get(HEAD, [])), node_facts) + running_checks(specs, launches)


def format_checks(checks: Sequence[Check]) -> str:
    """A table: node, check, status, detail; a `fix:` line under every row that is not ok."""
    if not checks:
        return "no nodes"
    w_node = max(4, *(len(c.node) for c in checks))
    w_name = max(5, *(len(c.name) for c in checks))
    lines = [f"{'node'.ljust(w_node)}  {'check'.ljust(w_name)}  {'status':6}  detail"]
    indent = " " * (w_node + w_name + 12)
    for c in checks:
        lines.append(f"{c.node.ljust(w_node)}  {c.name.ljust(w_name)}  {c.status:6}  {c.detail}")
        if c.fix and c.status in (FAIL, WARN):
            lines.append(f"{indent}fix: {c.fix}")
    failed = sum(1 for c in checks if c.status == FAIL)
    warned = sum(1 for c in checks if c.status == WARN)
    nodes = len({c.node for c in checks if c.node != HEAD})
    lines.append("")
    lines.append(f"{nodes} node(s): {failed} failed check(s), {warned} warning(s)" if failed or warned
                 else f"{nodes} node(s): all checks passed")
    return "\n".join(lines)


def failed(checks: Sequence[Check]) -> bool:
    return any(c.status == FAIL for c in checks)

