"""RMSNorm (computed in float32, cast back, as Llama does)."""

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.checkpoint_shape = (hidden_size,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def checkpoint_tensors(self, prefix: str) -> list[tuple[str, tuple[int, ...]]]:
        return [(prefix + ".weight", self.checkpoint_shape)]

    def load(self, weights, prefix: str) -> None:
        self.weight.data.copy_(weights.get(prefix + ".weight"))
