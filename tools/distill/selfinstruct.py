"""Data the target writes itself: requests and answers in its own chat format.

* ``selfinstruct`` (two stages): sample a user turn from the chat prefix up to the end-of-turn
  token (temperature 1.0), then template it and sample the assistant's answer (0.7, top-p 0.95).
  Writing both in one pass makes an instruct model loop on its turn markers. With openers
  (``TASK_OPENERS``, the default of the tools' ``--selfinstruct-openers tasks``) most user turns
  start with the first words of a task of one kind (writing, reasoning, math, STEM, extraction,
  roleplay, coding, advice, ...) and the target writes the rest, so the requests spread over the
  kinds of chat a draft serves instead of the few the target drifts to on its own.
* ``multiturn``: a self-instruct request and the target's answer, then a follow-up user turn
  the target writes in that context, and its answer to it (scored from the second answer).
* ``docinstruct``: requests built from the docstrings of functions in installed packages
  ("write a function ..."), answered by the target.
* ``random-target-samples``: continuations of a few random token ids, for targets without a
  tokenizer (tests).
"""

from __future__ import annotations

import ast
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tools.distill import sampler
from tools.distill.data import Docs, iter_texts

MARK = "\x00SSDLIB_USER_TURN\x00"
DOC_REQUESTS = (
    "Write a Python function `{sig}` that does the following:\n{doc}",
    "Implement `{sig}` in Python.\n\n{doc}",
    "Complete this Python function:\n\n```python\ndef {sig}:\n    \"\"\"{doc}\"\"\"\n```",
    "Explain what this function does and write an implementation:\n`{sig}`: {doc}",
)


# First words of user turns, by kind of task; "" lets the target start the turn itself.
TASK_OPENERS = (
    "", "", "", "",
    # writing
    "Write a short story about", "Write a poem about", "Write an email to", "Draft a",
    "Rewrite the following sentence", "Write a blog post about",
    # reasoning and math
    "Why does", "What would happen if", "Solve", "Calculate", "If a train", "Prove that",
    "What is the probability that",
    # STEM and knowledge
    "Explain how", "What is the difference between", "How does", "Describe the process of",
    "What are the main causes of",
    # extraction and summarising
    "Summarize the following text:", "Extract the", "List the key points of",
    "Classify the following",
    # roleplay
    "Pretend you are", "You are a", "Act as",
    # coding
    "Write a Python function that", "Fix this code:", "How do I", "Write a SQL query that",
    "What does this code do?", "Write a JavaScript function",
    # advice, planning, comparison
    "Give me", "Compare", "Plan a", "Recommend", "Translate", "What are some tips for",
)


def unit_fraction(value: str) -> float:
    """argparse type: a number in [0, 1]."""
    f = float(value)
    if not 0.0 <= f <= 1.0:
        raise ValueError(value)
    return f


unit_fraction.__name__ = "fraction in [0, 1]"


def answer_temperatures(n: int, s: "GenSettings") -> list[float]:
    """The temperatures of ``n`` training answers: every one whose index crosses a multiple of
    1 / ``s.greedy_answers`` is greedy (0.0), the others ``s.answer_temperature``."""
    f = s.greedy_answers
    return [0.0 if int((i + 1) * f) > int(i * f) else s.answer_temperature for i in range(n)]


@dataclass
class GenSettings:
    """How the target samples data (defaults from the measured recipe in DRAFT_NOTES)."""

    user_max_tokens: int = 96
    user_temperature: float = 1.0
    answer_max_tokens: int = 320
    answer_temperature: float = 0.7
    # the fraction of training answers decoded greedily, spread evenly (the rest sampled at
    # answer_temperature): greedy SD's acceptance is measured along greedy answers, which a
    # sampled-only corpus holds none of (the held-out answers are greedy)
    greedy_answers: float = 0.0
    top_p: float = 0.95
    batch_size: int = 64
    deadline: float | None = None  # time.monotonic(): sampling stops there (sampler.generate)
    graphs: bool = False  # decode forwards as captured steps (sampler.DecodeGraphs)
    stats: dict = field(default_factory=dict)  # the sampler's counters, summed over calls

    def sample(self, model, prompts, max_new_tokens, temperature, top_p, stop_ids, gen,
               on_batch=None):
        """sampler.generate with these settings' batch size, deadline and stats."""
        return sampler.generate(model, prompts, max_new_tokens, temperature, top_p, stop_ids,
                                gen, self.batch_size, on_batch, deadline=self.deadline,
                                stats=self.stats, graphs=self.graphs)


class ChatFormat:
    """The target's chat template, cut where the user's text goes."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        text = tokenizer.apply_chat_template([{"role": "user", "content": MARK}],
                                             add_generation_prompt=True)
        if MARK not in text:
            raise ValueError("the chat template does not show the user's message")
        prefix, suffix = text.split(MARK, 1)
        self.user_prefix = tokenizer.encode(prefix, add_special_tokens=False)
        suffix_ids = tokenizer.encode(suffix, add_special_tokens=False)
        # the user turn ends at the template's first token after the message (<|im_end|>)
        self.turn_end = set(tokenizer.eos_token_ids) | ({suffix_ids[0]} if suffix_ids else set())

    def prompt(self, user_text: str) -> list[int]:
        return self.conversation([user_text])

    def _templated(self, turns: list[str]) -> str:
        """User and assistant turns (alternating, the user's first) with the assistant's
        generation prompt, as text."""
        messages = [{"role": ("user", "assistant")[i % 2], "content": t}
                    for i, t in enumerate(turns)]
        return self.tok.apply_chat_template(messages, add_generation_prompt=True)

    def conversation(self, turns: list[str]) -> list[int]:
        """User and assistant turns (alternating, the user's first and last), templated with
        the assistant's generation prompt."""
        return self.tok.encode(self._templated(turns), add_special_tokens=False)

    def next_user_prefix(self, turns: list[str]) -> list[int]:
        """The conversation so far (user, assistant, ...) and the start of the next user turn,
        where its text goes."""
        text = self._templated(turns + [MARK])
        return self.tok.encode(text.split(MARK, 1)[0], add_special_tokens=False)


def answer_prompts(model, chat: ChatFormat, prompts: list[list[int]], s: GenSettings, gen,
                   temperature: float | list[float],
                   on_batch: Callable[[int], None] | None = None
                   ) -> list[tuple[list[int], int] | None]:
    """Sample the target's answer after each templated prompt (``temperature``: one, or one per
    prompt; 0 is greedy). Per prompt: (prompt + answer ids, first answer index), or None when
    no answer token was sampled (the deadline passed)."""
    outs = s.sample(model, prompts, s.answer_max_tokens, temperature, s.top_p,
                    chat.tok.eos_token_ids, gen, on_batch)
    return [(p + new, len(p)) if new else None for p, (new, _) in zip(prompts, outs)]


def answer_each(model, chat: ChatFormat, requests: list[str], s: GenSettings, gen,
                temperature: float | list[float],
                on_batch: Callable[[int], None] | None = None) -> list[tuple[list[int], int] | None]:
    """Stage 2: template each request and sample the target's answer (:func:`answer_prompts`)."""
    return answer_prompts(model, chat, [chat.prompt(r) for r in requests], s, gen, temperature,
                          on_batch)


def answer(model, chat: ChatFormat, requests: list[str], s: GenSettings, gen,
           temperature: float | list[float], source: str,
           on_batch: Callable[[int], None] | None = None) -> Docs:
    """Stage 2 as documents: prompt + answer, scored from the first answer token."""
    docs = Docs()
    for item in answer_each(model, chat, requests, s, gen, temperature, on_batch):
        if item is not None:
            docs.add(item[0], item[1], source)
    return docs


def _turn_said(chat: ChatFormat, new: list[int], stopped: bool) -> str | None:
    """What a sampled user turn says (decoded, without its turn-end token), or None when it did
    not end or says too little."""
    said = chat.tok.decode(new[:-1] if stopped else new)
    return said if stopped and len(said.strip()) >= 8 else None


def user_turns(model, chat: ChatFormat, n: int, s: GenSettings, gen,
               on_batch: Callable[[int], None] | None = None, max_rounds: int = 8,
               openers: tuple[str, ...] = ("",), seed: int = 0) -> list[str]:
    """Stage 1: ``n`` distinct user requests sampled from the chat prefix (only ones that ended
    with the turn-end token and say something). Each sampled turn starts with an opener drawn
    from ``openers`` (seeded), which the target continues; "" leaves the start to it."""
    rng = random.Random(seed)
    found: list[str] = []
    seen: set[str] = set()
    for _ in range(max_rounds):
        want = n - len(found)
        if want <= 0:
            break
        k = max(s.batch_size, int(want * 1.25) + 1)
        starts = [rng.choice(openers) for _ in range(k)]
        prompts = [chat.user_prefix + (chat.tok.encode(o, add_special_tokens=False) if o else [])
                   for o in starts]
        outs = s.sample(model, prompts, s.user_max_tokens, s.user_temperature,
                        1.0, chat.turn_end, gen, on_batch)
        for opener, (new, stopped) in zip(starts, outs):
            said = _turn_said(chat, new, stopped)
            if said is None:
                continue
            text = (opener + said).strip()
            if text not in seen:
                seen.add(text)
                found.append(text)
    return found[:n]


def follow_ups(model, chat: ChatFormat, pairs: list[tuple[str, str]], s: GenSettings, gen,
               on_batch: Callable[[int], None] | None = None) -> list[str | None]:
    """A second user turn for each (request, answer) conversation, sampled in its context;
    None where the turn did not end or says too little."""
    prompts = [chat.next_user_prefix([u, a]) for u, a in pairs]
    outs = s.sample(model, prompts, s.user_max_tokens, s.user_temperature, 1.0, chat.turn_end,
                    gen, on_batch)
    said = [_turn_said(chat, new, stopped) for new, stopped in outs]
    return [None if t is None else t.strip() for t in said]


def multiturn(model, chat: ChatFormat, requests: list[str], s: GenSettings, gen,
              temperature: float | list[float],
              progress: Callable[[str, int], Callable[[int], None]]
              ) -> list[tuple[list[int], int] | None]:
    """Two-turn conversations from ``requests``: the target's answer, a follow-up user turn it
    writes, its answer to that (``temperature``: per request, both answers). Per request:
    (conversation ids, first id of the second answer), or None where a stage gave nothing."""
    temps = temperature if isinstance(temperature, list) else [temperature] * len(requests)
    first = answer_each(model, chat, requests, s, gen, temps,
                        progress("multiturn answers", len(requests)))
    pairs, keep = [], []
    for i, item in enumerate(first):
        if item is not None:
            ids, start = item
            reply = chat.tok.decode([t for t in ids[start:] if t not in chat.tok.eos_token_ids])
            pairs.append((requests[i], reply.strip()))
            keep.append(i)
    asks = follow_ups(model, chat, pairs, s, gen, progress("multiturn follow-ups", len(pairs)))
    convs = [(i, [u, a, q]) for i, (u, a), q in zip(keep, pairs, asks) if q is not None]
    second = answer_prompts(model, chat, [chat.conversation(turns) for _, turns in convs], s,
                            gen, [temps[i] for i, _ in convs],
                            progress("multiturn second answers", len(convs)))
    result: list[tuple[list[int], int] | None] = [None] * len(requests)
    for (i, _), item in zip(convs, second):
        result[i] = item
    return result


def docstring_requests(roots: list[str], n: int, seed: int) -> list[str]:
    """``n`` requests made from public functions with docstrings in the files under ``roots``."""
    rng = random.Random(seed)
    out: list[str] = []
    for _, text in iter_texts(roots, seed):
        if len(out) >= n:
            break
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError, RecursionError):
            continue
        funcs = [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
                 and not f.name.startswith("_") and 40 <= len(ast.get_docstring(f) or "") <= 1200]
        for f in rng.sample(funcs, min(len(funcs), 2)):
            args = f.args
            if args.args and args.args[0].arg in ("self", "cls"):
                args.args = args.args[1:]
            sig = f"{f.name}({ast.unparse(args)})"
            doc = ast.get_docstring(f).strip()
            out.append(rng.choice(DOC_REQUESTS).format(sig=sig, doc=doc))
    return out[:n]


def random_target_docs(model, n: int, length: int, gen: torch.Generator, seed: int,
                       batch_size: int, progress: Callable[[int], None] | None = None,
                       settings: GenSettings | None = None) -> Docs:
    """``n`` documents: 1-4 random token ids, then ``length`` tokens the target samples at
    temperature 1 (no tokenizer needed). ``settings``: their deadline and stats apply."""
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 4))] for _ in range(n)]
    if settings is None:
        outs = sampler.generate(model, prompts, length, 1.0, 1.0, (), gen, batch_size, progress)
    else:
        outs = settings.sample(model, prompts, length, 1.0, 1.0, (), gen, progress)
    docs = Docs()
    for p, (new, _) in zip(prompts, outs):
        if new:
            docs.add(p + new, len(p), "random-target-samples")
    return docs
