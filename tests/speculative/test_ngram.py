"""Suffix n-gram and random backup proposers."""

import pytest
import torch

from ssdlib.errors import ConfigError
from ssdlib.speculative import QKind, ngram_or_random, propose_ngram, propose_random
from ssdlib.speculative.ngram import NGRAM_Q, RANDOM_Q


@pytest.mark.parametrize("tokens, K, kw, expected", [
    ([1, 2, 3, 4, 1, 2, 3], 3, {}, [4, 1, 2]),               # trigram suffix recurs
    ([7, 8, 1, 7, 9, 2, 7], 3, {"max_ngram": 1}, [9, 2, 7]),  # most recent occurrence wins
    ([1, 2, 5, 3, 2, 6, 1, 2], 3, {}, [5, 3, 2]),             # longest suffix beats a later unigram
    ([1, 2, 5, 3, 2, 6, 1, 2], 3, {"max_ngram": 1}, [6, 1, 2]),
    ([1, 2, 3, 4], 3, {}, None),                              # nothing recurs
    ([3, 9, 1, 3], 2, {"min_ngram": 2}, None),                # only a unigram would match
    ([3, 9, 1, 3], 2, {}, [9, 1]),
    ([1, 2, 3, 1, 2, 3], 8, {}, [1, 2, 3, 1, 2, 3, 1, 2]),   # copy runs past the end: repeats
    ([4, 4], 3, {}, [4, 4, 4]),
    ([5, 6, 5], 4, {}, [6, 5, 6, 5]),
    ([5], 3, {}, None),                                       # too short to recur
    ([], 3, {}, None),
    ([1, 2, 1], 0, {}, []),
])
def test_propose_ngram(tokens, K, kw, expected):
    assert propose_ngram(tokens, K, **kw) == expected
    assert propose_ngram(torch.tensor(tokens, dtype=torch.long), K, **kw) == expected


def test_propose_ngram_errors():
    with pytest.raises(ConfigError):
        propose_ngram([1, 2], -1)
    with pytest.raises(ConfigError):
        propose_ngram([1, 2], 2, max_ngram=1, min_ngram=2)
    with pytest.raises(ConfigError):
        propose_ngram([1, 2], 2, min_ngram=0)


def test_propose_random_is_reproducible_and_in_range():
    a = propose_random(50, 1000, torch.Generator().manual_seed(3))
    assert a == propose_random(50, 1000, torch.Generator().manual_seed(3))
    assert len(a) == 1000 and min(a) >= 0 and max(a) < 50 and len(set(a)) > 40


def test_declared_q_kinds():
    assert NGRAM_Q == QKind.ONEHOT and RANDOM_Q == QKind.UNIFORM


def test_ngram_or_random_batch():
    seqs = [[1, 2, 3, 1, 2], [9, 8, 7], torch.tensor([4, 4, 4])]
    tokens, q = ngram_or_random(seqs, 3, vocab_size=10, generators=torch.Generator().manual_seed(0))
    assert tokens.shape == (3, 3)
    assert tokens[0].tolist() == [3, 1, 2] and tokens[2].tolist() == [4, 4, 4]
    assert q.kinds.tolist() == [QKind.ONEHOT, QKind.UNIFORM, QKind.ONEHOT]
    assert ((tokens[1] >= 0) & (tokens[1] < 10)).all()


def _reference_ngram(seq, K, max_ngram=3, min_ngram=1):
    """The plain rule: the most recent earlier occurrence of the longest suffix n-gram, its
    continuation copied (overlapping past the end)."""
    L = len(seq)
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        for j in range(L - n - 1, -1, -1):
            if seq[j:j + n] == seq[L - n:]:
                ext = list(seq)
                while len(ext) < j + n + K:
                    ext.append(ext[len(ext) - (L - j - n)])
                return ext[j + n:j + n + K]
    return None


@pytest.mark.parametrize("vocab", [2, 5, 300, 70000])
def test_propose_ngram_matches_the_plain_rule(vocab):
    """Random sequences (small vocabularies: many recurrences; values whose bytes repeat across
    token boundaries, e.g. 256 = 00 01 00 ..., so a byte search must skip misaligned hits)."""
    g = torch.Generator().manual_seed(vocab)
    for trial in range(300):
        L = int(torch.randint(0, 40, (1,), generator=g))
        seq = torch.randint(0, vocab, (L,), generator=g).tolist()
        if vocab == 300:  # tokens 0, 1, 256, 257: byte patterns that straddle tokens
            seq = [[0, 1, 256, 257][t % 4] for t in seq]
        K = int(torch.randint(0, 6, (1,), generator=g))
        for kw in ({}, {"max_ngram": 1}, {"max_ngram": 4, "min_ngram": 2}):
            assert propose_ngram(seq, K, **kw) == _reference_ngram(seq, K, **kw), (seq, K, kw)
