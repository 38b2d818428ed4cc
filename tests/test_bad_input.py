"""Bad checkpoints and configs fail with errors that name the problem."""

import json
import re
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from archon.build import build_model
from archon.checkpoint.atomic import atomic_directory, atomic_file
from archon.checkpoint.hf import HFCheckpoint
from archon.checkpoint.hf_weights import load_hf_weights
from archon.lora import LoRAConfig
from archon.spec import get_spec, supported_model_types


def _rewrite(path, edit):
    weights = path / "model.safetensors"
    tensors = load_file(str(weights))
    edit(tensors)
    save_file(tensors, str(weights), metadata={"format": "pt"})


def test_missing_key(tiny_checkpoint):
    path = tiny_checkpoint("qwen3")
    _rewrite(path, lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"))
    with pytest.raises(KeyError, match=r"missing 1 key.*model\.layers\.1\.self_attn\.k_norm\.weight"):
        build_model(path)


def test_missing_expert(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe")
    _rewrite(path, lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"))
    with pytest.raises(KeyError, match=r"model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight"):
        build_model(path)


def test_unexpected_key(tiny_checkpoint):
    path = tiny_checkpoint("qwen3")
    _rewrite(path, lambda t: t.__setitem__("model.layers.0.mlp.extra_proj.weight", torch.zeros(2, 2)))
    with pytest.raises(KeyError, match=r"unexpected 1 key.*model\.layers\.0\.mlp\.extra_proj\.weight"):
        build_model(path)


def test_wrong_shape(tiny_checkpoint):
    path = tiny_checkpoint("qwen3")
    _rewrite(path, lambda t: t.__setitem__("model.layers.0.mlp.up_proj.weight", torch.zeros(128, 32)))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.weight.*\(128, 32\).*\(128, 64\)"):
        build_model(path)


def test_unknown_model_type(tiny_checkpoint):
    path = tiny_checkpoint("qwen3")
    config = json.loads((path / "config.json").read_text())
    with pytest.raises(ValueError, match=r"unsupported model_type 'gpt2'.*supported:.*qwen3"):
        get_spec("gpt2")
    config["model_type"] = "gpt2"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        build_model(path)


def test_unknown_lora_target(tiny_checkpoint):
    path = tiny_checkpoint("qwen3")
    with pytest.raises(ValueError, match=r"\['qkv_proj'\] do not exist in model family 'qwen3'.*q_proj"):
        build_model(path, lora=LoRAConfig(target_modules=("q_proj", "qkv_proj")))


def test_bad_lora_config():
    with pytest.raises(ValueError, match="rank"):
        LoRAConfig(rank=0)
    with pytest.raises(ValueError, match="target_modules"):
        LoRAConfig(target_modules="all")


def test_missing_directory_and_weights(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        build_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        build_model(tmp_path)


def test_atomic_writes_leave_nothing_on_failure(tmp_path):
    target = tmp_path / "file.bin"
    with pytest.raises(RuntimeError):
        with atomic_file(target) as f:
            f.write(b"partial")
            raise RuntimeError("interrupted")
    assert not target.exists() and list(tmp_path.iterdir()) == []

    directory = tmp_path / "ckpt"
    with atomic_directory(directory) as tmp:
        (tmp / "a").write_text("first")
    with pytest.raises(RuntimeError):
        with atomic_directory(directory) as tmp:
            (tmp / "a").write_text("second, unfinished")
            raise RuntimeError("interrupted")
    assert (directory / "a").read_text() == "first"
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def _kind(hf_key: str) -> str:
    """The key with its layer and expert numbers replaced: one kind of tensor."""
    return re.sub(r"\.\d+\.", ".N.", hf_key)


@pytest.mark.parametrize("model_type", supported_model_types())
def test_every_misshaped_tensor_is_named_before_it_is_split_or_reordered(model_type, tiny_checkpoint, tmp_path):
    """For every kind of checkpoint tensor of every family (fused and reordered projections, conv1d,
    A_log, stacked or per-expert experts, ...), one row more or one row fewer is refused naming the
    HF key and both shapes, before the converter splits, stacks or reorders anything."""
    path = tiny_checkpoint(model_type)
    loaded = build_model(path)
    tensors = load_file(str(path / "model.safetensors"))
    first_of_kind = {}
    for key in sorted(tensors):
        if not loaded.converter.is_ignored(key):  # e.g. a vision tower, which is never loaded
            first_of_kind.setdefault(_kind(key), key)
    for key in first_of_kind.values():
        good = tensors[key]
        for rows in (good.shape[0] + 1, good.shape[0] - 1):
            bad = torch.zeros((rows, *good.shape[1:]), dtype=good.dtype)
            directory = tmp_path / "bad"
            directory.mkdir(exist_ok=True)
            save_file({**tensors, key: bad}, str(directory / "model.safetensors"), metadata={"format": "pt"})
            shapes = f"has shape {tuple(bad.shape)}, but the model expects {tuple(good.shape)}"
            message = re.escape(f"{key!r} in 'model.safetensors' {shapes}")
            with pytest.raises(ValueError, match=message):
                load_hf_weights(loaded.model, loaded.converter, HFCheckpoint(directory))


def _edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    config.pop("layer_types", None)  # HF derives it for the new layer count
    (path / "config.json").write_text(json.dumps(config))


def test_a_model_deeper_than_memory_is_refused_naming_the_layer_count(tiny_checkpoint, monkeypatch):
    """A million layers: refused from a shallow meta-device copy within seconds (building the whole
    meta model would take many minutes), naming num_hidden_layers in the model's config.json."""
    path = tiny_checkpoint("qwen3")
    _edit_config(path, num_hidden_layers=10**6)
    monkeypatch.setattr("archon.build.memory_for_parameters", lambda device: (64 * 2**30, "in this test"))
    start = time.monotonic()
    with pytest.raises(
        ValueError,
        match=r"num_hidden_layers=1000000 in .*config\.json: 1000000 decoder layers of "
        r"about .* GiB each; .* would take about 1\d\d\.\d GiB here, more than the "
        r"64\.0 GiB in this test",
    ):
        build_model(path)
    assert time.monotonic() - start < 60


def test_a_model_wider_than_memory_is_refused_naming_the_width(tiny_checkpoint):
    """hidden_size 1e9 (terabytes of embedding) against the memory this machine really has."""
    path = tiny_checkpoint("qwen3")
    _edit_config(path, hidden_size=10**9)
    with pytest.raises(
        ValueError,
        match=r"vocab_size=256, hidden_size=1000000000 in .*config\.json: the embedding "
        r"and output head take 1,911\.1 GiB; .* more than the .* GiB of available "
        r"memory",
    ):
        build_model(path)


def test_lora_larger_than_memory_or_than_the_modules_is_refused_naming_lora_rank(tiny_checkpoint, monkeypatch):
    path = tiny_checkpoint("qwen3")
    # hidden 64 and key/value projections of 32 rows: no module of min(in, out) >= 65
    every = r"larger than min\(in, out\) of every module it adapts"
    largest = r"\(the largest is 64, for 'model\.layers\.0\.self_attn\.q_proj'\)"
    with pytest.raises(ValueError, match=rf"lora\.rank=1000000000: {every} {largest}"):
        build_model(path, lora=LoRAConfig(rank=10**9, target_modules="all-linear"))
    with pytest.raises(ValueError, match=r"task 'b': lora\.rank=65: larger than min\(in, out\)"):
        build_model(path, task_loras={"a": LoRAConfig(rank=4), "b": LoRAConfig(rank=65, target_modules=("v_proj",))})
    monkeypatch.setattr("archon.build.memory_for_parameters", lambda device: (600_000, "in this test"))
    with pytest.raises(ValueError, match=r"^lora\.rank=64: the LoRA factors take 0\.0 GiB; .* more than the 0\.0 GiB"):
        build_model(path, lora=LoRAConfig(rank=64, target_modules="all-linear"))
    build_model(path, lora=LoRAConfig(rank=4, target_modules="all-linear"))  # fits
