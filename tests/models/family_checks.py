"""Checks every model family's test file runs: HF parity, LoRA vs PEFT, state-dict round trip and
weight completeness on the meta device. Each takes an HF model_type and tiny-config overrides."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from archon.tools.align import TOLERANCES, AlignArgs, run_alignment

# Odd lengths, one of a single token, the longest above any tiny sliding window.
SEQ_LENS = (7, 1, 13, 33)


def assert_aligned(
    model_type: str, overrides: dict, lora_rank: int | None = 8, seq_lens=SEQ_LENS, dtype: str = "float32"
) -> dict:
    """archon vs HF (and, with lora_rank, vs PEFT on HF) on a packed batch, within the contract of
    `dtype` (archon.tools.align.TOLERANCES): logits, the training path (hidden states through the
    chunked head), LoRA gradients, PEFT keys, and config-field coverage."""
    report = run_alignment(
        AlignArgs(
            model_type=model_type, config_overrides=overrides, lora_rank=lora_rank, seq_lens=seq_lens, dtype=dtype
        )
    )
    tolerances = TOLERANCES[dtype]
    assert report["max_abs_logits_diff"] <= tolerances["max_abs_logits_diff"], report
    assert report["max_abs_train_logprob_diff"] <= tolerances["max_abs_logits_diff"], report
    assert report["mean_kl"] <= tolerances["mean_kl"], report
    assert report["unaccounted_config_fields"] == [], report
    if lora_rank is not None:
        assert report["lora_max_abs_logits_diff"] <= tolerances["max_abs_logits_diff"], report
        assert report["lora_max_abs_train_logprob_diff"] <= tolerances["max_abs_logits_diff"], report
        assert report["lora_grad_max_rel_err"] <= tolerances["lora_grad_max_rel_err"], report
        assert report["peft_missing_keys"] == [], report
        assert report["peft_unexpected_keys"] == [], report
        assert report["lora_effect_max_abs"] > 1e-3, report  # the adapter really acts
    assert report["pass"], report
    return report


def assert_gate_fails(model_type: str, overrides: dict, seq_lens=SEQ_LENS) -> dict:
    """The gate (fp32, no LoRA) fails: for mutation checks, where a feature of the archon model is
    switched off (monkeypatched) and the tiny config must be one that notices."""
    report = run_alignment(AlignArgs(model_type=model_type, config_overrides=overrides, seq_lens=seq_lens))
    assert not report["pass"], f"{model_type} passes the gate with the feature switched off: {report}"
    assert report["max_abs_logits_diff"] > 1e-3 or report["max_abs_train_logprob_diff"] > 1e-3, report
    return report


def assert_state_dict_round_trip(hf_dir: Path) -> None:
    """archon -> HF keys gives the checkpoint's tensors under its own keys, and HF -> archon gives
    back the archon state dict."""
    from safetensors.torch import load_file

    from archon.build import build_model
    from archon.checkpoint.hf import expected_base_params

    loaded = build_model(hf_dir)
    converter = loaded.converter
    archon_state = {k: v.detach().clone() for k, v in expected_base_params(loaded.model).items()}
    checkpoint = load_file(str(Path(hf_dir) / "model.safetensors"))

    hf_state = converter.state_dict_to_hf(archon_state)
    wanted = {k for k in checkpoint if not converter.is_ignored(k)}
    assert set(hf_state) == wanted, (sorted(set(hf_state) - wanted), sorted(wanted - set(hf_state)))
    for key, tensor in hf_state.items():
        assert torch.equal(tensor, checkpoint[key]), key

    hf_keys = set(hf_state)
    back = {
        key: converter.combine(key, [hf_state[s] for s in converter.hf_sources(key, hf_keys)]) for key in archon_state
    }
    assert set(back) == set(archon_state)
    for key, tensor in back.items():
        assert torch.equal(tensor, archon_state[key]), key


def assert_meta_weights_complete(model_type: str, overrides: dict) -> None:
    """On the meta device: every archon base weight has HF source key(s) of the right shape, and
    every HF weight is used (or deliberately ignored), so loading can neither miss nor drop one."""
    from archon.checkpoint.hf import expected_base_params
    from archon.spec import get_spec
    from archon.tools.align import hf_model_class
    from archon.tools.tiny_checkpoint import tiny_hf_config

    spec = get_spec(model_type)
    config = tiny_hf_config(model_type, **overrides)
    with torch.device("meta"):
        hf_model = hf_model_class(config).from_config(config)
        args = spec.args_cls.from_hf_config(config)
        model = spec.model_cls(args, None)
    converter = spec.state_dict_converter_cls(args)
    hf_state = hf_model.state_dict()
    hf_keys = {k for k in hf_state if not converter.is_ignored(k)}

    used: set[str] = set()
    for key, param in expected_base_params(model).items():
        sources = converter.hf_sources(key, hf_keys)
        absent = [s for s in sources if s not in hf_keys]
        assert not absent, f"archon {key!r} needs HF key(s) {absent} that the HF model lacks"
        combined = converter.combine(key, [hf_state[s] for s in sources])
        assert combined.shape == param.shape, (key, tuple(combined.shape), tuple(param.shape))
        used.update(sources)
    assert hf_keys == used, f"HF weights archon does not load: {sorted(hf_keys - used)}"
    assert all(p.is_meta for p in model.parameters())


def assert_extra_layer_keys_are_skipped(path: Path, tmp_path: Path, extra_keys: list[str], stray_key: str) -> None:
    """A checkpoint with `extra_keys` added (multi-token-prediction layers numbered from
    num_hidden_layers on, as released checkpoints carry them) loads to the same model; one with
    `stray_key` added as well fails the load, naming it."""
    import shutil

    from safetensors.torch import load_file, save_file

    from archon.build import build_model

    reference = build_model(path).model.eval()
    state = load_file(str(path / "model.safetensors"))
    for key in extra_keys:
        state[key] = torch.zeros(4, 4)
    with_extra = tmp_path / "with_extra_layers"
    shutil.copytree(path, with_extra)
    save_file(state, str(with_extra / "model.safetensors"), metadata={"format": "pt"})
    loaded = build_model(with_extra).model
    for name, tensor in reference.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name

    state[stray_key] = torch.zeros(2)
    save_file(state, str(with_extra / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(KeyError, match=rf"unexpected 1 key\(s\): '{re.escape(stray_key)}'"):
        build_model(with_extra)
