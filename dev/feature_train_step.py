"""Times one training step of a feature draft (tools/distill/feature_train.py) at SmolLM2-135M's
shape with random weights, and where the step's GPU kernel time goes: the short rows and the long
rows, eager and with the KL loss and the teacher's forward compiled.

    python dev/feature_train_step.py --device cuda [--steps 20] [--ttt-keys uniform] [--profile]
        [--draft-vocab 16384]

Random weights change nothing in a step's cost; no checkpoint or data is needed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from ssdlib.config import ModelConfig  # noqa: E402
from ssdlib.models.feature_draft import FeatureDraft  # noqa: E402
from ssdlib.models.feature_spec import FeatureSpec  # noqa: E402
from ssdlib.models.llama import LlamaForCausalLM  # noqa: E402
from tools.distill.feature_train import (TTT_KEYS, FeatureTrainer,  # noqa: E402
                                         FeatureTrainSettings, init_feature_draft)

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, head_dim=64, rope_theta=100000.0,
               max_position_embeddings=8192, tie_word_embeddings=True)


def random_pair(device: torch.device, dtype: torch.dtype, config: dict, max_positions: int):
    """A random teacher of ``config``'s shape in ``dtype`` and a fused one-layer draft."""
    torch.manual_seed(0)
    with torch.device(device):
        teacher = LlamaForCausalLM(ModelConfig(**config), None, max_positions=max_positions)
    with torch.no_grad():
        for p in teacher.parameters():
            p.copy_(torch.randn_like(p) * 0.02 if p.dim() > 1 else torch.ones_like(p))
            p.data = p.data.to(dtype)
    teacher.eval().requires_grad_(False)
    n = config["num_hidden_layers"]
    spec = FeatureSpec("fused", (1, n // 2, n - 1))
    with torch.device(device):
        draft = FeatureDraft.for_target(teacher, 1, max_positions, spec)
    init_feature_draft(draft, teacher, seed=0, token_gain=290.0)
    return teacher, draft


def time_steps(trainer: FeatureTrainer, ids: torch.Tensor, steps: int) -> float:
    """Milliseconds a step over ``ids`` (after two untimed steps)."""
    for _ in range(2):
        trainer.train_on(ids)
    torch.cuda.synchronize() if ids.is_cuda else None
    t0 = time.perf_counter()
    for _ in range(steps):
        trainer.train_on(ids)
    torch.cuda.synchronize() if ids.is_cuda else None
    return 1e3 * (time.perf_counter() - t0) / steps


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--long-seq-len", type=int, default=4096)
    p.add_argument("--ttt-steps", type=int, default=3)
    p.add_argument("--ttt-keys", choices=TTT_KEYS, default="inference",
                   help="the unroll's keys (tools/distill_feature_draft.py --ttt-keys)")
    p.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                   help="train over N tokens (tools/distill_feature_draft.py --draft-vocab; "
                        "here the first N ids: which ones changes nothing in the cost)")
    p.add_argument("--eager-only", action="store_true",
                   help="only the eager step (no compiles: a CPU's quick measurement)")
    p.add_argument("--small", action="store_true", help="a tiny shape (to check the script)")
    p.add_argument("--profile", action="store_true", help="list the top kernels of a step")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = dict(SMOLLM2)
    if args.small:
        config.update(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    teacher, draft = random_pair(device, dtype, config, max(args.long_seq_len, args.seq_len))
    g = torch.Generator().manual_seed(1)
    short = torch.randint(0, config["vocab_size"], (args.batch, args.seq_len), generator=g)
    long_rows = max(1, args.batch * args.seq_len // args.long_seq_len)
    long = torch.randint(0, config["vocab_size"], (long_rows, args.long_seq_len), generator=g)
    short, long = short.to(device), long.to(device)
    results = {}
    variants = {"eager": {}, "KL compiled": dict(compile_loss=True),
                "KL and teacher compiled": dict(compile_loss=True, compile_teacher=True)}
    if args.eager_only:
        variants = {"eager": {}}
    for variant, flags in variants.items():
        s = FeatureTrainSettings(steps=10 ** 6, lr=1e-4, warmup=1, seq_len=args.seq_len,
                                 ttt_steps=args.ttt_steps, ttt_keys=args.ttt_keys,
                                 token_gain=290.0,
                                 amp_dtype=dtype if dtype != torch.float32 else None, **flags)
        vocab = (None if args.draft_vocab is None
                 else torch.arange(args.draft_vocab, device=device))
        trainer = FeatureTrainer(draft, teacher, None, None, s, vocab)
        trainer._gain(True)
        for name, ids in (("short", short), ("long", long)):
            ms = time_steps(trainer, ids, args.steps)
            key = f"{name}, {variant}"
            results[key] = ms
            print(f"{key}: {ms:.1f} ms a step over {tuple(ids.shape)} "
                  f"({1e3 * ids.numel() / ms:,.0f} tokens/s)", flush=True)
        if args.profile and device.type == "cuda":
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    trainer.train_on(short)
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14,
                                            max_name_column_width=60))
        trainer._gain(False)
    return results


if __name__ == "__main__":
    main()
