"""Cheap backup speculators: suffix n-gram (prompt lookup) and random tokens.

Both declare the q their tokens come from, so the verifier's rule stays exact: an n-gram proposal
is a deterministic function of the sequence so far (q one-hot on the proposed token,
:attr:`QKind.ONEHOT`); random tokens are uniform over the vocabulary (:attr:`QKind.UNIFORM`).
"""

from __future__ import annotations

from array import array
from typing import Sequence

import torch

from ssdlib.errors import ConfigError, require_int
from ssdlib.speculative.acceptance import DraftQ, QKind
from ssdlib.speculative.rng import Generators, RowStream, uniforms

NGRAM_Q = QKind.ONEHOT
RANDOM_Q = QKind.UNIFORM


def propose_ngram(tokens: Sequence[int] | torch.Tensor, K: int, max_ngram: int = 3,
                  min_ngram: int = 1) -> list[int] | None:
    """Up to K tokens predicted by copying what followed the most recent earlier occurrence of the
    longest suffix n-gram (n from max_ngram down to min_ngram); None if no suffix recurs.

    The proposal always has K tokens: when the copy reaches the end of the sequence it continues
    from the proposal itself (LZ77-style overlapping copy), i.e. the matched stretch is assumed to
    repeat -- exactly right for the loops n-gram lookup is good at.
    """
    require_int("K", K, 0)
    if not 1 <= min_ngram <= max_ngram:
        raise ConfigError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
    seq = (tokens.reshape(-1).tolist() if isinstance(tokens, torch.Tensor) else list(tokens))
    L = len(seq)
    # the search runs over the tokens' bytes (8 per token) with bytes.rfind: C speed, no tensor
    # ops (this runs per row on the leader's host, between two verify forwards)
    data = array("q", seq).tobytes()
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        suffix = data[8 * (L - n):]
        # windows starting at j = 0..L-n-1: all earlier than the suffix, each followed by a token
        pos = data.rfind(suffix, 0, 8 * (L - 1))
        while pos > 0 and pos % 8:  # a match across token boundaries: look further left
            pos = data.rfind(suffix, 0, pos + len(suffix) - 1)
        if pos >= 0:
            start = pos // 8 + n                                   # first copied position
            proposal = seq[start:start + K]
            for i in range(len(proposal), K):
                proposal.append(proposal[start + i - L])           # = (seq + proposal)[start + i]
            return proposal
    return None


def propose_random(vocab_size: int, K: int, generator: torch.Generator | None = None) -> list[int]:
    """K tokens drawn uniformly from [0, vocab_size)."""
    if vocab_size < 1 or K < 0:
        raise ConfigError(f"need vocab_size >= 1 and K >= 0, got {vocab_size}, {K}")
    return torch.randint(vocab_size, (K,), generator=generator,
                         device=generator.device if generator is not None else "cpu").tolist()


def random_tokens(generators: Generators, rows: int, K: int, vocab_size: int) -> torch.Tensor:
    """K uniform random tokens per row: [rows, K] int64 (K uniforms per row, see rng)."""
    u = uniforms(generators, rows, K)                              # [rows, K]
    return (u * vocab_size).long().clamp(max=vocab_size - 1)


def random_tokens_host(streams: Sequence[RowStream], K: int, vocab_size: int) -> list[list[int]]:
    """:func:`random_tokens` drawn on the host from the rows' streams (the same tokens)."""
    return [[min(int(u * vocab_size), vocab_size - 1) for u in s.uniforms_host(K)]
            for s in streams]


def ngram_or_random(sequences: Sequence[Sequence[int] | torch.Tensor], K: int, vocab_size: int,
                    generators: Generators = None, max_ngram: int = 3,
                    min_ngram: int = 1,
                    random_rows: list[list[int]] | None = None) -> tuple[torch.Tensor, DraftQ]:
    """Batch backup: the n-gram proposal where a suffix recurs, random tokens elsewhere.

    Returns tokens [b, K] int64 and their DraftQ (one-hot / uniform per row). Randomness follows
    :mod:`ssdlib.speculative.rng` (K uniforms per row, drawn for every row), from ``generators``
    or already drawn as ``random_rows`` ([b][K] tokens, :func:`random_tokens_host`).
    """
    b = len(sequences)
    if random_rows is not None and generators is not None:
        raise ValueError("give generators or random_rows, not both")
    if random_rows is None:
        random_rows = random_tokens(generators, b, K, vocab_size).tolist()
    tokens, kinds = [], []
    for seq, fallback in zip(sequences, random_rows):
        proposal = propose_ngram(seq, K, max_ngram, min_ngram)
        tokens.append(fallback if proposal is None else proposal)
        kinds.append(RANDOM_Q if proposal is None else NGRAM_Q)
    return torch.tensor(tokens, dtype=torch.int64).reshape(b, K), DraftQ.per_row(kinds)


def kept_prefix(proposal: Sequence[int] | None, known: Sequence[int]) -> int:
    """How many tokens of a one-hot ``proposal`` (None: no proposal) the verified ``known``
    tokens keep: the shared prefix, up to the first that differs or the end of ``known``."""
    kept = 0
    if proposal is not None:
        while kept < len(known) and proposal[kept] == known[kept]:
            kept += 1
    return kept


def propose_ngram_device(history: torch.Tensor, lengths: torch.Tensor, K: int,
                         max_ngram: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`propose_ngram`'s rule (``min_ngram`` 1) on the device, batched, with nothing read
    back: history [b, H] the rows' tokens (row i's first ``lengths[i]`` are its sequence; the
    rest any values), lengths [b] -> (tokens [b, K], found [b] bool; tokens are zeros where no
    suffix recurs). Every n at once, in a fixed number of kernels (a chained round runs it in
    its captured steps): its shapes depend on b, H and K only."""
    b, H = history.shape
    N = min(max_ngram, H - 1)
    dev = history.device
    L = lengths.view(-1, 1)                                           # [b, 1]
    # the suffix's last N tokens, newest first: suffix[:, t] = token at L - 1 - t
    back = (L - 1 - torch.arange(N, device=dev)).clamp(min=0)         # [b, N]
    suffix = history.gather(1, back)
    # eq[:, t, j]: token j equals the suffix's t-th newest
    eq = history.unsqueeze(1) == suffix.unsqueeze(-1)                 # [b, N, H]
    j = torch.arange(H, device=dev)
    # match[:, n - 1, j]: the n tokens at j .. j + n - 1 are the suffix's n last, i.e. token
    # j + n - 1 - t is the t-th newest: match_n[j] = eq[n - 1, j] & match_{n-1}[j + 1] (the
    # shift wraps at the end, where no window of n fits: masked below)
    match = torch.empty(b, N, H, dtype=torch.bool, device=dev)
    match[:, 0] = eq[:, 0]
    for n in range(2, N + 1):
        match[:, n - 1] = eq[:, n - 1] & torch.roll(match[:, n - 2], -1, dims=1)
    ns = torch.arange(1, N + 1, device=dev).view(1, -1, 1)            # [1, N, 1]
    valid = (j.view(1, 1, -1) <= L.view(-1, 1, 1) - ns - 1) & (L.view(-1, 1, 1) > ns)
    last = torch.where(match & valid, j.view(1, 1, -1), -1).amax(dim=2)  # [b, N]
    # the longest n that recurs
    has = last >= 0                                                   # [b, N]
    n_best = (has * ns.view(1, -1)).amax(dim=1)                       # [b]; 0: none
    found = n_best > 0
    at_n = last.gather(1, (n_best - 1).clamp(min=0).view(-1, 1))      # [b, 1]
    first = (at_n + n_best.view(-1, 1)).clamp(min=0)                  # first copied position
    period = (L - first).clamp(min=1)                                 # the copy's repeat
    at = first + torch.arange(K, device=dev).view(1, -1) % period     # [b, K]
    tokens = history.gather(1, at.clamp(max=H - 1))
    return torch.where(found.view(-1, 1), tokens, torch.zeros_like(tokens)), found
