"""What a serving ``tbrpc launch`` shows about itself: ``/tbrpc`` (a page that
updates itself), ``/tbrpc/status.json`` (the figures behind it) and
``/metrics`` (the same figures for Prometheus).

Figures come from what the head already knows, so looking costs the nodes
nothing: each node's connection counters and transport (``tbrpc.client``),
the plan's layers and bytes per node, and the requests this server answered,
timed by a small ASGI middleware (time to first token of a stream, tokens,
tokens per second). With ``--api-key`` these routes want the same key, as a
bearer token or ``?api_key=``.
"""

from __future__ import annotations

import hmac
import json
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

from fastapi import HTTPException, Request as HttpRequest   # the server extra; imported by serve.make_app only
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse

from tbrpc.client import cluster as client_cluster
from tbrpc.outage import ASGIApp, Message, Receive, Scope, Send
from tbrpc.status import connection_records, on_tcp

TIMED_PATHS = ("/v1/completions", "/v1/chat/completions")
RECENT = 20


@dataclass(frozen=True)
class Request:
    path: str
    started: float          # unix time
    seconds: float          # until the last byte of the answer
    first_token_s: float | None   # streams only: until the first token's chunk
    tokens: int             # generated tokens (the answer's usage, or a stream's chunks)
    status: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class RequestLog:
    """The recent requests and running totals; shared by the server's threads.
    `baseline`: each node's (round trips, bytes) once the model in use was
    loaded, and `baseline_tokens` the tokens generated before, so that
    per-token figures are those of this load: they leave out the load and the
    warm-up, and a reload after a node failed (whose connection, and its
    counters, are new) starts them again (`loaded`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.recent: deque[Request] = deque(maxlen=RECENT)
        self.count = 0
        self.tokens = 0
        self.seconds = 0.0
        self.in_flight = 0
        self.baseline: dict[str, tuple[int, int]] = {}
        self.baseline_tokens = 0
        self.loaded()

    def loaded(self) -> None:
        """The model was (re)loaded: per-token figures count from now."""
        with self._lock:
            self.baseline = {i.endpoint: (i.round_trips, i.bytes_sent + i.bytes_received)
                             for i in client_cluster().nodes()}
            self.baseline_tokens = self.tokens

    def begin(self) -> None:
        with self._lock:
            self.in_flight += 1

    def end(self, request: Request) -> None:
        with self._lock:
            self.in_flight -= 1
            self.recent.append(request)
            self.count += 1
            self.tokens += request.tokens
            self.seconds += request.seconds


def _tokens_in(body: bytes, streamed: bool) -> int:
    """Generated tokens of an answer: its usage, or a stream's events that carry text (one per token)."""
    if not streamed:
        try:
            return int(json.loads(body)["usage"]["completion_tokens"])
        except (ValueError, KeyError, TypeError):
            return 0
    count = 0
    for line in body.split(b"\n"):
        if not line.startswith(b"data: {"):
            continue
        try:
            choices = json.loads(line[6:])["choices"]
        except (ValueError, KeyError, TypeError):
            continue
        count += any(c.get("text") or (c.get("delta") or {}).get("content") for c in choices)
    return count


class RequestTimer:
    """ASGI middleware: times the completion routes into a RequestLog."""

    def __init__(self, app: ASGIApp, log: RequestLog) -> None:
        self.app = app
        self.log = log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") not in TIMED_PATHS:
            await self.app(scope, receive, send)
            return
        started, wall = time.monotonic(), time.time()
        state: dict[str, Any] = {"status": 0, "streamed": False, "first": None, "body": bytearray()}

        async def timed_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                state["status"] = int(message["status"])
                headers = dict(message.get("headers") or [])
                state["streamed"] = headers.get(b"content-type", b"").startswith(b"text/event-stream")
            elif message["type"] == "http.response.body":
                chunk = message.get("body", b"")
                if state["streamed"] and state["first"] is None and _tokens_in(chunk, True):
                    state["first"] = time.monotonic() - started
                state["body"] += chunk
            await send(message)

        self.log.begin()
        try:
            await self.app(scope, receive, timed_send)
        finally:
            self.log.end(Request(scope["path"], wall, time.monotonic() - started, state["first"],
                                 _tokens_in(bytes(state["body"]), state["streamed"]), state["status"]))


def snapshot(llm: Any, alias: str, log: RequestLog, waiting: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything the page and /metrics show, as plain data. `waiting`: the failed nodes the
    server waits for (tbrpc/outage.py, Outage.as_json), else None."""
    plan = getattr(llm, "tbrpc_plan", None)
    mine = set(getattr(llm, "tbrpc_endpoints", []))
    planned = {n.device: n for n in plan.nodes} if plan is not None else {}
    shares = ({n.device: plan.part_of(n) for n in plan.nodes}   # tensor and ffn splits: a part of every layer
              if plan is not None and plan.split_mode in ("tensor", "ffn") else {})
    generated = log.tokens - log.baseline_tokens   # since the model in use was loaded
    tokens = max(generated, 1)
    nodes = []
    infos = client_cluster().nodes()
    carriers = connection_records(infos, {i.endpoint: i.node_name for i in infos})
    for info in infos:
        if mine and info.endpoint not in mine:
            continue
        p = planned.get(info.device_name)
        trips0, bytes0 = log.baseline.get(info.endpoint, (0, 0))
        trips, moved = info.round_trips - trips0, info.bytes_sent + info.bytes_received - bytes0
        nodes.append({
            "name": info.node_name, "endpoint": info.endpoint, "device": info.device_name,
            "node_device": info.node_device, "memory_total": info.mem_total,
            "memory_planned": p.total_bytes if p else None,
            "memory_used": info.bytes_allocated,   # this server's buffers on the node
            "layers": list(p.layers) if p and p.layers else None,
            "share": shares.get(info.device_name),
            "transport": info.transport, "links": info.links or None,   # to the next nodes: made at load (tbrpc.Llama)
            "transport_why": info.transport_why or None, "peer_links": [asdict(link) for link in info.peer_links],
            "allreduce": info.allreduce or None,   # a tensor split's: "mesh" or "ring"
            "on_tcp": on_tcp({"name": info.node_name, **carriers[info.endpoint]}),   # each with its kind and fix
            "failed": info.failed, "error": info.error or None,
            "round_trips": info.round_trips, "bytes": info.bytes_sent + info.bytes_received,
            "round_trips_per_token": trips / tokens if generated else None,   # since the model was loaded
            "bytes_per_token": moved / tokens if generated else None,
        })
    recent = [{**asdict(r), "tokens_per_s": r.tokens_per_s} for r in reversed(log.recent)]
    return {
        "model": {"alias": alias, "path": str(getattr(llm, "model_path", "")),
                  "context": plan.ctx if plan is not None else None},
        "nodes": nodes,
        "waiting": waiting,
        "requests": {"count": log.count, "in_flight": log.in_flight, "tokens": log.tokens,
                     "seconds": log.seconds, "recent": recent},
    }


def metrics_text(snap: dict[str, Any]) -> str:
    """Prometheus text exposition of a snapshot."""
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[dict[str, str], float]]) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            label_text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
            lines.append(f"{name}{{{label_text}}} {value}" if label_text else f"{name} {value}")

    def per_node(key: str) -> list[tuple[dict[str, str], float]]:
        return [({"node": n["name"], "endpoint": n["endpoint"]}, float(n[key] or 0)) for n in snap["nodes"]]

    r = snap["requests"]
    metric("tbrpc_requests_total", "counter", "Completion requests answered.", [({}, r["count"])])
    metric("tbrpc_requests_in_flight", "gauge", "Completion requests running or waiting.", [({}, r["in_flight"])])
    metric("tbrpc_generated_tokens_total", "counter", "Tokens generated for requests.", [({}, r["tokens"])])
    metric("tbrpc_request_seconds_total", "counter", "Time spent answering requests.", [({}, r["seconds"])])
    metric("tbrpc_waiting_for_node", "gauge", "1 while the server waits for a failed node (requests get 503).",
           [({}, 0.0 if snap.get("waiting") is None else 1.0)])
    metric("tbrpc_node_up", "gauge", "1 while the head's connection to the node works.",
           [({"node": n["name"], "endpoint": n["endpoint"], "transport": n["transport"]}, 0.0 if n["failed"] else 1.0)
            for n in snap["nodes"]])
    metric("tbrpc_node_memory_total_bytes", "gauge", "The node device's memory.", per_node("memory_total"))
    metric("tbrpc_node_memory_planned_bytes", "gauge", "What the plan puts on the node.", per_node("memory_planned"))
    metric("tbrpc_node_memory_used_bytes", "gauge", "This server's buffers on the node.", per_node("memory_used"))
    metric("tbrpc_node_round_trips_total", "counter", "Requests the head waited on.", per_node("round_trips"))
    metric("tbrpc_node_bytes_total", "counter", "Bytes between the head and the node, both ways.", per_node("bytes"))
    return "\n".join(lines) + "\n"


def _escape(value: Any) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>tbrpc</title>
<style>
 body { font: 14px/1.4 system-ui, sans-serif; margin: 2em; color: #222; }
 table { border-collapse: collapse; margin: 1em 0; } td, th { padding: .3em .8em; border-bottom: 1px solid #ddd; text-align: left; }
 th { background: #f4f4f4; } .down { color: #b00; font-weight: bold; } .num { text-align: right; font-variant-numeric: tabular-nums; }
 #updated { color: #888; } .why { color: #555; font-size: 90%; max-width: 40em; }
</style></head>
<body>
<h1>tbrpc <span id="model"></span></h1>
<p id="waiting" class="down"></p>
<p id="summary"></p>
<table id="nodes"><thead><tr><th>node</th><th>endpoint</th><th>device</th><th>layers</th><th>memory used / planned / total</th>
<th>transport</th><th>round trips / token</th><th>bytes / token</th><th>state</th></tr></thead><tbody></tbody></table>
<h2>Recent requests</h2>
<table id="requests"><thead><tr><th>when</th><th>route</th><th>tokens</th><th>tokens/s</th><th>first token</th><th>status</th></tr></thead><tbody></tbody></table>
<p id="updated"></p>
<script>
const key = new URLSearchParams(location.search).get("api_key");
const size = b => b == null ? "-" : b >= 2**30 ? (b / 2**30).toFixed(1) + " GiB" :
  b >= 2**20 ? (b / 2**20).toFixed(1) + " MiB" : (b / 2**10).toFixed(1) + " KiB";
const num = (x, d) => x == null ? "-" : x.toFixed(d);
function cell(row, text, cls) { const td = row.insertCell(); td.textContent = text; if (cls) td.className = cls; return td; }
function onTcp(td, carriers) {   // a connection or link on TCP: the kind of its reason and the fix (tbrpc status says the same)
  for (const c of carriers || []) {
    const d = document.createElement("div"); d.className = "why";
    d.textContent = c.what + " " + c.from + " -> " + c.to + " on TCP (" + c.why + "): fix: " + c.fix;
    td.appendChild(d);
  }
}
async function refresh() {
  try {
    const r = await fetch("tbrpc/status.json" + (key ? "?api_key=" + encodeURIComponent(key) : ""));
    const s = await r.json();
    document.getElementById("model").textContent = s.model.alias + (s.model.context ? " (context " + s.model.context + ")" : "");
    document.getElementById("waiting").textContent = s.waiting ? "503: " + s.waiting.message : "";
    const q = s.requests;
    document.getElementById("summary").textContent = q.count + " requests, " + q.tokens + " tokens, " +
      (q.seconds > 0 ? (q.tokens / q.seconds).toFixed(1) : "-") + " tokens/s overall, " + q.in_flight + " in flight";
    const nodes = document.querySelector("#nodes tbody"); nodes.replaceChildren();
    for (const n of s.nodes) {
      const row = nodes.insertRow(); row.dataset.node = n.name;
      cell(row, n.name); cell(row, n.endpoint); cell(row, n.device + " (" + n.node_device + ")");
      cell(row, (n.layers ? n.layers[0] + "-" + n.layers[1] : "-") + (n.share ? " (" + n.share + ")" : ""));
      cell(row, size(n.memory_used) + " / " + size(n.memory_planned) + " / " + size(n.memory_total), "num"); onTcp(cell(row, n.transport + (n.links ? "; links: " + n.links : "") + (n.allreduce ? "; all-reduce: " + n.allreduce : "")), n.on_tcp);
      cell(row, num(n.round_trips_per_token, 2), "num"); cell(row, size(n.bytes_per_token), "num");
      cell(row, n.failed ? "DOWN: " + n.error : "up", n.failed ? "down" : "");
    }
    const reqs = document.querySelector("#requests tbody"); reqs.replaceChildren();
    for (const x of q.recent) {
      const row = reqs.insertRow();
      cell(row, new Date(x.started * 1000).toLocaleTimeString()); cell(row, x.path); cell(row, x.tokens, "num");
      cell(row, num(x.tokens_per_s, 1), "num"); cell(row, x.first_token_s == null ? "-" : num(x.first_token_s * 1000, 0) + " ms", "num");
      cell(row, x.status);
    }
    document.getElementById("updated").textContent = "updated " + new Date().toLocaleTimeString();
  } catch (e) { document.getElementById("updated").textContent = "cannot reach the server: " + e; }
}
refresh(); setInterval(refresh, 1000);
</script></body></html>
"""


def install(app: Any, serving: Any, alias: str, api_key: str | None) -> RequestLog:
    """Add the page, its JSON and /metrics to a FastAPI app, and time its completion routes.
    `serving`: a tbrpc.outage.Serving (the model shown, and the node it may wait for)."""
    log = RequestLog()
    serving.on_loaded.append(log.loaded)
    app.add_middleware(RequestTimer, log=log)

    def allowed(request: HttpRequest) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = request.query_params.get("api_key") or (token.strip() if scheme.lower() == "bearer" else "")
        if not hmac.compare_digest(given.encode(), api_key.encode()):
            raise HTTPException(status_code=401, detail="this server wants its --api-key")

    def current() -> dict[str, Any]:
        outage = serving.outage
        return snapshot(serving.shown, alias, log, outage.as_json() if outage else None)

    def page(request: HttpRequest) -> HTMLResponse:
        allowed(request)
        return HTMLResponse(PAGE)

    def status(request: HttpRequest) -> JSONResponse:
        allowed(request)
        return JSONResponse(current())

    def metrics(request: HttpRequest) -> PlainTextResponse:
        allowed(request)
        return PlainTextResponse(metrics_text(current()), media_type="text/plain; version=0.0.4")

    app.add_api_route("/tbrpc", page, methods=["GET"], include_in_schema=False)
    app.add_api_route("/tbrpc/status.json", status, methods=["GET"], include_in_schema=False)
    app.add_api_route("/metrics", metrics, methods=["GET"], include_in_schema=False)
    return log
