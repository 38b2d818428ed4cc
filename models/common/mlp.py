import torch
import torch.nn.functional as F
from torch import nn

from archon.lora import LoRAConfig, linear


class SwiGLUMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), with HF's module names."""

    def __init__(self, dim: int, hidden_dim: int, bias: bool, lora: LoRAConfig | None) -> None:
        super().__init__()
        self.gate_proj = linear(dim, hidden_dim, bias, "gate_proj", lora)
        self.up_proj = linear(dim, hidden_dim, bias, "up_proj", lora)
        self.down_proj = linear(hidden_dim, dim, bias, "down_proj", lora)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
