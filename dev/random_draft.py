"""A draft of the default draft's shape with random weights (a deliberately bad draft: the
engine must not lose to AR with it): each matrix drawn from N(0, its trained std), norms one.

    python dev/random_draft.py --out /tmp/random-draft [--like ssdlib/assets/smollm2-135m-draft]
"""
from __future__ import annotations

import argparse
import os
import shutil

import torch
from safetensors.torch import load_file, save_file


def randomize(like: str, out: str, seed: int = 0) -> None:
    os.makedirs(out, exist_ok=True)
    for name in ("config.json", "tokenizer_source.json"):
        if os.path.isfile(os.path.join(like, name)):
            shutil.copy(os.path.join(like, name), os.path.join(out, name))
    g = torch.Generator().manual_seed(seed)
    tensors = load_file(os.path.join(like, "model.safetensors"))
    random = {}
    for key, t in tensors.items():
        if t.dim() == 1:
            random[key] = torch.ones_like(t)
        else:
            std = t.float().std().item()
            random[key] = (torch.randn(t.shape, generator=g) * std).to(t.dtype)
    save_file(random, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--like", default="ssdlib/assets/smollm2-135m-draft")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    randomize(a.like, a.out, a.seed)


if __name__ == "__main__":
    main()
