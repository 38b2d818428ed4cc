"""Importing adapters that PEFT itself made: per-module rank and alpha, all-linear, full-path targets.

The oracle is PEFT: an adapter with random non-zero factors, saved by PEFT, must give PEFT's logits
once imported into archon, and archon's re-export must load back into PEFT with the same logits."""

import json

import pytest
import torch
from safetensors import safe_open

from archon.build import build_model
from archon.lora.peft import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    load_peft_adapter,
    lora_config_from_peft,
    save_peft_adapter,
)
from archon.tools.align import packed_batch

CASES = {
    "all-linear+patterns": dict(
        target_modules="all-linear",
        rank_pattern={"q_proj": 2, r"layers\.1\.mlp\.down_proj": 6},
        alpha_pattern={"v_proj": 3.0, "o_proj": 32, r"model\.layers\.0\.mlp\.up_proj": 5},
    ),
    "leaf-names+alpha-pattern": dict(target_modules=["q_proj", "v_proj", "down_proj"], alpha_pattern={"v_proj": 24}),
    "full-paths+rslora": dict(
        target_modules=["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.gate_proj", "k_proj"],
        rank_pattern={"k_proj": 8},
        alpha_pattern={"gate_proj": 2},
        use_rslora=True,
    ),
}


def _peft_adapter(hf_path, out_dir, **lora_kwargs):
    """A PEFT model on the HF checkpoint with random non-zero LoRA factors, saved to out_dir."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_path, dtype=torch.float32)
    peft_model = get_peft_model(hf, LoraConfig(r=4, lora_alpha=8, **lora_kwargs))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.2)
    peft_model.save_pretrained(out_dir)
    return peft_model.eval()


def _peft_logits(peft_model, seqs):
    with torch.no_grad():
        return torch.cat([peft_model(s[None]).logits[0] for s in seqs])


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("model_type", ["qwen3", "llama"])
def test_peft_made_adapter_gives_peft_logits_and_exports_back(tiny_checkpoint, tmp_path, model_type, case):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint(model_type)
    peft_model = _peft_adapter(path, tmp_path / "peft", **CASES[case])
    seqs, tokens, positions, cu = packed_batch((6, 11), 256, seed=0)
    expected = _peft_logits(peft_model, seqs)

    lora = lora_config_from_peft(tmp_path / "peft")
    loaded = build_model(path, lora=lora)
    load_peft_adapter(loaded.model, loaded.converter, tmp_path / "peft")
    with torch.no_grad():
        ours = loaded.model.eval()(tokens, positions, cu, 11)
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)

    save_peft_adapter(loaded.model, loaded.converter, lora, tmp_path / "archon", str(path))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    reloaded = PeftModel.from_pretrained(hf, str(tmp_path / "archon")).eval()
    with safe_open(tmp_path / "archon" / ADAPTER_WEIGHTS, "pt") as f:
        exported_keys = set(f.keys())
    with safe_open(tmp_path / "peft" / ADAPTER_WEIGHTS, "pt") as f:
        peft_keys = set(f.keys())
    assert exported_keys == peft_keys
    peft_lora_shapes = {n: tuple(p.shape) for n, p in reloaded.named_parameters() if "lora_" in n}
    assert len(peft_lora_shapes) == len(exported_keys)  # PEFT built LoRA exactly where the file has factors
    torch.testing.assert_close(_peft_logits(reloaded, seqs), expected, rtol=1e-4, atol=1e-4)


def test_imported_patterns_set_per_module_rank_and_scaling(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("qwen3")
    _peft_adapter(path, tmp_path / "peft", **CASES["all-linear+patterns"])
    config = json.loads((tmp_path / "peft" / ADAPTER_CONFIG).read_text())
    assert isinstance(config["target_modules"], list) and "model.layers.0.self_attn.q_proj" in config["target_modules"]
    loaded = build_model(path, lora=lora_config_from_peft(tmp_path / "peft"))
    modules = dict(loaded.model.named_modules())
    assert (modules["layers.0.self_attn.q_proj"].rank, modules["layers.0.self_attn.q_proj"].scaling) == (2, 4.0)
    assert (modules["layers.1.mlp.down_proj"].rank, modules["layers.1.mlp.down_proj"].scaling) == (6, 8 / 6)
    assert (modules["layers.0.mlp.down_proj"].rank, modules["layers.0.mlp.down_proj"].scaling) == (4, 2.0)
    assert modules["layers.1.self_attn.o_proj"].scaling == 8.0
    assert modules["layers.0.mlp.up_proj"].scaling == 5 / 4 and modules["layers.1.mlp.up_proj"].scaling == 2.0


def test_literal_all_linear_config_loads_as_peft_resolves_it(tiny_checkpoint, tmp_path):
    """An adapter_config.json that says target_modules "all-linear" (PEFT resolves it on load: every
    linear but the output head) gives PEFT's logits in archon."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint("qwen3")
    _peft_adapter(path, tmp_path / "peft", target_modules="all-linear", alpha_pattern={"o_proj": 32})
    config_path = tmp_path / "peft" / ADAPTER_CONFIG
    config = json.loads(config_path.read_text())
    config["target_modules"] = "all-linear"
    config_path.write_text(json.dumps(config))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, str(tmp_path / "peft")).eval()
    seqs, tokens, positions, cu = packed_batch((6, 11), 256, seed=0)

    loaded = build_model(path, lora=lora_config_from_peft(tmp_path / "peft"))
    load_peft_adapter(loaded.model, loaded.converter, tmp_path / "peft")
    with torch.no_grad():
        ours = loaded.model.eval()(tokens, positions, cu, 11)
    torch.testing.assert_close(ours, _peft_logits(peft_model, seqs), rtol=1e-4, atol=1e-4)


def test_pattern_that_matches_no_module_warns(tiny_checkpoint):
    from archon.lora import LoRAConfig

    lora = LoRAConfig(rank=4, alpha=8, target_modules=("q_proj",), rank_pattern={"q_proj": 2, "v_pro": 8})
    with pytest.warns(RuntimeWarning, match=r"\['v_pro'\] match no adapted module"):
        build_model(tiny_checkpoint("qwen3"), lora=lora)


def test_patterns_on_moe_adapter_with_target_parameters_are_refused_at_build(tiny_checkpoint):
    """PEFT matches patterns against "<module>.<parameter>" for target_parameters and vLLM against the
    module name, so such an adapter could not be exported faithfully: the build fails, not the export."""
    from archon.lora import LoRAConfig

    lora = LoRAConfig(rank=4, alpha=8, target_modules=("q_proj", "experts"), rank_pattern={"q_proj": 2})
    with pytest.raises(ValueError, match=r"rank_pattern/alpha_pattern.*target_parameters.*mlp\.experts\.gate_up_proj"):
        build_model(tiny_checkpoint("qwen3_moe"), lora=lora)
