"""``tbrpc doctor``: check every node of a cluster, say what is wrong and how to fix it.

Per node: reachable; handshake (protocol and ggml ABI) and package versions;
device and usable memory against the cluster file; the model file on the
node against the head's copy (size and a fast fingerprint); ssh and, on
macOS nodes, RDMA, the Thunderbolt link of the node's address and the GPU
wired-memory limit. A node's own facts come from ``python -m tbrpc.facts``,
run over ssh, or in this process for nodes on this machine.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tbrpc import defaults
from tbrpc import secret as cluster_secret
from tbrpc.client import AuthenticationError, NodeError, NodeVersionMismatch, probe
from tbrpc.facts import collect, model_identity, package_version, tbrpc_version
from tbrpc.node_processes import _remote_word
from tbrpc.spec import NodeSpec
from tbrpc.units import format_size

OK, WARN, FAIL, SKIP = "ok", "warn", "FAIL", "-"
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


def _start_command(spec: NodeSpec) -> str:
    return f"tbrpc node --host {spec.listen_address} --port {spec.port} --name {spec.name}"


def _facts(spec: NodeSpec, model: str | None, timeout: float) -> tuple[dict[str, Any] | None, str, str]:
    """(facts, "", "") or (None, why, the check that failed: "ssh", "node facts" or "")."""
    if spec.start == "ssh" and spec.ssh is not None:
        words = [spec.python or "python3", "-m", "tbrpc.facts", "--host", spec.host]
        if model:
            words += ["--model", model]
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
        return collect(model, spec.host), "", ""
    return None, "no ssh access configured: only the network checks ran", ""


def _check_reachable(n: _Node, timeout: float) -> tuple[bool, Any]:
    spec = n.spec
    if not spec.port:
        n.add("reachable", SKIP, "no fixed port: started by launch on a free one")
        return False, None
    up, how = _tcp(spec.host, spec.port, timeout)
    if not up:
        if spec.start in ("local", "ssh"):
            n.add("reachable", WARN, f"{spec.endpoint}: not running ({how}); `tbrpc launch` starts it ({spec.describe_start()})")
        else:
            n.add("reachable", FAIL, f"{spec.endpoint}: {how}",
                  f"start it on {spec.host}: `{_start_command(spec)}`; check that a firewall lets port {spec.port} in")
        return False, None
    n.add("reachable", OK, f"{spec.endpoint}: {how}")
    try:
        info, status = probe(spec.endpoint, timeout=timeout)
    except AuthenticationError as exc:
        n.add("handshake", OK, "protocol and ggml ABI match")
        n.add("secret", FAIL, str(exc), _secret_fix(spec))
        return False, None
    except NodeError as exc:
        message = str(exc)
        if isinstance(exc, NodeVersionMismatch):
            fix = "install the same tbrpc and llama-cpp-python on the head and this node, then restart the node"
        else:
            fix = "is this port a tbrpc node? restart it: " + _start_command(spec)
        n.add("handshake", FAIL, message, fix)
        return False, None
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


def diagnose(specs: Sequence[NodeSpec], gguf: str | None = None, timeout: float = defaults.CHECK_TIMEOUT_S) -> list[Check]:
    """Every check of every node, in order."""
    reference = model_identity(gguf) if gguf else None
    checks: list[Check] = []
    for spec in specs:
        n = _Node(spec)
        up, answer = _check_reachable(n, timeout)
        if up:
            _check_device(n, answer[0])
        model = spec.model or gguf
        facts, why, failing = _facts(spec, model, timeout=max(30.0, timeout))
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
        checks.extend(n.checks)
    return checks


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
    nodes = len({c.node for c in checks})
    lines.append("")
    lines.append(f"{nodes} node(s): {failed} failed check(s), {warned} warning(s)" if failed or warned
                 else f"{nodes} node(s): all checks passed")
    return "\n".join(lines)


def failed(checks: Sequence[Check]) -> bool:
    return any(c.status == FAIL for c in checks)

