"""Context parallelism (Ulysses, gloo, CPU) against a single process: every token-mixer kind
(grouped-query attention, GPT-OSS sinks and sliding windows, Qwen3.5 gated DeltaNet and gated
attention, DeepSeek-V3 MLA), with micro-batches whose sequences straddle the token split, then with
FSDP and with TP; checkpoints moving between layouts; and the refused configurations. Layouts and the
one process compute in float64 (see tests/parallel_cases.py)."""

from __future__ import annotations

import parallel_cases as cases
import pytest
import torch
from test_parallel import TOL, _check_against_single_process, _check_export

from archon.checkpoint.hf import HFCheckpoint
from archon.parallel import ParallelDims
from archon.parallel.context_parallel import TokenSlice, require_context_parallel_heads
from archon.precision import fp32_islands_in_fp64
from archon.trainer import Trainer

MODEL_TYPES = ("qwen3", "qwen3_5_text", "deepseek_v3", "gpt_oss", "gemma3_text")
EXPERT_PARALLEL_MODEL = "qwen3_moe"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from archon.tools.align import make_tiny_hf_checkpoint

    root = tmp_path_factory.mktemp("context_parallel")
    return {t: make_tiny_hf_checkpoint(t, root / t, seed=0) for t in (*MODEL_TYPES, EXPERT_PARALLEL_MODEL)}


def _vocab(path) -> int:
    return HFCheckpoint(path).shape("model.embed_tokens.weight")[0]


@pytest.fixture(scope="module")
def single_process(checkpoints, tmp_path_factory):
    out = {}
    for model_type, path in checkpoints.items():
        export_dir = tmp_path_factory.mktemp("single") / model_type
        with fp32_islands_in_fp64():
            trainer = Trainer(cases.engine_config(path, dtype=cases.EQUALITY_DTYPE))
            result = cases.run_case(trainer, _vocab(path), export_dir=export_dir, generate=True)
        result["export_dir"] = str(export_dir)
        out[model_type] = result
    return out


def _run(checkpoints, tmp_path_factory, nproc, layouts, model_types):
    """`layouts`: LAYOUT (under every model) or MODEL:LAYOUT (under that model only)."""
    out = tmp_path_factory.mktemp(f"cp_world{nproc}") / "results.pt"
    ckpts = [f"{t}={checkpoints[t]}" for t in model_types]
    cases.launch(nproc, "parity", "--out", str(out), "--layouts", *layouts, "--ckpt", *ckpts)
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def two_rank_runs(checkpoints, tmp_path_factory) -> dict:
    """The 2-rank scenarios in one torchrun launch, one after the other: cp2 under every model, then
    qwen3's checkpoints moved between cp2 and fsdp2 (cases.reshard_job). Returns their outputs."""
    root = tmp_path_factory.mktemp("cp_world2")
    out = {"parity": root / "results.pt", "reshard": root / "reshard"}
    out["reshard"].mkdir()
    parity = ["parity", "--out", str(out["parity"]), "--layouts", "cp2", "--ckpt"]
    parity += [f"{t}={checkpoints[t]}" for t in MODEL_TYPES]
    cases.launch_jobs(2, [parity, cases.reshard_job(out["reshard"], "qwen3", checkpoints["qwen3"], "cp2", "fsdp2")])
    return out


@pytest.fixture(scope="module")
def two_process(two_rank_runs):
    return torch.load(two_rank_runs["parity"], weights_only=False)


FOUR_PROCESS_CASES = [("qwen3_5_text", "cp2_fsdp2"), ("qwen3", "cp2_tp2"), (EXPERT_PARALLEL_MODEL, "cp2_ep2")]


@pytest.fixture(scope="module")
def four_process(checkpoints, tmp_path_factory):
    layouts = [f"{model_type}:{layout}" for model_type, layout in FOUR_PROCESS_CASES]
    return _run(checkpoints, tmp_path_factory, 4, layouts, [model_type for model_type, _ in FOUR_PROCESS_CASES])


def test_micro_batches_straddle_the_token_split():
    """The parity batches split sequences between the two context-parallel ranks and need padding."""
    batch = cases.make_batch(256)
    micro = batch.split_by_tokens(cases.MICRO_BATCH_TOKENS)
    straddling = padded = 0
    for mb in micro:
        half = -(-mb.num_tokens // 2)
        bounds = mb.cu_seqlens.tolist()
        straddling += any(a < half < b for a, b in zip(bounds, bounds[1:]))
        padded += mb.num_tokens % 2
    assert straddling >= 2 and padded >= 1


@pytest.mark.slow
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_context_parallel_matches_single_process(two_process, single_process, model_type):
    """Log-probs, entropies, the first loss and LoRA gradients, the loss curve and gradient norms of
    the later steps, the exported adapter, and the built-in engine's greedy completions (generation
    runs whole sequences on every rank)."""
    result, reference = two_process[(model_type, "cp2")], single_process[model_type]
    _check_against_single_process(result, reference, f"{model_type} cp2")
    _check_export(result, reference, f"{model_type} cp2")
    assert result["generated"] == reference["generated"], (
        f"{model_type} cp2: completions {result['generated']}, one process's {reference['generated']}"
    )


@pytest.mark.slow
@pytest.mark.parametrize(("model_type", "layout"), FOUR_PROCESS_CASES)
def test_context_parallel_composes_with_fsdp_tp_and_ep(four_process, single_process, model_type, layout):
    result, reference = four_process[(model_type, layout)], single_process[model_type]
    _check_against_single_process(result, reference, f"{model_type} {layout}")
    _check_export(result, reference, f"{model_type} {layout}")
    assert result["generated"] == reference["generated"], (
        f"{model_type} {layout}: completions {result['generated']}, one process's {reference['generated']}"
    )


def test_token_slices_pad_to_a_multiple_of_cp():
    class Group:
        size, rank = 2, 1

    cu = torch.tensor([0, 3, 7])
    tokens_of = TokenSlice.of(cu, Group())
    assert tokens_of.padded_tokens == 8 and tokens_of.cu_seqlens.tolist() == [0, 3, 7, 8] and tokens_of.max_seqlen == 4
    assert tokens_of.local(torch.arange(7)).tolist() == [4, 5, 6, 0]
    assert tokens_of.local_positions(torch.tensor([0, 1, 2, 0, 1, 2, 3])).tolist() == [1, 2, 3, 0]


def test_cp_degree_is_part_of_the_world_size():
    assert ParallelDims(world_size=8, cp=2, tp=2).dp_shard == 2
    with pytest.raises(ValueError, match=r"dp_replicate\*cp\*tp"):
        ParallelDims(world_size=6, cp=4)
    with pytest.raises(ValueError, match="cp=0"):
        ParallelDims(world_size=2, cp=0)


def test_cp_must_split_whole_heads():
    dims = ParallelDims(world_size=8, cp=4, tp=2)
    with pytest.raises(ValueError, match=r"parallel.cp=4 .*num_attention_heads=4 \(needs a multiple of tp x cp = 8\)"):
        require_context_parallel_heads(dims, "qwen3", {"num_attention_heads": 4}, {"num_key_value_heads": 2})
    # 3 key/value heads per tensor-parallel rank can neither be split over 4 ranks nor repeated up to 4
    with pytest.raises(ValueError, match=r"num_key_value_heads=6 \(3 per tensor-parallel rank"):
        require_context_parallel_heads(dims, "qwen3", {"num_attention_heads": 16}, {"num_key_value_heads": 6})
    require_context_parallel_heads(dims, "qwen3", {"num_attention_heads": 16}, {"num_key_value_heads": 2})


@pytest.mark.slow
def test_checkpoints_move_between_context_parallel_and_other_layouts(checkpoints, two_rank_runs):
    """A CP=2 checkpoint resumes under FSDP and in one process, and an FSDP checkpoint under CP=2,
    each continuing with the losses and gradient norms of the uninterrupted run."""
    from test_parallel import _reshard_batch

    path = checkpoints["qwen3"]
    cases.check_resumed_across_layouts(two_rank_runs["reshard"], "qwen3", path, "cp2", "fsdp2", TOL, _reshard_batch)
