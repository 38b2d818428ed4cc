"""FSDP2, tensor and expert parallelism (gloo, CPU) against a single process, plus configuration errors.

The multi-process tests launch tests/parallel_worker.py under torchrun once per world size and
compare what it measured with the same measurements made here in one process.
"""

from __future__ import annotations

import json

import parallel_cases as cases
import pytest
import torch
from safetensors.torch import load_file

from archon.checkpoint.hf import HFCheckpoint
from archon.lora import LoRAConfig
from archon.parallel import ParallelConfig, ParallelDims, apply_tp_plan, colwise
from archon.trainer import Trainer

MODEL_TYPES = ("qwen3", "qwen3_moe")
TOL = 1e-5


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from archon.tools.align import make_tiny_hf_checkpoint

    root = tmp_path_factory.mktemp("parallel")
    return {t: make_tiny_hf_checkpoint(t, root / t, seed=0) for t in MODEL_TYPES}


@pytest.fixture(scope="module")
def single_process(checkpoints, tmp_path_factory):
    out = {}
    for model_type, path in checkpoints.items():
        vocab = HFCheckpoint(path).shape("model.embed_tokens.weight")[0]
        export_dir = tmp_path_factory.mktemp("single") / model_type
        result = cases.run_case(Trainer(cases.engine_config(path)), vocab, export_dir=export_dir)
        result["export_dir"] = str(export_dir)
        out[model_type] = result
    return out


def _run_layouts(checkpoints, tmp_path_factory, nproc, layouts):
    out = tmp_path_factory.mktemp(f"world{nproc}") / "results.pt"
    ckpts = [f"{t}={p}" for t, p in checkpoints.items()]
    cases.launch(nproc, "parity", "--out", str(out), "--layouts", *layouts, "--ckpt", *ckpts)
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def two_process(checkpoints, tmp_path_factory):
    return _run_layouts(checkpoints, tmp_path_factory, 2, ["fsdp2", "tp2"])


@pytest.fixture(scope="module")
def four_process(checkpoints, tmp_path_factory):
    return _run_layouts(checkpoints, tmp_path_factory, 4, ["fsdp2_tp2", "hsdp2x2"])


def check_first_step(result, reference):
    """What one step computes: log-probs, entropies, reference log-probs, the loss, the LoRA gradients
    and their norm."""
    for key in ("logprobs", "entropy", "ref_logprobs"):
        torch.testing.assert_close(result[key], reference[key], atol=TOL, rtol=0, msg=key)
    assert result["first_loss"] == pytest.approx(reference["first_loss"], abs=TOL)
    assert result["grads"].keys() == reference["grads"].keys()
    for name, ref in reference["grads"].items():
        scale = ref.abs().max().item()
        assert scale > 0, f"reference gradient of {name} is zero: the comparison would be empty"
        err = (result["grads"][name] - ref).abs().max().item() / scale
        assert err <= TOL, f"LoRA gradient {name}: relative error {err:.2e}"
    assert result["grad_norms"][0] == pytest.approx(reference["grad_norms"][0], rel=TOL)


def _check_against_single_process(result, reference, curve_tol=TOL):
    """The first step, then the curve. curve_tol: the absolute tolerance of the losses after the first
    update (the later gradient norms get 10x it, relative)."""
    check_first_step(result, reference)
    assert result["losses"] == pytest.approx(reference["losses"], abs=curve_tol)
    # Later norms (clipped with max_grad_norm=0.5, so they steer the updates) follow the parameters'
    # 1e-7-level differences and are reported, not the contract: compare them loosely.
    assert result["grad_norms"] == pytest.approx(reference["grad_norms"], rel=10 * curve_tol)


def _check_export(result, reference):
    assert reference["adapter_reloaded"] and result["adapter_reloaded"], "load_peft_adapter did not restore the factors"
    got = load_file(f"{result['export_dir']}/adapter_model.safetensors")
    want = load_file(f"{reference['export_dir']}/adapter_model.safetensors")
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key
    configs = [json.loads(open(f"{r['export_dir']}/adapter_config.json").read()) for r in (result, reference)]
    assert configs[0] == configs[1]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp2", "tp2"])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_two_process_matches_single_process(two_process, single_process, model_type, layout):
    _check_against_single_process(two_process[(model_type, layout)], single_process[model_type])


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp2", "tp2"])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_sharded_peft_export_equals_single_process(two_process, single_process, model_type, layout):
    _check_export(two_process[(model_type, layout)], single_process[model_type])


@pytest.mark.slow
def test_fsdp_full_parameter_training_matches_single_process(two_process, checkpoints):
    reference = cases.run_full_finetune(checkpoints["qwen3"], 256)
    assert two_process[("qwen3", "fsdp2")]["full_ft_losses"] == pytest.approx(reference, abs=TOL)
    assert reference[-1] < reference[0]


@pytest.mark.slow
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_fsdp_ranks_read_only_their_shards(two_process, model_type):
    result = two_process[(model_type, "fsdp2")]
    # Each rank reads its half of every sharded tensor (dense weights and stacked experts alike).
    assert all(n <= 0.55 * result["checkpoint_elements"] for n in result["read_elements"]), result["read_elements"]
    # Uneven micro-batch counts across data-parallel ranks were kept in step.
    assert result["micro_batches"] == 3


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp2_tp2", "hsdp2x2"])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_four_process_matches_single_process(four_process, single_process, model_type, layout):
    """FSDP x TP (2 x 2), and HSDP (2 replicas of a 2-way sharded model)."""
    result = four_process[(model_type, layout)]
    _check_against_single_process(result, single_process[model_type])
    _check_export(result, single_process[model_type])
    assert all(n <= 0.55 * result["checkpoint_elements"] for n in result["read_elements"])


# ---- expert parallelism ---------------------------------------------------------------------------

EP_MODEL_TYPES = ("qwen3_moe", "glm4_moe", "deepseek_v3", "gpt_oss", "minimax_m2")


@pytest.fixture(scope="module")
def ep_checkpoints(checkpoints, tmp_path_factory):
    from archon.tools.align import make_tiny_hf_checkpoint

    root = tmp_path_factory.mktemp("expert_parallel")
    return {t: checkpoints.get(t) or make_tiny_hf_checkpoint(t, root / t, seed=0) for t in EP_MODEL_TYPES}


@pytest.fixture(scope="module")
def ep_single_process(ep_checkpoints, tmp_path_factory):
    out = {}
    for model_type, path in ep_checkpoints.items():
        vocab = HFCheckpoint(path).shape("model.embed_tokens.weight")[0]
        export_dir = tmp_path_factory.mktemp("ep_single") / model_type
        trainer = Trainer(cases.engine_config(path))
        result = cases.run_case(trainer, vocab, export_dir=export_dir, merged=True, generate=True)
        result["export_dir"] = str(export_dir)
        out[model_type] = result
    return out


@pytest.fixture(scope="module")
def ep_two_process(ep_checkpoints, tmp_path_factory):
    return _run_layouts(ep_checkpoints, tmp_path_factory, 2, ["ep2"])


@pytest.fixture(scope="module")
def ep_four_process(ep_checkpoints, tmp_path_factory):
    return _run_layouts(ep_checkpoints, tmp_path_factory, 4, ["ep2_fsdp2", "ep2_tp2"])


def _check_merged_payload(result, reference):
    assert result["merged"].keys() == reference["merged"].keys()
    assert any(".experts." in key for key in reference["merged"])
    for key, want in reference["merged"].items():
        torch.testing.assert_close(result["merged"][key], want, atol=1e-6, rtol=0, msg=key)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", EP_MODEL_TYPES)
def test_expert_parallel_matches_single_process(ep_two_process, ep_four_process, ep_single_process, model_type):
    """EP x2 (experts split over the 2 FSDP ranks), EP x2 x FSDP x2 (world 4: experts split over 2
    ranks and replicated over the other 2) and EP x2 x TP x2: log-probs, loss, LoRA gradients
    (expert factors gathered from their shards), PEFT export, merged sync payload and the native
    engine's completions; and EP x2 computing in bf16."""
    reference = ep_single_process[model_type]
    for results, layout in ((ep_two_process, "ep2"), (ep_four_process, "ep2_fsdp2"), (ep_four_process, "ep2_tp2")):
        result = results[(model_type, layout)]
        assert any(".experts." in name for name in result["grads"]), "no expert LoRA gradient compared"
        # Under TP, DeepSeek's losses after 3 clipped updates drift up to ~2e-5 and its gradient norms
        # 1.1e-4 (the log-probs, first loss and gradients keep 1e-5).
        _check_against_single_process(result, reference, curve_tol=1e-4 if "tp" in layout else TOL)
        _check_export(result, reference)
        _check_merged_payload(result, reference)
        # Only the first data-parallel rank had prompts: the others ran its forwards (and their
        # all-to-alls) in step with it.
        assert result["generated"] == reference["generated"]
    # bf16 compute (parallel.param_dtype) reaches the expert-parallel experts as FSDP2 gives it to
    # every other parameter. The expert LoRA stays in fp32 under EP (FSDP2 casts it to bf16 without),
    # hence the bf16-sized tolerance on the log-probs.
    mixed = ep_two_process[(model_type, "ep2")]["mixed_precision"]
    torch.testing.assert_close(mixed["ep2"]["logprobs"], mixed["fsdp2"]["logprobs"], atol=0.1, rtol=0)
    assert mixed["ep2"]["first_loss"] == pytest.approx(mixed["fsdp2"]["first_loss"], abs=1e-4)


@pytest.mark.slow
def test_checkpoints_move_between_expert_parallel_and_other_layouts(ep_checkpoints, tmp_path):
    """An EP=2 checkpoint resumes under FSDP (EP=1) and in one process, and an EP=1 checkpoint under
    EP=2, each continuing with the losses of the uninterrupted run."""
    from archon.checkpoint.resume import CheckpointManager

    model_types = ("qwen3_moe", "gpt_oss")
    cases.launch(2, "reshard", "--out", str(tmp_path), "--layouts", "ep2", "fsdp2",
                 "--ckpt", *[f"{t}={ep_checkpoints[t]}" for t in model_types])  # fmt: skip
    results = torch.load(tmp_path / "reshard.pt")

    def check(got, want):  # [(loss, grad norm)] per step
        for (loss, norm), (want_loss, want_norm) in zip(got, want, strict=True):
            assert loss == pytest.approx(want_loss, abs=TOL) and norm == pytest.approx(want_norm, rel=1e-4)

    for model_type in model_types:
        uninterrupted = results[(model_type, "ep2")]
        check(results[(model_type, "fsdp2")], uninterrupted)
        check(results[(model_type, "ep2", "fsdp2")], uninterrupted)
        check(results[(model_type, "fsdp2", "ep2")], uninterrupted)

        path = ep_checkpoints[model_type]
        vocab = HFCheckpoint(path).shape("model.embed_tokens.weight")[0]

        def last_two_steps(trainer):
            metrics = [trainer.train_step(_reshard_batch(trainer, vocab, step), cases.loss_fn, with_entropy=True)
                       for step in (2, 3)]  # fmt: skip
            return [(m["loss"], m["grad_norm"]) for m in metrics]

        resumed = Trainer(cases.engine_config(path))
        resumed.load_checkpoint(CheckpointManager(tmp_path / f"{model_type}-ep2", keep_last=1))
        check(last_two_steps(resumed), uninterrupted)
        # Without the checkpoint the same steps give other gradients: the comparisons have teeth.
        fresh = last_two_steps(Trainer(cases.engine_config(path)))
        assert abs(fresh[0][1] / uninterrupted[0][1] - 1) > 1e-2


def _reshard_batch(trainer, vocab, step):
    """The worker's resume_batch in one process: the step's whole batch, on-policy old log-probs."""
    batch = cases.make_batch(vocab, seed=100 + step)
    batch.old_logprobs = trainer.logprobs(batch).logprobs
    return batch


# ---- several tasks (multi-LoRA) -------------------------------------------------------------------


@pytest.fixture(scope="module")
def multi_task_single_process(checkpoints, tmp_path_factory):
    out = {}
    for model_type, path in checkpoints.items():
        vocab = HFCheckpoint(path).shape("model.embed_tokens.weight")[0]
        export_dir = tmp_path_factory.mktemp("multi_task_single") / model_type
        out[model_type] = cases.run_multi_task_case(path, vocab, export_dir=export_dir)
        out[model_type]["export_dir"] = str(export_dir)
    return out


@pytest.fixture(scope="module")
def multi_task_two_process(checkpoints, tmp_path_factory):
    out = tmp_path_factory.mktemp("multi_task") / "results.pt"
    ckpts = [f"{t}={p}" for t, p in checkpoints.items()]
    cases.launch(2, "multi_task", "--out", str(out), "--layouts", *cases.MULTI_TASK_LAYOUTS, "--ckpt", *ckpts)
    return torch.load(out, weights_only=False)


MULTI_TASK_CASES = [("qwen3", "fsdp2"), ("qwen3", "tp2"), ("qwen3_moe", "fsdp2"), ("qwen3_moe", "tp2"),
                    ("qwen3_moe", "ep2")]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("model_type, layout", MULTI_TASK_CASES)
def test_multi_task_model_matches_single_process(multi_task_two_process, multi_task_single_process, model_type, layout):
    """Two tasks of other ranks and targets, their sequences mixed in one packed batch, on 2 ranks:
    per-token log-probs (adapters on, off, and one task's view), each task's LoRA gradients
    (gathered from the shards), and the native engine's greedy mixed generation before and after the
    adapters change (the first data-parallel rank generates, the other keeps in step)."""
    result, reference = multi_task_two_process[(model_type, layout)], multi_task_single_process[model_type]
    for key in ("logprobs", "ref_logprobs", "view_b_logprobs"):
        torch.testing.assert_close(result[key], reference[key], atol=TOL, rtol=0, msg=key)
    assert not torch.allclose(reference["logprobs"], reference["ref_logprobs"], atol=1e-3)
    assert result["grads"].keys() == reference["grads"].keys() == set(cases.MULTI_TASK_LORAS)
    for task, grads in reference["grads"].items():
        assert result["grads"][task].keys() == grads.keys()
        for name, ref in grads.items():
            scale = ref.abs().max().item()
            assert scale > 0, f"reference gradient of {task}: {name} is zero: the comparison would be empty"
            err = (result["grads"][task][name] - ref).abs().max().item() / scale
            assert err <= TOL, f"task {task}: LoRA gradient {name}: relative error {err:.2e}"
    if model_type == "qwen3_moe":
        assert any(".experts." in name for name in reference["grads"]["a"]), "no expert LoRA gradient compared"
    assert result["generated"] == reference["generated"]
    assert result["generated_after_change"] == reference["generated_after_change"]
    assert reference["generated_after_change"] != reference["generated"]


@pytest.mark.slow
@pytest.mark.parametrize("model_type, layout", MULTI_TASK_CASES)
def test_multi_task_peft_export_equals_single_process(multi_task_two_process, multi_task_single_process,
                                                      model_type, layout):  # fmt: skip
    """Each task's adapter, exported through its task_view from the shards, is the one-process export."""
    result, reference = multi_task_two_process[(model_type, layout)], multi_task_single_process[model_type]
    for task in cases.MULTI_TASK_LORAS:
        got = load_file(f"{result['export_dir']}/{task}/adapter_model.safetensors")
        want = load_file(f"{reference['export_dir']}/{task}/adapter_model.safetensors")
        assert got.keys() == want.keys() and want
        for key in want:
            assert torch.equal(got[key], want[key]), (task, key)
        configs = [json.loads(open(f"{r['export_dir']}/{task}/adapter_config.json").read()) for r in (result, reference)]
        assert configs[0] == configs[1]


def test_multi_task_model_refuses_compile_and_dropout_under_tp(checkpoints):
    from archon.build import build_model

    with pytest.raises(ValueError, match=r"parallel.compile=True: a multi-task"):
        build_model(checkpoints["qwen3"], task_loras=cases.MULTI_TASK_LORAS, dims=ParallelDims(world_size=1),
                    parallel=ParallelConfig(compile=True))  # fmt: skip
    dropping = {"a": cases.MULTI_TASK_LORAS["a"], "b": LoRAConfig(rank=2, dropout=0.1)}
    with pytest.raises(ValueError, match=r"task\(s\) \['b'\]: lora.dropout > 0 with tp=2"):
        build_model(checkpoints["qwen3"], task_loras=dropping, dims=ParallelDims(world_size=2, dp_shard=1, tp=2),
                    parallel=ParallelConfig(tp=2))  # fmt: skip


# ---- configuration errors -------------------------------------------------------------------------


@pytest.mark.slow
def test_a_non_finite_loss_on_one_rank_is_skipped_on_every_rank(checkpoints, tmp_path):
    out = tmp_path / "skip.pt"
    cases.launch(2, "skip", "--out", str(out), "--ckpt", f"qwen3={checkpoints['qwen3']}", "--layouts", "fsdp2", "tp2")
    results = torch.load(out)
    for layout in ("fsdp2", "tp2"):
        for rank, result in enumerate(results[layout]):
            assert result == {"skipped": [1.0, 0.0], "unchanged": True, "optimizer_steps": 2}, (layout, rank)


def test_degrees_must_multiply_to_world_size():
    with pytest.raises(ValueError, match=r"dp_replicate=1 x dp_shard=2 x cp=1 x tp=2 = 4, but the world size is 8"):
        ParallelDims(world_size=8, dp_shard=2, tp=2)
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by dp_replicate\*cp\*tp = 1\*1\*4"):
        ParallelDims(world_size=6, tp=4)
    with pytest.raises(ValueError, match="tp=0"):
        ParallelDims(world_size=2, tp=0)
    with pytest.raises(ValueError, match=r"ep=2 does not divide dp_shard=1"):
        ParallelDims(world_size=2, tp=2, ep=2)
    with pytest.raises(ValueError, match=r"ep=0"):
        ParallelDims(world_size=2, ep=0)
    ep = ParallelDims(world_size=8, dp_replicate=2, tp=2, ep=2)
    assert (ep.dp_shard, ep.dp_shard_mod_ep, ep.dp, ep.ep_enabled) == (2, 1, 4, True)
    dims = ParallelDims(world_size=8, dp_replicate=2, tp=2)
    assert (dims.dp_shard, dims.dp, dims.fsdp_enabled, dims.tp_enabled) == (2, 4, True, True)
    single = ParallelDims(world_size=1)
    assert (single.dp_shard, single.mesh, single.fsdp_enabled) == (1, None, False)


def test_tp_degree_must_divide_heads(checkpoints):
    from archon.build import load_hf_config
    from archon.spec import get_spec

    config = load_hf_config(checkpoints["qwen3"])
    spec = get_spec("qwen3")
    args = spec.args_cls.from_hf_config(config)
    with torch.device("meta"):
        model = spec.model_cls(args, None)
    dims = ParallelDims(world_size=3, dp_shard=1, tp=3)  # its mesh is never built
    with pytest.raises(ValueError, match=r"tp=3 does not divide num_attention_heads=4, num_key_value_heads=2"):
        spec.parallelize_fn(model, dims, ParallelConfig(tp=3))


@pytest.mark.parametrize("model_type, message", [
    ("qwen3_moe", r"ep=3 does not divide num_experts=8 of this qwen3 model"),
    ("qwen3", r"ep=3 requested but this qwen3 model has no routed experts"),
])  # fmt: skip
def test_ep_degree_must_divide_the_experts(checkpoints, model_type, message):
    from archon.build import load_hf_config
    from archon.spec import get_spec

    spec = get_spec(model_type)
    args = spec.args_cls.from_hf_config(load_hf_config(checkpoints[model_type]))
    with torch.device("meta"):
        model = spec.model_cls(args, None)
    dims = ParallelDims(world_size=3, dp_shard=3, ep=3)  # its mesh is never built
    with pytest.raises(ValueError, match=message):
        spec.parallelize_fn(model, dims, ParallelConfig(ep=3))


def test_tp_plan_entry_must_name_a_module():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(KeyError, match="'1.q_proj' matches no submodule"):
        apply_tp_plan(model, None, {"1.q_proj": colwise()})


def test_activation_checkpoint_mode_is_checked():
    from archon.parallel import checkpoint_module

    with pytest.raises(ValueError, match="activation_checkpoint='some'"):
        checkpoint_module(torch.nn.Linear(2, 2), "some")


@pytest.mark.parametrize("mode, model_type", [("full", "qwen3_moe"), ("selective", "qwen3")])
def test_activation_checkpointing_keeps_names_and_gradients(checkpoints, mode, model_type):
    from archon.build import build_model
    from archon.lora import LoRAConfig

    batch = cases.make_batch(256)
    grads = {}
    for ac in ("none", mode):
        loaded = build_model(
            checkpoints[model_type], lora=LoRAConfig(rank=4), parallel=ParallelConfig(activation_checkpoint=ac),
            dims=ParallelDims(world_size=1),
        )  # fmt: skip
        with torch.no_grad():
            for name, p in loaded.model.named_parameters():
                if "lora_b" in name:
                    p.normal_(0, 0.1, generator=torch.Generator().manual_seed(0))
        hidden = loaded.model(batch.tokens, batch.positions, batch.cu_seqlens, batch.max_seqlen, return_hidden=True)
        hidden.pow(2).mean().backward()
        grads[ac] = {n: p.grad for n, p in loaded.model.named_parameters() if p.grad is not None}
    assert grads[mode].keys() == grads["none"].keys() and len(grads["none"]) > 0
    for name, g in grads["none"].items():
        assert torch.equal(grads[mode][name], g), name


@pytest.mark.slow
def test_compiled_blocks_match_eager(checkpoints):
    engines = [
        Trainer(cases.engine_config(checkpoints["qwen3"], ParallelConfig(compile=compile, compile_backend="aot_eager"),
                                   micro_batch_tokens=10_000))  # one shape to compile for
        for compile in (False, True)
    ]
    batch = cases.make_batch(256)
    eager, compiled = (e.logprobs(batch).logprobs for e in engines)
    torch.testing.assert_close(compiled, eager, atol=TOL, rtol=0)
