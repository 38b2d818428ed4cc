"""Ranks whose torchrun launcher is killed outright (SIGKILL: it cannot stop them) stop too, instead
of training on as orphans (archon/rl/run/launcher_watch.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from test_grpo_recipe import _args, write_tiny_setup

REPO = Path(__file__).resolve().parents[1]
STEPS = 10_000


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_ranks_stop_when_the_launcher_is_killed(tmp_path):
    root = write_tiny_setup(tmp_path / "setup")
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)]), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    args = _args(root, run_dir, steps=STEPS) + ["--eval.every", "0", "--checkpoint.every", "0"]
    log = (tmp_path / "launcher.log").open("w")
    launcher = subprocess.Popen(
        [*cmd, str(REPO / "recipes" / "grpo_lora.py"), *args], env=env, stdout=log, stderr=subprocess.STDOUT
    )
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 300
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().count("\n") >= 1):  # both ranks train
            assert launcher.poll() is None and time.monotonic() < deadline, (tmp_path / "launcher.log").read_text()
            time.sleep(0.5)
        ranks = children(launcher.pid)
        while len(ranks) != 2 and time.monotonic() < deadline:
            time.sleep(0.5)
            ranks = children(launcher.pid)
        assert len(ranks) == 2, ranks
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        killed_at = time.monotonic()
        while any(alive(pid) for pid in ranks) and time.monotonic() - killed_at < 90:
            time.sleep(0.5)
        assert not any(alive(pid) for pid in ranks), f"ranks {ranks} still run after the launcher's SIGKILL"
        steps = metrics.read_text().count("\n")
        assert steps < STEPS
    finally:
        for pid in ranks:  # a failed test leaves nothing behind either
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()
        log.close()
