"""Assemble the training and held-out documents from the sources a run asks for."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tools.distill import selfinstruct
from tools.distill.data import SOURCES, Docs, pysrc_docs, split_held_out
from tools.distill.selfinstruct import GenSettings

NEEDS_TOKENIZER = ("selfinstruct", "docinstruct", "pysrc", "multiturn")


@dataclass
class SourceSettings:
    sources: list[str]
    selfinstruct_samples: int
    docinstruct_samples: int
    random_samples: int
    random_len: int
    pysrc_tokens: int
    eval_samples: int
    text_roots: list[str]
    seed: int
    gen: GenSettings
    # the first words of self-instruct user turns (selfinstruct.TASK_OPENERS), ("",): none
    selfinstruct_openers: tuple[str, ...] = ("",)
    multiturn_samples: int = 0  # two-turn conversations (source "multiturn")
    # (index, count): this run makes shard ``index`` of ``count`` (tools/distill_data.py): its
    # sampling seed differs from the others', its docstring requests are its own slice of one
    # shared list, pysrc is shard 0's only. The counts above are this shard's.
    shard: tuple[int, int] = (0, 1)

    def sampling_seed(self) -> int:
        index, count = self.shard
        return self.seed if count == 1 else self.seed + 7919 * (index + 1)


OPENER_SETS = {"tasks": selfinstruct.TASK_OPENERS, "none": ("",)}


def parse_sources(spec: str) -> list[str]:
    names = [s.strip() for s in spec.split(",") if s.strip()]
    bad = [s for s in names if s not in SOURCES]
    if bad or not names:
        raise ValueError(f"--data: unknown source(s) {bad or spec!r}; choose from "
                         f"{', '.join(SOURCES)}")
    return names


def build_splits(teacher, tokenizer, cfg: SourceSettings, device: torch.device,
                 progress: Callable[[str, int], Callable[[int], None]],
                 samples_path: str | None = None) -> tuple[Docs, Docs]:
    """(train, held_out) documents. ``progress(label, total)`` returns a callback advanced by the
    number of sequences sampled; ``samples_path`` receives the generated requests and answers as
    JSON lines for inspection."""
    if tokenizer is None and any(s in NEEDS_TOKENIZER for s in cfg.sources):
        raise ValueError(f"the target has no tokenizer: --data {','.join(cfg.sources)} needs "
                         "one; use --data random-target-samples")
    gen = torch.Generator(device=device).manual_seed(cfg.sampling_seed())
    index, count = cfg.shard
    train, held = Docs(), Docs()
    records: list[dict] = []

    def generated(source: str, requests: list[str], n: int) -> None:
        # up to n requests train (sampled answers), the last eval_samples are held out (greedy
        # answers: agreement is then measured on what the target itself would say); both in one
        # sampling pass (per-row temperatures)
        if len(requests) < 2:
            raise ValueError(f"{source}: only {len(requests)} requests could be made")
        n_eval = min(cfg.eval_samples, len(requests) // 2)
        tr_req = requests[:len(requests) - n_eval][:n]
        ev_req = requests[len(requests) - n_eval:]
        temps = selfinstruct.answer_temperatures(len(tr_req), cfg.gen) + [0.0] * len(ev_req)
        if source == "multiturn":
            items = selfinstruct.multiturn(teacher, chat, tr_req + ev_req, cfg.gen, gen, temps,
                                           progress)
        else:
            items = selfinstruct.answer_each(teacher, chat, tr_req + ev_req, cfg.gen, gen,
                                             temps, progress(f"{source} answers", len(temps)))
        tr, ev = Docs(), Docs()
        for i, item in enumerate(items):
            if item is not None:
                (tr if i < len(tr_req) else ev).add(item[0], item[1], source)
        train.extend(tr)
        held.extend(ev)
        for split, docs in (("train", tr), ("eval", ev)):
            for ids, start in zip(docs.ids, docs.score_from):
                records.append({"source": source, "split": split,
                                "prompt": tokenizer.decode(ids[:start], skip_special_tokens=False),
                                "answer": tokenizer.decode(ids[start:], skip_special_tokens=False)})

    chat = None
    if {"selfinstruct", "docinstruct", "multiturn"} & set(cfg.sources):
        chat = selfinstruct.ChatFormat(tokenizer)

    if "selfinstruct" in cfg.sources:
        n = cfg.selfinstruct_samples
        requests = selfinstruct.user_turns(teacher, chat, n + cfg.eval_samples, cfg.gen, gen,
                                           progress("self-instruct requests", n + cfg.eval_samples),
                                           openers=cfg.selfinstruct_openers,
                                           seed=cfg.sampling_seed())
        generated("selfinstruct", requests, n)
    if "multiturn" in cfg.sources and cfg.multiturn_samples > 0:
        n = cfg.multiturn_samples
        requests = selfinstruct.user_turns(teacher, chat, n + cfg.eval_samples, cfg.gen, gen,
                                           progress("multiturn requests", n + cfg.eval_samples),
                                           openers=cfg.selfinstruct_openers,
                                           seed=cfg.sampling_seed() + 1)
        generated("multiturn", requests, n)
    if "docinstruct" in cfg.sources:
        n = cfg.docinstruct_samples
        # every shard lists the same requests (base seed) and takes its own slice
        requests = selfinstruct.docstring_requests(cfg.text_roots, (n + cfg.eval_samples) * count,
                                                   cfg.seed)[index::count]
        generated("docinstruct", requests, n)
    if "pysrc" in cfg.sources and index == 0:
        docs = pysrc_docs(tokenizer, cfg.text_roots, cfg.pysrc_tokens, cfg.seed)
        tr, ev = split_held_out(docs, min(cfg.eval_samples, len(docs) // 10), cfg.seed)
        train.extend(tr)
        held.extend(ev)
    if "random-target-samples" in cfg.sources:
        n, m = cfg.random_samples, cfg.eval_samples
        docs = selfinstruct.random_target_docs(teacher, n + m, cfg.random_len, gen,
                                               cfg.sampling_seed(), cfg.gen.batch_size,
                                               progress("target samples", n + m), cfg.gen)
        tr, ev = split_held_out(docs, m, cfg.seed)
        train.extend(tr)
        held.extend(ev)
    if samples_path and records:
        with open(samples_path, "w") as f:
            for r in records:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return train, held
