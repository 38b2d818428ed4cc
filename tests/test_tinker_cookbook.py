"""tinker-cookbook's math_rl recipe (env=arithmetic), unmodified, against the server: it runs its
RL steps (sampling groups, training on them with importance_sampling, saving its final
checkpoints) on a tiny local base; the tokenizer comes from the base's directory, the renderer is
the cookbook's role_colon. docs/tinker.md has a longer run's reward curve."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from test_tinker_fixtures import API_KEY, tinker, tinker_server, tiny_base  # noqa: F401 - fixtures

pytest.importorskip("tinker_cookbook")


def test_math_rl_arithmetic_recipe_runs_unmodified(tinker_server, tiny_base, tmp_path):
    path, _ = tiny_base
    log_path = tmp_path / "math_rl"
    command = [
        sys.executable,
        "-m",
        "tinker_cookbook.recipes.math_rl.train",
        f"model_name={path}",
        "renderer_name=role_colon",
        "env=arithmetic",
        "loss_fn=importance_sampling",
        f"base_url={tinker_server.url}",
        "groups_per_batch=2",
        "group_size=4",
        "max_steps=2",
        "learning_rate=1e-2",
        "lora_rank=4",
        "eval_every=0",
        "save_every=0",
        f"log_path={log_path}",
        "behavior_if_log_dir_exists=delete",
    ]
    env = {**os.environ, "TINKER_API_KEY": API_KEY}
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "Training completed successfully" in run.stdout + run.stderr
    steps = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]
    trained = [s for s in steps if "env/all/reward/total" in s]
    assert len(trained) == 2
    assert all(0 < s["tokens/sampled"] <= 2 * 4 * 5 for s in trained)  # 2 groups of 4, max_tokens 5
    checkpoints = [json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines()]
    assert checkpoints[-1]["sampler_path"].startswith("tinker://")
