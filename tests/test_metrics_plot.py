import json
import logging
import re

import pytest

from archon.rl.metrics import MetricsLogger, read_metrics
from archon.tools.plot import curves, plot_run


def test_metrics_round_trip_and_plot(tmp_path):
    logger = MetricsLogger(tmp_path, tensorboard=True)
    for step in range(5):
        metrics = {"reward_mean": 0.1 * step, "accuracy": 0.2 * step, "loss": float("nan")}
        if step % 2 == 0:
            metrics["eval_accuracy"] = 0.15 * step
        logger.log(step, metrics)
    logger.close()
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    assert records[3]["accuracy"] == pytest.approx(0.6) and records[3]["loss"] is None
    assert list((tmp_path / "tensorboard").iterdir())
    png = plot_run(tmp_path)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_multi_task_run_gets_one_curve_per_task(tmp_path):
    """A multi-task run logs `<task>/<metric>`: each task's reward, accuracy and held-out accuracy
    is a curve of its own, in the order of the tasks."""
    logger = MetricsLogger(tmp_path, tensorboard=False)
    logger.log(0, {"sub/eval_accuracy": 0.1, "add/eval_accuracy": 0.2})
    for step in (1, 2):
        logger.log(
            step,
            {f"{task}/{key}": 0.1 * step for task in ("sub", "add") for key in ("reward_mean", "accuracy")}
            | {"sub/loss": 1.0, "active_tasks": 2.0},
        )
    logger.log(3, {"add/reward_mean": 0.5, "add/accuracy": 0.25, "add/eval_accuracy": 0.75})  # sub stopped
    logger.close()
    drawn = {(task, key): (steps, values) for task, key, _, steps, values in curves(read_metrics(tmp_path))}
    metrics = ("reward_mean", "accuracy", "eval_accuracy")
    assert list(drawn) == [(task, key) for task in ("sub", "add") for key in metrics]
    assert drawn["add", "reward_mean"] == ([1, 2, 3], [0.1, 0.2, 0.5])
    assert drawn["sub", "eval_accuracy"] == ([0], [0.1])
    assert plot_run(tmp_path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_metrics_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        read_metrics(tmp_path)
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "loss": 1.0}) + "\n{broken\n")
    with pytest.raises(ValueError, match="metrics.jsonl:2"):
        read_metrics(tmp_path)
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "loss": 1.0}) + "\n")
    with pytest.raises(ValueError, match="none of"):
        plot_run(tmp_path)


def test_a_torn_last_line_is_dropped_on_resume(tmp_path, caplog):
    """A run killed while writing a record leaves a part of a line, without its newline: the resumed
    run drops it (with a warning naming it) and logs on; the plot reads past it too."""
    logger = MetricsLogger(tmp_path, tensorboard=False)
    for step in range(3):
        logger.log(step, {"loss": float(step)})
    logger.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "lo')
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2]
    resumed = MetricsLogger(tmp_path, tensorboard=False)
    with caplog.at_level(logging.WARNING, logger="archon.rl"):
        resumed.drop_after(1)
    resumed.log(2, {"loss": 20.0})
    resumed.close()
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path)] == [(0, 0.0), (1, 1.0), (2, 20.0)]
    assert f"{tmp_path / 'metrics.jsonl'}:4" in caplog.text


@pytest.mark.parametrize("bad_line", ["{broken", "[1, 2]", '{"loss": 1.0}', '{"step": "2"}'])
def test_a_bad_metrics_line_is_named_and_the_file_kept(tmp_path, bad_line):
    """A corrupt line that is not a torn last one (it has its newline) is an error naming the file
    and line; the resume that met it changes nothing."""
    lines = [json.dumps({"step": 0, "loss": 1.0}), bad_line, json.dumps({"step": 1, "loss": 2.0})]
    text = "\n".join(lines) + "\n"
    (tmp_path / "metrics.jsonl").write_text(text)
    resumed = MetricsLogger(tmp_path, tensorboard=False)
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'metrics.jsonl'}:2: ")):
        resumed.drop_after(0)
    resumed.close()
    assert (tmp_path / "metrics.jsonl").read_text() == text
    with pytest.raises(ValueError, match="metrics.jsonl:2: "):
        read_metrics(tmp_path)


def test_the_plot_command_takes_the_run_directory_as_it_is_documented(tmp_path):
    from archon.tools.plot import main

    logger = MetricsLogger(tmp_path, tensorboard=False)
    for step in range(3):
        logger.log(step, {"reward_mean": 0.1 * step, "accuracy": 0.05 * step})
    logger.close()
    assert main([str(tmp_path)]) == 0
    assert (tmp_path / "curves.png").stat().st_size > 0
