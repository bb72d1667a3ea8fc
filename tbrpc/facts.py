"""What a machine says about itself, for ``tbrpc doctor``.

Run on each node (over ssh, or in-process for nodes on this machine) as
``python -m tbrpc.facts [--model PATH] [--host ADDR] [--toward ADDR ...]``;
prints one JSON object: OS (and on macOS its build), tbrpc and
llama-cpp-python versions, the model file's identity (size and a fast
fingerprint), the RDMA devices as the verbs library sees them (rdma_facts),
the address this machine sends from toward each --toward address, its
IPv4 addresses per interface (for the cables between machines), on Linux
the transparent-huge-page mode, the locked-memory limit and
/dev/infiniband, and on macOS rdma_ctl, the Thunderbolt link of the node's
address and the GPU wired-memory limit. Only rdma_facts needs tbrpc's C
library (and so llama_cpp); where that does not load, it says why and the
rest still answers.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import resource
import shutil
import socket
import subprocess
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

# The byte ranges nodes hash for a model file (tb_file_identity_fd in
# ggml_backend/model_file.c): the size, the first MiB, 14 samples of 64 KiB at
# size/15*i, the last MiB. Hashing exactly these (with blake2b, which Python
# has built in, instead of the C side's FNV) makes doctor's "same file" the
# nodes' "same file" without loading the C library.
EDGE_BYTES = 1 << 20
N_SAMPLES = 14
SAMPLE_BYTES = 64 << 10
_SHARD_RE = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def tbrpc_version() -> str:
    try:
        return metadata.version("tbrpc")
    except metadata.PackageNotFoundError:
        here = Path(__file__).resolve().parent.parent / "pyproject.toml"
        m = re.search(r'^version\s*=\s*"([^"]+)"', here.read_text(), re.M) if here.exists() else None
        return f"{m.group(1)} (source)" if m else "unknown"


def model_files(path: str | Path) -> list[Path]:
    """The files of a model: one file, or every shard of NAME-0000i-of-0000N.gguf."""
    p = Path(os.path.expanduser(str(path)))
    m = _SHARD_RE.match(p.name)
    if not m:
        return [p]
    count = int(m["count"])
    return [p.with_name(f"{m['prefix']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def sampled_ranges(size: int) -> list[tuple[int, int]]:
    """(offset, length) of every range a node hashes, clipped to the file."""
    wanted = [(0, EDGE_BYTES)] + [(size // (N_SAMPLES + 1) * i, SAMPLE_BYTES) for i in range(1, N_SAMPLES + 1)]
    wanted.append((max(size - EDGE_BYTES, 0), EDGE_BYTES))
    return [(offset, min(length, size - offset)) for offset, length in wanted if offset < size]


def file_fingerprint(path: Path) -> str:
    """blake2b of the size and the ranges nodes sample: fast on 50 GB shards."""
    size = path.stat().st_size
    h = hashlib.blake2b(size.to_bytes(8, "little"), digest_size=16)
    with open(path, "rb") as f:
        for offset, length in sampled_ranges(size):
            f.seek(offset)
            h.update(f.read(length))
    return h.hexdigest()


def model_identity(path: str | Path) -> dict[str, Any]:
    """The model at `path` (every shard of a split set): per file and as a whole.

    {"path", "exists" (all files), "missing", "size", "fingerprint" (of the
    whole set, None unless complete), "files": [{"name", "size",
    "fingerprint"} or {"name", "missing": True}]}
    """
    files = model_files(path)
    per_file: list[dict[str, Any]] = []
    for f in files:
        if f.is_file():
            per_file.append({"name": f.name, "size": f.stat().st_size, "fingerprint": file_fingerprint(f)})
        else:
            per_file.append({"name": f.name, "missing": True})
    missing = [str(f) for f, info in zip(files, per_file) if info.get("missing")]
    whole = None
    if not missing:
        h = hashlib.blake2b(digest_size=16)
        for info in per_file:
            h.update(info["fingerprint"].encode())
        whole = h.hexdigest()
    return {"path": str(path), "exists": not missing, "missing": missing,
            "size": sum(i.get("size", 0) for i in per_file), "fingerprint": whole, "files": per_file}


def _run(argv: list[str], timeout: float = 10) -> tuple[int, str]:
    if shutil.which(argv[0]) is None:
        return 127, f"{argv[0]}: not found"
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 1, str(exc)
    return proc.returncode, (proc.stdout + proc.stderr).strip()


def _interface_of(address: str) -> str | None:
    """The interface (en5, bridge0, ...) that holds `address`, from ifconfig."""
    rc, out = _run(["ifconfig"])
    if rc != 0:
        return None
    current = None
    for line in out.splitlines():
        if line and not line[0].isspace():
            current = line.split(":", 1)[0]
        elif current and re.search(rf"\binet6? {re.escape(address)}\b", line):
            return current
    return None


def _hardware_ports() -> dict[str, str]:
    """device -> hardware port name ("en5" -> "Thunderbolt 3"), from networksetup."""
    rc, out = _run(["networksetup", "-listallhardwareports"])
    ports: dict[str, str] = {}
    name = None
    for line in out.splitlines() if rc == 0 else []:
        if line.startswith("Hardware Port:"):
            name = line.split(":", 1)[1].strip()
        elif line.startswith("Device:") and name:
            ports[line.split(":", 1)[1].strip()] = name
    return ports


def _bridge_members(interface: str) -> list[str]:
    rc, out = _run(["ifconfig", interface])
    return re.findall(r"member: (\S+)", out) if rc == 0 else []


def _ipv4_kept(address: str) -> bool:
    """Not loopback (127/8) and not link-local (169.254/16, self-assigned: no cable of a plan)."""
    return not address.startswith("127.") and not address.startswith("169.254.")


def parse_ip_addr_json(text: str) -> list[dict[str, Any]]:
    """Linux's `ip -j -4 addr show`: [{"interface", "address", "prefix"}] of every IPv4 address kept."""
    out: list[dict[str, Any]] = []
    try:
        links = json.loads(text)
    except ValueError:
        return out
    for link in links if isinstance(links, list) else []:
        for a in link.get("addr_info", []) if isinstance(link, dict) else []:
            if a.get("family") == "inet" and isinstance(a.get("local"), str) and _ipv4_kept(a["local"]) and \
                    isinstance(a.get("prefixlen"), int):
                out.append({"interface": str(link.get("ifname", "?")), "address": a["local"], "prefix": a["prefixlen"]})
    return out


def parse_ifconfig(text: str) -> list[dict[str, Any]]:
    """macOS's `ifconfig`: the same list, from "inet 10.0.12.1 netmask 0xffffff00 ..." under each interface."""
    out: list[dict[str, Any]] = []
    current = None
    for line in text.splitlines():
        if line and not line[0].isspace():
            current = line.split(":", 1)[0]
            continue
        m = re.match(r"\s+inet (\d+\.\d+\.\d+\.\d+) netmask 0x([0-9a-fA-F]{8})\b", line)
        if current and m and _ipv4_kept(m.group(1)):
            out.append({"interface": current, "address": m.group(1), "prefix": bin(int(m.group(2), 16)).count("1")})
    return out


def interface_addresses() -> list[dict[str, Any]]:
    """This machine's IPv4 addresses with their interfaces and prefix lengths (loopback and
    link-local left out): what doctor finds the cables between machines from (tbrpc/cables.py)."""
    if platform.system() == "Darwin":
        rc, out = _run(["ifconfig"])
        return parse_ifconfig(out) if rc == 0 else []
    rc, out = _run(["ip", "-j", "-4", "addr", "show"])
    return parse_ip_addr_json(out) if rc == 0 else []


def macos_facts(host: str | None) -> dict[str, Any]:
    """RDMA, Thunderbolt link of `host`, and the GPU wired-memory limit on this Mac."""
    facts: dict[str, Any] = {}
    rc, out = _run(["rdma_ctl", "status"])
    facts["rdma_ctl"] = {"rc": rc, "output": out[:500]}
    rc, out = _run(["ibv_devices"])
    facts["ibv_devices"] = {"rc": rc, "output": out[:1000]}
    rc, out = _run(["sysctl", "-n", "iogpu.wired_limit_mb"])
    facts["wired_limit_mb"] = int(out) if rc == 0 and out.strip().isdigit() else None
    rc, out = _run(["sysctl", "-n", "hw.memsize"])
    facts["memsize"] = int(out) if rc == 0 and out.strip().isdigit() else None
    ports = _hardware_ports()
    facts["thunderbolt_ports"] = sorted(d for d, n in ports.items() if "thunderbolt" in n.lower())
    if host:
        iface = _interface_of(host)
        link: dict[str, Any] = {"address": host, "interface": iface}
        if iface:
            members = _bridge_members(iface) if iface.startswith("bridge") else []
            names = [ports.get(m, m) for m in members] or [ports.get(iface, iface)]
            link["ports"] = names
            link["thunderbolt"] = any("thunderbolt" in n.lower() for n in names)
            rc, out = _run(["ifconfig", iface])
            link["active"] = "status: active" in out
        facts["link"] = link
    return facts


THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
INFINIBAND = Path("/dev/infiniband")
RDMA_KINDS = {0: "usable", 1: "no_headers", 2: "no_library", 3: "no_device", 4: "open_failed", 5: "port_down",
              6: "no_gid", 7: "qp_budget", 8: "infiniband"}   # enum tb_rdma_verdict (ggml_backend/transport/rdma_report.h)
# Count free QPs up to this many per device: as many as one device of a ring
# (or a head's star of 4) needs, and no more, since the probe holds them for
# the moment it takes and a connection set up in that moment could miss one.
QP_PROBE = 4
GID_TYPES = {0: "untyped", 1: "RoCE v1", 2: "RoCE v2", 3: "IB"}   # enum tb_gid_type (transport/verbs_load.h)


def rdma_facts(qp_probe: int = QP_PROBE) -> dict[str, Any]:
    """The verbs library's view (tb_rdma_report): {"kind", "text", "library", "profile", "host_id",
    "ring_bytes", "devices": [{"name", "kind", "text", "errno", "port", "port_state", "link_layer",
    "active_mtu", "max_qp", "qp_free", "gids", "gid_index", "gid_types", "gid_chosen"}]}: the lists run along
    "gids" (each one's table index, type name, and whether a connection from its address would use it: RoCE v2
    over v1, as rdma.c chooses); kind "unavailable" when tbrpc's C library does not load."""
    try:
        from tbrpc.native import load, text

        ffi, lib = load()
    except Exception as exc:   # noqa: BLE001 - any reason the library cannot load is the answer
        return {"kind": "unavailable", "text": f"tbrpc's C library does not load: {exc}", "devices": []}
    r = ffi.new("struct tb_rdma_report *")
    lib.tb_rdma_report(r, qp_probe)
    devices = [{"name": text(d.name), "kind": RDMA_KINDS[d.kind], "text": text(d.text), "errno": d.error_number,
                "port": d.port, "port_state": d.port_state, "link_layer": d.link_layer, "active_mtu": d.active_mtu,
                "max_qp": d.max_qp, "qp_free": d.qp_free, "gids": [text(d.gids[i]) for i in range(d.n_gids)],
                "gid_index": [d.gid_index[i] for i in range(d.n_gids)],
                "gid_types": [GID_TYPES.get(d.gid_types[i], "untyped") for i in range(d.n_gids)],
                "gid_chosen": [bool(d.gid_chosen[i]) for i in range(d.n_gids)]}
               for d in (r.devices[i] for i in range(r.n_devices))]
    return {"kind": RDMA_KINDS[r.kind], "text": text(r.text), "library": text(r.library), "profile": text(r.profile),
            "host_id": f"{r.host_id:016x}", "ring_bytes": r.ring_bytes, "devices": devices}


def source_address(destination: str) -> str | None:
    """The address this machine sends from toward `destination` (a UDP connect: no packet leaves)."""
    try:
        family = socket.AF_INET6 if ":" in destination else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((destination, 9))
            return str(s.getsockname()[0])
    except OSError:
        return None


def memlock_limit() -> int | None:
    """RLIMIT_MEMLOCK's soft limit in bytes (`ulimit -l`), None when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else soft


def infiniband_facts(root: Path = INFINIBAND) -> dict[str, Any]:
    """The verbs device files: {"exists", "devices": [{"name", "access"}]}; access: read and write for this user."""
    if not root.is_dir():
        return {"exists": False, "devices": []}
    return {"exists": True, "devices": [{"name": p.name, "access": os.access(p, os.R_OK | os.W_OK)}
                                        for p in sorted(root.iterdir()) if p.name.startswith("uverbs")]}


def linux_facts() -> dict[str, Any]:
    """Transparent huge pages: the bracketed mode of THP_ENABLED ("always [madvise] never"), None without THP."""
    try:
        m = re.search(r"\[(\w+)\]", THP_ENABLED.read_text())
    except OSError:
        m = None
    return {"transparent_hugepage": m.group(1) if m else None, "memlock": memlock_limit(),
            "infiniband": infiniband_facts()}


def os_build() -> str | None:
    """macOS's build ("25C56"): RDMA over Thunderbolt needs the same one on every Mac (TN3205)."""
    if platform.system() != "Darwin":
        return None
    rc, out = _run(["sw_vers", "-buildVersion"])
    return out.strip() if rc == 0 else None


def collect(model: str | None = None, host: str | None = None, toward: Sequence[str] = ()) -> dict[str, Any]:
    facts: dict[str, Any] = {
        "os": platform.system(), "release": platform.release(), "machine": platform.machine(),
        "hostname": socket.gethostname(),
        "os_build": os_build(), "python": sys.version.split()[0], "tbrpc": tbrpc_version(),
        "llama_cpp_python": package_version("llama_cpp_python"),
        "rdma": rdma_facts(), "sources": {address: source_address(address) for address in toward},
        "interfaces": interface_addresses(),
    }
    if model:
        facts["model"] = model_identity(model)
    if platform.system() == "Darwin":
        facts["macos"] = macos_facts(host)
    elif platform.system() == "Linux":
        facts["linux"] = linux_facts()
    return facts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tbrpc.facts")
    parser.add_argument("--model")
    parser.add_argument("--host")
    parser.add_argument("--toward", action="append", default=[], help="an address this machine sends to (repeat)")
    args = parser.parse_args(argv)
    print(json.dumps(collect(args.model, args.host, args.toward)))


if __name__ == "__main__":
    main()
