"""Gate v2's check of multi-token-prediction layers (models/common/mtp.py). HF transformers builds no
MTP layers, so the reference is the published formula computed from the checkpoint's own tensors:

    x = projection(cat[embedding_norm(embed(t_{i+1})), hidden_norm(h_i)]);  logits = head(norm(block(x)))

with DeepSeek-V3's layout (plain RMSNorms `enorm` / `hnorm`, `eh_proj`, the embedding zeroed at
position 0 as vLLM does, the layer's own `shared_head`) or the hybrids' (Qwen3.5, Qwen3-Next:
zero-centred norms `mtp.pre_fc_norm_*`, `mtp.fc`, `mtp.norm`, the model's head). The block is a fresh
copy of the family's decoder layer with the MTP block's weights: the class whose math the gate checks
against HF on the main model. The tiny checkpoint gets one random MTP layer under the names released
checkpoints use.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from archon.build import load_hf_config, supports_mtp
from archon.spec import get_spec

# The HF config fields that count a checkpoint's MTP layers, by the families that have them.
MTP_CONFIG_FIELDS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")


def has_mtp(model_type: str) -> bool:
    return supports_mtp(get_spec(model_type))


def add_mtp_layer(model_dir: Path, seed: int) -> Path:
    """Write one random MTP layer into the tiny checkpoint at `model_dir` (its one model.safetensors)
    under the family's checkpoint names, and count it in config.json."""
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    section = config.get("text_config") or config
    spec = get_spec(config["model_type"])
    # the field the family's args name (`mtp_config_field`, its first word), else one the config has
    named = getattr(spec.args_cls, "mtp_config_field", "").split(" ")[0]
    hf_text_config = load_hf_config(model_dir).get_text_config()
    field = named or next((f for f in MTP_CONFIG_FIELDS if hasattr(hf_text_config, f)), None)
    if field is None:
        raise ValueError(f"{config_path}: no MTP layer count; the family names none (mtp_config_field)")
    section[field] = 1
    config_path.write_text(json.dumps(config, indent=2))
    args = dataclasses.replace(spec.args_cls.from_hf_config(load_hf_config(model_dir)), num_mtp_layers=1)
    converter = spec.state_dict_converter_cls(args)
    with torch.device("meta"):
        model = spec.model_cls(args, None)
    tensors = load_file(model_dir / "model.safetensors")
    g = torch.Generator().manual_seed(seed)
    for key, param in {**dict(model.named_parameters()), **dict(model.named_buffers())}.items():
        if key.startswith("mtp."):
            if param.ndim >= 2:
                value = torch.randn(param.shape, generator=g) / math.sqrt(param.shape[-1])
            else:  # norms off their init, biases near zero
                value = (1.0 if key.endswith("norm.weight") else 0.0) + 0.1 * torch.randn(param.shape, generator=g)
            tensors.update(converter.to_hf(key, value.float()))
        elif key in ("embed_tokens.weight", "lm_head.weight"):  # DeepSeek-V3 keeps copies per MTP layer
            tensors.update(converter.to_hf(key, tensors[converter.hf_name(key)]))
    save_file({k: v.contiguous() for k, v in tensors.items()}, model_dir / "model.safetensors")
    return model_dir


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    h = x.double()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * (offset + weight.double())


def _fresh_block(model) -> torch.nn.Module:
    """The MTP block's weights in a fresh copy of its decoder layer (no instance-level overrides)."""
    block = copy.deepcopy(model.mtp[0].block)
    for module in block.modules():
        module.__dict__.pop("forward", None)
    return block


def reference_mtp_logits(model, tensors: dict[str, torch.Tensor], tokens, positions, cu_seqlens, max_seqlen):
    """[T, V] logits of the MTP layer by the published formula (module docstring), in float64 outside the block."""
    eps = model.args.rms_norm_eps
    hidden = model(tokens, positions, cu_seqlens, max_seqlen, return_hidden=True)
    next_tokens = torch.roll(tokens, -1)
    if "mtp.fc.weight" in tensors:  # Qwen3.5 / Qwen3-Next
        embedding = next(v for k, v in tensors.items() if k.endswith("embed_tokens.weight") and "mtp" not in k)
        parts = ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.fc.weight")
        head, final_norm, offset = tensors.get("lm_head.weight", embedding), "mtp.norm.weight", 1.0
        embedded = torch.nn.functional.embedding(next_tokens, embedding)
    else:  # DeepSeek-V3: layer N = num_hidden_layers
        layer = f"model.layers.{model.args.num_hidden_layers}."
        parts = (layer + "enorm.weight", layer + "hnorm.weight", layer + "eh_proj.weight")
        head, final_norm, offset = tensors[layer + "shared_head.head.weight"], layer + "shared_head.norm.weight", 0.0
        embedded = torch.nn.functional.embedding(next_tokens, tensors[layer + "embed_tokens.weight"])
        embedded = embedded * (positions != 0).unsqueeze(-1)
    joined = torch.cat(
        [_rms(embedded, tensors[parts[0]], eps, offset), _rms(hidden, tensors[parts[1]], eps, offset)], -1
    )
    x = (joined @ tensors[parts[2]].double().T).to(hidden.dtype)
    cos, sin = model.rotary(positions, x.dtype)
    y = _rms(_fresh_block(model)(x, cos, sin, cu_seqlens, max_seqlen), tensors[final_norm], eps, offset)
    return y @ head.double().T


def mtp_check(hf_path: Path, dtype: torch.dtype, seqs_batch, seed: int, build_model) -> float:
    """max |Δ logits| of archon's MTP layer (`mtp_logits`) against the formula, on the checkpoint at
    `hf_path` (a copy: it gets one random MTP layer), over the gate's packed batch; `build_model` as
    archon.build's."""
    _, tokens, positions, cu_seqlens = seqs_batch
    max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    model = build_model(add_mtp_layer(hf_path, seed), dtype=dtype, mtp=True).model.eval()
    tensors = load_file(hf_path / "model.safetensors")
    with torch.no_grad():
        hidden = model(tokens, positions, cu_seqlens, max_seqlen, return_hidden=True)
        logits, _ = model.mtp_logits(hidden, torch.roll(tokens, -1), positions, cu_seqlens, max_seqlen)
        want = reference_mtp_logits(model, tensors, tokens, positions, cu_seqlens, max_seqlen)
    return (logits.double() - want).abs().max().item()
