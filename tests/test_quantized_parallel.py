"""Quantized bases (archon.quant: FP8 block-scaled, MXFP4) under FSDP2, tensor, expert and context
parallelism (gloo, CPU) against one process, with the same tiny checkpoints quantized by the
published recipes: log-probs, the first loss and every LoRA gradient, the loss curve, the exported
adapter, the merged sync payload and the native engine's completions; where each rank's part of the
quantized storage lies (its data and scales shard together, each rank holding 1/n of what the layout
shards); checkpoints moving between layouts; and the tensor-parallel split a quantized weight
refuses.

The multi-process cases run tests/parallel_worker.py's `quantized` scenario under torchrun. Layouts and
the one process compute in float64 (see tests/parallel_cases.py); the mixed-precision case in bf16.
"""

from __future__ import annotations

import parallel_cases as cases
import pytest
import torch
from helpers import assert_close_reporting
from test_parallel import TOL, _check_against_single_process, _check_export, _check_merged_payload

from archon.checkpoint.hf import HFCheckpoint
from archon.precision import fp32_islands_in_fp64
from archon.quant import QuantFormat, quant_format_from_config
from archon.quant.formats import compressed_tensors_config
from archon.trainer import Trainer

# 16x24 blocks: the tiny models' 64 inputs are 2 2/3 column blocks and their 32-row experts and
# key/value projections end in partial row blocks. Tensor parallelism splits a row-parallel
# linear's inputs, which needs whole column blocks per rank: 24x16 blocks give them (64 = 2 x 2 x 16)
# and keep partial row blocks, which the column-parallel splits cut through (rows 32 of 64).
FP8 = QuantFormat("fp8", (16, 24))
FP8_TP = QuantFormat("fp8", (24, 16))
MXFP4 = QuantFormat("mxfp4", (1, 32))
# GLM-4.5-FP8's layout (compressed-tensors, a scale per output channel): a row-parallel split
# replicates the scales, which cover every input.
FP8_CHANNEL = quant_format_from_config(compressed_tensors_config("channel"))
CHECKPOINTS = {
    "fp8": ("qwen3_moe", FP8),
    "fp8_tp": ("qwen3_moe", FP8_TP),
    "mxfp4": ("gpt_oss", MXFP4),
    "fp8_channel": ("glm4_moe", FP8_CHANNEL),
}

TWO_RANK_CASES = [
    ("fp8", "fsdp2"),
    ("fp8", "ep2"),
    ("fp8_tp", "tp2"),
    ("mxfp4", "fsdp2"),
    ("mxfp4", "ep2"),
    ("fp8", "cp2"),
    ("fp8_channel", "tp2"),
]
FOUR_RANK_CASES = [("fp8_tp", "fsdp2_tp2"), ("fp8", "ep2_fsdp2")]
# bf16 kept quantized against bf16 dequantized at load: the same bf16 values through the same GEMMs,
# measured bit-identical (difference 0, 2026-12-06; each against the float64 one-process run: 0.24
# (fp8) and 2.0 (mxfp4) on the log-probs), so no tolerance.
BF16_KEEP_TOL = 0.0


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from archon.quant.export import quantize_checkpoint
    from archon.tools.align import make_tiny_hf_checkpoint

    root = tmp_path_factory.mktemp("quantized_parallel")
    dense = {t: make_tiny_hf_checkpoint(t, root / t, seed=0) for t in {t for t, _ in CHECKPOINTS.values()}}
    return {name: quantize_checkpoint(dense[t], root / name, fmt) for name, (t, fmt) in CHECKPOINTS.items()}


def _vocab(path) -> int:
    return HFCheckpoint(path).shape("model.embed_tokens.weight")[0]


@pytest.fixture(scope="module")
def single_process(checkpoints, tmp_path_factory):
    out = {}
    for name, path in checkpoints.items():
        export_dir = tmp_path_factory.mktemp("single") / name
        with fp32_islands_in_fp64():
            trainer = Trainer(cases.engine_config(path, dtype=cases.EQUALITY_DTYPE))
            result = cases.run_case(trainer, _vocab(path), export_dir=export_dir, merged=True, generate=True)
        result["storage"] = cases.quantized_storage_layout(trainer.model)
        result["export_dir"] = str(export_dir)
        out[name] = result
    return out


def _quantized_job(checkpoints, out, pairs) -> list[str]:
    names = sorted({name for name, _ in pairs})
    return [
        "quantized",
        "--out",
        str(out),
        "--ckpt",
        *[f"{n}={checkpoints[n]}" for n in names],
        "--layouts",
        *[f"{n}:{layout}" for n, layout in pairs],
    ]


@pytest.fixture(scope="module")
def reshard_dir(tmp_path_factory):
    """Where the 2-rank launch of parallel_results moves the fp8 run's checkpoints between ep2 and
    fsdp2 (cases.reshard_job)."""
    return tmp_path_factory.mktemp("quantized_reshard")


@pytest.fixture(scope="module")
def parallel_results(checkpoints, reshard_dir, tmp_path_factory):
    """TWO_RANK_CASES, then the fp8 checkpoints moved between layouts, in one 2-rank launch;
    FOUR_RANK_CASES in a 4-rank one."""
    two, four = (tmp_path_factory.mktemp(f"quantized_world{n}") / "results.pt" for n in (2, 4))
    reshard = cases.reshard_job(reshard_dir, "fp8", checkpoints["fp8"], "ep2", "fsdp2")
    cases.launch_jobs(2, [_quantized_job(checkpoints, two, TWO_RANK_CASES), reshard])
    cases.launch(4, *_quantized_job(checkpoints, four, FOUR_RANK_CASES))
    return {**torch.load(two, weights_only=False), **torch.load(four, weights_only=False)}


@pytest.mark.slow
@pytest.mark.parametrize(("name", "layout"), TWO_RANK_CASES + FOUR_RANK_CASES)
def test_quantized_base_matches_single_process(parallel_results, single_process, name, layout):
    result, reference = parallel_results[(name, layout)], single_process[name]
    where = f"{name} base, {layout}"
    assert any(".experts." in key for key in reference["storage"]), "no quantized experts in the model"
    assert any(".experts." in key for key in result["grads"]), "no expert LoRA gradient compared"
    _check_against_single_process(result, reference, where)
    _check_export(result, reference, where)
    # The merged payload of a quantized base is its dequantized weights plus the LoRA deltas, gathered.
    _check_merged_payload(result, reference, where)
    assert result["generated"] == reference["generated"], f"{where}: {result['generated']} != {reference['generated']}"


@pytest.mark.slow
@pytest.mark.parametrize(("name", "layout"), TWO_RANK_CASES + FOUR_RANK_CASES)
def test_quantized_storage_shards_with_its_scales(parallel_results, single_process, name, layout):
    """Each rank holds its shard of every sharded `*_qdata` and the scales of exactly those rows and
    column blocks; the shards of the ranks tile the whole storage."""
    per_rank = parallel_results[(name, layout)]["storage"]
    whole = single_process[name]["storage"]
    world, kwargs = cases.LAYOUTS[layout]
    assert len(per_rank) == world and all(rank.keys() == whole.keys() for rank in per_rank)
    sharded = set()
    for key, reference in whole.items():
        parts = [rank[key] for rank in per_rank]
        for part in parts:
            data_placements, scale_placements = part["placements"]
            assert part["bytes"] == reference["bytes"], key
            data_region, scale_region = part["regions"]
            if part["column_block"] is None:  # a scale per row covers all inputs: replicated over their split
                assert scale_placements == (
                    data_placements and data_placements.replace("Shard(dim=1)", "Replicate()")
                ), key
                assert scale_region is None or data_region[:-1] == scale_region[:-1], key
                continue
            assert data_placements == scale_placements, f"{key}: data {data_placements}, scale {scale_placements}"
            if data_region is None:
                assert scale_region is None and part["local_bytes"] == part["bytes"], key
                continue
            # Same rows (and experts); the data columns start where the scale's column blocks do.
            assert data_region[:-1] == scale_region[:-1], (key, data_region, scale_region)
            first_input = data_region[-1].start * part["inputs_per_byte"]
            assert first_input == scale_region[-1].start * part["column_block"], (key, data_region, scale_region)
        shards = parts[0]["shards"][0]
        per_row_scale_replicated = parts[0]["column_block"] is None and parts[0]["shards"][1] == 1
        assert all(part["shards"] == [shards, 1 if per_row_scale_replicated else shards] for part in parts), key
        if shards > 1:
            sharded.add(key)
            # These tiny shapes split evenly: every rank holds 1/shards of the bytes (of the data
            # alone where the scales are replicated).
            if not per_row_scale_replicated:
                assert all(part["local_bytes"] * shards == part["bytes"] for part in parts), (key, shards)
            distinct = {tuple((s.start, s.stop) for s in part["regions"][0]) for part in parts}
            assert len(distinct) == shards, (key, distinct)
    quantized_bytes = sum(reference["bytes"] for reference in whole.values())
    held = [sum(part["local_bytes"] for part in rank.values()) for rank in per_rank]
    if layout in ("fsdp2", "ep2", "cp2"):  # everything sharded over the 2 ranks (FSDP2 shards over cp too)
        assert sharded == whole.keys()
        assert held == [quantized_bytes // 2] * 2, (held, quantized_bytes)
    elif layout == "tp2":  # attention and dense MLP split, the experts whole on both ranks (no FSDP)
        assert sharded == {key for key in whole if ".experts." not in key} != set()
    else:  # 4 ranks: every weight sharded (FSDP over 2, with TP or EP over the other 2)
        assert sharded == whole.keys()
        assert all(h <= 0.5 * quantized_bytes for h in held), (held, quantized_bytes)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fp8", "mxfp4"])
@pytest.mark.parametrize("layout", ["fsdp2", "ep2"])
def test_ranks_read_only_their_shards_of_a_quantized_checkpoint(parallel_results, name, layout):
    result = parallel_results[(name, layout)]
    assert all(n <= 0.55 * result["checkpoint_elements"] for n in result["read_elements"]), (
        result["read_elements"],
        result["checkpoint_elements"],
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fp8", "mxfp4"])
def test_fsdp_mixed_precision_leaves_quantized_storage_alone(parallel_results, name):
    """parallel.param_dtype=bfloat16: FSDP2 gathers the uint8 data and int32-coded fp32 scales
    uncast next to the parameters it casts, so the kept-quantized base computes what the base
    dequantized at load (to fp32, then cast to bf16 by FSDP2) computes: each weight dequantizes to
    the same bf16 values and every GEMM rounds as the dense one does (a scale cast to bf16 would
    move whole blocks; base and adapter summed in two roundings moved these log-probs by 0.24)."""
    mixed = parallel_results[(name, "fsdp2")]["mixed_precision"]
    keep, dequantized = mixed["keep"], mixed["dequantize"]
    where = f"{name} base, fsdp2 in bf16: kept quantized against dequantized at load"
    assert_close_reporting(keep["logprobs"], dequantized["logprobs"], BF16_KEEP_TOL, f"{where}: log-probs")
    assert_close_reporting(keep["first_loss"], dequantized["first_loss"], BF16_KEEP_TOL, f"{where}: first loss")


def test_row_parallel_split_must_keep_whole_scale_blocks():
    """A row-parallel linear splits its weight's inputs; each rank must start on a scale block. Hand
    cases: 63 inputs in 16-column blocks over 2 ranks split at 32 (block 2); 64 inputs in 24-column
    blocks split at 32, inside block 1; mxfp4's 32-input blocks over 64 and 96 inputs."""
    from archon.parallel import require_whole_scale_blocks, rowwise
    from archon.quant import quantize_base_weights

    def model(in_features, fmt):
        with torch.device("meta"):
            m = torch.nn.Sequential(torch.nn.Linear(in_features, 48), torch.nn.Linear(48, 8))
        quantize_base_weights(m, {"0.weight": fmt, **({"1.weight": fmt} if fmt.method == "fp8" else {})}, torch.float32)
        return m

    plan = {"0": rowwise()}
    require_whole_scale_blocks(model(63, QuantFormat("fp8", (8, 16))), plan, tp=2)
    require_whole_scale_blocks(model(64, MXFP4), plan, tp=2)
    require_whole_scale_blocks(model(64, FP8), plan, tp=1)
    require_whole_scale_blocks(model(64, FP8), {"1": rowwise()}, tp=2)  # 48 inputs = 2 x 24
    with pytest.raises(
        ValueError,
        match=r"layers\.3\.0: tensor parallelism \(tp=2\) splits its 64 input features "
        r"inside a block of 24 columns .*multiple of tp x 24",
    ):
        require_whole_scale_blocks(model(64, FP8), plan, tp=2, prefix="layers.3.")
    with pytest.raises(ValueError, match=r"splits its 96 input features inside a block of 32 columns"):
        require_whole_scale_blocks(model(96, MXFP4), plan, tp=2)


def test_tensor_parallel_refuses_a_quantized_base_it_would_split_inside_a_block(checkpoints):
    """Refused when the model is parallelized, before any mesh or weight exists, naming the module."""
    from archon.build import build_model
    from archon.lora import LoRAConfig
    from archon.parallel import ParallelConfig, ParallelDims

    message = (
        r"^layers\.0\.self_attn\.o_proj: tensor parallelism \(tp=2\) splits its 64 input features inside a "
        r"block of 24 columns .*fp8 e4m3 with 16x24 block scales.*model\.quantized_base='dequantize'"
    )
    with pytest.raises(ValueError, match=message):
        build_model(
            checkpoints["fp8"],
            lora=LoRAConfig(rank=4),
            dims=ParallelDims(world_size=2, dp_shard=1, tp=2),
            parallel=ParallelConfig(tp=2),
        )


@pytest.mark.slow
def test_quantized_run_checkpoints_move_between_layouts(checkpoints, parallel_results, reshard_dir):
    """An EP=2 checkpoint of a run on a quantized base resumes under FSDP and in one process, and an
    FSDP one under EP=2, each continuing with the losses of the uninterrupted run; the checkpoints
    hold the LoRA factors and their optimizer state, no quantized storage."""
    from test_parallel import _reshard_batch
    from torch.distributed.checkpoint import FileSystemReader

    from archon.checkpoint.resume import CheckpointManager

    path = checkpoints["fp8"]
    cases.check_resumed_across_layouts(reshard_dir, "fp8", path, "ep2", "fsdp2", TOL, _reshard_batch)
    manager = CheckpointManager(reshard_dir / "fp8-ep2", keep_last=1)
    stored = FileSystemReader(manager.latest()).read_metadata().state_dict_metadata
    model_keys = [k.removeprefix("model.") for k in stored if k.startswith("model.")]
    assert model_keys and all("lora" in k for k in model_keys), model_keys
