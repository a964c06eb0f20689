"""SmolLM2-135M from the pip package: ssdlib's greedy continuation of chat prompts equals HF
transformers' greedy continuation of the same GGUF, token for token (32 tokens each)."""

import pytest
import torch

PROMPTS = ["What is the capital of France?", "Write a Python function that adds two numbers.",
           "Give me three tips for sleeping better."]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_matches_transformers(smollm2_path, hf_gguf_model, prompt):
    from ssdlib import Generator, SamplingParams

    with Generator(target=smollm2_path, max_len=512) as gen:
        ids = gen.encode(prompt, chat=True)
        out = gen.generate([ids], SamplingParams(max_new_tokens=32, ignore_eos=True))[0]
    with torch.no_grad():
        ref = hf_gguf_model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                     eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    assert out.token_ids == ref
