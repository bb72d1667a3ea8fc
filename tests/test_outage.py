"""A serving `tbrpc launch` through a node's failure (tbrpc/outage.py): real nodes, kill -9.

While a node is gone every request for the model gets 503 naming it, at
once (never a hang); the page, its JSON and `tbrpc status` say what the
server waits for; when the node answers again (restarted by hand, or by
launch for a node it started) the model reloads and answers with the tokens
of one plain process.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from functools import cache
from pathlib import Path
from typing import Any

import pytest

import models
from tbrpc.gguf_model import load_gguf
from helpers import (
    ENV, PROMPT, Launch, assert_gone, baseline, http_json, http_stream, start_launch, start_node, stop_nodes,
    with_descendants,
)

N_TOKENS = 12
BODY = {"prompt": PROMPT, "max_tokens": N_TOKENS, "temperature": 0, "repeat_penalty": 1.0}
OUTAGE_ANSWER_S = 10.0   # a generous bound for "at once": a hang would be the request timeout


@cache
def expected_text() -> str:
    return str(baseline(models.ensure("llama"), PROMPT, N_TOKENS)["text"])


def refused(url: str, body: dict[str, Any] | None) -> tuple[int, dict[str, str], dict[str, Any], float]:
    """(status, headers, JSON body, seconds) of a request the server refuses."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    started = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            raise AssertionError(f"{url} answered {answer.status}: {answer.read()[:300]!r}")
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}, json.loads(exc.read()), time.monotonic() - started


def completion(base: str) -> str:
    return str(http_json(f"{base}/completions", BODY)["choices"][0]["text"])


def status_text(tmp_path: Path, env: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, "-m", "tbrpc.cli", "status"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    return done.stdout


def stop(launch: Launch) -> None:
    launch.proc.send_signal(signal.SIGINT)
    assert launch.finish() == 0, launch.stderr


def test_waits_for_a_node_started_by_hand_then_reloads(tmp_path: Path) -> None:
    want = expected_text()
    first, second = start_node(tmp_path), start_node(tmp_path)
    started = [first, second]
    cluster = tmp_path / "two.toml"
    cluster.write_text("".join(f'[[node]]\nname = "n{i}"\nhost = "127.0.0.1"\nport = {n.port}\nstart = "manual"\n\n'
                               for i, n in enumerate(started)))
    env = {**ENV, "XDG_RUNTIME_DIR": str(tmp_path / "run")}
    try:
        with start_launch(tmp_path, "--gguf", str(models.ensure("llama")), "--cluster", str(cluster), "--ctx", "256",
                          "--port", "0", env=env) as launch:
            base = launch.http_base()
            root = base.removesuffix("/v1")
            assert completion(base) == want

            second.proc.kill()   # kill -9; the head learns of it from the next request: one in flight, whose 500 becomes the 503
            second.proc.wait()
            for body, path in ((BODY, "completions"), ({**BODY, "stream": True}, "completions"),
                               ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}, "chat/completions")):
                code, headers, answer, seconds = refused(f"{base}/{path}", body)
                assert code == 503 and seconds < OUTAGE_ANSWER_S, (code, seconds, answer)
                assert answer["error"]["type"] == "node_unavailable", answer
                assert f"node n1 (127.0.0.1:{second.port})" in answer["error"]["message"], answer
                assert "waiting for it" in answer["error"]["message"], answer
                assert headers.get("retry-after") == "5", headers
            launch.wait_for(r"node n1 \(127\.0\.0\.1:\d+\) failed: .*requests get 503 meanwhile")
            launch.wait_for(r"model freed")
            assert [m["id"] for m in http_json(f"{base}/models")["data"]]   # what needs no model still answers
            page = http_json(f"{root}/tbrpc/status.json")
            assert page["waiting"]["nodes"] == [f"n1 (127.0.0.1:{second.port})"], page["waiting"]
            assert page["waiting"]["state"] == "waiting" and page["waiting"]["probes"] >= 1, page["waiting"]
            assert "tbrpc_waiting_for_node 1.0" in urllib.request.urlopen(f"{root}/metrics", timeout=30).read().decode()
            shown = status_text(tmp_path, env)
            assert f"503 to every request: node n1 (127.0.0.1:{second.port}) failed" in shown, shown

            again = start_node(tmp_path, "--port", str(second.port))   # the node returns on its endpoint
            started.append(again)
            launch.wait_for(r"node n1 \(127\.0\.0\.1:\d+\): answers again; reconnecting and reloading")
            launch.wait_for(r"model reloaded in [\d.]+ s; serving again")
            assert completion(base) == want
            chunks = http_stream(f"{base}/completions", {**BODY, "stream": True})
            assert "".join(c["choices"][0]["text"] for c in chunks) == want
            assert http_json(f"{root}/tbrpc/status.json")["waiting"] is None
            assert "503 to every request" not in status_text(tmp_path, env)
            stop(launch)
    finally:
        stop_nodes([n for n in started if n.proc.poll() is None])


def test_a_request_failed_by_a_node_logs_one_line(tmp_path: Path) -> None:
    """The request that meets the dead node gets the 503; the log says which node and why in one line,
    without llama-cpp-python's traceback (that is for errors nobody handles)."""
    first, second = start_node(tmp_path), start_node(tmp_path)
    cluster = tmp_path / "two.toml"
    cluster.write_text("".join(f'[[node]]\nname = "n{i}"\nhost = "127.0.0.1"\nport = {n.port}\nstart = "manual"\n\n'
                               for i, n in enumerate((first, second))))
    env = {**ENV, "XDG_RUNTIME_DIR": str(tmp_path / "run")}
    try:
        with start_launch(tmp_path, "--gguf", str(models.ensure("llama")), "--cluster", str(cluster), "--ctx", "256",
                          "--port", "0", env=env) as launch:
            base = launch.http_base()
            completion(base)
            second.proc.kill()
            second.proc.wait()
            assert refused(f"{base}/completions", BODY)[0] == 503
            launch.wait_for(r"model freed")
            failed = [line for line in launch.err_lines if "request failed" in line]
            assert len(failed) == 1 and failed[0].startswith(f"tbrpc: a request failed: node n1 (127.0.0.1:{second.port})"), \
                launch.stderr
            assert "Traceback" not in launch.stderr and "Exception:" not in launch.stderr, launch.stderr
            stop(launch)
    finally:
        stop_nodes([n for n in (first, second) if n.proc.poll() is None])


def test_restarts_a_node_it_started(tmp_path: Path) -> None:
    want = expected_text()
    with start_launch(tmp_path, "--gguf", str(models.ensure("llama")), "--local", "2", "--ctx", "256",
                      "--port", "0") as launch:
        base = launch.http_base()
        assert completion(base) == want
        before = launch.node_pids()
        old_tree = with_descendants([before[1]])
        os.kill(before[1], signal.SIGKILL)
        launch.wait_for(r"node local1 \(127\.0\.0\.1:\d+\): restarting it \(its process was killed by SIGKILL "
                        r"\(the kernel's out-of-memory killer, or kill -9\)\)")
        launch.wait_for(r"model reloaded in [\d.]+ s; serving again")
        assert_gone(old_tree)
        after = launch.node_pids()
        assert after[0] == before[0] and after[1] != before[1], (before, after)
        assert (launch.log_dir / "local1.log.1").exists()   # the dead node's log, kept
        assert completion(base) == want
        pids = with_descendants(after)
        stop(launch)
        assert_gone(pids)


def open_descriptors(pid: int) -> list[str]:
    """What each open descriptor of process `pid` is (a file's path, pipe:[...], socket:[...])."""
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except FileNotFoundError:   # closed meanwhile
            continue
    return sorted(out)


def settled_descriptors(pid: int, timeout: float = 10.0) -> list[str]:
    """open_descriptors once two reads 0.2 s apart agree: the server's end of the request just
    answered closes a moment after the client has its answer."""
    deadline = time.monotonic() + timeout
    last = open_descriptors(pid)
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = open_descriptors(pid)
        if now == last:
            return now
        last = now
    return last


def test_reloads_leave_no_descriptor_behind(tmp_path: Path) -> None:
    """A launch serving for days reloads at every node failure: K reloads (a node killed, a request
    served after each) leave the launch process with the descriptors it had after the first load.
    Each load's progress bar made a copy of stderr and left it to the model's garbage collection;
    the model served waited for the cyclic collector (wrappers holding it), so the copies (and the
    models) piled up, one per reload (benchmarks/soak.py)."""
    with start_launch(tmp_path, "--gguf", str(models.ensure("llama")), "--local", "2", "--ctx", "256",
                      "--port", "0") as launch:
        base = launch.http_base()
        completion(base)
        before = settled_descriptors(launch.proc.pid)
        reloads = 4
        for k in range(reloads):
            os.kill(launch.node_pids()[k % 2], signal.SIGKILL)
            launch.wait_for(r"(?s)(model reloaded in [\d.]+ s; serving again.*){%d}" % (k + 1))
            completion(base)
        after = settled_descriptors(launch.proc.pid)
        assert len(after) <= len(before), (sorted(set(after) - set(before)), sorted(set(before) - set(after)))
        pids = with_descendants(launch.node_pids())
        stop(launch)
        assert_gone(pids)


def held_by_workers(node_pid: int) -> tuple[list[str], list[str]]:
    """(descriptors, mapped shared-memory files) of a node's per-client workers."""
    fds, maps = [], set()
    for pid in with_descendants([node_pid])[1:]:
        fds += open_descriptors(pid)
        maps |= {line.split(None, 5)[-1] for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
                 if "/dev/shm/" in line}
    return sorted(fds), sorted(maps)


def test_a_surviving_node_drops_the_links_of_a_peer_that_died(tmp_path: Path) -> None:
    """K restarts of a node's peer leave the node that stays up holding (in its workers) the
    descriptors and shared-memory mappings it held, not one dead link (socket, segment) more per
    restart -- and, after MAX_PEERS (16), no link at all (benchmarks/soak.py). Launch gives every
    node a fresh session at a reload; a session kept across restarts of its peer is
    test_llama_dropin.py's test_a_node_that_stays_up_drops_its_links_to_a_peer_that_restarted."""
    with start_launch(tmp_path, "--gguf", str(models.ensure("llama")), "--local", "2", "--ctx", "256",
                      "--port", "0") as launch:
        base = launch.http_base()
        completion(base)
        survivor = launch.node_pids()[0]
        before = held_by_workers(survivor)
        assert before[1], "the link between the nodes is over shared memory here"
        for k in range(4):
            os.kill(launch.node_pids()[1], signal.SIGKILL)
            launch.wait_for(r"(?s)(model reloaded in [\d.]+ s; serving again.*){%d}" % (k + 1))
            completion(base)
        assert launch.node_pids()[0] == survivor
        after = held_by_workers(survivor)
        assert len(after[0]) <= len(before[0]) and len(after[1]) <= len(before[1]), (before, after)
        pids = with_descendants(launch.node_pids())
        stop(launch)
        assert_gone(pids)


@pytest.mark.parametrize("split", [("--local", "2", "--split", "ffn"), ("--local", "4", "--split", "ffn", "--groups", "2")],
                         ids=["ffn", "hybrid"])
def test_a_split_of_every_layer_restarts_its_nodes_too(tmp_path: Path, split: tuple[str, ...]) -> None:
    """The FFN split and the hybrid hold their nodes in meta devices: a node killed twice (another each
    time) is restarted, the meta devices are made again, and the answers stay one process's."""
    model = models.ensure("deepseek2-f32")
    want = str(baseline(model, PROMPT, N_TOKENS)["text"])
    with start_launch(tmp_path, "--gguf", str(model), *split, "--ctx", "256", "--port", "0") as launch:
        base = launch.http_base()
        assert completion(base) == want
        for victim in (1, 0):
            os.kill(launch.node_pids()[victim], signal.SIGKILL)
            launch.wait_for(r"(?s)(model reloaded in [\d.]+ s; serving again.*){%d}" % (2 - victim))
            assert completion(base) == want, launch.stderr
        pids = with_descendants(launch.node_pids())
        stop(launch)
        assert_gone(pids)


def test_a_node_killed_mid_answer_in_a_split_of_every_layer_reloads(tmp_path: Path) -> None:
    """FFN split, a node killed while a stream is being answered: the node that stays up fails the
    all-reduces already posted to it, and each failure left an error for its session's next reply,
    which was the reload's first buffer -- llama.cpp's meta device asserted, and launch aborted.
    Every node now connects again (a fresh session) before the reload; launch answers again."""
    long = {"prompt": PROMPT, "max_tokens": 200, "temperature": 0, "stream": True, "ignore_eos": True}
    with start_launch(tmp_path, "--gguf", str(models.ensure("gemma")), "--local", "2", "--split", "ffn", "--ctx", "256",
                      "--port", "0") as launch:   # Gemma: 18 layers, many all-reduces posted per token
        base = launch.http_base()
        for k in range(3):
            request = urllib.request.Request(f"{base}/completions", data=json.dumps(long).encode(),
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=60) as stream:
                for _ in range(6):
                    stream.readline()                 # generation is under way
                os.kill(launch.node_pids()[1], signal.SIGKILL)
                for _ in stream:
                    pass
            launch.wait_for(r"(?s)(model reloaded in [\d.]+ s; serving again.*){%d}" % (k + 1))
            assert completion(base), launch.stderr
        assert launch.proc.poll() is None, launch.stderr
        pids = with_descendants(launch.node_pids())
        stop(launch)
        assert_gone(pids)


def load_figures(launch: Launch) -> list[str]:
    """What each load said the nodes read from their own model files."""
    return re.findall(r"the nodes read (\S+ \S+) of weights from their own model files", launch.stderr)


def figures(root: str, tmp_path: Path, requests: int) -> list[tuple[float, float, int]]:
    """Per node: (round trips per token, bytes per token) from the page once it counted `requests`
    requests, and `tbrpc status`'s `from files`."""
    deadline = time.monotonic() + 30
    while (page := http_json(f"{root}/tbrpc/status.json"))["requests"]["count"] < requests:
        assert time.monotonic() < deadline, page["requests"]
        time.sleep(0.05)
    shown = json.loads(subprocess.run([sys.executable, "-m", "tbrpc.cli", "status", "--json"], cwd=tmp_path, env=ENV,
                                      capture_output=True, text=True, timeout=60).stdout)["nodes"]
    assert all(n["up"] for n in shown), shown
    from_files = {n["endpoint"]: n["bytes_from_files"] for n in shown}
    return [(n["round_trips_per_token"], n["bytes_per_token"], from_files[n["endpoint"]]) for n in page["nodes"]]


def test_figures_after_a_reload_are_those_of_the_new_load(tmp_path: Path) -> None:
    """A node restarted and the model reloaded: what the load says the nodes read, `tbrpc status`'s
    `from files` and the page's per-token figures count this load, as they did the first."""
    with start_launch(tmp_path, "--gguf", str(models.ensure("gemma")), "--local", "2", "--ctx", "256",
                      "--port", "0") as launch:   # Gemma: large enough that the nodes read weights from files
        base = launch.http_base()
        root = base.removesuffix("/v1")
        completion(base)
        before = figures(root, tmp_path, 1)
        assert all(moved > 0 and read > 0 for _, moved, read in before), before
        os.kill(launch.node_pids()[1], signal.SIGKILL)
        launch.wait_for(r"model reloaded in [\d.]+ s; serving again")
        reads = load_figures(launch)
        assert len(reads) == 2 and reads[0] == reads[1], launch.stderr
        completion(base)
        assert figures(root, tmp_path, 2) == before
        stop(launch)


def test_requests_in_flight_get_the_error_and_a_node_that_never_returns_is_waited_for(tmp_path: Path) -> None:
    """Gemma (slow enough to kill a node mid-answer): a stream under way ends without [DONE], a plain
    request under way gets the 503; with the node gone for good launch keeps waiting until Ctrl-C."""
    first, second = start_node(tmp_path), start_node(tmp_path)
    started = [first, second]
    cluster = tmp_path / "two.toml"
    cluster.write_text("".join(f'[[node]]\nname = "n{i}"\nhost = "127.0.0.1"\nport = {n.port}\nstart = "manual"\n\n'
                               for i, n in enumerate(started)))
    long = {"prompt": "Once upon a time", "max_tokens": 200, "temperature": 0}
    try:
        with start_launch(tmp_path, "--gguf", str(models.ensure("gemma")), "--cluster", str(cluster), "--ctx", "256",
                          "--port", "0") as launch:
            base = launch.http_base()
            root = base.removesuffix("/v1")
            request = urllib.request.Request(f"{base}/completions", data=json.dumps({**long, "stream": True}).encode(),
                                             headers={"Content-Type": "application/json"})
            lines = []
            with urllib.request.urlopen(request, timeout=60) as stream:
                lines.append(stream.readline())       # the first event: generation is under way
                second.proc.kill()
                second.proc.wait()
                started_at = time.monotonic()
                lines.extend(stream)                  # the rest, until the server ends the stream
            assert time.monotonic() - started_at < 60
            events = [line for line in lines if line.startswith(b"data: ")]
            assert 1 <= len(events) < long["max_tokens"] and b"data: [DONE]" not in b"".join(lines), lines[-3:]
            launch.wait_for(r"model freed")

            again = start_node(tmp_path, "--port", str(second.port))
            started.append(again)
            launch.wait_for(r"serving again")
            answer: dict[str, Any] = {}

            def ask() -> None:
                answer["refused"] = refused(f"{base}/completions", long)

            asking = threading.Thread(target=ask)
            asking.start()
            deadline = time.monotonic() + 60
            while http_json(f"{root}/tbrpc/status.json")["requests"]["in_flight"] < 1:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            time.sleep(0.5)                           # into the generation
            again.proc.kill()
            again.proc.wait()
            asking.join(timeout=60)
            code, _, body, _ = answer["refused"]
            assert code == 503 and f"node n1 (127.0.0.1:{second.port})" in body["error"]["message"], body

            launch.wait_for(r"node n1 \(127\.0\.0\.1:\d+\): waiting for it \(1 probe")   # it never comes back
            time.sleep(2 * 0.5 + 1.0)                 # several probes later: still waiting, still answering 503
            assert refused(f"{base}/completions", long)[0] == 503
            assert http_json(f"{root}/tbrpc/status.json")["waiting"]["probes"] >= 2
            stop(launch)
            assert "stopping (SIGINT)" in launch.stderr
            assert "Traceback" not in launch.stderr, launch.stderr   # the failed requests: a line each
    finally:
        stop_nodes([n for n in started if n.proc.poll() is None])


def test_a_stream_waiting_for_the_model_when_a_node_fails_gets_the_503(tmp_path: Path) -> None:
    """A stream queued behind a long request while a node dies is answered 503 naming the node, not
    a 200 whose stream says nothing: its headers wait for its first event."""
    first, second = start_node(tmp_path), start_node(tmp_path)
    cluster = tmp_path / "two.toml"
    cluster.write_text("".join(f'[[node]]\nname = "n{i}"\nhost = "127.0.0.1"\nport = {n.port}\nstart = "manual"\n\n'
                               for i, n in enumerate((first, second))))
    model = models.ensure("llama")
    no_end = {str(load_gguf(model).metadata["tokenizer.ggml.eos_token_id"]): -1000}
    try:
        with start_launch(tmp_path, "--gguf", str(model), "--cluster", str(cluster), "--ctx", "2048",
                          "--port", "0") as launch:
            base = launch.http_base()
            root = base.removesuffix("/v1")
            answers: dict[str, Any] = {}

            def ask(name: str, body: dict[str, Any]) -> None:
                answers[name] = refused(f"{base}/completions", body)

            long = threading.Thread(target=ask, args=("long", {"prompt": PROMPT, "max_tokens": 1900, "temperature": 0,
                                                                "logit_bias": no_end}))
            long.start()
            deadline = time.monotonic() + 60
            while http_json(f"{root}/tbrpc/status.json")["requests"]["in_flight"] < 1:
                assert time.monotonic() < deadline
                time.sleep(0.005)
            queued = threading.Thread(target=ask, args=("stream", {**BODY, "stream": True}))
            queued.start()
            while http_json(f"{root}/tbrpc/status.json")["requests"]["in_flight"] < 2:
                assert time.monotonic() < deadline
                time.sleep(0.005)
            time.sleep(0.2)   # the stream waits for the model
            assert long.is_alive(), "the long request ended before the node was killed"
            second.proc.kill()
            second.proc.wait()
            for t in (long, queued):
                t.join(timeout=60)
            for name in ("long", "stream"):
                code, _, body, _ = answers[name]
                assert code == 503 and f"node n1 (127.0.0.1:{second.port})" in body["error"]["message"], (name, body)
            stop(launch)
    finally:
        stop_nodes([n for n in (first, second) if n.proc.poll() is None])


def test_other_errors_keep_their_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    """Only a node's failure leaves llama-cpp-python's routes (for OutageGuard to answer); any other
    error is still theirs: a 500 and its traceback."""
    from fastapi import APIRouter
    from llama_cpp.server.errors import RouteErrorHandler

    from tbrpc.client import NodeFailed
    from tbrpc.serve import _node_errors_through

    router = APIRouter(route_class=RouteErrorHandler)
    router.add_api_route("/x", lambda: None)
    _node_errors_through(router)
    route = router.routes[0]
    try:
        raise RuntimeError("boom")
    except RuntimeError as exc:
        code, body = route.error_message_wrapper(exc)
    assert (code, body["message"]) == (500, "boom")
    assert "Exception: boom\nTraceback (most recent call last)" in capsys.readouterr().err
    with pytest.raises(NodeFailed, match="node gone"):
        route.error_message_wrapper(NodeFailed("node gone", "127.0.0.1:1"))
