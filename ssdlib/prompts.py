"""Prompts -> token ids and engine requests, checked against the target before any rank starts.

A prompt is a string, a list of token ids, or a dict with exactly one of ``"prompt"`` (string),
``"messages"`` (chat messages) or ``"prompt_ids"`` (token ids).
"""

from __future__ import annotations

from collections.abc import Mapping

from ssdlib.engine.leader.sequence import Request
from ssdlib.errors import ConfigError
from ssdlib.sampling import SamplingParams

Prompt = str | list[int] | dict
PROMPT_KEYS = ("prompt", "messages", "prompt_ids")


def _is_token_id(t: object) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def is_single_prompt(prompts: object) -> bool:
    """True for one prompt given where a list of prompts is expected (a string, a dict, or a flat
    list of token ids), so ``generate("Hello")`` means one prompt, not five one-letter ones."""
    if isinstance(prompts, (str, Mapping)):
        return True
    return isinstance(prompts, (list, tuple)) and bool(prompts) and all(map(_is_token_id, prompts))


class PromptEncoder:
    """Encodes prompts with the target's tokenizer; checks ids and length against the target.

    In chat messages, text that spells a special token (``<|im_start|>``) is plain text: only the
    chat template writes control tokens, so a message cannot forge a turn. Set
    ``allow_special_tokens_in_content`` to let message contents write them too.
    """

    def __init__(self, tokenizer, vocab_size: int, max_context: int,
                 allow_special_tokens_in_content: bool = False):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.allow_special_tokens_in_content = allow_special_tokens_in_content

    def encode(self, prompt: Prompt, chat: bool = False) -> list[int]:
        """A prompt (text, token ids, or a dict, see the module docstring) -> token ids."""
        if isinstance(prompt, Mapping):
            given = [k for k in PROMPT_KEYS if k in prompt]
            unknown = sorted(str(k) for k in prompt if k not in PROMPT_KEYS)
            if len(given) != 1 or unknown:
                raise ConfigError(f"a prompt dict takes exactly one of {', '.join(PROMPT_KEYS)}"
                                  + (f"; unknown key(s): {', '.join(unknown)}" if unknown else ""))
            value = prompt[given[0]]
            if given[0] == "messages":
                if not isinstance(value, (list, tuple)) or not value:
                    raise ConfigError("'messages' must be a non-empty list of chat messages")
                return self._encode_chat(value)
            if given[0] == "prompt" and not isinstance(value, str):
                raise ConfigError(f"'prompt' must be a string, got {type(value).__name__}")
            if given[0] == "prompt_ids" and not isinstance(value, (list, tuple)):
                raise ConfigError(f"'prompt_ids' must be a list of token ids, got "
                                  f"{type(value).__name__}")
            return self.encode(value, chat=chat and given[0] == "prompt")
        if isinstance(prompt, (list, tuple)):
            if not prompt or not all(map(_is_token_id, prompt)):
                raise ConfigError("a token-id prompt must be a non-empty list of integers")
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise ConfigError(f"token id {bad[0]} is outside the vocabulary "
                                  f"(size {self.vocab_size})")
            return list(prompt)
        if not isinstance(prompt, str):
            raise ConfigError(f"a prompt must be a string, a token-id list or a dict, got "
                              f"{type(prompt).__name__}")
        if self.tokenizer is None:
            raise ConfigError("this checkpoint has no tokenizer: give prompts as token-id lists")
        if not prompt:
            raise ConfigError("the prompt is empty")
        if chat:
            return self._encode_chat([{"role": "user", "content": prompt}])
        ids = self.tokenizer.encode(prompt)
        if not ids:
            raise ConfigError("the prompt is empty")
        return ids

    def _encode_chat(self, messages) -> list[int]:
        if self.tokenizer is None:
            raise ConfigError("this checkpoint has no tokenizer: chat prompts need one")
        return self.tokenizer.encode_chat(
            messages, add_generation_prompt=True,
            allow_special_tokens_in_content=self.allow_special_tokens_in_content)

    def fits(self, ids: list[int]) -> bool:
        """Whether a prompt of these ids leaves room for at least one generated token."""
        return len(ids) < self.max_context - 1

    def requests(self, prompts: list, params: SamplingParams | list | tuple | None,
                 chat: bool) -> list[Request]:
        """One validated :class:`Request` per prompt (``params``: one for all, or one each)."""
        plist = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ConfigError(f"give one SamplingParams, or one per prompt ({len(prompts)} "
                              f"prompts, {len(plist)} SamplingParams)")
        reqs = []
        for i, (prompt, p) in enumerate(zip(prompts, plist)):
            if p is not None and not isinstance(p, SamplingParams):
                raise ConfigError(f"params must be SamplingParams, got {type(p).__name__}")
            p = (p or SamplingParams()).validate()
            ids = self.encode(prompt, chat)
            if not self.fits(ids):
                raise ConfigError(f"prompt {i} has {len(ids)} tokens, longer than the context "
                                  f"({self.max_context} tokens incl. the answer; see --max-len)")
            reqs.append(Request(i, ids, p))
        return reqs
