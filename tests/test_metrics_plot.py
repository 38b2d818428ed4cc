import json

import pytest

from archon.rl.metrics import MetricsLogger, read_metrics
from archon.tools.plot import plot_run


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


def test_bad_metrics_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        read_metrics(tmp_path)
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "loss": 1.0}) + "\n{broken\n")
    with pytest.raises(ValueError, match="metrics.jsonl:2"):
        read_metrics(tmp_path)
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "loss": 1.0}) + "\n")
    with pytest.raises(ValueError, match="none of"):
        plot_run(tmp_path)
