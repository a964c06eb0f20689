"""SwiGLU activation."""

import torch
from torch import nn


class SiluAndMul(nn.Module):
    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return nn.functional.silu(gate) * up
