"""Experiment trackers and sample tables: each backend gets every step's metrics, the run's config and
the sample tables, read back from its own local store (wandb's offline run file, MLflow's file store,
Trackio's SQLite store, TensorBoard's event files); bad settings are errors at the start."""

import json
import os
import re
import struct
import warnings
from pathlib import Path

import pytest
import torch
from test_grpo_recipe import _args, tiny_setup  # noqa: F401  (the tiny model and data)

from archon.rl.config import LoggingConfig, RLConfig, load_config_file, parse_config, validate
from archon.rl.metrics import MetricsLogger, read_metrics
from archon.rl.samples import read_table, recorded_steps, table_path
from archon.rl.step_metrics import Scores
from archon.rl.trackers import TrackerError, open_trackers

ALL = ("tensorboard", "wandb", "mlflow", "trackio")


@pytest.fixture
def local_stores(tmp_path, monkeypatch):
    """wandb offline, MLflow's tracking URI unset (its default store is RUN_DIR/mlruns), Trackio's
    store in tmp_path/trackio."""
    import trackio.sqlite_storage

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    for module in (trackio, trackio.sqlite_storage, trackio.utils):
        monkeypatch.setattr(module, "TRACKIO_DIR", tmp_path / "trackio")
    return tmp_path / "trackio"


# ---- reading each backend's local store ---------------------------------------------------------


def _wandb_log_records(path: Path):
    """The payloads of a .wandb file: a 7-byte header (":W&B", magic, version), then LevelDB's log
    format (32 KiB blocks of records with a 7-byte header: crc32c, length, type full/first/middle/last)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        payload = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            yield payload
        elif kind == 2:
            pending = payload
        elif kind == 3:
            pending += payload
        elif kind == 4:
            yield pending + payload
        elif kind == 0 and length == 0:  # the zero padding at a block's end
            pos += left - 7


def read_wandb(run_dir: Path) -> dict:
    """The offline run's id, config, history ({step: {key: value}}) and tables ({key: {step: table}}),
    decoded with wandb's own protobuf records; a resumed run's processes wrote a file each."""
    from wandb.proto import wandb_internal_pb2 as pb

    run_files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert run_files
    config, history, tables, run_ids = {}, {}, {}, set()
    for run_file in run_files:
        for payload in _wandb_log_records(run_file):
            record = pb.Record()
            record.ParseFromString(payload)
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run_ids.add(record.run.run_id)
                config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
            elif kind == "config":
                config.update({item.key: json.loads(item.value_json) for item in record.config.update})
            elif kind == "history":
                step, logged = record.history.step.num, {}
                for item in record.history.item:  # a dict value (a table's reference) comes a leaf an item
                    *parents, leaf = item.nested_key or [item.key]
                    node = logged
                    for parent in parents:
                        node = node.setdefault(parent, {})
                    node[leaf] = json.loads(item.value_json)
                for key, value in logged.items():
                    if isinstance(value, dict) and value.get("_type") == "table-file":
                        table = run_file.parent / "files" / value["path"]
                        tables.setdefault(key, {})[step] = json.loads(table.read_text())
                    elif not key.startswith("_"):
                        history.setdefault(step, {})[key] = value
    config = {k: v["value"] if isinstance(v, dict) and "value" in v else v for k, v in config.items()}
    return {"ids": run_ids, "config": config, "history": history, "tables": tables}


def read_mlflow(run_dir: Path, run_id: str | None = None) -> dict:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    if run_id is None:
        (experiment,) = [e for e in client.search_experiments() if e.name == "archon"]
        (run,) = client.search_runs([experiment.experiment_id])
        run_id = run.info.run_id
    run = client.get_run(run_id)
    history = {}
    for key in run.data.metrics:
        for metric in client.get_metric_history(run_id, key):
            history.setdefault(metric.step, {})[key] = metric.value
    tables = {}
    for directory in client.list_artifacts(run_id):
        if directory.is_dir:
            for artifact in client.list_artifacts(run_id, directory.path):
                step = int(re.fullmatch(r".*/step_(\d+)\.json", artifact.path).group(1))
                local = client.download_artifacts(run_id, artifact.path, str(run_dir.parent / "downloads" / run_id))
                tables.setdefault(directory.path, {})[step] = json.loads(Path(local).read_text())
    config = json.loads(Path(client.download_artifacts(run_id, "config.json", str(run_dir.parent / "dl"))).read_text())
    return {"id": run_id, "params": run.data.params, "config": config, "history": history, "tables": tables}


def read_trackio(run_name: str) -> dict:
    from trackio import SQLiteStorage

    history, tables = {}, {}
    for log in SQLiteStorage.get_logs("archon", run_name):
        for key, value in log.items():
            if isinstance(value, dict) and value.get("_type") == "trackio.table":
                tables.setdefault(key, {})[log["step"]] = value["_value"]
            elif key not in ("step", "timestamp"):
                history.setdefault(log["step"], {})[key] = value
    return {
        "runs": SQLiteStorage.get_runs("archon"),
        "config": SQLiteStorage.get_run_config("archon", run_name),
        "history": history,
        "tables": tables,
    }


def read_tensorboard(run_dir: Path) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    history, texts = {}, {}
    for key in events.Tags()["scalars"]:
        for event in events.Scalars(key):
            history.setdefault(event.step, {})[key] = event.value
    for tag in events.Tags()["tensors"]:
        for event in events.Tensors(tag):
            text = event.tensor_proto.string_val[0].decode()
            texts.setdefault(tag.removesuffix("/text_summary"), {})[event.step] = text
    return {"history": history, "texts": texts}


def same_history(got: dict, expected: dict) -> bool:
    """{step: {key: value}} equal to `expected` up to float32 rounding."""
    assert got.keys() == expected.keys(), (sorted(got), sorted(expected))
    for step, values in expected.items():
        assert got[step] == pytest.approx(values), step
    return True


def _numbers(record: dict) -> dict:
    return {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


# ---- the logger and each backend ----------------------------------------------------------------


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i) for i in ids)


def _rows(steps_samples: int = 6):
    """Rows of 3 groups of 2 samples with two reward terms."""
    from archon.rl.data import PromptExample
    from archon.rl.samples import sample_rows
    from archon.rollout.base import Sample

    examples = [PromptExample(f"p{i}", None, f"train.jsonl:{i + 1}", data_source=f"src{i}") for i in range(3)]
    samples = [
        Sample(i // 2, [i // 2], [i, i + 1], [0.0, 0.0], "stop" if i % 2 else "length", 3 - i // 2, [0, 0])
        for i in range(steps_samples)
    ]
    rewards = torch.arange(steps_samples, dtype=torch.float32) / 10
    scores = Scores(
        rewards,
        rewards >= 1,
        torch.full((steps_samples,), 2.0),
        {},
        parts={"format": torch.ones(steps_samples), "answer": rewards * 2},
    )
    return sample_rows("", examples, samples, scores, _Tokenizer(), trainer_version=3, limit_rows=4)


def test_sample_rows_take_whole_groups_with_their_reward_terms_version_and_lag():
    rows = _rows()
    assert [row["group"] for row in rows] == [0, 0, 1, 1]  # 4 rows: two whole groups of 2
    assert rows[3] == {
        "task": "",
        "data_source": "src1",
        "source": "train.jsonl:2",
        "group": 1,
        "reward": pytest.approx(0.3),
        "parts": {"answer": pytest.approx(0.6), "format": 1.0},
        "stop": "stop",
        "version": 2,
        "lag": 1,
        "prompt": "b",
        "completion": "de",
    }


def test_a_multi_turn_sample_shows_its_whole_trajectory_and_the_episode_stop_reason():
    """A trajectory's completion is every id after the first prompt, special tokens (turn markers)
    kept; its stop is the episode's reason."""
    from types import SimpleNamespace

    from archon.agents.environment import StopReason
    from archon.rl.data import PromptExample
    from archon.rl.samples import sample_rows
    from archon.rollout.base import Sample

    class Marked(_Tokenizer):
        def decode(self, ids, skip_special_tokens=True):
            return "".join("<|turn|>" if i == 0 else chr(ord("a") + i) for i in ids if i or not skip_special_tokens)

    sample = Sample(
        0,
        [1],
        [2, 0, 3],
        [0.0] * 3,
        "length",
        5,
        [5] * 3,
        extra={"trajectory": SimpleNamespace(stop_reason=StopReason.TOOL_BUDGET)},
    )
    scores = Scores(torch.tensor([0.5]), torch.tensor([0.0]), torch.tensor([3.0]), {})
    (row,) = sample_rows("agent", [PromptExample("q", None, "x.jsonl:1")], [sample], scores, Marked(), 6, 8)
    assert (row["completion"], row["stop"], row["lag"], row["parts"]) == ("c<|turn|>d", "tool_budget", 1, {})


def test_every_backend_gets_every_scalar_the_config_and_the_tables(tmp_path, local_stores):
    run_dir = tmp_path / "run"
    settings = LoggingConfig(run_dir=str(run_dir), backends=ALL, run_name="unit")
    config = {"steps": 3, "logging": {"run_dir": str(run_dir), "backends": list(ALL)}, "tasks": [{"name": "a"}]}
    logger = MetricsLogger(run_dir, tensorboard=False, trackers=open_trackers(settings, run_dir, config))
    for step in (1, 2, 3):  # as the loop does: a step's tables, then its metrics (wandb drops earlier steps)
        if step == 2:
            logger.log_samples(2, _rows())
        if step == 3:
            logger.log_samples(3, _rows()[:2], evaluation=True)
        logger.log(step, {"reward_mean": 0.25 * step, "add/accuracy": step / 8, "loss": float("nan"), "note": "x"})
    logger.close()

    records = read_metrics(run_dir)
    expected = {r["step"]: _numbers(r) for r in records}
    assert expected[2] == {"reward_mean": 0.5, "add/accuracy": 0.25}  # NaN (None) and text are not scalars
    assert read_table(table_path(run_dir, 2)) == _rows() and recorded_steps(run_dir) == [2]
    assert recorded_steps(run_dir, evaluation=True) == [3]
    columns = [
        "task",
        "data_source",
        "source",
        "group",
        "reward",
        "reward/answer",
        "reward/format",
        "stop",
        "version",
        "lag",
        "prompt",
        "completion",
    ]
    first = ["", "src0", "train.jsonl:1", 0, 0.0, 0.0, 1.0, "length", 3, 0, "a", "ab"]

    wandb = read_wandb(run_dir)
    assert same_history(wandb["history"], expected)
    assert wandb["config"]["logging"] == config["logging"] and wandb["config"]["steps"] == 3
    assert wandb["tables"]["samples"][2]["columns"] == columns
    assert wandb["tables"]["samples"][2]["data"][0] == pytest.approx(first)
    assert len(wandb["tables"]["eval_samples"][3]["data"]) == 2

    mlflow = read_mlflow(run_dir)
    assert same_history(mlflow["history"], expected)
    assert mlflow["config"] == config and mlflow["params"]["tasks.0.name"] == "a" and mlflow["params"]["steps"] == "3"
    table = mlflow["tables"]["samples"][2]
    assert table["columns"] == columns and table["data"][0] == pytest.approx(first) and len(table["data"]) == 4
    assert len(mlflow["tables"]["eval_samples"][3]["data"]) == 2

    trackio = read_trackio("unit")
    assert same_history(trackio["history"], expected)
    assert {k: v for k, v in trackio["config"].items() if not k.startswith("_")} == config
    assert [list(row.values()) for row in trackio["tables"]["samples"][2]][0] == pytest.approx(first)
    assert list(trackio["tables"]["samples"][2][0]) == columns

    tensorboard = read_tensorboard(run_dir)
    assert same_history(tensorboard["history"], expected)
    assert "**reward** 0.0" in tensorboard["texts"]["samples"][2] and "    ab" in tensorboard["texts"]["samples"][2]
    assert '"steps": 3' in tensorboard["texts"]["config"][0]

    state = json.loads((run_dir / "trackers.json").read_text())
    assert {state["wandb"]["id"]} == wandb["ids"] and state["mlflow"]["run_id"] == mlflow["id"]
    assert state["trackio"]["name"] == "unit"


def test_a_tracker_failing_mid_run_is_dropped_and_the_metrics_file_goes_on(tmp_path, caplog):
    class Failing:
        name = "flaky"
        closed = False

        def log_scalars(self, step, scalars):
            if step == 2:
                raise ConnectionError("server went away")

        def close(self):
            Failing.closed = True

    logger = MetricsLogger(tmp_path, tensorboard=False, trackers=[Failing()])
    for step in (1, 2, 3):
        logger.log(step, {"loss": float(step)})
    logger.close()
    assert [r["loss"] for r in read_metrics(tmp_path)] == [1.0, 2.0, 3.0]
    assert Failing.closed and "step 2: the flaky tracker failed (ConnectionError: server went away)" in caplog.text


def test_a_resumed_run_replaces_the_tensorboard_steps_after_its_checkpoint(tmp_path):
    logger = MetricsLogger(tmp_path)
    for step in (1, 2, 3, 4):
        logger.log(step, {"loss": float(step)})
    logger.close()
    resumed = MetricsLogger(tmp_path)
    resumed.drop_after(2)
    resumed.log(3, {"loss": 30.0})
    resumed.close()
    assert read_tensorboard(tmp_path)["history"] == {1: {"loss": 1.0}, 2: {"loss": 2.0}, 3: {"loss": 30.0}}
    assert [r["loss"] for r in read_metrics(tmp_path)] == [1.0, 2.0, 30.0]


# ---- a real run ---------------------------------------------------------------------------------


def _run_args(root: Path, run_dir: Path, steps: int) -> list[str]:
    """The recipe tests' tiny run, without its (deprecated) --logging.no-tensorboard."""
    return [a for a in _args(root, run_dir, steps) if a != "--logging.no-tensorboard"]


def test_a_run_logs_to_every_backend_and_a_resumed_run_continues_their_runs(tiny_setup, tmp_path, local_stores):
    """3 RL steps with every backend and a checkpoint at step 2, killed in step 3 and resumed: every
    key of every metrics record reaches each backend at its step; sample tables every 2 steps and at
    each evaluation; the resumed run continues the same wandb, MLflow and Trackio runs."""
    from archon.rl.loop import RLRun

    run_dir = tmp_path / "run"

    def args(*extra):
        return parse_config(
            [
                *_run_args(tiny_setup, run_dir, 3),
                "--logging.backends",
                *ALL,
                "--logging.samples-every",
                "2",
                "--logging.samples-per-table",
                "8",
                "--eval.every",
                "2",
                "--checkpoint.every",
                "2",
                "--logging.run-name",
                "tiny",
                *extra,
            ]
        )

    class Killed(Exception):
        pass

    original_step = RLRun.step

    def step_then_kill(self, step):
        if step == 2:
            raise Killed()
        return original_step(self, step)

    RLRun.step = step_then_kill
    try:
        with pytest.raises(Killed):
            RLRun(args()).run()
    finally:
        RLRun.step = original_step
    first_state = json.loads((run_dir / "trackers.json").read_text())
    RLRun(args("--resume")).run()
    assert json.loads((run_dir / "trackers.json").read_text()) == first_state

    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    expected = {r["step"]: _numbers(r) for r in records}
    assert recorded_steps(run_dir) == [2] and recorded_steps(run_dir, evaluation=True) == [0, 2, 3]
    rows = read_table(table_path(run_dir, 2))
    assert len(rows) == 8 and [r["group"] for r in rows] == [0] * 4 + [1] * 4  # group_size 4: 2 whole groups
    assert all(r["lag"] == 0 and r["version"] == 1 and r["stop"] in ("stop", "length") for r in rows)
    assert all(r["source"].startswith(str(tiny_setup / "train.jsonl")) for r in rows)
    assert len(read_table(table_path(run_dir, 3, evaluation=True))) == 8  # 8 held-out prompts, group of 1
    from archon.tools.show_samples import show

    assert show(run_dir).count("\n== group ") == 8 and show(run_dir, 3, evaluation=True).count("lag 0") == 8

    mlflow = read_mlflow(run_dir, first_state["mlflow"]["run_id"])  # one run, continued
    assert same_history(mlflow["history"], expected)
    assert set(mlflow["tables"]["samples"]) == {2} and set(mlflow["tables"]["eval_samples"]) == {0, 2, 3}
    assert mlflow["config"]["logging"]["samples_every"] == 2

    trackio = read_trackio("tiny")
    assert trackio["runs"] == ["tiny"] and same_history(trackio["history"], expected)
    assert set(trackio["tables"]["eval_samples"]) == {0, 2, 3}

    tensorboard = read_tensorboard(run_dir)
    assert same_history(tensorboard["history"], expected)  # the resumed run's step 3 replaces nothing

    wandb = read_wandb(run_dir)
    assert wandb["ids"] == {first_state["wandb"]["id"]} and same_history(wandb["history"], expected)
    assert set(wandb["tables"]["eval_samples"]) == {0, 2, 3}


# ---- bad input ------------------------------------------------------------------------------------


def test_an_unknown_backend_is_refused_naming_the_known_ones(tmp_path):
    with pytest.raises(SystemExit):  # tyro: not one of the choices
        parse_config(["--logging.backends", "neptune"])
    path = tmp_path / "c.yaml"
    path.write_text("logging: {backends: [tensorboard, neptune]}\n")
    with pytest.raises(ValueError, match=r"logging\.backends.*'tensorboard', 'wandb', 'mlflow', 'trackio'"):
        load_config_file(path)
    with pytest.raises(ValueError, match="unknown backend .neptune.; the known ones are tensorboard, wandb, mlflow, "):
        validate(RLConfig(logging=LoggingConfig(backends=("neptune",))))


def test_a_backend_whose_package_is_missing_stops_the_run_before_the_model_is_built(tiny_setup, tmp_path, monkeypatch):
    import importlib

    from archon.rl.run import loop

    real_import = importlib.import_module

    def no_wandb(name, *args, **kwargs):
        if name == "wandb" or name.startswith("wandb."):
            raise ModuleNotFoundError("No module named 'wandb'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(importlib, "import_module", no_wandb)
    built = []
    monkeypatch.setattr(loop, "Trainer", lambda *a, **k: built.append(1))
    config = parse_config([*_run_args(tiny_setup, tmp_path / "run", 1), "--logging.backends", "tensorboard", "wandb"])
    with pytest.raises(
        TrackerError,
        match=re.escape(
            "logging.backends includes 'wandb' but its package cannot be "
            "imported (No module named 'wandb'); install it with `pip "
            "install 'archon[wandb]'`"
        ),
    ):
        loop.RLRun(config)
    assert not built
    with pytest.raises(TrackerError):  # the directory was released: the same error again, not "in use"
        loop.RLRun(config)
    monkeypatch.undo()


def test_a_run_that_fails_to_start_leaves_no_tracker_files(tiny_setup, tmp_path, local_stores, monkeypatch):
    """The trackers start before the model is built; when the build fails, what they wrote in the run
    directory goes, and the same directory takes the next run without --overwrite."""
    from archon.rl.run import loop

    def broken(*args, **kwargs):
        raise RuntimeError("no room for the model")

    monkeypatch.setattr(loop, "Trainer", broken)
    config = parse_config([*_run_args(tiny_setup, tmp_path / "run", 1), "--logging.backends", *ALL])
    with pytest.raises(RuntimeError, match="no room for the model"):
        loop.RLRun(config)
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if p.name != "run.lock") == []


def test_mlflow_with_an_unusable_tracking_uri_is_an_error_naming_the_setting(tmp_path, monkeypatch):
    settings = LoggingConfig(run_dir=str(tmp_path), backends=("tensorboard", "mlflow"), mlflow_tracking_uri="bogus://x")
    with pytest.raises(
        TrackerError,
        match=r"mlflow could not start a run at tracking URI 'bogus://x' "
        r"\(logging\.mlflow_tracking_uri\)",
    ):
        open_trackers(settings, tmp_path, {})
    import socket
    import time

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
    start = time.monotonic()
    with pytest.raises(TrackerError, match=rf"tracking URI 'http://127.0.0.1:{port}' \(MLFLOW_TRACKING_URI\)"):
        open_trackers(LoggingConfig(run_dir=str(tmp_path), backends=("mlflow",)), tmp_path, {})
    assert time.monotonic() - start < 60  # not MLflow's minutes of retries
    assert "MLFLOW_HTTP_REQUEST_MAX_RETRIES" not in os.environ  # restored


def test_the_tensorboard_setting_still_works_warns_and_must_agree_with_backends(tmp_path):
    with pytest.warns(FutureWarning, match=r"--logging\.no-tensorboard is deprecated .*; use --logging\.backends"):
        config = parse_config(["--logging.no-tensorboard"])
    from archon.rl.trackers import tracker_names

    assert tracker_names(config.logging) == ()
    path = tmp_path / "c.yaml"
    path.write_text("logging: {tensorboard: false, backends: [tensorboard, wandb]}\n")
    with (
        pytest.warns(FutureWarning, match=r"logging\.tensorboard is deprecated"),
        pytest.raises(
            ValueError, match=re.escape("logging.tensorboard=False and logging.backends=['tensorboard', 'wandb'] set")
        ),
    ):
        validate(load_config_file(path))
    path.write_text("logging: {tensorboard: false, backends: [wandb]}\n")
    with pytest.warns(FutureWarning):
        assert tracker_names(load_config_file(path).logging) == ("wandb",)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new spelling does not warn
        assert tracker_names(parse_config(["--logging.backends", "mlflow", "tensorboard"]).logging) == (
            "mlflow",
            "tensorboard",
        )
    with pytest.raises(ValueError, match=r"logging\.samples_per_table=0: must be at least 1"):
        validate(RLConfig(logging=LoggingConfig(samples_per_table=0)))


# ---- show_samples ---------------------------------------------------------------------------------


def test_show_samples_prints_a_recorded_step_and_names_what_is_missing(tmp_path, capsys):
    from archon.rl.samples import write_table
    from archon.tools.show_samples import main

    assert main([str(tmp_path)]) == 1
    assert "samples does not exist: no sample tables were recorded" in capsys.readouterr().err
    rows = _rows()
    rows[0] = {**rows[0], "task": "add", "completion": "x" * 1000}
    write_table(tmp_path, 10, rows)
    write_table(tmp_path, 20, rows[1:2])
    write_table(tmp_path, 10, rows[:1], evaluation=True)

    assert main([str(tmp_path)]) == 0  # the latest step
    out = capsys.readouterr().out
    assert out.startswith("training samples of step 20 (1)") and out.count("\n== ") == 1
    assert (
        "== group 0  reward 0.1  (answer 0.2, format 1)  stop stop  version 3  lag 0  data_source src0  from "
        "train.jsonl:1\n-- prompt\n    a\n-- completion\n    bc" in out
    )

    assert main([str(tmp_path), "--step", "10", "--task", "add"]) == 0
    out = capsys.readouterr().out
    assert "== [add]  group 0  reward 0  " in out and out.count("\n== ") == 1
    assert "[... 601 characters; --full shows all ...]" in out and "x" * 1000 not in out
    assert main([str(tmp_path), "--step", "10", "--task", "add", "--full"]) == 0
    assert "x" * 1000 in capsys.readouterr().out
    assert main([str(tmp_path), "--step", "10", "--eval"]) == 0
    assert capsys.readouterr().out.startswith("evaluation samples of step 10 (1)")

    assert main([str(tmp_path), "--step", "15"]) == 1
    assert "step 15 has no training sample table in" in capsys.readouterr().err
    assert main([str(tmp_path), "--step", "20", "--eval"]) == 1
    assert "recorded steps: 10" in capsys.readouterr().err
    assert main([str(tmp_path), "--step", "10", "--task", "sub"]) == 1
    assert "no sample of task 'sub'; its tasks: ['', 'add']" in capsys.readouterr().err


def test_a_multi_task_run_tables_each_tasks_groups_with_its_name(tmp_path):
    from test_grpo_recipe import write_tiny_setup

    from archon.rl.loop import RLRun
    from archon.rl.tasks import ArithmeticTaskConfig, arithmetic_splits, write_jsonl
    from archon.tools.show_samples import show

    root = write_tiny_setup(tmp_path / "setup")
    train, held_out = arithmetic_splits(ArithmeticTaskConfig(operations=("-",), num_train=16, num_held_out=4))
    write_jsonl(train, root / "sub.jsonl")
    write_jsonl(held_out, root / "sub_held_out.jsonl")
    tasks = "".join(
        f"  - name: {name}\n    data: {{path: {data}}}\n    eval_path: {held}\n"
        "    reward: {function: 'reward_fixtures:digits_or_raise', num_workers: 0}\n    lora: {rank: 4, alpha: 8}\n"
        for name, data, held in (
            ("add", root / "train.jsonl", root / "held_out.jsonl"),
            ("sub", root / "sub.jsonl", root / "sub_held_out.jsonl"),
        )
    )
    config = tmp_path / "multi.yaml"
    config.write_text(
        f"steps: 1\nmodel: {{path: {root / 'model'}, device: cpu}}\n"
        "rollout: {group_size: 2, prompts_per_step: 4, max_new_tokens: 3}\neval: {every: 1, max_prompts: 3}\n"
        f"logging: {{run_dir: {tmp_path / 'run'}, backends: [], progress: false, samples_every: 1, "
        f"samples_per_table: 4}}\ntasks:\n{tasks}"
    )
    RLRun(parse_config(["--config", str(config)])).run()
    run_dir = tmp_path / "run"
    assert not (run_dir / "tensorboard").exists() and not (run_dir / "trackers.json").exists()
    rows = read_table(table_path(run_dir, 1))
    assert [(r["task"], r["group"]) for r in rows] == [(t, g) for t in ("add", "sub") for g in (0, 1) for _ in range(2)]
    assert all(r["version"] == 0 and r["lag"] == 0 for r in rows)
    evaluated = read_table(table_path(run_dir, 1, evaluation=True))
    assert [r["task"] for r in evaluated] == ["add"] * 3 + ["sub"] * 3  # groups of 1 (greedy), 3 prompts each
    assert show(run_dir, 1, task="sub").count("\n== [sub]  group ") == 4


@pytest.mark.slow
def test_a_two_process_run_gathers_each_ranks_groups_into_one_table(tiny_setup, tmp_path):
    """Two data-parallel ranks, 2 prompts each (groups of 4), a table of 8 rows: one whole group from
    each rank (rank 0 alone would give 4 rows), numbered 0 and 1."""
    import subprocess
    import sys

    from test_grpo_recipe import REPO

    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)]), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(REPO / "recipes" / "grpo_lora.py"),
        *_run_args(tiny_setup, run_dir, 1),
        "--logging.backends",
        "tensorboard",
        "--logging.samples-every",
        "1",
        "--logging.samples-per-table",
        "8",
    ]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    rows = read_table(table_path(run_dir, 1))
    assert [r["group"] for r in rows] == [0] * 4 + [1] * 4
    assert rows[0]["source"] != rows[4]["source"]
    assert len(read_table(table_path(run_dir, 1, evaluation=True))) == 8  # 4 held-out prompts on each rank
    assert same_history(read_tensorboard(run_dir)["history"], {r["step"]: _numbers(r) for r in read_metrics(run_dir)})
