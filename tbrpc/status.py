"""``tbrpc status``: the nodes, their memory in use and their clients.

Nodes come from a cluster file, from "host:port" arguments, or from the
launches running on this machine: ``tbrpc launch`` records its nodes in a
small JSON file for as long as it runs (``launch-<pid>.json`` in
``runtime_dir()``), so ``tbrpc status`` alone finds nodes on free ports too.
Once its model is loaded a launch adds what carries each of its connections
and each node-to-node link, and why when it is TCP ("shm 16x256K", "tcp: peer
has no RDMA device", with the reason's kind), and once it serves, where
its ``/tbrpc/status.json`` is: status then shows what the launch's page shows
(layers and planned bytes per node, round trips and bytes per token, the last
error, recent requests' speed), asking the launch, never the nodes.
"""

from __future__ import annotations

import json
import os
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tbrpc import defaults
from tbrpc.client import NodeError, NodeInfo, NodeStatus, probe
from tbrpc.doctor import record_carriers, transport_fix
from tbrpc.units import format_size


@dataclass(frozen=True)
class Target:
    """A node to ask about, and what a running launch on this machine knows of it."""
    name: str
    endpoint: str
    launch: str = ""      # "launch <pid> (<model>)" when a running launch uses it
    transport: str = ""   # that launch's connection to it
    transport_why: str = ""   # the kind of its reason when on TCP (tbrpc.client.WHY_NAMES)
    links: tuple[dict[str, Any], ...] = ()   # that launch's links from it (connection_records)
    served: dict[str, Any] | None = None   # that launch's page's record of the node (dashboard.snapshot)
    secret_file: str | None = None         # the secret that launch proves to it (None: this process's)
    allreduce: str = ""   # that launch's tensor-split all-reduce over it: "mesh" or "ring"


@dataclass(frozen=True)
class Row:
    target: Target
    info: NodeInfo | None
    status: NodeStatus | None
    error: str = ""


def runtime_dir() -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return Path(base) / f"tbrpc-{os.getuid()}"


@contextmanager
def launch_record(model: str, names: Sequence[str], endpoints: Sequence[str],
                  secret_files: Sequence[str | None] = ()) -> Iterator[Path]:
    """Record a running launch (its nodes, and the secret file it proves to each) until the block ends.
    The file is the user's alone (it may come to hold the launch's --api-key)."""
    directory = runtime_dir()
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = directory / f"launch-{os.getpid()}.json"
    secrets = list(secret_files) or [None] * len(names)
    _write_record(path, {"pid": os.getpid(), "model": model,
                         "nodes": [{"name": n, "endpoint": e, "secret_file": k}
                                   for n, e, k in zip(names, endpoints, secrets)]})
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)


def _write_record(path: Path, data: dict[str, Any]) -> None:
    partial = path.with_suffix(".partial")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    partial.replace(path)


def connection_records(infos: Sequence[NodeInfo], names: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Per endpoint: what carries the head's connection to it and its links to other nodes (`names`:
    endpoint -> node name), each with the kind of its reason when it is TCP or missing ("why")."""
    return {info.endpoint: {
        "transport": info.transport, "transport_why": info.transport_why, "allreduce": info.allreduce,
        "links": [{"to": names.get(link.to, link.to), "endpoint": link.to, "usable": link.usable,
                   "transport": link.transport, "why": link.why} for link in info.peer_links],
    } for info in infos}


def note_connections(record: Path, infos: Sequence[NodeInfo]) -> None:
    """Add to a launch record what carries each of the launch's connections and links, and why."""
    data = json.loads(record.read_text())
    found = connection_records(infos, {n["endpoint"]: n["name"] for n in data["nodes"]})
    for node in data["nodes"]:
        node.update(found.get(node["endpoint"], {"transport": "", "transport_why": "", "allreduce": "", "links": []}))
    _write_record(record, data)


def connection_lines(nodes: Sequence[dict[str, Any]], fixes: bool = False) -> list[str]:
    """One line per connection (head to node) and per link (node to node) of launch record `nodes`:
    "connection head -> a: shm 16x256K", "link a -> b: tcp: asked for", then a tensor split's
    all-reduce ("all-reduce: ring over a -> b -> c -> a"); with `fixes`, only those on TCP or
    missing, each followed by the fix a user types (tbrpc.doctor.transport_fix)."""
    lines = []
    for node in nodes:
        if fixes:
            for c in on_tcp(node):
                lines += [f"{c['what']} {c['from']} -> {c['to']}: {c['transport'] or '?'}", f"  fix: {c['fix']}"]
        else:
            lines += [f"{what} {source} -> {target}: {transport or '?'}"
                      for source, target, transport, _, what in record_carriers(node)]
    if not fixes:   # a tensor split's: a link per pair, or the ring in node order; one line per group of
        for group in _allreduce_groups(nodes):   # nodes linked together (the hybrid has one per group)
            names, mode = [n["name"] for n in group], group[0]["allreduce"]
            lines.append(f"all-reduce: {mode} over " + (" -> ".join([*names, names[0]]) if mode == "ring"
                                                        else ", ".join(names)))
    return lines


def _allreduce_groups(nodes: Sequence[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The nodes of a record that all-reduce, grouped with the nodes they link to, transitively (the
    hybrid's groups are not linked to each other), in node order; one group when none has links."""
    reducing = [n for n in nodes if n.get("allreduce")]
    label = {n["name"]: i for i, n in enumerate(reducing)}   # each node's group: the lowest index in it
    if not any(n.get("links") for n in reducing):
        label = dict.fromkeys(label, 0)
    changed = True
    while changed:
        changed = False
        for n in reducing:
            for to in (link["to"] for link in n.get("links", []) if link["to"] in label):
                low = min(label[n["name"]], label[to])
                for name in (n["name"], to):
                    changed |= label[name] != low
                    label[name] = low
    groups: dict[int, list[dict[str, Any]]] = {}
    for n in reducing:
        groups.setdefault(label[n["name"]], []).append(n)
    return list(groups.values())


def on_tcp(node: dict[str, Any]) -> list[dict[str, str]]:
    """The head's connection to launch record `node` and its links that are on TCP or missing: each
    with what carries it, the kind of its reason (`why`) and the fix a user types (`fix`,
    tbrpc.doctor.transport_fix), as `tbrpc status` and the /tbrpc page show them."""
    return [{"what": what, "from": source, "to": target, "transport": transport, "why": why,
             "fix": transport_fix(why, source, target)}
            for source, target, transport, why, what in record_carriers(node) if why]


def note_serving(record: Path, url: str, api_key: str | None) -> None:
    """Add to a launch record where its HTTP server answers (and the key it wants)."""
    data = json.loads(record.read_text())
    data.update(http=url, api_key=api_key)
    _write_record(record, data)


def served_snapshot(launch: dict[str, Any], timeout: float) -> dict[str, Any] | None:
    """What a serving launch's /tbrpc/status.json says, or None (not serving, or no answer)."""
    if not launch.get("http"):
        return None
    request = urllib.request.Request(launch["http"] + "/tbrpc/status.json")
    if launch.get("api_key"):
        request.add_header("Authorization", f"Bearer {launch['api_key']}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            snap: dict[str, Any] = json.loads(answer.read())
            return snap
    except (OSError, ValueError, urllib.error.URLError):
        return None


def running_launches() -> list[dict[str, Any]]:
    """Records of launches still running on this machine (stale ones are removed)."""
    found = []
    for path in sorted(runtime_dir().glob("launch-*.json")):
        try:
            record = json.loads(path.read_text())
            os.kill(int(record["pid"]), 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
            continue
        except (OSError, ValueError, KeyError):
            continue
        found.append(record)
    return found


def targets(listed: Sequence[tuple[str, str]], with_launches: bool, timeout: float = defaults.CHECK_TIMEOUT_S) -> list[Target]:
    """The (name, endpoint) nodes listed, then (if asked) the running launches'
    other nodes; a listed node that a launch uses carries that launch's facts."""
    found = [Target(name, endpoint) for name, endpoint in listed]
    if not with_launches:
        return found
    for launch in running_launches():
        tag = f"launch {launch['pid']} ({launch['model']})"
        snap = served_snapshot(launch, timeout)
        served = {n["endpoint"]: n for n in snap["nodes"]} if snap else {}
        for node in launch["nodes"]:
            known = next((i for i, t in enumerate(found) if t.endpoint == node["endpoint"]), None)
            target = Target(found[known].name if known is not None else node["name"], node["endpoint"], tag,
                            node.get("transport", ""), node.get("transport_why", ""), tuple(node.get("links", [])),
                            served.get(node["endpoint"]), node.get("secret_file"), node.get("allreduce", ""))
            if known is None:
                found.append(target)
            elif not found[known].launch:
                found[known] = target
    return found


def serving(timeout: float = defaults.CHECK_TIMEOUT_S) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(launch record, its page's snapshot) of each launch here that serves HTTP and answers."""
    found = []
    for launch in running_launches():
        snap = served_snapshot(launch, timeout)
        if snap is not None:
            found.append((launch, snap))
    return found


def query(nodes: Sequence[Target], timeout: float = defaults.CHECK_TIMEOUT_S) -> list[Row]:
    """Probe each node; failures become rows with the error."""
    rows = []
    for target in nodes:
        try:
            info, status = probe(target.endpoint, timeout=timeout, secret_file=target.secret_file)
            rows.append(Row(target, info, status))
        except NodeError as exc:
            rows.append(Row(target, None, None, str(exc)))
    return rows


def _per_token(served: dict[str, Any] | None) -> str:
    if not served or served.get("round_trips_per_token") is None:
        return "-"
    return f"{served['round_trips_per_token']:.2f} trips, {format_size(int(served['bytes_per_token']))}"


def _layers(served: dict[str, Any] | None) -> str:
    layers, share = (served or {}).get("layers"), (served or {}).get("share")
    return (f"{layers[0]}-{layers[-1]}" if layers else "-") + (f" ({share})" if share else "")


def _carriers(t: Target) -> str:
    """What carries the launch's connection to the node, and its links to other nodes."""
    served = t.served or {}
    links = "; ".join(f"-> {link['to']} {link['transport']}" for link in t.links)
    return (served.get("transport") or t.transport or "-") + (f"; links: {links}" if links else "") + \
        (f"; all-reduce: {t.allreduce}" if t.allreduce else "")


def format_rows(rows: Sequence[Row]) -> str:
    header = ("node", "endpoint", "device", "layers", "in use", "planned", "from files", "buffers", "clients", "graphs",
              "free/total", "transport", "per token", "")
    table = [header]
    for r in rows:
        t = r.target
        served = t.served or {}
        planned = format_size(served["memory_planned"]) if served.get("memory_planned") else "-"
        if r.status is None or r.info is None:
            table.append((t.name, t.endpoint, "-", _layers(t.served), "-", planned, "-", "-", "-", "-", "-", "-", "-",
                          f"DOWN: {r.error}"))
            continue
        s = r.status
        note = t.launch + (f"; its last error: {served['error']}" if served.get("error") else "")
        table.append((t.name, t.endpoint, s.device, _layers(t.served), format_size(s.bytes_allocated), planned,
                      format_size(s.bytes_from_files), str(s.buffers), str(s.clients), str(s.graphs_computed),
                      f"{format_size(s.mem_free)}/{format_size(s.mem_total)}", _carriers(t), _per_token(t.served),
                      note))
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table)


def format_tcp(rows: Sequence[Row]) -> str:
    """The launches' connections and links that are on TCP (or missing), each with why and the fix."""
    by_launch: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        t = r.target
        if t.launch:
            by_launch.setdefault(t.launch, []).append({"name": t.name, "transport": t.transport,
                                                       "transport_why": t.transport_why, "links": list(t.links)})
    out = []
    for launch, nodes in by_launch.items():
        lines = connection_lines(nodes, fixes=True)
        if lines:
            out.append(f"{launch}: on TCP, and why")
            out.extend("  " + line for line in lines)
    return "\n".join(out)


def format_serving(launches: Sequence[tuple[dict[str, Any], dict[str, Any]]]) -> str:
    """One paragraph per serving launch: model, context, requests and their speed."""
    lines = []
    for launch, snap in launches:
        model, q = snap["model"], snap["requests"]
        lines.append(f"launch {launch['pid']}: {model['alias']} (context {model['context'] or '?'}) at {launch['http']}/v1; "
                     f"{q['count']} request(s), {q['in_flight']} running or waiting, {q['tokens']} token(s)")
        if snap.get("waiting"):   # a node failed: requests get 503 until it is back and the model reloaded
            lines.append(f"  503 to every request: {snap['waiting']['message']}")
        for x in q["recent"][:5]:
            first = f", first token {x['first_token_s'] * 1000:.0f} ms" if x.get("first_token_s") is not None else ""
            lines.append(f"  {x['path']}: {x['tokens']} token(s), {x['tokens_per_s']:.1f} tok/s{first}, HTTP {x['status']}")
    return "\n".join(lines)


def rows_json(rows: Sequence[Row], launches: Sequence[tuple[dict[str, Any], dict[str, Any]]] = ()) -> dict[str, Any]:
    """What `tbrpc status --json` prints: the nodes (sizes in bytes; a node that
    did not answer with "up": false and its error; "served": what the launch
    using it shows on its page) and the serving launches' models and requests."""
    out = []
    for r in rows:
        row: dict[str, Any] = {"name": r.target.name, "endpoint": r.target.endpoint, "up": r.status is not None,
                               "launch": r.target.launch or None, "transport": r.target.transport or None,
                               "transport_why": r.target.transport_why or None, "links": list(r.target.links),
                               "allreduce": r.target.allreduce or None, "served": r.target.served}
        if r.status is not None and r.info is not None:
            row.update(node_name=r.info.node_name, description=r.info.description, **asdict(r.status))
        else:
            row["error"] = r.error
        out.append(row)
    return {"nodes": out,
            "launches": [{"pid": launch["pid"], "http": launch["http"], "model": snap["model"],
                          "requests": snap["requests"], "waiting": snap.get("waiting")} for launch, snap in launches]}
