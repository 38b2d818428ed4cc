"""FSDP2, tensor and expert parallelism (gloo, CPU) against a single process, plus configuration errors.

The multi-process tests launch tests/parallel_worker.py under torchrun once per world size and
compare what it measured with the same measurements made here in one process. Both sides compute in
float64 (cases.EQUALITY_DTYPE) inside fp32_islands_in_fp64, so the comparisons hold to TOL on any
CPU; a float32 run of the fsdp2 layout and the bf16 mixed-precision runs keep the production and the
low-precision arithmetic tested, to tolerances derived from measured floors.
"""

from __future__ import annotations

import json

import parallel_cases as cases
import pytest
import torch
from helpers import assert_close_reporting
from safetensors.torch import load_file

from archon.checkpoint.hf import HFCheckpoint
from archon.lora import LoRAConfig
from archon.parallel import ParallelConfig, ParallelDims, apply_tp_plan, colwise
from archon.precision import fp32_islands_in_fp64
from archon.trainer import Trainer

MODEL_TYPES = ("qwen3", "qwen3_moe")
TOL = 1e-10  # float64 against float64
# The losses and gradient norms of the steps after the first update carry the float64 rounding as
# three clipped updates amplify it: measured at most 2.6e-11 (Qwen3.5 under cp2, ATEN_CPU_CAPABILITY
# avx2; 1.1e-11 native AVX512, 3.3e-12 default), where the first step stays under 1e-13.
CURVE_TOL = 1e-9
# A float32 fsdp2 run against one float32 process (the first step): each lies within the fp32-vs-fp64
# floor of its float64 twin, measured on this case as the largest distance over log-probs, entropies,
# the loss, the gradients (relative to their largest value) and their norm: 4.3e-6 (qwen3's first
# gradient norm under ATEN_CPU_CAPABILITY=default; 3.1e-6 avx2, 2.8e-6 native AVX512).
FP32_TOL = 4.3e-6 * 5  # measured fp32-vs-fp64 floor 4.3e-6 (2026-12-06) x 5


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
        with fp32_islands_in_fp64():
            trainer = Trainer(cases.engine_config(path, dtype=cases.EQUALITY_DTYPE))
            result = cases.run_case(trainer, vocab, export_dir=export_dir)
        result["export_dir"] = str(export_dir)
        result["float32"] = cases.run_case(Trainer(cases.engine_config(path)), vocab)
        out[model_type] = result
    return out


def _ckpt_args(checkpoints, model_types=None) -> list[str]:
    return [f"{t}={p}" for t, p in checkpoints.items() if model_types is None or t in model_types]


RESHARD_MODEL_TYPES = ("qwen3_moe", "gpt_oss")


@pytest.fixture(scope="module")
def two_rank_runs(checkpoints, ep_checkpoints, tmp_path_factory) -> dict:
    """Every 2-rank scenario of this module, run one after the other in one torchrun launch: the
    parity layouts (dense and MoE, then expert parallelism), the two-task model, the skipped
    non-finite step and the checkpoints moved between layouts. Returns each scenario's output path."""
    root = tmp_path_factory.mktemp("world2")
    out = {name: root / name for name in ("parity", "expert_parallel", "multi_task", "reshard")}
    for directory in out.values():
        directory.mkdir()
    out["skip"] = root / "skip.pt"
    jobs = [
        ["parity", "--out", str(out["parity"] / "results.pt"), "--layouts", "fsdp2", "tp2"],
        ["parity", "--out", str(out["expert_parallel"] / "results.pt"), "--layouts", "ep2"],
        ["multi_task", "--out", str(out["multi_task"] / "results.pt"), "--layouts", *cases.MULTI_TASK_LAYOUTS],
        ["skip", "--out", str(out["skip"]), "--layouts", "fsdp2", "tp2"],
        ["reshard", "--out", str(out["reshard"]), "--layouts", "ep2", "fsdp2"],
    ]
    ckpts = [
        _ckpt_args(checkpoints),
        _ckpt_args(ep_checkpoints),
        _ckpt_args(checkpoints),
        _ckpt_args(checkpoints, ("qwen3",)),
        _ckpt_args(ep_checkpoints, RESHARD_MODEL_TYPES),
    ]
    cases.launch_jobs(2, [[*job, "--ckpt", *ckpt] for job, ckpt in zip(jobs, ckpts)])
    return out


@pytest.fixture(scope="module")
def four_rank_runs(checkpoints, ep_checkpoints, tmp_path_factory) -> dict:
    """The 4-rank parity layouts, dense and MoE then expert-parallel, in one torchrun launch."""
    root = tmp_path_factory.mktemp("world4")
    out = {"parity": root / "parity", "expert_parallel": root / "expert_parallel"}
    for directory in out.values():
        directory.mkdir()
    jobs = [
        ["parity", "--out", str(out["parity"] / "results.pt"), "--layouts", "fsdp2_tp2", "hsdp2x2"],
        ["parity", "--out", str(out["expert_parallel"] / "results.pt"), "--layouts", "ep2_fsdp2", "ep2_tp2"],
    ]
    ckpts = [_ckpt_args(checkpoints), _ckpt_args(ep_checkpoints)]
    cases.launch_jobs(4, [[*job, "--ckpt", *ckpt] for job, ckpt in zip(jobs, ckpts)])
    return out


@pytest.fixture(scope="module")
def two_process(two_rank_runs):
    return torch.load(two_rank_runs["parity"] / "results.pt", weights_only=False)


@pytest.fixture(scope="module")
def four_process(four_rank_runs):
    return torch.load(four_rank_runs["parity"] / "results.pt", weights_only=False)


def check_first_step(result, reference, where: str, tol: float = TOL):
    """What one step computes: log-probs, entropies, reference log-probs, the loss, the LoRA gradients
    (relative to their largest value) and their norm. `where`: the model type and layout."""
    for key in ("logprobs", "entropy", "ref_logprobs"):
        assert_close_reporting(result[key], reference[key], tol, f"{where}: {key}")
    assert_close_reporting(result["first_loss"], reference["first_loss"], tol, f"{where}: first loss")
    cases.assert_gradients_close_reporting(result["grads"], reference["grads"], tol, f"{where}: first step")
    assert_close_reporting(result["grad_norms"][0], reference["grad_norms"][0], tol, f"{where}: first gradient norm")


def _check_against_single_process(result, reference, where: str):
    """The first step, then the curve: the losses and the gradient norms (clipped with
    max_grad_norm=0.5, so they steer the updates) of the steps after the first update."""
    check_first_step(result, reference, where)
    assert_close_reporting(result["losses"], reference["losses"], CURVE_TOL, f"{where}: losses")
    assert_close_reporting(result["grad_norms"], reference["grad_norms"], CURVE_TOL, f"{where}: gradient norms")


def check_exported_adapter(got_dir, want_dir, where: str):
    """The adapter exported from the shards is the one-process export, bit for bit, in float64: its
    factors were drawn in float64 (cases.set_lora_values in_factor_dtype), so an export that
    passed them through float32 would change them."""
    got = load_file(f"{got_dir}/adapter_model.safetensors")
    want = load_file(f"{want_dir}/adapter_model.safetensors")
    only_one_side = sorted(got.keys() ^ want.keys())
    assert want and not only_one_side, f"{where}: adapter keys on one side only: {only_one_side}"
    for key in want:
        assert want[key].dtype == torch.float64, f"{where}: the one-process export wrote {key} as {want[key].dtype}"
        assert_close_reporting(got[key], want[key], 0.0, f"{where}: exported {key}")
    assert any(not torch.equal(t, t.to(torch.float32).to(torch.float64)) for t in want.values()), (
        f"{where}: the exported factors are float32 values: a float32 round trip would go unnoticed"
    )
    configs = [json.loads(open(f"{d}/adapter_config.json").read()) for d in (got_dir, want_dir)]
    assert configs[0] == configs[1], f"{where}: adapter_config.json {configs[0]} != {configs[1]}"


def _check_export(result, reference, where: str):
    reloaded = reference["adapter_reloaded"] and result["adapter_reloaded"]
    assert reloaded, f"{where}: load_peft_adapter did not restore the factors"
    check_exported_adapter(result["export_dir"], reference["export_dir"], where)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp2", "tp2"])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_two_process_matches_single_process(two_process, single_process, model_type, layout):
    result, reference = two_process[(model_type, layout)], single_process[model_type]
    _check_against_single_process(result, reference, f"{model_type} {layout}")


@pytest.mark.slow
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_float32_fsdp_matches_single_process_to_float32_rounding(two_process, single_process, model_type):
    """The production dtype under FSDP2 (its fp32 gradient reduce, the grouped expert GEMMs that
    float64 runs do without): the first step agrees with one float32 process to float32 rounding."""
    result, reference = two_process[(model_type, "fsdp2")]["float32"], single_process[model_type]["float32"]
    assert result["logprobs"].dtype == torch.float32
    check_first_step(result, reference, f"{model_type} fsdp2 in float32", tol=FP32_TOL)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp2", "tp2"])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_sharded_peft_export_equals_single_process(two_process, single_process, model_type, layout):
    _check_export(two_process[(model_type, layout)], single_process[model_type], f"{model_type} {layout}")


@pytest.mark.slow
def test_fsdp_full_parameter_training_matches_single_process(two_process, checkpoints):
    with fp32_islands_in_fp64():
        reference = cases.run_full_finetune(checkpoints["qwen3"], 256, dtype=cases.EQUALITY_DTYPE)
    got = two_process[("qwen3", "fsdp2")]["full_ft_losses"]
    assert_close_reporting(got, reference, TOL, "qwen3 fsdp2: full-parameter training losses")
    assert reference[-1] < reference[0], f"full-parameter training did not lower the loss: {reference}"


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
    _check_against_single_process(result, single_process[model_type], f"{model_type} {layout}")
    _check_export(result, single_process[model_type], f"{model_type} {layout}")
    assert all(n <= 0.55 * result["checkpoint_elements"] for n in result["read_elements"])


# ---- expert parallelism ---------------------------------------------------------------------------

EP_MODEL_TYPES = ("qwen3_moe", "glm4_moe", "deepseek_v3", "gpt_oss", "minimax_m2")
# bf16 compute (MIXED_PRECISION_LAYOUTS) under ep2 against fsdp2, both in bf16, differing in the
# expert LoRA (fp32 under EP, bf16 under FSDP2 alone). A bf16 near-tie in a router can send a token
# to another expert: under ATEN_CPU_CAPABILITY=default two of minimax_m2's tokens moved by 0.74, so
# the log-probs are held by their median difference, which such tokens do not move. Measured
# 2026-12-06 (native AVX512, avx2 and default): median |ep2 - fsdp2| at most 8.1e-3 (gpt_oss) and
# the first losses 2.0e-5 apart (minimax_m2, default); each bf16 run against the float64 one-process
# run: medians 8.8e-3 to 2.7e-2.
BF16_MEDIAN_LOGPROBS_TOL = 8.1e-3 * 3  # measured bf16 ep2-vs-fsdp2 floor 8.1e-3 (2026-12-06) x 3
BF16_LOSS_TOL = 2.0e-5 * 5  # measured bf16 ep2-vs-fsdp2 floor 2.0e-5 (2026-12-06) x 5


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
        with fp32_islands_in_fp64():
            trainer = Trainer(cases.engine_config(path, dtype=cases.EQUALITY_DTYPE))
            result = cases.run_case(trainer, vocab, export_dir=export_dir, merged=True, generate=True)
        result["export_dir"] = str(export_dir)
        out[model_type] = result
    return out


@pytest.fixture(scope="module")
def ep_two_process(two_rank_runs):
    return torch.load(two_rank_runs["expert_parallel"] / "results.pt", weights_only=False)


@pytest.fixture(scope="module")
def ep_four_process(four_rank_runs):
    return torch.load(four_rank_runs["expert_parallel"] / "results.pt", weights_only=False)


def _check_merged_payload(result, reference, where: str):
    assert result["merged"].keys() == reference["merged"].keys(), f"{where}: merged payload keys differ"
    assert any(".experts." in key for key in reference["merged"]), f"{where}: no expert weight in the merged payload"
    for key, want in reference["merged"].items():
        assert_close_reporting(result["merged"][key], want, TOL, f"{where}: merged payload {key}")


@pytest.mark.slow
@pytest.mark.parametrize("model_type", EP_MODEL_TYPES)
def test_expert_parallel_matches_single_process(
    ep_two_process, ep_four_process, ep_single_process, ep_checkpoints, model_type
):
    """EP x2 (experts split over the 2 FSDP ranks), EP x2 x FSDP x2 (world 4: experts split over 2
    ranks and replicated over the other 2) and EP x2 x TP x2: log-probs, loss, LoRA gradients
    (expert factors gathered from their shards), the loss curve, PEFT export, merged sync payload and
    the native engine's completions; and EP x2 computing in bf16."""
    reference = ep_single_process[model_type]
    for results, layout in ((ep_two_process, "ep2"), (ep_four_process, "ep2_fsdp2"), (ep_four_process, "ep2_tp2")):
        result = results[(model_type, layout)]
        where = f"{model_type} {layout}"
        assert any(".experts." in name for name in result["grads"]), f"{where}: no expert LoRA gradient compared"
        _check_against_single_process(result, reference, where)
        _check_export(result, reference, where)
        _check_merged_payload(result, reference, where)
        # Only the first data-parallel rank had prompts: the others ran its forwards (and their
        # all-to-alls) in step with it.
        assert result["generated"] == reference["generated"], (
            f"{where}: completions {result['generated']}, one process's {reference['generated']}"
        )
    # bf16 compute (parallel.param_dtype) reaches the expert-parallel experts as FSDP2 gives it to
    # every other parameter. The expert LoRA stays in fp32 under EP (FSDP2 casts it to bf16 without),
    # hence the bf16-sized tolerances.
    mixed = ep_two_process[(model_type, "ep2")]["mixed_precision"]
    where = f"{model_type} bf16 compute, ep2 against fsdp2"
    ep2, fsdp2 = mixed["ep2"], mixed["fsdp2"]
    vocab = HFCheckpoint(ep_checkpoints[model_type]).shape("model.embed_tokens.weight")[0]
    scored = cases.make_batch(vocab).loss_mask.bool()
    difference = (ep2["logprobs"] - fsdp2["logprobs"]).abs()[scored]
    median = difference.median().item()
    assert median <= BF16_MEDIAN_LOGPROBS_TOL, (
        f"{where}: median |log-prob difference| {median:.3e} over {difference.numel()} tokens exceeds "
        f"{BF16_MEDIAN_LOGPROBS_TOL:.1e} (largest {difference.max().item():.3e})"
    )
    assert_close_reporting(ep2["first_loss"], fsdp2["first_loss"], BF16_LOSS_TOL, f"{where}: first loss")


@pytest.mark.slow
def test_checkpoints_move_between_expert_parallel_and_other_layouts(ep_checkpoints, two_rank_runs):
    """An EP=2 checkpoint resumes under FSDP (EP=1) and in one process, and an EP=1 checkpoint under
    EP=2, each continuing with the losses and gradient norms of the uninterrupted run."""
    from archon.checkpoint.resume import CheckpointManager

    out = two_rank_runs["reshard"]  # the worker's reshard scenario on RESHARD_MODEL_TYPES, ep2 and fsdp2
    results = torch.load(out / "reshard.pt")

    for model_type in RESHARD_MODEL_TYPES:
        uninterrupted = results[(model_type, "ep2")]

        def check(got, where):
            where = f"{model_type}: {where} against the uninterrupted ep2 run"
            cases.check_resumed_steps(got, uninterrupted, TOL, where)

        check(results[(model_type, "fsdp2")], "uninterrupted fsdp2")
        check(results[(model_type, "ep2", "fsdp2")], "ep2 checkpoint resumed under fsdp2")
        check(results[(model_type, "fsdp2", "ep2")], "fsdp2 checkpoint resumed under ep2")

        path = ep_checkpoints[model_type]
        vocab = HFCheckpoint(path).shape("model.embed_tokens.weight")[0]

        def last_two_steps(trainer):
            metrics = [
                trainer.train_step(_reshard_batch(trainer, vocab, step), cases.loss_fn, with_entropy=True)
                for step in (2, 3)
            ]
            return [(m["loss"], m["grad_norm"]) for m in metrics]

        with fp32_islands_in_fp64():
            resumed = Trainer(cases.engine_config(path, dtype=cases.EQUALITY_DTYPE))
            resumed.load_checkpoint(CheckpointManager(out / f"{model_type}-ep2", keep_last=1))
            check(last_two_steps(resumed), "ep2 checkpoint resumed in one process")
            # Without the checkpoint the same steps give other gradients: the comparisons have teeth.
            fresh = last_two_steps(Trainer(cases.engine_config(path, dtype=cases.EQUALITY_DTYPE)))
        assert abs(fresh[0][1] / uninterrupted[0][1] - 1) > 1e-2, (
            f"{model_type}: a fresh model's gradient norm {fresh[0][1]} is within 1% of the resumed run's "
            f"{uninterrupted[0][1]}"
        )


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
        with fp32_islands_in_fp64():
            out[model_type] = cases.run_multi_task_case(path, vocab, export_dir=export_dir, dtype=torch.float64)
        out[model_type]["export_dir"] = str(export_dir)
    return out


@pytest.fixture(scope="module")
def multi_task_two_process(two_rank_runs):
    return torch.load(two_rank_runs["multi_task"] / "results.pt", weights_only=False)


MULTI_TASK_CASES = [
    ("qwen3", "fsdp2"),
    ("qwen3", "tp2"),
    ("qwen3_moe", "fsdp2"),
    ("qwen3_moe", "tp2"),
    ("qwen3_moe", "ep2"),
]


@pytest.mark.slow
@pytest.mark.parametrize("model_type, layout", MULTI_TASK_CASES)
def test_multi_task_model_matches_single_process(multi_task_two_process, multi_task_single_process, model_type, layout):
    """Two tasks of other ranks and targets, their sequences mixed in one packed batch, on 2 ranks:
    per-token log-probs (adapters on, off, and one task's view), each task's LoRA gradients
    (gathered from the shards), and the native engine's greedy mixed generation before and after the
    adapters change (the first data-parallel rank generates, the other keeps in step)."""
    result, reference = multi_task_two_process[(model_type, layout)], multi_task_single_process[model_type]
    where = f"{model_type} {layout}, two tasks"
    for key in ("logprobs", "ref_logprobs", "view_b_logprobs"):
        assert_close_reporting(result[key], reference[key], TOL, f"{where}: {key}")
    adapters_change = not torch.allclose(reference["logprobs"], reference["ref_logprobs"], atol=1e-3)
    assert adapters_change, f"{model_type}: the adapters change no log-prob by 1e-3"
    assert result["grads"].keys() == reference["grads"].keys() == set(cases.MULTI_TASK_LORAS)
    for task, grads in reference["grads"].items():
        cases.assert_gradients_close_reporting(result["grads"][task], grads, TOL, f"{where}: task {task}")
    if model_type == "qwen3_moe":
        assert any(".experts." in name for name in reference["grads"]["a"]), "no expert LoRA gradient compared"
    assert result["generated"] == reference["generated"], where
    assert result["generated_after_change"] == reference["generated_after_change"], where
    assert reference["generated_after_change"] != reference["generated"]


@pytest.mark.slow
@pytest.mark.parametrize("model_type, layout", MULTI_TASK_CASES)
def test_multi_task_peft_export_equals_single_process(
    multi_task_two_process, multi_task_single_process, model_type, layout
):
    """Each task's adapter, exported through its task_view from the shards, is the one-process export."""
    result, reference = multi_task_two_process[(model_type, layout)], multi_task_single_process[model_type]
    for task in cases.MULTI_TASK_LORAS:
        check_exported_adapter(
            f"{result['export_dir']}/{task}", f"{reference['export_dir']}/{task}", f"{model_type} {layout}, task {task}"
        )


def test_multi_task_model_refuses_compile_and_dropout_under_tp(checkpoints):
    from archon.build import build_model

    with pytest.raises(ValueError, match=r"parallel.compile=True: a multi-task"):
        build_model(
            checkpoints["qwen3"],
            task_loras=cases.MULTI_TASK_LORAS,
            dims=ParallelDims(world_size=1),
            parallel=ParallelConfig(compile=True),
        )
    dropping = {"a": cases.MULTI_TASK_LORAS["a"], "b": LoRAConfig(rank=2, dropout=0.1)}
    with pytest.raises(ValueError, match=r"task\(s\) \['b'\]: lora.dropout > 0 with tp=2"):
        build_model(
            checkpoints["qwen3"],
            task_loras=dropping,
            dims=ParallelDims(world_size=2, dp_shard=1, tp=2),
            parallel=ParallelConfig(tp=2),
        )


# ---- configuration errors -------------------------------------------------------------------------


@pytest.mark.slow
def test_a_non_finite_loss_on_one_rank_is_skipped_on_every_rank(two_rank_runs):
    results = torch.load(two_rank_runs["skip"])  # the worker's skip scenario on qwen3, fsdp2 and tp2
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


@pytest.mark.parametrize(
    "model_type, message",
    [
        ("qwen3_moe", r"ep=3 does not divide num_experts=8 of this qwen3 model"),
        ("qwen3", r"ep=3 requested but this qwen3 model has no routed experts"),
    ],
)
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
        with fp32_islands_in_fp64():
            loaded = build_model(
                checkpoints[model_type],
                lora=LoRAConfig(rank=4),
                parallel=ParallelConfig(activation_checkpoint=ac),
                dims=ParallelDims(world_size=1),
                dtype=torch.float64,
            )
            with torch.no_grad():
                for name, p in loaded.model.named_parameters():
                    if "lora_b" in name:
                        p.normal_(0, 0.1, generator=torch.Generator().manual_seed(0))
            hidden = loaded.model(batch.tokens, batch.positions, batch.cu_seqlens, batch.max_seqlen, return_hidden=True)
            hidden.pow(2).mean().backward()
        grads[ac] = {n: p.grad for n, p in loaded.model.named_parameters() if p.grad is not None}
    assert grads[mode].keys() == grads["none"].keys() and len(grads["none"]) > 0
    for name, g in grads["none"].items():
        # the recomputation repeats the same operations: the same bits
        where = f"{model_type} activation_checkpoint={mode}: gradient {name}"
        assert_close_reporting(grads[mode][name], g, 0.0, where)


@pytest.mark.slow
def test_compiled_blocks_match_eager(checkpoints):
    batch = cases.make_batch(256)
    with fp32_islands_in_fp64():
        engines = []
        for compile in (False, True):
            parallel = ParallelConfig(compile=compile, compile_backend="aot_eager")
            config = cases.engine_config(
                checkpoints["qwen3"], parallel, dtype=cases.EQUALITY_DTYPE, micro_batch_tokens=10_000
            )  # one shape to compile for
            engines.append(Trainer(config))
        eager, compiled = (e.logprobs(batch).logprobs for e in engines)
    assert_close_reporting(compiled, eager, TOL, "qwen3 compiled blocks (aot_eager) against eager: log-probs")
