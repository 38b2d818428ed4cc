"""The life of vLLM servers around a run, checked without vLLM (tests/fake_vllm_server.py stands
in for it): a wrong or unreachable rollout.vllm.urls fails at once, naming the URL and what was
seen, and a server that loads is waited for with progress; a server that stops answering in the
middle of a run fails it promptly, and nothing waits on its stuck requests at exit; SIGTERM stops
the servers a run launched, as Ctrl-C does; a port that lingers in TIME_WAIT after a server
stopped is free to launch on."""

import contextlib
import errno
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from fake_vllm_server import FakeVLLMServer, vllm_package

from archon.rollout import vllm_server
from archon.rollout.vllm import VLLMConfig, VLLMRolloutEngine
from archon.rollout.vllm_network import VLLMServerError, check_port_free, free_port, probe_health

# the servers start as a run's do (tests/conftest.py: other modules' servers run the model in the engine core)
pytestmark = pytest.mark.usefixtures("vllm_production_layout")

REPO = Path(__file__).resolve().parents[1]
FAKE_SERVER = REPO / "tests" / "fake_vllm_server.py"


@contextlib.contextmanager
def _loopback_listener(handle):
    """A loopback socket that runs `handle(connection)` on each connection it accepts, on a thread
    of its own; yields its http:// URL."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    connections = []

    def serve(connection: socket.socket) -> None:
        with contextlib.suppress(OSError):  # the connection is closed under it at the end
            handle(connection)

    def accept() -> None:
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:  # closed
                return
            connections.append(connection)
            threading.Thread(target=serve, args=(connection,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()
        for connection in connections:
            connection.close()


@contextlib.contextmanager
def _fake_vllm(**options):
    server = FakeVLLMServer("127.0.0.1", 0, **options)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def _connect(url: str, **options) -> VLLMRolloutEngine:
    config = VLLMConfig(urls=(url,), startup_timeout_s=20.0, health_timeout_s=1.0, **options)
    return VLLMRolloutEngine(config)


def _closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def _send_garbage(connection: socket.socket) -> None:
    connection.recv(65536)
    connection.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")
    connection.close()


def _never_answer(connection: socket.socket) -> None:
    while connection.recv(65536):
        pass


def _answer_404(connection: socket.socket) -> None:
    connection.recv(65536)
    connection.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 9\r\nConnection: close\r\n\r\nnot found")
    connection.close()


# ---- servers given by URL: fail at once on what a vLLM server never does -----------------------
@pytest.mark.parametrize(
    "where, seen",
    [
        ("closed-port", "the connection was refused: nothing listens on that port"),
        ("garbage", "it answered GET /health with something that is not HTTP"),
        ("silent", "it accepted the connection but did not answer GET /health within 1 s"),
        ("not-vllm", "it answered GET /health with HTTP 404"),
        ("unresolvable", "its host name does not resolve"),
    ],
)
def test_an_unusable_server_url_fails_at_once_naming_it(where, seen):
    handlers = {"garbage": _send_garbage, "silent": _never_answer, "not-vllm": _answer_404}
    with contextlib.ExitStack() as stack:
        if where == "closed-port":
            url = _closed_port()
        elif where == "unresolvable":
            url = "http://no-such-host.invalid:8000"
        else:
            url = stack.enter_context(_loopback_listener(handlers[where]))
        start = time.monotonic()
        with pytest.raises(VLLMServerError) as error:
            _connect(url)
    message = str(error.value)
    assert message.startswith(f"vLLM server {url} (rollout.vllm.urls) cannot be used: {seen}"), message
    assert time.monotonic() - start < 10  # not the 20 s startup timeout


def test_an_http_server_that_is_not_vllm_is_named():
    """/health answers 200 (many servers have one), but the model list is not vLLM's."""

    def html_everywhere(connection: socket.socket) -> None:
        while request := connection.recv(65536):
            body = b"OK" if request.startswith(b"GET /health ") else b"<html>welcome</html>"
            connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))

    with _loopback_listener(html_everywhere) as url, pytest.raises(VLLMServerError) as error:
        _connect(url)
    expected = f"vLLM server {url} answered GET /v1/models with '<html>welcome</html>', which is not a vLLM server's"
    assert str(error.value).startswith(expected), str(error.value)


def test_a_url_must_be_a_server_address():
    with pytest.raises(ValueError, match=r"rollout.vllm.urls\[1\]='localhost:8000': expected a server's address"):
        VLLMConfig(urls=("http://127.0.0.1:8000", "localhost:8000"))
    with pytest.raises(ValueError, match=r"rollout.vllm.urls\[0\]='http://h:8000/v1': expected .* \(no path"):
        VLLMConfig(urls=("http://h:8000/v1",))


def test_a_server_that_is_still_loading_is_waited_for_with_progress(monkeypatch, capsys):
    """HTTP 503 on /health is what vLLM's servers answer while they load: waited for, saying so."""
    monkeypatch.setattr(vllm_server, "PROGRESS_EVERY_S", 0.0)
    with _fake_vllm(not_ready_probes=2, model="m") as server:
        engine = _connect(server.url)
        engine.close()
    assert engine.served_model == "m"
    progress = capsys.readouterr().out
    assert f"waiting for vLLM server {server.url} to start: " in progress, progress
    assert "it answers GET /health with HTTP 503 (not ready)" in progress, progress


# ---- a server that stops answering during the run ----------------------------------------------
def _wait_healthy(url: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 30
    while probe_health(url, 1.0)[0] != "healthy":
        assert process.poll() is None and time.monotonic() < deadline, "the fake server did not start"
        time.sleep(0.1)


def test_a_stopped_server_fails_generation_promptly_naming_it_and_the_process_exits(tmp_path):
    """The server is stopped (SIGSTOP) after it answered once: the next generation fails within
    about two health timeouts, naming the server, and the trainer process exits at once instead of
    waiting out the request stuck on it (request_timeout_s, an hour by default)."""
    port = free_port("127.0.0.1")
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, str(FAKE_SERVER), "--port", str(port)])
    trainer = f"""
import os, signal, time
from archon.rollout.base import SamplingParams
from archon.rollout.vllm import VLLMConfig, VLLMRolloutEngine
from archon.rollout.vllm_server import VLLMServerError

engine = VLLMRolloutEngine(VLLMConfig(urls=({url!r},), health_timeout_s=1.0))
sampling = SamplingParams(max_new_tokens=1, n=2)
assert len(engine.generate([[1, 2], [3]], sampling)) == 4
os.kill({server.pid}, signal.SIGSTOP)
start = time.monotonic()
try:
    engine.generate([[1, 2], [3]], sampling)
except VLLMServerError as error:
    print(f"failed after {{time.monotonic() - start:.0f}} s: {{error}}", flush=True)
finally:
    engine.close()
"""
    try:
        _wait_healthy(url, server)
        start = time.monotonic()
        result = subprocess.run([sys.executable, "-c", trainer], cwd=REPO, capture_output=True, text=True, timeout=60)
        elapsed = time.monotonic() - start
    finally:
        server.send_signal(signal.SIGCONT)
        server.kill()
        server.wait()
    assert result.returncode == 0, result.stderr[-3000:]
    assert (
        f"vLLM server {url} stopped answering: it accepted the connection but did not answer GET /health within 1 s"
        in result.stdout
    ), result.stdout + result.stderr[-3000:]
    assert elapsed < 30, elapsed


# ---- SIGTERM ------------------------------------------------------------------------------------
def test_sigterm_stops_the_servers_the_run_launched(tmp_path):
    """The recipe launches its server (the fake one, where archon's launch finds vLLM) and waits on
    a generation that never ends; SIGTERM, as Slurm and Kubernetes send, then stops the run as
    Ctrl-C does, and the server's process group (its own session, which the signal does not reach)
    is gone with it."""
    from helpers import tiny_char_checkpoint

    from archon.rl.tasks import ArithmeticTaskConfig, arithmetic_splits, write_jsonl

    model, _ = tiny_char_checkpoint(
        "qwen3", tmp_path / "model", head_dim=32, max_position_embeddings=64, use_sliding_window=False
    )
    train, _ = arithmetic_splits(ArithmeticTaskConfig(operations=("+",), num_train=8, num_held_out=4))
    write_jsonl(train, tmp_path / "train.jsonl")
    state = tmp_path / "server_state"
    state.mkdir()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(vllm_package(tmp_path / "fake_vllm")), str(REPO)]),
        "FAKE_VLLM_STATE": str(state),
        "FAKE_VLLM_HANG_COMPLETIONS": "1",
        "OMP_NUM_THREADS": "1",
    }
    args = [
        "--model.path",
        str(model),
        "--data.path",
        str(tmp_path / "train.jsonl"),
        "--rollout.engine",
        "vllm",
        "--rollout.vllm.port",
        str(free_port("127.0.0.1")),
        "--logging.run-dir",
        str(tmp_path / "run"),
        "--steps",
        "2",
        "--rollout.prompts-per-step",
        "2",
        "--rollout.group-size",
        "2",
        "--rollout.max-new-tokens",
        "4",
        "--lora.rank",
        "8",
        "--eval.every",
        "0",
        "--reward.num-workers",
        "0",
        "--logging.no-progress",
        "--logging.backends",
    ]
    trainer = subprocess.Popen(
        [sys.executable, str(REPO / "recipes" / "grpo_lora.py"), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    server_pid = None
    try:
        deadline = time.monotonic() + 120
        while not (state / "completion").exists():  # the run generates on its server
            assert trainer.poll() is None, trainer.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "the run did not reach its first generation"
            time.sleep(0.2)
        server_pid = int((state / "pid").read_text())
        trainer.send_signal(signal.SIGTERM)
        output = trainer.communicate(timeout=60)[0]
        assert "Terminated: received SIGTERM" in output, output[-3000:]
        with pytest.raises(ProcessLookupError):
            os.killpg(server_pid, 0)  # the launched server's whole process group
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
        if server_pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server_pid, signal.SIGKILL)


def test_the_sigterm_handler_is_the_blocks_own_and_the_main_threads_only():
    from archon.rl.interrupt import Terminated, terminate_as_interrupt

    before = signal.getsignal(signal.SIGTERM)
    with terminate_as_interrupt(), pytest.raises(Terminated, match="received SIGTERM"):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises on the main thread at once
    assert signal.getsignal(signal.SIGTERM) is before
    seen = []

    def off_the_main_thread() -> None:
        with terminate_as_interrupt():
            seen.append(signal.getsignal(signal.SIGTERM))

    thread = threading.Thread(target=off_the_main_thread)
    thread.start()
    thread.join()
    assert seen == [before]


# ---- the free-port check ------------------------------------------------------------------------
def test_a_port_in_time_wait_after_a_server_stopped_is_free():
    """The server side closes its connection first, so its port is left in TIME_WAIT: a plain bind
    is refused for about a minute, but servers (vLLM's, uvicorn) bind with SO_REUSEADDR, which
    Linux lets reuse such a port when the old socket had it too, and so does the check."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = listener.accept()
    accepted.close()  # the server's side closes first: its end goes to TIME_WAIT
    client.recv(1)  # the server's FIN
    client.close()
    listener.close()
    with socket.socket() as plain, pytest.raises(OSError) as refused:
        plain.bind(("127.0.0.1", port))
    assert refused.value.errno == errno.EADDRINUSE  # the port is in TIME_WAIT, as after a server stops
    check_port_free("127.0.0.1", port)
