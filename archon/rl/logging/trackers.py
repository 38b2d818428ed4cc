"""Experiment trackers: each RL step's metrics record, the run's config and the sample tables, sent
to TensorBoard, Weights & Biases, MLflow or Trackio (`logging.backends`), on rank 0.

Every backend is one class with the same four methods, driven by archon.rl.logging.metrics.MetricsLogger:
`log_config(config)` once at the start, `log_scalars(step, scalars)` each step,
`log_table(name, step, columns, rows)` for the sample tables (archon.rl.logging.samples) and `close()`
(and TensorBoard's `drop_after(step)`, for a resumed run: the one store that can take steps back).
A backend is started (its package imported, its run created or continued) before the model is
built, so a missing package or an unusable setting stops the run at once with an error naming the
backend and the setting. The ids of the tracker runs are kept in RUN_DIR/trackers.json, so that a
resumed run continues the same tracker runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import typing
import uuid
from pathlib import Path
from typing import Any, Literal

from archon.checkpoint.atomic import atomic_write_json
from archon.secrets import redact, redact_url, redact_value

TrackerName = Literal["tensorboard", "wandb", "mlflow", "trackio"]
TRACKERS: tuple[str, ...] = typing.get_args(TrackerName)
TRACKERS_STATE = "trackers.json"
"""RUN_DIR/trackers.json: each backend's run id (and where it lives), to continue it on --resume."""
TRACKER_DIRS = ("tensorboard", "wandb", "mlruns")
"""What the backends write under RUN_DIR: TensorBoard's event files, wandb's run files and the
default MLflow file store."""
EXTRAS = {
    "tensorboard": "archon[rl]",
    "wandb": "archon[wandb]",
    "mlflow": "archon[mlflow]",
    "trackio": "archon[trackio]",
}
MLFLOW_PARAMS_PER_CALL = 100  # MLflow's limit of params in one log_batch
MLFLOW_PARAM_CHARS = 6000  # MLflow's limit of one param value


class TrackerError(RuntimeError):
    """A backend that could not start (its package missing, a setting it refused)."""


def tracker_names(logging_config) -> tuple[str, ...]:
    """The backends a run logs to: `logging.backends`, less tensorboard when the deprecated
    `logging.tensorboard` is false (validation refuses it together with backends naming tensorboard
    explicitly)."""
    names = tuple(dict.fromkeys(logging_config.backends))
    if not logging_config.tensorboard:
        names = tuple(name for name in names if name != "tensorboard")
    return names


def unknown_tracker(name: str) -> str:
    return f"logging.backends: unknown backend {name!r}; the known ones are {', '.join(TRACKERS)}"


def _import(module: str, backend: str):
    """The backend's package, or a TrackerError saying how to install it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise TrackerError(
            f"logging.backends includes {backend!r} but its package cannot be imported ({e}); install it with "
            f"`pip install '{EXTRAS[backend]}'` or remove {backend!r} from logging.backends"
        ) from None


def _flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists (the tasks) by index."""
    flat = {}
    for key, value in config.items():
        if isinstance(value, (list, tuple)) and value and all(isinstance(v, dict) for v in value):
            value = {str(i): v for i, v in enumerate(value)}
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def markdown_table(columns: list[str], rows: list[list[Any]]) -> str:
    """The table as Markdown, one block per row (long text cells would break a Markdown table)."""
    blocks = []
    for row in rows:
        fields = dict(zip(columns, row))
        header = ", ".join(f"**{k}** {v}" for k, v in fields.items() if k not in ("prompt", "completion"))
        text = f"{fields.get('prompt', '')}{fields.get('completion', '')}"
        text = "\n".join(f"    {line}" for line in text.splitlines())
        blocks.append(f"{header}\n\n{text}")
    return "\n\n---\n\n".join(blocks)


class TensorBoardTracker:
    """Event files in RUN_DIR/tensorboard: scalars, the config and the tables as text."""

    name = "tensorboard"

    def __init__(self, settings, run_dir: Path, state: dict) -> None:
        _import("tensorboard", self.name)
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = str(run_dir / "tensorboard")
        self.writer = SummaryWriter(log_dir=self.log_dir)

    def drop_after(self, step: int) -> None:
        """Hide the events of steps after `step` (a resumed run logs them again)."""
        from torch.utils.tensorboard import SummaryWriter

        self.writer.close()
        self.writer = SummaryWriter(log_dir=self.log_dir, purge_step=step + 1)

    def log_config(self, config: dict[str, Any]) -> None:
        self.writer.add_text("config", "    " + json.dumps(config, indent=2, default=str).replace("\n", "\n    "), 0)
        self.writer.flush()

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def log_table(self, name: str, step: int, columns: list[str], rows: list[list[Any]]) -> None:
        self.writer.add_text(name, markdown_table(columns, rows), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """A Weights & Biases run; its files go to RUN_DIR/wandb. The run id is kept, so a resumed run
    continues it (wandb keeps the steps it has: a step logged again after a resume is dropped)."""

    name = "wandb"

    def __init__(self, settings, run_dir: Path, state: dict) -> None:
        self.wandb = wandb = _import("wandb", self.name)
        mode = settings.wandb_mode or os.environ.get("WANDB_MODE") or "online"
        run_id = state.get("id") or uuid.uuid4().hex[:8]
        try:
            with _redacted_argv():  # wandb records the command line with the run
                self.run = wandb.init(
                    project=settings.project,
                    entity=settings.wandb_entity,
                    name=settings.run_name or run_dir.name,
                    id=run_id,
                    resume="allow",
                    mode=mode,
                    dir=os.environ.get("WANDB_DIR") or str(run_dir),
                    settings=wandb.Settings(console="off"),
                )
        except Exception as e:
            raise TrackerError(
                redact(
                    f"logging.backends: wandb could not start a run (logging.wandb_mode={mode!r}, logging.project="
                    f"{settings.project!r}, logging.wandb_entity={settings.wandb_entity!r}): {type(e).__name__}: {e}"
                )
            ) from None
        state["id"] = run_id

    def log_config(self, config: dict[str, Any]) -> None:
        self.run.config.update(config, allow_val_change=True)

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def log_table(self, name: str, step: int, columns: list[str], rows: list[list[Any]]) -> None:
        self.run.log({name: self.wandb.Table(columns=columns, data=rows)}, step=step)

    def close(self) -> None:
        self.run.finish()


@contextlib.contextmanager
def _redacted_argv():
    """sys.argv with its secrets redacted, for the time of the block."""
    import sys

    argv = sys.argv
    sys.argv = [redact(arg) for arg in argv]
    try:
        yield
    finally:
        sys.argv = argv


@contextlib.contextmanager
def _few_http_retries():
    """MLflow retries a failed HTTP request 7 times with backoff (minutes): starting a run, an
    unreachable server is reported after one retry, unless MLFLOW_HTTP_REQUEST_MAX_RETRIES or
    MLFLOW_HTTP_REQUEST_TIMEOUT are set. Logging later retries as MLflow does."""
    quick = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}
    added = [name for name in quick if name not in os.environ]
    os.environ.update({name: quick[name] for name in added})
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


class MlflowTracker:
    """An MLflow run in logging.mlflow_experiment (default: logging.project) at
    logging.mlflow_tracking_uri, else MLFLOW_TRACKING_URI, else a file store in RUN_DIR/mlruns.
    The config is the run's params (flattened) and its artifact config.json; tables are
    artifacts samples/step_N.json. A resumed run continues the run it kept (same tracking URI)."""

    name = "mlflow"

    def __init__(self, settings, run_dir: Path, state: dict) -> None:
        _import("mlflow", self.name)
        uri = settings.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        setting = "logging.mlflow_tracking_uri" if settings.mlflow_tracking_uri else "MLFLOW_TRACKING_URI"
        if not uri:
            # MLflow refuses its file store unless allowed; it is the local store that needs no server
            # or database package, as the other backends' local stores
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri, setting = (run_dir / "mlruns").resolve().as_uri(), "the default store RUN_DIR/mlruns"
        experiment = settings.mlflow_experiment or settings.project
        try:
            with _few_http_retries():
                self._start(uri, experiment, settings.run_name or run_dir.name, state)
        except Exception as e:
            raise TrackerError(
                redact(
                    f"logging.backends: mlflow could not start a run at tracking URI {uri!r} ({setting}), experiment "
                    f"{experiment!r}: {type(e).__name__}: {str(e)[:500]}"
                )
            ) from None
        self.resumed = state.get("run_id") == self.run_id
        state.update(tracking_uri=redact_url(uri), run_id=self.run_id)

    def _start(self, uri: str, experiment: str, run_name: str, state: dict) -> None:
        """The client, the experiment (made if new) and the run: the one `state` names at this URI, or a new one."""
        from mlflow import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found is not None else self.client.create_experiment(experiment)
        # trackers.json keeps the URI without its credentials
        self.run_id = state.get("run_id") if state.get("tracking_uri") == redact_url(uri) else None
        if self.run_id is not None:
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id

    def log_config(self, config: dict[str, Any]) -> None:
        from mlflow.entities import Param

        self.client.log_dict(self.run_id, config, "config.json")
        if self.resumed:  # a param cannot change once logged; config.json has the resumed run's
            return
        params = [Param(k, str(v)[:MLFLOW_PARAM_CHARS]) for k, v in _flatten(config).items()]
        for i in range(0, len(params), MLFLOW_PARAMS_PER_CALL):
            self.client.log_batch(self.run_id, params=params[i : i + MLFLOW_PARAMS_PER_CALL])

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in scalars.items()])

    def log_table(self, name: str, step: int, columns: list[str], rows: list[list[Any]]) -> None:
        data = {column: [row[i] for row in rows] for i, column in enumerate(columns)}
        self.client.log_table(self.run_id, data=data, artifact_file=f"{name}/step_{step}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class TrackioTracker:
    """A Trackio run in project logging.project, in Trackio's local store (TRACKIO_DIR, by default
    ~/.cache/huggingface/trackio); a resumed run continues the latest run of its name."""

    name = "trackio"

    def __init__(self, settings, run_dir: Path, state: dict) -> None:
        self.trackio = trackio = _import("trackio", self.name)
        run_name = state.get("name") or settings.run_name or run_dir.name
        resume = "allow" if state.get("name") else "never"  # a new run beside an earlier one of the same name
        try:
            self.run = trackio.init(
                project=settings.project,
                name=run_name,
                resume=resume,
                embed=False,
                auto_log_cpu=False,
                auto_log_gpu=False,
            )
        except Exception as e:
            raise TrackerError(
                f"logging.backends: trackio could not start run {run_name!r} in project {settings.project!r} "
                f"(logging.project): {type(e).__name__}: {e}"
            ) from None
        state.update(project=settings.project, name=run_name)

    def log_config(self, config: dict[str, Any]) -> None:
        self.run.config.update(config)  # stored with the run's first log

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def log_table(self, name: str, step: int, columns: list[str], rows: list[list[Any]]) -> None:
        self.run.log({name: self.trackio.Table(columns=columns, data=rows)}, step=step)

    def close(self) -> None:
        self.run.finish()


BACKENDS = {cls.name: cls for cls in (TensorBoardTracker, WandbTracker, MlflowTracker, TrackioTracker)}


def check_tracker_packages(settings) -> tuple[str, ...]:
    """The backends of `settings` (a LoggingConfig), each checked to be known and importable (a
    TrackerError otherwise): what can be known before a run starts anything."""
    names = tracker_names(settings)
    for name in names:
        if name not in BACKENDS:
            raise TrackerError(unknown_tracker(name))
        _import(name, name)
    return names


def open_trackers(settings, run_dir: str | os.PathLike, config: dict[str, Any]) -> list:
    """Start the backends of `settings` (a LoggingConfig) and log `config` (the run's RLConfig as a
    nested dict, its secrets redacted here if the caller has not) to each; their run ids go to
    RUN_DIR/trackers.json. A backend that cannot start closes those started before it and raises a
    TrackerError naming it."""
    config = redact_value(config)
    run_dir = Path(run_dir)
    state_path = run_dir / TRACKERS_STATE
    state = json.loads(state_path.read_text()) if state_path.exists() else {}
    names = check_tracker_packages(settings)  # every package first, before anything is written
    trackers = []
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        # TensorBoard last: it does not fail to start, and the others may, before it has written anything
        for name in sorted(names, key=lambda name: name == "tensorboard"):
            backend_state = dict(state.get(name, {}))
            tracker = BACKENDS[name](settings, run_dir, backend_state)
            trackers.append(tracker)
            if backend_state:
                state[name] = backend_state
            tracker.log_config(config)
    except BaseException:
        close_trackers(trackers)
        raise
    if state:
        atomic_write_json(state_path, state)
    return trackers


def close_trackers(trackers: list) -> None:
    """Close each backend; one that fails to close does not keep the others open."""
    import logging

    for tracker in trackers:
        try:
            tracker.close()
        except Exception as e:  # the run's own outputs are written; a tracker's end is not worth an error
            logging.getLogger("archon.rl").error(
                "closing the %s tracker failed: %s: %s", tracker.name, type(e).__name__, e
            )


def tracker_outputs(run_dir: str | os.PathLike) -> set[str]:
    """The names of what the backends write under `run_dir` that exist now."""
    return {name for name in (*TRACKER_DIRS, TRACKERS_STATE) if (Path(run_dir) / name).exists()}


def remove_tracker_outputs(run_dir: str | os.PathLike, names: set[str]) -> None:
    """Delete these backend outputs of `run_dir` (those a run that failed to start created), so that
    its directory can be used again as it was."""
    for name in names:
        path = Path(run_dir) / name
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        elif path.exists():
            path.unlink()
