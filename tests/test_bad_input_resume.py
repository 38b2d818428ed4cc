"""Bad input around resuming and run directories: each case is refused with an error of the right
type that names the culprit, and leaves the run directory exactly as it was."""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from test_grpo_recipe import _args, tiny_setup  # noqa: F401  (the tiny model and data)

from archon.checkpoint.resume import CheckpointError
from archon.rl.config import parse_config
from archon.rl.loop import RLRun

CKPT = Path("checkpoints")


@pytest.fixture(scope="module")
def finished_run(tiny_setup, tmp_path_factory):  # noqa: F811
    """A 2-step run that checkpointed after each step: checkpoints/step-00000001 and step-00000002."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    RLRun(parse_config(_args(tiny_setup, run_dir, steps=2) + ["--checkpoint.every", "1"])).run()
    assert sorted(p.name for p in (run_dir / CKPT).iterdir()) == ["step-00000001", "step-00000002"]
    return run_dir


def snapshot(root: Path) -> dict[str, str]:
    """Every path under `root` with its content hash ("dir" for directories)."""
    if not root.exists():
        return {}
    return {
        str(p.relative_to(root)): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
    }


class Exploit:
    """Unpickling this runs a command (what a hostile checkpoint would do with weights_only=False)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _newest(run_dir: Path) -> Path:
    return run_dir / CKPT / "step-00000002"


def _resume_nothing_in_new_dir(run_dir):
    shutil.rmtree(run_dir)
    return ["--resume"], FileNotFoundError, [str(run_dir / CKPT), "does not exist"]


def _resume_nothing_in_empty_checkpoints(run_dir):
    for p in (run_dir / CKPT).iterdir():
        shutil.rmtree(p)
    return ["--resume"], FileNotFoundError, [str(run_dir / CKPT), "is empty"]


def _resume_mistyped_path(run_dir):
    return (
        ["--resume", str(run_dir / CKPT / "step-00000009")],
        FileNotFoundError,
        ["step-00000009", "no such directory"],
    )


def _resume_run_dir_instead_of_checkpoint(run_dir):
    return ["--resume", str(run_dir)], FileNotFoundError, [str(run_dir), "not a checkpoint directory"]


def _corrupt_trainer_state(run_dir):
    (_newest(run_dir) / "trainer_state.json").write_text('{"step": 2, "scheduler": ')
    return ["--resume"], CheckpointError, [str(_newest(run_dir) / "trainer_state.json"), "step-00000001"]


def _step_in_trainer_state(value):
    def case(run_dir):
        state_file = _newest(run_dir) / "trainer_state.json"
        state = json.loads(state_file.read_text())
        state["step"] = value
        state_file.write_text(json.dumps(state))
        # the resume would drop the metrics of the steps after the checkpoint's: refused, they stay
        return ["--resume"], CheckpointError, [str(state_file), f"'step' is {value!r}", "step-00000001"]

    case.__name__ = f"_step_{value!r}_in_trainer_state".replace("-", "minus")
    return case


def _corrupt_metrics_line(run_dir):
    metrics = run_dir / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    metrics.write_text(lines[0] + '{"step": 1, "loss": 0.5,,}\n' + "".join(lines[2:]))
    return ["--resume"], ValueError, [f"{metrics}:2: not a JSON object"]


def _truncated_distcp(run_dir):
    shard = sorted(_newest(run_dir).glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    return ["--resume"], CheckpointError, [str(shard), "truncated", "step-00000001"]


def _garbled_distcp(run_dir):
    shard = sorted(_newest(run_dir).glob("*.distcp"))[0]
    shard.write_bytes(b"\0" * shard.stat().st_size)
    return ["--resume"], CheckpointError, [str(shard), "corrupt", "step-00000001"]


def _missing_metadata(run_dir):
    (_newest(run_dir) / ".metadata").unlink()
    return ["--resume"], CheckpointError, [str(_newest(run_dir) / ".metadata"), "step-00000001"]


def _missing_rng_file(run_dir):
    (_newest(run_dir) / "rng" / "rank-0.pt").unlink()
    return ["--resume"], CheckpointError, [str(_newest(run_dir) / "rng" / "rank-0.pt"), "step-00000001"]


def _malicious_rng_pickle(run_dir):
    marker = run_dir.parent / "exploit-ran"
    rng_file = _newest(run_dir) / "rng" / "rank-0.pt"
    torch.save({"torch": Exploit(marker)}, rng_file)
    return ["--resume"], CheckpointError, [str(rng_file), "weights_only"]


def _malicious_metadata(run_dir):
    metadata = _newest(run_dir) / ".metadata"
    metadata.write_bytes(pickle.dumps(Exploit(run_dir.parent / "exploit-ran")))
    return ["--resume"], CheckpointError, [str(metadata), "not part of a checkpoint index"]


def _every_checkpoint_damaged(run_dir):
    for step in (1, 2):
        (run_dir / CKPT / f"step-{step:08d}" / ".metadata").unlink()
    return ["--resume"], CheckpointError, ["step-00000002", "no older checkpoint", str(run_dir / CKPT)]


def _named_checkpoint_damaged(run_dir):
    (_newest(run_dir) / "trainer_state.json").write_text("[]")
    return ["--resume", str(_newest(run_dir))], CheckpointError, ["trainer_state.json", "step-00000001"]


def _lora_rank_changed(run_dir):
    return ["--resume", "--lora.rank", "8"], CheckpointError, ["lora.rank: checkpoint 4, this run 8"]


def _lora_alpha_changed(run_dir):
    return ["--resume", "--lora.alpha", "16"], CheckpointError, ["lora.alpha: checkpoint 8.0, this run 16.0"]


def _lora_targets_changed(run_dir):
    return (
        ["--resume", "--lora.target-modules", "q_proj", "v_proj"],
        CheckpointError,
        ["lora.target_modules: checkpoint 'all-linear', this run ['q_proj', 'v_proj']"],
    )


def _lora_rslora_changed(run_dir):
    return ["--resume", "--lora.use-rslora"], CheckpointError, ["lora.use_rslora: checkpoint False, this run True"]


def _new_run_in_used_dir(run_dir):
    return [], FileExistsError, [str(run_dir), "--resume", "--overwrite"]


def _overwrite_with_foreign_files(run_dir):
    (run_dir / "notes.txt").write_text("mine")
    return ["--overwrite"], FileExistsError, [str(run_dir), "notes.txt"]


def _resume_and_overwrite(run_dir):
    return ["--resume", "--overwrite"], ValueError, ["--resume and --overwrite"]


def _run_dir_is_a_file(run_dir):
    shutil.rmtree(run_dir)
    run_dir.write_text("not a directory")
    return [], NotADirectoryError, [str(run_dir)]


CASES = [
    _resume_nothing_in_new_dir,
    _resume_nothing_in_empty_checkpoints,
    _resume_mistyped_path,
    _resume_run_dir_instead_of_checkpoint,
    _corrupt_trainer_state,
    _step_in_trainer_state(-1),
    _step_in_trainer_state(True),
    _step_in_trainer_state(1.5),
    _corrupt_metrics_line,
    _truncated_distcp,
    _garbled_distcp,
    _missing_metadata,
    _missing_rng_file,
    _malicious_rng_pickle,
    _malicious_metadata,
    _every_checkpoint_damaged,
    _named_checkpoint_damaged,
    _lora_rank_changed,
    _lora_alpha_changed,
    _lora_targets_changed,
    _lora_rslora_changed,
    _new_run_in_used_dir,
    _overwrite_with_foreign_files,
    _resume_and_overwrite,
    _run_dir_is_a_file,
]


@pytest.mark.parametrize("case", CASES, ids=[c.__name__.strip("_") for c in CASES])
def test_bad_resume_input_is_refused_and_changes_nothing(case, finished_run, tiny_setup, tmp_path):  # noqa: F811
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    extra, error, culprits = case(run_dir)
    before = snapshot(tmp_path)
    config = parse_config(_args(tiny_setup, run_dir, steps=4) + extra)
    with pytest.raises(error) as raised:
        RLRun(config).run()
    for culprit in culprits:
        assert culprit in str(raised.value), (culprit, str(raised.value))
    assert snapshot(tmp_path) == before
    assert not (tmp_path / "exploit-ran").exists()


def test_the_malicious_rng_file_would_run_code_if_unpickled_freely(tmp_path):
    """The malicious case above is a real exploit: a plain unpickler runs it."""
    torch.save({"torch": Exploit(tmp_path / "exploit-ran")}, tmp_path / "rank-0.pt")
    torch.load(tmp_path / "rank-0.pt", weights_only=False)
    assert (tmp_path / "exploit-ran").exists()


def test_overwrite_deletes_the_earlier_run_and_nothing_else(finished_run, tiny_setup, tmp_path):  # noqa: F811
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    (run_dir / ".metrics.jsonl.abc123.tmp").write_text("left by a killed write")
    RLRun(parse_config(_args(tiny_setup, run_dir, steps=1) + ["--overwrite"])).run()
    records = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in records] == [0, 1]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-00000001"]
    assert sorted(p.name for p in run_dir.iterdir()) == ["adapter", "checkpoints", "metrics.jsonl", "samples"]


def test_a_bare_resume_means_the_newest_checkpoint():
    assert parse_config(["--resume"]).resume == "latest"
    assert parse_config(["--resume", "--steps", "3"]).resume == "latest"
    assert parse_config(["--resume", "runs/x/checkpoints/step-00000002"]).resume == "runs/x/checkpoints/step-00000002"
    assert parse_config([]).resume is None and not parse_config([]).overwrite


def test_resume_in_a_file_takes_true_and_false_as_the_flag_does(tmp_path):
    (tmp_path / "on.yaml").write_text("resume: true\n")
    (tmp_path / "off.yaml").write_text("resume: false\n")
    assert parse_config(["--config", str(tmp_path / "on.yaml")]).resume == "latest"
    assert parse_config(["--config", str(tmp_path / "off.yaml")]).resume is None


def test_a_checkpoint_beyond_the_runs_steps_is_refused(finished_run, tiny_setup, tmp_path):  # noqa: F811
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    before = snapshot(tmp_path)
    with pytest.raises(ValueError, match=r"step-00000002: the checkpoint is at step 2, beyond this run's steps=1"):
        RLRun(parse_config(_args(tiny_setup, run_dir, steps=1) + ["--resume"])).run()
    assert snapshot(tmp_path) == before


def test_resuming_an_older_checkpoint_sets_the_newer_outputs_aside(finished_run, tiny_setup, tmp_path):  # noqa: F811
    """The earlier run's newer checkpoints leave checkpoints/ (a later bare --resume cannot take
    them, pruning cannot count them) without being deleted, and its metrics past the checkpoint
    are dropped, since the resumed run logs those steps again."""
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    older = run_dir / CKPT / "step-00000001"
    newer = snapshot(run_dir / CKPT / "step-00000002")
    RLRun(parse_config(_args(tiny_setup, run_dir, steps=2) + ["--resume", str(older)])).run()
    aside = run_dir / "superseded" / "after-step-00000001-0"
    assert snapshot(aside / "checkpoints" / "step-00000002") == newer
    assert sorted(p.name for p in (run_dir / CKPT).iterdir()) == ["step-00000001", "step-00000002"]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]


def test_a_torn_last_metrics_line_is_dropped_on_resume(finished_run, tiny_setup, tmp_path, caplog):  # noqa: F811
    """The run was killed while writing its last metrics record: the resume drops the torn line,
    saying so, and logs the steps it runs after the ones kept."""
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    metrics = run_dir / "metrics.jsonl"
    kept = metrics.read_text()
    with open(metrics, "a") as f:
        f.write('{"step": 3, "reward_mean": 0.')
    with caplog.at_level("WARNING", logger="archon.rl"):
        RLRun(parse_config(_args(tiny_setup, run_dir, steps=3) + ["--resume"])).run()
    assert f"{metrics}:4: dropped the last line" in caplog.text
    assert metrics.read_text().startswith(kept)
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [0, 1, 2, 3]
