"""Resume checkpoints (DCP): exact continuation, atomic writes, keep-last-K; sliced HF loading.

The runs whose losses a resumed run must continue are float64 trainers inside
`fp32_islands_in_fp64`: a checkpoint that rounded a parameter or an optimizer moment to fp32 would
change the losses that follow, and the comparison is exact (the same computation from the same state)."""

from __future__ import annotations

import io
from pathlib import Path

import parallel_cases as cases
import pytest
import torch

from archon.checkpoint.hf import HFCheckpoint, read_local
from archon.checkpoint.resume import TRAINER_STATE, CheckpointError, CheckpointManager
from archon.precision import fp32_islands_in_fp64
from archon.trainer import Trainer


def _fp64_config(path, **kwargs):
    return cases.engine_config(path, dtype="float64", **kwargs)


def _step_batch(trainer, step):
    batch = cases.make_batch(256, seed=100 + step)
    batch.old_logprobs = trainer.logprobs(batch).logprobs
    return batch


def _train(trainer, steps, manager=None):
    losses = []
    for step in steps:
        losses.append(trainer.train_step(_step_batch(trainer, step), cases.loss_fn, with_entropy=True)["loss"])
        if manager is not None:
            trainer.save_checkpoint(manager, step + 1, data_state={"next_step": step + 1})
    return losses


def test_resume_continues_with_the_uninterrupted_losses(qwen3_path, tmp_path):
    """Single process: 3 steps, save, a new engine (other seed) resumes, 3 more == 6 in one go.
    LoRA dropout is on, so the RNG state has to come back too."""
    with fp32_islands_in_fp64():
        uninterrupted = _train(Trainer(_fp64_config(qwen3_path, lora_dropout=0.1)), range(6))
        manager = CheckpointManager(tmp_path / "ckpts", keep_last=2)
        first = _train(Trainer(_fp64_config(qwen3_path, lora_dropout=0.1)), range(3), manager)
        resumed = Trainer(_fp64_config(qwen3_path, lora_dropout=0.1, seed=7))
        assert all(p.dtype == torch.float64 for p in resumed.model.parameters() if p.requires_grad)
        state = resumed.load_checkpoint(manager)
        assert state["data"] == {"next_step": 3} and state["step"] == 3 and resumed.optimizer_steps == 3
        second = _train(resumed, range(state["data"]["next_step"], 6))
    assert first + second == uninterrupted, f"losses {first} + {second} against uninterrupted {uninterrupted}"
    assert [p.name for p in manager.checkpoints()] == ["step-00000002", "step-00000003"]


def test_resume_without_rng_restore_would_differ(qwen3_path, tmp_path):
    """The exactness above is not vacuous: with dropout, a different RNG stream changes the losses."""
    manager = CheckpointManager(tmp_path / "ckpts")
    with fp32_islands_in_fp64():
        trainer = Trainer(_fp64_config(qwen3_path, lora_dropout=0.1))
        _train(trainer, range(2), manager)
        expected = _train(trainer, range(2, 3))
        resumed = Trainer(_fp64_config(qwen3_path, lora_dropout=0.1))
        resumed.load_checkpoint(manager)
        torch.manual_seed(12345)
        assert _train(resumed, range(2, 3)) != expected


def test_failed_save_leaves_no_checkpoint(qwen3_path, tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    manager = CheckpointManager(tmp_path / "ckpts")
    trainer = Trainer(cases.engine_config(qwen3_path))

    def broken_save(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(dcp, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        trainer.save_checkpoint(manager, 0)
    assert manager.latest() is None and trainer.load_checkpoint(manager) is None
    monkeypatch.undo()
    path = trainer.save_checkpoint(manager, 0, data_state={"epoch": 1})
    assert path.name == "step-00000000" and (path / TRAINER_STATE).exists()
    assert manager.latest() == path


def test_incomplete_checkpoint_is_rejected(tmp_path):
    (tmp_path / "step-00000001").mkdir()
    with pytest.raises(CheckpointError, match="trainer_state.json"):
        CheckpointManager(tmp_path).load(tmp_path / "step-00000001", {})
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointManager(tmp_path, keep_last=0)


@pytest.mark.slow
def test_two_process_resume_after_kill_continues_exactly(qwen3_path, tmp_path):
    """FSDP x2: 8 uninterrupted steps; a fresh run of 4 steps checkpoints every step and is killed;
    a new torchrun resumes from the latest checkpoint and runs 4 more. Bit-for-bit the same losses."""
    ckpt = f"qwen3={qwen3_path}"
    cases.launch(2, "resume", "--phase", "first", "--out", str(tmp_path), "--ckpt", ckpt)
    cases.launch(2, "resume", "--phase", "second", "--out", str(tmp_path), "--ckpt", ckpt)
    first = torch.load(tmp_path / "first.pt")
    second = torch.load(tmp_path / "second.pt")
    assert second["resumed_step"] == 4
    resumed = first["first_half"] + second["second_half"]
    assert resumed == first["uninterrupted"], f"losses {resumed} against uninterrupted {first['uninterrupted']}"
    assert second["checkpoints"] == ["step-00000003", "step-00000004"]  # keep_last=2


def test_loading_reads_only_the_region_a_shard_needs(qwen3_path):
    """The stacked-expert and one-to-one read paths, checked against the full tensor (no processes:
    a fake DTensor region)."""
    import archon.checkpoint.hf as hf
    from archon.build import load_hf_config
    from archon.models.qwen3.state_dict_converter import Qwen3StateDictConverter
    from archon.spec import get_spec
    from archon.tools.align import make_tiny_hf_checkpoint

    moe = make_tiny_hf_checkpoint("qwen3_moe", qwen3_path.parent / "moe", seed=0)
    args = get_spec("qwen3_moe").args_cls.from_hf_config(load_hf_config(moe))
    converter = Qwen3StateDictConverter(args)
    checkpoint = HFCheckpoint(moe)
    key = "layers.1.mlp.experts.gate_up_proj"
    sources = converter.hf_sources(key, checkpoint.keys())
    full = converter.combine(key, [checkpoint.get(s) for s in sources])
    target = torch.empty(full.shape)
    region = (slice(2, 5), slice(20, 40), slice(0, 64))  # crosses the gate/up boundary at row 32
    original = hf.local_region
    hf.local_region = lambda t: region[: t.ndim]
    try:
        part = read_local(converter, checkpoint, key, sources, target)
        dense_key = "layers.0.self_attn.q_proj.weight"
        dense = read_local(
            converter,
            checkpoint,
            dense_key,
            converter.hf_sources(dense_key, checkpoint.keys()),
            torch.empty(checkpoint.shape("model.layers.0.self_attn.q_proj.weight")),
        )
    finally:
        hf.local_region = original
    assert torch.equal(part, full[region])
    assert torch.equal(dense, checkpoint.get("model.layers.0.self_attn.q_proj.weight")[region[:2]])


def test_other_lora_settings_are_refused_before_any_tensor_is_read(qwen3_path, tmp_path):
    """Engine.load_checkpoint compares the stored LoRA settings; a checkpoint that did not record them
    is still checked key for key and shape for shape, so trained weights are never dropped."""
    import json

    from archon.lora import LoRAConfig

    manager = CheckpointManager(tmp_path / "ckpts")
    path = Trainer(cases.engine_config(qwen3_path)).save_checkpoint(manager, 1)
    assert json.loads((path / TRAINER_STATE).read_text())["lora"]["rank"] == 4

    other_alpha = Trainer(cases.engine_config(qwen3_path))
    other_alpha.lora = LoRAConfig(rank=4, alpha=16.0)
    with pytest.raises(CheckpointError, match=r"lora.alpha: checkpoint 8.0, this run 16.0"):
        other_alpha.load_checkpoint(manager)
    dropout_only = Trainer(cases.engine_config(qwen3_path, lora_dropout=0.1))
    assert dropout_only.load_checkpoint(manager)["step"] == 1

    state = json.loads((path / TRAINER_STATE).read_text())
    del state["lora"]  # as written before the settings were recorded
    (path / TRAINER_STATE).write_text(json.dumps(state))
    config = cases.engine_config(qwen3_path)
    config.lora = LoRAConfig(rank=8, alpha=8.0)
    shape = r"other shape \(28\): layers.0.mlp.down_proj.lora_a.weight \(checkpoint \(4, 128\), this run \(8, 128\)\)"
    with pytest.raises(CheckpointError, match=shape):
        Trainer(config).load_checkpoint(manager)
    config.lora = LoRAConfig(rank=4, alpha=8.0, target_modules=("q_proj",))
    extra = r"in the checkpoint but not trainable in this run \(24\): layers.0.mlp.down_proj"
    with pytest.raises(CheckpointError, match=extra):
        Trainer(config).load_checkpoint(manager)


def test_rng_state_round_trips_through_a_weights_only_file(tmp_path):
    import random

    import numpy as np

    from archon.checkpoint.resume import read_rng_state, rng_state, set_rng_state

    torch.save(rng_state(), tmp_path / "rank-0.pt")
    expected = (torch.rand(3), random.random(), np.random.rand(3), np.random.randn())
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    set_rng_state(read_rng_state(tmp_path / "rank-0.pt"))
    again = (torch.rand(3), random.random(), np.random.rand(3), np.random.randn())
    assert torch.equal(expected[0], again[0]) and expected[1] == again[1]
    assert np.array_equal(expected[2], again[2]) and expected[3] == again[3]


def test_pruning_keeps_checkpoints_newer_than_the_one_saved(tmp_path):
    """A run resumed at an earlier checkpoint saves lower step numbers than the newest ones on disk;
    keep-last counts back from the step just saved and never deletes the newer ones."""
    manager = CheckpointManager(tmp_path, keep_last=2)
    for step in (1, 2, 3, 5, 6):
        manager.save(step, {"model": {"w": torch.full((2,), float(step))}}, {"step": step})
    assert [p.name for p in manager.checkpoints()] == ["step-00000005", "step-00000006"]
    manager.save(3, {"model": {"w": torch.zeros(2)}}, {"step": 3})
    assert [p.name for p in manager.checkpoints()] == ["step-00000003", "step-00000005", "step-00000006"]
    manager.save(4, {"model": {"w": torch.zeros(2)}}, {"step": 4})
    assert [p.name for p in manager.checkpoints()] == [
        "step-00000003",
        "step-00000004",
        "step-00000005",
        "step-00000006",
    ]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_a_hostile_non_tensor_item_is_refused_before_dcp_unpickles_it(tmp_path):
    """DCP loads non-tensor items (optimizer settings) with weights_only=False; the manager checks
    them with weights_only=True first, so a planted pickle never runs."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    manager = CheckpointManager(tmp_path / "ckpts")
    path = manager.save(1, {"model": {"w": torch.zeros(2)}, "optimizer": {"lr": 0.5}}, {"step": 1})
    info = next(
        v for k, v in FileSystemReader(str(path)).read_metadata().storage_data.items() if k.fqn == "optimizer.lr"
    )
    marker = tmp_path / "exploit-ran"

    class Exploit:
        def __reduce__(self):
            return (Path.touch, (marker,))

    shard = path / info.relative_path
    data = bytearray(shard.read_bytes())
    payload = io.BytesIO()
    torch.save(Exploit(), payload)
    with open(shard, "wb") as f:  # the planted item replaces the stored one at the same place
        f.write(bytes(data[: info.offset]) + payload.getvalue() + bytes(data[info.offset + info.length :]))
    # the index must point at the planted bytes: rewrite its length
    import pickle

    metadata = FileSystemReader(str(path)).read_metadata()
    for k, v in metadata.storage_data.items():
        if k.fqn == "optimizer.lr":
            v.length = len(payload.getvalue())
        elif v.relative_path == info.relative_path and v.offset > info.offset:
            v.offset += len(payload.getvalue()) - info.length
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match=rf"{shard}.*'optimizer.lr' does not load with weights_only=True"):
        manager.load(path, {"model": {"w": torch.zeros(2)}, "optimizer": {"lr": 0.0}})
    assert not marker.exists()


def test_a_pattern_only_the_checkpoint_has_is_a_difference(tmp_path):
    """Dropping an alpha_pattern changes no shape, so only the settings can tell."""
    from archon.checkpoint.resume import check_same_settings, lora_settings
    from archon.lora import LoRAConfig

    saved = {"lora": lora_settings(LoRAConfig(rank=4, alpha=8.0, alpha_pattern={"q_proj": 64.0}))}
    with pytest.raises(CheckpointError, match=r"lora.alpha_pattern.q_proj: checkpoint 64.0, this run None"):
        check_same_settings(tmp_path, saved, {"lora": lora_settings(LoRAConfig(rank=4, alpha=8.0))})
    check_same_settings(
        tmp_path, saved, {"lora": lora_settings(LoRAConfig(rank=4, alpha=8.0, alpha_pattern={"q_proj": 64.0}))}
    )


def test_a_reshaping_combine_is_read_whole_for_a_shard(tmp_path, monkeypatch):
    """A converter whose combine only reshapes (Kimi Linear's A_log, stored [1, 1, H, 1], is [H] in
    archon) looks like the identity on a probe of the parameter's rank; the sharded read must not
    take the one-to-one path for it, which would slice the stored tensor with the parameter's region."""
    from safetensors.torch import save_file

    import archon.checkpoint.hf as hf
    from archon.checkpoint.state_dict_converter import StateDictConverter

    class Reshaping(StateDictConverter):
        def hf_sources(self, key, hf_keys):
            return ["A_log"]

        def combine(self, key, tensors):
            return tensors[0].reshape(-1)

    stored = torch.arange(8, dtype=torch.float32).reshape(1, 1, 8, 1)
    save_file({"A_log": stored}, str(tmp_path / "model.safetensors"))
    checkpoint = HFCheckpoint(tmp_path)
    converter = Reshaping.__new__(Reshaping)
    monkeypatch.setattr(hf, "local_region", lambda t: (slice(4, 8),))
    part = read_local(converter, checkpoint, "A_log", ["A_log"], torch.empty(8))
    assert torch.equal(part, torch.arange(4, 8, dtype=torch.float32))
