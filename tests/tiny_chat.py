"""A tiny chat model for tests: a tiny random Llama (tests.tiny) with a character-level tokenizer
and a ChatML template, so chat and text prompts run in milliseconds without SmolLM2."""

from __future__ import annotations

import json
import os
import string

from tests.tiny import make_tiny_llama

SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]  # ids 0..4; EOS = 2
CHARS = string.ascii_letters + string.digits + " .,?!:'\n"
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_char_tokenizer(directory: str, template: str = TEMPLATE) -> int:
    """Write tokenizer.json + tokenizer_config.json to ``directory``; returns the token count."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    vocab = {t: i for i, t in enumerate(SPECIALS + list(CHARS))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok.decoder = decoders.Fuse()
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                   "add_bos_token": False, "chat_template": template}, f)
    return len(vocab)


def make_tiny_chat_model(directory: str, vocab_size: int = 90, seed: int = 0,
                         template: str = TEMPLATE) -> str:
    """The smol_heads tiny Llama (``vocab_size`` embedding rows) with the character tokenizer."""
    make_tiny_llama(directory, "smol_heads", seed=seed, scale=2.0, vocab_size=vocab_size)
    n = write_char_tokenizer(directory, template)
    assert n <= vocab_size, (n, vocab_size)
    return directory
