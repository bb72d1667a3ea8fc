"""`tbrpc launch`: real node processes, the real HTTP API, real signals.

Answers over HTTP and with --prompt must be the tokens of one process with the
nodes' kernels (greedy; see helpers.baseline), and nothing launch started may be
left running afterwards -- after a normal stop, Ctrl-C, SIGTERM, SIGKILL of
launch itself, or a node killed during load or generation (checked by PID).
"""

from __future__ import annotations

import asyncio
import html
import json
import os
import re
import shutil
import signal
import socket
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
from click.testing import CliRunner

import models
from helpers import (
    CHAT, ENV, PROMPT, Launch, assert_gone, baseline, free_port, http_json, http_stream, python_wrapper, start_launch,
    start_sshd, with_descendants,
)

from tbrpc import secret as tbrpc_secret
from tbrpc.cli import main as cli_main
from tbrpc.cluster_file import choose_cluster, load_specs, spec_from_table
from tbrpc.doctor import transport_fix
from tbrpc.gguf_model import load_gguf
from tbrpc.llama import check_split, resolve_cluster
from tbrpc.native import TbrpcError
from tbrpc.node_memory import ClusterError
from tbrpc.spec import NodeSpec, SshTarget, local_specs

N_TOKENS = 12


CHAT_FORMAT = {"gemma": "gemma"}   # this GGUF has no chat template; the tiny models are not chat models


@cache
def expected(model_name: str, max_tokens: int = N_TOKENS) -> dict[str, Any]:
    return baseline(models.ensure(model_name), PROMPT, max_tokens, chat_format=CHAT_FORMAT.get(model_name))


def stop_and_check(launch: Launch, sig: int = signal.SIGINT, code: int = 0) -> None:
    pids = with_descendants(launch.node_pids())   # the nodes and their per-client workers
    assert pids, launch.stderr
    launch.proc.send_signal(sig)
    assert launch.finish() == code, launch.stderr
    assert_gone(pids)


# --- the cluster file's launch keys ------------------------------------------------------


def test_cluster_file_launch_keys(tmp_path: Path) -> None:
    path = tmp_path / "tbrpc.toml"
    path.write_text("""
[[node]]
name = "mac1"
host = "127.0.0.1"
port = 50052
memory = "64GiB"

[[node]]
name = "mac2"
host = "10.0.0.2"
port = 50052
memory = "512GiB"
usable_memory = "480GiB"
ssh = { user = "me", host = "mac2.local", key = "~/.ssh/tbrpc", options = ["StrictHostKeyChecking=accept-new"] }
python = "~/tbrpc/.venv/bin/python"
model = "/models/k2.gguf"
device = "MTL0"
threads = 8

[[node]]
name = "box"
host = "10.0.0.3"
port = 50053
memory = "128GiB"
kind = "cpu"
""")
    mac1, mac2, box = load_specs(path)
    assert (mac1.start, mac1.endpoint) == ("local", "127.0.0.1:50052")
    assert mac2.start == "ssh" and mac2.ssh == SshTarget("mac2.local", "me", "~/.ssh/tbrpc", None,
                                                         ("StrictHostKeyChecking=accept-new",))
    assert (mac2.python, mac2.model, mac2.device, mac2.threads) == ("~/tbrpc/.venv/bin/python", "/models/k2.gguf", "MTL0", 8)
    assert mac2.plan_node is not None and mac2.plan_node.usable_bytes == 480 * 2**30
    argv = mac2.ssh_argv("true")
    assert argv[0] == "ssh" and "BatchMode=yes" in argv and argv[-2:] == ["me@mac2.local", "true"]
    assert os.path.expanduser("~/.ssh/tbrpc") in argv
    assert box.start == "manual" and box.listen_address == "10.0.0.3"

    assert mac1.transport is None   # the head's choice: TBRPC_TRANSPORT, else "auto"

    bad = tmp_path / "bad.toml"
    for key, message in [('start = "telnet"', "start must be one of"),
                         ('transport = "rdma"', "transport must be one of auto, tcp, not 'rdma'")]:
        bad.write_text(f'[[node]]\nname = "x"\nhost = "h"\nport = 1\n{key}\n')
        with pytest.raises(ClusterError, match=message):
            load_specs(bad)


def test_cluster_file_location(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    with pytest.raises(ClusterError, match="--local N"):
        choose_cluster(None, None, instead="--local N")
    user_file = tmp_path / "config" / "tbrpc" / "tbrpc.toml"
    user_file.parent.mkdir(parents=True)
    user_file.write_text("")
    assert choose_cluster(None, None, instead="--local N") == str(user_file)
    (tmp_path / "tbrpc.toml").write_text("")
    assert choose_cluster(None, None, instead="--local N") == str(tmp_path / "tbrpc.toml")
    assert choose_cluster("other.toml", None, instead="--local N") == "other.toml"
    assert choose_cluster(None, 3, instead="--local N") == 3
    specs = local_specs(3)
    assert [s.name for s in specs] == ["local0", "local1", "local2"] and all(s.port == 0 for s in specs)
    assert spec_from_table({"name": "n", "host": "h", "ssh": "u@h2"}, None, "t").ssh == SshTarget("h2", "u")
    assert isinstance(specs[0], NodeSpec)


@pytest.mark.parametrize("command, expected", [
    ("launch", "no cluster: pass --cluster FILE or --local N (no cluster file at tbrpc.toml, "),
    ("plan", "no cluster: pass --cluster FILE or --node NAME=SIZE or --nodes NxSIZE (no cluster file at tbrpc.toml, "),
    ("doctor", "no cluster: pass --cluster FILE or the nodes' host:port endpoints (no cluster file at tbrpc.toml, "),
    ("status", "no nodes: pass --cluster FILE or host:port, or start `tbrpc launch` first"),
])
def test_no_cluster_names_only_options_the_command_has(command: str, expected: str, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))   # no launch running here
    args = ["--gguf", str(models.ensure("llama"))] if command in ("launch", "plan") else []
    result = CliRunner().invoke(cli_main, [command, *args])
    assert result.exit_code == 2 and expected in result.output, result.output
    options = {o for p in cli_main.commands[command].params for o in p.opts}
    assert set(re.findall(r"--[a-z-]+", expected)) <= options, (expected, options)


def test_how_a_node_process_ended_is_said_in_words() -> None:
    """A node that died says how: a signal by name and what usually sends it (a user can tell the
    out-of-memory killer from someone's stop from a crash), not Popen's negative return code."""
    from tbrpc.node_processes import how_it_ended

    assert how_it_ended(3) == "exited with code 3"
    assert how_it_ended(-signal.SIGKILL) == "was killed by SIGKILL (the kernel's out-of-memory killer, or kill -9)"
    assert how_it_ended(-signal.SIGTERM) == "was killed by SIGTERM (asked to stop: kill, or a service manager)"
    assert how_it_ended(-signal.SIGSEGV) == "was killed by SIGSEGV (a crash: its log may say where)"
    assert how_it_ended(-signal.SIGUSR1) == "was killed by SIGUSR1"
    assert how_it_ended(-200) == "was killed by signal 200"


@pytest.mark.parametrize("command", ["launch", "plan", "doctor", "status"])
def test_a_mistake_in_a_file_exits_1_in_every_command(command: str, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A cluster file or secret file with a mistake is bad input, not a bad invocation: every command
    exits 1 naming the file, with no usage banner (doctor and status answered exit 2 and
    "Usage: ...", plan and launch exit 1). A cluster not named nor found stays exit 2
    (test_no_cluster_names_only_options_the_command_has)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    cluster = tmp_path / "c.toml"
    cluster.write_text('[[node]]\nname = "a"\nhost = "127.0.0.1"\nport = 1\nmemroy = "1GiB"\n')
    secret = tmp_path / "secret"
    secret.write_text("0" * 64 + "\n")
    secret.chmod(0o644)
    args = ["--gguf", str(models.ensure("llama"))] if command in ("launch", "plan") else []
    for extra, names in ((["--cluster", str(cluster)], "unknown key 'memroy'"),
                         (["--cluster", str(cluster), "--secret-file", str(secret)], str(secret))):
        done = subprocess.run([sys.executable, "-m", "tbrpc.cli", command, *args, *extra], cwd=tmp_path,
                              capture_output=True, text=True, timeout=60, env={**ENV, "XDG_RUNTIME_DIR": str(tmp_path / "run")})
        assert done.returncode == 1, (extra, done.stderr)
        assert names in done.stderr and "Usage:" not in done.stderr, (extra, done.stderr)


@pytest.mark.parametrize("command, floor", [("node", 0), ("launch", 1)])
def test_negative_threads_are_refused(command: str, floor: int) -> None:
    # were -3 taken, neither would get far: the node has no such device, the launch no such port
    args = (["--gguf", str(models.ensure("llama")), "--local", "1", "--port", "-1"] if command == "launch"
            else ["--port", "0", "--device", "no-such-device"])
    result = CliRunner().invoke(cli_main, [command, *args, "--threads", "-3"])
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '--threads': -3 is not in the range x>={floor}" in result.output, result.output


# --- serving over HTTP -------------------------------------------------------------------


@pytest.mark.parametrize("model_name,n_nodes", [("llama", 2), ("llama", 4), ("deepseek2", 4), ("gemma", 2)])
def test_http_api_answers_like_one_process(model_name: str, n_nodes: int, tmp_path: Path) -> None:
    want = expected(model_name)
    chat_format = ["--chat-format", CHAT_FORMAT[model_name]] if model_name in CHAT_FORMAT else []
    with start_launch(tmp_path, "--gguf", str(models.ensure(model_name)), "--local", str(n_nodes),
                      "--ctx", "256", "--port", "0", "--alias", "m", *chat_format) as launch:
        base = launch.http_base()
        assert len(launch.node_pids()) == n_nodes
        if model_name == "gemma":   # local nodes read the weights from the model file, not from the socket
            assert "of weights from their own model files" in launch.stderr
        assert [m["id"] for m in http_json(f"{base}/models")["data"]] == ["m"]

        # repeat_penalty: the server defaults to 1.1, llama_cpp.Llama (the baseline) to 1.0
        body = {"model": "m", "prompt": PROMPT, "max_tokens": N_TOKENS, "temperature": 0, "repeat_penalty": 1.0}
        out = http_json(f"{base}/completions", body)
        assert out["choices"][0]["text"] == want["text"]
        assert out["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]

        chunks = http_stream(f"{base}/completions", {**body, "stream": True})
        assert "".join(c["choices"][0]["text"] for c in chunks) == want["text"]

        if "chat" in want:
            chat = {"model": "m", "messages": CHAT, "max_tokens": N_TOKENS, "temperature": 0, "repeat_penalty": 1.0}
            whole = http_json(f"{base}/chat/completions", chat)["choices"][0]["message"]["content"]
            assert whole == want["chat"]
            events = http_stream(f"{base}/chat/completions", {**chat, "stream": True})
            assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events) == whole
        stop_and_check(launch, signal.SIGINT, 0)
        assert "stopping (SIGINT)" in launch.stderr


def test_concurrent_requests_take_turns(tmp_path: Path) -> None:
    """Three clients at once, streaming and not: each gets its whole answer, the
    one a lone request gets; none is cut short or interleaved with another."""
    want = expected("gemma", 16)["text"]   # Gemma: clean text, and slow enough that the requests overlap
    with start_launch(tmp_path, "--gguf", str(models.ensure("gemma")), "--local", "2", "--ctx", "256",
                      "--port", "0", "--alias", "m", "--chat-format", "gemma") as launch:
        base = launch.http_base()
        body = {"model": "m", "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "repeat_penalty": 1.0}
        texts: dict[str, str] = {}

        def ask(name: str, stream: bool) -> None:
            if stream:
                chunks = http_stream(f"{base}/completions", {**body, "stream": True})
                texts[name] = "".join(c["choices"][0]["text"] for c in chunks)
            else:
                texts[name] = http_json(f"{base}/completions", body)["choices"][0]["text"]

        clients = [threading.Thread(target=ask, args=(f"c{i}", i != 1)) for i in range(3)]
        for c in clients:
            c.start()
        for c in clients:
            c.join(timeout=120)
        assert texts == {"c0": want, "c1": want, "c2": want}

        # what the server shows about itself
        root = base.removesuffix("/v1")
        deadline = time.monotonic() + 30   # a request counts once its last byte is sent, a moment after the client has it
        while (status := http_json(f"{root}/tbrpc/status.json"))["requests"]["count"] < 3:
            assert time.monotonic() < deadline, status["requests"]
            time.sleep(0.05)
        assert [n["name"] for n in status["nodes"]] == ["local0", "local1"], status["nodes"]
        (a0, a1), (b0, b1) = (n["layers"] for n in status["nodes"])
        assert (a0, b0, b1) == (0, a1 + 1, 17), status["nodes"]   # Gemma 3 270M: 18 layers, in plan order
        assert all(n["transport"].startswith("shm ") and not n["failed"] for n in status["nodes"])
        # the activations went node to node: local0's link to local1, over shared memory too
        assert status["nodes"][0]["links"].startswith(f"{status['nodes'][1]['endpoint']} shm "), status["nodes"]
        requests = status["requests"]
        assert (requests["count"], requests["tokens"], requests["in_flight"]) == (3, 48, 0), requests
        streams = [r for r in requests["recent"] if r["first_token_s"] is not None]
        assert len(streams) == 2 and all(0 < r["first_token_s"] < r["seconds"] for r in streams), requests
        # about one round trip per generated token (the head waits for the logits only), plus each
        # request's prompt and its first step
        assert 1.0 <= sum(n["round_trips_per_token"] for n in status["nodes"]) <= 1.5, status["nodes"]
        with urllib.request.urlopen(f"{root}/metrics", timeout=30) as r:
            metrics = r.read().decode()
        assert "tbrpc_generated_tokens_total 48" in metrics and 'tbrpc_node_up{node="local0"' in metrics, metrics
        with urllib.request.urlopen(f"{root}/tbrpc", timeout=30) as r:
            assert b"tbrpc/status.json" in r.read()
        stop_and_check(launch, signal.SIGINT, 0)


def test_a_request_whose_client_left_stops_generating(tmp_path: Path) -> None:
    """A non-streaming completion (plain and chat) whose client hangs up mid-answer stops at once
    (a stream did already),
    not at max_tokens with the nodes working for nobody and the next request waiting; the model
    then answers the next request as a fresh process would."""
    asked = 1900   # the tiny llama decodes ~1,000 tokens/s here: all of them would take seconds
    model = models.ensure("llama")
    no_end = {str(load_gguf(model).metadata["tokenizer.ggml.eos_token_id"]): -1000}   # text without an end
    want = expected("llama")
    with start_launch(tmp_path, "--gguf", str(model), "--local", "2", "--ctx", "2048",
                      "--port", "0", "--alias", "m") as launch:
        base = launch.http_base()
        root, port = base.removesuffix("/v1"), int(base.rsplit(":", 1)[1].split("/")[0])

        def trips() -> int:
            return sum(n["round_trips"] for n in http_json(f"{root}/tbrpc/status.json")["nodes"])

        for path, body in (("/v1/completions", {"prompt": PROMPT}),
                           ("/v1/chat/completions", {"messages": CHAT}),
                           ("/v1/completions", {"prompt": PROMPT, "stream": True})):   # llama-cpp-python's own stop
            before = trips()
            data = json.dumps({"model": "m", "max_tokens": asked, "temperature": 0, "logit_bias": no_end,
                               **body}).encode()
            with socket.create_connection(("127.0.0.1", port)) as client:
                client.sendall(f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                               f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
                deadline = time.monotonic() + 60
                while trips() < before + 20:   # generating (the prompt is one round trip per node)
                    assert time.monotonic() < deadline, launch.stderr
                    time.sleep(0.005)
            deadline = time.monotonic() + 60
            while (status := http_json(f"{root}/tbrpc/status.json"))["requests"]["in_flight"]:
                assert time.monotonic() < deadline, launch.stderr
                time.sleep(0.01)
            assert status["requests"]["recent"][0]["path"] == path, status["requests"]
            assert trips() - before < asked // 4, (path, body, status["requests"]["recent"][0])   # ~ a round trip a token

        out = http_json(f"{base}/completions", {"model": "m", "prompt": PROMPT, "max_tokens": N_TOKENS,
                                                 "temperature": 0, "repeat_penalty": 1.0})
        assert out["choices"][0]["text"] == want["text"]
        assert "Traceback" not in launch.stderr, launch.stderr
        stop_and_check(launch, signal.SIGINT, 0)


def test_a_client_that_stops_reading_counts_as_gone() -> None:
    """A streaming client that stays connected but reads nothing (a paused process, a peer gone
    without a reset) fills the socket's buffers; then the stream's next send waits for it, with the
    model held, and every later request waited as long as that client kept its connection. A send
    that waits CLIENT_STALL_TIMEOUT_S marks the client gone like a hang-up: the completion's
    stopping criterion turns true, the rest of the answer is dropped, and the model is free."""
    from tbrpc.abandoned import ClientWatch, stop_when_client_gone

    class Model:
        def create_completion(self, **kwargs: Any) -> Any:
            return kwargs["stopping_criteria"]

    sent: list[bytes] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:   # a stream: a send a token, until told to stop
        await receive()
        model = Model()   # held while it runs, as the server's route holds its model (the wrapper does not)
        criteria = stop_when_client_gone(model).create_completion(prompt="x")
        await send({"type": "http.response.start", "status": 200, "headers": []})
        while not any(stop([], None) for stop in criteria):
            await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def receive() -> dict[str, Any]:
        if not sent:
            sent.append(b"")
            return {"type": "http.request", "body": b"{}", "more_body": False}
        await asyncio.Event().wait()   # connected: no disconnect ever comes
        raise AssertionError

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            sent.append(message["body"])
            if len(sent) > 3:   # its buffers are full: nothing more is taken
                await asyncio.Event().wait()

    watch = ClientWatch(app, ["/v1/completions"], stall_timeout=0.2)
    started = time.monotonic()
    asyncio.run(asyncio.wait_for(watch({"type": "http", "path": "/v1/completions"}, receive, send), 10))
    assert time.monotonic() - started < 2
    assert len(sent) == 4   # what it took before it stopped reading; nothing after


def test_logprobs_are_refused_with_400_saying_why(tmp_path: Path) -> None:
    """Launch loads the model without logits_all (a layer split would send the head every prompt
    token's logits), so llama-cpp-python cannot give logprobs; it said so as a 500
    internal_server_error naming a Llama argument the client never saw. A 400 says what to do."""
    with start_launch(tmp_path, "--gguf", str(models.ensure("llama")), "--local", "1", "--ctx", "256",
                      "--port", "0", "--alias", "m") as launch:
        base = launch.http_base()
        for path, body in (("completions", {"prompt": PROMPT, "logprobs": 2}),
                           ("completions", {"prompt": PROMPT, "logprobs": 0, "echo": True}),
                           ("chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 2})):
            with pytest.raises(urllib.error.HTTPError) as refused:
                http_json(f"{base}/{path}", {"model": "m", "max_tokens": 4, **body})
            assert refused.value.code == 400, (path, body)
            assert "logprobs" in json.loads(refused.value.read())["detail"]
        out = http_json(f"{base}/completions", {"model": "m", "prompt": PROMPT, "max_tokens": 4})
        assert out["usage"]["completion_tokens"] == 4   # the model is unharmed
        assert "Traceback" not in launch.stderr, launch.stderr
        stop_and_check(launch, signal.SIGINT, 0)


def test_api_key_guards_the_api_and_the_dashboard(tmp_path: Path) -> None:
    env = {**ENV, "XDG_RUNTIME_DIR": str(tmp_path / "run")}
    with start_launch(tmp_path, "--gguf", str(models.ensure("llama")), "--local", "1", "--ctx", "256",
                      "--port", "0", "--api-key", "s3cret", env=env) as launch:
        root = launch.http_base().removesuffix("/v1")

        def code(path: str, key: str | None = None, scheme: str = "Bearer") -> int:
            request = urllib.request.Request(root + path, headers={"Authorization": f"{scheme} {key}"} if key else {})
            try:
                with urllib.request.urlopen(request, timeout=30) as r:
                    return int(r.status)
            except urllib.error.HTTPError as e:
                return int(e.code)

        assert [code("/v1/models"), code("/metrics"), code("/tbrpc/status.json"), code("/tbrpc")] == [401] * 4
        assert [code("/v1/models", "wrong"), code("/metrics", "wrong")] == [401, 401]
        assert [code("/v1/models", "s3cret"), code("/metrics", "s3cret"), code("/tbrpc?api_key=s3cret"),
                code("/tbrpc/status.json?api_key=s3cret")] == [200] * 4
        # the scheme's case does not matter (RFC 9110), as on llama-cpp-python's routes
        assert [code("/v1/models", "s3cret", "bearer"), code("/metrics", "s3cret", "bearer")] == [200, 200]
        assert code("/metrics", "s3cret", "Basic") == 401
        # tbrpc status on this machine reads the key from the launch's record (the user's alone)
        shown = json.loads(subprocess.run([sys.executable, "-m", "tbrpc.cli", "status", "--json"], cwd=tmp_path, env=env,
                                          capture_output=True, text=True, timeout=60).stdout)
        assert [x["pid"] for x in shown["launches"]] == [launch.proc.pid], shown
        (record,) = (tmp_path / "run").glob(f"tbrpc-*/launch-{launch.proc.pid}.json")
        assert record.stat().st_mode & 0o077 == 0
        stop_and_check(launch, signal.SIGINT, 0)


def _chromium() -> str | None:
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


def _rendered(browser: str, url: str, tmp_path: Path, screenshot: Path | None = None) -> str:
    """The page's DOM after its script ran (3 s of virtual time), from headless Chromium."""
    args = [browser, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / 'chromium'}",
            "--virtual-time-budget=3000", "--window-size=1100,520"]
    if screenshot is not None:
        subprocess.run([*args, f"--screenshot={screenshot}", url], capture_output=True, timeout=120, check=True)
    return subprocess.run([*args, "--dump-dom", url], capture_output=True, text=True, timeout=120, check=True).stdout


@pytest.mark.parametrize("key", [(), ("--api-key", "s3cret")])
def test_all_addresses_without_a_key_warn(key: tuple[str, ...], tmp_path: Path) -> None:
    env = {**ENV, "XDG_RUNTIME_DIR": str(tmp_path / "run")}
    with start_launch(tmp_path, "--gguf", str(models.ensure("llama")), "--local", "1", "--host", "0.0.0.0",
                      "--port", "0", *key, env=env) as launch:
        launch.http_base()
        warning = "tbrpc: warning: --host 0.0.0.0 without --api-key: anyone who can reach this machine on the network can use the API"
        assert (warning in launch.stderr) == (not key), launch.stderr
        stop_and_check(launch)


def test_dashboard_in_a_browser(tmp_path: Path) -> None:
    """The /tbrpc page, rendered by a real headless browser, lists both nodes, says for
    each connection and link on TCP the kind of its reason and the fix (those of
    `tbrpc status`, tbrpc.doctor.transport_fix), and shows a completion once one was answered."""
    browser = _chromium()
    if browser is None:
        pytest.skip("no chromium: .ci/run installs it (apt-get install chromium)")
    cluster = tmp_path / "two.toml"   # local1 asks for TCP: its connection and local0's link to it stay there
    cluster.write_text('[[node]]\nname = "local0"\nhost = "127.0.0.1"\nport = 0\nthreads = 1\n\n'
                       '[[node]]\nname = "local1"\nhost = "127.0.0.1"\nport = 0\nthreads = 1\ntransport = "tcp"\n')
    with start_launch(tmp_path, "--gguf", str(models.ensure("gemma")), "--cluster", str(cluster), "--ctx", "256",
                      "--port", "0", "--alias", "gemma-3-270m") as launch:
        base = launch.http_base()
        page = base.removesuffix("/v1") + "/tbrpc"
        before = _rendered(browser, page, tmp_path)
        assert 'data-node="local0"' in before and 'data-node="local1"' in before, before
        assert "0 requests" in before and "/v1/completions" not in before, before
        rows = {m[1]: m[2] for m in re.finditer(r'<tr data-node="(\w+)">(.*?)</tr>', before, re.S)}
        for node, line in (("local1", ("connection", "head", "local1")), ("local0", ("link", "local0", "local1"))):
            what, source, target = line
            shown = (f'<div class="why">{what} {source} -&gt; {target} on TCP (asked): fix: '
                     f'{html.escape(transport_fix("asked", source, target), quote=False)}</div>')
            assert shown in rows[node], rows
        assert rows["local0"].count('class="why"') == rows["local1"].count('class="why"') == 1, rows   # no other
        http_json(f"{base}/completions", {"model": "gemma-3-270m", "prompt": PROMPT, "max_tokens": 16, "temperature": 0})
        after = _rendered(browser, page, tmp_path, screenshot=tmp_path / "dashboard.png")
        assert "1 requests, 16 tokens" in after and "/v1/completions" in after, after
        if os.environ.get("TBRPC_SCREENSHOT"):   # how docs/dashboard.png is made
            shutil.copy(tmp_path / "dashboard.png", os.environ["TBRPC_SCREENSHOT"])
        stop_and_check(launch, signal.SIGINT, 0)


@pytest.mark.parametrize("transport,carrier", [("auto", r"shm \d+x\d+K"), ("tcp", "tcp: asked for")])
def test_prompt_prints_one_completion(transport: str, carrier: str, tmp_path: Path) -> None:
    """The load summary names every connection and the link the split uses, made before the
    first request (one token decoded and forgotten): the completion is still one process's."""
    want = expected("llama")
    launch = start_launch(tmp_path, "--gguf", str(models.ensure("llama")), "--local", "2", "--ctx", "256",
                          "--prompt", PROMPT, "--max-tokens", str(N_TOKENS), env={**ENV, "TBRPC_TRANSPORT": transport})
    assert launch.finish() == 0, launch.stderr
    assert launch.stdout == want["text"] + "\n"
    assert "model loaded in" in launch.stderr and "loading" in launch.stderr
    summary = launch.stderr.split("model loaded in", 1)[1]
    for line in ("connection head -> local0", "connection head -> local1", "link local0 -> local1"):
        assert re.search(rf"^tbrpc: {line}: {carrier}$", summary, re.M), launch.stderr
    assert "link local1 ->" not in summary, launch.stderr   # a layer split over two nodes: one link
    assert_gone(launch.node_pids())


def test_chat_in_the_terminal(tmp_path: Path) -> None:
    want = baseline(models.ensure("llama"), PROMPT, N_TOKENS, chat_format="llama-2")
    launch = start_launch(tmp_path, "--gguf", str(models.ensure("llama")), "--local", "2", "--ctx", "256", "--chat",
                          "--chat-format", "llama-2", "--max-tokens", str(N_TOKENS),
                          stdin_text=CHAT[0]["content"] + "\n")
    assert launch.finish() == 0, launch.stderr
    assert launch.stdout.startswith("chat: type a message")
    assert f"> {want['chat']}\n> " in launch.stdout
    assert_gone(launch.node_pids())


def test_sigterm_stops_server_and_nodes(tmp_path: Path) -> None:
    launch = start_launch(tmp_path, "--gguf", str(models.ensure("llama")), "--local", "2", "--ctx", "256", "--port", "0")
    launch.http_base()
    stop_and_check(launch, signal.SIGTERM, 0)


def test_sigterm_with_requests_waiting_answers_each_with_a_status(tmp_path: Path) -> None:
    """SIGTERM while completions run and wait for the model: uvicorn gives them 3 s, then cuts what
    is left. Each cut request gets 503 with a JSON error saying the server stops (it got a plain-text
    500, and the log a CancelledError traceback each); the others their whole answer. Launch exits
    0 in time and leaves no node."""
    model = models.ensure("llama")
    no_end = {str(load_gguf(model).metadata["tokenizer.ggml.eos_token_id"]): -1000}
    with start_launch(tmp_path, "--gguf", str(model), "--local", "2", "--ctx", "2048", "--port", "0",
                      "--alias", "m") as launch:
        base = launch.http_base()
        body = {"model": "m", "prompt": PROMPT, "max_tokens": 1900, "temperature": 0, "logit_bias": no_end}
        answers: dict[int, tuple[int, Any]] = {}

        def ask(i: int) -> None:
            try:
                answers[i] = (200, http_json(f"{base}/completions", body, timeout=60))
            except urllib.error.HTTPError as exc:
                answers[i] = (exc.code, exc.read())

        clients = [threading.Thread(target=ask, args=(i,)) for i in range(12)]   # one at a time: some are cut
        for c in clients:
            c.start()
        time.sleep(1.0)
        started = time.monotonic()
        stop_and_check(launch, signal.SIGTERM, 0)
        assert time.monotonic() - started < 20, launch.stderr
        for c in clients:
            c.join(timeout=30)
        codes = sorted(code for code, _ in answers.values())
        assert len(codes) == 12 and set(codes) <= {200, 503} and 503 in codes, (codes, answers)
        for code, answer in answers.values():
            if code == 200:
                assert answer["usage"]["completion_tokens"] == 1900
            else:
                assert json.loads(answer)["error"]["message"] == "the server is stopping", answer
        assert "Traceback" not in launch.stderr, launch.stderr


def test_launch_killed_leaves_no_node(tmp_path: Path) -> None:
    """Even SIGKILL of launch: each node sees its stdin close and stops by itself."""
    launch = start_launch(tmp_path, "--gguf", str(models.ensure("llama")), "--local", "2", "--ctx", "256", "--port", "0")
    launch.http_base()
    stop_and_check(launch, signal.SIGKILL, -signal.SIGKILL)


def test_mistakes_found_before_any_node_starts_are_said_with_their_fix(tmp_path: Path) -> None:
    """A cluster file with a mistake is refused naming the file, the node and the key, and the fix -- not
    with the hint to check the model file and the node logs of a failed load. More nodes than the split
    takes is refused before any node starts: `--local 40` started 40 nodes, then said that 18 layers do
    not go round 40 nodes."""
    model = models.ensure("llama")   # 6 layers
    bad = tmp_path / "tbrpc.toml"
    bad.write_text('[[node]]\nname = "a"\nhost = "127.0.0.1"\nport = 0\nmemroy = "8GiB"\n')
    launch = start_launch(tmp_path, "--gguf", str(model), "--cluster", str(bad), "--prompt", "x")
    assert launch.finish() == 1
    launch.wait_for("try: ")
    assert launch.stderr == (f"tbrpc: step start: {bad}: node a: unknown key 'memroy' (did you mean 'memory'?)\n"
                             "  try: fix the cluster file (docs/cluster.md, The cluster file, explains every key)\n")
    launch = start_launch(tmp_path, "--gguf", str(model), "--local", "7", "--prompt", "x")
    assert launch.finish() == 1
    launch.wait_for("nodes")
    assert launch.stderr == ("tbrpc: step plan: 7 nodes but only 6 layers to share: a layer split gives every node "
                             "at least one layer; use at most 6 nodes\n")   # and no "node local0: starting"
    assert not launch.log_dir.exists() or not list(launch.log_dir.glob("*.log"))
    with pytest.raises(TbrpcError) as refused:
        check_split(model, "tensor", 17, {})
    assert str(refused.value) == "step plan: tensor split: llama.cpp's meta device takes at most 16 devices, not 17"


def test_a_launch_that_starts_no_node_leaves_no_log_directory(tmp_path: Path) -> None:
    """The log directory launch makes for its nodes (with --local, also the run's secret) goes when
    no node was started: every refused launch left a /tmp/tbrpc-logs-* behind, holding a secret.
    One that started nodes keeps their logs (test_failures, test_outage read them)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    done = subprocess.run([sys.executable, "-m", "tbrpc.cli", "launch", "--gguf", str(models.ensure("llama")),
                           "--local", "7", "--prompt", "x"], capture_output=True, text=True, timeout=120,
                          env={**ENV, "TMPDIR": str(tmp), "XDG_RUNTIME_DIR": str(tmp_path / "run")})
    assert done.returncode == 1 and "7 nodes but only 6 layers" in done.stderr, done.stderr
    assert "node logs in" not in done.stderr, done.stderr
    assert not list(tmp.glob("tbrpc-logs-*")), list(tmp.iterdir())


def test_does_not_fit_refuses_and_stops_nodes(tmp_path: Path) -> None:
    cluster = tmp_path / "tiny.toml"
    cluster.write_text("".join(f'[[node]]\nname = "n{i}"\nhost = "127.0.0.1"\nport = 0\nmemory = "2GiB"\nkind = "cpu"\n'
                               for i in range(2)))
    launch = start_launch(tmp_path, "--gguf", str(models.ensure("llama")), "--cluster", str(cluster), "--prompt", "x")
    assert launch.finish() == 2, launch.stderr
    assert "step plan" in launch.stderr and "does not fit" in launch.stderr
    assert_gone(launch.node_pids())


def test_cluster_file_without_memory(nodes: Any, tmp_path: Path) -> None:
    """No `memory` anywhere: launch plans with what the nodes report (one it starts, one already running)."""
    want = expected("llama")
    (running,) = nodes(1)
    cluster = tmp_path / "tbrpc.toml"
    cluster.write_text('[[node]]\nname = "started"\nhost = "127.0.0.1"\nport = 0\nthreads = 1\n\n'
                       f'[[node]]\nname = "running"\nhost = "127.0.0.1"\nport = {running.port}\nstart = "manual"\n')
    launch = start_launch(tmp_path, "--gguf", str(models.ensure("llama")), "--cluster", str(cluster), "--ctx", "256",
                          "--prompt", PROMPT, "--max-tokens", str(N_TOKENS))
    assert launch.finish() == 0, launch.stderr
    assert launch.stdout == want["text"] + "\n"
    assert "tbrpc: plan: started layers 0-2, running layers 3-5" in launch.stderr, launch.stderr
    assert_gone(launch.node_pids())
    assert running.proc.poll() is None   # a node launch did not start is left running


def test_ffn_split_all_reduce_in_summary_and_status(tmp_path: Path) -> None:
    """`--split ffn` over two local nodes: the load summary names the all-reduce the split runs over
    the nodes' links (a mesh: no cables listed), and `tbrpc status` shows it per node, from the
    launch's record, in its table and its JSON, as the /tbrpc page's JSON does."""
    env = {**ENV, "XDG_RUNTIME_DIR": str(tmp_path / "run")}
    with start_launch(tmp_path, "--gguf", str(models.ensure("deepseek2-f32")), "--local", "2", "--split", "ffn",
                      "--ctx", "256", "--port", "0", env=env) as launch:
        launch.http_base()
        assert "tbrpc: all-reduce: mesh over local0, local1" in launch.stderr, launch.stderr
        status = subprocess.run([sys.executable, "-m", "tbrpc.cli", "status"], cwd=tmp_path, env=env,
                                capture_output=True, text=True, timeout=60)
        assert status.returncode == 0, status.stderr
        rows = {line.split()[0]: line for line in status.stdout.split("\n\n")[0].splitlines()[1:]}
        assert set(rows) == {"local0", "local1"} and all("; all-reduce: mesh" in r for r in rows.values()), status.stdout
        as_json = json.loads(subprocess.run([sys.executable, "-m", "tbrpc.cli", "status", "--json"], cwd=tmp_path,
                                            env=env, capture_output=True, text=True, timeout=60).stdout)
        assert [r["allreduce"] for r in as_json["nodes"]] == ["mesh", "mesh"], as_json["nodes"]
        page = http_json(f"{launch.http_base().removesuffix('/v1')}/tbrpc/status.json")   # what the /tbrpc page shows
        assert [n["allreduce"] for n in page["nodes"]] == ["mesh", "mesh"], page["nodes"]


def test_transport_per_node_in_summary_and_status(tmp_path: Path) -> None:
    """`transport = "tcp"` keeps one node on TCP; the other, on this host, gets
    shared memory. The load summary and `tbrpc status` say which and why."""
    cluster = tmp_path / "two.toml"
    cluster.write_text('[[node]]\nname = "near"\nhost = "127.0.0.1"\nport = 0\nthreads = 1\n\n'
                       '[[node]]\nname = "far"\nhost = "127.0.0.1"\nport = 0\nthreads = 1\ntransport = "tcp"\n')
    env = {**ENV, "XDG_RUNTIME_DIR": str(tmp_path / "run")}
    with start_launch(tmp_path, "--gguf", str(models.ensure("llama")), "--cluster", str(cluster), "--ctx", "256",
                      "--port", "0", env=env) as launch:
        launch.http_base()
        assert re.search(r"connected: TBRPC\d+=near \(shm \d+x\d+K\), TBRPC\d+=far \(tcp: asked for\)", launch.stderr), \
            launch.stderr
        # the link near -> far was made at load: `far` asked for TCP, so its links stay on TCP too
        assert "tbrpc: link near -> far: tcp: asked for" in launch.stderr, launch.stderr
        status = subprocess.run([sys.executable, "-m", "tbrpc.cli", "status"], cwd=tmp_path, env=env,
                                capture_output=True, text=True, timeout=60)
        assert status.returncode == 0, status.stderr
        table = status.stdout.split("\n\n")[0]   # the node table; a serving launch's paragraph follows
        rows = {line.split()[0]: line for line in table.splitlines()[1:]}
        assert set(rows) == {"near", "far"}, status.stdout
        # no request yet: no per-token figures, but the link is there
        assert re.search(r"shm \d+x\d+K; links: -> far tcp: asked for\s+-\s+launch \d+", rows["near"]), status.stdout
        assert "tcp: asked for" in rows["far"], status.stdout
        assert re.search(r"^launch \d+ \(.*\): on TCP, and why$", status.stdout, re.M), status.stdout
        for line in ("connection head -> far: tcp: asked for", "link near -> far: tcp: asked for"):   # each with its fix
            assert re.search(rf"^  {line}\n    fix: TCP was asked for \(TBRPC_TRANSPORT=tcp", status.stdout, re.M), \
                status.stdout
        as_json = subprocess.run([sys.executable, "-m", "tbrpc.cli", "status", "--json"], cwd=tmp_path, env=env,
                                 capture_output=True, text=True, timeout=60)
        by_name = {r["name"]: r for r in json.loads(as_json.stdout)["nodes"]}
        assert by_name["far"]["transport"] == "tcp: asked for" and by_name["near"]["transport"].startswith("shm ")
        assert (by_name["far"]["transport_why"], by_name["near"]["transport_why"]) == ("asked", None), by_name
        assert [(x["to"], x["transport"], x["why"]) for x in by_name["near"]["links"]] == [("far", "tcp: asked for", "asked")]
        # doctor reads the same record: what the running launch negotiated, per connection and link
        doctor = subprocess.run([sys.executable, "-m", "tbrpc.cli", "doctor", "--cluster", str(cluster)], cwd=tmp_path,
                                env=env, capture_output=True, text=True, timeout=120)
        for row in (r"far\s+connection from head", r"near\s+link to far"):
            assert re.search(rf"^{row}\s+ok\s+launch {launch.proc.pid}: tcp: asked for$", doctor.stdout, re.M), \
                doctor.stdout + doctor.stderr
        assert re.search(rf"^near\s+connection from head\s+ok\s+launch {launch.proc.pid}: shm ", doctor.stdout, re.M), \
            doctor.stdout
        assert all(r["up"] and r["clients"] >= 1 and r["bytes_allocated"] > 0 for r in by_name.values()), by_name

        # after a request, status shows what the launch's page shows, taken from the launch itself
        base = launch.http_base()
        http_json(f"{base}/completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0})
        deadline = time.monotonic() + 30   # the server counts a request once its last byte is sent, a moment after we read it
        while (page := http_json(f"{base.removesuffix('/v1')}/tbrpc/status.json"))["requests"]["count"] < 1:
            assert time.monotonic() < deadline, page["requests"]
            time.sleep(0.05)
        shown = json.loads(subprocess.run([sys.executable, "-m", "tbrpc.cli", "status", "--json"], cwd=tmp_path, env=env,
                                          capture_output=True, text=True, timeout=60).stdout)
        page_nodes = {n["endpoint"]: n for n in page["nodes"]}
        # the page's JSON: each connection and link on TCP, with the kind of its reason and its fix
        kinds = {n["name"]: [(c["what"], c["from"], c["to"], c["transport"], c["why"], c["fix"]) for c in n["on_tcp"]]
                 for n in page["nodes"]}
        assert kinds == {"far": [("connection", "head", "far", "tcp: asked for", "asked", transport_fix("asked", "head", "far"))],
                         "near": [("link", "near", "far", "tcp: asked for", "asked", transport_fix("asked", "near", "far"))]}, kinds
        text = subprocess.run([sys.executable, "-m", "tbrpc.cli", "status"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=60).stdout
        assert re.search(r"links: -> far tcp: asked for", text), text   # the first node's link to the second
        for row in shown["nodes"]:
            served, on_page = row["served"], page_nodes[row["endpoint"]]
            assert served["layers"] == on_page["layers"] and served["memory_planned"] == on_page["memory_planned"]
            assert served["bytes_per_token"] > 0, served
            # only the last node answers per token; the link near -> far was made at load, not in the request
            assert (served["round_trips_per_token"] > 0) == (row["name"] == "far"), served
            assert served["memory_used"] == row["bytes_allocated"] > 0, (served, row)   # the head's count is the node's
        (serving,) = shown["launches"]
        assert serving["pid"] == launch.proc.pid and serving["requests"]["count"] == 1, serving
        assert serving["requests"]["tokens"] == page["requests"]["tokens"] > 0, (serving, page)
        text = subprocess.run([sys.executable, "-m", "tbrpc.cli", "status"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=60).stdout
        layers = page_nodes[by_name["near"]["endpoint"]]["layers"]
        assert re.search(rf"^near .*{layers[0]}-{layers[-1]} .* trips, ", text, re.M), text
        assert f"launch {launch.proc.pid}: " in text and "1 request(s)" in text and "tok/s" in text, text
        stop_and_check(launch, signal.SIGINT, 0)


def test_context_options_are_planned_and_applied(tmp_path: Path) -> None:
    launch = start_launch(tmp_path, "--gguf", str(models.ensure("llama")), "--local", "2", "--ctx", "256",
                          "--cache-type-k", "q8_0", "--cache-type-v", "q8_0", "--threads", "1", "--ubatch", "64",
                          "--prompt", PROMPT, "--max-tokens", "4")
    assert launch.finish() == 0, launch.stderr
    assert "(context 256, KV cache q8_0/q8_0, flash attention" in launch.stderr, launch.stderr
    assert launch.stdout.strip()


def test_threads_reach_the_nodes_that_name_none(tmp_path: Path) -> None:
    assert [s.threads for s in resolve_cluster(3, threads=2)] == [2, 2, 2]
    assert [s.threads for s in resolve_cluster(2)] == [max(1, (os.cpu_count() or 1) // 2)] * 2
    path = tmp_path / "c.toml"
    path.write_text('[[node]]\nname = "a"\nhost = "127.0.0.1"\nport = 0\nthreads = 4\n\n'
                    '[[node]]\nname = "b"\nhost = "127.0.0.1"\nport = 0\n')
    assert [s.threads for s in resolve_cluster(str(path), threads=1)] == [4, 1]
    assert [s.threads for s in resolve_cluster(str(path))] == [4, 0]


def test_one_node_may_be_given_as_its_endpoint_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """tbrpc.Llama(cluster="host:port") is that one node, not a cluster file of that name (none exists)."""
    monkeypatch.chdir(tmp_path)
    [one] = resolve_cluster("10.0.0.2:50052")
    assert (one.host, one.port, one.start) == ("10.0.0.2", 50052, "manual")
    with pytest.raises(ClusterError, match="nodes.toml"):   # not an endpoint: still a cluster file, named
        resolve_cluster("nodes.toml")
    (tmp_path / "h:1").write_text('[[node]]\nname = "a"\nhost = "127.0.0.1"\nport = 7\n')
    assert [s.port for s in resolve_cluster("h:1")] == [7]   # a file of that name wins


@pytest.mark.parametrize("draft", [("--draft", "prompt-lookup:6"), ("--draft-model", "SELF", "--draft-tokens", "4")])
def test_speculative_decoding_keeps_greedy_output(draft: tuple[str, ...], tmp_path: Path) -> None:
    """Guessed tokens are checked by the split model in batches; on this prompt no choice is close enough for
    a batch's rounding to flip it, so the text is one-token greedy decoding's (test_llama_dropin.py checks
    what holds on a prompt where one flips)."""
    model = str(models.ensure("gemma"))
    want = expected("gemma", 24)["text"]
    args = [model if a == "SELF" else a for a in draft]
    launch = start_launch(tmp_path, "--gguf", model, "--local", "2", "--ctx", "256", *args,
                          "--prompt", PROMPT, "--max-tokens", "24")
    assert launch.finish(timeout=180) == 0, launch.stderr
    assert launch.stdout == want + "\n"
    assert "speculative decoding:" in launch.stderr, launch.stderr


def test_bad_draft_options_start_nothing(tmp_path: Path) -> None:
    for args, message in [(("--draft", "lookahead"), "expected prompt-lookup or prompt-lookup:N"),
                          (("--draft-model", str(models.ensure("llama"))), "a draft must share the model's vocabulary")]:
        launch = start_launch(tmp_path, "--gguf", str(models.ensure("gemma")), "--local", "2", *args, "--prompt", "x")
        assert launch.finish() == 1 and message in launch.stderr, launch.stderr
        assert "node(s); node logs" not in launch.stderr   # refused before any node started


def test_an_unknown_cache_type_starts_nothing(tmp_path: Path) -> None:
    launch = start_launch(tmp_path, "--gguf", str(models.ensure("llama")), "--local", "2", "--cache-type-v", "q9_9",
                          "--prompt", "x")
    assert launch.finish() == 2
    assert "'q9_9': choose one of f32, f16" in launch.stderr and not launch.node_pids()


def test_not_a_model_starts_nothing(tmp_path: Path) -> None:
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a gguf" * 100)
    launch = start_launch(tmp_path, "--gguf", str(bogus), "--local", "2", "--prompt", "x")
    assert launch.finish() == 1
    assert "step plan" in launch.stderr and "not a GGUF" in launch.stderr
    assert "starting" not in launch.stderr and not launch.node_pids()


def test_missing_http_server_package_starts_nothing(tmp_path: Path) -> None:
    """Serving is the main job: a broken environment is named before a node starts or the model is read."""
    shadow = tmp_path / "shadow" / "uvicorn"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'uvicorn'\", name='uvicorn')\n")
    launch = start_launch(tmp_path, "--gguf", str(models.ensure("llama")), "--local", "2", "--port", "0",
                          shadow=shadow.parent)
    assert launch.finish() == 1, launch.stderr
    assert "(uvicorn is missing)" in launch.stderr and "pip install 'llama-cpp-python[server]==0.3.36'" in launch.stderr
    assert "node(s)" not in launch.stderr and not launch.node_pids()


def test_port_in_use_starts_nothing(tmp_path: Path) -> None:
    """The HTTP port is taken before the nodes start: one in use is said at once, not after the load."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        launch = start_launch(tmp_path, "--gguf", str(models.ensure("llama")), "--local", "2", "--port", str(port))
        assert launch.finish() == 1, launch.stderr
    assert f"step serve: cannot listen on 127.0.0.1:{port}: Address already in use" in launch.stderr, launch.stderr
    assert "node(s)" not in launch.stderr and not launch.node_pids()


def test_unreachable_manual_node_names_node_and_step(tmp_path: Path) -> None:
    cluster = tmp_path / "c.toml"
    cluster.write_text('[[node]]\nname = "far"\nhost = "127.0.0.1"\nport = 1\nmemory = "8GiB"\nstart = "manual"\n')
    launch = start_launch(tmp_path, "--gguf", str(models.ensure("llama")), "--cluster", str(cluster),
                          "--start-timeout", "2", "--prompt", "x")
    assert launch.finish() == 1
    assert "node far (127.0.0.1:1), step handshake" in launch.stderr
    assert "try: is the node running" in launch.stderr


def test_a_node_that_never_listens_is_named_with_the_time_waited(tmp_path: Path) -> None:
    """A node started here whose process never listens (its `python` sleeps): launch gives up at
    --start-timeout and says how long it waited, not the default timeout."""
    sleeper = tmp_path / "sleeper"
    sleeper.write_text("#!/bin/sh\nexec sleep 30\n")
    sleeper.chmod(0o755)
    cluster = tmp_path / "c.toml"
    cluster.write_text(f'[[node]]\nname = "mute"\nhost = "127.0.0.1"\nport = 0\nmemory = "8GiB"\n'
                       f'python = "{sleeper}"\n')
    launch = start_launch(tmp_path, "--gguf", str(models.ensure("llama")), "--cluster", str(cluster),
                          "--start-timeout", "2", "--prompt", "x")
    assert launch.finish() == 1, launch.stderr
    assert "node mute" in launch.stderr and "not listening after 2 s" in launch.stderr, launch.stderr


def _manual_cluster(tmp_path: Path, port: int, top: str = "") -> Path:
    """A cluster file of one node started by hand, "far", on this machine's `port`."""
    cluster = tmp_path / "manual.toml"
    cluster.write_text(f'{top}[[node]]\nname = "far"\nhost = "127.0.0.1"\nport = {port}\nmemory = "8GiB"\n'
                       'start = "manual"\n')
    return cluster


def test_manual_node_not_running_is_said_at_once_with_its_command(tmp_path: Path) -> None:
    """Launch says at its first try that it waits for a node started by hand, and the exact command
    that starts it (--name, and --secret-file as the cluster has a secret); then it waits as long as before."""
    secret = tbrpc_secret.new(tmp_path / "secret")
    port = free_port()
    cluster = _manual_cluster(tmp_path, port, top=f'secret_file = "{secret}"\n\n')
    launch = start_launch(tmp_path, "--gguf", str(models.ensure("llama")), "--cluster", str(cluster),
                          "--start-timeout", "3", "--prompt", "x")
    command = f"tbrpc node --host 127.0.0.1 --port {port} --name far --secret-file {secret}"
    line = (f'tbrpc: node far: waiting up to 3 s for it to answer at 127.0.0.1:{port} (start = "manual": '
            f"launch does not start it); start it there: {command}\n")
    launch.wait_for(re.escape(line))
    said = time.monotonic()
    assert launch.finish() == 1, launch.stderr
    assert time.monotonic() - said > 2, "the line came at the timeout, not at the first try"
    timeout = f"node far (127.0.0.1:{port}), step handshake"
    assert launch.stderr.index(line) < launch.stderr.index(timeout), launch.stderr
    assert f"start it there by hand: {command};" in launch.stderr   # the timeout's hint: the same command


@pytest.mark.parametrize("args, warned", [(("--chat",), True), (("--port", "0"), True),
                                          (("--chat", "--chat-format", "gemma"), False), (("--prompt", "x"), False)],
                         ids=["chat", "serve", "chat-format-given", "prompt"])
def test_a_model_without_chat_template_names_a_chat_format(args: tuple[str, ...], warned: bool,
                                                           tmp_path: Path) -> None:
    """Gemma's GGUF has no chat template: chats (terminal or HTTP) without --chat-format are warned,
    naming llama-cpp-python's gemma format, before anything starts (here: a node that never answers)."""
    gguf = models.ensure("gemma")
    launch = start_launch(tmp_path, "--gguf", str(gguf), "--cluster", str(_manual_cluster(tmp_path, free_port())),
                          "--start-timeout", "0.5", *args, stdin_text="")
    assert launch.finish() == 1, launch.stderr
    warning = (f"tbrpc: warning: {gguf.name} has no chat template (tokenizer.chat_template): chats would use "
               "llama-cpp-python's fallback, the llama-2 format, which a gemma3 model may answer with nothing; "
               "try --chat-format gemma\n")
    if warned:
        assert warning in launch.stderr and launch.stderr.index(warning) < launch.stderr.index("node(s)"), launch.stderr
    else:
        assert "chat template" not in launch.stderr, launch.stderr


def test_ctrl_c_in_the_first_moment_exits_130(tmp_path: Path) -> None:
    """SIGINT while the launch command imports llama-cpp-python, before tbrpc/launch.py has run a line:
    launch's own message and 130, not click's `Aborted!` and 1. A signal sent from outside cannot be
    timed into that window deterministically, so the process raises it itself, at the import (a
    sitecustomize on its path: a real SIGINT through whatever handler is installed then)."""
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "sitecustomize.py").write_text(
        "import signal, sys\n"
        "class SigintAtImport:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'llama_cpp':\n"
        "            sys.meta_path.remove(self)\n"
        "            signal.raise_signal(signal.SIGINT)\n"
        "        return None\n"
        "sys.meta_path.insert(0, SigintAtImport())\n")
    launch = start_launch(tmp_path, "--gguf", str(models.ensure("llama")), "--local", "2", "--prompt", "x",
                          shadow=shadow)
    assert launch.finish() == 130, launch.stderr
    assert launch.stderr.endswith("tbrpc: interrupted (SIGINT) during step start; stopping the nodes\n"), launch.stderr
    assert "Aborted!" not in launch.stderr and "node(s)" not in launch.stderr and not launch.node_pids()


# --- failures during load and generation -----------------------------------------------


def _pause_node_1(launch: Launch) -> list[int]:
    """Once the nodes are connected, SIGSTOP node 1 (and its per-client workers) so the load cannot finish."""
    launch.wait_for(r"tbrpc: connected: .*; loading")
    tree = with_descendants([launch.node_pids()[1]])
    for pid in tree:
        os.kill(pid, signal.SIGSTOP)
    time.sleep(0.5)
    assert "model loaded" not in launch.stderr, "the load finished before the node was paused"
    return tree


def test_ctrl_c_during_load(tmp_path: Path) -> None:
    pids_before = None
    with start_launch(tmp_path, "--gguf", str(models.ensure("gemma")), "--local", "2", "--ctx", "256",
                      "--port", "0") as launch:
        paused = _pause_node_1(launch)
        pids_before = with_descendants(launch.node_pids())
        launch.proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
        for pid in paused:    # the load goes on, and stops at its next progress report
            os.kill(pid, signal.SIGCONT)
        assert launch.finish() == 130, launch.stderr
        assert "interrupted (SIGINT) during step load" in launch.stderr
        assert "serving" not in launch.stderr
    assert_gone(pids_before or [])


def test_node_killed_during_load(tmp_path: Path) -> None:
    launch = start_launch(tmp_path, "--gguf", str(models.ensure("gemma")), "--local", "2", "--ctx", "256", "--port", "0")
    paused = _pause_node_1(launch)
    pids = with_descendants(launch.node_pids())
    os.kill(paused[0], signal.SIGKILL)    # the node process; its workers go with it
    assert launch.finish() == 1, launch.stderr
    assert "step load" in launch.stderr and "local1" in launch.stderr, launch.stderr
    assert_gone(pids)


def generating_launch(tmp_path: Path) -> tuple[Any, list[int]]:
    """A Gemma launch over 2 nodes that has started printing its completion, and its node PIDs."""
    launch = start_launch(tmp_path, "--gguf", str(models.ensure("gemma")), "--local", "2", "--ctx", "256",
                          "--prompt", "Once upon a time", "--max-tokens", "200")
    launch.wait_for(r"model loaded")
    deadline = time.monotonic() + 60
    while not launch.stdout.strip() and time.monotonic() < deadline:
        time.sleep(0.02)
    return launch, with_descendants(launch.node_pids())


def test_node_killed_during_generation(tmp_path: Path) -> None:
    launch, pids = generating_launch(tmp_path)
    os.kill(launch.node_pids()[1], signal.SIGKILL)
    assert launch.finish() == 1, launch.stderr
    assert "step generate" in launch.stderr and "127.0.0.1:" in launch.stderr, launch.stderr
    assert_gone(pids)


def test_upstream_node_killed_during_generation_is_blamed(tmp_path: Path) -> None:
    """local1 only waits for local0's activations when local0 dies: the error names local0 and its
    log, and says what local1 saw."""
    launch, pids = generating_launch(tmp_path)
    os.kill(launch.node_pids()[0], signal.SIGKILL)
    assert launch.finish() == 1, launch.stderr
    m = re.search(r"tbrpc: node (\S+) \(127\.0\.0\.1:\d+\), step generate: (.*)\n  try: its log: (\S+);", launch.stderr)
    assert m, launch.stderr
    assert m.group(1) == "local0" and m.group(3).endswith("local0.log"), launch.stderr
    assert m.group(2).startswith("the node process was killed by SIGKILL (the kernel's out-of-memory killer, or kill -9); "
                                 "node local1 (127.0.0.1:"), launch.stderr
    assert not re.search(r"^tbrpc node ", launch.stderr, re.M), launch.stderr   # the error once, explained
    assert_gone(pids)


def test_stopped_upstream_node_is_blamed_and_launch_exits_at_once(tmp_path: Path) -> None:
    """local0 SIGSTOPped (with its workers) has not exited: local1 gives up waiting for its activations
    after the stall timeout, and names it as data (NodeError.peer); launch blames local0 and exits
    without waiting out the stop timeout for a node that cannot see its SIGTERM."""
    launch, pids = generating_launch(tmp_path)
    stopped = with_descendants([launch.node_pids()[0]])
    try:
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        launch.wait_for(r"step generate", timeout=60)
        said = time.monotonic()
        assert launch.finish() == 1, launch.stderr
        assert time.monotonic() - said < 5, launch.stderr
    finally:
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    m = re.search(r"tbrpc: node (\S+) \(127\.0\.0\.1:\d+\), step generate: (.*)\n  try: its log: (\S+);", launch.stderr)
    assert m, launch.stderr
    assert m.group(1) == "local0" and m.group(3).endswith("local0.log"), launch.stderr
    assert m.group(2).startswith("node local1 (127.0.0.1:"), launch.stderr
    assert "waiting for activations from node" in m.group(2), launch.stderr
    assert_gone(pids)


def test_ctrl_c_during_generation(tmp_path: Path) -> None:
    launch, pids = generating_launch(tmp_path)
    launch.proc.send_signal(signal.SIGINT)
    assert launch.finish() == 130, launch.stderr
    assert "interrupted (SIGINT) during step generate" in launch.stderr
    assert_gone(pids)


# --- over ssh ------------------------------------------------------------------------------


def test_launch_over_ssh(tmp_path: Path) -> None:
    """Two nodes started through the system's ssh client (to a private sshd on localhost)."""
    sshd = start_sshd(tmp_path)
    if isinstance(sshd, str):
        pytest.skip(sshd)
    try:
        python = python_wrapper(tmp_path)
        ssh = (f'ssh = {{ host = "127.0.0.1", port = {sshd.port}, key = "{sshd.key}", options = '
               f'["StrictHostKeyChecking=accept-new", "UserKnownHostsFile={sshd.known_hosts}"] }}\n')
        cluster = tmp_path / "tbrpc.toml"
        cluster.write_text("".join(
            f'[[node]]\nname = "ssh{i}"\nhost = "127.0.0.1"\nport = {free_port()}\nmemory = "4GiB"\nkind = "cpu"\n'
            f'threads = 1\npython = "{python}"\n{ssh}' for i in range(2)))
        want = expected("llama")
        launch = start_launch(tmp_path, "--gguf", str(models.ensure("llama")), "--ctx", "256", "--port", "0")
        base = launch.http_base()
        assert "starting (ssh 127.0.0.1)" in launch.stderr
        out = http_json(f"{base}/completions", {"prompt": PROMPT, "max_tokens": N_TOKENS, "temperature": 0,
                                                "repeat_penalty": 1.0})
        assert out["choices"][0]["text"] == want["text"]
        assert len(launch.node_pids()) == 2
        pids = with_descendants(launch.node_pids())
        # SIGKILL launch: the ssh clients see their stdin close, the remote nodes theirs.
        launch.proc.kill()
        launch.finish()
        assert_gone(pids)
    finally:
        sshd.stop()


def test_cli_help_lists_commands() -> None:
    out = subprocess.run([sys.executable, "-m", "tbrpc.cli", "--help"], env=ENV, capture_output=True, text=True).stdout
    for command in ("launch", "doctor", "status", "node"):
        assert command in out


def test_links_choose_the_address_a_node_is_dialled_at(tmp_path: Path) -> None:
    """`links` in b's table: a reaches b at that address for activations. At an
    address where b does not listen, a says so in its log and the activations
    go through the head: the same text either way."""
    want = expected("llama")
    cluster = tmp_path / "two.toml"
    cluster.write_text('[[node]]\nname = "a"\nhost = "127.0.0.1"\nport = 0\nthreads = 1\n\n'
                       '[[node]]\nname = "b"\nhost = "127.0.0.1"\nport = 0\nthreads = 1\n'
                       'links = { a = "127.0.0.9" }\n')
    with start_launch(tmp_path, "--gguf", str(models.ensure("llama")), "--cluster", str(cluster), "--ctx", "256",
                      "--prompt", PROMPT, "--max-tokens", str(N_TOKENS)) as launch:
        assert launch.finish() == 0, launch.stderr
        assert launch.stdout == want["text"] + "\n"
    logs = {log.stem: log.read_text() for log in launch.log_dir.glob("*.log")}
    assert "cannot reach peer 127.0.0.9:" in logs["a"], logs
    # the load summary says so too: the link was tried at load, and there is none
    assert re.search(r"^tbrpc: link a -> b: none: cannot reach 127\.0\.0\.9:\d+ \(", launch.stderr, re.M), launch.stderr


def test_the_served_model_is_freed_without_the_garbage_collector() -> None:
    """The wrappers serving puts on a model (logprobs refused, a gone client stops the completion)
    hold no reference to it: a closed model goes as its last reference does. With a reference
    cycle it waited for the cyclic collector, which in a serving launch can take many reloads,
    each model keeping its arrays and its progress bar's copy of stderr (benchmarks/soak.py)."""
    import gc
    import weakref

    from tbrpc.abandoned import stop_when_client_gone
    from tbrpc.serve import refuse_logprobs

    class Model:
        _logits_all = False

        def create_completion(self, prompt: str, **kwargs: Any) -> str:
            return f"{prompt}!"

    gc.disable()
    try:
        model = Model()
        wrapped = stop_when_client_gone(refuse_logprobs(model))
        assert wrapped is model and model.create_completion(prompt="x") == "x!"
        gone = weakref.ref(model)
        del model, wrapped
        assert gone() is None, "a reference cycle keeps the model"
    finally:
        gc.enable()
