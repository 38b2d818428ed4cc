"""Faults while a run writes its checkpoints and adapters: SIGKILL during a DCP save, between the two
renames of a re-save, and during a PEFT export. The newest complete checkpoint survives, `--resume`
continues with the very losses of the uninterrupted run, and what the killed write left behind is
cleaned up. A read-only run directory is reported, naming it, with nothing lost."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_bad_input_resume import snapshot
from test_grpo_recipe import _args, tiny_setup  # noqa: F401  (the tiny model and data)

from archon.checkpoint.atomic import atomic_directory, recover_directory
from archon.rl.config import parse_config
from archon.rl.loop import RLRun

REPO = Path(__file__).resolve().parents[1]
STEPS = 4


def _losses(run_dir: Path) -> dict[int, float]:
    """Loss per step; a step logged twice (run again after a kill) counts with its last record."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def _run_in_process(args: list[str]) -> None:
    RLRun(parse_config(args)).run()


def _run_until_killed(kill_point: str, target: str, args: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)]), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(REPO / "tests" / "fault_driver.py"), kill_point, target, *args]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == -signal.SIGKILL, result.stdout[-2000:] + result.stderr[-4000:]


@pytest.fixture(scope="module")
def uninterrupted(tiny_setup, tmp_path_factory):  # noqa: F811
    run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
    _run_in_process(_args(tiny_setup, run_dir, STEPS) + ["--checkpoint.every", "1"])
    losses = _losses(run_dir)
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses


def test_kill_during_dcp_save(tiny_setup, uninterrupted, tmp_path):  # noqa: F811
    run_dir = tmp_path / "run"
    args = _args(tiny_setup, run_dir, STEPS) + ["--checkpoint.every", "1"]
    _run_until_killed("dcp-save", ".step-00000003.tmp", args)
    checkpoints = run_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == [".step-00000003.tmp", "step-00000001", "step-00000002"]
    assert list((checkpoints / ".step-00000003.tmp").glob("*.distcp"))
    assert not (checkpoints / ".step-00000003.tmp" / ".metadata").exists()

    _run_in_process(args + ["--resume"])
    assert _losses(run_dir) == uninterrupted
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-00000003", "step-00000004"]


def test_kill_between_the_renames_of_a_resave(tiny_setup, uninterrupted, tmp_path):  # noqa: F811
    """Step 2 is saved again over itself; killed after step-2 was moved aside and before the new
    copy took its place. The next `--resume` finds step 2, not step 1."""
    run_dir = tmp_path / "run"
    checkpoints = run_dir / "checkpoints"
    _run_in_process(_args(tiny_setup, run_dir, 2) + ["--checkpoint.every", "1"])
    args = _args(tiny_setup, run_dir, STEPS) + ["--checkpoint.every", "1"]
    _run_until_killed("resave", ".step-00000002.tmp", args + ["--resume"])
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        ".step-00000002.old",
        ".step-00000002.tmp",
        "step-00000001",
    ]

    result = RLRun(parse_config(args + ["--resume"]))
    assert result.resume_from == checkpoints / "step-00000002"
    result.run()
    assert _losses(run_dir) == uninterrupted
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-00000003", "step-00000004"]


def test_kill_during_peft_export(tiny_setup, uninterrupted, tmp_path):  # noqa: F811
    """Killed while the step-3 adapter is written (before it is renamed into place): the step-3
    checkpoint is complete, the resume continues from it, and the half-written adapter is removed."""
    run_dir = tmp_path / "run"
    args = _args(tiny_setup, run_dir, STEPS) + ["--checkpoint.every", "1"]
    _run_until_killed("rename", ".step_000003.tmp", args)
    assert (run_dir / "adapters" / ".step_000003.tmp" / "adapter_model.safetensors").exists()
    assert not (run_dir / "adapters" / "step_000003").exists()

    result = RLRun(parse_config(args + ["--resume"]))
    assert result.resume_from == run_dir / "checkpoints" / "step-00000003"
    result.run()
    assert _losses(run_dir) == uninterrupted
    assert sorted(p.name for p in (run_dir / "adapters").iterdir()) == ["step_000001", "step_000002"]
    assert (run_dir / "adapter" / "adapter_model.safetensors").exists()


def test_kill_between_the_renames_of_an_adapter_export(tmp_path):
    """The directory replace used by the PEFT export: killed after the old adapter was moved aside,
    the old one is restored; killed before, the partial new one is removed on the next write."""
    target = tmp_path / "adapter"
    with atomic_directory(target) as staging:
        (staging / "adapter_model.safetensors").write_text("first")
    script = (
        "import os, signal, sys\n"
        "from pathlib import Path\n"
        "from archon.checkpoint.atomic import atomic_directory\n"
        "original = os.replace\n"
        "def replace(src, dst):\n"
        "    if Path(src).name == '.adapter.tmp':\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "    original(src, dst)\n"
        "os.replace = replace\n"
        "with atomic_directory(sys.argv[1]) as staging:\n"
        "    (staging / 'adapter_model.safetensors').write_text('second')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", script, str(target)], env=env, capture_output=True, text=True)
    assert result.returncode == -signal.SIGKILL, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [".adapter.old", ".adapter.tmp"]
    recover_directory(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]
    assert (target / "adapter_model.safetensors").read_text() == "first"
    with atomic_directory(target) as staging:
        (staging / "adapter_model.safetensors").write_text("third")
    assert (target / "adapter_model.safetensors").read_text() == "third"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]


def _make_read_only(root: Path) -> None:
    if os.geteuid() != 0:
        for p in [root, *root.rglob("*")]:
            p.chmod(p.stat().st_mode & ~0o222)
        return
    # root ignores permission bits; the immutable attribute stops it (where the file system has it)
    result = subprocess.run(["chattr", "-R", "+i", str(root)], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot make a directory read-only as root here: {result.stderr.strip()}")


def _make_writable(root: Path) -> None:
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-R", "-i", str(root)], check=True)
    else:
        for p in [root, *root.rglob("*")]:
            p.chmod(p.stat().st_mode | 0o200)


def test_read_only_run_dir_is_reported_and_nothing_is_lost(tiny_setup, tmp_path):  # noqa: F811
    run_dir = tmp_path / "run"
    args = _args(tiny_setup, run_dir, 1) + ["--checkpoint.every", "1"]
    _run_in_process(args)
    # a killed re-save, so that a resume would have to move directories to recover
    shutil.copytree(run_dir / "checkpoints" / "step-00000001", run_dir / "checkpoints" / ".step-00000001.tmp")
    before = snapshot(run_dir)
    _make_read_only(run_dir)
    try:
        for extra in (["--resume"], ["--overwrite"]):
            with pytest.raises(PermissionError, match=f"run directory {run_dir} cannot be written"):
                RLRun(parse_config(_args(tiny_setup, run_dir, 2) + extra)).run()
        with pytest.raises(PermissionError, match=f"run directory {run_dir / 'new'} cannot be written"):
            RLRun(parse_config(_args(tiny_setup, run_dir / "new", 2)))
    finally:
        _make_writable(run_dir)
    assert snapshot(run_dir) == before
