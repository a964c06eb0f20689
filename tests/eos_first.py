"""A prompt whose greedy first token is EOS under a tiny target (found by search)."""

import torch

EOS = 2  # tests.tiny's eos_token_id


def find_eos_first_prompt(target_dir: str) -> list[int] | None:
    from ssdlib.loading import load_checkpoint
    from ssdlib.models.llama import LlamaForCausalLM

    ck = load_checkpoint(target_dir)
    m = LlamaForCausalLM(ck.config, None, 64)
    m.load_weights(ck.weights)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _ in range(20):
            cand = torch.randint(3, ck.config.vocab_size, (512, 4), generator=g)
            first = m.forward_full(cand)[:, -1].argmax(-1)
            hit = (first == EOS).nonzero()
            if len(hit):
                return cand[int(hit[0, 0])].tolist()
    return None
