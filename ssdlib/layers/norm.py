"""RMSNorm (accumulated in float32, as Llama does; torch's fused kernel)."""

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.checkpoint_shape = (hidden_size,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one fused kernel on GPU (float32 accumulation inside, whatever x's dtype)
        return nn.functional.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    def checkpoint_tensors(self, prefix: str) -> list[tuple[str, tuple[int, ...]]]:
        return [(prefix + ".weight", self.checkpoint_shape)]

    def load(self, weights, prefix: str) -> None:
        self.weight.data.copy_(weights.get(prefix + ".weight"))
