"""Secrets of the config (API keys, URL credentials, keys read from the environment) never reach
anything a run writes: a real run with planted secrets, every file it writes grepped for them."""

import dataclasses
import os
import re
import socket
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from test_grpo_recipe import _args, tiny_setup  # noqa: F401  (the tiny model and data)

from archon.rl.config import RLConfig, parse_config
from archon.rl.logging.trackers import TrackerError, open_trackers
from archon.secrets import (
    REDACTED,
    forget_secrets,
    redact,
    redact_url,
    redacted_config,
    register_secrets,
    secret_kind,
    secret_values,
)

REPO = Path(__file__).resolve().parents[1]
CLI_KEY = "sk-cli-9f3b2a7c"
URL_PASSWORD = "yamlPw-41c8e0"
ENV_TOKEN = "env-token-7d1e55"


@pytest.fixture(autouse=True)
def no_registered_secrets():
    forget_secrets()
    yield
    forget_secrets()


def _leaf_fields(cls, prefix=""):
    """(dotted name, field) of every leaf field of the config tree, descending into nested sections
    (and the element type of tuples of sections, such as tasks and reward terms)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kinds = [hints[f.name], *typing.get_args(hints[f.name])]
        section = next((k for k in kinds if dataclasses.is_dataclass(k)), None)
        if section is not None:
            yield from _leaf_fields(section, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f


def test_every_field_that_can_hold_a_secret_is_marked():
    marked = {name: secret_kind(f) for name, f in _leaf_fields(RLConfig) if secret_kind(f)}
    assert marked["rollout.vllm.api_key"] == "value"
    assert marked["rollout.vllm.urls"] == "url"
    assert marked["logging.mlflow_tracking_uri"] == "url"
    assert marked["reward.terms.server.url"] == marked["reward.terms.judge.base_url"] == "url"
    assert marked["reward.terms.server.api_key_env"] == marked["reward.terms.judge.api_key_env"] == "env"
    assert marked["tasks.reward.terms.server.url"] == "url"
    # any field named like a key, a token, a password or a URL is marked
    named = {
        name
        for name, _ in _leaf_fields(RLConfig)
        if re.search(r"(^|_)(api_key|token|password|secret|urls?|uri)($|_)", name.rsplit(".", 1)[-1])
    }
    assert len(named) >= 10 and named <= set(marked), sorted(named - set(marked))


def test_redaction_of_values_and_url_credentials():
    assert redact_url("http://user:pw@host:8000/x") == "http://***@host:8000/x"
    assert (
        redact_url("see https://TOKEN@github.com/a and http://plain/b")
        == "see https://***@github.com/a and http://plain/b"
    )
    assert redact_url("mail me at a@b.c") == "mail me at a@b.c"
    register_secrets({"abc"})
    # a registered secret goes where it stands as a word, not inside other words
    assert redact("--api-key abc, --api-key=abc 'abc' tabcase") == "--api-key ***, --api-key=*** '***' tabcase"


def test_the_secrets_of_a_config_are_collected_and_redacted_in_its_dict(monkeypatch):
    monkeypatch.setenv("ARCHON_TEST_RM_TOKEN", ENV_TOKEN)
    config = parse_config(
        [
            "--rollout.vllm.api-key",
            CLI_KEY,
            "--logging.mlflow-tracking-uri",
            f"http://alice:{URL_PASSWORD}@127.0.0.1:5000",
            "--logging.run-dir",
            "runs/unused",
        ]
    )
    reward = dataclasses.replace(
        config.reward,
        terms=(
            *config.reward.terms,
            _server_term(f"http://bob:{URL_PASSWORD}x@127.0.0.1:9/score", "ARCHON_TEST_RM_TOKEN"),
        ),
    )
    config = dataclasses.replace(config, reward=reward)
    found = secret_values(config)
    assert {CLI_KEY, URL_PASSWORD, f"alice:{URL_PASSWORD}", URL_PASSWORD + "x", ENV_TOKEN} <= found
    as_dict = redacted_config(config)
    assert as_dict["rollout"]["vllm"]["api_key"] == REDACTED
    assert as_dict["logging"]["mlflow_tracking_uri"] == "http://***@127.0.0.1:5000"
    assert as_dict["reward"]["terms"][-1]["server"]["url"] == "http://***@127.0.0.1:9/score"
    assert as_dict["reward"]["terms"][-1]["server"]["api_key_env"] == "ARCHON_TEST_RM_TOKEN"  # a name, not a secret


def _server_term(url: str, api_key_env: str):
    from archon.rl.rewards import RewardTermConfig
    from archon.rl.rewards.http import RewardServerConfig

    server = RewardServerConfig(url=url, retries=0, timeout_s=1.0, api_key_env=api_key_env)
    return RewardTermConfig(name="rm", kind="server", weight=0.5, server=server)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _files_holding(root: Path, secrets: list[str]) -> dict[str, list[str]]:
    """{path: the secrets its bytes hold} of every file under `root`."""
    found = {}
    for path in root.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            held = [s for s in secrets if s.encode() in data]
            if held:
                found[str(path.relative_to(root))] = held
    return found


LAUNCHERS = {
    "python": [sys.executable],
    "torchrun-2": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"],
}


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_a_run_writes_no_planted_secret_anywhere(launcher, tiny_setup, tmp_path):  # noqa: F811
    """A recipe run (one process, or two under torchrun) with an API key on the command line, a
    reward-server URL with a password in its YAML file and a key read from the environment, logging
    to TensorBoard, wandb (offline) and MLflow, exporting adapters (model cards) and sample tables:
    no file under the run directory or wandb's directory, and nothing it prints, holds any of them.
    The reward server is down, so its URL is in the run's warnings."""
    run_dir, wandb_dir = tmp_path / "run", tmp_path / "wandb_elsewhere"
    wandb_dir.mkdir()
    config_file = tmp_path / "run.yaml"
    config_file.write_text(
        "reward:\n"
        "  num_workers: 0\n"
        "  terms:\n"
        "    - {name: digits, function: 'reward_fixtures:digits_or_raise'}\n"
        "    - name: rm\n"
        "      kind: server\n"
        "      weight: 0.5\n"
        f"      server: {{url: 'http://rm:{URL_PASSWORD}@127.0.0.1:{_closed_port()}/score', retries: 0, "
        "timeout_s: 2.0, api_key_env: ARCHON_TEST_RM_TOKEN}\n"
    )
    args = [a for a in _args(tiny_setup, run_dir, 2) if a != "--logging.no-progress"]
    args = args[: args.index("--reward.function")] + args[args.index("--reward.num-workers") + 2 :]
    args = (
        args[: args.index("--logging.backends") + 1]
        + ["tensorboard", "wandb", "mlflow"]
        + args[args.index("--logging.backends") + 1 :]
    )
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(REPO / "tests"), str(REPO), os.environ.get("PYTHONPATH", "")]),
        OMP_NUM_THREADS="1",
        WANDB_MODE="offline",
        WANDB_SILENT="true",
        WANDB_DIR=str(wandb_dir),
        ARCHON_TEST_RM_TOKEN=ENV_TOKEN,
    )
    env.pop("MLFLOW_TRACKING_URI", None)
    command = [
        *LAUNCHERS[launcher],
        str(REPO / "recipes" / "grpo_lora.py"),
        "--config",
        str(config_file),
        *args,
        "--rollout.vllm.api-key",
        CLI_KEY,
        "--checkpoint.every",
        "1",
        "--logging.samples-every",
        "1",
        "--logging.samples-per-table",
        "4",
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    secrets = [CLI_KEY, URL_PASSWORD, ENV_TOKEN]
    output = result.stdout + result.stderr
    assert "***@127.0.0.1" in output, "the reward server's failures should be logged, without its password"
    assert [s for s in secrets if s in output] == []
    card = (run_dir / "adapter" / "README.md").read_text()
    assert list((run_dir / "adapters").glob("step_*/README.md"))
    assert "--rollout.vllm.api-key ***" in card and (launcher == "python" or "--nproc_per_node 2" in card), card
    assert list(wandb_dir.rglob("*.wandb")) and (run_dir / "mlruns").is_dir() and (run_dir / "tensorboard").is_dir()
    assert not (run_dir / "wandb").exists(), "WANDB_DIR is honoured"
    assert _files_holding(run_dir, secrets) == {}
    assert _files_holding(wandb_dir, secrets) == {}


def test_a_tracker_that_fails_names_its_uri_without_its_credentials(tmp_path, monkeypatch):
    config = parse_config(
        [
            "--logging.backends",
            "mlflow",
            "--logging.mlflow-tracking-uri",
            f"http://alice:{URL_PASSWORD}@127.0.0.1:{_closed_port()}",
            "--logging.run-dir",
            str(tmp_path / "run"),
        ]
    )
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with pytest.raises(TrackerError) as raised:
        open_trackers(config.logging, tmp_path / "run", dataclasses.asdict(config))
    assert "http://***@127.0.0.1" in str(raised.value) and URL_PASSWORD not in str(raised.value)


def test_an_unexpected_error_is_printed_with_its_secrets_redacted(capsys):
    import archon.recipes.grpo_lora as recipe

    register_secrets({CLI_KEY})
    try:
        raise RuntimeError(f"server refused key {CLI_KEY} at http://alice:{URL_PASSWORD}@host/v1")
    except RuntimeError as error:
        recipe._print_redacted_traceback(type(error), error, error.__traceback__)
    err = capsys.readouterr().err
    assert err.startswith("Traceback") and "RuntimeError: server refused key *** at http://***@host/v1" in err
    assert CLI_KEY not in err and URL_PASSWORD not in err


def test_a_short_numeric_secret_leaves_the_metrics_numbers_alone(tmp_path):
    """Redaction applies to the strings of a record, so a secret that looks like a number does not
    corrupt metrics.jsonl."""
    from archon.rl.logging.metrics import MetricsLogger, read_metrics

    register_secrets({"1234"})
    logger = MetricsLogger(tmp_path, tensorboard=False)
    logger.log(1, {"loss": 0.1234, "note": "key 1234"})
    logger.close()
    assert read_metrics(tmp_path) == [{"step": 1, "loss": 0.1234, "note": "key ***"}]


def test_a_stopped_tasks_record_holds_no_secret(tmp_path):
    """stopped.json keeps why a task stopped, an error's message that may quote a URL or a key."""
    import json
    import types

    from archon.rl.run.task import STOPPED_FILE, Task

    register_secrets({CLI_KEY})
    task = types.SimpleNamespace(dir=tmp_path / "task", producer=None, stopped=None)
    Task.stop(task, 3, f"reward server http://rm:{URL_PASSWORD}@host failed with key {CLI_KEY}", writes_record=True)
    record = json.loads((tmp_path / "task" / STOPPED_FILE).read_text())
    assert record == {"step": 3, "reason": "reward server http://***@host failed with key ***"}
    assert task.stopped == record["reason"]


def test_an_unexpected_error_reaches_torchruns_error_file_with_its_secrets_redacted(tmp_path, monkeypatch):
    """@record writes an unexpected error's message to TORCHELASTIC_ERROR_FILE, which torchrun prints
    in its failure summary; the recipe redacts it (and the errors it chains) first."""
    import archon.recipes.grpo_lora as recipe

    register_secrets({CLI_KEY})
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.setattr("archon.rl.config.parse_config", lambda argv: None)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # main sets its own

    def run(config):
        try:
            raise OSError(f"refused http://alice:{URL_PASSWORD}@host/v1")
        except OSError as cause:
            raise RuntimeError(f"server refused key {CLI_KEY}") from cause

    monkeypatch.setattr(recipe, "run", run)
    with pytest.raises(RuntimeError) as raised:
        recipe.main(["--model.path", str(tmp_path)])
    written = error_file.read_text()
    assert "server refused key ***" in written and "http://***@host/v1" in str(raised.value.__cause__)
    assert CLI_KEY not in written and URL_PASSWORD not in written
