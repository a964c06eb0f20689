"""TP 2 on two GPUs with CUDA graphs (the captured steps include the NCCL all-reduces and the
vocab all-gather): greedy fp32 tokens equal TP 1's, for AR and SD. Skipped without 2 GPUs."""

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")]


def _generate(tiny_dirs, **kw):
    from ssdlib import Generator, SamplingParams

    # lengths that take every path: a captured decode/verify step, a captured single-row
    # prefill bucket (> 64 tokens), an eager short prefill, and a two-row prefill captured on
    # first use (admitted together)
    prompts = [[3 + (7 * i) % 80 for i in range(n)] for n in (5, 90, 12, 70)]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    with Generator(target=tiny_dirs["smol_heads"], device="cuda", dtype="float32", max_len=256,
                   max_batch=2, **kw) as g:
        return [o.token_ids for o in g.generate(prompts, params)]


def test_tp2_graphs_equal_tp1(tiny_dirs):
    ref = _generate(tiny_dirs, tp=1)
    assert _generate(tiny_dirs, tp=2) == ref
    assert _generate(tiny_dirs, tp=2, mode="sd", draft=tiny_dirs["smol_heads_draft"], k=3) == ref
