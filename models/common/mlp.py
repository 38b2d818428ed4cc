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

    def activation(self, gate: torch.Tensor) -> torch.Tensor:
        return F.silu(gate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.activation(self.gate_proj(x)) * self.up_proj(x))


class GeGLUMLP(SwiGLUMLP):
    """down(gelu_tanh(gate(x)) * up(x)): HF's `gelu_pytorch_tanh` gate (Gemma). The same layers and
    tensor-parallel plan as SwiGLUMLP."""

    def activation(self, gate: torch.Tensor) -> torch.Tensor:
        return F.gelu(gate, approximate="tanh")
