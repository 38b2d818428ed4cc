"""The alignment gate notices each feature a family's tiny config turns on being switched off.

A tiny config that never reaches a feature (a window longer than every sequence, a clamp no
activation hits, a bias the checkpoint leaves at zero) lets a port pass the gate that ignores the
feature. Each case here builds the archon model as the gate does, switches one feature off the way a
wrong port would (`switch_off(model, monkeypatch)`, applied to every model the gate builds), and
asserts that the gate fails with logits or training-path log-probs moved by more than 1e-3.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F
from family_checks import assert_aligned, assert_gate_fails
from torch import nn

import archon.tools.align as align
from archon.models.common import attention as attention_module
from archon.models.common import linear_attention
from archon.models.common.attention import Attention, GatedAttention, packed_attention
from archon.models.common.linear_attention import GatedDeltaNet, qkv_rows_by_key_head
from archon.models.common.mla import MultiHeadLatentAttention
from archon.models.common.mlp import GeGLUMLP
from archon.models.common.moe import (
    ClampedSwiGLUExperts,
    SharedExpertMoE,
    SharedExpertsMoE,
    SigmoidGroupTopKRouter,
    SoftmaxTopKRouter,
    TopKSoftmaxRouter,
)
from archon.models.common.norms import GatedRMSNorm, OffsetRMSNorm, ProjectionRMSNorm
from archon.models.common.rope import RotaryEmbedding, apply_rotary, rope_inv_freq
from archon.models.deepseek_v32.model import LightningIndexer, SparseLatentAttention
from archon.models.kimi_linear import model as kimi_linear_model
from archon.models.kimi_linear.model import KimiDeltaAttention, KimiForgetGate

# Odd lengths, one of a single token, the longest above every tiny sliding window.
SEQ_LENS = (7, 1, 33)

SwitchOff = Callable[[nn.Module, pytest.MonkeyPatch], None]


@dataclass(frozen=True)
class Case:
    model_type: str
    feature: str
    switch_off: SwitchOff
    overrides: dict = field(default_factory=dict)
    """Tiny-config overrides that turn the feature on, where the registered tiny config has it off."""

    @property
    def id(self) -> str:
        return f"{self.model_type}-{self.feature}"


def modules(model: nn.Module, cls: type) -> list[nn.Module]:
    found = [m for m in model.modules() if isinstance(m, cls)]
    assert found, f"the model has no {cls.__name__}"
    return found


class Zero(nn.Module):
    """An MLP that contributes nothing: x -> 0."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(x)


# ---- Mutations: each switches one feature off in a built model, as a wrong port would ----------


def zero_biases(*names: str) -> SwitchOff:
    """The biases of the linear layers named `names` (attention projections, MLP projections) are zero."""

    def switch_off(model, monkeypatch):
        layers = [m for name, m in model.named_modules() if name.rsplit(".", 1)[-1] in names]
        assert layers and all(layer.bias is not None for layer in layers), names
        with torch.no_grad():
            for layer in layers:
                layer.bias.zero_()

    return switch_off


def no_qk_norm(model, monkeypatch):
    """Queries and keys are not normalised per head."""
    for attn in [m for m in model.modules() if isinstance(m, (Attention, GatedAttention))]:
        assert attn.q_norm is not None
        attn.q_norm = attn.k_norm = nn.Identity()


def no_sliding_window(model, monkeypatch):
    """Sliding layers attend to the whole prefix."""
    sliding = [m for m in modules(model, Attention) if m.sliding_window is not None]
    assert sliding
    for attn in sliding:
        attn.sliding_window = None


def window_on_every_layer(model, monkeypatch):
    """The window applies to the full-attention layers too (the per-layer pattern ignored)."""
    window = model.args.sliding_window
    full = [m for m in modules(model, Attention) if m.sliding_window is None]
    assert full and window
    for attn in full:
        attn.sliding_window = window


def gqa_heads_tiled(model, monkeypatch):
    """Query head h reads key/value head h % n_kv_heads instead of h // (n_heads / n_kv_heads)."""

    def tiled(q, k, v, *args, **kwargs):
        repeats = q.shape[1] // k.shape[1]
        assert repeats > 1
        return packed_attention(q, k.repeat(1, repeats, 1), v.repeat(1, repeats, 1), *args, **kwargs)

    monkeypatch.setattr(attention_module, "packed_attention", tiled)


def no_attention_sinks(model, monkeypatch):
    for attn in modules(model, Attention):
        assert attn.sinks is not None
        attn.sinks = None


def rope_frequencies(model, rope_parameters: dict) -> torch.Tensor:
    """The inverse frequencies `rope_parameters` give the model's rotary dims."""
    inv_freq, _ = rope_inv_freq(rope_parameters, model.rotary.rotary_dim, model.args.max_position_embeddings)
    return inv_freq


def use_rope_frequencies(model, inv_freq: torch.Tensor) -> None:
    model.rotary._inv_freq = {torch.device("cpu"): inv_freq}


def plain_rope_frequencies(model, monkeypatch):
    """The scaled RoPE (llama3, YaRN) computed as default RoPE of the same theta; YaRN's attention
    factor on cos/sin is kept."""
    rope_parameters = model.args.rope_parameters
    assert rope_parameters["rope_type"] != "default"
    default = {"rope_type": "default", "rope_theta": rope_parameters["rope_theta"]}
    use_rope_frequencies(model, rope_frequencies(model, default))


def rope_frequencies_with(**changes) -> SwitchOff:
    """RoPE frequencies from rope_parameters with `changes` (a YaRN `truncate` ignored); the
    attention factor is kept."""

    def switch_off(model, monkeypatch):
        rope_parameters = model.args.rope_parameters
        assert any(rope_parameters.get(k) != v for k, v in changes.items()), changes
        use_rope_frequencies(model, rope_frequencies(model, {**rope_parameters, **changes}))

    return switch_off


def llama3_without_smoothing(model, monkeypatch):
    """llama3 RoPE without its smooth band: wavelengths above original / low_freq_factor divided by
    factor, the rest kept."""
    params = model.args.rope_parameters
    inv_freq = rope_frequencies(model, {"rope_type": "default", "rope_theta": params["rope_theta"]})
    long = 2 * math.pi / inv_freq > params["original_max_position_embeddings"] / params["low_freq_factor"]
    use_rope_frequencies(model, torch.where(long, inv_freq / params["factor"], inv_freq))


def no_rope_attention_factor(model, monkeypatch):
    """YaRN's attention factor (the scale of cos and sin) is dropped."""
    assert model.rotary.attention_scaling != 1.0
    model.rotary.attention_scaling = 1.0


def full_rotary(model, monkeypatch):
    """Partial rotary applied to every feature of the head."""
    args = model.args
    assert model.rotary.rotary_dim < args.head_dim
    model.rotary = RotaryEmbedding(args.rope_parameters, args.head_dim, args.max_position_embeddings)


def rope_not_interleaved(model, monkeypatch):
    """MLA's rotary features read in half-split order, not as interleaved pairs."""
    for attn in modules(model, MultiHeadLatentAttention):
        assert attn.interleaved
        attn.interleaved = False


def no_yarn_softmax_mscale(model, monkeypatch):
    """MLA's softmax scale without YaRN's mscale(factor, mscale_all_dim)**2."""
    for attn in modules(model, MultiHeadLatentAttention):
        assert not math.isclose(attn.scale, attn.qk_head_dim**-0.5)
        attn.scale = attn.qk_head_dim**-0.5


def no_latent_norms(model, monkeypatch):
    """MLA's query and key/value latents are not RMS-normalised."""
    for attn in modules(model, MultiHeadLatentAttention):
        attn.q_a_layernorm = attn.kv_a_layernorm = nn.Identity()


def no_output_gate(model, monkeypatch):
    """Gated attention without its per-head sigmoid output gate (the gate rows of q_proj unused)."""

    def forward(self, x, cos, sin, cu_seqlens, max_seqlen, cache=None, context_parallel=None):
        T, hd = x.shape[0], self.head_dim
        q, _ = self.q_proj(x).view(T, -1, 2 * hd).split(hd, dim=-1)
        k, v = self.k_proj(x).view(T, -1, hd), self.v_proj(x).view(T, -1, hd)
        q, k = apply_rotary(self.q_norm(q), cos, sin), apply_rotary(self.k_norm(k), cos, sin)
        out = packed_attention(q, k, v, cu_seqlens, max_seqlen, self.scale)
        return self.o_proj(out.reshape(T, -1))

    monkeypatch.setattr(GatedAttention, "forward", forward)


def norm_without_offset(model, monkeypatch):
    """Zero-centred RMSNorms scaled by w instead of (1 + w)."""

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * self.weight.float()).to(x.dtype)

    modules(model, OffsetRMSNorm)
    monkeypatch.setattr(OffsetRMSNorm, "forward", forward)


def conv_identity(model, monkeypatch):
    """DeltaNet's short causal conv passes each channel's current input through (silu still applied)."""
    with torch.no_grad():
        for mixer in modules(model, GatedDeltaNet):
            weight = mixer.conv1d.weight  # [C, 1, K]
            weight.zero_()
            weight[..., -1] = 1.0


def delta_rule_with(
    transform: Callable[[dict], None], family=linear_attention, mixer: type = GatedDeltaNet
) -> SwitchOff:
    """Every `mixer` layer calls the gated delta rule with its inputs changed by `transform`; `family` is
    the module the mixer is defined in, whose name for the rule is replaced."""

    def switch_off(model, monkeypatch):
        modules(model, mixer)
        rule = linear_attention.gated_delta_rule

        def changed(q, k, v, g, beta, seqs, initial_state):
            inputs = dict(q=q, k=k, v=v, g=g, beta=beta)
            transform(inputs)
            return rule(**inputs, seqs=seqs, initial_state=initial_state)

        monkeypatch.setattr(family, "gated_delta_rule", changed)

    return switch_off


def _no_decay(inputs):
    inputs["g"] = torch.zeros_like(inputs["g"])


def _full_write_strength(inputs):
    inputs["beta"] = torch.ones_like(inputs["beta"])


def value_heads_tiled(model, monkeypatch):
    """Value head h reads key head h % n_key_heads instead of h // (value heads per key head)."""
    per_key_head = model.args.linear_value_heads_per_key_head
    assert per_key_head > 1

    def tile(inputs):
        for name in ("q", "k"):
            key_heads = inputs[name][:, ::per_key_head]  # [T, Hk, dk]
            inputs[name] = key_heads.repeat(1, per_key_head, 1)

    delta_rule_with(tile)(model, monkeypatch)


def no_qk_l2_norm(model, monkeypatch):
    """The delta rule's queries and keys are not L2-normalised."""
    modules(model, GatedDeltaNet)
    monkeypatch.setattr(linear_attention, "l2_normalize", lambda x, eps=1e-6: x)


def zero_dt_bias(model, monkeypatch):
    with torch.no_grad():
        for mixer in modules(model, GatedDeltaNet):
            mixer.dt_bias.zero_()


def no_output_norm_gate(model, monkeypatch):
    """DeltaNet's output RMSNorm without its silu(z) gate."""

    def forward(self, x, gate):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    modules(model, GatedRMSNorm)
    monkeypatch.setattr(GatedRMSNorm, "forward", forward)


def fused_projections_read_flat(model, monkeypatch):
    """Qwen3-Next's in_proj_qkvz and in_proj_ba read as [all q | all k | all v | all z] and
    [all b | all a] instead of grouped per key head, as HF stores them."""
    mixers = modules(model, GatedDeltaNet)
    assert all(mixer.fused_projections for mixer in mixers)

    def project(self, x):
        dk, dv, r = self.key_head_dim, self.value_head_dim, self.value_heads_per_key_head
        T, n_k = x.shape[0], self.conv1d.weight.shape[0] // (2 * dk + r * dv)
        q, k, v, z = self.in_proj_qkvz(x).split([n_k * dk, n_k * dk, n_k * r * dv, n_k * r * dv], dim=-1)
        qkv = torch.cat([q.view(T, n_k, dk), k.view(T, n_k, dk), v.view(T, n_k, r * dv)], dim=-1)
        b, a = self.in_proj_ba(x).chunk(2, dim=-1)
        return qkv, b, a, z.reshape(T, -1, dv)

    monkeypatch.setattr(GatedDeltaNet, "_project", project)


def conv_channels_in_hf_order(model, monkeypatch):
    """DeltaNet's conv channels kept in HF's q | k | v order while the rows they convolve are grouped
    per key head (a converter that does not reorder them)."""
    hf_order = torch.argsort(qkv_rows_by_key_head(model.args))
    with torch.no_grad():
        for mixer in modules(model, GatedDeltaNet):
            mixer.conv1d.weight.copy_(mixer.conv1d.weight[hf_order])


def no_embedding_scale(model, monkeypatch):
    """Embeddings enter the first layer unscaled (Gemma multiplies them by sqrt(hidden_size))."""
    assert model.embedding_scale is not None
    model.embedding_scale = None


def head_dim_softmax_scale(model, monkeypatch):
    """The softmax scale is head_dim**-0.5, not query_pre_attn_scalar**-0.5."""
    for attn in modules(model, Attention):
        assert attn.scale != attn.head_dim**-0.5
        attn.scale = attn.head_dim**-0.5


def silu_gate(model, monkeypatch):
    """GeGLU's gelu (tanh) gate computed as SwiGLU's silu."""
    modules(model, GeGLUMLP)
    monkeypatch.setattr(GeGLUMLP, "activation", lambda self, gate: F.silu(gate))


def set_on(cls: type, **values) -> SwitchOff:
    """Set attributes on every module of class `cls` (a router's norm_topk_prob, a scaling factor)."""

    def switch_off(model, monkeypatch):
        for module in modules(model, cls):
            for name, value in values.items():
                assert getattr(module, name) != value, (cls.__name__, name)
                setattr(module, name, value)

    return switch_off


def topk_before_softmax(model, monkeypatch):
    """A softmax-then-top-k router computed as top-k then softmax over the chosen k."""

    def forward(self, x):
        top_logits, top_indices = torch.topk(F.linear(x, self.weight), self.top_k, dim=-1)
        return torch.softmax(top_logits, dim=-1, dtype=torch.float32).to(x.dtype), top_indices

    modules(model, SoftmaxTopKRouter)
    monkeypatch.setattr(SoftmaxTopKRouter, "forward", forward)


def softmax_before_topk(model, monkeypatch):
    """A top-k-then-softmax router computed as softmax over all experts, then top-k (not renormalised)."""

    def forward(self, x):
        probs = torch.softmax(F.linear(x, self.weight, self.bias), dim=-1, dtype=torch.float32)
        top_weights, top_indices = torch.topk(probs, self.top_k, dim=-1)
        return top_weights.to(x.dtype), top_indices

    modules(model, TopKSoftmaxRouter)
    monkeypatch.setattr(TopKSoftmaxRouter, "forward", forward)


def zero_router_bias(model, monkeypatch):
    with torch.no_grad():
        for router in modules(model, TopKSoftmaxRouter):
            router.bias.zero_()


def no_score_correction_bias(model, monkeypatch):
    """Expert choice without e_score_correction_bias."""
    for router in modules(model, SigmoidGroupTopKRouter):
        assert router.e_score_correction_bias.abs().max() > 0
        router.e_score_correction_bias.zero_()


def no_shared_experts(model, monkeypatch):
    for moe in modules(model, SharedExpertsMoE):
        moe.shared_experts = Zero()


def no_shared_expert(model, monkeypatch):
    for moe in modules(model, SharedExpertMoE):
        moe.shared_expert = Zero()


def ungated_shared_expert(model, monkeypatch):
    """Qwen3.5's shared expert added without its sigmoid(shared_expert_gate(x)) scale."""

    def forward(self, x):
        top_weights, top_indices = self.gate(x)
        return self.experts(x, top_weights, top_indices) + self.shared_expert(x)

    modules(model, SharedExpertMoE)
    monkeypatch.setattr(SharedExpertMoE, "forward", forward)


def zero_expert_biases(model, monkeypatch):
    with torch.no_grad():
        for experts in modules(model, ClampedSwiGLUExperts):
            experts.gate_up_proj_bias.zero_()
            experts.down_proj_bias.zero_()


def swiglu_activation(activation: Callable) -> SwitchOff:
    """GPT-OSS experts with `activation(experts, gate_up [n, 2*hidden]) -> [n, hidden]`."""

    def switch_off(model, monkeypatch):
        modules(model, ClampedSwiGLUExperts)
        monkeypatch.setattr(ClampedSwiGLUExperts, "_activation", activation)

    return switch_off


def _unclamped(self, gate_up):
    gate, up = gate_up[:, 0::2], gate_up[:, 1::2]
    return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


def _without_up_offset(self, gate_up):
    gate = gate_up[:, 0::2].clamp(max=self.limit)
    up = gate_up[:, 1::2].clamp(min=-self.limit, max=self.limit)
    return up * (gate * torch.sigmoid(gate * self.alpha))


def _plain_silu(self, gate_up):
    gate = gate_up[:, 0::2].clamp(max=self.limit)
    up = gate_up[:, 1::2].clamp(min=-self.limit, max=self.limit)
    return (up + 1) * F.silu(gate)


def _gate_up_halves(self, gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    gate, up = gate.clamp(max=self.limit), up.clamp(min=-self.limit, max=self.limit)
    return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


def every_causal_key(model, monkeypatch):
    """Sparse attention without its indexer: every query reads all its causal keys."""
    modules(model, LightningIndexer)
    monkeypatch.setattr(LightningIndexer, "select", lambda self, q, k, weights, visible: visible)


def shared_layers_read_every_key(model, monkeypatch):
    """GLM-5's shared layers attend to all causal keys instead of reusing the selection before them."""
    from archon.causal_attention import causal_mask

    assert any(attn.indexer is None for attn in modules(model, SparseLatentAttention))
    select = SparseLatentAttention._select

    def select_unless_shared(self, x, q_latent, cos, sin, cu_seqlens, cache):
        if self.indexer is not None:
            return select(self, x, q_latent, cos, sin, cu_seqlens, cache)
        return [causal_mask(int(n), None, x.device) for n in cu_seqlens[1:] - cu_seqlens[:-1]]

    monkeypatch.setattr(SparseLatentAttention, "_select", select_unless_shared)


def indexer_key_not_normed(model, monkeypatch):
    """The indexer's keys without their LayerNorm (k_norm)."""
    for indexer in modules(model, LightningIndexer):
        indexer.k_norm = nn.Identity()


def indexer_heads_weighted_equally(model, monkeypatch):
    """The indexer's per-head score weights (weights_proj) all 1."""
    modules(model, LightningIndexer)
    forward = LightningIndexer.forward

    def equal_weights(self, x, *rest):
        q, k, _ = forward(self, x, *rest)
        return q, k, torch.ones(x.shape[0], self.n_heads)

    monkeypatch.setattr(LightningIndexer, "forward", equal_weights)


def qk_norm_per_head(model, monkeypatch):
    """OLMo's QK-norms over the whole q and k projections taken per head instead (same weights)."""

    def forward(self, x):
        head_dim = model.args.head_dim
        h = x.float().unflatten(-1, (-1, head_dim))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h.flatten(-2)).to(x.dtype)

    modules(model, ProjectionRMSNorm)
    monkeypatch.setattr(ProjectionRMSNorm, "forward", forward)


def no_post_norm(name: str) -> SwitchOff:
    """A layer without its norm `name` (a post norm: the block's output added to the residual as it
    is; Gemma's pre-feedforward norm: the MLP's input as it is)."""

    def switch_off(model, monkeypatch):
        for layer in model.layers:
            setattr(layer, name, nn.Identity())

    return switch_off


def rope_of_the_other_layer_type(model, monkeypatch):
    """Each layer gets the rotary tables of the other layer type (OLMo 3's RoPE per layer type)."""
    tables = model.rotary.by_layer_type
    assert set(tables) == {"full_attention", "sliding_attention"}
    tables["full_attention"], tables["sliding_attention"] = tables["sliding_attention"], tables["full_attention"]


def full_attention_rope_as_default(model, monkeypatch):
    """The full-attention layers' scaled RoPE (OLMo 3's YaRN, Gemma 3's linear) computed as default
    RoPE of the same theta (attention factor kept)."""
    rotary = model.rotary.by_layer_type["full_attention"]
    rope_parameters = model.args.rope_parameters["full_attention"]
    assert rope_parameters["rope_type"] != "default"
    default = {"rope_type": "default", "rope_theta": rope_parameters["rope_theta"]}
    inv_freq, _ = rope_inv_freq(default, rotary.rotary_dim, model.args.max_position_embeddings)
    rotary._inv_freq = {torch.device("cpu"): inv_freq}


def no_full_attention_rope_attention_factor(model, monkeypatch):
    rotary = model.rotary.by_layer_type["full_attention"]
    assert rotary.attention_scaling != 1.0
    rotary.attention_scaling = 1.0


def kda_decay_per_head(model, monkeypatch):
    """KDA's per-channel decay replaced by its mean over each head's channels (a per-head decay)."""
    per_channel = KimiForgetGate.forward

    def per_head(self, x):
        g = per_channel(self, x)
        return g.mean(dim=-1, keepdim=True).expand_as(g)

    modules(model, KimiForgetGate)
    monkeypatch.setattr(KimiForgetGate, "forward", per_head)


def kda_conv_identity(model, monkeypatch):
    """KDA's short causal convs pass each channel's current input through (silu still applied)."""
    with torch.no_grad():
        for mixer in modules(model, KimiDeltaAttention):
            for conv in (mixer.q_conv1d, mixer.k_conv1d, mixer.v_conv1d):
                conv.weight.zero_()
                conv.weight[..., -1] = 1.0


def kda_zero_dt_bias(model, monkeypatch):
    with torch.no_grad():
        for gate in modules(model, KimiForgetGate):
            gate.dt_bias.zero_()


def mla_with_rope(model, monkeypatch):
    """Kimi Linear's NoPE MLA given RoPE on its qk_rope_head_dim features, as DeepSeek-V3 has."""
    args = model.args
    model.rotary = RotaryEmbedding({"rope_type": "default", "rope_theta": 10000.0}, args.qk_rope_head_dim, 512)
    for attn in modules(model, MultiHeadLatentAttention):
        assert not attn.rotary
        attn.rotary = True


def correction_bias_in_weights(model, monkeypatch):
    """The chosen experts weighted by their biased scores (the bias is for the choice only)."""

    def biased(router, x):
        scores = torch.sigmoid(F.linear(x.float(), router.weight.float())) + router.e_score_correction_bias
        top_weights, top_indices = scores.topk(router.top_k, dim=-1)
        return top_weights / top_weights.sum(-1, keepdim=True), top_indices

    for router in modules(model, SigmoidGroupTopKRouter):
        assert router.norm_topk_prob and router.n_group == 1
        router.forward = lambda x, router=router: biased(router, x)


CASES = [
    # Llama: llama3-scaled RoPE, GQA, optional attention and MLP biases.
    Case("llama", "llama3-rope-as-default", plain_rope_frequencies),
    Case("llama", "llama3-smoothing", llama3_without_smoothing),
    Case("llama", "gqa-head-mapping", gqa_heads_tiled),
    Case("llama", "attention-bias", zero_biases("q_proj", "k_proj", "v_proj", "o_proj"), dict(attention_bias=True)),
    Case("llama", "mlp-bias", zero_biases("gate_proj", "up_proj", "down_proj"), dict(mlp_bias=True)),
    # Qwen2: q/k/v bias, a sliding window on layers from max_window_layers on.
    Case("qwen2", "qkv-bias", zero_biases("q_proj", "k_proj", "v_proj")),
    Case("qwen2", "sliding-window", no_sliding_window),
    Case("qwen2", "max-window-layers", window_on_every_layer),
    # Qwen3: QK-norm, per-layer windows as Qwen2, optional attention bias.
    Case("qwen3", "qk-norm", no_qk_norm),
    Case("qwen3", "sliding-window", no_sliding_window),
    Case("qwen3", "max-window-layers", window_on_every_layer),
    Case("qwen3", "attention-bias", zero_biases("q_proj", "k_proj", "v_proj", "o_proj"), dict(attention_bias=True)),
    # Qwen3-MoE: QK-norm, softmax-then-top-k routing, norm_topk_prob.
    Case("qwen3_moe", "qk-norm", no_qk_norm),
    Case("qwen3_moe", "norm-topk-prob", set_on(SoftmaxTopKRouter, norm_topk_prob=False)),
    # With the chosen k renormalised the two orders agree; without, they differ.
    Case("qwen3_moe", "softmax-then-topk", topk_before_softmax, dict(norm_topk_prob=False)),
    # GPT-OSS: sinks, alternating windows, YaRN, biased top-k-then-softmax router, clamped SwiGLU.
    Case("gpt_oss", "attention-sinks", no_attention_sinks),
    Case("gpt_oss", "sliding-window", no_sliding_window),
    Case("gpt_oss", "window-layer-pattern", window_on_every_layer),
    Case("gpt_oss", "yarn-rope-as-default", plain_rope_frequencies),
    Case("gpt_oss", "yarn-attention-factor", no_rope_attention_factor),
    Case("gpt_oss", "yarn-no-truncation", rope_frequencies_with(truncate=True)),
    Case("gpt_oss", "attention-bias", zero_biases("q_proj", "k_proj", "v_proj", "o_proj")),
    Case("gpt_oss", "router-bias", zero_router_bias),
    Case("gpt_oss", "topk-then-softmax", softmax_before_topk),
    Case("gpt_oss", "expert-biases", zero_expert_biases),
    # The registered tiny config's activations stay below its clamp limit of 7 (gate at most about
    # 4.7, |up| about 3.7), so only a lower limit reaches the clamp. The registered config keeps 7:
    # vLLM's GPT-OSS experts clamp at a fixed 7.0 whatever the config says.
    Case("gpt_oss", "swiglu-clamp", swiglu_activation(_unclamped), dict(swiglu_limit=1.0)),
    Case("gpt_oss", "swiglu-up-plus-one", swiglu_activation(_without_up_offset)),
    Case("gpt_oss", "swiglu-alpha", swiglu_activation(_plain_silu)),
    Case("gpt_oss", "interleaved-gate-up", swiglu_activation(_gate_up_halves)),
    # GLM-4.5: partial rotary, QK-norm, q/k/v bias, group-limited sigmoid routing with correction bias,
    # renormalised and scaled weights, shared experts.
    Case("glm4_moe", "partial-rotary", full_rotary),
    Case("glm4_moe", "qk-norm", no_qk_norm),
    Case("glm4_moe", "qkv-bias", zero_biases("q_proj", "k_proj", "v_proj")),
    Case("glm4_moe", "score-correction-bias", no_score_correction_bias),
    Case("glm4_moe", "group-limited-routing", set_on(SigmoidGroupTopKRouter, topk_group=2)),
    Case("glm4_moe", "norm-topk-prob", set_on(SigmoidGroupTopKRouter, norm_topk_prob=False)),
    Case("glm4_moe", "routed-scaling-factor", set_on(SigmoidGroupTopKRouter, routed_scaling_factor=1.0)),
    Case("glm4_moe", "shared-experts", no_shared_experts),
    # DeepSeek-V3: MLA (latent norms, interleaved YaRN RoPE, softmax mscale), routing as GLM-4.5.
    Case("deepseek_v3", "yarn-rope-as-default", plain_rope_frequencies),
    Case("deepseek_v3", "yarn-attention-factor", no_rope_attention_factor),
    Case("deepseek_v3", "yarn-softmax-mscale", no_yarn_softmax_mscale),
    Case("deepseek_v3", "rope-interleave", rope_not_interleaved),
    Case("deepseek_v3", "latent-norms", no_latent_norms),
    Case("deepseek_v3", "score-correction-bias", no_score_correction_bias),
    Case("deepseek_v3", "group-limited-routing", set_on(SigmoidGroupTopKRouter, topk_group=4)),
    Case("deepseek_v3", "norm-topk-prob", set_on(SigmoidGroupTopKRouter, norm_topk_prob=False)),
    Case("deepseek_v3", "routed-scaling-factor", set_on(SigmoidGroupTopKRouter, routed_scaling_factor=1.0)),
    Case("deepseek_v3", "shared-experts", no_shared_experts),
    # DeepSeek-V3.2: DeepSeek-V3's MLA and routing plus the indexer's top-k selection (half-split
    # indexer RoPE); GLM-5: the indexer's RoPE interleaved, a layer sharing the selection before it.
    Case("deepseek_v32", "indexer-top-k", every_causal_key),
    Case("deepseek_v32", "indexer-rope-half-split", set_on(LightningIndexer, interleaved=True)),
    Case("deepseek_v32", "indexer-key-norm", indexer_key_not_normed),
    Case("deepseek_v32", "indexer-head-weights", indexer_heads_weighted_equally),
    Case("deepseek_v32", "yarn-softmax-mscale", no_yarn_softmax_mscale),
    Case("deepseek_v32", "rope-interleave", rope_not_interleaved),
    Case("deepseek_v32", "latent-norms", no_latent_norms),
    Case("deepseek_v32", "score-correction-bias", no_score_correction_bias),
    Case("deepseek_v32", "shared-experts", no_shared_experts),
    Case("glm_moe_dsa", "indexer-top-k", every_causal_key),
    Case("glm_moe_dsa", "indexer-rope-interleaved", set_on(LightningIndexer, interleaved=False)),
    Case("glm_moe_dsa", "shared-layer-selection", shared_layers_read_every_key),
    # Qwen3.5 dense: zero-centred norms, gated attention (QK-norm, partial rotary, output gate),
    # gated DeltaNet (short conv, decay, write strength, L2-normed q/k, dt_bias, gated output norm).
    Case("qwen3_5_text", "norm-one-plus-weight", norm_without_offset),
    Case("qwen3_5_text", "attention-output-gate", no_output_gate),
    Case("qwen3_5_text", "qk-norm", no_qk_norm),
    Case("qwen3_5_text", "partial-rotary", full_rotary),
    Case("qwen3_5_text", "short-conv", conv_identity),
    Case("qwen3_5_text", "delta-rule-decay", delta_rule_with(_no_decay)),
    Case("qwen3_5_text", "delta-rule-beta", delta_rule_with(_full_write_strength)),
    Case("qwen3_5_text", "value-heads-per-key-head", value_heads_tiled),
    Case("qwen3_5_text", "qk-l2-norm", no_qk_l2_norm),
    Case("qwen3_5_text", "dt-bias", zero_dt_bias),
    Case("qwen3_5_text", "output-norm-gate", no_output_norm_gate),
    # Qwen3.5 MoE: renormalised softmax routing, the gated shared expert, zero-centred norms.
    Case("qwen3_5_moe_text", "norm-topk-prob", set_on(SoftmaxTopKRouter, norm_topk_prob=False)),
    Case("qwen3_5_moe_text", "shared-expert", no_shared_expert),
    Case("qwen3_5_moe_text", "shared-expert-gate", ungated_shared_expert),
    Case("qwen3_5_moe_text", "norm-one-plus-weight", norm_without_offset),
    # Qwen3-Next: the Qwen3.5 mixers with the DeltaNet's projections fused per key head (in_proj_qkvz,
    # in_proj_ba), its conv channels reordered on load, sparse layers with a gated shared expert
    # (softmax top-k renormalised by norm_topk_prob) beside a dense one; q/k/v/o bias when set.
    Case("qwen3_next", "norm-one-plus-weight", norm_without_offset),
    Case("qwen3_next", "attention-output-gate", no_output_gate),
    Case("qwen3_next", "qk-norm", no_qk_norm),
    Case("qwen3_next", "partial-rotary", full_rotary),
    Case(
        "qwen3_next", "attention-bias", zero_biases("q_proj", "k_proj", "v_proj", "o_proj"), dict(attention_bias=True)
    ),
    Case("qwen3_next", "fused-projections-per-key-head", fused_projections_read_flat),
    Case("qwen3_next", "conv-channel-order", conv_channels_in_hf_order),
    Case("qwen3_next", "short-conv", conv_identity),
    Case("qwen3_next", "delta-rule-decay", delta_rule_with(_no_decay)),
    Case("qwen3_next", "delta-rule-beta", delta_rule_with(_full_write_strength)),
    Case("qwen3_next", "value-heads-per-key-head", value_heads_tiled),
    Case("qwen3_next", "qk-l2-norm", no_qk_l2_norm),
    Case("qwen3_next", "dt-bias", zero_dt_bias),
    Case("qwen3_next", "output-norm-gate", no_output_norm_gate),
    Case("qwen3_next", "norm-topk-prob", set_on(SoftmaxTopKRouter, norm_topk_prob=False)),
    Case("qwen3_next", "shared-expert", no_shared_expert),
    Case("qwen3_next", "shared-expert-gate", ungated_shared_expert),
    # OLMo 3: post-norm layers, QK-norm over the whole projections, windows and RoPE per layer type
    # (YaRN on the full-attention layers), GQA; q/k/v/o biases when attention_bias is set.
    Case("olmo3", "qk-norm", no_qk_norm),
    Case("olmo3", "qk-norm-over-the-projection", qk_norm_per_head),
    Case("olmo3", "post-attention-norm", no_post_norm("post_attention_layernorm")),
    Case("olmo3", "post-feedforward-norm", no_post_norm("post_feedforward_layernorm")),
    Case("olmo3", "sliding-window", no_sliding_window),
    Case("olmo3", "window-per-layer", window_on_every_layer),
    Case("olmo3", "rope-per-layer-type", rope_of_the_other_layer_type),
    Case("olmo3", "yarn-rope-as-default", full_attention_rope_as_default),
    Case("olmo3", "yarn-attention-factor", no_full_attention_rope_attention_factor),
    Case("olmo3", "gqa", gqa_heads_tiled),
    Case("olmo3", "attention-bias", zero_biases("q_proj", "k_proj", "v_proj", "o_proj"), dict(attention_bias=True)),
    # OLMo 2: the same layers with every layer full attention and one (here YaRN) RoPE.
    Case("olmo2", "qk-norm-over-the-projection", qk_norm_per_head),
    Case("olmo2", "post-feedforward-norm", no_post_norm("post_feedforward_layernorm")),
    Case("olmo2", "yarn-rope-as-default", full_attention_rope_as_default),
    # MiniMax-M2: QK-norm over the whole projection, partial rotary, sigmoid routing with the correction
    # bias for the choice only, renormalised weights.
    Case("minimax_m2", "qk-norm", no_qk_norm),
    Case("minimax_m2", "qk-norm-over-whole-projection", qk_norm_per_head),
    Case("minimax_m2", "partial-rotary", full_rotary),
    Case("minimax_m2", "score-correction-bias", no_score_correction_bias),
    Case("minimax_m2", "correction-bias-for-choice-only", correction_bias_in_weights),
    Case("minimax_m2", "norm-topk-prob", set_on(SigmoidGroupTopKRouter, norm_topk_prob=False)),
    # Kimi Linear: KDA (per-channel decay, short convs, sigmoid-gated output norm) and NoPE MLA layers,
    # group-limited sigmoid routing with shared experts.
    Case("kimi_linear", "kda-per-channel-decay", kda_decay_per_head),
    Case("kimi_linear", "kda-decay", delta_rule_with(_no_decay, kimi_linear_model, KimiDeltaAttention)),
    Case("kimi_linear", "kda-dt-bias", kda_zero_dt_bias),
    Case("kimi_linear", "kda-beta", delta_rule_with(_full_write_strength, kimi_linear_model, KimiDeltaAttention)),
    Case("kimi_linear", "kda-short-conv", kda_conv_identity),
    Case("kimi_linear", "kda-output-norm-gate", no_output_norm_gate),
    Case("kimi_linear", "kda-sigmoid-output-gate", set_on(GatedRMSNorm, gate_activation=F.silu)),
    Case("kimi_linear", "mla-nope", mla_with_rope),
    Case("kimi_linear", "latent-norms", no_latent_norms),
    Case("kimi_linear", "score-correction-bias", no_score_correction_bias),
    Case("kimi_linear", "group-limited-routing", set_on(SigmoidGroupTopKRouter, topk_group=4)),
    Case("kimi_linear", "norm-topk-prob", set_on(SigmoidGroupTopKRouter, norm_topk_prob=False)),
    Case("kimi_linear", "routed-scaling-factor", set_on(SigmoidGroupTopKRouter, routed_scaling_factor=1.0)),
    Case("kimi_linear", "shared-experts", no_shared_experts),
    # Gemma 3: scaled embeddings, zero-centred sandwich norms, QK-norm, query_pre_attn_scalar, the GeGLU
    # gate, sliding layers, RoPE per layer type with scaling on the full layers, attention bias.
    Case("gemma3_text", "embedding-scale", no_embedding_scale),
    Case("gemma3_text", "norm-one-plus-weight", norm_without_offset),
    Case("gemma3_text", "post-attention-norm", no_post_norm("post_attention_layernorm")),
    Case("gemma3_text", "pre-feedforward-norm", no_post_norm("pre_feedforward_layernorm")),
    Case("gemma3_text", "post-feedforward-norm", no_post_norm("post_feedforward_layernorm")),
    Case("gemma3_text", "qk-norm", no_qk_norm),
    Case("gemma3_text", "query-pre-attn-scalar", head_dim_softmax_scale),
    Case("gemma3_text", "gelu-tanh-gate", silu_gate),
    Case("gemma3_text", "sliding-window", no_sliding_window),
    Case("gemma3_text", "window-layer-pattern", window_on_every_layer),
    Case("gemma3_text", "rope-per-layer-type", rope_of_the_other_layer_type),
    Case("gemma3_text", "linear-rope-as-default", full_attention_rope_as_default),
    Case(
        "gemma3_text", "attention-bias", zero_biases("q_proj", "k_proj", "v_proj", "o_proj"), dict(attention_bias=True)
    ),
]


# Each (type, overrides) the cases check, once: the gate passes it unmutated, so a failure above is the
# mutation's.
CONFIGS = {
    "-".join([case.model_type, *(f"{k}={v}" for k, v in case.overrides.items())]): (case.model_type, case.overrides)
    for case in CASES
}


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_gate_passes_without_mutation(config):
    model_type, overrides = CONFIGS[config]
    assert_aligned(model_type, overrides, lora_rank=None, seq_lens=SEQ_LENS)


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_gate_fails_with_feature_switched_off(case: Case, monkeypatch):
    build_model = align.build_model

    def build_and_switch_off(*args, **kwargs):
        loaded = build_model(*args, **kwargs)
        case.switch_off(loaded.model, monkeypatch)
        return loaded

    monkeypatch.setattr(align, "build_model", build_and_switch_off)
    report = assert_gate_fails(case.model_type, case.overrides, seq_lens=SEQ_LENS)
    print(f"{case.id}: max |dlogits| {report['max_abs_logits_diff']:.3e}")
