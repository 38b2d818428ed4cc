"""DeepSeek-V3: MLA heads sharded, then the shared MoE decoder plan (dense MLPs and shared
experts sharded, routed experts whole).

The per-head projections are column-parallel (q_proj, or q_b_proj after the query bottleneck, and
kv_b_proj, whose rows are head-major) and o_proj is row-parallel. The latent projections
(q_a_proj, kv_a_proj_with_mqa) and their norms feed every head, so they stay replicated; so does the
shared rotary key, which each rank expands to its own heads: its gradient is summed over the ranks
(`SharedAcrossHeads` on `self_attn.shared_rope_key`).
"""

from __future__ import annotations

from archon.models.common.moe_parallel import parallelize_moe_decoder
from archon.models.deepseek_v3.model import DeepseekV3Model
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_module
from torch.distributed.tensor.parallel import ParallelStyle

from archon.parallel import ParallelConfig, ParallelDims, colwise, rowwise


class SharedAcrossHeads(ParallelStyle):
    """For a replicated activation that each tensor-parallel rank consumes for its own heads only:
    the module's output is its input as a local tensor whose gradient is a partial sum, so the
    backward all-reduces it over the ranks before it reaches the (replicated) producer."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def input_fn(mod, inputs, mesh):
            return (DTensor.from_local(inputs[0], mesh, (Replicate(),), run_check=False), *inputs[1:])

        def output_fn(mod, output, mesh):
            return output.to_local(grad_placements=(Partial(),))

        return distribute_module(module, device_mesh, None, input_fn, output_fn)


def parallelize_deepseek_v3(model: DeepseekV3Model, dims: ParallelDims, config: ParallelConfig) -> DeepseekV3Model:
    args = model.args
    query = "q_proj" if args.q_lora_rank is None else "q_b_proj"
    plan = {
        f"self_attn.{query}": colwise(),
        "self_attn.kv_b_proj": colwise(),
        "self_attn.shared_rope_key": SharedAcrossHeads(),
        "self_attn.o_proj": rowwise(),
    }
    return parallelize_moe_decoder(
        model, dims, config, "deepseek_v3", plan, dict(num_attention_heads=args.num_attention_heads)
    )
