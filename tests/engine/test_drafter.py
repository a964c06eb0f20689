"""The draft's proposals against a plain reference (its own greedy continuation, by full forwards
over the committed tokens): after a prefill, after rounds it skipped (adaptive K = 0: caught up
before the next proposal, in several forwards for a long gap), for a row never fed (its prompt
in one forward), and rounds that accept some drafts and not others (the chain feeds a seen
token again)."""

import random

import pytest
import torch

from ssdlib.engine.drafter import CATCH_UP_QUERIES, Drafter
from ssdlib.engine.runner.model_runner import ModelRunner
from ssdlib.loading import load_checkpoint
from ssdlib.sampling import SamplingParams
from ssdlib.speculative.rng import RowStream
from tests.draft_helpers import checkpoint_logits

K = 3


class Row:
    """What a Drafter reads of a sequence."""

    def __init__(self, slot: int, tokens: list[int]):
        self.slot, self.tokens = slot, tokens
        self.params = SamplingParams()
        self.stream = RowStream.from_seed(0, slot)


def reference(ck, tokens: list[int], k: int, max_positions: int = 256) -> list[int]:
    out = []
    for _ in range(k):
        logits = checkpoint_logits(ck, torch.tensor([tokens + out]), max_positions=max_positions)
        out.append(int(logits[0, -1].argmax()))
    return out


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    from tests.tiny import make_tiny_llama

    path = make_tiny_llama(str(tmp_path_factory.mktemp("drafter")), "gqa", scale=2.0)
    return load_checkpoint(path)


def test_proposals_after_skipped_rounds_equal_the_reference(draft):
    runner = ModelRunner(draft, None, torch.device("cpu"), torch.float32, 2, 200)
    drafter = Drafter(runner, draft.config.vocab_size, draws=K)
    rng = random.Random(0)
    rows = [Row(0, [5, 6, 7, 8]), Row(1, [9, 10])]
    drafter.prefill(rows[:1])
    drafter.reset(1)  # row 1's prompt is fed by its first proposal
    # rounds: K = 0 stretches (one longer than a catch-up forward holds), then proposals
    plan = [1, 0, 0, 0, 1, 1] + [0] * (CATCH_UP_QUERIES + 5) + [1, 1]
    counters = []
    for propose in plan:
        if not propose:  # an AR step: one token a row, no draft work
            drafter.skip(rows)
            for r in rows:
                r.tokens.append(rng.randrange(draft.config.vocab_size))
            counters.append([r.stream.counter for r in rows])
            continue
        tokens, _ = drafter.propose(rows, K, want_q=False)
        for r, toks in zip(rows, tokens.tolist()):
            assert toks == reference(draft, r.tokens, K)
        accepted = [rng.randrange(K + 1) for _ in rows]  # some rounds accept all, some not
        for r, toks, a in zip(rows, tokens.tolist(), accepted):
            r.tokens += toks[:a] + [rng.randrange(draft.config.vocab_size)]
        drafter.after_commit(rows, accepted, K)
    # a skipped round gives up a proposal's draws, as a drafting one would
    assert counters[1][0] - counters[0][0] == K
    assert not drafter.lagging


@pytest.fixture(scope="module")
def windowed_draft(tmp_path_factory):
    from tests.tiny import make_tiny_llama

    path = make_tiny_llama(str(tmp_path_factory.mktemp("windowed")), "gqa", scale=2.0,
                           sliding_window=128, max_position_embeddings=1024)
    return load_checkpoint(path)


def test_a_windowed_prefill_feeds_only_what_later_steps_read(windowed_draft):
    """A prompt longer than the window's reach (2 layers x 127 positions) is fed from
    ``first_read`` on: the KV that later steps read equals a prefill of every token's, positions
    before it stay unfed, and the proposals equal the reference (the full forward) after the
    prefill and after rounds skipped past the reach (the catch-up also starts within it)."""
    ck = windowed_draft
    assert ck.config.context_reach == 2 * 127
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(3, 90, (400,), generator=g).tolist()
    full = ModelRunner(ck, None, torch.device("cpu"), torch.float32, 2, 900)
    trimmed = ModelRunner(ck, None, torch.device("cpu"), torch.float32, 2, 900)
    full.cache.k.zero_()
    trimmed.cache.k.zero_()
    with torch.inference_mode():
        full.forward(torch.tensor([tokens]), torch.arange(400).view(1, -1), torch.tensor([0]))
    drafter = Drafter(trimmed, ck.config.vocab_size, draws=K)
    row = Row(0, list(tokens))
    drafter.reset(0)
    drafter.prefill([row])
    start = drafter.first_read(400)
    assert start == 400 - 2 - 254 and drafter.valid[0] == 400
    read = slice(400 - 2 - 127, 400)  # every position a query from 398 on sees
    torch.testing.assert_close(trimmed.cache.k[:, 0, :, read], full.cache.k[:, 0, :, read],
                               atol=1e-5, rtol=1e-5)
    assert trimmed.cache.k[:, 0, :, :start].abs().sum() == 0  # never fed
    tokens_d, _ = drafter.propose([row], K, want_q=False)
    assert tokens_d[0].tolist() == reference(ck, row.tokens, K, max_positions=1024)
    # rounds at K = 0 past the reach: the catch-up feeds only the positions within it
    row.tokens += torch.randint(3, 90, (300,), generator=g).tolist()
    drafter.skip([row])
    tokens_d, _ = drafter.propose([row], K, want_q=False)
    assert tokens_d[0].tolist() == reference(ck, row.tokens, K, max_positions=1024)
