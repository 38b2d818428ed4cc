"""One run at a time in a run directory: a second run on a held directory fails at once naming the
holder, the lock of a crashed run is taken over, and a run that ends, however it ends, releases
its directory."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_bad_input_resume import snapshot
from test_grpo_recipe import _args, tiny_setup  # noqa: F401  (the tiny model and data)

from archon.rl.config import parse_config
from archon.rl.loop import RLRun
from archon.rl.run_dir import LOCK_FILE, RunDirInUseError, prepare_run_dir

REPO = Path(__file__).resolve().parents[1]
HOLD = """
import sys
import time
from pathlib import Path

from archon.rl.run_dir import RunDirLock

lock = RunDirLock(Path(sys.argv[1]))
lock.acquire()
print("held", flush=True)
time.sleep(600)
"""


def _steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_held_directory_is_refused_and_a_killed_holders_lock_taken_over(tiny_setup, tmp_path, caplog):  # noqa: F811
    run_dir = tmp_path / "run"
    RLRun(parse_config(_args(tiny_setup, run_dir, steps=1) + ["--checkpoint.every", "1"])).run()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        before = snapshot(run_dir)
        in_use = re.escape(f"run directory {run_dir} is in use by process {holder.pid} on ")
        for extra in ([], ["--resume"], ["--overwrite"]):
            with pytest.raises(RunDirInUseError, match=in_use):
                RLRun(parse_config(_args(tiny_setup, run_dir, steps=2) + extra))
        assert snapshot(run_dir) == before
    finally:
        holder.kill()  # as a crash would: no release, the lock file stays
        holder.wait()
    assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == holder.pid
    with caplog.at_level("WARNING", logger="archon.rl"):
        RLRun(parse_config(_args(tiny_setup, run_dir, steps=2) + ["--resume"])).run()
    assert f"took over {run_dir / LOCK_FILE} from process {holder.pid} on " in caplog.text
    assert _steps(run_dir) == [0, 1, 2]
    assert not (run_dir / LOCK_FILE).exists()


@pytest.mark.parametrize("ending", [None, RuntimeError, KeyboardInterrupt], ids=["normal", "error", "interrupt"])
def test_a_run_holds_its_directory_until_it_ends(tiny_setup, tmp_path, ending):  # noqa: F811
    """Held from the check of the directory to the run's end, in this very process too; released
    after a normal end (a --resume follows), an error or an interrupt."""
    run_dir = tmp_path / "run"
    run = RLRun(parse_config(_args(tiny_setup, run_dir, steps=1)))
    with pytest.raises(RunDirInUseError, match=f"in use by process {os.getpid()} on "):
        prepare_run_dir(run_dir, "latest", False)
    if ending is None:
        run.run()
    else:

        def step(index):
            raise ending("stopped on purpose")

        run.step = step
        with pytest.raises(ending):
            run.run()
    assert not (run_dir / LOCK_FILE).exists()
    if ending is None:
        RLRun(parse_config(_args(tiny_setup, run_dir, steps=2) + ["--resume"])).run()
        assert _steps(run_dir) == [0, 1, 2]
    else:
        again = prepare_run_dir(run_dir, None, True)
        assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == os.getpid()
        again.release()


def test_a_refused_start_leaves_no_lock_and_no_directory(tiny_setup, tmp_path):  # noqa: F811
    """A resume with nothing to resume in a directory that does not exist leaves none behind."""
    with pytest.raises(FileNotFoundError, match="no checkpoint to resume"):
        RLRun(parse_config(_args(tiny_setup, tmp_path / "run", steps=1) + ["--resume"]))
    assert list(tmp_path.iterdir()) == []
