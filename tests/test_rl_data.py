import json

import pytest

from archon.rl.data import (
    DataConfig,
    PromptBatchIterator,
    PromptExample,
    load_prompt_dataset,
    tokenize_prompt,
)
from archon.rl.tasks import build_char_tokenizer

JSONL_LINES = [
    '{"prompt": "1+1=", "answer": "2"}',  # line 1
    '{"prompt": "2+2=", "answer": 4}',  # line 2: numeric answers are fine
    "",  # line 3: blank, skipped silently
    '{"prompt": "3+3=", "answer": "6"',  # line 4: invalid JSON
    '{"question": "4+4=", "answer": "8"}',  # line 5: no prompt field
    '{"prompt": 12, "answer": "8"}',  # line 6: prompt of the wrong type
    '{"prompt": "5+5="}',  # line 7: no answer
    '["prompt", "answer"]',  # line 8: not an object
    '{"prompt": "   ", "answer": "1"}',  # line 9: empty prompt
    '{"prompt": "6+6=", "answer": "12"}',  # line 10
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def write_jsonl(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_malformed_rows_are_counted_with_line_numbers(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", JSONL_LINES)
    dataset = load_prompt_dataset(DataConfig(path=str(path)))
    assert [e.prompt for e in dataset.examples] == ["1+1=", "2+2=", "6+6="]
    assert [e.reference for e in dataset.examples] == ["2", 4, "12"]
    assert dataset.examples[2].source == f"{path}:10"
    assert [(row.row, row.reason.split(" ")[0]) for row in dataset.malformed] == [
        (4, "invalid"),
        (5, "missing"),
        (6, "field"),
        (7, "missing"),
        (8, "row"),
        (9, "field"),
    ]
    assert "'prompt' is int" in dataset.malformed[2].reason
    assert "'answer'" in dataset.malformed[3].reason
    assert str(dataset.malformed[0]).startswith(f"{path}:4: invalid JSON")
    assert dataset.report().startswith("3 prompts, 6 malformed rows, 0 too long")


def test_custom_fields_nested_and_no_answer(tmp_path):
    rows = [{"q": "a", "meta": {"gold": "1"}}, {"q": "b", "meta": {}}, {"q": "c", "meta": {"gold": "3"}}]
    path = write_jsonl(tmp_path / "nested.jsonl", [json.dumps(r) for r in rows])
    dataset = load_prompt_dataset(DataConfig(path=str(path), prompt_field="q", answer_field="meta.gold"))
    assert [(e.prompt, e.reference) for e in dataset.examples] == [("a", "1"), ("c", "3")]
    assert [row.row for row in dataset.malformed] == [2]
    no_answers = load_prompt_dataset(DataConfig(path=str(path), prompt_field="q", answer_field=None))
    assert [e.reference for e in no_answers.examples] == [None, None, None]


def test_parquet_rows_are_zero_based(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"prompt": ["a", "b", None, "d"], "answer": ["1", None, "3", "4"]})
    path = tmp_path / "train.parquet"
    pq.write_table(table, path)
    dataset = load_prompt_dataset(DataConfig(path=str(path)))
    assert [(e.prompt, e.reference) for e in dataset.examples] == [("a", "1"), ("d", "4")]
    assert [(row.row, row.reason) for row in dataset.malformed] == [
        (1, "missing field 'answer'"),
        (2, "missing field 'prompt'"),
    ]
    assert str(dataset.malformed[0]) == f"{path} row 1: missing field 'answer'"
    assert dataset.examples[1].source == f"{path} row 3"


def test_datasets_directory_and_dataset_dict(tmp_path):
    import datasets

    data = {"problem": ["x", "y", "z"], "solution": ["1", "2", "3"]}
    datasets.Dataset.from_dict(data).save_to_disk(str(tmp_path / "single"))
    config = DataConfig(path=str(tmp_path / "single"), prompt_field="problem", answer_field="solution")
    assert [e.prompt for e in load_prompt_dataset(config).examples] == ["x", "y", "z"]

    only_bad_rows = datasets.Dataset.from_dict({"problem": ["t"], "solution": [None]})
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(data), "test": only_bad_rows}).save_to_disk(
        str(tmp_path / "dict")
    )
    fields = {"prompt_field": "problem", "answer_field": "solution"}
    train_split = load_prompt_dataset(DataConfig(path=str(tmp_path / "dict"), split="train", **fields))
    assert len(train_split) == 3
    with pytest.raises(ValueError, match="no usable rows"):
        load_prompt_dataset(DataConfig(path=str(tmp_path / "dict"), split="test", **fields))
    with pytest.raises(ValueError, match="not 'validation'"):
        load_prompt_dataset(DataConfig(path=str(tmp_path / "dict"), split="validation", prompt_field="problem"))


def test_whole_dataset_problems_raise(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_prompt_dataset(DataConfig(path=str(tmp_path / "missing.jsonl")))
    (tmp_path / "data.csv").write_text("prompt,answer\n")
    with pytest.raises(ValueError, match="unknown dataset format"):
        load_prompt_dataset(DataConfig(path=str(tmp_path / "data.csv")))
    with pytest.raises(ValueError, match="need a tokenizer"):
        load_prompt_dataset(DataConfig(path=str(tmp_path / "data.csv"), apply_chat_template=True))


def test_chat_template_messages_and_length_limit(tmp_path, tokenizer):
    rows = [
        {"prompt": "12+34=", "answer": "46"},
        {"prompt": [{"role": "user", "content": "1+2="}], "answer": "3"},
        {"prompt": [{"role": "user"}], "answer": "3"},  # message without content
        {"prompt": [{"role": "tool", "content": "x"}], "answer": "3"},  # the template rejects the role
        {"prompt": "1234567890+1234567890=", "answer": "2469135780"},  # too long
    ]
    path = write_jsonl(tmp_path / "chat.jsonl", [json.dumps(r) for r in rows])
    config = DataConfig(path=str(path), apply_chat_template=True, system_prompt="Add.", max_prompt_tokens=25)
    dataset = load_prompt_dataset(config, tokenizer)
    assert [e.prompt for e in dataset.examples] == [
        "<|system|>Add.<|end|><|user|>12+34=<|end|><|assistant|>",
        "<|system|>Add.<|end|><|user|>1+2=<|end|><|assistant|>",
    ]
    assert [row.row for row in dataset.malformed] == [3, 4]
    assert "chat template failed" in dataset.malformed[1].reason
    assert [row.row for row in dataset.too_long] == [5]
    ids = tokenize_prompt(tokenizer, dataset.examples[0].prompt, dataset.chat_template_applied)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|system|>")
    assert ids[-1] == tokenizer.convert_tokens_to_ids("<|assistant|>")

    # a message list without the chat template is a malformed row, not a crash
    plain = load_prompt_dataset(DataConfig(path=str(path)))
    assert "set apply_chat_template" in plain.malformed[0].reason


def examples(n):
    return [PromptExample(prompt=str(i), reference=None, source=f"row {i}") for i in range(n)]


def prompts(batch):
    return [e.prompt for e in batch]


def test_iterator_is_deterministic_per_seed_and_covers_each_epoch():
    data = examples(10)
    first = [prompts(next(PromptBatchIterator(data, 5, seed=3))) for _ in range(2)]
    assert first[0] == first[1]
    it = PromptBatchIterator(data, 5, seed=3)
    epoch0 = prompts(next(it)) + prompts(next(it))
    epoch1 = prompts(next(it)) + prompts(next(it))
    assert sorted(epoch0, key=int) == [str(i) for i in range(10)] == sorted(epoch1, key=int)
    assert epoch0 != epoch1 and it.epoch == 1
    other_seed = PromptBatchIterator(data, 5, seed=4)
    assert prompts(next(other_seed)) + prompts(next(other_seed)) != epoch0
    unshuffled = PromptBatchIterator(data, 4, shuffle=False)
    assert [prompts(next(unshuffled)) for _ in range(3)] == [
        ["0", "1", "2", "3"],
        ["4", "5", "6", "7"],
        ["0", "1", "2", "3"],
    ]


def test_iterator_resumes_at_the_saved_position():
    data = examples(7)
    it = PromptBatchIterator(data, 3, seed=0)
    for _ in range(3):  # crosses an epoch boundary (2 full batches per epoch, the 7th example is dropped)
        next(it)
    state = it.state_dict()
    assert (state["epoch"], state["position"]) == (1, 3)
    expected = [prompts(next(it)) for _ in range(4)]
    resumed = PromptBatchIterator(data, 3, seed=0)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert [prompts(next(resumed)) for _ in range(4)] == expected
    with pytest.raises(ValueError, match="num_examples: saved 7, now 8"):
        PromptBatchIterator(examples(8), 3, seed=0).load_state_dict(state)


def test_iterator_partial_last_batch_and_too_small_dataset():
    it = PromptBatchIterator(examples(5), 2, shuffle=False, drop_last=False)
    assert [len(next(it)) for _ in range(4)] == [2, 2, 1, 2]
    with pytest.raises(ValueError, match="fewer than one batch"):
        PromptBatchIterator(examples(2), 3)
