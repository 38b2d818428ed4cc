"""Bad adapter and HF model files: each is refused (or, for NaN/inf values, warned about) with a
message that names the culprit file, field or key, and the files and the model are left unchanged."""

import dataclasses
import hashlib
import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from helpers import randomised_lora_model
from safetensors.torch import load_file, save_file

from archon.build import build_model
from archon.checkpoint.hf import (
    SAFETENSORS_INDEX,
    check_model_dir,
    load_tokenizer,
    save_hf_checkpoint,
)
from archon.lora import LoRAConfig, lora_parameters
from archon.lora.peft import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    load_peft_adapter,
    save_peft_adapter,
)
from archon.tools.align import make_tiny_hf_checkpoint

LORA = LoRAConfig(rank=4, alpha=8, target_modules=("q_proj", "v_proj"))
Q_PROJ_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny HF checkpoint (single file and sharded), a model with LoRA, and its exported adapter."""
    root = tmp_path_factory.mktemp("bad_input_files")
    single = make_tiny_hf_checkpoint("qwen3", root / "hf")
    loaded = randomised_lora_model(single, LORA, seed=0, scale=1.0)
    save_peft_adapter(loaded.model, loaded.converter, LORA, root / "adapter", str(single))
    base = {k: v for k, v in loaded.model.state_dict().items() if "lora_" not in k}
    sharded = save_hf_checkpoint(
        loaded.converter.iter_to_hf(base.items()),
        root / "sharded",
        loaded.hf_config.to_dict(),
        max_shard_bytes=64 * 1024,
    )
    return {"single": single, "sharded": sharded, "adapter": root / "adapter", "loaded": loaded}


def _snapshot(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(directory.rglob("*"))
    }


def _edit_config(**changes):
    def edit(adapter_dir: Path):
        path = adapter_dir / ADAPTER_CONFIG
        config = json.loads(path.read_text())
        for key, value in changes.items():
            if value is _DROP:
                del config[key]
            else:
                config[key] = value
        path.write_text(json.dumps(config))

    return edit


_DROP = object()


def _truncate(name: str):
    def edit(directory: Path):
        data = (directory / name).read_bytes()
        (directory / name).write_bytes(data[: len(data) // 2])

    return edit


def _remove(name: str):
    return lambda directory: (directory / name).unlink()


def _write(name: str, text: str):
    return lambda directory: (directory / name).write_text(text)


def _reshape_q_proj_a(adapter_dir: Path):
    tensors = load_file(adapter_dir / ADAPTER_WEIGHTS)
    tensors[Q_PROJ_A] = tensors[Q_PROJ_A][:3].contiguous()
    save_file(tensors, adapter_dir / ADAPTER_WEIGHTS)


# (id, edit of the adapter directory, error type, regex the message must match)
# fmt: off
ADAPTER_CASES = [
    ("use_dora", _edit_config(use_dora=True), ValueError, r"adapter_config\.json.*use_dora=True.*DoRA"),
    ("modules_to_save", _edit_config(modules_to_save=["lm_head"]), ValueError,
     r"adapter_config\.json.*modules_to_save"),
    ("bias_all", _edit_config(bias="all"), ValueError, r"adapter_config\.json.*bias='all'"),
    ("bias_lora_only", _edit_config(bias="lora_only"), ValueError, r"adapter_config\.json.*bias='lora_only'"),
    ("lora_bias", _edit_config(lora_bias=True), ValueError, r"adapter_config\.json.*lora_bias=True"),
    ("layers_to_transform", _edit_config(layers_to_transform=[0]), ValueError,
     r"adapter_config\.json.*layers_to_transform"),
    ("layers_pattern", _edit_config(layers_pattern="layers"), ValueError, r"adapter_config\.json.*layers_pattern"),
    ("fan_in_fan_out", _edit_config(fan_in_fan_out=True), ValueError, r"adapter_config\.json.*fan_in_fan_out"),
    ("exclude_modules", _edit_config(exclude_modules=["q_proj"]), ValueError, r"adapter_config\.json.*exclude_modules"),
    ("alora", _edit_config(alora_invocation_tokens=[5, 6]), ValueError,
     r"adapter_config\.json.*alora_invocation_tokens=\[5, 6\]"),
    ("patterns_with_target_parameters",
     _edit_config(target_parameters=["mlp.experts.gate_up_proj"], rank_pattern={"q_proj": 2}), ValueError,
     r"adapter_config\.json.*rank_pattern/alpha_pattern together with target_parameters"),
    ("peft_type", _edit_config(peft_type="IA3"), ValueError, r"adapter_config\.json.*peft_type 'IA3'"),
    ("regex_targets", _edit_config(target_modules=".*q_proj"), ValueError,
     r"adapter_config\.json.*'target_modules'.*regular"),
    ("missing_r", _edit_config(r=_DROP), KeyError, r"adapter_config\.json.*lacks the field 'r'"),
    ("string_alpha", _edit_config(lora_alpha="eight"), ValueError, r"adapter_config\.json.*'lora_alpha'.*'eight'"),
    ("bad_rank_pattern", _edit_config(rank_pattern={"q_proj": 0}), ValueError,
     r"adapter_config\.json.*rank_pattern\['q_proj'\]"),
    ("other_alpha", _edit_config(lora_alpha=16), ValueError,
     r"adapter_config\.json.*'model\.layers\.0\.self_attn\.q_proj'.*scaling 4.*scaling 2"),
    ("corrupt_json", _truncate(ADAPTER_CONFIG), ValueError, r"adapter_config\.json.*not valid JSON"),
    ("json_list", _write(ADAPTER_CONFIG, "[1, 2]"), ValueError, r"adapter_config\.json.*JSON object"),
    ("no_config", _remove(ADAPTER_CONFIG), FileNotFoundError, r"adapter_config\.json.*does not exist"),
    ("no_weights", _remove(ADAPTER_WEIGHTS), FileNotFoundError, r"adapter_model\.safetensors.*does not exist"),
    ("truncated_weights", _truncate(ADAPTER_WEIGHTS), ValueError, r"adapter_model\.safetensors.*truncated or corrupt"),
    ("misshaped_tensor", _reshape_q_proj_a, ValueError,
     r"adapter_model\.safetensors.*layers\.0\.self_attn\.q_proj\.lora_a\.weight.*shape \(3, 64\)"),
]
# fmt: on


@pytest.mark.parametrize("edit, error, message", [c[1:] for c in ADAPTER_CASES], ids=[c[0] for c in ADAPTER_CASES])
def test_bad_adapter_is_refused_naming_the_culprit(files, tmp_path, edit, error, message):
    adapter_dir = tmp_path / "adapter"
    shutil.copytree(files["adapter"], adapter_dir)
    edit(adapter_dir)
    before = _snapshot(tmp_path)
    model, converter = files["loaded"].model, files["loaded"].converter
    params_before = {k: p.detach().clone() for k, p in lora_parameters(model).items()}
    with pytest.raises(error, match=message):
        load_peft_adapter(model, converter, adapter_dir)
    assert _snapshot(tmp_path) == before
    for key, param in lora_parameters(model).items():
        assert torch.equal(param, params_before[key]), f"{key} changed by a refused load"


def test_adapter_with_nan_warns_naming_the_tensor(files, tmp_path):
    adapter_dir = tmp_path / "adapter"
    shutil.copytree(files["adapter"], adapter_dir)
    tensors = load_file(adapter_dir / ADAPTER_WEIGHTS)
    tensors[Q_PROJ_A][0, 0] = float("nan")
    save_file(tensors, adapter_dir / ADAPTER_WEIGHTS)
    fresh = build_model(files["single"], lora=LORA)
    with pytest.warns(RuntimeWarning, match=rf"{Q_PROJ_A}.*adapter_model\.safetensors.*1 NaN/inf"):
        load_peft_adapter(fresh.model, fresh.converter, adapter_dir)


def _first_shard(directory: Path) -> str:
    return sorted(json.loads((directory / SAFETENSORS_INDEX).read_text())["weight_map"].values())[0]


def _second_shard(directory: Path) -> str:
    return sorted(set(json.loads((directory / SAFETENSORS_INDEX).read_text())["weight_map"].values()))[1]


def _truncate_second_shard(directory: Path):
    _truncate(_second_shard(directory))(directory)


def _drop_second_shard(directory: Path):
    _remove(_second_shard(directory))(directory)


def _edit_index(change):
    def edit(directory: Path):
        path = directory / SAFETENSORS_INDEX
        index = json.loads(path.read_text())
        change(index)
        path.write_text(json.dumps(index))

    return edit


def _move_embedding_to_last_shard(index):
    shards = sorted(set(index["weight_map"].values()))
    index["weight_map"]["model.embed_tokens.weight"] = shards[-1]


# (id, which checkpoint, edit, error type, regex the message must match)
# fmt: off
CHECKPOINT_CASES = [
    ("truncated_single", "single", _truncate("model.safetensors"), ValueError,
     r"model\.safetensors.*truncated or corrupt"),
    ("garbage_single", "single", _write("model.safetensors", "not a tensor file"), ValueError,
     r"model\.safetensors.*truncated or corrupt"),
    ("truncated_shard", "sharded", _truncate_second_shard, ValueError,
     r"model-00002-of-\d+\.safetensors.*truncated or corrupt"),
    ("missing_shard", "sharded", _drop_second_shard, FileNotFoundError,
     r"shard .*model-00002-of-\d+\.safetensors.*named in .*model\.safetensors\.index\.json.*does not exist"),
    ("corrupt_index", "sharded", _truncate(SAFETENSORS_INDEX), ValueError,
     r"model\.safetensors\.index\.json.*not valid JSON"),
    ("index_without_weight_map", "sharded", _edit_index(lambda i: i.pop("weight_map")), ValueError,
     r"model\.safetensors\.index\.json.*weight_map"),
    ("index_key_in_wrong_shard", "sharded", _edit_index(_move_embedding_to_last_shard), KeyError,
     r"index\.json.*'model\.embed_tokens\.weight'.*model-0000\d-of-\d+\.safetensors"),
    ("no_config", "single", _remove("config.json"), FileNotFoundError, r"no config\.json in .*hf"),
    ("corrupt_config", "single", _truncate("config.json"), ValueError, r"config\.json"),
    ("no_weights", "single", _remove("model.safetensors"), FileNotFoundError,
     r"no model\.safetensors or model\.safetensors\.index\.json in .*hf"),
]
# fmt: on


@pytest.mark.parametrize(
    "which, edit, error, message", [c[1:] for c in CHECKPOINT_CASES], ids=[c[0] for c in CHECKPOINT_CASES]
)
def test_bad_checkpoint_is_refused_naming_the_file(files, tmp_path, which, edit, error, message):
    directory = tmp_path / "hf"
    shutil.copytree(files[which], directory)
    edit(directory)
    before = _snapshot(tmp_path)
    with pytest.raises(error, match=message):
        build_model(directory, lora=LORA)
    assert _snapshot(tmp_path) == before


def test_missing_model_path_names_path_and_option(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(
        FileNotFoundError, match=r"model directory '.*no-such-model' \(from model\.path\) does not exist"
    ):
        build_model(missing, path_option="model.path")
    with pytest.raises(FileNotFoundError, match=r"'.*no-such-model' \(from algorithm\.teacher_path\) does not exist"):
        check_model_dir(missing, "algorithm.teacher_path")
    with pytest.raises(FileNotFoundError, match=r"tokenizer directory '.*no-such-model' \(from model\.tokenizer\)"):
        load_tokenizer(missing, "model.tokenizer")


def test_model_dir_without_tokenizer_is_refused_naming_it(files):
    # make_tiny_hf_checkpoint saves no tokenizer; AutoTokenizer alone would load an empty one from it.
    with pytest.raises(FileNotFoundError, match=r"no tokenizer in '.*hf' \(from model\.path\).*tokenizer\.json"):
        load_tokenizer(files["single"], "model.path")


def test_checkpoint_with_nan_weight_warns_naming_tensor_and_file(files, tmp_path):
    directory = tmp_path / "hf"
    shutil.copytree(files["single"], directory)
    tensors = load_file(directory / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"][2, :3] = float("inf")
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build_model(directory)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert any(
        "'model.layers.1.mlp.up_proj.weight'" in m and "model.safetensors" in m and "3 NaN/inf" in m for m in messages
    ), messages


@pytest.mark.parametrize("option", ["model.path", "model.tokenizer"])
def test_run_with_missing_path_names_path_and_option(files, tmp_path, option):
    from archon.rl.config import ModelConfig, RLConfig
    from archon.rl.loop import RLRun

    missing = str(tmp_path / "no-such-dir")
    if option == "model.path":
        model = ModelConfig(path=missing)
    else:
        model = ModelConfig(path=str(files["single"]), tokenizer=missing)
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    with pytest.raises(ValueError, match=rf"'{missing}' \(from {option}\) does not exist"):
        RLRun(RLConfig(model=model, data=dataclasses.replace(RLConfig().data, path=str(data))))
    assert not (tmp_path / "no-such-dir").exists()
