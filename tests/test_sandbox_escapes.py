"""Escapes from the python tool's sandbox, each tried from inside a call, each expected to fail.

The calls run as a run's agent runs them: the built-in `python` tool in a ToolRunner worker. This
test process stands in for the trainer: its pid, a run directory with a metrics.jsonl, a secret in
its environment, a TCP port on the host. Reward-function workers, which run user code in-process,
are held to their part: no pickle reaches the trainer from them, and no secret reaches them.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest

from archon.agents import sandbox
from archon.agents.sandbox import PYTHON_TOOL, SandboxLimits, python_tool, run_python
from archon.agents.tools import Tool, ToolCall, ToolRunner
from archon.rl.rewards import RewardConfig, RewardScorer

SECRET = "sk-archon-planted-4f1c9e"
SLEEP_TOKEN = "31.4159"
"""A `sleep` duration no other process on the machine uses: how a surviving process is found."""


@pytest.fixture
def runner(monkeypatch):
    """One worker with the python tool, started with a secret in the trainer's environment."""
    monkeypatch.setenv("ARCHON_TEST_API_KEY", SECRET)
    with ToolRunner([PYTHON_TOOL], timeout_s=20.0, num_workers=1) as runner:
        runner.call(ToolCall("python", {"code": "pass"}))  # the worker is up
        yield runner


def run_tool(runner: ToolRunner, code: str) -> str:
    result = runner.call(ToolCall("python", {"code": textwrap.dedent(code)}))
    assert result.status in ("ok", "output_truncated"), result
    return result.content


def worker_pid(runner: ToolRunner) -> int:
    return runner._workers[0].proc.pid


def processes_with(token: str) -> list[int]:
    """The pids of this machine's processes whose command line holds `token`."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as file:
                    if token.encode() in file.read():
                        found.append(int(entry))
            except OSError:
                pass
    return found


def test_a_pickle_written_into_the_workers_pipes_runs_nothing_in_the_trainer(runner, tmp_path):
    marker = tmp_path / "ran-in-the-trainer"
    code = f"""
        import os, pickle, struct
        class Payload:
            def __reduce__(self):
                return (open, ({str(marker)!r}, "w"))
        data = pickle.dumps(Payload())
        frame = struct.pack(">Q", len(data)) + data
        written = []
        for pid in ({worker_pid(runner)}, {os.getpid()}, os.getppid()):
            try:
                fds = os.listdir(f"/proc/{{pid}}/fd")
            except OSError as exc:
                print("no fds of", pid, type(exc).__name__)
                continue
            for fd in fds:
                path = f"/proc/{{pid}}/fd/{{fd}}"
                try:
                    if os.readlink(path).startswith("pipe:"):
                        with open(path, "wb") as pipe:
                            pipe.write(frame)
                        written.append(path)
                except OSError:
                    pass
        print("written", written)
    """
    output = run_tool(runner, code)
    assert "written []" in output, output
    run_tool(runner, "print('next call')")  # a frame left in a pipe would be read now
    assert not marker.exists()


def test_the_sandbox_cannot_kill_or_freeze_the_trainer_or_its_worker(runner):
    trainer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # a stand-in
    try:
        code = f"""
            import os, signal
            for pid, sig in (({trainer.pid}, signal.SIGSTOP), ({worker_pid(runner)}, signal.SIGKILL),
                             ({trainer.pid}, signal.SIGKILL), (os.getppid(), signal.SIGKILL)):
                try:
                    os.kill(pid, sig)
                    print("signalled", pid, sig.name)
                except OSError as exc:
                    print("refused", pid, type(exc).__name__)
        """
        pid_before = worker_pid(runner)
        output = run_tool(runner, code)
        with open(f"/proc/{trainer.pid}/stat") as file:
            state = file.read().rsplit(")", 1)[1].split()[0]
        assert trainer.poll() is None and state in ("S", "R"), (state, output)
        assert runner._workers[0].alive and worker_pid(runner) == pid_before, output
        assert "signalled" not in output.replace("signalled 1 ", ""), output  # its own PID 1 ignores it
    finally:
        trainer.kill()
        trainer.wait()


def test_the_run_directory_is_neither_readable_nor_writable(runner, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    metrics = run_dir / "metrics.jsonl"
    metrics.write_text('{"step": 1}\n')
    (run_dir / "config.json").write_text(json.dumps({"api_key": SECRET}))
    other_run = tmp_path / "other_run"
    other_run.mkdir()
    (other_run / "notes.txt").write_text(f"the other run's {SECRET}")
    outside = f"archon-escape-{os.getpid()}-{time.monotonic_ns()}.txt"
    code = f"""
        import os
        for line in range(15):
            try:
                with open({str(metrics)!r}, "a") as file:
                    file.write('{{"step": 999}}\\n')
            except OSError as exc:
                print("append refused:", type(exc).__name__)
                break
        for path in ({str(run_dir / "injected.txt")!r}, "/tmp/{outside}", "/usr/{outside}", "/{outside}",
                     os.path.expanduser("~/../{outside}")):
            try:
                with open(path, "w") as file:
                    file.write("x" * 1000)
                print("wrote", path)
            except OSError as exc:
                print("write refused:", type(exc).__name__)
        for path in ({str(run_dir / "config.json")!r}, {str(other_run / "notes.txt")!r}, "/root/.bashrc",
                     "/proc/{os.getpid()}/cmdline", "/proc/{os.getpid()}/environ"):
            try:
                print(open(path, errors="replace").read())
            except OSError as exc:
                print("read refused:", type(exc).__name__)
        print(sorted(os.listdir({str(tmp_path)!r})) if os.path.exists({str(tmp_path)!r}) else "no such dir")
    """
    output = run_tool(runner, code)
    assert metrics.read_text() == '{"step": 1}\n', output
    assert sorted(os.listdir(run_dir)) == ["config.json", "metrics.jsonl"]
    assert not any(os.path.exists(f"{directory}/{outside}") for directory in ("/tmp", "/usr", "", "/root/.."))
    assert "wrote" not in output and SECRET not in output and "pytest" not in output, output
    assert output.count("read refused") == 5 and "no such dir" in output, output


def test_the_hosts_files_are_not_visible(runner):
    with open("/etc/passwd") as file:
        host_users = [line.split(":")[0] for line in file if not line.startswith("root:")]
    output = run_tool(runner, "import os\nprint(open('/etc/passwd').read())\nprint(sorted(os.listdir('/')))")
    assert host_users and not any(f"\n{user}:" in "\n" + output for user in host_users), output
    system = {"proc", "scratch", "dev", "etc", "usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32"}
    interpreter = {path.split("/")[1] for path in sandbox._visible_paths()}  # the top of its installation's path
    top = set(json.loads(output.strip().splitlines()[-1].replace("'", '"')))
    assert top <= system | interpreter and set(os.listdir("/")) - top, output  # the host has more


def test_one_call_cannot_read_another_calls_scratch(monkeypatch):
    monkeypatch.setenv("ARCHON_TEST_API_KEY", SECRET)
    answer = "the answer is 424242"
    writer = f"""
        import os, time
        with open("answer.txt", "w") as file:
            file.write({answer!r})
        print(os.getcwd())
        time.sleep(4)
    """
    reader = """
        import glob, os, time
        time.sleep(1.5)
        found = glob.glob("/tmp/*/answer.txt") + glob.glob("/scratch/answer.txt") + glob.glob("/*/*/answer.txt")
        print("found", found, [open(path).read() for path in found])
    """
    with ToolRunner([PYTHON_TOOL], timeout_s=20.0, num_workers=2) as runner:
        calls = [ToolCall("python", {"code": textwrap.dedent(code)}) for code in (writer, reader)]
        results = runner.call_many(calls)
    assert all(result.status == "ok" for result in results), results
    assert "found [] []" in results[1].content and answer not in results[1].content, results[1]


def test_no_secret_of_the_trainers_environment_reaches_the_code(runner):
    code = f"""
        import os
        print(dict(os.environ))
        for pid in ("self", "1", os.getppid(), {worker_pid(runner)}, {os.getpid()}):
            try:
                print(open(f"/proc/{{pid}}/environ", "rb").read())
            except OSError as exc:
                print("refused", pid, type(exc).__name__)
    """
    output = run_tool(runner, code)
    assert SECRET not in output and "ARCHON_TEST_API_KEY" not in output, output
    assert "'HOME': '/scratch'" in output


def spawn_code(how: str) -> str:
    start = {
        "system": f"import ctypes\nctypes.CDLL(None).system(b'sleep {SLEEP_TOKEN} &')",
        "posixsubprocess": (  # the arguments of Python 3.11's subprocess.Popen._execute_child
            "import _posixsubprocess, os\n"
            f"args = [b'/bin/sleep', b'{SLEEP_TOKEN}']\n"
            "_posixsubprocess.fork_exec(args, [b'/bin/sleep'], True, (), None, None, -1, -1, -1, -1, -1, -1,"
            " *os.pipe(), False, False, -1, None, None, None, -1, None, False)"
        ),
        "double_fork": (
            "import ctypes\n"
            "libc = ctypes.CDLL(None)\n"
            "if libc.fork() == 0:\n"
            "    libc.setsid()\n"
            "    if libc.fork() == 0:\n"
            f"        libc.execl(b'/bin/sleep', b'sleep', b'{SLEEP_TOKEN}', None)\n"
            "    libc._exit(0)\n"
        ),
    }[how]
    return start + "\nimport time\ntime.sleep(0.5)\nprint('started')"


@pytest.mark.parametrize("how", ["system", "posixsubprocess", "double_fork"])
def test_no_process_started_by_a_call_outlives_it(runner, how):
    assert not processes_with(SLEEP_TOKEN)
    output = run_tool(runner, spawn_code(how))
    time.sleep(0.5)
    survivors = processes_with(SLEEP_TOKEN)
    for pid in survivors:  # leave nothing behind even when the test fails
        os.kill(pid, signal.SIGKILL)
    assert not survivors, output


def test_a_fork_bomb_stops_at_the_process_limit():
    code = """
        import ctypes, os, time
        libc = ctypes.CDLL(None, use_errno=True)
        started = 0
        for _ in range(200):
            pid = libc.fork()  # libc's, which no audit hook sees
            if pid == 0:
                time.sleep(3)
                os._exit(0)
            if pid < 0:
                print("refused", os.strerror(ctypes.get_errno()))
                break
            started += 1
        print("started", started)
    """
    output = run_python(textwrap.dedent(code), SandboxLimits(max_processes=16))
    assert "refused Resource temporarily unavailable" in output, output
    assert int(output.split("started ")[1].split()[0]) < 16, output


def ctypes_socket_code(port: int, listen: bool) -> str:
    """A connect() or a listen() on 127.0.0.1:`port`, made through libc so that no audit hook sees it."""
    return textwrap.dedent(f"""
        import ctypes, socket, struct, time
        libc = ctypes.CDLL(None, use_errno=True)
        fd = libc.socket(socket.AF_INET, socket.SOCK_STREAM, 0)
        # struct sockaddr_in: the family in the machine's byte order, the port in the network's
        address = struct.pack("=H", socket.AF_INET) + struct.pack("!H4s8x", {port}, socket.inet_aton("127.0.0.1"))
        if {listen}:
            ok = libc.bind(fd, address, len(address)) == 0 and libc.listen(fd, 8) == 0
            print("listening" if ok else f"listen refused {{ctypes.get_errno()}}", flush=True)
            time.sleep(3)
        else:
            ok = libc.connect(fd, address, len(address)) == 0
            print("connected" if ok else f"connect refused {{ctypes.get_errno()}}")
    """)


def test_a_raw_connect_does_not_reach_the_host(runner):
    with socket.create_server(("127.0.0.1", 0)) as server:
        output = run_tool(runner, ctypes_socket_code(server.getsockname()[1], listen=False))
        server.setblocking(False)
        with pytest.raises(BlockingIOError):
            server.accept()  # nobody connected
    assert "connect refused" in output, output


def test_a_listening_socket_accepts_nothing_from_the_host(runner):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    outputs = []
    call = threading.Thread(target=lambda: outputs.append(run_tool(runner, ctypes_socket_code(port, listen=True))))
    call.start()
    connected = []
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline and call.is_alive():
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            connected.append(port)
            break
        except OSError:
            time.sleep(0.1)
    call.join()
    assert not connected, outputs


def test_the_scratch_holds_no_more_than_its_cap():
    code = """
        import os
        written = 0
        try:
            for i in range(10000):
                with open(f"part{i}", "wb") as file:  # files under the per-file limit
                    file.write(b"x" * 2**20)
                written += 1
        except OSError as exc:
            print(type(exc).__name__, exc.strerror)
        print("written", written)
    """
    output = run_python(textwrap.dedent(code), SandboxLimits(scratch_mb=24, max_file_mb=4))
    assert "No space left on device" in output, output
    assert 16 <= int(output.split("written ")[1].split()[0]) < 24, output


def test_the_sandbox_stops_a_call_before_the_runner_does_and_leaves_no_scratch():
    before = set(os.listdir(tempfile.gettempdir()))
    code = "open('big', 'wb').write(b'x' * 2**20 * 8)\nimport time\ntime.sleep(60)"
    with ToolRunner([python_tool(max_file_mb=16)], timeout_s=3.0, num_workers=1) as runner:
        pid = runner._workers[0].proc.pid
        result = runner.call(ToolCall("python", {"code": code}))
        assert runner._workers[0].alive and runner._workers[0].proc.pid == pid  # not killed by the runner
    assert result.status == "ok" and result.content == "[stopped: over the wall-clock limit of 2.0 s]", result
    assert not {name for name in set(os.listdir(tempfile.gettempdir())) - before if "sandbox" in name}


def spin_past_the_cpu_limit() -> str:
    """A tool that ignores SIGXCPU and runs into its worker's hard CPU-time limit (a SIGKILL from the kernel)."""
    import resource

    signal.signal(signal.SIGXCPU, signal.SIG_IGN)
    used = resource.getrusage(resource.RUSAGE_SELF)
    limit = int(used.ru_utime + used.ru_stime) + 2
    resource.setrlimit(resource.RLIMIT_CPU, (limit - 1, limit))
    while True:
        pass


def test_a_worker_killed_at_its_cpu_limit_is_not_reported_as_out_of_memory():
    with ToolRunner([Tool.from_function(spin_past_the_cpu_limit)], timeout_s=30.0, num_workers=1) as runner:
        result = runner.call(ToolCall("spin_past_the_cpu_limit", {}))
    assert result.status == "error", result
    assert "killed by SIGKILL at its CPU-time limit (RLIMIT_CPU" in result.content, result
    assert "memory" not in result.content


REWARDS = """
import os, pickle, struct

class Payload:
    def __reduce__(self):
        return (open, (MARKER, "w"))

def reward(prompt, completion, reference):
    if completion == "pickle":
        data = pickle.dumps(Payload())
        frame = struct.pack(">Q", len(data)) + data
        for fd in range(3, 64):
            try:
                os.write(fd, frame)
            except OSError:
                pass
        return 1.0
    if completion == "env":
        return 1.0 if SECRET in repr(dict(os.environ)) else 0.5
    return 1.0
"""


def test_a_reward_worker_cannot_send_the_trainer_a_pickle_or_read_its_secrets(importable_module, monkeypatch, tmp_path):
    marker = tmp_path / "ran-in-the-trainer"
    module = importable_module("sandbox_escape_rewards", f"MARKER = {str(marker)!r}\nSECRET = {SECRET!r}\n{REWARDS}")
    monkeypatch.setenv("ARCHON_TEST_API_KEY", SECRET)
    with RewardScorer(RewardConfig(function=f"{module}:reward", num_workers=1)) as scorer:
        rewards, metrics = scorer.score(["p", "p", "p"], ["pickle", "env", "ok"], ["", "", ""])
    assert not marker.exists()
    assert rewards.tolist()[1:] == [0.5, 1.0], (rewards, metrics)


PROC_REWARDS = """
import os

def reward(prompt, completion, reference):
    parent = os.getppid()
    for path in (f"/proc/{parent}/environ", f"/proc/{parent}/fd/0", f"/proc/{parent}/mem"):
        try:
            with open(path, "rb") as file:
                if SECRET.encode() in file.read(1 << 20):
                    return 1.0
        except OSError:
            pass
    for fd in os.listdir(f"/proc/{parent}/fd") if os.access(f"/proc/{parent}/fd", os.R_OK) else []:
        try:
            if os.readlink(f"/proc/{parent}/fd/{fd}").startswith("pipe:"):
                return 0.75
        except OSError:
            pass
    return 0.5
"""


def test_a_reward_function_cannot_open_the_trainers_proc_entries(importable_module, monkeypatch):
    module = importable_module("sandbox_proc_rewards", f"SECRET = {SECRET!r}\n{PROC_REWARDS}")
    monkeypatch.setenv("ARCHON_TEST_API_KEY", SECRET)
    with RewardScorer(RewardConfig(function=f"{module}:reward", num_workers=1)) as scorer:
        rewards, _ = scorer.score(["p"], ["c"], [""])
    assert rewards.tolist() == [0.5]  # 1.0: it read the trainer's environment; 0.75: it saw the trainer's pipes


def test_a_call_whose_worker_is_killed_leaves_no_process_behind():
    code = spawn_code("system") + "\ntime.sleep(60)"
    runner = ToolRunner([PYTHON_TOOL], timeout_s=30.0, num_workers=1)
    call = threading.Thread(target=lambda: runner.call(ToolCall("python", {"code": code})))
    call.start()
    deadline = time.monotonic() + 10.0
    while not processes_with(SLEEP_TOKEN) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_with(SLEEP_TOKEN)  # the call is under way
    os.kill(worker_pid(runner), signal.SIGKILL)  # as a runner's timeout does
    call.join()
    runner.close()
    deadline = time.monotonic() + 5.0
    while (survivors := processes_with(SLEEP_TOKEN)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    assert not survivors
