"""The verifier side of the link with a fake target and link: a greedy row whose speculation
arrived without q (an exchange with no sampling rows) is verified correctly next to a sampled row;
only the cache source records lookups (the jit source of a separate-draft SD has no cache); with
the cache source the verifier takes a hit from its mirror and a local fallback without waiting
for a SPEC."""

import pytest
import torch

from ssdlib.distributed.protocol import CacheRows, Choice, Outcome, Speculation
from ssdlib.engine.leader.sequence import Request, Sequence
from ssdlib.engine.leader.speculation_source import CacheSource, JitSource
from ssdlib.engine.leader.verifier import LinkVerifier, SpecInHand
from ssdlib.sampling import SamplingParams
from ssdlib.speculative.acceptance import QKind
from ssdlib.speculative.rng import RowStream

K, V = 3, 7


class FakeTarget:
    """Target whose argmax is always token 2 (so a speculation of 2s is fully accepted)."""

    def forward(self, ids, positions, slots, logits_index=None):
        logits = torch.zeros(ids.shape[0], ids.shape[1], V)
        logits[..., 2] = 10.0
        return logits


class FakeLink:
    vocab_size = V
    failed = overlap = None  # a healthy link of ranks

    def __init__(self, cache: CacheRows | None = None):
        self.sent: list[Outcome] = []
        self.cache = cache  # what each CACHE brings
        self.specs = self.caches = self.qs = 0  # SPEC tokens, CACHEs and q received
        self.posted = 0  # CACHE receives posted (during the verify forward)

    def send_outcome(self, msg: Outcome):
        self.sent.append(msg)

    def recv_spec_tokens(self, b):
        self.specs += 1
        return Speculation(torch.full((b, K), 2), torch.zeros(b, dtype=torch.int64), None)

    def recv_q(self, b):
        self.qs += 1
        return torch.full((b, K, V), 1.0 / V)

    def post_cache(self, b):
        assert self.posted == self.caches, "a CACHE receive posted twice"
        self.posted += 1

    def recv_cache(self, b):
        self.caches += 1
        if self.cache is None:  # nothing built: every row misses (with jit)
            return CacheRows([False] * b, [0] * b, [[]] * b, [[]] * b, [[]] * b)
        return self.cache


def _greedy_and_sampled(ver):
    g = Sequence(Request(0, [1, 1], SamplingParams(max_new_tokens=50)), 0, [], None, "cpu")
    s = Sequence(Request(1, [1, 1], SamplingParams(max_new_tokens=50, temperature=1.0, seed=0)),
                 1, [], None, "cpu")
    for q in (g, s):
        q.commit([2])
    # from a greedy-only exchange, then from a sampling one
    ver.spec[0] = SpecInHand([2] * K, int(QKind.DENSE), None, "cache")
    ver.spec[1] = SpecInHand([2] * K, int(QKind.DENSE), torch.full((K, V), 1.0 / V),
                             "jit")
    return g, s


def _verifier(link, source_cls) -> LinkVerifier:
    return LinkVerifier(FakeTarget(), link, K, torch.device("cpu"), source_cls(K, V))


@pytest.mark.parametrize("source", [CacheSource, JitSource])
def test_greedy_row_without_q_next_to_sampled_row(source):
    link = FakeLink()
    ver = _verifier(link, source)
    g, s = _greedy_and_sampled(ver)
    ver.step([g, s])
    assert g.tokens[-(K + 1):] == [2] * (K + 1)  # all K accepted + bonus, as greedy AR would
    msg = link.sent[-1]
    assert msg.slots == [0, 1] and msg.accepted[0] == K and msg.active == [True, True]
    assert msg.sampling  # the sampled row is still running: the answer must carry q
    assert ("lookups" in g.metrics) == (source is CacheSource)
    # each round's accepted tokens are kept by where its speculation came from
    assert g.metrics["accepted_by_source"] == {"cache": [1, K]}
    assert list(s.metrics["accepted_by_source"]) == ["jit"]
    assert ver.replies.q_slots == [0, 1] and link.qs == 0  # q is taken with the next verify
    assert ver.spec[1].q is None
    ver.step([g, s])
    assert link.qs == 1  # taken during that verify (and the next one is due)
    assert ver.replies.q_slots == [0, 1] and ver.spec[1].q is None


def _two_greedy(ver):
    rows = [Sequence(Request(i, [1, 1], SamplingParams(max_new_tokens=50)), i, [], None, "cpu")
            for i in (0, 1)]
    for q in rows:
        q.commit([2])
        ver.spec[q.slot] = SpecInHand([2] * K, int(QKind.DENSE), None, "cache")
    ver.source.streams = {q.slot: RowStream.from_seed(0, q.slot) for q in rows}
    return rows


def test_cache_source_answers_from_its_mirror_without_a_spec():
    """Both rows accept all K (outcome (K, 2)): row 0's pushed cache has that outcome in branch
    1 (a hit: its tokens, no SPEC); row 1's has not, and its fallback is n-gram (drawn here)."""
    cache = CacheRows([True, True], [1, 1], [[0, K], [0, 1]], [[4, 2], [4, 2]],
                      [[[9, 9, 9], [5, 6, 4]], [[1, 1, 1], [3, 3, 3]]])
    link = FakeLink(cache)
    ver = _verifier(link, CacheSource)
    rows = _two_greedy(ver)
    ver.replies.cache_slots = [0, 1]  # the CACHE pushed after the last exchange
    ver.step(rows)
    # nothing waited for but the CACHE, whose receive was posted during the verify forward
    assert link.posted == link.caches == 1 and link.specs == 0
    msg = link.sent[-1]
    assert msg.choice == [int(Choice.CACHE), int(Choice.LOCAL)] and msg.arg[0] == 1
    assert msg.tokens[0] == [5, 6, 4] and ver.spec[0].tokens == [5, 6, 4]
    assert ver.spec[0].source == "cache" and rows[0].metrics["hits"] == 1
    # row 1 (tokens [1, 1, 2, 2, 2, 2, 2]): the suffix recurs, n-gram proposes its continuation
    assert msg.arg[1] == int(QKind.ONEHOT) and msg.tokens[1] == [2, 2, 2]
    assert ver.spec[1].source == "ngram" and ver.spec[1].tokens == msg.tokens[1]
    assert msg.spec_parts() == (False, False) and ver.replies.cache_slots == [0, 1]
    # the next round: nothing cached for its outcome and the CACHE names jit -> a SPEC
    link.cache = CacheRows([True, False], [0, 0], [[0, 0], [0, 0]], [[0, 0], [0, 0]],
                           [[[0] * K] * 2] * 2)
    ver.step(rows)
    assert link.posted == link.caches == 2 and link.specs == 1
    assert link.sent[-1].choice == [int(Choice.JIT)] * 2
    assert ver.spec[0].source == ver.spec[1].source == "jit"
