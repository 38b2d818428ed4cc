"""PEFT adapter export/import and merged-model export."""

import json

import pytest
import torch

from archon.build import build_model
from archon.checkpoint.hf_weights import save_merged_hf
from archon.lora import LoRAConfig, lora_parameters
from archon.lora.peft import ADAPTER_CONFIG, load_peft_adapter, lora_config_from_peft, save_peft_adapter
from archon.tools.align import packed_batch


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
def test_export_loads_in_peft_and_reproduces_logits(lora_model, tiny_checkpoint, tmp_path, model_type):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint(model_type)
    lora = LoRAConfig(rank=4, alpha=16, target_modules=("q_proj", "v_proj", "o_proj"))
    loaded = lora_model(path, lora)
    save_peft_adapter(loaded.model, loaded.converter, lora, tmp_path / "adapter", str(path))
    config = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 16 and config["peft_type"] == "LORA"
    assert config["target_modules"] == ["o_proj", "q_proj", "v_proj"]

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()
    seqs, tokens, positions, cu = packed_batch((6, 11), 256, seed=0)
    with torch.no_grad():
        ours = loaded.model.eval()(tokens, positions, cu, 11)
        theirs = torch.cat([peft_model(s[None]).logits[0] for s in seqs])
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
def test_import_round_trip(lora_model, tiny_checkpoint, tmp_path, model_type):
    path = tiny_checkpoint(model_type)
    lora = LoRAConfig(rank=4, alpha=8, use_rslora=True)
    loaded = lora_model(path, lora)
    save_peft_adapter(loaded.model, loaded.converter, lora, tmp_path / "adapter", str(path))

    imported_cfg = lora_config_from_peft(tmp_path / "adapter")
    assert imported_cfg.rank == 4 and imported_cfg.use_rslora and imported_cfg.scaling == lora.scaling
    fresh = build_model(path, lora=imported_cfg)
    load_peft_adapter(fresh.model, fresh.converter, tmp_path / "adapter")
    original, restored = lora_parameters(loaded.model), lora_parameters(fresh.model)
    assert original.keys() == restored.keys()
    for name in original:
        assert torch.equal(original[name], restored[name]), name


def test_import_rejects_adapter_of_other_rank(lora_model, tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("qwen3")
    lora = LoRAConfig(rank=4)
    loaded = lora_model(path, lora)
    save_peft_adapter(loaded.model, loaded.converter, lora, tmp_path / "adapter", str(path))
    other = build_model(path, lora=LoRAConfig(rank=8))
    with pytest.raises(
        ValueError, match=r"adapter_config\.json.*layers\.0\.self_attn\.q_proj' rank 4.*model has rank 8"
    ):
        load_peft_adapter(other.model, other.converter, tmp_path / "adapter")
    narrower = build_model(path, lora=LoRAConfig(rank=4, target_modules=("q_proj",)))
    with pytest.raises(KeyError, match="does not have"):
        load_peft_adapter(narrower.model, narrower.converter, tmp_path / "adapter")


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
def test_merged_export_round_trip(lora_model, tiny_checkpoint, tmp_path, model_type):
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint(model_type)
    loaded = lora_model(path, LoRAConfig(rank=4, alpha=8))
    before = {n: p.detach().clone() for n, p in loaded.model.named_parameters()}
    out = save_merged_hf(loaded.model, loaded.converter, tmp_path / "merged", loaded.hf_config.to_dict(), path)
    for name, param in loaded.model.named_parameters():
        assert torch.equal(param, before[name]), f"{name} changed by the merged export"

    seqs, tokens, positions, cu = packed_batch((6, 11), 256, seed=0)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    reloaded = build_model(out).model.eval()
    with torch.no_grad():
        with_lora = loaded.model.eval()(tokens, positions, cu, 11)
        hf_merged = torch.cat([hf(s[None]).logits[0] for s in seqs])
        archon_merged = reloaded(tokens, positions, cu, 11)
    torch.testing.assert_close(hf_merged, with_lora, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(archon_merged, with_lora, rtol=1e-4, atol=1e-4)


def test_sharded_checkpoint_loads(tiny_checkpoint, tmp_path):
    from archon.checkpoint.hf import SAFETENSORS_INDEX, save_hf_checkpoint

    path = tiny_checkpoint("qwen3")
    loaded = build_model(path)
    state = {k: v for k, v in loaded.model.state_dict().items()}
    out = save_hf_checkpoint(
        loaded.converter.iter_to_hf(state.items()),
        tmp_path / "sharded",
        loaded.hf_config.to_dict(),
        max_shard_bytes=64 * 1024,
    )
    index = json.loads((out / SAFETENSORS_INDEX).read_text())
    assert len(set(index["weight_map"].values())) > 2
    again = build_model(out)
    for name, tensor in again.model.state_dict().items():
        assert torch.equal(tensor, state[name]), name
