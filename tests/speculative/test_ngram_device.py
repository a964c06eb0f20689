"""The device n-gram proposal (chained rounds' fallback for a miss) against the host rule it
copies (propose_ngram, the reference), on random and repetitive sequences."""

import random

import torch

from ssdlib.speculative.ngram import propose_ngram, propose_ngram_device


def test_device_ngram_matches_the_host_rule():
    rng = random.Random(0)
    H, K = 40, 4
    seqs = []
    for _ in range(300):
        L = rng.randint(1, H)
        vocab = rng.choice([2, 3, 5, 50])  # small vocabularies repeat
        seqs.append([rng.randrange(vocab) for _ in range(L)])
    seqs += [[7], [7, 7], [1, 2, 1], [1, 2, 3, 1, 2], [5] * H]
    hist = torch.full((len(seqs), H), 99, dtype=torch.int64)  # past each row's end: junk
    for i, s in enumerate(seqs):
        hist[i, :len(s)] = torch.tensor(s)
    lengths = torch.tensor([len(s) for s in seqs])
    tokens, found = propose_ngram_device(hist, lengths, K)
    n_found = 0
    for i, s in enumerate(seqs):
        want = propose_ngram(s, K)
        assert bool(found[i]) == (want is not None), s
        if want is not None:
            n_found += 1
            assert tokens[i].tolist() == want, (s, tokens[i].tolist(), want)
        else:
            assert tokens[i].tolist() == [0] * K
    assert 0 < n_found < len(seqs)
