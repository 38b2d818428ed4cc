"""Bad configuration, data and reward settings fail (or are skipped and reported) with a message
that names the culprit: the field and the file, or the file:row. None of them touches a run directory."""

import dataclasses
import hashlib
import json
import logging
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import yaml

from archon.rl.config import RLConfig, TaskConfig, load_config_file, parse_config, validate
from archon.rl.data import DataConfig, load_prompt_dataset
from archon.rl.rewards import RewardConfig, RewardScorer
from archon.rl.tasks import build_char_tokenizer


def _snapshot(directory: Path) -> dict[str, str]:
    """Every path under `directory` with a hash of its contents (directories: "dir")."""
    return {
        str(p.relative_to(directory)): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
    }


@pytest.fixture
def run_dir(tmp_path):
    """A run directory from an earlier run; every failure below must leave it as it is."""
    root = tmp_path / "run"
    (root / "checkpoints" / "step-000002").mkdir(parents=True)
    (root / "checkpoints" / "step-000002" / "trainer_state.json").write_text('{"step": 2}')
    (root / "adapter").mkdir()
    (root / "adapter" / "adapter_model.safetensors").write_bytes(b"earlier adapter")
    (root / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    return root


def _replace(config, path: str, value):
    """A copy of `config` with the dotted field `path` set to `value`."""
    head, _, rest = path.partition(".")
    if not rest:
        return dataclasses.replace(config, **{head: value})
    return dataclasses.replace(config, **{head: _replace(getattr(config, head), rest, value)})


# ---- config files -------------------------------------------------------------------------------

FILE_CASES = {
    # name: (file name, contents, field the message must name)
    "yaml-int-word": ("run.yaml", "steps: ten\n", "steps: expected an integer, got str 'ten'"),
    "yaml-scalar-for-section": ("run.yaml", "rollout: 5\n", "rollout: expected a section"),
    "yaml-null-section": ("run.yaml", "lora: null\n", "lora: expected a section"),
    "yaml-mapping-for-scalar": ("run.yaml", "optim: {lr: {value: 1}}\n", "optim.lr: expected a number"),
    "yaml-float-word": ("run.yaml", "optim: {lr: fast}\n", "optim.lr: expected a number, got str 'fast'"),
    "yaml-fraction-for-int": ("run.yaml", "steps: 10.5\n", "steps: expected an integer, got float 10.5"),
    "yaml-bad-choice": ("run.yaml", "rollout: {engine: vlm}\n", "rollout.engine: expected one of 'native', 'vllm'"),
    "yaml-unknown-key": ("run.yaml", "rollout: {groupsize: 4}\n", "unknown config key 'rollout.groupsize'"),
    "yaml-bool-for-str": ("run.yaml", "data: {answer_field: no}\n", "data.answer_field: expected a string"),
    "yaml-bad-bool": ("run.yaml", "logging: {progress: maybe}\n", "logging.progress: expected true or false"),
    "yaml-short-tuple": ("run.yaml", "optim: {betas: [0.9]}\n", "optim.betas: expected a list of 2 items"),
    "yaml-str-for-list": ("run.yaml", "lora: {target_modules: q_proj}\n", "lora.target_modules: expected a list"),
    "yaml-deep-bad-choice": ("run.yaml", "algorithm: {name: ppo2}\n", "algorithm.name: expected one of 'grpo'"),
    "yaml-bad-choice-old-spelling": (
        "run.yaml",
        "algorithm: {loss: {algorithm: ppo2}}\n",
        "algorithm.loss.algorithm: expected one of 'grpo'",
    ),
    "yaml-both-spellings": (
        "run.yaml",
        "algorithm: {name: grpo, loss: {algorithm: dapo}}\n",
        "algorithm.loss.algorithm='dapo' and algorithm.name='grpo' set the same thing to different values",
    ),
    "yaml-task-both-spellings": (
        "run.yaml",
        "tasks: [{name: a}, {name: b, algorithm: {name: rloo, loss: {algorithm: cispo}}}]\n",
        "tasks[1].algorithm.loss.algorithm='cispo' and tasks[1].algorithm.name='rloo'",
    ),
    "yaml-dataclass-check": ("run.yaml", "lora: {rank: 0}\n", "lora: LoRAConfig.rank must be positive"),
    "yaml-reward-timeout": ("run.yaml", "reward: {timeout_s: 0}\n", "reward: RewardConfig.timeout_s must be positive"),
    "yaml-scalar-for-mapping": ("run.yaml", "lora: {rank_pattern: 8}\n", "lora.rank_pattern: expected a mapping"),
    "yaml-bad-mapping-value": (
        "run.yaml",
        "lora: {alpha_pattern: {q_proj: high}}\n",
        "lora.alpha_pattern['q_proj']: expected a number",
    ),
    "yaml-syntax": ("run.yaml", "steps: [1, 2\n", "invalid YAML"),
    "yaml-top-level-list": ("run.yaml", "- steps\n- 3\n", "the config: expected a section"),
    "toml-int-word": ("run.toml", "steps = 'ten'\n", "steps: expected an integer, got str 'ten'"),
    "toml-scalar-for-section": ("run.toml", "[rollout]\nvllm = 3\n", "rollout.vllm: expected a section"),
    "toml-bad-choice": ("run.toml", "[parallel]\nparam_dtype = 'bf16'\n", "parallel.param_dtype: expected one of"),
    "toml-syntax": ("run.toml", "steps = \n", "Invalid value"),
    "toml-unknown-section": ("run.toml", "[optimiser]\nlr = 1e-3\n", "unknown config key 'optimiser'"),
}


@pytest.mark.parametrize("case", sorted(FILE_CASES))
def test_config_file_errors_name_the_field_and_the_file(case, tmp_path):
    name, text, culprit = FILE_CASES[case]
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError) as error:
        load_config_file(path)
    message = str(error.value)
    assert str(path) in message and culprit in message, message
    with pytest.raises(ValueError, match="config file"):  # the recipe's path to it says the same
        parse_config(["--config", str(path)])


@pytest.mark.parametrize(
    "name, contents, error, culprit",
    [
        ("missing.yaml", None, FileNotFoundError, "missing.yaml"),
        ("run.json", b"{}", ValueError, "run.json"),
        ("latin1.yaml", "steps: 3\nseed: \xe9\n".encode("latin-1"), ValueError, "latin1.yaml"),
    ],
)
def test_unreadable_config_files_are_named(name, contents, error, culprit, tmp_path):
    path = tmp_path / name
    if contents is not None:
        path.write_bytes(contents)
    with pytest.raises(error, match=culprit):
        load_config_file(path)


def test_file_values_take_the_typed_path_of_a_flag(tmp_path):
    """PyYAML reads 1e-3 as a string; it is the float the flag --optim.lr 1e-3 gives."""
    path = tmp_path / "run.yaml"
    path.write_text("optim: {lr: 1e-3, betas: ['0.8', 0]}\nsteps: '12'\ndata: {answer_field: null}\n")
    from_file = load_config_file(path)
    from_flags = parse_config(
        ["--optim.lr", "1e-3", "--optim.betas", "0.8", "0", "--steps", "12", "--data.answer-field", "None"]
    )
    assert from_file == from_flags
    assert from_file.optim.lr == 1e-3 and isinstance(from_file.optim.lr, float)
    toml = tmp_path / "run.toml"
    toml.write_text("[data]\nanswer_field = 'None'\n[lora]\ntarget_modules = ['q_proj']\n")
    config = load_config_file(toml)
    assert config.data.answer_field is None and config.lora.target_modules == ("q_proj",)


def test_every_field_loads_from_a_file():
    """Each field of the tree (whatever its type) goes through the typed path: the defaults, written
    out and read back, give the defaults."""

    def plain(value):
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value

    values = plain(dataclasses.asdict(RLConfig()))
    from archon.rl.config import merge_into

    assert merge_into(RLConfig(), yaml.safe_load(yaml.safe_dump(values))) == RLConfig()


# ---- command-line flags -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, culprit",
    [
        (["--steps", "ten"], "--steps"),
        (["--rollout.engine", "vlm"], "--rollout.engine"),
        (["--optim.lr", "fast"], "--optim.lr"),
        (["--rollout.grop-size", "4"], "--rollout.grop-size"),
    ],
)
def test_bad_flags_name_the_flag(argv, culprit, capsys):
    with pytest.raises(SystemExit):
        parse_config(argv)
    captured = capsys.readouterr()
    assert culprit in captured.out + captured.err


def test_config_flag_without_a_path():
    with pytest.raises(SystemExit, match="--config needs a file path"):
        parse_config(["--steps", "3", "--config"])


def test_toml_files_are_read_with_the_backport_where_python_has_no_tomllib(tmp_path):
    """Python 3.10 has no tomllib; there the tomli backport (a dependency on 3.10 only) reads TOML."""
    path = tmp_path / "run.toml"
    path.write_text("steps = 3\n[lora]\nrank = 8\n")
    script = textwrap.dedent(
        f"""
        import sys, tomllib
        sys.modules["tomli"] = tomllib  # the backport, under its own name (tomllib is tomli, adopted)
        sys.modules["tomllib"] = None  # as on Python 3.10
        from archon.rl.config import files, load_config_file
        assert files.tomllib is sys.modules["tomli"]
        config = load_config_file({str(path)!r})
        print(config.steps, config.lora.rank)
        """
    )
    repo = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-c", script], cwd=repo, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["3", "8"]


# ---- renamed settings ---------------------------------------------------------------------------


def test_the_old_name_of_rl_config_warns_and_is_rl_config():
    import archon.rl.config as config_module

    renamed = r"archon\.rl\.config\.GRPOConfig is deprecated .*; use archon\.rl\.config\.RLConfig"
    with pytest.warns(FutureWarning, match=renamed):
        from archon.rl.config import GRPOConfig
    assert GRPOConfig is RLConfig
    with pytest.warns(FutureWarning, match="GRPOConfig is deprecated"):
        assert config_module.GRPOConfig is RLConfig
    with pytest.raises(AttributeError, match="has no attribute 'RLConfg'"):
        config_module.RLConfg  # noqa: B018


ALGORITHM_NAME_SPELLINGS = {
    # name: (file name, old spelling, new spelling, the old field in the warning)
    "yaml": (
        "run.yaml",
        "algorithm: {loss: {algorithm: dapo, kl_coef: 0.1}, minibatches: 2}\n",
        "algorithm: {name: dapo, loss: {kl_coef: 0.1}, minibatches: 2}\n",
        "algorithm.loss.algorithm",
    ),
    "toml": (
        "run.toml",
        "[algorithm.loss]\nalgorithm = 'cispo'\n",
        "[algorithm]\nname = 'cispo'\n",
        "algorithm.loss.algorithm",
    ),
    "task": (
        "run.yaml",
        "tasks: [{name: a}, {name: b, algorithm: {loss: {algorithm: rloo}}}]\n",
        "tasks: [{name: a}, {name: b, algorithm: {name: rloo}}]\n",
        "tasks[1].algorithm.loss.algorithm",
    ),
    "both-spellings-alike": (
        "run.yaml",
        "algorithm: {name: gspo, loss: {algorithm: gspo}}\n",
        "algorithm: {name: gspo}\n",
        "algorithm.loss.algorithm",
    ),
}


@pytest.mark.parametrize("case", sorted(ALGORITHM_NAME_SPELLINGS))
def test_the_old_spelling_of_the_algorithm_name_in_a_file_warns_and_means_the_same(case, tmp_path):
    name, old_text, new_text, old_field = ALGORITHM_NAME_SPELLINGS[case]
    (tmp_path / "old").mkdir()
    (tmp_path / "new").mkdir()
    old_path, new_path = tmp_path / "old" / name, tmp_path / "new" / name
    old_path.write_text(old_text)
    new_path.write_text(new_text)
    new_field = old_field.removesuffix("loss.algorithm") + "name"
    warning = re.escape(f"config file {old_path}: {old_field} is deprecated") + ".*" + re.escape(f"use {new_field}")
    with pytest.warns(FutureWarning, match=warning):
        old = load_config_file(old_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new spelling does not warn
        new = load_config_file(new_path)
    assert old == new and old != RLConfig()


def test_the_old_algorithm_name_flag_warns_and_means_the_same():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new = parse_config(["--algorithm.name", "dapo"])
    for argv in (["--algorithm.loss.algorithm", "dapo"], ["--algorithm.loss.algorithm=dapo"]):
        with pytest.warns(FutureWarning, match=r"--algorithm\.loss\.algorithm is deprecated .*; use --algorithm\.name"):
            assert parse_config(argv) == new
    assert new.algorithm.name == "dapo"
    with (
        pytest.warns(FutureWarning),
        pytest.raises(
            ValueError,
            match=re.escape("--algorithm.loss.algorithm='dapo' and --algorithm.name='rloo' set the same thing"),
        ),
    ):
        parse_config(["--algorithm.name=rloo", "--algorithm.loss.algorithm", "dapo"])
    with pytest.warns(FutureWarning):  # both alike: no conflict
        assert parse_config(["--algorithm.name", "dapo", "--algorithm.loss.algorithm", "dapo"]) == new


def test_task_configs_are_the_tasks_or_the_one_unnamed_task_of_the_top_level_settings():
    config = _replace(RLConfig(), "data.path", "train.jsonl")
    for path, value in {
        "eval.path": "held_out.jsonl",
        "reward.function": "exact",
        "algorithm.name": "dapo",
        "lora.rank": 4,
        "optim.lr": 1e-3,
        "rollout.max_staleness": 2,
    }.items():
        config = _replace(config, path, value)
    (single,) = config.task_configs()
    assert single == TaskConfig(
        name="",
        data=config.data,
        eval_path="held_out.jsonl",
        reward=config.reward,
        algorithm=config.algorithm,
        lora=config.lora,
        optim=config.optim,
        max_staleness=2,
    )
    tasks = (TaskConfig(name="a"), TaskConfig(name="b", max_staleness=1))
    assert dataclasses.replace(config, tasks=tasks).task_configs() == tasks


# ---- up-front validation ------------------------------------------------------------------------

VALIDATION_CASES = {
    # name: (changes, culprit in the message)
    "steps-zero": ({"steps": 0}, "steps=0"),
    "steps-negative": ({"steps": -5}, "steps=-5"),
    "minibatches-zero": ({"algorithm.minibatches": 0}, "algorithm.minibatches=0"),
    "ppo-epochs-zero": ({"algorithm.ppo_epochs": 0}, "algorithm.ppo_epochs=0"),
    "group-of-one": ({"rollout.group_size": 1}, "rollout.group_size=1"),
    "group-of-one-drgrpo": (
        {"rollout.group_size": 1, "algorithm.name": "drgrpo"},
        "rollout.group_size=1: algorithm.name='drgrpo'",
    ),
    "moe-bias-update-with-vllm": (
        {"model.moe.bias_update_rate": 0.001, "rollout.engine": "vllm"},
        "model.moe.bias_update_rate=0.001",
    ),
    "ep-not-dividing-dp-shard": ({"parallel.ep": 2}, "ep=2 does not divide dp_shard=1"),
    "lora-alpha-zero": ({"lora.alpha": 0.0}, "lora.alpha=0.0"),
    "lora-alpha-negative": ({"lora.alpha": -4.0}, "lora.alpha=-4.0"),
    "eval-every-negative": ({"eval.every": -1}, "eval.every=-1"),
    "eval-max-prompts-negative": ({"eval.max_prompts": -1}, "eval.max_prompts=-1"),
    "checkpoint-every-negative": ({"checkpoint.every": -2}, "checkpoint.every=-2"),
    "importance-cap-zero": ({"algorithm.loss.importance_cap": 0.0}, "algorithm.loss.importance_cap=0.0"),
    "importance-sampling-without-recompute": (
        {"algorithm.loss.importance_sampling": "sequence", "algorithm.recompute_old_logprobs": False},
        "algorithm.loss.importance_sampling='sequence': needs algorithm.recompute_old_logprobs=true",
    ),
    "top-p-without-recompute": (
        {"rollout.top_p": 0.9, "algorithm.recompute_old_logprobs": False},
        "algorithm.recompute_old_logprobs=False: must be true with rollout.top_p=0.9",
    ),
    "top-k-without-recompute": (
        {"rollout.top_k": 20, "algorithm.recompute_old_logprobs": False},
        "algorithm.recompute_old_logprobs=False: must be true with rollout.top_p=1.0 / rollout.top_k=20",
    ),
    "group-larger-than-the-native-table": (
        {"rollout.group_size": 8, "rollout.max_batch_sequences": 4},
        "rollout.max_batch_sequences=4: must be at least rollout.group_size=8",
    ),
    "icepop-band-outside-one": ({"algorithm.loss.icepop_band": (1.5, 5.0)}, "algorithm.loss.icepop_band=(1.5, 5.0)"),
    "dual-clip-not-above-one": ({"algorithm.loss.clip_ratio_c": 0.9}, "algorithm.loss.clip_ratio_c=0.9: must be > 1"),
    "dual-clip-with-cispo": (
        {"algorithm.loss.clip_ratio_c": 3.0, "algorithm.name": "cispo"},
        "algorithm.loss.clip_ratio_c=3.0: dual clip bounds the PPO clipped objective",
    ),
    "staleness-negative": ({"rollout.max_staleness": -1}, "rollout.max_staleness=-1: must be 0 or more"),
    "staleness-unbounded": (
        {"rollout.engine": "vllm", "rollout.max_staleness": 10**9},
        "rollout.max_staleness=1000000000: must be at most 64: the producer runs up to N steps ahead",
    ),
    "staleness-not-below-steps": (
        {"steps": 3, "rollout.engine": "vllm", "rollout.max_staleness": 3},
        "rollout.max_staleness=3: must be below steps=3",
    ),
    "continue-without-staleness": (
        {"rollout.engine": "vllm", "rollout.update_policy": "continue"},
        "rollout.update_policy='continue': switches requests in flight to a newly published adapter version",
    ),
    "entropy-coef-negative": ({"algorithm.loss.entropy_coef": -0.01}, "algorithm.loss.entropy_coef=-0.01"),
    "kl-cap-with-k2": (
        {"algorithm.loss.kl_cap": 10.0, "algorithm.loss.kl_coef": 0.1, "algorithm.loss.kl_estimator": "k2"},
        "algorithm.loss.kl_cap=10.0: caps the k3 estimator",
    ),
    "kl-cap-without-kl": ({"algorithm.loss.kl_cap": 10.0}, "algorithm.loss.kl_cap=10.0: has no effect"),
    "distillation-weight-without-teacher": (
        {"algorithm.distillation_weight": 0.5},
        "algorithm.distillation_weight=0.5: weights a teacher's advantage",
    ),
    "group-of-one-rloo": (
        {"rollout.group_size": 1, "algorithm.name": "rloo"},
        "rollout.group_size=1: algorithm.name='rloo'",
    ),
    "group-of-one-cispo": (
        {"rollout.group_size": 1, "algorithm.name": "cispo"},
        "rollout.group_size=1: algorithm.name='cispo': "
        "algorithm 'cispo' normalises each reward within its prompt's group",
    ),
    "dynamic-sampling-with-groups-of-one": (
        {"rollout.group_size": 1, "algorithm.name": "reinforce_pp", "algorithm.dynamic_sampling": True},
        "algorithm.dynamic_sampling=True: keeps only the groups whose rewards differ",
    ),
    "icepop-with-sequence-importance-sampling": (
        {"algorithm.loss.icepop_band": (0.5, 5.0), "algorithm.loss.importance_sampling": "sequence"},
        "algorithm.loss.importance_sampling='sequence': IcePop",
    ),
    "icepop-without-importance-sampling": (
        {"algorithm.loss.icepop_band": (0.5, 5.0), "algorithm.loss.importance_sampling": "none"},
        "algorithm.loss.importance_sampling='none': IcePop",
    ),
    "response-whitening-with-grpo": (
        {"algorithm.loss.advantage_whitening": "response"},
        "algorithm.loss.advantage_whitening='response': only algorithms that whiten their advantages over the batch "
        "(reinforce_pp, reinforce_pp_baseline) use it, not 'grpo'",
    ),
    "kl-coef-negative": ({"algorithm.loss.kl_coef": -0.1}, "algorithm.loss.kl_coef=-0.1"),
    "temperature-zero": ({"rollout.temperature": 0.0}, "rollout.temperature=0.0"),
    "overlong-buffer-too-big": (
        {"algorithm.overlong_buffer": 300, "rollout.max_new_tokens": 256},
        "algorithm.overlong_buffer=300",
    ),
    "lora-null-with-kl": ({"lora": None, "algorithm.loss.kl_coef": 0.1}, "algorithm.loss.kl_coef=0.1 (the reference"),
    "lora-null": ({"lora": None}, "lora=None"),
    "reward-no-module": ({"reward.function": "no_such_module:score"}, "reward.function='no_such_module:score'"),
    "reward-bad-form": ({"reward.function": "score_it"}, "reward.function='score_it'"),
    "parallel-degrees": ({"parallel.tp": 3}, "parallel: "),
    "optim-lr-nan": ({"optim.lr": float("nan")}, "optim.lr=nan: must be a finite number >= 0"),
    "optim-lr-inf": ({"optim.lr": float("inf")}, "optim.lr=inf: must be a finite number >= 0"),
    "optim-lr-negative": ({"optim.lr": -1e-5}, "optim.lr=-1e-05: must be a finite number >= 0"),
    "optim-weight-decay-negative": ({"optim.weight_decay": -0.1}, "optim.weight_decay=-0.1"),
    "optim-weight-decay-nan": ({"optim.weight_decay": float("nan")}, "optim.weight_decay=nan"),
    "optim-beta-one": ({"optim.betas": (0.9, 1.0)}, "optim.betas[1]=1.0: must be in [0, 1)"),
    "optim-beta-negative": ({"optim.betas": (-0.1, 0.999)}, "optim.betas[0]=-0.1: must be in [0, 1)"),
    "optim-eps-zero": ({"optim.eps": 0.0}, "optim.eps=0.0: must be a finite number > 0"),
    "optim-max-grad-norm-inf": ({"optim.max_grad_norm": float("inf")}, "optim.max_grad_norm=inf"),
    "optim-max-grad-norm-negative": ({"optim.max_grad_norm": -1.0}, "optim.max_grad_norm=-1.0"),
    "speculative-with-vllm": (
        {
            "rollout.engine": "vllm",
            "rollout.speculative.method": "draft_model",
            "rollout.speculative.draft_model_path": "d",
        },
        "rollout.speculative.method='draft_model': needs rollout.engine=native",
    ),
    "speculative-mtp-with-the-demo-model": (
        {"rollout.speculative.method": "mtp"},
        "rollout.speculative.method='mtp': the demo model has no MTP layer",
    ),
    "speculative-mtp-skipped": (
        {"rollout.speculative.method": "mtp", "model.mtp": "skip"},
        "rollout.speculative.method='mtp': drafts with the MTP layer, which model.mtp='skip' leaves unloaded",
    ),
    "speculative-draft-model-without-path": (
        {"rollout.speculative.method": "draft_model"},
        "rollout.speculative.draft_model_path=None: is needed",
    ),
    "speculative-draft-head-without-path": (
        {"rollout.speculative.method": "draft_head"},
        "rollout.speculative.draft_head_path=None: is needed",
    ),
    "speculative-zero-tokens": (
        {"rollout.speculative.method": "mtp", "rollout.speculative.num_tokens": 0},
        "rollout.speculative.num_tokens=0",
    ),
    "speculative-max-rows-while-off": (
        {"rollout.speculative.max_rows": 8},
        "rollout.speculative.max_rows=8: limits speculative decoding, which is off",
    ),
    "speculative-with-routing-replay": (
        {"rollout.speculative.method": "mtp", "algorithm.routing_replay": "rollout"},
        "rollout.speculative.method='mtp': cannot be combined with algorithm.routing_replay=rollout",
    ),
}


@pytest.mark.parametrize("case", sorted(VALIDATION_CASES))
def test_invalid_settings_fail_before_anything_is_built(case, run_dir):
    from archon.rl.loop import RLRun

    changes, culprit = VALIDATION_CASES[case]
    config = _replace(RLConfig(), "logging.run_dir", str(run_dir))
    for path, value in changes.items():
        config = _replace(config, path, value)
    before = _snapshot(run_dir)
    with pytest.raises(ValueError) as error:
        RLRun(config)  # validation is its first act: no model is built
    assert culprit in str(error.value), str(error.value)
    assert _snapshot(run_dir) == before


def test_groups_of_one_where_the_algorithm_learns_from_them():
    """REINFORCE++ and REINFORCE++-baseline whiten over the batch, so one sample per prompt is a
    valid setting for them; per task, the algorithms that need groups are named with the task."""
    from archon.rl.config import TaskConfig

    one = dataclasses.replace(RLConfig().rollout, group_size=1)
    for name in ("reinforce_pp", "reinforce_pp_baseline"):
        validate(_replace(RLConfig(rollout=one), "algorithm.name", name), world_size=1)
    baseline = _replace(RLConfig(), "algorithm.name", "reinforce_pp_baseline").algorithm
    rloo = _replace(RLConfig(), "algorithm.name", "rloo").algorithm
    tasks = (TaskConfig(name="a", algorithm=baseline), TaskConfig(name="b", algorithm=rloo))
    with pytest.raises(ValueError) as error:
        validate(RLConfig(tasks=tasks, rollout=one), world_size=1)
    message = str(error.value)
    assert "rollout.group_size=1: tasks[1].algorithm.name='rloo'" in message, message
    assert "tasks[0]" not in message, message


def test_prompts_per_step_below_the_data_parallel_size(run_dir, monkeypatch):
    from archon.rl.loop import RLRun

    config = _replace(_replace(RLConfig(), "rollout.prompts_per_step", 2), "logging.run_dir", str(run_dir))
    validate(config, world_size=2)
    with pytest.raises(ValueError, match=r"rollout.prompts_per_step=2: smaller than the data-parallel size 4"):
        validate(config, world_size=4)
    monkeypatch.setenv("WORLD_SIZE", "4")  # what torchrun sets
    before = _snapshot(run_dir)
    with pytest.raises(ValueError, match=r"rollout.prompts_per_step=2"):
        RLRun(config)
    with pytest.raises(ValueError, match=r"rollout.prompts_per_step=2"):
        parse_config(["--rollout.prompts-per-step", "2"])
    assert _snapshot(run_dir) == before


def test_optimizer_settings_are_checked_on_the_command_line_and_per_task():
    with pytest.raises(ValueError, match=r"optim\.lr=nan"):
        parse_config(["--optim.lr", "nan"])
    from archon.trainer import OptimConfig

    tasks = (TaskConfig(name="a"), TaskConfig(name="b", optim=OptimConfig(lr=float("inf"), eps=-1.0)))
    with pytest.raises(ValueError) as error:
        validate(RLConfig(tasks=tasks), world_size=1)
    message = str(error.value)
    assert "tasks[1].optim.lr=inf" in message and "tasks[1].optim.eps=-1.0" in message, message
    assert "tasks[0].optim" not in message, message


def test_settings_from_a_file_are_validated_when_parsed(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("steps: 0\nalgorithm: {ppo_epochs: 0}\n")
    with pytest.raises(ValueError, match=r"(?s)steps=0.*algorithm.ppo_epochs=0"):  # every problem at once
        parse_config(["--config", str(path)])


def test_the_staleness_bound_is_bounded_when_parsed_and_per_task():
    with pytest.raises(ValueError, match=r"rollout\.max_staleness=1000000000: must be at most 64"):
        parse_config(["--rollout.engine", "vllm", "--rollout.max-staleness", "1000000000"])
    tasks = (TaskConfig(name="a", max_staleness=2), TaskConfig(name="b", max_staleness=10**9))
    with pytest.raises(ValueError) as error:
        validate(RLConfig(tasks=tasks, rollout=dataclasses.replace(RLConfig().rollout, engine="vllm")), world_size=1)
    message = str(error.value)
    assert "tasks[1].max_staleness=1000000000: must be at most 64" in message, message
    assert "tasks[0].max_staleness" not in message, message


def _model_dir(root: Path, name: str, **config) -> Path:
    """A model directory with only a config.json (validation never reads weights)."""
    directory = root / name
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"model_type": "qwen3", **config}))
    return directory


TASK_SETTING_CASES = {
    # name: (changes to a task's settings, the problem; {task} stands for where the task's fields are,
    # {max_staleness} for its staleness bound's field, {eval_path} for its held-out prompts')
    "dual-clip-not-above-one": (
        {"algorithm.loss.clip_ratio_c": 0.9},
        "{task}algorithm.loss.clip_ratio_c=0.9: must be > 1",
    ),
    "dual-clip-with-cispo": (
        {"algorithm.name": "cispo", "algorithm.loss.clip_ratio_c": 3.0},
        "{task}algorithm.loss.clip_ratio_c=3.0: dual clip bounds the PPO clipped objective, which "
        "{task}algorithm.name='cispo' does not use",
    ),
    "kl-cap-without-kl": (
        {"algorithm.loss.kl_cap": 10.0},
        "{task}algorithm.loss.kl_cap=10.0: has no effect with {task}algorithm.loss.kl_coef=0",
    ),
    "skipped-steps-zero": (
        {"algorithm.max_skipped_steps": 0},
        "{task}algorithm.max_skipped_steps=0: must be at least 1",
    ),
    "staleness-unbounded": ({"max_staleness": 10**9}, "{max_staleness}=1000000000: must be at most 64"),
    "staleness-without-recompute": (
        {"max_staleness": 1, "algorithm.recompute_old_logprobs": False},
        "{task}algorithm.recompute_old_logprobs=False: {max_staleness}=1 trains on samples of older adapter versions",
    ),
    "lora-alpha-zero": ({"lora.alpha": 0.0}, "{task}lora.alpha=0.0: must be > 0"),
    "optim-lr-inf": ({"optim.lr": float("inf")}, "{task}optim.lr=inf: must be a finite number >= 0"),
    "optim-warmup-past-the-run": (
        {"optim.schedule": "cosine", "optim.warmup_steps": 500},
        "{task}optim.warmup_steps=500: OptimConfig.schedule",
    ),
    "reward-bad-form": ({"reward.function": "score_it"}, "{task}reward.function='score_it'"),
    "data-missing": ({"data.path": "{tmp}/missing.jsonl"}, "{task}data.path='{tmp}/missing.jsonl': no such file"),
    "held-out-missing": ({"eval_path": "{tmp}/missing.jsonl"}, "{eval_path}='{tmp}/missing.jsonl': no such file"),
    "teacher-vocabulary": (
        {"algorithm.teacher_path": "{tmp}/teacher"},
        "{task}algorithm.teacher_path='{tmp}/teacher': the teacher's vocabulary has 1000 tokens and the student's",
    ),
}


@pytest.mark.parametrize("case", sorted(TASK_SETTING_CASES))
def test_a_tasks_settings_are_checked_as_the_single_adapter_runs_naming_its_own_fields(case, tmp_path):
    """The same checks for tasks[i] and for the top-level settings of a run without tasks; each
    problem names the field as it is set: tasks[i].algorithm.loss.clip_ratio_c, tasks[i].max_staleness."""
    changes, problem = TASK_SETTING_CASES[case]
    changes = {path: value.format(tmp=tmp_path) if isinstance(value, str) else value for path, value in changes.items()}
    student = _model_dir(tmp_path, "student", vocab_size=512, max_position_embeddings=4096)
    _model_dir(tmp_path, "teacher", vocab_size=1000)
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    run = _replace(_replace(RLConfig(), "model.path", str(student)), "data.path", str(data))
    top_level = {"max_staleness": "rollout.max_staleness", "eval_path": "eval.path"}
    single = run
    for path, value in changes.items():
        single = _replace(single, top_level.get(path, path), value)
    task = TaskConfig(name="b", data=run.data)
    for path, value in changes.items():
        task = _replace(task, path, value)
    tasks = dataclasses.replace(
        run, data=dataclasses.replace(run.data, path=None), tasks=(TaskConfig(name="a", data=run.data), task)
    )
    for config, fields in (
        (single, {"task": "", "max_staleness": "rollout.max_staleness", "eval_path": "eval.path"}),
        (tasks, {"task": "tasks[1].", "max_staleness": "tasks[1].max_staleness", "eval_path": "tasks[1].eval_path"}),
    ):
        with pytest.raises(ValueError) as error:
            validate(config, world_size=1)
        message = str(error.value)
        assert "\n  " + problem.format(tmp=tmp_path, **fields) in message, message
        assert "tasks[0]" not in message, message


@pytest.mark.parametrize(
    "teacher_vocab, max_new_tokens, culprit",
    [
        (1000, 16, "algorithm.teacher_path="),  # a teacher with another vocabulary
        (512, 128, "rollout.max_new_tokens=128: the model's context is 128 tokens"),  # no room for a prompt
    ],
)
def test_model_files_are_checked_before_loading(teacher_vocab, max_new_tokens, culprit, tmp_path, run_dir):
    from archon.rl.loop import RLRun

    student = _model_dir(tmp_path, "student", vocab_size=512, max_position_embeddings=128)
    teacher = _model_dir(tmp_path, "teacher", vocab_size=teacher_vocab, max_position_embeddings=128)
    config = RLConfig()
    for path, value in {
        "model.path": str(student),
        "algorithm.teacher_path": str(teacher),
        "logging.run_dir": str(run_dir),
        "rollout.max_new_tokens": max_new_tokens,
    }.items():
        config = _replace(config, path, value)
    before = _snapshot(run_dir)
    with pytest.raises(ValueError) as error:
        RLRun(config)
    assert culprit in str(error.value) and str(student) in str(error.value), str(error.value)
    assert _snapshot(run_dir) == before


# ---- data files ---------------------------------------------------------------------------------

GOOD_ROW = b'{"prompt": "1+1=", "answer": "2"}'
DATA_CASES = {
    # name: (line 2 of a JSONL file, reason in the report)
    "bad-json": (b'{"prompt": "2+2=", "answer": ', "invalid JSON"),
    "missing-prompt": (b'{"question": "2+2=", "answer": "4"}', "missing field 'prompt'"),
    "missing-answer": (b'{"prompt": "2+2="}', "missing field 'answer'"),
    "prompt-not-text": (b'{"prompt": 22, "answer": "4"}', "field 'prompt' is int"),
    "not-an-object": (b'["2+2=", "4"]', "row is a JSON list"),
    "not-utf8": (b'{"prompt": "2+2=\xff\xfe", "answer": "4"}', "not valid UTF-8 (byte 0xff"),
    "latin1": ('{"prompt": "caf\u00e9 2+2=", "answer": "4"}'.encode("latin-1"), "not valid UTF-8 (byte 0xe9"),
    "too-long-for-context": (b'{"prompt": "' + b"1+" * 30 + b'1=", "answer": "31"}', "model's context of 64"),
}


@pytest.mark.parametrize("case", sorted(DATA_CASES))
def test_bad_rows_are_skipped_counted_and_reported_with_file_and_row(case, tmp_path, caplog):
    line, reason = DATA_CASES[case]
    path = tmp_path / "train.jsonl"
    path.write_bytes(b"\n".join([GOOD_ROW, line, GOOD_ROW, GOOD_ROW]) + b"\n")
    with caplog.at_level(logging.WARNING, logger="archon.rl.data"):
        dataset = load_prompt_dataset(
            DataConfig(path=str(path)), build_char_tokenizer(), context_length=64, max_new_tokens=8
        )
    assert [e.source for e in dataset.examples] == [f"{path}:1", f"{path}:3", f"{path}:4"]
    assert [e.prompt for e in dataset.examples] == ["1+1="] * 3  # nothing altered
    skipped = dataset.malformed + dataset.too_long
    assert len(skipped) == 1 and str(skipped[0]).startswith(f"{path}:2: ") and reason in str(skipped[0])
    report = dataset.report()
    assert report.startswith("3 prompts, ") and f"{path}:2: " in report and reason in report
    assert f"{path}:2: " in caplog.text


def test_a_prompt_longer_than_the_context_is_never_truncated(tmp_path):
    """The count is the tokens the rollout would see; nothing is cut to fit."""
    tokenizer = build_char_tokenizer()
    prompt = "12+34="
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"prompt": prompt, "answer": "46"}) + "\n" + '{"prompt": "1=", "answer": "1"}\n')
    n = len(tokenizer(prompt)["input_ids"])
    fits = load_prompt_dataset(DataConfig(path=str(path)), tokenizer, context_length=n + 4, max_new_tokens=4)
    assert [e.prompt for e in fits.examples] == [prompt, "1="]
    skipped = load_prompt_dataset(DataConfig(path=str(path)), tokenizer, context_length=n + 3, max_new_tokens=4)
    assert [e.prompt for e in skipped.examples] == ["1="]
    assert [str(r) for r in skipped.too_long] == [
        f"{path}:1: prompt has {n} tokens; with 4 new tokens that is more than the model's context of {n + 3}"
    ]
    assert skipped.report().startswith("1 prompts, 0 malformed rows, 1 too long")


@pytest.mark.parametrize(
    "name, contents, error, culprit",
    [
        ("missing.jsonl", None, FileNotFoundError, "missing.jsonl"),
        ("train.csv", b"prompt,answer\n", ValueError, "train.csv: unknown dataset format"),
        ("empty.jsonl", b"\n\n", ValueError, "empty.jsonl has no usable rows"),
        ("all-bad.jsonl", b'{"q": 1}\n\xff\n', ValueError, r"all-bad.jsonl:2: not valid UTF-8"),
    ],
)
def test_unusable_data_files_are_named(name, contents, error, culprit, tmp_path):
    path = tmp_path / name
    if contents is not None:
        path.write_bytes(contents)
    with pytest.raises(error, match=culprit):
        load_prompt_dataset(DataConfig(path=str(path)))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A tiny Qwen3 with a 64-token context and a character tokenizer."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    root = tmp_path_factory.mktemp("tiny")
    tokenizer = build_char_tokenizer()
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=64,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    return root / "model"


def test_run_skips_prompts_its_model_cannot_hold(tiny_model, tmp_path):
    """The recipe passes the model's context (max_position_embeddings) and the response length to
    the loader, for the training and the held-out data."""
    from archon.rl.loop import RLRun

    rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(8)]
    rows.insert(3, {"prompt": "1+" * 40 + "1=", "answer": "41"})  # 82 characters: over 64
    rows.insert(5, {"prompt": "1+" * 28 + "1=", "answer": "29"})  # fits alone, not with 8 new tokens
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = parse_config(
        [
            "--model.path",
            str(tiny_model),
            "--data.path",
            str(path),
            "--eval.path",
            str(path),
            "--rollout.prompts-per-step",
            "2",
            "--rollout.group-size",
            "2",
            "--rollout.max-new-tokens",
            "8",
            "--reward.function",
            "exact",
            "--reward.num-workers",
            "0",
            "--logging.run-dir",
            str(tmp_path / "run"),
        ]
    )
    run = RLRun(config)
    try:
        (task,) = run.tasks
        assert [row.location for row in task.train_set.too_long] == [f"{path}:4", f"{path}:6"]
        assert [row.location for row in task.eval_set.too_long] == [f"{path}:4", f"{path}:6"]
        assert len(task.train_set.examples) == 8
    finally:
        run.close()


def test_a_parsed_config_is_validated_once(tiny_model, tmp_path, monkeypatch):
    """parse_config validates; RLRun, given the parsed config, does not check it again. A config
    changed since, or checked for another world size, is checked again."""
    from archon.rl.config import validation
    from archon.rl.loop import RLRun

    checked = []
    run_problems = validation._run_problems
    monkeypatch.setattr(validation, "_run_problems", lambda config: checked.append(config) or run_problems(config))
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(4)))
    config = parse_config(
        [
            "--model.path",
            str(tiny_model),
            "--data.path",
            str(path),
            "--rollout.prompts-per-step",
            "2",
            "--rollout.group-size",
            "2",
            "--rollout.max-new-tokens",
            "4",
            "--reward.function",
            "exact",
            "--reward.num-workers",
            "0",
            "--logging.run-dir",
            str(tmp_path / "run"),
            "--logging.backends",
        ]
    )
    assert len(checked) == 1
    run = RLRun(config)
    run.close()
    assert len(checked) == 1
    validate(config, world_size=2)
    assert len(checked) == 2
    config.rollout.max_new_tokens = 64  # the model's whole context: checked again, and refused
    with pytest.raises(ValueError, match="rollout.max_new_tokens=64: the model's context is 64 tokens"):
        validate(config)
    assert len(checked) == 3


def _teacher(tiny_model: Path, directory: Path, mismatch: str) -> Path:
    """A teacher like `tiny_model` with 7 more tokens in its vocabulary, or with the same vocabulary
    size and a tokenizer that numbers the tokens in reverse."""
    from tokenizers import Tokenizer, models
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    config = AutoConfig.from_pretrained(tiny_model)
    if mismatch == "vocabulary":
        config.vocab_size += 7
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    if mismatch == "tokenizer":
        ids = AutoTokenizer.from_pretrained(tiny_model).get_vocab()
        reversed_vocab = {token: i for i, token in enumerate(sorted(ids, key=ids.get, reverse=True))}
        backend = Tokenizer(models.WordLevel(reversed_vocab, unk_token="<|unk|>"))
        PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<|unk|>").save_pretrained(directory)
    return directory


@pytest.mark.parametrize(
    "tasks, mismatch, culprit",
    [
        (False, "tokenizer", r"algorithm\.teacher_path='.*teacher': the teacher's tokenizer gives \d+ of the tokens"),
        (
            True,
            "vocabulary",
            r"tasks\[1\]\.algorithm\.teacher_path='.*teacher': the teacher's vocabulary has 110 "
            r"tokens and the student's \(model\.path='.*'\) 103",
        ),
        (True, "tokenizer", r"tasks\[1\]\.algorithm\.teacher_path='.*teacher': the teacher's tokenizer gives"),
    ],
    ids=["single-task-tokenizer", "task-vocabulary", "task-tokenizer"],
)
def test_a_teacher_of_another_vocabulary_is_refused_before_it_is_loaded(tasks, mismatch, culprit, tiny_model, tmp_path):
    from archon.rl.loop import RLRun

    teacher = _teacher(tiny_model, tmp_path / "teacher", mismatch)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(4)))
    task = "{{name: {}, data: {{path: {}}}, reward: {{function: exact, num_workers: 0}}, algorithm: {{{}}}}}"
    distill = f"teacher_path: {teacher}, name: grpo"
    if tasks:
        text = f"tasks: [{task.format('plain', data, 'name: grpo')}, {task.format('distill', data, distill)}]\n"
    else:
        text = f"data: {{path: {data}}}\nreward: {{function: exact, num_workers: 0}}\nalgorithm: {{{distill}}}\n"
    path = tmp_path / "run.yaml"
    path.write_text(
        f"model: {{path: {tiny_model}}}\nrollout: {{group_size: 2, prompts_per_step: 2, max_new_tokens: 4}}\n"
        f"logging: {{run_dir: {tmp_path / 'run'}, backends: [], progress: false}}\n{text}"
    )
    with pytest.raises(ValueError, match=culprit):  # a vocabulary of another size is found when parsed
        config = parse_config(["--config", str(path)])
        RLRun(config)


# ---- reward settings ----------------------------------------------------------------------------

USER_REWARDS = textwrap.dedent(
    """
    import os
    import signal

    def reward(prompt, completion, reference):
        if completion == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if completion == "exit":
            os._exit(3)
        return 1.0
    """
)


@pytest.fixture(scope="module")
def user_rewards(importable_module):
    return importable_module("bad_input_rewards", USER_REWARDS)


@pytest.mark.parametrize(
    "function, num_workers, error, culprit",
    [
        ("bad_input_rewards:missing", 0, ValueError, "module 'bad_input_rewards' has no attribute 'missing'"),
        ("bad_input_rewards:missing", 1, RuntimeError, "'bad_input_rewards:missing' could not be loaded"),
        ("no_such_module_here:score", 1, RuntimeError, "No module named 'no_such_module_here'"),
        ("score_it", 0, ValueError, "reward function 'score_it' must be one of"),
    ],
)
def test_reward_functions_that_cannot_be_loaded(function, num_workers, error, culprit, user_rewards):
    with pytest.raises(error, match=culprit):
        RewardScorer(RewardConfig(function=function, num_workers=num_workers))


@pytest.mark.parametrize(
    "completion, cause",
    [("kill", "it was killed by SIGKILL, which its parent did not send"), ("exit", "it exited with code 3")],
)
def test_a_dead_reward_worker_is_reported_with_its_cause(completion, cause, user_rewards, caplog):
    with caplog.at_level(logging.WARNING, logger="archon.rl.rewards"):
        with RewardScorer(RewardConfig(function=f"{user_rewards}:reward", num_workers=1)) as scorer:
            rewards, metrics = scorer.score(["p", "p"], [completion, "ok"], ["", ""])
    assert rewards.tolist() == [0.0, 1.0] and metrics["reward_errors"] == 1
    assert f"reward worker died: {cause}" in caplog.text
    assert "code None" not in caplog.text


# ---- the alignment tool's model directory -------------------------------------------------------


@pytest.mark.parametrize(
    "config, model_type, error, culprit",
    [
        (None, None, FileNotFoundError, "config.json does not exist"),
        ("{not json", None, ValueError, "config.json' is not valid JSON"),
        ({"vocab_size": 10}, None, ValueError, 'config.json has no "model_type"'),
        ({"model_type": "gpt2"}, None, ValueError, "config.json: unsupported model_type 'gpt2'"),
        ({"model_type": "qwen3"}, "llama", ValueError, "config.json holds model_type 'qwen3', not 'llama'"),
    ],
)
def test_align_model_directory_errors_name_the_file(config, model_type, error, culprit, tmp_path, capsys):
    from archon.tools.align import AlignArgs, main, resolve_model_type

    if config is not None:
        (tmp_path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    with pytest.raises(error, match=culprit) as raised:
        resolve_model_type(AlignArgs(model_type=model_type, hf_path=str(tmp_path)))
    assert str(tmp_path / "config.json") in str(raised.value)
    argv = ["--hf-path", str(tmp_path)] + (["--model-type", model_type] if model_type else [])
    assert main(argv) == 2
    assert culprit in capsys.readouterr().err


# ---- errors under torchrun ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def odd_models(tmp_path_factory):
    """A dense Qwen3 with 3 attention heads and a Qwen3-MoE with 3 experts (neither divisible by 2),
    each with a character tokenizer, and a training file."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    root = tmp_path_factory.mktemp("odd")
    tokenizer = build_char_tokenizer()
    shared = dict(
        vocab_size=len(tokenizer) + len(tokenizer) % 2,
        hidden_size=48,
        num_hidden_layers=1,
        num_attention_heads=3,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=64,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(intermediate_size=64, **shared)).save_pretrained(root / "dense")
    moe = Qwen3MoeConfig(num_experts=3, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=64, **shared)
    Qwen3MoeForCausalLM(moe).save_pretrained(root / "moe")
    for name in ("dense", "moe"):
        tokenizer.save_pretrained(root / name)
    rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(8)]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


@pytest.mark.parametrize(
    "model, flags, message",
    [
        ("dense", ["--parallel.tp", "3"], "error: invalid configuration:\n  parallel: "),  # found when parsed
        ("dense", ["--parallel.tp", "2"], "error: tp=2 does not divide num_attention_heads=3"),
        ("moe", ["--parallel.ep", "2"], "error: ep=2 does not divide num_experts=3"),
    ],
    ids=["parse-time", "tp-heads", "ep-experts"],
)
def test_errors_under_torchrun_print_the_field_not_only_child_failed(model, flags, message, odd_models, tmp_path):
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(repo / "recipes" / "grpo_lora.py"),
        "--model.path",
        str(odd_models / model),
        "--data.path",
        str(odd_models / "train.jsonl"),
        "--rollout.prompts-per-step",
        "2",
        "--rollout.group-size",
        "2",
        "--rollout.max-new-tokens",
        "4",
        "--reward.num-workers",
        "0",
        "--logging.run-dir",
        str(tmp_path / "run"),
        "--logging.backends",
        "--logging.no-progress",
        *flags,
    ]
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr[-5000:]
    if flags == ["--parallel.tp", "3"]:  # every rank refuses the settings alike: rank 0 alone says so
        assert result.stderr.count("error: ") == 1, result.stderr[-5000:]
    else:  # and torchrun's failure summary names the error of the rank that failed first
        root_cause = result.stderr.split("Root Cause")[-1]
        assert "ValueError: " + message.removeprefix("error: ") in root_cause, root_cause
