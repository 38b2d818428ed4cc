"""tinker-cookbook's flat SFT loop, recipes/sl_loop.py, run unmodified (its command line, environment
variables and the server's URL) against the server on a tiny base, lowers its loss.

The loop has no renderer option: it takes its renderer from `model_name`'s entry in the cookbook's
model table, and loads its tokenizer and its dataset by name. So the server serves the tiny base under
a name the table maps to the role_colon renderer (MODEL_NAME), and a temporary HF_HOME holds what a
user who once ran the loop online would have cached, made here from small local data: the base's
config and character tokenizer in the hub cache under MODEL_NAME, and `HuggingFaceH4/no_robots` in
the datasets cache that `datasets.load_dataset` reads offline (HF_HUB_OFFLINE=1). Its conversations
are rl_loop's prompt (its few-shot turn, then "What is x + y?" with one-digit x, y) answered with
the sum in \\boxed{}. docs/tinker.md records the curve.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from archon.rl.tasks import build_char_tokenizer
from archon.serve.config import ServeConfig
from archon.serve.server import start_server
from archon.tools.align import make_tiny_hf_checkpoint

pytest.importorskip("tinker")
pytest.importorskip("tinker_cookbook")

API_KEY = "tml-archon-loops-key"
MODEL_NAME = "Qwen/Qwen3-8B-Base"
"""A base model of the cookbook's model table whose recommended renderer is role_colon: only the name
the tiny base is served and cached under."""
QUESTION_SUFFIX = " Provide a numerical answer without units, written inside \\boxed{}."
FEW_SHOT = [
    {"role": "user", "content": "How many r's are in strawberry?" + QUESTION_SUFFIX},
    {
        "role": "assistant",
        "content": "Let's spell the word out and number all the letters: 1) s 2) t 3) r 4) a 5) w 6) b 7) e "
        "8) r 9) r 10) y. We have r's at positions 3, 8, and 9. \\boxed{3}",
    },
]
"""rl_loop's few-shot turn, which it puts before every question."""
SL_STEPS = 32
SL_BATCH = 16


def additions(seed: int, count: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    problems = []
    for _ in range(count):
        x, y = rng.randint(0, 9), rng.randint(0, 9)
        problems.append((f"What is {x} + {y}?", x + y))
    return problems


def plant_cached_dataset(datasets_cache: Path, repo_id: str, config_name: str, rows: list[dict]) -> None:
    """Write `rows` as the train split of `repo_id` (config `config_name`) where `datasets.load_dataset`
    looks when offline: `<cache>/<org>___<name>/<config>/<version>/<hash>/`, its dataset_info.json and
    the split's arrow file, as an online load leaves them."""
    import datasets
    from datasets.arrow_writer import ArrowWriter

    namespace, name = repo_id.split("/")
    directory = datasets_cache / f"{namespace}___{name}" / config_name / "0.0.0" / "local"
    directory.mkdir(parents=True)
    dataset = datasets.Dataset.from_list(rows)
    with ArrowWriter(path=str(directory / f"{name}-train.arrow")) as writer:
        writer.write_table(dataset.data.table)
        writer.finalize()
    split = datasets.SplitInfo("train", num_examples=len(rows), dataset_name=name)
    info = datasets.DatasetInfo(
        features=dataset.features,
        dataset_name=name,
        config_name=config_name,
        splits=datasets.SplitDict({"train": split}),
    )
    info.write_to_directory(str(directory))


def plant_cached_tokenizer(hub_cache: Path, repo_id: str, checkpoint: Path) -> None:
    """The checkpoint's config and tokenizer files (AutoTokenizer reads both) as a hub download leaves
    them: models--ORG--NAME/snapshots/<revision>/ and refs/main naming the revision."""
    root = hub_cache / f"models--{repo_id.replace('/', '--')}"
    revision = "0" * 40
    snapshot = root / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for file in checkpoint.glob("*.json"):
        shutil.copy(file, snapshot / file.name)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(revision)


@pytest.fixture(scope="module")
def hf_home(tiny_base, tmp_path_factory):
    home = tmp_path_factory.mktemp("hf_home")
    plant_cached_tokenizer(home / "hub", MODEL_NAME, tiny_base)
    sft = [
        {
            "messages": [
                *FEW_SHOT,
                {"role": "user", "content": question + QUESTION_SUFFIX},
                {"role": "assistant", "content": f"\\boxed{{{answer}}}"},
            ]
        }
        for question, answer in additions(seed=1, count=SL_STEPS * SL_BATCH)
    ]
    plant_cached_dataset(home / "datasets", "HuggingFaceH4/no_robots", "default", sft)
    return home


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory):
    tokenizer = build_char_tokenizer()
    path = make_tiny_hf_checkpoint(
        "qwen3",
        tmp_path_factory.mktemp("loops_base") / "hf",
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        use_sliding_window=False,
    )
    tokenizer.save_pretrained(path)
    return path


def serve(base: Path, checkpoint_dir: Path):
    config = ServeConfig(
        base_model=str(base),
        model_name=MODEL_NAME,
        port=0,
        api_key=API_KEY,
        max_lora_rank=16,
        checkpoint_dir=str(checkpoint_dir),
    )
    return start_server(config)


def run_recipe(module: str, hf_home: Path, log_path: Path, args: list[str], cwd: Path) -> list[dict]:
    env = {
        **os.environ,
        "TINKER_API_KEY": API_KEY,
        "HF_HOME": str(hf_home),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    }
    command = [sys.executable, "-m", module, f"log_path={log_path}", f"model_name={MODEL_NAME}", *args]
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=cwd)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "Training completed" in run.stdout + run.stderr
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]


def test_sl_loop_lowers_its_loss(hf_home, tiny_base, tmp_path):
    """The mean NLL of the answers over sl_loop's first 4 steps vs its last 4: measured 3.68 -> 0.43
    (2026-12-06); the test asks for less than half."""
    server = serve(tiny_base, tmp_path / "checkpoints")
    log_path = tmp_path / "sl_loop"
    args = [
        f"base_url={server.url}",
        f"batch_size={SL_BATCH}",
        "learning_rate=1e-2",
        "lora_rank=8",
        "save_every=0",
        "train_on_what=last_assistant_message",
        f"max_steps={SL_STEPS}",
    ]
    try:
        metrics = run_recipe("tinker_cookbook.recipes.sl_loop", hf_home, log_path, args, tmp_path)
    finally:
        server.shutdown()
        server.server_close()
    nll = [m["train_mean_nll"] for m in metrics]
    print("sl_loop train_mean_nll by step:", " ".join(f"{x:.3f}" for x in nll))
    assert len(nll) == SL_STEPS
    first, last = sum(nll[:4]) / 4, sum(nll[-4:]) / 4
    assert last < 0.5 * first, nll
    final = [json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines()][-1]
    assert final["state_path"].startswith("tinker://") and final["sampler_path"].startswith("tinker://")
