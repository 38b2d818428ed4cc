import pytest

from archon.rl.data import DataConfig, load_prompt_dataset
from archon.rl.tasks import (
    ArithmeticTaskConfig,
    arithmetic_splits,
    build_char_tokenizer,
    num_distinct_problems,
    write_jsonl,
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def solve(prompt: str) -> str:
    body = prompt.rstrip("=")
    at = next(i for i, c in enumerate(body) if c in "+-*")  # operands are never negative
    a, op, b = int(body[:at]), body[at], int(body[at + 1 :])
    return str({"+": a + b, "-": a - b, "*": a * b}[op])


def test_splits_are_disjoint_correct_and_deterministic():
    config = ArithmeticTaskConfig(min_digits=1, max_digits=3, num_train=500, num_held_out=100, seed=1)
    train, held_out = arithmetic_splits(config)
    assert len(train) == 500 and len(held_out) == 100
    train_prompts = {row["prompt"] for row in train}
    assert len(train_prompts) == 500
    assert not train_prompts & {row["prompt"] for row in held_out}
    assert all(row["answer"] == solve(row["prompt"]) for row in train + held_out)
    assert {row["prompt"][-1] for row in train} == {"="}
    assert (train, held_out) == arithmetic_splits(config)
    assert arithmetic_splits(ArithmeticTaskConfig(num_train=50, num_held_out=10, seed=2))[1] != held_out[:10]
    # the held-out split does not depend on how many training problems are drawn
    fewer_train = ArithmeticTaskConfig(min_digits=1, max_digits=3, num_train=50, num_held_out=100, seed=1)
    assert arithmetic_splits(fewer_train)[1] == held_out


def test_small_problem_space_is_enumerated_without_overlap():
    config = ArithmeticTaskConfig(operations=("+",), max_digits=1, num_train=90, num_held_out=10)
    assert num_distinct_problems(config) == 100
    train, held_out = arithmetic_splits(config)
    prompts = [row["prompt"] for row in train + held_out]
    assert len(set(prompts)) == 100
    with pytest.raises(ValueError, match="only 100 distinct"):
        arithmetic_splits(ArithmeticTaskConfig(operations=("+",), max_digits=1, num_train=95, num_held_out=10))
    # two-digit operands are 10..99: 90 * 90 problems per operation
    assert num_distinct_problems(ArithmeticTaskConfig(operations=("*", "-"), min_digits=2, max_digits=2)) == 2 * 90 * 90
    with pytest.raises(ValueError, match="operations"):
        ArithmeticTaskConfig(operations=("/",))


def test_prompt_format():
    config = ArithmeticTaskConfig(operations=("*",), num_train=3, num_held_out=0, prompt_format="What is {a} {op} {b}?")
    train, _ = arithmetic_splits(config)
    assert all(row["prompt"].startswith("What is ") and " * " in row["prompt"] for row in train)


def test_char_tokenizer_round_trip(tokenizer):
    text = "12+34=46\n-7*8 = -56\tWhat is x? (a_b) {c} ~!"
    ids = tokenizer(text)["input_ids"]
    assert len(ids) == len(text)  # one token per character, no BOS/EOS added
    assert tokenizer.decode(ids) == text
    assert len(tokenizer) == 6 + 2 + 95
    assert tokenizer.eos_token == "<|end|>" and tokenizer.pad_token == "<|pad|>"
    end = tokenizer.eos_token_id
    assert tokenizer("46<|end|>")["input_ids"] == [*tokenizer("46")["input_ids"], end]
    assert tokenizer.decode(tokenizer("46<|end|>")["input_ids"], skip_special_tokens=True) == "46"
    assert tokenizer.decode(tokenizer("é")["input_ids"]) == "<|unk|>"


def test_chat_template(tokenizer):
    messages = [{"role": "user", "content": "12+34="}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == "<|user|>12+34=<|end|><|assistant|>"
    full = messages + [{"role": "assistant", "content": "46"}]
    assert tokenizer.apply_chat_template(full, tokenize=False) == "<|user|>12+34=<|end|><|assistant|>46<|end|>"
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"]
    assert len(ids) == 1 + 6 + 1 + 1
    with pytest.raises(Exception, match="unsupported role"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_tokenizer_save_and_load(tmp_path, tokenizer):
    from transformers import AutoTokenizer

    tokenizer.save_pretrained(tmp_path / "tok")
    loaded = AutoTokenizer.from_pretrained(tmp_path / "tok")
    text = "<|user|>987*65=<|end|><|assistant|>64155<|end|>"
    assert loaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert loaded.eos_token_id == tokenizer.eos_token_id and loaded.pad_token_id == tokenizer.pad_token_id
    messages = [{"role": "user", "content": "1+1="}]
    prompt = loaded.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == "<|user|>1+1=<|end|><|assistant|>"


def test_generated_task_loads_through_the_data_pipeline(tmp_path, tokenizer):
    train, held_out = arithmetic_splits(ArithmeticTaskConfig(num_train=20, num_held_out=5))
    path = write_jsonl(train, tmp_path / "task" / "train.jsonl")
    dataset = load_prompt_dataset(DataConfig(path=str(path), apply_chat_template=True), tokenizer)
    assert len(dataset) == 20 and not dataset.malformed
    assert dataset.examples[0].prompt == f"<|user|>{train[0]['prompt']}<|end|><|assistant|>"
    assert dataset.examples[0].reference == train[0]["answer"]
