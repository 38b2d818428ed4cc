"""Prompt sources: verl's Parquet schema, Hugging Face datasets by name (from the local cache, offline),
and reasoning-gym tasks with their own scorers as the reward."""

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from archon.rl.config import parse_config, validate
from archon.rl.data import DataConfig, data_path_problem, hub_name, load_prompt_dataset
from archon.rl.reasoning_gym import (
    load_entries,
    parse_source,
    reasoning_gym_overlap,
    reasoning_gym_reward,
    source_problem,
)
from archon.rl.rewards import RewardConfig, RewardScorer
from archon.rl.tasks import build_char_tokenizer

reasoning_gym = pytest.importorskip("reasoning_gym")

SHORT_SYSTEM = "Answer inside <answer></answer>."
ARITHMETIC = "reasoning_gym:chain_sum?size=16&seed=0&min_terms=2&max_terms=2&max_digits=1"


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A tiny random Qwen3 with the character tokenizer and room for a chat-rendered prompt."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    root = tmp_path_factory.mktemp("datasets_model")
    tokenizer = build_char_tokenizer()
    config = Qwen3Config(
        vocab_size=len(tokenizer) + len(tokenizer) % 2,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(root)
    tokenizer.save_pretrained(root)
    return root


def _short_run(model: Path, run_dir: Path, *args: str):
    """Two RL steps (4 prompts x 2 samples, 4 new tokens) in this process; the run and its step records."""
    from archon.rl.loop import RLRun

    config = parse_config(
        [
            "--model.path",
            str(model),
            "--steps",
            "2",
            "--eval.every",
            "1",
            "--rollout.prompts-per-step",
            "4",
            "--rollout.group-size",
            "2",
            "--rollout.max-new-tokens",
            "4",
            "--reward.num-workers",
            "0",
            "--logging.run-dir",
            str(run_dir),
            "--logging.no-progress",
            "--logging.backends",
            "--lora.rank",
            "2",
            "--lora.alpha",
            "4",
            *args,
        ]
    )
    validate(config)
    run = RLRun(config)
    run.run()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(np.isfinite(r["loss"]) for r in records[1:])
    return run, records


# ---- verl's Parquet schema ----------------------------------------------------------------------


def _verl_row(index: int, question: str, answer: str, split: str = "train") -> dict:
    """A row as verl's examples/data_preprocess/gsm8k.py writes it."""
    return {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": f"{question} Let's think step by step."}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": split, "index": index, "answer": f"#### {answer}", "question": question},
    }


def _verl_rows(count: int) -> list[dict]:
    return [_verl_row(i, f"{i % 7}+{i % 5}=?", str(i % 7 + i % 5)) for i in range(count)]


@pytest.mark.parametrize("writer", ["pyarrow", "datasets"])
def test_verl_parquet_is_detected_and_rendered(writer, tmp_path, tokenizer, caplog):
    path = tmp_path / "train.parquet"
    if writer == "pyarrow":
        pq.write_table(pa.Table.from_pylist(_verl_rows(6)), path)
    else:  # as verl's preprocessing scripts write it
        import datasets

        datasets.Dataset.from_list(_verl_rows(6)).to_parquet(str(path))
    assert pa.types.is_struct(pq.read_schema(path).field("reward_model").type)  # nested struct columns
    with caplog.at_level(logging.INFO, logger="archon.rl.data"):
        dataset = load_prompt_dataset(DataConfig(path=str(path)), tokenizer)
    assert "schema verl (detected" in caplog.text
    assert dataset.schema == "verl" and dataset.chat_template_applied
    example = dataset[3]
    assert example.prompt == "<|user|>3+3=? Let's think step by step.<|end|><|assistant|>"
    assert example.reference == "6"
    assert example.data_source == "openai/gsm8k"
    assert example.row["extra_info"] == {"split": "train", "index": 3, "answer": "#### 6", "question": "3+3=?"}
    # a system prompt goes before the chat, as for plain rows
    with_system = load_prompt_dataset(DataConfig(path=str(path), system_prompt="Be brief."), tokenizer)
    assert with_system[0].prompt.startswith("<|system|>Be brief.<|end|><|user|>0+0=?")
    # the schema can be forced; plain reads the same file with its own fields and finds no "answer"
    with pytest.raises(ValueError, match="missing field 'answer'"):
        load_prompt_dataset(DataConfig(path=str(path), schema="plain", apply_chat_template=True), tokenizer)


def test_verl_rows_with_numpy_arrays_from_pandas_and_datasets(tmp_path, tokenizer):
    pd = pytest.importorskip("pandas")
    rows = _verl_rows(4)
    for index, row in enumerate(rows):
        row["extra_info"]["terms"] = [index % 7, index % 5]
    first = tmp_path / "first.parquet"
    pd.DataFrame(rows).to_parquet(first)
    frame = pd.read_parquet(first)  # how verl and users read it back: list columns become numpy arrays
    assert isinstance(frame["prompt"][0], np.ndarray)
    assert isinstance(frame["extra_info"][1]["terms"], np.ndarray)
    second = tmp_path / "second.parquet"
    frame.to_parquet(second)
    import datasets

    numpy_dir = tmp_path / "numpy_format"  # a datasets directory whose rows come back as numpy arrays
    datasets.Dataset.from_list(rows).with_format("numpy").save_to_disk(str(numpy_dir))
    assert isinstance(datasets.load_from_disk(str(numpy_dir))[0]["prompt"], np.ndarray)
    for path in (first, second, numpy_dir):
        dataset = load_prompt_dataset(DataConfig(path=str(path)), tokenizer)
        assert dataset.schema == "verl" and len(dataset) == 4
        assert dataset[1].reference == "2"
        assert dataset[3].row["extra_info"]["terms"] == [3, 3]
        assert dataset[0].prompt == "<|user|>0+0=? Let's think step by step.<|end|><|assistant|>"
        assert dataset[2].row["extra_info"]["index"] == 2
        assert isinstance(dataset[2].row["extra_info"]["index"], int)


def test_verl_row_without_ground_truth_is_counted_with_its_row_number(tmp_path, tokenizer):
    rows = _verl_rows(5)
    del rows[2]["reward_model"]["ground_truth"]
    rows[4]["reward_model"] = None
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    dataset = load_prompt_dataset(DataConfig(path=str(path)), tokenizer)
    assert len(dataset) == 3
    assert [str(row) for row in dataset.malformed] == [
        f"{path} row 2: missing field 'reward_model.ground_truth'",
        f"{path} row 4: missing field 'reward_model.ground_truth'",
    ]


def test_verl_rows_need_a_tokenizer_with_a_chat_template(tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(_verl_rows(2)), path)
    with pytest.raises(ValueError, match="verl rows are chat messages, which need a tokenizer"):
        load_prompt_dataset(DataConfig(path=str(path)))
    no_template = build_char_tokenizer()
    no_template.chat_template = None
    with pytest.raises(ValueError, match="verl rows are chat messages, but the tokenizer has no chat template"):
        load_prompt_dataset(DataConfig(path=str(path)), no_template)
    with pytest.raises(ValueError, match="DataConfig.schema must be one of auto, plain, verl"):
        DataConfig(path=str(path), schema="parquet")


def test_verl_parquet_drives_a_short_run(tmp_path, tiny_model, capsys):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(_verl_rows(8)), path)
    pq.write_table(pa.Table.from_pylist(_verl_rows(4)), tmp_path / "test.parquet")
    run, records = _short_run(
        tiny_model,
        tmp_path / "run",
        "--data.path",
        str(path),
        "--eval.path",
        str(tmp_path / "test.parquet"),
        "--reward.function",
        "exact",
    )
    assert run.tasks[0].train_set.schema == "verl" and run.tasks[0].eval_set.schema == "verl"
    out = capsys.readouterr().out
    assert "train data: 8 prompts, verl rows (detected: the first row has a reward_model object)" in out
    assert "held-out data: 4 prompts, verl rows" in out
    assert "eval_accuracy" in records[-1]


# ---- Hugging Face datasets by name --------------------------------------------------------------


def _put_in_datasets_cache(cache: Path, name: str, config_name: str, splits: dict[str, list[dict]], work: Path):
    """Put `name` (owner/repo) into the datasets cache as load_dataset leaves a Hub dataset of
    Parquet files after downloading it: CACHE/owner___repo/CONFIG/0.0.0/HASH with repo-SPLIT.arrow
    files and dataset_info.json (prepared by the same Parquet builder)."""
    from datasets.packaged_modules.parquet.parquet import Parquet

    owner, repo = name.split("/")
    work.mkdir(parents=True, exist_ok=True)
    files = {}
    for split, rows in splits.items():
        files[split] = str(work / f"{split}.parquet")
        pq.write_table(pa.Table.from_pylist(rows), files[split])
    builder = Parquet(cache_dir=str(work / "build"), dataset_name=repo, config_name=config_name, data_files=files)
    builder.download_and_prepare()
    shutil.copytree(builder.cache_dir, cache / f"{owner}___{repo}" / config_name / "0.0.0" / "0123abcd")


@pytest.fixture
def offline_datasets_cache(tmp_path, monkeypatch):
    """An empty datasets cache, and the Hub unreachable by configuration (offline mode)."""
    import datasets
    import huggingface_hub.constants

    cache = tmp_path / "hf_datasets"
    cache.mkdir()
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def _plain_rows(count: int, offset: int = 0) -> list[dict]:
    return [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(offset, offset + count)]


def test_names_and_paths_are_told_apart(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert hub_name("openai/gsm8k") == ("openai/gsm8k", {}) and hub_name("org-x/data.v2") == ("org-x/data.v2", {})
    assert hub_name("openai/gsm8k?subset=main&split=test") == ("openai/gsm8k", {"subset": "main", "split": "test"})
    for path in ("data/train.jsonl", "a/b/c", "train.jsonl", "/abs/dir", "reasoning_gym:x"):
        assert hub_name(path) is None, path
    (tmp_path / "openai").mkdir()
    (tmp_path / "openai" / "gsm8k").mkdir()  # a local path that exists wins over the name
    assert hub_name("openai/gsm8k") is None
    assert data_path_problem("someone/data?splt=test") == (
        "unknown option 'splt' after the dataset name (options: subset, split)"
    )
    assert (
        data_path_problem("missing.jsonl") == "no such file or directory (nor a Hugging Face dataset name, owner/name)"
    )
    assert data_path_problem("someone/data") is None  # its cache is looked at when loading


def test_cached_hub_dataset_loads_offline_by_name(tmp_path, tokenizer, offline_datasets_cache):
    _put_in_datasets_cache(
        offline_datasets_cache,
        "someone/sums",
        "main",
        {"train": _plain_rows(6), "test": _plain_rows(3, offset=100)},
        tmp_path,
    )
    _put_in_datasets_cache(offline_datasets_cache, "someone/sums", "other", {"train": _plain_rows(2)}, tmp_path / "o")
    train = load_prompt_dataset(DataConfig(path="someone/sums", subset="main"), tokenizer)
    assert [e.prompt for e in train.examples] == [f"{i}+1=" for i in range(6)] and train.schema == "plain"
    assert train[0].source == "someone/sums row 0"
    test = load_prompt_dataset(DataConfig(path="someone/sums", subset="main", split="test"), tokenizer)
    assert [e.reference for e in test.examples] == ["101", "102", "103"]
    by_name = load_prompt_dataset(DataConfig(path="someone/sums?split=test", subset="main"), tokenizer)
    assert [e.reference for e in by_name.examples] == ["101", "102", "103"]
    assert len(load_prompt_dataset(DataConfig(path="someone/sums", subset="other"), tokenizer)) == 2
    with pytest.raises(ValueError, match=r"(?s)'someone/sums' \(subset 'missing'\).*Available configs in the cache"):
        load_prompt_dataset(DataConfig(path="someone/sums", subset="missing"), tokenizer)
    with pytest.raises(ValueError, match="(?s)split 'validation'.*Unknown split"):
        load_prompt_dataset(DataConfig(path="someone/sums", subset="main", split="validation"), tokenizer)


def test_uncached_hub_dataset_offline_names_the_dataset_the_cache_and_the_download(tokenizer, offline_datasets_cache):
    with pytest.raises(ValueError) as error:
        load_prompt_dataset(DataConfig(path="someone/never-downloaded", subset="main"), tokenizer)
    message = str(error.value)
    assert "Hugging Face dataset 'someone/never-downloaded' (subset 'main'), split 'train'" in message
    assert str(offline_datasets_cache / "someone___never-downloaded") in message
    assert "offline mode is on" in message
    assert "datasets.load_dataset('someone/never-downloaded', 'main')" in message


def test_cached_hub_dataset_drives_a_short_run(tmp_path, tiny_model, offline_datasets_cache):
    _put_in_datasets_cache(
        offline_datasets_cache,
        "someone/sums",
        "default",
        {"train": _plain_rows(8), "test": _plain_rows(4, offset=50)},
        tmp_path,
    )
    run, _ = _short_run(
        tiny_model,
        tmp_path / "run",
        "--data.path",
        "someone/sums",
        "--eval.path",
        "someone/sums?split=test",
        "--reward.function",
        "exact",
    )
    assert len(run.tasks[0].train_set) == 8 and len(run.tasks[0].eval_set) == 4


# ---- reasoning-gym ------------------------------------------------------------------------------


def test_source_settings_entries_and_prompt(tokenizer):
    source = parse_source("reasoning_gym:chain_sum?size=3&seed=5&max_terms=2&allow_negation=false")
    assert (source.task, source.size, source.seed) == ("chain_sum", 3, 5)
    assert source.settings == {"max_terms": 2, "allow_negation": False}
    dataset = load_prompt_dataset(DataConfig(path=ARITHMETIC), tokenizer)
    assert dataset.schema == "reasoning_gym" and len(dataset) == 16
    own = reasoning_gym.create_dataset("chain_sum", size=16, seed=0, min_terms=2, max_terms=2, max_digits=1)
    from reasoning_gym.utils import SYSTEM_PROMPTS

    for index in (0, 7):
        example, entry = dataset[index], own[index]
        assert example.prompt == (
            f"<|system|>{SYSTEM_PROMPTS['default']}<|end|><|user|>{entry['question']}<|end|><|assistant|>"
        )
        assert example.data_source == "chain_sum"
        assert {k: example.reference[k] for k in entry} == entry
    custom = load_prompt_dataset(DataConfig(path=ARITHMETIC, system_prompt=SHORT_SYSTEM), tokenizer)
    assert custom[0].prompt.startswith(f"<|system|>{SHORT_SYSTEM}<|end|><|user|>State the final answer")


@pytest.mark.parametrize(
    "path, message",
    [
        ("reasoning_gym:chain_sun", r"no task 'chain_sun' \(close matches: chain_sum"),
        ("reasoning_gym:", "names no task"),
        ("reasoning_gym:chain_sum?max_term=3", "has no setting 'max_term' .*max_terms"),
        ("reasoning_gym:chain_sum?size=-1", "size=-1 must be an integer >= 1"),
        ("reasoning_gym:chain_sum?seed=x", "seed='x' must be an integer"),
    ],
)
def test_bad_reasoning_gym_sources(path, message, tokenizer):
    assert source_problem(path) is not None
    with pytest.raises(ValueError, match=message):
        load_prompt_dataset(DataConfig(path=path), tokenizer)


def test_config_validation_names_bad_sources_and_overlapping_held_out_sets(tiny_model):
    args = ["--model.path", str(tiny_model), "--reward.function", "reasoning_gym", "--rollout.max-new-tokens", "4"]
    with pytest.raises(
        ValueError,
        match=(
            r"data.path='reasoning_gym:leg_countin': reasoning-gym has no task 'leg_countin' "
            r"\(close matches: leg_counting"
        ),
    ):
        validate(parse_config([*args, "--data.path", "reasoning_gym:leg_countin"]))
    train = "reasoning_gym:chain_sum?size=100&seed=0"
    with pytest.raises(
        ValueError,
        match="eval.path=.*seeds 60..109 .* from 0..99: 40 held-out entries would be training entries.*use seed=100",
    ):
        validate(parse_config([*args, "--data.path", train, "--eval.path", "reasoning_gym:chain_sum?size=50&seed=60"]))
    validate(parse_config([*args, "--data.path", train, "--eval.path", "reasoning_gym:chain_sum?size=50&seed=100"]))
    assert reasoning_gym_overlap(train, "reasoning_gym:chain_sum?size=50&seed=0&max_terms=3") is None  # other settings


# (task, settings) and completions built from each entry: right, wrong, malformed (no <answer> tags,
# an empty answer, unclosed tags, the answer tagged twice with the right one last)
SCORED_TASKS = [
    ("chain_sum", {"max_digits": 2}),
    ("basic_arithmetic", {}),
    ("spell_backward", {}),
    ("word_sorting", {}),
    ("decimal_arithmetic", {"max_num_decimal_places": 3}),  # its scorer reads its settings
    ("leg_counting", {}),
]


def _completions(answer: str) -> list[str]:
    return [
        f"<think>easy</think>\n<answer>{answer}</answer>",
        f"<answer>{answer}</answer> done",
        f"<answer>{answer}x</answer>",
        "<answer>0</answer>",
        answer,
        "<answer></answer>",
        f"<answer>{answer}",
        f"<answer>wrong</answer> then <answer> {answer} </answer>",
    ]


def test_reasoning_gym_reward_equals_the_tasks_own_scorer_through_the_reward_worker():
    prompts, completions, references, expected = [], [], [], []
    for task, settings in SCORED_TASKS:
        query = "&".join(f"{k}={v}" for k, v in {"size": 3, "seed": 11, **settings}.items())
        source = parse_source(f"reasoning_gym:{task}?{query}")
        own = reasoning_gym.create_dataset(task, size=3, seed=11, **settings)
        for index, (messages, reference) in enumerate(load_entries(source, None)):
            entry = own[index]
            for completion in _completions(entry["answer"]):
                prompts.append(messages[1]["content"])
                completions.append(completion)
                references.append(reference)
                answer = reasoning_gym.utils.extract_answer(completion)
                expected.append(float(own.score_answer(answer, entry)))
    assert len(set(expected)) >= 3 and 1.0 in expected and 0.0 in expected
    with RewardScorer(RewardConfig(function="reasoning_gym", num_workers=1, timeout_s=60.0)) as scorer:
        rewards, metrics = scorer.score(prompts, completions, references)
    assert metrics["reward_errors"] == 0 and metrics["reward_timeouts"] == 0
    assert rewards.tolist() == pytest.approx(expected)
    # an entry kept without the source's settings is scored with the task's defaults
    plain_entry = reasoning_gym.create_dataset("spell_backward", size=1, seed=3)[0]
    assert reasoning_gym_reward("", f"<answer>{plain_entry['answer']}</answer>", plain_entry) == 1.0
    with pytest.raises(ValueError, match="needs a reasoning-gym entry"):
        reasoning_gym_reward("", "<answer>1</answer>", "1")


def test_reasoning_gym_drives_a_short_run(tmp_path, tiny_model):
    held_out = "reasoning_gym:chain_sum?size=4&seed=16&min_terms=2&max_terms=2&max_digits=1"
    run, records = _short_run(
        tiny_model,
        tmp_path / "run",
        "--data.path",
        ARITHMETIC,
        "--eval.path",
        held_out,
        "--data.system-prompt",
        SHORT_SYSTEM,
        "--reward.function",
        "reasoning_gym",
    )
    task = run.tasks[0]
    assert len(task.train_set) == 16 and len(task.eval_set) == 4
    train_questions = {e.reference["question"] for e in task.train_set.examples}
    assert all(e.data_source == "chain_sum" for e in task.eval_set.examples)
    assert records[-1]["reward_errors"] == 0 and "eval_accuracy" in records[-1]
    assert len(train_questions) > 1
