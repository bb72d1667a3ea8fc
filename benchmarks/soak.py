"""Soak driver: serve a small model with `tbrpc launch` for thousands of varied requests and watch
for leaks and slow degradation (not a pass/fail test).

    .venv/bin/python benchmarks/soak.py --model llama --requests 2000
    .venv/bin/python benchmarks/soak.py --model gemma --split ffn --requests 1000 --kill-every 400

Requests: completions and chat, streaming and not, prompts of 1 to a few hundred tokens, varied
max_tokens, clients that hang up mid-stream, `--concurrency` clients at once, and every
`--kill-every` requests a node SIGKILLed (launch restarts it and reloads the model).

Every `--sample-every` requests (at a quiet moment: no request in flight) it samples RSS, fds,
threads, sockets (and CLOSE_WAIT ones), /dev/shm mappings of the launch process, of every node
and of their per-client workers; zombies; /dev/shm entries and temp files; each node's buffers,
bytes and graphs (STATUS). At the end: growth per 1000 requests after the warm-up (least squares),
and latency p50/p99 per 500 requests.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WORDS = ("the cat sat on a mat while river stone light green paris france capital city of "
         "under over bright number seven blue house mountain quickly runs slow tree").split()
TCP_STATES = {"01": "ESTABLISHED", "06": "TIME_WAIT", "08": "CLOSE_WAIT", "0A": "LISTEN"}


# ---- processes -------------------------------------------------------------------------------

def children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            kids.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return kids


def descendants(pid: int, kids: dict[int, list[int]]) -> list[int]:
    out, todo = [], list(kids.get(pid, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def proc_state(pid: int) -> str:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("State:"):
                return line.split()[1]
    except OSError:
        pass
    return "?"


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def socket_states() -> dict[int, str]:
    states: dict[int, str] = {}
    for name in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            states[int(f[9])] = TCP_STATES.get(f[3], f[3])
    return states


@dataclass
class ProcSample:
    rss_kb: int = 0
    fds: int = 0
    threads: int = 0
    sockets: int = 0
    close_wait: int = 0
    shm_maps: int = 0
    count: int = 0

    def add(self, other: "ProcSample") -> None:
        for k in vars(self):
            setattr(self, k, getattr(self, k) + getattr(other, k))


def sample_proc(pid: int, tcp: dict[int, str]) -> ProcSample:
    s = ProcSample(count=1)
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                s.rss_kb = int(line.split()[1])
            elif line.startswith("Threads:"):
                s.threads = int(line.split()[1])
        for fd in os.listdir(f"/proc/{pid}/fd"):
            s.fds += 1
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                s.sockets += 1
                if tcp.get(int(target[8:-1])) == "CLOSE_WAIT":
                    s.close_wait += 1
        maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
        s.shm_maps = len({ln.split(None, 5)[-1] for ln in maps if "/dev/shm/" in ln or "memfd:" in ln})
    except OSError:
        pass
    return s


# ---- the launch ------------------------------------------------------------------------------

@dataclass
class Soak:
    args: argparse.Namespace
    proc: subprocess.Popen[bytes] | None = None
    port: int = 0
    log_dir: Path = Path()
    shm_before: set[str] = field(default_factory=set)
    tmp_dir: Path = Path()
    latencies: list[tuple[int, float, str]] = field(default_factory=list)   # (request index, seconds, kind)
    outcomes: dict[str, int] = field(default_factory=dict)
    samples: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    kills: int = 0

    def start(self) -> None:
        a = self.args
        self.log_dir = Path(tempfile.mkdtemp(prefix="soak-logs-"))
        self.shm_before = set(os.listdir("/dev/shm"))
        self.tmp_dir = Path(tempfile.mkdtemp(prefix="soak-tmp-"))   # launch's TMPDIR: its temp files, and only its
        model = a.model if a.model.endswith(".gguf") else subprocess.run(
            [sys.executable, "-m", "models", a.model], cwd=ROOT, check=True, capture_output=True, text=True
        ).stdout.strip().splitlines()[-1]
        cmd = [sys.executable, "-m", "tbrpc.cli", "launch", "--gguf", model, "--local", str(a.nodes), "--port", "0",
               "--log-dir", str(self.log_dir), "--ctx", str(a.ctx), "--split", a.split]
        if a.chat_format:
            cmd += ["--chat-format", a.chat_format]
        cmd += a.launch_arg
        self.err_path = self.log_dir / "launch.err"
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(self.err_path, "w"), cwd=self.tmp_dir,
                                     env={**os.environ, "TMPDIR": str(self.tmp_dir)})
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            text = self.err_path.read_text(errors="replace")
            if "serving OpenAI-compatible API on http://" in text:
                url = text.split("serving OpenAI-compatible API on http://", 1)[1].split("/", 1)[0]
                self.port = int(url.rsplit(":", 1)[1])
                return
            if self.proc.poll() is not None:
                raise SystemExit(f"launch exited:\n{text}")
            time.sleep(0.2)
        raise SystemExit("launch did not serve in 180 s")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    # ---- requests ----------------------------------------------------------------------------

    def request(self, i: int, rng: random.Random) -> None:
        words = rng.choice((1, 2, 5, 10, 30, 60, 120, 250))
        text = " ".join(rng.choice(WORDS) for _ in range(max(1, int(words * rng.uniform(0.5, 1.2)))))
        chat = rng.random() < 0.35
        stream = rng.random() < 0.5
        hangup = stream and rng.random() < 0.25
        body: dict[str, Any] = {"max_tokens": rng.choice((1, 4, 8, 16, 32)), "temperature": rng.choice((0, 0.8)),
                                "stream": stream}
        if chat:
            path = "/v1/chat/completions"
            body["messages"] = [{"role": "user", "content": text}]
        else:
            path = "/v1/completions"
            body["prompt"] = text
        kind = ("chat" if chat else "compl") + ("-stream" if stream else "") + ("-hangup" if hangup else "")
        t0 = time.monotonic()
        outcome = "ok"
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        try:
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                resp.read()
                outcome = f"http{resp.status}"
            elif hangup:
                resp.readline()                # the first event, then hang up
                conn.sock.close() if conn.sock else None
                outcome = "hangup"
            else:
                data = resp.read()
                if stream and b"[DONE]" not in data:
                    outcome = "stream-cut"
        except Exception as e:   # noqa: BLE001 - counted, the soak goes on
            outcome = type(e).__name__
        finally:
            conn.close()
        dt = time.monotonic() - t0
        with self.lock:
            self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
            if outcome == "ok":
                self.latencies.append((i, dt, kind))

    def wait_serving(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                st = self.status_json()
                if st.get("waiting") is None and not any(n.get("failed") for n in st["nodes"]):
                    return
            except Exception:   # noqa: BLE001
                pass
            if self.proc and self.proc.poll() is not None:
                raise SystemExit(f"launch exited with {self.proc.returncode} while the model came back; "
                                 f"its stderr: {self.err_path}")
            time.sleep(0.3)
        raise SystemExit("the model did not come back")

    def status_json(self) -> dict[str, Any]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request("GET", "/tbrpc/status.json")
            return json.loads(conn.getresponse().read())
        finally:
            conn.close()

    def node_pids(self) -> dict[str, int]:
        assert self.proc
        kids = children_map()
        out = {}
        for p in kids.get(self.proc.pid, []):
            c = cmdline(p)
            if "tbrpc._supervised" in c and "--name" in c:
                out[c[c.index("--name") + 1]] = p
        return out

    def kill_node(self, rng: random.Random) -> None:
        nodes = self.node_pids()
        name = rng.choice(sorted(nodes))
        os.kill(nodes[name], signal.SIGKILL)
        self.kills += 1
        print(f"  killed {name} (pid {nodes[name]})", flush=True)
        time.sleep(1.0)
        self.wait_serving()

    # ---- sampling ----------------------------------------------------------------------------

    def sample(self, done: int) -> dict[str, float]:
        from tbrpc.client import probe
        assert self.proc
        tcp = socket_states()
        kids = children_map()
        m: dict[str, float] = {}

        def put(prefix: str, s: ProcSample) -> None:
            for k, v in vars(s).items():
                m[f"{prefix}.{k}"] = v

        put("launch", sample_proc(self.proc.pid, tcp))
        tree = [self.proc.pid] + descendants(self.proc.pid, kids)
        m["zombies"] = sum(proc_state(p) == "Z" for p in tree)
        m["processes"] = len(tree)
        nodes = self.node_pids()
        secret = next(iter(self.log_dir.glob("secret-*")), None)
        st = self.status_json()
        endpoints = {n["name"]: n["endpoint"] for n in st["nodes"]}
        for name, pid in sorted(nodes.items()):
            put(f"{name}", sample_proc(pid, tcp))
            w = ProcSample()
            for child in descendants(pid, kids):
                w.add(sample_proc(child, tcp))
            put(f"{name}.workers", w)
            try:
                _, ns = probe(endpoints[name], timeout=10, secret_file=str(secret) if secret else None)
                m[f"{name}.status.buffers"] = ns.buffers
                m[f"{name}.status.bytes_allocated"] = ns.bytes_allocated
                m[f"{name}.status.clients"] = ns.clients
            except Exception as e:   # noqa: BLE001
                print(f"  probe {name}: {e}", flush=True)
        shm_now = set(os.listdir("/dev/shm"))
        m["dev_shm.new_entries"] = len(shm_now - self.shm_before)
        m["tmp.new_entries"] = sum(1 for _ in self.tmp_dir.rglob("*"))
        m["log_dir.files"] = sum(1 for _ in self.log_dir.rglob("*"))
        m["launch.in_flight"] = st["requests"]["in_flight"]
        self.samples.append((done, m))
        return m

    # ---- report ------------------------------------------------------------------------------

    def report(self) -> None:
        warm = [(n, m) for n, m in self.samples if n >= self.args.warmup]
        print(f"\n== growth per 1000 requests after {self.args.warmup} (least squares over {len(warm)} samples) ==")
        if len(warm) >= 2:
            keys = sorted(set().union(*(m.keys() for _, m in warm)))
            for k in keys:
                pts = [(n, m[k]) for n, m in warm if k in m]
                if len(pts) < 2:
                    continue
                xs, ys = [p[0] for p in pts], [p[1] for p in pts]
                mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
                den = sum((x - mx) ** 2 for x in xs) or 1
                slope = sum((x - mx) * (y - my) for x, y in pts) / den * 1000
                print(f"  {k:40s} first {ys[0]:>12.0f} last {ys[-1]:>12.0f}  per 1000: {slope:+10.1f}")
        print("\n== latency of ok requests per 500 (p50 / p99, seconds) ==")
        lat = sorted(self.latencies)
        for start in range(0, self.args.requests, 500):
            xs = sorted(d for i, d, _ in lat if start <= i < start + 500)
            if xs:
                print(f"  {start:5d}-{start + 499:5d}: n={len(xs):4d} p50 {xs[len(xs) // 2]:.3f}  "
                      f"p99 {xs[min(len(xs) - 1, int(len(xs) * 0.99))]:.3f}")
        print(f"\noutcomes: {self.outcomes}; node kills: {self.kills}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama", help="llama | deepseek2 | gemma | a .gguf path")
    ap.add_argument("--split", default="layer", choices=("layer", "tensor", "ffn"))
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--chat-format", default=None)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--sample-every", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--kill-every", type=int, default=0, help="SIGKILL a node every N requests (0: never)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--launch-arg", action="append", default=[], help="passed on to tbrpc launch (repeat)")
    ap.add_argument("--json-out", default=None, help="write the samples here")
    a = ap.parse_args()
    if a.model == "gemma" and not a.chat_format:
        a.chat_format = "gemma"
    rng = random.Random(a.seed)
    soak = Soak(a)
    soak.start()
    print(f"launch pid {soak.proc.pid if soak.proc else 0} on port {soak.port}; logs {soak.log_dir}", flush=True)
    t0 = time.monotonic()
    try:
        soak.sample(0)
        done = 0
        with ThreadPoolExecutor(a.concurrency) as pool:
            while done < a.requests:
                n = min(a.sample_every, a.requests - done)
                seeds = [rng.random() for _ in range(n)]
                list(pool.map(lambda j: soak.request(done + j, random.Random(seeds[j])), range(n)))
                done += n
                if a.kill_every and done % a.kill_every == 0 and done < a.requests:
                    soak.kill_node(rng)
                time.sleep(0.5)   # let hung-up streams and workers settle
                m = soak.sample(done)
                print(f"{done:6d} req {time.monotonic() - t0:6.0f} s  launch rss {m['launch.rss_kb'] / 1024:.1f} MiB "
                      f"fds {m['launch.fds']:.0f} thr {m['launch.threads']:.0f} sock {m['launch.sockets']:.0f} "
                      f"cw {m['launch.close_wait']:.0f} shm {m['launch.shm_maps']:.0f} | procs {m['processes']:.0f} "
                      f"zombies {m['zombies']:.0f} /dev/shm+{m['dev_shm.new_entries']:.0f} "
                      f"tmp+{m['tmp.new_entries']:.0f} | " + " ".join(
                          f"{k.split('.')[0]}: fds {m[k]:.0f} thr {m[k.replace('fds', 'threads')]:.0f} "
                          f"w {m.get(k.replace('.fds', '.workers.count'), 0):.0f} "
                          f"buf {m.get(k.replace('.fds', '.status.buffers'), -1):.0f}"
                          for k in sorted(m) if k.startswith("local") and k.count(".") == 1 and k.endswith(".fds")),
                      flush=True)
    finally:
        soak.report()
        if a.json_out:
            Path(a.json_out).write_text(json.dumps({"samples": soak.samples, "latencies": soak.latencies,
                                                    "outcomes": soak.outcomes}))
        soak.stop()
        print(f"logs: {soak.log_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
